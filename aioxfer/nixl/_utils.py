"""``nixl._utils``: raw host buffers for NIXL's examples and tests.

Addresses are plain ints, as NIXL's own helpers return them; the memory comes
from libc (4096-byte aligned, as NIXL allocates it for O_DIRECT I/O).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["ba_buf", "free_passthru", "malloc_passthru", "verify_transfer"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]

_ALIGN = 4096


def malloc_passthru(size: int) -> int:
    """The address of ``size`` new bytes (uninitialised), 4096-byte aligned."""
    size = int(size)
    if size < 0:
        raise ValueError(f"malloc_passthru: negative size {size}")
    # aligned_alloc wants a multiple of the alignment.
    rounded = max(_ALIGN, (size + _ALIGN - 1) // _ALIGN * _ALIGN)
    addr = _libc.aligned_alloc(_ALIGN, rounded)
    if not addr:
        raise MemoryError(f"malloc_passthru({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    """Frees memory from malloc_passthru."""
    _libc.free(ctypes.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> None:
    """Fills ``size`` bytes at ``addr`` with the test pattern 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Asserts that ``size`` bytes at addr1 and addr2 are equal."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    assert a == b, f"transfer verification failed: {size} bytes at {addr1:#x} and {addr2:#x} differ"

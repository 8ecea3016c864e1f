"""rev34: what aioxfer.cuda reads from a DLPack tensor bounds the region it
registers; packed sub-byte types (DLPack 1.1: float4_e2m1fn, float6_e3m2fn)
take bits, not bytes, per element. Host-memory DLPack producers (kDLCPU, no
buffer protocol) register by pointer, so this runs without a GPU."""

from __future__ import annotations

import ctypes
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import within

from aioxfer import cuda

KDL_FLOAT4_E2M1FN = 17  # DLDataTypeCode (dlpack.h 1.1)
KDL_FLOAT6_E3M2FN = 16


class _DLManaged(ctypes.Structure):
    _fields_ = [("tensor", cuda._DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class PackedHostTensor:
    """A 1-D host tensor of ``n`` packed ``bits``-bit elements at ``ptr``, as a
    DLPack producer with no buffer protocol (as torch's CPU tensors)."""

    def __init__(self, ptr: int, n: int, bits: int, code: int) -> None:
        self._shape = (ctypes.c_int64 * 1)(n)
        self._m = _DLManaged()
        t = self._m.tensor
        t.data = ptr
        t.device.device_type = cuda.KDL_CPU
        t.ndim = 1
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))

    def __dlpack_device__(self) -> tuple[int, int]:
        return (cuda.KDL_CPU, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor", None)


@pytest.mark.parametrize("n, bits, code, nbytes", [
    (8192, 4, KDL_FLOAT4_E2M1FN, 4096),
    (7, 4, KDL_FLOAT4_E2M1FN, 4),      # 28 bits: the last byte half used
    (4096, 6, KDL_FLOAT6_E3M2FN, 3072),
    (4096, 8, 2, 4096),                 # whole bytes as before
])
def test_packed_sub_byte_tensors_are_sized_in_bits(n: int, bits: int, code: int,
                                                   nbytes: int) -> None:
    mem = cuda.inspect(PackedHostTensor(0x7F00_0000_0000, n, bits, code))
    assert mem == cuda.GpuMemory("host", 0x7F00_0000_0000, nbytes, False)


async def test_a_read_into_a_registered_fp4_tensor_stays_inside_it(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """8192 FP4 values (4096 bytes) followed by other data in one host
    allocation: the region was registered as 8192 bytes, and a read of "the
    whole region" from a file overwrote the neighbour."""
    agent = await make_agent("fp4")
    arena = ctypes.create_string_buffer(b"N" * 8192, 8192)  # tensor, then its neighbour
    tensor = PackedHostTensor(ctypes.addressof(arena), 8192, 4, KDL_FLOAT4_E2M1FN)
    region = agent.register(tensor)
    f = agent.register_file(tmp_path / "kv.bin", size=8192)
    await within(agent.write(agent.register(bytearray(b"F" * 8192))[0:8192], f[0:8192]))
    await within(agent.read(region[0 : region.nbytes], f[0 : region.nbytes]))
    assert arena.raw[:4096] == b"F" * 4096
    assert arena.raw[4096:] == b"N" * 4096, "the read wrote past the tensor"
    assert region.nbytes == 4096
    await agent.deregister(region)

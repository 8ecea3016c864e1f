"""``nixl._bindings``: NIXL's raw agent API, on aioxfer.

The names, argument forms, return values and exceptions are NIXL's (its
pybind11 module); behind them each ``nixlAgent`` is one ``aioxfer.Agent`` on
the runtime's loop (see ``_runtime``). How NIXL's objects map:

- a registered descriptor is one aioxfer Region over that address range
  (DRAM through a ctypes view, VRAM as ``aioxfer.cuda.DevicePointer``);
- agent metadata names the aioxfer agent's control address and the regions
  behind each registered descriptor; loading it connects (``Agent.connect``),
  which fetches the access keys over the authenticated connection;
- a prepared descriptor list is three numpy arrays (region, offset, length
  per descriptor); a transfer request is one READ/WRITE of SegmentLists (or of
  one Segment pair), posted again on each ``postXferReq``;
- notifications are aioxfer notifications (framed when empty or over 4 KiB).

The "UCX" backend is aioxfer's transports (shm on one host, tcp, verbs, cuda,
chosen per peer); "POSIX" answers ``queryMem`` for files.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import enum
import hmac
import inspect
import itertools
import operator
import os
import select
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from time import perf_counter as _perf_counter
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

import aioxfer
from aioxfer import (
    AccessDenied,
    ClosedResourceError,
    PeerLost,
    RegistrationError,
    RemoteSegment,
    Segment,
    SegmentList,
    Transfer,
    XferError,
    _cyx,
)
from aioxfer.auth import default_token, hmac_key
from aioxfer.log import escape
from aioxfer.names import check_name
from aioxfer.nixl import _telemetry, _wire
from aioxfer.nixl._runtime import runtime
from aioxfer.progress import ALONE_LATENCIES, ALONE_MAX_US, POLL_SLICE_US, check_mode
from aioxfer.submission import SPIN_ALONE_MAX

__all__ = [
    "BLK_SEG",
    "DEFAULT_COMM_PORT",
    "DRAM_SEG",
    "FILE_SEG",
    "HAVE_UCX_GPU_DEVICE_API",
    "NIXL_COST_ANALYTICAL_BACKEND",
    "NIXL_ERR_BACKEND",
    "NIXL_ERR_INVALID_PARAM",
    "NIXL_ERR_MISMATCH",
    "NIXL_ERR_NOT_ALLOWED",
    "NIXL_ERR_NOT_FOUND",
    "NIXL_ERR_NOT_POSTED",
    "NIXL_ERR_NOT_SUPPORTED",
    "NIXL_ERR_REPOST_ACTIVE",
    "NIXL_ERR_UNKNOWN",
    "NIXL_INIT_AGENT",
    "NIXL_IN_PROG",
    "NIXL_READ",
    "NIXL_SUCCESS",
    "NIXL_THREAD_SYNC_DEFAULT",
    "NIXL_THREAD_SYNC_NONE",
    "NIXL_THREAD_SYNC_RW",
    "NIXL_THREAD_SYNC_STRICT",
    "NIXL_WRITE",
    "OBJ_SEG",
    "VRAM_SEG",
    "nixlAgent",
    "nixlAgentConfig",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixl_cost_t",
    "nixl_mem_t",
    "nixl_status_t",
    "nixl_thread_sync_t",
    "nixl_xfer_op_t",
]

# ---------------------------------------------------------------- constants


class _NixlEnum(enum.IntEnum):
    """NIXL's pybind11 enums print as ``nixl_mem_t.DRAM_SEG`` (str, format,
    %s), where Python's IntEnum prints ``0``; they still compare and convert
    as ints here."""

    __str__ = enum.Enum.__str__

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int.__format__(self, spec)


class nixl_mem_t(_NixlEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG


class nixl_xfer_op_t(_NixlEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE


class nixl_status_t(_NixlEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
# NIXL has these statuses in C++ but not in its Python enum.
_ERR_REMOTE_DISCONNECT = -10
_ERR_CANCELED = -11
_ERR_NO_TELEMETRY = -12


class nixl_thread_sync_t(_NixlEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias of NONE, as in NIXL


NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


class nixl_cost_t(_NixlEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND
_COST_UNKNOWN = -1

NIXL_INIT_AGENT = ""
DEFAULT_COMM_PORT = 8888
# No GPU device API: the tests that need it skip, as on NIXL builds without it.
HAVE_UCX_GPU_DEVICE_API = False

_PLUGINS: dict[str, tuple[dict[str, str], list[str]]] = {
    # NIXL's POSIX defaults, accepted: aioxfer's file transport chooses its
    # own I/O (io_uring for O_DIRECT regions, a pread/pwrite pool otherwise).
    "POSIX": (
        {
            "use_posix_aio": "false",
            "use_uring": "false",
            "use_aio": "false",
            "kernel_queue_size": "256",
            "ios_pool_size": "65536",
        },
        ["DRAM_SEG", "FILE_SEG"],  # (NIXL's order)
    ),
    # S3-compatible object storage through aioxfer's object backend (offered
    # where its extra, obstore and aiohttp, is installed). NIXL's parameters:
    # bucket (else AWS_DEFAULT_BUCKET), endpoint_override (else
    # AWS_ENDPOINT_OVERRIDE), scheme, region, access_key, secret_key,
    # session_token; the AWS environment otherwise.
    "OBJ": ({}, ["DRAM_SEG", "OBJ_SEG"]),
    "UCX": (
        {
            "transports": "",  # "" = every aioxfer transport available (shm, tcp, verbs, cuda)
            "listen": "127.0.0.1:0",
            "num_threads": "0",
        },
        ["DRAM_SEG", "VRAM_SEG"],
    ),
}

# ---------------------------------------------------------------- errors


class nixlNotPostedError(Exception):
    pass


class nixlInvalidParamError(Exception):
    pass


class nixlBackendError(Exception):
    pass


class nixlNotFoundError(Exception):
    pass


class nixlMismatchError(Exception):
    pass


class nixlNotAllowedError(Exception):
    pass


class nixlRepostActiveError(Exception):
    pass


class nixlUnknownError(Exception):
    pass


class nixlNotSupportedError(Exception):
    pass


class nixlRemoteDisconnectError(Exception):
    pass


class nixlCancelledError(Exception):
    pass


class nixlNoTelemetryError(Exception):
    pass


_ERRORS: dict[int, tuple[type[Exception], str]] = {
    -1: (nixlNotPostedError, "NIXL_ERR_NOT_POSTED"),
    -2: (nixlInvalidParamError, "NIXL_ERR_INVALID_PARAM"),
    -3: (nixlBackendError, "NIXL_ERR_BACKEND"),
    -4: (nixlNotFoundError, "NIXL_ERR_NOT_FOUND"),
    -5: (nixlMismatchError, "NIXL_ERR_MISMATCH"),
    -6: (nixlNotAllowedError, "NIXL_ERR_NOT_ALLOWED"),
    -7: (nixlRepostActiveError, "NIXL_ERR_REPOST_ACTIVE"),
    -8: (nixlUnknownError, "NIXL_ERR_UNKNOWN"),
    -9: (nixlNotSupportedError, "NIXL_ERR_NOT_SUPPORTED"),
    -10: (nixlRemoteDisconnectError, "NIXL_ERR_REMOTE_DISCONNECT"),
    -11: (nixlCancelledError, "NIXL_ERR_CANCELED"),
    -12: (nixlNoTelemetryError, "NIXL_ERR_NO_TELEMETRY"),
}


# NIXL's startTime is steady_clock (CLOCK_MONOTONIC) µs: perf_counter's clock
# here, when it is that clock (one clock read per post instead of two).
_PERF_IS_STEADY = (time.get_clock_info("perf_counter").implementation
                   == time.get_clock_info("monotonic").implementation)

_STATUS_OF: dict[type[BaseException], int] = {
    cls: status for status, (cls, _) in _ERRORS.items()}


def _error(status: int, detail: str = "") -> Exception:
    """The exception NIXL raises for ``status``; its message starts with the
    status name, as NIXL's, followed by what went wrong."""
    cls, name = _ERRORS[status]
    # (Limited: a caller retrying a refused call in a loop, as a repost of a
    # handle still in flight, made ~12 k identical lines in 15 s; rev19 #6.)
    _log_limited(("E", status, detail), "E", detail or name)
    return cls(f"{name}: {detail}" if detail else name)


def _from_xfer_error(exc: BaseException, what: str) -> Exception:
    """An aioxfer failure as the NIXL exception a caller expects."""
    if isinstance(exc, PeerLost):
        return _error(_ERR_REMOTE_DISCONNECT, f"{what}: remote agent disconnected: {exc}")
    if isinstance(exc, ClosedResourceError) and exc.peer is not None:
        return _error(_ERR_REMOTE_DISCONNECT, f"{what}: connection closed: {exc}")
    if isinstance(exc, asyncio.CancelledError):
        return _error(_ERR_CANCELED, f"{what}: cancelled")
    if isinstance(exc, ValueError | TypeError | IndexError):
        return _error(-2, f"{what}: {exc}")
    if isinstance(exc, AccessDenied):
        return _error(-3, f"{what}: access denied (memory deregistered by its owner?): {exc}")
    return _error(-3, f"{what}: {exc}")


# NIXL's C++ core logs to stderr, glog style, at NIXL_LOG_LEVEL (default WARN);
# scripts grep it (NIXL's CI reads "MD listener is listening on port N").
_LOG_ORDER = {"TRACE": 0, "DEBUG": 0, "INFO": 1, "WARN": 2, "ERROR": 3, "FATAL": 4}
_LETTER_ORDER = {"I": 1, "W": 2, "E": 3}


def _log(letter: str, message: str) -> None:
    threshold = _LOG_ORDER.get(os.environ.get("NIXL_LOG_LEVEL", "WARN").upper(), 2)
    if _LETTER_ORDER.get(letter, 3) < threshold:
        return
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now))
    micros = int((now % 1) * 1e6)
    # (Escaped: messages carry what peers sent, agent names and refusal
    # texts, which must not end this line or forge another: aioxfer.log.)
    line = (f"{letter}{stamp}.{micros:06d} {threading.get_native_id():>7} "
            f"aioxfer_nixl] {escape(message)}\n")
    # (Never raises: it runs on the loop thread too, inside the notification
    # pump and the assembler's bounds, which a failure here would end. The
    # stream may be None, a process started with fd 2 closed, or whatever
    # object the application put there.)
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except Exception:
        pass


# What _log_limited saw: key -> [when its last line was written, lines
# dropped since]. Bounded: past _LIMITED_KEYS keys it starts over (at worst a
# few more lines).
_limited: dict[Any, list[float]] = {}
_limited_lock = threading.Lock()
_LIMITED_KEYS = 256
_LIMIT_PERIOD = 1.0  # s


def _log_limited(key: Any, letter: str, message: str | Callable[[int], str],
                 count: int = 1) -> None:
    """_log, at most one line per ``key`` and _LIMIT_PERIOD. A call stands
    for ``count`` events. With a str, the next line written says how many
    events were left out meanwhile; with a callable, the line is
    ``message(n)``, n the events of this call and of those held back (a
    count that is the line's subject: notifications dropped)."""
    now = time.monotonic()
    with _limited_lock:
        seen = _limited.get(key)
        if seen is not None and now - seen[0] < _LIMIT_PERIOD:
            seen[1] += count
            return
        if seen is None and len(_limited) >= _LIMITED_KEYS:
            _limited.clear()
        skipped, since = (0, now) if seen is None else (int(seen[1]), seen[0])
        _limited[key] = [now, 0]
    if not isinstance(message, str):
        message = message(skipped + count)
    elif skipped:
        message = (f"{message} ({skipped} more like this in the last {now - since:.1f} s "
                   f"not shown)")
    _log(letter, message)


# ---------------------------------------------------------------- descriptor lists


def _mem(value: Any) -> nixl_mem_t:
    try:
        return nixl_mem_t(int(value))
    except (TypeError, ValueError):
        raise TypeError(f"incompatible memory type: {value!r} (a nixl_mem_t)") from None


def _descs_array(descs: Any, width: int = 3) -> npt.NDArray[np.uint64]:
    """An (n, 3) uint64 array from an Nx3 uint64/int64 C-contiguous array."""
    if descs.ndim != 2 or descs.shape[1] != width:
        raise ValueError("descs must be a Nx3 numpy array")
    if descs.dtype != np.uint64 and descs.dtype != np.int64:
        raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
    if not descs.flags.c_contiguous:
        raise ValueError("descs must be a C-contiguous numpy array")
    return np.array(descs, dtype=np.uint64, copy=True) if descs.dtype == np.uint64 else (
        descs.astype(np.uint64))


def _tuple_row(desc: Any, n: int) -> tuple[Any, ...]:
    if not isinstance(desc, tuple):
        raise TypeError("Each descriptor must be a tuple when provided as a list")
    if len(desc) != n:
        raise ValueError(f"Each descriptor tuple must have exactly {n} elements")
    return desc


def _meta_bytes(meta: Any) -> bytes:
    if isinstance(meta, bytes):
        return meta
    if isinstance(meta, bytearray | memoryview):
        return bytes(meta)
    if isinstance(meta, str):
        return meta.encode()
    raise _cast_error(meta, "descriptor meta info is str or bytes")


_U64_MAX = 2**64 - 1


def _cast_error(v: Any, why: str) -> RuntimeError:
    """What NIXL's pybind11 layer raises for a descriptor field it cannot
    convert (a float, a string, a negative or too large number, meta info
    that is not text): RuntimeError with pybind11's words, our reason after."""
    return RuntimeError(f"Unable to cast Python instance of type {type(v)!r} to C++ type '?' "
                        f"(#define PYBIND11_DETAILED_ERROR_MESSAGES or compile in debug mode "
                        f"for details): {why}, not {v!r}")


def _u(v: Any) -> int:
    """A descriptor field as pybind11 converts it to uint64_t: ints (and
    numpy integers, bools) in range; numbers with __int__ but no __index__
    (numpy floats) through int(); never a Python float or a string (int()
    would truncate 1.5 to 1, or parse "12", silently: a wrong address)."""
    if type(v) is int:
        if 0 <= v <= _U64_MAX:
            return v
        raise _cast_error(v, "a descriptor field is an unsigned 64-bit integer")
    if isinstance(v, float | str | bytes | bytearray):
        raise _cast_error(v, "a descriptor field is an unsigned 64-bit integer")
    try:
        i = operator.index(v)
    except TypeError:
        try:
            i = int(v)
        except (TypeError, ValueError):
            raise _cast_error(v, "a descriptor field is an unsigned 64-bit integer") from None
    if not 0 <= i <= _U64_MAX:
        raise _cast_error(v, "a descriptor field is an unsigned 64-bit integer")
    return i


# Blocks one strided (Nx5) list may expand to: each costs ~50 bytes here
# (NIXL keeps the rows compressed); 2**24 blocks, ~800 MiB, bounds what a
# typo in a count can allocate.
_STRIDED_MAX_BLOCKS = 1 << 24


def _strided_rows(descs: Any) -> tuple[npt.NDArray[np.uint64] | None, npt.NDArray[np.uint64]]:
    """NIXL's strided descriptor rows (addr, len, devId, stride, count) as
    their spans (addr, bytes from the first block's start to the last
    block's end, devId), one per row, and the (n, 3) rows of their blocks,
    row by row: what indices of a list prepared from them count (None past
    _STRIDED_MAX_BLOCKS blocks: refused once the spans are found registered).

    Refused as NIXL 1.5.1 refuses them (observed): a dtype other than
    uint64/int64 ValueError; a count of 0 or a stride shorter than the block
    (overlapping blocks, stride 0 included) NOT_FOUND, like blocks outside
    registered memory (and, in _prepped, a span not inside one registered
    region, as NIXL checks the whole span: blocks in two regions, or across
    a gap, NOT_FOUND). A row whose span passes 2**64 is refused NOT_FOUND
    too: NIXL 1.5.1 accepts it (its arithmetic wraps: a row at 2**64 - 16 of
    two blocks prepared though nothing is registered there, an int64 row of
    stride -32 as blocks going down), and here the wrapped blocks would have
    been looked up where they landed (a negative stride inside a region was
    accepted, silently); no such row describes memory anyone registered."""
    if not (isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 5):
        raise ValueError("descs must be a Nx5 numpy array")
    if descs.dtype != np.uint64 and descs.dtype != np.int64:
        raise ValueError("descs must be a Nx5 numpy array of uint64 or int64")
    rows = descs.astype(np.uint64)  # (an int64 -32 is 2**64 - 32, as NIXL reads it)
    spans = np.empty((rows.shape[0], 4), dtype=np.uint64)
    total = 0
    for i, (addr, n, dev, stride, count) in enumerate(rows.tolist()):
        if count == 0 or stride < n:
            raise _error(-4, f"prepXferDlist: strided row {i}: {count} blocks of {n} bytes "
                             f"{stride} apart (a count of 0, or blocks that overlap)")
        span = (count - 1) * stride + n  # (Python ints: no wrap)
        if addr + span > _U64_MAX + 1:
            raise _error(-4, f"prepXferDlist: strided row {i}: {count} blocks of {n} bytes "
                             f"{stride} apart from {addr:#x} end past 2**64")
        spans[i] = (addr, span, dev, count)
        total += count
    if total > _STRIDED_MAX_BLOCKS:
        return None, spans
    counts = rows[:, 4].astype(np.int64)
    row_of = np.repeat(np.arange(rows.shape[0]), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    k = (np.arange(total, dtype=np.int64) - first).astype(np.uint64)
    out = np.empty((total, 3), dtype=np.uint64)
    out[:, 0] = rows[row_of, 0] + k * rows[row_of, 3]  # (no wrap: the spans fit)
    out[:, 1] = rows[row_of, 1]
    out[:, 2] = rows[row_of, 2]
    return out, spans


def _argument(value: Any, cls: type, what: str) -> None:
    """TypeError unless ``value`` is a ``cls``: what NIXL's binding raises
    (pybind11's "incompatible function arguments") for any other argument,
    a list of tuples, an array, None, or the other kind of descriptor list.
    Before, such arguments got through to fail as AttributeError or
    ValueError, which no NIXL caller catches for this."""
    if not isinstance(value, cls):
        raise TypeError(f"{what}(): incompatible function arguments: a "
                        f"{cls.__name__} is needed, not {type(value).__name__}")


def _unsigned_index(i: Any) -> int:
    """A list's index as NIXL's binding converts it (an unsigned int): a
    negative one, or no integer at all, is a TypeError there, not an
    IndexError or ValueError."""
    if isinstance(i, bool) or not isinstance(i, int | np.integer) or i < 0:
        raise TypeError(f"incompatible index {i!r}: an unsigned integer is needed")
    return int(i)


class _DList:
    """Shared parts of the descriptor lists: a memory type and an (n, 3)
    uint64 array (addr, len, devId). No ``__len__``: a list is always truthy,
    as NIXL's are."""

    __slots__ = ("_type", "_a")
    _type: nixl_mem_t
    _a: npt.NDArray[np.uint64]

    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return int(self._a.shape[0])

    def isEmpty(self) -> bool:
        return bool(self._a.shape[0] == 0)

    def _check_index(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self._a.shape[0]:
            raise IndexError(f"descriptor index {i} out of range ({self._a.shape[0]} descriptors)")
        return i

    def remDesc(self, i: int) -> None:
        i = self._check_index(i)
        self._a = np.delete(self._a, i, axis=0)

    def clear(self) -> None:
        self._a = np.zeros((0, 3), dtype=np.uint64)


class nixlXferDList(_DList):
    """Transfer descriptors: (addr, len, devId) of one memory type."""

    __slots__ = ()

    def __init__(self, type: Any, *args: Any, **kwargs: Any) -> None:  # noqa: A002 (NIXL's name)
        self._type = _mem(type)
        descs = kwargs.pop("descs", None)
        init_size = kwargs.pop("init_size", None)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if args:
            if len(args) > 1:
                raise TypeError("nixlXferDList(type, descs) or nixlXferDList(type, init_size)")
            if isinstance(args[0], np.ndarray | list):
                descs = args[0]
            else:
                init_size = args[0]
        if descs is not None:
            if isinstance(descs, np.ndarray):
                self._a = _descs_array(descs)
            elif isinstance(descs, list):
                rows = [_tuple_row(d, 3) for d in descs]
                self._a = np.array([(_u(a), _u(b), _u(c)) for a, b, c in rows],
                                   dtype=np.uint64).reshape(-1, 3)
            else:
                raise TypeError("descs is a list of (addr, len, devId) tuples or an Nx3 array")
        else:
            self._a = np.zeros((int(init_size or 0), 3), dtype=np.uint64)

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        row = self._a[self._check_index(_unsigned_index(i))]
        return int(row[0]), int(row[1]), int(row[2])

    def __setitem__(self, i: int, desc: tuple[int, int, int]) -> None:
        self._a[self._check_index(i)] = (_u(desc[0]), _u(desc[1]), _u(desc[2]))

    def addDesc(self, desc: tuple[int, int, int]) -> None:
        row = np.array([[_u(desc[0]), _u(desc[1]), _u(desc[2])]], dtype=np.uint64)
        self._a = np.concatenate([self._a, row])

    append = addDesc

    def index(self, desc: tuple[int, int, int]) -> int:
        row = np.array([_u(desc[0]), _u(desc[1]), _u(desc[2])], dtype=np.uint64)
        hits = np.flatnonzero((self._a == row).all(axis=1))
        if not hits.size:
            raise _error(-4, f"descriptor {desc} is not in the list")
        return int(hits[0])

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and self._type == other._type
            and np.array_equal(self._a, other._a)
        )

    __hash__ = None  # type: ignore[assignment]

    def print(self) -> None:
        # As NIXL: the list's line on stdout (its memory type as a number),
        # each descriptor a native INFO line (shown at NIXL_LOG_LEVEL=INFO).
        for a, n, d in self._a.tolist():
            _log("I", f"Desc ({a}, {n}) from devID {d}")
        print(f"DescList of mem type {int(self._type)}", flush=True)

    def __repr__(self) -> str:
        return f"<nixlXferDList {self._type.name} n={self._a.shape[0]}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_xfer, (int(self._type), self._a.tobytes()))


def _rebuild_xfer(mem: int, data: bytes) -> nixlXferDList:
    arr = np.frombuffer(data, dtype=np.uint64).reshape(-1, 3)
    return nixlXferDList(nixl_mem_t(mem), np.ascontiguousarray(arr))


class nixlRegDList(_DList):
    """Registration descriptors: (addr, len, devId, metaInfo) of one memory type."""

    __slots__ = ("_metas",)
    _metas: list[bytes]

    def __init__(self, type: Any, *args: Any, **kwargs: Any) -> None:  # noqa: A002
        self._type = _mem(type)
        descs = kwargs.pop("descs", None)
        init_size = kwargs.pop("init_size", None)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if args:
            if len(args) > 1:
                raise TypeError("nixlRegDList(type, descs) or nixlRegDList(type, init_size)")
            if isinstance(args[0], np.ndarray | list):
                descs = args[0]
            else:
                init_size = args[0]
        if descs is not None:
            if isinstance(descs, np.ndarray):
                self._a = _descs_array(descs)
                self._metas = [b""] * self._a.shape[0]
            elif isinstance(descs, list):
                rows = [_tuple_row(d, 4) for d in descs]
                self._a = np.array([(_u(a), _u(b), _u(c)) for a, b, c, _ in rows],
                                   dtype=np.uint64).reshape(-1, 3)
                self._metas = [_meta_bytes(m) for _, _, _, m in rows]
            else:
                raise TypeError("descs: a list of (addr, len, devId, meta) tuples or an Nx3 array")
        else:
            n = int(init_size or 0)
            self._a = np.zeros((n, 3), dtype=np.uint64)
            self._metas = [b""] * n

    def __getitem__(self, i: int) -> tuple[int, int, int, bytes]:
        i = self._check_index(_unsigned_index(i))
        row = self._a[i]
        return int(row[0]), int(row[1]), int(row[2]), self._metas[i]

    def __setitem__(self, i: int, desc: tuple[int, int, int, Any]) -> None:
        i = self._check_index(i)
        self._a[i] = (_u(desc[0]), _u(desc[1]), _u(desc[2]))
        self._metas[i] = _meta_bytes(desc[3])

    def addDesc(self, desc: tuple[int, int, int, Any]) -> None:
        row = np.array([[_u(desc[0]), _u(desc[1]), _u(desc[2])]], dtype=np.uint64)
        meta = _meta_bytes(desc[3])
        self._a = np.concatenate([self._a, row])
        self._metas.append(meta)

    append = addDesc

    def index(self, desc: tuple[int, int, int, Any]) -> int:
        row = np.array([_u(desc[0]), _u(desc[1]), _u(desc[2])], dtype=np.uint64)
        meta = _meta_bytes(desc[3])
        for i in np.flatnonzero((self._a == row).all(axis=1)).tolist():
            if self._metas[i] == meta:
                return int(i)
        raise _error(-4, f"descriptor {desc} is not in the list")

    def remDesc(self, i: int) -> None:
        i = self._check_index(i)
        self._a = np.delete(self._a, i, axis=0)
        del self._metas[i]

    def clear(self) -> None:
        super().clear()
        self._metas = []

    def trim(self) -> nixlXferDList:
        """The same descriptors without their meta info, as a transfer list."""
        return nixlXferDList(self._type, np.ascontiguousarray(self._a))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and self._type == other._type
            and np.array_equal(self._a, other._a)
            and self._metas == other._metas
        )

    __hash__ = None  # type: ignore[assignment]

    def print(self) -> None:
        for (a, n, d), m in zip(self._a.tolist(), self._metas, strict=True):
            meta = m.decode(errors="backslashreplace")
            _log("I", f"Desc ({a}, {n}) from devID {d}, Metadata: {meta}")
        print(f"DescList of mem type {int(self._type)}", flush=True)

    def __repr__(self) -> str:
        return f"<nixlRegDList {self._type.name} n={self._a.shape[0]}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_reg, (int(self._type), self._a.tobytes(), list(self._metas)))


def _rebuild_reg(mem: int, data: bytes, metas: list[bytes]) -> nixlRegDList:
    arr = np.frombuffer(data, dtype=np.uint64).reshape(-1, 3)
    out = nixlRegDList(nixl_mem_t(mem), np.ascontiguousarray(arr))
    out._metas = list(metas)
    return out


class nixlRemoteDList:
    """Remote descriptors (addr, len, devId, agent name) for NIXL's GPU
    device API, which aioxfer does not offer: the list exists, prep_mem_view
    refuses it."""

    __slots__ = ("_type", "_descs")

    def __init__(self, type: Any, *args: Any, **kwargs: Any) -> None:  # noqa: A002
        self._type = _mem(type)
        descs = kwargs.pop("descs", args[0] if args and isinstance(args[0], list) else None)
        init_size = kwargs.pop("init_size", args[0] if args and not isinstance(args[0], list)
                               else 0)
        if descs is not None:
            self._descs = [
                (_u(a), _u(b), _u(c), str(n)) for a, b, c, n in (_tuple_row(d, 4) for d in descs)
            ]
        else:
            self._descs = [(0, 0, 0, "")] * int(init_size or 0)

    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return len(self._descs)

    def isEmpty(self) -> bool:
        return not self._descs

    def __getitem__(self, i: int) -> tuple[int, int, int, str]:
        return self._descs[int(i)]

    def __setitem__(self, i: int, desc: tuple[int, int, int, str]) -> None:
        self._descs[int(i)] = (_u(desc[0]), _u(desc[1]), _u(desc[2]), str(desc[3]))

    def addDesc(self, desc: tuple[int, int, int, str]) -> None:
        self._descs.append((_u(desc[0]), _u(desc[1]), _u(desc[2]), str(desc[3])))

    append = addDesc

    def remDesc(self, i: int) -> None:
        del self._descs[int(i)]

    def clear(self) -> None:
        self._descs = []

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and self._type == other._type
                and self._descs == other._descs)

    __hash__ = None  # type: ignore[assignment]

    def print(self) -> None:
        for a, n, d, name in self._descs:
            _log("I", f"Desc ({a}, {n}) from devID {d}, Remote agent: {name}")
        print(f"DescList of mem type {int(self._type)}", flush=True)


# ---------------------------------------------------------------- config, telemetry


class nixlAgentConfig:
    """NIXL's agent configuration (the fields ``nixl_agent`` sets)."""

    def __init__(
        self,
        useProgThread: bool = False,
        useListenThread: bool = False,
        listenPort: int = 0,
        syncMode: nixl_thread_sync_t = NIXL_THREAD_SYNC_DEFAULT,
        num_workers: int = 1,
        pthrDelay: int = 0,
        lthrDelay: int = 100000,
        captureTelemetry: bool = False,
    ) -> None:
        self.useProgThread = bool(useProgThread)
        self.useListenThread = bool(useListenThread)
        self.listenPort = int(listenPort)
        self.syncMode = syncMode
        self.pthrDelay = int(pthrDelay)
        self.lthrDelay = int(lthrDelay)
        self.captureTelemetry = bool(captureTelemetry)
        self.etcdWatchTimeout = 5000000
        self._num_workers = int(num_workers)


class nixlXferTelemetry:
    """What a finished transfer request took: ``startTime`` (µs of the steady
    clock, CLOCK_MONOTONIC, at the post: NIXL's ``std::chrono::steady_clock``),
    ``postDuration`` and ``xferDuration`` (µs, from the post; a post under
    1 µs counts 1; the transfer time is the engine's, from post to
    completion, not from post to the poll that saw it as NIXL's),
    ``totalBytes``, ``descCount`` (descriptors requested, before any
    merging). All 0 while the request is in flight. ``backendName`` (the
    backend that ran it, "UCX", "POSIX", "OBJ"; "" while in flight) is what
    NIXL after 1.5.1 adds, and its API test checks."""

    __slots__ = ("_start", "_post", "_xfer", "_bytes", "_count", "_backend")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0,
                 totalBytes: int = 0, descCount: int = 0, backendName: str = "") -> None:
        self._start = startTime
        self._post = postDuration
        self._xfer = xferDuration
        self._bytes = totalBytes
        self._count = descCount
        self._backend = backendName

    @property
    def startTime(self) -> int:
        return self._start

    @property
    def postDuration(self) -> int:
        return self._post

    @property
    def xferDuration(self) -> int:
        return self._xfer

    @property
    def totalBytes(self) -> int:
        return self._bytes

    @property
    def descCount(self) -> int:
        return self._count

    @property
    def backendName(self) -> str:
        return self._backend

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self._start}, postDuration={self._post}, "
                f"xferDuration={self._xfer}, totalBytes={self._bytes}, descCount={self._count}, "
                f"backendName={self._backend!r})")


# ---------------------------------------------------------------- the agent

# How long a refused request waits to see whether its peer is leaving (its
# connections close just after its memory is released).
_GONE_GRACE = 0.05
_CONNECT_TIMEOUT = float(os.environ.get("AIOXFER_NIXL_CONNECT_TIMEOUT", "30"))
_RELEASE_TIMEOUT = 60.0
# How long releaseXferReq of a request in flight waits for the engine to
# confirm that the cancelled request no longer touches its memory: the
# aioxfer agent's stall_timeout (30 s, its default, which these agents use)
# bounds how long a connection may owe a record with nothing moving, plus a
# margin. Past it, the release raises and keeps the handle (nixl-api.md).
_STOP_TIMEOUT = float(os.environ.get("AIOXFER_NIXL_CANCEL_TIMEOUT", "35"))
# A poller asking again within this many seconds (of its last call, or of the
# start of the post it polls: a caller that checks as soon as it posted) is
# in a tight loop: it waits for the engine itself (see _wait_completion), or
# yields to the loop thread (see Runtime.yield_to_loop). Its first call then
# waits, as a coroutine's await of a transfer it just posted polls for it
# (Submission.eager), rather than only look (a whole call more per request).
_TIGHT_POLL = 0.0002
# How long such a poller waits at most: until the engine has a completion
# (any of the agent's; a bounded spin, then a sleep), or this long; for
# requests finished by a task on the loop thread (the engine's fd does not
# say), _TIGHT_WAIT.
_TIGHT_WAIT = 0.001
_ENGINE_WAIT = 0.005
# What an agent keeps of the notifications nobody has taken yet (getNotifs):
# NIXL keeps them all; we keep up to this many bytes of messages (each
# counted _NOTIF_COST more, for a store of many tiny ones), then drop the
# oldest, logged. The same bound as the assembler's partial messages.
_NOTIF_STORE_BYTES = _wire._MAX_HELD_BYTES
_NOTIF_COST = 64
_NOTIF_PUMP_PAUSE = 0.002  # s: see _pump_notifs
# A request that completed later than this many spins after its post, on
# _SPIN_MISSES posts running, is not spun for on its next posts, but for one
# in _SPIN_PROBE (see _wait_completion and _spin_wanted).
_SPIN_KEEP = 4
_SPIN_MISSES = 3
_SPIN_PROBE = 16
# How long the loop thread leaves the engine's fd to a poller that stopped
# asking: completions meanwhile wait for that poller's next call (or this long).
_LINGER = 0.02


# NIXL's states by status (NIXL_SUCCESS, NIXL_IN_PROG); failures raise.
_STATE_STR = ("DONE", "PROC")


class _Number:
    """A request number where xferState takes a handle (getXferStatus)."""

    __slots__ = ("_handle",)

    def __init__(self, value: int) -> None:
        self._handle = value


def _noop() -> None:
    pass


def _no_wait(max_us: int) -> bool:
    return False


def _spin_wanted(x: _Xfer) -> bool:
    """Whether a tight poller spins for request ``x`` before it sleeps: while
    its posts complete soon after they are made; once they have not, on
    _SPIN_MISSES posts running (a large request: the spin would only take a
    core from the engine's threads), only every _SPIN_PROBE-th wait, so that
    a small request that was late because the machine was busy (a wake-up
    stretched by others' load, the first post after a pause) is spun for
    again once it is not: without the probe, its later posts, slept for,
    looked as late as the wake-ups that took them, and it was never spun for
    again while the load lasted (a 4 KiB tcp READ then took 3-4 times as
    long as a coroutine's, which spins on every post)."""
    if x.spin:
        return True
    x.skipped += 1
    if x.skipped >= _SPIN_PROBE:
        x.skipped = 0
        return True
    return False


def _note_latency(x: _Xfer, seconds: float) -> None:
    """Folds one post's time to completion into x.lat (1/8 weight) and sets
    how long a tight poller spins for it (x.budget, when more than the
    engine's poll_us): for a request up to SPIN_ALONE_MAX (as the agent's
    spin_alone), ALONE_LATENCIES times that average, at most ALONE_MAX_US:
    what a coroutine awaiting it alone spins (aioxfer.progress says why 5,
    not 2: a spin's bound is wall-clock time, and a preempted spinner ran
    out of twice the average on a busy host). A completion stops the spin
    at once, so the larger bound only costs CPU for a late request. With
    poll_us alone, a tcp round trip longer than that (about two thread
    wake-ups) was slept for on the engine's fd: a wake-up per request more
    than a coroutine's await."""
    lat = x.lat
    x.lat = lat = seconds if not lat else lat + (seconds - lat) * 0.125
    if x.nbytes <= SPIN_ALONE_MAX:
        us = int(lat * (ALONE_LATENCIES * 1e6))
        x.budget = us if us < ALONE_MAX_US else ALONE_MAX_US


def _data_done(x: _Xfer) -> bool:
    """Whether the current post of ``x`` moved all of its data (its parts,
    for a request of several; runtime lock not needed: a look)."""
    fut = x.fut
    if fut is None:
        return False
    if type(fut) is not Transfer and x.parts:
        return all(p.done() for p in x.parts)
    return fut.done()


def _spin_outcome(x: _Xfer, soon: bool) -> None:
    """Records whether ``x``'s post completed within _SPIN_KEEP spins of its
    post (``soon``: spun for and caught, or slept for and woken in time)."""
    if soon:
        x.spin = True
        x.slow = 0
    elif x.slow < _SPIN_MISSES:
        x.slow += 1
        if x.slow == _SPIN_MISSES:
            x.spin = False
            x.skipped = 0


def _seconds(x: _Xfer, res: Any) -> float:
    """A finished request's transfer time: from its post to its completion."""
    if isinstance(res, float):  # (a request of several parts: when the last ended)
        return res - x.t0
    return float(res.seconds)  # a TransferResult: from its post, by the engine's clock


def _durations(x: _Xfer) -> tuple[int, int]:
    """A finished request's post and transfer durations in whole µs, as NIXL
    reports them: the post at least 1, the transfer at least the post."""
    post_us = max(1, round(x.post_s * 1e6))
    return post_us, max(post_us, round(x.xfer_s * 1e6))


def _segments(region: Any, offsets: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64],
              nbytes: int) -> SegmentList:
    """A SegmentList of ranges already checked against ``region`` (they come
    from prepared lists): made without SegmentList's own checks, which cost
    more than the rest of a request. ``offsets`` and ``lengths`` are
    contiguous uint64 arrays already, as its own (gathered from a prepared
    list's, or a shared read-only array of equal lengths)."""
    sl = SegmentList.__new__(SegmentList)
    sl.region = region
    sl.offsets = offsets
    sl.lengths = lengths
    sl.nbytes = nbytes
    return sl


def _name(value: Any) -> str:
    """Agent names come as str or bytes (add_remote_agent returns bytes)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode()
    if isinstance(value, str):
        return value
    raise TypeError(f"an agent name is str or bytes, not {type(value).__name__}")


def _payload(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"a notification is bytes or str, not {type(value).__name__}")


def _direct(x: _Xfer, msg: bytes) -> bool:
    """Whether a post of ``x`` with notification ``msg`` is one aioxfer call
    (x.post): none, a file's (ignored), or a WRITE's that fits one frame."""
    return x.post is not None and (not msg or x.file or (
        x.write and len(msg) <= _wire.NOTIF_MAX and not msg.startswith(_wire.NOTIF_MAGIC)))


def _handles(backends: Any) -> list[int]:
    if backends is None:
        return []
    if isinstance(backends, int):
        return [backends]
    return [int(b) for b in backends]


class _Backend:
    __slots__ = ("handle", "type", "params", "mems", "objects")

    def __init__(self, handle: int, type_: str, params: dict[str, str], mems: list[str]) -> None:
        self.handle = handle
        self.type = type_
        self.params = params
        self.mems = mems
        self.objects: Any = None  # "OBJ": the bucket's aioxfer ObjectRegion


def _objects_available() -> bool:
    """aioxfer's object backend can run here (its "objects" extra is installed)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("obstore", "aiohttp"))


class _Reg:
    """One registered descriptor and the aioxfer region behind it."""

    __slots__ = ("mem", "addr", "nbytes", "dev", "meta", "region", "name", "backends")

    def __init__(self, mem: nixl_mem_t, addr: int, nbytes: int, dev: int, meta: bytes,
                 region: aioxfer.Region, backends: list[int]) -> None:
        self.mem = mem
        self.addr = addr
        self.nbytes = nbytes
        self.dev = dev
        self.meta = meta
        self.region = region
        self.name = region.name
        self.backends = backends


class _Table:
    """Registered ranges of one agent (ours or a peer's), searchable by
    address: what a descriptor list is checked and mapped against."""

    __slots__ = ("starts", "ends", "devs", "mems", "order", "objs")

    def __init__(self, rows: list[tuple[int, int, int, int, Any]]) -> None:
        # rows: (mem, addr, nbytes, dev, obj)
        rows = sorted(rows, key=lambda r: r[1])
        self.mems = np.array([r[0] for r in rows], dtype=np.int64)
        self.starts = np.array([r[1] for r in rows], dtype=np.uint64)
        self.ends = np.array([r[1] + r[2] for r in rows], dtype=np.uint64)
        self.devs = np.array([r[3] for r in rows], dtype=np.uint64)
        self.objs = [r[4] for r in rows]

    def locate(self, mem: int, descs: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp] | None:
        """For each descriptor the index (into ``objs``) of a registered range
        of type ``mem`` and the same devId that contains it; None if any has none."""
        n = descs.shape[0]
        if not n:
            return np.zeros(0, dtype=np.intp)
        if not len(self.objs):
            return None
        addr = descs[:, 0]
        end = addr + descs[:, 1]
        dev = descs[:, 2]
        pos = np.searchsorted(self.starts, addr, side="right").astype(np.intp) - 1
        safe = np.maximum(pos, 0)
        ok = (pos >= 0) & (self.ends[safe] >= end) & (self.devs[safe] == dev) & (
            self.mems[safe] == mem) & (end >= addr)
        if bool(ok.all()):
            return safe
        # Overlapping registrations: the nearest start may not be the one that
        # holds it; look at every range for the rest.
        out = safe.copy()
        for i in np.flatnonzero(~ok).tolist():
            a, e, d = int(addr[i]), int(end[i]), int(dev[i])
            hits = np.flatnonzero((self.starts <= a) & (self.ends >= e) & (self.devs == d)
                                  & (self.mems == mem))
            if not hits.size or e < a:
                return None
            out[i] = hits[0]
        return out


class _Remote:
    """A peer agent whose metadata was loaded."""

    __slots__ = ("name", "address", "incarnation", "peer", "ranges", "table", "gen", "removed")

    def __init__(self, name: str) -> None:
        self.name = name
        self.address = ""
        self.incarnation = 0
        self.peer: aioxfer.Peer | None = None
        self.ranges: dict[str, _wire.RegionMD] = {}
        self.table: _Table | None = None
        self.gen = 0  # bumped when removed or reconnected: prepared lists go stale
        self.removed = False

    def get_table(self) -> _Table:
        if self.table is None:
            # Only ranges the peer's own metadata (fetched over its
            # authenticated connection) vouches for: the region of that name
            # at that address and size. Metadata blobs (a listener's reply,
            # the central store, an application's) are not authenticated: a
            # forged range must resolve to nothing, never aim our transfers
            # at another of the peer's regions.
            known = self.peer.regions if self.peer is not None else {}
            self.table = _Table([(r.mem, r.addr, r.nbytes, r.dev, r.name)
                                 for r in self.ranges.values()
                                 if (rr := known.get(r.name)) is not None
                                 and rr.addr == r.addr and rr.nbytes == r.nbytes])
        return self.table


class _Prepped:
    """A prepared descriptor list: per descriptor the index of its region in
    ``objs`` (local: _Reg; remote: region names), its offset and length."""

    __slots__ = ("remote", "loopback", "mem", "objs", "ridx", "offs", "lens", "gen", "resolved",
                 "n", "single", "uniform", "_uniform_lens")

    def __init__(self, remote: _Remote | None, loopback: bool, mem: nixl_mem_t, objs: list[Any],
                 ridx: npt.NDArray[np.intp], offs: npt.NDArray[np.uint64],
                 lens: npt.NDArray[np.uint64], gen: int) -> None:
        self.remote = remote
        self.loopback = loopback
        self.mem = mem
        self.objs = objs
        self.ridx = ridx
        self.offs = offs
        self.lens = lens
        self.gen = gen
        self.resolved: dict[int, Any] = {}
        self.n = int(ridx.shape[0])
        # The region of every descriptor when it is one (the common case):
        # requests from this list then need no grouping.
        self.single = int(ridx[0]) if self.n and bool((ridx == ridx[0]).all()) else -1
        # The length of every descriptor when it is one (KV blocks), else -1.
        self.uniform = int(lens[0]) if self.n and bool((lens == lens[0]).all()) else -1
        self._uniform_lens: dict[int, npt.NDArray[np.uint64]] = {}

    def uniform_lens(self, k: int) -> npt.NDArray[np.uint64]:
        """``k`` lengths of a uniform list: one read-only array per count,
        shared by its requests (the engines only read lengths)."""
        out = self._uniform_lens.get(k)
        if out is None:
            if len(self._uniform_lens) > 64:
                self._uniform_lens.clear()
            out = np.full(k, self.uniform, dtype=np.uint64)
            out.flags.writeable = False
            self._uniform_lens[k] = out
        return out

    @property
    def is_local(self) -> bool:
        return self.remote is None and not self.loopback


class _Xfer:
    """A transfer request: its pairs of segment lists, reposted on each post."""

    __slots__ = ("op", "peer", "remote", "gen", "groups", "notif", "ndesc", "nbytes", "fut",
                 "t0", "start_us", "post_s", "xfer_s", "last_poll", "backend",
                 "file", "one", "write", "post", "objects", "parts", "frames", "notifying",
                 "failed", "spin", "slow", "skipped", "plain", "lat",
                 "budget", "prep", "tail", "gone")

    def __init__(self, op: int, peer: aioxfer.Peer | None, remote: _Remote | None, gen: int,
                 groups: list[tuple[Any, Any]], notif: bytes, ndesc: int, nbytes: int,
                 backend: int, file: bool) -> None:
        self.op = op
        self.peer = peer
        self.remote = remote
        self.gen = gen
        self.groups = groups
        self.notif = notif
        self.ndesc = ndesc
        self.nbytes = nbytes
        self.fut: asyncio.Future[Any] | None = None
        self.t0 = 0.0
        self.start_us = 0
        self.post_s = 0.0
        self.xfer_s = -1.0
        self.last_poll = 0.0
        self.backend = backend
        self.file = file
        # One region pair: posted by one aioxfer call (the common case),
        # post(*one); post is None where the request needs more than that call.
        self.one: tuple[Any, Any] = groups[0] if len(groups) == 1 else ((), ())
        self.write = op == NIXL_WRITE
        self.post: Any = None  # agent.write or agent.read where that call is the request
        self.objects = False  # to or from the "OBJ" backend's bucket
        # A request of several aioxfer calls (see _post): the current post's
        # parts, its notification frames, whether they are being sent.
        self.parts: list[Any] = []
        self.frames: list[bytes] = []
        self.notifying = False
        self.failed: Any = None  # the failed post already counted in telemetry
        # Whether a tight poller spins for it first (see _spin_wanted): not
        # once _SPIN_MISSES posts running took far longer than the spin (slow
        # counts them), until one does not; then every _SPIN_PROBE-th wait
        # spins anyway (skipped counts the waits since the last spin).
        self.spin = True
        self.slow = 0
        self.skipped = 0
        # Its posts' average time to completion when a tight poller waited
        # for them (seconds; 0.0: none yet), and, for a small one, how long
        # a tight poller spins for it (µs; 0: the engine's poll_us): see
        # _note_latency.
        self.lat = 0.0
        self.budget = 0
        # Whether a repost without a notification of its own is one call
        # of post with nothing to notify (or a file's, which ignores it), on
        # an agent without telemetry: the hot path of xferTransfer, decided
        # once, not on each repost.
        self.plain = False
        # That repost prepared (Agent.prepare), where the agent could: its
        # post, one compiled call (else post(*one), then a flush).
        self.prep: Any = None
        # The aioxfer transfer a task of the request posted (_framed_write,
        # _object_io: x.fut is that task): what a release waits for.
        self.tail: Any = None
        # Whether the failed post (failed) was refused because its peer left
        # (_denied_or_gone, decided once per post: every later answer the same).
        self.gone = False


_MAX_INDEX = np.maximum.reduce
# A request over several region pairs with at most this many descriptors per
# pair on average is posted as one aioxfer request of Segment lists (a Python
# step per descriptor); with more, as a SegmentList pair per region pair (a
# request per pair, each vectorised).
_SMALL_GROUPS = 8


def _indices(value: Any, what: str, n: int) -> npt.NDArray[np.int64]:
    """Request indices as int64 (NIXL's binding takes any numeric 1-D array,
    cast to 32-bit ints, or a list of int), each checked to be in [0, n)."""
    if type(value) is np.ndarray:
        if value.ndim != 1:
            raise ValueError("indices numpy array must be 1D")
        kind = value.dtype.kind
        idx = (value.astype(np.int64, copy=False) if kind in "iu"
               else value.astype(np.int32).astype(np.int64))  # floats, as NIXL's cast
    elif isinstance(value, np.ndarray):
        return _indices(np.asarray(value), what, n)
    else:
        arr = np.array(value) if type(value) is list else None
        if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
            idx = arr.astype(np.int64, copy=False)
        else:
            try:
                idx = np.fromiter((int(v) for v in value), dtype=np.int64)
            except (TypeError, ValueError):
                raise TypeError(f"{what} indices are a list of int or a 1-D numpy "
                                f"array") from None
    # One reduction: a negative index, seen as unsigned, is out of range too.
    if idx.size and int(_MAX_INDEX(idx.view(np.uint64))) >= n:
        i = int(np.flatnonzero((idx < 0) | (idx >= n))[0])
        raise _error(-2, f"makeXferReq: {what} index out of range at index {i} with "
                         f"value {int(idx[i])}")
    return idx


# Request, list and backend handles are numbered process-wide, as NIXL's
# (pointers) are unique in a process: a handle of another agent must never
# name one of this agent's own.
_HANDLE_SEQ = itertools.count(0x1000)


class nixlAgent:
    """NIXL's agent (the raw binding API), over one aioxfer.Agent."""

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not isinstance(name, str):
            raise TypeError(f"agent name must be str, not {type(name).__name__}")
        if not name:
            raise ValueError("agent name must not be empty")
        # (aioxfer's rule for names, checked here rather than when the UCX
        # backend makes the aioxfer agent: the name is in metadata before.)
        check_name(name)
        self._name = name
        self._rt = runtime()
        self._config = config
        # NIXL's telemetry (see _telemetry): the switch, and the agent's
        # events and their sink when on.
        self._telemetry = _telemetry.requested(bool(config.captureTelemetry), _log)
        self._tel: _telemetry.Telemetry | None = None
        self._tel_events = False
        self._agent: aioxfer.Agent | None = None
        # The agent's flush() and poll() once it exists (called with the lock
        # held, from any thread: the lock makes it the loop thread's turn).
        self._flush_fn: Callable[[], None] = _noop
        self._poll_fn: Callable[[], None] = _noop
        self._fd = -1
        # The agent's bounded busy-poll, then a poll of what came
        # (Agent.wait_poll: spinning up to that many µs without the GIL; 0:
        # a look; whether any came), and how a tight poller waits (see
        # _wait_completion): spins up to _spin_us first ("adaptive"; 0:
        # "sleep"), or only spins ("poll").
        self._wait_poll: Callable[[int], bool] = _no_wait
        self._spin_us = 0
        self._spin_only = False
        # What _cyx.nixl_state (xferState) reads of the fields above per
        # check, resolved once: set when the agent starts, None when closed.
        self._ns: _cyx.NixlCache | None = None
        self._transports: tuple[str, ...] | None = None
        self._backends: dict[int, _Backend] = {}
        self._backend_of: dict[str, int] = {}  # the first backend of each type
        self._handle_seq = _HANDLE_SEQ
        self._regs: list[_Reg] = []
        self._reg_seq = itertools.count(1)
        self._table: _Table | None = None
        self._remotes: dict[str, _Remote] = {}
        # agent name -> [its loads' lock, loads waiting or running]
        self._loading: dict[str, list[Any]] = {}
        self._self_peer: aioxfer.Peer | None = None
        self._dlists: dict[int, _Prepped] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._assembler = _wire.NotifAssembler(_notif_dropped)
        # Messages taken from the aioxfer agent's queue, not yet handed to
        # getNotifs (rev19 #2): see _pump_notifs. (sender, message), in
        # arrival order; _notif_held bounds them (_NOTIF_STORE_BYTES).
        self._notif_store: collections.deque[tuple[str, bytes]] = collections.deque()
        self._notif_held = 0
        self._last_empty_notif = 0.0
        self._last_md_poll = 0.0
        self._server: asyncio.AbstractServer | None = None
        self._listen_slots = _ListenSlots()  # listener connections being served
        self._listen_log = _ListenLog()
        # The token listener requests prove (_wire.LISTEN_NONCE), resolved
        # once: the aioxfer agent's, which _start_agent gives it.
        self._token: bytes | None = None
        # The listener's requests being served and sent (fetch, push,
        # invalidate): cancelled on close, with their sockets.
        self._bg: set[asyncio.Task[Any]] = set()
        # The central store's publishes and invalidates not done yet: close
        # lets them finish (see _close_at_exit).
        self._store_writes: set[asyncio.Task[Any]] = set()
        self.listen_port = 0
        endpoints = os.environ.get("NIXL_ETCD_ENDPOINTS")
        if endpoints is not None and not endpoints.strip():
            # As NIXL's agent does (set but empty is a configuration error).
            raise RuntimeError("Config parameter 'NIXL_ETCD_ENDPOINTS' needs non-empty value")
        self._store = _CentralStore(endpoints, name) if endpoints else None
        self._closed = False
        if self._telemetry:
            self._tel = _telemetry.Telemetry(name, self._rt.loop, _log)
        # Whether finished requests are events to write (a telemetry sink).
        self._tel_events = self._tel is not None and self._tel.ring is not None
        if config.useListenThread:
            # The key the listener's MACs use (auth.hmac_key: a scrypt, ~45
            # ms), derived here on the caller's thread, not on the loop's at
            # the first request (the aioxfer agent made below takes it cached).
            hmac_key(self._listen_token())
            try:
                self._rt.run(self._start_listener(int(config.listenPort)),
                             timeout=_CONNECT_TIMEOUT)
            except BaseException:
                if self._tel is not None:
                    self._rt.loop.call_soon_threadsafe(self._tel.close)
                raise
        self._rt.add_closer(self)

    def __repr__(self) -> str:
        return f"<nixlAgent {self._name!r} (aioxfer)>"

    # ------------------------------------------------------------ plugins and backends

    def getAvailPlugins(self) -> list[str]:
        return sorted(p for p in _PLUGINS if p != "OBJ" or _objects_available())

    def getPluginParams(self, type_: str) -> tuple[dict[str, str], list[str]]:
        if type_ not in self.getAvailPlugins():
            raise _error(-4, f"getPluginParams: plugin {type_!r} not found")
        params, mems = _PLUGINS[type_]
        return dict(params), list(mems)

    def getBackendParams(self, backend: int) -> tuple[dict[str, str], list[str]]:
        b = self._backends.get(int(backend))
        if b is None:
            raise _error(-4, f"getBackendParams: no backend handle {backend}")
        return dict(b.params), list(b.mems)

    def createBackend(self, type_: str, params: dict[str, str] | None = None) -> int:
        params = dict(params or {})
        if self._closed:  # (a new aioxfer agent here would never be closed)
            raise _error(-3, "createBackend: the agent is closed")
        if type_ not in self.getAvailPlugins():
            raise _error(-4, f"createBackend: unsupported backend '{type_}'")  # NIXL's words
        if any(b.type == type_ for b in self._backends.values()):
            raise _error(-2, f"createBackend: backend {type_} already created")
        effective = dict(_PLUGINS[type_][0])
        if type_ == "UCX":
            effective.update(self._start_agent(params))
        else:
            # POSIX and OBJ move data with the same aioxfer agent (its file
            # transport, its object backend): started here if UCX did not.
            if self._agent is None:
                self._start_agent({})
            effective.update({k: str(v) for k, v in params.items()})
        backend = _Backend(next(self._handle_seq), type_, effective, list(_PLUGINS[type_][1]))
        if type_ == "OBJ":
            backend.objects = self._register_objects(params)
        self._backends[backend.handle] = backend
        self._backend_of.setdefault(type_, backend.handle)
        return backend.handle

    def _register_objects(self, params: dict[str, str]) -> Any:
        """The bucket of an "OBJ" backend, as an aioxfer ObjectRegion."""
        bucket = params.get("bucket") or os.environ.get("AWS_DEFAULT_BUCKET")
        if not bucket:
            raise _error(-3, "createBackend OBJ: no bucket (the 'bucket' parameter or "
                             "AWS_DEFAULT_BUCKET)")
        endpoint = params.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_OVERRIDE")
        if endpoint and "://" not in endpoint:
            endpoint = f"{params.get('scheme', 'https')}://{endpoint}"
        kwargs = {k: v for k, v in (
            ("endpoint", endpoint),
            ("access_key_id", params.get("access_key")),
            ("secret_access_key", params.get("secret_key")),
            ("session_token", params.get("session_token")),
            ("region", params.get("region")),
        ) if v}
        agent = self._agent
        assert agent is not None
        try:
            with self._rt.locked():
                return agent.register_objects(f"s3://{bucket}", name=f"nixl-obj-{bucket}",
                                              **kwargs)
        except (XferError, ValueError, ImportError) as exc:
            raise _error(-3, f"createBackend OBJ: {exc}") from None

    def _start_agent(self, params: dict[str, str]) -> dict[str, str]:
        """The aioxfer agent behind the "UCX" backend, started on the loop
        (or, if POSIX started it, that one)."""
        if self._agent is not None:
            return {"transports": ",".join(self._agent.transports),
                    "listen": self._agent.address, "num_threads": params.get("num_threads", "0")}
        transports = _transports(params)
        listen = params.get("listen") or os.environ.get("AIOXFER_NIXL_LISTEN", "127.0.0.1:0")
        kwargs: dict[str, Any] = {"listen": listen}
        if transports:
            kwargs["transports"] = transports
        threads = int(params.get("num_threads", "0") or 0)
        if threads > 0:
            kwargs["copy_workers"] = min(threads, 16)
        try:
            progress = check_mode(params.get("progress")
                                  or os.environ.get("AIOXFER_NIXL_PROGRESS", "adaptive"))
            # The engine follows the mode (its tcp target polls briefly for a
            # peer's next request). The caller's thread polls
            # (check_xfer_state, get_new_notifs), so it is the one that spins:
            # the loop thread only sleeps ("sleep" before start: no Poller).
            # Its own bounded poll would hold the runtime lock the callers
            # need, on the rare rounds it wakes for, and its kick from a
            # caller's post would be a callback scheduled across threads for
            # nothing.
            agent = aioxfer.Agent(self._name, progress=progress, token=self._listen_token(),
                                  **kwargs)
            agent.progress = "sleep"
        except (XferError, ValueError, OSError) as exc:
            raise _error(-3, f"createBackend UCX: {exc}") from None
        try:
            self._rt.run(agent.start(), timeout=_CONNECT_TIMEOUT)
        except BaseException:
            self._rt.run(agent.aclose(), timeout=_CONNECT_TIMEOUT)
            raise
        self._agent = agent
        with self._rt.locked():
            self._track(self._rt.spawn(self._pump_notifs(agent.notifications)))
        self._flush_fn = agent.flush
        self._poll_fn = agent.poll
        self._fd = agent.fileno()
        # Agent.wait signals what its spin caught (for a caller that may not
        # poll): an eventfd write, then a read in the poll that follows. This
        # layer always polls after a hit, as the agent's own Poller does, so
        # it waits as that Poller does, with Agent.wait_poll: two system
        # calls fewer per request caught by a spin, and no Python frame
        # around the wait.
        self._wait_poll = agent.wait_poll
        self._spin_us = (0 if progress == "sleep" else agent.poll_us if progress == "adaptive"
                         else max(agent.poll_us, POLL_SLICE_US))
        self._spin_only = progress == "poll"
        self._ns = self._nixl_cache()
        self._transports = agent.transports
        return {"transports": ",".join(agent.transports), "listen": agent.address,
                "num_threads": str(threads)}

    def _backends_for(self, backends: Any, mem: nixl_mem_t, what: str) -> list[_Backend]:
        chosen = [self._backends[h] for h in _handles(backends) if h in self._backends]
        if not chosen:
            chosen = list(self._backends.values())
        usable = [b for b in chosen if mem.name in b.mems]
        if not usable:
            raise _error(-4, f"{what}: no available backends for mem type '{mem.name}'")
        return usable

    # ------------------------------------------------------------ memory

    def registerMem(self, descs: nixlRegDList, backends: Any = ()) -> int:
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"registerMem takes a nixlRegDList, not {type(descs).__name__}")
        mem = descs.getType()
        usable = self._backends_for(backends, mem, "registerMem")
        types = {b.type for b in usable}
        if not ((mem in (DRAM_SEG, VRAM_SEG) and "UCX" in types)
                or (mem in (DRAM_SEG, FILE_SEG) and "POSIX" in types)
                or (mem in (DRAM_SEG, OBJ_SEG) and "OBJ" in types)):
            raise _error(-9, f"registerMem: aioxfer registers DRAM and VRAM through UCX, DRAM "
                             f"and FILE through POSIX, DRAM and OBJ through OBJ; not {mem.name}")
        agent = self._agent
        if agent is None:
            raise _error(-3, "registerMem: the agent is closed")
        new: list[_Reg] = []
        with self._rt.locked():
            try:
                for i in range(descs.descCount()):
                    addr, nbytes, dev, meta = descs[i]
                    name = f"nixl{next(self._reg_seq)}"
                    if mem == FILE_SEG:
                        # NIXL's FILE descriptor: (offset, length, fd). A file
                        # region of aioxfer's file transport from offset 0 (so
                        # a region offset is a file offset), through the same
                        # file (its /proc/self/fd link), grown to the end of
                        # the range if shorter.
                        region = agent.register_file(f"/proc/self/fd/{dev}", size=addr + nbytes,
                                                     name=name)
                    elif mem == OBJ_SEG:
                        # NIXL's OBJ descriptor: (offset, length, devId, key);
                        # the key is devId in decimal when none is given.
                        objects = next(b.objects for b in usable if b.type == "OBJ")
                        key = meta.decode() if meta else str(dev)
                        reg = _Reg(mem, addr, nbytes, dev, meta, objects,
                                   [b.handle for b in usable])
                        reg.name = key
                        new.append(reg)
                        continue
                    else:
                        region = agent.register(_memory(mem, addr, nbytes), name=name)
                    new.append(_Reg(mem, addr, nbytes, dev, meta, region,
                                    [b.handle for b in usable]))
            except (RegistrationError, XferError, ValueError) as exc:
                for reg in new:
                    if reg.mem != OBJ_SEG:  # the bucket stays the backend's
                        self._drop_region(reg.region)
                raise _error(-3, f"registerMem: {exc}") from None
            self._regs.extend(new)
            self._table = None
        if self._tel is not None:
            self._tel.add(_telemetry.MEMORY_REGISTERED, sum(r.nbytes for r in new))
        return int(NIXL_SUCCESS)

    def _drop_region(self, region: aioxfer.Region) -> Any:
        agent = self._agent
        assert agent is not None
        return agent.deregister(region)

    def deregisterMem(self, descs: nixlRegDList, backends: Any = ()) -> int:
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"deregisterMem takes a nixlRegDList, not {type(descs).__name__}")
        mem = descs.getType()
        gone: list[_Reg] = []
        with self._rt.locked():
            taken: set[int] = set()
            for i in range(descs.descCount()):
                addr, nbytes, dev, _meta = descs[i]
                for k, reg in enumerate(self._regs):
                    if (k not in taken and reg.mem == mem and reg.addr == addr
                            and reg.nbytes == nbytes and reg.dev == dev):
                        taken.add(k)
                        gone.append(reg)
                        break
                else:
                    raise _error(-4, f"deregisterMem: no available backends for mem type "
                                     f"'{mem.name}' ({addr:#x}+{nbytes} is not registered)")
            self._regs = [r for k, r in enumerate(self._regs) if k not in taken]
            self._table = None
        # On the loop thread, where deregister's awaitable is the real release:
        # NIXL callers free the memory as soon as this returns, so it returns
        # only once no peer can touch it any more.
        regions = [reg.region for reg in gone if reg.mem != OBJ_SEG]  # buckets stay

        async def release() -> None:
            pending = [self._drop_region(r) for r in regions]
            await asyncio.gather(*(p for p in pending if inspect.isawaitable(p)))

        try:
            self._rt.run(release(), timeout=_RELEASE_TIMEOUT)
        except TimeoutError:
            raise _error(-3, "deregisterMem: peers did not release the memory in time") from None
        if self._tel is not None:
            self._tel.add(_telemetry.MEMORY_DEREGISTERED, sum(r.nbytes for r in gone))
        return int(NIXL_SUCCESS)

    def queryMem(self, descs: nixlRegDList, backend: int) -> list[dict[str, str] | None]:
        _argument(descs, nixlRegDList, "queryMem")
        b = self._backends.get(int(backend))
        if b is None:
            raise _error(-4, f"queryMem: no backend handle {backend}")
        out: list[dict[str, str] | None] = []
        if descs.getType() == OBJ_SEG and b.type == "OBJ":
            return self._query_objects(descs, b)
        if descs.getType() != FILE_SEG or b.type != "POSIX":
            raise _error(-9, f"queryMem: {b.type} answers for FILE_SEG through POSIX only "
                             f"and for OBJ_SEG through OBJ")
        for i in range(descs.descCount()):
            path = descs[i][3].decode(errors="surrogateescape")
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": str(st.st_mode),
                        "mtime": str(int(st.st_mtime))})
        return out

    def _query_objects(self, descs: nixlRegDList, b: _Backend) -> list[dict[str, str] | None]:
        """As NIXL's OBJ: per descriptor (its meta is the key) {} if the
        object exists, None if not; nixlBackendError if a HEAD failed."""
        keys = [descs[i][3].decode() for i in range(descs.descCount())]
        try:
            stats = self._rt.run(b.objects.stat(keys), timeout=_CONNECT_TIMEOUT)
        except (XferError, OSError, ValueError, TimeoutError) as exc:
            raise _error(-3, f"queryMem: {exc}") from None
        return [{} if st.exists else None for st in stats]

    def _local_table(self) -> _Table:
        if self._table is None:
            self._table = _Table([(int(r.mem), r.addr, r.nbytes, r.dev, r) for r in self._regs])
        return self._table

    # ------------------------------------------------------------ metadata

    def _md(self, regs: Sequence[_Reg], conn: bool, partial: bool) -> bytes:
        agent = self._agent
        address = agent.address if (conn and agent is not None) else ""
        incarnation = agent.incarnation if (conn and agent is not None) else 0
        # FILE and OBJ memory is local (POSIX, OBJ): never in metadata, as in NIXL.
        regions = [_wire.RegionMD(r.name, int(r.mem), r.addr, r.nbytes, r.dev) for r in regs
                   if r.mem not in (FILE_SEG, OBJ_SEG)]
        return _wire.encode_md(_wire.AgentMD(self._name, address, incarnation, regions, partial))

    def getLocalMD(self) -> bytes:
        with self._rt.locked():
            regs = list(self._regs)
        return self._md(regs, True, False)

    def _partial_regs(self, descs: nixlRegDList) -> list[_Reg]:
        out: list[_Reg] = []
        with self._rt.locked():
            for i in range(descs.descCount()):
                addr, nbytes, dev, _ = descs[i]
                for reg in self._regs:
                    if (reg.mem == descs.getType() and reg.addr == addr and reg.nbytes == nbytes
                            and reg.dev == dev):
                        out.append(reg)
                        break
                else:
                    raise _error(-4, f"partial metadata: {addr:#x}+{nbytes} is not registered")
        return out

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False,
                          backends: Any = ()) -> bytes:
        _argument(descs, nixlRegDList, "getLocalPartialMD")
        return self._md(self._partial_regs(descs), bool(inc_conn_info), True)

    def loadRemoteMD(self, metadata: bytes) -> bytes:
        if isinstance(metadata, str):
            metadata = metadata.encode()  # (NIXL's binding takes str as its UTF-8 bytes)
        try:
            md = _wire.decode_md(metadata)
        except _wire.NotMetadata as exc:
            # NIXL: metadata that does not deserialise is NIXL_ERR_MISMATCH
            # (observed on 1.5.1 for b"", b"garbage" and a str).
            raise _error(-5, f"loadRemoteMD: {exc}") from None
        except ValueError as exc:
            raise _error(-2, f"loadRemoteMD: {exc}") from None
        if md.name == self._name:
            raise _error(-2, "loadRemoteMD: remote agent name same as local agent, "
                             "no need to load metadata")
        try:
            return self._rt.run(self._load(md), timeout=_CONNECT_TIMEOUT + 5)
        except TimeoutError:
            raise _error(-3, f"loadRemoteMD: agent {md.name!r} did not answer") from None

    async def _load(self, md: _wire.AgentMD) -> bytes:
        """Loads metadata (on the loop thread): connects when it carries the
        connection info, imports the peer's new regions, records the ranges.
        Loads of one agent run one after the other, as NIXL's (which hold the
        agent's lock): two at once would each make a record of their own over
        the one cached connection, the last replacing the first."""
        entry = self._loading.get(md.name)
        if entry is None:
            entry = self._loading[md.name] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                return await self._load_one(md)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._loading[md.name]

    async def _load_one(self, md: _wire.AgentMD) -> bytes:
        rem = self._remotes.get(md.name)
        fresh = rem is None
        if rem is None:
            rem = _Remote(md.name)
        agent = self._agent
        if md.address and agent is not None:
            peer = rem.peer
            if (peer is None or peer.lost or rem.incarnation != md.incarnation
                    or rem.address != md.address):
                try:
                    peer = await asyncio.wait_for(agent.connect(md.address), _CONNECT_TIMEOUT)
                except (XferError, OSError, TimeoutError) as exc:
                    raise _error(-3, f"loadRemoteMD: cannot connect to agent {md.name!r} at "
                                     f"{md.address}: {exc}") from None
                if peer.name != md.name or peer.incarnation != md.incarnation:
                    raise _error(-5, f"loadRemoteMD: the agent at {md.address} is {peer.name!r} "
                                     f"(incarnation {peer.incarnation:#x}), not {md.name!r} "
                                     f"({md.incarnation:#x}): stale metadata")
                if rem.removed:
                    # Removed while connecting: the load came first, the
                    # removal after it; its connection goes with the record
                    # (kept in it, nothing could ever close it).
                    await peer.aclose()
                    return md.name.encode()
                if rem.peer is not None and rem.peer is not peer:
                    rem.gen += 1
                rem.peer = peer
                rem.address = md.address
                rem.incarnation = md.incarnation
        elif md.address:
            rem.address = md.address
            rem.incarnation = md.incarnation
        if rem.peer is not None and any(r.name not in rem.peer.regions for r in md.regions):
            try:
                await asyncio.wait_for(rem.peer.refresh(), _CONNECT_TIMEOUT)
            except (XferError, OSError, TimeoutError) as exc:
                raise _error(-3, f"loadRemoteMD: cannot refresh agent {md.name!r}: {exc}") from None
            if rem.removed:  # removed while refreshing (its connection closed with it)
                return md.name.encode()
        if md.partial:
            rem.ranges.update((r.name, r) for r in md.regions)
        else:
            rem.ranges = {r.name: r for r in md.regions}
        rem.table = None
        if fresh:
            self._remotes[md.name] = rem
        return md.name.encode()

    def invalidateRemoteMD(self, remote_agent: Any) -> int:
        name = _name(remote_agent)
        with self._rt.locked():
            rem = self._remotes.pop(name, None)
            if rem is None:
                _log("I", f"invalidateRemoteMD: remote metadata for agent '{name}' not found.")
                return int(NIXL_ERR_NOT_FOUND)
            rem.removed = True
            rem.gen += 1
            peer, rem.peer = rem.peer, None
            for x in self._xfers.values():
                if x.remote is rem:
                    _unwatched(x)
        if peer is not None:
            if self._rt.on_loop():
                self._rt.spawn(peer.aclose())
            else:
                self._rt.run(peer.aclose(), timeout=_CONNECT_TIMEOUT)
        return int(NIXL_SUCCESS)

    def checkRemoteMD(self, remote_agent: Any, descs: nixlXferDList | None = None) -> int:
        if descs is not None:
            _argument(descs, nixlXferDList, "checkRemoteMD")
        name = _name(remote_agent)
        rem = self._remotes.get(name)
        ok = rem is not None and rem.peer is not None and not rem.removed
        if ok and descs is not None and not descs.isEmpty():
            assert rem is not None
            with self._rt.locked():
                ok = rem.get_table().locate(int(descs.getType()), descs._a) is not None
        if ok:
            return int(NIXL_SUCCESS)
        now = time.perf_counter()
        if now - self._last_md_poll < _TIGHT_POLL:
            self._rt.yield_to_loop()
        self._last_md_poll = time.perf_counter()
        return int(NIXL_ERR_NOT_FOUND)

    def makeConnection(self, remote_agent: Any, backends: Any = ()) -> int:
        self._peer_of(_name(remote_agent), "makeConnection")
        return int(NIXL_SUCCESS)

    def _peer_of(self, name: str, what: str, lost_ok: bool = False) -> aioxfer.Peer:
        """The live peer for agent ``name`` (ourselves: a loopback connection);
        ``lost_ok``: a lost one too (a request made now fails when posted)."""
        if name == self._name:
            return self._loopback(what)
        rem = self._remotes.get(name)
        if rem is None or rem.removed or rem.peer is None:
            raise _error(-4, f"{what}: remote agent {name!r} is not known (metadata not loaded, "
                             f"or removed)")
        if rem.peer.lost and not lost_ok:
            raise _error(_ERR_REMOTE_DISCONNECT, f"{what}: remote agent {name!r} was "
                                                 f"disconnected")
        return rem.peer

    def _loopback(self, what: str) -> aioxfer.Peer:
        agent = self._agent
        if agent is None:
            raise _error(-4, f"{what}: no UCX backend for loopback transfers")
        peer = self._self_peer
        if peer is None or peer.lost:
            try:
                peer = self._rt.run(agent.connect(agent.address), timeout=_CONNECT_TIMEOUT)
            except (XferError, OSError, TimeoutError) as exc:
                raise _error(-3, f"{what}: loopback connection failed: {exc}") from None
            self._self_peer = peer
        return peer

    # ------------------------------------------------------------ listener (metadata exchange)

    async def _start_listener(self, port: int) -> None:
        host = os.environ.get("AIOXFER_NIXL_LISTEN_HOST", "127.0.0.1")
        ref = weakref.ref(self)

        async def serve(conn: _ListenConn) -> None:
            me = ref()
            task = asyncio.current_task()
            try:
                if me is None or task is None:
                    return
                # (Bounded: clients that connect and never finish a request
                # must not hold a task and a socket each without limit.)
                who = conn.who
                if not me._listen_slots.admit(task, conn, me._listen_log):
                    return
                try:
                    me._track(task)
                    await me._serve_md(conn, who, lambda: me._listen_slots.proved(task))
                finally:
                    me._listen_slots.release(task)
            except asyncio.CancelledError:
                # (Cancelled by close(): this task ends here, quietly.)
                pass
            finally:
                conn.close()

        try:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: _ListenConn(serve), host, port)
        except OSError as exc:
            raise _error(-3, f"metadata listener cannot listen on {host}:{port}: {exc}") from None
        self.listen_port = self._server.sockets[0].getsockname()[1]
        _log("I", f"MD listener is listening on port {self.listen_port}")

    def _listen_token(self) -> bytes:
        """The token of this agent's aioxfer agent (made or to be made): what
        listener requests, sent and served, are authenticated with."""
        if self._token is None:
            self._token = default_token()
        return self._token

    @property
    def _listen_conns(self) -> int:
        """Listener connections being served (at most _wire.MAX_LISTEN_CONNS)."""
        return len(self._listen_slots.live)

    async def _serve_md(self, conn: _ListenConn, who: str, proved: Callable[[], None]) -> None:
        """One listener request from client ``who``; ``proved()`` once it has
        shown it holds the token. Whatever goes wrong is logged (with who
        and why: a TimeoutError or a closed connection says nothing by
        itself) and closes this connection only."""
        timeout = _CONNECT_TIMEOUT
        stage = "no whole request"
        try:
            async with asyncio.timeout(timeout):
                token = self._listen_token()
                nonce = _wire.greeting()
                conn.write(nonce)
                await conn.drain()
                try:
                    body, req_mac = await _read_authenticated(conn, token, nonce, proved)
                except _OlderClient:
                    # (Its listener error text: what a version-1 client raises.)
                    _write_frame(conn, _wire.encoder.encode(
                        _wire.Reply(ok=False, error=_wire.older_client_refusal())))
                    await conn.drain()
                    raise
                stage = "its request not served"
                req = _wire.request_decoder.decode(body)
                if isinstance(req, _wire.Push):
                    md = _wire.decode_md(req.md)
                    if md.name == self._name:
                        raise ValueError("metadata of this very agent")
                    await self._load(md)
                    reply = _wire.Reply(ok=True)
                elif isinstance(req, _wire.Fetch):
                    if req.name != self._name:
                        # (The name asked for, cut: up to MAX_FRAME long.)
                        reply = _wire.Reply(ok=False, error=f"this is agent {self._name!r}, "
                                                            f"not {req.name[:300]!r}")
                    else:
                        reply = _wire.Reply(ok=True, md=self.getLocalMD())
                else:
                    self._forget(req.name)
                    reply = _wire.Reply(ok=True)
                # (Proved, whatever it says: _wire's version 3.)
                conn.write(_wire.reply_frame(token, nonce, req_mac, _wire.encoder.encode(reply)))
                await conn.drain()
        except _Evicted:
            pass
        except _wire.ListenerVersionError as exc:
            self._listen_log(f"{who}: {exc}")
        except TimeoutError:
            self._listen_log(f"{who}: {stage} within {timeout:g} s, closed")
        except asyncio.IncompleteReadError as exc:
            command = _wire.nixl_command(exc.partial)
            if command is not None:
                # (NIXL's fetch, 21 bytes: it took our greeting for a length
                # over its cap and hung up.)
                self._listen_log(f"{who}: a real NIXL agent's request (NIXLCOMM:{command}), "
                                 f"closed by it: {_wire.NIXL_NOT_US}")
            else:
                self._listen_log(f"{who}: closed after {len(exc.partial)} of {exc.expected} "
                                 f"bytes of a request")
        except Exception as exc:  # one bad request: log it, keep serving
            if not conn.evicted:  # (then said already)
                self._listen_log(f"{who}: request failed: {exc or type(exc).__name__}")

    def _forget(self, name: str) -> None:
        """A peer invalidated its metadata: drop it (on the loop thread)."""
        rem = self._remotes.pop(name, None)
        if rem is None:
            return
        rem.removed = True
        rem.gen += 1
        peer, rem.peer = rem.peer, None
        if peer is not None:
            self._rt.spawn(peer.aclose())

    def _track(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _request(self, ip: str, port: int, req: Any) -> _wire.Reply:
        """``req`` sent to the metadata listener at ip:port, its reply.
        Bounded in time as a whole (_CONNECT_TIMEOUT, from the connect to
        the reply's last byte: a listener that accepts and never answers,
        or trickles, must not hold the request and its socket for ever) and
        in memory (_ReplyConn; what is held follows what the listener sent,
        never more than the bound of a reply to ``req``, _reply_bound).
        Raises, each error naming the listener: TimeoutError (no whole
        reply in time), ConnectionError (no connection, or closed or reset
        before a whole reply), ValueError (a reply announced over its bound,
        or one that does not decode), RuntimeError (the listener's refusal:
        its text), _wire.ListenerVersionError (a listener of another wire
        version: at its greeting, before any proof is sent)."""
        where = f"metadata listener {_host_port(ip, port)}"
        bound = _reply_bound(req)
        stage = "no connection"
        conn: _ReplyConn | None = None
        ok = False
        # (Each error is raised anew past the try, not within an except: a
        # context would keep the read's frames, and with them its buffers,
        # for as long as the error is kept.)
        failed: tuple[type[Exception], str] | None = None
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT):
                token = self._listen_token()
                _, conn = await asyncio.get_running_loop().create_connection(
                    _ReplyConn, ip, port)
                stage = "no nonce"  # (the greeting: tests and logs know it so)
                nonce = bytes(await conn.readexactly(_wire.LISTEN_NONCE))
                version = _wire.greeting_version(nonce)
                if version != _wire.WIRE_VERSION:
                    # Checked before a proof goes: a listener of another
                    # version gets none, only a notice naming ours (that
                    # version 1 logs too: _wire.older_listener_notice).
                    conn.write(_wire.older_listener_notice(token, nonce) if version == 1
                               else _wire.version_notice())
                    stage = "the version notice not taken"
                    await conn.drain()
                    ok = True  # (closed, not reset: the notice goes first)
                    older = " (an older aioxfer.nixl)" if version < _wire.WIRE_VERSION else ""
                    failed = _wire.ListenerVersionError, (
                        f"{where} speaks listener wire version {version}{older}, this agent "
                        f"{_wire.WIRE_VERSION}: use one aioxfer version on both sides")
                else:
                    # (A fresh nonce per request: a reply recorded on an
                    # earlier connection, replayed by whoever answers with
                    # the greeting it came after, does not prove this one.)
                    request = _wire.listen_request(token, nonce, _wire.encoder.encode(
                        msgspec.structs.replace(req, nonce=os.urandom(_wire.CLIENT_NONCE))))
                    req_mac = request[-_wire.LISTEN_MAC:]
                    conn.write(request)
                    del request
                    stage = "the request not taken"
                    await conn.drain()
                    stage = "no whole reply"
                    body = await _read_proved_reply(conn, bound, where, token, nonce, req_mac)
                    ok = True
        except TimeoutError:
            # (No greeting: what a real NIXL agent's listener answers, as its
            # client speaks first. Told apart from a slow listener only by
            # the time it took, so the error says both.)
            why = (f" (not an aioxfer.nixl metadata listener? A real NIXL agent's never "
                   f"greets: {_wire.NIXL_NOT_US})" if stage == "no nonce" else "")
            failed = TimeoutError, f"{where}: {stage} within {_CONNECT_TIMEOUT:g} s{why}"
        except asyncio.IncompleteReadError as exc:
            failed = ConnectionError, (f"{where}: closed after {len(exc.partial)} of the "
                                       f"{exc.expected} bytes it owed ({stage})")
        except OSError as exc:  # (refused, reset, unreachable, a name not found)
            failed = (type(exc) if isinstance(exc, ConnectionError) else ConnectionError,
                      f"{where}: {exc} ({stage})")
        finally:
            if conn is not None:
                if ok:
                    conn.close()
                elif conn.transport is not None:
                    conn.transport.abort()  # (whatever it still sends: not read)
                conn = None  # (with a read's buffer, when one was cut short)
        if failed is not None:
            raise failed[0](failed[1])
        try:
            reply: _wire.Reply = _wire.reply_decoder.decode(body)
        except ValueError as exc:  # (msgspec.DecodeError)
            failed = ValueError, f"{where}: a reply that does not decode: {exc}"
        del body
        if failed is not None:
            raise failed[0](failed[1])
        if not reply.ok:
            # (The listener's text, cut: a Fetch's reply may be MAX_FRAME
            # long, and its text became one log line, or an exception
            # message, of up to 64 MiB. Its characters are escaped where it
            # is logged, _log.)
            more = len(reply.error) - _wire.MAX_ERROR_CHARS
            cut = f" (and {more} more characters)" if more > 0 else ""
            raise RuntimeError(f"{where}: {reply.error[:_wire.MAX_ERROR_CHARS]}{cut}")
        return reply

    def _background(self, what: str, coro: Any, level: str = "E",
                    store_write: bool = False) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception as exc:
                _log(level, f"{what} failed: {exc}")

        with self._rt.locked():
            task = self._rt.spawn(run())
            self._track(task)
            if store_write and task is not None:
                self._store_writes.add(task)
                task.add_done_callback(self._store_writes.discard)

    def _store_or_raise(self, what: str) -> _CentralStore:
        if self._store is None:
            # (NIXL 1.5.1, observed: NIXL_ERR_INVALID_PARAM, listener or not.)
            raise _error(-2, f"{what}: no peer address given and no central metadata store "
                             f"(NIXL_ETCD_ENDPOINTS) configured")
        return self._store

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        md = self.getLocalMD()
        if not ip_addr:
            store = self._store_or_raise("sendLocalMD")
            self._background("sendLocalMD", store.publish("", md), store_write=True)
            return
        self._background("sendLocalMD",
                         self._request(ip_addr, _port(port), _wire.Push(md=md)))

    def sendLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False,
                           backends: Any = (), ip_addr: str = "", port: int = 0,
                           label: str = "") -> None:
        md = self.getLocalPartialMD(descs, inc_conn_info, backends)
        if not ip_addr:
            store = self._store_or_raise("sendLocalPartialMD")
            if not label:
                raise _error(-2, "sendLocalPartialMD: a label is needed for the central store")
            self._background("sendLocalPartialMD", store.publish(label, md),
                             store_write=True)
            return
        self._background("sendLocalPartialMD",
                         self._request(ip_addr, _port(port), _wire.Push(md=md)))

    def fetchRemoteMD(self, remote_agent: Any, ip_addr: str = "", port: int = 0,
                      label: str = "") -> None:
        name = _name(remote_agent)
        if not ip_addr:
            store = self._store_or_raise("fetchRemoteMD")
            key = store.key(name, label)
            wait = self._config.etcdWatchTimeout / 1e6

            async def fetch_stored() -> None:
                # Polled, not watched: a key put before or after the call is
                # found alike, within etcdWatchTimeout. A value that is not
                # our metadata (a real NIXL agent's, under the same key: one
                # running, or one gone that left it) is waited past too, as
                # a missing one: our agent of that name may be about to
                # replace it; at the timeout, the error says what was there.
                deadline = time.monotonic() + wait
                refused: Exception | None = None
                while True:
                    got = await store.get(key)
                    if got is not None:
                        try:
                            decoded = _wire.decode_md(got[0])
                            break
                        except _wire.NotMetadata as exc:
                            refused = exc
                    if time.monotonic() > deadline:
                        if refused is not None:
                            raise _wire.NotMetadata(f"{refused} (under {key}, for {wait:g} s)")
                        raise TimeoutError(f"no metadata under {key} within {wait:g} s")
                    await asyncio.sleep(0.02)
                revision = got[1]
                await self._load(self._fetched(name, decoded, key))
                # As NIXL's: the agent's keys deleted after this read (it
                # invalidated its metadata) drop it here.
                store.watch_agent(name, revision, self._forget)

            self._background("fetchRemoteMD", fetch_stored())
            return

        async def fetch() -> None:
            reply = await self._request(ip_addr, _port(port), _wire.Fetch(name=name, label=label))
            await self._load(self._fetched(name, _wire.decode_md(reply.md),
                                           f"metadata listener {_host_port(ip_addr, _port(port))}"))

        self._background("fetchRemoteMD", fetch())

    def _fetched(self, name: str, md: _wire.AgentMD, where: str) -> _wire.AgentMD:
        """``md`` when it is what fetching agent ``name`` asked for: metadata
        of that agent, not ourselves. A proved reply only says a holder of
        the token answered; any agent of that token (one misconfigured,
        another listener on the port asked, a relay of one) could answer a
        fetch of "A" with the metadata of "B", which would be loaded under
        "B", its connection made, its ranges used, "A" never asked again.
        Raises NIXL_ERR_MISMATCH (logged by the fetch, nothing loaded)."""
        if md.name != name:
            raise _error(-5, f"fetchRemoteMD: {where} answered a fetch of agent {name!r} with "
                             f"the metadata of agent {md.name!r}: not loaded")
        if md.name == self._name:
            raise _error(-2, f"fetchRemoteMD: {where} answered with metadata of this very "
                             f"agent ({md.name!r}): not loaded")
        return md

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        if not ip_addr:
            store = self._store_or_raise("invalidateLocalMD")
            self._background("invalidateLocalMD", store.invalidate(), store_write=True)
            return
        # The peer may be gone already (it has what it needed): not an error.
        self._background("invalidateLocalMD",
                         self._request(ip_addr, _port(port), _wire.Invalidate(name=self._name)),
                         level="I")

    # ------------------------------------------------------------ descriptor preparation

    def prepXferDlist(self, *args: Any, **kwargs: Any) -> int:
        """prepXferDlist(agent_name, descs, backends=[]), prepXferDlist(descs,
        backends=[]), or NIXL 1.5.1's strided form prepXferDlist(agent_name,
        mem_type, Nx5 array, backends=[]): rows (addr, len, devId, stride,
        count), each ``count`` blocks of ``len`` bytes ``stride`` apart,
        indexed one after the other in row order."""
        agent_name: Any = kwargs.pop("agent_name", None)
        if args and isinstance(args[0], str | bytes):
            agent_name, args = args[0], args[1:]
        name = NIXL_INIT_AGENT if agent_name is None else _name(agent_name)
        spans: npt.NDArray[np.uint64] | None = None
        arr: npt.NDArray[np.uint64] | None
        if len(args) >= 2 and isinstance(args[1], np.ndarray) and not isinstance(
                args[0], nixlXferDList):
            mem = _mem(args[0])
            arr, spans = _strided_rows(args[1])
        else:
            descs = kwargs.pop("descs", args[0] if args else None)
            if not isinstance(descs, nixlXferDList):
                raise TypeError(f"prepXferDlist takes a nixlXferDList, not "
                                f"{type(descs).__name__}")
            mem = descs.getType()
            arr = descs._a
        try:
            return self._prep(name, mem, arr, spans)
        except nixlNotFoundError:
            if self._tel is not None:
                self._tel.error(-4)
            # Callers retry until (partial) metadata arrives: let it arrive.
            now = time.perf_counter()
            if now - self._last_md_poll < _TIGHT_POLL:
                self._rt.yield_to_loop()
            self._last_md_poll = time.perf_counter()
            raise

    def _prep(self, name: str, mem: nixl_mem_t, arr: npt.NDArray[np.uint64] | None,
              spans: npt.NDArray[np.uint64] | None = None) -> int:
        """Prepares ``arr``'s descriptors; for a strided list, ``spans`` (one
        per row, each inside one registered region as NIXL requires, or
        NOT_FOUND) and ``arr`` its blocks (None: too many, refused)."""
        with self._rt.locked():
            if name in (NIXL_INIT_AGENT, "NIXL_INIT_AGENT"):
                table = self._local_table()
                prepped = self._prepped(None, False, mem, arr, table, "local", spans)
            elif name == self._name:
                if self._agent is None and mem != FILE_SEG:
                    raise _error(-4, "prepXferDlist: no UCX backend for loopback")
                prepped = self._prepped(None, True, mem, arr, self._local_table(), "loopback",
                                        spans)
            else:
                rem = self._remotes.get(name)
                if rem is None or rem.removed:
                    raise _error(-4, f"prepXferDlist: remote agent {name!r} not found (metadata "
                                     f"not loaded, or removed)")
                prepped = self._prepped(rem, False, mem, arr, rem.get_table(),
                                        f"agent '{name}'", spans)
            handle = next(self._handle_seq)
            self._dlists[handle] = prepped
        return handle

    def _prepped(self, rem: _Remote | None, loopback: bool, mem: nixl_mem_t,
                 arr: npt.NDArray[np.uint64] | None, table: _Table, whose: str,
                 spans: npt.NDArray[np.uint64] | None = None) -> _Prepped:
        if spans is None:
            idx = table.locate(int(mem), arr) if arr is not None else None
        else:
            # A strided row's blocks lie in the region that holds its span.
            sidx = table.locate(int(mem), spans)
            if sidx is not None and arr is None:
                raise _error(-2, f"prepXferDlist: a strided list of more than "
                                 f"{_STRIDED_MAX_BLOCKS} blocks (the most here)")
            idx = None if sidx is None else np.repeat(sidx, spans[:, 3].astype(np.intp))
        if idx is None or arr is None:
            raise _error(-4, f"prepXferDlist: failed to prepare the descriptors for any of the "
                             f"specified or potential backends for {whose}: not inside memory "
                             f"it registered (or its metadata was not loaded yet)")
        if mem in (FILE_SEG, OBJ_SEG):
            offs = arr[:, 0].copy()  # file regions start at file offset 0; objects at 0
        else:
            starts = table.starts[idx] if idx.size else np.zeros(0, dtype=np.uint64)
            offs = arr[:, 0] - starts
        return _Prepped(rem, loopback, mem, table.objs, idx, offs, arr[:, 1].copy(),
                        rem.gen if rem is not None else 0)

    def releasedDlistH(self, handle: int) -> int:
        with self._rt.locked():
            if self._dlists.pop(int(handle), None) is None and not self._closed:
                raise _error(-2, f"releasedDlistH: unknown descriptor list handle {handle:#x}")
        return int(NIXL_SUCCESS)

    # ------------------------------------------------------------ transfer requests

    def makeXferReq(self, operation: Any, local_side: int, local_indices: Any, remote_side: int,
                    remote_indices: Any, notif_msg: Any = "", backend: Any = (),
                    skip_desc_merge: bool = False, **kwargs: Any) -> int:
        op = _OPS.get(operation)
        if op is None:
            op = _op(operation)
        ld = self._dlists.get(local_side)
        rd = self._dlists.get(remote_side)
        if ld is None or rd is None or not ld.is_local or rd.is_local:
            self._count(-2)
            if ld is None or rd is None:
                raise _error(-2, "makeXferReq: unknown prepared descriptor list handle")
            if not ld.is_local:
                raise _error(-2, "makeXferReq: the local side was prepared for a remote agent")
            raise _error(-2, "makeXferReq: the remote side was prepared as local "
                             "(NIXL_INIT_AGENT); prepare it with the remote (or own) agent name")
        li = _indices(local_indices, "local", ld.n)
        ri = _indices(remote_indices, "remote", rd.n)
        if li.size != ri.size or not li.size:
            raise _error(-2, f"makeXferReq: different number of indices for local ({li.size}), "
                             f"remote ({ri.size})")
        if ld.uniform >= 0 and ld.uniform == rd.uniform:
            lens = ld.uniform_lens(li.size)  # every length the same: nothing to compare
        else:
            lens = ld.lens[li]
            if not np.array_equal(lens, rd.lens[ri]):
                i = int(np.flatnonzero(lens != rd.lens[ri])[0])
                raise _error(-2, f"makeXferReq: length mismatch at index {i} with local index "
                                 f"{int(li[i])} and remote index {int(ri[i])}")
        return self._new_xfer(op, ld, li, rd, ri, lens, _payload(notif_msg) if notif_msg else b"",
                              "makeXferReq")

    def createXferReq(self, operation: Any, local_descs: nixlXferDList,
                      remote_descs: nixlXferDList, remote_agent: Any, notif_msg: Any = "",
                      backend: Any = ()) -> int:
        op = _op(operation)
        if not isinstance(local_descs, nixlXferDList) or not isinstance(remote_descs,
                                                                         nixlXferDList):
            raise TypeError("createXferReq takes two nixlXferDList")
        n = local_descs.descCount()
        if n != remote_descs.descCount() or not n:
            raise _error(-2, f"createXferReq: {n} local and {remote_descs.descCount()} remote "
                             f"descriptors")
        if not np.array_equal(local_descs._a[:, 1], remote_descs._a[:, 1]):
            raise _error(-2, "createXferReq: local and remote descriptor lengths differ")
        lh = self.prepXferDlist(local_descs, backend)
        try:
            rh = self.prepXferDlist(_name(remote_agent), remote_descs, backend)
        except BaseException:
            self._dlists.pop(lh, None)
            raise
        try:
            idx = np.arange(n, dtype=np.int64)
            ld, rd = self._dlists[lh], self._dlists[rh]
            return self._new_xfer(op, ld, idx, rd, idx, ld.lens,
                                  _payload(notif_msg) if notif_msg else b"", "createXferReq")
        finally:
            with self._rt.locked():
                self._dlists.pop(lh, None)
                self._dlists.pop(rh, None)

    def _count(self, status: int) -> None:
        """A failure NIXL counts in its telemetry (agent_err_*)."""
        if self._tel is not None:
            self._tel.error(status)

    def _count_exc(self, exc: BaseException) -> None:
        if self._tel is not None:
            self._tel.error(_STATUS_OF.get(type(exc), -8))

    def _new_xfer(self, op: int, ld: _Prepped, li: npt.NDArray[np.int64], rd: _Prepped,
                  ri: npt.NDArray[np.int64], lens: npt.NDArray[np.uint64], notif: bytes,
                  what: str) -> int:
        try:
            return self._make_xfer(op, ld, li, rd, ri, lens, notif, what)
        except Exception as exc:
            self._count_exc(exc)
            raise

    def _make_xfer(self, op: int, ld: _Prepped, li: npt.NDArray[np.int64], rd: _Prepped,
                   ri: npt.NDArray[np.int64], lens: npt.NDArray[np.uint64], notif: bytes,
                   what: str) -> int:
        rem = rd.remote
        if rem is not None and (rem.removed or rem.gen != rd.gen):
            raise _error(-4, f"{what}: remote agent '{rem.name}' was invalidated or re-registered "
                             f"after the descriptor list was prepared; prepare it again")
        if OBJ_SEG in (rd.mem, ld.mem):
            return self._new_object_xfer(op, ld, li, rd, ri, lens, notif, what)
        file = rd.mem == FILE_SEG
        if ld.mem == FILE_SEG:
            raise _error(-9, f"{what}: the local side is host memory, the FILE side is the "
                             f"agent's own (prepared with its own name), as with NIXL's POSIX")
        peer: aioxfer.Peer | None = None
        if not file:
            if rd.loopback:
                peer = self._loopback(what)
            else:
                assert rem is not None
                peer = self._peer_of(rem.name, what, lost_ok=True)
        # Which region pair each descriptor uses: one pair (the common case),
        # or per (local, remote) pair the descriptors in request order.
        k = int(li.size)
        # (local region, remote region, start, end): descriptors [start, end)
        # of the request (reordered by region pair, stably, when it spans several)
        split: list[tuple[int, int, int, int]] = []
        if ld.single >= 0 and rd.single >= 0:
            split.append((ld.single, rd.single, 0, k))
        elif k == 1:
            split.append((int(ld.ridx[li[0]]), int(rd.ridx[ri[0]]), 0, k))
        else:
            lridx = ld.ridx[li]
            rridx = rd.ridx[ri]
            key = lridx * len(rd.objs) + rridx
            order = np.argsort(key, kind="stable")
            skey = key[order]
            starts = [0, *(np.flatnonzero(skey[1:] != skey[:-1]) + 1).tolist()]
            if len(starts) > 1:
                li, ri = li[order], ri[order]
                if ld.uniform < 0:
                    lens = lens[order]
            ends = [*starts[1:], k]
            nregions = len(rd.objs)
            for a, b in zip(starts, ends, strict=True):
                lk, rk = divmod(int(skey[a]), nregions)
                split.append((lk, rk, a, b))
        # Remote regions by name, as the peer knows them (refreshed once if
        # the peer registered them after we connected).
        remote_objs = self._resolve(rd, list({rk for _, rk, _, _ in split}), peer, what)
        loffs = ld.offs[li]  # (contiguous: a group's slice of them is too)
        roffs = rd.offs[ri]
        groups: list[tuple[Any, Any]] = []
        total = ld.uniform * k if ld.uniform >= 0 else int(lens.sum())
        rt = self._rt
        rt.lock.acquire()
        try:
            try:
                if k == 1:
                    a, b, n = int(loffs[0]), int(roffs[0]), int(lens[0])
                    lk, rk, _, _ = split[0]
                    groups.append((ld.objs[lk].region[a:a + n], remote_objs[rk][b:b + n]))
                elif k <= _SMALL_GROUPS * len(split):
                    # Many region pairs with few descriptors each (one
                    # registration per block): one aioxfer request of
                    # Segment lists, rather than a request per pair.
                    lsegs: list[Any] = []
                    rsegs: list[Any] = []
                    lol, rol, nl = loffs.tolist(), roffs.tolist(), lens.tolist()
                    # (Built directly: the ranges were checked when prepared.)
                    far = Segment if file else RemoteSegment
                    for lk, rk, a, b in split:
                        lreg, rreg = ld.objs[lk].region, remote_objs[rk]
                        for j in range(a, b):
                            n = nl[j]
                            lsegs.append(Segment(lreg, lol[j], n))
                            rsegs.append(far(rreg, rol[j], n))
                    groups.append((lsegs, rsegs))
                else:
                    # Checked already: every range lies inside its prepared,
                    # registered region (the engines check again).
                    uniform = ld.uniform
                    for lk, rk, a, b in split:
                        if a == 0 and b == k:
                            lo, ro, sl, nbytes = loffs, roffs, lens, total
                        else:
                            lo, ro, sl = loffs[a:b], roffs[a:b], lens[a:b]
                            nbytes = uniform * (b - a) if uniform >= 0 else int(sl.sum())
                        groups.append((_segments(ld.objs[lk].region, lo, sl, nbytes),
                                       _segments(remote_objs[rk], ro, sl, nbytes)))
            except (XferError, ValueError, IndexError, TypeError) as exc:
                raise _from_xfer_error(exc, what) from None
            backend = self._backend_of.get("POSIX" if file else "UCX", 0)
            x = _Xfer(op, peer, rem, rd.gen, groups, notif, k, total, backend, file)
            agent = self._agent
            if len(groups) == 1 and agent is not None:
                x.post = agent.write if x.write else agent.read
                x.plain = (not notif or x.file) and not self._telemetry
                if x.plain:
                    # The hot path's repost: one compiled call (checked now;
                    # a pair the agent refuses is refused as it was, by the
                    # post: x.post then).
                    try:
                        x.prep = agent.prepare("write" if x.write else "read", *groups[0])
                    except (XferError, ValueError, TypeError):
                        x.prep = None
            handle = next(self._handle_seq)
            self._xfers[handle] = x
        finally:
            rt.leave()
        return handle

    def _new_object_xfer(self, op: int, ld: _Prepped, li: npt.NDArray[np.int64], rd: _Prepped,
                         ri: npt.NDArray[np.int64], lens: npt.NDArray[np.uint64], notif: bytes,
                         what: str) -> int:
        """Host memory to objects (WRITE: whole objects, offset 0, as NIXL's
        OBJ) or objects to host memory (READ: from the descriptor's offset),
        one request of aioxfer's object backend."""
        if ld.mem == OBJ_SEG or not rd.loopback:
            raise _error(-9, f"{what}: the local side is host memory, the OBJ side is the "
                             f"agent's own (prepared with its own name), as with NIXL's OBJ")
        write = op == NIXL_WRITE
        lridx, rridx = ld.ridx[li].tolist(), rd.ridx[ri].tolist()
        loffs, roffs, ns = ld.offs[li].tolist(), rd.offs[ri].tolist(), lens.tolist()
        with self._rt.locked():
            locals_: list[Any] = []
            fars: list[Any] = []
            try:
                for i, (lk, rk, lo, ro, n) in enumerate(zip(lridx, rridx, loffs, roffs, ns,
                                                          strict=True)):
                    reg = rd.objs[rk]
                    if write and ro:
                        raise _error(-2, f"{what}: descriptor {i}: object writes start at "
                                         f"offset 0 (whole objects), not {ro}")
                    locals_.append(ld.objs[lk].region[lo:lo + n])
                    whole = reg.region[reg.name]
                    fars.append(whole if write else whole[ro:ro + n])
            except (XferError, ValueError, IndexError, TypeError) as exc:
                raise _from_xfer_error(exc, what) from None
            backend = next((h for h, b in self._backends.items() if b.type == "OBJ"), 0)
            x = _Xfer(op, None, None, 0, [(locals_, fars)], notif, len(ns), int(lens.sum()),
                      backend, False)
            x.objects = True
            handle = next(self._handle_seq)
            self._xfers[handle] = x
        return handle

    def _resolve(self, rd: _Prepped, needed: list[int], peer: aioxfer.Peer | None,
                 what: str) -> dict[int, Any]:
        """Region objects for the remote side's regions ``needed``: the peer's
        RemoteRegions (ours, as seen through the loopback peer)."""
        if rd.mem == FILE_SEG:  # our own file regions (only ever prepared as loopback)
            return {k: rd.objs[k].region for k in needed}
        out: dict[int, Any] = {}
        missing: list[int] = []
        for k in needed:
            obj = rd.resolved.get(k)
            if obj is None or getattr(obj, "gone", False) or (
                    peer is not None and getattr(obj, "peer", peer) is not peer):
                missing.append(k)
            else:
                out[k] = obj
        if not missing:
            return out
        if peer is None:
            raise _error(-9, f"{what}: no UCX backend to reach remote memory")
        names = [rd.objs[k].name if rd.loopback else rd.objs[k] for k in missing]
        known = peer.regions
        if any(n not in known for n in names):
            try:
                self._rt.run(peer.refresh(), timeout=_CONNECT_TIMEOUT)
            except (XferError, OSError, TimeoutError) as exc:
                raise _from_xfer_error(exc, what) from None
            known = peer.regions
        for k, n in zip(missing, names, strict=True):
            region = known.get(n)
            if region is None:
                raise _error(-4, f"{what}: remote memory {n!r} is no longer registered")
            rd.resolved[k] = out[k] = region
        return out

    def postXferReq(self, reqh: int, notif_msg: Any = "") -> int:
        # Failures are counted in telemetry as NIXL counts them: all but a
        # repost refused; the request's own failure once (in _finish).
        try:
            x = self._xfers[reqh]
        except KeyError:
            self._count(-2)
            raise _error(-2, f"postXferReq: unknown transfer handle {int(reqh):#x}") from None
        return self._post_general(x, notif_msg)

    # (aioxfer extension) ``nixl_agent.transfer(handle, notif_msg)``:
    # postXferReq of a handle (anything with the request's number as
    # ``_handle``) as NIXL's state string, "DONE" or "PROC". nixl_agent binds
    # it as its ``transfer``. Compiled (_cyx.nixl_transfer): a plain repost
    # of a prepared request (x.prep) is posted without a Python frame (the
    # frame and its ~80 bytecodes were ~1.5 k instructions of a same-host
    # 4 KiB request, ~10 %); the rest comes to _transfer_py, which does all.
    xferTransfer = _cyx.nixl_transfer

    def _transfer_py(self, handle: Any, notif_msg: Any = b"") -> str:
        """xferTransfer in Python (what _cyx.nixl_transfer does for a plain
        prepared repost; keep the two in step).

        The hot path (vLLM's repost: one aioxfer call, nothing to notify, no
        telemetry) is straight-line: what does not change between posts was
        decided at creation (x.plain); everything else is _post_general's.
        Posted now, from this thread (a same-host copy may complete inside):
        what a coroutine awaiting it gets, without a wake-up of the loop
        thread. The flush the agent scheduled for the end of its loop
        iteration finds nothing to do.

        The runtime lock is taken for the post, from any thread: the post
        enters the aioxfer agent (its batch, counters, the engine's ring),
        which the loop thread drives too (it drains completions, runs the
        scheduled flush); the GIL alone makes single bytecodes atomic, not
        that sequence. (Uncontended, acquire and release cost about 0.1 µs
        together, under 1 % of a request: measured with callgrind.)"""
        x = self._xfers.get(handle._handle)
        if x is None or notif_msg or not x.plain:
            return _STATE_STR[self.postXferReq(handle._handle, notif_msg)]
        rt = self._rt
        lock = rt.lock
        lock.acquire()
        try:
            fut = x.fut
            if fut is not None and not fut.done():
                raise _error(-7, "postXferReq: the transfer is still in flight")
            if fut is not None and (fut.cancelled() or fut.exception() is not None):
                _refuse_if_moving(x)
            rem = x.remote
            # (Removing a remote bumps its gen: a remote removed, or
            # re-registered, goes to _post_general, which raises.) A peer
            # that was lost is the post's failure: see below.
            if rem is not None and rem.gen != x.gen:
                return _STATE_STR[self._post_general(x, notif_msg)]  # (raises)
            # When a tight poller decides whether to spin for it. (Before the
            # post: a large tcp request's post sends on this thread for
            # milliseconds, and stamped after it, its completion would look
            # soon and keep the poller spinning; CI caught that.)
            x.t0 = _perf_counter()
            prep = x.prep
            try:
                if prep is not None:
                    x.fut = fut = prep.post(True)  # (posted, flushed: one call)
                else:
                    flush = self._flush_fn  # (called as a method: an unspecialized lookup)
                    x.fut = fut = x.post(*x.one)
                    flush()
            except (XferError, ValueError, TypeError) as exc:
                x.fut = None
                peer = x.peer
                if peer is not None and peer.lost:
                    return _STATE_STR[self._post_general(x, notif_msg)]  # (raises)
                err = _from_xfer_error(exc, "postXferReq")
                self._count_exc(err)
                raise err from None
            # A check right after this call is a tight poll (a long post,
            # 256 tcp descriptors or 16 MiB sent from this thread, stamped
            # from its start, made the first check a mere look: PROC, and
            # one more call before the wait).
            x.last_poll = _perf_counter()
        finally:
            if rt._foreign:
                rt.leave()  # wakes the loop for what the section scheduled
            else:
                lock.release()
        if not fut.done():
            return "PROC"
        try:
            if fut.exception() is None:
                return "DONE"
        except asyncio.CancelledError:
            pass
        # Failed inside the post. A peer lost before it (its transfers fail
        # as they are submitted: no check needed before the post) raises as
        # NIXL's does, from _post_general; any other failure, as the
        # request's own.
        peer = x.peer
        if peer is not None and peer.lost:
            return _STATE_STR[self._post_general(x, notif_msg)]  # (raises)
        return _STATE_STR[self._finish(x, fut, "postXferReq")]  # (raises)

    def _repost_failed(self, x: _Xfer, exc: Exception) -> str:
        """_cyx.nixl_transfer's post raised ``exc`` (x.fut cleared, the lock
        released): raised as _transfer_py raises it."""
        if not isinstance(exc, XferError | ValueError | TypeError):
            raise exc
        peer = x.peer
        if peer is not None and peer.lost:
            return _STATE_STR[self._post_general(x, b"")]  # (raises)
        err = _from_xfer_error(exc, "postXferReq")
        self._count_exc(err)
        raise err from None

    def _repost_done(self, x: _Xfer, fut: asyncio.Future[Any]) -> str:
        """_cyx.nixl_transfer's post completed failed or cancelled inside it:
        as _transfer_py's."""
        peer = x.peer
        if peer is not None and peer.lost:
            return _STATE_STR[self._post_general(x, b"")]  # (raises)
        return _STATE_STR[self._finish(x, fut, "postXferReq")]  # (raises)

    def _post_general(self, x: _Xfer, notif_msg: Any) -> int:
        """postXferReq of anything but the hot path: a notification of the
        post's own or one that needs framing, several aioxfer calls,
        telemetry, a remote that is gone."""
        msg = _payload(notif_msg) if notif_msg else x.notif
        direct = _direct(x, msg)
        rt = self._rt
        rt.lock.acquire()
        try:
            fut = x.fut
            if fut is not None and not fut.done():
                raise _error(-7, "postXferReq: the transfer is still in flight")
            if fut is not None and (fut.cancelled() or fut.exception() is not None):
                _refuse_if_moving(x)
            rem = x.remote
            # (Removing a remote bumps its gen: one comparison covers both.)
            if rem is not None and rem.gen != x.gen:
                x.fut = None
                if rem.removed:
                    # NIXL 1.5.1: a request made before remove_remote_agent
                    # (or the peer's invalidate) is refused as NOT_FOUND, its
                    # agent's metadata gone; a peer that died is below.
                    self._count(-4)
                    raise _error(-4, f"postXferReq: remote agent '{rem.name}' was removed "
                                     f"after the transfer request was made")
                self._count(_ERR_REMOTE_DISCONNECT)
                raise _error(_ERR_REMOTE_DISCONNECT, f"postXferReq: remote agent "
                                                     f"'{rem.name}' was re-registered after "
                                                     f"the transfer request was made")
            peer = x.peer
            if peer is not None and peer.lost:
                x.fut = None
                self._count(_ERR_REMOTE_DISCONNECT)
                raise _error(_ERR_REMOTE_DISCONNECT, f"postXferReq: remote agent "
                                                     f"'{peer.name}' was disconnected after "
                                                     f"transfer request creation")
            telemetry = self._telemetry
            # (Read also when a tight poller decides whether to spin for it.)
            x.t0 = t0 = time.perf_counter()
            if telemetry:
                x.xfer_s = -1.0
                x.start_us = int(t0 * 1e6) if _PERF_IS_STEADY else time.monotonic_ns() // 1000
            try:
                if direct:
                    # One aioxfer call, posted now, from this thread (a
                    # same-host copy may complete inside): what a coroutine
                    # awaiting it gets, without a wake-up of the loop thread.
                    # The flush the agent scheduled for the end of its loop
                    # iteration finds nothing to do.
                    fut = x.post(*x.one) if not msg or x.file else x.post(*x.one, notify=msg)
                    x.fut = fut
                    self._flush_fn()
                else:
                    x.fut = fut = self._post(x, msg)
            except (XferError, ValueError, TypeError) as exc:
                x.fut = None
                err = _from_xfer_error(exc, "postXferReq")
                self._count_exc(err)
                raise err from None
            x.last_poll = now = time.perf_counter()  # (see _transfer_py)
            if telemetry:
                x.post_s = now - t0
        finally:
            if rt._foreign:
                rt.leave()  # wakes the loop for what the section scheduled
            else:
                rt.lock.release()
        if not fut.done():
            return 1  # NIXL_IN_PROG
        if not self._tel_events:
            try:
                if fut.exception() is None:
                    return 0  # NIXL_SUCCESS
            except asyncio.CancelledError:
                pass
        return self._finish(x, fut, "postXferReq")

    def _post(self, x: _Xfer, msg: bytes) -> asyncio.Future[Any]:
        """A request aioxfer does not post in one call (called with the lock
        held): several region pairs, a READ with a notification, or a
        notification that must be framed. The data goes now, from this
        thread; a task on the loop sends the notification once all of it has
        moved, and the request is done when that task is."""
        agent = self._agent
        assert agent is not None
        x.parts = []
        x.tail = None
        if x.objects:  # the object backend posts on its loop, in a task of its own
            return self._rt.spawn(self._object_io(x))
        frames = _wire.notif_frames(msg) if (msg and not x.file) else []
        if x.write and len(x.groups) == 1 and frames:
            # A WRITE carries its notification (the last frame): the frames
            # before it go first, in order, then the WRITE.
            return self._rt.spawn(self._framed_write(x, frames))
        post = agent.write if x.write else agent.read
        parts = [post(local, far) for local, far in x.groups]
        self._flush_fn()  # (the flush the parts scheduled finds nothing: see _Loop)
        # Done when every part is and then the notification was sent: a
        # future settled by whoever sees it first (a poller, from its own
        # thread; the loop thread, through the parts' callbacks, if nobody
        # polls), so that a poller needs no loop-thread round per request.
        whole: asyncio.Future[Any] = self._rt.loop.create_future()
        x.fut = whole  # (the current post's, for _advance: a repost's earlier one is done)
        x.parts = parts
        x.frames = frames
        x.notifying = False

        def advance(_: Any = None) -> None:
            self._advance(x, whole)

        self._advance(x, whole)
        if not whole.done() and not x.notifying:
            for part in parts:
                if not part.done():  # (on a done one: a loop-thread call for nothing)
                    part.add_done_callback(advance)
        return whole

    def _advance(self, x: _Xfer, whole: asyncio.Future[Any]) -> None:
        """Moves a request of several parts on (runtime lock held): once all
        of its data moved, sends its notification (a task on the loop), then
        settles ``whole``; a failed or cancelled part settles it at once."""
        if whole.done() or x.notifying or x.fut is not whole and x.fut is not None:
            return
        parts = x.parts
        for part in parts:
            if not part.done():
                return
        for part in parts:
            if part.cancelled():
                whole.cancel()
                return
            exc = part.exception()
            if exc is not None:
                whole.set_exception(exc)
                return
        if not x.frames:
            whole.set_result(time.perf_counter())
            return
        x.notifying = True
        assert x.peer is not None
        # The loop thread sends it; a poller's lingering claim would keep the
        # completion of the send from it (the poller waits for loop rounds now).
        self._rt.expire_lingering()
        task = self._rt.spawn(_notify_all(x.peer, x.frames))

        def notified(t: asyncio.Task[Any]) -> None:
            x.notifying = False
            if whole.done():
                return
            if t.cancelled():
                whole.cancel()
            elif t.exception() is not None:
                whole.set_exception(t.exception())  # type: ignore[arg-type]
            else:
                whole.set_result(time.perf_counter())

        task.add_done_callback(notified)

    async def _object_io(self, x: _Xfer) -> float:
        agent = self._agent
        assert agent is not None
        local, far = x.groups[0]
        x.tail = t = agent.write(local, far) if x.write else agent.read(local, far)
        await t
        return time.perf_counter()

    async def _framed_write(self, x: _Xfer, frames: list[bytes]) -> float:
        agent, peer = self._agent, x.peer
        assert agent is not None and peer is not None
        await asyncio.gather(*(peer.notify(f) for f in frames[:-1]))
        local, far = x.groups[0]
        x.tail = t = agent.write(local, far, notify=frames[-1])
        await t
        return time.perf_counter()

    def _denied_or_gone(self, x: _Xfer, exc: BaseException, wait: bool = True
                        ) -> BaseException:
        """A request the peer refused (its memory released): when the peer is
        closing, its connections go right after (an agent's close releases
        its memory first, then closes), and the request failed because the
        peer went away: NIXL_ERR_REMOTE_DISCONNECT, as NIXL users expect of a
        peer that left, not the BACKEND error of a deregistration. Waits for
        that at most _GONE_GRACE, once per failed post (``wait`` False: a
        future's, whose wait ran on the loop, _settle_gone, only looks). Not
        on the loop thread: the wait yields to it, which sees the close."""
        peer = x.peer
        if peer is None or x.remote is None:
            return exc
        deadline = time.monotonic() + _GONE_GRACE
        while not peer.lost:
            left = deadline - time.monotonic()
            if left <= 0 or not wait:
                return exc
            self._rt.yield_to_loop(min(left, 0.005), lambda: peer.lost)
        return PeerLost(f"{exc} (the peer left: its connection closed)")

    def _gone_unknown(self, x: _Xfer, fut: asyncio.Future[Any]) -> bool:
        """Whether the failed post ``fut`` is a refusal whose peer may yet
        turn out to be leaving (_denied_or_gone would wait)."""
        if fut.cancelled() or x.failed is fut:
            return False
        peer = x.peer
        return (isinstance(fut.exception(), AccessDenied) and peer is not None
                and x.remote is not None and not peer.lost)

    async def _settle_gone(self, x: _Xfer, fut: asyncio.Future[Any],
                           out: concurrent.futures.Future[str]) -> None:
        """xferFuture's settle of a refusal, on the loop thread: the wait of
        _denied_or_gone as a coroutine (spun there, it held the loop, which
        then could not see the close: nixlBackendError after a 50 ms stall,
        rev19 #3), then the same answer as check_xfer_state's."""
        peer = x.peer
        assert peer is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _GONE_GRACE
        while not peer.lost and loop.time() < deadline:
            await asyncio.sleep(0.005)
        self._settle_out(x, fut, out, wait=False)

    def _settle_out(self, x: _Xfer, fut: asyncio.Future[Any],
                    out: concurrent.futures.Future[str], wait: bool = True) -> None:
        """xferFuture's ``out`` from its post's outcome ``fut``."""
        if out.done():
            return
        try:
            self._finish(x, fut, "xferFuture", wait)
        except Exception as exc:  # noqa: BLE001 (handed to the awaiter)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                out.set_exception(exc)  # (unless cancelled meanwhile)
        else:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                out.set_result("DONE")

    def _finish(self, x: _Xfer, fut: asyncio.Future[Any], what: str, wait: bool = True) -> int:
        try:
            res = fut.result()
        except BaseException as exc:  # (the request's failure, or its cancel)
            if isinstance(exc, AccessDenied):
                if x.failed is not fut:
                    exc = self._denied_or_gone(x, exc, wait)
                    x.gone = isinstance(exc, PeerLost)
                elif x.gone:
                    exc = PeerLost(f"{exc} (the peer left: its connection closed)")
            err = (_error(_ERR_CANCELED, f"{what}: the transfer was cancelled")
                   if isinstance(exc, asyncio.CancelledError) else _from_xfer_error(exc, what))
            if x.failed is not fut:  # counted once per post, as NIXL's
                x.failed = fut
                self._count_exc(err)
            raise err from None
        if x.xfer_s < 0 and self._tel_events:
            # The agent's events are written as requests finish; without a
            # sink the request's own figures wait for getXferTelemetry.
            x.xfer_s = _seconds(x, res)
            tel = self._tel
            assert tel is not None
            tel.xfer(x.write, x.nbytes, *_durations(x))
        return int(NIXL_SUCCESS)

    # (aioxfer extension) ``nixl_agent.check_xfer_state(handle)``:
    # getXferStatus of a handle (anything with the request's number as
    # ``_handle``) as NIXL's state string, "DONE" or "PROC"; nixl_agent binds
    # it as its ``check_xfer_state``. Compiled (_cyx.nixl_state): a tight
    # poll of a request of one aioxfer call, its spin and the catch's
    # bookkeeping, without a Python frame (~3 µs of Python per request: the
    # gap to a coroutine's await), and a spin that did not catch then sleeps
    # on the engine's fd (_wait_sleep's, compiled); anything else goes to
    # _state_py, which does all.
    xferState = _cyx.nixl_state
    # What _cyx.nixl_state reads of this module, once per class.
    _nx_consts = (Transfer, _TIGHT_POLL, float(_SPIN_KEEP), _SPIN_MISSES, _SPIN_PROBE,
                  _LINGER, SPIN_ALONE_MAX, ALONE_MAX_US, _ENGINE_WAIT,
                  ALONE_LATENCIES * 1e6)

    def _nixl_cache(self) -> _cyx.NixlCache:
        """What xferState reads of this agent's fields per check (the
        aioxfer agent's, started), resolved once: its ``_ns``. (Remade by
        whatever changes one of those fields.)"""
        assert self._agent is not None
        return _cyx.NixlCache(self._agent, self._rt, self._fd, self._spin_us, self._spin_only,
                              self._poll_fn, self._wait_poll, self._tel_events, self._xfers)

    def _state_py(self, handle: Any) -> str:
        """xferState in Python (what _cyx.nixl_state does for a tight poll
        of a Transfer; keep the two in step)."""
        x = self._xfers.get(handle._handle)
        if x is None:
            raise _error(-2, f"getXferStatus: unknown transfer handle {int(handle._handle):#x}")
        fut = x.fut
        if fut is None:
            raise _error(-1, "getXferStatus: the transfer was not posted")
        if fut.done():
            # (Succeeded and no telemetry event to write: the usual answer
            # of a poller's last call, without _finish's frame.)
            if not self._tel_events:
                try:
                    if fut.exception() is None:
                        return "DONE"
                except asyncio.CancelledError:
                    pass
            return _STATE_STR[self._finish(x, fut, "getXferStatus")]
        now = _perf_counter()
        # Polled in a tight loop: wait for the engine's next completion (a
        # bounded spin without the GIL, then a sleep on its fd, at most
        # _ENGINE_WAIT: _wait_completion), or, for what a task on the loop
        # thread finishes, until that thread ends a round (at most
        # _TIGHT_WAIT); then take it here. Spinning in Python instead would
        # hold the interpreter the loop thread needs, and, unbounded, take a
        # core the engine's copy threads need.
        tight = now - x.last_poll < _TIGHT_POLL
        if tight and type(fut) is Transfer:
            # (The usual call: the first check after a post. The wait looks
            # at the ring first: the look below would take the lock twice.)
            self._wait_completion(_ENGINE_WAIT, fut.done, x)
            now = _perf_counter()
        else:
            rt = self._rt
            lock = rt.lock
            # Like NIXL's check, which progresses its backend: take the
            # completions the engine has now, rather than wait for the loop
            # thread to wake up and do it (skipped while the loop thread is
            # at it).
            parts = x.parts if type(fut) is not Transfer else None
            if lock.acquire(blocking=False):
                try:
                    # (A look at the ring first: an empty poll costs a system
                    # call, this a load, ~0.1 µs against ~2.5.)
                    wait_poll = self._wait_poll  # (a local: an unspecialized lookup)
                    wait_poll(0)
                    if parts:
                        self._advance(x, fut)
                finally:
                    if rt._foreign:
                        rt.leave()
                    else:
                        lock.release()
                if fut.done():
                    x.last_poll = now
                    return _STATE_STR[self._finish(x, fut, "getXferStatus")]
            if tight:
                if parts and not x.notifying:
                    self._wait_completion(_ENGINE_WAIT, fut.done, x)
                    if lock.acquire(blocking=False):
                        try:
                            self._advance(x, fut)
                        finally:
                            rt.leave()
                else:
                    rt.yield_to_loop(_TIGHT_WAIT, ready=fut.done)
                now = _perf_counter()
        return self._state_at(x, fut, now)

    def _state_at(self, x: _Xfer, fut: asyncio.Future[Any], now: float) -> str:
        """The end of a check: the poll's time noted, then "DONE" (no
        telemetry to record), the finished request's state, or "PROC"."""
        x.last_poll = now
        if fut.done():
            if not self._tel_events:
                try:
                    if fut.exception() is None:
                        return "DONE"
                except asyncio.CancelledError:
                    pass
            return _STATE_STR[self._finish(x, fut, "getXferStatus")]
        return "PROC"

    def getXferStatus(self, reqh: int) -> int:
        return 1 if self.xferState(_Number(reqh)) == "PROC" else 0

    def _wait_completion(self, timeout: float, ready: Any = None,
                         x: _Xfer | None = None) -> None:
        """Waits for the engine's next completion (not at all if ``ready()``)
        and takes it here, as the agent's "adaptive" progress waits on its
        loop: first a bounded busy-poll of the completion ring (the engine's
        calibrated poll_us, about two thread wake-ups, or for a small request
        what an awaiting coroutine would spin: _spin_budget; the GIL released, the
        runtime lock held, so the agent cannot close under it), which catches
        a small transfer's completion without any thread sleeping or waking;
        then a sleep until the engine signals one (at most ``timeout``).
        Progress "sleep" skips the first, "poll" the second (the caller asks
        again, and spins again). Only a wait for a request ``x`` (in flight)
        spins: one for notifications only sleeps (an agent with nothing in
        flight spins nothing). A request that completed later than _SPIN_KEEP
        spins after its post, _SPIN_MISSES posts running, is spun for only
        on one wait in _SPIN_PROBE (a large one: the spin would only take a
        core from the engine's threads) until one completes within that
        bound again (_spin_wanted).

        While this thread sleeps the loop thread does not watch the engine's
        fd (Runtime.claim), so a completion wakes this thread only: one
        wake-up, as for a coroutine awaiting it on the loop, rather than the
        loop thread's and then this one's. The claim lingers for _LINGER
        after the wait: a caller polling in a loop keeps the fd from one
        request to the next, and the completions of requests it posts
        meanwhile wake no thread at all (it takes them when it next asks).

        (The busy-poll and the poll after a hit are one call, Agent.wait_poll:
        the loop thread's Poller waits the same way, Engine.wait_polls.)"""
        rt = self._rt
        agent = self._agent
        if agent is None or not rt.lock.acquire(blocking=False):
            rt.yield_to_loop(min(timeout, _TIGHT_WAIT), ready=ready)
            return
        fd = self._fd
        try:
            if ready is not None and ready():
                return
            # Claimed for the spin too: the completion's eventfd write then
            # wakes no loop thread, to contend for the lock and the GIL.
            sel = rt.selector
            claimed = sel.claim(fd)
            spin_us = self._spin_us if x is not None else 0
            if x is not None and spin_us and (self._spin_only or x.spin or _spin_wanted(x)):
                if x.budget > spin_us:
                    spin_us = x.budget  # (a small request: see _note_latency)
                wait_us = spin_us
            else:
                # A look at the ring (no spin): what is there already needs
                # no sleep, nor the system calls of one.
                wait_us = 0
            try:
                wait_poll = self._wait_poll  # (a local: an unspecialized lookup)
                caught = wait_poll(wait_us)
                spun = caught or wait_us and self._spin_only
                # (A hit is polled, by wait_poll, even if the agent is
                # closing: a spin left it unsignalled, and its close waits
                # for it. A closed engine's wait finds nothing.)
                if not caught and spun and not agent.closed:
                    poll = self._poll_fn  # (a local: see xferTransfer's flush)
                    poll()
            except BaseException:
                if claimed:
                    sel.release(fd, _LINGER)
                raise
            if caught and wait_us and x is not None:
                fut = x.fut
                if fut is not None and (fut.done() if type(fut) is Transfer
                                        else _data_done(x)):
                    # Soon only if soon after its post, as for a sleep
                    # below: a spin that happens to catch the end of a
                    # long request (the probe of a 16 MiB tcp one,
                    # milliseconds after its post) is no sign that
                    # spinning for it pays (it started another run of
                    # _SPIN_MISSES spins: the test of this saw up to 20
                    # spins for ~35 waits on a loaded machine).
                    took = _perf_counter() - x.t0
                    _note_latency(x, took)
                    if took < _SPIN_KEEP * spin_us * 1e-6:
                        x.spin = True  # (_spin_outcome's soon, inline)
                        x.slow = 0
                    else:
                        _spin_outcome(x, False)
            if spun:
                if claimed:
                    sel.release(fd, _LINGER)
                return
        finally:
            if rt._foreign:
                rt.leave()
            else:
                rt.lock.release()
        self._wait_sleep(agent, fd, claimed, timeout, x, spin_us)

    def _wait_sleep(self, agent: aioxfer.Agent, fd: int, claimed: bool, timeout: float,
                    x: _Xfer | None, spin_us: int) -> None:
        """_wait_completion's sleep on the engine's fd (claimed, the runtime
        lock not held), then its bookkeeping."""
        rt = self._rt
        got: list[Any] | None = None
        woke = 0.0
        try:
            got = select.select([fd], [], [], timeout)[0]
            woke = time.perf_counter()
        except (OSError, ValueError):  # closed meanwhile
            pass
        finally:  # also on KeyboardInterrupt: the loop thread must get its fd back
            rt.lock.acquire()
            try:
                if self._agent is agent and not agent.closed:
                    self._poll_fn()  # before the loop thread may watch the fd again
            finally:
                if claimed:
                    rt.release(fd, _LINGER)
                rt.leave()
        if x is not None and spin_us and got is not None:
            # Spun for next time if it completed soon after a spin would have
            # ended (a miss by little costs the wake-up it saves); late if
            # the wait ran out; neither if what woke this thread was another
            # completion (the next wait tells).
            if not got:
                _spin_outcome(x, False)
            elif _data_done(x):
                _note_latency(x, woke - x.t0)
                _spin_outcome(x, woke - x.t0 < _SPIN_KEEP * spin_us * 1e-6)

    def xferFuture(self, reqh: int) -> concurrent.futures.Future[str]:
        """(aioxfer extension) A future of the request's current post: "DONE",
        or the exception ``check_xfer_state`` would raise. Cancelling it
        cancels the transfer (as releasing it does). Any thread; for asyncio,
        ``asyncio.wrap_future`` (what ``await handle`` does)."""
        x = self._xfers.get(int(reqh))
        if x is None:
            raise _error(-2, f"xferFuture: unknown transfer handle {int(reqh):#x}")
        out: concurrent.futures.Future[str] = concurrent.futures.Future()
        rt = self._rt
        with rt.locked():
            fut = x.fut
            if fut is None:
                raise _error(-1, "xferFuture: the transfer was not posted")
            # Nobody polls for an awaiter: the loop thread watches the fd.
            rt.expire_lingering()

            def settle(f: asyncio.Future[Any]) -> None:
                # (On the loop thread: a refusal's wait for the peer's close
                # runs as a task there, not spun in this callback.)
                if not out.done() and self._gone_unknown(x, f):
                    self._track(rt.spawn(self._settle_gone(x, f, out)))
                else:
                    self._settle_out(x, f, out)

            def cancelled(o: concurrent.futures.Future[str]) -> None:
                if o.cancelled():
                    with rt.locked():
                        if not fut.done():
                            fut.cancel()

            done = fut.done()
            if not done:
                fut.add_done_callback(settle)
                out.add_done_callback(cancelled)
        if done:
            # Here, the lock let go: on a caller's thread a refusal's wait
            # yields to the loop thread, which sees the peer's close.
            if rt.on_loop():
                settle(fut)
            else:
                self._settle_out(x, fut, out)
        return out

    def statistics(self) -> Any:
        """(aioxfer extension) The aioxfer agent's statistics() (an
        aioxfer.AgentStatistics; None before a UCX or POSIX backend exists):
        these transfers are counted there, by peer and path, as any other."""
        with self._rt.locked():
            return self._agent.statistics() if self._agent is not None else None

    def getXferTelemetry(self, reqh: int) -> nixlXferTelemetry:
        if not self._telemetry:
            raise _error(_ERR_NO_TELEMETRY, "getXferTelemetry: cannot return values when "
                                            "telemetry is not enabled.")
        x = self._xfers.get(int(reqh))
        if x is None:
            raise _error(-2, f"getXferTelemetry: unknown transfer handle {int(reqh):#x}")
        fut = x.fut
        if fut is None or not x.start_us:
            raise _error(-1, "getXferTelemetry: the transfer was not posted")
        if not fut.done():
            # NIXL gives an uninitialised record here; zeros are its intent.
            _log("E", "getXferTelemetry: Transfer is not complete yet")
            return nixlXferTelemetry()
        self._finish(x, fut, "getXferTelemetry")  # raises what the request failed with
        if x.xfer_s < 0:
            x.xfer_s = _seconds(x, fut.result())
        b = self._backends.get(x.backend)
        return nixlXferTelemetry(x.start_us, *_durations(x), x.nbytes, x.ndesc,
                                 b.type if b is not None else "")

    def estimateXferCost(self, req_handle: int) -> tuple[int, int, int]:
        x = self._xfers.get(int(req_handle))
        if x is None:
            raise _error(-2, f"estimateXferCost: unknown transfer handle {int(req_handle):#x}")
        if x.peer is None:
            return 0, 0, _COST_UNKNOWN
        st = x.peer.statistics()
        if not st.bandwidth and not st.latency:
            return 0, 0, _COST_UNKNOWN
        secs = st.latency + (x.nbytes / st.bandwidth if st.bandwidth else 0.0)
        us = round(secs * 1e6)
        return us, us // 2, _COST_UNKNOWN

    def queryXferBackend(self, reqh: int) -> int:
        x = self._xfers.get(int(reqh))
        if x is None:
            raise _error(-2, f"queryXferBackend: unknown transfer handle {int(reqh):#x}")
        return x.backend

    def releaseXferReq(self, reqh: int) -> int:
        """Frees a request. One in flight is cancelled, and the call returns
        only once the engine confirmed that nothing of it touches its memory
        any more (the cancel, or the outcome it reached first): the caller
        may reuse the memory at once (vLLM and Dynamo hand an aborted
        request's blocks to the next one). If that takes longer than
        _STOP_TIMEOUT (a peer that stalls), nixlBackendError, and the handle
        is kept: a later release tries again (nixl-api.md). On the loop
        thread, or within a section that holds the runtime lock (a handle
        dropped there), it only cancels: waiting there would hold up the
        engine's drain it waits for."""
        xfers = self._xfers
        x = xfers.pop(reqh, None)  # (atomic: no lock needed to take it out)
        if x is None:
            if self._closed:  # everything was released with the agent
                return 0
            raise _error(-2, f"releaseXferReq: unknown transfer handle {int(reqh):#x}")
        fut = x.fut
        # (A request of one aioxfer call done, not by a cancel: its record
        # was taken, nothing to wait for; the usual release, as cheap as it
        # was before the wait: measured. But for one still busy: a WRITE
        # whose pages the one-copy send handed to a same-host peer, over
        # (CQ_XFER_HELD) while the engine holds its memory until the peer
        # read or dropped them (CQ_XFER_FREED). Released at once, the
        # caller's next bytes in that buffer landed at a stopped peer once
        # it resumed (rev32: tests/test_rev32_nixl_held). Once done, busy
        # only goes from True to False: read off the loop thread, a stale
        # True only makes this release wait for nothing.)
        if fut is not None and (x.parts or x.tail is not None or not fut.done()
                                or fut.cancelled()
                                or (isinstance(fut, Transfer) and fut.busy)):
            xfers[reqh] = x  # kept while it stops, and if it cannot
            self._stop(x, reqh)
            xfers.pop(reqh, None)
            with self._rt.locked():
                _unwatched(x)
        elif fut is not None and not fut.cancelled():
            fut.exception()  # (done: nobody reads it now)
        return 0  # NIXL_SUCCESS

    def _stop(self, x: _Xfer, reqh: int) -> None:
        """releaseXferReq of a request that may be in flight: cancels what of
        its current post is not done, then waits (this thread takes the
        engine's completions, as a poller does: _wait_completion) until
        none of its aioxfer transfers is busy. Raises nixlBackendError if
        that takes past _STOP_TIMEOUT."""
        rt = self._rt
        lock = rt.lock
        # (Held by this thread already: the loop thread, or a section that
        # dropped a handle; the engine's drain must not be re-entered, nor
        # the loop held up.)
        nested = lock._is_owned()
        lock.acquire()
        try:
            fut = x.fut
            assert fut is not None
            ts = [t for t in (fut, *x.parts, x.tail) if isinstance(t, Transfer)]
            # aioxfer can always cancel: memory stays pinned until the engine
            # confirms nothing touches it any more. (Parts still running
            # after another part failed, too.)
            for t in ts:
                if not t.done():
                    t.cancel()
            if not fut.done():
                fut.cancel()
            moving = [t for t in ts if t.busy]
        finally:
            rt.leave()
        if not moving or nested:
            return

        def settled() -> bool:
            return not any(t.busy for t in moving)

        deadline = time.monotonic() + _STOP_TIMEOUT
        while not settled():
            left = deadline - time.monotonic()
            if left <= 0 or self._agent is None:
                break
            self._wait_completion(min(left, _ENGINE_WAIT * 20), settled)
        if self._agent is not None and not settled():
            self._count(int(NIXL_ERR_BACKEND))
            raise _error(int(NIXL_ERR_BACKEND),
                         f"releaseXferReq: transfer handle {int(reqh):#x} was cancelled but "
                         f"the engine did not confirm it within {_STOP_TIMEOUT:g} s (its "
                         f"memory may still be written or read); the handle is kept: "
                         f"release it again later")

    # ------------------------------------------------------------ notifications

    async def _pump_notifs(self, queue: aioxfer.Notifications) -> None:
        """Moves notifications out of the aioxfer agent's queue as they come
        (a task on the loop, lock held), so that the engine never stops
        reading a connection for them (rev19 #2): aioxfer bounds what waits
        there per connection (Limits.max_notify_per_conn) and stops reading
        that connection, its data included, until the application takes
        some; NIXL's transfers never wait for the target to read its
        notifications (a target that polls memory may never call
        getNotifs). Each message still comes after its data (the engine
        queues it only then) and in arrival order."""
        while True:
            try:
                n = await queue.receive()
            except ClosedResourceError:
                return
            try:
                self._keep_notif(n.peer_name, n.payload)
                self._take_notifs(queue)
            except Exception as exc:
                # Whatever a frame or its bookkeeping raised, the pump goes
                # on: were it to end, this agent's peers would stall again at
                # max_notify_per_conn unread notifications, and silently.
                _log_limited(("pump", id(self)), "E",
                             f"notifications: one dropped, the pump goes on: "
                             f"{type(exc).__name__}: {exc}")
            # A pause before the next wait: a target that reads its
            # notifications takes them itself (getNotifs), and a wake-up of
            # this task per notification (a callback scheduled from the
            # poster's thread, the loop thread woken) made a WRITE with a
            # notification ~1.7x slower; at most one per pause now, and what
            # a connection gathers meanwhile stays far below its
            # max_notify_per_conn.
            await asyncio.sleep(_NOTIF_PUMP_PAUSE)

    def _keep_notif(self, sender: str, frame: bytes) -> None:
        # (lock held)
        msg = self._assembler.feed(sender, frame)
        if msg is not None:
            self._notif_store.append((sender, msg))
            self._notif_held += len(msg) + _NOTIF_COST
            if self._notif_held > _NOTIF_STORE_BYTES:
                self._drop_notifs()

    def _take_notifs(self, queue: aioxfer.Notifications) -> None:
        """What the agent's queue holds, into the store (lock held)."""
        while len(queue):
            try:
                n = queue.receive_nowait()
            except (asyncio.QueueEmpty, ClosedResourceError):
                break
            self._keep_notif(n.peer_name, n.payload)

    def _drop_notifs(self) -> None:
        """Past the bound, the oldest messages go (logged at most once a
        second): memory must not grow without bound for a target that never
        reads (NIXL's would); the data path never waits for it either."""
        store = self._notif_store
        dropped = 0
        while self._notif_held > _NOTIF_STORE_BYTES and store:
            _, msg = store.popleft()
            self._notif_held -= len(msg) + _NOTIF_COST
            dropped += 1
        _log_limited(("notifications dropped", id(self)), "W", _dropped_line, dropped)

    def getNotifs(self, notif_map: dict[str, list[bytes]], backends: Any = ()
                  ) -> dict[str, list[bytes]]:
        agent = self._agent
        if agent is None:
            return notif_map
        queue = agent.notifications
        if not len(queue) and not self._notif_store:
            rt = self._rt
            # Take what the engine has now (the loop thread may not be
            # watching its fd: a tight poller's claim lingers).
            if rt.lock.acquire(blocking=False):
                try:
                    self._wait_poll(0)
                finally:
                    rt.leave()
            now = time.perf_counter()
            if len(queue) or self._notif_store:
                pass
            elif now - self._last_empty_notif < _TIGHT_POLL:
                self._wait_completion(_ENGINE_WAIT,
                                      lambda: len(queue) or self._notif_store)
            self._last_empty_notif = time.perf_counter()
            if not len(queue) and not self._notif_store:
                return notif_map
        with self._rt.locked():
            # (The pump may not have run yet: what the queue holds came after
            # what the store holds.)
            self._take_notifs(queue)
            store, self._notif_store = self._notif_store, collections.deque()
            self._notif_held = 0
        for sender, msg in store:
            notif_map.setdefault(sender, []).append(msg)
        return notif_map

    def genNotif(self, remote_agent: Any, msg: Any, backends: Any = ()) -> int:
        name = _name(remote_agent)
        payload = _payload(msg)
        try:
            peer = self._peer_of(name, "genNotif")
        except nixlNotFoundError:
            raise _error(-4, "genNotif: no specified or potential backend could send the "
                             "inter-agent notifications") from None
        frames = _wire.notif_frames(payload)
        with self._rt.locked():
            self._rt.spawn(_send_notifs(peer, frames))
        return int(NIXL_SUCCESS)

    # ------------------------------------------------------------ GPU device API

    def prepMemView(self, dlist: Any, backends: Any = ()) -> int:
        raise _error(-9, "prepMemView: the UCX GPU device API is not offered by aioxfer.nixl")

    def releaseMemView(self, mvh: int) -> None:
        raise _error(-9, "releaseMemView: the UCX GPU device API is not offered by aioxfer.nixl")

    # ------------------------------------------------------------ closing (aioxfer extension)

    def close(self) -> None:
        """Closes the agent now (NIXL does it when the agent is destroyed):
        peers see it leave, its regions are released. Idempotent."""
        if self._closed:
            return
        if self._rt.on_loop():
            self._rt.spawn(self._close_at_exit())
        else:
            self._rt.run(self._close_at_exit(), timeout=_CONNECT_TIMEOUT)

    async def _close_at_exit(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        writes = [t for t in self._store_writes if not t.done()]
        if writes:
            # Publishes and invalidates called before close are done first,
            # in their order, not cancelled with the rest: the usual "invalidate,
            # close" (or a publish, an invalidate, a close at once) otherwise
            # left the metadata of a closed agent in the store, for every
            # fetcher to find. Bounded: a store that does not answer (the
            # client's own call timeout) does not hold the close up for long.
            await asyncio.wait(writes, timeout=_STORE_DRAIN_TIMEOUT)
        pending = [t for t in self._bg if t is not asyncio.current_task()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        agent, self._agent = self._agent, None
        self._ns = None
        if self._store is not None:
            await self._store.close()
        for x in self._xfers.values():
            _unwatched(x)
        self._xfers.clear()
        self._dlists.clear()
        self._remotes.clear()
        self._regs.clear()
        tel, self._tel = self._tel, None
        self._tel_events = False
        if tel is not None:
            tel.close()  # the staged events written; the file stays, as NIXL's
        if agent is not None:
            # Connections first, memory after: a peer's request in flight then
            # fails as a disconnect (NIXL_ERR_REMOTE_DISCONNECT), what NIXL
            # users take for a peer that left; the agent's close releases the
            # memory first, and the peer saw "access denied" (deregistered).
            for peer in agent.peers:
                await peer.aclose()
            await agent.aclose()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or not hasattr(self, "_rt"):
            return
        rt = self._rt
        if not rt.thread.is_alive():
            return
        try:
            rt.loop.call_soon_threadsafe(_close_later, self._close_at_exit())
        except RuntimeError:
            pass


# NIXL's namespace when NIXL_ETCD_NAMESPACE is not set, its trailing "/"
# included: NIXL puts a "/" between namespace, agent and label whatever the
# namespace ends with, so its keys are "/nixl/agents//<agent>/<label>"
# (observed, NIXL 1.5.1). Ours are the same keys, byte for byte: a real NIXL
# agent's metadata fetched here is found, and refused as what it is, instead
# of waited for until the watch timeout under a key NIXL never writes.
_ETCD_DEFAULT_NAMESPACE = "/nixl/agents/"
# How long close waits for the store's publishes and invalidates called
# before it (the etcd client's own per-call timeout).
_STORE_DRAIN_TIMEOUT = 5.0
_FULL_LABEL = "metadata"


def _port(port: int) -> int:
    return int(port) if port else DEFAULT_COMM_PORT


def _agents_own(prefix: bytes, key: bytes) -> bool:
    """Whether ``key`` under the agent prefix ``prefix`` ("{ns}/{agent}/")
    is certainly that agent's: its label has no "/". Agent "a"'s prefix is
    also the start of every key of agent "a/b" ("{ns}/a/b/{label}"), whose
    part past "a"'s prefix always holds a "/"; a label of "a"'s that holds
    one cannot be told from those (_CentralStore.invalidate knows its own)."""
    return key.startswith(prefix) and b"/" not in key[len(prefix):]


class _CentralStore:
    """NIXL's central metadata store: etcd at NIXL_ETCD_ENDPOINTS (the first
    endpoint), keys ``{NIXL_ETCD_NAMESPACE}/{agent}/{label}`` ("metadata" for
    the whole), as NIXL writes them, with its empty "announce" key
    ``{NIXL_ETCD_NAMESPACE}/{agent}/``. The namespace is read when the agent
    is made, as NIXL does. Used from the loop thread only. Needs the aetcd
    package."""

    def __init__(self, endpoints: str, agent: str) -> None:
        first = endpoints.split(",")[0].strip()
        hostport = first.split("://", 1)[-1].rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.host = host or "127.0.0.1"
        self.port = int(port or 2379)
        self.namespace = os.environ.get("NIXL_ETCD_NAMESPACE", _ETCD_DEFAULT_NAMESPACE)
        self._agent = agent
        self._client: Any = None
        self._closed = False
        self._announced = False
        # The keys this agent put whose label holds a "/" (see _agents_own):
        # invalidate deletes them by name.
        self._odd_keys: set[bytes] = set()
        # Remote agent name -> the task watching its keys (watch_agent), and
        # the revision its metadata was last read at.
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._read_at: dict[str, int] = {}
        # publish and invalidate one at a time, in the order called (each
        # takes it first thing; asyncio.Lock serves waiters first come,
        # first served): NIXL runs them in order on its one worker. Else an
        # invalidate listing the keys before a later publish's put and
        # deleting after it took the new metadata away.
        self._order = asyncio.Lock()

    def key(self, name: str, label: str) -> str:
        return f"{self.namespace}/{name}/{label or _FULL_LABEL}"

    def prefix(self, name: str) -> bytes:
        return f"{self.namespace}/{name}/".encode()

    async def _get_client(self) -> Any:
        if self._closed:
            # (A call of the agent's after its close: a client made now, or
            # a watch started with it, would be left open for good.)
            raise RuntimeError("the agent is closed")
        if self._client is None:
            try:
                import aetcd  # type: ignore[import-untyped]
            except ImportError:
                raise RuntimeError("the central metadata store needs the aetcd package "
                                   "(pip install 'aioxfer[etcd]')") from None
            self._client = aetcd.Client(host=self.host, port=self.port, timeout=5.0)
        return self._client

    async def publish(self, label: str, value: bytes) -> None:
        """This agent's metadata under ``label``; the agent announced first
        (its empty prefix key, as NIXL writes before its first publish)."""
        async with self._order:
            client = await self._get_client()
            if not self._announced:
                await client.put(self.prefix(self._agent), b"")
                self._announced = True
            key = self.key(self._agent, label).encode()
            await client.put(key, value)
            if not _agents_own(self.prefix(self._agent), key):
                self._odd_keys.add(key)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """The value under ``key`` and the store's revision it was read at."""
        got = await (await self._get_client()).get(key.encode())
        return None if got is None else (bytes(got.value), int(got.header.revision))

    async def invalidate(self) -> int:
        """Deletes this agent's keys, no other agent's: not the whole prefix
        (NIXL's rmdir of "{ns}/a/", which took agent "a/b"'s keys with it),
        only what _agents_own says is ours, and the keys we put that it
        cannot tell. Returns how many went."""
        async with self._order:
            client = await self._get_client()
            prefix = self.prefix(self._agent)
            listed = await client.get_prefix(prefix, keys_only=True)
            mine = [bytes(kv.key) for kv in listed
                    if _agents_own(prefix, bytes(kv.key)) or bytes(kv.key) in self._odd_keys]
            for key in mine:
                await client.delete(key)
            self._odd_keys.clear()
            self._announced = False
            return len(mine)

    def watch_agent(self, name: str, since: int, gone: Callable[[str], None]) -> None:
        """Calls ``gone(name)`` (on the loop thread, once) when a key of agent
        ``name``'s is deleted at a revision after ``since``: it invalidated its
        metadata, as NIXL's fetching agent learns through its watch of the
        agent's prefix. Deletions of other agents' keys under that prefix
        (agent "a/b"'s under "a"'s) are not "a"'s, nor deletions before the
        last read of its metadata (an invalidate, a new publish, a fetch of
        it: the fetch's metadata stays). One watch per agent."""
        if self._closed:
            return
        self._read_at[name] = max(self._read_at.get(name, 0), since)
        task = self._watches.get(name)
        if task is not None and not task.done():
            return
        prefix = self.prefix(name)

        async def watch() -> None:
            from aetcd.exceptions import RevisionCompactedError  # type: ignore[import-untyped]
            from aetcd.rtypes import EventKind  # type: ignore[import-untyped]

            # The watch outlives a stream error (etcd restarted, a blip):
            # watched again from the revision after the last one seen, so a
            # deletion while it was down is still found; ended only by
            # gone() or close. Before, the first error ended it for good and
            # every later invalidation was missed.
            seen = since
            pause = 0.05
            while True:
                try:
                    client = await self._get_client()
                    events = await client.watch_prefix(prefix, start_revision=seen + 1,
                                                       kind=EventKind.DELETE)
                    try:
                        async for ev in events:
                            revision = int(ev.kv.mod_revision)
                            if (_agents_own(prefix, bytes(ev.kv.key))
                                    and revision > self._read_at.get(name, 0)):
                                self._read_at.pop(name, None)
                                gone(name)
                                return
                            seen = max(seen, revision)
                            pause = 0.05
                    finally:
                        with contextlib.suppress(Exception):
                            await events.cancel()
                    raise ConnectionError("the watch stream ended")
                except RevisionCompactedError as exc:
                    # The history since ``seen`` is gone: whether the agent
                    # invalidated in it is told by its keys now (none of its
                    # own left: it did), then watched from there.
                    _log("W", f"central store: the watch of agent {name!r}'s metadata "
                              f"missed compacted revisions: {exc}")
                    try:
                        listed = await client.get_prefix(prefix, keys_only=True)
                    except Exception:
                        pass  # (compacted again when watched again: asked again)
                    else:
                        if not any(_agents_own(prefix, bytes(kv.key)) for kv in listed):
                            self._read_at.pop(name, None)
                            gone(name)
                            return
                        seen = max(seen, int(exc.compacted_revision) - 1)
                except Exception as exc:
                    _log_limited(("etcd watch", id(self), name), "W",
                                 f"central store: the watch of agent {name!r}'s metadata "
                                 f"broke ({exc or type(exc).__name__}), watching again")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

        def done(t: asyncio.Task[None]) -> None:
            if self._watches.get(name) is t:
                del self._watches[name]
            if not t.cancelled() and t.exception() is not None:
                _log("W", f"central store: the watch of agent {name!r}'s metadata ended: "
                          f"{t.exception()}")

        task = asyncio.get_running_loop().create_task(watch())
        task.add_done_callback(done)
        self._watches[name] = task

    async def close(self) -> None:
        self._closed = True
        watches = list(self._watches.values())
        self._watches.clear()
        for t in watches:
            t.cancel()
        if watches:
            await asyncio.gather(*watches, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def _close_later(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    runtime().track_closing(task)


def _dropped_line(n: int) -> str:
    """_drop_notifs' log line, n messages dropped since the last one."""
    return (f"notifications: {n} messages nobody took dropped, the oldest first (bound: "
            f"{_NOTIF_STORE_BYTES >> 20} MiB of messages not yet taken by getNotifs, counting "
            f"{_NOTIF_COST} bytes each)")


async def _notify_all(peer: aioxfer.Peer, frames: list[bytes]) -> None:
    await asyncio.gather(*(peer.notify(f) for f in frames))


async def _send_notifs(peer: aioxfer.Peer, frames: list[bytes]) -> None:
    try:
        await asyncio.gather(*(peer.notify(f) for f in frames))
    except Exception as exc:
        _log("E", f"genNotif to {peer.name!r} failed: {exc}")


_OPS: dict[Any, nixl_xfer_op_t] = {NIXL_READ: NIXL_READ, NIXL_WRITE: NIXL_WRITE}


def _op(operation: Any) -> nixl_xfer_op_t:
    try:
        return nixl_xfer_op_t(int(operation))
    except (TypeError, ValueError):
        raise TypeError(f"operation is NIXL_READ or NIXL_WRITE, not {operation!r}") from None


def _transports(params: dict[str, str]) -> tuple[str, ...] | None:
    """aioxfer transports from the backend parameter "transports", else
    AIOXFER_NIXL_TRANSPORTS, else UCX_TLS when it names TCP only (what
    NIXL users set to force TCP)."""
    spec = params.get("transports") or os.environ.get("AIOXFER_NIXL_TRANSPORTS", "")
    if spec:
        return tuple(t.strip() for t in spec.split(",") if t.strip())
    tls = [t.strip() for t in os.environ.get("UCX_TLS", "").split(",") if t.strip()]
    if tls and all(t == "tcp" for t in tls):
        return ("tcp",)
    return None


def _memory(mem: nixl_mem_t, addr: int, nbytes: int) -> Any:
    """What aioxfer registers for a NIXL descriptor."""
    if nbytes <= 0:
        raise ValueError(f"cannot register {nbytes} bytes at {addr:#x}")
    if mem == VRAM_SEG:
        from aioxfer.cuda import DevicePointer

        return DevicePointer(addr, nbytes)
    return (ctypes.c_char * nbytes).from_address(addr)


class _Reads(Protocol):
    """What _read_authenticated reads from: a listener connection
    (_ListenConn), or a StreamReader (fuzz/fuzz_nixl_wire.py)."""

    async def readexactly(self, n: int) -> bytes | bytearray: ...


async def _read_authenticated(reader: _Reads, token: bytes, nonce: bytes,
                              proved: Callable[[], None] | None = None) -> tuple[bytes, bytes]:
    """A listener request from a client that knows ``token`` (see
    _wire.LISTEN_NONCE; ``nonce`` the greeting sent): its body and its
    body's MAC (what the reply's MAC covers); ValueError for any
    other, _wire.ListenerVersionError for a client of another listener wire
    version (a version 1 client's request read whole first: it is answered).
    ``proved()`` is called once the client has shown it holds the token (the
    length's MAC)."""
    head = await reader.readexactly(_wire.LISTEN_HEAD)
    version = _wire.notice_version(head)
    if version is not None:
        raise _wire.ListenerVersionError(
            f"a client of listener wire version {version} (this agent speaks "
            f"{_wire.WIRE_VERSION}: use one aioxfer version on both sides); it stopped at the "
            f"greeting")
    command = _wire.nixl_command(head)
    if command is not None:
        raise ValueError(f"a real NIXL agent's request (NIXLCOMM:{command}): "
                         f"{_wire.NIXL_NOT_US}")
    length = bytes(head[:4])
    older = False
    if not hmac.compare_digest(head[4:], _wire.listen_len_mac(token, nonce, length)):
        # (A second MAC only for a request the first refused: a client of
        # version 1, which does not read our greeting's version, is told
        # why, not refused as a bad token.)
        if not hmac.compare_digest(head[4:], _wire.v1_len_mac(token, nonce, length)):
            raise ValueError("a request from a client without this agent's token")
        older = True
    if proved is not None:
        proved()
    n = int.from_bytes(length, "big")
    if n > _wire.MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is over the limit")
    data = await reader.readexactly(n + _wire.LISTEN_MAC)
    if older:
        # (Read whole, so that closing after the refusal resets nothing the
        # client has not read: it would lose the refusal.)
        raise _OlderClient(
            f"a client of listener wire version 1 (an older aioxfer.nixl; this agent speaks "
            f"{_wire.WIRE_VERSION}: use one aioxfer version on both sides), told so")
    body = bytes(memoryview(data)[:n])
    mac = bytes(memoryview(data)[n:])
    if not hmac.compare_digest(mac, _wire.listen_body_mac(token, nonce, body)):
        raise ValueError("a request whose body does not match its proof")
    return body, mac


class _OlderClient(_wire.ListenerVersionError):
    """A version-1 client with the token, its request read: it is answered
    with _wire.older_client_refusal()."""


def _client_of(transport: asyncio.BaseTransport) -> str:
    """A listener client's address, as the log names it."""
    addr = transport.get_extra_info("peername")
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return "client"


class _Evicted(Exception):
    """A listener connection closed to make room for a new one (logged then)."""


class _ListenConn(asyncio.BufferedProtocol):
    """One metadata listener connection, read only as asked: the transport
    receives straight into the buffer of the one read waiting, never more
    than that read still needs, and reading stays paused while no read
    waits. So a client that has not proved the token makes the agent hold
    the 4 + LISTEN_MAC bytes it owes for the frame's head, whatever it
    sends; the rest stays in the kernel (what the socket's receive window
    took: we never read it, so it does not grow). asyncio's streams read up
    to 256 KiB a time and went on reading until 128 KiB waited: 64
    connections at a time sending garbage had the agent's allocations peak
    5.9-8.4 MiB up (its RSS 6.2-9.0 MiB) before their checks ran; now
    0.7 MiB (RSS 1.0-1.2 MiB) (tests/test_fuzz18_listener.py). A token
    holder's frame, up to _wire.MAX_FRAME, lands in one buffer of its size
    (allocated once its length was proved), no chunks to join."""

    __slots__ = ("serve", "transport", "who", "task", "evicted", "_buf", "_got", "_read",
                 "_end", "_lost", "_paused", "_drained")

    def __init__(self, serve: Callable[[_ListenConn], Coroutine[Any, Any, None]]) -> None:
        self.serve = serve
        self.transport: asyncio.Transport | None = None
        self.who = "client"
        self.task: asyncio.Task[None] | None = None
        self.evicted = False  # closed to make room for another (_ListenSlots)
        # The read waiting: its buffer, how much of it came, woken when all
        # did or no more will.
        self._buf = bytearray()
        self._got = 0
        self._read: asyncio.Future[None] | None = None
        # Why no more bytes will come (None while they may): the error,
        # _Evicted, or _EndOfStream for the client's end of its stream.
        self._end: BaseException | None = None
        self._lost = False  # the connection gone (connection_lost)
        self._paused = False  # writing (the transport's buffer is full)
        self._drained: asyncio.Future[None] | None = None

    # ------------------------------------------------ the transport's calls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()  # until a read asks for bytes
        self.who = _client_of(transport)
        # (Held here too: the loop keeps only a weak reference to a task.)
        self.task = asyncio.get_running_loop().create_task(self.serve(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        # (Called only while reading, that is while a read waits for the
        # rest of its buffer; an empty one would be a fatal error for the
        # transport, and cannot be.)
        return memoryview(self._buf)[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got >= len(self._buf):
            assert self.transport is not None
            self.transport.pause_reading()
            self._wake()

    def eof_received(self) -> bool:
        self._wake(end=True)
        return True  # (half-closed: a reply may still go out; serve closes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._wake(exc, end=True)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ------------------------------------------------ the serving task's side

    def _wake(self, exc: BaseException | None = None, end: bool = False) -> None:
        if end and self._end is None and not self.evicted:
            self._end = exc if exc is not None else _EndOfStream()
        if self._read is not None and not self._read.done():
            self._read.set_result(None)

    async def readexactly(self, n: int) -> bytearray:
        """Exactly n bytes; IncompleteReadError when the client's stream
        ends first, the connection's error when it broke, _Evicted when its
        place was given to another."""
        assert self.transport is not None
        if self._end is None and n > 0:
            self._buf, self._got = bytearray(n), 0
            self._read = asyncio.get_running_loop().create_future()
            self.transport.resume_reading()
            try:
                await self._read
            finally:
                self._read = None
                self.transport.pause_reading()  # (no read waits: cancelled, or done)
        buf, got = self._buf, self._got
        self._buf, self._got = bytearray(), 0
        if got >= n:
            return buf
        # (Not kept by this frame past here: the error's traceback keeps
        # the frame, and whoever keeps the error, a task, a log record or a
        # reference cycle, kept the read's whole buffer, zero-filled up to
        # n, where what came is all the error says.)
        partial = bytes(memoryview(buf)[:got])
        del buf
        end = self._end
        if end is None or isinstance(end, _EndOfStream):
            raise asyncio.IncompleteReadError(partial, n)
        raise end

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        if self._paused and not self._lost:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
        if self._lost:
            raise ConnectionResetError("connection lost")

    def fail(self, exc: BaseException) -> None:
        """Closes the connection now (its socket reset): its read, waiting
        or next, raises exc."""
        if self._end is None:
            self._end = exc
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Closes it once what was written has gone out; at once (reset)
        when the client does not read what it was sent."""
        t = self.transport
        if t is None:
            return
        if self._paused:
            t.abort()
            return
        if not self._lost and not t.is_closing():
            # A socket closed with bytes unread ends in a reset: what the
            # client sent that was not read (a refused request's rest,
            # typically) is read now and dropped, up to _LISTEN_DISCARD
            # bytes through one buffer for all connections, so a short one
            # ends in an orderly close as when asyncio's streams had read
            # it all. Past that, it is reset.
            sock = t.get_extra_info("socket")
            fd = -1 if sock is None else sock.fileno()
            for _ in range(_LISTEN_DISCARD // len(_LISTEN_SCRATCH) if fd >= 0 else 0):
                try:
                    if os.readv(fd, [_LISTEN_SCRATCH]) < len(_LISTEN_SCRATCH):
                        break
                except OSError:  # (nothing more now, or broken: closed alike)
                    break
        t.close()


class _ReplyConn(_ListenConn):
    """The client's side of a listener request (_request), read only as
    asked, as the listener's own connections are (_ListenConn): the
    transport receives straight into the buffer of the read waiting,
    never more than it still needs. With asyncio's streams a listener
    that answered with megabytes (an oversized or bogus length, garbage,
    bytes past its reply) made each request hold what they read ahead
    before any check ran (up to 256 KiB a read, reading on until 128 KiB
    waited: 8 requests to a flooding listener peaked 1.0 MiB up, now
    42 KiB), and a reply's whole announced length was read before the
    length was checked against what the request may get (_reply_bound: a
    Push answered with 32 MiB peaked 66 MiB, now 10 KiB;
    tests/test_fuzz19_request.py)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_no_serve)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()  # until a read asks for bytes
        self.who = _client_of(transport)  # (the listener, here)


async def _no_serve(conn: _ListenConn) -> None:
    """(_ReplyConn: the request's own task reads; nothing is served.)"""


# A reply's body is read in parts, the first this big and each next one as
# big as all before it: what a request holds follows what the listener has
# sent (at most twice that, plus this), not the length it announced. (One
# buffer of the announced length, zero-filled at once, would let a listener
# make every request hold up to _wire.MAX_FRAME by saying so.)
_REPLY_PART = 64 << 10


def _reply_bound(req: Any) -> int:
    """The most a reply to ``req`` may have: a Fetch's carries the
    listener's metadata (up to _wire.MAX_FRAME, as a Push's request);
    any other's is an acknowledgement or an error text."""
    return _wire.MAX_FRAME if isinstance(req, _wire.Fetch) else _wire.MAX_ACK


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def _read_reply(conn: _ReplyConn, bound: int, where: str,
                      tail: int = 0) -> bytes | bytearray:
    """A reply frame's body (4-byte big-endian length, then that many
    bytes) and the ``tail`` bytes after it, in one buffer: ValueError when
    the length is over ``bound`` (nothing of the body read),
    ConnectionError when the listener closes within the body or the tail
    (without ``where``: the caller adds it), IncompleteReadError within the
    length."""
    head = await conn.readexactly(4)
    n = int.from_bytes(head, "big")
    if n > bound:
        raise ValueError(f"{where}: a reply of {n} bytes announced, over the {bound} a "
                         f"reply to this request may have")
    # (The tail read with the body's last part: one read, not one more wake-up.)
    total = n + tail
    parts: list[bytearray] = []
    got = 0
    while got < total or not parts:
        try:
            parts.append(await conn.readexactly(min(total - got, max(got, _REPLY_PART))))
        except asyncio.IncompleteReadError as exc:
            got += len(exc.partial)
            break
        got += len(parts[-1])
    else:
        return parts[0] if len(parts) == 1 else b"".join(parts)
    # (Raised outside the except, what came dropped first: the error's
    # traceback keeps this frame, and its context the read's.)
    parts.clear()
    if got < n:
        raise ConnectionError(f"closed after {got} of the {n} bytes of its reply's body")
    raise ConnectionError(f"closed after its reply's body, {got - n} of the {tail} bytes "
                          f"after it")


async def _read_proved_reply(conn: _ReplyConn, bound: int, where: str, token: bytes,
                             nonce: bytes, request_mac: bytes) -> memoryview:
    """_read_reply's body (a view) and its MAC (_wire.reply_mac: the reply
    to the request whose body MAC was ``request_mac``, after the greeting
    ``nonce``): ValueError when it is not the one a holder of ``token``
    makes (nothing of the body decoded: metadata, a refusal or an
    acknowledgement from whoever answered on that port is not believed),
    ConnectionError when the listener closes within the body or the MAC."""
    data = memoryview(await _read_reply(conn, bound, where, _wire.LISTEN_MAC))
    n = len(data) - _wire.LISTEN_MAC
    body = data[:n]
    if not hmac.compare_digest(data[n:], _wire.reply_mac(
            token, nonce, request_mac, n.to_bytes(4, "big"), body)):
        del body, data  # (the error's traceback keeps this frame)
        raise ValueError(f"{where}: a reply without this agent's token (not from the agent "
                         f"that listens there, or altered on the way): refused")
    return body


# See _ListenConn.close (used on the loop thread only).
_LISTEN_DISCARD = 64 << 10
_LISTEN_SCRATCH = bytearray(16 << 10)


class _EndOfStream(Exception):
    """_ListenConn: its client closed its side."""


class _ListenSlots:
    """The metadata listener's connections being served: at most
    _wire.MAX_LISTEN_CONNS. When all are taken, a new connection takes the
    place of the oldest one that has not proved the token (closed, logged);
    only when every one has is the new one refused. Refusing it whatever the
    others were let MAX_LISTEN_CONNS clients without the token, connected and
    trickling a byte at a time (or none), keep a client with it out for as
    long as the listener's request timeout, again and again. Now they would
    have to open MAX_LISTEN_CONNS connections between a token holder's
    connect and its first bytes (one round trip). (Measured against another
    process holding 300 connections, opening ~150 a second: 1 refusal in
    ~3,000 requests with the token; 2 of 3 were refused when a connection
    had 1 s to prove the token before it could be pushed out.)"""

    __slots__ = ("live", "waiting")

    def __init__(self) -> None:
        self.live: set[asyncio.Task[Any]] = set()
        # Those that have not proved the token, oldest first.
        self.waiting: dict[asyncio.Task[Any], _ListenConn] = {}

    def admit(self, task: asyncio.Task[Any], conn: _ListenConn,
              log: Callable[[str], None]) -> bool:
        if len(self.live) >= _wire.MAX_LISTEN_CONNS:
            if not self.waiting:
                log(f"{conn.who}: refused, {_wire.MAX_LISTEN_CONNS} connections at once, each "
                    f"with the token")
                return False
            old, old_conn = next(iter(self.waiting.items()))
            self.release(old)
            # Its socket closed now; its task ends at its read, quietly (not
            # cancelled: the task's close path is the same either way, and
            # its read says why).
            old_conn.evicted = True
            old_conn.fail(_Evicted())
            log(f"{old_conn.who}: closed to make room for {conn.who} "
                f"({_wire.MAX_LISTEN_CONNS} connections at once; it was the oldest that had "
                f"not proved the token)")
        self.live.add(task)
        self.waiting[task] = conn
        return True

    def proved(self, task: asyncio.Task[Any]) -> None:
        self.waiting.pop(task, None)

    def release(self, task: asyncio.Task[Any]) -> None:
        self.live.discard(task)
        self.waiting.pop(task, None)


# Listener warnings written per window at most (_LISTEN_LOG_BURST per
# _LISTEN_LOG_WINDOW seconds); the next one written says how many were left
# out (a client looping connect-close made a line each). The window is read
# at each warning: tests shorten it rather than sleep a second past it.
_LISTEN_LOG_BURST = 10
_LISTEN_LOG_WINDOW = 1.0


class _ListenLog:
    """The metadata listener's warnings, at most _LISTEN_LOG_BURST a window."""

    __slots__ = ("window", "n", "left_out")

    def __init__(self) -> None:
        self.window = -1
        self.n = 0
        self.left_out = 0

    def __call__(self, message: str) -> None:
        window = int(time.monotonic() / _LISTEN_LOG_WINDOW)
        if window != self.window:
            self.window, self.n = window, 0
        self.n += 1
        if self.n > _LISTEN_LOG_BURST:
            self.left_out += 1
            return
        if self.left_out:
            message += f" ({self.left_out} more listener warnings not logged)"
            self.left_out = 0
        _log("W", f"metadata listener: {message}")


def _refuse_if_moving(x: _Xfer) -> None:
    """A repost of ``x`` whose last post ended cancelled (future().cancel(),
    a release that only cancelled) or failed (a part failed, others still
    running) is refused while the engine may still move that post's bytes
    (rev19 #1's repost case): the old data could land over the new. Its
    Transfers tell (busy until the engine confirms). Lock held."""
    fut = x.fut
    for t in (fut, *x.parts, x.tail):
        if isinstance(t, Transfer) and t.busy:
            raise _error(-7, "postXferReq: the transfer's previous post was cancelled or "
                             "failed, but the engine has not confirmed yet that it no longer "
                             "moves its data: retry")


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()


def _unwatched(x: _Xfer) -> None:
    """The request's outcome will be read by nobody (its handle released,
    its agent or its remote gone): its failure is retrieved here, not
    reported at garbage collection ("Transfer exception was never
    retrieved" on stderr: asyncio's, which NIXL users do not know). Lock
    held."""
    for f in (x.fut, *(x.parts or ()), x.tail):
        if isinstance(f, asyncio.Future):
            if f.done():
                _retrieve(f)
            else:
                f.add_done_callback(_retrieve)


def _notif_dropped(sender: str, nbytes: int) -> None:
    _log("W", f"notifications: a message of agent {sender!r} never finished, dropped with the "
              f"{nbytes} bytes of it received (bounds: {_wire._MAX_PARTIAL} messages, "
              f"{_wire._MAX_PARTIAL_BYTES >> 20} MiB per sender)")


def _write_frame(writer: _ListenConn, data: bytes) -> None:
    writer.write(len(data).to_bytes(4, "big") + data)

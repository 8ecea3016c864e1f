"""CUDA memory: is CUDA here, and what GPU memory an object describes.

aioxfer talks to the CUDA driver itself (loaded at run time by the native
engine), so it never imports torch or cupy and never fails to import where
there is no driver: ``status()`` then says why CUDA is absent.

What ``Agent.register`` accepts as GPU memory (region kind "cuda"):

- objects with ``__cuda_array_interface__`` (versions 2 and 3: PyTorch and
  CuPy tensors, Numba arrays), C-contiguous;
- DLPack producers (``__dlpack__`` / ``__dlpack_device__``) whose device is
  CUDA (kDLCUDA); DLPack host tensors (kDLCPU, kDLCUDAHost) are host memory
  (through their buffer export where they have one, else by pointer). The
  DLPack 1.0 protocol is asked first (``max_version=(1, 0)``), the legacy one
  of producers that predate it;
- ``DevicePointer(ptr, nbytes)``: a raw device pointer with its size, and an
  optional ``owner`` object that keeps the memory alive;
- ``DeviceBuffer(nbytes)``: memory allocated here through the driver (for
  tools and tests without a CUDA library of their own).

The driver is ``libcuda.so.1``; ``AIOXFER_CUDA_DRIVER`` names another library
(the tests load native/tests/fakecuda.c, a software stand-in, through it).

Read-only memory (a DLPack 1.0 export flagged READ_ONLY, a CUDA array
interface whose ``data`` says read-only, ``DevicePointer(readonly=True)``)
registers READ-only: peers may read it, never write it, and no READ of this
agent lands in it.

The registered object is held until the engine confirms nothing touches its
memory any more. aioxfer copies on its own CUDA streams: memory your kernels
write must be complete (``torch.cuda.synchronize()`` or an event) before a
transfer reads it, as with any other consumer.

Contexts: aioxfer never changes the calling thread's current context, and
its own streams, events, IPC mappings and host pins live in each device's
*primary* context, which it retains for the life of the process. An
application that uses only contexts of its own (``cuCtxCreate``) therefore
gets the device's primary context activated (on real hardware, hundreds of
MB of device memory for its state) at the first transfer that copies on that
device. Registering, exporting or describing memory does not activate it
(allocating a ``DeviceBuffer`` does: it allocates there); where the primary
context is active already (the runtime API, PyTorch, CuPy) retaining it
costs only a count. Why not the application's context: the application may
destroy it whenever it likes, and the driver then frees everything made in
it, under every engine of the process; the primary context is one aioxfer
holds a reference on.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from aioxfer import _cyx

__all__ = [
    "DeviceBuffer",
    "DeviceInfo",
    "DevicePointer",
    "GpuMemory",
    "describe",
    "device_info",
    "devices",
    "inspect",
    "status",
]

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3


def status() -> tuple[bool, str]:
    """(available, one line): the driver and device count, or why CUDA is absent."""
    st, why, _ = _cyx.cuda_probe()
    return st == _cyx.OK, why


def devices() -> list[str]:
    """The CUDA devices this process sees, by name ("0: NVIDIA H200"); [] without CUDA."""
    st, _, n = _cyx.cuda_probe()
    if st != _cyx.OK:
        return []
    return [f"{i}: {_cyx.cuda_device_name(i)}" for i in range(n)]


@dataclass(frozen=True)
class DeviceInfo:
    """What a CUDA device offers the transports: ``dmabuf`` (GPUDirect RDMA
    without nvidia-peermem), its PCI address (for GPU-NIC affinity) and the
    devices it reaches peer-to-peer (NVLink / PCIe P2P)."""

    ordinal: int
    name: str
    dmabuf: bool
    pci: str
    peers: tuple[int, ...]


def device_info() -> list[DeviceInfo]:
    """One entry per visible CUDA device; [] without CUDA."""
    st, _, n = _cyx.cuda_probe()
    if st != _cyx.OK:
        return []
    out = []
    for i in range(n):
        dmabuf, pci, mask = _cyx.cuda_device_info(i)
        peers = tuple(j for j in range(n) if mask >> j & 1)
        out.append(DeviceInfo(i, _cyx.cuda_device_name(i), dmabuf, pci, peers))
    return out


def describe(ptr: int, nbytes: int) -> tuple[bool, str]:
    """(registrable as GPU memory, one line saying what [ptr, ptr+nbytes) is):
    managed memory, a range past its mapping and host memory say so."""
    st, why = _cyx.cuda_describe(ptr, nbytes)
    return st == _cyx.OK, why


@dataclass(frozen=True)
class DevicePointer:
    """A raw CUDA device pointer and its size, registered as GPU memory.

    ``owner``: any object that keeps the memory alive (held while registered).
    The range must lie inside one CUDA allocation (checked at registration).
    """

    ptr: int
    nbytes: int
    owner: Any = None
    readonly: bool = False


class DeviceBuffer:
    """GPU memory allocated through the driver (cuMemAlloc): for tools and tests
    that have no CUDA library. Register it like any CUDA array; ``close()``
    frees it (once its regions are released: see ``close``). A region
    registered by any other object that describes memory inside it (a
    ``DevicePointer(buf.ptr + off, n)``, a tensor over it) counts as one of
    its regions too."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        if nbytes <= 0:
            raise ValueError("a DeviceBuffer needs a positive size")
        self.nbytes = int(nbytes)
        self.device = int(device)
        # Regions of it not yet released by their engine (ids, kept by
        # aioxfer.registration): close() frees it only after the last.
        self._regions: set[int] = set()
        self._closing = False
        self.ptr = _cyx.cuda_alloc(self.device, self.nbytes)
        _LIVE_BUFFERS[self.ptr] = self

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (0 if self._closing else self.ptr, False),  # closed: nothing to register
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def upload(self, data: Any, offset: int = 0) -> None:
        """Copies a host buffer into the device memory at offset (synchronous)."""
        mv = memoryview(data).cast("B")
        self._check(offset, mv.nbytes)
        holder = (ctypes.c_char * mv.nbytes).from_buffer_copy(mv) if mv.readonly else None
        addr = (
            ctypes.addressof(holder)
            if holder is not None
            else ctypes.addressof(ctypes.c_char.from_buffer(mv))
        )
        _cyx.cuda_copy(self.ptr + offset, addr, mv.nbytes)

    def download(self, offset: int = 0, nbytes: int | None = None) -> bytes:
        """A host copy of nbytes of device memory from offset (synchronous)."""
        n = self.nbytes - offset if nbytes is None else nbytes
        self._check(offset, n)
        out = ctypes.create_string_buffer(n)
        _cyx.cuda_copy(ctypes.addressof(out), self.ptr + offset, n)
        return out.raw

    def _check(self, offset: int, n: int) -> None:
        if self.ptr == 0 or self._closing:
            raise ValueError("DeviceBuffer is closed")
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise IndexError(f"[{offset}:+{n}] is out of bounds for {self.nbytes} bytes")

    def close(self) -> None:
        """Frees the memory; while a region of it is not yet released by its
        engine (deregistered and its release not awaited, or the agent not
        closed yet), only once that happens: freed under the engine, a copy
        still under way (or a peer's IPC mapping) would reach memory the
        driver may have handed to someone else. Closed at once either way."""
        self._closing = True
        if self.ptr and not self._regions:
            ptr, self.ptr = self.ptr, 0
            if _LIVE_BUFFERS.get(ptr) is self:
                del _LIVE_BUFFERS[ptr]
            _cyx.cuda_free(ptr)

    def _released(self, region: int) -> None:
        """aioxfer.registration: the engine released region ``region``
        (an id) of this buffer; a close() deferred until then frees it now.

        Raises NativeError when that free fails (a driver poisoned by a
        sticky error refuses every call): the memory is the driver's then,
        and this buffer is closed either way."""
        self._regions.discard(region)
        if self._closing:
            self.close()

    def __repr__(self) -> str:
        return f"<DeviceBuffer {self.nbytes} bytes on device {self.device} at {self.ptr:#x}>"


# Open DeviceBuffers by allocation base (weakly: a buffer dropped unclosed
# is never freed, as before, and never found here again).
_LIVE_BUFFERS: weakref.WeakValueDictionary[int, DeviceBuffer] = weakref.WeakValueDictionary()


def buffer_at(base: int) -> DeviceBuffer | None:
    """The open (not yet freed) DeviceBuffer whose allocation starts at
    ``base`` (an allocation base, as ``_cyx.cuda_pointer`` reports it)."""
    return _LIVE_BUFFERS.get(base)


@dataclass(frozen=True)
class GpuMemory:
    """What ``inspect`` found: memory at ``ptr`` of ``nbytes``, ``kind`` "cuda"
    (a device pointer) or "host" (a host pointer from DLPack)."""

    kind: Literal["cuda", "host"]
    ptr: int
    nbytes: int
    readonly: bool


class NotContiguous(ValueError):
    pass


def inspect(obj: Any) -> GpuMemory | None:
    """The memory an object describes by pointer (CUDA array interface, DLPack,
    DevicePointer), or None for objects registered through the buffer protocol.

    Raises ValueError (NotContiguous for strided arrays) when the description is
    unusable. Nothing here touches the memory or needs a driver."""
    if isinstance(obj, DevicePointer):
        if obj.ptr <= 0 or obj.nbytes <= 0:
            raise ValueError("a DevicePointer needs a non-null pointer and a positive size")
        return GpuMemory("cuda", int(obj.ptr), int(obj.nbytes), bool(obj.readonly))
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(cai)
    if hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) == KDL_CUDA:
            return _from_dlpack(obj, "cuda")
        if int(dev_type) in (KDL_CPU, KDL_CUDA_HOST):
            try:
                memoryview(obj).release()
                return None  # a buffer export: the usual host path pins it
            except TypeError:
                return _from_dlpack(obj, "host")
        raise ValueError(f"DLPack device type {dev_type} is neither CUDA nor host memory")
    return None


def _from_cai(cai: dict[str, Any]) -> GpuMemory:
    version = int(cai.get("version", 0))
    if version < 2:
        raise ValueError(f"__cuda_array_interface__ version {version} (2 or 3 needed)")
    if cai.get("mask") is not None:
        raise ValueError("masked CUDA arrays cannot be registered")
    shape = tuple(int(n) for n in cai["shape"])
    itemsize = int(str(cai["typestr"])[2:])
    ptr, readonly = cai["data"]
    count = math.prod(shape)
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, tuple(int(s) for s in strides), itemsize):
        raise NotContiguous(f"strides {tuple(strides)} are not C-contiguous for shape {shape}")
    nbytes = count * itemsize
    if nbytes <= 0 or not ptr:
        raise ValueError("cannot register an empty CUDA array")
    return GpuMemory("cuda", int(ptr), nbytes, bool(readonly))


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether byte ``strides`` lay ``shape`` out as one C-order block. The
    stride of a dimension of size 1 is never stepped over, so any value is
    fine there (a transposed column vector: shape (1, N), strides (1, 1)),
    as numpy, PyTorch and DLPack producers leave it arbitrary; an array of
    at most one element has no layout at all (its strides say nothing: an
    empty one is refused as empty, later)."""
    if len(strides) != len(shape):
        return False
    if math.prod(shape) <= 1:
        return True
    step = itemsize
    for n, stride in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and stride != step:
            return False
        step *= n
    return True


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """dlpack.h DLTensor, the first member of DLManagedTensor ("dltensor" capsules)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    """dlpack.h (1.0) DLManagedTensorVersioned ("dltensor_versioned" capsules)."""

    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


# DLManagedTensorVersioned.flags (dlpack.h 1.0)
DLPACK_FLAG_READ_ONLY = 1 << 0
DLPACK_FLAG_IS_COPIED = 1 << 1
_DLPACK_MAX_VERSION = (1, 0)  # the newest layout parsed here

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def _dlpack_export(obj: Any) -> tuple[Any, _DLTensor, bool]:
    """(capsule, its tensor, read-only) of obj's DLPack export.

    The versioned protocol first (``max_version=(1, 0)``): only its
    DLManagedTensorVersioned says whether the tensor is read-only (numpy 2
    refuses a read-only array's export through the legacy protocol, which
    cannot say so). A producer that predates it (``__dlpack__`` takes no
    ``max_version``: TypeError) is asked the legacy way; a legacy capsule is
    writable memory, as DLPack before 1.0 had no other kind."""
    try:
        capsule = obj.__dlpack__(max_version=_DLPACK_MAX_VERSION)
    except TypeError:
        capsule = obj.__dlpack__()
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        addr = _capsule_pointer(capsule, name)
        if not addr:
            raise ValueError("__dlpack__ returned no tensor")
        m = _DLManagedTensorVersioned.from_address(addr)
        if m.version.major > _DLPACK_MAX_VERSION[0]:
            # (the producer ignored max_version: a layout we cannot read)
            raise ValueError(f"DLPack {m.version.major}.{m.version.minor} tensor: "
                             f"version {_DLPACK_MAX_VERSION[0]} asked for")
        if m.flags & DLPACK_FLAG_IS_COPIED:
            # Memory of the capsule's own, freed with it when it is dropped
            # below: registered, peers would reach freed memory.
            raise ValueError("the DLPack export is a copy, not the object's own memory")
        return capsule, m.dl_tensor, bool(m.flags & DLPACK_FLAG_READ_ONLY)
    if name == b"dltensor":
        addr = _capsule_pointer(capsule, name)
        if not addr:
            raise ValueError("__dlpack__ returned no tensor")
        return capsule, _DLTensor.from_address(addr), False
    raise ValueError(f"__dlpack__ returned a capsule named {name!r}, not a DLPack tensor")


def _from_dlpack(obj: Any, kind: Literal["cuda", "host"]) -> GpuMemory:
    # The capsule is read and dropped unconsumed (its destructor calls the
    # producer's deleter); the registered object itself keeps the memory alive.
    capsule, t, readonly = _dlpack_export(obj)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    # Bits, not bytes, per element: DLPack packs sub-byte types (float4_e2m1fn
    # is 4 bits, float6_e3m2fn 6), so N of them take ceil(N * bits / 8) bytes.
    # Rounding each element up to a byte registered up to twice the memory
    # the tensor has, and peers could write past its allocation.
    bits = t.dtype.bits * t.dtype.lanes
    count = math.prod(shape)
    if t.strides:  # NULL: C-contiguous (DLPack before 1.0 allows it)
        strides = tuple(t.strides[i] for i in range(t.ndim))  # in elements
        if not _c_contiguous(shape, strides, 1):
            raise NotContiguous(
                f"DLPack strides {strides} (elements) are not C-contiguous for shape {shape}"
            )
    nbytes = (count * bits + 7) // 8
    ptr = (t.data or 0) + t.byte_offset
    del t, capsule
    if nbytes <= 0 or not ptr:
        raise ValueError("cannot register an empty DLPack tensor")
    # Read-only (DLPACK_FLAG_READ_ONLY): peers may READ it, never WRITE it,
    # and no transfer of ours lands in it (the region's access says so).
    return GpuMemory(kind, ptr, nbytes, readonly)

"""Registered memory (Region, Segment, SegmentList) and peers' memory
(RemoteRegion, RemoteSegment).

A Region is made by ``Agent.register`` / ``Agent.alloc``; a RemoteRegion by
``Peer.region``. Slicing either with ``[a:b]`` gives a segment: one contiguous
byte range, checked against the region's bounds here (the engine checks again,
natively, before memory is touched). A SegmentList is many ranges of one region
as two numpy arrays, so a large batch never becomes one Python object per
descriptor.
"""

from __future__ import annotations

import mmap
import operator
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from aioxfer._cyx import HostView
from aioxfer._cyx import pair_descs as _pair_descs
from aioxfer.errors import ClosedResourceError

if TYPE_CHECKING:
    from aioxfer.agent import Agent
    from aioxfer.cuda import DeviceBuffer
    from aioxfer.metadata import CudaExport
    from aioxfer.peer import Peer

__all__ = ["Region", "RemoteRegion", "RemoteSegment", "Segment", "SegmentList"]

# What memory a local region is: host memory (any buffer), a file's bytes
# (Agent.register_file), or GPU memory (reachable only over the "cuda" path).
RegionKind = Literal["host", "file", "cuda"]

U64 = npt.NDArray[np.uint64]
_U64 = np.dtype(np.uint64)  # a uint64 array's dtype (compared by identity)


def _bounds(key: object, nbytes: int, what: str) -> tuple[int, int]:
    """[a:b] of a region of nbytes as (offset, length); negative indices count
    from the end as usual, but out-of-range bounds raise instead of clipping."""
    if not isinstance(key, slice):
        raise TypeError(f"{what} is sliced with [start:stop] (byte offsets), not {key!r}")
    if key.step is not None:
        raise ValueError(f"{what} slices take no step")
    try:  # operator.index: a float or str bound is a TypeError, not an AttributeError
        start = 0 if key.start is None else operator.index(key.start)
        stop = nbytes if key.stop is None else operator.index(key.stop)
    except TypeError:
        raise TypeError(
            f"{what} slice bounds must be integers (byte offsets), not "
            f"[{key.start!r}:{key.stop!r}]"
        ) from None
    if start < 0:
        start += nbytes
    if stop < 0:
        stop += nbytes
    if not 0 <= start <= stop <= nbytes:
        raise IndexError(f"[{key.start}:{key.stop}] is out of bounds for {what} of {nbytes} bytes")
    return start, stop - start


class Region:
    """Memory registered with an agent: peers may read it, and write it when the
    buffer is writable (``access`` has ACCESS_WRITE).

    The buffer stays pinned (a bytearray cannot be resized) while registered and
    until the engine confirms nothing touches it any more.
    """

    __slots__ = (
        "_agent",
        "name",
        "rid",
        "key",
        "nbytes",
        "access",
        "addr",
        "_obj",
        "_memfd",
        "_memfd_ino",
        "_released",
        "_mmap",
        "_closed",
        "kind",
        "direct",
        "_cuda",
        "_devbuf",
        "__weakref__",
    )

    def __init__(
        self,
        agent: Agent,
        name: str,
        rid: int,
        key: int,
        nbytes: int,
        access: int,
        addr: int,
        obj: Any,
        memfd: int = -1,
        memfd_ino: int = 0,
        mm: mmap.mmap | None = None,
        kind: RegionKind = "host",
    ) -> None:
        self._agent = agent
        self.name = name
        self.rid = rid
        self.key = key
        self.nbytes = nbytes
        self.access = access
        self.addr = addr
        self._obj = obj
        self._memfd = memfd
        self._memfd_ino = memfd_ino
        self._released: Awaitable[None] | None = None  # deregister()'s answer
        self._mmap = mm
        self._closed = False
        self.kind: RegionKind = kind  # "file": Agent.register_file (obj: the path)
        self.direct = False  # a file region opened with O_DIRECT
        self._cuda: CudaExport | None = None  # cuda: what same-host peers map it by
        # cuda: the DeviceBuffer whose allocation it lies in (whatever object
        # registered it), told once the engine released it: its close()
        # frees the memory only after its last region's release.
        self._devbuf: DeviceBuffer | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def agent(self) -> Agent:
        return self._agent

    @property
    def obj(self) -> Any:
        """The registered object (for ``alloc``'d regions, the shared mmap)."""
        return self._obj

    @property
    def writable(self) -> bool:
        from aioxfer import _cyx

        return bool(self.access & _cyx.ACCESS_WRITE)

    @property
    def memoryview(self) -> memoryview:
        """A byte view of the whole region (format "B", length nbytes)."""
        self._check()
        if self.kind != "host":
            raise TypeError(f"region {self.name!r} is {self.kind} memory: no host bytes to view")
        try:
            mv = memoryview(self._obj)
        except TypeError:
            if not hasattr(self._obj, "__dlpack__"):
                raise
            # Registered by pointer (a DLPack CPU tensor: no buffer export):
            # a view of the registered bytes that holds the tensor, so the
            # memory outlives every view made of it, as a buffer's does.
            # Read-only as the registration is: never a way to write memory
            # that peers may only read.
            return memoryview(HostView(self._obj, self.addr, self.nbytes, not self.writable))
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        return mv

    def numpy(self, dtype: npt.DTypeLike = np.uint8) -> npt.NDArray[Any]:
        """A 1-D numpy view of the region's memory (no copy)."""
        return np.frombuffer(self.memoryview, dtype=dtype)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> Segment:
        self._check()
        off, length = _bounds(key, self.nbytes, f"region {self.name!r}")
        return Segment(self, off, length)

    def segments(self, offsets: npt.ArrayLike, lengths: npt.ArrayLike) -> SegmentList:
        """``SegmentList(self, offsets, lengths)``."""
        return SegmentList(self, offsets, lengths)

    def close(self) -> Awaitable[None]:
        """Deregisters the region (same as ``agent.deregister(region)``)."""
        return self._agent.deregister(self)

    def _check(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"region {self.name!r} is closed")

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        kind = "" if self.kind == "host" else f" kind={self.kind}"
        return f"<Region {self.name!r} rid={self.rid} nbytes={self.nbytes}{kind}{state}>"


class RemoteRegion:
    """A region registered by a peer, as its metadata describes it."""

    __slots__ = (
        "peer",
        "name",
        "rid",
        "key",
        "nbytes",
        "access",
        "addr",
        "memfd",
        "_gone",
        "kind",
        "__weakref__",
    )

    def __init__(
        self,
        peer: Peer,
        name: str,
        rid: int,
        key: int,
        nbytes: int,
        access: int,
        addr: int = 0,
        memfd: int = -1,
    ) -> None:
        self.peer = peer
        self.name = name
        self.rid = rid
        self.key = key
        self.nbytes = nbytes
        self.access = access
        self.addr = addr
        self.memfd = memfd
        self._gone = False
        self.kind = "host"  # or "cuda": reachable only over the "cuda" path

    @property
    def gone(self) -> bool:
        """True once a ``peer.refresh()`` found the peer deregistered it."""
        return self._gone

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> RemoteSegment:
        off, length = _bounds(key, self.nbytes, f"remote region {self.name!r}")
        return RemoteSegment(self, off, length)

    def segments(self, offsets: npt.ArrayLike, lengths: npt.ArrayLike) -> SegmentList:
        """``SegmentList(self, offsets, lengths)``."""
        return SegmentList(self, offsets, lengths)

    def __repr__(self) -> str:
        state = " gone" if self._gone else ""
        return (
            f"<RemoteRegion {self.name!r} of {self.peer.name!r} rid={self.rid} "
            f"nbytes={self.nbytes}{state}>"
        )


class Segment:
    """``region[a:b]``: bytes [offset, offset + length) of a local region."""

    __slots__ = ("region", "offset", "length")

    def __init__(self, region: Region, offset: int, length: int) -> None:
        self.region = region
        self.offset = offset
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> Segment:
        off, length = _bounds(key, self.length, "segment")
        return Segment(self.region, self.offset + off, length)

    @property
    def memoryview(self) -> memoryview:
        return self.region.memoryview[self.offset : self.offset + self.length]

    def numpy(self, dtype: npt.DTypeLike = np.uint8) -> npt.NDArray[Any]:
        return np.frombuffer(self.memoryview, dtype=dtype)

    def __repr__(self) -> str:
        return f"<Segment {self.region.name!r}[{self.offset}:{self.offset + self.length}]>"


class RemoteSegment:
    """``remote[a:b]``: bytes [offset, offset + length) of a peer's region."""

    __slots__ = ("region", "offset", "length")

    def __init__(self, region: RemoteRegion, offset: int, length: int) -> None:
        self.region = region
        self.offset = offset
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> RemoteSegment:
        off, length = _bounds(key, self.length, "remote segment")
        return RemoteSegment(self.region, self.offset + off, length)

    def __repr__(self) -> str:
        return (
            f"<RemoteSegment {self.region.peer.name}:{self.region.name!r}"
            f"[{self.offset}:{self.offset + self.length}]>"
        )


class SegmentList:
    """Many byte ranges of one region (local or remote), as numpy arrays.

    ``offsets`` and ``lengths`` are 1-D, equal-length, non-negative integer
    arrays (converted to uint64 once, here); every range must lie inside the region.
    Checked with whole-array operations: no per-descriptor Python work.
    The arrays kept are the list's own: a uint64 array given is copied, so
    changing it afterwards changes nothing here.
    """

    __slots__ = ("region", "offsets", "lengths", "nbytes")

    region: Region | RemoteRegion
    offsets: U64
    lengths: U64
    nbytes: int

    def __init__(
        self,
        region: Region | RemoteRegion,
        offsets: npt.ArrayLike,
        lengths: npt.ArrayLike,
    ) -> None:
        if not isinstance(region, Region | RemoteRegion):
            raise TypeError(f"SegmentList needs a Region or RemoteRegion, not {type(region)}")
        if isinstance(region, Region):
            region._check()
        offs = _u64(offsets, "offsets")
        lens = _u64(lengths, "lengths")
        if offs.shape != lens.shape:
            raise ValueError(
                f"offsets and lengths differ in length ({offs.shape[0]} != {lens.shape[0]})"
            )
        n = offs.shape[0]
        if n:
            ends = offs + lens  # uint64: an overflowing sum wraps below its offset
            if bool((ends < offs).any()) or int(ends.max()) > region.nbytes:
                bad = int(np.flatnonzero((ends < offs) | (ends > region.nbytes))[0])
                raise IndexError(
                    f"segment {bad} [{int(offs[bad])}:+{int(lens[bad])}] is out of bounds "
                    f"for region {region.name!r} of {region.nbytes} bytes"
                )
            total = int(lens.sum(dtype=np.uint64))
        else:
            total = 0
        self.region = region
        self.offsets = offs
        self.lengths = lens
        self.nbytes = total

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def __repr__(self) -> str:
        return f"<SegmentList {self.region.name!r} n={len(self)} nbytes={self.nbytes}>"



def pair_descs(local: SegmentList, lrid: int, far: SegmentList, frid: int, fkey: int,
               far_name: str) -> U64:
    """The (n, 6) descriptor array of two equal SegmentLists, local and far
    (remote, or a file region), with their checks: as many segments on both
    sides, none empty, lengths pairwise equal. ``far_name`` names the far side
    in the errors ("remote", "file"). Compiled (_cyx.pair_descs): one pass over
the four arrays instead of ~10 numpy calls per request."""
    return _pair_descs(local.offsets, local.lengths, far.offsets, far.lengths, lrid, frid,
                       fkey, far_name)

def _u64(a: npt.ArrayLike, what: str) -> U64:
    """``a`` as a 1-D uint64 array of the SegmentList's own: a uint64 array
    (or a view of one, or a buffer) is copied, or a change the caller made
    to it after the bounds were checked here would reach the engine
    unchecked by us (the engine refuses it, as AccessDenied at completion,
    not IndexError here). Copying costs no more than the conversion calls
    it replaces (~0.2 us for 16 offsets: reg31's A/B)."""
    if type(a) is np.ndarray and a.dtype is _U64 and a.ndim == 1:
        own: U64 = a.copy()  # (C-contiguous)
        return own
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, not of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, dtype=np.uint64)
        raise TypeError(f"{what} must be integers, not {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what} must not be negative")
    out = np.ascontiguousarray(arr, dtype=np.uint64)
    if out is a or out.base is not None:
        out = out.copy()  # still the caller's memory (a subclass, a buffer)
    return out

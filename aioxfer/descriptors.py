"""Descriptors: from the segments of a write/read to the engine's rows.

A request's descriptors are an (n, 6) uint64 array ``[lrid, loff, rrid, rkey,
roff, len]``, or for one pair that row as a tuple (``_cyx`` packs it without a
numpy array). The agent builds the one-pair case itself, inline in
``write``/``read`` (the hot path); the other shapes (equal-length lists, two
SegmentLists, ``post_arrays``' offset arrays of one region pair), the full
per-pair checks that say what is wrong, merging of contiguous runs and a cuda
peer's per-transfer path live here (issue 10, item 8). Functions of their
arguments: ``owner`` is the agent whose regions the local side must be in,
``peers`` its peer table (a remote segment's peer must be one of its); neither
is used but for identity.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from aioxfer import _cyx
from aioxfer.errors import AccessDenied, TransportError
from aioxfer.region import Region, RemoteRegion, RemoteSegment, Segment, SegmentList, pair_descs

if TYPE_CHECKING:
    from aioxfer.peer import Peer

__all__ = [
    "Descs",
    "check_pair",
    "coalesce",
    "cuda_path",
    "from_arrays",
    "from_lists",
    "from_vectors",
]

# A request's descriptors: an (n, 6) uint64 array, or one row as a tuple.
Descs = npt.NDArray[np.uint64] | tuple[int, int, int, int, int, int]
_U64 = np.dtype(np.uint64)  # what a uint64 array's dtype is (compared by identity)
# ndarray.max() without its Python wrapper (numpy's _methods._amax): the
# first bound checked after a while is a cold call, ~8 vs ~5 us (kv stream).
_max = np.maximum.reduce


def _gone_error(rr: RemoteRegion) -> Exception:
    """Why remote region ``rr``, dropped from its peer's table, cannot be used.
    A peer that deregisters its regions as it closes publishes that before
    its departure: whichever of the two reached us first, a peer that is gone
    now is the reason (PeerLost), not the deregistration."""
    if rr.peer.lost:
        return rr.peer._lost_error()
    return AccessDenied(
        f"remote region {rr.name!r} of peer {rr.peer.name!r} was deregistered by its owner",
        peer=rr.peer.name,
    )


def check_pair(local: Any, remote: Any, i: int, *, owner: object, peers: object) -> None:
    """Checks pair i of a request (types, owners, bounds, paths), raising what is wrong.
    ``owner``: the agent whose regions the local side must be in; ``peers``: its peer
    table (the remote side's peer must be one of its)."""
    if not isinstance(local, Segment):
        raise TypeError(f"local segment {i} is a {type(local).__name__}, not a Segment")
    if not isinstance(remote, RemoteSegment):
        raise TypeError(f"remote segment {i} is a {type(remote).__name__}, not a RemoteSegment")
    lr = local.region
    if lr._agent is not owner:
        raise ValueError(f"local segment {i} is in a region of agent {lr._agent.name!r}")
    lr._check()
    rr = remote.region
    if rr._gone:
        raise _gone_error(rr)
    if rr.peer._host is not peers:
        raise ValueError(f"remote segment {i} belongs to a peer of another agent")
    # GPU memory travels its own path (cuda) or RDMA (GPUDirect: the
    # engine says so, per region, if the NIC cannot reach it).
    if lr.kind != "host" and rr.peer.path not in (lr.kind, "verbs"):
        raise TransportError(
            f"local region {lr.name!r} is {lr.kind} memory, which path "
            f"{rr.peer.path!r} to peer {rr.peer.name!r} cannot reach",
            peer=rr.peer.name,
        )
    if rr.kind != "host" and rr.peer.path not in (rr.kind, "verbs"):
        raise TransportError(
            f"remote region {rr.name!r} of peer {rr.peer.name!r} is {rr.kind} memory, "
            f"which path {rr.peer.path!r} cannot reach",
            peer=rr.peer.name,
        )
    if local.length != remote.length:
        raise ValueError(
            f"segment {i}: local length {local.length} != remote length {remote.length}"
        )
    if not local.length:
        raise ValueError(f"segment {i} is empty")


def from_lists(
    local: Sequence[Any], remote: Sequence[Any], *, owner: object, peers: object
) -> tuple[Peer, npt.NDArray[np.uint64], int]:
    """Equal-length lists of Segments and RemoteSegments (one peer): their
    (n, 6) descriptor array, the peer and the total length. Each new pair of
    regions is checked in full (check_pair), the rest by type and length."""
    n = len(local)
    if n != len(remote):
        raise ValueError(f"{n} local segments but {len(remote)} remote segments")
    if not n:
        raise ValueError("no segments to transfer")
    rows: list[tuple[int, int, int, int, int, int]] = []
    append = rows.append
    last_l: Any = None
    last_r: Any = None
    peer: Peer | None = None
    total = 0
    for i in range(n):
        ls = local[i]
        rs = remote[i]
        try:
            lr = ls.region
            rr = rs.region
            length = ls.length
            ok = (
                type(ls) is Segment
                and type(rs) is RemoteSegment
                and length == rs.length
                and length > 0
            )
        except AttributeError:
            ok = False
        if not ok or lr is not last_l or rr is not last_r:
            check_pair(ls, rs, i, owner=owner, peers=peers)
            if peer is None:
                peer = rr.peer
            elif rr.peer is not peer:
                raise ValueError(
                    f"remote segment {i} is on peer {rr.peer.name!r}, not {peer.name!r}: "
                    f"one transfer goes to one peer"
                )
            last_l, last_r = lr, rr
        append((lr.rid, ls.offset, rr.rid, rr.key, rs.offset, length))
        total += length
    assert peer is not None
    return peer, np.array(rows, dtype=np.uint64), total


def from_vectors(
    local: SegmentList, remote: SegmentList, *, owner: object
) -> tuple[Peer, npt.NDArray[np.uint64], int]:
    """Two SegmentLists (a local Region's, a RemoteRegion's): their (n, 6)
    descriptor array, the peer and the total length."""
    lr = local.region
    rr = remote.region
    if not isinstance(lr, Region) or not isinstance(rr, RemoteRegion):
        raise TypeError("the first SegmentList must be of a local Region, the second remote")
    if lr._agent is not owner:
        raise ValueError(f"local segments are in a region of agent {lr._agent.name!r}")
    lr._check()
    for region, where in ((lr, "local"), (rr, "remote")):
        # As check_pair: GPU memory on its own path, or over RDMA (GPUDirect;
        # the engine refuses, per region, what the NIC cannot reach).
        if region.kind != "host" and rr.peer.path not in (region.kind, "verbs"):
            raise TransportError(
                f"{where} region {region.name!r} is {region.kind} memory, which path "
                f"{rr.peer.path!r} to peer {rr.peer.name!r} cannot reach",
                peer=rr.peer.name,
            )
    if rr._gone:
        raise _gone_error(rr)
    descs = pair_descs(local, lr.rid, remote, rr.rid, rr.key, "remote")
    return rr.peer, descs, local.nbytes


def _offsets(a: Any, n: int | None, what: str) -> npt.NDArray[np.uint64]:
    """``a`` as a 1-D uint64 array (of ``n`` offsets; one already is: as it is)."""
    if type(a) is not np.ndarray or a.dtype is not _U64 or a.ndim != 1:
        a = np.asarray(a)
        if a.ndim == 1 and not a.size:
            a = np.zeros(0, dtype=np.uint64)  # ([] is float64 to numpy)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise TypeError(f"{what} must be a 1-D array of integers")
        if a.dtype.kind == "i" and a.size and int(a.min()) < 0:
            raise ValueError(f"{what} must not be negative")
        a = a.astype(np.uint64, copy=False)
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{n} local offsets but {a.shape[0]} {what}")
    out: npt.NDArray[np.uint64] = a
    return out


def _refuse(
    lo: npt.NDArray[np.uint64],
    local: Region,
    ro: npt.NDArray[np.uint64],
    remote: RemoteRegion,
    length: int,
) -> None:
    """Raises what is wrong with from_arrays' offsets and length."""
    if not len(lo):
        raise ValueError("no segments to transfer")
    if length <= 0:
        raise ValueError(f"length must be positive, not {length}")
    for offs, region, where in ((lo, local, "local"), (ro, remote, "remote")):
        if int(offs.max()) + length > region.nbytes:
            bad = (
                0
                if length > region.nbytes
                else int(np.flatnonzero(offs > region.nbytes - length)[0])
            )
            raise IndexError(
                f"{where} segment {bad} [{int(offs[bad])}:+{length}] is out of bounds for "
                f"region {region.name!r} of {region.nbytes} bytes"
            )


def from_arrays(
    local: Region,
    remote: RemoteRegion,
    local_offsets: Any,
    remote_offsets: Any,
    length: int,
    *,
    owner: object,
    peers: object,
) -> tuple[Peer, npt.NDArray[np.uint64], int]:
    """One local Region and one RemoteRegion, ``length`` bytes at each pair of
    offsets (1-D uint64 arrays, as a caller that knows its blocks' places
    keeps them): their (n, 6) descriptor array, the peer and the total length.

    The path for a caller that already holds its descriptors as arrays (a KV
    store streaming layers of its blocks): no SegmentList, no pairing, no
    merging (the caller says what is contiguous). The checks that matter
    stay: owner, region alive (local) and not deregistered (remote), peer of
    this agent, memory kind against path, offsets in bounds on both sides
    (the engine checks bounds and keys again); a few whole-array operations,
    since every range has the same length: ``max(offsets) + length`` bounds
    them all."""
    if type(local) is not Region or type(remote) is not RemoteRegion:
        raise TypeError(
            f"arrays of offsets need a local Region and a RemoteRegion, not "
            f"{type(local).__name__} and {type(remote).__name__}"
        )
    peer = remote.peer
    if (
        local._agent is not owner
        or local._closed
        or remote._gone
        or peer._host is not peers
        or local.kind is not remote.kind
        # GPU memory on both sides still needs a path that reaches it (tcp
        # does not: posted, it failed later as an untyped "invalid argument")
        or (local.kind != "host" and peer.path != local.kind and peer.path != "verbs")
    ):
        # Off the usual path: the same checks, and errors, as a segment pair's.
        check_pair(local[0 : local.nbytes], remote[0 : remote.nbytes], 0, owner=owner, peers=peers)
    if type(length) is not int:
        length = operator.index(length)
    lo = local_offsets
    if type(lo) is not np.ndarray or lo.dtype is not _U64 or lo.ndim != 1:
        lo = _offsets(lo, None, "local offsets")
    n = lo.shape[0]
    ro = remote_offsets
    if type(ro) is not np.ndarray or ro.dtype is not _U64 or ro.shape != lo.shape:
        ro = _offsets(ro, n, "remote offsets")
    # uint64 offsets: none is negative, and max + length cannot wrap.
    if (
        not n
        or length <= 0
        or int(_max(lo)) + length > local.nbytes
        or int(_max(ro)) + length > remote.nbytes
    ):
        _refuse(lo, local, ro, remote, length)
    descs = np.empty((n, 6), dtype=np.uint64)
    descs[:, 0] = local.rid
    descs[:, 1] = lo
    descs[:, 2] = remote.rid
    descs[:, 3] = remote.key
    descs[:, 4] = ro
    descs[:, 5] = length
    return peer, descs, n * length


# Merges runs of descriptors contiguous on both sides (same regions, same
# key) into one each: fewer copies, frames and syscalls for a KV block split
# in pages. coalesce(descs) -> (descs, None) when nothing merges (a tuple,
# fewer than two rows: as given), else (merged, starts): the merged rows and
# each one's first original index (to report failures by the caller's
# index). Compiled: one pass over the rows instead of ~10 numpy calls (~40 us
# less per 256-descriptor batch; tests/test_hotpath checks it against the
# numpy formulation).
coalesce = _cyx.coalesce


def cuda_path(local: Any, remote: Any) -> str:
    """What a transfer to a "cuda" peer is: "cuda" when it touches GPU memory
    (CUDA copies), else "shm" (host memory moves as shm copies)."""
    for side in (local, remote):
        segs = side if isinstance(side, Sequence) else (side,)
        if any(s.region.kind != "host" for s in segs):
            return "cuda"
    return "shm"

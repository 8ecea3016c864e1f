"""The file transport: local files and block devices as regions of memory kind
"file" (``Agent.register_file``), moved to and from host memory by the engine.

A file region is a local transfer target: ``agent.write(host_seg, file_region[a:b])``
writes host memory into the file, ``agent.read(host_seg, file_region[a:b])``
reads the file into host memory. The engine does the I/O off the loop thread:
through io_uring (the kernel interface, no liburing needed; where the kernel
allows it) for O_DIRECT regions,
where it keeps the device's queue full, and a pread/pwrite thread pool for
buffered ones, where page-cache copies are CPU work the pool spreads over cores
(``AIOXFER_FILE_IO=threads`` or ``=uring`` forces one for all). With
``direct=True`` the file is opened with O_DIRECT: file offsets, lengths and
host addresses must be aligned to the device's block size (``Agent.alloc``
buffers are page aligned).

File regions are never advertised to peers: only this agent reaches them.

The file transport is the built-in local backend "file" of the registry
(aioxfer.backends): ``agent.write``/``agent.read`` hand it the pairs whose far
side is a file region, as they hand object storage's to the object backend.
Its I/O is native, so ``post`` submits to the engine rather than running
``put``/``get`` coroutines; its counters (``statistics()``) are those of the
engine's FILE endpoint. That endpoint's counters still sit on a Peer-shaped
record (``file_peer``), the one type the engine's drain settles counters on:
an implementation detail, never listed in ``agent.peers``.
"""

from __future__ import annotations

import errno
import fcntl
import operator
import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from aioxfer import _cyx
from aioxfer.backends.base import BackendStatistics, LocalBackend, Op
from aioxfer.backends.host import host_of
from aioxfer.descriptors import coalesce
from aioxfer.errors import RegistrationError, XferError, error_for_status
from aioxfer.peer import Peer
from aioxfer.region import Region, Segment, SegmentList, pair_descs

if TYPE_CHECKING:
    from aioxfer.agent import Agent
    from aioxfer.transfer import Transfer

__all__ = ["DIRECT_ALIGN", "FileBackend", "devices", "status"]

PATH = "file"  # TransferResult.path of file transfers
# O_DIRECT alignment checked here, with the segment's index, before posting:
# every logical block size we know of divides it (the engine checks the
# device's own, which may be smaller, again).
DIRECT_ALIGN = 4096
OFF_MAX = (1 << 63) - 1  # the largest off_t: no file region reaches past it


def status() -> tuple[bool, str]:
    """(available, one line): the file transport is always available; the line
    says which I/O backends a new agent uses and why, e.g. "io_uring (kernel
    interface) for O_DIRECT, thread pool for buffered I/O" or "thread pool: io_uring
    unavailable (EPERM)"."""
    _uring, line = _cyx.file_backend()
    return True, line


def devices() -> list[str]:
    """No devices to list: any local file or block device can be registered."""
    return []


# ---------------------------------------------------------------- registration


# (st_dev, st_ino) of a file open_region_file created: what discard_created
# removes, and only while the path still names that file.
Created = tuple[int, int]


def open_region_file(
    path: str | os.PathLike[str], size: int | None, direct: bool
) -> tuple[int, int, int, Created | None]:
    """Opens (creating a regular file if missing and ``size`` is given, growing
    it to ``size``) and returns (fd, nbytes, access, created): ``created``
    names the file this call made, for the caller to remove
    (``discard_created``) if its registration fails after all. Raises
    RegistrationError, having removed a file it created; a file that was there
    before is never removed."""
    where = os.fspath(path)
    if size is not None:
        # An integer of any kind (numpy's too, as alloc takes), made a plain
        # int: a bool was taken as a size (True: a 1-byte region whose nbytes
        # was True), a numpy integer refused.
        try:
            size = None if isinstance(size, bool) else operator.index(size)
        except TypeError:
            size = None
        if size is None or size <= 0:
            raise RegistrationError(
                f"cannot register {where!r}: size must be a positive int or None"
            )
    if size is not None and size > OFF_MAX:
        # ftruncate would raise OverflowError (not an OSError) past off_t, and
        # the engine's preads/pwrites take off_t offsets
        raise RegistrationError(
            f"cannot register {where!r}: size {size} is past the largest file offset ({OFF_MAX})"
        )
    flags = os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    access = _cyx.ACCESS_READ | _cyx.ACCESS_WRITE
    created: Created | None = None
    try:
        # Not O_CREAT: a file is made only where size= says how big, and only
        # by O_EXCL (_create), so that a failure later removes what this call
        # made and nothing else.
        fd = os.open(where, flags | os.O_RDWR)
    except FileNotFoundError:
        if size is None:
            raise RegistrationError(
                f"cannot register {where!r}: no such file; pass size= to create it"
            ) from None
        fd, created = _create(where, direct)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            raise RegistrationError(
                f"cannot register {where!r}: its filesystem refuses O_DIRECT (direct=True)"
            ) from None
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or size is not None:
            raise RegistrationError(f"cannot open {where!r}: {exc.strerror}") from None
        try:  # an existing read-only file: agents may read it, not write it
            fd = os.open(where, flags | os.O_RDONLY)
        except OSError as exc2:
            raise RegistrationError(f"cannot open {where!r}: {exc2.strerror}") from None
        access = _cyx.ACCESS_READ
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if size is None:
                if not st.st_size:
                    raise RegistrationError(
                        f"cannot register {where!r}: the file is empty; pass size= to grow it"
                    )
                size = st.st_size
            elif size > st.st_size:
                os.ftruncate(fd, size)  # grows it (sparse); never shrinks what is there
        elif stat.S_ISBLK(st.st_mode):
            devsize = os.lseek(fd, 0, os.SEEK_END)
            if size is None:
                size = devsize
            elif size > devsize:
                raise RegistrationError(
                    f"cannot register {size} bytes of {where!r}: the device has {devsize}"
                )
            if not size:
                raise RegistrationError(f"cannot register {where!r}: the device is empty")
        else:
            raise RegistrationError(
                f"cannot register {where!r}: not a regular file or block device"
            )
    except OSError as exc:
        os.close(fd)
        discard_created(where, created)
        raise RegistrationError(f"cannot size {where!r}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        discard_created(where, created)
        raise
    return fd, size, access, created


def _create(where: str, direct: bool) -> tuple[int, Created | None]:
    """A new regular file at ``where`` (O_EXCL), open read-write (O_DIRECT when
    ``direct``): (fd, its identity); (fd, None) when another process made it
    meanwhile and it was opened as an existing file."""
    try:
        fd = os.open(where, os.O_CLOEXEC | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # made since our first open: it is not ours to remove
        try:
            return os.open(where, os.O_CLOEXEC | os.O_RDWR | (os.O_DIRECT if direct else 0)), None
        except OSError as exc:
            raise RegistrationError(f"cannot open {where!r}: {exc.strerror}") from None
    except OSError as exc:
        raise RegistrationError(f"cannot create {where!r}: {exc.strerror}") from None
    st = os.fstat(fd)
    created = (st.st_dev, st.st_ino)
    if direct:
        # O_DIRECT set on this descriptor rather than by a second open of the
        # path, which might meanwhile name another file. A filesystem that
        # refuses it refuses F_SETFL (EINVAL) as it refuses open(O_DIRECT).
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            os.close(fd)
            discard_created(where, created)
            if exc.errno == errno.EINVAL:
                raise RegistrationError(
                    f"cannot register {where!r}: its filesystem refuses O_DIRECT (direct=True)"
                ) from None
            raise RegistrationError(f"cannot open {where!r}: {exc.strerror}") from None
    return fd, created


def discard_created(where: str, created: Created | None) -> None:
    """Removes the file open_region_file created at ``where`` (after a failed
    registration), if the path still names it: never a file that replaced it.
    Best effort: the registration's own error is what the caller reports."""
    if created is None:
        return
    try:
        st = os.lstat(where)
        if (st.st_dev, st.st_ino) == created:
            os.unlink(where)
    except OSError:
        pass


def register_file(
    agent: Agent,
    path: str | os.PathLike[str],
    size: int | None,
    direct: bool,
    name: str | None,
) -> Region:
    host = host_of(agent)
    host.check_open()
    if name is not None:
        host.check_name(name)
    fd, nbytes, access, created = open_region_file(path, size, direct)
    try:
        rid, key = host.engine.register_file(fd, 0, nbytes, access)
    except _cyx.NativeError as exc:
        discard_created(os.fspath(path), created)
        raise RegistrationError(f"cannot register {os.fspath(path)!r}: {exc}") from None
    except BaseException:
        discard_created(os.fspath(path), created)
        raise
    finally:
        os.close(fd)  # the engine keeps its own duplicate
    if name is None:
        name = host.default_name(rid, "file")
    region = Region(agent, name, rid, key, nbytes, access, 0, os.fspath(path), kind="file")
    region.direct = bool(direct)
    host.add_region(region)
    return region


# ---------------------------------------------------------------- descriptors


def is_file_target(remote: Any) -> bool:
    """True when the far side of a write/read is this agent's own memory (a
    Segment, a list of them, or a SegmentList of a local Region)."""
    if type(remote) is Segment:
        return True
    if isinstance(remote, SegmentList):
        return isinstance(remote.region, Region)
    return (
        isinstance(remote, Sequence)
        and not isinstance(remote, str | bytes | bytearray)
        and len(remote) > 0
        and type(remote[0]) is Segment
    )


def file_peer(agent: Agent) -> Peer:
    """The agent's one FILE endpoint, as the Peer its transfers are counted on."""
    host = host_of(agent)
    peer = host.file_peer
    if peer is None:
        tag = host.new_tag(PATH)
        try:
            ep = host.engine.endpoint_create(_cyx.EP_FILE, tag, 0)
        except _cyx.NativeError as exc:
            # The first file transfer starts the transport's I/O threads; a
            # process at its thread limit (RLIMIT_NPROC, a pids cgroup)
            # cannot: a typed error, as every other refusal of a transfer
            # (the bare NativeError escaped agent.write/read).
            raise error_for_status(
                exc.status, "cannot start the file transport (its I/O threads)"
            ) from None
        peer = Peer(
            host.peers,
            name=PATH,
            address=PATH,
            incarnation=agent.incarnation,
            path=PATH,
            host_id=host.host_id,
            pid=os.getpid(),
            ep=ep,
        )
        host.file_peer = peer
    return peer


def _check_regions(agent: Agent, local: Region, target: Region, i: int | None) -> None:
    at = "" if i is None else f" {i}"
    if local._agent is not agent or target._agent is not agent:
        raise ValueError(f"segment{at} is in a region of another agent")
    local._check()
    target._check()
    if local.kind != "host":
        raise TypeError(
            f"local segment{at} is in {local.kind} region {local.name!r}: file transfers move "
            f"between host memory and a file region"
        )
    if target.kind != "file":
        raise TypeError(
            f"segment{at} of region {target.name!r} is local host memory, not a file region or "
            f"a peer's region: nothing to transfer to"
        )


def _check_aligned(addr: int, foff: int, length: int, i: int) -> None:
    if (addr | foff | length) & (DIRECT_ALIGN - 1):
        raise XferError(
            f"segment {i} (host address {addr:#x}, file offset {foff}, length {length}) is not "
            f"aligned to {DIRECT_ALIGN} bytes, as O_DIRECT (direct=True) needs: invalid argument",
            status=_cyx.E_INVALID,
            op=None,
            fail_index=i,
        )


def descs(agent: Agent, local: Any, target: Any) -> tuple[Peer, npt.NDArray[np.uint64], int]:
    """The (n, 6) descriptor array of a transfer between host memory and this
    agent's file regions (rrid/rkey/roff name the file region)."""
    if type(local) is Segment and type(target) is Segment:
        _check_regions(agent, local.region, target.region, None)
        n = local.length
        if n != target.length:
            raise ValueError(f"local length {n} != file length {target.length}")
        if not n:
            raise ValueError("segment is empty")
        lr, fr = local.region, target.region
        if fr.direct:
            _check_aligned(lr.addr + local.offset, target.offset, n, 0)
        row = [[lr.rid, local.offset, fr.rid, fr.key, target.offset, n]]
        return file_peer(agent), np.array(row, dtype=np.uint64), n
    if isinstance(local, SegmentList) and isinstance(target, SegmentList):
        lreg, freg = local.region, target.region
        if not isinstance(lreg, Region) or not isinstance(freg, Region):
            raise TypeError("file transfers take two SegmentLists of local regions")
        _check_regions(agent, lreg, freg, None)
        out = pair_descs(local, lreg.rid, target, freg.rid, freg.key, "file")
        lens = out[:, 5]
        if freg.direct:
            mask = np.uint64(DIRECT_ALIGN - 1)
            unaligned = ((local.offsets + np.uint64(lreg.addr)) | target.offsets | lens) & mask
            if unaligned.any():
                i = int(np.flatnonzero(unaligned)[0])
                _check_aligned(lreg.addr + int(local.offsets[i]), int(target.offsets[i]),
                               int(lens[i]), i)
        return file_peer(agent), out, local.nbytes
    if (
        isinstance(local, Sequence)
        and isinstance(target, Sequence)
        and not isinstance(local, str | bytes | bytearray)
    ):
        m = len(local)
        if m != len(target):
            raise ValueError(f"{m} local segments but {len(target)} file segments")
        if not m:
            raise ValueError("no segments to transfer")
        rows: list[tuple[int, int, int, int, int, int]] = []
        last: tuple[Any, Any] = (None, None)
        total = 0
        for i in range(m):
            ls, fs = local[i], target[i]
            if type(ls) is not Segment or type(fs) is not Segment:
                raise TypeError(
                    f"segment {i}: a file transfer pairs Segments, not "
                    f"{type(ls).__name__} and {type(fs).__name__}"
                )
            if (ls.region, fs.region) != last:
                _check_regions(agent, ls.region, fs.region, i)
                last = (ls.region, fs.region)
            if ls.length != fs.length:
                raise ValueError(
                    f"segment {i}: local length {ls.length} != file length {fs.length}"
                )
            if not ls.length:
                raise ValueError(f"segment {i} is empty")
            if fs.region.direct:
                _check_aligned(ls.region.addr + ls.offset, fs.offset, ls.length, i)
            fr = fs.region
            rows.append((ls.region.rid, ls.offset, fr.rid, fr.key, fs.offset, ls.length))
            total += ls.length
        return file_peer(agent), np.array(rows, dtype=np.uint64), total
    raise TypeError(
        f"a file transfer takes a Segment and a file Segment, equal-length lists of them, or two "
        f"SegmentLists; not {type(local).__name__} and {type(target).__name__}"
    )


# ---------------------------------------------------------------- the backend


class FileBackend(LocalBackend):
    """The built-in local backend "file": file regions (``agent.register_file``
    or ``aioxfer.backends.register_region(agent, "file", path, ...)``) moved
    by the engine."""

    name = "file"
    kind = "file"

    def register(
        self,
        path: str | os.PathLike[str],
        *,
        size: int | None = None,
        direct: bool = False,
        name: str | None = None,
    ) -> Region:
        return register_file(self.agent, path, size, direct, name)

    def post(self, agent: Agent, op: Op, local: Any, far: Any, notify: object,
             priority: int) -> Transfer:
        if notify is not None:
            raise ValueError(f"a {op} into a file region takes no notify (nobody to tell)")
        peer, rows, nbytes = descs(agent, local, far)
        merged, starts = coalesce(rows)
        opcode = _cyx.OP_WRITE if op == "write" else _cyx.OP_READ
        t = host_of(agent).submit(peer, opcode, merged, None, nbytes, op, priority)
        if starts is not None:
            t._starts = starts
        return t

    def statistics(self) -> BackendStatistics:
        peer = host_of(self.agent).file_peer
        regions = sum(1 for r in self.agent.regions if r.kind == "file")
        if peer is None:
            return BackendStatistics(self.name, self.kind, regions, 0, 0, 0, 0, 0, 0, 0, 0)
        c = peer._counters
        return BackendStatistics(
            name=self.name,
            kind=self.kind,
            regions=regions,
            transfers_posted=c.posted,
            transfers_completed=c.completed,
            transfers_failed=c.failed,
            ops=c.completed,
            bytes=c.bytes,
            in_flight=c.inflight,
            in_flight_bytes=c.inflight_bytes,
            retries=0,
        )

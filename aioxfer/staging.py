"""GPU <-> file through host staging: a KV page moves GPU -> file and back with
one awaitable each.

Path (reported on every result): ``"cuda+file (host staging)"``. The GPU half
is a CUDA copy between the GPU region and a bounce buffer in shared host memory
(``agent.alloc``), posted through the agent's own "cuda" path (a loopback peer:
the agent connected to itself, so the engine's bounds, keys and revocation
rules apply as for any peer); the file half reads or writes the bounce buffer
through a ``FileSide``. No thread of the event loop copies or blocks.

GPUDirect Storage (cuFile) is not used: it must only be opened once the CUDA
driver is known to load (its driver_open spins forever without one), and it is
not implemented yet; this module is the fallback it would sit in front of.

``FileSide`` is the interface the file half needs. ``FileRegion`` implements
it over a file region of the agent (``agent.register_file``: the engine's file
transport, io_uring or its I/O threads); ``PosixFile`` with pread/pwrite on
Python worker threads, for files the agent does not own. A file region may be
passed to ``GpuFileStager`` as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import operator
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

from aioxfer.backends.host import host_of
from aioxfer.errors import AccessDenied, ClosedResourceError, TransportError

if TYPE_CHECKING:
    from aioxfer.agent import Agent
    from aioxfer.peer import Peer
    from aioxfer.region import Region, RemoteRegion, Segment
    from aioxfer.transfer import Transfer

__all__ = ["PATH", "FileRegion", "FileSide", "GpuFileStager", "PosixFile", "StagedResult"]

PATH = "cuda+file (host staging)"


@dataclass(frozen=True)
class StagedResult:
    nbytes: int
    seconds: float
    path: str = PATH


class FileSide(Protocol):
    """The file half of a staged move: host memory <-> a byte range of a file."""

    async def write_from(self, src: Segment, offset: int) -> None:
        """Writes src's bytes to the file at offset."""
        ...

    async def read_into(self, dst: Segment, offset: int) -> None:
        """Fills dst from the file at offset (all of it, or raises)."""
        ...


class FileRegion:
    """The file half through the agent's file transport: one ``agent.write`` /
    ``agent.read`` between the bounce segment and ``region`` (a file region,
    ``agent.register_file``). Offsets are the region's."""

    def __init__(self, region: Region) -> None:
        if region.kind != "file":
            raise ValueError(f"{region!r} is not a file region (kind {region.kind!r})")
        self.region = region

    async def write_from(self, src: Segment, offset: int) -> None:
        await _whole(self.region.agent.write(src, self._at(offset, src.length)))

    async def read_into(self, dst: Segment, offset: int) -> None:
        await _whole(self.region.agent.read(dst, self._at(offset, dst.length)))

    def _at(self, offset: int, length: int) -> Segment:
        # A file offset, never a slice bound: region[-8192:-4096] is the
        # region's end, so a negative offset moved the page there, silently.
        if operator.index(offset) < 0:
            raise ValueError(f"file offset must not be negative, not {offset}")
        return self.region[offset : offset + length]


class PosixFile:
    """A file read and written with pread/pwrite on worker threads.

    The file is opened read-write, created (mode 0600) where it is missing.
    ``size``: the file is grown (sparse) to at least that many bytes; one
    already longer is left as it is, never shrunk (as ``agent.register_file``
    does: truncating it silently dropped the pages past ``size`` that other
    users of the file had stored).

    ``close()`` refuses new calls at once; the descriptor itself is closed
    when the last call begun before it ends: a pread/pwrite still waiting for
    a worker thread would otherwise run on a number the next ``open`` reuses
    (another file's bytes read or overwritten)."""

    def __init__(self, path: str | os.PathLike[str], *, size: int | None = None) -> None:
        self.path = os.fspath(path)
        self._fd = -1
        self._users = 0  # calls begun and not ended: they hold the descriptor
        self._closing = False
        if size is not None and not 0 <= size < 1 << 63:
            raise ValueError(f"size must be a non-negative file size, not {size}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if size is not None and size > os.fstat(fd).st_size:
                os.ftruncate(fd, size)  # grows it (sparse); never shrinks what is there
        except BaseException:
            os.close(fd)  # never leaked by a failed constructor
            raise
        self._fd = fd

    def _check(self) -> int:
        if self._fd < 0 or self._closing:
            raise ClosedResourceError(f"file {self.path!r} is closed")
        return self._fd

    async def _run(self, what: str, offset: int, body: Callable[[int, threading.Event], None],
                   ) -> None:
        """``body(fd, stop)`` on a worker thread, holding the descriptor open
        until it ends; an OSError from it is a TransportError."""
        fd = self._check()
        if operator.index(offset) < 0:  # as FileRegion: a caller's error, not I/O
            raise ValueError(f"file offset must not be negative, not {offset}")
        stop = threading.Event()

        def run() -> None:
            try:
                body(fd, stop)
            except OSError as exc:
                raise TransportError(
                    f"{what} of file {self.path!r} at offset {offset} failed: {exc.strerror}"
                ) from exc

        self._users += 1
        try:
            await _on_thread(run, stop)
        finally:
            self._users -= 1
            if self._closing and not self._users:
                self._close_fd()

    async def write_from(self, src: Segment, offset: int) -> None:
        view = src.memoryview

        def body(fd: int, stop: threading.Event) -> None:
            done = 0
            while done < len(view) and not stop.is_set():
                n = os.pwrite(fd, view[done:], offset + done)
                if n == 0:  # no progress and no errno: never spin on it
                    raise OSError(errno.EIO, "pwrite wrote nothing")
                done += n

        await self._run("write", offset, body)

    async def read_into(self, dst: Segment, offset: int) -> None:
        view = dst.memoryview
        if view.readonly:  # as the engine refuses a READ into it (a BufferError escaped)
            raise AccessDenied(
                f"region {dst.region.name!r} is read-only: cannot read file {self.path!r} into it"
            )

        def body(fd: int, stop: threading.Event) -> None:
            done = 0
            while done < len(view) and not stop.is_set():
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    raise TransportError(
                        f"file {self.path!r} ends at {offset + done}, "
                        f"{len(view) - done} bytes short of the page"
                    )
                done += n

        await self._run("read", offset, body)

    def close(self) -> None:
        """Refuses new calls; the descriptor goes once no call uses it."""
        if self._fd >= 0 and not self._closing:
            self._closing = True
            if not self._users:
                self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


async def _whole(t: Transfer) -> None:
    """Awaits ``t``. Cancelled, it waits until the engine no longer touches
    t's memory (``t.settled()``: a cancelled transfer's copy may still land
    until the engine confirms the cancel) before it raises CancelledError,
    as ``_on_thread`` does for a thread's syscall: the caller reuses the
    buffer as soon as the cancellation reaches it."""
    try:
        await t
    except asyncio.CancelledError:
        settled = t.settled()
        while not settled.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([settled])
        raise


async def _on_thread(run: Callable[[], None], stop: threading.Event) -> None:
    """Runs ``run`` on a worker thread. Cancelled, it tells ``run`` to stop
    after its current pread/pwrite and waits for that before it raises
    CancelledError: a syscall on a thread cannot be interrupted, and until it
    returns it may still write into the caller's buffer (which the caller may
    reuse as soon as the cancellation reaches it)."""
    fut = asyncio.get_running_loop().run_in_executor(None, run)
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        stop.set()
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: what the stopped thread raised is moot
        raise


class GpuFileStager:
    """Moves byte ranges of GPU regions to and from a file through ``slots``
    bounce buffers of ``slot_bytes`` each (moves run concurrently up to
    ``slots``; a larger page goes through its slot in pieces).

    ``await stager.start()`` (or ``async with``) connects the agent to itself
    over "cuda", which needs CUDA in this process."""

    def __init__(
        self,
        agent: Agent,
        file: FileSide | Region,
        *,
        slot_bytes: int = 4 << 20,
        slots: int = 2,
    ) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise ValueError("slot_bytes and slots must be positive")
        from aioxfer.region import Region

        self._agent = agent
        self._file: FileSide = FileRegion(file) if isinstance(file, Region) else file
        self._slot_bytes = int(slot_bytes)
        self._nslots = int(slots)
        self._bounce: Region | None = None
        self._remote: RemoteRegion | None = None
        self._peer: Peer | None = None
        self._free: asyncio.Queue[int] = asyncio.Queue()
        self._closed = False
        # Moves begun (waiting for a slot or moving), and what aclose waits on
        # until none is left: the bounce buffer goes only after the last.
        self._moves = 0
        self._idle: asyncio.Event | None = None
        self._starting = asyncio.Lock()

    async def start(self) -> GpuFileStager:
        # One start at a time: a second caller returned at once, while the
        # first still connected, and its moves failed ("start() first").
        async with self._starting:
            return await self._start()

    async def _start(self) -> GpuFileStager:
        if self._closed:
            # (A start after aclose() registered a bounce buffer that nothing
            # would ever release: pinned until the agent closed.)
            raise ClosedResourceError("GPU <-> file stager is closed")
        if self._bounce is not None:
            return self
        agent = self._agent
        if "cuda" not in agent.transports:
            raise TransportError(f"GPU <-> file staging needs CUDA: {host_of(agent).cuda_why}")
        name = f"aioxfer-staging-{id(self):x}"
        bounce = self._bounce = agent.alloc(self._slot_bytes * self._nslots, name=name)
        try:
            self._peer = await agent.connect(agent.address)
            if self._peer.path != "cuda":
                raise TransportError(
                    f"the loopback path is {self._peer.path!r}, not 'cuda': "
                    f"cannot reach GPU memory"
                )
            await self._peer.refresh()
            self._remote = self._peer.region(name)
        except BaseException:
            agent.deregister(bounce)
            self._bounce = None
            raise
        for i in range(self._nslots):
            self._free.put_nowait(i)
        return self

    async def __aenter__(self) -> GpuFileStager:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuses new moves, and those still waiting for a slot
        (ClosedResourceError); waits for those moving to end, then releases
        the bounce buffer: a move's copies and file I/O use it to their end
        (a cancelled move's included: see _whole). Concurrent calls all
        wait."""
        self._closed = True
        if self._moves:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()
        # A start() under way registered the bounce buffer and still
        # connects: it ends first (released here at once, its error was an
        # AttributeError from deregistering None when it failed after this).
        async with self._starting:
            bounce, self._bounce = self._bounce, None
            if bounce is not None and not self._agent.closed:
                self._agent.deregister(bounce)

    def _ready(self) -> tuple[Region, RemoteRegion]:
        if self._closed:
            raise ClosedResourceError("GPU <-> file stager is closed")
        if self._bounce is None or self._remote is None:
            raise RuntimeError("GpuFileStager.start() first")
        return self._bounce, self._remote

    async def gpu_to_file(self, src: Segment, offset: int) -> StagedResult:
        """Writes a GPU segment to the file at offset."""
        return await self._move(src, offset, to_file=True)

    async def file_to_gpu(self, offset: int, dst: Segment) -> StagedResult:
        """Reads the file at offset into a GPU segment."""
        return await self._move(dst, offset, to_file=False)

    async def _move(self, seg: Segment, offset: int, *, to_file: bool) -> StagedResult:
        bounce, remote = self._ready()
        if seg.region.kind != "cuda":
            raise ValueError(f"{seg!r} is not GPU memory (region kind {seg.region.kind!r})")
        if offset < 0:
            raise ValueError("file offset must not be negative")
        t0 = perf_counter()
        self._moves += 1
        try:
            await self._move_in_slot(seg, offset, bounce, remote, to_file)
        finally:
            self._moves -= 1
            if not self._moves and self._idle is not None:
                self._idle.set()
        return StagedResult(seg.length, perf_counter() - t0)

    async def _move_in_slot(self, seg: Segment, offset: int, bounce: Region,
                            remote: RemoteRegion, to_file: bool) -> None:
        slot = await self._free.get()
        try:
            if self._closed:  # (closed while this move waited for the slot)
                raise ClosedResourceError("GPU <-> file stager is closed")
            base = slot * self._slot_bytes
            done = 0
            while done < seg.length:
                n = min(self._slot_bytes, seg.length - done)
                local = bounce[base : base + n]
                staged = remote[base : base + n]
                # (Each half waits, when cancelled, until its bytes no
                # longer move: the slot goes back to the pool below, and the
                # next move's page must not meet this one's late copy.)
                if to_file:
                    await _whole(self._agent.write(seg[done : done + n], staged))
                    await self._file.write_from(local, offset + done)
                else:
                    await self._file.read_into(local, offset + done)
                    await _whole(self._agent.read(seg[done : done + n], staged))
                done += n
        finally:
            self._free.put_nowait(slot)

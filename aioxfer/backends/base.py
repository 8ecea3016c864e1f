"""The interface of local backends written in Python/asyncio.

A *local backend* moves bytes between this agent's registered host memory and
storage the agent reaches itself (object storage, a directory of blobs, a
database...): the far side of ``agent.write(host_seg, far)`` /
``agent.read(host_seg, far)`` is a segment of one of the backend's regions.
A backend implements three things:

- ``kind`` (class attribute): the region kind it serves, e.g. "object";
- ``far_segments(far, op)``: the far side of a request as a list of its own
  segment objects (each with a ``region`` attribute, a :class:`BackendRegion`
  of this backend), and ``check_pair(seg, local_length, op, i)``: what can be
  checked without I/O (raise ValueError/TypeError: the call raises at once);
- ``async put(src, far)`` / ``async get(dst, far)``: move one pair, ``src``/
  ``dst`` a memoryview of registered host memory. Raise an :class:`XferError`
  subclass on failure; anything else is reported as a bug of the backend.

Everything else is done here, the same way for every backend: one
:class:`~aioxfer.transfer.Transfer` per request (posted at once, an asyncio
Future: ``await``, ``cancel()``, ``asyncio.timeout()`` all work), pairs of a
batch run with bounded concurrency (``max_concurrency`` per backend
instance, over all its requests, served by ``priority``), the first failure
cancels the rest and fails the transfer with its ``fail_index``, cancellation
is prompt for the caller while the transfer stays in flight until its I/O has
stopped touching the memory, ``agent.aclose()`` fails what is in flight with ClosedResourceError,
and counters (:class:`BackendStatistics`) are kept per backend.
Notifications do not apply (nobody to tell): ``notify=`` raises ValueError.

Backends are found by name in :mod:`aioxfer.backends.registry`: the built-in
ones, and those of installed packages through the entry-point group
``aioxfer.backends`` (``name = "package.module:BackendClass"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar, cast

from aioxfer.backends.host import host_of
from aioxfer.errors import ClosedResourceError, XferError
from aioxfer.region import Region, Segment, SegmentList
from aioxfer.transfer import DETACHED, Transfer, TransferResult

if TYPE_CHECKING:
    from aioxfer.agent import Agent
    from aioxfer.peer import Peer

__all__ = [
    "API_VERSION",
    "BackendRegion",
    "BackendStatistics",
    "BackendTransfer",
    "FarSegment",
    "LocalBackend",
]

API_VERSION = 1  # of this interface; a backend declares the one it was written for

Op = Literal["write", "read"]
T = TypeVar("T")
_next_id = itertools.count(1).__next__


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    """One backend instance of one agent: its requests (``transfers_*``, one
    per write/read call, however many pairs), the pairs they moved
    (``ops``), ``bytes`` moved, what is ``in_flight`` (requests whose I/O has
    not stopped yet, cancelled ones included) and ``in_flight_bytes``,
    ``retries`` of transient failures, ``errors`` by exception class name."""

    name: str
    kind: str
    regions: int
    transfers_posted: int
    transfers_completed: int
    transfers_failed: int
    ops: int
    bytes: int
    in_flight: int
    in_flight_bytes: int
    retries: int
    errors: dict[str, int] = field(default_factory=dict)


class FarSegment(Protocol):
    """What a local backend's segments have in common: their region (the far
    side of ``agent.write``/``agent.read``, for typing)."""

    @property
    def region(self) -> BackendRegion: ...


class BackendRegion:
    """A region of a local backend (``objs = agent.register_objects(...)``).
    Never advertised to peers. Subclasses make the segments (``region[...]``)."""

    kind: ClassVar[str] = ""

    def __init__(self, backend: LocalBackend, name: str) -> None:
        self.backend = backend
        self.name = name
        self._closed = False

    @property
    def agent(self) -> Agent:
        return self.backend.agent

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"{self.kind} region {self.name!r} is closed")
        if self.backend.agent.closed:
            raise ClosedResourceError(f"agent {self.backend.agent.name!r} is closed")

    async def aclose(self) -> None:
        """Forgets the region (new segments of it raise ClosedResourceError);
        subclasses say what happens to its transfers in flight. Idempotent."""
        if not self._closed:
            self._closed = True
            self.backend._regions.pop(self.name, None)

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<{type(self).__name__} {self.name!r} kind={self.kind}{state}>"


class BackendTransfer(Transfer):
    """A Transfer run by a local backend (``peer`` is the backend: it has
    ``name``, ``path`` and ``statistics()``)."""

    __slots__ = ("_task", "_settled")

    _task: asyncio.Task[None] | None
    _settled: bool  # counted out of flight

    def cancel(self, msg: object = None) -> bool:
        # Prompt for the caller: the future is cancelled now; the runner task
        # stops its I/O and only then counts the request out of flight.
        if self.done():
            return False
        self._cancel_requested = True
        if self._task is not None:
            self._task.cancel()
        return asyncio.Future.cancel(self, msg)

    @property
    def busy(self) -> bool:
        """Whether the backend's I/O may still touch this transfer's memory:
        until its runner ended (after a ``cancel()`` too: a worker thread's
        pread/pwrite cannot be interrupted). Transfer's contract; it was
        always False here (the detached host's answer), so a caller that
        cancelled and checked ``busy`` or awaited ``settled()`` reused memory
        a backend thread still wrote or read."""
        task = self._task
        return task is not None and not task.done()

    def settled(self) -> asyncio.Future[None]:
        """A future that ends once ``busy`` is False (see Transfer.settled)."""
        fut: asyncio.Future[None] = self.get_loop().create_future()
        task = self._task
        if task is None or task.done():
            fut.set_result(None)
        else:
            task.add_done_callback(lambda _task: None if fut.done() else fut.set_result(None))
        return fut

    async def stopped(self) -> None:
        """Waits until the transfer's I/O no longer touches its memory (at
        once when it never started; after a ``cancel()``, when the backend
        has let go of the buffers: the caller may reuse them then)."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait([task])

    def _cancel_local(self) -> None:
        if not self.done():
            asyncio.Future.cancel(self)

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "finished" if self.done() else "pending"
        return (
            f"<Transfer {self.op} #{self.req_id} {self.nbytes} bytes "
            f"backend={self.peer.name!r} {state}>"
        )


class Slots:
    """A semaphore whose waiters are served by priority (higher first, FIFO
    within one): a backend's ``max_concurrency`` pairs in progress, shared by
    all its requests, so a latency-critical read overtakes queued bulk
    traffic (``agent.read(..., priority=1)``) as it does towards peers."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count().__next__

    def acquire_nowait(self) -> bool:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def acquire(self, priority: int = 0) -> None:
        if self.acquire_nowait():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, self._seq(), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled at once: pass it on
            else:
                self._waiters = [w for w in self._waiters if w[2] is not fut]
                heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # the slot goes straight to it
                return
        self._free += 1

    @contextlib.asynccontextmanager
    async def held(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()


class LocalBackend:
    """Base class of local backends (see the module docstring).

    One instance per agent and backend name, made by the registry on first
    use; ``name`` is the name it is registered under (also ``path``, the
    ``TransferResult.path`` of its transfers)."""

    name: str = ""  # the registry sets the name it was found under
    kind: ClassVar[str] = ""
    api_version: ClassVar[int] = API_VERSION
    max_concurrency: int = 16  # pairs in progress at once, over all requests

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.path = self.name
        self._regions: dict[str, BackendRegion] = {}
        self._slots = Slots(self.max_concurrency)
        self._runners: set[asyncio.Task[None]] = set()
        self._posted = 0
        self._completed = 0
        self._failed = 0
        self._ops = 0
        self._bytes = 0
        self._inflight = 0
        self._inflight_bytes = 0
        self._retries = 0
        self._errors: dict[str, int] = {}

    # ---------------------------------------------------------------- to implement

    def far_segments(self, far: Any, op: Op) -> Sequence[Any]:
        """The far side of a request as a list of this backend's segments."""
        raise NotImplementedError

    def check_pair(self, seg: Any, local_length: int, op: Op, i: int) -> None:
        """Checks pair i without I/O: raise ValueError/TypeError if ``seg``
        cannot pair with ``local_length`` bytes of host memory for ``op``."""

    async def put(self, src: memoryview, far: Any) -> None:
        """Writes ``src`` into ``far``."""
        raise NotImplementedError

    async def get(self, dst: memoryview, far: Any) -> None:
        """Reads ``far`` into ``dst`` (exactly ``len(dst)`` bytes)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Releases the backend's clients (the agent is closing)."""

    # ---------------------------------------------------------------- machinery

    def _add_region(self, region: BackendRegion) -> None:
        if region.name in self._regions:
            from aioxfer.errors import RegistrationError

            raise RegistrationError(
                f"agent {self.agent.name!r} already has a {self.kind} region named "
                f"{region.name!r}; close it first or choose another name"
            )
        self._regions[region.name] = region

    @staticmethod
    async def run_blocking(fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` in a worker thread, for blocking I/O in ``put``/``get``.
        Cancelled, it still waits until the thread is done before raising
        CancelledError: a thread cannot be stopped, and the transfer must stay
        in flight while something may touch its memory."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            raise

    def note_retry(self) -> None:
        """Counts one retry of a transient failure (backends call it)."""
        self._retries += 1

    def post(self, agent: Agent, op: Op, local: Any, far: Any, notify: object,
             priority: int) -> Transfer:
        """``agent.write``/``agent.read`` with a far side of this backend:
        checks everything that needs no I/O (raising at once), then returns the
        posted Transfer."""
        if agent is not self.agent:
            raise ValueError(f"{self.kind} region belongs to agent {self.agent.name!r}")
        host_of(agent).check_open()
        if notify is not None:
            raise ValueError(f"a {op} to a {self.kind} region takes no notify (nobody to tell)")
        fars = self.far_segments(far, op)
        views, nbytes = self._local_views(agent, local, len(fars), op)
        for i, (view, seg) in enumerate(zip(views, fars, strict=True)):
            region = seg.region
            if i == 0 or region is not fars[i - 1].region:
                if not isinstance(region, BackendRegion) or region.backend is not self:
                    raise TypeError(f"far segment {i} is not of a {self.kind} region")
                region._check()
            self.check_pair(seg, len(view), op, i)
        loop = asyncio.get_running_loop()
        t = BackendTransfer(
            DETACHED, loop, _next_id(), op, cast("Peer", self), nbytes, perf_counter()
        )
        t._posted = True  # nothing for the engine to flush: Transfer.__await__ skips it
        t._settled = False
        self._posted += 1
        self._inflight += 1
        self._inflight_bytes += nbytes
        task = loop.create_task(
            self._run(t, op, views, fars, priority), name=f"aioxfer-{self.name}-{op}"
        )
        t._task = task
        self._runners.add(task)
        task.add_done_callback(lambda task: self._runner_done(task, t))
        return t

    def _runner_done(self, task: asyncio.Task[None], t: BackendTransfer) -> None:
        self._runners.discard(task)
        if not t._settled:  # cancelled before it started: no I/O was begun
            self._settle(t, False)
            self._cancelled(t)

    def _local_views(
        self, agent: Agent, local: Any, n: int, op: Op
    ) -> tuple[list[memoryview], int]:
        """memoryviews of the local side, checked: host regions of this agent,
        writable for reads, as many as far segments, none empty."""
        spans: list[tuple[Region, int, int]]
        if type(local) is Segment:
            spans = [(local.region, local.offset, local.length)]
        elif isinstance(local, SegmentList):
            region = local.region
            if not isinstance(region, Region):
                raise TypeError("the local side must be a SegmentList of a local Region")
            offs = local.offsets.tolist()
            lens = local.lengths.tolist()
            spans = [(region, o, ln) for o, ln in zip(offs, lens, strict=True)]
        elif isinstance(local, Sequence) and not isinstance(local, str | bytes | bytearray):
            spans = []
            for i, seg in enumerate(local):
                if type(seg) is not Segment:
                    raise TypeError(f"local segment {i} is a {type(seg).__name__}, not a Segment")
                spans.append((seg.region, seg.offset, seg.length))
        else:
            raise TypeError(
                f"the local side of a {self.kind} {op} is a Segment, a list of them or a "
                f"SegmentList, not {type(local).__name__}"
            )
        if len(spans) != n:
            raise ValueError(f"{len(spans)} local segments but {n} {self.kind} segments")
        if not n:
            raise ValueError("no segments to transfer")
        views: list[memoryview] = []
        total = 0
        last: Region | None = None
        whole: memoryview | None = None
        for i, (region, off, length) in enumerate(spans):
            if region is not last:
                if region._agent is not agent:
                    raise ValueError(f"local segment {i} is in a region of another agent")
                region._check()
                if region.kind != "host":
                    raise TypeError(
                        f"local segment {i} is in {region.kind} region {region.name!r}: "
                        f"{self.kind} transfers move host memory"
                    )
                if op == "read" and not region.writable:
                    raise ValueError(
                        f"local region {region.name!r} is read-only: cannot read into it"
                    )
                whole = region.memoryview
                last = region
            if not length:
                raise ValueError(f"segment {i} is empty")
            assert whole is not None
            views.append(whole[off : off + length])
            total += length
        return views, total

    async def _run(
        self,
        t: BackendTransfer,
        op: Op,
        views: list[memoryview],
        fars: Sequence[Any],
        priority: int,
    ) -> None:
        move = self.put if op == "write" else self.get
        failure: tuple[int, BaseException] | None = None
        n = len(views)
        cursor = iter(range(n))
        workers: list[asyncio.Task[None]] = []

        async def worker() -> None:
            nonlocal failure
            for i in cursor:
                async with self._slots.held(priority):
                    if failure is not None:
                        return
                    try:
                        await move(views[i], fars[i])
                    except asyncio.CancelledError:
                        raise
                    except BaseException as exc:  # reported through the transfer
                        if failure is None:
                            failure = (i, exc)
                            # The first failure ends the request: the others stop now.
                            me = asyncio.current_task()
                            for w in workers:
                                if w is not me:
                                    w.cancel()
                        return
                self._ops += 1

        loop = asyncio.get_running_loop()
        try:
            if n == 1 or self.max_concurrency == 1:
                await worker()
            else:
                workers.extend(
                    loop.create_task(worker()) for _ in range(min(n, self.max_concurrency))
                )
                await asyncio.wait(workers)
        except asyncio.CancelledError:
            # Transfer.cancel() or agent.aclose(): stop the workers and wait
            # until they stopped: then nothing of ours touches the memory.
            for w in workers:
                w.cancel()
            while workers and not all(w.done() for w in workers):
                try:
                    await asyncio.wait(workers)
                except asyncio.CancelledError:  # cancelled again (aclose): still wait
                    continue
            self._settle(t, False)
            self._cancelled(t)
            return
        finally:
            for v in views:
                with contextlib.suppress(BufferError):  # a client still holds it: GC frees it
                    v.release()
        if failure is None:
            self._settle(t, True)
            if not t.done():
                t.set_result(TransferResult(t.nbytes, perf_counter() - t._t0, self.name))
            return
        i, exc = failure
        self._settle(t, False)
        if isinstance(exc, XferError):
            exc.op = exc.op or op
            exc.fail_index = i
            err: BaseException = exc
        else:
            err = XferError(
                f"{op} of {self.kind} segment {i} failed in backend {self.name!r}: "
                f"{type(exc).__name__}: {exc}",
                op=op,
                fail_index=i,
            )
            err.__cause__ = exc
        self._errors[type(err).__name__] = self._errors.get(type(err).__name__, 0) + 1
        self._fail(t, err)

    def _cancelled(self, t: BackendTransfer) -> None:
        if self.agent.closed and not t._cancel_requested:
            self._fail(t, ClosedResourceError(
                f"agent {self.agent.name!r} was closed with the {t.op} of {t.nbytes} bytes "
                f"to {self.kind} storage in flight", op=t.op,
            ))
        else:
            t._cancel_local()

    def _settle(self, t: BackendTransfer, ok: bool) -> None:
        t._settled = True
        self._inflight -= 1
        self._inflight_bytes -= t.nbytes
        if ok:
            self._completed += 1
            self._bytes += t.nbytes
        else:
            self._failed += 1

    @staticmethod
    def _fail(t: BackendTransfer, exc: BaseException) -> None:
        if not t.done():
            t.set_exception(exc)

    async def _aclose(self) -> None:
        """The agent is closing: fails what is in flight (ClosedResourceError),
        waits until it stopped, closes the regions and the backend's clients."""
        runners = list(self._runners)
        for task in runners:
            task.cancel()
        if runners:
            await asyncio.gather(*runners, return_exceptions=True)
        # A region whose close fails does not leave the others (or the
        # backend's clients) open: the first failure is raised at the end.
        first: Exception | None = None
        for region in list(self._regions.values()):
            try:
                await region.aclose()
            except Exception as exc:
                first = first or exc
        try:
            await self.close()
        except Exception as exc:
            first = first or exc
        if first is not None:
            raise first

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            name=self.name,
            kind=self.kind,
            regions=len(self._regions),
            transfers_posted=self._posted,
            transfers_completed=self._completed,
            transfers_failed=self._failed,
            ops=self._ops,
            bytes=self._bytes,
            in_flight=self._inflight,
            in_flight_bytes=self._inflight_bytes,
            retries=self._retries,
            errors=dict(self._errors),
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} of agent {self.agent.name!r}>"

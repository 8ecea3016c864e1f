"""Submission: an agent's transfers between ``write``/``read`` and their completion.

A collaborator of :class:`aioxfer.Agent` (issue 10, item 8): it owns the batch
of requests made in this loop iteration (posted to the engine in one native
call), the table of transfers in flight, eager posting at ``await``, cancel,
each peer's scheduler admission, and the drain of the engine's completion ring.
It reaches the agent only through the narrow arguments it was built with, and
a :class:`~aioxfer.transfer.Transfer` reaches it only through
:class:`~aioxfer.transfer.TransferHost`.

This is the hot path (an awaited 4 KiB same-host write costs a few
microseconds, all of it here and in the engine): locals are bound once per
call, and nothing runs per transfer that can run per batch.
"""

from __future__ import annotations

import asyncio
import builtins
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aioxfer import _cyx
from aioxfer.errors import ClosedResourceError, PeerLost, XferError, error_class
from aioxfer.stats import BANDWIDTH_MIN, ESTIMATE_WEIGHT, PeerCounters, TransferCounters
from aioxfer.transfer import Transfer, TransferResult

if TYPE_CHECKING:
    from aioxfer.peer import Peer
    from aioxfer.progress import Poller

__all__ = ["Submission"]

# What Engine.post_many takes per request: (endpoint, opcode, descs, notify, id),
# or a _cyx.PostItem (Agent.write/read's usual case: the same fields as C
# integers, no tuples made; it reads as that tuple, its descs a 6-tuple).
Item = tuple[int, int, Any, "bytes | None", int] | _cyx.PostItem
# A completion record Engine.drain does not settle itself (Engine.drain's ``slow``).
OnRecord = Callable[[int, int, int, int, int, int, "bytes | None"], None]

POLL_MAX = 4096  # records per drain call
POLL_ROUNDS = 8  # drain calls per wake-up before yielding to the loop
EAGER_MAX = 64 << 10  # awaited requests up to this size may be flushed at once
# A lone awaited request up to this size still in flight after its post is
# polled for before the await suspends (spin_alone, bounded by the peer's
# latency): a 1 MiB tcp request completes ~250 us later, and waking the loop
# for it costs two loop iterations (tcp5: READ 1 MiB 1.18x, WRITE 1.06x).
# Larger ones take long enough that the wake-up does not matter.
SPIN_ALONE_MAX = 1 << 20
# Eager posts in a row without the loop running in between: a transfer copied
# inside its post completes without its await suspending, so a coroutine
# awaiting one after another would starve the loop (timers, other tasks, the
# agent's own housekeeping). Past this many, the next await suspends once.
EAGER_STREAK = 64

# Submission.submit's Transfer, made by _cyx.FutureMaker: the fields
# Transfer.__init__ sets (test_house checks), given per call (_MADE_GIVEN, in
# make()'s argument order), the post time (_MADE_CLOCK) and the constants.
_MADE_GIVEN = ("_host", "req_id", "op", "peer", "nbytes")
_MADE_CLOCK = "_t0"
_MADE_FIXED: dict[str, object] = {
    "_posted": False,
    "_cancel_requested": False,
    "_admitted": False,
    "_queued_item": None,
    "_starts": None,
    "_path": None,
}
# Transfer._admitted of a transfer that is not in its peer's scheduler budget
# but that someone awaits settled() of: truthy, so that whatever takes it out
# of inflight calls release(t) (the compiled drain and inline completion do so
# only for an admitted one), which wakes the waiters and releases no budget.
_SETTLE_ONLY: Any = type("_SettleOnly", (), {"__slots__": (), "__repr__":
                                             lambda self: "<settle only>"})()
_CQ_XFER = _cyx.CQ_XFER
_CQ_XFER_HELD = _cyx.CQ_XFER_HELD
_CQ_XFER_FREED = _cyx.CQ_XFER_FREED
_E_CANCELLED = _cyx.E_CANCELLED
_E_CLOSED = _cyx.E_CLOSED
_E_PEER_LOST = _cyx.E_PEER_LOST
_DESC_STATUSES = frozenset({_cyx.E_ACCESS, _cyx.E_INVALID, _cyx.E_TRANSPORT, _cyx.E_PROTOCOL})


def _uses(descs: Any, rid: int) -> bool:
    """Whether a request's descriptors (a 6-tuple, an (n, 6) uint64 array, or
    None: a notification) read or write local region ``rid``."""
    if type(descs) is tuple:
        return bool(descs[0] == rid)
    if getattr(descs, "ndim", None) != 2:
        return False  # None, or what the engine refuses at its post anyway
    return bool((descs[:, 0] == rid).any())


def as_priority(priority: object) -> int:
    """A transfer's priority as an int (numpy's integers too), else TypeError."""
    try:
        return operator.index(priority)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"priority must be an integer, not {type(priority).__name__}"
        ) from None


class _Hold:
    """A deregistration held back (Submission.hold_region): ``then`` runs once
    ``left`` transfers using the region are over."""

    __slots__ = ("left", "then")

    def __init__(self, left: int, then: Callable[[], None]) -> None:
        self.left = left
        self.then = then


class Submission:
    """One agent's posted transfers: batch, in flight, admission, drain.

    ``agent``: the agent's name (for errors); ``engine``: its native engine;
    ``start()``: starts the agent on the running loop and returns that loop
    (the first transfer of an agent not started yet); ``alone_max``: a lone
    awaited request up to this size is posted at its await (the engine's
    inline threshold); ``on_event(kind, status, id, tag, nbytes, fail_index,
    payload)``: every completion record that is not a transfer's (notifications,
    engine events); ``peer_lost(peer, status)``: the engine refused a post
    because the peer is gone before its loss record reached us (marks it
    lost; the record, drained later, says how it ended);
    ``describe(t)``: how errors name a transfer.
    """

    __slots__ = (
        "_agent",
        "_engine",
        "_start",
        "_on_event",
        "_peer_lost",
        "_describe",
        "_on_record_cb",
        "_release_cb",
        "submit",
        "_fast",
        "_loop",
        "_make",
        "_poller",
        "closed",
        "alone_max",
        "inflight",
        "_held",
        "_pending",
        "_pending_t",
        "_flush_scheduled",
        "_pending_cancelled",
        "_eager_streak",
        "_holds",
        "_settling",
        "_totals",
    )

    def __init__(
        self,
        agent: str,
        *,
        engine: _cyx.Engine,
        start: Callable[[], asyncio.AbstractEventLoop],
        alone_max: int,
        on_event: OnRecord,
        peer_lost: Callable[[Peer, int], None],
        describe: Callable[[Transfer], str],
    ) -> None:
        self._agent = agent
        self._engine = engine
        self._start = start
        self._on_event = on_event
        self._peer_lost = peer_lost
        self._describe = describe
        # Bound once: every drain call passes them.
        self._on_record_cb = self._on_record
        self._release_cb = self.release
        # submit(peer, opcode, descs, notify, nbytes, op, priority=0): a new
        # Transfer, into this loop iteration's batch (or its peer's scheduler
        # queue, over the peer's limits; or failed, peer lost). _submit_py,
        # its usual case compiled (_cyx.Submitter: the same effects, no
        # Python frame); the rest goes to _submit_py itself.
        # eager(t) (TransferHost) likewise: _eager_py's usual case compiled
        # (the eager method below reaches it through _fast).
        self._fast = _cyx.Submitter(
            self, self._submit_py, self._flush, self._eager_py, TransferResult,
            ESTIMATE_WEIGHT, BANDWIDTH_MIN, POLL_MAX, EAGER_MAX, EAGER_STREAK, POLL_ROUNDS,
            SPIN_ALONE_MAX,
        )
        self.submit: Callable[..., Transfer] = self._fast.submit
        self._loop: asyncio.AbstractEventLoop | None = None
        # FutureMaker(Transfer, ...).make on the agent's loop, once started.
        self._make: Callable[[Submission, int, str, Peer, int], Transfer] | None = None
        self._poller: Poller | None = None
        self.closed = False  # the agent closed: nothing more is posted
        self.alone_max = alone_max
        self.inflight: dict[int, Transfer] = {}  # req id -> transfer, until its completion
        # req id -> a transfer over (its outcome told: CQ_XFER_HELD) whose
        # memory the engine still holds: pages of it sent by the one-copy
        # send (tcp, loopback) that a failed connection's peer may still
        # read. Busy until CQ_XFER_FREED (not in inflight: nothing is in
        # flight, so no poller spins for it and no post counts it).
        self._held: dict[int, Transfer] = {}
        self._pending: list[Item] = []  # this loop iteration's batch
        self._pending_t: list[Transfer] = []
        self._flush_scheduled = False
        self._pending_cancelled = False
        # Eager posts (Transfer.__await__) since the loop last ran our _flush:
        # a coroutine whose awaits complete inside the post never yields, so
        # past a bound its next await waits for the loop (see EAGER_*).
        self._eager_streak = 0
        # req id -> the deregistrations waiting for that transfer to be over
        # (hold_region); empty but for a region deregistered while a request
        # using it waited in a peer's scheduler.
        self._holds: dict[int, list[_Hold]] = {}
        # req id -> the futures of settled() waiting for that transfer to
        # leave the engine (empty but while someone waits: see busy).
        self._settling: dict[int, list[asyncio.Future[None]]] = {}
        # The agent's totals (statistics()): posted, completed, failed,
        # bytes (the properties below), kept as C integers in a PeerCounters
        # record that the compiled submit and drain add to (a Python int
        # read and a new int per total cost ~85 instructions each, two per
        # drain and per aioxfer.nixl repost). ``posted`` is also the last
        # request id handed out (submit: ids are 1, 2, ...).
        self._totals = PeerCounters()

    def started(self, loop: asyncio.AbstractEventLoop, poller: Poller | None) -> None:
        """The agent runs on ``loop`` now (``poller``: its progress mode's, if it polls)."""
        self._loop = loop
        self._make = _cyx.FutureMaker(
            Transfer, {"loop": loop}, _MADE_GIVEN, _MADE_CLOCK, _MADE_FIXED
        ).make
        self._poller = poller
        # The drain's wake-ups as one handle: on asyncio's own loops, whose
        # call_soon (Python) costs more than the batching (not on uvloop).
        self._engine.batch_wakeups = isinstance(loop, asyncio.BaseEventLoop)

    @property
    def posted(self) -> int:
        return self._totals.posted

    @posted.setter
    def posted(self, value: int) -> None:
        self._totals.posted = value

    @property
    def completed(self) -> int:
        return self._totals.completed

    @completed.setter
    def completed(self, value: int) -> None:
        self._totals.completed = value

    @property
    def failed(self) -> int:
        return self._totals.failed

    @failed.setter
    def failed(self, value: int) -> None:
        self._totals.failed = value

    @property
    def bytes(self) -> int:
        return self._totals.bytes

    @bytes.setter
    def bytes(self, value: int) -> None:
        self._totals.bytes = value

    def counters(self) -> TransferCounters:
        return TransferCounters(self.posted, self.completed, self.failed, self.bytes)

    # ------------------------------------------------------------ posting

    def _submit_py(
        self,
        peer: Peer,
        opcode: int,
        descs: Any,
        notify: builtins.bytes | None,
        nbytes: int,
        op: str,
        priority: int = 0,
    ) -> Transfer:
        """submit (see __init__) in Python: a new Transfer, into this loop
        iteration's batch (or its peer's scheduler queue, over the peer's
        limits; or failed, peer lost). _cyx.Submitter does the same for the
        usual request; keep the two in step."""
        if type(priority) is not int:
            # Checked before anything is made or counted, whether the peer
            # has limits or not (a request's validity does not depend on
            # them): the scheduler's heap raised only after the transfer was
            # in flight (counted there for good, failed unretrieved at
            # close); a float (NaN) would break its order. _cyx.Submitter
            # sends every priority that is not an exact int here.
            priority = as_priority(priority)
        make = self._make
        if make is None:
            self._start()  # calls started()
            make = self._make
            assert make is not None
        # The request id is the agent's posted count: one attribute, and no
        # bound-method call (a callable in a slot defeats LOAD_METHOD's
        # specialization on 3.11: a generic lookup per transfer).
        req_id = self.posted + 1
        self.posted = req_id
        # Transfer(self, loop, req_id, op, peer, nbytes, perf_counter()),
        # without its __init__ frame: the C Future's own new and init, then
        # every field of Transfer.__slots__ set through its slot, as
        # __init__ sets them (_MADE_*; test_house checks).
        t = make(self, req_id, op, peer, nbytes)
        c = peer._counters
        c.posted += 1
        c.inflight += 1
        c.inflight_bytes += nbytes
        if peer._lost:
            self.finish_failed(t, peer._lost_error())
            return t
        self.inflight[req_id] = t
        item = (peer._ep, opcode, descs, notify, req_id)
        sched = peer._sched
        if sched is not None:
            if not sched.admit(t, nbytes, priority):
                # Over the peer's limits: it waits here, not in the caller
                # (counted as queued, not in flight, until admitted).
                t._queued_item = item
                c.inflight -= 1
                c.inflight_bytes -= nbytes
                c.queued += 1
                c.queued_bytes += nbytes
                return t
            t._admitted = True
        # _enqueue, inlined: this runs once per transfer.
        self._pending.append(item)
        self._pending_t.append(t)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop = self._loop
            assert loop is not None
            loop.call_soon(self._flush)
        return t

    def _enqueue(self, t: Transfer, item: Item) -> None:
        """Into this loop iteration's batch (one native call at its end)."""
        self._pending.append(item)
        self._pending_t.append(t)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def release(self, t: Transfer) -> None:
        """An admitted transfer is over: what its peer's scheduler admits now
        goes to the engine (or fails, if the peer was lost meanwhile). Also
        called for a transfer awaited by settled() (_SETTLE_ONLY)."""
        admitted = t._admitted
        t._admitted = False
        if self._settling:
            self._settled(t)
        if self._holds:
            self._over(t)
        if admitted is _SETTLE_ONLY:
            return
        peer = t.peer
        assert peer._sched is not None
        self._admit(peer, peer._sched.release(t.nbytes))

    def _admit(self, peer: Peer, admitted: list[Transfer]) -> None:
        """Queued transfers the peer's scheduler admitted: into the batch."""
        c = peer._counters
        for q in admitted:
            item, q._queued_item = q._queued_item, None
            q._admitted = True
            c.queued -= 1
            c.queued_bytes -= q.nbytes
            c.inflight += 1
            c.inflight_bytes += q.nbytes
            assert item is not None
            self._enqueue(q, item)

    def unqueue_all(self, peer: Peer) -> list[Transfer]:
        """Empties the peer's scheduler queue (peer lost, agent closing)."""
        if peer._sched is None:
            return []
        queued = peer._sched.drain()
        c = peer._counters
        for q in queued:
            q._queued_item = None
            # Back into the in-flight counts, which failing it takes them from.
            c.inflight += 1
            c.inflight_bytes += q.nbytes
        c.queued = 0
        c.queued_bytes = 0
        return queued

    def hold_region(self, rid: int, then: Callable[[], None]) -> bool:
        """Memory.deregister: whether transfers using local region ``rid``
        have not reached the engine yet (waiting in a peer's scheduler, or
        admitted from it into this iteration's batch by a completion the
        deregistration's own post drained). Those were made before the
        deregistration and must finish (Agent.deregister's promise), but the
        engine forgets the region at once: posted later, they would fail
        against the stale id. True: ``then()`` (the engine's deregistration)
        runs, from the loop, once every one of them is over (completed,
        failed, cancelled or dropped); once posted, the engine's own count of
        ops on the region holds it. False: nothing to wait for."""
        ts = [t for item, t in zip(self._pending, self._pending_t, strict=True)
              if _uses(item[2], rid)]
        for t in self.inflight.values():
            item = t._queued_item
            if item is not None and _uses(item[2], rid):
                ts.append(t)
        if not ts:
            return False
        hold = _Hold(len(ts), then)
        for t in ts:
            self._holds.setdefault(t.req_id, []).append(hold)
        return True

    def _over(self, t: Transfer) -> None:
        """t is over (no post of it can come any more): the deregistrations
        it held back go on once nothing else holds them. Called from the
        drain's release callback (which may not post nor drain), so they
        run from the loop; closed, at once (then they do nothing: the
        close's release_all deregistered the region already)."""
        holds = self._holds.pop(t.req_id, None)
        if holds is None:
            return
        for hold in holds:
            hold.left -= 1
            if hold.left == 0:
                if self.closed or self._loop is None or self._loop.is_closed():
                    hold.then()
                else:
                    self._loop.call_soon(hold.then)

    def busy(self, t: Transfer) -> bool:
        """TransferHost: whether the engine may still touch ``t``'s memory:
        in inflight (its record not taken yet) and posted, or still to be
        posted (in this iteration's batch or its peer's scheduler, not
        cancelled: a cancelled one is dropped unposted)."""
        rid = t.req_id
        return (self.inflight.get(rid) is t and (t._posted or not t._cancel_requested)) or (
            self._held.get(rid) is t
        )

    def settled(self, t: Transfer) -> asyncio.Future[None]:
        """TransferHost: a future that ends when busy(t) is False."""
        fut: asyncio.Future[None] = t.get_loop().create_future()
        if not self.busy(t):
            fut.set_result(None)
            return fut
        self._settling.setdefault(t.req_id, []).append(fut)
        if t._admitted is False and t._queued_item is None:
            # (A queued one is admitted, _admitted True, before its post;
            # one dropped from the queue wakes them in cancel or finish_failed.)
            t._admitted = _SETTLE_ONLY
        return fut

    def _settled(self, t: Transfer) -> None:
        """t left inflight: its settled() futures end (a held one's at its
        CQ_XFER_FREED)."""
        if self._held and self._held.get(t.req_id) is t:
            return
        futs = self._settling.pop(t.req_id, None)
        if futs is not None:
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def fail_queued(self, peer: Peer) -> None:
        """The peer is lost: fails what waits in its scheduler (it never
        reached the engine) with the peer's error."""
        for q in self.unqueue_all(peer):
            self.inflight.pop(q.req_id, None)
            self.finish_failed(q, peer._lost_error())

    # _flush: one native call for everything submitted this loop iteration
    # (the callback submit schedules): _cyx.Submitter's _scheduled_flush of
    # self._fast, called as a method without a Python frame; _flush_py is
    # what it does.
    _flush = _cyx.submission_scheduled_flush

    def _flush_py(self) -> None:
        """_flush in Python."""
        self._flush_scheduled = False
        self._eager_streak = 0  # the loop ran: eager posts may go on
        self.post_pending()

    # Agent.flush: _cyx.Submitter.flush of self._fast, called as a method
    # without a Python frame (aioxfer.nixl flushes per request); _flush_now
    # is what it does.
    flush = _cyx.submission_flush

    def _flush_now(self) -> None:
        """flush in Python: posts the batch now; one transfer with nothing
        else in flight is posted as an awaited lone request is."""
        self.post_pending(len(self._pending_t) == 1 == len(self.inflight))

    # TransferHost.eager(t): _cyx.Submitter.eager of self._fast, called as a
    # method without a Python frame; _eager_py is what it does.
    eager = _cyx.submission_eager

    def _eager_py(self, t: Transfer) -> None:
        """eager (see __init__) in Python; TransferHost: ``t`` is awaited and
        not posted yet. _cyx.Submitter.eager does the same for the usual
        case; keep the two in step.

        Awaited with nothing else of the agent's in the engine: latency is
        all that matters, so what this loop iteration posted goes to the
        engine now rather than at the end of the iteration, when small, or
        when one request (awaited alone) is within the engine's calibrated
        inline_bytes: posted with POST_ALONE, a same-host copy then runs on
        this thread inside the post (no copy worker to wake, then no loop to
        wake) and the await does not suspend. Several small ones are batched
        into one native call."""
        n = len(self._pending)
        if (
            n == len(self.inflight)
            and (t.nbytes <= EAGER_MAX or (n == 1 and t.nbytes <= self.alone_max))
            and self._eager_streak < EAGER_STREAK
        ):
            self._eager_streak += 1
            self.post_pending(n == 1)
            if (n == 1 and self.inflight and self._poller is not None
                    and t.nbytes <= SPIN_ALONE_MAX):
                # Still in flight (not copied inside the post): poll for it
                # here, then the await may not suspend.
                self._poller.spin_alone(t, self._flush_scheduled)

    def post_pending(self, alone: bool = False) -> None:
        """Posts what is pending now (the batch lists are emptied, not
        replaced, when the engine takes all of it). eager() calls it
        directly: the scheduled _flush stays scheduled (and finds nothing or what came since), so a
        coroutine awaiting one small transfer after another without
        suspending schedules one callback, not one per transfer.
        alone: one transfer, awaited with nothing else in flight (the engine
        may copy it inside the call: POST_ALONE)."""
        items = self._pending
        if not items or self.closed:
            return
        ts = self._pending_t
        if self._pending_cancelled:
            self._pending = []
            self._pending_t = []
            self._pending_cancelled = False
            items, ts = self._drop_cancelled(items, ts)
            if not items:
                return
        try:
            # One native call: the batch posted (polls: the completions known
            # at submit, small same-host copies, need no eventfd wake-up, nor
            # its two syscalls) and, if the engine accepted all of it (the
            # usual case), every transfer marked posted, the batch lists
            # emptied (reused: what the drain's callbacks submit goes into
            # them), and the ring drained.
            statuses, n, completed, nbytes = self._engine.post_drain(
                items, ts, self.inflight, self._on_record_cb, self._release_cb,
                TransferResult, ESTIMATE_WEIGHT, BANDWIDTH_MIN, POLL_MAX, alone,
            )
        except Exception as exc:
            self._post_raised(ts, exc)
            return
        if statuses is None:
            self.completed += completed
            self.bytes += nbytes
            if n >= POLL_MAX:
                self.drain()  # more remain
        else:
            self._refused(ts, statuses)
        if self.inflight and self._poller is not None:
            self._poller.kick()  # poll for the rest before the loop blocks

    def _post_raised(self, ts: list[Transfer], exc: Exception) -> None:
        """post_drain raised: a callback's error (all posted, re-raised), or a
        bad item or a closed engine (nothing posted: ts fail)."""
        if not ts or ts[0]._posted:  # all posted: the drain's (a callback's) error
            raise exc
        if ts is self._pending_t:
            self._pending = []
            self._pending_t = []
        for t in ts:
            self.inflight.pop(t.req_id, None)
            self.finish_failed(t, XferError(f"{t.op} could not be posted: {exc}"))

    def _refused(self, ts: list[Transfer], statuses: list[int]) -> None:
        """post_drain refused some of ts: nothing was marked posted, emptied,
        nor drained."""
        if ts is self._pending_t:
            self._pending = []
            self._pending_t = []
        for t, st in zip(ts, statuses, strict=True):
            if st:
                self.inflight.pop(t.req_id, None)
                self.finish_failed(t, self.error(t, st, None, "rejected"))
                if st == _E_PEER_LOST and not t.peer._lost:
                    # The engine found the peer dead before its loss record
                    # reached us: lost now, so a retry never picks it again;
                    # said (closed or lost) when the record comes.
                    self._peer_lost(t.peer, st)
            else:
                t._posted = True
        self.drain()  # completions known at submit (small same-host copies)

    def _drop_cancelled(
        self, items: list[Item], ts: list[Transfer]
    ) -> tuple[list[Item], list[Transfer]]:
        """The batch without the transfers cancelled before it was posted
        (those are over now). Its own method: comprehensions over post_pending's
        locals would make them cells, created on every post (callgrind)."""
        keep = [i for i, t in enumerate(ts) if not t._cancel_requested]
        for t in ts:
            if t._cancel_requested:
                self.inflight.pop(t.req_id, None)
                self.finish_failed(t, None)
        return [items[i] for i in keep], [ts[i] for i in keep]

    def cancel(self, t: Transfer) -> None:
        """TransferHost: ``t.cancel()`` was called (first time, not done)."""
        if self.closed or t.req_id not in self.inflight:
            return
        if t._queued_item is not None:  # never left the scheduler: over at once
            peer = t.peer
            assert peer._sched is not None
            peer._sched.discard(t)
            t._queued_item = None
            c = peer._counters
            c.queued -= 1
            c.queued_bytes -= t.nbytes
            del self.inflight[t.req_id]
            # Counted as failed (it was never in flight); Transfer.cancel
            # cancels the future.
            c.failed += 1
            self.failed += 1
            if self._holds:
                self._over(t)
            if self._settling:
                self._settled(t)
            # What waited behind it may fit now (it was the head, waiting
            # for budget): not until a completion, which may be far off.
            self._admit(peer, peer._sched.admit_ready())
            return
        if t._posted:
            self._engine.cancel(t.req_id)
        else:
            self._pending_cancelled = True  # the flush drops it unposted

    # ------------------------------------------------------------ completions

    # Reader callback on the engine's eventfd; also called after a post, and
    # by aioxfer.nixl's tight poll once per request (Agent.poll):
    # _cyx.Submitter.drain of self._fast, called as a method without a Python
    # frame; _drain_py is what it does.
    drain = _cyx.submission_drain

    def _drain_py(self) -> None:
        """drain in Python (what _cyx.Submitter.drain does when the fields
        are what it expects; keep the two in step)."""
        # Successful transfers are completed inside _cyx (no Python call per
        # record: the bulk of a small transfer's cost otherwise); the rest
        # comes to _on_record, in ring order.
        rounds = POLL_ROUNDS
        while rounds:
            n, completed, nbytes = self._engine.drain(
                self.inflight, self._on_record_cb, self._release_cb, TransferResult,
                ESTIMATE_WEIGHT, BANDWIDTH_MIN, POLL_MAX,
            )
            self.completed += completed
            self.bytes += nbytes
            if n < POLL_MAX:
                return
            rounds -= 1
        assert self._loop is not None
        self._loop.call_soon(self.drain)  # more remain: let the loop breathe first

    def drain_once(self) -> int:
        """One drain call; the records it took (closing: until none remain)."""
        n, completed, nbytes = self._engine.drain(
            self.inflight, self._on_record_cb, self._release_cb, TransferResult,
            ESTIMATE_WEIGHT, BANDWIDTH_MIN, POLL_MAX,
        )
        self.completed += completed
        self.bytes += nbytes
        return n

    def _on_record(
        self,
        kind: int,
        status: int,
        rid: int,
        tag: int,
        nbytes: int,
        fail_index: int,
        payload: builtins.bytes | None,
    ) -> None:
        """A completion record Engine.drain does not settle itself: a failed
        or cancelled transfer here, the rest to the agent's on_event."""
        if kind != _CQ_XFER:
            if kind == _CQ_XFER_HELD:
                self._on_held(status, rid, nbytes, fail_index)
            elif kind == _CQ_XFER_FREED:
                t = self._held.pop(rid, None)
                if t is not None:
                    self._settled(t)
            else:
                self._on_event(kind, status, rid, tag, nbytes, fail_index, payload)
            return
        t = self.inflight.pop(rid, None)
        if t is None:
            return
        if status == _E_CANCELLED and t._cancel_requested:
            self.finish_failed(t, None)
        else:
            self.finish_failed(t, self.error(t, status, fail_index, "failed"))

    def _on_held(self, status: int, rid: int, nbytes: int, fail_index: int) -> None:
        """CQ_XFER_HELD: the transfer failed (or was cancelled): told now,
        on time, though a stopped peer may still hold pages of it; its
        memory stays the engine's until CQ_XFER_FREED (busy, settled()). A
        success is never held (engine.c op_finish_now: its one record waits
        for its pages, rev32)."""
        del nbytes
        t = self.inflight.pop(rid, None)
        if t is None:
            return
        self._held[rid] = t
        if status == _E_CANCELLED and t._cancel_requested:
            self.finish_failed(t, None)
        else:
            self.finish_failed(t, self.error(t, status, fail_index, "failed"))

    def finish_failed(self, t: Transfer, exc: BaseException | None) -> None:
        """Counts t as failed and fails (exc) or cancels (None) its future."""
        peer = t.peer
        if t._admitted:
            self.release(t)
        else:
            if self._holds:
                self._over(t)
            if self._settling:
                self._settled(t)
        c = peer._counters
        c.inflight -= 1
        c.inflight_bytes -= t.nbytes
        c.failed += 1
        self.failed += 1
        if t.done():
            return
        if exc is None:
            t._cancel_local()
        else:
            t.set_exception(exc)

    def fail_pending(self) -> None:
        """Closing: fails what was never handed to the engine (ClosedResourceError):
        what waits in the peers' schedulers, then this iteration's batch. The
        queued go first: failing the batch releases its admitted transfers'
        budgets, which would admit queued ones into a new batch, posted
        (and maybe completed) during the close's wait for our memory."""
        queued = [t for t in self.inflight.values() if t._queued_item is not None]
        peers = {id(t.peer): t.peer for t in queued}
        for peer in peers.values():
            for q in self.unqueue_all(peer):
                self.inflight.pop(q.req_id, None)
                self.finish_failed(q, self.closed_error(q))
        pending, self._pending_t, self._pending = self._pending_t, [], []
        for t in pending:
            self.inflight.pop(t.req_id, None)
            self.finish_failed(t, self.closed_error(t))

    def fail_inflight(self) -> None:
        """Closed: fails what the engine, shut down and drained, never
        reported on (should not happen) with ClosedResourceError; held
        transfers whose CQ_XFER_FREED never came (the shut-down engine gave
        up on their pages) settle."""
        held, self._held = self._held, {}
        for t in held.values():
            self._settled(t)
        for t in list(self.inflight.values()):
            self.inflight.pop(t.req_id, None)
            self.finish_failed(t, self.closed_error(t))

    def error(self, t: Transfer, status: int, fail_index: int | None, how: str) -> XferError:
        """The error transfer ``t`` fails with, from its native status."""
        peer = t.peer
        if status in (_E_CLOSED, _E_PEER_LOST):
            if self.closed and status == _E_CLOSED:
                return self.closed_error(t)
            if peer._stale or peer._closed:
                return peer._lost_error()
            if peer._lost_reason:
                # We closed the endpoint because the peer is gone (discovery):
                # its transfers fail as lost, not as closed by us.
                return PeerLost(
                    f"{self._describe(t)} ({peer.path}) {how}: peer lost: {peer._lost_reason}",
                    status=_E_PEER_LOST,
                    peer=peer.name,
                    op=t.op,
                )
        what = f"{self._describe(t)} ({peer.path}) {how}"
        if fail_index is not None and t._starts is not None and fail_index < len(t._starts):
            fail_index = int(t._starts[fail_index])  # the caller's index, not the merged one
        if fail_index is not None and status in _DESC_STATUSES and t.op != "notify":
            what += f" at descriptor {fail_index}"
        if status == _E_CANCELLED:
            what += " by the engine"
        return error_class(status)(
            f"{what}: {_cyx.strerror(status)}",
            status=status,
            peer=peer.name,
            op=t.op,
            fail_index=fail_index,
        )

    def closed_error(self, t: Transfer) -> ClosedResourceError:
        return ClosedResourceError(
            f"agent {self._agent!r} was closed with the {self._describe(t)} in flight",
            status=_E_CLOSED,
            peer=t.peer.name,
            op=t.op,
        )

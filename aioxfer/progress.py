"""How an agent's event loop learns that transfers completed: its progress mode.

``Agent(progress=...)`` chooses one of:

- ``"sleep"``: the loop blocks in epoll on the engine's eventfd; a completion
  made on an engine thread wakes it (a thread wake-up: a few microseconds on
  bare metal, tens in a VM). The cheapest when many transfers overlap.
- ``"adaptive"`` (the default): while this agent has transfers in flight, the
  loop first polls the engine's completion ring for a bounded time (the
  engine's calibrated ``poll_us``, about two wake-ups) before blocking, and
  keeps polling while completions keep coming within that bound. A transfer
  awaited alone then completes without the loop being woken. Nothing is
  polled while nothing is in flight: an idle agent costs what ``"sleep"`` does.
- ``"poll"``: while transfers are in flight the loop busy-polls the ring (a
  core spent on it, as a dedicated progress thread would), in slices that
  let the loop's other callbacks run; idle, it blocks as ``"sleep"`` does.

The poll runs as a callback of the loop (``call_soon``), so it works the same
on asyncio's loops and on uvloop; the engine's wait releases the GIL. A poll
that finds completions is always followed by a drain, so the records it saw
are left unsignalled for that drain (``Engine.wait_polls``): no eventfd write
and no read for them, two system calls fewer per request.

A request awaited alone (nothing else of the agent's in flight; up to
``submission.SPIN_ALONE_MAX``, 1 MiB) is also polled for inside its ``await``,
on asyncio's own loops, when the loop has nothing else ready
(``Poller.spin_alone``): the await then returns without suspending, which
saves the two loop iterations (a ``select`` each, the task's wake-up handle)
of the callback's way, most of what Python adds to a tcp round trip.
Its bound is the peer's own (``alone_us``): twice the time it takes, its
latency average, or for a large request its bytes at its bandwidth average
(at least ``poll_us``, at most ``ALONE_MAX_US``), so a slow peer is waited for
by the loop as before; and the loop runs (its ``select``, its callbacks) at
least every ``ALONE_SPAN_US`` of such polling, as it does for the eager
posts' streak: that request's await suspends, and the loop's poll waits
that bound for it once.

As a target, the mode also says whether the engine's tcp receiver that just
answered a request polls its socket for the peer's next one (the engine's
``target_poll_us``): in "adaptive" while that peer's requests have come
within ``TARGET_POLL_US`` of the answers (on average), for twice that gap, one
receiver of the agent at a time; in "poll" the same within
``POLL_SLICE_US``; never in "sleep". A peer awaiting its requests one at a
time then finds the receiver running rather than asleep in ``recv`` (a thread
wake-up less per request); an idle or slow peer costs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sized
from time import perf_counter_ns
from typing import Any, Final, Protocol

from aioxfer.stats import BANDWIDTH_MIN

PROGRESS_MODES: Final = ("adaptive", "sleep", "poll")
POLL_SLICE_US: Final = 500  # "poll": one wait, then the loop's other callbacks run
ALONE_MAX_US: Final = 1000  # the most one await spins for its request (spin_alone)
ALONE_SPAN_US: Final = 1000  # spin_alone's time in a row without the loop running
TARGET_POLL_US: Final = 100  # "adaptive": a target polls for requests that come this soon
_NEVER_US: Final = (1 << 32) - 1  # the engine's target_poll_us for "never"


def check_mode(progress: object) -> str:
    if not isinstance(progress, str) or progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {PROGRESS_MODES}, not {progress!r}")
    return progress


def target_poll_us(mode: str) -> int:
    """The engine's ``target_poll_us`` for a progress mode."""
    return {"adaptive": TARGET_POLL_US, "poll": POLL_SLICE_US}.get(mode, _NEVER_US)


def alone_us(t: Any, floor: int) -> int:
    """How long an await polls for its lone transfer ``t`` (spin_alone),
    microseconds: twice what the peer takes for it, at least ``floor`` (the
    engine's ``poll_us``) and at most ALONE_MAX_US. What it takes: its
    latency average (``t.peer._counters.latency``, s: small transfers), or
    for a large transfer (BANDWIDTH_MIN or more), its bytes at the peer's
    bandwidth average (``.bandwidth``, bytes/s), when that is longer: a 1 MiB
    tcp request takes ~250 us where a small one takes ~25, and a poll
    bounded by the small ones' ran out before most 1 MiB READs completed
    (then the loop is woken for it: two loop iterations and a thread
    wake-up)."""
    c = t.peer._counters
    us = int(c.latency * 2e6)
    bw = c.bandwidth
    if bw > 0.0 and t.nbytes >= BANDWIDTH_MIN:
        sized = int(t.nbytes * 2e6 / bw)
        if sized > us:
            us = sized
    if us <= floor:
        return floor
    return us if us < ALONE_MAX_US else ALONE_MAX_US


class Polled(Protocol):
    """What a Poller polls for (aioxfer.submission.Submission implements it)."""

    @property
    def closed(self) -> bool: ...

    @property
    def inflight(self) -> Sized: ...

    def drain(self) -> None: ...


class Poller:
    """One agent's bounded poll of its engine's ring (modes adaptive, poll).

    ``sub``: the agent's transfers in flight and their drain; ``wait(us)``: the
    engine's bounded wait for a completion (nonzero: one came, and
    ``sub.drain()`` is called next, always: ``Engine.wait_polls`` relies on it)."""

    __slots__ = ("_sub", "_wait", "_loop", "_budget", "_keep", "_scheduled", "_ready",
                 "_spent_ns", "_next", "hits", "misses", "alone_hits", "alone_misses")

    def __init__(self, sub: Polled, wait: Callable[[int], int],
                 loop: asyncio.AbstractEventLoop, mode: str, poll_us: int) -> None:
        self._sub = sub
        self._wait = wait
        self._loop = loop
        self._keep = mode == "poll"  # poll on after a miss
        self._budget = max(int(poll_us), POLL_SLICE_US) if self._keep else int(poll_us)
        self._scheduled = False
        # asyncio's own loops: their queue of ready callbacks (spin_alone
        # polls only while it holds nothing but ours); other loops (uvloop,
        # whose queue is not visible): None, no spin_alone.
        ready = getattr(loop, "_ready", None) if isinstance(loop, asyncio.BaseEventLoop) else None
        self._ready: Sized | None = ready if isinstance(ready, Sized) else None
        self._spent_ns = 0  # spin_alone's polling since the loop last ran _run
        self._next = 0  # _run's bound once (us): a lone transfer spin_alone left to it
        self.hits = 0  # polls that found a completion
        self.misses = 0  # polls that ran out (then the eventfd wakes the loop)
        self.alone_hits = 0  # spin_alone polls that found it (the await did not suspend)
        self.alone_misses = 0  # spin_alone polls that ran out (then the callback's way)

    def kick(self) -> None:
        """Transfers are in flight: poll before the loop blocks."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def spin_alone(self, t: Any, flush_scheduled: bool) -> None:
        """``t`` was just posted, awaited, with nothing else of the agent's in
        flight: polls for its completion here, before the await suspends, if
        the loop has nothing else to run (``flush_scheduled``: the
        submission's own callback is one of the ready ones). Bounded by
        ``alone_us(t)`` and by ALONE_SPAN_US in a row without the loop
        running; past that span the loop runs first, and its own poll
        (``_run``) waits that long once instead of its usual bound."""
        ready = self._ready
        if ready is None or len(ready) > self._scheduled + flush_scheduled:
            return
        budget = alone_us(t, self._budget)
        if self._spent_ns > ALONE_SPAN_US * 1000:
            self._next = budget
            return
        sub = self._sub
        t0 = perf_counter_ns()
        got = self._wait(budget)
        self._spent_ns += perf_counter_ns() - t0
        if got:
            self.alone_hits += 1
            sub.drain()
        else:
            self.alone_misses += 1

    def _run(self) -> None:
        self._scheduled = False
        self._spent_ns = 0  # the loop runs
        budget, self._next = max(self._budget, self._next), 0
        sub = self._sub
        if sub.closed or not sub.inflight:
            return
        if self._wait(budget):
            self.hits += 1
            sub.drain()
            if sub.inflight:
                self.kick()
        else:
            self.misses += 1
            if self._keep:
                self.kick()

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
Its bound is the peer's own (``Poller.alone_bound``): ``ALONE_LATENCIES`` times
its latency average, or for a large request twice its bytes at its bandwidth
average (at least ``poll_us``, at most ``ALONE_MAX_US``), so a slow peer is
waited for by the loop as before; and the loop runs (its ``select``, its callbacks) at
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
from typing import Final, Protocol

from aioxfer import _cyx
from aioxfer.stats import BANDWIDTH_MIN

PROGRESS_MODES: Final = ("adaptive", "sleep", "poll")
POLL_SLICE_US: Final = 500  # "poll": one wait, then the loop's other callbacks run
ALONE_MAX_US: Final = 1000  # the most one await spins for its request (spin_alone)
# spin_alone's bound for a small request, in the peer's latency averages. A
# spin's bound is wall-clock time, and the spinning thread yields its CPU
# while it waits (sched_yield: the completion may need that CPU): on a busy
# host it can be off the CPU for longer than a request takes. With 2 (twice
# the average, ~50 us for a 25 us tcp 64 KiB WRITE) 0.5-1.5 % of lone 64 KiB
# tcp requests ran out of it (one such preemption) and went the loop's way
# (its poll, then the eventfd's wake-up), 4-7 % of the time of the whole
# run; with 5 (~125 us) 0.01-0.07 % did (py23, 5 interleaved pairs on the
# 2-vCPU VM). A request that completes sooner stops the spin at once: the
# bound only costs CPU for a late one (and ALONE_MAX_US, ALONE_SPAN_US cap it).
ALONE_LATENCIES: Final = 5
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


class Polled(Protocol):
    """What a Poller polls for (aioxfer.submission.Submission implements it)."""

    @property
    def closed(self) -> bool: ...

    @property
    def inflight(self) -> Sized: ...

    def drain(self) -> None: ...


class Poller(_cyx.Poller):
    """One agent's bounded poll of its engine's ring (modes adaptive, poll).

    ``sub``: the agent's transfers in flight and their drain; ``wait(us)``: the
    engine's bounded wait for a completion (nonzero: one came, and
    ``sub.drain()`` is called next, always: ``Engine.wait_polls`` relies on it).

    Compiled (``_cyx.Poller``, with this module's constants): the submission
    path calls ``kick`` and ``spin_alone`` without a Python frame, and an
    ``Engine.wait_polls`` is called as the engine's own wait. Its methods:

    - ``kick()``: transfers are in flight: poll before the loop blocks
      (``_run`` scheduled once).
    - ``spin_alone(t, flush_scheduled)``: ``t`` was just posted, awaited,
      with nothing else of the agent's in flight: polls for its completion
      here, before the await suspends, if the loop has nothing else to run
      (``flush_scheduled``: the submission's own callback is one of the
      ready ones). Bounded by ``alone_bound(t)`` and by ALONE_SPAN_US in a row
      without the loop running; past that span the loop runs first, and its
      own poll (``_run``) waits that long once instead of its usual bound.
    - ``_run()``: the loop's poll, ``poll_us`` (or what spin_alone left to
      it); then a drain, or a miss (in "poll": polled again).

    Counts: ``hits``/``misses`` (the loop's polls that found a completion /
    ran out, then the eventfd wakes the loop), ``alone_hits``/
    ``alone_misses`` (spin_alone's: the await did not suspend / the
    callback's way)."""

    __slots__ = ()

    def __init__(self, sub: Polled, wait: Callable[[int], int],
                 loop: asyncio.AbstractEventLoop, mode: str, poll_us: int) -> None:
        super().__init__(sub, wait, loop, mode, poll_us, POLL_SLICE_US, ALONE_MAX_US,
                         ALONE_SPAN_US, BANDWIDTH_MIN, ALONE_LATENCIES)

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
on asyncio's loops and on uvloop; the engine's wait releases the GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sized
from typing import Final, Protocol

PROGRESS_MODES: Final = ("adaptive", "sleep", "poll")
POLL_SLICE_US: Final = 500  # "poll": one wait, then the loop's other callbacks run


def check_mode(progress: object) -> str:
    if not isinstance(progress, str) or progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {PROGRESS_MODES}, not {progress!r}")
    return progress


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
    engine's bounded wait for a completion (nonzero: one came)."""

    __slots__ = ("_sub", "_wait", "_loop", "_budget", "_keep", "_scheduled", "hits", "misses")

    def __init__(self, sub: Polled, wait: Callable[[int], int],
                 loop: asyncio.AbstractEventLoop, mode: str, poll_us: int) -> None:
        self._sub = sub
        self._wait = wait
        self._loop = loop
        self._keep = mode == "poll"  # poll on after a miss
        self._budget = max(int(poll_us), POLL_SLICE_US) if self._keep else int(poll_us)
        self._scheduled = False
        self.hits = 0  # polls that found a completion
        self.misses = 0  # polls that ran out (then the eventfd wakes the loop)

    def kick(self) -> None:
        """Transfers are in flight: poll before the loop blocks."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        sub = self._sub
        if sub.closed or not sub.inflight:
            return
        if self._wait(self._budget):
            self.hits += 1
            sub.drain()
            if sub.inflight:
                self.kick()
        else:
            self.misses += 1
            if self._keep:
                self.kick()

"""Transfer: the awaitable handle of one posted request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from aioxfer.agent import Agent
    from aioxfer.peer import Peer

__all__ = ["Transfer", "TransferResult"]

_EAGER_MAX = 64 << 10  # awaited requests up to this size may be flushed at once
# Eager posts in a row without the loop running in between: a transfer copied
# inside its post completes without its await suspending, so a coroutine
# awaiting one after another would starve the loop (timers, other tasks, the
# agent's own housekeeping). Past this many, the next await suspends once.
_EAGER_STREAK = 64

# Called unbound: cheaper than super() on a path taken once per transfer.
_future_init = asyncio.Future.__init__
_future_await = asyncio.Future.__await__


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What a finished transfer moved: bytes, seconds from post to completion,
    the transport that carried it ("shm" or "tcp"), and how many of its parts
    were moved to another rail when theirs failed (tcp)."""

    # _cyx.Engine.drain builds these without calling __init__ (it sets the
    # four fields as the generated __init__ would): no __post_init__ here.
    nbytes: int
    seconds: float
    path: str
    reroutes: int = 0


class Transfer(asyncio.Future[TransferResult]):
    """A posted READ, WRITE or notification; ``await`` it for its TransferResult.

    A Transfer is an asyncio Future, so ``asyncio.gather``, ``wait``,
    ``as_completed`` and ``shield`` take it as it is (no task per transfer).
    Only the agent resolves it: do not call ``set_result``/``set_exception``.

    Cancelling it (``cancel()``, or cancelling the task that awaits it, e.g. by
    ``asyncio.timeout``) raises CancelledError in the awaiter at once and asks the
    engine to stop; the memory involved stays pinned, and the transfer counts as
    in flight, until the engine confirms it no longer touches it.
    """

    __slots__ = (
        "_agent",
        "req_id",
        "op",
        "peer",
        "nbytes",
        "_t0",
        "_posted",
        "_cancel_requested",
        "_admitted",
        "_queued_item",
        "_starts",
        "_path",
    )

    def __init__(
        self,
        agent: Agent,
        loop: asyncio.AbstractEventLoop,
        req_id: int,
        op: str,
        peer: Peer,
        nbytes: int,
        t0: float,
    ) -> None:
        _future_init(self, loop=loop)
        self._agent = agent
        self.req_id = req_id
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self._t0 = t0
        self._posted = False  # handed to the engine (a completion record will come)
        self._cancel_requested = False
        self._admitted = False  # counted in its peer's scheduler budget
        self._queued_item: tuple[int, int, object, bytes | None, int] | None = None
        self._starts: npt.NDArray[np.intp] | None = None  # merged descs' first original index
        self._path: str | None = None  # the path it took, where not peer.path

    def __await__(self):  # type: ignore[no-untyped-def]
        # Awaited with nothing else of the agent's in the engine: latency is
        # all that matters, so what this loop iteration posted goes to the
        # engine now rather than at the end of the iteration, when small, or
        # when one request (awaited alone) is within the engine's calibrated
        # inline_bytes: posted with POST_ALONE, a same-host copy then runs on
        # this thread inside the post (no copy worker to wake, then no loop
        # to wake) and the await does not suspend. Several small ones are
        # batched into one native call. (_posted first: with many in flight,
        # the first await posted the rest.)
        if not self._posted and not self.done():
            agent = self._agent
            n = len(agent._pending)
            if (
                n == len(agent._inflight)
                and (self.nbytes <= _EAGER_MAX or (n == 1 and self.nbytes <= agent._alone_max))
                and agent._eager_streak < _EAGER_STREAK
            ):
                agent._eager_streak += 1
                agent._post_pending(n == 1)
        return _future_await(self)

    __iter__ = __await__

    def cancel(self, msg: object = None) -> bool:
        """Cancels the transfer; False if it had already finished. Task.cancel()
        of a task awaiting this transfer comes here too."""
        if self.done():
            return False
        if not self._cancel_requested:
            self._cancel_requested = True
            self._agent._cancel_transfer(self)
        return super().cancel(msg)

    def _cancel_local(self) -> None:
        # The engine confirmed the cancel (or it never reached the engine).
        if not self.done():
            super().cancel()

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "finished" if self.done() else "pending"
        return (
            f"<Transfer {self.op} #{self.req_id} {self.nbytes} bytes "
            f"peer={self.peer.name!r} {state}>"
        )

"""Transfer: the awaitable handle of one posted request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioxfer.agent import Agent
    from aioxfer.peer import Peer

__all__ = ["Transfer", "TransferResult"]


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What a finished transfer moved: bytes, seconds from post to completion,
    and the transport that carried it ("shm" or "tcp")."""

    nbytes: int
    seconds: float
    path: str


class Transfer:
    """A posted READ, WRITE or notification; ``await`` it for its TransferResult.

    Cancelling it (``cancel()``, or cancelling the task that awaits it, e.g. by
    ``asyncio.timeout``) raises CancelledError in the awaiter at once and asks the
    engine to stop; the memory involved stays pinned, and the transfer counts as
    in flight, until the engine confirms it no longer touches it.
    """

    __slots__ = (
        "_agent",
        "_future",
        "req_id",
        "op",
        "peer",
        "nbytes",
        "_t0",
        "_posted",
        "_cancel_requested",
    )

    def __init__(
        self,
        agent: Agent,
        future: asyncio.Future[TransferResult],
        req_id: int,
        op: str,
        peer: Peer,
        nbytes: int,
        t0: float,
    ) -> None:
        self._agent = agent
        self._future = future
        self.req_id = req_id
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self._t0 = t0
        self._posted = False  # handed to the engine (a completion record will come)
        self._cancel_requested = False

    def __await__(self) -> Generator[Any, None, TransferResult]:
        fut = self._future
        try:
            return (yield from fut.__await__())
        except asyncio.CancelledError:
            # The awaiting task was cancelled: Task.cancel() cancelled our future
            # first. A future that already had its result means the data moved.
            if fut.cancelled() or not fut.done():
                self._cancel_native()
                fut.cancel()
            raise

    def done(self) -> bool:
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> bool:
        """Cancels the transfer; False if it had already finished."""
        if self._future.done():
            return False
        self._cancel_native()
        return self._future.cancel()

    def _cancel_native(self) -> None:
        if not self._cancel_requested:
            self._cancel_requested = True
            self._agent._cancel_transfer(self)

    def result(self) -> TransferResult:
        """The result; raises the transfer's error, CancelledError, or
        InvalidStateError when it has not finished."""
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def add_done_callback(self, fn: Callable[[Transfer], object]) -> None:
        """Calls fn(transfer) (through the loop) once the transfer is done."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        if self._future.cancelled():
            state = "cancelled"
        elif not self._future.done():
            state = "pending"
        elif self._future.exception() is not None:
            state = "failed"
        else:
            state = "done"
        return (
            f"<Transfer {self.op} #{self.req_id} {self.nbytes} bytes "
            f"peer={self.peer.name!r} {state}>"
        )

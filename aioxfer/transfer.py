"""Transfer: the awaitable handle of one posted request."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from aioxfer import _cyx

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from aioxfer.peer import Peer

__all__ = ["Transfer", "TransferResult"]


# Called unbound: cheaper than super() on a path taken once per transfer.
_future_init = asyncio.Future.__init__


class TransferHost(Protocol):
    """All a Transfer asks of what posted it (aioxfer.submission.Submission
    implements it; an agent's other state is none of a Transfer's business)."""

    def eager(self, t: Transfer) -> None:
        """``t`` is awaited and not yet handed to the engine: post now if that
        is what latency wants (it may complete ``t`` inside the call)."""

    def cancel(self, t: Transfer) -> None:
        """``t.cancel()`` was called on ``t``, not done: stop it (the engine
        confirms later) or drop it before it is posted."""

    def busy(self, t: Transfer) -> bool:
        """Whether the engine may still read or write ``t``'s memory."""

    def settled(self, t: Transfer) -> asyncio.Future[None]:
        """A future that ends once ``busy(t)`` is False."""


class _Detached:
    """The host of a Transfer that no engine runs (a local backend's: it is
    marked posted at once and resolves itself)."""

    __slots__ = ()

    def eager(self, t: Transfer) -> None:
        pass

    def cancel(self, t: Transfer) -> None:
        pass

    def busy(self, t: Transfer) -> bool:
        return False

    def settled(self, t: Transfer) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = t.get_loop().create_future()
        fut.set_result(None)
        return fut


DETACHED: TransferHost = _Detached()


# What a finished transfer moved: bytes, seconds from post to completion, the
# transport that carried it ("shm" or "tcp"), and how many of its parts were
# moved to another rail when theirs failed (tcp). A frozen dataclass's public
# behaviour (fields, dataclasses.replace/asdict, ==, hash, repr, pickle),
# compiled: made and freed once per request (cyx/_completions.pxi).
TransferResult = _cyx.TransferResult


class Transfer(asyncio.Future[TransferResult]):
    """A posted READ, WRITE or notification; ``await`` it for its TransferResult.

    A Transfer is an asyncio Future, so ``asyncio.gather``, ``wait``,
    ``as_completed`` and ``shield`` take it as it is (no task per transfer).
    Only the agent resolves it: do not call ``set_result``/``set_exception``.

    Cancelling it (``cancel()``, or cancelling the task that awaits it, e.g. by
    ``asyncio.timeout``) raises CancelledError in the awaiter at once and asks the
    engine to stop; the memory involved stays pinned, and the transfer counts as
    in flight, until the engine confirms it no longer touches it:
    ``await t.settled()`` waits for that (before the memory is reused for
    something else, e.g. a cancelled READ's destination).

    The same holds for a WRITE that fails (or is cancelled) after the tcp
    path's one-copy send handed pages of its buffer to a same-host peer
    (256 KiB-1 MiB writes over loopback; off with ``AIOXFER_TCP_SPLICE=0``):
    the transfer fails on time, but a peer that is stopped, or slow to read,
    may still read those pages and apply them at their destination as they
    are then. The engine keeps the memory held (``busy`` stays True, a
    deregistration of it waits) until the kernel shows the pages read or
    dropped (the peer resumed and read, or exited); reuse such a buffer only
    after ``await t.settled()``, else bytes never sent may land at the peer.
    """

    __slots__ = (
        "_host",
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
        host: TransferHost,
        loop: asyncio.AbstractEventLoop,
        req_id: int,
        op: str,
        peer: Peer,
        nbytes: int,
        t0: float,
    ) -> None:
        _future_init(self, loop=loop)
        self._host = host
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

    # Not in the engine yet: the host may post it now (Submission.eager:
    # awaited alone and small, it then completes inside the post and this
    # await does not suspend), then the C Future's own await. _posted first:
    # with many in flight, the first await posted the rest. Compiled
    # (_cyx.eager_await reads both fields by their slots): a Python frame
    # and two calls fewer per awaited transfer. In Python it reads:
    #     if not self._posted and not self.done():
    #         self._host.eager(self)
    #     return asyncio.Future.__await__(self)
    __await__ = _cyx.eager_await
    __iter__ = _cyx.eager_await

    def cancel(self, msg: object = None) -> bool:
        """Cancels the transfer; False if it had already finished. Task.cancel()
        of a task awaiting this transfer comes here too."""
        if self.done():
            return False
        if not self._cancel_requested:
            self._cancel_requested = True
            self._host.cancel(self)
        return super().cancel(msg)

    @property
    def busy(self) -> bool:
        """Whether the engine may still read or write this transfer's memory:
        from its submit until its completion record is taken (a transfer
        done, other than by a cancel, is not busy; a cancelled one is until
        the engine confirms the cancel, or reports the outcome it reached
        first; a failed one whose pages a peer may still read, see the
        class, until the engine releases them). Loop thread only, as the
        rest of the agent."""
        return self._host.busy(self)

    def settled(self) -> asyncio.Future[None]:
        """A future (of the agent's loop) that ends when the engine no longer
        touches this transfer's memory (``busy`` is False): at once if it
        never reached the engine (cancelled before its post, or refused).
        Unlike the transfer itself it ends only then, also after a cancel,
        so the memory can be reused once it has; it never fails (the
        transfer's own outcome is the transfer's), and cancelling it stops
        only this wait. Loop thread only."""
        return self._host.settled(self)

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

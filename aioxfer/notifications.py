"""Notifications received from peers, as an async stream with backpressure."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from aioxfer.errors import ClosedResourceError

__all__ = ["Notification", "Notifications"]


@dataclass(frozen=True, slots=True)
class Notification:
    """A message from a peer; a write's notification arrives only after all of
    that write's data is in this agent's memory."""

    peer_name: str
    payload: bytes


class Notifications:
    """``await receive()`` or ``async for n in notifications``.

    In arrival order. Bounded per connection (``Limits.max_notify_per_conn``):
    once that many from one connection wait here, the engine stops reading
    that connection until the application takes some, so TCP flow control
    slows the sender; nothing is dropped. When the agent closes, what was
    already received is still handed out; after that ``receive()`` raises
    ClosedResourceError and ``async for`` ends.
    """

    __slots__ = ("_items", "_waiters", "_closed", "_release")

    def __init__(self, release: Callable[[int], None] | None = None) -> None:
        # (notification, the tag of the connection it came on)
        self._items: deque[tuple[Notification, int]] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._release = release  # gives one notification's credit back to its connection

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def receive_nowait(self) -> Notification:
        """The next notification; raises asyncio.QueueEmpty when there is none
        yet, ClosedResourceError when there is none and the agent is closed."""
        if self._items:
            return self._take()
        if self._closed:
            raise ClosedResourceError("the agent is closed: no more notifications")
        raise asyncio.QueueEmpty

    def _take(self) -> Notification:
        item, tag = self._items.popleft()
        if self._release is not None and not self._closed:
            self._release(tag)
        return item

    async def receive(self) -> Notification:
        while not self._items:
            if self._closed:
                raise ClosedResourceError("the agent is closed: no more notifications")
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
                if self._items:
                    self._wake_one()  # pass on a wake-up this cancelled receiver got
                raise
        return self._take()

    def __aiter__(self) -> Notifications:
        return self

    async def __anext__(self) -> Notification:
        try:
            return await self.receive()
        except ClosedResourceError:
            raise StopAsyncIteration from None

    # -------------------------------------------------------------- agent side

    def _put(self, item: Notification, tag: int = 0) -> None:
        self._items.append((item, tag))
        if self._waiters:
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def _close(self) -> None:
        self._closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)

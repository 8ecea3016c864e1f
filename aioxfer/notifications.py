"""Notifications received from peers, as an unbounded async stream."""

from __future__ import annotations

import asyncio
from collections import deque
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

    Unbounded, in arrival order. When the agent closes, what was already received
    is still handed out; after that ``receive()`` raises ClosedResourceError and
    ``async for`` ends.
    """

    __slots__ = ("_items", "_waiters", "_closed")

    def __init__(self) -> None:
        self._items: deque[Notification] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def receive_nowait(self) -> Notification:
        """The next notification; raises asyncio.QueueEmpty when there is none
        yet, ClosedResourceError when there is none and the agent is closed."""
        if self._items:
            return self._items.popleft()
        if self._closed:
            raise ClosedResourceError("the agent is closed: no more notifications")
        raise asyncio.QueueEmpty

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
        return self._items.popleft()

    def __aiter__(self) -> Notifications:
        return self

    async def __anext__(self) -> Notification:
        try:
            return await self.receive()
        except ClosedResourceError:
            raise StopAsyncIteration from None

    # -------------------------------------------------------------- agent side

    def _put(self, item: Notification) -> None:
        self._items.append(item)
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

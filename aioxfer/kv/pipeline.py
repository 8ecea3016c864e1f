"""Pipeline building blocks: stages connected by bounded channels.

A stage is a coroutine that receives from one channel and sends to the next.
Channels are bounded, so a slow stage holds back the ones before it
(backpressure, never an unbounded queue); cancellation and errors propagate
both ways: a failing or cancelled stage cancels every other stage of its
pipeline, and the pipeline re-raises the first error.

```python
async with kv.Pipeline(maxsize=2) as p:
    computed = p.source(compute_layers())            # an async iterable
    sent = p.map(send_layer, computed)               # one coroutine call per item
    p.sink(record, sent)                             # consumes the rest
# leaving the block waits for every stage; the first error is raised
```
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from aioxfer.errors import ClosedResourceError

__all__ = ["Channel", "Pipeline"]

T = TypeVar("T")
U = TypeVar("U")


class Channel(Generic[T]):
    """A bounded FIFO between two stages. ``send`` waits while it is full;
    ``close()`` (by the sender) ends the receivers' iteration once drained;
    ``aclose()`` by a receiver makes pending and later sends raise
    ClosedResourceError (the consumer is gone: stop producing)."""

    def __init__(self, maxsize: int = 1) -> None:
        if maxsize < 1:
            raise ValueError("a channel holds at least one item")
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._closed = False  # no more sends
        self._broken = False  # no more receives
        self._readers: deque[asyncio.Future[None]] = deque()
        self._writers: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _wake(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    @staticmethod
    def _wake_all(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)

    async def send(self, item: T) -> None:
        while True:
            if self._broken:
                raise ClosedResourceError("the channel's receiver is gone")
            if self._closed:
                raise ClosedResourceError("the channel was closed for sending")
            if len(self._items) < self.maxsize:
                self._items.append(item)
                self._wake(self._readers)
                return
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._writers.append(w)
            try:
                await w
            except BaseException:
                if w.done() and not w.cancelled():
                    # Woken (room was made) and cancelled before it ran: the
                    # wake-up goes to the next sender, or it would wait on
                    # with room in the channel (a stalled pipeline).
                    self._wake(self._writers)
                w.cancel()
                raise

    async def receive(self) -> T:
        """The next item; raises StopAsyncIteration once closed and drained."""
        while True:
            if self._items:
                item = self._items.popleft()
                self._wake(self._writers)
                return item
            if self._closed or self._broken:
                raise StopAsyncIteration
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._readers.append(w)
            try:
                await w
            except BaseException:
                if w.done() and not w.cancelled():
                    self._wake(self._readers)  # woken, then cancelled: pass it on
                w.cancel()
                raise

    def close(self) -> None:
        """No more items will be sent."""
        self._closed = True
        self._wake_all(self._readers)

    def aclose_nowait(self) -> None:
        """The receiver stops: senders fail from now on, queued items are dropped."""
        self._broken = True
        self._items.clear()
        self._wake_all(self._writers)
        self._wake_all(self._readers)

    async def aclose(self) -> None:
        self.aclose_nowait()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self.receive()


class Pipeline:
    """Stages run as tasks of one group; see the module doc."""

    def __init__(self, maxsize: int = 2) -> None:
        self.maxsize = maxsize
        self._group: asyncio.TaskGroup | None = None
        self._channels: list[Channel[Any]] = []

    async def __aenter__(self) -> Pipeline:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> bool | None:
        assert self._group is not None
        try:
            await self._group.__aexit__(et, exc, tb)
            return None
        except BaseExceptionGroup as eg:
            # One stage failed, the others were cancelled because of it: the
            # error that started it is what the caller wants to see.
            first = eg.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from eg
        finally:
            for ch in self._channels:
                ch.aclose_nowait()

    def channel(self, maxsize: int | None = None) -> Channel[Any]:
        ch: Channel[Any] = Channel(maxsize or self.maxsize)
        self._channels.append(ch)
        return ch

    def _start(self, coro: Awaitable[Any], name: str) -> None:
        if self._group is None:
            raise RuntimeError("use the pipeline inside `async with`")
        self._group.create_task(coro, name=name)  # type: ignore[arg-type]

    def source(self, items: AsyncIterable[T], maxsize: int | None = None) -> Channel[T]:
        """A stage that sends everything ``items`` yields, then closes."""
        out: Channel[T] = self.channel(maxsize)

        async def run() -> None:
            try:
                async for item in items:
                    await out.send(item)
            except ClosedResourceError:
                # Downstream stopped receiving: stop producing. The source's
                # own ClosedResourceError (something it uses was closed) is an
                # error, not an end: the consumer would see a truncated stream.
                if not out._broken:
                    raise
            finally:
                out.close()
                aclose = getattr(items, "aclose", None)
                if aclose is not None:
                    await aclose()

        self._start(run(), "pipeline-source")
        return out

    def map(self, fn: Callable[[T], Awaitable[U]], inbox: Channel[T],
            maxsize: int | None = None) -> Channel[U]:
        """A stage that sends ``await fn(item)`` for each item received."""
        out: Channel[U] = self.channel(maxsize)

        async def run() -> None:
            try:
                async for item in inbox:
                    await out.send(await fn(item))
            except ClosedResourceError:
                if not out._broken:
                    raise
                inbox.aclose_nowait()  # downstream stopped: so do we, and upstream
            finally:
                out.close()

        self._start(run(), f"pipeline-map-{getattr(fn, '__name__', 'fn')}")
        return out

    def sink(self, fn: Callable[[T], Awaitable[Any]], inbox: Channel[T]) -> None:
        """A final stage that awaits ``fn(item)`` for each item."""

        async def run() -> None:
            try:
                async for item in inbox:
                    await fn(item)
            finally:
                inbox.aclose_nowait()

        self._start(run(), f"pipeline-sink-{getattr(fn, '__name__', 'fn')}")

"""LayerStream leftovers of kv18b.

1. ``async for`` over ``store.stream`` left by ``break`` (no aclose, no
   ``async with``): the stream, dropped at the break, cancelled the layers
   it had posted in its ``__del__``, and a cancelled Transfer resolves at
   once while the engine may still write its destination: the caller's code
   after the loop saw ``dst`` change under it. Broken right after layer 0,
   the loop callback that posts the window still held the stream: the
   window was posted after the loop had ended, then cancelled. Now the
   window callback holds the stream weakly, and a stream dropped unclosed
   on its loop's thread waits (synchronously: a ``__del__`` cannot await)
   for the copies it posted before it lets go of them.
2. An exception midway in ``LayerStream._post`` (one dst region's post
   failed after another's was posted) cancelled what it had posted and
   raised: the stream's close waited only for whole layers, so the posted
   part kept landing after the exception reached the caller. It is waited
   for now, as a cancellation's is.

The copies are real and slow enough to be caught in flight: as in
test_kv18b_stream_cancel, the agent reaches its own host tier over loopback
TCP only, with layers of 16 MiB per transfer."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import STREAM_BB as BB
from conftest import STREAM_LAYERS as LAYERS
from conftest import STREAM_N as N
from conftest import STREAM_TRIALS as TRIALS
from conftest import copy_started, engine_settled, kv_stream_store, within

LB = BB // LAYERS
MakeAgent = Callable[..., Awaitable[Any]]


async def _setup(make_agent: MakeAgent, tag: str,
                 transports: tuple[str, ...] = ("tcp",)) -> tuple[Any, Any, list[bytes]]:
    return await kv_stream_store(make_agent, "kv19", tag, 191, transports=transports)


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")])
@pytest.mark.parametrize("after", [0, 1])
async def test_break_out_of_async_for_leaves_nothing_landing_in_dst(
        make_agent: MakeAgent, after: int, transports: tuple[str, ...]) -> None:
    """``break`` after layer ``after`` (1: once layer 2's copy is running);
    what dst holds right after the loop is what it holds for good. Before,
    after layer 0: 33 MB changed after the loop in 6 of 6 trials over tcp,
    5 of 6 over shared memory (the usual path: the window was posted after
    the loop); after layer 1 over tcp: up to 3 MB in 2-4 of 6 (over shared
    memory the cancelled copies had ended by then: 0)."""
    agent, store, keys = await _setup(make_agent, f"kv19-break-{after}", transports)
    dst = agent.alloc(N * BB)
    try:
        changed = []
        for _ in range(TRIALS):
            view = dst.numpy()
            view[:] = 0xA5
            got = -1
            async for layer in store.stream(keys, dst[0:N * BB], layers=LAYERS):
                got = layer.layer
                if got == after:
                    if after:
                        await copy_started(view, (after + 1) * LB)
                    break
            assert got == after
            snap = view.copy()  # what the code after the loop sees
            await engine_settled(agent)
            changed.append(int((view != snap).sum()))
        assert changed == [0] * TRIALS, f"bytes of dst changed after the break: {changed}"
        # The pins went with the stream: every block is still readable and
        # removable (nothing left pinned).
        assert store._host is not None and store._host.pinned == 0
    finally:
        await within(store.aclose())


async def test_stream_dropped_by_the_garbage_collector_still_lets_go(
        make_agent: MakeAgent) -> None:
    """A stream in a reference cycle is dropped by the collector, at an
    allocation anywhere (even inside the agent's completion drain): it
    cannot drain there, so it cancels what it posted as before and its pins
    still go (no leak, no error)."""
    agent, store, keys = await _setup(make_agent, "kv19-gc")
    dst = agent.alloc(N * BB)
    try:
        stream = store.stream(keys, dst[0:N * BB], layers=LAYERS)
        first = await within(stream.__anext__())
        assert first.layer == 0
        await asyncio.sleep(0)  # (the window posted)
        stream.cycle = stream  # type: ignore[attr-defined]
        del stream
        gc.collect()
        await engine_settled(agent)
        assert store._host is not None and store._host.pinned == 0
        out = agent.alloc(N * BB)
        assert (await within(store.get(keys, out[0:N * BB]))).prefix == N
    finally:
        await within(store.aclose())


async def test_a_failed_post_midway_waits_for_what_it_posted(make_agent: MakeAgent) -> None:
    """dst in two regions; the second is deregistered after layer 0: each
    later layer's post posts into the first region, then fails on the
    second. The error reaches the caller once nothing the stream posted
    writes dst (before: the first region's part was cancelled and kept
    landing after the error)."""
    agent, store, keys = await _setup(make_agent, "kv19-post")
    half = N // 2
    try:
        changed = []
        for _ in range(TRIALS):
            a = agent.alloc(half * BB)
            b = agent.alloc(half * BB)
            view = a.numpy()
            view[:] = 0xA5
            dst = [a[i * BB:(i + 1) * BB] for i in range(half)] + \
                  [b[i * BB:(i + 1) * BB] for i in range(half)]
            stream = store.stream(keys, dst, layers=LAYERS)
            first = await within(stream.__anext__())
            assert first.layer == 0
            await within(agent.deregister(b))
            with pytest.raises(Exception) as err:
                await within(stream.__anext__())
            assert not isinstance(err.value, AssertionError), err.value
            snap = view.copy()  # what the caller sees when the error reaches it
            await engine_settled(agent)
            changed.append(int((view != snap).sum()))
            assert store._host is not None and store._host.pinned == 0
            await within(agent.deregister(a))
        assert changed == [0] * TRIALS, f"bytes of dst changed after the error: {changed}"
    finally:
        await within(store.aclose())

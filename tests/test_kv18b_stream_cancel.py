"""A LayerStream closed (aclose, ``async with``) or cancelled mid-way
returned at once while the layers it had posted into ``dst`` could still
land: it cancelled them, and a cancelled Transfer resolves at once while the
engine may still write its destination. The caller, told the stream was
over, reused ``dst`` and saw it change under it. A stream now waits for what
it posted into ``dst`` (kv.tier.landed) before its close or cancellation
returns.

The copies are real and slow enough to be caught in flight: the agent
reaches its own host tier over loopback TCP only (no shared-memory path),
with layers of 16 MiB per transfer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from conftest import STREAM_BB as BB
from conftest import STREAM_LAYERS as LAYERS
from conftest import STREAM_N as N
from conftest import STREAM_TRIALS as TRIALS
from conftest import copy_started, engine_settled, kv_stream_store, within

LB = BB // LAYERS
# (Before the fix a trial caught bytes landing after the close in about
# half the runs: 1-2 MiB each, one transfer's chunks in progress.)
MakeAgent = Callable[..., Awaitable[Any]]


async def _setup(make_agent: MakeAgent, tag: str) -> tuple[Any, Any, list[bytes], Any]:
    agent, store, keys = await kv_stream_store(make_agent, "kv18b", tag, 181)
    return agent, store, keys, agent.alloc(N * BB)


@pytest.mark.parametrize("how", ["aclose", "aexit"])
async def test_closed_stream_returns_only_once_dst_is_no_longer_written(
        make_agent: MakeAgent, how: str) -> None:
    """Layer 0 handed out, the window's layers in flight: the stream is
    closed while a later layer is being copied. What dst holds when the
    close returns is what it holds for good (before: the close cancelled
    the copies and returned; their bytes kept landing)."""
    agent, store, keys, dst = await _setup(make_agent, f"kv18b-{how}")
    try:
        changed = []
        for _ in range(TRIALS):
            view = dst.numpy()
            view[:] = 0xA5
            stream = store.stream(keys, dst[0:N * BB], layers=LAYERS)
            if how == "aclose":
                first = await within(stream.__anext__())
                assert first.layer == 0
                await copy_started(view, LB)
                await stream.aclose()
            else:
                async with stream:
                    first = await within(stream.__anext__())
                    assert first.layer == 0
                    await copy_started(view, LB)
            snap = view.copy()
            await engine_settled(agent)
            changed.append(int((view != snap).sum()))
        assert changed == [0] * TRIALS, f"bytes of dst changed after the close: {changed}"
    finally:
        await within(store.aclose())


async def test_cancelled_stream_returns_only_once_dst_is_no_longer_written(
        make_agent: MakeAgent) -> None:
    """The task iterating the stream is cancelled while it awaits layer 1
    (its copy running, layer 2 in flight too): its CancelledError arrives
    once nothing it posted writes dst (before: the await cancelled the
    layer's transfer and the stream cancelled the rest; they kept landing)."""
    agent, store, keys, dst = await _setup(make_agent, "kv18b-cancel")
    try:
        changed = []
        for _ in range(TRIALS):
            view = dst.numpy()
            view[:] = 0xA5
            snap: list[np.ndarray] = []
            started = asyncio.Event()

            async def reader(view: np.ndarray, snap: list[np.ndarray],
                             started: asyncio.Event) -> None:
                try:
                    async for layer in store.stream(keys, dst[0:N * BB], layers=LAYERS):
                        if layer.layer == 0:
                            started.set()
                except asyncio.CancelledError:
                    snap.append(view.copy())  # what the caller sees, then
                    raise

            task = asyncio.ensure_future(reader(view, snap, started))
            await within(started.wait())
            await copy_started(view, LB)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await within(task, 30)
            assert snap, "the reader did not see its cancellation"
            await engine_settled(agent)
            changed.append(int((view != snap[0]).sum()))
        assert changed == [0] * TRIALS, f"bytes of dst changed after the cancellation: {changed}"
    finally:
        await within(store.aclose())

"""Every public Store coroutine (put, get, lookup, prefetch, remove, a
stream's steps) cancelled after N loop steps, N = 1..k, on a host + disk
store (real directory, blocks on both tiers). After each cancel, once the
engine is idle: no pins left, no fetch registered, no task of the store's
left running, and the store still serves (a get of every block returns it
right). At the end the close leaves nothing running, and the loop's
exception handler was never called (make_agent checks: no "exception never
retrieved", no "Task was destroyed but it is pending")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import cancel_after, engine_settled, pattern, within

from aioxfer import kv

MakeAgent = Callable[..., Awaitable[Any]]
BB = 256 << 10
N = 16
STEPS = 12


async def stream_all(store: Any, keys: list[bytes], dst: Any) -> None:
    async with store.stream(keys, dst, layers=4) as s:
        async for _layer in s:
            pass


async def test_cancel_every_operation_at_every_step(make_agent: MakeAgent,
                                                    tmp_path: Path) -> None:
    agent = await make_agent("kv22-sweep", inline_bytes=0)
    data = pattern(2 * N * BB, 25)
    src = agent.alloc(2 * N * BB)
    src.numpy()[:] = data
    dst = agent.alloc(2 * N * BB)
    keys = kv.chain(np.arange(16 * 2 * N), block_tokens=16, namespace=b"kv22w")
    host = kv.HostTier(N * BB, high_watermark=0.9, low_watermark=0.5)
    store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[
        host, kv.DiskTier(tmp_path / "d", 8 * N * BB, segment_bytes=4 * N * BB)]))
    base = asyncio.all_tasks()
    ops: dict[str, Callable[[], Awaitable[Any]]] = {
        "put": lambda: store.put(keys, src[0:2 * N * BB]),
        "get": lambda: store.get(keys, dst[0:2 * N * BB]),
        "lookup": lambda: store.lookup(keys),
        "prefetch": lambda: store.prefetch(keys[N:]),
        "remove+put": lambda: store.remove(keys[:4]),
        "stream": lambda: stream_all(store, keys[:N], dst[0:N * BB]),
    }
    for name, call in ops.items():
        for steps in range(1, STEPS + 1):
            await cancel_after(call(), steps)
            await engine_settled(agent)
            await asyncio.sleep(0)
            st = store.statistics()
            what = (name, steps)
            assert st.pins == 0 and st.pinned_bytes == 0, (what, st.pins)
            assert st.fetches_in_flight == 0, what
            left = [t for t in asyncio.all_tasks() - base
                    if not t.done() and "demote" not in t.get_name()]
            assert not left, (what, left)
            # Still serves: whatever the cancel cut, put again and read back.
            put = await within(store.put(keys, src[0:2 * N * BB]))
            assert put.dropped == 0, (what, put)
            dst.numpy()[:] = 0
            got = await within(store.get(keys, dst[0:2 * N * BB]))
            assert got.prefix == 2 * N, (what, got)
            assert np.array_equal(dst.numpy(), data), what
    await within(store.aclose())
    left = [t for t in asyncio.all_tasks() - base if not t.done()]
    assert not left, left

"""A cancelled Store.aclose, and streams open across a close.

- A cancel landing while the close stops the host tier's demoter reaches
  the caller (before, kv22: HostTier._stop_demoter suppressed
  CancelledError, and the cancelled aclose returned normally).
- Cancelled at any step (puts in flight into a real disk directory), the
  close still ends before CancelledError is raised: the store is closed,
  nothing of it runs on, its regions are released and the segment files'
  fds closed; a second aclose has nothing left to do (before: the store
  refused every call but was not closed until a second aclose).
- A LayerStream open across the close: the close waits for its copies in
  flight and ends it; its next step raises ClosedResourceError (before:
  the later layers failed as BlockUnavailable "access denied", a posted
  layer's failure never retrieved over tcp)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, wait_until, within

from aioxfer import kv
from aioxfer.errors import ClosedResourceError

MakeAgent = Callable[..., Awaitable[Any]]


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_cancel_while_the_demoter_stops_reaches_the_caller(make_agent: MakeAgent,
                                                                 tmp_path: Path) -> None:
    agent = await make_agent("kv22-demoter")
    bb, n = 4 << 20, 16
    src = agent.alloc(n * bb)
    src.numpy()[:] = pattern(n * bb, 22)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv22d")
    hits = 0
    for rnd in range(6):
        host = kv.HostTier(n * bb, high_watermark=0.3, low_watermark=0.1)
        store = await within(kv.Store.open(agent, block_bytes=bb, tiers=[
            host, kv.DiskTier(tmp_path / f"d{rnd}", 4 * n * bb, segment_bytes=n * bb)]))
        before = asyncio.all_tasks()
        await within(store.put(keys, src[0:n * bb]))
        demoter = host._demoter
        assert demoter is not None and not demoter.done(), "no write-back running"
        closing = asyncio.ensure_future(store.aclose(flush=False))
        # Until the close has asked the demoter to stop and waits for it.
        for _ in range(200):
            if demoter.cancelling() or demoter.done():
                break
            await asyncio.sleep(0)
        if demoter.done():
            await within(closing)
            continue  # it ended before the cancel could land there
        hits += 1
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(closing)
        assert store.closed  # and the close went on to its end
        assert host._demoter is None and demoter.done()
        left = [t for t in asyncio.all_tasks() - before if not t.done()]
        assert not left, left
    assert hits, "the cancel never landed while the demoter stopped"


@pytest.mark.parametrize("host", [False, True], ids=["disk", "host+disk"])
async def test_cancelled_close_leaves_the_store_closed(make_agent: MakeAgent, tmp_path: Path,
                                                       host: bool) -> None:
    agent = await make_agent("kv22-cclose")
    bb, per, puts = 64 << 10, 4, 8
    src = agent.alloc(puts * per * bb)
    src.numpy()[:] = pattern(puts * per * bb, 23)
    # A first store warms the agent up (its file transport's ring and
    # threads, the loopback connection: the agent's, kept until it closes).
    async with kv.Store.open(agent, block_bytes=bb, tiers=[
            kv.DiskTier(tmp_path / "warm", 256 * bb, segment_bytes=8 * bb)]) as warm:
        await within(warm.put(kv.chain(np.arange(16 * per), block_tokens=16, namespace=b"w"),
                              src[0:per * bb], durable=True))
    # The warm store's last region may still be registered right after its
    # close (released soon after: kv24 saw it in 7 of 45 runs beside 3 CPU
    # hogs, and this baseline then was never reached): the count the
    # cancelled closes must return to is the one that stopped changing.
    regions0, stable = agent.statistics().native_regions, 0
    for _ in range(40):
        await asyncio.sleep(0.05)
        now = agent.statistics().native_regions
        stable, regions0 = (stable + 1, now) if now == regions0 else (0, now)
        if stable >= 4:
            break
    fds0 = fds()
    outcomes = set()
    for steps in range(1, 41, 2):  # (at 0 the task is cancelled before aclose begins)
        tiers: list[kv.Tier] = [kv.HostTier(8 * bb)] if host else []
        tiers.append(kv.DiskTier(tmp_path / f"s{steps}", 256 * bb, segment_bytes=8 * bb))
        store = await within(kv.Store.open(agent, block_bytes=bb, tiers=tiers))
        before = asyncio.all_tasks()
        ops = [asyncio.ensure_future(store.put(
            kv.chain(np.arange(16 * per) + 10**5 * (steps * puts + i), block_tokens=16,
                     namespace=b"kv22c"),
            src[i * per * bb:(i + 1) * per * bb], durable=i % 3 == 0)) for i in range(puts)]
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(store.aclose())
        for _ in range(steps):
            await asyncio.sleep(0)
        closing.cancel()
        try:
            await within(closing)
            outcomes.add("finished")
        except asyncio.CancelledError:
            outcomes.add("cancelled")
        # Closed when the cancel reached us: not refusing-but-open.
        assert store.closed, steps
        await within(store.aclose())  # nothing left to do
        for r in await within(asyncio.gather(*ops, return_exceptions=True)):
            assert isinstance(r, kv.PutResult | ClosedResourceError), (steps, r)
        left = [t for t in asyncio.all_tasks() - before if t not in ops and not t.done()]
        assert not left, (steps, left)
        # (Once, host+disk after a cancel at step 23, a region was still
        # pinned by the engine right after the close, released soon after:
        # not reproduced in 3 more runs; waited for here, bounded.)
        await within(wait_until(lambda: agent.statistics().native_regions == regions0,
                                seconds=2, what="the store's regions released"))
        assert fds() == fds0, (steps, fds() - fds0)
    assert "cancelled" in outcomes, outcomes


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_stream_open_across_close_is_ended(make_agent: MakeAgent, transport: str) -> None:
    agent = await make_agent(f"kv22-stream-{transport}", transports=(transport,),
                             inline_bytes=0)
    bb, n, layers = 1 << 20, 16, 8
    data = pattern(n * bb, 24)
    src = agent.alloc(n * bb)
    src.numpy()[:] = data
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv22t")
    store = await within(kv.Store.open(agent, block_bytes=bb, tiers=[kv.HostTier(n * bb)]))
    assert (await within(store.put(keys, src[0:n * bb]))).stored == n
    dst = agent.alloc(n * bb)
    dst.numpy()[:] = 0
    stream = store.stream(keys, dst[0:n * bb], layers=layers)
    got: list[int] = [(await within(stream.__anext__())).layer]
    await asyncio.sleep(0)  # the window is posted
    closing = asyncio.ensure_future(store.aclose())
    with pytest.raises(ClosedResourceError):
        while True:
            got.append((await within(stream.__anext__())).layer)
    await within(closing)
    assert got == list(range(len(got))) and len(got) < layers, got
    assert store.statistics().pins == 0
    lb = bb // layers
    view, want = dst.numpy().reshape(n, bb), data.reshape(n, bb)
    for layer in got:  # what was handed out is right
        assert np.array_equal(view[:, layer * lb:(layer + 1) * lb],
                              want[:, layer * lb:(layer + 1) * lb]), layer
    with pytest.raises(ClosedResourceError):
        await within(stream.__anext__())

"""Store.aclose with operations in flight: many concurrent puts into a disk
tier (with and without a host tier in front), the store closed midway, over
many rounds on a real directory. Every put either completes (what it says
it stored is on disk, found again by a store reopened on the directory) or
is refused with ClosedResourceError; nothing runs on after the close (no
task, no header flusher, no loop exception-handler call).

Before, the close ran under the puts: the tiers closed while puts (and the
host tier's write-back, stopped only when the host tier itself closed,
after the disk tier) still wrote into them, and a disk put's header flusher
started after the disk tier had closed failed with ClosedResourceError
(its headers lost)."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.errors import ClosedResourceError

BB = 16 << 10
PUTS = 24
PER_PUT = 4
MakeAgent = Callable[..., Awaitable[Any]]


def keys_of(rnd: int, i: int) -> list[bytes]:
    base = 16 * PER_PUT * (rnd * PUTS + i)
    return kv.chain(np.arange(base, base + 16 * PER_PUT), block_tokens=16, namespace=b"kv20c")


def warnings_in(err: str) -> list[str]:
    """aioxfer's warning and error events in captured stderr."""
    return [ln for ln in err.splitlines() if re.search(r"\[(warning|error)", ln)]


@pytest.mark.parametrize("host", [False, True], ids=["disk", "host+disk"])
async def test_close_waits_for_the_puts_in_flight(make_agent: MakeAgent, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 host: bool) -> None:
    agent = await make_agent("kv20-close")
    src = agent.alloc(PUTS * PER_PUT * BB)
    data = pattern(PUTS * PER_PUT * BB, 5)
    src.numpy()[:] = data
    rng = random.Random(20)
    for rnd in range(12):
        path = tmp_path / f"kv{rnd}"
        tiers: list[kv.Tier] = [kv.HostTier(8 * BB)] if host else []
        tiers.append(kv.DiskTier(path, 256 * BB, segment_bytes=8 * BB))
        store = await within(kv.Store.open(agent, block_bytes=BB, tiers=tiers))
        before = asyncio.all_tasks()
        puts = [asyncio.ensure_future(store.put(
            keys_of(rnd, i), src[i * PER_PUT * BB:(i + 1) * PER_PUT * BB],
            durable=rng.random() < 0.3)) for i in range(PUTS)]
        for _ in range(rng.randrange(0, 30)):
            await asyncio.sleep(0)
        await within(store.aclose())
        left = [t for t in asyncio.all_tasks() - before if t not in puts and not t.done()]
        assert not left, (rnd, left)  # nothing of the store's runs on
        results = await within(asyncio.gather(*puts, return_exceptions=True))
        stored: list[int] = []
        for i, r in enumerate(results):
            if isinstance(r, ClosedResourceError):
                continue  # refused: called after the close began
            assert isinstance(r, kv.PutResult), (rnd, i, r)
            if r.stored == PER_PUT:
                stored.append(i)
        await asyncio.sleep(0.02)
        bad = warnings_in(capsys.readouterr().err)
        assert not bad, (rnd, bad)
        # What the puts reported stored survived the close: all of it on
        # disk (the host tier's blocks written back by the close's flush).
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.DiskTier(path, 256 * BB, segment_bytes=8 * BB)]) as again:
            dst = agent.alloc(PER_PUT * BB)
            for i in stored:
                got = await within(again.get(keys_of(rnd, i), dst[0:PER_PUT * BB]))
                assert got.prefix == PER_PUT, (rnd, i, got)
                assert np.array_equal(dst.numpy(),
                                      data[i * PER_PUT * BB:(i + 1) * PER_PUT * BB])


async def test_operations_after_close_began_are_refused(make_agent: MakeAgent,
                                                        tmp_path: Path) -> None:
    """While the close waits for a put in flight, a new put, get, lookup,
    prefetch and remove are refused (ClosedResourceError) and the put in
    flight completes."""
    agent = await make_agent("kv20-refuse")
    src = agent.alloc(PER_PUT * BB)
    src.numpy()[:] = pattern(PER_PUT * BB, 6)
    disk = kv.DiskTier(tmp_path / "kv", 256 * BB, segment_bytes=8 * BB)
    store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[disk]))
    keys = keys_of(0, 0)
    put = asyncio.ensure_future(store.put(keys, src[0:PER_PUT * BB], durable=True))
    await asyncio.sleep(0)  # the put is under way (its durable flush to come)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0)
    for call in (store.put(keys_of(0, 1), src[0:PER_PUT * BB]),
                 store.get(keys, src[0:PER_PUT * BB]), store.lookup(keys),
                 store.prefetch(keys), store.remove(keys)):
        with pytest.raises(ClosedResourceError):
            await within(call)
    res = await within(put)
    assert res.stored == PER_PUT and res.durable == PER_PUT, res
    await within(closing)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.DiskTier(tmp_path / "kv", 256 * BB, segment_bytes=8 * BB)]) as again:
        assert (await within(again.lookup(keys))).prefix == PER_PUT

"""aioxfer.kv: coalesced gets under cancellation, on real agents and real
segment files. The order of events is forced with a gate on the disk tier's
read (the read itself is the real one), never with sleeps or timings.

Regression: a follower whose copy was in flight out of a handed-over fetch
was left waiting forever when another follower, the last one still listed,
cancelled: the fetch was cancelled under the delivery (found by the 1 M
operation soak, where it hung)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.errors import XferError
from aioxfer.region import Region

BB = 256 << 10  # large enough that copying a delivery out spans many loop turns
N = 32  # blocks per get

MakeAgent = Callable[..., Awaitable[Any]]


class GatedDisk(kv.DiskTier):
    """A DiskTier whose reads wait for ``gate`` before the real read (or
    fail, when ``fail`` is set)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 4 * N * BB, segment_bytes=2 * N * BB)
        self.gate = asyncio.Event()
        self.started = 0
        self.fail = False

    async def _read(self, locs: list[Any], regions: list[Region],
                    offsets: list[int]) -> list[XferError | None]:
        self.started += 1
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("injected: the disk read failed as a whole")
        return await super()._read(locs, regions, offsets)


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"test-cancel")


async def turns_until(pred: Callable[[], bool], limit: int = 100_000) -> bool:
    """Lets the loop turn (no sleeping) until ``pred()``; False if never."""
    for _ in range(limit):
        if pred():
            return True
        await asyncio.sleep(0)
    return pred()


def assert_quiet(store: kv.Store) -> None:
    s = store.statistics()
    assert (s.pins, s.pinned_bytes, s.fetches_in_flight) == (0, 0, 0), s
    staging = store._staging
    assert staging is not None
    # every staging slot is back, once
    assert sorted(staging.free) == list(range(store._staging_blocks)), staging.free


async def quiesce(store: kv.Store) -> None:
    while True:
        s = store.statistics()
        if not (s.pins or s.pinned_bytes or s.fetches_in_flight):
            return
        await asyncio.sleep(0.005)


@pytest.fixture
async def gated(make_agent: MakeAgent, tmp_path: Path) -> Any:
    """A store over a GatedDisk holding N + 1 blocks; operations may pin N."""
    agent = await make_agent("kv")
    disk = GatedDisk(tmp_path / "kv")
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk], staging_blocks=N,
                                max_pinned_bytes=N * BB, pin_wait=60.0)
    src = agent.alloc((N + 1) * BB)
    data = pattern((N + 1) * BB, 11)
    src.numpy()[:] = data
    keys = keys_for(N + 1)
    disk.gate.set()
    assert (await store.put(keys, src[0:(N + 1) * BB], durable=True)).durable == N + 1
    disk.gate.clear()
    yield agent, store, disk, keys[:N], data[:N * BB], keys[N]
    disk.gate.set()
    await store.aclose()


async def test_follower_in_a_delivery_survives_the_last_listed_follower_leaving(
        gated: Any) -> None:
    agent, store, disk, keys, data, extra = gated
    d_lead, d_a, d_b = (agent.alloc((N + 1) * BB) for _ in range(3))
    leader = asyncio.ensure_future(store.get(keys, d_lead[0:N * BB]))
    assert await turns_until(lambda: disk.started == 1)
    a = asyncio.ensure_future(store.get(keys, d_a[0:N * BB]))
    # b follows the same N fetches and leads one more block: over the pin
    # cap, so it waits for pin space with its followers attached.
    b = asyncio.ensure_future(store.get(keys + [extra], d_b[0:(N + 1) * BB]))
    fetches = [store._fetches[k] for k in keys]
    assert await turns_until(lambda: all(len(f.followers) == 2 for f in fetches)
                             and store.statistics().pin_waits == 1)
    leader.cancel()  # the fetch is handed over to a refetch into staging
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert await turns_until(lambda: disk.started == 2)
    disk.gate.set()
    # The refetch has read and is copying out to a and b: they are off the
    # followers lists, in its delivery.
    in_delivery = await turns_until(
        lambda: all(not f.followers for f in fetches) and not a.done() and not b.done())
    assert in_delivery
    # b gives up its pin wait: it leaves the fetches it followed, the last
    # follower still listed anywhere; that must not cancel the delivery.
    b.cancel()
    res = await within(a)
    with pytest.raises(asyncio.CancelledError):
        await b
    assert res.prefix == N and res.failed == () and res.coalesced == N
    assert np.array_equal(d_a.numpy()[:N * BB], data)
    await within(quiesce(store))
    assert_quiet(store)
    assert store.statistics().handoffs == N


async def test_last_waiter_cancelling_a_handed_over_read_cancels_it(gated: Any) -> None:
    agent, store, disk, keys, data, _extra = gated
    d_lead, d_a = (agent.alloc(N * BB) for _ in range(2))
    leader = asyncio.ensure_future(store.get(keys, d_lead[0:N * BB]))
    assert await turns_until(lambda: disk.started == 1)
    a = asyncio.ensure_future(store.get(keys, d_a[0:N * BB]))
    fetches = list(store._fetches.values())
    assert await turns_until(lambda: all(len(f.followers) == 1 for f in fetches))
    leader.cancel()
    assert await turns_until(lambda: disk.started == 2)  # the refetch waits at the gate
    a.cancel()  # the last waiter: the refetch goes, its staging comes back once
    for t in (leader, a):
        with pytest.raises(asyncio.CancelledError):
            await t
    assert store.statistics().fetches_in_flight == 0  # at once: no new get attaches to it
    disk.gate.set()
    await within(quiesce(store))
    assert_quiet(store)
    # The store still serves the blocks, whole.
    dst = agent.alloc(N * BB)
    res = await within(store.get(keys, dst[0:N * BB]))
    assert res.prefix == N and np.array_equal(dst.numpy(), data)
    assert_quiet(store)


async def test_followers_hear_a_failed_leader(gated: Any) -> None:
    agent, store, disk, keys, data, _extra = gated
    d_lead, d_a, d_b = (agent.alloc(N * BB) for _ in range(3))
    leader = asyncio.ensure_future(store.get(keys, d_lead[0:N * BB]))
    assert await turns_until(lambda: disk.started == 1)
    followers = [asyncio.ensure_future(store.get(keys, d[0:N * BB])) for d in (d_a, d_b)]
    fetches = list(store._fetches.values())
    assert await turns_until(lambda: all(len(f.followers) == 2 for f in fetches))
    disk.fail = True
    disk.gate.set()
    results = await within(asyncio.gather(leader, *followers))
    for r in results:
        assert r.prefix == 0 and len(r.failed) == N  # every block, typed
        assert isinstance(r.failed[0].error, kv.BlockUnavailable)
    await within(quiesce(store))
    assert_quiet(store)
    disk.fail = False
    res = await within(store.get(keys, d_a[0:N * BB]))
    assert res.prefix == N and np.array_equal(d_a.numpy(), data)


async def test_cancelled_durable_puts_leave_no_torn_header(make_agent: MakeAgent,
                                                           tmp_path: Path) -> None:
    """Durable puts cancelled at every point of their header flush, with other
    puts' flushes right behind them (one staging buffer for header sectors):
    after reopening, every block found reads back whole, none is corrupt."""
    bb = 4096
    agent = await make_agent("kv")
    n = 96
    src = agent.alloc(n * bb)
    data = pattern(n * bb, 12)
    src.numpy()[:] = data
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"test-torn")
    tiers = [kv.DiskTier(tmp_path / "kv", 1 << 24, segment_bytes=128 * bb)]
    async with kv.Store.open(agent, block_bytes=bb, tiers=tiers) as store:
        for i in range(0, n, 2):
            # two puts at once (each flushes its own header sector after its
            # data), the first cancelled after i % 7 loop turns
            p1 = asyncio.ensure_future(store.put(keys[i:i + 1], src[i * bb:(i + 1) * bb],
                                                 durable=True))
            p2 = asyncio.ensure_future(store.put(keys[i + 1:i + 2],
                                                 src[(i + 1) * bb:(i + 2) * bb], durable=True))
            for _ in range(i % 7):
                await asyncio.sleep(0)
            p1.cancel()
            await asyncio.gather(p1, p2, return_exceptions=True)
    tiers = [kv.DiskTier(tmp_path / "kv", 1 << 24, segment_bytes=128 * bb)]
    async with kv.Store.open(agent, block_bytes=bb, tiers=tiers) as store:
        hit = await store.lookup(keys)
        found = [i for i, t in enumerate(hit.tiers) if t is not None]
        assert len(found) >= n // 2  # every second put was never cancelled
        dst = agent.alloc(bb)
        for i in found:
            res = await within(store.get(keys[i:i + 1], dst[0:bb]))
            assert res.failed == () and res.prefix == 1, (i, res.failed)
            assert np.array_equal(dst.numpy(), data[i * bb:(i + 1) * bb]), i
        assert store.statistics().quarantined == 0


async def test_coalesced_copies_come_from_the_promoted_block(make_agent: MakeAgent,
                                                             tmp_path: Path) -> None:
    """Followers of a fetch that was promoted copy from the host tier's slot,
    not from the leader's memory: a caller's region is never imported through
    the store's loopback peer (each import maps it again; imports of retired
    caller buffers kept RSS climbing through the soak)."""
    agent = await make_agent("kv")
    n = 8
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 13)
    src.numpy()[:] = data
    keys = keys_for(n)
    tiers = [kv.HostTier(4 * n * BB), kv.DiskTier(tmp_path / "kv", 1 << 28,
                                                 segment_bytes=2 * n * BB)]
    async with kv.Store.open(agent, block_bytes=BB, tiers=tiers) as store:
        assert (await store.put(keys, src[0:n * BB], durable=True)).durable == n
        host = store.tiers[0]
        assert isinstance(host, kv.HostTier)
        for k in keys:
            host.evict(k, "test")
        known = len(store._me._regions) if store._me is not None else 0
        dsts = [agent.alloc(n * BB) for _ in range(3)]
        results = await within(asyncio.gather(*[store.get(keys, d[0:n * BB]) for d in dsts]))
        assert [r.prefix for r in results] == [n] * 3
        assert sorted(r.coalesced for r in results) == [0, n, n]
        for d in dsts:
            assert np.array_equal(d.numpy(), data)
        st = store.statistics().tiers["host"]
        assert st.promotions == n and st.blocks == n
        assert all(d not in store._remotes for d in dsts)
        assert store._me is not None and len(store._me._regions) == known  # no refresh
        await within(quiesce(store))
        s = store.statistics()
        assert (s.pins, s.pinned_bytes, s.fetches_in_flight) == (0, 0, 0)

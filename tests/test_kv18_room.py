"""kv17's leftover: a put that found every disk segment still being written
(none evictable) dropped its blocks as ``no_room`` at once, though room
appears as soon as one writer is done. A put holding no slot now waits for
that, at most ``room_wait``; one holding slots never waits (it is a writer:
waiting on itself, or two of them on each other, would never end).

Real agent, real segment files; disk-only stores (the put goes straight to
the tier) and one with a host tier writing back under pressure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, wait_until, within

from aioxfer import kv
from aioxfer.kv.disk import SECTOR, _Seg

BB = 64 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(lo: int, n: int, ns: bytes) -> list[bytes]:
    return kv.chain(np.arange(16 * lo, 16 * (lo + n)), block_tokens=16, namespace=ns)


def tier_of(path: Path, segments: int, slots: int, **kw: Any) -> kv.DiskTier:
    """A disk tier of exactly ``segments`` segments of ``slots`` blocks."""
    one = _Seg(0, "", slots, BB).file_bytes
    assert one % SECTOR == 0
    return kv.DiskTier(path, segments * one, segment_bytes=slots * BB, **kw)


async def test_concurrent_puts_wait_for_a_writer_instead_of_dropping(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A tier of 2 segments of 4; three durable puts of 4 at once: the first
    two fill both segments and are still writing when the third asks for a
    segment. It waits for one of them and evicts the older segment (before:
    its 4 blocks dropped no_room, at once). Many rounds of it, and puts of
    every size, drop nothing while room comes within room_wait."""
    agent = await make_agent("kv18-room")
    disk = tier_of(tmp_path / "kv", 2, 4, room_wait=10.0)
    assert disk.room_wait == 10.0
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        assert disk.max_segments == 2
        srcs = [agent.alloc(4 * BB) for _ in range(3)]
        for j, s in enumerate(srcs):
            s.numpy()[:] = pattern(4 * BB, 180 + j)
        for rnd in range(10):
            ks = keys_for(12 * rnd, 12, b"kv18-room")
            puts = [store.put(ks[4 * j:4 * j + 4], srcs[j][0:4 * BB], durable=True)
                    for j in range(3)]
            res = await within(asyncio.gather(*puts), 30)
            for r in res:
                assert (r.stored, r.dropped, r.durable) == (4, 0, 4), (rnd, res)
            # The last put's blocks read back (the tier evicted older ones).
            dst = agent.alloc(4 * BB)
            got = await within(store.get(ks[8:12], dst[0:4 * BB]))
            assert got.prefix == 4 and np.array_equal(dst.numpy(), srcs[2].numpy())
        st = store.statistics().tiers["disk"]
        assert "no_room" not in st.dropped_stores, st.dropped_stores
        assert st.errors == 0


async def test_a_put_holding_slots_never_waits_for_room(make_agent: MakeAgent,
                                                        tmp_path: Path) -> None:
    """Every writer waits: a put larger than the whole tier holds slots in
    both segments and still wants more. It stores what it got and drops the
    rest at once (room_wait is an hour: without the slot guard it waits on
    its own slots, and the 5 s deadline fails the test). Then puts of a
    segment and a half, several at once: each ends (stored + dropped = 6)
    well within the deadline, no writer left behind."""
    agent = await make_agent("kv18-guard")
    disk = tier_of(tmp_path / "kv", 2, 4, room_wait=3600.0)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        src = agent.alloc(12 * BB)
        res = await within(store.put(keys_for(0, 12, b"kv18-guard"), src[0:12 * BB]), 5)
        assert (res.stored, res.dropped) == (8, 4), res
        for rnd in range(5):
            puts = [store.put(keys_for(100 * (rnd * 3 + j + 1), 6, b"kv18-guard"),
                              src[0:6 * BB], durable=bool(j % 2)) for j in range(3)]
            got = await within(asyncio.gather(*puts), 5)
            for r in got:
                assert r.stored + r.dropped == 6 and r.durable <= r.stored, got
            assert not any(s.writing for s in disk.segs.values())
        st = store.statistics().tiers["disk"]
        assert st.errors == 0, st


async def test_room_wait_is_a_bound(make_agent: MakeAgent, tmp_path: Path) -> None:
    """Room that does not come within room_wait: the put drops no_room when
    it expires, not later. Both segments' writers compress their blocks and
    wait for the tier's compression stage, which the test holds (as a third
    compressing writer would): neither can finish, so the third put gives up
    after room_wait (0.3 s); then both end normally."""
    pytest.importorskip("blosc")
    agent = await make_agent("kv18-bound")
    disk = tier_of(tmp_path / "kv", 2, 4, room_wait=0.3, compress="lz4")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        src = agent.alloc(4 * BB)  # zeros: compressible, the gate stays on
        assert disk.clock_w is not None
        await disk.clock_w.acquire()
        try:
            first = asyncio.ensure_future(store.put(keys_for(0, 4, b"kv18-bound"), src[0:4 * BB]))
            second = asyncio.ensure_future(
                store.put(keys_for(10, 4, b"kv18-bound"), src[0:4 * BB]))
            await within(wait_until(lambda: sum(s.writing for s in disk.segs.values()) == 8,
                                    what="both segments being written"))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await within(store.put(keys_for(20, 4, b"kv18-bound"), src[0:4 * BB]), 5)
            waited = loop.time() - t0
            assert not first.done() and not second.done()
        finally:
            disk.clock_w.release()
        assert (r.stored, r.dropped) == (0, 4), r
        assert 0.25 <= waited < 3, waited
        for t in (first, second):
            res = await within(t)
            assert res.stored == 4, res
        # Room again (an evictable segment): a put stores at once.
        r = await within(store.put(keys_for(30, 4, b"kv18-bound"), src[0:4 * BB]), 5)
        assert r.stored == 4, r

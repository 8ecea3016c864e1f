"""rev17's DiskTier findings: a put cancelled while DiskTier._alloc makes
room (_new_segment evicting the oldest segment: _drop_segment awaits its
deregistration) left ``seg.writing`` raised for good (that segment never
evicted nor sealed again), and the evicted segment's file was unlinked only
after that await (cancelled: it stayed, counted nowhere, and its blocks,
evicted or removed since, came back at the next open). Real agent, real
files; the agent's own loopback connected so a deregistration waits for an
acknowledgement (an await to cancel in)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import within

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int, ns: bytes) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=ns)


async def cancel_after_steps(aw: Awaitable[Any], steps: int) -> None:
    t = asyncio.ensure_future(aw)
    for _ in range(steps):
        await asyncio.sleep(0)
    t.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await t


async def settled(disk: kv.DiskTier) -> None:
    """The header flusher and background drops have ended."""
    for _ in range(500):
        flusher = disk._flusher
        if not disk._pending_flush and (flusher is None or flusher.done()) and not disk._tasks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the disk tier's background work did not end")


async def test_puts_cancelled_while_making_room_leave_no_writer_behind(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A segment of 8 filled, 4 of the next; a put of 8 more takes the 4
    left and then evicts the oldest segment for a new one: cancelled there
    at every step count. Once each put has ended no segment counts a writer
    (before: 4 left on one segment from the third step on), and the tier
    still stores whole puts."""
    agent = await make_agent("kv17-writing", listen="127.0.0.1:0")
    disk = kv.DiskTier(tmp_path / "kv", 16 * BB, segment_bytes=8 * BB)  # 2 segments of 8
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        await within(agent.connect(agent.address))
        src = agent.alloc(8 * BB)
        keys = keys_for(40 * 20 + 48, b"kv17-writing")
        for turns in range(40):
            ks = keys[turns * 20:(turns + 1) * 20]
            await within(store.put(ks[0:8], src[0:8 * BB]))
            await within(store.put(ks[8:12], src[0:4 * BB]))
            await settled(disk)  # the first segment evictable
            await within(cancel_after_steps(store.put(ks[12:20], src[0:8 * BB]), turns))
            await settled(disk)
            writing = {s.no: s.writing for s in disk.segs.values() if s.writing}
            assert not writing, f"after {turns} steps: segments still counting writers {writing}"
        for r in range(6):
            ks = keys[800 + 8 * r:808 + 8 * r]
            res = await within(store.put(ks, src[0:8 * BB]))
            assert res.stored == 8, res
            await asyncio.sleep(0.02)


async def test_segments_dropped_by_cancelled_puts_leave_no_file_behind(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """Puts cancelled while the oldest segment is dropped for room: no more
    segment files than the tier holds (before: 36 files for 2 segments), and
    keys removed stay removed after a restart (before: hundreds came back)."""
    path = tmp_path / "kv"
    agent = await make_agent("kv17-orphans", listen="127.0.0.1:0")
    keys = keys_for(60 * 24, b"kv17-orphans")
    first = kv.DiskTier(path, 16 * BB, segment_bytes=8 * BB)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[first]) as store:
        await within(agent.connect(agent.address))
        src = agent.alloc(8 * BB)
        for turns in range(60):
            ks = keys[turns * 24:(turns + 1) * 24]
            await within(store.put(ks[0:8], src[0:8 * BB]))
            await settled(first)  # headers flushed: segments evictable
            await within(cancel_after_steps(store.put(ks[8:16], src[0:8 * BB]), turns % 12))
            await settled(first)
        files = [n for n in os.listdir(path) if n.startswith("seg-")]
        assert len(files) <= 2, f"{len(files)} segment files for a tier of 2 segments"
        await within(store.remove(keys))
    agent2 = await make_agent("kv17-orphans2")
    disk = kv.DiskTier(path, 16 * BB, segment_bytes=8 * BB)
    async with kv.Store.open(agent2, block_bytes=BB, tiers=[disk]) as store:
        assert not disk.index, f"{len(disk.index)} removed blocks came back after the restart"
        hit = await within(store.lookup(keys))
        assert hit.prefix == 0, hit


async def test_durable_puts_under_capacity_pressure_fail_no_header_flush(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """Four writers put durably into a disk tier of 4 segments of 4 blocks:
    each put makes room by evicting the oldest segment. Before, another
    put's _new_segment evicted a segment between a durable put's data and
    its header flush: the flush failed (FileNotFoundError, kv.disk_header_
    failed), counted as disk I/O errors and the blocks dropped as io_error
    (45 to 75 errors a run of 400 puts). Now no error, no io_error; every
    block a put reports durable is found after a restart (unless evicted
    by a later put)."""
    path = tmp_path / "kv"
    agent = await make_agent("kv17-durable")
    disk = kv.DiskTier(path, 16 * BB, segment_bytes=4 * BB)
    keys = keys_for(4 * 50 * 4, b"kv17-durable")
    durable: list[bytes] = []
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        srcs = [agent.alloc(4 * BB) for _ in range(4)]

        async def writer(w: int) -> None:
            for r in range(50):
                base = (w * 50 + r) * 4
                n = 1 + (r + w) % 4
                ks = keys[base:base + n]
                res = await within(store.put(ks, srcs[w][0:n * BB], durable=True))
                assert res.durable == res.stored, res  # nothing stored but not durable
                durable.extend(k for k, t in zip(ks, res.tiers, strict=True) if t)

        await within(asyncio.gather(*(writer(w) for w in range(4))), 60)
        st = store.statistics().tiers["disk"]
        assert st.errors == 0 and "io_error" not in st.dropped_stores, st
        held = set(disk.index)
    assert held <= set(durable)
    disk2 = kv.DiskTier(path, 16 * BB, segment_bytes=4 * BB)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk2]):
        assert set(disk2.index) == held, "durable blocks held before the restart lost"


async def test_remove_does_not_drop_a_segment_a_put_still_writes(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A segment of 4: put A fills 2 slots, a durable put B takes the last 2
    and writes, put C starts the next segment; A's keys are removed while B
    is still writing: the segment has no live block and is not the active
    one. Before, remove dropped it anyway: B's sync failed on the unlinked
    file (its blocks dropped as io_error), or B's blocks were indexed in a
    segment gone (KeyError on a get, seen in rev17's chaos script). Now it
    stays until B is done; B's blocks are stored and read back."""
    agent = await make_agent("kv17-rm-writer")
    disk = kv.DiskTier(tmp_path / "kv", 64 * BB, segment_bytes=4 * BB)
    keys = keys_for(5 * 100, b"kv17-rm-writer")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        src, dst = agent.alloc(4 * BB), agent.alloc(4 * BB)
        src.numpy()[:] = np.frombuffer(np.random.default_rng(5).bytes(4 * BB), dtype=np.uint8)
        raced = 0
        for r in range(100):
            ka, kb, kc = keys[5 * r:5 * r + 2], keys[5 * r + 2:5 * r + 4], keys[5 * r + 4:5 * r + 5]
            assert (await within(store.put(ka, src[0:2 * BB]))).stored == 2
            seg = disk.active
            assert seg is not None
            tb = asyncio.ensure_future(store.put(kb, src[0:2 * BB], durable=True))
            tc = asyncio.ensure_future(store.put(kc, src[0:BB]))
            for _ in range(100):
                await asyncio.sleep(0)
                if disk.active is not seg and seg.writing:
                    break
            raced += bool(seg.writing)
            assert await within(store.remove(ka)) == 2
            rb = await within(tb)
            assert (await within(tc)).stored == 1
            assert (rb.stored, rb.durable) == (2, 2), (r, rb)
            res = await within(store.get(kb, dst[0:2 * BB]))
            assert res.prefix == 2 and np.array_equal(dst.numpy()[:2 * BB], src.numpy()[:2 * BB])
        assert raced, "no remove ran while B was writing"
        st = store.statistics().tiers["disk"]
        assert st.errors == 0 and "io_error" not in st.dropped_stores, st

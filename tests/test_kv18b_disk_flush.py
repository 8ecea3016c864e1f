"""DiskTier's background header flusher stopped at its first failed header
write: the segments still queued behind it stayed in ``_pending_flush``,
which eviction never picks (their headers are "on their way"), while no
flusher ran to take them off. At capacity a put then found nothing to evict
and dropped its blocks as no_room, until some other non-durable put happened
to restart the flusher. Now a failed segment does not stop the others: each
gets its attempt and leaves the queue (its dirty sectors kept for the next
flush), so every segment is evictable again.

The failure is real: the tier lives on a small tmpfs that is filled to the
last page while the headers wait; a segment file is sparse, so writing its
first header sector needs a page the filesystem no longer has (ENOSPC)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import fill_fs, pattern, wait_until, within

from aioxfer import kv

BB = 64 << 10
SLOTS = 4  # blocks per segment
MakeAgent = Callable[..., Awaitable[Any]]


async def test_segments_queued_behind_a_failed_header_flush_become_evictable(
        make_agent: MakeAgent, disk_tmpfs: Path) -> None:
    agent = await make_agent("kv18b")
    tier = kv.DiskTier(disk_tmpfs / "kv", 6 * SLOTS * BB + 6 * (SLOTS + 2) * 4096,
                       segment_bytes=SLOTS * BB)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[tier]) as store:
        cap = tier.max_segments
        assert cap >= 3, cap
        n = cap * SLOTS
        src = agent.alloc(2 * n * BB)
        src.numpy()[:] = pattern(2 * n * BB, 182)
        keys = kv.chain(np.arange(16 * 2 * n), block_tokens=16, namespace=b"kv18b-flush")
        assert tier.lock is not None
        # The header lock held: the puts' headers queue up behind it, not
        # yet written (their sectors are holes in the sparse files).
        await tier.lock.acquire()
        try:
            put = await within(store.put(keys[:n], src[0:n * BB]))
            assert put.stored == n, put
            assert len(tier._pending_flush) >= 2, tier._pending_flush
            fill_fs(disk_tmpfs / "filler")
        finally:
            tier.lock.release()
        flusher = tier._flusher
        assert flusher is not None
        await within(wait_until(flusher.done, what="the flusher over"))
        # The header writes failed for real: their sectors are still dirty.
        assert any(s.dirty for s in tier.segs.values()), "no header flush failed"
        # Room again on the filesystem: what holds a put back now is only
        # whether the tier finds segments to evict.
        os.unlink(disk_tmpfs / "filler")
        stuck = len(tier._pending_flush)  # (left queued with no flusher running)
        put2 = await within(store.put(keys[n:n + 2 * SLOTS], src[n * BB:(n + 2 * SLOTS) * BB]),
                            60)
        # Two new segments: each made by evicting one (before: only the
        # segment whose flush failed was evictable, the second segment's
        # blocks were dropped as no_room).
        assert put2.stored == 2 * SLOTS, (put2, f"{stuck} segments stuck in the flush queue")
        assert stuck == 0

"""DiskTier leftovers of kv18/kv18b.

1. A segment whose background (non-durable) header flush failed kept its
   sectors dirty and was flushed again only when something flushed it again:
   another put into it (a full segment gets none) or the close. Its entries
   were in memory only; a kill -9 lost its blocks for good, however long the
   disk had had room again. Now a failed flush is retried after a bounded
   backoff, with no put needed. The failure is real: the tier lives on a
   small tmpfs filled to the last page while the headers wait (a segment
   file is sparse: its first header sector needs a page), the writer is a
   real process, killed with SIGKILL, and the directory reopened here.
2. ``_new_segment``'s waits for the header flusher and for durable puts'
   header flushes had no deadline: a put at capacity whose only evictable
   segments waited on a stalled flush waited as long as the flush did. It
   now waits at most ``room_wait``, then drops its blocks as ``no_room``, as
   other room failures do. The stall is real: a header write to a segment
   file on a SIGSTOPped FUSE-less path cannot be made here, so the writer
   holding the tier's header lock (the real lock every header write takes)
   stands for a flush stuck in its I/O."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import KV_WRITER_HEAD, check_kv_blocks, fill_fs, pattern, script_child, within

from aioxfer import kv
from aioxfer.kv.disk import SECTOR, _Seg

BB = 64 << 10
SLOTS = 4
MakeAgent = Callable[..., Awaitable[Any]]


WRITER = KV_WRITER_HEAD + textwrap.dedent('''
    SLOTS = int(sys.argv[4])

    async def main():
        async with aioxfer.Agent("kv19-writer") as agent:
            src, keys = source(agent, b"kv19-retry")
            disk = kv.DiskTier(PATH, 1 << 22, segment_bytes=SLOTS * BB)
            store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
            await disk.lock.acquire()  # the headers queue up, unwritten (holes)
            put = await store.put(keys, src[0:N * BB])
            print("queued", put.stored, len(disk._pending_flush), flush=True)
            assert await line() == "filled"
            disk.lock.release()
            t0 = time.monotonic()
            while not (disk._flusher.done() and not disk._pending_flush):
                assert time.monotonic() - t0 < 10, "the flusher never ended"
                await asyncio.sleep(0.005)
            print("failed", sum(len(s.dirty) for s in disk.segs.values()), flush=True)
            assert await line() == "freed"
            t0 = time.monotonic()
            while time.monotonic() - t0 < 15:  # bounded: before the fix this never ends
                if not any(s.dirty for s in disk.segs.values()):
                    break
                await asyncio.sleep(0.01)
            print("state", sum(len(s.dirty) for s in disk.segs.values()),
                  round(time.monotonic() - t0, 2), flush=True)
            await asyncio.sleep(3600)  # killed here, never closed (a close flushes)

    asyncio.run(main())
''')


async def test_failed_header_flush_is_retried_without_another_put(
        make_agent: MakeAgent, disk_tmpfs: Path, tmp_path: Path) -> None:
    """8 blocks in two full segments, their header writes failed with
    ENOSPC; room comes back and no put follows. The headers reach the file
    on their own, and all 8 blocks survive a kill -9 (before: 0 of 8, the
    sectors still dirty 15 s after the room came back)."""
    n = 2 * SLOTS
    path = disk_tmpfs / "kv"
    async with script_child(WRITER, str(path), str(BB), str(n), str(SLOTS),
                            cwd=tmp_path) as writer, asyncio.timeout(60):
        stored, queued = map(int, await writer.expect("queued"))
        assert stored == n and queued == 2, writer.lines
        fill_fs(disk_tmpfs / "filler")
        writer.send("filled")
        (dirty,) = map(int, await writer.expect("failed"))
        assert dirty >= 2, f"no header flush failed: {writer.lines}"
        os.unlink(disk_tmpfs / "filler")
        writer.send("freed")
        state = await writer.expect("state")
    await check_kv_blocks(make_agent, "kv19-reader",
                          kv.DiskTier(path, 1 << 22, segment_bytes=SLOTS * BB),
                          n, BB, b"kv19-retry", f"({writer.lines})")
    assert state[0] == "0", f"header sectors still dirty: {writer.lines}"


def tier_of(path: Path, segments: int, slots: int, **kw: Any) -> kv.DiskTier:
    one = _Seg(0, "", slots, BB).file_bytes
    assert one % SECTOR == 0
    return kv.DiskTier(path, segments * one, segment_bytes=slots * BB, **kw)


@pytest.mark.parametrize("durable", [False, True])
async def test_put_waiting_on_a_stalled_header_flush_drops_at_room_wait(
        make_agent: MakeAgent, tmp_path: Path, durable: bool) -> None:
    """A tier of 2 full segments whose headers are on their way (queued
    behind the header flusher, or held by a durable put in its header
    flush), the header write stalled: a put that needs a segment waits at
    most room_wait (0.3 s) and drops its blocks as no_room (before: it
    waited for the flush, for as long as it stalled: past 5 s here)."""
    agent = await make_agent("kv19-stall")
    disk = tier_of(tmp_path / "kv", 2, SLOTS, room_wait=0.3)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk]) as store:
        assert disk.max_segments == 2 and disk.lock is not None
        n = 2 * SLOTS
        src = agent.alloc((n + SLOTS) * BB)
        src.numpy()[:] = pattern((n + SLOTS) * BB, 193)
        keys = kv.chain(np.arange(16 * (n + SLOTS)), block_tokens=16, namespace=b"kv19-stall")
        await disk.lock.acquire()  # the stall: no header write gets past it
        held: Any = None
        try:
            if durable:
                held = asyncio.ensure_future(store.put(keys[:n], src[0:n * BB], durable=True))
                t0 = time.monotonic()
                while not disk._durable_flushes:
                    assert time.monotonic() - t0 < 10 and not held.done(), held
                    await asyncio.sleep(0.001)
            else:
                put = await within(store.put(keys[:n], src[0:n * BB]))
                assert put.stored == n, put
                # The flusher takes one segment off the queue (it waits for
                # the lock): that one is evictable, unless a reader holds
                # it; one does (its pin, as a get reading it takes).
                t0 = time.monotonic()
                while len(disk._pending_flush) != 1:
                    assert time.monotonic() - t0 < 10, disk._pending_flush
                    await asyncio.sleep(0.001)
                (flushing,) = [s for s in disk.segs.values() if s not in disk._pending_flush]
                disk.pin(flushing.no << 32)
                held = flushing
            t0 = time.monotonic()
            late = asyncio.ensure_future(
                store.put(keys[n:], src[n * BB:(n + SLOTS) * BB]))
            done, _ = await asyncio.wait([late], timeout=5)
            took = time.monotonic() - t0
            assert late in done, "the put waited on the stalled flush for 5 s"
            res = late.result()
            assert res.stored == 0 and res.dropped == SLOTS, res
            assert took < 3, took
        finally:
            disk.lock.release()
        if isinstance(held, asyncio.Future):
            assert (await within(held)).durable == n
        elif held is not None:
            disk.unpin(held.no << 32)
        stats = store.statistics()
        assert stats.tiers[disk.name].dropped_stores.get("no_room") == SLOTS, stats

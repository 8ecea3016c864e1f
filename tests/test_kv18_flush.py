"""rev17b #4: a durable disk put cancelled inside its header flush
(DiskTier._flush: waiting for the header lock, or writing header sectors)
put its sectors back into ``seg.dirty`` with nothing left to write them:
its blocks were published (this process served them, and a second durable
put of the keys found them present and acknowledged nothing new) but their
entries never reached the disk unless another put flushed the same segment,
and a full segment was never sealed. A kill -9 then lost them for good.

The cancel lands deterministically: the writer process holds the tier's
header lock (the real asyncio.Lock every header writer takes) while the
put publishes and reaches its flush, cancels it there, lets go of the lock,
and then waits (bounded) for the headers to reach the file on their own. The
test kills it with SIGKILL and reopens the directory in its own process."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from conftest import KV_WRITER_HEAD, check_kv_blocks, script_child

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]

WRITER = KV_WRITER_HEAD + textwrap.dedent('''
    async def main():
        async with aioxfer.Agent("kv18-writer") as agent:
            src, keys = source(agent, b"kv18-flush")
            disk = kv.DiskTier(PATH, 1 << 28, segment_bytes=4 * BB)  # 4 slots each
            store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
            await disk.lock.acquire()  # no header writer gets past it now
            put = asyncio.ensure_future(store.put(keys, src[0:N * BB], durable=True))
            t0 = time.monotonic()
            # Published (data written and fdatasynced) and in its header flush.
            while not (all(k in disk.index for k in keys) and disk._durable_flushes == 1):
                assert not put.done(), put
                assert time.monotonic() - t0 < 10, "the put never reached its flush"
                await asyncio.sleep(0.001)
            put.cancel()
            try:
                await put
                print("put not cancelled", flush=True)
            except asyncio.CancelledError:
                print("put cancelled", flush=True)
            disk.lock.release()
            # What a caller sees now: the keys are held (present), not durable.
            again = await store.put(keys, src[0:N * BB], durable=True)
            print("again", again.stored, again.present, again.durable, flush=True)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3:  # bounded: before the fix this never ends
                if not any(s.dirty for s in disk.segs.values()) and disk.lock is not None \\
                        and not disk.lock.locked():
                    break
                await asyncio.sleep(0.01)
            dirty = sum(len(s.dirty) for s in disk.segs.values())
            unsealed = sum(1 for s in disk.segs.values()
                           if s.image is not None and s.cursor >= s.slots)
            print("state", dirty, unsealed, flush=True)
            await asyncio.sleep(3600)  # killed here, never closed (a close flushes)

    asyncio.run(main())
''')


async def test_cancelled_durable_flush_reaches_disk_without_another_put(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """6 blocks over two segments (one full): cancelled in the flush of the
    first. Their headers reach the file with no other put (before: 2 dirty
    sectors left, the full segment never sealed, 0 of 6 found after kill -9)."""
    n = 6
    path = tmp_path / "kv"
    async with script_child(WRITER, str(path), str(BB), str(n),
                            cwd=tmp_path) as writer, asyncio.timeout(60):
        lines = [await writer.line() for _ in range(3)]
    assert lines[0] == "put cancelled", lines
    # Held, and so not written again: the caller's second durable put is told
    # "present", durable 0 (the first one raised CancelledError).
    assert lines[1] == f"again 0 {n} 0", lines
    await check_kv_blocks(make_agent, "kv18-reader",
                          kv.DiskTier(path, 1 << 28, segment_bytes=4 * BB), n, BB, b"kv18-flush")
    assert lines[2] == "state 0 0", f"headers left dirty / a full segment unsealed: {lines}"

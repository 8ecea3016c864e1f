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
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import within

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]

WRITER = textwrap.dedent('''
    import asyncio, sys, time
    import numpy as np
    import aioxfer
    from aioxfer import kv

    BB = int(sys.argv[2])
    N = int(sys.argv[3])

    async def main():
        async with aioxfer.Agent("kv18-writer") as agent:
            src = agent.alloc(N * BB)
            for i in range(N):
                src.numpy()[i * BB:(i + 1) * BB] = np.random.default_rng(i).integers(
                    0, 256, BB, dtype=np.uint8)
            keys = kv.chain(np.arange(16 * N), block_tokens=16, namespace=b"kv18-flush")
            disk = kv.DiskTier(sys.argv[1], 1 << 28, segment_bytes=4 * BB)  # 4 slots each
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
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "kv"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(path), str(BB), str(n),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):
            while len(lines) < 3:
                line = await proc.stdout.readline()
                if not line:
                    err = (await proc.stderr.read()).decode()
                    raise AssertionError(f"the writer died: {lines} {err[-3000:]}")
                lines.append(line.decode().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert lines[0] == "put cancelled", lines
    # Held, and so not written again: the caller's second durable put is told
    # "present", durable 0 (the first one raised CancelledError).
    assert lines[1] == f"again 0 {n} 0", lines
    agent = await make_agent("kv18-reader")
    dst = agent.alloc(n * BB)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv18-flush")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.DiskTier(path, 1 << 28, segment_bytes=4 * BB)]) as store:
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.failed == ()
        assert res.prefix == n, f"{res.prefix} of {n} blocks survived the kill"
        for i in range(n):
            want = np.random.default_rng(i).integers(0, 256, BB, dtype=np.uint8)
            assert np.array_equal(dst.numpy()[i * BB:(i + 1) * BB], want)
    assert lines[2] == "state 0 0", f"headers left dirty / a full segment unsealed: {lines}"

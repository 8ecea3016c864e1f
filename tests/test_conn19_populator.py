"""A same-host peer's pool mapped lazily (above $AIOXFER_SHM_LAZY_MIN, 1 GiB
by default) is populated behind connect by a low-priority thread that must
not hold the process's mmap_lock while it is preempted.

Before, that populator called madvise(MADV_POPULATE_READ), which holds the
whole process's mmap_lock for reading; at nice 10 it was often preempted
inside the call, and every mmap/munmap/mprotect of another thread (a new
thread's stack, malloc's arenas, the engine taking the first connection)
waited until it ran again: connect + first 4 KiB write to a lazily mapped
64 MiB pool stalled 0.5-6.5 ms in 16 of 45 samples (connect_phases, the
stall inside endpoint_add_conn). It now populates by reading a byte of each
page (page faults, under the mapping's own lock). These tests run the
initiator under strace and check that only the copies' own granules and the
first one are populated by madvise, while the mapping still ends up
populated (its Rss in /proc/self/smaps), and that the bytes land.

$AIOXFER_SHM_LAZY_MIN (bytes) itself is checked too: 0 maps a fully written
32 MiB pool lazily (before: populated at connect, by madvise, whatever the
variable said).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from typing import Any

import pytest
from conftest import PipeChild, digest, pattern

MiB = 1 << 20
GRANULE = 256 * 1024  # shm.c POP_SHIFT

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")


def pool_peer_main(conn: Any, size: int, data: int) -> None:
    """An agent whose "pool" (agent.alloc, a sealed memfd) is `size` bytes, of
    which the first `data` were written (the rest are holes)."""
    import aioxfer

    async def serve() -> None:
        async with aioxfer.Agent("pool") as agent:
            pool = agent.alloc(size, name="pool")
            view = pool.numpy()
            view[:data] = pattern(data, seed=3)
            conn.send({"address": agent.address})
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd == "quit":
                    conn.send(None)
                    return
                off, n = cmd
                conn.send(digest(view[off:off + n]))

    asyncio.run(serve())


# The initiator: connects, writes a page at each offset, then waits (up to
# 30 s) until its mapping of the peer's pool has `want` bytes resident, and
# prints that mapping's Rss, then and right after connect returned.
INITIATOR = r"""
import asyncio, json, sys, time
import aioxfer

address, size, want, offs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])

def rss():
    best = 0
    with open("/proc/self/smaps") as f:
        cur = None
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = hi - lo >= size and "memfd:aioxfer:pool:pool" in line
            elif cur and parts[0] == "Rss:":
                best = max(best, int(parts[1]) * 1024)
    return best

async def main():
    async with aioxfer.Agent("init") as agent:
        peer = await agent.connect(address)
        assert peer.path == "shm", peer.path
        rss0 = rss()
        remote = peer.region("pool")
        src = agent.register(bytearray(b"\x5a" * 4096))
        for off in offs:
            await agent.write(src[0:4096], remote[off:off + 4096])
        deadline = time.monotonic() + 30
        while rss() < want and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        print(json.dumps({"rss": rss(), "rss0": rss0}), flush=True)

asyncio.run(main())
"""

MADVISE = re.compile(r"madvise\(0x[0-9a-f]+, (\d+), (?:MADV_POPULATE_READ|0x16\b)")


async def _run(size: int, data: int, offs: list[int], lazy_min: str | None,
               tmp_path: Any) -> tuple[int, int, PipeChild]:
    """(bytes populated by madvise in the initiator, its mapping's Rss, the peer)."""
    populated, rss, _, child = await _run_rss0(size, data, offs, lazy_min, tmp_path)
    return populated, rss, child


async def _run_rss0(size: int, data: int, offs: list[int], lazy_min: str | None,
                    tmp_path: Any) -> tuple[int, int, int, PipeChild]:
    """As _run, and the mapping's Rss when connect returned (third)."""
    loop = asyncio.get_running_loop()
    child = await loop.run_in_executor(None, PipeChild, pool_peer_main, size, data)
    env = dict(os.environ)
    env.pop("AIOXFER_SHM_LAZY_MIN", None)
    if lazy_min is not None:
        env["AIOXFER_SHM_LAZY_MIN"] = lazy_min
    trace = tmp_path / "strace.out"
    try:
        proc = await asyncio.create_subprocess_exec(
            "strace", "-f", "-qq", "-e", "trace=madvise", "-o", str(trace),
            sys.executable, "-c", INITIATOR, child.hello["address"], str(size), str(data),
            json.dumps(offs), env=env, cwd="/", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
    except BaseException:
        await loop.run_in_executor(None, child.close)
        raise
    populated = sum(int(m.group(1)) for m in MADVISE.finditer(trace.read_text()))
    res = json.loads(out.decode().splitlines()[-1])
    return populated, res["rss"], res["rss0"], child


async def _check(child: PipeChild, offs: list[int]) -> None:
    loop = asyncio.get_running_loop()
    page = digest(bytearray(b"\x5a" * 4096))
    for off in offs:
        assert await loop.run_in_executor(None, child.call, (off, 4096)) == page


async def test_lazy_pool_populated_without_madvise(tmp_path: Any) -> None:
    """A fully written 32 MiB pool with AIOXFER_SHM_LAZY_MIN=0: mapped lazily,
    populated behind by the populator's page faults, not its madvise calls.
    Failed before: 33554432 bytes populated by madvise (no such variable:
    populated at connect)."""
    size = 32 * MiB
    offs = [0, 5 * MiB + 4096, size - 4096]
    populated, rss, child = await _run(size, size, offs, "0", tmp_path)
    try:
        # The first granule (at map time) and the granules the copies wrote.
        assert populated <= (1 + len(offs)) * GRANULE, populated
        assert rss == size  # populated all the same, behind
        await _check(child, offs)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, child.close)


async def test_large_sparse_pool_populated_without_madvise(tmp_path: Any) -> None:
    """The default threshold: a pool of 1 GiB + 2 MiB (16 MiB of it written)
    is mapped lazily; the populator fills exactly its data, by page faults.
    Failed before: 16777216 bytes populated by madvise (the populator's)."""
    size, data = (1 << 30) + 2 * MiB, 16 * MiB
    offs = [4096, 9 * MiB]
    populated, rss, child = await _run(size, data, offs, None, tmp_path)
    try:
        assert populated <= (1 + len(offs)) * GRANULE, populated
        assert data <= rss <= data + len(offs) * GRANULE, rss  # its data, not its holes
        await _check(child, offs)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, child.close)


async def test_bad_lazy_min_is_ignored(tmp_path: Any) -> None:
    """A value that is not a plain number leaves the default (1 GiB): the
    32 MiB pool is populated whole by the time connect returns, as before
    (small pages since shmc29 by a read per fault-around window, no madvise:
    see tests/test_shmc29_populate.py; a pool of huge pages, agent.alloc's,
    since nat34 by one MADV_POPULATE_READ over all but its first 2 MiB)."""
    size = 32 * MiB
    populated, rss, rss0, child = await _run_rss0(size, size, [0], "lots", tmp_path)
    try:
        assert rss0 == size and rss == size
        assert populated in (0, size - 2 * MiB), populated
        await _check(child, [0])
    finally:
        await asyncio.get_running_loop().run_in_executor(None, child.close)

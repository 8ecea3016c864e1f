"""A same-host peer's pool (up to $AIOXFER_SHM_LAZY_MIN, 1 GiB) is populated
by the time connect returns, by a read per fault-around window (shm.c
touch_pages; the window measured once through /proc/self/pagemap), not by
MAP_POPULATE or madvise(MADV_POPULATE_READ), which walk every page again
after the faults mapped it (~0.7x their CPU).

What must hold: every page of a written pool is mapped when connect returns
(a stride wider than the kernel's window, or a window misaligned with the
touches, would leave pages to the first writes' page faults), whatever its
size (one thread below 32 MiB, several above; below 2 MiB a read per page);
of a pool with holes exactly its data is mapped, with ranges that start and
end inside a window, also after the window was measured on a whole pool
(a hole mapped would be a page of the peer's file allocated for us); and no
madvise populates anything at connect. Checked from the initiator's own
/proc/self/smaps (the mapping's Rss) and strace, the bytes written read back
by the peer.
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

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4 * KiB

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")


def pools_main(conn: Any, pools: list[tuple[str, int, list[tuple[int, int]]]]) -> None:
    """One agent per (name, size, data ranges): a pool of `size` bytes
    (agent.alloc, a sealed memfd) of which only the ranges were written,
    in small pages: agent.alloc's huge pages (AIOXFER_SHM_HUGE) leave no hole
    (tests/test_shm32_make_huge.py covers those)."""
    os.environ["AIOXFER_SHM_HUGE"] = "0"
    import aioxfer

    async def serve() -> None:
        agents, views = [], {}
        try:
            for name, size, ranges in pools:
                agent = aioxfer.Agent(name)
                await agent.__aenter__()
                agents.append(agent)
                view = agent.alloc(size, name="pool").numpy()
                for i, (off, n) in enumerate(ranges):
                    view[off:off + n] = pattern(n, seed=i + 1)
                views[name] = view
            conn.send({a.name: a.address for a in agents})
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd == "quit":
                    conn.send(None)
                    return
                name, off, n = cmd
                conn.send(digest(views[name][off:off + n]))
        finally:
            for agent in reversed(agents):
                await agent.__aexit__(None, None, None)

    asyncio.run(serve())


# The initiator: connects to each (address, name, size, offsets) in turn,
# notes its mapping's Rss as soon as connect returned, writes a page of 0x5a
# at each offset; prints the Rss by name.
INITIATOR = r"""
import asyncio, json, sys
import aioxfer

targets = json.loads(sys.argv[1])

def rss(name, size):
    best = 0
    with open("/proc/self/smaps") as f:
        cur = False
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = hi - lo == size and f"memfd:aioxfer:{name}:pool" in line
            elif cur and parts[0] == "Rss:":
                best = max(best, int(parts[1]) * 1024)
    return best

async def main():
    out = {}
    async with aioxfer.Agent("init") as agent:
        src = agent.register(bytearray(b"\x5a" * 4096))
        for address, name, size, offs in targets:
            peer = await agent.connect(address)
            out[name] = rss(name, size)
            assert peer.path == "shm", peer.path
            remote = peer.region("pool")
            for off in offs:
                await agent.write(src[0:4096], remote[off:off + 4096])
    print(json.dumps(out), flush=True)

asyncio.run(main())
"""

MADVISE = re.compile(r"madvise\(0x[0-9a-f]+, (\d+), (?:MADV_POPULATE_READ|0x16\b)")


async def _connect_all(pools: list[tuple[str, int, list[tuple[int, int]]]],
                       offs: dict[str, list[int]], tmp_path: Any) -> dict[str, int]:
    """Runs the initiator against a child holding `pools`; checks the pages
    written; returns each pool's Rss at connect. No madvise populated."""
    loop = asyncio.get_running_loop()
    child = await loop.run_in_executor(None, PipeChild, pools_main, pools)
    try:
        env = dict(os.environ)
        env.pop("AIOXFER_SHM_LAZY_MIN", None)
        trace = tmp_path / "strace.out"
        targets = [[child.hello[name], name, size, offs[name]] for name, size, _ in pools]
        proc = await asyncio.create_subprocess_exec(
            "strace", "-f", "-qq", "-e", "trace=madvise", "-o", str(trace),
            sys.executable, "-c", INITIATOR, json.dumps(targets), env=env, cwd="/",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
        populated = sum(int(m.group(1)) for m in MADVISE.finditer(trace.read_text()))
        assert populated == 0, populated
        page = digest(bytearray(b"\x5a" * PAGE))
        for name, _, _ in pools:
            for off in offs[name]:
                got = await loop.run_in_executor(None, child.call, (name, off, PAGE))
                assert got == page, (name, off)
        rss: dict[str, int] = json.loads(out.decode().splitlines()[-1])
        return rss
    finally:
        await loop.run_in_executor(None, child.close)


@pytest.mark.parametrize("size", [64 * MiB, 3 * MiB + 12 * KiB, 40 * KiB])
async def test_written_pool_mapped_whole_at_connect(size: int, tmp_path: Any) -> None:
    """Every page of a written pool is mapped when connect returns: 64 MiB
    (several threads, each its slice), 3 MiB + 12 KiB (one thread, a tail
    that ends inside a window), 40 KiB (below the window's measurement)."""
    rss = await _connect_all([("full", size, [(0, size)])],
                             {"full": [0, size // 2 & ~(PAGE - 1), size - PAGE]}, tmp_path)
    assert rss["full"] == size


async def test_sparse_pool_maps_exactly_its_data(tmp_path: Any) -> None:
    """A pool with holes, connected to after a whole one (so the window is
    measured and the touches are spaced by it): its data ranges, which start
    and end inside windows and cross their edges, are mapped whole, and
    none of its holes."""
    size = 8 * MiB
    ranges = [(PAGE, 2 * PAGE), (60 * KiB, 72 * KiB), (2 * MiB - PAGE, 2 * PAGE),
              (5 * MiB + 68 * KiB, 4 * PAGE), (size - PAGE, PAGE)]
    pools = [("whole", 4 * MiB, [(0, 4 * MiB)]), ("sparse", size, ranges)]
    offs = {"whole": [0], "sparse": [off for off, _ in ranges]}
    rss = await _connect_all(pools, offs, tmp_path)
    assert rss["whole"] == 4 * MiB
    assert rss["sparse"] == sum(n for _, n in ranges)

"""A same-host peer's memfd pool with holes: we populate (pre-fault) only the
pages it has, never its holes.

Populating a hole of a peer's memfd allocates a page of the peer's file,
charged to us, and the page stays the peer's for as long as it keeps the
file. Before, connecting to a peer whose pool was a sparse memfd filled all
of it (MAP_POPULATE under 16 MiB, several threads up to 1 GiB, a background
populator above): a peer advertising a 64 GiB pool it never wrote had us
allocate up to 64 GiB. The data it wrote is still populated, so copies into
a pool its owner touched (the demo's, the benchmarks') take no page fault.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from conftest import PipeChild, digest, pattern, within

MiB = 1 << 20
DATA_OFF = 5 * MiB + 4096  # where the peer wrote its data, 1 MiB of it


def sparse_peer_main(conn: Any, size: int) -> None:
    """An agent whose "pool" (agent.alloc, a sealed memfd) is `size` bytes of
    which only [DATA_OFF, DATA_OFF + 1 MiB) and the last page were written.
    Small pages: agent.alloc's huge pages (AIOXFER_SHM_HUGE) leave no hole."""
    os.environ["AIOXFER_SHM_HUGE"] = "0"
    import aioxfer

    async def serve() -> None:
        async with aioxfer.Agent("sparse") as agent:
            pool = agent.alloc(size, name="pool")
            view = pool.numpy()
            view[DATA_OFF:DATA_OFF + MiB] = pattern(MiB, seed=7)
            view[size - 4096:] = 9
            conn.send({"address": agent.address})
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd == "quit":
                    conn.send(None)
                    return
                if cmd == "allocated":  # bytes of the memfd that have pages
                    conn.send(os.fstat(pool._memfd).st_blocks * 512)
                elif cmd == "digest":
                    conn.send(digest(view[DATA_OFF:DATA_OFF + MiB]))

    asyncio.run(serve())


@pytest.mark.parametrize("size", [8 * MiB, 256 * MiB, (1 << 30) + 2 * MiB],
                         ids=["map-populate", "parallel", "lazy"])
async def test_sparse_pool_populated_data_only(make_agent, size: int) -> None:
    loop = asyncio.get_running_loop()
    child = await loop.run_in_executor(None, PipeChild, sparse_peer_main, size)
    try:
        written = MiB + 4096
        before = await loop.run_in_executor(None, child.call, "allocated")
        # Huge pages (shmem_enabled=advise: agent.alloc advises them) hold
        # whole 2 MiB ranges of what the owner wrote: 3 of them here.
        assert before <= written + 64 * 1024 or before <= 6 * MiB
        init = await make_agent("init")
        peer = await within(init.connect(child.hello["address"]))
        assert peer.path == "shm"
        remote = peer.region("pool")
        # Its data is there (mapped, populated) and readable.
        back = init.register(bytearray(MiB))
        await within(init.read(back[0:MiB], remote[DATA_OFF:DATA_OFF + MiB]))
        assert digest(back.memoryview) == digest(pattern(MiB, seed=7))
        # The populator (above 1 GiB) works behind connect: give it time to
        # fill what it would (it filled ~1 GiB in well under a second here).
        await asyncio.sleep(1.0)
        allocated = await loop.run_in_executor(None, child.call, "allocated")
        assert allocated <= before + 2 * MiB, (
            f"connecting to a {size >> 20} MiB pool with {written} bytes written "
            f"allocated {allocated} bytes of it")
        # A write into a hole still lands (its pages fault in, ours to pay for).
        src = init.register(bytearray(pattern(MiB, seed=8).tobytes()))
        await within(init.write(src[0:MiB], remote[DATA_OFF:DATA_OFF + MiB]))
        assert await loop.run_in_executor(None, child.call, "digest") == \
            digest(pattern(MiB, seed=8))
        await within(init.write(src[0:4096], remote[64 * 1024:64 * 1024 + 4096]))
        grown = await loop.run_in_executor(None, child.call, "allocated")
        assert before < grown <= before + 2 * MiB + 256 * 1024
    finally:
        await loop.run_in_executor(None, child.close)

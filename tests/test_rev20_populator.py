"""rev20: conn19's populator (shm.c pop_main, touching a byte per page since
conn19, where it used madvise) against the mapping going away under it.

A lazily mapped pool ($AIOXFER_SHM_LAZY_MIN=0) is populated behind connect
by one low-priority thread; unmapping (the peer closed, or lost) waits for
it to let go (pop_cancel: at most one POP_STEP). With madvise a mapping
unmapped too early only made the call fail (ENOMEM); a touched page of an
unmapped range is a SIGSEGV of the whole process. Here an initiator (its own
process, the variable read at its first mapping) connects to a 96 MiB pool
and closes the peer at once, over and over, then connects again and the
pool's owner is SIGKILLed while it populates: the initiator must live
(a write after the loss fails PeerLost or lands), and its fds and
mappings must go back.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys

from conftest import PipeChild
from test_conn19_populator import pool_peer_main  # the same pool owner

MiB = 1 << 20

INITIATOR = r"""
import asyncio, os, sys, time
import aioxfer

address, size, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def pool_maps():
    with open("/proc/self/maps") as f:
        return sum("memfd:aioxfer:pool:pool" in line for line in f)

async def main():
    async with aioxfer.Agent("init") as agent:
        src = agent.register(bytearray(b"\x5a" * 4096))
        fds0 = len(os.listdir("/proc/self/fd"))
        for i in range(rounds):
            peer = await agent.connect(address)
            assert peer.path == "shm", peer.path
            if i % 2:  # a write first: the copy populates its own granule
                off = (i * 7 * 1024 * 1024) % (size - 4096)
                await agent.write(src[0:4096], peer.region("pool")[off:off + 4096])
            await peer.aclose()  # unmapped while the populator is (likely) in it
        deadline = time.monotonic() + 10
        while pool_maps() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert pool_maps() == 0, "a pool mapping left"
        assert len(os.listdir("/proc/self/fd")) <= fds0 + 2, (fds0, os.listdir("/proc/self/fd"))
        # The owner killed while its pool is populated here.
        peer = await agent.connect(address)
        print("connected", flush=True)
        sys.stdin.readline()  # the test SIGKILLs the owner meanwhile
        try:
            await agent.write(src[0:4096], peer.region("pool")[0:4096])
        except aioxfer.PeerLost:
            pass
        # Written before the loss or refused: either way, this process goes on.
        deadline = time.monotonic() + 10
        while pool_maps() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        print("maps", pool_maps(), flush=True)

asyncio.run(main())
"""


async def test_pool_unmapped_or_lost_while_populated() -> None:
    size = 96 * MiB
    loop = asyncio.get_running_loop()
    child = await loop.run_in_executor(None, PipeChild, pool_peer_main, size, size)
    env = dict(os.environ, AIOXFER_SHM_LAZY_MIN="0")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", INITIATOR, child.hello["address"], str(size), "40",
        env=env, cwd="/", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if line != b"connected\n":  # died (SIGSEGV: returncode -11) or failed
            err = await proc.stderr.read()
            rc = await asyncio.wait_for(proc.wait(), 30)
            raise AssertionError(f"initiator ended with {rc}: {err.decode()[-1500:]}")
        os.kill(child.proc.pid, signal.SIGKILL)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, (proc.returncode, err.decode()[-2000:])
        assert out.decode().split() == ["maps", "0"], out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await loop.run_in_executor(None, child.close)

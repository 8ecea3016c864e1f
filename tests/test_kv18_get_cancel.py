"""rev17: a cancelled Store.get() returned at once while reads it had
already posted into ``dst`` could still land: the caller, told its get was
cancelled, reused ``dst`` and then saw it change under it. A cancelled get
now waits for what it posted into ``dst`` to end (bounded by the agent's
own stall/liveness paths) before CancelledError reaches the caller.

The slow source is real: the member holding the blocks is another process,
reached over TCP, stopped with SIGSTOP while the get's reads are in flight
and let go (SIGCONT) only after the cancel was asked for."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import pattern, sigstop, wait_until, within

from aioxfer import kv

BB = 64 << 10
MakeAgent = Callable[..., Awaitable[Any]]

MEMBER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        async with aioxfer.Agent(sys.argv[1], transports=("tcp",), peer_timeout=30.0,
                                 keepalive=0.2) as agent:
            async with kv.Store.open(agent, block_bytes=int(sys.argv[2]), tiers=[
                    kv.HostTier(64 * int(sys.argv[2])), kv.PeerTier(group="g18")]):
                print(agent.address, flush=True)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def test_cancelled_get_returns_only_once_dst_is_no_longer_written(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """Blocks on a TCP member; the member stopped; a get posts its reads and
    is cancelled; the member resumes. The bytes dst holds when the get's
    CancelledError arrives are the bytes it holds for good (before: the get
    ended cancelled with dst untouched, and the member's answers then wrote
    it: dst changed after the cancellation returned)."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "m18", str(BB), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    stopped = False
    try:
        assert proc.stdout is not None
        line = await within(proc.stdout.readline(), 60)
        assert line, "the member did not start"
        address = line.decode().strip()
        agent = await make_agent("g18", transports=("tcp",), inline_bytes=0,
                                 peer_timeout=30.0, keepalive=0.2)
        n = 32
        src = agent.alloc(n * BB)
        data = pattern(n * BB, 18)
        src.numpy()[:] = data
        keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv18-get")
        tier = kv.PeerTier(group="g18")
        # Full at 4 blocks and never written back: the rest go to their
        # owners at once, the member's share read back over TCP.
        host = kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[host, tier]) as store:
            assert await within(tier.join(address))
            put = await within(store.put(keys, src[0:n * BB]))
            assert put.stored == n, put
            hit = await within(store.lookup(keys))  # the member's index read now
            remote = [k for k, t in zip(keys, hit.tiers, strict=True) if t == "peer"]
            assert len(remote) >= 4, hit
            remote = remote[:8]
            m = len(remote)
            want = np.concatenate([data[keys.index(k) * BB:(keys.index(k) + 1) * BB]
                                   for k in remote])
            dst = agent.alloc(m * BB)
            dst.numpy()[:] = 0xA5
            snap: list[np.ndarray] = []

            async def getter() -> None:
                try:
                    await store.get(remote, dst[0:m * BB])
                except asyncio.CancelledError:
                    snap.append(dst.numpy().copy())  # what the caller sees, then
                    raise

            assert proc.pid is not None
            sigstop(proc.pid)
            stopped = True
            reads = tier.counters.reads
            task = asyncio.ensure_future(getter())
            await within(wait_until(lambda: tier.counters.reads > reads
                                    and agent.statistics().in_flight > 0,
                                    what="the get's reads posted"))
            task.cancel()
            # Give a cancel that does not wait its chance to end the get now.
            await asyncio.wait([task], timeout=0.5)
            os.kill(proc.pid, signal.SIGCONT)
            stopped = False
            try:
                await within(task, 30)
                raise AssertionError("the get was not cancelled")
            except asyncio.CancelledError:
                pass
            # The engine has confirmed every transfer over: nothing may
            # land any more, and nothing landed after the cancellation.
            await within(wait_until(lambda: agent.statistics().in_flight == 0,
                                    what="the engine idle"))
            assert snap, "the getter did not see its cancellation"
            after = dst.numpy().copy()
            changed = int((after != snap[0]).sum())
            assert changed == 0, f"{changed} bytes of dst changed after the get was cancelled"
            # (the reads ran to their end: what the member answered is there)
            assert np.array_equal(after, want)
            assert store.statistics().pins == 0
            # The store still serves them.
            res = await within(store.get(remote, dst[0:m * BB]))
            assert res.prefix == m and np.array_equal(dst.numpy(), want)
        assert proc.stdin is not None
        proc.stdin.write(b"done\n")
        await proc.stdin.drain()
        await within(proc.wait(), 30)
    finally:
        if stopped and proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_get_cancelled_at_every_step_leaves_nothing_in_flight(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """Host hits and disk reads in one get, cancelled after 0, 1, 2, ...
    loop steps; and a second get of the same disk blocks (a follower of the
    first) cancelled the same way. When a CancelledError reaches a getter,
    the engine has nothing of its in flight (before: the disk reads were
    cancelled and still running) and its dst never changes again (checked
    once everything is over)."""
    agent = await make_agent("g18-sweep")
    bb = 256 << 10
    n = 40
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv18-sweep")
    src = agent.alloc(n * bb)
    data = pattern(n * bb, 181)
    src.numpy()[:] = data
    host = kv.HostTier(4 * bb, high_watermark=1.0, low_watermark=1.0, promote=False)
    disk = kv.DiskTier(tmp_path / "kv", 1 << 26, segment_bytes=64 * bb)
    async with kv.Store.open(agent, block_bytes=bb, tiers=[host, disk]) as store:
        assert (await within(store.put(keys[:4], src[0:4 * bb]))).stored == 4
        assert all(await within(disk._write(keys[4:], [src] * (n - 4),
                                            [i * bb for i in range(4, n)], durable=True)))
        assert (await within(store.lookup(keys))).tiers == ("host",) * 4 + ("disk",) * (n - 4)
        dst = agent.alloc(n * bb)
        dst2 = agent.alloc(n * bb)
        cancelled = followed = 0
        # Cancelled after 0..39 loop steps, and (-1) once the disk reads are
        # in the engine (their file reads take a while at this size).
        for steps in [*range(40), -1]:
            for follower in (False, True):
                dst.numpy()[:] = 0
                dst2.numpy()[:] = 0
                seen: list[tuple[int, np.ndarray]] = []
                mine = dst2 if follower else dst

                async def getter(mine: Any = mine, seen: Any = seen) -> None:
                    try:
                        await store.get(keys, mine[0:n * bb])
                    except asyncio.CancelledError:
                        seen.append((agent.statistics().in_flight, mine.numpy().copy()))
                        raise

                lead = asyncio.ensure_future(store.get(keys, dst[0:n * bb])) \
                    if follower else None
                if lead is not None:
                    await asyncio.sleep(0)  # the leader plans (and posts) first
                reading = disk.counters.in_flight
                task = asyncio.ensure_future(getter())
                for _ in range(steps):
                    await asyncio.sleep(0)
                if steps < 0:
                    await within(wait_until(
                        lambda r=reading, t=task: disk.counters.in_flight > r
                        and agent.statistics().in_flight > 0 or t.done(),
                        what="the disk reads posted"))
                task.cancel()
                try:
                    await within(task)
                except asyncio.CancelledError:
                    cancelled += 1
                    assert seen or steps == 0, "the getter did not see its cancellation"
                    if not seen:
                        pass  # cancelled before its first step: nothing posted
                    elif lead is None:
                        assert seen[0][0] == 0, (
                            f"step {steps}: {seen[0][0]} transfers in flight when the "
                            f"cancelled get returned")
                    else:
                        followed += 1
                if lead is not None:
                    res = await within(lead)
                    assert res.prefix == n and np.array_equal(dst.numpy(), data)
                await within(wait_until(lambda: agent.statistics().in_flight == 0,
                                        what="the engine idle"))
                if seen:
                    changed = int((mine.numpy() != seen[0][1]).sum())
                    assert changed == 0, (f"step {steps} follower={follower}: {changed} "
                                          f"bytes of dst changed after the cancellation")
                assert store.statistics().pins == 0
        assert cancelled >= 5 and followed >= 3, (cancelled, followed)

"""A put whose blocks overflow the host tier to a PeerTier: once the put has
returned or raised, its ``src`` is never read again. Before, the owner
pulled the blocks from ``src`` itself; a placement that outlived its put
(the owner stopped past ``ack_wait``, or the put cancelled) was pulled
later from memory the caller was already reusing (checksummed, so nothing
wrong was stored, but the caller's buffer was read after the put was over).

The owner is a real second process, SIGSTOPped while the put runs and
continued once it is over; it records which of the writer's regions each
placement it serves reads. The caller overwrites ``src`` as soon as its put
is over, as a serving engine reuses a block at once."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import pattern, sigstop, wait_until, within

from aioxfer import kv

BB = 16 << 10
N = 8
MakeAgent = Callable[..., Awaitable[Any]]

# The owner: a store whose PeerTier notes the writer's region each
# placement reads (the name the placement message carries, which the pull
# then reads), and prints them when asked.
OWNER = textwrap.dedent('''
    import asyncio, json, sys
    import aioxfer
    from aioxfer import kv

    class Noting(kv.PeerTier):
        read_from = []

        async def _pull(self, head, body):
            self.read_from.append(head["region"])
            await super()._pull(head, body)

    async def main():
        bb = int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[1], peer_timeout=60.0) as agent:
            tier = Noting(group="kv20")
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(256 * bb), tier]):
                print(agent.address, flush=True)
                loop = asyncio.get_running_loop()
                while (await loop.run_in_executor(None, sys.stdin.readline)).strip():
                    print(json.dumps({"read_from": tier.read_from, "pulled": tier.pulled}),
                          flush=True)

    asyncio.run(main())
''')


class Owner:
    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc = proc
        self.address = address

    async def report(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"report\n")
        await self.proc.stdin.drain()
        line = await within(self.proc.stdout.readline())
        return dict(json.loads(line))

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"\n")
            try:
                await within(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_owner(tmp_path: Path, name: str) -> Owner:
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), name, str(BB), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd=str(tmp_path))
    assert proc.stdout is not None
    line = await within(proc.stdout.readline(), 60)
    assert line, "the owner did not start"
    return Owner(proc, line.decode().strip())


def keys_for(tag: bytes) -> list[bytes]:
    return kv.chain(np.arange(16 * N), block_tokens=16, namespace=b"kv20-" + tag)


async def warm_up(store: kv.Store, agent: Any) -> None:
    """A put that reaches the owner while it runs: the control connection to
    it is made (a placement to a stopped owner is then sent, not stuck in
    the connect), and the host tier is left empty (its blocks removed)."""
    warm = agent.alloc(N * BB, name="kv20-warm")
    keys = keys_for(b"warm")
    put = await within(store.put(keys, warm[0:N * BB]))
    assert put.stored == N, put
    await within(store.remove(keys))
    assert store._host is not None and not store._host.index


async def _placements_over(tier: kv.PeerTier, name: str) -> None:
    """Until every placement that timed out has been answered late (the
    owner pulled, verified and acknowledged it)."""
    await within(wait_until(lambda: not tier.members[name].late and not tier.members[name].silent,
                            what="the owner's late acknowledgements"))


async def test_src_is_not_read_after_a_put_that_timed_out(make_agent: MakeAgent,
                                                          tmp_path: Path) -> None:
    """The owner is stopped: the put returns after ack_wait with the blocks
    not stored (ack_timeout). The caller then overwrites src at once. The
    owner, continued, serves the placement: it reads store memory (a copy
    taken while the put ran), never src, and the blocks it stores are the
    ones put (before: it read src, whose new bytes failed their checksums,
    and stored nothing)."""
    owner = await start_owner(tmp_path, "kv20-owner-a")
    try:
        agent = await make_agent("kv20-writer-a", peer_timeout=60.0)
        tier = kv.PeerTier(group="kv20", ack_wait=0.5)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0), tier]) as store:
            assert await within(tier.join(owner.address))
            name = next(iter(tier.members))
            src = agent.alloc(N * BB, name="kv20-caller-src")
            data = pattern(N * BB, 1)
            src.numpy()[:] = data
            keys = keys_for(b"timeout")
            await warm_up(store, agent)
            sigstop(owner.proc.pid)
            put = await within(store.put(keys, src[0:N * BB]))
            # Blocks 0-1 fit the host tier; 2-7 overflowed to the stopped owner.
            assert put.tiers[2:] == (None,) * (N - 2), put
            assert store.statistics().tiers["peer"].dropped_stores.get("ack_timeout", 0) > 0
            src.numpy()[:] = pattern(N * BB, 2)  # reused at once
            owner.proc.send_signal(signal.SIGCONT)
            await _placements_over(tier, name)
            rep = await owner.report()
            assert src.name not in rep["read_from"], rep
            dst = agent.alloc((N - 2) * BB)
            got = await within(store.get(keys[2:], dst[0:(N - 2) * BB]))
            assert got.prefix == N - 2, (got, rep)
            assert np.array_equal(dst.numpy(), data[2 * BB:])
    finally:
        await owner.stop()


async def test_src_is_not_read_after_a_cancelled_put(make_agent: MakeAgent,
                                                     tmp_path: Path) -> None:
    """The owner is stopped while the put waits for its acknowledgement; the
    put is cancelled, and once its CancelledError is raised the caller
    overwrites src. The owner, continued, never reads src (before: it did,
    after the put had raised)."""
    owner = await start_owner(tmp_path, "kv20-owner-b")
    try:
        agent = await make_agent("kv20-writer-b", peer_timeout=60.0)
        tier = kv.PeerTier(group="kv20", ack_wait=5.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0), tier]) as store:
            assert await within(tier.join(owner.address))
            name = next(iter(tier.members))
            src = agent.alloc(N * BB, name="kv20-caller-src")
            src.numpy()[:] = pattern(N * BB, 3)
            await warm_up(store, agent)
            sigstop(owner.proc.pid)
            task = asyncio.ensure_future(store.put(keys_for(b"cancel"), src[0:N * BB]))
            # Until its placement waits for the owner's acknowledgement.
            await within(wait_until(lambda: bool(tier.members[name].waiting),
                                    what="a placement sent"))
            task.cancel()
            try:
                await within(task)
                raise AssertionError("the put was not cancelled")
            except asyncio.CancelledError:
                pass
            src.numpy()[:] = pattern(N * BB, 4)  # reused at once
            owner.proc.send_signal(signal.SIGCONT)
            # The owner serves what it was sent (the put's placement: the
            # host tier writes blocks 0-1 back only at the close).
            async def pulled() -> dict[str, Any]:
                for _ in range(200):
                    rep = await owner.report()
                    if len(rep["read_from"]) > 1:  # (the first: the warm-up's)
                        return rep
                    await asyncio.sleep(0.02)
                raise AssertionError("the owner served no placement")
            rep = await within(pulled())
            assert src.name not in rep["read_from"], rep
    finally:
        await owner.stop()

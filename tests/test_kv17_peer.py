"""rev17's PeerTier findings, with real agents: a put and a member's
placement storing one key at once (the host tier lost the first slot for
good), Store.remove with a PeerTier (NotImplementedError), and placements to
a member killed with SIGKILL ("Future exception was never retrieved")."""

from __future__ import annotations

import asyncio
import gc
import random
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import wait_until, within

from aioxfer import kv

BB = 64 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(lo: int, n: int, ns: bytes = b"kv17") -> list[bytes]:
    return kv.chain(np.arange(16 * lo, 16 * (lo + n)), block_tokens=16, namespace=ns)


def lost_slots(host: kv.HostTier) -> list[int]:
    used = set(host.free) | set(host.index.values())
    return [s for s in range(host.n_slots) if s not in used]


async def test_put_racing_a_members_placement_of_the_same_keys_keeps_every_slot(
        make_agent: MakeAgent) -> None:
    """B places blocks on A (PeerTier._write: A pulls them into its host
    tier) while A puts the same keys: both fill a slot for one key. Before,
    the second HostTier.insert overwrote index[key] and the first slot was
    neither free nor indexed for good (56 of 64 slots after 300 rounds):
    now the later one goes back, the put counts it stored, the block reads
    back right and every slot is free or indexed."""
    a = await make_agent("dup-a")
    b = await make_agent("dup-b")
    n = 8
    ta, tb = kv.PeerTier(group="dup"), kv.PeerTier(group="dup")
    host = kv.HostTier(64 * BB)
    async with kv.Store.open(a, block_bytes=BB, tiers=[host, ta]) as sa, \
            kv.Store.open(b, block_bytes=BB, tiers=[kv.HostTier(64 * BB), tb]):
        assert await within(ta.join(b.address))
        assert await within(tb.join(a.address))
        srca, srcb = a.alloc(n * BB), b.alloc(n * BB)
        dst = a.alloc(n * BB)
        rng = random.Random(1)
        for rnd in range(80):
            keys = keys_for(rnd * n, n)
            data = np.frombuffer(rng.randbytes(n * BB), dtype=np.uint8)
            srca.numpy()[:] = data
            srcb.numpy()[:] = data
            place = asyncio.ensure_future(tb._write(keys, [srcb] * n, [i * BB for i in range(n)]))
            for _ in range(rng.randrange(0, 6)):
                await asyncio.sleep(0)
            res = await within(sa.put(keys, srca[0:n * BB]))
            assert res.stored + res.present == n and res.dropped == 0, res
            await within(place)
            if rnd % 10 == 0:
                got = await within(sa.get(keys, dst[0:n * BB]))
                assert got.prefix == n and np.array_equal(dst.numpy(), data)
        async def settled() -> bool:  # no pull, put or demotion under way
            return not host.demoting and not ta._pulling and sa.statistics().pins == 0
        for _ in range(200):
            if await settled():
                break
            await asyncio.sleep(0.01)
        assert not lost_slots(host), (
            f"{len(lost_slots(host))} of {host.n_slots} host slots neither free nor indexed")
        assert host.n_slots == len(host.free) + len(host.index)


async def test_host_insert_of_a_key_held_in_another_slot_gives_that_slot_back(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """HostTier.insert is the one place every writer publishes through: a
    second insert of one key (any caller) gives its slot back and keeps the
    first, marked to be written back when the second was."""
    agent = await make_agent("dup-host")
    host = kv.HostTier(4 * BB)
    disk = kv.DiskTier(tmp_path / "kv", 8 * BB, segment_bytes=4 * BB)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[host, disk]):
        key = keys_for(0, 1)[0]
        s1, s2 = host.take_free(2)
        assert host.insert(key, s1, dirty=False)
        assert not host.insert(key, s2, dirty=True)
        assert host.index[key] == s1 and s2 in host.free
        assert s1 in host.dirty  # the second writer's copy was to go below
        assert host.n_slots == len(host.free) + len(host.index)


async def test_remove_with_a_peer_tier_reaches_the_tiers_below(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """Store.remove on host + PeerTier + disk, the blocks in host memory and
    on disk: it returns (before: NotImplementedError out of PeerTier, after
    the host tier had dropped them) and the disk copies are gone too, also
    after a restart."""
    agent = await make_agent("rm-peer", listen="127.0.0.1:0")
    bb = 16 << 10
    keys = keys_for(0, 4, b"kv17-rm")
    path = tmp_path / "kv"
    disk = kv.DiskTier(path, 64 * bb, segment_bytes=8 * bb)
    async with kv.Store.open(agent, block_bytes=bb, tiers=[
            kv.HostTier(16 * bb), kv.PeerTier(group="rm"), disk]) as store:
        src = agent.alloc(4 * bb)
        res = await within(store.put(keys, src[0:4 * bb]))
        assert res.stored == 4
        # On disk too (as after a demotion or a restart).
        assert all(await within(disk._write(keys, [src] * 4, [i * bb for i in range(4)],
                                            durable=True)))
        assert (await within(store.lookup(keys))).tiers == ("host",) * 4
        assert await within(store.remove(keys)) == 8
        assert (await within(store.lookup(keys))).prefix == 0
        assert not disk.index
    disk2 = kv.DiskTier(path, 64 * bb, segment_bytes=8 * bb)
    async with kv.Store.open(agent, block_bytes=bb, tiers=[disk2]) as store:
        assert (await within(store.lookup(keys))).prefix == 0


MEMBER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        async with aioxfer.Agent(sys.argv[1]) as agent:
            async with kv.Store.open(agent, block_bytes=int(sys.argv[2]), tiers=[
                    kv.HostTier(64 * int(sys.argv[2])), kv.PeerTier(group="lost")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def start_member(script: Path, name: str, bb: int) -> tuple[Any, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), name, str(bb), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.stdout is not None
    address = (await within(proc.stdout.readline(), 60)).decode().strip()
    assert address, "the member did not start"
    return proc, address


async def test_placement_to_a_replaced_then_killed_member_leaves_no_stray_exception(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A placement's notification to a member (a real process, stopped: it
    neither takes nor answers it) is in flight when a new incarnation of
    that member joins: the old one's waiting future fails (PeerLost, "was
    replaced") while the placement still awaits the notification; the old
    process is then killed (SIGKILL) and the notification fails. Before,
    nobody retrieved the future's PeerLost: asyncio reported "Future
    exception was never retrieved" (a loop exception-handler call; rev17
    saw it in its kill -9 chaos run)."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    bb = 16 << 10
    procs: list[Any] = []
    try:
        proc, address = await start_member(script, "kv17-lost", bb)
        procs.append(proc)
        agent = await make_agent("kv17-placer", peer_timeout=30.0)
        calls: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        fixture_handler = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, ctx: calls.append(ctx))
        tier = kv.PeerTier(group="lost", ack_wait=30.0, ack_timeout=30.0)
        try:
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(16 * bb), tier]):
                assert await within(tier.join(address))
                m = tier.members["kv17-lost"]
                src = agent.alloc(8 * bb)
                keys = keys_for(0, 16, b"kv17-lost")
                # One answered first: the control connection to it is up.
                assert all(await within(tier._write(keys[8:], [src] * 8,
                                                    [i * bb for i in range(8)])))
                proc.send_signal(signal.SIGSTOP)
                stat = Path(f"/proc/{proc.pid}/stat")
                for _ in range(500):  # stopped before the notification goes
                    if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
                        break
                    await asyncio.sleep(0.01)
                place = asyncio.ensure_future(
                    tier._write(keys[:8], [src] * 8, [i * bb for i in range(8)]))
                for _ in range(500):
                    if m.waiting:
                        break
                    await asyncio.sleep(0.01)
                assert m.waiting, "no placement waits for the member"
                proc2, address2 = await start_member(script, "kv17-lost", bb)
                procs.append(proc2)
                # (kv31: refused while the stopped one lives, joined once it is gone)
                assert not await within(tier.join(address2))
                assert tier.members["kv17-lost"] is m
                proc.kill()
                assert not any(await within(place, 30))
                await within(wait_until(
                    lambda: "kv17-lost" in tier.members
                    and tier.members["kv17-lost"].peer.address == address2,
                    what="the new incarnation's join"))
                del m, place
                gc.collect()
                await asyncio.sleep(0.1)
                gc.collect()
        finally:
            loop.set_exception_handler(fixture_handler)
        assert not calls, f"loop exception handler called: {calls!r}"
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
            await p.wait()

"""aioxfer.kv PeerTier with a real second process: blocks placed on their
rendezvous-hash owner (which pulls them one-sided from the writer's memory),
read back one-sided from the owner's host tier, verified; the owner killed:
its blocks become misses, nothing fails or hangs."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import cancel_after, pattern, wait_until, within

from aioxfer import kv
from aioxfer.kv.peer import owners

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]

MEMBER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        async with aioxfer.Agent(sys.argv[1], peer_timeout=1.0, keepalive=0.2) as agent:
            async with kv.Store.open(agent, block_bytes=int(sys.argv[2]), tiers=[
                    kv.HostTier(256 * int(sys.argv[2])), kv.PeerTier(group="t")]) as store:
                print(agent.address, flush=True)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, sys.stdin.readline)
                tier = store.tiers[1]
                print("pulled", tier.pulled, flush=True)

    asyncio.run(main())
''')


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"peer-test")


async def start_member(tmp_path: Path, name: str) -> tuple[asyncio.subprocess.Process, str]:
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), name, str(BB), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = await within(proc.stdout.readline(), 60)
    assert line, "the member did not start"
    return proc, line.decode().strip()


async def test_blocks_placed_on_owner_and_read_back_then_owner_killed(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    proc, address = await start_member(tmp_path, "member-b")
    try:
        agent = await make_agent("member-a", peer_timeout=1.0, keepalive=0.2)
        src = agent.alloc(32 * BB)
        data = pattern(32 * BB, 1)
        src.numpy()[:] = data
        keys = keys_for(32)
        peer_tier = kv.PeerTier(group="t")
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(8 * BB), peer_tier]) as store:
            assert await within(peer_tier.join(address))
            assert list(peer_tier.members) == ["member-b"]
            # placement is the same computation everywhere: two members, one replica
            assert owners(keys[0], ["member-a", "member-b"], 1)[0] in ("member-a", "member-b")
            put = await within(store.put(keys, src[0:32 * BB]))
            assert put.stored == 32 and put.dropped == 0, put
            hit = await within(store.lookup(keys))
            assert hit.prefix == 32, hit
            assert "peer" in hit.tiers  # most blocks live only on the other process
            dst = agent.alloc(32 * BB)
            res = await within(store.get(keys, dst[0:32 * BB]))
            assert res.prefix == 32 and res.failed == ()
            assert np.array_equal(dst.numpy(), data)
            from_peer = [i for i, t in enumerate(res.tiers) if t == "peer"]
            assert len(from_peer) >= 16

            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            # right after the kill: verified hits or misses, never wrong bytes or a hang
            res = await within(store.get(keys, dst[0:32 * BB]))
            assert res.failed == ()
            assert np.array_equal(dst.numpy()[:res.prefix * BB], data[:res.prefix * BB])
            # once it is known gone, its blocks are plain misses
            await within(wait_until(lambda: not peer_tier.members, what="member left"))
            res = await within(store.get(keys, dst[0:32 * BB]))
            assert res.failed == () and res.prefix < 32
            assert all(t in ("host", None) for t in res.tiers)
            assert store.statistics().pins == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_owner_pulls_and_reports(make_agent: MakeAgent, tmp_path: Path) -> None:
    proc, address = await start_member(tmp_path, "member-c")
    try:
        agent = await make_agent("member-d")
        src = agent.alloc(16 * BB)
        src.numpy()[:] = pattern(16 * BB, 2)
        keys = keys_for(16)
        tier = kv.PeerTier(group="t")
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(4 * BB), tier]) as st:
            await within(tier.join(address))
            await within(st.put(keys, src[0:16 * BB]))
            assert st.statistics().tiers["peer"].puts >= 12
        assert proc.stdin is not None
        proc.stdin.write(b"done\n")
        await proc.stdin.drain()
        assert proc.stdout is not None
        line = await within(proc.stdout.readline(), 30)
        assert line.startswith(b"pulled") and int(line.split()[1]) >= 12, line
        await within(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_concurrent_probes_each_find_their_own_blocks(make_agent: MakeAgent,
                                                            tmp_path: Path) -> None:
    """Two lookups probing the same member at once: each reads that member's
    index buckets for its own keys and finds every block placed there (the
    tier's probe buffer is not refilled by one while the other reads it)."""
    proc, address = await start_member(tmp_path, "member-e")
    try:
        # Over TCP: a probe's read completes on the engine's threads, not
        # inside its await, so the two probes' reads are in flight together.
        agent = await make_agent("member-f", transports=("tcp",), inline_bytes=0)
        n = 32
        src = agent.alloc(n * BB)
        src.numpy()[:] = pattern(n * BB, 3)
        keys = keys_for(n)
        tier = kv.PeerTier(group="t")
        # (no write-back: four blocks stay in host memory, the rest go to
        # the member, all before put returns)
        host = kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[host, tier]) as st:
            await within(tier.join(address))
            put = await within(st.put(keys, src[0:n * BB]))
            assert put.stored == n and put.dropped == 0, put
            for _ in range(3):
                tier.located.clear()  # as in a fresh process: every get probes
                a, b = await within(asyncio.gather(st.lookup(keys[:n // 2]),
                                                   st.lookup(keys[n // 2:])))
                assert (a.prefix, b.prefix) == (n // 2, n // 2), (a, b)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def bad_metas(pool: str, index: str) -> list[bytes]:
    """Published metas a broken (or hostile) member might show."""
    ok = {"v": 1, "ctl": "127.0.0.1:1", "address": "127.0.0.1:1", "pool": pool,
          "index": index, "buckets": 4, "block_bytes": BB}
    return [b"\xff\xfe\x00not json", b"{\"block", b"[1]", b"\"text\"",
            json.dumps({"block_bytes": BB}).encode(),
            json.dumps({**ok, "pool": "no-such-region"}).encode(),
            json.dumps({**ok, "buckets": "4"}).encode(),
            json.dumps({**ok, "buckets": 3}).encode(),
            json.dumps({**ok, "buckets": 0}).encode(),
            json.dumps({**ok, "buckets": 1 << 40}).encode(),  # past its index region
            json.dumps({**ok, "ctl": 7}).encode()]


async def test_broken_peers_are_no_members_and_hostile_requests_are_dropped(
        make_agent: MakeAgent) -> None:
    """Members whose published meta is unreadable (not JSON, not an object,
    missing or mistyped fields, a geometry past their index region) are no
    members: Store.open with one as a seed opens, join() says False, never a
    ValueError (before: ValueError out of open and join, AttributeError and
    TypeError out of the membership follower). Control messages that are
    not well-formed requests are dropped, and the tier still serves a good
    member's placements after them (before: one ``[1]`` ended its serving
    loop, and every later placement waited out its ack and was dropped)."""
    bads = []
    for i in range(len(bad_metas("", ""))):
        bad = await make_agent(f"broken{i}")
        bad.alloc(16 * BB, name="pool")
        bad.alloc(4 * 4 * 64, name="kvpeer.t.index")
        raw = bad_metas("pool", "kvpeer.t.index")[i]
        meta = bad.alloc(4096, name="kvpeer.t.meta")
        meta.numpy()[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        bads.append(bad)
    agent = await make_agent("member-g")
    tier = kv.PeerTier(group="t", seeds=[bads[0].address, bads[2].address])
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(64 * BB), tier]):
        for bad in bads:
            assert not await within(tier.join(bad.address)), bad.name
        assert not tier.members
        assert tier.ctl is not None
        ctl = await within(bads[0].connect(tier.ctl.address))
        for head in [b"[1]", b"\"x\"", b"{\"op\": \"ack\", \"req\": \"x\"}",
                     b"{\"op\": \"ack\", \"req\": [1]}", b"{\"op\": \"put\", \"req\": 1}",
                     json.dumps({"op": "put", "req": 2, "from": 5, "ctl": "",
                                 "region": "r"}).encode(),
                     json.dumps({"op": "put", "req": 3, "from": "nowhere", "ctl": "nowhere",
                                 "region": "pool"}).encode()]:
            await within(ctl.notify(len(head).to_bytes(2, "little") + head + bytes(48)))
        # A good member places blocks here after all that.
        agent2 = await make_agent("member-h")
        src = agent2.alloc(16 * BB)
        src.numpy()[:] = pattern(16 * BB, 5)
        keys = keys_for(16)
        tier2 = kv.PeerTier(group="t")
        async with kv.Store.open(agent2, block_bytes=BB, tiers=[
                kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0), tier2]) as st2:
            assert await within(tier2.join(agent.address))
            put = await within(st2.put(keys, src[0:16 * BB]))
            assert put.stored == 16 and put.dropped == 0, put
            assert tier.pulled == 12


async def test_member_index_pointing_past_its_pool_is_a_miss(make_agent: MakeAgent) -> None:
    """A member whose published index (intact entries, checks right) points
    at slots past the end of its pool: a get of those keys is a miss
    (before: the pool's IndexError reached the store's bug guard, and every
    block read from that member in the batch failed BlockUnavailable), and
    nothing is left pinned."""
    keys = keys_for(4)
    bad = await make_agent("broken-idx")
    pool = bad.alloc(4 * BB, name="pool")
    idx = bad.alloc(4 * 4 * 64, name="kvpeer.t.index")
    from aioxfer.kv.peer import PeerIndex
    index = PeerIndex(idx, 4)
    for i, k in enumerate(keys):
        index.add(k, [1 << 20, 4, 3, 2][i], 0)  # slot 3 is in range: its CRC is wrong
    raw = json.dumps({"v": 1, "ctl": "127.0.0.1:1", "address": bad.address, "pool": pool.name,
                      "index": "kvpeer.t.index", "buckets": 4, "block_bytes": BB}).encode()
    meta = bad.alloc(4096, name="kvpeer.t.meta")
    meta.numpy()[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    agent = await make_agent("member-i")
    tier = kv.PeerTier(group="t")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]) as st:
        assert await within(tier.join(bad.address))
        dst = agent.alloc(4 * BB)
        for k in range(4):
            res = await within(st.get(keys[k:k + 1], dst[0:BB]))
            assert res.prefix == 0 and res.failed == (), res
        assert st.statistics().pins == 0


async def test_placement_with_offsets_past_the_senders_region(make_agent: MakeAgent) -> None:
    """A member asks us to pull blocks from offsets past the end of its
    region (broken or hostile): nothing is stored, the host slots taken for
    them come back (before: the read's IndexError left them taken for good,
    the host tier short of that room), and it is told so (an ack of zeros)."""
    sender = await make_agent("sender")
    src = sender.alloc(4 * BB, name="src")
    agent = await make_agent("member-j")
    host = kv.HostTier(8 * BB)
    tier = kv.PeerTier(group="t")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[host, tier]):
        assert tier.ctl is not None
        ctl = await within(sender.connect(tier.ctl.address))
        keys = keys_for(2)
        head = json.dumps({"op": "put", "req": 1, "from": sender.address,
                           "ctl": sender.address, "region": src.name}).encode()
        body = b"".join(k + off.to_bytes(8, "little") + bytes(8)
                        for k, off in zip(keys, [0, 1 << 40], strict=True))
        await within(ctl.notify(len(head).to_bytes(2, "little") + head + body))
        note = await within(anext(aiter(sender.notifications)))
        p = note.payload
        n = int.from_bytes(p[:2], "little")
        assert json.loads(p[2:2 + n]) == {"op": "ack", "req": 1}
        assert bytes(p[2 + n:]) == b"\x00\x00"
        assert len(host.free) == host.n_slots and not host.index


async def test_store_with_a_peer_tier_closed_under_cancellation(make_agent: MakeAgent) -> None:
    """Store.aclose() of a store with a PeerTier cancelled after 1, 2, 3, ...
    loop turns: whatever the point, the close finishes what it started
    (the cancel is raised after): the tier's control agent is closed, its
    published regions and the host tier's memory are released, the host
    tier no longer publishes (before: the close stopped at the await the
    cancel hit, leaving all that behind; the next store of the group could
    not even register its regions)."""
    agent = await make_agent("member-k")
    finished = 0
    for turns in range(1, 400):  # (0: cancelled before it began, nothing to finish)
        tier = kv.PeerTier(group="t")
        host = kv.HostTier(8 * BB)
        store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[host, tier]))
        assert tier.ctl is not None and tier.stage is not None and tier.index is not None
        ctl, regions = tier.ctl, [tier.stage, tier.index.region, tier.meta_region]
        finished += await cancel_after(store.aclose(), turns)
        assert store.closed, turns
        assert ctl.closed, turns
        assert all(r is not None and r.closed for r in regions), turns
        assert host.region is not None and host.region.closed, turns
        assert host.published is None, turns
        if finished >= 2:
            break
    assert finished >= 2


async def test_a_flood_of_placements_starts_bounded_pulls(make_agent: MakeAgent) -> None:
    """A peer floods the tier with 200 placement requests whose ``from`` is a
    socket that accepts and never answers (each pull hangs connecting):
    only max_pulls_per_peer of them are pulled at once, the rest refused and
    counted (before: one task each, 200 pulls hanging); a good member's
    placements beside the flood are still pulled and stored."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(256)
    nowhere = f"127.0.0.1:{silent.getsockname()[1]}"
    flooder = await make_agent("flooder")
    src = flooder.alloc(4 * BB, name="src")
    agent = await make_agent("member-l")
    tier = kv.PeerTier(group="t", max_pulls=8, max_pulls_per_peer=2)
    try:
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(64 * BB), tier]):
            assert tier.ctl is not None
            ctl = await within(flooder.connect(tier.ctl.address))
            body = b"".join(k + bytes(16) for k in keys_for(64))
            n = 200
            for req in range(n):
                head = json.dumps({"op": "put", "req": req, "from": nowhere, "ctl": nowhere,
                                   "region": src.name}).encode()
                await within(ctl.notify(len(head).to_bytes(2, "little") + head + body))
            def served() -> int:  # refused or pulling (before the limits: a task each)
                ext = tier._extra()
                return int(ext.get("pulls_refused", 0)) + int(ext.get("pulls_in_flight",
                                                                      len(tier._tasks) - 2))

            await wait_until(lambda: served() >= n, what="the flood served")
            # serve loop, membership follower, 2 pulls, at most max_pulls refusals acking
            assert len(tier._tasks) <= 2 + 2 + 8, len(tier._tasks)
            ext = tier._extra()
            assert ext["pulls_in_flight"] == 2 and ext["pulls_refused"] == n - 2
            st = tier._statistics()
            assert st.dropped_stores.get("pull_refused") == (n - 2) * 64
            # A good member places blocks here while the flood's pulls hang.
            agent2 = await make_agent("member-m")
            src2 = agent2.alloc(16 * BB)
            src2.numpy()[:] = pattern(16 * BB, 6)
            tier2 = kv.PeerTier(group="t")
            async with kv.Store.open(agent2, block_bytes=BB, tiers=[
                    kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0), tier2]) as st2:
                assert await within(tier2.join(agent.address))
                put = await within(st2.put(keys_for(16), src2[0:16 * BB]))
                assert put.stored == 16 and put.dropped == 0, put
                assert tier.pulled == 12
    finally:
        silent.close()


def fake_member(agent: Any, ctl_address: str) -> None:
    """Publishes on ``agent`` what a member of group "t" publishes, with its
    control agent at ``ctl_address`` (one the test drives by hand)."""
    pool = agent.alloc(16 * BB, name="pool")
    agent.alloc(4 * 4 * 64, name="kvpeer.t.index")
    raw = json.dumps({"v": 1, "ctl": ctl_address, "address": agent.address, "pool": pool.name,
                      "index": "kvpeer.t.index", "buckets": 4, "block_bytes": BB}).encode()
    meta = agent.alloc(4096, name="kvpeer.t.meta")
    meta.numpy()[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)


def ack_of(req: int, bitmap: bytes) -> bytes:
    head = json.dumps({"op": "ack", "req": req}).encode()
    return len(head).to_bytes(2, "little") + head + bitmap


async def test_acks_count_only_from_the_member_asked(make_agent: MakeAgent) -> None:
    """A placement sent to member B is acknowledged by another member (C,
    hostile: it claims B stored everything) before B's own ack (nothing
    stored) arrives: C's claim is ignored, B's answer counts (before: acks
    were matched by request number alone, so C's forged ack made the writer
    count the blocks as stored on B and drop them from its memory). An ack
    from B whose bitmap is not one byte 0/1 per block claims nothing."""
    b = await make_agent("fake-b")
    b_ctl = await make_agent("fake-b.kvctl")
    fake_member(b, b_ctl.address)
    evil = await make_agent("evil-c")
    agent = await make_agent("member-n")
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 7)
    keys = keys_for(8)
    tier = kv.PeerTier(group="t")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
        assert await within(tier.join(b.address))
        assert tier.ctl is not None
        forger = await within(evil.connect(tier.ctl.address))
        for answer in [b"\x00" * 8, b"\x01" * 7, b"\x02" * 8, b"\x01" * 9]:
            writing = asyncio.ensure_future(tier._write(keys, [src] * 8,
                                                        [i * BB for i in range(8)]))
            note = await within(anext(aiter(b_ctl.notifications)))
            p = note.payload
            head = json.loads(p[2:2 + int.from_bytes(p[:2], "little")])
            assert head["op"] == "put" and len(p) - 2 - int.from_bytes(p[:2], "little") == 8 * 48
            await within(forger.notify(ack_of(head["req"], b"\x01" * 8)))
            await asyncio.sleep(0.05)  # the forged ack is served first
            back = await within(b_ctl.connect(head["ctl"]))
            await within(back.notify(ack_of(head["req"], answer)))
            assert await within(writing) == [False] * 8, answer


async def test_a_stopped_member_does_not_hold_up_placements(make_agent: MakeAgent,
                                                            tmp_path: Path) -> None:
    """Member C (a real process) is SIGSTOPped (its agent is not yet known
    lost: the writer's peer timeout is long): puts whose blocks overflow to
    the peer tier return within the tier's ack_wait, the blocks owned by the
    healthy member B are stored there, C's are dropped and counted, and
    once C is known silent later placements do not wait for it at all
    (before: every placement waited 10 s for C's ack, and the put with it).
    C continued: its late acknowledgement makes it a target again."""
    proc_b, addr_b = await start_member(tmp_path, "member-b2")
    proc_c, addr_c = await start_member(tmp_path, "member-c2")
    try:
        agent = await make_agent("member-a2", peer_timeout=60.0)
        n = 32
        src = agent.alloc(n * BB)
        src.numpy()[:] = pattern(n * BB, 8)
        tier = kv.PeerTier(group="t", ack_wait=0.5)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0), tier]) as store:
            assert await within(tier.join(addr_b)) and await within(tier.join(addr_c))
            names = tier.member_names()
            keys = kv.chain(np.arange(10**7, 10**7 + 16 * n), block_tokens=16, namespace=b"s")
            put = await within(store.put(keys, src[0:n * BB]))  # both answer
            assert put.dropped == 0, put
            proc_c.send_signal(signal.SIGSTOP)
            stored_b = 0
            async with asyncio.timeout(5):  # one 10 s ack wait fails it
                for r in range(3):
                    keys = kv.chain(np.arange(16 * n * r, 16 * n * (r + 1)), block_tokens=16,
                                    namespace=b"stop")
                    put = await store.put(keys, src[0:n * BB])
                    to_b = [i for i, k in enumerate(keys)
                            if [o for o in owners(k, names, 2) if o != agent.name][0]
                            == "member-b2"]
                    got = [i for i, t in enumerate(put.tiers) if t == "peer"]
                    assert set(to_b) - {0, 1} <= set(got), (r, to_b, got)  # (0, 1: host)
                    assert not set(got) - set(to_b), (r, got)
                    stored_b += len(got)
            st = store.statistics().tiers["peer"]
            assert st.dropped_stores.get("peer_stalled", 0) > 0, st.dropped_stores
            assert stored_b > 0
            proc_c.send_signal(signal.SIGCONT)
            await within(wait_until(lambda: not tier.members["member-c2"].silent,
                                    what="C heard from again"))
            keys = kv.chain(np.arange(10**6, 10**6 + 16 * n), block_tokens=16, namespace=b"s")
            put = await within(store.put(keys, src[0:n * BB]))
            assert put.dropped == 0, put
    finally:
        for proc in (proc_b, proc_c):
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()



async def test_refused_placements_do_not_evict_clean_blocks(make_agent: MakeAgent) -> None:
    """A member whose host tier is full of clean blocks (placed there by a
    peer) is sent a placement whose blocks fail their checksums (a broken or
    hostile sender): nothing is stored and the blocks it held are all still
    there (before: room was made by evicting them before the pulled bytes
    were verified). A good placement after it still gets room."""
    from aioxfer.kv import checksum as ck
    sender = await make_agent("sender2")
    src = sender.alloc(8 * BB, name="src")
    data = pattern(8 * BB, 11)
    src.numpy()[:] = data
    agent = await make_agent("member-p")
    host = kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0)
    tier = kv.PeerTier(group="t")
    keys = keys_for(12)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[host, tier]) as store:
        assert tier.ctl is not None
        ctl = await within(sender.connect(tier.ctl.address))
        notes = aiter(sender.notifications)

        async def place(req: int, ks: list[bytes], blocks: list[int], crc_ok: bool) -> bytes:
            head = json.dumps({"op": "put", "req": req, "from": sender.address,
                               "ctl": sender.address, "region": src.name}).encode()
            body = b"".join(
                k + (b * BB).to_bytes(8, "little")
                + ((ck.checksum(data[b * BB:(b + 1) * BB]) ^ (0 if crc_ok else 1))
                   .to_bytes(4, "little")) + ck.ALGO.to_bytes(4, "little")
                for k, b in zip(ks, blocks, strict=True))
            await within(ctl.notify(len(head).to_bytes(2, "little") + head + body))
            p = (await within(anext(notes))).payload
            n = int.from_bytes(p[:2], "little")
            assert json.loads(p[2:2 + n])["req"] == req
            return bytes(p[2 + n:])

        assert await place(1, keys[:4], [0, 1, 2, 3], True) == b"\x01" * 4
        assert set(host.index) == set(keys[:4]) and not host.dirty
        assert await place(2, keys[4:8], [4, 5, 6, 7], False) == b"\x00" * 4
        assert set(host.index) == set(keys[:4]), "refused blocks evicted clean ones"
        dst = agent.alloc(4 * BB)
        res = await within(store.get(keys[:4], dst[0:4 * BB]))
        assert res.prefix == 4 and np.array_equal(dst.numpy(), data[:4 * BB])
        assert await place(3, keys[8:10], [4, 5], True) == b"\x01" * 2
        assert keys[8] in host.index and keys[9] in host.index
        res = await within(store.get(keys[8:10], dst[0:2 * BB]))
        assert res.prefix == 2 and np.array_equal(dst.numpy()[:2 * BB], data[4 * BB:6 * BB])
        assert store.statistics().pins == 0 and len(host.index) == 4


async def test_store_close_with_a_stopped_member_is_bounded(make_agent: MakeAgent,
                                                            tmp_path: Path) -> None:
    """A same-host member that maps this store's memory is SIGSTOPped: it
    holds that memory until it exits (the agent keeps it pinned meanwhile),
    but Store.aclose() returns within a bound of the agent's close_timeout a
    region and a caller's deadline around it works (before: it waited for the
    member to exit, a cancel or timeout could not end it: a hang)."""
    import aioxfer
    proc, address = await start_member(tmp_path, "member-s")
    try:
        agent = await make_agent("member-t", peer_timeout=60.0,
                                 limits=aioxfer.Limits(close_timeout=0.5))
        src = agent.alloc(16 * BB)
        src.numpy()[:] = pattern(16 * BB, 21)
        tier = kv.PeerTier(group="t")
        store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0), tier]))
        assert await within(tier.join(address))
        put = await within(store.put(keys_for(16), src[0:16 * BB]))
        assert put.dropped == 0, put
        proc.send_signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with asyncio.timeout(10):
            await store.aclose()
        assert store.closed and loop.time() - t0 < 10
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()


READER = textwrap.dedent('''
    import asyncio, sys
    import numpy as np
    import aioxfer
    from aioxfer import kv

    async def main():
        bb = int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[1], peer_timeout=60.0) as agent:
            tier = kv.PeerTier(group="t")
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(64 * bb), tier]) as store:
                print(agent.address, flush=True)
                loop = asyncio.get_running_loop()
                address = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
                await tier.join(address)            # reads the writer's meta region
                keys = kv.chain(np.arange(16 * 16), block_tokens=16, namespace=b"peer-test")
                dst = agent.alloc(16 * bb)
                res = await store.get(keys, dst[0:16 * bb])  # its index, then its pool
                print("got", res.prefix, flush=True)
                await loop.run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def _start_reader(tmp_path: Path, name: str) -> asyncio.subprocess.Process:
    """A same-host member running READER as agent ``name`` (pipes: stdin
    and stdout)."""
    script = tmp_path / "reader.py"
    script.write_text(READER)
    return await asyncio.create_subprocess_exec(
        sys.executable, str(script), name, str(BB), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).parent.parent))


class _TimedPeerTier(kv.PeerTier):
    """A PeerTier whose close is timed (the part of Store.aclose it takes)."""

    close_took: float | None = None

    async def _aclose(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await super()._aclose()
        finally:
            self.close_took = loop.time() - t0


async def test_peer_tier_close_waits_once_for_a_stopped_member(make_agent: MakeAgent,
                                                               tmp_path: Path) -> None:
    """A same-host member that read this tier's meta and index regions and the
    store's pool is SIGSTOPped (it then maps all four of the tier's regions):
    each release waits close_timeout, and the tier's close starts its
    deregistrations together and waits once: one close_timeout, not one per
    region (before: one after another, 4 x close_timeout, 8 s here)."""
    import aioxfer
    proc = await _start_reader(tmp_path, "member-r")
    assert proc.stdout is not None and proc.stdin is not None
    bound = 2.0
    try:
        address = (await within(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the member did not start"
        agent = await make_agent("member-w", peer_timeout=60.0,
                                 limits=aioxfer.Limits(close_timeout=bound))
        src = agent.alloc(16 * BB)
        src.numpy()[:] = pattern(16 * BB, 22)
        tier = _TimedPeerTier(group="t")
        store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(64 * BB), tier]))
        try:
            assert (await within(store.put(keys_for(16), src[0:16 * BB]))).stored == 16
            proc.stdin.write(agent.address.encode() + b"\n")
            await proc.stdin.drain()
            line = await within(proc.stdout.readline(), 30)
            assert line.split() == [b"got", b"16"], line  # it read the index and the pool
            proc.send_signal(signal.SIGSTOP)
        finally:
            async with asyncio.timeout(8 * bound):
                await store.aclose()
        assert tier.close_took is not None
        assert tier.close_took < 1.6 * bound, tier.close_took
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()


async def test_store_reopened_while_a_stopped_member_holds_the_old_one(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A store closed while a SIGSTOPped same-host member still maps its
    memory (kept pinned by the agent until that member lets go) is opened
    again in the same agent under the same names (kv.host, kv.staging,
    kvpeer.t.*): it opens and works while the old memory waits."""
    import aioxfer
    proc = await _start_reader(tmp_path, "member-q")
    assert proc.stdout is not None and proc.stdin is not None
    try:
        address = (await within(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the member did not start"
        agent = await make_agent("member-v", peer_timeout=60.0,
                                 limits=aioxfer.Limits(close_timeout=0.5))
        src = agent.alloc(16 * BB)
        data = pattern(16 * BB, 23)
        src.numpy()[:] = data
        store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(64 * BB), kv.PeerTier(group="t")]))
        try:
            assert (await within(store.put(keys_for(16), src[0:16 * BB]))).stored == 16
            proc.stdin.write(agent.address.encode() + b"\n")
            await proc.stdin.drain()
            line = await within(proc.stdout.readline(), 30)
            assert line.split() == [b"got", b"16"], line
            proc.send_signal(signal.SIGSTOP)
        finally:
            old = {r.name: r for r in agent.regions if r.name.startswith("kv")}
            await within(store.aclose())
        # Still pinned for the stopped member (deregister: the same awaitable).
        assert old.keys() >= {"kv.host", "kvpeer.t.meta", "kvpeer.t.index"}, old
        releases = [agent.deregister(r) for r in old.values()]
        assert all(isinstance(f, asyncio.Future) and not f.done() for f in releases)
        again = await within(kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(64 * BB), kv.PeerTier(group="t")]))
        try:
            assert {r.name for r in agent.regions} >= old.keys()  # the same names, again
            assert (await within(again.put(keys_for(16), src[0:16 * BB]))).stored == 16
            dst = agent.alloc(16 * BB)
            res = await within(again.get(keys_for(16), dst[0:16 * BB]))
            assert res.prefix == 16 and np.array_equal(dst.numpy(), data)
        finally:
            await within(again.aclose())
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()

"""kv31: who a peer tier's member is, and how its membership is followed.

- Embedded, names are not unique (the handshake proves the token, not the
  name): an agent named after a live member, elsewhere, became that
  member whenever the store's agent connected to it (here: dialled for a
  placement that named it as "from"). Now a live member's name stays its
  own (refused, logged, the claimant joined once the member is gone); a
  restarted member (a real process killed and started again) still joins.
- _follow awaited each join inline: a member (with discovery: an etcd key)
  whose address accepts and never answers held every later membership
  event for the agent's peer timeout. Now joins run beside the loop.
- _Member.late grew by one request per ack_timeout for a member that never
  answers: now bounded.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import pattern, wait_until, within
from test_discovery import TTL, etcd_server  # noqa: F401 (the fixture)
from test_kv17_peer import MEMBER, start_member
from test_kv28_placement import placement
from test_kv29_peer import publish_meta
from test_rv31a_buckets import stopped

import aioxfer
from aioxfer import kv
from aioxfer.discovery import Etcd
from aioxfer.kv import checksum as ck
from aioxfer.kv import peer as kvpeer

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys(tag: bytes, n: int = 1) -> list[bytes]:
    return kv.chain(list(range(16 * n)), block_tokens=16, namespace=tag)


async def test_an_agent_named_after_a_live_member_does_not_become_it(
        make_agent: MakeAgent, capsys: pytest.CaptureFixture[str]) -> None:
    """W is a member. A token holder runs an agent named "W" elsewhere and,
    from a second agent C, sends a placement whose "from" is that agent:
    the owner dials it (the pull checks who answers there). Before: the
    agent's PeerJoined of "W" made _follow join it as member "W", replacing
    the real one. Now it is refused while W lives (kv.peer_name_taken), the
    real W stays the member; once W closes, the claimant may have the name."""
    w = await make_agent("kv31-w")
    publish_meta(w, "kv31a")
    a = await make_agent("kv31-a")
    c = await make_agent("kv31-c")
    tier = kv.PeerTier(group="kv31a", ack_wait=60.0, ack_timeout=60.0)
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        assert tier.ctl is not None
        assert await within(tier.join(w.address))
        real = tier.members[w.name]
        async with aioxfer.Agent(w.name) as impostor:
            publish_meta(impostor, "kv31a")
            data = pattern(BB, 31)
            to_a = await within(c.connect(tier.ctl.address))
            await within(to_a.notify(placement(7, impostor.address, c.address, "hpool",
                                               keys(b"kv31a")[0], ck.checksum(data))))
            # The owner dialled the impostor (the pull's check of "from")...
            await within(wait_until(
                lambda: any(p.incarnation == impostor.incarnation for p in a.peers),
                what="the dial of the placement's from"))
            # ... and _follow took its PeerJoined: joined (before) or refused.
            await within(wait_until(
                lambda: tier.members[w.name] is not real
                or w.name in getattr(tier, "_claims", {}), what="the claim judged"))
            assert tier.members[w.name] is real, "an impostor replaced the live member"
            assert not real.gone.is_set()
            assert "kv.peer_name_taken" in capsys.readouterr().err
            # An explicit join of it is refused too, while W lives.
            assert not await within(tier.join(impostor.address))
            assert tier.members[w.name] is real
            # W gone: the name is free, and the agent that claimed it joins
            # without another event of its own.
            await within(w.aclose())
            await within(wait_until(
                lambda: w.name in tier.members
                and tier.members[w.name].peer.incarnation == impostor.incarnation,
                what="the claimant's join once W left"))


async def test_a_killed_and_restarted_member_rejoins(make_agent: MakeAgent,
                                                      tmp_path: Path) -> None:
    """What NIXL/Mooncake users expect stays: a member (a real process)
    killed with SIGKILL and started again (its next incarnation, at another
    port) is the member of its name again as soon as the store's agent
    connects to it, and placements go to it."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER.replace('group="lost"', 'group="kv31r"'))
    procs: list[Any] = []
    try:
        proc, address = await start_member(script, "kv31-r", BB)
        procs.append(proc)
        agent = await make_agent("kv31-placer", peer_timeout=60.0)
        tier = kv.PeerTier(group="kv31r", ack_wait=30.0, ack_timeout=30.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
            src = agent.alloc(2 * BB)
            src.numpy()[:] = pattern(2 * BB, 32)
            assert await within(tier.join(address))
            assert await within(tier._write(keys(b"kv31r1"), [src], [0])) == [True]
            proc.kill()
            await proc.wait()
            proc2, address2 = await start_member(script, "kv31-r", BB)
            procs.append(proc2)
            await within(agent.connect(address2))
            await within(wait_until(
                lambda: "kv31-r" in tier.members
                and tier.members["kv31-r"].peer.address == address2,
                what="the restarted member's join"))
            assert await within(tier._write(keys(b"kv31r2"), [src], [BB])) == [True]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
            await p.wait()


async def test_a_member_whose_meta_read_hangs_holds_up_no_other_join(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A member (a real process, over tcp) stopped right after the store's
    agent connected to it: its join's meta read is never answered (until
    the agent's peer timeout). Before: _follow awaited that join, so X,
    connected next, was not joined for the whole peer timeout (and gets'
    probes waited on the shared stage). Now X joins at once."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER.replace('group="lost"', 'group="kv31s"'))
    proc, address = await start_member(script, "kv31-s", BB)
    try:
        agent = await make_agent("kv31-f", peer_timeout=60.0, transports=("tcp",))
        tier = kv.PeerTier(group="kv31s", ack_wait=30.0, ack_timeout=30.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
            # Its meta read is posted only once the process is stopped (the
            # join may start inside connect's awaits, and SIGSTOP takes
            # effect a while after it is sent: a read answered meanwhile
            # passed the premise by, once under load).
            read_meta = tier._read_meta

            async def read_once_stopped(peer: Any) -> bytes | None:
                if peer.name == "kv31-s":
                    await wait_until(lambda: stopped(proc.pid), what="the member stopped")
                return await read_meta(peer)

            tier._read_meta = read_once_stopped
            await within(agent.connect(address))
            proc.send_signal(signal.SIGSTOP)
            x = await make_agent("kv31-x")
            publish_meta(x, "kv31s")
            await within(agent.connect(x.address))
            await within(wait_until(lambda: x.name in tier.members, seconds=10,
                                    what="x's join beside the hanging one"), 20)
            assert "kv31-s" not in tier.members
            # A get probes the members (x) while that meta read still hangs.
            dst = agent.alloc(BB)
            res = await within(tier.store.get(keys(b"kv31s"), dst[0:BB]))
            assert res.prefix == 0
            # (killed, its read fails: the close need not wait it out)
            proc.kill()
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()


async def test_with_discovery_a_member_that_never_answers_holds_up_no_event(
        make_agent: MakeAgent, etcd_server: str) -> None:  # noqa: F811
    """An etcd key (a token holder's, or a member's that froze) names an
    address that accepts connections and never answers. Before: _follow
    awaited its connect, so B's joining and leaving, after it, waited for
    the agent's peer timeout. Now B joins and leaves while that connect
    still hangs."""
    import aetcd  # type: ignore[import-untyped]

    etcd = Etcd(etcd_server, prefix=f"/aioxfer-test/kv31-{uuid.uuid4().hex[:12]}", ttl=TTL)
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # never accept()ed
    try:
        ghost_inc = secrets.randbits(63)
        ghost = msgspec.json.encode(dict(
            type="meta", version=aioxfer.metadata.PROTOCOL_VERSION, name="kv31-ghost",
            incarnation=ghost_inc, host_id="elsewhere", pid=1,
            address=f"127.0.0.1:{silent.getsockname()[1]}", transports=["tcp"], regions=[]))
        host, port = etcd_server.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
            await client.put(etcd.key("kv31-ghost").encode(), ghost)
        a = await make_agent("kv31d-a", discovery=etcd, peer_timeout=60.0)
        tier = kv.PeerTier(group="kv31d")
        async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
            b = await make_agent("kv31d-b", discovery=etcd)
            store_b = await within(kv.Store.open(b, block_bytes=BB, tiers=[
                kv.HostTier(8 * BB), kv.PeerTier(group="kv31d")]))
            try:
                await within(wait_until(lambda: b.name in tier.members, seconds=10,
                                        what="b's join"), 20)
            finally:
                await within(store_b.aclose())
            await within(b.aclose())
            await within(wait_until(lambda: b.name not in tier.members, seconds=10,
                                    what="b's leaving"), 20)
            assert "kv31-ghost" not in tier.members
            # Its key deleted (it left): its join, still connecting, ends.
            assert ("kv31-ghost", ghost_inc) in tier._follows
            async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
                await client.delete(etcd.key("kv31-ghost").encode())
            await within(wait_until(lambda: ("kv31-ghost", ghost_inc) not in tier._follows,
                                    what="the ghost's join ended by its leaving"))
    finally:
        silent.close()


async def test_late_requests_of_a_member_that_never_answers_are_bounded(
        make_agent: MakeAgent) -> None:
    """M (a plain agent publishing a tier's meta) takes placements and never
    answers. Each one sent once its ack_timeout had passed went unanswered
    and was kept in _Member.late for a late ack, for ever: one more request
    number per ack_timeout, without bound. Now the newest _LATE_MAX."""
    w = await make_agent("kv31-lw")
    m = await make_agent("kv31-lm")
    publish_meta(m, "kv31l")
    tier = kv.PeerTier(group="kv31l", ack_wait=0.002, ack_timeout=0.002)
    async with kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        assert await within(tier.join(m.address))
        member = tier.members[m.name]
        assert tier.ctl is not None
        member.ctl = await within(tier.ctl.connect(member.meta["ctl"]))  # (not in 2 ms)
        src = w.alloc(BB)
        loop = asyncio.get_running_loop()
        sent = 0
        for i in range(kvpeer._LATE_MAX * 2 if hasattr(kvpeer, "_LATE_MAX") else 128):
            before = loop.time()
            assert await within(tier._write(keys(b"kv31l%d" % i), [src], [0])) == [False]
            sent += 1
            # (past ack_timeout: the next placement tries the member again)
            await asyncio.sleep(max(0.0, before + 0.003 - loop.time()))
        assert sent >= 128
        assert len(member.late) <= 64, len(member.late)
        assert tier.counters.dropped_stores.get("ack_timeout", 0) >= 64


async def test_a_member_whose_index_read_hangs_holds_up_no_other_members_probe(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A (a real process, over tcp) stops (SIGSTOP) while a get probes its
    index: that read is not answered until the agent's peer timeout.
    Before: the probes shared one stage under one lock, so a get of a key
    that only B could hold waited behind it for the whole peer timeout.
    Now each member's read has buckets of its own: the second get probes B
    and ends (a miss) while the first still waits for A."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER.replace('group="lost"', 'group="kv31p"'))
    proc, address = await start_member(script, "kv31-pa", BB)
    try:
        agent = await make_agent("kv31-pw", peer_timeout=60.0, transports=("tcp",))
        b = await make_agent("kv31-pb")
        publish_meta(b, "kv31p")
        tier = kv.PeerTier(group="kv31p", ack_wait=30.0, ack_timeout=30.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB),
                                                                tier]) as store:
            assert await within(tier.join(address))
            assert await within(tier.join(b.address))
            names = tier.member_names()
            # a key whose owners (the readers probe replicas + 1) include A,
            # and one whose owners are this store and B only
            cands = [kv.chain([i] * 16, block_tokens=16, namespace=b"kv31p")[0]
                     for i in range(200)]
            on_a = next(k for k in cands if "kv31-pa" in kvpeer.owners(k, names, 2))
            on_b = next(k for k in cands
                        if set(kvpeer.owners(k, names, 2)) == {agent.name, b.name})
            proc.send_signal(signal.SIGSTOP)
            dst = agent.alloc(2 * BB)
            stuck = asyncio.ensure_future(store.get([on_a], dst[0:BB]))
            await asyncio.sleep(0.2)  # (its probe of A posted, unanswered)
            assert not stuck.done()
            res = await within(store.get([on_b], dst[BB:2 * BB]))
            assert res.prefix == 0
            assert not stuck.done()
            proc.kill()  # (its read fails now: the get ends, a miss)
            await proc.wait()
            assert (await within(stuck, 30)).prefix == 0
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()


async def test_a_sender_whose_memory_read_hangs_holds_up_no_other_senders_pull(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """O's host tier is full (of clean blocks C placed), so placements are
    pulled through the pull staging. Member S (a real process, over tcp)
    stops with a placement of its pulled from it: that read is not answered
    until the agent's peer timeout. Before: the staging was one area under
    one lock, so C's next placement waited behind it (its ack past C's
    ack_wait: C took O for silent). Now C's pull has a part of its own and
    is acknowledged, stored."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER.replace('group="lost"', 'group="kv31q"'))
    proc, address = await start_member(script, "kv31-qs", BB)
    try:
        o = await make_agent("kv31-qo", peer_timeout=60.0, transports=("tcp",))
        c = await make_agent("kv31-qc")
        csrc = c.alloc(3 * BB, name="csrc")
        csrc.numpy()[:] = pattern(3 * BB, 33)
        crcs = [ck.checksum(csrc.memoryview[i * BB:(i + 1) * BB]) for i in range(3)]
        ks = keys(b"kv31q", 3)
        tier = kv.PeerTier(group="kv31q", ack_wait=30.0, ack_timeout=30.0)
        host = kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0)
        async with kv.Store.open(o, block_bytes=BB, tiers=[host, tier]):
            assert tier.ctl is not None
            assert await within(tier.join(address))
            s = tier.members["kv31-qs"]
            to_o = await within(c.connect(tier.ctl.address))

            async def place_from_c(req: int, blocks: list[int]) -> bytes:
                head = json.dumps({"op": "put", "req": req, "from": c.address,
                                   "ctl": c.address, "region": "csrc"}).encode()
                body = b"".join(ks[i] + (i * BB).to_bytes(8, "little")
                                + crcs[i].to_bytes(4, "little")
                                + ck.ALGO.to_bytes(4, "little") for i in blocks)
                await within(to_o.notify(len(head).to_bytes(2, "little") + head + body))
                p = (await within(anext(aiter(c.notifications)))).payload
                n = int.from_bytes(p[:2], "little")
                assert json.loads(p[2:2 + n])["req"] == req
                return bytes(p[2 + n:])

            assert await place_from_c(1, [0, 1]) == b"\x01\x01"  # (the host tier is full now)
            assert not host.free
            proc.send_signal(signal.SIGSTOP)
            # A placement of S's (sent by an agent of its control agent's
            # name, as its own would be): O pulls it from S's pool, stopped.
            async with aioxfer.Agent("kv31-qs.kvctl") as s_ctl:
                to_o_s = await within(s_ctl.connect(tier.ctl.address))
                head = json.dumps({"op": "put", "req": 2, "from": s.peer.address,
                                   "ctl": s.meta["ctl"], "region": s.meta["pool"]}).encode()
                body = (keys(b"kv31q-s")[0] + bytes(8) + (0).to_bytes(4, "little")
                        + ck.ALGO.to_bytes(4, "little"))
                await within(to_o_s.notify(len(head).to_bytes(2, "little") + head + body))
                await within(wait_until(lambda: sum(tier._pulling.values()) == 1,
                                        what="S's pull under way"))
                await asyncio.sleep(0.2)  # (its read posted, unanswered)
                assert await within(place_from_c(3, [2]), 10) == b"\x01"
                assert ks[2] in host.index
                proc.kill()  # (S's read fails now)
                await proc.wait()
                await within(wait_until(lambda: not tier._pulling and not tier._answering,
                                        what="S's pull ended"), 30)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()

"""kv29: a peer tier's membership under placements in flight.

The member at the other end is played by the test (a plain agent that
publishes a peer tier's meta, with its own address as "ctl", as
tests/test_fz28_kv_peer.py does): the test sees each placement arrive and
answers it when it chooses, so every step below is a turn the test takes,
never a race between two stores."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np
import pytest
from conftest import pattern, wait_until, within

import aioxfer
from aioxfer import kv
from aioxfer.kv import peer as kvpeer

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def publish_meta(agent: Any, group: str) -> None:
    """Makes ``agent`` look like a store of ``group`` to a peer tier: pool,
    index and meta regions (the meta's "ctl" is the agent itself)."""
    agent.alloc(8 * BB, name="hpool")
    agent.alloc(16 * 4 * 64, name="hindex")
    meta = {"v": 1, "block_bytes": BB, "buckets": 16, "pool": "hpool", "index": "hindex",
            "ctl": agent.address, "address": agent.address, "pulls_per_peer": 4}
    blob = json.dumps(meta).encode()
    region = agent.alloc(4096, name=f"kvpeer.{group}.meta")
    region.numpy()[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)


def keys(tag: bytes, n: int = 1) -> list[bytes]:
    return kv.chain(list(range(16 * n)), block_tokens=16, namespace=tag)


async def next_placement(member: Any) -> dict[str, Any]:
    """The head of the next placement ``member`` receives."""
    p = (await within(anext(aiter(member.notifications)))).payload
    n = int.from_bytes(p[:2], "little")
    head: dict[str, Any] = json.loads(p[2:2 + n])
    assert head["op"] == "put", head
    return head


async def answer(to_ctl: Any, head: dict[str, Any], bitmap: bytes, *, busy: bool = False) -> None:
    ack: dict[str, Any] = {"op": "ack", "req": head["req"]}
    if busy:
        ack["busy"] = True
    raw = json.dumps(ack).encode()
    await within(to_ctl.notify(len(raw).to_bytes(2, "little") + raw + bitmap))


class TurnLock(asyncio.Lock):
    """A real lock whose second acquirer waits for the test's ``go`` before it
    queues for it: the turn the test gives to a second meta read
    (gate_meta_reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.go = asyncio.Event()

    async def acquire(self) -> Literal[True]:
        self.calls += 1
        if self.calls == 2:
            await self.go.wait()
        return await super().acquire()


def gate_meta_reads(tier: Any, gate: asyncio.Lock) -> None:
    """The tier's meta reads (kv31: a stage of their own) wait for ``gate``."""
    read_meta = tier._read_meta

    async def gated(peer: Any) -> bytes | None:
        async with gate:
            return await read_meta(peer)

    tier._read_meta = gated


async def test_concurrent_adds_of_one_new_peer_share_one_member(make_agent: MakeAgent) -> None:
    """Two adds of one new peer at once (a pull's _reach beside _follow, or
    two placements of a sender not yet a member): each read the peer's
    meta and made a member; the second replaced the first and failed the
    placement sent to it meanwhile (PeerLost "replaced": its block
    dropped, "peer_lost"). Now the second shares the first's join: one
    member, and the placement is stored when the member acknowledges it."""
    w = await make_agent("kv29-w1")
    m = await make_agent("kv29-m1")
    publish_meta(m, "kv29a")
    tier = kv.PeerTier(group="kv29a", ack_wait=60.0, ack_timeout=60.0)
    async with kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        assert tier.ctl is not None
        gate = TurnLock()
        gate_meta_reads(tier, gate)  # (kv31: meta reads have a stage of their own)
        peer = await within(w.connect(m.address))
        first = asyncio.ensure_future(tier._add_member(peer))
        second = asyncio.ensure_future(tier._add_member(peer))
        # (the agent's PeerJoined makes _follow add it too: a third add,
        # which may come first; whichever reads the meta first, the test
        # holds back the second read, if any, until its placement waits)
        await within(wait_until(lambda: m.name in tier.members, what="the join"))
        joined = tier.members[m.name]
        src = w.alloc(BB)
        src.numpy()[:] = pattern(BB, 29)
        put = asyncio.ensure_future(tier._write(keys(b"kv29a"), [src], [0]))
        head = await next_placement(m)  # the placement waits for its ack now
        gate.go.set()  # a second meta read, if the second add makes one
        adds = [await within(first), await within(second)]
        await answer(await within(m.connect(tier.ctl.address)), head, b"\x01")
        # (before: [False], dropped {"peer_lost": 1})
        assert await within(put) == [True], tier.counters.dropped_stores
        assert adds == [joined, joined] and tier.members[m.name] is joined
        assert gate.calls == 1  # (one meta read)


async def test_a_busy_retry_follows_the_member_as_it_is_then(
        make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """A placement refused "busy" is sent again after a pause. If its member
    changed meanwhile, the retry went to the old one all the same (its old
    control connection, whose acks nobody fails when it leaves). Now each
    try looks the member up as it is then: here it left during the pause
    (kv31: a live member's name cannot be taken over by another agent, so
    leaving is how it changes), and the retry ends "peer_left" at once."""
    monkeypatch.setattr(kvpeer, "_BUSY_PAUSE", 30.0)  # a pause the test acts in
    w = await make_agent("kv29-w2")
    old = await make_agent("kv29-m2")
    publish_meta(old, "kv29b")
    tier = kv.PeerTier(group="kv29b", ack_wait=600.0, ack_timeout=600.0)
    async with kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        assert tier.ctl is not None
        assert await within(tier.join(old.address))
        src = w.alloc(BB)
        src.numpy()[:] = pattern(BB, 30)
        put = asyncio.ensure_future(tier._write(keys(b"kv29b"), [src], [0]))
        head = await next_placement(old)
        await answer(await within(old.connect(tier.ctl.address)), head, b"\x00", busy=True)
        # (kv31: a live member's name is not taken over by another agent:
        # the old one leaves during the pause, which ends the pause, and the
        # retry finds no member of that name: dropped "peer_left" at once,
        # nothing sent to the old one's control agent)
        await within(old.aclose())
        assert await within(put, 10) == [False]
        assert tier.counters.dropped_stores == {"peer_left": 1}, tier.counters.dropped_stores


async def test_a_restarted_member_is_followed_by_incarnation(make_agent: MakeAgent) -> None:
    """Embedded, a member restarted (its next incarnation up while the old
    one is still closing): the agent reports PeerJoined of the new one,
    then PeerLeft of the old one. The tier skipped the joining (a member of
    that name was there) and the leaving then removed the name: no member
    left for it. Now both are matched by incarnation: the new one replaces
    the old, and the old one's leaving leaves it."""
    w = await make_agent("kv29-w3")
    old = aioxfer.Agent("kv29-m3")
    tier = kv.PeerTier(group="kv29c")
    async with old, kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        publish_meta(old, "kv29c")
        assert await within(tier.join(old.address))
        old_peer = tier.members[old.name].peer
        async with aioxfer.Agent(old.name) as new:  # its next incarnation
            publish_meta(new, "kv29c")
            await within(w.connect(new.address))  # (PeerJoined: _follow's)
            await within(old.aclose())
            await within(wait_until(lambda: old_peer.lost, what="the old one's leaving"))
            # A member joining after those two: once _follow has it, it has
            # taken both events before it (one loop, in order).
            x = await make_agent("kv29-x3")
            publish_meta(x, "kv29c")
            await within(w.connect(x.address))
            await within(wait_until(lambda: x.name in tier.members, what="x's joining"))
            # (kv31: joins run beside _follow, and the new one, refused while
            # the old one lived, joins once it left: in either order with x's)
            await within(wait_until(
                lambda: old.name in tier.members
                and tier.members[old.name].peer.address == new.address,
                what="the successor's joining (the old one's leaving removed it?)"))

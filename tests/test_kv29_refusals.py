"""kv29: what placements an owner refuses, and what it tells their senders.

An owner's refusals ("busy", past its pull limits) are told to its
members whatever other senders' refusals do.

A refusal's ack was bounded by one count for all senders (max_pulls): past
it a refused placement got no ack at all. Refusals to senders that are no
member dial the sender first (PeerTier._introduce), and such a dial can hang
for the owner's peer timeout; with max_pulls of them hanging, a member's
refused placement went unanswered: its writer waited out ack_wait
("ack_timeout") and took the owner for silent, skipping it for
ack_timeout. Now members' refusals are bounded per member, apart from the
others'."""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import pattern, wait_until, within
from test_kv27_put_from import listener

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def placement(req: int, frm: str, key: bytes) -> bytes:
    head = json.dumps({"op": "put", "req": req, "from": frm, "ctl": frm,
                       "region": "r"}).encode()
    body = key + bytes(16)
    return len(head).to_bytes(2, "little") + head + body


async def test_a_members_refusal_is_told_while_others_hang(make_agent: MakeAgent) -> None:
    """Owner A pulls one placement at a time (max_pulls 1). C (no member)
    sends two whose "from" is a port that accepts and never answers: the
    first is pulled and hangs in its dial, the second is refused and its
    ack hangs in the same dial (A's peer timeout is 60 s). Then member W
    places a block: refused, busy. Before: no ack (the one count for
    refusals was taken): W's placement ended "ack_timeout" and A was
    silent to W. Now W is told "busy" and tries again until its ack_wait
    is over, A not silent."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    nowhere = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        a = await make_agent("kv29-a", peer_timeout=60.0)
        ta = kv.PeerTier(group="kv29r", max_pulls=1, max_pulls_per_peer=1)
        c = await make_agent("kv29-c")
        w = await make_agent("kv29-w")
        tw = kv.PeerTier(group="kv29r", ack_wait=1.0, ack_timeout=30.0)
        async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
                kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tw]):
            assert ta.ctl is not None
            assert await within(tw.join(a.address))
            assert await within(ta.join(w.address))  # (each the other's seed)
            to_a = await within(c.connect(ta.ctl.address))
            for req in (1, 2):
                key = kv.chain(list(range(16)), block_tokens=16, namespace=b"kv29c%d" % req)[0]
                await within(to_a.notify(placement(req, nowhere, key)))
            await within(wait_until(lambda: ta.pulls_refused == 1, what="C's second refused"))
            src = w.alloc(BB)
            src.numpy()[:] = pattern(BB, 31)
            keys = kv.chain(list(range(16)), block_tokens=16, namespace=b"kv29w")
            got = await within(tw._write(keys, [src], [0]))
            assert got == [False]
            # (before: no busy_retries, A silent. "peer_busy"; or, the last
            # retry's answer later than the slowest before it, as under
            # load, "ack_timeout", but not silent, as for any try that
            # waited)
            assert tw.busy_retries > 0, tw.counters.dropped_stores
            assert not tw.members[a.name].silent
            assert set(tw.counters.dropped_stores) <= {"peer_busy", "ack_timeout"}
            assert ta.pulled == 0
    finally:
        silent.close()


async def test_a_non_members_from_is_dialled_once_until_it_reaches_it(
        make_agent: MakeAgent) -> None:
    """C (no member, embedded) sends placements whose "from" is a port that
    speaks no aioxfer. Each made A open a connection there and send a
    Hello (before: three placements, three connections, to any ports C
    chose). Now the first is dialled, reaches no agent of C's, and C's
    next ones are refused undialled ("placement_unvouched") for
    ack_timeout."""
    a = await make_agent("kv29-a2")
    c = await make_agent("kv29-c2")
    ta = kv.PeerTier(group="kv29d")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            listener() as (first, accepted1), listener() as (second, accepted2):
        assert ta.ctl is not None
        to_a = await within(c.connect(ta.ctl.address))
        key = kv.chain(list(range(16)), block_tokens=16, namespace=b"kv29d")[0]
        await within(to_a.notify(placement(1, first, key)))
        await within(wait_until(lambda: accepted1 == [1], what="the first dial"))
        await within(wait_until(
            lambda: ta._extra()["pulls_in_flight"] == ta._extra()["pulls_answering"] == 0,
            what="the first pull over"))
        for req in (2, 3):
            await within(to_a.notify(placement(req, first, key)))
        await within(wait_until(lambda: ta.pulls_refused == 2, what="both refused undialled"))
        assert ta.counters.dropped_stores == {"placement_unvouched": 2}
        assert accepted1 == [1] and accepted2 == []
        assert ta.pulled == 0

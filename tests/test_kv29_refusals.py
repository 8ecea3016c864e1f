"""kv29: an owner's refusals ("busy", past its pull limits) are told to its
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
    is over: "peer_busy", A not silent."""
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
            assert tw.counters.dropped_stores == {"peer_busy": 1}, tw.counters.dropped_stores
            assert tw.busy_retries > 0 and not tw.members[a.name].silent
            assert ta.pulled == 0
    finally:
        silent.close()

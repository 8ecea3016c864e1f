"""rev36: kv29's shared join of a peer (PeerTier._add_member) under cancels.

Regression guards, not bug fixes (they pass on kv29's code): a caller
cancelled while the join reads the peer's meta leaves the join to the
others; a store closed with a join in flight cancels and waits for it (no
task left pending, no exception unretrieved: make_agent fails a test whose
loop reported one)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import wait_until, within
from test_kv29_peer import gate_meta_reads, publish_meta

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


async def test_a_cancelled_caller_leaves_the_join_to_the_others(make_agent: MakeAgent) -> None:
    w = await make_agent("rev36-jw")
    m = await make_agent("rev36-jm")
    publish_meta(m, "rev36j")
    tier = kv.PeerTier(group="rev36j")
    async with kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        gate = asyncio.Lock()
        await gate.acquire()  # (the meta read waits for the test's turn)
        gate_meta_reads(tier, gate)
        peer = await within(w.connect(m.address))
        first = asyncio.ensure_future(tier._add_member(peer))
        second = asyncio.ensure_future(tier._add_member(peer))
        await within(wait_until(lambda: m.name in tier._joining, what="the join"))
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert first.cancelled() and not tier._joining[m.name][1].done()
        gate.release()
        joined = await within(second)
        assert joined is not None and tier.members[m.name] is joined
        assert not tier._joining


async def test_a_close_ends_a_join_in_flight(make_agent: MakeAgent) -> None:
    w = await make_agent("rev36-jw2")
    m = await make_agent("rev36-jm2")
    publish_meta(m, "rev36k")
    tier = kv.PeerTier(group="rev36k")
    gate = asyncio.Lock()
    async with kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]):
        await gate.acquire()  # (held past the close: the join never reads)
        gate_meta_reads(tier, gate)
        peer = await within(w.connect(m.address))
        caller = asyncio.ensure_future(tier._add_member(peer))
        await within(wait_until(lambda: m.name in tier._joining, what="the join"))
        task = tier._joining[m.name][1]
    assert task.cancelled() and task not in tier._tasks and not tier._joining
    assert m.name not in tier.members
    # (the caller's shield reports the join's cancel to it)
    await asyncio.gather(caller, return_exceptions=True)
    assert caller.cancelled()

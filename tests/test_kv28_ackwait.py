"""kv28: ack_wait bounds a whole placement, its turn included.

A writer keeps at most its member's max_pulls_per_peer placements in
flight to it (kv26); the others wait for their turn, and that wait was
outside ack_wait: a live member that answers each placement just within
ack_wait held the n-th queued one about n ack_waits, and the put with it.
Now a placement ends by ack_wait from when it was asked for (dropped
"ack_timeout" if its turn or its ack has not come by then); only one that
had the whole ack_wait to itself makes the member silent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import pattern, within
from test_kv26_place import BB, Member, at_turns, fake_member, keys_of

from aioxfer import kv

MakeAgent = Callable[..., Awaitable[Any]]


async def test_queued_placements_to_a_slow_member_end_within_ack_wait(
        make_agent: MakeAgent) -> None:
    """A member that pulls one placement from a peer at a time and answers
    each 0.6 s after it arrives; ack_wait 1 s; three puts at once (one
    placement each). Before: the third put returned after ~1.8 s (its
    turn came at 1.2 s, its ack at 1.8 s). Now every put returns by
    ack_wait (+ a margin for a loaded machine), the first stored, and the
    member is not taken for silent (a fourth put after them is placed)."""
    wait = 1.0
    b = await make_agent("kv28-slow-b")
    b_ctl = await make_agent("kv28-slow-b.kvctl")
    fake_member(b, b_ctl.address, 1)
    member = Member(b_ctl)
    agent = await make_agent("kv28-writer")
    tier = kv.PeerTier(group="t", ack_wait=wait, ack_timeout=30.0)
    src = agent.alloc(4 * 4 * BB)
    src.numpy()[:] = pattern(4 * 4 * BB, 28)

    slow = [True]

    async def answer_slowly() -> None:
        while True:
            head, body = await member.next(60.0)
            if slow[0]:
                await asyncio.sleep(0.6)
            await member.ack(head, body)

    async def put(p: int) -> tuple[list[bool], float]:
        t0 = time.monotonic()
        got = await tier._write(keys_of(p, 4), [src] * 4, [(4 * p + i) * BB for i in range(4)])
        return got, time.monotonic() - t0

    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
        assert await within(tier.join(b.address))
        answering = asyncio.ensure_future(answer_slowly())
        try:
            # Called in this order, each at its turn before the next (a
            # put's copy into the staging is a real transfer: on a loaded
            # machine a later one may finish first, CI: put 1 went first).
            calls = []
            for p in range(3):
                calls.append(asyncio.ensure_future(put(p)))
                await at_turns(tier, b.name, p + 1)
            results = await within(asyncio.gather(*calls), 20)
            took = [round(t, 2) for _, t in results]
            assert max(took) < wait + 0.4, f"puts took {took} s with ack_wait {wait} s"
            assert results[0][0] == [True] * 4, results
            assert not tier.members[b.name].silent
            # (its answers prompt now: a placement still in the member's
            # backlog, e.g. the third put's if it was sent right at its
            # deadline, would otherwise hold the fourth past its ack_wait)
            slow[0] = False
            got, _t = await within(put(3), 20)
            assert got == [True] * 4
            assert tier.counters.dropped_stores.get("peer_stalled", 0) == 0
        finally:
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)

"""kv28: more writers than an owner's max_pulls allows at once.

An owner pulls at most max_pulls placements at once (max_pulls_per_peer
from one writer); a writer keeps at most that per-peer number in flight to
it (kv26), but knows nothing of the other writers: past max_pulls in all
the owner refused the rest, and their writers dropped those blocks
("peer_refused"), as if the blocks had failed there. Now the refusal says
"busy" and the writer sends the placement again, after a short random
pause, until its ack_wait is over ("peer_busy" if it never gets in)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import pattern, within

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


async def test_writers_past_an_owners_max_pulls_are_retried_not_dropped(
        make_agent: MakeAgent) -> None:
    """Six writers (real agents and stores) put 8 blocks each at once to
    one owner that pulls three placements at a time (max_pulls 3, as many
    refusals told at once): before, the placements that arrived while
    three were pulled were refused and their blocks dropped (writers'
    dropped "peer_refused" 8, three of six); now every block is stored,
    the refused ones sent again."""
    owner = await make_agent("kv28-owner")
    to = kv.PeerTier(group="kv28b", max_pulls=3, max_pulls_per_peer=1)
    writers = 6
    async with kv.Store.open(owner, block_bytes=BB, tiers=[kv.HostTier(64 * BB), to]):
        tiers, stores, srcs = [], [], []
        try:
            for w in range(writers):
                agent = await make_agent(f"kv28-w{w}")
                tier = kv.PeerTier(group="kv28b")
                store = await within(kv.Store.open(agent, block_bytes=BB,
                                                   tiers=[kv.HostTier(8 * BB), tier]))
                stores.append(store)
                tiers.append(tier)
                src = agent.alloc(8 * BB)
                src.numpy()[:] = pattern(8 * BB, 100 + w)
                srcs.append(src)
                assert await within(tier.join(owner.address))
            results = await within(asyncio.gather(*(
                t._write(kv.chain(list(range(16 * 8)), block_tokens=16,
                                  namespace=f"kv28b{w}".encode()),
                         [srcs[w]] * 8, [i * BB for i in range(8)])
                for w, t in enumerate(tiers))), 30)
            drops = [t.counters.dropped_stores for t in tiers]
            assert all(r == [True] * 8 for r in results), (results, drops, to.pulls_refused)
            assert to.pulled == 8 * writers
            # (the limit was met: without it nothing here tells a retry from none)
            assert to.pulls_refused > 0 and sum(t.busy_retries for t in tiers) > 0
        finally:
            for store in stores:
                await within(store.aclose())

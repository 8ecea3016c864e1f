"""Views of registered memory do not outlive its release (kv26's audit of
the kv modules past disk.py). PeerTier's published index kept a numpy view
of its region (PeerIndex.rows) for as long as the tier object lived: after
the store closed, the region was released by the agent but its memfd stayed
mapped in this process."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import within

from aioxfer import kv

MakeAgent = Callable[..., Awaitable[Any]]


def mapped(agent_name: str) -> list[str]:
    """This process's mappings of the agent's memfds (by region name)."""
    with open("/proc/self/maps") as fh:
        return [line.split("memfd:aioxfer:", 1)[1].split()[0] for line in fh
                if f"memfd:aioxfer:{agent_name}:" in line]


async def test_a_closed_peer_tier_leaves_no_region_mapped(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv26-views")
    before = mapped(agent.name)
    tier = kv.PeerTier(group="kv26v")
    store = await within(kv.Store.open(agent, block_bytes=16 << 10, tiers=[
        kv.HostTier(64 << 14), tier]))
    assert any(m.endswith(":kvpeer.kv26v.index") for m in mapped(agent.name)), mapped(agent.name)
    await within(store.aclose())
    gc.collect()
    # The tier and store objects are still referenced here (as an
    # application holding them would): nothing of theirs stays mapped
    # (before: the index region's memfd did).
    assert tier is store.tiers[1]
    assert mapped(agent.name) == before, mapped(agent.name)

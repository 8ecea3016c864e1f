"""fz28 (fuzz/fuzz_kv_peer.py): a member's published meta whose "address"
is not a string (a JSON list or object) was taken for a member, and that
address goes into a set each time a placement is judged (PeerTier._unvouched
for a placement from it, PeerTier._ack_address for a placement from anyone):
TypeError (unhashable type). From then on every placement's ack raised out
of its task instead of being sent (the sender's ack_wait dropped every block
placed here), and a placement from the hostile member itself ended the
tier's serving loop for good. Such a meta is no member, as one whose "ctl"
is not a string already is. Real agents, published regions and
notifications, as tests/test_fz26_kv_peer.py."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv

BB = 64 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"fz28")


async def hostile_member(make_agent: MakeAgent, group: str, address: Any) -> Any:
    """An agent publishing a peer tier's meta (as PeerTier._open does) whose
    "address" is ``address``; its pool and index regions exist."""
    bad = await make_agent("fz28-hostile")
    bad.alloc(16 * BB, name="hpool")
    bad.alloc(16 * 4 * 64, name="hindex")
    meta = {"group": group, "block_bytes": BB, "buckets": 16, "pool": "hpool",
            "index": "hindex", "slots": 16, "ctl": bad.address, "address": address,
            "pulls_per_peer": 8}
    blob = json.dumps(meta).encode()
    region = bad.alloc(4096, name=f"kvpeer.{group}.meta")
    region.numpy()[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    return bad


@pytest.mark.parametrize("address", [["127.0.0.1:1"], {"a": 1}])
async def test_a_meta_with_an_unhashable_address_is_no_member(
        make_agent: MakeAgent, address: Any) -> None:
    # The errors out of the tier's tasks, said here (before the fix they were
    # TypeErrors: unhandled, they would fail make_agent's teardown, which a
    # strict xfail does not cover).
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()
    raised: list[str] = []
    loop.set_exception_handler(lambda _loop, ctx: raised.append(repr(ctx.get("exception"))))
    try:
        await _placements_after_a_hostile_join(make_agent, address)
        gc.collect()  # (a task's exception is said when the task goes)
    finally:
        loop.set_exception_handler(old)
    assert not raised, raised


async def _placements_after_a_hostile_join(make_agent: MakeAgent, address: Any) -> None:
    agent = await make_agent("fz28-member-a")
    bad = await hostile_member(make_agent, "fz28", address)
    tier = kv.PeerTier(group="fz28")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(64 * BB), tier]):
        assert tier.ctl is not None
        joined = await within(tier.join(bad.address))
        # The hostile member places blocks here (from its own name, as a member).
        ctl = await within(bad.connect(tier.ctl.address))
        head = json.dumps({"op": "put", "req": 1, "from": bad.address, "ctl": bad.address,
                           "region": "hpool"}).encode()
        await within(ctl.notify(len(head).to_bytes(2, "little") + head + bytes(48)))
        # A good member places blocks here after that: each is acknowledged.
        other = await make_agent("fz28-member-b")
        src = other.alloc(16 * BB)
        src.numpy()[:] = pattern(16 * BB, 5)
        tier2 = kv.PeerTier(group="fz28", ack_wait=5.0)
        async with kv.Store.open(other, block_bytes=BB, tiers=[
                kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0), tier2]) as st2:
            assert await within(tier2.join(agent.address))
            put = await within(st2.put(keys_for(16), src[0:16 * BB]), 60)
            assert put.stored == 16 and put.dropped == 0, put
            assert tier.pulled == 12
        assert not joined and bad.name not in tier.members

"""fz26: PeerTier's JSON from other members, nested past the interpreter's
recursion limit (json.loads raises RecursionError, which is neither a
ValueError nor a TypeError): a control message so nested ended the tier's
serving loop for good (every later placement on it waited out its ack and
was dropped), and a member's published meta so nested raised out of join()
and Store.open instead of making it no member. Real agents, real
notifications and published regions, as tests/test_kv_peer.py's hostile
member tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from conftest import pattern, within

from aioxfer import kv

BB = 64 << 10
MakeAgent = Callable[..., Awaitable[Any]]
# Deeper than any recursion limit a test runs under, and it still fits one
# notification (2-byte length + head + a 48-byte entry: at most 4096 bytes)
# and a published meta (4096 bytes).
DEEP = b"[" * 4000


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"fz26")


async def test_a_deeply_nested_control_message_leaves_the_tier_serving(
        make_agent: MakeAgent) -> None:
    agent = await make_agent("fz26-member-a")
    hostile = await make_agent("fz26-hostile")
    tier = kv.PeerTier(group="fz26")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(64 * BB), tier]):
        assert tier.ctl is not None
        ctl = await within(hostile.connect(tier.ctl.address))
        for head in [DEEP, b'{"op": "ack", "req": 1, "x": ' + DEEP[:3000] + b"}"]:
            await within(ctl.notify(len(head).to_bytes(2, "little") + head + bytes(48)))
        # A good member places blocks here after those.
        other = await make_agent("fz26-member-b")
        src = other.alloc(16 * BB)
        src.numpy()[:] = pattern(16 * BB, 7)
        tier2 = kv.PeerTier(group="fz26")
        async with kv.Store.open(other, block_bytes=BB, tiers=[
                kv.HostTier(4 * BB, high_watermark=1.0, low_watermark=1.0), tier2]) as st2:
            assert await within(tier2.join(agent.address))
            put = await within(st2.put(keys_for(16), src[0:16 * BB]), 60)
            assert put.stored == 16 and put.dropped == 0, put
            assert tier.pulled == 12


async def test_a_deeply_nested_published_meta_is_no_member(make_agent: MakeAgent) -> None:
    bad = await make_agent("fz26-deep-meta")
    bad.alloc(16 * BB, name="pool")
    bad.alloc(4 * 4 * 64, name="kvpeer.d.index")
    meta = bad.alloc(4096, name="kvpeer.d.meta")
    meta.numpy()[:len(DEEP)] = np.frombuffer(DEEP, dtype=np.uint8)
    agent = await make_agent("fz26-member-d")
    # As a seed: Store.open joins it (before: RecursionError out of open).
    tier = kv.PeerTier(group="d", seeds=[bad.address])
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
        assert not await within(tier.join(bad.address))
        assert not tier.members
        await asyncio.sleep(0)

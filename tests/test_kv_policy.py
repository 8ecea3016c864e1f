"""aioxfer.kv eviction policies: each one's behaviour alone (recency for LRU,
insertion order for FIFO, scan resistance for S3-FIFO and ARC), then chosen
per tier through the store."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.kv.policy import ARC, FIFO, LRU, S3FIFO, EvictionPolicy, make_policy

MakeAgent = Callable[..., Awaitable[Any]]


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


class Cache:
    """A cache of ``capacity`` keys driven by a policy, as a tier drives it:
    a miss inserts, evicting the policy's coldest first when full."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.keys: set[bytes] = set()
        self.hits = self.misses = 0

    def access(self, key: bytes, pinned: frozenset[bytes] = frozenset()) -> bool:
        if key in self.keys:
            self.policy.hit(key)
            self.hits += 1
            return True
        self.misses += 1
        if len(self.keys) >= self.policy.capacity:
            victim = self.policy.coldest(1, lambda x: x in pinned)
            assert victim, "a full cache with nothing evictable"
            self.policy.remove(victim[0], evicted=True)
            self.keys.discard(victim[0])
        self.policy.insert(key)
        self.keys.add(key)
        assert len(self.policy) == len(self.keys)
        return False


def test_make_policy_and_names() -> None:
    for name, cls in (("lru", LRU), ("fifo", FIFO), ("s3fifo", S3FIFO), ("arc", ARC)):
        p = make_policy(name, 8)
        assert isinstance(p, cls) and p.name == name and p.capacity == 8
    with pytest.raises(ValueError, match="eviction is one of"):
        make_policy("lfu", 8)
    with pytest.raises(ValueError):
        kv.HostTier(1 << 20, eviction="random")


def test_lru_evicts_the_least_recently_used() -> None:
    c = Cache(LRU(4))
    for i in range(4):
        c.access(k(i))
    c.access(k(0))  # 0 is now the most recent
    c.access(k(4))  # evicts 1
    assert c.keys == {k(0), k(2), k(3), k(4)}
    assert list(c.policy.order()) == [k(2), k(3), k(0), k(4)]
    # skip: a pinned coldest block is passed over, not evicted
    assert c.policy.coldest(2, lambda x: x == k(2)) == [k(3), k(0)]
    c.policy.remove(k(3))
    assert k(3) not in c.policy and len(c.policy) == 3


def test_fifo_ignores_reads() -> None:
    c = Cache(FIFO(4))
    for i in range(4):
        c.access(k(i))
    c.access(k(0))
    c.access(k(4))  # evicts 0 although it was just read
    assert c.keys == {k(1), k(2), k(3), k(4)}
    assert not FIFO.tracks_hits and LRU.tracks_hits


def scan_workload(policy: EvictionPolicy, hot: int, rounds: int) -> tuple[int, int]:
    """A hot set read over and over, interleaved with a long one-pass scan of
    blocks never read again; returns (hot hits, hot accesses) after warm-up."""
    c = Cache(policy)
    scan = 10_000
    for _ in range(3):  # warm-up: the hot set is read a few times
        for h in range(hot):
            c.access(k(h))
    hits = total = 0
    for r in range(rounds):
        for h in range(hot):
            hit = c.access(k(h))
            if r:  # the first round follows the warm-up, not a scan
                total += 1
                hits += hit
        for s in range(4 * hot):  # a scan burst bigger than the whole cache
            c.access(k(scan + r * 4 * hot + s))
    return hits, total


@pytest.mark.parametrize("policy", [S3FIFO, ARC])
def test_scan_resistance(policy: type[EvictionPolicy]) -> None:
    cap, hot = 100, 50
    lru_hits, total = scan_workload(LRU(cap), hot, 20)
    hits, total = scan_workload(policy(cap), hot, 20)
    # LRU loses the whole hot set to every scan burst; the scan-resistant
    # policies keep (most of) it.
    assert lru_hits == 0
    assert hits >= 0.8 * total, (policy.name, hits, total)


def test_s3fifo_queues_and_ghosts() -> None:
    p = S3FIFO(10)
    assert p.small_target == 1
    c = Cache(p)
    for i in range(10):
        c.access(k(i))
    for i in (1, 2, 3):
        c.access(k(i))  # read again while in the small queue
    c.access(k(10))  # evicts: 0 leaves (never read again) and is remembered
    assert k(0) not in c.keys and k(0) in p.ghost
    c.access(k(11))  # 1..3 move on to main as the scan passes them; 4 goes
    assert {k(1), k(2), k(3)} <= set(p.main) and k(4) in p.ghost
    c.access(k(0))  # back while remembered: straight into main
    assert k(0) in p.main
    c.policy.remove(k(0))  # an explicit remove is not remembered
    assert k(0) not in p.ghost and k(0) not in p


def test_arc_adapts_toward_the_ghost_that_hits() -> None:
    p = ARC(4)
    c = Cache(p)
    for i in range(4):
        c.access(k(i))
    c.access(k(0))  # 0 and 1 seen twice: t2
    c.access(k(1))
    assert set(p.t2) == {k(0), k(1)} and set(p.t1) == {k(2), k(3)}
    c.access(k(4))  # evicts the LRU of t1 (2) into b1
    assert k(2) in p.b1
    before = p.p
    c.access(k(2))  # a hit in b1: recency would have kept it, p grows
    assert p.p > before and k(2) in p.t2


async def test_store_uses_the_tier_policy(make_agent: MakeAgent) -> None:
    """Through a store: with s3fifo a one-pass scan of new blocks evicts
    the scan itself and keeps the blocks read again; with lru it evicts them."""
    bb = 4096
    agent = await make_agent("kv")
    n_hot, n_scan, cap = 16, 96, 64
    src = agent.alloc((n_hot + n_scan) * bb)
    src.numpy()[:] = pattern((n_hot + n_scan) * bb, 21)
    dst = agent.alloc(n_hot * bb)
    keys = kv.chain(np.arange(16 * (n_hot + n_scan)), block_tokens=16, namespace=b"policy")
    hot, scan = keys[:n_hot], keys[n_hot:]
    kept: dict[str, int] = {}
    for eviction in ("lru", "s3fifo", "arc"):
        tier = kv.HostTier(cap * bb, eviction=eviction, high_watermark=1.0, low_watermark=1.0)
        async with kv.Store.open(agent, block_bytes=bb, tiers=[tier]) as store:
            await store.put(hot, src[0:n_hot * bb])
            for _ in range(2):  # the hot blocks are read again
                assert (await within(store.get(hot, dst[0:n_hot * bb]))).prefix == n_hot
            for i in range(0, n_scan, 8):  # then a scan of new blocks, each put once
                await store.put(scan[i:i + 8], src[(n_hot + i) * bb:(n_hot + i + 8) * bb])
            hit = await store.lookup(hot)
            kept[eviction] = sum(t is not None for t in hit.tiers)
            st = store.statistics().tiers["host"]
            assert st.blocks == cap and st.evictions == {"capacity": n_hot + n_scan - cap}
            res = await within(store.get(hot, dst[0:n_hot * bb]))
            assert np.array_equal(dst.numpy()[:res.prefix * bb], src.numpy()[:res.prefix * bb])
    assert kept["lru"] == 0, kept
    assert kept["s3fifo"] == n_hot and kept["arc"] == n_hot, kept

"""aioxfer.kv.metrics: a store's per-tier statistics through prometheus_client
(a real registry, the text format parsed back), and on the agent's own
metrics endpoint scraped over loopback HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from scrape import samples, value  # noqa: E402

from aioxfer.kv.metrics import StoreCollector  # noqa: E402

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


async def test_store_collector_exports_per_tier_statistics(make_agent: MakeAgent,
                                                           tmp_path: Path) -> None:
    agent = await make_agent("kv")
    n = 24
    src = agent.alloc(n * BB)
    src.numpy()[:] = pattern(n * BB, 3)
    keys = kv.chain(np.arange(16 * (n + 1)), block_tokens=16, namespace=b"metrics")
    dst = agent.alloc(n * BB)
    tiers = [kv.HostTier(16 * BB, promote=False),
             kv.DiskTier(tmp_path / "kv", 1 << 26, segment_bytes=64 * BB)]
    async with kv.Store.open(agent, block_bytes=BB, tiers=tiers, name="s1") as store:
        await store.put(keys[:n], src[0:n * BB], durable=True)  # 16 fit in host memory
        host = store.tiers[0]
        assert isinstance(host, kv.HostTier)
        for k in keys[:4]:
            host.evict(k, "test")  # 4 now only on disk
        # two gets at once of the same blocks: the second one coalesces
        results = await within(asyncio.gather(store.get(keys[:8], dst[0:8 * BB]),
                                              store.get(keys[:8], dst[8 * BB:16 * BB])))
        assert all(r.prefix == 8 for r in results)
        res = await store.get(keys[n - 1:n + 1], dst[0:2 * BB])  # a hit, then a miss
        assert res.prefix == 1
        await store.lookup(keys)
        registry = CollectorRegistry(auto_describe=True)
        registry.register(StoreCollector(store))
        got = samples(generate_latest(registry).decode())
        st = store.statistics()
        for tier in ("host", "disk"):
            ts = st.tiers[tier]
            lab = {"store": "s1", "tier": tier, "kind": tier}
            for field in ("lookups", "hits", "misses", "hit_bytes", "miss_bytes", "puts",
                          "coalesced", "checksum_failures", "promotions"):
                assert value(got, f"aioxfer_kv_{field}_total", **lab) == getattr(ts, field), \
                    (tier, field)
            assert value(got, "aioxfer_kv_blocks", **lab) == ts.blocks
            assert value(got, "aioxfer_kv_pinned_tier_bytes", **lab) == 0
            assert value(got, "aioxfer_kv_in_flight", **lab) == 0
        host_lab = {"store": "s1", "tier": "host", "kind": "host"}
        disk_lab = {"store": "s1", "tier": "disk", "kind": "disk"}
        assert value(got, "aioxfer_kv_evictions_total", reason="test", **host_lab) == 4
        assert value(got, "aioxfer_kv_coalesced_total", **disk_lab) >= 1
        assert value(got, "aioxfer_kv_misses_total", **host_lab) == 1
        assert value(got, "aioxfer_kv_store_coalesced_total", store="s1") == st.coalesced >= 1
        assert value(got, "aioxfer_kv_pinned_bytes", store="s1") == 0
        assert value(got, "aioxfer_kv_fetches_in_flight", store="s1") == 0
        # latency histograms: every batch the disk tier read is in a bucket
        count = value(got, "aioxfer_kv_read_seconds_count", **disk_lab)
        assert count == store.tiers[1].counters.read_latency.n >= 1
        assert value(got, "aioxfer_kv_read_seconds_bucket", le="+Inf", **disk_lab) == count
        assert value(got, "aioxfer_kv_tier_extra", field="segments", **disk_lab) == 1
        # a second store, a collector of its own: evictions by reason
        full = kv.HostTier(2 * BB, put_wait=0.0, name="small")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[full], name="s2") as s2:
        for k in keys[:8]:
            await s2.put([k], src[0:BB])
        collector = StoreCollector(s2)
        assert s2.statistics().tiers["small"].evictions == {"capacity": 6}
        got = samples(generate_latest(_registry(collector)).decode())
        assert value(got, "aioxfer_kv_evictions_total", store="s2", tier="small", kind="host",
                     reason="capacity") == 6


def _registry(collector: StoreCollector) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(collector)
    return r


async def test_store_metrics_on_the_agent_endpoint(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(4 * BB)
    keys = kv.chain(np.arange(64), block_tokens=16, namespace=b"metrics")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(8 * BB)]) as store:
        await store.put(keys, src[0:4 * BB])
        await store.get(keys, src[0:4 * BB])
        server = await agent.serve_metrics(0)
        server.registry.register(StoreCollector(store))
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await within(reader.read())
        writer.close()
        body = raw.partition(b"\r\n\r\n")[2].decode()
        got = samples(body)
        lab = {"store": "kv", "tier": "host", "kind": "host"}
        assert value(got, "aioxfer_kv_hits_total", **lab) == 4
        assert value(got, "aioxfer_kv_puts_total", **lab) == 4
        assert ("aioxfer_transfers_posted_total", (("agent", agent.name),)) in got
        await server.aclose()


async def test_two_stores_of_one_name_are_not_exported_twice(make_agent: MakeAgent) -> None:
    """Two open stores of one name in one collector would export every series
    twice (Prometheus rejects such a scrape whole): the second is refused,
    in the constructor and in add(); once the first is closed, a store of
    its name replaces it. (Before: both were taken, every sample doubled.)"""
    a = await make_agent("kv-a")
    b = await make_agent("kv-b")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(4 * BB)], name="s") as s1, \
            kv.Store.open(b, block_bytes=BB, tiers=[kv.HostTier(4 * BB)], name="s") as s2:
        with pytest.raises(ValueError, match="'s'"):
            StoreCollector(s1, s2)
        collector = StoreCollector(s1)
        with pytest.raises(ValueError, match="'s'"):
            collector.add(s2)
        collector.add(s1)  # the same store again: no-op
        registry = CollectorRegistry(auto_describe=True)
        registry.register(collector)
        text = generate_latest(registry).decode()
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        assert len(lines) == len(set(lines)) and any('store="s"' in ln for ln in lines)
        await s1.aclose()
        collector.add(s2)  # the closed one of that name makes way
        text = generate_latest(registry).decode()
        lines = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and ln[0] != "#"]
        assert len(lines) == len(set(lines)), "a series exported twice"

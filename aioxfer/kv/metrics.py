"""Prometheus export of a KV store's statistics (needs ``prometheus_client``:
``pip install aioxfer[metrics]``; this module is imported only by whoever
uses it).

As with aioxfer.metrics, nothing runs per operation: the collector reads
``store.statistics()`` when Prometheus scrapes::

    from prometheus_client import REGISTRY
    from aioxfer.kv.metrics import StoreCollector
    REGISTRY.register(StoreCollector(store))

or beside the agent's own counters on the agent's endpoint::

    server = await agent.serve_metrics(9100)
    server.registry.register(StoreCollector(store))

Scrape from the store's event loop thread or accept counters a moment apart
(each is read whole; there is no lock). Metric names start with
``aioxfer_kv_``; labels: ``store``, ``tier`` and ``kind`` per tier,
``reason`` for evictions and dropped stores. Latencies are histograms of the
tier's medium, per batch (power-of-two microsecond buckets).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from aioxfer.kv.stats import LatencyHistogram
from aioxfer.metrics import add_named

if TYPE_CHECKING:
    from aioxfer.kv.store import Store

__all__ = ["StoreCollector"]

_TIER_COUNTERS = (
    ("lookups", "lookups", "Keys looked up (lookup, get, prefetch)"),
    ("hits", "hits", "Blocks found in the tier and read from it"),
    ("misses", "misses", "Gets that found no tier holding the next block"),
    ("hit_bytes", "hit_bytes", "Bytes of the blocks read from the tier"),
    ("miss_bytes", "miss_bytes", "Bytes of the blocks missed"),
    ("puts", "puts", "Blocks stored in the tier"),
    ("put_bytes", "put_bytes", "Bytes stored in the tier"),
    ("reads", "reads", "Transfers posted reading the tier's medium"),
    ("writes", "writes", "Transfers posted writing the tier's medium"),
    ("promotions", "promotions", "Blocks copied up into the tier on a hit below"),
    ("demotions", "demotions", "Blocks written back to the tier below"),
    ("coalesced", "coalesced", "Gets served by another get's fetch of the block"),
    ("checksum_failures", "checksum_failures", "Blocks whose checksum did not match"),
    ("quarantined", "quarantined", "Corrupt blocks taken out of the index"),
    ("errors", "errors", "I/O errors of the tier's medium"),
)
_TIER_GAUGES = (
    ("blocks", "blocks", "Blocks the tier holds"),
    ("used_bytes", "used_bytes", "Bytes the tier uses"),
    ("capacity_bytes", "capacity_bytes", "Bytes the tier may use"),
    ("in_flight", "in_flight", "Blocks being read from the tier now"),
    ("pinned_blocks", "pinned_blocks", "Blocks pinned by operations in flight"),
)
_STORE_GAUGES = (
    ("pinned_bytes", "pinned_bytes", "Bytes pinned by the store's operations in flight"),
    ("pins", "pins", "Pins held by operations in flight"),
    ("fetches_in_flight", "fetches_in_flight", "Blocks being fetched from lower tiers"),
)
_STORE_COUNTERS = (
    ("coalesced", "store_coalesced", "Gets that attached to a fetch in flight"),
    ("handoffs", "handoffs", "Fetches re-issued into staging after their leader left"),
    ("quarantined", "store_quarantined", "Corrupt blocks quarantined, all tiers"),
    ("pin_waits", "pin_waits", "Operations that waited for the pinned-bytes cap"),
)
_TIER = ["store", "tier", "kind"]


class StoreCollector(Collector):
    """A prometheus_client collector of one or more stores (held weakly: a
    dropped store disappears from the output; a closed one reports its last
    counters until an open store of its name is added). Store names are
    unique within a collector (see ``add``)."""

    def __init__(self, *stores: Store) -> None:
        self._stores: weakref.WeakSet[Store] = weakref.WeakSet()
        for store in stores:
            self.add(store)

    def add(self, store: Store) -> None:
        """Adds ``store``. Its name labels its samples: a second open store of
        the same name is refused (ValueError; the two would export the same
        series twice, and Prometheus rejects the whole scrape), a closed one
        of that name is replaced."""
        add_named(self._stores, store, "store")

    def remove(self, store: Store) -> None:
        self._stores.discard(store)

    def describe(self) -> Iterable[Metric]:
        yield from self._families().values()

    @staticmethod
    def _families() -> dict[str, Metric]:
        fams: dict[str, Metric] = {}
        for table, labels, counter in ((_TIER_COUNTERS, _TIER, True),
                                       (_TIER_GAUGES, _TIER, False),
                                       (_STORE_COUNTERS, ["store"], True),
                                       (_STORE_GAUGES, ["store"], False)):
            for _field, metric, doc in table:
                cls = CounterMetricFamily if counter else GaugeMetricFamily
                fams[metric] = cls(f"aioxfer_kv_{metric}", doc, labels=labels)
        fams["pinned_tier_bytes"] = GaugeMetricFamily(
            "aioxfer_kv_pinned_tier_bytes", "Bytes of the tier's blocks pinned now",
            labels=_TIER)
        fams["evictions"] = CounterMetricFamily(
            "aioxfer_kv_evictions", "Blocks that left the tier, by reason",
            labels=[*_TIER, "reason"])
        fams["dropped_stores"] = CounterMetricFamily(
            "aioxfer_kv_dropped_stores", "Blocks not stored (no room, not admitted, I/O error), "
            "by reason", labels=[*_TIER, "reason"])
        fams["read_seconds"] = HistogramMetricFamily(
            "aioxfer_kv_read_seconds", "Latency of a batch read from the tier's medium",
            labels=_TIER)
        fams["write_seconds"] = HistogramMetricFamily(
            "aioxfer_kv_write_seconds", "Latency of a batch written to the tier's medium",
            labels=_TIER)
        fams["tier_extra"] = GaugeMetricFamily(
            "aioxfer_kv_tier_extra", "Tier-specific numbers (disk: segments, compression "
            "ratio and state, ...)", labels=[*_TIER, "field"])
        return fams

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        for store in sorted(self._stores, key=lambda s: s.name):
            self._collect_store(store, fams)
        yield from fams.values()

    @staticmethod
    def _collect_store(store: Store, fams: dict[str, Metric]) -> None:
        st = store.statistics()
        name = store.name
        for field, metric, _ in (*_STORE_COUNTERS, *_STORE_GAUGES):
            _add(fams[metric], [name], getattr(st, field))
        bb = store.block_bytes
        for tier in store.tiers:
            ts = st.tiers[tier.name]
            labels = [name, ts.name, ts.kind]
            for field, metric, _ in (*_TIER_COUNTERS, *_TIER_GAUGES):
                _add(fams[metric], labels, getattr(ts, field))
            _add(fams["pinned_tier_bytes"], labels, ts.pinned_blocks * bb)
            for reason, n in sorted(ts.evictions.items()):
                _add(fams["evictions"], [*labels, reason], n)
            for reason, n in sorted(ts.dropped_stores.items()):
                _add(fams["dropped_stores"], [*labels, reason], n)
            _histogram(fams["read_seconds"], labels, tier.counters.read_latency)
            _histogram(fams["write_seconds"], labels, tier.counters.write_latency)
            for field, v in sorted(ts.extra.items()):
                if isinstance(v, int | float) and not isinstance(v, bool):
                    _add(fams["tier_extra"], [*labels, field], v)


def _add(fam: Metric, labels: list[str], value: float | bool) -> None:
    fam.add_metric(labels, float(value))  # type: ignore[attr-defined]


def _histogram(fam: Metric, labels: list[str], h: LatencyHistogram) -> None:
    buckets: list[tuple[str, float]] = []
    seen = 0
    for b, c in enumerate(h.counts):
        seen += c
        buckets.append((repr((1 << b) * 1e-6), float(seen)))
    buckets[-1] = ("+Inf", float(h.n))
    fam.add_metric(labels, buckets, h.total)  # type: ignore[attr-defined]

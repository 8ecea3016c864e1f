"""Per-tier counters and their frozen snapshots (``Store.statistics()``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["LatencyHistogram", "StoreStatistics", "TierStatistics"]


class LatencyHistogram:
    """Latencies in power-of-two microsecond buckets (1 µs .. ~1 min): O(1)
    per sample, fixed memory, percentiles good to a factor of two, which is
    what a dashboard needs from a hit path measured in microseconds."""

    __slots__ = ("counts", "n", "total")

    BUCKETS = 27

    def __init__(self) -> None:
        self.counts = [0] * self.BUCKETS
        self.n = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        us = seconds * 1e6
        b = 0 if us < 1.0 else min(self.BUCKETS - 1, int(math.log2(us)) + 1)
        self.counts[b] += 1
        self.n += 1
        self.total += seconds

    def quantile(self, q: float) -> float:
        """The upper bound, in seconds, of the bucket holding quantile ``q``."""
        if not self.n:
            return 0.0
        rank = q * self.n
        seen = 0
        for b, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return (1 << b) * 1e-6
        return (1 << (self.BUCKETS - 1)) * 1e-6


class TierCounters:
    """What a tier counts as it works (mutable; ``snapshot()`` freezes it)."""

    __slots__ = (
        "lookups", "hits", "misses", "hit_bytes", "miss_bytes", "puts", "put_bytes",
        "evictions", "promotions", "demotions", "dropped_stores", "coalesced",
        "checksum_failures", "quarantined", "errors", "in_flight", "read_latency",
        "write_latency", "reads", "writes",
    )

    def __init__(self) -> None:
        self.lookups = self.hits = self.misses = self.hit_bytes = self.miss_bytes = 0
        self.puts = self.put_bytes = self.promotions = self.demotions = 0
        self.coalesced = self.checksum_failures = self.quarantined = self.errors = 0
        self.in_flight = 0
        self.reads = self.writes = 0  # transfers posted to/from the tier's medium
        self.evictions: dict[str, int] = {}
        self.dropped_stores: dict[str, int] = {}
        self.read_latency = LatencyHistogram()
        self.write_latency = LatencyHistogram()

    def evicted(self, reason: str, n: int = 1) -> None:
        self.evictions[reason] = self.evictions.get(reason, 0) + n

    def dropped(self, reason: str, n: int = 1) -> None:
        self.dropped_stores[reason] = self.dropped_stores.get(reason, 0) + n


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """One tier's counters. Blocks unless ``_bytes``; latencies in seconds
    (p50/p99 of reads and writes of the tier's medium, per batch)."""

    name: str
    kind: str
    blocks: int
    used_bytes: int
    capacity_bytes: int
    lookups: int
    hits: int
    misses: int
    hit_bytes: int
    miss_bytes: int
    puts: int
    put_bytes: int
    reads: int
    writes: int
    promotions: int
    demotions: int
    coalesced: int
    checksum_failures: int
    quarantined: int
    errors: int
    in_flight: int
    pinned_blocks: int
    evictions: dict[str, int] = field(default_factory=dict)
    dropped_stores: dict[str, int] = field(default_factory=dict)
    read_p50: float = 0.0
    read_p99: float = 0.0
    write_p50: float = 0.0
    write_p99: float = 0.0
    extra: dict[str, int | float | str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """The store's snapshot: per tier (fastest first), plus what spans tiers."""

    tiers: dict[str, TierStatistics]
    pinned_bytes: int
    pins: int
    fetches_in_flight: int
    coalesced: int
    handoffs: int
    quarantined: int
    pin_waits: int = 0


def snapshot(name: str, kind: str, c: TierCounters, *, blocks: int, used_bytes: int,
             capacity_bytes: int, pinned_blocks: int,
             extra: dict[str, int | float | str] | None = None) -> TierStatistics:
    return TierStatistics(
        name=name, kind=kind, blocks=blocks, used_bytes=used_bytes,
        capacity_bytes=capacity_bytes, lookups=c.lookups, hits=c.hits, misses=c.misses,
        hit_bytes=c.hit_bytes, miss_bytes=c.miss_bytes, puts=c.puts, put_bytes=c.put_bytes,
        reads=c.reads, writes=c.writes, promotions=c.promotions, demotions=c.demotions,
        coalesced=c.coalesced, checksum_failures=c.checksum_failures,
        quarantined=c.quarantined, errors=c.errors, in_flight=c.in_flight,
        pinned_blocks=pinned_blocks, evictions=dict(c.evictions),
        dropped_stores=dict(c.dropped_stores),
        read_p50=c.read_latency.quantile(0.5), read_p99=c.read_latency.quantile(0.99),
        write_p50=c.write_latency.quantile(0.5), write_p99=c.write_latency.quantile(0.99),
        extra=dict(extra or {}),
    )

"""Routers (aioxfer.routing) over stub peers whose statistics() returns a real
PeerStatistics snapshot: load, measured speed, ties, lost peers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from aioxfer.errors import PeerLost
from aioxfer.routing import LeastLoaded, LowestExpectedCompletion, Router
from aioxfer.stats import PeerStatistics

MiB = 1 << 20


def make_stats(name: str, **kw: Any) -> PeerStatistics:
    base: dict[str, Any] = dict(
        name=name, address="127.0.0.1:1", path="tcp", lost=False, transfers_posted=0,
        transfers_completed=0, transfers_failed=0, bytes=0, in_flight=0,
    )
    return PeerStatistics(**{**base, **kw})


class StubPeer:
    def __init__(self, name: str, *, lost: bool = False, **stats: Any) -> None:
        self.name = name
        self.lost = lost
        self.stats = stats

    def statistics(self) -> PeerStatistics:
        return make_stats(self.name, **self.stats)

    def __repr__(self) -> str:
        return f"StubPeer({self.name!r})"


def choose(router: Router | Any, peers: Sequence[StubPeer], nbytes: int) -> str:
    return str(router.choose(peers, nbytes).name)  # type: ignore[arg-type]


ROUTERS = [LeastLoaded(), LowestExpectedCompletion()]


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: type(r).__name__)
def test_lost_peers_never_chosen(router: Any) -> None:
    a = StubPeer("a", lost=True)  # the fastest and idlest, but lost
    b = StubPeer("b", in_flight=3, in_flight_bytes=30 * MiB, bandwidth=1e9)
    c = StubPeer("c")
    c.stats["lost"] = True  # the snapshot says lost before peer.lost does
    assert choose(router, [a, b, c], MiB) == "b"
    with pytest.raises(PeerLost, match="no live peer"):
        router.choose([a, c], MiB)
    with pytest.raises(PeerLost):
        router.choose([], MiB)
    with pytest.raises(ValueError):
        router.choose([b], -1)


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: type(r).__name__)
def test_idle_pool_used_in_turn(router: Any) -> None:
    # Equal and idle: the one that has been given least so far, then by name.
    peers = [StubPeer(n, transfers_posted=p) for n, p in [("w2", 5), ("w0", 7), ("w1", 5)]]
    assert choose(router, peers, MiB) == "w1"


def test_least_loaded_by_outstanding_bytes_then_requests() -> None:
    r = LeastLoaded()
    a = StubPeer("a", in_flight=1, in_flight_bytes=8 * MiB)
    b = StubPeer("b", in_flight=4, in_flight_bytes=4 * MiB)
    assert choose(r, [a, b], MiB) == "b"
    # Queued bytes are load too: they go before a new request's.
    b.stats.update(queued=2, queued_bytes=6 * MiB)
    assert choose(r, [a, b], MiB) == "a"
    # Same bytes: fewer requests wins, whatever the order given.
    c = StubPeer("c", in_flight=2, in_flight_bytes=8 * MiB)
    assert choose(r, [c, a], MiB) == "a"
    assert choose(r, [a, c], MiB) == "a"
    # Speed is ignored by this router.
    a.stats["bandwidth"] = 1.0
    assert choose(r, [a, c], MiB) == "a"


def test_expected_completion_prefers_fast_over_idle() -> None:
    r = LowestExpectedCompletion()
    slow_idle = StubPeer("slow", bandwidth=1e8, latency=1e-3)  # 1 GiB: ~10.7 s
    fast_busy = StubPeer("fast", in_flight=2, in_flight_bytes=512 * MiB,
                         bandwidth=1e10, latency=1e-4)  # 1.5 GiB at 10 GB/s: ~0.16 s
    assert choose(r, [slow_idle, fast_busy], 1024 * MiB) == "fast"
    # A small request: the latencies decide.
    far = StubPeer("far", bandwidth=1e10, latency=5e-3)
    near = StubPeer("near", bandwidth=1e9, latency=1e-5)
    assert choose(r, [far, near], 4096) == "near"
    assert choose(r, [far, near], 1024 * MiB) == "far"


def test_expected_completion_counts_queued_and_request_size() -> None:
    r = LowestExpectedCompletion()
    a = StubPeer("a", in_flight_bytes=10 * MiB, bandwidth=2e9, latency=1e-4)
    b = StubPeer("b", in_flight_bytes=0, queued=3, queued_bytes=30 * MiB,
                 bandwidth=2e9, latency=1e-4)
    assert choose(r, [a, b], MiB) == "a"
    times = dict((p.name, t) for t, p in r.expected([a, b], MiB))
    assert times["a"] == pytest.approx(11 * MiB / 2e9 + 1e-4)
    assert times["b"] == pytest.approx(31 * MiB / 2e9 + 1e-4)


def test_unmeasured_peer_assumed_typical() -> None:
    r = LowestExpectedCompletion(default_bandwidth=1.0, default_latency=100.0)
    measured = [
        StubPeer("m0", in_flight_bytes=64 * MiB, bandwidth=1e9, latency=1e-4),
        StubPeer("m1", in_flight_bytes=64 * MiB, bandwidth=3e9, latency=3e-4),
    ]
    new = StubPeer("new", in_flight_bytes=0)  # just joined: bandwidth 0.0, latency 0.0
    # It gets the median (2 GB/s, 0.2 ms), not the absurd defaults: and being
    # idle, it is chosen.
    assert choose(r, [*measured, new], MiB) == "new"
    times = {p.name: t for t, p in r.expected([*measured, new], MiB)}
    assert times["new"] == pytest.approx(MiB / 2e9 + 2e-4)
    # Nobody measured: the defaults stand in for everyone.
    fresh = [StubPeer("x", in_flight_bytes=MiB), StubPeer("y")]
    times = {p.name: t for t, p in r.expected(fresh, 0)}
    assert times == {"x": pytest.approx(MiB / 1.0 + 100.0), "y": pytest.approx(100.0)}


def test_expected_completion_rejects_bad_defaults() -> None:
    bad: list[dict[str, Any]] = [
        {"default_bandwidth": 0.0}, {"default_bandwidth": float("inf")},
        {"default_latency": -1.0}, {"default_latency": float("nan")},
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            LowestExpectedCompletion(**kw)


def test_spreads_a_stream_of_requests() -> None:
    # Requests that stay in flight: the router balances by what it sees, and
    # sends a faster peer proportionally more (exactly so with no tolerance).
    r = LowestExpectedCompletion(tolerance=0.0, explore_every=None)
    peers = {n: StubPeer(n, bandwidth=bw, latency=1e-4)
             for n, bw in [("a", 1e9), ("b", 1e9), ("c", 2e9)]}
    counts = dict.fromkeys(peers, 0)
    for _ in range(400):
        p = r.choose(list(peers.values()), MiB)
        counts[p.name] += 1
        p.stats["in_flight_bytes"] = p.stats.get("in_flight_bytes", 0) + MiB
        p.stats["in_flight"] = p.stats.get("in_flight", 0) + 1
    assert counts["a"] + counts["b"] + counts["c"] == 400
    assert abs(counts["a"] - counts["b"]) <= 1
    assert abs(counts["c"] - 2 * counts["a"]) <= 2


def test_tolerance_spreads_over_nearly_equal_peers() -> None:
    # Noisy estimates of equal idle peers: the strict minimum would send all
    # to "a"; within the tolerance they are used in turn.
    peers = [StubPeer("a", bandwidth=5.0e9, latency=1e-4),
             StubPeer("b", bandwidth=4.2e9, latency=1e-4),
             StubPeer("c", bandwidth=1.0e9, latency=1e-4)]  # really slower: not used
    strict = LowestExpectedCompletion(tolerance=0.0, explore_every=None)
    loose = LowestExpectedCompletion(tolerance=0.25, explore_every=None)
    counts = dict.fromkeys("abc", 0)
    for _ in range(10):
        assert choose(strict, peers, 1 << 20) == "a"
        name = choose(loose, peers, 1 << 20)
        counts[name] += 1
        next(p for p in peers if p.name == name).stats["transfers_posted"] = counts[name]
    assert counts == {"a": 5, "b": 5, "c": 0}


def test_exploration_remeasures_a_starved_peer() -> None:
    # "c" measured slow once; without exploration it is never chosen again,
    # so its estimate never improves. Every 4th choice goes to the least used.
    peers = [StubPeer("a", bandwidth=5e9), StubPeer("b", bandwidth=5e9),
             StubPeer("c", bandwidth=1e8)]
    r = LowestExpectedCompletion(explore_every=4)
    picks = []
    for _ in range(12):
        p = r.choose(peers, 1 << 20)
        picks.append(p.name)
        p.stats["transfers_posted"] = p.stats.get("transfers_posted", 0) + 1
    assert [picks[i] for i in (3, 7, 11)] == ["c", "c", "c"]
    assert picks.count("c") == 3
    never = LowestExpectedCompletion(explore_every=None)
    assert all(never.choose(peers, 1 << 20).name != "c" for _ in range(50))
    with pytest.raises(ValueError):
        LowestExpectedCompletion(explore_every=1)
    with pytest.raises(ValueError):
        LowestExpectedCompletion(tolerance=-0.1)

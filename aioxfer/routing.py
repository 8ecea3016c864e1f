"""Routing: pick the peer a request should go to among candidates.

A router sees only what ``peer.statistics()`` reports (a frozen snapshot: in
flight, queued, measured bandwidth and latency), so it costs no I/O and can be
called once per request::

    router = aioxfer.routing.LowestExpectedCompletion()
    peer = router.choose(decode_peers, nbytes)      # raises PeerLost if all are lost
    await agent.write(src, peer.region("kv")[...], notify=b"...")

Lost peers are never chosen. A router is advice, not a guarantee: a peer can
die between ``choose`` and the write, which then fails with PeerLost, and the
caller chooses again among the others (see ``examples/kv_router.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from aioxfer.errors import PeerLost
from aioxfer.peer import Peer
from aioxfer.stats import PeerStatistics

__all__ = ["LeastLoaded", "LowestExpectedCompletion", "Router", "RoutablePeer"]

# Before a peer has a measurement these stand in (see LowestExpectedCompletion).
DEFAULT_BANDWIDTH = 1e9  # bytes/s: a modest same-host or 10 GbE figure
DEFAULT_LATENCY = 50e-6  # seconds: a small transfer on loopback


class RoutablePeer(Protocol):
    """What a router needs of a peer: ``aioxfer.Peer`` has it (and so can a
    test's stub)."""

    @property
    def name(self) -> str: ...

    @property
    def lost(self) -> bool: ...

    def statistics(self) -> PeerStatistics: ...


P = TypeVar("P", bound=RoutablePeer)


class Router(Protocol):
    """Chooses one of ``candidates`` for a request of ``nbytes``; raises
    PeerLost when every candidate is lost (or there is none)."""

    def choose(self, candidates: Sequence[Peer], nbytes: int) -> Peer: ...


@dataclass(frozen=True, slots=True)
class _Load:
    """The figures routers read from a statistics snapshot."""

    in_flight: int
    in_flight_bytes: int
    queued: int
    queued_bytes: int
    posted: int
    bandwidth: float
    latency: float

    @property
    def outstanding_bytes(self) -> int:
        return self.in_flight_bytes + self.queued_bytes

    @property
    def outstanding(self) -> int:
        return self.in_flight + self.queued


def _load(stats: PeerStatistics) -> _Load:
    return _Load(
        in_flight=stats.in_flight,
        in_flight_bytes=stats.in_flight_bytes,
        queued=stats.queued,
        queued_bytes=stats.queued_bytes,
        posted=stats.transfers_posted,
        bandwidth=stats.bandwidth,
        latency=stats.latency,
    )


def _live(candidates: Sequence[P]) -> list[tuple[P, _Load]]:
    """The candidates that are not lost, with their load; PeerLost if none."""
    live = []
    for peer in candidates:
        if peer.lost:
            continue
        stats = peer.statistics()
        if stats.lost:  # lost between the two reads: the snapshot is the later word
            continue
        live.append((peer, _load(stats)))
    if not live:
        names = ", ".join(repr(p.name) for p in candidates) or "none given"
        raise PeerLost(f"no live peer to route to (candidates: {names})")
    return live


def _check_nbytes(nbytes: int) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, not {nbytes}")


class LeastLoaded:
    """The peer with the fewest bytes outstanding (in flight plus queued in
    this agent's scheduler: both must drain before a new request's turn).
    Ties: fewer requests outstanding, then fewer transfers posted so far (so an
    idle pool is used in turn rather than always its first member), then name.

    Ignores speed: right for a pool of equal peers; for unequal ones (or a
    request size that matters) use :class:`LowestExpectedCompletion`.
    """

    __slots__ = ()

    def choose(self, candidates: Sequence[P], nbytes: int) -> P:
        _check_nbytes(nbytes)
        peer, _ = min(
            _live(candidates),
            key=lambda pl: (pl[1].outstanding_bytes, pl[1].outstanding, pl[1].posted, pl[0].name),
        )
        return peer


class LowestExpectedCompletion:
    """The peer expected to finish a new request of ``nbytes`` first:

        (in_flight_bytes + queued_bytes + nbytes) / bandwidth + latency

    with the peer's measured ``bandwidth`` (bytes/s) and ``latency`` (s).

    A peer not measured yet (0.0) is assumed typical: it gets the median of
    the measured candidates' figures, or ``default_bandwidth`` /
    ``default_latency`` when none is measured. That way a worker that just
    joined receives traffic (and so gets measured) instead of being avoided
    for looking slow, or flooded for looking infinitely fast.

    The measurements are moving averages of noisy samples (a transfer's time
    includes the event loop's delay in seeing it complete), and a peer is only
    measured when it is chosen. Taking the strict minimum would send an idle
    pool's traffic to whichever peer measured fastest last, and a peer that
    measured slow once would never be chosen, so never measured, again. Hence:

    - ``tolerance``: peers expected within ``(1 + tolerance)`` times the best
      time count as equally good; among them the one with fewer requests
      outstanding, then fewer transfers posted so far, then the first name
      wins (an idle pool of equal peers is used in turn);
    - ``explore_every``: every so many choices go to the live candidate that
      has been posted the fewest transfers, whatever its estimate, so a stale
      estimate is refreshed (``None``: never). A peer that really is slow then
      gets that share of the traffic and no more.
    """

    __slots__ = ("default_bandwidth", "default_latency", "tolerance", "explore_every", "_calls")

    def __init__(
        self,
        *,
        default_bandwidth: float = DEFAULT_BANDWIDTH,
        default_latency: float = DEFAULT_LATENCY,
        tolerance: float = 0.25,
        explore_every: int | None = 16,
    ) -> None:
        if not (default_bandwidth > 0 and math.isfinite(default_bandwidth)):
            raise ValueError(f"default_bandwidth must be a positive number of bytes/s, "
                             f"not {default_bandwidth!r}")
        if not (default_latency >= 0 and math.isfinite(default_latency)):
            raise ValueError(f"default_latency must be a non-negative number of seconds, "
                             f"not {default_latency!r}")
        if not (tolerance >= 0 and math.isfinite(tolerance)):
            raise ValueError(f"tolerance must be a non-negative fraction, not {tolerance!r}")
        if explore_every is not None and explore_every < 2:
            raise ValueError(f"explore_every must be at least 2 (or None), not {explore_every!r}")
        self.default_bandwidth = float(default_bandwidth)
        self.default_latency = float(default_latency)
        self.tolerance = float(tolerance)
        self.explore_every = explore_every
        self._calls = 0

    def expected(self, candidates: Sequence[P], nbytes: int) -> list[tuple[float, P]]:
        """Every live candidate with its expected completion time (seconds),
        in candidate order: what ``choose`` minimises, for logging and tests."""
        _check_nbytes(nbytes)
        return [(t, peer) for t, _, peer in self._estimates(_live(candidates), nbytes)]

    def choose(self, candidates: Sequence[P], nbytes: int) -> P:
        _check_nbytes(nbytes)
        live = _live(candidates)
        self._calls += 1
        if self.explore_every is not None and self._calls % self.explore_every == 0:
            return min(live, key=lambda pl: (pl[1].posted, pl[0].name))[0]
        estimates = self._estimates(live, nbytes)
        limit = min(e[0] for e in estimates) * (1.0 + self.tolerance)
        best = min(
            (e for e in estimates if e[0] <= limit),
            key=lambda e: (e[1].outstanding, e[1].posted, e[2].name),
        )
        return best[2]

    def _estimates(
        self, live: list[tuple[P, _Load]], nbytes: int
    ) -> list[tuple[float, _Load, P]]:
        bandwidth = _median([ld.bandwidth for _, ld in live if ld.bandwidth > 0])
        latency = _median([ld.latency for _, ld in live if ld.latency > 0])
        bw_guess = bandwidth if bandwidth is not None else self.default_bandwidth
        lat_guess = latency if latency is not None else self.default_latency
        out = []
        for peer, ld in live:
            bw = ld.bandwidth if ld.bandwidth > 0 else bw_guess
            lat = ld.latency if ld.latency > 0 else lat_guess
            out.append(((ld.outstanding_bytes + nbytes) / bw + lat, ld, peer))
        return out


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

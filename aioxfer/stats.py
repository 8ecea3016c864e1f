"""Statistics snapshots: frozen dataclasses, cheap to take, safe to keep."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aioxfer import _cyx

__all__ = ["AgentStatistics", "PeerStatistics", "RailStatistics"]

# The moving averages routers estimate completion times from (policy, applied
# by Engine.drain per completed transfer): a transfer of BANDWIDTH_MIN bytes or
# more is a bandwidth sample, a smaller one a latency sample; each sample
# weighs ESTIMATE_WEIGHT against the average so far (the first one is taken
# as it is).
BANDWIDTH_MIN = 64 << 10
ESTIMATE_WEIGHT = 0.2


@dataclass(slots=True)
class TransferCounters:
    """The live transfer counters of an agent (or a peer), typed: what the
    completion path updates and statistics() snapshots. Not public."""

    posted: int = 0
    completed: int = 0
    failed: int = 0
    bytes: int = 0

    @property
    def in_flight(self) -> int:
        return self.posted - self.completed - self.failed


# The live counters of one peer (see its docstring): a compiled class, its
# counts C integers that the submit, the drain and aioxfer.nixl's repost add
# to without making an int each (they were a dataclass's Python ints).
PeerCounters = _cyx.PeerCounters


@dataclass(frozen=True, slots=True)
class RailStatistics:
    """One path to a peer (one of its listen addresses), over its connections:
    ``up`` while at least one of them lives; ``bytes`` moved on it; ``rate``
    its measured bytes/s (0.0 until measured); ``reroutes``: request groups
    moved off it to other rails when its connections failed."""

    address: str
    up: bool
    connections: int
    bytes: int
    rate: float
    reroutes: int


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """Transfers this agent initiated towards one peer.

    ``in_flight`` counts transfers posted and not yet confirmed finished by the
    engine (a cancelled transfer stays in flight until the engine confirms it no
    longer touches its memory); ``in_flight_bytes`` their bytes. ``queued``
    and ``queued_bytes``: transfers posted but still waiting in this agent's
    scheduler for the peer's limits (not counted in flight until admitted).
    ``bandwidth`` (bytes/s) and ``latency`` (s) are moving averages over
    completed transfers (from 64 KiB on, and below 64 KiB), 0.0 until one
    completed: what routers estimate completion times from.
    ``rails``: one entry per path (tcp); ``reroutes``: request groups moved
    to other rails.
    """

    name: str
    address: str
    path: str
    lost: bool
    transfers_posted: int
    transfers_completed: int
    transfers_failed: int
    bytes: int
    in_flight: int
    in_flight_bytes: int = 0
    queued: int = 0
    queued_bytes: int = 0
    bandwidth: float = 0.0
    latency: float = 0.0
    rails: tuple[RailStatistics, ...] = ()
    reroutes: int = 0


@dataclass(frozen=True, slots=True)
class AgentStatistics:
    """One agent: its transfers (all peers), its regions and peers, and the
    engine's own counters (``native_*``, ``pinned_regions``: zero once everything
    is closed, which leak checks rely on)."""

    name: str
    address: str
    regions: int
    peers: int
    transfers_posted: int
    transfers_completed: int
    transfers_failed: int
    bytes: int
    in_flight: int
    native_ops: int
    native_regions: int
    native_endpoints: int
    native_conns: int
    native_bytes: int
    frames_rejected: int
    pinned_regions: int
    # Completion records the engine lost (its ring full and out of memory):
    # peers' notifications, connection closes, rails down, log lines. Each
    # loss is also logged (engine.log, at most once a second).
    records_lost: int = 0
    # tcp replies (acknowledgements, READ responses: a lone READ's up to
    # 1 MiB as it arrives) that the thread awaiting the transfer read off the
    # socket itself, a thread hand-off fewer each, instead of the
    # connection's receiver.
    replies_read_by_waiter: int = 0


def agent_statistics(
    name: str,
    address: str,
    *,
    regions: int,
    peers: int,
    counters: TransferCounters,
    native: Mapping[str, int],
    pinned_regions: int,
) -> AgentStatistics:
    """An AgentStatistics snapshot from the agent's counters and the engine's
    (``native``: Engine.stats(), or the last one taken before the engine closed)."""
    return AgentStatistics(
        name=name,
        address=address,
        regions=regions,
        peers=peers,
        transfers_posted=counters.posted,
        transfers_completed=counters.completed,
        transfers_failed=counters.failed,
        bytes=counters.bytes,
        in_flight=counters.in_flight,
        native_ops=native.get("ops", 0),
        native_regions=native.get("regions", 0),
        native_endpoints=native.get("endpoints", 0),
        native_conns=native.get("conns", 0),
        native_bytes=native.get("bytes", 0),
        frames_rejected=native.get("frames_rejected", 0),
        pinned_regions=pinned_regions,
        records_lost=native.get("cq_dropped", 0),
        replies_read_by_waiter=native.get("helped", 0),
    )

"""Statistics snapshots: frozen dataclasses, cheap to take, safe to keep."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AgentStatistics", "PeerStatistics"]


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """Transfers this agent initiated towards one peer.

    ``in_flight`` counts transfers posted and not yet confirmed finished by the
    engine (a cancelled transfer stays in flight until the engine confirms it no
    longer touches its memory).
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

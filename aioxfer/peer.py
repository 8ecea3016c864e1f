"""Peer: another agent this agent connected to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from aioxfer.region import RemoteRegion
from aioxfer.stats import PeerCounters, PeerStatistics, RailStatistics

if TYPE_CHECKING:
    from aioxfer.errors import XferError
    from aioxfer.scheduling import PeerScheduler
    from aioxfer.transfer import Transfer

__all__ = ["Peer"]


class PeerHost(Protocol):
    """All a Peer asks of the agent that made it (the agent's peer table,
    aioxfer.peertable.PeerTable, implements it).

    A Peer never reads the agent's state (engine, tables, counters): what it
    needs goes through these calls, each about one peer.
    """

    async def refresh(self, peer: Peer) -> None:
        """Re-fetches the peer's metadata and imports/forgets its regions."""

    async def notify(self, peer: Peer, payload: bytes | bytearray | memoryview) -> None:
        """Sends the peer one notification."""

    def close(self, peer: Peer) -> None:
        """Closes the agent's connections to the peer."""

    def error(self, peer: Peer) -> XferError:
        """The error a transfer to this (lost) peer fails with."""

    def rails(self, peer: Peer) -> list[tuple[int, bool, int, int, int]]:
        """(rail, live, bytes, rate in bytes/ms, reroutes) per connection the
        peer's endpoint ever had ([] once the agent or the peer is closed)."""


class Peer:
    """A connected peer agent: its metadata, its regions, the transport chosen.

    Made by ``await agent.connect(address)`` (or ``connect(name)`` with
    discovery). ``path`` is "shm" (same host: one memcpy or cross-memory attach),
    "verbs" (RDMA: one-sided WRITE and READ over queue pairs), "cuda" (same
    host, both with CUDA: GPU memory by CUDA IPC copies on CUDA streams, host
    memory as shm) or "tcp". A peer that dies, stops answering within the
    agent's ``peer_timeout``, leaves (discovery: its etcd key is deleted or its
    lease expires), or restarts becomes ``lost``: its pending transfers fail
    with PeerLost (StalePeer once a new incarnation of it is known), later ones
    too, and ``agent.connect(...)`` connects afresh.
    """

    __slots__ = (
        "_host",
        "name",
        "address",
        "incarnation",
        "path",
        "host_id",
        "pid",
        "_local",
        "_tag",
        "_ep",
        "_regions",
        "_by_rid",
        "_lost",
        "_lost_status",
        "_lost_reason",
        "_stale",
        "_closed",
        "_counters",
        "_rails",
        "_rail_conns",
        "_rails_down",
        "_probing",
        "_reroutes",
        "_sched",
        "__weakref__",
    )

    def __init__(
        self,
        host: PeerHost,
        *,
        name: str,
        address: str,
        incarnation: int,
        path: str,
        host_id: str,
        pid: int,
        ep: int,
    ) -> None:
        self._host = host
        self._local = ""  # same host: the peer's unix socket name (metadata refreshes)
        self._tag = 0  # its connections' tag in the engine
        self.name = name
        self.address = address
        self.incarnation = incarnation
        self.path = path
        self.host_id = host_id
        self.pid = pid
        self._ep = ep
        self._regions: dict[str, RemoteRegion] = {}
        self._by_rid: dict[int, RemoteRegion] = {}
        self._lost = False
        self._lost_status = 0
        self._lost_reason = ""  # why we dropped it, when we did (discovery, restart)
        self._stale = False
        self._closed = False
        # Updated by the agent's submission path and by Engine.drain (which
        # reads this attribute of a transfer's peer, and writes only the counters).
        self._counters = PeerCounters()
        self._rails: list[str] = [address]  # tcp: the peer's listen addresses
        self._rail_conns = 1  # connections wanted per rail
        self._rails_down: set[int] = set()
        self._probing: set[int] = set()
        self._reroutes = 0
        self._sched: PeerScheduler[Transfer] | None = None  # the agent's per-peer limits

    @property
    def lost(self) -> bool:
        """True once the peer died, timed out, restarted, or was closed."""
        return self._lost

    @property
    def regions(self) -> dict[str, RemoteRegion]:
        """The peer's regions by name, as of the last connect or refresh."""
        return dict(self._regions)

    def region(self, name: str) -> RemoteRegion:
        try:
            return self._regions[name]
        except KeyError:
            known = ", ".join(repr(n) for n in sorted(self._regions)) or "none"
            raise KeyError(
                f"peer {self.name!r} has no region {name!r} (known: {known}); if it was "
                f"registered after we connected, `await peer.refresh()` first"
            ) from None

    async def refresh(self) -> None:
        """Re-fetches the peer's metadata: imports regions it registered since,
        forgets regions it deregistered. Raises StalePeer if it restarted."""
        await self._host.refresh(self)

    async def notify(self, payload: bytes | bytearray | memoryview) -> None:
        """Sends a notification (1..4096 bytes); returns once the peer has it."""
        await self._host.notify(self, payload)

    async def aclose(self) -> None:
        """Closes this agent's connections to the peer; its pending transfers
        fail with ClosedResourceError. Idempotent."""
        self._host.close(self)

    def statistics(self) -> PeerStatistics:
        c = self._counters
        return PeerStatistics(
            name=self.name,
            address=self.address,
            path=self.path,
            lost=self._lost,
            transfers_posted=c.posted,
            transfers_completed=c.completed,
            transfers_failed=c.failed,
            bytes=c.bytes,
            in_flight=c.inflight,
            in_flight_bytes=c.inflight_bytes,
            queued=c.queued,
            queued_bytes=c.queued_bytes,
            bandwidth=c.bandwidth,
            latency=c.latency,
            rails=self._rail_statistics(),
            reroutes=self._reroutes,
        )

    @property
    def rails(self) -> list[str]:
        """The addresses this peer is reached by (tcp: one per rail)."""
        return list(self._rails)

    def _rail_statistics(self) -> tuple[RailStatistics, ...]:
        per: dict[int, list[int]] = {}  # rail -> [connections, live, bytes, rate, reroutes]
        if not self._lost:
            for rail, live, nbytes, rate, reroutes in self._host.rails(self):
                acc = per.setdefault(rail, [0, 0, 0, 0, 0])
                acc[0] += 1
                acc[1] += int(live)
                acc[2] += nbytes
                acc[3] += rate if live else 0
                acc[4] += reroutes
        out = []
        for i, address in enumerate(self._rails):
            _conns, live_conns, nbytes, rate, reroutes = per.get(i, [0, 0, 0, 0, 0])
            out.append(RailStatistics(
                address=address,
                up=bool(live_conns) and not self._lost,
                connections=live_conns,
                bytes=nbytes,
                rate=rate * 1000.0,  # the engine measures bytes per millisecond
                reroutes=reroutes,
            ))
        return tuple(out)

    # ------------------------------------------------------------ owner side
    # What the agent and its collaborators change on a Peer, by name.

    def _dropped(self, reason: str) -> None:
        """The agent drops this peer (discovery, restart): why, for its errors."""
        self._lost_reason = reason

    def _mark_stale(self) -> None:
        """A newer incarnation of this peer is known: its handles are fenced."""
        self._stale = True

    def _rerouted(self, moved: int) -> None:
        """The engine moved ``moved`` request groups off a failed connection."""
        self._reroutes += moved

    def _rail_is_down(self, rail: int) -> bool:
        return rail in self._rails_down

    def _rail_down(self, rail: int) -> None:
        self._rails_down.add(rail)

    def _rail_up(self, rail: int) -> bool:
        """Marks ``rail`` up again; True if it was down."""
        if rail not in self._rails_down:
            return False
        self._rails_down.discard(rail)
        return True

    def _probe_begin(self, rail: int) -> bool:
        """True if nobody re-dials ``rail`` yet (the caller does from now on)."""
        if rail in self._probing:
            return False
        self._probing.add(rail)
        return True

    def _probe_end(self, rail: int) -> None:
        self._probing.discard(rail)

    def _lost_error(self) -> XferError:
        return self._host.error(self)

    def __repr__(self) -> str:
        state = " lost" if self._lost else ""
        return f"<Peer {self.name!r} at {self.address} path={self.path}{state}>"

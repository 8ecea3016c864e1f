"""Peer: another agent this agent connected to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioxfer.region import RemoteRegion
from aioxfer.stats import PeerStatistics

if TYPE_CHECKING:
    from aioxfer.agent import Agent
    from aioxfer.errors import XferError

__all__ = ["Peer"]


class Peer:
    """A connected peer agent: its metadata, its regions, the transport chosen.

    Made by ``await agent.connect(address)`` (or ``connect(name)`` with
    discovery). ``path`` is "shm" (same host: one memcpy or cross-memory attach)
    or "tcp". A peer that dies, stops answering within the agent's
    ``peer_timeout``, leaves (discovery: its etcd key is deleted or its lease
    expires), or restarts becomes ``lost``: its pending transfers fail with
    PeerLost (StalePeer once a new incarnation of it is known), later ones too,
    and ``agent.connect(...)`` connects afresh.
    """

    __slots__ = (
        "_agent",
        "name",
        "address",
        "incarnation",
        "path",
        "host_id",
        "pid",
        "_ep",
        "_regions",
        "_by_rid",
        "_lost",
        "_lost_status",
        "_lost_reason",
        "_stale",
        "_closed",
        "_posted",
        "_completed",
        "_failed",
        "_bytes",
        "_inflight",
        "__weakref__",
    )

    def __init__(
        self,
        agent: Agent,
        *,
        name: str,
        address: str,
        incarnation: int,
        path: str,
        host_id: str,
        pid: int,
        ep: int,
    ) -> None:
        self._agent = agent
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
        self._posted = 0
        self._completed = 0
        self._failed = 0
        self._bytes = 0
        self._inflight = 0

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
        await self._agent._refresh_peer(self)

    async def notify(self, payload: bytes | bytearray | memoryview) -> None:
        """Sends a notification (1..4096 bytes); returns once the peer has it."""
        await self._agent._notify_peer(self, payload)

    async def aclose(self) -> None:
        """Closes this agent's connections to the peer; its pending transfers
        fail with ClosedResourceError. Idempotent."""
        self._agent._close_peer(self)

    def statistics(self) -> PeerStatistics:
        return PeerStatistics(
            name=self.name,
            address=self.address,
            path=self.path,
            lost=self._lost,
            transfers_posted=self._posted,
            transfers_completed=self._completed,
            transfers_failed=self._failed,
            bytes=self._bytes,
            in_flight=self._inflight,
        )

    def _lost_error(self) -> XferError:
        return self._agent._peer_error(self)

    def __repr__(self) -> str:
        state = " lost" if self._lost else ""
        return f"<Peer {self.name!r} at {self.address} path={self.path}{state}>"

"""The agent's view of the cluster's members, and the membership() streams.

A collaborator of :class:`aioxfer.Agent` (as asyncpg's ``connect_utils`` is of
its ``Connection``): it holds what etcd says about the other agents, fences
peers of a name that restarted, drops peers whose key went away, and fans
membership events out to every ``agent.membership()`` iterator. It reaches the
agent only through the narrow arguments it was built with, never its state.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from aioxfer.discovery import (
    Membership,
    MembershipEvent,
    PeerJoined,
    PeerLeft,
    PeerUpdated,
    diff_regions,
    region_names,
)
from aioxfer.errors import XferError
from aioxfer.log import get_logger

if TYPE_CHECKING:
    from aioxfer.metadata import AgentMeta
    from aioxfer.peer import Peer

__all__ = ["Members"]

_log = get_logger("aioxfer")


class Members:
    """Etcd's members (all but this agent), fencing, and membership events.

    ``peers_by_name`` maps a name to the
    Peers made for it; ``refresh_peer`` re-fetches a connected peer's metadata;
    ``drop_peer`` marks a peer lost for a reason and closes its endpoint;
    ``closed`` says whether the agent is closed.
    """

    __slots__ = (
        "_agent",
        "_members",
        "_subscribers",
        "_peers_by_name",
        "_refresh_peer",
        "_drop_peer",
        "_closed",
    )

    def __init__(
        self,
        agent: str,
        *,
        peers_by_name: Mapping[str, Iterable[Peer]],
        refresh_peer: Callable[[Peer], Awaitable[None]],
        drop_peer: Callable[[Peer, str], None],
        closed: Callable[[], bool],
    ) -> None:
        self._agent = agent
        self._members: dict[str, AgentMeta] = {}  # etcd's view, all but us
        self._subscribers: weakref.WeakSet[Membership] = weakref.WeakSet()
        self._peers_by_name = peers_by_name
        self._refresh_peer = refresh_peer
        self._drop_peer = drop_peer
        self._closed = closed

    # ------------------------------------------------------------ streams

    def subscribe(self, initial: list[MembershipEvent]) -> Membership:
        """A new membership() iterator that starts with ``initial``."""
        sub = Membership(initial, self._subscribers.discard)
        self._subscribers.add(sub)
        return sub

    def close(self) -> None:
        """The agent closed: every membership() iterator ends."""
        self._members.clear()
        for stream in list(self._subscribers):
            stream._end()
        self._subscribers.clear()

    def snapshot(self) -> list[MembershipEvent]:
        """A PeerJoined for every member etcd knows of."""
        return [
            PeerJoined(m.name, m.incarnation, m.address, region_names(m))
            for m in self._members.values()
        ]

    def emit(self, event: MembershipEvent) -> None:
        for sub in list(self._subscribers):
            sub._put(event)
        _log.debug("membership." + type(event).__name__, agent=self._agent, peer=event.name,
                   incarnation=f"{event.incarnation:#x}", address=event.address)

    # ------------------------------------------------------------ etcd's view
    # (discovery.MemberListener: what an EtcdSession reports)

    async def reset(self, members: dict[str, AgentMeta]) -> None:
        """etcd's full list (at join, and after a watch had to restart): what
        we knew is brought in line with it."""
        for name in [n for n in self._members if n not in members]:
            await self.deleted(name)
        for meta in members.values():
            await self.put(meta)

    async def put(self, meta: AgentMeta) -> None:
        if self._closed():
            return
        old = self._members.get(meta.name)
        self._members[meta.name] = meta
        if old is not None and old.incarnation == meta.incarnation:
            added, removed = diff_regions(old, meta)
            moved = old.address != meta.address
            if not (added or removed or moved):
                return
            # Connected peers learn the new regions from the peer itself (keys
            # never come from etcd) before anyone hears of them.
            for peer in self.live_peers(meta.name, meta.incarnation):
                try:
                    await self._refresh_peer(peer)
                except XferError as exc:
                    _log.info("peer.refresh_failed", agent=self._agent, peer=peer.name,
                              reason=str(exc))
            self.emit(
                PeerUpdated(meta.name, meta.incarnation, meta.address, added, removed,
                            old.address if moved else None)
            )
            return
        # A new member, or a new incarnation of one: whatever we hold of any
        # other incarnation of that name is fenced.
        self.fence(meta.name, meta.incarnation, None)
        if old is not None:
            self.emit(PeerLeft(old.name, old.incarnation, old.address, "restarted"))
        self.emit(PeerJoined(meta.name, meta.incarnation, meta.address, region_names(meta)))

    async def deleted(self, name: str) -> None:
        old = self._members.pop(name, None)
        if old is None or self._closed():
            return
        for peer in self.live_peers(name, old.incarnation):
            self._drop_peer(peer, "its etcd key was deleted (it left, or its lease expired)")
        self.emit(PeerLeft(old.name, old.incarnation, old.address, "left"))

    # ------------------------------------------------------------ fencing

    def live_peers(self, name: str, incarnation: int) -> list[Peer]:
        return [
            p for p in self._peers_by_name.get(name, ())
            if not p.lost and p.incarnation == incarnation
        ]

    def fence(self, name: str, incarnation: int, address: str | None) -> None:
        """Peer ``name`` is now ``incarnation``: every Peer we made for another
        incarnation of it (at ``address`` only, when given) becomes stale, so
        transfers from its handles fail with StalePeer, and never reach the new
        process."""
        for p in list(self._peers_by_name.get(name, ())):
            if p.incarnation == incarnation or p._closed:
                continue
            if address is not None and p.address != address:
                continue
            p._mark_stale()
            self._drop_peer(p, "it restarted")

"""The agent's view of the cluster's members, and the membership() streams.

A collaborator of :class:`aioxfer.Agent` (as asyncpg's ``connect_utils`` is of
its ``Connection``): it holds what etcd says about the other agents, fences
peers of a name that restarted, drops peers whose key went away, and fans
membership events out to every ``agent.membership()`` iterator. It reaches the
agent only through the narrow arguments it was built with, never its state.
"""

from __future__ import annotations

import asyncio
import logging
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
    retrieve_exception,
)
from aioxfer.errors import XferError
from aioxfer.log import get_logger

if TYPE_CHECKING:
    from aioxfer.metadata import AgentMeta
    from aioxfer.peer import Peer

__all__ = ["Members"]

_log = get_logger("aioxfer")


def _debug_on() -> bool:
    """Whether _log writes debug lines (True where the logger cannot say: an
    application's own structlog configuration without is_enabled_for)."""
    enabled = getattr(_log, "is_enabled_for", None)
    return True if enabled is None else bool(enabled(logging.DEBUG))


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
        "_outbox",
        "_workers",
        "_refreshing",
        "_missing",
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
        # Per member with a metadata refresh on the side: its events in order
        # (each with whether its live peers are refreshed before it is told),
        # the task that tells them, and the refresh it waits for.
        self._outbox: dict[str, list[tuple[MembershipEvent, bool]]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._refreshing: dict[str, tuple[Peer, asyncio.Task[None]]] = {}
        # Members a re-list did not find, each until its grace ends (or its
        # key comes back): see reset().
        self._missing: dict[str, asyncio.TimerHandle] = {}

    # ------------------------------------------------------------ streams

    def subscribe(self, initial: list[MembershipEvent]) -> Membership:
        """A new membership() iterator that starts with ``initial``."""
        sub = Membership(initial, self._subscribers.discard)
        self._subscribers.add(sub)
        return sub

    def close(self) -> None:
        """The agent closed: every membership() iterator ends."""
        self._members.clear()
        self._forgive_all()
        for _, task in self._refreshing.values():
            task.cancel()
        for task in self._workers.values():
            task.cancel()
        self._outbox.clear()
        self._workers.clear()
        self._refreshing.clear()
        for stream in list(self._subscribers):
            stream._end()
        self._subscribers.clear()

    def snapshot(self) -> list[MembershipEvent]:
        """A PeerJoined for every member etcd knows of."""
        return [
            PeerJoined(m.name, m.incarnation, m.address, region_names(m))
            for m in self._members.values()
        ]

    def heard(self) -> bool:
        """Whether an event emitted now reaches anyone: a membership()
        iterator, or a debug line that is written. Nobody listening, a caller
        may skip making one (a connect's PeerJoined, its regions sorted, was
        ~0.03 ms of a first connect's path to its first write; a later
        membership() starts with the connected peers all the same)."""
        return bool(self._subscribers) or _debug_on()

    def emit(self, event: MembershipEvent) -> None:
        for sub in list(self._subscribers):
            sub._put(event)
        # Its fields are formatted only for a debug log that is written (they
        # were on every event, each PeerUpdated of every region change).
        if _debug_on():
            _log.debug("membership." + type(event).__name__, agent=self._agent,
                       peer=event.name, incarnation=f"{event.incarnation:#x}",
                       address=event.address)

    # ------------------------------------------------------------ etcd's view
    # (discovery.MemberListener: what an EtcdSession reports)

    async def reset(self, members: dict[str, AgentMeta], grace: float = 0.0) -> None:
        """etcd's full list (at join, and after a watch had to restart): what
        we knew is brought in line with it.

        ``grace``: seconds a member missing from the list stays a member, so
        that it may put its key back. An etcd restarted without its data
        lists nobody at first: each member puts its key again only once its
        keepalive finds its lease gone (within a third of its ttl), and
        dropping them all at once failed every live peer's transfers."""
        for name in [n for n in self._members if n not in members]:
            if grace <= 0:
                await self.deleted(name)
            elif name not in self._missing:
                self._missing[name] = asyncio.get_running_loop().call_later(
                    grace, self._grace_over, name)
        for meta in members.values():
            await self.put(meta)

    def forget(self) -> None:
        """We stopped following etcd (a join undone): every member we had
        reported leaves our view (PeerLeft "left"), so that membership()
        shows no member of a cluster we are not in. Peers stay connected:
        nothing says they went."""
        self._forgive_all()
        members, self._members = self._members, {}
        for old in members.values():
            self._stop_refresh(old.name)
            self._report(old.name, PeerLeft(old.name, old.incarnation, old.address, "left"))

    def _forgive_all(self) -> None:
        for handle in self._missing.values():
            handle.cancel()
        self._missing.clear()

    def _grace_over(self, name: str) -> None:
        if self._missing.pop(name, None) is not None:
            self._delete(name)

    async def put(self, meta: AgentMeta) -> None:
        if self._closed():
            return
        missing = self._missing.pop(meta.name, None)
        if missing is not None:
            missing.cancel()
        old = self._members.get(meta.name)
        self._members[meta.name] = meta
        if old is not None and old.incarnation == meta.incarnation:
            added, removed = diff_regions(old, meta)
            moved = old.address != meta.address
            if not (added or removed or moved):
                return
            # Connected peers learn the new regions from the peer itself (keys
            # never come from etcd) before anyone hears of them: on the side,
            # since a frozen peer answers only at its peer timeout, and etcd's
            # events (anyone's, and a forged PUT is one) must not wait for it.
            self._report(
                meta.name,
                PeerUpdated(meta.name, meta.incarnation, meta.address, added, removed,
                            old.address if moved else None),
                refresh=bool(self.live_peers(meta.name, meta.incarnation)),
            )
            return
        # A new member, or a new incarnation of one: whatever we hold of any
        # other incarnation of that name is fenced.
        self.fence(meta.name, meta.incarnation, None)
        if old is not None:
            self._report(meta.name, PeerLeft(old.name, old.incarnation, old.address, "restarted"))
        self._report(meta.name,
                     PeerJoined(meta.name, meta.incarnation, meta.address, region_names(meta)))

    async def deleted(self, name: str) -> None:
        self._delete(name)

    def _delete(self, name: str) -> None:
        missing = self._missing.pop(name, None)
        if missing is not None:
            missing.cancel()
        old = self._members.pop(name, None)
        if old is None or self._closed():
            return
        for peer in self.live_peers(name, old.incarnation):
            self._drop_peer(peer, "its etcd key was deleted (it left, or its lease expired)")
        self._stop_refresh(name)
        self._report(name, PeerLeft(old.name, old.incarnation, old.address, "left"))

    # ------------------------------------------------------------ refreshing

    def _report(self, name: str, event: MembershipEvent, refresh: bool = False) -> None:
        """Emits ``event`` now, or, when ``refresh`` or when an earlier event
        of ``name`` still waits for its refresh, once those refreshes are done
        (a member's events stay in order)."""
        box = self._outbox.get(name)
        if box is None:
            if not refresh:
                self.emit(event)
                return
            box = self._outbox[name] = []
            self._workers[name] = asyncio.get_running_loop().create_task(
                self._tell(name, box), name=f"aioxfer-refresh-{self._agent}-{name}"
            )
        box.append((event, refresh))

    async def _tell(self, name: str, box: list[tuple[MembershipEvent, bool]]) -> None:
        """Refreshes ``name``'s live peers, then emits what waited for it; one
        refresh for all the updates that came meanwhile."""
        try:
            while box:
                batch = box[:]
                del box[:]
                updates = [ev for ev, refresh in batch if refresh]
                if updates:
                    await self._refresh(name, updates[-1].incarnation)
                for ev, _ in batch:
                    self.emit(ev)
        finally:
            if self._outbox.get(name) is box:
                del self._outbox[name]
                del self._workers[name]

    async def _refresh(self, name: str, incarnation: int) -> None:
        for peer in self.live_peers(name, incarnation):
            task = asyncio.get_running_loop().create_task(self._refresh_one(peer))
            # Reported (peer.refresh_failed) by whoever waited for it;
            # retrieved so that a refresh left behind by a close is never
            # logged as unretrieved.
            task.add_done_callback(retrieve_exception)
            self._refreshing[name] = (peer, task)
            try:
                # Bounded by the peer timeout; cut short when the member goes
                # (its peer is dropped: there is nothing left to refresh).
                await asyncio.wait([task])
            finally:
                task.cancel()
                if self._refreshing.get(name, (None, None))[1] is task:
                    del self._refreshing[name]
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                _log.info("peer.refresh_failed", agent=self._agent, peer=peer.name,
                          reason=str(exc) if isinstance(exc, XferError) else repr(exc))

    async def _refresh_one(self, peer: Peer) -> None:
        await self._refresh_peer(peer)

    def _stop_refresh(self, name: str, peer: Peer | None = None) -> None:
        """Cuts short the refresh of ``name``'s peer (``peer`` only, if given):
        it was dropped."""
        held = self._refreshing.get(name)
        if held is not None and (peer is None or held[0] is peer):
            held[1].cancel()

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
            self._stop_refresh(name, p)

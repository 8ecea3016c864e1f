"""PeerTable: an agent's peers, and what a Peer asks of its agent.

A collaborator of :class:`aioxfer.Agent` (issue 10, item 8): it holds the
tables that find a peer (by address, endpoint, incarnation and name), marks
peers lost (failing what waits for them in their scheduler, forgetting them,
saying so), closes and drops them, and implements
:class:`~aioxfer.peer.PeerHost`, the only way a :class:`~aioxfer.peer.Peer`
reaches its agent. It reaches the agent only through the narrow arguments it
was built with; connecting (and re-fetching a peer's metadata) stays with the
agent, which hands it ``refresh``.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aioxfer import _cyx
from aioxfer.discovery import MembershipEvent, PeerLeft
from aioxfer.errors import ClosedResourceError, PeerLost, StalePeer, XferError
from aioxfer.log import get_logger

if TYPE_CHECKING:
    from aioxfer.peer import Peer
    from aioxfer.transfer import Transfer

__all__ = ["PeerTable", "notify_payload"]

_log = get_logger("aioxfer")

_E_CLOSED = _cyx.E_CLOSED
_E_PEER_LOST = _cyx.E_PEER_LOST

# by_name's least size at which add() sweeps it (PeerTable._sweep)
_SWEEP_MIN = 64

# (rail, live, bytes, rate in bytes/ms, reroutes) per connection (Engine.endpoint_rails)
RailConn = tuple[int, bool, int, int, int]


class PeerTable:
    """The peers of one agent.

    ``agent``: the agent's name (logs, errors); ``engine``: its native engine
    (endpoint_close, endpoint_rails); ``closed()``: whether the agent is
    closed; ``submit(peer, opcode, descs, notify, nbytes, op)``: posts a
    request (Submission.submit); ``refresh(peer)``: re-fetches a peer's
    metadata (the agent's connect machinery); ``fail_queued(peer)``: fails
    what waits in a lost peer's scheduler; ``tag_unref(tag)``: a lost peer's
    endpoint no longer holds its connections' tag; ``emit(event)``:
    membership events (PeerLeft), None when discovery reports them instead.
    """

    __slots__ = (
        "_agent",
        "_engine",
        "_closed",
        "_submit",
        "_refresh",
        "_fail_queued",
        "_tag_unref",
        "_emit",
        "by_addr",
        "by_ep",
        "by_inc",
        "by_name",
        "_sweep_at",
        "unreported",
    )

    def __init__(
        self,
        agent: str,
        *,
        engine: _cyx.Engine,
        closed: Callable[[], bool],
        submit: Callable[[Peer, int, None, bytes, int, str], Transfer],
        refresh: Callable[[Peer], Awaitable[None]],
        fail_queued: Callable[[Peer], None],
        tag_unref: Callable[[int], None],
        emit: Callable[[MembershipEvent], None] | None,
    ) -> None:
        self._agent = agent
        self._engine = engine
        self._closed = closed
        self._submit = submit
        self._refresh = refresh
        self._fail_queued = fail_queued
        self._tag_unref = tag_unref
        self._emit = emit
        self.by_addr: dict[str, Peer] = {}  # every address we reached it by
        self.by_ep: dict[int, Peer] = {}  # live peers by endpoint
        self.by_inc: dict[tuple[str, int], Peer] = {}
        # every Peer made per name, lost ones too: a new incarnation fences them all
        self.by_name: dict[str, weakref.WeakSet[Peer]] = {}
        # by_name's size at which add() next drops the names whose Peers are
        # all gone (a WeakSet empties, its key stays): see add().
        self._sweep_at = _SWEEP_MIN
        # endpoint -> a peer marked lost at a refused post (refused) whose
        # loss the engine has not reported yet: its report waits for the
        # record, which says whether it said goodbye.
        self.unreported: dict[int, Peer] = {}

    def add(self, peer: Peer, address: str) -> None:
        """A peer just connected (at ``address``)."""
        self.by_addr[address] = peer
        self.by_ep[peer._ep] = peer
        self.by_inc[(peer.name, peer.incarnation)] = peer
        peers = self.by_name.get(peer.name)
        if peers is None:
            if len(self.by_name) >= self._sweep_at:
                self._sweep()
            peers = self.by_name[peer.name] = weakref.WeakSet()
        peers.add(peer)

    def _sweep(self) -> None:
        """Drops the names none of whose Peers is left (collected): a cluster
        whose names churn (a new name per restart or per job) grew by_name
        by one empty WeakSet per name ever connected, for ever. Amortised:
        the next sweep waits until the table has doubled, so by_name stays
        within twice the names with a Peer alive (or _SWEEP_MIN). In place:
        Members holds this very dict."""
        for name in [n for n, peers in self.by_name.items() if not peers]:
            del self.by_name[name]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(self.by_name))

    def live(self) -> list[Peer]:
        return list(self.by_ep.values())

    def clear(self) -> None:
        """The agent closed (its peers are marked lost first)."""
        for peer in self.unreported.values():
            # (the engine, shut down and drained, never reported it: should
            # not happen) said as what we know: lost
            self._report(peer, log=True, bye=False)
        self.unreported.clear()
        self.by_addr.clear()
        self.by_inc.clear()
        self.by_name.clear()
        self._sweep_at = _SWEEP_MIN

    # ------------------------------------------------------------ losing peers

    def mark_lost(self, peer: Peer, status: int, *, log: bool = True, bye: bool = False) -> None:
        """bye: the peer said goodbye (its agent closed cleanly): reported as
        closed, not lost (its transfers in flight still fail PeerLost)."""
        if peer._lost:
            return
        self._forget(peer, status)
        self._report(peer, log=log, bye=bye)

    def lost_record(self, ep: int, status: int, *, log: bool, bye: bool) -> bool:
        """The engine's loss record of endpoint ep (EngineEvents): marks its
        peer lost, or says how a peer marked lost at a refused post ended.
        False: no peer of ours has that endpoint (one still connecting)."""
        peer = self.by_ep.get(ep)
        if peer is not None:
            self.mark_lost(peer, status, log=log, bye=bye)
            return True
        peer = self.unreported.pop(ep, None)
        if peer is None:
            return False
        self._report(peer, log=log, bye=bye)
        return True

    def refused(self, peer: Peer, status: int) -> None:
        """The engine refused a post to peer (AXF_E_PEER_LOST) before its
        loss record reached us: the endpoint is dead, and the record is on
        its way (or in the ring, not drained yet). The peer is lost now, so
        that a retry never picks it again; how it ended (a goodbye: closed,
        else lost) is said when the record comes, from what the engine
        recorded (mark_lost). Said here, it was always a loss (spread18)."""
        if peer._lost:
            return
        self._forget(peer, status)
        self.unreported[peer._ep] = peer

    def _forget(self, peer: Peer, status: int) -> None:
        """Marks peer lost: fails what waits in its scheduler, drops it from
        the tables."""
        peer._lost = True
        peer._lost_status = status
        self._fail_queued(peer)  # never reached the engine: fail them here
        if self.by_ep.get(peer._ep) is peer:
            del self.by_ep[peer._ep]
            self._tag_unref(peer._tag)
        key = (peer.name, peer.incarnation)
        if self.by_inc.get(key) is peer:
            del self.by_inc[key]
        for addr in [a for a, p in self.by_addr.items() if p is peer]:
            del self.by_addr[addr]

    def _report(self, peer: Peer, *, log: bool, bye: bool) -> None:
        """Says that peer (marked lost) is gone: a log line, PeerLeft."""
        bye = bye and not peer._stale
        if log and bye:
            _log.info("peer.closed", agent=self._agent, peer=peer.name, address=peer.address,
                      path=peer.path, reason="closed by the peer",
                      in_flight=peer._counters.inflight)
        elif log:
            _log.warning(
                "peer.stale" if peer._stale else "peer.lost",
                agent=self._agent,
                peer=peer.name,
                address=peer.address,
                path=peer.path,
                reason=peer._lost_reason or _cyx.strerror(peer._lost_status),
                in_flight=peer._counters.inflight,
            )
        if self._emit is not None and not self._closed():
            reason = "restarted" if peer._stale else "closed" if peer._closed or bye else "lost"
            self._emit(PeerLeft(peer.name, peer.incarnation, peer.address, reason))

    def drop(self, peer: Peer, reason: str) -> None:
        """Marks peer lost and closes its endpoint, which fails its pending
        transfers (PeerLost, or StalePeer once fenced) now."""
        if peer.lost:
            return
        peer._dropped(reason)
        self.mark_lost(peer, _E_PEER_LOST)
        if not self._closed():
            try:
                self._engine.endpoint_close(peer._ep)
            except _cyx.NativeError:
                pass

    # ------------------------------------------------------------ PeerHost

    async def refresh(self, peer: Peer) -> None:
        """Re-fetches the peer's metadata and imports/forgets its regions."""
        await self._refresh(peer)

    async def notify(self, peer: Peer, payload: bytes | bytearray | memoryview) -> None:
        """Sends the peer one notification."""
        if self._closed():
            raise ClosedResourceError(f"agent {self._agent!r} is closed")
        if peer._host is not self:
            raise ValueError(f"{peer!r} is a peer of another agent")
        await self._submit(peer, _cyx.OP_NOTIFY, None, notify_payload(payload), 0, "notify")

    def close(self, peer: Peer) -> None:
        """Closes the agent's connections to the peer."""
        if peer._lost or self._closed():
            return
        peer._closed = True
        self.mark_lost(peer, _E_CLOSED, log=False)
        try:
            self._engine.endpoint_close(peer._ep)
        except _cyx.NativeError:
            pass
        _log.info("peer.closed", agent=self._agent, peer=peer.name, address=peer.address)

    def rails(self, peer: Peer) -> list[RailConn]:
        """The engine's per-connection records of peer's endpoint ([] once closed)."""
        if self._closed():
            return []
        return self._engine.endpoint_rails(peer._ep)

    def error(self, peer: Peer) -> XferError:
        """The error a transfer to this (lost) peer fails with."""
        where = f"peer {peer.name!r} at {peer.address}"
        if peer._stale:
            return StalePeer(f"{where} restarted: connect again", peer=peer.name)
        if peer._closed or (self._closed() and peer._lost_status == _E_CLOSED):
            return ClosedResourceError(f"{where} was closed", peer=peer.name)
        why = peer._lost_reason or _cyx.strerror(peer._lost_status)
        return PeerLost(
            f"{where} is lost ({why}): connect again",
            status=peer._lost_status,
            peer=peer.name,
        )


def notify_payload(payload: bytes | bytearray | memoryview) -> bytes:
    data = bytes(payload)
    if not 0 < len(data) <= _cyx.MAX_NOTIFY:
        raise ValueError(f"a notification payload is 1..{_cyx.MAX_NOTIFY} bytes, not {len(data)}")
    return data

"""Connector: how an agent connects to a peer and keeps its regions current.

A collaborator of :class:`aioxfer.Agent` (issue 10, item 8; asyncpg's
``connect_utils`` is the model): from a peer's address to a connected
:class:`~aioxfer.peer.Peer`. It dials the first data connection (Dialer),
takes the same-host path where the kernel vouches for the peer (its unix
socket: credentials, pidfd, metadata with memfds), chooses the transport,
creates the endpoint, imports the peer's regions before the engine reads from
the connection, opens the other rails' connections (verbs: exchanges queue
pairs), and adds the peer to the table. ``refresh`` re-fetches a peer's
metadata and applies it the same way.

It reaches the agent only through the narrow arguments it was built with;
``Agent.connect`` stays the public entry (caching, concurrent calls sharing
one attempt, names resolved through discovery) and hands it addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import os
import socket
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aioxfer import _cyx
from aioxfer import verbs as _verbs
from aioxfer._abi import MAX_CONNS
from aioxfer.dialing import Dialer, joining, parse_address
from aioxfer.discovery import PeerJoined, PeerUpdated
from aioxfer.errors import (
    ClosedResourceError,
    PeerLost,
    ProtocolError,
    StalePeer,
    TransportError,
    XferError,
    error_class,
)
from aioxfer.local import (
    PeerCred,
    check_sealed,
    local_name_for,
    local_name_from,
    local_name_mac,
    peer_cred,
    peer_pidfd,
)
from aioxfer.log import get_logger
from aioxfer.members import Members
from aioxfer.metadata import (
    PROTOCOL_VERSION,
    Accept,
    AgentMeta,
    RegionMeta,
    VerbsAccept,
    VerbsConnect,
    VerbsQP,
)
from aioxfer.peer import Peer
from aioxfer.peertable import PeerTable
from aioxfer.protocol import client_handshake, recv_frame, send_frame
from aioxfer.rails import Rails
from aioxfer.region import RemoteRegion
from aioxfer.scheduling import PeerScheduler
from aioxfer.serving import qp_tuple
from aioxfer.tags import Tags

__all__ = ["ConnectConfig", "Connector", "Predialed", "cma_allowed"]

_log = get_logger("aioxfer")
# How long after a connect returned its peer.connected line is rendered.
_LOG_DELAY = 0.001
# The most a connect waits on a peer's address-named unix socket before it
# takes the tcp probe instead: a real same-host peer answers in ~1 ms; only
# a process squatting the name (SECURITY.md) or a stalled peer waits longer.
_DIRECT_TIMEOUT = 1.0
# How long after a tcp connect returned its other connections begin to join
# (Connector._join_rest): requests posted meanwhile go on the first one, and
# what of them is still queued when a connection joins is spread over it too
# (the engine's conn_spread).
_JOIN_DELAY = 0.001
# After a predial took a Hello made ahead, another is made this much later
# (seconds): past the connect and its first write (~1.5-2.5 ms on a 2-vCPU
# host), where a timer due would run in the step before the caller resumes.
_PREPARE_DELAY = 0.005


@dataclass(frozen=True, slots=True)
class ConnectConfig:
    """What a Connector knows of its agent, fixed once the agent is made.

    ``incarnation``/``token``: who we are in handshakes (token None: no
    authentication); ``host_id``: equal for processes that can reach each
    other's memory (aioxfer.agent.host_id); ``local``: the agent listens on
    a same-host unix socket (without it no peer gets shm or cuda);
    ``transports``/``verbs_devices``: what it may use; ``max_rails``: at most
    this many of a peer's advertised rails are dialled; ``tcp_connections``:
    per tcp rail; ``peer_max_bytes``/``peer_max_requests``: each peer's
    scheduler (both None: none).
    """

    incarnation: int
    token: bytes | None
    host_id: str
    local: bool
    transports: tuple[str, ...]
    verbs_devices: tuple[str, ...]
    max_rails: int
    tcp_connections: int
    peer_max_bytes: int | None
    peer_max_requests: int | None


class Connector:
    """Connects one agent to its peers (see the module docstring).

    ``agent``: the agent's name (logs, errors, handshakes); ``config``: see
    ConnectConfig; ``engine``: its native engine (endpoints, imports);
    ``dialer``: opens its control and data connections; ``peers``: the table
    a connected peer joins; ``tags``: connection tags, one reference per
    endpoint; ``rails``: dials a tcp peer's rails and probes those down;
    ``embedded``: membership when there is no discovery (fencing a restarted
    peer by address, PeerJoined/PeerUpdated), None with discovery;
    ``connecting``: endpoint -> status, for endpoints being connected (the
    agent's drain records a peer lost meanwhile there); ``closed()``: whether
    the agent is closed.
    """

    __slots__ = (
        "_agent",
        "_config",
        "_engine",
        "_dialer",
        "_peers",
        "_tags",
        "_rails",
        "_embedded",
        "_connecting",
        "_closed",
        "_unchecked",
        "_predialed",
        "_name_mac",
        "_name_uid",
        "_prepare_at",
        "_timers",
        "joins_pending",
    )

    def __init__(
        self,
        agent: str,
        *,
        config: ConnectConfig,
        engine: _cyx.Engine,
        dialer: Dialer,
        peers: PeerTable,
        tags: Tags,
        rails: Rails,
        embedded: Members | None,
        connecting: dict[int, int],
        closed: Callable[[], bool],
    ) -> None:
        self._agent = agent
        self._config = config
        self._engine = engine
        self._dialer = dialer
        self._peers = peers
        self._tags = tags
        self._rails = rails
        self._embedded = embedded
        self._connecting = connecting
        self._closed = closed
        # (endpoint, rid, key) -> refreshes that imported that region of a
        # same-host peer and are still checking it (refresh): another
        # refresh whose snapshot names it checks it too before it returns.
        self._unchecked: dict[tuple[int, int, int], int] = {}
        # address -> the unix socket predial connected, from connect to
        # _open_direct (one attempt per address at a time: Agent.connect;
        # _open_direct(address) keeps its signature, which tests patch).
        self._predialed: dict[str, Predialed] = {}
        # local_name_for's HMAC keyed ahead (prepare), for _local_name; and
        # the euid it was made for (a process that changed it makes another).
        self._name_mac: hmac.HMAC | None = None
        self._name_uid = -1
        # Peers whose joining task a timer makes (_start_joins) and has not
        # made yet: joining too, for whoever waits for the joins to end.
        self.joins_pending = 0
        # Our timers not run yet (_later; prepare's: _prepare_at), which close
        # takes off the loop: one of a closed agent left there is due in a
        # later agent's connect, and a callback ready then keeps its
        # handshake's reads from polling (protocol._spin_recv_into), as in
        # every connect after the first of agents made one after another.
        self._prepare_at: asyncio.TimerHandle | None = None
        self._timers: dict[asyncio.TimerHandle, tuple[Callable[..., None], tuple[Any, ...]]] = {}

    def close(self) -> None:
        """The agent closed: our timers are taken off its loop. What they
        would still have done is done now (a peer.connected line; a join
        timer's count), not lost; prepare's Hellos are not made."""
        if self._prepare_at is not None:
            self._prepare_at.cancel()
            self._prepare_at = None
        timers, self._timers = self._timers, {}
        for handle, (fn, args) in timers.items():
            handle.cancel()
            fn(*args)

    def _later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """fn(*args) delay seconds from now, unless close runs it first."""
        cell: list[asyncio.TimerHandle] = []
        handle = asyncio.get_running_loop().call_later(delay, self._fire, cell, fn, args)
        cell.append(handle)
        self._timers[handle] = (fn, args)

    def _fire(
        self, cell: list[asyncio.TimerHandle], fn: Callable[..., None], args: tuple[Any, ...]
    ) -> None:
        self._timers.pop(cell[0], None)
        fn(*args)

    def _check_open(self) -> None:
        if self._closed():
            raise ClosedResourceError(f"agent {self._agent!r} is closed")

    def predial(self, address: str) -> Predialed | None:
        """The first connection connect(address) takes, connected now and its
        Hello sent, without yielding (Agent.connect calls this before the
        attempt's task first runs): a peer's loop wakes only once a Hello is
        in (TCP_DEFER_ACCEPT; its unix socket's accept is then ready with
        it), so every step of ours before the Hello was on the way of the
        whole connect. It is the peer's unix socket named after address
        (_open_direct) for an agent that tries that first, its Hello sent
        only once the kernel said it is served by our uid (as _open_direct
        checks before its handshake); else a tcp one to an IP literal.
        None where that is not known yet or did not connect at once (connect
        then dials as it would have, and says why it failed). Nothing is
        trusted of it before connect checked it as its own."""
        cfg = self._config
        dialer = self._dialer
        try:
            if cfg.local:
                sock = None
                if cma_allowed():  # (else no direct try: the probe first)
                    sock = dialer.dial_local_now(self._local_name(address))
                if sock is not None:
                    try:
                        ours = peer_cred(sock).uid == os.geteuid()
                    except OSError:
                        ours = False
                    sent = dialer.hello_now(sock, meta=True) if ours else None
                    self._prepare_later()
                    return Predialed(sock, sent, local=True)
                # Nobody listens there (not a same-host agent), or no direct
                # try: the tcp probe (connect's "meta" connection) instead,
                # its Hello sent now.
                sock = dialer.dial_now(address)
                if sock is None:
                    return Predialed(None, None, local=True)  # (direct: nobody; probe: dial)
                sent = dialer.hello_now(sock, purpose="meta", meta=False,
                                        joins=self._probe_joins())
                self._prepare_later()
                return Predialed(sock, sent, local=False)
            sock = dialer.dial_now(address)
        except (ValueError, TypeError):
            return None  # (not an address: connect raises it)
        except OSError:
            # A socket() that failed (EMFILE, ENFILE, ENOBUFS): connect
            # dials again and says it as a connect's error (TransportError,
            # Dialer.control_errors), not a bare OSError out of Agent.connect.
            return None
        if sock is None:
            return None
        sent = dialer.hello_now(sock, meta=True, joins=self._data_joins())
        self._prepare_later()
        return Predialed(sock, sent, local=False)

    def prepare(self) -> None:
        """The Hellos predial sends, made ahead (Dialer.prepare_hello): at the
        agent's start, and again a moment after a predial took one (not
        while a connect and its first write may still be under way)."""
        if self._closed():
            return
        cfg = self._config
        dialer = self._dialer
        if cfg.local:
            self._local_name_ahead()
            dialer.prepare_hello(meta=True)  # a same-host peer's unix socket's
            dialer.prepare_hello(purpose="meta", meta=False, joins=self._probe_joins())
        else:
            dialer.prepare_hello(meta=True, joins=self._data_joins())

    def _local_name_ahead(self) -> None:
        """The HMAC _local_name finishes per address, keyed now (prepare):
        its key's two hash blocks and the object's setup were ~half of the
        name's cost, on a connect's way before its Hello left."""
        uid = os.geteuid()
        if self._name_mac is None or self._name_uid != uid:
            self._name_mac = local_name_mac(self._config.token)
            self._name_uid = uid

    def _local_name(self, address: str) -> str:
        """local.local_name_for(token, address, our euid), from the HMAC
        keyed ahead (_local_name_ahead, local.local_name_from); where there
        is none, made now."""
        uid = os.geteuid()
        mac = self._name_mac
        if mac is None or self._name_uid != uid:
            return local_name_for(self._config.token, address, uid)
        return local_name_from(mac, address, uid)

    def _prepare_later(self) -> None:
        if self._prepare_at is None:  # (one pending makes them for every predial before it)
            self._prepare_at = asyncio.get_running_loop().call_later(
                _PREPARE_DELAY, self._prepare_due
            )

    def _prepare_due(self) -> None:
        self._prepare_at = None
        self.prepare()

    def _probe_joins(self) -> int:
        """How many joins the tcp "meta" probe of an agent with a unix
        socket asks for: the unix socket's, the tcp data connection's and
        its rail's others, then, with rails, the others' (connect)."""
        return 1 + self._config.tcp_connections + self._later_joins()

    def _data_joins(self) -> int:
        """How many joins the first tcp "data" connection of an agent without
        a unix socket asks for (its first rail's other connections', then,
        with rails, the others'): what its Hello says, sent by predial or by
        the handshake."""
        cfg = self._config
        if cfg.token is None:
            return 0
        early = cfg.tcp_connections - 1 if "verbs" not in cfg.transports else 0
        return max(early, 0) + self._later_joins()

    def _later_joins(self) -> int:
        """The joins asked for the connections dialled once the metadata is
        in (the peer's other tcp rails): only where it may have some."""
        cfg = self._config
        return MAX_CONNS - 1 if cfg.max_rails > 1 and "tcp" in cfg.transports else 0

    async def connect(self, address: str, first: Predialed | None = None) -> Peer:
        """A new Peer for the agent at address (or the live one of the
        incarnation found there), added to the table. first: from
        predial(address), ours from here on (closed if not taken)."""
        try:
            return await self._connect(address, first)
        finally:
            if first is not None:
                first.close()  # (a no-op once detached: handed to the engine)

    async def _connect(self, address: str, first: Predialed | None) -> Peer:
        host, port = parse_address(address)
        # One data connection first, which the peer's engine holds from the
        # metadata snapshot on: a region deregistered after the snapshot is
        # then revoked on this connection, and since its regions are imported
        # before the engine reads from it, no stale handle slips by. The
        # metadata comes on it too (Hello.meta, protocol.META_GO), unless the
        # peer may be on this host: then it comes from its unix socket.
        cfg = self._config
        early: _EarlyConns | None = None
        if not cfg.local and "verbs" not in cfg.transports and cfg.tcp_connections > 1:
            # Only tcp can come of it: the first rail's other connections
            # join once connect returned (_join_rest). With a token they join
            # the first one's Challenge (one round trip each, no Proof round:
            # protocol.Joins), which is asked for now.
            early = _EarlyConns(
                self._dialer, address, cfg.tcp_connections - 1, joinable=cfg.token is not None
            )
        # An agent with a unix socket first asks only who answered (purpose
        # "meta": an Accept naming the peer's unix socket and host): the
        # peer's engine never holds that connection, so neither side sets up
        # and tears down an endpoint for it while the same-host handshake and
        # the mapping of the peer's pools run. Taking tcp after all, it dials
        # a data connection of its own.
        # Its other connections join the probe's Challenge (one round trip
        # each, no Proof round: protocol.Joins): index 1 the unix socket's,
        # or else 2 the tcp data connection's, 3.. the tcp rails' others.
        probe = cfg.local
        # predial found nobody on the peer's address-named unix socket
        # (_open_direct would say just that: None): the probe's turn, on the
        # tcp connection predial opened for it if any.
        skip_direct = first is not None and (not first.local or first.sock is None)
        if first is not None and first.sock is None:
            first = None
        if probe and not skip_direct and (first is not None or cma_allowed()):
            # (predial asked cma_allowed)
            # A same-host peer also listens on a unix socket named after its
            # address (local.local_name_for): dialled first, it spares the tcp
            # probe (~1 ms: connect, handshake, then this same unix round).
            # Anything short of a vouched-for shm/cuda peer there (nobody,
            # another user, an impostor, a stall) falls back to the probe.
            if first is not None:  # (handed on by address: _open_direct(address) stays)
                self._predialed[address] = first
            try:
                direct = await self._open_direct(address)
            finally:
                self._predialed.pop(address, None)
            first = None  # (taken, or closed by connect)
            if direct is not None:
                try:
                    assert direct.meta is not None
                    return await self._connect_meta(address, direct.meta, None, direct)
                finally:
                    direct.close()
        challenge: list[bytes] = []
        # The connections dialled once the metadata is in (the peer's other
        # tcp rails; the first rail's, where its early ones fell short) join
        # too: up to MAX_CONNS - 1 more indexes, asked for only where the
        # peer may have other rails (max_rails > 1). Those a single-rail peer
        # leaves unused expire with the grant (the peer timeout), like the
        # probe's unix-socket index when it takes tcp (_probe_joins,
        # _data_joins, _later_joins).
        try:
            if probe:
                sock0, accept0, meta0 = await self._dialer.open_meta(
                    address, "meta", meta=False, joins=self._probe_joins(),
                    on_challenge=challenge.append,
                    sock=None if first is None else first.sock,
                    hello=None if first is None else first.sent,
                )
            else:
                sock0, accept0, meta0 = await self._dialer.open_meta(
                    address,
                    "data",
                    meta=True,
                    joins=self._data_joins(),
                    on_challenge=challenge.append,
                    sock=None if first is None else first.sock,
                    hello=None if first is None else first.sent,
                )
        except BaseException:
            if early is not None:
                await early.close()
            raise
        if early is not None:
            # Their Hellos go out once the metadata is in, not beside the
            # Proof: the peer would answer them before the Proof (its accept
            # step comes first), ~0.2 ms on the way of the metadata, while
            # they are added in the background now (_join_rest). None: no
            # Challenge came (a peer without a token): they handshake alone.
            early.on_challenge(challenge[0] if challenge else None)
        local: _LocalLink | None = None
        try:
            if (
                probe
                and accept0.local
                and accept0.host_id == self._config.host_id
                and cma_allowed()
            ):
                # Same host, says the peer: the kernel confirms it on the peer's
                # unix socket, whose metadata then replaces a tcp fetch.
                local = await self._open_local(
                    address, accept0, (challenge[0], 1) if challenge else None
                )
                if local is not None and self._local_path(local) is None:
                    local.close()
                    local = None
            if probe and local is None:
                # Not the same-host path: the data connection comes first, as below.
                sock0.close()
                if "verbs" not in cfg.transports and cfg.tcp_connections > 1:
                    # Only tcp can come of it now: as below, the first rail's
                    # other connections join later (the probe's Challenge, as 3..).
                    early = _EarlyConns(
                        self._dialer, address, cfg.tcp_connections - 1,
                        joinable=bool(challenge), first_index=3,
                    )
                sock0, accept0, meta0 = await self._dialer.open_meta(
                    address,
                    meta=True,
                    join=joining(challenge[0], 2) if challenge else None,
                )
                if early is not None:  # (their Hellos once the metadata is in, as above)
                    early.on_challenge(challenge[0] if challenge else None)
            if local is not None:
                assert local.meta is not None
                meta = local.meta
            elif meta0 is not None:
                meta = meta0
            else:
                meta = await self._dialer.fetch_meta(host, port, address)
            self._check_open()
            if accept0.incarnation != meta.incarnation:
                raise TransportError(
                    f"peer at {address} restarted while we connected (incarnation "
                    f"{accept0.incarnation:#x}, then {meta.incarnation:#x}): connect again"
                )
            joins = None
            if challenge and local is None:  # the tcp rails' other connections join on
                if probe:  # after the unix socket's (1), the data connection's (2), early ones'
                    joins = (challenge[0], 3 if early is None else 2 + cfg.tcp_connections)
                else:  # after the early ones' (1..)
                    joins = (challenge[0], 1 if early is None else cfg.tcp_connections)
            return await self._connect_meta(address, meta, sock0, local, early, joins)
        finally:
            if sock0.fileno() >= 0:
                sock0.close()
            if local is not None:
                local.close()
            if early is not None and not early.kept:
                await early.close()

    async def _connect_meta(
        self,
        address: str,
        meta: AgentMeta,
        sock0: socket.socket | None,
        local: _LocalLink | None,
        early: _EarlyConns | None = None,
        joins: tuple[bytes, int] | None = None,
    ) -> Peer:
        """sock0: the first tcp data connection (None: the peer came by its
        unix socket alone, local)."""
        if self._embedded is not None:
            # Embedded, names need not be unique: only the same name at the same
            # address with another incarnation is a restart of a peer we had.
            self._embedded.fence(meta.name, meta.incarnation, address)
        known = self._peers.by_inc.get((meta.name, meta.incarnation))
        if known is not None and not known._lost:
            self._peers.by_addr[address] = known
            return known
        if meta.version != PROTOCOL_VERSION:
            raise ProtocolError(f"peer at {address} speaks protocol version {meta.version}")
        if meta.byteorder != sys.byteorder:
            raise ProtocolError(f"peer at {address} is {meta.byteorder}-endian")
        # The same-host path only once the kernel vouched for the peer.
        path = self._choose_path(meta, same_host=local is not None)
        if path is None:
            raise TransportError(
                f"no transport in common with peer {meta.name!r} at {address} "
                f"(ours: {self._config.transports}, theirs: {tuple(meta.transports)}, "
                f"same host: {meta.host_id == self._config.host_id})"
            )
        return await self._connect_path(
            address, meta, sock0, path, local if path in ("shm", "cuda") else None,
            early if path == "tcp" else None, joins if path == "tcp" else None,
        )

    async def _connect_path(
        self,
        address: str,
        meta: AgentMeta,
        sock0: socket.socket | None,
        path: str,
        local: _LocalLink | None,
        early: _EarlyConns | None = None,
        joins: tuple[bytes, int] | None = None,
    ) -> Peer:
        """joins (nonce, i): the other tcp connections join that Challenge
        as indexes i, i + 1, ..."""
        shm = local is not None  # same host: one connection, copies by this engine
        verbs = path == "verbs"
        # tcp: every advertised listen address is a rail; the one we came by
        # may be a name or another spelling of one of them. shm and verbs:
        # one control connection (verbs: its rails are queue pairs).
        # At most max_rails of what the peer advertises are dialled: its
        # metadata must not make us open connections to anyone else en masse.
        rails = (
            [address] if shm or verbs or len(meta.rails) < 2
            else list(meta.rails)[: self._config.max_rails]
        )
        first = rails.index(address) if address in rails else 0
        per = (
            1 if shm or verbs
            else max(1, min(self._config.tcp_connections, MAX_CONNS // len(rails)))
        )
        tag = self._tags.ref(meta.name, meta.incarnation)
        kind = {"shm": _cyx.EP_SHM, "cuda": _cyx.EP_CUDA, "verbs": _cyx.EP_VERBS}.get(
            path, _cyx.EP_TCP
        )
        if local is not None:
            # The engine aims cross-memory attach only at the pid the kernel
            # reported, and owns the pidfd from here on.
            pid, pidfd = local.cred.pid, local.take_pidfd()
        else:
            pid, pidfd = 0, -1
        try:
            ep = self._engine.endpoint_create(kind, tag, pid, pidfd)
        except BaseException:
            self._tags.unref(tag)
            raise
        self._connecting[ep] = 0
        try:
            peer = Peer(
                self._peers,
                name=meta.name,
                address=address,
                incarnation=meta.incarnation,
                path=path,
                host_id=meta.host_id,
                pid=pid,
                ep=ep,
            )
            if local is not None:
                peer._local = meta.local
            peer._tag = tag
            peer._rails = rails
            peer._rail_conns = per
            cfg = self._config
            if cfg.peer_max_bytes is not None or cfg.peer_max_requests is not None:
                peer._sched = PeerScheduler(max_bytes=cfg.peer_max_bytes,
                                            max_requests=cfg.peer_max_requests)
            # Regions first: before the engine reads revocations on the connection.
            self._apply_regions(peer, meta.regions, local.fds if local is not None else None)
            if local is not None:
                self._engine.endpoint_add_conn(ep, local.take_data(), first)
            else:
                assert sock0 is not None  # only a local link comes without one
                self._engine.endpoint_add_conn(ep, sock0.detach(), first)
            # The rest of a tcp peer's connections (the first rail's others,
            # every other rail's) join in the background: the peer is usable
            # over its first one, and the engine stripes over whatever is live
            # when a request is posted (~0.4 ms of a connect: the peer answers
            # the joins one after another, the engine takes each in turn).
            joining = path == "tcp" and (early is not None or per > 1 or len(rails) > 1)
            if verbs:
                await self._connect_verbs(ep, address, meta)
            self._check_open()
            lost = self._connecting.pop(ep)
            if lost:
                raise PeerLost(
                    f"peer {meta.name!r} at {address} was lost while connecting: "
                    f"{_cyx.strerror(lost)}",
                    status=lost,
                    peer=meta.name,
                )
        except BaseException as exc:
            self._connecting.pop(ep, None)
            self._tags.unref(tag)
            if not self._closed():
                try:
                    self._engine.endpoint_close(ep)
                except _cyx.NativeError:
                    pass
            if isinstance(exc, _cyx.NativeError):
                raise error_class(exc.status)(
                    f"cannot connect to peer {meta.name!r} at {address}: {exc}", status=exc.status
                ) from None
            raise
        self._peers.add(peer, address)
        embedded = self._embedded
        if embedded is not None and embedded.heard():
            embedded.emit(PeerJoined(peer.name, peer.incarnation, address,
                                     tuple(sorted(peer._regions))))
        if joining:
            if early is not None:
                early.kept = True  # closed by the task _start_joins makes, not by connect()
            # Begun by a timer, not a task made now: a task's first step (and
            # its making, tracking) ran in the step the caller resumes in,
            # before it (tcp: the answer to the first write's end 45 us
            # longer, median of 52 pairs, connect_phases), and the joins wait
            # _JOIN_DELAY anyway (see _join_rest).
            self.joins_pending += 1
            self._later(_JOIN_DELAY, self._start_joins, peer, first, early, joins)
        else:
            self._log_connected(peer, 1)
        return peer

    def _start_joins(
        self,
        peer: Peer,
        first: int,
        early: _EarlyConns | None,
        joins: tuple[bytes, int] | None,
    ) -> None:
        """_join_rest's task, made _JOIN_DELAY after connect returned: none
        once the agent is closed or the peer lost meanwhile (early then holds
        nothing: its connections are dialled from its arrivals on)."""
        self.joins_pending -= 1
        if self._closed() or peer._lost:
            return
        task = asyncio.get_running_loop().create_task(
            self._join_rest(peer, first, early, joins), name=f"aioxfer-join-{peer.name}"
        )
        # One of the agent's background tasks (cancelled and awaited at its
        # close), cancelled when the peer is lost or closed (Rails.forget),
        # not left waiting out the joins' timeouts with their sockets.
        self._rails.track(peer, task)

    async def _join_rest(
        self,
        peer: Peer,
        first: int,
        early: _EarlyConns | None,
        joins: tuple[bytes, int] | None,
    ) -> None:
        """A tcp peer's connections after its first one, added as they come
        (the first rail's early ones first, then every rail at once: (rail,
        how many)). A connection that does not come is handled as a lost
        one is: its rail is re-dialled in the background (Rails), down if it
        has none; the peer is lost only when its last connection is. Ends
        quietly once the peer is lost or closed (the engine refuses to add).
        What the peer's requests posted meanwhile still have queued on the
        connections up is spread over each one as it joins (native
        conn_spread): the engine stripes a request over the connections live
        at its post, and conn14's early bulk writes, left on the first one,
        made the tcp demo 0.84x."""
        ep, rails, per = peer._ep, peer._rails, peer._rail_conns
        # Begun _JOIN_DELAY after connect returned (_start_joins), not before
        # the caller's first requests had the two processes' CPUs: the peer
        # answers each join and its engine starts the connection's threads,
        # which on a 2-vCPU host landed in a first 4 KiB write's window
        # (0.18 -> 0.40-0.53 ms: the whole gain gone; measured,
        # benchmarks/connect_phases.py). Their Hellos go out only now.
        took = 0
        dial: list[tuple[int, int]] = []
        added: list[int] = []
        # What went wrong that was not the engine refusing (an error nothing
        # expected, out of a dial or an early connection): said, then the
        # rails topped up as after a loss, never left in this task unretrieved
        # with no peer.connected line.
        failed: list[str] = []
        try:
            try:
                if early is not None:
                    # Each as soon as its handshake is done: the engine takes one
                    # (~0.05-0.15 ms) while the peer still answers the next.
                    async with contextlib.aclosing(
                        early.arrivals(per - 1, peer.incarnation)
                    ) as socks:
                        async for sock in socks:
                            if peer._lost:
                                return  # (closed by early.close)
                            self._engine.endpoint_add_conn(ep, sock.detach(), first)
                            took += 1
            finally:
                if early is not None:
                    await early.close()
            dial = [(i, n) for i in range(len(rails)) if (n := per - (i == first) * (1 + took))]
            starts = [sum(n for _, n in dial[:k]) for k in range(len(dial))]
            if dial and not peer._lost:
                # Each to its end: one that fails leaves none of the others
                # adding connections behind the re-dials started below.
                got = await asyncio.gather(
                    *(
                        self._rails.dial(
                            ep, i, rails[i], n, peer.incarnation,
                            None if joins is None else (joins[0], joins[1] + start),
                        )
                        for (i, n), start in zip(dial, starts, strict=True)
                    ),
                    return_exceptions=True,
                )
                for r in got:
                    if isinstance(r, _cyx.NativeError) or not isinstance(r, int | Exception):
                        raise r
                added = [r if isinstance(r, int) else 0 for r in got]
                failed += [f"{type(r).__name__}: {r}" for r in got if isinstance(r, Exception)]
        except _cyx.NativeError as exc:
            if not (peer._lost or self._closed() or exc.status == _cyx.E_CLOSED):
                _log.warning("conn.join_failed", agent=self._agent, peer=peer.name,
                             address=peer.address, reason=str(exc))
            return
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
        if peer._lost or self._closed():
            return
        live = self._rails.live(peer)
        if failed:
            _log.warning("conn.join_failed", agent=self._agent, peer=peer.name,
                         address=peer.address, reason="; ".join(failed))
            # (a dial that failed may have added some first: the engine's count)
            reached = {first} | {i for i, k in live.items() if k}
            conns = sum(live.values())
        else:
            reached = {first} | {i for (i, _), k in zip(dial, added, strict=True) if k}
            conns = 1 + took + sum(added)
        for i in range(len(rails)):
            if i not in reached:  # unreachable now: probed until it answers
                peer._rails_down.add(i)
                _log.warning("rail.down", agent=self._agent, peer=peer.name, address=rails[i],
                             reason="not joined" if failed else "unreachable at connect",
                             moved=0)
                self._rails.start_probe(peer, i)
        for i in sorted(reached):
            if live.get(i, 0) < per:  # some did not come: topped up as after a loss
                _log.warning("conn.join_failed", agent=self._agent, peer=peer.name,
                             address=rails[i], reason=f"{live.get(i, 0)} of {per} connections up")
                self._rails.start_probe(peer, i)
        self._log_connected(peer, conns)

    def _log_connected(self, peer: Peer, conns: int) -> None:
        # Logged a moment later, not before the caller's first transfer is
        # posted: a line costs ~0.05 ms rendered, a fresh process's first one
        # ~0.15-0.25 ms (measured, benchmarks/connect_phases.py). A timer
        # not due yet: one due at once runs before the caller resumes (this
        # task's end reaches it through two callbacks), and a ready callback
        # would keep that first transfer's await from polling for its
        # completion (progress.Poller.spin_alone).
        # Its arguments gathered then too (a partial of eight keywords made
        # here was on the caller's way); the region count is the connect's.
        self._later(_LOG_DELAY, self._log_connected_now, peer, conns, len(peer._regions))

    def _log_connected_now(self, peer: Peer, conns: int, regions: int) -> None:
        _log.info("peer.connected", agent=self._agent, peer=peer.name, address=peer.address,
                  path=peer.path, conns=conns, rails=len(peer._rails), regions=regions)

    def _local_path(self, local: _LocalLink) -> str | None:
        """The same-host path the peer behind local would get, or None."""
        assert local.meta is not None
        path = self._choose_path(local.meta, same_host=True)
        return path if path in ("shm", "cuda") else None

    def _choose_path(self, meta: AgentMeta, *, same_host: bool) -> str | None:
        """same_host: the kernel vouched for the peer (_open_local)."""
        if same_host and "cuda" in self._config.transports and "cuda" in meta.transports:
            return "cuda"  # GPU memory by CUDA IPC, host memory as shm
        if same_host and "shm" in self._config.transports and "shm" in meta.transports:
            return "shm"
        if "verbs" in self._config.transports and "verbs" in meta.transports and meta.verbs_devices:
            return "verbs"
        if "tcp" in self._config.transports and "tcp" in meta.transports:
            return "tcp"
        return None

    async def _open_direct(self, address: str) -> _LocalLink | None:
        """The same-host link to the peer at address, over the unix socket
        named after address (local.local_name_for), checked as _open_local
        checks it: our uid by the kernel, the token handshake, sealed memfds,
        the pidfd; and the metadata must list address among the peer's
        rails. None (a debug line) on anything else, within _DIRECT_TIMEOUT:
        the caller then takes the tcp probe, which answers for itself.
        That socket may be connected already (predial: connect hands it
        over in _predialed): then it is ours."""
        cfg = self._config
        loop = asyncio.get_running_loop()
        link = _LocalLink()
        first = self._predialed.pop(address, None)
        sent: tuple[bytes, bytes] | None = None
        if first is not None:
            link.data, sent = first.sock, first.sent
            first.sock = None  # (the link's now)
        result: _LocalLink | None = None
        why = ""
        try:
            if link.data is None:
                name = self._local_name(address)
                try:
                    link.data = await self._dialer.dial_local(name)
                except OSError:
                    return None  # nobody listens there: not a same-host agent (or an old one)
            async with asyncio.timeout(min(self._dialer.peer_timeout, _DIRECT_TIMEOUT)):
                link.cred = peer_cred(link.data)
                if link.cred.uid != os.geteuid():
                    why = f"the kernel says it runs as uid {link.cred.uid}, not as this user"
                    return None
                spin = self._dialer.spin_ns(loop, link.data)
                # Taken while the peer answers (our Hello is out), not once
                # its answer is in: a handle on the process the kernel named
                # (checked ours above), trusted with nothing before the
                # handshake and metadata below are checked (closed with the
                # link otherwise).
                link.pidfd = peer_pidfd(link.data, link.cred)
                accept = await client_handshake(
                    loop, link.data, name=self._agent, incarnation=cfg.incarnation,
                    purpose="data", token=cfg.token, meta=True, spin_ns=spin, sent=sent,
                )
                if not accept.meta or accept.host_id != cfg.host_id:
                    why = "it sends no metadata there, or is not on this host"
                    return None
                link.meta, link.fds = await self._dialer.receive_meta(link.data, local=True,
                                                                      spin_ns=spin)
            meta = link.meta
            if (meta.name, meta.incarnation) != (accept.name, accept.incarnation):
                why = "its metadata is not the agent that answered"
            elif address not in meta.rails:
                why = f"its metadata does not list {address}"
            elif meta.host_id != cfg.host_id:
                why = "its metadata is not of this host"
            elif self._local_path(link) is None:
                why = "no same-host transport in common"
            else:
                result = link
                return result
            return None
        except Exception as exc:  # noqa: BLE001 (any failure: the tcp probe decides)
            why = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            if result is None:
                link.close()
                if why:
                    _log.debug("local.direct_skipped", agent=self._agent, address=address,
                               reason=why)

    async def _open_local(
        self, address: str, meta: Accept, join: tuple[bytes, int] | None = None
    ) -> _LocalLink | None:
        """The same-host link to the peer that answered meta (its Accept), over
        its unix socket: a handshaken data connection, the peer's
        kernel-reported credentials and pidfd, and its metadata with its memfds
        (passed by the kernel). None, logged, when the kernel does not vouch
        for it (another user, another agent behind that name): the caller
        falls back to tcp. join: the probe's Challenge to join (nonce, index)."""
        loop = asyncio.get_running_loop()
        link = _LocalLink()
        result: _LocalLink | None = None
        why = ""
        try:
            async with self._dialer.control_errors(address, "connecting locally to", "connect to"):
                link.data = await self._dialer.dial_local(meta.local)
                link.cred = peer_cred(link.data)
                if link.cred.uid != os.geteuid():
                    why = f"the kernel says it runs as uid {link.cred.uid}, not as this user"
                    return None
                # Its metadata and memfds come on this connection (Hello.meta),
                # from a peer that does not send them there on another one.
                spin = self._dialer.spin_ns(loop, link.data)
                accept = await client_handshake(
                    loop, link.data, name=self._agent, incarnation=self._config.incarnation,
                    purpose="data", token=self._config.token, meta=True, join=join,
                    spin_ns=spin,
                )
                if (accept.name, accept.incarnation) != (meta.name, meta.incarnation):
                    why = f"its unix socket is served by another agent ({accept.name!r})"
                    return None
                link.pidfd = peer_pidfd(link.data, link.cred)
                if accept.meta:
                    link.meta, link.fds = await self._dialer.receive_meta(link.data, local=True,
                                                                          spin_ns=spin)
                else:
                    link.meta, link.fds = await self._dialer.fetch_local_meta(
                        meta.local, link.cred.pid
                    )
            if (link.meta.name, link.meta.incarnation) != (meta.name, meta.incarnation):
                why = "it restarted while we connected"
                return None
            result = link
            return result
        finally:
            if result is None:
                link.close()
                if why:
                    _log.warning("local.refused", agent=self._agent, peer=meta.name,
                                 address=address, reason=why, fallback="tcp")

    async def _connect_verbs(self, ep: int, address: str, meta: AgentMeta) -> None:
        """A queue pair per device pair (rail i: our device i, the peer's i),
        exchanged on a "verbs" control connection that then joins endpoint
        ep; ready to post once this returns."""
        loop = asyncio.get_running_loop()
        # Rails pair devices of one link layer (an InfiniBand port never
        # reaches a RoCE one), not index i with index i.
        pairs = _verbs.pair_rails(list(self._config.verbs_devices), list(meta.verbs_devices))
        if not pairs:
            raise TransportError(
                f"no RDMA device of ours shares a link layer with one of peer {meta.name!r}"
            )
        n = len(pairs)
        ours = [self._engine.verbs_qp_create(ep, mine) for mine, _ in pairs]
        sock, accept = await self._dialer.open(address, purpose="verbs")
        try:
            if accept.incarnation != meta.incarnation:
                raise TransportError(
                    f"peer at {address} restarted while we connected: connect again"
                )
            async with self._dialer.control_errors(address, "exchanging queue pairs with", "reach"):
                await send_frame(
                    loop,
                    sock,
                    VerbsConnect(
                        qps=[VerbsQP(*q) for q in ours], devices=[theirs for _, theirs in pairs]
                    ),
                )
                reply = await recv_frame(loop, sock)
            if not isinstance(reply, VerbsAccept) or len(reply.qps) != n:
                raise ProtocolError(f"peer at {address} answered the queue pairs with {reply!r}")
            for (mine, theirs), qp in zip(pairs, reply.qps, strict=True):
                self._engine.verbs_qp_connect(ep, mine, theirs, qp_tuple(qp))
            # The handshake and exchange read exactly their frames: the rest is the engine's.
            self._engine.endpoint_add_conn(ep, sock.detach(), 0)
        finally:
            if sock.fileno() >= 0:
                sock.close()

    def _apply_regions(
        self, peer: Peer, regions: list[RegionMeta], fds: list[int] | None = None,
        imported: list[tuple[int, int]] | None = None,
    ) -> None:
        """Imports regions new to us and forgets the ones the peer dropped.
        fds: a same-host peer's memfds as the kernel passed them (the caller
        closes them; the engine keeps its own mapping). imported: gets the
        (rid, key) of each region imported."""
        eng = self._engine
        ep = peer._ep
        wanted = {(m.rid, m.key): m for m in regions}
        for (rid, key), rr in _keyed(peer):
            if (rid, key) not in wanted:
                rr._gone = True
                del peer._by_rid[rid]
                if peer._regions.get(rr.name) is rr:
                    del peer._regions[rr.name]
                try:
                    eng.endpoint_forget(ep, rid)
                except _cyx.NativeError:
                    pass
        for m in regions:
            old = peer._by_rid.get(m.rid)
            if old is not None:
                if old.name != m.name:  # renamed cannot happen today; keep names in sync
                    peer._regions.pop(old.name, None)
                    old.name = m.name
                    peer._regions[m.name] = old
                continue
            if imported is not None:
                imported.append((m.rid, m.key))
            if m.kind != "host":
                self._import_device_region(peer, m)
                continue
            memfd = -1
            if fds is not None and 0 <= m.memfd < len(fds):
                memfd = fds[m.memfd]
            try:
                # The engine maps a memfd only sealed against resizing and at
                # least the region's length (shm.c map_fd: the checks
                # local.check_sealed makes, and more), before it maps it:
                # never mapped otherwise, so no SIGBUS.
                eng.endpoint_import(ep, m.rid, m.key, m.nbytes, m.access, m.addr, memfd)
            except _cyx.NativeError:
                if memfd < 0:
                    raise
                why = check_sealed(memfd, m.nbytes)
                if why is not None:  # (said as before: the engine's code names no reason)
                    _log.warning("region.memfd_refused", agent=self._agent, peer=peer.name,
                                 region=m.name, reason=why)
                # Could not map it: cross-memory attach reaches it too.
                eng.endpoint_import(ep, m.rid, m.key, m.nbytes, m.access, m.addr, -1)
                memfd = -1
            if peer.path == "verbs":
                eng.endpoint_import_verbs(ep, m.rid, _verbs_keys(peer, m))
            rr = RemoteRegion(peer, m.name, m.rid, m.key, m.nbytes, m.access, m.addr, memfd)
            stale = peer._regions.get(m.name)
            if stale is not None:
                stale._gone = True
            peer._by_rid[m.rid] = rr
            peer._regions[m.name] = rr

    def _import_device_region(self, peer: Peer, m: RegionMeta) -> None:
        """A peer's GPU region: imported where the path reaches GPU memory; known
        (so that transfers to it fail saying why) everywhere."""
        rr = RemoteRegion(peer, m.name, m.rid, m.key, m.nbytes, m.access, m.addr)
        rr.kind = m.kind
        if peer.path == "cuda" and m.kind == "cuda" and m.cuda is not None:
            own = peer.pid == os.getpid()  # a loopback peer: our own memory, no IPC
            try:
                self._engine.endpoint_import_cuda(
                    peer._ep, m.rid, m.key, m.nbytes, m.access, m.addr,
                    None if own else m.cuda.handle, m.cuda.offset, m.cuda.device,
                )
            except (_cyx.NativeError, ValueError) as exc:
                _log.warning("region.cuda_import_failed", agent=self._agent, peer=peer.name,
                             region=m.name, error=str(exc))
        elif peer.path == "verbs" and m.verbs:
            # GPUDirect RDMA: the owner registered it with its NICs (no rkeys:
            # it could not, and transfers to it fail at the engine saying so).
            try:
                self._engine.endpoint_import(
                    peer._ep, m.rid, m.key, m.nbytes, m.access, m.addr, -1
                )
                self._engine.endpoint_import_verbs(peer._ep, m.rid, _verbs_keys(peer, m))
            except _cyx.NativeError as exc:
                _log.warning("region.verbs_import_failed", agent=self._agent, peer=peer.name,
                             region=m.name, error=str(exc))
        stale = peer._regions.get(m.name)
        if stale is not None:
            stale._gone = True
        peer._by_rid[m.rid] = rr
        peer._regions[m.name] = rr

    async def refresh(self, peer: Peer) -> None:
        """Re-fetches peer's metadata and imports/forgets its regions (StalePeer
        if it restarted)."""
        self._check_open()
        if peer._lost:
            raise peer._lost_error()
        meta, fds = await self._fetch(peer)
        before = {(rr.name, rid) for rid, rr in peer._by_rid.items()}
        imported: list[tuple[int, int]] = []
        try:
            await self._refresh_with(peer, meta, fds, imported)
        except BaseException:
            if peer._local:  # (what it imported before it failed: unchecked, as below)
                self._forget_regions(peer, set(imported))
            raise
        finally:
            for fd in fds or ():
                os.close(fd)
        # (A tcp peer's regions need no check: see below.)
        mine = {(peer._ep, rid, key) for rid, key in imported} if peer._local else set()
        # Named by our snapshot too, imported by another refresh whose check
        # is still on its way: ours to check as well. Found imported already,
        # they were returned unchecked (rev31: a write by our caller landed in
        # memory the owner had back; tests/test_rev31_refresh_concurrent).
        # (Usually none is being checked: then no pass over the snapshot.)
        theirs: set[tuple[int, int, int]] = set()
        if self._unchecked:
            theirs = {(peer._ep, m.rid, m.key) for m in meta.regions
                      if (peer._ep, m.rid, m.key) in self._unchecked} - mine
        if mine or theirs:
            new = {(rid, key) for _, rid, key in mine}
            for k in mine:  # (no await since the import: none checked it yet)
                self._unchecked[k] = self._unchecked.get(k, 0) + 1
            # A same-host peer's memory is copied into by our engine, which
            # the owner holds back only by its revocations (on every
            # connection it accepted). One deregistered after the snapshot
            # above was taken but before we imported it was revoked while our
            # engine did not know it yet: acknowledged at once, the owner had
            # its memory back, and our import then let writes land there
            # (tests/test_rev29_refresh). A snapshot taken after our import
            # settles it: what it no longer lists is forgotten; what it lists
            # is revoked, if ever, after our import, so our engine sees that.
            try:
                try:
                    meta, fds = await self._fetch(peer)
                except BaseException:
                    # Not settled (cancelled, the peer gone): not kept either;
                    # the next refresh imports them again. (Another's are
                    # left to its own check.)
                    self._forget_regions(peer, new)
                    raise
            finally:
                for k in mine:
                    left = self._unchecked.pop(k) - 1
                    if left:
                        self._unchecked[k] = left
            for fd in fds or ():
                os.close(fd)
            if peer._lost:
                raise peer._lost_error()
            self._check_same(peer, meta)
            listed = {(m.rid, m.key) for m in meta.regions}
            self._forget_regions(peer, (new | {(rid, key) for _, rid, key in theirs}) - listed)
        if self._embedded is not None:
            after = {(rr.name, rid) for rid, rr in peer._by_rid.items()}
            if theirs:
                # (Another refresh's imports: that one reports them, if kept;
                # forgotten here, they were never reported as added.)
                skip = {rid for _, rid, _ in theirs}
                before = {n for n in before if n[1] not in skip}
                after = {n for n in after if n[1] not in skip}
            if before != after:
                self._embedded.emit(PeerUpdated(
                    peer.name, peer.incarnation, peer.address,
                    tuple(sorted(n for n, _ in after - before)),
                    tuple(sorted(n for n, _ in before - after)),
                ))

    async def _fetch(self, peer: Peer) -> tuple[AgentMeta, list[int] | None]:
        """peer's metadata as it serves it now (and a same-host peer's memfds).
        A fetch that failed once the peer is known lost raises its error
        (PeerLost...), not the fetch's: a tcp peer's too (a frozen one's
        fetch timed out after its keepalives had declared it lost:
        tests/test_rev29_refresh_lost)."""
        try:
            if peer._local:
                async with self._dialer.control_errors(peer.address, "fetching metadata from",
                                                "fetch metadata from"):
                    return await self._dialer.fetch_local_meta(peer._local, peer.pid)
            host, port = parse_address(peer.address)
            return await self._dialer.fetch_meta(host, port, peer.address), None
        except (OSError, ProtocolError, TransportError) as exc:
            if not peer._lost:
                raise
            raise peer._lost_error() from exc

    def _check_same(self, peer: Peer, meta: AgentMeta) -> None:
        """StalePeer (the peer dropped as restarted) unless meta is peer's."""
        if meta.name != peer.name or meta.incarnation != peer.incarnation:
            peer._stale = True
            self._peers.drop(peer, "it restarted")
            raise StalePeer(
                f"peer {peer.name!r} at {peer.address} restarted (now {meta.name!r}, incarnation "
                f"{meta.incarnation:#x}, was {peer.incarnation:#x}): its old regions are fenced; "
                f"connect again"
            )

    def _forget_regions(self, peer: Peer, keys: set[tuple[int, int]]) -> None:
        """Forgets peer's regions of those (rid, key), as _apply_regions
        forgets the ones the peer dropped."""
        for (rid, key), rr in _keyed(peer):
            if (rid, key) in keys:
                rr._gone = True
                del peer._by_rid[rid]
                if peer._regions.get(rr.name) is rr:
                    del peer._regions[rr.name]
                try:
                    self._engine.endpoint_forget(peer._ep, rid)
                except _cyx.NativeError:
                    pass

    async def _refresh_with(
        self, peer: Peer, meta: AgentMeta, fds: list[int] | None,
        imported: list[tuple[int, int]] | None = None,
    ) -> None:
        if peer._lost:
            raise peer._lost_error()
        self._check_same(peer, meta)
        try:
            self._apply_regions(peer, meta.regions, fds, imported)
        except _cyx.NativeError as exc:
            raise error_class(exc.status)(
                f"cannot refresh peer {peer.name!r}: {exc}", status=exc.status, peer=peer.name
            ) from None


def _verbs_keys(peer: Peer, m: RegionMeta) -> list[tuple[int, int]]:
    """A peer region's (addr, rkey) per device, range-checked."""
    if not 0 < len(m.verbs) <= _cyx.VERBS_MAX_DEVICES or not all(
        0 <= addr < 1 << 64 and 0 <= rkey < 1 << 32 for addr, rkey in m.verbs
    ):
        raise ProtocolError(f"peer {peer.name!r} sent region {m.name!r} without valid rkeys")
    return m.verbs


def _keyed(peer: Peer) -> list[tuple[tuple[int, int], RemoteRegion]]:
    return [((rr.rid, rr.key), rr) for rr in peer._by_rid.values()]


_CMA: bool | None = None


def _cma_works() -> bool:
    """Whether process_vm_readv works here at all (seccomp profiles of some
    container runtimes refuse it); probed once on our own memory."""
    global _CMA
    if _CMA is None:
        try:
            # The symbols already in this process (libc among them): find_library
            # would run ldconfig in a subprocess, ~2 ms on the first connect.
            libc = ctypes.CDLL(None, use_errno=True)

            class IoVec(ctypes.Structure):
                _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

            src = ctypes.create_string_buffer(b"aioxfer", 8)
            dst = ctypes.create_string_buffer(8)
            liov = IoVec(ctypes.cast(dst, ctypes.c_void_p), 8)
            riov = IoVec(ctypes.cast(src, ctypes.c_void_p), 8)
            fn = libc.process_vm_readv
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(IoVec),
                ctypes.c_ulong,
                ctypes.POINTER(IoVec),
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            n = fn(os.getpid(), ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
            _CMA = n == 8 and dst.raw == src.raw
        except (OSError, AttributeError):
            _CMA = False
    return _CMA


_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# False once the file was found missing: Yama is built into the kernel and
# set up at boot, so a kernel without it now never has it (no module loads
# it later); its absence is not asked again on every same-host connect.
_yama: bool | None = None


def _ptrace_scope() -> int:
    """Yama's ptrace_scope now (0 without Yama). Read on each call where Yama
    is (root may raise it at any time), by os.open/os.read: a text-mode
    open() was ~33 us warm, this ~9, and its absence raised (~10 us) on every
    call, before a same-host connect's Hello (Connector.predial)."""
    global _yama
    if _yama is False:
        return 0
    try:
        fd = os.open(_YAMA_SCOPE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        _yama = False
        return 0
    except OSError:
        return 0
    try:
        return int(os.read(fd, 32))
    except (OSError, ValueError):
        return 0
    finally:
        os.close(fd)


def cma_allowed() -> bool:
    """Whether we may reach a same-host peer's memory (of our own uid: the
    kernel checks that per connection): Yama (if present) must not restrict
    ptrace-style access to descendants, and process_vm_readv must work."""
    scope = _ptrace_scope()
    if scope >= 2 or (scope == 1 and os.geteuid() != 0):
        return False
    return _cma_works()


class _EarlyConns:
    """The first rail's other data connections to a tcp peer, whose joins
    were asked for in the first connection's Hello; closes whatever is not
    taken. joinable: once connected, each waits for
    the first connection's (or the probe's) Challenge (on_challenge) and
    joins it (indexes first_index, first_index + 1, ...) instead of running a
    Proof round of its own.

    Nothing is dialled before arrivals, called by the connected peer's
    background joining (Connector._join_rest): dialled beside the first
    connection (on its Hello) they cost its handshake the dials' CPU and
    saved nothing once the joins no longer delay connect (connect_phases
    tcp n=25 x2: 1.86 / 1.82 ms without, 2.14 / 1.81 with), and an agent
    closed before the joins opened nothing. Joinable ones to an IP literal
    are dialled then (Dialer.dial_now), their Hellos sent at once
    (Dialer.join_now), and arrivals reads their answers itself, with no
    task of theirs to wake; the others (a name, a dial that failed at
    once, no token) open on their own tasks."""

    __slots__ = ("_tasks", "_challenge", "_dialer", "_address", "_n", "_first", "_socks",
                 "_sent", "_nonce", "joins", "kept")

    def __init__(
        self, dialer: Dialer, address: str, n: int, *, joinable: bool, first_index: int = 1
    ) -> None:
        self._dialer = dialer
        self._address = address
        self._n = n
        self._first = first_index
        # Index i: its task, or its socket dialled at once (and what its Hello sent).
        self._tasks: list[asyncio.Task[tuple[socket.socket, Accept]] | None] = [None] * n
        self._socks: list[socket.socket | None] = [None] * n
        self._sent: list[tuple[bytes, bytes] | None] = [None] * n
        self._challenge: asyncio.Future[bytes | None] | None = None
        self._nonce: bytes | None = None
        self.joins = 0
        # Handed to the connected peer's background joining (which closes them).
        self.kept = False
        if joinable:
            self._challenge = asyncio.get_running_loop().create_future()
            self.joins = n

    def _go(self) -> None:
        """The handshakes begin (once, from arrivals): joinable ones are
        dialled at once where they can be and their Hellos sent, tasks open
        the others."""
        if self._challenge is not None:
            for i in range(self._n):
                self._socks[i] = self._dialer.dial_now(self._address)
            if not self._challenge.done():
                self._challenge.set_result(self._nonce)
        self._join_now(self._nonce)
        join = self._challenge is not None
        for i in range(self._n):
            if self._socks[i] is None and self._tasks[i] is None:
                self._tasks[i] = asyncio.ensure_future(self._dialer.open(
                    self._address, join=self._joiner(self._first + i) if join else None
                ))

    def _joiner(self, index: int) -> Callable[[], Awaitable[tuple[bytes, int] | None]]:
        async def join() -> tuple[bytes, int] | None:
            assert self._challenge is not None
            nonce = await asyncio.shield(self._challenge)  # shared: never cancelled by one
            return None if nonce is None else (nonce, index)

        return join

    def on_challenge(self, nonce: bytes | None) -> None:
        """The first connection's Challenge nonce (checked: its server proof
        was right), or None: the others handshake alone (from arrivals on)."""
        self._nonce = nonce

    def _join_now(self, nonce: bytes | None) -> None:
        """The Hellos of those dialled at once and connected, sent now."""
        if nonce is None:
            return
        for i, sock in enumerate(self._socks):
            if sock is not None and self._sent[i] is None:
                self._sent[i] = self._dialer.join_now(sock, (nonce, self._first + i))

    async def _joined(self, i: int) -> tuple[socket.socket, Accept] | None:
        """Index i's handshake, dialled at once, finished here (its Hello
        sent now if it was not): None if it failed (on the network, or
        refused by the peer)."""
        sock = self._socks[i]
        assert sock is not None and self._challenge is not None
        sent = self._sent[i]
        try:
            return await self._dialer.open(
                self._address, join=self._joiner(self._first + i), sock=sock,
                sent=lambda: sent,
            )
        except (XferError, OSError):
            return None

    async def arrivals(self, n: int, incarnation: int) -> AsyncGenerator[socket.socket, None]:
        """Up to n of them, answered by that incarnation, each once its
        handshake is done (in the order they were dialled, as the peer
        answers them); network failures only make them fewer. One the caller
        does not detach is closed by close()."""
        self._go()
        # Their Hellos went out at once: one bound for all their answers, not
        # one peer timeout each, one after another (a peer that never answers
        # a join held the connect's joins (n - 1) x peer_timeout).
        deadline = asyncio.get_running_loop().time() + self._dialer.peer_timeout
        got = 0
        for i, t in enumerate(self._tasks):
            if got == n:
                return
            if t is None:
                try:
                    async with asyncio.timeout_at(deadline):
                        res = await self._joined(i)
                except TimeoutError:
                    res = None
                if res is None:
                    continue
            else:
                if not t.done():  # (asyncio.wait costs a loop step)
                    await asyncio.wait((t,))
                if t.cancelled():
                    continue
                exc = t.exception()
                if exc is not None:
                    if not isinstance(exc, XferError | OSError):
                        raise exc
                    continue
                res = t.result()
            sock, accept = res
            if accept.incarnation == incarnation:
                got += 1
                yield sock

    async def close(self) -> None:
        """Closes what was not taken (a dial still running is cancelled: it
        closes its own socket)."""
        tasks = [t for t in self._tasks if t is not None]
        for t in tasks:
            t.cancel()
        if not all(t.done() for t in tasks):
            await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is None:
                sock = t.result()[0]
                if sock.fileno() >= 0:
                    sock.close()
        for s in self._socks:  # dialled at once (detached: taken by the engine)
            if s is not None and s.fileno() >= 0:
                s.close()


class Predialed:
    """A first connection Connector.predial opened: sock, and sent (what
    Dialer.hello_now sent on it: None, nothing). local: sock is the peer's
    address-named unix socket (None: nobody listens there); else a tcp
    connection (the "meta" probe's for an agent with a unix socket, else
    the "data" one's). Closed unless taken."""

    __slots__ = ("sock", "sent", "local")

    def __init__(
        self, sock: socket.socket | None, sent: tuple[bytes, bytes] | None, *, local: bool
    ) -> None:
        self.sock = sock
        self.sent = sent
        self.local = local

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # (a no-op once detached or closed)


class _LocalLink:
    """What _open_local gathered about a same-host peer; closes what nobody took."""

    __slots__ = ("cred", "data", "fds", "meta", "pidfd")

    def __init__(self) -> None:
        self.data: socket.socket | None = None
        self.cred = PeerCred(0, -1, -1)
        self.pidfd = -1
        self.meta: AgentMeta | None = None
        self.fds: list[int] = []

    def take_pidfd(self) -> int:
        fd, self.pidfd = self.pidfd, -1
        return fd

    def take_data(self) -> int:
        assert self.data is not None
        return self.data.detach()

    def close(self) -> None:
        if self.data is not None and self.data.fileno() >= 0:
            self.data.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        for fd in self.fds:
            os.close(fd)
        self.fds = []

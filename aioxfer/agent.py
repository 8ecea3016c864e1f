"""Agent: registered memory, peers, and the asyncio side of the native engine.

Threading: an Agent lives on one event loop. The loop thread only validates,
submits and drains; copies, socket I/O and keepalives run on engine threads.
Submissions made in one loop iteration go to the engine in one native call
(``post_many``, one doorbell); completions come back through one eventfd watched
with ``loop.add_reader`` and are drained in batches.

Lifetime: the agent owns its peers and regions. ``aclose()`` fails whatever is
in flight with ClosedResourceError, and releases every buffer once the engine
confirms nothing touches it any more.

Shape: the Agent is a facade (as asyncpg's Connection is over connect_utils).
It validates its arguments, owns the engine and the listening sockets, and
keeps the write/read path inline (a call less per transfer); the rest lives
in collaborators built from narrow arguments, never the agent: Submission (the
batch, admission, the drain), EngineEvents (notifications, peers and rails
lost, regions freed), PeerTable, Connector and Dialer (connecting), Server
(serving), Rails, Memory (registration and release), LocalMeta (our metadata),
Members and Cluster (membership, the etcd hand-off), BackendHost (what local
backends reach).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import secrets
import socket
import sys
import warnings
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from aioxfer import _cyx, descriptors, file_transport
from aioxfer import progress as _progress
from aioxfer import verbs as _verbs
from aioxfer._abi import MAX_CONNS  # connections one endpoint may have
from aioxfer.auth import default_token, hmac_key, key_if_derived, key_soon
from aioxfer.backends import registry as _backends
from aioxfer.backends.host import BackendHost
from aioxfer.cluster import Cluster
from aioxfer.connector import ConnectConfig, Connector, Predialed, cma_allowed
from aioxfer.descriptors import Descs as _Descs
from aioxfer.descriptors import coalesce as _coalesce
from aioxfer.descriptors import cuda_path as _cuda_path
from aioxfer.dialing import Dialer, parse_address
from aioxfer.discovery import Etcd, Membership, PeerJoined
from aioxfer.errors import ClosedResourceError, TransportError
from aioxfer.events import EngineEvents
from aioxfer.limits import Limits
from aioxfer.local import listen_abstract, listen_local, local_name_for
from aioxfer.localmeta import LocalMeta
from aioxfer.log import get_logger
from aioxfer.members import Members
from aioxfer.metadata import PROTOCOL_VERSION, Accept, AgentMeta
from aioxfer.names import check_name
from aioxfer.notifications import Notifications
from aioxfer.peer import Peer
from aioxfer.peertable import PeerTable, notify_payload
from aioxfer.protocol import token_bytes
from aioxfer.rails import Rails
from aioxfer.region import (
    Region,
    RemoteRegion,
    RemoteSegment,
    Segment,
    SegmentList,
)
from aioxfer.registration import Memory
from aioxfer.serving import Server
from aioxfer.stats import AgentStatistics, agent_statistics
from aioxfer.submission import Submission, as_priority
from aioxfer.tags import Tags
from aioxfer.transfer import Transfer

if TYPE_CHECKING:  # optional extras, imported where used
    from aioxfer.backends.base import FarSegment
    from aioxfer.backends.objects import ObjectRegion
    from aioxfer.metrics import MetricsServer

__all__ = ["Agent"]

_log = get_logger("aioxfer")

TRANSPORTS = ("shm", "tcp", "verbs", "cuda")
_NEVER_INLINE = (1 << 64) - 1  # the engine's inline_bytes for "never"
_MAX_SECONDS = ((1 << 32) - 1) // 1000  # what the engine's 32-bit milliseconds hold

_OK = _cyx.OK
_OP_WRITE = _cyx.OP_WRITE
_OP_READ = _cyx.OP_READ
_E_CLOSED = _cyx.E_CLOSED

Local = Segment | Sequence[Segment] | SegmentList
# A Segment (or list of them) of a file region: Agent.register_file.
Remote = RemoteSegment | Segment | Sequence[RemoteSegment] | Sequence[Segment] | SegmentList


class _KeyPending(RuntimeError):
    """An agent made inside a running event loop was used before its
    token's key was derived (start() and connect() await it): raised, not
    waited for, because the wait would block that loop (see Agent._token)."""


class Agent:
    """One participant: registers memory, serves its metadata, connects to peers,
    posts transfers.

    ``listen``: "host:port" of the control port (port 0 picks one; read
    ``address``), or several: one per NIC. Each is a rail: TCP peers open
    connections to every one (``tcp_connections`` per rail, 16 in all at most)
    and stripe large transfers over them by measured rate; when a rail fails,
    its unfinished chunks move to the others, and it is re-dialled every
    ``rail_probe`` seconds until it is back. ``addresses`` lists them.
    ``transports``: which of "shm", "tcp", "verbs", "cuda" this agent may use
    (all by default where available; ``("tcp",)`` forces TCP even on one host,
    ``("verbs",)`` RDMA). "verbs" needs RDMA devices and "cuda" (same-host GPU
    copies by CUDA IPC, host memory as shm) the CUDA driver: by default each is
    dropped where absent (``aioxfer.verbs.status()`` / ``aioxfer.cuda.status()``
    say why); asked for explicitly, its absence raises TransportError. Between
    hosts with RDMA devices the path is "verbs" (one reliable-connected queue
    pair per device pair, a stream connection for control); on one host shm
    stays the default (cuda when both have CUDA). ``token``: the shared
    secret every connection authenticates with (an HMAC challenge, both ways).
    None (the default): ``$AIOXFER_TOKEN``, else this user's own secret
    (``aioxfer.auth``), so agents of one user on one host connect with no
    configuration and other users' processes cannot; across hosts give every
    agent the same token. ``insecure_no_auth=True`` turns authentication off
    (anyone who can reach the port gets the metadata and the memory).
    ``peer_timeout``: seconds of silence after which a peer is lost (its transfers
    fail with PeerLost); ``keepalive``: idle ping interval of a peer's first
    connection (its other connections ping every half of the peer's timeout).
    ``tcp_connections``: connections per TCP peer and rail (large transfers are
    split across them).
    ``copy_workers``: engine threads doing same-host copies.
    ``peer_max_bytes`` / ``peer_max_requests``: per-peer limits on what is in
    the engine at once (None: unlimited). Over them, ``write``/``read`` still
    return a Transfer at once; it waits in this agent's scheduler, by
    ``priority`` (higher first, FIFO within one), so a latency-critical request
    overtakes queued bulk traffic to the same peer.
    ``stall_timeout``: seconds a connection may owe replies with nothing moving
    before its transfers fail with TransferTimeout (default 30; None: off, then
    a peer that keeps pinging but never answers pins the op and its memory).
    ``limits``: every bound on what peers can make this agent hold
    (``aioxfer.Limits``: handshakes, rails, metadata, connections, queued
    notifications and replies, revocation and close timeouts).
    ``discovery``: ``aioxfer.discovery.Etcd(...)`` to publish this agent under
    its name (from ``start()``/``async with`` until ``aclose()``), connect to
    others by name and follow membership through etcd; None (the default):
    embedded, connect by address.
    ``progress``: how the loop learns of completions (``aioxfer.progress``):
    "adaptive" (the default) polls the engine's ring for a bounded time (the
    calibrated ``poll_us``, tens of microseconds in a VM) before blocking, only
    while this agent has transfers in flight; "sleep" always blocks in epoll
    (the least CPU under load); "poll" busy-polls while transfers are in
    flight (a core spent on it). Idle, every mode blocks.
    ``inline_bytes``: a same-host request awaited alone (nothing else of this
    agent's in flight) up to this size is copied on the loop's thread inside
    the post, instead of by a copy worker (two thread wake-ups saved; from
    2 MiB the copy workers take a share beside it, and the post still returns
    with the copy done); batches keep the workers. None (the default):
    calibrated at start-up from this machine's measured thread wake-up cost
    and memcpy bandwidth, rounded up to a power of two, 64 KiB to 16 MiB (a
    few MiB in a VM, less on bare metal; ``$AIOXFER_INLINE_BYTES`` overrides
    it); an int: that (other same-host requests up to the smaller of it and
    64 KiB are copied at submit too); 0: never (every copy on the workers).
    """

    def __init__(
        self,
        name: str,
        *,
        listen: str | Sequence[str] = "127.0.0.1:0",
        transports: Sequence[str] | None = None,
        token: str | bytes | None = None,
        insecure_no_auth: bool = False,
        peer_timeout: float = 5.0,
        keepalive: float = 1.0,
        tcp_connections: int = 4,
        copy_workers: int = 2,
        discovery: Etcd | None = None,
        rail_probe: float = 1.0,
        stall_timeout: float | None = 30.0,
        peer_max_bytes: int | None = None,
        peer_max_requests: int | None = None,
        limits: Limits | None = None,
        progress: str = "adaptive",
        inline_bytes: int | None = None,
        _credentials_of: Agent | None = None,
    ) -> None:
        # (aioxfer.names: printable, 1..256 characters; peers' names are
        # held to the same rule where they enter, in the handshake.)
        check_name(name)
        if transports is None:
            transports = TRANSPORTS
        elif isinstance(transports, str):
            raise TypeError('transports is a sequence of names, e.g. ("tcp",)')
        transports = tuple(dict.fromkeys(transports))
        unknown = [t for t in transports if t not in TRANSPORTS]
        if unknown or not transports:
            raise ValueError(
                f"transports must be a non-empty subset of {TRANSPORTS}, not {transports}"
            )
        if not 0 < peer_timeout <= _MAX_SECONDS or not 0 < keepalive <= _MAX_SECONDS:
            raise ValueError(f"peer_timeout and keepalive must be positive (seconds, at most "
                             f"{_MAX_SECONDS}: the engine counts milliseconds in 32 bits)")
        if not 1 <= tcp_connections <= MAX_CONNS:
            raise ValueError(f"tcp_connections must be in 1..{MAX_CONNS}")
        if copy_workers < 1:
            raise ValueError("copy_workers must be at least 1")
        self.progress = _progress.check_mode(progress)
        if inline_bytes is not None and (
            not isinstance(inline_bytes, int) or isinstance(inline_bytes, bool)
            or not 0 <= inline_bytes < _NEVER_INLINE
        ):
            raise ValueError("inline_bytes is None (calibrated) or an int >= 0 (0: never)")
        for limit in (peer_max_bytes, peer_max_requests):
            if limit is not None and (not isinstance(limit, int) or limit < 1):
                raise ValueError("peer_max_bytes and peer_max_requests are positive ints or None")
        if not 0 < rail_probe <= _MAX_SECONDS or (
            stall_timeout is not None and not 0 < stall_timeout <= _MAX_SECONDS
        ):
            raise ValueError(f"rail_probe and stall_timeout must be positive (seconds, at most "
                             f"{_MAX_SECONDS})")
        listens = [listen] if isinstance(listen, str) else list(listen)
        if not listens or len(listens) > MAX_CONNS:
            raise ValueError(f"listen is one address or a list of 1..{MAX_CONNS} addresses")
        if discovery is not None and not isinstance(discovery, Etcd):
            raise TypeError(
                f"discovery is an aioxfer.discovery.Etcd or None, not {type(discovery).__name__}"
            )

        limits = Limits() if limits is None else limits
        if not isinstance(limits, Limits):
            raise TypeError(f"limits is an aioxfer.Limits, not {type(limits).__name__}")
        self.limits = limits
        self._max_handshakes = limits.max_handshakes
        self._max_rails = limits.max_rails
        self._max_meta_bytes = limits.max_meta_bytes
        self.name = name
        self.incarnation = secrets.randbits(64)
        self.transports: tuple[str, ...] = transports
        # The key every HMAC uses, in one field whose type says its state:
        # bytes (derived), a Future (still being derived: read through
        # _token, which refuses to block on it), None (insecure_no_auth
        # only). Before, None meant either of the last two (told apart by
        # a second field), so a reader that skipped the check read a
        # pending key as no authentication.
        self._key: bytes | concurrent.futures.Future[bytes] | None
        if _credentials_of is not None:
            # (private: a sibling agent of the library's own, e.g. a KV
            # PeerTier's control agent) Exactly that agent's credentials: its
            # derived key, or the derivation under way for it (both take the
            # same key from it), or no authentication if it has none. Never
            # re-derived from a token: the agent does not keep the raw one,
            # and $AIOXFER_TOKEN / the token file may be another secret.
            if token is not None or insecure_no_auth:
                raise ValueError("_credentials_of takes no token= or insecure_no_auth")
            self._key = _credentials_of._key
        elif insecure_no_auth:
            if token is not None:
                raise ValueError("give either token= or insecure_no_auth=True, not both")
            self._key = None
        else:
            # Every HMAC keys on the stretched token (auth.hmac_key: derived
            # once per token per process, never per connection). Made inside
            # a running event loop, the agent has it derived on a thread
            # (auth.key_soon) that start() and connect() await before
            # anything uses it: the loop is not blocked for the derivation
            # (~45 ms); elsewhere it is derived here.
            raw = token_bytes(token) if token is not None else None
            raw = raw if raw is not None else default_token()
            derived = key_if_derived(raw)
            if derived is not None:
                self._key = derived
            elif _loop_running():
                self._key = key_soon(raw)
            else:
                self._key = hmac_key(raw)
        self._peer_timeout = float(peer_timeout)
        # (kept for the library's sibling agents, see _credentials_of)
        self._keepalive = float(keepalive)
        self._stall_timeout = None if stall_timeout is None else float(stall_timeout)
        self._max_meta = limits.max_meta_bytes
        self._tcp_connections = int(tcp_connections)
        self._rail_probe = float(rail_probe)
        self._limits = (peer_max_bytes, peer_max_requests)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine = _cyx.Engine(
            copy_workers=int(copy_workers),
            keepalive_ms=max(1, round(keepalive * 1000)),
            peer_timeout_ms=max(1, round(peer_timeout * 1000)),
            stall_ms=0 if stall_timeout is None else max(1, round(stall_timeout * 1000)),
            max_conns=limits.max_conns,
            max_notify_per_conn=limits.max_notify_per_conn,
            revoke_timeout_ms=max(1, round(limits.revoke_timeout * 1000)),
            reply_queue_bytes=limits.reply_queue_bytes,
            inline_bytes=0 if inline_bytes is None else inline_bytes or _NEVER_INLINE,
            target_poll_us=_progress.target_poll_us(self.progress),
        )
        self._fd = self._engine.fileno()
        self._poller: _progress.Poller | None = None
        self._cuda_why = "not asked for"
        if "cuda" in transports:
            st, self._cuda_why = self._engine.cuda_enable()
            if st != _OK:
                if transports != TRANSPORTS:  # asked for by name
                    self._engine.close()
                    raise TransportError(f"transport 'cuda' is not available: {self._cuda_why}")
                transports = tuple(t for t in transports if t != "cuda")
                self.transports = transports
        self._lsocks: list[socket.socket] = []
        self.addresses: list[str] = []  # the rails; the first is ``address``
        try:
            for where in listens:
                lsock, bound = _listen(where)
                self._lsocks.append(lsock)
                self.addresses.append(bound)
        except BaseException:
            for lsock in self._lsocks:
                lsock.close()
            self._engine.close()
            raise
        self.address = self.addresses[0]
        self._host_id = host_id()
        # Same host: an abstract unix socket too, where the kernel vouches for
        # who connects (aioxfer.local). Without it no peer gets the shm path.
        self._local_sock: socket.socket | None = None
        self._local_name = ""
        if self._host_id and ("shm" in transports or "cuda" in transports):
            try:
                self._local_sock, self._local_name = listen_local(os.geteuid())
                cma_allowed()  # probed once per process now, not on the first connect
            except OSError as exc:
                _log.warning("local.unavailable", agent=self.name, reason=str(exc))
        # And one named after each tcp address (local.local_name_for), served
        # alike: a same-host peer that knows only our address dials it
        # directly, skipping the tcp round that would tell it the name above.
        self._direct_socks: list[socket.socket] = []
        if not isinstance(self._key, concurrent.futures.Future):
            self._listen_direct()
        self._accept_msg = Accept(name=self.name, incarnation=self.incarnation,
                                  host_id=self._host_id, local=self._local_name)
        self._verbs_devices: list[str] = []
        if "verbs" in transports:
            try:
                # Only verbs asked for: its absence is an error, else a fallback.
                self._verbs_devices = self._enable_verbs(explicit=transports == ("verbs",))
            except BaseException:
                for listener in (*self._lsocks, self._local_sock, *self._direct_socks):
                    if listener is not None:
                        listener.close()
                self._engine.close()
                raise
            if not self._verbs_devices:
                transports = tuple(t for t in transports if t != "verbs")
                self.transports = transports

        self._accept_tasks: list[asyncio.Task[None]] = []
        self._server: Server | None = None  # made at start
        self._probes: set[asyncio.Task[None]] = set()
        self._serving: set[asyncio.Task[None]] = set()
        self.notifications = Notifications(self._notify_release)

        # peers being connected: by address, and endpoint -> status if lost meanwhile
        self._connecting: dict[str, asyncio.Task[Peer]] = {}
        # each attempt's callers (Agent.connect, _attempt)
        self._attempts: dict[asyncio.Task[Peer], _Attempt] = {}
        self._connecting_eps: dict[int, int] = {}
        # Tags: each accepted connection and each endpoint holds one reference
        # to its peer's until it is gone, so that churn leaves no tags behind.
        self._tags = Tags()
        self._tag_for = self._tags.ref
        self._tag_unref = self._tags.unref

        # The collaborators (issue 10, item 8): each gets what it needs by
        # name, never the agent. Lambdas stand for those made later; they run
        # only on rare events (a peer or rail lost, a region freed).
        self._events = EngineEvents(
            name,
            tag_names=self._tags.names,
            tag_unref=self._tag_unref,
            notify=self.notifications._put,
            peer_of=lambda ep: self._peers.by_ep.get(ep),
            peer_lost=lambda ep, status, log, bye: self._peers.lost_record(
                ep, status, log=log, bye=bye
            ),
            rail_down=lambda peer, rail, moved, status: self._rails.on_down(
                peer, rail, moved, status
            ),
            connecting=self._connecting_eps,
            region_freed=lambda rid: self._memory.freed(rid),
            release=self._notify_release,
            # A sender resends what a silent rail owed after its peer_timeout
            # (ours, unless configured apart), a keepalive and slack later.
            seen_for=2 * self._peer_timeout + keepalive + 5.0,
        )
        # data path: the batch, transfers in flight, admission, the drain
        self._sub = Submission(
            name,
            engine=self._engine,
            start=self._start,
            # A lone request up to this is posted at its await (Submission.eager).
            alone_max=self.inline_bytes,
            on_event=self._events.on_event,
            peer_lost=lambda peer, status: self._peers.refused(peer, status),
            describe=_describe,
        )
        # Bound once: write/read call it once per transfer.
        self._submit = self._sub.submit
        # flush and poll bound to the Submission's own (what the methods below
        # call): a caller that flushes or polls per request (aioxfer.nixl's
        # repost) pays no Python frame for the wrapper.
        self.flush = self._sub.flush  # type: ignore[method-assign]
        self.poll = self._sub.drain  # type: ignore[method-assign]
        # peers: the tables that find them; what a Peer asks of its agent
        self._peers = PeerTable(
            name,
            engine=self._engine,
            closed=lambda: self._closed,
            submit=self._submit,
            refresh=lambda peer: self._connector.refresh(peer),
            fail_queued=self._peer_gone,
            tag_unref=self._tag_unref,
            emit=None if discovery is not None else lambda e: self._membership.emit(e),
        )
        # write/read's usual case compiled (_cyx.Poster: the same checks and
        # effects, no Python frame); anything else goes to the methods below.
        # Not where a subclass defines its own.
        if type(self).write is Agent.write and type(self).read is Agent.read:
            poster = _cyx.Poster(
                self, Agent.write, Agent.read, self._sub, self._sub._fast, self._peers,
                Segment, RemoteSegment, Region, RemoteRegion, Peer,
            )
            self.write = poster.write  # type: ignore[method-assign]
            self.read = poster.read  # type: ignore[method-assign]
        # membership: etcd's view, fencing, the membership() streams
        self._membership = Members(
            name,
            peers_by_name=self._peers.by_name,
            refresh_peer=lambda peer: self._connector.refresh(peer),
            drop_peer=self._peers.drop,
            closed=lambda: self._closed,
        )
        # the etcd hand-off (with discovery only)
        self._cluster: Cluster | None = None
        if discovery is not None:
            self._cluster = Cluster(
                name,
                discovery=discovery,
                incarnation=self.incarnation,
                members=self._membership,
                published=lambda: self._localmeta.published(),
                peers_by_inc=self._peers.by_inc,
                closed=lambda: self._closed,
            )
        # memory: the region table, registration, release
        self._memory = Memory(
            name,
            engine=self._engine,
            new_region=functools.partial(Region, self),
            pin_cuda="cuda" in self.transports,
            changed=self._cluster.changed if self._cluster is not None else _unchanged,
            pending=self._sub,
            started=lambda: self._loop is not None,
            closed=lambda: self._closed,
            tag_names=self._tags.names,
            close_timeout=limits.close_timeout,
        )
        # our metadata, as served and as published
        self._localmeta = LocalMeta(
            name,
            identity=AgentMeta(
                version=PROTOCOL_VERSION,
                name=name,
                incarnation=self.incarnation,
                host_id=self._host_id,
                pid=os.getpid(),
                address=self.address,
                transports=list(self.transports),
                regions=[],
                uid=os.geteuid(),
                byteorder=sys.byteorder,
                rails=list(self.addresses),
                verbs_devices=list(self._verbs_devices),
                local=self._local_name,
            ),
            regions=self._memory.regions,
            verbs_keys=self._engine.verbs_region_keys if self._verbs_devices else None,
        )
        # What local backends (the file transport among them), metrics and
        # staging reach this agent through (aioxfer.backends.host.host_of).
        self._backend_host = BackendHost(
            name,
            engine=self._engine,
            peers=self._peers,
            host_id=self._host_id,
            cuda_why=self._cuda_why,
            regions=self._memory,
            closed=lambda: self._closed,
            new_tag=self._tags.local,
            submit=self._submit,
        )
        self._final_native: dict[str, int] | None = None

    def _enable_verbs(self, *, explicit: bool) -> list[str]:
        """Opens the RDMA devices (verbs.provider() overrides libibverbs); their
        descriptions, [] when there are none (explicit: TransportError)."""
        n, why = self._engine.verbs_enable(_verbs.provider())
        if n <= 0:
            if explicit:
                raise TransportError(f"agent {self.name!r}: transport verbs unavailable: {why}")
            _log.debug("verbs.off", agent=self.name, reason=why)
            return []
        names = _verbs.devices()
        _log.debug("verbs.on", agent=self.name, devices=n, detail=why)
        return names[:n] if len(names) >= n else [f"dev{i}" for i in range(n)]

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> Agent:
        """Starts serving (also done by ``async with`` and, lazily, by the first
        connect, write or read). With discovery, also joins: publishes this
        agent and starts following the members (raises TransportError if etcd
        cannot be reached; a later start() tries again, and a cancelled one
        stops joining). Idempotent."""
        await self._key_derived()
        fresh = self._loop is None
        loop = self._start()
        # Made now: the first connect would otherwise make it (and Rails)
        # before it dials; and the Hellos its first dial sends (predial).
        self._connector.prepare()
        if fresh and not self._closed:
            # The accept loops' first steps (arming their listeners) run now,
            # not in the step a first connect hops through to its task: they
            # went first there, ~0.15 ms of every fresh process's connect
            # (benchmarks/connect_phases.py: I.connect -> I.Connector.connect
            # 0.15-0.19 ms, then ~0.03 ms). Serving has then begun when
            # start() returns, as it says.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                # The caller gave up before awaiting the join _start began:
                # the agent does not go on joining behind its back.
                if self._cluster is not None and self._cluster.joining is not None:
                    self._cluster.joining.cancel()
                raise
        cluster = self._cluster
        while cluster is not None:
            joining = cluster.joining
            if joining is None or joining.cancelled() or (
                joining.done() and joining.exception() is not None
            ):
                # A start() cancelled earlier stopped that join, or it failed
                # (etcd unreachable then): join afresh.
                self._check_open()
                cluster.join(loop)
                joining = cluster.joining
                assert joining is not None
            try:
                await cluster.joined()
                break
            except asyncio.CancelledError:
                # (The task not kept in a local: its CancelledError's
                # traceback holds this frame, a cycle; see _caller_cancelling.)
                if not _caller_cancelling() and joining.cancelled():
                    # Not this caller's cancellation: the agent closed, or
                    # another start() gave up on that join.
                    if self._closed:
                        raise ClosedResourceError(
                            f"agent {self.name!r} was closed while joining"
                        ) from None
                    continue
                # This caller gave up (cancelled, or its timeout): the agent
                # does not go on joining behind its back.
                joining.cancel()
                raise
        return self

    def _listen_direct(self) -> None:
        """The abstract sockets named after our tcp addresses (their names
        need the key)."""
        if self._local_sock is not None:
            for bound in self.addresses:
                try:
                    self._direct_socks.append(
                        listen_abstract(local_name_for(self._token, bound, os.geteuid()))
                    )
                except OSError as exc:  # taken (by a squatter): peers come by tcp first
                    _log.debug("local.direct_unavailable", agent=self.name, address=bound,
                               reason=str(exc))

    async def _key_derived(self) -> None:
        """Waits (without blocking the loop) for a key still being derived
        on its thread (see __init__); at once when there is none to wait for."""
        key = self._key
        if isinstance(key, concurrent.futures.Future) and not key.done():
            await asyncio.wrap_future(key)

    @property
    def _key_pending(self) -> concurrent.futures.Future[bytes] | None:
        """The derivation while it is under way or not yet taken in (a view
        of _key, for tests and the library's sibling agents), else None."""
        key = self._key
        return key if isinstance(key, concurrent.futures.Future) else None

    @property
    def _token(self) -> bytes | None:
        """The key every HMAC uses; None only for insecure_no_auth. A key
        derived on a thread is taken in at the first read after it is done
        (start() and connect() await that: _key_derived); read before, this
        raises _KeyPending rather than block the caller (the event loop's
        thread, where such an agent was made) for the derivation or be read
        as no authentication."""
        key = self._key
        if not isinstance(key, concurrent.futures.Future):
            return key
        if not key.done():
            raise _KeyPending(
                f"agent {self.name!r}: its token's key is still being derived (made inside "
                f"a running event loop): await start() first")
        self._key = derived = key.result()  # (the derivation's error, if it failed)
        if not self._closed:  # (closed: aclose closed the others, nothing closes these)
            self._listen_direct()
        return derived

    @functools.cached_property
    def _dialer(self) -> Dialer:
        """Made at the first use (after the key: _token raises before)."""
        return Dialer(
            self.name,
            incarnation=self.incarnation,
            token=self._token,
            peer_timeout=self._peer_timeout,
            max_meta_bytes=self._max_meta,
            # (cx31: a handshake with a same-host peer polls for its frames
            # for up to 1 ms; "sleep" polls nothing, there too)
            spin=self.progress != "sleep",
        )

    def _start(self) -> asyncio.AbstractEventLoop:
        self._token  # noqa: B018 (the key taken in, or _KeyPending: never started without it)
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            if self._loop is not loop:
                raise RuntimeError(f"agent {self.name!r} is bound to another event loop")
            return loop
        self._check_open()
        sub = self._sub
        loop.add_reader(self._fd, sub.drain)
        self._loop = loop
        if self.progress != "sleep":
            self._poller = _progress.Poller(
                sub, self._engine.wait_polls, loop, self.progress, self._engine.poll_us
            )
        sub.started(loop, self._poller)
        server = Server(
            self.name,
            engine=self._engine,
            token=self._token,
            accept=self._accept_msg,
            peer_timeout=self._peer_timeout,
            max_handshakes=self._max_handshakes,
            verbs_devices=len(self._verbs_devices),
            meta=self._localmeta.meta,
            local_meta=self._localmeta.local,
            tag_for=self._tag_for,
            tag_unref=self._tag_unref,
            tasks=self._serving,
            closed=lambda: self._closed,
            spin=self.progress != "sleep",
            # (what our metadata is made of: the region table, and the maker
            # the tests swap to make a hostile peer)
            meta_version=lambda: (self._memory.generation, self._localmeta.meta_with),
        )
        self._server = server
        if self.progress == "sleep" or getattr(loop, "_ready", None) is None:
            # Nothing is polled for (no spin; a loop without asyncio's ready
            # queue, e.g. uvloop: handshake_spin_ns 0): a loopback listener
            # that accepted at the connect (_listen) greeted a client whose
            # Hello was not in yet with an ordinary Challenge, its early
            # proof then lost (a Proof round more) for no overlap gained.
            # The kernel defers its accept until the Hello is in, as before
            # de9d3c37 (rv36, tests/test_rv36_defer).
            for lsock in self._lsocks:
                _defer_accept(lsock)
        self._accept_tasks = [
            loop.create_task(server.accept_loop(loop, lsock), name=f"aioxfer-accept-{self.name}")
            for lsock in self._lsocks
        ]
        for local in (self._local_sock, *self._direct_socks):
            if local is not None:
                self._accept_tasks.append(loop.create_task(
                    server.accept_loop(loop, local, local=True),
                    name=f"aioxfer-accept-local-{self.name}",
                ))
        if self._cluster is not None:
            self._cluster.join(loop)  # start() awaits it; a lazy start does not
        _log.debug("agent.started", agent=self.name, address=self.address)
        return loop

    async def __aenter__(self) -> Agent:
        try:
            return await self.start()
        except BaseException:
            await self.aclose()  # __aexit__ will not run
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Stops serving, fails in-flight transfers with ClosedResourceError,
        closes peers, releases every region. Idempotent.

        Like ``deregister``, it first waits (up to ``limits.close_timeout``)
        until no peer can touch our memory any more; a peer that still could
        then (a stopped same-host process) is named in a warning, and the
        memory it could touch stays quarantined (pinned, never released) for
        the rest of this process."""
        if self._closed:
            return
        # What is still batched never reaches the engine: deregistering below
        # would post it first, and a copy finishing during the release wait
        # would report success from an agent being closed.
        self._sub.fail_pending()
        # From here on a late peer's handshake is refused with a Reject that
        # names the close (before: Accepted, then dropped by the engine after
        # its goodbye: the peer thought it connected, then lost us).
        if self._server is not None:
            self._server.closing = True
        # Network peers hear our goodbye before the release revokes their
        # regions: their writes in flight then fail as a close (PeerLost,
        # "closed"), not as accesses refused to revoked regions. Same-host
        # peers keep their connections (they may still copy into our memory
        # and the release waits for them there): _shutdown says theirs.
        self._engine.bye_network()
        cancelled: asyncio.CancelledError | None = None
        if self._loop is not None:
            try:
                await self._memory.release_all()
            except asyncio.CancelledError as exc:
                # The caller gave up waiting for peers (its timeout): the
                # agent closes all the same (what a peer holds is
                # quarantined), then the cancellation goes on.
                cancelled = exc
        self._closed = self._sub.closed = True
        if "_connector" in self.__dict__:  # (a cached_property: made by start or a connect)
            self._connector.close()  # its timers off the loop
        tasks: list[asyncio.Task[Any]] = [
            task
            for task in (
                *self._accept_tasks,
                *self._probes,
                *self._serving,
                *self._connecting.values(),
                self._cluster.joining if self._cluster is not None else None,
            )
            if task is not None
        ]
        for task in tasks:
            task.cancel()
        try:
            try:
                # local backends (object storage, plugins): fail in flight, close clients
                await _backends.aclose_agent(self)
            finally:
                # Even when a backend's close failed: the cancelled accept
                # loops must take their readers off the listening sockets
                # before _shutdown closes them (uvloop aborts the process on
                # a closed fd still watched).
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            try:
                self._shutdown()
            finally:
                # The lease last, even when the shutdown failed: our peers
                # hear our engine's goodbye (same-host ones only at its
                # shutdown) before etcd tells them our key is gone, which
                # they take for a loss of a peer still connected (a
                # peer.lost warning for a clean leave: close18).
                if self._cluster is not None:
                    await self._cluster.leave()
        if cancelled is not None:
            raise cancelled

    def _shutdown(self) -> None:
        sub = self._sub
        sub.fail_pending()  # not yet handed to the engine: fail here
        for peer in self._peers.live():
            for q in sub.unqueue_all(peer):  # failed below with the rest
                q._admitted = False
        self._engine.shutdown()  # fails what is pending (E_CLOSED), frees regions
        while sub.drain_once():
            pass
        try:
            self._final_native = self._engine.stats()
        except _cyx.NativeError:
            self._final_native = None
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._engine.close()

        sub.fail_inflight()  # no completion came: should not happen
        self._memory.close()
        for peer in self._peers.live():
            self._peers.mark_lost(peer, _E_CLOSED, log=False)
        self._peers.clear()
        self._membership.close()
        self.notifications._close()
        for lsock in (*self._lsocks, self._local_sock, *self._direct_socks):
            if lsock is None:
                continue
            fd = lsock.fileno()  # -1: closed already
            if fd >= 0 and self._loop is not None and not self._loop.is_closed():
                # an accept loop cut short (a cancelled aclose) may still watch it
                self._loop.remove_reader(fd)
            lsock.close()
        _log.debug("agent.closed", agent=self.name)

    def __del__(self, _warn: Any = warnings.warn) -> None:
        if getattr(self, "_closed", True):
            return
        _warn(f"unclosed aioxfer agent {self.name!r}", ResourceWarning, source=self, stacklevel=1)
        for lsock in getattr(self, "_lsocks", ()):
            lsock.close()
        local = getattr(self, "_local_sock", None)
        if local is not None:
            local.close()
        for direct in getattr(self, "_direct_socks", ()):
            direct.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"agent {self.name!r} is closed")

    def __aioxfer_host__(self) -> BackendHost:
        """This agent's LocalBackendHost (aioxfer.backends.host): all that local
        backends, metrics and staging use of it beyond the public API."""
        return self._backend_host

    @property
    def _file_peer(self) -> Peer | None:
        """The FILE endpoint (made by the first file transfer), or None."""
        return self._backend_host.file_peer

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Agent {self.name!r} at {self.address}{state}>"

    # ------------------------------------------------------------ memory

    def register(self, obj: Any, *, name: str | None = None) -> Region:
        """Registers any buffer-protocol object (bytearray, memoryview, numpy
        array, mmap, bytes). Writable buffers may be read and written by peers,
        read-only ones only read. The export stays pinned while registered.

        GPU memory (region kind "cuda"): objects with ``__cuda_array_interface__``
        or CUDA DLPack (PyTorch, CuPy tensors), and ``aioxfer.cuda.DevicePointer``
        (see aioxfer.cuda); the object is held while registered. Without a CUDA
        driver those raise RegistrationError saying why."""
        return self._memory.register(obj, name)

    def alloc(self, nbytes: int, *, name: str | None = None) -> Region:
        """A new zeroed region in shared memory (memfd) that same-host peers map
        directly, so a transfer into it is a single memcpy."""
        return self._memory.alloc(nbytes, name)

    def register_file(
        self,
        path: str | os.PathLike[str],
        *,
        size: int | None = None,
        direct: bool = False,
        name: str | None = None,
    ) -> Region:
        """Registers a file (created if missing when ``size`` is given, and
        grown to it; None: its current size, the file must exist; a failed
        registration removes only a file it created) or a block device (its
        size, or its first ``size`` bytes) as a region of memory kind "file".
        ``write(host_seg, region[a:b])`` writes host memory into it,
        ``read(host_seg, region[a:b])`` reads it into host memory
        (TransferResult.path "file"). ``direct``: O_DIRECT; offsets, lengths
        and host addresses must then be block aligned. Never advertised to
        peers. See aioxfer.file_transport."""
        return file_transport.register_file(self, path, size, direct, name)

    def register_objects(self, url: str, **kwargs: Any) -> ObjectRegion:
        """Registers S3-compatible object storage ("s3://bucket/prefix"; keyword
        arguments endpoint, access_key_id, secret_access_key, region, ...; the
        AWS environment variables otherwise) as a region of kind "object": see
        aioxfer.backends.objects (needs the "objects" extra: obstore, aiohttp)."""
        from aioxfer.backends.objects import register_objects

        return register_objects(self, url, **kwargs)

    async def serve_metrics(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serves this agent's counters to Prometheus on http://host:port/metrics
        until aclose(): see aioxfer.metrics (needs prometheus_client)."""
        from aioxfer.metrics import serve_metrics

        return await serve_metrics(self, port, host)

    def deregister(self, region: Region) -> Awaitable[None]:
        """Revokes a region: peers' new accesses fail with AccessDenied; transfers
        already using it finish first. Returns an awaitable (a Future when an
        event loop runs; ignoring it is fine) that completes only when no peer
        can touch the memory any more: every peer acknowledged the revocation,
        or is verifiably gone (a same-host peer's process exited: a closed
        socket is not enough, a stopped process keeps its mappings; a tcp peer
        that does not acknowledge within ``limits.revoke_timeout`` is
        disconnected). Until then the region is quarantined: its buffer stays
        pinned and, for alloc'd regions, mapped. Idempotent: every call waits
        for the one release, each with a future of its own (as
        ``Transfer.settled()``): cancelling one (a deadline on it) stops only
        that wait, never the release nor another caller's wait of it."""
        if region._agent is not self:
            raise ValueError(
                f"{region!r} belongs to agent {region._agent.name!r}, not {self.name!r}"
            )
        released = self._memory.deregister(region)
        if isinstance(released, asyncio.Future) and not released.done():
            return _own_wait(released)
        return released  # over (or no loop runs: nothing can wait for it)

    @property
    def regions(self) -> list[Region]:
        return list(self._memory.regions.values())

    def region(self, name: str) -> Region:
        try:
            return self._memory.regions[name]
        except KeyError:
            raise KeyError(f"agent {self.name!r} has no region {name!r}") from None

    def _peer_gone(self, peer: Peer) -> None:
        """A peer was lost or closed (PeerTable.mark_lost): what waited in
        our scheduler for it fails now, and its rails are re-dialled no more."""
        self._sub.fail_queued(peer)
        if "_rails" in self.__dict__:  # (a cached_property: made by the first connect)
            self._rails.forget(peer)

    def _notify_release(self, tag: int) -> None:
        """The application took a notification that came on tag's connection:
        the engine may read that connection again if it had paused it."""
        if not self._closed:
            self._engine.notify_release(tag, 1)

    # ------------------------------------------------------------ membership

    def membership(self) -> Membership:
        """An async iterator of PeerJoined, PeerUpdated and PeerLeft events: a
        PeerJoined for every current member first, then changes as they happen,
        until the agent closes (or the iterator's ``aclose()``).

        With discovery the members are etcd's (everyone under the prefix but
        this agent); embedded, they are the peers this agent connected to
        (connect: PeerJoined; a refresh that finds new or deregistered regions:
        PeerUpdated; lost, restarted or closed: PeerLeft). Several consumers
        may iterate at once; each gets every event."""
        self._check_open()
        if self._cluster is not None:
            initial = self._membership.snapshot()
        else:
            initial = [
                PeerJoined(p.name, p.incarnation, p.address, tuple(sorted(p.regions)))
                for p in self._peers.by_ep.values()
            ]
        return self._membership.subscribe(initial)

    # ------------------------------------------------------------ peers

    @property
    def peers(self) -> list[Peer]:
        """Connected peers (not lost)."""
        return self._peers.live()

    async def connect(self, address: str) -> Peer:
        """Connects to the agent at "host:port": fetches its metadata, chooses
        the transport (logged once as ``peer.connected``), opens the data
        connections and imports its regions. Cached: connecting again to a live
        peer returns the same Peer; concurrent calls share one attempt.

        With discovery, ``address`` may also be an agent's name (no ":port"):
        it is resolved through etcd, and the Peer returned is the incarnation
        etcd holds now (a Peer of an older one is fenced: StalePeer). A name
        etcd does not hold raises PeerLost."""
        self._check_open()
        if not _is_address(address):
            if self._cluster is None:
                raise ValueError(
                    f'{address!r} is not a "host:port" address, and agent {self.name!r} has no '
                    f"discovery to resolve names with (Agent(..., discovery=Etcd(...)))"
                )
            await self.start()
            return await self._cluster.connect(address, self.connect)
        await self._key_derived()
        loop = self._start()
        peer = self._peers.by_addr.get(address)
        if peer is not None and not peer._lost:
            return peer
        task = self._connecting.get(address)
        if task is None:
            # The attempt's first connection is dialled and its Hello sent
            # now, not in the task's first step a loop iteration later: the
            # peer's loop wakes to answer it (~0.25 ms on an idle host) while
            # our task starts and the handshake is prepared, instead of after
            # (Connector.predial).
            attempt = _Attempt(address, self._connector.predial(address))
            task = loop.create_task(self._attempt(attempt), name=f"aioxfer-connect-{address}")
            self._connecting[address] = task
            self._attempts[task] = attempt
            task.add_done_callback(self._connect_done)
        # Each caller waits on a future of its own, resolved by the attempt
        # itself as it ends (_attempt): a cancelled caller cancels only its
        # own (as with asyncio.shield), and the callers resume one loop
        # iteration after the attempt's end, not two (the task's done
        # callbacks, then shield's outer future's).
        mine = self._attempts.get(task)
        fut: asyncio.Future[Peer]
        if mine is None or task.done():  # (ended, its callbacks not run yet)
            fut = asyncio.shield(task)
        else:
            fut = loop.create_future()
            mine.waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._closed and task.cancelled():
                raise ClosedResourceError(
                    f"agent {self.name!r} was closed while connecting to {address}"
                ) from None
            raise

    async def _attempt(self, attempt: _Attempt) -> Peer:
        """One connect attempt (Connector.connect), shared by its callers:
        each one's future gets its outcome here, as it ends."""
        try:
            peer = await self._connector.connect(attempt.address, attempt.first)
        except BaseException as exc:
            attempt.resolve(None, exc)
            raise  # (_connect_done: the rest)
        # Done with here, not by _connect_done: a callback still ready when
        # the callers resume would keep a first transfer's await from
        # polling for its completion (progress.Poller.spin_alone).
        task = asyncio.current_task()
        assert task is not None
        task.remove_done_callback(self._connect_done)
        self._connect_ended(task)
        attempt.resolve(peer, None)
        return peer

    def _connect_ended(self, task: asyncio.Task[Peer]) -> _Attempt | None:
        attempt = self._attempts.pop(task, None)
        if attempt is not None and self._connecting.get(attempt.address) is task:
            del self._connecting[attempt.address]
        return attempt

    def _connect_done(self, task: asyncio.Task[Peer]) -> None:
        """An attempt that failed, or was cancelled (maybe before its first
        step: the agent closed at once)."""
        attempt = self._connect_ended(task)
        exc: BaseException | None
        if task.cancelled():
            exc = asyncio.CancelledError()
        else:
            exc = task.exception()  # retrieved: every awaiter may have been cancelled
        if attempt is not None:
            if attempt.first is not None:
                attempt.first.close()  # (a no-op on one handed on)
            attempt.resolve(None if exc is not None else task.result(), exc)

    @functools.cached_property
    def _connector(self) -> Connector:
        """The connect-flow collaborator, made on first use."""
        return Connector(
            self.name,
            config=ConnectConfig(
                incarnation=self.incarnation,
                token=self._token,
                host_id=self._host_id,
                local=self._local_sock is not None,
                transports=self.transports,
                verbs_devices=tuple(self._verbs_devices),
                max_rails=self._max_rails,
                tcp_connections=self._tcp_connections,
                peer_max_bytes=self._limits[0],
                peer_max_requests=self._limits[1],
            ),
            engine=self._engine,
            dialer=self._dialer,
            peers=self._peers,
            tags=self._tags,
            rails=self._rails,
            embedded=self._membership if self._cluster is None else None,
            connecting=self._connecting_eps,
            closed=lambda: self._closed,
        )

    # ------------------------------------------------------------ rails
    # Keeping a tcp peer's rails up (noticing a rail down, re-dialling it)
    # lives in aioxfer.rails.Rails; these delegate to it.

    @functools.cached_property
    def _rails(self) -> Rails:
        """The rails collaborator, made on first use."""
        return Rails(
            self.name,
            endpoint_rails=self._engine.endpoint_rails,
            add_conn=self._engine.endpoint_add_conn,
            open_conn=self._dialer.open,
            probe_delay=self._rail_probe,
            probe_max=self.limits.rail_probe_max,
            tasks=self._probes,
            closed=lambda: self._closed,
            timeout_status=_cyx.E_TIMEOUT,
            loop=lambda: self._loop,
        )

    # ------------------------------------------------------------ data path

    def write(
        self,
        src: Local,
        dst: Remote | FarSegment | Sequence[FarSegment],
        *,
        notify: bytes | bytearray | memoryview | None = None,
        priority: int = 0,
    ) -> Transfer:
        """Posts a WRITE of local ``src`` into the peer's ``dst``; returns its
        Transfer. With ``notify``, the peer receives that payload (1..4096
        bytes) only after all the data is in its memory.

        ``src``/``dst``: a Segment and a RemoteSegment, equal-length lists of
        them, or two SegmentLists; lengths must match pair by pair. ``dst``
        may also be this agent's file region (``register_file``): its
        Segments, or a SegmentList of it (no ``notify`` then).
        ``priority``: matters when the peer's limits are reached (see Agent)."""
        if type(src) is Segment and type(dst) is RemoteSegment and notify is None:
            # The most frequent request, on the shortest path: _descs_one
            # inlined, its descriptor a tuple (_cyx packs it without numpy).
            lr = src.region
            rr = dst.region
            peer = rr.peer
            n = src.length
            if (
                self._closed
                or lr._agent is not self
                or lr._closed
                or rr._gone
                or n != dst.length
                or not n
                or peer._host is not self._peers
                or lr.kind is not rr.kind  # GPU memory: is the path one that reaches it?
                or lr.kind != "host"  # (on both sides: tcp does not reach it)
            ):
                self._check_open()
                self._check_pair(src, dst, 0)
            # self._submit bound to a local first: called as a method, a callable
            # held by the instance defeats 3.11's LOAD_METHOD specialization.
            submit = self._submit
            t = submit(
                peer, _OP_WRITE, (lr.rid, src.offset, rr.rid, rr.key, dst.offset, n), None, n,
                "write", priority,
            )
            if peer.path == "cuda":
                t._path = _cuda_path(src, dst)
            return t
        descs: _Descs
        starts: npt.NDArray[np.intp] | None = None
        if type(src) is Segment and type(dst) is RemoteSegment:
            peer, descs, nbytes = self._descs_one(src, dst)  # nothing to merge
        else:
            backend = _backends.local_target(dst)  # a local backend's region (object storage)
            if backend is not None:
                if type(priority) is not int:  # as submit checks it for a peer's requests
                    priority = as_priority(priority)
                return backend.post(self, "write", src, dst, notify, priority)
            peer, descs, nbytes = self._descs(src, dst, "write")
            descs, starts = _coalesce(descs)
        payload = None if notify is None else notify_payload(notify)
        if payload is not None and peer is self._file_peer:
            raise ValueError("a write into a file region takes no notify (nobody to tell)")
        submit = self._submit
        t = submit(peer, _OP_WRITE, descs, payload, nbytes, "write", priority)
        if starts is not None:
            t._starts = starts
        if peer.path == "cuda":
            t._path = _cuda_path(src, dst)
        return t

    def read(
        self, dst: Local, src: Remote | FarSegment | Sequence[FarSegment], *, priority: int = 0
    ) -> Transfer:
        """Posts a READ of the peer's ``src`` into local ``dst``; returns its
        Transfer. Same shapes and ``priority`` as ``write``."""
        descs: _Descs
        starts: npt.NDArray[np.intp] | None = None
        if type(dst) is Segment and type(src) is RemoteSegment:
            # As in write: _descs_one inlined.
            lr = dst.region
            rr = src.region
            peer = rr.peer
            n = dst.length
            if (
                self._closed
                or lr._agent is not self
                or lr._closed
                or rr._gone
                or n != src.length
                or not n
                or peer._host is not self._peers
                or lr.kind is not rr.kind
                or lr.kind != "host"  # GPU memory on both sides: does the path reach it?
            ):
                self._check_open()
                self._check_pair(dst, src, 0)
            submit = self._submit
            t = submit(
                peer, _OP_READ, (lr.rid, dst.offset, rr.rid, rr.key, src.offset, n), None, n,
                "read", priority,
            )
            if peer.path == "cuda":
                t._path = _cuda_path(dst, src)
            return t
        else:
            backend = _backends.local_target(src)  # a local backend's region (object storage)
            if backend is not None:
                if type(priority) is not int:  # as submit checks it for a peer's requests
                    priority = as_priority(priority)
                return backend.post(self, "read", dst, src, None, priority)
            peer, descs, nbytes = self._descs(dst, src, "read")
            descs, starts = _coalesce(descs)
        submit = self._submit
        t = submit(peer, _OP_READ, descs, None, nbytes, "read", priority)
        if starts is not None:
            t._starts = starts
        if peer.path == "cuda":
            t._path = _cuda_path(dst, src)
        return t

    def post_arrays(
        self,
        op: str,
        local: Region,
        remote: RemoteRegion,
        local_offsets: npt.ArrayLike,
        remote_offsets: npt.ArrayLike,
        length: int,
        *,
        priority: int = 0,
    ) -> Transfer:
        """Posts a READ (``op="read"``: the peer's bytes into ``local``) or a
        WRITE (``"write"``) of ``length`` bytes at each pair of offsets (1-D
        uint64 arrays best: used as they are); returns its Transfer. For a
        caller that keeps its blocks' places as arrays (a KV store posting
        layers): no SegmentList, pairing or merging per call; the checks of
        ``read``/``write`` (regions alive, peer, memory kind, bounds) stay."""
        if self._closed:
            self._check_open()
        if op != "read" and op != "write":
            raise ValueError(f'op is "read" or "write", not {op!r}')
        peer, descs, nbytes = descriptors.from_arrays(
            local, remote, local_offsets, remote_offsets, length, owner=self, peers=self._peers
        )
        submit = self._submit
        t = submit(
            peer, _OP_READ if op == "read" else _OP_WRITE, descs, None, nbytes, op, priority
        )
        if peer.path == "cuda":
            t._path = "shm" if local.kind == remote.kind == "host" else "cuda"
        return t

    def _descs(self, local: Any, remote: Any, op: str) -> tuple[Peer, _Descs, int]:
        """The (n, 6) uint64 descriptor array [lrid, loff, rrid, rkey, roff, len],
        or for one segment that row as a tuple."""
        if type(local) is Segment and type(remote) is RemoteSegment:
            return self._descs_one(local, remote)
        self._check_open()
        if file_transport.is_file_target(remote):
            return file_transport.descs(self, local, remote)
        if isinstance(local, SegmentList) and isinstance(remote, SegmentList):
            return descriptors.from_vectors(local, remote, owner=self)
        if (
            isinstance(local, Sequence)
            and isinstance(remote, Sequence)
            and not isinstance(local, str | bytes | bytearray)
            and not isinstance(remote, str | bytes | bytearray)
        ):
            return descriptors.from_lists(local, remote, owner=self, peers=self._peers)
        raise TypeError(
            f"{op} takes a Segment and a RemoteSegment, equal-length lists of them, or two "
            f"SegmentLists; not {type(local).__name__} and {type(remote).__name__}"
        )

    def _descs_one(
        self, local: Segment, remote: RemoteSegment
    ) -> tuple[Peer, tuple[int, int, int, int, int, int], int]:
        """One Segment and one RemoteSegment: the most frequent request, so
        checked on the shortest path; its descriptor as a tuple (_cyx packs it
        without a numpy array)."""
        if self._closed:
            self._check_open()
        lr = local.region
        rr = remote.region
        n = local.length
        if (
            lr._agent is not self
            or lr._closed
            or rr._gone
            or n != remote.length
            or not n
            or rr.peer._host is not self._peers
            or lr.kind is not rr.kind  # GPU memory: is the path one that reaches it?
            or lr.kind != "host"  # (on both sides: tcp does not reach it)
        ):
            self._check_pair(local, remote, 0)
        return rr.peer, (lr.rid, local.offset, rr.rid, rr.key, remote.offset, n), n

    def _check_pair(self, local: Any, remote: Any, i: int) -> None:
        descriptors.check_pair(local, remote, i, owner=self, peers=self._peers)

    # ------------------------------------------------------------ completions

    @property
    def inline_bytes(self) -> int:
        """The engine's inline threshold (see ``Agent``): a same-host request
        awaited alone up to this size is copied inside the post; 0: never."""
        n = self._engine.inline_bytes
        return 0 if n == _NEVER_INLINE else n

    def fileno(self) -> int:
        """The engine's completion eventfd (readable while completions wait).
        The agent's event loop already watches it; an integration that drives
        its own wait (a NIXL-style polling thread, a selector) may too, and
        then calls ``poll()`` from the loop's thread."""
        return self._fd

    def flush(self) -> None:
        """Posts every transfer submitted but not yet handed to the engine,
        now, instead of at the end of this loop iteration. Loop thread only.
        One transfer with nothing else in flight, within ``inline_bytes``, is
        posted as an awaited lone request is (a same-host copy runs inside
        this call): a caller flushing one request then polling it (the NIXL
        pattern) gets what a coroutine awaiting it gets (the engine applies
        the threshold)."""
        self._sub.flush()

    def poll(self) -> None:
        """Takes the completions the engine has now (the eventfd reader's
        work): their transfers are done when this returns. Loop thread only."""
        self._sub.drain()

    @property
    def poll_us(self) -> int:
        """The engine's calibrated bound of one busy-poll, µs (the "adaptive"
        spin: about two thread wake-ups)."""
        return int(self._engine.poll_us)

    def wait(self, max_us: int) -> bool:
        """Whether completions wait for poll(), spinning up to max_us µs for
        one (the GIL released; 0: a look, no system call). Takes nothing: for
        an integration that waits from its own thread (see fileno()); never
        concurrently with aclose()."""
        return bool(self._engine.wait(max_us) > 0)

    # ------------------------------------------------------------ statistics

    def statistics(self) -> AgentStatistics:
        native = (self._final_native or {}) if self._closed else self._engine.stats()
        return agent_statistics(
            self.name,
            self.address,
            regions=len(self._memory.regions),
            peers=len(self._peers.by_ep),
            counters=self._sub.counters(),
            native=native,
            pinned_regions=self._engine.pinned_regions(),
        )

    # ------------------------------------------------------------ prepared requests

    def prepare(
        self, op: str, local: Local, remote: Remote | FarSegment | Sequence[FarSegment], *,
        priority: int = 0,
    ) -> _cyx.Prepared:
        """A request to post again and again: ``prepare("write", src, dst)``
        then ``p.post()`` is ``write(src, dst)`` each time (``"read"``:
        ``read(local, remote)``), with the pair checked here, once, rather
        than on every post; ``p.post(now=True)`` also hands it to the engine
        before returning (``flush``), for a caller that polls for it rather
        than awaits it. The same shapes as ``write``/``read``; a post after
        the agent closed, the local region was deregistered or the remote
        one went away raises what ``write``/``read`` raise then, and one to
        a lost peer fails as theirs do.

        For one Segment and one RemoteSegment (the usual repost, a NIXL
        prepared transfer), or a SegmentList pair in one region pair (a NIXL
        request of many descriptors by index: its descriptors made here,
        once), a post is one compiled call: no Python frame."""
        if op != "write" and op != "read":
            raise ValueError(f'op is "read" or "write", not {op!r}')
        self._check_open()
        slow = self.write if op == "write" else self.read
        opcode = _OP_WRITE if op == "write" else _OP_READ
        if type(local) is Segment and type(remote) is RemoteSegment:
            peer, desc, n = self._descs_one(local, remote)
            if peer.path != "cuda":  # (its transfers carry their path: write's)
                return _cyx.Prepared(
                    self, op, local, remote, slow, self._submit, self.flush, peer, opcode,
                    desc, n, priority, local.region, remote.region,
                )
        n = 0
        if _backends.local_target(remote) is None:
            n = self._descs(local, remote, op)[2]  # checked now (raises what write/read would)
        return _cyx.Prepared(
            self, op, local, remote, slow, self._submit, self.flush, None, opcode, None, n,
            priority, None, None,
        )

    # ------------------------------------------------------------ wait, then poll

    # wait_poll(max_us) -> bool: wait(max_us), then poll() when completions
    # came, for an integration that waits from its own thread (see fileno());
    # what came during the wait is left unsignalled for that poll (two system
    # calls fewer than wait() then poll()). Compiled, called as a method
    # without a Python frame (aioxfer.nixl waits per request): see
    # _cyx.agent_wait_poll.
    wait_poll = _cyx.agent_wait_poll


# ---------------------------------------------------------------- helpers


class _Attempt:
    """One connect attempt (Agent.connect): the address, its first
    connection (Connector.predial), its callers' futures."""

    __slots__ = ("address", "first", "waiters")

    def __init__(self, address: str, first: Predialed | None) -> None:
        self.address = address
        self.first = first
        self.waiters: list[asyncio.Future[Peer]] = []

    def resolve(self, peer: Peer | None, exc: BaseException | None) -> None:
        """The outcome, to each caller still waiting."""
        for f in self.waiters:
            if f.done():  # (its caller was cancelled)
                continue
            if exc is None:
                assert peer is not None
                f.set_result(peer)
            elif isinstance(exc, asyncio.CancelledError):
                f.cancel()
            else:
                f.set_exception(exc)


def _describe(t: Transfer) -> str:
    if t.op == "notify":
        return f"notification to peer {t.peer.name!r}"
    prep = "from" if t.op == "read" else "to"
    if t.peer.path == file_transport.PATH:
        return f"{t.op} of {t.nbytes} bytes {prep} a file region"
    return f"{t.op} of {t.nbytes} bytes {prep} peer {t.peer.name!r}"


def _own_wait(shared: asyncio.Future[None]) -> asyncio.Future[None]:
    """A future of its own that ends as ``shared`` (one region's release)
    does: cancelling it stops only this wait. Handing out ``shared`` itself,
    one caller's deadline cancelled the release's future for every caller:
    another task awaiting it got CancelledError without being cancelled, and
    every later deregister() of the region answered that cancelled future
    (rev31). A release that fails (the region quarantined at close) fails
    it alike, its error marked retrieved: the shared future, referenced for
    good by the quarantine, never logged one, and this one may be ignored."""
    mine: asyncio.Future[None] = shared.get_loop().create_future()

    def over(_: asyncio.Future[None]) -> None:
        if mine.done():
            return  # (its waiter gave up, and mine's own callback ran late)
        if shared.cancelled():
            mine.cancel()
            return
        exc = shared.exception()
        if exc is None:
            mine.set_result(None)
        else:
            mine.set_exception(exc)
            mine.exception()  # retrieved: ignoring deregister()'s answer is fine

    def gave_up(_: asyncio.Future[None]) -> None:
        if mine.cancelled():  # no callback left behind per abandoned wait
            shared.remove_done_callback(over)

    shared.add_done_callback(over)
    mine.add_done_callback(gave_up)
    return mine


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _caller_cancelling() -> bool:
    """Whether the current task is being cancelled (or there is none). Asked
    in a frame of its own: a task kept in a local of the frame that re-raises
    its CancelledError is a cycle (task -> error -> traceback -> frame ->
    task) that holds all that frame holds until the next garbage collection."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _is_address(target: str) -> bool:
    """"host:port" (or "[v6]:port"), as opposed to an agent's name."""
    if not isinstance(target, str):
        return True  # let _parse_address say what is wrong with it
    host, sep, port = target.rpartition(":")
    return bool(sep and host and port.isdigit())


def _unchanged() -> None:
    """Memory's ``changed`` without discovery: nothing is published."""


def _listen(listen: str) -> tuple[socket.socket, str]:
    host, port = parse_address(listen)
    infos = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
    )
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        loopback = family in (socket.AF_INET, socket.AF_INET6) and (
            str(sockaddr[0]).startswith("127.") or sockaddr[0] == "::1"
        )
        if not loopback:
            # Not on a loopback listener: every client is on this host, and
            # one accepted at its connect has the Hello polled for in the
            # accepting step (serving.Server._join_polled), so the wake-up of
            # an idle vCPU (~0.1-0.2 ms) overlaps the client's making and
            # sending its Hello instead of following it (tgt36, run.py
            # --connect-only: tcp connect + first write 0.67-0.93x of the
            # deferred accept's, four runs, slots swapped). Where nothing
            # is polled, the agent's start defers it after all (_start).
            _defer_accept(sock)
        sock.listen(512)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()
    h = bound[0]
    address = f"[{h}]:{bound[1]}" if ":" in h else f"{h}:{bound[1]}"
    return sock, address


def _defer_accept(sock: socket.socket) -> None:
    """TCP_DEFER_ACCEPT on the listening sock, where the kernel has it.

    Why: every client speaks first (Hello): the kernel hands us a connection
    once its first bytes are in, so a connect wakes this process once
    (accept and Hello together), not twice, and a same-host client's early
    Hello is there when the accepting step answers (server_early_now: no
    Proof round). A client that never speaks is accepted after ~1 s anyway,
    then dropped at the handshake deadline as before."""
    if hasattr(socket, "TCP_DEFER_ACCEPT"):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)


_HOST_ID: str | None = None


def host_id() -> str:
    """Equal for two processes iff they share a kernel boot and a pid namespace
    (so pids name the same processes and cross-memory attach can reach them);
    "" where that cannot be known (then shm is never chosen)."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            ns = os.stat("/proc/self/ns/pid").st_ino
            _HOST_ID = f"{boot}:{ns}" if boot else ""
        except OSError:
            _HOST_ID = ""
    return _HOST_ID

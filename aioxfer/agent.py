"""Agent: registered memory, peers, and the asyncio side of the native engine.

Threading: an Agent lives on one event loop. The loop thread only validates,
submits and drains; copies, socket I/O and keepalives run on engine threads.
Submissions made in one loop iteration go to the engine in one native call
(``post_many``, one doorbell); completions come back through one eventfd watched
with ``loop.add_reader`` and are drained in batches.

Lifetime: the agent owns its peers and regions. ``aclose()`` fails whatever is
in flight with ClosedResourceError, and releases every buffer once the engine
confirms nothing touches it any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import mmap
import os
import secrets
import socket
import sys
import warnings
import weakref
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

from aioxfer import _cyx, file_transport
from aioxfer import cuda as _cuda
from aioxfer import progress as _progress
from aioxfer import verbs as _verbs
from aioxfer._abi import MAX_CONNS  # connections one endpoint may have
from aioxfer.auth import default_token
from aioxfer.backends import registry as _backends
from aioxfer.dialing import Dialer, parse_address
from aioxfer.discovery import (
    Etcd,
    EtcdSession,
    Membership,
    MembershipEvent,
    PeerJoined,
    PeerUpdated,
    encode_meta,
)
from aioxfer.errors import (
    AccessDenied,
    ClosedResourceError,
    PeerLost,
    ProtocolError,
    RegistrationError,
    StalePeer,
    TransportError,
    XferError,
    error_class,
)
from aioxfer.limits import Limits
from aioxfer.local import (
    PeerCred,
    check_sealed,
    listen_local,
    peer_cred,
    peer_pidfd,
    seal,
)
from aioxfer.log import get_logger
from aioxfer.members import Members
from aioxfer.metadata import (
    PROTOCOL_VERSION,
    Accept,
    AgentMeta,
    CudaExport,
    RegionMeta,
    VerbsAccept,
    VerbsConnect,
    VerbsQP,
)
from aioxfer.notifications import Notification, Notifications
from aioxfer.peer import Peer
from aioxfer.peertable import PeerTable, notify_payload
from aioxfer.protocol import (
    client_handshake,
    recv_frame,
    send_frame,
    token_bytes,
)
from aioxfer.rails import Rails
from aioxfer.region import (
    Region,
    RemoteRegion,
    RemoteSegment,
    Segment,
    SegmentList,
    pair_descs,
)
from aioxfer.scheduling import PeerScheduler
from aioxfer.serving import Server, qp_tuple
from aioxfer.stats import AgentStatistics, agent_statistics
from aioxfer.submission import Submission
from aioxfer.transfer import Transfer

if TYPE_CHECKING:  # optional extras, imported where used
    from aioxfer.backends.base import FarSegment
    from aioxfer.backends.objects import ObjectRegion
    from aioxfer.metrics import MetricsServer

__all__ = ["Agent"]

_log = get_logger("aioxfer")

TRANSPORTS = ("shm", "tcp", "verbs", "cuda")
_NEVER_INLINE = (1 << 64) - 1  # the engine's inline_bytes for "never"
# A request's descriptors: an (n, 6) uint64 array, or one row as a tuple.
_Descs = npt.NDArray[np.uint64] | tuple[int, int, int, int, int, int]

_OK = _cyx.OK
_OP_WRITE = _cyx.OP_WRITE
_OP_READ = _cyx.OP_READ
_CQ_NOTIFY = _cyx.CQ_NOTIFY
_E_CLOSED = _cyx.E_CLOSED
_E_PEER_LOST = _cyx.E_PEER_LOST

Local = Segment | Sequence[Segment] | SegmentList
# A Segment (or list of them) of a file region: Agent.register_file.
Remote = RemoteSegment | Segment | Sequence[RemoteSegment] | Sequence[Segment] | SegmentList


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
    fail with PeerLost); ``keepalive``: idle ping interval. ``tcp_connections``:
    connections per TCP peer and rail (large transfers are split across them).
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
    the post, instead of by a copy worker (two thread wake-ups saved); batches
    keep the workers. None (the default): calibrated at start-up from this
    machine's measured thread wake-up cost and memcpy bandwidth (a few MiB in
    a VM, less on bare metal; ``$AIOXFER_INLINE_BYTES`` overrides it); an int:
    that (other same-host requests up to the smaller of it and 64 KiB are
    copied at submit too); 0: never (every copy on the workers).
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
    ) -> None:
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise ValueError("agent name must be a string of 1..256 characters")
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
        if not peer_timeout > 0 or not keepalive > 0:
            raise ValueError("peer_timeout and keepalive must be positive (seconds)")
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
        if not rail_probe > 0 or (stall_timeout is not None and not stall_timeout > 0):
            raise ValueError("rail_probe and stall_timeout must be positive (seconds)")
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
        if insecure_no_auth:
            if token is not None:
                raise ValueError("give either token= or insecure_no_auth=True, not both")
            self._token: bytes | None = None
        else:
            self._token = token_bytes(token) if token is not None else default_token()
        self._peer_timeout = float(peer_timeout)
        self._dialer = Dialer(
            name,
            incarnation=self.incarnation,
            token=self._token,
            peer_timeout=self._peer_timeout,
            max_meta_bytes=limits.max_meta_bytes,
        )
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
            except OSError as exc:
                _log.warning("local.unavailable", agent=self.name, reason=str(exc))
        self._accept_msg = Accept(name=self.name, incarnation=self.incarnation,
                                  host_id=self._host_id, local=self._local_name)
        self._verbs_devices: list[str] = []
        if "verbs" in transports:
            try:
                # Only verbs asked for: its absence is an error, else a fallback.
                self._verbs_devices = self._enable_verbs(explicit=transports == ("verbs",))
            except BaseException:
                for lsock in self._lsocks:
                    lsock.close()
                self._engine.close()
                raise
            if not self._verbs_devices:
                transports = tuple(t for t in transports if t != "verbs")
                self.transports = transports

        self._accept_tasks: list[asyncio.Task[None]] = []
        self._probes: set[asyncio.Task[None]] = set()
        self._serving: set[asyncio.Task[None]] = set()
        self.notifications = Notifications(self._notify_release)

        # memory
        self._regions: dict[str, Region] = {}
        self._freeing: dict[int, Region] = {}  # deregistered, memory still ours to release
        self._settled: asyncio.Event | None = None  # aclose: set on each freed region
        self._file_peer: Peer | None = None  # the FILE endpoint, made by the first file transfer

        # peers
        self._connecting: dict[str, asyncio.Task[Peer]] = {}
        self._connecting_eps: dict[int, int] = {}  # endpoint -> status if lost meanwhile
        self._tags: dict[tuple[str, int], int] = {}
        self._tag_names: dict[int, str] = {}
        self._tag_keys: dict[int, tuple[str, int]] = {}
        self._tag_refs: dict[int, int] = {}
        self._next_tag = itertools.count(1).__next__

        # membership
        self._discovery = discovery
        self._session: EtcdSession | None = None
        self._session_start: asyncio.Task[None] | None = None
        self._members: dict[str, AgentMeta] = {}  # etcd's view, all but us
        self._subscribers: weakref.WeakSet[Membership] = weakref.WeakSet()

        # data path: the batch, transfers in flight, admission, the drain
        self._sub = Submission(
            name,
            engine=self._engine,
            start=self._start,
            # A lone request up to this is posted at its await (Submission.eager).
            alone_max=self.inline_bytes,
            on_event=self._on_event,
            peer_lost=lambda peer, status: self._peers.mark_lost(peer, status),
            describe=_describe,
        )
        # Bound once: write/read call it once per transfer.
        self._submit = self._sub.submit
        # peers: the tables that find them; what a Peer asks of its agent
        self._peers = PeerTable(
            name,
            engine=self._engine,
            closed=lambda: self._closed,
            submit=self._submit,
            refresh=self._refresh_peer,
            fail_queued=self._sub.fail_queued,
            tag_unref=self._tag_unref,
            emit=self._emit if discovery is None else None,
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
        cannot be reached). Idempotent."""
        self._start()
        if self._session_start is not None:
            await asyncio.shield(self._session_start)
        return self

    def _start(self) -> asyncio.AbstractEventLoop:
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
                sub, self._engine.wait, loop, self.progress, self._engine.poll_us
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
            meta=self._meta,
            local_meta=self._local_meta,
            tag_for=self._tag_for,
            tag_unref=self._tag_unref,
            tasks=self._serving,
            closed=lambda: self._closed,
        )
        self._accept_tasks = [
            loop.create_task(server.accept_loop(loop, lsock), name=f"aioxfer-accept-{self.name}")
            for lsock in self._lsocks
        ]
        if self._local_sock is not None:
            self._accept_tasks.append(loop.create_task(
                server.accept_loop(loop, self._local_sock, local=True),
                name=f"aioxfer-accept-local-{self.name}",
            ))
        if self._discovery is not None:
            # Joining needs etcd round trips: start() awaits it; a lazy start
            # (first connect, write or read) lets it run in the background.
            self._session_start = loop.create_task(
                self._start_discovery(), name=f"aioxfer-join-{self.name}"
            )
            self._session_start.add_done_callback(_retrieve)
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
        if self._loop is not None and (self._regions or self._freeing):
            await self._release_all()
        self._closed = self._sub.closed = True
        tasks: list[asyncio.Task[Any]] = [
            task
            for task in (
                *self._accept_tasks,
                *self._probes,
                *self._serving,
                *self._connecting.values(),
                self._session_start,
            )
            if task is not None
        ]
        for task in tasks:
            task.cancel()
        try:
            # local backends (object storage, plugins): fail in flight, close clients
            await _backends.aclose_agent(self)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self._session is not None:
                # Leave first, so that the others see PeerLeft now rather than
                # when our lease would expire.
                await self._session.aclose()
        finally:
            self._shutdown()

    async def _release_all(self) -> None:
        """Deregisters every region and waits, bounded, until peers released them."""
        for region in list(self._regions.values()):
            with contextlib.suppress(RegistrationError):
                self.deregister(region)
        self._settled = asyncio.Event()
        try:
            async with asyncio.timeout(self.limits.close_timeout):
                while self._held_regions():
                    self._settled.clear()
                    await self._settled.wait()
        except TimeoutError:
            pass
        finally:
            self._settled = None
        held = self._held_regions()
        if held:
            names = sorted({self._tag_names.get(t, f"tag-{t}") for tags in held.values()
                            for t in tags})
            for rid in held:
                if rid in self._freeing:
                    _QUARANTINE.append(self._freeing.pop(rid))  # its buffer is never released
            _log.warning("agent.close_gave_up", agent=self.name, peers=names,
                         regions=len(held), timeout=self.limits.close_timeout,
                         reason="peers that could still touch our memory did not release it")

    def _held_regions(self) -> dict[int, list[int]]:
        """Deregistered regions some connection still holds: rid -> tags."""
        held: dict[int, list[int]] = {}
        for rid in self._freeing:
            tags = self._engine.region_holders(rid)
            if tags:
                held[rid] = tags
        return held

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
        for region in list(self._regions.values()):
            region._closed = True
            self._release_memory(region)
        self._regions.clear()
        for region in list(self._freeing.values()):
            self._release_memory(region)
        self._freeing.clear()
        for peer in self._peers.live():
            self._peers.mark_lost(peer, _E_CLOSED, log=False)
        self._peers.clear()
        self._members.clear()
        for stream in list(self._subscribers):
            stream._end()
        self._subscribers.clear()
        self.notifications._close()
        for lsock in self._lsocks:
            lsock.close()
        if self._local_sock is not None:
            self._local_sock.close()
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

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"agent {self.name!r} is closed")

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
        try:
            mem = _cuda.inspect(obj)
        except ValueError as exc:
            raise RegistrationError(f"cannot register {type(obj).__name__}: {exc}") from None
        if mem is not None:
            return self._register_pointer(obj, mem, name)
        return self._register(obj, name)

    def _register_pointer(self, obj: Any, mem: _cuda.GpuMemory, name: str | None) -> Region:
        self._check_open()
        if name is not None:
            self._check_name(name)
        what = f"cannot register {type(obj).__name__} ({mem.kind} memory, {mem.nbytes} bytes)"
        export = None
        if mem.kind == "cuda":
            ok, why = _cuda.status()
            if not ok:
                raise RegistrationError(f"{what}: CUDA is not available: {why}")
            try:
                _cyx.cuda_pointer(mem.ptr, mem.nbytes)
            except _cyx.NativeError as exc:
                raise RegistrationError(f"{what}: {exc}") from None
            try:
                handle, offset, device = _cyx.cuda_export(mem.ptr)
                export = CudaExport(handle=handle, offset=offset, device=device)
            except _cyx.NativeError as exc:
                # Still usable locally (and by RDMA); same-host peers cannot map it.
                _log.warning("region.no_cuda_ipc", agent=self.name, error=str(exc))
        access = _cyx.ACCESS_READ | (0 if mem.readonly else _cyx.ACCESS_WRITE)
        kind = _cyx.MEM_CUDA if mem.kind == "cuda" else _cyx.MEM_HOST
        try:
            rid, key = self._engine.register_kind(kind, mem.ptr, mem.nbytes, access, obj)
        except _cyx.NativeError as exc:
            raise RegistrationError(f"{what}: {exc}") from None
        if name is None:
            name = self._default_name(rid)
        region = Region(self, name, rid, key, mem.nbytes, access, mem.ptr, obj)
        region.kind = mem.kind
        region._cuda = export
        self._regions[name] = region
        self._meta_changed()
        return region

    def alloc(self, nbytes: int, *, name: str | None = None) -> Region:
        """A new zeroed region in shared memory (memfd) that same-host peers map
        directly, so a transfer into it is a single memcpy."""
        self._check_open()
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise RegistrationError(f"cannot allocate {nbytes} bytes: size must be positive")
        if name is not None:
            self._check_name(name)
        label = f"aioxfer:{self.name}:{name or 'alloc'}"[:200]
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise RegistrationError(f"cannot create a memfd of {nbytes} bytes: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            # Its size is fixed for good, so a peer mapping it can never take
            # SIGBUS (peers refuse memfds without these seals).
            seal(fd)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise RegistrationError(f"cannot map a memfd of {nbytes} bytes: {exc}") from exc
        try:
            return self._register(mm, name, memfd=fd, ino=os.fstat(fd).st_ino, mm=mm)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    def register_file(
        self,
        path: str | os.PathLike[str],
        *,
        size: int | None = None,
        direct: bool = False,
        name: str | None = None,
    ) -> Region:
        """Registers a file (created if missing and grown to ``size``; None: its
        current size) or a block device (its size, or its first ``size`` bytes)
        as a region of memory kind "file". ``write(host_seg, region[a:b])``
        writes host memory into it, ``read(host_seg, region[a:b])`` reads it
        into host memory (TransferResult.path "file"). ``direct``: O_DIRECT;
        offsets, lengths and host addresses must then be block aligned. Never
        advertised to peers. See aioxfer.file_transport."""
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

    def _default_name(self, rid: int, prefix: str = "region") -> str:
        """A name for an unnamed region: prefix-rid, made unique among ours."""
        name, k = f"{prefix}-{rid}", 1
        while name in self._regions:
            name, k = f"{prefix}-{rid}-{k}", k + 1
        return name

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise RegistrationError("a region name must be a non-empty string")
        if name in self._regions:
            raise RegistrationError(
                f"agent {self.name!r} already has a region named {name!r}; "
                f"deregister it first or choose another name"
            )

    def _register(
        self,
        obj: Any,
        name: str | None,
        *,
        memfd: int = -1,
        ino: int = 0,
        mm: mmap.mmap | None = None,
    ) -> Region:
        self._check_open()
        if name is not None:
            self._check_name(name)
        try:
            rid, key, addr, nbytes, access = self._engine.register(obj, memfd)
        except ValueError as exc:
            raise RegistrationError(f"cannot register {type(obj).__name__}: {exc}") from None
        except (TypeError, BufferError) as exc:
            raise RegistrationError(
                f"cannot register {type(obj).__name__}: not a contiguous buffer ({exc})"
            ) from None
        except _cyx.NativeError as exc:
            raise RegistrationError(f"cannot register {type(obj).__name__}: {exc}") from None
        if name is None:
            name = self._default_name(rid)
        region = Region(self, name, rid, key, nbytes, access, addr, obj, memfd, ino, mm)
        self._regions[name] = region
        if "cuda" in self.transports:
            # Page-locked now, on the engine's CUDA thread, so a GPU copy to or
            # from it is asynchronous and its first one pays no pinning.
            self._engine.cuda_pin_region(rid)
        self._meta_changed()
        return region

    def deregister(self, region: Region) -> Awaitable[None]:
        """Revokes a region: peers' new accesses fail with AccessDenied; transfers
        already using it finish first. Returns an awaitable (a Future when an
        event loop runs; ignoring it is fine) that completes only when no peer
        can touch the memory any more: every peer acknowledged the revocation,
        or is verifiably gone (a same-host peer's process exited: a closed
        socket is not enough, a stopped process keeps its mappings; a tcp peer
        that does not acknowledge within ``limits.revoke_timeout`` is
        disconnected). Until then the region is quarantined: its buffer stays
        pinned and, for alloc'd regions, mapped. Idempotent (the same awaitable)."""
        if region._agent is not self:
            raise ValueError(
                f"{region!r} belongs to agent {region._agent.name!r}, not {self.name!r}"
            )
        if region._released is not None:
            return region._released
        region._closed = True
        if self._regions.get(region.name) is region:
            del self._regions[region.name]
        released = region._released = self._release_future()
        if self._closed:
            _resolve(released)
            return released
        self._freeing[region.rid] = region
        # Transfers posted before this call but still batched for the next
        # flush are "already using it": they go to the engine first, so they
        # finish rather than fail against a region that vanished under them.
        self._sub.post_pending()
        try:
            self._engine.deregister(region.rid)
        except (ValueError, _cyx.NativeError) as exc:
            self._freeing.pop(region.rid, None)
            _resolve(released)
            raise RegistrationError(f"cannot deregister region {region.name!r}: {exc}") from None
        finally:
            self._meta_changed()  # it is gone from our metadata either way
        if self._loop is None:
            self._sub.drain_once()  # not serving yet: no peer; the engine freed it already
        return released

    def _release_future(self) -> Awaitable[None]:
        try:
            return asyncio.get_running_loop().create_future()
        except RuntimeError:  # no loop: nothing can be waiting for it
            return _Released()

    @property
    def regions(self) -> list[Region]:
        return list(self._regions.values())

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"agent {self.name!r} has no region {name!r}") from None

    def _release_memory(self, region: Region) -> None:
        mm, fd = region._mmap, region._memfd
        region._mmap = None
        region._memfd = -1
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # The caller still holds views of it: it is unmapped when they go.
                _log.debug("region.views_alive", agent=self.name, region=region.name)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------ metadata server

    def _meta(self) -> AgentMeta:
        """Our metadata as served over tcp (and etcd): no memfds."""
        return self._meta_with(lambda r: -1)

    def _local_meta(self) -> tuple[AgentMeta, list[int]]:
        """Our metadata as served on the unix socket to a peer the kernel
        vouched for: each alloc'd region names its memfd's index among the fds
        that follow (SCM_RIGHTS)."""
        fds: list[int] = []

        def index(r: Region) -> int:
            if r._memfd < 0:
                return -1
            fds.append(r._memfd)
            return len(fds) - 1

        return self._meta_with(index), fds

    def _meta_with(self, memfd: Callable[[Region], int]) -> AgentMeta:
        return AgentMeta(
            version=PROTOCOL_VERSION,
            name=self.name,
            incarnation=self.incarnation,
            host_id=self._host_id,
            pid=os.getpid(),
            address=self.address,
            transports=list(self.transports),
            regions=[
                RegionMeta(
                    name=r.name,
                    rid=r.rid,
                    key=r.key,
                    nbytes=r.nbytes,
                    access=r.access,
                    addr=r.addr,
                    memfd=memfd(r),
                    verbs=self._engine.verbs_region_keys(r.rid) if self._verbs_devices else [],
                    kind=r.kind,
                    cuda=r._cuda,
                )
                for r in self._regions.values()
                if r.kind != "file"  # file regions are ours alone
            ],
            uid=os.geteuid(),
            byteorder=sys.byteorder,
            rails=list(self.addresses),
            verbs_devices=list(self._verbs_devices),
            local=self._local_name,
        )

    def _tag_for(self, name: str, incarnation: int) -> int:
        """The tag of (name, incarnation)'s connections, one reference more:
        each accepted connection and each endpoint holds one until it is
        gone (_tag_unref), so that churn leaves no tags behind."""
        key = (name, incarnation)
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = self._next_tag()
            self._tag_names[tag] = name
            self._tag_keys[tag] = key
        self._tag_refs[tag] = self._tag_refs.get(tag, 0) + 1
        return tag

    def _notify_release(self, tag: int) -> None:
        """The application took a notification that came on tag's connection:
        the engine may read that connection again if it had paused it."""
        if not self._closed:
            self._engine.notify_release(tag, 1)

    def _tag_unref(self, tag: int) -> None:
        n = self._tag_refs.get(tag, 0) - 1
        if n > 0:
            self._tag_refs[tag] = n
            return
        self._tag_refs.pop(tag, None)
        key = self._tag_keys.pop(tag, None)
        if key is not None:
            self._tags.pop(key, None)
        self._tag_names.pop(tag, None)

    # ------------------------------------------------------------ membership
    # etcd's view, fencing and the membership() streams live in
    # aioxfer.members.Members; the agent keeps what touches its own state
    # (its metadata, the etcd session, dropping a peer).

    @functools.cached_property
    def _membership(self) -> Members:
        """The membership collaborator, made on first use over the agent's tables."""
        return Members(
            self.name,
            members=self._members,
            subscribers=self._subscribers,
            peers_by_name=self._peers.by_name,
            refresh_peer=self._refresh_peer,
            drop_peer=self._peers.drop,
            closed=lambda: self._closed,
        )

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
        if self._discovery is not None:
            initial = self._membership.snapshot()
        else:
            initial = [
                PeerJoined(p.name, p.incarnation, p.address, tuple(sorted(p.regions)))
                for p in self._peers.by_ep.values()
            ]
        return self._membership.subscribe(initial)

    def _emit(self, event: MembershipEvent) -> None:
        self._membership.emit(event)

    def _published_meta(self) -> bytes:
        """Our metadata as published in etcd: no access keys, no memory
        addresses, no memfd numbers; peers fetch those from us over our control
        connection (authenticated when we have a token)."""
        meta = self._meta()
        regions = [
            RegionMeta(name=r.name, rid=r.rid, key=0, nbytes=r.nbytes, access=r.access, addr=0)
            for r in meta.regions
        ]
        return encode_meta(msgspec.structs.replace(meta, regions=regions))

    def _meta_changed(self) -> None:
        if self._session is not None and not self._closed:
            self._session.publish(self._published_meta())

    async def _start_discovery(self) -> None:
        assert self._discovery is not None
        session = EtcdSession(self._discovery, self.name, self.incarnation, self._membership)
        try:
            members = await session.open(self._published_meta())
            self._check_open()
        except BaseException as exc:
            await session.aclose()
            if isinstance(exc, Exception) and not isinstance(exc, XferError):
                error = TransportError(
                    f"agent {self.name!r} cannot join through etcd at "
                    f"{', '.join(self._discovery.endpoints)}: {exc}"
                )
                _log.warning("discovery.join_failed", agent=self.name, reason=str(error))
                raise error from exc
            raise
        self._session = session
        await self._membership.reset(members)
        session.start()
        self._meta_changed()  # regions registered while we were joining

    def _fence(self, name: str, incarnation: int, address: str | None) -> None:
        """Peers of ``name`` made for another incarnation become stale (Members.fence)."""
        self._membership.fence(name, incarnation, address)

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
            return await self._connect_name(address)
        loop = self._start()
        peer = self._peers.by_addr.get(address)
        if peer is not None and not peer._lost:
            return peer
        task = self._connecting.get(address)
        if task is None:
            task = loop.create_task(self._connect(address), name=f"aioxfer-connect-{address}")
            self._connecting[address] = task
            task.add_done_callback(lambda t: self._connect_done(address, t))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._closed and task.cancelled():
                raise ClosedResourceError(
                    f"agent {self.name!r} was closed while connecting to {address}"
                ) from None
            raise

    async def _connect_name(self, name: str) -> Peer:
        if self._discovery is None:
            raise ValueError(
                f'{name!r} is not a "host:port" address, and agent {self.name!r} has no '
                f"discovery to resolve names with (Agent(..., discovery=Etcd(...)))"
            )
        await self.start()
        session = self._session
        assert session is not None
        try:
            meta = await session.resolve(name)
        except (Exception, TimeoutError) as exc:
            if isinstance(exc, XferError):
                raise
            raise TransportError(
                f"cannot look up agent {name!r} in etcd at {session._endpoint}: "
                f"{str(exc) or type(exc).__name__}"
            ) from exc
        if meta is None:
            raise PeerLost(
                f"no agent named {name!r} in etcd (key {self._discovery.key(name)!r}): "
                f"not started yet, left, or its lease expired",
                peer=name,
            )
        known = self._peers.by_inc.get((name, meta.incarnation))
        if known is not None and not known._lost:
            return known
        self._fence(name, meta.incarnation, None)
        peer = await self.connect(meta.address)
        if peer.name != name:
            raise TransportError(
                f"etcd says agent {name!r} is at {meta.address}, but the agent there is "
                f"{peer.name!r}"
            )
        return peer

    def _connect_done(self, address: str, task: asyncio.Task[Peer]) -> None:
        if self._connecting.get(address) is task:
            del self._connecting[address]
        if not task.cancelled():
            task.exception()  # retrieved: every awaiter may have been cancelled

    async def _connect(self, address: str) -> Peer:
        host, port = parse_address(address)
        # One data connection first, so that the peer's engine holds it before
        # the peer takes the metadata snapshot: a region deregistered after the
        # snapshot is then revoked on this connection, and since its regions are
        # imported before the engine reads from it, no stale handle slips by.
        sock0, accept0 = await self._dialer.open(address)
        local: _LocalLink | None = None
        try:
            if (
                self._local_sock is not None
                and accept0.local
                and accept0.host_id == self._host_id
                and _cma_allowed()
            ):
                # Same host, says the peer: the kernel confirms it on the peer's
                # unix socket, whose metadata then replaces a tcp fetch.
                local = await self._open_local(address, accept0)
            if local is not None:
                assert local.meta is not None
                meta = local.meta
            else:
                meta = await self._dialer.fetch_meta(host, port, address)
            self._check_open()
            if accept0.incarnation != meta.incarnation:
                raise TransportError(
                    f"peer at {address} restarted while we connected (incarnation "
                    f"{accept0.incarnation:#x}, then {meta.incarnation:#x}): connect again"
                )
            return await self._connect_meta(address, meta, sock0, local)
        finally:
            if sock0.fileno() >= 0:
                sock0.close()
            if local is not None:
                local.close()

    async def _connect_meta(
        self, address: str, meta: AgentMeta, sock0: socket.socket, local: _LocalLink | None
    ) -> Peer:
        if self._discovery is None:
            # Embedded, names need not be unique: only the same name at the same
            # address with another incarnation is a restart of a peer we had.
            self._fence(meta.name, meta.incarnation, address)
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
                f"(ours: {self.transports}, theirs: {tuple(meta.transports)}, "
                f"same host: {meta.host_id == self._host_id})"
            )
        return await self._connect_path(
            address, meta, sock0, path, local if path in ("shm", "cuda") else None
        )

    async def _connect_path(
        self,
        address: str,
        meta: AgentMeta,
        sock0: socket.socket,
        path: str,
        local: _LocalLink | None,
    ) -> Peer:
        shm = local is not None  # same host: one connection, copies by this engine
        verbs = path == "verbs"
        # tcp: every advertised listen address is a rail; the one we came by
        # may be a name or another spelling of one of them. shm and verbs:
        # one control connection (verbs: its rails are queue pairs).
        # At most max_rails of what the peer advertises are dialled: its
        # metadata must not make us open connections to anyone else en masse.
        rails = (
            [address] if shm or verbs or len(meta.rails) < 2
            else list(meta.rails)[: self._max_rails]
        )
        first = rails.index(address) if address in rails else 0
        per = 1 if shm or verbs else max(1, min(self._tcp_connections, MAX_CONNS // len(rails)))
        tag = self._tag_for(meta.name, meta.incarnation)
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
            self._tag_unref(tag)
            raise
        self._connecting_eps[ep] = 0
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
            if self._limits != (None, None):
                peer._sched = PeerScheduler(max_bytes=self._limits[0],
                                            max_requests=self._limits[1])
            # Regions first: before the engine reads revocations on the connection.
            self._apply_regions(peer, meta.regions, local.fds if local is not None else None)
            if local is not None:
                self._engine.endpoint_add_conn(ep, local.take_data(), first)
            else:
                self._engine.endpoint_add_conn(ep, sock0.detach(), first)
            # The rest of the connections, every rail at once: (rail, how many).
            dial = [(i, n) for i in range(len(rails)) if (n := per - (i == first))]
            added = await asyncio.gather(
                *(self._dial_rail(ep, i, rails[i], n, meta.incarnation) for i, n in dial)
            )
            reached = {first} | {i for (i, _), k in zip(dial, added, strict=True) if k}
            if verbs:
                await self._connect_verbs(ep, address, meta)
            self._check_open()
            lost = self._connecting_eps.pop(ep)
            if lost:
                raise PeerLost(
                    f"peer {meta.name!r} at {address} was lost while connecting: "
                    f"{_cyx.strerror(lost)}",
                    status=lost,
                    peer=meta.name,
                )
        except BaseException as exc:
            self._connecting_eps.pop(ep, None)
            self._tag_unref(tag)
            if not self._closed:
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
        for i in range(len(rails)):
            if i not in reached:  # unreachable now: probed until it answers
                peer._rails_down.add(i)
                _log.warning("rail.down", agent=self.name, peer=peer.name, address=rails[i],
                             reason="unreachable at connect", moved=0)
                self._start_probe(peer, i)
        if self._discovery is None:
            self._emit(PeerJoined(peer.name, peer.incarnation, address,
                                  tuple(sorted(peer._regions))))
        _log.info(
            "peer.connected",
            agent=self.name,
            peer=peer.name,
            address=address,
            path=path,
            conns=1 + sum(added),
            rails=len(rails),
            regions=len(peer._regions),
        )
        return peer

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
        )

    def _rail_live(self, peer: Peer) -> dict[int, int]:
        return self._rails.live(peer)

    def _on_rail_down(self, peer: Peer, rail: int, moved: int, status: int) -> None:
        self._rails.on_down(peer, rail, moved, status)

    def _start_probe(self, peer: Peer, rail: int) -> None:
        if self._loop is not None:
            self._rails.start_probe(peer, rail)

    async def _dial_rail(
        self, ep: int, rail: int, address: str, n: int, incarnation: int
    ) -> int:
        return await self._rails.dial(ep, rail, address, n, incarnation)

    def _choose_path(self, meta: AgentMeta, *, same_host: bool) -> str | None:
        """same_host: the kernel vouched for the peer (_open_local)."""
        if same_host and "cuda" in self.transports and "cuda" in meta.transports:
            return "cuda"  # GPU memory by CUDA IPC, host memory as shm
        if same_host and "shm" in self.transports and "shm" in meta.transports:
            return "shm"
        if "verbs" in self.transports and "verbs" in meta.transports and meta.verbs_devices:
            return "verbs"
        if "tcp" in self.transports and "tcp" in meta.transports:
            return "tcp"
        return None

    async def _open_local(self, address: str, meta: Accept) -> _LocalLink | None:
        """The same-host link to the peer that answered meta (its Accept), over
        its unix socket: a handshaken data connection, the peer's
        kernel-reported credentials and pidfd, and its metadata with its memfds
        (passed by the kernel). None, logged, when the kernel does not vouch
        for it (another user, another agent behind that name): the caller
        falls back to tcp."""
        assert self._loop is not None
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
                accept = await client_handshake(
                    self._loop, link.data, name=self.name, incarnation=self.incarnation,
                    purpose="data", token=self._token,
                )
                if (accept.name, accept.incarnation) != (meta.name, meta.incarnation):
                    why = f"its unix socket is served by another agent ({accept.name!r})"
                    return None
                link.pidfd = peer_pidfd(link.data, link.cred)
                link.meta, link.fds = await self._dialer.fetch_local_meta(meta.local, link.cred.pid)
            if (link.meta.name, link.meta.incarnation) != (meta.name, meta.incarnation):
                why = "it restarted while we connected"
                return None
            result = link
            return result
        finally:
            if result is None:
                link.close()
                if why:
                    _log.warning("local.refused", agent=self.name, peer=meta.name,
                                 address=address, reason=why, fallback="tcp")

    async def _connect_verbs(self, ep: int, address: str, meta: AgentMeta) -> None:
        """A queue pair per device pair (rail i: our device i, the peer's i),
        exchanged on a "verbs" control connection that then joins endpoint
        ep; ready to post once this returns."""
        assert self._loop is not None
        # Rails pair devices of one link layer (an InfiniBand port never
        # reaches a RoCE one), not index i with index i.
        pairs = _verbs.pair_rails(self._verbs_devices, list(meta.verbs_devices))
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
                    self._loop,
                    sock,
                    VerbsConnect(
                        qps=[VerbsQP(*q) for q in ours], devices=[theirs for _, theirs in pairs]
                    ),
                )
                reply = await recv_frame(self._loop, sock)
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
        self, peer: Peer, regions: list[RegionMeta], fds: list[int] | None = None
    ) -> None:
        """Imports regions new to us and forgets the ones the peer dropped.
        fds: a same-host peer's memfds as the kernel passed them (the caller
        closes them; the engine keeps its own mapping)."""
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
            if m.kind != "host":
                self._import_device_region(peer, m)
                continue
            memfd = -1
            if fds is not None and 0 <= m.memfd < len(fds):
                why = check_sealed(fds[m.memfd], m.nbytes)
                if why is None:
                    memfd = fds[m.memfd]
                else:  # never mapped: cross-memory attach reaches it without SIGBUS
                    _log.warning("region.memfd_refused", agent=self.name, peer=peer.name,
                                 region=m.name, reason=why)
            try:
                eng.endpoint_import(ep, m.rid, m.key, m.nbytes, m.access, m.addr, memfd)
            except _cyx.NativeError:
                if memfd < 0:
                    raise
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
                _log.warning("region.cuda_import_failed", agent=self.name, peer=peer.name,
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
                _log.warning("region.verbs_import_failed", agent=self.name, peer=peer.name,
                             region=m.name, error=str(exc))
        stale = peer._regions.get(m.name)
        if stale is not None:
            stale._gone = True
        peer._by_rid[m.rid] = rr
        peer._regions[m.name] = rr

    async def _refresh_peer(self, peer: Peer) -> None:
        self._check_open()
        if peer._lost:
            raise peer._lost_error()
        fds: list[int] | None = None
        if peer._local:
            try:
                async with self._dialer.control_errors(peer.address, "fetching metadata from",
                                                "fetch metadata from"):
                    meta, fds = await self._dialer.fetch_local_meta(peer._local, peer.pid)
            except (OSError, ProtocolError, TransportError) as exc:
                if not peer._lost:
                    raise
                raise peer._lost_error() from exc
        else:
            host, port = parse_address(peer.address)
            meta = await self._dialer.fetch_meta(host, port, peer.address)
        try:
            await self._refresh_with(peer, meta, fds)
        finally:
            for fd in fds or ():
                os.close(fd)

    async def _refresh_with(self, peer: Peer, meta: AgentMeta, fds: list[int] | None) -> None:
        if peer._lost:
            raise peer._lost_error()
        if meta.name != peer.name or meta.incarnation != peer.incarnation:
            peer._stale = True
            self._peers.drop(peer, "it restarted")
            raise StalePeer(
                f"peer {peer.name!r} at {peer.address} restarted (now {meta.name!r}, incarnation "
                f"{meta.incarnation:#x}, was {peer.incarnation:#x}): its old regions are fenced; "
                f"connect again"
            )
        before = {(rr.name, rid) for rid, rr in peer._by_rid.items()}
        try:
            self._apply_regions(peer, meta.regions, fds)
        except _cyx.NativeError as exc:
            raise error_class(exc.status)(
                f"cannot refresh peer {peer.name!r}: {exc}", status=exc.status, peer=peer.name
            ) from None
        if self._discovery is None:
            after = {(rr.name, rid) for rid, rr in peer._by_rid.items()}
            if before != after:
                self._emit(PeerUpdated(
                    peer.name, peer.incarnation, peer.address,
                    tuple(sorted(n for n, _ in after - before)),
                    tuple(sorted(n for n, _ in before - after)),
                ))

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
            ):
                self._check_open()
                self._check_pair(src, dst, 0)
            t = self._submit(
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
                return backend.post(self, "write", src, dst, notify, priority)
            peer, descs, nbytes = self._descs(src, dst, "write")
            descs, starts = _coalesce(descs)
        payload = None if notify is None else notify_payload(notify)
        if payload is not None and peer is self._file_peer:
            raise ValueError("a write into a file region takes no notify (nobody to tell)")
        t = self._submit(peer, _OP_WRITE, descs, payload, nbytes, "write", priority)
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
            ):
                self._check_open()
                self._check_pair(dst, src, 0)
            t = self._submit(
                peer, _OP_READ, (lr.rid, dst.offset, rr.rid, rr.key, src.offset, n), None, n,
                "read", priority,
            )
            if peer.path == "cuda":
                t._path = _cuda_path(dst, src)
            return t
        else:
            backend = _backends.local_target(src)  # a local backend's region (object storage)
            if backend is not None:
                return backend.post(self, "read", dst, src, None, priority)
            peer, descs, nbytes = self._descs(dst, src, "read")
            descs, starts = _coalesce(descs)
        t = self._submit(peer, _OP_READ, descs, None, nbytes, "read", priority)
        if starts is not None:
            t._starts = starts
        if peer.path == "cuda":
            t._path = _cuda_path(dst, src)
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
            return self._descs_vector(local, remote)
        if (
            isinstance(local, Sequence)
            and isinstance(remote, Sequence)
            and not isinstance(local, str | bytes | bytearray)
            and not isinstance(remote, str | bytes | bytearray)
        ):
            return self._descs_lists(local, remote)
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
        ):
            self._check_pair(local, remote, 0)
        return rr.peer, (lr.rid, local.offset, rr.rid, rr.key, remote.offset, n), n

    def _check_pair(self, local: Any, remote: Any, i: int) -> None:
        if not isinstance(local, Segment):
            raise TypeError(f"local segment {i} is a {type(local).__name__}, not a Segment")
        if not isinstance(remote, RemoteSegment):
            raise TypeError(f"remote segment {i} is a {type(remote).__name__}, not a RemoteSegment")
        lr = local.region
        if lr._agent is not self:
            raise ValueError(f"local segment {i} is in a region of agent {lr._agent.name!r}")
        lr._check()
        rr = remote.region
        if rr._gone:
            raise AccessDenied(
                f"remote region {rr.name!r} of peer {rr.peer.name!r} was deregistered by its owner",
                peer=rr.peer.name,
            )
        if rr.peer._host is not self._peers:
            raise ValueError(f"remote segment {i} belongs to a peer of another agent")
        # GPU memory travels its own path (cuda) or RDMA (GPUDirect: the
        # engine says so, per region, if the NIC cannot reach it).
        if lr.kind != "host" and rr.peer.path not in (lr.kind, "verbs"):
            raise TransportError(
                f"local region {lr.name!r} is {lr.kind} memory, which path "
                f"{rr.peer.path!r} to peer {rr.peer.name!r} cannot reach",
                peer=rr.peer.name,
            )
        if rr.kind != "host" and rr.peer.path not in (rr.kind, "verbs"):
            raise TransportError(
                f"remote region {rr.name!r} of peer {rr.peer.name!r} is {rr.kind} memory, "
                f"which path {rr.peer.path!r} cannot reach",
                peer=rr.peer.name,
            )
        if local.length != remote.length:
            raise ValueError(
                f"segment {i}: local length {local.length} != remote length {remote.length}"
            )
        if not local.length:
            raise ValueError(f"segment {i} is empty")

    def _descs_lists(
        self, local: Sequence[Any], remote: Sequence[Any]
    ) -> tuple[Peer, npt.NDArray[np.uint64], int]:
        n = len(local)
        if n != len(remote):
            raise ValueError(f"{n} local segments but {len(remote)} remote segments")
        if not n:
            raise ValueError("no segments to transfer")
        rows: list[tuple[int, int, int, int, int, int]] = []
        append = rows.append
        last_l: Any = None
        last_r: Any = None
        peer: Peer | None = None
        total = 0
        for i in range(n):
            ls = local[i]
            rs = remote[i]
            try:
                lr = ls.region
                rr = rs.region
                length = ls.length
                ok = (
                    type(ls) is Segment
                    and type(rs) is RemoteSegment
                    and length == rs.length
                    and length > 0
                )
            except AttributeError:
                ok = False
            if not ok or lr is not last_l or rr is not last_r:
                self._check_pair(ls, rs, i)
                if peer is None:
                    peer = rr.peer
                elif rr.peer is not peer:
                    raise ValueError(
                        f"remote segment {i} is on peer {rr.peer.name!r}, not {peer.name!r}: "
                        f"one transfer goes to one peer"
                    )
                last_l, last_r = lr, rr
            append((lr.rid, ls.offset, rr.rid, rr.key, rs.offset, length))
            total += length
        assert peer is not None
        return peer, np.array(rows, dtype=np.uint64), total

    def _descs_vector(
        self, local: SegmentList, remote: SegmentList
    ) -> tuple[Peer, npt.NDArray[np.uint64], int]:
        lr = local.region
        rr = remote.region
        if not isinstance(lr, Region) or not isinstance(rr, RemoteRegion):
            raise TypeError("the first SegmentList must be of a local Region, the second remote")
        if lr._agent is not self:
            raise ValueError(f"local segments are in a region of agent {lr._agent.name!r}")
        lr._check()
        for region, where in ((lr, "local"), (rr, "remote")):
            if region.kind != "host" and rr.peer.path != region.kind:
                raise TransportError(
                    f"{where} region {region.name!r} is {region.kind} memory, which path "
                    f"{rr.peer.path!r} to peer {rr.peer.name!r} cannot reach",
                    peer=rr.peer.name,
                )
        if rr._gone:
            raise AccessDenied(
                f"remote region {rr.name!r} of peer {rr.peer.name!r} was deregistered by its owner",
                peer=rr.peer.name,
            )
        descs = pair_descs(local, lr.rid, remote, rr.rid, rr.key, "remote")
        return rr.peer, descs, local.nbytes

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

    def _on_event(
        self,
        kind: int,
        status: int,
        id_: int,
        tag: int,
        nbytes: int,
        fail_index: int,
        payload: bytes | None,
    ) -> None:
        """A completion record that is not a transfer's (Submission hands the
        agent these): a notification, or an engine event."""
        if kind == _CQ_NOTIFY:
            name = self._tag_names.get(tag)
            if name is None:
                name = f"tag-{tag}"  # a tag we never saw: should not happen
            self.notifications._put(Notification(name, payload or b""), tag)
            return
        if kind == _cyx.CQ_RAIL_DOWN:
            rpeer = self._peers.by_ep.get(id_)
            if rpeer is not None:
                self._on_rail_down(rpeer, fail_index, nbytes, status)
            return
        if kind == _cyx.CQ_PEER_LOST:
            peer = self._peers.by_ep.get(id_)
            if peer is not None:
                self._peers.mark_lost(peer, status, log=status != _E_CLOSED)
            elif id_ in self._connecting_eps:
                self._connecting_eps[id_] = status
        elif kind == _cyx.CQ_REGION_FREED:
            region = self._freeing.pop(id_, None)
            if region is not None:
                self._release_memory(region)
                if region._released is not None:
                    _resolve(region._released)
            if self._settled is not None:
                self._settled.set()
        elif kind == _cyx.CQ_LOG:
            if payload is not None and payload.startswith(b"verbs: GPU region"):
                # GPUDirect registration failed: said loudly, it is a slow path.
                warnings.warn(payload.decode("utf-8", "replace"), RuntimeWarning, stacklevel=1)
            _log.warning(
                "engine.log",
                agent=self.name,
                peer=self._tag_names.get(tag),
                tag=tag,
                reason=(payload or b"").decode("utf-8", "replace"),
            )
        elif kind == _cyx.CQ_CONN_CLOSED:
            _log.debug("conn.closed", agent=self.name, peer=self._tag_names.get(tag), tag=tag)
            self._tag_unref(tag)

    # ------------------------------------------------------------ statistics

    def statistics(self) -> AgentStatistics:
        native = (self._final_native or {}) if self._closed else self._engine.stats()
        return agent_statistics(
            self.name,
            self.address,
            regions=len(self._regions),
            peers=len(self._peers.by_ep),
            counters=self._sub.counters(),
            native=native,
            pinned_regions=self._engine.pinned_regions(),
        )


# ---------------------------------------------------------------- helpers


def _coalesce(descs: _Descs) -> tuple[_Descs, npt.NDArray[np.intp] | None]:
    """Merges runs of descriptors contiguous on both sides (same regions) into
    one each: fewer copies, frames and syscalls for a KV block split in pages.
    Returns the merged array and, when anything merged, each merged
    descriptor's first original index (to report failures by the caller's
    index)."""
    if isinstance(descs, tuple) or len(descs) < 2:
        return descs, None
    a, b = descs[:-1], descs[1:]
    joins = (
        (b[:, 0] == a[:, 0])
        & (b[:, 2] == a[:, 2])
        & (b[:, 3] == a[:, 3])
        & (b[:, 1] == a[:, 1] + a[:, 5])
        & (b[:, 4] == a[:, 4] + a[:, 5])
    )
    if not joins.any():
        return descs, None
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = descs[starts]
    merged[:, 5] = np.add.reduceat(descs[:, 5], starts)
    return merged, starts


def _verbs_keys(peer: Peer, m: RegionMeta) -> list[tuple[int, int]]:
    """A peer region's (addr, rkey) per device, range-checked."""
    if not 0 < len(m.verbs) <= _cyx.VERBS_MAX_DEVICES or not all(
        0 <= addr < 1 << 64 and 0 <= rkey < 1 << 32 for addr, rkey in m.verbs
    ):
        raise ProtocolError(f"peer {peer.name!r} sent region {m.name!r} without valid rkeys")
    return m.verbs


def _cuda_path(local: Any, remote: Any) -> str:
    """What a transfer to a "cuda" peer is: "cuda" when it touches GPU memory
    (CUDA copies), else "shm" (host memory moves as shm copies)."""
    for side in (local, remote):
        segs = side if isinstance(side, Sequence) else (side,)
        if any(s.region.kind != "host" for s in segs):
            return "cuda"
    return "shm"


def _describe(t: Transfer) -> str:
    if t.op == "notify":
        return f"notification to peer {t.peer.name!r}"
    prep = "from" if t.op == "read" else "to"
    if t.peer.path == file_transport.PATH:
        return f"{t.op} of {t.nbytes} bytes {prep} a file region"
    return f"{t.op} of {t.nbytes} bytes {prep} peer {t.peer.name!r}"


def _keyed(peer: Peer) -> list[tuple[tuple[int, int], RemoteRegion]]:
    return [((rr.rid, rr.key), rr) for rr in peer._by_rid.values()]


def _is_address(target: str) -> bool:
    """"host:port" (or "[v6]:port"), as opposed to an agent's name."""
    if not isinstance(target, str):
        return True  # let _parse_address say what is wrong with it
    host, sep, port = target.rpartition(":")
    return bool(sep and host and port.isdigit())


# Regions a peer could still touch when their agent closed: kept referenced (so
# their buffers are never freed and reused under a stopped peer's copies).
_QUARANTINE: list[Region] = []


class _Released:
    """deregister()'s answer where no event loop runs: already complete."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield

    def done(self) -> bool:
        return True


def _resolve(released: Awaitable[None]) -> None:
    if isinstance(released, asyncio.Future) and not released.done():
        released.set_result(None)


def _retrieve(task: asyncio.Task[Any]) -> None:
    # The exception is re-raised to whoever awaits start(); retrieving it here
    # keeps asyncio from logging it when nobody did.
    if not task.cancelled():
        task.exception()


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
        sock.listen(512)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()
    h = bound[0]
    address = f"[{h}]:{bound[1]}" if ":" in h else f"{h}:{bound[1]}"
    return sock, address


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


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def _cma_allowed() -> bool:
    """Whether we may reach a same-host peer's memory (of our own uid: the
    kernel checks that per connection): Yama (if present) must not restrict
    ptrace-style access to descendants, and process_vm_readv must work."""
    scope = _ptrace_scope()
    if scope >= 2 or (scope == 1 and os.geteuid() != 0):
        return False
    return _cma_works()


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

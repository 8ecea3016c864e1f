"""Discovery and membership: find agents by name, follow who joins, changes, leaves.

Embedded default (no discovery): agents connect by "host:port" and each serves
its own metadata on its port; ``agent.membership()`` reports the agent's own
connections (connect -> PeerJoined, peer lost or closed -> PeerLeft).

With ``Agent(..., discovery=Etcd([...]))`` the agent also publishes its
metadata (an :class:`~aioxfer.metadata.AgentMeta`, msgspec JSON) in etcd under
``{prefix}/agents/{name}``, bound to a lease it keeps alive, watches
``{prefix}/agents/`` for everyone else, and resolves ``connect("decode-3")``
through it.

Trust: what etcd holds decides whom we connect to and whom we fence, nothing
more. The published copy carries no access keys and no addresses of memory
(those travel only over the agent's own, possibly authenticated, control
connection), so whoever can write etcd can make us drop a peer, never aim our
writes at memory a peer did not advertise to us itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from aioxfer.errors import XferError
from aioxfer.log import get_logger
from aioxfer.metadata import AgentMeta

__all__ = [
    "Etcd",
    "Membership",
    "MembershipEvent",
    "PeerJoined",
    "PeerLeft",
    "PeerUpdated",
]

_log = get_logger("aioxfer.discovery")

# Events a consumer may fall behind by before its iterator fails (and a new
# iterator, which starts from a fresh snapshot, must be taken).
MAX_BACKLOG = 10_000


def retrieve_exception(fut: asyncio.Future[Any]) -> None:
    """A done callback for a future or task whose waiter may be gone (left
    behind by a close, a cancel or a bounded wait): fetches its exception so
    that asyncio does not log it as never retrieved. Whoever still awaits it
    gets the exception all the same. (Shared by members, cluster and
    kv.store.)"""
    if not fut.cancelled():
        fut.exception()


# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class PeerJoined:
    """An agent joined (etcd: its key appeared; embedded: we connected to it).
    Also reported, once per member, at the start of every ``membership()``."""

    name: str
    incarnation: int
    address: str
    regions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerUpdated:
    """A member's metadata changed: regions registered (``added``) or
    deregistered (``removed``), or a new ``address`` (``old_address`` is then the
    previous one). A connected peer is refreshed before this is reported, so
    ``peer.region(name)`` already knows the added regions."""

    name: str
    incarnation: int
    address: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    old_address: str | None = None


@dataclass(frozen=True, slots=True)
class PeerLeft:
    """A member left. ``reason``: "left" (etcd: its key was deleted, by its
    ``aclose()`` or by its lease expiring), "restarted" (a new incarnation took
    its name), "lost" (embedded: its connection died or went silent), "closed"
    (embedded: we closed the peer, or its agent closed and said goodbye)."""

    name: str
    incarnation: int
    address: str
    reason: str


MembershipEvent = PeerJoined | PeerUpdated | PeerLeft


class Membership:
    """The async iterator ``agent.membership()`` returns: a PeerJoined for every
    current member first, then each change as it happens. Any number may be
    iterated at once; each gets every event, and is iterated by one task at a
    time (a second task waiting on the same one gets RuntimeError). Ends when the agent closes or on
    ``aclose()`` (also ``async with``). A consumer that falls more than
    ``MAX_BACKLOG`` events behind gets an XferError and should iterate a new
    ``agent.membership()``."""

    __slots__ = ("_events", "_waiter", "_ended", "_overflow", "_unsubscribe", "__weakref__")

    def __init__(
        self, initial: Sequence[MembershipEvent], unsubscribe: Callable[[Membership], None]
    ) -> None:
        self._events: collections.deque[MembershipEvent] = collections.deque(initial)
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._overflow = False
        self._unsubscribe = unsubscribe

    def __aiter__(self) -> Membership:
        return self

    async def __anext__(self) -> MembershipEvent:
        while not self._events:
            if self._overflow:
                raise XferError(
                    f"membership consumer fell more than {MAX_BACKLOG} events behind; "
                    f"iterate agent.membership() again for a fresh snapshot"
                )
            if self._ended:
                raise StopAsyncIteration
            if self._waiter is not None:
                # One waiter only: a second task's waiter replaced the first
                # one's, which then never woke (not even at aclose or the
                # agent's close). Said, as asyncio's StreamReader says it.
                raise RuntimeError(
                    "this membership() iterator is already being iterated by another "
                    "task; call agent.membership() once per consumer"
                )
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._events.popleft()

    def _put(self, event: MembershipEvent) -> None:
        if self._ended:
            return
        if len(self._events) >= MAX_BACKLOG:
            # Dropping events silently would leave the consumer with a wrong
            # view; failing it makes it resynchronise from a snapshot.
            self._events.clear()
            self._overflow = True
            self._end()
            return
        self._events.append(event)
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def aclose(self) -> None:
        """Stops this iterator (others go on). Idempotent."""
        self._events.clear()
        self._end()
        self._unsubscribe(self)

    async def __aenter__(self) -> Membership:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def region_names(meta: AgentMeta) -> tuple[str, ...]:
    return tuple(sorted(r.name for r in meta.regions))


def diff_regions(old: AgentMeta, new: AgentMeta) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(added, removed) region names; a name re-registered as a new region is in both."""
    before = {(r.name, r.rid) for r in old.regions}
    after = {(r.name, r.rid) for r in new.regions}
    added = tuple(sorted(n for n, _ in after - before))
    removed = tuple(sorted(n for n, _ in before - after))
    return added, removed


# ---------------------------------------------------------------- etcd


def port_number(port: str, *, zero: bool = True) -> int | None:
    """A "host:port"'s port: ASCII digits only, at most 65535 (and not 0
    unless ``zero``: a listen address's "any free port"); None otherwise.
    int() alone took "+80", " 80", "8_0" and non-ASCII digits ("٨٠"), which
    etcd's endpoints (_parse_endpoint: here, since dialing.parse_address
    shares it) and metadata.check_address refused: one rule for every
    address."""
    if not (port.isascii() and port.isdigit()):
        return None
    digits = port.lstrip("0") or "0"  # zeros in front as metadata.check_address takes them
    if len(digits) > 5:  # (and never int() of a thousand digits)
        return None
    n = int(digits)
    return n if (zero or n > 0) and n <= 65535 else None


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    if not isinstance(endpoint, str):
        raise TypeError(f'an etcd endpoint is a "host:port" string, not {type(endpoint).__name__}')
    ep = endpoint
    if ep.startswith("https://"):
        raise ValueError(f"etcd endpoint {endpoint!r}: TLS is not supported yet; use http://")
    ep = ep.removeprefix("http://").rstrip("/")
    host, sep, port = ep.rpartition(":")
    # The port as dialing.parse_address takes it (port_number), but never 0:
    # an endpoint is dialled. (str.isdigit alone took "²", which int() refuses.)
    portnum = port_number(port, zero=False)
    if not sep or not host or portnum is None:
        raise ValueError(f'etcd endpoint {endpoint!r} is not "host:port" or "http://host:port"')
    return host.strip("[]"), portnum


class Etcd:
    """Discovery through a real etcd (v3 API; e.g. Debian's ``etcd-server``).

    ``endpoints``: "host:port" or "http://host:port" of the cluster's members,
    tried in order when joining (the agent then stays with the first that
    answered while it serves, and moves to another that answers when a lease
    refresh through it fails). ``prefix``: where agents live
    (``{prefix}/agents/{name}``). ``ttl``: lease seconds (whole, at least 1):
    an agent that stops refreshing its lease (killed, frozen, cut off) is
    removed that long after its last refresh, and its peers fail their
    transfers to it with PeerLost. ``timeout``: bound on each etcd request.
    ``keepalive``: seconds between gRPC pings on the connection to etcd while
    a watch is open; a connection whose ping goes unanswered for ``timeout``
    is dropped and dialled again (a partition that drops packets silently,
    without a reset, otherwise left the watch waiting on a dead connection
    for ever). etcd answers pings more often than its
    ``--grpc-keepalive-min-time`` (5 s by default) by closing the connection:
    keep it at or above that.

    Needs the ``aetcd`` package: ``pip install 'aioxfer[etcd]'``.
    """

    __slots__ = ("endpoints", "prefix", "ttl", "timeout", "keepalive")

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        prefix: str = "/aioxfer",
        ttl: int = 5,
        timeout: float = 5.0,
        keepalive: float = 10.0,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        eps = tuple(endpoints)
        if not eps:
            raise ValueError("Etcd needs at least one endpoint")
        for ep in eps:
            _parse_endpoint(ep)
        if not isinstance(prefix, str) or not prefix.startswith("/"):
            raise ValueError(f"etcd prefix {prefix!r} must be a string starting with '/'")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 1:
            raise ValueError(f"ttl must be at least 1 second (etcd leases are whole seconds), "
                             f"not {ttl!r}")
        if not timeout > 0:
            raise ValueError("timeout must be positive (seconds)")
        if not keepalive > 0:
            raise ValueError("keepalive must be positive (seconds)")
        if importlib.util.find_spec("aetcd") is None:
            raise ImportError(
                "aioxfer.discovery.Etcd needs the aetcd package: pip install 'aioxfer[etcd]'"
            )
        self.endpoints: tuple[str, ...] = eps
        self.prefix: str = prefix.rstrip("/")
        self.ttl: int = math.ceil(ttl)
        self.timeout: float = float(timeout)
        self.keepalive: float = float(keepalive)

    def key(self, name: str) -> str:
        """The etcd key an agent called ``name`` publishes under."""
        return f"{self.prefix}/agents/{name}"

    def __repr__(self) -> str:
        return f"Etcd({list(self.endpoints)!r}, prefix={self.prefix!r}, ttl={self.ttl})"


class MemberListener(Protocol):
    """What a session reports to (the agent's aioxfer.members.Members)."""

    async def reset(self, members: dict[str, AgentMeta], grace: float = 0.0) -> None:
        """etcd's full list of members (all but us); one it lacks is gone
        once ``grace`` seconds pass without its key coming back."""

    async def put(self, meta: AgentMeta) -> None:
        """A member joined, or its metadata changed."""

    async def deleted(self, name: str) -> None:
        """A member's key was deleted (it left, or its lease expired)."""


# etcd's values are at most 1.5 MiB (its --max-request-bytes default): pages of
# _LIST_PAGE keys fit in the receive bound, which a watch reply (events of many
# revisions) may still exceed: the watch then restarts from a paged list.
_LIST_PAGE = 32


def _grpc_options(config: Etcd) -> dict[str, int]:
    """gRPC channel arguments for one session's client.

    Its own subchannel pool: gRPC shares a connection among every channel of
    the process to the same target, so a client made right after etcd came
    back (a newcomer joining) inherited the others' connection still waiting
    out its reconnect backoff, and failed at once with "connection refused".
    A reconnect backoff well under the lease ttl: gRPC's default grows to 120 s,
    so after an outage of some seconds our leases, which etcd renews for one
    ttl when it comes back, expired before we even tried to reach it again.

    Keepalive pings while a call (the watch) is open, answered within the
    request timeout or the connection is dropped: a partition that drops
    packets without a reset left the watch reading a dead connection for
    ever (no timeout applies to a stream), and the unary calls on it timing
    out one by one without ever redialling. No limit on pings without data:
    gRPC's default (2) stopped pinging a quiet watch after the second ping.
    A connection attempt is bounded by the request timeout too (gRPC's
    default 20 s outlasted a short partition by its whole SYN backoff)."""
    ttl, timeout_ms = config.ttl, int(config.timeout * 1000)
    return {
        "grpc.max_receive_message_length": 64 << 20,
        "grpc.use_local_subchannel_pool": 1,
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": min(500, ttl * 250),
        "grpc.min_reconnect_backoff_ms": timeout_ms,
        "grpc.keepalive_time_ms": int(config.keepalive * 1000),
        "grpc.keepalive_timeout_ms": timeout_ms,
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.max_pings_without_data": 0,
    }


_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder(AgentMeta).decode


def _decode(value: bytes) -> AgentMeta:
    """An etcd value as AgentMeta. Anyone who can write the prefix writes
    these: JSON nested deeply enough to exhaust msgspec's recursion is
    malformed input like any other (DecodeError), never an exception that
    ends the watch."""
    try:
        return _json_decode(value)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested too deeply") from None


def encode_meta(meta: AgentMeta) -> bytes:
    return _encode(meta)


class EtcdSession:
    """One agent's connection to etcd: its lease, its key, the watch.

    Ownership of the key: the first put is unconditional (a restart under the
    same name takes the name over); every later put only succeeds while the key
    is still the one we wrote (its mod revision), so an old incarnation that
    wakes up never overwrites its successor. Our key deleted while our lease
    lives means an operator evicted us: we stay out. Our lease expired (we were
    frozen or cut off): we rejoin with a new lease if the name is still free.
    """

    def __init__(
        self, config: Etcd, name: str, incarnation: int, listener: MemberListener
    ) -> None:
        self.config = config
        self.name = name
        self.incarnation = incarnation
        self._listener = listener
        self._key = config.key(name).encode()
        self._agents = f"{config.prefix}/agents/".encode()
        self._client: Any = None
        self._endpoint = ""
        self._lease_id = 0
        self._mod_rev = 0
        self._value = b""
        self._published = b""
        self._state = "new"  # joined | evicted | superseded | closing
        self._revision = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._publisher: asyncio.Task[None] | None = None
        self._dirty = False
        self._warned: set[str] = set()
        # One key operation at a time: a rejoin racing a put would leave us
        # refreshing a lease our key is not on.
        self._lock = asyncio.Lock()
        # How long a lease refresh or a republication (which holds the lock
        # the keepalive needs) waits, with another endpoint to move to: a
        # third of the ttl, not the request timeout. An etcd node that hangs
        # (frozen, or cut off without a reset) held each for the whole
        # timeout, and our lease had expired when we moved on. The
        # failover's own refresh, through the next endpoint, waits the full
        # timeout.
        self._quick = (min(config.timeout, config.ttl / 3) if len(config.endpoints) > 1
                       else config.timeout)

    @property
    def grace(self) -> float:
        """How long a member a re-list lacks may take to put its key back
        (etcd restarted without its data: each member finds its lease gone at
        its next keepalive, within a third of its ttl, and puts its key
        again, each step bounded by the request timeout)."""
        return self.config.ttl + self.config.timeout

    # ------------------------------------------------------------ setup

    async def open(self, value: bytes) -> dict[str, AgentMeta]:
        """Connects, takes a lease, publishes ``value``, lists the members (all
        but us). Bounded by the config's timeout per endpoint tried."""
        import aetcd  # type: ignore[import-untyped]

        errors: list[str] = []
        for ep in self.config.endpoints:
            host, port = _parse_endpoint(ep)
            client = aetcd.Client(host=host, port=port, timeout=self.config.timeout,
                                  options=_grpc_options(self.config))
            lease = None
            try:
                async with asyncio.timeout(self.config.timeout):
                    await client.connect()
                    lease = await client.lease(self.config.ttl)
                    put = await client.put(self._key, value, lease=lease.id)
                    members, revision = await self._list(client)
            except BaseException as exc:
                with contextlib.suppress(Exception, TimeoutError):
                    async with asyncio.timeout(1.0):
                        if lease is not None:
                            # Our key may be in etcd already (cancelled or
                            # failed after the put): revoking deletes it, so
                            # the others never see a member that is not there.
                            await client.revoke_lease(lease.id)
                        await client.close()
                if not isinstance(exc, Exception):
                    raise  # cancelled: the agent closes
                errors.append(f"{ep}: {_why(exc)}")
                continue
            self._client = client
            self._endpoint = ep
            self._lease_id = int(lease.id)
            self._mod_rev = int(put.header.revision)
            self._value = self._published = value
            self._revision = revision
            self._state = "joined"
            _log.info("discovery.joined", agent=self.name, etcd=ep, key=self._key.decode(),
                      lease=f"{self._lease_id:#x}", ttl=self.config.ttl, members=len(members))
            return members
        raise ConnectionError("; ".join(errors))

    def start(self) -> None:
        """Starts the lease keepalive and the watch (after ``open``)."""
        loop = asyncio.get_running_loop()
        for coro, what in ((self._keepalive_loop(), "keepalive"), (self._watch_loop(), "watch")):
            task = loop.create_task(coro, name=f"aioxfer-etcd-{what}-{self.name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Revokes the lease (which deletes our key, if it is still ours) and
        disconnects; bounded, since etcd may be gone. Idempotent."""
        if self._state == "closing":
            return
        was_joined = self._state == "joined"
        self._state = "closing"
        tasks = list(self._tasks)
        if self._publisher is not None:
            tasks.append(self._publisher)
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a task stuck in the etcd client must not hang aclose().
            _, stuck = await asyncio.wait(tasks, timeout=min(self.config.timeout, 2.0))
            if stuck:
                _log.warning("discovery.close_slow", agent=self.name,
                             tasks=sorted(t.get_name() for t in stuck))
        client = self._client
        if client is None:
            return
        bound = min(self.config.timeout, 2.0)
        if was_joined and self._lease_id:
            try:
                async with asyncio.timeout(bound):
                    await client.revoke_lease(self._lease_id)
            except (Exception, TimeoutError) as exc:
                _log.warning("discovery.leave_failed", agent=self.name, etcd=self._endpoint,
                             reason=f"cannot revoke the lease: {_why(exc)}; "
                                    f"the key goes when it expires")
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(bound):
                await client.close()
        self._client = None
        _log.info("discovery.left", agent=self.name, key=self._key.decode())

    # ------------------------------------------------------------ queries

    async def resolve(self, name: str) -> AgentMeta | None:
        """The current metadata etcd holds for ``name`` (None: no such member)."""
        async with asyncio.timeout(self.config.timeout):
            kv = await self._client.get(self.config.key(name).encode())
        if kv is None:
            return None
        return self._decode(kv.key, kv.value)

    async def _list(self, client: Any) -> tuple[dict[str, AgentMeta], int]:
        """Every member at one revision, in pages: etcd takes values up to
        1.5 MiB, so one reply for the whole prefix could exceed any gRPC
        message bound (and then every join and every re-list failed)."""
        from aetcd import rpc, utils

        members: dict[str, AgentMeta] = {}
        start, end = self._agents, utils.prefix_range_end(self._agents)
        revision = 0
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=_LIST_PAGE,
                                       revision=revision)
            res = await client.kvstub.Range(request, timeout=self.config.timeout,
                                            metadata=client.metadata)
            revision = revision or int(res.header.revision)
            for kv in res.kvs:
                meta = self._decode(kv.key, kv.value)
                if meta is not None and meta.name != self.name:
                    members[meta.name] = meta
            if not res.more or not res.kvs:
                return members, revision
            start = res.kvs[-1].key + b"\0"

    def _name(self, key: bytes) -> str | None:
        """The agent name a key under the prefix is for; None when its bytes
        are not UTF-8: no agent's key (a name is a str of printable
        characters, so its key is its UTF-8). Decoded with "replace", b"a\xff"
        and b"a\xfe" were both "a\ufffd": a value naming that at either key
        was a member, and a DELETE of the other key removed it (fuzz31)."""
        try:
            return key[len(self._agents):].decode()
        except UnicodeDecodeError:
            return None

    def _decode(self, key: bytes, value: bytes) -> AgentMeta | None:
        name = self._name(key)
        if name is None:
            _log.warning("discovery.bad_value", key=key.decode("utf-8", "replace"),
                         reason="the key is not UTF-8: no agent's name")
            return None
        try:
            meta = _decode(value)
        except msgspec.ValidationError as exc:
            _log.warning("discovery.bad_value", key=key.decode("utf-8", "replace"),
                         reason=f"not an aioxfer AgentMeta: {exc}")
            return None
        except msgspec.DecodeError as exc:
            _log.warning("discovery.bad_value", key=key.decode("utf-8", "replace"),
                         reason=f"not msgspec JSON: {exc}")
            return None
        if meta.name != name:
            _log.warning("discovery.bad_value", key=key.decode("utf-8", "replace"),
                         reason=f"the value names agent {meta.name!r}, not {name!r}")
            return None
        return meta

    # ------------------------------------------------------------ publishing

    def publish(self, value: bytes) -> None:
        """Re-publishes our metadata (coalesced: one put in flight at a time,
        the latest value wins). Failures are retried by the keepalive loop."""
        self._value = value
        if self._state != "joined":
            return
        if self._publisher is not None and not self._publisher.done():
            self._dirty = True
            return
        self._publisher = asyncio.get_running_loop().create_task(
            self._publish_loop(), name=f"aioxfer-etcd-publish-{self.name}"
        )

    async def _publish_loop(self) -> None:
        while True:
            self._dirty = False
            try:
                async with self._lock:
                    await self._put_owned()
            except asyncio.CancelledError:
                raise
            except (Exception, TimeoutError) as exc:
                self._warn("discovery.publish_failed", f"{_why(exc)}; retrying")
                return
            if not self._dirty:
                return

    async def _put_owned(self) -> None:
        """Puts our value, only while the key is still the one we last wrote."""
        if self._state != "joined" or self._value == self._published:
            return
        c = self._client
        value = self._value
        async with asyncio.timeout(self._quick):
            ok, resp = await c.transaction(
                compare=[c.transactions.mod(self._key) == self._mod_rev],
                success=[c.transactions.put(self._key, value, lease=self._lease_id),
                         c.transactions.get(self._key)],
                failure=[c.transactions.get(self._key)],
            )
        current = _txn_kv(resp)
        if ok and current is not None:
            self._mod_rev = int(current.mod_revision)
            self._published = value
            return
        await self._key_taken(current)

    async def _key_taken(self, current: Any) -> None:
        """Our key is not the one we wrote: find out why and act."""
        if current is not None:
            meta = self._decode(current.key, current.value)
            if meta is not None and meta.incarnation == self.incarnation:
                await self._reclaim(current)
                return
            self._superseded(meta)
            return
        if await self._lease_alive():
            self._state = "evicted"
            _log.warning("discovery.evicted", agent=self.name, key=self._key.decode(),
                         reason="our key was deleted while our lease lives: staying out")
        else:
            await self._rejoin()

    async def _reclaim(self, current: Any) -> None:
        """Our key holds our incarnation, but not as we last wrote it: an
        earlier rejoin whose reply we lost (on a lease we granted and then
        lost track of), or someone else's put (anyone who can write etcd may
        put our incarnation, with another address, or with no lease: a key on
        no lease outlives us). Ours again, with our value, on a lease we keep
        alive; never adopting lease 0."""
        c = self._client
        held = int(current.lease)
        lease = self._lease_id
        if held and held != lease and await self._lease_alive(held):
            lease = held  # the lease of that earlier rejoin: keep it alive
        elif not await self._lease_alive(lease):
            async with asyncio.timeout(self.config.timeout):
                lease = int((await c.lease(self.config.ttl)).id)
        value = self._value
        if held == lease and bytes(current.value) == value:
            self._lease_id, self._mod_rev = lease, int(current.mod_revision)
            self._published = value
            return
        async with asyncio.timeout(self.config.timeout):
            ok, resp = await c.transaction(
                compare=[c.transactions.mod(self._key) == int(current.mod_revision)],
                success=[c.transactions.put(self._key, value, lease=lease),
                         c.transactions.get(self._key)],
                failure=[c.transactions.get(self._key)],
            )
        self._lease_id = lease
        now = _txn_kv(resp)
        if ok and now is not None:
            self._mod_rev = int(now.mod_revision)
            self._published = value
            if held != lease or bytes(current.value) != value:
                _log.warning("discovery.reclaimed", agent=self.name, key=self._key.decode(),
                             lease=f"{lease:#x}", reason="our key held our incarnation as "
                             "we had not written it (lease or value): put ours back")
            return
        # Written again meanwhile: its watch event brings us back here (with
        # a newer mod revision), or it is a deletion we handle as such.
        self._mod_rev = max(self._mod_rev, int(current.mod_revision))

    def _superseded(self, meta: AgentMeta | None) -> None:
        self._state = "superseded"
        other = f"incarnation {meta.incarnation:#x}" if meta is not None else "something else"
        _log.warning("discovery.superseded", agent=self.name, key=self._key.decode(),
                     reason=f"the name is now held by {other}: no longer publishing")

    async def _lease_alive(self, lease: int | None = None, bound: float | None = None) -> bool:
        """Refreshes our lease (or ``lease``): whether it still lives.
        ``bound``: seconds to wait for the answer (the request timeout)."""
        lease = self._lease_id if lease is None else lease
        if not lease:
            return False
        async with asyncio.timeout(self.config.timeout if bound is None else bound):
            reply = await self._client.refresh_lease(lease)
        return reply is not None and int(reply.TTL) > 0

    async def _rejoin(self) -> None:
        """Our lease expired (we were frozen or cut off longer than ttl): a new
        lease, and our key again if nobody took the name meanwhile."""
        c = self._client
        async with asyncio.timeout(self.config.timeout):
            lease = await c.lease(self.config.ttl)
            value = self._value
            ok, resp = await c.transaction(
                compare=[c.transactions.version(self._key) == 0],
                success=[c.transactions.put(self._key, value, lease=lease.id),
                         c.transactions.get(self._key)],
                failure=[c.transactions.get(self._key)],
            )
        self._lease_id = int(lease.id)
        current = _txn_kv(resp)
        if ok and current is not None:
            self._mod_rev = int(current.mod_revision)
            self._published = value
            _log.warning("discovery.rejoined", agent=self.name, key=self._key.decode(),
                         reason="our lease had expired (peers saw us leave)")
            return
        await self._key_taken(current)

    async def _keepalive_loop(self) -> None:
        # A third of the ttl: two refreshes may be lost or late before the lease goes.
        interval = self.config.ttl / 3
        bound = self._quick
        while True:
            await asyncio.sleep(interval)
            if self._state != "joined":
                continue
            try:
                async with self._lock:
                    if self._state != "joined":
                        continue
                    if not await self._lease_alive(bound=bound):
                        await self._rejoin()
                    elif self._value != self._published:
                        await self._put_owned()
                self._recovered("discovery.keepalive_failed")
                self._recovered("discovery.publish_failed")
            except asyncio.CancelledError:
                raise
            except (Exception, TimeoutError) as exc:
                self._warn("discovery.keepalive_failed", _why(exc))
                if len(self.config.endpoints) > 1:
                    async with self._lock:
                        await self._failover()

    async def _failover(self) -> None:
        """Our etcd endpoint failed us: moves the session to the first other
        endpoint that answers (our lease and key live in the cluster, not in
        one member). Staying with the first that answered at join meant that
        one etcd member dying for good took our lease along with it (and,
        with its members gone, every agent that had joined through it),
        however healthy the rest of the cluster. The watch, on the old
        client, ends as it closes: it lists again through the new one."""
        import aetcd

        eps = self.config.endpoints
        at = eps.index(self._endpoint) if self._endpoint in eps else -1
        for ep in eps[at + 1:] + eps[:at + 1]:
            if ep == self._endpoint or self._state != "joined":
                continue
            host, port = _parse_endpoint(ep)
            client = aetcd.Client(host=host, port=port, timeout=self.config.timeout,
                                  options=_grpc_options(self.config))
            try:
                async with asyncio.timeout(self.config.timeout):
                    await client.connect()
                    await client.refresh_lease(self._lease_id)  # it answers
            except BaseException as exc:
                with contextlib.suppress(Exception, TimeoutError):
                    async with asyncio.timeout(1.0):
                        await client.close()
                if not isinstance(exc, Exception):
                    raise  # cancelled: we are closing
                continue
            old, self._client = self._client, client
            _log.warning("discovery.failover", agent=self.name, etcd=ep, was=self._endpoint,
                         reason="our etcd endpoint failed: using another")
            self._endpoint = ep
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(1.0):
                    await old.close()
            return

    def _warn(self, event: str, reason: str) -> None:
        # Once per kind of trouble until it clears, not once per retry.
        if event not in self._warned:
            self._warned.add(event)
            _log.warning(event, agent=self.name, etcd=self._endpoint, reason=reason)

    def _recovered(self, event: str) -> None:
        if event in self._warned:
            self._warned.discard(event)
            _log.info("discovery.recovered", agent=self.name, etcd=self._endpoint,
                      after=event)

    # ------------------------------------------------------------ watching

    async def _watch_loop(self) -> None:
        backoff = 0.1
        relist = False
        while True:
            if relist:
                # Whatever was missed (events, compaction, an etcd restarted
                # empty): list afresh and let the listener diff it against
                # what it knew. The list's revision is ours only once the
                # listener took all of it: a reset that failed midway lists
                # again, rather than watching on from a revision whose members
                # it never heard of.
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.ttl / 2)
                try:
                    async with asyncio.timeout(self.config.timeout):
                        members, revision = await self._list(self._client)
                    await self._listener.reset(members, self.grace)
                except asyncio.CancelledError:
                    raise
                except (Exception, TimeoutError) as exc:
                    self._warn("discovery.watch_failed", _why(exc))
                    continue
                self._revision = revision
                relist = False
                self._recovered("discovery.watch_failed")
            loop = asyncio.get_running_loop()
            since = loop.time()
            try:
                await self._watch_from(self._revision + 1)
                raise ConnectionError("the watch stream ended")
            except asyncio.CancelledError:
                raise
            except (Exception, TimeoutError) as exc:
                if self._state == "closing":
                    return
                self._warn("discovery.watch_failed", f"{_why(exc)}; listing again")
            relist = True
            if loop.time() - since >= self.config.ttl:
                # It had been watching a while: the trouble is new, list at
                # once. Reset after each list that succeeded, a watch that
                # etcd cancels as soon as it is made (a permission refused,
                # say) listed the whole prefix ten times a second.
                backoff = 0.1

    async def _watch_from(self, revision: int) -> None:
        """Follows the prefix from ``revision`` on one Watch stream of our
        own, until it fails. Not aetcd's watch: it ignored a server's cancel
        (canceled without a compact revision: the stream stayed open, no
        event ever came again, the members froze), and one whose start
        revision was compacted raised only at its request timeout. Here
        either ends the watch at once, and the loop lists again."""
        from aetcd import rpc, utils

        client = self._client
        call = rpc.WatchStub(client.channel).Watch(metadata=client.metadata)
        try:
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=self._agents, range_end=utils.prefix_range_end(self._agents),
                start_revision=revision,
            )))
            replies = aiter(call)
            async with asyncio.timeout(self.config.timeout):
                created = await anext(replies, None)
            if created is None or not created.created:
                raise ConnectionError("etcd did not confirm the watch")
            _check_watch(created)
            async for resp in replies:
                _check_watch(resp)
                for ev in resp.events:
                    self._revision = max(self._revision, int(ev.kv.mod_revision))
                    await self._on_event(ev.type == _PUT, ev.kv)
            raise ConnectionError("the watch stream ended")
        except asyncio.CancelledError:
            # (Not the task in a local: the CancelledError's traceback holds
            # this frame and the task holds the error, a cycle that kept this
            # frame's call, its client's channel, its connection to etcd and
            # gRPC's pollers open after the agent closed, until the next
            # garbage collection: spread18.)
            if self._state == "closing" or _cancelling():
                raise
            # gRPC raises CancelledError for a call cancelled under us: our
            # client was closed (failover moved us to another endpoint).
            raise ConnectionError("the watch was cancelled as its client closed") from None
        finally:
            call.cancel()

    async def _on_event(self, put: bool, kv: Any) -> None:
        key: bytes = kv.key
        name = self._name(key)
        if name is None:
            # (Never a member's key, so nothing to add or remove; a PUT is
            # said, as any other bad value is.)
            if put:
                self._decode(key, kv.value)
            return
        if put:
            meta = self._decode(key, kv.value)
            if key == self._key:
                if meta is None or meta.incarnation != self.incarnation:
                    # (None: not an AgentMeta we can read, as when a
                    # republication meets it: perhaps a newer version's)
                    if self._state == "joined":
                        self._superseded(meta)
                    return
                # Our incarnation, written by someone else (a put of ours has
                # a mod revision we already know).
                try:
                    async with self._lock:
                        if self._state == "joined" and int(kv.mod_revision) > self._mod_rev:
                            await self._reclaim(kv)
                except (Exception, TimeoutError) as exc:
                    self._warn("discovery.keepalive_failed", _why(exc))
                return
            if meta is None:
                # The key no longer holds a member we can read: as a list
                # would say (it skips such values), that member is gone. Kept,
                # it stayed a member for ever: the bad value, on no lease,
                # never expires, so its real leaving never showed.
                await self._listener.deleted(name)
                return
            await self._listener.put(meta)
        else:
            if key == self._key:
                try:
                    async with self._lock:
                        if self._state == "joined" and int(kv.mod_revision) > self._mod_rev:
                            await self._key_taken(None)
                except (Exception, TimeoutError) as exc:
                    self._warn("discovery.keepalive_failed", _why(exc))
                return
            await self._listener.deleted(name)


_PUT = 0  # mvccpb.Event.EventType.PUT


class WatchLost(ConnectionError):
    """etcd ended our watch (compacted past our revision, or cancelled it)."""


def _check_watch(resp: Any) -> None:
    """Raises WatchLost when a watch reply says the watch is over."""
    if resp.compact_revision:
        raise WatchLost(f"etcd compacted its history past our revision "
                        f"(to {resp.compact_revision})")
    if resp.canceled:
        raise WatchLost(f"etcd cancelled the watch: {resp.cancel_reason or 'no reason given'}")


def _txn_kv(responses: list[Any]) -> Any:
    """The key-value of the txn's trailing get (None: no such key)."""
    for r in reversed(responses):
        if isinstance(r, list):
            return r[0][1] if r else None
    return None


def _cancelling() -> bool:
    """Whether the current task is being cancelled (asked in a frame of its
    own: see _watch_from)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:300]


"""Dialer: the connecting side of an agent's control plane.

A collaborator of :class:`aioxfer.Agent` (issue 10, item 8): it dials a peer
(tcp, every address of a name in turn; or a same-host peer's unix socket),
runs the client handshake (authentication, who answered), fetches metadata,
and bounds each exchange by the peer timeout, naming the peer in its errors.
What the agent then does with a connection (endpoints, rails, regions) stays
with the agent. It reaches the agent only through the narrow arguments it was
built with. Also the address helpers both sides share.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal

from aioxfer.discovery import port_number
from aioxfer.errors import AccessDenied, ProtocolError, TransportError, XferError
from aioxfer.local import local_address, peer_cred, recv_fds, recv_fds_then
from aioxfer.metadata import Accept, AgentMeta, Hello, Purpose
from aioxfer.protocol import (
    MAX_META_FRAME,
    META_GO,
    EarlyAhead,
    _hello,
    _hello_msg,
    client_handshake,
    client_join_now,
    early_ahead,
    encode_frame,
    fetch_meta,
    handshake_spin_ns,
    recv_frame,
    recv_go,
    send_now,
    with_early_frame,
    with_early_hello,
)
from aioxfer.serving import nodelay, writable

__all__ = ["Dialer", "joining", "numeric_addrinfo", "parse_address"]


class Dialer:
    """Opens one agent's control and data connections to its peers.

    ``agent``/``incarnation``: who we say we are in handshakes; ``token``: the
    shared secret (None: no authentication); ``peer_timeout``: the bound on one
    exchange; ``max_meta_bytes``: the largest metadata a same-host peer may send;
    ``spin``: whether our handshakes with a same-host peer poll for its frames
    (spin_ns; an agent whose progress mode is "sleep" polls nothing).
    """

    __slots__ = ("_agent", "_incarnation", "_token", "_peer_timeout", "_max_meta_bytes",
                 "_spin", "_hellos", "_hello_msgs")

    def __init__(
        self,
        agent: str,
        *,
        incarnation: int,
        token: bytes | None,
        peer_timeout: float,
        max_meta_bytes: int,
        spin: bool = True,
    ) -> None:
        self._agent = agent
        self._spin = spin
        self._incarnation = incarnation
        self._token = token
        self._peer_timeout = peer_timeout
        self._max_meta_bytes = max_meta_bytes
        # hello_now's Hellos made ahead (prepare_hello), each sent once:
        # (purpose, meta, joins) -> (nonce, frame).
        self._hellos: dict[tuple[Literal["data", "meta"], bool, int], tuple[bytes, bytes]] = {}
        # ... and each one's Hello as made (the same keys): hello_now stamps
        # it with an early proof without decoding its frame (with_early_hello),
        # from its early proof begun ahead: the HMAC over all of it but the
        # time and the server's address, the frame around both (early_ahead;
        # None: it carries none).
        self._hello_msgs: dict[
            tuple[Literal["data", "meta"], bool, int], tuple[Hello, EarlyAhead | None]
        ] = {}

    @property
    def peer_timeout(self) -> float:
        return self._peer_timeout

    def spin_ns(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> int:
        """How long our side of a handshake on sock polls for each of the
        peer's frames before it waits in the loop (protocol.handshake_spin_ns:
        a peer on this host only), ns; 0 without ``spin``."""
        return handshake_spin_ns(loop, sock) if self._spin else 0

    async def dial_local(self, name: str) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, local_address(name))
        except BaseException:
            sock.close()
            raise
        return sock

    def dial_local_now(self, name: str) -> socket.socket | None:
        """dial_local(name) where it connects at once (a unix socket's connect
        completes or fails inline, unless the listener's backlog is full),
        without yielding: None where it did not (dial_local then waits or
        says why)."""
        # Non-blocking from socket() on (SOCK_NONBLOCK: no setblocking's
        # ioctl before the Hello).
        sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        try:
            err = sock.connect_ex(local_address(name))
        except OSError:
            err = -1
        if err:
            sock.close()
            return None
        return sock

    async def fetch_local_meta(self, name: str, pid: int) -> tuple[AgentMeta, list[int]]:
        """A same-host peer's metadata and its memfds (index i of the list is
        the fd a RegionMeta with memfd=i names), from its unix socket, checked
        to be served by process pid."""
        loop = asyncio.get_running_loop()
        sock = await self.dial_local(name)
        try:
            if peer_cred(sock).pid != pid:
                raise ProtocolError(f"unix socket {name!r} is now served by another process")
            meta = await fetch_meta(loop, sock, name=self._agent,
                                    incarnation=self._incarnation, token=self._token,
                                    max_meta=self._max_meta_bytes)
            indexes = sorted(m.memfd for m in meta.regions if m.memfd >= 0)
            if indexes != list(range(len(indexes))):
                raise ProtocolError("metadata names memfds out of order or twice")
            return meta, await recv_fds(loop, sock, len(indexes))
        finally:
            sock.close()

    async def receive_meta(
        self, sock: socket.socket, *, local: bool, spin_ns: int = 0
    ) -> tuple[AgentMeta, list[int]]:
        """The metadata a "data" connection's Accept said follows (Hello.meta):
        the AgentMeta, on the unix socket (local) its memfds, and META_GO.
        The memfds are closed if anything fails. spin_ns: see spin_ns()."""
        loop = asyncio.get_running_loop()
        msg = await recv_frame(loop, sock, self._max_meta_bytes if local else MAX_META_FRAME,
                               spin_ns=spin_ns)
        if not isinstance(msg, AgentMeta):
            raise ProtocolError(f"expected AgentMeta, got {type(msg).__name__}")
        fds: list[int] = []
        go = b""
        if local:
            indexes = sorted(m.memfd for m in msg.regions if m.memfd >= 0)
            if indexes != list(range(len(indexes))):
                raise ProtocolError("metadata names memfds out of order or twice")
            # META_GO read with the last memfds' message where it came in it
            # (the peer's usual send): one read and one syscall fewer.
            fds, go = await recv_fds_then(loop, sock, len(indexes), len(META_GO))
        elif any(m.memfd >= 0 for m in msg.regions):
            raise ProtocolError("metadata over tcp names memfds")
        try:
            if not go:
                await recv_go(loop, sock, spin_ns=spin_ns)
            elif go != META_GO:
                raise ProtocolError(f"expected the end of the metadata, got {go!r}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return msg, fds

    async def dial(self, host: str, port: int) -> socket.socket:
        """A connected, non-blocking socket: every address of host is tried in turn."""
        loop = asyncio.get_running_loop()
        infos: Sequence[tuple[Any, ...]] | None = numeric_addrinfo(host, port)
        if infos is None:  # a name: the resolver runs on an executor thread
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError | None = None
        for family, type_, proto, _, sockaddr in infos:
            s = socket.socket(family, type_, proto)
            try:
                s.setblocking(False)
                nodelay(s)
                # Started here and waited for only if it has not completed:
                # over loopback it has by the time connect returns (the
                # kernel answers the SYN inline, though it says EINPROGRESS),
                # where loop.sock_connect would still wait for a writable
                # event, two loop iterations (~0.1-0.2 ms of a first connect,
                # benchmarks/connect_phases.py I.dial).
                err = s.connect_ex(sockaddr)
                if err not in (0, errno.EINPROGRESS):
                    raise OSError(err, os.strerror(err))
                await _connected(loop, s)
            except BaseException as exc:
                s.close()
                if not isinstance(exc, OSError):
                    raise
                error = exc
                continue
            return s
        raise error or OSError(f"no address for {host!r}")

    def dial_now(self, address: str) -> socket.socket | None:
        """A data connection to an IP literal's address, its connect started
        now and not waited for (None: a name, or it failed at once): for
        open(sock=...), and to send its Hello in a later step without
        yielding (join_now)."""
        target = _numeric_target(address)
        if target is None:
            return None
        family, sockaddr = target
        # Non-blocking from socket() on (SOCK_NONBLOCK: no setblocking's ioctl).
        s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK, socket.IPPROTO_TCP)
        try:
            nodelay(s)
            err = s.connect_ex(sockaddr)
        except OSError:
            s.close()
            return None
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return None
        return s

    def join_now(self, sock: socket.socket, join: tuple[bytes, int]) -> tuple[bytes, bytes] | None:
        """Our joining Hello on sock (from dial_now), sent now if it is
        connected (protocol.client_join_now): for open(sent=...)."""
        if self._token is None:
            return None
        return client_join_now(sock, name=self._agent, incarnation=self._incarnation,
                               token=self._token, join=join)

    def hello_now(
        self,
        sock: socket.socket,
        *,
        purpose: Literal["data", "meta"] = "data",
        meta: bool,
        joins: int = 0,
    ) -> tuple[bytes, bytes] | None:
        """Our first Hello on sock (connected by dial_now or dial_local_now),
        sent now, in this step: (its nonce, what the socket did not take
        yet), for open_meta's and client_handshake's ``sent``; None, nothing
        sent, where it takes nothing (not connected yet: client_handshake
        then sends it). purpose "data" (meta/joins: as client_handshake's)
        or "meta" (the accept_only probe, open_meta's). A Hello carries no
        secret (the handshake sends it at connect, before the peer proved
        anything, as here). To a server on this host by the address sock is
        connected to, with a token, it carries an early proof (no Proof
        round: protocol.with_early_proof), a Hello made ahead too: stamped
        and proved now, for this socket's address, its nonce kept."""
        key = self._hello_key(purpose, meta, joins)
        made = self._hellos.pop(key, None)
        msg = self._hello_msgs.pop(key, None)
        if made is None:
            nonce, frame = self._make_hello(key, sock)
        else:
            nonce, frame = made
            frame = (with_early_frame(frame, sock, self._token) if msg is None
                     else with_early_hello(msg[0], frame, sock, self._token, msg[1]))
        try:
            n = send_now(sock, frame)
        except OSError:
            return None
        return None if n == 0 else (nonce, frame[n:])

    def prepare_hello(
        self, *, purpose: Literal["data", "meta"] = "data", meta: bool, joins: int = 0
    ) -> None:
        """The Hello the next hello_now of these arguments sends, made now
        (its nonce fresh, from secrets as always, and sent once: hello_now
        takes it out): making one was ~0.03-0.05 ms of a connect before its
        Hello left (a code path gone cold while the process waited), and the
        peer answers nothing before that Hello. A Hello carries no secret."""
        key = self._hello_key(purpose, meta, joins)
        if key not in self._hellos:
            purpose, meta, joins = key
            msg = _hello_msg(name=self._agent, incarnation=self._incarnation, purpose=purpose,
                             token=self._token, meta=meta, accept_only=purpose == "meta",
                             joins=joins)
            self._hello_msgs[key] = msg, early_ahead(self._token, msg)
            self._hellos[key] = msg.nonce, encode_frame(msg)

    def _hello_key(
        self, purpose: Literal["data", "meta"], meta: bool, joins: int
    ) -> tuple[Literal["data", "meta"], bool, int]:
        if self._token is None:
            joins = 0  # (as client_handshake asks for none without a token)
        return purpose, meta and purpose == "data", joins

    def _make_hello(
        self, key: tuple[Literal["data", "meta"], bool, int], to: socket.socket | None = None
    ) -> tuple[bytes, bytes]:
        purpose, meta, joins = key
        return _hello(name=self._agent, incarnation=self._incarnation, purpose=purpose,
                      token=self._token, meta=meta, accept_only=purpose == "meta", joins=joins,
                      to=to)

    @contextlib.asynccontextmanager
    async def control_errors(self, address: str, doing: str, what: str) -> AsyncIterator[None]:
        """Bounds a control-plane exchange by peer_timeout and names the peer in its errors."""
        try:
            async with asyncio.timeout(self._peer_timeout):
                yield
        except AccessDenied as exc:
            # Named after the address, and still the error it was: its
            # status, peer, op and fail_index kept (type(exc)(msg) dropped them).
            raise type(exc)(f"connecting to {address}: {exc}", status=exc.status,
                            peer=exc.peer, op=exc.op, fail_index=exc.fail_index) from None
        except XferError:
            # Already typed: a TransferTimeout (the engine's stall detection)
            # is also a TimeoutError, and was relabelled as our peer timeout.
            raise
        except TimeoutError:
            raise TransportError(
                f"{doing} {address} timed out after {self._peer_timeout} s"
            ) from None
        except OSError as exc:
            raise TransportError(f"cannot {what} {address}: {exc}") from exc

    async def open(
        self,
        address: str,
        purpose: Literal["data", "verbs"] = "data",
        *,
        join: Callable[[], Awaitable[tuple[bytes, int] | None]] | None = None,
        sock: socket.socket | None = None,
        sent: Callable[[], tuple[bytes, bytes] | None] | None = None,
    ) -> tuple[socket.socket, Accept]:
        """A connected, handshaken data socket (non-blocking), and the peer's
        Accept (who answered: name and incarnation). join: awaited once the
        socket is connected; (nonce, index) joins that Challenge of a first
        connection (protocol.Joins), None does the whole handshake. sock: one
        from dial_now (ours from here on: closed if this fails); sent(),
        asked once join is known: what join_now sent on it (None: nothing)."""
        sock, accept, _ = await self.open_meta(address, purpose, meta=False, join=join,
                                               sock=sock, sent=sent)
        return sock, accept

    async def open_meta(
        self,
        address: str,
        purpose: Purpose = "data",
        *,
        meta: bool,
        joins: int = 0,
        on_challenge: Callable[[bytes], None] | None = None,
        join: Callable[[], Awaitable[tuple[bytes, int] | None]] | None = None,
        sock: socket.socket | None = None,
        sent: Callable[[], tuple[bytes, bytes] | None] | None = None,
        hello: tuple[bytes, bytes] | None = None,
    ) -> tuple[socket.socket, Accept, AgentMeta | None]:
        """open(), and with meta the peer's metadata on the same connection
        (None from a peer that does not send it there). Purpose "meta": only
        who answered (its Accept, Hello.accept_only); the peer's engine never
        holds the connection. joins/on_challenge: see client_handshake.
        sock/sent: see open(); hello: what hello_now sent on sock (a first
        Hello, asking for meta and joins as given here)."""
        loop = asyncio.get_running_loop()
        host, port = parse_address(address)
        async with self.control_errors(address, "connecting to", "connect to"):
            early = sock is not None
            try:
                if sock is None:
                    sock = await self.dial(host, port)
                joined = None if join is None else await join()
                if hello is None and sent is not None and joined is not None:
                    hello = sent()
                if early and hello is None:
                    await _connected(loop, sock)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            try:
                spin = self.spin_ns(loop, sock)
                accept = await client_handshake(
                    loop,
                    sock,
                    name=self._agent,
                    incarnation=self._incarnation,
                    purpose=purpose,
                    token=self._token,
                    meta=meta,
                    accept_only=purpose == "meta",
                    joins=joins,
                    on_challenge=on_challenge,
                    join=joined,
                    sent=hello,
                    spin_ns=spin,
                )
                got = None
                if meta and accept.meta:
                    got = (await self.receive_meta(sock, local=False, spin_ns=spin))[0]
            except BaseException:
                sock.close()
                raise
            return sock, accept, got
        raise AssertionError("unreachable")  # for type checkers: the block returns or raises

    async def fetch_meta(self, host: str, port: int, address: str) -> AgentMeta:
        loop = asyncio.get_running_loop()
        async with self.control_errors(address, "fetching metadata from", "fetch metadata from"):
            sock = await self.dial(host, port)
            try:
                return await fetch_meta(
                    loop, sock, name=self._agent, incarnation=self._incarnation,
                    token=self._token,
                )
            finally:
                sock.close()
        raise AssertionError("unreachable")  # for type checkers: the block returns or raises


async def _connected(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until sock's connect (started by dial_now, or done) has completed; its
    error as an OSError."""
    while True:
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
        try:
            sock.getpeername()
            return
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
        await writable(loop, sock)


@functools.lru_cache(maxsize=256)
def _numeric_target(address: str) -> tuple[int, tuple[Any, ...]] | None:
    """(family, sockaddr) of an IP literal's address (None: a name), as
    dial_now connects to it: parsed once per address in a process (a pure
    function of the string; ValueError/TypeError as parse_address, not
    kept), not on every connect's way before its Hello."""
    host, port = parse_address(address)
    infos = numeric_addrinfo(host, port)
    if infos is None:
        return None
    return infos[0][0], infos[0][4]


def joining(nonce: bytes, index: int) -> Callable[[], Awaitable[tuple[bytes, int] | None]]:
    """A known Challenge to join, as Dialer.open's join= takes it."""

    async def join() -> tuple[bytes, int] | None:
        return nonce, index

    return join


def parse_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str):
        raise TypeError(f'an address is a "host:port" string, not {type(address).__name__}')
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f'address {address!r} is not "host:port"')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    portnum = port_number(port)
    if portnum is None:
        raise ValueError(f"address {address!r} has no valid port")
    return host, portnum


def numeric_addrinfo(
    host: str, port: int
) -> list[tuple[int, int, int, str, tuple[Any, ...]]] | None:
    """getaddrinfo's answer for an IP literal, without the resolver (whose
    executor thread costs ~10 ms to start on a first connect); None for a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        sockaddr: tuple[Any, ...] = (host, port) if family == socket.AF_INET else (host, port, 0, 0)
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]
    return None

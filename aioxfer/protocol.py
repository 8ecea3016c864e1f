"""Control-plane framing and the connection handshake.

A frame is a 4-byte big-endian length and that many bytes of msgpack (one
tagged Struct from :mod:`aioxfer.metadata`), at most :data:`MAX_FRAME` bytes.

Every read asks the kernel for exactly the bytes still missing from the current
frame, never more: a "data" connection is handed to the native engine right
after the handshake, and whatever Python had read past it would be lost to the
engine.

Handshake (client left, server right)::

    Hello{version, name, incarnation, purpose, nonce_c}  ->
                   <- Challenge{nonce_s, HMAC(token, SERVER_CTX + nonce_c)}   (token only)
    Proof{HMAC(token, CLIENT_CTX + nonce_s + name)}       ->                  (token only)
                   <- Accept{name, incarnation}  |  Reject{reason}, close
    "meta":        <- AgentMeta, close
    "data":        native engine frames both ways from here on
    "data", Hello.meta (Accept.meta says it follows):
                   <- AgentMeta, [memfds: unix socket], META_GO
                   then native engine frames both ways
    "verbs":       VerbsConnect{client's queue pairs}  ->
                   <- VerbsAccept{server's queue pairs}, then as "data"

A client's other "data" connections to the same peer may join the Challenge
of its first connection, "data" or an accept_only "meta" probe (token only;
on the unix socket too, where the kernel still vouches for the user): the
first Hello says how many (``joins``); once the client has checked that
Challenge's server proof, each other connection (index i, 1-based) sends
``Hello{..., join=nonce_s, join_index=i, join_proof}`` with
``join_proof = HMAC(token, JOIN_CTX + nonce_s + i + nonce_c + name)`` and
gets ``Challenge{joined, HMAC(token, SERVER_CTX + nonce_c)}`` and Accept
together: one round trip, no Proof. The server honours a join only for a
Challenge it issued to that name and incarnation for that many joins, each
index once, within its peer timeout (:class:`Joins`); anything else (replayed,
forged, expired, another name, a wrong proof) gets the usual Challenge, so it
still has to prove the token over a fresh nonce.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
import sys
import time
from collections.abc import Callable
from typing import NamedTuple, TypeGuard

import msgspec

from aioxfer.errors import AccessDenied, ProtocolError, XferError
from aioxfer.metadata import (
    PROTOCOL_VERSION,
    Accept,
    AgentMeta,
    Challenge,
    Frame,
    Hello,
    Proof,
    Purpose,
    Reject,
)

__all__ = [
    "MAX_FRAME",
    "MAX_HANDSHAKE_FRAME",
    "MAX_META_FRAME",
    "NONCE_BYTES",
    "META_GO",
    "ClosedSilently",
    "HelloTaken",
    "FrameTooLarge",
    "HandshakeRejected",
    "Joins",
    "client_handshake",
    "client_join_now",
    "client_proof",
    "join_proof",
    "encode_frame",
    "recv_go",
    "recv_frame",
    "send_frame",
    "send_now",
    "server_handshake",
    "server_hello_now",
    "server_join_now",
    "server_proof",
]

MAX_FRAME = 1 << 20
# Before the peer proved it knows the token, a frame is one of the handshake's
# (Hello, Challenge, Proof, Accept, Reject): a few hundred bytes. Nothing larger
# is read (or allocated) for an unauthenticated peer.
MAX_HANDSHAKE_FRAME = 4096
# An agent's metadata, read only from an authenticated peer: big enough for
# ~700 k regions, and a configurable bound (Agent(max_meta_bytes=...)).
MAX_META_FRAME = 64 << 20
NONCE_BYTES = 16
MAX_NAME = 256
# Ends the metadata a "data" client asked for: sent only once the server's
# engine holds the connection as the metadata was (nothing the metadata names
# was deregistered meanwhile), so a region deregistered later is revoked on it.
# A server that cannot vouch for that closes the connection instead.
META_GO = b"\x01"
_SERVER_CTX = b"aioxfer-server-v1\x00"
_CLIENT_CTX = b"aioxfer-client-v1\x00"
_JOIN_CTX = b"aioxfer-join-v1\x00"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


class FrameTooLarge(ProtocolError):
    """A frame's length prefix is over :data:`MAX_FRAME` (or zero)."""


class HandshakeRejected(AccessDenied):
    """Server side: the client failed authentication (a Reject was sent)."""


def encode_frame(msg: Frame) -> bytes:
    body = _encoder.encode(msg)
    limit = MAX_META_FRAME if isinstance(msg, AgentMeta) else MAX_FRAME
    if len(body) > limit:
        raise FrameTooLarge(f"frame of {len(body)} bytes is over the {limit}-byte limit")
    return len(body).to_bytes(4, "big") + body


def decode_body(body: bytes | bytearray | memoryview) -> Frame:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(f"malformed frame: {exc}") from None
    except RecursionError:  # msgpack nested deeper than the interpreter allows
        raise ProtocolError("malformed frame: nested too deeply") from None


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes, never more (asks the kernel only for what is missing)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes of a frame")
        got += k
    return buf


async def recv_frame(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, max_frame: int = MAX_FRAME
) -> Frame:
    head = await recv_exact(loop, sock, 4)
    n = int.from_bytes(head, "big")
    if n == 0 or n > max_frame:
        raise FrameTooLarge(f"frame length {n} is outside 1..{max_frame}")
    return decode_body(await recv_exact(loop, sock, n))


async def send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, msg: Frame) -> None:
    await loop.sock_sendall(sock, encode_frame(msg))


def send_now(sock: socket.socket, data: bytes | memoryview) -> int:
    """Sends what the (non-blocking) socket takes now; returns how many bytes."""
    view = memoryview(data)
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except (BlockingIOError, InterruptedError):
            break
    return sent


async def recv_go(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Client: the META_GO that ends the metadata of a "data" connection."""
    try:
        go = await recv_exact(loop, sock, 1)
    except ProtocolError:
        raise ProtocolError(
            "the peer's regions changed while it sent its metadata: connect again"
        ) from None
    if go != META_GO:
        raise ProtocolError(f"expected the end of the metadata, got {bytes(go)!r}")


def token_bytes(token: str | bytes | None) -> bytes | None:
    if token is None:
        return None
    out = token.encode() if isinstance(token, str) else bytes(token)
    if not out:
        raise ValueError("token must not be empty")
    return out


def server_proof(token: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, _SERVER_CTX + client_nonce, hashlib.sha256).digest()


def client_proof(token: bytes, server_nonce: bytes, name: str) -> bytes:
    return hmac.new(token, _CLIENT_CTX + server_nonce + name.encode(), hashlib.sha256).digest()


def join_proof(token: bytes, join: bytes, index: int, client_nonce: bytes, name: str) -> bytes:
    """A joining connection's proof (see the module docstring); join and
    client_nonce are NONCE_BYTES long, index one byte."""
    return hmac.new(
        token, _JOIN_CTX + join + bytes((index,)) + client_nonce + name.encode(), hashlib.sha256
    ).digest()


class _Grant:
    __slots__ = ("expires", "name", "incarnation", "joins", "used")

    def __init__(self, expires: float, name: str, incarnation: int, joins: int) -> None:
        self.expires = expires
        self.name = name
        self.incarnation = incarnation
        self.joins = joins
        self.used = 0  # bit i: join_index i was accepted


class Joins:
    """Server side: the Challenges a client's other connections may join.

    A Challenge sent to a "data" (or accept_only "meta") Hello that asks for
    ``joins`` is granted here: for ``ttl`` seconds, each join_index 1..joins
    may be accepted once, on a "data" Hello of the same name and incarnation,
    with a join proof over the Challenge's nonce; the grant is revoked when
    the client fails its own Proof. At most ``cap`` grants are live (the oldest goes first): an
    unauthenticated client can make grants, never use one, and a legitimate
    client that finds its grant gone only does the usual Proof round.
    """

    __slots__ = ("_live", "_ttl", "_cap", "joined")

    def __init__(self, *, ttl: float, cap: int) -> None:
        self._live: dict[bytes, _Grant] = {}
        self.joined = 0  # joins accepted (tests, statistics)
        self._ttl = ttl
        self._cap = max(1, cap)

    def __len__(self) -> int:
        return len(self._live)

    def grant(self, nonce: bytes, hello: Hello) -> None:
        now = time.monotonic()
        live = self._live
        while live:  # oldest first: one ttl for all, so expiry follows insertion
            first = next(iter(live))
            if live[first].expires > now and len(live) < self._cap:
                break
            del live[first]
        live[nonce] = _Grant(now + self._ttl, hello.name, hello.incarnation, hello.joins)

    def revoke(self, nonce: bytes) -> None:
        self._live.pop(nonce, None)

    def take(self, hello: Hello, token: bytes) -> bool:
        """Whether hello joins a live grant (the index is then used up)."""
        g = self._live.get(hello.join)
        if (
            g is None
            or g.expires <= time.monotonic()
            or g.name != hello.name
            or g.incarnation != hello.incarnation
            or not 1 <= hello.join_index <= g.joins
            or g.used >> hello.join_index & 1
            or len(hello.nonce) != NONCE_BYTES
        ):
            return False
        want = join_proof(token, hello.join, hello.join_index, hello.nonce, hello.name)
        if not hmac.compare_digest(hello.join_proof, want):
            return False
        g.used |= 1 << hello.join_index
        self.joined += 1
        if g.used == (1 << (g.joins + 1)) - 2:
            del self._live[hello.join]
        return True


def _unexpected(got: Frame, want: str) -> ProtocolError:
    return ProtocolError(f"expected {want}, got {type(got).__name__}")


def _hello(
    *,
    name: str,
    incarnation: int,
    purpose: Purpose,
    token: bytes | None,
    meta: bool = False,
    accept_only: bool = False,
    joins: int = 0,
    join: tuple[bytes, int] | None = None,
) -> tuple[bytes, bytes]:
    """A client's Hello (a fresh nonce) as a frame; returns (nonce, frame)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    hello = Hello(
        version=PROTOCOL_VERSION,
        name=name,
        incarnation=incarnation,
        purpose=purpose,
        nonce=nonce,
        byteorder=sys.byteorder,
        meta=meta,
        accept_only=accept_only,
        joins=joins,
    )
    if join is not None:
        assert token is not None
        hello = msgspec.structs.replace(
            hello, join=join[0], join_index=join[1],
            join_proof=join_proof(token, join[0], join[1], nonce, name),
        )
    return nonce, encode_frame(hello)


def client_join_now(
    sock: socket.socket, *, name: str, incarnation: int, token: bytes, join: tuple[bytes, int]
) -> tuple[bytes, bytes] | None:
    """Sends a joining "data" Hello (join: the Challenge's nonce and our
    index) on a connected non-blocking socket now, in this step: returns
    (its nonce, what the socket did not take yet), for client_handshake's
    ``sent``; None, nothing sent, when the socket takes nothing (not
    connected yet, or broken: client_handshake then sends it)."""
    nonce, frame = _hello(name=name, incarnation=incarnation, purpose="data", token=token,
                          join=join)
    try:
        n = send_now(sock, frame)
    except OSError:
        return None
    return None if n == 0 else (nonce, frame[n:])


async def _client_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    name: str,
    incarnation: int,
    purpose: Purpose,
    token: bytes | None,
    meta: bool,
    accept_only: bool,
    joins: int,
    on_challenge: Callable[[bytes], None] | None,
    join: tuple[bytes, int] | None,
    sent: tuple[bytes, bytes] | None,
) -> Accept:
    """See client_handshake."""
    if token is None or not (purpose == "data" or accept_only):
        joins = 0
    if token is None or purpose != "data":
        join = None
    if sent is None:
        nonce, frame = _hello(name=name, incarnation=incarnation, purpose=purpose, token=token,
                              meta=meta, accept_only=accept_only, joins=joins, join=join)
        await loop.sock_sendall(sock, frame)
    else:  # client_join_now sent (the first part of) it
        nonce, rest = sent
        if rest:
            await loop.sock_sendall(sock, rest)
    msg = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME)
    if isinstance(msg, Challenge):
        if token is None:
            raise AccessDenied("peer requires a token and this agent has none")
        if not hmac.compare_digest(msg.proof, server_proof(token, nonce)):
            raise AccessDenied("peer failed to prove it knows the token")
        if len(msg.nonce) != NONCE_BYTES:
            raise ProtocolError(f"challenge nonce must be {NONCE_BYTES} bytes")
        if msg.joined:
            if join is None:
                raise ProtocolError("peer accepted a join this connection did not ask for")
        else:
            await send_frame(loop, sock, Proof(proof=client_proof(token, msg.nonce, name)))
            if on_challenge is not None and joins:
                # Our other connections may join it now (their Hellos may
                # go out in this step, behind the Proof: client_join_now).
                on_challenge(msg.nonce)
        msg = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME)
    elif isinstance(msg, Accept) and token is not None:
        raise AccessDenied("peer does not authenticate with a token, but this agent requires one")
    if isinstance(msg, Reject):
        raise AccessDenied(f"peer refused the connection: {msg.reason}")
    if not isinstance(msg, Accept):
        raise _unexpected(msg, "Accept")
    return msg


async def _server_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    token: bytes | None,
    accept: Accept,
    joins: Joins | None,
    taken: HelloTaken | None = None,
) -> Hello:
    """See server_handshake."""
    if taken is not None:  # (server_hello_now: the Hello read, the Challenge sent)
        await _proof_round(loop, sock, taken, token, joins)
        await send_frame(loop, sock, taken.accept)
        return taken.hello
    hello = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME)
    if not isinstance(hello, Hello):
        raise _unexpected(hello, "Hello")
    if hello.version != PROTOCOL_VERSION:
        await _reject(loop, sock, f"protocol version {hello.version} is not {PROTOCOL_VERSION}")
        raise ProtocolError(f"client speaks protocol version {hello.version}")
    if not hello.name or len(hello.name) > MAX_NAME:
        raise ProtocolError(f"agent name must be 1..{MAX_NAME} characters")
    if len(hello.nonce) != NONCE_BYTES:
        raise ProtocolError(f"hello nonce must be {NONCE_BYTES} bytes, not {len(hello.nonce)}")
    if not 0 <= hello.incarnation < 1 << 64:
        raise ProtocolError("incarnation must be an unsigned 64-bit integer")
    if hello.purpose in ("data", "verbs") and hello.byteorder != sys.byteorder:
        await _reject(loop, sock, f"byte order {hello.byteorder} is not {sys.byteorder}")
        raise ProtocolError(f"client byte order {hello.byteorder} is not {sys.byteorder}")
    if hello.meta and hello.purpose == "data":
        accept = msgspec.structs.replace(accept, meta=True)  # the caller sends it
    if token is not None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        proof = server_proof(token, hello.nonce)
        data = hello.purpose == "data" and joins is not None
        if data and hello.join and joins is not None and joins.take(hello, token):
            # Authenticated by its join proof: no Proof round.
            await loop.sock_sendall(
                sock,
                encode_frame(Challenge(nonce=nonce, proof=proof, joined=True))
                + encode_frame(accept),
            )
            return hello
        taken = HelloTaken(hello, nonce, accept, _grant(hello, nonce, joins))
        try:
            await send_frame(loop, sock, Challenge(nonce=nonce, proof=proof))
        except BaseException:
            if taken.granted and joins is not None:
                joins.revoke(nonce)
            raise
        await _proof_round(loop, sock, taken, token, joins)
    await send_frame(loop, sock, accept)
    return hello


class HelloTaken(NamedTuple):
    """A first connection's Hello, checked and read, and our Challenge (nonce)
    sent: what the Proof round goes on from. granted: its Challenge may be
    joined (Joins.grant); accept: what we answer once it proved the token."""

    hello: Hello
    nonce: bytes
    accept: Accept
    granted: bool


def _grant(hello: Hello, nonce: bytes, joins: Joins | None) -> bool:
    """Grants hello's Challenge to the joins it announced, where it may have any."""
    granted = (
        joins is not None
        and hello.joins > 0
        and (hello.purpose == "data" or (hello.purpose == "meta" and hello.accept_only))
    )
    if granted and joins is not None:
        joins.grant(nonce, hello)
    return granted


async def _proof_round(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    taken: HelloTaken,
    token: bytes | None,
    joins: Joins | None,
) -> None:
    """Our Challenge is out: the client's Proof, checked (the grant revoked
    if it does not come right)."""
    assert token is not None
    hello, nonce = taken.hello, taken.nonce
    try:
        try:
            answer = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME)
        except ProtocolError as exc:
            raise HandshakeRejected(
                f"agent {hello.name!r} did not authenticate (no or wrong token?): {exc}"
            ) from None
        if not isinstance(answer, Proof):
            raise _unexpected(answer, "Proof")
        if not hmac.compare_digest(answer.proof, client_proof(token, nonce, hello.name)):
            await _reject(loop, sock, "bad token")
            raise HandshakeRejected(f"agent {hello.name!r} failed token authentication")
    except BaseException:
        if taken.granted and joins is not None:
            joins.revoke(nonce)  # a client that did not prove the token joins nothing
        raise


def _peeked(sock: socket.socket) -> bytes | None:
    """What waits in the socket, up to a handshake frame, peeked (nothing
    read); None when nothing does yet or the socket broke (server_handshake
    meets either)."""
    try:
        return sock.recv(4 + MAX_HANDSHAKE_FRAME, socket.MSG_PEEK)
    except OSError:
        return None


def _whole_frame(peeked: bytes) -> int:
    """The length of the frame ``peeked`` starts with when all of it (a
    non-empty body) is there, else 0."""
    n = int.from_bytes(peeked[:4], "big")
    return n if len(peeked) >= 4 and 0 < n <= len(peeked) - 4 else 0


def _hello_passes(frame: object) -> TypeGuard[Hello]:
    """A Hello passing the checks server_handshake makes of every one
    (version, name, nonce, incarnation): server_hello_now and server_join_now
    take a peeked Hello only then, and leave any other to server_handshake,
    which answers it (a Reject, an error)."""
    return (
        isinstance(frame, Hello)
        and frame.version == PROTOCOL_VERSION
        and 0 < len(frame.name) <= MAX_NAME
        and len(frame.nonce) == NONCE_BYTES
        and 0 <= frame.incarnation < 1 << 64
    )


def server_hello_now(
    sock: socket.socket, *, token: bytes | None, accept: Accept, joins: Joins | None
) -> HelloTaken | None:
    """Server side, at once (no await), in the accepting step: a first
    connection's Hello (not a join: server_join_now's), whole in the socket
    (TCP_DEFER_ACCEPT: it came with the connection) and passing every check
    server_handshake makes, is read and answered by our Challenge: the
    Proof round then goes on in server_handshake(taken=...). Saves the
    Challenge a loop step and a task step. Anything else (no token, a
    partial Hello, any check failing, a join) returns None with nothing
    read: server_handshake reads it and answers as before (Reject included).
    ProtocolError: taken, but the connection broke (the caller closes it)."""
    if token is None:
        return None
    frame = _peeked(sock)
    if frame is None or not (n := _whole_frame(frame)):
        return None
    try:
        hello = decode_body(memoryview(frame)[4 : 4 + n])
    except ProtocolError:
        return None
    if not (
        _hello_passes(hello)
        and (hello.purpose not in ("data", "verbs") or hello.byteorder == sys.byteorder)
        and not hello.join
    ):
        return None
    if hello.meta and hello.purpose == "data":
        accept = msgspec.structs.replace(accept, meta=True)  # the caller sends it
    nonce = secrets.token_bytes(NONCE_BYTES)
    challenge = encode_frame(Challenge(nonce=nonce, proof=server_proof(token, hello.nonce)))
    taken = HelloTaken(hello, nonce, accept, _grant(hello, nonce, joins))
    try:
        if sock.recv_into(bytearray(4 + n), 4 + n) != 4 + n:  # the peeked Hello, for good
            raise ProtocolError("the Hello shrank between its peek and its read")
        # A few dozen bytes into an empty send buffer: they fit unless it broke.
        if send_now(sock, challenge) < len(challenge):
            raise ProtocolError("the Challenge did not fit an empty send buffer")
    except (OSError, ProtocolError) as exc:
        if taken.granted and joins is not None:
            joins.revoke(nonce)
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"connection broken during its handshake: {exc}") from None
    return taken


# How a Hello that joins nothing encodes its "join" field (the empty default):
# server_join_now leaves such a Hello to server_handshake without decoding it.
_NO_JOIN = b"\xa4join\xc4\x00"


class ClosedSilently(ProtocolError):
    """A connection closed before sending a byte: nothing was asked of us.
    A tcp connect's other connections are dialled early and joined later
    (connector._EarlyConns): an agent closing in between closes them so."""


def server_join_now(
    sock: socket.socket, *, token: bytes | None, accept: Accept, joins: Joins
) -> Hello | None:
    """Server side, at once (no await): a "data" connection whose whole Hello
    already waits in the socket and joins a live Challenge (see Joins) gets
    Challenge{joined} and Accept in one send, and its Hello is returned.
    Anything else (no token, a partial Hello, not a join, one that asks for
    the metadata, a grant gone or a wrong proof, a send that would block)
    returns None with nothing read: the caller runs server_handshake, which
    reads the same Hello. ProtocolError: taken, but the connection broke
    (the caller closes it); ClosedSilently: it closed before a byte came.
    A join is checked by peeking; its bytes are read (exactly the frame:
    the engine's bytes follow) only once it is taken."""
    if token is None:
        return None
    frame = _peeked(sock)
    if frame is None:
        return None
    if not frame:
        raise ClosedSilently("connection closed before its Hello")
    n = _whole_frame(frame)
    if not n:
        return None
    if _NO_JOIN in frame[4 : 4 + n]:
        return None  # (a shortcut: an empty "join" as msgspec writes it)
    try:
        # (Exactly the frame, as server_hello_now: all that was peeked made
        # a Hello with anything behind it fail to decode, "trailing
        # characters", and take server_handshake's slower path.)
        hello = decode_body(memoryview(frame)[4 : 4 + n])
    except ProtocolError:
        return None
    if not (
        _hello_passes(hello)
        and hello.purpose == "data"
        and hello.byteorder == sys.byteorder
        and not hello.meta
        and hello.join
    ):
        return None
    reply = encode_frame(
        Challenge(nonce=secrets.token_bytes(NONCE_BYTES), proof=server_proof(token, hello.nonce),
                  joined=True)
    ) + encode_frame(accept)
    # The reply is a few hundred bytes into an empty send buffer: it fits
    # unless the socket is broken; then the join is not taken.
    if not joins.take(hello, token):
        return None
    try:
        if sock.recv_into(bytearray(4 + n), 4 + n) != 4 + n:  # the peeked Hello, for good
            raise ProtocolError("the joining Hello shrank between its peek and its read")
        if send_now(sock, reply) < len(reply):
            raise ProtocolError("the joined connection's Accept did not fit its send buffer")
    except OSError as exc:
        raise ProtocolError(f"connection broken while it joined: {exc}") from None
    return hello


async def client_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    name: str,
    incarnation: int,
    purpose: Purpose,
    token: bytes | None,
    meta: bool = False,
    accept_only: bool = False,
    joins: int = 0,
    on_challenge: Callable[[bytes], None] | None = None,
    join: tuple[bytes, int] | None = None,
    sent: tuple[bytes, bytes] | None = None,
) -> Accept:
    """Runs the client half; returns the server's Accept.

    joins/on_challenge (a first "data" connection, token only): this many
    other connections will join its Challenge; on_challenge(nonce) is called
    once the server proved itself in it. join: (that nonce, index 1..joins)
    for one of those connections (see the module docstring); sent: such a
    connection's Hello was sent by client_join_now (its nonce, and the part
    still to send).

    meta ("data" only): ask for the server's metadata on this connection; if
    the Accept says it follows (``accept.meta``), the caller reads it
    (``recv_frame``; memfds on a unix socket; ``recv_go``) before the engine
    takes the connection. accept_only ("meta" only): the Accept is all we
    want; the server closes after it (an older one sends its metadata, which
    the caller leaves unread).

    Raises AccessDenied when the server rejects us, when its proof is wrong, when
    it wants a token we do not have, or when we have a token and it does not
    authenticate (a server that skips the challenge cannot prove who it is).
    On failure the socket is shut down (the caller still owns and closes it), so
    the other side sees the end at once instead of waiting for its timeout.
    """
    try:
        return await _client_handshake(
            loop, sock, name=name, incarnation=incarnation, purpose=purpose, token=token,
            meta=meta, accept_only=accept_only, joins=joins, on_challenge=on_challenge, join=join,
            sent=sent,
        )
    except XferError:
        _shutdown(sock)
        raise


async def server_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    token: bytes | None,
    accept: Accept,
    joins: Joins | None = None,
    taken: HelloTaken | None = None,
) -> Hello:
    """Runs the server half up to and including sending ``accept`` (with
    ``meta=True`` when the client asked for the metadata on a "data"
    connection: the caller then sends it, see META_GO). joins: where the
    Challenges other connections may join are kept (None: no joins).
    taken: server_hello_now read the Hello and sent the Challenge.

    Raises HandshakeRejected (after sending Reject) when authentication fails,
    ProtocolError on anything malformed; either way the socket is shut down.
    """
    try:
        return await _server_handshake(loop, sock, token=token, accept=accept, joins=joins,
                                       taken=taken)
    except XferError:
        _shutdown(sock)
        raise


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


async def _reject(loop: asyncio.AbstractEventLoop, sock: socket.socket, reason: str) -> None:
    try:
        await send_frame(loop, sock, Reject(reason=reason))
    except OSError:
        pass


async def fetch_meta(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    name: str,
    incarnation: int,
    token: bytes | None,
    max_meta: int = MAX_META_FRAME,
) -> AgentMeta:
    """Client side of a "meta" connection: handshake, then the AgentMeta."""
    await client_handshake(
        loop, sock, name=name, incarnation=incarnation, purpose="meta", token=token
    )
    msg = await recv_frame(loop, sock, max_meta)
    if not isinstance(msg, AgentMeta):
        raise _unexpected(msg, "AgentMeta")
    return msg

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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
import sys

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
    "FrameTooLarge",
    "HandshakeRejected",
    "client_handshake",
    "client_proof",
    "encode_frame",
    "recv_go",
    "recv_frame",
    "send_frame",
    "send_now",
    "server_handshake",
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


def _unexpected(got: Frame, want: str) -> ProtocolError:
    return ProtocolError(f"expected {want}, got {type(got).__name__}")


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
) -> Accept:
    """See client_handshake."""
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
    )
    await send_frame(loop, sock, hello)
    msg = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME)
    if isinstance(msg, Challenge):
        if token is None:
            raise AccessDenied("peer requires a token and this agent has none")
        if not hmac.compare_digest(msg.proof, server_proof(token, nonce)):
            raise AccessDenied("peer failed to prove it knows the token")
        if len(msg.nonce) != NONCE_BYTES:
            raise ProtocolError(f"challenge nonce must be {NONCE_BYTES} bytes")
        await send_frame(loop, sock, Proof(proof=client_proof(token, msg.nonce, name)))
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
) -> Hello:
    """See server_handshake."""
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
    if token is not None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        await send_frame(loop, sock, Challenge(nonce=nonce, proof=server_proof(token, hello.nonce)))
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
    if hello.meta and hello.purpose == "data":
        accept = msgspec.structs.replace(accept, meta=True)  # the caller sends it
    await send_frame(loop, sock, accept)
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
) -> Accept:
    """Runs the client half; returns the server's Accept.

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
            meta=meta, accept_only=accept_only,
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
) -> Hello:
    """Runs the server half up to and including sending ``accept`` (with
    ``meta=True`` when the client asked for the metadata on a "data"
    connection: the caller then sends it, see META_GO).

    Raises HandshakeRejected (after sending Reject) when authentication fails,
    ProtocolError on anything malformed; either way the socket is shut down.
    """
    try:
        return await _server_handshake(loop, sock, token=token, accept=accept)
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

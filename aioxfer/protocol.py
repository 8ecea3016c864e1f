"""Control-plane framing and the connection handshake.

A frame is a 4-byte big-endian length and that many bytes of msgpack (one
tagged Struct from :mod:`aioxfer.metadata`), at most :data:`MAX_FRAME` bytes.

Every read asks the kernel for exactly the bytes still missing from the current
frame, never more: a "data" connection is handed to the native engine right
after the handshake, and whatever Python had read past it would be lost to the
engine.

Handshake (client left, server right): the server speaks first, so a
connection costs one round trip after the connect::

                   <- Challenge{version, nonce_s}       (at accept, before reading)
    Hello{version, name, incarnation, purpose, nonce_c}  ->   (at connect, not waiting)
    Proof{HMAC(token, CLIENT_CTX + nonce_s + nonce_c + name)}  ->   (token only)
                   <- Accept{name, incarnation, proof}  |  Reject{reason}, close
                      proof = HMAC(token, SERVER_CTX + nonce_c + nonce_s)
    "meta":        <- AgentMeta, close
    "data":        native engine frames both ways from here on
    "data", Hello.meta (Accept.meta says it follows):
                   <- AgentMeta, [memfds: unix socket], META_GO
                   then native engine frames both ways
    "verbs":       VerbsConnect{client's queue pairs}  ->
                   <- VerbsAccept{server's queue pairs}, then as "data"

``token`` here and in every function below is the agent's key,
auth.hmac_key(token) (scrypt), never the token itself. Without a token
Challenge.nonce is empty, no Proof is sent and Accept.proof
is empty; a client with a token refuses such a server, a client without one
refuses a server with one. The client sends its Proof before the server
proved itself (SECURITY.md, "The order of the proofs"), and checks
Accept.proof before it uses anything the server sent. The Hello goes at
connect, not after the Challenge: a server of an older version, which reads
first, answers it with a Reject naming the version instead of both sides
waiting (TCP_DEFER_ACCEPT also accepts a tcp connection only once its first
bytes came).

A client's other "data" connections to the same peer may join the Challenge
of its first connection, "data" or an accept_only "meta" probe (token only;
on the unix socket too, where the kernel still vouches for the user): the
first Hello says how many (``joins``); once the client has checked the
server's proof in that connection's Accept, each other connection (index i, 1-based) sends
``Hello{..., join=nonce_s, join_index=i, join_proof}`` with
``join_proof = HMAC(token, JOIN_CTX + nonce_s + i + nonce_c + name)``; the
server answers its own Challenge and the proved Accept together: no Proof.
The server honours a join only for a Challenge it issued to that name and
incarnation for that many joins, each index once, within its peer timeout
(:class:`Joins`), revoked when the first connection fails its Proof;
anything else (replayed, forged, expired, another name, a wrong proof) gets
its Challenge again and must prove the token over that fresh nonce.

Early proofs (same host: the Proof round left out). A client connected to
this host by the address it dialled (a unix socket, or tcp to 127.0.0.0/8
or ::1) puts in its first Hello ``early_ts`` (its time.time_ns()) and
``early_proof = HMAC(token, EARLY_CTX + every other field of the Hello +
early_ts + the server's address)`` (early_proof; the address as both ends'
sockets name it, sock_endpoint). A server that finds the client on this
host from its own socket (its unix listener, whose peer the kernel names as
our uid; a loopback peer address; never from what the client says) and
finds that whole Hello waiting as it accepts takes the proof only when its
MAC verifies, its timestamp is within EARLY_WINDOW_NS of its clock and not
before the server started listening, and its nonce was never taken (a
replay cache, EarlyProofs); then, after every check a Hello passes in
server_handshake, and refuse()::

    Hello{..., early_ts, early_proof}  ->
                   <- Challenge{version, nonce_s, early=True}, Accept{..., proof}

in one send (server_early_now), the Accept's proof over nonce_c and nonce_s
as above: the client checks it before it uses anything, and sends no Proof.
Anything else gets the ordinary Challenge (``early`` False) at accept and
the client proves the token over it: an early proof is never refused, so
an older client, a stale clock or a full cache cost only the Proof round.
An older server ignores the Hello's early fields and never says ``early``.
Why one host only (SECURITY.md, "Early proofs"): whoever can record a
unix-socket or loopback Hello is root or this user and can read the token
itself; a Hello that crossed a network could be recorded there and replayed
at a server's loopback by a local user: other hosts never send or get early
proofs, and the address binding makes one made for a network address no
proof at a loopback one; a tcp address's scope (boot id, network namespace:
sock_endpoint) one made for one host's loopback none at another's (a
loopback port forwarded to another host: its Hello crossed a network).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Collection
from typing import NoReturn, TypeGuard, TypeVar

import msgspec

from aioxfer.errors import AccessDenied, ProtocolError, XferError
from aioxfer.log import escape
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
from aioxfer.names import MAX_NAME

__all__ = [
    "MAX_FRAME",
    "MAX_HANDSHAKE_FRAME",
    "MAX_META_FRAME",
    "NONCE_BYTES",
    "META_GO",
    "ClosedSilently",
    "EARLY_CACHE",
    "EARLY_WINDOW_NS",
    "EarlyProofs",
    "FrameTooLarge",
    "HandshakeRejected",
    "Joins",
    "OtherVersion",
    "client_handshake",
    "client_join_now",
    "challenge",
    "early_challenge",
    "AcceptAhead",
    "hello_peek_now",
    "peek_now",
    "client_proof",
    "early_proof",
    "with_early_frame",
    "with_early_hello",
    "with_early_proof",
    "join_proof",
    "encode_frame",
    "recv_go",
    "recv_frame",
    "send_frame",
    "send_now",
    "server_handshake",
    "server_greet_now",
    "server_join_now",
    "server_answer_now",
    "server_early_now",
    "same_host",
    "sock_endpoint",
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
# Ends the metadata a "data" client asked for: sent only once the server's
# engine holds the connection as the metadata was (nothing the metadata names
# was deregistered meanwhile), so a region deregistered later is revoked on it.
# A server that cannot vouch for that closes the connection instead.
META_GO = b"\x01"
# v2: the order of protocol version 4 (the server speaks first); a proof
# made for the old order never passes for the new one.
_SERVER_CTX = b"aioxfer-server-v2\x00"
_CLIENT_CTX = b"aioxfer-client-v2\x00"
_JOIN_CTX = b"aioxfer-join-v2\x00"
_EARLY_CTX = b"aioxfer-early-v1\x00"
# An early proof's timestamp (the client's time.time_ns()) is taken within
# this of the server's clock, either way: one host, one clock, so only the
# time between the client's Hello and the server's accept counts; past it
# (a loaded host, a clock stepped meanwhile) the Proof round is all it costs.
EARLY_WINDOW_NS = 5 * 10**9
# Early nonces a server remembers (each until its timestamp + the window):
# while that many are live no early proof is taken (the Proof round).
EARLY_CACHE = 4096

_T = TypeVar("_T")
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
        # (escaped: msgspec quotes a bad value, e.g. an unknown tag, raw, and
        # a peer's control characters would reach our exceptions' text)
        raise ProtocolError(f"malformed frame: {escape(str(exc))}") from None
    except RecursionError:  # msgpack nested deeper than the interpreter allows
        raise ProtocolError("malformed frame: nested too deeply") from None


# How long a client's handshake polls a same-host peer's socket for its next
# frame before it waits in the loop (handshake_spin_ns, _spin_recv_into).
HANDSHAKE_SPIN_NS = 1_000_000


def handshake_spin_ns(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> int:
    """The bound of a client's polls for a handshake frame on sock
    (_spin_recv_into), ns: HANDSHAKE_SPIN_NS for a peer on this host (a unix
    socket; tcp to a loopback address or to our own), on asyncio's own loops
    (whose ready queue says whether anything else waits); else 0.

    Why: the peer answers in ~0.1-0.3 ms; a loop asleep in epoll meanwhile
    is woken by its answer, and an idle vCPU of a VM (haltpoll, no guest
    polling) takes tens to hundreds of microseconds to wake: two or three
    such wake-ups are on a connect's way (the Challenge, the Accept, the
    metadata). Measured (cx31, connect_phases, 2 shared AMD vCPUs, fresh
    initiators interleaved with main's build): tcp connect + first 4 KiB
    write 1.72 -> 1.59 ms (n=21, 15 of 21 pairs faster; the handshake 0.85
    -> 0.64 ms) for ~0.15 ms more of the loop thread's CPU; same host (shm)
    3.96 -> 3.80 ms (n=15; the handshake 0.54 -> 0.46 ms). Over a network
    the round trip is long beside a wake-up, so nothing is polled there;
    the server polls only in its accepting step (server_answer_now), under
    a budget (serving._SPIN_SHARE: a client that never answers makes it
    poll for nothing, once per connection)."""
    if getattr(loop, "_ready", None) is None:
        return 0
    try:
        if sock.family == socket.AF_UNIX:
            return HANDSHAKE_SPIN_NS
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return 0
        host = sock.getpeername()[0]
        # (The kernel's own spelling of the address: a loopback one is told
        # by its prefix; ipaddress's parse cost ~0.03 ms on a woken vCPU, on
        # the accepting step's way, cxs32.)
        if host.startswith(_LOOPBACK_PREFIXES) or host == "::1":
            return HANDSHAKE_SPIN_NS
        return HANDSHAKE_SPIN_NS if sock.getsockname()[0] == host else 0
    except OSError:
        return 0


# IPv4 loopback (127.0.0.0/8) as getpeername writes it, also IPv4-mapped in IPv6.
_LOOPBACK_PREFIXES = ("127.", "::ffff:127.")


def _others_ready(ready: Collection[asyncio.Handle]) -> bool:
    """Whether asyncio's ready queue (loop._ready) holds a callback that
    will run: a handle cancelled after it fell due stays there until the
    loop pops and skips it (a timer of an agent closed meanwhile, tgt36:
    seen on all 7 of a connect's handshake reads, each then waited for in
    the loop: ~0.07 ms more on tcp's). A callback another thread adds
    while we look (call_soon_threadsafe) counts as ready."""
    if not ready:
        return False
    try:
        for handle in ready:
            if not handle.cancelled():
                return True
    except RuntimeError:  # (the deque changed under us: another thread added one)
        return True
    return False


def _spin_recv_into(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, bound_ns: int
) -> int:
    """Bytes read into view by polling the non-blocking sock for up to
    bound_ns, this thread's CPU yielded between polls (the peer may need
    it); -1: none came, or the loop has other callbacks ready (they run
    first: the caller waits in the loop; cancelled ones never run:
    _others_ready). 0: the peer closed."""
    ready = getattr(loop, "_ready", None)
    if ready is None or _others_ready(ready):
        return -1
    deadline = time.monotonic_ns() + bound_ns
    while True:
        try:
            return sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            pass
        if time.monotonic_ns() >= deadline:
            return -1
        os.sched_yield()


async def recv_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, *, spin_ns: int = 0
) -> bytearray:
    """Exactly n bytes, never more (asks the kernel only for what is missing).
    spin_ns: first polled for that long (_spin_recv_into; client side)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = _spin_recv_into(loop, sock, view[got:], spin_ns) if spin_ns else -1
        if k < 0:
            k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes of a frame")
        got += k
    return buf


class OtherVersion(ProtocolError):
    """A handshake frame none of ours decodes, from a peer that names
    another protocol version in it (``version``): a version whose frames
    changed shape is named, not reported as a malformed frame."""

    def __init__(self, version: int, detail: str) -> None:
        super().__init__(detail)
        self.version = version


def _other_version(body: bytes | bytearray | memoryview) -> int | None:
    """The "version" field of a frame that did not decode as one of ours,
    read leniently (any msgpack map), when it names a version other than
    ours; else None. Only on that failure path: a handshake frame is at
    most MAX_HANDSHAKE_FRAME bytes, so this costs the good path nothing."""
    try:
        obj = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    v = obj.get("version") if isinstance(obj, dict) else None
    if isinstance(v, int) and not isinstance(v, bool) and v != PROTOCOL_VERSION:
        return v
    return None


async def recv_frame(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    max_frame: int = MAX_FRAME,
    *,
    versioned: bool = False,
    spin_ns: int = 0,
) -> Frame:
    """One frame. versioned (the first frame of a handshake, either side):
    one that does not decode but names another protocol version raises
    OtherVersion. spin_ns: see recv_exact."""
    head = await recv_exact(loop, sock, 4, spin_ns=spin_ns)
    n = int.from_bytes(head, "big")
    if n == 0 or n > max_frame:
        raise FrameTooLarge(f"frame length {n} is outside 1..{max_frame}")
    body = await recv_exact(loop, sock, n, spin_ns=spin_ns)
    try:
        return decode_body(body)
    except ProtocolError as exc:
        v = _other_version(body) if versioned else None
        if v is None:
            raise
        raise OtherVersion(v, str(exc)) from None


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


async def recv_go(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, *, spin_ns: int = 0
) -> None:
    """Client: the META_GO that ends the metadata of a "data" connection.
    spin_ns: see recv_exact."""
    try:
        go = await recv_exact(loop, sock, 1, spin_ns=spin_ns)
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


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """Accept.proof: over the client's nonce (fresh: no recorded Accept
    answers it) and ours (binds it to this connection's Challenge)."""
    return hmac.digest(token, _SERVER_CTX + client_nonce + server_nonce, "sha256")


def server_proof_begun(token: bytes, client_nonce: bytes) -> hmac.HMAC:
    """server_proof's HMAC over all but the server's nonce: updated with
    it, its digest is server_proof(token, client_nonce, server_nonce)."""
    return hmac.new(token, _SERVER_CTX + client_nonce, "sha256")


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, name: str) -> bytes:
    return hmac.digest(token, _CLIENT_CTX + server_nonce + client_nonce + name.encode(),
                       "sha256")


def join_proof(token: bytes, join: bytes, index: int, client_nonce: bytes, name: str) -> bytes:
    """A joining connection's proof (see the module docstring); join and
    client_nonce are NONCE_BYTES long, index one byte."""
    return hmac.digest(
        token, _JOIN_CTX + join + bytes((index,)) + client_nonce + name.encode(), "sha256"
    )


def _net_scope() -> str:
    """Which loopback this process's tcp reaches: the kernel's boot id and
    our network namespace (its nsfs device and inode). Read once, at
    import: a process that moves to another namespace afterwards only
    makes early proofs no server takes (the Proof round)."""
    boot = ns = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    try:
        st = os.stat("/proc/self/ns/net")
        ns = f"{st.st_dev}.{st.st_ino}"
    except OSError:
        pass
    return f"{boot}/{ns}"


# An IP endpoint's scope in sock_endpoint (see there).
_NET_SCOPE = _net_scope()


def sock_endpoint(addr: object) -> str | bytes:
    """A socket address as both ends of a connection name it: the server's
    getsockname() of the accepted socket, the client's getpeername() (a unix
    socket's path or abstract name as it is; an IP's host:port, an
    IPv4-mapped IPv6 host as the IPv4 one, no flow or scope, then "@" and
    this host's boot id and network namespace, _NET_SCOPE).

    Why the scope: "127.0.0.1:P" names a different listener on every host
    (and in every namespace). A client that dials a loopback port which
    forwards to another host (socat, a port-forward) makes an early proof
    whose Hello crosses a network; recorded there, it would be a proof at
    127.0.0.1:P of any host sharing the token, over the loopback tcp any
    local user may dial (rv34). Both ends of a loopback connection share
    boot and namespace, so this costs a true same-host client nothing. A
    unix path needs none: it reaches no other host, and a unix listener
    admits only our uid (also from another namespace sharing the path)."""
    if isinstance(addr, str | bytes):
        return addr
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0]).partition("%")[0]
        if host.startswith("::ffff:") and "." in host:
            host = host[7:]
        return f"{host}:{addr[1]}@{_NET_SCOPE}"
    return repr(addr)


def same_host(addr: object) -> bool:
    """Whether the other end at addr (a getpeername() or accept() address)
    is on this host by what the kernel routes: a unix socket's peer, or a
    loopback IP (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104, told by the
    kernel's spelling, as handshake_spin_ns). Anything else, this host's own
    non-loopback addresses included, is not."""
    if isinstance(addr, str | bytes):
        return True  # AF_UNIX (an unnamed client socket's address is "")
    if not (isinstance(addr, tuple) and len(addr) >= 2 and isinstance(addr[0], str)):
        return False
    host = addr[0]
    return host.startswith(_LOOPBACK_PREFIXES) or host == "::1"


def early_proof(token: bytes, hello: Hello, here: str | bytes) -> bytes:
    """Hello.early_proof: over every field of hello but itself (early_ts
    included) and ``here``, the server's address (sock_endpoint): a Hello
    made for one listener is no proof at another (a network address's
    Hello none at a loopback one, a squatter's port none at ours)."""
    return _early_mac(token, hello, hello.early_ts, here)


def _early_mac(token: bytes, hello: Hello, ts: int, here: str | bytes) -> bytes:
    """early_proof of hello with its early_ts being ts (with_early_proof
    makes both in one replace)."""
    body = _encoder.encode((
        hello.version, hello.name, hello.incarnation, hello.purpose, hello.nonce,
        hello.byteorder, hello.meta, hello.accept_only, hello.joins, hello.join,
        hello.join_index, hello.join_proof, ts, here,
    ))
    return hmac.digest(token, _EARLY_CTX + body, "sha256")


def early_mac_head(token: bytes | None, hello: Hello) -> hmac.HMAC | None:
    """The HMAC of hello's early proof begun ahead (a Hello made ahead,
    dialing.Dialer.prepare_hello): over the context and every field of
    _early_mac's body but the last two (early_ts, the server's address,
    known only as it is sent: _early_finish). None where hello carries no
    early proof (no token, a join, a kind that may not: _early_kind).

    Why: the one-shot hmac.digest on a fresh process's first connect ran
    ~30-45 us (OpenSSL's digest looked up, its key schedule, cold code),
    ~5 us warm; the copy of a keyed HMAC, its update and digest ~8 us cold.
    The body is the same bytes: msgpack writes a tuple as its array header
    followed by each element's encoding, so the 14-tuple's encoding is a
    14-element header, the first 12 fields' encodings, then those of the
    last two (a test checks the MAC equals the one-shot's)."""
    if token is None or hello.join or not _early_kind(hello.purpose, hello.accept_only):
        return None
    head = _encoder.encode((
        hello.version, hello.name, hello.incarnation, hello.purpose, hello.nonce,
        hello.byteorder, hello.meta, hello.accept_only, hello.joins, hello.join,
        hello.join_index, hello.join_proof,
    ))
    # (a fixarray's header is 0x90 | n: both 12 and 14 are under 16)
    return hmac.new(token, _EARLY_CTX + bytes((0x90 | 14,)) + head[1:], "sha256")


# How a Hello's frame ends when it carries an early proof (its last two
# fields: msgspec writes a struct's fields in their order): "early_ts", a
# uint64 (0xcf: any time.time_ns() since 1970 + 4.3 s), "early_proof", 32 bytes.
_EARLY_TS_KEY = b"\xa8early_ts\xcf"
_EARLY_PROOF_KEY = b"\xabearly_proof\xc4\x20"


class EarlyAhead:
    """A Hello made ahead's early proof, as far as it goes before the
    Hello is sent (dialing.Dialer.prepare_hello): the HMAC begun
    (early_mac_head) and the Hello's frame around the two fields the send
    fills in (head: up to the time; mid: between the time and the proof).
    stamp() is then the frame as encode_frame writes the Hello with both
    (no replace, no encode on the connect's way: ~15 us on a fresh
    process, ep34)."""

    __slots__ = ("mac", "head", "mid")

    def __init__(self, mac: hmac.HMAC, head: bytes, mid: bytes) -> None:
        self.mac = mac
        self.head = head
        self.mid = mid

    def stamp(self, here: str | bytes) -> bytes:
        """The Hello's frame with early_ts now and its early proof for the
        server at here."""
        ts = time.time_ns()
        return self.head + ts.to_bytes(8, "big") + self.mid + _early_finish(self.mac, ts, here)


def early_ahead(token: bytes | None, hello: Hello) -> EarlyAhead | None:
    """hello's EarlyAhead; None where it carries no early proof
    (early_mac_head) or its frame is not laid out as stamp() writes it."""
    mac = early_mac_head(token, hello)
    if mac is None:
        return None
    frame = encode_frame(msgspec.structs.replace(hello, early_ts=1 << 63,
                                                 early_proof=bytes(32)))
    tail = _EARLY_TS_KEY + (1 << 63).to_bytes(8, "big") + _EARLY_PROOF_KEY + bytes(32)
    if not frame.endswith(tail):
        return None  # (with_early_hello then replaces and encodes)
    n = len(frame) - len(tail) + len(_EARLY_TS_KEY)
    return EarlyAhead(mac, frame[:n], _EARLY_PROOF_KEY)


def _early_finish(mac: hmac.HMAC, ts: int, here: str | bytes) -> bytes:
    """The early proof of the Hello whose early_mac_head mac is, with its
    early_ts being ts, for the server at here (_early_mac's value)."""
    h = mac.copy()
    h.update(_encoder.encode((ts, here))[1:])  # (their encodings, the 2-array's header off)
    return h.digest()


def with_early_proof(hello: Hello, sock: socket.socket, token: bytes | None) -> Hello:
    """hello as it goes on sock (connected): with an early proof (early_ts
    now) when it qualifies, as _hello(to=sock) decides: a token, a first
    "data" Hello or accept_only "meta" probe (no join), to a server on
    this host by the address sock is connected to (_early_target); else
    hello as it is. Its nonce is kept: for a Hello made ahead of its
    socket (dialing.Dialer.prepare_hello), stamped and proved as it is
    sent (the server's address and clock are only known then)."""
    here = None if token is None else _early_target(sock)
    return hello if here is None or token is None else _stamped(hello, token, here)


def _stamped(hello: Hello, token: bytes, here: str | bytes) -> Hello:
    """hello with an early proof for the server at here, if its kind may
    carry one (_early_kind, no join); else hello."""
    if not _early_kind(hello.purpose, hello.accept_only) or hello.join:
        return hello
    ts = time.time_ns()
    return msgspec.structs.replace(hello, early_ts=ts,
                                   early_proof=_early_mac(token, hello, ts, here))


def with_early_frame(frame: bytes, sock: socket.socket, token: bytes | None) -> bytes:
    """with_early_proof of a Hello made ahead as a frame (encode_frame):
    that frame itself where nothing is added (no token, or sock's peer not
    on this host: looked at before the frame is decoded)."""
    here = None if token is None else _early_target(sock)
    if here is None or token is None:
        return frame
    hello = decode_body(memoryview(frame)[4:])
    if not isinstance(hello, Hello):
        raise TypeError(f"not a Hello: {type(hello).__name__}")
    early = _stamped(hello, token, here)
    return frame if early is hello else encode_frame(early)


def with_early_hello(
    hello: Hello, frame: bytes, sock: socket.socket, token: bytes | None,
    ahead: EarlyAhead | None = None, here: str | bytes | None = None,
) -> bytes:
    """with_early_frame of a Hello made ahead whose struct was kept beside
    its frame (frame: encode_frame(hello)): nothing decoded (~0.01-0.02 ms
    of the stamp's ~0.1 ms on a fresh process's first connect, ed33).
    ahead: its early_ahead(token, hello), made ahead too: the proof is then
    that HMAC's copy finished (~8 us cold instead of a one-shot's ~30-45)
    and the frame filled in, not encoded again. here: the server's address
    as _early_target(sock) names it, known ahead (early_target_of the
    address sock was connected to); None: sock is asked."""
    if here is None and token is not None:
        here = _early_target(sock)
    if here is None or token is None:
        return frame
    if ahead is None:
        early = _stamped(hello, token, here)
        return frame if early is hello else encode_frame(early)
    return ahead.stamp(here)


def _early_kind(purpose: str, accept_only: bool) -> bool:
    """Whether a first Hello of this purpose may carry an early proof: a
    "data" one, or an accept_only "meta" probe (never verbs, nor a
    metadata fetch, which the server serves only after a Proof round)."""
    return purpose == "data" or (purpose == "meta" and accept_only)


class EarlyProofs:
    """Server side: which early proofs are taken (see the module docstring).

    One per listening agent, made as it starts listening (``start_ns``, its
    time.time_ns()). A Hello's early proof is taken only when its timestamp
    is not before ``start_ns`` (a Hello made for an earlier agent at this
    address is no proof to this one), within ``window_ns`` of now either way,
    its MAC verifies, and its nonce was never taken before: every taken nonce
    is kept until its timestamp + the window, when the timestamp alone
    refuses it. At most ``cap`` are kept: while that many are live no early
    proof is taken (the Proof round, never a Reject). The caller decides that
    the peer is on this host, from its socket.

    token: the listener's (its key, as the agent holds it): the HMACs of
    the early proof and of the Accept's proof are begun with it here, once
    (_macs), and each check or proof is a copy of one finished: on the
    accepting step's way a one-shot hmac.digest ran ~0.05-0.06 ms in an
    idle target (connect_phases, T.early_mac; its caches gone cold between
    connects), a copy finished ~0.025 (a one-shot ~0.043 with the caches
    evicted, ep34). The same MACs: a test checks them against the
    one-shots."""

    __slots__ = ("start_ns", "_window", "_cap", "_seen", "taken", "_macs")

    def __init__(
        self, *, start_ns: int | None = None, window_ns: int = EARLY_WINDOW_NS,
        cap: int = EARLY_CACHE, token: bytes | None = None,
    ) -> None:
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self._window = window_ns
        self._cap = max(1, cap)
        self._seen: dict[bytes, int] = {}  # nonce -> until (ns, time.time_ns)
        self.taken = 0  # early proofs taken (tests, statistics)
        # (token, the early proof's HMAC begun over its context, the
        # Accept's over its context), for the token take() was last given
        self._macs: tuple[bytes, hmac.HMAC, hmac.HMAC] | None = None
        if token is not None:
            self._macs_for(token)

    def _macs_for(self, token: bytes) -> tuple[bytes, hmac.HMAC, hmac.HMAC]:
        macs = self._macs
        if macs is None or not hmac.compare_digest(macs[0], token):
            macs = self._macs = (token, hmac.new(token, _EARLY_CTX, "sha256"),
                                 hmac.new(token, _SERVER_CTX, "sha256"))
        return macs

    def proof_of(self, hello: Hello, token: bytes, here: str | bytes) -> bytes:
        """early_proof(token, hello, here), from the HMAC begun ahead."""
        h = self._macs_for(token)[1].copy()
        h.update(_encoder.encode((
            hello.version, hello.name, hello.incarnation, hello.purpose, hello.nonce,
            hello.byteorder, hello.meta, hello.accept_only, hello.joins, hello.join,
            hello.join_index, hello.join_proof, hello.early_ts, here,
        )))
        return h.digest()

    def server_proof(self, token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
        """server_proof(token, client_nonce, server_nonce), from the HMAC
        begun ahead (the proved Accept of an early Hello taken)."""
        h = self._macs_for(token)[2].copy()
        h.update(client_nonce + server_nonce)
        return h.digest()

    def __len__(self) -> int:
        return len(self._seen)

    def take(self, hello: Hello, token: bytes, here: str | bytes) -> bool:
        """Whether hello's early proof is taken (its nonce is then spent)."""
        now = time.time_ns()
        ts = hello.early_ts
        if (
            not hello.early_proof
            or ts < self.start_ns
            or abs(ts - now) > self._window
            or len(hello.nonce) != NONCE_BYTES
            or hello.join
        ):
            return False
        if not hmac.compare_digest(hello.early_proof, self.proof_of(hello, token, here)):
            return False
        seen = self._seen
        if hello.nonce in seen:
            return False  # replayed (its timestamp still in the window)
        if len(seen) >= self._cap:
            for nonce in [n for n, until in seen.items() if until < now]:
                del seen[nonce]
            if len(seen) >= self._cap:
                return False
        seen[hello.nonce] = ts + self._window
        self.taken += 1
        return True


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

    The Challenge of a connection whose "data" (or accept_only "meta")
    Hello asks for ``joins`` is granted here once that Hello is read: for
    ``ttl`` seconds, each join_index 1..joins
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


# The most of a server's Reject reason that its AccessDenied (and so every log
# line naming it) carries.
_REASON_CHARS = 200


def _refused(reason: str) -> AccessDenied:
    """The AccessDenied of a server's Reject. Its reason is the server's text
    (up to 1024 characters, newlines, terminal escapes and bidi controls
    included): shown escaped (repr) and cut to _REASON_CHARS, so that a
    hostile server can neither forge log lines nor flood them through it."""
    more = len(reason) - _REASON_CHARS
    cut = f" (and {more} more characters)" if more > 0 else ""
    return AccessDenied(f"peer refused the connection: {reason[:_REASON_CHARS]!r}{cut}")


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
    to: socket.socket | None = None,
) -> tuple[bytes, bytes]:
    """A client's Hello (a fresh nonce) as a frame; returns (nonce, frame).
    to: the connected socket it goes on: a first "data" Hello or accept_only
    "meta" probe with a token to a server on this host by the address it
    is connected to (_early_target) carries an early proof bound to that
    address (see the module docstring)."""
    hello = _hello_msg(name=name, incarnation=incarnation, purpose=purpose, token=token,
                       meta=meta, accept_only=accept_only, joins=joins, join=join, to=to)
    return hello.nonce, encode_frame(hello)


def _hello_msg(
    *,
    name: str,
    incarnation: int,
    purpose: Purpose,
    token: bytes | None,
    meta: bool = False,
    accept_only: bool = False,
    joins: int = 0,
    join: tuple[bytes, int] | None = None,
    to: socket.socket | None = None,
) -> Hello:
    """_hello's Hello as a struct (a Hello made ahead keeps it beside its
    frame: dialing.Dialer.prepare_hello, with_early_hello)."""
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
    elif to is not None:
        hello = with_early_proof(hello, to, token)
    return hello


def early_target_of(peer: object) -> str | bytes | None:
    """_early_target of a socket connected to peer, known before it is
    (made ahead by its dialer, per address): peer is the address given to
    its connect as the kernel names it (getpeername's value: a numeric IP's
    sockaddr as getaddrinfo gives it; a unix socket's name as its listener
    bound it). The server's getsockname() decides: a name written another
    way (a unix path relative here, absolute there) is no proof at the
    server (the Proof round follows), never one for another server.

    Why: getpeername, the loopback check and the format ran ~17-23 us on a
    fresh process's first connect, on its way before the Hello leaves
    (tgt36, ~5 us warm)."""
    return sock_endpoint(peer) if same_host(peer) else None


def _early_target(sock: socket.socket) -> str | bytes | None:
    """The server's address for an early proof, when sock's peer is on this
    host by the address we are connected to (same_host); else None (no
    early proof: another host's clock, and a network that can record a
    Hello to replay it, SECURITY.md)."""
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    return early_target_of(peer)


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


def _check_challenge(msg: Frame, token: bytes | None) -> bytes:
    """The server's first frame: its nonce, once it is one we can answer."""
    if isinstance(msg, Reject):
        # (A server of protocol version 3 or older reads our Hello first and
        # answers this, naming the version.)
        raise _refused(msg.reason)
    if not isinstance(msg, Challenge):
        raise _unexpected(msg, "Challenge")
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks protocol version {msg.version}, this agent {PROTOCOL_VERSION}"
        )
    if token is None:
        if msg.nonce:
            raise AccessDenied("peer requires a token and this agent has none")
    elif not msg.nonce:
        raise AccessDenied("peer does not authenticate with a token, but this agent requires one")
    elif len(msg.nonce) != NONCE_BYTES:
        raise ProtocolError(f"challenge nonce must be {NONCE_BYTES} bytes")
    return msg.nonce


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
    spin_ns: int,
) -> Accept:
    """See client_handshake."""
    if token is None or not (purpose == "data" or accept_only):
        joins = 0
    if token is None or purpose != "data":
        join = None
    if sent is None:
        nonce, frame = _hello(name=name, incarnation=incarnation, purpose=purpose, token=token,
                              meta=meta, accept_only=accept_only, joins=joins, join=join,
                              to=sock)
        # The Hello goes at once, not after the server's Challenge: a server
        # of an older version, which waits for it, answers with a Reject
        # naming the version instead of both sides waiting; and our Proof
        # is then all that is left to send when the Challenge comes.
        await loop.sock_sendall(sock, frame)
    else:  # client_join_now sent (the first part of) it
        nonce, rest = sent
        if rest:
            await loop.sock_sendall(sock, rest)
    # The HMAC of the Accept's proof we check, begun while the server works
    # on our Hello (server_proof_begun): its setup (~0.02-0.04 ms with the
    # caches cold) was on the connect's way after the Accept came.
    accept_mac = None if token is None else server_proof_begun(token, nonce)
    try:
        first = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME, versioned=True,
                                 spin_ns=spin_ns)
    except OtherVersion as exc:
        # (e.g. a Challenge of a later version that changed shape: its
        # version named, as _check_challenge names that of one we decode)
        raise ProtocolError(
            f"peer speaks protocol version {exc.version}, this agent {PROTOCOL_VERSION}"
        ) from None
    server_nonce = _check_challenge(first, token)
    msg: Frame | None = None
    if token is not None:
        if join is not None or (isinstance(first, Challenge) and first.early):
            # Joined, or our early proof taken (the server says so in its
            # Challenge, which an Accept follows): the Accept comes at once;
            # a join not honoured: the Challenge again, and we prove the
            # token as a first connection does. (Whatever the Challenge
            # says, the Accept's proof below is checked before anything
            # of it is used: a server without the token makes none.)
            msg = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME, spin_ns=spin_ns)
            if isinstance(msg, Challenge):
                if msg.nonce != server_nonce:
                    raise ProtocolError("peer changed its challenge")
                msg = None
        if msg is None:
            # Our proof goes out before the server proved itself (in its
            # Accept): one round trip instead of two. What a server without
            # the token gets is an HMAC over the nonce it chose, which it can
            # only relay to the real server (SECURITY.md: "The order").
            await loop.sock_sendall(
                sock, encode_frame(Proof(proof=client_proof(token, server_nonce, nonce, name)))
            )
            msg = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME, spin_ns=spin_ns)
        elif join is not None:
            joins = 0  # (joined: nothing of ours to join)
    else:
        msg = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME, spin_ns=spin_ns)
    if isinstance(msg, Reject):
        raise _refused(msg.reason)
    if not isinstance(msg, Accept):
        raise _unexpected(msg, "Accept")
    # Before anything of the Accept (or the metadata and memfds after it) is
    # used: the server proves it knows the token, over our fresh nonce.
    if accept_mac is not None:
        accept_mac.update(server_nonce)
        if not hmac.compare_digest(msg.proof, accept_mac.digest()):
            raise AccessDenied("peer failed to prove it knows the token")
    if on_challenge is not None and joins:
        # Our other connections may join its Challenge now: their join
        # proofs go only to a server that proved the token.
        on_challenge(server_nonce)
    return msg


def _check_hello(hello: Frame) -> Hello:
    """The checks every Hello passes before anything else (ProtocolError:
    malformed; the version and byte order are answered by _server_handshake)."""
    if not isinstance(hello, Hello):
        raise _unexpected(hello, "Hello")
    if not hello.name or len(hello.name) > MAX_NAME:
        raise ProtocolError(f"agent name must be 1..{MAX_NAME} characters")
    if len(hello.nonce) != NONCE_BYTES:
        raise ProtocolError(f"hello nonce must be {NONCE_BYTES} bytes, not {len(hello.nonce)}")
    if not 0 <= hello.incarnation < 1 << 64:
        raise ProtocolError("incarnation must be an unsigned 64-bit integer")
    return hello


async def _server_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    token: bytes | None,
    accept: Accept,
    joins: Joins | None,
    nonce: bytes | None,
    refuse: Callable[[], str | None] | None,
) -> Hello:
    """See server_handshake."""
    if nonce is None:
        nonce = server_greet_now(sock, token=token)
    try:
        hello = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME, versioned=True)
    except OtherVersion as exc:  # a Hello of another version that changed shape
        await _refuse_version(loop, sock, exc.version)
    if isinstance(hello, Hello) and hello.version != PROTOCOL_VERSION:
        await _refuse_version(loop, sock, hello.version)
    hello = _check_hello(hello)
    if hello.purpose in ("data", "verbs") and hello.byteorder != sys.byteorder:
        await _reject(loop, sock, f"byte order {hello.byteorder} is not {sys.byteorder}")
        raise ProtocolError(f"client byte order {hello.byteorder} is not {sys.byteorder}")
    if hello.meta and hello.purpose == "data":
        accept = msgspec.structs.replace(accept, meta=True)  # the caller sends it
    if token is None:
        await _refuse(loop, sock, refuse)
        await send_frame(loop, sock, accept)
        return hello
    if hello.join:
        if hello.purpose == "data" and joins is not None and joins.take(hello, token):
            # Authenticated by its join proof: no Proof round.
            await _refuse(loop, sock, refuse)
            await send_frame(loop, sock, _proved(accept, token, hello.nonce, nonce))
            return hello
        # Not honoured (replayed, forged, expired, another name): it proves
        # the token over our nonce after all.
        await send_frame(loop, sock, Challenge(version=PROTOCOL_VERSION, nonce=nonce))
    granted = _grant(hello, nonce, joins)
    try:
        try:
            answer = await recv_frame(loop, sock, MAX_HANDSHAKE_FRAME)
        except ProtocolError as exc:
            raise HandshakeRejected(
                f"agent {hello.name!r} did not authenticate (no or wrong token?): {exc}"
            ) from None
        if not isinstance(answer, Proof):
            raise _unexpected(answer, "Proof")
        if not hmac.compare_digest(answer.proof, client_proof(token, nonce, hello.nonce,
                                                              hello.name)):
            await _reject(loop, sock, "bad token")
            raise HandshakeRejected(f"agent {hello.name!r} failed token authentication")
    except BaseException:
        if granted and joins is not None:
            joins.revoke(nonce)  # a client that did not prove the token joins nothing
        raise
    await _refuse(loop, sock, refuse)
    await send_frame(loop, sock, _proved(accept, token, hello.nonce, nonce))
    return hello


async def _refuse_version(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, version: int
) -> NoReturn:
    """A client of another protocol version: a Reject naming both (its
    agent raises AccessDenied with it), then ProtocolError here."""
    await _reject(loop, sock, f"protocol version {version} is not {PROTOCOL_VERSION}")
    raise ProtocolError(f"client speaks protocol version {version}")


async def _refuse(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, refuse: Callable[[], str | None] | None
) -> None:
    """Right before the Accept: a Reject instead, when refuse() says why."""
    reason = None if refuse is None else refuse()
    if reason is not None:
        await _reject(loop, sock, reason)
        raise HandshakeRejected(reason)


def _proved(accept: Accept, token: bytes, client_nonce: bytes, nonce: bytes) -> Accept:
    return msgspec.structs.replace(accept, proof=server_proof(token, client_nonce, nonce))


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


def challenge(token: bytes | None) -> tuple[bytes, bytes]:
    """A Challenge with a fresh nonce (none without a token), and its frame."""
    nonce = secrets.token_bytes(NONCE_BYTES) if token is not None else b""
    return nonce, encode_frame(Challenge(version=PROTOCOL_VERSION, nonce=nonce))


def early_challenge() -> tuple[bytes, bytes]:
    """An early answer's Challenge (``early``) with a fresh nonce, and its
    frame: server_early_now's own, or one made ahead (serving.Server, after
    an accepting step) and used for one connection only."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, encode_frame(Challenge(version=PROTOCOL_VERSION, nonce=nonce, early=True))


# Where AcceptAhead's frames end: the proof, a 32-byte bin (msgspec writes a
# struct's fields in their order, and Accept.proof is its last).
_PROOF_TAIL = b"\xa5proof\xc4\x20"


class AcceptAhead:
    """A server's proved Accept as frames made ahead (one per listening
    agent: its Accept is fixed), up to the proof, for meta False and True:
    frame(meta, proof) is encode_frame of the Accept with both, without a
    replace (whose __post_init__ checks the name again) or an encode on the
    accepting step's way. Where the layout differs (a test checks it does
    not), frame() replaces and encodes."""

    __slots__ = ("accept", "_heads")

    def __init__(self, accept: Accept) -> None:
        self.accept = accept
        mark = b"\xa5" * 32  # (any 32 bytes: the length prefix counts them)
        heads: list[bytes | None] = []
        for meta in (False, True):
            frame = encode_frame(msgspec.structs.replace(accept, meta=meta, proof=mark))
            ok = frame.endswith(_PROOF_TAIL + mark)
            heads.append(frame[:-32] if ok else None)
        self._heads = heads

    def frame(self, meta: bool, proof: bytes) -> bytes:
        head = self._heads[meta]
        if head is None or len(proof) != 32:
            return encode_frame(msgspec.structs.replace(self.accept, meta=meta, proof=proof))
        return head + proof


def server_greet_now(
    sock: socket.socket, *, token: bytes | None, made: tuple[bytes, bytes] | None = None
) -> bytes:
    """Server side, at once (no await), as the connection is accepted and
    before a byte of it is read: our Challenge (a fresh nonce with a token,
    none without; made: one challenge() made ahead, used for this
    connection only). Returns the nonce, for server_handshake. OSError: the
    socket broke; ProtocolError: the Challenge did not fit (a few dozen
    bytes into an empty send buffer fit otherwise); the caller closes it."""
    nonce, frame = made if made is not None else challenge(token)
    if send_now(sock, frame) < len(frame):  # (OSError: broken, as it is)
        raise ProtocolError("the Challenge did not fit an empty send buffer")
    return nonce


def _peeked(sock: socket.socket) -> bytes | None:
    """What waits in the socket, up to a handshake frame, peeked (nothing
    read); None when nothing does yet or the socket broke (server_handshake
    meets either)."""
    try:
        return sock.recv(4 + MAX_HANDSHAKE_FRAME, socket.MSG_PEEK)
    except OSError:
        return None


# (_peeked, for the accepting step: serving.Server._join_now hands its peek on)
peek_now = _peeked


def hello_peek_now(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, spin_ns: int
) -> bytes | None:
    """Server side, at once (no await), as a same-host connection is
    accepted and before our Challenge: whether a whole first frame waits
    in the non-blocking sock (peeked, nothing read: what was peeked, for
    server_early_now's ``peeked``), or the peer closed (b""), polled for up
    to spin_ns (this thread's CPU yielded between polls); the poll stops as
    soon as the loop has other callbacks ready. None: none came in time (or
    the loop had other work: asyncio's own loops only).

    Why: a unix socket's accept is ready at the client's connect, before
    its Hello is sent (no TCP_DEFER_ACCEPT there), and an early Hello that
    lands after the ordinary Challenge went out costs the Proof round
    (ep33: 2 of 15 shm connects, 2.2-2.7 ms instead of ~1.8). The caller
    bounds spin_ns (a client that never sends makes us poll for nothing,
    once per connection: serving._SPIN_SHARE)."""
    ready = getattr(loop, "_ready", None)
    deadline = 0
    while True:
        got = _peeked(sock)
        if got is not None and (not got or _whole_frame(got)):
            return got
        if ready is None or spin_ns <= 0 or _others_ready(ready):
            return None
        now = time.monotonic_ns()
        if not deadline:
            deadline = now + spin_ns
        elif now >= deadline:
            return None
        os.sched_yield()


def _whole_frame(peeked: bytes) -> int:
    """The length of the frame ``peeked`` starts with when all of it (a
    non-empty body) is there, else 0."""
    n = int.from_bytes(peeked[:4], "big")
    return n if len(peeked) >= 4 and 0 < n <= len(peeked) - 4 else 0


def _hello_passes(frame: object) -> TypeGuard[Hello]:
    """A Hello passing the checks server_handshake makes of every one
    (version, name, nonce, incarnation): server_join_now takes a peeked
    Hello only then, and leaves any other to server_handshake, which
    answers it (a Reject, an error)."""
    return (
        isinstance(frame, Hello)
        and frame.version == PROTOCOL_VERSION
        and 0 < len(frame.name) <= MAX_NAME
        and len(frame.nonce) == NONCE_BYTES
        and 0 <= frame.incarnation < 1 << 64
    )


# How a Hello that joins nothing encodes its "join" field (the empty default):
# server_join_now leaves such a Hello to server_handshake without decoding it.
_NO_JOIN = b"\xa4join\xc4\x00"


class ClosedSilently(ProtocolError):
    """A connection closed before sending a byte: nothing was asked of us.
    A tcp connect's other connections are dialled early and joined later
    (connector._EarlyConns): an agent closing in between closes them so."""


def server_join_now(
    sock: socket.socket, *, token: bytes | None, accept: Accept, joins: Joins,
    peeked: bytes | None = None,
) -> Hello | None:
    """Server side, at once (no await), as the connection is accepted: a
    "data" connection whose whole Hello already waits in the socket
    (TCP_DEFER_ACCEPT) and joins a live Challenge (see Joins) gets our
    Challenge and its proved Accept in one send, and its Hello is returned.
    Anything else (no token, a partial Hello, not a join, one that asks for
    the metadata, a grant gone or a wrong proof, a send that would block)
    returns None with nothing read or sent: the caller greets it
    (server_greet_now) and runs server_handshake, which reads the same
    Hello. ProtocolError: taken, but the connection broke (the caller
    closes it); ClosedSilently: it closed before a byte came. A join is
    checked by peeking; its bytes are read (exactly the frame: the engine's
    bytes follow) only once it is taken. peeked: the caller's peek of sock
    (_peeked's, nothing read since; None: peeked here)."""
    if token is None:
        return None
    frame = _peeked(sock) if peeked is None else peeked
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
        # (Exactly the frame: all that was peeked made a Hello with anything
        # behind it fail to decode, "trailing characters", and take
        # server_handshake's slower path.)
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
    nonce = secrets.token_bytes(NONCE_BYTES)
    reply = encode_frame(Challenge(version=PROTOCOL_VERSION, nonce=nonce)) + encode_frame(
        _proved(accept, token, hello.nonce, nonce)
    )
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


class _Later:
    """_peek_handshake's answer when the frames may still come (poll again)."""


_LATER = _Later()


def _peek_handshake(
    sock: socket.socket, token: bytes | None, hello: Hello | None
) -> tuple[Hello, memoryview, int] | Hello | _Later | None:
    """What waits in sock (peeked: nothing read), for server_answer_now.
    (hello, proof, n): a Hello that passes every check server_handshake
    makes of one, and, with a token, the body of the frame after it (the
    Proof, unchecked: server_answer_now checks it; empty without a token):
    the two frames are the first n bytes. hello (the argument): that Hello, already
    decoded from an earlier peek (its bytes do not change). A Hello alone
    (with a token): its Proof not whole yet; _LATER: not even the Hello;
    None: anything server_handshake must answer (or a closed, broken
    socket): the caller leaves it to server_handshake."""
    try:
        peeked = sock.recv(2 * (4 + MAX_HANDSHAKE_FRAME), socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return _LATER
    except OSError:
        return None
    if not peeked:
        return None  # closed: server_handshake says so
    if len(peeked) < 4:
        return _LATER
    n = int.from_bytes(peeked[:4], "big")
    if not 0 < n <= MAX_HANDSHAKE_FRAME:
        return None
    if len(peeked) < 4 + n:
        return _LATER
    if hello is None:
        try:
            frame = decode_body(memoryview(peeked)[4 : 4 + n])
        except ProtocolError:
            return None  # (malformed, or another version's: answered there)
        if not (
            _hello_passes(frame)
            and frame.purpose in ("data", "meta")
            and (frame.purpose != "data" or frame.byteorder == sys.byteorder)
            and not frame.join
        ):
            return None
        hello = frame
    if token is None:
        return hello, memoryview(b""), 4 + n
    rest = memoryview(peeked)[4 + n :]
    if len(rest) < 4:
        return hello
    m = int.from_bytes(rest[:4], "big")
    if not 0 < m <= MAX_HANDSHAKE_FRAME:
        return None
    if len(rest) < 4 + m:
        return hello
    return hello, rest[4 : 4 + m], 4 + n + 4 + m


def server_answer_now(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    token: bytes | None,
    accept: Accept,
    joins: Joins | None,
    nonce: bytes,
    refuse: Callable[[], str | None] | None,
    spin_ns: int,
    ahead: Callable[[Hello, bytes], _T],
    polled: Callable[[Hello], bool] | None = None,
) -> tuple[Hello, _T] | None:
    """Server side, at once (no await), right after server_greet_now sent
    our Challenge: the whole handshake of a connection whose Hello (and,
    with a token, Proof) are already in the socket, or come within spin_ns
    of polling it (a same-host client answers our Challenge in ~0.05-0.1
    ms; waiting for it in the loop costs the wake-up of an idle vCPU, and
    the serving task's start and steps ~0.15 ms more, cxs32). Returns the
    Hello and what ahead(hello, accept) made of it and of our proved Accept
    as a frame (Accept.meta set when the Hello asks for the metadata on a
    "data" connection): the caller's whole answer, made while the Proof is
    on its way (nothing of it goes out unless the Proof passes). Both
    frames were read, exactly, and a Hello's Challenge granted to its
    joins; the caller sends the answer. None, nothing read:
    anything else (not whole in time, malformed, another version, a
    "verbs" or joining Hello, a wrong proof, refused): the caller runs
    server_handshake, which reads the same bytes and answers them.

    Every check of server_handshake is made here, in its order, before a
    byte of ours but the Challenge goes out: the Hello's (version, name,
    nonce, incarnation, byte order), then the Proof's HMAC, then refuse().
    The polling (spin_ns > 0) stops as soon as the loop has other callbacks
    ready; the caller bounds spin_ns (a client that never answers makes us
    poll spin_ns for nothing). polled(hello) False: its client is not
    polled for (e.g. an agent of this thread's, which cannot answer while
    we poll)."""
    deadline = 0
    hello: Hello | None = None
    made: tuple[bytes, _T] | None = None
    while True:
        got = _peek_handshake(sock, token, hello)
        if got is None:
            return None
        if hello is None and not isinstance(got, _Later):
            hello = got[0] if isinstance(got, tuple) else got
            if polled is not None and not polled(hello):
                spin_ns = 0
        if not isinstance(got, tuple):
            now = time.monotonic_ns()
            if not deadline:
                ready = getattr(loop, "_ready", None)
                if not spin_ns or ready is None or _others_ready(ready):
                    return None
                deadline = now + spin_ns
            elif now >= deadline:
                return None
        if hello is not None and made is None:  # (once: while its Proof comes, or now)
            made = (
                client_proof(token, nonce, hello.nonce, hello.name) if token is not None
                else b"",
                ahead(hello, _answer(hello, token, accept, nonce)),
            )
        if isinstance(got, tuple):
            break
        os.sched_yield()
    hello, proof, n = got
    assert made is not None
    want, answer = made
    if token is not None:
        try:
            frame = decode_body(proof)
        except ProtocolError:
            return None
        if not isinstance(frame, Proof) or not hmac.compare_digest(frame.proof, want):
            return None  # (server_handshake rejects it, and logs it)
    if refuse is not None and refuse() is not None:
        return None  # (server_handshake sends the Reject)
    try:
        if sock.recv_into(bytearray(n), n) != n:  # the peeked frames, for good
            raise ProtocolError("the handshake's frames shrank between their peek and read")
    except OSError as exc:
        raise ProtocolError(f"connection broken during its handshake: {exc}") from None
    if token is not None:
        _grant(hello, nonce, joins)
    return hello, answer


# How a Hello without an early proof encodes its "early_proof" (the empty
# default): server_early_now leaves such a Hello alone without decoding it.
_NO_EARLY = b"\xabearly_proof\xc4\x00"


def server_early_now(
    sock: socket.socket,
    *,
    token: bytes | None,
    accept: Accept,
    early: EarlyProofs,
    joins: Joins | None,
    refuse: Callable[[], str | None] | None,
    ahead: Callable[[Hello, bytes], _T],
    peeked: bytes | None = None,
    here: str | bytes | None = None,
    made: Callable[[], tuple[bytes, bytes]] = early_challenge,
    accepts: AcceptAhead | None = None,
) -> tuple[Hello, _T] | None:
    """Server side, at once (no await), as a connection of a client on this
    host (the caller decided, from the socket: see same_host) is accepted,
    before our Challenge: a first "data" Hello or accept_only "meta" probe
    already waiting whose early proof ``early`` takes. Returns it and what
    ahead(hello, answer) made of our answer: our Challenge (``early``) and
    the proved Accept (``meta=True`` when a "data" Hello asked for the
    metadata: the caller sends it), as frames, for the caller to send. The
    Hello was read (exactly its frame: the engine's bytes follow) and its
    Challenge granted to its joins. None, nothing read or sent: anything
    else (no token, a partial Hello, no early proof or one not taken, any
    check of server_handshake's that fails, a refusal): the caller greets
    it (server_greet_now) and serves it as any other. ProtocolError: taken,
    but the connection broke (the caller closes it).

    Every check server_handshake makes of a Hello (version, name, nonce,
    incarnation, byte order) and refuse() come before the proof is taken,
    and nothing of ours goes out before it is.

    Made ahead by the caller, each where it has it (the accepting step's
    work from its wake-up to this answer's send is on the connect's way,
    on a cold vCPU, tgt35): peeked, what hello_peek_now peeked (nothing was
    read since: the same first bytes); here, the accepted socket's
    sock_endpoint(getsockname()) (a listener's own address, where every
    connection it accepts has it); made(), our Challenge's fresh nonce and
    frame (early_challenge, called once per answer); accepts, our Accept's
    frames up to the proof (AcceptAhead of ``accept``)."""
    if token is None:
        return None
    frame = _peeked(sock) if peeked is None else peeked
    if not frame:
        return None
    n = _whole_frame(frame)
    if not n or _NO_EARLY in frame[4 : 4 + n]:
        return None
    try:
        hello = decode_body(memoryview(frame)[4 : 4 + n])
    except ProtocolError:
        return None
    if not (
        _hello_passes(hello)
        and hello.early_proof
        and not hello.join
        and hello.byteorder == sys.byteorder
        and _early_kind(hello.purpose, hello.accept_only)
    ):
        return None
    if refuse is not None and refuse() is not None:
        return None  # (server_handshake says why, in a Reject)
    if here is None:
        try:
            here = sock_endpoint(sock.getsockname())
        except OSError:
            return None
    if not early.take(hello, token, here):
        return None
    nonce, challenge_frame = made()
    if accepts is not None:
        proved = accepts.frame(hello.meta and hello.purpose == "data",
                               early.server_proof(token, hello.nonce, nonce))
    else:
        proved = _answer(hello, token, accept, nonce, early)
    answer = ahead(hello, challenge_frame + proved)
    try:
        if sock.recv_into(bytearray(4 + n), 4 + n) != 4 + n:  # the peeked Hello, for good
            raise ProtocolError("the early Hello shrank between its peek and its read")
    except OSError as exc:
        raise ProtocolError(f"connection broken while it was accepted: {exc}") from None
    _grant(hello, nonce, joins)
    return hello, answer


def _answer(
    hello: Hello, token: bytes | None, accept: Accept, nonce: bytes,
    early: EarlyProofs | None = None,
) -> bytes:
    """Our Accept of hello as a frame (proved with a token), as
    server_handshake sends it. early: its proof made from the HMAC begun
    ahead there (EarlyProofs.server_proof: the same bytes)."""
    if hello.meta and hello.purpose == "data":
        accept = msgspec.structs.replace(accept, meta=True)  # the caller sends it
    if token is None:
        return encode_frame(accept)
    if early is not None:
        return encode_frame(msgspec.structs.replace(
            accept, proof=early.server_proof(token, hello.nonce, nonce)))
    return encode_frame(_proved(accept, token, hello.nonce, nonce))


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
    spin_ns: int = 0,
) -> Accept:
    """Runs the client half; returns the server's Accept, its proof checked.

    joins/on_challenge (a first "data" connection, token only): this many
    other connections will join its Challenge; on_challenge(nonce) is called
    once the server proved itself in its Accept. join: (that nonce, index 1..joins) for one of
    those connections (see the module docstring); sent: such a connection's
    Hello was sent by client_join_now (its nonce, and the part still to send).

    meta ("data" only): ask for the server's metadata on this connection; if
    the Accept says it follows (``accept.meta``), the caller reads it
    (``recv_frame``; memfds on a unix socket; ``recv_go``) before the engine
    takes the connection. accept_only ("meta" only): the Accept is all we
    want; the server closes after it.

    Raises AccessDenied when the server rejects us, when its proof is wrong, when
    it wants a token we do not have, or when we have a token and it does not
    authenticate (a server that skips the challenge cannot prove who it is);
    ProtocolError when it speaks another protocol version.
    On failure the socket is shut down (the caller still owns and closes it), so
    the other side sees the end at once instead of waiting for its timeout.
    """
    try:
        return await _client_handshake(
            loop, sock, name=name, incarnation=incarnation, purpose=purpose, token=token,
            meta=meta, accept_only=accept_only, joins=joins, on_challenge=on_challenge, join=join,
            sent=sent, spin_ns=spin_ns,
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
    nonce: bytes | None = None,
    refuse: Callable[[], str | None] | None = None,
) -> Hello:
    """Runs the server half up to and including sending ``accept`` (with
    ``meta=True`` when the client asked for the metadata on a "data"
    connection: the caller then sends it, see META_GO). joins: where the
    Challenges other connections may join are kept (None: no joins).
    nonce: server_greet_now sent our Challenge (None: it is sent here first).
    refuse(): asked right before the Accept; a reason refuses the handshake
    with it (a Reject, HandshakeRejected), e.g. once the agent is closing.

    Raises HandshakeRejected (after sending Reject) when authentication fails,
    ProtocolError on anything malformed; either way the socket is shut down.
    """
    try:
        return await _server_handshake(loop, sock, token=token, accept=accept, joins=joins,
                                       nonce=nonce, refuse=refuse)
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


def _warm() -> None:
    """A process's first use of each thing a handshake does costs several
    times its next one: HMAC-SHA256 ~60-120 us more (OpenSSL looks the
    digest up once for hmac.digest, once for hmac.new), a Hello made and
    encoded ~45 us more (getrandom's first call, the name check, msgspec's
    encoder for the type), each frame type's first decode. Made once here,
    at import (~0.3 ms), instead of on the way of the first connect, whose
    Hello nothing else waits for (the peer sleeps until it lands)."""
    hmac.digest(b"\0", b"", "sha256")
    hmac.new(b"\0", b"", hashlib.sha256).digest()
    nonce = secrets.token_bytes(NONCE_BYTES)
    for msg in (
        Hello(version=PROTOCOL_VERSION, name="warm", incarnation=0, purpose="data",
              nonce=nonce, byteorder=sys.byteorder),
        Challenge(version=PROTOCOL_VERSION, nonce=nonce),
        Proof(proof=nonce),
        Accept(name="warm", proof=nonce),
        Reject(reason="warm"),
    ):
        decode_body(memoryview(encode_frame(msg))[4:])
    # (An early proof's own steps, as a same-host connect's hello_now
    # makes them: the tuple's encode, the replace of two fields.)
    hello = Hello(version=PROTOCOL_VERSION, name="warm", incarnation=0, purpose="data",
                  nonce=nonce, byteorder=sys.byteorder)
    ts = time.time_ns()
    encode_frame(msgspec.structs.replace(
        hello, early_ts=ts, early_proof=_early_mac(b"\0", hello, ts, sock_endpoint(("::1", 0)))
    ))


_warm()

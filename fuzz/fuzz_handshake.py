#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: the connection handshake
(aioxfer/protocol.py: length-prefixed frames, Challenge / Hello / Proof /
Accept / Reject, the HMAC proofs; the server speaks first) from either side,
over a real socketpair.

Byte 0 of an input picks the side and its settings, the rest is the byte
stream the other side sends (then it hangs up):
  bit 0: 0 = we are the server (server_handshake; the input is a client),
         1 = we are the client (client_handshake; the input is a server);
  bit 1: we have a token (b"fuzz-token"), else none;
  bits 2-3 (client): purpose meta / data / verbs, or 3 = fetch_meta (the
         handshake, then the AgentMeta frame);
  bit 4 (server): a join table holding one grant the harness knows (GRANT,
         for "peer" incarnation 7, 3 joins), as if that client's first
         connection had been challenged; (client, data): this is a first
         connection that 3 others will join (joins=3, on_challenge);
  bit 5 (client, data): this connection joins (GRANT, index 1);
  bit 6 (server, token): the accepting step first, as serving.py takes
         it: server_join_now when the join table is held (bit 4), then
         server_greet_now (our Challenge, nothing read); then
         server_handshake, if the connection is not served already.
         server_join_now reads exactly the Hello's frame when it takes it
         (the rest stays in the socket, byte for byte, for the engine) and
         nothing when it does not. With the token, server_early_now
         before the greeting (a same-host client's early proof, cxs33):
         taken only for a Hello proved with the token for the
         socketpair's address (""), exactly its frame read, answered by
         a Challenge that says early; else nothing read.
Contract: the handshake returns what it promises (a Hello that passed every
check, an Accept, an AgentMeta) or raises an XferError (AccessDenied,
ProtocolError); it never authenticates a peer that did not prove the token
(with a token, no input can succeed, the nonces being random, except a join
of the known grant or an early Hello whose proof is made with the token:
seeds do that);
it never hangs once the peer hung up (5 s); a first frame (whole, in
bounds) that names another protocol version (a Hello or Challenge of
another version, or, protocol 5's lenient read, any msgpack map with an
integer "version" that none of our frames decodes) is named: the server
answers it with a Reject naming that version after its Challenge, the
client raises a ProtocolError naming it. Anything else raises
out of check(), unless it is a known, reported issue (fuzz/known_issues.py)
and AXF_FUZZ_TOLERATE_KNOWN=1.

Run: python fuzz/fuzz_handshake.py [libFuzzer flags] CORPUS_DIR   (see benchmarks/fuzz.sh)
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

TOKEN = b"fuzz-token"
GRANT = b"g" * 16  # the server nonce of the one join grant the server side holds
PURPOSES = ("meta", "data", "verbs")
MAX_INPUT = 64 << 10  # what one socketpair buffers without a reader
_m: Any = None
_loop: asyncio.AbstractEventLoop | None = None


def load() -> None:
    global _m, _loop
    if _m is not None:
        return
    import types

    import aioxfer.errors as errors
    import aioxfer.metadata as metadata
    import aioxfer.protocol as protocol

    _m = types.SimpleNamespace(errors=errors, metadata=metadata, protocol=protocol)
    _loop = asyncio.new_event_loop()


def _joined_with_the_token(hello: Any) -> bool:
    """Whether hello is a join of the known grant proved with TOKEN."""
    p = _m.protocol
    return (
        hello.join == GRANT and hello.name == "peer" and hello.incarnation == 7
        and 1 <= hello.join_index <= 3
        and hello.join_proof == p.join_proof(TOKEN, GRANT, hello.join_index, hello.nonce,
                                             hello.name)
    )


def _early_with_the_token(hello: Any) -> bool:
    """Whether hello carries an early proof made with TOKEN for the server's
    address here (a socketpair's: "", as sock_endpoint names it)."""
    p = _m.protocol
    return bool(hello.early_proof) and hello.early_proof == p.early_proof(TOKEN, hello, "")


def _waiting(sock: socket.socket) -> bytes:
    try:
        return sock.recv(MAX_INPUT, socket.MSG_PEEK)
    except BlockingIOError:
        return b""


def _at_once(sock: socket.socket, token: bytes | None, joins: Any) -> tuple[Any, Any]:
    """serving.py's accepting step: (a join served, or the nonce of the
    Challenge sent); checks what each read of the socket."""
    p, md = _m.protocol, _m.metadata
    before = _waiting(sock)
    accept = md.Accept(name="server", incarnation=1)
    if joins is not None:
        got = p.server_join_now(sock, token=token, accept=accept, joins=joins)
        after = _waiting(sock)
        if got is not None:
            n = 4 + int.from_bytes(before[:4], "big")
            if after != before[n:]:
                raise AssertionError(f"taken, and {len(before) - len(after)} bytes read of a "
                                     f"{n}-byte Hello frame with {len(before) - n} behind it")
            if got != p.decode_body(before[4:n]):
                raise AssertionError(f"taken a Hello that is not its frame's: {got!r}")
            return got, None
        if after != before:
            raise AssertionError(f"not taken, yet {len(before) - len(after)} bytes read")
        if _takes(before, token, joins):
            raise AssertionError("a whole Hello it takes, with what follows it, not taken")
    if token is not None:
        # A same-host client's early proof (cxs33): random bytes carry none
        # that verifies, so never taken and never a byte read; taken (a seed
        # made with the key), exactly its Hello read.
        early = p.EarlyProofs(start_ns=0, window_ns=1 << 62)
        # (as serving.Server calls it: its Accept's frames made ahead, and
        # the Hello's peek handed on, as _join_now and hello_peek_now do)
        got = p.server_early_now(sock, token=token, accept=accept, early=early, joins=joins,
                                 refuse=None, ahead=lambda h, b: b, peeked=p.peek_now(sock),
                                 accepts=p.AcceptAhead(accept))
        after = _waiting(sock)
        if got is not None:
            n = 4 + int.from_bytes(before[:4], "big")
            if after != before[n:] or got[0] != p.decode_body(before[4:n]):
                raise AssertionError("an early Hello taken, but not exactly its frame read")
            if not _early_with_the_token(got[0]):
                raise AssertionError(f"an early Hello taken without the token: {got[0]!r}")
            head = got[1]
            ch = p.decode_body(head[4:4 + int.from_bytes(head[:4], "big")])
            if not (isinstance(ch, _m.metadata.Challenge) and ch.early):
                raise AssertionError(f"an early Hello taken, answered by {ch!r}")
            rest = head[4 + int.from_bytes(head[:4], "big"):]
            acc = p.decode_body(rest[4:4 + int.from_bytes(rest[:4], "big")])
            if not (isinstance(acc, _m.metadata.Accept)
                    and acc.proof == p.server_proof(token, got[0].nonce, ch.nonce)):
                raise AssertionError(f"an early Hello taken, its Accept unproved: {acc!r}")
            return got[0], None
        if after != before:
            raise AssertionError(f"early: not taken, yet {len(before) - len(after)} bytes read")
    nonce = p.server_greet_now(sock, token=token)
    if _waiting(sock) != before:
        raise AssertionError("the Challenge went out, and bytes were read")
    return None, nonce


def _takes(data: bytes, token: bytes | None, joins: Any) -> bool:
    """Whether the accepting step must take the Hello that data starts with
    (whatever follows it): whole, passing every check, with the token; for
    server_join_now a join of the known grant proved with the token."""
    p = _m.protocol
    n = int.from_bytes(data[:4], "big")
    if token is None or len(data) < 4 or not 0 < n <= min(len(data) - 4, p.MAX_HANDSHAKE_FRAME):
        return False
    try:
        h = p.decode_body(data[4:4 + n])
    except _m.errors.ProtocolError:
        return False
    if not p._hello_passes(h):
        return False
    native = h.byteorder == sys.byteorder
    # (server_join_now's shortcut skips a frame holding an empty "join" as
    # msgspec writes it: a nonce may hold those 7 bytes too, 1 in 2**50 of
    # random ones; then it is left to server_handshake, as harmless.)
    return (h.purpose == "data" and native and not h.meta and _joined_with_the_token(h)
            and p._NO_JOIN not in data[4:4 + n])


async def _server(sock: socket.socket, token: bytes | None, with_joins: bool,
                  now: bool) -> None:
    p, md = _m.protocol, _m.metadata
    joins = None
    if with_joins:
        joins = p.Joins(ttl=60.0, cap=4)
        joins.grant(GRANT, md.Hello(version=md.PROTOCOL_VERSION, name="peer", incarnation=7,
                                    purpose="data", nonce=b"n" * 16, joins=3))
    joined, nonce = _at_once(sock, token, joins) if now else (None, None)
    if joined is not None:
        hello = joined
    else:
        hello = await p.server_handshake(
            _loop, sock, token=token, accept=md.Accept(name="server", incarnation=1),
            joins=joins, nonce=nonce,
        )
    if token is not None and not (
        (joins is not None and _joined_with_the_token(hello))
        or (joined is not None and _early_with_the_token(hello))
    ):
        raise AssertionError(f"a client without the token got in: {hello!r}")
    if not isinstance(hello, md.Hello):
        raise AssertionError(f"server_handshake returned {hello!r}")
    if hello.version != md.PROTOCOL_VERSION or not 1 <= len(hello.name) <= p.MAX_NAME:
        raise AssertionError(f"accepted a Hello that fails its checks: {hello!r}")
    if len(hello.nonce) != p.NONCE_BYTES or not 0 <= hello.incarnation < 1 << 64:
        raise AssertionError(f"accepted a Hello that fails its checks: {hello!r}")


async def _client(sock: socket.socket, token: bytes | None, mode: int, opts: int) -> None:
    p, md = _m.protocol, _m.metadata
    if mode == 3:
        got = await p.fetch_meta(_loop, sock, name="client", incarnation=1, token=token)
        want = md.AgentMeta
    else:
        challenged: list[bytes] = []
        got = await p.client_handshake(
            _loop, sock, name="client", incarnation=1, purpose=PURPOSES[mode], token=token,
            joins=3 if opts & 16 else 0, on_challenge=challenged.append,
            join=(GRANT, 1) if opts & 32 else None,
        )
        want = md.Accept
        if challenged and token is not None:
            raise AssertionError("others were let join a Challenge whose proof was not checked")
    if token is not None:
        raise AssertionError(f"a server without the token was trusted: {got!r}")
    if not isinstance(got, want):
        raise AssertionError(f"expected {want.__name__}, got {got!r}")


def _names_version(stream: bytes, client: bool) -> int | None:
    """The protocol version (not ours) the first frame of ``stream`` names,
    when it is whole and in bounds: a Hello (we are the server) or a
    Challenge (the client) that decodes, or any msgpack map with an integer
    "version" that none of our frames decodes (read here without
    protocol.py's helpers: the oracle for its lenient read)."""
    p, md = _m.protocol, _m.metadata
    n = int.from_bytes(stream[:4], "big")
    if len(stream) < 4 or not 0 < n <= min(len(stream) - 4, p.MAX_HANDSHAKE_FRAME):
        return None
    body = stream[4:4 + n]
    try:
        frame = p.decode_body(body)
    except _m.errors.ProtocolError:
        import msgspec

        try:
            obj = msgspec.msgpack.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return None
        v = obj.get("version") if isinstance(obj, dict) else None
        if type(v) is not int or v == md.PROTOCOL_VERSION:
            return None
        return v
    want = md.Challenge if client else md.Hello
    if isinstance(frame, want) and frame.version != md.PROTOCOL_VERSION:
        return int(frame.version)
    return None


def _check_named(version: int, client: bool, failed: BaseException | None,
                 theirs: socket.socket) -> None:
    """A peer of another protocol version was told so, by version."""
    p, md = _m.protocol, _m.metadata
    if client:
        if not isinstance(failed, _m.errors.ProtocolError) or (
                f"protocol version {version}, this agent" not in str(failed)):
            raise AssertionError(f"a server of protocol version {version}: the client "
                                 f"raised {failed!r}, not a ProtocolError naming it")
        return
    theirs.setblocking(False)
    got = bytearray()
    while True:
        try:
            chunk = theirs.recv(MAX_INPUT)
        except BlockingIOError:
            break
        if not chunk:
            break
        got += chunk
    frames = []
    while len(got) >= 4:
        n = int.from_bytes(got[:4], "big")
        frames.append(p.decode_body(bytes(got[4:4 + n])))
        del got[:4 + n]
    if (len(frames) != 2 or not isinstance(frames[0], md.Challenge)
            or not isinstance(frames[1], md.Reject)
            or f"protocol version {version} " not in frames[1].reason
            or not isinstance(failed, _m.errors.ProtocolError)):
        raise AssertionError(f"a client of protocol version {version}: the server sent "
                             f"{frames!r} and raised {failed!r}, not a Challenge and a "
                             f"Reject naming it")


def _run(data: bytes) -> None:
    assert _loop is not None
    opts, stream = data[0], data[1:MAX_INPUT]
    token = TOKEN if opts & 2 else None
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(stream)
        theirs.shutdown(socket.SHUT_WR)
        ours.setblocking(False)
        coro = (_client(ours, token, (opts >> 2) & 3, opts) if opts & 1
                else _server(ours, token, bool(opts & 16), bool(opts & 64)))
        failed: BaseException | None = None
        try:
            _loop.run_until_complete(asyncio.wait_for(coro, 5))
        except _m.errors.XferError as exc:
            failed = exc  # refused: what a hostile peer should get
        except TimeoutError:
            raise AssertionError("handshake still waiting 5 s after the peer hung up") from None
        version = _names_version(stream, opts & 1 == 1)
        if version is not None:
            _check_named(version, opts & 1 == 1, failed, theirs)
    finally:
        ours.close()
        theirs.close()


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _run, data)


def seeds() -> dict[str, bytes]:
    """Both sides of real handshakes: with and without a token, every purpose."""
    from aioxfer.metadata import (
        PROTOCOL_VERSION,
        Accept,
        AgentMeta,
        Challenge,
        Hello,
        Proof,
        Reject,
    )
    from aioxfer.protocol import encode_frame

    v = PROTOCOL_VERSION

    def _frame(obj: object) -> bytes:
        import msgspec

        body = msgspec.msgpack.encode(obj)
        return len(body).to_bytes(4, "big") + body

    def hello(purpose: str) -> bytes:
        return encode_frame(
            Hello(version=v, name="peer", incarnation=7, purpose=purpose, nonce=b"n" * 16)
        )

    from aioxfer.protocol import join_proof

    def join(index: int, proof: bytes | None = None) -> bytes:
        nonce = b"c" * 16
        return encode_frame(
            Hello(version=v, name="peer", incarnation=7, purpose="data", nonce=nonce, join=GRANT,
                  join_index=index,
                  join_proof=proof or join_proof(TOKEN, GRANT, index, nonce, "peer"))
        )

    meta = AgentMeta(
        version=v, name="server", incarnation=1, host_id="h", pid=1, address="127.0.0.1:1",
        transports=["tcp"], regions=[],
    )
    accept = encode_frame(Accept(name="server", incarnation=1))
    out = {
        "server-meta": b"\0" + hello("meta"),
        "server-data": b"\0" + hello("data"),
        "server-verbs": b"\0" + hello("verbs"),
        "server-token": b"\2" + hello("data") + encode_frame(Proof(proof=b"p" * 32)),
        "server-big-endian": b"\0"
        + encode_frame(
            Hello(version=v, name="peer", incarnation=7, purpose="data", nonce=b"n" * 16,
                  byteorder="big")
        ),
        "client-meta": b"\1" + accept,
        "client-data": bytes([1 | 1 << 2]) + accept,
        "client-verbs": bytes([1 | 2 << 2]) + accept,
        "client-fetch-meta": bytes([1 | 3 << 2]) + accept + encode_frame(meta),
        "client-reject": b"\1" + encode_frame(Reject(reason="no")),
        "client-token": b"\3"
        + encode_frame(Challenge(version=v, nonce=b"s" * 16))
        + encode_frame(Accept(name="server", incarnation=1, proof=b"p" * 32)),
        "client-old-server": b"\3"
        + encode_frame(Reject(reason="protocol version 4 is not 3")),
        "client-other-version": b"\3"
        + encode_frame(Challenge(version=v + 1, nonce=b"s" * 16)),
        # protocol 5's lenient read: a first frame of another version whose
        # shape changed (none of ours decodes it) still names its version
        "client-other-shape": b"\3" + _frame({"type": "challenge", "version": v + 1,
                                               "nonce": 7, "suite": "x"}),
        "server-other-shape": b"\2" + _frame({"type": "hello", "version": v + 1,
                                              "name": ["peer"], "nonce": b"n" * 16}),
        "server-untagged-version": b"\0" + _frame({"version": v - 1}),
        "client-no-token": b"\1"
        + encode_frame(Challenge(version=v, nonce=b""))
        + accept,
        # joins: a first connection's Hello asking for 3, a join the grant
        # honours (the one way in with a token), one with a forged proof, one
        # past the grant's count; a client's first connection and its join
        # answered by a Challenge that claims the join
        "server-first-of-joins": bytes([2 | 16])
        + encode_frame(Hello(version=v, name="peer", incarnation=7, purpose="data",
                             nonce=b"n" * 16, joins=3))
        + encode_frame(Proof(proof=b"p" * 32)),
        "server-join": bytes([2 | 16]) + join(1),
        # the accepting step's shortcuts (bit 6), with bytes behind the Hello
        "server-join-at-once": bytes([2 | 16 | 64]) + join(1) + b"engine bytes",
        "server-hello-at-once": bytes([2 | 64]) + hello("data")
        + encode_frame(Proof(proof=b"p" * 32)),
        "server-old-client": b"\2"
        + encode_frame(Hello(version=v - 1, name="peer", incarnation=7, purpose="data",
                             nonce=b"n" * 16)),
        "server-join-forged": bytes([2 | 16]) + join(2, b"f" * 32),
        "server-join-past-count": bytes([2 | 16]) + join(4),
        "client-first-of-joins": bytes([1 | 2 | 1 << 2 | 16])
        + encode_frame(Challenge(version=v, nonce=b"s" * 16))
        + encode_frame(Accept(name="server", incarnation=1, proof=b"p" * 32)),
        "client-join": bytes([1 | 2 | 1 << 2 | 32])
        + encode_frame(Challenge(version=v, nonce=b"s" * 16))
        + encode_frame(Accept(name="server", incarnation=1, proof=b"p" * 32)),
        "client-join-refused": bytes([1 | 2 | 1 << 2 | 32])
        + encode_frame(Challenge(version=v, nonce=b"s" * 16)) * 2
        + encode_frame(Accept(name="server", incarnation=1, proof=b"p" * 32)),
    }
    # Early proofs (same host: a socketpair, whose server address is ""):
    # one made with the token, taken at once with engine bytes behind it;
    # one for another address and one forged, neither taken (the ordinary
    # Challenge); a client's Hello answered by an early Challenge whose
    # Accept's proof is forged, and one not early (the Proof round).
    import msgspec

    from aioxfer.protocol import early_proof

    def early(here: str, key: bytes = TOKEN, purpose: str = "data", **kw: Any) -> bytes:
        h = Hello(version=v, name="peer", incarnation=7, purpose=purpose, nonce=b"e" * 16,
                  early_ts=1, **kw)
        return encode_frame(msgspec.structs.replace(h, early_proof=early_proof(key, h, here)))

    out.update({
        "server-early-at-once": bytes([2 | 64]) + early("") + b"engine bytes",
        "server-early-probe": bytes([2 | 64]) + early("", purpose="meta", accept_only=True),
        "server-early-with-joins": bytes([2 | 16 | 64]) + early("", joins=3),
        "server-early-elsewhere": bytes([2 | 64]) + early("127.0.0.1:1")
        + encode_frame(Proof(proof=b"p" * 32)),
        "server-early-forged": bytes([2 | 64]) + early("", key=b"not-the-token"),
        "client-early": bytes([1 | 2 | 1 << 2])
        + encode_frame(Challenge(version=v, nonce=b"s" * 16, early=True))
        + encode_frame(Accept(name="server", incarnation=1, proof=b"p" * 32)),
    })
    return out


def main() -> None:
    _harness.main(check, load, lambda: (_m.protocol, _m.metadata, _m.errors))


if __name__ == "__main__":
    main()

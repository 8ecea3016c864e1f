"""protocol.server_join_now takes a Hello that waits whole in the socket at
accept, over real loopback sockets (fuzz18). It decodes exactly the one
frame it then reads: server_join_now decoded everything it had peeked, so a
joining Hello with any byte behind it (the start of what follows it: the
engine's frames, once accepted) failed to decode ("trailing characters")
and took the slower path through server_handshake. A first connection's
handshake (conn22: the server's Challenge first) reads exactly its Hello
and Proof alike."""

from __future__ import annotations

import asyncio
import secrets
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from aioxfer import protocol
from aioxfer.metadata import PROTOCOL_VERSION, Accept, Challenge, Hello, Proof

TOKEN = b"fuzz18 token"
NAME = "client-0"
INC = 7


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected tcp loopback pair: (client, server side, non-blocking)."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        client = socket.create_connection(lsock.getsockname(), timeout=5)
        server, _ = lsock.accept()
    server.setblocking(False)
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def _waiting(sock: socket.socket, n: int) -> None:
    """Until n bytes wait in sock (what the accepting step would see)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            if len(sock.recv(n + 1, socket.MSG_PEEK)) >= n:
                return
        except BlockingIOError:
            pass
        assert time.monotonic() < deadline, "the client's bytes did not arrive"
        time.sleep(0.001)


def _recv_frames(client: socket.socket, count: int) -> list[object]:
    data = b""
    while len(frames := _frames_whole(data)) < count:
        chunk = client.recv(1 << 16)
        assert chunk, "the server closed before its reply"
        data += chunk
    return frames


def _frames_whole(data: bytes) -> list[object]:
    """The whole frames at the start of data."""
    out, i = [], 0
    while len(data) - i >= 4 and len(data) - i - 4 >= (n := int.from_bytes(data[i:i + 4], "big")):
        out.append(protocol.decode_body(data[i + 4 : i + 4 + n]))
        i += 4 + n
    return out


TRAILING = [b"\0", b"\x00\x00\x00\x10" + b"E" * 16, secrets.token_bytes(3000)]


@pytest.mark.parametrize("after", TRAILING, ids=["one-byte", "a-frame", "3000-bytes"])
def test_a_join_hello_with_bytes_behind_it_is_taken_at_once(
        pair: tuple[socket.socket, socket.socket], after: bytes) -> None:
    """A joining Hello for a live grant, with bytes behind it: taken in the
    accepting step (Challenge and a proved Accept sent), exactly its frame
    read, the bytes behind it left in the socket for whoever comes next.
    Before: None (not taken), the Hello left to server_handshake."""
    client, server = pair
    joins = protocol.Joins(ttl=30.0, cap=8)
    first_nonce = secrets.token_bytes(protocol.NONCE_BYTES)
    challenge_nonce = secrets.token_bytes(protocol.NONCE_BYTES)
    first = Hello(version=PROTOCOL_VERSION, name=NAME, incarnation=INC, purpose="data",
                  nonce=first_nonce, byteorder=sys.byteorder, joins=1)
    joins.grant(challenge_nonce, first)
    nonce, frame = protocol._hello(name=NAME, incarnation=INC, purpose="data", token=TOKEN,
                                   join=(challenge_nonce, 1))
    client.sendall(frame + after)
    _waiting(server, len(frame) + len(after))
    accept = Accept(name="server", incarnation=1)

    hello = protocol.server_join_now(server, token=TOKEN, accept=accept, joins=joins)

    assert hello is not None, "a join with bytes behind it was not taken"
    assert hello.name == NAME and hello.join == challenge_nonce and hello.nonce == nonce
    assert joins.joined == 1
    # Exactly the Hello was read: what follows it is still there, whole.
    assert server.recv(len(after) + 1, socket.MSG_PEEK) == after
    ch, acc = _recv_frames(client, 2)
    assert isinstance(ch, Challenge) and isinstance(acc, Accept)
    assert acc.proof == protocol.server_proof(TOKEN, nonce, ch.nonce)
    assert acc == Accept(name="server", incarnation=1, proof=acc.proof)


@pytest.mark.parametrize("after", TRAILING, ids=["one-byte", "a-frame", "3000-bytes"])
async def test_a_first_hello_with_bytes_behind_it_is_taken_exactly(
        pair: tuple[socket.socket, socket.socket], after: bytes) -> None:
    """A first connection: our Challenge goes before a byte is read
    (server_greet_now); then its Hello and Proof with bytes behind them:
    exactly those two frames read, the bytes behind left for the engine."""
    client, server = pair
    snonce = protocol.server_greet_now(server, token=TOKEN)
    (ch,) = _recv_frames(client, 1)
    assert ch == Challenge(version=PROTOCOL_VERSION, nonce=snonce)
    nonce, frame = protocol._hello(name=NAME, incarnation=INC, purpose="data", token=TOKEN)
    proof = protocol.encode_frame(Proof(proof=protocol.client_proof(TOKEN, snonce, nonce, NAME)))
    client.sendall(frame + proof + after)
    _waiting(server, len(frame) + len(proof) + len(after))
    hello = await asyncio.wait_for(protocol.server_handshake(
        asyncio.get_running_loop(), server, token=TOKEN, accept=Accept(name="server"),
        nonce=snonce), 5)
    assert hello.nonce == nonce
    assert server.recv(len(after) + 1, socket.MSG_PEEK) == after
    (acc,) = _recv_frames(client, 1)
    assert isinstance(acc, Accept) and acc.proof == protocol.server_proof(TOKEN, nonce, snonce)


def test_a_join_hello_cut_short_is_left_unread(pair: tuple[socket.socket, socket.socket]
                                               ) -> None:
    """Not all of the Hello there yet: nothing read, nothing granted used
    (server_handshake reads it when the rest comes)."""
    client, server = pair
    joins = protocol.Joins(ttl=30.0, cap=8)
    challenge_nonce = secrets.token_bytes(protocol.NONCE_BYTES)
    joins.grant(challenge_nonce, Hello(version=PROTOCOL_VERSION, name=NAME, incarnation=INC,
                                       purpose="data", nonce=b"n" * 16,
                                       byteorder=sys.byteorder, joins=1))
    _, frame = protocol._hello(name=NAME, incarnation=INC, purpose="data", token=TOKEN,
                               join=(challenge_nonce, 1))
    client.sendall(frame[:-1])
    _waiting(server, len(frame) - 1)
    assert protocol.server_join_now(server, token=TOKEN, accept=Accept(), joins=joins) is None
    assert joins.joined == 0
    assert server.recv(len(frame), socket.MSG_PEEK) == frame[:-1]

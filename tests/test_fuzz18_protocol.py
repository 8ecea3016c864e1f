"""protocol.server_join_now and server_hello_now take a Hello that waits
whole in the socket at accept, over real loopback sockets (fuzz18). Both
decode exactly the one frame they then read: server_join_now decoded
everything it had peeked, so a joining Hello with any byte behind it (the
start of what follows it: the engine's frames, once accepted) failed to
decode ("trailing characters") and took the slower path through
server_handshake, while server_hello_now took its Hello alike."""

from __future__ import annotations

import secrets
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from aioxfer import protocol
from aioxfer.metadata import PROTOCOL_VERSION, Accept, Challenge, Hello

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
    accepting step (Challenge{joined} and Accept sent), exactly its frame
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
    assert isinstance(ch, Challenge) and ch.joined
    assert ch.proof == protocol.server_proof(TOKEN, nonce)
    assert acc == accept


@pytest.mark.parametrize("after", TRAILING, ids=["one-byte", "a-frame", "3000-bytes"])
def test_a_first_hello_with_bytes_behind_it_is_taken_at_once(
        pair: tuple[socket.socket, socket.socket], after: bytes) -> None:
    """server_hello_now, the same case for a first connection (its Proof
    behind it): taken, exactly its frame read (as before: the two agree)."""
    client, server = pair
    nonce, frame = protocol._hello(name=NAME, incarnation=INC, purpose="data", token=TOKEN)
    client.sendall(frame + after)
    _waiting(server, len(frame) + len(after))
    taken = protocol.server_hello_now(server, token=TOKEN, accept=Accept(name="server"),
                                      joins=None)
    assert taken is not None and taken.hello.nonce == nonce
    assert server.recv(len(after) + 1, socket.MSG_PEEK) == after
    (ch,) = _recv_frames(client, 1)
    assert isinstance(ch, Challenge) and not ch.joined and ch.nonce == taken.nonce


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

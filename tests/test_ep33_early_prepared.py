"""Early proofs with Hellos made ahead (ep33): the Hello an agent makes at
start() for its first connect (cxp33's Dialer.prepare_hello) is stamped and
proved as it is sent (Dialer.hello_now, protocol.with_early_frame), for the
socket's address: a connect to this host by a loopback or unix address
takes the early path (no Proof round), the prepared nonce kept and sent once.

Over real sockets against real agents; the early path is seen in the Hello
on the wire (its proof checked against the listener's address) and in the
server's count of early proofs taken, never by time.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import msgspec
import pytest
from conftest import within
from test_cxp33_connect import _hello_sent, _listener

from aioxfer import auth, metadata, protocol

MiB = 1 << 20
TOKEN = b"ep33-early-prepared-token"
KEY = auth.hmac_key(TOKEN)


def _prepared(agent: Any, key: Any = None) -> tuple[tuple[Any, ...], bytes, metadata.Hello]:
    """The Hello start() made ahead (the only one, or key's): (key, nonce,
    the Hello as made)."""
    if key is None:
        ((key, (nonce, frame)),) = agent._dialer._hellos.items()
    else:
        nonce, frame = agent._dialer._hellos[key]
    made = protocol.decode_body(memoryview(frame)[4:])
    assert isinstance(made, metadata.Hello) and made.nonce == nonce
    # (its struct kept beside the frame, for hello_now to stamp undecoded)
    # and its early proof begun: the HMAC over all of it but the time and
    # the server's address, the frame around both: early_ahead)
    kept, ahead = agent._dialer._hello_msgs[key]
    assert kept == made and (ahead is None) == (agent._dialer._token is None)
    return key, nonce, made


@pytest.mark.parametrize("kept", [True, False])
async def test_a_prepared_hello_leaves_with_an_early_proof(make_agent: Any, kept: bool) -> None:
    """Made at start() without one (no socket yet); sent to a loopback
    address, it carries an early proof for that address, stamped at send
    time, and is otherwise the Hello made ahead (its nonce included).
    Stamped from its struct kept beside the frame, or (kept False: none
    kept) from the frame decoded."""
    init = await make_agent("init", transports=("tcp",), token=TOKEN)
    await init.start()
    _, nonce, made = _prepared(init)
    if not kept:
        init._dialer._hello_msgs.clear()
    assert not made.early_proof and made.early_ts == 0
    lsock, address = _listener()
    here = protocol.sock_endpoint(("127.0.0.1", lsock.getsockname()[1]))
    before = time.time_ns()
    sent = await _hello_sent(init, lsock, address)
    assert sent.nonce == nonce
    assert before <= sent.early_ts <= time.time_ns()
    assert sent.early_proof == protocol.early_proof(KEY, sent, here)
    assert sent.early_proof != protocol.early_proof(KEY, sent, "127.0.0.1:1")
    assert msgspec.structs.replace(sent, early_ts=0, early_proof=b"") == made


async def test_without_a_token_a_prepared_hello_goes_as_made(make_agent: Any) -> None:
    init = await make_agent("init", transports=("tcp",), insecure_no_auth=True)
    await init.start()
    _, nonce, made = _prepared(init)
    sent = await _hello_sent(init, *_listener())
    assert sent == made and not sent.early_proof


@pytest.mark.parametrize("transports", [("tcp",), None])
async def test_agents_take_the_early_path_with_a_prepared_hello(
    make_agent: Any, transports: Any
) -> None:
    """Real agents, the initiator started (its first Hello made ahead): its
    connect's first Hello (tcp to loopback; an agent with a unix socket
    sends it there) is taken early by the target, and a write goes
    through. The prepared Hello was the one sent (none left of its nonce)."""
    kw = {} if transports is None else {"transports": transports}
    target = await make_agent("target", token=TOKEN, **kw)
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", token=TOKEN, **kw)
    await init.start()
    src = init.alloc(MiB, name="src")
    src.numpy().fill(33)
    # (An agent with a unix socket made two: its first Hello there is the
    # one without joins; tcp only: the one with its connect's joins.)
    key, nonce, _ = _prepared(init, None if transports else ("data", True, 0))
    peer = await within(init.connect(target.address))
    assert target._server.early.taken == 1
    again = init._dialer._hellos.get(key)
    assert again is None or again[0] != nonce
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x21" * 4096


def _frame(**kw: Any) -> tuple[metadata.Hello, bytes]:
    kw.setdefault("purpose", "data")
    h = metadata.Hello(version=metadata.PROTOCOL_VERSION, name="ep33", incarnation=3,
                       nonce=b"\x07" * protocol.NONCE_BYTES, byteorder=sys.byteorder, **kw)
    return h, protocol.encode_frame(h)


@pytest.mark.parametrize("kept", [False, True])
def test_with_early_frame_adds_a_proof_only_where_one_belongs(kept: bool) -> None:
    """A same-host socket (a unix pair), a token, a first "data" Hello or
    accept_only probe: proved for the peer's address, nonce kept. No
    token, a socket not connected, a join, a verbs Hello or a metadata
    fetch: the frame itself, unchanged. kept: with_early_hello, the same
    from the Hello's struct kept beside its frame (nothing decoded)."""

    def stamp(h: metadata.Hello, frame: bytes, sock: socket.socket, key: bytes | None) -> bytes:
        if kept:
            return protocol.with_early_hello(h, frame, sock, key,
                                             protocol.early_ahead(key, h))
        return protocol.with_early_frame(frame, sock, key)

    a, b = socket.socketpair()
    loose = socket.socket()
    with a, b, loose:
        here = protocol.sock_endpoint(a.getpeername())
        for kw in ({}, {"purpose": "meta", "accept_only": True}):
            h, frame = _frame(**kw)
            got = protocol.decode_body(memoryview(stamp(h, frame, a, KEY))[4:])
            assert isinstance(got, metadata.Hello) and got.nonce == h.nonce
            assert got.early_ts > 0 and got.early_proof == protocol.early_proof(KEY, got, here)
            assert msgspec.structs.replace(got, early_ts=0, early_proof=b"") == h
        h, frame = _frame()
        assert stamp(h, frame, a, None) is frame
        assert stamp(h, frame, loose, KEY) is frame
        for kw in (
            {"join": b"\x01" * protocol.NONCE_BYTES, "join_index": 1,
             "join_proof": b"\x02" * protocol.NONCE_BYTES},
            {"purpose": "verbs"},
            {"purpose": "meta"},
        ):
            h, frame = _frame(**kw)
            assert stamp(h, frame, a, KEY) is frame
            assert protocol.with_early_proof(h, a, KEY) is h

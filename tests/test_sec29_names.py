"""Agent names are held to one rule where they enter (aioxfer.names).

A name reaches logs, errors, metrics labels, etcd keys, KV member tables
and the NIXL layer's remote-agent table. Before, only its length was
checked: ``Agent("x\\x1b[2J\\u202e...")`` was made, and a peer's Hello or
Accept carrying ESC, NUL, CR/LF, U+2028 or a bidi override was taken as its
name. Now our own ``Agent(name)`` and ``nixl_agent(name)`` raise ValueError,
compat metadata naming such an agent is refused (NIXL_ERR_INVALID_PARAM),
and a peer's handshake naming one is refused with ProtocolError.

The handshake tests (``test_a_hello_*``, ``test_an_accept_*``,
``test_frames_naming_*``) need the call in aioxfer/metadata.py that hs29's
session owns (sec29's report: Hello, Accept and AgentMeta check their name
in ``__post_init__``); they fail without it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from typing import Any

import msgspec
import pytest
from conftest import within
from test_security import raw_connect

import aioxfer
from aioxfer import auth, metadata, protocol
from aioxfer.names import MAX_NAME, check_name, name_problem
from aioxfer.nixl import _wire

TOKEN = "sec29-names-token-0123456789abcdef"

HOSTILE = [
    "a\x1b[2Jb",  # ESC: clears a terminal
    "a\nforged",  # LF
    "a\rb",  # CR
    "a\x00b",  # NUL
    "a\x7fb",  # DEL
    "a\x85b",  # NEL (C1)
    "a\u2028b",  # line separator
    "a\u2029b",  # paragraph separator
    "a\u202eb",  # right-to-left override
    "a\u2066b",  # left-to-right isolate
    "a\u200db",  # zero-width joiner (format)
    "a\ufeffb",  # BOM (format)
    "a\u00a0b",  # no-break space (a separator that is not the ASCII space)
    "a\ue000b",  # private use
    "a\U000e0001b",  # language tag (format)
    "a\udc80b",  # lone surrogate (which name.encode() raises on, in the proof)
]

VALID = ["a", "prefill-0", "decode_rank.3", "a b", "节点-1", "Ünïcödé", "x" * MAX_NAME,
         "host.example:1234/rank-7", "550e8400-e29b-41d4-a716-446655440000"]


@pytest.mark.parametrize("name", HOSTILE, ids=ascii)
def test_our_own_hostile_names_are_refused(name: str) -> None:
    why = name_problem(name)
    assert why is not None and "not printable" in why
    assert why.isprintable(), "the reason must not carry the character raw"
    with pytest.raises(ValueError, match="not printable"):
        aioxfer.Agent(name, insecure_no_auth=True)
    from aioxfer.nixl import nixl_agent

    with pytest.raises(ValueError, match="not printable"):
        nixl_agent(name)


@pytest.mark.parametrize("name", VALID, ids=lambda n: ascii(n[:20]))
def test_ordinary_names_stay_valid(name: str) -> None:
    assert check_name(name) == name
    agent = aioxfer.Agent(name, insecure_no_auth=True)
    assert agent.name == name


def test_length_and_type() -> None:
    for bad in ("", "x" * (MAX_NAME + 1)):
        with pytest.raises(ValueError, match=f"1..{MAX_NAME} characters"):
            aioxfer.Agent(bad, insecure_no_auth=True)
    with pytest.raises(ValueError, match="must be a string"):
        aioxfer.Agent(b"bytes", insecure_no_auth=True)  # type: ignore[arg-type]


def test_the_rule_is_what_the_log_leaves_as_it_is() -> None:
    """A valid name is written in a log line as it is, and any character
    aioxfer.log.escape would escape makes a name invalid."""
    from aioxfer.log import escape

    for n in VALID:
        assert escape(n) == n
    for n in HOSTILE:
        assert escape(n) != n


# ------------------------------------------------------------ NIXL metadata


@pytest.mark.parametrize("name", ["b\x1b]0;title\x07", "b\u202e", "b\nforged"], ids=ascii)
def test_nixl_metadata_naming_a_hostile_agent_is_refused(name: str, agents: Any,
                                                         monkeypatch: Any) -> None:
    """Compat metadata (from add_remote_agent, a listener push or fetch, etcd)
    whose agent name carries control characters: refused as NIXL refuses
    values it cannot use, never put in the remote-agent table."""
    from aioxfer.nixl._bindings import nixlInvalidParamError

    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    a = agents()
    blob = _wire.encode_md(_wire.AgentMD(name=name))
    with pytest.raises(ValueError, match="not printable"):
        _wire.decode_md(blob)
    with pytest.raises(nixlInvalidParamError, match="not printable"):
        a.add_remote_agent(blob)
    assert not a.agent._remotes


# ------------------------------------------------------------ the handshake (needs metadata.py)


def _raw_frame(obj: dict[str, Any]) -> bytes:
    """A frame encoded from a plain map: what a peer of its own making sends
    (our structs refuse to be built with such a name)."""
    body = msgspec.msgpack.encode(obj)
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("name", ["evil\x1b[2K\u202e", "evil\nE1206 forged", "evil\u2028x",
                                  "evil\x00"], ids=ascii)
async def test_frames_naming_a_hostile_agent_do_not_decode(name: str) -> None:
    """Hello, Accept and AgentMeta as the real decoder reads them: a typed
    ProtocolError whose text carries the name escaped."""
    frames = [
        {"type": "hello", "version": metadata.PROTOCOL_VERSION, "name": name, "incarnation": 7,
         "purpose": "data", "nonce": os.urandom(protocol.NONCE_BYTES)},
        {"type": "accept", "name": name, "incarnation": 7},
        {"type": "meta", "version": metadata.PROTOCOL_VERSION, "name": name, "incarnation": 7,
         "host_id": "h", "pid": 1, "address": "127.0.0.1:1", "transports": ["tcp"],
         "regions": []},
    ]
    for f in frames:
        with pytest.raises(aioxfer.ProtocolError, match="not printable") as info:
            protocol.decode_body(msgspec.msgpack.encode(f))
        assert str(info.value).isprintable()
        ok: Any = protocol.decode_body(msgspec.msgpack.encode(dict(f, name="fine-name")))
        assert ok.name == "fine-name"


@pytest.mark.parametrize("name", ["evil\x1b[2K\u202e", "evil\nforged", "evil\u2028x"],
                         ids=ascii)
async def test_a_hello_naming_a_hostile_agent_is_refused(name: str, make_agent: Any,
                                                         capfd: Any) -> None:
    """A client holding the token (it proves it) speaks the handshake with
    such a name: before, the server accepted it (Accept, proof and all, the
    name in its peer table and log lines); now it closes the connection
    without an Accept and logs the refusal with the name escaped."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        chal = await within(protocol.recv_frame(loop, sock))
        assert isinstance(chal, metadata.Challenge)
        nonce = os.urandom(protocol.NONCE_BYTES)
        hello = _raw_frame({"type": "hello", "version": metadata.PROTOCOL_VERSION,
                            "name": name, "incarnation": 7, "purpose": "data", "nonce": nonce,
                            "byteorder": sys.byteorder})
        proof = protocol.client_proof(auth.hmac_key(TOKEN.encode()), chal.nonce, nonce, name)
        await loop.sock_sendall(sock, hello + protocol.encode_frame(metadata.Proof(proof=proof)))
        try:
            answer: Any = await within(protocol.recv_frame(loop, sock))
        except (aioxfer.ProtocolError, ConnectionError) as exc:
            answer = exc
        assert not isinstance(answer, metadata.Accept), "a hostile name was accepted"
    # (The control case: the same raw client with an ordinary name gets in.)
    sock = await raw_connect(target.address)
    with sock:
        chal = await within(protocol.recv_frame(loop, sock))
        nonce = os.urandom(protocol.NONCE_BYTES)
        good = "plain-name"
        hello = _raw_frame({"type": "hello", "version": metadata.PROTOCOL_VERSION,
                            "name": good, "incarnation": 7, "purpose": "meta", "nonce": nonce,
                            "accept_only": True})
        proof = protocol.client_proof(auth.hmac_key(TOKEN.encode()), chal.nonce, nonce, good)
        await loop.sock_sendall(sock, hello + protocol.encode_frame(metadata.Proof(proof=proof)))
        assert isinstance(await within(protocol.recv_frame(loop, sock)), metadata.Accept)
    err = capfd.readouterr().err
    assert "conn.rejected" in err and "not printable" in err, err
    assert all(c == "\n" or c.isprintable() for c in err), "a raw control in the log"


async def test_an_accept_naming_a_hostile_agent_is_refused(make_agent: Any) -> None:
    """A server (here one of our own making, no token) answers a real
    client's connect with an Accept, and the metadata after it, naming an
    agent "srv\\x1b[2J\\u202e": the client refuses it with ProtocolError
    before it uses anything of it (before, it went on to hand the
    connection to its engine and made a Peer of that name)."""
    evil = "srv\x1b[2J\u202e"
    client = await make_agent("client", insecure_no_auth=True, transports=("tcp",))
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    port = lsock.getsockname()[1]
    held: list[socket.socket] = []

    async def serve() -> None:
        while True:
            conn, _ = await loop.sock_accept(lsock)
            held.append(conn)
            await loop.sock_sendall(conn, protocol.encode_frame(
                metadata.Challenge(version=metadata.PROTOCOL_VERSION, nonce=b"")))
            hello = await protocol.recv_frame(loop, conn)
            assert isinstance(hello, metadata.Hello)
            out = _raw_frame({"type": "accept", "name": evil, "incarnation": 9,
                              "meta": hello.meta})
            if hello.meta:
                out += _raw_frame({"type": "meta", "version": metadata.PROTOCOL_VERSION,
                                   "name": evil, "incarnation": 9, "host_id": "elsewhere",
                                   "pid": 1, "address": f"127.0.0.1:{port}",
                                   "transports": ["tcp"], "regions": []})
                out += protocol.META_GO
            await loop.sock_sendall(conn, out)

    server = asyncio.ensure_future(serve())
    try:
        with pytest.raises(aioxfer.ProtocolError, match="not printable") as info:
            await within(client.connect(f"127.0.0.1:{port}"), 10)
        assert str(info.value).isprintable()
        assert not client.peers
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        for c in held:
            c.close()
        lsock.close()

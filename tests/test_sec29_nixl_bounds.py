"""Sizes a NIXL compat listener's peer chooses, bounded where they are quoted.

A listener request or reply may be up to _wire.MAX_FRAME (64 MiB) long,
and three of their strings were quoted whole: a listener's refusal text
(Reply.error) became the client's exception message and its log line, a
Fetch's name went back whole in the listener's refusal, and a region
name in compat metadata had no bound (aioxfer's own are at most 256
characters: a longer one names no region) and was quoted whole in the
error refusing its region. Here each is a megabyte, from real sockets
with the token: the line, the refusal and the error stay short.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest

from aioxfer import auth
from aioxfer.nixl import _wire

TOKEN = "sec29-nixl-bounds-token-0123456789"
STEP = 20.0
BIG = 1 << 20


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {len(data)} of {n} bytes"
        data += chunk
    return data


@pytest.fixture
def client(agents: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")
    return agents()


def test_a_listeners_long_refusal_is_cut(client: Any, capfd: Any) -> None:
    """A listener with the token refuses a fetch with a megabyte of text:
    the client's log line says how much was left out."""
    sock = socket.create_server(("127.0.0.1", 0))
    token = TOKEN.encode()
    served = threading.Event()

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.settimeout(STEP)
            greeting = _wire.greeting()
            conn.sendall(greeting)
            head = _recv(conn, _wire.LISTEN_HEAD)
            _recv(conn, int.from_bytes(head[:4], "big"))
            req_mac = _recv(conn, _wire.LISTEN_MAC)
            body = _wire.encoder.encode(_wire.Reply(ok=False, error="r" * BIG))
            conn.sendall(_wire.reply_frame(token, greeting, req_mac, body))
            served.set()
            while conn.recv(1 << 16):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        capfd.readouterr()
        client.fetch_remote_metadata("somebody", "127.0.0.1", sock.getsockname()[1])
        assert served.wait(STEP)
        deadline = time.monotonic() + STEP
        lines: list[str] = []
        while not any("fetchRemoteMD failed" in ln for ln in lines):
            assert time.monotonic() < deadline, [ln[:200] for ln in lines]
            time.sleep(0.05)
            lines += capfd.readouterr().err.splitlines()
        (line,) = [ln for ln in lines if "fetchRemoteMD failed" in ln]
        assert len(line) < 4096, len(line)
        assert "more characters)" in line
    finally:
        sock.close()
        thread.join(STEP)


def test_a_fetch_of_a_long_name_gets_a_short_refusal(agents: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    server = agents(enable_listen_thread=True, listen_port=0)
    token = TOKEN.encode()
    with socket.create_connection(("127.0.0.1", server.agent.listen_port), timeout=STEP) as s:
        greeting = _recv(s, _wire.LISTEN_NONCE)
        body = _wire.encoder.encode(_wire.Fetch(name="q" * BIG,
                                                nonce=os.urandom(_wire.CLIENT_NONCE)))
        s.sendall(_wire.listen_request(token, greeting, body))
        n = int.from_bytes(_recv(s, 4), "big")
        reply = _wire.reply_decoder.decode(_recv(s, n))
    assert not reply.ok and server.name in reply.error
    assert len(reply.error) < 1000, len(reply.error)


def test_a_region_name_longer_than_any_is_refused(agents: Any, monkeypatch: Any) -> None:
    from aioxfer.nixl._bindings import nixlInvalidParamError

    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    a = agents()
    ok = _wire.AgentMD(name="peer-x", regions=[_wire.RegionMD("r" * 256, 0, 4096, 4096, 0)])
    assert _wire.decode_md(_wire.encode_md(ok)) == ok
    for addr in (4096, 2**64 - 1):  # (a fitting region, one that does not fit)
        md = _wire.AgentMD(name="peer-x", regions=[_wire.RegionMD("r" * BIG, 0, addr, 4096, 0)])
        with pytest.raises(ValueError, match=f"region name of {BIG} characters") as info:
            _wire.decode_md(_wire.encode_md(md))
        assert len(str(info.value)) < 300
        with pytest.raises(nixlInvalidParamError) as err:
            a.add_remote_agent(_wire.encode_md(md))
        assert len(str(err.value)) < 300
    assert not a.agent._remotes

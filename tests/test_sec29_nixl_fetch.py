"""A NIXL compat fetch is answered only with the agent it asked for.

fetch_remote_metadata("A", ip, port) checked that the reply was proved
(a holder of the token answered this very request) and then loaded
whatever metadata it carried. Every agent of a deployment holds the one
token, so any of them, or a relay run by one (a misrouted port, a listener
of another agent on the address asked, a compromised worker), could answer
a fetch of A with B's metadata: the client loaded B (connected to it, its
ranges usable under B's name) and never got A. Here a relay holding the
token asks B's real listener for B's metadata and answers a real client's
fetch of A with that genuine, proved reply: the client must refuse it
(NIXL_ERR_MISMATCH, logged) and load nothing. On main it loaded B.
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

TOKEN = "sec29-nixl-fetch-token-0123456789"
STEP = 20.0


def _recv(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    assert len(data) == n, f"{len(data)} of {n} bytes"
    return data


class _Relay:
    """A token holder's listener: answers one client's request with the
    reply B's real listener gives to a Fetch of ``ask`` (re-proved for the
    client's request: it holds the token)."""

    def __init__(self, upstream: int, ask: str) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.upstream, self.ask = upstream, ask
        self.token = TOKEN.encode()
        self.asked: list[str] = []
        self.served = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _fetch_upstream(self) -> bytes:
        with socket.create_connection(("127.0.0.1", self.upstream), timeout=STEP) as up:
            greeting = _recv(up, _wire.LISTEN_NONCE)
            body = _wire.encoder.encode(_wire.Fetch(name=self.ask,
                                                    nonce=os.urandom(_wire.CLIENT_NONCE)))
            request = _wire.listen_request(self.token, greeting, body)
            up.sendall(request)
            head = _recv(up, 4)
            reply = _recv(up, int.from_bytes(head, "big"))
            mac = _recv(up, _wire.LISTEN_MAC)
            assert mac == _wire.reply_mac(self.token, greeting, request[-_wire.LISTEN_MAC:],
                                          head, reply)
            return reply

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(STEP)
            try:
                greeting = _wire.greeting()
                conn.sendall(greeting)
                head = _recv(conn, _wire.LISTEN_HEAD)
                body = _recv(conn, int.from_bytes(head[:4], "big"))
                req_mac = _recv(conn, _wire.LISTEN_MAC)
                assert req_mac == _wire.listen_body_mac(self.token, greeting, body)
                req = _wire.request_decoder.decode(body)
                assert isinstance(req, _wire.Fetch)
                self.asked.append(req.name)
                conn.sendall(_wire.reply_frame(self.token, greeting, req_mac,
                                               self._fetch_upstream()))
                self.served.set()
                while conn.recv(1 << 16):
                    pass
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self._thread.join(STEP)


@pytest.fixture
def client(agents: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")
    return agents()


def _wait_log(capfd: Any, what: str) -> list[str]:
    deadline = time.monotonic() + STEP
    lines: list[str] = []
    while not any(what in ln for ln in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
        lines += capfd.readouterr().err.splitlines()
    return lines


def test_a_fetch_of_a_answered_with_b_is_refused(client: Any, agents: Any, capfd: Any) -> None:
    a = agents(enable_listen_thread=True, listen_port=0)
    b = agents(enable_listen_thread=True, listen_port=0)
    relay = _Relay(b.agent.listen_port, b.name)
    try:
        capfd.readouterr()
        client.fetch_remote_metadata(a.name, "127.0.0.1", relay.port)
        assert relay.served.wait(STEP)
        assert relay.asked == [a.name]
        lines = _wait_log(capfd, "fetchRemoteMD failed")
        assert any("NIXL_ERR_MISMATCH" in ln and repr(b.name) in ln and repr(a.name) in ln
                   for ln in lines), lines
        time.sleep(0.2)  # (a load that went on regardless would show now)
        assert not client.check_remote_metadata(b.name), "B's metadata was loaded"
        assert not client.check_remote_metadata(a.name)
    finally:
        relay.close()
    # The same client still fetches A from A's own listener.
    client.fetch_remote_metadata(a.name, "127.0.0.1", a.agent.listen_port)
    deadline = time.monotonic() + STEP
    while not client.check_remote_metadata(a.name):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not client.check_remote_metadata(b.name)


def test_a_fetch_answered_with_our_own_metadata_is_refused(client: Any, agents: Any,
                                                           capfd: Any) -> None:
    """A fetch of ourselves (the name asked is ours, as a caller looping
    over every rank's name does), answered with our own metadata: never
    loaded as a remote agent (add_remote_agent refuses the same)."""
    relay_to = agents(enable_listen_thread=True, listen_port=0)
    relay = _Relay(relay_to.agent.listen_port, relay_to.name)
    # (Our own metadata, as a relay holding the token could make of it.)
    relay._fetch_upstream = lambda: _wire.encoder.encode(  # type: ignore[method-assign]
        _wire.Reply(ok=True, md=client.get_agent_metadata()))
    try:
        capfd.readouterr()
        client.fetch_remote_metadata(client.name, "127.0.0.1", relay.port)
        assert relay.served.wait(STEP)
        lines = _wait_log(capfd, "fetchRemoteMD failed")
        assert any("this very agent" in ln for ln in lines), lines
        assert client.name not in client.agent._remotes
    finally:
        relay.close()

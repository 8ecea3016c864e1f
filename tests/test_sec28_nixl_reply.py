"""The NIXL compat listener's replies are proved (listener wire version 3).

Before, a request proved the token and the reply did not: whoever answered
the client's connection (a process squatting on the listener's port while
the agent is down, a man in the middle) had its metadata believed. Here a
squatter without the token, and a replayer that recorded a genuine
listener's greeting and reply, each answer a real client's
fetch_remote_metadata: the client must refuse the reply (logged), not load
the metadata. On main (version 2: plain reply frames) both were loaded.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from aioxfer import auth
from aioxfer.nixl import _wire

TOKEN = "sec28-nixl-reply-token-0123456789"
STEP = 20.0


class _Squatter:
    """A listener without the token: sends a greeting of the client's
    version, reads the request whole, answers ``reply`` (bytes) and keeps
    the connection until the client closes."""

    def __init__(self, answer: Any) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answer = answer  # (conn) -> None
        self.served = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(STEP)
            try:
                self.answer(conn)
                self.served.set()
                while conn.recv(1 << 16):
                    pass
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self._thread.join(STEP)


def _read_request(conn: socket.socket) -> bytes:
    head = conn.recv(_wire.LISTEN_HEAD, socket.MSG_WAITALL)
    n = int.from_bytes(head[:4], "big")
    rest = conn.recv(n + _wire.LISTEN_MAC, socket.MSG_WAITALL)
    return head + rest


def _refused(capfd: Any, client: Any, name: str) -> list[str]:
    """The client's log lines once its fetch failed; fails at once if it
    loaded the metadata instead."""
    deadline = time.monotonic() + STEP
    lines: list[str] = []
    while not any("fetchRemoteMD" in ln for ln in lines):
        assert not client.check_remote_metadata(name), f"the metadata was loaded: {lines}"
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
        lines += capfd.readouterr().err.splitlines()
    return lines


@pytest.fixture
def client(agents: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")
    return agents()


def test_a_squatters_metadata_is_not_believed(client: Any, agents: Any, capfd: Any) -> None:
    """The squatter answers a fetch of "prefill-0" with metadata of its
    choosing: here another agent's (metadata is no secret: any agent's
    blob, from etcd or an earlier exchange), which main's client loaded
    as the answer, connection and all."""
    other = agents()
    forged = other.get_agent_metadata()

    def answer(conn: socket.socket) -> None:
        conn.sendall(_wire.greeting())
        _read_request(conn)
        body = _wire.encoder.encode(_wire.Reply(ok=True, md=forged))
        # (Its length and body, then 32 bytes where version 3's MAC goes:
        # a plain frame to a version-2 client, which reads no further.)
        conn.sendall(len(body).to_bytes(4, "big") + body + b"\0" * _wire.LISTEN_MAC)

    squat = _Squatter(answer)
    try:
        capfd.readouterr()
        client.fetch_remote_metadata("prefill-0", "127.0.0.1", squat.port)
        assert squat.served.wait(STEP)
        lines = _refused(capfd, client, other.name)
        assert any("without this agent's token" in ln for ln in lines), lines
        assert not client.check_remote_metadata(other.name), "the squatter's metadata was loaded"
    finally:
        squat.close()


def test_a_replayed_reply_is_not_believed(client: Any, agents: Any, capfd: Any) -> None:
    """A relay records a genuine exchange (the listener's greeting and its
    reply to the client's fetch), then, the listener gone, answers the
    client's next fetch with the recorded greeting and reply: the client's
    fresh nonce makes its request another, and the old reply's MAC does
    not prove the new one."""
    server = agents(enable_listen_thread=True, listen_port=0)
    real = server.agent.listen_port
    recorded: dict[str, bytes] = {}

    def relay(conn: socket.socket) -> None:
        with socket.create_connection(("127.0.0.1", real), timeout=STEP) as up:
            greeting = up.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)
            conn.sendall(greeting)
            up.sendall(_read_request(conn))
            reply = b""
            while chunk := up.recv(1 << 16):
                reply += chunk
            conn.sendall(reply)
            recorded.update(greeting=greeting, reply=reply)

    first = _Squatter(relay)
    try:
        client.fetch_remote_metadata(server.name, "127.0.0.1", first.port)
        assert first.served.wait(STEP)
        deadline = time.monotonic() + STEP
        while not client.check_remote_metadata(server.name):
            assert time.monotonic() < deadline, "a relayed genuine reply was not loaded"
            time.sleep(0.02)
    finally:
        first.close()
    client.remove_remote_agent(server.name)
    assert not client.check_remote_metadata(server.name)

    def replay(conn: socket.socket) -> None:
        conn.sendall(recorded["greeting"])
        _read_request(conn)
        conn.sendall(recorded["reply"])

    second = _Squatter(replay)
    try:
        capfd.readouterr()
        client.fetch_remote_metadata(server.name, "127.0.0.1", second.port)
        assert second.served.wait(STEP)
        lines = _refused(capfd, client, server.name)
        assert any("without this agent's token" in ln for ln in lines), lines
        assert not client.check_remote_metadata(server.name), "a replayed reply was loaded"
    finally:
        second.close()


def test_genuine_replies_still_work(client: Any, agents: Any) -> None:
    """Fetch, push and invalidate against a real listener (each reply
    proved), and a refusal's text still reaches the client."""
    server = agents(enable_listen_thread=True, listen_port=0)
    port = server.agent.listen_port
    client.fetch_remote_metadata(server.name, "127.0.0.1", port)
    deadline = time.monotonic() + STEP
    while not client.check_remote_metadata(server.name):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client.send_local_metadata("127.0.0.1", port)
    while not server.check_remote_metadata(client.name):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client.invalidate_local_metadata("127.0.0.1", port)
    while server.check_remote_metadata(client.name):
        assert time.monotonic() < deadline
        time.sleep(0.02)

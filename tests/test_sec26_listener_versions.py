"""The NIXL compat listener's wire version (aioxfer.nixl, _wire.WIRE_VERSION
2) against version 1 (main 07d60a7 and before: no version field) and a
later one, both ways: each side fails at once with a typed error or a log
line that names both versions, never as a bad token and never after a
timeout, and a client sends no proof to a listener of another version.

Raw sockets play the other version in every run; where main's wheel is
installed (/tmp/vM26, or $AIOXFER_OLD26_PYTHON) a real version-1 agent runs
in another process, as the listener and as the client.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from aioxfer import ProtocolError, auth
from aioxfer.nixl import _wire

TOKEN = "sec26-listener-versions"
OLD_PYTHON = os.environ.get("AIOXFER_OLD26_PYTHON", "/tmp/vM26/bin/python")
STEP = 20.0


def _v1_request(key: bytes, nonce: bytes, body: bytes) -> bytes:
    """A request as a version-1 client makes it (by hand: its contexts)."""
    head = len(body).to_bytes(4, "big")
    return (head + hmac.new(key, b"aioxfer-nixl-listen-len-v1\x00" + nonce + head,
                            hashlib.sha256).digest()
            + body + hmac.new(key, b"aioxfer-nixl-listen-body-v1\x00" + nonce + body,
                              hashlib.sha256).digest())


def _recv_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(1 << 16):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


@pytest.fixture
def listener(agents: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    return agents(enable_listen_thread=True, listen_port=0)


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "metadata listener" in ln]


def test_an_older_client_is_told_the_versions(listener: Any, capfd: Any) -> None:
    """A version-1 client with the token (its MACs under the version-1
    contexts over our greeting, which it reads as its nonce) gets a refusal
    naming both versions, the reply it raises as the listener's error text;
    the listener's line names version 1. On main it was served (no version
    on the wire to tell them apart); a version-1 client without the token
    is still closed unanswered."""
    port = listener.agent.listen_port
    fetch = _wire.encoder.encode(_wire.Fetch(name=listener.name))
    capfd.readouterr()
    with socket.create_connection(("127.0.0.1", port), timeout=STEP) as s:
        greeting = s.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)
        assert len(greeting) == _wire.LISTEN_NONCE
        s.sendall(_v1_request(auth.hmac_key(TOKEN.encode()), greeting, fetch))
        got = _recv_all(s)
    n = int.from_bytes(got[:4], "big")
    assert len(got) == 4 + n, got
    reply = _wire.reply_decoder.decode(got[4:])
    assert not reply.ok
    assert f"listener wire version {_wire.WIRE_VERSION}" in reply.error
    assert "client version 1" in reply.error
    with socket.create_connection(("127.0.0.1", port), timeout=STEP) as s:
        greeting = s.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)
        s.sendall(_v1_request(auth.hmac_key(b"another token"), greeting, fetch))
        assert _recv_all(s) == b""
    deadline = time.monotonic() + STEP
    lines: list[str] = []
    while not any("without this agent's token" in ln for ln in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
        lines += _lines(capfd.readouterr().err)
    assert any("a client of listener wire version 1" in ln for ln in lines), lines


def test_a_newer_clients_notice_is_logged(listener: Any, capfd: Any) -> None:
    """A client of a later version stops at our greeting and sends its
    notice: the listener names its version and closes, answering nothing."""
    port = listener.agent.listen_port
    capfd.readouterr()
    notice = _wire.NOTICE_MAGIC + (7).to_bytes(2, "big")
    notice += bytes(_wire.LISTEN_HEAD - len(notice))
    with socket.create_connection(("127.0.0.1", port), timeout=STEP) as s:
        greeting = s.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)
        assert _wire.greeting_version(greeting) == _wire.WIRE_VERSION
        s.sendall(notice)
        assert _recv_all(s) == b""
    deadline = time.monotonic() + STEP
    lines: list[str] = []
    while not any("listener wire version 7" in ln for ln in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
        lines += _lines(capfd.readouterr().err)


class _RawListener:
    """A listener of another version: sends ``greeting``, keeps what the
    client sends until it closes."""

    def __init__(self, greeting: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.got = b""
        self.done = threading.Event()
        self._greeting = greeting
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(STEP)
            conn.sendall(self._greeting)
            self.got = _recv_all(conn)
        self.done.set()

    def close(self) -> None:
        self.sock.close()


def _fetch_from(client: Any, port: int) -> BaseException:
    core = client.agent
    t0 = time.monotonic()
    with pytest.raises(ProtocolError) as info:
        core._rt.run(core._request("127.0.0.1", port, _wire.Fetch(name="x")), timeout=STEP)
    assert time.monotonic() - t0 < 5, "not at once"
    return info.value


def test_a_client_names_an_older_listener_and_sends_it_no_proof(
        agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A greeting without the magic is version 1's (16 random bytes): our
    client raises ListenerVersionError at once, and what it sends is a
    version-1 request that a version-1 listener cannot decode, its message
    type naming version 2 (what that listener logs); no version-2 MAC."""
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    client = agents()
    nonce = os.urandom(_wire.LISTEN_NONCE)
    old = _RawListener(nonce)
    try:
        exc = _fetch_from(client, old.port)
        assert isinstance(exc, _wire.ListenerVersionError)
        assert "listener wire version 1" in str(exc), exc
        assert f"this agent {_wire.WIRE_VERSION}" in str(exc), exc
        assert old.done.wait(STEP)
    finally:
        old.close()
    key = auth.hmac_key(TOKEN.encode())
    head, mac = old.got[:4], old.got[4:_wire.LISTEN_HEAD]
    n = int.from_bytes(head, "big")
    assert mac == hmac.new(key, b"aioxfer-nixl-listen-len-v1\x00" + nonce + head,
                           hashlib.sha256).digest()
    assert mac != _wire.listen_len_mac(TOKEN.encode(), nonce, head)
    body = old.got[_wire.LISTEN_HEAD:_wire.LISTEN_HEAD + n]
    with pytest.raises(ValueError, match=f"Invalid value 'aioxfer.nixl listener wire version "
                                         f"{_wire.WIRE_VERSION}"):
        _wire.request_decoder.decode(body)


def test_a_client_names_a_newer_listener_and_sends_only_its_notice(
        agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    client = agents()
    later = _wire.WIRE_VERSION + 1
    newer = _RawListener(_wire.GREETING_MAGIC + later.to_bytes(2, "big") + os.urandom(10))
    try:
        exc = _fetch_from(client, newer.port)
        assert isinstance(exc, _wire.ListenerVersionError)
        assert f"listener wire version {later}" in str(exc), exc
        assert f"this agent {_wire.WIRE_VERSION}" in str(exc), exc
        assert newer.done.wait(STEP)
    finally:
        newer.close()
    assert newer.got == _wire.version_notice()
    assert _wire.notice_version(newer.got) == _wire.WIRE_VERSION


# ---------------------------------------------------------------- a real version-1 agent

_OLD_LISTENER = """
import sys
from aioxfer.nixl import nixl_agent, nixl_agent_config
a = nixl_agent("old-listener", nixl_agent_config(enable_listen_thread=True, listen_port=0))
print("PORT", a.agent.listen_port, flush=True)
sys.stdin.read()
a.close()
"""

_OLD_CLIENT = """
import sys, time
from aioxfer.nixl import nixl_agent, nixl_agent_config
a = nixl_agent("old-client", nixl_agent_config())
a.fetch_remote_metadata(sys.argv[1], "127.0.0.1", int(sys.argv[2]))
t0 = time.monotonic()
while time.monotonic() - t0 < 3 and not a.check_remote_metadata(sys.argv[1]):
    time.sleep(0.05)
print("loaded" if a.check_remote_metadata(sys.argv[1]) else "not loaded", flush=True)
a.close()
"""


def _old_python() -> str:
    if not Path(OLD_PYTHON).exists():
        pytest.skip(f"no older aioxfer wheel at {OLD_PYTHON} (set $AIOXFER_OLD26_PYTHON)")
    probe = subprocess.run([OLD_PYTHON, "-c", "from aioxfer.nixl import _wire; "
                            "print(getattr(_wire, 'WIRE_VERSION', 1))"],
                           cwd="/", capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.skip(f"{OLD_PYTHON} is not an aioxfer of listener wire version 1")
    return OLD_PYTHON


def _env() -> dict[str, str]:
    env = dict(os.environ, AIOXFER_TOKEN=TOKEN)
    env.pop("PYTHONPATH", None)
    return env


def test_real_old_listener(agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Main's agent listens in another process: our fetch fails at once with
    ListenerVersionError naming version 1, and the old listener's log line
    names version 2 (not a bad token, not a timeout)."""
    python = _old_python()
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    old = subprocess.Popen([python, "-c", _OLD_LISTENER], cwd="/", env=_env(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    # The old listener's stderr read as it comes: it logs the request
    # after our client has already raised, so it is told to quit only
    # once its line is in (or STEP passed).
    got: list[str] = []
    seen = threading.Event()

    def read_err() -> None:
        assert old.stderr is not None
        for ln in old.stderr:
            got.append(ln)
            if "Invalid value" in ln or "without this agent's token" in ln:
                seen.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        assert old.stdout is not None
        line = ""
        while not line.startswith("PORT "):
            line = old.stdout.readline()
            assert line, "the old listener ended"
        port = int(line.split()[1])
        client = agents()
        exc = _fetch_from(client, port)
        assert isinstance(exc, _wire.ListenerVersionError), exc
        assert "listener wire version 1" in str(exc), exc
        seen.wait(STEP)
    finally:
        assert old.stdin is not None
        old.stdin.close()
        old.wait(timeout=STEP)
        reader.join(STEP)
    err = "".join(got)
    lines = _lines(err)
    want = f"Invalid value 'aioxfer.nixl listener wire version {_wire.WIRE_VERSION}"
    assert any(want in ln for ln in lines), err
    assert not any("without this agent's token" in ln for ln in lines), err


def test_real_old_client(listener: Any, capfd: Any) -> None:
    """Main's agent fetches from ours in another process: its fetch fails at
    once with our refusal naming both versions (its log), and our listener
    names version 1."""
    python = _old_python()
    capfd.readouterr()
    t0 = time.monotonic()
    done = subprocess.run([python, "-c", _OLD_CLIENT, listener.name,
                           str(listener.agent.listen_port)], cwd="/", env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[-1] == "not loaded", (done.stdout, done.stderr)
    assert (f"this metadata listener speaks listener wire version {_wire.WIRE_VERSION}, the "
            f"client version 1") in done.stderr, done.stderr
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + STEP
    lines: list[str] = []
    while not any("a client of listener wire version 1" in ln for ln in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
        lines += _lines(capfd.readouterr().err)
    assert sys.version_info >= (3, 11)

"""aioxfer.nixl against a hostile local process or peer (rev16's findings):
the metadata listener answers only clients that hold the agent's token and
bounds what the others make it hold, a forged metadata blob cannot aim a
transfer at another of a peer's regions, a peer's never-finished
notification is bounded, and the telemetry ring file is never opened through
a planted link. Each test failed before its fix."""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import PipeChild
from test_nixl import Buf, _wait

import aioxfer.nixl as nixl
from aioxfer.nixl import _bindings, _wire, nixl_agent, nixl_agent_config

STEP = 20.0


def _raw(port: int, data: bytes) -> bytes:
    """What a client without the token gets for ``data`` (a plain listener
    frame, as real NIXL's): all the listener sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=STEP) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except ConnectionResetError:  # closed with our request unread
            pass
    return out


def _frame(req: Any) -> bytes:
    body = _wire.encoder.encode(req)
    return len(body).to_bytes(4, "big") + body


def _swapped(md: bytes, address: bool) -> bytes:
    """``md`` with its two regions' names swapped (each name now says the
    other's address range), with or without the connection info."""
    m = _wire.decode_md(md)
    r0, r1 = m.regions
    regions = [_wire.RegionMD(r1.name, r0.mem, r0.addr, r0.nbytes, r0.dev),
               _wire.RegionMD(r0.name, r1.mem, r1.addr, r1.nbytes, r1.dev)]
    return _wire.encode_md(_wire.AgentMD(m.name, m.address if address else "",
                                         m.incarnation if address else 0, regions, False))


def _three(agents: Any, **conf: Any) -> tuple[Any, Any, Buf, Buf, Buf]:
    """Agent a with buffer x (9s); agent b with y1 (1s) and y2 (2s), each
    its own registration; a has loaded b's metadata."""
    a, b = agents(**conf), agents(**conf)
    n = 4096
    x, y1, y2 = Buf(n, 9), Buf(n, 1), Buf(n, 2)
    a.register_memory([(x.addr, n, 0, "")], "DRAM")
    b.register_memory([(y1.addr, n, 0, "")], "DRAM")
    b.register_memory([(y2.addr, n, 0, "")], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    return a, b, x, y1, y2


def _write(a: Any, b: Any, x: Buf, y: Buf) -> str:
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, x.n, 0)], "DRAM"),
                          a.get_xfer_descs([(y.addr, y.n, 0)], "DRAM"), b.name)
    a.transfer(h)
    return _wait(a, h)


# ---------------------------------------------------------------- forged ranges


@pytest.mark.parametrize("address", [False, True], ids=["descriptors-only", "with-conn-info"])
def test_forged_metadata_cannot_aim_a_write_at_another_region(agents: Any,
                                                              address: bool) -> None:
    """Metadata loaded from anywhere not authenticated (the central store, a
    listener's reply, the application) whose region names were swapped made
    a WRITE aimed at b's first buffer land in its second, DONE. Only ranges
    b's own metadata (over its authenticated connection) vouches for are
    used now: the forged ones resolve to nothing; b's real metadata again
    makes the same WRITE land where it is aimed."""
    a, b, x, y1, y2 = _three(agents)
    good = b.get_agent_metadata()
    assert a.add_remote_agent(_swapped(good, address)) == b.name.encode()
    with pytest.raises(nixl.nixlNotFoundError):
        _write(a, b, x, y1)
    assert (y1.np == 1).all() and (y2.np == 2).all()
    assert not a.check_remote_metadata(b.name, a.get_xfer_descs([(y1.addr, y1.n, 0)], "DRAM"))
    assert a.add_remote_agent(good) == b.name.encode()
    assert _write(a, b, x, y1) == "DONE"
    assert (y1.np == 9).all() and (y2.np == 2).all()


# ---------------------------------------------------------------- the listener


def test_listener_refuses_a_push_without_the_token(agents: Any) -> None:
    """A local process without the token (another user's too) pushed b's
    metadata with its regions swapped to a's listener: accepted, and a's next
    WRITE to b's first buffer landed in its second. Refused now, before its
    body is read; a's WRITE lands where it is aimed."""
    a, b, x, y1, y2 = _three(agents, enable_listen_thread=True, listen_port=0)
    forged = _swapped(b.get_agent_metadata(), False)
    answer = _raw(a.agent.listen_port, _frame(_wire.Push(md=forged)))
    assert _write(a, b, x, y1) == "DONE"
    assert (y1.np == 9).all() and (y2.np == 2).all()
    assert len(answer) == _wire.LISTEN_NONCE, answer  # a nonce, then closed: no reply


def test_listener_refuses_invalidate_and_fetch_without_the_token(agents: Any) -> None:
    """A local process without the token made a forget its peer b
    (Invalidate: a's transfers to b then failed NOT_FOUND), and was handed
    a's metadata, region addresses included (Fetch). Both refused now."""
    a, b, x, y1, _y2 = _three(agents, enable_listen_thread=True, listen_port=0)
    answer = _raw(a.agent.listen_port, _frame(_wire.Invalidate(name=b.name)))
    assert a.check_remote_metadata(b.name), "b forgotten on a request without the token"
    assert _write(a, b, x, y1) == "DONE"
    assert len(answer) == _wire.LISTEN_NONCE, answer  # a nonce, then closed: no reply
    answer = _raw(a.agent.listen_port, _frame(_wire.Fetch(name=a.name)))
    assert len(answer) == _wire.LISTEN_NONCE, answer


def test_listener_holds_little_for_a_client_without_the_token(agents: Any) -> None:
    """Every connection could announce a 64 MiB frame, buffered whole before
    any check (4 connections: +256 MiB). Now such a client is cut off after
    its first 4 + LISTEN_MAC bytes: what it manages to send is what the
    kernel's socket buffers take."""
    a = agents(enable_listen_thread=True, listen_port=0)
    chunk = b"\0" * (1 << 20)
    with socket.create_connection(("127.0.0.1", a.agent.listen_port), timeout=STEP) as s:
        sent = 0
        try:
            s.sendall((64 << 20).to_bytes(4, "big"))
            while sent < 63 << 20:
                sent += s.send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent < 32 << 20, f"the listener took {sent >> 20} MiB from a client without the token"


def test_listener_serves_a_bounded_number_of_connections(agents: Any) -> None:
    """Idle connections each held a task and a socket, without limit. Past
    MAX_LISTEN_CONNS at once the next takes the place of the oldest that has
    not proved the token (fuzz17: closing the next one instead let idle
    clients keep a token holder out); once they go, a client with the token
    is served again."""
    t = agents(enable_listen_thread=True, listen_port=0)
    i = agents()
    port = t.agent.listen_port
    idle = []
    try:
        for _ in range(_wire.MAX_LISTEN_CONNS):
            s = socket.create_connection(("127.0.0.1", port), timeout=STEP)
            idle.append(s)
            assert len(s.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)) == _wire.LISTEN_NONCE
        assert len(_raw(port, b"")) == _wire.LISTEN_NONCE
        try:  # the oldest, closed for it
            assert idle[0].recv(1) == b""
        except ConnectionResetError:
            pass
        assert t.agent._listen_conns <= _wire.MAX_LISTEN_CONNS
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + STEP
    while t.agent._listen_conns:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    i.fetch_remote_metadata(t.name, "127.0.0.1", port)
    deadline = time.monotonic() + STEP
    while not i.check_remote_metadata(t.name):
        assert time.monotonic() < deadline


def token_child_main(conn: Any, token: str) -> None:
    """A compat agent in its own process (with ``token`` as AIOXFER_TOKEN,
    if any): sends the listener request it is told to, answers how it went."""
    if token:
        os.environ["AIOXFER_TOKEN"] = token
    from aioxfer.nixl import _wire, nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    buf = (ctypes.c_char * 4096)()
    agent.register_memory([(ctypes.addressof(buf), 4096, 0, "")], "DRAM")
    conn.send(agent.name)
    core = agent.agent
    while (msg := conn.recv()) != "quit":
        what, port, *name = msg
        req = (_wire.Push(md=core.getLocalMD()) if what == "push"
               else _wire.Invalidate(name=name[0]))
        try:  # (send_local_metadata's request, waited for)
            core._rt.run(core._request("127.0.0.1", port, req), timeout=STEP)
            conn.send("ok")
        except Exception as exc:
            conn.send(f"refused: {type(exc).__name__}")
    agent.close()
    conn.send("bye")


@pytest.mark.parametrize("same_token", [True, False], ids=["same-token", "other-token"])
def test_listener_serves_another_process_only_with_the_token(agents: Any,
                                                             same_token: bool) -> None:
    """Another process's compat agent pushes its metadata to our listener,
    then invalidates a peer we loaded: both served when it holds our token
    (the same user's default token, as aioxfer's own connections need);
    both refused with another one (its Invalidate was served: we forgot b)."""
    t, b = agents(enable_listen_thread=True, listen_port=0), agents()
    assert t.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    child = PipeChild(token_child_main, "" if same_token else secrets.token_hex(16),
                      seconds=STEP)
    try:
        name = child.hello
        port = t.agent.listen_port
        pushed = child.call(("push", port))
        invalidated = child.call(("invalidate", port, b.name))
        if same_token:
            assert (pushed, invalidated) == ("ok", "ok")
            assert t.check_remote_metadata(name) and not t.check_remote_metadata(b.name)
        else:
            assert t.check_remote_metadata(b.name), "b forgotten on another token's request"
            assert pushed.startswith("refused") and invalidated.startswith("refused")
            assert not t.check_remote_metadata(name)
    finally:
        child.close()


# ---------------------------------------------------------------- notifications


def test_a_never_finished_notification_is_bounded(agents: Any,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """A peer that sends the first fragments of a message and never its last
    one: the receiver held every fragment, without bound (4,000 of them:
    16 MB). Past _MAX_PARTIAL_BYTES (here 1 MiB) that message is dropped,
    logged, and so is its last fragment when it comes (never a truncated
    message); the sender's next messages arrive whole."""
    monkeypatch.setattr(_wire, "_MAX_PARTIAL_BYTES", 1 << 20, raising=False)
    a, b = agents(), agents()
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    assert b.add_remote_agent(a.get_agent_metadata()) == a.name.encode()
    peer = a.agent._peer_of(b.name, "test")
    mid = os.urandom(8)
    frame = _wire.NOTIF_MAGIC + b"F" + mid + b"x" * _wire._CHUNK
    got: list[bytes] = []

    def send_then_take(frames: list[bytes], last: bytes) -> None:
        for k in range(0, len(frames), 128):
            a.agent._rt.run(_bindings._send_notifs(peer, frames[k:k + 128]), timeout=STEP)
            got.extend(b.get_new_notifs().get(a.name, []))  # (the engine's credits)
        a.send_notif(b.name, last)
        deadline = time.monotonic() + STEP
        while last not in got:
            assert time.monotonic() < deadline, "notifications did not arrive"
            got.extend(b.get_new_notifs().get(a.name, []))

    n = 3 * (1 << 20) // _wire._CHUNK  # 3 MiB of one message's fragments
    send_then_take([frame] * n, b"mark")
    held = b.agent._assembler.held() if hasattr(b.agent._assembler, "held") else None
    last = _wire.NOTIF_MAGIC + b"L" + mid + b"end"
    big = os.urandom(600_000)  # a message under the bound, after: whole
    send_then_take([last, *_wire.notif_frames(big)], b"done")
    assert [m for m in got if len(m) > 100_000] == [big], "the dropped message was delivered"
    assert got == [b"mark", big, b"done"]
    assert held is not None and held <= 1 << 20
    assert b.agent._assembler.held() == 0
    assert "never finished" in capfd.readouterr().err


# ---------------------------------------------------------------- telemetry file


PRECIOUS = b"precious" * 64


def _telemetry_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: Any) -> Path:
    """Makes (and closes) an agent whose ring file's path holds what
    ``plant(path, victim)`` put there; returns the victim file (PRECIOUS)."""
    name = str(uuid.uuid4())
    tel = tmp_path / "tel"
    tel.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    plant(tel / name, victim)
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tel))
    try:
        nixl_agent(name, nixl_agent_config(capture_telemetry=True)).close()
    except RuntimeError:  # refused: the exporter could not be created
        pass
    return victim


def test_telemetry_file_is_not_opened_through_a_planted_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link planted at $NIXL_TELEMETRY_DIR/<agent name> (a shared /tmp, a
    predictable name) was followed: the file it named was truncated and
    became the ring. The agent is refused now (as NIXL refuses an exporter
    it cannot create); the file is untouched."""
    victim = _telemetry_agent(tmp_path, monkeypatch,
                              lambda path, victim: path.symlink_to(victim))
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_telemetry_file_of_another_user_is_not_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file another user made at the ring's path was truncated and shared
    (they read and write the agent's ring). Refused now; it is untouched."""
    import pwd

    nobody = pwd.getpwnam("nobody")

    def plant(path: Path, victim: Path) -> None:
        path.write_bytes(victim.read_bytes())
        os.chown(path, nobody.pw_uid, nobody.pw_gid)

    _telemetry_agent(tmp_path, monkeypatch, plant)
    planted = next((tmp_path / "tel").iterdir())
    assert planted.read_bytes() == PRECIOUS

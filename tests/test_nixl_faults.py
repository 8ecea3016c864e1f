"""aioxfer.nixl under faults: hostile metadata, a listener that never
answers, notifications whose transfer failed half-way. Each test here failed
before the fix it names in its docstring."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import pytest
from test_nixl import Buf, _wait

import aioxfer.nixl as nixl
from aioxfer.nixl import _wire, nixl_agent, nixl_agent_config

STEP = 20.0
NIXL_ERRORS = (nixl.nixlInvalidParamError, nixl.nixlNotFoundError, nixl.nixlBackendError,
               nixl.nixlMismatchError)



@pytest.mark.parametrize("addr,nbytes,dev", [
    (2**64 - 16, 64, 0),  # the range wraps past 2**64
    (4096, -1, 0),  # negative length
    (-4096, 64, 0),  # negative address
    (4096, 64, -1),  # negative device
])
def test_hostile_region_values_in_metadata_are_a_typed_error(agents: Any, addr: int, nbytes: int,
                                                             dev: int) -> None:
    """Metadata whose region does not fit 64 bits (values a peer controls)
    was loaded as it was; preparing a list against it then raised numpy's
    OverflowError, untyped."""
    a = agents()
    md = _wire.encode_md(_wire.AgentMD("hostile", regions=[
        _wire.RegionMD("r0", int(nixl.DRAM_SEG), addr, nbytes, dev)]))
    descs = a.get_xfer_descs([(4096, 64, 0)], "DRAM")
    with pytest.raises(NIXL_ERRORS):
        a.add_remote_agent(md)
        a.prep_xfer_dlist("hostile", descs)


def _notifs(agent: Any, want: int) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + STEP
    while len(got) < want:
        assert time.monotonic() < deadline, f"got {len(got)} of {want} notifications"
        for msgs in agent.get_new_notifs().values():
            got.extend(msgs)
    return got


def test_a_framed_notification_whose_write_failed_does_not_corrupt_the_next(
        agents: Any) -> None:
    """A notification over 4 KiB goes in fragments, the last one carried by
    the WRITE; when the WRITE failed, the fragments already delivered stayed
    with the receiver and were glued in front of the sender's next large
    message (which then arrived corrupted)."""
    a, b = agents(), agents()
    x, y = Buf(4096, 1), Buf(4096, 2)
    ra = a.register_memory([(x.addr, 4096, 0, "")], "DRAM")
    rb = b.register_memory([(y.addr, 4096, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 4096, 0)], "DRAM"),
                          b.get_xfer_descs([(y.addr, 4096, 0)], "DRAM"), b.name)
    b.deregister_memory(rb)  # the WRITE below fails at b
    first = b"1" * 10000
    with pytest.raises(NIXL_ERRORS + (nixl.nixlRemoteDisconnectError,)):
        a.transfer(h, first)
        _wait(a, h)
    a.release_xfer_handle(h)
    second = b"2" * 10000
    a.send_notif(b.name, second)
    assert _notifs(b, 1) == [second]
    a.deregister_memory(ra)


def test_a_listener_that_never_answers_leaves_no_socket_after_close(agents: Any) -> None:
    """fetch_remote_metadata from a listener that accepts and then says
    nothing waited for its answer for ever (no bound on the read), and the
    agent's close left that wait and its socket open."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(STEP)
    try:
        a = agents()
        a.fetch_remote_metadata("nobody", "127.0.0.1", srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            a.close()
            conn.settimeout(5.0)
            while conn.recv(1 << 16):  # the request, then the end of it
                pass
    finally:
        srv.close()


BIG = 64 << 20


def big_request(a: Any, md: bytes, raddr: int, op: str, n: int) -> tuple[Any, str, Any]:
    """On agent a: a BIG host buffer registered, the peer's metadata md
    loaded, and one request of n equal blocks between the buffer and the
    peer's BIG region at raddr (notifying b"done"), prepared: (its handle,
    the peer's name, the buffer, which must outlive the request)."""
    buf = (ctypes.c_char * BIG)()
    addr = ctypes.addressof(buf)
    a.register_memory([(addr, BIG, 0, "")], "DRAM")
    rname = a.add_remote_agent(md)
    blk = BIG // n
    local = a.get_xfer_descs([(addr + i * blk, blk, 0) for i in range(n)], "DRAM")
    remote = a.get_xfer_descs([(raddr + i * blk, blk, 0) for i in range(n)], "DRAM")
    return a.initialize_xfer(op, local, remote, rname, b"done"), rname, buf


def big_producer_main(conn: Any, transports: str) -> None:
    """A peer with a large pool: answers "quit"; killed by the tests."""
    import ctypes
    import os

    if transports:
        os.environ["AIOXFER_NIXL_TRANSPORTS"] = transports
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = (ctypes.c_char * BIG)()
    addr = ctypes.addressof(pool)
    agent.register_memory([(addr, BIG, 0, "")], "DRAM")
    conn.send((agent.name, agent.get_agent_metadata(), addr, os.getpid()))
    while True:
        for msgs in agent.get_new_notifs().values():
            conn.send(msgs)
        if conn.poll(0.01) and conn.recv() == "quit":
            agent.close()
            conn.send("bye")
            return


def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


@pytest.mark.parametrize("transports", ["", "tcp"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_peer_killed_mid_transfer_fails_the_transfer_in_flight(transports: str, op: str,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """SIGKILL of the peer right after each post of a 64 MiB request: the
    request in flight ends with nixlRemoteDisconnectError (or ERR) at once,
    never PROC for ever, never an untyped exception."""
    from conftest import PipeChild

    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    child = PipeChild(big_producer_main, transports, seconds=STEP)
    name, md, raddr, pid = child.hello
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    try:
        h, rname, _buf = big_request(a, md, raddr, op, 256)
        states = []
        t0 = time.monotonic()
        try:
            for _ in range(3):
                st = a.transfer(h)
                os.kill(pid, signal.SIGKILL)
                while st == "PROC":
                    st = a.check_xfer_state(h)
                    assert time.monotonic() - t0 < STEP, "stuck in PROC"
                states.append(st)
        except nixl.nixlRemoteDisconnectError:
            states.append("raised")
        assert states[-1] in ("raised", "ERR"), states
        a.release_xfer_handle(h)
        a.remove_remote_agent(rname)
    finally:
        a.close()
        child.close()


NIXL_ANY = NIXL_ERRORS + (nixl.nixlRemoteDisconnectError, nixl.nixlCancelledError)


def _settle(agent: Any, h: Any) -> str:
    """The request's end: "DONE", "ERR" or the NIXL error's name; never an
    untyped exception, never PROC for ever."""
    deadline = time.monotonic() + STEP
    try:
        while (st := agent.check_xfer_state(h)) == "PROC":
            assert time.monotonic() < deadline, "stuck in PROC"
        return str(st)
    except NIXL_ANY as exc:
        return type(exc).__name__


@pytest.mark.parametrize("transports", ["", "tcp"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("what", ["remove", "deregister_local", "deregister_remote",
                                  "release_dlist", "close_remote"])
def test_teardown_with_a_transfer_in_flight(agents: Any, transports: str, op: str, what: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each teardown step of a client (or of the peer) right after a post:
    the request ends, DONE or with a NIXL error, never an untyped one or
    PROC for ever; deregistering waits for it (a safe wait, found fine)."""
    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    a, b = agents(), agents()
    n = 16 << 20
    x, y = Buf(n, 1), Buf(n, 2)
    ra = a.register_memory([(x.addr, n, 0, "")], "DRAM")
    rb = b.register_memory([(y.addr, n, 0, "")], "DRAM")
    name = a.add_remote_agent(b.get_agent_metadata())
    k = 64
    blk = n // k
    local = a.prep_xfer_dlist("", [(x.addr + i * blk, blk, 0) for i in range(k)], "DRAM")
    remote = a.prep_xfer_dlist(name, [(y.addr + i * blk, blk, 0) for i in range(k)], "DRAM")
    h = a.make_prepped_xfer(op, local, list(range(k)), remote, list(range(k)), b"n")
    a.transfer(h)
    if what == "remove":
        a.remove_remote_agent(name)
    elif what == "deregister_local":
        a.deregister_memory(ra)
    elif what == "deregister_remote":
        b.deregister_memory(rb)
    elif what == "release_dlist":
        a.release_dlist_handle(local)
        a.release_dlist_handle(remote)
    else:
        b.close()
    assert _settle(a, h) in {"DONE", "nixlRemoteDisconnectError", "nixlBackendError",
                             "nixlCancelledError"}
    a.release_xfer_handle(h)
    a.release_xfer_handle(h)  # idempotent


def test_close_with_transfers_in_flight_leaves_no_fd_or_thread(agents: Any) -> None:
    """Closing both agents with a WRITE in flight: every fd and thread the
    pair opened goes (found fine)."""
    a, b = agents(), agents()  # (the runtime's loop thread, before the baseline)
    n = 16 << 20
    before_fds, before_threads = _fds(), {t.ident for t in threading.enumerate()}
    a2, b2 = agents(), agents()
    x, y = Buf(n, 1), Buf(n, 2)
    a2.register_memory([(x.addr, n, 0, "")], "DRAM")
    b2.register_memory([(y.addr, n, 0, "")], "DRAM")
    name = a2.add_remote_agent(b2.get_agent_metadata())
    hs = [a2.initialize_xfer(op, a2.get_xfer_descs([(x.addr, n, 0)], "DRAM"),
                             a2.get_xfer_descs([(y.addr, n, 0)], "DRAM"), name, b"m")
          for op in ("WRITE",)]
    for h in hs:
        a2.transfer(h)
    a2.close()
    b2.close()
    deadline = time.monotonic() + STEP
    while _fds() - before_fds or {t.ident for t in threading.enumerate()} - before_threads:
        assert time.monotonic() < deadline, (_fds() - before_fds, threading.enumerate())
        time.sleep(0.05)
    del a, b


def test_malformed_metadata_is_a_typed_error(agents: Any) -> None:
    """Truncated, damaged or foreign metadata (found fine: typed errors)."""
    a, b = agents(), agents()
    good = b.get_agent_metadata()
    bad = [b"", b"garbage", good[:len(good) // 2], good[:8], good[:8] + b"\xc1" * 40,
           good[:9], _wire.MD_MAGIC + _wire.encoder.encode({"name": 5}),
           _wire.MD_MAGIC + _wire.encoder.encode({"name": ""}),
           _wire.MD_MAGIC + _wire.encoder.encode({"name": "x", "regions": [[1, 2]]})]
    for md in bad:
        with pytest.raises(NIXL_ERRORS):
            a.add_remote_agent(md)
    assert not a.check_remote_metadata("x")
    assert a.add_remote_agent(good) == b.name.encode()


def test_listener_survives_garbage_and_half_messages(agents: Any) -> None:
    """Garbage, a header then a close, and an oversized length at the
    metadata listener: each closes that connection only (found fine)."""
    t, i = agents(enable_listen_thread=True, listen_port=0), agents()
    port = t.agent.listen_port
    for junk in (b"\x00\x00\x00\x05hello", b"\x00\x00\x10", b"\xff\xff\xff\xff" + b"x" * 64,
                 b"\x00\x00\x00\x40" + b"y" * 10):
        with socket.create_connection(("127.0.0.1", port), timeout=STEP) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass
    i.fetch_remote_metadata(t.name, "127.0.0.1", port)
    deadline = time.monotonic() + STEP
    while not i.check_remote_metadata(t.name):
        assert time.monotonic() < deadline


def test_threads_post_poll_release_and_churn_agents_at_once(agents: Any) -> None:
    """Posting and polling, releasing, removing and re-adding the peer and
    reading notifications from four threads: only NIXL errors, no deadlock
    (found fine)."""
    a, b = agents(), agents()
    n = 1 << 16
    x, y = Buf(n, 1), Buf(n, 2)
    a.register_memory([(x.addr, n, 0, "")], "DRAM")
    b.register_memory([(y.addr, n, 0, "")], "DRAM")
    md = b.get_agent_metadata()
    name = a.add_remote_agent(md)
    stop = threading.Event()
    errors: list[BaseException] = []
    handles: list[Any] = []

    def guard(fn: Any) -> Any:
        def run() -> None:
            while not stop.is_set():
                try:
                    fn()
                except NIXL_ANY:
                    pass
                except BaseException as exc:  # reported below
                    errors.append(exc)
                    return
        return run

    def post() -> None:
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 4096, 0)], "DRAM"),
                              a.get_xfer_descs([(y.addr, 4096, 0)], "DRAM"), name, b"p")
        handles.append(h)
        a.transfer(h)
        _settle(a, h)

    def release() -> None:
        if handles:
            a.release_xfer_handle(handles.pop(0))
        time.sleep(0.001)

    def churn() -> None:
        a.remove_remote_agent(name)
        a.add_remote_agent(md)

    def notifs() -> None:
        b.get_new_notifs()
        a.get_new_notifs()

    threads = [threading.Thread(target=guard(f)) for f in (post, release, churn, notifs)]
    for th in threads:
        th.start()
    time.sleep(2.0)
    stop.set()
    for th in threads:
        th.join(STEP)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors

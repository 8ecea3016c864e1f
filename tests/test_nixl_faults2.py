"""aioxfer.nixl under faults, second review (nixl_agent, its telemetry):
hostile telemetry files and settings, an agent used after close, a peer
frozen or killed around the agent's calls. A test whose docstring names
what failed failed before its fix; "found fine" ones pass and stay as
checks."""

from __future__ import annotations

import mmap
import struct
import time
import uuid
from typing import Any

import pytest
from test_nixl import Buf

import aioxfer.nixl as nixl
from aioxfer.nixl import _telemetry, nixl_agent, nixl_agent_config

STEP = 20.0



# ---------------------------------------------------------------- telemetry


def _header(path: Any) -> tuple[int, ...]:
    return struct.unpack_from("<QQiiQQ", path.read_bytes(), 0)


def _event_at(path: Any, i: int) -> tuple[str, int]:
    etype, value = struct.unpack_from("<I4xQ", path.read_bytes(), 40 + 16 * i)
    return _telemetry.EVENT_NAMES[etype], value


@pytest.mark.parametrize("write_pos", [4096 + 906, 2**63 + 17])
def test_telemetry_ring_with_a_write_position_out_of_range_keeps_writing(
        agents: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, write_pos: int) -> None:
    """The ring's header is a shared file any reader can write: a
    write_pos past the capacity (a buggy or hostile reader) was used as an
    index as it was: numpy's ValueError out of the loop's flush timer, which
    then never ran again (every later event of the agent lost), or events
    written nowhere."""
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_TELEMETRY_RUN_INTERVAL", "5")
    a = agents(capture_telemetry=True)
    path = tmp_path / a.name
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        struct.pack_into("<Q", mm, 0, write_pos)
    buf = Buf(8192)
    for n in (4096, 8192):
        a.deregister_memory(a.register_memory([(buf.addr, n, 0, "")], "DRAM"))
        deadline = time.monotonic() + STEP
        while True:
            wp, _, _, _, capacity, mask = _header(path)
            if wp < capacity and _event_at(path, (wp - 1) & mask) == (
                    "agent_memory_deregistered", n):
                break
            assert time.monotonic() < deadline, ("events not written", wp)
            time.sleep(0.005)
        assert _event_at(path, (wp - 2) & mask) == ("agent_memory_registered", n)


@pytest.mark.parametrize("size", [2**59, 2**62, 2**64, 2**70])
def test_telemetry_buffer_size_past_what_a_file_holds_refuses_the_agent_typed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, size: int) -> None:
    """NIXL_TELEMETRY_BUFFER_SIZE whose ring file is past off_t (or the
    value past size_t) raised OverflowError out of os.ftruncate, untyped;
    now RuntimeError, as NIXL's refusal of an exporter it cannot create (and
    its 'out of range' for a value past size_t)."""
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_TELEMETRY_BUFFER_SIZE", str(size))
    with pytest.raises(RuntimeError):
        nixl_agent(str(uuid.uuid4()), nixl_agent_config(capture_telemetry=True))


# ---------------------------------------------------------------- after close

NIXL_ERRORS = tuple(getattr(nixl, n) for n in nixl.__all__ if n.endswith("Error"))


def test_register_memory_after_close_is_a_typed_error(agents: Any) -> None:
    """register_memory on a closed agent (or racing its close from another
    thread) raised AssertionError, untyped: its backends stay, its aioxfer
    agent is gone."""
    a = agents()
    buf = Buf(4096)
    a.close()
    with pytest.raises(NIXL_ERRORS):
        a.register_memory([(buf.addr, 4096, 0, "")], "DRAM")


def test_create_backend_after_close_is_refused_and_opens_nothing(agents: Any) -> None:
    """create_backend("UCX") on a closed agent started a new aioxfer agent
    (listening sockets, accept tasks) that nothing ever closed: close() is
    done once, and __del__ skips a closed agent."""
    import os

    a = agents(backends=[])
    a.close()
    before = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(NIXL_ERRORS):
            a.create_backend("UCX")
    finally:
        leaked = a.agent._agent
        if leaked is not None:  # (what the fix prevents: closed here by hand)
            a.agent._rt.run(leaked.aclose(), timeout=STEP)
    assert set(os.listdir("/proc/self/fd")) <= before


# ---------------------------------------------------------------- a peer frozen or killed


def _peer_and_request(transports: str, monkeypatch: pytest.MonkeyPatch,
                      **conf: Any) -> tuple[Any, Any, Any, int, Buf]:
    """A peer process (test_nixl_faults' big producer), an agent of ours and
    a 64 MiB WRITE to it, done once (connected)."""
    from conftest import PipeChild
    from test_nixl_faults import BIG, big_producer_main

    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    child = PipeChild(big_producer_main, transports, seconds=STEP)
    name, md, raddr, pid = child.hello
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(**conf))
    buf = Buf(BIG)
    a.register_memory([(buf.addr, BIG, 0, "")], "DRAM")
    rname = a.add_remote_agent(md)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(buf.addr, BIG, 0)], "DRAM"),
                          a.get_xfer_descs([(raddr, BIG, 0)], "DRAM"), rname, b"w")
    a.transfer(h)
    deadline = time.monotonic() + STEP
    while a.check_xfer_state(h) == "PROC":
        assert time.monotonic() < deadline
    return child, a, h, pid, buf


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_peer_frozen_mid_transfer_fails_it_within_the_liveness_bound(
        transports: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP of the peer with a WRITE in flight (its kernel still holds the
    sockets open): the request ends with nixlRemoteDisconnectError once the
    peer is silent past aioxfer's liveness bound (5 s), not PROC for ever;
    notifying it then is refused typed; release and close return at once
    (found fine)."""
    import os
    import signal

    child, a, h, pid, _buf = _peer_and_request(transports, monkeypatch)
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(nixl.nixlRemoteDisconnectError):
            st = a.transfer(h)
            while st == "PROC":
                assert time.monotonic() - t0 < STEP, "stuck in PROC"
                st = a.check_xfer_state(h)
        with pytest.raises(nixl.nixlRemoteDisconnectError):
            a.send_notif(child.hello[0], b"after")
        h.release()
        a.close()
    finally:
        os.kill(pid, signal.SIGKILL)
        a.close()
        child.close()


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_peer_killed_under_future_and_await_and_counted_in_telemetry(
        transports: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """SIGKILL of the peer right after a post: the request's future() and
    ``await handle`` (aioxfer extensions) end with nixlRemoteDisconnectError
    at once, and each failure is one agent_err_remote_disconnect event in
    the telemetry file, as NIXL counts them (found fine)."""
    import asyncio
    import os
    import signal

    from test_nixl import _ring_events

    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    child, a, h, pid, _buf = _peer_and_request(transports, monkeypatch,
                                               capture_telemetry=True)
    try:
        a.transfer(h)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(nixl.nixlRemoteDisconnectError):
            h.future().result(STEP)

        async def again() -> str:
            a.transfer(h)
            return await h

        with pytest.raises(nixl.nixlRemoteDisconnectError):
            asyncio.run(asyncio.wait_for(again(), STEP))
        h.release()
        a.close()
        names = [e for e, _ in _ring_events(tmp_path / a.name)[1]]
        assert names.count("agent_err_remote_disconnect") == 2, names
        assert names.count("agent_tx_requests_num") == 1, names
    finally:
        a.close()
        child.close()


def named_peer_main(conn: Any, name: str, fill: int, transports: str) -> None:
    """A peer named ``name`` with a 1 MiB buffer of ``fill``: answers "sum"
    (its buffer's byte sum) and "quit"; killed by the tests."""
    import ctypes
    import os

    if transports:
        os.environ["AIOXFER_NIXL_TRANSPORTS"] = transports
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config())
    n = 1 << 20
    pool = (ctypes.c_char * n)(*([fill] * n))
    addr = ctypes.addressof(pool)
    agent.register_memory([(addr, n, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), addr, os.getpid()))
    while True:
        agent.get_new_notifs()
        if conn.poll(0.01):
            msg = conn.recv()
            if msg == "sum":
                conn.send(sum(pool.raw))
            elif msg == "quit":
                agent.close()
                conn.send("bye")
                return


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_peer_restarted_under_the_same_name_after_sigkill(
        transports: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer SIGKILLed, then started again under the same name (a worker
    restarting): after remove_remote_agent and add_remote_agent of its new
    metadata, a READ reads the new process's memory and a WRITE lands there,
    nothing of the dead one's connection or regions used."""
    import os
    import signal

    from conftest import PipeChild

    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    n = 1 << 20
    pname = str(uuid.uuid4())
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    buf = Buf(n)
    a.register_memory([(buf.addr, n, 0, "")], "DRAM")
    first = PipeChild(named_peer_main, pname, 1, transports, seconds=STEP)
    second = None
    try:
        md, raddr, pid = first.hello

        def read(raddr: int) -> Any:
            h = a.initialize_xfer("READ", a.get_xfer_descs([(buf.addr, n, 0)], "DRAM"),
                                  a.get_xfer_descs([(raddr, n, 0)], "DRAM"), pname)
            a.transfer(h)
            deadline = time.monotonic() + STEP
            while (st := a.check_xfer_state(h)) == "PROC":
                assert time.monotonic() < deadline
            return st, h

        assert a.add_remote_agent(md) == pname.encode()
        assert read(raddr)[0] == "DONE" and set(buf.np) == {1}
        os.kill(pid, signal.SIGKILL)
        first.proc.join(STEP)
        second = PipeChild(named_peer_main, pname, 2, transports, seconds=STEP)
        md2, raddr2, _ = second.hello
        with pytest.raises(nixl.nixlRemoteDisconnectError):
            read(raddr)  # (the dead one's, before its removal)
        a.remove_remote_agent(pname)
        assert a.add_remote_agent(md2) == pname.encode()
        st, h = read(raddr2)
        assert st == "DONE" and set(buf.np) == {2}
        buf.np[:] = 3
        w = a.initialize_xfer("WRITE", a.get_xfer_descs([(buf.addr, n, 0)], "DRAM"),
                              a.get_xfer_descs([(raddr2, n, 0)], "DRAM"), pname)
        a.transfer(w)
        deadline = time.monotonic() + STEP
        while a.check_xfer_state(w) == "PROC":
            assert time.monotonic() < deadline
        assert second.call("sum") == 3 * n
    finally:
        a.close()
        first.close()
        if second is not None:
            second.close()


# ---------------------------------------------------------------- handles of another agent


def test_a_handle_of_another_agent_never_posts_this_agents_request(agents: Any) -> None:
    """Two agents of one process number their requests alike: a.transfer(hb)
    with b's request silently posted a's own request of the same number (a's
    data written to a's target, b's target untouched, "DONE"). Real NIXL
    posts hb (a handle is its request); a typed error would do as well."""
    a, b, c = agents(), agents(), agents()
    n = 4096
    xa, xb, t1, t2 = Buf(n, 1), Buf(n, 2), Buf(n, 0), Buf(n, 0)
    a.register_memory([(xa.addr, n, 0, "")], "DRAM")
    b.register_memory([(xb.addr, n, 0, "")], "DRAM")
    c.register_memory([(t1.addr, n, 0, ""), (t2.addr, n, 0, "")], "DRAM")
    md = c.get_agent_metadata()
    a.add_remote_agent(md)
    b.add_remote_agent(md)
    ha = a.initialize_xfer("WRITE", a.get_xfer_descs([(xa.addr, n, 0)], "DRAM"),
                           a.get_xfer_descs([(t1.addr, n, 0)], "DRAM"), c.name)
    hb = b.initialize_xfer("WRITE", b.get_xfer_descs([(xb.addr, n, 0)], "DRAM"),
                           b.get_xfer_descs([(t2.addr, n, 0)], "DRAM"), c.name)
    try:
        st = a.transfer(hb)
        deadline = time.monotonic() + STEP
        while st == "PROC":
            assert time.monotonic() < deadline
            st = a.check_xfer_state(hb)
    except NIXL_ERRORS:
        st = "refused"
    time.sleep(0.2)  # (anything posted has landed)
    assert set(t1.np) == {0}, "a's own request was posted"
    assert (st, sorted(set(t2.np))) in (("DONE", [2]), ("refused", [0]))
    ha.release()

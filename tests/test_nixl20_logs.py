"""The compat layer's logging must neither stop it nor flood.

1. The notification pump (nixl19b, rev19 #2) ended for good on the first
   exception from what it calls, and then WRITEs with a notification to a
   target that reads none stalled again at the 1025th. A sender can drive
   the assembler to log (an unfinished message dropped at its bounds), and
   _log raised when the process has no usable stderr (sys.stderr None: a
   process started with fd 2 closed, as daemons are): the pump died.
2. rev19 #6: every refused repost (nixlRepostActiveError) wrote an E line:
   ~12 k lines in 15 s from a caller reposting in a loop.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest
from conftest import PipeChild
from test_nixl19b_notifs import COUNT, STEP, quiet_main, write_notified


def send_raw(agent: Any, name: str, frames: list[bytes]) -> None:
    """A hostile sender: frames as they are (genNotif would frame them)."""
    from aioxfer.nixl import _bindings

    inner = agent.agent
    peer = inner._peer_of(name, "test")
    with inner._rt.locked():
        inner._rt.spawn(_bindings._send_notifs(peer, frames))


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_pump_survives_what_a_hostile_sender_makes_it_log(
        transports: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aioxfer.nixl import _wire, nixl_agent, nixl_agent_config

    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    quiet = PipeChild(quiet_main, transports, True, seconds=STEP)
    name, md, raddr = quiet.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    try:
        src = np.ones(4096, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(src.ctypes.data, 4096, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        # First fragments of more unfinished messages than the target keeps
        # per sender: it drops the oldest, and logs that.
        frames = [_wire.NOTIF_MAGIC + b"F" + i.to_bytes(8, "big") + b"x" * 100
                  for i in range(_wire._MAX_PARTIAL + 2)]
        send_raw(agent, name, frames)
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(src.ctypes.data, 4096, 0)],
                                                                "DRAM"),
                                  agent.get_xfer_descs([(raddr, 4096, 0)], "DRAM"), name)
        write_notified(agent, h)
        agent.release_xfer_handle(h)
        # All of them, in order; nothing of the unfinished ones.
        assert quiet.call("read")[0] == [b"req-%d" % i for i in range(COUNT)]
    finally:
        agent.close()
        quiet.close()


BIG = 64 << 20


def sink_main(conn: Any) -> None:
    """A remote agent over tcp with BIG bytes to write into."""
    os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = np.zeros(BIG, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, BIG, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    while conn.recv() != "quit":
        pass
    agent.close()
    conn.send("bye")


def test_refused_reposts_log_a_line_a_second(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from aioxfer.nixl import nixl_agent, nixl_agent_config, nixlRepostActiveError

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    sink = PipeChild(sink_main, seconds=STEP)
    name, md, raddr = sink.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    stopped = False
    try:
        src = np.ones(BIG, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(src.ctypes.data, BIG, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(src.ctypes.data, BIG, 0)],
                                                                "DRAM"),
                                  agent.get_xfer_descs([(raddr, BIG, 0)], "DRAM"), name)
        # A stopped target keeps the WRITE in flight (its socket fills).
        os.kill(sink.proc.pid, signal.SIGSTOP)
        stopped = True
        assert agent.transfer(h) == "PROC"
        capfd.readouterr()
        refused = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            with pytest.raises(nixlRepostActiveError):
                agent.transfer(h)
            refused += 1
        elapsed = time.monotonic() - t0
        lines = [ln for ln in capfd.readouterr().err.splitlines()
                 if "still in flight" in ln]
        os.kill(sink.proc.pid, signal.SIGCONT)
        stopped = False
        assert refused >= 100, refused  # (else this shows nothing)
        # One line a second, the first at once; the second says how many
        # were left out.
        assert 1 <= len(lines) <= elapsed + 1, (refused, len(lines))
        assert all(ln.startswith("E") for ln in lines)
        if len(lines) > 1:
            assert re.search(r"\((\d+) more like this in the last", lines[1])
        deadline = time.monotonic() + STEP
        while (state := agent.check_xfer_state(h)) == "PROC":
            assert time.monotonic() < deadline
        assert state == "DONE"
        agent.release_xfer_handle(h)
    finally:
        if stopped:
            os.kill(sink.proc.pid, signal.SIGCONT)
        agent.close()
        sink.close()


@pytest.mark.parametrize("how", ["close", "remove", "release"])
def test_an_unread_failure_is_not_reported_by_asyncio(
        how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A request in flight when the agent closes or its remote is removed,
    or one failed and released unchecked, whose outcome nobody reads:
    asyncio printed
    "Transfer exception was never retrieved" (with a traceback) when the
    failed Transfer was collected. NIXL users do not know asyncio."""
    import gc
    import logging

    from aioxfer.nixl import nixl_agent, nixl_agent_config

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    sink = PipeChild(sink_main, seconds=STEP)
    name, md, raddr = sink.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    stopped = False
    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        src = np.ones(BIG, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(src.ctypes.data, BIG, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(src.ctypes.data, BIG, 0)],
                                                                "DRAM"),
                                  agent.get_xfer_descs([(raddr, BIG, 0)], "DRAM"), name)
        os.kill(sink.proc.pid, signal.SIGSTOP)
        stopped = True
        assert agent.transfer(h) == "PROC"
        if how == "close":
            agent.close()
        elif how == "remove":
            agent.remove_remote_agent(name)
            time.sleep(0.5)
            agent.release_xfer_handle(h)
        else:
            # Failed (its peer killed), never checked, then released.
            os.kill(sink.proc.pid, signal.SIGKILL)
            stopped = False
            time.sleep(1.0)
            agent.release_xfer_handle(h)
        del h
        agent.close()
        for _ in range(3):
            gc.collect()
            time.sleep(0.1)
        never = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
        assert not never, never
    finally:
        if stopped:
            os.kill(sink.proc.pid, signal.SIGCONT)
        agent.close()
        sink.close()

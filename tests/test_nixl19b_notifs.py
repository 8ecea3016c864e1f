"""rev19 #2 (taken from rev19's a8cfe91, without its xfail mark): WRITEs
with a notification to an aioxfer.nixl target that never calls
get_new_notifs stalled at the 1025th (Limits.max_notify_per_conn: aioxfer
stops reading the connection, its data included, while that many wait
unread), then failed "timed out" after ~30 s. NIXL queues notifications
without bound and its transfers never wait for the target to read them.
The compat layer now moves them out of the agent's queue as they arrive.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
from conftest import PipeChild

STEP = 30.0
COUNT = 1100  # past max_notify_per_conn (1024)


def quiet_main(conn: Any, transports: str, no_stderr: bool = False) -> None:
    """A remote agent that reads no notification until told to (NIXL queues
    them without bound; its peers' transfers never wait for it to).
    no_stderr: a process without stderr (what Python sets when fd 2 is
    closed at its start)."""
    if transports:
        os.environ["AIOXFER_NIXL_TRANSPORTS"] = transports
    if no_stderr:
        os.close(2)
        sys.stderr = None  # type: ignore[assignment]
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = np.zeros(1 << 20, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    while (msg := conn.recv()) != "quit":
        assert msg == "read"
        got: list[bytes] = []
        deadline = time.monotonic() + STEP
        while len(got) < COUNT and time.monotonic() < deadline:
            for msgs in agent.get_new_notifs().values():
                got.extend(msgs)
        conn.send((got, int(pool[:4096].sum())))
    agent.close()
    conn.send("bye")


def write_notified(agent: Any, h: Any) -> None:
    """COUNT WRITEs of handle h, one at a time, each with its notification
    req-<i>; each must be DONE within 10 s."""
    for i in range(COUNT):
        state = agent.transfer(h, b"req-%d" % i)
        deadline = time.monotonic() + 10.0
        while state == "PROC":
            assert time.monotonic() < deadline, f"WRITE {i} still in flight after 10 s"
            state = agent.check_xfer_state(h)
        assert state == "DONE"


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_writes_to_a_target_that_reads_no_notifications(
        transports: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    quiet = PipeChild(quiet_main, transports, seconds=STEP)
    name, md, raddr = quiet.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    try:
        src = np.ones(4096, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(src.ctypes.data, 4096, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(src.ctypes.data, 4096, 0)],
                                                                "DRAM"),
                                  agent.get_xfer_descs([(raddr, 4096, 0)], "DRAM"), name)
        write_notified(agent, h)
        agent.release_xfer_handle(h)
        # Nothing was lost while nobody read: all of them, in order, each
        # after its data.
        got, total = quiet.call("read")
        assert got == [b"req-%d" % i for i in range(COUNT)]
        assert total == 4096
    finally:
        agent.close()
        quiet.close()

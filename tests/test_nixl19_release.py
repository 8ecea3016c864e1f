"""release_xfer_handle of a request in flight (nixl-api.md: "releasing a
transfer in flight cancels it if the backend can, else raises and keeps the
handle"): it returns once the engine confirmed the cancel; where it cannot
confirm in time (a peer that stalls mid-READ), nixlBackendError, the handle
kept, and a later release, once the peer moves again, succeeds."""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest
from conftest import PipeChild

STEP = 30.0
BIG = 64 << 20


def producer_main(conn: Any) -> None:
    """A remote agent over tcp with BIG bytes of a non-zero pattern."""
    os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = (np.arange(BIG) % 251 + 1).astype(np.uint8)  # no zero byte
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, BIG, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    while conn.recv() != "quit":
        pass
    agent.close()
    conn.send("bye")


def test_release_of_a_read_from_a_stalled_peer_raises_and_keeps_the_handle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import aioxfer.nixl._bindings as bindings
    from aioxfer.nixl import nixl_agent, nixl_agent_config, nixlBackendError

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    monkeypatch.setattr(bindings, "_STOP_TIMEOUT", 1.0, raising=False)
    producer = PipeChild(producer_main, seconds=STEP)
    name, md, raddr = producer.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    stopped = False
    try:
        kv = np.zeros(BIG, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, BIG, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        raised = 0
        for _ in range(4):
            h = agent.initialize_xfer("READ", agent.get_xfer_descs([(kv.ctypes.data, BIG, 0)],
                                                                   "DRAM"),
                                      agent.get_xfer_descs([(raddr, BIG, 0)], "DRAM"), name)
            os.kill(producer.proc.pid, signal.SIGSTOP)
            stopped = True
            if agent.transfer(h) == "DONE":
                os.kill(producer.proc.pid, signal.SIGCONT)
                stopped = False
                h.release()
                continue
            t0 = time.monotonic()
            try:
                agent.release_xfer_handle(h)
            except nixlBackendError:
                raised += 1
                took = time.monotonic() - t0
                assert 0.9 < took < 10, took
                # Kept: the handle is still the agent's, in its cancelled state.
                assert not h._released
                with pytest.raises(Exception, match="cancelled"):
                    agent.check_xfer_state(h)
            os.kill(producer.proc.pid, signal.SIGCONT)
            stopped = False
            # Once the peer moves again the engine confirms: a release works.
            agent.release_xfer_handle(h)
            assert h._released
            kv[:] = 0
            time.sleep(0.05)
            assert not np.count_nonzero(kv)
        assert raised, "no release met a stalled READ: nothing was tested"
    finally:
        if stopped:
            os.kill(producer.proc.pid, signal.SIGCONT)
        agent.close()
        producer.close()

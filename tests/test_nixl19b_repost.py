"""A repost of a handle whose cancelled post the engine still moves (rev19
#1's repost case): handle.future().cancel() (or a cancelled ``await
handle``) settles the handle's future at once, while the cancelled READ's
bytes may still land until the engine confirms the cancel; a repost then
accepted would let the old data land over the new. It is refused
(nixlRepostActiveError) until the old post's transfers are settled, on the
compiled repost path and on the Python one (a post with a notification)."""

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


@pytest.mark.parametrize("notif", [b"", b"again"])
def test_repost_of_a_cancelled_read_still_moving_is_refused(
        notif: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    from aioxfer.nixl import nixl_agent, nixl_agent_config, nixlRepostActiveError

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    producer = PipeChild(producer_main, seconds=STEP)
    name, md, raddr = producer.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    stopped = False
    try:
        kv = np.zeros(BIG, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, BIG, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(kv.ctypes.data, BIG, 0)],
                                                               "DRAM"),
                                  agent.get_xfer_descs([(raddr, BIG, 0)], "DRAM"), name)
        refused = 0
        for _ in range(3):
            os.kill(producer.proc.pid, signal.SIGSTOP)
            stopped = True
            if agent.transfer(h) == "DONE":
                os.kill(producer.proc.pid, signal.SIGCONT)
                stopped = False
                continue
            h.future().cancel()
            # The peer is stopped: the engine cannot have confirmed the
            # cancel (the READ's answer may still come): refused.
            with pytest.raises(nixlRepostActiveError):
                agent.transfer(h, notif)
            refused += 1
            os.kill(producer.proc.pid, signal.SIGCONT)
            stopped = False
            # Once the engine confirms, the repost is accepted and completes.
            deadline = time.monotonic() + STEP
            while True:
                try:
                    state = agent.transfer(h, notif)
                    break
                except nixlRepostActiveError:
                    assert time.monotonic() < deadline, "the repost stays refused"
                    time.sleep(0.001)
            while state == "PROC":
                assert time.monotonic() < deadline
                state = agent.check_xfer_state(h)
            assert state == "DONE"
            assert np.array_equal(kv[:4096], (np.arange(4096) % 251 + 1).astype(np.uint8))
            kv[:] = 0
        assert refused, "no cancel met a READ in flight: nothing was tested"
        agent.release_xfer_handle(h)
    finally:
        if stopped:
            os.kill(producer.proc.pid, signal.SIGCONT)
        agent.close()
        producer.close()

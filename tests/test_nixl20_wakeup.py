"""rev19 #5: a handle's future() waited ~20 ms while another thread reposted
and polled a request of its own. That thread's post drains the engine and
takes the other transfer's completion, scheduling its callbacks on the loop
from the caller's thread; the post then cleared the runtime's wake-up mark
(meant for the agent's own no-op flush), so the loop slept until the
poller's claim on the engine's fd lingered out (_LINGER, 20 ms). Main: p99
~21 ms, 7-15 % of the waits >= 10 ms (tcp, this 2-vCPU VM)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import numpy as np
from conftest import PipeChild

STEP = 30.0
N = 4 << 20


def target_main(conn: Any) -> None:
    os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = (np.arange(N) % 251).astype(np.uint8)
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, N, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    while conn.recv() != "quit":
        pass
    agent.close()
    conn.send("bye")


def test_future_is_woken_while_another_thread_posts_and_polls(monkeypatch: Any) -> None:
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    target = PipeChild(target_main, seconds=STEP)
    name, md, raddr = target.hello
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    stop = threading.Event()
    errors: list[BaseException] = []
    hammer: threading.Thread | None = None
    try:
        x = np.zeros(N, np.uint8)
        agent.register_memory(agent.get_reg_descs([(x.ctypes.data, N, 0, "")], "DRAM"))
        agent.add_remote_agent(md)
        big = agent.initialize_xfer(
            "READ", agent.get_xfer_descs([(x.ctypes.data, 1 << 20, 0)], "DRAM"),
            agent.get_xfer_descs([(raddr, 1 << 20, 0)], "DRAM"), name)
        small = agent.initialize_xfer(
            "READ", agent.get_xfer_descs([(x.ctypes.data + (2 << 20), 4096, 0)], "DRAM"),
            agent.get_xfer_descs([(raddr + (2 << 20), 4096, 0)], "DRAM"), name)

        def hammer_main() -> None:
            try:
                while not stop.is_set():
                    st = agent.transfer(small)
                    while st == "PROC":
                        st = agent.check_xfer_state(small)
                        time.sleep(0)
                    assert st == "DONE", st
            except BaseException as exc:
                errors.append(exc)

        for _ in range(20):  # connected, warm
            agent.transfer(big)
            big.future().result(timeout=STEP)
        hammer = threading.Thread(target=hammer_main)
        hammer.start()
        waits = []
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            t0 = time.perf_counter()
            agent.transfer(big)
            big.future().result(timeout=STEP)
            waits.append(time.perf_counter() - t0)
        stop.set()
        hammer.join(STEP)
        assert not errors, errors
        slow = sum(w >= 0.010 for w in waits)
        assert len(waits) >= 100, len(waits)
        # (A loaded machine may preempt a few; the missed wake-up made every
        # completion the poller took wait for the linger.)
        assert slow <= 0.02 * len(waits), (slow, len(waits), sorted(waits)[-5:])
        assert int(x[:1 << 20].astype(np.int64).sum()) == int(
            (np.arange(1 << 20) % 251).sum())
    finally:
        stop.set()
        if hammer is not None:
            hammer.join(STEP)
        agent.close()
        target.close()

"""rev19's reproductions for aioxfer.nixl, copied by nixl19 (each failed on main
085d2b6; their strict-xfail marks removed with the fixes on branch nixl19).

- release_xfer_handle of a READ in flight returns at once while the engine
  still writes the cancelled READ's data into the destination: a caller that
  reuses the block (vLLM/Dynamo abort a request, then hand its blocks to the
  next) finds the old READ's bytes landing in it afterwards (wrong data).
  nixl-api.md: "releasing a transfer in flight cancels it if the backend
  can, else raises and keeps the handle".
- After os.fork() in a process that used aioxfer.nixl, the child inherits
  the runtime whose loop thread does not exist there: its first agent blocks
  for 2 x AIOXFER_NIXL_CONNECT_TIMEOUT (60 s by default), then raises a bare
  TimeoutError.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import numpy as np
import pytest
from conftest import NIXL_BIG, PipeChild, nixl_reader

STEP = 30.0
BIG = NIXL_BIG


def test_released_read_writes_nothing_after_release_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with nixl_reader(monkeypatch, BIG, seconds=STEP) as r:
        agent, kv = r.agent, r.kv
        late: list[tuple[int, int]] = []
        for rnd in range(6):
            h = r.read_handle()
            if agent.transfer(h) == "DONE":
                continue  # (finished inside the post: nothing to cancel)
            time.sleep(0.001 * rnd)
            agent.release_xfer_handle(h)  # returned: the block is the caller's again
            kv[:] = 0
            time.sleep(0.05)
            n = int(np.count_nonzero(kv))
            if n:
                late.append((rnd, n))
        assert not late, f"(round, bytes) landed after release returned: {late}"


_FORKED = textwrap.dedent("""
    import os, sys, time
    from aioxfer.nixl import nixl_agent, nixl_agent_config
    parent = nixl_agent("parent", nixl_agent_config())
    pid = os.fork()
    if pid == 0:
        t0 = time.monotonic()
        try:
            child = nixl_agent("child", nixl_agent_config())
            child.close()
            print("OK %.2f" % (time.monotonic() - t0), flush=True)
        except BaseException as exc:
            print("FAILED %.2f %s: %s" % (time.monotonic() - t0, type(exc).__name__, exc),
                  flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    parent.close()
""")


def test_agent_in_a_forked_child() -> None:
    env = dict(os.environ, AIOXFER_NIXL_CONNECT_TIMEOUT="2")
    out = subprocess.run([sys.executable, "-c", _FORKED], cwd="/", env=env, timeout=STEP * 2,
                         capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("OK", "FAILED"))]
    assert lines and lines[0].startswith("OK"), (lines, out.stderr[-2000:])


def leaver_main(conn: Any) -> None:
    """A same-host remote agent that closes (its memory released, then its
    connections) when told."""
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = np.ones(BIG, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, BIG, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    conn.recv()
    agent.close()
    conn.send("closed")
    conn.recv()


def test_future_of_a_read_from_a_leaving_peer_is_a_disconnect() -> None:
    """check_xfer_state reports a READ from a peer that closed mid-way as
    nixlRemoteDisconnectError (_denied_or_gone waits up to _GONE_GRACE for the
    connection's close). handle.future() settles it on the loop thread, where
    that wait cannot see the close (the loop thread is the one spinning):
    nixlBackendError, after a 50 ms stall of the loop."""
    from aioxfer.nixl import nixl_agent, nixl_agent_config, nixlBackendError

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    outcomes: list[str] = []
    try:
        kv = np.zeros(BIG, dtype=np.uint8)
        agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, BIG, 0, "")], "DRAM"))
        for _ in range(6):
            leaver = PipeChild(leaver_main, seconds=STEP)
            try:
                name, md, raddr = leaver.hello
                agent.add_remote_agent(md)
                h = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs([(kv.ctypes.data, BIG, 0)], "DRAM"),
                    agent.get_xfer_descs([(raddr, BIG, 0)], "DRAM"), name)
                agent.transfer(h)
                fut = h.future()
                leaver.conn.send("close")
                try:
                    outcomes.append(fut.result(timeout=STEP))
                except nixlBackendError:
                    outcomes.append("nixlBackendError")
                except Exception as exc:  # noqa: BLE001 (the outcome is the check)
                    outcomes.append(type(exc).__name__)
                leaver.recv()
                agent.remove_remote_agent(name)
                h.release()
            finally:
                leaver.close()
    finally:
        agent.close()
    assert "nixlBackendError" not in outcomes, outcomes

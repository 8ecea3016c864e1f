"""rev32: the NIXL shim's releaseXferReq of a WRITE that failed while pages
of its buffer, sent by the one-copy send (on by default since spl28: 256
KiB-1 MiB over loopback to a same-host peer), are still in a stopped
target's receive queue. releaseXferReq promises that "the caller may reuse
the memory at once" (vLLM and Dynamo hand an aborted request's blocks to
the next one), and a NIXL user cannot await ``Transfer.settled()``. Its
fast path (a request of one aioxfer call, done, not by a cancel) returned
at once although the failed transfer was still busy (AXF_CQ_XFER_HELD, no
AXF_CQ_XFER_FREED yet): the buffer rewritten after the release landed at
the target once it resumed and read its queue, bytes never posted.

Real processes over real loopback sockets: the target is a spawned child
agent of the shim, SIGSTOPped (its keepalives stop: the peer timeout ends
the connection and fails the write), then SIGCONTed by a timer while the
release waits.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
from conftest import PipeChild, sigstop

N = 512 << 10  # in the default splice window (256 KiB-1 MiB frames and requests)


def target_main(conn: Any, nbytes: int) -> None:
    """A PipeChild: a shim agent over tcp with ``nbytes`` of zeros
    registered; hello (name, metadata, address); answers "get" with its
    buffer's bytes."""
    os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(pool.ctypes.data, nbytes, 0, "")], "DRAM"))
    conn.send((agent.name, agent.get_agent_metadata(), pool.ctypes.data))
    while (msg := conn.recv()) != "quit":
        if msg == "get":
            conn.send(pool.tobytes())
    agent.close()
    conn.send("bye")


def test_release_of_a_failed_spliced_write_waits_for_its_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    monkeypatch.delenv("AIOXFER_TCP_SPLICE", raising=False)  # the default: on
    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    target = PipeChild(target_main, N)
    timer: threading.Timer | None = None
    stopped = False
    try:
        name, md, raddr = target.hello
        agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
        try:
            buf = np.zeros(N, dtype=np.uint8)
            agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, N, 0, "")], "DRAM"))
            agent.add_remote_agent(md)

            def handle() -> Any:
                return agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs([(buf.ctypes.data, N, 0)], "DRAM"),
                    agent.get_xfer_descs([(raddr, N, 0)], "DRAM"), name)

            def wait(h: Any, seconds: float) -> str:
                deadline = time.monotonic() + seconds
                while True:
                    try:
                        st = agent.check_xfer_state(h)
                    except Exception:  # the shim raises for a failed request
                        return "ERR"
                    if st != "PROC" or time.monotonic() > deadline:
                        return str(st)
                    time.sleep(0.01)

            # Warm: the connection up, a pipe made by the first spliced frame.
            h = handle()
            agent.transfer(h)
            assert wait(h, 10) == "DONE"
            agent.release_xfer_handle(h)
            posted = (np.arange(N) % 251 + 1).astype(np.uint8)
            buf[:] = posted
            sigstop(target.proc.pid)
            stopped = True
            h = handle()
            agent.transfer(h)
            # The stopped target's keepalives stop: lost within the peer
            # timeout (5 s), the write fails on time (its memory held).
            st = wait(h, 20)
            assert st == "ERR", st
            busy = [t for t in (h._agent._xfers[h._handle].fut,) if t.busy]  # type: ignore
            assert busy, "failed and not busy: the write did not go spliced, nothing is tested"

            def cont() -> None:
                os.kill(target.proc.pid, signal.SIGCONT)

            timer = threading.Timer(1.5, cont)
            timer.start()
            t0 = time.monotonic()
            agent.release_xfer_handle(h)
            took = time.monotonic() - t0
            # Released: the memory is the caller's again (NIXL's contract).
            buf[:] = 0xEE
            timer.join()
            stopped = False
            time.sleep(1.0)  # the target read its queue (resumed before or after the release)
            got = np.frombuffer(target.call("get"), dtype=np.uint8)
            # Each byte is what was posted, or the zero it was (a frame the
            # target took only in part); none is the 0xee written after.
            stray = int(np.count_nonzero((got != posted) & (got != 0)))
            assert not stray, (
                f"{stray} bytes never posted landed at the target: the release returned after "
                f"{took:.3f} s while the engine still held the failed write's pages")
            assert took >= 1.0, took  # (it waited for the target to read its pages)
        finally:
            if timer is not None:
                timer.cancel()
            if stopped:
                os.kill(target.proc.pid, signal.SIGCONT)
            agent.close()
    finally:
        target.close()

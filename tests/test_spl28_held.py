"""spl28: the one-copy send on by default, prompt and safe. A WRITE whose
pages went spliced to a same-host peer (256 KiB-1 MiB over loopback) and
that fails before its acknowledgement (the target stopped: the stall
timeout) fails on time (the engine's AXF_CQ_XFER_HELD), but its memory
stays the engine's: ``Transfer.busy`` stays True, ``settled()`` and a
deregistration of its region wait until the kernel shows the pages read or
dropped (the target resumed and read them, or was killed:
AXF_CQ_XFER_FREED). A buffer rewritten only after ``settled()`` never lands
at the target. Before (tcp26, splice opt-in), the failure itself waited for
the stopped target: not failed 3 s after the stall timeout.

Real processes over real loopback sockets: the target is a child agent,
SIGSTOPped, then SIGCONTed or SIGKILLed. The environment is left as a user
has it (no AIOXFER_TCP_SPLICE): the default is what is tested.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import digest, pattern, pipe_names, sigstop, within

from aioxfer import XferError


@pytest.mark.parametrize("end", ["resumed", "killed"])
@pytest.mark.parametrize("n", [256 << 10, 1 << 20])
async def test_failed_spliced_write_fails_at_once_memory_held(
        make_agent, remote_agent, monkeypatch, n: int, end: str) -> None:
    monkeypatch.delenv("AIOXFER_TCP_SPLICE", raising=False)  # the default
    ra = await remote_agent(size=4 << 20, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), stall_timeout=0.5)
    peer = await within(agent.connect(ra.address))
    buf = bytearray(n)
    src = agent.register(buf)
    rr = peer.region("user")
    before = pipe_names()
    await within(agent.write(src[0:n], rr[n:2 * n]))  # warm: the pipe exists
    assert pipe_names() - before, "the write did not go spliced by default: nothing is tested"
    old = await ra.call("digest", "user", 0, n)
    posted = pattern(n, 28).tobytes()
    buf[:] = posted
    rewritten = b"\xee" * n
    sigstop(ra.pid)
    ended = False
    try:
        t = agent.write(src[0:n], rr[0:n])
        t0 = time.monotonic()
        # The stall timeout (0.5 s) ends the connection: the write fails on
        # time, though the stopped target still holds our pages.
        with pytest.raises(XferError):
            await within(t, 3.0)
        failed_after = time.monotonic() - t0
        assert t.busy, "failed, but the engine may still hand its pages to the target"
        settled = t.settled()
        dereg = asyncio.ensure_future(agent.deregister(src))
        await asyncio.sleep(1.0)
        assert not settled.done(), "settled while the stopped target holds the pages"
        assert not dereg.done(), "the region was released while the target holds its pages"
        assert t.busy
        if end == "resumed":
            os.kill(ra.pid, signal.SIGCONT)
        else:
            os.kill(ra.pid, signal.SIGKILL)
            os.kill(ra.pid, signal.SIGCONT)
            ra.closed = True
        ended = True
        t1 = time.monotonic()
        await within(settled, 10)
        await within(dereg, 10)
        settled_after = time.monotonic() - t1
        assert not t.busy
        buf[:] = rewritten  # settled and deregistered: the caller's again
        print(f"\n{n} bytes, target {end}: failed after {failed_after:.2f} s, "
              f"settled {settled_after:.3f} s after it {end}")
    finally:
        if not ended:
            os.kill(ra.pid, signal.SIGCONT)
    if end == "resumed":
        await asyncio.sleep(1.0)
        got = await ra.call("digest", "user", 0, n)
        assert got != digest(rewritten), "bytes never posted to this address landed"
        assert got in (digest(posted), old)

"""rev18b #1: a WRITE that failed (the stall timeout, its target stopped)
lands later if the target resumes and reads it. With the copy it lands the
posted bytes ("may still land"); with the one-copy send (AIOXFER_TCP_SPLICE=1)
the buffer's bytes of that moment, never posted to that address (fixed by
tcp26: such ops stay pinned until the kernel shows the pages read or
dropped; tested in test_tcp26_splice_pinned.py). (The reviewer's
reproduction, kept for the copy.)"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from conftest import digest, pattern, sigstop, within

from aioxfer import XferError


# The spliced case ("1") is tests/test_tcp26_splice_pinned.py's: a failed
# spliced WRITE now stays pinned (not failed) until the stopped target reads
# or drops its pages, so this test's wait for the failure would not end.
@pytest.mark.parametrize("spl", ["0"])
async def test_failed_write_lands_only_posted_bytes(make_agent, remote_agent, monkeypatch,
                                                   spl: str) -> None:
    monkeypatch.setenv("AIOXFER_TCP_SPLICE", spl)
    n = 64 << 10
    ra = await remote_agent(size=1 << 20, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), stall_timeout=0.5)
    peer = await within(agent.connect(ra.address))
    src = agent.register(bytearray(n))
    rr = peer.region("user")
    await within(agent.write(src[0:n], rr[n:2 * n]))  # warm: the pipe exists
    posted = pattern(n, 3).tobytes()
    src.memoryview[:] = posted
    sigstop(ra.pid)
    try:
        with pytest.raises(XferError):
            await within(agent.write(src[0:n], rr[0:n]), 20)
        src.memoryview[:] = b"\xee" * n  # the op failed: the buffer is the caller's again
    finally:
        os.kill(ra.pid, signal.SIGCONT)
    await asyncio.sleep(1.0)
    got = await ra.call("digest", "user", 0, n)
    assert got != digest(b"\xee" * n), "bytes never posted to this address landed"

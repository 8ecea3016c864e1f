"""tcp26: the one-copy send's release rule (native/src/conn.c "one-copy
send", spl_keep / spl_settle). A spliced WRITE that fails before its
acknowledgement (its target stopped: the stall timeout) is not released
while the peer's socket may still read our pages: the region holds that
keep a deregistration waiting (and, since spl28, which fails it on time:
Transfer.busy / settled()) wait until the kernel says the pages were read
or dropped. Before tcp26 the op completed at the
timeout, the caller rewrote its buffer, and the resumed target applied the
rewritten bytes, never posted to that address (rev18b #1).

Real processes over real loopback sockets: the target is a child agent,
SIGSTOPped and SIGCONTed. Also: a process that is not dumpable is not
vouched for by "our uid can read our memory anyway", so it never splices.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal

import pytest
from conftest import digest, pattern, pipe_names, sigstop, within

from aioxfer import XferError

PR_SET_DUMPABLE = 4


@pytest.mark.parametrize("n", [64 << 10, 256 << 10])
async def test_failed_spliced_write_stays_pinned(make_agent, remote_agent, monkeypatch,
                                                n: int) -> None:
    monkeypatch.setenv("AIOXFER_TCP_SPLICE", "1")
    ra = await remote_agent(size=1 << 20, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), stall_timeout=0.5)
    peer = await within(agent.connect(ra.address))
    buf = bytearray(n)
    src = agent.register(buf)
    rr = peer.region("user")
    before = pipe_names()
    # Warm: the pipe exists. A frame sent while the connection's one-copy
    # verdict is still being asked goes by copy, by design (spl_decide: BUSY),
    # so the first write may make none on a loaded host: a few more may.
    for _ in range(20):
        await within(agent.write(src[0:n], rr[n:2 * n]))
        if pipe_names() - before:
            break
    assert pipe_names() - before, "the write did not go spliced: nothing is tested"
    old = await ra.call("digest", "user", 0, n)
    posted = pattern(n, 26).tobytes()
    buf[:] = posted
    rewritten = b"\xee" * n
    sigstop(ra.pid)
    resumed = False
    try:
        t = agent.write(src[0:n], rr[0:n])
        # The stall timeout (0.5 s) ends the connection. spl28: the write
        # fails on time, but its memory stays held (busy, settled(), the
        # deregistration) while the stopped target's socket still holds our
        # pages (tests/test_spl28_held.py). Before tcp26 it was released at
        # the failure; tcp26 held the failure too.
        done, _ = await asyncio.wait([t], timeout=3.0)
        if done:
            with pytest.raises(XferError):
                t.result()
        if done and not t.busy:
            buf[:] = rewritten  # before tcp26: released with the failure
        else:
            assert t.busy
            settled = t.settled()
            dereg = asyncio.ensure_future(agent.deregister(src))
            await asyncio.sleep(1.0)
            assert not dereg.done(), "the region was released while the peer holds its pages"
            assert not settled.done()
        os.kill(ra.pid, signal.SIGCONT)
        resumed = True
        if not done or t.busy:
            if not done:
                with pytest.raises(XferError):
                    await within(t, 20)
            await within(settled, 20)
            await within(dereg, 20)
            buf[:] = rewritten  # settled and deregistered: the caller's again
    finally:
        if not resumed:
            os.kill(ra.pid, signal.SIGCONT)
    await asyncio.sleep(1.0)
    got = await ra.call("digest", "user", 0, n)
    assert got != digest(rewritten), "bytes never posted to this address landed"
    assert got in (digest(posted), old)


async def test_not_dumpable_copies(make_agent, remote_agent, monkeypatch) -> None:
    """PR_SET_DUMPABLE 0: a process of our uid may not read our memory, so the
    one-copy send's premise fails and no pipe is made; dumpable again, a new
    agent's connection splices."""
    monkeypatch.setenv("AIOXFER_TCP_SPLICE", "1")
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    ra = await remote_agent(size=1 << 20, transports=("tcp",))
    n = 256 << 10
    data = pattern(n, 7).tobytes()
    for dumpable in (0, 1):
        assert prctl(PR_SET_DUMPABLE, dumpable, 0, 0, 0) == 0
        try:
            agent = await make_agent(f"init{dumpable}", transports=("tcp",))
            peer = await within(agent.connect(ra.address))
            src = agent.register(bytearray(data))
            before = pipe_names()
            await within(agent.write(src[0:n], peer.region("user")[0:n]))
            made = len(pipe_names() - before)
        finally:
            assert prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0
        assert await ra.call("digest", "user", 0, n) == digest(data)
        assert (made > 0) == bool(dumpable), (dumpable, made)
        await ra.call("zero", "user")

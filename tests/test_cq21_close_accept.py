"""close18 (b): a peer that connects while the agent is closing (aclose's
release waiting on a stopped same-host peer) is not served: the engine
refuses it (axf_accept_conn after axf_engine_bye_network): its connection
is closed at once instead of served (receiver and sender threads, its
frames read) by an engine releasing its regions, until the shutdown's
goodbye; it never heard the goodbye the other network peers did. Real
processes: the stopped peer is a child agent (shm), the late one an
in-process agent over tcp."""

from __future__ import annotations

import asyncio
import contextlib

from conftest import SAME_HOST, sigstop, within

import aioxfer

MiB = 1 << 20


async def test_peer_connecting_during_close_is_refused(make_agent, remote_agent) -> None:
    target = aioxfer.Agent("target", peer_timeout=0.5, keepalive=0.1,
                           limits=aioxfer.Limits(close_timeout=4.0))
    await target.start()
    closing: asyncio.Task[None] | None = None
    try:
        target.alloc(MiB, name="dst")
        ra = await remote_agent(size=MiB, name="sleeper", peer_timeout=0.5, keepalive=0.1)
        try:
            assert await ra.call("connect", target.address) == SAME_HOST
            await ra.call("flood", target.address, "pool", "dst", MiB)
            sigstop(ra.pid)
            late = await make_agent("late", transports=("tcp",), peer_timeout=5.0)
            closing = asyncio.create_task(target.aclose())
            await asyncio.sleep(0.5)  # bye_network said; the release waits for the sleeper
            assert not closing.done()
            before = target.statistics().native_conns
            # The handshake is the serving loop's (Python): the connect may
            # return (its metadata lists no region: all being released);
            # what matters is whether the engine serves the connection.
            with contextlib.suppress(aioxfer.XferError, OSError):
                await within(late.connect(target.address), 10)
            await asyncio.sleep(0.5)
            assert not closing.done()  # still in the close's window
            served = target.statistics().native_conns - before
            assert served == 0, f"{served} connection(s) served by an agent whose close had begun"
        finally:
            ra.kill()
        await within(closing, 15)
    finally:
        if closing is None:
            await target.aclose()

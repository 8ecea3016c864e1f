"""A peer that connects while the agent is closing (aclose's release waiting
on a stopped same-host peer) is told so: conn22's Server refuses a
handshake with a Reject naming the close ("agent ... is closing") once
``Server.closing`` is set "by the agent as its close begins (before its
goodbye to the network)". Real processes, as test_cq21_close_accept: the
stopped peer is a child agent (shm), the late one an in-process agent over
tcp. Without the Reject the late peer's handshake is Accepted, then the
closing engine drops the connection (cq21): the connect fails with a
ProtocolError about the metadata ("regions changed"), or returns a peer
that is lost at once."""

from __future__ import annotations

import asyncio

import pytest
from conftest import SAME_HOST, sigstop, within

import aioxfer
from aioxfer.serving import Server

MiB = 1 << 20


@pytest.mark.skipif(not hasattr(Server, "closing"), reason="no Server.closing (before conn22)")
async def test_connect_during_close_is_refused_by_name(make_agent, remote_agent) -> None:
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
            with pytest.raises(aioxfer.AccessDenied, match="closing"):
                await within(late.connect(target.address), 10)
            assert not closing.done()  # still in the close's window
        finally:
            ra.kill()
        await within(closing, 15)
    finally:
        if closing is None:
            await target.aclose()

"""A tcp connect's edges on the target and the initiator (conn14): a
connection that closes before sending a byte (an early-dialled one its
agent closed unused, a port check) is not a rejected handshake, and a
connect cancelled at any step leaves no socket open and no task running."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from conftest import cancel_after, wait_until, within

import aioxfer

MiB = 1 << 20


def _conns(peer: aioxfer.Peer) -> list[int]:
    return [r.connections for r in peer.statistics().rails]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("steps", [1, 3, 6, 12, 30])
async def test_cancelled_connect_leaves_nothing(make_agent, remote_agent, steps: int) -> None:
    """A connect cancelled at various points (before or after its first
    connection is up, during its other connections' joins) leaves no socket
    open and no task running, and the next connect gets all the connections."""
    ra = await remote_agent(size=MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    # A connect and close first: what the agent opens once, on its first
    # connect, is not counted as left open.
    await within((await within(init.connect(ra.address))).aclose())
    await wait_until(lambda: not init.peers and not init._probes, 5, what="closed")
    before = _fds()
    # True: it finished before the cancel took (a connect to a fast loopback
    # peer may take under 6 steps): a live peer then, closed here first.
    finished = await cancel_after(init._connector.connect(ra.address), steps)
    await wait_until(lambda: not init._probes, 10, what="no background task left")
    assert finished or not init.peers  # cancelled: no peer left behind
    for p in init.peers:
        await within(p.aclose())
    await wait_until(lambda: _fds() <= before, 5, what="every socket closed")
    peer = await within(init.connect(ra.address))
    # Its connections after the first join after connect returned (Connector._join_rest).
    await wait_until(lambda: _conns(peer) == [4], 5, what="the joins")


async def test_an_early_connection_closed_unused_is_not_a_warning(make_agent, capsys) -> None:
    """A connection that closes before sending a byte (a client's early
    connection its agent closed unused, a port check) is dropped with a
    debug line, not a conn.rejected warning (failed before: three warnings)."""
    target = await make_agent("target", transports=("tcp",))
    host, port = target.address.rsplit(":", 1)
    for _ in range(3):
        socket.create_connection((host, int(port))).close()
    await asyncio.sleep(0.2)
    init = await make_agent("init", transports=("tcp",))
    await within(init.connect(target.address))  # the target's loop served the closed ones
    err = capsys.readouterr().err
    assert "conn.rejected" not in err, err

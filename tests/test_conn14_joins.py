"""A tcp connect returns once its first connection is up (issue 13, conn14):
the peer's other connections join in the background (Connector._join_rest),
requests posted meanwhile go on the live ones, and a join that fails is
handled as a lost connection is (its rail topped up again; the peer lost
only with its last connection). Faults during the joins: the peer killed,
the agent closed; nothing may leak or hang (cancelled connects and silent
connections: test_conn14_connect)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from conftest import sigstop, wait_until, within

import aioxfer
from aioxfer.errors import PeerLost, ProtocolError
from aioxfer.protocol import Joins

MiB = 1 << 20


def _conns(peer: aioxfer.Peer) -> list[int]:
    return [r.connections for r in peer.statistics().rails]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_requests_posted_before_the_joins_use_the_first_connection(make_agent) -> None:
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(16 * MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    src = init.alloc(16 * MiB, name="src")
    src.numpy()[:] = 7
    peer = await within(init.connect(target.address))
    # Posted in the step connect returned in: the joins have not begun.
    assert sum(_conns(peer)) < 4
    await within(init.write(src[0 : 16 * MiB], peer.region("dst")[0 : 16 * MiB]))
    assert (dst.numpy() == 7).all()
    await wait_until(lambda: _conns(peer) == [4], 5, what="the joins")
    src.numpy()[:] = 8
    await within(init.write(src[0 : 16 * MiB], peer.region("dst")[0 : 16 * MiB]))
    assert (dst.numpy() == 8).all()
    assert not init._probes  # the joining task ended


async def test_joins_refused_are_topped_up_as_after_a_loss(make_agent, capsys,
                                                          monkeypatch) -> None:
    """The peer closes every joining connection: the first connection
    serves, the failure is logged, and the rail is topped up by the re-dial
    a lost connection gets (each with a handshake of its own)."""
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(MiB, name="dst")
    def refuse(*a: object, **k: object) -> bool:
        raise ProtocolError("refused (test)")  # the join's connection is closed

    monkeypatch.setattr(Joins, "take", refuse)
    init = await make_agent("init", transports=("tcp",), tcp_connections=3, rail_probe=0.05)
    src = init.alloc(MiB, name="src")
    src.numpy()[:] = 5
    peer = await within(init.connect(target.address))
    await within(init.write(src[0:MiB], peer.region("dst")[0:MiB]))
    assert (dst.numpy() == 5).all()
    await wait_until(lambda: _conns(peer) == [3], 10, what="the rail topped up")
    assert not peer.lost
    assert "conn.join_failed" in capsys.readouterr().err


async def test_peer_killed_during_the_joins(make_agent, remote_agent) -> None:
    """The peer stops right after connect returned (its joins unanswered),
    then is killed: the peer is lost (PeerLost, typed), the joining task
    ends, no socket is left open, and the agent closes at once."""
    ra = await remote_agent(size=MiB, transports=("tcp",))
    before = _fds()
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    src = init.alloc(MiB, name="src")
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    await asyncio.sleep(0.05)  # the joins' Hellos are out, their answers awaited
    assert init._probes
    ra.kill(signal.SIGKILL)
    ra.proc.join(5)
    with pytest.raises(PeerLost):
        for _ in range(100):  # until the loss is seen (keepalive, or the broken connection)
            await within(init.write(src[0:4096], peer.region("pool")[0:4096]))
            await asyncio.sleep(0.05)
    await wait_until(lambda: not init._probes, 10, what="the joining task ended")
    await within(init.aclose(), 5)
    await wait_until(lambda: _fds() <= before, 5, what="every socket closed")


async def test_close_during_the_joins(make_agent, remote_agent) -> None:
    """The agent closes while its joins wait for a stopped peer's answers:
    the close does not wait for them (nor for the peer timeout) and leaves
    no socket open; the peer, resumed, is not left with a warning per
    connection it never answered."""
    ra = await remote_agent(size=MiB, transports=("tcp",))
    before = _fds()
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=30)
    await within(init.connect(ra.address))
    sigstop(ra.pid)
    try:
        await asyncio.sleep(0.05)
        assert init._probes  # joining
        await within(init.aclose(), 5)
        assert not init._probes
        assert _fds() <= before
    finally:
        ra.kill(signal.SIGCONT)

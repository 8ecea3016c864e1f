"""While a tcp peer's connections after its first one join (conn14: after
connect returned), a bulk request waits for them (JoinGate as the peer's
scheduler: posted over the first connection alone it would stay there, the
engine stripes a request over the connections live at its post); a small
one goes at once. Bounded (Connector._JOIN_WAIT); faults while one waits:
the peer killed, closed, the agent closed, must fail it typed or let it
go on, never hang."""

from __future__ import annotations

import asyncio
import os
import signal

from conftest import sigstop, wait_until, within

import aioxfer
from aioxfer import connector
from aioxfer.errors import PeerLost
from aioxfer.scheduling import JoinGate

MiB = 1 << 20
BULK = connector._JOIN_BULK


def _conns(peer: aioxfer.Peer) -> list[int]:
    return [r.connections for r in peer.statistics().rails]


def _joining(agent: aioxfer.Agent) -> bool:
    return any(t.get_name().startswith("aioxfer-join") for t in agent._probes)


async def test_a_bulk_request_waits_for_the_joins_a_small_one_goes(make_agent) -> None:
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(16 * MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    src = init.alloc(16 * MiB, name="src")
    src.numpy()[:] = 3
    peer = await within(init.connect(target.address))
    assert isinstance(peer._sched, JoinGate)
    small = init.write(src[0:4096], peer.region("dst")[0:4096])
    bulk = init.write(src[0:BULK], peer.region("dst")[0:BULK])
    st = peer.statistics()
    assert (st.queued, st.in_flight) == (1, 1), st
    await within(small)
    await within(bulk)
    assert (dst.numpy()[:BULK] == 3).all()
    # Posted once they joined (or the gate's bound passed): all four up by now,
    # and the peer's requests back on the compiled path (no scheduler).
    await wait_until(lambda: not _joining(init), 5, what="the joins")
    assert _conns(peer) == [4]
    assert peer._sched is None
    st = peer.statistics()
    assert (st.queued, st.in_flight, st.in_flight_bytes) == (0, 0, 0), st
    # Not released twice nor to a scheduler gone (the gate admitted them).
    src.numpy()[:] = 4
    await within(init.write(src[0 : 16 * MiB], peer.region("dst")[0 : 16 * MiB]))
    assert (dst.numpy() == 4).all()


async def test_a_peer_with_limits_keeps_its_scheduler(make_agent) -> None:
    """peer_max_requests: its scheduler's order and admission stay as they
    are (no gate: it would reorder what the scheduler admits in order)."""
    target = await make_agent("target", transports=("tcp",))
    target.alloc(16 * MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4,
                            peer_max_requests=1)
    src = init.alloc(16 * MiB, name="src")
    peer = await within(init.connect(target.address))
    assert not isinstance(peer._sched, JoinGate) and peer._sched is not None
    ts = [init.write(src[0:BULK], peer.region("dst")[0:BULK]) for _ in range(2)]
    st = peer.statistics()
    assert (st.queued, st.in_flight) == (1, 1), st
    await within(asyncio.gather(*ts))


async def test_the_wait_is_bounded_when_the_joins_are_not_answered(make_agent,
                                                                   remote_agent) -> None:
    """The peer stops right after connect (its joins unanswered): the bulk
    request is posted over the first connection within the gate's bound,
    while the joins still wait; it completes once the peer runs again."""
    ra = await remote_agent(size=16 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=5.0)
    src = init.alloc(16 * MiB, name="src")
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    try:
        bulk = init.write(src[0:BULK], peer.region("pool")[0:BULK])
        assert peer.statistics().queued == 1
        await wait_until(lambda: peer.statistics().queued == 0, 1, what="the gate's bound")
        assert _joining(init)  # still waiting for the joins' answers
        assert peer._sched is None
    finally:
        os.kill(ra.pid, signal.SIGCONT)
    await within(bulk, 10)


async def test_peer_killed_while_a_bulk_request_waits(make_agent, remote_agent,
                                                      monkeypatch) -> None:
    """The gate held open (bound lifted), the peer stopped then killed: the
    waiting bulk request fails PeerLost (typed) promptly, the joining task
    ends, the peer's scheduler is gone."""
    monkeypatch.setattr(connector, "_JOIN_WAIT", 60.0)
    ra = await remote_agent(size=16 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=2.0)
    src = init.alloc(16 * MiB, name="src")
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    bulk = init.write(src[0:BULK], peer.region("pool")[0:BULK])
    await asyncio.sleep(0.05)
    assert peer.statistics().queued == 1
    os.kill(ra.pid, signal.SIGKILL)
    os.kill(ra.pid, signal.SIGCONT)
    ra.closed = True
    results = await within(asyncio.gather(bulk, return_exceptions=True), 10)
    assert isinstance(results[0], PeerLost), results
    await wait_until(lambda: not _joining(init), 10, what="the joining task ended")
    st = peer.statistics()
    assert (st.queued, st.in_flight) == (0, 0), st
    assert peer._sched is None


async def test_peer_closed_while_a_bulk_request_waits(make_agent, remote_agent,
                                                      monkeypatch) -> None:
    monkeypatch.setattr(connector, "_JOIN_WAIT", 60.0)
    ra = await remote_agent(size=16 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=2.0)
    src = init.alloc(16 * MiB, name="src")
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    try:
        bulk = init.write(src[0:BULK], peer.region("pool")[0:BULK])
        await asyncio.sleep(0.05)
        assert peer.statistics().queued == 1
        await within(peer.aclose())
        results = await within(asyncio.gather(bulk, return_exceptions=True), 5)
        assert isinstance(results[0], aioxfer.ClosedResourceError | PeerLost), results
        await wait_until(lambda: not _joining(init), 5, what="the joining task ended")
    finally:
        os.kill(ra.pid, signal.SIGCONT)


async def test_agent_closed_while_a_bulk_request_waits(make_agent, remote_agent,
                                                       monkeypatch) -> None:
    monkeypatch.setattr(connector, "_JOIN_WAIT", 60.0)
    ra = await remote_agent(size=16 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=2.0)
    src = init.alloc(16 * MiB, name="src")
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    try:
        bulk = init.write(src[0:BULK], peer.region("pool")[0:BULK])
        await asyncio.sleep(0.05)
        assert peer.statistics().queued == 1
        await within(init.aclose(), 10)
        results = await within(asyncio.gather(bulk, return_exceptions=True), 5)
        assert isinstance(results[0], aioxfer.ClosedResourceError), results
    finally:
        os.kill(ra.pid, signal.SIGCONT)


async def test_a_waiting_bulk_request_cancelled(make_agent, monkeypatch) -> None:
    monkeypatch.setattr(connector, "_JOIN_WAIT", 60.0)
    target = await make_agent("target", transports=("tcp",))
    target.alloc(16 * MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    src = init.alloc(16 * MiB, name="src")
    peer = await within(init.connect(target.address))
    bulk = init.write(src[0:BULK], peer.region("dst")[0:BULK])
    assert bulk.cancel()
    st = peer.statistics()
    assert (st.queued, st.in_flight) == (0, 0), st
    await wait_until(lambda: not _joining(init), 5, what="the joins")
    assert peer._sched is None
    await within(init.write(src[0:BULK], peer.region("dst")[0:BULK]))

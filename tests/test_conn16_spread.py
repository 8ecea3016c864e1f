"""A tcp peer's connections after its first one join after connect returned
(Connector._join_rest); requests posted meanwhile go at once over the
connections up (no scheduler of their own: the compiled submit path), and
what they still have queued when a connection joins is spread over it too
(native conn_spread), so bulk writes posted right after connect do not stay
on the first connection (conn14: the tcp demo 0.84x; conn15 held them back
in a Python gate instead). Faults while they wait queued and the joins
run: the peer killed, closed, the agent closed, the requests cancelled, the
joins refused; each fails typed or completes, never hangs."""

from __future__ import annotations

import asyncio
import os
import signal

from conftest import digest, pattern, sigstop, wait_until, within

import aioxfer
from aioxfer.errors import PeerLost, ProtocolError
from aioxfer.protocol import Joins

MiB = 1 << 20
N, SIZE = 4, 16 * MiB  # the bulk writes posted at connect: 64 MiB


def _conns(peer: aioxfer.Peer) -> list[int]:
    return [r.connections for r in peer.statistics().rails]


def _conn_bytes(agent: aioxfer.Agent, peer: aioxfer.Peer) -> list[int]:
    """Bytes each live connection carried (acknowledged), as the engine counts."""
    return [nbytes for _, live, nbytes, _, _ in agent._engine.endpoint_rails(peer._ep) if live]


def _joining(agent: aioxfer.Agent) -> bool:
    # (its task made _JOIN_DELAY after connect returned: joins_pending till then)
    return bool(agent._connector.joins_pending) or any(
        t.get_name().startswith("aioxfer-join") for t in agent._probes
    )


async def _stopped_with_bulk_queued(make_agent, remote_agent, **kw):  # type: ignore[no-untyped-def]
    """A remote peer connected, then stopped (SIGSTOP) with N bulk writes
    posted: they sit queued on the first connection (its socket full), the
    joins unanswered."""
    ra = await remote_agent(size=N * SIZE, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, **kw)
    src = init.alloc(N * SIZE, name="src")
    src.numpy()[:] = pattern(N * SIZE, 16)
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    ts = [init.write(src[i * SIZE:(i + 1) * SIZE], peer.region("pool")[i * SIZE:(i + 1) * SIZE])
          for i in range(N)]
    assert peer._sched is None  # the compiled path: nothing held in Python
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in ts)
    return ra, init, src, peer, ts


async def test_bulk_writes_posted_before_the_joins_spread_over_them(make_agent,
                                                                    remote_agent) -> None:
    """Posted while only the first connection is up and the peer is stopped
    (so they are still queued there when the joins come): once it runs
    again and the others joined, the first connection carried a part only.
    Failed before conn_spread: every byte went over the first connection."""
    ra, init, src, peer, ts = await _stopped_with_bulk_queued(make_agent, remote_agent)
    os.kill(ra.pid, signal.SIGCONT)
    results = await within(asyncio.gather(*ts), 20)
    assert [r.nbytes for r in results] == [SIZE] * N
    assert await ra.call("digest", "pool", 0, N * SIZE) == digest(src.numpy())
    await wait_until(lambda: not _joining(init), 5, what="the joins")
    assert _conns(peer) == [4]
    per = _conn_bytes(init, peer)
    assert sum(per) == N * SIZE, per  # each byte once
    assert max(per) < N * SIZE * 3 // 4, per  # not all on the first connection
    assert sum(1 for b in per if b) >= 3, per
    assert peer.statistics().reroutes == 0  # moved, not rerouted off a failure


async def test_peer_killed_with_bulk_writes_queued(make_agent, remote_agent) -> None:
    ra, init, src, peer, ts = await _stopped_with_bulk_queued(
        make_agent, remote_agent, peer_timeout=2.0)
    os.kill(ra.pid, signal.SIGKILL)
    os.kill(ra.pid, signal.SIGCONT)
    ra.closed = True
    results = await within(asyncio.gather(*ts, return_exceptions=True), 10)
    assert all(isinstance(r, PeerLost) for r in results), results
    await wait_until(lambda: not _joining(init), 10, what="the joining task ended")
    st = peer.statistics()
    assert (st.queued, st.in_flight) == (0, 0), st


async def test_peer_closed_with_bulk_writes_queued(make_agent, remote_agent) -> None:
    ra, init, src, peer, ts = await _stopped_with_bulk_queued(
        make_agent, remote_agent, peer_timeout=2.0)
    try:
        await within(peer.aclose())
        results = await within(asyncio.gather(*ts, return_exceptions=True), 5)
        assert all(isinstance(r, aioxfer.ClosedResourceError | PeerLost) for r in results), \
            results
        await wait_until(lambda: not _joining(init), 5, what="the joining task ended")
    finally:
        os.kill(ra.pid, signal.SIGCONT)


async def test_agent_closed_with_bulk_writes_queued(make_agent, remote_agent) -> None:
    ra, init, src, peer, ts = await _stopped_with_bulk_queued(
        make_agent, remote_agent, peer_timeout=2.0)
    try:
        await within(init.aclose(), 10)
        results = await within(asyncio.gather(*ts, return_exceptions=True), 5)
        assert all(isinstance(r, aioxfer.ClosedResourceError) for r in results), results
        assert not init._probes
    finally:
        os.kill(ra.pid, signal.SIGCONT)


async def test_bulk_writes_cancelled_while_queued_then_spread(make_agent,
                                                              remote_agent) -> None:
    """Cancelled while queued on the first connection; the joins then come
    and spread what is left of them: they end cancelled (or done, if they
    finished first), and the peer serves the next write over every
    connection."""
    ra, init, src, peer, ts = await _stopped_with_bulk_queued(make_agent, remote_agent)
    for t in ts:
        t.cancel()
    os.kill(ra.pid, signal.SIGCONT)
    results = await within(asyncio.gather(*ts, return_exceptions=True), 20)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    await wait_until(lambda: not _joining(init), 5, what="the joins")
    # What was in a send already goes out; the engine then confirms each.
    await wait_until(lambda: peer.statistics().in_flight == 0, 10, what="the cancels confirmed")
    st = peer.statistics()
    assert (st.queued, st.in_flight, st.in_flight_bytes) == (0, 0, 0), st
    res = await within(init.write(src[0:SIZE], peer.region("pool")[0:SIZE]))
    assert res.nbytes == SIZE
    assert await ra.call("digest", "pool", 0, SIZE) == digest(src.numpy()[0:SIZE])


async def test_joins_refused_with_bulk_writes_queued(make_agent, remote_agent,
                                                     monkeypatch) -> None:
    """The peer refuses every join while bulk writes are queued on the first
    connection: they complete over it (nothing was moved to a connection
    that never came), and the rail is topped up as after a loss."""
    def refuse(*a: object, **k: object) -> bool:
        raise ProtocolError("refused (test)")

    monkeypatch.setattr(Joins, "take", refuse)  # (this process: an in-process target)
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(N * SIZE, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, rail_probe=0.05)
    src = init.alloc(N * SIZE, name="src")
    src.numpy()[:] = pattern(N * SIZE, 17)
    peer = await within(init.connect(target.address))
    ts = [init.write(src[i * SIZE:(i + 1) * SIZE], peer.region("dst")[i * SIZE:(i + 1) * SIZE])
          for i in range(N)]
    results = await within(asyncio.gather(*ts), 20)
    assert [r.nbytes for r in results] == [SIZE] * N
    assert (dst.numpy() == src.numpy()).all()
    await wait_until(lambda: _conns(peer) == [4], 10, what="the rail topped up")

"""Agent lifecycle under cancellation and timeouts (the agent's own await
points: start, connect, aclose), against real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import SAME_HOST, sigstop, within

import aioxfer
from aioxfer import registration
from aioxfer.discovery import Etcd


@pytest.fixture
def silent_etcd() -> Iterator[str]:
    """A "host:port" that takes TCP connections (the kernel's backlog) and
    never answers: an etcd that hangs."""
    pytest.importorskip("aetcd", reason="the aetcd client is not installed")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


async def test_cancelled_start_stops_joining_and_a_later_start_joins_again(
    silent_etcd: str,
) -> None:
    agent = aioxfer.Agent("a", discovery=Etcd(silent_etcd, timeout=60.0, ttl=5))
    try:
        task = asyncio.get_running_loop().create_task(agent.start())
        await asyncio.sleep(0.3)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(task)
        joining = agent._cluster.joining
        assert joining is not None
        # The caller gave up on joining: the agent does not join behind its back.
        await within(asyncio.wait([joining], timeout=5))
        assert joining.done(), "a cancelled start() left the agent joining"
        assert agent._cluster.session is None
        # start() again joins again (it is not the cancellation replayed).
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await agent.start()
        assert agent._cluster.joining is not joining
    finally:
        await within(agent.aclose(), 20)
    assert agent.closed


async def test_aclose_cancelled_while_peers_hold_memory_still_closes(remote_agent: Any) -> None:
    """aclose() waits (up to close_timeout) for peers to release our memory;
    cancelled in that wait (a caller's timeout), it still closes: the engine
    shut, nothing served any more, what a peer could still touch quarantined
    as when close_timeout runs out. The peer: a stopped same-host process
    that maps our memory (a network peer no longer holds it: since close18,
    aclose ends network connections with a goodbye before the release)."""
    agent = aioxfer.Agent("a", limits=aioxfer.Limits(revoke_timeout=30.0, close_timeout=30.0))
    await agent.start()
    region = agent.alloc(1 << 20, name="dst")
    ra = await remote_agent(size=1 << 20, name="sleeper")
    try:
        assert await ra.call("connect", agent.address) == SAME_HOST
        await ra.call("flood", agent.address, "pool", "dst", 1 << 20)
        sigstop(ra.pid)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await agent.aclose()
        assert agent.closed, "a cancelled aclose() left the agent open"
        assert all(t.done() for t in agent._accept_tasks)
        assert region._closed
        assert any(r is region for r in registration._QUARANTINE), \
            "memory a peer could still touch was not quarantined"
        assert agent._engine.closed
        await within(agent.aclose())  # idempotent
    finally:
        ra.kill()
        if not agent.closed:
            await within(agent.aclose(), 40)


@pytest.mark.parametrize("field, bad", [
    ("max_conns", 2.5), ("max_rails", True), ("max_handshakes", float("inf")),
    ("max_notify_per_conn", 1 << 40), ("reply_queue_bytes", 1 << 64),
    ("revoke_timeout", float("inf")), ("close_timeout", float("nan")),
    ("rail_probe_max", 1e300), ("revoke_timeout", True), ("max_conns", 0),
])
def test_limits_refuse_what_the_engine_cannot_take(field: str, bad: object) -> None:
    """Before, some of these were taken and failed later with OverflowError
    (an infinite revoke_timeout, a count past 32 bits), or were silently
    truncated (2.5 connections, True rails)."""
    with pytest.raises(ValueError, match=f"Limits.{field}"):
        aioxfer.Limits(**{field: bad})


def test_limits_extremes_accepted() -> None:
    lim = aioxfer.Limits(max_conns=(1 << 32) - 1, reply_queue_bytes=(1 << 63) - 1,
                         revoke_timeout=0.001, close_timeout=4_000_000)
    assert lim.max_conns == (1 << 32) - 1


@pytest.mark.parametrize("kwargs", [
    {"peer_timeout": float("inf")}, {"keepalive": float("nan")}, {"stall_timeout": 1e12},
    {"rail_probe": float("inf")}, {"peer_timeout": 5_000_000},
])
def test_agent_seconds_refused_typed(kwargs: dict[str, float]) -> None:
    """Before (NaN aside): OverflowError from the engine's constructor."""
    with pytest.raises(ValueError, match="seconds"):
        aioxfer.Agent("a", **kwargs)


async def test_start_after_a_failed_join_tries_again(silent_etcd: str) -> None:
    """etcd unreachable at start(): TransportError; a later start() joins
    again (etcd may be back) rather than re-raising the first failure
    forever, as it did before (the same exception object, no new attempt)."""
    agent = aioxfer.Agent("a", discovery=Etcd(silent_etcd, timeout=0.3, ttl=5))
    try:
        with pytest.raises(aioxfer.TransportError) as first:
            await within(agent.start(), 20)
        failed = agent._cluster.joining
        with pytest.raises(aioxfer.TransportError) as second:
            await within(agent.start(), 20)
        assert agent._cluster.joining is not failed, "start() did not try to join again"
        assert second.value is not first.value
    finally:
        await within(agent.aclose(), 20)

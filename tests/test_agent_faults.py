"""Agent lifecycle under cancellation and timeouts (the agent's own await
points: start, connect, aclose), against real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from conftest import within

import aioxfer
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

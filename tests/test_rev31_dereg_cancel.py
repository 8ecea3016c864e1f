"""Cancelling a wait for ``deregister()`` stops only that wait (rev31).

A deregistration can take long: a stopped same-host process keeps our memory
mapped until it exits. Its awaitable was one Future shared by every call: a
caller that gave up waiting (``asyncio.timeout``, a cancelled task) cancelled
it for everyone, so another task awaiting the same release got CancelledError
without being cancelled, and a later ``await agent.deregister(region)`` raised
CancelledError at once instead of waiting for the release. As
``Transfer.settled()``, each call now gets its own future of the one release.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import SAME_HOST, sigstop, wait_until, within

MiB = 1 << 20


async def _mapped_by_a_stopped_peer(make_agent: Any, remote_agent: Any) -> tuple[Any, Any, Any]:
    """(owner agent, its region a stopped same-host process maps, that process)."""
    owner = await make_agent("owner", peer_timeout=0.5, keepalive=0.1)
    region = owner.alloc(MiB, name="dst")
    ra = await remote_agent(size=MiB, peer_timeout=0.5, keepalive=0.1)
    assert await ra.call("connect", owner.address) == SAME_HOST
    sigstop(ra.pid)
    return owner, region, ra


async def _steps(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_cancelled_wait_leaves_the_release_to_the_other_waiters(
    make_agent: Any, remote_agent: Any
) -> None:
    owner, region, ra = await _mapped_by_a_stopped_peer(make_agent, remote_agent)
    try:
        impatient = asyncio.ensure_future(_await(owner.deregister(region)))
        patient = asyncio.ensure_future(_await(owner.deregister(region)))
        await _steps(5)
        assert not impatient.done() and not patient.done()  # the peer still maps it
        impatient.cancel()
        await _steps(5)
        assert impatient.cancelled()
        # The task nobody cancelled still waits for the release.
        assert not patient.done(), "a waiter that was not cancelled ended: " + repr(patient)
        later = owner.deregister(region)  # asked again after a wait was given up
        await _steps(5)
        assert not later.done(), "deregister() answered a cancelled awaitable"
        assert owner.statistics().native_regions >= 1  # still held, not freed
    finally:
        ra.kill()  # gone for good: the memory is released
    await within(patient, 10)
    await within(later, 10)
    await wait_until(lambda: owner.statistics().native_regions == 0, 10, what="region freed")


async def test_a_deadline_on_one_wait_then_waiting_again(
    make_agent: Any, remote_agent: Any
) -> None:
    owner, region, ra = await _mapped_by_a_stopped_peer(make_agent, remote_agent)
    try:
        first = owner.deregister(region)
        waiting = asyncio.ensure_future(_await(first))
        await _steps(5)
        waiting.cancel()  # as asyncio.timeout would, on the caller's deadline
        with pytest.raises(asyncio.CancelledError):
            await waiting
        again = owner.deregister(region)
        assert not again.done()
        assert not region.close().done()  # Region.close() is deregister()
    finally:
        ra.kill()
    assert await within(again, 10) is None


async def _await(aw: Any) -> Any:
    return await aw

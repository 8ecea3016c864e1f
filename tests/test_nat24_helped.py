"""AgentStatistics.replies_read_by_waiter (nat24): the engine's count of tcp
replies the thread awaiting a transfer read off the socket itself (axf_stats
helped; conn.c help_read / help_more: read22's lone READ up to 1 MiB copied
as it arrives) instead of the connection's receiver. Python tests could not
see that path run before (the counter was internal to the engine).

Lone awaited READs of 64 KiB and 1 MiB over loopback tcp take the path (the
awaiting thread spins for them); the same READs with progress="sleep" (no
spinning: the loop sleeps on the engine's eventfd) never do, so the count is
the path's, not any reply's.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import wait_until, within

MiB = 1 << 20
KiB = 1 << 10
ROUNDS = 40


async def _lone_reads(make_agent: Any, size: int, progress: str,
                      rounds: int = ROUNDS, until_helped: bool = False) -> tuple[int, int]:
    """Up to rounds lone awaited READs of size (until_helped: stopping at the
    first the waiter read); the waiter's count before and after."""
    target = await make_agent("target", listen="127.0.0.1:0", transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), progress=progress)
    far = bytearray(os.urandom(size))
    target.register(far, name="far")
    peer = await within(agent.connect(target.address))
    assert peer.path == "tcp"
    dst = agent.register(bytearray(size))
    rr = peer.region("far")
    await within(agent.read(dst[0:4096], rr[0:4096]))  # the connection warm
    await wait_until(lambda: agent.statistics().native_ops == 0, what="nothing in flight")
    before = agent.statistics().replies_read_by_waiter
    for _ in range(rounds):
        await within(agent.read(dst[0:size], rr[0:size]))
        if until_helped and agent.statistics().replies_read_by_waiter > before:
            break
    after = agent.statistics().replies_read_by_waiter
    assert bytes(dst.memoryview[0:size]) == bytes(far)
    return before, after


@pytest.mark.parametrize("size", [64 * KiB, MiB])
async def test_lone_tcp_read_taken_by_its_waiter(make_agent: Any, size: int) -> None:
    before, after = await _lone_reads(make_agent, size, "adaptive", rounds=400,
                                      until_helped=True)
    # Each READ spins for its response; on a busy machine a spin may run out
    # and leave it to the receiver (CI once: 0 of 40 at 1 MiB), never 400.
    assert after - before > 0, (before, after)


async def test_sleeping_waiter_reads_nothing(make_agent: Any) -> None:
    before, after = await _lone_reads(make_agent, MiB, "sleep")
    assert after == before, (before, after)

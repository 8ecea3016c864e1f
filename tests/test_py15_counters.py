"""A peer's counters (aioxfer.stats.PeerCounters, now compiled: C integers
the submit, the drain and aioxfer.nixl's repost add to) keep the typed
record's contract: keyword construction, int attributes read and written
from Python, any integer taken as its int, past 2**62 Python's ints (the
compiled paths then take Python's arithmetic, and come back to C integers
once every count fits again), and the peer's statistics from them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from conftest import within

from aioxfer.stats import PeerCounters

MakeAgent = Callable[..., Awaitable[Any]]

NAMES = ("posted", "completed", "failed", "bytes", "inflight", "inflight_bytes", "queued",
         "queued_bytes")


def test_fields_as_a_record() -> None:
    c = PeerCounters(inflight=3, inflight_bytes=3 * 4096, latency=2e-6)
    assert [getattr(c, n) for n in NAMES] == [0, 0, 0, 0, 3, 3 * 4096, 0, 0]
    assert (c.latency, c.bandwidth) == (2e-6, 0.0)
    assert type(c.inflight) is int and type(c.latency) is float
    c.posted += 5
    c.queued_bytes = np.int64(7)  # an integer of any type: its int
    assert (c.posted, c.queued_bytes, type(c.queued_bytes)) == (5, 7, int)
    assert c == PeerCounters(posted=5, inflight=3, inflight_bytes=3 * 4096, queued_bytes=7,
                             latency=2e-6)
    assert c != PeerCounters()
    assert "inflight=3" in repr(c)
    with pytest.raises(TypeError):
        c.inflight = 1.5  # type: ignore[assignment]
    with pytest.raises(TypeError):
        hash(c)


@pytest.mark.parametrize("name", NAMES)
def test_counts_past_62_bits_are_exact_and_come_back(name: str) -> None:
    c = PeerCounters(posted=1, inflight=2)
    for big in (1 << 62, -(1 << 62), 1 << 64, -(1 << 100)):
        setattr(c, name, big)
        assert getattr(c, name) == big
        setattr(c, name, getattr(c, name) + 1)
        assert getattr(c, name) == big + 1
        setattr(c, name, 9)
        assert getattr(c, name) == 9
    assert (c.posted, c.inflight) == ((9 if name == "posted" else 1),
                                      (9 if name == "inflight" else 2))


def test_settle_is_the_drains_tally() -> None:
    c = PeerCounters(inflight=4, inflight_bytes=4 * 4096, completed=1, bytes=10)
    c.settle(3, 3 * 4096, 3 * 4000, 1e-6, 5e9)
    assert (c.inflight, c.inflight_bytes, c.completed, c.bytes) == (1, 4096, 4, 10 + 12000)
    assert (c.latency, c.bandwidth) == (1e-6, 5e9)
    c.settle(1, 1 << 64, 1 << 64, 1e-6, 5e9)  # (past 2**62: Python's ints)
    assert (c.inflight_bytes, c.bytes) == (4096 - (1 << 64), 10 + 12000 + (1 << 64))


async def _setup(make_agent: MakeAgent) -> tuple[Any, Any, Any, Any]:
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await within(init.connect(target.address))
    target.alloc(1 << 16, name="r")
    await within(peer.refresh())
    k = next(iter(init._peers.by_ep.values()))._counters
    return init, init.alloc(1 << 16, name="l"), peer.region("r"), k


@pytest.mark.parametrize("start", [(1 << 62) - 4096, -(1 << 62) + 1])
async def test_compiled_paths_cross_62_bits_exactly(make_agent: MakeAgent, start: int) -> None:
    """The submit's and the drain's C additions that leave 62 bits (and come
    back) give what Python's ints give: a batch, a post alone (aioxfer.nixl's
    repost, Prepared.post(now=True)), and the peer's statistics."""
    init, local, remote, k = await _setup(make_agent)
    k.bytes += start
    k.inflight_bytes += start
    k.posted += start
    s0 = (k.posted, k.completed, k.bytes)
    prep = init.prepare("write", local[0:4096], remote[0:4096])
    for _ in range(3):
        assert (await within(prep.post(True))).nbytes == 4096
    batch = [init.write(local[i * 1000:i * 1000 + 1000], remote[0:1000]) for i in range(5)]
    assert [(await within(t)).nbytes for t in batch] == [1000] * 5
    assert (k.posted, k.completed, k.bytes) == (s0[0] + 8, s0[1] + 8,
                                                s0[2] + 3 * 4096 + 5 * 1000)
    assert (k.inflight, k.inflight_bytes) == (0, start)
    k.bytes -= start
    k.inflight_bytes -= start
    k.posted -= start
    st = next(iter(init._peers.by_ep.values())).statistics()
    assert (st.in_flight, st.in_flight_bytes) == (0, 0)
    assert (st.transfers_posted, st.transfers_completed, st.bytes) == (
        s0[0] - start + 8, s0[1] + 8, s0[2] - start + 3 * 4096 + 5 * 1000)
    assert st.latency > 0.0


async def test_agent_totals_are_exact_across_62_bits(make_agent: MakeAgent) -> None:
    """The agent's totals (Submission.posted, .completed, .failed, .bytes:
    properties over a PeerCounters record the compiled paths add to).
    ``posted`` is the last request id: ids stay consecutive where the
    compiled submit hands over to the Python one past 2**62 and back."""
    init, local, remote, _k = await _setup(make_agent)
    sub = init._sub
    base = sub.posted
    ts = [init.write(local[0:4096], remote[0:4096])]
    assert ts[0].req_id == base + 1 and sub.posted == base + 1
    sub.posted = (1 << 62) - 3
    ts = [init.write(local[i * 4096:(i + 1) * 4096], remote[0:4096]) for i in range(4)]
    assert [t.req_id for t in ts] == [(1 << 62) - 2 + i for i in range(4)]
    assert [(await within(t)).nbytes for t in ts] == [4096] * 4
    assert sub.posted == (1 << 62) + 1 and type(sub.posted) is int
    sub.posted = 100
    t = init.write(local[0:4096], remote[0:4096])
    assert t.req_id == 101 and (await within(t)).nbytes == 4096
    s = init.statistics()
    assert (s.transfers_posted, s.in_flight) == (101, 101 - s.transfers_completed)
    sub.failed += 1
    assert init.statistics().transfers_failed == 1
    sub.failed -= 1
    sub.posted = sub.completed + sub.failed  # (the ids moved: none in flight)

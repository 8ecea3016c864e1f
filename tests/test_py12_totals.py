"""The agent's totals (Submission.completed and .bytes), which the compiled
Submitter adds as C integers after a post or a drain (_add_total), stay
exact: on the unbatched post of one request (Prepared.post(now=True):
aioxfer.nixl's repost), on a batch, and past 2**62, where the C path hands
over to Python's int arithmetic."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import within

MakeAgent = Callable[..., Awaitable[Any]]


async def _setup(make_agent: MakeAgent) -> tuple[Any, Any, Any]:
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await within(init.connect(target.address))
    target.alloc(1 << 16, name="r")
    await within(peer.refresh())
    return init, init.alloc(1 << 16, name="l"), peer.region("r")


@pytest.mark.parametrize("start", [0, (1 << 62) - 3, 1 << 64])
async def test_totals_exact_on_one_request_posts_and_batches(make_agent: MakeAgent,
                                                             start: int) -> None:
    init, local, remote = await _setup(make_agent)
    sub = init._sub
    s0 = init.statistics()
    sub.completed += start
    sub.bytes += start
    prep = init.prepare("write", local[0:4096], remote[0:4096])
    for _ in range(5):  # posted alone, now: Submitter._post_one
        assert (await within(prep.post(True))).nbytes == 4096
    batch = [init.read(local[i * 1000:i * 1000 + 1000], remote[0:1000]) for i in range(7)]
    assert [(await within(t)).nbytes for t in batch] == [1000] * 7  # a batch: _post
    s1 = init.statistics()
    assert s1.transfers_completed - s0.transfers_completed == start + 12
    assert s1.bytes - s0.bytes == start + 5 * 4096 + 7 * 1000
    assert type(sub.completed) is int and type(sub.bytes) is int
    # (in_flight is posted - completed - failed: the offset taken back.)
    sub.completed -= start
    sub.bytes -= start
    assert init.statistics().in_flight == 0


async def test_counters_past_63_bits_take_the_python_path(make_agent: MakeAgent) -> None:
    """A counter the compiled paths read as a C integer (_slot_int: the
    peer's, the Submission's posted) that no longer fits one: the Python
    arithmetic, not an OverflowError out of the submit or the drain (it was
    one: PyLong_AsLongLong raised before _slot_int's own check)."""
    init, local, remote = await _setup(make_agent)
    peer = next(iter(init._peers.by_ep.values()))
    k = peer._counters
    big = 1 << 64
    k.bytes += big
    k.completed += big
    prep = init.prepare("write", local[0:4096], remote[0:4096])
    for _ in range(3):
        assert (await within(prep.post(True))).nbytes == 4096
        assert (await within(init.write(local[0:512], remote[0:512]))).nbytes == 512
    assert k.completed >= big + 6 and k.bytes >= big + 3 * 4608
    assert k.inflight == 0 and k.inflight_bytes == 0
    k.bytes -= big
    k.completed -= big

"""Transfer.busy / Transfer.settled(): a cancelled transfer's future ends at
once, but the engine may still write its memory until its record comes;
settled() ends only then (what aioxfer.nixl's release of a request in flight
waits for)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import Pair, within

BIG = 64 << 20


@pytest.mark.parametrize("transport", ["tcp"])
async def test_a_cancelled_read_writes_nothing_once_settled(pair: Pair) -> None:
    src = pair.target.alloc(BIG, name="src")
    src.numpy()[:] = (np.arange(BIG) % 251 + 1).astype(np.uint8)  # no zero byte
    remote = await pair.remote("src")
    local = pair.init.register(np.zeros(BIG, dtype=np.uint8))
    late: list[tuple[int, int]] = []
    cancelled = 0
    for r in range(6):
        t = pair.init.read(local[0:BIG], remote[0:BIG])
        await asyncio.sleep(0.001 * r)  # (posted by the loop's flush meanwhile)
        if not t.cancel():
            continue  # finished already: nothing to cancel
        cancelled += 1
        assert t.done()
        await within(t.settled())
        assert not t.busy
        local.numpy()[:] = 0
        await asyncio.sleep(0.05)
        n = int(np.count_nonzero(local.numpy()))
        if n:
            late.append((r, n))
    assert cancelled, "every READ finished before its cancel: nothing was tested"
    assert not late, f"(round, bytes) landed after settled() ended: {late}"


@pytest.mark.parametrize("transport", ["tcp"])
async def test_settled_of_a_transfer_that_never_reached_the_engine_and_of_one_done(
        pair: Pair) -> None:
    src = pair.target.alloc(1 << 20, name="src")
    remote = await pair.remote("src")
    local = pair.init.register(bytearray(1 << 20))
    # Cancelled in the iteration that made it: dropped from the batch unposted.
    t = pair.init.read(local[0:1 << 20], remote[0:1 << 20])
    assert t.busy  # (to be posted)
    t.cancel()
    assert not t.busy
    s = t.settled()
    assert s.done()
    # Not cancelled: settled() ends with it (its record taken), busy until then.
    t = pair.init.read(local[0:1 << 20], remote[0:1 << 20])
    s = t.settled()
    assert not s.done() and t.busy
    await within(t)
    await within(s)
    assert not t.busy
    assert t.settled().done()
    assert src is not None

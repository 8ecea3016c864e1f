"""rev23: a lone 1 MiB READ's response copied by the awaiting thread as it
comes (read22: conn.c help_more), with a second request posted while the
first one's response may be half copied (then the endpoint has two in
flight: read_alone no longer holds, the receiver reads the second's, the
spinner may still own the first's mid-frame state), and with cancels landing
mid-response. Every completed READ must hold its own source's bytes, none
may land in another's destination or outside it, and a cancelled one ends
(cancelled or done) without hanging the next ones."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
from conftest import within

MiB = 1 << 20


async def test_second_request_and_cancels_during_a_whole_1mib_read(make_agent: Any) -> None:
    target = await make_agent("target", transports=("tcp",))
    a = target.alloc(MiB, name="a")
    b = target.alloc(MiB, name="b")
    a.numpy()[:] = (np.arange(MiB) % 251).astype(np.uint8)
    b.numpy()[:] = (np.arange(MiB) % 241 + 7).astype(np.uint8)
    init = await make_agent("init", transports=("tcp",))
    peer = await within(init.connect(target.address))
    local = init.alloc(4 * MiB, name="dst")
    guard = np.full(4 * MiB, 0x5A, dtype=np.uint8)
    ra, rb = peer.region("a")[0:MiB], peer.region("b")[0:MiB]
    da, db = local[MiB:2 * MiB], local[2 * MiB:3 * MiB]
    for k in range(60):
        local.numpy()[:] = guard
        t1 = init.read(da, ra)
        # let the first one go out alone (so the spinner takes its response),
        # then a second READ beside it, part of the time
        await asyncio.sleep(0)
        t2 = init.read(db, rb) if k % 2 else None
        if k % 3 == 2:
            await asyncio.sleep(0.0001 * (k % 7))
            t1.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await within(t1, 10)
        if t2 is not None:
            await within(t2, 10)
            assert np.array_equal(local.numpy()[2 * MiB:3 * MiB], b.numpy()), k
        # the engine lets go of t1 (a cancel resolves the Transfer at once)
        await within(t1.settled(), 10)
        got = local.numpy()
        if not t1.cancelled():
            assert np.array_equal(got[MiB:2 * MiB], a.numpy()), k
        else:  # whatever landed is a's bytes at their own offsets
            part = got[MiB:2 * MiB]
            ok = (part == a.numpy()) | (part == 0x5A)
            assert ok.all(), k
        assert np.array_equal(got[:MiB], guard[:MiB]), k
        assert np.array_equal(got[3 * MiB:], guard[3 * MiB:]), k
    # nothing of the cancelled READs holds dst once it is deregistered
    await within(init.deregister(local), 10)
    assert init.statistics().pinned_regions == 0

"""The drain's batched wake-ups (cyx/_completions.pxi _take_callbacks) see a
transfer's done callbacks in the C Future's own fields (fut_callback0 for
the first, fut_callbacks for the rest), read without ``fut._callbacks``
once a probe found them there. A transfer with callbacks must still have
them taken into the drain's one handle (an exception from one is reported
naming its future, which a loop's own handle does not), whether it has one
callback (only fut_callback0 set), several, or only ones in the list (the
first removed: fut_callback0 cleared); a transfer without any completes
without a wake-up. The last case ran every other callback twice before
(the C Future then hands out its own list, which the removals shrank while
they walked it): the awaiting task's wake-up too, resuming it while it
awaited something else."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import pattern, transport_kwargs, wait_until, within

KiB = 1024


def _dummy(fut: object) -> None:
    raise AssertionError("a removed callback ran")


@pytest.mark.parametrize(("per", "removed"), [(1, False), (3, False), (2, True)])
async def test_callbacks_in_the_futures_fields_are_batched(make_agent, per: int,
                                                           removed: bool) -> None:
    tkw = transport_kwargs("tcp")
    target = await make_agent("target", progress="sleep", **tkw)
    init = await make_agent("init", progress="sleep", **tkw)
    peer = await within(init.connect(target.address))
    dst = target.alloc(256 * KiB, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    src = init.register(pattern(256 * KiB, 13), name="src")
    loop = asyncio.get_running_loop()
    assert init._sub._engine.batch_wakeups
    ran: list[tuple[int, int]] = []
    caught: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: caught.append(context))
    try:
        n = 16
        ts = [init.write(src[i * 4 * KiB:(i + 1) * 4 * KiB], remote[i * 4 * KiB:(i + 1) * 4 * KiB])
              for i in range(n)]
        # Every other transfer gets callbacks; the rest complete without any.
        for i in range(0, n, 2):
            if removed:  # then the callback below is in fut_callbacks only
                ts[i].add_done_callback(_dummy)
            for k in range(per):
                def cb(fut: object, i: int = i, k: int = k) -> None:
                    ran.append((i, k))
                    if i == 4 and k == per - 1:
                        raise ValueError("callback 4")
                ts[i].add_done_callback(cb)
            if removed:
                assert ts[i].remove_done_callback(_dummy) == 1
        for t in ts:
            await within(t)
        await wait_until(lambda: len(ran) >= per * n // 2, what="every callback ran")
        await asyncio.sleep(0.05)  # and none runs twice
    finally:
        loop.set_exception_handler(previous)
    assert sorted(ran) == [(i, k) for i in range(0, n, 2) for k in range(per)]
    assert len(caught) == 1 and isinstance(caught[0]["exception"], ValueError)
    # Named: it ran in the drain's handle (a loop's own handle does not name it).
    assert caught[0].get("future") is ts[4]
    assert np.array_equal(dst.numpy()[:n * 4 * KiB], src.numpy()[:n * 4 * KiB])


class _RaisingEq:
    """A done callback whose ``==`` raises for anything but itself: what
    remove_done_callback's comparisons would run."""

    def __call__(self, fut: object) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        raise RuntimeError("__eq__ of a callback")

    __hash__ = object.__hash__


async def test_a_callbacks_raising_eq_leaves_the_batch_whole(make_agent) -> None:
    """The drain takes a transfer's callbacks off it as the C Future does
    before scheduling them (its fields cleared), not by remove_done_callback:
    that compared callbacks (a raising ``__eq__`` escaped the drain, whose
    finally freed the rest of the batch's records unread: 4 of 16 transfers
    never completed; rev13's finding)."""
    tkw = transport_kwargs("tcp")
    target = await make_agent("target", progress="sleep", **tkw)
    init = await make_agent("init", progress="sleep", **tkw)
    peer = await within(init.connect(target.address))
    target.alloc(256 * KiB, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    src = init.register(pattern(256 * KiB, 13), name="src")
    ts = [init.write(src[i * 4 * KiB:(i + 1) * 4 * KiB], remote[i * 4 * KiB:(i + 1) * 4 * KiB])
          for i in range(16)]
    ran: list[object] = []
    ts[0].add_done_callback(_RaisingEq())
    ts[0].add_done_callback(ran.append)
    done, pending = await asyncio.wait(ts, timeout=10)
    assert not pending, f"{len(pending)} transfers never completed"
    await wait_until(lambda: ran == [ts[0]], what="the second callback ran once")

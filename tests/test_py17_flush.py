"""Submission._flush, what a batch's first submit schedules on the loop, is
compiled (_cyx.submission_scheduled_flush: its Submitter's _scheduled_flush)
with the Python method's effects: the flush marked run, the eager streak
reset, the batch posted (alone=False); a batch with a cancelled transfer,
or a closed agent, goes to the Python post_pending."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pair_64k

from aioxfer import _cyx
from aioxfer.submission import Submission


async def test_the_scheduled_flush_posts_the_batch(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    assert Submission._flush is _cyx.submission_scheduled_flush
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    local.numpy()[:] = 3
    sub._eager_streak = 5
    ts = [init.write(local[i * 4096:(i + 1) * 4096], remote[i * 4096:(i + 1) * 4096])
          for i in range(3)]
    assert sub._flush_scheduled is True and len(sub._pending) == 3
    posted = sub.posted
    await asyncio.sleep(0)  # the loop runs the flush
    assert sub._flush_scheduled is False and sub._eager_streak == 0
    assert sub._pending == [] and sub._pending_t == [] and sub.posted == posted
    assert all(t._posted for t in ts)
    assert [(await t).nbytes for t in ts] == [4096] * 3
    back = init.alloc(1 << 16, name="back")
    assert (await init.read(back[0:12288], remote[0:12288])).nbytes == 12288
    assert bytes(back.memoryview[0:12288]) == b"\x03" * 12288


async def test_a_cancelled_transfer_in_the_batch_is_dropped(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    ts = [init.write(local[i * 4096:(i + 1) * 4096], remote[i * 4096:(i + 1) * 4096])
          for i in range(3)]
    ts[1].cancel()
    assert sub._pending_cancelled is True
    await asyncio.sleep(0)
    assert sub._flush_scheduled is False and sub._pending == []
    assert sub._pending_cancelled is False
    assert (await ts[0]).nbytes == 4096 and (await ts[2]).nbytes == 4096
    with pytest.raises(asyncio.CancelledError):
        await ts[1]
    assert ts[1].req_id not in sub.inflight


async def test_a_flush_after_close_posts_nothing(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    t = init.write(local[0:4096], remote[0:4096])
    sub.closed = True  # (what aclose sets first)
    try:
        sub._flush()
        assert sub._flush_scheduled is False and len(sub._pending) == 1
        assert not t._posted and not t.done()
    finally:
        sub.closed = False
    sub._flush()
    assert sub._pending == [] and (await t).nbytes == 4096

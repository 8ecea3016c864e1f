"""rev23: obj22's whole-request bound counts a request's wait for a pooled
connection of its own session.

Each attempt of our own requests is bounded as a whole (objects.py
``_timeout_for``: connect_timeout + read_timeout + bytes / min_rate, passed as
aiohttp's ``ClientTimeout(total=...)``), which aiohttp starts before it takes
a connection from the region's pool. The pool holds ``max_concurrency`` (16)
connections, the same count as the backend's pairs in progress, but each
pair's multipart upload sends up to 4 parts at once: 5 writes of 4 parts
each are 20 part requests for 16 connections, so 4 of them wait for a
connection while the first ones are served. A store that takes each part
well within its bound (here 1.2 s of a 2.1 s bound: a part alone succeeds)
then fails the queued parts as timeouts: the write fails (no retry) or burns
its retry budget on our own queueing, not on a slow server.

The store is an in-process aiohttp server (tests/conftest.py FakeS3) that
takes every part whole and answers it 1.2 s later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import FakeS3, s3_answer, s3_stage, within

MiB = 1 << 20
CREDS = dict(access_key_id="AKIDREV23", secret_access_key="SECRET-rev23", region="us-east-1")
PART_TAKES = 1.2  # seconds a part takes the store, once its body is in


def slow_parts(active: list[int]) -> Callable[[Any], Awaitable[Any]]:
    async def handler(req: Any) -> Any:
        if s3_stage(req) != "upload_part":
            return await s3_answer(req)
        await req.read()
        active[0] += 1
        active[1] = max(active[1], active[0])
        try:
            await asyncio.sleep(PART_TAKES)
        finally:
            active[0] -= 1
        return await s3_answer(req)
    return handler


async def test_queued_parts_are_not_timed_out_by_their_wait_for_a_connection(
        make_agent: Callable[..., Awaitable[Any]],
        fake_s3: Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[FakeS3]]) -> None:
    active = [0, 0]
    srv = await fake_s3(slow_parts(active))
    agent = await make_agent("o")
    # bound per part attempt: 0.5 + 1.5 + 5 MiB / 50 MiB/s = 2.1 s; a part
    # alone takes 1.2 s (within it), each read waits at most 1.2 s (< 1.5)
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, **CREDS,
                                  part_size=5 * MiB, max_retries=0, check_multipart=False,
                                  connect_timeout=0.5, read_timeout=1.5,
                                  min_rate=50 * MiB)
    n = 20 * MiB  # four parts each
    srcs = [agent.alloc(n) for _ in range(5)]
    await within(asyncio.gather(*(agent.write(s[:], objs[f"k{i}"])
                                  for i, s in enumerate(srcs))), 60)
    # the store served at most the pool's 16 at once: the others waited
    assert active[1] <= 16

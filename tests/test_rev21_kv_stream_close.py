"""rev21: Store.aclose waits for the operations in flight (kv20), but a
LayerStream is not one of them: store.stream() is not counted (_op_begin),
and a stream whose blocks are below host memory brings them up with the
uncounted store._prefetch (LayerStream._start). Closed meanwhile, the tiers
and the host memory go under the stream's reads, the failure kv20 fixed for
put/get/prefetch: here the close cancels the
store's fetch task under the stream's _prefetch, and the task iterating
the stream, which nobody cancelled, ends with CancelledError (12 of 12
rounds on integ 44dff3b). A real directory, a disk tier below a host tier: blocks
put on disk by one store, streamed by a second one closed after a few loop
turns. Each stream must end as a stream of a closed store may: delivered,
or refused with ClosedResourceError; nothing else, and nothing logged."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.errors import ClosedResourceError

BB = 64 << 10
N = 16
MakeAgent = Callable[..., Awaitable[Any]]


async def _consume(stream: Any) -> int:
    n = 0
    async with stream:
        async for _layer in stream:
            n += 1
    return n


async def test_close_under_a_stream_from_disk(make_agent: MakeAgent, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    agent = await make_agent("rev21-stream")
    keys = kv.chain(np.arange(16 * N), block_tokens=16, namespace=b"rev21s")
    src = agent.alloc(N * BB)
    src.numpy()[:] = pattern(N * BB, 7)
    path = tmp_path / "kv"
    async with kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.DiskTier(path, 256 * BB, segment_bytes=8 * BB)]) as first:
        assert (await within(first.put(keys, src[0:N * BB], durable=True))).stored == N
    dst = agent.alloc(N * BB)
    odd: list[tuple[int, BaseException]] = []
    for turns in range(0, 24, 2):
        store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(2 * N * BB), kv.DiskTier(path, 256 * BB, segment_bytes=8 * BB)]))
        task = asyncio.ensure_future(_consume(store.stream(keys, dst[0:N * BB], layers=4)))
        for _ in range(turns):
            await asyncio.sleep(0)
        await within(store.aclose())
        try:
            await within(task)
        except ClosedResourceError:
            pass
        except (Exception, asyncio.CancelledError) as exc:  # the finding: what it raised
            # (CancelledError out of a task nobody cancelled: the close
            # cancelled the store's fetch task under the stream's _prefetch)
            odd.append((turns, exc))
    bad = [ln for ln in capsys.readouterr().err.splitlines()
           if re.search(r"\[(warning|error)", ln)]
    assert not odd and not bad, ([(t, repr(e)) for t, e in odd], bad[:3])

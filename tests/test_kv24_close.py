"""Store.aclose cancelled, continued (kv24).

- A cancelled aclose whose close then fails: the cancelled caller sees
  CancelledError (the failure attached as its cause, and logged), while a
  caller that waits for the same close uncancelled sees the failure
  (before: the cancelled caller got the close's exception, its cancel
  lost)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv

MakeAgent = Callable[..., Awaitable[Any]]


class JournalTier(kv.Tier):
    """A tier of the application's own (the public Tier interface) that
    stores nothing and writes a journal file when the store closes: its
    close fails for real once its directory is gone."""

    stores = False

    def __init__(self, path: Path) -> None:
        super().__init__("journal")
        self.path = path

    def _locate(self, key: bytes) -> None:
        return None

    async def _aclose(self) -> None:
        self.path.write_bytes(b"closed\n")


async def test_cancelled_caller_of_a_failing_close_sees_its_cancel(
        make_agent: MakeAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    agent = await make_agent("kv24-fail")
    bb, n = 64 << 10, 8
    gone = tmp_path / "journal"
    gone.mkdir()
    host = kv.HostTier(4 * n * bb)
    store = await within(kv.Store.open(agent, block_bytes=bb, tiers=[
        host, kv.DiskTier(tmp_path / "disk", 16 * n * bb, segment_bytes=n * bb),
        JournalTier(gone / "log")]))
    src = agent.alloc(n * bb)
    src.numpy()[:] = pattern(n * bb, 241)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv24f")
    assert (await within(store.put(keys, src[0:n * bb]))).stored == n  # dirty: a flush to do
    shutil.rmtree(gone)
    cancelled = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0)  # the close has begun (its task made)
    waiting = asyncio.ensure_future(store.aclose())  # shares it
    await asyncio.sleep(0)
    assert not cancelled.done() and not waiting.done()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError) as got:
        await within(cancelled)
    # The failure is not lost on the cancelled caller: its cause, and logged.
    assert isinstance(got.value.__cause__, FileNotFoundError), repr(got.value.__cause__)
    with pytest.raises(FileNotFoundError):
        await within(waiting)
    assert store.closed and host.region is not None and host.region.closed
    await within(store.aclose())  # nothing left to do
    assert "kv.close_failed" in capsys.readouterr().err

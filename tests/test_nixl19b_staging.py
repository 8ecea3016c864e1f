"""staging: a file half cancelled while its copy is in flight returns only
once the engine no longer moves its bytes (rev19 #1, staging case:
GpuFileStager._move gave its bounce slot back to the pool while the
cancelled copy could still land in it, into the next move's page).
GpuFileStager needs CUDA; its file half through the agent's file transport
(FileRegion, the same await of a Transfer) runs here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aioxfer.staging import FileRegion

SIZE = 64 << 20


@pytest.mark.parametrize("io", ["threads", "auto"])
async def test_cancelled_file_read_lands_nothing_after_the_cancel(
        make_agent: Callable[..., Awaitable[Any]], tmp_path: Path, io: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if io == "threads":
        monkeypatch.setenv("AIOXFER_FILE_IO", "threads")
    else:
        monkeypatch.delenv("AIOXFER_FILE_IO", raising=False)
    agent = await make_agent("files")
    path = tmp_path / "pages.bin"
    path.write_bytes((np.arange(SIZE) % 251 + 1).astype(np.uint8).tobytes())  # no zero byte
    side = FileRegion(agent.register_file(path))
    host = agent.alloc(SIZE)
    mem = np.frombuffer(host.memoryview, dtype=np.uint8)
    posted: list[Any] = []
    read = agent.read

    def spy(*args: Any, **kwargs: Any) -> Any:
        t = read(*args, **kwargs)  # the real read: only its Transfer is kept
        posted.append(t)
        return t

    monkeypatch.setattr(agent, "read", spy)
    late = []
    busy = []
    for delay in (0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.001, 0.002):
        mem[:] = 0
        task = asyncio.ensure_future(side.read_into(host[0:SIZE], 0))
        await asyncio.sleep(delay)
        if task.done():
            continue
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        busy.append(posted[-1].busy)
        # The caller may reuse the bounce slot now: nothing may land in it.
        mem[:] = 0
        await asyncio.sleep(0.05)
        late.append(int(np.count_nonzero(mem)))
    assert late and not any(busy) and not any(late), (busy, late)

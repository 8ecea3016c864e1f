"""_runtime.Runtime.run: a TimeoutError the coroutine raised itself (on
3.11 the same class as concurrent.futures.TimeoutError) is the coroutine's
error, not "no answer within N s"."""

from __future__ import annotations

import asyncio

import pytest


def test_run_reports_the_coroutines_own_timeout() -> None:
    from aioxfer.nixl._runtime import runtime

    rt = runtime()

    async def times_out() -> None:
        await asyncio.wait_for(asyncio.sleep(10), 0.01)

    async def raises() -> None:
        raise TimeoutError("the coroutine's own")

    with pytest.raises(TimeoutError, match="the coroutine's own"):
        rt.run(raises(), timeout=5.0)
    with pytest.raises(TimeoutError) as info:
        rt.run(times_out(), timeout=5.0)
    assert "no answer" not in str(info.value)

    async def answers() -> int:
        return 7

    assert rt.run(answers(), timeout=5.0) == 7

    async def slow() -> None:
        await asyncio.sleep(10)

    # Ours: the coroutine did not answer in time (and is cancelled).
    with pytest.raises(TimeoutError, match="no answer within 0.05 s"):
        rt.run(slow(), timeout=0.05)

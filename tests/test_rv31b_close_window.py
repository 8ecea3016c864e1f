"""rv31b (second-wave review of reg31/rev31): registration's release paths
while the agent closes.

- aioxfer/registration.py Memory.deregister: a region deregistered after
  ``aclose()`` marked the agent closed but before the engine shut down (the
  close still awaits its backends and its cancelled tasks) was dropped from
  the agent's table and its awaitable resolved at once, its memory never
  given back: the engine still had it registered (same-host peers could
  still reach it), and the close that followed skipped it, so an alloc'd
  region's memfd stayed open and mapped for good (a DeviceBuffer of it
  stayed allocated after its close()). A region registered while
  ``aclose()`` waited for peers to release the others (allowed: the agent
  is not closed yet) is the one that can be there then.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from conftest import SAME_HOST, sigstop, within

import aioxfer

MiB = 1 << 20


async def test_a_region_deregistered_while_the_agent_closes_is_released_by_the_close(
    remote_agent: Any,
) -> None:
    target = aioxfer.Agent("target", limits=aioxfer.Limits(close_timeout=1.0))
    await target.start()
    target.alloc(MiB, name="dst")
    ra = await remote_agent(size=MiB, name="sleeper")
    try:
        assert await ra.call("connect", target.address) == SAME_HOST
        await ra.call("flood", target.address, "pool", "dst", MiB)
        sigstop(ra.pid)  # it maps "dst" and never acknowledges its revocation
        closer = asyncio.ensure_future(target.aclose())
        for _ in range(500):  # aclose() waits for the stopped peer now
            if target._memory._settled is not None:
                break
            await asyncio.sleep(0.01)
        assert target._memory._settled is not None and not target.closed
        late = target.alloc(MiB, name="late")  # not closed yet: taken
        fd = late._memfd
        assert fd >= 0

        async def deregister_in_the_window() -> Any:
            while not target.closed:
                await asyncio.sleep(0)
            assert not closer.done()  # the engine has not shut down yet
            return target.deregister(late)

        released = await within(deregister_in_the_window(), 10)
        await within(closer, 10)
        await within(released, 2)
        # The close gave the memory back (before: open and mapped for good).
        assert late._memfd == -1 and late._mmap is None
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        ra.kill()

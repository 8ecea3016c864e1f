"""A conformance check any local backend can run (as trio's
``check_two_way_stream`` is for streams): what agent.write/read with its
regions must do, whoever wrote the backend.

    from aioxfer.backends.testing import check_local_backend

    async def test_my_backend(tmp_path):
        async with aioxfer.Agent("t") as agent:
            region = aioxfer.backends.register_region(agent, "mybackend", ...)
            await check_local_backend(agent, region)

The region must be empty of the keys ``conformance-*`` and take string keys
(``region[key]``, ``region.segments(keys)``) for whole blobs. Raises
AssertionError saying what did not hold. With ``close_agent=True`` it ends
by closing the agent with a request in flight (ClosedResourceError).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from aioxfer.backends.base import BackendRegion
from aioxfer.errors import ClosedResourceError, ObjectNotFound
from aioxfer.transfer import Transfer

if TYPE_CHECKING:
    from aioxfer.agent import Agent

__all__ = ["check_local_backend"]

_STEP = 30.0  # seconds any one request may take before the check calls it a hang


def _keyed(region: BackendRegion) -> Any:
    """The region as what the check uses it for: region[key], region.segments(keys)."""
    return region


async def _wait_idle(region: BackendRegion, what: str) -> None:
    deadline = time.monotonic() + _STEP
    while region.backend.statistics().in_flight:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: I/O still in flight after {_STEP} s")
        await asyncio.sleep(0.01)


async def check_local_backend(
    agent: Agent, region: Any, *, n: int = 24, size: int = 16 << 10, close_agent: bool = False
) -> None:
    """Runs the checks (see the module docstring) on ``region`` of ``agent``."""
    if not isinstance(region, BackendRegion):
        raise TypeError(f"{region!r} is not a local backend's region")
    backend = region.backend
    region = _keyed(region)
    before = backend.statistics()
    data = np.frombuffer(np.random.default_rng(7).bytes(n * size), dtype=np.uint8)
    src = agent.register(bytearray(data.tobytes()))
    dst = agent.register(bytearray(n * size))
    offs = np.arange(n, dtype=np.uint64) * size
    lens = np.full(n, size, dtype=np.uint64)
    keys = [f"conformance-{i}" for i in range(n)]
    try:
        # One pair: posted at once, an awaitable Transfer, result names the backend.
        t = agent.write(src[0:size], region[keys[0]])
        assert isinstance(t, Transfer), f"write returned {type(t).__name__}, not a Transfer"
        async with asyncio.timeout(_STEP):
            res = await t
        assert res.nbytes == size, f"TransferResult.nbytes {res.nbytes} != {size}"
        assert res.path == backend.name, f"TransferResult.path {res.path!r} != {backend.name!r}"
        async with asyncio.timeout(_STEP):
            await agent.read(dst[0:size], region[keys[0]])
        assert bytes(dst.obj[0:size]) == data.tobytes()[0:size], "read back other bytes"

        # Batches: a SegmentList to region.segments(), then a list of pairs in reverse.
        async with asyncio.timeout(_STEP):
            await agent.write(src.segments(offs, lens), region.segments(keys))
        dst.numpy()[:] = 0
        order = list(reversed(range(n)))
        async with asyncio.timeout(_STEP):
            await agent.read([dst[i * size : (i + 1) * size] for i in range(n)],
                             [region[keys[j]] for j in order])
        got = dst.numpy().reshape(n, size)
        want = data.reshape(n, size)
        bad = [i for i, j in enumerate(order) if not np.array_equal(got[i], want[j])]
        assert not bad, f"batched read: pairs {bad[:5]} hold other bytes"

        # A missing key: ObjectNotFound, with the failing pair's index.
        try:
            async with asyncio.timeout(_STEP):
                await agent.read([dst[0:size], dst[size : 2 * size]],
                                 [region[keys[0]], region["conformance-absent"]])
        except ObjectNotFound as exc:
            assert exc.fail_index == 1, f"fail_index {exc.fail_index}, not 1"
        else:
            raise AssertionError("reading a missing key did not raise ObjectNotFound")

        # Cancellation: prompt for the caller; in flight until the I/O stopped,
        # and the memory untouched after that.
        t = agent.read(dst.segments(offs, lens), region.segments(keys))
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("a cancelled transfer did not raise CancelledError")
        await _wait_idle(region, "cancel")
        dst.numpy()[:] = 0
        await asyncio.sleep(0.05)
        assert not dst.numpy().any(), "memory written after the cancelled transfer was over"

        # A deadline around the await.
        try:
            async with asyncio.timeout(0.0005):
                await agent.read(dst.segments(offs, lens), region.segments(keys))
        except TimeoutError:
            pass
        await _wait_idle(region, "deadline")

        after = backend.statistics()
        posted = after.transfers_posted - before.transfers_posted
        done = (after.transfers_completed - before.transfers_completed
                + after.transfers_failed - before.transfers_failed)
        assert posted == 7 and done == 7, f"statistics: {posted} posted, {done} finished of 7"
        assert after.in_flight == 0 and after.in_flight_bytes == 0, "statistics: still in flight"

        if close_agent:
            t = agent.read(dst.segments(offs, lens), region.segments(keys))
            await asyncio.sleep(0)
            await agent.aclose()
            try:
                await t
            except ClosedResourceError:
                pass
            except BaseException as exc:  # the transfer may also have finished first
                raise AssertionError(f"closing the agent failed the transfer with {exc!r}") from exc
            assert backend.statistics().in_flight == 0, "in flight after agent.aclose()"
    finally:
        if not agent.closed:
            agent.deregister(src)
            agent.deregister(dst)

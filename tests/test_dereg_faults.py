"""Fault review of submission, scheduling and registration: each test failed
before the fix it names."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from conftest import SAME_HOST, sigstop, within

import aioxfer
from aioxfer import registration

MiB = 1 << 20


@pytest.mark.parametrize("priority", ["urgent", None, 1.5, float("nan")])
async def test_a_bad_priority_is_refused_before_anything_is_counted(
    make_agent: Any, priority: Any
) -> None:
    """submission.Submission._submit_py: a priority the scheduler cannot
    order raised TypeError out of the heap only after the transfer was made
    and counted in flight: in_flight stayed 1 until close, and the hidden
    transfer failed then, unretrieved (the loop's exception handler). A
    float was taken (NaN breaks the heap's order)."""
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_requests=1)
    target.alloc(64 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    src = init.register(bytearray(32 * MiB))
    first = init.write(src[0:32 * MiB], peer.region("dst")[0:32 * MiB])
    posted = init.statistics().transfers_posted
    with pytest.raises(TypeError, match="priority"):
        init.write(src[0:4096], peer.region("dst")[0:4096], priority=priority)
    assert init.statistics().transfers_posted == posted
    await within(first)
    st = init.statistics()
    assert st.in_flight == 0, st
    ps = peer.statistics()
    assert ps.in_flight == 0 and ps.queued == 0
    # numpy's integers (any operator.index) still order
    np = pytest.importorskip("numpy")
    done = await within(init.write(src[0:4096], peer.region("dst")[0:4096],
                                   priority=np.int64(3)))
    assert done.nbytes == 4096
    await asyncio.sleep(0)


async def test_a_deregistration_the_close_gave_up_on_does_not_hang(remote_agent: Any) -> None:
    """registration.Memory._quarantine_held: a region a stopped same-host
    peer still maps when aclose() gives up is quarantined for good, and the
    awaitable deregister() returned for it never completed: a task awaiting
    it hung forever. It now fails with ClosedResourceError (the memory stays
    pinned, never to be reused: not a success); one nobody awaits logs
    nothing (awaiting deregister() is optional)."""
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    target = aioxfer.Agent("target", limits=aioxfer.Limits(close_timeout=1.0))
    await target.start()
    dst = target.alloc(MiB, name="dst")
    other = target.alloc(MiB, name="other")
    left = target.alloc(MiB, name="left")  # never deregistered: aclose does
    ra = await remote_agent(size=MiB, name="sleeper")
    try:
        assert await ra.call("connect", target.address) == SAME_HOST
        await ra.call("flood", target.address, "pool", "dst", MiB)
        sigstop(ra.pid)
        released = target.deregister(dst)
        waiter = asyncio.ensure_future(released)
        target.deregister(other)  # its awaitable ignored
        await within(target.aclose(), 10)
        with pytest.raises(aioxfer.ClosedResourceError, match="dst"):
            await within(waiter, 2)
        del released, waiter
        gc.collect()  # the ignored awaitable goes: nothing logged for it
        await asyncio.sleep(0)
        assert not logged, logged
        # The interpreter's exit clears the quarantine (a module global): its
        # regions' release futures go then. One of a region aclose() itself
        # deregistered (nobody holds an awaitable of it) logged "Future
        # exception was never retrieved" there, once per region.
        kept = [r for r in registration._QUARANTINE if r is left]
        assert kept, "the region the peer held was not quarantined"
        registration._QUARANTINE.remove(left)
        del kept, left
        gc.collect()
        await asyncio.sleep(0)
        assert not logged, logged
    finally:
        loop.set_exception_handler(old_handler)
        ra.kill()


async def test_cancelling_the_head_of_the_queue_admits_what_fits_behind_it(
    make_agent: Any,
) -> None:
    """submission.Submission.cancel / scheduling.PeerScheduler.admit_ready: a
    queued request cancelled at the head of its peer's queue (a large one,
    waiting for budget) left the small ones behind it waiting, though they
    fit at once, until some request in flight completed (a stalled one: no
    bound at all)."""
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_bytes=40 * MiB)
    dst = target.alloc(64 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    src = init.register(bytearray(b"q" * (64 * MiB)))
    remote = peer.region("dst")
    first = init.write(src[0:32 * MiB], remote[0:32 * MiB])
    big = init.write(src[0:16 * MiB], remote[32 * MiB:48 * MiB])  # 48 > 40: waits
    small = init.write(src[0:4096], remote[60 * MiB:60 * MiB + 4096])  # FIFO: behind big
    assert peer.statistics().queued == 2
    assert big.cancel()
    st = peer.statistics()
    assert (st.queued, st.in_flight) == (0, 2), st  # small went, before first completed
    assert not first.done()
    await within(asyncio.gather(first, small))
    with pytest.raises(asyncio.CancelledError):
        await big
    assert bytes(dst.memoryview[60 * MiB:60 * MiB + 4096]) == b"q" * 4096
    st = peer.statistics()
    assert (st.queued, st.in_flight, st.in_flight_bytes) == (0, 0, 0)

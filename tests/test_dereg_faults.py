"""Fault review of submission, scheduling and registration: each test failed
before the fix it names."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import within

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

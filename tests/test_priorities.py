"""Per-peer limits and priorities, through the agent: requests over a peer's
limits wait in the scheduler (write() still returns at once), a
latency-critical request overtakes queued bulk traffic to the same peer, a
queued request can be cancelled, and a lost peer fails what is queued."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from conftest import digest, pattern, within

import aioxfer

MiB = 1 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_latency_critical_overtakes_bulk(make_agent, remote_agent, transport) -> None:
    kw = {"transports": ("tcp",)} if transport == "tcp" else {}
    size = 64 * MiB
    ra = await remote_agent(size=size, **kw)
    init = await make_agent("init", peer_max_bytes=16 * MiB, **kw)
    peer = await within(init.connect(ra.address))
    src = init.register(pattern(size, seed=31))
    pool = peer.region("pool")
    # 1 GiB of bulk prefetch: 64 writes of 16 MiB, the limit admits one at a time.
    chunk = 16 * MiB
    bulk = [init.write(src[(i % 4) * chunk:(i % 4 + 1) * chunk],
                       pool[(i % 4) * chunk:(i % 4 + 1) * chunk]) for i in range(64)]
    assert peer.statistics().queued == 63 and peer.statistics().in_flight == 1
    urgent = init.write(src[0:4096], peer.region("user")[0:4096], priority=10)
    await within(urgent, 30)
    done_bulk = sum(t.done() for t in bulk)
    print(f"urgent done with {done_bulk} of 64 bulk writes done")
    assert done_bulk < 8, "the urgent write waited for the bulk backlog"
    await within(asyncio.gather(*bulk), 60)
    assert await ra.call("digest", "pool", 0, size) == digest(src.memoryview)
    st = peer.statistics()
    assert st.queued == 0 and st.in_flight == 0 and st.in_flight_bytes == 0


async def test_queued_request_cancelled(make_agent) -> None:
    target = await make_agent("target")
    init = await make_agent("init", peer_max_requests=1)
    target.alloc(32 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    src = init.register(bytearray(32 * MiB))
    first = init.write(src[0:32 * MiB], peer.region("dst")[0:32 * MiB])
    second = init.write(src[0:MiB], peer.region("dst")[0:MiB])
    assert peer.statistics().queued == 1
    assert second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert peer.statistics().queued == 0
    await within(first)
    third = await within(init.write(src[0:MiB], peer.region("dst")[0:MiB]))
    assert third.nbytes == MiB
    st = init.statistics()
    assert st.in_flight == 0


async def test_lost_peer_fails_queued(make_agent, remote_agent) -> None:
    ra = await remote_agent(size=64 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_requests=1, peer_timeout=2.0)
    peer = await within(init.connect(ra.address))
    src = init.register(bytearray(64 * MiB))
    ts = [init.write(src[0:64 * MiB], peer.region("pool")[0:64 * MiB]) for _ in range(8)]
    assert peer.statistics().queued == 7
    os.kill(ra.pid, signal.SIGKILL)
    ra.closed = True
    results = await within(asyncio.gather(*ts, return_exceptions=True), 20)
    failed = [r for r in results if isinstance(r, aioxfer.PeerLost)]
    assert len(failed) >= 7, results
    assert all(isinstance(r, aioxfer.TransferResult | aioxfer.PeerLost) for r in results)
    st = peer.statistics()
    assert st.queued == 0 and st.in_flight == 0


def test_limit_arguments_checked() -> None:
    with pytest.raises(ValueError):
        aioxfer.Agent("x", peer_max_bytes=0)
    with pytest.raises(ValueError):
        aioxfer.Agent("x", peer_max_requests=-1)


async def test_queued_transfer_of_a_deregistered_region_finishes(make_agent) -> None:
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_requests=1)
    dst = target.alloc(64 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    big = init.register(bytearray(32 * MiB))
    small = init.register(bytearray(b"B" * 4096))
    first = init.write(big[0:32 * MiB], peer.region("dst")[0:32 * MiB])
    queued = init.write(small[0:4096], peer.region("dst")[40 * MiB:40 * MiB + 4096])
    assert peer.statistics().queued == 1
    released = init.deregister(small)
    await within(first)
    await within(queued)  # posted before deregister(): finishes first
    await within(released)
    assert bytes(dst.memoryview[40 * MiB:40 * MiB + 4096]) == b"B" * 4096

"""Rails on loopback: an agent listening on several addresses is reached over
all of them, large transfers are striped over every rail, each rail is
reported, and a rail that cannot be reached at connect is left out (and
probed) while the others carry the data. Failures of a live rail (link down,
blackhole) are tested with real network namespaces in test_rails_netns.py."""

from __future__ import annotations

import asyncio

import numpy as np
from conftest import SAME_HOST, digest, pattern, within

import aioxfer

MiB = 1 << 20


async def test_two_rails_stripe_and_report(make_agent) -> None:
    target = await make_agent("target", listen=["127.0.0.1:0", "127.0.0.2:0"],
                              transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=2)
    assert len(target.addresses) == 2 and target.address == target.addresses[0]
    dst = target.alloc(64 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    assert peer.rails == target.addresses
    src = init.register(pattern(64 * MiB, seed=5))
    for _ in range(3):
        await within(init.write(src[0:64 * MiB], peer.region("dst")[0:64 * MiB]), 30)
    assert digest(dst.memoryview) == digest(src.memoryview)
    st = peer.statistics()
    assert [r.address for r in st.rails] == target.addresses
    assert all(r.up and r.connections == 2 for r in st.rails)
    assert all(r.bytes > 0 for r in st.rails), st.rails  # both carried data
    assert sum(r.bytes for r in st.rails) == 3 * 64 * MiB
    assert st.reroutes == 0 and st.bandwidth > 0 and st.in_flight_bytes == 0


async def _unlisten(agent, i: int) -> None:
    """Listener i goes away: its accept loop ends (its reader removed) before
    the socket closes, so no later socket reusing its fd number is read by it."""
    task = agent._accept_tasks[i]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    agent._lsocks[i].close()


async def test_unreachable_rail_left_out_and_probed(make_agent, capsys) -> None:
    target = await make_agent("target", listen=["127.0.0.1:0", "127.0.0.3:0"],
                              transports=("tcp",))
    # The second rail's listener goes away: nothing answers there any more.
    await _unlisten(target, 1)
    init = await make_agent("init", transports=("tcp",), rail_probe=0.05)
    dst = target.alloc(8 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    src = init.register(pattern(8 * MiB, seed=6))
    await within(init.write(src[0:8 * MiB], peer.region("dst")[0:8 * MiB]))
    assert bytes(dst.memoryview) == bytes(src.memoryview)
    st = peer.statistics()
    assert st.rails[0].up and not st.rails[1].up
    assert st.rails[1].bytes == 0
    await asyncio.sleep(0.2)  # a few probes fail, quietly
    assert not peer.statistics().rails[1].up
    assert "rail.down" in capsys.readouterr().err


async def test_rail_statistics_for_shm_peer(make_agent) -> None:
    target = await make_agent("target")
    init = await make_agent("init")
    target.alloc(MiB, name="dst")
    peer = await within(init.connect(target.address))
    assert peer.path == SAME_HOST
    st = peer.statistics()
    assert len(st.rails) == 1 and st.rails[0].up
    src = init.register(np.zeros(4096, dtype=np.uint8))
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert peer.statistics().latency > 0


def test_listen_argument_checks() -> None:
    import pytest

    with pytest.raises(ValueError):
        aioxfer.Agent("x", listen=[])
    with pytest.raises(ValueError):
        aioxfer.Agent("x", rail_probe=0)
    with pytest.raises(ValueError):
        aioxfer.Agent("x", stall_timeout=-1)


async def test_probes_of_a_lost_peer_end_with_it(make_agent) -> None:
    """A rail that never answers is re-dialled with backoff (up to
    rail_probe_max between tries); once its peer is gone (closed here, or
    lost) the probe ends at once instead of sleeping out its backoff (before:
    up to rail_probe_max seconds, holding the Peer)."""
    target = await make_agent("target", listen=["127.0.0.1:0", "127.0.0.3:0"],
                              transports=("tcp",))
    await _unlisten(target, 1)  # nothing answers on the second rail
    init = await make_agent("init", transports=("tcp",), rail_probe=0.1,
                            limits=aioxfer.Limits(rail_probe_max=30.0))
    peer = await within(init.connect(target.address))
    assert not peer.statistics().rails[1].up
    await asyncio.sleep(1.6)  # probes at 0.1, 0.3, 0.7, 1.5 s: the next waits 1.6 s
    assert len(init._probes) == 1
    await peer.aclose()
    await asyncio.sleep(0.3)
    assert not init._probes, "a lost peer's rail is still being probed"

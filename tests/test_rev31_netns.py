"""A link that drops under a peer's data path, over real links (tests/netns.py).

An initiator in namespace b is connected over tcp to a target in namespace a
by one veth pair (one rail). The link goes down (``ip link set down`` in a):
a write and a notification posted then, and one already waiting, fail typed
(PeerLost) within the keepalive bound, never hang; a connect while the link
is down fails typed (TransportError) within peer_timeout; once the link is
back, a new connect and its transfers work; both agents close with nothing
in flight and no native op, region or pin left (rev31's fault review).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import netns
import pytest
from netns import NsAgent, Rails, WorkerError

PEER_TIMEOUT = 1.0
KEEPALIVE = 0.2
# How long past peer_timeout a failure may take on a busy 2-vCPU host (a hang
# detector, not a timing: the calls below are bounded by it).
SLACK = 10.0
PORT = 7131
MiB = 1 << 20


@pytest.fixture
def net() -> Iterator[Rails]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"netns tests need network namespaces: {reason}")
    with netns.rails(1, prefix="10.131") as r:
        yield r
    assert not netns.leftover_namespaces(), "namespaces left behind"


async def test_link_down_fails_the_data_path_typed_and_a_later_connect_works(
    net: Rails,
) -> None:
    opts = {"transports": ("tcp",), "peer_timeout": PEER_TIMEOUT, "keepalive": KEEPALIVE}
    agents: list[NsAgent] = []
    try:
        target, init = await asyncio.gather(
            NsAgent.start(net, "a", "target", listen=f"{net.rail(1).addr_a}:{PORT}", **opts),
            NsAgent.start(net, "b", "init", listen=f"{net.rail(1).addr_b}:0", **opts),
        )
        agents += [target, init]
        await target.call("alloc", "dst", MiB)
        await init.call("alloc", "src", MiB, 7)
        await init.call("connect", target.address, timeout=20)
        assert tuple(await init.call("write", target.address, "src", 0, "dst", 0, MiB)) == (
            "ok", "tcp")
        assert tuple(await init.call("notify", target.address, b"up")) == ("ok", "")

        net.link_down(1)
        t0 = time.monotonic()
        bound = PEER_TIMEOUT + KEEPALIVE + SLACK
        results = await asyncio.gather(
            init.call("write", target.address, "src", 0, "dst", 0, MiB, timeout=bound),
            init.call("notify", target.address, b"down", timeout=bound),
            init.call("write", target.address, "src", 4096, "dst", 4096, 4096, timeout=bound),
        )
        took = time.monotonic() - t0
        kinds = [kind for kind, _ in results]
        assert kinds == ["PeerLost"] * 3, results
        assert await init.call("peer_lost", target.address)
        # A new connect over the dead link: refused typed within its bound.
        with pytest.raises(WorkerError, match="TransportError"):
            await init.call("connect", target.address, timeout=PEER_TIMEOUT + SLACK)
        print(f"\nlink down: the data path failed PeerLost after {took:.2f} s")

        net.link_up(1)
        deadline = time.monotonic() + 30
        while True:  # (the link's carrier and routes come back in a moment)
            try:
                await init.call("connect", target.address, timeout=20)
                break
            except WorkerError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert tuple(await init.call("write", target.address, "src", 0, "dst", 0, MiB)) == (
            "ok", "tcp")
        assert await target.call("digest", "dst") == await init.call("digest", "src")
        assert tuple(await init.call("notify", target.address, b"back")) == ("ok", "")
        notes = [p for _, p in await target.call("notes", 0.5)]
        assert b"up" in notes and b"back" in notes, notes
        stats = await init.call("stats")
        assert stats["in_flight"] == 0 and stats["native_ops"] == 0, stats
    finally:
        finals = await netns.close_all(agents)
    netns.assert_closed_clean(agents, finals)

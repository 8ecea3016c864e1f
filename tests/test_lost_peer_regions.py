"""A region its peer dropped, then the peer gone: a write names the loss.

A peer that closes deregisters its regions (published to its connected
peers and to etcd) and then leaves; the news can reach us in either order
(CI saw the region vanish before the departure in test_discovery's
test_join_update_leave). Whatever came first, once the peer is lost a
request to one of its regions fails PeerLost, as it would had the loss come
first: the deregistration is a detail of the peer's going.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import wait_until, within

import aioxfer


async def test_a_dropped_region_of_a_lost_peer_fails_peer_lost(make_agent: Any) -> None:
    b = await make_agent("b")
    a = await make_agent("a")
    more = b.register(bytearray(4096), name="more")
    peer = await within(a.connect(b.address))
    rr = peer.region("more")
    src = a.register(bytearray(4096))
    await within(a.write(src[0:16], rr[0:16]))

    # The deregistration first, seen by a refresh: the region is gone, the
    # peer is not (yet): AccessDenied, the owner's doing.
    b.deregister(more)
    await within(peer.refresh())
    assert rr.gone and not peer.lost
    with pytest.raises(aioxfer.AccessDenied):
        await within(a.write(src[0:16], rr[0:16]))

    # Then the departure: the same request now fails as the peer's loss.
    await within(b.aclose())
    await wait_until(lambda: peer.lost, what="peer lost after its close")
    with pytest.raises(aioxfer.PeerLost):
        await within(a.write(src[0:16], rr[0:16]))
    with pytest.raises(aioxfer.PeerLost):
        await within(a.read(src[0:16], rr[0:16]))

"""rv33: review of nat33's rail keepalive (a tcp peer's connections other
than the first ping every half of the peer's timeout, learnt from its pings).

Peers configured apart: the connecting agent's timeout is longer than its
peer's, so its rails must learn the peer's shorter timeout from the peer's
pings and ping within it; and the other way round. Each side's idle rails
must stay up over several of the shorter timeouts (real agents, real
sockets), and still carry data afterwards.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import within


def live(peer: Any) -> int:
    return sum(r.connections for r in peer.statistics().rails)


@pytest.mark.parametrize(("a_timeout", "b_timeout"), [(2.0, 0.4), (0.4, 2.0)])
async def test_rails_of_peers_with_other_timeouts_stay_up(
    make_agent: Any, a_timeout: float, b_timeout: float
) -> None:
    a = await make_agent("a", transports=("tcp",), tcp_connections=4, peer_timeout=a_timeout)
    b = await make_agent("b", transports=("tcp",), tcp_connections=4, peer_timeout=b_timeout)
    b.alloc(1 << 20, name="dst")
    peer = await within(a.connect(b.address))
    src = a.register(bytearray(1 << 20))
    await within(a.write(src[0 : 1 << 20], peer.region("dst")[0 : 1 << 20]))
    for _ in range(200):  # the rail's other connections join after the connect
        if live(peer) == 4:
            break
        await asyncio.sleep(0.01)
    assert live(peer) == 4
    # Idle (pings only) for five of the shorter timeouts, watched closely: a
    # rail declared silent is dialled again at once, so only its absence
    # meanwhile shows.
    low = 4
    end = asyncio.get_running_loop().time() + 5 * min(a_timeout, b_timeout)
    while asyncio.get_running_loop().time() < end:
        low = min(low, live(peer))
        await asyncio.sleep(0.01)
    assert not peer.lost
    assert low == 4, "an idle rail was declared silent"
    for _ in range(3):  # every connection still carries data
        await within(a.write(src[0 : 1 << 20], peer.region("dst")[0 : 1 << 20]))
    assert not peer.lost

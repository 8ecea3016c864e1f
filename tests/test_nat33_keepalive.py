"""Keepalive of a tcp peer's several connections (nat33, issue 13's idle CPU).

The first connection to a peer (its group's lead) pings at the configured
keepalive; the peer's other connections (rails) ping every half of the peer's
timeout, which the peer's own pings told: each connection is still heard
within the peer's timeout and judged silent on its own. Counted here with the
kernel's per-socket segment counters (``ss -ti``: data_segs_in) on the
accepting side's sockets, over an idle window: the pings of real connections,
no mock. The counts are compared with each other (one lead, three rails), not
with a time.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from typing import Any

import pytest
from conftest import within

KEEPALIVE = 0.05
PEER_TIMEOUT = 1.0
IDLE = 2.0  # two peer timeouts: each rail must be heard (it is not lost) and count its pings

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def segs_in(port: int) -> dict[str, int]:
    """data_segs_in per established tcp socket whose local port is port, by
    its peer address."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
        check=True, capture_output=True, text=True,
    ).stdout
    counts: dict[str, int] = {}
    peer = None
    for line in out.splitlines():
        addrs = re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", line)
        if len(addrs) >= 2:
            peer = addrs[1]
        m = re.search(r"\bdata_segs_in:(\d+)", line)
        if m and peer is not None:
            counts[peer] = int(m.group(1))
    return counts


async def test_rails_ping_at_half_the_peer_timeout(make_agent: Any) -> None:
    kw: dict[str, Any] = {"transports": ("tcp",), "tcp_connections": 4,
                          "peer_timeout": PEER_TIMEOUT, "keepalive": KEEPALIVE}
    a = await make_agent("a", **kw)
    b = await make_agent("b", **kw)
    b.alloc(1 << 20, name="dst")
    peer = await within(a.connect(b.address))
    src = a.register(bytearray(1 << 20))
    await within(a.write(src[0 : 1 << 20], peer.region("dst")[0 : 1 << 20]))
    port = int(b.address.rpartition(":")[2])
    await asyncio.sleep(PEER_TIMEOUT)  # every connection pinged once and heard b's timeout
    before = segs_in(port)
    assert len(before) == 4, before
    await asyncio.sleep(IDLE)
    after = segs_in(port)
    assert not peer.lost, "an idle rail was declared silent"
    pings = sorted(after[k] - before[k] for k in before)
    print("pings per connection over the idle window:", pings)
    # The lead: about IDLE / KEEPALIVE (40) pings; each rail about
    # IDLE / (PEER_TIMEOUT / 2) (4). Before: every connection the lead's count.
    assert pings[-1] >= 10, pings
    assert all(n * 3 <= pings[-1] for n in pings[:-1]), pings
    assert all(n >= 1 for n in pings), pings  # each rail still pings
    # Every connection still carries data.
    for _ in range(3):
        await within(a.write(src[0 : 1 << 20], peer.region("dst")[0 : 1 << 20]))
    assert not peer.lost

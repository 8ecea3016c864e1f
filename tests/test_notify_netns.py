"""Notifications across a rail failure, over real links (tests/netns.py).

A target agent in namespace a listens on two rails; an initiator in b
connects (one connection per rail). Notifications go on the peer's first live
connection (rail 1). Rail 1 then loses only the target's side: its packets to
the initiator are dropped (nft/iptables in namespace a), so the target still
receives on rail 1 and acknowledges, but the acknowledgements never arrive.
The initiator sees rail 1 go silent, declares it down after peer_timeout and
moves what it was owed (the notification, never acknowledged) to rail 2.

The target's application must see that notification exactly once: it was
already delivered from rail 1, the copy resent on rail 2 is the same message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import netns
import pytest
from netns import NsAgent, Rails

PEER_TIMEOUT = 1.0
KEEPALIVE = 0.2
SLACK = 1.0
PORT = 7100



@pytest.fixture
def net() -> Iterator[Rails]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"netns tests need network namespaces: {reason}")
    if netns.firewall() is None:
        pytest.skip("dropping one direction of a rail needs nft or iptables")
    with netns.rails(2, prefix="10.78") as r:
        yield r
    assert not netns.leftover_namespaces(), "namespaces left behind"


def _drop_outbound(net: Rails, index: int) -> None:
    """Namespace a stops sending on rail ``index`` (it still receives)."""
    r = net.rail(index)
    if netns.firewall() == "nft":
        net.exec("a", "nft", "-f", "-", input=(
            "table ip axf_out {\n"
            "  chain out { type filter hook output priority -10; policy accept;\n"
            f"    ip daddr {r.subnet} drop\n  }}\n"
            "}\n"))
    else:
        net.exec("a", "iptables", "-w", "5", "-I", "OUTPUT", "-d", r.subnet, "-j", "DROP")


async def test_notification_resent_on_another_rail_is_delivered_once(net: Rails) -> None:
    opts = {"transports": ("tcp",), "peer_timeout": PEER_TIMEOUT, "keepalive": KEEPALIVE,
            "tcp_connections": 1}
    listen = [f"{r.addr_a}:{PORT}" for r in net.rails]
    agents: list[NsAgent] = []
    try:
        target, init = await asyncio.gather(
            NsAgent.start(net, "a", "target", listen=listen, **opts),
            NsAgent.start(net, "b", "init", listen=f"{net.rail(1).addr_b}:0", **opts),
        )
        agents += [target, init]
        await init.call("connect", target.address, timeout=20)
        assert tuple(await init.call("notify", target.address, b"before")) == ("ok", "")
        assert [p for _, p in await target.call("notes", 0.5)] == [b"before"]
        _drop_outbound(net, 1)
        t0 = time.monotonic()
        kind, msg = await init.call("notify", target.address, b"once",
                                    timeout=PEER_TIMEOUT + KEEPALIVE + SLACK + 10)
        took = time.monotonic() - t0
        assert kind == "ok", (kind, msg)
        notes = await target.call("notes", PEER_TIMEOUT + KEEPALIVE + SLACK)
        print(f"\nnotification resent on rail 2 after {took:.3f} s; target got {notes}")
        assert [p for _, p in notes].count(b"once") == 1, \
            f"the target's application got {notes} (one 'once' sent)"
        rails = (await init.call("peer_stats", target.address))["rails"]
        assert not rails[0]["up"] and rails[0]["reroutes"] > 0, rails
    finally:
        finals = await netns.close_all(agents)
    netns.assert_closed_clean(agents, finals)

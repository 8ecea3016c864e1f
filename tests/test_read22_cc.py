"""The loopback shapes follow the congestion control actually in use (read22).

A lone WRITE of 1 MiB over loopback goes whole on one connection only when
the connections' congestion control does not pace (conn.c loop_cc_set,
tcp.c tcp_chunk): under bbr that shape was measured to stall (tcp13, tcp19).
Before read22 any name in AIOXFER_TCP_LOOPBACK_CC turned the shapes on, so
AIOXFER_TCP_LOOPBACK_CC=bbr sent the 1 MiB whole over bbr sockets. Each
socket's congestion control and the bytes it received are read from the
kernel (test_tcp19_loopback's helpers), not from the engine.
"""
from __future__ import annotations

from typing import Any

import pytest
from test_tcp19_loopback import MiB, lone, pair, sockets

with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as _f:
    KINDS = _f.read().split()


@pytest.mark.skipif("bbr" not in KINDS, reason="bbr is not available in this kernel")
async def test_bbr_by_name_keeps_the_halves(make_agent: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "bbr")  # read when an engine is made
    *_, port = await pair(make_agent)
    assert {s[0] for s in sockets(port).values()} == {"bbr"}  # the setting was applied
    at_target, _ = await lone(make_agent, "WRITE")
    assert at_target[-1] >= MiB // 2 and at_target[-2] >= MiB // 2, at_target  # two connections


@pytest.mark.skipif("cubic" not in KINDS, reason="cubic is not available in this kernel")
async def test_cubic_by_name_goes_whole(make_agent: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another congestion control without pacing keeps the shapes (root or
    tcp_allowed_congestion_control lets this process choose cubic)."""
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "cubic")
    *_, port = await pair(make_agent)
    if {s[0] for s in sockets(port).values()} != {"cubic"}:
        pytest.skip("this process may not choose cubic (tcp_allowed_congestion_control)")
    at_target, _ = await lone(make_agent, "WRITE")
    assert at_target[-1] >= MiB and at_target[-2] < 4096, at_target  # one connection


@pytest.mark.skipif("bbr" not in KINDS, reason="bbr is not available in this kernel")
async def test_bbr_by_name_keeps_the_read_halves(make_agent: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The lone 1 MiB READ, whole over reno since read22, keeps its halves
    under bbr too."""
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "bbr")
    _, at_init = await lone(make_agent, "READ")
    assert at_init[-1] >= MiB // 2 and at_init[-2] >= MiB // 2, at_init  # two connections

"""A flood of connections closed before the agent accepted them (issue 13:
test_hardening's test_handshakes_are_capped could flake on them).

Closed connections still in the accept queue are accepted together with the
next real ones: 8 of them take every handshake slot of a max_handshakes=8
agent until each has read its EOF, and a real connection accepted in the
same burst is refused (the cap working as meant). A test that connects right
after a flood must first know the queue is drained: test_hardening's
_accepted_up_to_here. Without it, this connect was refused (TransportError:
connection reset) on every run; the helper must make it succeed.
"""

from __future__ import annotations

import socket

from conftest import wait_until, within
from test_hardening import _accepted_up_to_here

import aioxfer


async def test_connect_after_a_queued_closed_flood(make_agent) -> None:
    target = await make_agent("target", peer_timeout=1.0,
                              limits=aioxfer.Limits(max_handshakes=8))
    target.alloc(1 << 20, name="dst")
    host, port = target.address.rsplit(":", 1)
    friend = await make_agent("friend")
    # 40: a first accept burst (32) fills the 8 slots; the friend's
    # connection then lands in the second burst beside the last closed ones.
    silent = [socket.create_connection((host, int(port))) for _ in range(40)]
    for s in silent:  # closed before the target's loop ran at all: all still queued
        s.close()
    await _accepted_up_to_here(host, int(port))
    await wait_until(lambda: len(target._serving) == 0, 5)
    peer = await within(friend.connect(target.address))
    assert peer.region("dst").nbytes == 1 << 20

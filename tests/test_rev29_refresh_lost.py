"""A refresh that fails because its tcp peer is lost says so: PeerLost.

A same-host peer's refresh turned a failed fetch into the peer's own error
once the peer was known lost; a tcp peer's gave the fetch's TransportError
("timed out") even when its peer had been declared lost meanwhile (frozen:
the keepalives saw it first), so a caller could not tell a dead peer from a
slow fetch.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import RemoteAgent, sigstop, within

import aioxfer

PEER_TIMEOUT = 1.0
KEEPALIVE = 0.2


async def test_refresh_of_a_frozen_tcp_peer_fails_peer_lost(
    make_agent: Any, remote_agent: Callable[..., Awaitable[RemoteAgent]]
) -> None:
    opts = {"transports": ("tcp",), "peer_timeout": PEER_TIMEOUT, "keepalive": KEEPALIVE}
    a = await make_agent("a", **opts)
    ra = await remote_agent(**opts)
    try:
        peer = await within(a.connect(ra.address))
        assert peer.path == "tcp"
        sigstop(ra.pid)
        # Started a while after the freeze: its fetch waits out peer_timeout
        # from here, the keepalives' bound runs from the freeze.
        await asyncio.sleep(0.6)
        assert not peer.lost
        err: BaseException | None = None
        try:
            await within(peer.refresh(), 10)
        except aioxfer.XferError as exc:
            err, lost_then = exc, peer.lost
        assert err is not None, "a refresh of a frozen peer succeeded"
        if not lost_then:
            pytest.skip("the keepalives had not declared it lost when the fetch failed")
        assert isinstance(err, aioxfer.PeerLost), repr(err)
    finally:
        ra.kill(signal.SIGKILL)
        ra.terminate()

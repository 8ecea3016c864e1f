"""Deregistering a local region while a transfer using it waits in its peer's
scheduler (over ``peer_max_requests``): the engine's deregistration is held
back until that transfer is over, and every way it can end lets the
deregistration go on: completion, cancel, a deadline, the peer killed, the
agent closed. Each ends with the region gone from the engine and nothing
leaked (the make_agent fixture's checks after close, and native_regions
before it)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import pytest
from conftest import wait_until, within

import aioxfer
from aioxfer import auth, protocol

MiB = 1 << 20


async def _queued_pair(make_agent: Any, **kw: Any) -> tuple[Any, Any, Any, Any, Any]:
    """target (a 64 MiB "dst"), init limited to one request in flight to it,
    init's Peer, and a 32 MiB write in flight that the next one queues behind."""
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_requests=1, **kw)
    dst = target.alloc(64 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    big = init.register(bytearray(32 * MiB))
    first = init.write(big[0:32 * MiB], peer.region("dst")[0:32 * MiB])
    return init, dst, peer, big, first


def _regions(agent: Any) -> int:
    return int(agent.statistics().native_regions)


async def test_deregister_then_cancel_the_queued_transfer(make_agent: Any) -> None:
    init, _dst, peer, _big, first = await _queued_pair(make_agent)
    small = init.register(bytearray(b"C" * 4096))
    queued = init.write(small[0:4096], peer.region("dst")[40 * MiB:40 * MiB + 4096])
    assert peer.statistics().queued == 1
    before = _regions(init)
    released = init.deregister(small)
    assert queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    await within(released)  # the cancel let the held-back deregistration go
    await within(first)
    await wait_until(lambda: _regions(init) == before - 1, what="small freed in the engine")
    st = peer.statistics()
    assert st.queued == 0 and st.in_flight == 0 and st.in_flight_bytes == 0
    assert init.statistics().in_flight == 0


async def test_deregister_then_a_deadline_on_the_queued_transfer(make_agent: Any) -> None:
    init, _dst, peer, _big, first = await _queued_pair(make_agent)
    small = init.register(bytearray(4096))
    queued = init.write(small[0:4096], peer.region("dst")[40 * MiB:40 * MiB + 4096])
    released = init.deregister(small)
    # A deadline shorter than the 32 MiB write it waits behind (it may
    # still win on a fast box: then the transfer finished, also fine).
    try:
        async with asyncio.timeout(0.0):
            await queued
    except TimeoutError:
        assert queued.cancelled()
    else:
        assert queued.result().nbytes == 4096
    await within(released)
    await within(first)
    assert init.statistics().in_flight == 0 and peer.statistics().queued == 0


async def test_two_regions_of_one_queued_transfer_deregistered(make_agent: Any) -> None:
    init, dst, peer, _big, first = await _queued_pair(make_agent)
    a = init.register(bytearray(b"a" * 4096))
    b = init.register(bytearray(b"b" * 4096))
    remote = peer.region("dst")
    queued = init.write([a[0:4096], b[0:4096]],
                        [remote[40 * MiB:40 * MiB + 4096], remote[50 * MiB:50 * MiB + 4096]])
    released_a = init.deregister(a)
    released_b = init.deregister(b)
    again_a = init.deregister(a)  # twice: no error, a wait of the same release
    await within(first)
    assert (await within(queued)).nbytes == 8192  # not AccessDenied on either region
    await within(asyncio.gather(released_a, released_b, again_a))
    assert bytes(dst.memoryview[40 * MiB:40 * MiB + 4096]) == b"a" * 4096
    assert bytes(dst.memoryview[50 * MiB:50 * MiB + 4096]) == b"b" * 4096


async def test_one_region_held_by_two_queued_transfers(make_agent: Any) -> None:
    init, dst, peer, _big, first = await _queued_pair(make_agent)
    small = init.register(bytearray(b"T" * 8192))
    remote = peer.region("dst")
    cancelled = init.write(small[0:4096], remote[40 * MiB:40 * MiB + 4096])
    kept = init.write(small[4096:8192], remote[44 * MiB:44 * MiB + 4096])
    released = init.deregister(small)
    assert cancelled.cancel()
    await asyncio.sleep(0)
    assert not released.done(), "released while a transfer using the region still waits"
    await within(first)
    assert (await within(kept)).nbytes == 4096
    await within(released)
    assert bytes(dst.memoryview[44 * MiB:44 * MiB + 4096]) == b"T" * 4096


async def test_reregister_the_same_buffer_while_the_old_deregistration_waits(
    make_agent: Any,
) -> None:
    init, dst, peer, _big, first = await _queued_pair(make_agent)
    buf = bytearray(b"R" * 4096)
    old = init.register(buf, name="s")
    remote = peer.region("dst")
    queued_old = init.write(old[0:4096], remote[40 * MiB:40 * MiB + 4096])
    released = init.deregister(old)
    new = init.register(buf, name="s")  # the name is free again, the memory too
    assert new.rid != old.rid and init.region("s") is new
    buf[:] = b"N" * 4096
    queued_new = init.write(new[0:4096], remote[48 * MiB:48 * MiB + 4096])
    await within(first)
    await within(asyncio.gather(queued_old, queued_new))
    await within(released)
    # One buffer: both writes read it after the change (the old region's
    # registration lived until its transfer was over).
    assert bytes(dst.memoryview[40 * MiB:40 * MiB + 4096]) == b"N" * 4096
    assert bytes(dst.memoryview[48 * MiB:48 * MiB + 4096]) == b"N" * 4096
    again = await within(init.write(new[0:4096], remote[52 * MiB:52 * MiB + 4096]))
    assert again.nbytes == 4096
    await within(init.deregister(new))


async def test_agent_closed_while_the_deregistered_transfer_waits(make_agent: Any) -> None:
    init, _dst, peer, _big, first = await _queued_pair(make_agent)
    small = init.register(bytearray(4096))
    queued = init.write(small[0:4096], peer.region("dst")[40 * MiB:40 * MiB + 4096])
    released = init.deregister(small)
    # Well under close_timeout: the close fails the queued transfer, never waits for it.
    await within(init.aclose(), 5)
    with pytest.raises(aioxfer.ClosedResourceError):
        await queued
    await within(released, 1)
    await asyncio.gather(first, return_exceptions=True)
    s = init.statistics()
    assert (s.in_flight, s.native_ops, s.native_regions, s.pinned_regions) == (0, 0, 0, 0)


async def test_peer_killed_while_the_deregistered_transfer_waits(
    make_agent: Any, remote_agent: Any
) -> None:
    ra = await remote_agent(size=64 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_requests=1, peer_timeout=2.0)
    peer = await within(init.connect(ra.address))
    big = init.register(bytearray(64 * MiB))
    small = init.register(bytearray(4096))
    pool = peer.region("pool")
    bulk = [init.write(big[0:64 * MiB], pool[0:64 * MiB]) for _ in range(4)]
    queued = init.write(small[0:4096], pool[0:4096])
    assert peer.statistics().queued == 4
    before = _regions(init)
    released = init.deregister(small)
    os.kill(ra.pid, signal.SIGKILL)
    ra.closed = True
    results = await within(asyncio.gather(*bulk, queued, return_exceptions=True), 20)
    assert all(isinstance(r, aioxfer.TransferResult | aioxfer.PeerLost) for r in results), results
    assert isinstance(results[-1], aioxfer.PeerLost), results[-1]
    await within(released, 10)  # the dead peer holds nothing: no wait for it
    await wait_until(lambda: _regions(init) == before - 1, what="small freed in the engine")
    st = peer.statistics()
    assert st.queued == 0 and st.in_flight == 0
    assert init.statistics().in_flight == 0


async def _silent_connection(address: str) -> socket.socket:
    """A data connection to ``address`` that acknowledges nothing (a
    revocation then waits ``revoke_timeout`` for it)."""
    loop = asyncio.get_running_loop()
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await within(loop.sock_connect(sock, (host, int(port))))
    await within(protocol.client_handshake(loop, sock, name="silent", incarnation=9,
                                           purpose="data",
                                           token=auth.hmac_key(auth.default_token())))
    return sock


async def test_close_fails_a_queued_transfer_as_closed(make_agent: Any) -> None:
    """aclose() while a transfer waits in the scheduler: it fails with
    ClosedResourceError, never posted during the close's wait for peers to
    release our memory (by then deregistered: it failed AccessDenied, as if
    the peer had refused it)."""
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), peer_max_requests=1,
                            limits=aioxfer.Limits(revoke_timeout=1.0))
    target.alloc(64 * MiB, name="dst")
    peer = await within(init.connect(target.address))
    big = init.register(bytearray(32 * MiB))
    small = init.register(bytearray(4096))
    # The peer's connections after its first one join after connect returned
    # (Connector._join_rest): counted once they did.
    await wait_until(lambda: not init._connector.joins_pending and not any(
        t.get_name().startswith("aioxfer-join") for t in init._probes), what="the joins")
    conns = init.statistics().native_conns
    with await _silent_connection(init.address):
        await wait_until(lambda: init.statistics().native_conns == conns + 1, what="connected")
        # Posted only now, right before the close: a 32 MiB write in flight
        # and one queued behind it (posted before the joins' wait and the
        # silent handshake, the 32 MiB write, ~13 ms here, and the queued one
        # after it completed before the close in 4 of 5 runs once connect got
        # faster, 2026-12-07: the test then checked nothing it meant to).
        first = init.write(big[0:32 * MiB], peer.region("dst")[0:32 * MiB])
        queued = init.write(small[0:4096], peer.region("dst")[40 * MiB:40 * MiB + 4096])
        assert peer.statistics().queued == 1
        # The close waits up to revoke_timeout for the silent connection: the
        # 32 MiB write ahead of the queued one completes meanwhile.
        await within(init.aclose(), 10)
    results = await within(asyncio.gather(first, queued, return_exceptions=True))
    assert isinstance(results[1], aioxfer.ClosedResourceError), results

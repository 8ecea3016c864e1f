"""A deregistration held back for transfers that wait in a peer's scheduler
(test_dereg_queued) keeps the region in the engine for them, but not for
peers: from the deregister() call on, a peer that still holds the region's
key gets AccessDenied for its READ and WRITE (the engine's revocation: the
tcp target's check refuses it as for a deregistered region, and every
connected peer is told to forget it), while the queued transfer, our own,
still completes once its turn comes. Peers: an agent in this process, one in
another process, and a raw connection that ignores the revocation and keeps
using the key."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
from typing import Any

import pytest
from conftest import RemoteError, sigstop, wait_until, within

import aioxfer
from aioxfer import _cyx, auth, protocol

KiB = 1 << 10
HDR = struct.Struct("<IHHiIQQQQQQ")  # native/src/internal.h wire_hdr
MAGIC = 0x31465841
F_WRITE, F_WRITE_ACK, F_READ_REQ, F_READ_RESP, F_PING, F_REVOKE = 1, 2, 3, 4, 7, 8


def _frame(type_: int, op: int, rid: int, key: int, off: int, length: int) -> bytes:
    return HDR.pack(MAGIC, type_, 1, 0, 0, op, 0, rid, key, off, length)


async def _raw_peer(address: str) -> socket.socket:
    """A data connection that answers nothing (revocations included)."""
    loop = asyncio.get_running_loop()
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await within(loop.sock_connect(sock, (host, int(port))))
    await within(protocol.client_handshake(loop, sock, name="raw", incarnation=11,
                                           purpose="data",
                                           token=auth.hmac_key(auth.default_token())))
    return sock


async def _reply(sock: socket.socket, want: int) -> tuple[Any, ...]:
    """The next frame of type want (pings and revocations, ignored, skipped)."""
    loop = asyncio.get_running_loop()
    while True:
        hdr = HDR.unpack(await within(protocol.recv_exact(loop, sock, HDR.size)))
        if hdr[1] not in (F_PING, F_REVOKE):
            assert hdr[1] == want, hdr
            return hdr


async def _raw_write(sock: socket.socket, op: int, rid: int, key: int, data: bytes) -> int:
    await asyncio.get_running_loop().sock_sendall(
        sock, _frame(F_WRITE, op, rid, key, 0, len(data)) + data)
    return int((await _reply(sock, F_WRITE_ACK))[3])


async def _raw_read(sock: socket.socket, op: int, rid: int, key: int, n: int) -> int:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, _frame(F_READ_REQ, op, rid, key, 0, n))
    hdr = await _reply(sock, F_READ_RESP)
    if hdr[3] == _cyx.OK:
        await within(protocol.recv_exact(loop, sock, hdr[10]))
    return int(hdr[3])


def _settled(agent: Any, rid: int) -> bool:
    return agent._engine.region_holders(rid) is None


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_peers_lose_a_held_back_region_at_once(
    make_agent: Any, remote_agent: Any, transport: str
) -> None:
    # The queue: the agent's transfers to a target it may have one request in
    # flight to, and a target that does not answer (stopped) until we let it.
    target = await remote_agent(size=64 * KiB, transports=("tcp",))
    owner = await make_agent("owner", transports=(transport, "tcp"), peer_max_requests=1,
                             peer_timeout=30.0, limits=aioxfer.Limits(revoke_timeout=2.0))
    rbuf = bytearray(8 * KiB)
    region = owner.register(rbuf, name="r")
    other = owner.register(bytearray(8 * KiB), name="other")
    to_target = await within(owner.connect(target.address))

    # Peers holding the region's key: one here, one in another process.
    b = await make_agent("b", transports=(transport, "tcp"))
    b_peer = await within(b.connect(owner.address))
    assert b_peer.path == transport
    b_buf = b.register(bytearray(b"B" * 8 * KiB))
    b_r = b_peer.region("r")
    assert (await within(b.write(b_buf[0:4 * KiB], b_r[0:4 * KiB]))).nbytes == 4 * KiB
    far = await remote_agent(size=64 * KiB, transports=(transport, "tcp"))
    assert await far.call("connect", owner.address) == transport
    assert await far.call("write", owner.address, "user", 0, "r", 4 * KiB, 4 * KiB, None) \
        == 4 * KiB
    raw = await _raw_peer(owner.address) if transport == "tcp" else None
    if raw is not None:
        assert await _raw_write(raw, 1, region.rid, region.key, b"GOOD") == _cyx.OK
    rbuf[:] = b"R" * len(rbuf)

    sigstop(target.pid)
    try:
        first = owner.write(other[0:4 * KiB], to_target.region("pool")[0:4 * KiB])
        queued = owner.write(region[0:4 * KiB], to_target.region("pool")[8 * KiB:12 * KiB])
        await asyncio.sleep(0)
        assert to_target.statistics().queued == 1
        released = owner.deregister(region)

        if transport == "shm":
            # Same host: the peers copy without asking us; they stop once
            # they have taken the revocation in (acknowledged: nothing of
            # theirs touches the region from then on).
            await wait_until(lambda: _settled(owner, region.rid), what="peers acknowledged")
        with pytest.raises(aioxfer.AccessDenied):
            await within(b.write(b_buf[0:4 * KiB], b_r[0:4 * KiB]))
        with pytest.raises(aioxfer.AccessDenied):
            await within(b.read(b_buf[0:4 * KiB], b_r[4 * KiB:8 * KiB]))
        with pytest.raises(RemoteError, match="AccessDenied"):
            await far.call("write", owner.address, "user", 0, "r", 0, 4 * KiB, None)
        if raw is not None:
            # Keeps the key and ignores the revocation: the owner's check
            # refuses it, as for a region that is not there.
            assert await _raw_write(raw, 2, region.rid, region.key, b"EVIL") == _cyx.E_ACCESS
            assert await _raw_read(raw, 3, region.rid, region.key, 4) == _cyx.E_ACCESS
            assert await _raw_write(raw, 4, region.rid + 1000, region.key, b"EVIL") \
                == _cyx.E_ACCESS
            assert await _raw_write(raw, 5, other.rid, other.key, b"SAFE") == _cyx.OK
        # All of that before the queued transfer ended: it still waits.
        assert not queued.done() and to_target.statistics().queued == 1
        assert not released.done()
        assert bytes(rbuf) == b"R" * len(rbuf), "a peer's access reached the region"
        # The owner serves its other regions to the same peers.
        assert (await within(b.write(b_buf[0:4 * KiB], b_peer.region("other")[0:4 * KiB]))
                ).nbytes == 4 * KiB
    finally:
        os.kill(target.pid, signal.SIGCONT)
    await within(first)
    assert (await within(queued)).nbytes == 4 * KiB  # ours: the revocation spared it
    assert await target.call("get", "pool", 8 * KiB, 4 * KiB) == b"R" * 4 * KiB
    if raw is not None:
        raw.close()  # the revocation it never acknowledged: settled by its close
    await within(released, 10)
    # (The engine counts a region out just after pushing its freed record.)
    await wait_until(lambda: owner.statistics().native_regions == 1, what="only 'other' left")


async def test_deregister_releases_the_region_when_the_drain_raises(
    make_agent: Any, remote_agent: Any
) -> None:
    """deregister() posts what is batched first, and that post drains the
    ring: a drain callback's error, re-raised, used to leave the region out
    of our table but registered in the engine for good (peers reached it,
    `released` never completed). Now the error goes to the loop's exception
    handler (tests/test_drain_errors.py), and the region leaves the engine
    once the transfer using it is over."""
    # A target that does not answer (stopped) while the drain runs: the
    # transfer's completion is not in the batch whose callback fails.
    target = await remote_agent(size=64 * KiB, transports=("tcp",))
    owner = await make_agent("owner", transports=("tcp",), peer_timeout=30.0)
    peer = await within(owner.connect(target.address))
    spare = owner.register(bytearray(4 * KiB))
    region = owner.register(bytearray(b"Q" * 4 * KiB))
    before = owner.statistics().native_regions
    # A record for the ring (spare freed at once: no peer holds the owner's
    # memory) whose callback fails, and a transfer batched for the next
    # flush, so that deregister() posts, then drains.
    sub = owner._sub
    on_event = sub._on_event

    def failing(*args: Any) -> None:
        sub._on_event = on_event
        on_event(*args)
        raise RuntimeError("a drain callback failed")

    sigstop(target.pid)
    try:
        sub._on_event = failing
        spare_released = owner.deregister(spare)
        t = owner.write(region[0:4 * KiB], peer.region("pool")[0:4 * KiB])
        # The callback's error goes to the loop's exception handler (as
        # asyncio reports a callback's), not to deregister()'s caller.
        seen: list[Any] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx.get("exception")))
        try:
            owner.deregister(region)
        finally:
            loop.set_exception_handler(None)
        assert sub._on_event is on_event, "the failing callback did not run"
        assert [type(e) for e in seen] == [RuntimeError], seen
        released = owner.deregister(region)  # the same awaitable
        with pytest.raises(ValueError, match="unknown region"):
            owner._engine.deregister(region.rid)  # it left the engine's table
    finally:
        os.kill(target.pid, signal.SIGCONT)
    assert (await within(t)).nbytes == 4 * KiB
    await within(asyncio.gather(released, spare_released))
    await wait_until(lambda: owner.statistics().native_regions == before - 2,
                     what="both regions freed in the engine")
    assert await target.call("get", "pool", 0, 4 * KiB) == b"Q" * 4 * KiB

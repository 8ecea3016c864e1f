"""Connect's cheaper mechanics (issue 13, conn25) keep their guarantees.

- Agent.connect: callers share one attempt (a task, shielded): a
  cancelled caller never cancels the attempt the others
  wait on, and an agent closed meanwhile tells its callers so.
- The server sends a tcp client's Accept, metadata and META_GO in one send:
  META_GO still goes only once nothing the metadata names was deregistered
  while a send waited.
"""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest
from conftest import wait_until, within

import aioxfer
from aioxfer import ProtocolError, auth, metadata, protocol

MiB = 1 << 20


async def test_cancelled_caller_leaves_the_shared_attempt(make_agent) -> None:
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",))
    first = asyncio.ensure_future(init.connect(target.address))
    second = asyncio.ensure_future(init.connect(target.address))
    await asyncio.sleep(0)  # both wait on the one attempt now
    assert len(init._connecting) == 1
    first.cancel()
    peer = await within(second)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert peer.region("dst").nbytes == MiB
    assert await within(init.connect(target.address)) is peer
    assert not init._connecting


async def test_failed_attempt_reaches_every_caller(make_agent) -> None:
    target = await make_agent("target", transports=("tcp",), token="one")
    init = await make_agent("init", transports=("tcp",), token="two")
    calls = [asyncio.ensure_future(init.connect(target.address)) for _ in range(3)]
    done = await within(asyncio.gather(*calls, return_exceptions=True))
    assert all(isinstance(r, aioxfer.AccessDenied) for r in done), done
    assert not init._connecting


async def test_closed_while_connecting(make_agent) -> None:
    """A peer that accepts but never speaks: the attempt waits in its
    handshake until the agent closes; its callers hear it was closed."""
    init = await make_agent("init", transports=("tcp",))
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        calls = [asyncio.ensure_future(init.connect(address)) for _ in range(2)]
        await wait_until(lambda: bool(init._connecting), 5, what="the attempt")
        await asyncio.sleep(0.05)
        await within(init.aclose())
        for c in calls:
            with pytest.raises(aioxfer.ClosedResourceError):
                await within(c)


async def test_tcp_metadata_that_waits_is_checked_before_go(make_agent) -> None:
    """Over tcp (no memfds) the Accept, metadata and META_GO go in one send
    only when all of it fits; a send that waits (a client that does not
    read) leaves META_GO to after the check, which a deregistration fails."""
    target = await make_agent("target", transports=("tcp",))
    victim = target.register(bytearray(MiB), name="victim")
    real = target._localmeta.meta_with
    # Far more than a loopback socket buffers: the server must wait.
    pad = [
        metadata.RegionMeta(name=f"pad-{i:06d}-" + "x" * 200, rid=(1 << 40) + i, key=i,
                            nbytes=4096, access=1, addr=0)
        for i in range(40_000)
    ]

    def padded(memfd):
        m = real(memfd)
        return msgspec.structs.replace(m, regions=m.regions + pad)

    target._localmeta.meta_with = padded
    loop = asyncio.get_running_loop()
    host, port = target.address.rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, int(port)))
        accept = await within(protocol.client_handshake(
            loop, sock, name="raw", incarnation=1, purpose="data",
            token=auth.hmac_key(auth.default_token()), meta=True,
        ))
        assert accept.meta
        await within(target.deregister(victim))
        with pytest.raises(ProtocolError):
            meta = await within(protocol.recv_frame(loop, sock, protocol.MAX_META_FRAME))
            assert isinstance(meta, metadata.AgentMeta)
            assert any(r.name == "victim" for r in meta.regions)
            await within(protocol.recv_go(loop, sock))
    finally:
        sock.close()


async def test_tcp_small_metadata_connects(make_agent) -> None:
    """The usual case (all of it in one send) still hands the client its
    metadata and META_GO, and the connection to the engine."""
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",))
    src = init.alloc(MiB, name="src")
    src.numpy()[:4096] = 7
    peer = await within(init.connect(target.address))
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x07" * 4096

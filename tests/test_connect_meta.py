"""The metadata on the first data connection (issue 13: fewer round trips).

A "data" Hello may ask for the server's metadata (``Hello.meta``); the server
sends it (on its unix socket with the memfds) and ``META_GO`` before its engine
takes the connection, so no separate "meta" connection is made. A region the
metadata names must never be deregistered between the snapshot and the engine
holding the connection without the client learning it: then the server closes
the connection instead of sending ``META_GO``.
"""

from __future__ import annotations

import asyncio
import os
import socket

import msgspec
import pytest
from conftest import SAME_HOST, wait_until, within

import aioxfer
from aioxfer import AccessDenied, ProtocolError, auth, local, metadata, protocol

MiB = 1 << 20


def _count_snapshots(agent) -> list[int]:
    """Counts how often agent builds its metadata (once per meta served)."""
    calls: list[int] = []
    real = agent._localmeta.meta_with

    def counted(memfd):
        calls.append(1)
        return real(memfd)

    agent._localmeta.meta_with = counted
    return calls


@pytest.mark.parametrize("transport", ["tcp", SAME_HOST])
async def test_one_connection_carries_the_metadata(make_agent, transport) -> None:
    kw = {"transports": ("tcp",)} if transport == "tcp" else {}
    target = await make_agent("target", **kw)
    dst = target.alloc(MiB, name="dst")
    served = _count_snapshots(target)
    init = await make_agent("init", **kw)
    src = init.alloc(MiB, name="src")
    src.numpy()[:4096] = 7
    peer = await within(init.connect(target.address))
    assert peer.path == transport
    assert len(served) == 1  # no second connection fetched it again
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x07" * 4096


async def test_same_host_agent_taking_tcp_dials_a_data_connection(make_agent) -> None:
    """An agent with a unix socket asks the peer first only who it is
    (Hello.accept_only); a peer without a same-host path gets a data
    connection of its own, its metadata on it (one snapshot in all)."""
    target = await make_agent("target", transports=("tcp",))
    dst = target.alloc(MiB, name="dst")
    served = _count_snapshots(target)
    init = await make_agent("init")
    assert init._local_sock is not None
    src = init.alloc(MiB, name="src")
    src.numpy()[:4096] = 5
    peer = await within(init.connect(target.address))
    assert peer.path == "tcp"
    assert len(served) == 1
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x05" * 4096


async def test_accept_only_gets_the_accept_and_the_end(make_agent) -> None:
    """A "meta" Hello with accept_only: the Accept, then the server closes
    (no metadata built or sent, no connection for its engine)."""
    target = await make_agent("target")
    served = _count_snapshots(target)
    loop = asyncio.get_running_loop()
    host, port = target.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setblocking(False)
    try:
        accept = await within(protocol.client_handshake(
            loop, sock, name="raw", incarnation=1, purpose="meta",
            token=auth.hmac_key(auth.default_token()), accept_only=True,
        ))
        assert (accept.name, accept.local) == (target.name, target._accept_msg.local)
        assert await within(loop.sock_recv(sock, 1)) == b""
    finally:
        sock.close()
    assert served == []


async def test_deregistered_while_metadata_waits_closes(make_agent) -> None:
    """A region deregistered while the server waited to send its metadata (a
    client that does not read) ends the connection without META_GO."""
    target = await make_agent("target")
    target.alloc(MiB, name="pool")  # a memfd to pass
    # Registered, not alloc'd: reached by cross-memory attach, where a stale
    # handle would aim at memory given back to the allocator.
    victim = target.register(bytearray(MiB), name="victim")
    real = target._localmeta.meta_with
    # Far more than a unix socket buffers (~200 KiB): the server must wait.
    pad = [
        metadata.RegionMeta(name=f"pad-{i:06d}-" + "x" * 200, rid=(1 << 40) + i, key=i,
                            nbytes=4096, access=1, addr=0)
        for i in range(12_000)
    ]

    def padded(memfd):
        m = real(memfd)
        return msgspec.structs.replace(m, regions=m.regions + pad)

    target._localmeta.meta_with = padded
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, local.local_address(target._accept_msg.local))
        accept = await within(protocol.client_handshake(
            loop, sock, name="raw", incarnation=1, purpose="data",
            token=auth.hmac_key(auth.default_token()), meta=True,
        ))
        assert accept.meta
        # The server took its snapshot in the step that sent Accept, and now
        # waits for us to read.
        await within(target.deregister(victim))
        fds: list[int] = []
        with pytest.raises(ProtocolError):
            meta = await within(protocol.recv_frame(loop, sock, protocol.MAX_META_FRAME))
            assert isinstance(meta, metadata.AgentMeta)
            assert any(r.name == "victim" for r in meta.regions)
            fds = await within(local.recv_fds(loop, sock, 1))
            await within(protocol.recv_go(loop, sock))
        for fd in fds:
            os.close(fd)
    finally:
        sock.close()


async def test_metadata_that_waits_still_connects(make_agent) -> None:
    """Metadata larger than the socket buffers, its memfds after it: the
    server waits, finds nothing changed, and the peer connects."""
    target = await make_agent("target")
    dst = target.alloc(MiB, name="dst")
    buf = bytearray(8_000 * 64)
    mv = memoryview(buf)
    for i in range(8_000):
        target.register(mv[i * 64:(i + 1) * 64], name=f"r{i:05d}-" + "y" * 100)
    init = await make_agent("init")
    src = init.alloc(MiB, name="src")
    src.numpy()[:4096] = 9
    peer = await within(init.connect(target.address), 30)
    assert len(peer.regions) == 8_001
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x09" * 4096


async def test_first_rail_connections_come_after_connect(make_agent) -> None:
    """tcp: the first rail's other connections, dialled beside the first one,
    all come up once connect returned (they join in the background)."""
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    peer = await within(init.connect(target.address))
    await wait_until(lambda: [r.connections for r in peer.statistics().rails] == [4], 5,
                     what="the joins")


async def test_failed_connect_leaves_no_connection_open(make_agent) -> None:
    """No connection is left open when connecting fails."""
    target = await make_agent("target", transports=("tcp",), token="one")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, token="two")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(AccessDenied):
            await within(init.connect(target.address))
    for _ in range(200):  # the target (in this process too) closes its side
        if not target._serving:
            break
        await asyncio.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == before


async def test_failure_after_the_first_connection_closes_the_others(make_agent) -> None:
    """The first rail's other connections, dialled beside the first one, are
    closed when connecting fails after the first one's metadata came (here:
    it names another protocol version)."""
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    await connects_after_the_metadata_fail_leaving_no_fd(target, init)


async def connects_after_the_metadata_fail_leaving_no_fd(target: aioxfer.Agent,
                                                         init: aioxfer.Agent) -> None:
    """Three connects of init to target fail once target's metadata came (it
    names another protocol version), and leave no file descriptor open on
    either side (both agents live in this process)."""
    real = target._localmeta.meta_with
    target._localmeta.meta_with = lambda memfd: msgspec.structs.replace(real(memfd), version=999)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(ProtocolError):
            await within(init.connect(target.address))
    for _ in range(200):  # the target (in this process too) closes its side
        if not target._serving and len(os.listdir("/proc/self/fd")) == before:
            break
        await asyncio.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == before

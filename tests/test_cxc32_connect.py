"""Connect's first connection is dialled, and its Hello sent, by
Agent.connect itself (cxc32, Connector.predial), before the attempt's task
first runs: the peer wakes only once a Hello is in (TCP_DEFER_ACCEPT), so
nothing of ours was to come before it.

- The Hello is on the wire when connect first yields (the tcp probe's, for
  an agent with a unix socket where nobody listens on the address's name).
- A connection predial opened is closed when the attempt never runs (the
  task cancelled before its first step), and the agent connects afterwards.
- On a same-host peer's address-named unix socket the Hello goes only to a
  listener the kernel says runs as our uid (as _open_direct checks before
  its handshake): an impostor of another uid gets nothing.
- The callers of one attempt are resumed by the attempt itself; the peer is
  usable at once, and a later connect returns it.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from conftest import within

import aioxfer
from aioxfer import connector, local, protocol
from aioxfer.metadata import Hello

MiB = 1 << 20


def _listener() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


async def test_hello_is_sent_before_connect_first_yields(make_agent) -> None:
    init = await make_agent("init", transports=("tcp",))
    await init.start()
    lsock, address = _listener()
    loop = asyncio.get_running_loop()
    with lsock:
        call = asyncio.ensure_future(init.connect(address))
        await asyncio.sleep(0)  # the caller ran up to its first wait, the attempt not yet
        conn, _ = lsock.accept()  # (non-blocking: raises if nothing connected)
        with conn:
            conn.setblocking(False)
            hello = await within(protocol.recv_frame(loop, conn, protocol.MAX_HANDSHAKE_FRAME))
            assert isinstance(hello, Hello)
            assert hello.name == init.name and hello.purpose == "data" and hello.meta
            assert hello.incarnation == init.incarnation
    # The listener never answers and is gone: the attempt fails as a dial would.
    with pytest.raises(aioxfer.XferError):
        await within(call)
    assert not init._connecting


@pytest.mark.parametrize("cma", [True, False])
async def test_probe_hello_is_sent_before_connect_first_yields(
    make_agent, monkeypatch, cma: bool
) -> None:
    """An agent with a unix socket whose peer has none at the address's
    name (or that may not reach a same-host peer's memory: no direct try):
    predial sends the tcp probe's Hello at once instead."""
    init = await make_agent("init")
    await init.start()
    if not init._connector._config.local or (cma and not connector.cma_allowed()):
        pytest.skip("no same-host path here: no probe")
    if not cma:
        monkeypatch.setattr(connector, "cma_allowed", lambda: False)
    lsock, address = _listener()
    loop = asyncio.get_running_loop()
    with lsock:
        call = asyncio.ensure_future(init.connect(address))
        await asyncio.sleep(0)
        conn, _ = lsock.accept()
        with conn:
            conn.setblocking(False)
            hello = await within(protocol.recv_frame(loop, conn, protocol.MAX_HANDSHAKE_FRAME))
            assert isinstance(hello, Hello)
            assert hello.purpose == "meta" and hello.accept_only and not hello.meta
            assert hello.joins == init._connector._probe_joins()
    with pytest.raises(aioxfer.XferError):
        await within(call)
    assert not init._connecting


async def test_predialed_connection_closed_when_attempt_never_runs(make_agent) -> None:
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",))
    await init.start()
    call = asyncio.ensure_future(init.connect(target.address))
    await asyncio.sleep(0)
    task = init._connecting[target.address]
    first = init._attempts[task].first
    assert first is not None and first.sock.fileno() >= 0
    task.cancel()  # before its first step: the coroutine never runs
    with pytest.raises(asyncio.CancelledError):
        await within(call)
    assert first.sock.fileno() == -1
    assert not init._connecting and not init._attempts
    peer = await within(init.connect(target.address))
    assert peer.region("dst").nbytes == MiB


async def test_direct_hello_only_to_our_uid(make_agent, monkeypatch) -> None:
    init = await make_agent("init")
    await init.start()
    if not connector.cma_allowed() or not init._connector._config.local:
        pytest.skip("no same-host path here")
    _, address = _listener()  # (a port nobody serves: only its name is used)
    name = local.local_name_for(init._token, address, os.geteuid())
    squatter = local.listen_abstract(name)
    with squatter:
        real = connector.peer_cred

        def other_uid(sock: socket.socket) -> local.PeerCred:
            cred = real(sock)
            return local.PeerCred(cred.pid, cred.uid + 1, cred.gid)

        monkeypatch.setattr(connector, "peer_cred", other_uid)
        first = init._connector.predial(address)
        assert first is not None and first.sent is None
        conn, _ = squatter.accept()
        with conn:
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1)  # nothing was sent to it
        first.close()
        monkeypatch.setattr(connector, "peer_cred", real)
        first = init._connector.predial(address)  # our uid: the Hello goes at once
        assert first is not None and first.sent is not None
        conn, _ = squatter.accept()
        with conn:
            conn.setblocking(False)
            assert conn.recv(4096)
        first.close()


async def test_callers_share_the_attempt_and_its_peer(make_agent, transport) -> None:
    target = await make_agent("target", **({"transports": ("tcp",)} if transport == "tcp" else {}))
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", **({"transports": ("tcp",)} if transport == "tcp" else {}))
    calls = [asyncio.ensure_future(init.connect(target.address)) for _ in range(3)]
    peers = await within(asyncio.gather(*calls))
    assert peers[0] is peers[1] is peers[2]
    assert not init._connecting and not init._attempts
    src = init.alloc(MiB, name="src")
    src.numpy()[:] = 7
    await within(init.write(src[0:4096], peers[0].region("dst")[0:4096]))
    assert (dst.numpy()[:4096] == 7).all()
    assert await within(init.connect(target.address)) is peers[0]

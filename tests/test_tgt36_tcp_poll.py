"""A same-host tcp connection accepted before its Hello came (a listener
without TCP_DEFER_ACCEPT: the accept is ready at the connect) has its Hello
polled for in the accepting step, as the unix socket's (serving.Server.
_join_polled): the early proof is still taken, joins still join, every
connect's write lands; a client that never speaks costs one bounded poll
and is greeted and served as before; a client that closes is closed.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from conftest import within

from aioxfer import serving

TOKEN = "tgt36-tcp-poll"


def _no_defer(agent: Any) -> None:
    for lsock in agent._lsocks:
        lsock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 0)


class _Spy:
    def __init__(self, monkeypatch: Any) -> None:
        self.polled: list[Any] = []
        real = serving.Server._join_polled

        def spy(server: Any, loop: Any, sock: Any, addr: Any) -> Any:
            got = real(server, loop, sock, addr)
            self.polled.append(got)
            return got

        monkeypatch.setattr(serving.Server, "_join_polled", spy)


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="no TCP_DEFER_ACCEPT")
async def test_connects_without_a_deferred_accept(make_agent: Any, monkeypatch: Any) -> None:
    spy = _Spy(monkeypatch)
    b = await make_agent("b", transports=("tcp",), token=TOKEN)
    _no_defer(b)
    rb = b.alloc(1 << 20, name="buf")
    for i in range(4):
        a = await make_agent(f"a{i}", transports=("tcp",), token=TOKEN)
        ra = a.alloc(1 << 20, name="buf")
        ra.numpy()[:4096] = i + 1
        taken = b._server.early.taken
        peer = await within(a.connect(b.address))
        await within(a.write(ra[0:4096], peer.region("buf")[0:4096]))
        assert (rb.numpy()[:4096] == i + 1).all()
        assert b._server.early.taken == taken + 1  # (no Proof round)
        await within(a.aclose())
    # (an in-process client sends its Hello before the accept runs: any poll found it)
    assert all(got is not None for got in spy.polled), spy.polled


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="no TCP_DEFER_ACCEPT")
async def test_a_silent_client_is_polled_once_then_served(make_agent: Any,
                                                          monkeypatch: Any) -> None:
    spy = _Spy(monkeypatch)
    b = await make_agent("b", transports=("tcp",), token=TOKEN)
    _no_defer(b)
    b.alloc(1 << 20, name="buf")
    host, port = b.address.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    silent = socket.create_connection((host, int(port)))
    closer = socket.create_connection((host, int(port)))
    try:
        closer.close()
        for _ in range(200):
            if spy.polled:
                break
            await asyncio.sleep(0.005)
        assert None in spy.polled  # (the silent one: nothing came in the poll)
        # The silent one was greeted: our Challenge waits for it.
        silent.setblocking(False)
        got = await within(loop.sock_recv(silent, 4096))
        assert got
        # Others still connect and write.
        a = await make_agent("a", transports=("tcp",), token=TOKEN)
        ra = a.alloc(1 << 20, name="buf")
        peer = await within(a.connect(b.address))
        await within(a.write(ra[0:4096], peer.region("buf")[0:4096]))
    finally:
        silent.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="no TCP_DEFER_ACCEPT")
async def test_a_hello_after_the_accept_is_answered_early(make_agent: Any,
                                                          monkeypatch: Any) -> None:
    """A client (another thread) that connects, then sends its early Hello
    a little later: answered in the accepting step, its proof taken, when
    the Hello came while polled for (or before the accept: no poll)."""
    import time

    from aioxfer import metadata, protocol

    spy = _Spy(monkeypatch)
    b = await make_agent("b", transports=("tcp",), token=TOKEN)
    _no_defer(b)
    b.alloc(1 << 20, name="buf")
    host, port = b.address.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    for _ in range(3):
        taken = b._server.early.taken
        got: list[bytes] = []

        def client(got: list[bytes] = got) -> None:
            with socket.create_connection((host, int(port))) as c:
                time.sleep(0.0002)
                _, frame = protocol._hello(name="tgt36-raw", incarnation=1, purpose="data",
                                           token=b._token, to=c)
                c.sendall(frame)
                c.settimeout(5)
                got.append(c.recv(65536))

        await within(loop.run_in_executor(None, client))
        assert got and got[0]
        n = int.from_bytes(got[0][:4], "big")
        frames = protocol.decode_body(memoryview(got[0])[4 : 4 + n])
        assert isinstance(frames, metadata.Challenge)
        assert b._server.early.taken == taken + 1
    assert all(p is not None for p in spy.polled), spy.polled

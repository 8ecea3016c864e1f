"""Dialer.dial (issue 13, where a connect's dial may skip its wait for a
writable event): the socket it returns is connected, non-blocking and
TCP_NODELAY, and a refused connect raises its error.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from conftest import within

from aioxfer.dialing import Dialer


def _dialer() -> Dialer:
    return Dialer("d", incarnation=1, token=None, peer_timeout=5.0, max_meta_bytes=1 << 20)


async def test_dial_connected_and_refused() -> None:
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(4)
        host, port = lsock.getsockname()
        sock = await within(_dialer().dial(host, port))
        with sock:
            assert sock.getpeername() == (host, port)
            assert not sock.getblocking()
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            conn, _ = lsock.accept()
            conn.sendall(b"x")
            assert await asyncio.get_running_loop().sock_recv(sock, 1) == b"x"
            conn.close()
    # Nobody listens there now: the connect's error is the dial's.
    with pytest.raises(ConnectionRefusedError):
        await within(_dialer().dial(host, port))

"""serving._accepter: the accepting step's accept (the listener's family,
type and protocol read once) gives the socket socket.accept gives (its
family, type, timeout, blocking, addresses), for tcp and the unix socket,
and keeps socket.accept for a listener it does not fit.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from aioxfer import serving


def _listeners(tmp: Path) -> list[tuple[socket.socket, object]]:
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp / "s")
    unix.bind(path)
    unix.listen(8)
    return [(tcp, tcp.getsockname()), (unix, path)]


@pytest.mark.parametrize("which", [0, 1])
def test_the_same_socket_as_socket_accept(which: int, tmp_path: Path) -> None:
    lsock, addr = _listeners(tmp_path)[which]
    lsock.setblocking(False)
    accept = serving._accepter(lsock)
    assert accept != lsock.accept
    clients = []
    try:
        with pytest.raises(BlockingIOError):
            accept()
        for _ in range(2):
            c = socket.socket(lsock.family, socket.SOCK_STREAM)
            c.connect(addr)  # type: ignore[arg-type]
            clients.append(c)
        got = [accept(), lsock.accept()]
        ours, theirs = got[0][0], got[1][0]
        try:
            for s in (ours, theirs):
                assert isinstance(s, socket.socket)
            assert (ours.family, ours.type, ours.proto) == (
                theirs.family, theirs.type, theirs.proto)
            assert ours.gettimeout() == theirs.gettimeout()
            assert ours.getblocking() == theirs.getblocking()
            assert ours.getsockname() == theirs.getsockname()
            assert type(got[0][1]) is type(got[1][1])
            assert {ours.getpeername(), theirs.getpeername()} == (
                {c.getsockname() for c in clients})
            ours.sendall(b"x")  # (a working connection: one of the clients gets it)
            assert any(c.recv(1, socket.MSG_DONTWAIT) == b"x"
                       for c in clients if c.getsockname() == ours.getpeername())
        finally:
            ours.close()
            theirs.close()
    finally:
        for c in clients:
            c.close()
        lsock.close()


def test_a_listener_with_a_timeout_keeps_socket_accept(tmp_path: Path) -> None:
    for lsock, _ in _listeners(tmp_path):
        with lsock:
            lsock.settimeout(1.0)
            assert serving._accepter(lsock) == lsock.accept
            lsock.settimeout(None)
            assert serving._accepter(lsock) == lsock.accept

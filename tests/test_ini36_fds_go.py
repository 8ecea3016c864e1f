"""The same-host metadata's end (META_GO) read with the last memfds (ini36).

The peer appends META_GO to the last memfds' message when nothing waited
(serving._send_now): Dialer.receive_meta takes it in that read
(local.recv_fds_then) instead of a read of its own. Whether it came there,
came later on its own, or something else came in its place, the outcome is
what it was: the metadata and memfds, or a ProtocolError with every memfd
closed. Nothing past META_GO is read.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from conftest import within

from aioxfer.dialing import Dialer
from aioxfer.errors import ProtocolError
from aioxfer.local import FDS_PER_MESSAGE, recv_fds, recv_fds_then
from aioxfer.metadata import PROTOCOL_VERSION, AgentMeta, RegionMeta
from aioxfer.protocol import META_GO, encode_frame


def _memfds(n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"ini36-{i}", os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        fds.append(fd)
    return fds


def _send(sock: socket.socket, fds: list[int], tail: bytes, rest: bytes = b"") -> None:
    """fds as serving sends them (FDS_PER_MESSAGE a message, b"F" each),
    tail after the last one's b"F" in its message, then rest on its own."""
    for i in range(0, len(fds), FDS_PER_MESSAGE):
        last = i + FDS_PER_MESSAGE >= len(fds)
        socket.send_fds(sock, [b"F" + (tail if last else b"")], fds[i : i + FDS_PER_MESSAGE])
    if rest:
        sock.sendall(rest)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    return a, b


def _same(got: list[int], sent: list[int]) -> bool:
    return [os.fstat(f).st_ino for f in got] == [os.fstat(f).st_ino for f in sent]


@pytest.mark.parametrize("n", [1, 3, FDS_PER_MESSAGE + 2])
@pytest.mark.parametrize("with_last", [True, False])
async def test_recv_fds_then(n: int, with_last: bool) -> None:
    """The byte after the last message's marker comes back only where it
    came in that message; the stream past it is left unread."""
    loop = asyncio.get_running_loop()
    ours, theirs = _pair()
    sent = _memfds(n)
    got: list[int] = []
    try:
        if with_last:
            _send(theirs, sent, META_GO, b"next")
        else:
            _send(theirs, sent, b"", META_GO + b"next")
        got, after = await within(recv_fds_then(loop, ours, n, len(META_GO)))
        assert _same(got, sent)
        assert after == (META_GO if with_last else b"")
        rest = META_GO + b"next" if not with_last else b"next"
        assert ours.recv(64) == rest  # nothing past META_GO was taken
    finally:
        for fd in (*sent, *got):
            os.close(fd)
        ours.close()
        theirs.close()


async def test_recv_fds_unchanged() -> None:
    """recv_fds reads one byte a message, as before: what follows stays."""
    loop = asyncio.get_running_loop()
    ours, theirs = _pair()
    sent = _memfds(2)
    got: list[int] = []
    try:
        _send(theirs, sent, META_GO)
        got = await within(recv_fds(loop, ours, 2))
        assert _same(got, sent)
        assert ours.recv(8) == META_GO
    finally:
        for fd in (*sent, *got):
            os.close(fd)
        ours.close()
        theirs.close()


def _meta(n: int) -> AgentMeta:
    """A peer's metadata naming n memfds (indexes 0..n-1)."""
    regions = [
        RegionMeta(name=f"r{i}", rid=i + 1, key=7, nbytes=4096, access=3, addr=0, memfd=i)
        for i in range(n)
    ]
    return AgentMeta(version=PROTOCOL_VERSION, name="peer", incarnation=5, host_id="h",
                     pid=1, address="127.0.0.1:1", transports=["shm"], regions=regions)


@pytest.mark.parametrize("where", ["with_last", "alone", "bad_with_last", "bad_alone", "none"])
async def test_receive_meta_go(where: str) -> None:
    """receive_meta: META_GO with the last memfds or on its own is the
    metadata's end; another byte there (or none before the close) is a
    ProtocolError, every memfd closed."""
    ours, theirs = _pair()
    sent = _memfds(2)
    before = set(os.listdir("/proc/self/fd"))
    try:
        theirs.sendall(encode_frame(_meta(2)))
        if where == "with_last":
            _send(theirs, sent, META_GO)
        elif where == "alone":
            _send(theirs, sent, b"", META_GO)
        elif where == "bad_with_last":
            _send(theirs, sent, b"\x07")
        elif where == "bad_alone":
            _send(theirs, sent, b"", b"\x07")
        else:
            _send(theirs, sent, b"")
            theirs.shutdown(socket.SHUT_WR)
        dialer = Dialer("me", incarnation=1, token=None, peer_timeout=5.0,
                        max_meta_bytes=1 << 20)
        if where in ("with_last", "alone"):
            meta, got = await within(dialer.receive_meta(ours, local=True))
            try:
                assert meta.name == "peer" and len(meta.regions) == 2
                assert _same(got, sent)
            finally:
                for fd in got:
                    os.close(fd)
        else:
            with pytest.raises(ProtocolError):
                await within(dialer.receive_meta(ours, local=True))
        assert set(os.listdir("/proc/self/fd")) <= before  # none left open
    finally:
        for fd in sent:
            os.close(fd)
        ours.close()
        theirs.close()

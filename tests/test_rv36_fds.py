"""recv_fds_then (ini36) against a peer that breaks its promise: fewer
memfds in the last message than promised (META_GO behind them), or the
connection closed after the first message: a ProtocolError, and no memfd
received is left open in this process."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from conftest import within

from aioxfer.errors import ProtocolError
from aioxfer.local import FDS_PER_MESSAGE, recv_fds_then
from aioxfer.protocol import META_GO


def _memfds(n: int) -> list[int]:
    return [os.memfd_create(f"rv36-{i}", os.MFD_CLOEXEC) for i in range(n)]


@pytest.mark.parametrize("how", ["fewer_with_go", "closed_midway"])
async def test_a_broken_promise_leaks_no_memfd(how: str) -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    n = FDS_PER_MESSAGE + 2
    sent = _memfds(n)
    before = set(os.listdir("/proc/self/fd"))
    try:
        socket.send_fds(theirs, [b"F"], sent[:FDS_PER_MESSAGE])
        if how == "fewer_with_go":
            socket.send_fds(theirs, [b"F" + META_GO], sent[FDS_PER_MESSAGE : FDS_PER_MESSAGE + 1])
        else:
            theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError):
            await within(recv_fds_then(loop, ours, n, len(META_GO)))
        assert set(os.listdir("/proc/self/fd")) <= before
    finally:
        for fd in sent:
            os.close(fd)
        ours.close()
        theirs.close()

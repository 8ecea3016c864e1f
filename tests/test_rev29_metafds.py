"""The unix socket's "meta" answer never passes an fd its region no longer has.

A refresh of a same-host peer (and an old-style local connect) fetches the
metadata on a "meta" connection: the snapshot, then its regions' memfds
(SCM_RIGHTS). When the snapshot's send had to wait (metadata bigger than the
socket's buffer, a reader slow to take it), a region deregistered meanwhile
had its memfd closed, and the number, reused by the next open of the
process (here another region's memfd), was passed as the gone region's: the
reader got an fd of ours the snapshot never named (the data path's
_send_meta checks for this; this one did not).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
import termios
from typing import Any

import pytest
from conftest import wait_until, within

from aioxfer.errors import XferError
from aioxfer.local import local_address, recv_fds
from aioxfer.metadata import AgentMeta
from aioxfer.protocol import client_handshake, encode_frame, recv_frame


def _queued(sock: socket.socket) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0\0\0\0"))[0])


async def test_meta_answer_never_passes_a_reused_fd(make_agent: Any) -> None:
    b = await make_agent("b")
    if not b._accept_msg.local:
        pytest.skip("no same-host unix socket here")
    loop = asyncio.get_running_loop()
    # Metadata well over a unix socket's send buffer (~208 KiB): its send waits.
    keep = [b.register(bytearray(64), name=f"r{i}") for i in range(6000)]
    gone = b.alloc(4096, name="gone")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    fds: list[int] = []
    try:
        await within(loop.sock_connect(sock, local_address(b._accept_msg.local)))
        await within(client_handshake(loop, sock, name="reader", incarnation=7,
                                      purpose="meta", token=b._token))
        # The snapshot is taken (its first bytes wait here) and its send waits.
        await wait_until(lambda: _queued(sock) > 0, what="the metadata's first bytes")
        await asyncio.sleep(0.05)
        size = len(encode_frame(b._localmeta.local()[0]))
        if _queued(sock) >= size:
            pytest.skip(f"the socket took all {size} bytes at once: nothing waited")
        number = gone._memfd
        await within(b.deregister(gone))
        other = b.alloc(4096, name="other")
        if other._memfd != number:
            pytest.skip(f"fd {number} was not reused ({other._memfd}): nothing to show")
        ino = os.fstat(other._memfd).st_ino
        meta = await within(recv_frame(loop, sock, 64 << 20))
        assert isinstance(meta, AgentMeta)
        n = sum(1 for m in meta.regions if m.memfd >= 0)
        assert n == 1  # (the snapshot names "gone" only)
        try:
            fds = await within(recv_fds(loop, sock, n))
        except (XferError, OSError):
            fds = []  # refused: the connection closed instead
        assert ino not in {os.fstat(fd).st_ino for fd in fds}, (
            "the answer passed another region's memfd as the deregistered one's")
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
    del keep

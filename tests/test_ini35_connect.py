"""The initiator's connect path before its Hello and after the answer,
trimmed (ini35), its behaviour unchanged:

- The name of a same-host peer's address-named unix socket comes from an
  HMAC keyed at start (Connector._local_name): the very name
  local.local_name_for gives (the listener binds that one), for any token,
  address and uid; made on the spot where nothing was keyed ahead.
- The first connection's socket is non-blocking from socket() on (no
  setblocking): unix and tcp.
- The pidfd of a same-host peer is taken before its answer: a handshake
  that fails after it closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from typing import Any

import pytest
from conftest import within
from test_cxc32_connect import _listener

import aioxfer
from aioxfer import connector, dialing, local

MiB = 1 << 20


@pytest.mark.parametrize("token", [None, b"s3cret", b"\x00\xff" * 40])
async def test_local_name_is_local_name_for(make_agent: Any, token: bytes | None) -> None:
    """Keyed ahead or not, the name is local_name_for's, address by address."""
    init = await make_agent("init", token=token)
    await init.start()  # keys it (prepare)
    cn = init._connector
    key = cn._config.token
    assert cn._name_mac is not None
    mac, cn._name_mac = cn._name_mac, None
    addresses = ["127.0.0.1:1", "127.0.0.1:65535", "[::1]:80", "host.example:9", "é:1"]
    for a in addresses:  # nothing keyed: made on the spot
        assert cn._local_name(a) == local.local_name_for(key, a, os.geteuid())
    cn._name_mac = mac
    for a in addresses:
        assert cn._local_name(a) == local.local_name_for(key, a, os.geteuid())
    # A uid other than the one it was keyed for: made on the spot, for that uid.
    cn._name_uid = os.geteuid() + 1
    assert cn._local_name(addresses[0]) == local.local_name_for(key, addresses[0], os.geteuid())


async def test_keyed_name_finds_the_peer(make_agent: Any) -> None:
    """With a token, the keyed name is the one the peer listens on: the
    connect takes the direct same-host path and a write lands."""
    target = await make_agent("target", token=b"tok")
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", token=b"tok")
    await init.start()
    assert init._connector._name_mac is not None
    src = init.alloc(MiB, name="src")
    src.numpy().fill(5)
    peer = await within(init.connect(target.address))
    assert peer.path == "shm"
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x05" * 4096


async def test_first_sockets_are_nonblocking(make_agent: Any) -> None:
    target = await make_agent("target")
    d = dialing.Dialer("x", incarnation=1, token=None, peer_timeout=1.0, max_meta_bytes=MiB)
    tcp = d.dial_now(target.address)
    assert tcp is not None
    name = local.local_name_for(target._token, target.address, os.geteuid())
    unix = d.dial_local_now(name)
    assert unix is not None
    try:
        for s in (tcp, unix):
            assert s.gettimeout() == 0.0
            assert fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
            assert fcntl.fcntl(s.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        tcp.close()
        unix.close()
    assert d.dial_now("not-an-ip:1") is None
    with pytest.raises(ValueError):
        d.dial_now("127.0.0.1")


async def test_pidfd_closed_when_the_handshake_fails(make_agent: Any) -> None:
    """A squatter on a tcp address's unix socket name (this process: our
    uid) that takes the Hello and hangs up: the pidfd taken before its
    answer is closed with the link; the connect then fails on the tcp
    address (a listener that hangs up too), as before."""
    init = await make_agent("init")
    await init.start()
    lsock, address = _listener()
    name = local.local_name_for(init._connector._config.token, address, os.geteuid())
    squat = local.listen_abstract(name)
    taken: list[int] = []
    real = connector.peer_pidfd

    def spy(sock: Any, cred: Any) -> int:
        fd = real(sock, cred)
        taken.append(fd)
        return fd

    async def hang_up() -> None:  # each connection: its first bytes, then closed
        loop = asyncio.get_running_loop()
        while True:
            for ls in (squat, lsock):
                try:
                    conn, _ = ls.accept()
                except BlockingIOError:
                    continue
                with conn:
                    conn.setblocking(False)
                    with contextlib.suppress(OSError):
                        await asyncio.wait_for(loop.sock_recv(conn, 64), 1)
            await asyncio.sleep(0.001)

    before = _pidfds()
    server = asyncio.ensure_future(hang_up())
    connector.peer_pidfd = spy  # type: ignore[assignment]
    try:
        with pytest.raises(aioxfer.XferError):
            await within(init.connect(address))
    finally:
        connector.peer_pidfd = real  # type: ignore[assignment]
        server.cancel()
        squat.close()
        lsock.close()
    assert taken  # (taken before the answer, on the direct try)
    assert _pidfds() == before


def _pidfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "pidfd" in os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            pass
    return n

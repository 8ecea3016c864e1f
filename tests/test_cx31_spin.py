"""A client's handshake with a same-host peer polls for the peer's frames
(protocol.handshake_spin_ns, cx31) and keeps every guarantee of the awaited
reads: exactly n bytes and never more, a peer that closes is an error, a
peer slower than the bound is still waited for in the loop, nothing is
polled while the loop has other callbacks ready or on a loop without a
ready queue (uvloop), nor over a network.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from conftest import within

from aioxfer import ProtocolError, protocol
from aioxfer.dialing import Dialer

MiB = 1 << 20


@contextlib.contextmanager
def _pair(family: int = socket.AF_UNIX):
    if family == socket.AF_UNIX:
        a, b = socket.socketpair()
    else:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            a = socket.create_connection(srv.getsockname())
            b, _ = srv.accept()
    a.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


async def test_spin_only_for_a_peer_on_this_host() -> None:
    loop = asyncio.get_running_loop()
    with _pair() as (a, _):
        assert protocol.handshake_spin_ns(loop, a) == protocol.HANDSHAKE_SPIN_NS
    with _pair(socket.AF_INET) as (a, _):
        assert protocol.handshake_spin_ns(loop, a) == protocol.HANDSHAKE_SPIN_NS

    class NoReadyQueue:  # a loop that does not show its ready callbacks (uvloop's)
        pass

    with _pair() as (a, _):
        assert protocol.handshake_spin_ns(NoReadyQueue(), a) == 0  # type: ignore[arg-type]
    # Not connected (or not a stream we know): nothing polled.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        assert protocol.handshake_spin_ns(loop, s) == 0


async def test_spin_for_another_host_is_off() -> None:
    """A tcp peer at an address that is neither loopback nor our own end's."""
    loop = asyncio.get_running_loop()
    host = _non_loopback_address()
    if host is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    with socket.create_server((host, 0)) as srv:
        # Our end bound to loopback, the peer's end a host address: not the
        # same address (as a peer elsewhere), though both are this host's.
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            a.connect(srv.getsockname())
            b, _ = srv.accept()
            with b:
                assert a.getpeername()[0] != a.getsockname()[0]
                assert protocol.handshake_spin_ns(loop, a) == 0
        # Both ends the host's own address: the same host.
        with socket.create_connection(srv.getsockname()) as a:
            b, _ = srv.accept()
            with b:
                assert protocol.handshake_spin_ns(loop, a) == protocol.HANDSHAKE_SPIN_NS


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: routing only
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") or host == "0.0.0.0" else host


async def test_spin_reads_exactly_n_and_leaves_the_rest() -> None:
    loop = asyncio.get_running_loop()
    with _pair() as (a, b):
        b.sendall(b"\x00\x00\x00\x05hello" + b"ENGINE")
        frame = await within(protocol.recv_exact(loop, a, 9, spin_ns=protocol.HANDSHAKE_SPIN_NS))
        assert bytes(frame) == b"\x00\x00\x00\x05hello"
        assert a.recv(64) == b"ENGINE"  # the bytes after it stay in the socket


async def test_spin_sees_a_close_as_the_awaited_read_does() -> None:
    loop = asyncio.get_running_loop()
    with _pair() as (a, b):
        b.sendall(b"ab")
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="closed after 2 of 4"):
            await within(protocol.recv_exact(loop, a, 4, spin_ns=protocol.HANDSHAKE_SPIN_NS))


async def test_a_peer_slower_than_the_bound_is_waited_for() -> None:
    """Nothing within the bound (1 us here): the read waits in the loop, and
    the bytes sent later (by a loop callback, which runs only once the read
    waits) complete it."""
    loop = asyncio.get_running_loop()
    with _pair() as (a, b):
        read = asyncio.ensure_future(protocol.recv_exact(loop, a, 6, spin_ns=1000))
        await asyncio.sleep(0)  # the read started: polled, then waits
        assert not read.done()
        loop.call_soon(b.sendall, b"abc")
        loop.call_soon(loop.call_soon, b.sendall, b"def")
        assert bytes(await within(read)) == b"abcdef"


async def test_no_spin_while_other_callbacks_are_ready() -> None:
    """A callback is ready: the read does not poll (else it would hold the
    loop for the whole bound, 30 s here, past the 5 s deadline, before that
    callback could send: the deadline then fails the test)."""
    loop = asyncio.get_running_loop()
    with _pair() as (a, b):
        loop.call_soon(b.sendall, b"late")
        got = await within(protocol.recv_exact(loop, a, 4, spin_ns=30 * 10**9), 5)
        assert bytes(got) == b"late"


async def test_spin_polls_until_the_bytes_or_the_bound() -> None:
    loop = asyncio.get_running_loop()
    assert not loop._ready  # type: ignore[attr-defined]  # (nothing else ready: it polls)
    with _pair() as (a, b):
        buf = bytearray(8)
        assert protocol._spin_recv_into(loop, a, memoryview(buf), 1000) == -1  # none came
        b.sendall(b"xy")
        assert protocol._spin_recv_into(loop, a, memoryview(buf), 1000) == 2
        assert bytes(buf[:2]) == b"xy"
        b.shutdown(socket.SHUT_WR)
        assert protocol._spin_recv_into(loop, a, memoryview(buf), 1000) == 0  # closed


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_connect_and_write_with_the_spin(make_agent, transport: str) -> None:
    """Connect (its handshake polled: both agents on this host) and a
    write land, with and without a token, and a Dialer says it polls."""
    for token in (None, "s3cret"):
        kw = {"transports": ("tcp",)} if transport == "tcp" else {}
        target = await make_agent(f"t-{token}", token=token, **kw)
        region = target.alloc(MiB, name="dst")
        init = await make_agent(f"i-{token}", token=token, **kw)
        src = init.alloc(MiB, name="src")
        src.numpy()[:] = 7
        peer = await within(init.connect(target.address))
        assert peer.path == transport
        await within(init.write(src[0:4096], peer.region("dst")[4096:8192]))
        assert bytes(region.memoryview[4096:8192]) == b"\x07" * 4096
    loop = asyncio.get_running_loop()
    d = Dialer("x", incarnation=1, token=None, peer_timeout=1.0, max_meta_bytes=MiB)
    with _pair() as (a, _):
        assert d.spin_ns(loop, a) == protocol.HANDSHAKE_SPIN_NS
    d = Dialer("x", incarnation=1, token=None, peer_timeout=1.0, max_meta_bytes=MiB, spin=False)
    with _pair() as (a, _):
        assert d.spin_ns(loop, a) == 0

"""rev15 probes of conn14's background joins."""
from __future__ import annotations

import asyncio
import os
import signal
import time

from conftest import sigstop, wait_until, within

MiB = 1 << 20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_joining_task_ends_soon_after_the_peer_is_closed(make_agent, remote_agent) -> None:
    """A peer that never answers the joins (stopped), closed by the user right
    after connect: the joining task should end within about one peer timeout,
    not one per connection, and its sockets be closed."""
    ra = await remote_agent(size=MiB, transports=("tcp",))
    before = _fds()
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=2.0)
    peer = await within(init.connect(ra.address))
    sigstop(ra.pid)
    try:
        await asyncio.sleep(0.05)
        assert init._probes
        t0 = time.monotonic()
        await peer.aclose()
        await wait_until(lambda: not init._probes, 30, what="the joining task ended")
        took = time.monotonic() - t0
        print(f"joining task ended {took:.2f} s after peer.aclose(); fds {_fds() - before}")
        assert took < 3.0, f"joining task outlived its peer by {took:.2f} s"
    finally:
        os.kill(ra.pid, signal.SIGCONT)


async def test_joining_task_with_a_silent_peer_is_bounded(make_agent, remote_agent) -> None:
    """Not closed: how long the joining task of a peer that never answers joins lives."""
    ra = await remote_agent(size=MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=1.0)
    await within(init.connect(ra.address))
    sigstop(ra.pid)
    try:
        t0 = time.monotonic()
        await asyncio.sleep(0.05)
        await wait_until(lambda: not init._connector.joins_pending and not any(
            t.get_name().startswith("aioxfer-join") for t in init._probes),
            30, what="join task ended")
        print(f"silent peer: joining task lived {time.monotonic() - t0:.2f} s (peer_timeout 1)")
    finally:
        os.kill(ra.pid, signal.SIGCONT)


async def test_joins_never_answered_by_a_live_peer(make_agent, monkeypatch) -> None:
    """The peer serves the first connection and keepalives but never answers a
    join (holds the connection): the connect's joins should give up within
    about one peer timeout (their Hellos all went out at once), not one per
    connection, one after another."""
    from aioxfer import serving

    held: list[object] = []
    from aioxfer import protocol
    orig = serving.Server._join_now

    def swallow_joins(self, sock, addr):
        sock.setblocking(False)
        try:
            frame = sock.recv(4 + protocol.MAX_HANDSHAKE_FRAME, __import__("socket").MSG_PEEK)
            n = int.from_bytes(frame[:4], "big")
            hello = protocol.decode_body(memoryview(frame)[4 : 4 + n])
        except Exception:
            return orig(self, sock, addr)
        if getattr(hello, "join", None):
            held.append(sock)  # never answered, never closed
            return True
        return orig(self, sock, addr)

    monkeypatch.setattr(serving.Server, "_join_now", swallow_joins)
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4, peer_timeout=1.0,
                            rail_probe=30.0)
    peer = await within(init.connect(target.address))
    t0 = time.monotonic()
    await wait_until(lambda: not init._connector.joins_pending and not any(
        t.get_name().startswith("aioxfer-join") for t in init._probes), 30, what="join task ended")
    took = time.monotonic() - t0
    print(f"live silent peer: joining task lived {took:.2f} s (peer_timeout 1, 3 joins); "
          f"lost={peer.lost} held={len(held)}")
    assert not peer.lost
    assert took < 2.5, took

"""Liveness without any discovery service: keepalives on every connection.

A peer in another process is frozen with SIGSTOP. Frozen longer than
``peer_timeout``, it is declared lost within that bound and its pending
transfers fail with PeerLost (they never hang); frozen well within the bound
and resumed (SIGCONT), it loses nothing: every transfer completes and the data
is verified. Detection times are printed (``pytest -s``); the only bound
asserted is the one the design states (peer_timeout, plus one keepalive
interval of granularity and scheduling slack for a busy CI box).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import RemoteAgent, digest, pattern, sigstop, within

import aioxfer

PEER_TIMEOUT = 1.0
KEEPALIVE = 0.2
SLACK = 1.0  # scheduling on a loaded 2-core machine; not a speed claim


def stop(ra: RemoteAgent) -> None:
    sigstop(ra.pid)


@pytest.fixture
def frozen() -> Any:
    """Remembers remote agents a test stops, and kills them at teardown (a
    stopped process cannot answer the remote_agent fixture's "quit")."""
    stopped: list[RemoteAgent] = []
    yield stopped
    for ra in stopped:
        if ra.proc.is_alive():
            ra.kill(signal.SIGKILL)
        ra.terminate()


async def test_sigstopped_peer_is_lost_within_peer_timeout(
    make_agent: Any, remote_agent: Callable[..., Awaitable[RemoteAgent]], frozen: list[Any]
) -> None:
    opts = {"transports": ("tcp",), "peer_timeout": PEER_TIMEOUT, "keepalive": KEEPALIVE}
    a = await make_agent("a", **opts)
    events = a.membership()
    ra = await remote_agent(**opts)
    peer = await within(a.connect(ra.address))
    src = a.register(bytearray(1 << 20))
    dst = peer.region("pool")
    await within(a.write(src[0:4096], dst[0:4096]))  # healthy before

    frozen.append(ra)
    stop(ra)
    t_stop = time.monotonic()
    pending = [a.write(src[i << 16:(i + 1) << 16], dst[i << 16:(i + 1) << 16]) for i in range(8)]
    pending.append(a.write(src[0:16], dst[0:16], notify=b"are you there"))
    results = await within(
        asyncio.gather(*pending, return_exceptions=True), PEER_TIMEOUT + KEEPALIVE + SLACK + 5
    )
    elapsed = time.monotonic() - t_stop
    print(f"\nSIGSTOP'd peer: lost after {elapsed:.3f} s "
          f"(peer_timeout {PEER_TIMEOUT} s, keepalive {KEEPALIVE} s)")
    assert all(isinstance(r, aioxfer.PeerLost) for r in results), [repr(r) for r in results]
    assert elapsed <= PEER_TIMEOUT + KEEPALIVE + SLACK
    assert peer.lost
    with pytest.raises(aioxfer.PeerLost):
        await within(a.write(src[0:16], dst[0:16]))  # later ones fail at once too
    async with asyncio.timeout(5):
        async for ev in events:
            if isinstance(ev, aioxfer.PeerLeft):
                assert ev.reason == "lost" and ev.name == peer.name
                break


async def test_sigstop_within_bound_loses_nothing(
    make_agent: Any, remote_agent: Callable[..., Awaitable[RemoteAgent]], frozen: list[Any]
) -> None:
    timeout = 3.0  # frozen for a sixth of it
    opts = {"transports": ("tcp",), "peer_timeout": timeout, "keepalive": KEEPALIVE}
    size = 2 << 20
    a = await make_agent("a", **opts)
    ra = await remote_agent(size=size, **opts)
    peer = await within(a.connect(ra.address))
    data = pattern(size, 11)
    src = a.register(bytearray(data.tobytes()))
    dst = peer.region("pool")
    await within(a.write(src[0:4096], dst[0:4096]))

    frozen.append(ra)
    stop(ra)
    t_stop = time.monotonic()
    chunk = size // 16
    # Posted while it is frozen: they wait for it, they do not fail.
    pending = [a.write(src[i * chunk:(i + 1) * chunk], dst[i * chunk:(i + 1) * chunk])
               for i in range(16)]
    pending.append(a.write(src[0:16], dst[0:16], notify=b"resumed"))
    await asyncio.sleep(timeout / 6)
    assert not any(t.done() for t in pending), "a write completed into a stopped process"
    ra.kill(signal.SIGCONT)
    frozen.remove(ra)
    results = await within(asyncio.gather(*pending), timeout + 5)
    print(f"\nSIGSTOP for {timeout / 6:.2f} s then SIGCONT: all {len(results)} transfers "
          f"completed {time.monotonic() - t_stop:.3f} s after the stop")
    assert sum(r.nbytes for r in results[:-1]) == size
    assert not peer.lost
    assert await ra.call("digest", "pool", 0, size) == digest(data)
    notes = await ra.call("notes", 1, 5.0, {})
    assert notes[0][1] == b"resumed"


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")], ids=["tcp", "shm"])
async def test_idle_peers_configured_apart_stay_connected(
    make_agent: Any, transports: tuple[str, ...]
) -> None:
    """A tight peer_timeout on one side, a long keepalive on the other: the
    quiet side learns the tight timeout from the pings and pings often enough,
    so an idle connection is never declared silent. (Before, "a" heard from
    "b" only every 2 s and dropped it after 1 s of idleness.)"""
    a = await make_agent("a", transports=transports, peer_timeout=PEER_TIMEOUT,
                         keepalive=KEEPALIVE)
    b = await make_agent("b", transports=transports, peer_timeout=10.0, keepalive=2.0)
    b.alloc(1 << 20, name="dst")
    peer = await within(a.connect(b.address))
    src = a.register(bytearray(4096))
    await within(a.write(src[0:4096], peer.region("dst")[0:4096]))
    await asyncio.sleep(3 * PEER_TIMEOUT)  # idle, three timeouts long
    assert not peer.lost, "an idle peer was declared silent"
    await within(a.write(src[0:4096], peer.region("dst")[0:4096]))

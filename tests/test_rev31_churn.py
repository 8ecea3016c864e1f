"""Peers that die under load, with real processes (rev31's fault review).

- Churn: connect, a batch of writes, reads and notifications in flight, the
  peer SIGKILLed, reconnect to a new one, again and again, over shm and tcp:
  every transfer completes or fails typed (PeerLost), nothing hangs, and the
  cycles leave nothing behind in this process: file descriptors, asyncio
  tasks, the engine's ops and regions, the agent's tables of peers, tags and
  notification ids. ``AIOXFER_REV31_CYCLES`` sets the cycles (a minute's
  churn: ~150 here).
- The other side: a long-lived target whose initiators are SIGKILLed while
  their writes with notifications stream in: the same.
- ``aclose()`` racing writes, notifications, receives and connects (to a
  peer that never answers), at every few loop steps: each fails typed or
  completes, none hangs, nothing leaks.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest import within

import aioxfer

CYCLES = int(os.environ.get("AIOXFER_REV31_CYCLES", "6"))
KiB = 1 << 10
MiB = 1 << 20

# A peer process: an agent with a 16 MiB pool; prints its address, then
# either idles or (argv[2] given: an address) writes with notifications to
# that agent's "pool" in a loop (argv[3] given: 4 rounds of them, then it
# closes its peer, prints "closed" and idles).
_PEER = r"""
import asyncio, sys
import aioxfer

async def main():
    kw = {"transports": ("tcp",)} if sys.argv[1] == "tcp" else {}
    async with aioxfer.Agent("peer", peer_timeout=2.0, keepalive=0.5, **kw) as a:
        src = a.alloc(16 << 20, name="pool")
        if len(sys.argv) < 3:
            print(a.address, flush=True)
            await asyncio.sleep(3600)
        peer = await a.connect(sys.argv[2])
        dst = peer.region("pool")
        print(a.address, flush=True)
        i = 0
        while len(sys.argv) < 4 or i < 4:  # argv[3]: 4 rounds, then close that peer
            await asyncio.gather(*(a.write(src[k << 18:(k + 1) << 18], dst[k << 18:(k + 1) << 18],
                                           notify=b"n%d" % i) for k in range(8)))
            i += 1
        await peer.aclose()
        print("closed", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


class Peers:
    """Peer processes of this test: killed (SIGKILL) and reaped at its end."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, mode: str, *args: str) -> tuple[asyncio.subprocess.Process, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _PEER, mode, *args,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            # (outside the checkout: "-c" puts the cwd first on sys.path, and
            # a checkout's aioxfer has no compiled part where the package is
            # installed, not editable: CI)
            cwd="/",
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        line = await within(proc.stdout.readline(), 60)
        assert line, "the peer process died before it printed its address"
        return proc, line.decode().strip()

    async def kill(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        await within(proc.wait(), 10)


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    made = Peers()
    try:
        yield made
    finally:
        for proc in made.procs:
            await made.kill(proc)


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # (the listing's own fd)
    return out


def _tasks() -> Counter[str]:
    return Counter(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task())


def _tables(agent: Any) -> dict[str, int]:
    s = agent.statistics()
    return {
        "in_flight": s.in_flight, "native_ops": s.native_ops, "peers": len(agent.peers),
        "tags": len(agent._tags.names), "seen": len(agent._events._seen),
        "connecting": len(agent._connecting_eps), "probes": len(agent._probes),
        "serving": len(agent._serving), "inflight": len(agent._sub.inflight),
        "held": len(agent._sub._held), "settling": len(agent._sub._settling),
        "holds": len(agent._sub._holds), "unreported": len(agent._peers.unreported),
    }


async def _quiet(agent: Any) -> None:
    """Until the agent has nothing in flight, no peer (the lost ones'
    records drained) and no rail probe (cancelled with its lost peer: ended
    a few loop steps later), bounded: what is left past that leaked."""
    async with asyncio.timeout(15):
        while (_tables(agent)["in_flight"] or agent.peers or agent._sub.inflight
               or agent._probes):
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["shm", "tcp"])
async def test_kill9_churn_leaves_nothing_behind(make_agent: Any, peers: Peers,
                                                 mode: str) -> None:
    kw: dict[str, Any] = {"transports": ("tcp",)} if mode == "tcp" else {}
    agent = await make_agent("churn", peer_timeout=2.0, keepalive=0.5, **kw)
    src = agent.alloc(16 * MiB, name="src")
    outcomes: dict[str, int] = {}
    before: tuple[dict[str, str], Counter[str], int] | None = None
    for cycle in range(CYCLES + 2):
        proc, address = await peers.start("tcp" if mode == "tcp" else "auto")
        peer = await within(agent.connect(address), 30)
        assert peer.path == mode
        dst = peer.region("pool")
        n = 4 + cycle % 5
        pending: list[Any] = [
            agent.write(src[k * 256 * KiB:(k + 1) * 256 * KiB],
                        dst[k * 256 * KiB:(k + 1) * 256 * KiB],
                        notify=b"w%d" % k if k % 2 else None)
            for k in range(n)
        ]
        pending += [agent.read(src[(32 + k) * 256 * KiB:(33 + k) * 256 * KiB],
                               dst[k * 256 * KiB:(k + 1) * 256 * KiB]) for k in range(3)]
        pending.append(asyncio.ensure_future(peer.notify(b"hello")))
        for _ in range(cycle % 4):  # the kill lands at a different step each cycle
            await asyncio.sleep(0)
        proc.kill()
        results = await within(asyncio.gather(*pending, return_exceptions=True), 20)
        for r in results:
            if isinstance(r, BaseException):
                assert isinstance(r, aioxfer.PeerLost), repr(r)
            outcomes[type(r).__name__] = outcomes.get(type(r).__name__, 0) + 1
        await peers.kill(proc)
        with pytest.raises(aioxfer.PeerLost):  # a new transfer to the dead peer: typed, at once
            await within(agent.write(src[0:4096], dst[0:4096]), 20)
        await _quiet(agent)
        if cycle == 1:  # after a warm-up (lazily made things exist)
            gc.collect()
            before = (_fds(), _tasks(), agent.statistics().native_regions)
    assert outcomes.get("PeerLost"), outcomes  # the kills did land mid-batch
    assert before is not None
    gc.collect()
    fds, tasks, regions = _fds(), _tasks(), agent.statistics().native_regions
    assert {k: v for k, v in fds.items() if k not in before[0]} == {}, "fds leaked"
    assert tasks == before[1], "tasks leaked"
    assert regions == before[2] == 1  # src only
    assert _tables(agent) == dict.fromkeys(_tables(agent), 0), _tables(agent)


@pytest.mark.parametrize("mode", ["auto", "tcp"])
async def test_initiators_killed_mid_stream_leave_the_target_clean(
    make_agent: Any, peers: Peers, mode: str
) -> None:
    kw: dict[str, Any] = {"transports": ("tcp",)} if mode == "tcp" else {}
    target = await make_agent("target", peer_timeout=2.0, keepalive=0.5, **kw)
    target.alloc(16 * MiB, name="pool")
    got = 0

    async def receive() -> None:
        nonlocal got
        async for _ in target.notifications:
            got += 1

    receiver = asyncio.ensure_future(receive())
    before: tuple[dict[str, str], Counter[str]] | None = None
    try:
        for cycle in range(CYCLES + 2):
            proc, _ = await peers.start(mode, target.address)  # connected and writing
            seen = got
            async with asyncio.timeout(30):
                while got == seen:  # its writes land
                    await asyncio.sleep(0.01)
            await peers.kill(proc)
            async with asyncio.timeout(15):  # its connections' loss drained
                while target._tags.names or target.statistics().native_conns:
                    await asyncio.sleep(0.05)
            if cycle == 1:
                gc.collect()
                before = (_fds(), _tasks())
        assert before is not None
        gc.collect()
        assert {k: v for k, v in _fds().items() if k not in before[0]} == {}, "fds leaked"
        assert _tasks() == before[1], "tasks leaked"
        assert _tables(target) == dict.fromkeys(_tables(target), 0), _tables(target)
        assert target.statistics().native_ops == 0
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)


async def _op(what: str, agent: Any, peer: Any, src: Any, dst: Any, k: int,
              nowhere: str) -> Any:
    if what == "write":
        return await agent.write(src[0:256 * KiB], dst[k * 256 * KiB:(k + 1) * 256 * KiB],
                                 notify=b"w")
    if what == "notify":
        return await peer.notify(b"n%d" % k)
    if what == "receive":
        return await agent.notifications.receive()
    return await agent.connect(nowhere)


@pytest.mark.parametrize("what", ["write", "notify", "receive", "connect"])
@pytest.mark.parametrize("mode", ["auto", "tcp"])
async def test_aclose_racing_the_data_path(peers: Peers, mode: str, what: str) -> None:
    kw: dict[str, Any] = {"transports": ("tcp",)} if mode == "tcp" else {}
    proc, address = await peers.start("tcp" if mode == "tcp" else "auto")
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # answers nothing
    nowhere = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    try:
        for steps in (0, 1, 2, 5, 20):
            agent = aioxfer.Agent("racing", peer_timeout=2.0, keepalive=0.5, **kw)
            await within(agent.start())
            peer = await within(agent.connect(address), 30)
            src = agent.alloc(MiB)
            dst = peer.region("pool")

            ops = [asyncio.ensure_future(_op(what, agent, peer, src, dst, k, nowhere))
                   for k in range(4)]
            for _ in range(steps):
                await asyncio.sleep(0)
            await within(agent.aclose(), 20)
            results = await within(asyncio.gather(*ops, return_exceptions=True), 20)
            for r in results:
                # Done before the close, or refused typed by it: never a hang,
                # never an untyped error.
                assert not isinstance(r, BaseException) or isinstance(
                    r, aioxfer.ClosedResourceError), repr(r)
            s = agent.statistics()
            assert (s.in_flight, s.native_ops, s.native_regions, s.pinned_regions) == (0,) * 4
            assert not agent._connecting and not agent._sub.inflight
    finally:
        silent.close()
        await silent.wait_closed()


@pytest.mark.parametrize("mode", ["auto", "tcp"])
async def test_a_peer_connected_both_ways_killed_leaves_no_notification_ids(
    make_agent: Any, peers: Peers, mode: str
) -> None:
    """We connect to it and it to us (prefill and decode do both), and it
    notifies us. Its notification ids (kept per connection tag to drop
    copies resent on another rail: up to NOTIFY_SEEN, ~1 MiB, per peer)
    must go with its tag whichever reference goes last: our endpoint's,
    when the peer is marked lost after its connections' close records.
    They stayed for good then (rev31): a leak per peer that died."""
    kw: dict[str, Any] = {"transports": ("tcp",)} if mode == "tcp" else {}
    agent = await make_agent("both", peer_timeout=2.0, keepalive=0.5, **kw)
    agent.alloc(16 * MiB, name="pool")
    got = 0

    async def receive() -> None:
        nonlocal got
        async for _ in agent.notifications:
            got += 1

    receiver = asyncio.ensure_future(receive())
    try:
        for _ in range(2):
            # It writes to us with notifications, 4 rounds of 8, then closes its
            # connections to us (their close records release their references
            # to its tag); we connect to it meanwhile: our endpoint holds the last.
            proc, address = await peers.start(mode, agent.address, "once")
            peer = await within(agent.connect(address), 30)
            assert proc.stdout is not None
            assert await within(proc.stdout.readline(), 30) == b"closed\n"
            async with asyncio.timeout(15):
                while got < 32 or agent._tags._refs.get(peer._tag) != 1:
                    await asyncio.sleep(0.01)
            got = 0
            assert agent._events._seen  # its ids, remembered while it lives
            await peers.kill(proc)  # then our endpoint goes: the tag's last reference
            async with asyncio.timeout(15):  # lost both ways, its tag released
                while agent.peers or agent._tags.names:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # (any record still on its way drained)
            assert agent._events._seen == {}, {
                t: len(ids) for t, (ids, _) in agent._events._seen.items()}
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)

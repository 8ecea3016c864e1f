"""The one-copy send (native/src/conn.c "one-copy send", tcp18): a WRITE's
payload to a tcp peer that the kernel says runs as our uid over loopback goes
by vmsplice + splice, so only the target copies. Real processes over real
loopback sockets.

Which path ran is observed from outside the engine: the one-copy send opens
one pipe per connection, on its first spliced frame, and nothing else in this
process opens pipes while these tests write, so the pipes in /proc/self/fd
say it (a same-uid peer gets them, another uid's never; before tcp18 none at
all: test_same_uid_splices_other_uid_copies fails there on the first half).
The one-copy send is off by default (rev18b: tcp.c tcp_enable): these tests
turn it on (AIOXFER_TCP_SPLICE=1, read when an engine is made).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
from conftest import digest, pattern, sigstop, wait_until, within

from aioxfer import PeerLost, XferError, auth

MiB = 1 << 20
NOBODY = 65534
# The window's edges (64 KiB .. 512 KiB a frame and a request), either side.
EDGES = [4096, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 100_000, 333_333, (512 << 10) - 1,
         512 << 10, (512 << 10) + 1, MiB, 3 * MiB + 5]


@pytest.fixture(autouse=True)
def splice_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_TCP_SPLICE", "1")


def pipes() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
        except OSError:
            pass
    return n


async def _writes(agent, peer, src, region: str, plan, inflight: bool) -> None:
    """Posts plan's (loff, roff, n) WRITEs, all at once (the sending threads'
    path) or one at a time (the posting thread sends inline)."""
    rr = peer.region(region)
    if inflight:
        await within(asyncio.gather(*(agent.write(src[lo:lo + n], rr[ro:ro + n])
                                      for lo, ro, n in plan)), 30)
    else:
        for lo, ro, n in plan:
            await within(agent.write(src[lo:lo + n], rr[ro:ro + n]))


def _plan(rng: random.Random, size: int, count: int) -> list[tuple[int, int, int]]:
    """Random sizes from EDGES at unaligned, sub-page and page-spanning
    offsets, into disjoint slots of the target's region."""
    slot = size // count
    out = []
    for k in range(count):
        n = min(rng.choice(EDGES), slot - 4099)
        lo = rng.randrange(0, size - n)
        ro = k * slot + rng.randrange(0, 4099)
        out.append((lo, ro, n))
    return out


@pytest.mark.parametrize("inflight", [False, True], ids=["one-at-a-time", "in-flight"])
async def test_integrity_across_window(make_agent, remote_agent, inflight: bool) -> None:
    size = 32 * MiB
    ra = await remote_agent(size=size, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",))
    peer = await within(agent.connect(ra.address))
    assert peer.path == "tcp"
    src = agent.register(bytearray(size))
    rng = random.Random(18 + inflight)
    before = pipes()
    for rnd in range(4):
        src.memoryview[:] = pattern(size, 100 + rnd).tobytes()
        await ra.call("zero", "user")
        plan = _plan(rng, size, 16)
        await _writes(agent, peer, src, "user", plan, inflight)
        for lo, ro, n in plan:
            assert await ra.call("digest", "user", ro, n) == digest(src.memoryview[lo:lo + n]), \
                (lo, ro, n)
    assert pipes() > before, "no frame went spliced to a same-uid loopback peer"


async def test_source_rewritten_after_complete(make_agent, remote_agent) -> None:
    """The source is overwritten the moment each WRITE completes: the target
    holds the bytes as of the post (its acknowledgement came after it read
    the spliced pages)."""
    ra = await remote_agent(size=8 * MiB, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",))
    peer = await within(agent.connect(ra.address))
    src = agent.register(bytearray(2 * MiB))
    rr = peer.region("user")
    mv = src.memoryview
    for i in range(24):
        n = (512 << 10, 256 << 10, 64 << 10)[i % 3]
        data = pattern(n, 700 + i).tobytes()
        mv[:n] = data
        roff = (i % 7) * MiB
        await within(agent.write(src[0:n], rr[roff:roff + n]))
        mv[:n] = b"\xee" * n  # what a late reader would see
        assert await ra.call("digest", "user", roff, n) == digest(data), i


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (an other-uid process)")
async def test_same_uid_splices_other_uid_copies(make_agent, remote_agent) -> None:
    """A peer of another uid (nobody) gets the copy: no pipe is ever made for
    its connections; a same-uid peer's connections, written the same way from
    the same agent, get theirs (one a connection at most)."""
    token = auth.default_token().decode()
    other = await remote_agent(as_uid=NOBODY, token=token, transports=("tcp",), size=4 * MiB)
    same = await remote_agent(transports=("tcp",), size=4 * MiB)
    agent = await make_agent("init", transports=("tcp",), tcp_connections=4)
    p_other = await within(agent.connect(other.address))
    p_same = await within(agent.connect(same.address))
    assert p_other.path == p_same.path == "tcp"
    src = agent.register(bytearray(4 * MiB))
    src.memoryview[:] = pattern(4 * MiB, 5).tobytes()
    plan = [(k * 4097, k * (256 << 10), n)
            for k, n in enumerate([64 << 10, 256 << 10, 100_000, 200_000] * 3)]
    before = pipes()
    for inflight in (False, True):
        await _writes(agent, p_other, src, "user", plan, inflight)
    assert pipes() == before, "a pipe was made for another uid's peer"
    for lo, ro, n in plan:
        assert await other.call("digest", "user", ro, n) == digest(src.memoryview[lo:lo + n])
    for inflight in (False, True):
        await _writes(agent, p_same, src, "user", plan, inflight)
    made = pipes() - before
    assert 0 < made <= 2 * 4, made  # two fds a pipe, one pipe a connection at most
    for lo, ro, n in plan:
        assert await same.call("digest", "user", ro, n) == digest(src.memoryview[lo:lo + n])


async def test_kill9_midstream(make_agent, remote_agent) -> None:
    """The target is killed (SIGKILL) while large WRITEs are being spliced to
    it: every op ends (done or PeerLost), promptly, and the connections'
    pipes are closed with them."""
    ra = await remote_agent(size=16 * MiB, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), peer_timeout=2.0)
    peer = await within(agent.connect(ra.address))
    base = pipes()  # after the spawn (its sentinel is a pipe)
    src = agent.register(bytearray(16 * MiB))
    rr = peer.region("user")
    half = 512 << 10  # the window's top
    await within(agent.write(src[0:half], rr[0:half]))  # a pipe exists now
    assert pipes() > base
    ts = [agent.write(src[(k % 32) * half:(k % 32 + 1) * half],
                      rr[(k % 32) * half:(k % 32 + 1) * half]) for k in range(128)]
    await asyncio.sleep(0.002)
    ra.kill()
    t0 = asyncio.get_running_loop().time()
    results = await within(asyncio.gather(*ts, return_exceptions=True), 15)
    took = asyncio.get_running_loop().time() - t0
    bad = [r for r in results if isinstance(r, BaseException) and not isinstance(r, PeerLost)]
    assert not bad, bad
    assert any(isinstance(r, XferError) for r in results), "the kill landed after every op"
    assert took < 5, took
    await wait_until(lambda: pipes() == base, 10, "the pipes closed")


async def test_target_stopped_then_resumed(make_agent, remote_agent) -> None:
    """The target stops reading (SIGSTOP) while spliced WRITEs are posted:
    the sockets fill, the posting thread's sends stop where the socket has
    no room and the sending threads wait; once it runs again every WRITE
    completes with its bytes in place."""
    ra = await remote_agent(size=17 * MiB, transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",))
    peer = await within(agent.connect(ra.address))
    src = agent.register(bytearray(16 * MiB))
    src.memoryview[:] = pattern(16 * MiB, 77).tobytes()
    rr = peer.region("user")
    half = 512 << 10
    await within(agent.write(src[0:half], rr[0:half]))
    sigstop(ra.pid)
    try:
        ts = [agent.write(src[k * MiB + 5:k * MiB + half], rr[k * MiB + 11:k * MiB + half + 6])
              for k in range(16)]
        await asyncio.sleep(0.3)
    finally:
        os.kill(ra.pid, signal.SIGCONT)
    await within(asyncio.gather(*ts), 30)
    for k in range(16):
        want = digest(src.memoryview[k * MiB + 5:k * MiB + half])
        assert await ra.call("digest", "user", k * MiB + 11, half - 5) == want, k

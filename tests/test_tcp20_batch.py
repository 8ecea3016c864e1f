"""A lone tcp WRITE of several chunks through loopback (tcp20): a batch of
256 x 16 KiB scattered descriptors (4 MiB, what benchmarks/peers measures
beside iperf3's one stream) goes on one connection, sent whole by the posting
thread (tcp.c solo_conn), where it was striped over all four. A READ batch,
a WRITE over 4 MiB, and connections without the loopback congestion control
keep the stripes.

Both agents run in this process: each socket's received bytes are read from
the kernel (test_tcp19_loopback.sockets: TCP_INFO), not from the engine.
Before tcp20 the 4 MiB batch reached the target on four connections, ~1 MiB
each.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from conftest import digest, queued_conns, sigstop, wait_until, within
from test_tcp19_loopback import pair, sockets

import aioxfer
from aioxfer import PeerLost

MiB = 1 << 20
DESC = 16 << 10


def scattered(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n distinct DESC-aligned offsets in each of two buffers of size bytes."""
    rng = np.random.default_rng(seed)
    pages = size // DESC
    return (rng.permutation(pages)[:n].astype(np.uint64) * DESC,
            rng.permutation(pages)[:n].astype(np.uint64) * DESC)


async def per_conn(make_agent: Any, op: str, n: int, big: bool = False) -> tuple[list[int],
                                                                                  list[int]]:
    """What one lone request of n scattered 16 KiB descriptors added to each
    connection's received bytes (sorted: the target's ends, the
    initiator's); every descriptor's bytes checked."""
    agent, peer, src, dst, port = await pair(make_agent)
    # pair()'s buffers: src 2 MiB at the initiator, dst 4 MiB at the target.
    local = agent.register(bytearray(os.urandom(8 * MiB))) if big else src
    lsize = 8 * MiB if big else 2 * MiB
    loff, roff = scattered(n, min(lsize, len(dst)), 20)
    lens = np.full(n, DESC, dtype=np.uint64)
    sl = aioxfer.SegmentList(local, loff, lens)
    sr = aioxfer.SegmentList(peer.region("dst"), roff, lens)
    if op == "READ":
        dst[:] = os.urandom(len(dst))
    await wait_until(lambda: agent.statistics().native_ops == 0, what="nothing in flight")
    before = sockets(port)
    await within(agent.write(sl, sr) if op == "WRITE" else agent.read(sl, sr))
    after = sockets(port)
    assert before.keys() == after.keys()
    mine = local.memoryview
    for lo, ro in zip(loff.tolist(), roff.tolist(), strict=True):
        assert bytes(mine[lo:lo + DESC]) == bytes(dst[ro:ro + DESC])
    delta = {k: after[k][1] - before[k][1] for k in after}
    return (sorted(d for k, d in delta.items() if after[k][2] == "t"),
            sorted(d for k, d in delta.items() if after[k][2] == "i"))


async def test_lone_batch_write_goes_on_one_connection(make_agent: Any) -> None:
    # 128 x 16 KiB (2 MiB, pair()'s source): two chunks' worth of frames
    at_target, _ = await per_conn(make_agent, "WRITE", 128)
    assert at_target[-1] >= 2 * MiB and at_target[-2] < 4096, at_target


async def test_lone_4mib_batch_write_goes_on_one_connection(make_agent: Any) -> None:
    at_target, _ = await per_conn(make_agent, "WRITE", 256, big=True)  # the benchmark's 4 MiB
    assert at_target[-1] >= 4 * MiB and at_target[-2] < 4096, at_target


async def test_lone_batch_read_keeps_its_stripes(make_agent: Any) -> None:
    _, at_init = await per_conn(make_agent, "READ", 128)
    assert all(d >= MiB // 4 for d in at_init), at_init  # four connections


async def test_batch_write_striped_without_reno(make_agent: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "0")
    at_target, _ = await per_conn(make_agent, "WRITE", 128)
    assert all(d >= MiB // 4 for d in at_target), at_target


async def test_write_over_4mib_keeps_its_stripes(make_agent: Any) -> None:
    """4 MiB in one descriptor goes on one connection; 4 MiB + 16 KiB (past
    SOLO_MAX) is striped over the four as before."""
    target = await make_agent("target", listen="127.0.0.1:0", transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), tcp_connections=4)
    dst = bytearray(8 * MiB)
    target.register(dst, name="dst")
    peer = await within(agent.connect(target.address))
    src = agent.register(bytearray(os.urandom(8 * MiB)))
    port = int(target.address.rsplit(":", 1)[1])
    await wait_until(lambda: peer.statistics().rails[0].connections == 4, 10, what="the joins")
    await wait_until(lambda: len(sockets(port)) == 8, what="4 connections, both ends")
    rr = peer.region("dst")
    got = []
    for size in (4 * MiB, 4 * MiB + DESC):
        await wait_until(lambda: agent.statistics().native_ops == 0, what="nothing in flight")
        before = sockets(port)
        await within(agent.write(src[0:size], rr[0:size]))
        after = sockets(port)
        got.append(sorted(after[k][1] - before[k][1] for k in after if after[k][2] == "t"))
        assert bytes(src.memoryview[0:size]) == bytes(dst[0:size])
    assert got[0][-1] >= 4 * MiB and got[0][-2] < 4096, got
    assert all(d >= MiB // 2 for d in got[1]), got


async def test_peer_killed_under_a_lone_batch(make_agent: Any, remote_agent: Any) -> None:
    """The batch queued whole at a stopped peer (one connection), the peer
    then SIGKILLed: PeerLost within a bound, nothing left in flight, and a
    new peer gets the same batch right."""
    ra = await remote_agent(size=8 * MiB, transports=("tcp",))
    port = int(ra.address.rsplit(":", 1)[1])
    init = await make_agent("init", transports=("tcp",), keepalive=30.0, peer_timeout=120.0)
    data = os.urandom(4 * MiB)
    buf = init.register(bytearray(data), name="src")
    n = 256
    lens = np.full(n, DESC, dtype=np.uint64)
    offs = np.arange(n, dtype=np.uint64) * DESC  # in order: the digest below checks it whole
    peer = await within(init.connect(ra.address))
    await wait_until(lambda: peer.statistics().rails[0].connections == 4, 10, what="the joins")

    def batch(p: Any) -> Any:
        return init.write(aioxfer.SegmentList(buf, offs, lens),
                          aioxfer.SegmentList(p.region("user"), offs[::-1].copy(), lens))

    await within(batch(peer))  # warm
    sigstop(ra.pid)
    try:
        t0 = time.monotonic()
        t = batch(peer)
        await wait_until(lambda: queued_conns(port, 256 << 10) >= 1, 10, what="the batch queued")
        assert queued_conns(port, 32 << 10) == 1  # whole, on one connection
        assert not t.done()
        ra.kill(signal.SIGKILL)
        with pytest.raises(PeerLost):
            await within(t, 10)
        assert time.monotonic() - t0 < 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ra.pid, signal.SIGCONT)
    await wait_until(lambda: init.statistics().in_flight == 0
                     and init.statistics().native_ops == 0, 10, what="nothing in flight")
    ra.terminate()
    ra2 = await remote_agent(size=8 * MiB, transports=("tcp",))
    peer2 = await within(init.connect(ra2.address))
    res = await within(batch(peer2))
    assert res.nbytes == 4 * MiB
    # offs reversed at the target: descriptor i lands at page n-1-i
    want = b"".join(data[i * DESC:(i + 1) * DESC] for i in reversed(range(n)))
    assert await ra2.call("digest", "user", 0, 4 * MiB) == digest(want)

"""Prepared.post(now=True) (aioxfer.nixl's repost) with the engine's
AXF_POST_INLINE: a same-host copy done inside the post completes its
transfer there, with no completion record in the ring. What the drain did
for that record must still happen: the Transfer resolved with its result,
out of flight, counted on its peer and on the agent (statistics), and any
other completion that came meanwhile still drained; what the post does not
finish inside goes through the ring as before."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from conftest import Pair, pattern, within

N = 1 << 22


async def _regions(pair: Pair) -> tuple[Any, bytearray, bytearray, Any]:
    src_buf = bytearray(pattern(N, 3).tobytes())
    src = pair.init.register(src_buf, name="src")
    dst_buf = bytearray(N)
    pair.target.register(dst_buf, name="dst")
    return src, src_buf, dst_buf, await pair.remote("dst")


async def test_reposts_are_counted_as_the_drain_counts_them(pair: Pair) -> None:
    """Each post(True) of a 4 KiB prepared WRITE and READ: resolved with the
    result a drained record gives (over shm: when post returns), out of
    flight, and the agent's and the peer's totals move by one transfer and
    its bytes each (latency average set), as for write/read."""
    src, src_buf, dst_buf, remote = await _regions(pair)
    agent, peer = pair.init, pair.peer
    a0, p0 = agent.statistics(), peer.statistics()
    w = agent.prepare("write", src[0:4096], remote[8192:12288])
    r = agent.prepare("read", src[N - 4096:N], remote[8192:12288])
    k = 20
    for i in range(k):
        src_buf[0:4096] = bytes([i]) * 4096
        t = w.post(True)
        if pair.transport == "shm":
            assert t.done() and not agent._sub.inflight
        res = await within(t)
        assert (res.nbytes, res.path, res.reroutes) == (4096, pair.result_path, 0)
        assert res.seconds >= 0
        assert dst_buf[8192:12288] == bytes([i]) * 4096
        t = r.post(True)
        await within(t)
        assert src_buf[N - 4096:N] == bytes([i]) * 4096
    a1, p1 = agent.statistics(), peer.statistics()
    assert a1.transfers_posted - a0.transfers_posted == 2 * k
    assert a1.transfers_completed - a0.transfers_completed == 2 * k
    assert a1.bytes - a0.bytes == 2 * k * 4096
    assert a1.in_flight == 0
    assert p1.transfers_posted - p0.transfers_posted == 2 * k
    assert p1.transfers_completed - p0.transfers_completed == 2 * k
    assert p1.bytes - p0.bytes == 2 * k * 4096
    assert (p1.in_flight, p1.in_flight_bytes) == (0, 0)
    assert p1.latency > 0.0


async def test_a_post_done_inside_still_drains_what_else_came(pair: Pair) -> None:
    """With a large write in flight on the copy workers, a prepared 4 KiB
    post(True) (not alone: copied inside, as a batch's small copy) completes
    inside; the large one completes through the ring, drained by that post
    or later; both counted once."""
    src, src_buf, dst_buf, remote = await _regions(pair)
    agent = pair.init
    a0 = agent.statistics()
    w = agent.prepare("write", src[0:4096], remote[0:4096])
    for _ in range(5):
        big = agent.write(src[N // 2:N], remote[N // 2:N])
        agent.flush()
        small = w.post(True)
        await within(asyncio.gather(big, small))
        assert big.result().nbytes == N // 2 and small.result().nbytes == 4096
    assert dst_buf[N // 2:N] == src_buf[N // 2:N] and dst_buf[0:4096] == src_buf[0:4096]
    a1 = agent.statistics()
    assert a1.transfers_completed - a0.transfers_completed == 10
    assert a1.bytes - a0.bytes == 5 * (N // 2 + 4096)
    assert a1.in_flight == 0 and not agent._sub.inflight


async def test_posts_past_what_is_copied_inside_complete_through_the_ring(
        pair: Pair) -> None:
    """A prepared post(True) above the agent's inline threshold (the copy
    workers') and one of a failed access are reported as before: the first
    completes later, the second fails; the counts agree."""
    src, src_buf, dst_buf, remote = await _regions(pair)
    agent = pair.init
    a0 = agent.statistics()
    big = agent.prepare("write", src[0:N], remote[0:N])
    t = big.post(True)
    assert (await within(t)).nbytes == N
    assert dst_buf == src_buf
    a1 = agent.statistics()
    assert a1.transfers_completed - a0.transfers_completed == 1
    assert a1.bytes - a0.bytes == N and a1.in_flight == 0


def _nixl_pair(agents: Any, n: int = 1 << 16) -> tuple[Any, Any, Any, Any, int, int, Any]:
    """Two aioxfer.nixl agents a and b, each with n bytes of ctypes memory
    registered (xs, ys at addresses xa, ya; returned to keep them alive),
    and b's name as a knows it."""
    import ctypes

    a = agents()
    b = agents()
    xs, ys = (ctypes.c_char * n)(), (ctypes.c_char * n)()
    xa, ya = ctypes.addressof(xs), ctypes.addressof(ys)
    a.register_memory([(xa, n, 0, "")], "DRAM")
    b.register_memory([(ya, n, 0, "")], "DRAM")
    return a, b, xs, ys, xa, ya, a.add_remote_agent(b.get_agent_metadata())


def test_nixl_transfer_done_inside_is_awaitable_and_counted(agents: Any) -> None:
    """aioxfer.nixl: transfer() of a 4 KiB request answers DONE (copied
    inside, no record; from the second post on no Transfer made either:
    Prepared._post_repost), ``await handle`` still answers DONE, and the
    aioxfer agent's statistics count every post."""

    a, b, xs, ys, xa, ya, name = _nixl_pair(agents)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(xa, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(ya + 4096, 4096, 0)], "DRAM"), name)
    inner = a.agent._agent
    if inner.transports[0] != "shm":
        pytest.skip(f"not over shm: {inner.transports}")
    s0 = inner.statistics()
    k = 50
    for i in range(k):
        xs[0:4096] = bytes([i]) * 4096
        assert a.transfer(h) == "DONE"
        assert ys[4096:8192] == bytes([i]) * 4096
        assert a.check_xfer_state(h) == "DONE"
    assert not inner._sub.inflight

    async def awaited() -> str:
        return await h  # type: ignore[no-any-return]

    assert asyncio.run(awaited()) == "DONE"
    # The repost turns the cyclic GC off around its post and back on, and
    # leaves it off for a caller who turned it off.
    assert gc.isenabled()
    gc.disable()
    try:
        assert a.transfer(h) == "DONE"
        assert not gc.isenabled()
    finally:
        gc.enable()
    k += 1
    s1 = inner.statistics()
    assert s1.transfers_posted - s0.transfers_posted == k
    assert s1.transfers_completed - s0.transfers_completed == k
    assert s1.bytes - s0.bytes == k * 4096
    assert s1.in_flight == 0
    h.release()


def test_nixl_reposts_over_tcp_are_counted_and_move_the_data(
        agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over tcp a repost never completes inside: posted the usual way (its
    Transfer made first), completed through the ring; each post is counted
    once and moves its data."""

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    a, b, xs, ys, xa, ya, name = _nixl_pair(agents)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(xa, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(ya, 4096, 0)], "DRAM"), name)
    inner = a.agent._agent
    assert inner.transports == ("tcp",)
    s0 = inner.statistics()
    k = 30
    for i in range(k):
        xs[0:4096] = bytes([i + 1]) * 4096
        st = a.transfer(h)
        while st != "DONE":
            st = a.check_xfer_state(h)
        assert ys[0:4096] == bytes([i + 1]) * 4096
    s1 = inner.statistics()
    assert s1.transfers_completed - s0.transfers_completed == k
    assert s1.bytes - s0.bytes == k * 4096 and s1.in_flight == 0
    assert gc.isenabled()
    h.release()


def test_nixl_reposts_done_inside_then_peer_gone_raise_as_the_python_path(
        agents: Any) -> None:
    """After reposts that completed inside (no Transfer made), the peer
    closes: the compiled repost raises what the Python method's raises for
    a twin request (the engine's refusal, or the peer already lost), and a
    refused post leaves nothing in flight."""
    import time

    a, b, xs, ys, xa, ya, name = _nixl_pair(agents)
    inner = a.agent._agent
    if inner.transports[0] != "shm":
        pytest.skip(f"not over shm: {inner.transports}")

    def make() -> Any:
        return a.initialize_xfer("WRITE", a.get_xfer_descs([(xa, 4096, 0)], "DRAM"),
                                 a.get_xfer_descs([(ya, 4096, 0)], "DRAM"), name)

    h, h2 = make(), make()
    a.agent._xfers[h2._handle].prep = None  # the Python method's post
    for _ in range(5):
        assert a.transfer(h) == "DONE"
        assert a.transfer(h2) == "DONE"
    b.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert a.transfer(h2) == "DONE"
        except Exception as exc:
            py_exc = exc
            break
        assert time.monotonic() < deadline, "the closed peer was never seen"
        time.sleep(0.01)
    with pytest.raises(type(py_exc)):
        a.transfer(h)
    assert not inner._sub.inflight and inner.statistics().in_flight == 0

"""Progress modes (Agent(progress=...)) and copies on the posting thread
(Agent(inline_bytes=...), POST_ALONE): settings accepted and refused, bytes
exact through every mode and path, cancellation and peer death around an
inline copy. Functional only: the figures are in benchmarks/."""

from __future__ import annotations

import asyncio
import contextvars
import os
import select
import signal
import time

import numpy as np
import pytest
from conftest import pattern, transport_kwargs, wait_until, within

import aioxfer
from aioxfer import PeerLost, _cyx
from aioxfer.progress import PROGRESS_MODES

MiB = 1 << 20
MODES = list(PROGRESS_MODES)


async def idle(agent) -> None:
    await wait_until(lambda: agent.statistics().in_flight == 0
                     and agent.statistics().native_ops == 0, what="nothing in flight")


# --------------------------------------------------------------- settings


def test_calibration_and_engine_settings() -> None:
    cal = _cyx.calibration()
    assert set(cal) == {"wake_ns", "copy_mbps", "inline_bytes", "poll_us"}
    assert cal["wake_ns"] > 0 and cal["copy_mbps"] > 0
    ib = cal["inline_bytes"]
    if os.environ.get("AIOXFER_INLINE_BYTES"):
        assert ib > 0
    else:  # measured: a power of two, so start-ups on one machine agree
        assert 64 << 10 <= ib <= 16 << 20 and ib & (ib - 1) == 0
    assert 20 <= cal["poll_us"] <= 200
    assert _cyx.calibration() == cal  # measured once per process
    e = _cyx.Engine()
    try:
        assert e.inline_bytes == cal["inline_bytes"]
        assert e.poll_us == cal["poll_us"]
        assert e.wait(0) == 0 and e.wait(50) == 0  # nothing in flight: nothing comes
    finally:
        e.close()
    assert e.wait(10) == 0  # closed: 0, no error
    e = _cyx.Engine(inline_bytes=12345)
    try:
        assert e.inline_bytes == 12345
    finally:
        e.close()
    assert _cyx.POST_ALONE not in (_cyx.POST_DEFER, _cyx.POST_POLL)


@pytest.mark.parametrize("progress", MODES)
async def test_progress_modes_accepted(progress: str) -> None:
    agent = aioxfer.Agent("modes", progress=progress)
    try:
        assert agent.progress == progress
    finally:
        await agent.aclose()


@pytest.mark.parametrize("bad", ["", "busy", "SLEEP", None, 1])
async def test_progress_mode_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="progress"):
        aioxfer.Agent("modes", progress=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1 << 64, True, 1.5, "1"])
async def test_inline_bytes_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="inline_bytes"):
        aioxfer.Agent("inline", inline_bytes=bad)  # type: ignore[arg-type]


async def test_inline_bytes_settings() -> None:
    for given, want in ((None, _cyx.calibration()["inline_bytes"]), (0, 0), (4096, 4096),
                        (64 * MiB, 64 * MiB)):
        agent = aioxfer.Agent("inline", inline_bytes=given)
        try:
            assert agent.inline_bytes == want
        finally:
            await agent.aclose()


# --------------------------------------------------------------- data


async def _pair(make_agent, transport: str, both: bool = False, **kw):
    """An initiator made with kw (the target too, if both) and its peer."""
    tkw = transport_kwargs(transport)
    target = await make_agent("target", **tkw, **(kw if both else {}))
    init = await make_agent("init", **tkw, **kw)
    peer = await within(init.connect(target.address))
    return init, target, peer


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("progress", MODES)
async def test_lone_requests_through_each_mode(make_agent, transport: str,
                                               progress: str) -> None:
    # The target in the same mode: its tcp receivers poll for requests, or not.
    init, target, peer = await _pair(make_agent, transport, both=True, progress=progress)
    size = 4 * MiB
    dst = target.alloc(size, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    data = pattern(size, 31)
    src = init.register(data.copy(), name="src")
    back = init.register(np.zeros(size, dtype=np.uint8), name="back")
    # One at a time at sizes on both sides of any threshold, then a few in
    # flight together, then a lone notification.
    for n in (1, 4096, 64 << 10, 65 << 10, MiB, 3 * MiB, size):
        dst.numpy()[:n] = 0
        res = await within(init.write(src[0:n], remote[0:n]))
        assert res.nbytes == n and np.array_equal(dst.numpy()[:n], data[:n])
        back.numpy()[:n] = 0
        res = await within(init.read(back[0:n], remote[0:n]))
        assert res.nbytes == n and np.array_equal(back.numpy()[:n], data[:n])
    dst.numpy()[:] = 0
    ts = [init.write(src[i * MiB:(i + 1) * MiB], remote[i * MiB:(i + 1) * MiB])
          for i in range(4)]
    await within(asyncio.gather(*ts))
    assert np.array_equal(dst.numpy(), data)
    await within(peer.notify(b"ping"))
    note = await within(target.notifications.receive())
    assert note.payload == b"ping"
    await idle(init)


@pytest.mark.parametrize("inline", [0, 4096, 64 * MiB])
async def test_inline_copies_byte_exact(make_agent, inline: int) -> None:
    """The same transfers copied on the posting thread (64 MiB: all of them),
    on the workers (0: none) or split at a small threshold: the same bytes,
    for mapped (alloc) and cross-memory-attach (register) memory, with and
    without a notification bound to them."""
    init, target, peer = await _pair(make_agent, "shm", inline_bytes=inline)
    assert init.inline_bytes == inline
    size = 8 * MiB
    dsts = {"alloc": target.alloc(size, name="alloc"),
            "register": target.register(np.zeros(size, dtype=np.uint8), name="register")}
    await within(peer.refresh())
    data = pattern(size, 32)
    src = init.register(data.copy(), name="src")
    back = init.register(np.zeros(size, dtype=np.uint8), name="back")
    for name, dst in dsts.items():
        remote = peer.region(name)
        for off, n in ((0, 100), (4095, 4097), (12345, 3 * MiB + 7), (0, size)):
            dst.numpy()[:] = 0
            await within(init.write(src[off:off + n], remote[off:off + n]))
            want = np.zeros(size, dtype=np.uint8)
            want[off:off + n] = data[off:off + n]
            assert np.array_equal(dst.numpy(), want), (name, off, n)
            back.numpy()[:] = 0
            await within(init.read(back[off:off + n], remote[off:off + n]))
            assert np.array_equal(back.numpy()[off:off + n], data[off:off + n])
            assert not back.numpy()[:off].any() and not back.numpy()[off + n:].any()
        dst.numpy()[:] = 0
        await within(init.write(src[0:2 * MiB], remote[0:2 * MiB], notify=b"layer"))
        note = await within(target.notifications.receive())
        assert note.payload == b"layer"  # the data is there when the notification is
        assert np.array_equal(dst.numpy()[:2 * MiB], data[:2 * MiB])
    await idle(init)


@pytest.mark.parametrize("inline", [0, 4 * MiB])
async def test_flush_of_one_request_copies_inline(make_agent, inline: int) -> None:
    """agent.flush() of one request with nothing else in flight posts it as a
    lone await does: within inline_bytes, a same-host copy is done when flush
    returns (the NIXL pattern: post, then poll); with inline_bytes=0 it is
    still correct, and two pending requests are never copied inline."""
    init, target, peer = await _pair(make_agent, "shm", inline_bytes=inline)
    size = MiB
    dst = target.alloc(2 * size, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    data = pattern(2 * size, 33)
    src = init.register(data.copy(), name="src")
    t = init.write(src[0:size], remote[0:size])
    init.flush()
    if inline:
        assert t.done() and t.result().nbytes == size
        assert np.array_equal(dst.numpy()[:size], data[:size])
    await within(t)
    dst.numpy()[:] = 0
    ts = [init.write(src[0:size], remote[0:size]),
          init.write(src[size:], remote[size:])]
    init.flush()
    await within(asyncio.gather(*ts))
    assert np.array_equal(dst.numpy(), data)
    await idle(init)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_wait_then_poll_from_the_caller(make_agent, transport: str) -> None:
    """Agent.wait/poll_us, the seam an integration that waits from its own
    thread uses (aioxfer.nixl's tight poller): with the loop never run, wait()
    spins until the engine holds the completion, and poll() then finishes the
    transfer. Idle, wait(0) is a look that finds nothing."""
    init, target, peer = await _pair(make_agent, transport, progress="sleep")
    assert 20 <= init.poll_us <= 200
    dst = target.alloc(MiB, name="dst")
    await within(peer.refresh())
    await idle(init)
    assert init.wait(0) is False
    data = pattern(MiB, 34)
    src = init.register(data.copy(), name="src")
    t = init.write(src[0:65536], peer.region("dst")[0:65536])
    init.flush()
    deadline = time.monotonic() + 10
    while not t.done() and not init.wait(init.poll_us):  # no await: the loop never runs
        assert time.monotonic() < deadline, "no completion within 10 s"
    init.poll()
    assert t.done() and t.result().nbytes == 65536
    assert np.array_equal(dst.numpy()[:65536], data[:65536])
    await idle(init)


async def test_wait_polls_leaves_records_to_the_poll(make_agent) -> None:
    """Engine.wait_polls (the Poller's wait: AXF_WAIT_POLLS) for a caller that
    drains after it: what its spin saw is not signalled on the eventfd, and the
    drain that follows takes it, finishes the transfer and leaves the eventfd
    unreadable (no stale wake-up for the loop's reader)."""
    init, target, peer = await _pair(make_agent, "tcp", progress="sleep")
    size = MiB  # sent by the connection's thread: not done inside the flush
    dst = target.alloc(size, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    data = pattern(size, 36)
    src = init.register(data.copy(), name="src")
    engine = init._sub._engine
    fd = init.fileno()
    for _ in range(10):
        dst.numpy()[:] = 0
        t = init.write(src[0:size], remote[0:size])
        init.flush()
        deadline = time.monotonic() + 10
        while not t.done() and not engine.wait_polls(init.poll_us):  # the loop never runs
            assert time.monotonic() < deadline, "no completion within 10 s"
        init.poll()
        assert t.done() and t.result().nbytes == size
        assert select.select([fd], [], [], 0)[0] == []
        assert np.array_equal(dst.numpy(), data)
    await idle(init)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_done_callbacks_of_one_drain(make_agent, transport: str) -> None:
    """The done callbacks of transfers one drain completes (run as one loop
    handle on asyncio's loops: Engine.batch_wakeups) behave as asyncio's own:
    each runs once, in its own context, in the order added per transfer; one
    that raises goes to the loop's exception handler with its future, and
    the others still run."""
    init, target, peer = await _pair(make_agent, transport, progress="sleep")
    loop = asyncio.get_running_loop()
    assert init._sub._engine.batch_wakeups == isinstance(loop, asyncio.BaseEventLoop)
    dst = target.alloc(MiB, name="dst")
    await within(peer.refresh())
    src = init.register(pattern(MiB, 35), name="src")
    remote = peer.region("dst")
    var: contextvars.ContextVar[int] = contextvars.ContextVar("which")
    ran: list[tuple[int, int, int]] = []  # (transfer, callback, context value)
    caught: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: caught.append(context))
    try:
        n = 64
        ts = [init.write(src[i * 4096:(i + 1) * 4096], remote[i * 4096:(i + 1) * 4096])
              for i in range(n)]
        for i, t in enumerate(ts):
            ctx = contextvars.copy_context()
            ctx.run(var.set, 1000 + i)
            for k in range(2):
                def cb(fut: object, i: int = i, k: int = k) -> None:
                    ran.append((i, k, var.get()))
                    if i == 7 and k == 0:
                        raise ValueError("callback 7")
                t.add_done_callback(cb, context=ctx)
        await within(asyncio.gather(*ts))
        await wait_until(lambda: len(ran) == 2 * n, what="every callback ran")
    finally:
        loop.set_exception_handler(previous)
    assert sorted(ran) == [(i, k, 1000 + i) for i in range(n) for k in range(2)]
    for i in range(n):  # per transfer, in the order added
        assert ran.index((i, 0, 1000 + i)) < ran.index((i, 1, 1000 + i))
    assert len(caught) == 1
    assert isinstance(caught[0]["exception"], ValueError)
    assert caught[0].get("future", ts[7]) is ts[7]  # batched: named; a loop's own handle: not
    assert np.array_equal(dst.numpy()[:n * 4096], src.numpy()[:n * 4096])
    await idle(init)


async def _small_writes_until_a_timer(init, src, remote) -> tuple[bool, int]:
    """Awaits one 4 KiB write after another until a 10 ms timer fires (at
    most 10 s): whether it fired, and how many writes ran."""
    fired = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, fired.set)
    deadline = time.monotonic() + 10
    n = 0
    while not fired.is_set() and time.monotonic() < deadline:
        await init.write(src[0:4096], remote[0:4096])
        n += 1
    return fired.is_set(), n


async def test_inline_flood_lets_the_loop_run(make_agent) -> None:
    """Awaits that complete inside their post do not starve the loop: a timer
    fires while a coroutine writes one small transfer after another."""
    init, target, peer = await _pair(make_agent, "shm", inline_bytes=64 * MiB)
    target.alloc(MiB, name="dst")
    await within(peer.refresh())
    src = init.alloc(MiB, name="src")
    fired, n = await _small_writes_until_a_timer(init, src, peer.region("dst"))
    assert fired, f"the loop never ran during {n} inline writes"


@pytest.mark.parametrize("progress", MODES)
async def test_lone_tcp_requests_polled_in_their_await(make_agent, progress: str) -> None:
    """A small tcp request awaited alone is polled for inside its await
    (Poller.spin_alone) on asyncio's own loops, in the modes that poll; never
    in "sleep", nor on a loop whose ready queue is not visible (uvloop): there
    the loop's callback polls, as before. Bytes exact either way."""
    init, target, peer = await _pair(make_agent, "tcp", progress=progress)
    dst = target.alloc(MiB, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    data = pattern(64 << 10, 5)
    src = init.register(data.copy(), name="src")
    for i in range(200):
        n = (1, 4096, 64 << 10)[i % 3]
        dst.numpy()[:n] = 0
        res = await within(init.write(src[0:n], remote[0:n]))
        assert res.nbytes == n and np.array_equal(dst.numpy()[:n], data[:n])
    poller = init._poller
    if progress == "sleep":
        assert poller is None
        return
    assert poller is not None
    tried = poller.alone_hits + poller.alone_misses
    if isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop):
        assert tried > 0  # how many found it within the bound is timing's
    else:
        assert tried == 0
    await idle(init)


# asyncio's loop only: the await's poll needs the loop's ready queue, which
# uvloop does not show (there the loop's callback polls every size, as
# test_lone_tcp_requests_polled_in_their_await checks); was a uvloop case
# that only skipped.
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_lone_tcp_requests_up_to_spin_alone_max_are_polled(make_agent) -> None:
    """A lone awaited tcp request up to SPIN_ALONE_MAX (1 MiB: the loop's
    wake-up for it is a fifth of its time) is polled for in its await; a
    larger one is waited for by the loop. Bytes exact either way."""
    from aioxfer.submission import SPIN_ALONE_MAX

    assert isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop)
    # Both posted eagerly, alone (within inline_bytes, whatever the machine
    # calibrates): only the size decides the poll.
    init, target, peer = await _pair(make_agent, "tcp", progress="adaptive",
                                     inline_bytes=4 * SPIN_ALONE_MAX)
    dst = target.alloc(2 * SPIN_ALONE_MAX, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    data = pattern(2 * SPIN_ALONE_MAX, 7)
    src = init.register(data.copy(), name="src")
    poller = init._poller
    assert poller is not None
    for n, polled in ((SPIN_ALONE_MAX, True), (SPIN_ALONE_MAX + 4096, False)):
        before = poller.alone_hits + poller.alone_misses
        # Several: an await polls only for a request still in flight after
        # its post, with nothing else ready on the loop.
        for _ in range(40):
            dst.numpy()[:n] = 0
            res = await within(init.write(src[0:n], remote[0:n]))
            assert res.nbytes == n and np.array_equal(dst.numpy()[:n], data[:n])
        tried = poller.alone_hits + poller.alone_misses - before
        assert (tried > 0) == polled, (n, tried)
    await idle(init)


@pytest.mark.parametrize("progress", ["adaptive", "poll"])
async def test_lone_tcp_awaits_let_the_loop_run(make_agent, progress: str) -> None:
    """Polling inside awaits does not starve the loop: a timer fires and
    another task runs while a coroutine awaits one small tcp write after
    another (ALONE_SPAN_US, then the await suspends once)."""
    init, target, peer = await _pair(make_agent, "tcp", progress=progress)
    target.alloc(MiB, name="dst")
    await within(peer.refresh())
    src = init.alloc(MiB, name="src")
    remote = peer.region("dst")
    fired, n = await _small_writes_until_a_timer(init, src, remote)
    assert fired, f"the loop never ran its timer during {n} awaited tcp writes"
    ticks = 0
    done = False

    async def other() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    poller = init._poller
    assert poller is not None
    before = (poller.alone_hits, poller.alone_misses)
    for _ in range(50):
        await init.write(src[0:4096], remote[0:4096])
    done = True
    await within(task)
    assert ticks > 0
    # With another task ready, the await never polls: the loop's callback does.
    assert (poller.alone_hits, poller.alone_misses) == before
    await idle(init)


async def test_cancel_around_inline_copy(make_agent) -> None:
    init, target, peer = await _pair(make_agent, "shm", inline_bytes=64 * MiB)
    dst = target.alloc(4 * MiB, name="dst")
    await within(peer.refresh())
    src = init.register(pattern(4 * MiB, 33), name="src")
    remote = peer.region("dst")
    # Cancelled before its await: never posted, nothing copied.
    t = init.write(src[0:4 * MiB], remote[0:4 * MiB])
    assert t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await asyncio.sleep(0)
    assert not dst.numpy().any()
    # A task awaiting a lone inline copy, cancelled before it runs, and one
    # cancelled right after its post completed: neither leaks nor breaks the
    # next transfer.
    task = asyncio.ensure_future(init.write(src[0:4 * MiB], remote[0:4 * MiB]))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    t = init.write(src[0:4 * MiB], remote[0:4 * MiB])
    task = asyncio.ensure_future(t)
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    res = await within(init.write(src[0:4 * MiB], remote[0:4 * MiB]))
    assert res.nbytes == 4 * MiB
    assert np.array_equal(dst.numpy(), src.numpy())
    await idle(init)


@pytest.mark.parametrize("region", ["pool", "user"])
async def test_peer_death_during_inline_copies(make_agent, remote_agent, region: str) -> None:
    """Lone writes copied on the posting thread while the peer is killed:
    each completes or fails PeerLost, within the bound, and the agent stays
    usable (pool: a mapped memfd; user: cross-memory attach)."""
    ra = await remote_agent(size=16 * MiB, peer_timeout=1.0, keepalive=0.2)
    init = await make_agent("init", peer_timeout=1.0, keepalive=0.2, inline_bytes=64 * MiB,
                            **transport_kwargs("shm"))
    peer = await within(init.connect(ra.address))
    assert peer.path == "shm"
    src = init.register(pattern(16 * MiB, 34), name="src")
    remote = peer.region(region)
    await within(init.write(src[0:16 * MiB], remote[0:16 * MiB]))
    killed = False
    outcomes: list[object] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        if not killed and time.monotonic() - t0 > 0.05:
            ra.kill(signal.SIGKILL)
            killed = True
            killed_at = time.monotonic()
        try:
            outcomes.append(await within(init.write(src[0:16 * MiB], remote[0:16 * MiB])))
        except PeerLost as exc:
            outcomes.append(exc)
            break
        await asyncio.sleep(0.01)
    assert killed and isinstance(outcomes[-1], PeerLost), outcomes[-3:]
    assert time.monotonic() - killed_at < 6
    await wait_until(lambda: peer.lost, 5, what="peer.lost")
    await idle(init)
    ra.terminate()


def test_alone_bound_bounds_a_lone_await_by_what_the_peer_takes() -> None:
    """spin_alone's bound (Poller.alone_bound, a budget of 43 us): ALONE_LATENCIES
    times the peer's latency average for a small transfer; for a large one (BANDWIDTH_MIN or more),
    twice its bytes at the peer's bandwidth average when that is longer (a
    1 MiB tcp request polled only for the small ones' latency ran out before
    most completed); never under the floor, never over ALONE_MAX_US."""
    from types import SimpleNamespace

    from aioxfer.progress import ALONE_LATENCIES, ALONE_MAX_US, Poller
    from aioxfer.stats import BANDWIDTH_MIN

    class Sub:
        closed = False
        inflight: dict[int, object] = {}

        def drain(self) -> None:
            pass

    def lone(nbytes: int, latency: float, bandwidth: float) -> SimpleNamespace:
        counters = SimpleNamespace(latency=latency, bandwidth=bandwidth)
        return SimpleNamespace(nbytes=nbytes, peer=SimpleNamespace(_counters=counters))

    loop = asyncio.new_event_loop()
    poller = Poller(Sub(), lambda us: 0, loop, "adaptive", 43)
    loop.close()

    bound = poller.alone_bound  # the floor: its budget, 43 us
    assert bound(lone(4096, 5e-6, 4e9)) == 43  # 5 x 5 us < floor
    assert bound(lone(4096, 30e-6, 4e9)) == int(30 * ALONE_LATENCIES) == 150
    # a small transfer is never sized by bandwidth, however slow the peer
    assert bound(lone(BANDWIDTH_MIN - 1, 5e-6, 1e6)) == 43
    # 1 MiB at 4 GB/s: 2 x 262 us
    assert bound(lone(1 << 20, 20e-6, 4e9)) == int((1 << 20) * 2e6 / 4e9)
    # the latency average wins when longer; no bandwidth measured yet: latency
    assert bound(lone(1 << 20, 160e-6, 4e9)) == 800
    assert bound(lone(1 << 20, 5e-6, 0.0)) == 43
    # capped
    assert bound(lone(1 << 20, 20e-6, 1e9)) == ALONE_MAX_US
    assert bound(lone(4096, 1.0, 4e9)) == ALONE_MAX_US

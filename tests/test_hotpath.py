"""The compiled pieces of the per-transfer path (_cyx.FutureMaker,
_cyx.eager_await, Engine.drain's slot reads) on the types they take fast,
and on types they must take the generic way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import pair_64k

import aioxfer
from aioxfer import _cyx
from aioxfer.stats import BANDWIDTH_MIN, ESTIMATE_WEIGHT, PeerCounters
from aioxfer.transfer import Transfer


class _Host:
    def __init__(self) -> None:
        self.eagers: list[Any] = []

    def eager(self, t: Any) -> None:
        self.eagers.append(t)
        t._posted = True
        t.set_result("done")


class _Slotted(asyncio.Future[Any]):
    __slots__ = ("_host", "_posted", "peer", "nbytes", "_t0", "_admitted", "_path", "x")


class _Plain(asyncio.Future[Any]):
    """Fields in a __dict__: every compiled read takes the generic way."""


@pytest.mark.parametrize("cls", [_Slotted, _Plain])
async def test_eager_await_posts_once_then_awaits_the_future(cls: type[Any]) -> None:
    loop = asyncio.get_running_loop()
    host = _Host()
    t = cls(loop=loop)
    t._host, t._posted = host, False
    cls.__await__ = _cyx.eager_await  # type: ignore[method-assign]
    try:
        assert await t == "done"
        assert host.eagers == [t]
        assert await t == "done"  # posted now: eager is not asked again
        assert host.eagers == [t]
        u = cls(loop=loop)  # posted already: awaited as a plain future
        u._host, u._posted = host, True
        loop.call_soon(u.set_result, 5)
        assert await u == 5 and host.eagers == [t]
        with pytest.raises(TypeError):
            _cyx.eager_await(object())
    finally:
        del cls.__await__


def test_future_maker_refuses_what_it_cannot_set() -> None:
    loop = asyncio.new_event_loop()
    try:
        given = ("_host", "_posted", "peer", "nbytes", "x")
        m = _cyx.FutureMaker(_Slotted, {"loop": loop}, given, "_t0", {"_admitted": False})
        f = m.make(1, 2, 3, 4, 5)
        assert (f._host, f._posted, f.peer, f.nbytes, f.x, f._admitted) == (1, 2, 3, 4, 5, False)
        assert type(f) is _Slotted and f.get_loop() is loop and not f.done()
        with pytest.raises(TypeError):  # no slots
            _cyx.FutureMaker(_Plain, {"loop": loop}, given, "_t0", {})
        with pytest.raises(TypeError):  # not a future
            _cyx.FutureMaker(PeerCounters, {"loop": loop}, given, "_t0", {})
        with pytest.raises(ValueError):  # five given fields
            _cyx.FutureMaker(_Slotted, {"loop": loop}, given[:4], "_t0", {})
    finally:
        loop.close()


class _Peer:
    __slots__ = ("path", "_counters")

    def __init__(self) -> None:
        self.path = "shm"
        self._counters = PeerCounters(inflight=2, inflight_bytes=2 * 4096)


@contextlib.contextmanager
def _self_shm_engine() -> Iterator[tuple[Any, Any, bytearray, bytearray, int, int, int, Any]]:
    """An engine with an shm endpoint to itself, an 8 KiB source and
    destination: (engine, loop, dst, src, src rid, dst rid, dst key, ep);
    shut down, its regions released, and closed after."""
    e = _cyx.Engine()
    loop = asyncio.new_event_loop()
    try:
        dst = bytearray(2 * 4096)
        src = bytearray(os.urandom(2 * 4096))
        drid, dkey, daddr, dlen, dacc = e.register(dst)
        srid = e.register(src)[0]
        ep = e.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        e.endpoint_import(ep, drid, dkey, dlen, dacc, daddr, -1)
        yield e, loop, dst, src, srid, drid, dkey, ep
    finally:
        loop.close()
        e.shutdown()
        for _ in range(1000):  # the regions' release records
            e.poll()
            if e.stats()["regions"] == 0 and e.stats()["ops"] == 0:
                break
            e.wait(10_000)
        e.close()


def test_drain_results_carry_python_ints() -> None:
    """A transfer whose nbytes is not an int (a numpy integer) still gets a
    TransferResult whose nbytes is an int, as for one whose nbytes is."""
    with _self_shm_engine() as (e, loop, dst, src, srid, drid, dkey, ep):
        peer = _Peer()
        ts = []
        for nbytes in (4096, np.uint64(4096)):
            t = _Slotted(loop=loop)
            t.peer, t.nbytes, t._admitted, t._path, t._posted = peer, nbytes, False, None, False
            t._t0 = 0.0
            ts.append(t)
        items = [(ep, _cyx.OP_WRITE, (srid, i * 4096, drid, dkey, i * 4096, 4096), None, i + 1)
                 for i in range(2)]
        inflight = {1: ts[0], 2: ts[1]}
        statuses, n, completed, nbytes = e.post_drain(
            items, list(ts), inflight, None, None, aioxfer.TransferResult,
            ESTIMATE_WEIGHT, BANDWIDTH_MIN)
        if n < 2:  # not copied inside the post: the records come later
            while completed < 2:
                e.wait(100_000)
                completed += e.drain(inflight, None, None, aioxfer.TransferResult,
                                     ESTIMATE_WEIGHT, BANDWIDTH_MIN)[1]
        assert statuses is None and inflight == {} and dst == src
        assert all(t._posted is True for t in ts)
        for t in ts:
            r = t.result()
            assert type(r.nbytes) is int and r.nbytes == 4096 and r.path == "shm"
        c = peer._counters
        assert (c.inflight, c.inflight_bytes, c.completed, c.bytes) == (0, 0, 2, 2 * 4096)


def test_post_drain_from_inside_a_drain() -> None:
    """A drain's callback that posts again (post_drain inside a drain): the
    inner post neither drains (the engine's ring is in use) nor leaves its
    records quiet (a same-host 4 KiB copy alone is done inside the post): the
    transfer completes at the next drain, never stuck."""
    with _self_shm_engine() as (e, loop, dst, src, srid, drid, dkey, ep):
        peer = _Peer()
        t = _Slotted(loop=loop)
        t.peer, t.nbytes, t._admitted, t._path, t._posted = peer, 4096, False, None, False
        t._t0 = 0.0
        inflight = {2: t}
        inner: list[Any] = []

        def slow(kind: int, status: int, rid: int, *rest: Any) -> None:
            # the scratch region's release record comes here: post now
            if kind == _cyx.CQ_REGION_FREED and not inner:
                item = (ep, _cyx.OP_WRITE, (srid, 4096, drid, dkey, 4096, 4096), None, 2)
                inner.append(e.post_drain([item], [t], inflight, slow, None,
                                          aioxfer.TransferResult, ESTIMATE_WEIGHT,
                                          BANDWIDTH_MIN, alone=True))

        scratch = bytearray(4096)
        e.deregister(e.register(scratch)[0])
        for _ in range(1000):  # its release record, drained
            e.drain({}, slow, None, aioxfer.TransferResult, ESTIMATE_WEIGHT, BANDWIDTH_MIN)
            if inner:
                break
            e.wait(10_000)
        assert inner == [(None, 0, 0, 0)] and t._posted is True
        for _ in range(1000):  # transfer 2: signalled, taken by a later drain
            if t.done():
                break
            assert e.wait(100_000) >= 0
            e.drain(inflight, slow, None, aioxfer.TransferResult, ESTIMATE_WEIGHT,
                    BANDWIDTH_MIN)
        assert t.done() and t.result().nbytes == 4096 and dst[4096:] == src[4096:]


def _numpy_coalesce(descs: Any) -> tuple[Any, Any]:
    """descriptors.coalesce as it was written in numpy (the reference)."""
    if isinstance(descs, tuple) or len(descs) < 2:
        return descs, None
    a, b = descs[:-1], descs[1:]
    joins = (
        (b[:, 0] == a[:, 0])
        & (b[:, 2] == a[:, 2])
        & (b[:, 3] == a[:, 3])
        & (b[:, 1] == a[:, 1] + a[:, 5])
        & (b[:, 4] == a[:, 4] + a[:, 5])
    )
    if not joins.any():
        return descs, None
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = descs[starts]
    merged[:, 5] = np.add.reduceat(descs[:, 5], starts)
    return merged, starts


def test_compiled_coalesce_agrees_with_numpy() -> None:
    from aioxfer import descriptors

    assert descriptors.coalesce is _cyx.coalesce
    rng = np.random.default_rng(5)
    one = (1, 0, 2, 3, 0, 4096)
    assert _cyx.coalesce(one) == (one, None)
    for n in (1, 2, 3, 17, 256):
        for _ in range(50):
            d = np.empty((n, 6), dtype=np.uint64)
            lens = rng.choice([1, 4096, 16384], n).astype(np.uint64)
            d[:, 5] = lens
            # Runs: each row follows the previous one on both sides, or not.
            follow = rng.random(n) < 0.6
            lo = np.cumsum(np.where(follow, 0, rng.integers(1, 3, n) * 65536)) + np.cumsum(lens)
            d[:, 1] = lo - lens
            d[:, 4] = d[:, 1] + 8192 * (rng.random(n) < 0.1)  # the far side breaks a run
            d[:, 0] = 1 + (rng.random(n) < 0.05)  # another local region
            d[:, 2] = 2
            d[:, 3] = 3 + (rng.random(n) < 0.05)  # another key
            if n > 1 and rng.random() < 0.2:
                d[0, 1] = d[0, 4] = np.uint64(2**64 - 4096)  # a sum past 2**64 wraps in both
                d[0, 5] = 4096
            want, wstarts = _numpy_coalesce(d)
            got, gstarts = _cyx.coalesce(d)
            if wstarts is None:
                assert gstarts is None and got is d
            else:
                assert gstarts is not None and gstarts.dtype == np.intp
                assert got.dtype == np.uint64 and got.flags.c_contiguous
                assert np.array_equal(got, want) and np.array_equal(gstarts, wstarts)
    with pytest.raises(ValueError):
        _cyx.coalesce(np.zeros((3, 5), dtype=np.uint64))


async def test_compiled_submit_does_what_the_python_one_does(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Submission.submit (_cyx.Submitter) and the Python method it stands
    for (_submit_py): the same transfer, counts, batch item and flush."""
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    assert sub._make is not None and peer._sched is None and peer._lost is False
    c = peer._counters
    deltas = []
    for submit in (sub.submit, sub._submit_py):
        before = (sub.posted, len(sub.inflight), c.posted, c.inflight, c.inflight_bytes)
        descs = (local.rid, 0, remote.rid, remote.key, 0, 4096)
        t = submit(peer, _cyx.OP_WRITE, descs, None, 4096, "write", 0)
        after = (sub.posted, len(sub.inflight), c.posted, c.inflight, c.inflight_bytes)
        deltas.append(tuple(a - b for a, b in zip(after, before, strict=True)))
        assert type(t) is Transfer and t.get_loop() is asyncio.get_running_loop()
        assert (t.req_id, t.op, t.peer, t.nbytes) == (sub.posted, "write", peer, 4096)
        assert (t._posted, t._admitted, t._queued_item, t._path) == (False, False, None, None)
        assert sub.inflight[t.req_id] is t and sub._pending_t[-1] is t
        assert sub._pending[-1] == (peer._ep, _cyx.OP_WRITE, descs, None, t.req_id)
        assert sub._flush_scheduled is True
        r = await t
        assert r.nbytes == 4096 and t.req_id not in sub.inflight
    assert deltas[0] == deltas[1] == (1, 1, 1, 1, 4096)
    assert (c.inflight, c.inflight_bytes) == (0, 0)


async def test_compiled_eager_does_what_the_python_one_does(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Submission.eager (_cyx.Submitter.eager) and _eager_py: an awaited
    lone request posted, copied and completed inside the call, the same
    counts; past the streak, neither posts."""
    from aioxfer import submission

    init, peer, local, remote = await pair_64k(make_agent)
    local.numpy()[:] = 7
    sub = init._sub
    await asyncio.sleep(0)  # the loop ran: no streak
    deltas = []
    for eager in (sub.eager, sub._eager_py):
        before = (sub.completed, sub.bytes, sub._eager_streak)
        t = init.write(local[0:4096], remote[0:4096])
        eager(t)
        assert t.done() and t.result().nbytes == 4096 and t._posted is True
        assert not sub._pending and not sub._pending_t and not sub.inflight
        after = (sub.completed, sub.bytes, sub._eager_streak)
        deltas.append(tuple(a - b for a, b in zip(after, before, strict=True)))
        # Past the streak: left for the loop's flush.
        sub._eager_streak = submission.EAGER_STREAK
        t = init.write(local[0:4096], remote[4096:8192])
        eager(t)
        assert not t.done() and t._posted is False and sub._pending_t == [t]
        assert (await t).nbytes == 4096
        sub._eager_streak = 0
    assert deltas[0] == deltas[1] == (1, 4096, 1)


async def test_compiled_flush_does_what_the_python_one_does(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Submission.flush (_cyx.Submitter.flush) and _flush_now: a lone
    request posted alone (copied and completed inside the call), two
    requests posted together, the same counts; nothing pending, nothing
    done."""
    init, peer, local, remote = await pair_64k(make_agent)
    local.numpy()[:] = 9
    sub = init._sub
    deltas = []
    for flush in (sub.flush, sub._flush_now):
        before = (sub.completed, sub.bytes)
        t = init.write(local[0:4096], remote[0:4096])
        flush()
        assert t.done() and t.result().nbytes == 4096 and t._posted is True
        assert not sub._pending and not sub._pending_t and not sub.inflight
        two = [init.write(local[0:4096], remote[i:i + 4096]) for i in (8192, 16384)]
        flush()
        assert all(t._posted for t in two) and not sub._pending_t
        assert [(await t).nbytes for t in two] == [4096, 4096]
        flush()  # nothing pending
        deltas.append((sub.completed - before[0], sub.bytes - before[1]))
    assert deltas[0] == deltas[1] == (3, 3 * 4096)


async def test_compiled_drain_does_what_the_python_one_does(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Submission.drain (_cyx.Submitter.drain) and _drain_py: the same
    transfers completed with their results, the same agent and peer counts."""
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    deltas = []
    for drain in (sub.drain, sub._drain_py):
        before = (sub.completed, sub.bytes, peer._counters.completed)
        ts = [init.write(local[0:4096], remote[i:i + 4096]) for i in (0, 8192, 16384)]
        # Posted by hand (post_pending would drain them itself), then seen.
        items, sub._pending, sub._pending_t = sub._pending, [], []
        assert sub._engine.post_many(items) == [0, 0, 0]
        for t in ts:
            t._posted = True
        for _ in range(100):
            if not sub.inflight:
                break
            sub._engine.wait(100_000)
            drain()
        assert [t.result().nbytes for t in ts] == [4096] * 3
        deltas.append((sub.completed - before[0], sub.bytes - before[1],
                       peer._counters.completed - before[2]))
    assert deltas[0] == deltas[1] == (3, 3 * 4096, 3)


async def test_prepared_post_now_with_nothing_batched_skips_the_batch(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Prepared.post(now=True) (aioxfer.nixl's repost) with nothing batched
    posts its request on its own: no batch item, no flush scheduled, the
    same transfer and counts as a write flushed at once; with something
    batched, the batch goes first, both in one post (as flush does)."""
    init, peer, local, remote = await pair_64k(make_agent)
    local.numpy()[:] = 7
    sub = init._sub
    p = init.prepare("write", local[0:4096], remote[0:4096])
    counts = []
    for post in (lambda: p.post(True), lambda: (init.write(local[0:4096], remote[0:4096]),
                                               sub.flush())[0]):
        sub._flush()  # (whatever an earlier submit scheduled: run now)
        before = (sub.posted, sub.completed, sub.bytes, peer._counters.completed)
        t = post()
        assert t.done() and t.result().nbytes == 4096 and t._posted is True
        assert not sub._pending and not sub._pending_t and not sub.inflight
        counts.append((sub.posted - before[0], sub.completed - before[1],
                       sub.bytes - before[2], peer._counters.completed - before[3],
                       sub._flush_scheduled))
    # The write's submit scheduled the loop's flush; the lone post did not.
    assert counts == [(1, 1, 4096, 1, False), (1, 1, 4096, 1, True)]
    batched = init.write(local[0:4096], remote[8192:12288])
    t = p.post(True)
    assert batched._posted is True and t._posted is True and not sub._pending_t
    assert [(await x).nbytes for x in (batched, t)] == [4096, 4096]


async def test_compiled_write_and_read_do_what_the_python_ones_do(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Agent.write/read's usual case (_cyx.Poster) and the Python methods it
    stands for: the same transfer, batch item and bytes moved; every other
    shape or a failing check goes to the Python method (the same errors)."""
    init, peer, local, remote = await pair_64k(make_agent)
    assert init.write.__self__ is init.read.__self__  # the Poster's, bound per agent
    assert type(init.write.__self__) is _cyx.Poster
    sub = init._sub
    local.numpy()[:] = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    items = []
    for write in (init.write, aioxfer.Agent.write.__get__(init)):
        t = write(local[0:4096], remote[8192:12288], priority=3)
        items.append((sub._pending[-1], t.op, t.nbytes, t.peer))
        assert (await t).nbytes == 4096
    for read in (init.read, aioxfer.Agent.read.__get__(init)):
        t = read(local[20000:24096], remote[8192:12288])
        items.append((sub._pending[-1], t.op, t.nbytes, t.peer))
        assert (await t).nbytes == 4096
    assert items[0][1:] == items[1][1:] == ("write", 4096, peer)
    assert items[2][1:] == items[3][1:] == ("read", 4096, peer)
    w = (peer._ep, _cyx.OP_WRITE, (local.rid, 0, remote.rid, remote.key, 8192, 4096), None)
    r = (peer._ep, _cyx.OP_READ, (local.rid, 20000, remote.rid, remote.key, 8192, 4096), None)
    assert [i[0][:4] for i in items] == [w, w, r, r]
    assert bytes(local.memoryview[20000:24096]) == bytes(local.memoryview[0:4096])
    # The usual case runs no Python frame (the Python method not called).
    frames: list[str] = []

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            frames.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        tw = init.write(local[0:4096], remote[0:4096])
        tr = init.read(local[0:4096], remote[4096:8192])
    finally:
        sys.setprofile(None)
    assert "write" not in frames and "read" not in frames, frames
    await tw
    await tr
    # Not the usual case: the Python method, with its errors.
    t = init.write(local[0:16], remote[0:16], notify=b"n")
    assert (await t).nbytes == 16
    assert (await init.write([local[0:8]], [remote[0:8]])).nbytes == 8
    for call in (lambda: init.write(local[0:8], remote[0:16]),
                 lambda: init.read(local[0:8], remote[0:16])):
        with pytest.raises(ValueError):
            call()
    await init.aclose()
    with pytest.raises(aioxfer.ClosedResourceError):
        init.write(local[0:8], remote[0:8])


async def test_subclass_write_is_its_own() -> None:
    """An Agent subclass defining write or read keeps its own (no Poster)."""

    class Mine(aioxfer.Agent):
        def write(self, *a: Any, **kw: Any) -> Any:
            return "mine"

    async with Mine("sub") as a:
        assert a.write(1, 2) == "mine"
        assert a.read.__func__ is aioxfer.Agent.read  # type: ignore[attr-defined]


async def test_compiled_submit_calls_a_replaced_make(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Submitter calls a FutureMaker's make directly (no method call), and
    whatever else Submission._make is set to as it is: a replaced one is
    called, the FutureMaker's again once it is back."""
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    own = sub._make
    calls: list[int] = []

    def make(*args: Any) -> Any:
        calls.append(args[1])
        return own(*args)

    for m in (own, make, own):
        sub._make = m
        t = init.write(local[0:4096], remote[0:4096])
        assert (await t).nbytes == 4096
    assert calls == [sub.posted - 1]

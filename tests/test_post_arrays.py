"""Agent.post_arrays: a READ/WRITE from offset arrays of one local Region and
one RemoteRegion (the KV store's layer path), with the checks of read/write:
bounds on both sides (here, and again in the engine), regions alive and
registered, the peer's permissions, and the same Transfer (cancel, errors,
statistics). Over every transport."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import Pair, pattern, wait_until, within

from aioxfer import AccessDenied, ClosedResourceError, RemoteRegion, XferError

MiB = 1 << 20
PIECE = 4096


async def idle(agent) -> None:
    await wait_until(lambda: agent.statistics().in_flight == 0
                     and agent.statistics().native_ops == 0, what="nothing in flight")


def scattered(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n pieces: local piece i at i, remote piece i at n - 1 - i (nothing to merge)."""
    lo = np.arange(n, dtype=np.uint64) * np.uint64(PIECE)
    return lo, lo[::-1].copy()


async def test_write_then_read_scattered(pair: Pair) -> None:
    n = 64
    dst = pair.target.alloc(n * PIECE, name="dst")
    data = pattern(n * PIECE, 31)
    src = pair.init.register(data)
    remote = await pair.remote("dst")
    lo, ro = scattered(n)
    before = pair.init.statistics()
    t = pair.init.post_arrays("write", src, remote, lo, ro, PIECE)
    res = await within(t)
    assert res.nbytes == n * PIECE
    got = dst.numpy().reshape(n, PIECE)
    assert np.array_equal(got[::-1], data.reshape(n, PIECE))
    # back, into another local region: lists and signed arrays are taken too
    back = pair.init.alloc(n * PIECE)
    t = pair.init.post_arrays("read", back, remote, lo.tolist(), ro.astype(np.int64), PIECE)
    assert (await within(t)).nbytes == n * PIECE
    assert np.array_equal(back.numpy(), data)
    after = pair.init.statistics()
    assert after.transfers_posted - before.transfers_posted == 2
    assert after.transfers_completed - before.transfers_completed == 2
    assert after.bytes - before.bytes == 2 * n * PIECE
    await idle(pair.init)


async def test_bounds_and_shapes_refused_at_post(pair: Pair) -> None:
    size = 16 * PIECE
    dst = pair.target.alloc(size, name="dst")
    dst.numpy()[:] = 0x5A
    src = pair.init.alloc(2 * size)
    remote = await pair.remote("dst")
    posted = pair.init.statistics().transfers_posted
    u = np.uint64
    out_of_bounds = {
        "remote past the end": (np.array([0], u), np.array([size - 100], u), PIECE),
        "local past the end": (np.array([2 * size - 100], u), np.array([0], u), PIECE),
        "one of many": (np.arange(4, dtype=u) * u(PIECE), np.array([0, PIECE, size, 0], u),
                        PIECE),
        "wrapping offset": (np.array([0], u), np.array([2**64 - 8], u), 16),
        "longer than the region": (np.array([0], u), np.array([0], u), 2 * size + 1),
    }
    for what, (lo, ro, length) in out_of_bounds.items():
        for op in ("write", "read"):
            with pytest.raises(IndexError, match="out of bounds"):
                pair.init.post_arrays(op, src, remote, lo, ro, length)
                pytest.fail(f"{what}: {op} was posted")
    one = np.zeros(1, dtype=u)
    bad = {
        ValueError: [
            (("copy", src, remote, one, one, 16), "op"),
            (("write", src, remote, one, one, 0), "length"),
            (("write", src, remote, np.zeros(0, u), np.zeros(0, u), 16), "no segments"),
            (("write", src, remote, [], [], 16), "no segments"),
            (("write", src, remote, np.zeros(2, u), one, 16), "offsets"),
            (("write", src, remote, np.array([-1]), one, 16), "negative"),
        ],
        TypeError: [
            (("write", src[0:16], remote, one, one, 16), "Region"),
            (("write", src, remote[0:16], one, one, 16), "Region"),
            (("write", src, remote, np.zeros((1, 1), u), one, 16), "1-D"),
            (("write", src, remote, one, np.zeros(1), 16), "integers"),
        ],
    }
    for exc, cases in bad.items():
        for args, match in cases:
            with pytest.raises(exc, match=match):
                pair.init.post_arrays(*args)
    assert pair.init.statistics().transfers_posted == posted  # nothing reached the engine
    assert (dst.numpy() == 0x5A).all()
    # The engine checks bounds again: a handle claiming more than the peer
    # registered passes the check here and is refused there, memory untouched.
    big = RemoteRegion(remote.peer, remote.name, remote.rid, remote.key, 4 * size,
                       remote.access, remote.addr, remote.memfd)
    with pytest.raises(AccessDenied):
        await within(pair.init.post_arrays("write", src, big, one, np.array([size], u), PIECE))
    assert (dst.numpy() == 0x5A).all()
    # The connection stays usable.
    res = await within(pair.init.post_arrays("write", src, remote, one, one, size))
    assert res.nbytes == size
    await idle(pair.init)


async def test_permissions_checked(pair: Pair) -> None:
    ro = pair.target.register(bytes(PIECE), name="ro")
    src = pair.init.alloc(PIECE)
    src.numpy()[:] = 7
    remote = await pair.remote("ro")
    zero = np.zeros(1, dtype=np.uint64)
    with pytest.raises(AccessDenied):
        await within(pair.init.post_arrays("write", src, remote, zero, zero, PIECE))
    assert bytes(ro.memoryview) == bytes(PIECE)
    await within(pair.init.post_arrays("read", src, remote, zero, zero, PIECE))
    assert not src.numpy().any()


async def test_deregistered_regions_fail(pair: Pair) -> None:
    dst = pair.target.alloc(MiB, name="dst")
    src = pair.init.alloc(MiB)
    remote = await pair.remote("dst")
    zero = np.zeros(1, dtype=np.uint64)
    # local side deregistered: refused at post
    gone = pair.init.alloc(MiB)
    pair.init.deregister(gone)
    for op in ("write", "read"):
        with pytest.raises(ClosedResourceError):
            pair.init.post_arrays(op, gone, remote, zero, zero, PIECE)
    # remote side deregistered: a stale handle is refused by the engine...
    pair.target.deregister(dst)
    await wait_until(lambda: pair.target.statistics().pinned_regions == 0, what="unpinned")
    with pytest.raises(XferError):
        await within(pair.init.post_arrays("write", src, remote, zero, zero, PIECE))
    # ...and, once the peer's metadata says so, here at post
    await within(pair.peer.refresh())
    assert remote.gone
    with pytest.raises(AccessDenied, match="deregistered"):
        pair.init.post_arrays("write", src, remote, zero, zero, PIECE)
    await idle(pair.init)


async def test_cancel_and_closed_agent(pair: Pair) -> None:
    size = 64 * MiB
    pieces = 16
    dst = pair.target.alloc(size, name="dst")
    src = pair.init.alloc(size)
    src.numpy()[:] = pattern(size, 32)
    remote = await pair.remote("dst")
    offs = np.arange(pieces, dtype=np.uint64) * np.uint64(size // pieces)
    # cancelled before it reached the engine, then once in flight
    t = pair.init.post_arrays("write", src, remote, offs, offs, size // pieces)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(t)
    t = pair.init.post_arrays("write", src, remote, offs, offs, size // pieces)
    pair.init.flush()
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(t)
    await idle(pair.init)
    # a task awaiting one, cancelled: the transfer is cancelled with it
    t = pair.init.post_arrays("read", src, remote, offs, offs, size // pieces)
    task = asyncio.ensure_future(t)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task)
    await wait_until(t.done, what="transfer settled")
    await idle(pair.init)
    # and after all that, one goes through whole
    res = await within(pair.init.post_arrays("write", src, remote, offs, offs, size // pieces),
                       30)
    assert res.nbytes == size and np.array_equal(dst.numpy(), src.numpy())
    await idle(pair.init)
    await pair.init.aclose()
    with pytest.raises(ClosedResourceError):
        pair.init.post_arrays("write", src, remote, offs, offs, size // pieces)

"""Batches over tcp: many scattered descriptors of a request travel as vectored
frames (several chunks per frame, native/src/tcp.c); what lands must be exactly
what each descriptor names, for WRITE and READ, with sizes that mix packed
frames and frames of their own (a descriptor as large as a chunk)."""

from __future__ import annotations

import numpy as np
import pytest

import aioxfer

BUF = 8 << 20
PAGE = 16 << 10


def pages(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    npages = BUF // PAGE
    return (rng.permutation(npages)[:n].astype(np.uint64) * PAGE,
            rng.permutation(npages)[:n].astype(np.uint64) * PAGE)


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("conns", [1, 4])
async def test_scattered_batch_lands_exactly(make_agent, op: str, conns: int) -> None:
    target = await make_agent("target", transports=("tcp",), tcp_connections=conns)
    init = await make_agent("init", transports=("tcp",), tcp_connections=conns)
    tr = target.alloc(BUF, name="buf")
    ir = init.alloc(BUF, name="buf")
    rng = np.random.default_rng(5)
    tr.numpy()[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
    ir.numpy()[:] = rng.integers(0, 256, BUF, dtype=np.uint8)
    t0, i0 = tr.numpy().copy(), ir.numpy().copy()
    peer = await init.connect(target.address)
    remote = peer.region("buf")
    n = 256
    loffs, roffs = pages(11, n)
    # 16 KiB pages, some of them shorter (down to one byte).
    lens = np.full(n, PAGE, dtype=np.uint64)
    lens[::7] = 1
    lens[3::11] = PAGE - 5
    sl = aioxfer.SegmentList(ir, loffs, lens)
    sr = aioxfer.SegmentList(remote, roffs, lens)
    xfer = init.write if op == "write" else init.read
    res = await xfer(sl, sr)
    assert res.nbytes == int(lens.sum())
    src, dst = (i0, tr.numpy()) if op == "write" else (t0, ir.numpy())
    soffs, doffs = (loffs, roffs) if op == "write" else (roffs, loffs)
    expect = (t0 if op == "write" else i0).copy()
    for s, d, ln in zip(soffs, doffs, lens, strict=True):
        expect[int(d):int(d + ln)] = src[int(s):int(s + ln)]
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("op", ["write", "read"])
async def test_batch_with_large_descriptors(make_agent, op: str) -> None:
    """Descriptors of 1 MiB and more (their own frames, split into chunks)
    among small ones (packed), in one request."""
    target = await make_agent("target", transports=("tcp",))
    init = await make_agent("init", transports=("tcp",))
    tr = target.alloc(BUF, name="buf")
    ir = init.alloc(BUF, name="buf")
    tr.numpy()[:] = 3
    ir.numpy()[:] = np.arange(BUF, dtype=np.uint64).astype(np.uint8)
    if op == "read":
        tr.numpy()[:] = np.arange(BUF, dtype=np.uint64).astype(np.uint8) ^ 0x5A
        ir.numpy()[:] = 3
    peer = await init.connect(target.address)
    remote = peer.region("buf")
    loffs = np.array([0, 3 << 20, (3 << 20) + 8192, 6 << 20, (7 << 20) + 100], dtype=np.uint64)
    roffs = np.array([5 << 20, 0, 4096, 1 << 20, (2 << 20) + 77], dtype=np.uint64)
    lens = np.array([3 << 20, 4096, 4096, 1 << 20, 5000], dtype=np.uint64)
    xfer = init.write if op == "write" else init.read
    res = await xfer(aioxfer.SegmentList(ir, loffs, lens),
                     aioxfer.SegmentList(remote, roffs, lens))
    assert res.nbytes == int(lens.sum())
    src, dst = (ir.numpy(), tr.numpy()) if op == "write" else (tr.numpy(), ir.numpy())
    soffs, doffs = (loffs, roffs) if op == "write" else (roffs, loffs)
    for s, d, ln in zip(soffs, doffs, lens, strict=True):
        assert np.array_equal(dst[int(d):int(d + ln)], src[int(s):int(s + ln)])

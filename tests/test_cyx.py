"""The low-level layer: aioxfer._cyx.Engine, without the asyncio Agent.

Two engines in this process joined by socketpairs stand in for two agents;
raw sockets stand in for misbehaving peers. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aioxfer
from aioxfer import _cyx
from aioxfer.stats import BANDWIDTH_MIN, ESTIMATE_WEIGHT, PeerCounters

RECORD = tuple[int, int, int, int, int, int, bytes | None]

# Wire header of the native data connections: magic, type, flags, status,
# reserved, op, index, rid, key, off, len (little-endian, 64 bytes).
HDR = struct.Struct("<IHHiIQQQQQQ")
MAGIC = 0x31465841
F_WRITE, F_WRITE_ACK, F_READ_REQ, F_READ_RESP, F_NOTIFY, F_NOTIFY_ACK, F_PING = range(1, 8)
FL_LAST = 1


def frame(type_: int, *, op: int = 1, flags: int = FL_LAST, status: int = 0, index: int = 0,
          rid: int = 0, key: int = 0, off: int = 0, length: int = 0,
          magic: int = MAGIC) -> bytes:
    return HDR.pack(magic, type_, flags, status, 0, op, index, rid, key, off, length)


def wait_records(eng: _cyx.Engine, pred: Callable[[list[RECORD]], bool],
                 seconds: float = 10.0, into: list[RECORD] | None = None) -> list[RECORD]:
    """Polls eng (sleeping on its eventfd) until pred(records) holds."""
    recs: list[RECORD] = [] if into is None else into
    deadline = time.monotonic() + seconds
    while not pred(recs):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"records not seen within {seconds} s; got {recs!r}")
        select.select([eng.fileno()], [], [], min(left, 0.5))
        recs.extend(eng.poll())
    return recs


def xfer(recs: list[RECORD], req: int) -> RECORD | None:
    for r in recs:
        if r[0] == _cyx.CQ_XFER and r[2] == req:
            return r
    return None


def wait_xfer(eng: _cyx.Engine, req: int, seconds: float = 10.0,
              into: list[RECORD] | None = None) -> RECORD:
    recs = wait_records(eng, lambda rs: xfer(rs, req) is not None, seconds, into)
    rec = xfer(recs, req)
    assert rec is not None
    return rec


def descs(rows: list[tuple[int, int, int, int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, _cyx.DESC_FIELDS)


def close_engine(eng: _cyx.Engine) -> None:
    eng.shutdown()
    wait_records(eng, lambda _: eng.stats()["regions"] == 0 and eng.stats()["ops"] == 0)
    eng.poll()
    eng.close()
    assert eng.pinned_regions() == 0


@pytest.fixture
def engine() -> Iterator[_cyx.Engine]:
    eng = _cyx.Engine()
    yield eng
    close_engine(eng)


class TcpPair:
    """Engine a (initiator, endpoint ep) -> engine b (target), n socketpairs."""

    A_TAG, B_TAG = 77, 99

    def __init__(self, nconns: int = 1, size: int = 1 << 20, **cfg: int) -> None:
        self.a = _cyx.Engine(**cfg)
        self.b = _cyx.Engine(**cfg)
        self.ep = self.a.endpoint_create(_cyx.EP_TCP, self.A_TAG, 0)
        for _ in range(nconns):
            s0, s1 = socket.socketpair()
            self.a.endpoint_add_conn(self.ep, s0.detach())
            self.b.accept_conn(s1.detach(), self.B_TAG)
        self.src = bytearray(os.urandom(size))
        self.dst = bytearray(size)
        self.arid, self.akey, *_ = self.a.register(self.src)
        self.brid, self.bkey, baddr, blen, bacc = self.b.register(self.dst)
        self.blen, self.bacc = blen, bacc
        self.a.endpoint_import(self.ep, self.brid, self.bkey, blen, bacc, 0, -1)
        self.arecs: list[RECORD] = []
        self.brecs: list[RECORD] = []

    def close(self) -> None:
        close_engine(self.a)
        close_engine(self.b)


@pytest.fixture
def tcp_pair() -> Iterator[TcpPair]:
    p = TcpPair()
    yield p
    p.close()


# --------------------------------------------------------------- constants


def test_status_codes_match_header() -> None:
    assert (_cyx.OK, _cyx.E_INVALID, _cyx.E_NOMEM, _cyx.E_ACCESS, _cyx.E_PEER_LOST,
            _cyx.E_TIMEOUT, _cyx.E_TRANSPORT, _cyx.E_REGISTRATION, _cyx.E_PROTOCOL,
            _cyx.E_CLOSED, _cyx.E_CANCELLED, _cyx.E_NOTFOUND,
            _cyx.E_LIMIT) == tuple(range(0, -13, -1))
    assert _cyx.strerror(_cyx.OK) == "ok"
    assert "access denied" in _cyx.strerror(_cyx.E_ACCESS)
    assert _cyx.strerror(_cyx.E_PEER_LOST) == "peer lost"
    assert _cyx.MAX_NOTIFY == 4096
    assert _cyx.DESC_FIELDS == 6
    assert len({_cyx.CQ_XFER, _cyx.CQ_NOTIFY, _cyx.CQ_PEER_LOST, _cyx.CQ_REGION_FREED,
                _cyx.CQ_LOG, _cyx.CQ_CONN_CLOSED}) == 6


def test_native_error_carries_status() -> None:
    err = _cyx.NativeError(_cyx.E_ACCESS, "cannot do it")
    assert err.status == _cyx.E_ACCESS
    assert "cannot do it" in str(err) and "access denied" in str(err)


# --------------------------------------------------------------- registry


def test_register_pins_until_freed(engine: _cyx.Engine) -> None:
    buf = bytearray(b"x" * 4096)
    rid, key, addr, nbytes, access = engine.register(buf)
    assert nbytes == 4096
    assert access == _cyx.ACCESS_READ | _cyx.ACCESS_WRITE
    assert addr == np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert engine.pinned_regions() == 1
    assert engine.stats()["regions"] == 1
    with pytest.raises(BufferError):
        buf.extend(b"y")  # the export is pinned: the bytearray cannot move
    engine.deregister(rid)
    recs = wait_records(engine, lambda rs: any(r[0] == _cyx.CQ_REGION_FREED for r in rs))
    freed = [r for r in recs if r[0] == _cyx.CQ_REGION_FREED]
    assert [r[2] for r in freed] == [rid]
    assert engine.pinned_regions() == 0
    assert engine.stats()["regions"] == 0
    buf.extend(b"y")  # released
    with pytest.raises(ValueError):
        engine.deregister(rid)


def test_keys_are_random_and_ids_distinct(engine: _cyx.Engine) -> None:
    bufs = [bytearray(64) for _ in range(8)]
    regs = [engine.register(b) for b in bufs]
    assert len({r[0] for r in regs}) == 8
    assert len({r[1] for r in regs}) == 8
    assert all(r[1] != 0 for r in regs)


def test_register_read_only_and_various_buffers(engine: _cyx.Engine) -> None:
    assert engine.register(b"read only")[4] == _cyx.ACCESS_READ
    ro = np.zeros(16, dtype=np.uint8)
    ro.flags.writeable = False
    assert engine.register(ro)[4] == _cyx.ACCESS_READ
    for obj in (memoryview(bytearray(10)), np.zeros((4, 4), dtype=np.float32),
                mmap.mmap(-1, 8192)):
        rid, key, addr, nbytes, access = engine.register(obj)
        assert nbytes == memoryview(obj).nbytes
        assert access == _cyx.ACCESS_READ | _cyx.ACCESS_WRITE
    with pytest.raises(ValueError):
        engine.register(bytearray())
    with pytest.raises(TypeError):
        engine.register(12345)


def test_eventfd_readable_only_with_records(engine: _cyx.Engine) -> None:
    fd = engine.fileno()
    assert select.select([fd], [], [], 0)[0] == []
    assert engine.poll() == []
    rid = engine.register(bytearray(16))[0]
    engine.deregister(rid)
    assert select.select([fd], [], [], 5)[0] == [fd]
    recs = engine.poll()
    assert [r[0] for r in recs] == [_cyx.CQ_REGION_FREED]
    assert select.select([fd], [], [], 0)[0] == []  # drained: eventfd cleared
    with pytest.raises(ValueError):
        engine.poll(0)


def test_closed_engine_refuses() -> None:
    eng = _cyx.Engine()
    rid = eng.register(bytearray(8))[0]
    assert rid
    eng.close()
    eng.close()  # idempotent
    assert eng.closed
    assert eng.pinned_regions() == 0
    assert eng.poll() == []
    with pytest.raises(_cyx.NativeError) as ei:
        eng.register(bytearray(8))
    assert ei.value.status == _cyx.E_CLOSED


# --------------------------------------------------------------- post validation


def test_post_rejections(tcp_pair: TcpPair) -> None:
    p = tcp_pair
    a = p.a
    ok_row = (p.arid, 0, p.brid, p.bkey, 0, 16)
    with pytest.raises(ValueError):
        a.post(p.ep, _cyx.OP_WRITE, np.zeros((2, 5), dtype=np.uint64), None, 1)
    with pytest.raises(ValueError):
        a.post(p.ep, _cyx.OP_WRITE, np.zeros((2, 6), dtype=np.int64), None, 1)
    with pytest.raises(ValueError):
        a.post(p.ep, _cyx.OP_WRITE, np.zeros((6, 2), dtype=np.uint64).T, None, 1)
    with pytest.raises(ValueError):
        a.post(p.ep, _cyx.OP_WRITE, [list(ok_row)], None, 1)
    assert a.post(12345, _cyx.OP_WRITE, descs([ok_row]), None, 1) == _cyx.E_NOTFOUND
    assert a.post(p.ep, 99, descs([ok_row]), None, 1) == _cyx.E_INVALID
    assert a.post(p.ep, _cyx.OP_WRITE, None, None, 1) == _cyx.E_INVALID
    too_big = b"x" * (_cyx.MAX_NOTIFY + 1)
    assert a.post(p.ep, _cyx.OP_WRITE, descs([ok_row]), too_big, 1) == _cyx.E_INVALID
    assert a.post(p.ep, _cyx.OP_NOTIFY, descs([ok_row]), b"n", 1) == _cyx.E_INVALID
    assert a.post(p.ep, _cyx.OP_NOTIFY, None, None, 1) == _cyx.E_INVALID
    assert a.post(p.ep, _cyx.OP_READ, descs([ok_row]), b"n", 1) == _cyx.E_INVALID
    zero_len = (p.arid, 0, p.brid, p.bkey, 0, 0)
    assert a.post(p.ep, _cyx.OP_WRITE, descs([zero_len]), None, 1) == _cyx.E_INVALID
    # Checked against the imported remote region and the local one before anything moves.
    bad = [
        (p.arid, 0, p.brid, p.bkey ^ 1, 0, 16),  # wrong key
        (p.arid, 0, p.brid + 1000, p.bkey, 0, 16),  # unknown remote region
        (p.arid, 0, p.brid, p.bkey, p.blen - 8, 16),  # past the remote end
        (p.arid, 0, p.brid, p.bkey, 2**64 - 8, 16),  # offset wrap-around
        (p.arid, len(p.src) - 8, p.brid, p.bkey, 0, 16),  # past the local end
        (p.arid + 1000, 0, p.brid, p.bkey, 0, 16),  # unknown local region
    ]
    for row in bad:
        assert a.post(p.ep, _cyx.OP_WRITE, descs([ok_row, row]), None, 2) == _cyx.E_ACCESS, row
    # Nothing was queued: no completion, no op left.
    assert a.stats()["ops"] == 0
    assert a.poll() == []
    assert p.dst == bytearray(len(p.dst))


def test_duplicate_request_id_rejected() -> None:
    p = TcpPair(size=64 << 20)
    try:
        d = descs([(p.arid, 0, p.brid, p.bkey, 0, 64 << 20)])
        assert p.a.post(p.ep, _cyx.OP_WRITE, d, None, 5) == _cyx.OK
        # Still in flight (64 MiB and an acknowledgement): the id is taken.
        assert p.a.post(p.ep, _cyx.OP_WRITE, d, None, 5) == _cyx.E_INVALID
        seen: list[RECORD] = []
        assert wait_xfer(p.a, 5, into=seen)[1] == _cyx.OK
        assert sum(r[0] == _cyx.CQ_XFER for r in seen) == 1
        assert p.a.stats()["ops"] == 0
        assert p.dst == p.src
    finally:
        p.close()


# --------------------------------------------------------------- tcp data path


def test_tcp_write_read_notify(tcp_pair: TcpPair) -> None:
    p = tcp_pair
    rows = [(p.arid, 0, p.brid, p.bkey, 4096, 100),
            (p.arid, 8192, p.brid, p.bkey, 65536, 16384),
            (p.arid, 300000, p.brid, p.bkey, 400000, 500000),
            (p.arid, 1000, p.brid, p.bkey, 0, 1)]
    assert p.a.post(p.ep, _cyx.OP_WRITE, descs(rows), b"req-1", 1) == _cyx.OK
    # The notification reaches b only once the data is in b's memory.
    brecs = wait_records(p.b, lambda rs: any(r[0] == _cyx.CQ_NOTIFY for r in rs))
    note = next(r for r in brecs if r[0] == _cyx.CQ_NOTIFY)
    assert note[3] == TcpPair.B_TAG and note[6] == b"req-1"
    for _, loff, _, _, roff, n in rows:
        assert p.dst[roff:roff + n] == p.src[loff:loff + n]
    rec = wait_xfer(p.a, 1)
    assert rec[1] == _cyx.OK and rec[4] == sum(r[5] for r in rows)
    # READ it back into a fresh local region.
    back = bytearray(len(p.src))
    lrid = p.a.register(back)[0]
    rrows = [(lrid, loff, p.brid, p.bkey, roff, n) for _, loff, _, _, roff, n in rows]
    assert p.a.post(p.ep, _cyx.OP_READ, descs(rrows), None, 2) == _cyx.OK
    rec = wait_xfer(p.a, 2)
    assert rec[1] == _cyx.OK and rec[4] == sum(r[5] for r in rows)
    for _, loff, _, _, roff, n in rows:
        assert back[loff:loff + n] == p.dst[roff:roff + n]
    # A standalone notification.
    assert p.a.post(p.ep, _cyx.OP_NOTIFY, None, b"hello", 3) == _cyx.OK
    assert wait_xfer(p.a, 3)[1] == _cyx.OK
    brecs = wait_records(p.b, lambda rs: any(r[6] == b"hello" for r in rs))


def test_post_many_one_doorbell(tcp_pair: TcpPair) -> None:
    p = tcp_pair
    items = [(p.ep, _cyx.OP_WRITE, descs([(p.arid, i * 4096, p.brid, p.bkey, i * 4096, 4096)]),
              None, 100 + i) for i in range(16)]
    items.append((p.ep, _cyx.OP_WRITE, descs([(p.arid, 0, p.brid, p.bkey ^ 7, 0, 1)]), None, 99))
    sts = p.a.post_many(items)
    assert sts[:16] == [_cyx.OK] * 16 and sts[16] == _cyx.E_ACCESS
    recs: list[RECORD] = []
    for i in range(16):
        assert wait_xfer(p.a, 100 + i, into=recs)[1] == _cyx.OK
    assert xfer(recs, 99) is None
    assert p.dst[:16 * 4096] == p.src[:16 * 4096]


def test_target_checks_key_and_bounds(tcp_pair: TcpPair) -> None:
    """The initiator's import is forged (wrong key, inflated length): the target
    itself must refuse, and its memory must stay untouched."""
    p = tcp_pair
    ep2 = p.a.endpoint_create(_cyx.EP_TCP, 78, 0)
    s0, s1 = socket.socketpair()
    p.a.endpoint_add_conn(ep2, s0.detach())
    p.b.accept_conn(s1.detach(), 98)
    # Forged view of b's region: wrong key. The lying length lets the initiator
    # post past the end; only the target can refuse.
    p.a.endpoint_import(ep2, p.brid, p.bkey ^ 0x5A5A, p.blen * 4, p.bacc, 0, -1)
    cases = [
        (p.bkey ^ 0x5A5A, 0, 4096),  # bad key
    ]
    for n, (key, roff, length) in enumerate(cases):
        d = descs([(p.arid, 0, p.brid, key, roff, length)])
        assert p.a.post(ep2, _cyx.OP_WRITE, d, None, 500 + n) == _cyx.OK
        rec = wait_xfer(p.a, 500 + n)
        assert rec[1] == _cyx.E_ACCESS
    # Past the end with the right key: import again under a third endpoint.
    ep3 = p.a.endpoint_create(_cyx.EP_TCP, 79, 0)
    s0, s1 = socket.socketpair()
    p.a.endpoint_add_conn(ep3, s0.detach())
    p.b.accept_conn(s1.detach(), 97)
    p.a.endpoint_import(ep3, p.brid, p.bkey, p.blen * 4, p.bacc, 0, -1)
    d = descs([(p.arid, 0, p.brid, p.bkey, 0, 16),
               (p.arid, 0, p.brid, p.bkey, p.blen - 100, 4096)])
    assert p.a.post(ep3, _cyx.OP_WRITE, d, None, 600) == _cyx.OK
    rec = wait_xfer(p.a, 600)
    assert rec[1] == _cyx.E_ACCESS and rec[5] == 1
    assert p.dst[16:] == bytearray(len(p.dst) - 16)  # nothing past the refused one
    # READ past the end: refused too, nothing read beyond the region.
    back = bytearray(8192)
    lrid = p.a.register(back)[0]
    d = descs([(lrid, 0, p.brid, p.bkey, p.blen - 100, 4096)])
    assert p.a.post(ep3, _cyx.OP_READ, d, None, 601) == _cyx.OK
    assert wait_xfer(p.a, 601)[1] == _cyx.E_ACCESS
    assert back == bytearray(8192)
    # The endpoint still works afterwards (the refusal did not kill the connection).
    d = descs([(p.arid, 0, p.brid, p.bkey, 0, 4096)])
    assert p.a.post(ep3, _cyx.OP_WRITE, d, None, 602) == _cyx.OK
    assert wait_xfer(p.a, 602)[1] == _cyx.OK
    assert p.dst[:4096] == p.src[:4096]


def test_deregistered_target_region_refuses(tcp_pair: TcpPair) -> None:
    p = tcp_pair
    p.b.deregister(p.brid)
    wait_records(p.b, lambda rs: any(r[0] == _cyx.CQ_REGION_FREED for r in rs))
    # B told A before freeing it: A refuses at post.
    d = descs([(p.arid, 0, p.brid, p.bkey, 0, 4096)])
    assert p.a.post(p.ep, _cyx.OP_WRITE, d, None, 1) == _cyx.E_ACCESS
    # A handle imported again (stale metadata): B's own check refuses it.
    p.a.endpoint_import(p.ep, p.brid, p.bkey, p.blen, p.bacc, 0, -1)
    assert p.a.post(p.ep, _cyx.OP_WRITE, d, None, 2) == _cyx.OK
    assert wait_xfer(p.a, 2)[1] == _cyx.E_ACCESS
    assert p.dst == bytearray(len(p.dst))


def test_cancel_big_transfer() -> None:
    p = TcpPair(size=64 << 20)
    try:
        d = descs([(p.arid, 0, p.brid, p.bkey, 0, 64 << 20)])
        assert p.a.post(p.ep, _cyx.OP_WRITE, d, None, 7) == _cyx.OK
        assert p.a.cancel(7) == _cyx.OK
        rec = wait_xfer(p.a, 7)
        assert rec[1] == _cyx.E_CANCELLED
        assert p.a.cancel(7) == _cyx.E_NOTFOUND
        assert p.a.stats()["ops"] == 0
        # The connection keeps working.
        d = descs([(p.arid, 0, p.brid, p.bkey, 0, 1 << 20)])
        assert p.a.post(p.ep, _cyx.OP_WRITE, d, None, 8) == _cyx.OK
        assert wait_xfer(p.a, 8)[1] == _cyx.OK
        assert p.dst[:1 << 20] == p.src[:1 << 20]
    finally:
        p.close()


def test_peer_lost_fails_pending() -> None:
    a = _cyx.Engine(peer_timeout_ms=1000, keepalive_ms=200)
    try:
        ep = a.endpoint_create(_cyx.EP_TCP, 5, 0)
        s0, s1 = socket.socketpair()
        a.endpoint_add_conn(ep, s0.detach())
        src = bytearray(8 << 20)
        rid = a.register(src)[0]
        a.endpoint_import(ep, 1, 2, 8 << 20, _cyx.ACCESS_WRITE, 0, -1)
        assert a.post(ep, _cyx.OP_WRITE, descs([(rid, 0, 1, 2, 0, 8 << 20)]), None, 1) == _cyx.OK
        s1.recv(1000)  # the frames start to arrive ...
        s1.close()  # ... and the peer dies
        seen: list[RECORD] = []
        rec = wait_xfer(a, 1, seconds=5, into=seen)
        assert rec[1] == _cyx.E_PEER_LOST
        recs = wait_records(a, lambda rs: any(r[0] == _cyx.CQ_PEER_LOST for r in rs), into=seen)
        lost = next(r for r in recs if r[0] == _cyx.CQ_PEER_LOST)
        assert lost[2] == ep and lost[3] == 5
        assert a.post(ep, _cyx.OP_WRITE, descs([(rid, 0, 1, 2, 0, 1)]), None, 2) == \
            _cyx.E_PEER_LOST
    finally:
        close_engine(a)


def test_silent_peer_detected_within_timeout() -> None:
    a = _cyx.Engine(peer_timeout_ms=500, keepalive_ms=100)
    s0, s1 = socket.socketpair()
    try:
        ep = a.endpoint_create(_cyx.EP_TCP, 5, 0)
        a.endpoint_add_conn(ep, s0.detach())
        t0 = time.monotonic()
        assert a.post(ep, _cyx.OP_NOTIFY, None, b"anyone?", 1) == _cyx.OK
        rec = wait_xfer(a, 1, seconds=5)  # s1 never answers
        assert rec[1] == _cyx.E_PEER_LOST
        assert time.monotonic() - t0 < 3.0
    finally:
        s1.close()
        close_engine(a)


def test_shutdown_fails_pending_with_closed() -> None:
    a = _cyx.Engine()
    s0, s1 = socket.socketpair()
    ep = a.endpoint_create(_cyx.EP_TCP, 5, 0)
    a.endpoint_add_conn(ep, s0.detach())
    src = bytearray(32 << 20)
    rid = a.register(src)[0]
    a.endpoint_import(ep, 1, 2, 32 << 20, _cyx.ACCESS_WRITE, 0, -1)
    assert a.post(ep, _cyx.OP_WRITE, descs([(rid, 0, 1, 2, 0, 32 << 20)]), None, 1) == _cyx.OK
    a.shutdown()  # s1 never reads: the op is stuck in the socket
    rec = wait_xfer(a, 1)
    assert rec[1] == _cyx.E_CLOSED
    wait_records(a, lambda rs: a.pinned_regions() == 0)
    assert a.stats()["ops"] == 0
    a.close()
    s1.close()


# --------------------------------------------------------------- hostile frames


@pytest.mark.parametrize(
    "garbage, reason",
    [
        (os.urandom(64), "magic"),
        (frame(42), "type"),
        (frame(F_WRITE, length=1 << 40), "oversized"),
        (frame(F_NOTIFY, length=1 << 20), "NOTIFY"),
        (frame(F_WRITE_ACK), "type"),  # a reply sent to a target
    ],
    ids=["random", "bad-type", "oversized-write", "oversized-notify", "reply-to-target"],
)
def test_malformed_frame_closes_that_connection_only(garbage: bytes, reason: str) -> None:
    b = _cyx.Engine()
    try:
        dst = bytearray(1 << 16)
        brid, bkey, *_ = b.register(dst)
        good0, good1 = socket.socketpair()
        bad0, bad1 = socket.socketpair()
        b.accept_conn(good1.detach(), 1)
        b.accept_conn(bad1.detach(), 2)
        bad0.sendall(garbage)
        recs = wait_records(b, lambda rs: any(r[0] == _cyx.CQ_CONN_CLOSED and r[3] == 2
                                              for r in rs))
        logs = [r for r in recs if r[0] == _cyx.CQ_LOG and r[3] == 2]
        assert logs, recs
        assert b"malformed" in logs[0][6] and reason.encode() in logs[0][6], logs
        assert b.stats()["frames_rejected"] == 1
        bad0.settimeout(5)
        assert bad0.recv(100) == b""  # closed by the engine
        # The other connection is still served: a raw WRITE with the right key lands.
        good0.sendall(frame(F_WRITE, op=9, rid=brid, key=bkey, off=100, length=5) + b"hello")
        good0.settimeout(5)
        ack = HDR.unpack(read_exact(good0, 64))
        assert ack[0] == MAGIC and ack[1] == F_WRITE_ACK and ack[3] == _cyx.OK and ack[5] == 9
        assert dst[100:105] == b"hello"
        good0.close()
        bad0.close()
    finally:
        close_engine(b)


def test_raw_frames_checked_against_region_table() -> None:
    b = _cyx.Engine()
    try:
        dst = bytearray(4096)
        brid, bkey, *_ = b.register(dst)
        s0, s1 = socket.socketpair()
        s0.settimeout(5)
        b.accept_conn(s1.detach(), 1)
        # Wrong key: acknowledged with E_ACCESS, memory untouched, connection kept.
        s0.sendall(frame(F_WRITE, op=1, rid=brid, key=bkey ^ 1, off=0, length=4) + b"evil")
        ack = HDR.unpack(read_exact(s0, 64))
        assert ack[1] == F_WRITE_ACK and ack[3] == _cyx.E_ACCESS
        # Past the end / wrapping offsets.
        for off, length in ((4090, 16), (2**64 - 2, 4), (4097, 0 + 1)):
            s0.sendall(frame(F_WRITE, op=2, rid=brid, key=bkey, off=off, length=length)
                       + b"E" * length)
            ack = HDR.unpack(read_exact(s0, 64))
            assert ack[1] == F_WRITE_ACK and ack[3] == _cyx.E_ACCESS, (off, length)
        # READ with a wrong key: refused, no payload.
        s0.sendall(frame(F_READ_REQ, op=3, rid=brid, key=bkey + 1, off=0, length=64))
        resp = HDR.unpack(read_exact(s0, 64))
        assert resp[1] == F_READ_RESP and resp[3] == _cyx.E_ACCESS and resp[10] == 0
        assert dst == bytearray(4096)
        # A correct READ returns the bytes: the refusals above were not vacuous.
        dst[0:4] = b"good"
        s0.sendall(frame(F_READ_REQ, op=4, rid=brid, key=bkey, off=0, length=4))
        resp = HDR.unpack(read_exact(s0, 64))
        assert resp[1] == F_READ_RESP and resp[3] == _cyx.OK and resp[10] == 4
        assert read_exact(s0, 4) == b"good"
        s0.close()
    finally:
        close_engine(b)


def read_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise AssertionError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return out


# --------------------------------------------------------------- shm


def test_shm_memfd_and_cross_memory_attach() -> None:
    a = _cyx.Engine()
    b = _cyx.Engine()
    try:
        size = 4 << 20
        fd = os.memfd_create("axf-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        pool = mmap.mmap(fd, size)  # b's memfd-backed pool
        user = bytearray(size)  # b's plain memory (cross-memory attach)
        prid, pkey, paddr, plen, pacc = b.register(pool, memfd=fd)
        urid, ukey, uaddr, ulen, uacc = b.register(user)
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        # An unsealed memfd could be truncated under our copies: refused.
        with pytest.raises(_cyx.NativeError) as err:
            a.endpoint_import(ep, prid, pkey, plen, pacc, paddr, fd)
        assert err.value.status == _cyx.E_ACCESS
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_SEAL)
        a.endpoint_import(ep, prid, pkey, plen, pacc, paddr, fd)
        a.endpoint_import(ep, urid, ukey, ulen, uacc, uaddr, -1)
        src = bytearray(os.urandom(size))
        srid = a.register(src)[0]
        req = 1
        for rrid, rkey, target in ((prid, pkey, pool), (urid, ukey, user)):
            for n in (100, 60000, 3 << 20):  # inline-sized and worker-sized copies
                rows = [(srid, 0, rrid, rkey, 4096, n), (srid, size - 1000, rrid, rkey, 0, 1000)]
                assert a.post(ep, _cyx.OP_WRITE, descs(rows), None, req) == _cyx.OK
                rec = wait_xfer(a, req)
                assert rec[1] == _cyx.OK and rec[4] == n + 1000
                assert bytes(target[4096:4096 + n]) == src[:n]
                assert bytes(target[0:1000]) == src[size - 1000:]
                req += 1
            back = bytearray(size)
            brid2 = a.register(back)[0]
            rows = [(brid2, 0, rrid, rkey, 0, size)]
            assert a.post(ep, _cyx.OP_READ, descs(rows), None, req) == _cyx.OK
            assert wait_xfer(a, req)[1] == _cyx.OK
            assert back == bytes(target[:size])
            req += 1
            # Bounds are checked by the initiator before the copy.
            bad = [(srid, 0, rrid, rkey, size - 10, 20)]
            assert a.post(ep, _cyx.OP_WRITE, descs(bad), None, req) == _cyx.E_ACCESS
            bad = [(srid, 0, rrid, rkey ^ 1, 0, 20)]
            assert a.post(ep, _cyx.OP_WRITE, descs(bad), None, req) == _cyx.E_ACCESS
        close_engine(a)
        close_engine(b)
        pool.close()
        os.close(fd)
    finally:
        if not a.closed:
            close_engine(a)
        if not b.closed:
            close_engine(b)


def test_small_shm_completion_is_ready_at_once() -> None:
    """A copy known complete at submit is in the ring before post() returns."""
    a = _cyx.Engine()
    try:
        dst = bytearray(4096)
        src = bytearray(b"z" * 4096)
        drid, dkey, daddr, dlen, dacc = a.register(dst)
        srid = a.register(src)[0]
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        a.endpoint_import(ep, drid, dkey, dlen, dacc, daddr, -1)
        assert a.post(ep, _cyx.OP_WRITE, descs([(srid, 0, drid, dkey, 0, 4096)]), None, 1) \
            == _cyx.OK
        assert select.select([a.fileno()], [], [], 0)[0] == [a.fileno()]
        recs = a.poll()
        assert xfer(recs, 1) is not None and xfer(recs, 1)[1] == _cyx.OK
        assert dst == src
    finally:
        close_engine(a)


def test_small_post_keeping_the_gil_takes_on_no_queued_copy() -> None:
    """post_many of a small request keeps the GIL, so its doorbell must not
    copy other requests' queued jobs (shm's help, up to inline_bytes: other
    Python threads would wait that long for the GIL): the worker copies them.
    Seen from the source pages of a queued 2 MiB batch, never touched before
    (an anonymous mmap): none of its 512 faults in on this thread."""
    import resource

    a = _cyx.Engine(copy_workers=1, inline_bytes=2 << 20)
    big = mmap.mmap(-1, 2 << 20)
    try:
        dst = bytearray(4 << 20)
        small = bytearray(b"s" * 4096)
        drid, dkey, daddr, dlen, dacc = a.register(dst)
        brid = a.register(big)[0]
        srid = a.register(small)[0]
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        a.endpoint_import(ep, drid, dkey, dlen, dacc, daddr, -1)
        rows = [(brid, i * 16384, drid, dkey, i * 16384, 16384) for i in range(128)]
        assert a.post(ep, _cyx.OP_WRITE, descs(rows), None, 1, defer=True) == _cyx.OK
        item = (ep, _cyx.OP_WRITE, (srid, 0, drid, dkey, 3 << 20, 4096), None, 2)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        assert a.post_many([item]) == [_cyx.OK]
        after = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        assert after - before < 16  # helping would fault in 64 a 256 KiB job
        recs: list[RECORD] = []
        for _ in range(1000):
            recs += a.poll()
            if xfer(recs, 1) is not None and xfer(recs, 2) is not None:
                break
            a.wait(10_000)
        assert xfer(recs, 1)[1] == _cyx.OK and xfer(recs, 2)[1] == _cyx.OK
        assert dst[3 << 20:(3 << 20) + 4096] == small
    finally:
        close_engine(a)
        big.close()


class _Peer:
    """What Engine.drain reads of a transfer's peer: its path, and the
    counters it settles (a typed record, never the peer's own fields)."""

    __slots__ = ("path", "_counters")

    def __init__(self) -> None:
        self.path = "shm"
        self._counters = PeerCounters(inflight=3, inflight_bytes=3 * 4096)


class _Transfer(asyncio.Future[Any]):
    """What Engine.drain reads of a transfer (aioxfer.Transfer has these)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: _Peer, admitted: bool) -> None:
        super().__init__(loop=loop)
        self.peer = peer
        self.nbytes = 4096
        self._t0 = time.perf_counter()
        self._admitted = admitted
        self._path: str | None = None


def test_one_descriptor_tuple_and_drain_dispatch() -> None:
    """A descriptor given as a 6-tuple posts like a one-row array; drain
    finishes successful transfers it knows, in ring order with the records it
    hands to slow, and settles the peer's counters before each callback."""
    a = _cyx.Engine()
    loop = asyncio.new_event_loop()
    try:
        dst = bytearray(3 * 4096)
        src = bytearray(os.urandom(3 * 4096))
        drid, dkey, daddr, dlen, dacc = a.register(dst)
        srid = a.register(src)[0]
        spare = a.register(bytearray(16))[0]
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        a.endpoint_import(ep, drid, dkey, dlen, dacc, daddr, -1)
        with pytest.raises(ValueError, match="6 fields"):
            a.post_many([(ep, _cyx.OP_WRITE, (srid, 0, drid, dkey, 0), None, 9)])
        peer = _Peer()
        inflight = {1: _Transfer(loop, peer, False), 2: _Transfer(loop, peer, True),
                    3: _Transfer(loop, peer, False)}
        inflight[3].cancel()  # cancelled meanwhile: counted, never resolved
        items = [(ep, _cyx.OP_WRITE, (srid, i * 4096, drid, dkey, i * 4096, 4096), None, i + 1)
                 for i in range(3)]
        items.append((ep, _cyx.OP_WRITE, (srid, 0, drid, dkey, 0, 1), None, 77))  # not ours
        assert a.post_many(items[:1]) == [_cyx.OK]
        a.deregister(spare)  # its CQ_REGION_FREED goes to slow, between 1 and 2
        assert a.post_many(items[1:]) == [_cyx.OK] * 3
        assert dst == src
        t1, t2, t3 = inflight[1], inflight[2], inflight[3]
        calls: list[tuple[str, Any]] = []

        def slow(*rec: Any) -> None:
            calls.append(("slow", (rec[0], t1.done(), t2.done(), peer._counters.completed)))

        def release(t: Any) -> None:
            calls.append(("release", (t is t2, t2.done(), peer._counters.completed)))

        n, completed, nbytes = a.drain(inflight, slow, release, aioxfer.TransferResult,
                                       ESTIMATE_WEIGHT, BANDWIDTH_MIN)
        assert (n, completed, nbytes) == (5, 3, 3 * 4096)
        assert calls == [("slow", (_cyx.CQ_REGION_FREED, True, False, 1)),
                         ("release", (True, False, 1))]
        assert inflight == {}
        r = t1.result()
        assert type(r) is aioxfer.TransferResult
        assert (r.nbytes, r.path, r.reroutes) == (4096, "shm", 0) and r.seconds > 0
        # The drain's clock is time.perf_counter's (transfers' _t0 come from it).
        assert r.seconds < time.perf_counter() - t1._t0
        assert r == aioxfer.TransferResult(4096, r.seconds, "shm", 0)
        assert t2.result().nbytes == 4096 and t3.cancelled()
        c = peer._counters
        assert (c.inflight, c.inflight_bytes, c.completed, c.bytes) == (0, 0, 3, 3 * 4096)
        assert 0 < c.latency < 10 and c.bandwidth == 0.0
        assert a.drain(inflight, slow, release, aioxfer.TransferResult,
                       ESTIMATE_WEIGHT, BANDWIDTH_MIN) == (0, 0, 0)
    finally:
        loop.close()
        close_engine(a)


def test_post_poll_skips_only_the_wakeup_of_completions_known_at_submit() -> None:
    """post_many(polls=True): a small same-host copy's record is in the ring
    without the eventfd becoming readable (the caller polls next); a copy the
    workers finish later still signals; a drained ring leaves the fd clear."""
    a = _cyx.Engine()
    try:
        size = 1 << 20
        dst = bytearray(size)
        src = bytearray(os.urandom(size))
        drid, dkey, daddr, dlen, dacc = a.register(dst)
        srid = a.register(src)[0]
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        a.endpoint_import(ep, drid, dkey, dlen, dacc, daddr, -1)

        def readable() -> bool:
            return bool(select.select([a.fileno()], [], [], 0)[0])

        small = [(ep, _cyx.OP_WRITE, (srid, 0, drid, dkey, 0, 4096), None, 1)]
        assert a.post_many(small, polls=True) == [_cyx.OK]
        assert not readable()
        assert xfer(a.poll(), 1) is not None and not readable()
        small = [(ep, _cyx.OP_WRITE, (srid, 0, drid, dkey, 0, 4096), None, 2)]
        assert a.post_many(small) == [_cyx.OK]
        assert readable()
        assert xfer(a.poll(), 2) is not None and not readable()
        big = [(ep, _cyx.OP_WRITE, (srid, 0, drid, dkey, 0, size), None, 3)]
        assert a.post_many(big, polls=True) == [_cyx.OK]
        assert wait_xfer(a, 3)[1] == _cyx.OK  # waits on the eventfd
        assert dst == src
        a.poll()
        assert not readable()
    finally:
        close_engine(a)


# --------------------------------------------------------------- limits and same-host trust


def test_max_conns_refuses_typed() -> None:
    b = _cyx.Engine(max_conns=2)
    peers = []
    try:
        for tag in (1, 2):
            s0, s1 = socket.socketpair()
            b.accept_conn(s1.detach(), tag)
            peers.append(s0)
        s0, s1 = socket.socketpair()
        with pytest.raises(_cyx.NativeError) as err:
            b.accept_conn(s1.detach(), 3)
        assert err.value.status == _cyx.E_LIMIT
        assert s0.recv(1) == b""  # refused means closed, fd and all
        s0.close()
        assert b.stats()["conns"] == 2 and b.stats()["conns_refused"] == 1
    finally:
        close_engine(b)
        for s in peers:
            s.close()


def test_notifications_stop_at_the_credit_until_released() -> None:
    p = TcpPair(max_notify_per_conn=3)
    try:
        for i in range(7):
            assert p.a.post(p.ep, _cyx.OP_NOTIFY, None, b"m%d" % i, 100 + i) == _cyx.OK

        def notes(recs: list[RECORD]) -> list[bytes]:
            return [r[6] for r in recs if r[0] == _cyx.CQ_NOTIFY and r[6] is not None]

        wait_records(p.b, lambda rs: len(notes(rs)) >= 3, into=p.brecs)
        time.sleep(0.3)
        p.brecs.extend(p.b.poll())
        assert notes(p.brecs) == [b"m0", b"m1", b"m2"]  # no more read until released
        p.b.notify_release(TcpPair.B_TAG, 3)
        wait_records(p.b, lambda rs: len(notes(rs)) >= 6, into=p.brecs)
        p.b.notify_release(TcpPair.B_TAG, 3)
        wait_records(p.b, lambda rs: len(notes(rs)) >= 7, into=p.brecs)
        assert notes(p.brecs) == [b"m%d" % i for i in range(7)]
        for i in range(7):
            assert wait_xfer(p.a, 100 + i, into=p.arecs)[1] == _cyx.OK
    finally:
        p.close()


def test_same_host_holder_keeps_region_quarantined_until_its_process_exits() -> None:
    """A same-host connection (accepted with its process's pidfd) that closed
    its socket does not release what it may still map or copy into: the
    region stays quarantined, its holder named, until the process exits."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    b = _cyx.Engine()
    try:
        buf = bytearray(8192)
        rid = b.register(buf)[0]
        s0, s1 = socket.socketpair()
        b.accept_conn(s1.detach(), 41, os.pidfd_open(child.pid))
        s0.close()
        wait_records(b, lambda rs: any(r[0] == _cyx.CQ_CONN_CLOSED for r in rs))
        b.deregister(rid)
        assert b.region_holders(rid) == [41]
        st = b.stats()
        assert st["quarantined"] == 1 and st["quarantined_bytes"] == 8192
        assert st["held_conns"] == 1
        time.sleep(0.2)
        assert not any(r[0] == _cyx.CQ_REGION_FREED for r in b.poll())
        assert b.pinned_regions() == 1
        child.kill()
        child.wait()
        recs = wait_records(b, lambda rs: any(r[0] == _cyx.CQ_REGION_FREED for r in rs))
        assert [r[1] for r in recs if r[0] == _cyx.CQ_REGION_FREED] == [_cyx.OK]
        assert b.region_holders(rid) is None
        assert b.pinned_regions() == 0
        assert b.stats()["quarantined"] == 0
    finally:
        child.kill()
        child.wait()
        close_engine(b)


def test_same_host_endpoint_needs_the_kernels_word() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    a = _cyx.Engine()
    try:
        with pytest.raises(_cyx.NativeError) as err:  # a claimed pid alone
            a.endpoint_create(_cyx.EP_SHM, 1, child.pid)
        assert err.value.status == _cyx.E_ACCESS
        with pytest.raises(_cyx.NativeError) as err:  # a pidfd of someone else
            a.endpoint_create(_cyx.EP_SHM, 1, child.pid, os.pidfd_open(os.getpid()))
        assert err.value.status == _cyx.E_ACCESS
        ep = a.endpoint_create(_cyx.EP_SHM, 1, child.pid, os.pidfd_open(child.pid))
        child.kill()
        child.wait()
        recs = wait_records(a, lambda rs: any(r[0] == _cyx.CQ_PEER_LOST for r in rs))
        assert [r[1] for r in recs if r[0] == _cyx.CQ_PEER_LOST and r[2] == ep] == [
            _cyx.E_PEER_LOST]
    finally:
        child.kill()
        child.wait()
        close_engine(a)

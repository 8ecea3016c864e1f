"""A lone awaited request's spin (Poller.spin_alone) outlasts one preemption
of the spinning thread: its bound is ALONE_LATENCIES (5) times the peer's
latency average, not twice it (py23: with twice, 0.5-1.5 % of lone 64 KiB
tcp WRITEs on the 2-vCPU VM ran out of their spin and went the loop's way,
4-7 % of a run's time)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aioxfer.progress import ALONE_LATENCIES, ALONE_MAX_US, Poller
from aioxfer.stats import BANDWIDTH_MIN, PeerCounters


class _Sub:
    closed = False
    inflight: dict[int, object] = {}

    def drain(self) -> None:
        pass


def _bound(latency: float, nbytes: int = 64 << 10, bandwidth: float = 4e9) -> int:
    loop = asyncio.new_event_loop()
    try:
        poller = Poller(_Sub(), lambda us: 0, loop, "adaptive", 43)
        counters = PeerCounters(latency=latency, bandwidth=bandwidth)
        return int(poller.alone_bound(SimpleNamespace(nbytes=nbytes,
                                                      peer=SimpleNamespace(_counters=counters))))
    finally:
        loop.close()


def test_lone_small_request_spins_five_latencies() -> None:
    # A 64 KiB tcp WRITE over loopback takes ~25 us: its spin lasts ~125 us
    # (was 50: one sched_yield that lost the CPU for a timeslice ran it out).
    assert ALONE_LATENCIES == 5
    assert _bound(25e-6) == 125
    assert _bound(25e-6, nbytes=4096) == 125
    # still floored by the budget (poll_us) and capped by ALONE_MAX_US
    assert _bound(5e-6) == 43
    assert _bound(1e-3) == ALONE_MAX_US


def test_large_request_still_sized_by_bandwidth() -> None:
    # 1 MiB at 4 GB/s: twice its time at the peer's bandwidth (the latency
    # term, 5 x 20 us, is shorter), as before.
    assert _bound(20e-6, nbytes=1 << 20) == int((1 << 20) * 2e6 / 4e9)
    assert _bound(20e-6, nbytes=BANDWIDTH_MIN - 1, bandwidth=1e6) == 100

"""The compiled Poller (cyx/_progress.pxi, aioxfer.progress.Poller's base):
its spin_alone bound reads counters in slots as it reads them as attributes
(the bound itself: test_progress's test_alone_bound_bounds_...), and a wait other than an
Engine's is called as given. An agent's lone awaits through it: test_progress
(test_lone_tcp_requests_polled_in_their_await and the rest)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from aioxfer import _cyx
from aioxfer.progress import ALONE_MAX_US, Poller
from aioxfer.stats import BANDWIDTH_MIN, PeerCounters


class _Sub:
    closed = False
    inflight: dict[int, object] = {}

    def drain(self) -> None:
        pass


@pytest.mark.parametrize(
    ("nbytes", "latency", "bandwidth"),
    [
        (4096, 20e-6, 4e9),
        (4096, 30e-6, 4e9),
        (BANDWIDTH_MIN - 1, 20e-6, 1e6),
        (BANDWIDTH_MIN, 20e-6, 1e6),
        (1 << 20, 20e-6, 4e9),
        (1 << 20, 400e-6, 4e9),
        (1 << 20, 20e-6, 0.0),
        (1 << 20, 20e-6, 1e9),
        (4096, 1.0, 4e9),
        (4096, 0.0, 0.0),
    ],
)
def test_compiled_bound_reads_slots_as_attributes(nbytes: int, latency: float,
                                                  bandwidth: float) -> None:
    """Poller.alone_bound (the compiled spin_alone's bound) is the same for
    counters in plain slots (PeerCounters: read through them) as for any
    other object (read as attributes), within the poller's budget and
    ALONE_MAX_US."""
    loop = asyncio.new_event_loop()
    try:
        poller = Poller(_Sub(), lambda us: 0, loop, "adaptive", 43)
        bounds = []
        for counters in (PeerCounters(latency=latency, bandwidth=bandwidth),
                         SimpleNamespace(latency=latency, bandwidth=bandwidth)):
            t = SimpleNamespace(nbytes=nbytes, peer=SimpleNamespace(_counters=counters))
            bounds.append(poller.alone_bound(t))
        assert bounds[0] == bounds[1]
        assert 43 <= bounds[0] <= ALONE_MAX_US
    finally:
        loop.close()


def test_wait_that_is_not_the_engines_is_called() -> None:
    """A wait other than an Engine's wait_polls is called as given, with the
    budget; a nonzero return is a hit followed by the sub's drain."""
    calls: list[int] = []
    drained: list[int] = []

    class Sub(_Sub):
        inflight = {1: object()}

        def drain(self) -> None:
            drained.append(1)
            self.inflight = {}

    def wait(us: int) -> int:
        calls.append(us)
        return 1

    async def main() -> None:
        poller = Poller(Sub(), wait, asyncio.get_running_loop(), "poll", 7)
        assert isinstance(poller, _cyx.Poller)
        poller.kick()
        poller.kick()  # scheduled once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert calls == [500]  # "poll": at least POLL_SLICE_US
        assert drained == [1]
        assert (poller.hits, poller.misses) == (1, 0)

    asyncio.run(main())

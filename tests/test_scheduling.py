"""PeerScheduler: ordering, limits, the oversize rule, discard, drain, and
random operation sequences checked against its invariants."""

from __future__ import annotations

import random

import pytest

from aioxfer.scheduling import PeerScheduler


def test_unlimited_admits_everything() -> None:
    s: PeerScheduler[str] = PeerScheduler()
    assert all(s.admit(f"r{i}", 1 << 30) for i in range(100))
    assert (s.in_flight_requests, s.in_flight_bytes, s.queued) == (100, 100 << 30, 0)
    assert s.release(1 << 30) == []
    assert s.in_flight_requests == 99


def test_request_limit_fifo() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_requests=2)
    assert s.admit("a", 10)
    assert s.admit("b", 10)
    assert not s.admit("c", 10)
    assert not s.admit("d", 10)
    assert (s.queued, s.queued_bytes) == (2, 20)
    assert s.release(10) == ["c"]
    assert s.release(10) == ["d"]
    assert s.release(10) == []
    assert s.release(10) == []
    assert (s.in_flight_requests, s.in_flight_bytes, s.queued) == (0, 0, 0)


def test_byte_limit_admits_as_many_as_fit() -> None:
    s: PeerScheduler[int] = PeerScheduler(max_bytes=100)
    assert s.admit(0, 80)
    for i in range(1, 5):
        assert not s.admit(i, 30)
    assert s.in_flight_bytes == 80
    # All freed: four 30-byte requests need 120, so three go and one waits.
    assert s.release(80) == [1, 2, 3]
    assert s.in_flight_bytes == 90
    assert s.release(30) == [4]
    assert s.queued == 0


def test_priority_first_fifo_within() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_requests=1)
    assert s.admit("running", 1)
    for name, prio in [("bulk1", 0), ("hi1", 5), ("bulk2", 0), ("mid", 2), ("hi2", 5)]:
        assert not s.admit(name, 1, prio)
    out = []
    for _ in range(5):
        out += s.release(1)
    assert out == ["hi1", "hi2", "mid", "bulk1", "bulk2"]


def test_high_priority_overtakes_bulk_backlog() -> None:
    # 1 GiB of bulk prefetch queued behind a 256 MiB byte budget: a small
    # latency-critical request posted last is admitted at the first release,
    # ahead of every queued bulk chunk.
    chunk = 64 << 20
    s: PeerScheduler[str] = PeerScheduler(max_bytes=256 << 20)
    admitted = [f"bulk{i}" for i in range(16) if s.admit(f"bulk{i}", chunk)]
    assert admitted == ["bulk0", "bulk1", "bulk2", "bulk3"]
    assert not s.admit("urgent", 4096, priority=10)  # no room now: it waits...
    assert s.release(chunk) == ["urgent"]  # ...but goes first when room frees
    # The urgent request takes 4 KiB of the freed 64 MiB: bulk waits for more.
    assert s.release(chunk) == ["bulk4"]


def test_new_higher_priority_goes_at_once_when_it_fits() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_bytes=100)
    assert s.admit("a", 50)
    assert not s.admit("big-bulk", 80)  # waits for 80 bytes
    assert s.admit("urgent", 10, priority=1)  # outranks the queue and fits now
    assert not s.admit("bulk", 10)  # same priority as the queue: behind it
    assert s.in_flight_bytes == 60


def test_head_of_line_is_not_starved() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_bytes=100)
    assert s.admit("a", 60)
    assert not s.admit("big", 90)
    assert not s.admit("small", 11)  # would fit now, but must not pass "big"
    assert s.release(60) == ["big"]  # 90 in flight: 11 more would exceed 100
    assert s.release(90) == ["small"]


def test_oversize_runs_alone() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_bytes=100)
    assert s.admit("huge", 1000)  # idle: admitted although over the limit
    assert not s.admit("small", 1)
    assert s.release(1000) == ["small"]

    assert not s.admit("huge2", 1000)  # "small" in flight: waits until idle
    assert not s.admit("small2", 1)
    assert s.release(1) == ["huge2"]
    assert s.in_flight_bytes == 1000
    assert s.release(1000) == ["small2"]


def test_zero_byte_requests_count_against_requests() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_bytes=10, max_requests=2)
    assert s.admit("n1", 0)
    assert s.admit("n2", 0)
    assert not s.admit("n3", 0)
    assert s.release(0) == ["n3"]


def test_discard() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_requests=1)
    assert s.admit("a", 5)
    assert not s.admit("b", 7)
    assert not s.admit("c", 11)
    assert s.discard("b")
    assert not s.discard("b")  # already gone
    assert not s.discard("a")  # admitted, not queued
    assert not s.discard("zzz")
    assert (s.queued, s.queued_bytes) == (1, 11)
    assert s.release(5) == ["c"]
    # A discarded item may be queued again later, as a new request.
    assert not s.admit("b", 7)
    assert s.release(11) == ["b"]


def test_discard_head_then_release_admits_behind() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_bytes=100)
    assert s.admit("a", 50)
    assert not s.admit("big", 90)
    assert not s.admit("small", 10)
    assert s.discard("big")
    assert s.release(50) == ["small"]


def test_discard_head_then_admit_ready_admits_behind_at_once() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_bytes=100)
    assert s.admit("a", 50)
    assert not s.admit("big", 90)
    assert not s.admit("small", 10)
    assert not s.admit("medium", 45)
    assert s.admit_ready() == []  # big at the head does not fit: nothing passes it
    assert s.discard("big")
    assert s.admit_ready() == ["small"]  # 50 + 10 fit, 50 + 10 + 45 do not
    assert (s.in_flight_requests, s.in_flight_bytes, s.queued) == (2, 60, 1)
    assert s.release(50) == ["medium"]


def test_drain() -> None:
    s: PeerScheduler[str] = PeerScheduler(max_requests=1)
    assert s.admit("a", 1)
    for name, prio in [("x", 0), ("y", 3), ("z", 0), ("w", 3)]:
        s.admit(name, 2, prio)
    s.discard("z")
    assert s.drain() == ["y", "w", "x"]
    assert (s.queued, s.queued_bytes) == (0, 0)
    assert s.drain() == []
    # In-flight requests are still released normally after a drain.
    assert (s.in_flight_requests, s.in_flight_bytes) == (1, 1)
    assert s.release(1) == []
    assert s.admit("b", 1)


def test_errors() -> None:
    with pytest.raises(ValueError):
        PeerScheduler(max_bytes=0)
    with pytest.raises(ValueError):
        PeerScheduler(max_requests=0)
    s: PeerScheduler[str] = PeerScheduler(max_requests=1)
    with pytest.raises(ValueError):
        s.release(0)  # nothing in flight
    with pytest.raises(ValueError):
        s.admit("a", -1)
    assert s.admit("a", 4)
    with pytest.raises(ValueError):
        s.release(5)  # more than in flight
    assert not s.admit("b", 1)
    with pytest.raises(ValueError):
        s.admit("b", 1)  # queued twice


def test_many_items() -> None:
    n = 20_000
    s: PeerScheduler[int] = PeerScheduler(max_requests=4)
    sizes = {i: (i * 7919) % 1000 for i in range(n)}
    prios = {i: i % 3 for i in range(n)}
    running = [i for i in range(n) if s.admit(i, sizes[i], prios[i])]
    assert running == [0, 1, 2, 3]
    for i in range(4, n, 5):
        assert s.discard(i)
    order: list[int] = []
    while running:
        done = running.pop(0)
        got = s.release(sizes[done])
        running += got
        order += got
    want = sorted(
        (i for i in range(4, n) if (i - 4) % 5), key=lambda i: (-prios[i], i)
    )
    assert order == want
    assert (s.queued, s.queued_bytes, s.in_flight_requests, s.in_flight_bytes) == (0, 0, 0, 0)


@pytest.mark.parametrize("seed", range(30))
def test_random_sequences_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    max_bytes = rng.choice([None, 100, 1000])
    max_requests = rng.choice([None, 1, 3, 8])
    s: PeerScheduler[int] = PeerScheduler(max_bytes=max_bytes, max_requests=max_requests)
    sizes: dict[int, int] = {}
    prios: dict[int, int] = {}
    queued: dict[int, int] = {}  # model: item -> arrival order
    running: list[int] = []
    out: list[int] = []  # every item that came out (admitted, drained or discarded)
    arrival = 0

    def check() -> None:
        assert s.in_flight_requests == len(running)
        assert s.in_flight_bytes == sum(sizes[i] for i in running)
        assert s.queued == len(queued)
        assert s.queued_bytes == sum(sizes[i] for i in queued)
        if max_requests is not None:
            assert s.in_flight_requests <= max_requests
        if max_bytes is not None and s.in_flight_bytes > max_bytes:
            assert s.in_flight_requests == 1, "over the byte budget, not alone"
        if queued:
            assert running, "queued with nothing in flight: nothing would admit it"

    def took(items: list[int]) -> None:
        # The queue's order: priority first, then arrival.
        best = sorted(queued, key=lambda i: (-prios[i], queued[i]))
        assert items == best[: len(items)]
        for i in items:
            del queued[i]
        running.extend(items)
        out.extend(items)

    for step in range(600):
        op = rng.random()
        if op < 0.5:
            item = step
            sizes[item] = rng.choice([0, 1, 10, 50, 99, 100, 400, 2000])
            prios[item] = rng.choice([0, 0, 0, 1, 5])
            if s.admit(item, sizes[item], prios[item]):
                assert not queued or max(prios[i] for i in queued) < prios[item]
                running.append(item)
                out.append(item)
            else:
                queued[item] = arrival
            arrival += 1
        elif op < 0.85 and running:
            done = running.pop(rng.randrange(len(running)))
            took(s.release(sizes[done]))
        elif op < 0.97 and queued:
            victim = rng.choice(list(queued))
            assert s.discard(victim)
            assert not s.discard(victim)
            del queued[victim]
            out.append(victim)
        elif op >= 0.99:
            drained = s.drain()
            assert drained == sorted(queued, key=lambda i: (-prios[i], queued[i]))
            queued.clear()
            out.extend(drained)
        check()

    # Finish everything: every item comes out exactly once.
    while running:
        took(s.release(sizes[running.pop(0)]))
        check()
    assert not queued
    assert sorted(out) == sorted(sizes)
    assert len(out) == len(set(out))

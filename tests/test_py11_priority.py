"""A request's ``priority`` is checked the same way on every path: an integer
(numpy's too) or TypeError, raised by write/read before anything is made or
counted, whether the peer has limits (the scheduled path) or not (the
compiled fast path of _cyx.Poster and _cyx.Submitter, which once ignored a
non-integer priority), and for a local backend's region alike."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
from conftest import within

import aioxfer
from aioxfer.backends import BackendRegion, LocalBackend, add_backend, register_region

MakeAgent = Callable[..., Awaitable[Any]]

BAD = [1.5, None, "1", float("nan")]


async def _pair(make_agent: MakeAgent, **kw: Any) -> tuple[Any, Any, Any, Any]:
    """(initiator, its peer, a 64 KiB local region, the target's 64 KiB region)."""
    target = await make_agent("target")
    init = await make_agent("init", **kw)
    peer = await within(init.connect(target.address))
    target.alloc(1 << 16, name="r")
    await within(peer.refresh())
    return init, peer, init.alloc(1 << 16, name="l"), peer.region("r")


def _counts(init: Any, peer: Any) -> tuple[Any, ...]:
    sub = init._sub
    c = peer._counters
    return (sub.posted, len(sub.inflight), len(sub._pending), c.posted, c.inflight,
            c.inflight_bytes, c.queued)


def _requests(init: Any, local: Any, remote: Any) -> list[tuple[str, Callable[..., Any]]]:
    """Every way a request to the peer is posted, each taking priority=."""
    lst = aioxfer.SegmentList(local, np.array([0, 8192], np.uint64),
                              np.array([4096, 4096], np.uint64))
    rst = aioxfer.SegmentList(remote, np.array([0, 16384], np.uint64),
                              np.array([4096, 4096], np.uint64))
    offs = np.array([0, 4096], np.uint64)
    return [
        ("write", lambda p: init.write(local[0:4096], remote[0:4096], priority=p)),
        ("read", lambda p: init.read(local[0:4096], remote[0:4096], priority=p)),
        ("Agent.write", lambda p: aioxfer.Agent.write(init, local[0:4096], remote[0:4096],
                                                      priority=p)),
        ("Agent.read", lambda p: aioxfer.Agent.read(init, local[0:4096], remote[0:4096],
                                                    priority=p)),
        ("write notify", lambda p: init.write(local[0:4096], remote[0:4096], notify=b"n",
                                              priority=p)),
        ("write lists", lambda p: init.write(lst, rst, priority=p)),
        ("read lists", lambda p: init.read(lst, rst, priority=p)),
        ("post_arrays", lambda p: init.post_arrays("write", local, remote, offs, offs, 4096,
                                                   priority=p)),
    ]


@pytest.mark.parametrize("limits", [False, True], ids=["no-limits", "limits"])
async def test_non_integer_priority_raises_on_every_path(make_agent: MakeAgent,
                                                         limits: bool) -> None:
    kw = {"peer_max_bytes": 1 << 20} if limits else {}
    init, peer, local, remote = await _pair(make_agent, **kw)
    assert (peer._sched is not None) is limits
    if not limits:  # the compiled write/read stand for Agent.write/read here
        assert type(init.write.__self__) is aioxfer._cyx.Poster
    await within(init.write(local[0:4096], remote[0:4096]))  # started, warm
    before = _counts(init, peer)
    for name, post in _requests(init, local, remote):
        for bad in BAD:
            with pytest.raises(TypeError, match="priority must be an integer"):
                post(bad)
            assert _counts(init, peer) == before, (name, bad)
    # An integer of any integer type is taken, and the requests complete.
    for name, post in _requests(init, local, remote):
        for good in (0, 7, -3, np.int64(2), True):
            res = await within(post(good))
            assert res.nbytes in (4096, 8192), (name, good)
    st = peer.statistics()
    assert st.in_flight == 0 and st.queued == 0


# ------------------------------------------------------------ a local backend

class _Seg:
    __slots__ = ("region", "key", "offset", "length")

    def __init__(self, region: _Region, key: str) -> None:
        self.region = region
        self.key = key
        self.offset = 0
        self.length: int | None = None


class _Region(BackendRegion):
    kind = "py11-mem"

    def __init__(self, backend: _Backend, name: str) -> None:
        super().__init__(backend, name)
        self.blobs: dict[str, bytes] = {}

    def __getitem__(self, key: str) -> _Seg:
        self._check()
        return _Seg(self, key)


class _Backend(LocalBackend):
    name = "py11-mem"
    kind = "py11-mem"

    def register(self, name: str = "mem") -> _Region:
        region = _Region(self, name)
        self._add_region(region)
        return region

    def far_segments(self, far: Any, op: str) -> Sequence[Any]:
        return (far,) if isinstance(far, _Seg) else far

    async def put(self, src: memoryview, far: _Seg) -> None:
        far.region.blobs[far.key] = bytes(src)

    async def get(self, dst: memoryview, far: _Seg) -> None:
        dst[:] = far.region.blobs[far.key]


add_backend("py11-mem-test", _Backend)


async def test_non_integer_priority_raises_for_a_local_backend(make_agent: MakeAgent) -> None:
    """A local backend's request (Agent.write/read hand it to backend.post)
    is checked as a peer's is, before the backend makes its transfer (its
    slots' heap took a float and raised for None or a str only in its task)."""
    agent = await make_agent("prio")
    region = register_region(agent, "py11-mem-test")
    src = agent.register(bytearray(64))
    for bad in BAD:
        with pytest.raises(TypeError, match="priority must be an integer"):
            agent.write(src[0:64], region["k"], priority=bad)
        with pytest.raises(TypeError, match="priority must be an integer"):
            agent.read(src[0:64], region["k"], priority=bad)
    assert region.backend.statistics().transfers_posted == 0
    await within(agent.write(src[0:64], region["k"], priority=np.int64(3)))
    await within(agent.read(src[0:64], region["k"], priority=1))
    assert region.backend.statistics().transfers_posted == 2

"""The compiled hot path's shortcuts keep Python's semantics: a class's
``__await__ = _cyx.eager_await`` (installed as its C await slot at its first
await) stays replaceable and removable as any ``__await__``; the compiled
write/read compare segment lengths as integers with the Python method's
outcome; the batch lists keep working after long batches are posted."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import pytest
from conftest import within
from test_hotpath import _Host  # its eager() posts and answers "done"

import aioxfer
from aioxfer import _cyx

MakeAgent = Callable[..., Awaitable[Any]]


class _Fut(asyncio.Future[Any]):
    __slots__ = ("_host", "_posted")


async def test_compiled_await_slot_stays_a_python_attribute() -> None:
    loop = asyncio.get_running_loop()
    host = _Host()

    def fut(posted: bool) -> _Fut:
        f = _Fut(loop=loop)
        f._host, f._posted = host, posted
        return f

    _Fut.__await__ = _cyx.eager_await  # type: ignore[assignment]
    try:
        t = fut(False)
        assert await t == "done" and host.eagers == [t]  # the first await: slot installed
        u = fut(False)
        assert await u == "done" and host.eagers == [t, u]  # through the slot
        seen: list[Any] = []

        def mine(self: Any) -> Generator[Any, None, Any]:
            seen.append(self)
            return "mine"
            yield  # a generator

        _Fut.__await__ = mine  # type: ignore[assignment]
        v = fut(False)
        assert await v == "mine" and seen == [v] and host.eagers == [t, u]
        _Fut.__await__ = _cyx.eager_await  # type: ignore[assignment]
        w = fut(False)
        assert await w == "done" and host.eagers == [t, u, w]

        class Sub(_Fut):  # inherits __await__: awaited through the generic slot
            __slots__ = ()

        x = Sub(loop=loop)
        x._host, x._posted = host, False
        assert await x == "done" and host.eagers == [t, u, w, x]
    finally:
        del _Fut.__await__
    # asyncio.Future's own await again: no eager post.
    y = fut(False)
    loop.call_soon(y.set_result, 7)
    assert await y == 7 and host.eagers[-1] is x


async def test_transfer_await_in_a_generator_based_loop(make_agent: MakeAgent) -> None:
    """A Transfer awaited once the slot is installed also works where a
    generator drives it by hand (the await protocol's iterator)."""
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await within(init.connect(target.address))
    target.alloc(1 << 16, name="r")
    await within(peer.refresh())
    local, remote = init.alloc(1 << 16, name="l"), peer.region("r")
    assert (await init.write(local[0:4096], remote[0:4096])).nbytes == 4096
    t = init.write(local[0:4096], remote[0:4096])
    it = t.__await__()
    while True:
        try:
            fut = it.send(None)
        except StopIteration as stop:
            assert stop.value.nbytes == 4096
            break
        assert fut is t
        await asyncio.wait([fut])


async def test_compiled_write_lengths_as_python(make_agent: MakeAgent) -> None:
    """Equal lengths in different int objects take the compiled path; a zero
    length or two different ones reach the Python method and its errors."""
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await within(init.connect(target.address))
    target.alloc(1 << 16, name="r")
    await within(peer.refresh())
    local, remote = init.alloc(1 << 16, name="l"), peer.region("r")
    a, b = local[100:4196], remote[5000:9096]
    assert a.length == b.length == 4096
    assert a.length is not b.length  # (ints past the small-int cache)
    frames: list[str] = []

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            frames.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        tw = init.write(a, b)
        tr = init.read(a, b)
    finally:
        sys.setprofile(None)
    assert "write" not in frames and "read" not in frames, frames
    assert [(await x).nbytes for x in (tw, tr)] == [4096, 4096]
    for post in (init.write, init.read, aioxfer.Agent.write.__get__(init),
                 aioxfer.Agent.read.__get__(init)):
        for x, y in ((local[8:8], remote[8:8]), (local[0:4096], remote[0:4097]),
                     (local[0:4097], remote[0:4096])):
            with pytest.raises(ValueError) as err:
                post(x, y)
            assert "length" in str(err.value) or "empty" in str(err.value), err.value
    assert init.statistics().in_flight == 0


@pytest.mark.parametrize("qd", [8, 9, 64, 256, 257, 600])
async def test_batches_of_every_length_post_and_complete(make_agent: MakeAgent,
                                                         qd: int) -> None:
    """The batch lists emptied in place after each post (their allocation
    kept up to 256 items, freed above): batches around those sizes, one after
    another, each complete with its bytes."""
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await within(init.connect(target.address))
    far = target.alloc(1 << 20, name="r")
    await within(peer.refresh())
    local, remote = init.alloc(1 << 20, name="l"), peer.region("r")
    n = 1024
    for k in range(3):
        local.numpy()[:] = k + 1
        ts = [init.write(local[(i * n) % (1 << 20):(i * n) % (1 << 20) + n],
                         remote[(i * n) % (1 << 20):(i * n) % (1 << 20) + n])
              for i in range(qd + k)]
        res = await within(asyncio.gather(*ts))
        assert [r.nbytes for r in res] == [n] * (qd + k)
        assert not init._sub._pending and not init._sub._pending_t
        moved = min((qd + k) * n, 1 << 20)
        assert bytes(far.memoryview[0:moved]) == bytes([k + 1]) * moved

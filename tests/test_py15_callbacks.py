"""The drain's batched wake-ups for a future whose callback fields were not
probed (not the C Future of CPython 3.11-3.14, or a layout the probe did
not recognise): _take_callbacks takes its done callbacks off with
remove_done_callback, whose comparisons run a callback's ``__eq__``. One
that raised escaped the drain (its finally freed the batch's other records
unread: those transfers never completed; rev13's finding, fixed then for the
C Future's own path only). Now the error is reported as a drain callback's
error is, the batch completes, and each callback runs once (one that stayed
on the future is run by it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from conftest import pattern, transport_kwargs, wait_until, within

from aioxfer import _cyx

KiB = 1024


@pytest.fixture
def removal_path() -> Iterator[None]:
    previous = _cyx._force_cb_fields(0)
    try:
        yield
    finally:
        _cyx._force_cb_fields(previous)


async def _writes_over_tcp(make_agent, seed: int):
    """An initiator (progress "sleep": the drain's batched wake-ups) writing
    4 KiB pieces of a 256 KiB source to a target's region over tcp: the
    initiator, a function making the i-th piece's transfer, and a list of the
    loop's exception-handler contexts (caught from here on; restore() puts
    the previous handler back)."""
    tkw = transport_kwargs("tcp")
    target = await make_agent("target", progress="sleep", **tkw)
    init = await make_agent("init", progress="sleep", **tkw)
    assert init._sub._engine.batch_wakeups
    peer = await within(init.connect(target.address))
    target.alloc(256 * KiB, name="dst")
    await within(peer.refresh())
    remote = peer.region("dst")
    src = init.register(pattern(256 * KiB, seed), name="src")
    loop = asyncio.get_running_loop()
    caught: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: caught.append(context))

    def write(i: int):
        return init.write(src[i * 4 * KiB:(i + 1) * 4 * KiB], remote[i * 4 * KiB:(i + 1) * 4 * KiB])

    def restore() -> None:
        loop.set_exception_handler(previous)

    return write, caught, restore


class _RaisingEq:
    """A done callback whose ``==`` raises for anything but itself."""

    def __init__(self, ran: list[object]) -> None:
        self.ran = ran

    def __call__(self, fut: object) -> None:
        self.ran.append(("eq", fut))

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        raise RuntimeError("__eq__ of a callback")

    __hash__ = object.__hash__


@pytest.mark.parametrize("raising_first", [True, False])
async def test_removal_path_reports_a_raising_eq_and_completes_the_batch(
        make_agent, removal_path: None, raising_first: bool) -> None:
    write, caught, restore = await _writes_over_tcp(make_agent, 7)
    try:
        ts = [write(i) for i in range(16)]
        ran: list[object] = []
        cbs = [_RaisingEq(ran), lambda fut: ran.append(("plain", fut))]
        for cb in cbs if raising_first else cbs[::-1]:
            ts[0].add_done_callback(cb)
        done, pending = await asyncio.wait(ts, timeout=10)
        assert not pending, f"{len(pending)} transfers never completed"
        await wait_until(lambda: len(ran) >= 2, what="both callbacks ran")
        await asyncio.sleep(0.05)  # and neither runs twice
    finally:
        restore()
    assert sorted(ran, key=str) == sorted([("eq", ts[0]), ("plain", ts[0])], key=str)
    errors = [c.get("exception") for c in caught]
    assert any(isinstance(e, RuntimeError) and "__eq__" in str(e) for e in errors), caught
    for t in ts:
        assert t.result().nbytes == 4 * KiB


async def test_removal_path_batches_plain_callbacks(make_agent, removal_path: None) -> None:
    """Without a raising ``__eq__`` the removal path batches every callback
    into the drain's handle, each run once (an error named with its future)."""
    write, caught, restore = await _writes_over_tcp(make_agent, 9)
    ran: list[tuple[int, int]] = []
    try:
        ts = [write(i) for i in range(8)]
        for i, t in enumerate(ts):
            for k in range(3):
                def cb(fut: object, i: int = i, k: int = k) -> None:
                    ran.append((i, k))
                    if (i, k) == (2, 1):
                        raise ValueError("callback 2")
                t.add_done_callback(cb)
        for t in ts:
            await within(t)
        await wait_until(lambda: len(ran) >= 24, what="every callback ran")
        await asyncio.sleep(0.05)
    finally:
        restore()
    assert sorted(ran) == [(i, k) for i in range(8) for k in range(3)]
    assert len(caught) == 1 and isinstance(caught[0]["exception"], ValueError)
    assert caught[0].get("future") is ts[2]  # run in the drain's handle

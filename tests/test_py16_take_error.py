"""The drain's removal path (futures whose callback fields were not probed:
_take_callbacks takes their done callbacks off with remove_done_callback,
whose comparisons run a callback's ``__eq__``) keeps the first error it met
for its drain to report (rev15's nit). It was one module-level slot: a drain
of another engine that ran in between (here: from a property the removal
path reads after it stored the error; a finalizer run by a garbage
collection there is the same) took the first engine's error and reported it
as its own, and the first drain reported nothing. Now each Engine keeps its
own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import pattern, transport_kwargs, within

from aioxfer import _cyx
from aioxfer.transfer import Transfer

KiB = 1024


@pytest.fixture
def removal_path() -> Iterator[None]:
    previous = _cyx._force_cb_fields(0)
    try:
        yield
    finally:
        _cyx._force_cb_fields(previous)


class _RaisingEq:
    """A done callback whose ``==`` raises for anything but itself."""

    def __init__(self, ran: list[object]) -> None:
        self.ran = ran

    def __call__(self, fut: object) -> None:
        self.ran.append("a-eq")

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        raise RuntimeError("__eq__ of engine a's callback")

    __hash__ = object.__hash__


def _in_ring(agent: Any, write: Any) -> Any:
    """A transfer of agent's, posted, whose completion waits in its engine's
    ring undrained (the loop does not run meanwhile: nothing drains it). The
    post's own look at the ring may find the reply there already and
    complete it: then another."""
    for _ in range(50):
        t = write()
        agent._sub.flush()
        if t.done():
            continue
        deadline = time.monotonic() + 10
        while agent._sub._engine.wait(10_000) == 0:
            assert time.monotonic() < deadline, "no completion in the ring"
        assert not t.done()
        return t
    raise AssertionError("every post completed inside")


async def test_two_engines_errors_stay_apart(make_agent, removal_path: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tkw = transport_kwargs("tcp")
    target = await make_agent("target", progress="sleep", **tkw)
    a = await make_agent("a", progress="sleep", **tkw)
    b = await make_agent("b", progress="sleep", **tkw)
    assert a._sub._engine.batch_wakeups and b._sub._engine.batch_wakeups
    pa = await within(a.connect(target.address))
    pb = await within(b.connect(target.address))
    target.alloc(16 * KiB, name="dst")
    await within(pa.refresh())
    await within(pb.refresh())
    src_a = a.register(pattern(8 * KiB, 3), name="src")
    src_b = b.register(pattern(8 * KiB, 4), name="src")
    loop = asyncio.get_running_loop()
    caught: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: caught.append(context))
    ran: list[object] = []
    during_b: list[list[dict[str, object]]] = []
    try:
        # From here to the two drains nothing awaits: no loop iteration
        # drains either ring behind the test's back.
        tb = _in_ring(b, lambda: b.write(src_b[0:4 * KiB], pb.region("dst")[8 * KiB:12 * KiB]))
        tb.add_done_callback(lambda fut: ran.append("b"))
        ta = _in_ring(a, lambda: a.write(src_a[0:4 * KiB], pa.region("dst")[0:4 * KiB]))
        ta.add_done_callback(_RaisingEq(ran))
        ta.add_done_callback(lambda fut: ran.append("a-plain"))

        real = vars(asyncio.Future)["_callbacks"]
        reads = [0]

        def callbacks(fut: Transfer) -> Any:
            if fut is ta:
                reads[0] += 1
                if reads[0] == 2:
                    # The removal path's second read of ta's callbacks: its
                    # removals ran (one raised) and it kept the error. b's
                    # drain runs now, completing tb on its own removal path
                    # (whose removal does not raise).
                    n = len(caught)
                    b._sub.drain()
                    during_b.append(caught[n:])
            return real.__get__(fut, type(fut))

        monkeypatch.setattr(Transfer, "_callbacks", property(callbacks))
        a._sub.drain()
        monkeypatch.undo()
        assert reads[0] == 2, "ta's drain took the removal path that raised"
        assert ta.done() and tb.done()
        await asyncio.sleep(0.05)  # the drains' handles run the callbacks
    finally:
        loop.set_exception_handler(previous)
    # b's drain reported nothing (it had no error of its own); a's drain
    # reported a's error.
    assert during_b == [[]], f"b's drain reported {during_b!r}"
    errors = [c.get("exception") for c in caught]
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), caught
    assert "engine a" in str(errors[0])
    assert sorted(ran) == ["a-eq", "a-plain", "b"]
    assert ta.result().nbytes == tb.result().nbytes == 4 * KiB
    await asyncio.sleep(0.05)  # (transfers that completed inside their post settle)

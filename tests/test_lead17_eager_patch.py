"""Transfer's await remembers whether its host type's eager is
_cyx.submission_eager (then calls the Submitter directly): an eager patched
on Submission after the first await (monkeypatch, instrumentation) was then
bypassed for good (rev17b); the type's version tag now says it changed.
And agent.write / agent.read (builtin methods since py17) have the
signatures Agent.write / Agent.read document."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pair_64k

from aioxfer import _cyx
from aioxfer.submission import Submission
from aioxfer.transfer import Transfer


async def test_eager_patched_after_the_first_await_is_called(
    make_agent: Callable[..., Awaitable[Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    init, _peer, local, remote = await pair_64k(make_agent)
    await init.write(local[0:4096], remote[0:4096])  # the host type remembered
    seen: list[int] = []

    def spy(self: Submission, t: Transfer) -> None:
        seen.append(t.req_id)
        _cyx.submission_eager(self, t)

    monkeypatch.setattr(Submission, "eager", spy)
    ids = []
    for _ in range(3):
        t = init.write(local[0:4096], remote[0:4096])
        ids.append(t.req_id)
        await t
    assert seen == ids
    monkeypatch.undo()  # and back: called directly again, each still awaited
    seen.clear()
    for _ in range(3):
        await init.write(local[0:4096], remote[0:4096])
    assert seen == []


async def test_write_and_read_signatures(make_agent: Callable[..., Awaitable[Any]]) -> None:
    agent = await make_agent("sig")
    assert str(inspect.signature(agent.write)) == "(src, dst, *, notify=None, priority=0)"
    assert str(inspect.signature(agent.read)) == "(dst, src, *, priority=0)"

"""Transfer's await calls its Submission host's Submitter._eager directly when
the host's eager is _cyx.submission_eager as an attribute lookup finds it;
a host whose eager is another (a subclass's own) gets its own eager called,
as before."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from conftest import pair_64k

from aioxfer import _cyx
from aioxfer.submission import Submission
from aioxfer.transfer import Transfer


class Counting(Submission):
    """A Submission whose eager is its own (the same slots: its class can be
    swapped in on a live agent)."""

    __slots__ = ()
    seen: list[int] = []

    def eager(self, t: Transfer) -> None:
        Counting.seen.append(t.req_id)
        _cyx.submission_eager(self, t)


async def test_a_host_with_its_own_eager_gets_it_called(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    assert type(sub).eager is _cyx.submission_eager
    for _ in range(3):  # the direct call (and the host type it remembers)
        assert (await init.write(local[0:4096], remote[0:4096])).nbytes == 4096
    Counting.seen.clear()
    sub.__class__ = Counting
    try:
        ids = []
        for _ in range(3):
            t = init.write(local[0:4096], remote[0:4096])
            ids.append(t.req_id)
            assert (await t).nbytes == 4096
        assert Counting.seen == ids  # its own eager, at each await
    finally:
        sub.__class__ = Submission
    Counting.seen.clear()
    assert (await init.write(local[0:4096], remote[0:4096])).nbytes == 4096
    assert Counting.seen == []

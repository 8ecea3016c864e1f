"""The agent's write and read are the Poster's (a builtin method bound to
it): called with two positional arguments and no keyword they go straight to
the compiled usual case (no argument parsing); any other call goes to the
Poster's _write / _read, the same methods with their full signatures."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pair_64k

from aioxfer import _cyx


async def test_write_and_read_are_bound_to_the_poster(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    init, peer, local, remote = await pair_64k(make_agent)
    poster = init.write.__self__
    assert type(poster) is _cyx.Poster and init.read.__self__ is poster
    assert init.write.__name__ == "write" and init.read.__name__ == "read"
    assert type(init.write).__name__ == "builtin_function_or_method"  # as the bound def was
    sub = init._sub
    local.numpy()[:4096] = 5
    # Two positional arguments, keywords, and the Python method's shapes.
    calls: list[Callable[[], Any]] = [
        lambda: init.write(local[0:4096], remote[0:4096]),
        lambda: init.write(local[0:4096], remote[4096:8192], priority=3),
        lambda: init.write(src=local[0:4096], dst=remote[8192:12288]),
        lambda: init.read(local[4096:8192], remote[0:4096]),
        lambda: init.read(local[8192:12288], src=remote[4096:8192], priority=-1),
    ]
    for call in calls:
        t = call()
        assert type(sub._pending[-1]) is _cyx.PostItem  # the compiled usual case
        assert (await t).nbytes == 4096
    assert bytes(local.memoryview[4096:12288]) == b"\x05" * 8192
    t = init.write(local[0:16], remote[0:16], notify=b"n")  # the Python method's
    assert type(sub._pending[-1]) is tuple and (await t).nbytes == 16
    assert (await poster.write(local[0:8], remote[0:8])).nbytes == 8
    # Calls the signatures refuse: TypeError, nothing posted.
    posted = sub.posted
    bad_calls: list[Callable[[], Any]] = [
        lambda: init.write(local[0:8]),
        lambda: init.write(local[0:8], remote[0:8], 1),
        lambda: init.write(local[0:8], remote[0:8], bogus=1),
        lambda: init.read(local[0:8], remote[0:8], notify=b"n"),
        lambda: init.read(),
        lambda: init.write(local[0:8], dst=remote[0:8], src=local[0:8]),
    ]
    for bad in bad_calls:
        with pytest.raises(TypeError):
            bad()
    assert sub.posted == posted

"""A tcp peer's other connections join from a task a timer makes
_JOIN_DELAY after connect returned (Connector._start_joins), none made in
the caller's step (ini35): they still join; meanwhile the peer counts as
joining (Connector.joins_pending); an agent or a peer closed before that
timer makes none and leaves nothing open."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from conftest import within

from aioxfer import connector

MiB = 1 << 20


def _joins() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("aioxfer-join-")]


def _sockets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            what = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue
        if what.startswith("socket:"):
            out.add(what)
    return out


async def test_joins_begin_after_connect_returned(make_agent: Any) -> None:
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    peer = await within(init.connect(target.address))
    assert _joins() == []  # (made by a timer, _JOIN_DELAY later)
    assert init._connector.joins_pending == 1  # joining all the same
    for _ in range(400):
        if init.statistics().native_conns == 4 and not _joins():
            break
        await asyncio.sleep(0.005)
    assert init.statistics().native_conns == 4
    assert init._connector.joins_pending == 0
    assert peer._rails_down == set()


@pytest.mark.parametrize("how", ["agent", "peer"])
async def test_closed_before_the_joins_begin(make_agent: Any, how: str) -> None:
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=4)
    await init.start()
    before = _sockets()
    peer = await within(init.connect(target.address))
    await (init.aclose() if how == "agent" else peer.aclose())
    await asyncio.sleep(connector._JOIN_DELAY * 20)
    assert _joins() == []
    assert init._connector.joins_pending == 0
    await asyncio.sleep(0.05)
    if how == "peer":
        assert init.statistics().native_conns == 0
    assert _sockets() <= before

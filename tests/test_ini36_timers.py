"""A closed agent leaves nothing of its own on its loop (ini36).

Connector's timers (the Hellos made again after a predial, a tcp peer's
joins begun a moment after connect, the peer.connected line) used to stay
scheduled after the agent closed: in a process that makes agents one after
another (run.py's connect samples), one came due in the next agent's
connect, and a callback ready there keeps the handshake's reads from
polling (protocol._spin_recv_into). Closing takes them off the loop, and
does at once what they would still have done (the line is logged, the
joins' count goes back to 0).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import within

from aioxfer import connector

MiB = 1 << 20


def _ours(handle: asyncio.Handle, objs: tuple[object, ...]) -> bool:
    cb: Any = handle._callback  # type: ignore[attr-defined]
    return getattr(cb, "__self__", None) in objs or any(
        a in objs for a in (handle._args or ())  # type: ignore[attr-defined]
    )


def _live(loop: asyncio.AbstractEventLoop, objs: tuple[object, ...]) -> list[asyncio.Handle]:
    handles = (*loop._scheduled, *loop._ready)  # type: ignore[attr-defined]
    return [h for h in handles if not h.cancelled() and _ours(h, objs)]


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")])
async def test_closed_agent_leaves_no_timer(make_agent: Any, transports: tuple[str, ...]) -> None:
    """Connect, a first write, close at once: none of the closed agent's
    (its connector's) handles is left scheduled or ready."""
    loop = asyncio.get_running_loop()
    target = await make_agent("target", transports=transports)
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=transports)
    src = init.alloc(MiB, name="src")
    src.numpy()[:4096] = 7
    peer = await within(init.connect(target.address))
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert (dst.numpy()[:4096] == 7).all()
    cn = init._connector
    assert _live(loop, (cn, init)), "a connect schedules the connector's timers"
    await within(init.aclose())
    assert _live(loop, (cn, init)) == []
    # A later agent's connect and write in the same loop: no handle of the
    # closed one comes due in it.
    again = await make_agent("again", transports=transports)
    src2 = again.alloc(MiB, name="src")
    peer2 = await within(again.connect(target.address))
    await within(again.write(src2[0:4096], peer2.region("dst")[0:4096]))
    assert _live(loop, (cn, init)) == []


@pytest.mark.parametrize("conns", [1, 3])
async def test_close_does_what_the_timers_would(
    make_agent: Any, capsys: Any, monkeypatch: Any, conns: int
) -> None:
    """Closed before its connect's timer came due (tcp; the timers put a
    minute off): with one connection, the peer.connected line is logged all
    the same; with 3, the joins' count is back to 0 (an agent closed first
    joins nothing, says nothing). The timers are gone."""
    monkeypatch.setattr(connector, "_JOIN_DELAY", 60.0)
    monkeypatch.setattr(connector, "_LOG_DELAY", 60.0)
    loop = asyncio.get_running_loop()
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=conns)
    capsys.readouterr()
    await within(init.connect(target.address))
    cn = init._connector
    assert cn.joins_pending == (conns > 1)
    # The joins' timer (they log once joined), or the line's; and prepare's.
    assert len(_live(loop, (cn, init))) == 2
    await within(init.aclose())
    assert cn.joins_pending == 0
    assert _live(loop, (cn, init)) == []
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "peer.connected" in ln]
    assert len(lines) == (conns == 1), lines
    if lines:
        assert f"address={target.address}" in lines[0] and "conns=1" in lines[0], lines

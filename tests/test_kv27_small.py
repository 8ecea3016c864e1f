"""Small costs on hot paths (kv27): a tcp connection's TCP_NODELAY was set
twice (Server._join_now, then again in Server._serve), and Members.emit
formatted its debug line's fields (an f-string of the incarnation) for
every membership event even when debug lines are not written."""

from __future__ import annotations

import collections
import logging
from typing import Any

import pytest
from conftest import within

import aioxfer.members
import aioxfer.serving
from aioxfer.discovery import PeerJoined


async def test_tcp_nodelay_is_set_once_per_accepted_connection(
        make_agent: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real setsockopt runs; the test counts the calls per socket of
    the connections the target accepts (before: 2 for each one _serve
    handled, the connect's first, its metadata connection)."""
    calls: collections.Counter[int] = collections.Counter()
    real = aioxfer.serving.nodelay

    def counting(sock: Any) -> None:
        calls[id(sock)] += 1
        real(sock)

    monkeypatch.setattr(aioxfer.serving, "nodelay", counting)
    target = await make_agent("kv27-nd-target", transports=("tcp",))
    target.alloc(1 << 16, name="dst")
    init = await make_agent("kv27-nd-init", transports=("tcp",), tcp_connections=2)
    peer = await within(init.connect(target.address))
    assert peer.region("dst").nbytes == 1 << 16
    assert calls, "no accepted connection was counted"
    assert max(calls.values()) == 1, calls


class _Incarnation(int):
    formatted = 0

    def __format__(self, spec: str) -> str:
        type(self).formatted += 1
        return int.__format__(self, spec)


def test_members_emit_formats_nothing_when_debug_is_filtered() -> None:
    log = aioxfer.members._log
    if not hasattr(log, "is_enabled_for") or log.is_enabled_for(logging.DEBUG):
        pytest.skip("debug lines are written here (AIOXFER_LOG_LEVEL=debug)")
    members = aioxfer.members.Members(
        "kv27-m", peers_by_name={}, refresh_peer=lambda p: None,  # type: ignore[arg-type,return-value]
        drop_peer=lambda p, why: None, closed=lambda: False)
    _Incarnation.formatted = 0
    members.emit(PeerJoined("x", _Incarnation(0x1234), "127.0.0.1:1", ()))
    assert _Incarnation.formatted == 0

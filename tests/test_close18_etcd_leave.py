"""With etcd discovery, a member that closed cleanly was logged by its peers
as a loss (a ``peer.lost`` warning, reason "its etcd key was deleted (it
left, or its lease expired)"): its Agent.aclose revoked its lease before its
engine said goodbye, so the others' Members saw the key deleted and dropped
the still-connected peer first. A clean leave is a leave (``peer.closed``,
info) whatever the transport; a crash (kill -9) is still a loss. Real etcd,
the member a real process."""
from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest
from conftest import within
from test_discovery import (  # noqa: F401  (the fixtures)
    TTL,
    etcd,
    etcd_server,
    is_,
    member,
    next_event,
)

import aioxfer
from aioxfer.discovery import Etcd, PeerJoined, PeerLeft


async def _connected(make_agent: Any, member: Any, etcd: Etcd,  # noqa: F811
                     transports: tuple[str, ...], name: str) -> tuple[Any, Any, Any, Any]:
    a = await make_agent("a", discovery=etcd, transports=transports)
    events = a.membership()
    tgt = await member(name, transports=transports, size=1 << 16)
    await next_event(events, is_(PeerJoined, name, tgt.incarnation), what="PeerJoined")
    peer = await within(a.connect(name))
    src = a.register(bytearray(4096))
    await within(a.write(src[0:4096], peer.region("pool")[0:4096]))
    return a, events, tgt, peer


@pytest.mark.parametrize("transports", [("shm",), ("tcp",)])
async def test_clean_leave_is_logged_as_a_leave(
    make_agent: Any, member: Any, etcd: Etcd, capsys: Any,  # noqa: F811
    transports: tuple[str, ...],
) -> None:
    """Before (shm): peer.lost warning with "its etcd key was deleted"."""
    a, events, tgt, peer = await _connected(make_agent, member, etcd, transports, "tgt")
    capsys.readouterr()
    await tgt.close()  # the member's agent closes cleanly ("quit")
    left = await next_event(events, is_(PeerLeft, "tgt", tgt.incarnation), what="PeerLeft")
    assert left.reason == "left"
    assert peer.lost
    await asyncio.sleep(0.1)  # (a report made late would come by now)
    err = capsys.readouterr().err
    assert "peer.lost" not in err, err
    assert "peer.closed" in err, err
    with pytest.raises(aioxfer.PeerLost):
        await within(a.write(a.register(bytearray(8))[0:8], peer.region("pool")[0:8]))


@pytest.mark.parametrize("transports", [("shm",), ("tcp",)])
async def test_killed_member_is_still_a_loss(
    make_agent: Any, member: Any, etcd: Etcd, capsys: Any,  # noqa: F811
    transports: tuple[str, ...],
) -> None:
    """kill -9: no goodbye; logged as a loss (peer.lost), PeerLeft "left"
    once its lease expires."""
    a, events, tgt, peer = await _connected(make_agent, member, etcd, transports, "crash")
    capsys.readouterr()
    tgt.kill(signal.SIGKILL)
    left = await next_event(events, is_(PeerLeft, "crash", tgt.incarnation), seconds=TTL + 5,
                            what="PeerLeft after lease expiry")
    assert left.reason == "left"
    assert peer.lost
    err = capsys.readouterr().err
    assert "peer.lost" in err, err
    assert "peer.closed" not in err, err


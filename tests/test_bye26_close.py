"""bye26: an agent whose same-host peer runs in its own process (its own
loopback, or two agents of one process: what aioxfer.nixl does) closes at
once, not after close_timeout.

The peer closing first says goodbye (FR_BYE: it unmapped our memory) and
closes its socket; our close then revokes our regions on that connection.
With rev24's drain of any dead target connection, the revocation meeting
the closed socket (EPIPE) killed the connection before its receiver had read
the goodbye queued there, which it then dropped: the revocation waited for
the peer's process to exit (ours), and the close gave up after close_timeout
(agent.close_gave_up, the region quarantined): the +10 s of
tests/test_nixl_faults' churn test and tests/test_compat16_nixl (a race
there). Here the receiver is held deterministically: its notification
credit (max_notify_per_conn=1) is spent on a notification nobody takes, so
the second notification and the goodbye wait in the socket until the
connection dies (as native test_bye26_release does)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from conftest import within

import aioxfer

CLOSE_TIMEOUT = 3.0


async def test_loopback_peer_closed_first_then_agent_closes_at_once(make_agent: Any,
                                                                     capsys: Any) -> None:
    limits = aioxfer.Limits(close_timeout=CLOSE_TIMEOUT, max_notify_per_conn=1)
    a = await make_agent("self", limits=limits)
    src = a.alloc(8192, name="user")
    peer = await within(a.connect(a.address))  # same host: a pidfd-held connection
    assert peer.path == "shm"
    await within(a.write(src[0:4096], peer.region("user")[4096:8192]))
    await within(peer.notify(b"one"))  # the credit: nobody takes it
    second = asyncio.ensure_future(peer.notify(b"two"))  # waits in the socket
    await asyncio.sleep(0.1)
    assert not second.done()
    # As aioxfer.nixl's close: the peers first, then the agent.
    await within(peer.aclose())
    with contextlib.suppress(aioxfer.XferError):  # failed by the close (or landed)
        await within(second)
    t0 = time.monotonic()
    await within(a.aclose(), 30)
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    print(f"close took {took:.3f} s")
    assert "agent.close_gave_up" not in err, err
    assert took < CLOSE_TIMEOUT / 2  # before: CLOSE_TIMEOUT, the region quarantined

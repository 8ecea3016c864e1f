"""A loopback listener accepts at the connect (no TCP_DEFER_ACCEPT, de9d3c37)
only where its accepting step can poll for the Hello (serving.Server.
_join_polled): with progress "sleep" (nothing polled) it still defers the
accept until the Hello is in, as before, so a same-host client whose early
Hello comes a moment after its connect still has its early proof taken (no
Proof round), instead of meeting an ordinary Challenge sent before its
Hello came.

The client is a thread, as another process would be: its connect and its
Hello are not ordered against the target's loop.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
from conftest import within

from aioxfer import metadata, protocol

TOKEN = "rv36-defer"


def _first_frame(got: bytes) -> Any:
    n = int.from_bytes(got[:4], "big")
    return protocol.decode_body(memoryview(got)[4 : 4 + n])


async def _late_hello(agent: Any, delay: float) -> metadata.Challenge:
    """What agent answers first to an early Hello sent delay s after the connect."""
    host, port = agent.address.rsplit(":", 1)
    got: list[bytes] = []

    def client() -> None:
        with socket.create_connection((host, int(port))) as c:
            time.sleep(delay)
            _, frame = protocol._hello(name="rv36-raw", incarnation=1, purpose="data",
                                       token=agent._token, to=c)
            c.sendall(frame)
            c.settimeout(5)
            data = b""
            while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
                more = c.recv(65536)
                assert more, "closed before the first frame"
                data += more
            got.append(data)

    await within(asyncio.get_running_loop().run_in_executor(None, client))
    first = _first_frame(got[0])
    assert isinstance(first, metadata.Challenge)
    return first


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="no TCP_DEFER_ACCEPT")
async def test_sleep_mode_loopback_hello_after_connect_is_answered_early(
    make_agent: Any,
) -> None:
    b = await make_agent("b", transports=("tcp",), token=TOKEN, progress="sleep")
    assert b.address.startswith("127.")
    b.alloc(1 << 20, name="buf")
    for _ in range(2):
        taken = b._server.early.taken
        first = await _late_hello(b, 0.05)
        assert first.early, "an ordinary Challenge went out before the Hello came"
        assert b._server.early.taken == taken + 1


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="no TCP_DEFER_ACCEPT")
async def test_a_loop_that_cannot_poll_defers_too(make_agent: Any) -> None:
    """uvloop (no asyncio ready queue: nothing polled, whatever the
    progress mode; AIOXFER_TEST_LOOPS=uvloop runs this on it): as "sleep"."""
    if getattr(asyncio.get_running_loop(), "_ready", None) is not None:
        pytest.skip("asyncio's own loop polls")
    b = await make_agent("b", transports=("tcp",), token=TOKEN)
    b.alloc(1 << 20, name="buf")
    taken = b._server.early.taken
    assert (await _late_hello(b, 0.05)).early
    assert b._server.early.taken == taken + 1


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="no TCP_DEFER_ACCEPT")
async def test_polling_loopback_listener_still_accepts_at_the_connect(make_agent: Any) -> None:
    """The polling agent's loopback listener is left without the deferred
    accept (tgt36's overlap): its option reads 0."""
    b = await make_agent("b", transports=("tcp",), token=TOKEN)
    polls = getattr(asyncio.get_running_loop(), "_ready", None) is not None
    for lsock in b._lsocks:
        assert (lsock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) == 0) == polls
    s = await make_agent("s", transports=("tcp",), token=TOKEN, progress="sleep")
    for lsock in s._lsocks:
        assert lsock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) > 0

"""The rest of an answer begun in the accepting step is checked before it goes.

Server._answer_now (cxs32) answers a same-host client's handshake as the
connection is accepted: our Accept, the metadata snapshot, META_GO. When
the socket takes only part of it, a serving task sends the rest. That task
starts a loop step (or more) after the snapshot was taken: regions may be
deregistered meanwhile, exactly as when a send waited, so the snapshot must
be checked against our regions before its memfds and META_GO go out
(_send_meta's rule, tests/test_rev29_metafds). Here the deregistration
slips in before the task's first send, while the client drains what it got;
the task's first send then takes all the rest at once. On 9eb5b8e8 the
rest, META_GO included, went out unchecked: the client was told the
connection is ready with a region that is gone (and on the unix socket a
memfd number since closed, maybe reused, would have been passed as its).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from typing import Any

import pytest
from conftest import wait_until, within
from test_cxs32_answer_now import _client, _where

import aioxfer.serving as serving
from aioxfer.protocol import encode_frame


def _unsent(sock: socket.socket) -> int:
    """Bytes we sent on sock that its reader has not taken yet (SIOCOUTQ)."""
    return int(struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0\0\0\0"))[0])


async def test_rest_checked_when_the_task_sends_it_at_once(make_agent: Any,
                                                           monkeypatch: Any) -> None:
    b = await make_agent("b")
    where = _where(b, "unix")
    # Metadata somewhat over a unix socket's send buffer (~208 KiB): the
    # accepting step sends part of it, the rest fits once the client drained.
    keep = [b.register(bytearray(64), name=f"r{i}") for i in range(4500)]
    gone = b.register(bytearray(64), name="gone")
    size = len(encode_frame(b._localmeta.local()[0]))
    seen: dict[str, int] = {}
    serve = serving.Server._serve

    async def late(server: Any, loop: Any, sock: socket.socket, addr: Any, *,
                   answered: Any = None, **k: Any) -> None:
        # (The real serving task, started a little later: what any other
        # callback of the loop may do before its first step.)
        if answered is not None:
            seen["left"] = len(answered[1].data)
            await b.deregister(gone)
            await wait_until(lambda: _unsent(sock) == 0, what="the client drained")
        await serve(server, loop, sock, addr, answered=answered, **k)

    monkeypatch.setattr(serving.Server, "_serve", late)
    got = await within(_client("slow", where, b._token), 60)
    if "left" not in seen:
        pytest.skip(f"the socket took all {size} bytes at once: no task sent the rest")
    if seen["left"] > size - seen["left"]:
        pytest.skip(f"{seen['left']} of {size} bytes left: more than one send takes")
    # The snapshot (naming "gone") went out, then the connection closed
    # instead of META_GO.
    assert "gone" in got.get("regions", ["gone"]), sorted(got)
    assert got.get("go") is not True, (
        "META_GO sent after a region of the snapshot was deregistered")
    del keep

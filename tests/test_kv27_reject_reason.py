"""A server's Reject reason reaches the connecting agent's AccessDenied (and
every log line that names it) escaped and bounded (kv27). It went in as
the server sent it: up to 1024 characters with newlines and terminal
escapes, so a hostile server (or anyone answering on an address an agent
dials) could forge log lines (a newline and a fake record) or flood them."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest
from conftest import within
from test_conn22_handshake import TOKEN, rogue_server

from aioxfer import AccessDenied, metadata, protocol

FORGED = "2026-12-06T00:00:00.000000Z [error    ] peer.token_stolen agent=admin"
HOSTILE = ("no\n" + FORGED + "\r\n\x1b[2K\x1b[1A\u202e" + "x" * 1024)[:1024]


async def _reject_first(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    await protocol.send_frame(loop, sock, metadata.Reject(reason=HOSTILE))


async def _reject_after_proof(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    # A server that challenges as usual and refuses where the Accept belongs.
    await protocol.send_frame(loop, sock, metadata.Challenge(
        version=metadata.PROTOCOL_VERSION, nonce=os.urandom(16)))
    for _ in range(3):
        got = await protocol.recv_frame(loop, sock, protocol.MAX_HANDSHAKE_FRAME)
        if isinstance(got, metadata.Proof):
            break
    else:
        raise AssertionError("no Proof came")
    await protocol.send_frame(loop, sock, metadata.Reject(reason=HOSTILE))


@pytest.mark.parametrize("serve", [_reject_first, _reject_after_proof],
                         ids=["instead-of-challenge", "instead-of-accept"])
async def test_a_hostile_reject_reason_is_escaped_and_bounded(make_agent: Any,
                                                              serve: Any) -> None:
    """Refused in place of the Challenge or of the Accept, with 1024
    characters of forged log lines and terminal escapes."""
    init = await make_agent("kv27r", token=TOKEN, transports=("tcp",), peer_timeout=5.0)
    async with rogue_server(serve) as address:
        with pytest.raises(AccessDenied) as caught:
            await within(init.connect(address))
    text = str(caught.value)
    assert "peer refused the connection: " in text  # (after "connecting to <address>: ")
    # Nothing that ends a log line or drives a terminal is left raw ...
    assert not any(c in text for c in "\n\r\x1b\u202e"), repr(text)
    assert FORGED not in text.split("\\n")[0]
    # ... the server's words are still there, escaped, and cut.
    assert "\\n2026-12-06T00:00:00" in text and "\\x1b[2K" in text
    assert len(text) < 400 and "more characters" in text, len(text)

"""A peer of another protocol version whose handshake frames changed shape
is named by its version, on both sides, instead of "malformed frame:
Object missing required field ..." (what a protocol-3 client still says
of a protocol-4 server: its code is out of reach, a later version's is not).

Real agents over loopback tcp; the other version is a raw socket speaking
msgpack maps of the shape such a version might send.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time

import msgspec
import pytest
from conftest import within
from test_conn22_handshake import rogue_server
from test_security import closed_by_peer, raw_connect

from aioxfer import ProtocolError, metadata, protocol

TOKEN = b"conn24-token"
LATER = metadata.PROTOCOL_VERSION + 3


def _frame(obj: dict[str, object]) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return len(body).to_bytes(4, "big") + body


async def _reshaped_challenge(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    # A later version's Challenge: a salt beside the nonce, the nonce renamed.
    await loop.sock_sendall(sock, _frame({
        "type": "challenge", "version": LATER, "salt": os.urandom(16), "n": os.urandom(16),
    }))


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
async def test_client_names_a_reshaped_challenges_version(make_agent, token) -> None:
    """Failed before: ProtocolError "malformed frame: Object missing required
    field `nonce`" (no version named)."""
    init = await make_agent("init", token=token, transports=("tcp",), peer_timeout=5.0)
    async with rogue_server(_reshaped_challenge) as address:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=f"peer speaks protocol version {LATER}, "
                                                f"this agent {metadata.PROTOCOL_VERSION}"):
            await within(init.connect(address))
        assert time.monotonic() - t0 < 2.0


async def test_client_still_says_malformed_without_a_version(make_agent) -> None:
    """A first frame that decodes as nothing of ours and names no other
    version (here: our own) is still "malformed"."""
    async def ours_reshaped(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        await loop.sock_sendall(sock, _frame({
            "type": "challenge", "version": metadata.PROTOCOL_VERSION, "n": b"x"}))

    init = await make_agent("init", token=TOKEN, transports=("tcp",), peer_timeout=5.0)
    async with rogue_server(ours_reshaped) as address:
        with pytest.raises(ProtocolError, match="malformed frame"):
            await within(init.connect(address))


async def _reject_after(sock: socket.socket, first: bytes) -> metadata.Frame:
    loop = asyncio.get_running_loop()
    chal = await within(protocol.recv_frame(loop, sock))
    assert isinstance(chal, metadata.Challenge)
    await loop.sock_sendall(sock, first)
    return await within(protocol.recv_frame(loop, sock))


async def test_server_rejects_a_reshaped_hello_naming_its_version(make_agent) -> None:
    """Failed before: the server dropped the connection without a word
    (recv_frame: "connection closed after 0 of 4 bytes"); only its log said
    "malformed frame"."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    sock = await raw_connect(target.address)
    with sock:
        got = await _reject_after(sock, _frame({
            "type": "hello", "version": LATER, "name": "later", "incarnation": 1,
            "purpose": "data", "nonces": [os.urandom(16)], "byteorder": sys.byteorder,
        }))
        assert isinstance(got, metadata.Reject)
        assert got.reason == f"protocol version {LATER} is not {metadata.PROTOCOL_VERSION}"
        assert await closed_by_peer(sock, 5.0)
    assert target.statistics().native_conns == 0


async def test_server_drops_a_malformed_hello_without_a_version(make_agent) -> None:
    """No version to name: closed without a Reject, as before."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    sock = await raw_connect(target.address)
    with sock:
        with pytest.raises(ProtocolError, match="connection closed"):
            await _reject_after(sock, _frame({"type": "hello", "name": "x"}))

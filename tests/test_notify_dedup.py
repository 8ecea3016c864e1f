"""Notifications are delivered once per (peer, sender's request id).

A sender resends, on another rail, the notifications a failed rail still owed
it an acknowledgement for (tests/test_notify_netns.py makes that happen over
real links); the copy of one that had arrived is dropped. Here a raw data
connection on loopback repeats ids on purpose: repeats are dropped, their
flow-control credits are given back (the connection keeps being read), new
ids still arrive in order, and what is remembered stays bounded.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from conftest import within

import aioxfer
from aioxfer import auth, events, protocol

HDR = struct.Struct("<IHHiIQQQQQQ")
MAGIC = 0x31465841
F_NOTIFY = 5


async def data_connection(address: str, name: str = "resender") -> socket.socket:
    """A handshaken data connection to the agent at address, from nobody
    (a raw socket: it sends what the test writes, reads and acknowledges
    nothing)."""
    loop = asyncio.get_running_loop()
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await within(loop.sock_connect(sock, (host, int(port))))
    await within(protocol.client_handshake(loop, sock, name=name, incarnation=7,
                                           purpose="data",
                                           token=auth.hmac_key(auth.default_token())))
    return sock


def _notify(op: int, payload: bytes) -> bytes:
    return HDR.pack(MAGIC, F_NOTIFY, 0, 0, 0, op, 0, 0, 0, 0, len(payload)) + payload


async def test_repeated_ids_delivered_once_credits_given_back(make_agent) -> None:
    cap = 4
    target = await make_agent("target", limits=aioxfer.Limits(max_notify_per_conn=cap))
    sock = await data_connection(target.address)
    loop = asyncio.get_running_loop()
    with sock:
        # 10 * cap copies of id 1: were each to hold a credit, the agent
        # would stop reading after cap of them, and id 2 would never come.
        await loop.sock_sendall(sock, b"".join(_notify(1, b"one") for _ in range(10 * cap)))
        await loop.sock_sendall(sock, _notify(2, b"two") + _notify(1, b"one"))
        first = await within(target.notifications.receive())
        second = await within(target.notifications.receive(), 10)
        assert (first.peer_name, first.payload) == ("resender", b"one")
        assert second.payload == b"two"
        await asyncio.sleep(0.2)
        assert len(target.notifications) == 0, "a repeated id was delivered again"


async def test_ids_remembered_stay_bounded(make_agent) -> None:
    target = await make_agent("target")
    sock = await data_connection(target.address)
    loop = asyncio.get_running_loop()
    n = events.NOTIFY_SEEN + 100
    with sock:
        await loop.sock_sendall(sock, b"".join(_notify(i, b"x") for i in range(1, n + 1)))
        for _ in range(n):
            await within(target.notifications.receive())
        seen = target._events._seen
        assert len(seen) == 1
        ids, order = next(iter(seen.values()))
        assert len(ids) == len(order) <= events.NOTIFY_SEEN
    # The peer's last connection closed: what was remembered of it goes too.
    async with asyncio.timeout(10):
        while target._events._seen:
            await asyncio.sleep(0.02)

"""TCP through the loopback device (tcp19): the engine's connections between
two addresses of this host use reno (AIOXFER_TCP_LOOPBACK_CC; conn.c
loop_cc_set), and a lone WRITE of 1 MiB over them goes whole on one
connection, where it went in two halves on two (tcp.c tcp_chunk); so does a
lone READ since read22; a WRITE keeps its halves when the setting is off.

Both agents run in this process, so both ends of every connection are in
/proc/self/fd: each socket's congestion control and the bytes it received
are read from the kernel (getsockopt TCP_CONGESTION, TCP_INFO), not from the
engine. Before tcp19 the sockets had the system's default (bbr on this VM)
and the 1 MiB WRITE reached the target on two connections.
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Any

import pytest
from conftest import digest, queued_conns, tcp_victim, wait_until, within

MiB = 1 << 20
# struct tcp_info: tcpi_bytes_received (u64) comes after 8 one-byte fields,
# 24 u32s and three u64s (pacing_rate, max_pacing_rate, bytes_acked).
BYTES_RECEIVED_AT = 128
Sock = tuple[str, int, str]  # congestion control, bytes received, "t"arget or "i"nitiator end


def system_default() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def sockets(port: int) -> dict[tuple[Any, Any], Sock]:
    """This process's TCP sockets connected to or accepted on port, by their
    4-tuple."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                continue
            try:
                me, peer = s.getsockname(), s.getpeername()
            except OSError:  # a listener
                continue
            if port not in (me[1], peer[1]):
                continue
            cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            (got,) = struct.unpack_from("<Q", info, BYTES_RECEIVED_AT)
            out[(me, peer)] = (cc.split(b"\0")[0].decode(), got, "t" if me[1] == port else "i")
        finally:
            s.close()
    return out


async def pair(make_agent: Any) -> tuple[Any, Any, Any, bytearray, int]:
    target = await make_agent("target", listen="127.0.0.1:0", transports=("tcp",))
    agent = await make_agent("init", transports=("tcp",), tcp_connections=4)
    dst = bytearray(4 * MiB)
    target.register(dst, name="dst")
    peer = await within(agent.connect(target.address))
    assert peer.path == "tcp"
    src = agent.register(bytearray(os.urandom(2 * MiB)))
    await within(agent.write(src[0:4096], peer.region("dst")[0:4096]))
    port = int(target.address.rsplit(":", 1)[1])
    # The connections after the first join in the background: the engine's
    # (a joining socket is in /proc before conn_open set its congestion
    # control and before tcp_chunk counts it live), then both ends' sockets.
    await wait_until(lambda: peer.statistics().rails[0].connections == 4, 10,
                     what="the joins, in the engine")
    await wait_until(lambda: len(sockets(port)) == 8, what="4 connections, both ends")
    return agent, peer, src, dst, port


async def test_loopback_connections_use_reno(make_agent: Any) -> None:
    *_, port = await pair(make_agent)
    socks = list(sockets(port).values())
    assert sorted(s[2] for s in socks) == ["i"] * 4 + ["t"] * 4, socks
    assert {s[0] for s in socks} == {"reno"}, socks


async def test_zero_keeps_the_system_default(make_agent: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "0")  # read when an engine is made
    *_, port = await pair(make_agent)
    socks = list(sockets(port).values())
    assert len(socks) == 8, socks
    assert {s[0] for s in socks} == {system_default()}, socks


async def lone(make_agent: Any, op: str) -> tuple[list[int], list[int]]:
    """What one lone 1 MiB request added to each connection's received bytes
    (sorted, at the target's ends and at the initiator's); its bytes checked."""
    agent, peer, src, dst, port = await pair(make_agent)
    rr = peer.region("dst")
    if op == "READ":
        dst[MiB:2 * MiB] = os.urandom(MiB)
    # Alone: the warm-up's op record gone too (tcp_chunk splits only then).
    await wait_until(lambda: agent.statistics().native_ops == 0, what="nothing in flight")
    before = sockets(port)
    if op == "WRITE":
        await within(agent.write(src[0:MiB], rr[MiB:2 * MiB]))
    else:
        await within(agent.read(src[0:MiB], rr[MiB:2 * MiB]))
    after = sockets(port)
    assert before.keys() == after.keys()
    assert bytes(src.memoryview[0:MiB]) == bytes(dst[MiB:2 * MiB])
    delta = {k: after[k][1] - before[k][1] for k in after}
    return (sorted(d for k, d in delta.items() if after[k][2] == "t"),
            sorted(d for k, d in delta.items() if after[k][2] == "i"))


async def test_lone_write_goes_whole(make_agent: Any) -> None:
    at_target, _ = await lone(make_agent, "WRITE")
    assert at_target[-1] >= MiB and at_target[-2] < 4096, at_target  # one connection


async def test_lone_read_goes_whole(make_agent: Any) -> None:
    _, at_init = await lone(make_agent, "READ")  # read22: whole, as the WRITE
    assert at_init[-1] >= MiB and at_init[-2] < 4096, at_init  # one connection


async def test_lone_write_halves_without_reno(make_agent: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "0")
    at_target, _ = await lone(make_agent, "WRITE")
    assert at_target[-1] >= MiB // 2 and at_target[-2] >= MiB // 2, at_target


async def test_peer_killed_under_a_whole_write(make_agent: Any, remote_agent: Any) -> None:
    """The whole 1 MiB WRITE queued at a stopped peer (one connection), the
    peer then SIGKILLed: the request fails with PeerLost within a bound,
    nothing stays in flight, and a new peer gets the same WRITE right."""
    data = os.urandom(MiB)
    v = await tcp_victim(make_agent, remote_agent, bytearray(data))
    init, buf, peer = v.init, v.buf, v.peer

    def whole() -> None:
        assert queued_conns(v.port, 32 << 10) == 1  # whole, on one connection

    await v.kill_under(lambda: init.write(buf[0:MiB], peer.region("user")[0:MiB]),
                       lambda: queued_conns(v.port, 32 << 10) >= 1, "the WRITE queued", whole)
    v.ra.terminate()
    ra2 = await remote_agent(size=2 * MiB, transports=("tcp",))
    peer2 = await within(init.connect(ra2.address))
    res = await within(init.write(buf[0:MiB], peer2.region("user")[0:MiB]))
    assert res.nbytes == MiB
    assert await ra2.call("digest", "user", 0, MiB) == digest(data)

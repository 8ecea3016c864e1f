"""Token authentication and hostile input from raw sockets.

The control port speaks 4-byte big-endian length + msgpack frames; after a
"data" handshake the connection belongs to the native engine (64-byte binary
frame headers). Whatever a misbehaving client sends, only its own connection
is closed, the target's memory is untouched, and the agent keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import numpy as np
import pytest
from conftest import digest, pattern, wait_until, within

from aioxfer import AccessDenied, _cyx, auth, metadata, protocol

MiB = 1 << 20
HDR = struct.Struct("<IHHiIQQQQQQ")
MAGIC = 0x31465841
F_WRITE, F_WRITE_ACK, F_READ_REQ, F_READ_RESP, F_PING = 1, 2, 3, 4, 7


def frame(type_: int, *, op: int = 1, flags: int = 1, rid: int = 0, key: int = 0,
          off: int = 0, length: int = 0, magic: int = MAGIC) -> bytes:
    return HDR.pack(magic, type_, flags, 0, 0, op, 0, rid, key, off, length)


async def raw_connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await within(asyncio.get_running_loop().sock_connect(sock, (host, int(port))))
    return sock


async def closed_by_peer(sock: socket.socket, seconds: float = 10.0) -> bool:
    """Reads (and drops) until the other side closes; False if it never does."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(seconds):
            while True:
                try:
                    data = await loop.sock_recv(sock, 65536)
                except (ConnectionResetError, BrokenPipeError):
                    return True
                if not data:
                    return True
    except TimeoutError:
        return False


async def recv_native(sock: socket.socket) -> tuple:
    """The next non-PING native frame header from a data connection."""
    loop = asyncio.get_running_loop()
    while True:
        hdr = HDR.unpack(await within(protocol.recv_exact(loop, sock, HDR.size)))
        if hdr[1] != F_PING:
            return hdr


async def data_connection(address: str, name: str = "raw", token: bytes | None = None):
    # this user's: what a default agent expects, as its key (hmac_key)
    token = auth.hmac_key(token or auth.default_token())
    loop = asyncio.get_running_loop()
    sock = await raw_connect(address)
    await within(protocol.client_handshake(loop, sock, name=name, incarnation=7,
                                           purpose="data", token=token))
    return sock


async def region_meta(address: str, name: str, token: bytes | None = None):
    token = auth.hmac_key(token or auth.default_token())
    loop = asyncio.get_running_loop()
    sock = await raw_connect(address)
    with sock:
        meta = await within(protocol.fetch_meta(loop, sock, name="raw-meta", incarnation=8,
                                                token=token))
    return next(r for r in meta.regions if r.name == name)


async def still_serves(make_agent, address: str, region: str, nbytes: int = MiB,
                       **kw) -> bytes:
    """A well-behaved agent connects and writes; returns what it wrote."""
    good = await make_agent("good", **kw)
    peer = await within(good.connect(address))
    data = pattern(nbytes, seed=len(good.name))
    src = good.register(data)
    res = await within(good.write(src[0:nbytes], peer.region(region)[0:nbytes]))
    assert res.nbytes == nbytes
    return data.tobytes()


# --------------------------------------------------------------- control-plane garbage


@pytest.mark.parametrize(
    "garbage",
    [
        os.urandom(256),
        b"\xff\xff\xff\xff" + os.urandom(64),  # oversized length prefix
        struct.pack(">I", protocol.MAX_FRAME + 1) + b"\x00" * 32,
        b"\x00\x00\x00\x00",  # zero-length frame
        struct.pack(">I", 16) + os.urandom(16),  # valid length, garbage msgpack
        protocol.encode_frame(metadata.Accept(name="x")),  # valid frame, wrong message
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["random", "ffffffff", "max+1", "zero", "garbage-body", "wrong-message", "http"],
)
async def test_garbage_handshake_closes_connection(make_agent, capsys, garbage: bytes) -> None:
    target = await make_agent("target")
    dst = target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        await loop.sock_sendall(sock, garbage)
        assert await closed_by_peer(sock), "garbage handshake: connection not closed"
    wrote = await still_serves(make_agent, target.address, "dst")
    assert bytes(dst.memoryview) == wrote
    assert "conn.rejected" in capsys.readouterr().err


async def test_truncated_and_silent_handshakes(make_agent) -> None:
    target = await make_agent("target", peer_timeout=1.0)
    target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    silent = await raw_connect(target.address)  # never says anything
    trunc = await raw_connect(target.address)
    await loop.sock_sendall(trunc, struct.pack(">I", 100) + b"\x93" * 10)
    trunc.shutdown(socket.SHUT_WR)
    with silent, trunc:
        assert await closed_by_peer(trunc)
        # A silent client does not block anyone else...
        await still_serves(make_agent, target.address, "dst")
        # ...and is dropped after the handshake deadline (the peer timeout).
        assert await closed_by_peer(silent, 6.0), "silent client kept forever"


async def test_wrong_protocol_version_rejected(make_agent) -> None:
    target = await make_agent("target")
    target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        hello = metadata.Hello(version=999, name="future", incarnation=1, purpose="data",
                               nonce=b"n" * protocol.NONCE_BYTES)
        await loop.sock_sendall(sock, protocol.encode_frame(hello))
        # (The server speaks first: its Challenge, then the answer to our Hello.)
        chal = await within(protocol.recv_frame(loop, sock))
        assert isinstance(chal, metadata.Challenge)
        assert chal.version == metadata.PROTOCOL_VERSION
        reply = await within(protocol.recv_frame(loop, sock))
        assert isinstance(reply, metadata.Reject) and "version" in reply.reason
        assert await closed_by_peer(sock)
    await still_serves(make_agent, target.address, "dst")


async def test_many_hostile_connections_at_once(make_agent) -> None:
    target = await make_agent("target")
    dst = target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    socks = [await raw_connect(target.address) for _ in range(32)]
    try:
        await asyncio.gather(*(loop.sock_sendall(s, os.urandom(100 + i))
                               for i, s in enumerate(socks)))
        closed = await within(asyncio.gather(*(closed_by_peer(s) for s in socks)), 20)
        assert all(closed)
    finally:
        for s in socks:
            s.close()
    wrote = await still_serves(make_agent, target.address, "dst")
    assert bytes(dst.memoryview) == wrote


# --------------------------------------------------------------- native-frame garbage


@pytest.mark.parametrize(
    "garbage",
    [
        os.urandom(64),
        frame(F_WRITE, magic=0xDEADBEEF),
        frame(99),
        frame(F_WRITE, length=1 << 40),
        frame(F_WRITE_ACK),  # a reply sent to a target
        frame(F_READ_REQ, length=0, flags=1),
    ],
    ids=["random", "bad-magic", "bad-type", "oversized", "reply", "empty-read"],
)
async def test_garbage_native_frames_close_that_connection(make_agent, capsys,
                                                           garbage: bytes) -> None:
    target = await make_agent("target")
    dst = target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    # An honest peer is connected and keeps working throughout.
    honest = await make_agent("honest", transports=("tcp",))
    hpeer = await within(honest.connect(target.address))
    hsrc = honest.register(pattern(MiB, seed=1))
    sock = await data_connection(target.address)
    with sock:
        await loop.sock_sendall(sock, garbage)
        assert await closed_by_peer(sock), "malformed native frame: connection not closed"
    await wait_until(lambda: target.statistics().frames_rejected >= 1, what="frame rejected")
    await within(honest.write(hsrc[0:MiB], hpeer.region("dst")[0:MiB]))
    assert np.array_equal(dst.numpy(), hsrc.numpy())
    assert not hpeer.lost
    # The reason reaches the log when the target's loop drains the engine's
    # log record: the counter above moves first, and the honest write may
    # complete without the loop running a callback (adaptive polling).
    err: list[str] = []
    await wait_until(lambda: (err.append(capsys.readouterr().err) or "malformed" in "".join(err)),
                     what="the rejected frame's reason logged")


async def test_native_frames_checked_before_memory(make_agent) -> None:
    """A client that completed the handshake but forges keys and bounds."""
    target = await make_agent("target")
    dst = target.alloc(4096, name="dst")
    dst.numpy()[:] = 0x11
    loop = asyncio.get_running_loop()
    m = await region_meta(target.address, "dst")
    sock = await data_connection(target.address)
    with sock:
        forged = [
            (m.rid, m.key ^ 1, 0, 4),  # wrong key
            (m.rid + 1000, m.key, 0, 4),  # unknown region
            (m.rid, m.key, 4094, 4),  # past the end
            (m.rid, m.key, 2**64 - 2, 4),  # wrapping offset
        ]
        for op, (rid, key, off, n) in enumerate(forged, start=1):
            await loop.sock_sendall(sock, frame(F_WRITE, op=op, rid=rid, key=key, off=off,
                                                length=n) + b"EVIL")
            ack = await recv_native(sock)
            assert ack[1] == F_WRITE_ACK and ack[3] == _cyx.E_ACCESS, (rid, key, off)
            await loop.sock_sendall(sock, frame(F_READ_REQ, op=100 + op, rid=rid, key=key,
                                                off=off, length=n))
            resp = await recv_native(sock)
            assert resp[1] == F_READ_RESP and resp[3] == _cyx.E_ACCESS and resp[10] == 0
        assert bytes(dst.memoryview) == b"\x11" * 4096, "forged frames touched memory"
        # The right key works on the same connection: the refusals were real checks.
        await loop.sock_sendall(sock, frame(F_WRITE, op=50, rid=m.rid, key=m.key, off=8,
                                            length=4) + b"GOOD")
        ack = await recv_native(sock)
        assert ack[1] == F_WRITE_ACK and ack[3] == _cyx.OK
        assert bytes(dst.memoryview[8:12]) == b"GOOD"


async def test_hostile_input_to_agent_in_another_process(make_agent, remote_agent) -> None:
    ra = await remote_agent(size=MiB)
    loop = asyncio.get_running_loop()
    for garbage in (os.urandom(300), b"\xff\xff\xff\xff"):
        sock = await raw_connect(ra.address)
        with sock:
            await loop.sock_sendall(sock, garbage)
            assert await closed_by_peer(sock)
    sock = await data_connection(ra.address)
    with sock:
        await loop.sock_sendall(sock, os.urandom(64))
        assert await closed_by_peer(sock)
    st = await ra.call("stats")
    assert st["frames_rejected"] >= 1
    init = await make_agent("init")
    peer = await within(init.connect(ra.address))
    data = pattern(MiB, seed=3)
    src = init.register(data)
    await within(init.write(src[0:MiB], peer.region("pool")[0:MiB]))
    assert await ra.call("digest", "pool", 0, MiB) == digest(data)


# --------------------------------------------------------------- tokens


async def meta_denied_without_token(address: str) -> None:
    """Without the token even the metadata (region ids, keys) is refused."""
    with pytest.raises(AccessDenied):
        await region_meta(address, "dst")


async def test_token_auth(make_agent, capsys) -> None:
    target = await make_agent("target", token="s3cret")
    dst = target.alloc(MiB, name="dst")
    for bad in ({"token": "wrong"}, {}):
        intruder = await make_agent("intruder", **bad)
        with pytest.raises(AccessDenied):
            await within(intruder.connect(target.address))
        assert intruder.peers == []
    err = capsys.readouterr().err
    assert "conn.rejected" in err, "refused connection not logged by the server"
    # The server keeps serving the agents that have the token.
    wrote = await still_serves(make_agent, target.address, "dst", token="s3cret")
    assert bytes(dst.memoryview) == wrote
    # A client with a token refuses a server that has none (it cannot prove it).
    open_server = await make_agent("open", insecure_no_auth=True)
    with_token = await make_agent("careful", token="s3cret")
    with pytest.raises(AccessDenied):
        await within(with_token.connect(open_server.address))


async def test_forged_proof_rejected_and_logged(make_agent, capsys) -> None:
    target = await make_agent("target", token="s3cret")
    dst = target.alloc(4096, name="dst")
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        hello = metadata.Hello(version=metadata.PROTOCOL_VERSION, name="forger", incarnation=1,
                               purpose="data", nonce=os.urandom(protocol.NONCE_BYTES))
        await loop.sock_sendall(sock, protocol.encode_frame(hello))
        chal = await within(protocol.recv_frame(loop, sock))
        assert isinstance(chal, metadata.Challenge)
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Proof(proof=b"\x00" * 32)))
        reply = await within(protocol.recv_frame(loop, sock))
        assert isinstance(reply, metadata.Reject)
        # Whatever it sends next must never reach the engine.
        # (Even with the right region id and key, which this test knows.)
        await meta_denied_without_token(target.address)
        try:
            await loop.sock_sendall(sock, frame(F_WRITE, rid=dst.rid, key=dst.key, length=4)
                                    + b"EVIL")
        except OSError:
            pass
        assert await closed_by_peer(sock)
    assert bytes(dst.memoryview) == bytes(4096)
    err = capsys.readouterr().err
    assert "conn.rejected" in err and "forger" in err
    # No data connection came of it.
    assert target.statistics().native_conns == 0


async def test_token_auth_across_processes(make_agent, remote_agent) -> None:
    ra = await remote_agent(size=MiB, token="s3cret")
    for bad in ({"token": "wrong"}, {}):
        intruder = await make_agent("intruder", **bad)
        with pytest.raises(AccessDenied):
            await within(intruder.connect(ra.address))
    good = await make_agent("good", token="s3cret")
    peer = await within(good.connect(ra.address))
    data = pattern(MiB, seed=4)
    src = good.register(data)
    await within(good.write(src[0:MiB], peer.region("pool")[0:MiB], notify=b"ok"))
    assert await ra.call("digest", "pool", 0, MiB) == digest(data)

"""Unit tests of the pure-Python layer: errors, metadata and framing, the
handshake, regions and their slicing, SegmentList validation, notifications."""

from __future__ import annotations

import asyncio
import mmap
import socket
import struct

import anyio
import msgspec
import numpy as np
import pytest
from conftest import wait_until, within

import aioxfer
from aioxfer import _cyx, errors, metadata, protocol
from aioxfer.notifications import Notification, Notifications

ERROR_NAMES = [
    "XferError", "PeerLost", "StalePeer", "AccessDenied", "TransferTimeout",
    "TransportError", "RegistrationError", "ProtocolError", "ClosedResourceError",
]

# --------------------------------------------------------------- public names


def test_public_names() -> None:
    for name in aioxfer.__all__:
        assert hasattr(aioxfer, name), f"aioxfer.__all__ lists missing {name}"
    for name in ["Agent", "Region", "RemoteRegion", "Segment", "RemoteSegment", "SegmentList",
                 "Peer", "Transfer", "TransferResult", "Notification", *ERROR_NAMES]:
        assert name in aioxfer.__all__, f"{name} is not public"
    assert isinstance(aioxfer.__version__, str)


# --------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ERROR_NAMES)
def test_errors_reexported_and_rooted(name: str) -> None:
    cls = getattr(errors, name)
    assert getattr(aioxfer, name) is cls
    assert issubclass(cls, errors.XferError)
    assert issubclass(cls, Exception)


def test_error_bases_match_stdlib_vocabulary() -> None:
    assert issubclass(errors.TransferTimeout, TimeoutError)
    assert issubclass(errors.ClosedResourceError, anyio.ClosedResourceError)
    assert issubclass(errors.StalePeer, errors.PeerLost)
    assert not issubclass(errors.AccessDenied, errors.PeerLost)


@pytest.mark.parametrize(
    "status, cls",
    [
        (_cyx.E_ACCESS, errors.AccessDenied),
        (_cyx.E_PEER_LOST, errors.PeerLost),
        (_cyx.E_TIMEOUT, errors.TransferTimeout),
        (_cyx.E_TRANSPORT, errors.TransportError),
        (_cyx.E_REGISTRATION, errors.RegistrationError),
        (_cyx.E_PROTOCOL, errors.ProtocolError),
        (_cyx.E_CLOSED, errors.ClosedResourceError),
        (_cyx.E_INVALID, errors.XferError),
    ],
)
def test_status_table(status: int, cls: type[errors.XferError]) -> None:
    err = errors.error_for_status(status, "write to peer 'b'", peer="b", fail_index=3)
    assert type(err) is cls
    assert err.status == status and err.peer == "b" and err.fail_index == 3
    assert str(err) == f"write to peer 'b': {_cyx.strerror(status)}"
    assert str(err) == str(err).lower() or "'b'" in str(err)  # lowercase messages


# --------------------------------------------------------------- metadata and framing


def _meta() -> metadata.AgentMeta:
    return metadata.AgentMeta(
        version=metadata.PROTOCOL_VERSION, name="a", incarnation=2**63 + 5, host_id="h",
        pid=123, address="127.0.0.1:1", transports=["shm", "tcp"],
        regions=[metadata.RegionMeta(name="kv", rid=1, key=2**64 - 1, nbytes=10, access=3,
                                     addr=0x7F0000000000, memfd=7)],
    )


def test_metadata_roundtrip() -> None:
    m = _meta()
    wire = protocol.encode_frame(m)
    assert int.from_bytes(wire[:4], "big") == len(wire) - 4
    assert protocol.decode_body(wire[4:]) == m


def test_metadata_is_not_pickle_and_unknown_fields_are_ignored() -> None:
    body = msgspec.msgpack.encode({"type": "accept", "name": "x", "incarnation": 4,
                                   "added_in_v9": [1, 2]})
    got = protocol.decode_body(body)
    assert isinstance(got, metadata.Accept) and got.name == "x" and got.incarnation == 4
    import pickle

    with pytest.raises(errors.ProtocolError):
        protocol.decode_body(pickle.dumps(_meta()))
    with pytest.raises(errors.ProtocolError):
        protocol.decode_body(msgspec.msgpack.encode({"type": "nonsense"}))
    with pytest.raises(errors.ProtocolError):
        protocol.decode_body(b"\xc1\xc1\xc1")


@pytest.mark.parametrize("prefix", [0, protocol.MAX_FRAME + 1, 2**32 - 1])
async def test_frame_length_checked(prefix: int) -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    with a, b:
        b.sendall(struct.pack(">I", prefix) + b"\x00" * 16)
        with pytest.raises(protocol.FrameTooLarge):
            await within(protocol.recv_frame(loop, a))


async def test_truncated_frame() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    with a:
        b.sendall(struct.pack(">I", 100) + b"\x00" * 10)
        b.close()
        with pytest.raises(errors.ProtocolError):
            await within(protocol.recv_frame(loop, a))


async def _handshake(server_token: bytes | None, client_token: bytes | None) -> tuple:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    with a, b:
        server = protocol.server_handshake(loop, a, token=server_token,
                                           accept=metadata.Accept(name="srv", incarnation=9))
        client = protocol.client_handshake(loop, b, name="cli", incarnation=1, purpose="data",
                                           token=client_token)
        return tuple(await within(asyncio.gather(server, client, return_exceptions=True)))


async def test_handshake_tokens() -> None:
    hello, accept = await _handshake(None, None)
    assert isinstance(hello, metadata.Hello) and hello.name == "cli"
    assert isinstance(accept, metadata.Accept) and accept.name == "srv"
    hello, accept = await _handshake(b"s3cret", b"s3cret")
    assert isinstance(hello, metadata.Hello) and isinstance(accept, metadata.Accept)
    srv, cli = await _handshake(b"s3cret", b"wrong")
    # The server's proof does not verify with the wrong token: the client refuses first.
    assert isinstance(cli, errors.AccessDenied)
    assert isinstance(srv, errors.XferError | OSError)
    srv, cli = await _handshake(b"s3cret", None)
    assert isinstance(cli, errors.AccessDenied)
    srv, cli = await _handshake(None, b"s3cret")  # a server that cannot prove the token
    assert isinstance(cli, errors.AccessDenied)


def test_hmac_proofs_bind_context() -> None:
    n = b"n" * protocol.NONCE_BYTES
    m = b"m" * protocol.NONCE_BYTES
    assert protocol.server_proof(b"t", n, n) != protocol.client_proof(b"t", n, n, "")
    assert protocol.client_proof(b"t", n, m, "a") != protocol.client_proof(b"t", n, m, "b")
    assert protocol.client_proof(b"t", n, m, "a") != protocol.client_proof(b"u", n, m, "a")
    # Both nonces count, each in its place (a proof over one connection's
    # pair never passes for another's, nor with the two swapped).
    assert protocol.client_proof(b"t", n, m, "a") != protocol.client_proof(b"t", m, n, "a")
    assert protocol.server_proof(b"t", n, m) != protocol.server_proof(b"t", m, n)


# --------------------------------------------------------------- regions


async def test_region_slicing(make_agent) -> None:
    agent = await make_agent("a")
    buf = bytearray(range(100))
    reg = agent.register(buf, name="r")
    assert isinstance(reg, aioxfer.Region)
    assert len(reg) == reg.nbytes == 100 and reg.name == "r" and reg.writable
    seg = reg[10:20]
    assert isinstance(seg, aioxfer.Segment)
    assert (seg.region, seg.offset, seg.length) == (reg, 10, 10)
    assert bytes(seg.memoryview) == bytes(range(10, 20))
    assert (reg[-10:].offset, reg[-10:].length) == (90, 10)
    assert (reg[:].offset, reg[:].length) == (0, 100)
    assert reg[5:5].length == 0
    sub = seg[2:4]
    assert (sub.offset, sub.length) == (12, 2)
    for bad in (slice(0, 101), slice(50, 40), slice(-101, None), slice(101, None)):
        with pytest.raises(IndexError):
            reg[bad]
    with pytest.raises(IndexError):
        seg[0:11]
    with pytest.raises(ValueError):
        reg[0:10:2]
    with pytest.raises(TypeError):
        reg[5]
    # Views share the registered memory.
    reg.numpy()[0] = 250
    assert buf[0] == 250
    reg.memoryview[1] = 251
    assert buf[1] == 251
    assert reg.numpy(np.uint32).shape == (25,)


async def test_register_buffer_kinds(make_agent) -> None:
    agent = await make_agent("a")
    for obj in (bytearray(64), memoryview(bytearray(64)), np.zeros((8, 8), dtype=np.uint8),
                np.zeros(16, dtype=np.float32), mmap.mmap(-1, 4096)):
        reg = agent.register(obj)
        assert reg.nbytes == memoryview(obj).nbytes
        assert reg.writable
    ro = agent.register(b"read only bytes")
    assert not ro.writable
    with pytest.raises(errors.RegistrationError):
        agent.register(bytearray())
    with pytest.raises(errors.RegistrationError):
        agent.register(12345)
    agent.register(bytearray(8), name="dup")
    with pytest.raises(errors.RegistrationError):
        agent.register(bytearray(8), name="dup")


async def test_alloc_is_shared_memory(make_agent) -> None:
    agent = await make_agent("a")
    reg = agent.alloc(1 << 20, name="pool")
    assert reg.nbytes == 1 << 20 and reg.writable and reg.name == "pool"
    arr = reg.numpy()
    assert arr.shape == (1 << 20,) and not arr.any()
    arr[:] = 7
    assert bytes(reg.memoryview[:4]) == b"\x07" * 4


async def test_registration_pins_buffer(make_agent) -> None:
    agent = await make_agent("a")
    buf = bytearray(1024)
    reg = agent.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")
    agent.deregister(reg)
    assert reg.closed
    await wait_until(lambda: agent.statistics().pinned_regions == 0, what="buffer released")
    buf.extend(b"x")  # released once the engine confirmed it is untouched
    with pytest.raises(errors.ClosedResourceError):
        reg[0:10]
    reg2 = agent.register(bytearray(16))
    reg2.close()
    assert reg2.closed


async def test_segment_list_validation(make_agent) -> None:
    agent = await make_agent("a")
    reg = agent.register(bytearray(1000))
    sl = aioxfer.SegmentList(reg, [0, 100, 990], [10, 20, 10])
    assert len(sl) == 3 and sl.nbytes == 40
    assert sl.offsets.dtype == np.uint64 and sl.lengths.dtype == np.uint64
    big = aioxfer.SegmentList(reg, np.arange(100, dtype=np.int64) * 10, np.full(100, 10))
    assert len(big) == 100 and big.nbytes == 1000
    assert len(aioxfer.SegmentList(reg, [], [])) == 0
    with pytest.raises(ValueError):
        aioxfer.SegmentList(reg, [0, 1], [1])
    with pytest.raises(ValueError):
        aioxfer.SegmentList(reg, [[0, 1]], [[1, 1]])
    with pytest.raises(ValueError):
        aioxfer.SegmentList(reg, [-1], [1])
    with pytest.raises(TypeError):
        aioxfer.SegmentList(reg, [0.5], [1])
    with pytest.raises(IndexError):
        aioxfer.SegmentList(reg, [995], [10])
    with pytest.raises(IndexError):
        aioxfer.SegmentList(reg, np.array([2**64 - 1], dtype=np.uint64), [2])  # wraps around
    with pytest.raises(TypeError):
        aioxfer.SegmentList(bytearray(10), [0], [1])
    reg.close()
    with pytest.raises(errors.ClosedResourceError):
        aioxfer.SegmentList(reg, [0], [1])


# --------------------------------------------------------------- notifications


async def test_notifications_stream() -> None:
    n = Notifications()
    with pytest.raises(asyncio.QueueEmpty):
        n.receive_nowait()
    n._put(Notification("p", b"0"))
    assert n.receive_nowait() == Notification("p", b"0")
    # Cancelled before the item arrives: the other receiver gets it.
    r1 = asyncio.create_task(n.receive())
    r2 = asyncio.create_task(n.receive())
    await asyncio.sleep(0)
    r1.cancel()
    n._put(Notification("p", b"1"))
    assert (await within(r2)).payload == b"1"
    assert r1.cancelled()
    # Woken, then cancelled before it ran: the wake-up passes on, nothing is lost.
    r3 = asyncio.create_task(n.receive())
    r4 = asyncio.create_task(n.receive())
    await asyncio.sleep(0)
    n._put(Notification("p", b"2"))
    r3.cancel()
    assert (await within(r4)).payload == b"2"
    # In order; what was received before close is still handed out, then the end.
    for i in range(3, 6):
        n._put(Notification("p", str(i).encode()))
    n._close()
    assert [x.payload async for x in n] == [b"3", b"4", b"5"]
    with pytest.raises(errors.ClosedResourceError):
        await within(n.receive())
    with pytest.raises(errors.ClosedResourceError):
        n.receive_nowait()


async def test_connect_failures_are_bounded(make_agent) -> None:
    agent = await make_agent("a", peer_timeout=1.0)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    with pytest.raises(errors.TransportError):
        await within(agent.connect(f"127.0.0.1:{port}"))
    mute = socket.socket()  # listens, accepts (backlog), never answers
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    with mute:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(errors.TransportError):
            await within(agent.connect(f"127.0.0.1:{mute.getsockname()[1]}"))
        assert asyncio.get_running_loop().time() - t0 < 1.0 + 3.0
    for bad in ("no-port", "127.0.0.1:notaport", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            await within(agent.connect(bad))
    assert agent.peers == []


def test_agent_argument_checks() -> None:
    for kwargs in ({"transports": ("carrier-pigeon",)}, {"transports": ()},
                   {"transports": "tcp"}, {"peer_timeout": 0}, {"tcp_connections": 0},
                   {"copy_workers": 0}):
        with pytest.raises((ValueError, TypeError)):
            aioxfer.Agent("x", **kwargs)
    with pytest.raises(ValueError):
        aioxfer.Agent("")

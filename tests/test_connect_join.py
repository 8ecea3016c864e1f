"""A tcp connect's other connections join the first one's Challenge
(protocol.Joins): one round trip each, no Proof round, and only for the
client that was challenged, once per index, while the grant lives.

Raw sockets against a real agent: the first connection runs the real client
handshake asking for joins; the others are built by hand, so that replayed,
forged, expired, renamed, out-of-range and wrongly keyed joins can be sent.
Each of those must get its Challenge again instead of an Accept (it must
prove the token over that nonce), and a wrong Proof then gets a Reject, as
any unauthenticated client.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest
from conftest import wait_until, within
from test_connect_meta import connects_after_the_metadata_fail_leaving_no_fd
from test_security import closed_by_peer, raw_connect, still_serves

import aioxfer
from aioxfer import auth, metadata, protocol

MiB = 1 << 20
TOKEN = b"join-test-token"
# What the proofs are keyed on: the stretched token, as an agent made with
# token=TOKEN keys them (protocol version 5).
KEY = auth.hmac_key(TOKEN)


async def first_connection(
    address: str, joins: int, *, name: str = "raw", incarnation: int = 7
) -> tuple[socket.socket, bytes]:
    """A "data" connection asking for joins; returns it and its Challenge nonce."""
    loop = asyncio.get_running_loop()
    sock = await raw_connect(address)
    got: list[bytes] = []
    await within(protocol.client_handshake(
        loop, sock, name=name, incarnation=incarnation, purpose="data", token=KEY,
        joins=joins, on_challenge=got.append,
    ))
    assert len(got) == 1
    return sock, got[0]


def join_hello(join: bytes, index: int, *, name: str = "raw", incarnation: int = 7,
               token: bytes = KEY, nonce: bytes | None = None) -> bytes:
    nonce = nonce or os.urandom(protocol.NONCE_BYTES)
    return protocol.encode_frame(metadata.Hello(
        version=metadata.PROTOCOL_VERSION, name=name, incarnation=incarnation,
        purpose="data", nonce=nonce, byteorder=sys.byteorder, join=join, join_index=index,
        join_proof=protocol.join_proof(token, join, index, nonce, name),
    ))


async def send_join(address: str, hello: bytes) -> tuple[socket.socket, bool]:
    """Sends hello on a new connection: it and whether its join was honoured
    (the server's Challenge, then at once an Accept proved over hello's
    nonce and that Challenge's; not honoured: the same Challenge again)."""
    loop = asyncio.get_running_loop()
    sock = await raw_connect(address)
    await loop.sock_sendall(sock, hello)
    chal = await within(protocol.recv_frame(loop, sock))
    assert isinstance(chal, metadata.Challenge) and len(chal.nonce) == protocol.NONCE_BYTES
    reply = await within(protocol.recv_frame(loop, sock))
    if isinstance(reply, metadata.Challenge):
        assert reply == chal
        return sock, False
    assert isinstance(reply, metadata.Accept)
    # The server proved itself over this connection's own nonce.
    assert reply.proof == protocol.server_proof(KEY, metadata_hello(hello).nonce, chal.nonce)
    return sock, True


async def refused(address: str, hello: bytes) -> None:
    """hello's join is not honoured: its Challenge again, and a client that
    cannot answer it is rejected."""
    loop = asyncio.get_running_loop()
    sock, joined = await send_join(address, hello)
    with sock:
        assert not joined
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Proof(proof=b"\0" * 32)))
        reply = await within(protocol.recv_frame(loop, sock))
        assert isinstance(reply, metadata.Reject)
        assert await closed_by_peer(sock)


async def test_join_is_one_round_trip_once(make_agent) -> None:
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    target.alloc(MiB, name="dst")
    first, nonce = await first_connection(target.address, 2)
    socks = [first]
    try:
        hello = join_hello(nonce, 1)
        sock, joined = await send_join(target.address, hello)
        socks.append(sock)
        assert joined  # (send_join checked the Accept's proof)
        assert target._server.joins.joined == 1
        # The same Hello again (a replay), and index 1 with a fresh nonce: used up.
        await refused(target.address, hello)
        await refused(target.address, join_hello(nonce, 1))
        # Index 2 is still there, once; then the grant is gone.
        sock, joined = await send_join(target.address, join_hello(nonce, 2))
        socks.append(sock)
        assert joined
        assert target._server.joins.joined == 2 and len(target._server.joins) == 0
    finally:
        for s in socks:
            s.close()
    await still_serves(make_agent, target.address, "dst", token=TOKEN)


def metadata_hello(frame: bytes) -> metadata.Hello:
    msg = protocol.decode_body(frame[4:])
    assert isinstance(msg, metadata.Hello)
    return msg


@pytest.mark.parametrize("case", [
    "forged-nonce", "wrong-token", "other-name", "other-incarnation", "index-0",
    "index-past-joins", "proof-for-another-nonce",
])
async def test_bad_join_gets_the_usual_challenge(make_agent, case: str) -> None:
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    target.alloc(MiB, name="dst")
    first, nonce = await first_connection(target.address, 2)
    with first:
        if case == "forged-nonce":
            hello = join_hello(os.urandom(protocol.NONCE_BYTES), 1)
        elif case == "wrong-token":
            hello = join_hello(nonce, 1, token=auth.hmac_key(b"another user's token"))
        elif case == "other-name":
            hello = join_hello(nonce, 1, name="intruder")
        elif case == "other-incarnation":
            hello = join_hello(nonce, 1, incarnation=8)
        elif case == "index-0":
            hello = join_hello(nonce, 0)
        elif case == "index-past-joins":
            hello = join_hello(nonce, 3)
        else:  # a proof computed for one client nonce, sent with another
            good = metadata_hello(join_hello(nonce, 1))
            hello = protocol.encode_frame(metadata.Hello(
                version=good.version, name=good.name, incarnation=good.incarnation,
                purpose="data", nonce=os.urandom(protocol.NONCE_BYTES), join=nonce,
                join_index=1, join_proof=good.join_proof,
            ))
        await refused(target.address, hello)
        assert target._server.joins.joined == 0
        # The refused attempt used nothing up: the real index 1 still joins.
        sock, joined = await send_join(target.address, join_hello(nonce, 1))
        with sock:
            assert joined
    await still_serves(make_agent, target.address, "dst", token=TOKEN)


async def test_no_join_without_a_proven_first_connection(make_agent) -> None:
    """A first connection that fails its Proof leaves no grant behind."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Hello(
            version=metadata.PROTOCOL_VERSION, name="raw", incarnation=7, purpose="data",
            nonce=os.urandom(protocol.NONCE_BYTES), byteorder=sys.byteorder, joins=2,
        )))
        chal = await within(protocol.recv_frame(loop, sock))
        assert isinstance(chal, metadata.Challenge)
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Proof(proof=b"\0" * 32)))
        assert isinstance(await within(protocol.recv_frame(loop, sock)), metadata.Reject)
        assert await closed_by_peer(sock)
    assert len(target._server.joins) == 0
    # Even with the token, the nonce of that failed handshake joins nothing.
    await refused(target.address, join_hello(chal.nonce, 1))


async def test_expired_grant_joins_nothing(make_agent) -> None:
    target = await make_agent("target", token=TOKEN, transports=("tcp",), peer_timeout=0.5)
    first, nonce = await first_connection(target.address, 1)
    with first:
        await asyncio.sleep(0.7)  # past the target's peer timeout
        await refused(target.address, join_hello(nonce, 1))


async def test_grants_are_bounded(make_agent) -> None:
    """At most max_handshakes grants live (authenticated first connections
    asking for many joins each); the oldest go first."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",),
                              limits=aioxfer.Limits(max_handshakes=4))
    firsts = [await first_connection(target.address, 63) for _ in range(6)]
    try:
        assert len(target._server.joins) == 4
        await refused(target.address, join_hello(firsts[0][1], 1))  # evicted
        sock, joined = await send_join(target.address, join_hello(firsts[-1][1], 1))
        with sock:
            assert joined
    finally:
        for sock, _ in firsts:
            sock.close()


async def test_agent_connections_join(make_agent) -> None:
    """An agent's tcp connect: the first rail's other connections join."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    dst = target.alloc(8 * MiB, name="dst")
    # max_rails=1: it asks for no more joins than its first rail uses (the
    # grant is then used up and gone).
    init = await make_agent("init", token=TOKEN, transports=("tcp",), tcp_connections=4,
                            limits=aioxfer.Limits(max_rails=1))
    peer = await within(init.connect(target.address))
    # They join in the background, after connect returned (Connector._join_rest).
    await wait_until(lambda: target._server.joins.joined == 3, 5, what="the joins")
    assert len(target._server.joins) == 0
    assert len(init._engine.endpoint_rails(peer._ep)) >= 1
    src = init.alloc(8 * MiB, name="src")
    src.numpy()[:] = 7
    await within(init.write(src[0:8 * MiB], peer.region("dst")[0:8 * MiB]))
    assert (dst.numpy() == 7).all()


async def test_no_token_no_joins(make_agent) -> None:
    """Without a token there is no Challenge to join: the others handshake alone."""
    target = await make_agent("target", insecure_no_auth=True, transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", insecure_no_auth=True, transports=("tcp",),
                            tcp_connections=4)
    peer = await within(init.connect(target.address))
    assert target._server.joins.joined == 0 and len(target._server.joins) == 0
    assert peer.path == "tcp"


async def test_same_host_connect_joins_the_probe(make_agent, monkeypatch) -> None:
    """A same-host connect's unix-socket connection joins the tcp probe's
    Challenge (the kernel still checks who connects there): the probe path,
    taken where the address-named unix socket is not (Connector._open_direct;
    tests/test_conn12_direct.py covers the fallback with a real squatter)."""
    from aioxfer import connector, dialing

    async def no_direct(self, address):
        return None

    monkeypatch.setattr(connector.Connector, "_open_direct", no_direct)
    # Connector.predial dials that socket itself (its Hello answered, with
    # the pool's memfds, before _open_direct runs): as absent for it too.
    # Else its dropped connection held dst until this process's exit, and
    # the target's aclose() waited its close_timeout (10 s) for it.
    monkeypatch.setattr(dialing.Dialer, "dial_local_now", lambda self, name: None)
    target = await make_agent("target", token=TOKEN)
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init", token=TOKEN)
    peer = await within(init.connect(target.address))
    if peer.path != "shm":
        pytest.skip(f"no same-host path here ({peer.path})")
    # Index 1 used; the ones a tcp fallback would have used expire unused.
    assert target._server.joins.joined == 1
    src = init.alloc(MiB, name="src")
    src.numpy()[:] = 5
    await within(init.write(src[0:MiB], peer.region("dst")[0:MiB]))
    assert (dst.numpy() == 5).all()


async def test_probe_grant_is_not_a_data_connection(make_agent) -> None:
    """A "meta" probe's grant admits joining "data" Hellos only; a probe
    that is not accept_only gets no grant."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        await within(protocol.fetch_meta(loop, sock, name="raw", incarnation=7, token=KEY))
    assert len(target._server.joins) == 0
    sock = await raw_connect(target.address)
    got: list[bytes] = []
    with sock:
        await within(protocol.client_handshake(
            loop, sock, name="raw", incarnation=7, purpose="meta", token=KEY,
            accept_only=True, joins=1, on_challenge=got.append,
        ))
    assert len(got) == 1 and len(target._server.joins) == 1
    hello = metadata_hello(join_hello(got[0], 1))
    meta_join = protocol.encode_frame(metadata.Hello(
        version=hello.version, name=hello.name, incarnation=hello.incarnation,
        purpose="meta", nonce=hello.nonce, join=hello.join, join_index=1,
        join_proof=hello.join_proof,
    ))
    await refused(target.address, meta_join)
    sock, joined = await send_join(target.address, join_hello(got[0], 1))
    with sock:
        assert joined


async def test_tcp_after_the_probe_joins_it(make_agent) -> None:
    """An agent that probes first (it has a unix socket) and then takes tcp
    (the peer has no same-host path): its data connection and the rail's
    other connections join the probe's Challenge."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    dst = target.alloc(8 * MiB, name="dst")
    init = await make_agent("init", token=TOKEN, tcp_connections=4)
    peer = await within(init.connect(target.address))
    assert peer.path == "tcp"
    await wait_until(lambda: target._server.joins.joined == 4, 5, what="the joins")
    src = init.alloc(8 * MiB, name="src")
    src.numpy()[:] = 9
    await within(init.write(src[0:8 * MiB], peer.region("dst")[0:8 * MiB]))
    assert (dst.numpy() == 9).all()


async def test_failure_after_the_probe_closes_the_others(make_agent) -> None:
    """The other connections dialled beside a probing agent's tcp data
    connection are closed when connecting fails after its metadata came."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    init = await make_agent("init", token=TOKEN, tcp_connections=4)
    await connects_after_the_metadata_fail_leaving_no_fd(target, init)


@pytest.mark.parametrize("probe", [False, True], ids=["tcp-only", "probe-then-tcp"])
async def test_other_rails_join(make_agent, probe: bool) -> None:
    """A peer's other tcp rails, dialled once its metadata is in, join the
    first connection's (or the probe's) Challenge too: every connection but
    the first is authenticated by a join proof, none by a Proof round of
    its own."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",),
                              listen=["127.0.0.1:0", "127.0.0.2:0"])
    dst = target.alloc(8 * MiB, name="dst")
    kw = {} if probe else {"transports": ("tcp",)}
    init = await make_agent("init", token=TOKEN, tcp_connections=2, **kw)
    assert (init._local_sock is not None) == probe
    peer = await within(init.connect(target.address))
    assert peer.path == "tcp" and peer.rails == target.addresses
    await wait_until(lambda: [r.connections for r in peer.statistics().rails] == [2, 2], 5,
                     what="the joins")
    # tcp-only: the first rail's other one and the second rail's two;
    # probing first: its data connection as well.
    assert target._server.joins.joined == 3 + probe
    src = init.alloc(8 * MiB, name="src")
    src.numpy()[:] = 3
    await within(init.write(src[0:8 * MiB], peer.region("dst")[0:8 * MiB]))
    assert (dst.numpy() == 3).all()


async def test_other_rails_without_a_token(make_agent) -> None:
    """Without a token nothing is granted: every rail's connections
    handshake alone, and connect still reaches both rails."""
    target = await make_agent("target", insecure_no_auth=True, transports=("tcp",),
                              listen=["127.0.0.1:0", "127.0.0.2:0"])
    target.alloc(MiB, name="dst")
    init = await make_agent("init", insecure_no_auth=True, transports=("tcp",),
                            tcp_connections=2)
    peer = await within(init.connect(target.address))
    await wait_until(lambda: [r.connections for r in peer.statistics().rails] == [2, 2], 5,
                     what="the joins")
    assert target._server.joins.joined == 0 and len(target._server.joins) == 0


@pytest.mark.parametrize("cut", [2, 4, 40], ids=["in-the-length", "length-only", "in-the-body"])
async def test_join_hello_in_pieces(make_agent, cut: int) -> None:
    """A join whose Hello is not all there when its connection is accepted
    (the accepting step serves a whole one at once, serving.Server._join_now)
    is served by the usual handshake, which reads the bytes the accepting
    step only peeked at: it is joined all the same, and its engine takes it."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    first, nonce = await first_connection(target.address, 1)
    with first:
        hello = join_hello(nonce, 1)
        sock = await raw_connect(target.address)
        with sock:
            await loop.sock_sendall(sock, hello[:cut])
            await asyncio.sleep(0.05)  # accepted (TCP_DEFER_ACCEPT: some bytes came)
            await loop.sock_sendall(sock, hello[cut:])
            chal = await within(protocol.recv_frame(loop, sock))
            assert isinstance(chal, metadata.Challenge)
            accept = await within(protocol.recv_frame(loop, sock))
            assert isinstance(accept, metadata.Accept) and accept.name == target.name
            assert accept.proof == protocol.server_proof(
                KEY, metadata_hello(hello).nonce, chal.nonce)
            assert target._server.joins.joined == 1
            await wait_conns(target, 1)
    await still_serves(make_agent, target.address, "dst", token=TOKEN)


async def wait_conns(agent: aioxfer.Agent, n: int) -> None:
    """Until agent's engine holds n connections (it takes a joined one as
    its Accept goes out)."""
    for _ in range(200):
        if agent.statistics().native_conns >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine holds {agent.statistics().native_conns} connections")


async def test_join_cut_at_once(make_agent) -> None:
    """Joining Hellos whose connections are reset right after them (the
    accepting step may find the Hello, the reset, or both): nothing breaks,
    the agent still serves, and a join that was not taken still joins."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    first, nonce = await first_connection(target.address, 4)
    with first:
        for index in (1, 2, 3):
            sock = await raw_connect(target.address)
            await loop.sock_sendall(sock, join_hello(nonce, index))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            sock.close()  # RST
        await asyncio.sleep(0.1)
        sock, joined = await send_join(target.address, join_hello(nonce, 4))
        with sock:
            assert joined
    await still_serves(make_agent, target.address, "dst", token=TOKEN)

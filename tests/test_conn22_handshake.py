"""The server speaks first (protocol version 4, conn22): its Challenge goes
out as it accepts, the client's Hello and Proof (over the server's nonce and
its own) come back, and the Accept carries the server's proof.

Against real agents over loopback tcp, with raw sockets playing the hostile
side: a replayed Proof, a Proof over another connection's nonce, a Proof
bound to another Hello, clients that go silent after the Challenge, and
servers that lie (garbage first, a wrong proof in the Accept followed by
metadata, a server of the older version, a silent one). And an agent that
is closing refuses a handshake with a Reject that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from conftest import wait_until, within
from test_security import closed_by_peer, raw_connect, still_serves

from aioxfer import AccessDenied, ProtocolError, XferError, auth, metadata, protocol

MiB = 1 << 20
TOKEN = b"conn22-token"
# What the proofs are keyed on: the stretched token, as an agent made with
# token=TOKEN keys them (protocol version 5).
KEY = auth.hmac_key(TOKEN)


def hello(name: str = "raw", nonce: bytes | None = None, **kw) -> metadata.Hello:
    return metadata.Hello(
        version=metadata.PROTOCOL_VERSION, name=name, incarnation=7, purpose="data",
        nonce=nonce or os.urandom(protocol.NONCE_BYTES), byteorder=sys.byteorder, **kw,
    )


async def challenge(sock: socket.socket) -> metadata.Challenge:
    chal = await within(protocol.recv_frame(asyncio.get_running_loop(), sock))
    assert isinstance(chal, metadata.Challenge)
    assert chal.version == metadata.PROTOCOL_VERSION
    return chal


async def answer(sock: socket.socket, h: metadata.Hello, proof: bytes) -> metadata.Frame:
    """Sends h and a Proof; returns the server's answer."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(
        sock, protocol.encode_frame(h) + protocol.encode_frame(metadata.Proof(proof=proof))
    )
    return await within(protocol.recv_frame(loop, sock))


async def test_challenge_comes_first_and_one_reply_authenticates(make_agent) -> None:
    """Nothing sent yet, the Challenge is already there; Hello and Proof in
    one send get the Accept, whose proof is over both nonces."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    sock = await raw_connect(target.address)
    with sock:
        chal = await challenge(sock)  # we sent nothing
        h = hello()
        acc = await answer(sock, h, protocol.client_proof(KEY, chal.nonce, h.nonce, h.name))
        assert isinstance(acc, metadata.Accept) and acc.name == target.name
        assert acc.proof == protocol.server_proof(KEY, h.nonce, chal.nonce)


async def test_replayed_hello_and_proof_are_rejected(make_agent) -> None:
    """A whole first message recorded from a connection that got in,
    replayed on another: its Proof is over the old Challenge's nonce."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    target.alloc(MiB, name="dst")
    first = await raw_connect(target.address)
    with first:
        chal = await challenge(first)
        h = hello()
        proof = protocol.client_proof(KEY, chal.nonce, h.nonce, h.name)
        assert isinstance(await answer(first, h, proof), metadata.Accept)
    again = await raw_connect(target.address)
    with again:
        await challenge(again)
        reply = await answer(again, h, proof)
        assert isinstance(reply, metadata.Reject) and reply.reason == "bad token"
        assert await closed_by_peer(again)
    await still_serves(make_agent, target.address, "dst", token=TOKEN)


async def test_proof_over_another_connections_nonce_is_rejected(make_agent) -> None:
    """Two connections open at once: a right proof over the other one's
    (live, unused) nonce does not pass here, and the other connection's
    own handshake is not spent by that attempt."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    a, b = await raw_connect(target.address), await raw_connect(target.address)
    with a, b:
        chal_a, chal_b = await challenge(a), await challenge(b)
        assert chal_a.nonce != chal_b.nonce
        h = hello()
        reply = await answer(a, h, protocol.client_proof(KEY, chal_b.nonce, h.nonce, h.name))
        assert isinstance(reply, metadata.Reject)
        h2 = hello()
        ok = await answer(b, h2, protocol.client_proof(KEY, chal_b.nonce, h2.nonce, h2.name))
        assert isinstance(ok, metadata.Accept)


@pytest.mark.parametrize("case", ["other-hello-nonce", "other-name", "nonces-swapped",
                                  "server-proof", "wrong-token"])
async def test_proof_bound_to_something_else_is_rejected(make_agent, case: str) -> None:
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    sock = await raw_connect(target.address)
    with sock:
        chal = await challenge(sock)
        h = hello()
        if case == "other-hello-nonce":  # made for a Hello with another nonce
            proof = protocol.client_proof(KEY, chal.nonce, os.urandom(16), h.name)
        elif case == "other-name":
            proof = protocol.client_proof(KEY, chal.nonce, h.nonce, "someone-else")
        elif case == "nonces-swapped":
            proof = protocol.client_proof(KEY, h.nonce, chal.nonce, h.name)
        elif case == "server-proof":  # the server's own proof reflected back
            proof = protocol.server_proof(KEY, h.nonce, chal.nonce)
        else:
            proof = protocol.client_proof(auth.hmac_key(b"another token"), chal.nonce, h.nonce,
                                          h.name)
        reply = await answer(sock, h, proof)
        assert isinstance(reply, metadata.Reject) and reply.reason == "bad token"


@pytest.mark.parametrize("sends", ["nothing", "hello-only", "half-a-proof"])
async def test_silent_client_after_the_challenge_is_dropped(make_agent, sends: str) -> None:
    """A client that stops after the Challenge (before its Hello, before
    its Proof, inside its Proof) holds a server task only until the
    handshake's bound (peer_timeout), then is closed."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",), peer_timeout=0.5)
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        await challenge(sock)
        if sends != "nothing":
            await loop.sock_sendall(sock, protocol.encode_frame(hello()))
        if sends == "half-a-proof":
            await loop.sock_sendall(sock, protocol.encode_frame(
                metadata.Proof(proof=b"p" * 32))[:10])
        assert len(target._serving) == 1
        t0 = time.monotonic()
        assert await closed_by_peer(sock, 5.0), "silent client kept past the handshake bound"
        assert time.monotonic() - t0 < 3.0
    await wait_until(lambda: len(target._serving) == 0, 5, what="the handshake task to end")


@contextlib.asynccontextmanager
async def rogue_server(
    serve: Callable[[asyncio.AbstractEventLoop, socket.socket], Awaitable[None]],
) -> AsyncIterator[str]:
    """A listener on loopback whose every connection is served by serve();
    yields its address."""
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    tasks: set[asyncio.Task[None]] = set()

    async def one(sock: socket.socket) -> None:
        with sock:
            with contextlib.suppress(OSError, XferError):
                await serve(loop, sock)
                await closed_by_peer(sock, 5.0)

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(lsock)
            sock.setblocking(False)
            t = loop.create_task(one(sock))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    acceptor = loop.create_task(accept())
    try:
        host, port = lsock.getsockname()
        yield f"{host}:{port}"
    finally:
        for t in (acceptor, *tasks):
            t.cancel()
        await asyncio.gather(acceptor, *tasks, return_exceptions=True)
        lsock.close()


async def test_client_checks_the_servers_proof_before_the_metadata(make_agent) -> None:
    """A server without the token takes our Proof and answers an Accept
    with a made-up proof, followed by metadata naming a region: the client
    refuses at the Accept, and its agent knows no such peer afterwards."""
    got_proof: list[bytes] = []

    async def liar(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        nonce = os.urandom(protocol.NONCE_BYTES)
        await protocol.send_frame(loop, sock, metadata.Challenge(
            version=metadata.PROTOCOL_VERSION, nonce=nonce))
        h = await protocol.recv_frame(loop, sock, protocol.MAX_HANDSHAKE_FRAME)
        p = await protocol.recv_frame(loop, sock, protocol.MAX_HANDSHAKE_FRAME)
        assert isinstance(h, metadata.Hello) and isinstance(p, metadata.Proof)
        got_proof.append(p.proof)
        meta = metadata.AgentMeta(
            version=metadata.PROTOCOL_VERSION, name="liar", incarnation=1, host_id="h",
            pid=os.getpid(), address="127.0.0.1:1", transports=["tcp"],
            regions=[metadata.RegionMeta(name="r", rid=1, key=2, nbytes=4096, access=3,
                                         addr=4096)],
        )
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Accept(
            name="liar", incarnation=1, meta=True, proof=os.urandom(32),
        )) + protocol.encode_frame(meta) + protocol.META_GO)

    init = await make_agent("init", token=TOKEN, transports=("tcp",), peer_timeout=5.0)
    async with rogue_server(liar) as address:
        t0 = time.monotonic()
        with pytest.raises(AccessDenied, match="failed to prove"):
            await within(init.connect(address))
        assert time.monotonic() - t0 < 2.0
    assert got_proof, "the client never sent its proof"
    assert not init._peers.live()


async def _garbage(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    await loop.sock_sendall(sock, b"\x00\x00\x00\x08notmsgpk")


async def _huge(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    await loop.sock_sendall(sock, (1 << 30).to_bytes(4, "big"))


async def _accept_first(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    # An Accept where the Challenge belongs: no nonce was ever proved over.
    await protocol.send_frame(loop, sock, metadata.Accept(name="x", proof=b"p" * 32))


async def _old_version(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    # What a server of protocol version 3 does: it reads the Hello first,
    # then refuses its version.
    h = await protocol.recv_frame(loop, sock, protocol.MAX_HANDSHAKE_FRAME)
    assert isinstance(h, metadata.Hello)
    await protocol.send_frame(loop, sock, metadata.Reject(
        reason=f"protocol version {h.version} is not 3"))


async def _newer_version(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    await protocol.send_frame(loop, sock, metadata.Challenge(
        version=metadata.PROTOCOL_VERSION + 1, nonce=os.urandom(16)))


async def _no_token(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    await protocol.send_frame(loop, sock, metadata.Challenge(
        version=metadata.PROTOCOL_VERSION, nonce=b""))


@pytest.mark.parametrize("serve,error,match", [
    (_garbage, ProtocolError, "malformed"),
    (_huge, ProtocolError, "outside"),
    (_accept_first, ProtocolError, "expected Challenge"),
    (_old_version, AccessDenied, f"protocol version {metadata.PROTOCOL_VERSION} is not 3"),
    (_newer_version, ProtocolError, f"protocol version {metadata.PROTOCOL_VERSION + 1}"),
    (_no_token, AccessDenied, "does not authenticate"),
], ids=["garbage", "huge-frame", "accept-first", "old-version", "newer-version", "no-token"])
async def test_server_speaking_wrong_first_is_a_typed_error(
        make_agent, serve, error: type[Exception], match: str) -> None:
    """Whatever a server sends first instead of a Challenge we can answer,
    connect fails at once with a typed error naming it (never waits for
    its timeout)."""
    init = await make_agent("init", token=TOKEN, transports=("tcp",), peer_timeout=5.0)
    async with rogue_server(serve) as address:
        t0 = time.monotonic()
        with pytest.raises(error, match=match):
            await within(init.connect(address))
        assert time.monotonic() - t0 < 2.0


async def test_silent_server_is_bounded(make_agent) -> None:
    """A server that accepts and never speaks: connect ends at the peer timeout."""
    async def silent(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        await asyncio.sleep(30)

    init = await make_agent("init", token=TOKEN, transports=("tcp",), peer_timeout=0.5)
    async with rogue_server(silent) as address:
        with pytest.raises(XferError, match="timed out"):
            await within(init.connect(address))


async def test_closing_agent_refuses_at_accept(make_agent) -> None:
    """Once the agent is closing (Server.closing, set by its aclose), a new
    connection gets a Reject saying so where the Challenge would be; the
    connecting agent raises AccessDenied naming it, and our engine holds
    no connection of it."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    target.alloc(MiB, name="dst")
    target._server.closing = True
    init = await make_agent("init", token=TOKEN, transports=("tcp",))
    with pytest.raises(AccessDenied, match="is closing"):
        await within(init.connect(target.address))
    await asyncio.sleep(0.05)
    assert target.statistics().native_conns == 0
    assert len(target._serving) == 0


async def test_closing_during_a_handshake_refuses_its_accept(make_agent) -> None:
    """A handshake under way when the close begins: a Reject instead of the
    Accept (the peer would otherwise think it connected, then lose us)."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",))
    sock = await raw_connect(target.address)
    with sock:
        chal = await challenge(sock)
        target._server.closing = True
        h = hello()
        reply = await answer(sock, h, protocol.client_proof(KEY, chal.nonce, h.nonce, h.name))
        assert isinstance(reply, metadata.Reject) and "is closing" in reply.reason
        assert await closed_by_peer(sock)
    assert target.statistics().native_conns == 0

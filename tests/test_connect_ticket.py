"""Unix-socket tickets (protocol.Tickets): a same-host client's second
handshake, on the server's unix socket, skips the Proof round with a ticket
its authenticated tcp handshake got; everything else about who gets in stays.

The server side runs for real (an agent); the client side is the protocol's
own client_handshake or raw frames where the test plays a misbehaving client.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from conftest import within

from aioxfer import AccessDenied, metadata, protocol
from aioxfer.local import local_address
from aioxfer.protocol import Tickets

TOKEN = b"s3cret"


async def tcp(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await within(asyncio.get_running_loop().sock_connect(sock, (host, int(port))))
    return sock


async def unix(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await within(asyncio.get_running_loop().sock_connect(sock, local_address(name)))
    return sock


async def ticket_from(address: str, *, name: str = "client", want: bool = True,
                      purpose: metadata.Purpose = "data", token: bytes = TOKEN) -> metadata.Accept:
    """A tcp handshake as a same-host client makes it; the server's Accept."""
    loop = asyncio.get_running_loop()
    with await tcp(address) as sock:
        return await within(protocol.client_handshake(
            loop, sock, name=name, incarnation=1, purpose=purpose, token=token,
            want_ticket=want,
        ))


async def hello_with_ticket(sock: socket.socket, ticket: bytes, *, name: str = "client",
                            token: bytes = TOKEN) -> tuple[metadata.Challenge, bytes]:
    """Sends a Hello carrying ticket; returns the Challenge and our nonce."""
    loop = asyncio.get_running_loop()
    nonce = os.urandom(protocol.NONCE_BYTES)
    hello = metadata.Hello(
        version=metadata.PROTOCOL_VERSION, name=name, incarnation=1, purpose="data",
        nonce=nonce, ticket=ticket, ticket_proof=protocol.ticket_proof(token, ticket, name),
    )
    await loop.sock_sendall(sock, protocol.encode_frame(hello))
    chal = await within(protocol.recv_frame(loop, sock))
    assert isinstance(chal, metadata.Challenge)
    assert chal.proof == protocol.server_proof(TOKEN, nonce)  # the server still proves itself
    return chal, nonce


async def test_ticket_spares_the_proof_round_once(make_agent) -> None:
    # No regions: the raw unix connection the engine takes is nobody's to
    # release (the agent would wait for this process to let go of them).
    target = await make_agent("target", token=TOKEN)
    accept = await ticket_from(target.address)
    assert accept.local and len(accept.ticket) == protocol.NONCE_BYTES
    loop = asyncio.get_running_loop()
    with await unix(accept.local) as sock:
        chal, _ = await hello_with_ticket(sock, accept.ticket)
        assert chal.resumed
        # No Proof sent: the Accept follows at once.
        reply = await within(protocol.recv_frame(loop, sock))
        assert isinstance(reply, metadata.Accept) and reply.name == target.name
    # Used up: the same ticket again gets an ordinary Challenge, and without
    # a Proof nothing is accepted.
    with await unix(accept.local) as sock:
        chal, _ = await hello_with_ticket(sock, accept.ticket)
        assert not chal.resumed
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Proof(proof=b"\0" * 32)))
        reply = await within(protocol.recv_frame(loop, sock))
        assert isinstance(reply, metadata.Reject)


async def test_ticket_needs_the_token_and_its_name(make_agent) -> None:
    """A ticket seen on the wire is no use without the token, nor under
    another name; a wrong try uses it up."""
    target = await make_agent("target", token=TOKEN)
    for name, token in (("client", b"wrong"), ("other", TOKEN)):
        accept = await ticket_from(target.address)
        with await unix(accept.local) as sock:
            chal, _ = await hello_with_ticket(sock, accept.ticket, name=name, token=token)
            assert not chal.resumed
        with await unix(accept.local) as sock:  # the right proof now: too late
            chal, _ = await hello_with_ticket(sock, accept.ticket)
            assert not chal.resumed


async def test_ticket_not_honoured_over_tcp(make_agent) -> None:
    target = await make_agent("target", token=TOKEN)
    accept = await ticket_from(target.address)
    with await tcp(target.address) as sock:
        chal, _ = await hello_with_ticket(sock, accept.ticket)
        assert not chal.resumed
    with await unix(accept.local) as sock:  # and it was not used up there
        chal, _ = await hello_with_ticket(sock, accept.ticket)
        assert chal.resumed


async def test_tickets_only_where_asked_and_useful(make_agent) -> None:
    target = await make_agent("target", token=TOKEN)
    assert (await ticket_from(target.address, want=False)).ticket == b""
    assert (await ticket_from(target.address, purpose="meta")).ticket == b""
    tcp_only = await make_agent("tcp-only", token=TOKEN, transports=("tcp",))
    assert (await ticket_from(tcp_only.address)).ticket == b""  # no unix socket
    # Not before the client proved itself: a wrong token gets no Accept at all.
    with pytest.raises(AccessDenied):
        await ticket_from(target.address, token=b"wrong")


async def test_client_refuses_a_resume_it_did_not_ask_for(make_agent) -> None:
    """A server that says resumed to a client that sent no ticket is broken
    (or lying): the client stops."""
    loop = asyncio.get_running_loop()
    server, client = socket.socketpair()
    with server, client:
        client.setblocking(False)
        server.setblocking(False)

        async def fake_server() -> None:
            hello = await protocol.recv_frame(loop, server)
            assert isinstance(hello, metadata.Hello) and hello.ticket == b""
            chal = metadata.Challenge(nonce=os.urandom(protocol.NONCE_BYTES),
                                      proof=protocol.server_proof(TOKEN, hello.nonce),
                                      resumed=True)
            await protocol.send_frame(loop, server, chal)

        task = asyncio.ensure_future(fake_server())
        with pytest.raises(protocol.ProtocolError, match="ticket"):
            await within(protocol.client_handshake(
                loop, client, name="c", incarnation=1, purpose="data", token=TOKEN))
        await task


async def test_same_host_connect_with_tickets_moves_data(make_agent) -> None:
    """End to end: the tcp handshake hands out a ticket, the unix one takes
    it (the server has none left), and the shm path works."""
    target = await make_agent("target", token=TOKEN)
    dst = target.alloc(1 << 20, name="dst")
    init = await make_agent("init", token=TOKEN)
    issued: list[bytes] = []
    redeemed: list[bool] = []
    issue, redeem = Tickets.issue, Tickets.redeem

    def spy_issue(self: Tickets, name: str) -> bytes:
        issued.append(issue(self, name))
        return issued[-1]

    def spy_redeem(self: Tickets, *a: bytes | str) -> bool:
        redeemed.append(redeem(self, *a))  # type: ignore[arg-type]
        return redeemed[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(Tickets, "issue", spy_issue)
    mp.setattr(Tickets, "redeem", spy_redeem)
    try:
        peer = await within(init.connect(target.address))
    finally:
        mp.undo()
    assert peer.path == "shm"
    assert len(issued) == 1 and issued[0] and redeemed == [True]
    src = init.alloc(4096, name="src")
    src.numpy()[:] = 7
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x07" * 4096


def test_tickets_expire_are_capped_and_bound_to_a_name() -> None:
    now = [100.0]
    t = Tickets(ttl=5.0, cap=2, clock=lambda: now[0])

    def proof(ticket: bytes, name: str = "a") -> bytes:
        return protocol.ticket_proof(TOKEN, ticket, name)

    a = t.issue("a")
    b = t.issue("a")
    assert len(a) == len(b) == protocol.NONCE_BYTES and a != b
    assert t.issue("a") == b""  # capped: the client proves itself as usual
    assert t.redeem(a, "a", proof(a), TOKEN)
    assert not t.redeem(a, "a", proof(a), TOKEN)  # once
    c = t.issue("c")
    assert not t.redeem(c, "a", proof(c, "a"), TOKEN)  # issued to "c"
    now[0] += 5.0
    assert not t.redeem(b, "a", proof(b), TOKEN)  # expired
    d = t.issue("a")
    e = t.issue("a")  # expired ones make room
    assert d and e and len(t) == 2
    assert not t.redeem(os.urandom(protocol.NONCE_BYTES), "a", b"", TOKEN)

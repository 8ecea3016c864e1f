"""Early proofs (cxs33, hs29's design on the accepting step): a same-host
client's Hello proves the token at once, and the server sends its Challenge
(``early``) and the proved Accept together: no Proof round.

Over real sockets against real agents: the early path is proved by the
frames on the wire (we send one Hello and nothing else; the Accept comes),
never by time. Every case the server must not take (stale, future, before
the listener started, replayed, a wrong MAC, a MAC for another address,
the replay cache full, a peer that is not on this host: a network
namespace) gets the ordinary Challenge (not ``early``) and still connects
with a Proof, and a replayed early Hello is not let in by that fallback
either. Older builds (main's wheel, /tmp/vM33) on either side connect over
the Proof round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from conftest import within
from test_security import closed_by_peer, raw_connect, still_serves

import aioxfer
from aioxfer import AccessDenied, auth, metadata, protocol
from aioxfer.local import local_address

MiB = 1 << 20
TOKEN = b"cxs33-early-token"
KEY = auth.hmac_key(TOKEN)
# A target whose raw unix clients (this process) got data connections: its
# engine counts them as holders of its regions, settled only by their
# process's exit (never by a closed socket alone), so its aclose() waits
# close_timeout (10 s by default) for this very process and then gives up.
RAW_PEERS = aioxfer.Limits(close_timeout=0.5)
OLD_PYTHON = os.environ.get("AIOXFER_MAIN_PYTHON", "/tmp/vM33/bin/python")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def hello(name: str = "raw", **kw) -> metadata.Hello:
    kw.setdefault("purpose", "data")
    return metadata.Hello(
        version=metadata.PROTOCOL_VERSION, name=name, incarnation=33,
        nonce=os.urandom(protocol.NONCE_BYTES), byteorder=sys.byteorder, **kw,
    )


def early_hello(here: str | bytes, *, ts: int | None = None, key: bytes = KEY,
                **kw) -> metadata.Hello:
    """A Hello with an early proof for the server at ``here`` (sock_endpoint)."""
    h = msgspec.structs.replace(hello(**kw), early_ts=time.time_ns() if ts is None else ts)
    return msgspec.structs.replace(h, early_proof=protocol.early_proof(key, h, here))


def here_of(sock: socket.socket) -> str | bytes:
    return protocol.sock_endpoint(sock.getpeername())


async def recv(sock: socket.socket) -> metadata.Frame:
    return await within(protocol.recv_frame(asyncio.get_running_loop(), sock))


async def send(sock: socket.socket, *frames: metadata.Frame | bytes) -> None:
    data = b"".join(f if isinstance(f, bytes) else protocol.encode_frame(f) for f in frames)
    await asyncio.get_running_loop().sock_sendall(sock, data)


async def unix_connect(agent) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await within(asyncio.get_running_loop().sock_connect(sock, local_address(agent._local_name)))
    return sock


async def connect_raw(agent, how: str) -> socket.socket:
    return await (tcp_connect_now(agent.address) if how == "tcp" else unix_connect(agent))


async def tcp_connect_now(address: str) -> socket.socket:
    """A tcp connection made without yielding to the loop, as an agent's
    client makes it (Connector.predial: the Hello sent in the same step): a
    loopback listener accepts at the connect (no TCP_DEFER_ACCEPT) and polls
    for the Hello in its accepting step, which a client of this very loop
    could not send meanwhile (raw_connect's await)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setblocking(False)
    return sock


async def early_taken(sock: socket.socket, h: metadata.Hello) -> metadata.Accept:
    """After h (sent): the Challenge says the early proof was taken, and
    the proved Accept follows it, though we sent nothing but the Hello."""
    chal = await recv(sock)
    assert isinstance(chal, metadata.Challenge) and chal.early, chal
    acc = await recv(sock)
    assert isinstance(acc, metadata.Accept), acc
    assert acc.proof == protocol.server_proof(KEY, h.nonce, chal.nonce)
    return acc


async def proof_round(sock: socket.socket, h: metadata.Hello) -> None:
    """After h (sent): not taken. The ordinary Challenge (not ``early``),
    then a Proof over its nonce gets the proved Accept."""
    chal = await recv(sock)
    assert isinstance(chal, metadata.Challenge) and not chal.early, chal
    await send(sock, metadata.Proof(proof=protocol.client_proof(KEY, chal.nonce, h.nonce, h.name)))
    acc = await recv(sock)
    assert isinstance(acc, metadata.Accept), acc
    assert acc.proof == protocol.server_proof(KEY, h.nonce, chal.nonce)


@pytest.mark.parametrize("how", ["tcp", "unix"])
async def test_same_host_hello_with_early_proof_gets_accept_without_proof(
    make_agent, how: str
) -> None:
    target = await make_agent("target", token=TOKEN)
    early = target._server.early
    for purpose in ("data", "meta"):
        sock = await connect_raw(target, how)
        with sock:
            h = early_hello(here_of(sock), purpose=purpose, accept_only=purpose == "meta")
            await send(sock, h)
            acc = await early_taken(sock, h)
            assert acc.name == target.name
    assert early.taken == 2 and len(early) == 2


@pytest.mark.parametrize("how", ["tcp", "unix"])
async def test_an_early_accept_grants_its_joins(make_agent, how: str) -> None:
    """The other connections of a client join the Challenge an early
    Accept answered, as after a Proof (the Accept carries its proof over
    that Challenge's nonce: the nonce to join)."""
    target = await make_agent("target", token=TOKEN)
    first = await connect_raw(target, how)
    with first:
        h = early_hello(here_of(first), joins=1)
        await send(first, h)
        chal = await recv(first)
        assert isinstance(chal, metadata.Challenge)
        assert isinstance(await recv(first), metadata.Accept)
        other = await raw_connect(target.address)
        with other:
            j = hello(join=chal.nonce, join_index=1)
            j = msgspec.structs.replace(j, join_proof=protocol.join_proof(
                KEY, chal.nonce, 1, j.nonce, j.name))
            await send(other, j)
            theirs = await recv(other)
            assert isinstance(theirs, metadata.Challenge)
            acc = await recv(other)  # no Proof sent: joined
            assert isinstance(acc, metadata.Accept)
            assert acc.proof == protocol.server_proof(KEY, j.nonce, theirs.nonce)
    assert target._server.joins.joined == 1


CASES = ["stale", "future", "before-start", "wrong-mac", "wrong-key", "other-address",
         "other-name", "cache-full"]


@pytest.mark.parametrize("how", ["tcp", "unix"])
@pytest.mark.parametrize("case", CASES)
async def test_early_proof_not_taken_falls_back_to_the_proof_round(
    make_agent, case: str, how: str
) -> None:
    target = await make_agent("target", token=TOKEN, limits=RAW_PEERS)
    target.alloc(MiB, name="dst")
    if case == "cache-full":
        target._server.early = protocol.EarlyProofs(cap=1)
        sock = await connect_raw(target, how)
        with sock:
            h = early_hello(here_of(sock))
            await send(sock, h)
            await early_taken(sock, h)
    sock = await connect_raw(target, how)
    with sock:
        here = here_of(sock)
        now = time.time_ns()
        window = protocol.EARLY_WINDOW_NS
        if case == "stale":
            h = early_hello(here, ts=now - window - 10**9)
        elif case == "future":
            h = early_hello(here, ts=now + window + 10**9)
        elif case == "before-start":  # within the window, but made before it listened
            h = early_hello(here, ts=target._server.early.start_ns - 10**6)
        elif case == "wrong-mac":
            h = early_hello(here)
            h = msgspec.structs.replace(h, early_proof=bytes(32))
        elif case == "wrong-key":
            h = early_hello(here, key=auth.hmac_key(b"another-token"))
        elif case == "other-address":  # made for a listener at another address
            h = early_hello(b"\0elsewhere" if how == "unix" else "127.0.0.1:1")
        elif case == "other-name":  # a proof for one Hello, sent with another name
            h = msgspec.structs.replace(early_hello(here), name="someone-else")
        else:
            h = early_hello(here)
        await send(sock, h)
        await proof_round(sock, h)
    assert target._server.early.taken == (1 if case == "cache-full" else 0)
    await still_serves(make_agent, target.address, "dst", token=TOKEN)


@pytest.mark.parametrize("how", ["tcp", "unix"])
async def test_a_replayed_early_hello_is_not_taken_nor_let_in(make_agent, how: str) -> None:
    """The bytes of a real early Hello that got in, sent again on new
    connections (within the window): the ordinary Challenge each time, and
    what a replayer without the key can send as a Proof (the recorded
    early proof itself, nothing) gets a Reject or nothing."""
    target = await make_agent("target", token=TOKEN, peer_timeout=2.0, limits=RAW_PEERS)
    target.alloc(MiB, name="dst")
    sock = await connect_raw(target, how)
    with sock:
        h = early_hello(here_of(sock))
        recorded = protocol.encode_frame(h)
        await send(sock, recorded)
        await early_taken(sock, h)
    again = await connect_raw(target, how)
    with again:
        await send(again, recorded)
        chal = await recv(again)
        assert isinstance(chal, metadata.Challenge) and not chal.early
        await send(again, metadata.Proof(proof=h.early_proof))
        reply = await recv(again)
        assert isinstance(reply, metadata.Reject) and reply.reason == "bad token"
        assert await closed_by_peer(again)
    silent = await connect_raw(target, how)
    with silent:  # nothing after the replayed Hello: no Accept, closed at the timeout
        await send(silent, recorded)
        frames = []
        with contextlib.suppress(protocol.ProtocolError):
            for _ in range(3):
                frames.append(await within(
                    protocol.recv_frame(asyncio.get_running_loop(), silent), 10.0))
        assert frames and all(isinstance(f, metadata.Challenge) for f in frames), frames
    assert target._server.early.taken == 1
    await still_serves(make_agent, target.address, "dst", token=TOKEN)


@pytest.mark.parametrize("how", ["tcp", "unix"])
async def test_a_hello_without_an_early_proof_takes_the_proof_round(
    make_agent, how: str
) -> None:
    """What a client that predates early proofs sends: one Challenge (not
    ``early``), a Proof, the Accept."""
    target = await make_agent("target", token=TOKEN)
    sock = await connect_raw(target, how)
    with sock:
        h = hello()
        await send(sock, h)
        chal = await recv(sock)
        assert isinstance(chal, metadata.Challenge) and not chal.early
        await send(sock, metadata.Proof(
            proof=protocol.client_proof(KEY, chal.nonce, h.nonce, h.name)))
        acc = await recv(sock)
        assert isinstance(acc, metadata.Accept)
    assert target._server.early.taken == 0


async def test_no_token_no_early_path(make_agent) -> None:
    """Without a token nothing changes: an empty Challenge that takes no
    early proofs, and early fields in a Hello are ignored."""
    target = await make_agent("target", insecure_no_auth=True)
    sock = await raw_connect(target.address)
    with sock:
        h = early_hello(here_of(sock))
        await send(sock, h)
        chal = await recv(sock)
        assert isinstance(chal, metadata.Challenge) and not chal.nonce and not chal.early
        acc = await recv(sock)
        assert isinstance(acc, metadata.Accept) and not acc.proof
    assert target._server.early.taken == 0


@pytest.mark.parametrize("transports", [("tcp",), None])
async def test_agents_on_one_host_connect_with_early_proofs(make_agent, transports) -> None:
    """Real agents: tcp over loopback (its other connections join the early
    Accept's Challenge) and the same-host path each take an early proof;
    with the cache full the next connect takes the Proof round and works."""
    kw = {} if transports is None else {"transports": transports}
    target = await make_agent("target", token=TOKEN, **kw)
    target.alloc(MiB, name="dst")
    await still_serves(make_agent, target.address, "dst", token=TOKEN, **kw)
    early = target._server.early
    assert early.taken >= 1
    if transports == ("tcp",):
        assert early.taken == 1
        await within(_until(lambda: target._server.joins.joined >= 1))
    target._server.early = protocol.EarlyProofs(cap=1)
    target._server.early.take(early_hello("x"), KEY, "x")  # (fills it)
    assert len(target._server.early) == 1
    await still_serves(make_agent, target.address, "dst", token=TOKEN, **kw)
    assert target._server.early.taken == 1


async def _until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("mine,theirs", [(TOKEN, None), (None, TOKEN)])
async def test_token_on_one_side_only_is_refused_as_before(make_agent, mine, theirs) -> None:
    def kw(token: bytes | None) -> dict[str, object]:
        return {"token": token} if token is not None else {"insecure_no_auth": True}

    target = await make_agent("target", **kw(theirs))
    me = await make_agent("me", **kw(mine))
    with pytest.raises(AccessDenied):
        await within(me.connect(target.address))


# ------------------------------------------------------------------ another host


_NS_TARGET = textwrap.dedent("""
    import asyncio, json, sys
    import aioxfer

    async def main():
        async with aioxfer.Agent("ns-target", token=sys.argv[1].encode(),
                                 listen=[sys.argv[2]], transports=("tcp",)) as a:
            print(json.dumps({"address": a.address}), flush=True)
            loop = asyncio.get_running_loop()
            while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "stats":
                s = a._server
                print(json.dumps({"taken": s.early.taken}), flush=True)

    asyncio.run(main())
""")

_NS_CLIENT = textwrap.dedent("""
    import asyncio, json, os, socket, sys, time
    import msgspec
    from aioxfer import auth, metadata, protocol

    async def main():
        key = auth.hmac_key(sys.argv[1].encode())
        host, port = sys.argv[2].rsplit(":", 1)
        loop = asyncio.get_running_loop()
        out = {}
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        here = protocol.sock_endpoint(sock.getpeername())
        out["client_would_send_early"] = protocol._early_target(sock) is not None
        h = metadata.Hello(version=metadata.PROTOCOL_VERSION, name="ns-raw", incarnation=1,
                           purpose="data", nonce=os.urandom(16), byteorder=sys.byteorder,
                           early_ts=time.time_ns())
        h = msgspec.structs.replace(h, early_proof=protocol.early_proof(key, h, here))
        await loop.sock_sendall(sock, protocol.encode_frame(h))
        chal = await protocol.recv_frame(loop, sock)
        out["first"] = type(chal).__name__
        out["early"] = chal.early
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Proof(
            proof=protocol.client_proof(key, chal.nonce, h.nonce, h.name))))
        acc = await protocol.recv_frame(loop, sock)
        out["then"] = type(acc).__name__
        out["proved"] = acc.proof == protocol.server_proof(key, h.nonce, chal.nonce)
        print(json.dumps(out), flush=True)

    asyncio.run(main())
""")


async def test_a_peer_on_another_host_never_gets_an_early_accept() -> None:
    """Two network namespaces joined by a veth (tests/netns.py): the target
    sees the client at 10.77.1.2, not a loopback address. A Hello with a
    valid early proof (bound to the address it reached) gets a Challenge
    that takes no early proofs, and the Accept only after the Proof; our
    client would not have sent one there at all."""
    netns = pytest.importorskip("netns")
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    # The children run from "/" with no PYTHONPATH: they import the installed
    # aioxfer, never the checkout's sources (CI installs a wheel: the checkout
    # has no compiled extension).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with netns.rails(1) as net:
        target = net.popen("a", [sys.executable, "-c", _NS_TARGET, TOKEN.decode(),
                                 f"{net.rail(1).addr_a}:0"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                           cwd="/")
        assert target.stdin is not None and target.stdout is not None
        loop = asyncio.get_running_loop()
        line = await within(loop.run_in_executor(None, target.stdout.readline), 30)
        address = json.loads(line)["address"]
        proc = await within(loop.run_in_executor(None, lambda: subprocess.run(
            ["ip", "netns", "exec", net.ns("b"), sys.executable, "-c", _NS_CLIENT,
             TOKEN.decode(), address], capture_output=True, text=True, timeout=30, env=env,
            cwd="/")), 40)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out == {"client_would_send_early": False, "first": "Challenge", "early": False,
                       "then": "Accept", "proved": True}
        target.stdin.write("stats\n")
        target.stdin.flush()
        stats = json.loads(await within(loop.run_in_executor(None, target.stdout.readline), 30))
        assert stats["taken"] == 0
        target.stdin.write("exit\n")
        target.stdin.flush()


# ------------------------------------------------------------------ older builds


_OLD_TARGET = textwrap.dedent("""
    import asyncio, json, sys
    import aioxfer

    async def main():
        kw = {"transports": ("tcp",)} if sys.argv[2] == "tcp" else {}
        async with aioxfer.Agent("old-target", token=sys.argv[1].encode(), **kw) as a:
            a.alloc(1 << 20, name="dst")
            print(json.dumps({"address": a.address}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
""")

_OLD_CLIENT = textwrap.dedent("""
    import asyncio, sys
    import aioxfer

    async def main():
        kw = {"transports": ("tcp",)} if sys.argv[2] == "tcp" else {}
        async with aioxfer.Agent("old-client", token=sys.argv[1].encode(), **kw) as a:
            peer = await a.connect(sys.argv[3])
            src = a.alloc(4096, name="src")
            await a.write(src[0:4096], peer.region("dst")[0:4096])
            print("ok", peer.path, flush=True)

    asyncio.run(main())
""")


def _old_python() -> str:
    if not os.access(OLD_PYTHON, os.X_OK):
        pytest.skip(f"no build of main (before early proofs) at {OLD_PYTHON}")
    return OLD_PYTHON


@contextlib.asynccontextmanager
async def _old_target(py: str, how: str) -> AsyncIterator[str]:
    proc = subprocess.Popen([py, "-c", _OLD_TARGET, TOKEN.decode(), how], cwd="/",
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=""))
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await within(asyncio.get_running_loop().run_in_executor(
            None, proc.stdout.readline), 30)
        yield json.loads(line)["address"]
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", ["tcp", "same-host"])
async def test_an_older_server_is_reached_over_the_proof_round(make_agent, how: str) -> None:
    """Our early proof goes to a server that predates it: its Challenge
    does not say it takes them, so we prove at once, and it ignores the
    Hello's early fields."""
    py = _old_python()
    async with _old_target(py, "tcp" if how == "tcp" else "all") as address:
        kw = {"transports": ("tcp",)} if how == "tcp" else {}
        await still_serves(make_agent, address, "dst", nbytes=4096, token=TOKEN, **kw)


@pytest.mark.parametrize("how", ["tcp", "same-host"])
async def test_an_older_client_connects_over_the_proof_round(make_agent, how: str) -> None:
    py = _old_python()
    kw = {"transports": ("tcp",)} if how == "tcp" else {}
    target = await make_agent("target", token=TOKEN, **kw)
    target.alloc(MiB, name="dst")
    loop = asyncio.get_running_loop()
    proc = await within(loop.run_in_executor(None, lambda: subprocess.run(
        [py, "-c", _OLD_CLIENT, TOKEN.decode(), "tcp" if how == "tcp" else "all",
         target.address], capture_output=True, text=True, timeout=60, cwd="/",
        env=dict(os.environ, PYTHONPATH=""))), 70)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok"), proc.stdout
    assert target._server.early.taken == 0


# ------------------------------------------------------------------ the client's side


async def _fake_server(reply) -> tuple[socket.socket, asyncio.Task[bytes]]:
    """A loopback listener that reads a client's Hello, sends reply(hello)
    and returns everything else the client sends until it closes."""
    loop = asyncio.get_running_loop()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)

    async def serve() -> bytes:
        with lsock:
            conn, _ = await loop.sock_accept(lsock)
        with conn:
            h = await protocol.recv_frame(loop, conn)
            assert isinstance(h, metadata.Hello)
            await loop.sock_sendall(conn, reply(h))
            rest = b""
            while chunk := await loop.sock_recv(conn, 4096):
                rest += chunk
            return rest

    return lsock, asyncio.create_task(serve())


async def test_the_client_sends_an_early_proof_only_to_this_host_and_checks_the_accept(
) -> None:
    """Our client's Hello to a loopback server carries an early proof bound
    to that address (verifiable with the key); a server that says it took
    it (Challenge.early) but cannot prove the token in its Accept gets
    AccessDenied, and no Proof of ours: nothing is sent after the Hello."""
    seen: list[metadata.Hello] = []

    def forged(h: metadata.Hello) -> bytes:
        seen.append(h)
        nonce = os.urandom(protocol.NONCE_BYTES)
        return (protocol.encode_frame(metadata.Challenge(
            version=metadata.PROTOCOL_VERSION, nonce=nonce, early=True))
            + protocol.encode_frame(metadata.Accept(name="liar", proof=bytes(32))))

    lsock, task = await _fake_server(forged)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await within(loop.sock_connect(sock, lsock.getsockname()))
    with sock:
        here = here_of(sock)
        with pytest.raises(AccessDenied, match="failed to prove"):
            await within(protocol.client_handshake(loop, sock, name="me", incarnation=1,
                                                   purpose="data", token=KEY))
    assert await within(task) == b""  # no Proof, nothing else
    (h,) = seen
    assert h.early_ts and h.early_proof == protocol.early_proof(KEY, h, here)
    assert protocol.early_proof(KEY, h, "127.0.0.2:1") != h.early_proof


async def test_no_early_proof_without_a_token_or_for_a_join() -> None:
    for token, join in ((None, None), (KEY, (os.urandom(16), 1))):
        a, b = socket.socketpair()
        with a, b:
            _, frame = protocol._hello(name="me", incarnation=1, purpose="data", token=token,
                                       join=join, to=a)
            h = protocol.decode_body(frame[4:])
            assert isinstance(h, metadata.Hello)
            assert not h.early_ts and not h.early_proof
    a, b = socket.socketpair()
    with a, b:  # a unix socket: this host
        _, frame = protocol._hello(name="me", incarnation=1, purpose="verbs", token=KEY, to=a)
        h = protocol.decode_body(frame[4:])
        assert isinstance(h, metadata.Hello) and not h.early_proof  # (verbs: never)
        _, frame = protocol._hello(name="me", incarnation=1, purpose="data", token=KEY, to=a)
        h = protocol.decode_body(frame[4:])
        assert isinstance(h, metadata.Hello) and h.early_proof


def test_same_host_is_told_by_the_kernels_address_only() -> None:
    assert protocol.same_host("/run/x") and protocol.same_host(b"\0abstract")
    assert protocol.same_host(("127.0.0.1", 1)) and protocol.same_host(("127.9.9.9", 1))
    assert protocol.same_host(("::1", 1, 0, 0))
    assert protocol.same_host(("::ffff:127.0.0.1", 1, 0, 0))
    for addr in (("10.0.0.1", 1), ("::ffff:10.0.0.1", 1, 0, 0), ("fe80::1", 1, 0, 2),
                 ("1127.0.0.1", 1), None, 5):
        assert not protocol.same_host(addr), addr
    scope = protocol._NET_SCOPE
    assert protocol.sock_endpoint(("::ffff:127.0.0.1", 5, 0, 0)) == f"127.0.0.1:5@{scope}"

"""Protocol 5 (the stretched key, sec24) against protocol 4, both ways: a
typed error naming the version, at once, and no proof ever sent to the
other version (its proof would only fail as a bad token, AccessDenied,
and hand it an HMAC to test guesses against).

Raw sockets play a version-4 peer in every run; where main's wheel of
protocol 4 is installed (/tmp/vM23, or $AIOXFER_OLD_PYTHON) a real
version-4 agent runs in another process, on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator

import pytest
from conftest import within
from test_security import raw_connect

from aioxfer import ProtocolError, metadata, protocol

TOKEN = b"sec24-versions"
OLD = 4  # the version before the stretched key
OLD_PYTHON = os.environ.get("AIOXFER_OLD_PYTHON", "/tmp/vM23/bin/python")


@contextlib.asynccontextmanager
async def old_server(got: list[metadata.Frame]) -> AsyncIterator[str]:
    """What a protocol-4 server does at accept: its Challenge (a nonce), then
    it reads a Hello and a Proof; every frame it gets lands in ``got``."""
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)

    async def one(sock: socket.socket) -> None:
        with sock:
            await protocol.send_frame(loop, sock, metadata.Challenge(
                version=OLD, nonce=os.urandom(protocol.NONCE_BYTES)))
            with contextlib.suppress(OSError, protocol.ProtocolError, TimeoutError):
                async with asyncio.timeout(3):
                    while True:
                        got.append(await protocol.recv_frame(loop, sock))

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(lsock)
            sock.setblocking(False)
            tasks.add(loop.create_task(one(sock)))

    tasks: set[asyncio.Task[None]] = set()
    acceptor = loop.create_task(accept())
    try:
        yield f"127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        acceptor.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(acceptor, *tasks, return_exceptions=True)
        lsock.close()


async def test_a_version_4_server_gets_a_typed_error_and_no_proof(make_agent) -> None:
    """Before: a version-4 agent answered its Challenge with a Proof (keyed
    on the raw token). Now the client stops at the Challenge's version."""
    init = await make_agent("init", token=TOKEN, transports=("tcp",), peer_timeout=5.0)
    got: list[metadata.Frame] = []
    async with old_server(got) as address:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=f"protocol version {OLD}, this agent 5"):
            await within(init.connect(address))
        assert time.monotonic() - t0 < 2.0
        await asyncio.sleep(0.2)  # anything sent after the Hello would be here by now
    assert got and all(isinstance(f, metadata.Hello) for f in got), got
    assert not any(isinstance(f, metadata.Proof) for f in got)


async def test_a_version_4_client_is_refused_by_name(make_agent) -> None:
    """A version-4 client sends its Hello at connect: the server's Challenge
    names version 5 (the old client stops there) and the Hello gets a Reject
    naming both versions, then the close. Before: the server took the Hello
    and waited for a Proof."""
    target = await make_agent("target", token=TOKEN, transports=("tcp",), peer_timeout=5.0)
    loop = asyncio.get_running_loop()
    sock = await raw_connect(target.address)
    with sock:
        await loop.sock_sendall(sock, protocol.encode_frame(metadata.Hello(
            version=OLD, name="old-client", incarnation=7, purpose="data",
            nonce=os.urandom(protocol.NONCE_BYTES), byteorder=sys.byteorder)))
        t0 = time.monotonic()
        chal = await within(protocol.recv_frame(loop, sock))
        assert isinstance(chal, metadata.Challenge) and chal.version == 5
        async with asyncio.timeout(2):
            reject = await protocol.recv_frame(loop, sock)
        assert isinstance(reject, metadata.Reject), reject
        assert reject.reason == f"protocol version {OLD} is not 5"
        assert await within(loop.sock_recv(sock, 1)) == b""
        assert time.monotonic() - t0 < 2.0


# A version-4 agent in its own process (main's wheel): "serve" prints its
# address and serves until stdin closes; "connect" connects to argv[3] and
# prints what it got and how long it took.
_OLD_AGENT = r"""
import asyncio, sys, time
import aioxfer

async def main(mode, token, address):
    async with aioxfer.Agent("old-" + mode, token=token, peer_timeout=5.0) as agent:
        if mode == "serve":
            print(aioxfer.metadata.PROTOCOL_VERSION, agent.address, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            return
        t0 = time.monotonic()
        try:
            await agent.connect(address)
            print("connected", flush=True)
        except Exception as exc:
            print(f"{time.monotonic() - t0:.3f}", type(exc).__name__, exc, flush=True)

asyncio.run(main(*sys.argv[1:]))
"""

needs_old = pytest.mark.skipif(not os.path.exists(OLD_PYTHON),
                               reason=f"no version-4 aioxfer at {OLD_PYTHON}")


async def _old(mode: str, address: str = "") -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return await asyncio.create_subprocess_exec(
        OLD_PYTHON, "-c", _OLD_AGENT, mode, TOKEN.decode(), address, cwd="/", env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)


@needs_old
async def test_new_client_old_agent_process(make_agent) -> None:
    old = await _old("serve")
    try:
        assert old.stdout is not None
        version, address = (await within(old.stdout.readline(), 60)).decode().split()
        assert version == str(OLD)
        init = await make_agent("init", token=TOKEN, peer_timeout=5.0)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=f"protocol version {OLD}, this agent 5"):
            await within(init.connect(address))
        assert time.monotonic() - t0 < 2.0
    finally:
        assert old.stdin is not None
        old.stdin.close()
        if await within(old.wait(), 30) is None:
            old.kill()


@needs_old
async def test_old_client_process_new_agent(make_agent) -> None:
    target = await make_agent("target", token=TOKEN, peer_timeout=5.0)
    old = await _old("connect", target.address)
    assert old.stdout is not None
    out = (await within(old.communicate(), 60))[0].decode().strip()
    took, kind, message = out.split(" ", 2)
    assert kind == "ProtocolError" and "protocol version 5, this agent 4" in message, out
    assert float(took) < 2.0, out

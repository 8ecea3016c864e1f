"""rv34: an early proof made for one host's loopback is no proof at another's.

A client that dials 127.0.0.1:P believes the server is on its host and
binds its early proof to "127.0.0.1:P". Where that port is a plain
forwarder (socat, a port-forward) to another host, the Hello crosses a
network, and whoever records it there could replay it within the window to
a listener at 127.0.0.1:P on any other host that shares the token: over
loopback tcp, which every local user may dial (the unix socket admits only
the agent's uid). It got the early Challenge and the proved Accept (and the
metadata a "data" Hello asks for) without ever knowing the token. Two real
network namespaces stand for the two hosts (each has its own loopback):
the Hello is made by the client's own code (protocol._hello(to=sock))
against a recorder at 127.0.0.1:P in ours, and replayed to a real agent
listening at 127.0.0.1:P in the other. It must get the ordinary Challenge.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import within

from aioxfer import auth, protocol

TOKEN = b"rv34-early-scope-token"
KEY = auth.hmac_key(TOKEN)

_TARGET = textwrap.dedent("""
    import asyncio, json, sys
    import aioxfer

    async def main():
        async with aioxfer.Agent("rv34-target", token=sys.argv[1].encode(),
                                 listen=["127.0.0.1:0"], transports=("tcp",)) as a:
            print(json.dumps({"address": a.address}), flush=True)
            loop = asyncio.get_running_loop()
            while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "stats":
                print(json.dumps({"taken": a._server.early.taken}), flush=True)

    asyncio.run(main())
""")

_REPLAY = textwrap.dedent("""
    import asyncio, json, socket, sys
    from aioxfer import protocol

    async def main():
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", int(sys.argv[1])))
        await loop.sock_sendall(sock, bytes.fromhex(sys.argv[2]))
        chal = await asyncio.wait_for(protocol.recv_frame(loop, sock), 20)
        out = {"first": type(chal).__name__, "early": bool(getattr(chal, "early", False))}
        if out["early"]:
            acc = await asyncio.wait_for(protocol.recv_frame(loop, sock), 20)
            out["then"] = type(acc).__name__
        print(json.dumps(out), flush=True)

    asyncio.run(main())
""")


async def test_a_loopback_hello_replayed_on_another_hosts_loopback_gets_no_accept() -> None:
    netns = pytest.importorskip("netns")
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    # The children run from "/" with no PYTHONPATH: they import the installed
    # aioxfer, never the checkout's sources (CI installs a wheel: the checkout
    # has no compiled extension).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    loop = asyncio.get_running_loop()
    with netns.rails(1) as net:
        target = net.popen("a", [sys.executable, "-c", _TARGET, TOKEN.decode()],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                           cwd="/")
        assert target.stdin is not None and target.stdout is not None
        line = await within(loop.run_in_executor(None, target.stdout.readline), 30)
        address = json.loads(line)["address"]
        port = int(address.rsplit(":", 1)[1])
        # "Host" one (our namespace): the client dials 127.0.0.1:port, where a
        # recorder (the forwarder's first hop) takes its Hello.
        recorder = socket.create_server(("127.0.0.1", port))
        with recorder:
            client = socket.create_connection(("127.0.0.1", port))
            conn, _ = recorder.accept()
            with client, conn:
                assert protocol._early_target(client) is not None  # it sends one
                _, frame = protocol._hello(name="rv34-client", incarnation=1, purpose="data",
                                           token=KEY, meta=True, to=client)
                client.sendall(frame)
                recorded = b""
                while len(recorded) < len(frame):
                    recorded += conn.recv(65536)
        hello = protocol.decode_body(memoryview(recorded)[4:])
        assert hello.early_proof  # (the client did put one in)
        # "Host" two: the recording replayed at its loopback, same port.
        proc = await within(loop.run_in_executor(None, lambda: subprocess.run(
            ["ip", "netns", "exec", net.ns("a"), sys.executable, "-c", _REPLAY, str(port),
             recorded.hex()], capture_output=True, text=True, timeout=40, env=env, cwd="/")), 50)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        target.stdin.write("stats\n")
        target.stdin.flush()
        stats = json.loads(await within(loop.run_in_executor(None, target.stdout.readline), 30))
        target.stdin.write("exit\n")
        target.stdin.flush()
        assert out == {"first": "Challenge", "early": False}, out
        assert stats["taken"] == 0

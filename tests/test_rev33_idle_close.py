"""rev33: a kept-alive connection the server closed (its idle timeout) just
before our next request on it is written.

aiohttp takes a connection from its pool while the server's FIN may already
be in the kernel, not yet seen by the event loop (it is seen at the loop's
next select; the body's writer task runs first). The request's first write
then goes to a server that is gone: the connection fails, and a PUT whose
body was started is one whose outcome is unknown (objects._Body marks its
body consumed at its first write, so that aiohttp never sends a body twice):
a HEAD, not there, TransportError. Nothing of it had left, though: the
socket was already in CLOSE_WAIT when the write began. Now that write is
refused before anything is sent, and aiohttp sends the request again, on a
new connection (its own rule for idempotent requests whose body was not
consumed).

The server is a blocking one on a thread (its idle close independent of the
test's loop); a request trace hook holds the loop, once, right after a
pooled connection is taken, while the server's idle timeout runs out.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from conftest import pattern, within

pytest.importorskip("obstore")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20
IDLE = 0.3  # the server's keep-alive idle timeout


class IdleClosingS3:
    """PUT: 200 once the body is in; HEAD: 404; an idle connection closed
    after IDLE seconds."""

    def __init__(self) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.connections = 0
        self.puts = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def kwargs(self) -> dict[str, Any]:
        return {"endpoint": f"http://127.0.0.1:{self.port}", "access_key_id": "AKFAKE",
                "secret_access_key": "fake-secret", "region": "us-east-1",
                "max_retries": 0}

    def close(self) -> None:
        self._stop = True
        self.lsock.close()
        for t in [self._accepting, *self._threads]:
            t.join(5)

    def _accept(self) -> None:
        self.lsock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.lsock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while not self._stop:
                conn.settimeout(IDLE)  # idle: waiting for a request's head
                while b"\r\n\r\n" not in buf:
                    got = conn.recv(1 << 16)
                    if not got:
                        return
                    buf += got
                conn.settimeout(10)
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method = lines[0].split(" ")[0]
                clen = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        clen = int(value)
                while len(buf) < clen:
                    got = conn.recv(1 << 20)
                    if not got:
                        return
                    buf += got
                buf = buf[clen:]
                if method == "PUT":
                    self.puts += 1
                    conn.sendall(b'HTTP/1.1 200 OK\r\nETag: "x-1"\r\nContent-Length: 0\r\n\r\n')
                else:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        except (TimeoutError, OSError):
            pass  # idle: closed
        finally:
            conn.close()


async def test_put_on_a_connection_closed_while_idle(make_agent: MakeAgent) -> None:
    # failed before: TransportError "write of object 'k1' ...: the PUT's
    # outcome is unknown (Server disconnected) and the object is not there"
    server = IdleClosingS3()
    try:
        agent = await make_agent("o")
        objs = agent.register_objects("s3://b/t", **server.kwargs())
        n = 2 * MiB  # a PUT of ours (over obstore's size)
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 36)
        await within(agent.write(src[:], objs["k0"]), 30)

        hold = [True]

        async def reused(session: Any, ctx: Any, params: Any) -> None:
            if hold[0]:
                hold[0] = False
                # the loop held (no select) past the server's idle close
                time.sleep(IDLE + 0.3)

        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(reused)
        trace.freeze()
        objs._http()._trace_configs.append(trace)
        await asyncio.sleep(0.1)
        await within(agent.write(src[:], objs["k1"]), 30)
        assert not hold[0], "the pooled connection was not reused"
        assert server.puts == 2
        assert server.connections == 2
    finally:
        server.close()

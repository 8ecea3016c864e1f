"""rev33: the end of a request body's write (objects._Body), against a small
HTTP/1.1 server on loopback that reads bodies at a set pace, or stops
reading one part way.

- a server that stops reading a body whose bytes all fit in the kernel's
  buffers: the write's wait for the send queue to drain (_Body) ends after
  ``read_timeout`` without progress, a TimeoutError (the PUT's outcome
  unknown, the HEAD finds nothing: TransportError), promptly, not at the
  attempt's whole bound (connect + read + bytes / min_rate);
- sequential PUTs read briskly and answered at once keep one connection.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pattern, within

from aioxfer.errors import TransportError

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


class PacedS3:
    """Answers PUTs 200 (an MD5-less e-tag) once their body is read, HEADs
    404. Reads a body ``step`` bytes at a time, sleeping ``pause`` s between
    reads; with ``stop_at``, stops reading a body at that many bytes (the
    connection left open, unread). ``connections`` counts accepted ones."""

    def __init__(self, step: int = 64 << 10, pause: float = 0.0,
                 stop_at: int | None = None) -> None:
        self.step = step
        self.pause = pause
        self.stop_at = stop_at
        self.connections = 0
        self.puts = 0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def kwargs(self) -> dict[str, Any]:
        return {"endpoint": f"http://127.0.0.1:{self.port}", "access_key_id": "AKFAKE",
                "secret_access_key": "fake-secret", "region": "us-east-1"}

    async def start(self) -> None:
        sock = socket.socket()
        if self.stop_at is not None:
            # a small receive window (accepted sockets inherit it): what the
            # server leaves unread stays mostly in the client's send queue,
            # unacknowledged, where _Body sees it (bytes in the server's
            # receive buffer are acknowledged: SIOCOUTQ no longer counts them)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=sock)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(w)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method = lines[0].split(" ")[0]
                clen = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        clen = int(value)
                got = 0
                while got < clen:
                    if self.stop_at is not None and got >= self.stop_at:
                        w.transport.pause_reading()
                        await asyncio.Event().wait()  # till aclose
                    want = min(self.step, clen - got)
                    if self.stop_at is not None:
                        want = min(want, self.stop_at - got)
                    got += len(await r.readexactly(want))
                    if self.pause:
                        await asyncio.sleep(self.pause)
                if method == "PUT":
                    self.puts += 1
                    answer = b'HTTP/1.1 200 OK\r\nETag: "x-1"\r\nContent-Length: 0\r\n\r\n'
                else:
                    answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
                w.write(answer)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError,
                asyncio.CancelledError):
            pass
        finally:
            w.transport.abort()
            self._writers.discard(w)
            self._tasks.discard(task)


async def paced(**kwargs: Any) -> PacedS3:
    server = PacedS3(**kwargs)
    await server.start()
    return server


async def test_server_stops_reading_the_tail(make_agent: MakeAgent) -> None:
    # 3 MiB, of which the server reads 2 MiB and then nothing: the last
    # MiB fits in the two kernels' buffers, so the whole body is written
    # and the write waits for the send queue to drain (_Body). It never
    # does: after read_timeout (1 s) without a byte taken, TimeoutError;
    # the PUT's outcome unknown, the HEAD finds nothing: TransportError.
    # The attempt's whole bound is 1 + 1 + 3 MiB / 64 KiB/s = 50 s: the
    # failure must come from the stall bound, in a few seconds.
    server = await paced(stop_at=2 * MiB)
    try:
        agent = await make_agent("o")
        objs = agent.register_objects("s3://b/t", **server.kwargs(), read_timeout=1.0,
                                      connect_timeout=1.0, max_retries=0)
        n = 3 * MiB
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 33)
        t0 = time.monotonic()
        with pytest.raises(TransportError) as got:
            await within(agent.write(src[:], objs["k"]), 30)
        took = time.monotonic() - t0
        print(f"failed in {took:.2f} s: {got.value}")
        assert "took none of the body's last" in str(got.value)
        assert took < 10
    finally:
        await server.aclose()


async def test_sequential_puts_keep_their_connection(make_agent: MakeAgent) -> None:
    # A server that reads a body at a pace (a send queue left at the
    # write's end, so _Body polls it) and answers as soon as the last
    # byte is read: each PUT's answer may arrive while _Body sleeps
    # between two polls. aiohttp then cancels the body's writer task as
    # the answer ends, and a writer cancelled closes its connection: every
    # PUT a new connection (a TCP, for https a TLS, handshake each).
    server = await paced(step=256 << 10, pause=0.001)
    try:
        agent = await make_agent("o")
        objs = agent.register_objects("s3://b/t", **server.kwargs(), max_retries=0)
        n = 8 * MiB
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 34)
        for i in range(16):
            await within(agent.write(src[:], objs[f"k{i}"]), 60)
        print(f"{server.puts} PUTs over {server.connections} connections")
        assert server.puts == 16
        assert server.connections == 1
    finally:
        await server.aclose()


async def test_idle_pooled_connection_after_an_answer_in_the_poll(
        make_agent: MakeAgent) -> None:
    # As above, with read_timeout 1 s and 1.2 s between PUTs: a PUT whose
    # answer ends while _Body polls hands its connection back to the pool
    # (the fix above), and no read timer of its may be left running there:
    # it would fire on the idle connection, and the next PUT on it fail
    # (TransportError "outcome is unknown (Timeout on reading data from
    # socket)"). (Whether an answer ends during a poll is down to timing:
    # here about a PUT in three.)
    server = await paced(step=256 << 10, pause=0.001)
    try:
        agent = await make_agent("o")
        objs = agent.register_objects("s3://b/t", **server.kwargs(), read_timeout=1.0,
                                      max_retries=0)
        n = 4 * MiB
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 35)
        for i in range(6):
            await within(agent.write(src[:], objs[f"k{i}"]), 60)
            await asyncio.sleep(1.2)
        print(f"{server.puts} PUTs over {server.connections} connections")
        assert server.puts == 6
    finally:
        await server.aclose()

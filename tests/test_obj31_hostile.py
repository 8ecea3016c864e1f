"""obj31: answers a store should never send, from a server on a thread.

- An S3 error body whose <Code> is oversized or holds control characters
  (a hostile or broken server, a proxy's HTML page): its text went whole
  into the error (up to the 64 KiB read of the body), newlines and terminal
  escapes included, into logs and tracebacks. Now a code that is not one
  (S3's are short words: letters, digits, dots) is named as malformed.
- An error answer with an endless body to a PUT: ours reads 64 KiB of it;
  obstore's (small objects) reads it whole into memory (512 MiB offered:
  the client's peak grew by as much; xfail, left to a later change).
- A DELETE answered with a status that is neither done nor gone (400,
  409) was taken as done: now XferError.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from conftest import within

from aioxfer.errors import TransportError, XferError

pytest.importorskip("obstore")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20
Handler = Callable[[socket.socket, str, bytes], None]


class Hostile:
    """Reads each request (head and Content-Length body), then calls
    ``handler(conn, method, head)`` to answer it; counts requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.lsock.getsockname()[1])
        self.requests = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def kwargs(self) -> dict[str, Any]:
        return {"endpoint": f"http://127.0.0.1:{self.port}", "access_key_id": "AKFAKE",
                "secret_access_key": "fake-secret", "region": "us-east-1",
                "max_retries": 0, "read_timeout": 3.0}

    def close(self) -> None:
        self._stop = True
        self.lsock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # (its thread's recv returns)
            except OSError:
                pass
        for t in [self._accepting, *self._threads]:
            t.join(5)

    def _accept(self) -> None:
        self.lsock.settimeout(0.05)
        while not self._stop:
            try:
                conn, _ = self.lsock.accept()
            except (TimeoutError, OSError):
                continue
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        conn.settimeout(5)
        try:
            while not self._stop:
                while b"\r\n\r\n" not in buf:
                    got = conn.recv(1 << 16)
                    if not got:
                        return
                    buf += got
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
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
                self.requests += 1
                self.handler(conn, lines[0].split(" ")[0], head)
        except OSError:
            pass
        finally:
            conn.close()


@pytest.fixture
def hostile() -> Iterator[Callable[[Handler], Hostile]]:
    made: list[Hostile] = []

    def make(handler: Handler) -> Hostile:
        made.append(Hostile(handler))
        return made[-1]

    yield make
    for h in made:
        h.close()


def error_answer(status: int, code: str) -> Handler:
    body = f"<?xml version=\"1.0\"?><Error><Code>{code}</Code></Error>".encode()

    def answer(conn: socket.socket, method: str, head: bytes) -> None:
        if method == "HEAD":
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return
        conn.sendall(b"HTTP/1.1 %d Oops\r\nContent-Type: application/xml\r\n"
                     b"Content-Length: %d\r\n\r\n" % (status, len(body)) + body)

    return answer


HOSTILE_CODES = ["A" * 60000, "Nasty\n\x1b[31mFAKE LOG LINE ERROR\x1b[0m"]


@pytest.mark.parametrize("status", [400, 404, 409, 500])
@pytest.mark.parametrize("code", HOSTILE_CODES, ids=["oversized", "control"])
@pytest.mark.parametrize("op", ["put-ours", "get", "delete"])
async def test_hostile_error_code(make_agent: MakeAgent, hostile: Any, status: int,
                                  code: str, op: str) -> None:
    # failed before (put-ours, get, delete): the code's text whole in the
    # error, 60 KiB of it, or its newline and escape sequence; a DELETE
    # answered 400 or 409 was taken as done (only a 404 is: the key gone)
    if op == "delete" and status == 404:
        pytest.skip("a DELETE's 404 (not NoSuchBucket) is the key gone: done")
    srv = hostile(error_answer(status, code))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://b/t", **srv.kwargs())
    buf = agent.alloc(2 * MiB)  # a PUT of ours (above obstore's size)
    with pytest.raises(XferError) as err:
        if op == "put-ours":
            await within(agent.write(buf[:], objs["k"]), 30)
        elif op == "get":
            await within(agent.read(buf[:4096], objs["k"][0:4096]), 30)
        else:
            await within(objs.delete("k"), 30)
    text = str(err.value)
    assert len(text) < 2000, text[:300]
    assert "\n" not in text and "\x1b" not in text, text[:300]
    assert "FAKE LOG LINE" not in text


def endless_error(conn: socket.socket, method: str, head: bytes) -> None:
    """A 500 whose body (chunked) does not end soon: 512 MiB offered."""
    if method == "HEAD":
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        return
    conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Type: application/xml\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % MiB + b"<" * MiB + b"\r\n"
    for _ in range(512):
        conn.sendall(chunk)


@pytest.mark.parametrize("n", [
    pytest.param(64 << 10, marks=pytest.mark.xfail(
        strict=True, reason="obstore (object_store) reads an error body whole into memory: "
        "a PUT of up to min_rate * read_timeout bytes is obstore's")),
    2 * MiB], ids=["obstore-put", "own-put"])
async def test_endless_error_body_bounded(make_agent: MakeAgent, hostile: Any, n: int) -> None:
    srv = hostile(endless_error)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://b/t", **srv.kwargs())
    buf = agent.alloc(n)
    # the process's resident memory sampled through the write (its peak so
    # far, ru_maxrss, may be above what this write adds)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    rss0, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with pytest.raises(TransportError):
            await within(agent.write(buf[:], objs["k"]), 60)
    finally:
        done.set()
        sampler.join(5)
    grown = max(peak[0], rss()) - rss0
    assert grown < 128 * MiB, f"the client's resident memory grew by {grown >> 20} MiB"


def truncated(conn: socket.socket, method: str, head: bytes) -> None:
    """A GET's 200 promising 4096 bytes, 100 sent, the connection closed."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\nETag: \"x\"\r\n\r\n" + b"z" * 100)
    conn.shutdown(socket.SHUT_RDWR)


def loris(conn: socket.socket, method: str, head: bytes) -> None:
    """An answer's head, a byte every 0.5 s (each read in time), for ever."""
    for b in b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\nX-Pad: " + b"a" * 1000:
        conn.sendall(bytes([b]))
        threading.Event().wait(0.5)


@pytest.mark.parametrize("server", [truncated, loris], ids=["truncated", "slow-loris"])
async def test_get_truncated_or_trickled(make_agent: MakeAgent, hostile: Any,
                                         server: Handler) -> None:
    # A typed error within the request's bound (connect_timeout +
    # read_timeout + bytes / min_rate: 2 + 3 + 0.06 s here), nothing hangs
    srv = hostile(server)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://b/t", **srv.kwargs())
    buf = agent.alloc(4096)
    with pytest.raises(TransportError):
        await within(agent.read(buf[:], objs["k"][0:4096]), 30)
    with pytest.raises(TransportError):
        await within(agent.read(buf[:], objs["k"]), 30)


async def test_cancelled_get_of_a_trickling_server(make_agent: MakeAgent,
                                                  hostile: Any) -> None:
    # A cancel is prompt (the read's destination let go at once), the
    # connection closed; the agent's close then finds nothing in flight
    srv = hostile(loris)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://b/t", **srv.kwargs())
    buf = agent.alloc(4096)
    task = asyncio.ensure_future(agent.read(buf[:], objs["k"]))
    await asyncio.sleep(1.0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task, 2)
    await within(objs.aclose(), 5)

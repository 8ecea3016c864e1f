"""rv31c: a request the server read whole, then reset without an answer, is
not "proven unsent".

obj31's resend (_Body.never_reached) takes a connection reset with none of
the request's bytes acknowledged as proof that none reached the server.
But a server's kernel delays its ACK of a small request on a kept-alive
connection (delayed ACK, up to 40 ms and more, in the hope of riding on the
answer), and a reset carries no acknowledgement that the client's kernel
takes in: a server (or a proxy in front of it) that read the whole request,
ran it, and then reset the connection (an abortive close, SO_LINGER 0)
leaves the same trace. The request was then sent a second time: a
multipart upload's complete, completed by the first, found NoSuchUpload on
its resend and the write failed ObjectNotFound, though the object was
written; a conditional create that landed failed ObjectExists. What tells
the idle close apart: the server's FIN came before its reset (the race is
a request written into a connection the server had closed), while an
abortive close sends the reset alone.

A real store (rclone serve s3) behind a relay on a thread, which, armed,
forwards one request whole (head and body), reads the store's whole answer
(the request has run), and resets the client's connection instead of
passing the answer on.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from conftest import pattern, within
from s3server import S3Server, server

pytest.importorskip("obstore")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


def _head_and_length(buf: bytes) -> tuple[int, int] | None:
    """(the head's length, the Content-Length) of an HTTP message at the
    start of ``buf``, None while its head is not complete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    length = 0
    for line in buf[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return end + 4, length


class ResetRelay:
    """A relay on a thread in front of ``target``. Armed with markers (bytes
    of a request's first line), the next request whose head holds all is
    forwarded whole, its answer read whole from the store, and the client's
    connection then reset (SO_LINGER 0), the answer not passed on. Counts
    the requests going up whose first line holds ``count``."""

    def __init__(self, target: S3Server) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.lsock.getsockname()[1])
        self.armed: tuple[bytes, ...] | None = None
        self.resets = 0
        self.count = b""
        self.counted = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def kwargs(self) -> dict[str, str]:
        return {**self.target.kwargs(), "endpoint": f"http://127.0.0.1:{self.port}"}

    def close(self) -> None:
        self._stop = True
        self.lsock.close()
        for t in [self._accepting, *self._threads]:
            t.join(5)

    def _accept(self) -> None:
        self.lsock.settimeout(0.05)
        while not self._stop:
            try:
                conn, _ = self.lsock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.target.port))
        pending = b""  # the client's bytes of a request not yet forwarded
        try:
            while not self._stop:
                ready, _, _ = select.select([client, up], [], [], 0.01)
                if up in ready:
                    data = up.recv(1 << 20)
                    if not data:
                        return
                    client.sendall(data)
                if client not in ready:
                    continue
                data = client.recv(1 << 20)
                if not data:
                    return
                pending += data
                # forwarded a request at a time: its head is looked at
                while True:
                    got = _head_and_length(pending)
                    if got is None:
                        break
                    head_len, length = got
                    first = pending[:pending.find(b"\r\n")]
                    if self.armed is not None and all(m in first for m in self.armed):
                        while len(pending) < head_len + length:
                            more = client.recv(1 << 20)
                            if not more:
                                return
                            pending += more
                        self._reset_after(client, up, pending[:head_len + length], first)
                        return
                    if self.count and self.count in first:
                        self.counted += 1
                    # the rest of this request (its body) is passed as it comes
                    up.sendall(pending)
                    sent = len(pending) - head_len
                    pending = b""
                    while sent < length:
                        more = client.recv(min(1 << 20, length - sent))
                        if not more:
                            return
                        up.sendall(more)
                        sent += len(more)
                    break
        except OSError:
            pass
        finally:
            client.close()
            up.close()

    def _reset_after(self, client: socket.socket, up: socket.socket, request: bytes,
                     first: bytes) -> None:
        self.armed = None
        if self.count and self.count in first:
            self.counted += 1
        up.sendall(request)
        answer = b""
        while True:
            got = _head_and_length(answer)
            if got is not None and len(answer) >= got[0] + got[1]:
                break
            more = up.recv(1 << 20)
            if not more:
                break
            answer += more
        # the request ran at the store; the client gets a reset, no answer
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.resets += 1


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def relay(s3: S3Server) -> Iterator[ResetRelay]:
    r = ResetRelay(s3)
    try:
        yield r
    finally:
        r.close()


async def test_complete_read_then_reset_not_resent(make_agent: MakeAgent, s3: S3Server,
                                                   relay: ResetRelay) -> None:
    # Failed on b30e0dd9: XferError/ObjectNotFound "multipart write ...
    # (complete): not found (NoSuchUpload)" -- the complete, done by its
    # first attempt, was resent at once as "never reached", found no such
    # upload, and its attempt number (1) said that could not be an earlier
    # attempt's doing. Before obj31 (and after this fix): the cut complete
    # is retried within the budget, its NoSuchUpload on attempt 2 sends the
    # write to the HEAD, which finds the object.
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), max_retries=2,
                                  part_size=5 * MiB)
    n = 5 * MiB + 4096  # two parts
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 41)
    await within(agent.write(src[:], objs["k0"]), 60)  # (the pool's connections)
    # the complete: "POST /...?uploadId=" (the create is "?uploads")
    relay.armed = (b"POST /", b"uploadId=")
    relay.count = b"POST /"
    relay.counted = 0
    src.numpy()[:] = pattern(n, 42)
    await within(agent.write(src[:], objs["k1"]), 60)
    assert relay.resets == 1
    assert s3.file(bucket, "t/k1").read_bytes() == bytes(src.numpy())


async def test_small_put_read_then_reset_not_resent(make_agent: MakeAgent, s3: S3Server,
                                                    relay: ResetRelay) -> None:
    # A single PUT of ours (part_md5: every PUT is ours) the store read and
    # stored, its connection then reset: its outcome is unknown, the HEAD
    # finds it written; it is not sent a second time. Failed on b30e0dd9:
    # two PUTs of k1 went up.
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), max_retries=0,
                                  part_md5=True)
    n = 512
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 43)
    await within(agent.write(src[:], objs["k0"]), 30)
    relay.armed = (b"PUT /",)
    relay.count = b"PUT /"
    relay.counted = 0
    src.numpy()[:] = pattern(n, 44)
    await within(agent.write(src[:], objs["k1"]), 30)
    assert relay.resets == 1
    assert relay.counted == 1, "the PUT the store ran was sent again"
    assert s3.file(bucket, "t/k1").read_bytes() == bytes(src.numpy())


async def test_create_read_then_reset_is_written(make_agent: MakeAgent, s3: S3Server,
                                                 relay: ResetRelay) -> None:
    # A conditional create the store ran, its connection reset: written (the
    # HEAD finds our bytes). Failed on b30e0dd9: resent at once, the resend
    # found the key taken (412) by the first, and the create raised
    # ObjectExists for the object it had written.
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), max_retries=0,
                                  part_md5=True)
    n = 512
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 45)
    await within(agent.write(src[:], objs["k0"]), 30)
    relay.armed = (b"PUT /",)
    relay.count = b"PUT /"
    relay.counted = 0
    src.numpy()[:] = pattern(n, 46)
    await within(agent.write(src[:], objs.create("k1")), 30)
    assert relay.resets == 1
    # (rclone serve s3 does not refuse a create of a taken key: the resend
    # there overwrote it with the same bytes, where S3 answers 412)
    assert relay.counted == 1, "the create the store ran was sent again"
    assert s3.file(bucket, "t/k1").read_bytes() == bytes(src.numpy())

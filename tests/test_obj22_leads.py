"""obj22: the object backend's leads left by obj20 / rev21 (notes/s21.md).

1. A cancelled ``ObjectRegion.aclose`` (cancelled while a multipart upload
   ran) left the region's HTTP session, and its pooled connections to the
   store, open until something closed the region again (rclone here).
2. Our own requests had no bound as a whole (``ClientTimeout(total=None)``,
   only a per-read one): a server trickling a byte every 0.2 s held a HEAD,
   a GET or a multipart create for as long as it liked (a small in-process
   server that does so on purpose).
3. Multipart parts went UNSIGNED-PAYLOAD with no Content-MD5: a proxy that
   flips a byte of a part over plain http changed the stored object and the
   write succeeded. ``part_md5=True`` sends Content-MD5 (rclone checks it:
   400 BadDigest) and the part is sent again.
4. ``_signed_request`` read an error's body with one ``read(4096)``: an
   error split across packets lost its code (a DELETE answered 404
   NoSuchBucket in two pieces counted as done).
5. A ``credential_provider`` (obstore's callback) could not be given to
   ``register_objects``; with it, the multipart upload is ours (signed with
   the provider's credentials, no redirect followed) against rclone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import s3server
from conftest import FakeS3, pattern, s3_answer, s3_stage, within
from s3server import ACCESS_KEY, SECRET_KEY, FaultProxy, S3Server

from aioxfer.errors import ClosedResourceError, ObjectNotFound, TransportError, XferError

aiohttp = pytest.importorskip("aiohttp")
web = pytest.importorskip("aiohttp.web")

s3 = s3server.s3  # the fixture, by name

MakeAgent = Callable[..., Awaitable[Any]]
MakeFake = Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[FakeS3]]
MiB = 1 << 20
CREDS = dict(access_key_id="AKIDOBJ22", secret_access_key="SECRET-obj22", region="us-east-1")


def connections_to(port: int) -> int:
    """This process's established TCP connections to 127.0.0.1:``port``
    (its socket fds matched to /proc/net/tcp's entries)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    want = f"0100007F:{port:04X}"
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[2] == want and cols[3] == "01" and cols[9] in inodes:
                n += 1
    return n


# --- 1. a cancelled aclose ------------------------------------------------


async def test_cancelled_aclose_still_closes_the_session(make_agent: MakeAgent,
                                                          s3: S3Server) -> None:
    bucket = s3.bucket("c")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/c", **s3.kwargs(), part_size=5 * MiB,
                                  check_multipart=False)
    src = agent.alloc(40 * MiB)
    src.numpy()[:] = pattern(40 * MiB, 1)
    t = agent.write(src[:], objs["k"])
    async with asyncio.timeout(20):
        while not objs._uploads:  # the multipart upload is running
            await asyncio.sleep(0.001)
    closing = asyncio.ensure_future(objs.aclose())
    await asyncio.sleep(0.005)
    assert objs._uploads, "the upload ended before the cancel: nothing tested"
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await within(closing)
    # the upload goes on (aclose lets writes in flight finish) and ends
    with contextlib.suppress(ClosedResourceError):
        await within(t, 60)
    async with asyncio.timeout(5):
        while connections_to(s3.port):
            await asyncio.sleep(0.05)
    assert objs._session is None


# --- 2. a server that trickles ---------------------------------------------


class Trickler:
    """An HTTP server on loopback that reads each request whole, then
    answers it a byte every ``every`` seconds: the status line and then
    header bytes (``where="head"``), or a whole head and then the body
    (``where="body"``; 200 with a Content-Length of 4096)."""

    def __init__(self, where: str, every: float = 0.2) -> None:
        self.where = where
        self.every = every
        self.requests: list[bytes] = []
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        for task in list(self._tasks):  # still dripping: stopped, waited for
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(w)
        try:
            head = await r.readuntil(b"\r\n\r\n")
            clen = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    clen = int(value)
            await r.readexactly(clen)
            self.requests.append(head.split(b"\r\n", 1)[0])
            if self.where == "head":
                w.write(b"HTTP/1.1 200 OK\r\nX-Pad: ")
                drip = b"a" * 10_000
            else:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: 4096\r\n\r\n")
                drip = b" " * 4096
            for i in range(len(drip)):
                w.write(drip[i:i + 1])
                await w.drain()
                await asyncio.sleep(self.every)
        except (ConnectionError, asyncio.IncompleteReadError, OSError,
                asyncio.CancelledError):
            pass  # (a cancel by aclose: ended quietly, not left to the loop's callback)
        finally:
            w.transport.abort()
            self._writers.discard(w)
            self._tasks.discard(task)


@pytest.fixture
async def trickler() -> Any:
    made: list[Trickler] = []

    async def make(where: str) -> Trickler:
        t = Trickler(where)
        await t.start()
        made.append(t)
        return t

    yield make
    for t in made:
        await t.aclose()


def trickled(agent: Any, endpoint: str) -> Any:
    # sock_read (1 s) is met by every byte (0.2 s apart); the bound as a
    # whole is connect_timeout + read_timeout (+ bytes / min_rate) = 2 s
    return agent.register_objects("s3://bkt/pre", endpoint=endpoint, **CREDS,
                                  part_size=5 * MiB, max_retries=1, retry_timeout=1.0,
                                  connect_timeout=1.0, read_timeout=1.0)


@pytest.mark.parametrize("op", ["stat", "read", "write"])
async def test_trickling_server_is_bounded(make_agent: MakeAgent, trickler: Any,
                                           op: str) -> None:
    srv = await trickler("head" if op == "stat" else "body")
    agent = await make_agent("o")
    objs = trickled(agent, srv.endpoint)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TransportError, match="failed after"):
        if op == "stat":
            await within(objs.stat("k"), 15)
        elif op == "read":
            dst = agent.alloc(4096)
            await within(agent.read(dst[:], objs["k"]), 15)
        else:  # a multipart upload's create (POST ?uploads), ours
            src = agent.alloc(6 * MiB)
            await within(agent.write(src[:], objs["k"]), 15)
    took = loop.time() - t0
    # one attempt of ~2 s (+ bytes / min_rate), the retry budget (1 s) spent
    assert took < 8, took
    assert srv.requests, "the server saw no request"


# --- 3. a proxy that flips a byte of a part -------------------------------


class Flipper:
    """An HTTP/1.1 proxy in front of an S3Server that flips one byte in the
    body of the first ``flips`` multipart part PUTs it relays (a corrupting
    middlebox over plain http); ``parts`` counts the part PUTs relayed."""

    def __init__(self, target: S3Server, flips: int = 1) -> None:
        self.target = target
        self.flips = flips
        self.parts = 0
        self.flipped = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._writers.add(cw)
        sw: asyncio.StreamWriter | None = None
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target.port)
            self._writers.add(sw)
            while True:
                head = await cr.readuntil(b"\r\n\r\n")
                clen = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        clen = int(value)
                body = bytearray(await cr.readexactly(clen))
                first = head.split(b"\r\n", 1)[0].decode()
                method = first.split(" ", 1)[0]
                if method == "PUT" and "partNumber=" in first:
                    self.parts += 1
                    if self.flipped < self.flips:
                        self.flipped += 1
                        body[len(body) // 2] ^= 0x01
                sw.write(head + body)
                await sw.drain()
                if not await FaultProxy._relay_answer(sr, cw, method):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            for w in (sw, cw):
                if w is not None:
                    w.transport.abort()
                    self._writers.discard(w)


@pytest.mark.parametrize("part_md5", [False, True])
async def test_flipped_byte_in_a_part(make_agent: MakeAgent, s3: S3Server,
                                      part_md5: bool) -> None:
    bucket = s3.bucket("f")
    px = Flipper(s3)
    await px.start()
    try:
        agent = await make_agent("o")
        kw = {**s3.kwargs(), "endpoint": f"http://127.0.0.1:{px.port}"}
        if part_md5:
            kw["part_md5"] = True
        via = agent.register_objects(f"s3://{bucket}/f", **kw, part_size=5 * MiB)
        direct = agent.register_objects(f"s3://{bucket}/f", **s3.kwargs())
        n = 12 * MiB  # three parts
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 3)
        await within(agent.write(src[:], via["k"]), 60)
        dst = agent.alloc(n)
        await within(agent.read(dst[:], direct["k"]), 60)
        same = bytes(dst.numpy()) == bytes(src.numpy())
        assert px.flipped == 1
        if part_md5:
            # the store refused the flipped part (BadDigest); sent again
            assert same, "the stored object differs from what was written"
            assert px.parts == 4
        else:
            # without Content-MD5 the corruption lands unseen: the hazard
            assert not same and px.parts == 3
    finally:
        await px.aclose()


# --- 4. an error body in two pieces ---------------------------------------


def split_error(status: int, code: str) -> Callable[[Any], Awaitable[Any]]:
    async def handler(req: Any) -> Any:
        if s3_stage(req) not in ("delete", "get"):
            return await s3_answer(req)
        await req.read()
        resp = web.StreamResponse(status=status, headers={"Content-Type": "application/xml"})
        await resp.prepare(req)
        await resp.write(b'<?xml version="1.0" encoding="UTF-8"?>\n<Error>')
        await asyncio.sleep(0.3)
        await resp.write(f"<Code>{code}</Code><Message>m</Message></Error>".encode())
        await resp.write_eof()
        return resp
    return handler


async def test_split_error_body_delete(make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    srv = await fake_s3(split_error(404, "NoSuchBucket"))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, **CREDS,
                                  max_retries=0)
    # a 404 NoSuchKey is "gone, as asked"; NoSuchBucket is not
    with pytest.raises(ObjectNotFound, match="no such bucket"):
        await within(objs.delete("k"))


async def test_split_error_body_read(make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    srv = await fake_s3(split_error(400, "InvalidRequest"))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, **CREDS,
                                  max_retries=0)
    dst = agent.alloc(4096)
    with pytest.raises(XferError, match="HTTP 400 InvalidRequest"):
        await within(agent.read(dst[:], objs["k"]))


# --- 5. a credential provider ---------------------------------------------


def provider(calls: list[str], token: str = "obj22-session-token",
             is_async: bool = False) -> Callable[[], Any]:
    def creds() -> dict[str, Any]:
        calls.append("called")
        return {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                "token": token, "expires_at": datetime.now(UTC) + timedelta(hours=1)}

    async def acreds() -> dict[str, Any]:
        return creds()

    return acreds if is_async else creds


@pytest.mark.parametrize("is_async", [False, True])
async def test_credential_provider_against_rclone(make_agent: MakeAgent, s3: S3Server,
                                                  is_async: bool) -> None:
    bucket = s3.bucket("p")
    calls: list[str] = []
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/p", endpoint=s3.endpoint,
                                  region="us-east-1", part_size=5 * MiB,
                                  credential_provider=provider(calls, is_async=is_async))
    for n in (12 * MiB, 64 << 10):  # multipart (ours), then one PUT (obstore's)
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, n)
        await within(agent.write(src[:], objs[f"k{n}"]), 60)
        dst = agent.alloc(n)
        await within(agent.read(dst[:], objs[f"k{n}"]), 60)
        assert bytes(dst.numpy()) == bytes(src.numpy())
        st = await within(objs.stat(f"k{n}"))
        assert st.size == n
    assert calls, "the provider was never asked"
    assert objs._provided_creds is not None  # our own requests signed with its answer


async def test_credential_provider_upload_follows_no_redirect(make_agent: MakeAgent,
                                                               fake_s3: MakeFake) -> None:
    other = await fake_s3(s3_answer)

    async def redirecting(req: Any) -> Any:
        if s3_stage(req) == "create_mpu":
            await req.read()
            raise web.HTTPTemporaryRedirect(f"{other.endpoint}{req.path_qs}")
        return await s3_answer(req)

    srv = await fake_s3(redirecting)
    calls: list[str] = []
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, region="us-east-1",
                                  part_size=5 * MiB, max_retries=0,
                                  credential_provider=provider(calls))
    src = agent.alloc(6 * MiB)
    with pytest.raises(XferError, match="redirect"):
        await within(agent.write(src[:], objs["k"]), 20)
    # nothing, the session token least of all, went to the other host
    assert other.seen == []
    create = [h for stage, _, h in srv.seen if stage == "create_mpu"]
    assert create and create[0].get("X-Amz-Security-Token") == "obj22-session-token"

"""Object backend: presigned URLs (bearer credentials) reach no error text
and no log line, signed GETs follow no redirect, a 403 to a cached URL signs
again once, short chunked reads are a size mismatch, '.'/'..' keys are
refused up front, a cancelled multipart write leaves no upload open.

The hostile endpoints are aiohttp servers on loopback (conftest's fake_s3)
or a bare listener, started by each test; the multipart test runs against
real ``rclone serve s3`` (tests/s3server.py) and lists uploads with boto3."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import s3server
from conftest import within
from s3server import S3Server

from aioxfer.errors import AccessDenied, ObjectNotFound, TransportError, XferError

pytest.importorskip("obstore")
web = pytest.importorskip("aiohttp.web")

s3 = s3server.s3  # the fixture, by name

MakeAgent = Callable[..., Awaitable[Any]]
TOKEN = "SESSION-TOKEN-SECRET-obj18"
CREDS = dict(access_key_id="AKIDOBJ18EXAMPLE", secret_access_key="SECRETKEY-obj18",
             session_token=TOKEN, region="us-east-1")
# What a presigned URL carries that must be seen nowhere: the session token,
# the access key id (in X-Amz-Credential) and the signature parameter.
SECRETS = (TOKEN, CREDS["access_key_id"], "X-Amz-Signature=", "X-Amz-Credential=")


def chain_texts(exc: BaseException | None) -> list[str]:
    """str() and repr() of an exception and of everything it links to
    (cause, context), as a traceback or an error reporter would show."""
    out: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out += [str(exc), repr(exc)]
        nxt = exc.__cause__ or exc.__context__
        exc = nxt
    return out


def assert_clean(texts: list[str]) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} in {text!r}"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
         ) -> Iterator[Callable[[], list[str]]]:
    """Every log line of the test: stdlib records at DEBUG (aiohttp's, the
    asyncio loop's) and aioxfer's structlog events (rendered to stderr when
    the application did not configure structlog)."""
    caplog.set_level(logging.DEBUG)

    def lines() -> list[str]:
        out, err = capsys.readouterr()
        recs = [r.getMessage() for r in caplog.records]
        recs += [repr(r.args) for r in caplog.records]
        recs += [r.exc_text or "" for r in caplog.records]
        return recs + [out, err]

    yield lines


def register(agent: Any, endpoint: str, **kw: Any) -> Any:
    return agent.register_objects("s3://bkt/pre", endpoint=endpoint, **CREDS, **kw)


async def test_connect_timeout_leaks_no_credentials(make_agent: MakeAgent,
                                                    logs: Callable[[], list[str]]) -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs
    # and the GET's connect times out, aiohttp's error naming the whole URL.
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(0)
    port = ls.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fillers.append(s)
        await asyncio.sleep(0.2)
        agent = await make_agent("o")
        objs = register(agent, f"http://127.0.0.1:{port}", max_retries=1, retry_timeout=3.0,
                        connect_timeout=0.3)
        dst = agent.alloc(4096)
        with pytest.raises(TransportError) as ei:
            await within(agent.read(dst[0:4096], objs["k"]), 10)
        assert "timeout" in str(ei.value).lower()  # still says what went wrong
        assert_clean(chain_texts(ei.value))
        assert_clean(logs())
    finally:
        for s in fillers:
            s.close()
        ls.close()


async def test_redirect_not_followed_nor_leaked(make_agent: MakeAgent, fake_s3: Any,
                                                logs: Callable[[], list[str]]) -> None:
    other = await fake_s3(lambda req: _ok(req, 4096))  # where a redirect points

    async def handle(req: Any) -> Any:
        key = req.path.rsplit("/", 1)[-1]
        if key == "loop":  # to itself, query and all (aiohttp follows 10)
            raise web.HTTPTemporaryRedirect(location=str(req.url))
        # elsewhere, with the signed query: the credentials would go along
        raise web.HTTPTemporaryRedirect(location=f"{other.endpoint}{req.path_qs}")

    fake = await fake_s3(handle)
    agent = await make_agent("o")
    objs = register(agent, fake.endpoint, max_retries=4, retry_timeout=10.0)
    dst = agent.alloc(4096)
    for key in ("loop", "away"):
        with pytest.raises(XferError) as ei:
            await within(agent.read(dst[0:4096], objs[key]), 10)
        assert "redirect" in str(ei.value) and "307" in str(ei.value)
        assert_clean(chain_texts(ei.value))
        # a 3xx is final: one GET, not ten per attempt times five attempts
        assert fake.hits[("GET", key)] == 1
    assert other.hits == {}  # the signed URL went nowhere else
    assert_clean(logs())


async def _ok(req: Any, size: int) -> Any:
    body = bytes(range(256)) * (size // 256)
    return web.Response(body=body, headers={"ETag": '"e"',
                                            "Last-Modified": email.utils.formatdate(usegmt=True)})


async def test_kv_probe_log_leaks_no_credentials(make_agent: MakeAgent, fake_s3: Any,
                                                 logs: Callable[[], list[str]]) -> None:
    # The KV object tier logs a failed probe (kv.object_probe_failed, with
    # the error's repr): a HEAD finds the block, the GET of its trailer is
    # redirected.
    from aioxfer import kv
    from aioxfer.kv.objects import TRAILER
    bb = 4096

    async def handle(req: Any) -> Any:
        if req.method == "HEAD":
            return web.Response(headers={
                "Content-Length": str(bb + TRAILER), "ETag": '"e"',
                "Last-Modified": email.utils.formatdate(usegmt=True)})
        raise web.HTTPTemporaryRedirect(location=str(req.url))

    fake = await fake_s3(handle)
    agent = await make_agent("kv")
    objs = register(agent, fake.endpoint, max_retries=1, retry_timeout=3.0)
    tier = kv.ObjectTier(objs)
    store = await kv.Store.open(agent, block_bytes=bb, tiers=[tier])
    try:
        keys = kv.chain(list(range(16)), block_tokens=16, namespace=b"obj18")
        hit = await within(store.lookup(keys), 10)
        assert hit.prefix == 0 and tier.counters.errors == 1
    finally:
        await store.aclose()
    lines = logs()
    assert any("kv.object_probe_failed" in line for line in lines)
    assert_clean(lines)


async def test_403_on_cached_url_signs_again_once(make_agent: MakeAgent, fake_s3: Any) -> None:
    # The server accepts only URLs signed at or after ``cutoff`` (as after a
    # credential rotation): a URL from the signer's cache made before then
    # is answered 403. The signer is obstore's own, not replaced.
    cutoff = [""]
    dates: list[str] = []

    async def handle(req: Any) -> Any:
        date = req.query.get("X-Amz-Date", "")
        dates.append(date)
        if date < cutoff[0] or req.path.endswith("/never"):
            return web.Response(status=403, text="<Error><Code>AccessDenied</Code></Error>")
        return await _ok(req, 4096)

    fake = await fake_s3(handle)
    agent = await make_agent("o")
    objs = register(agent, fake.endpoint, max_retries=0)
    dst = agent.alloc(4096)
    await within(agent.read(dst[0:4096], objs["k"]), 10)
    assert fake.hits[("GET", "k")] == 1
    await asyncio.sleep(1.1)  # X-Amz-Date has a resolution of one second
    cutoff[0] = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    await within(agent.read(dst[0:4096], objs["k"]), 10)  # cached URL: 403, signed anew
    assert fake.hits[("GET", "k")] == 3
    assert dates[1] == dates[0] < cutoff[0] <= dates[2]
    await within(agent.read(dst[0:4096], objs["k"]), 10)  # the fresh URL is cached
    assert fake.hits[("GET", "k")] == 4 and dates[3] == dates[2]
    # A 403 to a URL just signed is final: one GET.
    with pytest.raises(AccessDenied):
        await within(agent.read(dst[0:4096], objs["never"]), 10)
    assert fake.hits[("GET", "never")] == 1
    # ... and so is a second 403 after signing again: two GETs, not a loop.
    cutoff[0] = "99999999T999999Z"
    with pytest.raises(AccessDenied):
        await within(agent.read(dst[0:4096], objs["k"]), 10)
    assert fake.hits[("GET", "k")] == 6


async def test_short_chunked_read_is_size_mismatch(make_agent: MakeAgent, fake_s3: Any) -> None:
    async def handle(req: Any) -> Any:
        # the object is 1000 bytes, sent chunked (no Content-Length)
        resp = web.StreamResponse(status=200)
        resp.enable_chunked_encoding()
        await resp.prepare(req)
        await resp.write(b"x" * 1000)
        await resp.write_eof()
        return resp

    fake = await fake_s3(handle)
    agent = await make_agent("o")
    objs = register(agent, fake.endpoint, max_retries=4, retry_timeout=10.0)
    dst = agent.alloc(4096)
    with pytest.raises(XferError) as ei:
        await within(agent.read(dst[0:4096], objs["short"]), 10)
    assert not isinstance(ei.value, TransportError)
    assert "1000 bytes" in str(ei.value) and "4096" in str(ei.value)
    assert fake.hits[("GET", "short")] == 1  # not retried: the answer was whole


async def test_cut_chunked_read_is_still_retried(make_agent: MakeAgent) -> None:
    # The other side of the rule above: a chunked body whose connection is
    # cut before its last chunk is a transient failure, retried.
    gets = 0

    async def serve(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        nonlocal gets
        try:
            while await cr.readline() not in (b"\r\n", b""):
                pass
            gets += 1
            cw.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3e8\r\n" + b"x" * 1000 + b"\r\n")  # no terminating 0-chunk
            await cw.drain()
        finally:
            cw.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        agent = await make_agent("o")
        objs = register(agent, f"http://127.0.0.1:{port}", max_retries=2, retry_timeout=10.0)
        dst = agent.alloc(4096)
        with pytest.raises(TransportError):
            await within(agent.read(dst[0:4096], objs["cut"]), 10)
        assert gets == 3
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("key", ["..", ".", "../escape", "a/../b", "./a", "a/./b", "a/..",
                                 "a/."])
async def test_dot_segments_refused_up_front(make_agent: MakeAgent, key: str) -> None:
    agent = await make_agent("o")
    objs = register(agent, "http://127.0.0.1:9")  # never contacted
    for make in (lambda: objs[key], lambda: objs.create(key),
                 lambda: objs.segments([key])):
        with pytest.raises(ValueError, match="'.' or '..' segments"):
            make()
    for call in (objs.stat, objs.delete):
        with pytest.raises(ValueError, match="'.' or '..' segments"):
            await call(key)
    # obstore drops a trailing '/' ("a/" would alias "a"): refused as well
    for key in ("a/", "b/c/"):
        with pytest.raises(ValueError, match="no trailing '/'"):
            objs[key]
    # names that merely contain dots are keys like any other
    for ok in ("a..b", ".hidden", "a/.b", "..a/b", "%2e%2e/x"):
        assert objs[ok].key == ok


MiB = 1 << 20


async def test_cancelled_multipart_write_leaves_no_upload(make_agent: MakeAgent,
                                                          s3: S3Server) -> None:
    boto3 = pytest.importorskip("boto3")
    bucket = s3.bucket()
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3server.ACCESS_KEY,
                          aws_secret_access_key=s3server.SECRET_KEY, region_name="us-east-1")
    agent = await make_agent("mpu")
    # 7 MiB: a multipart upload (part_size 5 MiB) of an object small enough
    # to be uploaded from the backend's own copy (OWNED_MAX)
    objs = agent.register_objects(f"s3://{bucket}", **s3.kwargs(), part_size=5 * MiB)
    src = agent.alloc(7 * MiB)
    src.numpy()[:] = 7
    cancelled = 0
    for i, delay in enumerate([0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.2, 0.3]):
        t = agent.write(src[:], objs[f"obj{i}"])
        await asyncio.sleep(delay)
        t.cancel()
        try:
            await within(t, 30)
        except asyncio.CancelledError:
            cancelled += 1
        await within(t.stopped(), 30)
    assert cancelled  # (the later ones may have finished first)
    ups = await asyncio.to_thread(client.list_multipart_uploads, Bucket=bucket)
    assert ups.get("Uploads", []) == []
    # (whether each object landed depends on when its cancel came; a write
    # after them all still works)
    await within(agent.write(src[:], objs["after"]), 30)
    st = await objs.stat("after")
    assert st.exists and st.size == 7 * MiB
    with pytest.raises(ObjectNotFound):
        await within(agent.read(src[0:4096], objs["never-written"]), 10)

"""rev21: obj20's own multipart upload reads a create's or complete's answer
with one ``resp.content.read(1 << 16)``, which returns the bytes that have
arrived so far, not the body.

S3 answers a CompleteMultipartUpload that takes a while with ``200 OK`` at
once and keeps the connection alive with whitespace, the outcome (a
``CompleteMultipartUploadResult``, or an ``<Error>``) coming later in the
same body ("Because a request could fail after the initial 200 OK response
has been sent, it is important that you check the response body", Amazon S3
API reference, CompleteMultipartUpload). Here a loopback S3 (a stateful
fake on a real aiohttp server) answers the first complete that way with an
InternalError after the whitespace, the upload left open as S3 leaves it;
sent again, the complete succeeds. The write must end with the object
written. On integ 44dff3b the first read sees whitespace only: no ``<Error``,
no ETag, so _completed answers "" (complete, no e-tag) and
- with ``check_multipart=False`` the write returns at once: the object was
  never made (nothing under the key, or an older object stays);
- with the HEAD check, an older object of the same size under the key
  passes it (size equal, no e-tag to compare): the write returns, the older
  bytes stay.
A create answered in two pieces (the XML head, then the UploadId) fails the
write with ProtocolError 'HTTP 200 without an UploadId', not retried.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import FakeS3, pattern, s3_stage, within

from aioxfer.errors import XferError

aiohttp = pytest.importorskip("aiohttp")
web = pytest.importorskip("aiohttp.web")

MakeAgent = Callable[..., Awaitable[Any]]
MakeFake = Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[FakeS3]]
MiB = 1 << 20
KEY = "/bkt/pre/k"
CREDS = dict(access_key_id="AKIDREV21", secret_access_key="SECRET-rev21",
             session_token="TOKEN-rev21", region="us-east-1")
HEAD = b'<?xml version="1.0" encoding="UTF-8"?>\n'


class Store:
    """A stateful S3 of one bucket. ``slow`` names the stages whose next
    answer is a 200 sent in two pieces 0.3 s apart (S3's keep-alive shape):
    for complete_mpu the second piece is an InternalError and the upload
    stays open (S3 did not complete it); for create_mpu it is the rest of a
    good answer."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.slow: set[str] = set()
        self.completes = 0
        self._n = 0

    async def _two_pieces(self, req: Any, first: bytes, rest: bytes) -> Any:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/xml"})
        await resp.prepare(req)
        await resp.write(first)
        await asyncio.sleep(0.3)
        await resp.write(rest)
        await resp.write_eof()
        return resp

    async def __call__(self, req: Any) -> Any:
        what = s3_stage(req)
        body = await req.read()
        slow = what in self.slow
        self.slow.discard(what)
        if what == "create_mpu":
            self._n += 1
            uid = f"UP{self._n}"
            self.uploads[uid] = {}
            res = (f"<InitiateMultipartUploadResult><Bucket>bkt</Bucket><Key>pre/k</Key>"
                   f"<UploadId>{uid}</UploadId></InitiateMultipartUploadResult>").encode()
            if slow:
                return await self._two_pieces(req, HEAD + res[:40], res[40:])
            return web.Response(body=HEAD + res, content_type="application/xml")
        if what == "upload_part":
            up = self.uploads.get(req.query["uploadId"])
            if up is None:
                return web.Response(status=404, text="<Error><Code>NoSuchUpload</Code></Error>")
            up[int(req.query["partNumber"])] = body
            return web.Response(headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
        if what == "complete_mpu":
            self.completes += 1
            if slow:  # 200 at once, whitespace, then the failure: not completed
                return await self._two_pieces(
                    req, HEAD + b" " * 16,
                    b"<Error><Code>InternalError</Code><Message>We encountered an internal "
                    b"error. Please try again.</Message></Error>")
            parts = self.uploads.pop(req.query["uploadId"], None)
            if parts is None:
                return web.Response(status=404, text="<Error><Code>NoSuchUpload</Code></Error>")
            data = b"".join(parts[i] for i in sorted(parts))
            self.objects[req.path] = data
            return web.Response(content_type="application/xml", text=(
                "<CompleteMultipartUploadResult><ETag>&quot;"
                f"{hashlib.md5(data).hexdigest()}-{len(parts)}&quot;</ETag>"
                "</CompleteMultipartUploadResult>"))
        if what == "abort":
            self.uploads.pop(req.query["uploadId"], None)
            return web.Response(status=204)
        if what == "head":
            found = self.objects.get(req.path)
            if found is None:
                return web.Response(status=404)
            return web.Response(headers={"Content-Length": str(len(found))})
        return web.Response(status=400)


async def _setup(make_agent: MakeAgent, fake_s3: MakeFake, **kw: Any
                 ) -> tuple[Store, FakeS3, Any, Any]:
    store = Store()
    srv = await fake_s3(store)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, **CREDS,
                                  part_size=5 * MiB, max_retries=2, retry_timeout=5.0, **kw)
    return store, srv, agent, objs


@pytest.mark.parametrize("older", [False, True])
async def test_complete_error_after_whitespace_unchecked(
        make_agent: MakeAgent, fake_s3: MakeFake, older: bool) -> None:
    store, srv, agent, objs = await _setup(make_agent, fake_s3, check_multipart=False)
    if older:
        store.objects[KEY] = b"older" * 1000
    store.slow.add("complete_mpu")
    src = agent.register(bytearray(pattern(11 * MiB, 21).tobytes()))
    try:
        await within(agent.write(src[:], objs["k"]), 30)
    except XferError:
        pass  # failing is an honest answer; returning with the object unwritten is not
    else:
        assert store.objects.get(KEY) == bytes(src.obj), (
            f"write returned, the store holds {len(store.objects.get(KEY, b''))} bytes "
            f"under the key after {store.completes} complete(s)")


async def test_complete_error_after_whitespace_older_same_size(
        make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    store, srv, agent, objs = await _setup(make_agent, fake_s3)
    size = 11 * MiB
    store.objects[KEY] = bytes(size)  # an older object of the same size
    store.slow.add("complete_mpu")
    src = agent.register(bytearray(pattern(size, 22).tobytes()))
    try:
        await within(agent.write(src[:], objs["k"]), 30)
    except XferError:
        pass
    else:
        assert store.objects[KEY] == bytes(src.obj), (
            f"write returned, the older object stays ({store.completes} complete(s) sent)")


async def test_create_answer_in_two_pieces(make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    store, srv, agent, objs = await _setup(make_agent, fake_s3)
    store.slow.add("create_mpu")
    src = agent.register(bytearray(pattern(11 * MiB, 23).tobytes()))
    await within(agent.write(src[:], objs["k"]), 30)
    assert store.objects[KEY] == bytes(src.obj)


async def test_whole_answers_write(make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    # The control: the same store answering in one piece is written to, with
    # and without the HEAD check (the harness is not what fails above).
    for check in (True, False):
        store, srv, agent, objs = await _setup(make_agent, fake_s3, check_multipart=check)
        src = agent.register(bytearray(pattern(11 * MiB, 24).tobytes()))
        await within(agent.write(src[:], objs["k"]), 30)
        assert store.objects[KEY] == bytes(src.obj)
        assert store.completes == 1

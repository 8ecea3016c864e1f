"""Object backend: a multipart write is reported done only once the store
holds the object.

obstore followed a redirect of a multipart upload's complete request (to
another host too) and took that host's answer: the write "succeeded" while
the store never completed the upload. The backend ends a multipart write
with a HEAD of the key (presigned, no redirect): the object must be there
with the written size and, where the e-tags compare, the complete's e-tag.
Since obj20 the backend signs and sends the upload's requests itself, with
static credentials, and follows no redirect (tests/test_obj18b_redirects.py):
the redirected complete fails the write, the other host sees nothing.

The store here is a small stateful S3 on loopback (conftest's fake_s3): it
keeps uploads, parts and objects, answers HEADs and GETs from them, and can
redirect the complete (to a willing S3, conftest's s3_answer, that stores
nothing) or refuse HEADs. The e-tags are S3's: the MD5 of a single PUT's
bytes, the MD5 of the parts' MD5s with "-<parts>" for a multipart object.
"""

from __future__ import annotations

import email.utils
import hashlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import FakeS3, s3_answer, s3_stage, within

from aioxfer.errors import XferError

pytest.importorskip("obstore")
web = pytest.importorskip("aiohttp.web")

MakeAgent = Callable[..., Awaitable[Any]]
MakeFake = Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[FakeS3]]
MiB = 1 << 20
CREDS = dict(access_key_id="AKIDOBJ19EXAMPLE", secret_access_key="SECRETKEY-obj19",
             session_token="SESSION-TOKEN-obj19", region="us-east-1")


class Store:
    """A stateful S3 of one bucket: ``redirect`` (a set of s3_stage names)
    sends those requests to ``elsewhere`` (307, path and query kept);
    ``refuse_head`` answers HEADs 403."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}  # path -> (bytes, e-tag)
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.redirect: set[str] = set()
        self.elsewhere = 0  # port
        self.refuse_head = False
        self._ids = itertools.count(1)

    async def __call__(self, req: Any) -> Any:
        what = s3_stage(req)
        body = await req.read()
        if what in self.redirect:
            raise web.HTTPTemporaryRedirect(
                location=f"http://localhost:{self.elsewhere}{req.path_qs}")
        path = req.path
        if what == "create_mpu":
            uid = f"UP{next(self._ids)}"
            self.uploads[uid] = {}
            return web.Response(content_type="application/xml", text=(
                '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
                f"<Bucket>bkt</Bucket><Key>{path}</Key><UploadId>{uid}</UploadId>"
                "</InitiateMultipartUploadResult>"))
        if what == "upload_part":
            self.uploads[req.query["uploadId"]][int(req.query["partNumber"])] = body
            return web.Response(headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
        if what == "complete_mpu":
            parts = self.uploads.pop(req.query["uploadId"])
            data = b"".join(parts[i] for i in sorted(parts))
            md5s = b"".join(hashlib.md5(parts[i]).digest() for i in sorted(parts))
            e_tag = f'"{hashlib.md5(md5s).hexdigest()}-{len(parts)}"'
            self.objects[path] = (data, e_tag)
            return web.Response(content_type="application/xml", text=(
                '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult>'
                f"<Bucket>bkt</Bucket><Key>{path}</Key><ETag>{e_tag}</ETag>"
                "</CompleteMultipartUploadResult>"))
        if what == "abort":
            self.uploads.pop(req.query["uploadId"], None)
            return web.Response(status=204)
        if what == "put":
            e_tag = f'"{hashlib.md5(body).hexdigest()}"'
            self.objects[path] = (body, e_tag)
            return web.Response(headers={"ETag": e_tag})
        if what == "delete":
            self.objects.pop(path, None)
            return web.Response(status=204)
        found = self.objects.get(path)
        meta = {"Last-Modified": email.utils.formatdate(usegmt=True)}
        if what == "head":
            if self.refuse_head:
                return web.Response(status=403)
            if found is None:
                return web.Response(status=404)
            return web.Response(headers={**meta, "Content-Length": str(len(found[0])),
                                         "ETag": found[1]})
        if what == "get":
            if found is None:
                return web.Response(status=404, text="<Error><Code>NoSuchKey</Code></Error>")
            return web.Response(body=found[0], headers={**meta, "ETag": found[1]})
        return web.Response(status=400)


async def store_pair(fake_s3: MakeFake) -> tuple[Store, FakeS3, FakeS3]:
    """(the store, its server, a willing S3 elsewhere that stores nothing)."""
    other = await fake_s3(s3_answer)
    store = Store()
    store.elsewhere = other.port
    return store, await fake_s3(store), other


def register(agent: Any, endpoint: str) -> Any:
    return agent.register_objects("s3://bkt/pre", endpoint=endpoint, **CREDS,
                                  part_size=5 * MiB, max_retries=1, retry_timeout=3.0)


async def test_redirected_complete_is_not_a_written_object(make_agent: MakeAgent,
                                                           fake_s3: MakeFake) -> None:
    store, srv, other = await store_pair(fake_s3)
    store.redirect = {"complete_mpu"}
    agent = await make_agent("o")
    objs = register(agent, srv.endpoint)
    src = agent.alloc(11 * MiB)
    src.numpy()[:] = 3
    # the backend signs and sends the complete itself since obj20: the
    # redirect is not followed (the other host sees nothing), the write fails
    with pytest.raises(XferError, match="redirect"):
        await within(agent.write(src[:], objs["k"]), 20)
    assert other.seen == []
    assert store.objects == {}
    assert not (await objs.stat("k")).exists


@pytest.mark.parametrize("older", ["smaller", "same_size"])
async def test_redirected_complete_over_an_older_object(make_agent: MakeAgent,
                                                        fake_s3: MakeFake, older: str) -> None:
    # The key already holds an object: the HEAD finds one, but not the one
    # written (another size; or the same size and another multipart e-tag).
    store, srv, other = await store_pair(fake_s3)
    agent = await make_agent("o")
    objs = register(agent, srv.endpoint)
    src = agent.alloc(11 * MiB)
    if older == "smaller":
        await within(agent.write(src[0:4096], objs["k"]), 20)
    else:
        await within(agent.write(src[:], objs["k"]), 20)  # honest: checked, fine
    before = store.objects["/bkt/pre/k"][1]
    src.numpy()[:] = 5
    store.redirect = {"complete_mpu"}
    with pytest.raises(XferError, match="redirect"):
        await within(agent.write(src[:], objs["k"]), 20)
    assert other.seen == []
    assert store.objects["/bkt/pre/k"][1] == before  # the older object stays


async def test_multipart_write_costs_one_head(make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    store, srv, other = await store_pair(fake_s3)
    agent = await make_agent("o")
    objs = register(agent, srv.endpoint)
    src = agent.alloc(11 * MiB)
    src.numpy()[:] = 7
    await within(agent.write(src[:], objs["k"]), 20)
    stages = [s[0] for s in srv.seen]
    assert stages.count("head") == 1 and stages[-2:] == ["complete_mpu", "head"], stages
    assert store.objects["/bkt/pre/k"][0] == bytes(src.memoryview)
    # a single PUT (up to part_size) is not checked: no HEAD
    await within(agent.write(src[0:MiB], objs["small"]), 20)
    assert [s[0] for s in srv.seen].count("head") == 1
    assert not other.seen


async def test_write_only_credentials_still_write(make_agent: MakeAgent,
                                                  fake_s3: MakeFake) -> None:
    # Credentials allowed to write but not to read: the check cannot be
    # made (403) and the write counts as done, as before the check.
    store, srv, other = await store_pair(fake_s3)
    store.refuse_head = True
    agent = await make_agent("o")
    objs = register(agent, srv.endpoint)
    src = agent.alloc(11 * MiB)
    await within(agent.write(src[:], objs["k"]), 20)
    assert len(store.objects["/bkt/pre/k"][0]) == 11 * MiB


async def test_many_keys_signed_at_once_keep_the_403_rule(make_agent: MakeAgent,
                                                          fake_s3: MakeFake) -> None:
    # stat and delete of many keys (a request a key, through the shared
    # signed-request loop): a 403 to a URL just signed is final (one request
    # a key), one to a URL reused from the cache signs again once (two).
    from aioxfer.errors import AccessDenied

    refuse = [True]

    async def handle(req: Any) -> Any:
        await req.read()
        if refuse[0]:
            return web.Response(status=403, text="<Error><Code>AccessDenied</Code></Error>")
        return await s3_answer(req)

    srv = await fake_s3(handle)
    agent = await make_agent("o")
    objs = register(agent, srv.endpoint)
    keys = ["a", "b", "c"]
    for call, method in ((objs.stat, "HEAD"), (objs.delete, "DELETE")):
        refuse[0] = True
        with pytest.raises(AccessDenied):
            await within(call(keys), 10)
        assert [srv.hits[(method, k)] for k in keys] == [1, 1, 1]
        with pytest.raises(AccessDenied):  # the URLs are cached now
            await within(call(keys), 10)
        assert [srv.hits[(method, k)] for k in keys] == [3, 3, 3]
        refuse[0] = False  # and a cached URL that works is used as is
        await within(call(keys), 10)
        assert [srv.hits[(method, k)] for k in keys] == [4, 4, 4]


async def test_stat_of_many_keys_reports_once_every_head_ended(make_agent: MakeAgent,
                                                                fake_s3: MakeFake) -> None:
    # One key refused at once, another answered late: stat raises the
    # refusal only once the late HEAD is over (it used to raise at once and
    # leave that request running after the caller had its answer, as
    # delete did before 02c49c0).
    import asyncio

    from aioxfer.errors import AccessDenied

    ended: list[str] = []

    async def handle(req: Any) -> Any:
        key = req.path.rsplit("/", 1)[-1]
        if key == "slow":
            await asyncio.sleep(0.5)
            ended.append(key)
            return await s3_answer(req)
        return web.Response(status=403)

    srv = await fake_s3(handle)
    agent = await make_agent("o")
    objs = register(agent, srv.endpoint)
    with pytest.raises(AccessDenied):
        await within(objs.stat(["denied", "slow"]), 10)
    assert ended == ["slow"]

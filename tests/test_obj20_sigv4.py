"""aioxfer.backends.sigv4 (AWS Signature Version 4) and the object backend's
own signed multipart upload.

The signer is checked three ways: against AWS's published vectors (written
out below with their sources), against obstore's own presigned URLs (same
time, same credentials: the same signature, for keys that need encoding),
and against a server that verifies signatures (rclone serve s3 with
--auth-key: a wrong secret, or a signed header changed after signing, is
refused). The multipart upload built on it is then run against rclone (a
session token included) and against a stateful fake S3 that injects the
faults the upload must ride out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import s3server
import yarl
from conftest import FakeS3, pattern, s3_stage, within
from s3server import ACCESS_KEY, SECRET_KEY, S3Server

from aioxfer.backends import sigv4
from aioxfer.errors import AccessDenied, XferError

obstore = pytest.importorskip("obstore")
aiohttp = pytest.importorskip("aiohttp")
web = pytest.importorskip("aiohttp.web")

s3 = s3server.s3  # the fixture, by name
MakeAgent = Callable[..., Awaitable[Any]]
MakeFake = Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[FakeS3]]
MiB = 1 << 20

# --- AWS's published vectors ----------------------------------------------
# The aws-sig-v4-test-suite (AWS General Reference, "Signature Version 4 Test
# Suite"; a copy in github.com/bazelbuild/bazel third_party/aws-sig-v4-test-suite):
# service "service", region us-east-1, 2015-08-30T12:36:00Z, the suite's key.
SUITE_KEY = sigv4.Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
SUITE_TIME = datetime(2015, 8, 30, 12, 36, tzinfo=UTC)
SUITE_TOKEN = (  # post-sts-token/readme.txt
    "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmx"
    "fpSPfIeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0"
    "KPkyQDYwT7WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZ"
    "bqBAz+scqKmlzm8FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/oLxBA=="
)
SUITE = [
    # (case, method, url, token, signed headers, signature from its .authz)
    ("get-vanilla", "GET", "https://example.amazonaws.com/", None, "host;x-amz-date",
     "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"),
    ("get-vanilla-query-order-key-case", "GET",
     "https://example.amazonaws.com/?Param2=value2&Param1=value1", None, "host;x-amz-date",
     "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"),
    ("get-utf8", "GET", "https://example.amazonaws.com/%E1%88%B4", None, "host;x-amz-date",
     "8318018e0b0f223aa2bbf98705b62bb787dc9c0e678f255a891fd03141be5d85"),
    ("post-vanilla", "POST", "https://example.amazonaws.com/", None, "host;x-amz-date",
     "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"),
    ("post-sts-header-before", "POST", "https://example.amazonaws.com/", SUITE_TOKEN,
     "host;x-amz-date;x-amz-security-token",
     "85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead"),
]

# Amazon S3 API reference, "Authenticating Requests (AWS Signature Version
# 4)": "Example: GET Object" (header signing) and "Authenticating Requests:
# Using Query Parameters" (a presigned URL), 2013-05-24T00:00:00Z.
S3_DOC_KEY = sigv4.Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
S3_DOC_TIME = datetime(2013, 5, 24, tzinfo=UTC)


@pytest.mark.parametrize(("case", "method", "url", "token", "signed", "sig"), SUITE,
                         ids=[c[0] for c in SUITE])
def test_aws_test_suite(case: str, method: str, url: str, token: str | None, signed: str,
                        sig: str) -> None:
    creds = sigv4.Credentials(SUITE_KEY.access_key_id, SUITE_KEY.secret_access_key, token)
    headers = sigv4.sign_headers(method, url, creds, "us-east-1", service="service",
                                 now=SUITE_TIME, content_sha256=False)
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
        f"SignedHeaders={signed}, Signature={sig}")
    assert headers["X-Amz-Date"] == "20150830T123600Z"
    assert headers["Host"] == "example.amazonaws.com"


def test_s3_doc_get_object_header_signing() -> None:
    headers = sigv4.sign_headers(
        "GET", "https://examplebucket.s3.amazonaws.com/test.txt", S3_DOC_KEY, "us-east-1",
        headers={"Range": "bytes=0-9"}, now=S3_DOC_TIME)
    assert headers["X-Amz-Content-Sha256"] == sigv4.EMPTY_SHA256
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_s3_doc_presigned_url() -> None:
    url = sigv4.presign("GET", "https://examplebucket.s3.amazonaws.com/test.txt", S3_DOC_KEY,
                        "us-east-1", 86400, now=S3_DOC_TIME)
    assert url == (
        "https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host"
        "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")


KEYS = ["k", "dir/sub/obj.bin", "with space/a+b=c&d", "ünï/ß€", "odd~_-.(x)!*'", "pct%41"]


@pytest.mark.parametrize("token", [None, "TOKEN/with+odd=chars"])
@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", None])
def test_same_signature_as_obstore(token: str | None, endpoint: str | None) -> None:
    # obstore (object_store) presigns a GET; ours, of the same URL at the
    # same time with the same credentials, must carry the same signature:
    # the canonical request (path encoding of awkward keys, the token signed
    # in the query) is obstore's.
    from obstore.store import S3Store

    cfg: dict[str, Any] = {"access_key_id": "AKIDOBJ20", "secret_access_key": "s3cr3t/obj20",
                           "region": "eu-west-3"}
    if token:
        cfg["session_token"] = token
    if endpoint:
        cfg["endpoint"] = endpoint
    store = S3Store("bkt", prefix="pre/fix", client_options={"allow_http": True}, **cfg)
    creds = sigv4.Credentials("AKIDOBJ20", "s3cr3t/obj20", token)
    for key in KEYS:
        theirs = obstore.sign(store, "GET", key, timedelta(seconds=900))
        parts = urlsplit(theirs)
        q = dict(parse_qsl(parts.query))
        when = datetime.strptime(q["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        ours = sigv4.presign("GET", f"{parts.scheme}://{parts.netloc}{parts.path}", creds,
                             "eu-west-3", 900, now=when)
        assert dict(parse_qsl(urlsplit(ours).query)) == q, (key, theirs, ours)


# --- a server that checks signatures: rclone serve s3 --auth-key ------------

async def _send(url: str, method: str, headers: dict[str, str]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.request(
            method, yarl.URL(url, encoded=True), headers=headers,
            allow_redirects=False) as resp:
        return resp.status, await resp.text()


async def test_rclone_checks_our_signatures(s3: S3Server) -> None:
    bucket = s3.bucket("d")
    url = f"{s3.endpoint}/{bucket}/d/k?uploads"
    good = sigv4.Credentials(ACCESS_KEY, SECRET_KEY, "SESSION-TOKEN-obj20")
    status, text = await within(_send(url, "POST", sigv4.sign_headers(
        "POST", url, good, "us-east-1")))
    assert status == 200 and "<UploadId>" in text, (status, text)
    # a wrong secret, a signed header (the token) changed after signing, a
    # signature over another query: refused
    bad = sigv4.Credentials(ACCESS_KEY, SECRET_KEY + "x", "SESSION-TOKEN-obj20")
    status, text = await within(_send(url, "POST", sigv4.sign_headers(
        "POST", url, bad, "us-east-1")))
    assert status == 403, (status, text)
    tampered = sigv4.sign_headers("POST", url, good, "us-east-1")
    tampered["X-Amz-Security-Token"] = "ANOTHER-TOKEN"
    status, text = await within(_send(url, "POST", tampered))
    assert status == 403, (status, text)
    other = sigv4.sign_headers("POST", f"{s3.endpoint}/{bucket}/d/other?uploads", good,
                               "us-east-1")
    status, text = await within(_send(url, "POST", other))
    assert status == 403, (status, text)
    # and a presigned GET of ours is taken, a tampered one not
    put = sigv4.sign_headers("PUT", f"{s3.endpoint}/{bucket}/d/g", good, "us-east-1",
                             payload_hash=sigv4.UNSIGNED_PAYLOAD)
    async with aiohttp.ClientSession() as session:
        async with session.put(f"{s3.endpoint}/{bucket}/d/g", data=b"hello",
                               headers=put) as resp:
            assert resp.status == 200, await resp.text()
        signed = sigv4.presign("GET", f"{s3.endpoint}/{bucket}/d/g", good, "us-east-1", 60)
        async with session.get(yarl.URL(signed, encoded=True)) as resp:
            assert (resp.status, await resp.read()) == (200, b"hello")
        forged = signed.replace("X-Amz-Expires=60", "X-Amz-Expires=61")
        async with session.get(yarl.URL(forged, encoded=True)) as resp:
            assert resp.status == 403


@pytest.mark.parametrize("token", [None, "SESSION-TOKEN-obj20"])
@pytest.mark.parametrize("size", [6 * MiB + 5, 21 * MiB + 1])
async def test_multipart_write_to_rclone(make_agent: MakeAgent, s3: S3Server,
                                         token: str | None, size: int) -> None:
    bucket = s3.bucket("pre/dir")
    agent = await make_agent("o")
    kw = {**s3.kwargs(), "part_size": 5 * MiB}
    if token:
        kw["session_token"] = token
    objs = agent.register_objects(f"s3://{bucket}/pre", **kw)
    data = pattern(size, 20)
    src = agent.register(bytearray(data.tobytes()))
    await within(agent.write(src[:], objs["dir/a b+c.bin"]), 60)
    assert s3.file(bucket, "pre/dir/a b+c.bin").read_bytes() == data.tobytes()
    st = await within(objs.stat("dir/a b+c.bin"))
    assert st.size == size


async def test_multipart_wrong_secret_is_access_denied(make_agent: MakeAgent,
                                                       s3: S3Server) -> None:
    bucket = s3.bucket("pre")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/pre", **{
        **s3.kwargs(), "secret_access_key": "wrong", "part_size": 5 * MiB})
    src = agent.alloc(6 * MiB)
    with pytest.raises(AccessDenied, match="create"):
        await within(agent.write(src[:], objs["k"]), 30)


# --- faults the upload rides out (a stateful fake S3) -----------------------

class Store:
    """A stateful S3 of one bucket: uploads, parts, objects; ``faults``
    maps a stage (conftest.s3_stage) to the answers to give (one per
    request, in turn) before answering as S3 would."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.faults: dict[str, list[str]] = {}
        self.aborted: list[str] = []
        self._n = 0

    async def __call__(self, req: Any) -> Any:
        what = s3_stage(req)
        body = await req.read()
        fault = self.faults.get(what, [])
        do = fault.pop(0) if fault else ""
        if do == "503":
            return web.Response(status=503, text="<Error><Code>SlowDown</Code></Error>")
        if do == "400":
            return web.Response(status=400, text="<Error><Code>InvalidPart</Code></Error>")
        if what == "create_mpu":
            self._n += 1
            uid = f"UP{self._n}&x"  # an id that must be encoded in a query
            self.uploads[uid] = {}
            return web.Response(content_type="application/xml", text=(
                "<InitiateMultipartUploadResult><UploadId>"
                f"{uid.replace('&', '&amp;')}</UploadId></InitiateMultipartUploadResult>"))
        if what == "upload_part":
            up = self.uploads.get(req.query["uploadId"])
            if up is None:
                return web.Response(status=404, text="<Error><Code>NoSuchUpload</Code></Error>")
            up[int(req.query["partNumber"])] = body
            return web.Response(headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
        if what == "complete_mpu":
            if do == "error-in-200":
                return web.Response(status=200, text=(
                    "<Error><Code>InternalError</Code></Error>"))
            parts = self.uploads.pop(req.query["uploadId"], None)
            if do == "lose-500":  # the store lost the upload, and says 500
                return web.Response(status=500, text="<Error><Code>InternalError</Code></Error>")
            if parts is None:
                return web.Response(status=404, text="<Error><Code>NoSuchUpload</Code></Error>")
            self.objects[req.path] = b"".join(parts[i] for i in sorted(parts))
            if do == "500-after":  # completed, and the answer says otherwise
                return web.Response(status=500, text="<Error><Code>InternalError</Code></Error>")
            return web.Response(content_type="application/xml", text=(
                "<CompleteMultipartUploadResult><ETag>&quot;e-2&quot;</ETag>"
                "</CompleteMultipartUploadResult>"))
        if what == "abort":
            self.aborted.append(req.query["uploadId"])
            self.uploads.pop(req.query["uploadId"], None)
            return web.Response(status=204)
        if what == "head":
            found = self.objects.get(req.path)
            if found is None:
                return web.Response(status=404)
            return web.Response(headers={"Content-Length": str(len(found))})
        return web.Response(status=400)


CREDS = dict(access_key_id="AKIDOBJ20", secret_access_key="SECRET-obj20",
             session_token="TOKEN-obj20", region="us-east-1")


async def _store(make_agent: MakeAgent, fake_s3: MakeFake, **kw: Any
                 ) -> tuple[Store, FakeS3, Any, Any]:
    store = Store()
    srv = await fake_s3(store)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, **CREDS,
                                  part_size=5 * MiB, max_retries=2, retry_timeout=5.0, **kw)
    return store, srv, agent, objs


@pytest.mark.parametrize("fault", ["upload_part:503", "create_mpu:503", "complete_mpu:503",
                                   "complete_mpu:error-in-200", "complete_mpu:500-after"])
async def test_multipart_rides_out(make_agent: MakeAgent, fake_s3: MakeFake, fault: str) -> None:
    # complete_mpu:500-after: the store completed the upload and answered
    # 500; the complete sent again finds no such upload, and the HEAD that
    # ends every multipart write finds the object with its size: written.
    store, srv, agent, objs = await _store(make_agent, fake_s3)
    stage, do = fault.split(":")
    store.faults[stage] = [do]
    src = agent.register(bytearray(pattern(11 * MiB, 3).tobytes()))
    await within(agent.write(src[:], objs["k"]), 30)
    assert store.objects["/bkt/pre/k"] == bytes(src.obj)
    seen = [s[0] for s in srv.seen]
    # sent again once: the stage's request (3 parts: 4 part requests)
    assert seen.count(stage) == (4 if stage == "upload_part" else 2), seen
    assert not store.aborted and not store.uploads
    # every request carried the session token, signed
    for what, _, headers in srv.seen:
        low = {k.lower(): v for k, v in headers.items()}
        if what != "head":
            assert low["x-amz-security-token"] == "TOKEN-obj20"
            assert "x-amz-security-token" in low["authorization"]


async def test_failed_part_aborts_the_upload(make_agent: MakeAgent, fake_s3: MakeFake) -> None:
    store, srv, agent, objs = await _store(make_agent, fake_s3)
    store.faults["upload_part"] = ["", "400"]  # the second part: refused
    src = agent.alloc(16 * MiB)
    with pytest.raises(XferError, match=r"part \d of 4\).*InvalidPart"):
        await within(agent.write(src[:], objs["k"]), 30)
    assert store.aborted == ["UP1&x"] and not store.uploads and not store.objects
    # parts not yet begun when one failed are not sent
    assert [s[0] for s in srv.seen].count("upload_part") <= 4


@pytest.mark.parametrize("older", [None, 4096])
async def test_lost_complete_is_not_a_written_object(make_agent: MakeAgent, fake_s3: MakeFake,
                                                     older: int | None) -> None:
    # The complete is answered 500 and the upload is gone: sent again, the
    # complete finds no such upload (as after a first attempt that did
    # complete it), and the HEAD that ends the write finds no object, or an
    # older one of another size: the write fails, naming which.
    store, srv, agent, objs = await _store(make_agent, fake_s3)
    if older:
        store.objects["/bkt/pre/k"] = bytes(older)
    store.faults["complete_mpu"] = ["lose-500"]
    src = agent.alloc(11 * MiB)
    match = "no such object" if older is None else f"holds {older} bytes"
    with pytest.raises(XferError, match=match):
        await within(agent.write(src[:], objs["k"]), 30)
    assert [s[0] for s in srv.seen][-3:] == ["complete_mpu", "complete_mpu", "head"]


async def test_check_multipart_false_skips_the_head(make_agent: MakeAgent,
                                                    fake_s3: MakeFake) -> None:
    # check_multipart=False: no HEAD after a complete the store answered;
    # one still after a complete whose outcome is not known (sent again, it
    # found no such upload: the first had completed it).
    store, srv, agent, objs = await _store(make_agent, fake_s3, check_multipart=False)
    src = agent.register(bytearray(pattern(11 * MiB, 4).tobytes()))
    await within(agent.write(src[:], objs["k"]), 30)
    assert store.objects["/bkt/pre/k"] == bytes(src.obj)
    assert "head" not in [s[0] for s in srv.seen]
    store.faults["complete_mpu"] = ["500-after"]
    await within(agent.write(src[:], objs["k2"]), 30)
    assert [s[0] for s in srv.seen][-3:] == ["complete_mpu", "complete_mpu", "head"]

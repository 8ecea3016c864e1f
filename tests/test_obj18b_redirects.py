"""Object backend: no request of ours follows a redirect to another host.

obstore (object_store / reqwest) follows a 307 for its own requests, and on
a redirect to another host reqwest drops only the Authorization header: the
session token (``x-amz-security-token``) goes along, and whatever the other
host answers counts (a fake HEAD says the key exists, a fake DeleteResult
says the keys are gone). Here an aiohttp server on loopback redirects (307,
to a second one, path and query kept) the requests of one stage of each
object operation the backend (and the KV object tier, which calls the same
ones: stat, delete, reads of segments, writes) performs; the second one
answers every request as a willing S3 would. Each operation must fail with
a typed XferError, and the second server must see no request at all (so
none with the token, a signature or an Authorization header).
"""

from __future__ import annotations

import email.utils
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from conftest import within

from aioxfer.errors import XferError

pytest.importorskip("obstore")
web = pytest.importorskip("aiohttp.web")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20
TOKEN = "SESSION-TOKEN-SECRET-obj18b"
CREDS = dict(access_key_id="AKIDOBJ18BEXAMPLE", secret_access_key="SECRETKEY-obj18b",
             session_token=TOKEN, region="us-east-1")
_NOW = email.utils.formatdate(usegmt=True)


def stage(req: Any) -> str:
    """Which request of an operation ``req`` is."""
    q = req.query
    if req.method == "HEAD":
        return "head"
    if req.method == "GET":
        return "get"
    if req.method == "POST" and "delete" in q:
        return "bulk_delete"
    if req.method == "DELETE" and "uploadId" in q:
        return "abort"
    if req.method == "DELETE":
        return "delete"
    if req.method == "POST" and "uploads" in q:
        return "create_mpu"
    if req.method == "PUT" and "partNumber" in q:
        return "upload_part"
    if req.method == "POST" and "uploadId" in q:
        return "complete_mpu"
    if req.method == "PUT":
        return "put"
    return f"other {req.method}"


async def s3_answer(req: Any, size: int = 4096) -> Any:
    """What a willing S3 server answers (no checks of any signature)."""
    await req.read()
    what = stage(req)
    meta = {"ETag": '"0123456789abcdef0123456789abcdef"', "Last-Modified": _NOW}
    if what == "head":
        return web.Response(headers={**meta, "Content-Length": str(size)})
    if what == "get":
        rng = req.headers.get("Range")
        if rng:
            a, b = (int(x) for x in rng.split("=")[1].split("-"))
            return web.Response(status=206, body=bytes(b - a + 1), headers={
                **meta, "Content-Range": f"bytes {a}-{b}/{size}"})
        return web.Response(body=bytes(size), headers=meta)
    if what == "bulk_delete":
        return web.Response(content_type="application/xml", text=(
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"></DeleteResult>'))
    if what == "create_mpu":
        return web.Response(content_type="application/xml", text=(
            '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
            "<Bucket>bkt</Bucket><Key>pre/k</Key><UploadId>UP1</UploadId>"
            "</InitiateMultipartUploadResult>"))
    if what == "complete_mpu":
        return web.Response(content_type="application/xml", text=(
            '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult>'
            '<Bucket>bkt</Bucket><Key>pre/k</Key><ETag>"e-2"</ETag>'
            "</CompleteMultipartUploadResult>"))
    if what in ("delete", "abort"):
        return web.Response(status=204)
    return web.Response(headers=meta)  # put, upload_part


class Server:
    def __init__(self, handler: Callable[[Any], Awaitable[Any]]) -> None:
        self.handler = handler
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.runner: Any = None
        self.port = 0

    async def _handle(self, req: Any) -> Any:
        self.seen.append((stage(req), req.path_qs, dict(req.headers)))
        return await self.handler(req)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * MiB)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def pair() -> AsyncIterator[Callable[[set[str]], Awaitable[tuple[Server, Server]]]]:
    """``await pair(stages)``: (first, other); the first redirects the
    requests of ``stages`` to ``other`` and answers the rest itself."""
    made: list[Server] = []

    async def make(redirected: set[str]) -> tuple[Server, Server]:
        other = Server(s3_answer)
        await other.start()

        async def first(req: Any) -> Any:
            if stage(req) in redirected:
                await req.read()
                # "localhost": another host name than the endpoint's
                # 127.0.0.1, as a redirect to another host would be.
                raise web.HTTPTemporaryRedirect(
                    location=f"http://localhost:{other.port}{req.path_qs}")
            return await s3_answer(req)

        srv = Server(first)
        await srv.start()
        made.extend((other, srv))
        return srv, other

    yield make
    for s in made:
        await s.runner.cleanup()


def leaked(other: Server) -> list[str]:
    """The requests ``other`` saw, each with what it carried of the credentials."""
    out = []
    for what, path_qs, headers in other.seen:
        low = {k.lower(): v for k, v in headers.items()}
        carried = [h for h in ("authorization", "x-amz-security-token") if h in low]
        carried += [p for p in ("X-Amz-Signature", "X-Amz-Security-Token") if p in path_qs]
        out.append(f"{what} {path_qs[:60]} carrying {carried}")
    return out


async def _stat(agent: Any, objs: Any) -> Any:
    return await objs.stat("k")


async def _stat_many(agent: Any, objs: Any) -> Any:
    return await objs.stat(["k", "k2"])


async def _delete(agent: Any, objs: Any) -> Any:
    return await objs.delete("k")


async def _delete_many(agent: Any, objs: Any) -> Any:
    return await objs.delete(["k", "k2", "k3"])


async def _write_small(agent: Any, objs: Any) -> Any:
    src = agent.alloc(4096)
    return await agent.write(src[0:4096], objs["k"])


async def _create_small(agent: Any, objs: Any) -> Any:
    src = agent.alloc(4096)
    return await agent.write(src[0:4096], objs.create("k"))


async def _write_multipart(agent: Any, objs: Any) -> Any:
    # 6 MiB with part_size 5 MiB: owned (<= 8 MiB) and multipart, two parts
    src = agent.alloc(6 * MiB)
    return await agent.write(src[0:6 * MiB], objs["k"])


async def _write_multipart_big(agent: Any, objs: Any) -> Any:
    src = agent.alloc(11 * MiB)  # from the caller's buffer (> OWNED_MAX)
    return await agent.write(src[0:11 * MiB], objs["k"])


async def _read(agent: Any, objs: Any) -> Any:
    dst = agent.alloc(4096)
    return await agent.read(dst[0:4096], objs["k"])


async def _read_range(agent: Any, objs: Any) -> Any:
    dst = agent.alloc(100)
    return await agent.read(dst[0:100], objs["k"][10:110])


async def _read_many(agent: Any, objs: Any) -> Any:
    dst = agent.alloc(200)
    return await agent.read([dst[0:100], dst[100:200]],
                            objs.segments(["k", "k2"], [0, 5], [100, 100]))


CASES: list[Any] = [
    *(pytest.param(*c, id=c[0]) for c in (
        ("stat", _stat, {"head"}),
        ("stat_many", _stat_many, {"head"}),
        ("delete", _delete, {"delete", "bulk_delete"}),
        ("delete_many", _delete_many, {"delete", "bulk_delete"}),
        ("write_small", _write_small, {"put"}),
        ("create_small", _create_small, {"put"}),
        ("mpu_part", _write_multipart, {"upload_part"}),
        ("read", _read, {"get"}),
        ("read_range", _read_range, {"get"}),
        ("read_many", _read_many, {"get"}),
    )),
    # Left (see objects.py's module docstring): obstore's multipart upload
    # follows a redirect of its create, complete and abort requests, and
    # obstore has no option against it nor a way to presign a URL with a
    # query (?uploads, ?uploadId=). Strict: they pass once that is fixed.
    *(pytest.param(name, op, st, marks=pytest.mark.xfail(
        strict=True, reason="obstore follows redirects of multipart requests"), id=name)
      for name, op, st in (
          ("mpu_create", _write_multipart, {"create_mpu"}),
          ("mpu_complete", _write_multipart, {"complete_mpu"}),
          # a part fails (400, final) and the abort is redirected
          ("mpu_abort", _write_multipart, {"abort"}),
          ("mpu_big_create", _write_multipart_big, {"create_mpu"}),
          ("mpu_big_complete", _write_multipart_big, {"complete_mpu"}),
      )),
]


@pytest.mark.parametrize(("name", "op", "stages"), CASES)
async def test_no_request_follows_a_redirect(make_agent: MakeAgent, pair: Any, name: str,
                                             op: Any, stages: set[str]) -> None:
    srv, other = await pair(stages)
    if name == "mpu_abort":
        base = srv.handler

        async def failing_part(req: Any) -> Any:
            if stage(req) == "upload_part":
                await req.read()
                return web.Response(status=400, text="<Error><Code>InvalidPart</Code></Error>")
            return await base(req)

        srv.handler = failing_part
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/pre", endpoint=srv.endpoint, **CREDS,
                                  part_size=5 * MiB, max_retries=1, retry_timeout=3.0)
    outcome: str
    try:
        got = await within(op(agent, objs), 20)
        outcome = f"succeeded: {got!r}"
    except XferError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seen = [s[0] for s in srv.seen]
    assert not other.seen, (
        f"{name}: the other host got {leaked(other)}; the operation {outcome}; first saw {seen}")
    assert set(seen) & (stages | ({"upload_part"} if name == "mpu_abort" else set())), (
        f"{name}: the redirected stage never ran: {seen}")
    assert not outcome.startswith("succeeded"), f"{name}: {outcome} (first saw {seen})"
    if name != "mpu_abort":  # there the part's failure is the error
        assert "redirect" in outcome.lower(), outcome
    assert TOKEN not in outcome

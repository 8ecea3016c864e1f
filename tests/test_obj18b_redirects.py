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

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import FakeS3, s3_answer, within
from conftest import s3_stage as stage

from aioxfer.errors import XferError

pytest.importorskip("obstore")
web = pytest.importorskip("aiohttp.web")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20
TOKEN = "SESSION-TOKEN-SECRET-obj18b"
CREDS = dict(access_key_id="AKIDOBJ18BEXAMPLE", secret_access_key="SECRETKEY-obj18b",
             session_token=TOKEN, region="us-east-1")


@pytest.fixture
def pair(fake_s3: Callable[..., Awaitable[FakeS3]]
         ) -> Callable[[set[str]], Awaitable[tuple[FakeS3, FakeS3]]]:
    """``await pair(stages)``: (first, other); the first redirects the
    requests of ``stages`` to ``other`` and answers the rest itself."""

    async def make(redirected: set[str]) -> tuple[FakeS3, FakeS3]:
        other = await fake_s3(s3_answer)

        async def first(req: Any) -> Any:
            if stage(req) in redirected:
                await req.read()
                # "localhost": another host name than the endpoint's
                # 127.0.0.1, as a redirect to another host would be.
                raise web.HTTPTemporaryRedirect(
                    location=f"http://localhost:{other.port}{req.path_qs}")
            return await s3_answer(req)

        return await fake_s3(first), other

    return make


def leaked(other: FakeS3) -> list[str]:
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
        # The multipart upload's own requests (signed by the backend since
        # obj20: obstore followed a redirect of each of them).
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

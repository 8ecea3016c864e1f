"""obj28: requests on a kept-alive connection the server closes as they start.

aiohttp 3.14 sends an idempotent request (GET, HEAD, PUT, DELETE) once more
by itself when its connection turns out closed (ClientOSError,
ServerDisconnectedError), on a new one, unless its body payload is
``consumed``. Every request of ours with a body (a single PUT, a multipart
upload's parts and complete) streams it once
(objects._Body): aiohttp honours its ``consumed``, set as its write starts,
and a request's head is buffered until that first write, so a resend is
only ever of a request none of whose bytes left. POSTs (create, complete)
are never sent again by aiohttp. What is resent silently is a request
without a body (GET, HEAD, DELETE: reads, and deletes that S3 makes
idempotent). These tests show it with a server that closes a kept-alive
connection as the next request arrives, at its head or once its body is in:

- a GET is sent again by aiohttp and the read succeeds (harmless);
- a single PUT (ours) is not: its outcome is unknown, the HEAD finds
  nothing, TransportError (sent again by us only with resend_unknown_puts,
  after that HEAD); a conditional create alike;
- a multipart part is sent again by our own retry (a part replaces itself).

Guards: they pass on main too (no silent resend of a body was found). They
can fail: with ``data=bytes(body)`` in ObjectRegion._own_put, the four
single-PUT cases fail ("DID NOT RAISE TransportError": aiohttp sent the PUT
again by itself, a create's body received whole twice, with no HEAD between).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import within
from test_obj28_headers import FakeS3, fake

from aioxfer.errors import TransportError

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

__all__ = ["fake"]  # the fixture, by name

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


def second(where: str, method: str) -> Callable[[int, str], str | None]:
    """Closes a connection at its second request if it is a ``method``:
    the first such request only."""
    done = False

    def close(i: int, m: str) -> str | None:
        nonlocal done
        if done or i != 1 or m != method:
            return None
        done = True
        return where

    return close


async def started(make: Any, close: Callable[[int, str], str | None]) -> FakeS3:
    srv: FakeS3 = await make(lambda m, p, q, b: None)
    srv.close = close
    return srv


def methods(srv: FakeS3) -> list[str]:
    return [m for m, _, _ in srv.requests]


@pytest.mark.parametrize("where", ["head", "body"])
async def test_get_sent_again_by_aiohttp(make_agent: MakeAgent, fake: Any, where: str) -> None:
    srv = await started(fake, second(where, "GET"))

    def answer(m: str, p: str, q: dict[str, str], b: bytes) -> Any:
        return (b"200 OK", [], b"abcd") if m == "GET" else None

    srv.answer = answer
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    assert not (await within(objs.stat("k"))).exists  # the connection kept alive
    dst = agent.alloc(4)
    await within(agent.read(dst[0:4], objs["k"]))
    assert bytes(dst.numpy()) == b"abcd"
    # one GET closed on the kept-alive connection, sent again on a new one
    assert methods(srv) == ["HEAD", f"GET (closed: {where})", "GET"]
    assert objs.backend.statistics().retries == 0  # not ours: aiohttp's


@pytest.mark.parametrize("where", ["head", "body"])
@pytest.mark.parametrize("create", [False, True], ids=["put", "create"])
async def test_single_put_not_sent_again(make_agent: MakeAgent, fake: Any, where: str,
                                         create: bool) -> None:
    srv = await started(fake, second(where, "PUT"))
    agent = await make_agent("o")
    # part_md5: ours whatever the size
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_md5=True)
    assert not (await within(objs.stat("k"))).exists
    n = 1 if create else 64 << 10
    src = agent.alloc(n)
    seg = objs.create("k") if create else objs["k"]
    with pytest.raises(TransportError, match="outcome is unknown"):
        await within(agent.write(src[0:n], seg))
    # the PUT went once (aiohttp did not send it again); the HEAD said
    # it is not there; not sent again while it may still run there
    assert methods(srv) == ["HEAD", f"PUT (closed: {where})", "HEAD"]


async def test_single_put_sent_again_only_when_asked(make_agent: MakeAgent,
                                                     fake: Any) -> None:
    srv = await started(fake, second("body", "PUT"))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_md5=True,
                                  resend_unknown_puts=True)
    assert not (await within(objs.stat("k"))).exists
    src = agent.alloc(64 << 10)
    await within(agent.write(src[:], objs["k"]))
    # ours: after the HEAD, within the retry budget, on a new connection
    assert methods(srv) == ["HEAD", "PUT (closed: body)", "HEAD", "PUT"]


async def test_part_sent_again_by_our_retry(make_agent: MakeAgent, fake: Any) -> None:
    # the create (POST) keeps its connection; the first part on it is cut
    srv = await started(fake, second("body", "PUT"))

    def answer(m: str, p: str, q: dict[str, str], b: bytes) -> Any:
        if m == "HEAD":
            return (b"200 OK", [b"Content-Length: %d" % (6 * MiB),
                                b'ETag: "0123456789abcdef0123456789abcdef-2"'], b"")
        return None

    srv.answer = answer
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **{**srv.kwargs(), "max_retries": 2},
                                  part_size=5 * MiB)
    src = agent.alloc(6 * MiB)
    await within(agent.write(src[:], objs["k"]))
    parts = [(m, q.get("partNumber")) for m, _, q in srv.requests if "partNumber" in q]
    cut = [pn for m, pn in parts if "closed" in m]
    assert len(cut) == 1 and sorted(pn for m, pn in parts if m == "PUT") == ["1", "2"]
    assert objs.backend.statistics().retries >= 1  # ours, counted

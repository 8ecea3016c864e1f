"""obj28: a malformed answer from the store is a ProtocolError (fz26's lead).

Each header (and XML field) the object backend reads from an answer, made
malformed by a small HTTP/1.1 server here (rclone answers well-formed
ones): before, several escaped as other errors:

- a Content-Range of more than 4300 digits: int() raised ValueError, made a
  plain XferError by _typed;
- a Content-Length aiohttp cannot read: aiohttp's ClientResponseError was
  taken as a transport failure, retried, then TransportError;
- an ETag with a control or non-ASCII character: a HEAD's returned as is
  (stat), a part's made the complete's XML fail to encode
  (UnicodeEncodeError, a plain XferError);
- an UploadId that is not ASCII: sent back changed (U+FFFD), the store's
  NoSuchUpload a plain XferError; a complete's ETag not an entity-tag:
  compared, a mismatch XferError;
- a Last-Modified past year 9999: OverflowError out of stat();
- a redirect's Location that urlsplit cannot split: ValueError out of stat().
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from conftest import within

from aioxfer.errors import ProtocolError, TransportError, XferError

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20

# (status, header lines, body); Content-Length is added unless given
Answer = tuple[bytes, list[bytes], bytes]


class FakeS3:
    """An HTTP/1.1 server on loopback (keep-alive, Content-Length bodies)
    answering each request with ``answer(method, path, query, body)``, by
    default a well-formed multipart upload (create, parts, complete, abort)
    and HEADs that find nothing; ``requests`` lists (method, path, query)."""

    def __init__(self, answer: Callable[[str, str, dict[str, str], bytes], Answer | None],
                 close: Callable[[int, str], str | None] | None = None) -> None:
        self.answer = answer
        # close(i, method) for the i-th request (from 0) of a connection,
        # once its head is read: "head" aborts the connection there (its
        # body unread), "body" once its body is read (unanswered)
        self.close = close
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def kwargs(self) -> dict[str, Any]:
        return {"endpoint": f"http://127.0.0.1:{self.port}", "access_key_id": "AKFAKE",
                "secret_access_key": "fake-secret", "region": "us-east-1",
                "max_retries": 1, "retry_timeout": 3.0}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self._writers.add(w)
        try:
            for i in itertools.count():
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target = lines[0].split(" ")[:2]
                clen = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        clen = int(value)
                closing = None if self.close is None else self.close(i, method)
                parts = urlsplit(target)
                query = dict(parse_qsl(parts.query, keep_blank_values=True))
                if closing == "head":
                    self.requests.append((f"{method} (closed: head)", parts.path, query))
                    return
                body = await r.readexactly(clen)
                if closing == "body":
                    self.requests.append((f"{method} (closed: body)", parts.path, query))
                    return
                self.requests.append((method, parts.path, query))
                got = self.answer(method, parts.path, query, body)
                if got is None:
                    got = default_answer(method, query, body)
                status, headers, payload = got
                if not any(h.lower().startswith(b"content-length:") for h in headers):
                    headers = [*headers, b"Content-Length: %d" % len(payload)]
                w.write(b"HTTP/1.1 " + status + b"\r\n" + b"".join(h + b"\r\n" for h in headers)
                        + b"\r\n" + (b"" if method == "HEAD" else payload))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            w.transport.abort()
            self._writers.discard(w)


UPLOAD_ID = "upload-28"
NOT_FOUND: Answer = (b"404 Not Found", [], b"")


def default_answer(method: str, query: dict[str, str], body: bytes) -> Answer:
    if method == "POST" and "uploads" in query:
        return (b"200 OK", [], b"<InitiateMultipartUploadResult><UploadId>%s</UploadId>"
                b"</InitiateMultipartUploadResult>" % UPLOAD_ID.encode())
    if method == "PUT" and "partNumber" in query:
        if query.get("uploadId") != UPLOAD_ID:
            return (b"404 Not Found", [], b"<Error><Code>NoSuchUpload</Code></Error>")
        return (b"200 OK", [b'ETag: "%032x"' % int(query["partNumber"])], b"")
    if method == "POST" and "uploadId" in query:
        return (b"200 OK", [], b"<CompleteMultipartUploadResult><ETag>&quot;"
                b"0123456789abcdef0123456789abcdef-2&quot;</ETag>"
                b"</CompleteMultipartUploadResult>")
    if method == "DELETE":
        return (b"204 No Content", [], b"")
    if method == "PUT":
        return (b"200 OK", [b'ETag: "00000000000000000000000000000000"'], b"")
    return NOT_FOUND


@pytest.fixture
async def fake() -> Any:
    made: list[FakeS3] = []

    async def make(answer: Callable[[str, str, dict[str, str], bytes], Answer | None]
                   ) -> FakeS3:
        f = FakeS3(answer)
        await f.start()
        made.append(f)
        return f

    try:
        yield make
    finally:
        for f in made:
            await f.aclose()


def only(method: str, answer: Answer, part: bool = False) -> Callable[..., Answer | None]:
    """``answer`` to every ``method`` request (``part``: to a multipart
    upload's parts only, else to requests of no upload), the default else."""
    def pick(m: str, path: str, query: dict[str, str], body: bytes) -> Answer | None:
        if m == method and ("partNumber" in query) == part and (
                part or "uploadId" not in query):
            return answer
        return None
    return pick


# --- Content-Range -------------------------------------------------------------


@pytest.mark.parametrize("value", [b"bytes " + b"0" * 5000 + b"-3/4",
                                   b"bytes 0-3/" + b"9" * 5000], ids=["start", "total"])
async def test_content_range_of_5000_digits(make_agent: MakeAgent, fake: Any,
                                            value: bytes) -> None:
    # failed before: start: XferError "... ValueError: Exceeds the limit
    # (4300 digits) for integer string conversion" (_typed's), not a
    # ProtocolError; total: taken (the total not read when the range was
    # the one asked for)
    srv = await fake(only("GET", (b"206 Partial Content", [b"Content-Range: " + value],
                                  b"abcd")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    dst = agent.alloc(4)
    with pytest.raises(ProtocolError, match="Content-Range"):
        await within(agent.read(dst[0:4], objs["k"][0:4]))


# --- Content-Length ------------------------------------------------------------


@pytest.mark.parametrize("value", [b"12x", b"1" * 40], ids=["letters", "overflow"])
async def test_content_length_malformed_get(make_agent: MakeAgent, fake: Any,
                                            value: bytes) -> None:
    # failed before: TransportError after the retries (aiohttp's parser
    # error taken as a transport failure); now one attempt, ProtocolError
    srv = await fake(only("GET", (b"200 OK", [b"Content-Length: " + value], b"abcd")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    dst = agent.alloc(4)
    with pytest.raises(ProtocolError, match="malformed"):
        await within(agent.read(dst[0:4], objs["k"]))
    assert sum(m == "GET" for m, _, _ in srv.requests) == 1


async def test_content_length_malformed_head(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: TransportError after the retries
    srv = await fake(only("HEAD", (b"200 OK", [b"Content-Length: 4 4"], b"")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    with pytest.raises(ProtocolError, match="malformed"):
        await within(objs.stat("k"))


async def test_content_length_malformed_put(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: TransportError ("the PUT's outcome is unknown ... 400,
    # message='Invalid character in Content-Length'"); the HEAD after it
    # still asked (the answer cannot say whether it was stored)
    srv = await fake(only("PUT", (b"200 OK", [b"Content-Length: \xb2"], b"")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_md5=True)
    src = agent.alloc(64 << 10)
    with pytest.raises(ProtocolError, match="malformed"):
        await within(agent.write(src[:], objs["k"]))
    assert [m for m, _, _ in srv.requests] == ["PUT", "HEAD"]


# --- ETag ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [b'"ab\x01cd"', b'"ab\xe9cd"', b'"a"b"'],
                         ids=["control", "latin1", "quote"])
async def test_head_etag_malformed(make_agent: MakeAgent, fake: Any, value: bytes) -> None:
    # failed before: stat() returned the e-tag as it came
    srv = await fake(only("HEAD", (b"200 OK", [b"Content-Length: 4", b"ETag: " + value], b"")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    with pytest.raises(ProtocolError, match="ETag"):
        await within(objs.stat("k"))


async def test_head_etag_well_formed(make_agent: MakeAgent, fake: Any) -> None:
    # guard: what stores send is taken (quoted, weak, unquoted, multipart)
    for value in (b'"0123456789abcdef0123456789abcdef"', b'W/"x-2"', b"abc", b'""'):
        srv = await fake(only("HEAD", (b"200 OK", [b"Content-Length: 4", b"ETag: " + value],
                                       b"")))
        agent = await make_agent("o")
        objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
        st = await within(objs.stat("k"))
        assert st.exists and st.size == 4 and st.e_tag == value.decode()


async def test_part_etag_not_ascii(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: XferError "... UnicodeEncodeError: 'utf-8' codec can't
    # encode character '\udce9'" (the complete's XML); now ProtocolError,
    # the upload aborted
    srv = await fake(only("PUT", (b"200 OK", [b'ETag: "ab\xe9cd"'], b""), part=True))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_size=5 * MiB)
    src = agent.alloc(6 * MiB)
    with pytest.raises(ProtocolError, match="ETag"):
        await within(agent.write(src[:], objs["k"]))
    assert srv.requests[-1][0] == "DELETE"  # aborted


# --- XML bodies ----------------------------------------------------------------


async def test_upload_id_not_ascii(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: the id went back as U+FFFD (the answer decoded with
    # "replace"): XferError "... NoSuchUpload" from the store, or worse,
    # another upload's parts
    srv = await fake(only("POST", (b"200 OK", [], b"<InitiateMultipartUploadResult><UploadId>"
                                   b"up\xff28</UploadId></InitiateMultipartUploadResult>")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_size=5 * MiB)
    src = agent.alloc(6 * MiB)
    with pytest.raises(ProtocolError, match="UploadId"):
        await within(agent.write(src[:], objs["k"]))
    assert not any("partNumber" in q for _, _, q in srv.requests)


async def test_upload_id_and_etag_entities(make_agent: MakeAgent, fake: Any) -> None:
    # guard: XML references in an UploadId and a complete's ETag are
    # decoded (&amp; sent back as &, &quot; compared without its quotes)
    issued = "a&b=c"

    def answer(m: str, path: str, query: dict[str, str], body: bytes) -> Answer | None:
        if m == "POST" and "uploads" in query:
            return (b"200 OK", [], b"<InitiateMultipartUploadResult>\n  <UploadId>a&amp;b=c"
                    b"</UploadId>\n</InitiateMultipartUploadResult>")
        if m == "PUT" and "partNumber" in query:
            assert query["uploadId"] == issued
            return (b"200 OK", [b'ETag: "%032x"' % int(query["partNumber"])], b"")
        if m == "HEAD":
            return (b"200 OK", [b"Content-Length: %d" % (6 * MiB),
                                b'ETag: "0123456789abcdef0123456789abcdef-2"'], b"")
        return None

    srv = await fake(answer)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_size=5 * MiB)
    src = agent.alloc(6 * MiB)
    await within(agent.write(src[:], objs["k"]))
    assert [m for m, _, q in srv.requests] == ["POST", "PUT", "PUT", "POST", "HEAD"]


async def test_complete_etag_malformed(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: XferError ("answered as complete with e-tag "a b", but
    # the store's object has ...": compared as it came); now ProtocolError
    def answer(m: str, path: str, query: dict[str, str], body: bytes) -> Answer | None:
        if m == "POST" and "uploadId" in query:
            return (b"200 OK", [], b"<CompleteMultipartUploadResult><ETag>&quot;a b&quot;"
                    b"</ETag></CompleteMultipartUploadResult>")
        if m == "HEAD":
            return (b"200 OK", [b"Content-Length: %d" % (6 * MiB),
                                b'ETag: "0123456789abcdef0123456789abcdef"'], b"")
        return None

    srv = await fake(answer)
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs(), part_size=5 * MiB)
    src = agent.alloc(6 * MiB)
    with pytest.raises(ProtocolError, match="ETag"):
        await within(agent.write(src[:], objs["k"]))


# --- Last-Modified, Location -----------------------------------------------------


async def test_last_modified_past_9999(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: OverflowError out of stat() (parsedate_to_datetime);
    # the date is informative: left out, as one that cannot be read
    srv = await fake(only("HEAD", (b"200 OK", [
        b"Content-Length: 4", b"Last-Modified: Mon, 01 Jan 99999999999 00:00:00 GMT"], b"")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    st = await within(objs.stat("k"))
    assert st.exists and st.size == 4 and st.last_modified is None


async def test_redirect_location_unsplittable(make_agent: MakeAgent, fake: Any) -> None:
    # failed before: ValueError ("Invalid IPv6 URL") out of stat(); now the
    # redirect's XferError, the Location not named
    srv = await fake(only("HEAD", (b"307 Temporary Redirect", [b"Location: http://[bad/x"],
                                   b"")))
    agent = await make_agent("o")
    objs = agent.register_objects("s3://bkt/p", **srv.kwargs())
    with pytest.raises(XferError, match="redirected") as got:
        await within(objs.stat("k"))
    assert not isinstance(got.value, TransportError)
    assert re.search(r"malformed Location", str(got.value))

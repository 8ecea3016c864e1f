"""obj28: the check after a PUT whose outcome is unknown (s24's lead).

When a single PUT's answer is lost (the connection cut once the server had
the whole body), ObjectRegion._landed asks for the key with a HEAD and
compares its e-tag with the body's MD5. That MD5 was hashed with hashlib on
the event loop's thread: a conditional create's body may be up to 5 GiB (S3's
limit for one PUT), i.e. seconds of a blocked loop (0.6 GB/s here), every
other task of the process stalled meanwhile. Now it is hashed on a worker
thread (awaited through a cancel when it reads the caller's buffer), once
per write (the Content-MD5 of ``part_md5`` reuses it).

Against rclone serve s3 (tests/s3server.py), through a relay here that cuts
the client's connection once the server starts to answer the PUT.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import s3server
from conftest import pattern, within
from s3server import S3Server

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

s3 = s3server.s3  # the fixture, by name

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


class CutRelay:
    """A TCP relay on loopback in front of the S3 server, streaming both
    ways a chunk at a time (no large copies on the test's loop, whose stalls
    are measured). The first connection it relays is cut (the client's side
    aborted) as soon as the server's answer to it begins: the server has
    stored the PUT it carried, the client cannot know. ``cut_at``: when."""

    def __init__(self, target: S3Server) -> None:
        self.target = target
        self.port = 0
        self.cut_at: float | None = None
        self._conns = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def kwargs(self) -> dict[str, str]:
        return {**self.target.kwargs(), "endpoint": f"http://127.0.0.1:{self.port}"}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self._conns += 1
        cut = self._conns == 1
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target.port)
        self._writers |= {cw, sw}
        up = asyncio.ensure_future(self._pump(cr, sw, None))
        down = asyncio.ensure_future(self._pump(sr, cw, cw if cut else None))
        self._tasks |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for w in (cw, sw):
            w.transport.abort()
            self._writers.discard(w)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                    cut: asyncio.StreamWriter | None) -> None:
        task = asyncio.current_task()
        try:
            while True:
                chunk = await r.read(256 << 10)
                if not chunk:
                    return
                if cut is not None:
                    self.cut_at = time.monotonic()
                    cut.transport.abort()
                    return
                w.write(chunk)
                await w.drain()
        except (ConnectionError, OSError):
            return
        finally:
            if task is not None:
                self._tasks.discard(task)


class Ticker:
    """A task waking every ``period`` seconds: the longest gap between two
    of its wake-ups after ``since`` (a time.monotonic()) is the longest the
    loop was kept from running it, less ``period``."""

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.gaps: list[tuple[float, float]] = []  # (woke at, gap)
        self._task: asyncio.Task[None] | None = None
        self._last = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        self._last = time.monotonic()
        while True:
            await asyncio.sleep(self.period)
            self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        self.gaps.append((now, now - self._last - self.period))
        self._last = now

    async def stop(self) -> None:
        assert self._task is not None
        # the stall that ended the awaited call (its last step) may end just
        # before the ticker's own wake-up: counted here
        self._tick()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    def longest(self, since: float) -> float:
        return max((g for at, g in self.gaps if at - g > since), default=0.0)


@pytest.mark.parametrize("md5", [False, True], ids=["plain", "part_md5"])
async def test_landed_check_hashes_off_the_loop(make_agent: MakeAgent, s3: S3Server,
                                                md5: bool) -> None:
    # failed before (plain): the loop's longest stall after the cut was the
    # MD5 of the whole 128 MiB body on the loop's thread (~0.2-0.4 s here,
    # as long as the hash measured below); now the hash runs on a worker
    # thread and the loop keeps ticking. With part_md5 the Content-MD5's
    # digest is reused (before: a second hash of the body, on the loop).
    relay = CutRelay(s3)
    await relay.start()
    try:
        bucket = s3.bucket("l")
        agent = await make_agent("o")
        objs = agent.register_objects(f"s3://{bucket}/l", **relay.kwargs(),
                                      part_md5=md5, max_retries=0)
        n = 128 * MiB
        src = agent.alloc(n)
        src.numpy()[:] = pattern(n, 28)
        hashed = float("inf")  # the body's MD5 on this thread: the better of two
        for _ in range(2):
            t0 = time.monotonic()
            want = hashlib.md5(memoryview(src.numpy()), usedforsecurity=False).hexdigest()
            hashed = min(hashed, time.monotonic() - t0)
        ticker = Ticker()
        ticker.start()
        try:
            # a conditional create: one PUT whatever its size (up to 5 GiB);
            # the HEAD after the cut finds our bytes: written
            await within(agent.write(src[:], objs.create("k")), 120)
        finally:
            await ticker.stop()
        assert relay.cut_at is not None, "the relay did not cut the PUT's answer"
        stall = ticker.longest(relay.cut_at)
        print(f"md5 of the body on the loop {hashed * 1e3:.0f} ms; the loop's longest "
              f"stall after the cut {stall * 1e3:.1f} ms")
        assert stall < hashed / 2, (
            f"the loop stalled {stall * 1e3:.0f} ms after the cut (the body's MD5 "
            f"takes {hashed * 1e3:.0f} ms): hashed on the loop's thread?")
        got = hashlib.md5(s3.file(bucket, "l/k").read_bytes(), usedforsecurity=False)
        assert got.hexdigest() == want
    finally:
        await relay.aclose()

"""obj26: single PUTs through our own signed requests (notes/s23.md, obj24's leads).

1. A single PUT went through obstore, whose read_timeout counts from the
   request's start until its answer begins, the body's sending included: a
   body the store reads slower than ~part_size / read_timeout failed (its
   outcome unknown, then TransportError), and ``part_md5`` / ``min_rate``
   did not apply to it. Now it is signed here and sent with aiohttp (the
   same attempt loop: unsent / answered / unknown), bound by ``min_rate``,
   with Content-MD5 under ``part_md5``.
2. A conditional create whose outcome was unknown and whose HEAD found the
   key holding another writer's bytes was sent again (resend_unknown_puts)
   blindly: on a store that ignores If-None-Match (rclone) it replaced that
   object. Now it is ObjectExists, the other object left alone.
3. With a credential_provider, a 401/403 of obstore's own upload (a
   conditional create over part_size) was not retried with fresh
   credentials: AccessDenied.
4. A write still asking the provider (signing its target) when aclose
   started was not one of the writes aclose waited for: its session was
   made after the close (left open), or it failed.

All against rclone serve s3 (tests/s3server.py), through relays here.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import s3server
from conftest import pattern, within
from s3server import ACCESS_KEY, SECRET_KEY, FaultProxy, S3Server

from aioxfer.errors import ObjectExists

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

s3 = s3server.s3  # the fixtures, by name
proxy = s3server.fault_proxy

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20


class Relay:
    """A TCP relay on loopback in front of the S3 server. ``rate``: the
    bytes per second it reads from the client (the server reading request
    bodies that slowly; answers go at once). ``corrupt``: the byte at this
    offset of the body of the first PUT it relays is flipped (a faulty
    network or proxy), once."""

    def __init__(self, target: S3Server, rate: float | None = None,
                 corrupt: int | None = None) -> None:
        self.target = target
        self.rate = rate
        self.corrupt = corrupt
        self.corrupted = 0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def kwargs(self) -> dict[str, str]:
        return {**self.target.kwargs(), "endpoint": f"http://127.0.0.1:{self.port}"}

    async def start(self) -> None:
        sock = socket.socket()
        # a small receive buffer (not autotuned): the client's bytes wait
        # in its own socket, not here, for the paced reads
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 10)
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=sock)
        self.port = int(sock.getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target.port)
        self._writers |= {cw, sw}
        up = asyncio.ensure_future(self._pump(cr, sw, True))
        down = asyncio.ensure_future(self._pump(sr, cw, False))
        self._tasks |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for w in (cw, sw):
            w.transport.abort()
            self._writers.discard(w)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, up: bool) -> None:
        task = asyncio.current_task()
        seen = bytearray()  # a request's first bytes, until its head ends
        at = 0  # bytes relayed upward on this connection
        target = -1  # where the byte to flip is, in this connection's bytes
        try:
            while True:
                chunk = await r.read(64 << 10)
                if not chunk:
                    return
                if up and self.corrupt is not None and not self.corrupted:
                    if target < 0 and len(seen) < 1 << 16:
                        seen += chunk
                        end = seen.find(b"\r\n\r\n")
                        if end >= 0 and seen.startswith(b"PUT "):
                            target = end + 4 + self.corrupt
                    if 0 <= target - at < len(chunk):
                        buf = bytearray(chunk)
                        buf[target - at] ^= 0xFF
                        chunk = bytes(buf)
                        self.corrupted += 1
                at += len(chunk)
                w.write(chunk)
                await w.drain()
                if up and self.rate is not None:
                    await asyncio.sleep(len(chunk) / self.rate)
        except (ConnectionError, OSError):
            return
        finally:
            if task is not None:
                self._tasks.discard(task)


@pytest.fixture
async def relay_factory(s3: S3Server) -> Any:
    made: list[Relay] = []

    async def make(**kw: Any) -> Relay:
        r = Relay(s3, **kw)
        await r.start()
        made.append(r)
        return r

    try:
        yield make
    finally:
        for r in made:
            await r.aclose()


# --- 1. a single PUT whose body the store reads slowly -------------------------


async def test_slow_single_put_bound_by_min_rate_not_read_timeout(
        make_agent: MakeAgent, s3: S3Server, relay_factory: Any) -> None:
    # failed before: TransportError after ~3 s ("the PUT's outcome is
    # unknown (... timed out)"): obstore's read_timeout counts the body's
    # sending, 24 MiB at 4 MiB/s taking ~6 s. Ours: the answer is waited
    # for read_timeout once the body is out; the whole bound is
    # connect + read + bytes / min_rate.
    relay = await relay_factory(rate=4 * MiB)
    bucket = s3.bucket("s")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/s", **relay.kwargs(),
                                  part_size=32 * MiB, read_timeout=3.0, max_retries=0)
    n = 24 * MiB
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 26)
    t0 = time.monotonic()
    await within(agent.write(src[:], objs["k"]), 60)
    took = time.monotonic() - t0
    assert took > 3.0  # the pace was met: slower than the read_timeout
    assert s3.file(bucket, "s/k").read_bytes() == bytes(src.numpy())


async def test_single_put_below_min_rate_fails_within_its_bound(
        make_agent: MakeAgent, s3: S3Server, relay_factory: Any) -> None:
    # guard (passes before too, obstore's bound being stricter): a body
    # read slower than min_rate fails as a timeout, its outcome unknown
    # (not sent again), within connect + read + bytes / min_rate
    relay = await relay_factory(rate=256 << 10)
    bucket = s3.bucket("m")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/m", **relay.kwargs(),
                                  connect_timeout=1.0, read_timeout=1.0,
                                  min_rate=2 * MiB, max_retries=0)
    n = 6 * MiB  # bound 1 + 1 + 3 s; ~24 s at the relay's pace
    src = agent.alloc(n)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="outcome is unknown"):
        await within(agent.write(src[:], objs["k"]), 30)
    assert time.monotonic() - t0 < 12


async def test_part_md5_covers_a_single_put(make_agent: MakeAgent, s3: S3Server,
                                            relay_factory: Any) -> None:
    # failed before: the corrupted bytes were stored (obstore's PUT carried
    # no Content-MD5): the file differed from the source. Now the store
    # refuses it (400 BadDigest: answered, so over) and it is sent again.
    relay = await relay_factory(corrupt=1000)
    bucket = s3.bucket("d")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/d", **relay.kwargs(), part_md5=True)
    n = 64 << 10
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 7)
    await within(agent.write(src[:], objs["k"]))
    assert relay.corrupted == 1
    assert s3.file(bucket, "d/k").read_bytes() == bytes(src.numpy())


# --- 2. a create whose outcome is unknown, the key another writer's ------------


@pytest.mark.parametrize("ours", [False, True], ids=["obstore", "ours"])
async def test_unknown_create_finding_other_bytes_is_object_exists(
        make_agent: MakeAgent, s3: S3Server, proxy: FaultProxy, ours: bool) -> None:
    # failed before: the HEAD found the key without our bytes and the
    # create was sent again (resend_unknown_puts): rclone ignores
    # If-None-Match, so it replaced the other writer's object and the
    # write succeeded. (A 16 KiB PUT is obstore's; part_md5 makes it ours.)
    bucket = s3.bucket("c")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/c", **proxy.kwargs(),
                                  resend_unknown_puts=True, part_md5=ours)
    n = 16 << 10
    theirs, mine = agent.alloc(n), agent.alloc(n)
    theirs.numpy()[:] = pattern(n, 1)
    mine.numpy()[:] = pattern(n, 2)
    await within(agent.write(theirs[:], objs["k"]))
    proxy.put_fault["c/k"] = "drop"  # the create's answer lost (never stored)
    with pytest.raises(ObjectExists, match="other bytes"):
        await within(agent.write(mine[:], objs.create("k")))
    assert s3.file(bucket, "c/k").read_bytes() == bytes(theirs.numpy())
    assert proxy.puts["c/k"] == 1  # the first writer's only


# --- 3. a provider's refused credentials on a create over part_size ------------


class Provider:
    """obstore's S3CredentialProvider: counts its calls; its first ``stale``
    answers carry a wrong secret (rclone: 403 SignatureDoesNotMatch);
    ``delay``: seconds its first call takes (async)."""

    def __init__(self, stale: int = 0, delay: float = 0.0) -> None:
        self.calls = 0
        self.stale = stale
        self.delay = delay
        self.asked = asyncio.Event()

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        self.asked.set()
        if self.calls == 1 and self.delay:
            await asyncio.sleep(self.delay)
        secret = "stale-secret" if self.calls <= self.stale else SECRET_KEY
        return {"access_key_id": ACCESS_KEY, "secret_access_key": secret, "token": None,
                "expires_at": None}


async def test_stale_provider_on_a_create_over_part_size(make_agent: MakeAgent,
                                                         s3: S3Server) -> None:
    # failed before: AccessDenied (obstore's put with a mode, no refresh)
    bucket = s3.bucket("p")
    agent = await make_agent("o")
    p = Provider(stale=1)
    objs = agent.register_objects(f"s3://{bucket}/p", endpoint=s3.endpoint,
                                  region="us-east-1", part_size=5 * MiB,
                                  credential_provider=p)
    n = 6 * MiB
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 3)
    await within(agent.write(src[:], objs.create("k")), 60)
    assert s3.file(bucket, "p/k").read_bytes() == bytes(src.numpy())
    assert p.calls == 2


# --- 4. aclose while a write is still asking the provider ----------------------


@pytest.mark.parametrize("n", [64 << 10, 12 * MiB], ids=["single", "multipart"])
async def test_aclose_waits_for_a_write_still_signing(make_agent: MakeAgent,
                                                      s3: S3Server, n: int) -> None:
    # failed before: aclose did not wait for it (it was not yet in
    # _uploads): the write made a session after the close, left open
    bucket = s3.bucket("a")
    agent = await make_agent("o")
    p = Provider(delay=1.0)
    objs = agent.register_objects(f"s3://{bucket}/a", endpoint=s3.endpoint,
                                  region="us-east-1", part_size=5 * MiB,
                                  credential_provider=p)
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 4)
    t = asyncio.ensure_future(agent.write(src[:], objs["k"]))
    await within(p.asked.wait())  # the write is asking the provider
    await within(objs.aclose(), 60)
    assert t.done()  # aclose waited for it
    await within(t)
    assert s3.file(bucket, "a/k").read_bytes() == bytes(src.numpy())
    assert objs._session is None


# --- our single PUT's attempts sorted as obstore's were -------------------------


@pytest.mark.parametrize("fault, resend, ok, puts", [
    ("drop", False, False, 0),  # unknown, not there: not sent again
    ("502", False, False, 0),   # a gateway's: unknown
    ("cut", False, True, 1),    # unknown, the HEAD finds our bytes
    ("503", False, True, 1),    # answered, so over: sent again
    ("drop", True, True, 1),    # unknown, sent again when asked
])
async def test_our_single_put_sorts_its_failures(make_agent: MakeAgent, s3: S3Server,
                                                 proxy: FaultProxy, fault: str,
                                                 resend: bool, ok: bool, puts: int) -> None:
    # (guard: these held for obstore's PUT; part_md5 makes a 16 KiB PUT ours)
    bucket = s3.bucket("f")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/f", **proxy.kwargs(), part_md5=True,
                                  resend_unknown_puts=resend)
    n = 16 << 10
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 9)
    proxy.put_fault["f/k"] = fault
    if ok:
        await within(agent.write(src[:], objs["k"]))
        assert s3.file(bucket, "f/k").read_bytes() == bytes(src.numpy())
    else:
        with pytest.raises(Exception, match="resend_unknown_puts"):
            await within(agent.write(src[:], objs["k"]))
        assert not s3.file(bucket, "f/k").exists()
    assert proxy.puts.get("f/k", 0) == puts and proxy.overlaps == []

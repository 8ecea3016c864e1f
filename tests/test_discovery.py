"""Membership and discovery on a real etcd, and incarnation fencing.

A session-scoped fixture starts Debian's ``etcd`` (package etcd-server) on
loopback, on free ports, in a temp dir, and stops it by its pid; the etcd
tests skip with the reason when the binary is absent. Members that must die
(kill -9, SIGSTOP) or restart run in their own processes (multiprocessing
spawn). Detection times are printed (``pytest -s``); only the bounds the design
states are asserted.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import time
import traceback
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import (
    STEP,
    RemoteAgent,
    RemoteError,
    _command,
    digest,
    pattern,
    run_child,
    sigstop,
    stats_dict,
    wait_until,
    within,
)

import aioxfer
from aioxfer.discovery import Etcd, Membership, PeerJoined, PeerLeft, PeerUpdated
from aioxfer.metadata import AgentMeta

TTL = 2  # lease seconds in these tests: short, yet a healthy member on a busy box keeps it


# --------------------------------------------------------------- the etcd server


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return b'"true"' in r.read()
    except OSError:
        return False


def etcd_command(exe: str, name: str, data_dir: Path, client: str, peer: str, *,
                 initial: str | None = None, heartbeat_ms: int = 10) -> list[str]:
    """The command line of one etcd member for the tests (client and peer:
    its http:// URLs; initial: the whole cluster's name=peer list, this
    member alone by default). Short raft timings (election 10 heartbeats): a
    single node elects itself at once, and leases as short as 1 s are
    allowed (etcd's minimum TTL follows the election timeout)."""
    return [
        exe, "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", initial or f"{name}={peer}", "--initial-cluster-state", "new",
        "--heartbeat-interval", str(heartbeat_ms), "--election-timeout", str(10 * heartbeat_ms),
        "--logger", "zap", "--log-level", "warn",
    ]


def etcd_env() -> dict[str, str]:
    """The environment for a test etcd: none of the caller's ETCD* settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}

@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real single-node etcd on 127.0.0.1 (never the default ports, so a
    system etcd on 2379 does not interfere); yields its "host:port"."""
    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip("the etcd binary is not installed (Debian: apt-get install etcd-server)")
    pytest.importorskip("aetcd", reason="the aetcd client is not installed (pip install aetcd)")
    data = tmp_path_factory.mktemp("etcd")
    client_port, peer_port = _free_ports(2)
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    cmd = etcd_command(exe, "aioxfer-test", data / "data", client, peer)
    with open(data / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=etcd_env())
    try:
        deadline = time.monotonic() + 30
        while not _healthy(client):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {proc.returncode}: {(data / 'etcd.log').read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within 30 s at {client}")
            time.sleep(0.05)
        yield f"127.0.0.1:{client_port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture
def etcd(etcd_server: str) -> Etcd:
    """A discovery config of its own (a fresh prefix) for each test."""
    return Etcd(etcd_server, prefix=f"/aioxfer-test/{uuid.uuid4().hex[:12]}", ttl=TTL)


async def _etcd_get(etcd: Etcd, name: str) -> bytes | None:
    import aetcd  # type: ignore[import-untyped]

    host, port = etcd.endpoints[0].rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=STEP) as c:
        kv = await c.get(etcd.key(name).encode())
    return None if kv is None else bytes(kv.value)


async def _etcd_delete(etcd: Etcd, name: str) -> None:
    import aetcd

    host, port = etcd.endpoints[0].rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=STEP) as c:
        await c.delete(etcd.key(name).encode())


async def next_event(
    it: Membership, pred: Callable[[Any], bool], seconds: float = STEP, what: str = "event"
) -> Any:
    """The next event from ``it`` matching ``pred`` (others are skipped)."""
    seen = []
    try:
        async with asyncio.timeout(seconds):
            async for ev in it:
                if pred(ev):
                    return ev
                seen.append(ev)
    except TimeoutError:
        raise AssertionError(f"no {what} within {seconds} s; saw {seen}") from None
    raise AssertionError(f"membership ended before {what}; saw {seen}")


def is_(cls: type, name: str, incarnation: int | None = None) -> Callable[[Any], bool]:
    return lambda ev: (
        isinstance(ev, cls)
        and ev.name == name
        and (incarnation is None or ev.incarnation == incarnation)
    )


# --------------------------------------------------------------- member processes


async def _member_serve(conn: Any, opts: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    size = opts.get("size", 1 << 20)
    kwargs = {k: opts[k] for k in ("transports", "peer_timeout", "keepalive") if k in opts}
    disc = Etcd(opts["etcd"], prefix=opts["prefix"], ttl=opts.get("ttl", TTL))
    agent = aioxfer.Agent(opts["name"], discovery=disc, **kwargs)
    # Registered before joining: the first publication already lists them.
    regions: dict[str, Any] = {
        "pool": agent.alloc(size, name="pool"),
        "user": agent.register(bytearray(size), name="user"),
    }
    async with agent:
        conn.send({"address": agent.address, "pid": os.getpid(),
                   "incarnation": agent.incarnation})
        while True:
            cmd, args = await loop.run_in_executor(None, conn.recv)
            if cmd == "quit":
                break
            try:
                if cmd == "register":
                    name, n = args
                    regions[name] = agent.register(bytearray(n), name=name)
                    result = None
                else:
                    result = await _command(agent, regions, {}, cmd, args)
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    conn.send(("ok", stats_dict(agent)))


def member_main(conn: Any, opts: dict[str, Any]) -> None:
    run_child(_member_serve, conn, opts)


class Member(RemoteAgent):
    """An agent with discovery in a spawned process (regions "pool" and "user")."""

    def __init__(self, **opts: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=member_main, args=(child, opts), daemon=True)
        self.proc.start()
        child.close()
        hello = self._recv(60.0)
        if not isinstance(hello, dict):
            raise RemoteError(f"member failed to start: {hello!r}")
        self.address: str = hello["address"]
        self.pid: int = hello["pid"]
        self.incarnation: int = hello["incarnation"]
        self.closed = False


@pytest.fixture
async def member(etcd: Etcd) -> AsyncIterator[Callable[..., Awaitable[Member]]]:
    started: list[Member] = []

    async def factory(name: str, **opts: Any) -> Member:
        opts = {"etcd": etcd.endpoints[0], "prefix": etcd.prefix, "ttl": etcd.ttl,
                "name": name, **opts}
        m = await asyncio.get_running_loop().run_in_executor(None, lambda: Member(**opts))
        started.append(m)
        return m

    try:
        yield factory
    finally:
        finals = []
        for m in started:
            if m.proc.is_alive():
                m.kill(signal.SIGCONT)  # a stopped one could not answer "quit"
            finals.append(await m.close())
    for stats in finals:
        if stats is not None:
            leaks = {k: stats[k] for k in ("in_flight", "native_ops", "native_regions",
                                           "pinned_regions")}
            assert all(v == 0 for v in leaks.values()), f"member leaks: {leaks}"


class Stream:
    """Keeps ``depth`` writes in flight from ``src`` into ``dst`` until stopped
    or until one fails; records when each failure happened."""

    def __init__(self, agent: Any, src: Any, dst: Any, chunk: int, depth: int = 4) -> None:
        self.agent, self.src, self.dst, self.chunk, self.depth = agent, src, dst, chunk, depth
        self.ok = 0
        self.failures: list[tuple[float, BaseException]] = []
        self.stop = asyncio.Event()
        self.started = asyncio.Event()
        self.failed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def _done(self, t: asyncio.Future[Any]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None:
            self.ok += 1
            self.started.set()
        else:
            self.failures.append((time.monotonic(), exc))
            self.failed.set()

    async def _run(self) -> None:
        n = self.src.nbytes // self.chunk
        i = 0
        inflight: set[Any] = set()
        while True:
            while len(inflight) < self.depth and not self.stop.is_set() and not self.failures:
                off = (i % n) * self.chunk
                t = self.agent.write(self.src[off:off + self.chunk], self.dst[off:off + self.chunk])
                t.add_done_callback(self._done)
                inflight.add(t)
                i += 1
            if not inflight:
                return
            _, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)

    async def finish(self, seconds: float = STEP) -> None:
        self.stop.set()
        await within(self.task, seconds)


# --------------------------------------------------------------- without a server


def test_public_names() -> None:
    for name in ("Etcd", "Membership", "PeerJoined", "PeerUpdated", "PeerLeft"):
        assert name in aioxfer.__all__
        assert getattr(aioxfer, name) is getattr(aioxfer.discovery, name)


def test_etcd_arguments() -> None:
    pytest.importorskip("aetcd")
    e = Etcd(["http://127.0.0.1:1234", "10.0.0.1:2379"], prefix="/x/", ttl=1.5)
    assert e.endpoints == ("http://127.0.0.1:1234", "10.0.0.1:2379")
    assert e.ttl == 2 and e.key("d-3") == "/x/agents/d-3"
    for bad in ([], ["nohost"], ["127.0.0.1:0"], ["https://127.0.0.1:2379"]):
        with pytest.raises(ValueError):
            Etcd(bad)
    with pytest.raises(ValueError, match="ttl"):
        Etcd("127.0.0.1:2379", ttl=0)
    with pytest.raises(ValueError, match="prefix"):
        Etcd("127.0.0.1:2379", prefix="nope")
    with pytest.raises(TypeError, match="discovery"):
        aioxfer.Agent("a", discovery="127.0.0.1:2379")  # type: ignore[arg-type]


async def test_membership_consumer_that_falls_behind_fails_loudly() -> None:
    from aioxfer.discovery import MAX_BACKLOG

    it = Membership([], lambda _: None)
    for i in range(MAX_BACKLOG + 1):
        it._put(PeerJoined(f"p{i}", i, "127.0.0.1:1"))
    with pytest.raises(aioxfer.XferError, match="fell more than"):
        await within(it.__anext__())


async def test_names_need_discovery(make_agent: Any) -> None:
    a = await make_agent("a")
    with pytest.raises(ValueError, match="no discovery"):
        await a.connect("decode-3")


async def test_unreachable_etcd_fails_start_within_bound() -> None:
    pytest.importorskip("aetcd")
    (port,) = _free_ports(1)  # nothing listens there
    agent = aioxfer.Agent("lonely", discovery=Etcd(f"127.0.0.1:{port}", timeout=1.0))
    t0 = time.monotonic()
    with pytest.raises(aioxfer.TransportError, match="cannot join through etcd"):
        await within(agent.__aenter__())
    assert agent.closed  # __aenter__ closed it: nothing leaks
    print(f"\nunreachable etcd reported after {time.monotonic() - t0:.2f} s")


async def test_embedded_membership_follows_connections(make_agent: Any) -> None:
    """Without discovery: connect -> PeerJoined, a refresh that finds a new
    region -> PeerUpdated, peer gone -> PeerLeft; two consumers see the same."""
    a = await make_agent("a")
    b = await make_agent("b")
    first, second = a.membership(), a.membership()
    peer = await within(a.connect(b.address))
    for it in (first, second):
        ev = await next_event(it, is_(PeerJoined, b.name), what="PeerJoined")
        assert (ev.incarnation, ev.address) == (b.incarnation, b.address)
    b.register(bytearray(64), name="kv")
    await within(peer.refresh())
    ev = await next_event(first, is_(PeerUpdated, b.name), what="PeerUpdated")
    assert ev.added == ("kv",) and ev.removed == ()
    late = a.membership()  # starts from the current members
    assert await within(late.__anext__()) == PeerJoined(b.name, b.incarnation, b.address, ("kv",))
    await b.aclose()  # it says goodbye: closed, not lost
    ev = await next_event(first, is_(PeerLeft, b.name), what="PeerLeft")
    assert ev.reason == "closed" and ev.incarnation == b.incarnation
    await a.aclose()  # every iterator ends, after what was queued
    assert [type(e) async for e in second] == [PeerUpdated, PeerLeft]
    assert [type(e) async for e in late] == [PeerLeft]
    with pytest.raises(aioxfer.ClosedResourceError):
        a.membership()


async def test_embedded_restart_at_same_address_is_stale(make_agent: Any) -> None:
    """Embedded: the same name at the same address with a new incarnation is a
    restart; handles to the old one fail with StalePeer, never reach the new."""
    a = await make_agent("a", transports=("tcp",))
    old = aioxfer.Agent("same", listen="127.0.0.1:0", transports=("tcp",))
    await old.start()
    address = old.address
    old.register(bytearray(4096), name="kv")
    peer = await within(a.connect(address))
    stale = peer.region("kv")
    await old.aclose()
    await wait_until(lambda: peer.lost, what="old peer lost")
    new = aioxfer.Agent("same", listen=address, transports=("tcp",))
    try:
        await new.start()
        kv = new.register(bytearray(4096), name="kv")
        src = a.register(bytearray(b"\xff" * 4096))
        with pytest.raises(aioxfer.PeerLost) as lost:
            await within(a.write(src[0:4096], stale[0:4096]))
        assert not isinstance(lost.value, aioxfer.StalePeer)  # no new incarnation known yet
        fresh = await within(a.connect(address))
        assert fresh.incarnation == new.incarnation != peer.incarnation
        with pytest.raises(aioxfer.StalePeer):
            await within(a.write(src[0:4096], stale[0:4096]))
        assert bytes(kv.memoryview) == bytes(4096)
        await within(a.write(src[0:4096], fresh.region("kv")[0:4096]))
        assert bytes(kv.memoryview) == b"\xff" * 4096
    finally:
        await a.aclose()
        await new.aclose()


# --------------------------------------------------------------- with etcd


async def test_join_update_leave(make_agent: Any, etcd: Etcd) -> None:
    a = await make_agent("a", discovery=etcd)
    events, other = a.membership(), a.membership()
    b = await make_agent("b", discovery=etcd)
    for it in (events, other):
        ev = await next_event(it, is_(PeerJoined, b.name, b.incarnation), what="PeerJoined")
        assert ev.address == b.address and ev.regions == ()

    # Published as msgspec JSON, without access keys or memory addresses.
    kv = b.register(bytearray(4096), name="kv")
    raw = await _etcd_get(etcd, b.name)
    assert raw is not None
    meta = msgspec.json.decode(raw, type=AgentMeta)
    assert (meta.name, meta.incarnation, meta.address) == (b.name, b.incarnation, b.address)
    assert all(r.key == 0 and r.addr == 0 for r in meta.regions)

    peer = await within(a.connect(b.name))  # by name
    assert peer.incarnation == b.incarnation
    assert await within(a.connect(b.address)) is peer  # addresses still work
    ev = await next_event(events, is_(PeerUpdated, b.name), what="PeerUpdated(kv)")
    assert ev.added == ("kv",)

    # A region registered now: PeerUpdated, and the Peer already knows it.
    b.register(bytearray(4096), name="more")
    ev = await next_event(events, is_(PeerUpdated, b.name), what="PeerUpdated(more)")
    assert ev.added == ("more",) and ev.removed == () and ev.old_address is None
    src = a.register(bytearray(pattern(4096, 7).tobytes()))
    more = peer.region("more")
    await within(a.write(src[0:4096], more[0:4096]))
    assert bytes(b.regions[1].memoryview) == bytes(src.memoryview)

    b.deregister(kv)
    ev = await next_event(events, is_(PeerUpdated, b.name), what="PeerUpdated(-kv)")
    assert ev.removed == ("kv",) and ev.added == ()

    b_name, b_inc = b.name, b.incarnation
    await b.aclose()
    ev = await next_event(events, is_(PeerLeft, b_name, b_inc), what="PeerLeft")
    assert ev.reason == "left"
    await next_event(other, is_(PeerLeft, b_name, b_inc), what="PeerLeft (2nd consumer)")
    assert peer.lost
    # b's close deregistered "more" (published to etcd) before it left:
    # whichever news came first, the write names the peer's loss (the
    # region may be gone from peer.regions already: CI saw a KeyError).
    with pytest.raises(aioxfer.PeerLost):
        await within(a.write(src[0:16], more[0:16]))
    with pytest.raises(aioxfer.PeerLost, match="no agent named"):
        await within(a.connect(b_name))
    assert await _etcd_get(etcd, b_name) is None

    await a.aclose()
    assert await _etcd_get(etcd, a.name) is None  # aclose deregistered it
    with pytest.raises(StopAsyncIteration):
        await within(events.__anext__())


async def test_lazy_start_joins_in_background(make_agent: Any, etcd: Etcd) -> None:
    """An agent first used without start() (a connect by address) still joins."""
    b = await make_agent("b", discovery=etcd)
    events = b.membership()
    lazy = aioxfer.Agent("lazy", discovery=etcd)
    try:
        await within(lazy.connect(b.address))
        ev = await next_event(events, is_(PeerJoined, "lazy", lazy.incarnation), what="join")
        assert ev.address == lazy.address
        assert (await within(lazy.connect(b.name))).incarnation == b.incarnation
    finally:
        await lazy.aclose()
    await next_event(events, is_(PeerLeft, "lazy"), what="leave")


async def test_deleted_key_drops_peer_and_evicts(make_agent: Any, etcd: Etcd) -> None:
    """An operator deleting a member's key: its peers drop it (transfers fail
    with PeerLost), and the member does not put itself back."""
    a = await make_agent("a", discovery=etcd, transports=("tcp",))
    b = await make_agent("b", discovery=etcd, transports=("tcp",))
    b.register(bytearray(1024), name="kv")
    events = a.membership()
    await next_event(events, is_(PeerJoined, b.name), what="PeerJoined")
    peer = await within(a.connect(b.name))
    t0 = time.monotonic()
    await _etcd_delete(etcd, b.name)
    ev = await next_event(events, is_(PeerLeft, b.name), what="PeerLeft")
    await wait_until(lambda: peer.lost, what="peer dropped")
    print(f"\ndeleted key -> PeerLeft after {time.monotonic() - t0:.3f} s")
    assert ev.reason == "left"
    src = a.register(bytearray(64))
    with pytest.raises(aioxfer.PeerLost, match="etcd key was deleted"):
        await within(a.write(src[0:8], peer.region("kv")[0:8]))
    b.register(bytearray(64), name="after")  # would republish, were b not evicted
    await wait_until(lambda: b._cluster.session._state == "evicted", what="b evicted")
    assert await _etcd_get(etcd, b.name) is None


def _first_failure(stream: Stream) -> tuple[float, BaseException]:
    assert stream.failures, "no transfer failed"
    return min(stream.failures, key=lambda f: f[0])


async def test_kill9_member_lease_expires_then_restart(
    make_agent: Any, member: Callable[..., Awaitable[Member]], etcd: Etcd
) -> None:
    """kill -9 of a member mid-stream: its transfers fail with PeerLost, its
    lease expires (PeerLeft); restarted under the same name, the old handles
    fail with StalePeer and no byte of theirs reaches the new process."""
    size, chunk = 4 << 20, 256 << 10
    a = await make_agent("a", discovery=etcd, transports=("tcp",))
    events = a.membership()
    old = await member("tgt", transports=("tcp",), size=size)
    await next_event(events, is_(PeerJoined, "tgt", old.incarnation), what="PeerJoined")
    peer = await within(a.connect("tgt"))
    assert peer.incarnation == old.incarnation
    src = a.register(bytearray(pattern(size, 1).tobytes()))
    stale_dst = peer.region("pool")

    stream = Stream(a, src, stale_dst, chunk)
    await within(stream.started.wait())
    t_kill = time.monotonic()
    old.kill(signal.SIGKILL)
    await within(stream.failed.wait())  # the stream goes on until the loss shows
    await stream.finish()
    t_fail, exc = _first_failure(stream)
    assert all(isinstance(e, aioxfer.PeerLost) for _, e in stream.failures), stream.failures
    left = await next_event(events, is_(PeerLeft, "tgt", old.incarnation), seconds=TTL + 5,
                            what="PeerLeft after lease expiry")
    t_left = time.monotonic()
    print(f"\nkill -9: pending transfers failed ({type(exc).__name__}) after "
          f"{t_fail - t_kill:.3f} s; lease expiry (ttl {TTL} s) -> PeerLeft after "
          f"{t_left - t_kill:.3f} s; {stream.ok} writes completed before")
    assert left.reason == "left"
    assert t_left - t_kill < TTL + 3  # ttl, etcd's 0.5 s expiry sweep, and slack

    new = await member("tgt", transports=("tcp",), size=size)
    await next_event(events, is_(PeerJoined, "tgt", new.incarnation), what="new PeerJoined")
    with pytest.raises(aioxfer.StalePeer):
        await within(a.write(src[0:chunk], stale_dst[0:chunk]))
    zeros = digest(bytes(size))
    assert await new.call("digest", "pool", 0, size) == zeros
    assert await new.call("digest", "user", 0, size) == zeros

    fresh = await within(a.connect("tgt"))
    assert fresh is not peer and fresh.incarnation == new.incarnation
    await within(a.write(src[0:chunk], fresh.region("pool")[0:chunk]))
    assert await new.call("digest", "pool", 0, chunk) == digest(src.memoryview[0:chunk])


async def test_lease_expiry_fails_pending_transfers(
    make_agent: Any, member: Callable[..., Awaitable[Member]], etcd: Etcd
) -> None:
    """A frozen member (SIGSTOP) whose connections stay open: with a long
    peer_timeout only its lease can tell, and its expiry fails the pending
    transfers with PeerLost."""
    a = await make_agent("a", discovery=etcd, transports=("tcp",), peer_timeout=60.0)
    events = a.membership()
    m = await member("frozen", transports=("tcp",), peer_timeout=60.0)
    peer = await within(a.connect("frozen"))
    src = a.register(bytearray(1 << 20))
    await within(a.write(src[0:4096], peer.region("pool")[0:4096]))
    try:
        sigstop(m.pid)
        t_stop = time.monotonic()
        pending = [a.write(src[0:65536], peer.region("pool")[0:65536]) for _ in range(4)]
        results = await within(asyncio.gather(*pending, return_exceptions=True), TTL + 5)
        t_fail = time.monotonic()
        assert all(isinstance(r, aioxfer.PeerLost) for r in results), [repr(r) for r in results]
        assert "lease expired" in str(results[0])
        await next_event(events, is_(PeerLeft, "frozen"), what="PeerLeft")
        print(f"\nSIGSTOP'd member: lease expiry (ttl {TTL} s) failed its pending transfers "
              f"after {t_fail - t_stop:.3f} s")
        assert t_fail - t_stop < TTL + 3
    finally:
        m.kill(signal.SIGKILL)
        m.terminate()


async def test_restart_same_name_mid_stream(
    make_agent: Any, member: Callable[..., Awaitable[Member]], etcd: Etcd
) -> None:
    """A new incarnation takes the name while the old one still runs and a
    stream of writes goes to it: the old handles are fenced (StalePeer), the new
    process never receives a byte from them, and connect(name) is the new one."""
    size, chunk = 4 << 20, 128 << 10
    a = await make_agent("a", discovery=etcd, transports=("tcp",))
    events = a.membership()
    old = await member("tgt", transports=("tcp",), size=size)
    peer = await within(a.connect("tgt"))
    src = a.register(bytearray(pattern(size, 2).tobytes()))
    stale_dst = peer.region("pool")
    stream = Stream(a, src, stale_dst, chunk)
    await within(stream.started.wait())

    new = await member("tgt", transports=("tcp",), size=size)  # spawned while streaming
    await next_event(events, is_(PeerLeft, "tgt", old.incarnation), what="old PeerLeft")
    joined = await next_event(events, is_(PeerJoined, "tgt"), what="new PeerJoined")
    assert joined.incarnation == new.incarnation
    # Both events may come in one watch batch, before the stream ran again:
    # its next write to the fenced handle is what must fail, so let it post.
    await within(stream.failed.wait())
    await stream.finish()
    assert stream.ok > 0 and stream.failures
    assert all(isinstance(e, aioxfer.StalePeer) for _, e in stream.failures), stream.failures
    assert peer.lost
    with pytest.raises(aioxfer.StalePeer):
        await within(a.write(src[0:chunk], stale_dst[0:chunk]))
    with pytest.raises(aioxfer.StalePeer):
        await within(a.read(src[0:chunk], stale_dst[0:chunk]))
    zeros = digest(bytes(size))
    assert await new.call("digest", "pool", 0, size) == zeros
    assert await new.call("digest", "user", 0, size) == zeros

    fresh = await within(a.connect("tgt"))
    assert fresh.incarnation == new.incarnation
    await within(a.write(src[0:size], fresh.region("pool")[0:size]))
    assert await new.call("digest", "pool", 0, size) == digest(src.memoryview)

    # The old incarnation, superseded, leaves without taking the name along.
    await old.close()
    raw = await _etcd_get(etcd, "tgt")
    assert raw is not None
    assert msgspec.json.decode(raw, type=AgentMeta).incarnation == new.incarnation
    assert not fresh.lost


"""Discovery under faults, second part: the join retried in the background,
the grace a re-list gives members after etcd lost its data, a join undone,
and watches that etcd ends (compaction, a cancel), on a real etcd of each
test's own (tests/test_discovery_faults.py's EtcdProc).

A server's cancel of a watch without a compact revision cannot be provoked
from a client of a stock etcd 3.4: a gRPC proxy in the test's loop (every
method forwarded as raw bytes, the Watch stream parsed) injects one, and
drops what the server sends for that watch afterwards, as etcd would not
send it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import STEP, sigstop, wait_until, within
from test_discovery import Member, is_, next_event
from test_discovery_faults import (
    TTL,
    EtcdCluster,
    EtcdProc,
    _client,
    _meta_json,
    config,
    drain_grpc,
    etcd_get,
    etcd_put,
    in_thread,
    wait_registered,
)

import aioxfer
from aioxfer.discovery import EtcdSession, PeerJoined, PeerLeft


@pytest.fixture
def etcd_proc(tmp_path: Path) -> Iterator[EtcdProc]:
    e = EtcdProc(tmp_path)
    e.start()
    try:
        yield e
    finally:
        if e.proc is not None:
            e.kill()

# ----------------------------------------------------------------- lazy join


async def first_join_failed(capsys: pytest.CaptureFixture[str]) -> None:
    """Until a lazy join's first try failed: it says so once, in a warning
    logged just before its backoff (aioxfer's log goes to sys.stderr).
    Was a fixed 1.5 s sleep: the first try fails at once with etcd down."""
    seen: list[str] = []

    def failed() -> bool:
        seen.append(capsys.readouterr().err)
        return "discovery.join_failed" in "".join(seen)

    await wait_until(failed, STEP, what="the lazy join's first try failed")


async def test_lazy_start_retries_a_failed_join_in_the_background(
    etcd_proc: EtcdProc, make_agent: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent started lazily (its first connect) while etcd was down: its
    join failed in the background, and nothing tried again until a start()
    or connect(name); etcd back, it stayed out of the cluster for ever."""
    disc = config(etcd_proc, timeout=1.0)
    plain = await make_agent("plain")
    await in_thread(etcd_proc.kill)
    lazy = aioxfer.Agent("lazy", discovery=disc)
    try:
        await within(lazy.connect(plain.address))  # starts it, and its join
        joining = lazy._cluster.joining
        assert joining is not None
        await first_join_failed(capsys)  # etcd down
        assert lazy._cluster.session is None
        await in_thread(etcd_proc.start)
        t0 = time.monotonic()
        await wait_registered(etcd_proc, disc, lazy, STEP)
        # The key is put before the join ends (the members are reset, then
        # the session kept): the background join task itself must finish.
        await within(asyncio.shield(joining))
        print(f"\njoined {time.monotonic() - t0:.2f} s after etcd came back")
        assert lazy._cluster.joining is joining and lazy._cluster.session is not None
    finally:
        await within(lazy.aclose())
    assert await etcd_get(etcd_proc, disc.key(lazy.name)) is None
    await drain_grpc()


async def test_start_during_a_lazy_joins_backoff_still_raises(
    etcd_proc: EtcdProc, capsys: pytest.CaptureFixture[str]
) -> None:
    """start() while the lazy join waits to try again: it gets that try's
    failure (the contract: start() raises when etcd cannot be reached), at
    once, not after the rest of the backoff nor never."""
    disc = config(etcd_proc, timeout=1.0)
    await in_thread(etcd_proc.kill)
    agent = aioxfer.Agent("lazy2", discovery=disc)
    try:
        agent._start()  # what a lazy start does
        # Logged with no await before the backoff's: the join waits in it now.
        await first_join_failed(capsys)
        with pytest.raises(aioxfer.TransportError, match="cannot join"):
            await within(agent.start(), 5.0)
    finally:
        await within(agent.aclose())
    await drain_grpc()


# ----------------------------------------------------------------- etcd wiped


async def test_relist_after_etcd_lost_its_data_gives_members_a_grace(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """etcd restarted without its data: a's re-list finds nobody, b (alive,
    connected) puts its key back only at its next keepalive. a reported b
    gone and dropped its peer at the re-list; now b has a grace (about a
    ttl) to come back, and nothing is reported. (b is stopped over the
    restart, so that a's re-list surely comes first.)"""
    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc, peer_timeout=30.0)
    b = await in_thread(lambda: Member(etcd=etcd_proc.endpoint, prefix=disc.prefix, ttl=TTL,
                                       name="b", peer_timeout=30.0))
    try:
        events = a.membership()
        await next_event(events, is_(PeerJoined, "b", b.incarnation), what="b joined")
        peer = await within(a.connect("b"))
        session = a._cluster.session
        assert session is not None
        before = session._revision
        await in_thread(sigstop, b.pid)
        await in_thread(etcd_proc.kill, True)
        await in_thread(etcd_proc.start)
        await wait_until(lambda: session._revision < before, STEP,
                         what="a listed the wiped etcd")
        b.kill(signal.SIGCONT)
        await wait_registered(etcd_proc, disc, a, STEP)
        raw = None
        deadline = time.monotonic() + STEP
        while raw is None and time.monotonic() < deadline:
            raw = await etcd_get(etcd_proc, disc.key("b"))
            await asyncio.sleep(0.1)
        assert raw is not None, "b never put its key back"
        await asyncio.sleep(session.grace + 0.5)  # past any grace
        seen = list(events._events)
        assert not [ev for ev in seen if isinstance(ev, PeerLeft)], seen
        assert "b" in a._membership._members
        assert not peer.lost, "a dropped its live peer b"
    finally:
        b.kill(signal.SIGCONT)
        await b.close()


async def test_member_that_does_not_come_back_leaves_after_the_grace(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """The grace ends: a member whose key does not come back (killed while
    etcd was down) is reported gone, and its peer dropped."""
    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc)
    b = await in_thread(lambda: Member(etcd=etcd_proc.endpoint, prefix=disc.prefix, ttl=TTL,
                                       name="b"))
    try:
        events = a.membership()
        await next_event(events, is_(PeerJoined, "b", b.incarnation), what="b joined")
        peer = await within(a.connect("b"))
        await in_thread(etcd_proc.kill, True)
        b.kill(signal.SIGKILL)
        await in_thread(etcd_proc.start)
        session = a._cluster.session
        assert session is not None
        await next_event(events, is_(PeerLeft, "b", b.incarnation),
                         seconds=STEP + session.grace, what="b's leaving")
        assert peer.lost
    finally:
        await b.close()


# ----------------------------------------------------------------- undone join


async def test_join_undone_as_start_is_cancelled_forgets_its_members(
    etcd_proc: EtcdProc,
) -> None:
    """start() cancelled just as its join completed: the join is undone (key
    revoked), but the members it had listed stayed in membership()."""
    disc = config(etcd_proc)
    for i in range(3):
        await etcd_put(etcd_proc, disc.key(f"m{i}").encode(), _meta_json(f"m{i}"))
    agent = aioxfer.Agent("undone", discovery=disc)
    try:
        early = agent.membership()
        start = asyncio.get_running_loop().create_task(agent.start())
        await asyncio.sleep(0)  # start() awaits the join now
        joining = agent._cluster.joining
        assert joining is not None
        # Runs right after the join is done, before start() resumes.
        joining.add_done_callback(lambda _: start.cancel())
        with pytest.raises(asyncio.CancelledError):
            await within(start)
        assert agent._cluster.session is None
        assert await etcd_get(etcd_proc, disc.key(agent.name)) is None
        assert not agent.membership()._events, "members of a join undone"
        got = list(early._events)
        joined = {ev.name for ev in got if isinstance(ev, PeerJoined)}
        left = {ev.name for ev in got if isinstance(ev, PeerLeft)}
        assert joined == left == {"m0", "m1", "m2"}, got
        await within(agent.start())  # and joins again
        assert {ev.name for ev in agent.membership()._events} == {"m0", "m1", "m2"}
    finally:
        await within(agent.aclose())
    await drain_grpc()


# ----------------------------------------------------------------- etcd ends a watch


async def test_watch_from_a_compacted_revision_ends_at_once(etcd_proc: EtcdProc) -> None:
    """A watch from a revision etcd compacted away ends at once, with the
    compaction as its reason (the loop then lists again). Through aetcd it
    waited for its request timeout first."""
    disc = config(etcd_proc, timeout=8.0)

    class Nobody:
        async def reset(self, members: Any, grace: float = 0.0) -> None: ...
        async def put(self, meta: Any) -> None: ...
        async def deleted(self, name: str) -> None: ...

    session = EtcdSession(disc, "w", 1, Nobody())
    await within(session.open(_meta_json("w", incarnation=1)))
    try:
        async with await _client(etcd_proc) as c:
            for i in range(5):
                put = await c.put(disc.key(f"c{i}").encode(), _meta_json(f"c{i}"))
            await c.compact(int(put.header.revision), physical=True)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="(?i)compact"):
            await within(session._watch_from(2), disc.timeout + STEP)
        took = time.monotonic() - t0
        print(f"\ncompacted watch ended after {took:.3f} s")
        assert took < disc.timeout / 2, f"waited {took:.1f} s (the request timeout)"
    finally:
        await within(session.aclose())
        await drain_grpc()


class WatchCancelProxy:
    """A gRPC proxy to etcd: every method forwarded (raw bytes), the Watch
    streams parsed, and ``cancel()`` sends each open watch a server cancel
    without a compact revision, dropping what etcd sends it afterwards."""

    STREAMS = {"/etcdserverpb.Lease/LeaseKeepAlive"}
    WATCH = "/etcdserverpb.Watch/Watch"

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.queues: list[tuple[asyncio.Queue[Any], set[int], set[int]]] = []
        self.refuse = False  # cancel every watch as soon as it is created
        self.calls: dict[str, int] = {}
        self.cancels = 0

    async def start(self) -> str:
        import grpc
        from aetcd import rpc

        self.channel = grpc.aio.insecure_channel(self.upstream)
        proxy = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                method = details.method
                if method == proxy.WATCH:
                    return grpc.stream_stream_rpc_method_handler(
                        proxy._watch, response_serializer=rpc.WatchResponse.SerializeToString)
                if method in proxy.STREAMS:
                    return grpc.stream_stream_rpc_method_handler(proxy._stream(method))
                return grpc.unary_unary_rpc_method_handler(proxy._unary(method))

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((Handler(),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.channel.close()

    def _unary(self, method: str) -> Any:
        async def forward(request: bytes, context: Any) -> bytes:
            self.calls[method] = self.calls.get(method, 0) + 1
            call = self.channel.unary_unary(method)
            return await call(request, timeout=context.time_remaining(),
                              metadata=context.invocation_metadata())  # type: ignore[no-any-return]
        return forward

    def _stream(self, method: str) -> Any:
        async def forward(requests: Any, context: Any) -> Any:
            async for reply in self.channel.stream_stream(method)(requests):
                yield reply
        return forward

    async def _watch(self, requests: Any, context: Any) -> Any:
        from aetcd import rpc

        queue: asyncio.Queue[Any] = asyncio.Queue()
        ids: set[int] = set()
        cancelled: set[int] = set()
        entry = (queue, ids, cancelled)
        self.queues.append(entry)
        up = self.channel.stream_stream(self.WATCH,
                                        response_deserializer=rpc.WatchResponse.FromString)
        call = up(requests)

        async def pump() -> None:
            try:
                async for resp in call:
                    if resp.created:
                        ids.add(resp.watch_id)
                    await queue.put(resp)
                    if resp.created and self.refuse:
                        self.cancel()
            finally:
                await queue.put(None)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while (resp := await queue.get()) is not None:
                if resp.watch_id in cancelled and not (resp.canceled or resp.created):
                    continue  # etcd would send nothing more on a cancelled watch
                yield resp
        finally:
            self.queues.remove(entry)
            task.cancel()
            call.cancel()

    def cancel(self) -> int:
        from aetcd import rpc

        n = 0
        for queue, ids, cancelled in self.queues:
            for wid in ids - cancelled:
                cancelled.add(wid)
                self.cancels += 1
                queue.put_nowait(rpc.WatchResponse(watch_id=wid, canceled=True,
                                                   cancel_reason="injected by the test"))
                n += 1
        return n


@pytest.fixture
async def watch_proxy(etcd_proc: EtcdProc) -> AsyncIterator[WatchCancelProxy]:
    pytest.importorskip("grpc")
    proxy = WatchCancelProxy(etcd_proc.endpoint)
    proxy.address = await proxy.start()  # type: ignore[attr-defined]
    try:
        yield proxy
    finally:
        await proxy.stop()


async def test_watch_cancelled_by_the_server_lists_again(
    etcd_proc: EtcdProc, watch_proxy: WatchCancelProxy, make_agent: Any
) -> None:
    """etcd cancels our watch (no compact revision: e.g. its permission
    revoked, or a leader lost with require-leader): the agent lists again and
    watches anew. aetcd ignored such a reply: the stream stayed open, no
    event came again, and nobody's joining or leaving was seen."""
    disc = aioxfer.Etcd(watch_proxy.address, prefix="/faults", ttl=TTL,  # type: ignore[attr-defined]
                        timeout=2.0)
    a = await make_agent("a", discovery=disc)
    events = a.membership()
    await wait_until(lambda: watch_proxy.cancel() > 0, STEP, what="a's watch open at the proxy")
    b = await make_agent("b", discovery=config(etcd_proc))
    await next_event(events, is_(PeerJoined, b.name, b.incarnation),
                     what="b's joining, after etcd cancelled a's watch")
    await b.aclose()
    await next_event(events, is_(PeerLeft, b.name), what="b's leaving, on the new watch")



async def test_watch_that_etcd_keeps_cancelling_backs_off(
    etcd_proc: EtcdProc, watch_proxy: WatchCancelProxy, make_agent: Any
) -> None:
    """Every new watch cancelled at once (as a permission etcd keeps refusing
    would): each failure listed the whole prefix again after 0.1 s, since a
    list that succeeded reset the backoff; every agent listed etcd ten times
    a second for as long as it lasted. The backoff now resets only once a
    watch has lived a while."""
    disc = aioxfer.Etcd(watch_proxy.address, prefix="/faults", ttl=TTL,  # type: ignore[attr-defined]
                        timeout=2.0)
    a = await make_agent("a", discovery=disc)
    events = a.membership()
    watch_proxy.refuse = True
    watch_proxy.cancel()
    await wait_until(lambda: watch_proxy.cancels >= 2, STEP, what="a's watches refused")
    ranges = "/etcdserverpb.KV/Range"
    before = watch_proxy.calls.get(ranges, 0)
    # 2 s (was 4 s): past the backoff's growth (two refusals are behind us,
    # the next waits 0.4, 0.8, then ttl / 2 = 1 s): 3 or 4 lists; the bug's
    # list every 0.1 s makes ~20, still twice the bound.
    await asyncio.sleep(2.0)
    lists = watch_proxy.calls.get(ranges, 0) - before
    print(f"\n{lists} lists in 2 s of refused watches")
    assert lists <= 10, f"{lists} lists of the prefix in 2 s"
    watch_proxy.refuse = False
    b = await make_agent("b", discovery=config(etcd_proc))
    await next_event(events, is_(PeerJoined, b.name, b.incarnation),
                     seconds=STEP + TTL, what="b's joining once watches are allowed again")


# ----------------------------------------------------------------- a hung etcd node


def _status(client: str) -> dict[str, Any]:
    req = urllib.request.Request(f"http://{client}/v3/maintenance/status", data=b"{}",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path)
    try:
        yield cluster
    finally:
        for proc in cluster.procs:
            if proc is not None:
                os.kill(proc.pid, signal.SIGCONT)
        cluster.stop()


@pytest.mark.parametrize("publish", [False, True], ids=["idle", "publishing"])
async def test_member_fails_over_from_a_hung_etcd_node_within_its_lease(
    etcd_cluster: EtcdCluster, make_agent: Any, publish: bool
) -> None:
    """The etcd node an agent joined through hangs (SIGSTOP: connections
    accepted, nothing answered; a follower, so that no election renews the
    leases), the other two healthy. Each lease refresh waited the whole
    request timeout (here the ttl) before the agent moved to another node:
    its lease had expired by then, and everyone saw it leave (and its peers
    were dropped). A refresh now gives up after a third of the ttl when
    there is another node to try. Publishing: a region registered just as the
    node hung; the republication held the session's lock (which the
    keepalive needs) for the whole request timeout."""
    ttl, timeout = 3, 3.0
    clients = etcd_cluster.clients
    leader = _status(clients[0])["leader"]
    frozen = next(i for i, c in enumerate(clients) if _status(c)["header"]["member_id"] != leader)
    order = [clients[frozen]] + [c for i, c in enumerate(clients) if i != frozen]
    disc = aioxfer.Etcd(order, prefix="/faults", ttl=ttl, timeout=timeout)
    a = await make_agent("a", discovery=disc)
    session = a._cluster.session
    assert session is not None and session._endpoint == clients[frozen]
    lease = session._lease_id
    b = await make_agent("b", discovery=aioxfer.Etcd(order[1:], prefix="/faults", ttl=ttl,
                                                     timeout=timeout))
    events = b.membership()
    await next_event(events, is_(PeerJoined, a.name, a.incarnation), what="a joined")
    proc = etcd_cluster.procs[frozen]
    assert proc is not None
    await in_thread(sigstop, proc.pid)
    try:
        if publish:
            region = a.register(bytearray(4096), name="late")
        await asyncio.sleep(3 * ttl)
        seen = list(events._events)
        assert not [ev for ev in seen if isinstance(ev, PeerLeft)], (
            f"a's lease expired while two of three etcd nodes were healthy: {seen}")
        assert session._endpoint != clients[frozen]
        assert session._lease_id == lease
        if publish:
            await next_event(events, lambda ev: "late" in getattr(ev, "added", ()),
                             what="a's new region, published through another node")
            a.deregister(region)
    finally:
        os.kill(proc.pid, signal.SIGCONT)

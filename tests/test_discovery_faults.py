"""Discovery under faults, on a real etcd that the tests kill and restart.

Each test here gets an etcd of its own (its own ports and data directory), so
it can be ``kill -9``-ed and restarted, with or without its data, without
disturbing the session's etcd that tests/test_discovery.py shares. Every value
under the prefix is untrusted: hostile ones must be ignored with a log line,
never end the watch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import STEP, sigstop, wait_until, within
from test_discovery import (
    Member,
    _free_ports,
    _healthy,
    etcd_command,
    etcd_env,
    is_,
    next_event,
)

import aioxfer
from aioxfer.discovery import Etcd, PeerJoined, PeerLeft

TTL = 2


class EtcdProc:
    """A single-node etcd on loopback that a test may kill and restart."""

    def __init__(self, root: Path) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.skip("the etcd binary is not installed (Debian: apt-get install etcd-server)")
        pytest.importorskip("aetcd", reason="the aetcd client is not installed")
        self.exe, self.root = exe, root
        self.client_port, self.peer_port = _free_ports(2)
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = etcd_command(self.exe, "faults", self.root / "data", client, peer)
        with open(self.root / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=etcd_env())
        deadline = time.monotonic() + 30
        while not _healthy(client):
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.root / 'etcd.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("etcd not healthy within 30 s")
            time.sleep(0.05)

    def kill(self, wipe: bool = False) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None
        if wipe:
            shutil.rmtree(self.root / "data")


@pytest.fixture
def etcd_proc(tmp_path: Path) -> Iterator[EtcdProc]:
    e = EtcdProc(tmp_path)
    e.start()
    try:
        yield e
    finally:
        if e.proc is not None:
            e.kill()


def config(e: EtcdProc, **kw: Any) -> Etcd:
    return Etcd(e.endpoint, prefix="/faults", ttl=TTL, timeout=kw.pop("timeout", 2.0), **kw)


async def _client(e: EtcdProc) -> Any:
    import aetcd  # type: ignore[import-untyped]

    host, port = e.endpoint.rsplit(":", 1)
    return aetcd.Client(host=host, port=int(port), timeout=STEP)


async def etcd_get(e: EtcdProc, key: str) -> bytes | None:
    async with await _client(e) as c:
        kv = await c.get(key.encode())
    return None if kv is None else bytes(kv.value)


async def etcd_put(e: EtcdProc, key: bytes, value: bytes) -> None:
    async with await _client(e) as c:
        await c.put(key, value)


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def drain_grpc() -> None:
    """For a test without make_agent (which does the same), at its end: gRPC's
    poller thread delivers the completions of the calls a close cancelled a
    moment later; once this test's loop is closed, the next loop to run gRPC
    calls reports each as 'Event loop is closed' (seen failing the next test's
    make_agent teardown)."""
    await asyncio.sleep(0.1)


# ----------------------------------------------------------------- etcd dies


@pytest.mark.parametrize("wipe", [False, True], ids=["restart", "restart-empty"])
async def test_membership_survives_etcd_kill9_and_restart(
    etcd_proc: EtcdProc, make_agent: Any, wipe: bool
) -> None:
    """etcd killed and restarted (with its data, or empty: every lease and key
    lost): members stay registered (re-registering if their lease is gone),
    and the watch goes on reporting joins and leaves."""
    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc)
    b = await make_agent("b", discovery=disc)
    events = a.membership()
    await next_event(events, is_(PeerJoined, b.name, b.incarnation), what="b joined")

    await in_thread(etcd_proc.kill, wipe)
    await asyncio.sleep(1.0)  # the agents notice: keepalives and the watch fail
    await in_thread(etcd_proc.start)

    # Both put themselves back (after a wipe their leases are gone).
    for agent in (a, b):
        await wait_registered(etcd_proc, disc, agent, 3 * STEP)
    # The watch still works: a newcomer is seen, and so is its leaving.
    c = await make_agent("c", discovery=disc)
    await next_event(events, is_(PeerJoined, c.name, c.incarnation), seconds=3 * STEP,
                     what="c joined after the restart")
    c_name, c_inc = c.name, c.incarnation
    await c.aclose()
    await next_event(events, is_(PeerLeft, c_name, c_inc), what="c left after the restart")
    assert a._membership._members.keys() >= {b.name}


async def wait_registered(e: EtcdProc, disc: Etcd, agent: Any, seconds: float) -> None:
    """Until etcd holds ``agent``'s key, in its incarnation."""
    name = getattr(agent, "name", "frozen")
    deadline = time.monotonic() + seconds
    while True:
        try:
            raw = await within(etcd_get(e, disc.key(name)))
        except Exception:
            raw = None
        if raw is not None and str(agent.incarnation).encode() in raw:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} not registered within {seconds} s: {raw!r}")
        await asyncio.sleep(0.1)


# ----------------------------------------------------------------- hostile values


def _meta_json(name: str, **over: Any) -> bytes:
    """An AgentMeta as JSON, with fields overridden by anything (no validation)."""
    import msgspec

    fields: dict[str, Any] = dict(type="meta", version=3, name=name, incarnation=7,
                                  host_id="h", pid=1, address="127.0.0.1:9",
                                  transports=["tcp"], regions=[])
    fields.update(over)
    return msgspec.json.encode(fields)


HOSTILE: dict[str, bytes] = {
    "not-json": b"\xff\xfe\x00garbage",
    "deep": b"[" * 200_000,
    "deep-object": b'{"type":"meta","regions":' + b"[" * 200_000,
    "wrong-type": b'{"type":"meta","name":5}',
    "empty": b"",
    "null": b"null",
    "big-incarnation": _meta_json("big-incarnation", incarnation=1 << 70),
    "negative-incarnation": _meta_json("negative-incarnation", incarnation=-1),
    "other-name": _meta_json("someone-else"),
    "bad-address": _meta_json("bad-address", address="no port here"),
    "bad-port": _meta_json("bad-port", address="127.0.0.1:99999"),
    "empty-address": _meta_json("empty-address", address=""),
    # An address that is a name: connect() resolved it again, and again...
    "self-address": _meta_json("self-address", address="self-address"),
    "plus-port": _meta_json("plus-port", address="plus-port:+1"),
    "nan-pid": b'{"type":"meta","version":3,"name":"nan-pid","incarnation":1,"host_id":"",'
               b'"pid":1e999,"address":"127.0.0.1:1","transports":[],"regions":[]}',
}


async def test_hostile_values_never_end_the_watch(etcd_proc: EtcdProc, make_agent: Any) -> None:
    """Whatever bytes sit under the prefix (at join, or put while watching):
    each is ignored or reported as a member whose connect fails with an
    XferError; the watch goes on and a real newcomer is still seen."""
    disc = config(etcd_proc)
    agents = f"{disc.prefix}/agents/"
    # Some there before anyone joins (the first list), some put while watching.
    items = list(HOSTILE.items())
    for name, value in items[: len(items) // 2]:
        await etcd_put(etcd_proc, (agents + name).encode(), value)
    await etcd_put(etcd_proc, agents.encode() + b"\xff\xfe", b"{}")
    a = await make_agent("a", discovery=disc)
    events = a.membership()
    for name, value in items[len(items) // 2:]:
        await etcd_put(etcd_proc, (agents + name).encode(), value)
    b = await make_agent("b", discovery=disc)
    await next_event(events, is_(PeerJoined, b.name, b.incarnation), what="b joined")
    for name in HOSTILE:
        try:
            await within(a.connect(name))
        except aioxfer.XferError as exc:
            if name == "empty-address":  # not a RecursionError after ~1000 etcd look-ups
                assert isinstance(exc, aioxfer.ProtocolError), exc
            elif name in ("bad-address", "bad-port", "self-address", "plus-port"):
                # Not a host:port address: the value does not decode as
                # AgentMeta (metadata._check_address), so it is ignored with
                # the other malformed values: no such member.
                assert isinstance(exc, aioxfer.PeerLost) and "no agent named" in str(exc), exc
        else:
            raise AssertionError(f"connect({name!r}) succeeded")
    assert (await within(a.connect(b.name))).incarnation == b.incarnation
    # Still watching after all that.
    c = await make_agent("c", discovery=disc)
    await next_event(events, is_(PeerJoined, c.name, c.incarnation), what="c joined")


# ----------------------------------------------------------------- cancellation


async def test_aclose_while_joining_leaves_no_key(etcd_proc: EtcdProc) -> None:
    """An agent closed at any point of its join (here: after 0 to ~60 ms, which
    covers connect, lease, put and list) leaves nothing in etcd: no key that
    the others would see as a member until its lease expired."""
    disc = config(etcd_proc)
    # Enough members that listing them takes a while (the window after our put).
    for i in range(400):
        await etcd_put(etcd_proc, disc.key(f"m{i}").encode(),
                       _meta_json(f"m{i}", regions=[], host_id="x" * 100))
    outcomes = []
    for step in range(40):
        agent = aioxfer.Agent(f"j{step}", discovery=disc)
        start = asyncio.get_running_loop().create_task(agent.start())
        await asyncio.sleep(step * 0.0015)
        await within(agent.aclose())
        try:
            await within(start)
            outcomes.append("joined")
        except (aioxfer.XferError, asyncio.CancelledError):
            outcomes.append("cancelled")
        raw = await etcd_get(etcd_proc, disc.key(agent.name))
        assert raw is None, f"closed at {step * 1.5} ms ({outcomes[-1]}): its key stayed"
    print(f"\n{outcomes.count('cancelled')} closed mid-join, {outcomes.count('joined')} after")
    await drain_grpc()


# ----------------------------------------------------------------- frozen member


async def test_frozen_member_rejoins_after_its_lease_expired(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """A member frozen (SIGSTOP) past its lease: the others see it leave; once
    it runs again it puts itself back under a new lease, the others see it
    join again (same incarnation), and transfers to it work again."""
    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc, transports=("tcp",))
    events = a.membership()
    m = await in_thread(lambda: Member(etcd=disc.endpoints[0], prefix=disc.prefix, ttl=TTL,
                                       name="frozen", transports=("tcp",)))
    try:
        await next_event(events, is_(PeerJoined, "frozen", m.incarnation), what="joined")
        m.kill(signal.SIGSTOP)
        try:
            await next_event(events, is_(PeerLeft, "frozen", m.incarnation),
                             seconds=3 * STEP, what="left (lease expired)")
        finally:
            m.kill(signal.SIGCONT)
        await next_event(events, is_(PeerJoined, "frozen", m.incarnation),
                         seconds=3 * STEP, what="joined again")
        await wait_registered(etcd_proc, disc, m, STEP)
        peer = await within(a.connect("frozen"))
        src = a.register(bytearray(b"x" * 4096))
        await within(a.write(src[0:4096], peer.region("user")[0:4096]))
        # It stays: no second expiry for lack of keepalives on the new lease.
        await asyncio.sleep(2 * TTL)
        await wait_registered(etcd_proc, disc, m, 0)
    finally:
        await m.close()


async def test_join_with_more_than_grpc_default_message_of_members(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """etcd takes values up to 1.5 MiB; a few large ones (many regions, or
    hostile) made the member list larger than gRPC's default 4 MiB message:
    every join, and every re-list after a watch restart, then failed."""
    disc = config(etcd_proc)
    for i in range(4):
        await etcd_put(etcd_proc, disc.key(f"big{i}").encode(),
                       _meta_json(f"big{i}", regions=[
                           {"name": f"region-{j}", "rid": j, "key": 0, "nbytes": 4096,
                            "access": 3, "addr": 0} for j in range(16_000)]))
    for i in range(70):  # and more keys than one page of the list holds
        await etcd_put(etcd_proc, disc.key(f"small{i}").encode(), _meta_json(f"small{i}"))
    a = await make_agent("a", discovery=disc)
    b = await make_agent("b", discovery=disc)
    events = a.membership()
    await next_event(events, is_(PeerJoined, b.name, b.incarnation), what="b joined")
    expected = {f"big{i}" for i in range(4)} | {f"small{i}" for i in range(70)} | {b.name}
    assert {ev.name for ev in a.membership()._events} == expected


async def test_leases_survive_an_etcd_outage(etcd_proc: EtcdProc, make_agent: Any) -> None:
    """etcd down for 10 s, then back with its data: etcd renews every lease for
    one ttl when it comes back, so a member that reaches it again within that
    keeps its lease (and its key: nobody sees it leave). gRPC's reconnect
    backoff had grown to seconds by then (its default tops out at 120 s): the
    member tried again only after its lease had expired, and rejoined."""
    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc)
    assert a._cluster.session is not None
    lease = a._cluster.session._lease_id
    await in_thread(etcd_proc.kill)
    await asyncio.sleep(10.0)
    await in_thread(etcd_proc.start)
    await asyncio.sleep(3 * TTL)
    await wait_registered(etcd_proc, disc, a, STEP)
    assert a._cluster.session._lease_id == lease, "our lease expired after etcd came back"
    async with await _client(etcd_proc) as c:
        kv = await c.get(disc.key(a.name).encode())
    assert kv is not None and int(kv.lease) == lease


# ----------------------------------------------------------------- the watch loop


class FlakyListener:
    """A MemberListener (what EtcdSession reports to) whose first put and
    first reset raise; reset raises midway, after taking its first member."""

    def __init__(self) -> None:
        self.members: dict[str, Any] = {}
        self.fail_put = self.fail_reset = 1

    async def reset(self, members: dict[str, Any], grace: float = 0.0) -> None:
        for name in [n for n in self.members if n not in members]:
            del self.members[name]
        for i, name in enumerate(sorted(members)):
            if i == 1 and self.fail_reset:
                self.fail_reset -= 1
                raise RuntimeError("reset failed midway")
            self.members[name] = members[name]

    async def put(self, meta: Any) -> None:
        if self.fail_put:
            self.fail_put -= 1
            raise RuntimeError("put failed")
        self.members[meta.name] = meta

    async def deleted(self, name: str) -> None:
        self.members.pop(name, None)


async def test_relist_whose_reset_fails_midway_lists_again(etcd_proc: EtcdProc) -> None:
    """A re-list (after the watch failed) whose reset raised midway: the session
    took the list's revision before the reset finished, watched on from there,
    and the members the reset had not reached stayed unknown to the listener
    until some later re-list (none came)."""
    from aioxfer.discovery import EtcdSession

    disc = config(etcd_proc)
    listener = FlakyListener()
    session = EtcdSession(disc, "watcher", 1, listener)
    await within(session.open(_meta_json("watcher", incarnation=1)))
    session.start()
    try:
        names = [f"x{i}" for i in range(5)]
        async with await _client(etcd_proc) as c:  # one revision: one watch reply
            await c.transaction(compare=[], success=[
                c.transactions.put(disc.key(n).encode(), _meta_json(n)) for n in names
            ], failure=[])
        await wait_until(lambda: listener.members.keys() >= set(names),
                         what=f"every member known (have {sorted(listener.members)})")
        assert listener.fail_put == listener.fail_reset == 0
    finally:
        await within(session.aclose())
        await drain_grpc()


async def test_frozen_peer_refresh_never_stalls_membership(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """A connected member's key changes (here: a forged PUT) while the member
    is frozen: refreshing its metadata waits up to the peer timeout (60 s
    here). It ran inside the watch loop, so every other membership event (a
    newcomer, the frozen one's own lease expiry) waited as long. Now the
    refresh runs on the side: the newcomer is seen at once, and the frozen
    member's PeerUpdated then PeerLeft come, in that order, when its lease
    expires."""
    import msgspec

    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc, transports=("tcp",), peer_timeout=60.0)
    events = a.membership()
    m = await in_thread(lambda: Member(etcd=disc.endpoints[0], prefix=disc.prefix, ttl=TTL,
                                       name="frozen", transports=("tcp",), peer_timeout=60.0))
    try:
        await next_event(events, is_(PeerJoined, "frozen", m.incarnation), what="joined")
        peer = await within(a.connect("frozen"))
        async with await _client(etcd_proc) as c:
            kv = await c.get(disc.key("frozen").encode())
        meta = msgspec.json.decode(kv.value)
        meta["regions"].append({"name": "forged", "rid": 999, "key": 0, "nbytes": 64,
                                "access": 3, "addr": 0})
        sigstop(m.pid)
        async with await _client(etcd_proc) as c:
            await c.put(disc.key("frozen").encode(), msgspec.json.encode(meta), lease=kv.lease)
        b = await make_agent("b", discovery=disc)
        await next_event(events, is_(PeerJoined, b.name, b.incarnation),
                         what="a newcomer while a frozen peer's refresh waits")
        seen = []
        async with asyncio.timeout(3 * STEP):
            async for ev in events:
                if ev.name == "frozen":
                    seen.append(type(ev).__name__)
                    if isinstance(ev, PeerLeft):
                        break
        assert seen == ["PeerUpdated", "PeerLeft"], seen
        assert peer.lost
    finally:
        m.kill(signal.SIGKILL)
        m.terminate()


# ----------------------------------------------------------------- our own key


async def test_forged_own_key_without_lease_is_taken_back(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """Someone puts our key (our incarnation, another address) with no lease:
    we put it back on our lease, with our value. It was adopted, lease 0 and
    all: our key then outlived us (no lease to expire), and we kept a lease no
    key was on."""
    import msgspec

    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc)
    session = a._cluster.session
    lease = session._lease_id
    key = disc.key(a.name).encode()
    async with await _client(etcd_proc) as c:
        kv = await c.get(key)
        forged = msgspec.json.decode(kv.value)
        forged["address"] = "127.0.0.1:1"
        await c.put(key, msgspec.json.encode(forged))  # no lease
    a.register(bytearray(64), name="after")  # a republication meets the forged key too

    async def ours() -> bool:
        async with await _client(etcd_proc) as c:
            kv = await c.get(key)
        if kv is None or int(kv.lease) == 0:
            return False
        meta = msgspec.json.decode(kv.value)
        return (int(kv.lease) == session._lease_id
                and meta["address"] == a.address
                and [r["name"] for r in meta["regions"]] == ["after"])

    deadline = time.monotonic() + STEP
    while not await ours():
        assert time.monotonic() < deadline, (
            f"our key not taken back: lease {session._lease_id:#x} (was {lease:#x}), "
            f"etcd holds {await etcd_get(etcd_proc, disc.key(a.name))!r}")
        await asyncio.sleep(0.05)
    await a.aclose()  # revoking our lease takes the key along
    assert await etcd_get(etcd_proc, disc.key(a.name)) is None


# ----------------------------------------------------------------- cancelled start


async def test_cancelled_start_leaves_nothing_joined(etcd_proc: EtcdProc) -> None:
    """An explicitly awaited start() cancelled at any point of its join: the
    join stops with it (no key in etcd, nothing joined) and a later start()
    joins. The join went on in the background after the cancellation."""
    disc = config(etcd_proc)
    for i in range(400):  # listing them takes a while: the window after our put
        await etcd_put(etcd_proc, disc.key(f"m{i}").encode(),
                       _meta_json(f"m{i}", regions=[], host_id="x" * 100))
    outcomes = []
    for step in range(30):
        agent = aioxfer.Agent(f"s{step}", discovery=disc)
        try:
            start = asyncio.get_running_loop().create_task(agent.start())
            await asyncio.sleep(step * 0.0015)
            start.cancel()
            try:
                await within(start)
                outcomes.append("joined")
                continue
            except asyncio.CancelledError:
                outcomes.append("cancelled")
            joining = agent._cluster.joining
            if joining is not None:  # what a join left running would do meanwhile
                await within(asyncio.wait([joining]))
            raw = await etcd_get(etcd_proc, disc.key(agent.name))
            assert raw is None, f"cancelled at {step * 1.5} ms: its key is in etcd"
            assert agent._cluster.session is None
            await within(agent.start())  # joins now
            assert await etcd_get(etcd_proc, disc.key(agent.name)) is not None
        finally:
            await within(agent.aclose())
        assert await etcd_get(etcd_proc, disc.key(agent.name)) is None
    print(f"\n{outcomes.count('cancelled')} cancelled mid-join, {outcomes.count('joined')} after")
    assert "cancelled" in outcomes
    await drain_grpc()


# ----------------------------------------------------------------- an etcd cluster


class EtcdCluster:
    """Three etcd members on loopback, each of which a test may kill."""

    def __init__(self, root: Path, n: int = 3) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.skip("the etcd binary is not installed (Debian: apt-get install etcd-server)")
        pytest.importorskip("aetcd", reason="the aetcd client is not installed")
        ports = _free_ports(2 * n)
        self.clients = [f"127.0.0.1:{p}" for p in ports[:n]]
        peers = [f"http://127.0.0.1:{p}" for p in ports[n:]]
        initial = ",".join(f"n{i}={peer}" for i, peer in enumerate(peers))
        env = etcd_env()
        self.procs: list[subprocess.Popen[bytes] | None] = []
        for i, (client, peer) in enumerate(zip(self.clients, peers, strict=True)):
            cmd = etcd_command(exe, f"n{i}", root / f"data{i}", f"http://{client}", peer,
                               initial=initial, heartbeat_ms=20)
            with open(root / f"etcd{i}.log", "ab") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                   env=env))
        deadline = time.monotonic() + 30
        for client in self.clients:
            while not _healthy(f"http://{client}"):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("etcd cluster not healthy within 30 s")
                time.sleep(0.05)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.procs[i] = None

    def stop(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None:
                self.kill(i)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()


async def test_member_fails_over_when_its_etcd_node_dies(
    etcd_cluster: EtcdCluster, make_agent: Any
) -> None:
    """kill -9 of the etcd member an agent joined through, the other two
    healthy: the agent moves to one of them, keeps its lease and key, and its
    watch goes on. It kept retrying the dead one: its lease expired, the others
    saw it leave, and it saw nobody join any more."""
    disc = Etcd(etcd_cluster.clients, prefix="/faults", ttl=TTL, timeout=2.0)
    a = await make_agent("a", discovery=disc)
    session = a._cluster.session
    assert session is not None and session._endpoint == etcd_cluster.clients[0]
    lease = session._lease_id
    events = a.membership()
    await in_thread(etcd_cluster.kill, 0)
    await asyncio.sleep(3 * TTL)
    others = Etcd(etcd_cluster.clients[1:], prefix="/faults", ttl=TTL, timeout=2.0)
    b = await make_agent("b", discovery=others)
    await next_event(events, is_(PeerJoined, b.name, b.incarnation),
                     what="a newcomer, seen through another etcd member")
    import aetcd

    host, port = etcd_cluster.clients[1].rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=STEP) as c:
        kv = await c.get(disc.key(a.name).encode())
    assert kv is not None and int(kv.lease) == lease == session._lease_id, (
        "our lease expired while the rest of the etcd cluster was up")


async def test_start_again_after_a_failed_join_joins(etcd_proc: EtcdProc) -> None:
    """start() failed (etcd down), etcd came back: start() again joins. It
    raised the first join's error for ever (and connect(name) with it)."""
    disc = config(etcd_proc, timeout=1.0)
    await in_thread(etcd_proc.kill)
    agent = aioxfer.Agent("late", discovery=disc)
    try:
        with pytest.raises(aioxfer.TransportError, match="cannot join"):
            await within(agent.start())
        await in_thread(etcd_proc.start)
        await within(agent.start())
        await wait_registered(etcd_proc, disc, agent, STEP)
        peer_etcd = await etcd_get(etcd_proc, disc.key(agent.name))
        assert peer_etcd is not None
    finally:
        await within(agent.aclose())
    assert await etcd_get(etcd_proc, disc.key(agent.name)) is None
    await drain_grpc()


async def test_bad_value_on_a_members_key_is_its_leaving(
    etcd_proc: EtcdProc, make_agent: Any
) -> None:
    """A member's key overwritten with a value that is no AgentMeta (and on no
    lease): a list skips it, so a newcomer does not see that member; the
    watchers did keep it, for ever, since that key then never expires and the
    member's real leaving (here: its aclose) deletes nothing."""
    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc)
    b = await make_agent("b", discovery=disc)
    events = a.membership()
    await next_event(events, is_(PeerJoined, b.name, b.incarnation), what="b joined")
    await etcd_put(etcd_proc, disc.key(b.name).encode(), HOSTILE["wrong-type"])
    b_name, b_inc = b.name, b.incarnation
    await b.aclose()
    await next_event(events, is_(PeerLeft, b_name, b_inc), what="b's leaving")
    assert b_name not in a._membership._members
    c = await make_agent("c", discovery=disc)
    assert b_name not in c._membership._members  # what a list says

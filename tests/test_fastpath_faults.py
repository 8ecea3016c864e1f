"""Faults aimed at the latency fast paths (tcp's lone-request halves, the
receiver's read-ahead, the await's polling of a lone request).

Each fast path is a place where the fault contract could slip: a peer that
dies, a link that drops, a deregistered region, a cancelled await or a
malformed frame must still end every pending transfer promptly with a typed
error, leak nothing and corrupt nothing. Everything here runs on real
processes, sockets and (for the link) network namespaces.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from typing import Any

import netns
import numpy as np
import pytest
from conftest import digest, pattern, queued_conns, sigstop, tcp_victim, wait_until, within
from test_security import HDR, MAGIC, data_connection, frame, region_meta

import aioxfer
from aioxfer import PeerLost, _cyx

MiB = 1 << 20
F_WRITE, F_WRITE_ACK, F_READ_REQ, F_READ_RESP, F_PING, F_REVOKE, F_REVOKE_ACK = 1, 2, 3, 4, 7, 8, 9


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ------------------------------------------------- a peer killed under the halves


@pytest.mark.parametrize("op", ["write", "read"])
async def test_peer_killed_with_both_halves_in_flight(make_agent, remote_agent, op: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone 1 MiB request goes as two 512 KiB halves on two connections
    (over loopback a lone WRITE goes whole since tcp19, tcp.c tcp_chunk: the
    halves are those of connections without the loopback setting, hence
    AIOXFER_TCP_LOOPBACK_CC=0 here, on both agents);
    the peer is stopped (so both halves stay in flight, seen in its receive
    queues) and then SIGKILLed: the request fails with PeerLost within a
    bound, nothing stays in flight, the connections' fds are closed, and a
    new peer at once gets the same request right."""
    monkeypatch.setenv("AIOXFER_TCP_LOOPBACK_CC", "0")  # read when an engine is made
    data = pattern(MiB, seed=5)
    v = await tcp_victim(make_agent, remote_agent, data.copy())
    init, buf, fds0, ra = v.init, v.buf, v.fds0, v.ra
    remote = v.peer.region("user")
    if op == "write":
        post = init.write
        need = 32 << 10  # a half's payload arriving
    else:
        post = init.read
        need = HDR.size  # a half's request frame
    # Both halves reach the stopped peer, each on its own connection.
    await v.kill_under(lambda: post(buf[0:MiB], remote[0:MiB]),
                       lambda: queued_conns(v.port, need) >= 2,
                       f"two halves of the lone {op} queued at the stopped peer")
    await wait_until(lambda: init.statistics().native_conns == 0, 10, what="connections closed")
    await wait_until(lambda: _fds() <= fds0, 10, what=f"fds back to {fds0} (now {_fds()})")
    assert init.statistics().native_regions == v.regions0
    ra.terminate()
    # The agent is fine: a new peer gets the same lone request, whole.
    ra2 = await remote_agent(size=2 * MiB, transports=("tcp",))
    peer2 = await within(init.connect(ra2.address))
    if op == "write":
        res = await within(init.write(buf[0:MiB], peer2.region("user")[0:MiB]))
        assert await ra2.call("digest", "user", 0, MiB) == digest(data)
    else:
        await ra2.call("fill", "user", 0, MiB, 6)
        buf.numpy()[:] = 0
        res = await within(init.read(buf[0:MiB], peer2.region("user")[0:MiB]))
        assert digest(buf.memoryview) == digest(pattern(MiB, seed=6))
    assert res.nbytes == MiB


# ------------------------------------------------- a same-host peer killed under inline copies


@pytest.mark.parametrize("region", ["user", "pool"])
@pytest.mark.parametrize("size", ["64KiB", "inline_max"])
async def test_same_host_peer_killed_under_lone_inline_writes(make_agent, remote_agent,
                                                              region: str, size: str) -> None:
    """Lone awaited shm writes within inline_bytes are copied inside the post
    on the posting thread (from 2 MiB shared with the copy workers and
    waited for there), into the peer's plain memory (cross-memory attach) or
    its memfd pool (our mapping). The peer is SIGKILLed while they go on:
    each write completes or fails with PeerLost, the failure comes within a
    bound of the kill, the loop never blocks, and nothing is left in flight."""
    ra = await remote_agent(size=4 * MiB)
    init = await make_agent("init")
    nbytes = 64 << 10 if size == "64KiB" else min(init.inline_bytes, 2 * MiB)
    src = init.register(pattern(nbytes, seed=13))
    peer = await within(init.connect(ra.address))
    assert peer.path == "shm"
    dst = peer.region(region)[0:nbytes]
    for _ in range(5):
        await within(init.write(src[0:nbytes], dst))
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        ra.kill(signal.SIGKILL)

    killer = threading.Timer(0.05, kill)
    killer.start()
    ok = 0
    t0 = time.monotonic()
    try:
        while True:
            try:
                await within(init.write(src[0:nbytes], dst), 5)
                ok += 1
            except PeerLost:
                # The loss is reported before the transfer that found it
                # fails: a caller woken by that failure sees the peer lost.
                assert peer.lost, "a write failed with PeerLost, the peer not lost"
                break
            await asyncio.sleep(0)  # the loop's other callbacks (the peer's loss) run
            assert time.monotonic() - t0 < 30, "writes still succeed long after the kill"
    finally:
        killer.join()
    assert killed  # (ok may be 0: on a loaded machine the kill can come first)
    assert time.monotonic() - killed[0] < 5, "PeerLost only long after the kill"
    await wait_until(lambda: init.statistics().in_flight == 0
                     and init.statistics().native_ops == 0, 10, what="nothing in flight")
    with pytest.raises(PeerLost):
        await within(init.write(src[0:nbytes], dst))
    ra.terminate()


# ------------------------------------------------- a cancelled, polled await


def _cancel_when(started: threading.Event, loop: asyncio.AbstractEventLoop,
                 task: asyncio.Task[None]) -> None:
    started.wait(5)
    time.sleep(0.002)  # the poll (at most ALONE_MAX_US) is under way or over
    loop.call_soon_threadsafe(task.cancel)


async def test_cancel_of_a_polled_lone_await_leaves_nothing(make_agent, remote_agent) -> None:
    """A lone 1 MiB write awaited alone is polled for inside its await
    (spin_alone); the peer is stopped, so the poll runs out and the await
    suspends; the awaiting task is cancelled from another thread while it
    polls. CancelledError comes at once although the peer is stopped; once
    the peer runs again nothing is left in flight, no slot leaked, and the
    next lone transfers complete right."""
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        pytest.skip("a lone await is polled (spin_alone) on asyncio's loop only")
    ra = await remote_agent(size=2 * MiB, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",), keepalive=30.0, peer_timeout=120.0)
    data = pattern(MiB, seed=7)
    buf = init.register(data.copy(), name="src")
    peer = await within(init.connect(ra.address))
    remote = peer.region("user")
    for _ in range(8):  # the peer's latency average: the poll's bound
        await within(init.write(buf[0:MiB], remote[0:MiB]))
    poller = init._poller
    assert poller is not None
    loop = asyncio.get_running_loop()
    polled = 0
    for round_ in range(4):
        # Two at once: the loop's poll callback runs, which lets the next
        # lone await poll again (spin_alone's span since the loop last ran).
        await within(asyncio.gather(init.write(buf[0:MiB], remote[0:MiB]),
                                    init.write(buf[0:MiB], remote[0:MiB])))
        misses = poller.alone_misses
        sigstop(ra.pid)
        try:
            started = threading.Event()

            async def lone(started: threading.Event = started) -> None:
                started.set()
                await init.write(buf[0:MiB], remote[0:MiB])

            task = loop.create_task(lone())
            # The cancel comes from another thread while the task's first
            # step (post, then poll) runs or right after; the task sees it
            # once its await suspended.
            canceller = threading.Thread(target=_cancel_when, args=(started, loop, task))
            canceller.start()
            with pytest.raises(asyncio.CancelledError):
                await within(task, 5)
            canceller.join()
            polled += poller.alone_misses > misses
            assert init.statistics().in_flight <= 1  # the cancelled one, until confirmed
        finally:
            os.kill(ra.pid, signal.SIGCONT)
        await wait_until(lambda: init.statistics().in_flight == 0
                         and init.statistics().native_ops == 0
                         and peer.statistics().in_flight == 0, 10,
                         what=f"round {round_}: the cancelled write settled")
        ps = peer.statistics()
        assert ps.in_flight_bytes == 0 and ps.queued == 0, ps
        assert ps.transfers_posted == ps.transfers_completed + ps.transfers_failed, ps
        assert not peer.lost
        # The next ones work, and the cancelled write did not leave bytes of
        # its own behind (it wrote the same data, or nothing).
        await ra.call("zero", "user")
        for _ in range(3):
            res = await within(init.write(buf[0:MiB], remote[0:MiB]))
            assert res.nbytes == MiB
        assert await ra.call("digest", "user", 0, MiB) == digest(data)
    assert polled, "no lone await was polled before its cancel"
    s = init.statistics()
    assert s.in_flight == 0 and s.native_ops == 0


# ------------------------------------------------- a link dropped under a polled lone await

PEER_TIMEOUT = 1.0
KEEPALIVE = 0.2
SLACK = 3.0  # command round trips and scheduling on a loaded 2-core box


@pytest.mark.parametrize("nbytes", [MiB, 4096], ids=["1MiB-halves", "4KiB"])
async def test_link_down_under_a_lone_polled_await(nbytes: int) -> None:
    """Two namespaces, one veth rail, two tcp connections on it; the
    initiator's lone awaited writes (polled for in their await, a 1 MiB one
    as two halves on the two connections) go on while the link is taken
    down: the write in flight then fails with PeerLost within the
    peer_timeout bound (not a hang, not a spin), the agent leaks nothing, and
    once the link is back a new connection carries the same writes again,
    data checked."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    opts = {"transports": ("tcp",), "peer_timeout": PEER_TIMEOUT, "keepalive": KEEPALIVE,
            "tcp_connections": 2}
    with netns.rails(1, prefix="10.78") as net:
        rail = net.rail(1)
        agents: list[netns.NsAgent] = []
        try:
            target, init = await asyncio.gather(
                netns.NsAgent.start(net, "a", "target", listen=f"{rail.addr_a}:7100", **opts),
                netns.NsAgent.start(net, "b", "init", listen=f"{rail.addr_b}:0", **opts))
            agents += [target, init]
            await asyncio.gather(target.call("alloc", "dst", 2 * MiB),
                                 init.call("alloc", "src", 2 * MiB, 3))
            await init.call("connect", target.address, timeout=20)
            for _ in range(20):  # the peer's latency average: the await's poll bound
                assert await init.call("write", target.address, "src", 0, "dst", 0,
                                       nbytes) == ("ok", "tcp")
            # Writes one after the other, the link taken down meanwhile.
            results: list[tuple[float, tuple[str, str]]] = []

            async def writes() -> None:
                while True:
                    r = await init.call("write", target.address, "src", 0, "dst", 0, nbytes,
                                        timeout=PEER_TIMEOUT + KEEPALIVE + 30)
                    results.append((time.monotonic(), tuple(r)))
                    if r[0] != "ok":
                        return

            task = asyncio.get_running_loop().create_task(writes())
            await asyncio.sleep(0.2)
            t_down = time.monotonic()
            net.link_down(1, "b")
            await within(task, PEER_TIMEOUT + KEEPALIVE + 30)
            t_end, last = results[-1]
            assert last[0] == "PeerLost", results[-3:]
            print(f"\n{nbytes} B lone writes: {len(results) - 1} completed, then PeerLost "
                  f"{t_end - t_down:.3f} s after the link went down")
            assert t_end - t_down <= PEER_TIMEOUT + KEEPALIVE + SLACK, (
                f"the await ended {t_end - t_down:.2f} s after the link went down")
            assert await init.call("peer_lost", target.address)
            st = await init.call("stats")
            assert st["in_flight"] == 0 and st["native_ops"] == 0, st
            # Back up: a new connection carries the same lone writes, whole.
            net.link_up(1, "b")
            await target.call("alloc", "dst2", 2 * MiB)

            async def reconnect() -> None:
                while True:
                    try:
                        await init.call("connect", target.address, timeout=20)
                        return
                    except netns.WorkerError:
                        await asyncio.sleep(0.2)  # the target may not know the old one gone

            await within(reconnect(), 30)
            for _ in range(5):
                assert await init.call("write", target.address, "src", 0, "dst2", 0,
                                       nbytes) == ("ok", "tcp")
            assert (await target.call("digest", "dst2", 0, nbytes)
                    == await init.call("digest", "src", 0, nbytes))
        finally:
            finals = await netns.close_all(agents)
        netns.assert_closed_clean(agents, finals)
    assert not netns.leftover_namespaces()


# ------------------------------------------------- deregistered under queued READ responses


def _parse(stream: bytearray) -> list[tuple[tuple[Any, ...], bytes]]:
    """Whole frames a target sent at the start of ``stream`` (consumed):
    only a READ response carries a payload (a WRITE_ACK's len is the bytes
    it acknowledges)."""
    out = []
    while len(stream) >= HDR.size:
        h = HDR.unpack_from(stream)
        n = h[10] if h[1] == F_READ_RESP else 0
        if len(stream) < HDR.size + n:
            break
        out.append((h, bytes(stream[HDR.size:HDR.size + n])))
        del stream[:HDR.size + n]
    return out


async def test_deregister_waits_for_queued_read_responses(make_agent) -> None:
    """A client sends 24 READ requests of 1 MiB back to back (the target's
    receiver takes them from its read-ahead and queues the responses), reads
    nothing, and acknowledges the region's revocation at once. The
    deregistration must not complete while responses pointing into the
    region are still queued: the memory is overwritten the moment it does,
    and every response byte the client then reads must be the region's
    original content."""
    target = await make_agent("target", peer_timeout=60.0)
    size = 4 * MiB
    data = pattern(size, seed=9)
    mem = bytearray(data.tobytes())
    region = target.register(mem, name="src")
    m = await region_meta(target.address, "src")
    loop = asyncio.get_running_loop()
    nreq = 24
    sock = await data_connection(target.address)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    with sock:
        reqs = b"".join(frame(F_READ_REQ, op=i + 1, rid=m.rid, key=m.key,
                              off=(i % 4) * MiB, length=MiB) for i in range(nreq))
        await loop.sock_sendall(sock, reqs)
        await asyncio.sleep(0.3)  # the target read them and queued what it could not send
        released = target.deregister(region)
        overwritten = []

        def overwrite(_: Any) -> None:  # the moment the agent says the memory is free
            mem[:] = b"\xee" * size
            overwritten.append(time.monotonic())

        released.add_done_callback(overwrite)
        # Acknowledged without reading the REVOKE (it waits behind the responses).
        await loop.sock_sendall(sock, frame(F_REVOKE_ACK, op=0, flags=0, rid=m.rid, key=m.key))
        await asyncio.sleep(0.5)
        assert not released.done(), "deregistered while READ responses into it were queued"
        stream = bytearray()
        got: list[tuple[tuple[Any, ...], bytes]] = []
        async with asyncio.timeout(30):
            while sum(h[1] == F_READ_RESP for h, _ in got) < nreq:
                chunk = await loop.sock_recv(sock, 1 << 16)
                assert chunk, "target closed the connection"
                stream += chunk
                got += _parse(stream)
        await within(released, 10)
    # (the callback runs in a later loop iteration when released was done
    # before this awaited it)
    await wait_until(lambda: bool(overwritten), what="the overwrite at release")
    resps = [(h, p) for h, p in got if h[1] == F_READ_RESP]
    assert [h[5] for h, _ in resps] == list(range(1, nreq + 1))
    src = data.tobytes()
    for h, payload in resps:
        assert h[3] == _cyx.OK and len(payload) == MiB, h
        off = h[9]
        assert payload == src[off:off + MiB], f"response {h[5]} carried bytes of freed memory"
    assert target.statistics().native_regions == 0


# ------------------------------------------------- a malformed frame behind a valid one


@pytest.mark.parametrize("bad", ["bad-magic", "bad-type", "oversized", "interleaved",
                                 "aborted-with-payload"])
async def test_malformed_frame_behind_valid_ones_in_one_segment(make_agent, capsys,
                                                                bad: str) -> None:
    """Valid frames and then a malformed one arrive in one segment (the
    receiver parses the later ones out of its read-ahead buffer): the valid
    ones take effect and are answered, the malformed one closes that
    connection only, with a logged reason; an honest peer's stream of
    transfers keeps completing throughout."""
    target = await make_agent("target")
    dst = target.alloc(MiB, name="dst")
    dst.numpy()[:] = 0
    honest = await make_agent("honest", transports=("tcp",))
    hpeer = await within(honest.connect(target.address))
    hdata = pattern(64 << 10, seed=11)
    hsrc = honest.register(hdata.copy())
    done = {"ok": 0, "failed": 0}
    stop = asyncio.Event()

    async def honest_stream() -> None:
        while not stop.is_set():
            try:
                await honest.write(hsrc[0:64 << 10], hdst)
                done["ok"] += 1
            except aioxfer.XferError:
                done["failed"] += 1
            await asyncio.sleep(0)

    hdst = hpeer.region("dst")[MiB // 2:MiB // 2 + (64 << 10)]
    stream_task = asyncio.get_running_loop().create_task(honest_stream())
    m = await region_meta(target.address, "dst")
    rejected0 = target.statistics().frames_rejected
    loop = asyncio.get_running_loop()
    sock = await data_connection(target.address)
    try:
        good = (frame(F_WRITE, op=1, rid=m.rid, key=m.key, off=8, length=4) + b"GOOD"
                + frame(F_READ_REQ, op=2, rid=m.rid, key=m.key, off=8, length=4))
        tail = {
            "bad-magic": frame(F_READ_REQ, op=3, rid=m.rid, key=m.key, length=4, magic=0xBAD),
            "bad-type": frame(42, op=3),
            "oversized": frame(F_WRITE, op=3, rid=m.rid, key=m.key, length=1 << 40),
            # a first WRITE frame (not LAST) of op 3, then one of op 4
            "interleaved": frame(F_WRITE, op=3, flags=0, rid=m.rid, key=m.key, off=100,
                                 length=4) + b"AAAA"
            + frame(F_WRITE, op=4, rid=m.rid, key=m.key, off=200, length=4) + b"BBBB",
            "aborted-with-payload": frame(F_WRITE, op=3, flags=3, rid=m.rid, key=m.key,
                                          length=4) + b"CCCC",
        }[bad]
        await loop.sock_sendall(sock, good + tail)
        # Until the close: only keepalives and the valid frames' answers
        # (each right, if it came: answers still queued when a connection is
        # closed for a malformed frame are dropped with it).
        stream = bytearray()
        async with asyncio.timeout(10):
            while True:
                try:
                    b = await loop.sock_recv(sock, 65536)
                except (ConnectionResetError, BrokenPipeError):
                    break
                if not b:
                    break
                stream += b
        frames = _parse(stream)
        assert not stream, f"a partial frame before the close: {bytes(stream)!r}"
        for h, payload in frames:
            assert h[0] == MAGIC
            assert (h[1] == F_PING
                    or (h[1] == F_WRITE_ACK and h[5] == 1 and h[3] == _cyx.OK)
                    or (h[1] == F_READ_RESP and h[5] == 2 and h[3] == _cyx.OK
                        and payload == b"GOOD")), (h, payload)
    finally:
        sock.close()
    await wait_until(lambda: target.statistics().frames_rejected > rejected0,
                     what="frame rejected")
    assert bytes(dst.memoryview[8:12]) == b"GOOD"
    if bad == "interleaved":
        assert bytes(dst.memoryview[200:204]) != b"BBBB"  # the frame after the fault
    ok0 = done["ok"]
    await wait_until(lambda: done["ok"] >= ok0 + 20, what="the honest stream goes on")
    stop.set()
    await within(stream_task)
    assert done["failed"] == 0 and not hpeer.lost
    assert np.array_equal(dst.numpy()[MiB // 2:MiB // 2 + (64 << 10)], hdata)
    err: list[str] = []
    await wait_until(lambda: (err.append(capsys.readouterr().err) or "malformed" in "".join(err)),
                     what="the rejected frame's reason logged")


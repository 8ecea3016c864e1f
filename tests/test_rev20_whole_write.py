"""rev20: the loopback data path of tcp19/tcp19b under faults.

Since tcp19 a lone WRITE of up to 1 MiB over loopback connections (reno)
goes whole on one connection (tcp.c tcp_chunk), and since tcp19b the thread
awaiting it reads its 1 MiB acknowledgement itself, the connection's
receiver parked meanwhile (conn.c help_ack, help_read, rx_park). The fault
tests before them (test_fastpath_faults) turned that path off
(AIOXFER_TCP_LOOPBACK_CC=0) and test_tcp19_loopback kills the whole peer
only: here one connection of four is cut (the kernel's SOCK_DESTROY through
``ss -K``: an RST to both ends, as a link reset would) while the whole
WRITE is in flight on it, at random moments of a stream of 1 MiB WRITEs
awaited one at a time (the receivers parked for the awaiting thread), and a
whole WRITE at a stopped peer is cancelled. Real processes: the target is a
spawned agent; bytes are checked at the target.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from conftest import digest, sigstop, wait_until, within

MiB = 1 << 20



def _ss_kills() -> bool:
    """Whether ss -K resets a loopback connection here (root, and a kernel
    with INET_DIAG_DESTROY)."""
    if shutil.which("ss") is None or os.geteuid() != 0:
        return False
    import socket

    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c:
            a, _ = lst.accept()
            with a:
                subprocess.run(["ss", "-K", "-t", "state", "established",
                                f"( sport = :{port} )"], capture_output=True, timeout=10)
                c.settimeout(5)
                try:
                    return c.recv(1) == b""
                except TimeoutError:  # still there: not killed
                    return False
                except OSError:  # reset
                    return True


pytestmark = pytest.mark.skipif(
    not _ss_kills(),
    reason="cuts one connection with ss -K (SOCK_DESTROY: root, INET_DIAG_DESTROY)")


def target_conns(port: int) -> dict[int, int]:
    """The target's established data connections (local port ``port``): the
    initiator's port of each -> bytes unread in the target's receive queue."""
    out = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            lport = int(cols[1].rsplit(":", 1)[1], 16)
            rport = int(cols[2].rsplit(":", 1)[1], 16)
            if cols[3] == "01" and lport == port:
                out[rport] = int(cols[4].split(":")[1], 16)
    return out


def cut(port: int, rport: int) -> None:
    """Resets one connection at both ends (SOCK_DESTROY on the target's side)."""
    subprocess.run(["ss", "-K", "-t", "state", "established",
                    f"( sport = :{port} and dport = :{rport} )"],
                   check=True, capture_output=True, timeout=10)
    assert rport not in target_conns(port), "ss -K left the connection"


class Src:
    """A registered 1 MiB source: its bytes (mem) and its region (reg)."""

    def __init__(self, init: Any) -> None:
        self.mem = bytearray(MiB)
        self.reg = init.register(self.mem, name="src")

    def fill(self, seed: int) -> bytes:
        data = random.Random(seed).randbytes(MiB)
        self.mem[:] = data
        return data


async def setup(make_agent: Any, remote_agent: Any) -> tuple[Any, Any, Any, Src, int]:
    ra = await remote_agent(size=2 * MiB, transports=("tcp",))
    port = int(ra.address.rsplit(":", 1)[1])
    # The peer is stopped for a while in these tests: no keepalive verdict
    # meanwhile (the cut is what fails a connection here).
    init = await make_agent("init", transports=("tcp",), keepalive=30.0, peer_timeout=120.0)
    buf = Src(init)
    peer = await within(init.connect(ra.address))
    await wait_until(lambda: peer.statistics().rails[0].connections == 4, 10, what="the joins")
    await within(init.write(buf.reg[0:4096], peer.region("user")[0:4096]))  # warm
    return ra, init, peer, buf, port


async def write_checked(init: Any, peer: Any, ra: Any, buf: Src, seed: int) -> None:
    data = buf.fill(seed)
    res = await within(init.write(buf.reg[0:MiB], peer.region("user")[0:MiB]), 10)
    assert res.nbytes == MiB
    assert await ra.call("digest", "user", 0, MiB) == digest(data), f"write {seed}"


async def test_whole_write_moves_off_its_cut_connection(make_agent: Any,
                                                       remote_agent: Any) -> None:
    """The whole 1 MiB WRITE queued at a stopped peer on one connection; that
    connection is reset: the WRITE goes again on another connection and
    completes with every byte at the target, three times (down to the last
    connection), and the one left carries the next WRITE."""
    ra, init, peer, buf, port = await setup(make_agent, remote_agent)
    for k in range(3):
        await write_checked(init, peer, ra, buf, 100 + k)  # replies read by this thread
        data = buf.fill(k)
        sigstop(ra.pid)
        try:
            t = init.write(buf.reg[0:MiB], peer.region("user")[0:MiB])
            await wait_until(lambda: any(q >= 32 << 10 for q in target_conns(port).values()),
                             10, what="the WRITE queued")
            loaded = [rp for rp, q in target_conns(port).items() if q >= 32 << 10]
            assert len(loaded) == 1, loaded  # whole, on one connection
            cut(port, loaded[0])
            await asyncio.sleep(0.05)
        finally:
            os.kill(ra.pid, signal.SIGCONT)
        res = await within(t, 10)
        assert res.nbytes == MiB
        assert await ra.call("digest", "user", 0, MiB) == digest(data), f"round {k}"
        await wait_until(lambda k=k: peer.statistics().rails[0].connections == 3 - k, 10,
                         what="the cut connection gone")
    assert peer.statistics().reroutes >= 3
    await write_checked(init, peer, ra, buf, 200)
    await wait_until(lambda: init.statistics().in_flight == 0
                     and init.statistics().native_ops == 0, 10, what="nothing in flight")


async def test_cuts_at_random_moments_of_awaited_whole_writes(make_agent: Any,
                                                               remote_agent: Any) -> None:
    """1 MiB WRITEs awaited one at a time (each whole on one connection, its
    ack read by the awaiting thread while that connection's receiver is
    parked), a thread resetting the busiest connection at random moments,
    three times: every WRITE completes (moved to another connection when its
    own was cut) with the bytes it wrote at the target, within a bound."""
    ra, init, peer, buf, port = await setup(make_agent, remote_agent)
    rng = random.Random(20)
    stop = threading.Event()
    cuts: list[int] = []

    def cutter() -> None:
        while len(cuts) < 3 and not stop.is_set():
            time.sleep(rng.uniform(0.02, 0.15))
            conns = target_conns(port)
            if len(conns) < 2:
                return
            busiest = max(conns, key=lambda rp: conns[rp])
            with contextlib.suppress(subprocess.CalledProcessError, AssertionError):
                cut(port, busiest)
                cuts.append(busiest)

    th = threading.Thread(target=cutter, daemon=True)
    th.start()
    try:
        n = 0
        deadline = time.monotonic() + 60
        while (th.is_alive() or n < 20) and time.monotonic() < deadline:
            data = buf.fill(n)
            t0 = time.monotonic()
            res = await within(init.write(buf.reg[0:MiB], peer.region("user")[0:MiB]), 10)
            assert res.nbytes == MiB
            assert time.monotonic() - t0 < 5
            if n % 4 == 0 or not th.is_alive():
                assert await ra.call("digest", "user", 0, MiB) == digest(data), f"write {n}"
            n += 1
    finally:
        stop.set()
        th.join(10)
    assert len(cuts) == 3, cuts
    assert peer.statistics().rails[0].connections == 1
    await write_checked(init, peer, ra, buf, 300)
    await wait_until(lambda: init.statistics().in_flight == 0
                     and init.statistics().native_ops == 0, 10, what="nothing in flight")


@pytest.mark.parametrize("then", ["resume", "kill"])
async def test_cancel_of_a_whole_write_at_a_stopped_peer(make_agent: Any, remote_agent: Any,
                                                          then: str) -> None:
    """A whole 1 MiB WRITE queued at a stopped peer is cancelled: the
    transfer is cancelled for its caller at once, busy until the engine is
    done with it, and settles once the peer resumes (or dies); nothing stays
    in flight, and the connection (or a new peer) carries the next WRITE
    with every byte."""
    ra, init, peer, buf, port = await setup(make_agent, remote_agent)
    await write_checked(init, peer, ra, buf, 1)
    sigstop(ra.pid)
    try:
        t = init.write(buf.reg[0:MiB], peer.region("user")[0:MiB])
        await wait_until(lambda: any(q >= 32 << 10 for q in target_conns(port).values()),
                         10, what="the WRITE queued")
        assert t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(t)
        assert t.busy  # the frame is in the peer's socket: the engine still owns it
        s = t.settled()
        await asyncio.sleep(0.2)
        assert not s.done()
        if then == "kill":
            ra.kill(signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ra.pid, signal.SIGCONT)
    await within(s, 10)
    assert not t.busy
    if then == "kill":
        ra.terminate()
        ra = await remote_agent(size=2 * MiB, transports=("tcp",))
        peer = await within(init.connect(ra.address))
    for k in range(5):
        await write_checked(init, peer, ra, buf, 10 + k)
    await wait_until(lambda: init.statistics().in_flight == 0
                     and init.statistics().native_ops == 0, 10, what="nothing in flight")

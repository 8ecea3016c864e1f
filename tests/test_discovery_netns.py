"""The membership watch across a partition that drops packets silently.

etcd runs in network namespace a (tests/netns.py's Rails, one veth pair to
namespace b), serving clients on the veth and on a's own loopback. The
watching agent runs in b and reaches etcd over the veth; the other members run
in a, on its loopback. The partition drops every packet of the veth inside
the namespaces (nft or iptables when installed; else blackhole routes, which
drop them as silently for an open connection): no reset, no FIN, nothing
reaches either side. The host's rules are never touched.

Without gRPC keepalive the watch read its dead connection for ever (a
stream has no deadline; nothing is sent on it from our side): the agent
never noticed, and learned nothing after the partition healed either, until
TCP gave up on its retransmissions. With it, the agent notices within
keepalive + timeout, lists again once etcd answers, and watches on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from netns import Rails
from test_discovery import etcd_command, etcd_env

TTL = 2
TIMEOUT = 1.0
KEEPALIVE = 1.0  # etcd started with --grpc-keepalive-min-time below it
SLACK = 4.0  # a busy two-core box
PORT = 2379

# A member, in its namespace: joins, prints (JSON lines on stdout) that it
# joined, every membership event and every discovery.* log event, until its
# stdin closes.
CHILD = r"""
import asyncio, json, sys, time
import structlog

def out(**kw):
    kw["t"] = time.monotonic()
    print(json.dumps(kw), flush=True)

def capture(logger, method, ev):
    name = str(ev.get("event", ""))
    if name.startswith("discovery."):
        out(kind="log", event=name, reason=str(ev.get("reason", "")))
    raise structlog.DropEvent

structlog.configure(processors=[capture], cache_logger_on_first_use=False)
import aioxfer
from aioxfer.discovery import Etcd

async def main(name, endpoint, ttl, timeout, keepalive):
    disc = Etcd(endpoint, prefix="/netns", ttl=int(ttl), timeout=float(timeout),
                keepalive=float(keepalive))
    async with aioxfer.Agent(name, discovery=disc) as agent:
        events = agent.membership()
        out(kind="joined", incarnation=agent.incarnation)
        async def follow():
            async for ev in events:
                out(kind=type(ev).__name__, name=ev.name, incarnation=ev.incarnation)
        task = asyncio.get_running_loop().create_task(follow())
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        task.cancel()

asyncio.run(main(*sys.argv[1:]))
"""

HEALTH = r"""
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=1) as r:
    sys.exit(0 if b'"true"' in r.read() else 1)
"""


@pytest.fixture
def net() -> Iterator[Rails]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"netns tests need network namespaces: {reason}")
    if shutil.which("etcd") is None:
        pytest.skip("the etcd binary is not installed (Debian: apt-get install etcd-server)")
    pytest.importorskip("aetcd", reason="the aetcd client is not installed")
    with netns.rails(1, prefix="10.83") as r:
        yield r
    assert not netns.leftover_namespaces(), "namespaces left behind"


class Child:
    """A member process in a namespace; its stdout lines, parsed, in a queue."""

    def __init__(self, net: Rails, side: str, name: str, endpoint: str,
                 keepalive: float = KEEPALIVE) -> None:
        self.name = name
        self.lines: list[dict[str, Any]] = []
        # Its stderr in a file the failure message quotes; run from "/" so
        # that it imports the installed aioxfer, never the checkout's sources
        # (CI installs a wheel: the checkout has no compiled extension).
        self.stderr = tempfile.TemporaryFile()
        self.proc = net.popen(side, [sys.executable, "-c", CHILD, name, endpoint, str(TTL),
                                     str(TIMEOUT), str(keepalive)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=self.stderr, cwd="/")
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-2000:].decode(errors="replace")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(ValueError):
                rec = json.loads(raw)
                with self._cond:
                    self.lines.append(rec)
                    self._cond.notify_all()

    def _wait(self, pred: Any, seconds: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + seconds
        with self._cond:
            while True:
                for rec in self.lines:
                    if pred(rec):
                        return rec
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return None
                self._cond.wait(min(left, 0.2))

    async def wait(self, pred: Any, seconds: float, what: str) -> dict[str, Any]:
        rec = await asyncio.get_running_loop().run_in_executor(None, self._wait, pred, seconds)
        if rec is None:
            raise AssertionError(f"{self.name}: no {what} within {seconds} s; "
                                 f"saw {self.lines[-20:]}; stderr: {self._stderr_tail()}")
        return rec

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _partition(net: Rails) -> str:
    """Drops every packet on the veth, in both namespaces, silently."""
    if netns.firewall() is not None:
        return net.blackhole(1, "a")
    r = net.rail(1)
    net.ip("a", "route", "add", "blackhole", f"{r.addr_b}/32")
    net.ip("b", "route", "add", "blackhole", f"{r.addr_a}/32")
    return "route"


def _heal(net: Rails, how: str) -> None:
    if how != "route":
        net.unblackhole(1, "a")
        return
    r = net.rail(1)
    net.ip("a", "route", "del", "blackhole", f"{r.addr_b}/32")
    net.ip("b", "route", "del", "blackhole", f"{r.addr_a}/32")


def _start_etcd(net: Rails, root: Path) -> None:
    exe = shutil.which("etcd")
    assert exe is not None
    veth = f"http://{net.rail(1).addr_a}:{PORT}"
    local = f"http://127.0.0.1:{PORT}"
    cmd = etcd_command(exe, "ns", root / "data", veth, "http://127.0.0.1:2380")
    cmd[cmd.index("--listen-client-urls") + 1] = f"{veth},{local}"
    # Pings every KEEPALIVE: etcd 3.4 closes a connection pinged more often
    # than its --grpc-keepalive-min-time (5 s by default).
    cmd += ["--grpc-keepalive-min-time", "500ms"]
    with open(root / "etcd.log", "ab") as log:
        net.popen("a", cmd, stdout=log, stderr=subprocess.STDOUT, env=etcd_env())
    deadline = time.monotonic() + 30
    while net.exec("a", sys.executable, "-c", HEALTH, local, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"etcd not healthy within 30 s: "
                               f"{(root / 'etcd.log').read_text()[-2000:]}")
        time.sleep(0.1)


async def test_watch_survives_a_partition_that_drops_packets(
    net: Rails, tmp_path: Path
) -> None:
    """Partition between the watcher and etcd (packets dropped, no reset)
    for 3 ttl; meanwhile m1 is killed (its lease expires) and m2 joins. The
    watcher notices its dead watch within keepalive + timeout, and after the
    partition heals it learns of both."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, _start_etcd, net, tmp_path)
    local = f"127.0.0.1:{PORT}"
    children: list[Child] = []
    try:
        m1 = Child(net, "a", "m1", local)
        children.append(m1)
        await m1.wait(lambda r: r["kind"] == "joined", 30, "join")
        w = Child(net, "b", "w", f"{net.rail(1).addr_a}:{PORT}")
        children.append(w)
        await w.wait(lambda r: r["kind"] == "PeerJoined" and r["name"] == "m1", 30, "m1 joined")

        how = await loop.run_in_executor(None, _partition, net)
        t_part = time.monotonic()
        m1.kill()
        m2 = Child(net, "a", "m2", local)
        children.append(m2)
        await m2.wait(lambda r: r["kind"] == "joined", 30, "join")

        bound = KEEPALIVE + TIMEOUT + SLACK
        failed = await w.wait(
            lambda r: r.get("event") == "discovery.watch_failed" and r["t"] > t_part,
            max(0.0, t_part + bound - time.monotonic()),
            "watch failure noticed while partitioned")
        print(f"\npartition ({how}): the watch failed {failed['t'] - t_part:.2f} s in "
              f"({failed['reason']})")

        await asyncio.sleep(max(0.0, t_part + 3 * TTL - time.monotonic()))
        await loop.run_in_executor(None, _heal, net, how)
        t_heal = time.monotonic()
        bound = TTL / 2 + 2 * TIMEOUT + SLACK
        left = await w.wait(lambda r: r["kind"] == "PeerLeft" and r["name"] == "m1" and
                            r["t"] > t_part, bound, "m1's leaving after the partition healed")
        joined = await w.wait(lambda r: r["kind"] == "PeerJoined" and r["name"] == "m2",
                              max(0.0, t_heal + bound - time.monotonic()),
                              "m2's joining after the partition healed")
        print(f"after healing: m1 left at +{left['t'] - t_heal:.2f} s, "
              f"m2 joined at +{joined['t'] - t_heal:.2f} s")
        assert w.proc.poll() is None
    finally:
        for c in children:
            c.kill()

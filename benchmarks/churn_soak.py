"""Churn soak: agents join and leave at random while a driver keeps running
verified transfers against whichever of them are alive.

Agents are separate processes. Some close cleanly, some are SIGKILLed, new ones
start under the same name (a restart: a new incarnation, which fences the old
one's handles) or a new one. The driver posts rounds of write-with-notify then
read-back (contiguous, or scattered over many descriptors), and checks the
bytes read back. Every await has a deadline, as a hang detector only: an
operation either completes, or fails with a typed aioxfer error, or it *hangs*
(runs past the deadline), and hung must be 0.

Discovery: with ``--etcd host:port`` agents join through etcd and the driver
follows ``agent.membership()`` and connects by name (a SIGKILLed agent stays a
member until its lease expires, so transfers to it fail typed meanwhile);
without, the supervisor passes each agent's address to the driver (embedded).

Also checked: every write whose completion the driver saw was notified at its
target (for agents that closed cleanly and could count), and agents that close
cleanly, and the driver, leak no native op, region or pinned buffer.

    python benchmarks/churn_soak.py --duration 180 [--agents 6] [--etcd 127.0.0.1:2379]
                                    [--tcp] [--json soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

import aioxfer

SLOT = 1 << 20  # each driver task owns one slot of every agent's pool
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)
PIECE = 16 << 10  # scattered rounds: descriptors of this size, shuffled
LEAK_KEYS = ("in_flight", "native_ops", "native_regions", "pinned_regions")


def tie_to_parent(parent: int) -> None:
    # The kernel SIGKILLs an agent whose parent dies: none outlives the soak.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def agent_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"peer_timeout": args.peer_timeout, "keepalive": args.peer_timeout / 4}
    if args.tcp:
        opts["transports"] = ("tcp",)
    return opts


# ------------------------------------------------------------ an agent process


def agent_main(name: str, conn: Connection, parent: int, opts: dict[str, Any]) -> None:
    tie_to_parent(parent)
    try:
        asyncio.run(agent_serve(name, conn, opts))
    except Exception as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None


async def agent_serve(name: str, conn: Connection, opts: dict[str, Any]) -> None:
    discovery = None
    if opts["etcd"]:
        discovery = aioxfer.Etcd(opts["etcd"], prefix=opts["prefix"], ttl=opts["ttl"])
    agent = aioxfer.Agent(name, discovery=discovery, **opts["agent"])
    # Registered before joining: whoever finds this agent finds its pool.
    agent.alloc(opts["pool"], name="pool")
    notes = 0
    async with agent:
        loop = asyncio.get_running_loop()
        quit = asyncio.Event()  # "quit" from the supervisor, or its end of the pipe closing
        loop.add_reader(conn.fileno(), quit.set)
        conn.send(("up", agent.address, agent.incarnation))

        async def count() -> None:
            nonlocal notes
            async for _ in agent.notifications:
                notes += 1

        task = asyncio.create_task(count())
        await quit.wait()
        loop.remove_reader(conn.fileno())
        task.cancel()
    # Closing drains what the engine already received: those count too.
    notes += len(agent.notifications)
    stats = agent.statistics()
    try:
        conn.send(("closed", notes, {k: getattr(stats, k) for k in LEAK_KEYS}))
    except OSError:
        pass  # the supervisor is gone: nobody to tell


# ------------------------------------------------------------ the supervisor and driver


@dataclass(eq=False)
class Member:
    """One incarnation of an agent process."""

    name: str
    proc: BaseProcess
    conn: Connection
    state: str = "starting"  # starting, up, closing, closed, killed, failed
    address: str = ""
    incarnation: int = 0
    notified_writes: int = 0  # writes with notify to it that the driver saw complete
    notes: int | None = None  # notifications it counted (known after a clean close)
    leaks: dict[str, int] = field(default_factory=dict)


def _recv(conn: Connection, seconds: float) -> Any:
    # Runs in an executor thread: the loop never blocks on a pipe.
    try:
        return conn.recv() if conn.poll(seconds) else None
    except (EOFError, OSError):
        return None  # it died


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.ctx = mp.get_context("spawn")
        self.prefix = f"/aioxfer-soak/{uuid.uuid4().hex[:12]}"
        self.members: list[Member] = []  # every incarnation ever started
        self.up: dict[str, Member] = {}  # name -> its live incarnation
        self.by_incarnation: dict[tuple[str, int], Member] = {}
        self.view: set[str] = set()  # etcd: the driver's membership view
        self.targets: dict[str, Member] = {}  # embedded: the driver's view, by name
        self.starting = 0
        self.reserved: set[str] = set()  # names a restart is about to reuse
        self.peers: dict[str, aioxfer.Peer] = {}  # the driver's, by target
        self.next_name = args.agents
        self.events: Counter[str] = Counter()  # started, closed, killed, restarted, ...
        self.peak_up = 0
        self.ops: Counter[str] = Counter()  # completed: write, read
        self.failures: Counter[str] = Counter()  # "stage: Class"
        self.untyped: Counter[str] = Counter()  # anything not an aioxfer error: must be 0
        self.hung: list[str] = []
        self.corrupt = 0
        self.rounds = 0
        self.bytes_verified = 0
        self.fail_seconds: list[float] = []
        self.actions: set[asyncio.Task[None]] = set()
        self.end = 0.0

    # ---------------------------------------------------------- churn

    def child_options(self) -> dict[str, Any]:
        return {"etcd": self.args.etcd, "prefix": self.prefix, "ttl": self.args.ttl,
                "pool": self.args.concurrency * SLOT, "agent": agent_options(self.args)}

    async def start(self, name: str) -> None:
        conn, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=agent_main, args=(name, child, os.getpid(),
                                                         self.child_options()), daemon=True)
        proc.start()  # on the loop thread: PDEATHSIG follows the thread that forked
        child.close()
        m = Member(name, proc, conn)
        self.members.append(m)
        self.starting += 1
        try:
            hello = await asyncio.get_running_loop().run_in_executor(None, _recv, conn, 60.0)
        finally:
            self.starting -= 1
        if not (isinstance(hello, tuple) and hello[0] == "up"):
            m.state = "failed"
            self.events["failed to start"] += 1
            print(f"agent {name} failed to start: {hello!r}", file=sys.stderr)
            await self.reap(m)
            return
        _, m.address, m.incarnation = hello
        m.state = "up"
        self.up[name] = m
        self.targets[name] = m
        self.by_incarnation[(name, m.incarnation)] = m
        self.events["started"] += 1
        self.peak_up = max(self.peak_up, len(self.up))

    def left(self, m: Member) -> None:
        """The driver hears of a departure ``--lag`` seconds late (a membership
        service is never instant), so it keeps sending to the member meanwhile."""
        self.up.pop(m.name, None)

        def forget() -> None:
            if self.targets.get(m.name) is m:  # not if a new incarnation took the name
                del self.targets[m.name]

        asyncio.get_running_loop().call_later(self.args.lag, forget)

    async def close(self, m: Member) -> None:
        """A clean leave: the agent closes itself and reports what it counted."""
        m.state = "closing"
        self.left(m)
        try:
            m.conn.send(("quit",))
        except OSError:
            pass
        reply = await asyncio.get_running_loop().run_in_executor(None, _recv, m.conn, 30.0)
        if isinstance(reply, tuple) and reply[0] == "closed":
            m.notes, m.leaks = reply[1], reply[2]
            m.state = "closed"
            self.events["closed cleanly"] += 1
        else:
            m.state = "failed"
            self.events["close failed"] += 1
            print(f"agent {m.name} did not close cleanly: {reply!r}", file=sys.stderr)
        await self.reap(m)

    async def kill(self, m: Member) -> None:
        m.state = "killed"
        self.left(m)
        m.proc.kill()  # SIGKILL
        self.events["SIGKILLed"] += 1
        await self.reap(m)

    async def reap(self, m: Member) -> None:
        await asyncio.get_running_loop().run_in_executor(None, m.proc.join, 15.0)
        if m.proc.is_alive():
            m.proc.kill()
            self.events["killed at reaping"] += 1
            await asyncio.get_running_loop().run_in_executor(None, m.proc.join, 15.0)
        m.conn.close()

    def new_name(self) -> str:
        # Half the time a name used before (a fresh incarnation of it), else a new one.
        busy = set(self.up) | self.reserved
        busy |= {m.name for m in self.members if m.state in ("starting", "closing")}
        reusable = sorted({m.name for m in self.members} - busy)
        if reusable and self.rng.random() < 0.5:
            self.events["started under a used name"] += 1
            return self.rng.choice(reusable)
        self.next_name += 1
        self.events["started under a new name"] += 1
        return f"agent-{self.next_name - 1}"

    async def restart(self, m: Member) -> None:
        """SIGKILL, then at once a new incarnation under the same name."""
        self.events["restarted (kill + same name)"] += 1
        self.reserved.add(m.name)
        try:
            await self.kill(m)
            await self.start(m.name)
        finally:
            self.reserved.discard(m.name)

    async def churn(self) -> None:
        a = self.args
        while time.monotonic() < self.end:
            await asyncio.sleep(self.rng.expovariate(1.0 / a.churn_interval))
            live = len(self.up) + self.starting
            if live < a.min_agents or not self.up:
                action = "start"
            elif live >= a.agents:
                action = self.rng.choice(["close", "kill", "restart"])
            else:
                action = self.rng.choices(["start", "close", "kill", "restart"], [3, 2, 2, 1])[0]
            if action == "start":
                coro = self.start(self.new_name())
            else:
                m = self.up.pop(self.rng.choice(sorted(self.up)))  # chosen: not chosen twice
                coro = {"close": self.close, "kill": self.kill, "restart": self.restart}[action](m)
            task = asyncio.create_task(coro)
            self.actions.add(task)
            task.add_done_callback(self.actions.discard)

    # ---------------------------------------------------------- driving

    async def follow(self, agent: aioxfer.Agent) -> None:
        """etcd: the driver's own view of who is a member."""
        async for ev in agent.membership():
            if isinstance(ev, aioxfer.PeerLeft):
                self.view.discard(ev.name)
            else:
                self.view.add(ev.name)

    def target(self) -> str | None:
        if self.args.etcd:
            names = sorted(self.view)
            return self.rng.choice(names) if names else None
        names = sorted(self.targets)
        return self.targets[self.rng.choice(names)].address if names else None

    async def drive(self, agent: aioxfer.Agent, k: int, src: aioxfer.Region,
                    dst: aioxfer.Region) -> None:
        rng = random.Random(self.args.seed * 1000 + k)
        slot = slice(k * SLOT, (k + 1) * SLOT)
        while time.monotonic() < self.end:
            target = self.target()
            if target is None:
                await asyncio.sleep(0.05)
                continue
            n = rng.choice(SIZES)
            data = np.frombuffer(rng.randbytes(n), dtype=np.uint8)
            src.numpy()[slot][:n] = data
            dst.numpy()[slot][:n] = 0
            scattered = n >= 4 * PIECE and rng.random() < 0.5
            await self.round(agent, k, target, n, data, src, dst, scattered, rng)

    async def round(self, agent: aioxfer.Agent, k: int, target: str, n: int, data: Any,
                    src: aioxfer.Region, dst: aioxfer.Region, scattered: bool,
                    rng: random.Random) -> None:
        stage, t0 = "connect", time.monotonic()
        deadline = self.args.deadline
        self.rounds += 1
        try:
            peer = self.peers.get(target)
            if peer is None or peer.lost:  # (a restart fences the old incarnation: lost)
                async with asyncio.timeout(deadline):
                    peer = self.peers[target] = await agent.connect(target)
            member = self.by_incarnation.get((peer.name, peer.incarnation))
            pool = peer.region("pool")
            base = k * SLOT
            w_src: Any
            w_dst: Any
            r_src: Any
            r_dst: Any
            if scattered:  # n / PIECE descriptors, remote order shuffled
                count = n // PIECE
                local = np.arange(count, dtype=np.uint64) * PIECE + base
                remote = np.array(rng.sample(range(count), count), dtype=np.uint64) * PIECE + base
                lengths = np.full(count, PIECE, dtype=np.uint64)
                w_src, w_dst = src.segments(local, lengths), pool.segments(remote, lengths)
                r_dst, r_src = dst.segments(local, lengths), pool.segments(remote, lengths)
            else:
                w_src, w_dst = src[base:base + n], pool[base:base + n]
                r_dst, r_src = dst[base:base + n], pool[base:base + n]
            stage, t0 = "write", time.monotonic()
            async with asyncio.timeout(deadline):
                await agent.write(w_src, w_dst, notify=b"soak %d" % self.rounds)
            self.ops["write"] += 1
            if member is not None:
                member.notified_writes += 1
            stage, t0 = "read", time.monotonic()
            async with asyncio.timeout(deadline):
                await agent.read(r_dst, r_src)
            self.ops["read"] += 1
            if np.array_equal(dst.numpy()[base:base + n], data):
                self.bytes_verified += n
            else:
                self.corrupt += 1
                print(f"CORRUPT: {n} bytes read back from {target} differ", file=sys.stderr)
        except aioxfer.XferError as exc:  # typed (TransferTimeout too: the engine's verdict)
            self.failures[f"{stage}: {type(exc).__name__}"] += 1
            self.fail_seconds.append(time.monotonic() - t0)
            await asyncio.sleep(0.01)  # as a client would: no busy loop on a dead target
        except TimeoutError:
            self.hung.append(f"{stage} to {target} after {deadline} s")
            print(f"HUNG: {self.hung[-1]}", file=sys.stderr)
        except Exception as exc:  # not an aioxfer error: a bug, reported
            self.untyped[f"{stage}: {type(exc).__name__}: {exc}"[:160]] += 1

    # ---------------------------------------------------------- the run

    async def run(self) -> dict[str, Any]:
        a = self.args
        discovery = aioxfer.Etcd(a.etcd, prefix=self.prefix, ttl=a.ttl) if a.etcd else None
        t_start = time.monotonic()
        driver = aioxfer.Agent("driver", discovery=discovery, **agent_options(a))
        src = driver.alloc(a.concurrency * SLOT, name="src")
        dst = driver.alloc(a.concurrency * SLOT, name="dst")
        try:
            async with driver:
                follower = asyncio.create_task(self.follow(driver)) if a.etcd else None
                await asyncio.gather(*(self.start(f"agent-{i}") for i in range(a.agents)))
                self.end = time.monotonic() + a.duration
                print(f"churn soak: {a.duration:.0f} s, up to {a.agents} agents "
                      f"({'etcd ' + a.etcd if a.etcd else 'embedded'}), "
                      f"{a.concurrency} driver tasks, deadline {a.deadline:.0f} s", flush=True)
                churn = asyncio.create_task(self.churn())
                await asyncio.gather(*(self.drive(driver, k, src, dst)
                                       for k in range(a.concurrency)))
                await churn
                while self.actions:
                    await asyncio.gather(*self.actions)
                await asyncio.gather(*(self.close(m) for m in list(self.up.values())))
                if follower is not None:
                    follower.cancel()
        finally:
            for m in self.members:  # whatever happened: no process is left behind
                if m.proc.is_alive():
                    m.proc.kill()
                    self.events["killed at reaping"] += 1
                m.proc.join(15)
        driver_stats = driver.statistics()
        return self.summary(time.monotonic() - t_start, {k: getattr(driver_stats, k)
                                                          for k in LEAK_KEYS})

    def summary(self, seconds: float, driver_leaks: dict[str, int]) -> dict[str, Any]:
        counted = [m for m in self.members if m.notes is not None]
        expected = sum(m.notified_writes for m in counted)
        received = sum(m.notes or 0 for m in counted)
        missing = sum(max(0, m.notified_writes - (m.notes or 0)) for m in counted)
        leaks = {f"{m.name}#{m.incarnation:x}": m.leaks for m in counted
                 if any(m.leaks.values())}
        if any(driver_leaks.values()):
            leaks["driver"] = driver_leaks
        fails = sorted(self.fail_seconds)
        return {
            "seconds": round(seconds, 1),
            "config": {k: v for k, v in vars(self.args).items() if k != "json"},
            "agents": dict(self.events, peak_up=self.peak_up),
            "rounds": self.rounds,
            "transfers_completed": self.ops["write"] + self.ops["read"],
            "writes_completed": self.ops["write"],
            "reads_completed": self.ops["read"],
            "failed_typed": sum(self.failures.values()),
            "failed_by_class": dict(sorted(self.failures.items())),
            "hung": len(self.hung),
            "hung_detail": self.hung,
            "corrupt": self.corrupt,
            "untyped": dict(self.untyped),
            "bytes_verified": self.bytes_verified,
            "seconds_to_typed_failure": {
                "p50": fails[len(fails) // 2] if fails else None,
                "max": fails[-1] if fails else None,
            },
            "notifications": {"agents_counted": len(counted), "expected": expected,
                              "received": received, "missing": missing,
                              "missing_at": {f"{m.name}#{m.incarnation:x}": [m.notified_writes,
                                                                            m.notes]
                                             for m in counted
                                             if m.notified_writes > (m.notes or 0)}},
            "leaks": leaks,
            "ok": not self.hung and not self.corrupt and not self.untyped and not missing
            and not leaks,
        }


def print_summary(s: dict[str, Any]) -> None:
    ag = s["agents"]
    rows = [
        ("run", f"{s['seconds']} s, {s['rounds']} rounds (write with notify, read back)"),
        ("agents", ", ".join(f"{k} {v}" for k, v in ag.items())),
        ("completed", f"{s['transfers_completed']} transfers ({s['writes_completed']} writes, "
                      f"{s['reads_completed']} reads)"),
        ("failed", f"{s['failed_typed']} typed"),
        *((f"  {k}", str(v)) for k, v in s["failed_by_class"].items()),
        ("time to fail", "p50 {p50}, max {max} s".format(**{
            k: "-" if v is None else f"{v:.3f}" for k, v in s["seconds_to_typed_failure"].items()
        })),
        ("hung", str(s["hung"])),
        ("corrupt", str(s["corrupt"])),
        ("untyped errors", str(sum(s["untyped"].values())) + (f" {s['untyped']}"
                                                               if s["untyped"] else "")),
        ("bytes verified", f"{s['bytes_verified']} ({s['bytes_verified'] / 2**30:.2f} GiB)"),
        ("notifications", "{received} received of {expected} expected at {agents_counted} "
                          "cleanly closed agents, {missing} missing".format(**s["notifications"])),
        ("leaks", "none" if not s["leaks"] else json.dumps(s["leaks"])),
        ("verdict", "OK" if s["ok"] else "FAILED"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of churn (180)")
    p.add_argument("--agents", type=int, default=6, help="most agents alive at once (6)")
    p.add_argument("--min-agents", type=int, default=2, help="fewest agents alive (2)")
    p.add_argument("--churn-interval", type=float, default=1.0,
                   help="mean seconds between joins/leaves (1.0)")
    p.add_argument("--concurrency", type=int, default=4, help="driver tasks (4)")
    p.add_argument("--deadline", type=float, default=30.0,
                   help="hang detector: seconds an await may take (30)")
    p.add_argument("--peer-timeout", type=float, default=2.0, help="agents' peer_timeout (2)")
    p.add_argument("--lag", type=float, default=0.5,
                   help="embedded: seconds before the driver hears an agent left (0.5)")
    p.add_argument("--etcd", default=None, help="host:port of etcd (default: embedded)")
    p.add_argument("--ttl", type=int, default=2, help="etcd lease seconds (2)")
    p.add_argument("--tcp", action="store_true", help="force TCP (default: shm on one host)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args()
    if args.min_agents < 1 or args.agents < args.min_agents:
        p.error("need 1 <= --min-agents <= --agents")
    summary = asyncio.run(Soak(args).run())
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

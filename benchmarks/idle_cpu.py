"""What an idle agent costs: one agent (the hub, in its own process) with 10
connected peers, nothing in flight, for 10 s; its CPU time (user + system,
every thread: engine threads, keepalives, the event loop) as a percentage of
one core, per progress mode and transport, and its threads' wake-ups per
second (the third field of /proc/<pid>/task/*/schedstat: times a thread was
put on a CPU; on a VM each costs tens of microseconds). The hub dials every
peer and every peer dials the hub (both directions live), and one transfer
each way ran before the quiet period, so every path has been used.

    python benchmarks/idle_cpu.py [--seconds 10] [--peers 10] [--modes adaptive,sleep,poll]
                                  [--transports shm,tcp] [--json]

Target (issue 13): < 0.5 % of one core in every mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import aioxfer

TICK = os.sysconf("SC_CLK_TCK")


def _kw(transport: str) -> dict[str, object]:
    return {"transports": ("tcp",)} if transport == "tcp" else {}


async def hub(mode: str, transport: str) -> None:
    loop = asyncio.get_running_loop()
    kw = _kw(transport)
    if mode != "default":  # "default": an aioxfer without the setting (a before/after run)
        kw["progress"] = mode
    async with aioxfer.Agent("idle-hub", **kw) as agent:
        src = agent.alloc(1 << 20, name="buf")
        print(agent.address, flush=True)
        addresses = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
        peers = [await agent.connect(a) for a in addresses]
        for p in peers:  # every path used once
            await agent.write(src[0:4096], p.region("buf")[0:4096])
            await agent.read(src[0:4096], p.region("buf")[0:4096])
        print("ready", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # the quiet period, then "exit"


def cpu_of(pid: int) -> tuple[float, int]:
    """CPU seconds of pid's threads now and their wake-ups (times run): the
    scheduler's nanosecond run time and run count
    (/proc/<pid>/task/*/schedstat) where the kernel keeps them, else utime +
    stime in clock ticks (10 ms: coarse over a 10 s window) and -1. Threads
    do not come or go while the agent is idle."""
    try:
        total = runs = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            total += int(fields[0])
            runs += int(fields[2])
        return total / 1e9, runs
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICK, -1


async def measure(mode: str, transport: str, npeers: int,
                  seconds: float) -> tuple[float, float]:
    """(% of one core, wake-ups per second; -1 where not kept)."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--hub", mode, transport],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdin is not None and proc.stdout is not None
    loop = asyncio.get_running_loop()
    agents = [aioxfer.Agent(f"idle-peer-{i}", **_kw(transport)) for i in range(npeers)]
    try:
        address = (await loop.run_in_executor(None, proc.stdout.readline)).strip()
        for a in agents:
            await a.start()
            a.alloc(1 << 20, name="buf")
        proc.stdin.write(json.dumps([a.address for a in agents]) + "\n")
        proc.stdin.flush()
        for a in agents:
            p = await a.connect(address)
            await a.write(a.region("buf")[0:4096], p.region("buf")[0:4096])
        line = await loop.run_in_executor(None, proc.stdout.readline)
        assert line.strip() == "ready", line
        await asyncio.sleep(1.0)  # connections settle
        (c0, r0), t0 = cpu_of(proc.pid), time.monotonic()
        await asyncio.sleep(seconds)
        (c1, r1), t1 = cpu_of(proc.pid), time.monotonic()
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        wakes = (r1 - r0) / (t1 - t0) if r0 >= 0 and r1 >= 0 else -1.0
        return 100.0 * (c1 - c0) / (t1 - t0), wakes
    finally:
        for a in agents:
            await a.aclose()
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def main(ns: argparse.Namespace) -> None:
    rows = []
    for transport in ns.transports.split(","):
        for mode in ns.modes.split(","):
            pct, wakes = await measure(mode, transport, ns.peers, ns.seconds)
            rows.append({"transport": transport, "mode": mode, "peers": ns.peers,
                         "seconds": ns.seconds, "cpu_pct_of_one_core": round(pct, 3),
                         "wakeups_per_s": round(wakes, 1)})
            if not ns.json:
                print(f"{transport:4} {mode:9} {ns.peers} peers, {ns.seconds:g} s idle: "
                      f"{pct:.2f} % of one core, {wakes:.0f} wake-ups/s", flush=True)
    if ns.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--hub":
        asyncio.run(hub(sys.argv[2], sys.argv[3]))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--peers", type=int, default=10)
    ap.add_argument("--modes", default="adaptive,sleep,poll",
                    help="progress modes; 'default' passes none (an older aioxfer)")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    asyncio.run(main(ap.parse_args()))

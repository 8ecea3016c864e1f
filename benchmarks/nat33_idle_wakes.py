"""Thread wake-ups of an idle agent: idle_cpu.py's hub (10 connected peers,
both ways, nothing in flight), its CPU as a percentage of one core and its
threads' wake-ups per second (the third field of /proc/<pid>/task/*/schedstat:
times a thread was put on a CPU), over the same window.

    python benchmarks/nat33_idle_wakes.py [--seconds 10] [--peers 10]
                                          [--modes adaptive] [--transports tcp]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import idle_cpu  # noqa: E402


def sample(pid: int) -> tuple[float, int, int]:
    """CPU seconds, wake-ups (slices run) and threads of pid now."""
    cpu = 0
    runs = 0
    tids = os.listdir(f"/proc/{pid}/task")
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:
            continue
        cpu += int(fields[0])
        runs += int(fields[2])
    return cpu / 1e9, runs, len(tids)


async def measure(mode: str, transport: str, npeers: int, seconds: float) -> dict[str, object]:
    hub = os.path.join(os.path.dirname(os.path.abspath(__file__)), "idle_cpu.py")
    proc = subprocess.Popen([sys.executable, hub, "--hub", mode, transport],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdin is not None and proc.stdout is not None
    loop = asyncio.get_running_loop()
    kw = idle_cpu._kw(transport)
    agents = [aioxfer.Agent(f"idle-peer-{i}", **kw) for i in range(npeers)]
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
        await asyncio.sleep(1.0)
        c0, r0, n = sample(proc.pid)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        c1, r1, _ = sample(proc.pid)
        t1 = time.monotonic()
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        return {"transport": transport, "mode": mode, "threads": n,
                "cpu_pct": round(100.0 * (c1 - c0) / (t1 - t0), 3),
                "wakeups_per_s": round((r1 - r0) / (t1 - t0), 1)}
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
    for transport in ns.transports.split(","):
        for mode in ns.modes.split(","):
            row = await measure(mode, transport, ns.peers, ns.seconds)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--peers", type=int, default=10)
    ap.add_argument("--modes", default="adaptive")
    ap.add_argument("--transports", default="tcp")
    asyncio.run(main(ap.parse_args()))

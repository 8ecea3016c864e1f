"""Where a tcp batch's time goes (tcp20): 256 x 16 KiB scattered, one request
awaited at a time, as benchmarks/peers/bench_aioxfer.py's batch row does.

Runs the batch (WRITE or READ) between this process and a target child for
--secs, and prints one JSON line: GB/s, the request's median time, CPU
seconds per GB (both processes, every thread), voluntary context switches per
request, and each process's busiest threads (CPU seconds and switches, from
/proc/<pid>/task). --strace-target / --strace-init attach `strace -c -f` to
one side during the timed loop and print its syscall table (slower: only
the counts mean anything then). --iperf3 runs iperf3's one stream (1 MiB
writes, loopback) for the same time right after, for the ratio.

    python benchmarks/tcp20_batch.py --op WRITE --secs 2
    python benchmarks/tcp20_batch.py --op READ --strace-target

Run a wheel's venv from outside any checkout (cd /) to measure a build, A and B
alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from proc_cpu import cpu_of

import aioxfer

BUF = 64 << 20
N, DESC = 256, 16 << 10


def threads(pid: int) -> dict[int, tuple[float, int, int]]:
    """tid -> (CPU seconds, voluntary, involuntary switches)."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            sw = {}
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        k, v = line.split(":")
                        sw[k] = int(v)
        except OSError:
            continue
        out[int(tid)] = ((int(st[11]) + int(st[12])) / tck, sw.get("voluntary_ctxt_switches", 0),
                         sw.get("nonvoluntary_ctxt_switches", 0))
    return out


def busiest(a: dict[int, tuple[float, int, int]], b: dict[int, tuple[float, int, int]],
            nreq: int, wall: float) -> list[str]:
    rows = []
    for tid, (c1, v1, i1) in b.items():
        c0, v0, i0 = a.get(tid, (0.0, 0, 0))
        if c1 - c0 > 0.01 * wall or v1 - v0 > nreq // 4:
            rows.append((c1 - c0, f"{100 * (c1 - c0) / wall:.0f}% cpu "
                         f"{(v1 - v0) / nreq:.2f}v/{(i1 - i0) / nreq:.2f}i per req"))
    return [r for _, r in sorted(rows, reverse=True)]


def pages() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)  # common.batch_pages: the peers' benchmark's pages
    n = BUF // DESC
    return rng.permutation(n)[:N], rng.permutation(n)[:N]


async def target(a: argparse.Namespace) -> None:
    async with aioxfer.Agent("t20-target", transports=("tcp",),
                             tcp_connections=a.conns) as agent:
        agent.alloc(BUF, name="buf").numpy().fill(1)
        print(agent.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def strace(pid: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid)], stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # attached to every thread
    return p


def strace_end(p: subprocess.Popen[bytes]) -> str:
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    return err.decode()


def iperf3(secs: float) -> float:
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", "5231"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", "5231", "-l", "1M", "-J",
                              "-t", str(max(1, round(secs)))], capture_output=True, check=True,
                             timeout=secs + 30).stdout
        return float(json.loads(out)["end"]["sum_received"]["bits_per_second"]) / 8e9
    finally:
        srv.wait(timeout=10)


async def initiator(a: argparse.Namespace) -> None:
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "target",
                          "--conns", str(a.conns)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdin is not None
    addr = p.stdout.readline().decode().strip()
    lp, rp = pages()
    lens = np.full(N, DESC, dtype=np.uint64)
    lat: list[float] = []
    async with aioxfer.Agent("t20-init", transports=("tcp",), tcp_connections=a.conns) as agent:
        local = agent.alloc(BUF, name="buf")
        local.numpy().fill(2)
        peer = await agent.connect(addr)
        sl: Any = aioxfer.SegmentList(local, lp.astype(np.uint64) * DESC, lens)
        sr: Any = aioxfer.SegmentList(peer.region("buf"), rp.astype(np.uint64) * DESC, lens)
        if a.size:  # one descriptor [0:size] on both sides, as the peers' one-at-a-time rows
            sl, sr = local[0:a.size], peer.region("buf")[0:a.size]
        nbytes = a.size or N * DESC
        xfer = agent.write if a.op == "WRITE" else agent.read
        w0 = time.perf_counter()
        while time.perf_counter() - w0 < 0.3:
            await xfer(sl, sr)
        st = strace(p.pid if a.strace_target else os.getpid()) \
            if a.strace_target or a.strace_init else None
        ru0, c0 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(p.pid)
        ti0, tt0 = threads(os.getpid()), threads(p.pid)
        pc = time.perf_counter
        w0 = pc()
        while pc() - w0 < a.secs:
            t0 = pc()
            await xfer(sl, sr)
            lat.append(pc() - t0)
        wall = pc() - w0
        ru1, c1 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(p.pid)
        ti1, tt1 = threads(os.getpid()), threads(p.pid)
        trace = strace_end(st) if st else None
    p.stdin.write(b"x\n")
    p.stdin.flush()
    p.wait()
    n = len(lat)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime + c1 - c0
    rec: dict[str, Any] = dict(
        op=a.op, size=nbytes, conns=a.conns, n=n, gbps=nbytes * n / wall / 1e9,
        us_med=statistics.median(lat) * 1e6, cpu_s_per_gb=cpu / (nbytes * n / 1e9),
        vcsw_per_req=(ru1.ru_nvcsw - ru0.ru_nvcsw) / n,
        init_threads=busiest(ti0, ti1, n, wall), target_threads=busiest(tt0, tt1, n, wall))
    if a.iperf3:
        rec["iperf3_gbps"] = iperf3(a.secs)
        rec["ratio_iperf3"] = rec["gbps"] / rec["iperf3_gbps"]
    print(json.dumps(rec), flush=True)
    if trace:
        print(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--op", default="WRITE", choices=["WRITE", "READ"])
    ap.add_argument("--secs", type=float, default=2.0)
    ap.add_argument("--size", type=int, default=0,
                    help="bytes of one descriptor [0:size] instead of the batch")
    ap.add_argument("--conns", type=int, default=4, help="tcp_connections (the default 4)")
    ap.add_argument("--strace-target", action="store_true")
    ap.add_argument("--strace-init", action="store_true")
    ap.add_argument("--iperf3", action="store_true")
    a = ap.parse_args()
    asyncio.run(target(a) if a.role == "target" else initiator(a))


if __name__ == "__main__":
    main()

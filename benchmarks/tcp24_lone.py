"""A lone tcp request awaited one at a time (tcp24): the per-request time
distribution and what each side's threads did per request.

One run: --secs of requests ([0:size] on both sides, as the peers' one-at-a-time
rows) between this process and a target child, each awaited before the next;
prints one JSON line: GB/s (the mean, as the peers' rows), p10/p50/p90/p99 of
the per-request times, CPU seconds per GB, and per request the voluntary and
involuntary context switches of each process (all threads, /proc/<pid>/task)
and of its busiest threads.

Pairs: --pythons A,B[,C...] runs the same measurement with each Python (wheel
venvs; cwd /) alternated --pairs times, in a rotated order, and prints each
run and then per build the median of the runs' medians and the median of
the per-pair ratios against the first build. --env NAME=VALUE,... per build
(';'-separated lists, one per Python: the same Python with settings
switched):

    python benchmarks/tcp24_lone.py --pythons /tmp/vM23/bin/python,/tmp/vX/bin/python \\
        --pairs 4 --secs 1.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from proc_cpu import cpu_of


def task_stats(pid: int) -> dict[int, tuple[float, int, int, str]]:
    """tid -> (CPU seconds, voluntary, involuntary switches, name)."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
            name = raw.split("(", 1)[1].rsplit(")", 1)[0]
            st = raw.rsplit(")", 1)[1].split()
            sw = {}
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        k, v = line.split(":")
                        sw[k] = int(v)
        except OSError:
            continue
        out[int(tid)] = ((int(st[11]) + int(st[12])) / tck, sw.get("voluntary_ctxt_switches", 0),
                         sw.get("nonvoluntary_ctxt_switches", 0), name)
    return out


def diff(a: dict[int, tuple[float, int, int, str]], b: dict[int, tuple[float, int, int, str]],
         n: int, wall: float) -> tuple[float, float, list[str]]:
    vol = inv = 0
    rows = []
    for tid, (c1, v1, i1, name) in b.items():
        c0, v0, i0, _ = a.get(tid, (0.0, 0, 0, ""))
        vol += v1 - v0
        inv += i1 - i0
        if c1 - c0 > 0.02 * wall or v1 - v0 > n // 10:
            rows.append((c1 - c0, f"{name}:{100 * (c1 - c0) / wall:.0f}%cpu "
                         f"{(v1 - v0) / n:.2f}v/{(i1 - i0) / n:.2f}i"))
    return vol / n, inv / n, [r for _, r in sorted(rows, reverse=True)]


async def target(a: argparse.Namespace) -> None:
    import aioxfer
    import aioxfer.progress
    if os.environ.get("TCP24_TARGET_POLL_US"):  # A/B of the target's poll bound, one build
        aioxfer.progress.TARGET_POLL_US = int(os.environ["TCP24_TARGET_POLL_US"])  # type: ignore
    kw = {"progress": a.target_progress} if a.target_progress else {}
    async with aioxfer.Agent("t24-target", transports=("tcp",), **kw) as agent:
        agent.alloc(64 << 20, name="buf").numpy().fill(1)
        print(agent.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def initiator(a: argparse.Namespace) -> None:
    import aioxfer
    import aioxfer.progress
    if os.environ.get("TCP24_ALONE_SPAN_US"):  # A/B of spin_alone's span, one build
        aioxfer.progress.ALONE_SPAN_US = int(os.environ["TCP24_ALONE_SPAN_US"])  # type: ignore
    targ = ["--target-progress", a.target_progress] if a.target_progress else []
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "target", *targ],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdin is not None
    addr = p.stdout.readline().decode().strip()
    lat: list[int] = []
    t0s: list[int] = []
    kw = {"progress": a.progress} if a.progress else {}
    async with aioxfer.Agent("t24-init", transports=("tcp",), **kw) as agent:
        local = agent.alloc(64 << 20, name="buf")
        local.numpy().fill(2)
        peer = await agent.connect(addr)
        ls, rs = local[0:a.size], peer.region("buf")[0:a.size]
        xfer = agent.write if a.op == "WRITE" else agent.read
        w0 = time.perf_counter()
        while time.perf_counter() - w0 < 0.3:
            await xfer(ls, rs)
        mono = time.perf_counter_ns
        ru0, c0 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(p.pid)
        ti0, tt0 = task_stats(os.getpid()), task_stats(p.pid)
        po = getattr(agent, "_poller", None)
        names = ("hits", "misses", "alone_hits", "alone_misses")
        pst0 = {k: getattr(po, k, 0) for k in names}
        w0 = time.perf_counter()
        while time.perf_counter() - w0 < a.secs:
            t0 = mono()
            await xfer(ls, rs)
            lat.append(mono() - t0)
            t0s.append(t0)
        wall = time.perf_counter() - w0
        pst = {k: getattr(po, k, 0) - pst0[k] for k in names}
        ru1, c1 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(p.pid)
        ti1, tt1 = task_stats(os.getpid()), task_stats(p.pid)
    p.stdin.write(b"x\n")
    p.stdin.flush()
    p.wait()
    n = len(lat)
    if a.stamps:  # for benchmarks/tcp24_tail.py (perf_counter_ns is CLOCK_MONOTONIC, the trace's)
        with open(a.stamps, "w") as f:
            json.dump({"t0": t0s, "t1": [x + d for x, d in zip(t0s, lat, strict=True)],
                       "init_pid": os.getpid(), "target_pid": p.pid}, f)
    s = sorted(x / 1e3 for x in lat)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime + c1 - c0
    iv, ii, ith = diff(ti0, ti1, n, wall)
    tv, tinv, tth = diff(tt0, tt1, n, wall)
    print(json.dumps(dict(
        op=a.op, size=a.size, n=n, gbps=round(a.size * n / wall / 1e9, 3),
        us_mean=round(statistics.fmean(s), 1), us_p10=round(s[n // 10], 1),
        us_p50=round(s[n // 2], 1), us_p90=round(s[9 * n // 10], 1),
        us_p99=round(s[min(n - 1, 99 * n // 100)], 1),
        slow_share=round(sum(x > 2 * s[n // 2] for x in s) / n, 4),
        slow_time_share=round(sum(x for x in s if x > 2 * s[n // 2]) / sum(s), 3),
        cpu_s_per_gb=round(cpu / (a.size * n / 1e9), 3),
        init_v=round(iv, 2), init_i=round(ii, 2), tgt_v=round(tv, 2), tgt_i=round(tinv, 2),
        poller=pst, init_threads=ith, target_threads=tth)), flush=True)


def pairs(a: argparse.Namespace) -> None:
    pys = a.pythons.split(",")
    envs = [dict(kv.split("=", 1) for kv in e.split(",") if kv) for e in
            (a.env.split(";") if a.env else [""] * len(pys))]
    labels = a.labels.split(",") if a.labels else [str(i) for i in range(len(pys))]
    res: list[list[dict[str, Any]]] = [[] for _ in pys]
    for k in range(a.pairs):
        order = list(range(len(pys)))
        order = order[k % len(pys):] + order[:k % len(pys)]
        for i in order:
            args = [pys[i], os.path.abspath(__file__), "--op", a.op, "--size", str(a.size),
                    "--secs", str(a.secs)]
            if a.progress:
                args += ["--progress", a.progress]
            out = subprocess.run(args, env=dict(os.environ, **envs[i]), capture_output=True,
                                 text=True, cwd="/", timeout=120)
            line = [x for x in out.stdout.splitlines() if x.startswith("{")]
            if not line:
                print(f"{labels[i]} failed: {out.stderr[-800:]}", file=sys.stderr)
                continue
            r = json.loads(line[-1])
            res[i].append(r)
            print(labels[i], json.dumps(r), flush=True)
    keys = ("gbps", "us_mean", "us_p10", "us_p50", "us_p90", "us_p99", "slow_share",
            "cpu_s_per_gb", "init_v", "init_i", "tgt_v", "tgt_i")
    for i, rs in enumerate(res):
        if not rs:
            continue
        med = {k: round(statistics.median(r[k] for r in rs), 3) for k in keys}
        summary = f"{labels[i]}: " + " ".join(f"{k}={v}" for k, v in med.items())
        if i and res[0]:
            q = sorted(r["gbps"] / r0["gbps"] for r, r0 in zip(rs, res[0], strict=False))
            summary += f" | gbps/{labels[0]} median {statistics.median(q):.3f} " \
                   f"[{q[0]:.2f}..{q[-1]:.2f}] {sum(x > 1 for x in q)}/{len(q)}"
        print(summary, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--op", default="WRITE", choices=["WRITE", "READ"])
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--secs", type=float, default=1.5)
    ap.add_argument("--progress", choices=["adaptive", "sleep", "poll"])
    ap.add_argument("--target-progress", choices=["adaptive", "sleep", "poll"])
    ap.add_argument("--stamps", help="file for the per-request times (tcp24_tail.py)")
    ap.add_argument("--pythons", help="A,B,...: alternate these builds (see above)")
    ap.add_argument("--labels")
    ap.add_argument("--env", help="per build NAME=V,...; builds separated by ';'")
    ap.add_argument("--pairs", type=int, default=4)
    a = ap.parse_args()
    if a.pythons:
        pairs(a)
    else:
        asyncio.run(target(a) if a.role == "target" else initiator(a))


if __name__ == "__main__":
    main()

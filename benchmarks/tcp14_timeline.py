"""The timeline of tcp requests awaited one at a time through Python (tcp14).

Runs N requests (default: 1 MiB WRITEs, [0:size] on both sides, as
benchmarks/peers/bench_aioxfer.py's run_suite does) between this process and a
target child, each awaited before the next, and prints their per-request
times and CPU cost. With a native build made with -Dc_args=-DAXF_TCP_TRACE and
AXF_TCP_TRACE=DIR in the environment, both processes record the engine's
events (native/src/internal.h TR_*) into DIR/trace.<pid>, and --analyze DIR
lines them up per request against the post (CLOCK_MONOTONIC, one clock for
both processes): medians of each step on each thread, which CPU ran it, and
whether the target's receiver polled.

    AXF_TCP_TRACE=/tmp/tr python benchmarks/tcp14_timeline.py --n 2000 --stamps /tmp/st.json
    python benchmarks/tcp14_timeline.py --analyze /tmp/tr --stamps /tmp/st.json

Per-request rows (us after the post): P = the posting thread (its inline
send), S = a connection's sending thread (its wake-up and send), TA/TB = the
target's receivers of the halves at offsets 0 and size/2 (header, payload
served, acknowledgement sent), I.ackK = the initiator's K-th acknowledgement
read (by a receiver, or by the spinning thread: HELP), py_t0/py_t1 = Python
before the call and after the await; then each request's Python time by
placement: the posting thread and the target's receiver of its (first) frame
on one CPU or on two (tcp17: on this VM a 64 KiB WRITE takes ~16 us on one,
~22 on two). --progress / --target-progress set each side's Agent(progress=),
--cpus I,T pins this process to CPU I and the target's to T.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from proc_cpu import cpu_of

import aioxfer

REC = np.dtype([("ns", "<u8"), ("op", "<u8"), ("a", "<u8"), ("tid", "<u4"), ("ev", "u1"),
                ("cpu", "u1"), ("fd", "<i2")])
EV = {n: i + 1 for i, n in enumerate(
    "POST SEND_B SEND_E TX_WAKE RX_HDR RX_DONE UNIT_B UNIT_E HELP PARK_B PARK_E RX_BLOCK "
    "STREAM_B STREAM_E WAIT_B WAIT_E CQ_PUSH SPIN_B SPIN_E SIG_B SIG_E".split())}
NOWAIT = 1 << 62


async def target(a: argparse.Namespace) -> None:
    if a.cpus:
        os.sched_setaffinity(0, {int(a.cpus.split(",")[1])})
    kw = {"progress": a.progress} if a.progress else {}
    async with aioxfer.Agent("tl-target", transports=("tcp",), **kw) as agent:
        agent.alloc(64 << 20, name="buf").numpy().fill(1)
        print(agent.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def initiator(a: argparse.Namespace) -> None:
    targ = ["--progress", a.target_progress] if a.target_progress else []
    if a.cpus:  # this process on the first, the target's on the second (inherited by threads)
        ini, tgt = (int(x) for x in a.cpus.split(","))
        targ += ["--cpus", f"{tgt},{tgt}"]
        os.sched_setaffinity(0, {ini})
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "target", *targ],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdin is not None
    addr = p.stdout.readline().decode().strip()
    t0s: list[int] = []
    t1s: list[int] = []
    kw = {"progress": a.progress} if a.progress else {}
    async with aioxfer.Agent("tl-init", transports=("tcp",), **kw) as agent:
        local = agent.alloc(64 << 20, name="buf")
        local.numpy().fill(2)
        peer = await agent.connect(addr)
        ls, rs = local[0:a.size], peer.region("buf")[0:a.size]
        xfer = agent.write if a.op == "WRITE" else agent.read
        for _ in range(200):
            await xfer(ls, rs)
        mono = time.monotonic_ns
        ru0, c0 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(p.pid)
        w0 = time.perf_counter()
        while (len(t0s) < a.n) if a.n else (time.perf_counter() - w0 < a.secs):
            t0 = mono()
            await xfer(ls, rs)
            t1s.append(mono())
            t0s.append(t0)
        wall = time.perf_counter() - w0
        ru1, c1 = resource.getrusage(resource.RUSAGE_SELF), cpu_of(p.pid)
    p.stdin.write(b"x\n")
    p.stdin.flush()
    p.wait()
    n = len(t0s)
    lat = sorted((b - x) / 1e3 for x, b in zip(t0s, t1s, strict=True))
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime + c1 - c0
    print(json.dumps(dict(op=a.op, size=a.size, n=n, gbps=a.size * n / wall / 1e9,
                          us_med=lat[n // 2], us_p10=lat[n // 10], us_p90=lat[9 * n // 10],
                          cpu_s_per_gb=cpu / (a.size * n / 1e9),
                          vcsw_per_req=(ru1.ru_nvcsw - ru0.ru_nvcsw) / n)), flush=True)
    if a.stamps:
        with open(a.stamps, "w") as f:
            json.dump({"t0": t0s, "t1": t1s, "init_pid": os.getpid(), "target_pid": p.pid}, f)


Rec = tuple[int, int, int, int, int, int, int]  # ns, op, a, tid, ev, fd, cpu


def load(d: str, pid: int) -> tuple[dict[int, list[Rec]], dict[int, list[Rec]], list[Rec]]:
    r = np.fromfile(f"{d}/trace.{pid}", dtype=REC)
    r = r[r["ns"] != 0]
    byop: dict[int, list[Rec]] = collections.defaultdict(list)
    bytid: dict[int, list[Rec]] = collections.defaultdict(list)
    allr = []
    for ns, op, a, tid, ev, cpu, fd in r.tolist():
        x = (ns, op, a, tid, ev, fd, cpu)
        allr.append(x)
        if op:
            byop[op].append(x)
        bytid[tid].append(x)
    for v in list(byop.values()) + list(bytid.values()):
        v.sort()
    allr.sort()
    return byop, bytid, allr


def last_before(seq: list[Rec], ns: int, ev: int, lo: int) -> Rec | None:
    k = bisect.bisect_right(seq, (ns, 1 << 64)) - 1
    while k >= 0 and seq[k][0] >= lo:
        if seq[k][4] == ev:
            return seq[k]
        k -= 1
    return None


def analyze(d: str, stamps: str) -> None:
    st: dict[str, Any] = json.load(open(stamps))
    iop, itid, iall = load(d, st["init_pid"])
    top, ttid, _ = load(d, st["target_pid"])
    n = len(st["t0"])
    posts = [x for x in iall if x[4] == EV["POST"]][-n:]
    rows: dict[str, list[float]] = collections.defaultdict(list)
    cnt: collections.Counter[str] = collections.Counter()
    placed: dict[str, list[float]] = collections.defaultdict(list)
    for i, p in enumerate(posts):
        ns0, ptid = p[0], p[3]
        ta_cpu = next((e[6] for e in top.get(p[1], []) if e[4] == EV["RX_HDR"]), None)
        where = "one CPU" if ta_cpu == p[6] else "two CPUs"
        placed[f"posting thread and target receiver on {where}"].append(
            (st["t1"][i] - st["t0"][i]) / 1e3)

        def rel(t: int, ns0: int = ns0) -> float:
            return (t - ns0) / 1e3
        rows["py_t0"].append(rel(st["t0"][i]))
        rows["py_t1"].append(rel(st["t1"][i]))
        ev = iop[p[1]]
        for e in ev:
            if e[4] != EV["SEND_B"]:
                continue
            end = next(x for x in ev if x[4] == EV["SEND_E"] and x[3] == e[3] and x[0] >= e[0])
            who = "P" if e[3] == ptid and e[2] & NOWAIT else "S"
            if who == "S":
                w = last_before(itid[e[3]], e[0], EV["TX_WAKE"], ns0)
                if w:
                    rows["S.wake"].append(rel(w[0]))
            rows[f"{who}.send_b"].append(rel(e[0]))
            rows[f"{who}.send_e"].append(rel(end[0]))
            cnt[f"{who} on cpu{e[6]}"] += 1
        sig = [x for x in ev if x[4] in (EV["SIG_B"], EV["SIG_E"])]
        if len(sig) == 2:
            rows["P.wakes_S (enqueue+futex)"].append((sig[1][0] - sig[0][0]) / 1e3)
        for e in top.get(p[1], []):
            if e[4] == EV["RX_HDR"] and e[2] & 0xFFFF in (1, 8):  # FR_WRITE, FR_WRITEV
                half = "TA" if e[2] >> 20 == 0 else "TB"
                rows[f"{half}.hdr"].append(rel(e[0]))
                cnt[f"{half} on cpu{e[6]}"] += 1
                cnt[f"{half} caught by its poll"] += e[2] >> 16 & 1
                done = next(x for x in ttid[e[3]] if x[4] == EV["RX_DONE"] and x[0] >= e[0])
                rows[f"{half}.served"].append(rel(done[0]))
                ack = next((x for x in ttid[e[3]] if x[4] == EV["SEND_B"] and x[0] >= e[0]), None)
                if ack:
                    rows[f"{half}.ack_send_b"].append(rel(ack[0]))
        acks = [x for x in ev if x[4] in (EV["RX_HDR"], EV["HELP"])]
        for k, e in enumerate(acks):
            rows[f"I.ack{k}"].append(rel(e[0]))
            cnt["acks read by the spinner" if e[4] == EV["HELP"] else "acks read by receivers"] += 1
        push = [x for x in ev if x[4] == EV["CQ_PUSH"]]
        if push:
            rows["I.cq_push"].append(rel(push[-1][0]))
        mine = [x for x in itid[ptid] if ns0 <= x[0] <= st["t1"][i]]
        wb = [x for x in mine if x[4] == EV["WAIT_B"]]
        we = [x for x in mine if x[4] == EV["WAIT_E"]]
        if wb and we:
            rows["W.spin_b"].append(rel(wb[0][0]))
            rows["W.spin_e"].append(rel(we[-1][0]))
            cnt[f"spinner on cpu{wb[0][6]}"] += 1
    print(f"{n} requests; us after the post (median, p10, p90):")
    for name in sorted(rows, key=lambda r: statistics.median(rows[r])):
        v = rows[name]
        q = statistics.quantiles(v, n=10) if len(v) > 1 else v * 9
        print(f"  {name:28s} n={len(v):5d} {statistics.median(v):8.1f} {q[0]:8.1f} {q[-1]:8.1f}")
    for what, c in sorted(cnt.items()):
        print(f"  {what}: {c}")
    for what, v in sorted(placed.items()):  # Python's own time, post to return
        print(f"  {what}: {len(v)} requests, median {statistics.median(v):.1f} us, "
              f"mean {statistics.fmean(v):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--op", default="WRITE", choices=["WRITE", "READ"])
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--n", type=int, default=0, help="requests (0: for --secs)")
    ap.add_argument("--secs", type=float, default=1.0)
    ap.add_argument("--stamps", help="file for Python's per-request times")
    ap.add_argument("--progress", choices=["adaptive", "sleep", "poll"],
                    help="this process's Agent(progress=...) (default: the agent's default)")
    ap.add_argument("--target-progress", choices=["adaptive", "sleep", "poll"],
                    help="the target's Agent(progress=...)")
    ap.add_argument("--cpus", metavar="I,T",
                    help="pin this process to CPU I and the target to CPU T (placement A/Bs)")
    ap.add_argument("--analyze", metavar="DIR", help="read DIR's traces with --stamps")
    a = ap.parse_args()
    if a.analyze:
        analyze(a.analyze, a.stamps)
    else:
        asyncio.run(target(a) if a.role == "target" else initiator(a))


if __name__ == "__main__":
    main()

"""One markdown table of a side-by-side run (results/<run>/run_*.jsonl), then
issue 3's and issue 13's targets, each marked met or missed and by how much.

Every ratio is taken within one round (the system and the limit or peer it is
divided by were measured in the same round), then the median over rounds is
shown; figures are medians over rounds too.

    python summarize.py results/<run>          (run.py calls it and saves summary.md)
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from typing import Any

KiB, MiB = 1024, 1024 * 1024
SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
BATCH = 256 * 16 * KiB
PATHS = {"same": "same host", "tcp": "tcp"}
PEERS = ("nixl", "mooncake")
NAMES = {"nixl": "NIXL", "mooncake": "Mooncake", "aioxfer": "aioxfer", "before": "aioxfer before",
         "sleep": "aioxfer sleep", "poll": "aioxfer poll"}
# aioxfer's progress modes besides its default (adaptive), when run (run.py --modes).
MODES = ("sleep", "poll")
# Which measurement stands for each system on each path: (peer, transport) in the records.
SYSTEMS = {
    "same": {"nixl": ("nixl", "ucx"), "mooncake": ("mooncake", "tcp"),
             "aioxfer": ("aioxfer", "shm"), "before": ("aioxfer-before", "shm"),
             **{m: (f"aioxfer-{m}", "shm") for m in MODES}},
    "tcp": {"nixl": ("nixl", "ucx-tcp"), "mooncake": ("mooncake", "tcp"),
            "aioxfer": ("aioxfer", "tcp"), "before": ("aioxfer-before", "tcp"),
            **{m: (f"aioxfer-{m}", "tcp") for m in MODES}},
}
# Rows of the CPU-cost table: where data moves for a measured time.
CPU_ROWS = [*SIZES, "qd16", "qd64", "batch"]


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


# Workloads: key -> (label, record op ("{op}" = WRITE/READ), size, field, unit, higher is better)
WORKLOADS: dict[Any, tuple[str, str, int, str, str, bool]] = {
    **{s: (f"{size_label(s)}, one at a time", "{op}", s, "gbps", "GB/s", True) for s in SIZES},
    "lat": ("4 KiB latency p50, awaited one at a time", "{op}", 4 * KiB, "lat_us_med", "µs", False),
    "qd16": ("4 KiB, 16 in flight", "{op}_qd16", 4 * KiB, "req_per_s", "ops/s", True),
    "qd64": ("4 KiB, 64 in flight", "{op}_qd64", 4 * KiB, "req_per_s", "ops/s", True),
    "batch": ("256 × 16 KiB scattered, one request", "{op}_batch256x16KiB", BATCH, "gbps", "GB/s",
              True),
    "batch_rps": ("256 × 16 KiB scattered, requests/s", "{op}_batch256x16KiB", BATCH, "req_per_s",
                  "req/s", True),
    # Median over fresh initiators (BENCH_CONNECT_SAMPLES each round), each
    # sample ending once the target saw the bytes land (common.ConnectSample).
    "connect": ("connect + first 4 KiB write (median of fresh connects, landed)",
                "first_write_incl_connect", 4 * KiB, "lat_us_med", "µs", False),
    # aioxfer's own targets (no peer figure)
    "qd256": ("4 KiB writes, 256 in flight (asyncio)", "WRITE_qd256", 4 * KiB, "req_per_s", "ops/s",
              True),
    "qd256_uvloop": ("4 KiB writes, 256 in flight (uvloop)", "WRITE_qd256_uvloop", 4 * KiB,
                     "req_per_s", "ops/s", True),
    "post100k": ("post one 100 000-descriptor request", "WRITE_post_100000_descs", 100_000 * 256,
                 "desc_per_s", "desc/s", True),
    "register": ("register a 1 GiB host region", "register_1GiB", 1 << 30, "lat_us_med", "µs",
                 False),
}
# The sizes bench_limits.py tcpfloor measures (and its 4 KiB latency).
FLOOR_SIZES = (4 * KiB, 64 * KiB, MiB)
PER_OP = [*SIZES, "lat", "qd16", "qd64", "batch", "batch_rps"]
ONCE = ["connect"]
AIOXFER_ONLY = {"same": ["qd256", "qd256_uvloop", "post100k", "register"], "tcp": ["post100k"]}

# Issue 3's targets, as data. vs: "limit" (the limit in the limit column), a peer, or
# None (aioxfer's own figure against an absolute threshold). The value compared is
# aioxfer's figure divided by vs's, taken per round, median over rounds.
TARGETS: list[dict[str, Any]] = [
    dict(text="shm, writes and reads ≥ 64 KiB: ≥ 0.9× single-thread memcpy", path="same",
         ops=("WRITE", "READ"), work=(64 * KiB, MiB, 16 * MiB, 64 * MiB), vs="limit", cmp=">=",
         thr=0.9),
    dict(text="shm, 16 and 64 MiB: ≥ 1.5× NIXL", path="same", ops=("WRITE", "READ"),
         work=(16 * MiB, 64 * MiB), vs="nixl", cmp=">=", thr=1.5),
    dict(text="shm, 256 × 16 KiB batch: ≥ 0.8× a plain memcpy loop over the same segments",
         path="same", ops=("WRITE", "READ"), work=("batch",), vs="limit", cmp=">=", thr=0.8),
    dict(text="shm, 256 × 16 KiB batch: ≥ 2× NIXL", path="same", ops=("WRITE", "READ"),
         work=("batch",), vs="nixl", cmp=">=", thr=2.0),
    dict(text="shm, 4 KiB awaited one at a time: p50 ≤ NIXL's polled per-op latency",
         path="same", ops=("WRITE", "READ"), work=("lat",), vs="nixl", cmp="<=", thr=1.0),
    dict(text="shm, 4 KiB at 64 in flight: ≥ 1.5× NIXL's ops/s", path="same",
         ops=("WRITE", "READ"), work=("qd64",), vs="nixl", cmp=">=", thr=1.5),
    dict(text="tcp, ≥ 1 MiB: ≥ 0.9× iperf3 one stream", path="tcp", ops=("WRITE", "READ"),
         work=(MiB, 16 * MiB, 64 * MiB), vs="limit", cmp=">=", thr=0.9),
    dict(text="tcp, ≥ 1 MiB: ≥ 1.2× NIXL-over-TCP", path="tcp", ops=("WRITE", "READ"),
         work=(MiB, 16 * MiB, 64 * MiB), vs="nixl", cmp=">=", thr=1.2),
    dict(text="tcp, ≥ 1 MiB: ≥ 2× Mooncake", path="tcp", ops=("WRITE", "READ"),
         work=(MiB, 16 * MiB, 64 * MiB), vs="mooncake", cmp=">=", thr=2.0),
    dict(text="tcp, 256 × 16 KiB batch: ≥ 1.5× NIXL-over-TCP", path="tcp", ops=("WRITE", "READ"),
         work=("batch",), vs="nixl", cmp=">=", thr=1.5),
    dict(text="tcp, 4 KiB round trip p50 ≤ 0.8× NIXL-over-TCP", path="tcp", ops=("WRITE", "READ"),
         work=("lat",), vs="nixl", cmp="<=", thr=0.8),
    dict(text="a 100 000-descriptor request posts at ≥ 5 M descriptors/s (SegmentList)",
         path="same", ops=("-",), work=("post100k",), vs=None, cmp=">=", thr=5e6),
    dict(text="≥ 400 k completed 4 KiB shm transfers/s to awaiting coroutines, many in flight "
         "(uvloop shown too)", path="same", ops=("-",), work=("qd256", "qd256_uvloop"), vs=None,
         cmp=">=", thr=400e3),
    dict(text="connect + first 4 KiB write to a new peer ≤ 5 ms", path="same", ops=("-",),
         work=("connect",), vs=None, cmp="<=", thr=5000),
    dict(text="registering a 1 GiB host region ≤ 1 ms", path="same", ops=("-",),
         work=("register",), vs=None, cmp="<=", thr=1000),
    dict(text="engine memory flat over a 10-minute soak (RSS at start and end)", path=None,
         ops=(), work=(), vs=None, cmp=None, thr=None,
         note="not measured by this harness (a 10-minute soak; see `aioxfer bench`)"),
]

# Issue 13's targets ("performance, round 2"), same form. vs="fastest": the
# fastest peer of the same round (the smaller figure where lower is better).
TARGETS_13: list[dict[str, Any]] = [
    dict(text="shm, one request at a time, 4 KiB-64 MiB: ≥ 1.0× NIXL", path="same",
         ops=("WRITE", "READ"), work=SIZES, vs="nixl", cmp=">=", thr=1.0),
    dict(text="shm, 1 MiB one at a time: ≥ 0.6× single-thread memcpy", path="same",
         ops=("WRITE", "READ"), work=(MiB,), vs="limit", cmp=">=", thr=0.6),
    dict(text="shm, 4 KiB p50 awaited ≤ NIXL's polled latency", path="same",
         ops=("WRITE", "READ"), work=("lat",), vs="nixl", cmp="<=", thr=1.0),
    dict(text="tcp, 4 KiB p50 awaited ≤ NIXL-over-TCP's", path="tcp", ops=("WRITE", "READ"),
         work=("lat",), vs="nixl", cmp="<=", thr=1.0),
    dict(text="tcp, one at a time, 64 KiB and 1 MiB: ≥ 1.2× NIXL-over-TCP", path="tcp",
         ops=("WRITE", "READ"), work=(64 * KiB, MiB), vs="nixl", cmp=">=", thr=1.2),
    dict(text="tcp, one at a time, 64 KiB and 1 MiB: ≥ 2× Mooncake", path="tcp",
         ops=("WRITE", "READ"), work=(64 * KiB, MiB), vs="mooncake", cmp=">=", thr=2.0),
    dict(text="4 KiB × 256 in flight: ≥ 500 k completions/s on asyncio", path="same", ops=("-",),
         work=("qd256",), vs=None, cmp=">=", thr=500e3),
    dict(text="4 KiB × 256 in flight: ≥ 700 k completions/s on uvloop", path="same", ops=("-",),
         work=("qd256_uvloop",), vs=None, cmp=">=", thr=700e3),
    dict(text="shm, connect + first 4 KiB write ≤ the fastest peer's", path="same", ops=("-",),
         work=("connect",), vs="fastest", cmp="<=", thr=1.0),
    dict(text="tcp, connect + first 4 KiB write ≤ the fastest peer's", path="tcp", ops=("-",),
         work=("connect",), vs="fastest", cmp="<=", thr=1.0),
    dict(text="shm, 256 × 16 KiB batch: ≥ 1.0× the memcpy loop", path="same",
         ops=("WRITE", "READ"), work=("batch",), vs="limit", cmp=">=", thr=1.0),
    dict(text="shm, 256 × 16 KiB batch: ≥ 4× NIXL", path="same", ops=("WRITE", "READ"),
         work=("batch",), vs="nixl", cmp=">=", thr=4.0),
    dict(text="tcp, 256 × 16 KiB batch: ≥ 0.95× iperf3 one stream", path="tcp",
         ops=("WRITE", "READ"), work=("batch",), vs="limit", cmp=">=", thr=0.95),
    dict(text="shm, 4 KiB × 64 in flight: ≥ 3× NIXL", path="same", ops=("WRITE", "READ"),
         work=("qd64",), vs="nixl", cmp=">=", thr=3.0),
    dict(text="an idle agent (10 peers, 10 s) < 0.5 % of one core", path=None, ops=(), work=(),
         vs=None, cmp=None, thr=None,
         note="not measured by this harness: benchmarks/idle_cpu.py"),
]


class Results:
    def __init__(self, recs: list[dict[str, Any]]) -> None:
        self.meta = [r for r in recs if r.get("peer") == "meta"]
        recs = [r for r in recs if r.get("peer") != "meta"]
        self.runs = sorted({r["run"] for r in recs}, key=lambda x: (len(str(x)), str(x)))
        self.idx: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.errors: list[dict[str, Any]] = []
        self.checks: list[tuple[dict[str, Any], bool]] = []
        for r in recs:
            self.idx[(r["run"], r["peer"], r.get("transport"), r.get("op"), r.get("size"))] = r
            if "error" in r:
                self.errors.append(r)
            if "verified" in r:
                self.checks.append((r, r["verified"] is True))

    def value(self, run: str, peer: str, transport: str, op: str, size: int,
              field: str) -> float | None:
        r = self.idx.get((run, peer, transport, op, size))
        v = None if r is None else r.get(field)
        return float(v) if isinstance(v, int | float) else None

    def verified_ok(self, peer: str, transport: str, op: str, size: int) -> bool:
        return all(
            self.idx[k].get("verified", True) is True
            for k in self.idx if k[1:] == (peer, transport, op, size)
        )

    # -------------------------------------------------------------- per round

    def fig(self, run: str, path: str, system: str, op: str, key: Any) -> float | None:
        _, rop, size, field, _, _ = WORKLOADS[key]
        peer, transport = SYSTEMS[path][system]
        return self.value(run, peer, transport, rop.format(op=op), size, field)

    def limit(self, run: str, path: str, op: str, key: Any,
              which: str = "main") -> tuple[float | None, str]:
        """The limit a workload is divided by (which="main"), the CMA reference
        shown beside it on the same-host rows (which="cma"), or the tcp
        request/answer floor of a one-at-a-time row (which="floor")."""
        v = self.value
        if which == "floor":
            if path != "tcp" or key not in (*FLOOR_SIZES, "lat", "batch"):
                return None, ""
            size, field = ((4 * KiB, "lat_us_med") if key == "lat"
                           else (BATCH, "gbps") if key == "batch" else (key, "gbps"))
            return v(run, "limit", "tcp-loopback", f"reqack_{op}", size, field), "floor"
        ops_per_s = 1e9 / (4 * KiB)  # GB/s of 4 KiB copies -> copies/s
        if path == "same":
            if which == "cma":
                name = "process_vm_writev" if op == "WRITE" else "process_vm_readv"
                tr, label = "cma", "CMA"
            else:
                name, tr, label = "ctypes.memmove", "memcpy", "memcpy"
            if key in SIZES:
                return v(run, "limit", tr, name, key, "gbps"), label
            if key == "lat":
                return v(run, "limit", tr, name, 4 * KiB, "lat_us_med"), label
            if key in ("qd16", "qd64"):
                g = v(run, "limit", tr, name, 4 * KiB, "gbps")
                return (None if g is None else g * ops_per_s), label
            if key in ("batch", "batch_rps"):
                field = "gbps" if key == "batch" else "req_per_s"
                if which == "main":
                    label += " loop"
                return v(run, "limit", tr, f"{name}_batch256x16KiB", BATCH, field), label
            return None, ""
        if which == "cma":
            return None, ""
        if key in SIZES:
            lsize = min(key, MiB)
            label = "iperf3" if key <= MiB else "iperf3 (1 MiB writes)"
            return v(run, "limit", "tcp-loopback", "iperf3", lsize, "gbps"), label
        if key in ("qd16", "qd64"):
            g = v(run, "limit", "tcp-loopback", "iperf3", 4 * KiB, "gbps")
            return (None if g is None else g * ops_per_s), "iperf3 4 KiB writes"
        if key in ("batch", "batch_rps"):
            g = v(run, "limit", "tcp-loopback", "iperf3", MiB, "gbps")
            if g is not None and key == "batch_rps":
                g = g * 1e9 / BATCH
            return g, "iperf3 (1 MiB writes)"
        return None, ""

    # -------------------------------------------------------------- medians over rounds

    def compared(self) -> tuple[str, ...]:
        """The peers aioxfer is divided by: NIXL, Mooncake, and an earlier build of
        aioxfer when one ran beside it (run.py --aioxfer-before-python)."""
        return (*PEERS, "before") if any(k[1] == "aioxfer-before" for k in self.idx) else PEERS

    def med(self, per_round: list[float | None]) -> float | None:
        xs = [x for x in per_round if x is not None]
        return statistics.median(xs) if xs else None

    def cpu_per_gb(self, run: str, path: str, system: str, op: str, key: Any) -> float | None:
        """CPU seconds (initiator + target) per GB moved, one round."""
        _, rop, size, _, _, _ = WORKLOADS[key]
        peer, transport = SYSTEMS[path][system]
        r = self.idx.get((run, peer, transport, rop.format(op=op), size))
        if r is None or not isinstance(r.get("cpu_s"), int | float):
            return None
        moved = float(r.get("gbps") or 0) * float(r.get("secs") or 0)
        return float(r["cpu_s"]) / moved if moved > 0 else None

    def fig_med(self, path: str, system: str, op: str, key: Any) -> float | None:
        return self.med([self.fig(r, path, system, op, key) for r in self.runs])

    def ratio_med(self, path: str, system: str, op: str, key: Any, vs: str | None) -> float | None:
        """system's figure / vs's figure (vs: "limit", "floor", a peer, or None: the figure itself),
        within each round, median over rounds."""
        out: list[float | None] = []
        for r in self.runs:
            a = self.fig(r, path, system, op, key)
            if vs is None:
                out.append(a)
                continue
            if vs == "fastest":
                # the fastest peer of this round: the larger figure where higher
                # is better, the smaller where lower is
                peers = [f for f in (self.fig(r, path, p, op, key) for p in PEERS) if f]
                b = ((max if WORKLOADS[key][5] else min)(peers) if peers else None)
            else:
                b = (self.limit(r, path, op, key, vs)[0] if vs == "floor"
                     else self.limit(r, path, op, key)[0] if vs == "limit"
                     else self.fig(r, path, vs, op, key))
            out.append(a / b if a is not None and b else None)
        return self.med(out)


def fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "–"
    if unit in ("ops/s", "desc/s", "req/s") and x >= 10_000:
        return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.0f} k"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}" if abs(x) >= 0.01 else f"{x:.2g}"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"


def table(res: Results) -> list[str]:
    # An earlier build of aioxfer run beside this one (run.py --aioxfer-before-python)
    # is one more peer: its column and aioxfer ÷ it.
    peers = res.compared()
    modes = modes_run(res)
    shown = (*peers[:2], "aioxfer", *modes, *peers[2:])
    out = [
        "| path | op | workload | unit | limit | "
        + " | ".join(NAMES[p] for p in shown) + " | "
        + " | ".join(f"aioxfer ÷ {NAMES[p]}" for p in peers) + " |",
        "|---|---|---|---|---|" + "---:|" * (len(shown) + len(peers)),
    ]
    for path in ("same", "tcp"):
        rows: list[tuple[str, Any]] = [(op, k) for op in ("WRITE", "READ") for k in PER_OP]
        rows += [("-", k) for k in ONCE] + [("-", k) for k in AIOXFER_ONLY[path]]
        for op, key in rows:
            label, rop, size, _, unit, _ = WORKLOADS[key]
            lim = res.med([res.limit(r, path, op, key)[0] for r in res.runs])
            lname = next((res.limit(r, path, op, key)[1] for r in res.runs), "")
            cma = res.med([res.limit(r, path, op, key, "cma")[0] for r in res.runs])
            lcell = "–" if lim is None else f"{fmt(lim, unit)} {lname}"
            if cma is not None:
                lcell += f"; {fmt(cma, unit)} CMA"
            cells = []
            systems = (("aioxfer", "before", *MODES) if key in AIOXFER_ONLY[path]
                       else ("nixl", "mooncake", "aioxfer", "before", *MODES))
            for system in shown:
                f = res.fig_med(path, system, op, key) if system in systems else None
                if f is None:
                    cells.append("–")
                    continue
                c = fmt(f, unit)
                rl = res.ratio_med(path, system, op, key, "limit")
                if system in MODES:  # a mode: its figure against NIXL's
                    rl = res.ratio_med(path, system, op, key, "nixl")
                    if rl is not None:
                        c += f" ({fmt_ratio(rl)} NIXL)"
                elif rl is not None:
                    c += f" ({fmt_ratio(rl)})"
                peer, tr = SYSTEMS[path][system]
                if not res.verified_ok(peer, tr, rop.format(op=op), size):
                    c += " **NOT VERIFIED**"
                cells.append(c)
            vs = [fmt_ratio(res.ratio_med(path, "aioxfer", op, key, p)) for p in peers]
            opcell = op if op != "-" else ""
            out.append(f"| {PATHS[path]} | {opcell} | {label} | {unit} | {lcell} | "
                       + " | ".join(cells + vs) + " |")
    return out


def modes_run(res: Results) -> tuple[str, ...]:
    return tuple(m for m in MODES if any(k[1] == f"aioxfer-{m}" for k in res.idx))


def cpu_table(res: Results) -> list[str]:
    """CPU seconds per GB moved, both processes together (initiator and target:
    every thread, progress threads and copy workers included), median of rounds."""
    peers = res.compared()
    shown = (*peers[:2], "aioxfer", *modes_run(res), *peers[2:])
    out = ["| path | op | workload | " + " | ".join(NAMES[p] for p in shown) + " |",
           "|---|---|---|" + "---:|" * len(shown)]
    for path in ("same", "tcp"):
        for op in ("WRITE", "READ"):
            for key in CPU_ROWS:
                cells = [fmt(res.med([res.cpu_per_gb(r, path, system, op, key)
                                      for r in res.runs])) for system in shown]
                out.append(f"| {PATHS[path]} | {op} | {WORKLOADS[key][0]} | "
                           + " | ".join(cells) + " |")
    return out


def floor_table(res: Results) -> list[str]:
    """tcp one at a time against the request/answer floor (bench_limits.py tcpfloor):
    what plain C over the same loopback does when each request waits for its answer,
    which a streaming limit (iperf3) does not."""
    peers = res.compared()
    shown = (*peers[:2], "aioxfer", *peers[2:])
    out = ["| op | workload | floor (C, conns) | " + " | ".join(f"{NAMES[p]} ÷ floor"
                                                            for p in shown) + " |",
           "|---|---|---|" + "---:|" * len(shown)]
    rows = 0
    for op in ("WRITE", "READ"):
        for key in (*FLOOR_SIZES, "lat", "batch"):
            fl = res.med([res.limit(r, "tcp", op, key, "floor")[0] for r in res.runs])
            if fl is None:
                continue
            size = 4 * KiB if key == "lat" else BATCH if key == "batch" else key
            conns = sorted({f"{res.idx[k].get('conns')}{'p' if res.idx[k].get('polled') else ''}"
                            for k in res.idx
                            if k[1:] == ("limit", "tcp-loopback", f"reqack_{op}", size)})
            cells = [fmt_ratio(res.ratio_med("tcp", system, op, key, "floor")) for system in shown]
            unit = "µs" if key == "lat" else "GB/s"
            out.append(f"| {op} | {WORKLOADS[key][0]} | {fmt(fl)} {unit} ({'/'.join(conns)}) | "
                       + " | ".join(cells) + " |")
            rows += 1
    return out if rows else []


def targets(res: Results, table: list[dict[str, Any]] = TARGETS) -> list[str]:
    out = ["| target | measured (aioxfer ÷ reference, median of rounds) | status |",
           "|---|---|---|"]
    met = missed = 0
    for t in table:
        if t["cmp"] is None:
            out.append(f"| {t['text']} | {t['note']} | not measured |")
            continue
        parts: list[str] = []
        worst: tuple[float, str, float] | None = None  # (v / thr, instance, v)
        missing = False
        for op in t["ops"]:
            for key in t["work"]:
                v = res.ratio_med(t["path"], "aioxfer", op, key, t["vs"])
                unit = WORKLOADS[key][4]
                what = size_label(key) if isinstance(key, int) else WORKLOADS[key][0]
                if t["vs"] is not None and not isinstance(key, int):
                    what = what.split(",")[0]
                    if what.count("(") > what.count(")"):  # a comma inside parentheses
                        what = what.split(" (")[0]
                name = f"{op} {what}" if op != "-" else what
                if v is None:
                    missing = True
                    parts.append(f"{name}: n/a")
                    continue
                shown = fmt_ratio(v) if t["vs"] else f"{fmt(v, unit)} {unit}"
                parts.append(f"{name}: {shown}")
                q = v / t["thr"]
                # the worst instance: the smallest q for a floor, the largest for a ceiling
                if worst is None or (q < worst[0] if t["cmp"] == ">=" else q > worst[0]):
                    worst = (q, name, v)
        if worst is None or missing:
            status = "not measured (figures missing)"
        else:
            q, name = worst[0], worst[1]
            if t["cmp"] == ">=":
                ok = q >= 1
                how = (f"{(q - 1) * 100:+.0f}% over the floor" if ok
                       else f"short by {(1 - q) * 100:.0f}%")
            else:
                ok = q <= 1
                how = f"{(1 - q) * 100:.0f}% under the ceiling" if ok else f"{q:.2f}× the ceiling"
            met, missed = met + ok, missed + (not ok)
            status = f"**{'met' if ok else 'missed'}**: {how}"
            if len(parts) > 1:
                status += f" (worst: {name})"
        out.append(f"| {t['text']} | {'; '.join(parts)} | {status} |")
    out.append("")
    out.append(f"Targets met: {met}, missed: {missed}, of {len(table)}.")
    return out


def summarize(directory: str) -> str:
    recs = []
    for f in sorted(glob.glob(os.path.join(directory, "run_*.jsonl"))):
        with open(f) as fh:
            recs += [json.loads(line) for line in fh if line.strip()]
    if not recs:
        return f"no records under {directory}\n"
    res = Results(recs)
    meta = res.meta[0] if res.meta else {}
    lines = [
        f"## aioxfer side by side with NIXL and Mooncake ({meta.get('when', '?')})",
        "",
        f"{meta.get('machine', '')}; rounds: {len(res.runs)}"
        + (f" ({meta['mode']})" if meta.get("mode") else "")
        + ". Figures are medians over rounds; (×) is the figure ÷ the limit in the limit "
        "column, and aioxfer ÷ peer is aioxfer's figure ÷ the peer's, each taken within one "
        "round, then the median. For µs, lower is better (so below 1× is better). Same host: "
        "NIXL is UCX (CMA), progress thread on the target; Mooncake has no same-host transport, "
        "so its figures there are its TCP ones. tcp: NIXL with UCX_TLS=tcp, aioxfer with "
        'transports=("tcp",) on both agents.',
        "",
        *table(res),
        "",
    ]
    bad = [r for r, ok in res.checks if not ok]
    lines.append(f"Data verified (CRC32 of the destination): {len(res.checks) - len(bad)} of "
                 f"{len(res.checks)} checks passed"
                 + ("." if not bad else ": FAILED " + ", ".join(
                     f"{r['peer']}/{r.get('transport')} {r['op']} {r['size']}" for r in bad)))
    inline = sorted({(r["peer"], r.get("transport", ""), r["inline_bytes"])
                     for r in recs if "inline_bytes" in r})
    if inline:  # which path aioxfer's lone same-host rows took (calibrated per process)
        lines.append("aioxfer's inline threshold (a lone same-host request up to it is copied "
                     "by the posting thread): " + ", ".join(
                         f"{p}/{t} {n / 2**20:g} MiB" for p, t, n in inline) + ".")
    for r in res.errors:
        lines.append(f"- error, round {r['run']}, {r['peer']} {r.get('transport', '')} "
                     f"{r.get('op', '')}: {str(r['error'])[:200]}")
    lines += ["", "### CPU seconds per GB moved (initiator + target, every thread)", "",
              "Lower is better; \"aioxfer\" is its default progress mode (adaptive).", "",
              *cpu_table(res), ""]
    floor = floor_table(res)
    if floor:
        lines += ["", "### tcp one at a time against the request/answer floor", "",
                  "The floor: plain C over the same loopback (bench_limits.py tcpfloor), each "
                  "request waiting for its answer, over 1 or 2 connections, receivers asleep in "
                  "recv or polling it (p), the best of the four per round (which: beside the "
                  "figure). GB/s ÷ floor above 1× would be faster than the floor; for µs, lower "
                  "is better.", "", *floor, ""]
    lines += ["", "### Targets (issue 3)", "", *targets(res), ""]
    lines += ["", "### Targets (issue 13: one request awaited at a time, connect, batches)", "",
              *targets(res, TARGETS_13), ""]
    return "\n".join(lines)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    d = sys.argv[1] if len(sys.argv) > 1 else None
    if d is None:  # the latest run
        runs = sorted(glob.glob(os.path.join(here, "results", "*", "")))
        if not runs:
            sys.exit("no results yet: run run.py first")
        d = runs[-1]
    sys.stdout.write(summarize(d))


if __name__ == "__main__":
    main()

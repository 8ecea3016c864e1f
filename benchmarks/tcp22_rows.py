"""Issue 13's tcp one-at-a-time rows, alone and interleaved (read22): 64 KiB
and 1 MiB WRITE and READ (and the 256 x 16 KiB batch) through the peers'
own harness (benchmarks/peers/bench_*.py: the same workloads, timing loops
and checks as run.py), for aioxfer builds A and B, Mooncake and NIXL-tcp,
round by round in an order rotated each round, then medians and ratios.

Each system runs with common.SIZES and common.QDS cut to those rows,
BENCH_CONNECT_SAMPLES=1, and bench_aioxfer's extra rows (the 256 in flight
Python path, the post rate, register 1 GiB, uvloop) left out, so a round
takes ~1 minute instead of run.py's ~6.

    python3 benchmarks/tcp22_rows.py --a /tmp/vM22/bin/python --b /tmp/vX/bin/python \\
        --rounds 2 --out /tmp/r22.jsonl      # through /work/benchlock, cwd /
    python3 benchmarks/tcp22_rows.py --table /tmp/r22.jsonl   # several files: pooled

The table: each row's median GB/s over the rounds per system, B / A, and
aioxfer's rows over Mooncake's and NIXL-tcp's (medians of the per-round
ratios, every system of a round measured within the same minute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
VENVS = os.path.expanduser("~/.cache/aioxfer-peers")
KiB, MiB = 1 << 10, 1 << 20

# Runs a peer script with common's workload lists cut; the script's own main.
WRAP = r"""
import importlib.util, os, sys
peers, script, sizes = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, peers)
import common
common.SIZES = [int(s) for s in sizes.split(",")]
common.QDS = ()
if os.environ.get("TCP22_COUNT"):  # counting one row's switches: the batch row runs once
    import time as _t
    _prep, _tl, _atl, _in_batch = common.prepare_batch, common.timed_loop, common.atimed_loop, []
    def _prepare_batch(*a, **k):
        _in_batch.append(1)
        return _prep(*a, **k)
    def _timed_loop(op, *a, **k):
        if _in_batch:
            t = _t.perf_counter(); op(); return 1, _t.perf_counter() - t
        return _tl(op, *a, **k)
    async def _atimed_loop(op, *a, **k):
        if _in_batch:
            t = _t.perf_counter(); await op(); return 1, _t.perf_counter() - t
        return await _atl(op, *a, **k)
    common.prepare_batch, common.timed_loop, common.atimed_loop = (
        _prepare_batch, _timed_loop, _atimed_loop)
spec = importlib.util.spec_from_file_location("bench_mod", os.path.join(peers, script))
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
if script == "bench_aioxfer.py":
    async def _skip(*a, **k): return None
    m.python_path = m.post_rate = m.uvloop_pass = _skip
    m.register_1gib = lambda *a, **k: None
sys.argv = [os.path.join(peers, script)] + sys.argv[4:]
m.main()
"""


def systems(ns: argparse.Namespace) -> dict[str, tuple[str, str, list[str], dict[str, str]]]:
    """name -> (python, script, args, extra environment)."""
    out = {
        "A": (ns.a, "bench_aioxfer.py", ["--transport", "tcp", "--label", "A"], {}),
        "mooncake": (os.path.join(VENVS, "venv-mooncake", "bin", "python"),
                     "bench_mooncake.py", [], {}),
        "nixl_tcp": (os.path.join(VENVS, "venv-nixl", "bin", "python"), "bench_nixl.py",
                     ["--prog-thread", "target"], {"UCX_TLS": "tcp"}),
    }
    if ns.b:
        benv = dict(kv.split("=", 1) for kv in ns.b_env.split(",") if kv)
        out["B"] = (ns.b, "bench_aioxfer.py", ["--transport", "tcp", "--label", "B"], benv)
    return {k: out[k] for k in ns.systems.split(",") if k in out}


def run_round(ns: argparse.Namespace, rnd: int) -> None:
    sy = systems(ns)
    names = list(sy)
    k = rnd % len(names)
    names = names[k:] + names[:k]  # no system always first
    env = dict(os.environ, BENCH_CONNECT_SAMPLES="1", UCX_NET_DEVICES="lo",
               MC_TCP_BIND_ADDRESS="127.0.0.1", BENCH_RUN_ID=str(rnd))
    for name in names:
        py, script, args, extra = sy[name]
        t0 = time.monotonic()
        p = subprocess.run([py, "-c", WRAP, PEERS, script, ns.sizes, "--ops", ns.ops, *args],
                           env=dict(env, BENCH_PHASE=name, **extra), capture_output=True,
                           text=True, timeout=170, cwd="/")
        recs = []
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                r["sys"], r["round"] = name, rnd
                recs.append(r)
        with open(ns.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        bad = [r for r in recs if r.get("verified") is False]
        print(f"round {rnd} {name}: {len(recs)} records, {time.monotonic() - t0:.0f} s"
              + (f" rc={p.returncode} {p.stderr[-400:]}" if p.returncode else "")
              + (f" UNVERIFIED {len(bad)}" if bad else ""), file=sys.stderr, flush=True)


def table(paths: list[str]) -> None:
    recs = [json.loads(x) for p in paths for x in open(p)]
    # round key: file + round (several files pooled)
    by: dict[tuple[str, str], dict[str, float]] = {}
    for i, p in enumerate(paths):
        for x in open(p):
            r = json.loads(x)
            if "gbps" not in r or r["op"].startswith("first"):
                continue
            row = f"{r['op']} {r['size'] // KiB} KiB" if "batch" not in r["op"] else r["op"]
            by.setdefault((row, f"{i}.{r['round']}"), {})[r["sys"]] = r["gbps"]
    rows = sorted({k[0] for k in by}, key=lambda s: (s.split()[0], len(s), s))
    sysn = [s for s in ("A", "B", "mooncake", "nixl_tcp") if any(r["sys"] == s for r in recs)]
    print("| row | " + " | ".join(f"{s} GB/s" for s in sysn)
          + " | B/A | A/mc | B/mc | A/nixl | B/nixl | rounds |")
    print("|---" * (len(sysn) + 7) + "|")
    for row in rows:
        rs = [v for (r, _), v in by.items() if r == row]
        med = {s: statistics.median([v[s] for v in rs if s in v]) if any(s in v for v in rs)
               else float("nan") for s in sysn}

        def ratio(x: str, y: str, rs: list[dict[str, float]] = rs) -> str:
            q = [v[x] / v[y] for v in rs if x in v and y in v and v[y] > 0]
            if not q:
                return "-"
            return f"{statistics.median(q):.2f} [{min(q):.2f}..{max(q):.2f}]"
        print(f"| {row} | " + " | ".join(f"{med[s]:.3f}" for s in sysn)
              + f" | {ratio('B', 'A')} | {ratio('A', 'mooncake')} | {ratio('B', 'mooncake')}"
              f" | {ratio('A', 'nixl_tcp')} | {ratio('B', 'nixl_tcp')} | {len(rs)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", help="Python of build A (e.g. main's wheel venv)")
    ap.add_argument("--b", help="Python of build B")
    ap.add_argument("--b-env", default="",
                    help="NAME=V,... for build B only (tcp24: one wheel, a setting switched)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first-round", type=int, default=0)
    ap.add_argument("--sizes", default=f"{64 * KiB},{MiB}")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--systems", default="A,B,mooncake,nixl_tcp")
    ap.add_argument("--out", default="/tmp/tcp22_rows.jsonl")
    ap.add_argument("--table", nargs="*", help="print the table of these files and exit")
    ns = ap.parse_args()
    if ns.table:
        table(ns.table)
        return
    for rnd in range(ns.first_round, ns.first_round + ns.rounds):
        run_round(ns, rnd)
    table([ns.out])


if __name__ == "__main__":
    main()

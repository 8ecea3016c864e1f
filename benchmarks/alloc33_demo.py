"""The demo as a user runs it (README's first command), builds interleaved:
per run its wall time (process start to exit) and the throughput it prints
(its whole transfer window, ~0.1 s: the first second's), then per build the
medians and the per-pair ratios to the first build's.

    cd / && python /path/benchmarks/alloc33_demo.py -n 5 \
        --python /tmp/before/bin/python --python /tmp/after/bin/python

--settle S sleeps S s before each run (0: back to back, as a user repeating it).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--settle", type=float, default=0.0)
    ap.add_argument("--python", action="append", required=True)
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {py: [] for py in args.python}
    for i in range(args.n):
        for py in args.python if i % 2 == 0 else args.python[::-1]:
            time.sleep(args.settle)
            t0 = time.perf_counter()
            out = subprocess.run([py, "-m", "aioxfer", "demo", "--no-progress"],
                                 capture_output=True, text=True, check=True, timeout=300, cwd="/")
            wall = time.perf_counter() - t0
            m = re.search(r"throughput: ([0-9.]+) GB/s", out.stdout)
            if m is None or "verification: ok" not in out.stdout:
                raise SystemExit(f"{py}: unexpected demo output:\n{out.stdout}\n{out.stderr}")
            got[py].append((wall, float(m.group(1))))
            print(f"{py}: wall {wall:.2f} s, throughput {m.group(1)} GB/s", flush=True)
    base = got[args.python[0]]
    for py in args.python:
        s = got[py]
        wr = [a[0] / b[0] for a, b in zip(s, base, strict=True)]
        tr = [a[1] / b[1] for a, b in zip(s, base, strict=True)]
        print(f"{py}: n={len(s)}: wall {statistics.median(x[0] for x in s):.2f} s"
              f" (pair ratio {statistics.median(wr):.3f}), throughput"
              f" {statistics.median(x[1] for x in s):.2f} GB/s (pair ratio"
              f" {statistics.median(tr):.3f})")


if __name__ == "__main__":
    sys.exit(main())

"""What a pool costs its owner, warm and cold: agent.alloc(n) and its first
fill, per build and size, after a settling pause.

Why a pause: on a VM with free page reporting (Firecracker here:
page_reporting_order on the kernel's command line) memory freed a few
seconds ago goes back to the host, and the next 2 MiB pages come from it:
the kernel's zeroing of each (at alloc, where the pool is collapsed into
huge pages) then faults on the host, 4-15 ms per 2 MiB instead of ~0.2 ms.
--settle S sleeps S s before each sample (cold: S >= 7 here); 0 runs them
back to back (warm: each reuses the memory the last one freed).

Fresh processes, builds interleaved (the order flips every round); per
sample the wall time of alloc and of filling the pool (numpy fill: the
owner's first touch of every page); then per build and size the medians
and the per-pair ratio of alloc + fill to the first build's.

    python benchmarks/alloc33_alloc.py -n 5 --mib 64,512,1024 --settle 0 \
        --python /tmp/before/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import asyncio, json, sys, time
import aioxfer

async def main(n: int) -> None:
    async with aioxfer.Agent("owner") as agent:
        t0 = time.perf_counter()
        region = agent.alloc(n, name="pool")
        t1 = time.perf_counter()
        region.numpy().fill(1)
        t2 = time.perf_counter()
        print(json.dumps({"alloc": (t1 - t0) * 1e3, "fill": (t2 - t1) * 1e3}))

asyncio.run(main(int(sys.argv[1])))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--mib", default="64,512,1024", help="pool sizes, MiB, comma-separated")
    ap.add_argument("--settle", type=float, default=0.0, help="s to sleep before each sample")
    ap.add_argument("--python", action="append", required=True)
    args = ap.parse_args()
    sizes = [int(x) for x in args.mib.split(",")]
    got: dict[tuple[str, int], list[dict[str, float]]] = {
        (py, mib): [] for py in args.python for mib in sizes
    }
    for i in range(args.n):
        for mib in sizes:
            for py in args.python if i % 2 == 0 else args.python[::-1]:
                time.sleep(args.settle)
                out = subprocess.run([py, "-c", CHILD, str(mib << 20)], capture_output=True,
                                     text=True, check=True, timeout=120)
                got[py, mib].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = args.python[0]
    for mib in sizes:
        for py in args.python:
            s = got[py, mib]
            tot = [x["alloc"] + x["fill"] for x in s]
            ratio = [t / (b["alloc"] + b["fill"])
                     for t, b in zip(tot, got[base, mib], strict=True)]
            alloc = statistics.median(x["alloc"] for x in s)
            fill = statistics.median(x["fill"] for x in s)
            print(f"{py}: {mib} MiB, settle {args.settle:g} s, n={len(s)}: alloc {alloc:.1f} ms"
                  f" (min {min(x['alloc'] for x in s):.1f}, max {max(x['alloc'] for x in s):.1f}),"
                  f" fill {fill:.1f} ms, alloc + fill {statistics.median(tot):.1f} ms;"
                  f" pair ratio {statistics.median(ratio):.3f}")


if __name__ == "__main__":
    sys.exit(main())

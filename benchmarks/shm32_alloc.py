"""What a pool costs its owner: agent.alloc(n) and its first fill, per build.

Fresh processes, builds interleaved; per sample the wall time of alloc
(where a build collapses the pool into huge pages, that is here) and of
filling it (numpy fill: the owner's first touch of every page), then the
medians and each build's per-pair ratio of alloc + fill to the first build's.

    python benchmarks/shm32_alloc.py -n 15 --mib 64 \
        --python /tmp/before/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--python", action="append", required=True)
    args = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {py: [] for py in args.python}
    for i in range(args.n):
        for py in args.python if i % 2 == 0 else args.python[::-1]:
            out = subprocess.run([py, "-c", CHILD, str(args.mib << 20)], capture_output=True,
                                 text=True, check=True, timeout=60)
            got[py].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = args.python[0]
    for py in args.python:
        s = got[py]
        tot = [x["alloc"] + x["fill"] for x in s]
        ratio = [t / (b["alloc"] + b["fill"]) for t, b in zip(tot, got[base], strict=True)]
        alloc = statistics.median(x["alloc"] for x in s)
        fill = statistics.median(x["fill"] for x in s)
        print(f"{py}: {args.mib} MiB, n={len(s)}: alloc {alloc:.2f} ms, fill {fill:.2f} ms,"
              " alloc + fill"
              f" {statistics.median(tot):.2f} ms; pair ratio {statistics.median(ratio):.3f}")


if __name__ == "__main__":
    sys.exit(main())

"""Concurrent puts overflowing the host tier to a PeerTier member (kv26).

A writer store whose host tier holds 2 blocks (every put overflows) and one
member, a second process (the owner of every block: two members, one
replica). A round is ``--puts`` concurrent puts of ``--blocks`` fresh keys
each (``--block-kib`` KiB blocks, each put from its own part of one
registered source); its time is from the first put's call to the last
one's return. Printed: the median round (ms), the blocks stored and
dropped (why), as one JSON line.

    python benchmarks/kv26_overflow.py                  # one run, this interpreter
    python benchmarks/kv26_overflow.py --compare /tmp/vA/bin/python /tmp/vB/bin/python \\
        --pairs 5                                       # A/B runs interleaved

``--compare`` runs this script under each interpreter in turn (A, B, A, B,
...: a noisy shared machine hits both alike), each in its own processes with
cwd ``/`` (so each imports its own installed aioxfer), and prints each pair's
medians, the median of each side and the ratio B/A of those medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any

# KV26_CTL_COPY_WORKERS=n (environment): the tier's control agent (its
# name ends ".kvctl") is made with copy_workers=n, in both processes, by
# wrapping the constructor the tier calls (kv29: what its copy workers do
# to a round).
CTL_WORKERS = textwrap.dedent('''
    import os
    import aioxfer, aioxfer.kv.peer as _kp
    _n = os.environ.get("KV26_CTL_COPY_WORKERS")
    if _n:
        class _Mod:
            """aioxfer, but its Agent given copy_workers for a control agent."""
            def __getattr__(self, a):
                return getattr(aioxfer, a)

            @staticmethod
            def Agent(name, **kw):
                if name.endswith(".kvctl"):
                    kw["copy_workers"] = int(_n)
                return aioxfer.Agent(name, **kw)
        _kp.aioxfer = _Mod()
''')

OWNER = CTL_WORKERS + textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        bb, slots = int(sys.argv[1]), int(sys.argv[2])
        async with aioxfer.Agent("kv26b-owner") as agent:
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(slots * bb), kv.PeerTier(group="kv26b")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    exec(CTL_WORKERS, {})
    import aioxfer
    from aioxfer import kv

    bb = args.block_kib << 10
    per_round = args.puts * args.blocks
    total = (args.rounds + args.warmup) * per_round
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, str(bb), str(total + 64), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd="/")
    assert proc.stdout is not None and proc.stdin is not None
    try:
        address = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the owner did not start"
        async with aioxfer.Agent("kv26b-writer") as agent:
            src = agent.alloc(per_round * bb)
            src.numpy()[:] = np.random.default_rng(26).integers(0, 256, per_round * bb,
                                                                dtype=np.uint8)
            tier = kv.PeerTier(group="kv26b")
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    # (put_wait=0: a put takes what room there is at once,
                    # else each round waited 50 ms for the 2 slots' write-back)
                    kv.HostTier(2 * bb, high_watermark=1.0, low_watermark=1.0, put_wait=0),
                    tier]) as store:
                assert await tier.join(address)
                times: list[float] = []
                stored = dropped = 0
                seed = 0
                for r in range(args.warmup + args.rounds):
                    puts = []
                    for p in range(args.puts):
                        seed += 1
                        keys = kv.chain(np.arange(16 * args.blocks) + seed * 10_000_000,
                                        block_tokens=16, namespace=b"kv26b")
                        off = p * args.blocks * bb
                        puts.append(store.put(keys, src[off:off + args.blocks * bb]))
                    t0 = time.perf_counter()
                    res = await asyncio.gather(*puts)
                    took = time.perf_counter() - t0
                    if r >= args.warmup:
                        times.append(took)
                        stored += sum(x.stored for x in res)
                        dropped += sum(x.dropped for x in res)
                why = dict(store.statistics().tiers["peer"].dropped_stores)
        return {"python": sys.executable, "round_ms": statistics.median(times) * 1e3,
                "ctl_copy_workers": os.environ.get("KV26_CTL_COPY_WORKERS", "default"),
                "rounds_ms": [round(t * 1e3, 2) for t in times], "stored": stored,
                "dropped": dropped, "dropped_why": why}
    finally:
        if proc.returncode is None:
            proc.stdin.write(b"\n")
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def compare(args: argparse.Namespace) -> int:
    a_py, b_py = args.compare
    me = os.path.abspath(__file__)
    own = ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--puts",
           str(args.puts), "--blocks", str(args.blocks), "--block-kib", str(args.block_kib)]
    side: dict[str, list[float]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        got = {}
        # Alternate which side goes first (the second of a pair may run warmer).
        order = [("A", a_py), ("B", b_py)] if pair % 2 == 0 else [("B", b_py), ("A", a_py)]
        for tag, py in order:
            out = subprocess.run([py, me, *own], cwd="/", capture_output=True, text=True,
                                 timeout=170, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            got[tag] = res
            side[tag].append(res["round_ms"])
        print(f"pair {pair}: A {got['A']['round_ms']:.2f} ms (dropped {got['A']['dropped']}), "
              f"B {got['B']['round_ms']:.2f} ms (dropped {got['B']['dropped']} "
              f"{got['B']['dropped_why']})", flush=True)
    ma, mb = statistics.median(side["A"]), statistics.median(side["B"])
    print(json.dumps({"A": a_py, "B": b_py, "median_A_ms": round(ma, 2),
                      "median_B_ms": round(mb, 2), "ratio_B_over_A": round(mb / ma, 3),
                      "A_ms": [round(x, 2) for x in side["A"]],
                      "B_ms": [round(x, 2) for x in side["B"]]}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--puts", type=int, default=8, help="concurrent puts per round")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per put")
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compare", nargs=2, metavar=("PYTHON_A", "PYTHON_B"))
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

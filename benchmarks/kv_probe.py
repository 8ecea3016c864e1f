"""PeerTier members under gets and under overflowing puts (kv31: probes of
different members at once, each into stage buckets of its own, and staged
pulls in parts of their own, instead of one after another under one lock).

``get`` (default):
A reader store whose host tier holds 2 blocks and two members, each a
process of its own (three members in all, one replica: a reader probes the
top two owners of each key other than itself, so most gets probe both
members). ``--keys`` blocks (``--block-kib`` KiB) are put once (they
overflow to their owners); a round is one get of ``--blocks`` consecutive
of them (host tier misses: a probe of the members, then the reads). Printed:
the median get (ms), the blocks found, as one JSON line.

``put``: the same reader and members, the members' host tiers of
``--member-slots`` blocks (full after the first rounds: every pull goes
through their pull staging). A round is ``--puts`` concurrent puts of
``--blocks`` fresh keys each; printed: the median round (ms), as "get_ms".

    python benchmarks/kv_probe.py                      # one run, this interpreter
    python benchmarks/kv_probe.py put --member-slots 16
    python benchmarks/kv_probe.py --compare /tmp/vA/bin/python /tmp/vB/bin/python \\
        --pairs 5                                      # A/B runs interleaved

``--compare`` runs this script under each interpreter in turn (A, B, then
B, A, ...), each in its own processes with cwd ``/`` (so each imports its
own installed aioxfer), and prints each pair's medians, the median of each
side and the ratio B/A of those medians.
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

MEMBER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        bb, slots = int(sys.argv[1]), int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[3]) as agent:
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(slots * bb), kv.PeerTier(group="kv31b")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import aioxfer
    from aioxfer import kv

    bb = args.block_kib << 10
    procs = []
    try:
        addresses = []
        for i in range(2):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", MEMBER, str(bb),
                str(args.member_slots if args.what == "put" else 2 * args.keys + 64),
                f"kv31b-m{i}",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd="/")
            procs.append(proc)
            assert proc.stdout is not None
            address = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
            assert address, "a member did not start"
            addresses.append(address)
        async with aioxfer.Agent("kv31b-reader") as agent:
            src = agent.alloc(args.keys * bb)
            src.numpy()[:] = np.random.default_rng(31).integers(0, 256, args.keys * bb,
                                                                dtype=np.uint8)
            dst = agent.alloc(args.blocks * bb)
            tier = kv.PeerTier(group="kv31b")
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(2 * bb, high_watermark=1.0, low_watermark=1.0, put_wait=0),
                    tier]) as store:
                for address in addresses:
                    assert await tier.join(address)
                if args.what == "put":
                    return await puts(args, store, src, bb)
                keys = kv.chain(np.arange(16 * args.keys), block_tokens=16, namespace=b"kv31b")
                for i in range(0, args.keys, 64):
                    await store.put(keys[i:i + 64], src[i * bb:min(args.keys, i + 64) * bb])
                times: list[float] = []
                found = 0
                starts = range(0, args.keys - args.blocks + 1, args.blocks)
                for r in range(args.warmup + args.rounds):
                    i = starts[r % len(starts)]
                    t0 = time.perf_counter()
                    res = await store.get(keys[i:i + args.blocks], dst[0:args.blocks * bb])
                    took = time.perf_counter() - t0
                    if r >= args.warmup:
                        times.append(took)
                        found += res.prefix
        return {"python": sys.executable, "get_ms": statistics.median(times) * 1e3,
                "found": found, "of": args.rounds * args.blocks}
    finally:
        for proc in procs:
            if proc.returncode is None:
                assert proc.stdin is not None
                proc.stdin.write(b"\n")
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def puts(args: argparse.Namespace, store: Any, src: Any, bb: int) -> dict[str, Any]:
    import numpy as np

    from aioxfer import kv

    times: list[float] = []
    stored = dropped = seed = 0
    per = args.blocks
    for r in range(args.warmup + args.rounds):
        ops = []
        for p in range(args.puts):
            seed += 1
            keys = kv.chain(np.arange(16 * per) + seed * 10_000_000, block_tokens=16,
                            namespace=b"kv31p")
            off = (p * per) % max(1, args.keys - per + 1)
            ops.append(store.put(keys, src[off * bb:(off + per) * bb]))
        t0 = time.perf_counter()
        res = await asyncio.gather(*ops)
        took = time.perf_counter() - t0
        if r >= args.warmup:
            times.append(took)
            stored += sum(x.stored for x in res)
            dropped += sum(x.dropped for x in res)
    return {"python": sys.executable, "get_ms": statistics.median(times) * 1e3,
            "found": stored, "of": stored + dropped,
            "dropped_why": dict(store.statistics().tiers["peer"].dropped_stores)}


def compare(args: argparse.Namespace) -> int:
    a_py, b_py = args.compare
    me = os.path.abspath(__file__)
    own = [args.what, "--member-slots", str(args.member_slots), "--puts", str(args.puts),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--keys",
           str(args.keys), "--blocks", str(args.blocks), "--block-kib", str(args.block_kib)]
    side: dict[str, list[float]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        got = {}
        order = [("A", a_py), ("B", b_py)] if pair % 2 == 0 else [("B", b_py), ("A", a_py)]
        for tag, py in order:
            out = subprocess.run([py, me, *own], cwd="/", capture_output=True, text=True,
                                 timeout=170, check=True)
            got[tag] = json.loads(out.stdout.strip().splitlines()[-1])
            side[tag].append(got[tag]["get_ms"])
        print(f"pair {pair}: A {got['A']['get_ms']:.3f} ms (found {got['A']['found']}), "
              f"B {got['B']['get_ms']:.3f} ms (found {got['B']['found']})", flush=True)
    ma, mb = statistics.median(side["A"]), statistics.median(side["B"])
    print(json.dumps({"A": a_py, "B": b_py, "median_A_ms": round(ma, 3),
                      "median_B_ms": round(mb, 3), "ratio_B_over_A": round(mb / ma, 3),
                      "A_ms": [round(x, 3) for x in side["A"]],
                      "B_ms": [round(x, 3) for x in side["B"]]}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="get", choices=("get", "put"))
    ap.add_argument("--keys", type=int, default=256, help="blocks put (overflowing)")
    ap.add_argument("--member-slots", type=int, default=16, help="put: members' host tiers")
    ap.add_argument("--puts", type=int, default=8, help="put: concurrent puts per round")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per get")
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--compare", nargs=2, metavar=("PYTHON_A", "PYTHON_B"))
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What aioxfer.nixl adds per request over aioxfer's own API, in microseconds.

One initiator process holds both: an aioxfer.nixl agent (driven as vLLM and
NIXL's benchmarks drive it: ``transfer`` then ``check_xfer_state`` until
DONE) and a native ``aioxfer.Agent`` (awaiting ``agent.read``/``write``),
each with its own target process (bench_nixl_compat's, 16 MiB of numpy
memory). For each workload the two take turns of ``--slice`` seconds, many
times, in the same process, so a busy, shared machine slows both alike; the
figures are per request: wall time (the best turn: what the code costs when
nothing else runs; and the median turn) and the CPU time of the whole
process (the copy workers and the loop thread included; median), with the
median of the per-turn differences.

The last rows are vLLM-shaped: per request a new transfer from prepared
block lists (32 of 1024 blocks by a numpy index array, READ, the blocks in
two registered regions on the local side as vLLM's layers are), posted,
polled and released; natively, the two SegmentLists built from the indices
and read. They measure ``make_prepped_xfer`` and ``release_xfer_handle``
too, which the other rows (one prepared request, reposted) do not.

    python benchmarks/nixl_overhead.py                       # shm, WRITE and READ
    python benchmarks/nixl_overhead.py --transport tcp --reps 15
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

import bench_nixl_compat as bnc  # noqa: E402


def turn_sync(once: Callable[[], None], secs: float) -> tuple[float, float]:
    once()
    n = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while True:
        once()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= secs:
            return dt / n * 1e6, (time.process_time() - c0) / n * 1e6


async def turn_async(make: Callable[[], Any], secs: float) -> tuple[float, float]:
    await make()
    n = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while True:
        await make()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= secs:
            return dt / n * 1e6, (time.process_time() - c0) / n * 1e6


VLLM_BLOCKS = 32


def _vllm_indices() -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(7)
    return (rng.choice(bnc.NBLOCKS, VLLM_BLOCKS, replace=False).astype(np.int64),
            rng.choice(bnc.NBLOCKS, VLLM_BLOCKS, replace=False).astype(np.int64))


def vllm_like_compat(args: argparse.Namespace, target: bnc.Target, keep: list[Any],
                     _: Any) -> list[bnc.Workload]:
    """A new request per step, as vLLM's NIXL connector makes them."""
    import numpy as np

    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent("initiator-vllm", nixl_agent_config(enable_prog_thread=False,
                                                           backends=["UCX"]))
    buf = np.empty(bnc.BUF, dtype=np.uint8)
    keep += [agent, buf]
    half = bnc.BUF // 2
    laddr, raddr = buf.ctypes.data, target.hello["addr"]
    agent.register_memory([(laddr, half, 0, ""), (laddr + half, half, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(target.hello["md"]))
    rows = np.zeros((bnc.NBLOCKS, 3), dtype=np.uint64)
    rows[:, 1] = bnc.BLOCK
    rows[:, 0] = laddr + np.arange(bnc.NBLOCKS, dtype=np.uint64) * bnc.BLOCK
    lblocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows.copy(), "DRAM")
    rows[:, 0] = raddr + np.arange(bnc.NBLOCKS, dtype=np.uint64) * bnc.BLOCK
    rblocks = agent.prep_xfer_dlist(name, rows, "DRAM")
    li, ri = _vllm_indices()

    def once() -> None:
        h = agent.make_prepped_xfer("READ", lblocks, li, rblocks, ri)
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"transfer state {st}")
        agent.release_xfer_handle(h)

    ok = bnc.check(target, buf, "READ", 99, "batch", once, li=li, ri=ri)
    return [bnc.Workload("READ", f"vLLM-shaped {VLLM_BLOCKS} x 16 KiB by index (new request each)",
                         VLLM_BLOCKS * bnc.BLOCK, once, ok)]


def vllm_like_native(args: argparse.Namespace, target: bnc.Target,
                     loop: asyncio.AbstractEventLoop, keep: list[Any]) -> list[bnc.Workload]:
    import numpy as np

    import aioxfer

    kwargs = {"transports": ("tcp",)} if args.transport == "tcp" else {}
    agent = aioxfer.Agent("initiator-vllm", **kwargs)
    buf = np.empty(bnc.BUF, dtype=np.uint8)
    keep += [agent, buf]
    half = bnc.BUF // 2
    regions = [agent.register(buf[:half], name="kv0"), agent.register(buf[half:], name="kv1")]
    peer = loop.run_until_complete(agent.connect(target.hello["address"]))
    remote = peer.region("kv")
    li, ri = _vllm_indices()
    per = half // bnc.BLOCK

    def once() -> Any:
        lens = np.full(VLLM_BLOCKS, bnc.BLOCK, dtype=np.uint64)
        roffs = ri.astype(np.uint64) * bnc.BLOCK
        parts = []
        for k, region in enumerate(regions):
            sel = (li // per) == k
            if sel.any():
                parts.append(agent.read(
                    aioxfer.SegmentList(region, (li[sel] % per).astype(np.uint64) * bnc.BLOCK,
                                        lens[sel]),
                    aioxfer.SegmentList(remote, roffs[sel], lens[sel])))
        return asyncio.gather(*parts)

    def run() -> None:
        loop.run_until_complete(bnc._awaited(once))

    ok = bnc.check(target, buf, "READ", 99, "batch", run, li=li, ri=ri)
    return [bnc.Workload("READ", f"vLLM-shaped {VLLM_BLOCKS} x 16 KiB by index (new request each)",
                         VLLM_BLOCKS * bnc.BLOCK, once, ok)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--slice", type=float, default=0.05)
    ap.add_argument("--only", default="", help="workload labels to run, comma-separated")
    ap.add_argument("--memory", default="same", choices=["same", "separate"],
                    help="same (the default): compat and native copy between the same two "
                         "buffers (one target process serving its buffer through both APIs): "
                         "the same physical pages, whose placement alone moves a 1 MiB copy "
                         "by up to ~10 %%; separate: a buffer and a target each")
    args = ap.parse_args()
    args.same_memory = args.memory == "same"
    args.ops = args.ops.split(",")
    if args.transport == "tcp":
        os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    os.environ.setdefault("AIOXFER_LOG_LEVEL", "warning")
    keep: list[Any] = []
    targets = []
    try:
        shared = bnc.buffer() if args.same_memory else None
        args.system = "both" if args.same_memory else "compat"
        t_compat = bnc.Target(args)
        targets.append(t_compat)
        compat = bnc.nixl_like_workloads(args, t_compat, keep, shared)
        compat += vllm_like_compat(args, t_compat, keep, compat[0].once)
        if args.same_memory:
            t_native = t_compat
        else:
            args.system = "native"
            t_native = bnc.Target(args)
            targets.append(t_native)
        loop = asyncio.new_event_loop()
        native = bnc.native_workloads(args, t_native, loop, keep, shared)
        native += vllm_like_native(args, t_native, loop, keep)
        only = set(args.only.split(",")) if args.only else None
        print(f"{args.transport}: per request, µs (median of {args.reps} turns of "
              f"{args.slice} s each)"
              + ("; compat and native between the same two buffers" if args.same_memory
                 else ""))
        print("| op | workload | compat best | native best | compat speed ÷ native (best) "
              "| compat speed ÷ native (medians) "
              "| compat wall | native wall | Δ wall | compat CPU | native CPU | Δ CPU | data |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c, n in zip(compat, native, strict=True):
            assert (c.op, c.label) == (n.op, n.label)
            if only is not None and c.label not in only:
                continue
            cw: list[float] = []
            nw: list[float] = []
            cc: list[float] = []
            nc: list[float] = []
            for rep in range(args.reps):
                order = ("c", "n") if rep % 2 == 0 else ("n", "c")
                for who in order:
                    if who == "c":
                        w, cpu = turn_sync(c.once, args.slice)
                        cw.append(w)
                        cc.append(cpu)
                    else:
                        w, cpu = loop.run_until_complete(turn_async(n.once, args.slice))
                        nw.append(w)
                        nc.append(cpu)
            dw = statistics.median(a - b for a, b in zip(cw, nw, strict=True))
            dc = statistics.median(a - b for a, b in zip(cc, nc, strict=True))
            ok = "ok" if c.verified and n.verified else "NOT VERIFIED"
            print(f"| {c.op} | {c.label} | {min(cw):.1f} | {min(nw):.1f} | "
                  f"{min(nw) / min(cw):.2f}× | "
                  f"{statistics.median(nw) / statistics.median(cw):.2f}× | "
                  f"{statistics.median(cw):.1f} | "
                  f"{statistics.median(nw):.1f} | {dw:+.1f} | {statistics.median(cc):.1f} | "
                  f"{statistics.median(nc):.1f} | {dc:+.1f} | {ok} |", flush=True)
    finally:
        for t in targets:
            t.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

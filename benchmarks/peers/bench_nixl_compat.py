#!/usr/bin/env python3
"""The vLLM-shaped transfer path through aioxfer.nixl, real NIXL and aioxfer's
own API, side by side in one run.

Each system moves data between two processes (the initiator starts its target
as a child) over 127.0.0.1, between 16 MiB registered host buffers (user
memory: numpy arrays, as vLLM's KV caches are), for READ and WRITE:

- one request of 4 KiB, 64 KiB, 1 MiB, 16 MiB, repeated one at a time;
- 256 x 16 KiB by index: both pools prepared as 1024 16 KiB blocks, one
  request of 256 scattered block indices per side (vLLM's make_prepped_xfer).

NIXL-shaped systems (``nixl``: real NIXL 1.5.1 with UCX from its venv,
``compat``: aioxfer.nixl) prepare descriptor lists, make the request once and
repost it, polling ``check_xfer_state`` until DONE (what vLLM and NIXL's own
benchmark do). ``native`` awaits ``agent.read``/``agent.write`` of the same
Segment pair or SegmentList pair. Paths: ``shm`` (same host: NIXL's UCX picks
CMA; aioxfer shm) and ``tcp`` (UCX_TLS=tcp; aioxfer transports=("tcp",)).
Systems run one after another, in an order rotated every round; figures are
medians over rounds. Every workload's data is checked once (CRC32 of both
sides) before it is timed.

    python benchmarks/peers/bench_nixl_compat.py                     # 3 rounds
    python benchmarks/peers/bench_nixl_compat.py --rounds 1 --min-secs 0.1   # quick

``--nixl-python`` (default: $PEERS_VENVS/venv-nixl/bin/python, made by
install.sh) runs the real NIXL side; this script must also be importable by
it (it imports aioxfer only in the aioxfer systems).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

BUF = 16 << 20
BLOCK = 16 << 10
NBLOCKS = BUF // BLOCK
BATCH = 256
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
SYSTEMS = ["nixl", "compat", "native"]


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def fill(buf: np.ndarray, seed: int) -> None:
    buf[:] = (np.arange(buf.size, dtype=np.uint32) * seed % 251).astype(np.uint8)


def batch_indices(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.choice(NBLOCKS, BATCH, replace=False).astype(np.int64),
            rng.choice(NBLOCKS, BATCH, replace=False).astype(np.int64))


def gathered_crc(buf: np.ndarray, idx: np.ndarray) -> int:
    crc = 0
    for i in idx.tolist():
        crc = zlib.crc32(buf[i * BLOCK:(i + 1) * BLOCK], crc)
    return crc


# ---------------------------------------------------------------- target side


def target_main(args: argparse.Namespace) -> None:
    """Registers a 16 MiB buffer, sends its metadata and address on the
    control fd, then answers CRC requests from stdin until "exit"."""
    ctl = os.fdopen(args.ctl_fd, "w")
    buf = np.empty(BUF, dtype=np.uint8)
    fill(buf, 3)
    keep: Any = None
    if args.system == "native":
        import aioxfer

        async def serve() -> None:
            kwargs = {"transports": ("tcp",)} if args.transport == "tcp" else {}
            async with aioxfer.Agent("target", **kwargs) as agent:
                agent.register(buf, name="kv")
                ctl.write(json.dumps({"address": agent.address, "addr": buf.ctypes.data}) + "\n")
                ctl.flush()
                loop = asyncio.get_running_loop()
                while True:
                    line = await loop.run_in_executor(None, sys.stdin.readline)
                    if not answer(line, buf, ctl):
                        return

        asyncio.run(serve())
        return
    if args.system == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config
    else:
        from aioxfer.nixl import nixl_agent, nixl_agent_config
    agent = nixl_agent("target", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    keep = agent.register_memory([(buf.ctypes.data, BUF, 0, "")], "DRAM")
    ctl.write(json.dumps({"md": agent.get_agent_metadata().hex(), "addr": buf.ctypes.data})
              + "\n")
    ctl.flush()
    for line in sys.stdin:
        if not answer(line, buf, ctl):
            break
    del keep
    sys.stdout.flush()
    os._exit(0)  # NIXL's wheel may crash in exit-time destructors


def answer(line: str, buf: np.ndarray, ctl: Any) -> bool:
    cmd = json.loads(line) if line.strip() else {"cmd": "exit"}
    if cmd["cmd"] == "exit":
        return False
    if cmd["cmd"] == "crc":
        crc = zlib.crc32(buf[cmd["off"]:cmd["off"] + cmd["len"]])
    else:
        crc = gathered_crc(buf, np.array(cmd["idx"], dtype=np.int64))
    ctl.write(json.dumps({"crc": crc}) + "\n")
    ctl.flush()
    return True


class Target:
    def __init__(self, args: argparse.Namespace) -> None:
        rfd, wfd = os.pipe()
        argv = [sys.executable, os.path.abspath(__file__), "--role", "target", "--system",
                args.system, "--transport", args.transport, "--ctl-fd", str(wfd)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     pass_fds=(wfd,), text=True)
        os.close(wfd)
        self.ctl = os.fdopen(rfd)
        line = self.ctl.readline()
        if not line:
            raise RuntimeError("target failed to start")
        self.hello = json.loads(line)

    def ask(self, **cmd: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return int(json.loads(self.ctl.readline())["crc"])

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)


# ---------------------------------------------------------------- timing


def timed(once: Callable[[], None], min_secs: float) -> tuple[int, float]:
    for _ in range(3):
        once()
    n = 0
    t0 = time.perf_counter()
    while True:
        once()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_secs:
            return n, dt


def emit(args: argparse.Namespace, op: str, workload: str, nbytes: int, n: int, dt: float,
         verified: bool) -> None:
    rec = {"system": args.system, "transport": args.transport, "op": op, "workload": workload,
           "gbps": nbytes * n / dt / 1e9, "us": dt / n * 1e6, "verified": verified}
    print("RESULT " + json.dumps(rec), flush=True)


def check(target: Target, buf: np.ndarray, op: str, seed: int, kind: str, *, size: int = 0,
          li: np.ndarray | None = None, ri: np.ndarray | None = None,
          once: Callable[[], None]) -> bool:
    """One request with fresh local contents, then both sides' CRCs compared."""
    if op == "WRITE":
        fill(buf, seed)
    else:
        buf[:] = 0
    once()
    if kind == "single":
        return zlib.crc32(buf[:size]) == target.ask(cmd="crc", off=0, len=size)
    assert li is not None and ri is not None
    return gathered_crc(buf, li) == target.ask(cmd="crcs", idx=ri.tolist())


def initiator_nixl_like(args: argparse.Namespace, target: Target) -> None:
    if args.system == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config
    else:
        from aioxfer.nixl import nixl_agent, nixl_agent_config
    agent = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=False,
                                                      backends=["UCX"]))
    buf = np.empty(BUF, dtype=np.uint8)
    fill(buf, 5)
    laddr, raddr = buf.ctypes.data, target.hello["addr"]
    agent.register_memory([(laddr, BUF, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(target.hello["md"]))

    def once_of(h: Any) -> Callable[[], None]:
        def once() -> None:
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
            if st != "DONE":
                raise RuntimeError(f"transfer state {st}")
        return once

    def blocks(base: int) -> np.ndarray:
        rows = np.zeros((NBLOCKS, 3), dtype=np.uint64)
        rows[:, 0] = base + np.arange(NBLOCKS, dtype=np.uint64) * BLOCK
        rows[:, 1] = BLOCK
        return rows

    lblocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(laddr), "DRAM")
    rblocks = agent.prep_xfer_dlist(name, blocks(raddr), "DRAM")
    seed = 11
    for op in args.ops:
        for size in SIZES:
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(laddr, size, 0)], "DRAM")
            rh = agent.prep_xfer_dlist(name, [(raddr, size, 0)], "DRAM")
            h = agent.make_prepped_xfer(op, lh, [0], rh, [0])
            once = once_of(h)
            seed += 1
            ok = check(target, buf, op, seed, "single", size=size, once=once)
            n, dt = timed(once, args.min_secs)
            emit(args, op, size_name(size), size, n, dt, ok)
            h.release()
            lh.release()
            rh.release()
        li, ri = batch_indices(seed)
        h = agent.make_prepped_xfer(op, lblocks, li, rblocks, ri)
        once = once_of(h)
        seed += 1
        ok = check(target, buf, op, seed, "batch", li=li, ri=ri, once=once)
        n, dt = timed(once, args.min_secs)
        emit(args, op, f"{BATCH} x 16 KiB by index", BATCH * BLOCK, n, dt, ok)
        h.release()
    agent.remove_remote_agent(name)


def initiator_native(args: argparse.Namespace, target: Target) -> None:
    import aioxfer

    async def main() -> None:
        kwargs = {"transports": ("tcp",)} if args.transport == "tcp" else {}
        async with aioxfer.Agent("initiator", **kwargs) as agent:
            buf = np.empty(BUF, dtype=np.uint8)
            fill(buf, 5)
            region = agent.register(buf, name="kv")
            peer = await agent.connect(target.hello["address"])
            remote = peer.region("kv")
            loop = asyncio.get_running_loop()
            async def run(op: str, seed: int, kind: str, make: Callable[[], Any],
                          **kw: Any) -> bool:
                if op == "WRITE":
                    fill(buf, seed)
                else:
                    buf[:] = 0
                await make()
                if kind == "single":
                    want = await loop.run_in_executor(None, lambda: target.ask(
                        cmd="crc", off=0, len=kw["size"]))
                    return zlib.crc32(buf[:kw["size"]]) == want
                want = await loop.run_in_executor(None, lambda: target.ask(
                    cmd="crcs", idx=kw["ri"].tolist()))
                return gathered_crc(buf, kw["li"]) == want

            async def atimed(make: Callable[[], Any]) -> tuple[int, float]:
                for _ in range(3):
                    await make()
                n = 0
                t0 = time.perf_counter()
                while True:
                    await make()
                    n += 1
                    dt = time.perf_counter() - t0
                    if dt >= args.min_secs:
                        return n, dt

            seed = 11
            for op in args.ops:
                post = agent.write if op == "WRITE" else agent.read
                for size in SIZES:
                    seg, rseg = region[0:size], remote[0:size]
                    seed += 1
                    one = functools.partial(post, seg, rseg)
                    ok = await run(op, seed, "single", one, size=size)
                    n, dt = await atimed(one)
                    emit(args, op, size_name(size), size, n, dt, ok)
                li, ri = batch_indices(seed)
                lens = np.full(BATCH, BLOCK, dtype=np.uint64)
                lsl = aioxfer.SegmentList(region, li.astype(np.uint64) * BLOCK, lens)
                rsl = aioxfer.SegmentList(remote, ri.astype(np.uint64) * BLOCK, lens)
                seed += 1
                one = functools.partial(post, lsl, rsl)
                ok = await run(op, seed, "batch", one, li=li, ri=ri)
                n, dt = await atimed(one)
                emit(args, op, f"{BATCH} x 16 KiB by index", BATCH * BLOCK, n, dt, ok)

    asyncio.run(main())


def initiator_main(args: argparse.Namespace) -> None:
    target = Target(args)
    try:
        if args.system == "native":
            initiator_native(args, target)
        else:
            initiator_nixl_like(args, target)
    finally:
        target.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- driver


def system_env(system: str, transport: str) -> dict[str, str]:
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_MODULES="^ib", NIXL_LOG_LEVEL="WARN",
               AIOXFER_LOG_LEVEL="warning")
    env.pop("UCX_TLS", None)
    env.pop("AIOXFER_NIXL_TRANSPORTS", None)
    if transport == "tcp":
        if system == "nixl":
            env["UCX_TLS"] = "tcp"
        else:
            env["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    return env


def run_one(python: str, system: str, transport: str, args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    argv = [python, os.path.abspath(__file__), "--role", "initiator", "--system", system,
            "--transport", transport, "--min-secs", str(args.min_secs), "--ops",
            ",".join(args.ops)]
    try:
        out = subprocess.run(argv, env=system_env(system, transport), capture_output=True,
                             text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"  {system}/{transport}: timed out", file=sys.stderr)
        return []
    recs = [json.loads(line[7:]) for line in out.stdout.splitlines()
            if line.startswith("RESULT ")]
    if out.returncode != 0 or not recs:
        tail = "\n".join((out.stderr or out.stdout).splitlines()[-15:])
        print(f"  {system}/{transport}: rc={out.returncode}, {len(recs)} records\n{tail}",
              file=sys.stderr)
    return recs


def table(records: list[dict[str, Any]], systems: list[str]) -> str:
    by: dict[tuple[str, str, str, str], list[float]] = {}
    ratio: dict[tuple[str, str, str, str], list[float]] = {}
    bad: set[tuple[str, str, str, str]] = set()
    rows: list[tuple[str, str, str]] = []
    for r in records:
        key = (r["transport"], r["op"], r["workload"])
        if key not in rows:
            rows.append(key)
        by.setdefault((*key, r["system"]), []).append(r["gbps"])
        if not r["verified"]:
            bad.add((*key, r["system"]))
    # Ratios within each round (records carry the round).
    per_round: dict[tuple[Any, ...], float] = {(r["round"], r["transport"], r["op"],
                                                r["workload"], r["system"]): r["gbps"]
                                               for r in records}
    for (rnd, tr, op, wl, sysname), v in per_round.items():
        if sysname != "compat":
            continue
        for other in ("nixl", "native"):
            o = per_round.get((rnd, tr, op, wl, other))
            if o:
                ratio.setdefault((tr, op, wl, other), []).append(v / o)
    head = ["path", "op", "workload"] + [f"{s} GB/s" for s in systems]
    if "compat" in systems and "nixl" in systems:
        head.append("compat ÷ NIXL")
    if "compat" in systems and "native" in systems:
        head.append("compat ÷ native")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tr, op, wl in rows:
        cells = [tr, op, wl]
        for s in systems:
            vals = by.get((tr, op, wl, s))
            cell = f"{statistics.median(vals):.3f}" if vals else "—"
            if (tr, op, wl, s) in bad:
                cell += " NOT VERIFIED"
            cells.append(cell)
        for other, need in (("nixl", 1.0), ("native", 0.9)):
            if "compat" in systems and other in systems:
                rs = ratio.get((tr, op, wl, other))
                if rs:
                    m = statistics.median(rs)
                    cells.append(f"{m:.2f}× {'met' if m >= need else 'MISSED'}")
                else:
                    cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> None:
    nixl_python = args.nixl_python or os.path.join(
        os.environ.get("PEERS_VENVS", os.path.expanduser("~/.cache/aioxfer-peers")),
        "venv-nixl", "bin", "python")
    systems = [s for s in SYSTEMS if s in args.only]
    if "nixl" in systems and not os.path.exists(nixl_python):
        print(f"no NIXL venv at {nixl_python} (benchmarks/peers/install.sh): skipping nixl",
              file=sys.stderr)
        systems.remove("nixl")
    records: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
        for transport in args.transports:
            for system in order:
                python = nixl_python if system == "nixl" else sys.executable
                t0 = time.perf_counter()
                recs = run_one(python, system, transport, args)
                for r in recs:
                    r["round"] = rnd
                records += recs
                print(f"round {rnd + 1}/{args.rounds} {system}/{transport}: {len(recs)} "
                      f"records in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"\n{args.rounds} round(s), {args.min_secs} s per point, medians; "
          f"ratios are compat's figure over the other's within a round (median); targets: "
          f"compat ≥ 1× NIXL and ≥ 0.9× native\n")
    print(table(records, systems))
    failed = sum(1 for r in records if not r["verified"])
    print(f"\ndata checks: {len(records) - failed} passed, {failed} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "initiator", "target"])
    ap.add_argument("--system", default="compat", choices=SYSTEMS)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--ctl-fd", type=int, default=-1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-secs", type=float, default=0.5)
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--only", default=",".join(SYSTEMS))
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--nixl-python", default="")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default="", help="also write every record to this file")
    args = ap.parse_args()
    args.ops = args.ops.split(",")
    args.only = args.only.split(",")
    args.transports = args.transports.split(",")
    if args.role == "target":
        target_main(args)
    elif args.role == "initiator":
        initiator_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()

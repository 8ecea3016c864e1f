"""aioxfer: the peers' workloads, through aioxfer's public API.

The initiator (this process) starts the target as a child with the same Python;
each runs an Agent on 127.0.0.1 and registers a 64 MiB region (agent.alloc by
default: a memfd that a same-host peer maps); the target's address goes over the
child's stdin/stdout pipe, which also carries the CRC32 checks. Every workload
of the peers' scripts runs in the same order, verified the same way, awaited:
one request at a time per size, 4 KiB latency, 4 KiB with 16 and 64 in flight
(posted, then awaited in order), and one SegmentList request of 256 scattered
16 KiB pages. aioxfer's own targets add: connect + first 4 KiB write, 4 KiB
writes with 256 in flight (also under uvloop when it is installed), the post
rate of one 100 000-descriptor request, and registering 1 GiB.

    python bench_aioxfer.py --transport shm      # same host (what aioxfer picks itself)
    python bench_aioxfer.py --transport tcp      # transports=("tcp",) on both agents

Run it with the Python of the environment where aioxfer is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

import aioxfer  # noqa: E402

AOp = Callable[[], Awaitable[Any]]
N_DESCS = 100_000
DESC_STRIDE, DESC_LEN = 512, 256  # 100 000 x 256 B spread over 51.2 MB


def agent_kwargs(args: argparse.Namespace, initiator: bool = False) -> dict[str, Any]:
    kw: dict[str, Any] = {"transports": ("tcp",)} if args.transport == "tcp" else {}
    if args.progress:  # both agents: the target's loop handles its notifications
        kw["progress"] = args.progress
    return kw


def region_of(agent: aioxfer.Agent, args: argparse.Namespace) -> aioxfer.Region:
    if args.memory == "alloc":
        return agent.alloc(C.BUF_SIZE, name="buf")
    return agent.register(np.empty(C.BUF_SIZE, dtype=np.uint8), name="buf")


# ------------------------------------------------------------------ target


async def target(args: argparse.Namespace) -> None:
    ctl = C.child_ctl()
    async with aioxfer.Agent("bench-target", **agent_kwargs(args)) as agent:
        buf = region_of(agent, args).numpy()
        buf.fill(1)
        ctl.send(("meta", agent.address))

        def serve() -> None:
            while (msg := ctl.recv())[0] != "exit":
                C.serve_check(msg, buf, ctl)

        # The pipe is served on a worker thread; the loop stays free for the agent.
        await asyncio.get_running_loop().run_in_executor(None, serve)


# ------------------------------------------------------------------ initiator


async def initiator(args: argparse.Namespace, ctl: C.Ctl) -> str:
    kind, address = ctl.recv()
    assert kind == "meta"
    base = dict(peer=args.label, transport=args.transport,
                config=f"{args.transport},memory={args.memory},loop=asyncio,"
                f"progress={args.progress or 'default'}")
    await connect_samples(args, ctl, address, base)
    if C.CONNECT_ONLY:
        return ""
    async with aioxfer.Agent("bench-initiator", **agent_kwargs(args)) as agent:
        # Which path a same-host row took depends on the calibrated threshold
        # (a lone request up to it is copied by the posting thread): record it.
        base["inline_bytes"] = agent.inline_bytes
        local = region_of(agent, args)
        buf = local.numpy()
        buf.fill(2)
        peer = await agent.connect(address)
        remote = peer.region("buf")
        await agent.write(local[0:4096], remote[0:4096])
        base["path"] = peer.path

        await run_suite(agent, local, remote, base, ctl, buf, args.ops.split(","))
        await python_path(agent, local, remote, base, "WRITE_qd256")
        await post_rate(agent, local, remote, base, ctl, buf)
        register_1gib(agent, base)
        return address


async def connect_samples(args: argparse.Namespace, ctl: C.Ctl, address: str,
                          base: dict[str, Any]) -> None:
    """connect + first 4 KiB write, C.CONNECT_SAMPLES times: each by a fresh
    initiator agent (its region allocated and filled before the clock), to
    the same target; the first is this process's first connect."""
    samples, path = [], ""
    for i in range(C.CONNECT_SAMPLES):
        async with aioxfer.Agent(f"bench-connect-{i}", **agent_kwargs(args)) as agent:
            local = region_of(agent, args)
            src = local.numpy()
            src.fill(2)
            cs = C.ConnectSample(ctl)
            cs.arm(src)
            cs.start()
            peer = await agent.connect(address)
            res = await agent.write(local[0:4096], peer.region("buf")[0:4096])
            cs.done()
            samples.append(cs.finish())
            if peer.path != args.transport:
                raise SystemExit(f"asked for {args.transport} but the peer's path is {peer.path}")
            path = res.path
    C.emit_connect(base, samples, path=path)


async def run_suite(agent: aioxfer.Agent, local: aioxfer.Region, remote: aioxfer.RemoteRegion,
                    base: dict[str, Any], ctl: C.Ctl, buf: np.ndarray, ops: list[str]) -> None:
    """common.run_suite, awaited: the same workloads, order, seeds and checks."""
    seed = 7
    lpages, rpages = C.batch_pages()
    for op in ops:
        xfer = agent.write if op == "WRITE" else agent.read  # both take (local, remote)
        for size in C.SIZES:
            ls, rs = local[0:size], remote[0:size]

            def once(xfer: Any = xfer, ls: Any = ls, rs: Any = rs) -> Awaitable[Any]:
                return xfer(ls, rs)
            seed += 1
            C.prepare_single(op, ctl, buf, size, seed)
            await once()
            ok = C.check_single(op, ctl, buf, size, seed)
            iters, secs = await C.atimed_loop(once)
            rec = dict(base, op=op, size=size, iters=iters, secs=secs,
                       gbps=C.gbps(size, iters, secs), verified=ok)
            if size == 4 * C.KiB:
                rec["lat_us_med"], rec["lat_us_p99"] = await C.alatency_samples(once)
            C.emit(**rec)
        for qd in C.QDS:
            once = inflight(xfer, local, remote, qd)
            seed += 1
            C.prepare_single(op, ctl, buf, qd * 4 * C.KiB, seed)
            await once()
            ok = C.check_single(op, ctl, buf, qd * 4 * C.KiB, seed)
            iters, secs = await C.atimed_loop(once)
            C.emit(**base, op=f"{op}_qd{qd}", size=4 * C.KiB, iters=iters * qd, secs=secs,
                   gbps=C.gbps(4 * C.KiB * qd, iters, secs), req_per_s=iters * qd / secs,
                   verified=ok)
        d = C.BATCH_DESC
        lens = np.full(C.BATCH_N, d, dtype=np.uint64)
        sl = aioxfer.SegmentList(local, lpages.astype(np.uint64) * d, lens)
        sr = aioxfer.SegmentList(remote, rpages.astype(np.uint64) * d, lens)

        def batch(xfer: Any = xfer, sl: Any = sl, sr: Any = sr) -> Awaitable[Any]:
            return xfer(sl, sr)
        seed += 1
        C.prepare_batch(op, ctl, buf, seed, lpages)
        await batch()
        ok = C.check_batch(op, ctl, buf, seed, lpages, rpages)
        iters, secs = await C.atimed_loop(batch)
        C.emit(**base, op=f"{op}_batch256x16KiB", size=C.BATCH_BYTES, iters=iters, secs=secs,
               gbps=C.gbps(C.BATCH_BYTES, iters, secs), req_per_s=iters / secs, verified=ok)


def inflight(xfer: Callable[..., Any], local: aioxfer.Region, remote: aioxfer.RemoteRegion,
             qd: int) -> AOp:
    """qd x 4 KiB at offsets i * 4 KiB, all posted, then awaited in order."""
    pairs = [(local[i * 4096:(i + 1) * 4096], remote[i * 4096:(i + 1) * 4096]) for i in range(qd)]

    async def once() -> None:
        for t in [xfer(ls, rs) for ls, rs in pairs]:
            await t
    return once


async def python_path(agent: aioxfer.Agent, local: aioxfer.Region, remote: aioxfer.RemoteRegion,
                      base: dict[str, Any], op_name: str) -> None:
    """Completed 4 KiB writes per second delivered to awaiting coroutines, 256 in flight."""
    once = inflight(agent.write, local, remote, 256)
    iters, secs = await C.atimed_loop(once)
    C.emit(**base, op=op_name, size=4 * C.KiB, iters=iters * 256, secs=secs,
           gbps=C.gbps(4 * C.KiB * 256, iters, secs), req_per_s=iters * 256 / secs)


async def post_rate(agent: aioxfer.Agent, local: aioxfer.Region, remote: aioxfer.RemoteRegion,
                    base: dict[str, Any], ctl: C.Ctl, buf: np.ndarray) -> None:
    """Descriptors per second posted from Python: one 100 000-descriptor WRITE
    (SegmentLists built once), timed from the call until the engine has it (the
    agent hands the loop iteration's submissions over in one call_soon pass)."""
    offs = np.arange(N_DESCS, dtype=np.uint64) * DESC_STRIDE
    lens = np.full(N_DESCS, DESC_LEN, dtype=np.uint64)
    sl = aioxfer.SegmentList(local, offs, lens)
    sr = aioxfer.SegmentList(remote, offs, lens)
    C.prepare_single("WRITE", ctl, buf, C.BUF_SIZE, 99)
    posts, dones = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        tr = agent.write(sl, sr)
        await asyncio.sleep(0)  # the agent's flush (scheduled first) runs before we resume
        t1 = time.perf_counter()
        await tr
        posts.append(t1 - t0)
        dones.append(time.perf_counter() - t0)
    pages = [2 * i for i in range(N_DESCS)]  # DESC_STRIDE = 2 * DESC_LEN
    ok = ctl.call("crc_pages", pages, DESC_LEN) == C.crc_pages(buf, pages, DESC_LEN)
    post = statistics.median(posts)
    C.emit(**base, op=f"WRITE_post_{N_DESCS}_descs", size=N_DESCS * DESC_LEN, iters=len(posts),
           lat_us_med=post * 1e6, desc_per_s=N_DESCS / post,
           done_us_med=statistics.median(dones) * 1e6, verified=ok)


def register_1gib(agent: aioxfer.Agent, base: dict[str, Any]) -> None:
    arr = np.empty(1 << 30, dtype=np.uint8)  # a pool as numpy/torch hand it out: untouched pages
    times = []
    for i in range(5):
        t = time.perf_counter()
        r = agent.register(arr, name=f"big-{i}")
        times.append(time.perf_counter() - t)
        agent.deregister(r)
    C.emit(**base, op="register_1GiB", size=1 << 30, iters=len(times),
           lat_us_med=statistics.median(times) * 1e6)


async def uvloop_pass(args: argparse.Namespace, address: str) -> None:
    """The Python-path figure again, with a fresh agent on a uvloop event loop."""
    async with aioxfer.Agent("bench-initiator-uvloop", **agent_kwargs(args)) as agent:
        local = region_of(agent, args)
        peer = await agent.connect(address)
        base = dict(peer=args.label, transport=args.transport, path=peer.path,
                    config=f"{args.transport},memory={args.memory},loop=uvloop,"
                    f"progress={args.progress or 'default'}")
        await python_path(agent, local, peer.region("buf"), base, "WRITE_qd256_uvloop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--memory", default="alloc", choices=["alloc", "register"],
                    help="alloc: agent.alloc regions (memfd); register: agent.register(numpy)")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--progress", choices=["adaptive", "sleep", "poll"],
                    help="Agent(progress=...) on both agents (default: the agent's default; "
                    "an older aioxfer without the setting: leave it out)")
    ap.add_argument("--label", default="aioxfer",
                    help="the records' peer name (aioxfer-before: an earlier build, run.py)")
    args = ap.parse_args()
    if args.role == "target":
        asyncio.run(target(args))
        return
    argv = [sys.executable, os.path.abspath(__file__), "--role", "target",
            "--transport", args.transport, "--memory", args.memory]
    if args.progress:
        argv += ["--progress", args.progress]
    proc, ctl = C.spawn_target(argv)
    try:
        address = asyncio.run(initiator(args, ctl))
        if not address:
            return
        try:
            import uvloop
        except ImportError:
            C.log("uvloop is not installed: no uvloop figure (pip install uvloop)")
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(uvloop_pass(args, address))
    finally:
        C.stop_target(proc, ctl)


if __name__ == "__main__":
    main()

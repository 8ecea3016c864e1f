"""The GPU check: one run on a machine with an NVIDIA GPU (benchmarks/gpu_check.sh
runs it on the device machine; it finishes in well under 4 minutes).

What it does, each step verified and timed, and what it prints at the end: one
JSON line (``GPU_CHECK {...}``) with every figure and every failure.

1. CUDA status and devices as aioxfer sees them (its own driver table).
2. Registers a torch CUDA tensor (when torch is importable; else memory from
   aioxfer.cuda.DeviceBuffer) and checks the region is kind "cuda".
3. Two processes (spawned): the child registers GPU memory and shared host
   memory; over the "cuda" path the parent moves host -> GPU, GPU -> host and
   GPU -> GPU (its torch tensor into the child's GPU memory), checks the bytes,
   and reports GB/s (best of a few) against torch ``copy_`` of the same size in
   one process (pageable host memory, as ours).
4. A KV batch: many 64 KiB pages host -> GPU in one transfer.
5. GPU -> file -> GPU through host staging (aioxfer.staging) and the engine's
   file transport (a file region), verified.
6. The child killed with SIGKILL while transfers are in flight: they end
   (done or PeerLost), later ones fail with PeerLost, nothing hangs.

Usage: python benchmarks/gpu_check.py [--size-mib 256] [--iters 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

import aioxfer
from aioxfer import cuda
from aioxfer.staging import GpuFileStager

try:
    import torch
except ImportError:  # the driver table allocates instead
    torch = None


def digest(b: Any) -> str:
    return hashlib.blake2b(memoryview(b).cast("B"), digest_size=16).hexdigest()


def pattern(n: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy()


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


# ------------------------------------------------------------------ child


async def child_main_async(conn: Any, size: int) -> None:
    loop = asyncio.get_running_loop()
    async with aioxfer.Agent("gpu-check-child") as agent:
        buf = cuda.DeviceBuffer(size)
        agent.register(buf, name="gpu")
        agent.alloc(size, name="host")
        conn.send({"address": agent.address, "pid": os.getpid()})
        while True:
            cmd, args = await loop.run_in_executor(None, conn.recv)
            if cmd == "quit":
                conn.send(("ok", None))
                return
            try:
                if cmd == "digest":
                    off, n = args
                    conn.send(("ok", digest(buf.download(off, n))))
                elif cmd == "upload":
                    off, n, seed = args
                    buf.upload(pattern(n, seed), off)
                    conn.send(("ok", None))
                else:
                    raise ValueError(cmd)
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))


def child_main(conn: Any, size: int) -> None:
    asyncio.run(child_main_async(conn, size))


class Child:
    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(theirs, size), daemon=True)
        self.proc.start()
        theirs.close()
        if not self.conn.poll(120):
            raise RuntimeError("child did not start")
        hello = self.conn.recv()
        self.address, self.pid = hello["address"], hello["pid"]

    async def call(self, cmd: str, *args: Any) -> Any:
        def rpc() -> Any:
            self.conn.send((cmd, args))
            if not self.conn.poll(60):
                raise RuntimeError(f"child: {cmd} timed out")
            return self.conn.recv()

        reply = await asyncio.get_running_loop().run_in_executor(None, rpc)
        if reply[0] != "ok":
            raise RuntimeError(f"child {cmd}: {reply[1]}")
        return reply[1]

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


# ------------------------------------------------------------------ steps


async def timed(aw_factory: Any, iters: int) -> float:
    """Best seconds of iters runs (the first is a warm-up when iters > 1)."""
    best = float("inf")
    for i in range(iters + (1 if iters > 1 else 0)):
        t0 = time.perf_counter()
        await aw_factory()
        dt = time.perf_counter() - t0
        if iters == 1 or i > 0:
            best = min(best, dt)
    return best


def torch_copy_baselines(size: int, iters: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if torch is None:
        return out
    host = torch.from_numpy(pattern(size, 1))
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(size, dtype=torch.uint8, device="cuda")
    back = torch.empty(size, dtype=torch.uint8)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    cases = {
        "torch_h2d_pageable": lambda: dev.copy_(host),
        "torch_d2h_pageable": lambda: back.copy_(dev),
        "torch_d2d": lambda: dev2.copy_(dev),
        "torch_h2d_pinned": lambda: dev.copy_(pinned, non_blocking=True),
    }
    for name, fn in cases.items():
        best = float("inf")
        for i in range(iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t0)
        out[name] = gbps(size, best)
    return out


async def run(ns: argparse.Namespace, summary: dict[str, Any]) -> None:
    size = ns.size_mib << 20
    res: dict[str, Any] = summary["results"]
    errors: list[str] = summary["errors"]

    def step_failed(name: str) -> None:
        errors.append(f"{name}: {traceback.format_exc(limit=3)}")
        print(f"[gpu_check] {name} FAILED\n{traceback.format_exc()}", flush=True)

    ok, why = cuda.status()
    summary["cuda"] = {"available": ok, "status": why, "devices": cuda.devices()}
    summary["torch"] = None if torch is None else torch.__version__
    print(f"[gpu_check] cuda: {why}; devices {cuda.devices()}; torch {summary['torch']}",
          flush=True)
    if not ok:
        errors.append(f"CUDA not available: {why}")
        return

    try:
        summary["torch_baseline_gbps"] = torch_copy_baselines(size, ns.iters)
    except Exception:
        step_failed("torch baselines")

    async with aioxfer.Agent("gpu-check") as agent:
        # 2. a torch tensor (or driver memory) as a region
        if torch is not None:
            tensor = torch.empty(size, dtype=torch.uint8, device="cuda")
            mine = agent.register(tensor, name="mine")
            fill = lambda seed: tensor.copy_(torch.from_numpy(pattern(size, seed)))  # noqa: E731
            read_mine = lambda: tensor.cpu().numpy()  # noqa: E731
        else:
            dbuf = cuda.DeviceBuffer(size)
            mine = agent.register(dbuf, name="mine")
            fill = lambda seed: dbuf.upload(pattern(size, seed))  # noqa: E731
            read_mine = lambda: np.frombuffer(dbuf.download(), dtype=np.uint8)  # noqa: E731
        res["register"] = {"kind": mine.kind, "from": "torch" if torch else "DeviceBuffer",
                           "ipc": mine._cuda is not None}

        child = Child(size)
        try:
            peer = await agent.connect(child.address)
            res["path"] = peer.path
            rgpu = peer.region("gpu")
            host = agent.alloc(size, name="host")
            host.numpy()[:] = pattern(size, 3)
            back = agent.alloc(size, name="back")

            # 3. host -> GPU, GPU -> host, GPU -> GPU between processes
            try:
                dt = await timed(lambda: agent.write(host[:], rgpu[:]), ns.iters)
                assert await child.call("digest", 0, size) == digest(host.memoryview)
                res["h2d_gbps"] = gbps(size, dt)
                dt = await timed(lambda: agent.read(back[:], rgpu[:]), ns.iters)
                assert digest(back.memoryview) == digest(host.memoryview)
                res["d2h_gbps"] = gbps(size, dt)
            except Exception:
                step_failed("host <-> GPU")
            try:
                fill(7)
                if torch is not None:
                    torch.cuda.synchronize()
                dt = await timed(lambda: agent.write(mine[:], rgpu[:]), ns.iters)
                assert await child.call("digest", 0, size) == digest(pattern(size, 7))
                res["d2d_write_gbps"] = gbps(size, dt)
                await child.call("upload", 0, size, 8)
                dt = await timed(lambda: agent.read(mine[:], rgpu[:]), ns.iters)
                assert digest(read_mine()) == digest(pattern(size, 8))
                res["d2d_read_gbps"] = gbps(size, dt)
            except Exception:
                step_failed("GPU <-> GPU")

            # 4. a KV batch: 64 KiB pages, one transfer
            try:
                page = 64 << 10
                n = min(4096, size // page)
                offs = np.arange(n, dtype=np.uint64) * page
                lens = np.full(n, page, dtype=np.uint64)
                dt = await timed(
                    lambda: agent.write(host.segments(offs, lens), rgpu.segments(offs, lens)),
                    ns.iters,
                )
                res["kv_pages"] = {"pages": int(n), "page": page, "gbps": gbps(n * page, dt),
                                   "us_per_page": round(dt / n * 1e6, 2)}
            except Exception:
                step_failed("KV batch")

            # 5. GPU -> file -> GPU
            try:
                kv = min(size, 64 << 20)
                fill(9)
                if torch is not None:
                    torch.cuda.synchronize()
                with tempfile.TemporaryDirectory() as tmp:
                    # the engine's file transport: a file region of the agent
                    f = agent.register_file(os.path.join(tmp, "kv.bin"), size=kv)
                    async with GpuFileStager(agent, f, slot_bytes=8 << 20, slots=4) as st:
                        r1 = await st.gpu_to_file(mine[0:kv], 0)
                        fill(10)  # overwritten, then read back from the file
                        if torch is not None:
                            torch.cuda.synchronize()
                        r2 = await st.file_to_gpu(0, mine[0:kv])
                        assert digest(read_mine()[:kv]) == digest(pattern(size, 9)[:kv])
                    agent.deregister(f)
                res["gpu_file"] = {"path": r1.path, "bytes": kv,
                                   "to_file_gbps": gbps(kv, r1.seconds),
                                   "from_file_gbps": gbps(kv, r2.seconds),
                                   "file_io": agent._engine.file_backend()[1]}
            except Exception:
                step_failed("GPU <-> file")

            # 6. peer killed mid-transfer
            try:
                inflight = [agent.write(host[:], rgpu[:]) for _ in range(4)]
                os.kill(child.pid, signal.SIGKILL)
                outcomes = []
                async with asyncio.timeout(30):
                    for t in inflight:
                        try:
                            await t
                            outcomes.append("done")
                        except aioxfer.PeerLost:
                            outcomes.append("PeerLost")
                    try:
                        await agent.write(host[:], rgpu[:])
                        later = "done"
                    except aioxfer.PeerLost:
                        later = "PeerLost"
                assert later == "PeerLost", later
                res["peer_kill"] = {"in_flight": outcomes, "after": later}
            except Exception:
                step_failed("peer kill")
        finally:
            child.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--deadline", type=float, default=200.0, help="seconds for the whole run")
    ns = p.parse_args()
    summary: dict[str, Any] = {"results": {}, "errors": []}
    t0 = time.perf_counter()

    async def bounded() -> None:
        async with asyncio.timeout(ns.deadline):
            await run(ns, summary)

    try:
        asyncio.run(bounded())
    except Exception:
        summary["errors"].append(f"run: {traceback.format_exc(limit=3)}")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["ok"] = not summary["errors"]
    print("GPU_CHECK " + json.dumps(summary, sort_keys=True), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

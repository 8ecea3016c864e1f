"""The GPU check: one run on a machine with an NVIDIA GPU (benchmarks/gpu_check.sh
runs it on the device machine), in the bring-up order, each step verified and
timed; at the end one JSON line (``GPU_CHECK {...}``) with every figure and
every failure. Under 2 minutes on one GPU.

1. Driver: the symbols aioxfer looks up resolve (else CUDA reports which is
   missing), per device its dmabuf support, PCI address and peer access.
2. Context hygiene: with the application on its last GPU, registering,
   exporting and moving its memory leaves the thread's current context as it
   was and never activates device 0's primary context.
3. A torch tensor (else aioxfer.cuda.DeviceBuffer) registered as a "cuda"
   region; a peer process's GPU region at an odd 512-byte offset in its
   allocation (as caching allocators place tensors), moved both ways.
4. Bandwidth between processes over the "cuda" path, verified, next to torch
   ``copy_`` in one process: GPU <-> local host, GPU <-> the peer's memfd host
   memory (registered with CUDA: asynchronous DMA), GPU <-> GPU (and, with two
   GPUs, across them: IPC with peer access).
5. A KV batch (64 KiB pages), GPU -> file -> GPU through host staging.
6. The peer killed with SIGKILL mid-transfer: nothing hangs, PeerLost.
7. With an RDMA NIC: GID tables and the GID chosen, GPU WRITE of 100 bytes
   (below the inline limit) and of the whole buffer over verbs to another
   process, verified.

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


async def child_main_async(conn: Any, size: int, device: int,
                           transports: tuple[str, ...] | None) -> None:
    loop = asyncio.get_running_loop()
    async with aioxfer.Agent("gpu-check-child", transports=transports) as agent:
        buf = cuda.DeviceBuffer(size, device=device)
        agent.register(buf, name="gpu")
        # at an odd 512-byte offset in its allocation, as a caching allocator
        # places tensors: IPC exports the allocation and the offset
        agent.register(cuda.DevicePointer(buf.ptr + 512, size - 4096, owner=buf), name="gpu_odd")
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
                elif cmd == "host_digest":
                    off, n = args
                    conn.send(("ok", digest(agent.region("host").memoryview[off : off + n])))
                elif cmd == "upload":
                    off, n, seed = args
                    buf.upload(pattern(n, seed), off)
                    conn.send(("ok", None))
                else:
                    raise ValueError(cmd)
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))


def child_main(conn: Any, size: int, device: int, transports: tuple[str, ...] | None) -> None:
    asyncio.run(child_main_async(conn, size, device, transports))


class Child:
    def __init__(self, size: int, device: int = 0,
                 transports: tuple[str, ...] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(theirs, size, device, transports),
                                daemon=True)
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


def driver_step(res: dict[str, Any]) -> None:
    """1. What the driver offers, device by device."""
    res["driver"] = [
        {"ordinal": d.ordinal, "name": d.name, "dmabuf": d.dmabuf, "pci": d.pci,
         "peers": list(d.peers)}
        for d in cuda.device_info()
    ]


class CudaCtx:
    """The application's view of its CUDA context, through libcuda itself."""

    def __init__(self) -> None:
        import ctypes

        self.lib = ctypes.CDLL(os.environ.get("AIOXFER_CUDA_DRIVER") or "libcuda.so.1")
        self.ct = ctypes

    def current(self) -> int:
        c = self.ct.c_void_p(0)
        self.lib.cuCtxGetCurrent(self.ct.byref(c))
        return int(c.value or 0)

    def primary_active(self, dev: int) -> bool:
        flags, active = self.ct.c_uint(0), self.ct.c_int(0)
        self.lib.cuDevicePrimaryCtxGetState(dev, self.ct.byref(flags), self.ct.byref(active))
        return bool(active.value)


async def hygiene_step(res: dict[str, Any], size: int) -> None:
    """2. The application works on its last GPU: our calls leave its current
    context alone and never activate device 0's primary context."""
    if torch is None:
        res["context"] = "skipped (no torch)"
        return
    n = torch.cuda.device_count()
    last = n - 1
    torch.cuda.set_device(last)
    t = torch.empty(size, dtype=torch.uint8, device=f"cuda:{last}")
    cc = CudaCtx()
    before = cc.current()
    dev0_before = cc.primary_active(0)
    async with aioxfer.Agent("gpu-check-hygiene") as agent:
        r = agent.register(t, name="t")
        host = agent.alloc(1 << 20, name="h")
        peer = await agent.connect(agent.address)  # loopback: same-process copies
        rt = peer.region("t")
        await agent.write(host[:], rt[0 : 1 << 20])
        await agent.read(host[:], rt[0 : 1 << 20])
        after = cc.current()
        agent.deregister(r)
    res["context"] = {
        "gpu": last,
        "current_unchanged": after == before,
        "device0_primary_untouched": n == 1 or cc.primary_active(0) == dev0_before,
    }
    torch.cuda.set_device(0)  # the rest of the check works on device 0
    assert after == before, "the application's current context changed"
    assert n == 1 or cc.primary_active(0) == dev0_before, "device 0's primary context activated"


async def nic_step(res: dict[str, Any], size: int, iters: int) -> None:
    """7. With an RDMA NIC: GID tables, and GPU memory over verbs to another
    process (a 100-byte WRITE: never inline from GPU memory)."""
    from aioxfer import verbs

    nics = verbs.nics()
    ok, why = verbs.status()
    res["nic"] = {"status": why, "devices": verbs.devices(),
                  "gids": {n.name: {p: [(g.index, g.gid, g.type) for g in t]
                                    for p, t in n.gids.items()} for n in nics},
                  "memlock": verbs.memlock_limit(), "peermem": verbs.peermem_loaded()}
    if not ok:
        res["nic"]["gpu_write"] = "skipped (no RDMA device)"
        return
    child = Child(size, transports=("verbs",))
    try:
        async with aioxfer.Agent("gpu-check-verbs", transports=("verbs",)) as agent:
            src = torch.empty(size, dtype=torch.uint8, device="cuda") if torch else None
            if src is None:
                buf = cuda.DeviceBuffer(size)
                mine = agent.register(buf, name="src")
                buf.upload(pattern(size, 21))
            else:
                src.copy_(torch.from_numpy(pattern(size, 21)))
                torch.cuda.synchronize()
                mine = agent.register(src, name="src")
            peer = await agent.connect(child.address)
            rhost = peer.region("host")
            await agent.write(mine[0:100], rhost[0:100])
            assert await child.call("host_digest", 0, 100) == digest(pattern(size, 21)[:100])
            dt = await timed(lambda: agent.write(mine[:], rhost[:]), iters)
            assert await child.call("host_digest", 0, size) == digest(pattern(size, 21))
            res["nic"]["gpu_write"] = {"path": peer.path, "small_ok": True,
                                       "gbps": gbps(size, dt)}
    finally:
        child.close()


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
        driver_step(res)
    except Exception:
        step_failed("driver")
    try:
        await hygiene_step(res, 1 << 22)
    except Exception:
        step_failed("context hygiene")
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

            # 3. the peer's region at an odd offset in its allocation
            try:
                odd = peer.region("gpu_odd")
                n = odd.nbytes
                await agent.write(host[0:n], odd[:])
                assert await child.call("digest", 512, n) == digest(host.memoryview[0:n])
                res["ipc_odd_offset"] = {"offset": 512, "bytes": n, "ok": True}
            except Exception:
                step_failed("IPC at an odd offset")

            # 4. GPU <-> the peer's memfd host memory (pinned by us: async DMA)
            try:
                rhost = peer.region("host")
                fill(11)
                if torch is not None:
                    torch.cuda.synchronize()
                dt = await timed(lambda: agent.write(mine[:], rhost[:]), ns.iters)
                assert await child.call("host_digest", 0, size) == digest(pattern(size, 11))
                res["gpu_to_peer_host_gbps"] = gbps(size, dt)
                dt = await timed(lambda: agent.read(mine[:], rhost[:]), ns.iters)
                res["peer_host_to_gpu_gbps"] = gbps(size, dt)
            except Exception:
                step_failed("GPU <-> peer memfd")

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

        # 4. across GPUs: a peer process on device 1, our tensor on device 0
        if torch is not None and torch.cuda.device_count() > 1:
            try:
                other = Child(size, device=1)
                try:
                    peer1 = await agent.connect(other.address)
                    fill(12)
                    torch.cuda.synchronize()
                    dt = await timed(lambda: agent.write(mine[:], peer1.region("gpu")[:]),
                                     ns.iters)
                    assert await other.call("digest", 0, size) == digest(pattern(size, 12))
                    res["cross_gpu_write_gbps"] = gbps(size, dt)
                finally:
                    other.close()
            except Exception:
                step_failed("GPU 0 -> GPU 1")

    try:
        await nic_step(res, min(size, 64 << 20), ns.iters)
    except Exception:
        step_failed("RDMA NIC")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--deadline", type=float, default=150.0, help="seconds for the whole run")
    p.add_argument("--json", help="also write the summary to this file")
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
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(summary, f, sort_keys=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

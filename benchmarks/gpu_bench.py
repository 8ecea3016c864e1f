"""GPU transfers between two processes on one host, beside the GPU's own limits.

Needs a CUDA driver and device (run it on a GPU machine; without one it says
why and exits 2). Two agents, each in its own process, each with one GPU
allocation (``cuda.DeviceBuffer``, cuMemAlloc) and one host pool
(``agent.alloc``). The parent moves data one request at a time, awaited:

- host -> far GPU (WRITE), local GPU -> far GPU (WRITE),
- far GPU -> local GPU (READ), far GPU -> host (READ),
- 256 x 64 KiB GPU -> GPU as one request,

at 4 KiB ... 256 MiB, and verifies each pair's bytes once (a digest computed by
the far side). Beside it, in the same run, the limits: ``cuMemcpy`` through
aioxfer's own driver binding (``DeviceBuffer.upload``/``download`` for
pageable host <-> GPU), and with PyTorch (when installed) pinned host <-> GPU
and GPU <-> GPU copies timed with CUDA events. A torch tensor is also
registered directly (CUDA array interface) and written into from the peer.

    python benchmarks/gpu_bench.py [--json out.json] [--secs 0.3] [--sizes 4096,65536]

``--sizes`` runs those sizes only (the small-request floor: ``--sizes 4096``;
also on the software driver, native/tests/fakecuda.c, where what it shows is
the engine's own cost per request, thread hand-offs included, not a GPU's).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np

import aioxfer
from aioxfer import cuda

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
MAX = max(SIZES)


def _pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def _serve(conn: Any) -> None:
    loop = asyncio.get_running_loop()
    async with aioxfer.Agent("gpu-b") as agent:
        gbuf = cuda.DeviceBuffer(MAX)
        agent.register(gbuf, name="gpu")
        host = agent.alloc(MAX, name="host")
        conn.send({"address": agent.address})
        while True:
            cmd, args = await loop.run_in_executor(None, conn.recv)
            if cmd == "quit":
                conn.send(None)
                return
            if cmd == "gpu_digest":
                off, n = args
                conn.send(hashlib.sha256(gbuf.download(off, n)).hexdigest())
            elif cmd == "upload":
                off, n, seed = args
                gbuf.upload(_pattern(n, seed), off)
                conn.send(None)
            elif cmd == "host_digest":
                off, n = args
                conn.send(hashlib.sha256(host.memoryview[off : off + n]).hexdigest())
            else:
                conn.send(f"unknown {cmd}")


def _child(conn: Any) -> None:
    try:
        asyncio.run(_serve(conn))
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        raise


def _summary(times: list[float], size: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"gbps": size / med / 1e9, "p50_us": med * 1e6, "n": len(times)}


def _fake_driver() -> Any:
    """The software driver (native/tests/fakecuda.c) where it is the one loaded:
    its counters; None with a real driver."""
    path = os.environ.get("AIOXFER_CUDA_DRIVER")
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW).fakecuda_event_sleeps \
            if path else None
    except (OSError, AttributeError):
        return None


async def _timed(make: Any, size: int, secs: float) -> dict[str, float]:
    for _ in range(3):
        await make()
    times: list[float] = []
    sleeps = _fake_driver()
    s0 = sleeps() if sleeps else 0
    csw0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    end = time.perf_counter() + secs
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        await make()
        times.append(time.perf_counter() - t0)
    r = _summary(times, size)
    # this process's voluntary context switches (every thread's sleeps: the
    # event loop's, the CUDA threads') per request: the hand-offs it took
    r["csw"] = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - csw0) / len(times)
    if sleeps:  # cuEventSynchronize calls that slept (the driver's wake-up) per request
        r["event_sleeps"] = (sleeps() - s0) / len(times)
    return r


def _limits(secs: float) -> dict[str, Any]:
    """Copy limits measured in this process, this run."""
    out: dict[str, Any] = {}
    a = cuda.DeviceBuffer(MAX)
    b = bytearray(MAX)
    for size in SIZES:
        src = memoryview(b)[:size]
        ts: list[float] = []
        end = time.perf_counter() + secs
        while time.perf_counter() < end or len(ts) < 5:
            t0 = time.perf_counter()
            a.upload(src)
            ts.append(time.perf_counter() - t0)
        out[f"cuMemcpy pageable H2D {size}"] = _summary(ts, size)
    a.close()
    h1, h2 = np.zeros(MAX, np.uint8), np.ones(MAX, np.uint8)
    for size in SIZES:
        ts = []
        end = time.perf_counter() + secs
        while time.perf_counter() < end or len(ts) < 5:
            t0 = time.perf_counter()
            np.copyto(h1[:size], h2[:size])
            ts.append(time.perf_counter() - t0)
        out[f"memcpy host {size}"] = _summary(ts, size)
    try:
        import torch
    except ImportError:
        out["torch"] = "not installed"
        return out
    dev = torch.device("cuda")
    pinned = torch.empty(MAX, dtype=torch.uint8, pin_memory=True)
    g1 = torch.empty(MAX, dtype=torch.uint8, device=dev)
    g2 = torch.empty(MAX, dtype=torch.uint8, device=dev)
    for name, dst, src in (("H2D pinned", g1, pinned), ("D2H pinned", pinned, g1),
                           ("D2D", g2, g1)):
        for size in SIZES:
            ts = []
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for i in range(30):
                start.record()
                dst[:size].copy_(src[:size], non_blocking=True)
                stop.record()
                stop.synchronize()
                if i >= 3:
                    ts.append(start.elapsed_time(stop) / 1e3)
            out[f"torch {name} {size}"] = _summary(ts, size)
    return out


async def _torch_tensor(agent: aioxfer.Agent, peer: Any, call: Any) -> str:
    """A torch CUDA tensor registered as is (CUDA array interface): the far
    GPU's bytes READ into it, then WRITTEN from it to the far GPU, verified."""
    try:
        import torch
    except ImportError:
        return "torch not installed: skipped"
    n = 4 << 20
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    region = agent.register(t, name="tensor")
    try:
        if region.kind != "cuda":
            return f"FAIL: a torch CUDA tensor registered as {region.kind!r}"
        call("upload", 0, n, 11)
        rgpu = peer.region("gpu")
        await agent.read(region[:], rgpu[0:n])
        if bytes(t.cpu().numpy().tobytes()) != _pattern(n, 11):
            return "FAIL: the tensor's bytes differ after a READ into it"
        t.copy_(torch.frombuffer(bytearray(_pattern(n, 12)), dtype=torch.uint8))
        torch.cuda.synchronize()
        await agent.write(region[:], rgpu[n : 2 * n])
        if call("gpu_digest", n, n) != hashlib.sha256(_pattern(n, 12)).hexdigest():
            return "FAIL: the far GPU's bytes differ after a WRITE from the tensor"
        return "ok (READ into and WRITE from a torch tensor, verified)"
    finally:
        await agent.deregister(region)


async def main(args: argparse.Namespace) -> int:
    ok, why = cuda.status()
    if not ok:
        print(f"no CUDA: {why}")
        return 2
    report: dict[str, Any] = {"devices": [str(d) for d in cuda.device_info()]}
    print("devices:", report["devices"])
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn,), daemon=True)
    proc.start()
    hello = conn.recv()
    if "error" in hello:
        print(hello["error"])
        return 1

    def call(cmd: str, *a: Any) -> Any:
        conn.send((cmd, a))
        return conn.recv()

    failures: list[str] = []
    try:
        async with aioxfer.Agent("gpu-a") as agent:
            gbuf = cuda.DeviceBuffer(MAX)
            lgpu = agent.register(gbuf, name="gpu")
            host = agent.alloc(MAX, name="host")
            peer = await agent.connect(hello["address"])
            rgpu, rhost = peer.region("gpu"), peer.region("host")
            first = await agent.write(host[0:4096], rgpu[0:4096])
            report["path"] = first.path
            print("path:", first.path, "transports:", agent.transports)

            # correctness once per pair, 16 MiB at an odd offset
            n, off = 16 << 20, 4096 + 64
            data = _pattern(n, 1)
            host.memoryview[off : off + n] = data
            want = hashlib.sha256(data).hexdigest()
            await agent.write(host[off : off + n], rgpu[off : off + n])
            if call("gpu_digest", off, n) != want:
                failures.append("host -> far GPU write")
            await agent.write(host[0:n], rgpu[0:n])  # scramble, then GPU -> GPU
            gbuf.upload(data, off)
            await agent.write(lgpu[off : off + n], rgpu[off : off + n])
            if call("gpu_digest", off, n) != want:
                failures.append("local GPU -> far GPU write")
            call("upload", 0, n, 2)
            want2 = hashlib.sha256(_pattern(n, 2)).hexdigest()
            await agent.read(host[0:n], rgpu[0:n])
            if hashlib.sha256(host.memoryview[0:n]).hexdigest() != want2:
                failures.append("far GPU -> host read")
            await agent.read(lgpu[0:n], rgpu[0:n])
            if hashlib.sha256(gbuf.download(0, n)).hexdigest() != want2:
                failures.append("far GPU -> local GPU read")
            print("verified:", "FAILED " + ", ".join(failures) if failures else "all 4 pairs")

            rows: dict[str, Any] = {}
            pairs = {
                "WRITE host->farGPU": lambda s: agent.write(host[0:s], rgpu[0:s]),
                "WRITE GPU->farGPU": lambda s: agent.write(lgpu[0:s], rgpu[0:s]),
                "READ farGPU->GPU": lambda s: agent.read(lgpu[0:s], rgpu[0:s]),
                "READ farGPU->host": lambda s: agent.read(host[0:s], rgpu[0:s]),
                f"WRITE host->farhost {first.path}": lambda s: agent.write(host[0:s], rhost[0:s]),
            }
            for name, op in pairs.items():
                for size in SIZES:
                    r = await _timed(lambda op=op, size=size: op(size), size, args.secs)
                    rows[f"{name} {size}"] = r
                    extra = (f"  ev_sleeps/op {r['event_sleeps']:.2f}"
                             if "event_sleeps" in r else "")
                    print(f"{name:22s} {size:>10d} B  {r['gbps']:8.2f} GB/s  "
                          f"p50 {r['p50_us']:9.1f} us  n={r['n']}  csw/op {r['csw']:.2f}{extra}")
            offs = np.arange(256, dtype=np.uint64) * (64 << 10)
            lens = np.full(256, 64 << 10, dtype=np.uint64)
            batch_l = aioxfer.SegmentList(lgpu, offs, lens)
            batch_r = aioxfer.SegmentList(rgpu, offs, lens)
            r = await _timed(lambda: agent.write(batch_l, batch_r), 256 << 16, args.secs)
            rows["WRITE GPU->farGPU 256x64KiB"] = r
            print(f"{'256 x 64 KiB GPU->farGPU':33s}  {r['gbps']:8.2f} GB/s")
            report["rows"] = rows
            report["torch_tensor"] = await _torch_tensor(agent, peer, call)
            print("torch tensor registration:", report["torch_tensor"])
            if not str(report["torch_tensor"]).startswith(("ok", "torch not")):
                failures.append("torch tensor")
            await agent.deregister(lgpu)
            gbuf.close()
        # the same host -> far host rows over the shm path (CUDA left out), to
        # see what moving host memory over the CUDA endpoint costs
        async with aioxfer.Agent("shm-a", transports=("shm", "tcp")) as agent2:
            host2 = agent2.alloc(MAX, name="host")
            peer2 = await agent2.connect(hello["address"])
            rhost2 = peer2.region("host")
            for size in SIZES:
                r = await _timed(lambda size=size: agent2.write(host2[0:size], rhost2[0:size]),
                                 size, args.secs)
                rows[f"WRITE host->farhost {peer2.path} {size}"] = r
                print(f"{'WRITE host->farhost ' + peer2.path:22s} {size:>10d} B  "
                      f"{r['gbps']:8.2f} GB/s  p50 {r['p50_us']:9.1f} us  n={r['n']}")
    finally:
        try:
            call("quit")
        except (OSError, EOFError):
            pass
        proc.join(10)
    report["limits"] = _limits(args.secs)
    for k, v in report["limits"].items():
        if isinstance(v, dict):
            print(f"limit {k:34s} {v['gbps']:8.2f} GB/s  p50 {v['p50_us']:9.1f} us")
    report["failures"] = failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=os.environ.get("GPU_BENCH_JSON"))
    p.add_argument("--secs", type=float, default=0.3)
    p.add_argument("--sizes", help="comma-separated sizes in bytes (default: "
                   + ",".join(map(str, SIZES)) + ")")
    ns = p.parse_args()
    if ns.sizes:
        SIZES[:] = [int(x) for x in ns.sizes.split(",")]
    sys.exit(asyncio.run(main(ns)))

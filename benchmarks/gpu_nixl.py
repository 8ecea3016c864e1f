"""GPU -> peer GPU through NIXL's Python API: real NIXL beside aioxfer.nixl.

The same code runs twice, once with ``import nixl`` (real NIXL: UCX, cuda_ipc on
one host) and once with ``aioxfer.nixl`` (aioxfer's "cuda" path: CUDA IPC
mappings, copies on the engine's streams). Two processes per run: a target
that registers one VRAM allocation (a torch CUDA tensor) and hands its
metadata over a pipe, and an initiator that registers its own, loads the
metadata, and moves one request at a time the way NIXL users wait for one:
``initialize_xfer`` once per size and direction, then ``transfer`` +
``check_xfer_state`` until "DONE", timed per request. WRITE (local -> far) and
READ (far -> local) at 4 KiB ... 256 MiB; the bytes are checked once per size
(sums of the far and local ranges, taken on the GPUs).

Needs torch with CUDA (and, for the real-NIXL run, the ``nixl`` wheels). On a
lent GPU machine:

    python benchmarks/gpu_nixl.py --impl nixl,aioxfer.nixl --json out.json

Prints one line per row and a final ``GPU_NIXL {...}`` JSON line (ratios
aioxfer.nixl / NIXL per row, and each one's voluntary context switches per
request at WRITE 4 KiB-1 MiB: the initiator process's, every thread's, so a
thread hand-off per request shows as about 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
MAX = max(SIZES)
SMALL = [n for n in SIZES if n <= 1 << 20]  # the one-request-at-a-time floor


def _api(impl: str) -> Any:
    return importlib.import_module("nixl._api" if impl == "nixl" else "aioxfer.nixl")


def _agent(api: Any) -> Any:
    return api.nixl_agent(str(uuid.uuid4()), api.nixl_agent_config(backends=["UCX"]))


class Buf:
    """MAX random bytes: a torch CUDA tensor ("VRAM"), or host memory ("DRAM",
    to try the script on a machine without a GPU)."""

    def __init__(self, mem: str) -> None:
        self.mem = mem
        if mem == "VRAM":
            import torch

            self.t = torch.randint(0, 256, (MAX,), dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            self.ptr, self.dev = self.t.data_ptr(), self.t.device.index or 0
        else:
            import numpy as np

            self.t = np.random.default_rng().integers(0, 256, MAX, dtype=np.uint8)
            self.ptr, self.dev = self.t.ctypes.data, 0

    def sum(self, n: int) -> int:
        if self.mem == "VRAM":
            import torch

            return int(self.t[:n].to(torch.int64).sum().item())
        return int(self.t[:n].sum(dtype="int64"))

    def zero(self, n: int) -> None:
        self.t[:n] = 0
        if self.mem == "VRAM":
            import torch

            torch.cuda.synchronize()


def target_main(conn: Any, impl: str, mem: str) -> None:
    try:
        api = _api(impl)
        agent = _agent(api)
        buf = Buf(mem)
        reg = agent.get_reg_descs([(buf.ptr, MAX, buf.dev, "")], mem)
        agent.register_memory(reg)
        conn.send(("ok", agent.get_agent_metadata(), buf.ptr))
        while True:
            cmd, n = conn.recv()
            if cmd == "quit":
                agent.deregister_memory(reg)
                conn.send(("ok",))
                return
            # the sum of the first n bytes (cmd == "sum")
            conn.send(("ok", buf.sum(n)))
    except BaseException as exc:  # reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _wait(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer ended {state}")


def run_impl(impl: str, secs: float, mem: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, impl, mem), daemon=True)
    proc.start()
    child.close()

    def call(msg: Any, wait: float = 120.0) -> Any:
        if msg is not None:
            conn.send(msg)
        if not conn.poll(wait):
            raise TimeoutError(f"{impl} target did not answer")
        reply = conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(reply[1])
        return reply[1:]

    rows: list[dict[str, Any]] = []
    try:
        md, rptr = call(None)
        api = _api(impl)
        agent = _agent(api)
        buf = Buf(mem)
        agent.register_memory(agent.get_reg_descs([(buf.ptr, MAX, buf.dev, "")], mem))
        remote = agent.add_remote_agent(md)
        for op in ("WRITE", "READ"):
            for n in SIZES:
                local = agent.get_xfer_descs([(buf.ptr, n, buf.dev)], mem)
                far = agent.get_xfer_descs([(rptr, n, 0)], mem)
                h = agent.initialize_xfer(op, local, far, remote)
                for _ in range(3):
                    _wait(agent, h)
                lat: list[int] = []
                csw0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                t_end = time.perf_counter() + secs
                while time.perf_counter() < t_end or len(lat) < 20:
                    t0 = time.perf_counter_ns()
                    _wait(agent, h)
                    lat.append(time.perf_counter_ns() - t0)
                csw = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - csw0) / len(lat)
                if op == "READ":
                    buf.zero(n)  # the next READ must bring the far bytes back
                    _wait(agent, h)
                agent.release_xfer_handle(h)
                here = buf.sum(n)
                (far_sum,) = call(("sum", n))
                p50 = statistics.median(lat)
                rows.append({"impl": impl, "op": op, "bytes": n, "reqs": len(lat),
                             "p50_us": p50 / 1e3, "gbps": n / p50, "csw": round(csw, 3),
                             "verified": here == far_sum})
                r = rows[-1]
                print(f"{impl:13s} {op:5s} {n:>10d} B  {r['gbps']:8.2f} GB/s"
                      f"  p50 {r['p50_us']:9.1f} us  {r['reqs']:6d} reqs  csw/op {csw:5.2f}"
                      f"  {'ok' if r['verified'] else 'BYTES DIFFER'}",
                      flush=True)
        agent.remove_remote_agent(remote)
        call(("quit", 0))
    finally:
        if proc.is_alive():
            proc.join(10)
        if proc.is_alive():
            proc.kill()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="nixl,aioxfer.nixl")
    p.add_argument("--secs", type=float, default=0.3, help="seconds per row")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--mem", choices=["VRAM", "DRAM"], default="VRAM",
                   help="DRAM: host memory, to try the script where there is no GPU")
    args = p.parse_args()
    if args.mem == "VRAM":
        try:
            import torch
        except ImportError:
            print("gpu_nixl: torch is not installed", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("gpu_nixl: no CUDA device", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for impl in args.impl.split(","):
        try:
            rows += run_impl(impl, args.secs, args.mem)
        except Exception as exc:  # one implementation failing still reports the other
            failed[impl] = f"{type(exc).__name__}: {exc}"
            print(f"{impl}: FAILED {failed[impl]}", flush=True)
    by = {(r["impl"], r["op"], r["bytes"]): r for r in rows}
    ratios = {f"{op} {n}": round(by[("aioxfer.nixl", op, n)]["gbps"] / r["gbps"], 3)
              for (impl, op, n), r in by.items()
              if impl == "nixl" and ("aioxfer.nixl", op, n) in by}
    csw = {impl: {f"WRITE {n}": by[(impl, "WRITE", n)]["csw"] for n in SMALL
                  if (impl, "WRITE", n) in by}
           for impl in args.impl.split(",")}
    out = {"rows": rows, "failed": failed, "ratio_aioxfer_nixl_over_nixl": ratios,
           "csw_per_op": csw, "all_verified": all(r["verified"] for r in rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print("GPU_NIXL " + json.dumps({"ratios": ratios, "csw_per_op": csw, "failed": failed,
                                    "all_verified": out["all_verified"]}))
    return 0 if rows and not failed and out["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())

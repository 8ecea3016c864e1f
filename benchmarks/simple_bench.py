"""GB/s of 1 MiB and 64 MiB aioxfer writes (shm and tcp) beside the machine's limits.

All in one run, on one machine: a plain single-thread memcpy (numpy.copyto) and
a plain loopback socket copy (sendall / recv_into between two processes, one
byte of acknowledgement per message) of the same sizes, then aioxfer writes
from this process into an agent in a spawned process, over shm (automatic
between same-host agents) and tcp (forced with ``transports=("tcp",)``).
Each figure is the median of several repetitions; every repetition times
enough back-to-back operations to last a few milliseconds. Destination memory
is touched once before timing (a warm KV pool), so page faults of a fresh
mapping are not what is measured.

    python benchmarks/simple_bench.py [--reps 7] [--sizes 1M,64M] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

MIN_REP_BYTES = 256 << 20  # each repetition moves at least this much (or one op)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def inner_count(size: int) -> int:
    return max(1, MIN_REP_BYTES // size)


def median_gbps(size: int, times: list[float]) -> float:
    return size / statistics.median(times) / 1e9


# --------------------------------------------------------------- memcpy


def bench_memcpy(size: int, reps: int) -> float:
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    np.copyto(dst, src)
    inner = inner_count(size)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            np.copyto(dst, src)
        times.append((time.perf_counter() - t0) / inner)
    return median_gbps(size, times)


# --------------------------------------------------------------- loopback socket


def _sock_receiver(port_q: Any, max_size: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    srv.close()
    buf = bytearray(max_size)
    view = memoryview(buf)
    head = bytearray(8)
    with conn:
        while True:
            got = 0
            while got < 8:
                k = conn.recv_into(memoryview(head)[got:])
                if not k:
                    return
                got += k
            n = int.from_bytes(head, "little")
            if n == 0:
                return
            got = 0
            while got < n:
                k = conn.recv_into(view[got:n])
                if not k:
                    return
                got += k
            conn.sendall(b"k")


def bench_socket(sizes: list[int], reps: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sock_receiver, args=(q, max(sizes)), daemon=True)
    proc.start()
    out = {}
    try:
        port = q.get(timeout=60)
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(bytearray(b"\x07" * max(sizes)))
        ack = bytearray(1)

        def one(n: int) -> None:
            s.sendall(n.to_bytes(8, "little"))
            s.sendall(payload[:n])
            if s.recv_into(ack) != 1:
                raise RuntimeError("socket receiver went away")

        with s:
            for size in sizes:
                for _ in range(2):
                    one(size)  # warm-up
                inner = inner_count(size)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        one(size)
                    times.append((time.perf_counter() - t0) / inner)
                out[size] = median_gbps(size, times)
            s.sendall((0).to_bytes(8, "little"))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out


# --------------------------------------------------------------- aioxfer


def _target_main(transport: str, nbytes: int, q: Any, stop: Any) -> None:
    import aioxfer

    async def run() -> None:
        kw = {"transports": ("tcp",)} if transport == "tcp" else {}
        async with aioxfer.Agent(f"bench-target-{transport}", **kw) as agent:
            dst = agent.alloc(nbytes, name="dst")
            dst.numpy().fill(0)  # warm
            q.put(agent.address)
            await asyncio.get_running_loop().run_in_executor(None, stop.wait, 600)

    asyncio.run(run())


async def _bench_agent(transport: str, address: str, sizes: list[int],
                       reps: int) -> tuple[dict[int, float], str]:
    import aioxfer

    kw = {"transports": ("tcp",)} if transport == "tcp" else {}
    out = {}
    async with aioxfer.Agent(f"bench-init-{transport}", **kw) as agent:
        src = agent.alloc(max(sizes), name="src")
        src.numpy().fill(7)
        async with asyncio.timeout(60):
            peer = await agent.connect(address)
        remote = peer.region("dst")
        for size in sizes:
            for _ in range(2):
                async with asyncio.timeout(60):
                    await agent.write(src[0:size], remote[0:size])  # warm-up
            inner = inner_count(size)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                async with asyncio.timeout(300):
                    for _ in range(inner):
                        await agent.write(src[0:size], remote[0:size])
                times.append((time.perf_counter() - t0) / inner)
            out[size] = median_gbps(size, times)
        return out, peer.path


def bench_agent(transport: str, sizes: list[int], reps: int) -> tuple[dict[int, float], str]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop = ctx.Event()
    proc = ctx.Process(target=_target_main, args=(transport, max(sizes), q, stop), daemon=True)
    proc.start()
    try:
        address = q.get(timeout=60)
        return asyncio.run(_bench_agent(transport, address, sizes, reps))
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# --------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="repetitions per figure (median)")
    ap.add_argument("--sizes", default="1M,64M", help="comma-separated sizes (default 1M,64M)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    ns = ap.parse_args(argv)
    sizes = [parse_size(x) for x in ns.sizes.split(",") if x.strip()]
    if not sizes or min(sizes) <= 0 or ns.reps < 1:
        ap.error("sizes and --reps must be positive")

    print(f"simple_bench: sizes {', '.join(fmt_size(s) for s in sizes)}, "
          f"median of {ns.reps} reps", file=sys.stderr)
    memcpy = {s: bench_memcpy(s, ns.reps) for s in sizes}
    sock = bench_socket(sizes, ns.reps)
    shm, shm_path = bench_agent("shm", sizes, ns.reps)
    tcp, tcp_path = bench_agent("tcp", sizes, ns.reps)

    head = (f"{'size':>8} | {'memcpy':>8} | {'socket':>8} | {'shm':>8} {'shm/memcpy':>10} | "
            f"{'tcp':>8} {'tcp/socket':>10}")
    print(f"GB/s (1 GB = 1e9 bytes); shm path: {shm_path}, tcp path: {tcp_path}")
    print(head)
    print("-" * len(head))
    for s in sizes:
        print(f"{fmt_size(s):>8} | {memcpy[s]:8.2f} | {sock[s]:8.2f} | {shm[s]:8.2f} "
              f"{shm[s] / memcpy[s]:10.2f} | {tcp[s]:8.2f} {tcp[s] / sock[s]:10.2f}")
    print("memcpy of sizes that fit in the CPU caches runs from cache; socket: one "
          "connection, single-threaded; tcp: the agent's default connections per peer")
    if ns.json:
        print(json.dumps({
            "unit": "GB/s",
            "reps": ns.reps,
            "paths": {"shm": shm_path, "tcp": tcp_path},
            "results": [
                {"size": s, "memcpy": memcpy[s], "socket": sock[s], "shm": shm[s],
                 "tcp": tcp[s]} for s in sizes
            ],
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

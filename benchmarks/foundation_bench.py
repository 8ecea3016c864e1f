"""GB/s of 1 MiB and 64 MiB writes over shm and tcp beside the machine's limits.

Measured in one run: a single-thread memcpy (numpy.copyto) and a plain loopback
socket copy (sendall / recv_into between two processes) of the same sizes, and
aioxfer writes between two agents in separate processes. Medians of several
repetitions; the table gives each figure and its ratio to the limit.

    python benchmarks/foundation_bench.py [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time

import numpy as np

import aioxfer

SIZES = (1 << 20, 64 << 20)


def memcpy_gbps(size: int, reps: int) -> float:
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        inner = max(1, (256 << 20) // size)
        t0 = time.perf_counter()
        for _ in range(inner):
            np.copyto(dst, src)
        times.append((time.perf_counter() - t0) / inner)
    return size / statistics.median(times) / 1e9


def _sink(port_q: mp.Queue, size: int, count: int) -> None:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port_q.put(lsock.getsockname()[1])
    conn, _ = lsock.accept()
    buf = bytearray(size)
    view = memoryview(buf)
    for _ in range(count):
        got = 0
        while got < size:
            got += conn.recv_into(view[got:], size - got)
        conn.sendall(b"k")
    conn.close()


def socket_gbps(size: int, reps: int) -> float:
    inner = max(1, (256 << 20) // size)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_sink, args=(q, size, reps * inner + 1))
    proc.start()
    s = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
    data = bytes(size)
    s.sendall(data)
    s.recv(1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            s.sendall(data)
            s.recv(1)
        times.append((time.perf_counter() - t0) / inner)
    s.close()
    proc.join(30)
    return size / statistics.median(times) / 1e9


def _target(addr_q: mp.Queue, stop: mp.Event, transports: tuple[str, ...] | None) -> None:
    async def main() -> None:
        async with aioxfer.Agent("bench-target", transports=transports) as agent:
            agent.alloc(max(SIZES), name="dst")
            addr_q.put(agent.address)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    asyncio.run(main())


async def _writes(address: str, transports: tuple[str, ...] | None, reps: int) -> dict[int, float]:
    out = {}
    async with aioxfer.Agent("bench-init", transports=transports) as agent:
        src = agent.register(np.ones(max(SIZES), np.uint8), name="src")
        peer = await agent.connect(address)
        dst = peer.region("dst")
        for size in SIZES:
            inner = max(1, (256 << 20) // size)
            await agent.write(src[0:size], dst[0:size])
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(inner):
                    await agent.write(src[0:size], dst[0:size])
                times.append((time.perf_counter() - t0) / inner)
            out[size] = size / statistics.median(times) / 1e9
        path = peer.path
    return {"path": path, **out}  # type: ignore[dict-item]


def aioxfer_gbps(transport: str, reps: int) -> dict[int, float]:
    transports = ("tcp",) if transport == "tcp" else None
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    stop = ctx.Event()
    proc = ctx.Process(target=_target, args=(q, stop, transports))
    proc.start()
    try:
        res = asyncio.run(_writes(q.get(timeout=30), transports, reps))
    finally:
        stop.set()
        proc.join(30)
    assert res["path"] == transport, res
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    mem = {s: memcpy_gbps(s, args.reps) for s in SIZES}
    sock = {s: socket_gbps(s, args.reps) for s in SIZES}
    shm = aioxfer_gbps("shm", args.reps)
    tcp = aioxfer_gbps("tcp", args.reps)
    print(f"{'size':>8} {'memcpy':>8} {'shm':>8} {'shm/memcpy':>10} "
          f"{'socket':>8} {'tcp':>8} {'tcp/socket':>10}   (GB/s, medians of {args.reps})")
    for s in SIZES:
        print(f"{s >> 20:>6}Mi {mem[s]:8.2f} {shm[s]:8.2f} {shm[s] / mem[s]:10.2f} "
              f"{sock[s]:8.2f} {tcp[s]:8.2f} {tcp[s] / sock[s]:10.2f}")


if __name__ == "__main__":
    main()

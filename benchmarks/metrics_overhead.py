"""What aioxfer.metrics costs a transfer: nothing, by construction (the
collector reads counters the agent keeps anyway, only when scraped). This
measures it: µs per awaited 4 KiB write between two same-host agents (shm),
without metrics, with a collector registered and ``serve_metrics`` listening
(unscraped), and while being scraped every 100 ms; plus the cost of one
scrape. Modes alternate; each figure is the median of ``--reps``.

    python benchmarks/metrics_overhead.py [--reps 7] [--n 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from prometheus_client import REGISTRY

import aioxfer
from aioxfer.metrics import AgentCollector


async def scrape(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    body = await reader.read()
    writer.close()
    return len(body)


async def loop_writes(agent: Any, src: Any, dst: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        await agent.write(src, dst)
    return (time.perf_counter() - t0) / n * 1e6


async def main(reps: int, n: int) -> None:
    async with aioxfer.Agent("m-src") as a, aioxfer.Agent("m-dst") as b:
        b.register(bytearray(1 << 20), name="pool")
        src = a.register(bytearray(4096))[:]
        peer = await a.connect(b.address)
        dst = peer.region("pool")[0:4096]
        await loop_writes(a, src, dst, 2000)  # warm
        results: dict[str, list[float]] = {"none": [], "unscraped": [], "scraped": []}
        server = None
        collector = AgentCollector(a, b)
        for rep in range(reps):
            for mode in (("none", "unscraped", "scraped") if rep % 2 == 0
                         else ("scraped", "unscraped", "none")):
                stop = asyncio.Event()
                scraper = None
                if mode == "none":
                    if server is not None:
                        await server.aclose()
                        REGISTRY.unregister(collector)
                        server = None
                else:
                    if server is None:
                        server = await a.serve_metrics(0)
                        REGISTRY.register(collector)
                    if mode == "scraped":
                        async def every(port: int, stop: asyncio.Event) -> None:
                            while not stop.is_set():
                                await scrape(port)
                                await asyncio.sleep(0.1)
                        scraper = asyncio.create_task(every(server.port, stop))
                results[mode].append(await loop_writes(a, src, dst, n))
                stop.set()
                if scraper is not None:
                    await scraper
        if server is None:
            server = await a.serve_metrics(0)
        t0 = time.perf_counter()
        size = 0
        for _ in range(50):
            size = await scrape(server.port)
        per_scrape = (time.perf_counter() - t0) / 50 * 1e3
    print(f"4 KiB write, awaited one at a time, shm, n={n}, median of {reps} (µs/transfer):")
    for mode, v in results.items():
        print(f"  {mode:>10}: {statistics.median(v):6.2f}   {[round(x, 2) for x in v]}")
    print(f"one scrape (2 agents, 1 peer): {per_scrape:.2f} ms, {size} bytes")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    asyncio.run(main(args.reps, args.n))

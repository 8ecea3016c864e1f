"""Memory soak: mixed verified transfers for a while; RSS at start and end.

An initiator (this process) and a target (a spawned process) run shm and tcp
peers at once: single writes and reads of 4 KiB..4 MiB, scattered batches of
up to 1 000 descriptors, writes with notifications, cancelled transfers and
deadlines that expire, connect/close of extra peers. Both processes report
their RSS (and the engine's own leak counters) after a warm-up and at the end;
the engine's memory must stay flat. Every few seconds a sample is verified.

    python benchmarks/soak_memory.py [--minutes 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from typing import Any

import numpy as np

import aioxfer

MiB = 1 << 20
POOL = 64 * MiB


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def target_main(conn: Any) -> None:
    async def serve() -> None:
        async with aioxfer.Agent("soak-target") as a_shm, aioxfer.Agent(
            "soak-target-tcp", transports=("tcp",)
        ) as a_tcp:
            pools = [a.alloc(POOL, name="pool") for a in (a_shm, a_tcp)]
            users = [a.register(bytearray(POOL), name="user") for a in (a_shm, a_tcp)]
            conn.send((a_shm.address, a_tcp.address))
            loop = asyncio.get_running_loop()

            async def consume(a: aioxfer.Agent) -> None:
                async for _ in a.notifications:  # a serving loop would act on them
                    pass

            consumers = [asyncio.create_task(consume(a)) for a in (a_shm, a_tcp)]
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd == "rss":
                    conn.send((rss_kib(), [a.statistics() for a in (a_shm, a_tcp)]))
                elif cmd == "quit":
                    for c in consumers:
                        c.cancel()
                    del pools, users
                    return

    asyncio.run(serve())


async def soak(minutes: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child,), daemon=True)
    proc.start()
    child.close()  # the target's end: its death then reads as EOF here
    loop = asyncio.get_running_loop()

    async def reply() -> Any:
        while not await loop.run_in_executor(None, parent.poll, 1.0):
            if proc.exitcode is not None:
                raise SystemExit(f"the target process died (exit code {proc.exitcode})")
        return parent.recv()

    async def ask(cmd: str) -> Any:
        parent.send(cmd)
        return await reply()

    addr_shm, addr_tcp = await reply()

    counts = {"ok": 0, "typed_errors": 0, "timeouts": 0, "cancelled": 0, "verified": 0}
    async with aioxfer.Agent("soak-init") as ini, aioxfer.Agent(
        "soak-init-tcp", transports=("tcp",)
    ) as ini_tcp:
        src = np.frombuffer(np.random.default_rng(seed).bytes(POOL), dtype=np.uint8).copy()
        regs = (ini.register(src), ini_tcp.register(src))
        back = (ini.register(bytearray(POOL)), ini_tcp.register(bytearray(POOL)))
        peers = (await ini.connect(addr_shm), await ini_tcp.connect(addr_tcp))

        async def one_round(k: int) -> None:
            agent = (ini, ini_tcp)[k]
            peer = peers[k]
            src_r, back_r = regs[k], back[k]
            remote = peer.region(rng.choice(["pool", "user"]))
            kind = rng.random()
            size = 1 << rng.randint(12, 22)
            off = rng.randrange(0, POOL - size, 4096)
            try:
                if kind < 0.35:
                    await agent.write(src_r[off:off + size], remote[off:off + size],
                                      notify=b"n" if rng.random() < 0.3 else None)
                elif kind < 0.6:
                    await agent.read(back_r[off:off + size], remote[off:off + size])
                elif kind < 0.8:
                    n = rng.randint(2, 1000)
                    offs = np.array(rng.sample(range(0, POOL // 4096), n), dtype=np.uint64) * 4096
                    lens = np.full(n, 4096, dtype=np.uint64)
                    await agent.write(aioxfer.SegmentList(src_r, offs, lens),
                                      aioxfer.SegmentList(remote, offs, lens))
                elif kind < 0.9:
                    t = agent.write(src_r[0:16 * MiB], remote[0:16 * MiB])
                    await asyncio.sleep(0)
                    t.cancel()
                    counts["cancelled"] += 1
                    try:
                        await t
                    except asyncio.CancelledError:
                        pass
                    return
                else:
                    try:
                        async with asyncio.timeout(0.0005):
                            await agent.write(src_r[0:32 * MiB], remote[0:32 * MiB])
                    except TimeoutError:
                        counts["timeouts"] += 1
                        return
                counts["ok"] += 1
            except aioxfer.XferError:
                counts["typed_errors"] += 1

        async def verify() -> None:
            for k in (0, 1):
                remote = peers[k].region("pool")
                await (ini, ini_tcp)[k].write(regs[k][0:MiB], remote[0:MiB])
                await (ini, ini_tcp)[k].read(back[k][0:MiB], remote[0:MiB])
                if bytes(back[k].memoryview[0:MiB]) != src[0:MiB].tobytes():
                    raise SystemExit("verification failed: data corrupted")
                counts["verified"] += 1

        async def run_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            last_verify = time.monotonic()
            while time.monotonic() < end:
                await asyncio.gather(*(one_round(rng.randint(0, 1)) for _ in range(8)))
                if time.monotonic() - last_verify > 5:
                    await verify()
                    last_verify = time.monotonic()

        warm = min(60.0, minutes * 60 / 5)
        await run_for(warm)
        start = {"init_rss_kib": rss_kib(), "target": await ask("rss")}
        t0 = time.monotonic()
        await run_for(minutes * 60 - warm)
        await verify()
        end = {"init_rss_kib": rss_kib(), "target": await ask("rss")}
        seconds = time.monotonic() - t0
        stats = [a.statistics() for a in (ini, ini_tcp)]
    parent.send("quit")
    await loop.run_in_executor(None, proc.join, 30)
    return {
        "minutes": minutes,
        "measured_seconds": round(seconds, 1),
        "counts": counts,
        "init_rss_kib": [start["init_rss_kib"], end["init_rss_kib"]],
        "target_rss_kib": [start["target"][0], end["target"][0]],
        "init_native": [(s.native_ops, s.native_regions, s.pinned_regions) for s in stats],
        "target_native_end": [(s.native_ops, s.native_regions, s.native_conns)
                              for s in end["target"][1]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    ns = ap.parse_args()
    res = asyncio.run(soak(ns.minutes, ns.seed))
    i0, i1 = res["init_rss_kib"]
    t0, t1 = res["target_rss_kib"]
    print(f"soak {res['measured_seconds']} s after warm-up: {res['counts']}")
    print(f"initiator RSS {i0 / 1024:.1f} -> {i1 / 1024:.1f} MiB ({(i1 - i0) / 1024:+.1f})")
    print(f"target    RSS {t0 / 1024:.1f} -> {t1 / 1024:.1f} MiB ({(t1 - t0) / 1024:+.1f})")
    print(f"engine at the end: initiator (ops, regions, pinned) {res['init_native']}, "
          f"target (ops, regions, conns) {res['target_native_end']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

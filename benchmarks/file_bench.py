"""GB/s of the file transport (host -> file and file -> host) beside a plain
``os.pwritev`` / ``os.preadv`` loop on the same file.

Per case (4 KiB x N scattered descriptors, 1 MiB x N scattered descriptors)
and per I/O backend (the thread pool, which agents use for buffered files, and
io_uring, which they use for O_DIRECT ones, each forced with AIOXFER_FILE_IO):
one aioxfer transfer of all N descriptors as one SegmentList, timed from post
to completion. The baseline is one Python loop of one pwritev/preadv call per
descriptor, in this thread. File offsets are a random permutation, so nothing
coalesces. The file is written once before timing, so what is measured is the
page cache, not the disk (pass --dir to choose the filesystem); with --direct
both sides open the file with O_DIRECT and the disk is what is measured. Each
figure is the median of --reps repetitions.

    python benchmarks/file_bench.py [--reps 7] [--total 256M] [--dir /var/tmp] [--direct] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import aioxfer
from aioxfer import _cyx


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def plain(path: Path, buf: memoryview, offs: np.ndarray, size: int, write: bool,
          direct: bool) -> float:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
    try:
        pieces = [buf[i * size:(i + 1) * size] for i in range(len(offs))]
        foffs = [int(o) for o in offs]
        t0 = time.perf_counter()
        if write:
            for piece, off in zip(pieces, foffs, strict=True):
                os.pwritev(fd, [piece], off)
        else:
            for piece, off in zip(pieces, foffs, strict=True):
                os.preadv(fd, [piece], off)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


async def run_backend(backend: str, path: Path, total: int, sizes: list[int],
                      reps: int, direct: bool) -> list[dict[str, Any]]:
    os.environ["AIOXFER_FILE_IO"] = backend
    rows = []
    rng = np.random.default_rng(0)
    async with aioxfer.Agent("file-bench") as agent:
        f = agent.register_file(path, size=total, direct=direct)
        host = agent.alloc(total)
        host.numpy()[:] = rng.integers(0, 256, total, dtype=np.uint8)
        await agent.write(host[0:total], f[0:total])  # page cache populated
        used = "io_uring" if backend == "uring" else "thread pool"
        for size in sizes:
            n = total // size
            offs = rng.permutation(n).astype(np.uint64) * np.uint64(size)
            lens = np.full(n, size, dtype=np.uint64)
            hsegs = host.segments(np.arange(n, dtype=np.uint64) * np.uint64(size), lens)
            fsegs = f.segments(offs, lens)
            for op in ("write", "read"):
                ours, base = [], []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    if op == "write":
                        await agent.write(hsegs, fsegs)
                    else:
                        await agent.read(hsegs, fsegs)
                    ours.append(time.perf_counter() - t0)
                    base.append(plain(path, host.memoryview, offs, size, op == "write", direct))
                rows.append({
                    "backend": used,
                    "op": "host->file" if op == "write" else "file->host",
                    "desc_bytes": size,
                    "descs": n,
                    "aioxfer_gbps": total / statistics.median(ours) / 1e9,
                    "pwritev_preadv_gbps": total / statistics.median(base) / 1e9,
                })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--total", default="256M", help="bytes per transfer (and file size)")
    ap.add_argument("--sizes", default="4K,1M", help="descriptor sizes")
    ap.add_argument("--dir", default=None, help="directory of the test file")
    ap.add_argument("--direct", action="store_true", help="O_DIRECT on both sides")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    uring, chosen = _cyx.file_backend()  # before AIOXFER_FILE_IO is set below
    backends = ["threads", "uring"] if uring else ["threads"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aioxfer-file-bench-", dir=args.dir) as d:
        for backend in backends:
            rows += asyncio.run(run_backend(backend, Path(d) / "bench.bin", total, sizes,
                                            args.reps, args.direct))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"agents' file I/O here: {chosen}; measured: "
          f"{'O_DIRECT' if args.direct else 'page cache'}")
    print(f"{'backend':12} {'op':11} {'descriptors':>16} {'aioxfer GB/s':>13} "
          f"{'pwritev/preadv GB/s':>20}")
    for r in rows:
        desc = f"{r['descs']} x {r['desc_bytes'] // 1024} KiB"
        print(f"{r['backend']:12} {r['op']:11} {desc:>16} {r['aioxfer_gbps']:13.2f} "
              f"{r['pwritev_preadv_gbps']:20.2f}")


if __name__ == "__main__":
    main()

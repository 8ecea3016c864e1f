"""KV offload to local SSD: a decode worker whose host KV pool is smaller than
the KV of the requests it holds moves cold requests' pages to a file and
brings them back when a request resumes.

- A prefill agent writes each request's pages (scattered 16 KiB pages) into
  the decode agent's pool, one batched write bound to a notification.
- The decode agent keeps requests in its pool in LRU order. When a new request
  needs pages and the pool is full, the least recently used requests are
  offloaded: one batched ``agent.write(pool pages, file_region[...])`` each
  (the file transport: page-cache I/O on the engine's threads, or io_uring
  with ``--direct``), and their pool pages are reused.
- Then every request resumes in random order: an offloaded one is read back
  from the file (one batched ``agent.read``) into free pool pages, evicting
  others as needed (a request read back and unchanged is dropped, not written
  again), and its bytes are checked against what prefill wrote.

    python examples/kv_offload.py --requests 48 --pool-pages 1024 --file /var/tmp/kv.bin
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections import OrderedDict

import numpy as np

import aioxfer

PAGE = 16 << 10


def page_bytes(request: int, page: int) -> np.ndarray:
    """What prefill writes into page `page` of `request` (checked on resume)."""
    rng = np.random.default_rng(request * 100_003 + page)
    return rng.integers(0, 256, PAGE, dtype=np.uint8)


class Tiers:
    """Which pool pages and which file slots each request occupies."""

    def __init__(self, agent: aioxfer.Agent, pool: aioxfer.Region,
                 file: aioxfer.Region, pages_per_request: int) -> None:
        self.agent, self.pool, self.file = agent, pool, file
        self.n = pages_per_request
        self.free = list(range(pool.nbytes // PAGE))
        self.in_pool: OrderedDict[int, list[int]] = OrderedDict()  # LRU first
        self.on_file: dict[int, int] = {}  # request -> first file page
        self.clean: set[int] = set()  # in the pool and unchanged since read from the file
        self.next_file_page = 0
        self.offloaded = self.restored = self.dropped = 0
        self.offload_s = self.restore_s = 0.0

    def pool_pages(self, pages: list[int]) -> aioxfer.SegmentList:
        offs = np.asarray(pages, dtype=np.uint64) * PAGE
        return aioxfer.SegmentList(self.pool, offs, np.full(len(pages), PAGE, dtype=np.uint64))

    def file_pages(self, request: int) -> aioxfer.SegmentList:
        """The request's slot in the file: n contiguous pages, written once."""
        if request not in self.on_file:
            self.on_file[request] = self.next_file_page
            self.next_file_page += self.n
        offs = (self.on_file[request] + np.arange(self.n, dtype=np.uint64)) * PAGE
        return aioxfer.SegmentList(self.file, offs, np.full(self.n, PAGE, dtype=np.uint64))

    async def make_room(self) -> list[int]:
        """n free pool pages, offloading least recently used requests for them."""
        while len(self.free) < self.n:
            victim, pages = self.in_pool.popitem(last=False)
            if victim in self.clean:  # the file has these bytes already
                self.clean.discard(victim)
                self.dropped += 1
                self.free.extend(pages)
                continue
            t = time.perf_counter()
            # Scattered pool pages to the request's contiguous file slot: one
            # batched write (adjacent file pages are coalesced by the agent).
            result = await self.agent.write(self.pool_pages(pages), self.file_pages(victim))
            assert result.path == "file", result.path
            self.offload_s += time.perf_counter() - t
            self.offloaded += 1
            self.free.extend(pages)
        taken, self.free = self.free[:self.n], self.free[self.n:]
        return taken

    async def resume(self, request: int) -> list[int]:
        """The request's pool pages, read back from the file if it was offloaded."""
        if request in self.in_pool:
            self.in_pool.move_to_end(request)
            return self.in_pool[request]
        pages = await self.make_room()
        t = time.perf_counter()
        await self.agent.read(self.pool_pages(pages), self.file_pages(request))
        self.restore_s += time.perf_counter() - t
        self.restored += 1
        self.in_pool[request] = pages
        self.clean.add(request)
        return pages


async def main(args: argparse.Namespace) -> int:
    path = args.file or os.path.join(tempfile.mkdtemp(prefix="aioxfer-kv-"), "kv.bin")
    n = args.pages_per_request
    async with aioxfer.Agent("decode-0") as decode, aioxfer.Agent("prefill-0") as prefill:
        pool = decode.alloc(args.pool_pages * PAGE, name="kv")
        file = decode.register_file(path, size=args.requests * n * PAGE, direct=args.direct)
        tiers = Tiers(decode, pool, file, n)
        peer = await prefill.connect(decode.address)
        remote = peer.region("kv")
        staging = prefill.alloc(n * PAGE)
        view = pool.numpy()

        for request in range(args.requests):
            pages = await tiers.make_room()
            src = staging.numpy()
            for i in range(n):
                src[i * PAGE:(i + 1) * PAGE] = page_bytes(request, i)
            dst = [remote[p * PAGE:(p + 1) * PAGE] for p in pages]
            await prefill.write([staging[i * PAGE:(i + 1) * PAGE] for i in range(n)], dst,
                                notify=f"req-{request}".encode())
            note = await decode.notifications.receive()
            assert note.payload == f"req-{request}".encode()
            tiers.in_pool[request] = pages

        order = list(range(args.requests))
        random.Random(7).shuffle(order)
        corrupt = 0
        for request in order:
            pages = await tiers.resume(request)
            for i, p in enumerate(pages):
                if not np.array_equal(view[p * PAGE:(p + 1) * PAGE], page_bytes(request, i)):
                    corrupt += 1

        mb = n * PAGE / 1e6
        print(f"{args.requests} requests x {n} pages of {PAGE >> 10} KiB, pool {args.pool_pages} "
              f"pages, file {path} ({'O_DIRECT' if args.direct else 'page cache'})")
        print(f"offloaded: {tiers.offloaded} requests, "
              f"{tiers.offloaded * mb / max(tiers.offload_s, 1e-9) / 1e3:.2f} GB/s")
        print(f"dropped clean: {tiers.dropped} requests")
        print(f"restored: {tiers.restored} requests, "
              f"{tiers.restored * mb / max(tiers.restore_s, 1e-9) / 1e3:.2f} GB/s")
        print(f"resumed: {len(order)}  corrupt pages: {corrupt}")
        if not args.file:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
        return 1 if corrupt else 0


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--pages-per-request", type=int, default=64)
    ap.add_argument("--pool-pages", type=int, default=1024, help="host pool size in pages")
    ap.add_argument("--file", help="the SSD tier's file (default: a temporary file)")
    ap.add_argument("--direct", action="store_true", help="O_DIRECT (io_uring where allowed)")
    args = ap.parse_args()
    if args.pool_pages < args.pages_per_request:
        ap.error("the pool must hold at least one request")
    return args


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))

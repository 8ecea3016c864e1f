"""KV offload to local SSD with the ``aioxfer.kv`` store: a decode worker whose
host KV memory is smaller than the KV of the requests it holds keeps the hot
pages in a host tier and lets the store write cold ones back to a disk tier,
then brings them back when a request resumes.

- A prefill agent writes each request's pages (16 KiB each) into the decode
  agent's arrival buffer, one batched write bound to a notification.
- The decode agent puts them into its store under keys chained over the
  request's tokens: ``kv.HostTier`` (registered host memory, LRU) over
  ``kv.DiskTier`` (append-only segment files, checksummed). When the host tier
  passes its high watermark, the least recently used pages are written back
  to disk and their host memory reused (write-back; counted as demotions).
- Then every request resumes in random order: ``store.get`` lands its pages
  in the decode worker's working buffer, from host memory or from disk
  (verified against their CRC32C on the way), and they are checked against
  what prefill wrote.

    python examples/kv_offload.py --requests 48 --pool-pages 1024 --dir /var/tmp/kv
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time

import numpy as np

import aioxfer
from aioxfer import kv

PAGE = 16 << 10
BLOCK_TOKENS = 16


def page_bytes(request: int, page: int) -> np.ndarray:
    """What prefill writes into page `page` of `request` (checked on resume)."""
    rng = np.random.default_rng(request * 100_003 + page)
    return rng.integers(0, 256, PAGE, dtype=np.uint8)


def request_keys(request: int, pages: int) -> list[bytes]:
    tokens = np.random.default_rng(request).integers(0, 32000, pages * BLOCK_TOKENS)
    return kv.chain(tokens, block_tokens=BLOCK_TOKENS, namespace=b"kv-offload-example")


async def main(args: argparse.Namespace) -> int:
    path = args.dir or tempfile.mkdtemp(prefix="aioxfer-kv-")
    n = args.pages_per_request
    async with aioxfer.Agent("decode-0") as decode, aioxfer.Agent("prefill-0") as prefill:
        arrival = decode.alloc(n * PAGE, name="arrival")
        work = decode.alloc(n * PAGE, name="work")
        tiers = [kv.HostTier(args.pool_pages * PAGE),
                 kv.DiskTier(path, capacity=4 * args.requests * n * PAGE, direct=args.direct)]
        async with kv.Store.open(decode, block_bytes=PAGE, tiers=tiers) as store:
            peer = await prefill.connect(decode.address)
            remote = peer.region("arrival")
            staging = prefill.alloc(n * PAGE)
            src = staging.numpy()
            for request in range(args.requests):
                for i in range(n):
                    src[i * PAGE:(i + 1) * PAGE] = page_bytes(request, i)
                await prefill.write(staging[0:n * PAGE], remote[0:n * PAGE],
                                    notify=f"req-{request}".encode())
                note = await decode.notifications.receive()
                assert note.payload == f"req-{request}".encode()
                put = await store.put(request_keys(request, n), arrival[0:n * PAGE])
                assert put.stored == n and put.dropped == 0, put
            await asyncio.sleep(0)  # let the last write-back finish its batch
            on_disk = 0
            for request in range(args.requests):
                hit = await store.lookup(request_keys(request, n))
                on_disk += any(t == "disk" for t in hit.tiers)
            disk_stats = store.statistics().tiers["disk"]

            order = list(range(args.requests))
            random.Random(7).shuffle(order)
            corrupt = restored = 0
            t_restore = 0.0
            for request in order:
                t = time.perf_counter()
                res = await store.get(request_keys(request, n), work[0:n * PAGE])
                if "disk" in res.tiers:
                    restored += 1
                    t_restore += time.perf_counter() - t
                if res.prefix != n:
                    corrupt += n - res.prefix
                view = work.numpy()
                for i in range(res.prefix):
                    if not np.array_equal(view[i * PAGE:(i + 1) * PAGE], page_bytes(request, i)):
                        corrupt += 1
            st = store.statistics()
        mb = n * PAGE / 1e6
        write_s = disk_stats.put_bytes / 1e9
        print(f"{args.requests} requests x {n} pages of {PAGE >> 10} KiB, host tier "
              f"{args.pool_pages} pages, disk tier {path} "
              f"({'O_DIRECT' if args.direct else 'page cache'}, "
              f"{st.tiers['disk'].extra['checksum']})")
        print(f"offloaded: {on_disk} requests, {disk_stats.puts} pages written back "
              f"({write_s:.3f} GB)")
        print(f"restored: {restored} requests, "
              f"{restored * mb / max(t_restore, 1e-9) / 1e3:.2f} GB/s")
        print(f"host tier: hits {st.tiers['host'].hits}, demotions {st.tiers['host'].demotions}, "
              f"promotions {st.tiers['host'].promotions}; disk tier: hits "
              f"{st.tiers['disk'].hits}, checksum failures {st.tiers['disk'].checksum_failures}")
        print(f"resumed: {len(order)}  corrupt pages: {corrupt}")
        if not args.dir:
            shutil.rmtree(path)
        return 1 if corrupt else 0


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--pages-per-request", type=int, default=64)
    ap.add_argument("--pool-pages", type=int, default=1024, help="host tier size in pages")
    ap.add_argument("--dir", help="the disk tier's directory (default: a temporary one)")
    ap.add_argument("--direct", action="store_true", help="O_DIRECT (io_uring where allowed)")
    args = ap.parse_args()
    if args.pool_pages < args.pages_per_request:
        ap.error("the host tier must hold at least one request")
    return args


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))

"""Disaggregated serving in miniature: a prefill agent streams a request's KV
pages into a decode agent's pre-registered KV pool and notifies it.

Both agents run in this process here; in production they are separate workers
(see `aioxfer demo` for the two-process version). The pattern is the same:

- decode: allocates its KV pool once, hands out free page slots per request
  (scattered: a paged-attention block table), awaits the notification, decodes;
- prefill: computes a request's KV pages, writes them into the slots it was
  given as ONE batched write (a SegmentList), bound to a notification that
  arrives only after all of the request's data is in decode's memory.

    python examples/disagg_prefill_decode.py
"""

from __future__ import annotations

import asyncio

import numpy as np

import aioxfer

PAGE = 16 << 10  # bytes per KV page (one block of one layer, say)
SLOTS = 4096  # pages in the decode pool (64 MiB)
PAGES_PER_REQUEST = 256


async def decode_worker(agent: aioxfer.Agent, pool: aioxfer.Region, tables: dict, n: int) -> None:
    pages = pool.numpy().reshape(SLOTS, PAGE)
    for _ in range(n):
        note = await agent.notifications.receive()  # only after the data is in
        rid = int(note.payload)
        kv = pages[tables[rid]]  # gather this request's pages: ready to decode
        assert (kv[:, 0] == rid % 251).all()
        print(f"decode: request {rid} from {note.peer_name}: {len(kv)} pages ready")


async def main() -> None:
    async with aioxfer.Agent("decode-0") as decode, aioxfer.Agent("prefill-0") as prefill:
        pool = decode.alloc(SLOTS * PAGE, name="kv")  # shared memory: one memcpy per page
        staging = prefill.alloc(PAGES_PER_REQUEST * PAGE, name="staging")
        peer = await prefill.connect(decode.address)  # metadata fetched, transport chosen
        remote_pool = peer.region("kv")
        print(f"prefill -> decode over {peer.path}")

        rng = np.random.default_rng(0)
        free = rng.permutation(SLOTS)  # the decode side's free list, scattered
        tables = {rid: free[rid * PAGES_PER_REQUEST:(rid + 1) * PAGES_PER_REQUEST]
                  for rid in range(8)}
        consumer = asyncio.create_task(decode_worker(decode, pool, tables, len(tables)))

        lengths = np.full(PAGES_PER_REQUEST, PAGE, dtype=np.uint64)
        local = aioxfer.SegmentList(staging, np.arange(PAGES_PER_REQUEST) * PAGE, lengths)
        for rid, table in tables.items():
            staging.numpy()[:] = rid % 251  # "prefill computed the KV cache"
            remote = aioxfer.SegmentList(remote_pool, table.astype(np.uint64) * PAGE, lengths)
            async with asyncio.timeout(10):  # deadlines are scopes, not arguments
                result = await prefill.write(local, remote, notify=str(rid).encode())
            print(f"prefill: request {rid}: {result.nbytes >> 10} KiB in "
                  f"{result.seconds * 1e3:.2f} ms over {result.path}")
        async with asyncio.timeout(10):
            await consumer
        print(prefill.statistics())


if __name__ == "__main__":
    asyncio.run(main())

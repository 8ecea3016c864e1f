"""Layer-wise KV streaming between two processes, then reuse from the KV store.

- The decode worker (a second process) registers a KV pool and waits.
- The prefill worker computes the prompt's KV one layer at a time. A pipeline
  of two stages joined by a bounded channel overlaps compute with transfer:
  while layer l+1 is computed, layer l of every block is written into the
  decode worker's pool (one batched one-sided write) with a notification
  bound to it, which the decode worker sees only once the layer's bytes are in
  its memory.
- The decode worker's own pipeline starts on layer 0 as soon as it lands
  (here: it checks that layer's bytes) while later layers are still in flight.
- Once all layers are there, the decode worker puts the blocks into its
  ``aioxfer.kv`` store under keys chained over the prompt's tokens; a second
  request with the same prompt streams them back from the store, layer by
  layer (``store.stream``), instead of waiting for prefill.

    python examples/layerwise_prefill_decode.py --layers 32 --blocks 64 --block-kib 64
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import numpy as np

import aioxfer
from aioxfer import kv

BLOCK_TOKENS = 16
NAMESPACE = b"example-model/bf16/tp0"


def layer_bytes(block: int, layer: int, nbytes: int) -> np.ndarray:
    """What prefill computes for one layer of one block (checked by decode)."""
    rng = np.random.default_rng(block * 1000 + layer)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def prompt(blocks: int) -> np.ndarray:
    return np.random.default_rng(42).integers(0, 32000, blocks * BLOCK_TOKENS)


async def decode(args: argparse.Namespace) -> int:
    bb = args.block_kib << 10
    lb = bb // args.layers
    n, layers = args.blocks, args.layers
    async with aioxfer.Agent("decode") as agent:
        pool = agent.alloc(n * bb, name="kv-pool")
        print(f"ADDRESS {agent.address}", flush=True)
        view = pool.numpy().reshape(n, layers, lb)
        landed: list[float] = []
        bad = 0

        async def notes() -> AsyncIterator[int]:
            for _ in range(layers):
                msg = await agent.notifications.receive()
                landed.append(time.perf_counter())
                yield int(msg.payload.split()[1])

        async def attend(layer: int) -> int:
            # Decode starts on a layer the moment it lands: here it checks the
            # bytes (a real worker would run the layer's attention on them).
            nonlocal bad
            for b in range(n):
                if not np.array_equal(view[b, layer], layer_bytes(b, layer, lb)):
                    bad += 1
            return layer

        order: list[int] = []

        async def record(layer: int) -> None:
            order.append(layer)

        async with kv.Pipeline(maxsize=2) as p:
            p.sink(record, p.map(attend, p.source(notes())))
        t_first, t_last = landed[0], landed[-1]
        print(f"decode: {layers} layers landed in order: {order == list(range(layers))}; "
              f"corrupt blocks: {bad}")

        keys = kv.chain(prompt(n), block_tokens=BLOCK_TOKENS, namespace=NAMESPACE)
        async with kv.Store.open(agent, block_bytes=bb, tiers=[kv.HostTier(2 * n * bb)]) as store:
            put = await store.put(keys, pool[0:n * bb])
            # A second request with the same prompt: its KV comes from the store.
            again = agent.alloc(n * bb)
            t0 = time.perf_counter()
            first = None
            async for item in store.stream(keys, again[0:n * bb], layers=layers):
                if first is None:
                    first = time.perf_counter() - t0
                assert item.prefix == n
            whole = time.perf_counter() - t0
            reused_ok = np.array_equal(again.numpy(), pool.numpy())
        print(f"decode: stored {put.stored} blocks; reuse from the store: first layer after "
              f"{(first or 0) * 1e3:.3f} ms of {whole * 1e3:.3f} ms "
              f"({(first or 0) / whole:.3f} of the whole); verified: {reused_ok}")
        print(f"decode: prefill stream: first layer landed {(t_last - t_first) * 1e3:.1f} ms "
              f"before the last")
        return 0 if bad == 0 and reused_ok and order == list(range(layers)) else 1


async def prefill(args: argparse.Namespace, address: str) -> None:
    bb = args.block_kib << 10
    lb = bb // args.layers
    n, layers = args.blocks, args.layers
    async with aioxfer.Agent("prefill") as agent:
        staging = agent.alloc(n * bb)
        peer = await agent.connect(address)
        remote = peer.region("kv-pool")
        view = staging.numpy().reshape(n, layers, lb)
        offs = np.arange(n, dtype=np.uint64) * bb
        lens = np.full(n, lb, dtype=np.uint64)

        async def compute() -> AsyncIterator[int]:
            for layer in range(layers):
                for b in range(n):
                    view[b, layer] = layer_bytes(b, layer, lb)
                if args.compute_ms:
                    await asyncio.sleep(args.compute_ms / 1e3)
                yield layer

        async def send(layer: int) -> int:
            # Layer `layer` of every block: one batched write, its notification
            # delivered only after all of its bytes are in decode's pool.
            at = offs + np.uint64(layer * lb)
            await agent.write(aioxfer.SegmentList(staging, at, lens),
                              aioxfer.SegmentList(remote, at, lens),
                              notify=f"layer {layer}".encode())
            return layer

        sent: list[int] = []

        async def done(layer: int) -> None:
            sent.append(layer)

        t0 = time.perf_counter()
        async with kv.Pipeline(maxsize=2) as p:
            p.sink(done, p.map(send, p.source(compute())))
        print(f"prefill: {len(sent)} layers x {n} blocks of {lb} bytes sent over {peer.path} in "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--compute-ms", type=float, default=1.0, help="simulated compute per layer")
    ap.add_argument("--role", choices=["main", "decode"], default="main", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if (args.block_kib << 10) % args.layers:
        ap.error("--layers must divide the block size")
    if args.role == "decode":
        return asyncio.run(decode(args))
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "decode", "--layers", str(args.layers),
         "--blocks", str(args.blocks), "--block-kib", str(args.block_kib)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.startswith("ADDRESS "):
            raise SystemExit(f"decode worker did not start: {line!r}")
        asyncio.run(prefill(args, line.split()[1]))
        out, _ = child.communicate(timeout=120)
        print(out, end="")
        return child.returncode
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


if __name__ == "__main__":
    raise SystemExit(main())

"""A KV router: one prefill agent spreads requests' KV pages over a pool of
decode workers, choosing per request by expected completion time, and keeps
serving when one of the workers is killed.

- Each decode worker (its own process) registers a KV pool; on every
  notification it checks that request's pages byte for byte and acknowledges
  with a notification back.
- The router writes each request (64 scattered 16 KiB pages) as one batched
  write bound to a notification, to the worker ``LowestExpectedCompletion``
  picks from ``peer.statistics()``; a request is served once acknowledged.
- Midway the busiest worker is SIGKILLed. Its requests fail with PeerLost (the
  write itself; or, when the data was in but no acknowledgement came, the
  PeerLeft membership event) and are retried on the survivors.

    python examples/kv_router.py --workers 3 --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing as mp
import os
import random
import signal
from collections import Counter
from typing import Any

import numpy as np

import aioxfer
from aioxfer.routing import LowestExpectedCompletion

PAGE = 16 << 10  # bytes per KV page
PAGES = 64  # pages per request (1 MiB)
WINDOW = 8  # requests in flight at once
SLOTS = 2 * WINDOW * PAGES  # pages per worker pool: a request always finds free ones
DEADLINE = 20.0  # seconds; a hang detector only: failures are typed errors, not timeouts


def agent_options(tcp: bool) -> dict[str, Any]:
    # A silent worker is lost within 1 s; --tcp forces TCP even on one host.
    return {"peer_timeout": 1.0, "keepalive": 0.2, **({"transports": ("tcp",)} if tcp else {})}


def kv(rid: int) -> np.ndarray:
    """Request ``rid``'s KV pages, distinct in every request and page."""
    words = np.arange(PAGES * PAGE // 8, dtype=np.uint64) + np.uint64(rid << 40)
    return words.view(np.uint8).reshape(PAGES, PAGE)


# ------------------------------------------------------------ decode worker


def decode_main(name: str, conn: Any, parent: int, router_address: str, tcp: bool) -> None:
    # The kernel SIGKILLs a worker whose parent dies: none outlives the router.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    asyncio.run(decode_worker(name, conn, router_address, tcp))


async def decode_worker(name: str, conn: Any, router_address: str, tcp: bool) -> None:
    async with aioxfer.Agent(name, **agent_options(tcp)) as agent:
        pages = agent.alloc(SLOTS * PAGE, name="kv").numpy().reshape(SLOTS, PAGE)
        router = await agent.connect(router_address)  # for the acknowledgements

        async def decode() -> None:
            async for note in agent.notifications:  # only once the request's data is in
                rid, slots = note.payload[:4], np.frombuffer(note.payload[4:], dtype="<u2")
                ok = np.array_equal(pages[slots], kv(int.from_bytes(rid, "little")))
                await router.notify(rid + bytes([ok]))

        loop = asyncio.get_running_loop()
        quit = asyncio.Event()  # the parent closing its end of the pipe
        loop.add_reader(conn.fileno(), quit.set)
        conn.send(agent.address)
        task = asyncio.create_task(decode())
        await quit.wait()
        loop.remove_reader(conn.fileno())
        task.cancel()


# ------------------------------------------------------------ router


class Worker:
    """The router's view of one decode worker."""

    def __init__(self, name: str, proc: Any, conn: Any) -> None:
        self.name, self.proc, self.conn = name, proc, conn
        self.peer: aioxfer.Peer
        self.free = set(range(SLOTS))  # its KV pool's free pages
        self.acks: dict[int, asyncio.Future[bool]] = {}  # request -> its acknowledgement
        self.served = 0
        self.killed = False


class KvRouter:
    def __init__(self, prefill: aioxfer.Agent, workers: list[Worker], seed: int) -> None:
        self.prefill, self.rng = prefill, random.Random(seed)
        self.workers = {w.name: w for w in workers}
        self.by_peer = {w.peer: w for w in workers}
        self.router = LowestExpectedCompletion()
        self.staging = prefill.alloc(WINDOW * PAGES * PAGE, name="staging")
        self.windows: asyncio.Queue[int] = asyncio.Queue()
        for i in range(WINDOW):
            self.windows.put_nowait(i)
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # by error class
        self.kill_at = 0

    async def acknowledgements(self) -> None:
        async for note in self.prefill.notifications:
            rid = int.from_bytes(note.payload[:4], "little")
            ack = self.workers[note.peer_name].acks.pop(rid, None)
            if ack is not None and not ack.done():
                ack.set_result(bool(note.payload[4]))

    async def departures(self) -> None:
        # A worker that leaves owes us its acknowledgements: fail them, typed.
        async for event in self.prefill.membership():
            if isinstance(event, aioxfer.PeerLeft) and event.name in self.workers:
                w = self.workers[event.name]
                acks, w.acks = w.acks, {}
                for ack in acks.values():
                    if not ack.done():
                        ack.set_exception(aioxfer.PeerLost(
                            f"{w.name} {event.reason} before acknowledging", peer=w.name))

    async def serve(self, rid: int) -> None:
        window = await self.windows.get()  # a staging area, and a place in the window
        try:
            first = window * PAGES
            self.staging.numpy().reshape(-1, PAGE)[first:first + PAGES] = kv(rid)  # "prefill"
            src = self.staging.segments(np.arange(first, first + PAGES) * PAGE, [PAGE] * PAGES)
            while True:
                try:
                    peer = self.router.choose([w.peer for w in self.workers.values()], PAGES * PAGE)
                except aioxfer.PeerLost:  # nobody left to serve it
                    self.counts["unserved"] += 1
                    return
                try:
                    async with asyncio.timeout(DEADLINE):
                        ok = await self.send(rid, src, self.by_peer[peer])
                except aioxfer.XferError as exc:  # typed: PeerLost when the worker died
                    self.failures[type(exc).__name__] += 1
                    self.counts["retries"] += 1
                    continue
                except TimeoutError:
                    self.counts["hung"] += 1
                    return
                self.counts["served" if ok else "corrupt"] += 1
                if self.counts["served"] == self.kill_at:
                    self.kill_busiest()
                return
        finally:
            self.windows.put_nowait(window)

    async def send(self, rid: int, src: aioxfer.SegmentList, w: Worker) -> bool:
        """One attempt: write the pages to free slots of ``w``, await its check."""
        slots = np.array(self.rng.sample(sorted(w.free), PAGES), dtype="<u2")  # scattered
        w.free.difference_update(slots.tolist())
        ack: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        w.acks[rid] = ack
        try:
            dst = w.peer.region("kv").segments(slots.astype(np.uint64) * PAGE, [PAGE] * PAGES)
            await self.prefill.write(src, dst, notify=rid.to_bytes(4, "little") + slots.tobytes())
            ok = await ack
        except BaseException:
            w.acks.pop(rid, None)
            if ack.done() and not ack.cancelled():
                ack.exception()  # failed by departures() as well: retrieved here
            ack.cancel()
            if not w.peer.lost:  # e.g. cancelled: the worker lives, its slots are reusable
                w.free.update(slots.tolist())
            raise
        w.free.update(slots.tolist())  # decoded: the slots are free again
        w.served += ok
        return ok

    def kill_busiest(self) -> None:
        # The busiest, so that it dies with requests in flight.
        w = max(self.workers.values(), key=lambda v: len(v.acks))
        print(f"killing {w.name} (SIGKILL) with {len(w.acks)} requests in flight to it")
        w.killed = True
        os.kill(w.proc.pid, signal.SIGKILL)


async def main(n_workers: int, n_requests: int, tcp: bool, seed: int) -> int:
    loop, ctx = asyncio.get_running_loop(), mp.get_context("spawn")
    workers: list[Worker] = []
    try:
        async with aioxfer.Agent("prefill", **agent_options(tcp)) as prefill:
            for i in range(n_workers):
                conn, child = ctx.Pipe()
                args = (f"decode-{i}", child, os.getpid(), prefill.address, tcp)
                proc = ctx.Process(target=decode_main, args=args, daemon=True)
                proc.start()  # on the loop thread: PDEATHSIG follows the thread that forks
                child.close()
                workers.append(Worker(f"decode-{i}", proc, conn))
            zeros = prefill.alloc(SLOTS * PAGE, name="zeros")
            for w in workers:
                if not await loop.run_in_executor(None, w.conn.poll, 60):
                    raise RuntimeError(f"{w.name} did not start")
                w.peer = await prefill.connect(w.conn.recv())
                # Touch its pool once, as a server warms up: page faults would make
                # the first transfers (the first bandwidth estimates) look slow.
                async with asyncio.timeout(DEADLINE):
                    await prefill.write(zeros[:], w.peer.region("kv")[:])
            prefill.deregister(zeros)

            kvr = KvRouter(prefill, workers, seed)
            kvr.kill_at = n_requests // 2
            print(f"prefill -> {n_workers} decode workers over {workers[0].peer.path}: "
                  f"{n_requests} requests of {PAGES} x {PAGE >> 10} KiB pages, "
                  f"routed by {type(kvr.router).__name__}")
            helpers = [asyncio.create_task(kvr.acknowledgements()),
                       asyncio.create_task(kvr.departures())]
            await asyncio.gather(*(kvr.serve(rid) for rid in range(n_requests)))
            for task in helpers:
                task.cancel()
    finally:
        for w in workers:  # closing our end of its pipe tells a worker to quit
            w.conn.close()
        for w in workers:  # ...and every one is reaped
            w.proc.join(10)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()

    print(f"{'worker':<10} {'served':>6}  state")
    for w in workers:
        print(f"{w.name:<10} {w.served:>6}  {'killed' if w.killed else f'exit {w.proc.exitcode}'}")
    c = kvr.counts
    typed = ", ".join(f"{k} x{v}" for k, v in kvr.failures.items()) or "none"
    print(f"served: {c['served']}/{n_requests}  retries: {c['retries']}  failures: {typed}  "
          f"unserved: {c['unserved']}  corrupt: {c['corrupt']}  "
          f"killed: {sum(w.killed for w in workers)}  hung: {c['hung']}")
    return 0 if c["served"] == n_requests and c["hung"] == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tcp", action="store_true", help="force TCP (default: shm on one host)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    raise SystemExit(asyncio.run(main(a.workers, a.requests, a.tcp, a.seed)))

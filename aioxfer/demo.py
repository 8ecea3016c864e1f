"""``aioxfer demo``: prefill -> decode KV streaming between two processes.

A "decode" process allocates a KV pool (requests x pages x page_size bytes) in
shared memory and waits for notifications. A "prefill" process connects to it,
and for each request writes that request's pages from its own registered buffer
into scattered page slots of the decode pool, as one batched write
(``SegmentList``) carrying the request id as its notification. Several requests
are in flight at once. The decode side verifies every page byte for byte as soon
as the notification arrives: the data must already be in its memory then.

Both sides derive the page contents and the slot permutation from the request
id, the page index and a seed, so the decode side needs nothing but the
notification to check a request.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DemoConfig", "expected_pages", "page_slots", "run_demo"]

_MIX_PAGE = np.uint64(0x9E3779B97F4A7C15)
_MIX_WORD = np.uint64(0x100000001B3)
_SALT = np.uint64(0xA5A5_0000_0000_0000)


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 64
    pages: int = 512
    page_size: int = 16384
    inflight: int = 8
    transport: str = "auto"
    seed: int = 1234
    listen: str = "127.0.0.1:0"
    progress: bool = True
    timeout: float = 300.0
    # Testing aid: prefill writes one page of one request to a wrong slot, so
    # the verification must fail (proves the check is not vacuous).
    inject_corruption: bool = False

    @property
    def slots(self) -> int:
        return self.requests * self.pages

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.page_size

    @property
    def transports(self) -> tuple[str, ...] | None:
        return None if self.transport == "auto" else (self.transport,)


def page_slots(cfg: DemoConfig) -> np.ndarray:
    """Slot index in the decode pool of every (request, page), shape (requests, pages)."""
    rng = np.random.default_rng(cfg.seed)
    return rng.permutation(cfg.slots).astype(np.uint64).reshape(cfg.requests, cfg.pages)


def expected_pages(cfg: DemoConfig, request: int) -> np.ndarray:
    """The synthetic KV bytes of one request: uint8 array of shape (pages, page_size).

    Every 8-byte word depends on the request, the page and its position, so a
    page in the wrong slot, a shifted copy or a stale page all fail the check.
    """
    words = cfg.page_size // 8
    page_ids = (np.uint64(request) * np.uint64(cfg.pages)
                + np.arange(cfg.pages, dtype=np.uint64))
    w = np.arange(words, dtype=np.uint64)
    with np.errstate(over="ignore"):
        vals = (page_ids[:, None] * _MIX_PAGE) ^ (w[None, :] * _MIX_WORD + _SALT)
    out = vals.view(np.uint8).reshape(cfg.pages, words * 8)
    if cfg.page_size % 8:
        tail = np.full((cfg.pages, cfg.page_size % 8), request & 0xFF, dtype=np.uint8)
        out = np.concatenate([out, tail], axis=1)
    return out


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ------------------------------------------------------------------ decode


async def _decode(cfg: DemoConfig, events: Any, stop: Any) -> None:
    import aioxfer

    async with aioxfer.Agent("decode", listen=cfg.listen, transports=cfg.transports) as agent:
        pool = agent.alloc(cfg.pool_bytes, name="kv")
        pages = pool.numpy().reshape(cfg.slots, cfg.page_size)
        # A serving engine's KV pool is warm: touch it once now, so page faults
        # of a fresh mapping are not what the demo measures.
        pages.fill(0)
        slots = page_slots(cfg)
        events.put(("address", agent.address))
        failures: list[str] = []
        seen: set[int] = set()
        deadline = time.monotonic() + cfg.timeout
        while len(seen) < cfg.requests:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                note = await agent.notifications.receive()
            try:
                rid = int(note.payload.decode().removeprefix("req-"))
            except ValueError:
                failures.append(f"unexpected notification {note.payload!r}")
                continue
            if rid in seen or not 0 <= rid < cfg.requests:
                failures.append(f"duplicate or unknown request id {rid}")
                continue
            seen.add(rid)
            # The notification came after the data: the pages must be there now.
            got = pages[slots[rid].astype(np.intp)]
            want = expected_pages(cfg, rid)
            bad = np.flatnonzero((got != want).any(axis=1))
            if bad.size:
                failures.append(
                    f"request {rid}: {bad.size} of {cfg.pages} pages differ "
                    f"(first: page {int(bad[0])}, slot {int(slots[rid][bad[0]])})"
                )
            events.put(("verified", rid, not bad.size))
        events.put(("decode-done", failures))
        # Keep serving until the parent has everything: the prefill side may
        # still be completing its last writes.
        await asyncio.get_running_loop().run_in_executor(None, stop.wait, cfg.timeout)


def _decode_main(cfg: DemoConfig, events: Any, stop: Any) -> None:
    try:
        asyncio.run(_decode(cfg, events, stop))
    except BaseException as exc:  # report, do not lose it in a child's stderr
        events.put(("error", "decode", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


# ------------------------------------------------------------------ prefill


async def _prefill(cfg: DemoConfig, addresses: Any, events: Any, stop: Any) -> None:
    import aioxfer

    loop = asyncio.get_running_loop()
    async with aioxfer.Agent("prefill", listen=cfg.listen, transports=cfg.transports) as agent:
        src = agent.alloc(cfg.pool_bytes, name="kv-src")
        src_pages = src.numpy().reshape(cfg.requests, cfg.pages, cfg.page_size)
        for r in range(cfg.requests):  # the "computed" KV cache of every request
            src_pages[r] = expected_pages(cfg, r)
        slots = page_slots(cfg)
        if cfg.inject_corruption and cfg.pages > 1:
            slots = slots.copy()
            slots[0, [0, 1]] = slots[0, [1, 0]]  # two pages of request 0 swap places
        # The decode side's address, once its pool is allocated and warm (its
        # "address" event); None: the parent gave up before that.
        try:
            address = await loop.run_in_executor(None, addresses.get, True, cfg.timeout)
        except queue.Empty:
            raise TimeoutError("no decode address within the timeout") from None
        if address is None:
            return
        async with asyncio.timeout(cfg.timeout):
            peer = await agent.connect(address)
        remote = peer.region("kv")
        events.put(("path", peer.path))
        lengths = np.full(cfg.pages, cfg.page_size, dtype=np.uint64)
        page_off = np.arange(cfg.pages, dtype=np.uint64) * np.uint64(cfg.page_size)
        window = asyncio.Semaphore(cfg.inflight)
        latencies: list[float] = []

        async def one(r: int) -> None:
            try:
                src_list = aioxfer.SegmentList(
                    src, np.uint64(r * cfg.pages * cfg.page_size) + page_off, lengths
                )
                dst_list = aioxfer.SegmentList(
                    remote, slots[r] * np.uint64(cfg.page_size), lengths
                )
                t0 = time.perf_counter()
                t = agent.write(src_list, dst_list, notify=f"req-{r}".encode())
                async with asyncio.timeout(cfg.timeout):
                    await t
                dt = time.perf_counter() - t0
                latencies.append(dt)
                events.put(("sent", r, dt))
            finally:
                window.release()

        tasks = []
        t_start = time.perf_counter()
        for r in range(cfg.requests):
            await window.acquire()
            tasks.append(asyncio.create_task(one(r)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t_start
        events.put(("prefill-done", elapsed, latencies))
        await loop.run_in_executor(None, stop.wait, cfg.timeout)


def _prefill_main(cfg: DemoConfig, addresses: Any, events: Any, stop: Any) -> None:
    try:
        asyncio.run(_prefill(cfg, addresses, events, stop))
    except BaseException as exc:
        events.put(("error", "prefill", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


# ------------------------------------------------------------------ parent


class _Bar:
    """A self-drawn progress bar on stderr: redrawn in place on a terminal, else
    printed as a fresh line every tenth of the way."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self.sent = 0
        self.verified = 0
        self._last = 0.0
        self._step = -1

    def _line(self) -> str:
        width = 30
        total = max(1, self.total)
        done = int(width * self.verified / total)
        sent = max(0, int(width * self.sent / total) - done)
        bar = "#" * done + "-" * sent + " " * max(0, width - done - sent)
        return f"[{bar}] sent {self.sent}/{self.total}  verified {self.verified}/{self.total}"

    def update(self, force: bool = False) -> None:
        if not self.enabled:
            return
        if self.live:
            now = time.monotonic()
            if force or now - self._last >= 0.05:
                self._last = now
                sys.stderr.write("\r" + self._line())
                sys.stderr.flush()
            return
        step = (10 * self.verified) // max(1, self.total)
        if step != self._step or force:
            self._step = step
            sys.stderr.write(self._line() + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.live:
            self.update(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif self.enabled and self.verified != self.total:
            self.update(force=True)


def run_demo(cfg: DemoConfig, out: Any = None) -> int:
    """Runs the demo; prints the summary to ``out``; returns the exit code."""
    out = out or sys.stdout
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    stop = ctx.Event()
    mib = cfg.pool_bytes / (1 << 20)
    print(
        f"aioxfer demo: {cfg.requests} requests x {cfg.pages} pages x {cfg.page_size} B "
        f"= {mib:.1f} MiB, {cfg.inflight} requests in flight, transport {cfg.transport}",
        file=out,
        flush=True,
    )
    addresses = ctx.Queue()
    # Both sides start at once, as two serving instances would: the prefill
    # process starts its interpreter and allocates and fills its own pool
    # while the decode side allocates its pool (the two pools' allocations,
    # 2 MiB pages each, ~0.1-2 s apiece where the host must back fresh
    # memory: docs/shm-huge-pages.md), and connects once the decode side
    # gives its address. Before, one after the other.
    decode = ctx.Process(target=_decode_main, args=(cfg, events, stop), name="decode")
    prefill = ctx.Process(target=_prefill_main, args=(cfg, addresses, events, stop),
                          name="prefill")
    decode.start()
    prefill.start()
    procs = [decode, prefill]
    bar = _Bar(cfg.requests, cfg.progress)
    path = "?"
    prefill_result: tuple[float, list[float]] | None = None
    decode_failures: list[str] | None = None
    errors: list[str] = []
    verified_ok = 0
    deadline = time.monotonic() + cfg.timeout
    try:
        while prefill_result is None or decode_failures is None:
            if time.monotonic() > deadline:
                errors.append(f"demo did not finish within {cfg.timeout:.0f} s")
                break
            try:
                ev = events.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode is not None]
                if dead:
                    # A child died without saying why (or its report is still in flight).
                    try:
                        ev = events.get(timeout=1.0)
                    except queue.Empty:
                        p = dead[0]
                        errors.append(f"{p.name} process exited with code {p.exitcode}")
                        break
                else:
                    continue
            kind = ev[0]
            if kind == "address":
                addresses.put(ev[1])
            elif kind == "path":
                path = ev[1]
            elif kind == "sent":
                bar.sent += 1
                bar.update()
            elif kind == "verified":
                bar.verified += 1
                verified_ok += bool(ev[2])
                bar.update()
            elif kind == "prefill-done":
                prefill_result = (ev[1], ev[2])
            elif kind == "decode-done":
                decode_failures = ev[1]
            elif kind == "error":
                errors.append(f"{ev[1]}: {ev[2]}")
                break
    finally:
        bar.close()
        stop.set()
        addresses.put(None)  # a prefill side still waiting for an address: stop
        for p in procs:
            p.join(timeout=30)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    ok = not errors and decode_failures == [] and verified_ok == cfg.requests
    print(f"transport: {path}", file=out)
    if prefill_result is not None:
        elapsed, lat = prefill_result
        ms = [x * 1e3 for x in lat]
        print(
            f"latency per request (post -> completion): p50 {_percentile(ms, 50):.3f} ms  "
            f"p99 {_percentile(ms, 99):.3f} ms",
            file=out,
        )
        gbs = cfg.pool_bytes / elapsed / 1e9 if elapsed > 0 else float("inf")
        print(f"throughput: {gbs:.2f} GB/s ({mib:.1f} MiB in {elapsed:.3f} s)", file=out)
    for line in errors:
        print(f"error: {line}", file=out)
    for line in (decode_failures or [])[:10]:
        print(f"mismatch: {line}", file=out)
    if ok:
        print(
            f"verification: ok ({cfg.requests}/{cfg.requests} requests, "
            f"{cfg.slots} pages checked byte for byte)",
            file=out,
        )
    else:
        print(
            f"verification: FAILED ({verified_ok}/{cfg.requests} requests verified)",
            file=out,
        )
    out.flush()
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--pages", type=int, default=512, help="KV pages per request (default 512)")
    p.add_argument("--page-size", type=int, default=16384, help="bytes per page (default 16384)")
    p.add_argument("--inflight", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--listen", default="127.0.0.1:0", help="address the agents listen on")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many s")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bar on stderr (default: on)",
    )
    p.add_argument("--inject-corruption", action="store_true", help=argparse.SUPPRESS)


def config_from_args(ns: argparse.Namespace) -> DemoConfig:
    for name in ("requests", "pages", "page_size", "inflight"):
        if getattr(ns, name) < 1:
            raise SystemExit(f"aioxfer demo: --{name.replace('_', '-')} must be at least 1")
    return DemoConfig(
        requests=ns.requests,
        pages=ns.pages,
        page_size=ns.page_size,
        inflight=ns.inflight,
        transport=ns.transport,
        seed=ns.seed,
        listen=ns.listen,
        progress=ns.progress,
        timeout=ns.timeout,
        inject_corruption=ns.inject_corruption,
    )

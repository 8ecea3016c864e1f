"""``aioxfer bench``: nixlbench-style sweeps of READ and WRITE between two agents.

An initiator agent (this process) and a target agent (a spawned child process
by default, or the same process with ``--same-process``) each hold registered
pools (``agent.alloc``: shared memory that a same-host peer maps). For every
point of the sweep (op x transport x segment size x descriptors per request x
requests in flight) the initiator keeps ``inflight`` requests posted, each of
``descs`` segments, for ``--duration`` seconds (or ``--reps`` requests), in
``--rounds`` rounds, and reports the median round: GB/s, requests/s,
descriptors/s, latency p50/p99 (post -> completion as the awaiting coroutine
sees it), CPU seconds per GB of each process, and the transport used.

Segments sit at scattered, page-aligned slots of a pool with a gap between
slots, so no layer can merge a request's descriptors into fewer copies. A
request of one descriptor is posted as a Segment pair; larger ones as two
SegmentLists (numpy offsets and lengths: no Python object per descriptor).

Source pools hold a position-dependent pattern derived from ``--seed``; the
destination span of a point is zeroed before it runs. After the point, a
sample of destination segments is checksummed where they lie (the target, over
its pipe, for writes; here for reads) and compared with the checksum of the
pattern that the source slot held: a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "BenchConfig",
    "BenchError",
    "Layout",
    "expected_digests",
    "fill_pattern",
    "format_size",
    "parse_size",
    "parse_sizes",
    "pattern_bytes",
    "plot_results",
    "run_bench",
    "segment_digests",
    "verify_digests",
]

T = TypeVar("T")

OPS = ("write", "read")
TRANSPORTS = ("shm", "tcp", "verbs")
MAX_DESCS = 100_000
MAX_INFLIGHT = 256
DEFAULT_SIZES = "4K,64K,1M,16M,64M"

# Verification reads at most this many bytes (and segments) per point: enough
# to catch a misplaced, shifted, stale or torn segment, cheap next to the point.
VERIFY_MAX_SEGMENTS = 64
VERIFY_MAX_BYTES = 64 << 20

_SRC = "bench-src"
_DST = "bench-dst"

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_S29 = np.uint64(29)
_S32 = np.uint64(32)
_MASK64 = (1 << 64) - 1
_FILL_CHUNK = 8 << 20


class BenchError(Exception):
    """The bench could not run (a target that died or did not answer)."""


# ------------------------------------------------------------------ sizes


def parse_size(text: str) -> int:
    """"4K" -> 4096; K, M and G are binary (KiB, MiB, GiB); "KB"/"KiB" spellings too."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in ("K", "M", "G") else t
    try:
        value = float(digits) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 4K, 64K, 1M, 1G)") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(f"not a size: {text!r} (a positive whole number of bytes)")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def format_size(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n}B"


def _parse_ints(text: str, what: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"aioxfer bench: --{what}: comma-separated integers, not {text!r}"
        ) from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise SystemExit(f"aioxfer bench: --{what}: each value must be in {lo}..{hi}")
    return list(dict.fromkeys(vals))


def _parse_names(text: str, what: str, allowed: Sequence[str]) -> list[str]:
    vals = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise SystemExit(
            f"aioxfer bench: --{what}: choose from {', '.join(allowed)} (comma-separated), "
            f"not {text!r}"
        )
    return list(dict.fromkeys(vals))


# ------------------------------------------------------------------ pattern


def _words(seed: int, first: int, count: int) -> npt.NDArray[np.uint64]:
    # splitmix64 of (word index ^ seed): every 8-byte word depends on its
    # position, so a segment copied to the wrong slot or shifted by any number
    # of words cannot match.
    salt = np.uint64((seed * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64)
    x = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x ^= salt
        x *= _M1
        x ^= x >> _S29
        x *= _M2
        x ^= x >> _S32
    return x


def pattern_bytes(seed: int, offset: int, length: int) -> npt.NDArray[np.uint8]:
    """The pattern bytes [offset, offset + length) of a source pool seeded with ``seed``."""
    first = offset // 8
    count = (offset + length + 7) // 8 - first
    raw = _words(seed, first, count).astype("<u8", copy=False).view(np.uint8)
    skip = offset - first * 8
    return raw[skip : skip + length]


def fill_pattern(buf: npt.NDArray[np.uint8], seed: int) -> None:
    """Fills a whole pool (a uint8 view) with its pattern, in chunks so the
    temporaries stay small."""
    n = buf.shape[0]
    for off in range(0, n, _FILL_CHUNK):
        m = min(_FILL_CHUNK, n - off)
        buf[off : off + m] = pattern_bytes(seed, off, m)


def segment_digests(buf: Any, offsets: Sequence[int], size: int) -> list[str]:
    """blake2b of each segment [off, off + size) of ``buf`` (any buffer), as hex."""
    mv = memoryview(buf).cast("B")
    return [
        hashlib.blake2b(mv[off : off + size], digest_size=16).hexdigest()
        for off in (int(o) for o in offsets)
    ]


def expected_digests(seed: int, src_offsets: Sequence[int], size: int) -> list[str]:
    """What ``segment_digests`` must give for segments copied from these source offsets."""
    return [
        hashlib.blake2b(pattern_bytes(seed, int(off), size).data, digest_size=16).hexdigest()
        for off in src_offsets
    ]


def verify_digests(
    got: Sequence[str],
    want: Sequence[str],
    dst_offsets: Sequence[int],
    src_offsets: Sequence[int],
) -> list[str]:
    """One message per sampled segment whose checksum is not the expected one
    (empty: all match)."""
    if len(got) != len(want):
        return [f"{len(got)} checksums came back for {len(want)} sampled segments"]
    return [
        f"segment at destination offset {int(d)} (copied from source offset {int(s)}) "
        f"has checksum {g}, expected {w}"
        for g, w, d, s in zip(got, want, dst_offsets, src_offsets, strict=True)
        if g != w
    ]


# ------------------------------------------------------------------ layout


def _pitch(size: int) -> int:
    # Page-aligned slots (as a KV pool's blocks are) with at least one page of
    # gap after each segment: neighbouring slots are never contiguous, so no
    # layer can coalesce a request's descriptors.
    gap = 4096 if size >= 4096 else 64
    return -(-(size + gap) // gap) * gap


def _slots(size: int, descs: int, inflight: int, pool_size: int) -> int:
    # Every descriptor of every request in flight gets its own slot while the
    # pool cap allows; beyond it, descriptors wrap around (same pairing).
    return max(1, min(descs * inflight, pool_size // _pitch(size)))


def pool_span(size: int, descs: int, inflight: int, pool_size: int) -> int:
    """Bytes of each pool a point uses."""
    return _slots(size, descs, inflight, pool_size) * _pitch(size)


@dataclass(frozen=True)
class Layout:
    """Where a point's segments lie. Descriptor k (counting across requests,
    modulo ``slots``) copies source slot ``src_slot[k]`` to destination slot
    ``dst_slot[k]``: two seeded permutations, so a destination slot always
    receives the same source slot, whichever request writes it."""

    size: int
    descs: int
    pitch: int
    slots: int
    templates: int  # distinct requests, cycled through
    src_slot: npt.NDArray[np.uint64]
    dst_slot: npt.NDArray[np.uint64]

    @classmethod
    def make(cls, size: int, descs: int, inflight: int, pool_size: int, seed: int) -> Layout:
        pitch = _pitch(size)
        slots = _slots(size, descs, inflight, pool_size)
        rng = np.random.default_rng(seed)
        src = rng.permutation(slots).astype(np.uint64)
        dst = rng.permutation(slots).astype(np.uint64)
        return cls(size, descs, pitch, slots, -(-slots // descs), src, dst)

    @property
    def span(self) -> int:
        return self.slots * self.pitch

    def indices(self, template: int) -> npt.NDArray[np.int64]:
        """Descriptor indices k of request template ``template``."""
        return (template * self.descs + np.arange(self.descs, dtype=np.int64)) % self.slots

    def src_offsets(self, k: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        return self.src_slot[k] * np.uint64(self.pitch)

    def dst_offsets(self, k: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        return self.dst_slot[k] * np.uint64(self.pitch)

    def sample(self, seed: int) -> npt.NDArray[np.int64]:
        """Descriptor indices to verify: the first and last used, and a seeded
        random few between, within VERIFY_MAX_SEGMENTS and VERIFY_MAX_BYTES."""
        used = min(self.slots, self.templates * self.descs)
        m = max(1, min(VERIFY_MAX_SEGMENTS, VERIFY_MAX_BYTES // self.size, used))
        if m >= used:
            return np.arange(used, dtype=np.int64)
        ends = [0, used - 1][:m]
        rng = np.random.default_rng(seed)
        pick = rng.choice(np.arange(1, used - 1), size=m - len(ends), replace=False)
        return np.unique(np.concatenate([ends, pick]).astype(np.int64))


# ------------------------------------------------------------------ processes


def _agent_kwargs(transport: str) -> dict[str, Any]:
    # "shm" is what automatic selection picks between same-host agents;
    # "tcp" and "verbs" are forced on both sides, as a user would (verbs over
    # the devices there, or AIOXFER_VERBS_PROVIDER's, which the target inherits).
    if transport in ("tcp", "verbs"):
        return {"transports": (transport,)}
    # shm: on a CUDA machine same-host peers would pick "cuda" by default
    return {"transports": ("shm", "tcp")}


def _run_loop(coro: Coroutine[Any, Any, T], use_uvloop: bool) -> T:
    if use_uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


class _Pools:
    """One agent's bench pools: "bench-src" (the seeded pattern) and
    "bench-dst" (zeroed), each only if this side needs it."""

    def __init__(self, agent: Any, src_bytes: int, dst_bytes: int, seed: int) -> None:
        self.src = agent.alloc(src_bytes, name=_SRC) if src_bytes else None
        self.dst = agent.alloc(dst_bytes, name=_DST) if dst_bytes else None
        if self.src is not None:
            fill_pattern(self.src.numpy(), seed)
        if self.dst is not None:
            # Touch every page now: page faults of a fresh mapping are not
            # what the bench measures.
            self.dst.numpy().fill(0)

    def zero(self, nbytes: int) -> None:
        assert self.dst is not None
        self.dst.numpy()[:nbytes] = 0

    def digests(self, offsets: Sequence[int], size: int) -> list[str]:
        assert self.dst is not None
        return segment_digests(self.dst.memoryview, offsets, size)

    def command(self, cmd: str, args: Sequence[Any]) -> Any:
        if cmd == "zero":
            self.zero(int(args[0]))
            return None
        if cmd == "digests":
            return self.digests(args[0], int(args[1]))
        if cmd == "cpu":
            # User + system time of every thread of this process (the engine's
            # progress and copy threads included).
            return time.process_time()
        raise ValueError(f"unknown target command {cmd!r}")


def _die_with_parent(parent_pid: int) -> None:
    """Asks the kernel to SIGKILL this process when its parent dies, so a
    killed bench never leaves a target holding memory."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    # The parent may have died before prctl took effect: then nobody waits for us.
    if os.getppid() != parent_pid:
        os._exit(1)


async def _serve_target(conn: Any, opts: dict[str, Any]) -> None:
    import aioxfer

    loop = asyncio.get_running_loop()
    async with aioxfer.Agent(
        "bench-target", listen=opts["listen"], **_agent_kwargs(opts["transport"])
    ) as agent:
        pools = _Pools(agent, opts["src_bytes"], opts["dst_bytes"], opts["seed"])
        conn.send(("ok", {"address": agent.address, "pid": os.getpid()}))
        while True:
            try:
                cmd, args = await loop.run_in_executor(None, conn.recv)
            except (EOFError, OSError):
                return  # the parent is gone: nobody left to serve
            if cmd == "quit":
                break
            try:
                conn.send(("ok", pools.command(cmd, args)))
            except Exception as exc:
                conn.send(("error", f"{cmd}: {type(exc).__name__}: {exc}"))
    # Acknowledged only once the agent is closed, so the parent reaps a process
    # that has released everything.
    conn.send(("ok", None))


def _target_main(conn: Any, opts: dict[str, Any], parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: the parent alone handles it and
    # closes this target (quit, or the pipe's end).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _run_loop(_serve_target(conn, opts), opts["uvloop"])
    except BaseException as exc:  # report it: a child's stderr is easily lost
        with contextlib.suppress(Exception):
            conn.send(("error", f"target: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


class _RemoteTarget:
    """The target agent in a spawned child process, driven over a pipe."""

    same_process = False

    def __init__(self, opts: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Started from the loop's (main) thread: PR_SET_PDEATHSIG fires when
        # the thread that forked the child ends, so never from a worker thread.
        self.proc = ctx.Process(
            target=_target_main,
            args=(child, opts, os.getpid()),
            name=f"aioxfer-bench-target-{opts['transport']}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.address = ""
        self.pid = self.proc.pid

    async def start(self, timeout: float) -> None:
        hello = await self._reply(timeout)
        self.address = hello["address"]

    async def call(self, cmd: str, *args: Any, timeout: float = 120.0) -> Any:
        self._conn.send((cmd, args))
        return await self._reply(timeout)

    async def cpu(self) -> float | None:
        return float(await self.call("cpu"))

    async def _reply(self, timeout: float) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self._recv, timeout)

    def _recv(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.1):
            code = self.proc.exitcode
            if code is not None and not self._conn.poll(0):
                raise BenchError(f"the target process exited with code {code}")
            if time.monotonic() > deadline:
                raise BenchError(f"the target process did not answer within {timeout:.0f} s")
        kind, value = self._conn.recv()
        if kind != "ok":
            raise BenchError(str(value))
        return value

    async def aclose(self) -> None:
        try:
            if self.proc.is_alive():
                self._conn.send(("quit", ()))
                await self._reply(30.0)
        except (BenchError, OSError, EOFError):
            pass
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.reap)

    def reap(self) -> None:
        """Waits for the child (killing it if it lingers); idempotent."""
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self._conn.close()


class _LocalTarget:
    """The target agent in this process and on this loop (``--same-process``)."""

    same_process = True

    def __init__(self, opts: dict[str, Any]) -> None:
        self._opts = opts
        self._agent: Any = None
        self._pools: _Pools | None = None
        self.address = ""
        self.pid = os.getpid()

    async def start(self, timeout: float) -> None:
        import aioxfer

        o = self._opts
        agent = aioxfer.Agent("bench-target", listen=o["listen"], **_agent_kwargs(o["transport"]))
        self._agent = agent
        async with asyncio.timeout(timeout):
            await agent.__aenter__()
        self._pools = _Pools(agent, o["src_bytes"], o["dst_bytes"], o["seed"])
        self.address = agent.address

    async def call(self, cmd: str, *args: Any, timeout: float = 120.0) -> Any:
        assert self._pools is not None
        return self._pools.command(cmd, args)

    async def cpu(self) -> float | None:
        return None  # one process: its CPU time cannot be split between the sides

    async def aclose(self) -> None:
        if self._agent is not None:
            await self._agent.aclose()

    def reap(self) -> None:
        pass


# ------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class BenchConfig:
    ops: tuple[str, ...] = ("write",)
    transports: tuple[str, ...] = ("shm", "tcp")
    sizes: tuple[int, ...] = tuple(parse_sizes(DEFAULT_SIZES))
    descs: tuple[int, ...] = (1,)
    inflight: tuple[int, ...] = (1,)
    duration: float = 0.5
    reps: int | None = None
    rounds: int = 3
    same_process: bool = False
    verify: bool = True
    seed: int = 1234
    pool_size: int = 256 << 20
    listen: str = "127.0.0.1:0"
    timeout: float = 120.0
    json_path: str | None = None
    plot_path: str | None = None
    uvloop: bool = False
    progress: bool = True

    def points(self) -> list[tuple[str, str, int, int, int]]:
        """(transport, op, size, descs, inflight) in the order they run."""
        return [
            (t, op, s, d, i)
            for t in self.transports
            for op in self.ops
            for s in self.sizes
            for d in self.descs
            for i in self.inflight
        ]


@dataclass
class _Round:
    seconds: float
    requests: int
    latencies: list[float]
    paths: set[str] = field(default_factory=set)


async def _round(
    post: Callable[[Any, Any], Awaitable[Any]],
    pairs: Sequence[tuple[Any, Any]],
    inflight: int,
    duration: float,
    reps: int | None,
    timeout: float,
) -> _Round:
    """Keeps ``inflight`` requests posted, cycling through ``pairs``, until
    ``reps`` requests were issued or ``duration`` seconds passed."""
    lat: list[float] = []
    paths: set[str] = set()
    clock = time.perf_counter
    limit = reps if reps is not None else sys.maxsize
    issued = 0
    n = len(pairs)
    start = clock()
    deadline = start + duration if reps is None else math.inf

    async def worker() -> None:
        nonlocal issued
        while issued < limit and clock() < deadline:
            local, remote = pairs[issued % n]
            issued += 1
            t0 = clock()
            res = await post(local, remote)
            lat.append(clock() - t0)
            paths.add(res.path)

    # One deadline for the whole round, not one per request: a per-request
    # timeout scope would itself cost what small transfers take.
    async with asyncio.timeout(duration + timeout if reps is None else timeout):
        if inflight == 1 or limit == 1:
            await worker()
        else:
            try:
                async with asyncio.TaskGroup() as tg:
                    for _ in range(min(inflight, limit)):
                        tg.create_task(worker())
            except BaseExceptionGroup as eg:  # the first failure, plainly
                raise eg.exceptions[0] from None
    return _Round(clock() - start, issued, lat, paths)


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    return float(statistics.median(vals)) if vals else None


def _point_label(rec: dict[str, Any]) -> str:
    return (
        f"{rec['op']} {rec['transport']} {format_size(rec['size'])} x{rec['descs']} "
        f"@{rec['inflight']}"
    )


async def _run_point(
    cfg: BenchConfig,
    index: int,
    agent: Any,
    pools: _Pools,
    peer: Any,
    target: _RemoteTarget | _LocalTarget,
    transport: str,
    op: str,
    size: int,
    descs: int,
    inflight: int,
    on_round: Callable[[], None],
) -> dict[str, Any]:
    import aioxfer

    lay = Layout.make(size, descs, inflight, cfg.pool_size, cfg.seed + 7919 * (index + 1))
    rec: dict[str, Any] = {
        "op": op,
        "transport": transport,
        "path": peer.path,
        "api": "segment" if descs == 1 else "segmentlist",
        "size": size,
        "descs": descs,
        "inflight": inflight,
        "bytes_per_request": size * descs,
        "same_process": target.same_process,
        "pool_slots": lay.slots,
        "rounds": cfg.rounds,
        "requests": 0,
        "seconds": 0.0,
        "gbps": None,
        "requests_per_s": None,
        "descs_per_s": None,
        "latency_p50_us": None,
        "latency_p99_us": None,
        "cpu_initiator_s_per_gb": None,
        "cpu_target_s_per_gb": None,
        "rounds_gbps": [],
        "verify": "off",
        "verified_segments": 0,
        "verify_errors": [],
        "error": None,
    }
    local_region = pools.src if op == "write" else pools.dst
    remote_region = peer.region(_DST if op == "write" else _SRC)
    assert local_region is not None
    post: Callable[[Any, Any], Awaitable[Any]] = agent.write if op == "write" else agent.read
    lengths = np.full(descs, size, dtype=np.uint64)
    pairs: list[tuple[Any, Any]] = []
    for t in range(lay.templates):
        k = lay.indices(t)
        lo = lay.src_offsets(k) if op == "write" else lay.dst_offsets(k)
        ro = lay.dst_offsets(k) if op == "write" else lay.src_offsets(k)
        if descs == 1:
            a, b = int(lo[0]), int(ro[0])
            pairs.append((local_region[a : a + size], remote_region[b : b + size]))
        else:
            pairs.append(
                (
                    aioxfer.SegmentList(local_region, lo, lengths),
                    aioxfer.SegmentList(remote_region, ro, lengths),
                )
            )
    # A clean destination: verification then proves this point's data landed.
    if op == "write":
        await target.call("zero", lay.span)
    else:
        pools.zero(lay.span)

    rounds: list[dict[str, Any]] = []
    paths: set[str] = set()
    try:
        # Warm-up: every request template once (touches every slot), untimed.
        warm = await _round(post, pairs, inflight, 0.0, max(lay.templates, 2), cfg.timeout)
        paths |= warm.paths
        for _ in range(cfg.rounds):
            tc0 = await target.cpu()
            c0 = time.process_time()
            r = await _round(post, pairs, inflight, cfg.duration, cfg.reps, cfg.timeout)
            c1 = time.process_time()
            tc1 = await target.cpu()
            paths |= r.paths
            gb = r.requests * size * descs / 1e9
            lat_us = np.asarray(r.latencies) * 1e6
            rounds.append(
                {
                    "seconds": r.seconds,
                    "requests": r.requests,
                    "gbps": gb / r.seconds,
                    "requests_per_s": r.requests / r.seconds,
                    "descs_per_s": r.requests * descs / r.seconds,
                    "p50": float(np.percentile(lat_us, 50)),
                    "p99": float(np.percentile(lat_us, 99)),
                    "cpu_i": (c1 - c0) / gb,
                    "cpu_t": None if tc0 is None or tc1 is None else (tc1 - tc0) / gb,
                }
            )
            on_round()
    except (aioxfer.XferError, TimeoutError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    if rounds:
        rec["requests"] = sum(x["requests"] for x in rounds)
        rec["seconds"] = sum(x["seconds"] for x in rounds)
        rec["rounds_gbps"] = [x["gbps"] for x in rounds]
        for key, name in (
            ("gbps", "gbps"),
            ("requests_per_s", "requests_per_s"),
            ("descs_per_s", "descs_per_s"),
            ("latency_p50_us", "p50"),
            ("latency_p99_us", "p99"),
            ("cpu_initiator_s_per_gb", "cpu_i"),
            ("cpu_target_s_per_gb", "cpu_t"),
        ):
            rec[key] = _median([x[name] for x in rounds])
    if paths:
        rec["path"] = ",".join(sorted(paths))
    if cfg.verify and rec["error"] is None:
        k = lay.sample(cfg.seed + index)
        dst_offs = [int(x) for x in lay.dst_offsets(k)]
        src_offs = [int(x) for x in lay.src_offsets(k)]
        want = expected_digests(cfg.seed, src_offs, size)
        if op == "write":
            got = await target.call("digests", dst_offs, size)
        else:
            got = pools.digests(dst_offs, size)
        errors = verify_digests(got, want, dst_offs, src_offs)
        rec["verified_segments"] = len(dst_offs)
        rec["verify_errors"] = errors[:10]
        rec["verify"] = "FAILED" if errors else "ok"
    return rec


async def _sweep(
    cfg: BenchConfig,
    on_point: Callable[[dict[str, Any]], None],
    on_round: Callable[[], None],
    on_start: Callable[[str], None],
    warn: Callable[[str], None],
    targets: list[Any],
) -> None:
    import aioxfer

    points = cfg.points()
    for transport in cfg.transports:
        mine = [(n, p) for n, p in enumerate(points) if p[0] == transport]
        spans = {
            op: max(
                (pool_span(s, d, i, cfg.pool_size) for _, (_, o, s, d, i) in mine if o == op),
                default=0,
            )
            for op in OPS
        }
        opts = {
            "transport": transport,
            "listen": cfg.listen,
            "seed": cfg.seed,
            "uvloop": cfg.uvloop,
            # writes land in the target's dst; reads come from its src
            "src_bytes": spans["read"],
            "dst_bytes": spans["write"],
        }
        target: _RemoteTarget | _LocalTarget = (
            _LocalTarget(opts) if cfg.same_process else _RemoteTarget(opts)
        )
        targets.append(target)
        try:
            await target.start(cfg.timeout)
            async with aioxfer.Agent(
                "bench-initiator", listen=cfg.listen, **_agent_kwargs(transport)
            ) as agent:
                pools = _Pools(agent, spans["write"], spans["read"], cfg.seed)
                async with asyncio.timeout(cfg.timeout):
                    peer = await agent.connect(target.address)
                if peer.path != transport:
                    warn(f"transport {transport}: the peer path is {peer.path}, not {transport}")
                for n, (_, op, size, descs, inflight) in mine:
                    on_start(f"{op} {transport} {format_size(size)} x{descs} @{inflight}")
                    rec = await _run_point(
                        cfg, n, agent, pools, peer, target, transport, op, size, descs,
                        inflight, on_round,
                    )
                    on_point(rec)
        finally:
            await target.aclose()


# ------------------------------------------------------------------ output


class _Progress:
    """A progress bar on stderr: redrawn in place on a terminal; otherwise one
    line per finished point."""

    def __init__(self, points: int, rounds: int, enabled: bool, stream: TextIO) -> None:
        self.stream = stream
        self.enabled = enabled
        self.live = enabled and stream.isatty()
        self.points = points
        self.total = max(1, points * rounds)
        self.done_rounds = 0
        self.done_points = 0
        self.label = ""

    def _draw(self) -> None:
        width = 30
        filled = int(width * self.done_rounds / self.total)
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(
            f"\r\033[K[{bar}] {self.done_points}/{self.points} points  {self.label}"
        )
        self.stream.flush()

    def start(self, label: str) -> None:
        self.label = label
        if self.live:
            self._draw()

    def round_done(self) -> None:
        self.done_rounds += 1
        if self.live:
            self._draw()

    def clear(self) -> None:
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def point_done(self, rec: dict[str, Any]) -> None:
        self.done_points += 1
        if self.live:
            self._draw()
        elif self.enabled:
            gbps = rec["gbps"]
            fig = "-" if gbps is None else f"{gbps:.2f} GB/s"
            self.stream.write(
                f"[{self.done_points}/{self.points}] {_point_label(rec)}: {fig}, "
                f"verify {rec['verify']}\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.label = "done"
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


_COLUMNS: tuple[tuple[str, int], ...] = (
    ("op", -5),
    ("transport", -9),
    ("path", -4),
    ("size", 5),
    ("descs", 6),
    ("inflight", 8),
    ("GB/s", 8),
    ("req/s", 8),
    ("desc/s", 8),
    ("p50 us", 9),
    ("p99 us", 9),
    ("cpu-i s/GB", 10),
    ("cpu-t s/GB", 10),
    ("verify", -6),
)


def _cells(values: Sequence[str]) -> str:
    return "  ".join(
        v.ljust(-w) if w < 0 else v.rjust(w) for v, (_, w) in zip(values, _COLUMNS, strict=True)
    ).rstrip()


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, k in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= k:
            return f"{x / k:.3g}{unit}"
    return f"{x:.3g}"


def _fixed(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x < 1e4 else f"{x:.0f}"


def table_header() -> str:
    return _cells([name for name, _ in _COLUMNS])


def table_row(rec: dict[str, Any]) -> str:
    verify = "ERROR" if rec["error"] else rec["verify"]
    return _cells(
        [
            rec["op"],
            rec["transport"],
            rec["path"],
            format_size(rec["size"]),
            str(rec["descs"]),
            str(rec["inflight"]),
            _fixed(rec["gbps"], 2),
            _rate(rec["requests_per_s"]),
            _rate(rec["descs_per_s"]),
            _us(rec["latency_p50_us"]),
            _us(rec["latency_p99_us"]),
            _fixed(rec["cpu_initiator_s_per_gb"], 3),
            _fixed(rec["cpu_target_s_per_gb"], 3),
            verify,
        ]
    )


def machine_info(cfg: BenchConfig) -> dict[str, Any]:
    """What the figures were measured on."""
    import aioxfer

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "system": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": None,
        "mem_total_bytes": None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "aioxfer": aioxfer.__version__,
        "loop": "uvloop" if cfg.uvloop else "asyncio",
        "same_process": cfg.same_process,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_bytes"] = int(line.split()[1]) * 1024
                    break
    return info


def plot_results(results: Sequence[dict[str, Any]], path: str) -> None:
    """GB/s and latency (p50) against segment size, one line per transport and
    op (and per descs/inflight where the sweep varied them)."""
    from matplotlib.figure import Figure  # the optional "plot" extra

    ok = [r for r in results if r["gbps"] is not None]
    vary_d = len({r["descs"] for r in ok}) > 1
    vary_i = len({r["inflight"] for r in ok}) > 1
    groups: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault((r["transport"], r["op"], r["descs"], r["inflight"]), []).append(r)
    fig = Figure(figsize=(12, 4.8))
    ax_bw, ax_lat = fig.subplots(1, 2)
    colors = {"shm": "tab:blue", "tcp": "tab:orange"}
    styles = {"write": "-", "read": "--"}
    for (transport, op, d, i), recs in sorted(groups.items()):
        recs.sort(key=lambda r: r["size"])
        label = f"{transport} {op}"
        if vary_d:
            label += f" x{d}"
        if vary_i:
            label += f" @{i}"
        xs = [r["size"] for r in recs]
        kw: dict[str, Any] = {"marker": "o", "linestyle": styles.get(op, "-"), "label": label}
        if not (vary_d or vary_i):
            kw["color"] = colors.get(transport)
        ax_bw.plot(xs, [r["gbps"] for r in recs], **kw)
        ax_lat.plot(xs, [r["latency_p50_us"] for r in recs], **kw)
    sizes = sorted({r["size"] for r in ok})
    for ax, ylabel, title in (
        (ax_bw, "GB/s", "bandwidth"),
        (ax_lat, "latency p50 (µs, post -> completion)", "latency"),
    ):
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.set_xlabel("segment size")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if groups:
            ax.legend(fontsize="small")
    ax_lat.set_yscale("log")
    fig.suptitle("aioxfer bench (" + ("one process" if ok and ok[0]["same_process"]
                                     else "initiator and target in separate processes") + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def run_bench(cfg: BenchConfig, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Runs the sweep; the table goes to ``out``, progress and messages to
    ``err``. Returns the exit code: 0, or 1 on a failed verification or transfer."""
    out = out or sys.stdout
    err = err or sys.stderr
    points = cfg.points()
    progress = _Progress(len(points), cfg.rounds, cfg.progress, err)
    results: list[dict[str, Any]] = []
    targets: list[Any] = []
    warnings: list[str] = []
    timing = f"{cfg.reps} requests" if cfg.reps is not None else f"{cfg.duration:g} s"
    if cfg.progress:
        err.write(
            f"aioxfer bench: {len(points)} points, {cfg.rounds} round(s) of {timing} each, "
            f"target {'in this process' if cfg.same_process else 'in a child process'}, "
            f"loop {'uvloop' if cfg.uvloop else 'asyncio'}\n"
        )
        err.flush()
    print(table_header(), file=out, flush=True)

    def on_point(rec: dict[str, Any]) -> None:
        results.append(rec)
        progress.clear()
        print(table_row(rec), file=out, flush=True)
        progress.point_done(rec)

    def warn(msg: str) -> None:
        warnings.append(msg)
        progress.clear()
        err.write(f"warning: {msg}\n")
        err.flush()

    fatal: str | None = None
    try:
        _run_loop(
            _sweep(cfg, on_point, progress.round_done, progress.start, warn, targets), cfg.uvloop
        )
    except (BenchError, TimeoutError, OSError) as exc:
        fatal = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        import aioxfer

        if not isinstance(exc, aioxfer.XferError):
            raise
        fatal = f"{type(exc).__name__}: {exc}"
    finally:
        progress.close()
        # However the sweep ended, no target process outlives it.
        for t in targets:
            t.reap()

    failures: list[str] = []
    if fatal is not None:
        failures.append(f"the bench stopped: {fatal}")
    for rec in results:
        if rec["error"]:
            failures.append(f"{_point_label(rec)}: {rec['error']}")
        if rec["verify"] == "FAILED":
            failures.append(
                f"{_point_label(rec)}: verification FAILED: "
                f"{len(rec['verify_errors'])} of {rec['verified_segments']} sampled segments "
                f"differ; first: {rec['verify_errors'][0]}"
            )

    if cfg.json_path:
        doc = {
            "machine": machine_info(cfg),
            "config": {
                "ops": list(cfg.ops),
                "transports": list(cfg.transports),
                "sizes": list(cfg.sizes),
                "descs": list(cfg.descs),
                "inflight": list(cfg.inflight),
                "duration": None if cfg.reps is not None else cfg.duration,
                "reps": cfg.reps,
                "rounds": cfg.rounds,
                "same_process": cfg.same_process,
                "verify": cfg.verify,
                "seed": cfg.seed,
                "pool_size": cfg.pool_size,
            },
            "results": results,
            "warnings": warnings,
            "failures": failures,
        }
        with open(cfg.json_path, "w") as f:
            json.dump(_json_safe(doc), f, indent=1, allow_nan=False)
            f.write("\n")
    if cfg.plot_path and results:
        plot_results(results, cfg.plot_path)

    for line in failures:
        err.write(f"error: {line}\n")
    if cfg.verify and not failures:
        checked = sum(r["verified_segments"] for r in results)
        err.write(
            f"verification: ok ({len(results)} points, {checked} sampled segments checked)\n"
        )
    elif not cfg.verify:
        err.write("verification: off (--no-verify)\n")
    err.flush()
    return 1 if failures else 0


# ------------------------------------------------------------------ command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", default="write", help="ops to sweep: write,read (default write)")
    p.add_argument(
        "--transport",
        default="shm,tcp",
        help="transports to sweep: shm (automatic same-host selection), tcp, verbs (forced on "
        "both agents); default shm,tcp",
    )
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"segment sizes, K/M/G suffixes (default {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--descs", default="1", help=f"descriptors per request, 1..{MAX_DESCS} (default 1)"
    )
    p.add_argument(
        "--inflight", default="1", help=f"requests in flight, 1..{MAX_INFLIGHT} (default 1)"
    )
    timing = p.add_mutually_exclusive_group()
    timing.add_argument(
        "--duration", type=float, default=0.5, help="seconds per round (default 0.5)"
    )
    timing.add_argument("--reps", type=int, default=None, help="requests per round, not seconds")
    p.add_argument("--rounds", type=int, default=3, help="rounds per point; medians (default 3)")
    p.add_argument(
        "--same-process",
        action="store_true",
        help="run the target agent in this process (default: a child process)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the data checks")
    p.add_argument("--seed", type=int, default=1234, help="pattern and layout seed")
    p.add_argument(
        "--pool-size",
        default="256M",
        help="cap on each pool; larger sweeps reuse slots (default 256M)",
    )
    p.add_argument("--listen", default="127.0.0.1:0", help="address the agents listen on")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="give up on a round after this many s"
    )
    p.add_argument("--json", metavar="FILE", default=None, help="write all results as JSON")
    p.add_argument(
        "--plot", metavar="PNG", default=None,
        help="draw GB/s and latency against size (needs matplotlib: aioxfer[plot])",
    )
    p.add_argument("--uvloop", action="store_true", help="run the event loops on uvloop")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress on stderr (default: on)",
    )


def _require(module: str, why: str) -> None:
    # Checked before the sweep, not after minutes of measuring.
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"aioxfer bench: {why}") from None


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    try:
        sizes = parse_sizes(ns.sizes)
        pool_size = parse_size(ns.pool_size)
    except ValueError as exc:
        raise SystemExit(f"aioxfer bench: {exc}") from None
    if not sizes:
        raise SystemExit("aioxfer bench: --sizes: at least one size")
    if not ns.duration > 0 or not math.isfinite(ns.duration):
        raise SystemExit("aioxfer bench: --duration must be a positive number of seconds")
    if ns.reps is not None and ns.reps < 1:
        raise SystemExit("aioxfer bench: --reps must be at least 1")
    if ns.rounds < 1:
        raise SystemExit("aioxfer bench: --rounds must be at least 1")
    if not ns.timeout > 0:
        raise SystemExit("aioxfer bench: --timeout must be positive")
    if ns.uvloop:
        _require("uvloop", "--uvloop needs uvloop, which is not installed (pip install uvloop)")
    if ns.plot:
        _require(
            "matplotlib",
            "--plot needs matplotlib, which is not installed (pip install 'aioxfer[plot]')",
        )
    return BenchConfig(
        ops=tuple(_parse_names(ns.op, "op", OPS)),
        transports=tuple(_parse_names(ns.transport, "transport", TRANSPORTS)),
        sizes=tuple(dict.fromkeys(sizes)),
        descs=tuple(_parse_ints(ns.descs, "descs", 1, MAX_DESCS)),
        inflight=tuple(_parse_ints(ns.inflight, "inflight", 1, MAX_INFLIGHT)),
        duration=float(ns.duration),
        reps=ns.reps,
        rounds=ns.rounds,
        same_process=ns.same_process,
        verify=not ns.no_verify,
        seed=ns.seed,
        pool_size=pool_size,
        listen=ns.listen,
        timeout=float(ns.timeout),
        json_path=ns.json,
        plot_path=ns.plot,
        uvloop=ns.uvloop,
        progress=ns.progress,
    )

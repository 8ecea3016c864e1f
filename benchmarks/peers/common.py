"""What every benchmark in benchmarks/peers shares: the workloads, the timing
loops, the data pattern and checksums, the record format, and the control pipe
between an initiator and the target process it starts.

Record format: one JSON object per measurement on stdout, prefixed "RESULT ":

  {"peer": "nixl" | "mooncake" | "aioxfer" | "limit", "transport": ..., "op": ...,
   "size": bytes per request, "iters": n, "secs": elapsed, "gbps": 1e9 bytes/s,
   "lat_us_med"/"lat_us_p99": per-op wall time in µs (4 KiB, one at a time),
   "req_per_s": requests/s (in-flight and batch cases), "verified": CRC32 matched,
   "cpu_s": CPU seconds (user + system, every thread) that the initiator and the
   target process it started spent together during the timed loop,
   "run": round id, "phase": what the driver called this run}

Op names are the same for every system: "WRITE"/"READ" (one request of `size`
bytes, one outstanding), "WRITE_qd16" (16 x 4 KiB posted, then all awaited),
"WRITE_batch256x16KiB" (one request of 256 scattered 16 KiB descriptors),
"first_write_incl_connect".

Knobs (environment): BENCH_MIN_SECS (seconds per point, default 1.0),
BENCH_LAT_SAMPLES (4 KiB latency samples, default 2000), BENCH_CONNECT_SAMPLES
(fresh initiators timed for "first_write_incl_connect", default 15, the same
for every system), BENCH_CONNECT_ONLY=1 (that row only, then exit),
BENCH_RUN_ID, BENCH_PHASE.

"first_write_incl_connect" is timed the same way for every system: a fresh
initiator (agent / engine, its memory registered before the clock starts)
connects to the long-lived target and writes 4 KiB; a sample ends when the
initiator saw its write complete AND the target saw the bytes in its buffer
(connect_sample / the target's "watch"). The second condition matters for
Mooncake: its TCP WRITE completes once the body is in the local socket (no
reply from the target), so its own completion alone comes before the data has
landed. Records carry the median ("lat_us_med"), the first sample (the
process's first connect: "lat_us_first"), quartiles, and the median of each
system's own completion ("own_us_med").
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

KiB = 1024
MiB = 1024 * KiB
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
BUF_SIZE = 64 * MiB
QDS = (16, 64)  # 4 KiB requests in flight
BATCH_N = 256
BATCH_DESC = 16 * KiB
BATCH_BYTES = BATCH_N * BATCH_DESC
MIN_SECS = float(os.environ.get("BENCH_MIN_SECS", "1.0"))
LAT_SAMPLES = int(os.environ.get("BENCH_LAT_SAMPLES", "2000"))
CONNECT_SAMPLES = int(os.environ.get("BENCH_CONNECT_SAMPLES", "15"))
CONNECT_ONLY = bool(os.environ.get("BENCH_CONNECT_ONLY"))
MAX_ITERS = 2_000_000
RUN_ID = os.environ.get("BENCH_RUN_ID", "0")


# ------------------------------------------------------------------ CPU cost
# Both sides: this process (getrusage) and the target spawn_target started
# (/proc/<pid>/stat). The last timed loop's total goes into the next record
# emitted with a rate ("cpu_s"): CPU seconds per GB moved = cpu_s / (gbps * secs).

_TARGET_PID: int | None = None
_LAST_CPU: float | None = None
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    total = ru.ru_utime + ru.ru_stime
    if _TARGET_PID is not None:
        try:
            with open(f"/proc/{_TARGET_PID}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def emit(**kw: Any) -> None:
    global _LAST_CPU
    if _LAST_CPU is not None and "secs" in kw and ("gbps" in kw or "req_per_s" in kw):
        kw.setdefault("cpu_s", _LAST_CPU)
    _LAST_CPU = None
    kw.setdefault("run", RUN_ID)
    if os.environ.get("BENCH_PHASE"):
        kw.setdefault("phase", os.environ["BENCH_PHASE"])
    print("RESULT " + json.dumps(kw), flush=True)


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def gbps(nbytes: int, iters: int, secs: float) -> float:
    return nbytes * iters / secs / 1e9


# ------------------------------------------------------------------ timing


def timed_loop(op: Callable[[], Any], min_secs: float = MIN_SECS,
               warmup: int = 3) -> tuple[int, float]:
    """Calls op() until min_secs have passed; returns (iterations, seconds).
    The batch between clock reads doubles up to 1024, so the clock is read rarely."""
    global _LAST_CPU
    for _ in range(warmup):
        op()
    iters, batch = 0, 1
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    while True:
        for _ in range(batch):
            op()
        iters += batch
        el = time.perf_counter() - t0
        if el >= min_secs or iters >= MAX_ITERS:
            _LAST_CPU = cpu_seconds() - c0
            return iters, el
        batch = min(batch * 2, 1024)


async def atimed_loop(
    op: Callable[[], Awaitable[Any]], min_secs: float = MIN_SECS, warmup: int = 3
) -> tuple[int, float]:
    """timed_loop for an awaitable operation (same calibration)."""
    global _LAST_CPU
    for _ in range(warmup):
        await op()
    iters, batch = 0, 1
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    while True:
        for _ in range(batch):
            await op()
        iters += batch
        el = time.perf_counter() - t0
        if el >= min_secs or iters >= MAX_ITERS:
            _LAST_CPU = cpu_seconds() - c0
            return iters, el
        batch = min(batch * 2, 1024)


def _percentiles(ns: list[int]) -> tuple[float, float]:
    ns.sort()
    return statistics.median(ns) / 1e3, ns[max(0, int(len(ns) * 0.99) - 1)] / 1e3


def latency_samples(op: Callable[[], Any], n: int = LAT_SAMPLES,
                    warmup: int = 50) -> tuple[float, float]:
    """Median and p99 wall time of one op, in µs."""
    for _ in range(warmup):
        op()
    pc = time.perf_counter_ns
    s = []
    for _ in range(n):
        t = pc()
        op()
        s.append(pc() - t)
    return _percentiles(s)


async def alatency_samples(
    op: Callable[[], Awaitable[Any]], n: int = LAT_SAMPLES, warmup: int = 50
) -> tuple[float, float]:
    for _ in range(warmup):
        await op()
    pc = time.perf_counter_ns
    s = []
    for _ in range(n):
        t = pc()
        await op()
        s.append(pc() - t)
    return _percentiles(s)


# ------------------------------------------------------------------ data


def pattern(seed: int, start: int, n: int) -> np.ndarray:
    """Bytes [start, start+n) of a non-constant pattern, so misplaced bytes show."""
    v = np.arange(start, start + n, dtype=np.uint32)
    return ((v * np.uint32(2654435761) + np.uint32(seed)) >> np.uint32(13)).astype(np.uint8)


def fill_pattern(buf: np.ndarray, seed: int, start: int = 0) -> None:
    """Fills buf with the pattern as it lies at byte offset `start` of a buffer."""
    step = 16 * MiB  # bounded temporaries
    for a in range(0, buf.size, step):
        b = min(buf.size, a + step)
        buf[a:b] = pattern(seed, start + a, b - a)


def crc(buf: Any) -> int:
    return zlib.crc32(memoryview(buf))


def crc_pages(buf: np.ndarray, pages: Any, psz: int) -> int:
    c = 0
    for p in pages:
        c = zlib.crc32(memoryview(buf[int(p) * psz:(int(p) + 1) * psz]), c)
    return c


def expected_crc(seed: int, size: int) -> int:
    return crc(pattern(seed, 0, size))


def expected_crc_pages(seed: int, pages: Any, psz: int) -> int:
    c = 0
    for p in pages:
        c = zlib.crc32(memoryview(pattern(seed, int(p) * psz, psz)), c)
    return c


def batch_pages() -> tuple[np.ndarray, np.ndarray]:
    """The batch's 256 local and 256 remote page numbers (16 KiB pages of a 64 MiB
    buffer, random, so no two descriptors can be merged). Same for every system."""
    rng = np.random.default_rng(1234)
    npages = BUF_SIZE // BATCH_DESC
    return rng.permutation(npages)[:BATCH_N], rng.permutation(npages)[:BATCH_N]


# ------------------------------------------------------------------ control pipe
# Between the initiator and its target, over the child's stdin/stdout: length-
# prefixed pickles, for metadata and verification only, never for timed data.


class Ctl:
    def __init__(self, rfile: Any, wfile: Any) -> None:
        self.r = rfile
        self.w = wfile

    def send(self, obj: Any) -> None:
        b = pickle.dumps(obj)
        self.w.write(struct.pack("<Q", len(b)) + b)
        self.w.flush()

    def _read(self, n: int) -> bytes:
        b = b""
        while len(b) < n:
            part = self.r.read(n - len(b))  # an unbuffered pipe returns what it has
            if not part:
                raise EOFError("control channel closed")
            b += part
        return b

    def recv(self) -> Any:
        (n,) = struct.unpack("<Q", self._read(8))
        return pickle.loads(self._read(n))

    def call(self, *msg: Any) -> Any:
        self.send(msg)
        return self.recv()


def child_ctl() -> Ctl:
    """In the target: the control pipe on the original stdin/stdout (stdout itself
    is pointed at stderr, so library chatter cannot corrupt the pipe). The target
    is SIGKILLed by the kernel if its initiator dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    r = os.fdopen(os.dup(0), "rb", buffering=0)
    w = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return Ctl(r, w)


def serve_check(msg: tuple[Any, ...], buf: np.ndarray, ctl: Ctl) -> bool:
    """Answers the target-side verification requests on `buf`; False if `msg` is not one."""
    kind = msg[0]
    if kind == "crc":  # ("crc", offset, n)
        ctl.send(crc(buf[msg[1]:msg[1] + msg[2]]))
    elif kind == "crc_pages":  # ("crc_pages", pages, page_size)
        ctl.send(crc_pages(buf, msg[1], msg[2]))
    elif kind == "fill":  # ("fill", seed)
        fill_pattern(buf, msg[1])
        ctl.send("ok")
    elif kind == "watch":  # ("watch", offset, n, crc): armed, then "landed" answers
        _Watch.start(buf, msg[1], msg[2], msg[3])
        ctl.send("armed")
    elif kind == "landed":  # when the watched bytes were seen (monotonic ns), or None
        ctl.send(_Watch.result())
    else:
        return False
    return True


class _Watch:
    """The target's watcher: a thread that polls [offset, offset+n) of its
    buffer for an expected CRC every ~25 µs (its own timer slack lowered to
    1 µs; a poll of 4 KiB costs ~1 µs, so it barely loads the machine) and
    stamps CLOCK_MONOTONIC when it matches: when a write landed, whatever the
    writing system calls complete. Gives up after 10 s (None)."""

    thread: Any = None
    seen: int | None = None

    @classmethod
    def start(cls, buf: np.ndarray, off: int, n: int, want: int) -> None:
        import threading

        cls.seen = None
        view = buf[off:off + n]

        def poll() -> None:
            try:
                import ctypes

                ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 µs
            except Exception:
                pass
            end = time.monotonic() + 10
            while time.monotonic() < end:
                if zlib.crc32(memoryview(view)) == want:
                    cls.seen = time.monotonic_ns()
                    return
                time.sleep(20e-6)

        cls.thread = threading.Thread(target=poll, daemon=True)
        cls.thread.start()

    @classmethod
    def result(cls) -> int | None:
        if cls.thread is not None:
            cls.thread.join()
            cls.thread = None
        return cls.seen


class ConnectSample:
    """One "first_write_incl_connect" sample (see the module docstring), as
    the initiator takes it: ``arm(src)`` before the clock starts (src: the 4
    KiB about to be written to the target's offset 0, filled here with a
    pattern of its own), ``start()``, the system's connect + write, ``done()``
    once the system says it completed; ``finish()`` then waits for the
    target's stamp and returns (sample µs, the system's own µs)."""

    seed = 1000

    def __init__(self, ctl: Ctl) -> None:
        self.ctl = ctl
        self.t0 = self.t1 = 0

    def arm(self, src: np.ndarray) -> None:
        ConnectSample.seed += 1
        src[:4 * KiB] = pattern(ConnectSample.seed, 0, 4 * KiB)
        assert self.ctl.call("watch", 0, 4 * KiB, crc(src[:4 * KiB])) == "armed"

    def start(self) -> None:
        self.t0 = time.monotonic_ns()

    def done(self) -> None:
        self.t1 = time.monotonic_ns()

    def finish(self) -> tuple[float, float]:
        seen = self.ctl.call("landed")
        if seen is None:
            raise RuntimeError("the target never saw the first 4 KiB write land")
        return (max(self.t1, seen) - self.t0) / 1e3, (self.t1 - self.t0) / 1e3


def emit_connect(base: dict[str, Any], samples: list[tuple[float, float]], **extra: Any) -> None:
    """The "first_write_incl_connect" record of ConnectSample results."""
    lat = [s for s, _ in samples]
    q = statistics.quantiles(lat, n=4) if len(lat) > 1 else [lat[0]] * 3
    emit(**base, op="first_write_incl_connect", size=4 * KiB, samples=len(lat),
         lat_us_med=statistics.median(lat), lat_us_q1=q[0], lat_us_q3=q[2],
         lat_us_min=min(lat), lat_us_first=lat[0],
         own_us_med=statistics.median(o for _, o in samples), **extra)


def spawn_target(argv: list[str],
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Ctl]:
    e = dict(os.environ)
    if env:
        e.update(env)
    global _TARGET_PID
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=e)
    _TARGET_PID = p.pid  # its CPU time counts with ours (cpu_seconds)
    return p, Ctl(p.stdout, p.stdin)


def stop_target(p: subprocess.Popen[bytes], ctl: Ctl | None = None, timeout: float = 20) -> None:
    """Asks the target to exit, then stops it by its own pid if it does not."""
    try:
        if ctl is not None:
            ctl.send(("exit",))
    except Exception:
        pass
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ verification
# Initiator side, the same for every system: prepare, move the data once, check.
# WRITE: our pattern must arrive in the target's bytes. READ: the target's pattern
# must arrive in our zeroed bytes. Batch: local page i <-> remote page i.


def prepare_single(op: str, ctl: Ctl, buf: np.ndarray, size: int, seed: int) -> None:
    if op == "WRITE":
        fill_pattern(buf[:size], seed)
    else:
        ctl.call("fill", seed)
        buf[:size] = 0


def check_single(op: str, ctl: Ctl, buf: np.ndarray, size: int, seed: int) -> bool:
    if op == "WRITE":
        return bool(ctl.call("crc", 0, size) == crc(buf[:size]))
    return crc(buf[:size]) == expected_crc(seed, size)


def prepare_batch(op: str, ctl: Ctl, buf: np.ndarray, seed: int, lpages: Any) -> None:
    if op == "WRITE":
        fill_pattern(buf, seed)
    else:
        ctl.call("fill", seed)
        for p in lpages:
            buf[int(p) * BATCH_DESC:(int(p) + 1) * BATCH_DESC] = 0


def check_batch(op: str, ctl: Ctl, buf: np.ndarray, seed: int, lpages: Any, rpages: Any) -> bool:
    mine = crc_pages(buf, lpages, BATCH_DESC)
    if op == "WRITE":
        return bool(ctl.call("crc_pages", [int(p) for p in rpages], BATCH_DESC) == mine)
    return mine == expected_crc_pages(seed, rpages, BATCH_DESC)


# ------------------------------------------------------------------ the workload sequence

Op = Callable[[], Any]
Made = tuple[Op, Callable[[], None] | None]  # (run once, release or None)


def run_suite(base: dict[str, Any], ctl: Ctl, buf: np.ndarray, ops: list[str],
              single: Callable[[str, int], Made],
              inflight: Callable[[str, int], Made],
              batch: Callable[[str, np.ndarray, np.ndarray], Made]) -> None:
    """Every workload, for a system whose operations are blocking calls.
    single(op, size): one request of [0:size] -> [0:size]; inflight(op, qd): qd x 4 KiB
    at offsets i*4 KiB, posted, then all waited for; batch(op, lpages, rpages): one
    request of 256 x 16 KiB pages. bench_aioxfer.py runs the same sequence, awaited."""
    seed = 7
    lpages, rpages = batch_pages()
    for op in ops:
        for size in SIZES:
            once, release = single(op, size)
            seed += 1
            prepare_single(op, ctl, buf, size, seed)
            once()
            ok = check_single(op, ctl, buf, size, seed)
            iters, secs = timed_loop(once)
            rec = dict(base, op=op, size=size, iters=iters, secs=secs,
                       gbps=gbps(size, iters, secs), verified=ok)
            if size == 4 * KiB:
                rec["lat_us_med"], rec["lat_us_p99"] = latency_samples(once)
            emit(**rec)
            if release:
                release()
        for qd in QDS:
            once, release = inflight(op, qd)
            seed += 1
            prepare_single(op, ctl, buf, qd * 4 * KiB, seed)
            once()
            ok = check_single(op, ctl, buf, qd * 4 * KiB, seed)
            iters, secs = timed_loop(once)
            emit(**base, op=f"{op}_qd{qd}", size=4 * KiB, iters=iters * qd, secs=secs,
                 gbps=gbps(4 * KiB * qd, iters, secs), req_per_s=iters * qd / secs, verified=ok)
            if release:
                release()
        once, release = batch(op, lpages, rpages)
        seed += 1
        prepare_batch(op, ctl, buf, seed, lpages)
        once()
        ok = check_batch(op, ctl, buf, seed, lpages, rpages)
        iters, secs = timed_loop(once)
        emit(**base, op=f"{op}_batch256x16KiB", size=BATCH_BYTES, iters=iters, secs=secs,
             gbps=gbps(BATCH_BYTES, iters, secs), req_per_s=iters / secs, verified=ok)
        if release:
            release()

#!/usr/bin/env python3
"""The vLLM-shaped transfer path through aioxfer.nixl, real NIXL and aioxfer's
own API, side by side in one run.

Each system moves data between two processes (the initiator starts its target
as a child) over 127.0.0.1, between 16 MiB registered host buffers (user
memory: numpy arrays, as vLLM's KV caches are), for READ and WRITE:

- one request of 4 KiB, 64 KiB, 1 MiB, 16 MiB, repeated one at a time;
- 256 x 16 KiB by index: both pools prepared as 1024 16 KiB blocks, one
  request of 256 scattered block indices per side (vLLM's make_prepped_xfer).

NIXL-shaped systems (``nixl``: real NIXL 1.5.1 with UCX from its venv,
``compat``: aioxfer.nixl) prepare descriptor lists, make the request once and
repost it, polling ``check_xfer_state`` until DONE (what vLLM and NIXL's own
benchmark do). ``native`` awaits ``agent.read``/``agent.write`` of the same
Segment pair or SegmentList pair. Paths: ``shm`` (same host: NIXL's UCX picks
CMA; aioxfer shm) and ``tcp`` (UCX_TLS=tcp; aioxfer transports=("tcp",)).

All three systems' process pairs are started first and kept stopped
(SIGSTOP); for each point they take turns, one pair running at a time, in a
rotating order: ``--reps`` x ``--split`` rounds of a turn of ``--slice`` /
``--split`` seconds each. On a shared, busy machine the systems then see the
same conditions, and each ratio compares turns taken back to back: the
shorter the turns, the closer (an A/A run, native against itself, on shm with
the load of other benchmarks: ratios 0.52-1.20 with 5 rounds of 0.25 s
turns, 0.88-1.15 with 15 of 0.08 s). Every workload's data is checked once
(CRC32 of both sides) before it is timed. Each turn also measures the CPU
time both processes of the pair spent per request, which others' load does
not stretch as it stretches wall time (in clock ticks, 10 ms: a turn's is
coarse). All aioxfer processes get one calibration (``--inline shared``,
see shared_inline).

    python benchmarks/peers/bench_nixl_compat.py                          # about 3 minutes
    python benchmarks/peers/bench_nixl_compat.py --reps 2 --slice 0.05    # quick: proves it runs
    valgrind --tool=callgrind --separate-threads=yes python benchmarks/peers/bench_nixl_compat.py \
        --role count --system compat --workload "READ 4 KiB" --count 5000  # and 1000: subtract

``--aa SYSTEM`` adds an A/A pair: a second pair of one system, taking turns
with the others, the first's figures over the second's, with the spread of
the turns' ratios: what the machine's noise alone makes of a ratio in the
same run (a compat row that misses its target by less than that is noise,
not code). ``--aa native --only native``: an A/A run alone.

compat and native run in one process pair, between the same two buffers
(``--memory same``, the default; ``separate``: a pair each): with every
buffer in huge pages, which physical pages a pair got still moves its 1 MiB
copy by up to ~10 % (memcpy of 1 MiB into five buffers of one process:
32.8-36.0 µs, the same order on a repeat), for the pair's life, so that
separate pairs' compat ÷ native at 1 MiB was 0.91-1.12x from run to run with
the same code (native ÷ native' 0.86-1.11x); the same buffers: 0.97-1.02x.

``--nixl-python`` (default: $PEERS_VENVS/venv-nixl/bin/python, made by
install.sh) runs the real NIXL side; this script must also be importable by
it (it imports aioxfer only in the aioxfer systems).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

BUF = 16 << 20
BLOCK = 16 << 10
NBLOCKS = BUF // BLOCK
BATCH = 256
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
SYSTEMS = ["nixl", "compat", "native"]


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def buffer() -> np.ndarray:
    """A BUF-byte buffer for a process to register, its pages as $BENCH_PAGES
    says (``--pages``; "INITIATOR'S,TARGET'S" or one for both):

    - ``huge`` (the default): 2 MiB-aligned, MADV_HUGEPAGE, touched, then
      MADV_COLLAPSE (Linux 6.1) to insist where a fault got 4 KiB pages: all
      in huge pages when the kernel has any;
    - ``numpy``: np.empty, as vLLM's caches. numpy advises huge pages from 4
      MiB, but its mapping is not 2 MiB-aligned: the part before the first 2
      MiB boundary (0-2 MiB, 1128 KiB in initiators here, moving between
      processes with their threads' stacks) stays in 4 KiB pages, and a fault
      that finds no free huge page (a fragmented machine) falls back to 4 KiB
      pages for the life of the process;
    - ``small``: MADV_NOHUGEPAGE, all in 4 KiB pages.

    Why it matters: a same-host copy between two processes' user memory is
    process_vm_writev/readv, and the kernel pins the *target's* pages for
    every call, a page-table walk and a reference per 4 KiB page, one per 2
    MiB page. A target in 4 KiB pages made the same code 0.84x at 64 KiB and
    0.77x at 1 MiB (0.93x at 16 MiB, 1.0x at 4 KiB; native pairs taking
    turns, 2026-12-05); the initiator's pages moved it by 5 % at most. With
    numpy buffers that decided a pair's speed for its whole life: A/A runs
    (native ÷ native') had shown 1.18-1.19x on exactly those rows."""
    hows = os.environ.get("BENCH_PAGES", "huge").split(",")
    how = hows[-1] if _role == "target" else hows[0]
    if how == "numpy":
        return np.empty(BUF, dtype=np.uint8)
    if how not in ("huge", "small"):
        raise SystemExit(f"BENCH_PAGES: huge, numpy or small, not {how!r}")
    huge = 2 << 20
    mm = mmap.mmap(-1, BUF + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _keep_maps.append(mm)
    raw = np.frombuffer(mm, dtype=np.uint8)
    off = -raw.ctypes.data % huge
    mm.madvise(mmap.MADV_HUGEPAGE if how == "huge" else mmap.MADV_NOHUGEPAGE, off, BUF)
    buf = raw[off:off + BUF]
    buf[:] = 0
    if how == "huge":
        with contextlib.suppress(OSError):  # before 6.1 (EINVAL), or no huge page (EAGAIN)
            mm.madvise(MADV_COLLAPSE, off, BUF)
    return buf


MADV_COLLAPSE = 25
_keep_maps: list[mmap.mmap] = []
_role = "driver"


def fill(buf: np.ndarray, seed: int) -> None:
    buf[:] = (np.arange(buf.size, dtype=np.uint32) * seed % 251).astype(np.uint8)


def batch_indices(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.choice(NBLOCKS, BATCH, replace=False).astype(np.int64),
            rng.choice(NBLOCKS, BATCH, replace=False).astype(np.int64))


def gathered_crc(buf: np.ndarray, idx: np.ndarray) -> int:
    crc = 0
    for i in idx.tolist():
        crc = zlib.crc32(buf[i * BLOCK:(i + 1) * BLOCK], crc)
    return crc


# ---------------------------------------------------------------- target side


def own_calibration(system: str) -> dict[str, int] | None:
    """This aioxfer process's calibration (what its engines run with: the
    inline threshold, $AIOXFER_INLINE_BYTES when set, and poll_us), None in
    NIXL's: each aioxfer process measures its own at start-up."""
    if system == "nixl":
        return None
    from aioxfer import _cyx

    return dict(_cyx.calibration())


KPF_THP = 1 << 22


def placement(buf: np.ndarray) -> dict[str, Any]:
    """Where ``buf``'s pages are: its address within a 2 MiB page, and how many
    KiB of its first 64 KiB, 1 MiB and all of it are transparent huge pages
    (with /proc/kpageflags, root only; else the mapping's AnonHugePages)."""
    addr, n = buf.ctypes.data, buf.nbytes
    out: dict[str, Any] = {"mod2m_kib": (addr % (2 << 20)) >> 10}
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            huge = []
            for page in range(addr >> 12, (addr + n + 4095) >> 12):
                pm.seek(page * 8)
                pfn = int.from_bytes(pm.read(8), "little") & ((1 << 55) - 1)
                flags = 0
                if pfn:
                    kf.seek(pfn * 8)
                    flags = int.from_bytes(kf.read(8), "little")
                huge.append(bool(flags & KPF_THP))
        for name, size in (("64k", 64 << 10), ("1m", 1 << 20), ("all", n)):
            out[f"thp_{name}_kib"] = 4 * sum(huge[:(size + 4095) >> 12])
    except OSError:
        total = 0
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                m = line.split(" ", 1)[0].split("-")
                if len(m) == 2 and all(c in "0123456789abcdef" for c in m[0] + m[1]):
                    lo, hi = int(m[0], 16), int(m[1], 16)
                    inside = lo < addr + n and hi > addr
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1])
        out["thp_mapping_kib"] = total
    return out


def target_main(args: argparse.Namespace) -> None:
    """Registers a 16 MiB buffer, sends its metadata and address on the
    control fd, then answers CRC requests from stdin until "exit"."""
    ctl = os.fdopen(args.ctl_fd, "w")
    buf = buffer()
    fill(buf, 3)
    keep: Any = None
    hello: dict[str, Any] = {"addr": buf.ctypes.data, "cal": own_calibration(args.system),
                             "pages": placement(buf)}
    if args.system == "both":
        # One buffer served by both of aioxfer's APIs (--memory same):
        # compat and native then copy into the same pages.
        from aioxfer.nixl import nixl_agent, nixl_agent_config

        compat = nixl_agent("target", nixl_agent_config(enable_prog_thread=True,
                                                        backends=["UCX"]))
        keep = compat.register_memory([(buf.ctypes.data, BUF, 0, "")], "DRAM")
        hello["md"] = compat.get_agent_metadata().hex()
    if args.system in ("native", "both"):
        import aioxfer

        async def serve() -> None:
            kwargs = {"transports": ("tcp",)} if args.transport == "tcp" else {}
            async with aioxfer.Agent("target", **kwargs) as agent:
                agent.register(buf, name="kv")
                ctl.write(json.dumps({**hello, "address": agent.address}) + "\n")
                ctl.flush()
                loop = asyncio.get_running_loop()
                while True:
                    line = await loop.run_in_executor(None, sys.stdin.readline)
                    if not answer(line, buf, ctl):
                        return

        asyncio.run(serve())
        if args.system == "both":
            compat.close()  # (see below)
            sys.stdout.flush()
            os._exit(0)  # as the NIXL-shaped targets
        return
    if args.system == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config
    else:
        from aioxfer.nixl import nixl_agent, nixl_agent_config
    agent = nixl_agent("target", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    keep = agent.register_memory([(buf.ctypes.data, BUF, 0, "")], "DRAM")
    ctl.write(json.dumps({**hello, "md": agent.get_agent_metadata().hex()}) + "\n")
    ctl.flush()
    for line in sys.stdin:
        if not answer(line, buf, ctl):
            break
    del keep
    if args.system != "nixl":
        # os._exit skips the compat agent's close at interpreter exit: its
        # engine never said goodbye and the initiator, still up, logged
        # rail.down + peer.lost for a target that ended cleanly. Closed
        # here (aioxfer.nixl's close; NIXL's agent has none), it is a close.
        agent.close()
    sys.stdout.flush()
    os._exit(0)  # NIXL's wheel may crash in exit-time destructors


def answer(line: str, buf: np.ndarray, ctl: Any) -> bool:
    cmd = json.loads(line) if line.strip() else {"cmd": "exit"}
    if cmd["cmd"] == "exit":
        return False
    if cmd["cmd"] == "crc":
        crc = zlib.crc32(buf[cmd["off"]:cmd["off"] + cmd["len"]])
    else:
        crc = gathered_crc(buf, np.array(cmd["idx"], dtype=np.int64))
    ctl.write(json.dumps({"crc": crc}) + "\n")
    ctl.flush()
    return True


class Target:
    def __init__(self, args: argparse.Namespace) -> None:
        rfd, wfd = os.pipe()
        argv = [sys.executable, os.path.abspath(__file__), "--role", "target", "--system",
                args.system, "--transport", args.transport, "--ctl-fd", str(wfd)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     pass_fds=(wfd,), text=True)
        os.close(wfd)
        self.ctl = os.fdopen(rfd)
        line = self.ctl.readline()
        if not line:
            raise RuntimeError("target failed to start")
        self.hello = json.loads(line)

    def ask(self, **cmd: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return int(json.loads(self.ctl.readline())["crc"])

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)


# ---------------------------------------------------------------- initiators
#
# An initiator prepares every workload (and checks its data once), reports
# them on its control fd, then serves commands from stdin: {"w": i, "secs": s}
# runs workload i for s seconds and answers {"n": requests, "dt": seconds}.
# The driver keeps all three systems' process pairs alive and stopped
# (SIGSTOP), and lets one pair run at a time, so that the systems alternate
# every fraction of a second on the same, shared, CPUs.


class Workload:
    def __init__(self, op: str, label: str, nbytes: int, once: Callable[[], Any],
                 verified: bool) -> None:
        self.op = op
        self.label = label
        self.nbytes = nbytes
        self.once = once
        self.verified = verified


def check(target: Target, buf: np.ndarray, op: str, seed: int, kind: str,
          run: Callable[[], None], *, size: int = 0, li: np.ndarray | None = None,
          ri: np.ndarray | None = None) -> bool:
    """One request with fresh local contents, then both sides' CRCs compared."""
    if op == "WRITE":
        fill(buf, seed)
    else:
        buf[:] = 0
    run()
    if kind == "single":
        return zlib.crc32(buf[:size]) == target.ask(cmd="crc", off=0, len=size)
    assert li is not None and ri is not None
    return gathered_crc(buf, li) == target.ask(cmd="crcs", idx=ri.tolist())


def nixl_like_workloads(args: argparse.Namespace, target: Target, keep: list[Any],
                        buf: np.ndarray | None = None) -> list[Workload]:
    if args.system == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config
    else:
        from aioxfer.nixl import nixl_agent, nixl_agent_config
    agent = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=False,
                                                      backends=["UCX"]))
    if buf is None:
        buf = buffer()
    fill(buf, 5)
    keep += [agent, buf]
    laddr, raddr = buf.ctypes.data, target.hello["addr"]
    agent.register_memory([(laddr, BUF, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(target.hello["md"]))

    def once_of(h: Any) -> Callable[[], None]:
        def once() -> None:
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
            if st != "DONE":
                raise RuntimeError(f"transfer state {st}")
        return once

    def blocks(base: int) -> np.ndarray:
        rows = np.zeros((NBLOCKS, 3), dtype=np.uint64)
        rows[:, 0] = base + np.arange(NBLOCKS, dtype=np.uint64) * BLOCK
        rows[:, 1] = BLOCK
        return rows

    lblocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(laddr), "DRAM")
    rblocks = agent.prep_xfer_dlist(name, blocks(raddr), "DRAM")
    out: list[Workload] = []
    seed = 11
    for op in args.ops:
        for size in SIZES:
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(laddr, size, 0)], "DRAM")
            rh = agent.prep_xfer_dlist(name, [(raddr, size, 0)], "DRAM")
            once = once_of(agent.make_prepped_xfer(op, lh, [0], rh, [0]))
            seed += 1
            ok = check(target, buf, op, seed, "single", once, size=size)
            out.append(Workload(op, size_name(size), size, once, ok))
        li, ri = batch_indices(seed)
        once = once_of(agent.make_prepped_xfer(op, lblocks, li, rblocks, ri))
        seed += 1
        ok = check(target, buf, op, seed, "batch", once, li=li, ri=ri)
        out.append(Workload(op, f"{BATCH} x 16 KiB by index", BATCH * BLOCK, once, ok))
    return out


def native_workloads(args: argparse.Namespace, target: Target, loop: asyncio.AbstractEventLoop,
                     keep: list[Any], buf: np.ndarray | None = None) -> list[Workload]:
    import aioxfer

    kwargs = {"transports": ("tcp",)} if args.transport == "tcp" else {}
    agent = aioxfer.Agent("initiator", **kwargs)
    if buf is None:
        buf = buffer()
    fill(buf, 5)
    keep += [agent, buf]
    region = agent.register(buf, name="kv")
    peer = loop.run_until_complete(agent.connect(target.hello["address"]))
    remote = peer.region("kv")
    out: list[Workload] = []
    seed = 11
    for op in args.ops:
        post = agent.write if op == "WRITE" else agent.read
        pairs: list[tuple[str, int, Any, Any, Any]] = []
        for size in SIZES:
            pairs.append((size_name(size), size, region[0:size], remote[0:size], None))
        li, ri = batch_indices(seed + len(SIZES))
        lens = np.full(BATCH, BLOCK, dtype=np.uint64)
        pairs.append((f"{BATCH} x 16 KiB by index", BATCH * BLOCK,
                      aioxfer.SegmentList(region, li.astype(np.uint64) * BLOCK, lens),
                      aioxfer.SegmentList(remote, ri.astype(np.uint64) * BLOCK, lens), (li, ri)))
        for label, nbytes, local, far, idx in pairs:
            one = functools.partial(post, local, far)
            seed += 1
            def run(one: Callable[[], Any] = one) -> None:
                loop.run_until_complete(_awaited(one))

            if idx is None:
                ok = check(target, buf, op, seed, "single", run, size=nbytes)
            else:
                ok = check(target, buf, op, seed, "batch", run, li=idx[0], ri=idx[1])
            out.append(Workload(op, label, nbytes, one, ok))
    return out


async def _awaited(make: Callable[[], Any]) -> None:
    await make()


def switches(pid: int) -> tuple[int, int]:
    """Context switches of process ``pid``'s live threads: voluntary (it
    slept) and involuntary (another thread took its CPU)."""
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol += int(line.split()[1])
    return vol, invol


def cpu_seconds(pid: int, field: int = 0) -> float:
    """CPU time of process ``pid``'s live threads, to the nanosecond
    (schedstat; /proc/PID/stat counts 10 ms ticks); with ``field=1``, the
    time they waited runnable for a CPU that others held."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[field])
    return total / 1e9


def main_thread_waited() -> float:
    """Seconds this process's main thread (the one posting and waiting, the
    one a turn times) has spent runnable while other threads held the CPUs."""
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _usage(target: int) -> tuple[float, ...]:
    return (cpu_seconds(os.getpid()), cpu_seconds(target), main_thread_waited(),
            *switches(os.getpid()))


def _turn(n: int, dt: float, before: tuple[float, ...], target: int) -> dict[str, Any]:
    """A turn's figures: its requests and seconds; the CPU seconds of this
    process and of the target, the seconds this process's main thread waited
    for a CPU, and this process's voluntary and involuntary context
    switches."""
    after = _usage(target)
    cpu, tcpu, runq, vol, invol = (a - b for a, b in zip(after, before, strict=True))
    return {"n": n, "dt": dt, "cpu": cpu, "tcpu": tcpu, "runq": runq, "vol": vol,
            "invol": invol}


def timed(once: Callable[[], None], secs: float, target: int) -> dict[str, Any]:
    """Runs ``once`` for ``secs``: requests, seconds, and the CPU seconds both
    processes of the pair spent meanwhile (on a shared machine the fairer
    measure of cost: other processes' load stretches wall time, not CPU)."""
    once()  # warm: the first request after a pause
    n = 0
    before = _usage(target)
    t0 = time.perf_counter()
    while True:
        once()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= secs:
            return _turn(n, dt, before, target)


async def atimed(make: Callable[[], Any], secs: float, target: int) -> dict[str, Any]:
    await make()
    n = 0
    before = _usage(target)
    t0 = time.perf_counter()
    while True:
        await make()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= secs:
            return _turn(n, dt, before, target)


def initiator_main(args: argparse.Namespace) -> None:
    ctl = os.fdopen(args.ctl_fd, "w")
    target = Target(args)
    keep: list[Any] = []
    loop = asyncio.new_event_loop() if args.system in ("native", "both") else None
    try:
        # "both" (--memory same): compat's workloads, then native's, between
        # the same two buffers; the driver names native's by index + len/2.
        shared = buffer() if args.system == "both" else None
        nixl_like = [] if args.system == "native" else nixl_like_workloads(args, target, keep,
                                                                           shared)
        works = nixl_like + ([] if loop is None else native_workloads(args, target, loop, keep,
                                                                      shared))
        ctl.write(json.dumps({"target_pid": target.proc.pid,
                              "cal": own_calibration(args.system),
                              "target_cal": target.hello.get("cal"),
                              "pages": placement(next(k for k in keep
                                                      if isinstance(k, np.ndarray))),
                              "target_pages": target.hello.get("pages"),
                              "workloads": [[w.op, w.label, w.nbytes, w.verified]
                                            for w in works]}) + "\n")
        ctl.flush()
        for line in sys.stdin:
            cmd = json.loads(line)
            if "w" not in cmd:
                break
            w = works[cmd["w"]]
            if loop is not None and cmd["w"] >= len(nixl_like):
                turn = loop.run_until_complete(atimed(w.once, cmd["secs"], target.proc.pid))
            else:
                turn = timed(w.once, cmd["secs"], target.proc.pid)
            ctl.write(json.dumps(turn) + "\n")
            ctl.flush()
    finally:
        target.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NIXL's wheel may crash in exit-time destructors


def count_main(args: argparse.Namespace) -> None:
    """``--role count``: one system's workload ``--workload`` (e.g. "READ 4
    KiB"), ``--count`` times in a row after 300 warm-up requests, untimed:
    for an instruction count per request, two runs under callgrind (the
    target is not traced) differenced, e.g. ``--count 1000`` and ``--count
    5000``, with the same environment the driver gives the system."""
    os.environ.update(system_env(args.system, args.transport))
    args.ops = [args.workload.split()[0]]
    label = args.workload.split(None, 1)[1]
    target = Target(args)
    keep: list[Any] = []
    loop = asyncio.new_event_loop() if args.system == "native" else None
    try:
        works = (native_workloads(args, target, loop, keep) if loop is not None
                 else nixl_like_workloads(args, target, keep))
        w = next(w for w in works if w.label == label)
        assert w.verified
        if loop is not None:
            async def go(n: int, make: Callable[[], Any] = w.once) -> None:
                for _ in range(n):
                    await make()

            loop.run_until_complete(go(300))
            t0 = time.perf_counter()
            loop.run_until_complete(go(args.count))
        else:
            def go_sync(n: int, once: Callable[[], Any] = w.once) -> None:
                for _ in range(n):
                    once()

            go_sync(300)
            t0 = time.perf_counter()
            go_sync(args.count)
        # (Wall time, for a quick look; under callgrind, meaningless.)
        print(f"{args.system} {args.workload}: "
              f"{(time.perf_counter() - t0) / args.count * 1e6:.2f} µs per request",
              file=sys.stderr, flush=True)
    finally:
        target.close()
    os._exit(0)


# ---------------------------------------------------------------- driver


def system_env(system: str, transport: str) -> dict[str, str]:
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_MODULES="^ib", NIXL_LOG_LEVEL="WARN",
               AIOXFER_LOG_LEVEL="warning")
    env.pop("UCX_TLS", None)
    env.pop("AIOXFER_NIXL_TRANSPORTS", None)
    if transport == "tcp":
        if system == "nixl":
            env["UCX_TLS"] = "tcp"
        else:
            env["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    return env


class Pair:
    """One system's initiator (and, through it, its target), stopped between turns."""

    def __init__(self, python: str, system: str, transport: str,
                 args: argparse.Namespace, label: str = "") -> None:
        self.system = label or system  # (an A/A run's second pair: "<system>'")
        rfd, wfd = os.pipe()
        argv = [python, os.path.abspath(__file__), "--role", "initiator", "--system", system,
                "--transport", transport, "--ops", ",".join(args.ops), "--ctl-fd", str(wfd)]
        self.proc = subprocess.Popen(argv, env=system_env(system, transport),
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     pass_fds=(wfd,), text=True)
        os.close(wfd)
        self.ctl = os.fdopen(rfd)
        line = self.ctl.readline()
        if not line:
            raise RuntimeError(f"{self.system}/{transport}: the initiator failed to start")
        hello = json.loads(line)
        self.target_pid = int(hello["target_pid"])
        self.cal = hello.get("cal"), hello.get("target_cal")
        self.pages = hello.get("pages"), hello.get("target_pages")
        self.workloads = hello["workloads"]
        self.base = 0  # (view: the index of its first workload)
        self.stop()

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        os.kill(self.target_pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.target_pid, signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGCONT)

    def view(self, system: str) -> Pair:
        """This "both" pair as one of its two systems (--memory same)."""
        half = len(self.workloads) // 2
        v = copy.copy(self)
        v.system = system
        v.base = half if system.rstrip("'") == "native" else 0
        v.workloads = self.workloads[v.base:v.base + half]
        return v

    def run(self, w: int, secs: float) -> dict[str, Any]:
        self.cont()
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"w": self.base + w, "secs": secs}) + "\n")
            self.proc.stdin.flush()
            line = self.ctl.readline()
            if not line:
                raise RuntimeError(f"{self.system}: the initiator died")
            return dict(json.loads(line))
        finally:
            if self.proc.poll() is None:
                self.stop()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cont()
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.target_pid, signal.SIGCONT)


def measure(args: argparse.Namespace, systems: list[str], transport: str, nixl_python: str
            ) -> list[dict[str, Any]]:
    pairs: list[Pair] = []
    records: list[dict[str, Any]] = []
    try:
        both: Pair | None = None
        for label in systems:
            system = label.rstrip("'")
            t0 = time.perf_counter()
            python = nixl_python if system == "nixl" else sys.executable
            try:
                if args.same_memory and label in ("compat", "native"):
                    if both is None:
                        both = Pair(python, "both", transport, args)
                    pairs.append(both.view(label))
                else:
                    pairs.append(Pair(python, system, transport, args, label))
            except (RuntimeError, OSError) as exc:
                print(f"  {label}/{transport}: {exc}", file=sys.stderr)
                continue
            mine, theirs = pairs[-1].cal
            print(f"{label}/{transport}: ready in {time.perf_counter() - t0:.1f} s"
                  + (f"; calibration: initiator {mine}, target {theirs}" if mine else "")
                  + "; pages (initiator, target): " + json.dumps(pairs[-1].pages),
                  file=sys.stderr)
            tpages = pairs[-1].pages[1] or {}
            if tpages.get("thp_all_kib", BUF >> 10) < BUF >> 10 and \
                    os.environ.get("BENCH_PAGES", "huge").split(",")[-1] == "huge":
                print(f"  {label}/{transport}: WARNING: its target's buffer is not all in huge "
                      f"pages (the kernel had none free?): its 64 KiB-16 MiB rows run slower "
                      f"for this pair's life", file=sys.stderr)
        if not pairs:
            return records
        for w, (op, label, nbytes, _) in enumerate(pairs[0].workloads):
            if args.workloads and label not in args.workloads:
                continue
            for rnd in range(args.reps * args.split):
                shift = rnd % len(pairs)
                for pair in pairs[shift:] + pairs[:shift]:
                    turn = pair.run(w, args.slice / args.split)
                    n, dt, cpu, tcpu = turn["n"], turn["dt"], turn["cpu"], turn["tcpu"]
                    records.append({"system": pair.system, "transport": transport, "op": op,
                                    "workload": label, "round": rnd, "gbps": nbytes * n / dt / 1e9,
                                    "cpu_us": (cpu + tcpu) / n * 1e6,
                                    "initiator_cpu_us": cpu / n * 1e6,
                                    "target_cpu_us": tcpu / n * 1e6,
                                    "runq_us": turn["runq"] / n * 1e6,
                                    # the same turn less the time its main
                                    # thread stood runnable on a CPU others
                                    # held: what others' load added to it
                                    "gbps_unwaited": nbytes * n / max(dt - turn["runq"], 1e-9)
                                    / 1e9,
                                    "switches_per_req": [turn["vol"] / n, turn["invol"] / n],
                                    "cal": pair.cal,
                                    "pages": pair.pages, "initiator_pid": pair.proc.pid,
                                    "verified": bool(pair.workloads[w][3])})
            print(f"  {transport} {op} {label}: done", file=sys.stderr)
    finally:
        for pair in pairs:
            pair.close()
    return records


def table(records: list[dict[str, Any]], systems: list[str]) -> str:
    sums: dict[tuple[str, ...], list[float]] = {}
    cpus: dict[tuple[str, ...], list[float]] = {}
    rows: list[tuple[str, str, str]] = []
    bad: set[tuple[str, ...]] = set()
    for r in records:
        key = (r["transport"], r["op"], r["workload"])
        if key not in rows:
            rows.append(key)
        sums.setdefault((*key, r["system"]), []).append(r["gbps"])
        if "cpu_us" in r:
            cpus.setdefault((*key, r["system"]), []).append(r["cpu_us"])
        if not r["verified"]:
            bad.add((*key, r["system"]))
    per: dict[tuple[Any, ...], float] = {(r["round"], r["transport"], r["op"], r["workload"],
                                          r["system"]): r["gbps"] for r in records}
    unwaited: dict[tuple[Any, ...], float] = {
        (r["round"], r["transport"], r["op"], r["workload"], r["system"]): r["gbps_unwaited"]
        for r in records if "gbps_unwaited" in r}
    waits: dict[tuple[str, ...], list[float]] = {}
    for r in records:
        if "runq_us" in r:
            waits.setdefault((r["transport"], r["op"], r["workload"], r["system"]),
                             []).append(r["runq_us"])
    # compat against the others, with the targets; an A/A pair (X and X'):
    # the first against the second, no target, with the spread of its turns.
    comps: list[tuple[str, str, float | None]] = [
        ("compat", o, need) for o, need in (("nixl", 1.0), ("native", 0.9))
        if "compat" in systems and o in systems]
    comps += [(s[:-1], s, None) for s in systems if s.endswith("'") and s[:-1] in systems]
    ratio: dict[tuple[str, ...], list[float]] = {}
    ratio_unwaited: dict[tuple[str, ...], list[float]] = {}
    for into, of in ((ratio, per), (ratio_unwaited, unwaited)):
        for (rnd, tr, op, wl, sysname), v in of.items():
            for me, other, _ in comps:
                o = of.get((rnd, tr, op, wl, other))
                if sysname == me and o:
                    into.setdefault((tr, op, wl, me, other), []).append(v / o)

    def name(o: str) -> str:
        return "NIXL" if o == "nixl" else o

    def verdict(m: float, need: float | None) -> str:
        return "" if need is None else " met" if m >= need else " MISSED"

    head = ["path", "op", "workload"] + [f"{s} GB/s" for s in systems]
    head += [f"{me} ÷ {name(o)}" for me, o, _ in comps]
    head += [f"best turns: {me} ÷ {name(o)}" for me, o, _ in comps]
    head += [f"{me} ÷ {name(o)}, CPU waits excluded" for me, o, _ in comps]
    head += [f"{me} ÷ {o}: turns' ratios, 10th-90th percentile"
             for me, o, need in comps if need is None]
    head += [f"{s} CPU µs/req" for s in systems]
    head += [f"{s} waited µs/req" for s in systems]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tr, op, wl in rows:
        cells = [tr, op, wl]
        for s in systems:
            vals = sums.get((tr, op, wl, s))
            cell = f"{statistics.median(vals):.3f}" if vals else "—"
            if (tr, op, wl, s) in bad:
                cell += " NOT VERIFIED"
            cells.append(cell)
        for me, other, need in comps:
            rs = ratio.get((tr, op, wl, me, other))
            if rs:
                m = statistics.median(rs)
                cells.append(f"{m:.2f}×{verdict(m, need)}")
            else:
                cells.append("—")
        # The best turn of each: what each system does when the machine lets
        # it (a shared, busy machine slows single turns, never speeds them).
        for me, other, need in comps:
            mine, theirs = sums.get((tr, op, wl, me)), sums.get((tr, op, wl, other))
            if mine and theirs:
                m = max(mine) / max(theirs)
                cells.append(f"{m:.2f}×{verdict(m, need)}")
            else:
                cells.append("—")
        # Each turn less the time its main thread waited for a CPU (others'
        # load on this shared machine), the ratios of the same rounds: the
        # code's difference when turns were slowed unevenly.
        for me, other, _ in comps:
            rs = ratio_unwaited.get((tr, op, wl, me, other))
            cells.append(f"{statistics.median(rs):.2f}×" if rs else "—")
        for me, other, need in comps:
            if need is None:
                rs = sorted(ratio.get((tr, op, wl, me, other), []))
                cells.append(f"{rs[len(rs) // 10]:.2f}-{rs[(len(rs) * 9) // 10]:.2f}×"
                             if rs else "—")
        for s in systems:
            vals = cpus.get((tr, op, wl, s))
            cells.append(f"{statistics.median(vals):.0f}" if vals else "—")
        for s in systems:
            vals = waits.get((tr, op, wl, s))
            cells.append(f"{statistics.median(vals):.1f}" if vals else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shared_inline(args: argparse.Namespace, systems: list[str]) -> str:
    """With ``--inline shared``: one calibration for every aioxfer process of
    the run (the driver's: its measured thread wake-up and memcpy rate, given
    to the others through $AIOXFER_WAKE_NS and $AIOXFER_COPY_MBPS, and the
    inline threshold, the largest lone same-host copy an engine makes on the
    posting thread, that follows from them, through $AIOXFER_INLINE_BYTES).
    Each process otherwise measures its own at start-up: the wake-up (before
    the engine measured it on one CPU) was 1.5-4 µs in some processes and
    14-42 µs in others, with it poll_us (each agent's spin bound) 42-124 and
    the inline threshold 2 or 4 MiB, and the memcpy rate moves the threshold
    across a power of two on a busy machine: the rows then compared two
    calibrations, not compat with native."""
    if os.environ.get("AIOXFER_INLINE_BYTES"):
        return f"{os.environ['AIOXFER_INLINE_BYTES']} ($AIOXFER_INLINE_BYTES)"
    if args.inline != "shared" or not {"compat", "native"} & {s.rstrip("'") for s in systems}:
        return ""
    from aioxfer import _cyx

    cal = _cyx.calibration()
    os.environ["AIOXFER_INLINE_BYTES"] = str(cal["inline_bytes"])
    os.environ["AIOXFER_WAKE_NS"] = str(cal["wake_ns"])
    os.environ["AIOXFER_COPY_MBPS"] = str(cal["copy_mbps"])
    return (f"{cal['inline_bytes']} bytes, poll {cal['poll_us']} µs, for every aioxfer "
            f"process (calibrated once: wake-up {cal['wake_ns']} ns, memcpy "
            f"{cal['copy_mbps']} MB/s)")


def driver(args: argparse.Namespace) -> None:
    nixl_python = args.nixl_python or os.path.join(
        os.environ.get("PEERS_VENVS", os.path.expanduser("~/.cache/aioxfer-peers")),
        "venv-nixl", "bin", "python")
    systems = [s for s in SYSTEMS if s in args.only]
    if args.aa:
        if args.aa not in SYSTEMS:
            raise SystemExit(f"--aa: one of {', '.join(SYSTEMS)}")
        if args.aa not in systems:
            systems.append(args.aa)
        systems.append(args.aa + "'")
    if "nixl" in systems and not os.path.exists(nixl_python):
        print(f"no NIXL venv at {nixl_python} (benchmarks/peers/install.sh): skipping nixl",
              file=sys.stderr)
        systems = [s for s in systems if s.rstrip("'") != "nixl"]
    inline = shared_inline(args, systems)
    records: list[dict[str, Any]] = []
    for transport in args.transports:
        records += measure(args, systems, transport, nixl_python)
    print(f"\n{args.reps * args.split} turns of {args.slice / args.split:.3g} s per system and "
          f"point, the systems taking "
          f"turns (the others stopped); GB/s: medians of the turns; ratios: compat's figure "
          f"over the other's in the same round, median; best turns: compat's best turn over "
          f"the other's; CPU µs/req: both processes' CPU time per request (initiator and "
          f"target), median of the turns: what other processes' load does not stretch; "
          f"CPU waits excluded: each turn less the time the initiator's main thread stood "
          f"runnable while others held the CPUs (waited µs/req), the same rounds' ratio. "
          + "Targets: compat ≥ 1× NIXL and ≥ 0.9× native."
          + (f" A/A: {args.aa} and {args.aa}' run the same code (two process pairs): "
             f"their ratios are what noise alone makes of one now.\n" if args.aa else "\n"))
    if inline:
        print(f"aioxfer's inline threshold: {inline}.\n")
    print(f"registered buffers' pages: {os.environ.get('BENCH_PAGES', 'huge')} (--pages)"
          + ("; compat and native: one process pair, the same two buffers (--memory same)"
             if args.same_memory else "") + ".\n")
    print(table(records, systems))
    failed = {(r["system"], r["transport"], r["op"], r["workload"]) for r in records
              if not r["verified"]}
    checked = {(r["system"], r["transport"], r["op"], r["workload"]) for r in records}
    print(f"\ndata checks: {len(checked) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="driver",
                    choices=["driver", "initiator", "target", "count"])
    ap.add_argument("--system", default="compat", choices=[*SYSTEMS, "both"])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--ctl-fd", type=int, default=-1)
    ap.add_argument("--reps", type=int, default=7, help="turns per system and point")
    ap.add_argument("--slice", type=float, default=0.25,
                    help="seconds per system, point and rep (split into --split turns)")
    ap.add_argument("--split", type=int, default=3,
                    help="turns per system, point and rep: the systems alternate this many "
                         "times within a rep, for ratios of turns closer in time")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--only", default=",".join(SYSTEMS))
    ap.add_argument("--memory", default="same", choices=["same", "separate"],
                    help="same (the default): compat and native in one process pair, between "
                         "the same two buffers (NIXL, and an A/A pair, in their own): the "
                         "pages' physical placement, which moves a 1 MiB copy by up to ~10 %% "
                         "from one pair to the next, is then the same for both; separate: a "
                         "pair each")
    ap.add_argument("--workloads", default="",
                    help="time only these workloads (labels, comma-separated: \"4 KiB,1 MiB\"); "
                         "every one is still prepared and checked")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--nixl-python", default="")
    ap.add_argument("--json", default="", help="also write every record to this file")
    ap.add_argument("--workload", default="READ 4 KiB", help="--role count: op and workload")
    ap.add_argument("--count", type=int, default=1000, help="--role count: requests")
    ap.add_argument("--inline", default="shared", choices=["shared", "own"],
                    help="aioxfer's inline threshold: one calibration for every process "
                         "(shared) or each engine's own")
    ap.add_argument("--aa", default="",
                    help="an A/A pair: a second pair of this system (named with a ') taking "
                         "turns with the others, its ratios the first's over the second's: how "
                         "far apart two runs of the same code are on this machine now (with "
                         "--only SYSTEM: an A/A run alone)")
    ap.add_argument("--pages", default="",
                    help="the registered buffers' pages: huge, numpy or small (see buffer()), "
                         "every process's or INITIATOR'S,TARGET'S; default: $BENCH_PAGES, "
                         "else huge")
    args = ap.parse_args()
    global _role
    _role = args.role
    if args.pages:
        os.environ["BENCH_PAGES"] = args.pages  # the children inherit it
    args.ops = args.ops.split(",")
    args.only = args.only.split(",")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.same_memory = args.memory == "same"
    args.transports = args.transports.split(",")
    if args.role == "target":
        target_main(args)
    elif args.role == "initiator":
        initiator_main(args)
    elif args.role == "count":
        count_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()

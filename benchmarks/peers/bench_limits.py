"""This machine's limits, measured the way the systems are measured.

  memcpy  one thread, ctypes.memmove between two 64 MiB buffers, the same sizes at
          the same offsets as the systems; "batch": a plain memmove loop over the
          same 256 scattered 16 KiB pages
  cma     two processes: one process_vm_writev / process_vm_readv per request (what
          UCX, hence NIXL, does same-host); batch: one call with 256 iovecs a side
  iperf3  one TCP stream over 127.0.0.1 (the C reference for TCP), write sizes
          4 KiB, 64 KiB, 1 MiB (iperf3's largest -l); IPERF_SECS per size (default 2)
  tcpfloor  one request at a time over TCP loopback in plain C (tcp_floor.c, built
          here with cc): WRITE = payload then a one-byte answer, READ = one-byte
          request then the payload, over 1 and 2 connections (the payload split in
          halves), receivers asleep in recv or polling it, at 4 KiB, 64 KiB, 1 MiB
          and the batch's 4 MiB (also over 4 connections); the best per size is the
          floor a one-at-a-time tcp row can be held against: iperf3 streams, a
          request/answer protocol cannot

    python bench_limits.py [memcpy,cma,iperf3,tcpfloor]
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

libc = ctypes.CDLL(None, use_errno=True)


def bench_memcpy() -> None:
    src = np.empty(C.BUF_SIZE, dtype=np.uint8)
    dst = np.zeros(C.BUF_SIZE, dtype=np.uint8)
    C.fill_pattern(src, 3)
    sa, da = src.ctypes.data, dst.ctypes.data
    base = dict(peer="limit", transport="memcpy")
    for size in C.SIZES:
        def op(size: int = size) -> None:
            ctypes.memmove(da, sa, size)
        iters, secs = C.timed_loop(op)
        rec = dict(base, op="ctypes.memmove", size=size, iters=iters, secs=secs,
                   gbps=C.gbps(size, iters, secs))
        if size == 4 * C.KiB:
            rec["lat_us_med"], rec["lat_us_p99"] = C.latency_samples(op)
        C.emit(**rec)
    lp, rp = C.batch_pages()
    d = C.BATCH_DESC
    pairs = [(da + int(r) * d, sa + int(s) * d) for s, r in zip(lp, rp, strict=True)]

    def loop() -> None:
        for to, frm in pairs:
            ctypes.memmove(to, frm, d)
    iters, secs = C.timed_loop(loop)
    C.emit(**base, op="ctypes.memmove_batch256x16KiB", size=C.BATCH_BYTES, iters=iters, secs=secs,
           gbps=C.gbps(C.BATCH_BYTES, iters, secs), req_per_s=iters / secs)


class iovec(ctypes.Structure):  # noqa: N801 (the C name)
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def cma_target() -> None:
    ctl = C.child_ctl()
    buf = np.empty(C.BUF_SIZE, dtype=np.uint8)
    buf.fill(1)
    ctl.send((os.getpid(), buf.ctypes.data))
    while (msg := ctl.recv())[0] != "exit":
        C.serve_check(msg, buf, ctl)


def bench_cma() -> None:
    proc, ctl = C.spawn_target([sys.executable, os.path.abspath(__file__), "--cma-target"])
    try:
        pid, raddr = ctl.recv()
        buf = np.empty(C.BUF_SIZE, dtype=np.uint8)
        buf.fill(2)
        laddr = buf.ctypes.data
        base = dict(peer="limit", transport="cma")
        fns = {"WRITE": libc.process_vm_writev, "READ": libc.process_vm_readv}
        for fn in fns.values():
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(iovec), ctypes.c_ulong,
                           ctypes.POINTER(iovec), ctypes.c_ulong, ctypes.c_ulong]

        def call(fn: object, lv: object, rv: object, n: int, total: int) -> None:
            r = fn(pid, lv, n, rv, n, 0)
            if r != total:
                raise OSError(ctypes.get_errno(), f"process_vm_*: {r} of {total} bytes")

        seed = 40
        lp, rp = C.batch_pages()
        for op, fn in fns.items():
            name = "process_vm_writev" if op == "WRITE" else "process_vm_readv"
            for size in C.SIZES:
                lv, rv = iovec(laddr, size), iovec(raddr, size)

                def once(fn: object = fn, lv: iovec = lv, rv: iovec = rv, size: int = size) -> None:
                    call(fn, ctypes.byref(lv), ctypes.byref(rv), 1, size)
                seed += 1
                C.prepare_single(op, ctl, buf, size, seed)
                once()
                ok = C.check_single(op, ctl, buf, size, seed)
                iters, secs = C.timed_loop(once)
                rec = dict(base, op=name, size=size, iters=iters, secs=secs,
                           gbps=C.gbps(size, iters, secs), verified=ok)
                if size == 4 * C.KiB:
                    rec["lat_us_med"], rec["lat_us_p99"] = C.latency_samples(once)
                C.emit(**rec)
            d = C.BATCH_DESC
            lv = (iovec * C.BATCH_N)(*[iovec(laddr + int(p) * d, d) for p in lp])
            rv = (iovec * C.BATCH_N)(*[iovec(raddr + int(p) * d, d) for p in rp])

            def batch(fn: object = fn, lv: object = lv, rv: object = rv) -> None:
                call(fn, lv, rv, C.BATCH_N, C.BATCH_BYTES)
            seed += 1
            C.prepare_batch(op, ctl, buf, seed, lp)
            batch()
            ok = C.check_batch(op, ctl, buf, seed, lp, rp)
            iters, secs = C.timed_loop(batch)
            C.emit(**base, op=f"{name}_batch256x16KiB", size=C.BATCH_BYTES, iters=iters,
                   secs=secs, gbps=C.gbps(C.BATCH_BYTES, iters, secs), req_per_s=iters / secs,
                   verified=ok)
    finally:
        C.stop_target(proc, ctl)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_iperf3() -> None:
    exe = shutil.which("iperf3")
    base = dict(peer="limit", transport="tcp-loopback", op="iperf3")
    secs = os.environ.get("IPERF_SECS", "2")
    for size in (4 * C.KiB, 64 * C.KiB, C.MiB):
        if not exe:
            C.emit(**base, size=size, error="iperf3 is not installed (run install.sh)")
            continue
        port = str(free_port())
        srv = subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", port],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            out = subprocess.run([exe, "-c", "127.0.0.1", "-p", port, "-t", secs, "-l", str(size),
                                  "-J"], capture_output=True, timeout=60)
            try:
                j = json.loads(out.stdout)
                bps = j["end"]["sum_received"]["bits_per_second"]
                C.emit(**base, size=size, secs=float(secs), gbps=bps / 8 / 1e9)
            except (ValueError, KeyError):
                C.emit(**base, size=size, error=(out.stdout or out.stderr).decode()[:200])
        finally:
            try:
                srv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                srv.terminate()
                srv.wait()


def build_tcp_floor() -> str | None:
    """tcp_floor.c compiled into a temporary directory (None: no C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    exe = os.path.join(tempfile.mkdtemp(prefix="aioxfer-tcpfloor-"), "tcp_floor")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_floor.c")
    subprocess.run([cc, "-O2", "-std=c11", "-pthread", "-o", exe, src], check=True)
    return exe


def bench_tcp_floor() -> None:
    exe = build_tcp_floor()
    base = dict(peer="limit", transport="tcp-loopback")
    for op in ("WRITE", "READ"):
        for size in (4 * C.KiB, 64 * C.KiB, C.MiB, C.BATCH_BYTES):
            if exe is None:
                C.emit(**base, op=f"reqack_{op}", size=size, error="no C compiler")
                continue
            best: dict[str, float] | None = None
            # The batch's bytes (4 MiB) are spread over as many connections
            # as aioxfer's default (4) too: the request/answer floor its batch
            # row can be held against beside iperf3's stream.
            shapes = ((1, ""), (2, ""), (1, "poll"), (2, "poll"))
            if size == C.BATCH_BYTES:
                shapes += ((4, ""),)
            for conns, poll in shapes:
                argv = [exe, op, str(size), str(conns), str(C.MIN_SECS), poll]
                out = subprocess.run([a for a in argv if a], capture_output=True, timeout=120,
                                     check=True)
                r = json.loads(out.stdout)
                r["gbps"] = C.gbps(size, r["iters"], r["secs"])
                if best is None or r["gbps"] > best["gbps"]:
                    best = r
            assert best is not None
            C.emit(**base, op=f"reqack_{op}", size=size, iters=best["iters"], secs=best["secs"],
                   gbps=best["gbps"], lat_us_med=best["us_med"], conns=best["conns"],
                   polled=bool(best["poll"]))


def main() -> None:
    if sys.argv[1:] == ["--cma-target"]:
        cma_target()
        return
    which = (sys.argv[1] if len(sys.argv) > 1 else "memcpy,cma,iperf3,tcpfloor").split(",")
    for w in which:
        {"memcpy": bench_memcpy, "cma": bench_cma, "iperf3": bench_iperf3,
         "tcpfloor": bench_tcp_floor}[w]()


if __name__ == "__main__":
    main()

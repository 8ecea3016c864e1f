"""Where the two processes of a tcp request run decides what it costs (tcp17).

A lone 64 KiB WRITE over TCP loopback, one request at a time, with the
initiator's process and the target's process pinned to CPUs I and T: the
plain-C request/answer floor (benchmarks/peers/tcp_floor.c, polled and
blocking receivers) and aioxfer (benchmarks/tcp14_timeline.py's loop, through
Python) in the same placements, interleaved, round after round:

  one   both processes on one CPU (I = T = 0): the payload stays in that CPU's
        caches, the two sides take turns on it (sched_yield, wake-ups)
  two   one CPU each (I = 0, T = 1): the payload's cache lines cross between
        the vCPUs twice a request (the sender's copy into socket buffers the
        receiver read last, the receiver's copy out of them), and a receiver
        asleep in recv is woken on a halted vCPU
  free  not pinned: where the scheduler puts them

Unpinned, the scheduler picks one of these (and keeps it while both sides
poll: neither is woken, so neither is placed again), which is why the
side-by-side rows of this size swing between runs: its GB/s and CPU per GB are
those of the placement it got. Prints per placement the medians over rounds
of GB/s (bytes over wall time: the mean request, as the peers' rows), the
median request (us), and aioxfer's ratio to the polled floor.

    python benchmarks/tcp17_placement.py --rounds 3 [--size 65536] [--python PY]

Run it under /work/benchlock, cwd outside the repository when --python is
another build (e.g. a wheel's venv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
from bench_limits import build_tcp_floor  # type: ignore[import-not-found]  # noqa: E402

PLACEMENTS: dict[str, tuple[int, int] | None] = {"one": (0, 0), "two": (0, 1), "free": None}


def floor_run(exe: str, size: int, secs: float, cpus: tuple[int, int] | None,
              poll: bool) -> dict[str, float]:
    """tcp_floor with its initiator on cpus[0] and its target (the forked child)
    on cpus[1]: both start on the target's; the parent moves once the child
    exists (before its connections are up: the timed loop starts after them)."""
    argv = [exe, "WRITE", str(size), "1", str(secs)] + (["poll"] if poll else [])
    if cpus is None:
        out = subprocess.run(argv, capture_output=True, check=True, timeout=60 + secs).stdout
        r = json.loads(out)
        return {"gbps": size * r["iters"] / r["secs"] / 1e9, "us_med": r["us_med"]}
    ini, tgt = cpus
    p = subprocess.Popen(argv, stdout=subprocess.PIPE,
                         preexec_fn=lambda: os.sched_setaffinity(0, {tgt}))
    kids = f"/proc/{p.pid}/task/{p.pid}/children"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        try:
            with open(kids) as f:
                if f.read().split():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.0002)
    try:
        os.sched_setaffinity(p.pid, {ini})
    except ProcessLookupError:
        pass
    out, _ = p.communicate(timeout=60 + secs)
    r = json.loads(out)
    return {"gbps": size * r["iters"] / r["secs"] / 1e9, "us_med": r["us_med"]}


def aioxfer_run(py: str, size: int, secs: float, cpus: tuple[int, int] | None) -> dict[str, float]:
    pin = ["--cpus", f"{cpus[0]},{cpus[1]}"] if cpus else []
    out = subprocess.run([py, os.path.join(HERE, "tcp14_timeline.py"), "--size", str(size),
                          "--secs", str(secs), *pin],
                         capture_output=True, check=True, timeout=120)
    r = json.loads(out.stdout.decode().splitlines()[0])
    return {"gbps": r["gbps"], "us_med": r["us_med"], "cpu_s_per_gb": r["cpu_s_per_gb"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--secs", type=float, default=1.0)
    ap.add_argument("--python", default=sys.executable, help="the aioxfer build's Python")
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two CPUs")
    exe = build_tcp_floor()
    if exe is None:
        sys.exit("no C compiler for tcp_floor.c")
    res: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(a.rounds):
        for name, cpus in PLACEMENTS.items():
            for what in ("floor polled", "floor blocking", "aioxfer"):
                if what == "aioxfer":
                    r = aioxfer_run(a.python, a.size, a.secs, cpus)
                else:
                    r = floor_run(exe, a.size, a.secs, cpus, what == "floor polled")
                res.setdefault((name, what), []).append(r)
                print(json.dumps(dict(round=rnd, placement=name, what=what, **r)), flush=True)
    print(f"{a.size} B WRITEs one at a time, {a.rounds} rounds, medians over rounds:")
    for name in PLACEMENTS:
        fl = statistics.median(r["gbps"] for r in res[(name, "floor polled")])
        for what in ("floor polled", "floor blocking", "aioxfer"):
            v = res[(name, what)]
            g = statistics.median(r["gbps"] for r in v)
            print(f"  {name:4s}: {what:15s} {g:6.2f} GB/s "
                  f"(median request {statistics.median(r['us_med'] for r in v):6.1f} us, "
                  f"{g / fl:.2f}x the polled floor)")


if __name__ == "__main__":
    main()

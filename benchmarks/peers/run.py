"""The side-by-side run: this machine's limits, NIXL, Mooncake and aioxfer,
interleaved round by round, then one table (summarize.py).

Each round runs the limits first (memcpy, CMA, iperf3), then every system once,
in an order rotated by one each round so that no system always runs first or
last. Records go to results/<timestamp>/run_<round>.jsonl, each system's stderr
to log_<round>_<system>.txt beside them, the table to summary.md.

    python3 benchmarks/peers/run.py --aioxfer-python /path/to/venv/bin/python [--rounds 3]
    python3 benchmarks/peers/run.py --quick --rounds 1        # a smoke run: ~0.1 s per point
    python3 benchmarks/peers/run.py --connect-only --no-limits --rounds 5   # that row only

All traffic stays on 127.0.0.1: UCX_NET_DEVICES=lo, MC_TCP_BIND_ADDRESS=127.0.0.1,
and every agent and socket binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import summarize  # noqa: E402

SYSTEMS = ["nixl", "nixl_tcp", "mooncake", "aioxfer_shm", "aioxfer_tcp"]


def commands(ns: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (argv, extra environment, python that must exist)."""
    nixl = os.path.join(ns.venvs, "venv-nixl", "bin", "python")
    mooncake = os.path.join(ns.venvs, "venv-mooncake", "bin", "python")
    aio = ns.aioxfer_python
    s = lambda name: os.path.join(HERE, name)  # noqa: E731
    return {
        "limits": ([aio, s("bench_limits.py"), "memcpy,cma,iperf3,tcpfloor"], {}, aio),
        "nixl": ([nixl, s("bench_nixl.py"), "--prog-thread", "target"], {}, nixl),
        "nixl_tcp": ([nixl, s("bench_nixl.py"), "--prog-thread", "target"], {"UCX_TLS": "tcp"},
                     nixl),
        "mooncake": ([mooncake, s("bench_mooncake.py")], {}, mooncake),
        "aioxfer_shm": ([aio, s("bench_aioxfer.py"), "--transport", "shm"], {}, aio),
        "aioxfer_tcp": ([aio, s("bench_aioxfer.py"), "--transport", "tcp"], {}, aio),
        # Progress modes beside the default (run.py --modes): columns of their own.
        **{
            f"mode_{m}_{tr}": ([aio, s("bench_aioxfer.py"), "--transport", tr, "--progress", m,
                                "--label", f"aioxfer-{m}"], {}, aio)
            for m in ns.mode_list for tr in ("shm", "tcp")
        },
        # An earlier build (its own venv) through today's workload script: the
        # before/after of a change, in the same run.
        **({
            f"before_{tr}": ([ns.aioxfer_before_python, s("bench_aioxfer.py"), "--transport", tr,
                              "--label", "aioxfer-before"], {}, ns.aioxfer_before_python)
            for tr in ("shm", "tcp")
        } if ns.aioxfer_before_python else {}),
    }


def run_one(name: str, cmd: tuple[list[str], dict[str, str], str], rnd: int, out: str,
            base_env: dict[str, str], timeout: float) -> int:
    argv, extra, python = cmd
    jsonl = os.path.join(out, f"run_{rnd}.jsonl")
    log = os.path.join(out, f"log_{rnd}_{name}.txt")
    print(f"[{time.strftime('%H:%M:%S')}] round {rnd}: {name}", file=sys.stderr, flush=True)
    if not os.access(python, os.X_OK):
        rec = {"peer": name.split("_")[0], "op": "-", "run": str(rnd), "phase": name,
               "error": f"{python} not found (run install.sh / pass --aioxfer-python)"}
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"  !! {name}: {rec['error']}", file=sys.stderr)
        return 1
    env = dict(base_env, BENCH_RUN_ID=str(rnd), BENCH_PHASE=name, **extra)
    t0 = time.monotonic()
    with open(log, "w") as err:
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, env=env, cwd=out,
                               timeout=timeout, text=True)
            stdout, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as exc:  # run() kills the child by its own pid
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            rc = 124
    with open(jsonl, "a") as f:
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                f.write(line[len("RESULT "):] + "\n")
        if rc:
            f.write(json.dumps({"peer": name.split("_")[0], "op": "-", "run": str(rnd),
                                "phase": name, "error": f"exit status {rc}, see {log}"}) + "\n")
    note = f"  !! exit status {rc}, see {log}" if rc else ""
    print(f"  {time.monotonic() - t0:.0f} s{note}", file=sys.stderr, flush=True)
    return rc


def machine() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs {cpu}".strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3; medians over them)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 0.1 s per point, 200 latency samples, 1 s of iperf3")
    ap.add_argument("--min-secs", type=float, help="seconds per point (default 1.0; quick 0.1)")
    ap.add_argument("--aioxfer-python", default=os.environ.get("AIOXFER_PYTHON", sys.executable),
                    help="python of the environment where aioxfer is installed "
                    "(default: $AIOXFER_PYTHON, else this python)")
    ap.add_argument("--aioxfer-before-python",
                    help="python of a venv with an earlier aioxfer: adds systems before_shm and "
                    "before_tcp, shown as a column 'aioxfer before' with aioxfer ÷ it")
    ap.add_argument("--modes", default="",
                    help="progress modes to run besides the default (adaptive), e.g. "
                    "sleep,poll: each adds systems mode_<m>_shm and mode_<m>_tcp, shown as "
                    "columns 'aioxfer <m>'")
    ap.add_argument("--venvs", default=os.environ.get(
        "PEERS_VENVS", os.path.expanduser("~/.cache/aioxfer-peers")),
        help="where install.sh put the peers' venvs (default: $PEERS_VENVS or "
        "~/.cache/aioxfer-peers)")
    ap.add_argument("--only", default=",".join(SYSTEMS),
                    help=f"systems to run (default: all of {','.join(SYSTEMS)})")
    ap.add_argument("--no-limits", action="store_true", help="skip the limits (ratios show –)")
    ap.add_argument("--connect-samples", type=int, default=15,
                    help="fresh initiators timed for connect + first 4 KiB write, the same "
                    "for every system (default 15)")
    ap.add_argument("--connect-only", action="store_true",
                    help="only the connect + first 4 KiB write row (a few seconds a system)")
    ap.add_argument("--out", help="results folder (default: results/<timestamp>)")
    ap.add_argument("--timeout", type=float, help="seconds per system run (default 600; quick 180)")
    ns = ap.parse_args()
    ns.no_limits = ns.no_limits or ns.connect_only
    only = [s for s in ns.only.split(",") if s]
    ns.mode_list = [m for m in ns.modes.split(",") if m and m != "adaptive"]
    bad_modes = set(ns.mode_list) - {"sleep", "poll"}
    if bad_modes:
        ap.error(f"unknown progress modes {sorted(bad_modes)} (adaptive, sleep, poll)")
    extra = [f"mode_{m}_{tr}" for m in ns.mode_list for tr in ("shm", "tcp")
             if f"aioxfer_{tr}" in only]
    if ns.aioxfer_before_python and ns.only == ",".join(SYSTEMS):
        only += ["before_shm", "before_tcp"]
    only += extra
    unknown = set(only) - set(SYSTEMS) - {"before_shm", "before_tcp"} - set(extra)
    if unknown or ns.rounds < 1:
        ap.error(f"unknown systems {sorted(unknown)} (choose from {SYSTEMS})" if unknown
                 else "--rounds must be at least 1")
    out = ns.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    out = os.path.abspath(out)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "MC_", "BENCH_"))}
    env.update(UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n",
               MC_TCP_BIND_ADDRESS="127.0.0.1")
    min_secs = ns.min_secs if ns.min_secs is not None else (0.1 if ns.quick else 1.0)
    env["BENCH_MIN_SECS"] = str(min_secs)
    env["BENCH_CONNECT_SAMPLES"] = str(ns.connect_samples)
    if ns.connect_only:
        env["BENCH_CONNECT_ONLY"] = "1"
    if ns.quick:
        env.update(BENCH_LAT_SAMPLES="200", IPERF_SECS="1")
    timeout = ns.timeout or (180.0 if ns.quick else 600.0)
    if shutil.which("iperf3") is None:
        print("iperf3 is not installed: run install.sh (the tcp limit will be missing)",
              file=sys.stderr)

    mode = f"{'quick, ' if ns.quick else ''}{min_secs:g} s per point"
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        # NIXL's busy-polling threads and every one-at-a-time figure suffer
        # first from a shared CPU: the rows are not comparable then.
        print(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs: other work is "
              "running, figures will be noisy", file=sys.stderr)
    with open(os.path.join(out, "run_0_meta.jsonl"), "w") as f:
        f.write(json.dumps({"peer": "meta", "run": "meta", "when": time.strftime("%Y-%m-%d %H:%M"),
                            "machine": machine(), "mode": mode, "rounds": ns.rounds,
                            "loadavg": round(load, 2),
                            "aioxfer_python": ns.aioxfer_python}) + "\n")
    cmds = commands(ns)
    t0 = time.monotonic()
    failed = 0
    for rnd in range(1, ns.rounds + 1):
        k = (rnd - 1) % len(only)
        order = ([] if ns.no_limits else ["limits"]) + only[k:] + only[:k]
        for name in order:
            failed += run_one(name, cmds[name], rnd, out, env, timeout) != 0
    text = summarize.summarize(out)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"{ns.rounds} round(s) in {time.monotonic() - t0:.0f} s; records, logs and summary.md "
          f"in {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

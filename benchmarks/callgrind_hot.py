"""Instructions per request on the same-host hot paths, under callgrind.

The target agent runs in a child process (not traced); this process connects
over shm and runs ``--count`` requests of one workload after a warm-up. Two
runs differenced give the instructions per request, free of start-up; only
the main thread's are counted (``--separate-threads=yes``, its file ``-01``):
the engine's and the event loop's helper threads wake and spin a varying
number of times per run (counting every thread swung the figure by ~3,500
instructions a request between runs of one build), and the main thread runs
the whole Python/Cython submit -> complete -> await path. Both runs take one
PYTHONHASHSEED: with str hashes randomized per process, the probes of a
string-keyed lookup made per request (the loop's and other dicts) collide or
not by chance, which moved the main thread's figure by up to ~260
instructions a request (qd64-write-4k: unicodekeys_lookup_unicode alone
6-78 per request in three runs):

    for n in 2000 10000; do
        PYTHONHASHSEED=0 valgrind --tool=callgrind --separate-threads=yes \\
            --callgrind-out-file=/tmp/cg.$n \\
            python benchmarks/callgrind_hot.py --workload await-write-4k --count $n
    done
    # (total(/tmp/cg.10000-01) - total(/tmp/cg.2000-01)) / 8000, from callgrind_annotate

``--wrap`` runs it all under callgrind itself and prints that figure, with
PYTHONHASHSEED ``--hashseed`` (0); ``--repeat R``: R such figures, with
seeds hashseed, hashseed + 1, ... (the spread over hash layouts: compare
builds over the same seeds); ``--top K``: also the K
functions whose own instructions per request grew most between the two
runs, i.e. where a request's instructions go; ``--inclusive``: the same
with callees included; ``--keep PREFIX``: keep both main-thread files,
PREFIX.n and PREFIX.5n, for ``callgrind_annotate``). Workloads:
await-{write,read}-{4k,64k} (one request awaited at a time),
qd{64,256}-write-4k (posted, then awaited in order; per request),
compat-{write,read}-4k (aioxfer.nixl, vLLM's shape: one prepared request
reposted, ``transfer`` then ``check_xfer_state`` until DONE, no progress
thread); ``--uvloop``; ``--transport tcp`` (both agents tcp only: a
request's user-space instructions; the initiator's poll for the reply,
``axf_wait_ex``, spins a varying number of rounds, so subtract its
inclusive count).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import aioxfer

BUF = 4 << 20


def agent_kwargs(transport: str) -> dict[str, Any]:
    return {"transports": ("tcp",)} if transport == "tcp" else {}


async def target(transport: str) -> None:
    async with aioxfer.Agent("cg-target", **agent_kwargs(transport)) as agent:
        agent.alloc(BUF, name="buf")
        print(agent.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def initiator(address: str, workload: str, count: int, transport: str) -> None:
    async with aioxfer.Agent("cg-initiator", **agent_kwargs(transport)) as agent:
        local = agent.alloc(BUF, name="buf")
        peer = await agent.connect(address)
        remote = peer.region("buf")
        kind, op, size = workload.split("-")
        n = int(size.rstrip("k")) << 10
        xfer = agent.write if op == "write" else agent.read
        if kind == "await":
            ls, rs = local[0:n], remote[0:n]

            async def go(k: int) -> None:
                for _ in range(k):
                    await xfer(ls, rs)

            await go(500)
            await go(count)
        else:
            qd = int(kind[2:])
            pairs = [(local[i * n:(i + 1) * n], remote[i * n:(i + 1) * n]) for i in range(qd)]

            async def go(k: int) -> None:
                for _ in range(k // qd):
                    for t in [xfer(a, b) for a, b in pairs]:
                        await t

            await go(qd * 8)
            await go(count)


def compat_target(transport: str) -> None:
    """aioxfer.nixl's target: a registered buffer, its metadata on stdout."""
    import numpy as np

    from aioxfer.nixl import nixl_agent, nixl_agent_config

    os.environ.update(compat_env(transport))
    buf = np.zeros(BUF, dtype=np.uint8)
    agent = nixl_agent("cg-target", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    agent.register_memory([(buf.ctypes.data, BUF, 0, "")], "DRAM")
    print(json.dumps({"md": agent.get_agent_metadata().hex(), "addr": buf.ctypes.data}),
          flush=True)
    sys.stdin.read()
    os._exit(0)


def compat_env(transport: str) -> dict[str, str]:
    return {"AIOXFER_NIXL_TRANSPORTS": "tcp"} if transport == "tcp" else {}


def compat_initiator(hello: dict[str, Any], workload: str, count: int, transport: str) -> None:
    import numpy as np

    from aioxfer.nixl import nixl_agent, nixl_agent_config

    os.environ.update(compat_env(transport))
    _, op, size = workload.split("-")
    n = int(size.rstrip("k")) << 10
    buf = np.ones(BUF, dtype=np.uint8)
    agent = nixl_agent("cg-initiator", nixl_agent_config(enable_prog_thread=False,
                                                         backends=["UCX"]))
    agent.register_memory([(buf.ctypes.data, BUF, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(hello["md"]))
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.ctypes.data, n, 0)], "DRAM")
    rh = agent.prep_xfer_dlist(name, [(hello["addr"], n, 0)], "DRAM")
    h = agent.make_prepped_xfer(op.upper(), lh, [0], rh, [0])

    def go(k: int) -> None:
        for _ in range(k):
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
            if st != "DONE":
                raise RuntimeError(f"transfer state {st}")

    go(500)
    go(count)


def total(path: str) -> int:
    out = subprocess.run(["callgrind_annotate", path], capture_output=True, text=True).stdout
    m = re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", out)
    assert m, out[:2000]
    return int(m.group(1).replace(",", ""))


def functions(path: str, inclusive: bool) -> dict[str, int]:
    """Instructions per function (self, or with callees) of a callgrind file."""
    argv = ["callgrind_annotate", "--threshold=100"]
    argv += ["--inclusive=yes"] if inclusive else []
    out = subprocess.run([*argv, path], capture_output=True, text=True).stdout
    per: dict[str, int] = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)$", line)
        if m and "PROGRAM TOTALS" not in line:
            name = re.sub(r" \[.*\]$", "", m.group(2))
            name = re.sub(r"^/tmp/python-build[^ ]*?/Python-[\d.]+/", "", name)
            per[name] = per.get(name, 0) + int(m.group(1).replace(",", ""))
    return per


def per_request(args: argparse.Namespace, seed: int, keep: str = "") -> float:
    """One figure: the main thread's instructions at count and 5 x count,
    differenced, per request (--top: and the functions' figures, printed)."""
    tot: dict[int, int] = {}
    funcs: dict[int, dict[str, int]] = {}
    for n in (args.count, 5 * args.count):
        d = tempfile.mkdtemp(prefix="cg.", dir="/tmp")
        try:
            argv = [sys.executable, os.path.abspath(__file__), "--workload", args.workload,
                    "--count", str(n), "--transport", args.transport]
            argv += ["--uvloop"] if args.uvloop else []
            subprocess.run(["valgrind", "--tool=callgrind", "-q", "--separate-threads=yes",
                            f"--callgrind-out-file={d}/cg.out", *argv], check=True,
                           stdout=subprocess.DEVNULL,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed)))
            main_file = f"{d}/cg.out-01"
            assert os.path.exists(main_file), sorted(glob.glob(f"{d}/*"))
            tot[n] = total(main_file)
            if args.top:
                funcs[n] = functions(main_file, args.inclusive)
            if keep:
                shutil.copy(main_file, f"{keep}.{'n' if n == args.count else '5n'}")
        finally:
            shutil.rmtree(d)
    if args.top:
        big, small = funcs[5 * args.count], funcs[args.count]
        rows = sorted(((big.get(k, 0) - small.get(k, 0)) / (4 * args.count), k)
                      for k in set(big) | set(small))
        for v, k in reversed(rows[-args.top:]):
            print(f"{v:9.1f}  {k[:160]}")
    return (tot[5 * args.count] - tot[args.count]) / (4 * args.count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator",
                    choices=["initiator", "target", "compat-target"])
    ap.add_argument("--workload", default="await-write-4k")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--wrap", action="store_true",
                    help="run twice under callgrind (count, 5 x count): the main thread's "
                         "instructions per request")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--wrap: this many figures (hash seeds hashseed, hashseed + 1, ...)")
    ap.add_argument("--hashseed", type=int, default=0, help="--wrap: PYTHONHASHSEED of the runs")
    ap.add_argument("--top", type=int, default=0,
                    help="--wrap: print the K functions with the most instructions per request")
    ap.add_argument("--inclusive", action="store_true", help="--top: with their callees")
    ap.add_argument("--keep", default="",
                    help="--wrap: keep the main-thread files as KEEP.n and KEEP.5n")
    args = ap.parse_args()
    if args.role == "target":
        asyncio.run(target(args.transport))
        return
    if args.role == "compat-target":
        compat_target(args.transport)
        return
    if args.wrap:
        figs = [per_request(args, args.hashseed + i, f"{args.keep}.{args.hashseed + i}"
                            if args.keep and args.repeat > 1 else args.keep)
                for i in range(args.repeat)]
        label = f"{args.workload}{' uvloop' if args.uvloop else ''} {args.transport}"
        if len(figs) == 1:
            print(f"{label}: {figs[0]:.0f} instructions/request (main thread, "
                  f"hash seed {args.hashseed})")
        else:
            print(f"{label}: median {statistics.median(figs):.0f} instructions/request "
                  f"(main thread), {min(figs):.0f}-{max(figs):.0f} over {len(figs)} hash seeds "
                  f"from {args.hashseed}: "
                  + " ".join(f"{f:.0f}" for f in figs))
        return
    compat = args.workload.startswith("compat-")
    role = "compat-target" if compat else "target"
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role,
                             "--transport", args.transport],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline().strip()
    while compat and line and not line.startswith("{"):  # (a log line before the hello)
        line = proc.stdout.readline().strip()
    try:
        if compat:
            compat_initiator(json.loads(line), args.workload, args.count, args.transport)
            return
        run: Any = initiator(line, args.workload, args.count, args.transport)
        if args.uvloop:
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(run)
        else:
            asyncio.run(run)
    finally:
        proc.stdin.close()
        proc.wait()


if __name__ == "__main__":
    main()

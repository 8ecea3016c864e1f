"""Instructions per request on the same-host hot paths, under callgrind.

The target agent runs in a child process (not traced); this process connects
over shm and runs ``--count`` requests of one workload after a warm-up. Two
runs differenced give the instructions per request, free of start-up:

    for n in 2000 10000; do
        valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n \\
            python benchmarks/callgrind_hot.py --workload await-write-4k --count $n
    done
    # (total(10000) - total(2000)) / 8000, totals from callgrind_annotate

``--wrap`` runs it all under callgrind itself and prints that figure.
Workloads: await-{write,read}-{4k,64k} (one request awaited at a time),
qd{64,256}-write-4k (posted, then awaited in order; per request); ``--uvloop``;
``--transport tcp`` (both agents tcp only: a request's user-space
instructions; the initiator's poll for the reply, ``axf_wait_ex``, spins
a varying number of rounds, so subtract its inclusive count).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
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


def total(path: str) -> int:
    out = subprocess.run(["callgrind_annotate", path], capture_output=True, text=True).stdout
    m = re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", out)
    assert m, out[:2000]
    return int(m.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--workload", default="await-write-4k")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--wrap", action="store_true",
                    help="run twice under callgrind (count, 5 x count): instructions per request")
    args = ap.parse_args()
    if args.role == "target":
        asyncio.run(target(args.transport))
        return
    if args.wrap:
        tot: dict[int, int] = {}
        for n in (args.count, 5 * args.count):
            with tempfile.NamedTemporaryFile(prefix="cg.", dir="/tmp") as f:
                argv = [sys.executable, os.path.abspath(__file__), "--workload", args.workload,
                        "--count", str(n), "--transport", args.transport]
                argv += ["--uvloop"] if args.uvloop else []
                subprocess.run(["valgrind", "--tool=callgrind", "-q",
                                f"--callgrind-out-file={f.name}", *argv], check=True)
                tot[n] = total(f.name)
        per = (tot[5 * args.count] - tot[args.count]) / (4 * args.count)
        print(f"{args.workload}{' uvloop' if args.uvloop else ''} {args.transport}: "
              f"{per:.0f} instructions/request")
        return
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "target",
                             "--transport", args.transport],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    address = proc.stdout.readline().strip()
    try:
        run: Any = initiator(address, args.workload, args.count, args.transport)
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

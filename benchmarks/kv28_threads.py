"""Threads and idle CPU of a KV writer process with a PeerTier (kv28).

A writer store joined to ``--members`` members (each a process of its own),
after one overflowing put (so that its control agent is connected to each
member's and theirs to it): the writer's thread count (/proc/self/task),
and its CPU while idle for ``--idle`` seconds (utime + stime over wall
time), as one JSON line.

``--tcp``: every agent tcp only (as between hosts: on one host the shm path
takes one connection a peer whatever tcp_connections is). A build whose
control agent does not follow its store agent's transports (main before
kv28) is given tcp for it too, by wrapping the constructor the tier calls,
so that both builds' control agents talk tcp::

    cd / && python /path/to/benchmarks/kv28_threads.py --members 3 --tcp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

FORCE_TCP = textwrap.dedent('''
    import aioxfer, aioxfer.kv.peer as kp

    class _Mod:
        """aioxfer, but its Agent made tcp only (for the control agent)."""
        def __getattr__(self, n):
            return getattr(aioxfer, n)

        @staticmethod
        def Agent(name, **kw):
            kw["transports"] = ("tcp",)
            return aioxfer.Agent(name, **kw)

    kp.aioxfer = _Mod()
''')

MEMBER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv
    if sys.argv[2] == "tcp":
        exec(sys.argv[3], {})

    async def main():
        kw = {"transports": ("tcp",)} if sys.argv[2] == "tcp" else {}
        async with aioxfer.Agent(sys.argv[1], **kw) as agent:
            async with kv.Store.open(agent, block_bytes=65536, tiers=[
                    kv.HostTier(64 * 65536), kv.PeerTier(group="kv28t")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


def cpu_seconds() -> float:
    f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def main(args: Any) -> None:
    import aioxfer
    from aioxfer import kv

    mode = "tcp" if args.tcp else "any"
    if args.tcp:
        exec(FORCE_TCP, {})
    procs, addrs = [], []
    try:
        for i in range(args.members):
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-c", MEMBER, f"kv28t-m{i}", mode, FORCE_TCP,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
            assert p.stdout is not None
            procs.append(p)
            addrs.append((await asyncio.wait_for(p.stdout.readline(), 60)).decode().strip())
        kw: dict[str, Any] = {"transports": ("tcp",)} if args.tcp else {}
        async with aioxfer.Agent("kv28t-w", **kw) as agent:
            bb = 65536
            tier = kv.PeerTier(group="kv28t")
            async with kv.Store.open(agent, block_bytes=bb,
                                     tiers=[kv.HostTier(2 * bb), tier]) as st:
                for a in addrs:
                    assert await tier.join(a)
                src = agent.alloc(64 * bb)
                keys = kv.chain(list(range(16 * 64)), block_tokens=16, namespace=b"kv28t")
                put = await st.put(keys, src[0:64 * bb])
                await asyncio.sleep(1.0)  # (the members' acks and connections settle)
                threads = len(os.listdir("/proc/self/task"))
                c0, t0 = cpu_seconds(), time.monotonic()
                await asyncio.sleep(args.idle)
                idle = (cpu_seconds() - c0) / (time.monotonic() - t0)
                print(json.dumps({"members": args.members, "tcp": args.tcp,
                                  "stored": put.stored, "threads": threads,
                                  "idle_cpu_pct": round(100 * idle, 2)}), flush=True)
    finally:
        for p in procs:
            if p.stdin is not None and p.returncode is None:
                p.stdin.write(b"\n")
                await p.stdin.drain()
        for p in procs:
            await p.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--tcp", action="store_true")
    ap.add_argument("--idle", type=float, default=5.0)
    asyncio.run(main(ap.parse_args()))

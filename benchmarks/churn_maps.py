"""Connect/kill churn against one target: does anything stay behind?

A target agent (this process) with a shared pool; a zygote process (aioxfer
imported, no agent, no threads) forks one initiator per cycle, which connects
(same host: a unix socket, a pidfd, the pool's memfd mapped), writes 4 KiB
into the pool, says so, and is SIGKILLed. After every cycle the target must be
back where it started: its RSS, its /proc/self/maps entry count, its engine's
connections and its tag table are sampled after a warm-up and at the end.

    python benchmarks/churn_maps.py --cycles 10000 [--transport shm|tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def maps_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def zygote(transports: tuple[str, ...], rfd: int, wfd: int) -> None:
    """Reads the target's address (a line), then forks an initiator per byte
    read from rfd, which writes "ok PID" or "err PID". Forked before any
    thread or event loop exists in the benchmark, so its forks are clean."""
    import aioxfer

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the killed
    address = b""
    while not address.endswith(b"\n"):
        address += os.read(rfd, 1)

    async def initiator(w: int, address: str) -> None:
        agent = aioxfer.Agent("churn", transports=transports)
        await agent.start()
        peer = await agent.connect(address)
        src = agent.register(bytearray(4096))
        await agent.write(src[0:4096], peer.region("pool")[0:4096])
        os.write(w, f"ok {os.getpid()}\n".encode())
        await asyncio.sleep(3600)  # killed here

    while os.read(rfd, 1):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                asyncio.run(initiator(wfd, address.decode().strip()))
            except BaseException:
                os.write(wfd, f"err {os.getpid()}\n".encode())
            os._exit(1)
    os._exit(0)


async def main(ns: argparse.Namespace, transports: tuple[str, ...], zpid: int,
               to_z_w: int, from_z_r: int) -> None:
    import aioxfer

    agent = aioxfer.Agent("target", transports=transports, peer_timeout=2.0)
    await agent.start()
    agent.alloc(64 << 20, name="pool")
    os.write(to_z_w, agent.address.encode() + b"\n")
    reader = os.fdopen(from_z_r, "rb", buffering=0)
    loop = asyncio.get_running_loop()

    async def line() -> bytes:
        return await loop.run_in_executor(None, reader.readline)

    samples: dict[str, dict[str, int]] = {}
    ok = err = 0
    t0 = time.monotonic()
    for i in range(ns.cycles + ns.warmup):
        if i == ns.warmup:
            await settle(agent)
            samples["start"] = sample(agent)
            t0 = time.monotonic()
        os.write(to_z_w, b"x")
        # One line per initiator, written by itself: "ok PID" or "err PID".
        status, pid_text = (await line()).split()
        pid = int(pid_text)
        ok += status == b"ok"
        err += status != b"ok"
        os.kill(pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    await settle(agent)
    samples["end"] = sample(agent)
    os.close(to_z_w)
    os.kill(zpid, signal.SIGKILL)
    os.waitpid(zpid, 0)
    await agent.aclose()
    print(json.dumps({"transport": ns.transport, "cycles": ns.cycles, "ok": ok, "failed": err,
                      "seconds": round(elapsed, 1), **samples}))


async def settle(agent: object) -> None:
    """Until the engine holds no connection (the kills are noticed), bounded."""
    for _ in range(200):
        if agent.statistics().native_conns == 0:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)


def sample(agent: object) -> dict[str, int]:
    st = agent.statistics()  # type: ignore[attr-defined]
    return {"rss_kib": rss_kib(), "maps": maps_count(), "conns": st.native_conns,
            "tags": len(agent._tags)}  # type: ignore[attr-defined]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    args = ap.parse_args()
    os.environ.setdefault("AIOXFER_LOG_LEVEL", "warning")  # not one line per cycle
    tr = ("shm", "tcp") if args.transport == "shm" else ("tcp",)
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(to_w)
        os.close(from_r)
        zygote(tr, to_r, from_w)
    os.close(to_r)
    os.close(from_w)
    sys.exit(asyncio.run(main(args, tr, child, to_w, from_r)))

"""Reroute throughput over real rails: GB/s before, during and after a rail
failure, and after the rail's recovery.

Two network namespaces joined by two veth pairs (tests/netns.py; needs root
and ``ip netns``): a target agent in namespace a listens on both rails, an
initiator in namespace b streams ``--chunk`` MiB WRITEs into a ``--region``
MiB region, ``--window`` in flight, pass after pass (each pass leaves
different bytes). Phases, each ``--phase`` seconds:

- before:    both rails up
- during:    from the moment rail ``--rail`` fails (link down, or ``--fail
             blackhole``: nft drop rules), detection included
- after:     the next window, one rail only
- recovered: from the moment the recovered rail is reported up again

GB/s is bytes of writes completed in the window over its length, per-rail MiB
the growth of ``peer.statistics().rails[i].bytes`` over it. Detection is the
time from the failure to the initiator's ``rail.down`` event (and to the rail
showing ``up == False`` in the statistics); recovery, from the link's return
to ``rail.up``. The target's memory is verified against what the completed
writes put there at the end. ``--rate 2gbit`` shapes rail ``--shape-rail``
(default 2) with ``tc tbf`` on the initiator's side so the rails differ and
the rate-proportional striping shows in the per-rail bytes.

    sudo python benchmarks/rails_reroute.py [--phase 3] [--fail link|blackhole]
        [--rate 2gbit] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netns  # noqa: E402
from netns import NsAgent  # noqa: E402

MiB = 1 << 20


def rail_of(stats: dict[str, Any], address: str) -> dict[str, Any]:
    return next(r for r in stats["rails"] if r["address"] == address)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chunk, region = args.chunk * MiB, args.region * MiB
    opts = {"transports": ("tcp",), "peer_timeout": args.peer_timeout,
            "keepalive": args.keepalive, "rail_probe": args.rail_probe,
            "tcp_connections": args.conns}
    with netns.rails(2) as net:
        if args.rate:
            net.shape(args.shape_rail, args.rate, side="b")
        listen = [f"{r.addr_a}:7000" for r in net.rails]
        target, init = await asyncio.gather(
            NsAgent.start(net, "a", "target", listen=listen, **opts),
            NsAgent.start(net, "b", "init", listen=f"{net.rail(1).addr_b}:0", **opts),
        )
        try:
            return await _measure(args, net, target, init, chunk, region, listen)
        finally:
            await asyncio.gather(init.close(), target.close(), return_exceptions=True)


async def _measure(args: argparse.Namespace, net: netns.Rails, target: NsAgent,
                   init: NsAgent, chunk: int, region: int, listen: list[str]) -> dict[str, Any]:
    await asyncio.gather(target.call("alloc", "dst", region),
                         init.call("alloc", "src", region + chunk, 7))
    await init.call("connect", target.address, timeout=20)
    addr = listen[args.rail - 1]

    async def stats() -> dict[str, Any]:
        return await init.call("peer_stats", target.address)

    async def wait(pred: Any, seconds: float, what: str) -> float:
        deadline = time.monotonic() + seconds
        while not pred(await stats()):
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} not reached within {seconds} s\n{init.log_tail()}")
            await asyncio.sleep(0.02)
        return time.monotonic()

    marks: dict[str, tuple[float, dict[str, Any]]] = {}

    async def mark(name: str) -> None:
        marks[name] = (time.monotonic(), await stats())

    sid = await init.call("stream_start", target.address, "src", "dst", chunk,
                          region // chunk, args.window, None, True)
    await asyncio.sleep(args.warmup)
    await mark("before")
    await asyncio.sleep(args.phase)
    await mark("fail")
    t_fail = marks["fail"][0]
    if args.fail == "link":
        net.link_down(args.rail)
    else:
        net.blackhole(args.rail)
    t_seen = await wait(lambda st: not rail_of(st, addr)["up"],
                        args.peer_timeout + args.keepalive + 10, "rail reported down")
    await asyncio.sleep(max(0.0, t_fail + args.phase - time.monotonic()))
    await mark("after")
    await asyncio.sleep(args.phase)
    await mark("restore")
    t_restore = marks["restore"][0]
    if args.fail == "link":
        net.link_up(args.rail)
    else:
        net.unblackhole(args.rail)
    t_back = await wait(lambda st: rail_of(st, addr)["up"], args.rail_probe + 15,
                        "rail back up")
    await mark("recovered")
    await asyncio.sleep(args.phase)
    await mark("end")
    rec = await init.call("stream_stop", sid, region, 30.0, timeout=45)
    verified = rec["expected"] is not None and \
        await target.call("digest", "dst") == rec["expected"]
    events = await init.call("events", "rail.down", "rail.up")
    downs = [e["t"] for e in events if e["event"] == "rail.down" and e.get("address") == addr]
    ups = [e["t"] for e in events if e["event"] == "rail.up" and e.get("address") == addr]
    final = await stats()

    comp = rec["completions"]

    def phase(name: str, start: str, stop: str) -> dict[str, Any]:
        t0, s0 = marks[start]
        t1, s1 = marks[stop]
        nbytes = sum(n for t, n in comp if t0 <= t < t1)
        rails = {}
        for a in listen:
            b0, b1 = rail_of(s0, a)["bytes"], rail_of(s1, a)["bytes"]
            rails[a] = (b1 - b0) if b1 >= b0 else None  # None: the counter went back
        return {"phase": name, "seconds": t1 - t0, "bytes": nbytes,
                "gbps": nbytes / (t1 - t0) / 1e9, "rail_bytes": rails,
                "rail_rate": {a: rail_of(s1, a)["rate"] for a in listen},
                "rail_up": {a: rail_of(s1, a)["up"] for a in listen}}

    phases = [phase("before", "before", "fail"), phase("during", "fail", "after"),
              phase("after", "after", "restore"), phase("recovered", "recovered", "end")]
    return {
        "fail": args.fail, "rail": addr, "rate": args.rate,
        "shaped_rail": listen[args.shape_rail - 1] if args.rate else None,
        "chunk": chunk, "region": region, "window": args.window,
        "conns_per_rail": args.conns, "peer_timeout": args.peer_timeout,
        "keepalive": args.keepalive, "rail_probe": args.rail_probe,
        "detect_event_s": (downs[0] - t_fail) if downs else None,
        "detect_stats_s": t_seen - t_fail,
        "recover_event_s": (min(t for t in ups if t > t_restore) - t_restore)
        if any(t > t_restore for t in ups) else None,
        "recover_stats_s": t_back - t_restore,
        "writes_ok": rec["ok"], "writes_posted": rec["posted"], "errors": rec["errors"],
        "hung": rec["hung"], "verified": verified, "reroutes": final["reroutes"],
        "phases": phases,
    }


def table(res: dict[str, Any]) -> str:
    rails = list(res["phases"][0]["rail_bytes"])
    head = f"{'phase':<10} {'s':>5} {'GB/s':>6}  " + "  ".join(
        f"{'MiB ' + a:>20}" for a in rails)
    lines = [head, "-" * len(head)]
    for p in res["phases"]:
        cells = "  ".join(f"{'reset' if v is None else f'{v / MiB:.0f}':>20}"
                          for v in p["rail_bytes"].values())
        lines.append(f"{p['phase']:<10} {p['seconds']:>5.2f} {p['gbps']:>6.3f}  {cells}")

    def s(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f} s"

    lines += [
        f"failed {res['rail']} by {res['fail']}"
        + (f"; {res['shaped_rail']} shaped to {res['rate']}" if res["rate"] else ""),
        f"detection: rail.down {s(res['detect_event_s'])}, stats down {s(res['detect_stats_s'])}"
        f" (peer_timeout {res['peer_timeout']} s, keepalive {res['keepalive']} s)",
        f"recovery:  rail.up {s(res['recover_event_s'])}, stats up {s(res['recover_stats_s'])}"
        f" (rail_probe {res['rail_probe']} s)",
        f"writes: {res['writes_ok']}/{res['writes_posted']} ok, errors {len(res['errors'])}, "
        f"hung {res['hung']}, reroutes {res['reroutes']}, data verified: {res['verified']}",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", type=float, default=3.0, help="seconds per phase")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--fail", choices=("link", "blackhole"), default="link")
    ap.add_argument("--rail", type=int, choices=(1, 2), default=1, help="the rail that fails")
    ap.add_argument("--rate", help="tc tbf rate for --shape-rail, e.g. 2gbit")
    ap.add_argument("--shape-rail", type=int, choices=(1, 2), default=2)
    ap.add_argument("--region", type=int, default=128, help="MiB")
    ap.add_argument("--chunk", type=int, default=4, help="MiB per write")
    ap.add_argument("--window", type=int, default=8, help="writes in flight")
    ap.add_argument("--conns", type=int, default=2, help="tcp connections per rail")
    ap.add_argument("--peer-timeout", type=float, default=1.0)
    ap.add_argument("--keepalive", type=float, default=0.2)
    ap.add_argument("--rail-probe", type=float, default=0.5)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args()
    if args.region % args.chunk or args.window >= args.region // args.chunk:
        ap.error("--region must be a multiple of --chunk, with more chunks than --window")
    reason = netns.unavailable()
    if reason:
        print(f"rails_reroute: cannot run: {reason}", file=sys.stderr)
        raise SystemExit(2)
    res = asyncio.run(run(args))
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print(table(res))
    if res["errors"] or res["hung"] or not res["verified"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

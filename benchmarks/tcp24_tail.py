"""Where a lone tcp WRITE's slow requests come from (tcp24): reads the traces
of benchmarks/tcp14_timeline.py (an AXF_TCP_TRACE build, AXF_TCP_TRACE=DIR,
--stamps FILE) and splits the requests by placement (the posting thread and
the target's receiver of the frame on one CPU or on two) and, within each,
by duration quantile: for each band the medians of the steps (us after the
post: the posting thread's send end, the target's header and whether its
poll caught it, the end of its streamed read, served, the acknowledgement
read, Python's return), then the one-CPU episodes (runs of consecutive
requests sharing a CPU) and what came just before the long ones.

    AXF_TCP_TRACE=/tmp/tr python benchmarks/tcp14_timeline.py --n 8000 --stamps /tmp/tr/st.json
    python benchmarks/tcp24_tail.py /tmp/tr /tmp/tr/st.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tcp14_timeline as tl  # noqa: E402

EV = tl.EV


def requests(d: str, stamps: str) -> list[dict[str, Any]]:
    st: dict[str, Any] = json.load(open(stamps))
    iop, itid, iall = tl.load(d, st["init_pid"])
    top, ttid, _ = tl.load(d, st["target_pid"])
    n = len(st["t0"])
    posts = [x for x in iall if x[4] == EV["POST"]][-n:]
    rows = []
    for i, p in enumerate(posts):
        ns0 = p[0]

        def rel(t: int, ns0: int = ns0) -> float:
            return (t - ns0) / 1e3
        ev = iop[p[1]]
        sends = [x for x in ev if x[4] == EV["SEND_E"]]
        r: dict[str, Any] = dict(dur=(st["t1"][i] - st["t0"][i]) / 1e3, pcpu=p[6],
                                 nsend=sum(x[4] == EV["SEND_B"] for x in ev),
                                 send_e=rel(sends[-1][0]) if sends else None,
                                 t1=rel(st["t1"][i]), t_ms=(ns0 - posts[0][0]) / 1e6)
        hdr = next((e for e in top.get(p[1], []) if e[4] == EV["RX_HDR"]), None)
        if hdr:
            r.update(hdr=rel(hdr[0]), tcpu=hdr[6], polled=hdr[2] >> 16 & 1)
            done = next((x for x in ttid[hdr[3]] if x[4] == EV["RX_DONE"] and x[0] >= hdr[0]),
                        None)
            if done:
                r["served"] = rel(done[0])
                se = [x for x in ttid[hdr[3]] if hdr[0] <= x[0] <= done[0]
                      and x[4] == EV["STREAM_E"]]
                if se:  # the payload polled for as it came; a = iovecs left for a blocking read
                    r["stream_e"], r["stream_left"] = rel(se[0][0]), se[0][2] > 0
        acks = [x for x in ev if x[4] in (EV["RX_HDR"], EV["HELP"])]
        if acks:
            r["ack"], r["help"] = rel(acks[0][0]), acks[0][4] == EV["HELP"]
        rows.append(r)
    return rows


def med(sub: list[dict[str, Any]], k: str) -> float:
    v = [r[k] for r in sub if r.get(k) is not None]
    return statistics.median(v) if v else float("nan")


def mean(sub: list[dict[str, Any]], k: str) -> float:
    v = [float(r[k]) for r in sub if r.get(k) is not None]
    return statistics.fmean(v) if v else float("nan")


def main() -> None:
    rows = requests(sys.argv[1], sys.argv[2])
    groups = {"two CPUs": [r for r in rows if "tcpu" in r and r["tcpu"] != r["pcpu"]],
              "one CPU": [r for r in rows if "tcpu" in r and r["tcpu"] == r["pcpu"]]}
    for name, grp in groups.items():
        if not grp:
            continue
        ds = sorted(r["dur"] for r in grp)

        def q(f: float, ds: list[float] = ds) -> float:
            return ds[min(len(ds) - 1, int(f * len(ds)))]
        print(f"{name}: {len(grp)} requests, p10 {q(.1):.1f} p50 {q(.5):.1f} p90 {q(.9):.1f} "
              f"p99 {q(.99):.1f} mean {statistics.fmean(ds):.1f} us")
        for lo, hi in ((0, .5), (.5, .75), (.75, .9), (.9, .99), (.99, 1.0)):
            sub = [r for r in grp if q(lo) <= r["dur"] and (hi == 1.0 or r["dur"] < q(hi))]
            if sub:
                print(f"  p{lo * 100:g}-{hi * 100:g} n={len(sub)} dur {med(sub, 'dur'):.1f}"
                      f" send_e {med(sub, 'send_e'):.1f} hdr {med(sub, 'hdr'):.1f}"
                      f" polled {mean(sub, 'polled'):.2f} stream_e {med(sub, 'stream_e'):.1f}"
                      f" blocked {mean(sub, 'stream_left'):.2f} served {med(sub, 'served'):.1f}"
                      f" ack {med(sub, 'ack'):.1f} t1 {med(sub, 't1'):.1f}"
                      f" help {mean(sub, 'help'):.2f} sends {mean(sub, 'nsend'):.2f}")
    runs: list[tuple[bool, int, int]] = []  # (one CPU, first request, length)
    for i, r in enumerate(rows):
        one = r.get("tcpu") == r["pcpu"]
        if runs and runs[-1][0] == one:
            runs[-1] = (one, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((one, i, 1))
    eps = [x for x in runs if x[0]]
    longest = sorted((x[2] for x in eps), reverse=True)[:10]
    print(f"one-CPU episodes: {len(eps)}, longest: {longest}")
    for _, i, k in eps:
        if k >= 20:
            before = " ".join(f"{r['dur']:.0f}us/hdr {r.get('hdr', 0):.0f}/polled {r.get('polled')}"
                              for r in rows[max(0, i - 3):i])
            print(f"  at request {i} ({rows[i]['t_ms']:.0f} ms), {k} requests; the 3 before: "
                  f"{before}")


if __name__ == "__main__":
    main()

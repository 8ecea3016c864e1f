"""Where a fresh tcp connection's first writes go, from the engine's traces (nat34).

Reads the per-process trace files that a native build made with
``-Dc_args=-DAXF_TCP_TRACE`` writes under ``$AXF_TCP_TRACE`` (native/src/
internal.h TR_*, CLOCK_MONOTONIC: one clock for both processes) during a
``benchmarks/connect_phases.py --transport tcp`` run with ``PHASE_WRITES=3``
and ``PHASE_WARM=1`` (the warm-up connect in each initiator process opens its
trace file, so that the timed connect's first write does not pay for it), and
prints, per write of the timed connect (its 1st, 2nd, 3rd), the medians over
the samples of: post -> the initiator's inline send done; send -> the target's
receiver has the header; the target's serve + acknowledgement; post -> the
completion pushed; and how many spins expired, how many acknowledgements the
spinning thread read (HELP), and how often the target's receiver was polling.

    AXF_TCP_TRACE=/tmp/tr PHASE_WARM=1 PHASE_WRITES=3 python \\
        benchmarks/connect_phases.py --transport tcp -n 8 --python /tmp/vtrace/bin/python
    python benchmarks/nat34_first_write.py /tmp/tr

The target is the process with the most events (it serves every sample).

Measured (2026-12-07, 2-vCPU AMD EPYC VM, main 17402908 + nat34, n=8):
write 1: send 38.9, target header 23.1, serve + ack 21.7, completion 86.6 us;
write 2: 29.3, 16.6, 10.9, 59.9; write 3 (the target polling): 11.3, 2.2,
10.7, 22.8. connect_phases' I.write for the same run: 0.14 / 0.08 / 0.04 ms.
"""

from __future__ import annotations

import argparse
import glob
import statistics

import numpy as np

REC = np.dtype([("ns", "<u8"), ("op", "<u8"), ("a", "<u8"), ("tid", "<u4"), ("ev", "u1"),
                ("cpu", "u1"), ("fd", "<i2")])
EV = {n: i + 1 for i, n in enumerate(
    "POST SEND_B SEND_E TX_WAKE RX_HDR RX_DONE UNIT_B UNIT_E HELP PARK_B PARK_E RX_BLOCK "
    "STREAM_B STREAM_E WAIT_B WAIT_E CQ_PUSH SPIN_B SPIN_E SIG_B SIG_E".split())}


def _load(d: str) -> dict[int, np.ndarray]:
    out = {}
    for f in glob.glob(f"{d}/trace.*"):
        r = np.fromfile(f, dtype=REC)
        out[int(f.rsplit(".", 1)[1])] = r[r["ns"] != 0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the $AXF_TCP_TRACE directory of one connect_phases run")
    ap.add_argument("--skip", type=int, default=1,
                    help="posts of the warm-up connects before the timed one (PHASE_WARM)")
    args = ap.parse_args()
    recs = _load(args.dir)
    target = max(recs, key=lambda p: len(recs[p]))
    t = recs[target]
    res: dict[int, list[dict[str, float]]] = {1: [], 2: [], 3: []}
    for pid, i in recs.items():
        if pid == target:
            continue
        posts = i[i["ev"] == EV["POST"]]
        if len(posts) < args.skip + 3:
            continue
        me = posts["tid"][args.skip]
        for k in (1, 2, 3):
            w = args.skip + k - 1
            p = int(posts["ns"][w])
            nxt = int(posts["ns"][w + 1]) if w + 1 < len(posts) else p + 10**7
            win = i[(i["ns"] >= p) & (i["ns"] < nxt)]
            tw = t[(t["ns"] >= p) & (t["ns"] < nxt)]
            sent = win[(win["ev"] == EV["SEND_E"]) & (win["tid"] == me)]
            hdr = tw[tw["ev"] == EV["RX_HDR"]]
            done = tw[tw["ev"] == EV["RX_DONE"]]
            push = win[win["ev"] == EV["CQ_PUSH"]]
            if not len(sent) or not len(hdr) or not len(done) or not len(push):
                continue
            res[k].append({
                "send": (int(sent["ns"][0]) - p) / 1e3,
                "hdr": (int(hdr["ns"][0]) - int(sent["ns"][0])) / 1e3,
                "serve": (int(done["ns"][0]) - int(hdr["ns"][0])) / 1e3,
                "done": (int(push["ns"][0]) - p) / 1e3,
                "expired": float(len(win[(win["ev"] == EV["WAIT_E"]) & (win["a"] == 0)])),
                "helped": float(len(win[win["ev"] == EV["HELP"]]) > 0),
                "polled": float(len(tw[(tw["ev"] == EV["SPIN_E"]) & (tw["a"] == 1)]) > 0),
            })
    for k, rows in res.items():
        if not rows:
            print(f"write{k}: no complete sample")
            continue

        def med(f: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[f] for r in rows)

        def total(f: str, rows: list[dict[str, float]] = rows) -> int:
            return int(sum(r[f] for r in rows))

        print(f"write{k} n={len(rows)}: post->sent {med('send'):.1f}, sent->target header "
              f"{med('hdr'):.1f}, target serve+ack {med('serve'):.1f}, post->completion "
              f"{med('done'):.1f} us; spins expired {total('expired')}, "
              f"read by the spinner {total('helped')}, target polling {total('polled')}")


if __name__ == "__main__":
    main()

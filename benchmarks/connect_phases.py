"""Where connect + first 4 KiB write goes: a phase timeline, both processes.

One target agent per build (64 MiB agent.alloc region, as bench_aioxfer.py),
then fresh initiator processes, one per sample, each: Agent, 64 MiB region
filled, then ``connect`` + one 4 KiB write timed (the "connect + first 4 KiB
write" row). Both processes wrap the connect path's steps (dial, handshake,
metadata, unix socket, imports i.e. the populate, the engine taking
connections, the other connections, the write) and stamp them with
CLOCK_MONOTONIC, so the target's steps land on the initiator's timeline.

    python benchmarks/connect_phases.py --transport tcp -n 15
    python benchmarks/connect_phases.py --transport shm -n 15 \
        --python /tmp/before/bin/python --python .venv/bin/python   # A/B, interleaved

Prints per build: the total's median, then each step's median start and
duration (ms from the initiator's connect call), over the samples; --dump
also one sample's raw timeline. PHASE_TCP_CONNS=n in the environment: the
initiator's tcp_connections (a what-if: how much the other connections cost);
PHASE_INIT_ALL=1: the initiator has every transport (with --transport tcp:
it probes first, as an agent with a unix socket does, then takes tcp);
PHASE_RAILS=n: the target listens on 127.0.0.1..n (n tcp rails);
PHASE_WRITES=n: n writes, the later ones timed too (I.write2...);
PHASE_IDLE_MS=ms: an idle pause before each write (threads long started);
PHASE_POOL_MIB=n: the target's region is n MiB, not 64 (a what-if: with a
small one the shm row is the handshake without the pool's populate);
PHASE_PROFILE=path: cProfile of the initiator's timed window, to path.<pid>.
I.predial / I.hello_now (builds since cxc32): the first connection dialled
and its Hello sent by Agent.connect itself, before the attempt's task runs
(I.Connector.connect then starts after them; I.dial is no longer a step).
T.early_now (builds since ep33): the accepting step's try of a same-host
Hello's early proof (taken: Challenge, proved Accept and metadata sent in
that step, no Proof round; else nothing read, and the greeting follows).
PHASE_TARGET_NOSPIN=1: the target never polls for a handshake's next frame
(a what-if: cxs32's accepting-step answer without its poll).
PHASE_WARM=n: n connects + first writes of other agents in the initiator's
process before the timed one (closed first): its code warm, as run.py's
samples after its first (a fresh process per sample is the cold case).
M.<name> steps: a build with temporary probes (a list aioxfer.log.MARKS
of (name, monotonic ns) appended to at points of the path) shows each as a
step from the previous probe (or the clock's start) to it; the target's
probes as T.M.<name>, each an instant (its start; duration 0).
PHASE_BACK2BACK=n: run.py's connect samples' pattern (bench_aioxfer
connect_samples): n agents of the initiator's process before the timed one,
each its region filled, connect + first write, closed, one after another,
and no gc.collect() before the clock; the steps of both processes kept from
PHASE_BEFORE_MS (50 here, else 1) before it: what the target still did for
the previous peers (its loss, close, timers, a collection) when the timed
Hello came (T.* steps at negative starts).
PHASE_GC_KEEP=1: no gc.collect() before the clock (see _initiator). The
collector's passes show as steps (I.gc0, T.gc1, ... by generation).
I.cpu_process / I.cpu_loop_thread: the initiator's CPU time (rusage) over
the connect + first write, its whole process and its loop's thread (shown
as a step's duration; _sys: its kernel part).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

EVENTS: list[tuple[str, int, int]] = []


def _stamp(name: str, t0: int) -> None:
    EVENTS.append((name, t0, time.monotonic_ns()))


def _wrap_async(obj: Any, attr: str, name: str) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    async def w(*a: Any, **k: Any) -> Any:
        t0 = time.monotonic_ns()
        try:
            return await fn(*a, **k)
        finally:
            _stamp(name, t0)

    setattr(obj, attr, w)


def _wrap_sync(obj: Any, attr: str, name: str) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def w(*a: Any, **k: Any) -> Any:
        t0 = time.monotonic_ns()
        try:
            return fn(*a, **k)
        finally:
            _stamp(name, t0)

    setattr(obj, attr, w)


class _EngineProxy:
    """The engine with some methods timed (a Cython type's methods cannot be patched)."""

    def __init__(self, eng: Any, prefix: str) -> None:
        self._eng = eng
        for m in ("endpoint_import", "endpoint_add_conn", "endpoint_create", "accept_conn"):
            if hasattr(eng, m):
                fn = getattr(eng, m)

                def w(*a: Any, _fn: Any = fn, _m: str = m, **k: Any) -> Any:
                    t0 = time.monotonic_ns()
                    try:
                        return _fn(*a, **k)
                    finally:
                        _stamp(prefix + _m, t0)

                setattr(self, m, w)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._eng, name)


def _patch_select(prefix: str) -> None:
    """PHASE_SELECT=1: the loop's waits in its selector (idle) as steps."""
    if not os.environ.get("PHASE_SELECT"):
        return
    sel = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    _wrap_sync(sel, "select", prefix + "idle")


def _patch_gc(prefix: str) -> None:
    """The garbage collector's passes as steps (gc0, gc1, gc2 by generation):
    a pass that lands in the timed window moves it by its length."""
    began: list[int] = []

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began.append(time.monotonic_ns())
        elif began:
            EVENTS.append((f"{prefix}gc{info['generation']}", began.pop(), time.monotonic_ns()))

    gc.callbacks.append(cb)


def _patch(prefix: str) -> None:
    _patch_gc(prefix)
    import aioxfer.connector as conn
    import aioxfer.protocol as protocol

    if os.environ.get("PHASE_DETAIL"):  # finer steps (recv_exact: each read of a frame)
        import aioxfer.members as members
        import aioxfer.peertable as peertable

        _wrap_async(protocol, "recv_exact", prefix + "recv_exact")
        _wrap_sync(peertable.PeerTable, "add", prefix + "peers_add")
        _wrap_sync(members.Members, "emit", prefix + "members_emit")
        _wrap_sync(conn._LocalLink, "close", prefix + "local_close")
        _wrap_async(conn._EarlyConns, "close", prefix + "early_close")
        import aioxfer.serving as serving_

        # The target's side, finer (cxs32): the accept step, each frame.
        _wrap_sync(serving_.Server, "_greet_now", prefix + "greet_now")
        _wrap_sync(serving_.Server, "_hand_over", prefix + "hand_over")
        if hasattr(serving_.Server, "_answer_now"):  # (cxs32's builds)
            _wrap_sync(serving_.Server, "_answer_now", prefix + "answer_now")
            _wrap_sync(serving_, "server_answer_now", prefix + "server_answer_now")
            _wrap_sync(serving_.Server, "_send_now", prefix + "send_now")
            _wrap_sync(serving_.Server, "_out", prefix + "out")
            _wrap_sync(serving_.Server, "_spin_ns", prefix + "spin_ns")
            peek = protocol._peek_handshake

            def peek_w(*a: Any) -> Any:
                t0 = time.monotonic_ns()
                got = peek(*a)
                _stamp(prefix + ("peek_whole" if isinstance(got, tuple) else "peek"), t0)
                return got

            protocol._peek_handshake = peek_w
        _wrap_async(protocol, "recv_frame", prefix + "recv_frame")
        _wrap_async(protocol, "send_frame", prefix + "send_frame")
        import aioxfer.dialing as dialing_

        # ep33's builds (early proofs), split: the target's early step (the
        # Hello peeked, its proof taken, our answer made: Challenge + proved
        # Accept + metadata; then _finish_now: sent, pidfd, the engine's
        # accept), and the client's Hello made ahead stamped as it is sent
        # (with_early_frame: the peer's address, the frame decoded, the
        # proof, encoded again). Each where the build has it.
        for mod, attr, step in (
            (serving_, "server_early_now", "server_early_now"),
            (protocol, "_peeked", "peeked"),
            (protocol.EarlyProofs if hasattr(protocol, "EarlyProofs") else None, "take",
             "early_take"),
            (protocol, "_answer", "answer_accept"),
            (serving_.Server, "_finish_now", "finish_now"),
            (serving_, "peer_pidfd", "peer_pidfd"),
            (dialing_, "with_early_frame", "with_early_frame"),
            (dialing_, "with_early_hello", "with_early_hello"),
            (protocol, "_early_target", "early_target"),
            (protocol, "_stamped", "stamped"),
            (protocol, "_early_mac", "early_mac"),
            # ep34's: the proof finished from its HMAC begun ahead; the
            # accepting step's poll for a unix client's Hello (ep34's
            # hello_waits_now, since tgt35 hello_peek_now: its peek handed on;
            # the step keeps its name)
            (protocol, "_early_finish", "early_finish"),
            (serving_, "hello_waits_now", "hello_waits_now"),
            (serving_, "hello_peek_now", "hello_waits_now"),
            (dialing_, "send_now", "hello_send_now"),
        ):
            if mod is not None and hasattr(mod, attr):
                _wrap_sync(mod, attr, prefix + step)
        spin = protocol._spin_recv_into

        def spin_w(loop: Any, sock: Any, view: Any, bound_ns: int) -> int:
            t0 = time.monotonic_ns()
            ready = getattr(loop, "_ready", None)
            busy = bool(ready)
            k = spin(loop, sock, view, bound_ns)
            _stamp(prefix + ("spin_skipped" if busy else "spin_got" if k >= 0 else "spin_none"),
                   t0)
            return k

        protocol._spin_recv_into = spin_w
    import aioxfer.dialing as dialing
    import aioxfer.serving as serving

    for mod in (dialing, conn, serving):
        for f in ("client_handshake", "server_handshake"):
            if hasattr(mod, f):
                _wrap_async(mod, f, prefix + f)
    for m in ("dial", "dial_local", "receive_meta", "fetch_meta", "fetch_local_meta"):
        _wrap_async(dialing.Dialer, m, prefix + m)
    if hasattr(conn.Connector, "predial"):  # (builds since cxc32: dialled in Agent.connect)
        _wrap_sync(conn.Connector, "predial", prefix + "predial")
        _wrap_sync(dialing.Dialer, "hello_now", prefix + "hello_now")
    _wrap_async(conn.Connector, "_open_local", prefix + "open_local")
    _wrap_async(conn.Connector, "_open_direct", prefix + "open_direct")
    _wrap_async(conn.Connector, "connect", prefix + "Connector.connect")
    _wrap_async(dialing.Dialer, "open_meta", prefix + "open_meta")
    _wrap_sync(conn.Connector, "_apply_regions", prefix + "apply_regions")
    _wrap_async(serving.Server, "_send_meta", prefix + "send_meta")
    _wrap_sync(serving.Server, "_join_now", prefix + "join_now")  # the accepting step's part
    if hasattr(serving.Server, "_early_now"):  # (builds since ep33: same-host early proofs)
        _wrap_sync(serving.Server, "_early_now", prefix + "early_now")
    _wrap_async(serving.Server, "_serve", prefix + "serve")
    init = serving.Server.__init__

    def sinit(self: Any, *a: Any, **k: Any) -> None:
        k["engine"] = _EngineProxy(k["engine"], prefix)
        if os.environ.get("PHASE_TARGET_NOSPIN"):  # what-if (cxs32): the target never polls
            k["spin"] = False
        init(self, *a, **k)

    serving.Server.__init__ = sinit  # type: ignore[method-assign]


def _agent_kw(transport: str, initiator: bool = False) -> dict[str, Any]:
    kw: dict[str, Any] = {"transports": ("tcp",)} if transport == "tcp" else {}
    if initiator and os.environ.get("PHASE_INIT_ALL"):  # a default initiator: probes first
        kw = {}
    if initiator and os.environ.get("PHASE_TCP_CONNS"):  # what-if: fewer connections
        kw["tcp_connections"] = int(os.environ["PHASE_TCP_CONNS"])
    if not initiator and os.environ.get("PHASE_RAILS"):  # the target listens on n loopbacks
        kw["listen"] = [f"127.0.0.{i + 1}:0" for i in range(int(os.environ["PHASE_RAILS"]))]
    return kw


async def _target(transport: str) -> None:
    import aioxfer
    import aioxfer.log

    _patch("T.")
    _patch_select("T.")
    async with aioxfer.Agent("phase-target", **_agent_kw(transport)) as agent:
        pool = int(os.environ.get("PHASE_POOL_MIB", "64")) << 20
        agent.alloc(pool, name="buf").numpy().fill(1)
        print(json.dumps({"address": agent.address}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "exit":
                return
            marks = getattr(aioxfer.log, "MARKS", None)
            if marks:  # a probe build's marks in the target: each an instant, T.M.<name>
                EVENTS.extend(("T.M." + name, t, t) for name, t in marks)
                marks.clear()
            print(json.dumps({"events": EVENTS}), flush=True)
            EVENTS.clear()


async def _initiator(transport: str, address: str) -> None:
    import aioxfer
    import aioxfer.log

    _patch("I.")
    _patch_select("I.")
    b2b = int(os.environ.get("PHASE_BACK2BACK", "0"))
    for i in range(b2b):
        # run.py's pattern (bench_aioxfer.connect_samples): agents one after
        # another in this process, each region filled, connect + 4 KiB
        # write, closed; nothing collected in between (see the docstring).
        async with aioxfer.Agent(f"phase-b2b-{i}", **_agent_kw(transport, True)) as prev:
            pl = prev.alloc(64 << 20, name="buf")
            pl.numpy().fill(2)
            pp = await prev.connect(address)
            await prev.write(pl[0:4096], pp.region("buf")[0:4096])
        EVENTS.clear()
    for i in range(int(os.environ.get("PHASE_WARM", "0"))):
        # As run.py's samples after its first: this process has connected
        # before (another agent of it, closed), so its code, caches and
        # imports are warm; the clock is on a fresh agent's first connect.
        async with aioxfer.Agent(f"phase-warm-{i}", **_agent_kw(transport, True)) as warm:
            wl = warm.alloc(64 << 20, name="buf")
            wp = await warm.connect(address)
            await warm.write(wl[0:4096], wp.region("buf")[0:4096])
        EVENTS.clear()
    async with aioxfer.Agent("phase-init", **_agent_kw(transport, True)) as agent:
        cn = agent._connector
        cn._engine = _EngineProxy(agent._engine, "I.")  # type: ignore[assignment]
        rails = agent._rails
        _wrap_async(type(rails), "dial", "I.rails_dial")
        rails._add_conn = _EngineProxy(agent._engine, "I.").endpoint_add_conn
        local = agent.alloc(64 << 20, name="buf")
        local.numpy().fill(2)
        # Every build from the same collector state: in a fresh process the
        # allocations since start (which differ by build: a class more at
        # import) decide whether a young-generation pass (~0.06-0.2 ms here)
        # lands inside the connect; conn15's 0.15-0.2 ms over conn14 was one
        # (the gc0 step at 0.27 ms, in every sample). The connect and its
        # write allocate ~100 tracked objects net, far from a pass then.
        # PHASE_GC_KEEP=1: as before (no collection first).
        if not os.environ.get("PHASE_GC_KEEP") and not b2b:
            gc.collect()
        marks = getattr(aioxfer.log, "MARKS", None)
        if marks is not None:
            marks.clear()
        prof = None
        if os.environ.get("PHASE_PROFILE"):  # cProfile of the timed window (appended stats)
            import cProfile

            prof = cProfile.Profile()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        m0 = resource.getrusage(resource.RUSAGE_THREAD)
        if prof is not None:
            prof.enable()
        t0 = time.monotonic_ns()
        peer = await agent.connect(address)
        t1 = time.monotonic_ns()
        idle = float(os.environ.get("PHASE_IDLE_MS", "0"))
        if idle:  # what-if: the connections' threads long started and idle
            await asyncio.sleep(idle / 1000)
            t1 = time.monotonic_ns()
        xfer = agent.write(local[0:4096], peer.region("buf")[0:4096])
        tp = time.monotonic_ns()
        res = await xfer
        t2 = time.monotonic_ns()
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["PHASE_PROFILE"] + f".{os.getpid()}")
        assert peer.path == transport, (peer.path, res.path)
        EVENTS.append(("I.connect", t0, t1))
        EVENTS.append(("I.write", t1, t2))
        EVENTS.append(("I.write_post", t1, tp))  # agent.write's synchronous part
        EVENTS.append(("TOTAL", t0, t2))
        # CPU over the same window (rusage, µs resolution), as steps whose
        # "duration" is CPU time: the process (its engine threads too) and
        # the loop's thread alone. Near the TOTAL means the initiator's own
        # work, not waiting for the target, is the window (conn24: ~1.2-1.3
        # ms of the loop thread's CPU in a 1.4-1.9 ms window, warm agents).
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        m1 = resource.getrusage(resource.RUSAGE_THREAD)
        for name, a, b in (("I.cpu_process", r0, r1), ("I.cpu_loop_thread", m0, m1)):
            user, kernel = b.ru_utime - a.ru_utime, b.ru_stime - a.ru_stime
            EVENTS.append((name, t0, t0 + int((user + kernel) * 1e9)))
            EVENTS.append((name + "_sys", t0, t0 + int(kernel * 1e9)))
        for i in range(int(os.environ.get("PHASE_WRITES", "1")) - 1):  # the later writes
            if idle:
                await asyncio.sleep(idle / 1000)
            t3 = time.monotonic_ns()
            xfer = agent.write(local[0:4096], peer.region("buf")[4096 : 4096 * 2])
            tp = time.monotonic_ns()
            await xfer
            EVENTS.append((f"I.write{i + 2}", t3, time.monotonic_ns()))
            EVENTS.append((f"I.write{i + 2}_post", t3, tp))
        if marks:
            prev = t0
            for name, t in marks:
                if t0 <= t <= t2:
                    EVENTS.append(("M." + name, prev, t))
                    prev = t
        print(json.dumps({"events": EVENTS}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "target", "initiator"])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--address")
    ap.add_argument("-n", type=int, default=11)
    ap.add_argument("--python", action="append",
                    help="a build's Python (repeat for an interleaved A/B); default: this one")
    ap.add_argument("--dump", action="store_true", help="print one sample's raw timeline")
    ap.add_argument("--json", help="append the raw samples here")
    args = ap.parse_args()
    if args.role == "target":
        asyncio.run(_target(args.transport))
        return
    if args.role == "initiator":
        asyncio.run(_initiator(args.transport, args.address))
        return
    pythons = args.python or [sys.executable]
    me = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH="")
    targets = []
    for py in pythons:
        p = subprocess.Popen([py, me, "--role", "target", "--transport", args.transport],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None
        targets.append((py, p, json.loads(p.stdout.readline())["address"]))
    samples: dict[str, list[dict[str, list[tuple[int, int]]]]] = {py: [] for py in pythons}
    # Steps kept from this long before the clock (PHASE_BACK2BACK: the
    # target's since the previous agent's write, what it still did then).
    before_ns = int(float(os.environ.get("PHASE_BEFORE_MS",
                                         "50" if os.environ.get("PHASE_BACK2BACK") else "1"))
                    * 1e6)
    try:
        for i in range(args.n):
            order = targets if i % 2 == 0 else targets[::-1]
            for py, p, address in order:
                out = subprocess.run(
                    [py, me, "--role", "initiator", "--transport", args.transport,
                     "--address", address],
                    capture_output=True, text=True, env=env, timeout=60,
                )
                if out.returncode:
                    print(out.stderr, file=sys.stderr)
                    raise SystemExit(f"initiator failed ({py})")
                ev = json.loads(out.stdout.strip().splitlines()[-1])["events"]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("events\n")
                p.stdin.flush()
                ev += json.loads(p.stdout.readline())["events"]
                t0 = next(a for n, a, _ in ev if n == "TOTAL")
                s: dict[str, list[tuple[int, int]]] = {}
                for n, a, b in ev:
                    if b >= t0 - before_ns:
                        s.setdefault(n, []).append((a - t0, b - a))
                samples[py].append(s)
    finally:
        for _, p, _ in targets:
            assert p.stdin is not None
            try:
                p.stdin.write("exit\n")
                p.stdin.flush()
            except OSError:
                pass
            p.wait(timeout=20)
    if args.dump:
        for py in pythons:
            s = sorted(samples[py], key=lambda s: s["TOTAL"][0][1])[len(samples[py]) // 2]
            rows = sorted((a, d, n) for n, h in s.items() for a, d in h)
            print(f"-- one sample of {py}")
            for a, d, n in rows:
                print(f"  {a / 1e6:7.2f} +{d / 1e6:6.2f}  {n}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"transport": args.transport, "samples": samples}) + "\n")
    for py in pythons:
        ss = samples[py]
        tot = [s["TOTAL"][0][1] / 1e6 for s in ss]
        q1 = statistics.quantiles(tot, n=4)[0] if len(tot) > 1 else tot[0]
        print(f"== {py} ({args.transport}, n={len(ss)}): total median {statistics.median(tot):.2f}"
              f" ms (min {min(tot):.2f}, q1 {q1:.2f}, max {max(tot):.2f})")
        names = sorted({n for s in ss for n in s},
                       key=lambda n: statistics.median(s[n][0][0] for s in ss if n in s))
        for n in names:
            have = [s[n] for s in ss if n in s]
            cnt = statistics.median(len(h) for h in have)
            start = statistics.median(h[0][0] for h in have) / 1e6
            dur = statistics.median(sum(d for _, d in h) for h in have) / 1e6
            print(f"  {n:28s} x{cnt:<4g} start {start:7.2f}  dur(sum) {dur:6.2f} ms")


if __name__ == "__main__":
    main()

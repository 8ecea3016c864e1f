"""KV hand-off, the serving-shaped benchmark: a prefill worker writes a
request's KV cache into a decode worker's pool layer by layer, with a
notification per layer; the decode worker waits for each layer as it lands
(it could start decoding layer 0 while the rest is still on the wire).

Per iteration: L layers x 2 (K, V) x B blocks of S bytes. The source blocks
of a layer are contiguous; their destination slots follow a fixed random
permutation (a decode pool's free blocks are scattered), so every layer is 2B
descriptors. The prefill side posts all L layer writes back to back (as a
model that finished its forward pass would), the decode side timestamps each
layer's notification on arrival. Reported per system and block size: time
from the first post to layer 0's notification ("first layer": when decoding
can start) and to the last one to arrive ("all layers"), medians over the
iterations, and GB/s of KV moved (bytes / all-layers time). The last iteration's bytes are checked.

Systems, each in its own processes (prefill = child of decode), all on one host:
  aioxfer        the native API (agent.write(SegmentList, SegmentList, notify=...),
                 await agent.notifications.receive())
  aioxfer.nixl   NIXL's API on aioxfer (the same code as "nixl" below)
  nixl           real NIXL (UCX backend): prep_xfer_dlist once, make_prepped_xfer +
                 transfer per layer with its notification, get_new_notifs polled
                 (how vLLM's connector does it); needs --nixl-python

    python benchmarks/kv_handoff.py --nixl-python ~/.cache/aioxfer-peers/venv-nixl/bin/python

Traffic stays on 127.0.0.1 (UCX_NET_DEVICES=lo). Times from CLOCK_MONOTONIC,
which is one clock for every process of the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

SYSTEMS = ("aioxfer", "aioxfer.nixl", "nixl")


# ---------------------------------------------------------------- the workload


class Layout:
    """Where each (layer, K/V, block) lives on both sides."""

    def __init__(self, layers: int, blocks: int, block_bytes: int) -> None:
        self.layers, self.blocks, self.block_bytes = layers, blocks, block_bytes
        self.per_layer = 2 * blocks
        self.total = layers * self.per_layer * block_bytes
        perm = np.random.default_rng(7).permutation(blocks)
        rows = np.arange(layers * 2)[:, None] * blocks
        self.src_index = (rows + np.arange(blocks)[None, :]).reshape(layers, -1)
        self.dst_index = (rows + perm[None, :]).reshape(layers, -1)

    def src_offsets(self, layer: int) -> np.ndarray:
        return self.src_index[layer] * self.block_bytes

    def dst_offsets(self, layer: int) -> np.ndarray:
        return self.dst_index[layer] * self.block_bytes

    def fill(self, buf: np.ndarray, seed: int) -> None:
        """Block i of the source holds bytes (i * 31 + seed) mod 251."""
        view = buf.reshape(-1, self.block_bytes)
        view[:] = ((np.arange(view.shape[0]) * 31 + seed) % 251).astype(np.uint8)[:, None]

    def check(self, dst: np.ndarray, seed: int) -> bool:
        want = np.empty(self.total, np.uint8)
        self.fill(want, seed)
        got = dst.reshape(-1, self.block_bytes)
        src = want.reshape(-1, self.block_bytes)
        return bool(np.array_equal(got[self.dst_index.ravel()], src[self.src_index.ravel()]))


def _layer_of(msg: bytes, it: int, arrived: dict[int, int]) -> int:
    """The layer a notification announces ("<iteration>:<layer>"). Layers may
    arrive in any order (NIXL orders nothing across requests); each once."""
    got_it, layer = (int(x) for x in msg.split(b":"))
    if got_it != it or layer in arrived:
        raise AssertionError(f"iteration {it}: unexpected notification {msg!r}")
    return layer


def summarize(layout: Layout, firsts: list[int], lasts: list[int], ok: bool) -> dict[str, Any]:
    last = statistics.median(lasts) / 1e3
    return {
        "layers": layout.layers, "blocks": layout.blocks, "block_bytes": layout.block_bytes,
        "iters": len(lasts), "first_us": statistics.median(firsts) / 1e3, "all_us": last,
        "gbps": layout.total / (last * 1e3), "verified": ok,
    }


# ---------------------------------------------------------------- aioxfer


def _progress(cfg: dict[str, Any]) -> dict[str, Any]:
    """Agent(progress=...) when --progress chose one (else the agent's default)."""
    return {"progress": cfg["progress"]} if cfg.get("progress") else {}


async def _aio_decode(cfg: dict[str, Any], conn: Any) -> dict[str, Any]:
    import aioxfer

    layout = Layout(cfg["layers"], cfg["blocks"], cfg["block_bytes"])
    loop = asyncio.get_running_loop()
    async with aioxfer.Agent("decode", **_progress(cfg)) as agent:
        pool = agent.alloc(layout.total, name="kv")
        conn.send(agent.address)
        assert await loop.run_in_executor(None, conn.recv) == "ready"
        firsts: list[int] = []
        lasts: list[int] = []
        for it in range(cfg["warmup"] + cfg["iters"]):
            conn.send(it)
            arrived: dict[int, int] = {}
            while len(arrived) < layout.layers:
                note = await agent.notifications.receive()
                arrived[_layer_of(note.payload, it, arrived)] = time.monotonic_ns()
            t0 = await loop.run_in_executor(None, conn.recv)
            if it >= cfg["warmup"]:
                firsts.append(arrived[0] - t0)
                lasts.append(max(arrived.values()) - t0)
        last = cfg["iters"] + cfg["warmup"] - 1
        ok = layout.check(np.frombuffer(pool.memoryview, np.uint8), last)
        conn.send("done")
        return summarize(layout, firsts, lasts, ok)


async def _aio_prefill(cfg: dict[str, Any], conn: Any) -> None:
    import aioxfer

    layout = Layout(cfg["layers"], cfg["blocks"], cfg["block_bytes"])
    loop = asyncio.get_running_loop()
    address = conn.recv()
    async with aioxfer.Agent("prefill", **_progress(cfg)) as agent:
        src = agent.alloc(layout.total, name="kv")
        srcv = np.frombuffer(src.memoryview, np.uint8)
        peer = await agent.connect(address)
        dst = peer.region("kv")
        size = np.full(layout.per_layer, layout.block_bytes)
        # Prepared once, as NIXL's prepped descriptor lists are.
        src_layers = [src.segments(layout.src_offsets(i), size) for i in range(layout.layers)]
        dst_layers = [dst.segments(layout.dst_offsets(i), size) for i in range(layout.layers)]
        conn.send("ready")
        while True:
            it = await loop.run_in_executor(None, conn.recv)
            if it == "done":
                return
            layout.fill(srcv, it)
            t0 = time.monotonic_ns()
            posted = [
                agent.write(src_layers[i], dst_layers[i], notify=b"%d:%d" % (it, i))
                for i in range(layout.layers)
            ]
            await asyncio.gather(*posted)
            conn.send(t0)


def _aio_prefill_main(cfg: dict[str, Any], conn: Any) -> None:
    asyncio.run(_aio_prefill(cfg, conn))


# ---------------------------------------------------------------- NIXL's API


def _nixl_api(system: str) -> Any:
    if system == "nixl":
        import nixl._api as api
    else:
        import aioxfer.nixl._api as api
    return api


def _nixl_agent(api: Any, name: str) -> Any:
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _nixl_decode(cfg: dict[str, Any], conn: Any) -> dict[str, Any]:
    api = _nixl_api(cfg["system"])
    layout = Layout(cfg["layers"], cfg["blocks"], cfg["block_bytes"])
    agent = _nixl_agent(api, "decode")
    pool = np.zeros(layout.total, np.uint8)
    reg = agent.register_memory([(pool.ctypes.data, layout.total, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), pool.ctypes.data))
    assert conn.recv() == "ready"
    firsts: list[int] = []
    lasts: list[int] = []
    for it in range(cfg["warmup"] + cfg["iters"]):
        conn.send(it)
        arrived: dict[int, int] = {}
        while len(arrived) < layout.layers:  # polled, as NIXL's users do
            for msgs in agent.get_new_notifs().values():
                now = time.monotonic_ns()
                for msg in msgs:
                    arrived[_layer_of(msg, it, arrived)] = now
        t0 = conn.recv()
        if it >= cfg["warmup"]:
            firsts.append(arrived[0] - t0)
            lasts.append(max(arrived.values()) - t0)
    ok = layout.check(pool, cfg["iters"] + cfg["warmup"] - 1)
    conn.send("done")
    conn.recv()  # the prefill side has released everything
    agent.deregister_memory(reg)
    return summarize(layout, firsts, lasts, ok)


def _nixl_prefill_main(cfg: dict[str, Any], conn: Any) -> None:
    api = _nixl_api(cfg["system"])
    layout = Layout(cfg["layers"], cfg["blocks"], cfg["block_bytes"])
    meta, raddr = conn.recv()
    agent = _nixl_agent(api, "prefill")
    src = np.zeros(layout.total, np.uint8)
    reg = agent.register_memory([(src.ctypes.data, layout.total, 0, "")], "DRAM")
    remote = agent.add_remote_agent(meta)
    n = layout.layers * layout.per_layer
    bs = layout.block_bytes
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(src.ctypes.data + i * bs, bs, 0) for i in range(n)], "DRAM")
    far = agent.prep_xfer_dlist(remote, [(raddr + i * bs, bs, 0) for i in range(n)], "DRAM")
    conn.send("ready")
    while True:
        it = conn.recv()
        if it == "done":
            break
        layout.fill(src, it)
        t0 = time.monotonic_ns()
        handles = []
        for i in range(layout.layers):
            h = agent.make_prepped_xfer("WRITE", local, layout.src_index[i].tolist(), far,
                                        layout.dst_index[i].tolist(), b"%d:%d" % (it, i))
            if agent.transfer(h) == "ERR":
                raise RuntimeError("transfer failed")
            handles.append(h)
        for h in handles:
            while (state := agent.check_xfer_state(h)) == "PROC":
                pass
            if state != "DONE":
                raise RuntimeError(f"transfer ended {state}")
            agent.release_xfer_handle(h)
        conn.send(t0)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(far)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    conn.send("released")
    sys.stdout.flush()
    os._exit(0)  # NIXL's bundled libnl crashes in its exit-time destructor


# ---------------------------------------------------------------- one system


def run_system(cfg: dict[str, Any]) -> dict[str, Any]:
    """This process is the decode side; the prefill side is its child."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    aio = cfg["system"] == "aioxfer"
    child = ctx.Process(target=_aio_prefill_main if aio else _nixl_prefill_main,
                        args=(cfg, theirs), daemon=True)
    child.start()
    theirs.close()
    try:
        if aio:
            result = asyncio.run(_aio_decode(cfg, mine))
        else:
            result = _nixl_decode(cfg, mine)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    label = cfg["system"] + (f" ({cfg['progress']})" if cfg.get("progress") else "")
    return {"system": label, **result}


def _role_main(ns: argparse.Namespace) -> None:
    cfg = {"system": ns.system, "layers": ns.layers, "blocks": ns.blocks,
           "block_bytes": ns.block_bytes, "iters": ns.iters, "warmup": ns.warmup,
           "progress": ns.progress if ns.system == "aioxfer" else None}
    print("RESULT " + json.dumps(run_system(cfg)), flush=True)
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=SYSTEMS, help="run one system once (internal)")
    ap.add_argument("--nixl-python", help="a Python with real NIXL installed")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16, help="blocks per layer, per K and V")
    ap.add_argument("--block-kib", default="16,64", help="block sizes (KiB), comma-separated")
    ap.add_argument("--block-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--progress", default="",
                    help="aioxfer's progress modes to run (comma-separated: adaptive, sleep, "
                    "poll; default: the agent's default only); one aioxfer row per mode")
    ns = ap.parse_args()
    if ns.system:
        _role_main(ns)
        return
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_MODULES="^ib")
    modes = [m for m in ns.progress.split(",") if m] or [""]
    systems = [f"{s}:{m}" if s == "aioxfer" else f"{s}:" for s in SYSTEMS
               if s != "nixl" or ns.nixl_python for m in (modes if s == "aioxfer" else [""])]
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rnd in range(ns.rounds):
        order = systems[rnd % len(systems):] + systems[: rnd % len(systems)]
        for kib in (int(k) for k in ns.block_kib.split(",")):
            for entry in order:
                system, mode = entry.split(":")
                py = ns.nixl_python if system == "nixl" else sys.executable
                argv = [py, os.path.abspath(__file__), "--system", system,
                        "--layers", str(ns.layers), "--blocks", str(ns.blocks),
                        "--block-bytes", str(kib << 10), "--iters", str(ns.iters),
                        "--warmup", str(ns.warmup)] + (["--progress", mode] if mode else [])
                out = subprocess.run(argv, env=env, capture_output=True, text=True,
                                     timeout=600, cwd="/")
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if not lines:
                    print(f"{system} {kib} KiB failed (exit {out.returncode}):\n"
                          f"{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                rec = json.loads(lines[-1][7:])
                print(f"round {rnd} {rec['system']:20s} {kib:3d} KiB: "
                      f"first {rec['first_us']:9.1f} us,"
                      f" all {rec['all_us']:9.1f} us, {rec['gbps']:6.2f} GB/s"
                      f"{'' if rec['verified'] else '  NOT VERIFIED'}", file=sys.stderr)
                rows.setdefault((rec["system"], kib), []).append(rec)
    print(f"\nKV hand-off: {ns.layers} layers x 2 x {ns.blocks} blocks, notification per "
          f"layer; medians of {ns.rounds} rounds x {ns.iters} iterations "
          f"({os.cpu_count()} cores)\n")
    print("| system | block | first layer (µs) | all layers (µs) | GB/s | verified |")
    print("|---|---:|---:|---:|---:|:---:|")
    for (system, kib), recs in rows.items():
        med = {k: statistics.median(r[k] for r in recs) for k in ("first_us", "all_us", "gbps")}
        print(f"| {system} | {kib} KiB | {med['first_us']:.1f} | {med['all_us']:.1f} | "
              f"{med['gbps']:.2f} | {'yes' if all(r['verified'] for r in recs) else 'NO'} |")


if __name__ == "__main__":
    main()

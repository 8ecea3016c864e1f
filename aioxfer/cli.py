"""The ``aioxfer`` command: ``info``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("aioxfer")
    except Exception:
        import aioxfer

        return str(getattr(aioxfer, "__version__", "unknown"))


def _shm_status() -> tuple[bool, str]:
    if sys.platform != "linux":
        return False, "needs Linux (memfd, cross-memory attach)"
    if not hasattr(os, "memfd_create"):
        return False, "os.memfd_create missing"
    notes = ["memfd pools", "cross-memory attach"]
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
        if scope > 0:
            notes.append(
                f"kernel.yama.ptrace_scope={scope}: cross-memory attach to non-child "
                "processes may be refused; memfd pools (agent.alloc) are unaffected"
            )
    except (OSError, ValueError):
        pass
    return True, ", ".join(notes)


# The transports that depend on what this machine has: (name, module). Each
# module answers status() -> (available, why) and, where it applies,
# devices() -> names; neither may raise on a machine without the hardware.
OPTIONAL_TRANSPORTS = (
    ("verbs", "aioxfer.verbs"),
    ("cuda", "aioxfer.cuda"),
    ("file", "aioxfer.file_transport"),
)


def _optional_status(module: str) -> tuple[bool, str, list[str]]:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return False, f"not built ({exc})", []
    ok, why = mod.status()
    devices = list(mod.devices()) if ok and hasattr(mod, "devices") else []
    return bool(ok), str(why), devices


def cmd_info(ns: argparse.Namespace) -> int:
    print(f"aioxfer {_version()}")
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"platform {platform.system()} {platform.release()} {platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    try:
        from aioxfer import _cyx
    except ImportError as exc:
        print(f"native engine: NOT importable ({exc})")
        return 1
    print(f"native engine: aioxfer._cyx ({_cyx.__file__})")
    print("transports:")
    ok, why = _shm_status()
    print(f"  shm     {'available' if ok else 'unavailable'}: {why}")
    print("  tcp     available: framed one-sided protocol, several connections per peer")
    for name, module in OPTIONAL_TRANSPORTS:
        ok, why, devices = _optional_status(module)
        print(f"  {name:<7} {'available' if ok else 'unavailable'}: {why}")
        for dev in devices:
            print(f"          device {dev}")
    _hardware()
    max_notify = getattr(_cyx, "MAX_NOTIFY", None)
    if max_notify is not None:
        print(f"limits: notification payload <= {max_notify} bytes")
    return 0


def _hardware() -> None:
    """What the GPU and RDMA transports will find: GPUs (dmabuf, peer access),
    NICs (ports, link layer, GID table with types, the GID chosen), GPU-NIC
    PCIe affinity, the locked-memory limit, the peer-memory module. Each part
    says plainly when there is nothing."""
    from aioxfer import cuda, verbs

    print("hardware:")
    gpus = cuda.device_info()
    if not gpus:
        print(f"  GPUs:   none ({cuda.status()[1]})")
    for g in gpus:
        peers = ",".join(str(p) for p in g.peers) or "none"
        print(f"  GPU {g.ordinal}:  {g.name} at {g.pci or '?'}, dmabuf "
              f"{'yes' if g.dmabuf else 'no'}, peer access to: {peers}")
    nics = verbs.nics()
    if not nics:
        print("  NICs:   none (no RDMA devices in /sys/class/infiniband)")
    chosen = {line.split(" ", 1)[0]: line for line in verbs.devices()}
    for n in nics:
        ports = ", ".join(f"port {p} {st or '?'} {ll or '?'}" for p, (st, ll) in n.ports.items())
        print(f"  NIC {n.name}: at {n.pci or '(no PCI device)'}, {ports or 'no ports'}")
        for port, table in n.gids.items():
            for gid in table:
                print(f"          port {port} gid[{gid.index}] {gid.gid} {gid.type or '(type ?)'}")
        if n.name in chosen:
            print(f"          used: {chosen[n.name]}")
    if gpus and nics:
        for gpu, order in verbs.gpu_nic_affinity([g.pci for g in gpus], nics).items():
            print(f"  GPU {gpu} -> NICs by PCIe distance: {', '.join(order)}")
    limit = verbs.memlock_limit()
    print(f"  RLIMIT_MEMLOCK: {'unlimited' if limit is None else f'{limit // 1024} KiB'}"
          + ("" if limit is None or limit >= 1 << 30 else
             " (RDMA registration pins memory against it, per device: raise it, "
             "ulimit -l unlimited)"))
    peermem = verbs.peermem_loaded()
    print(f"  nvidia-peermem: {'loaded (' + peermem + ')' if peermem else 'not loaded'}"
          + ("" if peermem or not gpus else " (GPU memory reaches RDMA through dmabuf only)"))


def cmd_demo(ns: argparse.Namespace) -> int:
    from aioxfer import demo

    return demo.run_demo(demo.config_from_args(ns))


def cmd_bench(ns: argparse.Namespace) -> int:
    from aioxfer import bench

    return bench.run_bench(bench.config_from_args(ns))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aioxfer", description="asyncio-first transfer framework: tools"
    )
    p.add_argument("--version", action="version", version=f"aioxfer {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="version and the transports available here")
    info.set_defaults(func=cmd_info)
    demo = sub.add_parser(
        "demo", help="prefill -> decode KV streaming between two processes, verified"
    )
    from aioxfer import demo as demo_mod

    demo_mod.add_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser(
        "bench",
        help="sweeps of READ/WRITE (op, transport, size, descriptors, in flight), verified: "
        "table, JSON, plot",
    )
    from aioxfer import bench as bench_mod

    bench_mod.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

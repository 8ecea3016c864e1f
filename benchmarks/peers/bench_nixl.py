"""NIXL (UCX backend): one-sided WRITE/READ between host buffers of two processes.

The initiator (this process) starts the target as a child; each creates a
nixl_agent with the UCX backend and registers a 64 MiB DRAM buffer; agent
metadata goes over the child's stdin/stdout pipe. Each request is an
initialize_xfer handle, re-posted with transfer() and polled with
check_xfer_state() until DONE (NIXL's fastest way to repeat a transfer).

    UCX_NET_DEVICES=lo python bench_nixl.py --prog-thread target        # same host: UCX picks CMA
    UCX_NET_DEVICES=lo UCX_TLS=tcp python bench_nixl.py --prog-thread target   # over TCP

UCX transports come from the UCX_* environment. With UCX_TLS=tcp the target's
progress thread must run: UCT tcp implements a put natively (a PUT_REQ header,
then the payload), and the put completes only when the target's PUT_ACK comes
back, sent once the payload is in the destination (src/uct/tcp/tcp_ep.c): the
same remote completion as aioxfer's WRITE.

UCX_TLS=tcp is TCP only (checked with strace -f and perf sched events on
this script, WRITE and READ, 4 KiB to 64 MiB): no process_vm_writev but
UCX's start-up CMA probe (8 bytes into its own pid), no shared memory but
three 4 KiB SysV segments at start-up, one data socket per direction, no
MSG_ZEROCOPY, no SO_SNDBUF/SO_RCVBUF (autotuned), TCP_NODELAY. A 1 MiB WRITE
is one sendmsg (25 B header + the payload) and a 25 B flush request; the
target receives straight into the destination, 100-650 KiB per recv. It
beats a single iperf3 stream because both of its threads busy-poll (the
initiator in check_xfer_state, the target's progress thread): no thread
ever waits to be woken, and the sender's copy overlaps the receiver's on
two otherwise idle cores. With anything else running on the two cores that
collapses (measured: 1 MiB WRITE 0.1-0.7 GB/s, 4 KiB p99 8 ms), so its rows
are only meaningful on an idle machine (run.py records the load average). NIXL's bundled
libnl-route crashes in its exit-time destructor once rdma-core is installed, so
the process leaves with os._exit after its work.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def make_agent(name: str, args: argparse.Namespace) -> object:
    from nixl._api import nixl_agent, nixl_agent_config

    thread = args.prog_thread in ("both", "target" if name == "target" else "initiator")
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=thread, backends=[]))
    init = {"ucx_error_handling_mode": args.ucx_err_mode} if args.ucx_err_mode else {}
    agent.create_backend("UCX", init)
    return agent


def target_main(args: argparse.Namespace) -> None:
    ctl = C.child_ctl()
    agent = make_agent("target", args)
    buf = np.empty(C.BUF_SIZE, dtype=np.uint8)
    buf.fill(1)  # fault the pages in
    agent.register_memory([(buf.ctypes.data, C.BUF_SIZE, 0, "")], "DRAM")
    ctl.send(("meta", agent.get_agent_metadata(), buf.ctypes.data))
    while True:
        msg = ctl.recv()
        if msg[0] == "exit":
            break
        C.serve_check(msg, buf, ctl)
    os._exit(0)


def initiator_main(args: argparse.Namespace) -> None:
    argv = [sys.executable, os.path.abspath(__file__), "--role", "target",
            "--prog-thread", args.prog_thread, "--ucx-err-mode", args.ucx_err_mode]
    proc, ctl = C.spawn_target(argv)
    try:
        run(args, ctl)
    finally:
        C.stop_target(proc, ctl)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(args: argparse.Namespace, ctl: C.Ctl) -> None:
    kind, meta, raddr = ctl.recv()
    assert kind == "meta"
    buf = np.empty(C.BUF_SIZE, dtype=np.uint8)
    buf.fill(2)
    laddr = buf.ctypes.data
    tls = os.environ.get("UCX_TLS", "")
    config = f"UCX{':' + tls if tls else ''},progthr={args.prog_thread}"
    if args.ucx_err_mode:
        config += f",err={args.ucx_err_mode}"
    base = dict(peer="nixl", transport="ucx-tcp" if tls == "tcp" else "ucx", config=config)
    connect_samples(args, ctl, meta, raddr, buf, base)
    if C.CONNECT_ONLY:
        return
    agent = make_agent("initiator", args)
    reg = agent.register_memory([(laddr, C.BUF_SIZE, 0, "")], "DRAM")
    remote = agent.add_remote_agent(meta)
    remote = remote.decode() if isinstance(remote, bytes) else remote

    def handle(op: str, pairs: list[tuple[int, int, int]]) -> object:
        """pairs: (local offset, remote offset, length)."""
        local = agent.get_xfer_descs([(laddr + lo, n, 0) for lo, _, n in pairs], "DRAM")
        rem = agent.get_xfer_descs([(raddr + ro, n, 0) for _, ro, n in pairs], "DRAM")
        return agent.initialize_xfer(op, local, rem, remote)

    def run_once(h: object) -> None:
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"NIXL transfer state {st}")

    h = handle("WRITE", [(0, 0, 4096)])
    run_once(h)
    h.release()

    def single(op: str, size: int) -> C.Made:
        h = handle(op, [(0, 0, size)])
        return (lambda: run_once(h)), h.release

    def inflight(op: str, qd: int) -> C.Made:
        hs = [handle(op, [(i * 4096, i * 4096, 4096)]) for i in range(qd)]

        def once() -> None:
            for h in hs:
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("NIXL transfer state ERR")
            for h in hs:
                st = agent.check_xfer_state(h)
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                if st != "DONE":
                    raise RuntimeError(f"NIXL transfer state {st}")

        def release() -> None:
            for h in hs:
                h.release()

        return once, release

    def batch(op: str, lpages: np.ndarray, rpages: np.ndarray) -> C.Made:
        d = C.BATCH_DESC
        pairs = zip(lpages, rpages, strict=True)
        h = handle(op, [(int(lp) * d, int(rp) * d, d) for lp, rp in pairs])
        return (lambda: run_once(h)), h.release

    C.run_suite(base, ctl, buf, args.ops.split(","), single, inflight, batch)
    # orderly teardown before os._exit
    agent.deregister_memory(reg)
    agent.remove_remote_agent(remote)


def connect_samples(args: argparse.Namespace, ctl: C.Ctl, meta: bytes, raddr: int,
                    buf: np.ndarray, base: dict[str, Any]) -> None:
    """connect + first 4 KiB write, C.CONNECT_SAMPLES times: each by a fresh
    agent (its UCX backend made and its memory registered before the clock).
    Loading the target's metadata is part of connecting (Mooncake's and
    aioxfer's fetch theirs inside the timer), then a handle, a WRITE polled
    to DONE (UCX: remotely complete)."""
    laddr = buf.ctypes.data
    samples = []
    for i in range(C.CONNECT_SAMPLES):
        agent: Any = make_agent(f"initiator-c{i}", args)
        reg = agent.register_memory([(laddr, C.BUF_SIZE, 0, "")], "DRAM")
        cs = C.ConnectSample(ctl)
        cs.arm(buf)
        cs.start()
        remote = agent.add_remote_agent(meta)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        local = agent.get_xfer_descs([(laddr, 4096, 0)], "DRAM")
        rem = agent.get_xfer_descs([(raddr, 4096, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", local, rem, remote)
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        cs.done()
        if st != "DONE":
            raise RuntimeError(f"NIXL transfer state {st}")
        samples.append(cs.finish())
        h.release()
        agent.deregister_memory(reg)
        agent.remove_remote_agent(remote)
        del agent
    C.emit_connect(base, samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--prog-thread", default="target",
                    choices=["both", "target", "initiator", "none"],
                    help="which agents run NIXL's progress thread (default: the target only)")
    ap.add_argument("--ucx-err-mode", default="",
                    help="UCX ucx_error_handling_mode (peer|none; default: UCX's own)")
    args = ap.parse_args()
    (target_main if args.role == "target" else initiator_main)(args)


if __name__ == "__main__":
    main()

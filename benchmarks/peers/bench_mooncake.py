"""Mooncake Transfer Engine (TCP transport, P2P handshake): WRITE/READ between
host buffers of two processes.

The target (a child process) initializes a TransferEngine on 127.0.0.1 with
metadata "P2PHANDSHAKE", registers a 64 MiB buffer and sends its session name
("127.0.0.1:<rpc port>") and buffer address over the child's stdin/stdout pipe.
Single requests use transfer_sync_write/read; requests in flight use
transfer_submit_write (WRITE) or batch_transfer_async (READ, which has no
per-request submit); the scattered batch uses batch_transfer_sync_write/read.

    MC_TCP_BIND_ADDRESS=127.0.0.1 python bench_mooncake.py

Needs libibverbs1 installed to import, even for TCP.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def make_engine() -> object:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize rc={rc}")
    return te


def target_main() -> None:
    ctl = C.child_ctl()
    te = make_engine()
    buf = np.empty(C.BUF_SIZE, dtype=np.uint8)
    buf.fill(1)
    assert te.register_memory(buf.ctypes.data, C.BUF_SIZE) == 0
    ctl.send(("meta", f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data))
    while True:
        msg = ctl.recv()
        if msg[0] == "exit":
            break
        C.serve_check(msg, buf, ctl)
    te.unregister_memory(buf.ctypes.data)
    sys.stdout.flush()
    os._exit(0)


def initiator_main(args: argparse.Namespace) -> None:
    proc, ctl = C.spawn_target([sys.executable, os.path.abspath(__file__), "--role", "target"])
    try:
        run(args, ctl)
    finally:
        C.stop_target(proc, ctl)
    sys.stdout.flush()
    os._exit(0)


def run(args: argparse.Namespace, ctl: C.Ctl) -> None:
    kind, session, raddr = ctl.recv()
    assert kind == "meta"
    buf = np.empty(C.BUF_SIZE, dtype=np.uint8)
    buf.fill(2)
    laddr = buf.ctypes.data
    base = dict(peer="mooncake", transport="tcp", config="tcp,P2PHANDSHAKE")

    def chk(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"mooncake rc={rc}")

    # connect + first 4 KiB write: each sample a fresh engine (its memory
    # registered before the clock; engines coexist in one process), whose
    # first transfer to the session runs the P2P handshake (the target's
    # segment descriptor) and opens its connection. transfer_sync_write
    # returns once the body is in the local socket (the target sends no
    # reply to a WRITE), so the sample also waits for the target to see the
    # bytes (C.ConnectSample).
    samples = []
    for _ in range(C.CONNECT_SAMPLES):
        eng = make_engine()
        assert eng.register_memory(laddr, C.BUF_SIZE) == 0
        cs = C.ConnectSample(ctl)
        cs.arm(buf)
        cs.start()
        chk(eng.transfer_sync_write(session, laddr, raddr, 4096))
        cs.done()
        samples.append(cs.finish())
        eng.unregister_memory(laddr)
        del eng
    C.emit_connect(base, samples)
    if C.CONNECT_ONLY:
        return
    te = make_engine()
    assert te.register_memory(laddr, C.BUF_SIZE) == 0
    chk(te.transfer_sync_write(session, laddr, raddr, 4096))

    def single(op: str, size: int) -> C.Made:
        fn = te.transfer_sync_write if op == "WRITE" else te.transfer_sync_read
        return (lambda: chk(fn(session, laddr, raddr, size))), None

    def inflight(op: str, qd: int) -> C.Made:
        if op == "WRITE":
            def once() -> None:
                ids = [te.transfer_submit_write(session, laddr + i * 4096, raddr + i * 4096, 4096)
                       for i in range(qd)]
                for i in ids:
                    if i < 0:
                        raise RuntimeError("mooncake submit failed")
                    while (st := te.transfer_check_status(i)) != 1:  # 1: completed
                        if st < 0:
                            raise RuntimeError(f"mooncake status {st}")
            return once, None
        opc = te.TransferOpcode.Read
        lbufs = [laddr + i * 4096 for i in range(qd)]
        rbufs = [raddr + i * 4096 for i in range(qd)]

        def once_read() -> None:
            bid = te.batch_transfer_async(session, lbufs, rbufs, [4096] * qd, opc)
            if bid == 0:
                raise RuntimeError("mooncake batch submit failed")
            while (st := te.get_batch_transfer_status([bid])) != 0:
                if st < 0:
                    raise RuntimeError(f"mooncake status {st}")
        return once_read, None

    def batch(op: str, lpages: np.ndarray, rpages: np.ndarray) -> C.Made:
        d = C.BATCH_DESC
        lbufs = [laddr + int(p) * d for p in lpages]
        rbufs = [raddr + int(p) * d for p in rpages]
        lens = [d] * C.BATCH_N
        fn = te.batch_transfer_sync_write if op == "WRITE" else te.batch_transfer_sync_read
        return (lambda: chk(fn(session, lbufs, rbufs, lens))), None

    C.run_suite(base, ctl, buf, args.ops.split(","), single, inflight, batch)
    te.unregister_memory(laddr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="initiator", choices=["initiator", "target"])
    ap.add_argument("--ops", default="WRITE,READ")
    args = ap.parse_args()
    target_main() if args.role == "target" else initiator_main(args)


if __name__ == "__main__":
    main()

"""benchmarks/peers/bench_nixl_compat.py's aioxfer.nixl target ended with
os._exit, which skips the compat agent's close at interpreter exit: its
engine never said goodbye, and the initiator (still up, waiting for the
target to exit) logged rail.down + peer.lost at the end of every tcp run for
a target that ended cleanly. Real processes: the bench's own Target (its
target process) and a compat initiator, over tcp."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"

# The initiator's side of one run, cut to its set-up (every workload's data
# checked once) and its end (the target told to exit); then it stays up a
# while, as the bench's initiator does while a driver reads its last lines.
CHILD = """
import argparse, sys, time
sys.path.insert(0, {peers!r})
import bench_nixl_compat as b
args = argparse.Namespace(system={system!r}, transport="tcp", ops=["WRITE"])
target = b.Target(args)
keep = []
shared = b.buffer() if args.system == "both" else None
works = b.nixl_like_workloads(args, target, keep, shared)
assert all(w.verified for w in works)
target.close()
time.sleep(1.0)
print("initiator done", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("system", ["compat", "both"])
def test_compat_target_leaves_cleanly(system: str, tmp_path: Path) -> None:
    """Before: rail.down and peer.lost warnings, no peer.closed."""
    env = dict(os.environ, AIOXFER_NIXL_TRANSPORTS="tcp", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(peers=str(PEERS), system=system)],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)  # not the checkout: `-c` puts cwd first on sys.path
    err = proc.stderr
    assert proc.returncode == 0 and "initiator done" in err, err[-4000:]
    assert "peer.connected" in err, err[-4000:]
    assert "peer.lost" not in err and "rail.down" not in err, err[-4000:]
    assert "peer.closed" in err, err[-4000:]  # (seen: the end was watched)

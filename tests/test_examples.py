"""The runnable examples run, as a user would run them, and say what they should."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SAME_HOST

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, cwd: Path, seconds: float = 120) -> str:
    # Run outside the source tree, so the installed (built) aioxfer is imported.
    env = {**os.environ, "AIOXFER_LOG_LEVEL": "error"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=seconds,
    )
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kv_router_survives_a_killed_worker(transport: str, tmp_path: Path) -> None:
    requests = 48
    args = ["--workers", "3", "--requests", str(requests)]
    out = run_example("kv_router.py", *args, *(["--tcp"] if transport == "tcp" else []),
                      cwd=tmp_path)
    assert f"over {SAME_HOST if transport == 'shm' else transport}:" in out, out
    summary = re.search(
        r"served: (\d+)/(\d+)  retries: (\d+)  failures: (.*)  unserved: (\d+)  "
        r"corrupt: (\d+)  killed: (\d+)  hung: (\d+)", out)
    assert summary, out
    served, total, retries, failures, unserved, corrupt, killed, hung = summary.groups()
    assert (int(served), int(total)) == (requests, requests), out
    assert (int(unserved), int(corrupt), int(killed), int(hung)) == (0, 0, 1, 0), out
    # Every failed attempt was a typed aioxfer error, and was retried.
    attempts = re.findall(r"(\w+) x(\d+)", failures)
    assert all(cls in {"PeerLost", "StalePeer", "TransportError"} for cls, _ in attempts), out
    assert sum(int(n) for _, n in attempts) == int(retries), out
    # Per worker: one killed, the others exited cleanly, and together they served all.
    rows = re.findall(r"^(decode-\d+)\s+(\d+)\s+(killed|exit -?\d+)$", out, re.MULTILINE)
    assert len(rows) == 3, out
    assert sorted(state for _, _, state in rows) == ["exit 0", "exit 0", "killed"], out
    assert sum(int(n) for _, n, _ in rows) == requests, out


def test_kv_offload_to_file_and_back(tmp_path: Path) -> None:
    out = run_example("kv_offload.py", "--requests", "12", "--pages-per-request", "16",
                      "--pool-pages", "64", "--dir", str(tmp_path / "kv"), cwd=tmp_path)
    offloaded = re.search(r"offloaded: (\d+) requests", out)
    restored = re.search(r"restored: (\d+) requests", out)
    assert offloaded and restored, out
    # A host tier of 4 requests for 12: at least 8 are written back to the
    # disk tier while prefill runs, and resuming all 12 in random order reads
    # back every one not in host memory.
    assert int(offloaded.group(1)) >= 8 and int(restored.group(1)) >= 8, out
    assert "checksum failures 0" in out, out
    assert "resumed: 12  corrupt pages: 0" in out, out


def test_layerwise_prefill_decode(tmp_path: Path) -> None:
    out = run_example("layerwise_prefill_decode.py", "--layers", "8", "--blocks", "16",
                      "--block-kib", "32", "--compute-ms", "2", cwd=tmp_path)
    assert f"prefill: 8 layers x 16 blocks of 4096 bytes sent over {SAME_HOST}" in out, out
    assert "decode: 8 layers landed in order: True; corrupt blocks: 0" in out, out
    # The first layer landed while later ones were still being computed and sent.
    early = re.search(r"first layer landed ([\d.]+) ms before the last", out)
    assert early and float(early.group(1)) > 0, out
    assert "decode: stored 16 blocks" in out and "verified: True" in out, out

"""benchmarks/peers/bench_nixl_compat.py as the lead runs it, tiny: compat and
native in one process pair between the same two buffers (``--memory same``,
the default) and, for comparison, a pair each. What is checked is that every
row's data check passed (each system's bytes landed, CRC of both sides) and
that every record carries its figures; never a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "peers" / "bench_nixl_compat.py"


@pytest.mark.parametrize("memory", ["same", "separate"])
def test_compat_bench_checks_every_row_and_records_its_figures(
        memory: str, tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--only", "compat,native", "--transports", "shm",
         "--memory", memory, "--reps", "1", "--split", "2", "--slice", "0.02",
         "--workloads", "4 KiB,256 x 16 KiB by index", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "data checks: 8 passed, 0 failed" in proc.stdout, proc.stdout[-2000:]
    records = json.loads(out.read_text())
    assert {(r["system"], r["op"], r["workload"]) for r in records} == {
        (s, op, wl) for s in ("compat", "native") for op in ("WRITE", "READ")
        for wl in ("4 KiB", "256 x 16 KiB by index")}
    for r in records:
        assert r["verified"] and r["gbps"] > 0 and r["cpu_us"] > 0
        assert r["runq_us"] >= 0 and r["gbps_unwaited"] >= r["gbps"]
        assert r["initiator_cpu_us"] + r["target_cpu_us"] == pytest.approx(r["cpu_us"])
    # --memory same: both systems' initiators (and targets) are one process
    # pair, the same buffers; separate: a pair each.
    pids = {r["system"]: r["initiator_pid"] for r in records}
    assert (pids["compat"] == pids["native"]) == (memory == "same")
    assert ("one process pair, the same two buffers" in proc.stdout) == (memory == "same")

"""The cancel-heavy soak of benchmarks/kv_bench.py, reduced to fit CI: random
puts, gets, coalesced gets, lookups, removals, prefetches and streams on a
small host + disk store, a third of them cancelled at a random point. Every
block a get delivers is checked; afterwards nothing may be pinned or in
flight. (The full 1 M-operation run and its RSS curve: `python
benchmarks/kv_bench.py soak --ops 1000000`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "kv_bench.py"


def test_kv_soak_reduced(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = {**os.environ, "AIOXFER_LOG_LEVEL": "error"}
    proc = subprocess.run([sys.executable, str(BENCH), "soak", "--ops", "6000", "--seed", "3",
                           "--dir", str(tmp_path), "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["soak"]
    assert r["ops"] == 6000 and r["done"] + r["cancelled"] + r["errors"] == 6000
    assert r["cancelled"] > 600 and r["done"] > 3000, r  # cancel-heavy, and work got done
    assert r["unexpected_count"] == 0, r["unexpected"]
    assert r["stuck"] == 0, r  # every operation ended (no waiter left unanswered)
    assert r["verified_blocks"] > 1000 and r["corrupt_blocks"] == 0, r
    assert (r["pins"], r["pinned_bytes"], r["fetches_in_flight"], r["agent_in_flight"]) == \
        (0, 0, 0, 0), r
    # Flat memory: after the first quarter, RSS may wobble but not climb.
    assert r["rss_growth_after_warmup_mib"] < 32, r["rss_mib"]

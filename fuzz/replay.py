#!/usr/bin/env python3
"""Replays inputs through a Python harness's check(), outside the fuzzer:
the harness's seeds, then every file of the given directories.

The harnesses that set up agents, stores or servers once per process
(kv_peer, kv_disk, objects) replay in a process of their own this way
(tests/test_fz28_fuzz_replay.py): what they set up goes with the process.
Prints "replayed N inputs" and, per failing input, its name and error;
exits 1 if any failed.

Run: python fuzz/replay.py HARNESS [DIR...]
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    harness, dirs = sys.argv[1], sys.argv[2:]
    import aioxfer.log

    aioxfer.log.configure(level="critical")
    mod = importlib.import_module(f"fuzz_{harness}")
    inputs = [(f"seed-{k}", v) for k, v in mod.seeds().items()]
    for d in map(Path, dirs):
        inputs += [(p.name, p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()]
    failed = 0
    known: set[str] = set()
    for name, data in inputs:
        try:
            got = mod.check(data)
        except Exception as exc:  # a harness finding: said, with its input's name
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {exc}"[:2000], flush=True)
            continue
        if got is not None:
            known.add(got)
    print(f"replayed {len(inputs)} inputs, {failed} failed"
          + (f", known issues: {','.join(sorted(known))}" if known else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

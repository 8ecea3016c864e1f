"""Replays fz28's harnesses' seeds and committed corpora (fuzz/corpus/<harness>/)
as tests/test_fuzz_replay.py replays the others': the KV peer tier's
published metas and control messages (fuzz/fuzz_kv_peer.py), the KV disk
tier's segment and tombstone files and compressed blocks
(fuzz/fuzz_kv_disk.py), the object backend's reading of S3 answers
(fuzz/fuzz_objects.py). Each harness sets up real agents (and a loopback
endpoint) once per process, so each replays in a child process of its own
(fuzz/replay.py), its cwd outside the checkout. A harness's oracle failing
on any input fails the test; a known, reported issue (fuzz/known_issues.py)
is tolerated there, as in the other replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"


@pytest.mark.parametrize("harness", ["kv_peer", "kv_disk", "objects"])
def test_fz28_corpus_replays(harness: str, tmp_path: Path) -> None:
    if harness == "objects":
        pytest.importorskip("obstore")
    corpus = FUZZ / "corpus" / harness
    dirs = [str(corpus)] if corpus.is_dir() else []
    r = subprocess.run([sys.executable, str(FUZZ / "replay.py"), harness, *dirs],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = r.stdout + r.stderr[-4000:]
    assert r.returncode == 0, out
    n = int(r.stdout.split("replayed ", 1)[1].split()[0])
    files = len(list(corpus.iterdir())) if corpus.is_dir() else 0
    assert n >= 7 + files, out  # the seeds and every committed input ran

"""Replays the lone_frames harness's seeds and committed corpus (fuzz31):
the initiator-side parser with each request awaited alone by a spinning
thread, which reads the replies of parked receivers (conn.c help_read,
help_takes, help_more; native/fuzz/fuzz_lone_frames.c). Built as
tests/test_fuzz_replay.py builds the other native harnesses (build.sh
--replay: ASan/UBSan, LeakSanitizer at exit), each input on an engine of its
own. The harness's oracles (guard bytes, no byte changed that no READ asked
for, every request done once, no hang) fail the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_fuzz_replay import _replay, replay_bins  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"


def _inputs() -> list[tuple[str, bytes]]:
    import sys

    if str(FUZZ) not in sys.path:
        sys.path.insert(0, str(FUZZ))
    import make_seeds

    out = [(f"seed-{k}", v) for k, v in make_seeds.lone_seeds().items()]
    for sub in ("corpus", "findings"):
        d = FUZZ / sub / "lone_frames"
        if d.is_dir():
            out += [(p.name, p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()]
    return out


def test_lone_corpus_replays(replay_bins: Path, tmp_path: Path) -> None:  # noqa: F811
    if not (replay_bins / "fuzz_lone_frames").exists():
        pytest.fail("build.sh --replay made no fuzz_lone_frames")
    inputs = _inputs()
    assert len(inputs) >= 5, "the lone_frames seeds are missing"
    for name, data in inputs:
        (tmp_path / name).write_bytes(data)
    r = _replay(replay_bins / "fuzz_lone_frames", [tmp_path])
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr[-6000:]}"
    assert f"replayed {len(inputs)} inputs" in r.stdout, r.stdout

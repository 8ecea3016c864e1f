"""Replays the committed fuzz corpora (fuzz/corpus/<harness>/) and the seeds
(fuzz/make_seeds.py) through the same harnesses benchmarks/fuzz.sh fuzzes
with, so every input that once found new coverage keeps running in CI:

- the Python harnesses (handshake over a real socketpair, metadata decoders,
  aioxfer.nixl's wire formats) in this process, against the installed package;
- the native frame-parser harnesses through a replay build
  (native/fuzz/build.sh --replay: the harnesses with a plain main(), under
  ASan/UBSan and LeakSanitizer), so no libFuzzer runtime is needed here.

A harness's oracles (guard bytes, read-only and revoked memory untouched,
only typed errors, no hang) fail the test. Findings, once fixed, join the corpus
(fuzz/corpus/metadata/deep-nesting-json: discovery's etcd decoder).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"
CORPUS = FUZZ / "corpus"
FINDINGS = FUZZ / "findings"


def _harness(name: str) -> ModuleType:
    if str(FUZZ) not in sys.path:
        sys.path.insert(0, str(FUZZ))
    return importlib.import_module(name)


def _inputs(harness: str) -> list[tuple[str, bytes]]:
    seeds = _harness("make_seeds")
    make = {
        "target_frames": seeds.target_seeds,
        "initiator_frames": seeds.initiator_seeds,
        "handshake": seeds.handshake_seeds,
        "metadata": seeds.metadata_seeds,
        "nixl_wire": seeds.nixl_wire_seeds,
        "lone_frames": seeds.lone_seeds,
    }[harness]
    out = [(f"seed-{k}", v) for k, v in make().items()]
    d = CORPUS / harness
    if d.is_dir():
        out += [(p.name, p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()]
    return out


@pytest.mark.parametrize("harness", ["handshake", "metadata", "nixl_wire"])
def test_python_corpus_replays(harness: str) -> None:
    mod = _harness(f"fuzz_{harness}")
    inputs = _inputs(harness)
    assert len(inputs) >= 9, f"the {harness} corpus and seeds are missing"
    failures: list[str] = []
    for name, data in inputs:
        try:
            mod.check(data)  # a known issue's name comes back: tolerated here
        except Exception as exc:  # a harness finding: reported below, with its input
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} of {len(inputs)} inputs failed:\n" + "\n".join(
        failures[:20]
    )


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("clang") or shutil.which("cc")


@pytest.fixture(scope="module")
def replay_bins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _compiler() is None:
        pytest.skip("no C compiler (clang or cc) to build the native replay harnesses")
    out = tmp_path_factory.mktemp("fuzz-replay")
    r = subprocess.run(
        [str(ROOT / "native/fuzz/build.sh"), "--replay", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"build failed:\n{r.stdout}\n{r.stderr}"
    return out


def _replay(binary: Path, paths: list[Path]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = "abort_on_error=1:detect_leaks=1"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    # Each input on an engine of its own, shut down and destroyed after it:
    # the teardown then runs against what every single input left behind.
    env["AXF_FUZZ_RECYCLE"] = "1"
    return subprocess.run(
        [str(binary), *map(str, paths)], capture_output=True, text=True, timeout=600, env=env
    )


# Found by the initiator harness, fixed in conn.c (thread_exit drops the
# connection from the registry before its endpoint may be reaped): kept as a
# regression input in fuzz/findings/initiator_frames/.


@pytest.mark.parametrize(
    "harness",
    ["target_frames", "initiator_frames", "lone_frames"],
)
def test_native_corpus_replays(harness: str, replay_bins: Path, tmp_path: Path) -> None:
    inputs = _inputs(harness)
    assert len(inputs) >= 10, f"the {harness} corpus and seeds are missing"
    for name, data in inputs:
        (tmp_path / name).write_bytes(data)
    r = _replay(replay_bins / f"fuzz_{harness}", [tmp_path])
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr[-6000:]}"
    assert f"replayed {len(inputs)} inputs" in r.stdout, r.stdout


def test_native_uaf_finding_fixed(replay_bins: Path) -> None:
    found = sorted((FINDINGS / "initiator_frames").iterdir())
    assert found
    # A race with the engine's watcher thread: each round replays the input 20
    # times, each on a fresh engine (9 of 10 rounds hit it on main).
    for _ in range(5):
        r = _replay(replay_bins / "fuzz_initiator_frames", found * 20)
        assert r.returncode == 0, r.stderr[-3000:]


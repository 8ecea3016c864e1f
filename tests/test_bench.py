"""``aioxfer bench`` as a user runs it: tiny sweeps through the real command
(both transports, both ops, target in a child process and in this process), the
JSON it writes, the data check fed wrong bytes, and the target process dying
with its parent. No timed assertions: figures are checked for presence and
sanity, never for speed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aioxfer import bench, cli

RESULT_FIELDS = {
    "op", "transport", "path", "api", "size", "descs", "inflight", "bytes_per_request",
    "same_process", "pool_slots", "rounds", "requests", "seconds", "gbps", "requests_per_s",
    "descs_per_s", "latency_p50_us", "latency_p99_us", "cpu_initiator_s_per_gb",
    "cpu_target_s_per_gb", "rounds_gbps", "verify", "verified_segments", "verify_errors",
    "error",
}
MACHINE_FIELDS = {"hostname", "system", "machine", "cpus", "cpu_model", "mem_total_bytes",
                  "python", "numpy", "aioxfer", "loop", "same_process", "time_utc"}
# Tiny points: what is checked is that every figure is there and every byte lands.
TINY = ["--sizes", "4K,64K", "--descs", "1,16", "--reps", "6", "--rounds", "2"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "aioxfer", "bench", *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=os.path.dirname(__file__))


def check_doc(doc: dict[str, Any], *, ops: list[str], transports: list[str],
              same_process: bool, points: int) -> None:
    assert MACHINE_FIELDS <= set(doc["machine"]), doc["machine"]
    assert doc["failures"] == [] and doc["warnings"] == []
    results = doc["results"]
    assert len(results) == points
    assert {r["op"] for r in results} == set(ops)
    assert {r["transport"] for r in results} == set(transports)
    for r in results:
        assert set(r) == RESULT_FIELDS, set(r) ^ RESULT_FIELDS
        assert r["error"] is None
        assert r["path"] == r["transport"], r  # shm picked automatically, tcp forced
        assert r["same_process"] is same_process
        assert r["api"] == ("segment" if r["descs"] == 1 else "segmentlist")
        assert r["bytes_per_request"] == r["size"] * r["descs"]
        assert r["requests"] > 0 and r["seconds"] > 0
        for key in ("gbps", "requests_per_s", "descs_per_s", "latency_p50_us",
                    "latency_p99_us", "cpu_initiator_s_per_gb"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["latency_p99_us"] >= r["latency_p50_us"] > 0
        assert r["descs_per_s"] == pytest.approx(r["requests_per_s"] * r["descs"])
        if same_process:
            assert r["cpu_target_s_per_gb"] is None  # one process: not separable
        else:
            assert isinstance(r["cpu_target_s_per_gb"], float) and r["cpu_target_s_per_gb"] >= 0
        assert len(r["rounds_gbps"]) == r["rounds"]
        assert r["verify"] == "ok" and r["verify_errors"] == []
        assert r["verified_segments"] >= 1


def test_separate_processes_both_transports_both_ops(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = run("--op", "write,read", "--transport", "shm,tcp", "--inflight", "1,4", *TINY,
            "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["op", "transport", "path", "size"]
    assert "GB/s" in lines[0] and "p99 us" in lines[0] and "cpu-t s/GB" in lines[0]
    assert len(lines) == 1 + 32  # stdout is the table only: header and one row per point
    assert all(line.split()[-1] == "ok" for line in lines[1:])
    assert "[32/32]" in p.stderr  # progress on stderr (one line per point off a terminal)
    assert "verification: ok (32 points" in p.stderr
    doc = json.loads(out.read_text())
    check_doc(doc, ops=["write", "read"], transports=["shm", "tcp"], same_process=False,
              points=32)
    assert doc["machine"]["same_process"] is False
    # Every descriptor of every request in flight has a slot of its own.
    wide = [r for r in doc["results"] if r["descs"] == 16 and r["inflight"] == 4]
    assert all(r["pool_slots"] == 64 for r in wide)


def test_same_process_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--op", "write,read", "--transport", "shm,tcp", "--same-process",
                   "--sizes", "4K,1M", "--descs", "1,8", "--inflight", "2", "--duration", "0.02",
                   "--rounds", "1", "--no-progress", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    doc = json.loads(out.read_text())
    check_doc(doc, ops=["write", "read"], transports=["shm", "tcp"], same_process=True,
              points=16)
    assert doc["config"]["duration"] == 0.02 and doc["config"]["reps"] is None
    assert len(cap.out.splitlines()) == 17


def test_many_descriptors_one_request(tmp_path: Path) -> None:
    """A 100 000-descriptor request (SegmentList path) over a pool smaller than
    the request: descriptors wrap onto the same slots and still verify."""
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--transport", "shm", "--same-process", "--sizes", "64",
                   "--descs", "100000", "--reps", "2", "--rounds", "1", "--pool-size", "1M",
                   "--no-progress", "--json", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["verify"] == "ok" and r["descs"] == 100000 and r["pool_slots"] < 100000


def test_no_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--transport", "shm", "--same-process", "--sizes", "4K",
                   "--reps", "3", "--rounds", "1", "--no-verify", "--no-progress",
                   "--json", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["verify"] == "off" and r["verified_segments"] == 0
    assert "verification: off" in capsys.readouterr().err


def test_mismatch_fails_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A checksum mismatch is a failure: exit 1 and a clear message. The
    expectation is computed for another seed, so the (correct) destination
    bytes cannot match it."""
    real = bench.expected_digests
    monkeypatch.setattr(bench, "expected_digests",
                        lambda seed, offs, size: real(seed + 1, offs, size))
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--op", "write,read", "--transport", "shm", "--same-process",
                   "--sizes", "4K", "--reps", "2", "--rounds", "1", "--no-progress",
                   "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert cap.err.count("verification FAILED") == 2, cap.err
    assert "expected" in cap.err
    assert [line.split()[-1] for line in cap.out.splitlines()[1:]] == ["FAILED", "FAILED"]
    doc = json.loads(out.read_text())
    assert all(r["verify"] == "FAILED" and r["verify_errors"] for r in doc["results"])
    assert len(doc["failures"]) == 2


# ------------------------------------------------------------------ the check itself


def _copy_segments(lay: bench.Layout, seed: int) -> tuple[np.ndarray, list[int], list[int]]:
    """A destination pool as a correct transfer leaves it, and the sampled offsets."""
    k = np.arange(lay.slots)
    dst = np.zeros(lay.span, dtype=np.uint8)
    for s, d in zip(lay.src_offsets(k), lay.dst_offsets(k), strict=True):
        dst[int(d):int(d) + lay.size] = bench.pattern_bytes(seed, int(s), lay.size)
    sample = lay.sample(seed)
    return dst, [int(x) for x in lay.dst_offsets(sample)], [int(x) for x in lay.src_offsets(sample)]


def _verify(buf: np.ndarray, dst: list[int], src: list[int], size: int, seed: int) -> list[str]:
    got = bench.segment_digests(buf, dst, size)
    return bench.verify_digests(got, bench.expected_digests(seed, src, size), dst, src)


def test_verify_accepts_right_bytes_and_rejects_wrong_ones() -> None:
    seed, size = 99, 1000
    lay = bench.Layout.make(size, 8, 2, 1 << 20, seed=5)
    buf, dst, src = _copy_segments(lay, seed)
    assert len(dst) == 16
    assert _verify(buf, dst, src, size, seed) == []

    one = buf.copy()
    one[dst[3] + 517] ^= 0x01  # a single flipped bit
    errs = _verify(one, dst, src, size, seed)
    assert len(errs) == 1 and f"destination offset {dst[3]} " in errs[0]

    swapped = buf.copy()  # two segments landed in each other's slot
    a, b = dst[0], dst[1]
    swapped[a:a + size], swapped[b:b + size] = buf[b:b + size], buf[a:a + size]
    assert len(_verify(swapped, dst, src, size, seed)) == 2

    shifted = np.roll(buf, 8)  # every segment one word off
    assert len(_verify(shifted, dst, src, size, seed)) == len(dst)
    assert len(_verify(np.zeros_like(buf), dst, src, size, seed)) == len(dst)  # nothing landed
    assert len(_verify(buf, dst, src, size, seed + 1)) == len(dst)  # another run's data
    assert bench.verify_digests(["x"], [], [], []) != []  # a short answer is not a pass


def test_pattern_is_position_dependent() -> None:
    buf = np.empty(3 * 8192 + 5, dtype=np.uint8)
    bench.fill_pattern(buf, seed=7)
    for off, n in ((0, 100), (13, 4096), (8192, 8192), (len(buf) - 9, 9)):
        assert np.array_equal(buf[off:off + n], bench.pattern_bytes(7, off, n))
    # No two slots (nor one slot and another seed) hold the same bytes.
    assert not np.array_equal(bench.pattern_bytes(7, 0, 4096), bench.pattern_bytes(7, 8192, 4096))
    assert not np.array_equal(bench.pattern_bytes(7, 0, 4096), bench.pattern_bytes(8, 0, 4096))


@pytest.mark.parametrize("size,descs,inflight,pool", [
    (4096, 256, 4, 256 << 20), (1 << 20, 16, 1, 4 << 20), (64, 1000, 1, 16 << 10),
])
def test_layout_is_scattered_and_consistent(size: int, descs: int, inflight: int,
                                            pool: int) -> None:
    lay = bench.Layout.make(size, descs, inflight, pool, seed=3)
    assert lay.span <= max(pool, lay.pitch) and lay.pitch >= size + 64
    assert sorted(lay.src_slot.tolist()) == list(range(lay.slots))  # permutations
    assert sorted(lay.dst_slot.tolist()) == list(range(lay.slots))
    for t in range(lay.templates):
        k = lay.indices(t)
        for offs in (lay.src_offsets(k), lay.dst_offsets(k)):
            assert int(offs.max()) + size <= lay.span
            # Consecutive descriptors never touch: nothing can merge them.
            assert not np.any(offs[:-1] + np.uint64(size) == offs[1:])
            assert bool(np.all(offs % np.uint64(64) == 0))


def test_parse_size() -> None:
    assert [bench.parse_size(x) for x in ("4096", "4K", "4k", "4KiB", "64KB", "1M", "1G",
                                          "1.5K")] == [4096, 4096, 4096, 4096, 65536,
                                                       1 << 20, 1 << 30, 1536]
    for bad in ("", "4X", "0", "-1K", "0.3K", "inf", "K"):
        with pytest.raises(ValueError):
            bench.parse_size(bad)
    assert bench.format_size(65536) == "64K" and bench.format_size(1000) == "1000B"


@pytest.mark.parametrize("args", [
    ["--descs", "0"], ["--descs", "100001"], ["--inflight", "257"], ["--inflight", "x"],
    ["--sizes", "4X"], ["--op", "copy"], ["--transport", "carrier-pigeon"], ["--rounds", "0"],
    ["--reps", "0"], ["--duration", "0"], ["--reps", "3", "--duration", "1"],
])
def test_bad_arguments(args: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *args])
    assert e.value.code != 0


def test_missing_optional_extras(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--plot", str(tmp_path / "x.png")])
    assert "matplotlib" in str(e.value) and "aioxfer[plot]" in str(e.value)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--uvloop"])
    assert "uvloop" in str(e.value) and "not installed" in str(e.value)
    assert not (tmp_path / "x.png").exists()


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    rc = cli.main(["bench", "--op", "write,read", "--same-process", "--sizes", "4K,64K",
                   "--reps", "3", "--rounds", "1", "--no-progress", "--plot", str(png)])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_uvloop(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    out = tmp_path / "bench.json"
    p = run("--uvloop", "--transport", "shm", "--sizes", "4K", "--inflight", "4", "--reps", "8",
            "--rounds", "1", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["machine"]["loop"] == "uvloop"
    check_doc(doc, ops=["write"], transports=["shm"], same_process=False, points=1)


# ------------------------------------------------------------------ the target process


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_ORPHAN = """
import os, sys, time
from aioxfer import bench
parent = os.getpid()
pid = os.fork()
if pid == 0:
    bench._die_with_parent(parent)
    time.sleep(60)  # reads no pipe: only the kernel's death signal ends it early
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_parent_uses_the_kernel() -> None:
    """PR_SET_PDEATHSIG alone kills the child: a target blocked anywhere (not
    only in its pipe, whose EOF also ends it) goes when its parent goes."""
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE,
                              text=True, cwd=os.path.dirname(__file__))
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.3)  # past the prctl
        assert not _gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), f"child {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_target_dies_with_parent() -> None:
    """A bench killed with SIGKILL (no cleanup runs) leaves no target behind."""
    parent = subprocess.Popen(
        [sys.executable, "-m", "aioxfer", "bench", "--transport", "shm", "--sizes", "4K",
         "--duration", "60", "--rounds", "1", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=os.path.dirname(__file__))
    try:
        deadline = time.monotonic() + 60
        target = None
        while target is None and time.monotonic() < deadline:
            assert parent.poll() is None, "the bench exited early"
            for kid in _children(parent.pid):
                cmd = _cmdline(kid)
                if "multiprocessing" in cmd and "resource_tracker" not in cmd:
                    target = kid
            time.sleep(0.1)
        assert target is not None, "no target process appeared"
        time.sleep(0.5)  # let it get past its start (prctl) into serving
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while not _gone(target) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(target), f"target {target} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)

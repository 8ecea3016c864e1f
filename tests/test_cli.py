"""The command line: ``aioxfer info`` and ``aioxfer demo`` as a user runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from conftest import SAME_HOST

from aioxfer import cli


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "aioxfer", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=os.path.dirname(__file__))


def test_info() -> None:
    p = run("info", timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    import aioxfer

    assert f"aioxfer {aioxfer.__version__}" in out
    assert "shm" in out and "tcp" in out
    # Each optional transport says honestly whether it is there and why.
    for name, module in cli.OPTIONAL_TRANSPORTS:
        ok, why, _ = cli._optional_status(module)
        line = f"  {name:<7} {'available' if ok else 'unavailable'}: {why}"
        assert line in out.splitlines(), (line, out)
    exe = shutil.which("aioxfer")
    if exe is not None:  # the console script, when installed on PATH
        q = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=60)
        assert q.returncode == 0
        assert q.stdout[q.stdout.index("transports:"):] == out[out.index("transports:"):]


def test_info_hardware_section() -> None:
    """GPUs, NICs, RLIMIT_MEMLOCK and nvidia-peermem are reported; on a machine
    without them (CI, this one) it says so plainly."""
    from aioxfer import cuda, verbs

    p = run("info", timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "hardware:" in lines
    if not cuda.device_info():
        assert any(line.startswith("  GPUs:   none (") for line in lines), p.stdout
    if not verbs.nics():
        assert "  NICs:   none (no RDMA devices in /sys/class/infiniband)" in lines
    limit = verbs.memlock_limit()
    want = "unlimited" if limit is None else f"{limit // 1024} KiB"
    assert any(line.startswith(f"  RLIMIT_MEMLOCK: {want}") for line in lines), p.stdout
    assert any(line.startswith("  nvidia-peermem: ") for line in lines)


def test_sysfs_topology_parsed(tmp_path: Any) -> None:
    """NIC ports, link layers and GID tables (with types) from a sysfs tree;
    rails pair by link layer, never InfiniBand with Ethernet."""
    from aioxfer import verbs

    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    for i, (g, t) in enumerate([("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"),
                                ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
                                ("0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2"),
                                ("0000:0000:0000:0000:0000:0000:0000:0000", "")]):
        (port / "gids" / str(i)).write_text(g + "\n")
        (port / "gid_attrs" / "types" / str(i)).write_text(t + "\n")
    (nics,) = verbs.nics(str(tmp_path))
    assert nics.name == "mlx5_0" and nics.ports == {1: ("ACTIVE", "Ethernet")}
    assert [(g.index, g.type) for g in nics.gids[1]] == [(0, "IB/RoCE v1"), (1, "RoCE v2"),
                                                         (2, "RoCE v2")]
    ours = ["mlx5_0 (port 1, InfiniBand, mtu 4096, gid[0] ...)",
            "mlx5_1 (port 1, Ethernet, mtu 4096, gid[3] ...)"]
    theirs = ["mlx5_0 (port 1, Ethernet, mtu 4096, gid[3] ...)",
              "mlx5_1 (port 1, InfiniBand, mtu 4096, gid[0] ...)"]
    assert verbs.pair_rails(ours, theirs) == [(0, 1), (1, 0)]
    assert verbs.pair_rails(ours[:1], theirs[:1]) == []


def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    assert "transports" in capsys.readouterr().out
    assert cli.main([]) == 2  # no command: help
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    with pytest.raises(SystemExit):
        cli.main(["demo", "--transport", "carrier-pigeon"])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_demo_runs(transport: str) -> None:
    p = run("demo", "--requests", "4", "--pages", "16", "--transport", transport)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "verification: ok (4/4 requests, 64 pages" in out
    want = SAME_HOST if transport == "auto" else "tcp"
    assert f"transport: {want}" in out
    assert "p50" in out and "p99" in out and "GB/s" in out
    assert "verified 4/4" in p.stderr  # the progress bar


def test_demo_detects_corruption() -> None:
    """The verifier is not vacuous: two swapped pages make the demo fail."""
    p = run("demo", "--requests", "2", "--pages", "8", "--inject-corruption", "--no-progress")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verification: FAILED" in p.stdout
    assert "request 0: 2 of 8 pages differ" in p.stdout


def test_example_runs() -> None:
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "disagg_prefill_decode.py")
    p = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(__file__))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("pages ready") == 8
    assert f"prefill -> decode over {SAME_HOST}" in p.stdout

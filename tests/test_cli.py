"""The command line: ``aioxfer info`` and ``aioxfer demo`` as a user runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

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
    want = "shm" if transport == "auto" else "tcp"
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
    assert "prefill -> decode over shm" in p.stdout

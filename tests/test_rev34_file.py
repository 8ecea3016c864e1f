"""rev34: the file transport's registration (aioxfer.file_transport), with
real files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioxfer


@pytest.mark.parametrize("size", [True, False, 1.0, "4096"])
async def test_register_file_refuses_sizes_that_are_not_integers(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path, size: Any
) -> None:
    """size=True made a 1-byte file and a region whose nbytes was True."""
    agent = await make_agent("sizes")
    with pytest.raises(aioxfer.RegistrationError, match="size must be a positive int"):
        agent.register_file(tmp_path / "b.bin", size=size)
    assert not os.path.exists(tmp_path / "b.bin")
    assert not any(r.kind == "file" for r in agent.regions)


async def test_register_file_takes_numpy_integer_sizes(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """As alloc does (any operator.index): np.int64(4096) was refused."""
    agent = await make_agent("np-size")
    f = agent.register_file(tmp_path / "n.bin", size=np.int64(4096))
    assert f.nbytes == 4096 and type(f.nbytes) is int
    assert os.path.getsize(tmp_path / "n.bin") == 4096


THREADLESS_CHILD = r'''
import asyncio, os, resource, sys
import aioxfer


async def main(path):
    agent = aioxfer.Agent("threadless")
    await agent.start()
    f = agent.register_file(path, size=1 << 20)
    host = agent.alloc(1 << 20)
    # No new thread from here on (as root, RLIMIT_NPROC is not enforced).
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    for _ in range(2):  # and again: still typed, nothing half made
        try:
            await asyncio.wait_for(agent.write(host[0:4096], f[0:4096]), 10)
            print("RESULT ok")
        except aioxfer.XferError as exc:
            print("RESULT typed", type(exc).__name__, exc)
        except Exception as exc:
            print("RESULT untyped", type(exc).__name__, exc)
    await agent.aclose()
    print("CLOSED")


asyncio.run(main(sys.argv[1]))
'''


def test_file_transport_that_cannot_start_its_threads_fails_typed(tmp_path: Path) -> None:
    """file_transport.file_peer: the first file transfer makes the FILE
    endpoint, which starts the I/O threads; at the process's thread limit
    the engine's refusal escaped as a bare _cyx.NativeError."""
    if os.geteuid() != 0:
        pytest.skip("dropping to nobody under RLIMIT_NPROC needs root")
    script = tmp_path / "child.py"
    script.write_text(THREADLESS_CHILD)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "t.bin")],
                         capture_output=True, text=True, timeout=120)
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, out.stdout + out.stderr[-2000:]
    for line in results:
        assert line.startswith("RESULT typed"), out.stdout
        assert "cannot start the file transport" in line, line
    assert "CLOSED" in out.stdout, out.stdout + out.stderr[-2000:]

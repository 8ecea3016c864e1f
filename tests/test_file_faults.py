"""Faults around file regions, their descriptors and the host staging helpers,
each with real files and real processes: a file that shrinks or outgrows
RLIMIT_FSIZE under a transfer, bad sizes and slices from Python (typed errors
before anything native is touched), and a cancelled pread on a worker thread
that must not write into the caller's buffer after the cancellation returns."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, wait_until, within

import aioxfer
from aioxfer import _cyx
from aioxfer.staging import PosixFile

MiB = 1 << 20


@pytest.fixture(params=["threads", "uring"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "uring" and not _cyx.file_backend()[0]:
        pytest.skip(f"no io_uring here: {_cyx.file_backend()[1]}")
    monkeypatch.setenv("AIOXFER_FILE_IO", str(request.param))
    return str(request.param)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------- typed errors from Python


async def test_region_slices_of_non_integers_are_type_errors(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    agent = await make_agent("slices")
    host = agent.register(bytearray(4096))
    f = agent.register_file(tmp_path / "s.bin", size=4096)
    for region in (host, f):
        for bad in (slice(0.5, 8), slice(0, 8.0), slice("0", 8)):
            with pytest.raises(TypeError):
                region[bad]
        with pytest.raises(TypeError):
            region[0:4096][0:1.5]  # type: ignore[misc]
        assert region[np.uint64(8) : np.int32(16)].length == 8  # integers of any kind still do


@pytest.mark.parametrize("size", [1 << 63, 1 << 64, 1 << 80])
async def test_register_file_with_a_size_past_off_t_is_a_registration_error(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path, size: int
) -> None:
    agent = await make_agent("huge")
    before = open_fds()
    with pytest.raises(aioxfer.RegistrationError, match="size"):
        agent.register_file(tmp_path / "huge.bin", size=size)
    assert open_fds() == before  # and its fd is closed
    assert not any(r.kind == "file" for r in agent.regions)


@pytest.mark.parametrize("size", [-1, 1 << 64])
def test_posix_file_with_a_bad_size_leaks_no_fd(tmp_path: Path, size: int) -> None:
    before = open_fds()
    with pytest.raises((ValueError, OSError, OverflowError)):
        PosixFile(tmp_path / "p.bin", size=size)
    assert open_fds() == before


# --------------------------------------------------------------- the file changes under us


async def test_read_of_a_file_that_shrank_fails_typed_and_says_where(
    make_agent: Callable[..., Awaitable[Any]], backend: str, tmp_path: Path
) -> None:
    agent = await make_agent("shrink")
    path = tmp_path / "shrink.bin"
    f = agent.register_file(path, size=8 * MiB)
    src = agent.alloc(8 * MiB)
    src.numpy()[:] = pattern(8 * MiB, 3)
    await within(agent.write(src[:], f[:]))
    os.truncate(path, 3 * MiB + 100)  # shorter than the region now
    dst = agent.alloc(8 * MiB)
    # Two descriptors (not contiguous: never merged into one): the first inside
    # what is left, the second reaching past its end: the bytes are not there
    # (AccessDenied, bounds; was a bare TransportError).
    with pytest.raises(aioxfer.AccessDenied) as ei:
        await within(agent.read([dst[0:MiB], dst[2 * MiB:8 * MiB]], [f[0:MiB], f[MiB:7 * MiB]]))
    assert ei.value.fail_index == 1
    # Never a success with stale bytes: a read within what is left still works.
    await within(agent.read(dst[0:MiB], f[0:MiB]))
    assert np.array_equal(dst.numpy()[:MiB], src.numpy()[:MiB])


def test_write_past_rlimit_fsize_fails_typed_in_a_real_process(backend: str,
                                                               tmp_path: Path) -> None:
    """RLIMIT_FSIZE: the write meets EFBIG (Python ignores SIGXFSZ) on the engine's
    threads or io_uring's workers; the agent reports a TransportError, stays usable
    and the file holds what fitted."""
    code = textwrap.dedent(
        f"""
        import asyncio, os, resource
        import aioxfer
        MiB = 1 << 20
        async def main():
            async with aioxfer.Agent("fsize") as a:
                f = a.register_file({str(tmp_path / "big.bin")!r}, size=4 * MiB)
                os.truncate({str(tmp_path / "big.bin")!r}, 4096)  # the write extends it
                src = a.alloc(4 * MiB)
                resource.setrlimit(resource.RLIMIT_FSIZE, (MiB, resource.RLIM_INFINITY))
                try:
                    await asyncio.wait_for(a.write(src[:], f[:]), 30)
                except aioxfer.TransportError as exc:
                    print("typed", exc.fail_index)
                else:
                    print("succeeded")
                await asyncio.wait_for(a.write(src[0:4096], f[0:4096]), 30)
                print("size", os.path.getsize({str(tmp_path / "big.bin")!r}))
        asyncio.run(main())
        """
    )
    # From tmp_path, not the checkout's root: "-c" puts the working directory
    # first on sys.path, and the source tree's aioxfer has no built extension.
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "AIOXFER_FILE_IO": backend}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["typed", "0", "size", str(MiB)], r.stdout + r.stderr


# --------------------------------------------------------------- cancellation on worker threads


async def test_cancelled_posix_read_never_writes_after_the_cancel_returns(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """PosixFile's pread runs on a worker thread that cannot be interrupted: a
    cancelled read_into must not return (raise CancelledError) while that thread
    can still write into the caller's buffer, which the caller may reuse at once."""
    agent = await make_agent("posix")
    size = 256 * MiB
    pf = PosixFile(tmp_path / "sparse.bin", size=size)  # a hole: reads as zeros
    try:
        dst = agent.register(bytearray(size))
        view = dst.numpy()
        caught = 0
        for _ in range(5):
            view[:] = 0xFF
            task = asyncio.create_task(pf.read_into(dst[:], 0))
            await wait_until(lambda: view[0] == 0, what="the pread started")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            at_cancel = int(view[-1])
            await asyncio.sleep(0.3)  # time for a pread still running to finish
            caught += at_cancel != int(view[-1])
            assert int(view[-1]) == at_cancel, "the buffer changed after the cancel returned"
        assert not caught
        agent.deregister(dst)
    finally:
        pf.close()

"""rev34: staging.PosixFile, the file half of the GPU <-> file stager for files
the agent does not own (pread/pwrite on worker threads), with real files."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import mounted_tmpfs, within

import aioxfer
from aioxfer.staging import PosixFile

KiB = 1 << 10


@pytest.fixture
def one_worker() -> Iterator[tuple[concurrent.futures.ThreadPoolExecutor, threading.Event]]:
    """The loop's default executor with one worker, held busy until the event
    is set: a PosixFile call queued behind it has not begun its syscall."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    gate = threading.Event()
    pool.submit(gate.wait)
    try:
        yield pool, gate
    finally:
        gate.set()
        pool.shutdown(wait=True)


async def test_close_with_a_write_queued_never_writes_into_a_file_that_reused_the_fd(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path,
    one_worker: tuple[concurrent.futures.ThreadPoolExecutor, threading.Event],
) -> None:
    """PosixFile.close() closed the descriptor at once, while a write_from it
    had begun still waited for a worker thread: the file opened next got the
    same number, and the queued pwrite went into that file (another file's
    bytes overwritten). The descriptor now lives until its last call ends."""
    pool, gate = one_worker
    asyncio.get_running_loop().set_default_executor(pool)
    agent = await make_agent("posix-close")
    src = agent.register(bytearray(b"S" * (4 * KiB)))
    pf = PosixFile(tmp_path / "staged.bin", size=4 * KiB)
    task = asyncio.create_task(pf.write_from(src[0 : 4 * KiB], 0))
    await asyncio.sleep(0)  # queued behind the busy worker, its fd taken
    pf.close()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"v" * (4 * KiB))
    fd = os.open(victim, os.O_RDWR)  # the lowest free number: what pf had
    try:
        gate.set()
        try:
            await within(task)
        except aioxfer.ClosedResourceError:
            pass  # refused once closed: also fine, as long as nothing landed elsewhere
        assert victim.read_bytes() == b"v" * (4 * KiB), "the write landed in another file"
    finally:
        os.close(fd)
    with pytest.raises(aioxfer.ClosedResourceError):
        await pf.write_from(src[0 : 4 * KiB], 0)


async def test_a_full_filesystem_is_a_typed_transport_error(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """ENOSPC from pwrite escaped as a bare OSError (read_into's short file is
    a TransportError already): the stager's callers catch XferError."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    agent = await make_agent("posix-full")
    src = agent.alloc(2 << 20)
    with mounted_tmpfs(tmp_path / "full", "1m") as mnt:
        pf = PosixFile(mnt / "big.bin")
        try:
            with pytest.raises(aioxfer.TransportError, match="No space left"):
                await within(pf.write_from(src[0 : 2 << 20], 0))
        finally:
            pf.close()

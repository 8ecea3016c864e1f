"""rev34: staging.PosixFile, the file half of the GPU <-> file stager for files
the agent does not own (pread/pwrite on worker threads), with real files."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
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


STAGER_CHILD = r'''
import asyncio
import aioxfer
from aioxfer import cuda
from aioxfer.errors import ClosedResourceError
from aioxfer.staging import GpuFileStager, PosixFile

PAGE = 1 << 20


async def main(path):
    ok, why = cuda.status()
    if not ok:
        print("NOCUDA", why)
        return
    async with aioxfer.Agent("stager") as agent:
        buf = cuda.DeviceBuffer(PAGE)
        pf = PosixFile(path, size=PAGE)
        try:
            buf.upload(bytes(range(256)) * (PAGE // 256))
            gpu = agent.register(buf, name="kv")
            stager = GpuFileStager(agent, pf, slot_bytes=PAGE, slots=1)
            first = asyncio.ensure_future(stager.start())
            second = asyncio.ensure_future(stager.start())
            await asyncio.wait_for(second, 10)
            try:  # right after the second start() returned: ready
                r = await asyncio.wait_for(stager.gpu_to_file(gpu[0:PAGE], 0), 10)
                print("SECOND_READY", r.nbytes == PAGE)
            except Exception as exc:
                print("SECOND_READY", type(exc).__name__, exc)
            await asyncio.wait_for(first, 10)
            await stager.aclose()
            before = sorted(r.name for r in agent.regions)
            try:
                await stager.start()
                print("RESTART", "started")
            except ClosedResourceError:
                print("RESTART", "refused")
            print("NO_LEAK", sorted(r.name for r in agent.regions) == before)
            racing = GpuFileStager(agent, pf, slot_bytes=PAGE, slots=1)
            starting = asyncio.ensure_future(racing.start())
            await asyncio.sleep(0)  # its bounce buffer registered, connecting
            closing = asyncio.ensure_future(racing.aclose())
            outcomes = []
            for fut in (starting, closing):
                try:
                    await asyncio.wait_for(fut, 10)
                    outcomes.append("ok")
                except ClosedResourceError:
                    outcomes.append("closed")
                except Exception as exc:
                    outcomes.append(type(exc).__name__)
            print("RACE", ",".join(outcomes))
            print("RACE_NO_LEAK", sorted(r.name for r in agent.regions) == before)
            await agent.deregister(gpu)
        finally:
            pf.close()
            buf.close()


import sys
asyncio.run(main(sys.argv[1]))
'''


def test_stager_start_is_ready_when_it_returns_and_refused_after_close(
    tmp_path: Path, fakecuda: Path
) -> None:
    """GpuFileStager.start(): a second concurrent start() returned before the
    first had connected (the moves after it failed: "start() first"); a
    start() after aclose() registered a new bounce buffer that nothing
    released (pinned until the agent closed); an aclose() while start()
    connected made that start() fail with AttributeError. On the software
    CUDA driver, in a fresh process."""
    script = tmp_path / "child.py"
    script.write_text(STAGER_CHILD)
    env = dict(os.environ, AIOXFER_CUDA_DRIVER=str(fakecuda))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "f.bin")], env=env,
                         capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "NOCUDA" not in lines, out.stdout
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert lines.get("SECOND_READY") == "True", out.stdout
    assert lines.get("RESTART") == "refused", out.stdout
    assert lines.get("NO_LEAK") == "True", out.stdout
    # aclose() while start() connects: start raised AttributeError (it
    # deregistered None: aclose had taken its bounce buffer)
    assert lines.get("RACE") in ("ok,ok", "closed,ok"), out.stdout
    assert lines.get("RACE_NO_LEAK") == "True", out.stdout


@pytest.mark.parametrize("offset", [-8192, -4096])
async def test_file_region_side_refuses_negative_offsets(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path, offset: int
) -> None:
    """FileRegion (the stager's file half over a file region) sliced the region
    with the offset: -8192 wrote the page at the region's end, silently (a
    PosixFile refuses it: pwrite's EINVAL)."""
    from aioxfer.staging import FileRegion

    agent = await make_agent("neg")
    path = tmp_path / "r.bin"
    side = FileRegion(agent.register_file(path, size=16 * KiB))
    src = agent.register(bytearray(b"P" * (4 * KiB)))
    with pytest.raises(ValueError, match="negative"):
        await within(side.write_from(src[0 : 4 * KiB], offset))
    with pytest.raises(ValueError, match="negative"):
        await within(side.read_into(src[0 : 4 * KiB], offset))
    assert path.read_bytes() == bytes(16 * KiB)
    pf = PosixFile(path)
    try:
        with pytest.raises(ValueError, match="negative"):
            await within(pf.write_from(src[0 : 4 * KiB], offset))
    finally:
        pf.close()


async def test_posix_read_into_read_only_memory_is_access_denied(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """As agent.read into a read-only region (AccessDenied); a BufferError
    from the worker thread escaped."""
    agent = await make_agent("posix-ro")
    ro = agent.register(bytes(4 * KiB))
    pf = PosixFile(tmp_path / "ro.bin", size=4 * KiB)
    try:
        with pytest.raises(aioxfer.AccessDenied, match="read-only"):
            await within(pf.read_into(ro[0 : 4 * KiB], 0))
    finally:
        pf.close()

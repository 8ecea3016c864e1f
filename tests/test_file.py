"""The file transport through the public API: Agent.register_file, writes and
reads between host memory and file regions, over both I/O backends (io_uring
where the kernel allows it, and the pread/pwrite thread pool forced with
AIOXFER_FILE_IO=threads)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, wait_until, within

import aioxfer
from aioxfer import _cyx, file_transport
from aioxfer.region import Segment

MiB = 1 << 20


@pytest.fixture(params=["auto", "threads", "uring"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The I/O backends agents made in this test use (read when an engine makes
    its first file endpoint): by default io_uring for O_DIRECT regions and the
    thread pool for buffered ones; "threads" or "uring" for everything."""
    if request.param == "auto":
        monkeypatch.delenv("AIOXFER_FILE_IO", raising=False)
    else:
        if request.param == "uring" and not _cyx.file_backend()[0]:
            pytest.skip(f"no io_uring here: {_cyx.file_backend()[1]}")
        monkeypatch.setenv("AIOXFER_FILE_IO", str(request.param))
    return str(request.param)


@pytest.fixture
async def agent(make_agent: Callable[..., Awaitable[Any]], backend: str) -> AsyncIterator[Any]:
    yield await make_agent("files")


def check_backend(agent: Any, backend: str) -> None:
    used, line = agent._engine.file_backend()
    if backend == "threads":
        assert (used, line) == (0, "thread pool: forced by AIOXFER_FILE_IO=threads")
    elif backend == "uring":
        assert used == 1 and line.endswith("for all file I/O (AIOXFER_FILE_IO=uring)"), line
    else:
        assert used == int(_cyx.file_backend()[0]), line


def file_bytes(path: Path | str, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


# --------------------------------------------------------------- status, registration


def test_status() -> None:
    ok, line = file_transport.status()
    assert ok is True
    uring, probe = _cyx.file_backend()
    assert line == probe
    # io_uring through the kernel interface itself (no liburing), wherever the
    # kernel allows it
    want = "io_uring (kernel interface) " if uring else "thread pool: "
    assert line.startswith(want), line
    assert file_transport.devices() == []


async def test_register_file(agent: Any, tmp_path: Path) -> None:
    p = tmp_path / "new.bin"
    r = agent.register_file(p, size=3 * MiB, name="kv-ssd")
    assert p.stat().st_size == 3 * MiB  # created and grown
    assert (r.kind, r.nbytes, r.name, r.obj, r.direct) == ("file", 3 * MiB, "kv-ssd", str(p), False)
    assert r.writable and "kind=file" in repr(r)
    assert agent.region("kv-ssd") is r
    with pytest.raises(TypeError, match="no host bytes"):
        r.memoryview  # noqa: B018
    host = agent.register(bytearray(4096), name="host")
    # File regions are this agent's alone: never in the metadata peers fetch.
    assert [m.name for m in agent._localmeta.meta().regions] == ["host"]

    q = tmp_path / "existing.bin"
    q.write_bytes(b"x" * 5000)
    r2 = agent.register_file(q)  # size=None: its current size
    assert r2.nbytes == 5000
    r3 = agent.register_file(q, size=8192)  # grown, what was there kept
    assert q.stat().st_size == 8192 and file_bytes(q, 0, 5000) == b"x" * 5000
    assert r3.nbytes == 8192
    r4 = agent.register_file(q, size=100)  # the first bytes only; never shrinks the file
    assert r4.nbytes == 100 and q.stat().st_size == 8192

    (tmp_path / "empty.bin").touch()
    with pytest.raises(aioxfer.RegistrationError, match="empty"):
        agent.register_file(tmp_path / "empty.bin")
    with pytest.raises(aioxfer.RegistrationError, match="not a regular file"):
        agent.register_file("/dev/null")
    with pytest.raises(aioxfer.RegistrationError):
        agent.register_file(tmp_path)  # a directory
    with pytest.raises(aioxfer.RegistrationError, match="size"):
        agent.register_file(tmp_path / "zero.bin", size=0)
    with pytest.raises(aioxfer.RegistrationError, match="already has a region"):
        agent.register_file(p, name="kv-ssd")
    for region in (r, r2, r3, r4, host):
        agent.deregister(region)
    await wait_until(lambda: agent.statistics().native_regions == 0, what="regions freed")


# --------------------------------------------------------------- data


async def test_round_trip_scattered(agent: Any, backend: str, tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    f = agent.register_file(path, size=16 * MiB)
    src = agent.alloc(8 * MiB)
    src.numpy()[:] = pattern(8 * MiB, 1)
    dst = agent.register(bytearray(8 * MiB))
    # (host offset, file offset, length): small, odd, several chunks long, the file's end.
    spans = [
        (0, 7 * 4096, 4096),
        (100, 1, 333),
        (65536, 2 * MiB, 3 * MiB + 17),
        (6 * MiB, 14 * MiB, MiB),
        (8 * MiB - 10, 16 * MiB - 10, 10),
    ]
    total = sum(n for _, _, n in spans)
    res = await within(agent.write([src[h:h + n] for h, _, n in spans],
                                   [f[o:o + n] for _, o, n in spans]))
    assert (res.nbytes, res.path) == (total, "file")
    check_backend(agent, backend)
    want = src.memoryview
    for h, o, n in spans:
        assert file_bytes(path, o, n) == want[h:h + n]
    res = await within(agent.read([dst[h:h + n] for h, _, n in spans],
                                  [f[o:o + n] for _, o, n in spans]))
    assert (res.nbytes, res.path) == (total, "file")
    got = dst.memoryview
    for h, _, n in spans:
        assert got[h:h + n] == want[h:h + n]
    # One segment each way.
    await within(agent.write(src[0:MiB], f[5 * MiB:6 * MiB]))
    await within(agent.read(dst[MiB:2 * MiB], f[5 * MiB:6 * MiB]))
    assert got[MiB:2 * MiB] == want[0:MiB]
    # One transfer over two files.
    g = agent.register_file(tmp_path / "other.bin", size=MiB)
    await within(agent.write([src[0:4096], src[4096:8192]], [g[0:4096], f[0:4096]]))
    assert file_bytes(g.obj, 0, 4096) == want[0:4096]
    assert file_bytes(path, 0, 4096) == want[4096:8192]
    s = agent.statistics()
    assert s.peers == 0 and s.transfers_completed == 5  # the file endpoint is not a peer


async def test_segment_list_batch(agent: Any, backend: str, tmp_path: Path) -> None:
    n, size = 10_000, 4096
    path = tmp_path / "batch.bin"
    f = agent.register_file(path, size=n * size)
    src = agent.alloc(n * size)
    src.numpy()[:] = pattern(n * size, 2)
    dst = agent.alloc(n * size)
    perm = np.random.default_rng(3).permutation(n).astype(np.uint64)
    host_offs = np.arange(n, dtype=np.uint64) * size
    lens = np.full(n, size, dtype=np.uint64)
    res = await within(agent.write(src.segments(host_offs, lens), f.segments(perm * size, lens)))
    assert (res.nbytes, res.path) == (n * size, "file")
    check_backend(agent, backend)
    on_disk = np.fromfile(path, dtype=np.uint8).reshape(n, size)
    assert np.array_equal(on_disk[perm], src.numpy().reshape(n, size))
    # Back in another order: host block i <- file block (n - 1 - i).
    rev = np.arange(n - 1, -1, -1, dtype=np.uint64) * size
    res = await within(agent.read(dst.segments(host_offs, lens), f.segments(rev, lens)))
    assert res.nbytes == n * size
    assert np.array_equal(dst.numpy().reshape(n, size), on_disk[::-1])


async def test_access_denied(agent: Any, tmp_path: Path) -> None:
    f = agent.register_file(tmp_path / "acl.bin", size=MiB)
    host = agent.alloc(MiB)
    await within(agent.write(host[0:4096], f[0:4096]))
    # The engine checks bounds and keys itself: get past the Python checks.
    past_end = Segment(f, MiB - 100, 4096)
    with pytest.raises(aioxfer.AccessDenied, match="rejected"):
        # Refused at post, as for a peer's imported region: nothing moved.
        await within(agent.write([host[0:4096], host[4096:8192]], [f[8192:12288], past_end]))
    assert file_bytes(f.obj, 8192, 4096) == bytes(4096)
    f.key ^= 1
    with pytest.raises(aioxfer.AccessDenied):
        await within(agent.read(host[0:4096], f[0:4096]))
    f.key ^= 1
    agent.deregister(f)
    with pytest.raises(aioxfer.ClosedResourceError):
        agent.write(host[0:4096], f[0:4096])
    g = agent.register_file(tmp_path / "acl2.bin", size=MiB)
    await within(agent.read(host[0:4096], g[0:4096]))  # still usable


async def test_misuse(agent: Any, tmp_path: Path) -> None:
    f = agent.register_file(tmp_path / "m.bin", size=MiB)
    host = agent.alloc(MiB)
    with pytest.raises(ValueError, match="notify"):
        agent.write(host[0:4096], f[0:4096], notify=b"x")
    with pytest.raises(TypeError, match="local host memory"):
        agent.write(host[0:4096], host[4096:8192])
    with pytest.raises(TypeError, match="file region"):
        agent.write(f[0:4096], f[4096:8192])
    with pytest.raises(ValueError, match="length"):
        agent.write(host[0:4096], f[0:8192])
    b = await make_other(agent)
    with pytest.raises(ValueError, match="another agent"):
        agent.write(b.alloc(4096)[0:4096], f[0:4096])
    await b.aclose()


async def make_other(agent: Any) -> Any:
    other = aioxfer.Agent("other")
    await other.start()
    return other


# --------------------------------------------------------------- O_DIRECT


@pytest.fixture
def direct_dir() -> Iterator[Path]:
    """A directory on a filesystem that takes O_DIRECT (tmpfs may not)."""
    for base in ("/var/tmp", None):
        try:
            d = Path(tempfile.mkdtemp(prefix="aioxfer-direct-", dir=base))
        except OSError:
            continue
        probe = d / "probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.close(fd)
        except OSError:
            shutil.rmtree(d, ignore_errors=True)
            continue
        yield d
        shutil.rmtree(d, ignore_errors=True)
        return
    pytest.skip("no filesystem here takes O_DIRECT (/var/tmp, the temp dir)")


async def test_direct(agent: Any, backend: str, direct_dir: Path) -> None:
    path = direct_dir / "direct.bin"
    f = agent.register_file(path, size=8 * MiB, direct=True)
    assert f.direct
    src = agent.alloc(4 * MiB)  # page aligned
    src.numpy()[:] = pattern(4 * MiB, 4)
    dst = agent.alloc(4 * MiB)
    await within(agent.write([src[0:4096], src[MiB:3 * MiB]], [f[8192:12288], f[4 * MiB:6 * MiB]]))
    check_backend(agent, backend)
    assert file_bytes(path, 4 * MiB, 2 * MiB) == src.memoryview[MiB:3 * MiB]
    await within(agent.read([dst[0:4096], dst[MiB:3 * MiB]], [f[8192:12288], f[4 * MiB:6 * MiB]]))
    assert dst.memoryview[0:4096] == src.memoryview[0:4096]
    assert dst.memoryview[MiB:3 * MiB] == src.memoryview[MiB:3 * MiB]
    # Misaligned file offset, host address, length: refused before anything moves.
    for bad_src, bad_dst, idx in [
        ([src[0:4096], src[0:4096]], [f[0:4096], f[100:4196]], 1),
        ([src[8:4104]], [f[0:4096]], 0),
        ([src[0:4096], src[0:4096], src[0:5000]], [f[0:4096], f[0:4096], f[0:5000]], 2),
    ]:
        with pytest.raises(aioxfer.XferError) as ei:
            agent.write(bad_src, bad_dst)
        assert (ei.value.status, ei.value.fail_index) == (_cyx.E_INVALID, idx)
    lens = np.full(3, 4096, dtype=np.uint64)
    with pytest.raises(aioxfer.XferError) as ei:
        agent.read(dst.segments([0, 4096, 8192], lens), f.segments([0, 4096, 8192 + 512], lens))
    assert ei.value.fail_index == 2
    # The engine refuses it on its own too (an 8-byte misaligned host address).
    peer = file_transport.file_peer(agent)
    descs = np.array([[src.rid, 8, f.rid, f.key, 0, 4096]], dtype=np.uint64)
    assert agent._engine.post(peer._ep, _cyx.OP_WRITE, descs, None, 1 << 60) == _cyx.E_INVALID
    assert file_bytes(path, 0, 4096) == bytes(4096)


# --------------------------------------------------------------- lifetime and faults


async def test_deregister_in_flight(agent: Any, backend: str, tmp_path: Path) -> None:
    path = tmp_path / "dereg.bin"
    n, size = 2048, 16384
    f = agent.register_file(path, size=n * size)
    src = agent.alloc(n * size)
    src.numpy()[:] = pattern(n * size, 5)
    offs = np.arange(n, dtype=np.uint64)[::-1].copy() * size  # nothing coalesces
    lens = np.full(n, size, dtype=np.uint64)
    host = src.segments(np.arange(n, dtype=np.uint64) * size, lens)
    t = agent.write(host, f.segments(offs, lens))
    agent._sub.post_pending()  # in the engine now
    agent.deregister(f)  # the transfer holds the region: it finishes
    res = await within(t)
    assert res.nbytes == n * size
    on_disk = np.fromfile(path, dtype=np.uint8).reshape(n, size)
    assert np.array_equal(on_disk[::-1], src.numpy().reshape(n, size))
    await wait_until(lambda: agent.statistics().native_regions == 1, what="file region freed")


async def test_cancel(agent: Any, backend: str, tmp_path: Path) -> None:
    n, size = 10_000, 4096
    f = agent.register_file(tmp_path / "cancel.bin", size=n * size)
    src = agent.alloc(n * size)
    offs = np.arange(n, dtype=np.uint64)[::-1].copy() * size
    lens = np.full(n, size, dtype=np.uint64)
    host = src.segments(np.arange(n, dtype=np.uint64) * size, lens)
    t = agent.write(host, f.segments(offs, lens))
    agent._sub.post_pending()
    assert t._posted
    # Not done yet as far as the loop knows (nothing drained since the post).
    assert t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    # The engine confirms (cancelled, or finished first) and releases the memory.
    await wait_until(lambda: agent.statistics().in_flight == 0, what="cancel confirmed")
    assert agent.statistics().native_ops == 0
    await within(agent.write(src[0:4096], f[0:4096]))


async def test_close_with_transfers_in_flight(
    make_agent: Any, backend: str, tmp_path: Path
) -> None:
    n, size = 10_000, 4096
    offs = np.arange(n, dtype=np.uint64)[::-1].copy() * size
    lens = np.full(n, size, dtype=np.uint64)
    # 40 000 writes take far longer than a close, but a loaded machine can
    # stall the closing coroutine until the engine has finished them all:
    # a few fresh agents, and at least one close must catch writes in flight.
    caught = 0
    for attempt in range(4):
        a = await make_agent(f"closing{attempt}")
        f = a.register_file(tmp_path / f"close{attempt}.bin", size=n * size)
        src = a.alloc(n * size)
        ts = [a.write(src.segments(np.arange(n, dtype=np.uint64) * size, lens),
                      f.segments(offs, lens))
              for _ in range(4)]
        a._sub.post_pending()
        await within(a.aclose())
        results = await asyncio.gather(*ts, return_exceptions=True)
        # Those the engine had not finished fail as closed; none hangs or leaks.
        for r in results:
            assert isinstance(r, aioxfer.ClosedResourceError) or r.nbytes == n * size, r
        caught += any(isinstance(r, aioxfer.ClosedResourceError) for r in results)
        if caught:
            break
    assert caught, "every close came after all the writes had finished"


async def test_io_error_is_typed(agent: Any, backend: str, small_tmpfs: Path,
                                 tmp_path: Path) -> None:
    f = agent.register_file(small_tmpfs / "big.bin", size=4 * MiB)  # sparse: fits until written
    src = agent.alloc(4 * MiB)
    with pytest.raises(aioxfer.TransportError) as ei:
        await within(agent.write(src[0:4 * MiB], f[0:4 * MiB]))
    assert ei.value.fail_index == 0 and "file region" in str(ei.value)
    check_backend(agent, backend)
    # The agent stays usable, the full filesystem too for what fits.
    g = agent.register_file(tmp_path / "ok.bin", size=MiB)
    await within(agent.write(src[0:MiB], g[0:MiB]))
    await within(agent.read(src[0:4096], f[0:4096]))


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    """A 4 MiB loop block device over a file (root only)."""
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("loop devices need root and losetup")
    img = tmp_path / "disk.img"
    with open(img, "wb") as f:
        f.truncate(4 * MiB)
    r = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot attach a loop device here: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@pytest.mark.parametrize("direct", [False, True])
async def test_block_device(agent: Any, loop_device: str, direct: bool) -> None:
    with pytest.raises(aioxfer.RegistrationError, match="the device has"):
        agent.register_file(loop_device, size=8 * MiB)
    dev = agent.register_file(loop_device, direct=direct)
    assert (dev.nbytes, dev.kind, dev.direct) == (4 * MiB, "file", direct)
    src = agent.alloc(MiB)
    src.numpy()[:] = pattern(MiB, 6)
    dst = agent.alloc(MiB)
    on_dev = [dev[0:4096], dev[3 * MiB:4 * MiB - 8192]]
    await within(agent.write([src[0:4096], src[8192:MiB]], on_dev))
    await within(agent.read([dst[0:4096], dst[8192:MiB]], on_dev))
    want = src.memoryview.tobytes()
    assert dst.memoryview == want[0:4096] + bytes(4096) + want[8192:MiB]
    agent.deregister(dev)
    await wait_until(lambda: agent.statistics().native_regions == 2, what="device region freed")

"""shm32: a fresh pool memfd collapsed into shmem huge pages by its owner
(_cyx.shm_make_huge, shm.c axf_shm_make_huge: MADV_COLLAPSE, which the
kernel honours at any shmem_enabled but ``deny``), so that a same-host peer
populates its mapping with one PMD entry per 2 MiB, not 512 PTEs (on its
own thread: starting a second one cost more than the populate).

What must hold: every whole 2 MiB of a fresh memfd becomes one huge page
that a peer's import maps by PMD, whole; the file stays all zeros and
takes a peer's writes; the tail below 2 MiB is left a hole; a memfd that
already holds data, one under 2 MiB, or a pool above $AIOXFER_SHM_LAZY_MIN
is left exactly as it was (nothing copied, nothing allocated); a file
shorter than asked or not a regular file is refused. And a pool whose
first 2 MiB is huge but whose other ranges are small pages (a tail, a THP
fallback) is still mapped whole at import (shm.c pop_huge; before, the
2 MiB stride measured on its head left those ranges to the first writes).
Checked from /proc/self/smaps (the importer's mapping) and fstat's block
count.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from test_cyx import close_engine, descs, wait_xfer

from aioxfer import _cyx

MiB = 1 << 20
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _kernel_collapses() -> str | None:
    """Why MADV_COLLAPSE cannot make shmem huge pages here, or None."""
    if os.uname().sysname != "Linux":
        return "not Linux"
    try:
        with open(THP_SYSFS) as f:
            mode = f.read()
    except OSError:
        return "no shmem THP in this kernel"
    if "[deny]" in mode:
        return "shmem_enabled is deny"
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (6, 1):
        return "MADV_COLLAPSE needs Linux 6.1"
    return None


needs_collapse = pytest.mark.skipif(_kernel_collapses() is not None,
                                    reason=str(_kernel_collapses()))


def _memfd(size: int, label: str = "axf-shm32") -> int:
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _smaps(label: str) -> Iterator[dict[str, Any]]:
    """This process's mappings of /memfd:label: start address and fields (kB)."""
    cur: dict[str, Any] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0] and len(head) >= 5:
                if cur is not None:
                    yield cur
                cur = None
                if len(head) >= 6 and head[5] == f"/memfd:{label}":
                    cur = {"start": int(head[0].split("-")[0], 16)}
            elif cur is not None and len(head) >= 2 and head[0].endswith(":") \
                    and head[1].isdigit():
                cur[head[0][:-1]] = int(head[1])
    if cur is not None:
        yield cur


@needs_collapse
def test_fresh_pool_is_mapped_by_pmd_on_import() -> None:
    size = 64 * MiB  # (from 32 MiB a pool of small pages is populated by 2 threads)
    fd = _memfd(size, "axf-shm32-pmd")
    a = _cyx.Engine()
    b = _cyx.Engine()
    pool = None
    try:
        assert _cyx.shm_make_huge(fd, size) is True
        assert os.fstat(fd).st_blocks * 512 == size  # allocated whole, now
        pool = mmap.mmap(fd, size)  # the owner's mapping: not touched here
        prid, pkey, paddr, plen, pacc = b.register(pool, memfd=fd)
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        a.endpoint_import(ep, prid, pkey, plen, pacc, paddr, fd)
        maps = list(_smaps("axf-shm32-pmd"))
        imported = [m for m in maps if m.get("ShmemPmdMapped")]
        # The importer's mapping: 2 MiB-aligned, every page mapped by PMD.
        assert len(imported) == 1, maps
        assert imported[0]["start"] % (2 * MiB) == 0
        assert imported[0]["ShmemPmdMapped"] == size // 1024
        assert imported[0]["Rss"] == size // 1024
        # Zeros, and it takes the peer's writes (seen through the owner's mapping).
        assert pool[:] == bytes(size)
        src = bytearray(os.urandom(size))
        srid = a.register(src)[0]
        rows = [(srid, 0, prid, pkey, 0, size)]
        assert a.post(ep, _cyx.OP_WRITE, descs(rows), None, 1) == _cyx.OK
        assert wait_xfer(a, 1)[1] == _cyx.OK
        assert pool[:] == src
    finally:
        close_engine(a)
        close_engine(b)
        if pool is not None:
            pool.close()
        os.close(fd)


@needs_collapse
def test_tail_below_2mib_stays_a_hole() -> None:
    size = 4 * MiB + 12 * 1024
    fd = _memfd(size)
    try:
        assert _cyx.shm_make_huge(fd, size) is True
        assert os.fstat(fd).st_blocks * 512 == 4 * MiB
        assert os.pread(fd, size, 0) == bytes(size)
    finally:
        os.close(fd)


def test_pool_with_data_is_left_as_it_was() -> None:
    size = 4 * MiB
    fd = _memfd(size)
    try:
        os.pwrite(fd, b"owner's", 3 * MiB + 5)
        blocks = os.fstat(fd).st_blocks
        assert _cyx.shm_make_huge(fd, size) is False
        assert os.fstat(fd).st_blocks == blocks
        data = os.pread(fd, size, 0)
        assert data[3 * MiB + 5:3 * MiB + 12] == b"owner's"
        assert data.count(0) == size - len(b"owner's")
    finally:
        os.close(fd)


def test_small_pool_is_left_alone() -> None:
    fd = _memfd(2 * MiB - 4096)
    try:
        assert _cyx.shm_make_huge(fd, 2 * MiB - 4096) is False
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(fd)


def test_refuses_a_short_file_or_not_a_file() -> None:
    fd = _memfd(4 * MiB)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="cannot make fd"):
            _cyx.shm_make_huge(fd, 4 * MiB + 4096)
        with pytest.raises(ValueError, match="cannot make fd"):
            _cyx.shm_make_huge(r, 4 * MiB)
        assert os.fstat(fd).st_blocks == 0
    finally:
        for x in (fd, r, w):
            os.close(x)


@needs_collapse
def test_pool_above_lazy_min_is_left_alone() -> None:
    """Above $AIOXFER_SHM_LAZY_MIN peers populate behind, not inside connect:
    collapsing would commit the whole pool at alloc for nothing."""
    code = (
        "import os, fcntl\n"
        "from aioxfer import _cyx\n"
        "e = _cyx.Engine()\n"  # reads the environment's snapshot
        "fd = os.memfd_create('x', os.MFD_ALLOW_SEALING)\n"
        "os.ftruncate(fd, 4 << 20)\n"
        "print(_cyx.shm_make_huge(fd, 4 << 20), os.fstat(fd).st_blocks)\n"
        "e.shutdown(); e.poll(); e.close()\n"
    )
    env = dict(os.environ, AIOXFER_SHM_LAZY_MIN=str(4 * MiB - 1))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd="/",  # the installed aioxfer, not the checkout (CI: not editable)
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0"]
    env["AIOXFER_SHM_LAZY_MIN"] = str(4 * MiB)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd="/",  # the installed aioxfer, not the checkout (CI: not editable)
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(4 * MiB // 512)]


@needs_collapse
@pytest.mark.parametrize("tail", [MiB + 12 * 1024, 2 * MiB])
def test_huge_head_small_tail_mapped_whole(tail: int) -> None:
    """A pool whose first 2 MiB is a huge page and the rest small pages (a
    tail below 2 MiB; a 2 MiB range written before the collapse, as where
    THP fell back) is mapped whole at import: the populate's 2 MiB stride,
    measured on the huge head, would leave all but one fault-around window
    of each small range to the first writes' page faults."""
    size = 2 * MiB + tail
    fd = _memfd(size, "axf-shm32-mixed")
    a = _cyx.Engine()
    b = _cyx.Engine()
    pool = None
    try:
        # (2 MiB of tail: only the head collapsed, the rest written after)
        assert _cyx.shm_make_huge(fd, size if tail < 2 * MiB else 2 * MiB) is True
        os.pwrite(fd, b"\x5a" * tail, 2 * MiB)  # small pages, all data
        assert os.fstat(fd).st_blocks * 512 == size
        pool = mmap.mmap(fd, size)
        prid, pkey, paddr, plen, pacc = b.register(pool, memfd=fd)
        ep = a.endpoint_create(_cyx.EP_SHM, 3, os.getpid())
        a.endpoint_import(ep, prid, pkey, plen, pacc, paddr, fd)
        imported = [m for m in _smaps("axf-shm32-mixed") if m.get("ShmemPmdMapped")]
        assert len(imported) == 1
        assert imported[0]["ShmemPmdMapped"] == 2 * MiB // 1024
        assert imported[0]["Rss"] == size // 1024
    finally:
        close_engine(a)
        close_engine(b)
        if pool is not None:
            pool.close()
        os.close(fd)

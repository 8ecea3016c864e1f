"""shm24: agent.alloc pools as shmem transparent huge pages, mapped by PMD.

Where the host allows shmem THP for advised mappings
(/sys/kernel/mm/transparent_hugepage/shmem_enabled ``advise``, or
``always``/``within_size``), ``agent.alloc`` advises its pool MADV_HUGEPAGE
before its first touch (registration.py _advise_huge) and a same-host peer
maps it at a 2 MiB-aligned address (shm.c map_shared), so populating the
peer's mapping sets one PMD entry per 2 MiB instead of 512 PTEs (a 64 MiB
pool: ~30 us instead of 2.5-10 ms on this VM). At the default ``never`` the
pool is collapsed into huge pages at alloc instead (shm32: MADV_COLLAPSE,
Linux 6.1+, refused only at ``deny``); the huge-page test skips only where
neither can give them (it does not flip sysfs: other processes share the
host).

The security claim it leans on is checked under any setting: shmem THP is
not hugetlbfs (which map_fd refuses: tests/test_rev20_hugetlb.py). A hole its
owner punches in a mapped pool, inside a huge page (which the kernel splits)
or a whole 2 MiB of one, reads back as zeros on the peer and takes its
writes: no SIGBUS. The initiator is the child process, so a SIGBUS would end
it and fail the test rather than the test run.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
from typing import Any

import numpy as np
import pytest
from conftest import PipeChild, pattern, within

MiB = 1 << 20
POOL = 8 * MiB
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_thp_mode() -> str:
    """The bracketed value of shmem_enabled, or why there is none."""
    try:
        with open(THP_SYSFS) as f:
            text = f.read()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def thp_allowed() -> bool:
    """Whether agent.alloc's pools get huge pages on this host: advised
    (shmem_enabled advise and up) or collapsed (MADV_COLLAPSE, Linux 6.1+,
    any setting but deny)."""
    if shmem_thp_mode() in ("always", "within_size", "advise", "force"):
        return True
    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    return shmem_thp_mode() == "never" and release >= (6, 1)


def smaps_of(addr: int) -> dict[str, Any]:
    """This process's /proc/self/smaps fields (kB) of the mapping holding addr,
    with its start address and name."""
    out: dict[str, Any] = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                if out:
                    return out
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if lo <= addr < hi:
                    out = {"start": lo, "end": hi, "name": " ".join(head[5:])}
            elif out and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
                out[head[0][:-1]] = int(head[1])
    return out


def initiator_main(conn: Any) -> None:
    """The peer that maps the pool: connects, then reads, writes and reports
    its own mapping's smaps as the parent asks."""
    import aioxfer

    async def serve() -> None:
        async with aioxfer.Agent("init") as agent:
            conn.send("ready")
            loop = asyncio.get_running_loop()
            local = agent.alloc(POOL, name="local")
            view = local.numpy()
            remote = None
            while True:
                msg = await loop.run_in_executor(None, conn.recv)
                if msg == "quit":  # PipeChild.close's message: a bare string
                    conn.send(None)
                    return
                cmd, *args = msg
                if cmd == "connect":
                    peer = await within(agent.connect(args[0]))
                    remote = peer.region("thp")
                    conn.send(peer.path)
                elif cmd == "read":
                    off, n = args
                    await within(agent.read(local[0:n], remote[off:off + n]))
                    conn.send(view[:n].tobytes())
                elif cmd == "write":
                    off, data = args
                    view[:len(data)] = np.frombuffer(data, dtype=np.uint8)
                    await within(agent.write(local[0:len(data)], remote[off:off + len(data)]))
                    conn.send(None)
                elif cmd == "smaps":  # our mapping of the peer's memfd, by its name
                    conn.send(mapping_by_name(args[0]))

    asyncio.run(serve())


def mapping_by_name(name: str) -> dict[str, Any]:
    with open("/proc/self/maps") as f:
        for line in f:
            if name in line:
                return smaps_of(int(line.split("-")[0], 16))
    return {}


async def owner_pool(make_agent: Any, size: int = POOL) -> tuple[Any, Any, np.ndarray]:
    owner = await make_agent("thpowner")
    pool = owner.alloc(size, name="thp")
    view = pool.numpy()
    view[:] = pattern(size, seed=24)  # the first touch: the pages are allocated now
    return owner, pool, view


# 8 MiB: map_fd's MAP_POPULATE path; 32 MiB: pop_parallel's (its probe of
# the first 2 MiB finds huge pages and populates the rest on one thread).
@pytest.mark.parametrize("size", [POOL, 32 * MiB], ids=["map-populate", "parallel"])
async def test_pool_is_huge_page_backed_on_both_sides(make_agent, size: int) -> None:
    if not thp_allowed():
        pytest.skip(f"no shmem huge pages on this host ({THP_SYSFS}: {shmem_thp_mode()}, "
                    f"Linux {os.uname().release}; MADV_COLLAPSE needs 6.1 and not deny)")
    owner, pool, view = await owner_pool(make_agent, size)
    mine = smaps_of(view.ctypes.data)
    if shmem_thp_mode() != "never":
        # Every 2 MiB of the owner's pool is one huge page, mapped by a PMD.
        # (At never, the owner's own mapping, Python's mmap, is not aligned
        # for one: its huge pages are mapped by PTEs there.)
        assert mine["start"] % (2 * MiB) == 0, mine
        assert mine.get("ShmemPmdMapped", 0) * 1024 == size, mine
    loop = asyncio.get_running_loop()
    child = await loop.run_in_executor(None, PipeChild, initiator_main)
    try:
        assert await loop.run_in_executor(None, child.call, ("connect", owner.address)) == "shm"
        name = f"/memfd:aioxfer:{owner.name}:thp "
        theirs = await loop.run_in_executor(None, child.call, ("smaps", name))
        # The peer's mapping (map_fd's populate) is PMD-mapped too: aligned,
        # and all of it, with no small-page entry left.
        assert theirs and theirs["start"] % (2 * MiB) == 0, theirs
        assert theirs.get("ShmemPmdMapped", 0) * 1024 == size, theirs
        data = pattern(4096, seed=25).tobytes()
        await loop.run_in_executor(None, child.call, ("write", 3 * MiB, data))
        assert view[3 * MiB:3 * MiB + 4096].tobytes() == data
    finally:
        await loop.run_in_executor(None, child.close)


def punch_hole(fd: int, off: int, n: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    falloc_fl_keep_size, falloc_fl_punch_hole = 0x01, 0x02
    if libc.fallocate(fd, falloc_fl_keep_size | falloc_fl_punch_hole, off, n) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


async def test_punched_hole_in_mapped_pool_reads_zeros_no_sigbus(make_agent) -> None:
    owner, pool, view = await owner_pool(make_agent)
    if thp_allowed() and shmem_thp_mode() != "never":
        # the huge-page case (at never too: the owner's mapping is not PMD-
        # aligned there): the punch splits / frees huge pages
        assert smaps_of(view.ctypes.data).get("ShmemPmdMapped", 0) * 1024 == POOL
    loop = asyncio.get_running_loop()
    child = await loop.run_in_executor(None, PipeChild, initiator_main)
    try:
        assert await loop.run_in_executor(None, child.call, ("connect", owner.address)) == "shm"
        want = pattern(POOL, seed=24)
        # Inside a huge page (4 KiB-8 KiB into 3-5 MiB's page: split) and one
        # whole 2 MiB-aligned huge page (freed outright), after the peer mapped
        # and populated them.
        small = (3 * MiB + 4096, 8192)
        whole = (6 * MiB, 2 * MiB)
        for off, n in (small, whole):
            punch_hole(pool._memfd, off, n)
            want[off:off + n] = 0
        for off, n in (small, whole, (2 * MiB, 2 * MiB), (0, 4096)):
            got = await loop.run_in_executor(None, child.call, ("read", off, n))
            assert got == want[off:off + n].tobytes(), (off, n)
        # The owner sees zeros there too, and the peer's writes into the holes land.
        assert view[6 * MiB:8 * MiB].tobytes() == bytes(2 * MiB)
        for off, n in (small, whole):
            data = pattern(n, seed=off).tobytes()
            await loop.run_in_executor(None, child.call, ("write", off, data))
            assert view[off:off + n].tobytes() == data
        assert child.proc.is_alive()
    finally:
        await loop.run_in_executor(None, child.close)

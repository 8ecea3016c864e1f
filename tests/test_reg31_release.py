"""reg31: registration's release paths and DeviceBuffer lifetimes.

- aioxfer/registration.py: a deregistration the engine refused completed as
  a success, and the region's memory was never given back (its memfd open
  for good, a DeviceBuffer of it allocated for good after its close()).
- aioxfer/registration.py: a DeviceBuffer's deferred free that failed inside
  the release (cuda_free raising: a driver poisoned by a sticky error) escaped
  into the drain: the rest of the release was skipped and the deregistration's
  awaitable never completed.
- aioxfer/registration.py: a region of a DeviceBuffer registered through
  another object (``DevicePointer(buf.ptr, n)``) was not one of the buffer's
  regions: ``buf.close()`` freed memory the region still named.
- aioxfer/registration.py: a host region registered by pointer (a DLPack CPU
  tensor) was never page-locked ahead of its first GPU copy, as every other
  host region is.

The GPU ones run on the software CUDA driver (native/tests/fakecuda.c: freed
device memory is unmapped, as a real driver may hand it to someone else), in
fresh processes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import within

import aioxfer

MiB = 1 << 20


async def test_a_refused_deregistration_fails_its_awaitable_and_leaks_no_memory(
    make_agent: Any,
) -> None:
    """The engine refuses the deregistration (here: it no longer knows the
    region, deregistered behind the agent's back; out of memory is the other
    way): deregister() raises RegistrationError, awaiting its awaitable raises
    it too (it completed as a success), and the region's memfd is closed once
    the engine released the region (it stayed open for good)."""
    agent = await make_agent("a")
    region = agent.alloc(MiB, name="pool")
    fd = region._memfd
    assert fd >= 0
    agent._engine.deregister(region.rid)  # the engine releases it on its own
    with pytest.raises(aioxfer.RegistrationError, match="cannot deregister region 'pool'"):
        agent.deregister(region)
    with pytest.raises(aioxfer.RegistrationError, match="cannot deregister region 'pool'"):
        await within(agent.deregister(region))
    assert region.closed and agent.regions == []
    # the engine's release (CQ_REGION_FREED) gives the memory back
    for _ in range(100):
        if region._memfd < 0:
            break
        await asyncio.sleep(0.01)
    assert region._memfd == -1 and region._mmap is None
    with pytest.raises(OSError):
        os.fstat(fd)


async def test_a_refused_deregistration_is_released_by_the_close(make_agent: Any) -> None:
    """Where no release comes from the engine for it before the close, the
    agent's close gives the memory back (it was dropped from every table)."""
    agent = await make_agent("a")
    region = agent.alloc(MiB, name="pool")
    agent._engine.deregister(region.rid)
    agent._sub.drain_once()  # the engine's release arrives first: nothing knows the rid then
    with pytest.raises(aioxfer.RegistrationError):
        agent.deregister(region)
    assert region._memfd >= 0  # the engine may hold it still: kept
    await within(agent.aclose())
    assert region._memfd == -1 and region._mmap is None


CHILD = r'''
import asyncio, ctypes, os, sys
import numpy as np
import aioxfer
from aioxfer import _cyx, cuda

N = 1 << 20
WHAT = sys.argv[1]


def pinned_count():
    lib = ctypes.CDLL(os.environ["AIOXFER_CUDA_DRIVER"], mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    return int(lib.fakecuda_pinned_count())


class DLOnly:
    def __init__(self, arr):
        self.arr = arr

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)


async def refused():
    async with aioxfer.Agent("a") as a:
        buf = cuda.DeviceBuffer(N)
        ptr = buf.ptr
        g = a.register(buf, name="g")
        a._engine.deregister(g.rid)
        try:
            a.deregister(g)
            print("DEREG", "taken")
        except aioxfer.RegistrationError:
            print("DEREG", "refused")
        buf.close()
        print("ALIVE", cuda.describe(ptr, N)[0])
        try:
            await asyncio.wait_for(a.deregister(g), 10)
            print("AWAIT", "ok")
        except aioxfer.RegistrationError:
            print("AWAIT", "RegistrationError")
        for _ in range(200):
            if not cuda.describe(ptr, N)[0]:
                break
            await asyncio.sleep(0.01)
    print("FREED", not cuda.describe(ptr, N)[0])


async def pointer():
    async with aioxfer.Agent("a") as a, aioxfer.Agent("b") as b:
        src = b.alloc(N, name="src")
        src.numpy()[:] = 9
        peer = await asyncio.wait_for(a.connect(b.address), 10)
        buf = cuda.DeviceBuffer(N)
        ptr = buf.ptr
        g = a.register(cuda.DevicePointer(ptr + 4096, N - 8192), name="view")
        t = a.read(g[0:N - 8192], peer.region("src")[0:N - 8192])  # a copy into it
        a._sub.post_pending()
        released = a.deregister(g)
        buf.close()  # the region names its memory, a copy may still run
        print("ALIVE", cuda.describe(ptr, N)[0])
        try:
            a.register(cuda.DevicePointer(ptr, 4096))
            print("CLOSED_BUFFER", "taken")
        except aioxfer.RegistrationError:
            print("CLOSED_BUFFER", "refused")
        r = await asyncio.wait_for(t, 30)
        print("READ", r.nbytes == N - 8192)
        await asyncio.wait_for(released, 30)
        print("FREED", not cuda.describe(ptr, N)[0])


async def poisoned():
    async with aioxfer.Agent("a") as a:
        buf = cuda.DeviceBuffer(N)
        g = a.register(buf, name="g")
        released = a.deregister(g)
        buf.close()  # deferred: the engine has not released the region yet
        host = ctypes.create_string_buffer(4096)
        try:  # past the allocation: a sticky error, every later driver call fails
            _cyx.cuda_copy(buf.ptr + N - 16, ctypes.addressof(host), 4096)
        except _cyx.NativeError:
            pass
        print("POISONED", not cuda.status()[0])
        try:
            await asyncio.wait_for(released, 10)
            print("AWAIT", "ok")
        except aioxfer.RegistrationError as exc:
            print("AWAIT", "RegistrationError", "DeviceBuffer" in str(exc))
        except asyncio.TimeoutError:
            print("AWAIT", "hung")
        print("CLOSED", buf.ptr == 0)
    print("AGENT_CLOSED")


async def pin():
    async with aioxfer.Agent("a") as a:
        print("CUDA", "cuda" in a.transports)
        # (Pinned ahead in a context of the engine's, known once the device
        # is in use: allocated here, or after a first copy.)
        gpu = cuda.DeviceBuffer(4096)
        before = pinned_count()
        plain = a.register(bytearray(N), name="plain")  # a buffer export: pinned ahead
        for _ in range(200):
            if pinned_count() > before:
                break
            await asyncio.sleep(0.01)
        print("PINNED_BUFFER", pinned_count() - before)
        await a.deregister(plain)
        gpu.close()
        arr = np.zeros(N, dtype=np.uint8)
        r = a.register(DLOnly(arr), name="host")
        print("KIND", r.kind)
        for _ in range(200):  # pinned on the engine's CUDA thread, soon
            if pinned_count() > before:
                break
            await asyncio.sleep(0.01)
        print("PINNED", pinned_count() - before)
        await a.deregister(r)
        print("UNPINNED", pinned_count() - before)


async def readonly_pin():
    """A read-only mapping registered (READ access): pinned READ_ONLY, so the
    GPU copies out of it run asynchronously."""
    import mmap
    lib = ctypes.CDLL(os.environ["AIOXFER_CUDA_DRIVER"], mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    async with aioxfer.Agent("a") as a:
        gpu = cuda.DeviceBuffer(N)
        g = a.register(gpu, name="g")
        before = pinned_count()
        ro = mmap.mmap(-1, N, prot=mmap.PROT_READ)
        r = a.register(ro, name="ro")
        print("WRITABLE", r.writable)
        for _ in range(200):
            if pinned_count() > before:
                break
            await asyncio.sleep(0.01)
        print("PINNED", pinned_count() - before)
        peer = await asyncio.wait_for(a.connect(a.address), 10)
        sync0 = lib.fakecuda_sync_copies()
        await asyncio.wait_for(a.write(r[0:N], peer.region("g")[0:N]), 10)
        print("COPIED", gpu.download(0, 16) == bytes(16))
        print("SYNC_COPIES", lib.fakecuda_sync_copies() - sync0)
        await a.deregister(r)
        await a.deregister(g)
        print("UNPINNED", pinned_count() - before)
        ro.close()
        gpu.close()


async def main():
    ok, why = cuda.status()
    if not ok:
        print("NOCUDA", why)
        return
    await {"refused": refused, "pointer": pointer, "poisoned": poisoned, "pin": pin,
           "readonly_pin": readonly_pin}[WHAT]()
    print("DONE")


asyncio.run(main())
'''


def _child(tmp_path: Path, fakecuda: Path, what: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, AIOXFER_CUDA_DRIVER=str(fakecuda))
    out = subprocess.run([sys.executable, str(script), what], env=env, capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert "NOCUDA" not in out.stdout, out.stdout
    assert out.returncode == 0, f"rc {out.returncode}\n" + out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]  # nothing raised into the drain
    return out.stdout.splitlines()


def test_a_refused_deregistration_of_a_device_buffer_frees_it_after_all(
    tmp_path: Path, fakecuda: Path
) -> None:
    lines = _child(tmp_path, fakecuda, "refused")
    assert lines == ["DEREG refused", "ALIVE True", "AWAIT RegistrationError", "FREED True",
                     "DONE"], lines


def test_a_device_pointer_into_a_device_buffer_defers_its_close(
    tmp_path: Path, fakecuda: Path
) -> None:
    """DevicePointer(buf.ptr + 4096, ...) registered, a copy into it in flight:
    buf.close() freed the memory at once (ALIVE False, the copy then wrote
    into unmapped memory); now it waits for the region's release."""
    lines = _child(tmp_path, fakecuda, "pointer")
    assert lines == ["ALIVE True", "CLOSED_BUFFER refused", "READ True", "FREED True",
                     "DONE"], lines


def test_a_failed_deferred_free_still_ends_the_deregistration(
    tmp_path: Path, fakecuda: Path
) -> None:
    """cuda_free raising inside the release (the driver poisoned): the
    awaitable hung (and the error went into the drain); now it fails typed."""
    lines = _child(tmp_path, fakecuda, "poisoned")
    assert lines == ["POISONED True", "AWAIT RegistrationError True", "CLOSED True",
                     "AGENT_CLOSED", "DONE"], lines


def test_a_host_region_registered_by_pointer_is_pinned_ahead(
    tmp_path: Path, fakecuda: Path
) -> None:
    lines = _child(tmp_path, fakecuda, "pin")
    assert lines == ["CUDA True", "PINNED_BUFFER 1", "KIND host", "PINNED 1", "UNPINNED 0",
                     "DONE"], lines


def test_a_read_only_mapping_is_pinned_read_only(tmp_path: Path, fakecuda: Path) -> None:
    """native/src/cuda.c pin_op / pin_ahead pinned every region of ours as
    writable memory: the driver refuses that for a read-only mapping (a
    PROT_READ mmap, registered READ-only), which stayed pageable, and every
    GPU copy out of it ran synchronously in the driver. Now a region nobody
    may write is pinned READ_ONLY where the writable pin is refused."""
    lines = _child(tmp_path, fakecuda, "readonly_pin")
    assert lines == ["WRITABLE False", "PINNED 1", "COPIED True", "SYNC_COPIES 0",
                     "UNPINNED 0", "DONE"], lines

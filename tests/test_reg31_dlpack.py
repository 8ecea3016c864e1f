"""reg31: read-only DLPack tensors register read-only.

aioxfer.cuda._from_dlpack asked for a DLPack export through the legacy
protocol only (``__dlpack__()`` without ``max_version``): numpy 2 refuses a
read-only array's export that way (the legacy DLManagedTensor cannot say
"read-only"), so such a tensor could not be registered at all, and every
tensor registered by pointer was READ|WRITE (``GpuMemory.readonly`` was always
False). Now the versioned protocol comes first (``max_version=(1, 0)``: a
DLManagedTensorVersioned, whose READ_ONLY flag makes the region READ-only: a
peer may read it, never write it, and no READ of ours lands in it), the
legacy one for producers that predate it.

The host tests run anywhere (a host tensor that only speaks DLPack is host
memory registered by pointer); the GPU one on the software CUDA driver
(native/tests/fakecuda.c) in a fresh process.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SAME_HOST, within

import aioxfer
from aioxfer import _cyx, cuda


class DLOnly:
    """A host tensor that speaks only DLPack (no buffer export), as a CPU
    tensor of a framework without the buffer protocol: registered by pointer.
    ``export`` (keyword arguments) is passed through to numpy's __dlpack__."""

    def __init__(self, arr: np.ndarray, **export: Any) -> None:
        self.arr = arr
        self._export = export

    def __dlpack_device__(self) -> tuple[int, int]:
        dev: tuple[int, int] = self.arr.__dlpack_device__()
        return dev

    def __dlpack__(self, **kw: Any) -> Any:
        return self.arr.__dlpack__(**kw, **self._export)


class LegacyDLOnly(DLOnly):
    """A producer from before DLPack 1.0: __dlpack__ takes no max_version."""

    def __dlpack__(self, stream: Any = None) -> Any:  # type: ignore[override]
        return self.arr.__dlpack__()


def _readonly(n: int, fill: int) -> np.ndarray:
    a = np.full(n, fill, dtype=np.uint8)
    a.flags.writeable = False
    return a


def test_a_read_only_dlpack_tensor_is_inspected_read_only() -> None:
    ro = _readonly(4096, 7)
    m = cuda.inspect(DLOnly(ro))
    assert m == cuda.GpuMemory("host", ro.ctypes.data, 4096, True)
    rw = np.zeros(4096, dtype=np.uint16)
    assert cuda.inspect(DLOnly(rw)) == cuda.GpuMemory("host", rw.ctypes.data, 8192, False)
    # a legacy producer: its capsule cannot say read-only; a writable array
    # still registers (READ|WRITE), as before
    assert cuda.inspect(LegacyDLOnly(rw)) == cuda.GpuMemory("host", rw.ctypes.data, 8192, False)
    # a copy made for the export is freed with its capsule: never registered
    with pytest.raises(ValueError, match="copy"):
        cuda.inspect(DLOnly(rw, copy=True))


@pytest.mark.parametrize("transport", ["same-host", "tcp"])
async def test_a_peer_reads_a_read_only_dlpack_region_and_never_writes_it(
    make_agent: Any, transport: str
) -> None:
    kw: dict[str, Any] = {} if transport == "same-host" else {"transports": ("tcp",)}
    target = await make_agent("target", **kw)
    init = await make_agent("init", **kw)
    n = 1 << 16
    ro = _readonly(n, 0x5A)
    region = target.register(DLOnly(ro), name="weights")
    assert region.kind == "host"
    assert region.access == _cyx.ACCESS_READ and not region.writable
    assert region.memoryview.readonly
    peer = await within(init.connect(target.address))
    assert peer.path == (SAME_HOST if transport == "same-host" else "tcp")
    remote = peer.region("weights")
    assert remote.access == _cyx.ACCESS_READ
    dst = init.alloc(n, name="dst")
    result = await within(init.read(dst[:], remote[:]))
    assert result.nbytes == n
    assert bytes(dst.memoryview) == b"\x5a" * n
    src = init.alloc(n, name="src")
    src.numpy()[:] = 0xEE
    with pytest.raises(aioxfer.AccessDenied):
        await within(init.write(src[:], remote[:]))
    # nor does a READ of the owner's own land in it
    other = await make_agent("other", **kw)
    other.alloc(n, name="o")
    back = await within(target.connect(other.address))
    with pytest.raises(aioxfer.AccessDenied):
        await within(target.read(region[:], back.region("o")[:]))
    assert bytes(ro) == b"\x5a" * n  # untouched
    await within(target.deregister(region))


async def test_a_writable_dlpack_region_stays_writable(make_agent: Any) -> None:
    target = await make_agent("target")
    init = await make_agent("init")
    n = 1 << 16
    rw = np.zeros(n, dtype=np.uint8)
    region = target.register(DLOnly(rw), name="kv")
    assert region.writable
    legacy = target.register(LegacyDLOnly(np.zeros(n, dtype=np.uint8)), name="old")
    assert legacy.writable
    peer = await within(init.connect(target.address))
    src = init.alloc(n, name="src")
    src.numpy()[:] = 0x33
    await within(init.write(src[:], peer.region("kv")[:]))
    assert bytes(rw) == b"\x33" * n


# ------------------------------------------------------------ GPU memory (software driver)


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", cuda._DLTensor)]


CHILD = r'''
import asyncio, ctypes, sys
sys.path.insert(0, sys.argv[1])
import aioxfer
from aioxfer import _cyx, cuda
from test_reg31_dlpack import _DLManagedVersioned

N = 1 << 20


class GpuTensor:
    """A CUDA DLPack producer of the 1.0 protocol (as PyTorch >= 2.6):
    a "dltensor_versioned" capsule over device memory, READ_ONLY when asked."""

    def __init__(self, buf, readonly):
        self.buf = buf
        self._shape = (ctypes.c_int64 * 1)(buf.nbytes)
        self._m = _DLManagedVersioned()
        self._m.version.major, self._m.version.minor = 1, 0
        self._m.flags = 1 if readonly else 0  # DLPACK_FLAG_BITMASK_READ_ONLY
        t = self._m.dl_tensor
        t.data = buf.ptr
        t.device.device_type, t.device.device_id = cuda.KDL_CUDA, 0
        t.ndim = 1
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 1, 8, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))

    def __dlpack_device__(self):
        return (cuda.KDL_CUDA, 0)

    def __dlpack__(self, stream=None, max_version=None):
        assert max_version == (1, 0), max_version
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor_versioned", None)


async def main():
    ok, why = cuda.status()
    if not ok:
        print("NOCUDA", why)
        return
    async with aioxfer.Agent("gpu") as a, aioxfer.Agent("host") as b:
        buf = cuda.DeviceBuffer(N)
        buf.upload(b"\x42" * N)
        g = a.register(GpuTensor(buf, True), name="ro")
        print("ACCESS", g.kind, g.access == _cyx.ACCESS_READ)
        rwbuf = cuda.DeviceBuffer(N)
        w = a.register(GpuTensor(rwbuf, False), name="rw")
        print("RW", w.access == _cyx.ACCESS_READ | _cyx.ACCESS_WRITE)
        peer = await asyncio.wait_for(b.connect(a.address), 10)
        print("PATH", peer.path)
        dst = b.alloc(N, name="dst")
        await asyncio.wait_for(b.read(dst[:], peer.region("ro")[:]), 10)
        print("READ", bytes(dst.memoryview) == b"\x42" * N)
        src = b.alloc(N, name="src")
        src.numpy()[:] = 0x17
        try:
            await asyncio.wait_for(b.write(src[:], peer.region("ro")[:]), 10)
            print("WRITE", "taken")
        except aioxfer.AccessDenied:
            print("WRITE", "denied")
        print("INTACT", buf.download() == b"\x42" * N)
        await asyncio.wait_for(b.write(src[:], peer.region("rw")[:]), 10)
        print("RW_WRITE", rwbuf.download() == b"\x17" * N)
        await a.deregister(g)
        await a.deregister(w)
        buf.close()
        rwbuf.close()
    print("DONE")


asyncio.run(main())
'''


def test_a_read_only_gpu_tensor_is_read_only_for_peers(tmp_path: Path, fakecuda: Path) -> None:
    """A CUDA tensor exported READ_ONLY through DLPack 1.0: registered READ
    only (its IPC export is still there, but every peer's engine refuses a
    WRITE to it); a writable one stays READ|WRITE."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, AIOXFER_CUDA_DRIVER=str(fakecuda))
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, str(script), here], env=env, capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert "NOCUDA" not in out.stdout, out.stdout
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:3] == ["ACCESS cuda True", "RW True", "PATH cuda"], out.stdout
    assert lines[3:] == ["READ True", "WRITE denied", "INTACT True", "RW_WRITE True", "DONE"], \
        out.stdout

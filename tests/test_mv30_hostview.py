"""mv30: host memory registered by pointer (a DLPack CPU tensor, as torch's:
no buffer protocol) has a host view. ``Region.memoryview`` did
``memoryview(obj)``, a TypeError for such an object, so a local backend,
staging.PosixFile and ``Region.numpy()`` could not move the region at all.
The view is over the registered (address, nbytes), holds the object that
owns the memory for as long as it lives, and is read-only for a read-only
region."""

from __future__ import annotations

import ctypes
import gc
import os
import weakref
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

import aioxfer
from aioxfer import _cyx
from aioxfer.backends import registry
from aioxfer.backends.base import BackendRegion, LocalBackend
from aioxfer.staging import PosixFile

MakeAgent = Callable[..., Awaitable[Any]]
N = 64 << 10


class CpuTensor:
    """As a torch CPU tensor: host memory reachable through DLPack only."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __dlpack_device__(self) -> tuple[int, int]:
        dev: tuple[int, int] = self.arr.__dlpack_device__()
        return dev

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.arr.__dlpack__(stream=stream)


def _tensor(seed: int, n: int = N) -> CpuTensor:
    return CpuTensor(pattern(n, seed))


# ---------------------------------------------------------------- the view


async def test_a_dlpack_cpu_tensor_has_a_byte_view_of_its_memory(make_agent: MakeAgent) -> None:
    agent = await make_agent("view")
    t = _tensor(1)
    with pytest.raises(TypeError):
        memoryview(t)  # type: ignore[call-overload]  # (what made it a pointer registration)
    region = agent.register(t)
    assert region.kind == "host" and region.nbytes == N and region.writable
    assert region.addr == t.arr.ctypes.data
    mv = region.memoryview
    assert (mv.format, mv.ndim, mv.nbytes, mv.readonly) == ("B", 1, N, False)
    assert bytes(mv) == t.arr.tobytes()
    mv[0:4] = b"abcd"  # the tensor's own memory, not a copy
    assert t.arr[0:4].tobytes() == b"abcd"
    words = region.numpy(np.uint32)
    assert words.shape == (N // 4,) and words.flags.writeable
    words[1] = 0x01020304
    assert t.arr[4:8].tobytes() == (0x01020304).to_bytes(4, "little")
    seg = region[100:200]
    assert bytes(seg.memoryview) == t.arr[100:200].tobytes()
    assert seg.numpy().tobytes() == t.arr[100:200].tobytes()


async def test_the_view_keeps_the_tensor_alive_and_a_closed_region_gives_none(
    make_agent: MakeAgent,
) -> None:
    agent = await make_agent("alive")
    t = _tensor(2)
    want = t.arr.tobytes()
    gone = weakref.ref(t.arr)
    region = agent.register(t)
    mv = region.memoryview
    arr = region.numpy()
    await within(region.close())
    with pytest.raises(aioxfer.ClosedResourceError):
        region.memoryview  # noqa: B018
    with pytest.raises(aioxfer.ClosedResourceError):
        region.numpy()
    # The region and the tensor dropped: the views still own the memory.
    del region, t
    gc.collect()
    assert gone() is not None, "the tensor's memory was freed under a live view"
    assert bytes(mv) == want and arr.tobytes() == want
    del arr
    mv.release()
    del mv
    gc.collect()
    assert gone() is None, "the view kept the tensor after it was released"


async def test_a_read_only_pointer_region_gives_a_read_only_view(make_agent: MakeAgent) -> None:
    agent = await make_agent("ro")
    t = _tensor(3)
    region = agent.register(t)
    # DLPack without versioning carries no read-only flag, so a read-only
    # host pointer region comes from the access bits alone: what the view
    # must follow.
    region.access = _cyx.ACCESS_READ
    mv = region.memoryview
    assert mv.readonly and bytes(mv) == t.arr.tobytes()
    with pytest.raises(TypeError):
        mv[0] = 1
    assert not region.numpy().flags.writeable
    with pytest.raises(ValueError):
        region.numpy()[0] = 1


def test_host_view_refuses_what_it_cannot_describe() -> None:
    arr = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError):
        _cyx.HostView(arr, 0, 16, False)
    with pytest.raises(ValueError):
        _cyx.HostView(arr, arr.ctypes.data, 0, False)
    with pytest.raises(ValueError):
        _cyx.HostView(None, arr.ctypes.data, 16, False)
    with pytest.raises((ValueError, OverflowError)):
        _cyx.HostView(arr, arr.ctypes.data, -1, False)
    hv = _cyx.HostView(arr, arr.ctypes.data, 16, True)
    assert hv.owner is arr and hv.nbytes == 16 and hv.readonly
    assert memoryview(hv).readonly
    with pytest.raises(TypeError, match="not writable"):  # a writable export refused
        (ctypes.c_uint8 * 16).from_buffer(hv)
    rw = _cyx.HostView(arr, arr.ctypes.data, 16, False)
    (ctypes.c_uint8 * 16).from_buffer(rw)[3] = 7
    assert arr[3] == 7


# ---------------------------------------------------------------- moving it


class _FileSeg:
    __slots__ = ("region", "offset")

    def __init__(self, region: _FileRegion, offset: int) -> None:
        self.region = region
        self.offset = offset


class _FileRegion(BackendRegion):
    kind = "mv30-file"

    def __init__(self, backend: _FileBackend, name: str, path: Path) -> None:
        super().__init__(backend, name)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def __getitem__(self, offset: int) -> _FileSeg:
        self._check()
        return _FileSeg(self, offset)

    async def aclose(self) -> None:
        await super().aclose()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _FileBackend(LocalBackend):
    """A plugin of the public interface: pread/pwrite of one real file on
    worker threads (what LocalBackend hands it is the region's host view)."""

    kind = "mv30-file"

    def register(self, path: Path, name: str = "mv30-file") -> _FileRegion:
        region = _FileRegion(self, name, path)
        self._add_region(region)
        return region

    def far_segments(self, far: Any, op: str) -> Sequence[Any]:
        return (far,) if isinstance(far, _FileSeg) else far

    async def put(self, src: memoryview, far: _FileSeg) -> None:
        await self.run_blocking(os.pwrite, far.region.fd, src, far.offset)

    async def get(self, dst: memoryview, far: _FileSeg) -> None:
        await self.run_blocking(os.preadv, far.region.fd, [dst], far.offset)


registry.add_backend("mv30-file", _FileBackend)


async def test_a_local_backend_moves_a_dlpack_cpu_tensor(
    make_agent: MakeAgent, tmp_path: Path
) -> None:
    agent = await make_agent("local")
    be = registry.instance(agent, "mv30-file")
    assert isinstance(be, _FileBackend)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\0" * N)
    far = be.register(path)
    src = _tensor(4)
    region = agent.register(src)
    await within(agent.write(region[0:N], far[0]))
    assert path.read_bytes() == src.arr.tobytes()
    dst = CpuTensor(np.zeros(N, dtype=np.uint8))
    back = agent.register(dst)
    await within(agent.read(back[N // 2 : N], far[N // 2]))
    assert dst.arr[: N // 2].tobytes() == b"\0" * (N // 2)
    assert dst.arr[N // 2 :].tobytes() == src.arr[N // 2 :].tobytes()


async def test_posix_file_stages_a_dlpack_cpu_tensor(
    make_agent: MakeAgent, tmp_path: Path
) -> None:
    agent = await make_agent("posix")
    src = _tensor(5)
    dst = CpuTensor(np.zeros(N, dtype=np.uint8))
    rs, rd = agent.register(src), agent.register(dst)
    pf = PosixFile(tmp_path / "staged.bin", size=N)
    try:
        await within(pf.write_from(rs[0:N], 0))
        await within(pf.read_into(rd[0:N], 0))
    finally:
        pf.close()
    assert (tmp_path / "staged.bin").read_bytes() == src.arr.tobytes()
    assert dst.arr.tobytes() == src.arr.tobytes()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_peers_still_move_a_dlpack_cpu_tensor(make_agent: MakeAgent, transport: str) -> None:
    kw = {"transports": ("tcp",)} if transport == "tcp" else {}
    target = await make_agent("target", **kw)
    init = await make_agent("init", **kw)
    peer = await within(init.connect(target.address))
    assert peer.path == transport
    far = CpuTensor(np.zeros(N, dtype=np.uint8))
    target.register(far, name="far")
    await within(peer.refresh())
    remote = peer.region("far")
    src = _tensor(6)
    near = init.register(src)
    await within(init.write(near[0:N], remote[0:N]))
    assert far.arr.tobytes() == src.arr.tobytes()
    # Into it through its host view, back over the wire.
    back = CpuTensor(np.zeros(N, dtype=np.uint8))
    rb = init.register(back)
    await within(init.read(rb[0:N], remote[0:N]))
    assert rb.memoryview.tobytes() == src.arr.tobytes() == back.arr.tobytes()

"""CUDA memory and the "cuda" path.

Without a driver (every CI machine here): CUDA reports itself absent with a
reason and nothing raises on import; GPU objects (CUDA array interface, CUDA
DLPack, raw device pointers) are recognised, parsed, and refused with that
reason; host DLPack arrays keep registering as host memory.

Tests marked ``gpu`` need a CUDA driver and device and skip otherwise: they move
data host <-> GPU and GPU <-> GPU between two processes over the "cuda" path,
verified, and check peer death and deregistration.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from conftest import STEP, digest, pattern, run_child, wait_until, within

import aioxfer
from aioxfer import _cyx, cuda
from aioxfer.metadata import CudaExport, RegionMeta

CUDA_OK, CUDA_WHY = cuda.status()
gpu = pytest.mark.skipif(not CUDA_OK, reason=f"no CUDA driver/device ({CUDA_WHY})")


class FakeCudaArray:
    """Describes device memory by the CUDA array interface, as CuPy/PyTorch do."""

    def __init__(self, ptr: int = 0x7F00_0000_0000, shape: tuple[int, ...] = (256,),
                 typestr: str = "<f4", strides: tuple[int, ...] | None = None,
                 version: int = 3) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (ptr, False),
            "version": version, "strides": strides, "stream": None,
        }


class _DLManaged(ctypes.Structure):
    _fields_ = [("tensor", cuda._DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class FakeDLPack:
    """A DLPack producer with a real "dltensor" capsule (no deleter)."""

    def __init__(self, device_type: int, ptr: int, shape: tuple[int, ...],
                 bits: int = 16, byte_offset: int = 0) -> None:
        self.device_type = device_type
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._m = _DLManaged()
        t = self._m.tensor
        t.data = ptr
        t.device.device_type = device_type
        t.ndim = len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, bits, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor", None)


# ------------------------------------------------------------ without a GPU


def test_status_and_devices_never_raise() -> None:
    ok, why = cuda.status()
    assert isinstance(ok, bool) and why
    names = cuda.devices()
    assert (len(names) > 0) == ok
    st, why2, n = _cyx.cuda_probe()
    assert (st == _cyx.OK) == ok and why2 == why and (n > 0) == ok


def test_absent_driver_reports_why_in_any_process() -> None:
    # A fresh process pointed at a driver that does not exist: absent, with the
    # reason naming it, on any machine (also one with a GPU).
    code = ("import aioxfer, aioxfer.cuda as c; print(c.status()); print(c.devices()); "
            "a = aioxfer.Agent('x'); print(a.transports); print(a._engine.cuda_enable()); "
            "a._engine.close()")
    env = dict(os.environ, AIOXFER_CUDA_DRIVER="/nonexistent/libcuda.so.1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("(False, 'no CUDA driver: cannot load /nonexistent/libcuda.so.1")
    assert lines[1] == "[]"
    assert lines[2] == "('shm', 'tcp')"  # "cuda" is dropped, not advertised
    # the engine's own enable call answers with the status and the same reason
    assert lines[3].startswith(f"({_cyx.E_TRANSPORT}, 'no CUDA driver: cannot load /nonexistent/")


@pytest.mark.skipif(CUDA_OK, reason="a CUDA driver is present")
async def test_cuda_objects_refused_with_the_reason(make_agent: Any) -> None:
    agent = await make_agent("a")
    assert "cuda" not in agent.transports
    for obj in (FakeCudaArray(), FakeDLPack(cuda.KDL_CUDA, 0x7F00_0000_0000, (8, 8)),
                cuda.DevicePointer(0x7F00_0000_0000, 4096)):
        with pytest.raises(aioxfer.RegistrationError, match="CUDA is not available") as ei:
            agent.register(obj, name="gpu")
        assert CUDA_WHY in str(ei.value)
    assert agent.regions == []
    with pytest.raises(aioxfer.TransportError, match="'cuda' is not available: no CUDA driver"):
        aioxfer.Agent("b", transports=("cuda", "shm"))


def test_cuda_array_interface_parsed() -> None:
    m = cuda.inspect(FakeCudaArray(ptr=0x1000, shape=(4, 8), typestr="<f2"))
    assert m == cuda.GpuMemory("cuda", 0x1000, 64, False)
    # explicit C-contiguous strides are fine; others are refused
    assert cuda.inspect(FakeCudaArray(shape=(4, 8), typestr="<f2", strides=(16, 2))) is not None
    with pytest.raises(cuda.NotContiguous):
        cuda.inspect(FakeCudaArray(shape=(4, 8), typestr="<f2", strides=(2, 8)))
    with pytest.raises(ValueError, match="version"):
        cuda.inspect(FakeCudaArray(version=1))
    with pytest.raises(ValueError, match="empty"):
        cuda.inspect(FakeCudaArray(shape=(0,)))


def test_dlpack_parsed() -> None:
    m = cuda.inspect(FakeDLPack(cuda.KDL_CUDA, 0x2000, (3, 5), bits=32, byte_offset=64))
    assert m == cuda.GpuMemory("cuda", 0x2000 + 64, 60, False)
    # a host DLPack tensor without a buffer export: host memory by pointer
    host = np.zeros(10, dtype=np.uint16)
    m = cuda.inspect(FakeDLPack(cuda.KDL_CPU, host.ctypes.data, (10,)))
    assert m == cuda.GpuMemory("host", host.ctypes.data, 20, False)
    with pytest.raises(ValueError, match="neither CUDA nor host"):
        cuda.inspect(FakeDLPack(14, 0x2000, (3,)))  # kDLOneAPI


async def test_host_dlpack_still_host(make_agent: Any) -> None:
    a = await make_agent("a")
    b = await make_agent("b")
    src = pattern(1 << 16, 1)  # numpy: DLPack and a buffer export
    assert hasattr(src, "__dlpack_device__")
    region = a.register(src, name="src")
    assert region.kind == "host"
    dst = b.alloc(1 << 16, name="dst")
    peer = await within(a.connect(b.address))
    result = await within(a.write(region[:], peer.region("dst")[:]))
    assert result.path == "shm"
    assert digest(dst.memoryview) == digest(src)


def test_metadata_carries_the_ipc_export() -> None:
    export = CudaExport(handle=bytes(range(64)), offset=4096, device=bytes(16))
    m = RegionMeta(name="kv", rid=1, key=2, nbytes=3, access=3, addr=0x7F00, kind="cuda",
                   cuda=export)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=RegionMeta)
    assert back == m and back.cuda is not None and back.cuda.version == 1

    class OldRegionMeta(msgspec.Struct, frozen=True):  # an agent from before CUDA
        name: str
        rid: int
        key: int
        nbytes: int
        access: int
        addr: int

    old = msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=OldRegionMeta)
    assert old.name == "kv"
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=RegionMeta)
    assert new.kind == "host" and new.cuda is None


# ------------------------------------------------------------ with a GPU


def ipc_open_count() -> int | None:
    """Peer allocations this process has open by CUDA IPC, where the driver is
    the software one (it counts them); None with a real driver."""
    path = os.environ.get("AIOXFER_CUDA_DRIVER")
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        count = lib.fakecuda_ipc_open_count
    except (OSError, AttributeError):
        return None
    return int(count())


async def _gpu_serve(conn: Any, opts: dict[str, Any]) -> None:
    size = opts["size"]
    loop = asyncio.get_running_loop()
    async with aioxfer.Agent("gpu-child") as agent:
        buf = cuda.DeviceBuffer(size)
        agent.register(buf, name="gpu")
        # a second region in the same allocation: one IPC mapping for both
        agent.register(cuda.DevicePointer(buf.ptr + size // 2, size // 2, owner=buf),
                       name="gpu_half")
        agent.alloc(size, name="pool")
        conn.send({"address": agent.address, "pid": os.getpid()})
        while True:
            cmd, args = await loop.run_in_executor(None, conn.recv)
            try:
                if cmd == "quit":
                    conn.send(("ok", None))
                    return
                if cmd == "upload":
                    off, n, seed = args
                    buf.upload(pattern(n, seed), off)
                    result: Any = None
                elif cmd == "digest":
                    off, n = args
                    result = digest(buf.download(off, n))
                elif cmd == "deregister":
                    agent.deregister(agent.region(args[0]))
                    result = None
                else:
                    raise ValueError(cmd)
                conn.send(("ok", result))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def gpu_child_main(conn: Any, opts: dict[str, Any]) -> None:
    run_child(_gpu_serve, conn, opts)


class GpuChild:
    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=gpu_child_main, args=(child, {"size": size}), daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(60):
            raise AssertionError("GPU child did not start")
        hello = self._conn.recv()
        assert isinstance(hello, dict), hello
        self.address: str = hello["address"]
        self.pid: int = hello["pid"]

    async def call(self, cmd: str, *args: Any) -> Any:
        def rpc() -> Any:
            self._conn.send((cmd, args))
            if not self._conn.poll(STEP * 3):
                raise AssertionError(f"GPU child: {cmd} did not answer")
            return self._conn.recv()

        reply = await asyncio.get_running_loop().run_in_executor(None, rpc)
        assert reply[0] == "ok", reply
        return reply[1]

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self._conn.close()


@pytest.fixture
async def gpu_child() -> Any:
    children: list[GpuChild] = []

    async def factory(size: int) -> GpuChild:
        c = GpuChild(size)
        children.append(c)
        return c

    yield factory
    for c in children:
        try:
            if c.proc.is_alive():
                await c.call("quit")
        except (AssertionError, OSError, EOFError):
            pass
        c.close()


@gpu
@pytest.mark.gpu
async def test_gpu_register_local(make_agent: Any) -> None:
    agent = await make_agent("a")
    assert "cuda" in agent.transports
    buf = cuda.DeviceBuffer(1 << 20)
    try:
        region = agent.register(buf, name="gpu")
        assert region.kind == "cuda" and region.nbytes == 1 << 20 and region._cuda is not None
        with pytest.raises(TypeError, match="no host bytes to view"):
            region.memoryview  # noqa: B018
        sub = agent.register(cuda.DevicePointer(buf.ptr + 4096, 4096, owner=buf), name="sub")
        assert sub._cuda is not None and sub._cuda.offset == 4096
        _, base, alloc_size = _cyx.cuda_pointer(buf.ptr, 1)  # the driver may round up
        assert base == buf.ptr and alloc_size >= 1 << 20
        # The next allocation is often right after this one (the driver hands
        # them out back to back): a range into it is still refused, since a
        # peer maps each allocation on its own.
        nxt = cuda.DeviceBuffer(1 << 20)
        try:
            with pytest.raises(aioxfer.RegistrationError, match="runs past the device memory"):
                agent.register(cuda.DevicePointer(base + alloc_size - 4096, 8192), name="past")
        finally:
            nxt.close()
        agent.deregister(region)
        agent.deregister(sub)
    finally:
        await asyncio.sleep(0.1)
        agent.poll()
        buf.close()


@gpu
@pytest.mark.gpu
async def test_gpu_two_processes(make_agent: Callable[..., Awaitable[Any]],
                                 gpu_child: Any) -> None:
    size = 8 << 20
    child = await gpu_child(size)
    agent = await make_agent("a")
    peer = await within(agent.connect(child.address))
    assert peer.path == "cuda"
    rgpu = peer.region("gpu")
    assert rgpu.kind == "cuda"
    # opened at first use, in the context of the device that copies it
    assert ipc_open_count() in (None, 0)
    host = agent.register(pattern(size, 5), name="host")
    back = agent.alloc(size, name="back")
    # host -> remote GPU, many descriptors
    pages = [host[i : i + (64 << 10)] for i in range(0, size, 64 << 10)]
    rpages = [rgpu[i : i + (64 << 10)] for i in range(0, size, 64 << 10)]
    r = await within(agent.write(pages, rpages))
    assert r.path == "cuda" and r.nbytes == size
    assert await child.call("digest", 0, size) == digest(host.memoryview)
    # host memory to the same peer moves as shm (and says so)
    r = await within(agent.write(host[0:4096], peer.region("pool")[0:4096]))
    assert r.path == "shm"
    # remote GPU -> host
    r = await within(agent.read(back.segments([0], [size]), rgpu.segments([0], [size])))
    assert r.path == "cuda"
    assert digest(back.memoryview) == digest(host.memoryview)
    # a second region of the same allocation (the peer's IPC handle is opened once)
    half = peer.region("gpu_half")
    await within(agent.write(host[0 : size // 2], half[:]))
    assert ipc_open_count() in (None, 1)  # "gpu" and "gpu_half": one allocation, opened once
    assert await child.call("digest", size // 2, size // 2) == digest(
        host.memoryview[0 : size // 2])
    # local GPU -> remote GPU
    mine = cuda.DeviceBuffer(size)
    try:
        mine.upload(pattern(size, 9))
        local = agent.register(mine, name="mine")
        await within(agent.write(local[:], rgpu[:]))
        assert await child.call("digest", 0, size) == digest(pattern(size, 9))
        # remote GPU -> local GPU
        await child.call("upload", 0, size, 11)
        await within(agent.read(local[:], rgpu[:]))
        assert digest(mine.download()) == digest(pattern(size, 11))
        # a cancelled GPU transfer ends (cancelled, or done if it was quicker)
        t = agent.write(local[:], rgpu[:])
        t.cancel()
        try:
            await within(t)
        except asyncio.CancelledError:
            pass
        agent.deregister(local)
        # deregistration waits for what is in flight (it completes), and what
        # comes after it fails
        inflight = [agent.write(host[:], rgpu[:]) for _ in range(4)]
        await asyncio.sleep(0)  # posted
        await child.call("deregister", "gpu")
        for t in inflight:
            assert (await within(t)).nbytes == size
        await within(peer.refresh())
        assert rgpu.gone
        with pytest.raises(aioxfer.AccessDenied):
            await within(agent.write(host[0:4096], rgpu[0:4096]))
        assert ipc_open_count() in (None, 1)  # "gpu_half" still holds the allocation
        # the peer closed: its allocation is closed here once nothing uses it
        await within(peer.aclose())
        await wait_until(lambda: ipc_open_count() in (None, 0), what="IPC mapping closed")
    finally:
        await asyncio.sleep(0.2)
        agent.poll()
        mine.close()


def fake_driver() -> Any:
    """The software driver's library where it is the one loaded (its counters),
    else None (a real driver)."""
    path = os.environ.get("AIOXFER_CUDA_DRIVER")
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        lib.fakecuda_copy_tid.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None
    return lib


@gpu
@pytest.mark.gpu
async def test_gpu_lone_request_on_the_posting_thread(
        make_agent: Callable[..., Awaitable[Any]], gpu_child: Any) -> None:
    """A lone small GPU -> peer GPU write: its copy is enqueued by the thread
    that posts it (the event loop's), with no hand-off to the submit thread,
    and its event is polled ("adaptive" progress), by that thread too when
    the write is awaited alone, before any blocking wait; in "sleep" progress
    it is not polled. Counted by the software driver."""
    import threading

    size = 1 << 20
    child = await gpu_child(size)
    mine = cuda.DeviceBuffer(size)
    try:
        mine.upload(pattern(size, 3))
        for progress in ("adaptive", "sleep"):
            agent = await make_agent(f"a-{progress}", progress=progress)
            peer = await within(agent.connect(child.address))
            assert peer.path == "cuda"
            rgpu = peer.region("gpu")
            local = agent.register(mine, name="mine")
            await within(agent.write(local[0:4096], rgpu[0:4096]))  # opens the peer's memory
            lib = fake_driver()
            if lib:
                lib.fakecuda_query_tid.restype = ctypes.c_long
            q0 = lib.fakecuda_event_queries() if lib else 0
            polled_here = 0
            for i in range(1, 9):
                r = await within(agent.write(local[i * 4096 : (i + 1) * 4096],
                                             rgpu[i * 4096 : (i + 1) * 4096]))
                assert r.path == "cuda" and r.nbytes == 4096
                if lib:
                    assert lib.fakecuda_copy_tid() == threading.get_native_id()
                    # awaited alone: the posting thread polled its event and
                    # completed it (at least once: the stand-in's "GPU" is a
                    # thread a loaded machine may run late)
                    polled_here += lib.fakecuda_query_tid() == threading.get_native_id()
            if lib and progress == "adaptive":
                assert lib.fakecuda_event_queries() > q0
                assert polled_here > 0
            elif lib:
                assert lib.fakecuda_event_queries() == q0
            assert await child.call("digest", 0, 9 * 4096) == digest(
                pattern(size, 3)[0 : 9 * 4096])
            agent.deregister(local)
            await within(peer.aclose())
    finally:
        await asyncio.sleep(0.1)
        mine.close()


@gpu
@pytest.mark.gpu
async def test_gpu_memory_over_verbs(make_agent: Any, verbs_provider: str) -> None:
    """GPUDirect RDMA through the Agent: GPU regions registered by dmabuf
    travel over verbs, both as the target (the peer's NIC writes and reads
    device memory) and as the source, including writes small enough that a
    host source would be posted inline (a device source never is: the CPU
    cannot read it; softverbs faults such a post)."""
    a = await make_agent("a", transports=("verbs",))
    b = await make_agent("b", transports=("verbs",))
    size = 1 << 20
    buf_a, buf_b = cuda.DeviceBuffer(size), cuda.DeviceBuffer(size)
    try:
        a.register(buf_a, name="ga")
        a.alloc(size, name="ha")
        gb = b.register(buf_b, name="gb")
        hb = b.register(pattern(size, 3), name="hb")
        back = b.alloc(size, name="back")
        peer = await within(b.connect(a.address))
        assert peer.path == "verbs"
        ga, ha = peer.region("ga"), peer.region("ha")
        assert ga.kind == "cuda"
        if not os.environ.get("AIOXFER_CUDA_DRIVER"):
            # A real GPU with the software provider (seen on an H200): softverbs
            # cannot map a real dmabuf (no CPU access to device memory), so the
            # GPU regions stay off verbs, with a warning naming GPUDirect, and a
            # transfer to one fails typed and promptly; host memory still moves.
            with pytest.raises(aioxfer.XferError):
                await within(b.write(hb[:], ga[:]))
            await within(b.write(hb[:], ha[:]))
            assert digest(a.region("ha").memoryview) == digest(hb.memoryview)
            return
        # host -> remote GPU, then remote GPU -> host
        r = await within(b.write(hb[:], ga[:]))
        assert r.path == "verbs" and r.nbytes == size
        assert digest(buf_a.download()) == digest(hb.memoryview)
        await within(b.read(back[:], ga[:]))
        assert digest(back.memoryview) == digest(hb.memoryview)
        # local GPU -> remote host: whole, and small pieces (never inline)
        buf_b.upload(pattern(size, 7))
        await within(b.write(gb[:], ha[:]))
        await within(b.write([gb[i : i + 200] for i in range(0, 4000, 400)],
                             [ha[i + 1 : i + 201] for i in range(0, 4000, 400)]))
        await within(b.write(gb[0:64], ha[5000:5064]))
        src = pattern(size, 7).tobytes()
        expect = bytearray(src)
        for i in range(0, 4000, 400):
            expect[i + 1 : i + 201] = src[i : i + 200]
        expect[5000:5064] = src[0:64]
        assert digest(a.region("ha").memoryview) == digest(bytes(expect))
        # local GPU -> remote GPU
        await within(b.write(gb[:], ga[:]))
        assert digest(buf_a.download()) == digest(pattern(size, 7))
    finally:
        await asyncio.sleep(0.1)
        a.poll()
        b.poll()
        buf_a.close()
        buf_b.close()


@gpu
@pytest.mark.gpu
async def test_gpu_memory_never_offered_to_host_paths(make_agent: Any) -> None:
    a = await make_agent("a")
    b = await make_agent("b", transports=("tcp",))
    buf_a, buf_b = cuda.DeviceBuffer(1 << 16), cuda.DeviceBuffer(1 << 16)
    try:
        ga = a.register(buf_a, name="ga")
        b.register(buf_b, name="gb")
        ha = a.register(bytearray(1 << 16), name="ha")
        b.alloc(1 << 16, name="hb")
        peer = await within(a.connect(b.address))
        assert peer.path == "tcp"
        gb, hb = peer.region("gb"), peer.region("hb")
        assert gb.kind == "cuda" and hb.kind == "host"
        for src, dst in ((ha[:], gb[:]), (ga[:], hb[:]), ([ha[:]], [gb[:]]),
                         (ha.segments([0], [16]), gb.segments([0], [16]))):
            with pytest.raises(aioxfer.TransportError, match="is cuda memory, which path 'tcp'"):
                a.write(src, dst)  # type: ignore[arg-type]
        # host memory still moves on that path
        await within(a.write(ha[:], hb[:]))
        a.deregister(ga)
    finally:
        await asyncio.sleep(0.1)
        a.poll()
        b.poll()
        buf_a.close()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("side", ["file_region", "posix"])
async def test_gpu_file_round_trip(make_agent: Any, tmp_path: Any, side: str) -> None:
    from aioxfer.staging import PATH, GpuFileStager, PosixFile

    page = 3 << 20  # larger than a slot: moved in pieces
    agent = await make_agent("a")
    buf = cuda.DeviceBuffer(2 * page)
    path = tmp_path / "kv.bin"
    posix = PosixFile(path) if side == "posix" else None
    # the engine's file transport (a file region), or pread/pwrite threads
    file: Any = posix if posix is not None else agent.register_file(path, size=page + 4096)
    try:
        gpu_region = agent.register(buf, name="kv")
        buf.upload(pattern(page, 21), page)
        async with GpuFileStager(agent, file, slot_bytes=1 << 20, slots=2) as stager:
            r = await within(stager.gpu_to_file(gpu_region[page : 2 * page], 4096))
            assert r.path == PATH == "cuda+file (host staging)" and r.nbytes == page
            with open(path, "rb") as fh:
                fh.seek(4096)
                assert digest(fh.read(page)) == digest(pattern(page, 21))
            # two pages back at once, into the other half, through both slots
            await within(asyncio.gather(
                stager.file_to_gpu(4096, gpu_region[0 : page // 2]),
                stager.file_to_gpu(4096 + page // 2, gpu_region[page // 2 : page]),
            ))
            assert digest(buf.download(0, page)) == digest(pattern(page, 21))
            with pytest.raises((aioxfer.TransportError, IndexError)):
                await within(stager.file_to_gpu(page, gpu_region[0:page]))  # past its end
        agent.deregister(gpu_region)
    finally:
        if posix is not None:
            posix.close()
        await asyncio.sleep(0.1)
        agent.poll()
        buf.close()


@gpu
@pytest.mark.gpu
async def test_gpu_peer_killed(make_agent: Any, gpu_child: Any) -> None:
    size = 64 << 20
    child = await gpu_child(size)
    agent = await make_agent("a", peer_timeout=2.0, keepalive=0.2)
    peer = await within(agent.connect(child.address))
    host = agent.alloc(size, name="host")
    rgpu = peer.region("gpu")
    transfers = [agent.write(host[:], rgpu[:]) for _ in range(8)]
    os.kill(child.pid, signal.SIGKILL)
    for t in transfers:
        try:
            await within(t)
        except aioxfer.PeerLost:
            pass
    # the copies already on the GPU finish; what comes after the death fails
    with pytest.raises(aioxfer.PeerLost):
        await within(agent.write(host[:], rgpu[:]))
    assert peer.lost
    # the dead peer's memory is unmapped here once the copies into it are over
    await wait_until(lambda: ipc_open_count() in (None, 0), what="IPC mapping closed")


# ------------------------------------------------------------ the GPU tests, here


def test_gpu_tests_on_the_software_driver(tmp_path: Any, fakecuda: Path) -> None:
    """Runs the ``gpu`` tests above, the conformance suite over "cuda" and
    test_nixl_cuda's VRAM tests in fresh processes whose driver is
    native/tests/fakecuda.c (device memory = shared memfd mappings, streams =
    threads, IPC through /proc): the engine's CUDA path, IPC import cache,
    event waits, revocation and peer death run on machines without a GPU."""
    env = dict(os.environ, AIOXFER_CUDA_DRIVER=str(fakecuda))
    here = os.path.dirname(os.path.abspath(__file__))
    # the GPU tests, then the conformance suite over the "cuda" path
    # and NIXL's VRAM segments through aioxfer.nixl (torch is not here)
    for selection in (["-m", "gpu", os.path.join(here, "test_cuda.py")],
                      ["-k", "cuda", os.path.join(here, "test_conformance.py")],
                      ["-m", "gpu", "-k", "not torch", os.path.join(here, "test_nixl_cuda.py")]):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
            env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


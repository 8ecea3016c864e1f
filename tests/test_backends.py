"""The local-backend interface (aioxfer.backends): the registry, plugins found
through the entry-point group ``aioxfer.backends`` (examples/plugin/, pip
installed here), and the semantics every local backend gets from
LocalBackend, run over each backend: the example plugin, the object backend
(against rclone serve s3) and a backend defined in this file."""

from __future__ import annotations

import asyncio
import importlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3server
from conftest import REPO, pattern, wait_until, within

import aioxfer
from aioxfer.backends import (
    BackendRegion,
    LocalBackend,
    add_backend,
    available,
    backend_class,
    backends_of,
    instance,
    register_region,
    registry,
)
from aioxfer.backends.testing import check_local_backend
from aioxfer.errors import ObjectNotFound

s3 = s3server.s3
MakeAgent = Callable[..., Awaitable[Any]]
KiB = 1 << 10


# ---------------------------------------------------------------- the plugin


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/plugin installed (pip, into a directory of its own put on
    sys.path, as site-packages would be): its entry point is then visible."""
    target = tmp_path_factory.mktemp("plugin-site")
    # Built from a copy: a build leaves build/ and *.egg-info beside its sources.
    source = tmp_path_factory.mktemp("plugin-src") / "plugin"
    shutil.copytree(Path(REPO) / "examples" / "plugin", source)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield str(target)
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("aioxfer_dirstore", None)


def test_plugin_is_found_by_entry_point(plugin: str) -> None:
    found = available()
    assert found["dirstore"] == "aioxfer_dirstore:DirStoreBackend"
    assert found["object"] == "aioxfer.backends.objects:ObjectBackend"
    cls = backend_class("dirstore")
    assert issubclass(cls, LocalBackend) and cls.kind == "dirstore"
    assert cls.__module__ == "aioxfer_dirstore"
    assert Path(sys.modules["aioxfer_dirstore"].__file__ or "").is_relative_to(plugin)


def test_registry_errors() -> None:
    with pytest.raises(LookupError, match="no aioxfer backend named 'nope'.*object"):
        backend_class("nope")
    with pytest.raises(ValueError, match="exists already"):
        add_backend("object", MemBackend)

    class Old(LocalBackend):
        name = kind = "old"
        api_version = 0

    with pytest.raises(TypeError, match="API version 0"):
        add_backend("old", Old)
    add_backend("test-not-a-backend", "builtins:dict")  # imported on first use
    with pytest.raises(TypeError, match="not a LocalBackend"):
        backend_class("test-not-a-backend")


# ---------------------------------------------------------------- a backend of this file


class MemSegment:
    __slots__ = ("region", "key", "offset", "length")

    def __init__(self, region: MemRegion, key: str) -> None:
        self.region = region
        self.key = key
        self.offset = 0
        self.length: int | None = None


class MemRegion(BackendRegion):
    kind = "mem"

    def __init__(self, backend: MemBackend, name: str) -> None:
        super().__init__(backend, name)
        self.blobs: dict[str, bytes] = {}

    def __getitem__(self, key: str) -> MemSegment:
        self._check()
        return MemSegment(self, key)

    def segments(self, keys: Sequence[str]) -> list[MemSegment]:
        return [self[k] for k in keys]


class MemBackend(LocalBackend):
    """Blobs in a dict, each op yielding to the loop a few times: measures
    how many ops run at once; the key "boom" fails with a non-XferError."""

    name = "mem"
    kind = "mem"
    max_concurrency = 3

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        self.now = 0
        self.peak = 0
        self.done: list[str] = []  # keys, in the order their puts finished
        # Set: every op waits for it (a deadline test's op cannot finish
        # first: 48 in-loop copies can take less than its 1 ms).
        self.hold: asyncio.Event | None = None

    def register(self, name: str = "mem") -> MemRegion:
        region = MemRegion(self, name)
        self._add_region(region)
        return region

    def far_segments(self, far: Any, op: str) -> Sequence[Any]:
        return (far,) if isinstance(far, MemSegment) else far

    async def _step(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            if self.hold is not None:
                await self.hold.wait()
        finally:
            self.now -= 1

    async def put(self, src: memoryview, far: MemSegment) -> None:
        await self._step()
        if far.key == "boom":
            raise KeyError("boom")
        far.region.blobs[far.key] = bytes(src)
        self.done.append(far.key)

    async def get(self, dst: memoryview, far: MemSegment) -> None:
        await self._step()
        try:
            blob = far.region.blobs[far.key]
        except KeyError:
            raise ObjectNotFound(f"no blob {far.key!r}") from None
        dst[:] = blob


add_backend("mem-test", MemBackend)


# ---------------------------------------------------------------- every backend


@pytest.fixture(params=["mem-test", "dirstore", "object"])
async def store(
    request: pytest.FixtureRequest, make_agent: MakeAgent, tmp_path: Path
) -> AsyncIterator[tuple[Any, Any]]:
    """(agent, region) of each backend."""
    agent = await make_agent(f"be-{request.param}")
    if request.param == "dirstore":
        request.getfixturevalue("plugin")
        region = register_region(agent, "dirstore", tmp_path / "blobs")
    elif request.param == "object":
        srv = request.getfixturevalue("s3")
        region = agent.register_objects(f"s3://{srv.bucket()}", **srv.kwargs())
    else:
        region = register_region(agent, "mem-test")
    yield agent, region


async def test_roundtrip_and_batches(store: tuple[Any, Any]) -> None:
    agent, region = store
    backend = region.backend
    n, size = 24, 16 * KiB
    data = pattern(n * size, 11)
    src = agent.register(bytearray(data.tobytes()))
    t = agent.write(src[0:size], region["one"])
    assert isinstance(t, aioxfer.Transfer) and not t.done()
    res = await within(t)
    assert (res.nbytes, res.path) == (size, backend.name)
    dst = agent.register(bytearray(n * size))
    await within(agent.read(dst[0:size], region["one"]))
    assert bytes(dst.obj[0:size]) == data.tobytes()[0:size]

    keys = [f"k{i}" for i in range(n)]
    offs = np.arange(n, dtype=np.uint64) * size
    lens = np.full(n, size, dtype=np.uint64)
    await within(agent.write(src.segments(offs, lens), region.segments(keys)), 60)
    dst.numpy()[:] = 0
    await within(agent.read([dst[i * size : (i + 1) * size] for i in range(n)],
                            [region[k] for k in keys]), 60)
    assert dst.obj == src.obj
    st = backend.statistics()
    assert (st.transfers_posted, st.transfers_completed, st.transfers_failed) == (4, 4, 0)
    assert st.ops == 2 + 2 * n and st.bytes == 2 * size + 2 * n * size and st.in_flight == 0
    assert backend in backends_of(agent) and instance(agent, backend.name) is backend


async def test_missing_key_is_typed_with_its_index(store: tuple[Any, Any]) -> None:
    agent, region = store
    src = agent.register(bytearray(b"z" * 4096))
    await within(agent.write(src[0:100], region["here"]))
    with pytest.raises(ObjectNotFound) as exc:
        await within(agent.read([src[0:100], src[100:200], src[200:300]],
                                [region["here"], region["here"], region["absent"]]))
    assert exc.value.fail_index == 2 and exc.value.op == "read"
    st = region.backend.statistics()
    assert st.errors == {"ObjectNotFound": 1} and st.transfers_failed == 1
    assert st.in_flight == 0 and st.in_flight_bytes == 0


async def test_cancel_deadline_and_close(store: tuple[Any, Any]) -> None:
    agent, region = store
    backend = region.backend
    n, size = 48, 64 * KiB
    src = agent.register(bytearray(pattern(n * size, 12).tobytes()))
    keys = [f"c{i}" for i in range(n)]
    offs = np.arange(n, dtype=np.uint64) * size
    lens = np.full(n, size, dtype=np.uint64)
    await within(agent.write(src.segments(offs, lens), region.segments(keys)), 60)
    dst = agent.register(bytearray(n * size))

    t = agent.read(dst.segments(offs, lens), region.segments(keys))
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    # In flight until its I/O stopped, and nothing writes the memory after.
    await wait_until(lambda: backend.statistics().in_flight == 0, what="I/O stopped")
    dst.numpy()[:] = 0
    await asyncio.sleep(0.05)
    assert not dst.numpy().any()

    if isinstance(backend, MemBackend):
        backend.hold = asyncio.Event()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            await agent.read(dst.segments(offs, lens), region.segments(keys))
    await wait_until(lambda: backend.statistics().in_flight == 0, what="I/O stopped")
    if isinstance(backend, MemBackend):
        backend.hold = None
    assert backend.statistics().transfers_failed == 2

    t = agent.read(dst.segments(offs, lens), region.segments(keys))
    await asyncio.sleep(0)
    await within(agent.aclose())
    with pytest.raises(aioxfer.ClosedResourceError):
        await t
    st = backend.statistics()
    assert st.in_flight == 0 and st.regions == 0 and region.closed
    with pytest.raises(aioxfer.ClosedResourceError):
        region["x"]


async def test_conformance_checker(store: tuple[Any, Any]) -> None:
    """aioxfer.backends.testing, the check third-party backends run, passes
    on each backend here."""
    agent, region = store
    await check_local_backend(agent, region, close_agent=True)
    assert agent.closed


# ---------------------------------------------------------------- the machinery


async def test_bounded_concurrency_and_foreign_errors(make_agent: MakeAgent) -> None:
    agent = await make_agent("mem")
    region = register_region(agent, "mem-test")
    backend = region.backend
    src = agent.register(bytearray(20 * 64))
    keys = [f"k{i}" for i in range(20)]
    await within(agent.write([src[i * 64 : (i + 1) * 64] for i in range(20)],
                             region.segments(keys)))
    assert backend.peak == MemBackend.max_concurrency  # bounded, and used

    # A backend raising something else than an XferError: an XferError that
    # names the backend, the pair and the cause; the other pairs stop.
    with pytest.raises(aioxfer.XferError, match="segment 1 failed in backend 'mem-test'") as exc:
        await within(agent.write([src[0:64], src[64:128]], [region["a"], region["boom"]]))
    assert isinstance(exc.value.__cause__, KeyError) and exc.value.fail_index == 1
    # Checks that need no I/O raise at the call.
    with pytest.raises(ValueError, match="notify"):
        agent.write(src[0:64], region["a"], notify=b"n")
    with pytest.raises(ValueError, match="2 local segments but 1"):
        agent.write([src[0:1], src[1:2]], [region["a"]])
    other = await make_agent("other")
    with pytest.raises(ValueError, match="belongs to agent"):
        other.write(other.register(bytearray(4))[:], region["a"])
    with pytest.raises(aioxfer.RegistrationError, match="already has"):
        register_region(agent, "mem-test")


async def test_file_regions_are_the_file_backend(make_agent: MakeAgent, tmp_path: Path) -> None:
    """The file transport is the registry's built-in local backend "file":
    write/read reach it through the registry, its counters are its own."""
    agent = await make_agent("files")
    assert available()["file"] == "aioxfer.file_transport:FileBackend"
    region = register_region(agent, "file", tmp_path / "f.bin", size=1 << 20)
    assert isinstance(region, aioxfer.Region) and region.kind == "file"
    src = agent.register(bytearray(pattern(1 << 16, 13).tobytes()))
    res = await within(agent.write([src[0:4096], src[4096:8192]],
                                   [region[0:4096], region[4096:8192]]))
    assert res.path == "file"
    dst = agent.register(bytearray(1 << 16))
    await within(agent.read(dst[0:8192], region[0:8192]))
    assert bytes(dst.obj[0:8192]) == bytes(src.obj[0:8192])
    (backend,) = [b for b in backends_of(agent) if b.name == "file"]
    st = backend.statistics()
    assert (st.kind, st.regions, st.transfers_posted, st.transfers_completed) == ("file", 1, 2, 2)
    assert st.bytes == 2 * 8192 and st.in_flight == 0
    assert not agent.peers  # no peer for it
    with pytest.raises(ValueError, match="notify"):
        agent.write(src[0:4096], region[0:4096], notify=b"x")


async def test_priority_overtakes_queued_bulk(make_agent: MakeAgent) -> None:
    """Pairs wait for the backend's slots by priority: an urgent request posted
    after five bulk ones (15 workers waiting for 3 slots) is served next."""
    agent = await make_agent("prio")
    region = register_region(agent, "mem-test")
    backend = region.backend
    src = agent.register(bytearray(64))
    bulk = [agent.write([src[0:64]] * 10, region.segments([f"b{j}-{i}" for i in range(10)]))
            for j in range(5)]
    await asyncio.sleep(0)  # the bulk workers are queued for the slots
    urgent = agent.write(src[0:64], region["urgent"], priority=5)
    await within(asyncio.gather(urgent, *bulk))
    assert len(backend.done) == 51
    # Served at the first free slot: after at most the 3 bulk pairs in progress
    # and those that had their slots at that moment.
    assert backend.done.index("urgent") <= 2 * MemBackend.max_concurrency


class JournalBackend(MemBackend):
    """MemBackend that writes a journal file when its agent closes."""

    name = "journal"
    kind = "journal"
    path: Path | None = None

    async def close(self) -> None:
        assert JournalBackend.path is not None
        JournalBackend.path.write_bytes(b"closed\n")


add_backend("journal-test", JournalBackend)


async def test_a_failing_backend_close_does_not_leave_the_others_open(
        s3: Any, tmp_path: Path) -> None:
    """A backend's close fails for real (its journal directory is gone):
    agent.aclose() still closes the backend registered after it (the
    object backend: its region closed, its HTTP session released) and runs
    the closers, then raises that error. (Before: it stopped at the failing
    backend, the object backend's session and regions left open.)"""
    (tmp_path / "j").mkdir()
    JournalBackend.path = tmp_path / "j" / "log"
    agent = aioxfer.Agent("be-journal")
    await agent.start()
    register_region(agent, "journal-test")
    objs = agent.register_objects(f"s3://{s3.bucket()}", **s3.kwargs())
    src = agent.register(bytearray(b"x" * 100))
    await within(agent.write(src[:], objs["k"]))  # (the HTTP session is made)
    closed: list[bool] = []

    async def closer() -> None:
        closed.append(True)

    registry.on_close(agent, closer)
    shutil.rmtree(tmp_path / "j")
    with pytest.raises(FileNotFoundError):
        await within(agent.aclose())
    assert objs.closed and objs._session is None
    assert closed == [True]


class FlushRegion(MemRegion):
    """A MemRegion that writes its blobs to a file when it closes."""

    path: Path | None = None

    async def aclose(self) -> None:
        await super().aclose()
        if self.path is not None:
            self.path.write_bytes(b"".join(self.blobs.values()))


class FlushBackend(MemBackend):
    name = "flush"
    kind = "flush"
    closed_clients = False

    def register(self, name: str = "mem", path: Path | None = None) -> MemRegion:
        region = FlushRegion(self, name)
        region.path = path
        self._add_region(region)
        return region

    async def close(self) -> None:
        self.closed_clients = True


add_backend("flush-test", FlushBackend)


async def test_a_failing_region_close_does_not_leave_the_others_open(tmp_path: Path) -> None:
    """One region's close fails for real (its flush directory is gone): the
    backend's other regions and its clients are closed all the same, then
    agent.aclose() raises that error. (Before: the regions after it and the
    backend's close() were skipped.)"""
    (tmp_path / "gone").mkdir()
    agent = aioxfer.Agent("be-flush")
    await agent.start()
    bad = register_region(agent, "flush-test", "a", tmp_path / "gone" / "a")
    good = register_region(agent, "flush-test", "b", tmp_path / "b")
    backend = instance(agent, "flush-test")
    shutil.rmtree(tmp_path / "gone")
    with pytest.raises(FileNotFoundError):
        await within(agent.aclose())
    assert bad.closed and good.closed and (tmp_path / "b").exists()
    assert backend.closed_clients  # type: ignore[attr-defined]

"""rev34: a local backend's Transfer keeps Transfer's memory contract: after
a cancel it stays ``busy``, and ``settled()`` waits, until the backend's I/O
no longer touches the caller's memory. The backend here is a plugin of the
public interface over a real file, its preads/pwrites on worker threads
(LocalBackend.run_blocking), as a blocking client library's would be."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until, within

from aioxfer.backends import registry
from aioxfer.backends.base import BackendRegion, LocalBackend


class FileSeg:
    __slots__ = ("region", "offset")

    def __init__(self, region: GatedRegion, offset: int) -> None:
        self.region = region
        self.offset = offset


class GatedRegion(BackendRegion):
    kind = "gated-file"

    def __init__(self, backend: GatedFileBackend, name: str, path: Path) -> None:
        super().__init__(backend, name)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def __getitem__(self, offset: int) -> FileSeg:
        self._check()
        return FileSeg(self, offset)

    async def aclose(self) -> None:
        await super().aclose()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class GatedFileBackend(LocalBackend):
    """pread/pwrite of a file on worker threads, each waiting at a gate first."""

    kind = "gated-file"

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def register(self, path: Path, name: str = "gated") -> GatedRegion:
        region = GatedRegion(self, name, path)
        self._add_region(region)
        return region

    def far_segments(self, far: Any, op: str) -> Sequence[Any]:
        return (far,) if isinstance(far, FileSeg) else far

    def _io(self, write: bool, mem: memoryview, seg: FileSeg) -> None:
        self.entered.set()
        self.gate.wait(30)
        if write:
            os.pwrite(seg.region.fd, mem, seg.offset)
        else:
            os.preadv(seg.region.fd, [mem], seg.offset)

    async def put(self, src: memoryview, far: FileSeg) -> None:
        await self.run_blocking(self._io, True, src, far)

    async def get(self, dst: memoryview, far: FileSeg) -> None:
        await self.run_blocking(self._io, False, dst, far)


registry.add_backend("rev34-gated-file", GatedFileBackend)


@pytest.mark.parametrize("op", ["read", "write"])
async def test_cancelled_backend_transfer_stays_busy_until_its_io_stopped(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path, op: str
) -> None:
    agent = await make_agent("gated")
    path = tmp_path / "blobs.bin"
    path.write_bytes(b"F" * 4096)
    be = registry.instance(agent, "rev34-gated-file")
    assert isinstance(be, GatedFileBackend)
    region = be.register(path)
    buf = agent.register(bytearray(b"M" * 4096))
    t = getattr(agent, op)(buf[0:4096], region[0])
    try:
        await wait_until(be.entered.is_set, what="the backend's thread started")
        assert t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        # The thread still holds the memory: the transfer says so.
        assert t.busy, "a cancelled backend transfer whose thread runs is not busy"
        settled = t.settled()
        await asyncio.sleep(0.05)
        assert not settled.done(), "settled() ended while the backend's thread still ran"
    finally:
        be.gate.set()
    await within(t.settled())
    assert not t.busy
    # What the thread did after the cancel (why waiting mattered).
    if op == "read":
        assert bytes(buf.memoryview) == b"F" * 4096
    else:
        assert path.read_bytes() == b"M" * 4096


async def test_a_finished_backend_transfer_is_settled(
    make_agent: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    agent = await make_agent("gated-done")
    path = tmp_path / "blobs.bin"
    path.write_bytes(b"F" * 4096)
    be = registry.instance(agent, "rev34-gated-file")
    assert isinstance(be, GatedFileBackend)
    be.gate.set()
    region = be.register(path)
    buf = agent.register(bytearray(4096))
    t = agent.read(buf[0:4096], region[0])
    assert t.busy
    await within(t)
    await within(t.settled())
    assert not t.busy and bytes(buf.memoryview) == b"F" * 4096

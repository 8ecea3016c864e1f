"""A directory of blobs as an aioxfer local backend (an example plugin).

What a backend writes: a region class (its segments are what ``agent.write``
and ``agent.read`` take as the far side), ``far_segments``/``far_length`` (the
checks that need no I/O) and ``put``/``get`` (one pair each). aioxfer's
LocalBackend does the rest: Transfers, batching with bounded concurrency,
cancellation, closing with the agent, statistics.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aioxfer.backends import BackendRegion, LocalBackend
from aioxfer.errors import ObjectNotFound, RegistrationError, TransportError, XferError

__all__ = ["DirSegment", "DirStore", "DirStoreBackend"]


class DirSegment:
    """``store[key]`` (the whole blob) or ``store[key][a:b]``."""

    __slots__ = ("region", "key", "offset", "length")

    def __init__(self, region: DirStore, key: str, offset: int = 0,
                 length: int | None = None) -> None:
        self.region = region
        self.key = key
        self.offset = offset
        self.length = length

    def __getitem__(self, s: slice) -> DirSegment:
        start = s.start or 0
        if start < 0 or (s.stop is not None and s.stop < start):
            raise IndexError(f"[{s.start}:{s.stop}]: offsets are >= 0, stop >= start")
        length = None if s.stop is None else s.stop - start
        return DirSegment(self.region, self.key, self.offset + start, length)

    def __repr__(self) -> str:
        return f"<DirSegment {self.key!r} +{self.offset}>"


class DirStore(BackendRegion):
    kind = "dirstore"

    def __init__(self, backend: DirStoreBackend, name: str, root: Path) -> None:
        super().__init__(backend, name)
        self.root = root

    def __getitem__(self, key: str) -> DirSegment:
        self._check()
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid key {key!r}")
        return DirSegment(self, key)

    def segments(self, keys: Sequence[str]) -> list[DirSegment]:
        return [self[k] for k in keys]

    def path(self, key: str) -> Path:
        return self.root / key


def _write(path: Path, src: memoryview) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        done = 0
        while done < len(src):
            done += os.pwrite(fd, src[done:], done)
    finally:
        os.close(fd)
    os.replace(tmp, path)  # readers see the old blob or the new one, never half


def _read(path: Path, dst: memoryview, offset: int, whole: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if whole and size != len(dst):
            raise XferError(f"blob {path.name!r} is {size} bytes, the destination {len(dst)}")
        if offset + len(dst) > size:
            raise XferError(f"bytes [{offset}:{offset + len(dst)}] are past the end of "
                            f"blob {path.name!r} ({size} bytes)")
        done = 0
        while done < len(dst):  # straight into the registered memory
            n = os.preadv(fd, [dst[done:]], offset + done)
            if n == 0:
                raise XferError(f"blob {path.name!r} shrank while read")
            done += n
    finally:
        os.close(fd)


class DirStoreBackend(LocalBackend):
    name = "dirstore"
    kind = "dirstore"
    max_concurrency = 4  # worker threads busy at once

    def register(self, root: str | os.PathLike[str], *, name: str | None = None) -> DirStore:
        path = Path(root)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RegistrationError(f"cannot use {str(path)!r}: {exc.strerror}") from None
        region = DirStore(self, name or str(path), path)
        self._add_region(region)
        return region

    def far_segments(self, far: Any, op: str) -> Sequence[Any]:
        if isinstance(far, DirSegment):
            return (far,)
        if isinstance(far, Sequence) and all(isinstance(s, DirSegment) for s in far):
            return far
        raise TypeError(f"not dirstore segments: {type(far).__name__}")

    def far_length(self, seg: DirSegment, local_length: int, op: str, i: int) -> None:
        if op == "write" and (seg.offset or seg.length is not None):
            raise ValueError(f"segment {i}: a write replaces a whole blob")
        if seg.length is not None and seg.length != local_length:
            raise ValueError(f"segment {i}: local length {local_length} != {seg.length}")

    async def put(self, src: memoryview, far: DirSegment) -> None:
        try:
            await self.run_blocking(_write, far.region.path(far.key), src)
        except OSError as exc:
            raise TransportError(f"write of blob {far.key!r}: {exc.strerror}") from None

    async def get(self, dst: memoryview, far: DirSegment) -> None:
        whole = far.offset == 0 and far.length is None
        try:
            await self.run_blocking(_read, far.region.path(far.key), dst, far.offset, whole)
        except FileNotFoundError:
            raise ObjectNotFound(f"no blob {far.key!r} in {far.region.name}") from None
        except OSError as exc:
            raise TransportError(f"read of blob {far.key!r}: {exc.strerror}") from None

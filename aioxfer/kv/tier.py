"""What every tier implements for the Store (internal interface)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from aioxfer._uncancelled import finish_uncancelled
from aioxfer.errors import XferError
from aioxfer.kv.stats import TierCounters, TierStatistics, snapshot
from aioxfer.region import Region
from aioxfer.transfer import Transfer

if TYPE_CHECKING:
    from aioxfer.kv.store import Store

__all__ = ["Tier"]


class Tier:
    """A level of the store. Tiers below the host tier implement ``_locate``
    (synchronous index probe), ``_read`` (into registered host memory,
    verified) and ``_write`` (from registered host memory); the host tier is
    the store's own memory and is driven by the store directly."""

    kind = "tier"
    stores = True  # blocks may be written here (demotion, write-through, put)

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ValueError("a tier needs a non-empty name")
        self.name = name
        self.counters = TierCounters()
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError(f"tier {self.name!r} is not part of an open store")
        return self._store

    async def _open(self, store: Store) -> None:
        if self._store is not None:
            raise RuntimeError(f"tier {self.name!r} already belongs to a store")
        self._store = store

    async def _aclose(self) -> None:
        pass

    def _locate(self, key: bytes) -> Any | None:
        """Where ``key`` is in this tier, or None (no I/O; no await)."""
        raise NotImplementedError

    def _contains(self, key: bytes) -> bool:
        return self._locate(key) is not None

    async def _read(self, locs: list[Any], regions: list[Region],
                    offsets: list[int]) -> list[XferError | None]:
        """Reads block ``locs[i]`` into ``regions[i]`` at ``offsets[i]`` and
        verifies it; per block None (delivered) or the error. Corrupt blocks
        are quarantined here, by the tier that found them."""
        raise NotImplementedError

    async def _write(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                     *, durable: bool = False) -> list[bool]:
        """Stores blocks from registered host memory; per block True if it is
        now in this tier (False: not admitted, no room, or I/O error; counted)."""
        raise NotImplementedError

    async def _remove(self, keys: list[bytes]) -> int:
        raise NotImplementedError

    def _usage(self) -> tuple[int, int, int]:
        """(blocks, used_bytes, capacity_bytes)."""
        return 0, 0, 0

    def _extra(self) -> dict[str, int | float | str]:
        return {}

    def _pinned_blocks(self) -> int:
        return 0

    def _statistics(self) -> TierStatistics:
        blocks, used, cap = self._usage()
        return snapshot(self.name, self.kind, self.counters, blocks=blocks, used_bytes=used,
                        capacity_bytes=cap, pinned_blocks=self._pinned_blocks(),
                        extra=self._extra())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


async def landed(*transfers: Awaitable[Any]) -> list[Any]:
    """Awaits transfers that write a caller's memory; per transfer its result
    or the exception it failed with. Cancelled, it does not cut them short:
    a cancelled Transfer resolves at once while the engine may still write
    its destination (the engine's confirmation, AXF_E_CANCELLED, is not
    visible through it), so the caller could reuse memory that is still
    being written. It waits for them to end instead, then raises
    CancelledError: once that reaches the caller its memory is no longer
    written. Bounded by the engine's own paths (the agent's stall_timeout,
    peer liveness, its close) and a local backend's timeouts.

    Not done (kv20, measured): cancelling the engine's transfers and
    awaiting ``Transfer.settled()`` instead. Over loopback TCP, 64 MiB of
    reads cancelled 2 ms in ended no sooner (cancel to raise, medians of
    20 interleaved pairs: one 64 MiB read 13.2 ms vs 14.6 ms waiting, eight
    of 8 MiB 11.6 vs 11.5 ms: the engine's cancel stops only what it has
    not sent), and a local backend's transfer (a BackendTransfer: object
    stores) settles only when its runner ends, so waiting on it as here
    costs the same."""
    fut = asyncio.gather(*transfers, return_exceptions=True)
    if await finish_uncancelled(fut):
        raise asyncio.CancelledError
    return list(fut.result())


async def settle_on_cancel(transfers: Sequence[Transfer]) -> list[Any]:
    """Awaits transfers that read a caller's memory (a put's ``src``); per
    transfer its result or the exception it failed with. Cancelled, it
    cancels them (the engine stops what it has not started: a file write's
    chunks not yet issued) and waits, through any further cancel, until the
    engine no longer touches their memory (``Transfer.settled``), then
    raises CancelledError: once that reaches the caller, ``src`` is never
    read again. (Unlike ``landed``, which lets transfers that write a
    caller's memory run to their end, a put's cut short loses nothing: the
    blocks it did not finish are not stored.)"""
    fut = asyncio.gather(*transfers, return_exceptions=True)
    try:
        return list(await asyncio.shield(fut))
    except asyncio.CancelledError:
        for t in transfers:
            t.cancel()
        fut.add_done_callback(_retrieved)
        await finish_uncancelled(asyncio.gather(*(t.settled() for t in transfers)))
        raise


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()

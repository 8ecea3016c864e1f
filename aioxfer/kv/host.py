"""HostTier: registered host memory (one ``agent.alloc`` pool of fixed slots).

The pool is a memfd region the store reaches through its agent's own
loopback peer, so every move between the pool and a caller's registered
memory is one of the agent's one-sided transfers (the shm path: one memcpy on
the engine's copy threads, never a Python ``bytes``).

Policy, all counted in ``statistics()``:
- eviction order: ``"lru"`` (default), ``"fifo"``, ``"s3fifo"`` or ``"arc"``
  (aioxfer.kv.policy; S3-FIFO and ARC resist scans: one pass over cold
  blocks does not flush the blocks read again and again);
- watermarks: once more than ``high_watermark`` of the slots are used, a
  background demoter writes the coldest dirty blocks back to the next tier
  that stores (write-back) and frees slots until ``low_watermark``; clean
  blocks (already below) are simply dropped;
- ``write_through=True``: every put is also written to the next tier at once;
- ``promote=True``: a block fetched from a lower tier is copied in on its way
  to the caller;
- ``put_wait``: how long a put may wait for room (demotions in flight) before
  the rest of its blocks are dropped (counted as ``dropped_stores["no_room"]``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aioxfer._uncancelled import finish_uncancelled
from aioxfer.kv import checksum as ck
from aioxfer.kv.policy import POLICIES, EvictionPolicy, make_policy
from aioxfer.kv.tier import Tier
from aioxfer.log import get_logger
from aioxfer.region import Region, RemoteRegion

if TYPE_CHECKING:
    from aioxfer.kv.store import Store

__all__ = ["HostTier"]

_log = get_logger("aioxfer.kv")
_DEMOTE_BATCH = 64
_SCAN_FACTOR = 4  # how far past the coldest blocks eviction looks for unpinned ones


class HostTier(Tier):
    kind = "host"

    def __init__(
        self,
        capacity: int,
        *,
        name: str = "host",
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        eviction: str = "lru",
        write_through: bool = False,
        promote: bool = True,
        put_wait: float = 0.05,
    ) -> None:
        super().__init__(name)
        if capacity <= 0:
            raise ValueError("capacity must be positive (bytes)")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if eviction not in POLICIES:
            raise ValueError(f"eviction is one of {sorted(POLICIES)}, not {eviction!r}")
        if put_wait < 0:
            raise ValueError("put_wait must be >= 0 (seconds)")
        self.capacity = int(capacity)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.eviction = eviction
        self.write_through = write_through
        self.promote = promote
        self.put_wait = put_wait
        self.block_bytes = 0
        self.n_slots = 0
        self.region: Region | None = None
        self.remote: RemoteRegion | None = None
        self.index: dict[bytes, int] = {}
        self.policy: EvictionPolicy = make_policy(eviction, 1)  # sized at open
        self.slot_key: list[bytes | None] = []
        self.pins: list[int] = []
        self.pinned = 0  # slots with pins > 0
        self.dirty: set[int] = set()  # not yet in any lower tier
        self.demoting: set[int] = set()
        self.doomed: set[int] = set()  # evicted while pinned: freed at the last unpin
        self.removed_demoting: set[bytes] = set()  # removed while written back
        self.free: list[int] = []
        self._space: asyncio.Event | None = None
        self._kick: asyncio.Event | None = None
        self._demoter: asyncio.Task[None] | None = None
        self.published: Any = None  # a PeerTier's PeerIndex: what peers can read here
        # Keys read at least once while here (kept only when a lower tier
        # admits on reuse: DiskTier(admit="reused")).
        self.track_reuse = False
        self.reused: set[bytes] = set()

    async def _open(self, store: Store) -> None:
        await super()._open(store)
        bb = store.block_bytes
        n = self.capacity // bb
        if n < 1:
            raise ValueError(f"host tier {self.name!r}: capacity {self.capacity} holds no block "
                             f"of {bb} bytes")
        self.block_bytes, self.n_slots = bb, n
        self.policy = make_policy(self.eviction, n)
        self.region = store.agent.alloc(n * bb, name=f"{store.name}.{self.name}")
        self.remote = await store._remote(self.region)
        self.slot_key = [None] * n
        self.pins = [0] * n
        self.free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first
        self._space = asyncio.Event()
        self._kick = asyncio.Event()

    async def _aclose(self) -> None:
        await self._stop_demoter()

    async def _stop_demoter(self) -> None:
        """Stops the write-back (Store.aclose: before the tiers it writes to
        close) and waits for it to end, through a cancel of the caller, which
        is raised once it has (kv22: a suppress(CancelledError) around the
        wait swallowed the caller's cancel with the demoter's own, and a
        cancelled Store.aclose returned as if it had not been)."""
        task = self._demoter
        if task is None:
            return
        task.cancel()
        # (gather: the demoter's own CancelledError, or a failure, is its
        # result here, never raised as ours.)
        cancelled = await finish_uncancelled(asyncio.gather(task, return_exceptions=True))
        if self._demoter is task:
            self._demoter = None
        if cancelled:
            raise asyncio.CancelledError

    # ------------------------------------------------------------ bookkeeping

    @property
    def used(self) -> int:
        return self.n_slots - len(self.free)

    def _usage(self) -> tuple[int, int, int]:
        return len(self.index), len(self.index) * self.block_bytes, self.n_slots * self.block_bytes

    def _pinned_blocks(self) -> int:
        return self.pinned

    def _extra(self) -> dict[str, int | float | str]:
        return {"dirty": len(self.dirty), "demoting": len(self.demoting),
                "free_slots": len(self.free)}

    def _locate(self, key: bytes) -> int | None:
        return self.index.get(key)

    def touch(self, key: bytes) -> None:
        self.policy.hit(key)

    def pin(self, slot: int) -> None:
        if not self.pins[slot]:
            self.pinned += 1
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        p = self.pins[slot] - 1
        self.pins[slot] = p
        if not p:
            self.pinned -= 1
            if slot in self.doomed:
                self.doomed.discard(slot)
                self._release_slot(slot)

    def _release_slot(self, slot: int) -> None:
        self.slot_key[slot] = None
        self.free.append(slot)
        assert self._space is not None
        self._space.set()

    def publish(self, index: Any) -> None:
        """Keeps ``index`` (a PeerIndex) in step with this tier, or stops (None)."""
        self.published = index
        if index is not None and self.region is not None:
            for key, slot in self.index.items():
                self._publish_one(key, slot)

    def _publish_one(self, key: bytes, slot: int) -> None:
        assert self.region is not None
        bb = self.block_bytes
        crc = ck.checksum(self.region.memoryview[slot * bb:(slot + 1) * bb])
        self.published.add(key, slot, crc)

    def insert(self, key: bytes, slot: int, *, dirty: bool) -> bool:
        """Publishes a filled slot under ``key``; False when ``key`` is here
        already in another slot (two writers filled it at once: a put and a
        member's placement, which checks the index, not the store's
        ``_filling``). The one published first stays (readers may hold it),
        ``slot`` goes back; the copies are the same block (the key names its
        content). A second ``index[key] = slot`` would orphan the first
        slot: neither free nor indexed, for good."""
        old = self.index.get(key)
        if old is not None and old != slot:
            if dirty:
                self.mark_unwritten(key)
            self._release_slot(slot)
            return False
        self.index[key] = slot
        self.policy.insert(key)
        self.slot_key[slot] = key
        if dirty:
            self.dirty.add(slot)
        if self.published is not None:
            self._publish_one(key, slot)
        self._maybe_demote()
        return True

    def mark_unwritten(self, key: bytes) -> None:
        """``key``'s copy here is to reach the tier below (a put's), though
        the copy kept may be a member's clean one (dropped on eviction):
        written back unless that tier holds it already."""
        store = self._store
        lower = store._next_storing_tier(self) if store is not None else None
        if lower is not None and lower._locate(key) is None:
            self.dirty.add(self.index[key])

    def evict(self, key: bytes, reason: str) -> None:
        slot = self.index.pop(key)
        self.reused.discard(key)
        if self.published is not None:
            self.published.remove(key)
        # Only the policy's own choices are remembered by its ghost lists.
        self.policy.remove(key, evicted=reason in ("capacity", "demoted"))
        self.dirty.discard(slot)
        self.counters.evicted(reason)
        if reason == "removed" and slot in self.demoting:
            self.removed_demoting.add(key)  # its write-back takes it out again
        if self.pins[slot]:
            self.doomed.add(slot)  # a reader still copies out of it
        else:
            self._release_slot(slot)

    def take_free(self, k: int) -> list[int]:
        """Up to k free slots now, evicting nothing."""
        free = self.free
        got = free[-k:][::-1] if k else []
        del free[len(free) - len(got):]
        return got

    def _take(self, k: int) -> list[int]:
        """Up to k free slots now, evicting clean unpinned cold blocks (no I/O,
        no await); never waits."""
        got = self.take_free(k)
        if len(got) < k:
            index, pins, dirty, demoting = self.index, self.pins, self.dirty, self.demoting

            def busy(key: bytes) -> bool:
                slot = index[key]
                return bool(pins[slot]) or slot in dirty or slot in demoting

            want = k - len(got)
            victims = self.policy.coldest(want, busy, _SCAN_FACTOR * want + 16)
            for key in victims:
                self.evict(key, "capacity")
            got += self.take_free(k - len(got))
        return got

    async def reserve(self, k: int, wait: float) -> list[int]:
        """Up to k slots: free ones, clean evictable ones, then whatever the
        demoter frees within ``wait`` seconds. Never spins: it sleeps on the
        event the demoter and unpins set."""
        got = self._take(k)
        if len(got) >= k or wait <= 0:
            return got
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        assert self._space is not None
        try:
            while len(got) < k:
                if not (self.dirty or self.demoting or self.pinned):
                    break  # nothing will free up: fail fast
                self._kick_demoter()
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._space.clear()
                try:
                    async with asyncio.timeout(left):
                        await self._space.wait()
                except TimeoutError:
                    pass
                got.extend(self._take(k - len(got)))
        except BaseException:
            self.give_back(got)
            raise
        return got

    def give_back(self, slots: list[int]) -> None:
        """Reserved slots that were never published."""
        for s in slots:
            self._release_slot(s)

    # ------------------------------------------------------------ write-back

    def _maybe_demote(self) -> None:
        if self.n_slots - len(self.free) > self.high_watermark * self.n_slots:
            self._kick_demoter()

    def _kick_demoter(self) -> None:
        store = self._store
        if store is None or store._closing:
            return
        if store._next_storing_tier(self) is None and not self.dirty:
            # Nothing to write back to: clean eviction on demand is enough.
            return
        assert self._kick is not None
        self._kick.set()
        if self._demoter is None or self._demoter.done():
            self._demoter = asyncio.get_running_loop().create_task(
                self._demote_loop(), name=f"aioxfer-kv-demote-{self.name}")

    def _coldest_unpinned(self, limit: int) -> list[bytes]:
        index, pins, demoting = self.index, self.pins, self.demoting

        def busy(key: bytes) -> bool:
            slot = index[key]
            return bool(pins[slot]) or slot in demoting

        return self.policy.coldest(limit, busy, _SCAN_FACTOR * limit + 16)

    async def _demote_loop(self) -> None:
        store = self.store
        assert self._kick is not None
        while True:
            await self._kick.wait()
            self._kick.clear()
            target = self.low_watermark * self.n_slots
            while self.used > target and not store._closing:
                excess = int(self.used - target + 0.999999)
                keys = self._coldest_unpinned(min(_DEMOTE_BATCH, max(1, excess)))
                if not keys:
                    break  # all pinned: the last unpin kicks us again via reserve
                lower = store._next_storing_tier(self)
                dirty = [k for k in keys if self.index[k] in self.dirty]
                for k in keys:
                    if self.index[k] not in self.dirty:
                        self.evict(k, "capacity")
                if not dirty:
                    continue
                if lower is None:
                    for k in dirty:
                        self.counters.dropped("no_lower_tier")
                        self.evict(k, "capacity")
                    continue
                await self._write_back(lower, dirty)

    async def _write_back(self, lower: Tier, keys: list[bytes], *, evict: bool = True) -> None:
        """Writes dirty blocks to ``lower`` (pinned while read), then frees
        them (``evict``) or keeps them as clean copies."""
        slots = [self.index[k] for k in keys]
        for s in slots:
            self.pin(s)
            self.demoting.add(s)
        bb = self.block_bytes
        assert self.region is not None
        try:
            ok = await lower._write(keys, [self.region] * len(keys), [s * bb for s in slots])
        except Exception as exc:
            _log.warning("kv.demote_failed", tier=self.name, lower=lower.name, blocks=len(keys),
                         error=repr(exc))
            ok = [False] * len(keys)
        except BaseException:  # cancelled (the store closes): nothing to undo after
            self.removed_demoting.difference_update(keys)
            raise
        finally:
            for s in slots:
                self.demoting.discard(s)
                self.unpin(s)
        undo: list[bytes] = []
        for key, slot, stored in zip(keys, slots, ok, strict=True):
            if key in self.removed_demoting:
                self.removed_demoting.discard(key)
                if stored and key not in self.index:
                    undo.append(key)  # removed while written: not in the lower tier either
            if self.index.get(key) != slot:
                continue  # removed meanwhile
            if stored and not evict:
                self.dirty.discard(slot)
            elif stored:
                self.counters.demotions += 1
                self.evict(key, "demoted")
            elif evict:
                # The lower tier refused or failed (counted there): the block
                # is lost from the store, and counted here too, never silently.
                self.counters.dropped("demote_failed")
                self.evict(key, "capacity")
        if undo:
            try:
                await lower._remove(undo)
            except Exception as exc:
                _log.warning("kv.demote_undo_failed", tier=self.name, lower=lower.name,
                             blocks=len(undo), error=repr(exc))

"""ObjectTier: blocks as objects in S3-compatible storage, through the
object backend's region (``agent.register_objects("s3://bucket/prefix")``).

Each block is one object ``{prefix}{namespace tag}/{key hex}`` holding the
block's bytes followed by a 64-byte trailer (key, length, CRC32C, magic, and
a check over the trailer): self-describing, so a store that never saw the
object (another process, a restart) can find and verify it. A get is a
ranged GET of the block's bytes straight into the caller's registered memory
(the backend copies each received chunk there; no Python ``bytes``), checked
against the CRC before it counts as delivered; a corrupt object is
quarantined (deleted) and reported as BlockCorrupt.

Objects this store did not write are found by ``_probe``: a HEAD per key
(existence and size), then a ranged GET of the trailers that exist.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from aioxfer._uncancelled import finish_uncancelled, run_to_end
from aioxfer.backends.base import BackendTransfer
from aioxfer.errors import ObjectNotFound, TransportError, XferError
from aioxfer.kv import checksum as ck
from aioxfer.kv.disk import ENTRY, ENTRY_DTYPE, ENTRY_MAGIC, ENTRY_VERSION, F_LIVE, entry_check
from aioxfer.kv.disk import ns_tag as _ns_tag
from aioxfer.kv.errors import BlockCorrupt, BlockMissing, BlockUnavailable
from aioxfer.kv.tier import Tier, landed
from aioxfer.log import get_logger
from aioxfer.region import Region

if TYPE_CHECKING:
    from aioxfer.kv.store import Store

__all__ = ["ObjectTier"]

_log = get_logger("aioxfer.kv")
TRAILER = ENTRY
# ObjectTier.missing is swept of expired entries once it holds more than
# this many (and twice as many as after its last sweep).
_SWEEP_MIN = 1024
_ALGO_SHIFT = 4


class ObjectTier(Tier):
    """``objs``: an object region of the store's agent. ``prefix``: where
    under it the blocks go. ``batch``: blocks staged (block + trailer) per
    round of PUTs. ``absent_ttl``: seconds a key found absent is not asked
    of the bucket again (0: every get asks; other stores put meanwhile)."""

    kind = "object"
    probes = True  # its index is remote: misses are asked for (see _probe)
    durable = True

    def __init__(self, objs: Any, *, name: str = "object", prefix: str = "kv/",
                 namespace: bytes | str = b"", batch: int = 16,
                 absent_ttl: float = 2.0) -> None:
        super().__init__(name)
        if getattr(objs, "kind", None) != "object":
            raise TypeError("ObjectTier takes a region from agent.register_objects(...)")
        self.objs = objs
        self.namespace = namespace
        self.ns = _ns_tag(namespace)
        self.prefix = f"{prefix}{self.ns:08x}/"
        self.batch = batch
        self.index: dict[bytes, int] = {}  # key -> payload CRC
        self.stage: Region | None = None
        # One user of the stage at a time: concurrent puts (two callers, a
        # put beside the host tier's write-back) and probes each fill it and
        # hand it to requests that read or write it until they end.
        self.stage_lock = asyncio.Lock()
        # Keys not asked of the bucket again before a time: probed and
        # absent (for ``absent_ttl`` seconds: another store may put them
        # meanwhile), or removed or quarantined by this tier (inf while their
        # objects may still be there; until put again).
        self.missing: dict[bytes, float] = {}
        # Probed-and-absent entries stay until asked again: with ever new
        # keys (one per new prompt) they are swept (_sweep) whenever the
        # dict has doubled since the last sweep, so it stays within twice
        # its live entries (and _SWEEP_MIN) at an amortised O(1) per miss.
        self._sweep_at = _SWEEP_MIN
        self.absent_ttl = float(absent_ttl)
        self.block_bytes = 0

    async def _open(self, store: Store) -> None:
        await super()._open(store)
        self.block_bytes = store.block_bytes  # (statistics after close too)
        self.stage = store.agent.alloc(self.batch * (store.block_bytes + TRAILER),
                                       name=f"{store.name}.{self.name}.stage")

    async def _aclose(self) -> None:
        from aioxfer.kv.store import _deregister

        if self.stage is not None and not self.stage.closed:
            await _deregister(self.store.agent, self.stage)

    def object_key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _usage(self) -> tuple[int, int, int]:
        return len(self.index), len(self.index) * self.block_bytes, 0

    def _locate(self, key: bytes) -> tuple[bytes, int] | None:
        crc = self.index.get(key)
        return None if crc is None else (key, crc)

    # ------------------------------------------------------------ write

    def _trailer(self, key: bytes, crc: int) -> np.ndarray:
        rec = np.zeros(1, dtype=ENTRY_DTYPE)
        rec["key"] = np.frombuffer(key, dtype="V32")
        rec["ns"] = self.ns
        rec["length"] = self.store.block_bytes
        rec["crc"] = crc
        rec["orig"] = self.store.block_bytes
        rec["magic"] = ENTRY_MAGIC
        rec["version"] = ENTRY_VERSION
        rec["flags"] = F_LIVE | (ck.ALGO << _ALGO_SHIFT)
        raw = rec.view(np.uint8).reshape(1, ENTRY)
        rec["check"] = entry_check(raw)[0]
        row: np.ndarray = raw[0]
        return row

    async def _write(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                     *, durable: bool = False) -> list[bool]:
        assert self.stage is not None
        async with self.stage_lock:
            # Decided under the lock: a write that waited for it skips what
            # the one before it stored meanwhile (keys name their contents),
            # rather than PUT the same key again.
            ok = [k in self.index for k in keys]
            todo = [i for i, good in enumerate(ok) if not good]
            cancelled = False
            for b in range(0, len(todo), self.batch):
                cancelled = await self._write_batch(keys, regions, offsets, todo[b:b + self.batch],
                                                    ok)
                if cancelled:
                    break
        if cancelled:
            raise asyncio.CancelledError
        return ok

    def _fill_stage(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                    part: list[int]) -> tuple[list[Any], list[int]]:
        """Copies blocks ``part`` and their trailers into the stage and posts
        their PUTs. Apart from the awaits that follow: its views of the
        stage and of the caller's memory end here, never held across an
        await (a cancel's traceback kept such a view, and the mapping with
        it, alive past the region's release; kv24 in disk.py)."""
        bb = self.store.block_bytes
        rec = bb + TRAILER
        assert self.stage is not None
        stage = self.stage.numpy()
        agent = self.store.agent
        puts = []
        crcs = []
        for j, i in enumerate(part):
            # Block and trailer must be one contiguous object body: the
            # block is copied once into registered staging memory.
            src = np.frombuffer(regions[i].memoryview[offsets[i]:offsets[i] + bb],
                                dtype=np.uint8)
            stage[j * rec:j * rec + bb] = src
            crc = ck.checksum(self.stage.memoryview[j * rec:j * rec + bb])
            crcs.append(crc)
            stage[j * rec + bb:(j + 1) * rec] = self._trailer(keys[i], crc)
            puts.append(agent.write(self.stage[j * rec:(j + 1) * rec],
                                    self.objs[self.object_key(keys[i])]))
        return puts, crcs

    async def _write_batch(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                           part: list[int], ok: list[bool]) -> bool:
        """PUTs blocks ``part`` through the stage (the caller holds its lock);
        returns whether the caller was cancelled meanwhile (then the PUTs not
        finished are cancelled: a block not acknowledged is not stored). The
        stage is handed on only once no PUT reads it: else the next batch
        could refill it with other blocks while a PUT's client still reads
        it, and upload their bytes under this block's key (found corrupt, or
        never found: a durable put lost)."""
        puts, crcs = self._fill_stage(keys, regions, offsets, part)
        self.counters.writes += len(puts)
        self.counters.in_flight += len(puts)
        cancelled = False
        try:
            await asyncio.gather(*puts, return_exceptions=True)
        except asyncio.CancelledError:
            # The PUTs are cancelled with us (gather cancels them), and the
            # stage is not handed on before none of them reads it any more:
            # at once for a block the backend uploads from its own copy, at
            # the end of its upload for one past OWNED_MAX.
            cancelled = True
            for p in puts:
                p.cancel()
            stopped = [p.stopped() for p in puts if isinstance(p, BackendTransfer)]
            if stopped:
                await finish_uncancelled(asyncio.gather(*stopped))
        finally:
            self.counters.in_flight -= len(puts)
        results = [p.exception() if not p.cancelled() else asyncio.CancelledError()
                   for p in puts]
        for i, crc, r in zip(part, crcs, results, strict=True):
            if isinstance(r, BaseException):
                self.counters.errors += 1
                self.counters.dropped("io_error")
                continue
            self.index[keys[i]] = crc
            self.missing.pop(keys[i], None)
            ok[i] = True
            self.counters.puts += 1
            self.counters.put_bytes += self.store.block_bytes
        return cancelled

    # ------------------------------------------------------------ probe

    async def _probe(self, keys: list[bytes]) -> int:
        """Learns which of ``keys`` (in order) exist in the bucket; returns how
        many leading ones the tier now knows. A HEAD per unknown key, then one
        ranged GET of their trailers (into staging memory) to learn the CRCs."""
        bb = self.store.block_bytes
        n = self._known_prefix(keys)
        now = time.monotonic()
        missing = self.missing
        if len(missing) > self._sweep_at:
            self._sweep(now)

        def skip(k: bytes) -> bool:
            t = missing.get(k)
            if t is None:
                return False
            if t < now:
                del missing[k]  # absent a while ago: asked again
                return False
            return True

        # A batch of unknown keys at a time, from the first one not known,
        # until the leading run ends (a prefix longer than one batch is
        # found whole, not one batch per get).
        while n < len(keys) and not skip(keys[n]):
            unknown = list(itertools.islice(
                (k for k in keys[n:] if k not in self.index and not skip(k)), self.batch))
            try:
                stats = await self.objs.stat([self.object_key(k) for k in unknown])
            except XferError as exc:
                return self._probe_failed(keys, exc)
            present = []
            for k, st in zip(unknown, stats, strict=True):
                if st.exists and st.size == bb + TRAILER:
                    present.append(k)
                else:
                    self.missing[k] = now + self.absent_ttl
            if present:
                async with self.stage_lock:
                    try:
                        raw = await self._read_trailers(present)
                    except XferError as exc:
                        return self._probe_failed(keys, exc)
                    self._learn(present, raw)
            m = self._known_prefix(keys)
            if m == n:
                break  # (deleted meanwhile: asked again next time)
            n = m
        return n

    def _sweep(self, now: float) -> None:
        """Drops the absent entries whose ``absent_ttl`` ran out (the inf
        ones, removed or quarantined by this tier, stay)."""
        missing = self.missing
        for k in [k for k, until in missing.items() if until < now]:
            del missing[k]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(missing))

    def _probe_failed(self, keys: list[bytes], exc: XferError) -> int:
        """The bucket could not be asked (the server down, access denied):
        what this tier does not know is a miss for this get, which serves
        what the other tiers hold; asked again next time."""
        self.counters.errors += 1
        _log.warning("kv.object_probe_failed", tier=self.name, error=repr(exc))
        return self._known_prefix(keys)

    async def _read_trailers(self, present: list[bytes]) -> np.ndarray | None:
        """The trailers of ``present`` (a copy), or None if one was deleted
        meanwhile. The read into the stage is never cut short (the caller
        holds the stage's lock: the next user refills the stage)."""
        assert self.stage is not None
        bb = self.store.block_bytes
        n = len(present)
        try:
            await run_to_end(self.store.agent.read(
                [self.stage[j * TRAILER:(j + 1) * TRAILER] for j in range(n)],
                self.objs.segments([self.object_key(k) for k in present],
                                   [bb] * n, [TRAILER] * n)))
        except ObjectNotFound:
            return None  # deleted meanwhile: asked again later
        out: np.ndarray = self.stage.numpy()[: n * TRAILER].reshape(n, TRAILER).copy()
        return out

    def _learn(self, present: list[bytes], raw: np.ndarray | None) -> None:
        if raw is None:
            return
        bb = self.store.block_bytes
        ent = raw.view(ENTRY_DTYPE).ravel()
        good = ((ent["magic"] == ENTRY_MAGIC) & (ent["version"] == ENTRY_VERSION)
                & (entry_check(raw) == ent["check"]) & (ent["ns"] == self.ns)
                & (ent["length"] == bb))
        for j, k in enumerate(present):
            if good[j] and ent["key"][j].tobytes() == k:
                self.index[k] = int(ent["crc"][j])
            else:
                self.missing[k] = math.inf
                self.counters.checksum_failures += 1

    def _known_prefix(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.index:
                break
            n += 1
        return n

    # ------------------------------------------------------------ read

    async def _read(self, locs: list[Any], regions: list[Region],
                    offsets: list[int]) -> list[XferError | None]:
        """GETs the blocks straight into the caller's memory, each verified
        against its CRC. A block's failure is that block's alone:

        - gone (another store removed or quarantined it): BlockMissing, a miss;
        - corrupt: BlockCorrupt, quarantined;
        - the bucket failed to deliver it (an HTTP error after the object
          backend's bounded retries, a server down or cut off): BlockUnavailable.
          The block stays in this tier (it is not known lost: a later get
          reads it again), the get's prefix ends before it, and it is up to
          the caller to retry the get later or to recompute.

        One batched read first (one request of many GETs); it stops at its
        first failure and cancels the GETs in flight, so what it delivered
        is then learned from the blocks' CRCs in the caller's memory, and
        the rest is read again as one batch, without the failed block. A
        round that delivered nothing and failed with a TransportError ends
        the reading (the bucket is failing as a whole: another round would
        only wait out the backend's retries again); a failure of one object's
        own (not found, access denied, too large) costs only that block."""
        bb = self.store.block_bytes
        n = len(locs)
        errs: list[XferError | None] = [None] * n
        keys = [loc[0] for loc in locs]
        crcs = [loc[1] for loc in locs]
        agent = self.store.agent
        self.counters.reads += 1

        def crc(i: int) -> int:
            """Block i's CRC as it lies in the caller's memory."""
            return int(ck.checksum(regions[i].memoryview[offsets[i]:offsets[i] + bb]))

        todo = list(range(n))  # neither delivered nor failed yet
        read: list[int] = []  # read whole by a round: verified below
        while todo:
            # Into the caller's memory: a cancel waits for the round to end
            # (see kv.tier.landed) so no GET writes there once it returns.
            [res] = await landed(agent.read(
                [regions[i][offsets[i]:offsets[i] + bb] for i in todo],
                self.objs.segments([self.object_key(keys[i]) for i in todo],
                                   [0] * len(todo), [bb] * len(todo))))
            if isinstance(res, XferError):
                exc = res
                f = exc.fail_index
                if f is None or not 0 <= f < len(todo):  # (the agent closed: not one block's)
                    for i in todo:
                        errs[i] = self._unavailable(exc)
                    break
                failed = todo[f]
                errs[failed] = self._read_failed(keys[failed], exc)
                rest = [i for i in todo if i != failed]
                todo = [i for i in rest if crc(i) != crcs[i]]  # else delivered before it stopped
                if todo and len(todo) == len(rest) and isinstance(exc, TransportError):
                    for i in todo:
                        errs[i] = self._unavailable(exc, "not read: the bucket failed a GET "
                                                         "beside it and delivered nothing")
                    break
                continue
            if isinstance(res, BaseException):
                raise res
            read = todo
            break
        bad = []
        for i in read:
            got = crc(i)
            if got != crcs[i]:
                self.counters.checksum_failures += 1
                errs[i] = BlockCorrupt(f"object tier {self.name!r}: {self.object_key(keys[i])}: "
                                       f"checksum {got:#010x} != recorded {crcs[i]:#010x}; "
                                       f"quarantined")
                bad.append(keys[i])
        if bad:
            for k in bad:
                self.index.pop(k, None)
                self.missing[k] = math.inf  # not probed back in (until put again)
                self.counters.quarantined += 1
            try:
                await self.objs.delete([self.object_key(k) for k in bad])
                self._gone(bad)
            except XferError as exc:
                # Not served again from here either way (out of the index;
                # another store's read fails the CRC and deletes it): the
                # blocks verified beside it are delivered all the same.
                _log.warning("kv.object_quarantine_failed", tier=self.name, blocks=len(bad),
                             error=repr(exc))
        return errs

    def _read_failed(self, key: bytes, exc: XferError) -> XferError:
        """The error of the block whose GET failed with ``exc``."""
        if isinstance(exc, ObjectNotFound):
            # Another store removed or quarantined it: a miss, not a failure.
            self.index.pop(key, None)
            return BlockMissing(f"object tier {self.name!r}: {self.object_key(key)} is gone")
        return self._unavailable(exc)

    def _unavailable(self, exc: XferError, why: str = "") -> BlockUnavailable:
        self.counters.errors += 1
        e = BlockUnavailable(f"object tier {self.name!r}: {why + ': ' if why else ''}{exc}")
        e.__cause__ = exc
        return e

    async def _remove(self, keys: list[bytes]) -> int:
        """Forgets the keys (not served, not probed back in until put again)
        before it DELETEs them: a DELETE that fails (the bucket unreachable)
        raises with the tier consistent, the objects left in the bucket for
        a later remove (see kv.RemoveIncomplete)."""
        known = [k for k in keys if self.index.pop(k, None) is not None]
        self.missing.update(dict.fromkeys(keys, math.inf))
        await self.objs.delete([self.object_key(k) for k in keys])
        self._gone(keys)
        return len(known)

    def _gone(self, keys: list[bytes]) -> None:
        """Their objects were deleted: absent like any other (another store
        may put them again: asked again after ``absent_ttl``)."""
        until = time.monotonic() + self.absent_ttl
        for k in keys:
            if self.missing.get(k) == math.inf:
                self.missing[k] = until

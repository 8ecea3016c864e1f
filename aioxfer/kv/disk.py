"""DiskTier: crash-consistent, append-only segment files on a local filesystem
or block-device-backed directory, moved by the agent's file transport.

Layout of one segment file ``seg-NNNNNNNN.axkv`` (every part 4 KiB aligned,
so O_DIRECT works):

    [superblock 4 KiB][header table: one 64-byte entry per slot][slot 0][slot 1]...

The superblock says the file's geometry (block and slot size, slots,
namespace tag) and carries its own CRC. Entry ``i`` describes slot ``i``:
key, sequence number, namespace tag, length, payload checksum (CRC32C),
flags, and a check over the entry itself. Slots are filled in order and never
rewritten (append-only); an entry is written only after its slot's data
write completed (and, for ``put(durable=True)``, after an fdatasync), so a
header on disk always describes complete bytes. Header sectors are written
from an in-memory image by one writer at a time (so a later write of a sector
never carries older content over a newer one).

On open, the index is rebuilt from the header tables alone (one sequential
read per segment, parsed and checked with whole-array numpy operations):
entries whose check fails (torn by a crash, or corrupted) are dropped; a key
present twice keeps its highest sequence number. Payload checksums are
verified on every read: a block that fails is quarantined (its entry is
marked removed on disk) and reported as BlockCorrupt, never delivered.

A remove marks the entries removed in place. Where that fails (an I/O
error, a segment file made read-only or immutable), the keys go into the
tier's tombstone file (``tombstones.axkv``: entries of the same format, flag
removed, each with the sequence number of the record removed; appended and
synced) before the remove returns: on open, a record of a tombstoned key
whose sequence number is not above its tombstone's (the removed record's)
is dead. The tombstones
are retired (the file deleted) once an open has marked those records
removed in place. A remove raises only if neither could be written.

Space is reclaimed a segment at a time: when the tier is at capacity the
least recently read sealed segment with no reader is deleted (its blocks
become misses, counted as evictions "capacity"); removed blocks free their
segment once it has none left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from aioxfer._uncancelled import finish_uncancelled, run_to_end
from aioxfer.errors import ClosedResourceError, XferError
from aioxfer.kv import checksum as ck
from aioxfer.kv.errors import BlockCorrupt, BlockUnavailable
from aioxfer.kv.tier import Tier, landed, settle_on_cancel
from aioxfer.log import get_logger
from aioxfer.region import Region, SegmentList

if TYPE_CHECKING:
    from aioxfer.kv.store import Store

__all__ = ["DiskTier"]

_log = get_logger("aioxfer.kv")

SECTOR = 4096
ENTRY = 64
SUPER_MAGIC = b"AXKVSEG1"
ENTRY_MAGIC = 0x4B56
ENTRY_VERSION = 1
F_LIVE = 0x01
F_REMOVED = 0x02
_NOT_LIVE = 0xFF & ~F_LIVE
_ALGO_SHIFT = 4
_CODEC_SHIFT = 6  # flags bits 6-7: the block's codec (0: stored as is; kv.codec.CODECS)
_CSTAGE_BLOCKS = 32  # compressed blocks staged at once (per direction)
_SEG_RE = re.compile(r"^seg-(\d{8})\.axkv$")
TOMBSTONES = "tombstones.axkv"
_STAGE_SECTORS = 64
# A background header flush that failed (ENOSPC, EIO) is tried again after
# this delay, doubled at each failure in a row up to _FLUSH_RETRY_MAX: its
# entries are in memory only meanwhile, and a crash would lose them.
_FLUSH_RETRY_FIRST = 0.05
_FLUSH_RETRY_MAX = 5.0
_VERIFY_CHUNK = 128  # blocks per read chunk at least (see _read)
# Sequence numbers we write stay below this (one per record: never reached);
# an entry or tombstone naming one at or past it is no record of ours: taken
# as the tier's highest, the next ones would pass 2**64 (fz28).
_SEQ_END = np.uint64(1 << 63)

ENTRY_DTYPE = np.dtype([
    ("key", "V32"), ("seq", "<u8"), ("ns", "<u4"), ("length", "<u4"), ("crc", "<u4"),
    ("orig", "<u4"), ("magic", "<u2"), ("version", "u1"), ("flags", "u1"), ("check", "<u4"),
])
assert ENTRY_DTYPE.itemsize == ENTRY

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_M32 = np.uint64(0xFFFFFFFF)
_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_S31 = np.uint64(31)
_S32 = np.uint64(32)


def entry_check(raw: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint32]:
    """The 32-bit check of each 64-byte entry in ``raw`` ((n, 64) uint8) over
    its first 60 bytes: a multiply-xorshift mix, computed for a million
    entries in a few numpy passes (a torn or garbled entry fails it with
    probability 1 - 2**-32; the payload has its own CRC32C)."""
    words = np.ascontiguousarray(raw).view("<u8")  # (n, 8)
    h = np.full(words.shape[0], _P2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(8):
            w = words[:, j] if j < 7 else words[:, 7] & _M32
            h ^= w
            h *= _P1
            h ^= h >> _S31
        h ^= h >> _S32
    return (h & _M32).astype(np.uint32)


def ns_tag(namespace: bytes | str) -> int:
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return zlib.crc32(b"aioxfer.kv.ns\x00" + ns)


async def _staged(t: Any) -> None:
    """Awaits a transfer through the header staging buffer without ever
    cancelling it: a cancelled caller waits for it to end (one header I/O)
    and then raises. Cancelled midway, the engine could still be copying the
    buffer when the next writer (the lock released) refills it with other
    sectors' entries, and write those over this transfer's sectors: entries
    at the wrong slots, read back as corrupt blocks after a restart."""
    await run_to_end(t)


# A view of a stage (numpy or memoryview) is never held in a coroutine's
# frame across an await: a cancelled or failed operation's traceback keeps
# that frame, and the view in it, alive, and the region's release at the
# close then cannot unmap it (kv24: the header stage's mapping and fd stayed
# open after the close, for as long as a caller kept a cut put's exception).
# Sync helpers take their views and drop them on return.


def _fill_stage(stage: Region, image: npt.NDArray[np.uint8], sectors: list[int]) -> None:
    """The header image's ``sectors`` into the stage, one after another."""
    view = stage.numpy()
    for j, s in enumerate(sectors):
        view[j * SECTOR:(j + 1) * SECTOR] = image[s * SECTOR:(s + 1) * SECTOR]


def _mark_in_stage(stage: Region, chunk: list[int], slots: list[int]) -> None:
    """Marks ``slots``' entries removed in the header sectors ``chunk`` read
    into the stage."""
    view = stage.numpy()
    pos = {sec: j for j, sec in enumerate(chunk)}
    for s in slots:
        sec = s * ENTRY // SECTOR
        if sec in pos:
            off = pos[sec] * SECTOR + (s * ENTRY) % SECTOR
            _mark_entry_removed(view[off:off + ENTRY])


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _Seg:
    """One segment file and what the index knows of it."""

    __slots__ = ("no", "path", "region", "slots", "slot_bytes", "hdr_off", "data_off",
                 "keys", "live", "nlive", "crc", "algo", "cursor", "pins", "last_access",
                 "doomed", "image", "dirty", "writing", "length", "codec", "seqs")

    def __init__(self, no: int, path: str, slots: int, slot_bytes: int) -> None:
        self.no = no
        self.path = path
        self.region: Region | None = None
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.hdr_off = SECTOR
        self.data_off = SECTOR + _round_up(slots * ENTRY, SECTOR)
        self.keys = np.zeros(slots, dtype="V32")
        self.live = np.zeros(slots, dtype=bool)
        self.nlive = 0
        self.crc = np.zeros(slots, dtype=np.uint32)
        self.algo = np.zeros(slots, dtype=np.uint8)
        self.length = np.zeros(slots, dtype=np.uint32)  # stored bytes (compressed or not)
        self.codec = np.zeros(slots, dtype=np.uint8)
        self.seqs = np.zeros(slots, dtype=np.uint64)  # each record's sequence number
        self.cursor = slots  # next slot to fill; == slots: sealed
        self.pins = 0
        self.last_access = 0
        self.doomed = False
        self.image: npt.NDArray[np.uint8] | None = None  # the active segment's header table
        self.dirty: set[int] = set()  # sectors of ``image`` not yet written
        self.writing = 0  # slots handed out whose entries are not yet published

    @property
    def file_bytes(self) -> int:
        return self.data_off + self.slots * self.slot_bytes


def _superblock(seg: _Seg, block_bytes: int, ns: int) -> bytes:
    body = (SUPER_MAGIC + (1).to_bytes(4, "little") + block_bytes.to_bytes(4, "little")
            + seg.slot_bytes.to_bytes(4, "little") + seg.slots.to_bytes(4, "little")
            + seg.hdr_off.to_bytes(8, "little") + seg.data_off.to_bytes(8, "little")
            + ns.to_bytes(4, "little"))
    return body + zlib.crc32(body).to_bytes(4, "little")


def _parse_superblock(raw: bytes) -> dict[str, int] | None:
    if len(raw) < 48 or raw[:8] != SUPER_MAGIC:
        return None
    body, check = raw[:44], int.from_bytes(raw[44:48], "little")
    if zlib.crc32(body) != check:
        return None
    def u32(o: int) -> int:
        return int.from_bytes(raw[o:o + 4], "little")

    return {"version": u32(8), "block_bytes": u32(12), "slot_bytes": u32(16), "slots": u32(20),
            "hdr_off": int.from_bytes(raw[24:32], "little"),
            "data_off": int.from_bytes(raw[32:40], "little"), "ns": u32(40)}


def _mark_entry_removed(entry: npt.NDArray[np.uint8]) -> None:
    """Flags one 64-byte entry (a view) removed and re-checks it, so a restart
    reads it as intact and removed (not as torn)."""
    if not entry.any():
        return
    entry[59] = (int(entry[59]) & _NOT_LIVE) | F_REMOVED
    entry[60:64] = np.frombuffer(
        int(entry_check(entry.reshape(1, ENTRY))[0]).to_bytes(4, "little"), dtype=np.uint8)


def _fdatasync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


class DiskTier(Tier):
    """Blocks in append-only segment files under ``path`` (created if
    missing), at most ``capacity`` bytes of them. ``direct``: O_DIRECT (the
    filesystem must allow it; ``block_bytes`` a multiple of 4096).
    ``namespace``: records of another namespace found under ``path`` are
    ignored. ``segment_bytes``: size of one segment's data (the unit of
    eviction). ``admit``: "always", or "reused" (only blocks read at least
    once from the tier above, the second-hit rule; the rest are dropped and
    counted). ``compress``: None, "lz4" or "zstd" (aioxfer.kv.codec; needs
    blosc): blocks are byte-shuffled (``compress_typesize``: 2 for bf16/fp16)
    and compressed on their way through a tier-owned stage, their checksum
    over the stored bytes; the tier stops compressing by itself while the
    ratio stays under ``compress_min_ratio`` or the compressor is slower than
    the tier's own uncompressed writes (``statistics()`` extra: compress_on,
    compress_ratio, compress_gbps, raw_write_gbps). Slots keep their size:
    compression saves device bandwidth, not capacity. Records say how they
    were stored, so a tier reopened with other settings reads them all.
    ``room_wait``: how long a put that finds every segment still being
    written (none evictable) waits for a writer to finish before its blocks
    are dropped (``dropped_stores["no_room"]``); only a put holding no slot
    of its own waits (see _alloc), so writers never wait on each other. The
    same bound holds for a put waiting for segments' header flushes (the
    background flusher's, durable puts'): they make those segments
    evictable, and a stalled one drops the put's blocks at ``room_wait``."""

    kind = "disk"
    durable = True

    def __init__(self, path: str | os.PathLike[str], capacity: int, *, direct: bool = False,
                 name: str = "disk", namespace: bytes | str = b"",
                 segment_bytes: int = 256 << 20, admit: str = "always",
                 compress: str | None = None, compress_typesize: int = 2,
                 compress_min_ratio: float = 1.15, room_wait: float = 1.0) -> None:
        super().__init__(name)
        if room_wait < 0:
            raise ValueError("room_wait must be >= 0 (seconds)")
        self.room_wait = float(room_wait)
        if capacity <= 0:
            raise ValueError("capacity must be positive (bytes)")
        if admit not in ("always", "reused"):
            raise ValueError(f"admit is 'always' or 'reused', not {admit!r}")
        self.path = os.fspath(path)
        self.capacity = int(capacity)
        self.direct = bool(direct)
        self.namespace = namespace
        self.ns = ns_tag(namespace)
        self.segment_bytes = int(segment_bytes)
        self.admit = admit
        self.codec: Any = None
        self.codec_gate: Any = None
        if compress is not None:
            from aioxfer.kv.codec import Codec, Gate

            self.codec = Codec(compress, typesize=compress_typesize)
            self.codec_gate = Gate(min_ratio=compress_min_ratio)
        self.cstage_w: Region | None = None  # compressed blocks on their way out
        self.cstage_r: Region | None = None  # and in
        self.clock_w: asyncio.Lock | None = None
        self.clock_r: asyncio.Lock | None = None
        self.compressed_blocks = 0  # written compressed
        self.compressed_in = 0  # their bytes before and after
        self.compressed_out = 0
        self.any_compressed = False  # a block stored compressed is (or was) here
        self._decoders: dict[int, Any] = {}
        self.index: dict[bytes, int] = {}  # key -> segment << 32 | slot
        self.segs: dict[int, _Seg] = {}
        self.active: _Seg | None = None
        self.seq = 0
        self.tick = 0
        self.slot_bytes = 0
        self.slots_per_seg = 0
        self.max_segments = 0
        self.next_no = 0
        self.stage: Region | None = None
        self.lock: asyncio.Lock | None = None
        self.rebuild_seconds = 0.0
        self.dropped_on_open = 0
        self.foreign_segments = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending_flush: set[_Seg] = set()
        # Durable puts making their segments' headers durable (those
        # segments count them as writers meanwhile), and the event set as
        # each ends: a put making room waits for one, as for the flusher.
        self._durable_flushes = 0
        self._durable_flushed = asyncio.Event()
        # Set whenever a writer lets go of its slots or a segment goes: a
        # put that found no room waits on it (bounded by room_wait).
        self._room = asyncio.Event()
        self._flusher: asyncio.Future[None] | None = None
        # Segments whose header flush failed, the timer that queues them
        # again (no put need come to flush them) and its next delay.
        self._flush_retry: set[_Seg] = set()
        self._flush_retry_timer: asyncio.TimerHandle | None = None
        self._flush_retry_delay = _FLUSH_RETRY_FIRST
        self._closing = False
        self.segment_failed = False  # the last _alloc could not make a segment
        self.tombstoned = 0  # keys written to the tombstone file (see the module doc)

    # ------------------------------------------------------------ open / close

    async def _open(self, store: Store) -> None:
        await super()._open(store)
        bb = store.block_bytes
        if self.direct and bb % SECTOR:
            raise ValueError(f"an O_DIRECT disk tier needs block_bytes a multiple of {SECTOR}")
        self.slot_bytes = _round_up(bb, SECTOR) if self.direct else bb
        self.slots_per_seg = max(1, self.segment_bytes // self.slot_bytes)
        probe = _Seg(0, "", self.slots_per_seg, self.slot_bytes)
        self.max_segments = max(2, self.capacity // probe.file_bytes)
        self.lock = asyncio.Lock()
        if self.admit == "reused" and store._host is not None:
            store._host.track_reuse = True
        # Private: the directory is trusted (SECURITY.md, the disk tier's
        # directory): a new one only its user can reach, files likewise.
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self.stage = store.agent.alloc(_STAGE_SECTORS * SECTOR,
                                       name=f"{store.name}.{self.name}.hdr")
        # Compressed blocks always pass through a tier-owned stage (blocks
        # stored compressed may be found even when this run does not compress).
        self.cstage_w = store.agent.alloc(_CSTAGE_BLOCKS * self.slot_bytes,
                                          name=f"{store.name}.{self.name}.cw") \
            if self.codec is not None else None
        self.cstage_r = store.agent.alloc(_CSTAGE_BLOCKS * self.slot_bytes,
                                          name=f"{store.name}.{self.name}.cr")
        self.clock_w = asyncio.Lock()
        self.clock_r = asyncio.Lock()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._rebuild()
        self.rebuild_seconds = loop.time() - t0

    async def _aclose(self) -> None:
        """Waits for background work, writes the pending headers, then
        deregisters every segment file and stage. A cancel landing at any of
        these awaits does not stop the close there (each step runs to its end,
        the cancel is raised once all are done): cut short, the tier's files
        stayed registered (open) and its headers unwritten."""
        cancelled = False
        self._closing = True  # (no flush retry is scheduled from here on: the close flushes)
        for task in list(self._tasks):
            cancelled |= await finish_uncancelled(asyncio.gather(task, return_exceptions=True))
        if self._flusher is not None:
            cancelled |= await finish_uncancelled(
                asyncio.gather(self._flusher, return_exceptions=True))
        if self.lock is not None:
            for seg in list(self.segs.values()):
                if seg.image is not None:
                    try:
                        cancelled |= await finish_uncancelled(self._flush(seg, durable=False))
                    except (XferError, OSError) as exc:
                        # (a full or failing disk) Its blocks are not found
                        # after a restart, as after a crash; the close goes on.
                        _log.warning("kv.disk_flush_failed", tier=self.name, segment=seg.no,
                                     error=repr(exc))
        if self._flush_retry_timer is not None:
            self._flush_retry_timer.cancel()
            self._flush_retry_timer = None
        self._flush_retry.clear()
        from aioxfer.kv.store import _deregister_all

        agent = self.store.agent
        regions = [seg.region for seg in list(self.segs.values())]
        first, late = await _deregister_all(
            agent, [*regions, self.stage, self.cstage_w, self.cstage_r],
            "kv.disk_close_failed", tier=self.name)
        cancelled |= late
        if first is not None:
            raise first
        if cancelled:
            raise asyncio.CancelledError

    async def _rebuild(self) -> None:
        """The index from every segment's header table (see the module doc)."""
        names = sorted(n for n in os.listdir(self.path) if _SEG_RE.match(n))
        all_keys: list[npt.NDArray[Any]] = []
        all_seq: list[npt.NDArray[np.uint64]] = []
        all_loc: list[npt.NDArray[np.uint64]] = []
        block_bytes = self.store.block_bytes
        for fname in names:
            no = int(_SEG_RE.match(fname).group(1))  # type: ignore[union-attr]
            self.next_no = max(self.next_no, no + 1)
            path = os.path.join(self.path, fname)
            try:
                with open(path, "rb") as fh:
                    sb = _parse_superblock(fh.read(SECTOR))
                    # A slot count the file cannot hold the header table of
                    # (each segment is made its full size at once) is no
                    # segment of ours: sizing the index arrays and the header
                    # read by it would let any file in the directory claim
                    # 2**32 slots (MemoryError out of open).
                    if sb is None or sb["block_bytes"] != block_bytes or sb["ns"] != self.ns \
                            or sb["slot_bytes"] != self.slot_bytes \
                            or SECTOR + sb["slots"] * ENTRY > os.fstat(fh.fileno()).st_size:
                        self.foreign_segments += 1
                        continue
                    seg = _Seg(no, path, sb["slots"], sb["slot_bytes"])
                    if seg.hdr_off != sb["hdr_off"] or seg.data_off != sb["data_off"]:
                        self.foreign_segments += 1
                        continue
                    fh.seek(seg.hdr_off)
                    table = np.frombuffer(fh.read(seg.slots * ENTRY), dtype=np.uint8)
                size = os.path.getsize(path)
            except OSError:
                self.foreign_segments += 1
                continue
            n_entries = table.size // ENTRY
            raw = table[: n_entries * ENTRY].reshape(n_entries, ENTRY)
            ent = raw.view(ENTRY_DTYPE).ravel()
            intact = ((ent["magic"] == ENTRY_MAGIC) & (ent["version"] == ENTRY_VERSION)
                      & (entry_check(raw) == ent["check"]) & (ent["seq"] < _SEQ_END))
            codec = (ent["flags"] >> _CODEC_SHIFT) & 0x3
            sized = ((codec == 0) & (ent["length"] == block_bytes)) | (
                (codec != 0) & (ent["orig"] == block_bytes) & (ent["length"] > 0)
                & (ent["length"] <= block_bytes))
            live = intact & ((ent["flags"] & (F_LIVE | F_REMOVED)) == F_LIVE) \
                & (ent["ns"] == self.ns) & sized
            # Slots past the file's end (a truncated file) hold nothing.
            fits = (seg.data_off + (np.arange(n_entries, dtype=np.int64) + 1)
                    * seg.slot_bytes) <= size
            good = live & fits
            written = raw.view("<u8").any(axis=1)  # an all-zero entry was never written
            self.dropped_on_open += int((written & ~intact).sum() + (live & ~fits).sum())
            idx = np.flatnonzero(good)
            seg.keys[:n_entries] = ent["key"]
            seg.crc[:n_entries] = ent["crc"]
            seg.algo[:n_entries] = (ent["flags"] >> _ALGO_SHIFT) & 0x3
            seg.codec[:n_entries] = codec
            if bool((codec[idx] != 0).any()):
                self.any_compressed = True
            seg.length[:n_entries] = ent["length"]
            seg.seqs[:n_entries] = ent["seq"]
            seg.live[idx] = True
            seg.nlive = int(idx.size)
            if idx.size:
                self.seq = max(self.seq, int(ent["seq"][idx].max()))
            if not seg.nlive:
                with contextlib.suppress(OSError):  # (a read-only directory: skipped all the same)
                    os.unlink(path)  # nothing left in it
                continue
            seg.region = self.store.agent.register_file(path, direct=self.direct,
                                                        name=f"{self.store.name}.{self.name}.{no}")
            self.segs[no] = seg
            all_keys.append(ent["key"][idx])
            all_seq.append(ent["seq"][idx])
            all_loc.append((np.uint64(no) << np.uint64(32)) | idx.astype(np.uint64))
        tomb = self._read_tombstones()
        if tomb:
            # New records must outnumber every tombstone (or the next open
            # would take them for removed), even where no record is left.
            self.seq = max(self.seq, max(tomb.values()))
        if not all_keys:
            if tomb:
                self._retire_tombstones()
            return
        keys_a = np.concatenate(all_keys)
        seq = np.concatenate(all_seq)
        loc = np.concatenate(all_loc)
        if tomb:
            buried = np.array([tomb.get(k, -1) >= q for k, q in zip(
                np.ascontiguousarray(keys_a).tolist(), seq.tolist(), strict=True)], dtype=bool)
            if buried.any():
                gone = loc[buried].tolist()
                for lo in gone:
                    seg = self.segs[lo >> 32]
                    seg.live[lo & 0xFFFFFFFF] = False
                    seg.nlive -= 1
                keys_a, seq, loc = keys_a[~buried], seq[~buried], loc[~buried]
                # Marked removed in place now; the tombstones go once that worked.
                self._spawn(self._bury(gone))
            else:
                self._retire_tombstones()
            if not loc.size:
                return
        if seq.size > 1 and not bool((seq[1:] > seq[:-1]).all()):
            # Later records must win in the dict: order by sequence (needed
            # only when concurrent writers filled slots out of order).
            order = np.argsort(seq, kind="stable")
            keys_a, loc = keys_a[order], loc[order]
        keys = np.ascontiguousarray(keys_a).tolist()
        locs = loc.tolist()
        index = dict(zip(keys, locs, strict=True))
        self.index = index
        if len(index) != len(keys):  # a key written twice: the older copy is dead
            dead = []
            for k, lo in zip(keys, locs, strict=True):
                if index[k] != lo:
                    seg = self.segs[lo >> 32]
                    seg.live[lo & 0xFFFFFFFF] = False
                    seg.nlive -= 1
                    dead.append(lo)
            # Marked removed on disk as well (see _publish), in the background.
            self._spawn(self._mark_removed(dead))

    # ------------------------------------------------------------ tombstones

    def _read_tombstones(self) -> dict[bytes, int]:
        """key -> the highest sequence number its tombstones bury (records of
        the key at or below it are dead); torn or foreign entries ignored."""
        try:
            with open(os.path.join(self.path, TOMBSTONES), "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return {}
        n = len(raw) // ENTRY
        if not n:
            return {}
        rows = np.frombuffer(raw[:n * ENTRY], dtype=np.uint8).reshape(n, ENTRY)
        ent = rows.view(ENTRY_DTYPE).ravel()
        ok = ((ent["magic"] == ENTRY_MAGIC) & (ent["version"] == ENTRY_VERSION)
              & (entry_check(rows) == ent["check"]) & (ent["ns"] == self.ns)
              & (ent["seq"] < _SEQ_END)
              & ((ent["flags"] & F_REMOVED) != 0))
        out: dict[bytes, int] = {}
        for k, q in zip(np.ascontiguousarray(ent["key"][ok]).tolist(),
                        ent["seq"][ok].tolist(), strict=True):
            if q > out.get(k, -1):
                out[k] = q
        return out

    def _write_tombstones(self, keys: list[bytes], seqs: list[int]) -> None:
        """Appends tombstones for ``keys``, each burying its records up to the
        sequence number of the one removed (a later record of the key, put
        again meanwhile, lives on), and syncs them (runs in a thread)."""
        n = len(keys)
        rec = np.zeros(n, dtype=ENTRY_DTYPE)
        rec["key"] = np.frombuffer(b"".join(keys), dtype="V32")
        rec["seq"] = np.array(seqs, dtype=np.uint64)
        rec["ns"] = self.ns
        rec["magic"] = ENTRY_MAGIC
        rec["version"] = ENTRY_VERSION
        rec["flags"] = F_REMOVED
        raw = rec.view(np.uint8).reshape(n, ENTRY)
        rec["check"] = entry_check(raw)
        path = os.path.join(self.path, TOMBSTONES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            data = raw.tobytes()
            while data:
                data = data[os.write(fd, data):]
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _retire_tombstones(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.path, TOMBSTONES))

    async def _bury(self, locs: list[int]) -> None:
        """Records an open found tombstoned: marked removed in place, then the
        tombstone file goes (kept if that failed, or new tombstones came)."""
        before = self.tombstoned
        await self._mark_removed(locs)
        if self.tombstoned == before:
            self._retire_tombstones()

    # ------------------------------------------------------------ bookkeeping

    def _usage(self) -> tuple[int, int, int]:
        used = sum(s.file_bytes for s in self.segs.values())
        return len(self.index), used, self.capacity

    def _pinned_blocks(self) -> int:
        return sum(s.pins for s in self.segs.values())

    def _extra(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = {
            "segments": len(self.segs), "rebuild_seconds": self.rebuild_seconds,
            "dropped_on_open": self.dropped_on_open,
            "foreign_segments": self.foreign_segments, "checksum": ck.name(),
            "tombstoned": self.tombstoned}
        if self.codec is not None:
            g = self.codec_gate
            out.update(compress=self.codec.name, compress_on=int(g.on),
                       compressed_blocks=self.compressed_blocks,
                       compress_ratio=(self.compressed_in / self.compressed_out
                                       if self.compressed_out else 0.0),
                       compress_gbps=g.codec_bps / 1e9, raw_write_gbps=g.raw_bps / 1e9)
        return out

    def _locate(self, key: bytes) -> int | None:
        return self.index.get(key)

    def pin(self, loc: int) -> None:
        self.segs[loc >> 32].pins += 1

    def unpin(self, loc: int) -> None:
        seg = self.segs.get(loc >> 32)
        if seg is None:
            return
        seg.pins -= 1
        if not seg.pins and seg.doomed:
            self._spawn(self._drop_segment(seg, "capacity"))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Background bookkeeping (a quarantine's on-disk mark, a segment
            # drop): the in-memory index is already right; say what failed.
            _log.warning("kv.disk_background_failed", tier=self.name,
                         error=repr(task.exception()))

    # ------------------------------------------------------------ segments

    async def _new_segment(self, deadline: float) -> _Seg | None:
        """A fresh active segment; evicts the least recently read sealed one
        first when at capacity. None: no room (every segment has readers),
        or the segments' header flushes it waited for (they become evictable
        then) did not end by ``deadline`` (loop time: the put's room_wait)."""
        loop = asyncio.get_running_loop()
        while len(self.segs) >= self.max_segments:
            victims = sorted((s for s in self.segs.values()
                              if s is not self.active and not s.pins and not s.doomed
                              and not s.writing and s not in self._pending_flush),
                             key=lambda s: s.last_access)
            if not victims:
                flusher = self._flusher
                # Bounded as a wait for a writer is (_wait_for_room): a
                # header write stalled on a failing or hung device would
                # otherwise hold the put (and its caller) as long as it
                # stalls, where other room failures drop at room_wait.
                left = deadline - loop.time()
                if self._pending_flush and flusher is not None and not flusher.done():
                    # Segments whose headers are on their way become
                    # evictable in one header write: wait for it, not drop.
                    if left <= 0:
                        return None
                    await asyncio.wait([flusher], timeout=left)
                    if not flusher.done():
                        return None
                    continue
                if self._durable_flushes:
                    # The same for segments a durable put holds while it
                    # flushes their headers (an fdatasync; they wait for
                    # nothing else): evictable once it is done.
                    if left <= 0:
                        return None
                    self._durable_flushed.clear()
                    try:
                        async with asyncio.timeout(left):
                            await self._durable_flushed.wait()
                    except TimeoutError:
                        return None
                    continue
                return None
            await self._drop_segment(victims[0], "capacity")
        no = self.next_no
        self.next_no += 1
        path = os.path.join(self.path, f"seg-{no:08d}.axkv")
        seg = _Seg(no, path, self.slots_per_seg, self.slot_bytes)
        sb = _superblock(seg, self.store.block_bytes, self.ns)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.pwrite(fd, sb + bytes(SECTOR - len(sb)), 0)
                os.ftruncate(fd, seg.file_bytes)
            finally:
                os.close(fd)
            seg.region = self.store.agent.register_file(
                path, direct=self.direct, name=f"{self.store.name}.{self.name}.{no}")
        except (OSError, XferError) as exc:
            # The filesystem is full (ENOSPC, a quota), out of files, or
            # gone: no segment, so no room; the blocks are dropped and
            # counted by the caller, never an OSError out of a put.
            self.counters.errors += 1
            self.segment_failed = True
            _log.warning("kv.disk_segment_failed", tier=self.name, path=path, error=repr(exc))
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        seg.cursor = 0
        seg.image = np.zeros(seg.data_off - seg.hdr_off, dtype=np.uint8)
        self.tick += 1
        seg.last_access = self.tick
        self.segs[no] = seg
        return seg

    async def _drop_segment(self, seg: _Seg, reason: str) -> None:
        if self.segs.get(seg.no) is not seg:
            return
        if seg.pins:
            seg.doomed = True  # dropped by the last unpin
            return
        del self.segs[seg.no]
        self._room.set()  # room for a new segment
        base = np.uint64(seg.no) << np.uint64(32)
        n = 0
        for slot in np.flatnonzero(seg.live).tolist():
            key = seg.keys[slot].tobytes()
            if self.index.get(key) == int(base) | slot:
                del self.index[key]
                n += 1
        if n:
            self.counters.evicted(reason, n)
        if self.active is seg:
            self.active = None
        from aioxfer.kv.store import _deregister

        # Out of segs already: its file goes even if this await is cancelled
        # (a put cancelled while _new_segment makes room), or it stays on
        # disk, counted nowhere, and its blocks (evicted, or removed since)
        # are indexed again at the next open. The registration holds its own
        # fd: unlinking while its release is pending is safe.
        try:
            if seg.region is not None and not seg.region.closed:
                await _deregister(self.store.agent, seg.region)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)

    async def _alloc(self, k: int) -> list[tuple[_Seg, int]]:
        out: list[tuple[_Seg, int]] = []
        deadline: float | None = None
        try:
            while len(out) < k:
                seg = self.active
                if seg is None or seg.cursor >= seg.slots:
                    self.active = None  # full: sealed once its last writer has published
                    if deadline is None:
                        # From the put's first need of a segment: every wait
                        # for room (flushes, writers) within one room_wait.
                        deadline = asyncio.get_running_loop().time() + self.room_wait
                    seg = await self._new_segment(deadline)
                    if seg is None:
                        # No room: every segment is pinned or still being
                        # written. Only a put holding no slot waits for a
                        # writer to finish: one holding slots is a writer
                        # itself (others may wait for it; two such waiting
                        # on each other, or one on its own slots, would
                        # never end). Writers only write and flush (I/O, the
                        # header lock): none waits on a waiter, so the wait
                        # ends when one of them does, or at room_wait.
                        if out or self.segment_failed:
                            break
                        if not await self._wait_for_room(deadline):
                            break
                        continue
                    self.active = seg
                take = min(k - len(out), seg.slots - seg.cursor)
                out.extend((seg, seg.cursor + j) for j in range(take))
                seg.cursor += take
                seg.writing += take
        except BaseException:
            # Cancelled while _new_segment made room (its eviction's
            # deregistration, or the wait for the header flusher): the slots
            # taken so far are nobody's (their cursor stays past them, never
            # reused; their entries stay empty). Else their segments keep
            # ``writing`` raised for good: never evicted nor sealed, the tier
            # runs out of room.
            self._let_go(out)
            for seg in {p[0] for p in out}:
                self._maybe_seal(seg)
            raise
        return out

    def _let_go(self, places: list[tuple[_Seg, int]]) -> None:
        """The slots' writer is done with them: their segments may be
        evicted or sealed, and a put waiting for room looks again."""
        for seg, _slot in places:
            seg.writing -= 1
        if places:
            self._room.set()

    async def _wait_for_room(self, deadline: float) -> bool:
        """Waits (until ``deadline``, loop time) for a writer to let go of
        its slots; False at once when no segment has a writer (nothing will
        free up) or the deadline has passed."""
        if not any(s.writing for s in self.segs.values()):
            return False
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        self._room.clear()
        try:
            async with asyncio.timeout(left):
                await self._room.wait()
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------ write

    async def _write(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                     *, durable: bool = False) -> list[bool]:
        n = len(keys)
        ok = [False] * n
        if self.admit == "reused":
            # Second-hit admission: only blocks the tier above saw read.
            host = self.store._host
            reused: set[bytes] = getattr(host, "reused", set())
            admitted = [i for i in range(n) if keys[i] in reused]
            if len(admitted) < n:
                self.counters.dropped("admission", n - len(admitted))
        else:
            admitted = list(range(n))
        todo = [i for i in admitted if keys[i] not in self.index]
        for i in admitted:
            if keys[i] in self.index:
                ok[i] = True
        if not todo:
            return ok
        bb = self.store.block_bytes
        self.segment_failed = False
        places = await self._alloc(len(todo))
        if len(places) < len(todo):
            why = "io_error" if self.segment_failed else "no_room"
            self.counters.dropped(why, len(todo) - len(places))
        todo = todo[: len(places)]
        if not todo:
            # Nothing to write: never into the write path (a compressing
            # one would wait for the stage another writer holds).
            return ok
        segs = {p[0] for p in places}
        # A durable put's segments count it as a writer until their headers
        # are durable too: else another put's _new_segment may evict one
        # between the data and the header flush (its file gone: the flush
        # failed with FileNotFoundError, the blocks dropped as io_error).
        held = True
        flushing = False
        interrupted = False  # a durable header flush cut short (cancelled)
        try:
            try:
                gate = self.codec_gate
                if gate is not None and gate.compress_next():
                    written = await self._write_compressed(keys, regions, offsets, todo,
                                                           places, durable)
                else:
                    t0 = time.perf_counter()
                    written = await self._write_slots(keys, regions, offsets, todo, places,
                                                      durable)
                    if gate is not None and not durable:
                        gate.note_raw(len(written) * bb, time.perf_counter() - t0)
            finally:
                if not durable:
                    held = False
                    self._let_go(places)
            for i in written:
                ok[i] = True
            if durable:
                place_of = dict(zip(todo, places, strict=False))
                self._durable_flushes += 1
                flushing = True
                interrupted = True
                for seg in segs:
                    try:
                        await self._flush(seg, durable=True)
                    except (XferError, OSError) as exc:
                        # The headers could not be made durable (ENOSPC for a
                        # header sector, EIO): the blocks are not stored, as if
                        # their data write had failed, and not indexed (their
                        # entries, if written later, say removed).
                        lost = [i for i in written if ok[i] and place_of[i][0] is seg]
                        self._unpublish([keys[i] for i in lost], [place_of[i] for i in lost])
                        for i in lost:
                            ok[i] = False
                        written = [i for i in written if ok[i]]
                        self.counters.errors += 1
                        self.counters.dropped("io_error", len(lost))
                        _log.warning("kv.disk_header_failed", tier=self.name, segment=seg.no,
                                     blocks=len(lost), error=repr(exc))
                        # Its sectors stay dirty: other puts' entries, and
                        # these blocks' (marked removed): written later.
                        self._flush_failed(seg)
                interrupted = False
            else:
                # Not promised durable: the headers follow in the background
                # (still only after their data, which is complete by now).
                self._schedule_flush(segs)
        finally:
            if held:
                self._let_go(places)
                for seg in segs:
                    self._maybe_seal(seg)  # full, its last writer done, headers on disk
            if interrupted:
                # Cancelled while its header flush waited for the header lock
                # or wrote (the sectors went back into ``dirty``), or before
                # it reached a later segment: the blocks are published (this
                # process serves them; a later durable put of the key finds
                # it present) but their entries are not on disk, and nothing
                # else would write them until another put flushed the same
                # segment (a full one: never; a crash lost them, and the
                # segment was never sealed). Scheduled like a non-durable
                # put's headers.
                self._schedule_flush([s for s in segs if s.dirty])
            if flushing:
                self._durable_flushes -= 1
                self._durable_flushed.set()
        self.counters.puts += len(written)
        self.counters.put_bytes += len(written) * bb
        return ok

    async def _write_slots(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                           todo: list[int], places: list[tuple[_Seg, int]],
                           durable: bool) -> list[int]:
        """Writes blocks ``todo`` into their slots, then publishes them;
        returns the indexes (into keys) written."""
        bb = self.store.block_bytes
        # One transfer per (source region, segment).
        groups: dict[tuple[int, int], list[int]] = {}
        for j, i in enumerate(todo):
            groups.setdefault((id(regions[i]), places[j][0].no), []).append(j)
        transfers = []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for js in groups.values():
            seg = places[js[0]][0]
            src = regions[todo[js[0]]]
            assert seg.region is not None
            transfers.append(self.store.agent.write(
                SegmentList(src, np.array([offsets[todo[j]] for j in js], dtype=np.uint64),
                            np.full(len(js), bb, dtype=np.uint64)),
                SegmentList(seg.region,
                            np.array([seg.data_off + places[j][1] * seg.slot_bytes for j in js],
                                     dtype=np.uint64),
                            np.full(len(js), bb, dtype=np.uint64))))
        self.counters.writes += len(transfers)
        self.counters.in_flight += len(todo)
        # Checksums while the engine writes: both only read the source.
        crcs = [ck.checksum(regions[i].memoryview[offsets[i]:offsets[i] + bb]) for i in todo]
        try:
            # Cancelled, the put does not raise before the engine has let go
            # of ``src`` (kv22: cut short by gather's cancel, it raised while
            # chunks already issued, up to the file transport's queue depth of
            # 1 MiB each, still read the caller's memory: a marker written
            # into src after the put raised reached the segment file, 5 of 6
            # delays). The file transport stops issuing chunks at the cancel,
            # so this waits for those in flight only.
            results = await settle_on_cancel(transfers)
        finally:
            self.counters.in_flight -= len(todo)
        self.counters.write_latency.add(loop.time() - t0)
        written: list[int] = []
        for js, r in zip(groups.values(), results, strict=True):
            if isinstance(r, BaseException):
                self.counters.errors += 1
                self.counters.dropped("io_error", len(js))
                continue
            written.extend(js)
        if durable and written:
            # Data before headers: a header on disk then always describes
            # bytes that are on disk too.
            try:
                for seg in {places[j][0] for j in written}:
                    await run_to_end(asyncio.to_thread(_fdatasync, seg.path))
            except OSError as exc:
                self.counters.errors += 1
                self.counters.dropped("io_error", len(written))
                _log.warning("kv.disk_sync_failed", tier=self.name, error=repr(exc))
                return []
        done = [todo[j] for j in written]
        if written:
            self._publish([places[j] for j in written], [keys[i] for i in done],
                          [crcs[j] for j in written])
        return done

    async def _write_compressed(self, keys: list[bytes], regions: list[Region],
                                offsets: list[int], todo: list[int],
                                places: list[tuple[_Seg, int]], durable: bool) -> list[int]:
        """As _write_slots, each block compressed on its way through the
        tier's write stage (stored as is when it would not shrink). The
        checksum is over the stored bytes: a read verifies before it
        decompresses."""
        bb = self.store.block_bytes
        sb = self.slot_bytes
        codec, gate, stage = self.codec, self.codec_gate, self.cstage_w
        assert stage is not None and self.clock_w is not None
        agent = self.store.agent
        done_j: list[int] = []
        lengths: list[int] = []
        codecs: list[int] = []
        crcs: list[int] = []
        async with self.clock_w:
            for c0 in range(0, len(todo), _CSTAGE_BLOCKS):
                sv = stage.numpy()  # (dropped before the await below: see _fill_stage)
                smv = stage.memoryview
                js = list(range(c0, min(len(todo), c0 + _CSTAGE_BLOCKS)))
                t0 = time.perf_counter()
                blobs = []
                for j in js:
                    i = todo[j]
                    blobs.append(codec.compress(regions[i].memoryview[offsets[i]:offsets[i] + bb]))
                dt = time.perf_counter() - t0
                n_in = n_out = 0
                lens: list[int] = []
                cids: list[int] = []
                for k, (j, z) in enumerate(zip(js, blobs, strict=True)):
                    off = k * sb
                    if len(z) < bb:
                        sv[off:off + len(z)] = np.frombuffer(z, dtype=np.uint8)
                        lens.append(len(z))
                        cids.append(codec.id)
                        n_in += bb
                        n_out += len(z)
                    else:  # incompressible: stored as is
                        i = todo[j]
                        sv[off:off + bb] = np.frombuffer(
                            regions[i].memoryview[offsets[i]:offsets[i] + bb], dtype=np.uint8)
                        lens.append(bb)
                        cids.append(0)
                crc_c = [ck.checksum(smv[k * sb:k * sb + L]) for k, L in enumerate(lens)]
                del sv, smv
                gate.note_compressed(len(js) * bb, n_out + (len(js) * bb - n_in), dt)
                by_seg: dict[int, list[int]] = {}
                for k, j in enumerate(js):
                    by_seg.setdefault(places[j][0].no, []).append(k)
                transfers = []
                for ks in by_seg.values():
                    seg = places[js[ks[0]]][0]
                    assert seg.region is not None
                    wl = np.array([_round_up(lens[k], SECTOR) if self.direct else lens[k]
                                   for k in ks], dtype=np.uint64)
                    transfers.append((ks, agent.write(
                        SegmentList(stage, np.array(ks, dtype=np.uint64) * np.uint64(sb), wl),
                        SegmentList(seg.region, np.array(
                            [seg.data_off + places[js[k]][1] * seg.slot_bytes for k in ks],
                            dtype=np.uint64), wl))))
                self.counters.writes += len(transfers)
                # Never cut short: the stage is refilled by the next chunk.
                results = asyncio.gather(*(t for _ks, t in transfers), return_exceptions=True)
                await _staged(results)
                for (ks, _t), r in zip(transfers, results.result(), strict=True):
                    if isinstance(r, BaseException):
                        self.counters.errors += 1
                        self.counters.dropped("io_error", len(ks))
                        continue
                    for k in ks:
                        done_j.append(js[k])
                        lengths.append(lens[k])
                        codecs.append(cids[k])
                        crcs.append(crc_c[k])
                        if cids[k]:
                            self.compressed_blocks += 1
                            self.compressed_in += bb
                            self.compressed_out += lens[k]
        if durable and done_j:
            try:
                for seg in {places[j][0] for j in done_j}:
                    await run_to_end(asyncio.to_thread(_fdatasync, seg.path))
            except OSError as exc:
                self.counters.errors += 1
                self.counters.dropped("io_error", len(done_j))
                _log.warning("kv.disk_sync_failed", tier=self.name, error=repr(exc))
                return []
        if done_j:
            self._publish([places[j] for j in done_j], [keys[todo[j]] for j in done_j], crcs,
                          lengths, codecs)
        return [todo[j] for j in done_j]

    def _publish(self, places: list[tuple[_Seg, int]], keys: list[bytes],
                 crcs: list[int], lengths: list[int] | None = None,
                 codecs: list[int] | None = None) -> None:
        """Their slots' data is written: the entries go into the header images
        (whole-array built and checked) and the keys into the index."""
        n = len(keys)
        bb = self.store.block_bytes
        rec = np.zeros(n, dtype=ENTRY_DTYPE)
        rec["key"] = np.frombuffer(b"".join(keys), dtype="V32")
        rec["seq"] = np.arange(self.seq + 1, self.seq + 1 + n, dtype=np.uint64)
        self.seq += n
        rec["ns"] = self.ns
        rec["length"] = bb if lengths is None else np.array(lengths, dtype=np.uint32)
        rec["crc"] = np.array(crcs, dtype=np.uint32)
        rec["orig"] = bb
        rec["magic"] = ENTRY_MAGIC
        rec["version"] = ENTRY_VERSION
        cid = 0 if codecs is None else np.array(codecs, dtype=np.uint8) << _CODEC_SHIFT
        rec["flags"] = F_LIVE | (ck.ALGO << _ALGO_SHIFT) | cid
        raw = rec.view(np.uint8).reshape(n, ENTRY)
        rec["check"] = entry_check(raw)
        index = self.index
        dead: list[int] = []
        for j, (seg, slot) in enumerate(places):
            key = keys[j]
            old = index.get(key)
            if old is not None:  # written twice concurrently: the older copy is dead
                prev = self.segs.get(old >> 32)
                if prev is not None and prev.live[old & 0xFFFFFFFF]:
                    prev.live[old & 0xFFFFFFFF] = False
                    prev.nlive -= 1
                    dead.append(old)
            assert seg.image is not None
            seg.image[slot * ENTRY:(slot + 1) * ENTRY] = raw[j]
            seg.dirty.add(slot * ENTRY // SECTOR)
            seg.keys[slot] = rec["key"][j]
            seg.crc[slot] = crcs[j]
            seg.algo[slot] = ck.ALGO
            seg.length[slot] = bb if lengths is None else lengths[j]
            seg.codec[slot] = 0 if codecs is None else codecs[j]
            seg.seqs[slot] = rec["seq"][j]
            seg.live[slot] = True
            seg.nlive += 1
            index[key] = (seg.no << 32) | slot
        if codecs is not None and any(codecs):
            self.any_compressed = True
        if dead:
            # On disk too: a remove() marks only the copy the index holds, and
            # a live older record would bring the key back at the next open.
            self._spawn(self._mark_removed(dead))

    def _unpublish(self, keys: list[bytes], places: list[tuple[_Seg, int]]) -> None:
        """Takes back blocks _publish indexed whose headers did not reach the
        disk: out of the index, their entries marked removed in the image."""
        for key, (seg, slot) in zip(keys, places, strict=True):
            loc = (seg.no << 32) | slot
            if self.index.get(key) == loc:
                del self.index[key]
            if seg.live[slot]:
                seg.live[slot] = False
                seg.nlive -= 1
            if seg.image is not None:
                _mark_entry_removed(seg.image[slot * ENTRY:(slot + 1) * ENTRY])
                seg.dirty.add(slot * ENTRY // SECTOR)

    def _schedule_flush(self, segs: Any) -> None:
        """The segments' dirty headers go to disk in the background (the
        flusher: one at a time, sealing each segment once it is done)."""
        if not segs:
            return
        self._pending_flush.update(segs)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_pending())

    def _maybe_seal(self, seg: _Seg) -> None:
        if seg.cursor >= seg.slots and not seg.writing and not seg.dirty:
            seg.image = None  # sealed: its whole table is on disk

    def _flush_failed(self, seg: _Seg) -> None:
        """``seg``'s header flush failed (its sectors are still dirty): it is
        flushed again after a backoff, whether or not another put comes (a
        full segment gets none: its entries stayed in memory only, lost to a
        crash, and it was never sealed)."""
        self._flush_retry.add(seg)
        if self._flush_retry_timer is None and not self._closing:
            delay = self._flush_retry_delay
            self._flush_retry_delay = min(delay * 2, _FLUSH_RETRY_MAX)
            self._flush_retry_timer = asyncio.get_running_loop().call_later(
                delay, self._retry_flush)

    def _retry_flush(self) -> None:
        self._flush_retry_timer = None
        segs = [s for s in self._flush_retry
                if s.dirty and s.image is not None and self.segs.get(s.no) is s]
        self._flush_retry.clear()
        if not self._closing:
            # Queued as a put's headers are: while queued the segment is not
            # evicted (as before the failure); a failure again comes back here.
            self._schedule_flush(segs)

    async def _flush_pending(self) -> None:
        failed = False
        while self._pending_flush:
            seg = self._pending_flush.pop()
            try:
                await self._flush(seg, durable=False)
            except Exception as exc:  # tried again after a backoff (dirty kept)
                # On to the others, not return: a segment queued here is no
                # eviction victim (its headers are "on their way") and only
                # this task takes it off the queue; stopped here, the rest
                # stayed unevictable until another put restarted the flusher,
                # and a put at capacity dropped its blocks as no_room
                # meanwhile. Each gets its own try (one file's error need
                # not be the next one's); on a failing disk that is one
                # failed header write per queued segment, then none.
                _log.warning("kv.disk_flush_failed", tier=self.name, segment=seg.no,
                             error=repr(exc), retry_in=self._flush_retry_delay)
                failed = True
                self._flush_failed(seg)
                continue
            self._maybe_seal(seg)
        if not failed:
            self._flush_retry_delay = _FLUSH_RETRY_FIRST  # the disk takes headers again

    async def _flush(self, seg: _Seg, *, durable: bool) -> None:
        """Writes the segment's dirty header sectors (one writer at a time)."""
        assert self.lock is not None and self.stage is not None
        async with self.lock:
            while seg.dirty and seg.image is not None and seg.region is not None \
                    and not seg.region.closed:
                sectors = sorted(seg.dirty)[:_STAGE_SECTORS]
                seg.dirty.difference_update(sectors)
                _fill_stage(self.stage, seg.image, sectors)
                m = len(sectors)
                try:
                    await _staged(self.store.agent.write(
                        SegmentList(self.stage, np.arange(m, dtype=np.uint64) * SECTOR,
                                    np.full(m, SECTOR, dtype=np.uint64)),
                        SegmentList(seg.region,
                                    seg.hdr_off + np.array(sectors, dtype=np.uint64) * SECTOR,
                                    np.full(m, SECTOR, dtype=np.uint64))))
                except ClosedResourceError:
                    if self.segs.get(seg.no) is not seg:
                        return  # the segment was dropped meanwhile: nothing to write
                    seg.dirty.update(sectors)
                    raise
                except BaseException:
                    seg.dirty.update(sectors)  # written next time
                    raise
            if durable:
                await run_to_end(asyncio.to_thread(_fdatasync, seg.path))

    # ------------------------------------------------------------ read

    async def _read(self, locs: list[int], regions: list[Region],
                    offsets: list[int]) -> list[XferError | None]:
        n = len(locs)
        bb = self.store.block_bytes
        errs: list[XferError | None] = [None] * n
        groups: dict[tuple[int, int], list[int]] = {}
        comp: list[int] = []
        if self.any_compressed:
            segs = self.segs
            for i, loc in enumerate(locs):
                if segs[loc >> 32].codec[loc & 0xFFFFFFFF]:
                    comp.append(i)
                else:
                    groups.setdefault((loc >> 32, id(regions[i])), []).append(i)
        else:
            for i, loc in enumerate(locs):
                groups.setdefault((loc >> 32, id(regions[i])), []).append(i)
        # Each group is posted in a few chunks at once: the device queue stays
        # as full as with one transfer, and chunk k is verified while the
        # chunks after it are still being read (the checksum pass overlaps
        # the I/O instead of following it).
        chunks: list[tuple[int, list[int], Any]] = []
        self.tick += 1
        agent = self.store.agent
        for (no, _r), idx in groups.items():
            seg = self.segs[no]
            seg.last_access = self.tick
            assert seg.region is not None
            step = max(_VERIFY_CHUNK, -(-len(idx) // 2))
            for k in range(0, len(idx), step):
                part = idx[k:k + step]
                slots = np.array([locs[i] & 0xFFFFFFFF for i in part], dtype=np.uint64)
                lens = np.full(len(part), bb, dtype=np.uint64)
                chunks.append((no, part, agent.read(
                    SegmentList(regions[part[0]],
                                np.array([offsets[i] for i in part], dtype=np.uint64), lens),
                    SegmentList(seg.region, seg.data_off + slots * np.uint64(seg.slot_bytes),
                                lens))))
        self.counters.reads += len(chunks)
        bad: list[int] = []
        try:
            for no, part, t in chunks:
                try:
                    # Through shield, not `await t`: a transfer awaited alone
                    # may be posted (and a small one finished) inside the
                    # await, before other gets of this loop pass could find
                    # it in flight and coalesce with it. Shielded: a cancel
                    # must not cut it short (see below).
                    await asyncio.shield(t)
                except XferError as r:
                    self.counters.errors += 1
                    e = BlockUnavailable(f"disk tier {self.name!r}: reading segment {no} "
                                         f"failed: {r}")
                    e.__cause__ = r
                    for i in part:
                        errs[i] = e
                    continue
                held = self.segs.get(no)
                for i in part:
                    slot = locs[i] & 0xFFFFFFFF
                    want = int(held.crc[slot]) if held is not None else -1
                    got = ck.checksum_with(int(held.algo[slot]) if held is not None else 0,
                                           regions[i].memoryview[offsets[i]:offsets[i] + bb])
                    if got is None:
                        errs[i] = BlockUnavailable(f"block of segment {no} slot {slot} has a "
                                                   f"checksum this process cannot compute")
                    elif got != want:
                        self.counters.checksum_failures += 1
                        errs[i] = BlockCorrupt(f"disk tier {self.name!r}: segment {no} slot "
                                               f"{slot}: checksum {got:#010x} != recorded "
                                               f"{want:#010x}; quarantined")
                        bad.append(i)
            if comp:
                await self._read_compressed(comp, locs, regions, offsets, errs, bad)
        except BaseException:
            # The caller's memory: a cancelled read's bytes may still land
            # (a cancelled Transfer says nothing of when they stop), so the
            # chunks posted run to their end (a device read each) before
            # the caller hears; only then may it reuse its memory.
            await landed(*(t for _no, _part, t in chunks))
            raise
        if bad:
            self._quarantine([locs[i] for i in bad])
        return errs

    def _decoder(self, cid: int) -> Any:
        dec = self._decoders.get(cid)
        if dec is None:
            from aioxfer.kv.codec import Codec

            dec = self._decoders[cid] = Codec(Codec.name_of(cid))
        return dec

    async def _read_compressed(self, idx: list[int], locs: list[int], regions: list[Region],
                               offsets: list[int], errs: list[XferError | None],
                               bad: list[int]) -> None:
        """Blocks stored compressed: read into the tier's read stage, verified
        there (the checksum is over the stored bytes), then decompressed
        straight into the caller's memory. A block that fails either check is
        corrupt: quarantined like any other."""
        bb = self.store.block_bytes
        sb = self.slot_bytes
        stage = self.cstage_r
        assert stage is not None and self.clock_r is not None
        agent = self.store.agent
        async with self.clock_r:
            for c0 in range(0, len(idx), _CSTAGE_BLOCKS):
                part = idx[c0:c0 + _CSTAGE_BLOCKS]
                by_seg: dict[int, list[int]] = {}
                for k, i in enumerate(part):
                    by_seg.setdefault(locs[i] >> 32, []).append(k)
                reads = []
                for no, ks in by_seg.items():
                    seg = self.segs[no]
                    seg.last_access = self.tick
                    assert seg.region is not None
                    slots = [locs[part[k]] & 0xFFFFFFFF for k in ks]
                    rl = np.array([_round_up(int(seg.length[s]), SECTOR) if self.direct
                                   else int(seg.length[s]) for s in slots], dtype=np.uint64)
                    reads.append((no, ks, agent.read(
                        SegmentList(stage, np.array(ks, dtype=np.uint64) * np.uint64(sb), rl),
                        SegmentList(seg.region, seg.data_off + np.array(slots, dtype=np.uint64)
                                    * np.uint64(seg.slot_bytes), rl))))
                self.counters.reads += len(reads)
                results = asyncio.gather(*(t for _n, _k, t in reads), return_exceptions=True)
                await _staged(results)  # the stage is reused by the next chunk: never cut short
                smv = stage.memoryview  # (no await from here to its del: see _fill_stage)
                for (no, ks, _t), r in zip(reads, results.result(), strict=True):
                    if isinstance(r, BaseException):
                        self.counters.errors += 1
                        e = BlockUnavailable(f"disk tier {self.name!r}: reading segment {no} "
                                             f"failed: {r}")
                        e.__cause__ = r
                        for k in ks:
                            errs[part[k]] = e
                        continue
                    held = self.segs.get(no)
                    for k in ks:
                        i = part[k]
                        slot = locs[i] & 0xFFFFFFFF
                        if held is None:
                            errs[i] = BlockUnavailable(f"segment {no} went while read")
                            continue
                        n = int(held.length[slot])
                        stored = smv[k * sb:k * sb + n]
                        got = ck.checksum_with(int(held.algo[slot]), stored)
                        want = int(held.crc[slot])
                        where = f"disk tier {self.name!r}: segment {no} slot {slot}"
                        if got is None:
                            errs[i] = BlockUnavailable(f"{where}: checksum not computable here")
                            continue
                        if got != want:
                            self.counters.checksum_failures += 1
                            errs[i] = BlockCorrupt(f"{where}: checksum {got:#010x} != recorded "
                                                   f"{want:#010x}; quarantined")
                            bad.append(i)
                            continue
                        cid = int(held.codec[slot])
                        try:
                            dec = self._decoder(cid)
                        except (ImportError, ValueError) as exc:
                            errs[i] = BlockUnavailable(f"{where}: stored compressed "
                                                       f"({cid}): {exc}")
                            continue
                        dst = regions[i].memoryview[offsets[i]:offsets[i] + bb]
                        if dec.decompress_into(stored, dst) != bb:
                            self.counters.checksum_failures += 1
                            errs[i] = BlockCorrupt(f"{where}: does not decompress to "
                                                   f"{bb} bytes; quarantined")
                            bad.append(i)
                del smv
                stored = dst = memoryview(b"")  # (the caller's and the stage's views dropped)

    def _quarantine(self, locs: list[int]) -> None:
        for loc in locs:
            seg = self.segs.get(loc >> 32)
            if seg is None:
                continue
            key = seg.keys[loc & 0xFFFFFFFF].tobytes()
            if self.index.get(key) == loc:
                del self.index[key]
                self.counters.quarantined += 1
        self._spawn(self._mark_removed(locs))

    # ------------------------------------------------------------ remove

    async def _remove(self, keys: list[bytes]) -> int:
        locs = [loc for k in keys if (loc := self.index.pop(k, None)) is not None]
        if locs:
            await self._mark_removed(locs)
        return len(locs)

    async def _mark_removed(self, locs: list[int]) -> None:
        """Flags the entries removed on disk (so a restart does not bring them
        back) and frees segments left empty."""
        by_seg: dict[int, list[int]] = {}
        for loc in locs:
            by_seg.setdefault(loc >> 32, []).append(loc & 0xFFFFFFFF)
        assert self.lock is not None and self.stage is not None
        unmarked: list[bytes] = []
        unmarked_seq: list[int] = []
        first: BaseException | None = None
        for no, slots in by_seg.items():
            seg = self.segs.get(no)
            if seg is None:
                continue
            for s in slots:
                if seg.live[s]:
                    seg.live[s] = False
                    seg.nlive -= 1
            try:
                if seg.image is not None:  # the active segment: its image is the truth
                    for s in slots:
                        _mark_entry_removed(seg.image[s * ENTRY:(s + 1) * ENTRY])
                        seg.dirty.add(s * ENTRY // SECTOR)
                    await self._flush(seg, durable=False)
                else:
                    await self._rewrite_sealed(seg, slots)
            except (XferError, OSError) as exc:
                # Still live on disk: a restart would bring them back.
                unmarked.extend(seg.keys[s].tobytes() for s in slots)
                unmarked_seq.extend(int(seg.seqs[s]) for s in slots)
                first = first or exc
                continue
            if not seg.nlive and seg is not self.active and not seg.writing:
                # (A put still writing into it publishes there next: dropped
                # now, its blocks would be indexed in a segment gone, or fail
                # their durable sync; left to capacity eviction instead.)
                await self._drop_segment(seg, "removed")
        if unmarked:
            _log.warning("kv.disk_remove_unmarked", tier=self.name, blocks=len(unmarked),
                         error=repr(first))
            try:
                await run_to_end(asyncio.to_thread(self._write_tombstones, unmarked,
                                                      unmarked_seq))
            except OSError as exc:
                self.counters.errors += 1
                assert first is not None
                raise first from exc
            self.tombstoned += len(unmarked)

    async def _rewrite_sealed(self, seg: _Seg, slots: list[int]) -> None:
        assert self.lock is not None and self.stage is not None and seg.region is not None
        sectors = sorted({s * ENTRY // SECTOR for s in slots})
        agent = self.store.agent
        async with self.lock:
            for k in range(0, len(sectors), _STAGE_SECTORS):
                chunk = sectors[k:k + _STAGE_SECTORS]
                m = len(chunk)
                if seg.region.closed or self.segs.get(seg.no) is not seg:
                    return  # dropped meanwhile: nothing left to mark
                local = SegmentList(self.stage, np.arange(m, dtype=np.uint64) * SECTOR,
                                    np.full(m, SECTOR, dtype=np.uint64))
                remote = SegmentList(seg.region,
                                     seg.hdr_off + np.array(chunk, dtype=np.uint64) * SECTOR,
                                     np.full(m, SECTOR, dtype=np.uint64))
                try:
                    await _staged(agent.read(local, remote))
                except ClosedResourceError:
                    if self.segs.get(seg.no) is not seg:
                        return
                    raise
                _mark_in_stage(self.stage, chunk, slots)
                try:
                    await _staged(agent.write(local, remote))
                except ClosedResourceError:
                    if self.segs.get(seg.no) is not seg:
                        return
                    raise

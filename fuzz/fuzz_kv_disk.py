#!/usr/bin/env python3
"""atheris (libFuzzer for Python) harness: the KV disk tier's reading of its
directory (aioxfer/kv/disk.py): a segment file's superblock (geometry, CRC)
and header table (64-byte entries: key, sequence, namespace, lengths,
checksum, flags, entry check), the tombstone file, and (blosc) the stored
form of a compressed block. What is on disk may be torn by a crash, garbled
by the device, or written by anyone with the directory.

Set up once: a real agent, and a template segment a real Store wrote (block
size 4 KiB, 4 slots a segment; 3 keys put durable, one removed, one put
compressed where blosc is installed): its geometry and slot data are what an
input's table describes. Byte 0 of an input picks:
  bit 0: the rest after the segment part is also the tombstone file;
  bit 3: the template is the segment holding the compressed block (else
         the one holding 3 blocks as they are, one removed);
  bits 4-6: checks made right over the input's bytes, as anyone writing
         the directory can (not a torn write): bit 4 the superblock's CRC,
         bit 5 each entry's check, bit 6 each entry's payload checksum
         (see _seal): garbled fields behind valid checks;
  bit 7: instead of bytes in place, the rest of the input is field edits
         of the template (3 bytes each: see _edited), every check then made
         right: values at their edges (0, 2**32 - 1, 2**64 - 1, the block
         size...) that byte mutations rarely make while the checks hold;
  bit 1: the input is a compressed block (from byte 1 on): Codec
         ("lz4", "zstd": bit 2).decompress_into a 4 KiB destination
         between guard bytes (blosc's C code on stored bytes);
then byte 1 is the file's length (255: whole, else that many 255ths of
it: a torn tail), bytes 2..49 the superblock's 48 bytes, bytes 50..51 how
many bytes of header table follow (little-endian), then those, then the
tombstone file. The file is the template with these bytes in place.
Contract: the tier opens (a foreign, torn or garbled file is skipped or its
entries dropped, counted, never an error out of Store.open); every key it
indexes is served or reported failed (BlockCorrupt, BlockUnavailable: in
GetResult.failed), and what is served matches its recorded checksum; a put
of a new block after that returns (stored or dropped); the store closes
cleanly. A decompression writes nothing outside its
destination and returns the destination's length or -1. Anything else
raises out of check(), unless it is a known, reported issue
(fuzz/known_issues.py) and AXF_FUZZ_TOLERATE_KNOWN=1.

Run: python fuzz/fuzz_kv_disk.py [libFuzzer flags] CORPUS_DIR   (see benchmarks/fuzz.sh)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

BB = 4096
SLOTS = 4
GUARD = 64
SEG = "seg-00000000.axkv"
_m: Any = None


def _tier(path: str, compress: str | None = None) -> Any:
    return _m.kv.DiskTier(path, 1 << 24, segment_bytes=SLOTS * BB, compress=compress)


def _keys() -> list[bytes]:
    import numpy as np

    return list(_m.kv.chain(np.arange(16 * 6), block_tokens=16, namespace=b"fz28-disk"))


def load() -> None:
    global _m
    if _m is not None:
        return
    import types

    import numpy as np

    import aioxfer
    import aioxfer.kv as kv
    import aioxfer.kv.codec as codec
    import aioxfer.kv.disk as disk
    import aioxfer.kv.errors as kverrors

    loop = asyncio.new_event_loop()
    ns = types.SimpleNamespace(kv=kv, disk=disk, codec=codec, kverrors=kverrors, loop=loop,
                               np=np)
    ns.tmp = tempfile.mkdtemp(prefix="fz28-kv-disk-")
    ns.work = os.path.join(ns.tmp, "work")
    _m = ns

    async def setup() -> None:
        ns.agent = aioxfer.Agent("fz-kv-disk")
        await ns.agent.__aenter__()
        ns.dst = ns.agent.alloc(8 * BB)
        src = ns.agent.alloc(6 * BB)
        src.numpy()[:] = np.arange(6 * BB, dtype=np.uint32).astype(np.uint8)
        src.numpy()[4 * BB:] = 7  # compressible
        keys = _keys()
        tpl = os.path.join(ns.tmp, "template")
        async with kv.Store.open(ns.agent, block_bytes=BB, tiers=[_tier(tpl)]) as store:
            await store.put(keys[:3], src[0:3 * BB], durable=True)
            await store.remove(keys[1:2])
        ns.compressed = False
        if codec.available():
            # (a tier that compresses: the next segment's block is stored compressed)
            async with kv.Store.open(ns.agent, block_bytes=BB,
                                     tiers=[_tier(tpl, "lz4")]) as store:
                await store.put(keys[4:5], src[4 * BB:5 * BB], durable=True)
                ns.compressed = True
        with open(os.path.join(tpl, SEG), "rb") as fh:
            ns.template = fh.read()
        ns.seg1 = None
        if os.path.exists(os.path.join(tpl, "seg-00000001.axkv")):
            with open(os.path.join(tpl, "seg-00000001.axkv"), "rb") as fh:
                ns.seg1 = fh.read()

    loop.run_until_complete(setup())


def _compose(data: bytes, base: bytes, mode: int) -> tuple[bytes, bytes]:
    """The segment file (``base`` with the input's bytes in place) and the
    rest of ``data`` (the tombstone file, when the mode says so)."""
    tpl = bytearray(base)
    size = data[0] if data else 255
    sb = data[1:49]
    n = int.from_bytes(data[49:51], "little")
    table = data[51:51 + n]
    rest = data[51 + n:]
    tpl[:len(sb)] = sb
    at = _m.disk.SECTOR
    room = max(0, min(len(table), len(tpl) - at))
    tpl[at:at + room] = table[:room]
    _seal(tpl, base, mode)
    if size != 255:
        del tpl[len(tpl) * size // 255:]
    return bytes(tpl), rest


def _seal(f: bytearray, base: bytes, mode: int) -> None:
    """What a writer of the directory (not a torn write) can do: the checks
    made right over whatever the input put there. Mode bit 6: each entry's
    payload checksum that of its slot's bytes (its length of them, by its
    algorithm); bit 5: each entry's check; bit 4: the superblock's CRC.
    The template's geometry says where entries and slots are."""
    import zlib

    np, disk = _m.np, _m.disk
    sector, entry = disk.SECTOR, disk.ENTRY
    data_off = int.from_bytes(base[32:40], "little")
    slot_bytes = int.from_bytes(base[16:20], "little")
    for i in range(SLOTS):
        e = sector + i * entry
        if mode & 64:
            length = min(int.from_bytes(f[e + 44:e + 48], "little"), slot_bytes)
            at = data_off + i * slot_bytes
            got = disk.ck.checksum_with((f[e + 59] >> 4) & 3, memoryview(bytes(f[at:at + length])))
            if got is not None:
                f[e + 48:e + 52] = got.to_bytes(4, "little")
        if mode & 32:
            row = np.frombuffer(bytes(f[e:e + entry]), dtype=np.uint8).reshape(1, entry)
            f[e + 60:e + 64] = int(disk.entry_check(row)[0]).to_bytes(4, "little")
    if mode & 16:
        f[44:48] = zlib.crc32(bytes(f[:44])).to_bytes(4, "little")


async def _open_and_read(seg: bytes, tomb: bytes | None) -> None:
    kv = _m.kv
    work = _m.work
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, SEG), "wb") as fh:
        fh.write(seg)
    if tomb is not None:
        with open(os.path.join(work, _m.disk.TOMBSTONES), "wb") as fh:
            fh.write(tomb)
    tier = _tier(work)
    async with kv.Store.open(_m.agent, block_bytes=BB, tiers=[tier]) as store:
        keys = list(tier.index)
        if len(keys) > SLOTS:
            raise AssertionError(f"{len(tier.index)} keys indexed from one segment of {SLOTS}")
        for key in keys:  # one at a time: a get stops at its first miss
            loc = tier.index.get(key)
            res = await store.get([key], _m.dst[0:BB])
            if res.prefix == 1:
                seg_ = tier.segs[loc >> 32]
                slot = loc & 0xFFFFFFFF
                got = _m.disk.ck.checksum_with(int(seg_.algo[slot]), _m.dst.memoryview[0:BB]) \
                    if not seg_.codec[slot] else None
                if got is not None and got != int(seg_.crc[slot]):
                    raise AssertionError(f"served a block whose checksum {got:#x} is not "
                                         f"the recorded {int(seg_.crc[slot]):#x}")
            elif not res.failed and key in tier.index:
                raise AssertionError(f"an indexed key neither served nor failed: {res!r}")
            for f in res.failed:
                if not isinstance(f.error, (_m.kverrors.BlockCorrupt,
                                            _m.kverrors.BlockUnavailable)):
                    raise AssertionError(f"failed with {f.error!r}")
        # A put after it: whatever the directory held, new blocks are stored
        # (or dropped, said in the result), never an error.
        put = await store.put(_keys()[5:6], _m.dst[BB:2 * BB])
        if put.stored + put.present + put.dropped != 1:
            raise AssertionError(f"a put of one block: {put!r}")
        st = store.statistics().tiers["disk"]
        if st.blocks != len(tier.index):
            raise AssertionError(f"statistics say {st.blocks} blocks, the index {len(tier.index)}")


# entry fields (offset, size) and superblock fields an edit (bit 7) sets
_ENTRY_FIELDS = [(32, 8), (40, 4), (44, 4), (48, 4), (52, 4), (56, 2), (58, 1), (59, 1)]
_SB_FIELDS = [(8, 4), (12, 4), (16, 4), (20, 4), (24, 8), (32, 8), (40, 4)]


def _interesting(choice: int, size: int) -> int:
    top = (1 << (8 * size)) - 1
    vals = [0, 1, 2, 3, 0x7F, 0x80, 0xFF, BB - 1, BB, BB + 1, 2 * BB, 4096, 8192,
            (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63,
            top - 1, top]
    if choice < len(vals):
        return vals[choice] & top
    return (choice * 0x9E3779B97F4A7C15) & top


def _edited(data: bytes, base: bytes) -> bytes:
    """Mode bit 7: the template with field edits, each 3 bytes of ``data``
    (target: entry 0-3 or 4 = the superblock, or 5 = copy an entry's key to
    another; field; value choice), its checks then made right (all of _seal)."""
    f = bytearray(base)
    sector, entry = _m.disk.SECTOR, _m.disk.ENTRY
    for i in range(0, len(data) - 2, 3):
        target, field, choice = data[i] % 6, data[i + 1], data[i + 2]
        if target == 4:
            off, size = _SB_FIELDS[field % len(_SB_FIELDS)]
            f[off:off + size] = _interesting(choice, size).to_bytes(size, "little")
        elif target == 5:
            a, b = sector + (field & 3) * entry, sector + ((field >> 2) & 3) * entry
            f[b:b + 32] = f[a:a + 32]
        else:
            off, size = _ENTRY_FIELDS[field % len(_ENTRY_FIELDS)]
            at = sector + target * entry + off
            f[at:at + size] = _interesting(choice, size).to_bytes(size, "little")
    _seal(f, base, 16 | 32 | 64)
    return bytes(f)


def _segment(data: bytes, mode: int) -> None:
    if mode & 128:
        base = _m.seg1 if mode & 8 and _m.seg1 is not None else _m.template
        seg = _edited(data, base)
        _m.loop.run_until_complete(asyncio.wait_for(_open_and_read(seg, None), 30))
        return
    seg, rest = _compose(data, _m.seg1 if mode & 8 and _m.seg1 is not None else _m.template,
                         mode)
    _m.loop.run_until_complete(asyncio.wait_for(
        _open_and_read(seg, rest if mode & 1 else None), 30))


def _decompress(data: bytes, zstd: bool) -> None:
    if not _m.codec.available():
        return
    np = _m.np
    dec = _m.codec.Codec("zstd" if zstd else "lz4")
    buf = np.full(BB + 2 * GUARD, 0xA5, dtype=np.uint8)
    dst = memoryview(buf)[GUARD:GUARD + BB]
    got = dec.decompress_into(memoryview(data), dst)
    if got not in (BB, -1):
        raise AssertionError(f"decompress_into returned {got}")
    if (buf[:GUARD] != 0xA5).any() or (buf[GUARD + BB:] != 0xA5).any():
        raise AssertionError("decompression wrote outside its destination")


def _run(data: bytes) -> None:
    if data[0] & 2:
        _decompress(data[1:], bool(data[0] & 4))
    else:
        _segment(data[1:], data[0])


def check(data: bytes) -> str | None:
    """Runs one input (fuzz/_harness.py guarded: None, a known issue's name,
    or raises on a new finding)."""
    return _harness.guarded(load, _run, data)


def _input(seg: bytes, *, size: int = 255, mode: int = 0, tomb: bytes = b"") -> bytes:
    """The input whose file is ``seg`` (its superblock and header table)."""
    sector = 4096
    sb = seg[:48]
    table = seg[sector:sector + SLOTS * 64]
    return bytes([mode, size]) + sb + len(table).to_bytes(2, "little") + table + tomb


def seeds() -> dict[str, bytes]:
    """The template segment as written, torn, with tombstones, and the
    compressed block it stores."""
    load()
    seg = _m.template
    out = {
        "segment": _input(seg),
        "segment-torn": _input(seg, size=200),
        "segment-empty-table": bytes([0, 255]) + seg[:48] + b"\0\0",
    }
    # A tombstone of the first key (the entry of slot 0, flagged removed)
    first = bytearray(seg[4096:4096 + 64])
    first[59] = 0x02 | (first[59] & ~0x03 & 0xFF)
    import numpy as np

    row = np.frombuffer(bytes(first), dtype=np.uint8).reshape(1, 64)
    first[60:64] = int(_m.disk.entry_check(row)[0]).to_bytes(4, "little")
    out["segment-sealed"] = _input(seg, mode=16 | 32 | 64)
    out["edit-none"] = bytes([128])
    out["edit-compressed-length"] = bytes([128 | 8, 0, 2, 7])  # entry 0's length: BB - 1
    out["edit-copy-key"] = bytes([128, 5, 0b0100, 0])  # entry 0's key onto entry 1
    out["segment-tombstoned"] = _input(seg, mode=1, tomb=bytes(first))
    if _m.seg1 is not None:
        s1 = _m.seg1
        out["segment-compressed"] = _input(s1, mode=8)
        out["segment-compressed-sealed"] = _input(s1, mode=8 | 16 | 32 | 64)
        ent = np.frombuffer(s1[4096:4096 + 64], dtype=_m.disk.ENTRY_DTYPE)[0]
        data_off = int.from_bytes(s1[32:40], "little")
        stored = s1[data_off:data_off + int(ent["length"])]
        out["lz4-block"] = b"\2" + stored
        out["zstd-block"] = b"\6" + _m.codec.Codec("zstd").compress(
            memoryview(bytes(range(256)) * 16))
    return out


def main() -> None:
    _harness.main(check, load, lambda: (_m.disk, _m.codec), quiet=True)


if __name__ == "__main__":
    main()

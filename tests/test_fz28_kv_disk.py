"""fz28 (fuzz/fuzz_kv_disk.py): a DiskTier directory holding an intact entry
(its check right: written by anyone with the directory, or a garble that
passes the 32-bit check) or a tombstone whose sequence number is at the top
of its 64-bit field. The index rebuild took it as the tier's highest
sequence number, so every put after the open raised OverflowError out of
numpy (the next number, 2**64, has no uint64) instead of storing its blocks
(for some numbers below the top, numpy wraps the new records' numbers round
to 0 instead: np.arange(2**64 - 2, 2**64 + 2, dtype=np.uint64) ends 0, 1, and
records numbered below what they replace lose to it at the next open; not
exercised here). Such an entry is no record of ours: dropped on open like a
torn one. Real
agent and store, files rewritten as kv/disk.py's own functions write them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.kv.disk import ENTRY, ENTRY_DTYPE, SECTOR, TOMBSTONES, entry_check

BB = 16 << 10
TOP = (1 << 64) - 1
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"fz28-disk")


def disk(path: Path) -> kv.DiskTier:
    return kv.DiskTier(path, 1 << 28, segment_bytes=16 * BB)


def restamp(seg: Path, slot: int, seq: int) -> None:
    """Gives the entry of ``slot`` the sequence number ``seq``, its check
    made right again (as _publish makes it)."""
    with open(seg, "r+b") as fh:
        fh.seek(SECTOR + slot * ENTRY)
        raw = bytearray(fh.read(ENTRY))
        raw[32:40] = seq.to_bytes(8, "little")
        row = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(1, ENTRY)
        raw[60:64] = int(entry_check(row)[0]).to_bytes(4, "little")
        fh.seek(SECTOR + slot * ENTRY)
        fh.write(raw)


def tombstone(seg: Path, slot: int, seq: int) -> bytes:
    """A tombstone of the key of ``slot``'s entry burying up to ``seq``."""
    with open(seg, "rb") as fh:
        fh.seek(SECTOR + slot * ENTRY)
        rec = np.frombuffer(fh.read(ENTRY), dtype=ENTRY_DTYPE).copy()
    rec["seq"] = seq
    rec["flags"] = 0x02
    raw = rec.view(np.uint8).reshape(1, ENTRY)
    rec["check"] = entry_check(raw)
    return raw.tobytes()


@pytest.mark.parametrize("where", ["entry", "tombstone", "entry-near-top"])
async def test_a_sequence_number_at_the_top_leaves_puts_working(
        make_agent: MakeAgent, tmp_path: Path, where: str) -> None:
    agent = await make_agent("fz28-disk")
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 11)
    keys = keys_for(8)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk(tmp_path)]) as store:
        put = await within(store.put(keys[:4], src[0:4 * BB], durable=True))
        assert put.durable == 4
    seg = sorted(tmp_path.glob("seg-*.axkv"))[0]
    if where == "entry":
        restamp(seg, 3, TOP)
    elif where == "entry-near-top":
        restamp(seg, 3, TOP - 1)
    else:
        (tmp_path / TOMBSTONES).write_bytes(tombstone(seg, 3, TOP))
    dst = agent.alloc(8 * BB)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk(tmp_path)]) as store:
        # the blocks no forged number touched are there
        res = await within(store.get(keys[:3], dst[0:3 * BB]))
        assert res.prefix == 3
        # new blocks, and one put again over an old one (its new bytes)
        src.numpy()[:BB] = pattern(BB, 99)
        put = await within(store.put(keys[4:8], src[4 * BB:8 * BB], durable=True))
        assert put.stored == 4, put
        await within(store.remove(keys[0:1]))
        put = await within(store.put(keys[0:1], src[0:BB], durable=True))
        assert put.stored == 1, put
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk(tmp_path)]) as store:
        res = await within(store.get(keys[4:8], dst[0:4 * BB]))
        assert res.prefix == 4 and np.array_equal(dst.numpy()[:4 * BB],
                                                  src.numpy()[4 * BB:8 * BB])
        res = await within(store.get(keys[0:1], dst[0:BB]))
        assert res.prefix == 1 and np.array_equal(dst.numpy()[:BB], src.numpy()[:BB])

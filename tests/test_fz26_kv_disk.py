"""fz26: a DiskTier segment file whose superblock is well formed (its CRC
right, the tier's geometry and namespace) but states a slot count its file
cannot hold: before, the index rebuild sized its per-slot arrays and the
header read by that count (2**32 - 1 slots: 128 GiB of keys, a 256 GiB read)
and MemoryError came out of Store.open; such a file is foreign (counted,
left alone), as one of another geometry is, and the tier opens with the
segments it can read."""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.kv.disk import ENTRY, SECTOR

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"fz26-disk")


def disk(path: Path) -> kv.DiskTier:
    return kv.DiskTier(path, 1 << 28, segment_bytes=16 * BB)


def restate_slots(seg: Path, slots: int) -> None:
    """Rewrites the superblock of ``seg`` (see kv/disk.py's _superblock) to
    state ``slots`` slots, its offsets and CRC consistent with that."""
    raw = bytearray(seg.read_bytes()[:48])
    raw[20:24] = slots.to_bytes(4, "little")
    data_off = SECTOR + (slots * ENTRY + SECTOR - 1) // SECTOR * SECTOR
    raw[32:40] = data_off.to_bytes(8, "little")
    raw[44:48] = zlib.crc32(bytes(raw[:44])).to_bytes(4, "little")
    with open(seg, "r+b") as fh:
        fh.write(raw)


@pytest.mark.parametrize("slots", [(1 << 32) - 1, 1 << 20])
async def test_a_slot_count_the_file_cannot_hold_is_foreign(
        make_agent: MakeAgent, tmp_path: Path, slots: int) -> None:
    agent = await make_agent("fz26-disk")
    src = agent.alloc(20 * BB)
    src.numpy()[:] = pattern(20 * BB, 3)
    keys = keys_for(20)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[disk(tmp_path)]) as store:
        put = await within(store.put(keys, src[0:20 * BB], durable=True))
        assert put.durable == 20
    segs = sorted(tmp_path.glob("seg-*.axkv"))
    assert len(segs) == 2  # 16 blocks a segment
    size = segs[1].stat().st_size
    restate_slots(segs[1], slots)
    agent2 = await make_agent("fz26-disk2")
    dst = agent2.alloc(16 * BB)
    async with kv.Store.open(agent2, block_bytes=BB, tiers=[disk(tmp_path)]) as store:
        st = store.statistics().tiers["disk"]
        assert st.extra["foreign_segments"] == 1 and st.blocks == 16, st
        res = await within(store.get(keys[:16], dst[0:16 * BB]))
        assert res.prefix == 16 and np.array_equal(dst.numpy(), src.numpy()[:16 * BB])
    assert segs[1].stat().st_size == size  # left alone

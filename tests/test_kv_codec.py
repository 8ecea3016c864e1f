"""aioxfer.kv compression for lower tiers: the codecs on bf16 KV-like data,
DiskTier(compress=...) round trips, restarts, corrupt compressed records, and
the gate that turns compression off where it does not pay."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv

pytest.importorskip("blosc", reason="compression needs blosc (pip install 'aioxfer[kv]')")

from aioxfer.kv.codec import CODECS, Codec, Gate  # noqa: E402

BB = 64 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def kv_like(nbytes: int, seed: int) -> np.ndarray:
    """bf16 values of a KV cache's shape of distribution (normal, per-channel
    scales), as bytes: what byte-shuffle + lz4/zstd meets in practice."""
    rng = np.random.default_rng(seed)
    n = nbytes // 2
    scale = rng.uniform(0.05, 4.0, size=128).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32) * np.resize(scale, n)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return bf16.view(np.uint8)


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"codec-test")


@pytest.mark.parametrize("name", sorted(CODECS))
def test_codec_round_trip_and_ratio(name: str) -> None:
    data = kv_like(BB, 1)
    c = Codec(name)
    z = c.compress(memoryview(data))
    # shuffled bf16 compresses (the exponent bytes; mantissas hardly do)
    assert len(z) < (0.97 if name == "lz4" else 0.9) * BB, (name, BB / len(z))
    out = bytearray(BB)
    assert c.decompress_into(memoryview(z), memoryview(out)) == BB
    assert bytes(out) == data.tobytes()
    # garbage, a truncated block, or the wrong size is refused, never half-written
    assert c.decompress_into(memoryview(z[:len(z) // 2]), memoryview(out)) == -1
    assert c.decompress_into(memoryview(z), memoryview(bytearray(BB // 2))) == -1
    assert c.decompress_into(memoryview(bytes(64)), memoryview(out)) == -1
    with pytest.raises(ValueError):
        Codec("snappy")


def test_gate_ratio_and_throughput() -> None:
    g = Gate(min_ratio=1.15, probe_raw=4, probe_codec=8)
    assert g.on and [g.compress_next() for _ in range(4)] == [True, True, True, False]
    g.note_compressed(1000, 980, 1e-6)  # ratio 1.02: does not pay
    assert not g.on
    assert [g.compress_next() for _ in range(8)].count(True) == 1  # a probe now and then
    g = Gate(min_ratio=1.15)
    g.note_compressed(1000, 500, 1e-5)  # ratio 2 at 100 MB/s ...
    assert g.on
    g.note_raw(1000, 1e-6)  # ... but the tier moves 1 GB/s uncompressed
    assert not g.on
    g.note_raw(1000, 1.0)  # the device got slow: compressing pays again
    for _ in range(60):
        g.note_raw(1000, 1.0)
    assert g.on


async def test_disk_tier_compresses_and_reads_back(make_agent: MakeAgent,
                                                   tmp_path: Path) -> None:
    agent = await make_agent("kv")
    n = 48
    src = agent.alloc(n * BB)
    data = np.concatenate([kv_like(BB, 10 + i) for i in range(n)])
    src.numpy()[:] = data
    keys = keys_for(n)
    dst = agent.alloc(n * BB)
    tier = kv.DiskTier(tmp_path / "kv", 1 << 28, segment_bytes=32 * BB, compress="zstd")
    tier.codec_gate.probe_raw = 1 << 30  # every batch compressed here (the gate has its own test)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[tier]) as store:
        put = await store.put(keys, src[0:n * BB], durable=True)
        assert put.durable == n
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == n and res.failed == ()
        assert np.array_equal(dst.numpy(), data)
        ex = store.statistics().tiers["disk"].extra
        assert ex["compress"] == "zstd" and ex["compressed_blocks"] == n
        assert float(ex["compress_ratio"]) > 1.15, ex
    # A restart, this time without compression: the records say how they
    # were stored, so they still read back.
    dst.numpy()[:] = 0
    tiers = [kv.DiskTier(tmp_path / "kv", 1 << 28, segment_bytes=32 * BB)]
    async with kv.Store.open(agent, block_bytes=BB, tiers=tiers) as store:
        assert (await store.lookup(keys)).prefix == n
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == n and np.array_equal(dst.numpy(), data)


async def test_corrupt_compressed_record_is_quarantined(make_agent: MakeAgent,
                                                        tmp_path: Path) -> None:
    agent = await make_agent("kv")
    n = 8
    src = agent.alloc(n * BB)
    src.numpy()[:] = np.concatenate([kv_like(BB, 30 + i) for i in range(n)])
    keys = keys_for(n)
    dst = agent.alloc(n * BB)
    tier = kv.DiskTier(tmp_path / "kv", 1 << 28, segment_bytes=32 * BB, compress="lz4")
    tier.codec_gate.probe_raw = 1 << 30
    async with kv.Store.open(agent, block_bytes=BB, tiers=[tier]) as store:
        await store.put(keys, src[0:n * BB], durable=True)
        loc = tier.index[keys[3]]
        seg = tier.segs[loc >> 32]
        slot = loc & 0xFFFFFFFF
        assert seg.codec[slot] == CODECS["lz4"] and seg.length[slot] < BB
        off = seg.data_off + slot * seg.slot_bytes
        with open(seg.path, "r+b") as fh:  # one flipped bit inside the compressed bytes
            fh.seek(off + 100)
            b = fh.read(1)
            fh.seek(off + 100)
            fh.write(bytes([b[0] ^ 0x04]))
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == 3 and [f.index for f in res.failed] == [3]
        assert isinstance(res.failed[0].error, kv.BlockCorrupt)
        assert np.array_equal(dst.numpy()[:3 * BB], src.numpy()[:3 * BB])
        st = store.statistics().tiers["disk"]
        assert st.checksum_failures == 1 and st.quarantined == 1
        assert (await store.lookup(keys)).tiers[3] is None


async def test_incompressible_data_turns_compression_off(make_agent: MakeAgent,
                                                          tmp_path: Path) -> None:
    agent = await make_agent("kv")
    n = 64
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 4)  # random bytes: nothing to gain
    src.numpy()[:] = data
    keys = keys_for(n)
    tier = kv.DiskTier(tmp_path / "kv", 1 << 28, segment_bytes=64 * BB, compress="lz4")
    async with kv.Store.open(agent, block_bytes=BB, tiers=[tier]) as store:
        for i in range(0, n, 8):
            await store.put(keys[i:i + 8], src[i * BB:(i + 8) * BB])
        ex = store.statistics().tiers["disk"].extra
        assert ex["compress_on"] == 0 and ex["compressed_blocks"] == 0, ex
        dst = agent.alloc(n * BB)
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == n and np.array_equal(dst.numpy(), data)


def test_host_tier_never_compresses() -> None:
    with pytest.raises(TypeError):
        kv.HostTier(1 << 20, compress="lz4")  # type: ignore[call-arg]


async def test_compressed_blocks_of_an_odd_size_read_back(make_agent: MakeAgent,
                                                          tmp_path: Path) -> None:
    """block_bytes not a multiple of compress_typesize (here odd): the blocks
    stored compressed read back whole (before: blosc compressed whole
    elements only, the last byte was left out, and every compressed block
    failed its size check at the read: BlockCorrupt, quarantined, lost)."""
    bb = BB + 1
    agent = await make_agent("kv")
    n = 8
    src = agent.alloc(n * bb)
    data = np.concatenate([np.resize(pattern(4096, i), bb) for i in range(n)])  # compressible
    src.numpy()[:] = data
    keys = keys_for(n)
    disk = kv.DiskTier(tmp_path / "kv", 1 << 24, segment_bytes=16 * bb, compress="lz4")
    async with kv.Store.open(agent, block_bytes=bb, tiers=[disk]) as store:
        assert (await within(store.put(keys, src[0:n * bb]))).stored == n
        assert disk.compressed_blocks > 0
        dst = agent.alloc(n * bb)
        res = await within(store.get(keys, dst[0:n * bb]))
        assert res.failed == () and res.prefix == n, res
        assert np.array_equal(dst.numpy(), data)

"""Faults in the tiered KV store, each with the real component: the S3 server
is ``rclone serve s3`` (killed with SIGKILL), a full filesystem is a small
tmpfs, cancellations land at chosen awaits. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3server
from conftest import cancel_after, pattern, wait_until, within
from s3server import S3Server, tier_dir

import aioxfer
from aioxfer import kv

s3 = s3server.s3  # the fixtures, by name
own_s3 = s3server.own_s3

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return kv.chain(np.arange(seed * 100_000, seed * 100_000 + 16 * n), block_tokens=16,
                    namespace=b"faults")


async def test_concurrent_object_puts_keep_their_own_bytes(make_agent: MakeAgent,
                                                            s3: S3Server) -> None:
    """Two puts into the object tier at once: each object holds its own block
    (the tier's staging memory is not refilled by the second while the first
    one's PUTs still read it), as a second store reading them back sees."""
    pytest.importorskip("obstore")
    bucket = s3.bucket(tier_dir("kvtest"))
    agent = await make_agent("kv")
    objs = agent.register_objects(f"s3://{bucket}/kvtest", **s3.kwargs())
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[kv.ObjectTier(objs, batch=4)])
    n = 4
    src = agent.alloc(2 * n * BB)
    data = pattern(2 * n * BB, 7)
    src.numpy()[:] = data
    ka, kb = keys_for(n, 1), keys_for(n, 2)
    try:
        ra, rb = await within(asyncio.gather(
            store.put(ka, src[0:n * BB], durable=True),
            store.put(kb, src[n * BB:2 * n * BB], durable=True)))
        assert ra.stored == rb.stored == n and ra.durable == rb.durable == n
    finally:
        await store.aclose()
    agent2 = await make_agent("kv2")
    objs2 = agent2.register_objects(f"s3://{bucket}/kvtest", **s3.kwargs())
    store2 = await kv.Store.open(agent2, block_bytes=BB, tiers=[kv.ObjectTier(objs2)])
    try:
        dst = agent2.alloc(2 * n * BB)
        res = await within(store2.get(ka + kb, dst[0:2 * n * BB]))
        assert res.failed == () and res.prefix == 2 * n
        assert np.array_equal(dst.numpy(), data)
    finally:
        await store2.aclose()


@pytest.fixture
def full_tmpfs(small_tmpfs: Path) -> Path:
    """conftest's 1 MiB tmpfs, filled to the last page by a file (removed by
    the test to make room): every write needing a new page fails ENOSPC."""
    (small_tmpfs / "kv").mkdir()
    with open(small_tmpfs / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\xff" * 4096)
    return small_tmpfs


async def test_disk_full_puts_are_dropped_and_counted(make_agent: MakeAgent,
                                                      full_tmpfs: Path) -> None:
    """ENOSPC when a new segment is made: the put stores nothing and says so
    (dropped, counted), raises no OSError, indexes nothing, leaves no file
    behind; with room again the same tier stores and serves them."""
    agent = await make_agent("kv")
    disk = kv.DiskTier(full_tmpfs / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
    src = agent.alloc(4 * BB)
    data = pattern(4 * BB, 3)
    src.numpy()[:] = data
    keys = keys_for(4, 3)
    try:
        res = await within(store.put(keys, src[0:4 * BB]))
        assert (res.stored, res.dropped) == (0, 4)
        st = store.statistics().tiers["disk"]
        assert st.dropped_stores.get("io_error", 0) + st.dropped_stores.get("no_room", 0) == 4
        assert (await store.lookup(keys)).prefix == 0
        assert not [p for p in (full_tmpfs / "kv").iterdir() if p.name.startswith("seg-")]
        (full_tmpfs / "filler").unlink()
        res = await within(store.put(keys, src[0:4 * BB], durable=True))
        assert res.stored == 4 and res.durable == 4
        dst = agent.alloc(4 * BB)
        got = await within(store.get(keys, dst[0:4 * BB]))
        assert got.prefix == 4 and np.array_equal(dst.numpy(), data)
    finally:
        await store.aclose()


async def test_host_slots_come_back_when_the_overflow_write_fails(make_agent: MakeAgent,
                                                                  full_tmpfs: Path) -> None:
    """A put larger than the host tier: the rest goes to the disk tier, which
    is full. The host slots reserved for the first blocks are used or given
    back, never lost (the tier keeps its capacity)."""
    agent = await make_agent("kv")
    host = kv.HostTier(4 * BB, put_wait=0)
    disk = kv.DiskTier(full_tmpfs / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 4)
    keys = keys_for(8, 4)
    try:
        res = await within(store.put(keys, src[0:8 * BB]))
        assert res.stored == 4 and res.dropped == 4
        assert len(host.free) + len(host.index) == host.n_slots
        await store.remove(keys)
        assert len(host.free) == host.n_slots
    finally:
        await store.aclose()


async def test_cancelled_overflow_put_gives_host_slots_back(make_agent: MakeAgent,
                                                            tmp_path: Path) -> None:
    """A put cancelled while its overflow blocks are written to the disk
    tier: the host slots it had reserved are free again afterwards."""
    agent = await make_agent("kv")
    host = kv.HostTier(4 * BB, put_wait=0)
    disk = kv.DiskTier(tmp_path / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 5)
    keys = keys_for(8, 5)
    try:
        task = asyncio.ensure_future(store.put(keys, src[0:8 * BB]))
        await until_in_flight(disk, "the overflow write")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(task)
        await within(quiesce(store))
        assert len(host.free) + len(host.index) == host.n_slots, (len(host.free), host.index)
    finally:
        await store.aclose()


async def until_in_flight(tier: kv.DiskTier, what: str) -> None:
    """Loop turns until the tier has an operation in flight (``what``: the
    operation awaited, named in the failure)."""
    for _ in range(100_000):
        if tier.counters.in_flight:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never started")


async def quiesce(store: kv.Store) -> None:
    """Until no operation holds pins and no write-back is under way."""
    host = store._host
    while True:
        s = store.statistics()
        if not (s.pins or s.pinned_bytes or s.fetches_in_flight
                or (host is not None and host.demoting)):
            return
        await asyncio.sleep(0.005)


async def test_cancelled_write_through_leaves_blocks_for_write_back(make_agent: MakeAgent,
                                                                    tmp_path: Path) -> None:
    """A write-through put cancelled while its blocks go to the disk tier:
    every block it left in host memory is on the disk tier or still dirty
    (written back later), never a clean copy the host tier drops unwritten."""
    agent = await make_agent("kv")
    host = kv.HostTier(16 * BB, write_through=True)
    disk = kv.DiskTier(tmp_path / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 6)
    keys = keys_for(8, 6)
    try:
        task = asyncio.ensure_future(store.put(keys, src[0:8 * BB]))
        await until_in_flight(disk, "the write-through")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(task)
        await within(quiesce(store))
        lost = [k for k in keys if k in host.index and host.index[k] not in host.dirty
                and disk._locate(k) is None]
        assert not lost, f"{len(lost)} blocks clean in host memory and on no lower tier"
    finally:
        await store.aclose()


async def test_object_server_killed_mid_get(make_agent: MakeAgent, own_s3: S3Server) -> None:
    """The S3 server SIGKILLed while a get reads blocks from it: the get ends
    (typed BlockUnavailable for what did not arrive, no hang), nothing from a
    cut-short body is promoted into host memory, no pin is left; restarted,
    the same store serves every block intact."""
    pytest.importorskip("obstore")
    from aioxfer.backends import registry

    s3 = own_s3
    bb = 1 << 20
    n = 48
    agent = await make_agent("kv")
    bucket = s3.bucket(tier_dir("kv"))
    objs = agent.register_objects(f"s3://{bucket}/kv", retry_timeout=2.0, max_retries=2,
                                  **s3.kwargs())
    host = kv.HostTier(2 * n * bb)
    store = await kv.Store.open(agent, block_bytes=bb, tiers=[host, kv.ObjectTier(objs)])
    src = agent.alloc(n * bb)
    data = pattern(n * bb, 8)
    src.numpy()[:] = data
    keys = keys_for(n, 8)
    backend = registry.instance(agent, "object")
    try:
        # Straight to the object tier (no room kept in host memory).
        ok = await within(store.tiers[1]._write(keys, [src] * n, [i * bb for i in range(n)]), 120)
        assert all(ok)
        dst = agent.alloc(n * bb)
        ops0 = backend.statistics().ops
        t = asyncio.ensure_future(store.get(keys, dst[0:n * bb]))
        await wait_until(lambda: backend.statistics().ops >= ops0 + 2, what="first GETs done")
        s3.kill()
        res = await within(t, 60)
        assert res.prefix < n
        assert all(isinstance(f.error, kv.BlockUnavailable) for f in res.failed), res.failed
        # Nothing cut short is promoted: no block that failed is in host
        # memory (blocks past the prefix that arrived whole, as their CRCs
        # show, may be; the get below checks the bytes of every block).
        assert res.failed and not [f.key for f in res.failed if f.key in host.index]
        await within(quiesce(store))
        assert backend.statistics().in_flight == 0
        s3.start()
        dst.numpy()[:] = 0
        res = await within(store.get(keys, dst[0:n * bb]), 120)
        assert res.prefix == n and np.array_equal(dst.numpy(), data)
    finally:
        await store.aclose()


async def test_failed_quarantine_delete_keeps_the_good_blocks(make_agent: MakeAgent,
                                                              s3: S3Server) -> None:
    """A corrupt object whose quarantine (DELETE) fails (its directory made
    immutable under the server): the get still delivers the verified blocks
    before it and reports the corrupt one as BlockCorrupt; it is not served
    again."""
    pytest.importorskip("obstore")
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr (an immutable directory)")
    bucket = s3.bucket(tier_dir("kvtest"))
    agent = await make_agent("kv")
    objs = agent.register_objects(f"s3://{bucket}/kvtest", max_retries=1, retry_timeout=1.0,
                                  **s3.kwargs())
    tier = kv.ObjectTier(objs)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier])
    src = agent.alloc(4 * BB)
    data = pattern(4 * BB, 9)
    src.numpy()[:] = data
    keys = keys_for(4, 9)
    path = s3.file(bucket, "kvtest/" + tier.object_key(keys[2]))
    locked = False
    try:
        assert (await within(store.put(keys, src[0:4 * BB]))).stored == 4
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0x01
        path.write_bytes(bytes(raw))
        r = subprocess.run(["chattr", "+i", str(path.parent)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"chattr +i failed here: {r.stderr.strip()}")
        locked = True
        dst = agent.alloc(4 * BB)
        res = await within(store.get(keys, dst[0:4 * BB]))
        assert res.prefix == 2, res
        assert [f.index for f in res.failed] == [2]
        assert isinstance(res.failed[0].error, kv.BlockCorrupt)
        assert np.array_equal(dst.numpy()[:2 * BB], data[:2 * BB])
        assert path.exists()  # the DELETE failed ...
        assert (await store.lookup(keys[2:3])).prefix == 0  # ... and it is not served again
    finally:
        if locked:
            subprocess.run(["chattr", "-i", str(path.parent)], capture_output=True)
        await store.aclose()


async def test_remove_during_a_get_is_not_undone_by_its_promotion(make_agent: MakeAgent,
                                                                  tmp_path: Path) -> None:
    """A get reading blocks from the disk tier while they are removed: the get
    may deliver them (it began first), but its promotion does not bring them
    back into host memory after remove() returned: they stay removed."""
    agent = await make_agent("kv")
    host = kv.HostTier(16 * BB)
    disk = kv.DiskTier(tmp_path / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    n = 8
    src = agent.alloc(n * BB)
    src.numpy()[:] = pattern(n * BB, 10)
    keys = keys_for(n, 10)
    try:
        assert all(await within(disk._write(keys, [src] * n, [i * BB for i in range(n)])))
        dst = agent.alloc(n * BB)
        t = asyncio.ensure_future(store.get(keys, dst[0:n * BB]))
        await until_in_flight(disk, "the disk read")
        assert await within(store.remove(keys)) == n
        await within(t)
        await within(quiesce(store))
        assert (await store.lookup(keys)).prefix == 0
        assert not [k for k in keys if k in host.index]
    finally:
        await store.aclose()


async def test_remove_during_write_back_stays_removed(make_agent: MakeAgent,
                                                      tmp_path: Path) -> None:
    """Blocks removed while the host tier writes them back to the disk tier:
    once both are over, no tier holds them (the write-back does not publish
    them on the disk tier after remove() returned)."""
    agent = await make_agent("kv")
    host = kv.HostTier(16 * BB)
    disk = kv.DiskTier(tmp_path / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    n = 4
    src = agent.alloc(n * BB)
    src.numpy()[:] = pattern(n * BB, 11)
    keys = keys_for(n, 11)
    try:
        assert (await within(store.put(keys, src[0:n * BB]))).stored == n
        assert len(host.dirty) == n
        wb = asyncio.ensure_future(host._write_back(disk, list(keys)))
        await until_in_flight(disk, "the write-back")
        assert await within(store.remove(keys)) == n
        await within(wb)
        await within(quiesce(store))
        assert (await store.lookup(keys)).prefix == 0
        assert not [k for k in keys if disk._locate(k) is not None]
    finally:
        await store.aclose()


async def test_durable_put_whose_header_cannot_be_written(make_agent: MakeAgent,
                                                          full_tmpfs: Path) -> None:
    """Room for a segment's superblock and a block's data but not for its
    header sector (ENOSPC): a durable put does not report the block stored
    (nor durable), raises nothing untyped, and the tier does not index it."""
    agent = await make_agent("kv")
    disk = kv.DiskTier(full_tmpfs / "kv", 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
    src = agent.alloc(BB)
    src.numpy()[:] = pattern(BB, 12)
    keys = keys_for(1, 12)
    filler = full_tmpfs / "filler"
    # superblock page + the block's pages free; the header sector's is not
    os.truncate(filler, filler.stat().st_size - 4096 - BB)
    try:
        res = await within(store.put(keys, src[0:BB], durable=True))
        assert (res.stored, res.durable, res.dropped) == (0, 0, 1), res
        assert (await store.lookup(keys)).prefix == 0
        assert store.statistics().tiers["disk"].dropped_stores.get("io_error") == 1
        filler.unlink()  # room again: the close writes the header, marked removed
    finally:
        await store.aclose()
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[
        kv.DiskTier(full_tmpfs / "kv", 64 * BB, segment_bytes=8 * BB)])
    try:
        assert (await store.lookup(keys)).prefix == 0  # not back after a restart either
    finally:
        await store.aclose()


async def turns_until(pred: Callable[[], bool], limit: int = 10_000) -> bool:
    for _ in range(limit):
        if pred():
            return True
        await asyncio.sleep(0)
    return pred()


async def test_channel_wakeup_passes_on_when_the_woken_sender_is_cancelled() -> None:
    """A full channel with two senders waiting: a receive makes room and wakes
    the first, which is cancelled before it runs; the second one sends (the
    wake-up is not lost with the cancelled one: no pipeline stalls)."""
    ch: kv.Channel[int] = kv.Channel(1)
    await ch.send(0)
    w1 = asyncio.ensure_future(ch.send(1))
    w2 = asyncio.ensure_future(ch.send(2))
    assert not await turns_until(lambda: w1.done() or w2.done(), 10)
    assert await ch.receive() == 0  # room for one: w1 is woken ...
    w1.cancel()  # ... and cancelled before it runs
    assert await turns_until(w2.done), "the second sender was never woken"
    assert await ch.receive() == 2


async def test_channel_wakeup_passes_on_when_the_woken_receiver_is_cancelled() -> None:
    ch: kv.Channel[int] = kv.Channel(1)
    r1 = asyncio.ensure_future(ch.receive())
    r2 = asyncio.ensure_future(ch.receive())
    assert not await turns_until(lambda: r1.done() or r2.done(), 10)
    await ch.send(7)  # wakes r1 ...
    r1.cancel()  # ... cancelled before it runs
    assert await turns_until(r2.done), "the second receiver was never woken"
    assert r2.result() == 7


async def test_removed_key_written_twice_stays_removed_after_restart(make_agent: MakeAgent,
                                                                     tmp_path: Path) -> None:
    """One key written to the disk tier by two writers at once (a write-back
    beside a put) has two records; once removed, neither comes back when the
    tier is reopened."""
    agent = await make_agent("kv")
    path = tmp_path / "kv"
    disk = kv.DiskTier(path, 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
    src = agent.alloc(BB)
    src.numpy()[:] = pattern(BB, 13)
    keys = keys_for(1, 13)
    try:
        a, b = await within(asyncio.gather(disk._write(keys, [src], [0]),
                                           disk._write(keys, [src], [0])))
        assert a == b == [True]
        assert await within(store.remove(keys)) == 1
        assert (await store.lookup(keys)).prefix == 0
    finally:
        await store.aclose()
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[
        kv.DiskTier(path, 64 * BB, segment_bytes=8 * BB)])
    try:
        assert (await store.lookup(keys)).prefix == 0
    finally:
        await store.aclose()


async def test_object_server_down_is_a_miss_not_a_failed_get(make_agent: MakeAgent,
                                                             own_s3: S3Server) -> None:
    """The S3 server is dead when a get has to ask it about the keys the host
    tier does not hold: the get delivers the host tier's leading blocks and
    ends its prefix there (the probe's failure counted), it does not raise."""
    pytest.importorskip("obstore")
    s3 = own_s3
    agent = await make_agent("kv")
    bucket = s3.bucket(tier_dir("kv"))
    objs = agent.register_objects(f"s3://{bucket}/kv", retry_timeout=1.0, max_retries=1,
                                  connect_timeout=0.5, **s3.kwargs())
    host = kv.HostTier(16 * BB)
    tier = kv.ObjectTier(objs)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, tier])
    n = 8
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 14)
    src.numpy()[:] = data
    keys = keys_for(n, 14)
    try:
        assert (await within(store.put(keys[:4], src[0:4 * BB]))).stored == 4
        s3.kill()
        dst = agent.alloc(n * BB)
        res = await within(store.get(keys, dst[0:n * BB]), 60)
        assert res.prefix == 4 and res.failed == (), res
        assert np.array_equal(dst.numpy()[:4 * BB], data[:4 * BB])
        assert store.statistics().tiers["object"].errors >= 1
        assert (await within(store.lookup(keys), 60)).prefix == 4
    finally:
        await store.aclose()


def assert_whole(store: kv.Store, where: object = None) -> None:
    """Nothing pinned, reserved, half-filled or in flight is left over."""
    s = store.statistics()
    assert (s.pins, s.pinned_bytes, s.fetches_in_flight) == (0, 0, 0), s
    assert not store._filling and not getattr(store, "_removing", None)
    host = store._host
    if host is not None:
        assert len(host.free) + len(host.index) == host.n_slots, (len(host.free), len(host.index))
        assert not host.pinned and not any(host.pins) and not host.doomed, (
            where, host.pinned, host.pins, host.doomed)
        assert not host.demoting
    for t in store.tiers:
        if isinstance(t, kv.DiskTier):
            assert not any(seg.writing for seg in t.segs.values())
            assert not any(seg.pins for seg in t.segs.values())


@pytest.mark.parametrize("write_through", [False, True])
async def test_put_and_get_cancelled_at_every_step(make_agent: MakeAgent, tmp_path: Path,
                                                   write_through: bool) -> None:
    """A put (half of it overflowing to the disk tier) and a get (half from
    the disk tier) cancelled after 0, 1, 2, ... loop turns: whatever the
    point, the store is whole afterwards, and every block it indexes reads
    back with the bytes put."""
    agent = await make_agent("kv")
    host = kv.HostTier(4 * BB, put_wait=0, write_through=write_through)
    disk = kv.DiskTier(tmp_path / "kv", 256 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    n = 8
    src = agent.alloc(n * BB)
    dst = agent.alloc(n * BB)
    try:
        finished = 0
        for turns in range(200):
            data = pattern(n * BB, 100 + turns)
            src.numpy()[:] = data
            keys = keys_for(n, 100 + turns)
            finished += await cancel_after(store.put(keys, src[0:n * BB]), turns)
            got = asyncio.ensure_future(store.get(keys, dst[0:n * BB]))
            for _ in range(turns // 2):
                await asyncio.sleep(0)
            got.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await within(got)
            await within(quiesce(store))
            assert_whole(store)
            res = await within(store.get(keys, dst[0:n * BB]))
            assert res.failed == ()
            for i in range(n):
                if res.tiers[i] is not None:
                    assert np.array_equal(dst.numpy()[i * BB:(i + 1) * BB],
                                          data[i * BB:(i + 1) * BB]), (turns, i, res.tiers[i])
            await within(quiesce(store))
            assert_whole(store)
            await store.remove(keys)
            if finished >= 3:
                break  # cancelled at every step of a put, then past its end
        assert finished >= 1
    finally:
        await store.aclose()


async def test_prefetch_stream_and_remove_cancelled_at_every_step(make_agent: MakeAgent,
                                                                  tmp_path: Path) -> None:
    """A prefetch, a layer stream and a remove of blocks half in host memory,
    half on the disk tier, each cancelled after 0, 1, 2, ... loop turns: the
    store is whole after each, and what it still indexes reads back intact."""
    agent = await make_agent("kv")
    host = kv.HostTier(8 * BB, put_wait=0)
    disk = kv.DiskTier(tmp_path / "kv", 256 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk])
    n = 8
    src = agent.alloc(n * BB)
    dst = agent.alloc(n * BB)

    async def start(step: int, keys: list[bytes]) -> None:
        if step == 0:
            await store.prefetch(keys)
        elif step == 1:
            async with store.stream(keys, dst[0:n * BB], layers=4) as s:
                async for _layer in s:
                    pass
        else:
            await store.remove(keys[2:3])

    try:
        for turns in range(60):
            data = pattern(n * BB, 300 + turns)
            src.numpy()[:] = data
            keys = keys_for(n, 300 + turns)
            # half in host memory, half straight to the disk tier
            assert all(await within(disk._write(keys[4:], [src] * 4,
                                                [i * BB for i in range(4, n)])))
            assert (await within(store.put(keys[:4], src[0:4 * BB]))).stored == 4
            for step in range(3):
                task = asyncio.ensure_future(start(step, keys))
                for _ in range(turns):
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await within(task)
                await within(quiesce(store))
                assert_whole(store, (turns, step))
            res = await within(store.get(keys, dst[0:n * BB]))
            assert res.failed == ()
            for i in range(n):
                if res.tiers[i] is not None:
                    assert np.array_equal(dst.numpy()[i * BB:(i + 1) * BB],
                                          data[i * BB:(i + 1) * BB]), (turns, i, res.tiers[i])
            await within(store.remove(keys))
            await within(quiesce(store))
            assert_whole(store)
    finally:
        await store.aclose()


async def test_object_puts_cancelled_at_every_step(make_agent: MakeAgent, s3: S3Server) -> None:
    """Puts into the object tier (two at once, different blocks) cancelled
    after 0, 1, 2, ... loop turns: every object the bucket then holds is the
    block of its key (read back and verified by a second store), and nothing
    is left in flight."""
    pytest.importorskip("obstore")
    from aioxfer.backends import registry

    bucket = s3.bucket(tier_dir("kvtest"))
    agent = await make_agent("kv")
    objs = agent.register_objects(f"s3://{bucket}/kvtest", **s3.kwargs())
    tier = kv.ObjectTier(objs, batch=2)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier])
    n = 4
    src = agent.alloc(2 * n * BB)
    written: dict[bytes, np.ndarray] = {}
    must: set[bytes] = set()  # put by a put that was not cancelled
    try:
        for turns in range(0, 40, 2):
            data = pattern(2 * n * BB, 500 + turns)
            src.numpy()[:] = data
            ka, kb = keys_for(n, 500 + 2 * turns), keys_for(n, 501 + 2 * turns)
            ta = asyncio.ensure_future(store.put(ka, src[0:n * BB]))
            tb = asyncio.ensure_future(store.put(kb, src[n * BB:2 * n * BB]))
            for _ in range(turns):
                await asyncio.sleep(0)
            tb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await within(tb)
            assert (await within(ta)).stored == n
            for i, k in enumerate(ka + kb):
                written[k] = data[i * BB:(i + 1) * BB]
            must.update(ka)
        assert registry.instance(agent, "object").statistics().in_flight == 0
    finally:
        await store.aclose()
    agent2 = await make_agent("kv2")
    objs2 = agent2.register_objects(f"s3://{bucket}/kvtest", **s3.kwargs())
    tier2 = kv.ObjectTier(objs2)
    store2 = await kv.Store.open(agent2, block_bytes=BB, tiers=[tier2])
    try:
        dst = agent2.alloc(BB)
        found = 0
        for k, want in written.items():
            res = await within(store2.get([k], dst[0:BB]))
            assert res.failed == (), res
            if res.prefix:
                found += 1
                assert np.array_equal(dst.numpy(), want)
            else:
                assert k not in must, "a block a finished put stored is not in the bucket"
        assert found >= len(must)
    finally:
        await store2.aclose()


async def test_remove_with_the_object_server_down(make_agent: MakeAgent,
                                                  own_s3: S3Server) -> None:
    """remove() while the S3 server is dead: the host tier's copies go, the
    store serves the keys from no tier, and the caller gets a typed
    RemoveIncomplete (not the transport's error) saying what was removed.
    The server back, this store does not find the stale objects again (it
    did: the object tier forgot them only once their DELETE succeeded, so
    the next lookup probed them back in); another store still sees them
    until a second remove() deletes them."""
    pytest.importorskip("obstore")
    s3 = own_s3
    bucket = s3.bucket(tier_dir("kv"))
    agent = await make_agent("kv")
    kw = dict(retry_timeout=1.0, max_retries=1, connect_timeout=0.5, **s3.kwargs())
    objs = agent.register_objects(f"s3://{bucket}/kv", **kw)
    host = kv.HostTier(16 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, kv.ObjectTier(objs)])
    n = 4
    src = agent.alloc(n * BB)
    src.numpy()[:] = pattern(n * BB, 15)
    keys = keys_for(n, 15)
    agent2 = await make_agent("kv2")
    objs2 = agent2.register_objects(f"s3://{bucket}/kv", **kw)
    tier2 = kv.ObjectTier(objs2)
    other = await kv.Store.open(agent2, block_bytes=BB, tiers=[tier2])
    try:
        res = await within(store.put(keys, src[0:n * BB], durable=True))
        assert res.durable == n
        s3.kill()
        with pytest.raises(kv.RemoveIncomplete) as ei:
            await within(store.remove(keys), 60)
        assert ei.value.tiers == ("object",) and ei.value.removed == n
        assert isinstance(ei.value.__cause__, aioxfer.XferError)
        assert not [k for k in keys if k in host.index]
        assert (await within(store.lookup(keys), 60)).prefix == 0
        assert_whole(store)
        s3.start()
        assert (await within(store.lookup(keys), 60)).prefix == 0  # not probed back in
        assert (await within(other.lookup(keys), 60)).prefix == n  # still in the bucket
        await within(store.remove(keys), 60)  # ... until removed again
        tier2.index.clear()  # asked afresh
        assert (await within(other.lookup(keys), 60)).prefix == 0
    finally:
        await other.aclose()
        await store.aclose()


class JournalTier(kv.Tier):
    """A tier of the application's own (the public Tier interface) that
    stores nothing and writes a journal file when the store closes."""

    stores = False

    def __init__(self, path: Path) -> None:
        super().__init__("journal")
        self.path = path

    def _locate(self, key: bytes) -> None:
        return None

    async def _aclose(self) -> None:
        self.path.write_bytes(b"closed\n")


async def test_a_failing_tier_close_does_not_leave_the_others_open(make_agent: MakeAgent,
                                                                   tmp_path: Path) -> None:
    """The lowest tier's close fails for real (its directory is gone:
    FileNotFoundError): Store.aclose still closes the disk tier above it
    (headers written: its blocks are found by the next open) and releases
    the host memory, then raises that error; a second aclose is a no-op.
    (Before: aclose stopped at the failing tier, the disk tier and the host
    region left open.)"""
    agent = await make_agent("kv")
    gone = tmp_path / "journal"
    gone.mkdir()
    disk = kv.DiskTier(tmp_path / "disk", 64 * BB, segment_bytes=8 * BB)
    host = kv.HostTier(8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[host, disk,
                                                              JournalTier(gone / "log")])
    n = 4
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 16)
    src.numpy()[:] = data
    keys = keys_for(n, 16)
    assert (await within(store.put(keys, src[0:n * BB]))).stored == n  # dirty in host memory
    shutil.rmtree(gone)
    with pytest.raises(FileNotFoundError):
        await within(store.aclose())
    assert store.closed
    assert disk._store is None and disk.stage is not None and disk.stage.closed
    assert host.region is not None and host.region.closed
    await within(store.aclose())
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[
        kv.DiskTier(tmp_path / "disk", 64 * BB, segment_bytes=8 * BB)])
    try:
        dst = agent.alloc(n * BB)
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == n and np.array_equal(dst.numpy(), data)
    finally:
        await store.aclose()


async def test_object_removed_by_another_store_is_a_miss(make_agent: MakeAgent,
                                                         s3: S3Server) -> None:
    """Two stores share a bucket; one removes a block the other has indexed.
    The other's get delivers the blocks before it and ends its prefix there
    (a miss, BlockMissing's meaning: gone meanwhile), it does not fail the
    whole read (before: every block of the batch BlockUnavailable, prefix
    0, though only one object was gone); put again, it is served again."""
    pytest.importorskip("obstore")
    bucket = s3.bucket(tier_dir("kv"))
    agent = await make_agent("kv")
    objs = agent.register_objects(f"s3://{bucket}/kv", **s3.kwargs())
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[kv.ObjectTier(objs)])
    agent2 = await make_agent("kv2")
    objs2 = agent2.register_objects(f"s3://{bucket}/kv", **s3.kwargs())
    other = await kv.Store.open(agent2, block_bytes=BB, tiers=[kv.ObjectTier(objs2)])
    n = 4
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 17)
    src.numpy()[:] = data
    keys = keys_for(n, 17)
    try:
        assert (await within(store.put(keys, src[0:n * BB]))).stored == n
        assert await within(other.remove(keys[2:3])) == 0  # (not in its index)
        dst = agent.alloc(n * BB)
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == 2 and res.failed == (), res
        assert np.array_equal(dst.numpy()[:2 * BB], data[:2 * BB])
        assert_whole(store)
        put = await within(store.put(keys, src[0:n * BB]))
        assert (put.stored, put.present) == (1, n - 1), put
        dst.numpy()[:] = 0
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == n and np.array_equal(dst.numpy(), data)
    finally:
        await other.aclose()
        await store.aclose()


async def test_open_failing_reports_its_own_error_not_the_cleanups(make_agent: MakeAgent,
                                                                   tmp_path: Path) -> None:
    """A tier fails to open (the disk tier's path is a file) and the cleanup
    that follows meets a second failure (another tier's close): Store.open
    raises the open's error (the cause the caller must fix), with everything
    opened so far closed. (Before: the cleanup's FileNotFoundError replaced
    it.)"""
    agent = await make_agent("kv")
    (tmp_path / "journal").mkdir()
    (tmp_path / "notadir").write_bytes(b"x")
    host = kv.HostTier(8 * BB)
    tiers = [host, JournalTier(tmp_path / "journal" / "log"),
             kv.DiskTier(tmp_path / "notadir", 64 * BB, segment_bytes=8 * BB)]
    shutil.rmtree(tmp_path / "journal")
    with pytest.raises(OSError) as ei:
        await within(kv.Store.open(agent, block_bytes=BB, tiers=tiers))
    assert not isinstance(ei.value, FileNotFoundError), ei.value
    assert "notadir" in str(ei.value)
    assert host.region is None or host.region.closed
    assert all(t._store is None for t in tiers)


def immutable(path: Path, on: bool) -> None:
    r = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True,
                       text=True)
    if on and r.returncode != 0:
        pytest.skip(f"chattr +i failed here: {r.stderr.strip()}")


async def test_removed_keys_stay_removed_when_their_segment_cannot_be_marked(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """remove() of blocks in a sealed segment file made immutable (chattr +i:
    their entries cannot be marked removed in place, EPERM): the remove
    still succeeds (the keys are tombstoned in the tier's own file), and
    after a restart, with the file writable again or not, they stay removed
    while the rest of that segment is served; a key put again after that
    survives the next restart; once marked in place, the tombstones are
    retired. (Before: RemoveIncomplete, and the restart brought the removed
    blocks back.)"""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr")
    agent = await make_agent("kv")
    path = tmp_path / "kv"

    def tier() -> kv.DiskTier:
        return kv.DiskTier(path, 64 * BB, segment_bytes=8 * BB)

    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier()])
    n = 12  # segment 0 sealed (8 blocks), segment 1 active
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 18)
    src.numpy()[:] = data
    keys = keys_for(n, 18)
    seg0 = path / "seg-00000000.axkv"
    try:
        assert (await within(store.put(keys, src[0:n * BB], durable=True))).durable == n
        immutable(seg0, True)
        assert await within(store.remove(keys[:3])) == 3
        assert (await store.lookup(keys[:3])).prefix == 0
    finally:
        try:
            await store.aclose()
        finally:
            immutable(seg0, False)
    immutable(seg0, True)  # still immutable at the restart
    try:
        store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier()])
        try:
            assert (await store.lookup(keys[:3])).prefix == 0, "removed blocks came back"
            dst = agent.alloc((n - 3) * BB)
            res = await within(store.get(keys[3:], dst[0:(n - 3) * BB]))
            assert res.prefix == n - 3 and np.array_equal(dst.numpy(), data[3 * BB:])
        finally:
            await store.aclose()
    finally:
        immutable(seg0, False)
    disk = tier()
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
    try:
        assert (await store.lookup(keys[:3])).prefix == 0
        await wait_until(lambda: not disk._tasks, what="the tombstoned records marked")
        assert not (path / "tombstones.axkv").exists(), "tombstones not retired"
        assert (await within(store.put(keys[:1], src[0:BB], durable=True))).durable == 1
    finally:
        await store.aclose()
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier()])
    try:
        dst = agent.alloc(BB)
        res = await within(store.get(keys[:1], dst[0:BB]))
        assert res.prefix == 1 and np.array_equal(dst.numpy(), data[:BB])
        assert (await store.lookup(keys[1:3])).prefix == 0
    finally:
        await store.aclose()


async def test_object_put_cancelled_while_the_server_hangs(make_agent: MakeAgent,
                                                           own_s3: S3Server) -> None:
    """The S3 server stops answering (SIGSTOP) under a durable put into the
    object tier: cancelled, the put ends at once (before: it waited for its
    PUTs, up to the client's timeouts, a minute here), stores nothing, and
    its memory and the tier's stage are reused at once; once the server
    runs again every object in the bucket is its key's block, and the tier
    stores the next blocks."""
    pytest.importorskip("obstore")
    import signal

    s3 = own_s3
    bucket = s3.bucket(tier_dir("kv"))
    agent = await make_agent("kv")
    kw = dict(retry_timeout=60.0, max_retries=2, connect_timeout=60.0, read_timeout=60.0,
              **s3.kwargs())
    objs = agent.register_objects(f"s3://{bucket}/kv", **kw)
    tier = kv.ObjectTier(objs, batch=4)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier])
    n = 4
    src = agent.alloc(2 * n * BB)
    data = pattern(2 * n * BB, 19)
    src.numpy()[:] = data
    keys, later = keys_for(n, 19), keys_for(n, 20)
    assert s3.proc is not None
    try:
        s3.proc.send_signal(signal.SIGSTOP)
        try:
            put = asyncio.ensure_future(store.put(keys, src[0:n * BB], durable=True))
            await until_in_flight(tier, "the PUTs")
            await asyncio.sleep(0.5)  # (the requests well inside the client, not a timing)
            put.cancel()
            with pytest.raises(asyncio.CancelledError):
                await within(put, 10)
            assert not [k for k in keys if k in tier.index]
            src.numpy()[:n * BB] = 0  # reused by its owner
            late = asyncio.ensure_future(store.put(later, src[n * BB:2 * n * BB], durable=True))
            await until_in_flight(tier, "the next PUTs")
        finally:
            s3.proc.send_signal(signal.SIGCONT)
        assert (await within(late, 60)).durable == n
    finally:
        await store.aclose()
    agent2 = await make_agent("kv2")
    objs2 = agent2.register_objects(f"s3://{bucket}/kv", **kw)
    store2 = await kv.Store.open(agent2, block_bytes=BB, tiers=[kv.ObjectTier(objs2)])
    try:
        dst = agent2.alloc(BB)
        for i, k in enumerate(keys + later):
            res = await within(store2.get([k], dst[0:BB]), 60)
            assert res.failed == (), res
            if res.prefix:
                assert np.array_equal(dst.numpy(), data[i * BB:(i + 1) * BB]), i
            else:
                assert k in keys, "a block the finished put stored is not in the bucket"
    finally:
        await store2.aclose()


async def test_key_put_again_during_a_tombstoned_remove_survives_a_restart(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A key removed from an immutable segment (so tombstoned) is put again
    while that remove still waits for the tier's header lock: the new
    record is what the tier serves, and after a restart too (the tombstone
    buries the removed record's sequence number, not the tier's latest)."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr")
    agent = await make_agent("kv")
    path = tmp_path / "kv"
    disk = kv.DiskTier(path, 64 * BB, segment_bytes=8 * BB)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[disk])
    n = 10
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 21)
    src.numpy()[:] = data
    keys = keys_for(n, 21)
    seg0 = path / "seg-00000000.axkv"
    try:
        assert (await within(store.put(keys, src[0:n * BB], durable=True))).durable == n
        immutable(seg0, True)
        assert disk.lock is not None
        async with disk.lock:
            rm = asyncio.ensure_future(store.remove(keys[:1]))
            assert await turns_until(lambda: keys[0] not in disk.index)
            assert await within(disk._write(keys[:1], [src], [0])) == [True]
        assert await within(rm) == 1
        assert disk.tombstoned == 1
        assert (await store.lookup(keys[:1])).prefix == 1
    finally:
        try:
            await store.aclose()
        finally:
            immutable(seg0, False)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[
        kv.DiskTier(path, 64 * BB, segment_bytes=8 * BB)])
    try:
        dst = agent.alloc(BB)
        res = await within(store.get(keys[:1], dst[0:BB]))
        assert res.prefix == 1 and np.array_equal(dst.numpy(), data[:BB])
    finally:
        await store.aclose()

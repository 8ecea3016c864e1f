"""aioxfer.kv: per-layer streaming, prefetch, pipelines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import ClosedResourceError, kv

BB = 32 << 10
LAYERS = 8
LB = BB // LAYERS
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"stream")


async def test_stream_block_layout(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(16 * BB)
    data = pattern(16 * BB, 1)
    src.numpy()[:] = data
    dst = agent.alloc(16 * BB)
    keys = keys_for(16)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(32 * BB)]) as store:
        await store.put(keys[:12], src[0:12 * BB])
        seen = []
        async with store.stream(keys, dst[0:16 * BB], layers=LAYERS) as layers:
            async for item in layers:
                assert item.prefix == 12 and item.nbytes == 12 * LB
                # layer l of every leading block is there, later layers need not be
                view = dst.numpy().reshape(16, LAYERS, LB)
                want = data.reshape(16, LAYERS, LB)
                assert np.array_equal(view[:12, item.layer], want[:12, item.layer])
                seen.append(item.layer)
        assert seen == list(range(LAYERS))
        assert np.array_equal(dst.numpy()[:12 * BB], data[:12 * BB])
        assert store.statistics().pins == 0


async def test_stream_layer_major_targets_from_disk(make_agent: MakeAgent,
                                                    tmp_path: Path) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(8 * BB)
    data = pattern(8 * BB, 2)
    src.numpy()[:] = data
    keys = keys_for(8)
    # a layer-major cache: one region per layer, block i of a layer at i * LB
    caches = [agent.alloc(8 * LB) for _ in range(LAYERS)]
    async with kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(16 * BB), kv.DiskTier(tmp_path, 1 << 26, segment_bytes=8 * BB)]) as store:
        await store.put(keys, src[0:8 * BB], durable=True)
        host = store.tiers[0]
        assert isinstance(host, kv.HostTier)
        for k in keys:
            host.evict(k, "test")
        targets = [c.segments(np.arange(8) * LB, np.full(8, LB)) for c in caches]
        got = [item.layer async for item in store.stream(keys, targets, layers=LAYERS)]
        assert got == list(range(LAYERS))
        for layer, c in enumerate(caches):
            assert np.array_equal(c.numpy().reshape(8, LB), data.reshape(8, LAYERS, LB)[:, layer])
        assert store.statistics().tiers["host"].promotions == 8
        assert store.statistics().pins == 0


async def test_stream_left_early_releases_pins(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(8 * BB)
    keys = keys_for(8)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB)]) as store:
        await store.put(keys, src[0:8 * BB])
        async for item in store.stream(keys, agent.alloc(8 * BB)[0:8 * BB], layers=LAYERS):
            assert item.layer == 0
            break
        await asyncio.sleep(0)
        assert store.statistics().pins == 0
        with pytest.raises(ValueError):
            store.stream(keys, src[0:8 * BB], layers=3)  # 3 does not divide the block


async def test_stream_layers_in_order_across_regions(make_agent: MakeAgent) -> None:
    """Layers come in order, each landed when yielded, for targets spread over
    two regions (one transfer per region per layer) and only up to the
    prefix the store holds; per-layer targets over two regions likewise."""
    agent = await make_agent("kv")
    n, held = 12, 9
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 4)
    src.numpy()[:] = data
    want = data.reshape(n, LAYERS, LB)
    keys = keys_for(n)
    a, b = agent.alloc(n * BB), agent.alloc(n * BB)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(32 * BB)]) as store:
        await store.put(keys[:held], src[0:held * BB])
        # blocks alternate between a and b, at scattered places
        where = [(a if i % 2 else b, (n - 1 - i) * BB) for i in range(n)]
        seen = []
        async for item in store.stream(keys, [r[o:o + BB] for r, o in where], layers=LAYERS):
            assert item.prefix == held and item.nbytes == held * LB
            for i, (r, o) in enumerate(where[:held]):
                got = r.numpy()[o + item.layer * LB:o + (item.layer + 1) * LB]
                assert np.array_equal(got, want[i, item.layer]), (i, item.layer)
            seen.append(item.layer)
        assert seen == list(range(LAYERS))
        # layer-major targets, block i of each layer in region (i % 2)
        caches = [(agent.alloc(n * LB), agent.alloc(n * LB)) for _ in range(LAYERS)]
        targets = [[c[i % 2][i * LB:(i + 1) * LB] for i in range(n)] for c in caches]
        seen = []
        async for item in store.stream(keys, targets, layers=LAYERS):
            c = caches[item.layer]
            for i in range(held):
                got = c[i % 2].numpy()[i * LB:(i + 1) * LB]
                assert np.array_equal(got, want[i, item.layer]), (i, item.layer)
            seen.append(item.layer)
        assert seen == list(range(LAYERS))
        assert store.statistics().tiers["host"].hits == 2 * held
        assert store.statistics().pins == 0


async def test_stream_first_layer_alone_then_the_window(make_agent: MakeAgent) -> None:
    """Layer 0 is posted alone and handed out without waiting for more posts;
    the next layers are posted from the loop right after it (while the
    caller works on layer 0)."""
    agent = await make_agent("kv")
    src = agent.alloc(8 * BB)
    keys = keys_for(8)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB)]) as store:
        await store.put(keys, src[0:8 * BB])
        stream = store.stream(keys, agent.alloc(8 * BB)[0:8 * BB], layers=LAYERS)
        async with stream:
            first = await within(stream.__anext__())
            assert first.layer == 0 and len(stream._pending) == 1  # nothing else posted yet
            await asyncio.sleep(0)  # the caller yields to the loop: the window opens
            assert len(stream._pending) == 1 + 2
            assert [item.layer async for item in stream] == list(range(1, LAYERS))
        assert store.statistics().pins == 0


@pytest.mark.parametrize("eviction", ["lru", "fifo", "s3fifo", "arc"])
async def test_stream_blocks_removed_under_it(make_agent: MakeAgent, eviction: str) -> None:
    """Blocks removed while a stream holds them (after layer 0 is out, before
    its hits reach the eviction policy): the stream goes on from the pinned
    slots, the policy hears only of blocks still there, and the pins go. The
    soak found this: LRU's hit raised KeyError for a key it had lost, in a
    loop callback, and pins leaked."""
    agent = await make_agent("kv")
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 6)
    keys = keys_for(8)
    tier = kv.HostTier(16 * BB, eviction=eviction)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[tier]) as store:
        await store.put(keys, src[0:8 * BB])
        dst = agent.alloc(8 * BB)
        stream = store.stream(keys, dst[0:8 * BB], layers=LAYERS)
        async with stream:
            first = await within(stream.__anext__())
            assert first.layer == 0 and first.prefix == 8
            await store.remove(keys[2:5])  # before the window opens
            assert [item.layer async for item in stream] == list(range(1, LAYERS))
        assert np.array_equal(dst.numpy(), src.numpy())  # copied from the pinned slots
        assert store.statistics().pins == 0
        assert (await store.lookup(keys)).prefix == 2
        # The policy tracks exactly what is indexed: filling the tier evicts
        # through it without a KeyError.
        more = keys_for(40)[8:]
        big = agent.alloc(32 * BB)
        await store.put(more, big[0:32 * BB])
        assert store.statistics().pins == 0


async def test_stream_cancelled_mid_way_releases_everything(make_agent: MakeAgent) -> None:
    """A task iterating a stream, cancelled while layers are in flight: it
    ends at once, the pins go, the copies posted settle (none left in the
    agent), and the blocks can be evicted and reused; so does a stream left
    right after layer 0, before the window opened."""
    agent = await make_agent("kv")
    bb = 256 << 10  # layers big enough to be in flight across loop turns
    n = 16
    src = agent.alloc(n * bb)
    src.numpy()[:] = pattern(n * bb, 5)
    keys = keys_for(n)
    async with kv.Store.open(agent, block_bytes=bb, tiers=[kv.HostTier(n * bb)]) as store:
        await store.put(keys, src[0:n * bb])
        dst = agent.alloc(n * bb)
        got: list[int] = []
        third = asyncio.Event()

        async def consume() -> None:
            async for item in store.stream(keys, dst[0:n * bb], layers=LAYERS):
                got.append(item.layer)
                if item.layer == 2:
                    third.set()
                    await asyncio.sleep(3600)  # cancelled here, layers 3.. in flight

        task = asyncio.ensure_future(consume())
        await within(third.wait())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert got == [0, 1, 2]
        assert store.statistics().pins == 0
        for _ in range(500):  # the copies posted settle (completed or cancelled)
            if not agent.statistics().in_flight:
                break
            await asyncio.sleep(0.01)
        assert agent.statistics().in_flight == 0
        # left right after layer 0, in the same loop turn: the window never opens
        stream = store.stream(keys, dst[0:n * bb], layers=LAYERS)
        assert (await within(stream.__anext__())).layer == 0
        await stream.aclose()
        await asyncio.sleep(0)
        assert len(stream._pending) == 1 and store.statistics().pins == 0
        # nothing holds the blocks: all of them can go and be replaced
        assert await store.remove(keys) == n
        assert (await store.put(keys_for(2 * n)[n:], src[0:n * bb])).stored == n
        assert store.statistics().tiers["host"].hits == 2 * n


async def test_prefetch_brings_blocks_up_and_is_cancellable(make_agent: MakeAgent,
                                                            tmp_path: Path) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(32 * BB)
    src.numpy()[:] = pattern(32 * BB, 3)
    keys = keys_for(32)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[
            kv.HostTier(64 * BB), kv.DiskTier(tmp_path, 1 << 26)]) as store:
        await store.put(keys, src[0:32 * BB], durable=True)
        host = store.tiers[0]
        assert isinstance(host, kv.HostTier)
        for k in keys:
            host.evict(k, "test")
        assert await within(store.prefetch(keys[:16])) == 16
        assert (await store.lookup(keys)).tiers == ("host",) * 16 + ("disk",) * 16
        task = asyncio.ensure_future(store.prefetch(keys))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the reads already posted land and are kept
            if not store.statistics().pins:
                break
            await asyncio.sleep(0.01)
        assert store.statistics().pins == 0 and store.statistics().fetches_in_flight == 0
        dst = agent.alloc(32 * BB)
        res = await store.get(keys, dst[0:32 * BB])
        assert res.prefix == 32 and np.array_equal(dst.numpy(), src.numpy())


# ---------------------------------------------------------------- pipelines


async def numbers(n: int, log: list[int]) -> AsyncIterator[int]:
    for i in range(n):
        log.append(i)
        yield i


async def test_pipeline_backpressure_and_order() -> None:
    produced: list[int] = []
    out: list[int] = []

    async def double(x: int) -> int:
        return 2 * x

    async def slow_sink(x: int) -> None:
        # Bounded channels: the producer can only be a few items ahead.
        assert len(produced) - len(out) <= 2 + 2 + 2 + 1, (produced, out)
        out.append(x)
        await asyncio.sleep(0)

    async with kv.Pipeline(maxsize=2) as p:
        p.sink(slow_sink, p.map(double, p.source(numbers(50, produced))))
    assert out == [2 * i for i in range(50)]


async def test_pipeline_error_cancels_upstream_and_downstream() -> None:
    produced: list[int] = []
    cancelled: list[str] = []

    async def boom(x: int) -> int:
        if x == 5:
            raise RuntimeError("stage failed")
        return x

    async def sink(x: int) -> None:
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            cancelled.append("sink")
            raise

    with pytest.raises(RuntimeError, match="stage failed"):
        async with kv.Pipeline(maxsize=1) as p:
            p.sink(sink, p.map(boom, p.source(numbers(10_000, produced))))
    assert len(produced) < 20  # the source stopped: it did not run to the end


async def test_pipeline_consumer_leaving_stops_producers() -> None:
    produced: list[int] = []
    async with kv.Pipeline(maxsize=1) as p:
        out = p.map(_identity, p.source(numbers(10_000, produced)))
        got = [await out.receive() for _ in range(3)]
        await out.aclose()  # the consumer is done: everything upstream stops quietly
    assert got == [0, 1, 2] and len(produced) < 10


async def _identity(x: int) -> int:
    return x


async def test_channel_semantics() -> None:
    ch: kv.Channel[int] = kv.Channel(1)
    await ch.send(1)
    blocked = asyncio.ensure_future(ch.send(2))
    await asyncio.sleep(0)
    assert not blocked.done()  # full: the sender waits
    assert await ch.receive() == 1
    await within(blocked)
    ch.close()
    assert [x async for x in ch] == [2]
    with pytest.raises(ClosedResourceError):
        await ch.send(3)


async def test_stream_dst_deregistered_fails_and_releases_pins(make_agent: MakeAgent) -> None:
    """The layers' copies keep the checks of a read: a dst region deregistered
    before the first layer, or between layers, fails the stream with
    ClosedResourceError (nothing written after it went), and the pins go."""
    agent = await make_agent("kv")
    src = agent.alloc(8 * BB)
    src.numpy()[:] = pattern(8 * BB, 7)
    keys = keys_for(8)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB)]) as store:
        await store.put(keys, src[0:8 * BB])
        dst = agent.alloc(8 * BB)
        stream = store.stream(keys, dst[0:8 * BB], layers=LAYERS)
        agent.deregister(dst)
        with pytest.raises(ClosedResourceError):
            await within(stream.__anext__())
        assert store.statistics().pins == 0
        # between layers: the window's posts fail in the loop callback, the
        # next layer not yet posted raises to the caller
        dst = agent.alloc(8 * BB)
        got = []
        with pytest.raises(ClosedResourceError):
            async for item in store.stream(keys, dst[0:8 * BB], layers=LAYERS):
                got.append(item.layer)
                if item.layer == 0:
                    agent.deregister(dst)
        assert got and got[0] == 0 and len(got) <= 1 + 2  # at most the window landed
        assert store.statistics().pins == 0
        assert (await store.lookup(keys)).prefix == 8


async def test_stream_of_non_keys_raises(make_agent: MakeAgent) -> None:
    """Keys are checked where they are used: a stream of things that are not
    keys raises TypeError from its first iteration (also past hits), takes
    no pins and brings nothing up."""
    agent = await make_agent("kv")
    src = agent.alloc(4 * BB)
    keys = keys_for(4)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(8 * BB)]) as store:
        await store.put(keys, src[0:4 * BB])
        dst = agent.alloc(4 * BB)
        for bad in (["not bytes"], [bytearray(32)], [keys[0], 7], keys[:2] + [b"short"]):
            stream = store.stream(bad, dst[0:len(bad) * BB], layers=LAYERS)  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                await within(stream.__anext__())
            assert store.statistics().pins == 0
        assert [item.layer async for item in store.stream(keys, dst[0:4 * BB], layers=LAYERS)] \
            == list(range(LAYERS))
        assert store.statistics().tiers["host"].hits == 4


async def test_pipeline_source_failing_closed_is_an_error_not_an_end() -> None:
    """The source's own iteration raises ClosedResourceError (here: it feeds
    a side channel whose receiver is gone) while the pipeline's consumer is
    still there: the pipeline raises it. (Before: the source stage took any
    ClosedResourceError for its consumer leaving and ended quietly, so the
    sink saw a truncated stream and no error.)"""
    side: kv.Channel[int] = kv.Channel(8)

    async def source() -> AsyncIterator[int]:
        for i in range(10):
            if i == 3:
                side.aclose_nowait()  # the side channel's reader is gone
            await side.send(i)
            yield i

    out: list[int] = []

    async def sink(x: int) -> None:
        out.append(x)

    with pytest.raises(ClosedResourceError):
        async with kv.Pipeline(maxsize=1) as p:
            p.sink(sink, p.source(source()))
    assert out == [0, 1, 2]

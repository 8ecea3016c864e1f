"""aioxfer.kv: keys, the store over a host tier, coalescing, pins."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv

BB = 16 << 10  # block bytes in these tests


# ---------------------------------------------------------------- keys


def spec_chain(tokens: list[int], block_tokens: int, namespace: bytes) -> list[str]:
    """The key scheme as the docs state it, written out independently."""
    out, parent = [], bytes(32)
    prefix = b"aioxfer.kv.chain/v1\x00" + len(namespace).to_bytes(4, "little") + namespace
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens:(i + 1) * block_tokens]
        body = b"".join(t.to_bytes(4, "little") for t in block)
        parent = hashlib.sha256(prefix + parent + body).digest()
        out.append(parent.hex())
    return out


def test_chain_matches_the_documented_scheme() -> None:
    tokens = [7, 0, 65535, 2**32 - 1] * 9  # 36 tokens: 2 full blocks of 16, 4 left over
    keys = kv.chain(tokens, block_tokens=16, namespace=b"llama/bf16/tp0")
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert [k.hex() for k in keys] == spec_chain(tokens, 16, b"llama/bf16/tp0")


def test_chain_is_a_chain_and_namespaced() -> None:
    tokens = list(range(64))
    full = kv.chain(tokens, block_tokens=16, namespace="m")
    # Extending from the last key of a prefix gives the same keys as hashing all.
    head = kv.chain(tokens[:32], block_tokens=16, namespace="m")
    tail = kv.chain(tokens[32:], block_tokens=16, namespace="m", parent=head[-1])
    assert head + tail == full
    # numpy arrays of any integer dtype hash like lists
    assert kv.chain(np.arange(64, dtype=np.int64), block_tokens=16, namespace="m") == full
    # namespaces separate, and so does the block size
    assert kv.chain(tokens, block_tokens=16, namespace="n")[0] != full[0]
    assert kv.chain(tokens, block_tokens=16, namespace="")[0] != full[0]
    assert kv.chain(tokens, block_tokens=32, namespace="m")[0] != full[1]
    # a different token early changes every later key (chained)
    other = kv.chain([1] + tokens[1:], block_tokens=16, namespace="m")
    assert all(a != b for a, b in zip(other, full, strict=True))
    with pytest.raises(ValueError):
        kv.chain([-1] * 16)
    with pytest.raises(ValueError):
        kv.chain([2**32] * 16)


def test_keys_identical_across_processes_and_hash_seeds() -> None:
    code = ("from aioxfer import kv; "
            "print(kv.chain(list(range(100)), block_tokens=16, namespace=b'ns')[-1].hex()); "
            "print(kv.import_key(-12345, namespace=b'ns', source='lmcache').hex()); "
            "print(kv.import_key(b'\\x01' * 32, source='vllm').hex())")
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd="/",
                                   capture_output=True, text=True, timeout=60).stdout)
    here = (kv.chain(list(range(100)), block_tokens=16, namespace=b"ns")[-1].hex() + "\n"
            + kv.import_key(-12345, namespace=b"ns", source="lmcache").hex() + "\n"
            + kv.import_key(b"\x01" * 32, source="vllm").hex() + "\n")
    assert outs[0] == outs[1] == here


def test_import_key() -> None:
    a = kv.import_key(42, source="vllm")
    assert len(a) == 32
    assert a == kv.import_key(42, source="vllm")
    assert a != kv.import_key(42, source="sglang")  # schemes stay apart
    assert a != kv.import_key(42, source="vllm", namespace="other")
    assert kv.import_key(-1) != kv.import_key(255)  # signed encoding: no aliasing
    assert kv.import_key(b"\x2a") != kv.import_key(42)  # types stay apart
    assert kv.import_key("abc") != kv.import_key(b"abc")
    assert a not in kv.chain(list(range(16)))
    with pytest.raises(TypeError):
        kv.import_key(1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- helpers


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return kv.chain(np.arange(seed * 100_000, seed * 100_000 + 16 * n), block_tokens=16,
                    namespace=b"test")


def fill(region: Any, nblocks: int, seed: int) -> np.ndarray:
    data = pattern(nblocks * BB, seed)
    region.numpy()[: nblocks * BB] = data
    return data


def assert_no_pins(store: kv.Store) -> None:
    s = store.statistics()
    assert s.pinned_bytes == 0 and s.pins == 0, s
    assert s.fetches_in_flight == 0, s
    for t in s.tiers.values():
        assert t.pinned_blocks == 0, t


MakeAgent = Callable[..., Awaitable[Any]]


# ---------------------------------------------------------------- host tier


async def test_put_lookup_get_remove_host(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(32 * BB)
    dst = agent.register(bytearray(32 * BB))  # plain user memory works as dst too
    data = fill(src, 32, seed=1)
    keys = keys_for(32)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(64 * BB)]) as store:
        assert (await store.lookup(keys)).prefix == 0
        res = await store.get(keys, dst[0:32 * BB])
        assert res.prefix == 0 and res.failed == () and res.tiers == (None,) * 32
        put = await within(store.put(keys[:24], src[0:24 * BB]))
        assert (put.stored, put.present, put.dropped) == (24, 0, 0)
        assert put.tiers == ("host",) * 24
        again = await store.put(keys[:24], src[0:24 * BB])
        assert (again.stored, again.present) == (0, 24)
        hit = await store.lookup(keys)
        assert hit.prefix == 24 and hit.tiers == ("host",) * 24 + (None,) * 8
        # the blocks land in the caller's memory, in key order, whatever layout
        order = np.random.default_rng(3).permutation(24)
        segs = [dst[int(j) * BB:(int(j) + 1) * BB] for j in order]
        res = await within(store.get(keys, segs + [dst[24 * BB:25 * BB]] * 8))
        assert res.prefix == 24 and res.failed == ()
        view = np.frombuffer(dst.memoryview, dtype=np.uint8)
        for i, j in enumerate(order):
            assert np.array_equal(view[int(j) * BB:(int(j) + 1) * BB], data[i * BB:(i + 1) * BB])
        assert await store.remove(keys[10:12]) == 2
        hit = await store.lookup(keys)
        assert hit.prefix == 10 and hit.tiers[10:12] == (None, None)
        res = await store.get(keys[:12], dst[0:12 * BB])
        assert res.prefix == 10
        st = store.statistics().tiers["host"]
        assert st.blocks == 22 and st.puts == 24 and st.evictions == {"removed": 2}
        assert st.hits == 24 + 10
        assert_no_pins(store)
    assert store.closed


async def test_store_open_await_form_and_argument_checks(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv")
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(8 * BB)])
    src = agent.alloc(4 * BB)
    try:
        with pytest.raises(TypeError):
            await store.put([b"short"], src[0:BB])
        with pytest.raises(ValueError):
            await store.put(keys_for(2), src[0:BB])  # one block of memory for two keys
        with pytest.raises(ValueError):
            await store.put(keys_for(1), [src[0:BB - 1]])  # not block_bytes long
        other = await make_agent("other")
        with pytest.raises(ValueError):
            await store.put(keys_for(1), other.alloc(BB)[0:BB])  # another agent's memory
    finally:
        await store.aclose()
    with pytest.raises(kv.KVError.__mro__[1]):  # XferError: ClosedResourceError
        await store.get(keys_for(1), src[0:BB])
    with pytest.raises(ValueError):
        kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(BB), kv.HostTier(BB, name="b")])


async def test_host_lru_eviction_without_lower_tier(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv")
    src = agent.alloc(16 * BB)
    dst = agent.alloc(16 * BB)
    fill(src, 16, seed=2)
    keys = keys_for(16)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(8 * BB)]) as store:
        assert (await store.put(keys[:8], src[0:8 * BB])).stored == 8
        # touch the first two: they become the most recently used
        assert (await store.get(keys[:2], dst[0:2 * BB])).prefix == 2
        put = await store.put(keys[8:12], src[8 * BB:12 * BB])
        assert put.stored == 4
        tiers = (await store.lookup(keys)).tiers
        present = {i for i, t in enumerate(tiers) if t == "host"}
        assert present == {0, 1, 6, 7, 8, 9, 10, 11}, present  # 2..5 were the coldest
        assert store.statistics().tiers["host"].evictions == {"capacity": 4}
        assert_no_pins(store)


# ---------------------------------------------------------------- coalescing and cancellation


@pytest.fixture
async def disk_store(make_agent: MakeAgent, tmp_path: Any) -> Any:
    agent = await make_agent("kv")
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[
        kv.HostTier(64 * BB, promote=False), kv.DiskTier(tmp_path / "kv", 1 << 26,
                                                         segment_bytes=32 * BB)])
    yield agent, store
    await store.aclose()


async def put_on_disk(store: kv.Store, keys: list[bytes], src: Any) -> None:
    """Puts blocks straight to the disk tier (durable), then drops host copies."""
    res = await store.put(keys, src, durable=True)
    assert res.durable == len(keys), res
    host = store.tiers[0]
    assert isinstance(host, kv.HostTier)
    for k in keys:
        if k in host.index:
            host.evict(k, "test")
    assert (await store.lookup(keys)).tiers == ("disk",) * len(keys)


def test_find_matches_a_per_key_loop() -> None:
    """The vectorised probe of lookup against the loop it replaces, on random
    tier contents (1 to 4 tiers, runs of every length, duplicates)."""
    from aioxfer.kv.store import _find

    rng = np.random.default_rng(11)
    pool = keys_for(64, seed=9)
    for trial in range(800):
        nt = int(rng.integers(1, 5))
        n = int(rng.choice([0, 1, 2, 15, 16, 17, 40, 64]))
        if trial % 2:  # anything
            ks = [pool[int(i)] for i in rng.integers(0, len(pool), n)]
            held = [{k for k in pool if rng.random() < p} for p in rng.random(nt)]
        else:  # each tier a run after the faster ones' (the usual shape), some not quite
            ks = pool[:n]
            cuts = [0, *sorted(int(c) for c in rng.integers(0, n + 1, nt))]
            held = [set(ks[cuts[t]:cuts[t + 1]]) for t in range(nt)]
            for h in held:
                if n and rng.random() < 0.3:
                    h.add(ks[int(rng.integers(0, n))])
        names = (*(f"t{i}" for i in range(nt)), None)
        want = tuple(next((names[t] for t in range(nt) if k in held[t]), None) for k in ks)
        prefix = want.index(None) if None in want else n
        assert _find(ks, [h.__contains__ for h in held], names) == (prefix, want)


async def test_lookup_names_the_fastest_tier_per_key(disk_store: Any) -> None:
    """lookup probes each tier with whole-list passes: per key the fastest tier
    holding it, in runs and alone, misses anywhere, the prefix up to the first."""
    agent, store = disk_store
    n = 48
    src = agent.alloc(n * BB)
    keys = keys_for(n, seed=7)
    host = store.tiers[0]
    assert isinstance(host, kv.HostTier)
    await store.put(keys[:40], src[0:40 * BB], durable=True)  # everything on disk
    for i in range(40):  # host copies: a run, then every third, then none
        if not (i < 8 or (i >= 16 and i % 3 == 0)):
            host.evict(keys[i], "test")
    want: list[str | None] = [
        "host" if i < 8 or (16 <= i < 40 and i % 3 == 0) else "disk" if i < 40 else None
        for i in range(n)]
    hit = await store.lookup(keys)
    assert hit.tiers == tuple(want) and hit.prefix == 40
    # a miss in the middle ends the prefix there; the blocks after it are still named
    assert await store.remove(keys[20:21]) == 1
    want[20] = None
    hit = await store.lookup(keys)
    assert hit.tiers == tuple(want) and hit.prefix == 20
    # many runs (one name per key), all in host memory, nothing at all
    assert (await store.lookup(keys[16:40])).tiers == tuple(want[16:40])
    assert await store.lookup(keys[:8]) == kv.LookupResult(8, ("host",) * 8)
    assert await store.lookup(keys[40:]) == kv.LookupResult(0, (None,) * 8)
    assert await store.lookup([]) == kv.LookupResult(0, ())
    # things that are not keys raise, also past hits
    for bad in (["not bytes"], [bytearray(32)], [keys[0], 7], keys[:2] + [b"short"]):
        with pytest.raises(TypeError):
            await store.lookup(bad)  # type: ignore[arg-type]
    assert_no_pins(store)


async def test_concurrent_gets_of_a_disk_block_read_it_once(disk_store: Any) -> None:
    agent, store = disk_store
    src = agent.alloc(BB)
    data = fill(src, 1, seed=5)
    key = keys_for(1)
    await put_on_disk(store, key, src[0:BB])
    disk = store.statistics().tiers["disk"]
    dsts = [agent.alloc(BB) for _ in range(16)]
    results = await within(asyncio.gather(*[store.get(key, d[0:BB]) for d in dsts]))
    after = store.statistics().tiers["disk"]
    assert after.reads - disk.reads == 1  # one disk read for sixteen gets
    assert after.coalesced - disk.coalesced == 15
    assert sorted(r.coalesced for r in results) == [0] + [1] * 15
    for r, d in zip(results, dsts, strict=True):
        assert r.prefix == 1 and r.tiers == ("disk",)
        assert np.array_equal(d.numpy(), data)
    assert_no_pins(store)


async def test_cancelled_follower_leaves_others_running(disk_store: Any) -> None:
    agent, store = disk_store
    src = agent.alloc(8 * BB)
    data = fill(src, 8, seed=6)
    keys = keys_for(8)
    await put_on_disk(store, keys, src[0:8 * BB])
    d1, d2, d3 = (agent.alloc(8 * BB) for _ in range(3))
    leader = asyncio.ensure_future(store.get(keys, d1[0:8 * BB]))
    await asyncio.sleep(0)  # the leader has planned and posted its read
    follower = asyncio.ensure_future(store.get(keys, d2[0:8 * BB]))
    other = asyncio.ensure_future(store.get(keys, d3[0:8 * BB]))
    await asyncio.sleep(0)
    follower.cancel()
    r1, r3 = await within(asyncio.gather(leader, other))
    with pytest.raises(asyncio.CancelledError):
        await follower
    assert r1.prefix == 8 and r3.prefix == 8
    assert np.array_equal(d1.numpy(), data) and np.array_equal(d3.numpy(), data)
    assert store.statistics().tiers["disk"].reads >= 1
    assert_no_pins(store)


async def test_cancelled_leader_hands_the_fetch_over(disk_store: Any) -> None:
    agent, store = disk_store
    src = agent.alloc(8 * BB)
    data = fill(src, 8, seed=7)
    keys = keys_for(8)
    await put_on_disk(store, keys, src[0:8 * BB])
    d1, d2, d3 = (agent.alloc(8 * BB) for _ in range(3))
    leader = asyncio.ensure_future(store.get(keys, d1[0:8 * BB]))
    await asyncio.sleep(0)
    followers = [asyncio.ensure_future(store.get(keys, d[0:8 * BB])) for d in (d2, d3)]
    await asyncio.sleep(0)
    assert store.statistics().fetches_in_flight == 8
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    r2, r3 = await within(asyncio.gather(*followers))
    assert r2.prefix == 8 and r3.prefix == 8
    assert store.statistics().handoffs == 8  # re-issued once each, into staging
    assert np.array_equal(d2.numpy(), data) and np.array_equal(d3.numpy(), data)
    await asyncio.sleep(0.05)  # cancelled transfers' completions
    assert_no_pins(store)


async def test_last_waiter_to_cancel_cancels_the_fetch(disk_store: Any) -> None:
    agent, store = disk_store
    src = agent.alloc(8 * BB)
    fill(src, 8, seed=8)
    keys = keys_for(8)
    await put_on_disk(store, keys, src[0:8 * BB])
    tasks = [asyncio.ensure_future(store.get(keys, agent.alloc(8 * BB)[0:8 * BB]))
             for _ in range(3)]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with pytest.raises(asyncio.CancelledError):
            await t
    await within(_quiesce(store))
    assert_no_pins(store)
    # and the store still serves them
    dst = agent.alloc(8 * BB)
    assert (await within(store.get(keys, dst[0:8 * BB]))).prefix == 8
    assert np.array_equal(dst.numpy(), src.numpy())


async def _quiesce(store: kv.Store) -> None:
    """Waits (bounded by the caller) until no fetch or pin is left."""
    while True:
        s = store.statistics()
        if not (s.fetches_in_flight or s.pins or s.pinned_bytes):
            return
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- pins


async def test_pinned_bytes_cap_fails_fast_and_waits(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv", inline_bytes=64 << 10)
    src = agent.alloc(8 * BB)
    fill(src, 8, seed=9)
    keys = keys_for(8)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB)],
                             max_pinned_bytes=8 * BB, pin_wait=5.0) as store:
        assert (await store.put(keys, src[0:8 * BB])).stored == 8
        with pytest.raises(kv.PinLimitExceeded):  # more than the cap alone: at once
            await store.get(keys * 2, agent.alloc(16 * BB)[0:16 * BB])
        assert_no_pins(store)
        # Gets that fit alone but not together (128 KiB each: not copied
        # inline, so they overlap): the later ones wait for pins, then run.
        dsts = [agent.alloc(8 * BB) for _ in range(4)]
        results = await within(asyncio.gather(*[store.get(keys, d[0:8 * BB]) for d in dsts]))
        assert all(r.prefix == 8 for r in results)
        assert all(np.array_equal(d.numpy(), src.numpy()) for d in dsts)
        assert store.statistics().pin_waits >= 1
        assert_no_pins(store)


async def test_pin_wait_deadline(make_agent: MakeAgent) -> None:
    agent = await make_agent("kv", inline_bytes=64 << 10)
    src = agent.alloc(8 * BB)
    keys = keys_for(8)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB)],
                             max_pinned_bytes=8 * BB, pin_wait=0.0) as store:
        await store.put(keys, src[0:8 * BB])
        first = asyncio.ensure_future(store.get(keys, agent.alloc(8 * BB)[0:8 * BB]))
        await asyncio.sleep(0)
        with pytest.raises(kv.PinLimitExceeded):  # pin_wait 0: fail fast, no wait
            await store.get(keys, agent.alloc(8 * BB)[0:8 * BB])
        assert (await within(first)).prefix == 8
        assert_no_pins(store)

"""Faults of one object at a time, against a real S3 server (``rclone serve
s3``) behind s3server.FaultProxy: a GET the server fails for one key, PUTs
whose answer is lost or that are still running at the server when their
client's connection is cut.

- A batched object-tier read that met one failing GET marked every block of
  the batch unavailable (the get delivered nothing, not even the blocks read
  before the failing one).
- obstore sent a PUT again when its answer was lost (a second PUT of a key
  the server had stored) or while the first attempt was still running at the
  server (two PUTs of one key at once: what makes rclone 1.75 answer 500 to
  GETs of the key, or lose it after both PUTs returned 200;
  repro_rclone_samekey.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import s3server
from conftest import pattern, within
from s3server import FaultProxy, S3Server

from aioxfer import kv
from aioxfer.backends import registry

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

s3 = s3server.s3  # the fixture, by name
own_s3 = s3server.own_s3

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def keys_for(n: int, seed: int) -> list[bytes]:
    return kv.chain(np.arange(seed * 100_000, seed * 100_000 + 16 * n), block_tokens=16,
                    namespace=b"objkv12")


@pytest.fixture
async def proxy(s3: S3Server) -> AsyncIterator[FaultProxy]:
    px = FaultProxy(s3)
    await px.start()
    try:
        yield px
    finally:
        await px.aclose()


async def object_store(make_agent: MakeAgent, endpoint: dict[str, str], bucket: str,
                       **kwargs: Any) -> tuple[Any, kv.Store, kv.ObjectTier]:
    agent = await make_agent("kv")
    objs = agent.register_objects(f"s3://{bucket}/kvtest", **endpoint, **kwargs)
    tier = kv.ObjectTier(objs)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier])
    return agent, store, tier


def replaced(s3: S3Server, bucket: str) -> list[str]:
    """rclone's log lines of keys of ``bucket`` it replaced: a PUT of a key
    that existed deletes it first ("...: Deleted"); this module's tests PUT
    every key once and delete nothing."""
    return [ln for ln in s3.log.read_text(errors="replace").splitlines()
            if bucket in ln and ln.endswith(": Deleted")]


def object_path(tier: kv.ObjectTier, key: bytes) -> str:
    """The key's path under the bucket, as the proxy sees it."""
    return "kvtest/" + tier.object_key(key)


# ------------------------------------------------------------------ reads


@pytest.mark.parametrize("n, bad", [(8, 5), (40, 2)])
async def test_a_failing_get_fails_only_its_block(make_agent: MakeAgent, s3: S3Server,
                                                   proxy: FaultProxy, n: int, bad: int) -> None:
    """The server answers 500 to every GET of block ``bad``: that block is
    BlockUnavailable (kept: read again once the server serves it), every
    other one is delivered, and the prefix ends at ``bad``. With 40 blocks
    (past the backend's 16 GETs at once) the blocks not yet read when the
    batch stopped are read in a second round. (Before: all n unavailable,
    prefix 0.)"""
    bucket = s3.bucket()
    agent, store, tier = await object_store(make_agent, proxy.kwargs(), bucket, max_retries=1)
    src = agent.alloc(n * BB)
    data = pattern(n * BB, 7)
    src.numpy()[:] = data
    keys = keys_for(n, seed=7 + n)
    try:
        assert (await within(store.put(keys, src[0:n * BB]))).stored == n
        proxy.fail_get.add(object_path(tier, keys[bad]))
        dst = agent.alloc(n * BB)
        res = await within(store.get(keys, dst[0:n * BB]))
        assert proxy.failed_gets >= 1
        assert res.prefix == bad, res
        assert [f.index for f in res.failed] == [bad], res.failed
        assert isinstance(res.failed[0].error, kv.BlockUnavailable)
        assert res.tiers[:bad] == ("object",) * bad
        got, want = dst.numpy(), data
        assert np.array_equal(got[:bad * BB], want[:bad * BB])
        # the blocks past it were delivered too (a coalesced get may need them)
        assert np.array_equal(got[(bad + 1) * BB:], want[(bad + 1) * BB:])
        # Unavailable is not lost: still in the tier, served once the server is.
        assert (await store.lookup(keys)).prefix == n
        proxy.fail_get.clear()
        dst.numpy()[:] = 0
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == n and np.array_equal(dst.numpy(), data)
    finally:
        await store.aclose()


async def test_a_bucket_down_ends_the_read_after_one_round(make_agent: MakeAgent,
                                                           own_s3: S3Server) -> None:
    """The server is gone: the read fails every block as unavailable after
    one batched request, not one more per block or per round (each would
    wait out the backend's retries again)."""
    bucket = own_s3.bucket()
    agent, store, _tier = await object_store(make_agent, own_s3.kwargs(), bucket,
                                             max_retries=1)
    n = 40
    src = agent.alloc(n * BB)
    src.numpy()[:] = pattern(n * BB, 8)
    keys = keys_for(n, seed=8)
    try:
        assert (await within(store.put(keys, src[0:n * BB]))).stored == n
        own_s3.kill()
        backend = registry.instance(agent, "object")
        before = backend.statistics().transfers_posted
        dst = agent.alloc(n * BB)
        res = await within(store.get(keys, dst[0:n * BB]))
        assert res.prefix == 0 and len(res.failed) == n
        assert all(isinstance(f.error, kv.BlockUnavailable) for f in res.failed)
        assert backend.statistics().transfers_posted - before == 1
    finally:
        await store.aclose()

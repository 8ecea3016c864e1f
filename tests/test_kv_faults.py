"""Faults in the tiered KV store, each with the real component: the S3 server
is ``rclone serve s3`` (killed with SIGKILL), a full filesystem is a small
tmpfs, cancellations land at chosen awaits. Each test failed before its fix."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import s3server
from conftest import pattern, within
from s3server import S3Server

from aioxfer import kv

s3 = s3server.s3  # the fixture, by name

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
    bucket = s3.bucket()
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

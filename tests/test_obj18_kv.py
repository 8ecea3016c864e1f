"""kv.ObjectTier.missing (keys probed and found absent) stays bounded under
ever new misses: expired entries are swept once the dict has doubled since
the last sweep. Real ``rclone serve s3`` on loopback (tests/s3server.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import s3server
from conftest import within
from s3server import S3Server, tier_dir

from aioxfer import kv
from aioxfer.kv import objects as kvobjects

pytest.importorskip("obstore")

s3 = s3server.s3  # the fixture, by name

BB = 16 << 10
SWEEP_MIN = 64  # the sweep's floor, lowered so that a few hundred misses show it


async def test_missing_stays_bounded(make_agent: Callable[..., Awaitable[Any]], s3: S3Server,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # raising=False: main's code has no such knob and no sweep (the test
    # then sees the dict grow with every miss)
    monkeypatch.setattr(kvobjects, "_SWEEP_MIN", SWEEP_MIN, raising=False)
    bucket = s3.bucket(tier_dir("kvtest"))
    agent = await make_agent("kv")
    objs = agent.register_objects(f"s3://{bucket}/kvtest", **s3.kwargs())
    tier = kv.ObjectTier(objs, absent_ttl=0.05)
    store = await kv.Store.open(agent, block_bytes=BB, tiers=[tier])
    try:
        # A key held back for good (inf: as a remove or quarantine whose
        # DELETE failed leaves it, kv/objects.py _remove): never swept.
        gone = kv.chain(np.arange(16) + 10**7, block_tokens=16, namespace=b"obj18")
        tier.missing[gone[0]] = math.inf
        most = 0
        for i in range(6 * SWEEP_MIN):  # distinct prompts, one never-seen block each
            keys = kv.chain(np.arange(16) + i * 16, block_tokens=16, namespace=b"obj18")
            hit = await within(store.lookup(keys))
            assert hit.prefix == 0
            assert keys[0] in tier.missing  # the miss is remembered (absent_ttl)
            most = max(most, len(tier.missing))
            if i % 16 == 0:
                await asyncio.sleep(0.06)  # entries' absent_ttl runs out meanwhile
        # live entries (absent_ttl not over) are few here: twice the floor
        # plus one probe's batch is the most the dict may hold
        assert most <= 2 * SWEEP_MIN + tier.batch, most
        assert tier.missing[gone[0]] == math.inf
    finally:
        await store.aclose()

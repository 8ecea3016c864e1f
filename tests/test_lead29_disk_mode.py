"""The KV disk tier's directory is trusted (SECURITY.md): a directory the tier
creates is private to its user (0700) and so are its segment and tombstone
files (0600), whatever the umask lets through (022 made them 0755 / 0644:
readable by every user of the host)."""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from aioxfer import kv

BB = 16 << 10


async def test_created_directory_and_files_are_private(
        make_agent: Callable[..., Awaitable[Any]], tmp_path: Path) -> None:
    agent = await make_agent("kv-mode")
    src = agent.alloc(8 * BB)
    src.numpy()[:] = 7
    keys = kv.chain(np.arange(16 * 8), block_tokens=16, namespace=b"mode-test")
    path = tmp_path / "kvdir"
    old = os.umask(0o022)
    try:
        tier = kv.DiskTier(path, 1 << 26, segment_bytes=16 * BB)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[tier]) as store:
            put = await store.put(keys, src[0:8 * BB], durable=True)
            assert put.durable == 8
            await store.remove(keys[:1])
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    files = [p for p in path.iterdir() if p.is_file()]
    assert files, "the tier wrote no file"
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o600"}, modes

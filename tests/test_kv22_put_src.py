"""A cancelled put never reads ``src`` once it has raised (the contract:
once put returns or raises, the caller may reuse src).

Each trial cancels a large put after a few loop steps (or a few ms), then
at once overwrites src with a marker byte the blocks never hold, lets the
engine settle, and looks for the marker where the put's copies land: the
host tier's slots (real shared memory, or loopback TCP) and the disk tier's
segment files (a real directory, read back with plain file reads). One
marker byte there is a read of src after the put raised.

Before (kv22): the host tier's copies were never cancelled and the put
raised at once (_await_owned): ~70-130 MiB of 128 MiB carried the marker,
every cancel after the first step, shm and tcp; the disk tier's writes were
cut short by gather's cancel while the file transport's chunks already
issued still read src (a few MiB in most trials)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import engine_settled, within

from aioxfer import kv

MARK = 0x5A
MakeAgent = Callable[..., Awaitable[Any]]
# (steps of the loop before the cancel, or seconds as a float)
CANCEL_AT: tuple[int | float, ...] = (1, 2, 3, 5, 0.001, 0.003)


async def cancel_put(store: Any, keys: list[bytes], src: Any, at: int | float) -> bool:
    """Starts the put, cancels it at ``at``; True if the cancel took."""
    put = asyncio.ensure_future(store.put(keys, src))
    if isinstance(at, float):
        await asyncio.sleep(at)
    else:
        for _ in range(at):
            await asyncio.sleep(0)
    put.cancel()
    try:
        await within(put)
    except asyncio.CancelledError:
        return True
    return False


def marked_in_files(root: Path) -> int:
    return sum(int((np.fromfile(p, dtype=np.uint8) == MARK).sum())
               for p in root.glob("seg-*.axkv"))


@pytest.mark.parametrize("kind", ["host-shm", "host-tcp", "disk", "host-overflow-disk"])
async def test_cancelled_put_reads_no_src_after_it_raised(make_agent: MakeAgent,
                                                         tmp_path: Path, kind: str) -> None:
    tcp = kind == "host-tcp"
    agent = await make_agent(f"kv22-src-{kind}",
                             **({"transports": ("tcp",), "inline_bytes": 0} if tcp else {}))
    bb = 4 << 20
    n = 32 if kind.startswith("host") else 24
    src = agent.alloc(n * bb)
    cancelled = 0
    for trial, at in enumerate(CANCEL_AT):
        src.numpy()[:] = 1
        keys = kv.chain(np.arange(16 * n) + 10**6 * trial, block_tokens=16, namespace=b"kv22s")
        root = tmp_path / f"t{trial}"
        tiers: list[kv.Tier] = []
        if kind.startswith("host"):
            # Overflow: one slot and no wait for room, so the rest of the put
            # goes to the disk tier straight from src.
            tiers.append(kv.HostTier(bb if kind == "host-overflow-disk" else n * bb,
                                     put_wait=0))
        if kind.endswith("disk"):
            tiers.append(kv.DiskTier(root, 4 * n * bb, segment_bytes=n * bb))
        store = await within(kv.Store.open(agent, block_bytes=bb, tiers=tiers))
        host = store._host
        took = await cancel_put(store, keys, src[0:n * bb], at)
        cancelled += took
        src.numpy()[:] = MARK  # the caller reuses src: the put is over
        await engine_settled(agent)
        in_host = int((host.region.numpy() == MARK).sum()) if host is not None else 0
        await within(store.aclose())
        in_files = marked_in_files(root) if kind.endswith("disk") else 0
        assert (in_host, in_files) == (0, 0), (
            f"{kind}, cancel at {at}: src read after the put raised: {in_host} marker bytes "
            f"in host slots, {in_files} in segment files")
    assert cancelled >= len(CANCEL_AT) // 2, f"only {cancelled} puts cut short: too fast to test"

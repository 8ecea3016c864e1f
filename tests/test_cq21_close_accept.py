"""close18 (b): a peer that connects while the agent is closing (aclose's
release waiting on a stopped same-host peer) is not served: the engine
refuses it (axf_accept_conn after axf_engine_bye_network), so its connect
fails at once instead of "succeeding" to an agent whose regions are being
released (its writes then refused as revoked accesses, and a goodbye only at
the shutdown). Real processes: the stopped peer is a child agent (shm), the
late one an in-process agent over tcp."""

from __future__ import annotations

import asyncio

import pytest
from conftest import SAME_HOST, sigstop, within

import aioxfer

MiB = 1 << 20


async def test_peer_connecting_during_close_is_refused(make_agent, remote_agent) -> None:
    target = aioxfer.Agent("target", peer_timeout=0.5, keepalive=0.1,
                           limits=aioxfer.Limits(close_timeout=4.0))
    await target.start()
    closing: asyncio.Task[None] | None = None
    try:
        target.alloc(MiB, name="dst")
        ra = await remote_agent(size=MiB, name="sleeper", peer_timeout=0.5, keepalive=0.1)
        try:
            assert await ra.call("connect", target.address) == SAME_HOST
            await ra.call("flood", target.address, "pool", "dst", MiB)
            sigstop(ra.pid)
            late = await make_agent("late", transports=("tcp",), peer_timeout=5.0)
            buf = late.register(bytearray(4096), name="src")
            closing = asyncio.create_task(target.aclose())
            await asyncio.sleep(0.5)  # bye_network said; the release waits for the sleeper
            assert not closing.done()
            try:
                peer = await within(late.connect(target.address), 10)
            except (aioxfer.XferError, OSError) as exc:
                refused = exc
            else:
                # Served by a closing agent: what failed before (the write is
                # refused as an access to a revoked region, or worse lands).
                try:
                    await within(late.write(buf[0:4096], peer.region("dst")[0:4096]), 10)
                    outcome = "the write landed"
                except aioxfer.XferError as exc:
                    outcome = f"the write failed: {type(exc).__name__}: {exc}"
                pytest.fail(f"connected to an agent whose close had begun; {outcome}")
            assert not closing.done()  # refused during the close, not after it
            print("refused:", type(refused).__name__, refused)
        finally:
            ra.kill()
        await within(closing, 15)
    finally:
        if closing is None:
            await target.aclose()

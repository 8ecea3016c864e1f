"""A refresh that finds a region another refresh imported but has not checked
yet checks it too before it returns.

rev29's fix (tests/test_rev29_refresh): a same-host peer's region learnt from
a snapshot taken before its owner deregistered it, but imported after (the
revocation reached an importer that did not know it yet and was acknowledged
at once: the owner has the memory back), is forgotten by a second snapshot
taken after the import. Only the refresh that imported it took that second
snapshot: a concurrent refresh whose own (equally early) snapshot named the
same region found it imported already, imported nothing itself, and returned
at once, with the unchecked region in ``peer.regions``: a write by its caller
landed in memory the owner had released.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from conftest import within

import aioxfer
from aioxfer.serving import Server


async def test_a_concurrent_refresh_does_not_return_an_unchecked_region(
    make_agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = await make_agent("b")
    a = await make_agent("a")
    peer = await within(a.connect(b.address))
    if peer.path != "shm":
        pytest.skip(f"same-host path not available here ({peer.path})")
    buf = bytearray(4096)
    late = b.register(buf, name="late")
    # Both refreshes' first snapshots are taken now (they name "late") and
    # delivered after the deregistration below (as a snapshot whose send
    # waited is): tests/test_rev29_refresh's stale snapshot, twice.
    snap = b._localmeta.local()
    await within(b.deregister(late))
    server = b._server
    real_meta = server._local_meta
    real_send = Server._send_meta
    calls: list[int] = []
    checking = asyncio.Event()
    release = asyncio.Event()

    async def send_meta(self: Server, loop: Any, sock: Any, local: bool, *,
                        go: bool = True) -> None:
        if self is not server or go:
            return await real_send(self, loop, sock, local, go=go)
        calls.append(1)
        n = len(calls)
        if n == 2:
            # The first refresh's check (its second snapshot): held until
            # the second refresh has returned.
            checking.set()
            await release.wait()
        self._local_meta = (lambda: snap) if n in (1, 3) else real_meta
        try:
            return await real_send(self, loop, sock, local, go=go)
        finally:
            self._local_meta = real_meta

    monkeypatch.setattr(Server, "_send_meta", send_meta)
    events = a.membership()
    first = asyncio.ensure_future(peer.refresh())
    try:
        await within(checking.wait())
        # The first refresh has imported "late" and is checking it: a second
        # refresh, with its own early snapshot naming it.
        await within(peer.refresh())
        rr = peer.regions.get("late")
        landed = False
        if rr is not None:
            src = a.register(bytearray(b"\xa5" * 4096))
            try:
                await within(a.write(src[0:64], rr[0:64]))
                landed = True
            except aioxfer.XferError:
                pass
        assert bytes(buf[:64]) == bytes(64) and not landed, (
            "a write reached a region its owner had deregistered (and got back), "
            "through a refresh that returned before it was checked")
        assert rr is None, "a refresh returned with a region not yet checked"
    finally:
        release.set()
        await within(first)
    assert "late" not in peer.regions
    assert len(calls) >= 3
    # What the refreshes reported (embedded membership): "late" was never
    # kept, so neither added nor removed.
    seen: list[Any] = []
    with contextlib.suppress(TimeoutError):
        while True:
            seen.append(await asyncio.wait_for(events.__anext__(), 0.3))
    await events.aclose()
    assert not [ev for ev in seen if isinstance(ev, aioxfer.PeerUpdated)
                and "late" in (*ev.added, *ev.removed)], seen

"""A refresh never imports a region its owner deregistered before the import.

A same-host (shm) importer copies into the owner's memory itself (cross-memory
attach): the owner's only hold on that is its revocation, sent on every
connection it accepted and acknowledged by the importer's engine. A region
first learnt by ``peer.refresh()`` comes in a metadata snapshot fetched on a
side connection: deregistered after that snapshot was taken but before the
importer took it in (the snapshot's send waited, big metadata; or the
importer's loop read the reply late), its revocation reaches an importer that
does not know it yet, is acknowledged at once, and the owner gets the memory
back; the import that follows then let a write land in memory its owner had
released (a Python object freed, reused, or unmapped).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import within

import aioxfer


async def test_a_refresh_drops_a_region_deregistered_before_its_import(make_agent: Any) -> None:
    b = await make_agent("b")
    a = await make_agent("a")
    peer = await within(a.connect(b.address))
    if peer.path != "shm":
        pytest.skip(f"same-host path not available here ({peer.path})")
    buf = bytearray(4096)
    late = b.register(buf, name="late")
    # The snapshot a refresh is served, taken now ...
    snap = b._localmeta.local()
    # ... and the region deregistered before the importer takes it in: b's
    # revocation reaches a's engine, which does not know the region yet and
    # acknowledges it at once; b has it back.
    await within(b.deregister(late))
    server = b._server
    real = server._local_meta
    served: list[int] = []

    def stale_once() -> tuple[Any, list[int]]:
        # Delivered late, as a snapshot whose send had to wait is.
        if not served:
            served.append(1)
            return snap
        return real()

    server._local_meta = stale_once
    try:
        await within(peer.refresh())
    finally:
        server._local_meta = real
    assert served, "the refresh did not fetch the snapshot"
    # Nothing may reach b's released buffer through what the refresh made.
    src = a.register(bytearray(b"\xa5" * 4096))
    rr = peer.regions.get("late")
    landed = False
    if rr is not None:
        try:
            await within(a.write(src[0:64], rr[0:64]))
            landed = True
        except aioxfer.XferError:
            pass
    assert bytes(buf[:64]) == bytes(64) and not landed, (
        "a write reached a region its owner had deregistered (and got back)")
    assert "late" not in peer.regions, "a region deregistered before its import was imported"


async def test_a_region_registered_after_the_connect_is_still_imported(make_agent: Any) -> None:
    """The fix's other side: a refresh still imports what is really there,
    and a write to it lands."""
    b = await make_agent("b")
    a = await make_agent("a")
    peer = await within(a.connect(b.address))
    buf = bytearray(4096)
    b.register(buf, name="late")
    await within(peer.refresh())
    src = a.register(bytearray(b"\x5a" * 4096))
    await within(a.write(src[0:64], peer.region("late")[0:64]))
    assert bytes(buf[:64]) == b"\x5a" * 64
    assert isinstance(peer.region("late"), aioxfer.RemoteRegion)


async def test_a_refresh_cancelled_before_it_settled_keeps_no_new_region(
    make_agent: Any,
) -> None:
    """Cancelled while it checks what it imported (a caller's timeout), a
    refresh keeps none of it: unchecked, it may be a region its owner has
    back (the next refresh imports what is really there)."""
    b = await make_agent("b")
    a = await make_agent("a")
    peer = await within(a.connect(b.address))
    if peer.path != "shm":
        pytest.skip(f"same-host path not available here ({peer.path})")
    buf = bytearray(4096)
    late = b.register(buf, name="late")
    snap = b._localmeta.local()
    await within(b.deregister(late))
    server = b._server
    real = server._local_meta
    calls: list[int] = []
    task: asyncio.Task[None] | None = None

    def stale_then_cancel() -> tuple[Any, list[int]]:
        calls.append(1)
        if len(calls) == 1:
            return snap  # (as above: a snapshot delivered late)
        assert task is not None
        task.cancel()  # the caller gives up while the check is on its way
        return real()

    server._local_meta = stale_then_cancel
    try:
        task = asyncio.ensure_future(peer.refresh())
        with pytest.raises(asyncio.CancelledError):
            await within(task)
    finally:
        server._local_meta = real
    assert calls, "the refresh did not fetch the snapshot"
    assert "late" not in peer.regions, "an unchecked import was kept"
    src = a.register(bytearray(b"\xa5" * 4096))
    await within(peer.refresh())
    assert "late" not in peer.regions
    del src
    assert bytes(buf[:64]) == bytes(64)

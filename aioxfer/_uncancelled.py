"""Awaiting work that must not be cut short by a cancel (shared asyncio helpers).

For code of any layer (the kv store, the object backend): a cancelled caller
waits for the work to end, and only then sees its CancelledError. Used where
stopping midway would leave something half done: a transfer into memory its
owner frees once we return, a staging buffer the next writer refills, an
HTTP session's close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

__all__ = ["finish_uncancelled", "run_to_end"]


async def finish_uncancelled(aw: Awaitable[Any]) -> bool:
    """Runs ``aw`` to its end even if the caller is cancelled meanwhile (store
    memory that a transfer still reads or writes is never handed on midway);
    raises what ``aw`` raised, else returns whether a cancel arrived (the
    caller raises it once it has finished what must not be cut short)."""
    fut = asyncio.ensure_future(aw)
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
    fut.result()
    return cancelled


async def run_to_end(aw: Awaitable[Any]) -> Any:
    """Awaits ``aw`` without ever cutting it short: a cancelled caller waits
    for it to end and then raises CancelledError (what ``aw`` raised comes
    first). For work that must not stop midway: a transfer through a staging
    buffer the next writer refills, a delivery whose copies read memory its
    owner frees once we return, a session's close."""
    fut = asyncio.ensure_future(aw)
    if await finish_uncancelled(fut):
        raise asyncio.CancelledError
    return fut.result()

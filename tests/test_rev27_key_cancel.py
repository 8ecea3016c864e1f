"""A start() cancelled while the agent's key is derived on a thread (sec26:
an agent made inside a running loop) must not poison the token for the
process. asyncio.wrap_future passes the awaiting future's cancel on to the
shared concurrent future of the derivation: it was left PENDING, so it was
cancelled, the derivation thread's set_result raised InvalidStateError, and
every later Agent() or hmac_key() of that token in the process raised
CancelledError (the default per-user token: every agent made afterwards)."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from typing import Any

import pytest
from conftest import within

import aioxfer
from aioxfer import auth


@pytest.fixture
def thread_errors() -> Any:
    """Exceptions raised in threads meanwhile (the derivation thread's)."""
    seen: list[BaseException | None] = []
    old = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    yield seen
    threading.excepthook = old


async def test_a_cancelled_start_leaves_the_key_usable(thread_errors: list[Any]) -> None:
    token = secrets.token_hex(16)
    a = aioxfer.Agent("rev27-a", token=token, listen="127.0.0.1:0")
    assert a._key_pending is not None  # (made in a running loop: derived on a thread)
    t = asyncio.ensure_future(a.start())
    await asyncio.sleep(0)  # start() awaits the derivation now
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(t)
    try:
        # The derivation goes on and its key is everyone's: another agent of
        # the token starts, the cancelled one starts on retry, and a
        # blocking hmac_key agrees with both.
        b = aioxfer.Agent("rev27-b", token=token, listen="127.0.0.1:0")
        try:
            await within(b.start())
            await within(a.start())
            assert a._token == b._token == auth.hmac_key(token.encode())
            peer = await within(a.connect(b.address))  # and they authenticate each other
            assert peer.name == "rev27-b"
        finally:
            await b.aclose()
    finally:
        await a.aclose()
    assert thread_errors == []


def test_the_shared_derivation_cannot_be_cancelled() -> None:
    token = secrets.token_bytes(24)
    fut = auth.key_soon(token)
    assert not fut.cancel()
    assert fut.result(timeout=30) == auth.hmac_key(token)


def abstract_listeners() -> set[str]:
    """This process's listening abstract unix sockets (their names)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    names = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            # Num RefCount Protocol Flags Type St Inode Path; St 01: listening
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("@"):
                names.add(parts[7])
    return names


async def test_closed_before_its_key_came_listens_on_nothing() -> None:
    """An agent made in a running loop, closed before start(): a later
    start() (or connect()) raises ClosedResourceError and opens nothing.
    Before: it took the key in first (_start -> _take_key) and listened on
    the abstract sockets named after its addresses, which nothing closed
    (aclose had run; __del__ skips a closed agent)."""
    before = abstract_listeners()
    a = aioxfer.Agent("rev27-closed", token=secrets.token_hex(16), listen="127.0.0.1:0")
    assert a._key_pending is not None
    await within(a.aclose())
    with pytest.raises(aioxfer.ClosedResourceError):
        await within(a.start())
    with pytest.raises(aioxfer.ClosedResourceError):
        await within(a.connect("127.0.0.1:1"))
    assert abstract_listeners() - before == set()

"""rev17's "3 extra fds (two eventpoll, one eventfd) constant whatever the run
length" after a chaos run: an agent with etcd discovery, once closed, left
its etcd client alive until the next cyclic garbage collection. The watch
task's frame held the task (``task = asyncio.current_task()`` in its
``except CancelledError``) and the task held that frame through its
CancelledError's traceback: a cycle, holding the frame's gRPC call, so its
channel (a TCP connection to etcd still open), and with it gRPC's aio
poller (a thread, a socket pair) and its core's pollers (the eventpoll and
eventfd descriptors). Constant whatever the run length: each collection
freed the runs before. Agent.start's join had the same cycle (``me``).

Real etcd, real agent; the collector off while it runs, so that only what
reference counting frees is freed, as between two collections."""
from __future__ import annotations

import asyncio
import collections
import gc
import os
import time
import uuid

from conftest import within
from test_discovery import TTL, etcd_server  # noqa: F401  (the fixture)

import aioxfer
from aioxfer.discovery import Etcd


def fd_kinds() -> collections.Counter[str]:
    """This process's descriptors by kind (socket, pipe, anon_inode:[eventpoll], ...)."""
    out: collections.Counter[str] = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (the listing's own descriptor)
        out[link if link.startswith("anon_inode") else link.split(":")[0]] += 1
    return out


async def _settled(before: collections.Counter[str], seconds: float) -> collections.Counter[str]:
    """What is still open beyond ``before``, once it stops changing or the
    time is up (gRPC ends its pollers on threads of its own)."""
    deadline = time.monotonic() + seconds
    while True:
        extra = fd_kinds() - before
        if not extra or time.monotonic() > deadline:
            return extra
        await asyncio.sleep(0.05)


async def test_closed_discovery_agent_leaves_no_fds(etcd_server: str) -> None:  # noqa: F811
    """Before: 2 eventpoll, 2 eventfd and 3 sockets (one a connection to
    etcd) stayed open after the agent closed, until gc.collect()."""
    gc.collect()
    gc.disable()
    try:
        before = fd_kinds()
        for i in range(2):
            disc = Etcd(etcd_server, prefix=f"/aioxfer-test/{uuid.uuid4().hex[:12]}", ttl=TTL)
            agent = aioxfer.Agent(f"spread18-fds-{i}", discovery=disc)
            await within(agent.__aenter__())
            await asyncio.sleep(0.2)  # the watch and keepalive running
            await within(agent.aclose())
            del agent, disc
        extra = await _settled(before, 5.0)
    finally:
        gc.enable()
    assert not extra, f"left open by a closed agent until the next collection: {dict(extra)}"


async def test_cancelled_start_is_freed_without_a_collection() -> None:
    """Agent.start() cancelled by its caller while the agent joins etcd (one
    that never answers: a listening socket that accepts nothing): the
    caller's task, once dropped, is freed at once. Before, start's frame
    kept the task in a local (``me``) and the task kept the frame through
    its CancelledError's traceback: freed only by a collection."""
    import socket
    import weakref

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        port = mute.getsockname()[1]
        agent = aioxfer.Agent("spread18-start", discovery=Etcd(f"127.0.0.1:{port}", timeout=5.0))
        gc.collect()
        gc.disable()
        try:
            task = asyncio.create_task(agent.start())
            await asyncio.sleep(0.3)  # joining: connecting to the mute "etcd"
            assert not task.done()
            task.cancel()
            await asyncio.wait([task])  # (not gather: its own records of the task form cycles)
            assert task.cancelled()
            ref = weakref.ref(task)
            del task
            assert ref() is None, "start's task kept alive by a cycle"
        finally:
            gc.enable()
            await within(agent.aclose())

"""metrics.py's connection handler kept its own task in a local
(``task = asyncio.current_task()``): when MetricsServer.aclose cancelled a
scrape in progress, the handler's frame re-raised the CancelledError whose
traceback holds that frame, and the task holds the error: a cycle (task ->
error -> traceback -> frame -> task) keeping the task, its reader, writer
and socket until the next garbage collection (the pattern spread18 fixed in
discovery and agent). Real server, real socket; the collector off while it
runs, so that only what reference counting frees is freed."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

from conftest import within


async def test_cancelled_scrape_is_freed_without_a_collection(make_agent) -> None:
    """Before: the cancelled handler's task stayed alive (weakref not None)
    until gc.collect()."""
    agent = await make_agent("close18-metrics")
    server = await agent.serve_metrics(0)
    gc.collect()
    gc.disable()
    try:
        reader, writer = await within(asyncio.open_connection(server.host, server.port))
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # no end of head: the handler waits
        await writer.drain()
        for _ in range(100):
            if server._conns:
                break
            await asyncio.sleep(0.01)
        (task,) = server._conns
        ref = weakref.ref(task)
        del task
        await within(server.aclose())  # cancels the scrape in progress
        for _ in range(100):  # the handler's finally runs, the transport closes
            if ref() is None:
                break
            await asyncio.sleep(0.01)
        assert ref() is None, "the cancelled handler's task kept alive by a cycle"
        writer.close()
        with contextlib.suppress(ConnectionError):  # (the server closed it)
            await writer.wait_closed()
    finally:
        gc.enable()

"""Store operations in flight are counted once, by the task they run in
(kv26: a count kept beside the tasks, ``_ops``, is gone; it was derivable
from them but for an operation outside any task). A coroutine driven by
hand, outside any asyncio task, is counted under None: aclose still waits
for it, and a cancelled aclose, which cancels the operations' tasks,
passes it by (it has none) and still waits for it to end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def drive(coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    """Runs ``coro`` from loop callbacks, never inside a task (what a
    framework with its own scheduler may do); its outcome in the future."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def step() -> None:
        assert asyncio.current_task() is None
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            done.set_result(stop.value)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            done.set_exception(exc)
            return
        if yielded is None:
            loop.call_soon(step)
        else:
            yielded._asyncio_future_blocking = False
            yielded.add_done_callback(lambda _f: loop.call_soon(step))

    loop.call_soon(step)
    return done


@pytest.mark.parametrize("cancel_close", [False, True])
async def test_an_operation_outside_any_task_is_waited_for(make_agent: MakeAgent,
                                                           cancel_close: bool) -> None:
    agent = await make_agent("kv26-ops")
    n = 64
    src = agent.alloc(n * BB)
    src.numpy()[:] = pattern(n * BB, 29)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv26o")
    store = await within(kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(n * BB)]))
    put = drive(store.put(keys, src[0:n * BB]))
    seen: list[dict[Any, int]] = []
    while not put.done() and not seen:
        await asyncio.sleep(0)
        if store._op_tasks:
            seen.append(dict(store._op_tasks))
    assert seen == [{None: 1}], seen
    assert not put.done()
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0)
    if cancel_close:
        closing.cancel()
    if cancel_close:
        with pytest.raises(asyncio.CancelledError):
            await within(closing)
    else:
        await within(closing)
    # The close ended only after the put did: it was counted and waited for.
    assert put.done() and store.closed and not store._op_tasks
    assert (await put).stored == n

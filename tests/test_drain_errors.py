"""A completion callback that raises while the loop drains the engine's
ring: the records after it in the same batch are still processed (their
transfers resolve), and the error is raised once the batch is done
(cyx/_engine.pxi Engine._drain). It used to free the rest of the batch
unread: those transfers never resolved."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conftest import within

KiB = 1024


async def test_a_failing_callback_does_not_drop_the_rest_of_its_batch(
    make_agent: Any,
) -> None:
    target = await make_agent("target", transports=("tcp",))
    buf = bytearray(64 * KiB)
    target.register(buf, name="pool")
    owner = await make_agent("owner", transports=("tcp",))
    peer = await within(owner.connect(target.address))
    src = owner.register(bytearray(b"D" * 16 * KiB))
    spare = owner.register(bytearray(4 * KiB))
    sub = owner._sub
    on_event = sub._on_event
    seen: list[BaseException] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx.get("exception")))

    def failing(*args: Any) -> None:
        sub._on_event = on_event
        on_event(*args)
        raise RuntimeError("a drain callback failed")

    sub._on_event = failing
    # The spare's freed record reaches the ring first (nobody maps it), then
    # the writes' completions; the loop does not drain while it sleeps here,
    # so they are drained in one batch.
    released = owner.deregister(spare)
    writes = [owner.write(src[i * 4 * KiB:(i + 1) * 4 * KiB],
                          peer.region("pool")[i * 4 * KiB:(i + 1) * 4 * KiB])
              for i in range(4)]
    time.sleep(0.5)
    try:
        done = await within(asyncio.gather(*writes), 5.0)
    finally:
        loop.set_exception_handler(None)
    assert [r.nbytes for r in done] == [4 * KiB] * 4
    assert sub._on_event is on_event, "the failing callback did not run"
    await within(released)
    assert bytes(buf[0:16 * KiB]) == b"D" * 16 * KiB
    assert any(isinstance(e, RuntimeError) for e in seen), seen

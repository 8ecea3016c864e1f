"""Agent.aclose() with AIOXFER_TCP_SPLICE=1 and writes queued at a stopped
peer (rev27). tcp26 made a connection that may splice shut only its
reading side when it dies (conn_mark_dead), so that the peer's socket stays
visible to spl_settle. At the engine's shutdown that left the sending
thread in its blocking splice/sendmsg into the full socket for SO_SNDTIMEO
(peer_timeout, 5 s by default), one call after another, while the
shutdown, run by aclose on the event loop's thread, waited for it: the
loop was blocked 10-16 s in 3 of 4 runs (1 s in the other; splice off: 0
s). spl_settle gives up a second after the shutdown anyway: the shutdown
shuts writing too."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from conftest import sigstop, within


async def test_close_with_spliced_writes_at_a_stopped_peer(make_agent, remote_agent,
                                                           monkeypatch) -> None:
    monkeypatch.setenv("AIOXFER_TCP_SPLICE", "1")
    mib = 1 << 20
    ra = await remote_agent(size=64 * mib, transports=("tcp",))
    init = await make_agent("init", transports=("tcp",))
    src = init.alloc(64 * mib, name="src")
    peer = await within(init.connect(ra.address))
    await within(init.write(src[0:mib], peer.region("pool")[0:mib]))
    sigstop(ra.pid)
    try:
        ts = [init.write(src[i * mib:(i + 1) * mib], peer.region("pool")[i * mib:(i + 1) * mib])
              for i in range(32)]
        await asyncio.sleep(0.3)  # the socket full, the sending thread in its send
        gap = 0.0

        async def ticker() -> None:
            nonlocal gap
            last = time.monotonic()
            try:
                while True:
                    await asyncio.sleep(0.01)
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
            finally:
                gap = max(gap, time.monotonic() - last)

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await within(init.aclose(), 30)
        took = time.monotonic() - t0
        tick.cancel()
        await asyncio.gather(tick, return_exceptions=True)
        await within(asyncio.gather(*ts, return_exceptions=True))
        # spl_settle's second after the shutdown, and slack for a busy host
        assert took < 4.0, f"aclose took {took:.2f} s"
        assert gap < 4.0, f"the event loop was blocked {gap:.2f} s"
    finally:
        os.kill(ra.pid, signal.SIGCONT)

"""Store.aclose cancelled, continued (kv24).

- A cancelled aclose whose close then fails: the cancelled caller sees
  CancelledError (the failure attached as its cause, and logged), while a
  caller that waits for the same close uncancelled sees the failure
  (before: the cancelled caller got the close's exception, its cancel
  lost).
- A cancelled aclose cancels the operations in flight instead of waiting
  for them: a put overflowing to a PeerTier whose owner (a real second
  process) is SIGSTOPped waits for its acknowledgement up to ack_wait
  (20 s here); the close, cancelled, returns in 1 s (before: 5.9 s, it
  waited for the put), the put raises ClosedResourceError, the
  store is closed with nothing of it running, and once the owner goes on
  every region of the store is released."""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, sigstop, wait_until, within

import aioxfer
from aioxfer import kv
from aioxfer.errors import ClosedResourceError

MakeAgent = Callable[..., Awaitable[Any]]


class JournalTier(kv.Tier):
    """A tier of the application's own (the public Tier interface) that
    stores nothing and writes a journal file when the store closes: its
    close fails for real once its directory is gone."""

    stores = False

    def __init__(self, path: Path) -> None:
        super().__init__("journal")
        self.path = path

    def _locate(self, key: bytes) -> None:
        return None

    async def _aclose(self) -> None:
        self.path.write_bytes(b"closed\n")


async def test_cancelled_caller_of_a_failing_close_sees_its_cancel(
        make_agent: MakeAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    agent = await make_agent("kv24-fail")
    bb, n = 64 << 10, 8
    gone = tmp_path / "journal"
    gone.mkdir()
    host = kv.HostTier(4 * n * bb)
    store = await within(kv.Store.open(agent, block_bytes=bb, tiers=[
        host, kv.DiskTier(tmp_path / "disk", 16 * n * bb, segment_bytes=n * bb),
        JournalTier(gone / "log")]))
    src = agent.alloc(n * bb)
    src.numpy()[:] = pattern(n * bb, 241)
    keys = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv24f")
    assert (await within(store.put(keys, src[0:n * bb]))).stored == n  # dirty: a flush to do
    shutil.rmtree(gone)
    cancelled = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0)  # the close has begun (its task made)
    waiting = asyncio.ensure_future(store.aclose())  # shares it
    await asyncio.sleep(0)
    assert not cancelled.done() and not waiting.done()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError) as got:
        await within(cancelled)
    # The failure is not lost on the cancelled caller: its cause, and logged.
    assert isinstance(got.value.__cause__, FileNotFoundError), repr(got.value.__cause__)
    with pytest.raises(FileNotFoundError):
        await within(waiting)
    assert store.closed and host.region is not None and host.region.closed
    await within(store.aclose())  # nothing left to do
    assert "kv.close_failed" in capsys.readouterr().err


OWNER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        bb = int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[1], peer_timeout=60.0) as agent:
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(256 * bb), kv.PeerTier(group="kv24")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def test_cancelled_close_cuts_a_put_waiting_for_a_stopped_owner(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    bb, n = 16 << 10, 8
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "kv24-owner", str(bb), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd=str(tmp_path))
    assert proc.stdout is not None and proc.stdin is not None
    try:
        address = (await within(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the owner did not start"
        agent = await make_agent("kv24-writer", peer_timeout=60.0,
                                 limits=aioxfer.Limits(close_timeout=0.5))
        src = agent.alloc(2 * n * bb)
        src.numpy()[:] = pattern(2 * n * bb, 242)
        regions0 = agent.statistics().native_regions
        tier = kv.PeerTier(group="kv24", ack_wait=20.0, ack_timeout=20.0)
        store = await within(kv.Store.open(agent, block_bytes=bb, tiers=[
            kv.HostTier(2 * bb, high_watermark=1.0, low_watermark=1.0), tier]))
        before = asyncio.all_tasks()
        assert await within(tier.join(address))
        name = next(iter(tier.members))
        # A put that reaches the owner while it runs: the control connection
        # is made (the placement to the stopped owner is then sent, not
        # stuck in the connect); its keys removed, the host tier empty again.
        warm = kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv24w")
        assert (await within(store.put(warm, src[n * bb:2 * n * bb]))).stored == n
        await within(store.remove(warm))
        sigstop(proc.pid)
        put = asyncio.ensure_future(store.put(
            kv.chain(np.arange(16 * n), block_tokens=16, namespace=b"kv24p"), src[0:n * bb]))
        # Until its placement waits for the stopped owner's acknowledgement.
        await within(wait_until(lambda: bool(tier.members[name].waiting),
                                what="a placement sent"))
        closing = asyncio.ensure_future(store.aclose())
        await asyncio.sleep(0.2)
        assert not closing.done() and not put.done()
        t0 = time.monotonic()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(closing, 60)
        took = time.monotonic() - t0
        # 1.0 s here: the close's own releases wait close_timeout for the
        # stopped owner's mappings, twice (the tier's regions, then the
        # store's). Before, 5.9 s: it waited for the put, which ended only
        # when the tier's control agent took the owner for lost (its
        # peer_timeout, 5 s; ack_wait would have been 20 s).
        assert took < 3.0, f"the cancelled close took {took:.1f} s"
        assert store.closed
        with pytest.raises(ClosedResourceError):
            await within(put)
        left = [t for t in asyncio.all_tasks() - before if t is not put and not t.done()]
        assert not left, left
        proc.send_signal(signal.SIGCONT)
        # The stopped owner's mappings held the regions; once it goes on
        # they are all released.
        await within(wait_until(lambda: agent.statistics().native_regions == regions0,
                                seconds=20, what="the store's regions released"), 30)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write(b"\n")
            try:
                await within(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

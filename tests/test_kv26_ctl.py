"""PeerTier's control agent ({name}.kvctl) follows the store agent's
timeouts (kv26). It was made with the defaults whatever the store's agent
had: a member SIGSTOPped was taken for lost on the control connection
after 5 s (peer_timeout's default) even when the application had
configured its agent for 1 s, so placements to it, and an owner's ack to
a stopped writer, waited that long."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import pattern, sigstop, wait_until, within

import aioxfer
from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]

OWNER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        bb = int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[1]) as agent:
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(64 * bb), kv.PeerTier(group="kv26c")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def test_control_agent_takes_the_store_agents_timeouts(make_agent: MakeAgent,
                                                             tmp_path: Path) -> None:
    """A store whose agent has peer_timeout=1 s: its tier's control agent
    has it too (and the agent's limits), and a SIGSTOPped owner's control
    connection is declared lost in about 1 s (before: 5.0 s, the default)."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "kv26c-owner", str(BB), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd=str(tmp_path))
    assert proc.stdout is not None and proc.stdin is not None
    try:
        address = (await within(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the owner did not start"
        limits = aioxfer.Limits(close_timeout=0.5, revoke_timeout=2.0)
        agent = await make_agent("kv26c-writer", peer_timeout=1.0, keepalive=0.2,
                                 limits=limits)
        tier = kv.PeerTier(group="kv26c", ack_wait=20.0, ack_timeout=20.0)
        src = agent.alloc(8 * BB)
        src.numpy()[:] = pattern(8 * BB, 26)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0), tier]) as store:
            assert tier.ctl is not None and tier.ctl.limits is limits
            assert await within(tier.join(address))
            name = next(iter(tier.members))
            # A put that reaches the owner: the control connection is made.
            keys = kv.chain(np.arange(16 * 8), block_tokens=16, namespace=b"kv26c")
            assert (await within(store.put(keys, src[0:8 * BB]))).stored == 8
            ctl = tier.members[name].ctl
            assert ctl is not None and not ctl.lost
            sigstop(proc.pid)
            t0 = time.monotonic()
            await within(wait_until(lambda: ctl.lost, seconds=20,
                                    what="the stopped owner's control connection lost"), 30)
            took = time.monotonic() - t0
            # about peer_timeout (1 s) plus a poll; before: 5.0 s
            assert took < 3.0, f"the control agent took {took:.1f} s to declare the owner lost"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write(b"\n")
            try:
                await within(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

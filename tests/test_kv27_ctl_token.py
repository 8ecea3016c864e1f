"""PeerTier's control agent ({name}.kvctl) authenticates with exactly the
store agent's credentials (kv27). It was made with the default token
($AIOXFER_TOKEN, else the user's token file) whatever the store's agent
was given: members given the same token= but holding other default
tokens could not reach each other's control agents (every placement to a
peer failed, "peer_unreachable"), and the control agent authenticated with
a secret the application had not chosen (or with one where the application
had turned authentication off)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from conftest import pattern, within

import aioxfer
from aioxfer import kv

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]

OWNER = textwrap.dedent('''
    import asyncio, json, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        bb = int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[1], token=sys.argv[3]) as agent:
            tier = kv.PeerTier(group="kv27t")
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(64 * bb), tier]):
                print(agent.address, flush=True)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, sys.stdin.readline)
                print(json.dumps({"pulled": tier.pulled}), flush=True)
                await loop.run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def test_members_with_one_token_and_other_default_tokens_place_blocks(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """The owner, another process, runs with an $AIOXFER_TOKEN of its own
    and gives its agent token=T; so does this writer (its default token
    differs from the owner's): the writer's overflow puts are placed there
    and acknowledged (before: its control agent was refused by the owner's,
    every block dropped as "peer_unreachable")."""
    token = f"kv27-{secrets.token_hex(8)}"
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = dict(os.environ, AIOXFER_TOKEN=f"kv27-owner-default-{secrets.token_hex(8)}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "kv27t-owner", str(BB), token,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=str(tmp_path),
        env=env)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        address = (await within(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the owner did not start"
        agent = await make_agent("kv27t-writer", token=token)
        src = agent.alloc(8 * BB)
        src.numpy()[:] = pattern(8 * BB, 27)
        tier = kv.PeerTier(group="kv27t")
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0, put_wait=0),
                tier]) as store:
            assert await within(tier.join(address))  # (the store agents: one token)
            keys = kv.chain(np.arange(16 * 8), block_tokens=16, namespace=b"kv27t")
            res = await within(store.put(keys, src[0:8 * BB]))
            why = store.statistics().tiers["peer"].dropped_stores
            assert res.stored == 8 and not res.dropped, (res, why)
            assert why == {}
            proc.stdin.write(b"report\n")
            await proc.stdin.drain()
            report = (await within(proc.stdout.readline())).decode()
            assert '"pulled": ' in report and '"pulled": 0' not in report, report
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write(b"\n\n")
            try:
                await within(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_control_agent_has_the_store_agents_key_and_settings(
        make_agent: MakeAgent) -> None:
    """Made inside the running loop with a token not derived yet (its key is
    derived on a thread, sec26): the control agent takes that key, not the
    default token's; and the store agent's keepalive and stall_timeout."""
    token = f"kv27-fresh-{secrets.token_hex(8)}"  # never derived in this process
    agent = aioxfer.Agent("kv27k", token=token, keepalive=0.3, stall_timeout=7.0)
    try:
        assert agent._key_pending is not None  # (the case of interest)
        tier = kv.PeerTier(group="kv27k")
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(4 * BB), tier]):
            ctl = tier.ctl
            assert ctl is not None
            assert agent._token is not None and ctl._token == agent._token
            assert ctl._keepalive == 0.3 and ctl._stall_timeout == 7.0
    finally:
        await within(agent.aclose(), 30)


async def test_control_agent_of_an_agent_without_authentication_has_none(
        make_agent: MakeAgent) -> None:
    """insecure_no_auth on the store agent: its control agent authenticates
    with nothing either (before: with the default token), so a member
    without authentication reaches it."""
    a = await make_agent("kv27n-a", insecure_no_auth=True)
    b = await make_agent("kv27n-b", insecure_no_auth=True)
    ta, tb = kv.PeerTier(group="kv27n"), kv.PeerTier(group="kv27n")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(4 * BB), ta]), \
            kv.Store.open(b, block_bytes=BB, tiers=[kv.HostTier(4 * BB), tb]):
        assert ta.ctl is not None and ta.ctl._token is None
        # b's control agent, talking to a's without a token, is accepted.
        assert tb.ctl is not None
        peer = await within(tb.ctl.connect(ta.ctl.address))
        await within(peer.notify(b"\x02\x00{}"))

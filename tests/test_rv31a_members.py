"""rv31a: kv31's membership claims under real faults (all pass on its base:
checks of what it claims, kept as regressions): a member stopped and
started again elsewhere joins once the agent lets the stopped one go; one
killed and started again at the same address joins at once; a close with
more hanging joins than run at once leaves no task."""

from __future__ import annotations

import asyncio
import secrets
import signal
import socket
import sys
import textwrap
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from conftest import pattern, wait_until, within
from test_discovery import TTL, etcd_server  # noqa: F401 (the fixture)

import aioxfer
from aioxfer import kv
from aioxfer.discovery import Etcd

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]

MEMBER = textwrap.dedent('''
    import asyncio, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        kw = {"listen": sys.argv[3]} if len(sys.argv) > 3 else {}
        async with aioxfer.Agent(sys.argv[1], peer_timeout=float(sys.argv[4])
                                 if len(sys.argv) > 4 else 5.0, **kw) as agent:
            async with kv.Store.open(agent, block_bytes=int(sys.argv[2]), tiers=[
                    kv.HostTier(64 * int(sys.argv[2])), kv.PeerTier(group="rv31a")]):
                print(agent.address, flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


async def start(script: Path, name: str, *extra: str) -> tuple[Any, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), name, str(BB), *extra, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.stdout is not None
    address = (await within(proc.stdout.readline(), 60)).decode().strip()
    assert address, "the member did not start"
    return proc, address


def keys(tag: bytes) -> list[bytes]:
    return kv.chain(list(range(16)), block_tokens=16, namespace=tag)


async def test_stopped_member_successor_elsewhere(make_agent: MakeAgent, tmp_path: Path) -> None:
    script = tmp_path / "m.py"
    script.write_text(MEMBER)
    procs: list[Any] = []
    try:
        proc, address = await start(script, "rv31a-m")
        procs.append(proc)
        agent = await make_agent("rv31a-w", peer_timeout=2.0)
        tier = kv.PeerTier(group="rv31a", ack_wait=30.0, ack_timeout=30.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
            src = agent.alloc(2 * BB)
            src.numpy()[:] = pattern(2 * BB, 3)
            assert await within(tier.join(address))
            proc.send_signal(signal.SIGSTOP)
            proc2, address2 = await start(script, "rv31a-m")
            procs.append(proc2)
            assert not await within(tier.join(address2))
            await within(wait_until(
                lambda: "rv31a-m" in tier.members
                and tier.members["rv31a-m"].peer.address == address2,
                seconds=20, what="successor"), 30)
            assert await within(tier._write(keys(b"rv31a2"), [src], [BB])) == [True]
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            await p.wait()


async def test_killed_member_same_address(make_agent: MakeAgent, tmp_path: Path) -> None:
    script = tmp_path / "m.py"
    script.write_text(MEMBER)
    procs: list[Any] = []
    try:
        proc, address = await start(script, "rv31a-s")
        procs.append(proc)
        agent = await make_agent("rv31a-ws", peer_timeout=60.0)
        tier = kv.PeerTier(group="rv31a", ack_wait=30.0, ack_timeout=30.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
            src = agent.alloc(2 * BB)
            src.numpy()[:] = pattern(2 * BB, 3)
            assert await within(tier.join(address))
            assert await within(tier._write(keys(b"rv31as1"), [src], [0])) == [True]
            proc.kill()
            await proc.wait()
            proc2, address2 = await start(script, "rv31a-s", address)
            procs.append(proc2)
            assert address2 == address
            assert await within(tier.join(address2))
            assert await within(tier._write(keys(b"rv31as2"), [src], [BB])) == [True]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
            await p.wait()



async def test_close_with_many_hanging_joins(make_agent: MakeAgent,
                                             etcd_server: str) -> None:  # noqa: F811
    import aetcd  # type: ignore[import-untyped]

    etcd = Etcd(etcd_server, prefix=f"/aioxfer-test/rv31a-{uuid.uuid4().hex[:12]}", ttl=TTL)
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)
    try:
        host, port = etcd_server.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
            for i in range(20):
                ghost = msgspec.json.encode(dict(
                    type="meta", version=aioxfer.metadata.PROTOCOL_VERSION,
                    name=f"rv31a-ghost{i}", incarnation=secrets.randbits(63),
                    host_id="elsewhere", pid=1,
                    address=f"127.0.0.1:{silent.getsockname()[1]}", transports=["tcp"],
                    regions=[]))
                await client.put(etcd.key(f"rv31a-ghost{i}").encode(), ghost)
        a = await make_agent("rv31a-ga", discovery=etcd, peer_timeout=60.0)
        tier = kv.PeerTier(group="rv31ag")
        store = await within(kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tier]))
        await within(wait_until(lambda: len(tier._follows) == 16 and len(tier._queued) == 4,
                                what="joins under way"))
        await within(store.aclose(), 10)  # (not the connects' timeout)
        assert not tier._follows and not tier._queued and not tier._tasks
        left = [t for t in asyncio.all_tasks() if "_follow" in repr(t.get_coro())]
        assert not left, left
    finally:
        silent.close()

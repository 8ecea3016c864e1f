"""rv31a: one stopped member cannot take every probe bucket (kv31 review).

kv31 gave each member's bucket read buckets of its own from a shared pool
(1024), so that a member whose read hangs (stopped) holds up no other
member's probe. But nothing bounded what one member's reads held: each get
that probes it takes up to 256 more buckets, all held until the agent's
peer timeout. Four such gets at once (an inference server's batch, keys of
a few hundred blocks each) took every bucket, and every get's probe of
every healthy member waited behind the stopped one again, for the peer
timeout: the very stall kv31 set out to end.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from conftest import wait_until, within
from test_kv17_peer import MEMBER, start_member
from test_kv29_peer import BB, publish_meta

from aioxfer import kv
from aioxfer.kv import peer as kvpeer

MakeAgent = Callable[..., Awaitable[Any]]


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP takes effect a while after
    it is sent: a read answered meanwhile would pass the premise by)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def test_a_stopped_members_reads_hold_at_most_its_share_of_the_buckets(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    """A (a real process, over tcp) stops; four probes of 256+ keys each
    that A owns are under way (their reads of A hang). A probe of a key
    only B (healthy) and this store own must still end at once."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER.replace('group="lost"', 'group="rv31ab"'))
    proc, address = await start_member(script, "rv31-ba", BB)
    stuck: list[asyncio.Future[int]] = []
    try:
        agent = await make_agent("rv31-bw", peer_timeout=60.0, transports=("tcp",))
        b = await make_agent("rv31-bb")
        publish_meta(b, "rv31ab")
        tier = kv.PeerTier(group="rv31ab", ack_wait=30.0, ack_timeout=30.0)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
            assert await within(tier.join(address))
            assert await within(tier.join(b.address))
            names = tier.member_names()
            n_owners = tier.replicas + 1
            cands = kv.chain(list(range(16 * 4000)), block_tokens=16, namespace=b"rv31ab")
            on_a = [k for k in cands if "rv31-ba" in kvpeer.owners(k, names, n_owners)]
            on_b = next(k for k in cands
                        if set(kvpeer.owners(k, names, n_owners)) == {agent.name, b.name})
            per = kvpeer._PROBE_KEYS
            gets = kvpeer._PROBE_BUCKETS // per
            assert len(on_a) >= gets * per
            proc.send_signal(signal.SIGSTOP)
            await within(wait_until(lambda: stopped(proc.pid), what="stopped"))
            for i in range(gets):
                stuck.append(asyncio.ensure_future(tier._probe(on_a[i * per:(i + 1) * per])))
            # (their reads of B, if any, end; those of A hang)
            await within(wait_until(lambda: len(tier.probe_slots.free) <= kvpeer._PROBE_BUCKETS
                                    - per, what="a read of A posted"))
            await asyncio.sleep(0.3)  # (the others' reads of B, if any, ended)
            assert not any(t.done() for t in stuck), [
                t.exception() or t.result() for t in stuck if t.done()]
            # Before: every bucket was held by A's reads, and this waited
            # for the peer timeout (60 s).
            assert await within(tier._probe([on_b]), 10) == 0
            assert not any(t.done() for t in stuck)
            proc.kill()  # (A's reads fail now: the probes end, misses)
            await proc.wait()
            for t in stuck:
                assert await within(t, 30) == 0
            assert len(tier.probe_slots.free) == kvpeer._PROBE_BUCKETS
    finally:
        for t in stuck:
            t.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()

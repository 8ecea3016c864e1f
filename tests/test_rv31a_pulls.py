"""rv31a: one stopped sender cannot take every part of the pull staging
(kv31 review).

kv31 cut the pull staging into 4 parts, one per staged read at once, so
that a sender stopped while its blocks are read "holds one part, not every
other sender's pulls". But a sender may have max_pulls_per_peer (4)
placements pulled at once, each took a part of its own: a stopped sender
with 4 placements in flight (a writer keeps that many in flight) held all
4 for the agent's peer timeout, every other sender's staged pull waited
behind it, their ack_waits passed and they took this owner for silent,
the very stall kv31 set out to end.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from conftest import pattern, wait_until, within
from test_kv17_peer import MEMBER, start_member

import aioxfer
from aioxfer import kv
from aioxfer.kv import checksum as ck

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP takes effect a while after
    it is sent: a read answered meanwhile would pass the premise by)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def keys(tag: bytes, n: int = 1) -> list[bytes]:
    return kv.chain(list(range(16 * n)), block_tokens=16, namespace=tag)


async def test_a_stopped_sender_with_pulls_in_flight_holds_up_no_other_sender(
        make_agent: MakeAgent, tmp_path: Path) -> None:
    script = tmp_path / "member.py"
    script.write_text(MEMBER.replace('group="lost"', 'group="rv31aq"'))
    proc, address = await start_member(script, "rv31-qs", BB)
    try:
        o = await make_agent("rv31-qo", peer_timeout=60.0, transports=("tcp",))
        c = await make_agent("rv31-qc")
        csrc = c.alloc(3 * BB, name="csrc")
        csrc.numpy()[:] = pattern(3 * BB, 34)
        crcs = [ck.checksum(csrc.memoryview[i * BB:(i + 1) * BB]) for i in range(3)]
        ks = keys(b"rv31aq", 3)
        tier = kv.PeerTier(group="rv31aq", ack_wait=30.0, ack_timeout=30.0)
        host = kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0)
        async with kv.Store.open(o, block_bytes=BB, tiers=[host, tier]):
            assert tier.ctl is not None
            assert await within(tier.join(address))
            s = tier.members["rv31-qs"]
            to_o = await within(c.connect(tier.ctl.address))

            async def place_from_c(req: int, blocks: list[int]) -> bytes:
                head = json.dumps({"op": "put", "req": req, "from": c.address,
                                   "ctl": c.address, "region": "csrc"}).encode()
                body = b"".join(ks[i] + (i * BB).to_bytes(8, "little")
                                + crcs[i].to_bytes(4, "little")
                                + ck.ALGO.to_bytes(4, "little") for i in blocks)
                await within(to_o.notify(len(head).to_bytes(2, "little") + head + body))
                p = (await within(anext(aiter(c.notifications)))).payload
                n = int.from_bytes(p[:2], "little")
                assert json.loads(p[2:2 + n])["req"] == req
                return bytes(p[2 + n:])

            assert await place_from_c(1, [0, 1]) == b"\x01\x01"  # (the host tier is full now)
            assert not host.free
            proc.send_signal(signal.SIGSTOP)
            await within(wait_until(lambda: stopped(proc.pid), what="stopped"))
            # S's placements, as many as this owner pulls from one sender at
            # once, each pulled from S's pool (stopped).
            n = tier.max_pulls_per_peer
            async with aioxfer.Agent("rv31-qs.kvctl") as s_ctl:
                to_o_s = await within(s_ctl.connect(tier.ctl.address))
                for req in range(n):
                    head = json.dumps({"op": "put", "req": 10 + req, "from": s.peer.address,
                                       "ctl": s.meta["ctl"], "region": s.meta["pool"]}).encode()
                    body = (keys(b"rv31aq-s%d" % req)[0] + bytes(8) + (0).to_bytes(4, "little")
                            + ck.ALGO.to_bytes(4, "little"))
                    await within(to_o_s.notify(len(head).to_bytes(2, "little") + head + body))
                await within(wait_until(lambda: sum(tier._pulling.values()) == n,
                                        what="S's pulls under way"))
                await asyncio.sleep(0.3)  # (their reads posted, unanswered)
                # Before: S's pulls held every part, and C's ack waited for
                # the peer timeout (60 s).
                assert await within(place_from_c(3, [2]), 10) == b"\x01"
                assert ks[2] in host.index
                proc.kill()  # (S's reads fail now)
                await proc.wait()
                await within(wait_until(lambda: not tier._pulling and not tier._answering,
                                        what="S's pulls ended"), 30)
                assert len(tier.pull_parts.free) == tier.pull_parts.n
                assert not tier._pull_shares
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()

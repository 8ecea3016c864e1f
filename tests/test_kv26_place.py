"""Puts overflowing the host tier to a PeerTier go out together (kv26).

They took the tier's placement staging one at a time (a lock held over the
copy in and the owner's acknowledgement): 8 concurrent puts of 8 blocks
were 8 placements one after another. Now each round of a put takes staging
slots of its own, first come, first served, and the placements of several
rounds are in flight together, at most the member's max_pulls_per_peer (it
publishes it) at once to one member, so that none is refused there for
arriving together. Kept: the order (a large put is not passed by smaller
ones after it), a cancelled put gives its slots back (waiting or placed),
the src of a put is not read once it is over (tests/test_kv20_peer_src).

The member is driven by hand where the order of its acknowledgements
matters (its control agent is the test's), and a real second process where
it pulls."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import pattern, within

from aioxfer import kv
from aioxfer.kv.peer import _Slots

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def fake_member(agent: Any, ctl_address: str, pulls: int | None) -> None:
    """Publishes on ``agent`` what a member of group "t" publishes (its
    control agent at ``ctl_address``, driven by the test), saying it pulls
    ``pulls`` placements from one peer at once (None: not said)."""
    pool = agent.alloc(16 * BB, name="pool")
    agent.alloc(4 * 4 * 64, name="kvpeer.t.index")
    meta: dict[str, Any] = {"v": 1, "ctl": ctl_address, "address": agent.address,
                            "pool": pool.name, "index": "kvpeer.t.index", "buckets": 4,
                            "block_bytes": BB}
    if pulls is not None:
        meta["pulls_per_peer"] = pulls
    raw = json.dumps(meta).encode()
    region = agent.alloc(4096, name="kvpeer.t.meta")
    region.numpy()[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)


def keys_of(put: int, n: int) -> list[bytes]:
    return kv.chain(np.arange(16 * n) + 1000 * put, block_tokens=16, namespace=b"kv26p")


class Member:
    """The test's side of a fake member: placements as they arrive, acked by hand."""

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl
        self.it = aiter(ctl.notifications)

    async def next(self, seconds: float = 10.0) -> tuple[dict[str, Any], bytes]:
        note = await within(anext(self.it), seconds)
        p = note.payload
        n = int.from_bytes(p[:2], "little")
        head = json.loads(p[2:2 + n])
        assert head["op"] == "put"
        return head, p[2 + n:]

    async def none_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(anext(self.it), seconds)
        except TimeoutError:
            return True
        return False

    async def ack(self, head: dict[str, Any], body: bytes, stored: int = 1) -> None:
        back = await within(self.ctl.connect(head["ctl"]))
        ack = json.dumps({"op": "ack", "req": head["req"]}).encode()
        n = len(body) // 48
        await within(back.notify(len(ack).to_bytes(2, "little") + ack + bytes([stored]) * n))


def put_of(body: bytes, puts: dict[bytes, int]) -> int:
    """Which put a placement carries (its first block's key)."""
    return puts[body[:32]]


async def _member_and_tier(make_agent: MakeAgent, pulls: int | None,
                           staging: int) -> tuple[Member, kv.PeerTier, Any, Any]:
    b = await make_agent("kv26-fake-b")
    b_ctl = await make_agent("kv26-fake-b.kvctl")
    fake_member(b, b_ctl.address, pulls)
    agent = await make_agent("kv26-writer")
    tier = kv.PeerTier(group="t", place_staging_blocks=staging, ack_wait=30.0,
                       ack_timeout=30.0)
    return Member(b_ctl), tier, agent, b


async def at_turns(tier: kv.PeerTier, name: str, n: int) -> None:
    """Until ``n`` placements to member ``name`` hold or wait for a turn,
    or wait for the staging before it (in the order they asked)."""
    m = tier.members[name]

    async def counted() -> None:
        while (len(m.sending._waiters) + m.sending.n - len(m.sending.free)
               + len(tier.place_slots._waiters)) < n:
            await asyncio.sleep(0.001)
    await within(counted())


async def test_concurrent_overflow_puts_are_placed_together_up_to_the_members_limit(
        make_agent: MakeAgent) -> None:
    """Six concurrent overflowing puts of 4 blocks, a staging of 16 blocks,
    a member that pulls 2 placements from one peer at once: 2 placements
    arrive together, no third before one is acknowledged, and the rest
    follow in the order the puts were called as acks come back (before:
    one at a time, the second only after the first's ack). A member that
    does not publish its limit gets our own max_pulls_per_peer (4)."""
    for pulls, together in ((2, 2), (None, 4)):
        member, tier, agent, _b = await _member_and_tier(make_agent, pulls, 16)
        src = agent.alloc(6 * 4 * BB)
        src.numpy()[:] = pattern(6 * 4 * BB, 26)
        async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
            assert await within(tier.join(_b.address))
            first = {keys_of(p, 4)[0]: p for p in range(6)}
            puts = []
            for p in range(6):
                puts.append(asyncio.ensure_future(tier._write(
                    keys_of(p, 4), [src] * 4, [(4 * p + i) * BB for i in range(4)])))
                # In this order at the member's turn queue: each put's copy
                # into the staging is a real transfer, and on a loaded
                # machine a later put's copy may finish first (CI: the
                # order was [1, 2, 3, 0, 4, 5]); what is tested is the turns.
                await at_turns(tier, _b.name, p + 1)
            arrived = [await member.next() for _ in range(together)]
            assert await member.none_within(0.3), f"more than {together} placements at once"
            # (those sent together may arrive in either order)
            order = sorted(put_of(body, first) for _head, body in arrived)
            pending = list(arrived)
            while pending:
                head, body = pending.pop(0)
                await member.ack(head, body)
                if len(order) < 6:
                    head, body = await member.next()
                    order.append(put_of(body, first))
                    pending.append((head, body))
            assert order == list(range(6)), order
            for put in puts:
                assert await within(put) == [True] * 4
            assert sorted(tier.place_slots.free) == list(range(16))


async def test_a_large_put_is_not_passed_and_cancelled_puts_give_their_slots_back(
        make_agent: MakeAgent) -> None:
    """A staging of 8 blocks. Put A (4 blocks) is placed; put B (8) waits for
    the whole area; put C (4) waits behind B although 4 slots are free (first
    come, first served: B is never starved by small puts). C cancelled while
    it waits leaves the queue; A cancelled while its owner has not answered
    gives its slots back: B is placed at once, then D (called after C's
    cancel), and every slot is free at the end."""
    member, tier, agent, b = await _member_and_tier(make_agent, 8, 8)
    src = agent.alloc(24 * BB)
    src.numpy()[:] = pattern(24 * BB, 27)
    async with kv.Store.open(agent, block_bytes=BB, tiers=[kv.HostTier(16 * BB), tier]):
        assert await within(tier.join(b.address))
        sizes = {"A": 4, "B": 8, "C": 4, "D": 4}
        first = {keys_of(p, n)[0]: p for p, n in enumerate(sizes.values())}
        base = {"A": 0, "B": 4, "C": 12, "D": 16}

        def write(name: str) -> asyncio.Future[list[bool]]:
            p, n = list(sizes).index(name), sizes[name]
            return asyncio.ensure_future(tier._write(
                keys_of(p, n), [src] * n, [(base[name] + i) * BB for i in range(n)]))

        a = write("A")
        head_a, body_a = await member.next()
        assert put_of(body_a, first) == 0
        bput = write("B")
        c = write("C")
        assert await member.none_within(0.3), "a put passed B, which waits for the whole area"
        c.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(c)
        d = write("D")
        await asyncio.sleep(0.05)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(a)
        head_b, body_b = await member.next()
        assert put_of(body_b, first) == 1
        assert await member.none_within(0.2), "D went before B's slots came back"
        await member.ack(head_b, body_b)
        assert await within(bput) == [True] * 8
        head_d, body_d = await member.next()
        assert put_of(body_d, first) == 3
        await member.ack(head_d, body_d, stored=0)
        assert await within(d) == [False] * 4
        assert sorted(tier.place_slots.free) == list(range(8))
        await member.ack(head_a, body_a)  # (late: nobody waits for it any more)


async def test_slots_first_come_first_served() -> None:
    """The allocator itself: a request waits behind earlier ones even when
    its slots are free; one cancelled while it waits wakes those after it;
    one granted but cancelled before it resumed gives its slots back."""
    slots = _Slots(4)
    a = await slots.take(3)
    big = asyncio.ensure_future(slots.take(4))
    small = asyncio.ensure_future(slots.take(1))
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done()  # 1 free, but small came after big
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    assert len(await within(small)) == 1  # woken once big left the queue
    assert slots.free == []
    later = asyncio.ensure_future(slots.take(2))
    await asyncio.sleep(0)
    slots.give_back(a)  # later is granted 2 of these ...
    later.cancel()  # ... and cancelled before it resumed: they come back
    with pytest.raises(asyncio.CancelledError):
        await later
    assert len(slots.free) == 3 and not slots._waiters
    with pytest.raises(ValueError):
        await slots.take(5)


OWNER = textwrap.dedent('''
    import asyncio, json, sys
    import aioxfer
    from aioxfer import kv

    async def main():
        bb = int(sys.argv[2])
        async with aioxfer.Agent(sys.argv[1]) as agent:
            tier = kv.PeerTier(group="kv26o", max_pulls_per_peer=int(sys.argv[3]))
            async with kv.Store.open(agent, block_bytes=bb, tiers=[
                    kv.HostTier(1024 * bb), tier]):
                print(agent.address, flush=True)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, sys.stdin.readline)
                print(json.dumps({"refused": tier.pulls_refused, "pulled": tier.pulled}),
                      flush=True)
                await loop.run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
''')


@pytest.mark.parametrize("pulls", [1, 2])
async def test_concurrent_puts_to_a_real_owner_are_never_refused(
        make_agent: MakeAgent, tmp_path: Path, pulls: int) -> None:
    """A real owner that pulls ``pulls`` placements from one peer at once;
    rounds of 8 concurrent puts of 8 blocks overflowing to it: every block
    is stored, none refused there (placements arriving together past its
    limit were refused: dropped "pull_refused" there, "peer_refused" here;
    and an owner counted a pull until its ack's notify returned, so the next
    placement, sent on that ack, could still find the count full)."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "kv26o-owner", str(BB), str(pulls),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=str(tmp_path))
    assert proc.stdout is not None and proc.stdin is not None
    try:
        address = (await within(proc.stdout.readline(), 60)).decode().strip()
        assert address, "the owner did not start"
        agent = await make_agent("kv26o-writer")
        src = agent.alloc(64 * BB)
        src.numpy()[:] = pattern(64 * BB, 28)
        tier = kv.PeerTier(group="kv26o")
        async with kv.Store.open(agent, block_bytes=BB, tiers=[
                kv.HostTier(2 * BB, high_watermark=1.0, low_watermark=1.0, put_wait=0),
                tier]) as store:
            assert await within(tier.join(address))
            assert tier.members["kv26o-owner"].sending.n == pulls
            dropped = []
            for r in range(6):
                res = await within(asyncio.gather(*(
                    store.put(keys_of(100 * r + p, 8), src[p * 8 * BB:(p + 1) * 8 * BB])
                    for p in range(8))))
                dropped.append([x.dropped for x in res])
            proc.stdin.write(b"report\n")
            await proc.stdin.drain()
            report = json.loads(await within(proc.stdout.readline()))
            why = store.statistics().tiers["peer"].dropped_stores
            assert report["refused"] == 0, (report, dropped, why)
            assert not any(map(any, dropped)), (report, dropped, why)
            assert store.statistics().tiers["peer"].dropped_stores == {}
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write(b"\n\n")
            try:
                await within(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

"""rev36: a non-member's "from" bar (PeerTier._dial_barred) cannot be set
for a genuine sender by another agent that claims its name.

Embedded, agents' names need not be unique, and a placement's sender is the
name its agent gave in the handshake. kv29 barred dialling any "from" of a
sender name for ack_timeout once one dial for that name reached no agent of
its own, and while one address of that name was being dialled: any token
holder that sent one placement under a genuine writer's name, naming a port
that speaks no aioxfer (or one that never answers), had the owner refuse the
genuine writer's placements undialled, its blocks dropped, the owner taken
for silent. Now the bar is the address that was dialled, for the name that
claimed it: the genuine writer's own address is dialled."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from conftest import pattern, wait_until, within
from test_kv27_put_from import listener

import aioxfer
from aioxfer import kv
from aioxfer.kv import peer as kvpeer

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


def placement(req: int, frm: str, key: bytes) -> bytes:
    head = json.dumps({"op": "put", "req": req, "from": frm, "ctl": frm,
                       "region": "r"}).encode()
    body = key + bytes(16)
    return len(head).to_bytes(2, "little") + head + body


async def test_a_name_claimed_by_another_agent_does_not_bar_its_owner(
        make_agent: MakeAgent) -> None:
    """X claims writer W's control agent's name and sends owner A one
    placement whose "from" speaks no aioxfer: A dials it once (kv29's
    bound) and it reaches no agent of W's. Then W (which joined A, so A
    does not know it yet) writes a block owned by A. Before: A refused W's
    placement undialled ("its last address reached no agent of its"), W's
    block was dropped ("ack_timeout") and A taken for silent. Now A dials
    W's own address, joins W, pulls the block and acknowledges it."""
    a = await make_agent("rev36-a")
    w = await make_agent("rev36-w")
    ta = kv.PeerTier(group="rev36d", ack_timeout=60.0)
    tw = kv.PeerTier(group="rev36d", ack_wait=5.0, ack_timeout=60.0)
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            kv.Store.open(w, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tw]), \
            listener() as (nowhere, accepted):
        assert ta.ctl is not None and tw.ctl is not None
        assert await within(tw.join(a.address))
        assert w.name not in ta.members
        # (X: W's control agent's very name; embedded, names need not be unique)
        async with aioxfer.Agent(tw.ctl.name) as x:
            to_a = await within(x.connect(ta.ctl.address))
            key = kv.chain(list(range(16)), block_tokens=16, namespace=b"rev36x")[0]
            await within(to_a.notify(placement(1, nowhere, key)))
        await within(wait_until(lambda: accepted == [1], what="X's dial"))
        await within(wait_until(
            lambda: ta._extra()["pulls_in_flight"] == ta._extra()["pulls_answering"] == 0,
            what="X's pull over"))
        assert ta.counters.dropped_stores == {}  # (its pull failed: nothing counted)
        src = w.alloc(BB)
        src.numpy()[:] = pattern(BB, 36)
        # (a key A owns: A and W the members, one replica)
        ks = [k for i in range(64)
              for k in kv.chain(list(range(16)), block_tokens=16, namespace=b"rev36w%d" % i)
              if kvpeer.owners(k, [a.name, w.name], 1) == [a.name]][:1]
        got = await within(tw._write(ks, [src], [0]))
        # (before: [False], {"ack_timeout": 1}, A silent)
        assert got == [True], tw.counters.dropped_stores
        assert ta.pulled == 1 and w.name in ta.members
        assert not tw.members[a.name].silent


async def test_a_misdialled_address_stays_barred_under_other_names(
        make_agent: MakeAgent) -> None:
    """The bar holds the address that reached no agent, whatever name
    claims it next: X sends a placement naming a port that speaks no
    aioxfer (dialled once), then agents under two other names send
    placements naming that port: refused undialled for ack_timeout, so
    cycling names does not aim A at a port again and again."""
    a = await make_agent("rev36-a2")
    ta = kv.PeerTier(group="rev36e", ack_timeout=60.0)
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            listener() as (nowhere, accepted):
        assert ta.ctl is not None
        key = kv.chain(list(range(16)), block_tokens=16, namespace=b"rev36e")[0]
        for i, name in enumerate(("rev36-x1", "rev36-x2", "rev36-x3")):
            x = await make_agent(name)
            to_a = await within(x.connect(ta.ctl.address))
            await within(to_a.notify(placement(i + 1, nowhere, key)))
            # (dialled, or refused undialled: before, dialled each time)
            await within(wait_until(
                lambda i=i: ta.pulls_refused + len(accepted) == i + 1,  # type: ignore[misc]
                what=f"placement {i + 1} dialled or refused"))
            await within(wait_until(
                lambda: ta._extra()["pulls_in_flight"] == ta._extra()["pulls_answering"] == 0,
                what="its pull over"))
        assert accepted == [1]
        assert ta.counters.dropped_stores == {"placement_unvouched": 2}
        assert ta.pulled == 0


async def test_the_bars_are_bounded_oldest_first(make_agent: MakeAgent) -> None:
    """At most 1024 bars: past that the oldest goes (none has lapsed, with
    ack_timeout 60 s), and a renewed bar is the newest."""
    a = await make_agent("rev36-a3")
    ta = kv.PeerTier(group="rev36f", ack_timeout=60.0)
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]):
        for i in range(1030):
            ta._misdial("", f"127.0.0.1:{i}")
        assert len(ta._misdialled) == 1024  # (0 to 5 went)
        assert ta._dial_barred("x", "127.0.0.1:5") is None
        ta._misdial("", "127.0.0.1:6")  # (renewed: now the newest)
        ta._misdial("", "127.0.0.1:1030")
        assert len(ta._misdialled) == 1024
        assert ta._dial_barred("x", "127.0.0.1:7") is None  # (the oldest went)
        for port in (6, 8, 1029, 1030):
            assert ta._dial_barred("x", f"127.0.0.1:{port}") is not None

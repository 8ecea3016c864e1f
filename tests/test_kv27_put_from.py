"""A member's placement ("put" on the control agents) names the addresses
the owner dials: "from", to pull the blocks, and "ctl", to acknowledge
them. They were dialled as sent, so any holder of the token could make an
owner connect to any host and port. Now (kv27) a placement from a member
the owner knows must name that member's published addresses; otherwise
nothing is dialled and the refusal is logged and counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from conftest import wait_until, within
from test_discovery import TTL, etcd_server  # noqa: F401 (the fixture)

from aioxfer import kv
from aioxfer.discovery import Etcd

BB = 16 << 10
MakeAgent = Callable[..., Awaitable[Any]]


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback port that counts the connections made to it."""
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    accepted: list[int] = []

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(lsock)
            accepted.append(1)
            sock.close()

    task = loop.create_task(accept())
    try:
        yield f"127.0.0.1:{lsock.getsockname()[1]}", accepted
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        lsock.close()


@pytest.mark.parametrize("field", ["from", "ctl"])
async def test_a_placement_naming_another_address_is_refused_undialled(
        make_agent: MakeAgent, field: str) -> None:
    """B is a member A knows (A joined it). B's control agent sends A a
    placement whose ``field`` is a port of the test's instead of B's own:
    A connects to nothing there, counts the refusal, logs why (before: A
    dialled it, to pull from it or to acknowledge to it)."""
    a = await make_agent("kv27f-a")
    b = await make_agent("kv27f-b")
    ta, tb = kv.PeerTier(group="kv27f"), kv.PeerTier(group="kv27f")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            kv.Store.open(b, block_bytes=BB, tiers=[kv.HostTier(8 * BB), tb]), \
            listener() as (elsewhere, accepted):
        assert await within(ta.join(b.address))
        assert b.name in ta.members and ta.ctl is not None and tb.ctl is not None
        pool = b.alloc(BB, name="kv27f.src")
        head = {"op": "put", "req": 1, "from": b.address, "ctl": tb.ctl.address,
                "region": pool.name}
        head[field] = elsewhere
        raw = json.dumps(head).encode()
        body = bytes(32) + bytes(8) + bytes(4) + bytes(4)  # one block's entry
        to_a = await within(tb.ctl.connect(ta.ctl.address))
        await within(to_a.notify(len(raw).to_bytes(2, "little") + raw + body))
        await within(wait_until(lambda: ta.pulls_refused == 1, seconds=10,
                                what="the placement refused"), 20)
        await asyncio.sleep(0.3)  # (time for a dial, had there been one)
        assert accepted == [], f"A dialled the {field!r} address it was sent"
        assert ta.counters.dropped_stores == {"placement_unvouched": 1}


async def test_a_placement_from_a_member_at_its_own_addresses_is_pulled(
        make_agent: MakeAgent) -> None:
    """The same placement naming B's own addresses is pulled and acked as
    before (the check refuses only what is not the member's)."""
    a = await make_agent("kv27g-a")
    b = await make_agent("kv27g-b")
    ta, tb = kv.PeerTier(group="kv27g"), kv.PeerTier(group="kv27g")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            kv.Store.open(b, block_bytes=BB, tiers=[kv.HostTier(2 * BB), tb]) as sb:
        assert await within(ta.join(b.address))
        src = b.alloc(4 * BB)
        src.numpy()[:] = 7
        keys = kv.chain(list(range(16 * 4)), block_tokens=16, namespace=b"kv27g")
        # B's host tier holds 2: the rest overflow to A (B joined by A only:
        # A knows B, B learns A by joining it too).
        assert await within(tb.join(a.address))
        res = await within(sb.put(keys, src[0:4 * BB]))
        assert res.stored == 4 and not res.dropped, (res, tb.counters.dropped_stores)
        assert ta.pulled >= 1 and ta.pulls_refused == 0


@pytest.mark.parametrize("field", ["from", "ctl"])
async def test_with_discovery_a_placement_from_an_unjoined_sender_needs_etcds_address(
        make_agent: MakeAgent, etcd_server: str, field: str) -> None:  # noqa: F811
    """With discovery, a placement from an agent the tier has not taken as a
    member, ``field`` a port of the test's, the other the sender's own
    address: from one etcd holds, "from" must be the address etcd holds
    for it, and its "ctl" is no member's (kv28: this case named both
    fields the test's port, so the refusal of "from" hid whether "ctl" was
    dialled; rev28's test_rev28_ctl found it was); from one etcd does not
    hold, nothing is dialled (before: both dialled the test's port)."""
    etcd = Etcd(etcd_server, prefix=f"/aioxfer-test/kv27-{uuid.uuid4().hex[:12]}", ttl=TTL)
    a = await make_agent("kv27d-a", discovery=etcd)
    c = await make_agent("kv27d-c", discovery=etcd)  # in etcd, no PeerTier: no member
    d = await make_agent("kv27d-d")  # not in etcd
    ta = kv.PeerTier(group="kv27d")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            listener() as (elsewhere, accepted):
        assert ta.ctl is not None
        await within(wait_until(lambda: any(ev.name == c.name
                                            for ev in a._membership.snapshot()),
                                seconds=10, what="c in etcd"), 20)
        body = bytes(48)
        for sender in (c, d):
            head = {"op": "put", "req": 1, "from": sender.address, "ctl": sender.address,
                    "region": "r"}
            head[field] = elsewhere
            raw = json.dumps(head).encode()
            to_a = await within(sender.connect(ta.ctl.address))
            await within(to_a.notify(len(raw).to_bytes(2, "little") + raw + body))
        # "from" refused for both; "ctl": d refused, c's pull tried (it is
        # at its etcd address) and found no region "r", its ack withheld.
        refused = 2 if field == "from" else 1
        await within(wait_until(lambda: ta.pulls_refused == refused, seconds=10,
                                what="the placements refused"), 20)
        await asyncio.sleep(0.5)
        assert accepted == [], f"A dialled the {field!r} address it was sent"
        assert ta.counters.dropped_stores == {"placement_unvouched": refused}
        assert c.name not in ta.members

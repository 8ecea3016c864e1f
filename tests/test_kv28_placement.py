"""kv28: what a placement from a sender that is no member (embedded mode)
may make an owner do.

A placement names "from" (the owner connects there and reads the blocks)
and "ctl" (the owner connects there to acknowledge). kv27/rev28 vouched for
both when the sender was a known member (or, with discovery, one of
etcd's); embedded, a sender the owner never joined had both dialled as
sent: any token holder could make an owner read a third agent's memory
into its host tier, and dial any host and port with its ack (even for a
placement it refused). Now the agent found at "from" must be the sender's
own store agent (its name, proven in the handshake), and the ack of a
sender that is still no member goes only to the sender itself at "from".
Names with control characters (which went raw into log lines) are no
member's and no sender's."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pattern, wait_until, within
from test_kv27_put_from import BB, listener

from aioxfer import kv
from aioxfer.kv import checksum as ck

MakeAgent = Callable[..., Awaitable[Any]]


def placement(req: int, frm: str, ctl: str, region: str, key: bytes, crc: int) -> bytes:
    head = json.dumps({"op": "put", "req": req, "from": frm, "ctl": ctl,
                       "region": region}).encode()
    body = key + bytes(8) + crc.to_bytes(4, "little") + ck.ALGO.to_bytes(4, "little")
    return len(head).to_bytes(2, "little") + head + body


def one_key(tag: bytes) -> bytes:
    return kv.chain(list(range(16)), block_tokens=16, namespace=tag)[0]


async def test_from_naming_another_agent_is_not_read_nor_acked(make_agent: MakeAgent) -> None:
    """C (a plain agent A never joined) sends A a placement whose "from" is
    X, another agent (with a block whose checksum C knows), and whose
    "ctl" is a port of the test's. Before: A read X's block into its host
    tier, took X as a member and dialled the port with its ack. Now: the
    agent at "from" is not the sender: nothing read, nothing acked,
    refused and counted."""
    x = await make_agent("kv28-x")
    secret = x.alloc(BB, name="secret")
    data = pattern(BB, 28)
    secret.numpy()[:] = data
    c = await make_agent("kv28-c")
    a = await make_agent("kv28-a")
    host = kv.HostTier(8 * BB)
    ta = kv.PeerTier(group="kv28")
    async with kv.Store.open(a, block_bytes=BB, tiers=[host, ta]), \
            listener() as (elsewhere, accepted):
        assert ta.ctl is not None
        to_a = await within(c.connect(ta.ctl.address))
        await within(to_a.notify(placement(1, x.address, elsewhere, "secret", one_key(b"kv28x"),
                                           ck.checksum(data))))
        await within(wait_until(lambda: ta.pulls_refused == 1 or ta.pulled == 1, seconds=10,
                                what="the placement served"), 20)
        await asyncio.sleep(0.5)  # (time for an ack's dial, had there been one)
        assert ta.pulled == 0 and not host.index, "A read X's memory for C"
        assert accepted == [], "A dialled the ctl address C sent"
        assert ta.pulls_refused == 1
        assert ta.counters.dropped_stores == {"placement_unvouched": 1}
        assert x.name not in ta.members


async def test_a_senders_own_placement_is_pulled_but_acked_only_to_itself(
        make_agent: MakeAgent) -> None:
    """C places a block of its own memory ("from": C itself), "ctl" a port
    of the test's. The pull goes on (the agent at "from" is the sender),
    the ack does not go to the port (before: it did); with "ctl" C's own
    address the ack comes to C, as before."""
    c = await make_agent("kv28-c2")
    src = c.alloc(2 * BB, name="src")
    data = pattern(2 * BB, 29)
    src.numpy()[:] = data
    a = await make_agent("kv28-a2")
    ta = kv.PeerTier(group="kv28")
    async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
            listener() as (elsewhere, accepted):
        assert ta.ctl is not None
        to_a = await within(c.connect(ta.ctl.address))
        await within(to_a.notify(placement(1, c.address, elsewhere, "src", one_key(b"kv28c1"),
                                           ck.checksum(data[:BB]))))
        await within(wait_until(lambda: ta.pulled == 1, seconds=10, what="the pull"), 20)
        await asyncio.sleep(0.5)
        assert accepted == [], "A dialled the ctl address C sent"
        notes = aiter(c.notifications)
        await within(to_a.notify(placement(2, c.address, c.address, "src", one_key(b"kv28c2"),
                                           ck.checksum(data[:BB]))))
        p = (await within(anext(notes))).payload
        n = int.from_bytes(p[:2], "little")
        assert json.loads(p[2:2 + n]) == {"op": "ack", "req": 2} and p[2 + n:] == b"\x01"
        assert ta.pulled == 2 and accepted == []


async def test_a_refusal_is_not_acked_to_an_unknown_senders_ctl(make_agent: MakeAgent) -> None:
    """Past max_pulls a placement is refused with an ack of zeros. From a
    sender that is no member that ack went to the "ctl" it named (before:
    the test's port was dialled for it); now nowhere."""
    silent = socket.socket()  # accepts, never answers: the first pull hangs in its connect
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    nowhere = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        c = await make_agent("kv28-c3")
        a = await make_agent("kv28-a3")
        ta = kv.PeerTier(group="kv28", max_pulls=1, max_pulls_per_peer=1)
        async with kv.Store.open(a, block_bytes=BB, tiers=[kv.HostTier(8 * BB), ta]), \
                listener() as (elsewhere, accepted):
            assert ta.ctl is not None
            to_a = await within(c.connect(ta.ctl.address))
            for req in (1, 2):
                await within(to_a.notify(placement(req, nowhere, elsewhere, "r",
                                                   one_key(b"kv28r"), 0)))
            await within(wait_until(lambda: ta.pulls_refused == 1, seconds=10,
                                    what="the second placement refused"), 20)
            await asyncio.sleep(0.5)
            assert accepted == [], "A dialled the ctl address of a refused placement"
            assert ta.counters.dropped_stores == {"pull_refused": 1}
    finally:
        silent.close()


async def test_names_with_control_characters_are_no_members(make_agent: MakeAgent) -> None:
    """A store whose agent's name held a newline and a terminal escape was
    joined and its name written raw into kv.peer_joined (kv28 refused it as
    a member). Such an agent can no longer exist: Agent() refuses the name,
    and a peer naming itself so is refused in the handshake (aioxfer.names,
    tests/test_sec29_names.py); kv's own check stays behind that."""
    with pytest.raises(ValueError, match="not printable"):
        await make_agent("kv28-bad\n2026-12-07 [info     ] kv.peer_joined \x1b[2K")

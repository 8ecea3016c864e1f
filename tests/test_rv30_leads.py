"""rev29's leads on the control plane's edges, each on real agents:

- Dialer.control_errors renamed an AccessDenied as type(exc)(msg) (its
  status, peer, op and fail_index lost) and relabelled a TransferTimeout (a
  TimeoutError) as its own peer timeout, a TransportError;
- PeerTable.by_name kept an empty WeakSet for every name ever connected;
- a membership() iterator iterated by two tasks left the first asleep for
  ever (one waiter slot, the second task's replaced it);
- parse_address took any port int() takes ("+80", " 80", "8_0", "٨٠"),
  which etcd's endpoints and metadata.check_address refused.
"""
from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from conftest import wait_until, within

import aioxfer
from aioxfer import _abi
from aioxfer.dialing import Dialer, parse_address
from aioxfer.discovery import PeerLeft, _parse_endpoint
from aioxfer.errors import AccessDenied, TransferTimeout, TransportError, error_for_status
from aioxfer.metadata import check_address

_STATUS = {name: code for code, name in _abi.STATUS_NAMES.items()}


def _dialer() -> Dialer:
    return Dialer("rv30", incarnation=1, token=None, peer_timeout=5.0, max_meta_bytes=1 << 20)


# ---------------------------------------------------------------- 1. control_errors


async def test_control_errors_keeps_an_access_denied_s_fields() -> None:
    # Before: AccessDenied('connecting to ...') with status, peer, op and
    # fail_index all None.
    with pytest.raises(AccessDenied) as info:
        async with _dialer().control_errors("127.0.0.1:9", "connecting to", "connect to"):
            raise error_for_status(_STATUS["E_ACCESS"], "import", peer="tgt", op="read",
                                   fail_index=3)
    err = info.value
    assert "connecting to 127.0.0.1:9" in str(err)
    assert (err.status, err.peer, err.op, err.fail_index) == (_STATUS["E_ACCESS"], "tgt",
                                                              "read", 3)


async def test_control_errors_keeps_a_transfer_timeout() -> None:
    # Before: TransportError("connecting to 127.0.0.1:9 timed out after 5.0 s"):
    # the engine's stall (a TimeoutError too) read as the exchange's timeout.
    stalled = error_for_status(_STATUS["E_TIMEOUT"], "read", peer="tgt")
    with pytest.raises(TransferTimeout) as info:
        async with _dialer().control_errors("127.0.0.1:9", "connecting to", "connect to"):
            raise stalled
    assert info.value is stalled


async def test_control_errors_own_timeout_still_a_transport_error() -> None:
    d = Dialer("rv30", incarnation=1, token=None, peer_timeout=0.05, max_meta_bytes=1 << 20)
    with pytest.raises(TransportError, match="timed out after 0.05 s"):
        async with d.control_errors("127.0.0.1:9", "connecting to", "connect to"):
            await asyncio.sleep(5)


async def test_refused_token_is_still_access_denied_named_after_the_address(
        make_agent: Any) -> None:
    target = await make_agent("tgt", token=b"t" * 32)
    init = await make_agent("ini", token=b"u" * 32)
    with pytest.raises(AccessDenied, match=f"connecting to {target.address}"):
        await within(init.connect(target.address))


# ---------------------------------------------------------------- 2. by_name


async def test_by_name_does_not_keep_every_name_ever_connected(make_agent: Any) -> None:
    init = await make_agent("ini", transports=("tcp",))
    cycles = 100
    for i in range(cycles):
        async with aioxfer.Agent(f"churn-{i}", transports=("tcp",)) as target:
            peer = await within(init.connect(target.address))
        await wait_until(lambda p=peer: p.lost, 10, what="the closed target lost")
        del peer
        gc.collect()
    gc.collect()
    table = init._peers.by_name
    # Before: all 100 names, each an empty WeakSet. Now: at most the sweep's
    # threshold (64), whatever the churn.
    # (the last lost Peer may still be held a while: by the agent's loss report)
    assert sum(1 for peers in table.values() if peers) <= 1
    assert len(table) <= 64, len(table)
    # and a live name is never dropped by a sweep: the one connected now
    async with aioxfer.Agent("churn-last", transports=("tcp",)) as target:
        peer = await within(init.connect(target.address))
        assert peer in init._peers.by_name[peer.name]
        for i in range(70):  # past a sweep, with names whose Peers are gone
            init._peers.by_name.setdefault(f"gone-{i}", weakref.WeakSet())
        async with aioxfer.Agent("churn-more", transports=("tcp",)) as other:
            await within(init.connect(other.address))
        assert peer in init._peers.by_name[peer.name]
        assert not any(n.startswith("gone-") for n in init._peers.by_name)


# ---------------------------------------------------------------- 3. membership


async def test_second_task_iterating_one_membership_is_told(make_agent: Any) -> None:
    init = await make_agent("ini", transports=("tcp",))
    members = init.membership()
    seen: list[Any] = []

    async def consume() -> None:
        async for ev in members:
            seen.append(ev)
            if isinstance(ev, PeerLeft):
                return

    first = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # first waits for an event
    # Before: the second task's waiter replaced the first's; this waited for
    # ever (and the first never woke again, not even at aclose).
    with pytest.raises(RuntimeError, match="already being iterated"):
        await within(members.__anext__(), 2)
    target = await make_agent("tgt", transports=("tcp",))
    await within(init.connect(target.address))
    await within(target.aclose())
    await within(first, 10)  # the first still gets its events
    assert any(isinstance(ev, PeerLeft) for ev in seen)
    await members.aclose()


async def test_membership_aclose_wakes_its_one_waiter(make_agent: Any) -> None:
    init = await make_agent("ini", transports=("tcp",))
    members = init.membership()
    waiting = asyncio.create_task(members.__anext__())
    await asyncio.sleep(0.05)
    await members.aclose()
    with pytest.raises(StopAsyncIteration):
        await within(waiting, 2)


# ---------------------------------------------------------------- 4. ports


_BAD_PORTS = ["+80", " 80", "80 ", "8_0", "٨٠", "²", "-1", "65536", "99999", "", "0x50",
              "1" + "0" * 5000]


@pytest.mark.parametrize("port", _BAD_PORTS)
def test_parse_address_refuses_what_is_not_ascii_digits(port: str) -> None:
    # Before: "+80", " 80", "80 ", "8_0" and "٨٠" gave port 80 (and etcd's
    # "²" a builtin ValueError of int(), "invalid literal").
    with pytest.raises(ValueError, match="no valid port"):
        parse_address(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="etcd endpoint"):
        _parse_endpoint(f"127.0.0.1:{port}")


@pytest.mark.parametrize("port", ["1", "80", "2379", "65535", "08", "000080"])
def test_every_parser_takes_a_port_alike(port: str) -> None:
    for address in (f"127.0.0.1:{port}", f"[::1]:{port}"):
        host, n = parse_address(address)
        assert n == int(port)
        assert _parse_endpoint(address) == (host, n)
        assert _parse_endpoint(f"http://{address}/") == (host, n)
        check_address(address)


def test_port_zero_is_a_listen_port_not_an_endpoint() -> None:
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)  # Agent(listen=...:0)
    with pytest.raises(ValueError, match="etcd endpoint"):
        _parse_endpoint("127.0.0.1:0")


async def test_connect_refuses_a_port_in_other_digits(make_agent: Any) -> None:
    target = await make_agent("tgt", transports=("tcp",))
    init = await make_agent("ini", transports=("tcp",))
    port = target.address.rpartition(":")[2]
    arabic = "".join(chr(0x660 + int(d)) for d in port)  # Arabic-Indic digits: isdigit()
    # Before: int() read them as the target's port, and this connected to it.
    with pytest.raises(ValueError, match="no valid port"):
        await within(init.connect(f"127.0.0.1:{arabic}"))


@pytest.mark.parametrize("port", ["+0", " 0", "0_0"])
async def test_listen_refuses_a_port_int_alone_takes(port: str) -> None:
    # Before: Agent(listen="127.0.0.1:+0") listened on a free port.
    with pytest.raises(ValueError, match="no valid port"):
        async with aioxfer.Agent("rv30-listen", listen=f"127.0.0.1:{port}"):
            pass

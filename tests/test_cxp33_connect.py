"""The initiator's connect path, trimmed (cxp33), its behaviour unchanged:

- A connect's PeerJoined is made only when someone hears it (Members.heard:
  a membership() iterator, or a debug line that is written): an iterator
  gets it, a debug log writes it, and a membership() opened after a connect
  nobody heard still starts with that peer.
- The Hellos a connect's first dial sends (Connector.predial) are made
  ahead, at start() and a moment after one was taken: each sent once, its
  nonce fresh; none ready, one is made then, as before.
- Yama's ptrace_scope (cma_allowed, before a same-host connect's Hello) is
  read on each call where the file is, so a scope raised at run time is
  seen; its absence is remembered (Yama is built in and set up at boot).
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import within
from test_cxc32_connect import _listener

import aioxfer
from aioxfer import connector, members, protocol
from aioxfer.discovery import PeerJoined
from aioxfer.metadata import Hello

MiB = 1 << 20


async def test_peer_joined_reaches_an_iterator(make_agent: Any) -> None:
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",))
    it = init.membership()
    assert init._membership.heard()
    peer = await within(init.connect(target.address))
    ev = await within(it.__anext__())
    assert ev == PeerJoined(target.name, target.incarnation, target.address, ("dst",))
    assert peer.name == target.name


async def test_unheard_connect_is_still_a_member_later(
    make_agent: Any, monkeypatch: Any
) -> None:
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",))
    it = init.membership()
    await it.aclose()  # an iterator closed no longer hears anything
    del it
    assert not init._membership.heard()  # (no debug log here: tests run at info)
    made: list[object] = []
    emit = members.Members.emit

    def counted(self: members.Members, ev: Any) -> None:
        made.append(ev)
        emit(self, ev)

    monkeypatch.setattr(members.Members, "emit", counted)
    await within(init.connect(target.address))
    assert made == []  # nobody heard it: none made
    late = init.membership()
    ev = await within(late.__anext__())
    assert ev == PeerJoined(target.name, target.incarnation, target.address, ("dst",))


async def test_unheard_connect_is_logged_at_debug(make_agent: Any, monkeypatch: Any) -> None:
    """A debug log written counts as someone hearing: its line stays."""
    out = io.StringIO()
    logger = structlog.wrap_logger(
        structlog.PrintLogger(out),
        wrapper_class=structlog.make_filtering_bound_logger(10),  # debug
        processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
    )
    monkeypatch.setattr(members, "_log", logger)
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",))
    assert init._membership.heard()
    await within(init.connect(target.address))
    lines = [ln for ln in out.getvalue().splitlines() if "membership.PeerJoined" in ln]
    assert len(lines) == 1 and f"peer='{target.name}'" in lines[0]


def test_ptrace_scope_read_each_time_where_yama_is(tmp_path: Path, monkeypatch: Any) -> None:
    scope = tmp_path / "ptrace_scope"
    scope.write_text("1\n")
    monkeypatch.setattr(connector, "_YAMA_SCOPE", str(scope))
    monkeypatch.setattr(connector, "_yama", None)
    assert connector._ptrace_scope() == 1
    scope.write_text("3\n")  # raised at run time: seen at the next connect
    assert connector._ptrace_scope() == 3
    if os.geteuid() != 0:
        assert not connector.cma_allowed()
    scope.write_text("junk\n")
    assert connector._ptrace_scope() == 0  # (as before: unreadable counts as none)


def test_ptrace_scope_absence_is_remembered(tmp_path: Path, monkeypatch: Any) -> None:
    scope = tmp_path / "ptrace_scope"
    monkeypatch.setattr(connector, "_YAMA_SCOPE", str(scope))
    monkeypatch.setattr(connector, "_yama", None)
    assert connector._ptrace_scope() == 0
    assert connector._yama is False
    scope.write_text("3\n")  # (cannot happen to a kernel: Yama is not loaded later)
    assert connector._ptrace_scope() == 0


def test_ptrace_scope_of_this_host() -> None:
    """What the kernel says here, as a plain read of the file says it."""
    try:
        want = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except FileNotFoundError:
        want = 0
    assert connector._ptrace_scope() == want
    assert connector._ptrace_scope() == want
    assert aioxfer is not None and pytest is not None


async def _hello_sent(init: Any, lsock: socket.socket, address: str) -> Hello:
    """connect(address) up to its Hello, read from the raw listener (which
    then goes away: the attempt fails as a dial would)."""
    loop = asyncio.get_running_loop()
    call = asyncio.ensure_future(init.connect(address))
    await asyncio.sleep(0)
    conn, _ = lsock.accept()
    with conn:
        conn.setblocking(False)
        hello = await within(protocol.recv_frame(loop, conn, protocol.MAX_HANDSHAKE_FRAME))
    lsock.close()
    with pytest.raises(aioxfer.XferError):
        await within(call)
    assert isinstance(hello, Hello)
    return hello


async def test_first_hello_made_at_start_and_sent_once(make_agent: Any) -> None:
    """start() makes the Hello the first connect's dial sends; that connect
    sends it (its nonce), and it is never sent again: the next connect's is
    another, made a moment after the first was taken."""
    init = await make_agent("init", transports=("tcp",))
    await init.start()
    made = dict(init._dialer._hellos)
    assert len(made) == 1
    ((key, (nonce, frame)),) = made.items()
    assert key == ("data", True, init._connector._data_joins())
    first = await _hello_sent(init, *_listener())
    assert first.nonce == nonce and first.meta and first.purpose == "data"
    assert first.joins == key[2] and first.name == init.name
    assert first.incarnation == init.incarnation
    await asyncio.sleep(connector._PREPARE_DELAY * 4)
    again = init._dialer._hellos.get(key)
    assert again is not None and again[0] != nonce
    second = await _hello_sent(init, *_listener())
    assert second.nonce == again[0] != first.nonce


async def test_hellos_in_a_row_are_fresh(make_agent: Any) -> None:
    """Connects in a row (made ahead or not in between): every nonce fresh."""
    init = await make_agent("init", transports=("tcp",))
    await init.start()
    nonces = set()
    for _ in range(3):
        hello = await _hello_sent(init, *_listener())
        nonces.add(hello.nonce)
    assert len(nonces) == 3


async def test_prepared_hellos_connect_for_real(make_agent: Any) -> None:
    """An agent with a unix socket made both of its first Hellos ahead (its
    peer's unix socket's, the tcp probe's): a same-host connect and a write
    go through as before."""
    target = await make_agent("target")
    dst = target.alloc(MiB, name="dst")
    init = await make_agent("init")
    await init.start()
    src = init.alloc(MiB, name="src")
    src.numpy().fill(7)
    peer = await within(init.connect(target.address))
    await within(init.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.numpy()[:4096]) == b"\x07" * 4096

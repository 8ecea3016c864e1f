"""rev16b #2: a tcp peer's background joins (Connector._join_rest) against the
rail re-dials (Rails._probe), and a join that fails with something other than
the engine refusing."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from conftest import wait_until, within

from aioxfer import protocol, serving

MiB = 1 << 20


def _join_task(agent: Any) -> asyncio.Task[None]:
    tasks = [t for t in agent._probes if t.get_name().startswith("aioxfer-join")]
    assert len(tasks) == 1, tasks
    return tasks[0]


def _join_index(sock: socket.socket) -> int:
    """The join index of the Hello waiting on sock (peeked, left there); 0:
    not a join."""
    try:
        frame = sock.recv(4 + protocol.MAX_HANDSHAKE_FRAME, socket.MSG_PEEK)
        n = int.from_bytes(frame[:4], "big")
        hello = protocol.decode_body(memoryview(frame)[4 : 4 + n])
    except Exception:
        return 0
    return int(getattr(hello, "join_index", 0)) if getattr(hello, "join", None) else 0


def _conns_to(port: int, but: set[Any]) -> list[int]:
    """This process's fds of tcp connections to 127.0.0.1:port (the
    initiator's side), except those whose local address is in but."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with contextlib.closing(s):
            try:
                if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                    continue
                if s.getpeername() == ("127.0.0.1", port) and s.getsockname() not in but:
                    fds.append(int(name))
            except OSError:
                continue
    return fds


async def test_rail_redial_during_the_joins_does_not_overfill(make_agent, monkeypatch) -> None:
    """A connection of the first rail breaks while another of its joins is
    still unanswered: the rail's re-dial must not count the join as missing
    (it dialled it too, and the rail ended with a connection more than asked
    for, up to the engine's cap of 16). With the re-dial waiting for the
    joins, the rail ends with exactly tcp_connections live."""
    held: list[tuple[Any, socket.socket, Any]] = []
    orig = serving.Server._join_now

    def hold_one_join(self: Any, sock: socket.socket, addr: Any) -> bool:
        # The last early connection (the joins are taken in their order).
        if not held and _join_index(sock) == 2:
            held.append((self, sock, addr))  # answered later, by the test
            return True
        return orig(self, sock, addr)

    monkeypatch.setattr(serving.Server, "_join_now", hold_one_join)
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    port = int(target.address.rsplit(":", 1)[1])
    init = await make_agent("init", transports=("tcp",), tcp_connections=3, rail_probe=0.02)
    peer = await within(init.connect(target.address))
    rails = init._rails
    # The first connection and one join up; the other join held.
    await wait_until(lambda: held and rails.live(peer).get(0) == 2, 10, what="one join up")
    join = _join_task(init)
    assert not join.done()
    held_local = held[0][1].getpeername()
    live = _conns_to(port, {held_local})
    assert len(live) == 2, live
    with contextlib.closing(socket.socket(fileno=os.dup(live[0]))) as s:
        s.shutdown(socket.SHUT_RDWR)  # one of the rail's live connections breaks
    await wait_until(lambda: rails.live(peer).get(0) == 1, 10, what="the rail down to one")
    await asyncio.sleep(0.3)  # the re-dial's delay (0.02 s) is long past
    server, sock, addr = held[0]
    assert orig(server, sock, addr)  # the held join answered at last
    await within(asyncio.wait([join]))
    await wait_until(lambda: not init._probes, 10, what="the re-dial ended")
    live_now = rails.live(peer)
    print(f"rail 0: {live_now.get(0)} connections live (tcp_connections 3)")
    assert live_now == {0: 3}
    assert not peer.lost


async def test_join_failing_unexpectedly_is_logged_and_topped_up(
    make_agent, capsys, monkeypatch
) -> None:
    """A join that fails with something other than the engine refusing (an
    error out of the dialer) ends the joining task without an exception left
    in it: it says so (conn.join_failed), the peer is still reported
    connected, and the rail it did not reach is re-dialled until full."""
    target = await make_agent("target", listen=["127.0.0.1:0", "127.0.0.2:0"],
                              transports=("tcp",))
    target.alloc(MiB, name="dst")
    init = await make_agent("init", transports=("tcp",), tcp_connections=2, rail_probe=0.02)
    rails = init._rails
    open_conn = rails._open_conn

    async def broken_joins(address: str, **kw: Any) -> Any:
        if kw.get("join") is not None:
            raise RuntimeError("unexpected in a join")
        return await open_conn(address, **kw)

    rails._open_conn = broken_joins
    tracked: list[asyncio.Task[None]] = []  # the joining task, made _JOIN_DELAY later
    track = type(rails).track

    def spy(self: Any, p: Any, t: asyncio.Task[None]) -> None:
        tracked.append(t)
        track(self, p, t)

    monkeypatch.setattr(type(rails), "track", spy)
    peer = await within(init.connect(target.address))
    await wait_until(lambda: bool(tracked), 10, what="the joining task made")
    join = tracked[0]
    await within(asyncio.wait([join]))
    assert not join.cancelled()
    assert join.exception() is None, join.exception()
    await wait_until(lambda: rails.live(peer) == {0: 2, 1: 2}, 10, what="both rails full")
    await wait_until(lambda: not init._probes, 10, what="the re-dial ended")
    assert all(r.up and r.connections == 2 for r in peer.statistics().rails)
    await asyncio.sleep(0.05)  # peer.connected is logged a moment later
    err = capsys.readouterr().err
    assert "conn.join_failed" in err and "unexpected in a join" in err, err
    assert "peer.connected" in err, err
    assert "rail.up" in err, err

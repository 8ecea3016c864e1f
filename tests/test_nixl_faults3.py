"""aioxfer.nixl under faults, third round: metadata loads that race each
other, and a peer that closes with a tcp WRITE in flight. Each
test here failed before the fix its docstring names."""

from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid
from typing import Any

import pytest
from test_nixl import Buf
from test_nixl_faults import BIG, big_request

import aioxfer.nixl as nixl
from aioxfer.nixl import nixl_agent, nixl_agent_config

STEP = 20.0



def _both(f: Any, g: Any) -> list[Any]:
    """f() and g() from two threads released at once; their results (or
    exceptions)."""
    out: list[Any] = [None, None]
    gate = threading.Barrier(2)

    def run(i: int, fn: Any) -> None:
        gate.wait()
        try:
            out[i] = fn()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[i] = exc

    ts = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((f, g))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(STEP)
    return out


def test_concurrent_loads_of_one_agent_make_one_record(agents: Any) -> None:
    """Two threads loading metadata of one agent at once (its full metadata
    and a partial one) each made a record of their own over the one shared
    connection; the last made replaced the other, so the agent's regions
    were those of the partial metadata alone and a list over another region
    was "not found" (NIXL merges a partial load into what it holds)."""
    a, b = agents(), agents()
    x, y = Buf(4096, 1), Buf(4096, 2)
    b.register_memory([(x.addr, 4096, 0, "")], "DRAM")
    ry = b.register_memory([(y.addr, 4096, 0, "")], "DRAM")
    full = b.get_agent_metadata()
    part = b.get_partial_agent_metadata(ry, True)
    for i in range(12):
        first, second = (full, part) if i % 2 else (part, full)
        got = _both(lambda f=first: a.add_remote_agent(f),
                    lambda s=second: a.add_remote_agent(s))
        assert got == [b.name.encode()] * 2, got
        h = a.prep_xfer_dlist(b.name, [(x.addr, 4096, 0), (y.addr, 4096, 0)], "DRAM")
        a.release_dlist_handle(h)
        a.remove_remote_agent(b.name)




def _closing_peer_main(conn: Any) -> None:
    """A peer with a large pool over tcp: closes its agent cleanly on
    "close" (its process stays), exits on "quit"."""
    os.environ["AIOXFER_NIXL_TRANSPORTS"] = "tcp"
    from aioxfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    pool = (ctypes.c_char * BIG)()
    addr = ctypes.addressof(pool)
    agent.register_memory([(addr, BIG, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), addr))
    while True:
        msg = conn.recv()
        if msg == "close":
            agent.close()
            conn.send("closed")
        else:
            conn.send("bye")
            return


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_peer_closing_with_a_tcp_transfer_in_flight_is_a_disconnect(
        op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer process closing its agent (clean close, process alive) right
    after a 64 MiB tcp request was posted to it: the request ends with
    nixlRemoteDisconnectError (or ERR), as for any peer that went away; a
    WRITE ended with nixlBackendError (its memory "deregistered by its
    owner"), which NIXL users do not take for a peer that left."""
    from conftest import PipeChild

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")
    child = PipeChild(_closing_peer_main, seconds=STEP)
    md, raddr = child.hello
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    try:
        h, rname, _buf = big_request(a, md, raddr, op, 64)
        st = a.transfer(h)
        assert child.call("close") == "closed"
        deadline = time.monotonic() + STEP
        try:
            while st == "PROC":
                st = a.check_xfer_state(h)
                assert time.monotonic() < deadline, "stuck in PROC"
        except nixl.nixlRemoteDisconnectError:
            st = "raised"
        assert st in ("raised", "ERR", "DONE"), st
        a.release_xfer_handle(h)
        a.remove_remote_agent(rname)
    finally:
        a.close()
        child.close()

"""aioxfer.nixl under faults: hostile metadata, a listener that never
answers, notifications whose transfer failed half-way. Each test here failed
before the fix it names in its docstring."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from test_nixl import Buf, _wait

import aioxfer.nixl as nixl
from aioxfer.nixl import _wire, nixl_agent, nixl_agent_config

STEP = 20.0
NIXL_ERRORS = (nixl.nixlInvalidParamError, nixl.nixlNotFoundError, nixl.nixlBackendError,
               nixl.nixlMismatchError)


@pytest.fixture
def agents() -> Iterator[Any]:
    made: list[nixl_agent] = []

    def make(**conf: Any) -> nixl_agent:
        a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(**conf))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


@pytest.mark.parametrize("addr,nbytes,dev", [
    (2**64 - 16, 64, 0),  # the range wraps past 2**64
    (4096, -1, 0),  # negative length
    (-4096, 64, 0),  # negative address
    (4096, 64, -1),  # negative device
])
def test_hostile_region_values_in_metadata_are_a_typed_error(agents: Any, addr: int, nbytes: int,
                                                             dev: int) -> None:
    """Metadata whose region does not fit 64 bits (values a peer controls)
    was loaded as it was; preparing a list against it then raised numpy's
    OverflowError, untyped."""
    a = agents()
    md = _wire.encode_md(_wire.AgentMD("hostile", regions=[
        _wire.RegionMD("r0", int(nixl.DRAM_SEG), addr, nbytes, dev)]))
    descs = a.get_xfer_descs([(4096, 64, 0)], "DRAM")
    with pytest.raises(NIXL_ERRORS):
        a.add_remote_agent(md)
        a.prep_xfer_dlist("hostile", descs)


def _notifs(agent: Any, want: int) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + STEP
    while len(got) < want:
        assert time.monotonic() < deadline, f"got {len(got)} of {want} notifications"
        for msgs in agent.get_new_notifs().values():
            got.extend(msgs)
    return got


def test_a_framed_notification_whose_write_failed_does_not_corrupt_the_next(
        agents: Any) -> None:
    """A notification over 4 KiB goes in fragments, the last one carried by
    the WRITE; when the WRITE failed, the fragments already delivered stayed
    with the receiver and were glued in front of the sender's next large
    message (which then arrived corrupted)."""
    a, b = agents(), agents()
    x, y = Buf(4096, 1), Buf(4096, 2)
    ra = a.register_memory([(x.addr, 4096, 0, "")], "DRAM")
    rb = b.register_memory([(y.addr, 4096, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.addr, 4096, 0)], "DRAM"),
                          b.get_xfer_descs([(y.addr, 4096, 0)], "DRAM"), b.name)
    b.deregister_memory(rb)  # the WRITE below fails at b
    first = b"1" * 10000
    with pytest.raises(NIXL_ERRORS + (nixl.nixlRemoteDisconnectError,)):
        a.transfer(h, first)
        _wait(a, h)
    a.release_xfer_handle(h)
    second = b"2" * 10000
    a.send_notif(b.name, second)
    assert _notifs(b, 1) == [second]
    a.deregister_memory(ra)


def test_a_listener_that_never_answers_leaves_no_socket_after_close(agents: Any) -> None:
    """fetch_remote_metadata from a listener that accepts and then says
    nothing waited for its answer for ever (no bound on the read), and the
    agent's close left that wait and its socket open."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(STEP)
    try:
        a = agents()
        a.fetch_remote_metadata("nobody", "127.0.0.1", srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            a.close()
            conn.settimeout(5.0)
            while conn.recv(1 << 16):  # the request, then the end of it
                pass
    finally:
        srv.close()

"""The RDMA verbs transport beyond the conformance suite (which runs whole over
"verbs" with the software provider): what this machine's real libibverbs
reports, how agents choose and advertise verbs, the registration cache as
peers see it, rails between agents with different device counts, and real
devices where there are some (skipped elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import numpy as np
import pytest
from conftest import SAME_HOST, digest, pattern, within

import aioxfer
from aioxfer import TransportError, _cyx, auth
from aioxfer import verbs as axverbs

MiB = 1 << 20

_built = "not built" not in _cyx.verbs_probe(None)[2]
_real_devices = _built and _cyx.verbs_probe(None)[0] > 0
needs_build = pytest.mark.skipif(not _built, reason="verbs not built (no libibverbs headers)")
real_rdma = pytest.mark.skipif(not _real_devices, reason="no RDMA device on this machine")
no_real_rdma = pytest.mark.skipif(_real_devices, reason="this machine has RDMA devices")


@pytest.fixture
def libibverbs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real libibverbs, whatever the environment says."""
    monkeypatch.delenv(axverbs.PROVIDER_ENV, raising=False)


def test_status_with_the_real_libibverbs(libibverbs: None) -> None:
    ok, why = axverbs.status()
    names = axverbs.devices()
    assert ok == bool(names)
    if not _built:
        assert not ok and "not built" in why
    elif not ok:
        # This machine and CI: a kernel without InfiniBand (ENOSYS) is "no
        # devices", or rdma-core is not installed; never an exception.
        assert "no RDMA devices" in why or "cannot load" in why or "none usable" in why, why
    else:
        assert all("port" in n for n in names)


@needs_build
@no_real_rdma
async def test_default_agent_without_devices_has_no_verbs(libibverbs: None, make_agent) -> None:
    agent = await make_agent("plain")
    assert "verbs" not in agent.transports
    assert agent._localmeta.meta().verbs_devices == []
    region = agent.register(bytearray(4096), name="r")
    assert agent._localmeta.meta().regions[0].verbs == [] and region.rid


@no_real_rdma
def test_forced_verbs_without_devices_raises(libibverbs: None) -> None:
    with pytest.raises(TransportError, match="verbs"):
        aioxfer.Agent("forced", transports=("verbs",))


async def test_provider_devices_and_metadata(verbs_provider: str, make_agent) -> None:
    ok, why = axverbs.status()
    assert ok and "softverbs" in why
    assert len(axverbs.devices()) == 2
    agent = await make_agent("advertiser")
    assert "verbs" in agent.transports
    buf = np.zeros(MiB, dtype=np.uint8)
    a = agent.register(buf, name="a")
    agent.register(buf, name="b")  # the same range: the same registrations
    ro = agent.register(bytes(4096), name="ro")
    meta = agent._localmeta.meta()
    assert len(meta.verbs_devices) == 2
    keys = {r.name: r.verbs for r in meta.regions}
    assert len(keys["a"]) == 2 and all(addr == a.addr for addr, _ in keys["a"])
    assert keys["a"] == keys["b"]
    assert keys["ro"] != keys["a"] and len(keys["ro"]) == 2
    agent.deregister(a)
    assert {r.name: r.verbs for r in agent._localmeta.meta().regions}["b"] == keys["b"]
    assert ro.nbytes == 4096


async def test_same_host_stays_off_verbs(verbs_provider: str, make_agent) -> None:
    """verbs is enabled on both, but between same-host agents shm (cuda where
    both have CUDA) is chosen; with shm left out, verbs is (over tcp)."""
    target = await make_agent("target")
    init = await make_agent("init")
    assert (await within(init.connect(target.address))).path == SAME_HOST
    init2 = await make_agent("init2", transports=("tcp", "verbs"))
    target2 = await make_agent("target2", transports=("tcp", "verbs"))
    peer = await within(init2.connect(target2.address))
    assert peer.path == "verbs"
    dst = target2.register(bytearray(2 * MiB), name="dst")
    await within(peer.refresh())
    data = pattern(2 * MiB, 3)
    src = init2.register(data)
    res = await within(init2.write(src[0:2 * MiB], peer.region("dst")[0:2 * MiB]))
    assert res.path == "verbs" and res.nbytes == 2 * MiB
    assert bytes(dst.memoryview) == data.tobytes()


async def test_fewer_devices_on_one_side(verbs_provider: str, make_agent, remote_agent,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer with one device and us with two: one rail (device 0 to device
    0); data moves both ways between processes."""
    size = 8 * MiB
    monkeypatch.setenv("AXF_SOFTVERBS_DEVICES", "1")
    ra = await remote_agent(size=size, transports=("verbs",))
    monkeypatch.setenv("AXF_SOFTVERBS_DEVICES", "2")
    init = await make_agent("init", transports=("verbs",))
    assert len(init._localmeta.meta().verbs_devices) == 2
    peer = await within(init.connect(ra.address))
    assert peer.path == "verbs"
    data = pattern(size, 7)
    src = init.register(data)
    res = await within(init.write(src[0:size], peer.region("user")[0:size]), 30)
    assert res.nbytes == size and res.path == "verbs"
    assert await ra.call("digest", "user", 0, size) == digest(data)
    back = init.register(bytearray(size))
    await within(init.read(back[0:size], peer.region("user")[0:size]), 30)
    assert bytes(back.memoryview) == data.tobytes()


@real_rdma
async def test_real_devices_write_read(libibverbs: None, make_agent) -> None:
    """Hardware only: two agents on this host over its RDMA devices (loopback
    through the NIC), 16 MiB both ways, checked byte for byte."""
    size = 16 * MiB
    target = await make_agent("target", transports=("verbs",))
    init = await make_agent("init", transports=("verbs",))
    dst = target.register(bytearray(size), name="dst")
    peer = await within(init.connect(target.address))
    assert peer.path == "verbs"
    data = pattern(size, 11)
    src = init.register(data)
    await within(init.write(src[0:size], peer.region("dst")[0:size], notify=b"done"), 30)
    assert (await within(target.notifications.receive())).payload == b"done"
    assert bytes(dst.memoryview) == data.tobytes()
    back = init.register(bytearray(size))
    await within(init.read(back[0:size], peer.region("dst")[0:size]), 30)
    assert bytes(back.memoryview) == data.tobytes()
    assert os.environ.get(axverbs.PROVIDER_ENV) is None


@pytest.mark.parametrize("qps", [
    [],  # none
    [(1, 1, 5, 0, 1, 0, bytes(16))] * 3,  # more than the server's devices
    [(1, 1, 9, 0, 1, 0, bytes(16))],  # MTU out of range
    [(1 << 30, 1, 5, 0, 1, 0, bytes(16))],  # QPN out of range
    [(1, 1, 5, 0, 1, 0, bytes(4))],  # a short GID
    [(1, 1, 5, 0, 1, 0, bytes(16))],  # well formed, but no such queue pair anywhere
])
async def test_bad_queue_pair_exchange_is_refused(verbs_provider: str, make_agent,
                                                  qps: list[tuple[Any, ...]]) -> None:
    """Queue pair parameters come from the network: whatever a client sends,
    the server refuses or accepts it without harm (the fixture fails the test
    on any loop exception), and serves well-behaved peers afterwards."""
    from aioxfer.metadata import VerbsConnect, VerbsQP
    from aioxfer.protocol import client_handshake, send_frame

    target = await make_agent("target", transports=("verbs",))
    loop = asyncio.get_running_loop()
    host, port = target.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setblocking(False)
    try:
        await within(client_handshake(loop, sock, name="rogue", incarnation=1, purpose="verbs",
                                      token=auth.hmac_key(auth.default_token())))
        await send_frame(loop, sock, VerbsConnect(qps=[VerbsQP(*q) for q in qps]))
        # Refused: the server closes; accepted (the last case): nothing moves.
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(0.5):
                await loop.sock_recv(sock, 1 << 16)
    finally:
        sock.close()
    init = await make_agent("init", transports=("verbs",))
    dst = target.register(bytearray(MiB), name="dst")
    peer = await within(init.connect(target.address))
    data = pattern(MiB, 5)
    await within(init.write(init.register(data)[0:MiB], peer.region("dst")[0:MiB]))
    assert bytes(dst.memoryview) == data.tobytes()


def test_qp_parameters_checked_both_ways(verbs_provider: str) -> None:
    """The queue pair parameters a peer sends may say its link layer, GID type
    and READ depth (10 fields; 7 from a peer that does not): a peer on another
    link layer or GID type is refused at connect, not left to time out."""
    a, b = _cyx.Engine(), _cyx.Engine()
    try:
        assert a.verbs_enable(verbs_provider)[0] > 0 and b.verbs_enable(verbs_provider)[0] > 0
        ep = a.endpoint_create(_cyx.EP_VERBS, 1, 0)
        full = a.verbs_qp_create(ep, 0)
        assert len(full) == 10 and full[7:] == (2, 3, 16)  # softverbs: RoCE v2, READ depth 16
        mine = full[:7]
        handle, theirs = b.verbs_accept_qp(0, mine)  # 7 fields: not said, accepted
        assert len(theirs) == 10
        b.verbs_qp_destroy(handle)
        handle, _ = b.verbs_accept_qp(0, full)  # what a peer of ours sends
        b.verbs_qp_destroy(handle)
        for bad in ((*mine, 1, 3, 16), (*mine, 2, 2, 16)):  # InfiniBand; RoCE v1
            with pytest.raises(_cyx.NativeError) as err:
                b.verbs_accept_qp(0, bad)
            assert err.value.status == _cyx.E_TRANSPORT
    finally:
        a.close()
        b.close()

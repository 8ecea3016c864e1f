"""Hardening against untrusted peers and careless ones (issue 9).

Real processes throughout: a victim process that must stay byte for byte
untouched, fake peers that lie in their metadata (also as another user,
``nobody``), SIGSTOPped initiators, floods bounded in count and time.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap

import msgspec
import pytest
from conftest import SAME_HOST, sigstop, wait_until, within

import aioxfer
from aioxfer import AccessDenied, ProtocolError, XferError, auth, local, metadata, protocol

MiB = 1 << 20
NOBODY = 65534
HDR = struct.Struct("<IHHiIQQQQQQ")
MAGIC = 0x31465841
F_NOTIFY = 5

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (other-uid processes)")


# --------------------------------------------------------------- a victim process

VICTIM = textwrap.dedent(
    """
    import ctypes, hashlib, json, os, sys, tempfile
    buf = bytearray(os.urandom(1 << 20))
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    fd, path = tempfile.mkstemp(prefix="aioxfer-victim-")
    os.write(fd, bytes(buf[:65536]))
    print(json.dumps({"pid": os.getpid(), "addr": addr, "nbytes": len(buf), "fd": fd,
                      "path": path, "digest": hashlib.sha256(buf).hexdigest()}), flush=True)
    for line in sys.stdin:
        print(hashlib.sha256(buf).hexdigest(), flush=True)
    """
)


class Victim:
    """An unrelated process of this user: a 1 MiB buffer and an open file."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.pid, self.addr, self.nbytes = info["pid"], info["addr"], info["nbytes"]
        self.fd, self.path, self.start = info["fd"], info["path"], info["digest"]
        with open(self.path, "rb") as f:
            self.file_start = f.read()

    def memory_digest(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def untouched(self) -> bool:
        with open(self.path, "rb") as f:
            return self.memory_digest() == self.start and f.read() == self.file_start

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.unlink(self.path)


@pytest.fixture
def victim():
    v = Victim()
    try:
        yield v
    finally:
        v.close()


@pytest.mark.parametrize("as_nobody", [False, True], ids=["same-uid", "nobody"])
async def test_lying_peer_cannot_aim_us_at_another_process(
    make_agent, remote_agent, victim, as_nobody, capsys
) -> None:
    """A fake agent advertising a victim's pid, a buffer address in it and its
    uid: our copies go only where the kernel says the peer is."""
    lie = {"pid": victim.pid, "addr": victim.addr, "nbytes": victim.nbytes, "uid": 0}
    opts: dict = {"size": victim.nbytes, "lie": lie, "token": auth.default_token().decode()}
    if as_nobody:
        opts["as_uid"] = NOBODY
    fake = await remote_agent(**opts)
    agent = await make_agent("honest")
    peer = await within(agent.connect(fake.address))
    # Another user never gets the same-host path, whatever it claims.
    assert peer.path == ("tcp" if as_nobody else SAME_HOST)
    assert peer.pid in (0, fake.pid)
    src = agent.register(bytearray(b"\xee" * victim.nbytes))
    dst = agent.register(bytearray(victim.nbytes))
    for region in ("pool", "user"):
        rr = peer.region(region)
        for t in (agent.write(src[0:4096], rr[0:4096]), agent.read(dst[0:4096], rr[0:4096])):
            try:
                await within(t)
            except XferError:
                pass  # refused is fine; touching the victim is not
    assert victim.untouched(), "the victim's memory or file changed"
    assert bytes(dst.memoryview[:4096]) != victim.file_start[:4096]
    if as_nobody:
        assert "local.refused" in capsys.readouterr().err


async def test_other_user_refused_on_unix_socket(make_agent, remote_agent) -> None:
    """The unix socket refuses another uid before any handshake, even with the token."""
    target = await make_agent("target")
    target.alloc(MiB, name="dst")
    ra = await remote_agent(as_uid=NOBODY, token=auth.default_token().decode())
    path = await ra.call("connect", target.address)
    assert path == "tcp"


async def test_default_agents_refuse_other_users(make_agent, remote_agent, tmp_path) -> None:
    """Secure by default: a process of another user without our token gets
    neither the metadata nor the memory; agents of one user need no setup."""
    target = await make_agent("target")  # default arguments
    dst = target.alloc(MiB, name="dst")
    before = bytes(dst.memoryview)
    ra = await remote_agent(as_uid=NOBODY, token="a-guess")
    with pytest.raises(Exception, match="AccessDenied"):
        await ra.call("connect", target.address)
    loop = asyncio.get_running_loop()
    host, port = target.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setblocking(False)
    with sock, pytest.raises(AccessDenied):
        await within(protocol.fetch_meta(loop, sock, name="snoop", incarnation=1, token=None))
    assert bytes(dst.memoryview) == before
    # Same user, defaults on both sides: connects with no configuration.
    friend = await make_agent("friend")
    peer = await within(friend.connect(target.address))
    assert peer.path == SAME_HOST


def test_token_file_is_private(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    os.chmod(tmp_path, 0o700)
    tok = auth.default_token()
    path = auth.token_path()
    assert path.parent == tmp_path / "aioxfer"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(path.parent).st_mode & 0o777) == "0o700"
    assert auth.default_token() == tok and len(tok) >= 32
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):
        auth.default_token()
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.default_token() == b"from-env"


def test_insecure_needs_its_name() -> None:
    with pytest.raises(ValueError):
        aioxfer.Agent("x", token="t", insecure_no_auth=True)


# --------------------------------------------------------------- sealed pools


async def test_alloc_pools_are_sealed(make_agent) -> None:
    agent = await make_agent("a")
    pool = agent.alloc(MiB, name="pool")
    seals = fcntl.fcntl(pool._memfd, fcntl.F_GET_SEALS)
    assert seals & local.REQUIRED_SEALS == local.REQUIRED_SEALS
    with pytest.raises(OSError):
        os.ftruncate(pool._memfd, 0)  # what a hostile peer holding it would try


def test_unsealed_memfd_refused() -> None:
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, MiB)
        assert local.check_sealed(fd, MiB) is not None
        local.seal(fd)
        assert local.check_sealed(fd, MiB) is None
        assert local.check_sealed(fd, 2 * MiB) is not None  # smaller than claimed
    finally:
        os.close(fd)
    with open(__file__, "rb") as f:  # not a memfd at all
        assert local.check_sealed(f.fileno(), 1) is not None


# --------------------------------------------------------------- release means released


async def test_deregister_waits_for_a_stopped_same_host_peer(make_agent, remote_agent) -> None:
    """A stopped initiator keeps its mapping: its closed socket does not
    release our memory; its exit does."""
    target = await make_agent("target", peer_timeout=0.5, keepalive=0.1)
    pool = target.alloc(4 * MiB, name="dst")
    ra = await remote_agent(size=4 * MiB, peer_timeout=0.5, keepalive=0.1)
    assert await ra.call("connect", target.address) == SAME_HOST
    await ra.call("flood", target.address, "pool", "dst", 4 * MiB)
    assert target.statistics().native_conns == 1
    sigstop(ra.pid)
    try:
        # Past peer_timeout the target drops its socket (its connection
        # closed: waited for, not slept past).
        await wait_until(lambda: target.statistics().native_conns == 0, 10,
                         what="the stopped peer's connection dropped")
        released = target.deregister(pool)
        await asyncio.sleep(1.0)
        assert not released.done(), "released while a stopped peer still maps the memory"
        assert target.statistics().native_regions >= 1  # quarantined, not freed
    finally:
        ra.kill()  # SIGKILL: gone for good (pidfd readable)
    await within(released, 10)


async def test_deregister_completes_when_peers_acknowledge(make_agent, remote_agent) -> None:
    target = await make_agent("target")
    pool = target.alloc(MiB, name="dst")
    ra = await remote_agent(size=MiB)
    assert await ra.call("connect", target.address) == SAME_HOST
    await within(target.deregister(pool), 10)
    assert target.deregister(pool).done()  # idempotent


async def test_unacknowledging_tcp_peer_is_cut_off(make_agent) -> None:
    """A tcp peer that never acknowledges a revocation is disconnected after
    revoke_timeout; then the memory is released."""
    target = await make_agent("target", limits=aioxfer.Limits(revoke_timeout=1.0))
    region = target.register(bytearray(MiB), name="dst")
    sock = await _data_connection(target.address)  # reads nothing, acknowledges nothing
    with sock:
        await wait_until(lambda: target.statistics().native_conns == 1, 5)
        released = target.deregister(region)
        await asyncio.sleep(0.3)
        assert not released.done()
        await within(released, 10)
    assert target.statistics().native_conns == 0


async def test_aclose_names_the_peer_it_gave_up_on(remote_agent, capsys) -> None:
    target = aioxfer.Agent("target", peer_timeout=0.5, keepalive=0.1,
                           limits=aioxfer.Limits(close_timeout=1.0))
    await target.start()
    target.alloc(MiB, name="dst")
    ra = await remote_agent(size=MiB, name="sleeper", peer_timeout=0.5, keepalive=0.1)
    try:
        assert await ra.call("connect", target.address) == SAME_HOST
        await ra.call("flood", target.address, "pool", "dst", MiB)
        sigstop(ra.pid)
        await asyncio.sleep(1.0)
        t0 = asyncio.get_running_loop().time()
        await within(target.aclose(), 10)
        assert asyncio.get_running_loop().time() - t0 < 5
        err = capsys.readouterr().err
        assert "agent.close_gave_up" in err and "sleeper" in err
    finally:
        ra.kill()


# --------------------------------------------------------------- bounded queues


def _rss_kib(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _data_connection(address: str) -> socket.socket:
    loop = asyncio.get_running_loop()
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await within(loop.sock_connect(sock, (host, int(port))))
    await within(protocol.client_handshake(loop, sock, name="flooder", incarnation=9,
                                           purpose="data",
                                           token=auth.hmac_key(auth.default_token())))
    return sock


async def test_notification_flood_pushes_back(make_agent) -> None:
    """Notifications nobody takes: the agent stops reading that connection at
    the bound; none is lost once the application takes them."""
    cap = 64
    target = await make_agent("target", limits=aioxfer.Limits(max_notify_per_conn=cap))
    sock = await _data_connection(target.address)
    payload = b"n" * 4096
    sent = 0
    loop = asyncio.get_running_loop()
    with sock:
        # Send until the kernel buffers are full (the agent stopped reading):
        # one send that has not gone out within a second (a send takes
        # microseconds while the agent reads), bounded at 5 s in all, so a
        # sender that never feels backpressure still runs to 5 s, as before
        # (it waited the whole 5 s every time). Each with a request id of its
        # own, as a real sender (a repeated id is a copy resent after a rail
        # failed: delivered once).
        deadline = loop.time() + 5
        try:
            while (left := deadline - loop.time()) > 0:
                one = HDR.pack(MAGIC, F_NOTIFY, 0, 0, 0, sent + 1, 0, 0, 0, 0,
                               len(payload)) + payload
                async with asyncio.timeout(min(left, 1.0)):
                    await loop.sock_sendall(sock, one)
                sent += 1
        except TimeoutError:
            pass
        await asyncio.sleep(0.2)
        assert len(target.notifications) <= cap, len(target.notifications)
        assert sent < 100_000, "sender never felt backpressure"
        got = 0
        async with asyncio.timeout(20):
            while got < sent:
                await target.notifications.receive()
                got += 1
    assert got == sent


async def challenged_then_cut_off(loop: asyncio.AbstractEventLoop, s: socket.socket) -> None:
    """The agent's Challenge (it speaks first, before reading a byte), then
    the end of the connection: nothing else."""
    chal = await within(protocol.recv_frame(loop, s), 5)
    assert isinstance(chal, metadata.Challenge)
    assert await within(loop.sock_recv(s, 1), 5) == b""


async def test_handshakes_are_capped(make_agent) -> None:
    target = await make_agent("target", peer_timeout=1.0,
                              limits=aioxfer.Limits(max_handshakes=8))
    target.alloc(MiB, name="dst")
    host, port = target.address.rsplit(":", 1)
    # A client announcing a frame bigger than a handshake is cut off at once.
    loop = asyncio.get_running_loop()
    s = socket.create_connection((host, int(port)))
    s.setblocking(False)
    with s:
        await loop.sock_sendall(s, struct.pack(">I", protocol.MAX_HANDSHAKE_FRAME + 1))
        await challenged_then_cut_off(loop, s)
    silent = [socket.create_connection((host, int(port))) for _ in range(64)]
    try:
        await asyncio.sleep(0.3)
        assert len(target._serving) <= 8
    finally:
        for s in silent:
            s.close()
    # Once the silent ones are gone, a real agent connects. Gone means
    # accepted too: closed ones still in the accept queue would be accepted
    # together with the friend's connections, 8 of them would take every
    # handshake slot until they read their EOF, and the friend's would be
    # refused (the cap working as meant). The queue is first in, first out:
    # once a marker dialled after them is answered (cut off, as the oversized
    # frame above; or refused over the cap), every one before it was accepted.
    await _accepted_up_to_here(host, int(port))
    await wait_until(lambda: len(target._serving) == 0, 5)
    friend = await make_agent("friend")
    await within(friend.connect(target.address))


async def _accepted_up_to_here(host: str, port: int) -> None:
    """Returns once the listener at host:port accepted every connection made
    before this call (a marker connection made now has been answered)."""
    loop = asyncio.get_running_loop()
    s = socket.create_connection((host, port))
    s.setblocking(False)
    with s:
        try:
            await loop.sock_sendall(s, struct.pack(">I", protocol.MAX_HANDSHAKE_FRAME + 1))
            await challenged_then_cut_off(loop, s)
        except ConnectionError:  # refused over the cap: accepted, then closed (reset)
            pass


async def test_deeply_nested_msgpack_is_a_protocol_error(make_agent, capsys) -> None:
    target = await make_agent("target")
    body = b"\x91" * 4000 + b"\xc0"  # 4000 nested one-element arrays
    with pytest.raises(ProtocolError):
        protocol.decode_body(body)
    loop = asyncio.get_running_loop()
    host, port = target.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.setblocking(False)
    with s:
        await loop.sock_sendall(s, struct.pack(">I", len(body)) + body)
        await challenged_then_cut_off(loop, s)
    assert "conn.rejected" in capsys.readouterr().err


def test_metadata_out_of_range_is_typed() -> None:
    good = {"name": "r", "rid": 1, "key": 2, "nbytes": 3, "access": 3, "addr": 4}
    enc = msgspec.msgpack.encode
    for bad in ({"rid": -1}, {"access": 9}, {"addr": (1 << 64) - 2, "nbytes": 16},
                {"verbs": [(1, 1 << 40)]}):
        body = enc({**good, **bad})
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(body, type=metadata.RegionMeta)
    meta = metadata.AgentMeta(version=2, name="x", incarnation=1, host_id="h", pid=1,
                              address="a:1", transports=["tcp"], regions=[],
                              rails=["a:1"] * 17)
    with pytest.raises(ProtocolError):
        protocol.decode_body(protocol.encode_frame(meta)[4:])
    huge = msgspec.json.encode({"rid": 1 << 70, "name": "r", "key": 0, "nbytes": 0,
                                "access": 0, "addr": 0})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(huge, type=metadata.RegionMeta)


async def test_large_metadata_is_served(make_agent) -> None:
    """20 000 regions (well over the old 1 MiB frame) reach a peer."""
    target = await make_agent("target")
    buf = bytearray(20_000 * 64)
    mv = memoryview(buf)
    for i in range(20_000):
        target.register(mv[i * 64:(i + 1) * 64], name=f"r{i}")
    init = await make_agent("init")
    peer = await within(init.connect(target.address), 30)
    assert len(peer.regions) == 20_000


async def test_advertised_rails_are_capped(make_agent) -> None:
    """A peer advertising 1000 rails makes us dial at most max_rails of them."""
    counter = socket.socket()
    counter.bind(("127.0.0.1", 0))
    counter.listen(4096)
    counter.setblocking(False)
    third_party = f"127.0.0.1:{counter.getsockname()[1]}"
    target = await make_agent("target", transports=("tcp",))
    target.alloc(MiB, name="dst")
    real = target._localmeta.meta_with

    def many_rails(memfd):
        m = real(memfd)
        return msgspec.structs.replace(m, rails=[m.address] + [third_party] * 15)

    target._localmeta.meta_with = many_rails
    init = await make_agent("init", transports=("tcp",), rail_probe=0.2,
                            limits=aioxfer.Limits(max_rails=3))
    await within(init.connect(target.address))
    dialled = 0
    loop = asyncio.get_running_loop()
    try:
        # 1.5 s (was 3 s): the first dials of all 15 advertised rails (the
        # cap's bug) are 14 * 4 > 40 at once; re-dials every 0.2 s without
        # backing off are > 40 in 1.5 s too.
        async with asyncio.timeout(1.5):
            while True:
                s, _ = await loop.sock_accept(counter)
                s.close()
                dialled += 1
    except TimeoutError:
        pass
    counter.close()
    # Rails 1 and 2 (of 3) point at the third party; their connections and the
    # probes' re-dials (backing off from 0.2 s) stay few.
    assert dialled <= 2 * 4 * 5, dialled


# --------------------------------------------------------------- nothing left behind


async def test_connect_kill_cycles_leave_nothing(make_agent, remote_agent) -> None:
    target = await make_agent("target", peer_timeout=1.0)
    target.alloc(MiB, name="dst")
    for _ in range(3):
        ra = await remote_agent(size=MiB)
        assert await ra.call("connect", target.address) == SAME_HOST
        ra.kill()
        ra.terminate()
    await wait_until(lambda: target.statistics().native_conns == 0, 10)
    await wait_until(lambda: not len(target._tags), 5)  # every peer tag released


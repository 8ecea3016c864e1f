"""A same-host connect dials the peer's address-named unix socket directly
(aioxfer.local.local_name_for), skipping the tcp probe; whoever else holds
that name cannot stop the connect nor pass for the peer."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import SAME_HOST, within

from aioxfer import auth, dialing, local
from aioxfer.connector import cma_allowed

NOBODY = 65534

pytestmark = pytest.mark.skipif(not cma_allowed(), reason="no cross-memory attach here")


def _free_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def _name(address: str) -> str:
    # (the agent's key, as an agent computes the name)
    return local.local_name_for(auth.hmac_key(auth.default_token()), address, os.geteuid())


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The addresses each tcp probe (Dialer.open_meta) went to."""
    seen: list[str] = []
    real = dialing.Dialer.open_meta

    async def counting(self, address, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(address)
        return await real(self, address, *args, **kwargs)

    monkeypatch.setattr(dialing.Dialer, "open_meta", counting)
    return seen


async def test_direct_path_skips_the_tcp_probe(make_agent, probes) -> None:
    target = await make_agent("target")
    dst = target.alloc(4096, name="dst")
    agent = await make_agent("init")
    peer = await within(agent.connect(target.address))
    assert peer.path == SAME_HOST and peer.name == target.name
    assert probes == [], "the tcp probe ran: the direct unix socket was not taken"
    src = agent.register(bytearray(b"\x5a" * 4096))
    await within(agent.write(src[0:4096], peer.region("dst")[0:4096]))
    assert bytes(dst.memoryview) == b"\x5a" * 4096


class _Squatter:
    """Holds the direct name of an address before the agent there starts:
    accepts and then says nothing ("silent") or answers garbage."""

    def __init__(self, name: str, mode: str) -> None:
        self.sock = local.listen_abstract(name)
        self.mode = mode
        self.conns: list[socket.socket] = []
        self.task: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            self.conns.append(conn)
            if self.mode == "garbage":
                await loop.sock_sendall(conn, b"\xff" * 64 + b"not an aioxfer agent\n")

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.parametrize("mode", ["silent", "garbage"])
async def test_squatter_on_the_name_does_not_stop_the_connect(make_agent, probes, mode) -> None:
    address = _free_address()
    squat = _Squatter(_name(address), mode)
    squat.task = asyncio.get_running_loop().create_task(squat.serve())
    try:
        target = await make_agent("target", listen=address, peer_timeout=30.0)
        dst = target.alloc(4096, name="dst")
        agent = await make_agent("init", peer_timeout=30.0)
        # Falls back to the probe within the direct bound (1 s), long before
        # the 30 s peer timeout.
        peer = await within(agent.connect(address), 10)
        assert peer.name == target.name and peer.path == SAME_HOST
        assert probes == [address]
        assert squat.conns, "the squatter was never dialled"
        src = agent.register(bytearray(b"\x33" * 4096))
        await within(agent.write(src[0:4096], peer.region("dst")[0:4096]))
        assert bytes(dst.memoryview) == b"\x33" * 4096
    finally:
        squat.close()


async def test_impostor_agent_on_the_name_is_not_taken_for_the_peer(make_agent, probes) -> None:
    """Another agent of ours serving the name (its handshake and memfds all
    sound) is refused: its metadata does not list the dialled address."""
    address = _free_address()
    sock = local.listen_abstract(_name(address))
    impostor = await make_agent("impostor")
    serving = asyncio.get_running_loop().create_task(
        impostor._server.accept_loop(asyncio.get_running_loop(), sock, local=True)
    )
    try:
        target = await make_agent("target", listen=address)
        target.alloc(4096, name="dst")
        agent = await make_agent("init")
        peer = await within(agent.connect(address))
        assert peer.name == target.name, "the impostor passed for the peer"
        assert probes == [address]
    finally:
        serving.cancel()
        sock.close()


# Started as root, then dropped to nobody (which cannot exec this venv's python).
DROP = "import os, socket, sys; os.setgroups([]); os.setresgid(65534, 65534, 65534); "\
    "os.setresuid(65534, 65534, 65534)\n"

NOBODY_SQUAT = DROP + textwrap.dedent(
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\\0" + sys.argv[1])
    s.listen(8)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        c.sendall(b"\\xff" * 64)
    """
)

NOBODY_DIAL = DROP + textwrap.dedent(
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect("\\0" + sys.argv[1])
    got = b""
    try:  # closed on at once: the send may already fail
        s.sendall(b"\\0" * 64)
        while chunk := s.recv(4096):
            got += chunk
    except (BrokenPipeError, ConnectionResetError):
        pass
    print(len(got), flush=True)
    """
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (an other-uid process)")


@needs_root
async def test_other_user_squatter_is_refused(make_agent, probes) -> None:
    """A nobody process holding the name: refused by SO_PEERCRED, the connect
    takes the probe and reaches the real peer."""
    address = _free_address()
    proc = subprocess.Popen([sys.executable, "-c", NOBODY_SQUAT, _name(address)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        target = await make_agent("target", listen=address)
        target.alloc(4096, name="dst")
        agent = await make_agent("init")
        peer = await within(agent.connect(address))
        assert peer.name == target.name and peer.path == SAME_HOST
        assert probes == [address]
    finally:
        proc.kill()
        proc.wait()


@needs_root
async def test_other_user_dialling_the_name_is_refused(make_agent, capsys) -> None:
    """A nobody process that dials the name (it is guessable without a
    token) is closed on before any byte of the handshake."""
    target = await make_agent("target")
    name = _name(target.address)
    loop = asyncio.get_running_loop()
    out = await within(loop.run_in_executor(None, lambda: subprocess.run(
        [sys.executable, "-c", NOBODY_DIAL, name], capture_output=True, text=True, timeout=30,
    )))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "the agent answered another user on its direct name"
    await asyncio.sleep(0.1)
    assert f"uid {NOBODY} is not this agent's user" in capsys.readouterr().err


async def test_fallback_probe_still_joins_its_challenge(make_agent, probes) -> None:
    """With the direct name taken, the same-host connect is the probe's as
    before: its unix-socket connection joins the probe's Challenge (index 1)."""
    token = b"conn12-token"
    address = _free_address()
    squat = _Squatter(local.local_name_for(auth.hmac_key(token), address, os.geteuid()),
                      "garbage")
    squat.task = asyncio.get_running_loop().create_task(squat.serve())
    try:
        target = await make_agent("target", listen=address, token=token)
        target.alloc(4096, name="dst")
        agent = await make_agent("init", token=token)
        peer = await within(agent.connect(address))
        assert peer.path == SAME_HOST and probes == [address] and squat.conns
        assert target._server.joins.joined == 1
    finally:
        squat.close()

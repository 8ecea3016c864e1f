"""obj31: a server's keep-alive idle close racing the first bytes of a PUT.

A server closes a kept-alive connection it found idle (its idle timeout:
nginx 75 s, some S3 gateways 5 s or less) while our next request on that
connection is already under way: its FIN is still on the wire when the
request's first write goes out (tests/test_rev33_idle_close.py is the case
where the FIN was already in our kernel: refused unsent there). The
server's kernel answers the request's bytes with a reset, its socket being
closed: nothing of the request reached the server. Before, a single PUT
of ours failed so as "outcome unknown" (a HEAD found nothing, and it was
not sent again: TransportError) though nothing of it had reached the
server; now it is sent again, once, at once: the connection's TCP_INFO
proves that the server's kernel acknowledged none of its bytes before the
connection was reset.

A real server (rclone serve s3) behind a relay on a thread that closes a
client connection idle for IDLE seconds (rclone serve s3 has no idle
timeout flag under a minute). On loopback a FIN takes no time on the wire:
the race's window (the FIN on its way while the request is written) is
made by holding the loop, once, right after the request's check of its
pooled connection (objects._tcp_info's first call for that request), past
the relay's idle close.
"""

from __future__ import annotations

import gc
import os
import select
import socket
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from conftest import pattern, within
from s3server import S3Server, server

from aioxfer.backends import objects
from aioxfer.errors import TransportError

pytest.importorskip("obstore")

MakeAgent = Callable[..., Awaitable[Any]]
MiB = 1 << 20
IDLE = 0.3  # the relay's idle timeout


class IdleRelay:
    """A relay on a thread in front of ``target``: a client connection with
    no byte either way for ``idle`` seconds is closed (a FIN: every byte
    it had was read). Counts connections and request heads going up."""

    def __init__(self, target: S3Server, idle: float) -> None:
        self.target = target
        self.idle = idle
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.lsock.getsockname()[1])
        self.connections = 0
        self.idle_closes = 0
        self.puts = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def kwargs(self) -> dict[str, str]:
        return {**self.target.kwargs(), "endpoint": f"http://127.0.0.1:{self.port}"}

    def close(self) -> None:
        self._stop = True
        self.lsock.close()
        for t in [self._accepting, *self._threads]:
            t.join(5)

    def _accept(self) -> None:
        self.lsock.settimeout(0.05)
        while not self._stop:
            try:
                conn, _ = self.lsock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.target.port))
        last = time.monotonic()
        try:
            while not self._stop:
                ready, _, _ = select.select([client, up], [], [], 0.01)
                if not ready:
                    if time.monotonic() - last > self.idle:
                        self.idle_closes += 1
                        return
                    continue
                for s in ready:
                    data = s.recv(1 << 20)
                    if not data:
                        return
                    if s is client:
                        # (the bodies are random bytes: "PUT /" at random
                        # in them is a chance of about 2e-6 per MiB)
                        self.puts += data.count(b"PUT /")
                        up.sendall(data)
                    else:
                        client.sendall(data)
                    last = time.monotonic()
        except OSError:
            pass
        finally:
            client.close()
            up.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def relay(s3: S3Server) -> Iterator[IdleRelay]:
    r = IdleRelay(s3, IDLE)
    try:
        yield r
    finally:
        r.close()


def hold_after_check(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Arms a hold: the next request's check of its connection
    (objects._tcp_info's first call) answers what it saw, then holds the
    loop past the relay's idle close. Returns the flag (False once used)."""
    real = objects._tcp_info
    armed = [False]

    def held(sock: Any) -> bytes | None:
        got = real(sock)
        if armed[0]:
            armed[0] = False
            time.sleep(IDLE + 0.3)  # the loop held: the FIN "on the wire"
        return got

    monkeypatch.setattr(objects, "_tcp_info", held)
    return armed


@pytest.mark.parametrize("n", [2 * MiB, 12 * MiB], ids=["2MiB", "12MiB"])
async def test_put_racing_an_idle_close(make_agent: MakeAgent, s3: S3Server,
                                        relay: IdleRelay, monkeypatch: pytest.MonkeyPatch,
                                        n: int) -> None:
    # failed before: TransportError "write of object 'k1' ...: the PUT's
    # outcome is unknown (Server disconnected) and the object is not there
    # with these bytes; not sent again ..."
    # (12 MiB: a body from the caller's buffer, not the owned copy)
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), max_retries=0,
                                  part_size=16 * MiB)
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 31)
    await within(agent.write(src[:], objs["k0"]), 30)
    armed = hold_after_check(monkeypatch)
    src.numpy()[:] = pattern(n, 32)
    armed[0] = True
    await within(agent.write(src[:], objs["k1"]), 30)
    assert not armed[0], "the hold was not reached"
    assert relay.idle_closes >= 1
    assert relay.connections == 2  # the first attempt's, and the resend's
    # The first attempt's bytes never reached the server: two PUTs came
    # through, one per key, none twice.
    assert relay.puts == 2
    assert s3.file(bucket, "t/k1").read_bytes() == bytes(src.numpy())
    assert "Deleted" not in s3.log_tail()


async def test_race_twice_fails_typed(make_agent: MakeAgent, s3: S3Server, relay: IdleRelay,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The resend is one: a write whose resend meets the same race fails (the
    # retry budget, max_retries=0 here, then decides), typed, nothing stored.
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), max_retries=0)
    n = 2 * MiB
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 33)
    await within(agent.write(src[:], objs["k0"]), 30)
    real = objects._tcp_info
    holds = [2]  # the first attempt's check, and the resend's

    def held(sock: Any) -> bytes | None:
        got = real(sock)
        if holds[0] and got is not None and got[0] == 1:  # ESTABLISHED: a request's check
            holds[0] -= 1
            time.sleep(IDLE + 0.3)
        return got

    monkeypatch.setattr(objects, "_tcp_info", held)
    with pytest.raises(TransportError, match="none of the request reached it"):
        await within(agent.write(src[:], objs["k1"]), 30)
    assert holds[0] == 0
    assert relay.puts == 1  # k0's: neither attempt of k1 reached the server
    assert not s3.file(bucket, "t/k1").exists()


async def test_multipart_part_racing_an_idle_close(make_agent: MakeAgent, s3: S3Server,
                                                   relay: IdleRelay,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A part's request meets the same race (its connection pooled from the
    # create's): sent again at once, outside the budget (max_retries=0)
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    objs = agent.register_objects(f"s3://{bucket}/t", **relay.kwargs(), max_retries=0,
                                  part_size=5 * MiB)
    n = 5 * MiB + 4096  # two parts
    src = agent.alloc(n)
    src.numpy()[:] = pattern(n, 34)
    await within(agent.write(src[:], objs["k0"]), 30)
    armed = hold_after_check(monkeypatch)
    src.numpy()[:] = pattern(n, 35)
    armed[0] = True
    await within(agent.write(src[:], objs["k1"]), 60)
    assert not armed[0], "the hold was not reached"
    assert relay.idle_closes >= 1
    assert s3.file(bucket, "t/k1").read_bytes() == bytes(src.numpy())


def sockets_open() -> set[str]:
    """This process's socket descriptors (as their inode names)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (the listing's own)
        if target.startswith("socket:"):
            out.add(f"{fd}:{target}")
    return out


async def test_no_descriptor_left(make_agent: MakeAgent, s3: S3Server) -> None:
    # The probe (a duplicate of each request's socket descriptor) is closed
    # with its request, not left to the garbage collector (a ResourceWarning,
    # and its connection held open until then); once the region is closed,
    # no socket more than before
    bucket = s3.bucket("t")
    agent = await make_agent("o")
    fds0 = sockets_open()
    objs = agent.register_objects(f"s3://{bucket}/t", **s3.kwargs(), part_size=5 * MiB)
    n = 6 * MiB
    src = agent.alloc(n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for i in range(4):
            await within(agent.write(src[:], objs[f"m{i}"]), 60)  # multipart: 2 parts
            await within(agent.write(src[:2 * MiB], objs[f"s{i}"]), 60)  # a PUT of ours
        await within(objs.aclose(), 30)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [
        str(w.message) for w in caught]
    assert sockets_open() <= fds0, sockets_open() - fds0

"""The rest of an answer begun in the accepting step is checked before it goes.

Server._answer_now (cxs32) answers a same-host client's handshake as the
connection is accepted: our Accept, the metadata snapshot, META_GO. When
the socket takes only part of it, a serving task sends the rest. That task
starts a loop step (or more) after the snapshot was taken: regions may be
deregistered meanwhile, exactly as when a send waited, so the snapshot must
be checked against our regions before its memfds and META_GO go out
(_send_meta's rule, tests/test_rev29_metafds). Here the deregistration
slips in before the task's first send, while the client drains what it got;
the task's first send then takes all the rest at once. On 9eb5b8e8 the
rest, META_GO included, went out unchecked: the client was told the
connection is ready with a region that is gone (and on the unix socket a
memfd number since closed, maybe reused, would have been passed as its).
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
import termios
from typing import Any

import pytest
from conftest import wait_until, within
from test_cxs32_answer_now import _client, _where

import aioxfer.serving as serving
from aioxfer.protocol import encode_frame


def _unsent(sock: socket.socket) -> int:
    """Bytes we sent on sock that its reader has not taken yet (SIOCOUTQ)."""
    return int(struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0\0\0\0"))[0])


async def test_rest_checked_when_the_task_sends_it_at_once(make_agent: Any,
                                                           monkeypatch: Any) -> None:
    b = await make_agent("b")
    where = _where(b, "unix")
    # Metadata somewhat over a unix socket's send buffer (~208 KiB): the
    # accepting step sends part of it, the rest fits once the client drained.
    keep = [b.register(bytearray(64), name=f"r{i}") for i in range(4500)]
    gone = b.register(bytearray(64), name="gone")
    size = len(encode_frame(b._localmeta.local()[0]))
    seen: dict[str, int] = {}
    serve = serving.Server._serve

    async def late(server: Any, loop: Any, sock: socket.socket, addr: Any, *,
                   answered: Any = None, **k: Any) -> None:
        # (The real serving task, started a little later: what any other
        # callback of the loop may do before its first step.)
        if answered is not None:
            seen["left"] = len(answered[1].data)
            await b.deregister(gone)
            await wait_until(lambda: _unsent(sock) == 0, what="the client drained")
        await serve(server, loop, sock, addr, answered=answered, **k)

    monkeypatch.setattr(serving.Server, "_serve", late)
    got = await within(_client("slow", where, b._token), 60)
    if "left" not in seen:
        pytest.skip(f"the socket took all {size} bytes at once: no task sent the rest")
    if seen["left"] > size - seen["left"]:
        pytest.skip(f"{seen['left']} of {size} bytes left: more than one send takes")
    # The snapshot (naming "gone") went out, then the connection closed
    # instead of META_GO.
    assert "gone" in got.get("regions", ["gone"]), sorted(got)
    assert got.get("go") is not True, (
        "META_GO sent after a region of the snapshot was deregistered")
    del keep


# A "meta" reader (a same-host peer's refresh) in its own process: Hello,
# Proof, then it waits (the answer fills the socket), then reads the
# snapshot and its memfds and prints the memfds' inodes.
_META_READER = r'''
import json, os, socket, sys, time
from aioxfer import protocol
from aioxfer.local import local_address
from aioxfer.metadata import Accept, AgentMeta, Challenge, Proof

name, key = sys.argv[1], bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(local_address(name))


def exact(n):
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise EOFError
        out += got
    return out


def frame():
    return protocol.decode_body(exact(int.from_bytes(exact(4), "big")))


nonce, f = protocol._hello(name="rv32-reader", incarnation=7, purpose="meta", token=key)
s.sendall(f)
ch = frame()
assert isinstance(ch, Challenge), ch
s.sendall(protocol.encode_frame(Proof(proof=protocol.client_proof(
    key, ch.nonce, nonce, "rv32-reader"))))
time.sleep(0.3)
assert isinstance(frame(), Accept)
meta = frame()
assert isinstance(meta, AgentMeta)
n = sum(1 for r in meta.regions if r.memfd >= 0)
fds = []
try:
    while len(fds) < n:
        _, got, _, _ = socket.recv_fds(s, 1, n - len(fds))
        if not got:
            break
        fds += got
except OSError:
    pass
print(json.dumps({"named": n, "inodes": [os.fstat(fd).st_ino for fd in fds]}))
'''


async def test_meta_rest_never_passes_a_reused_fd(make_agent: Any, monkeypatch: Any) -> None:
    """tests/test_rev29_metafds's case, its reader in another process (the
    accepting step answers it, cxs32): a region deregistered before the
    task sends the rest, its memfd's number reused by our next region: the
    reader must never get that region's memfd as the gone one's."""
    b = await make_agent("b")
    where = _where(b, "unix")
    keep = [b.register(bytearray(64), name=f"r{i}") for i in range(4500)]
    gone = b.alloc(4096, name="gone")
    number = gone._memfd
    state: dict[str, int] = {}
    serve = serving.Server._serve

    async def late(server: Any, loop: Any, sock: socket.socket, addr: Any, *,
                   answered: Any = None, **k: Any) -> None:
        if answered is not None:
            state["left"] = len(answered[1].data)
            await b.deregister(gone)
            other = b.alloc(4096, name="other")
            state["reused"] = other._memfd == number
            state["ino"] = os.fstat(other._memfd).st_ino
            await wait_until(lambda: _unsent(sock) == 0, what="the reader drained")
        await serve(server, loop, sock, addr, answered=answered, **k)

    monkeypatch.setattr(serving.Server, "_serve", late)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _META_READER, where.partition(":")[2], b._token.hex(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
    )
    out, err = await within(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    got = json.loads(out.decode().strip().splitlines()[-1])
    if "left" not in state:
        pytest.skip("the socket took the whole answer at once: no task sent the rest")
    if not state["reused"]:
        pytest.skip(f"fd {number} was not reused: nothing to show")
    assert got["named"] == 1  # (the snapshot names "gone" only)
    assert state["ino"] not in got["inodes"], (
        "the answer passed another region's memfd as the deregistered one's")
    del keep

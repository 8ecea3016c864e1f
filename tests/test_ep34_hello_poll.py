"""A same-host client's Hello that lands after its unix socket was accepted
is still answered early (ep34).

A unix socket's accept is ready as the client connects, before its Hello is
sent (there is no TCP_DEFER_ACCEPT there): ep33's accepting step found no
Hello then, greeted the client with the ordinary Challenge, and its early
proof cost the Proof round after all. The accepting step now polls such a
connection (a client of another process, on the unix socket) for its Hello
a bounded while before it greets it. Each client here is another process,
speaking the protocol with blocking sockets and the protocol module's own
frames; it sends its Hello only once the server's accepting step peeked and
found nothing (the test's gate), so the Hello lands after the accept every
time. What must hold: that Hello is taken early (Challenge ``early`` and the
proved Accept together, no Proof); a client that sends nothing is polled for
once, within the bound, and then served as any other (the ordinary
Challenge, its Proof round in a task), never polled twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import wait_until, within

import aioxfer.serving as serving
from aioxfer import protocol
from aioxfer.protocol import HANDSHAKE_SPIN_NS

# The client: argv = name (the unix socket's), key (hex), mode. "late":
# connects, waits for a line on stdin, then sends an early Hello and reads
# the answer; "mute": connects, waits for a line on stdin (sent once the
# server greeted it), then sends its early Hello and answers as a client
# without an early answer would (its Proof). Prints one JSON line.
_CLIENT = r'''
import json, socket, sys
from aioxfer import protocol
from aioxfer.local import local_address
from aioxfer.metadata import Accept, AgentMeta, Challenge, Proof

name, key, mode = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]


def exact(s, n):
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def frame(s):
    n = int.from_bytes(exact(s, 4), "big")
    return protocol.decode_body(exact(s, n))


s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(local_address(name))
out = {}
if mode == "mute":
    ch = frame(s)  # (greeted before we sent anything)
    out["greeted_first"] = isinstance(ch, Challenge) and not ch.early
# Made before the gate: sent the moment it opens (the server polls ~1 ms
# for it; a cold _hello made after the gate could outlast that under load).
nonce, f = protocol._hello(name="ep34-client", incarnation=11, purpose="data", token=key,
                           meta=True, to=s)
out["proved"] = bool(protocol.decode_body(memoryview(f)[4:]).early_proof)
sys.stdin.readline()
s.sendall(f)
if mode == "late":
    ch = frame(s)
assert isinstance(ch, Challenge), ch
out["early"] = ch.early
if not ch.early:
    s.sendall(protocol.encode_frame(Proof(proof=protocol.client_proof(
        key, ch.nonce, nonce, "ep34-client"))))
acc = frame(s)
assert isinstance(acc, Accept), acc
out["accept_proved"] = acc.proof == protocol.server_proof(key, nonce, ch.nonce)
meta = frame(s)
out["meta"] = isinstance(meta, AgentMeta)
print(json.dumps(out))
'''


class _Gate:
    """The client process, and its gate: released (a line on its stdin)
    when the server's accepting step first peeks its socket and finds
    nothing (mode "late"), or when the server greeted it (mode "mute")."""

    def __init__(self, name: str, key: bytes, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, name, key.hex(), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
        )
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            assert self.proc.stdin is not None
            # (a blocking write of a line into an empty pipe: never waits)
            os.write(self.proc.stdin.fileno(), b"go\n")

    async def result(self) -> dict[str, Any]:
        # (not communicate(): it closes the client's stdin, the gate, at once)
        def wait() -> tuple[bytes, bytes]:
            assert self.proc.stdout is not None and self.proc.stderr is not None
            out = self.proc.stdout.read()
            err = self.proc.stderr.read()
            self.proc.wait()
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            return out, err

        out, err = await within(asyncio.to_thread(wait), 60)
        assert self.proc.returncode == 0, err.decode()
        got: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        return got


def _name(agent: Any) -> str:
    if not agent._accept_msg.local:
        pytest.skip("no same-host unix socket here")
    name: str = agent._accept_msg.local
    return name


def _count_serves(monkeypatch: Any) -> list[int]:
    """Counts the connections left to a serving task (Server._serve's
    calls) from now on: the one-element list's value."""
    served = [0]
    serve = serving.Server._serve

    async def counted(server: Any, *a: Any, **k: Any) -> None:
        served[0] += 1
        await serve(server, *a, **k)

    monkeypatch.setattr(serving.Server, "_serve", counted)
    return served


async def test_a_hello_after_the_accept_is_answered_early(make_agent: Any,
                                                          monkeypatch: Any) -> None:
    """The Hello is sent only once the accepting step found none: polled
    for (the bound made long here, so that the client process's start of
    its send cannot miss it), it is taken early, no Proof round, no task."""
    b = await make_agent("b")
    b.alloc(1 << 20, name="pool")
    monkeypatch.setattr(serving, "handshake_spin_ns", lambda loop, sock: 20 * 10**9)
    gate: list[_Gate] = []
    peeked = protocol._peeked

    def peek(sock: Any) -> Any:
        got = peeked(sock)
        if got is None and gate:
            gate[0].release()  # (nothing there yet: now the client sends)
        return got

    monkeypatch.setattr(protocol, "_peeked", peek)
    served = _count_serves(monkeypatch)
    gate.append(_Gate(_name(b), b._token, "late"))
    got = await gate[0].result()
    assert gate[0].released  # (the Hello did land after the accept)
    assert got == {"proved": True, "early": True, "accept_proved": True, "meta": True}
    assert b._server.early.taken == 1
    assert served[0] == 0


async def test_a_client_that_sends_nothing_is_polled_for_once(make_agent: Any,
                                                              monkeypatch: Any) -> None:
    """A unix client that sends nothing: polled for its Hello at most the
    bound (HANDSHAKE_SPIN_NS), then greeted with the ordinary Challenge and
    left to a serving task, not polled again for its Proof; its early Hello,
    sent after that Challenge, is not taken (the Proof round)."""
    b = await make_agent("b")
    b.alloc(1 << 20, name="pool")
    answer_polls: list[int] = []
    answer_now = serving.server_answer_now

    def polled(*a: Any, **k: Any) -> Any:
        answer_polls.append(k["spin_ns"])
        return answer_now(*a, **k)

    monkeypatch.setattr(serving, "server_answer_now", polled)
    served = _count_serves(monkeypatch)
    client = _Gate(_name(b), b._token, "mute")
    await wait_until(lambda: served[0] == 1, what="the silent client left to a task")
    debt = b._server._spin_debt
    assert 0 < debt
    client.release()
    got = await client.result()
    assert got == {"greeted_first": True, "proved": True, "early": False,
                   "accept_proved": True, "meta": True}
    assert answer_polls == []  # (polled for its Hello, not again for its Proof)
    assert b._server.early.taken == 0
    assert b._server._spin_debt <= debt  # (nothing polled after the greeting)
    assert HANDSHAKE_SPIN_NS > 0

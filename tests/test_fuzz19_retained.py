"""What the compat metadata exchange's errors keep, and whether the fuzz
harness of its wire format leaks (fuzz19).

fuzz_nixl_wire's RSS grew 75 -> 657 MB over 2.1 M runs (fuzz18), here
75 -> 1,033 MB in 95 k runs (atheris, 75 s), while fuzz17's harness stayed
at 75 MB on the same code: inputs read through the listener's connection
with a proved length (up to 64 MiB) left reference cycles (the harness kept
an exception whose traceback held its own frame), each pinning that read's
whole buffer until a full collection. The listener's own path keeps none
(below: N connections with the cyclic collector off); an error kept by
whoever caught it (a task, a log record) kept the read's whole zero-filled
buffer (_ListenConn.readexactly) or, for a client request (_request), what
the listener had sent."""

from __future__ import annotations

import asyncio
import gc
import socket
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioxfer.nixl import _bindings, _wire

ROOT = Path(__file__).resolve().parent.parent
STEP = 20.0
MiB = 1 << 20


class _NoCycles:
    """Traced memory with the cyclic collector off: what only reference
    counting frees is freed; what a cycle holds stays and is counted."""

    def __enter__(self) -> _NoCycles:
        gc.collect()
        self.was = gc.isenabled()
        gc.disable()
        tracemalloc.start()
        self.base = tracemalloc.get_traced_memory()[0]
        return self

    def grown(self) -> int:
        return int(tracemalloc.get_traced_memory()[0] - self.base)

    def __exit__(self, *exc: object) -> None:
        tracemalloc.stop()
        if self.was:
            gc.enable()
        gc.collect()


# ---------------------------------------------------------------- the harness


def _harness() -> Any:
    fuzz = str(ROOT / "fuzz")
    if fuzz not in sys.path:
        sys.path.insert(0, fuzz)
    import fuzz_nixl_wire

    return fuzz_nixl_wire


def test_the_nixl_wire_harness_keeps_nothing_per_input() -> None:
    """Inputs of the harness's mode 4 that prove a length of 8 MiB (bit 3)
    and are read through _ListenConn as well (bit 5): with the cyclic
    collector off, 10 of them leave under 1 MiB (before: 8 MiB each)."""
    h = _harness()
    h.load()
    # (Each: the length, its genuine MAC from the harness, 100 bytes of a
    # body that never finishes.)
    data = bytes([4 | 8 | 32 | 3 << 6]) + (8 * MiB).to_bytes(4, "big") + b"b" * 100
    assert h.check(data) is None
    with _NoCycles() as m:
        for _ in range(10):
            assert h.check(data) is None
        grown = m.grown()
    assert grown < MiB, f"10 inputs left {grown / MiB:.1f} MiB held by cycles"


# ---------------------------------------------------------------- the listener's path


def _proving_client(port: int, token: bytes, n: int) -> None:
    """A token holder that proves a length of n, sends 10 bytes of the body
    and closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=STEP) as s:
        nonce = s.recv(_wire.LISTEN_NONCE, socket.MSG_WAITALL)
        head = n.to_bytes(4, "big")
        s.sendall(head + _wire.listen_len_mac(token, nonce, head) + b"x" * 10)
        s.shutdown(socket.SHUT_WR)
        while s.recv(4096):  # until the listener closes its side
            pass


def test_the_listener_keeps_nothing_of_cut_requests(agents: Any) -> None:
    """The listener's path itself, N times, collector off: 20 token holders
    that each prove 8 MiB and stop after 10 bytes (the listener allocates
    the 8 MiB once proved) leave under 1 MiB. (A guard: this held before
    too; the harness's cycles were its own.)"""
    t = agents(enable_listen_thread=True, listen_port=0)
    port, token = t.agent.listen_port, t.agent._listen_token()
    _proving_client(port, token, 8 * MiB)  # (what is made once: made)
    with _NoCycles() as m:
        for _ in range(20):
            _proving_client(port, token, 8 * MiB)
        deadline = time.monotonic() + STEP
        while t.agent._listen_conns:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        grown = m.grown()
    assert grown < MiB, f"20 cut requests left {grown / MiB:.1f} MiB"


def test_a_kept_incomplete_read_error_keeps_only_what_came(agents: Any) -> None:
    """_ListenConn.readexactly (the listener's, and _request's through
    _ReplyConn) over a real socket: 32 MiB asked, 10 bytes sent, closed.
    The IncompleteReadError, kept, holds those 10 bytes, not the read's
    32 MiB buffer (before: its traceback kept the frame that held it)."""
    core = agents().agent
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(STEP)
    port = srv.getsockname()[1]

    async def read() -> BaseException:
        _, conn = await asyncio.get_running_loop().create_connection(
            _bindings._ReplyConn, "127.0.0.1", port)
        try:
            await conn.readexactly(32 * MiB)
        except asyncio.IncompleteReadError as exc:
            return exc
        finally:
            conn.close()
        raise AssertionError("read 32 MiB of 10 bytes")

    try:
        with _NoCycles() as m:
            fut = asyncio.run_coroutine_threadsafe(read(), core._rt.loop)
            c, _ = srv.accept()
            c.sendall(b"x" * 10)
            c.close()
            kept = fut.result(STEP)
            del fut
            grown = m.grown()
    finally:
        srv.close()
    assert isinstance(kept, asyncio.IncompleteReadError) and kept.partial == b"x" * 10
    assert grown < MiB, f"a kept IncompleteReadError held {grown / MiB:.1f} MiB"


# ---------------------------------------------------------------- a client request's error

# A listener (another process) that takes a request and answers with the
# length of an 8 MiB reply, 1 MiB of it, then closes (argv[1] "close") or
# waits (argv[1] "stall").
_CUT = r"""
import socket, sys, time
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept()
    c.sendall(b"AXNL" + int(sys.argv[2]).to_bytes(2, "big") + b"n" * 10)  # our version's
    head = c.recv(36, socket.MSG_WAITALL)
    n = int.from_bytes(head[:4], "big") + 32
    while n > 0:
        n -= len(c.recv(min(n, 1 << 16)))
    c.sendall((8 << 20).to_bytes(4, "big") + b"r" * (1 << 20))
    if sys.argv[1] == "close":
        c.close()
"""


@pytest.fixture
def cut_listener(request: pytest.FixtureRequest) -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", _CUT, request.param,
                             str(_wire.WIRE_VERSION)], cwd="/",
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.parametrize("cut_listener, error", [("close", ConnectionError),
                                                 ("stall", TimeoutError)],
                         indirect=["cut_listener"], ids=["closed", "stalled"])
def test_a_failed_requests_error_keeps_nothing_of_the_reply(
        agents: Any, monkeypatch: pytest.MonkeyPatch, cut_listener: int,
        error: type[Exception]) -> None:
    """A Fetch whose reply stops after 1 MiB of 8 (closed, or stalled past
    the timeout): the error, kept, holds none of that MiB (before: the
    IncompleteReadError's partial, or the stream's buffer through the
    timeout's context)."""
    monkeypatch.setattr(_bindings, "_CONNECT_TIMEOUT", 1.0)
    core = agents().agent

    async def fetch() -> BaseException:
        try:
            await core._request("127.0.0.1", cut_listener, _wire.Fetch(name="x"))
        except Exception as exc:
            return exc
        raise AssertionError("a cut reply read whole")

    with _NoCycles() as m:
        kept = core._rt.run(fetch(), timeout=STEP)
        time.sleep(0.1)  # (the socket closed at the loop's next turn)
        grown = m.grown()
    assert grown < MiB // 4, f"a kept {type(kept).__name__} held {grown / MiB:.2f} MiB"
    assert isinstance(kept, error), repr(kept)

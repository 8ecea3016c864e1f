"""A lone 64 KiB READ's response arriving in pieces (read21).

The thread awaiting a lone READ on a loopback connection copies the
response's payload as it arrives (conn.c help_more): it takes the header
(after checking it against the request, as the receiver would), copies the
bytes that are there, and peeks again for the rest; when no byte comes for a
while (or the awaiting thread stops spinning) it hands the socket back
to the receiver, which reads the rest of that same frame. Each piece must
land at its own offset in the destination, nothing outside it may be written,
and a peer that dies between two pieces must fail the request with a typed
error or reroute it with the right bytes.

The target is a real agent behind a proxy on loopback (read20's harness,
tests/test_read20_hostile_resp.py) that holds back the third 64 KiB READ
response and sends it as header + first bytes, a pause, then the rest (or
closes the connection instead). The payload is a pattern of bytes
0x80-0xbc, with a period (61) that never lines up with the piece boundaries,
so a piece copied to the wrong offset shows; it never looks like a header.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import pytest
from conftest import within
from test_read20_hostile_resp import HDR, SIZE, Proxy

import aioxfer

KiB = 1 << 10


def pattern() -> np.ndarray:
    return (np.arange(SIZE) % 61 + 0x80).astype(np.uint8)


class PiecesProxy(Proxy):
    """Sends the ``nth`` 64 KiB READ response in pieces: its header and
    ``first`` payload bytes, ``pause`` seconds later the rest (or, with
    ``die``, nothing more: the connection is cut)."""

    def __init__(self, target: str, nth: int, first: int, pause: float, die: bool) -> None:
        super().__init__(target, "pieces", nth)
        self.first, self.pause, self.die = first, pause, die

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, tamper: bool) -> None:
        buf = bytearray()
        try:
            while True:
                b = await self._read(r, w, buf)
                if not b:
                    break
                if not tamper or self.done.is_set():
                    w.write(b)
                    await w.drain()
                    continue
                buf += b
                out = self._scan(buf)
                if isinstance(out, bytes):
                    w.write(out)
                    await w.drain()
                    continue
                head, resp, rest = out
                cut = HDR.size + self.first
                w.write(head + resp[:cut])
                await w.drain()
                await asyncio.sleep(self.pause)
                if self.die:
                    w.transport.abort()
                    return
                w.write(resp[cut:] + rest)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    def _scan(self, buf: bytearray):  # type: ignore[override]
        # read20's scan finds the nth response whole; it hands it back here.
        saved, self.mode = self.mode, "extra-bytes"
        try:
            seen = self.seen
            out = super()._scan(buf)  # the nth: header + payload + 4 KiB of 0x22 + rest
        finally:
            self.mode = saved
        if not self.done.is_set() or self.seen == seen or out is None:
            return out
        i = out.find(b"\x22" * (4 * KiB), HDR.size + SIZE - 1)
        whole = out[:i] + out[i + 4 * KiB:]  # undo the extra bytes
        start = i - HDR.size - SIZE
        assert whole[start:start + 6] == out[start:start + 6] and start >= 0
        return whole[:start], whole[start:start + HDR.size + SIZE], whole[start + HDR.size + SIZE:]


class ProxyThread:
    """The proxy on its own thread and event loop: the test's loop is then
    free to await each READ alone (its thread spins for the response and
    reads it: the path under test), not busy forwarding its bytes."""

    def __init__(self, proxy: PiecesProxy) -> None:
        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _run(make_agent, capsys, first: int, pause: float, die: bool) -> None:
    target = await make_agent("target", transports=("tcp",))
    src = target.alloc(SIZE, name="src")
    src.numpy()[:] = pattern()
    proxy = PiecesProxy(target.address, nth=3, first=first, pause=pause, die=die)
    pt = ProxyThread(proxy)
    addr = await asyncio.to_thread(pt.call, proxy.start())
    try:
        init = await make_agent("init", transports=("tcp",))
        local = init.alloc(4 * SIZE, name="dst")
        guard = np.frombuffer(bytes(range(256)) * (4 * SIZE // 256), dtype=np.uint8)
        peer = await within(init.connect(addr))
        dst = local[SIZE:2 * SIZE]
        err: BaseException | None = None
        for k in range(5):
            local.numpy()[:] = guard
            try:
                await within(init.read(dst, peer.region("src")[0:SIZE]), 10)
            except aioxfer.XferError as e:  # typed, and promptly (within)
                err = e
                break
            got = local.numpy()
            assert np.array_equal(got[SIZE:2 * SIZE], pattern()), f"READ {k}: wrong bytes"
            assert np.array_equal(got[:SIZE], guard[:SIZE])
            assert np.array_equal(got[2 * SIZE:], guard[2 * SIZE:])
        assert proxy.done.is_set(), "the proxy never saw the response it splits"
        got = local.numpy()
        assert np.array_equal(got[:SIZE], guard[:SIZE])
        assert np.array_equal(got[2 * SIZE:], guard[2 * SIZE:])
        if not die:
            assert err is None, err
            return
        # Cut mid-payload: the endpoint lost (a typed error), or that rail
        # (the READ rerouted, its bytes checked above).
        logged = ""
        whys = ("peer.lost", "broken or silent", "connection lost")
        for _ in range(100):
            logged += capsys.readouterr().err
            if any(w in logged for w in whys):
                break
            await asyncio.sleep(0.05)
        assert any(w in logged for w in whys) or err is not None, logged
    finally:
        await asyncio.to_thread(pt.close)


@pytest.mark.parametrize("first", [1, 4 * KiB + 3, SIZE // 2, SIZE - 1])
@pytest.mark.parametrize("pause", [0.0, 0.02])
async def test_response_in_pieces_lands_in_place(make_agent, capsys, first: int,
                                                 pause: float) -> None:
    await _run(make_agent, capsys, first, pause, die=False)


@pytest.mark.parametrize("first", [0, 4 * KiB + 3, SIZE - 1])
async def test_peer_dies_between_pieces(make_agent, capsys, first: int) -> None:
    await _run(make_agent, capsys, first, 0.02, die=True)

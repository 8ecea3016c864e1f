"""A target that answers a lone 64 KiB READ wrongly (read20).

A lone READ's response up to 64 KiB on a loopback connection is read by the
thread awaiting it (conn.c help_takes / help_read), which now also waits for
a payload still coming instead of handing the socket to the receiver. Every
byte from the network is untrusted: a response whose length is not what the
request asked for, one carrying more bytes than it says, or a peer that dies
in the middle of the payload must end the request with a typed error and a
logged reason, and write nothing outside the destination.

The hostile target is a real agent behind a proxy on loopback that forwards
every connection byte for byte and rewrites the target's third 64 KiB
READ response (the first ones are answered honestly, so that the awaiting
thread reads the later ones: the receiver parks for it after one). Frames
are found by their header (magic, READ_RESP type, 64 KiB length): the
payloads are filled with 0x11 bytes, which never look like a header.
"""
from __future__ import annotations

import asyncio
import contextlib
import struct

import numpy as np
import pytest
from conftest import within
from test_security import HDR, MAGIC

import aioxfer

KiB = 1 << 10
SIZE = 64 * KiB
F_READ_RESP = 4
LEN_AT = HDR.size - 8  # the header's last field: the payload's length
PATTERN = struct.pack("<IH", MAGIC, F_READ_RESP)
HOLD_S = 0.05  # a held-back tail that may begin a header, at most (Proxy._read)


class Proxy:
    """Forwards connections to ``target``; in the target -> client direction
    the ``nth`` 64 KiB READ response (counted over all connections) is
    rewritten by ``mode``."""

    def __init__(self, target: str, mode: str, nth: int) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.mode, self.nth = mode, nth
        self.seen = 0
        self.done = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self.server.close()
        for w in self.writers:
            w.close()
        for t in self.tasks:  # each ends at its connection's close
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(t), 5)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection(self.host, self.port)
        self.writers += [cw, tw]
        self.tasks += [asyncio.create_task(self._pipe(cr, tw, tamper=False)),
                       asyncio.create_task(self._pipe(tr, cw, tamper=True))]

    async def _read(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                    buf: bytearray) -> bytes:
        """r's next bytes. A tail _scan held back only because it may begin
        a header (shorter than one's first bytes) goes on when nothing follows
        within HOLD_S: handshake frames end in random bytes (the server's
        Challenge in its nonce, since protocol 4), and one ending like a
        header's first byte (1 in 256) would otherwise wait for bytes its
        sender never sends: it waits for the answer (the connect then timed out)."""
        while True:
            if not buf or len(buf) >= len(PATTERN):
                return await r.read(1 << 16)
            try:
                return await asyncio.wait_for(r.read(1 << 16), HOLD_S)
            except TimeoutError:
                w.write(bytes(buf))
                buf.clear()
                await w.drain()

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
                if out is None:  # the peer "dies" here
                    w.write(bytes(buf))
                    await w.drain()
                    w.transport.abort()
                    return
                w.write(out)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    def _scan(self, buf: bytearray) -> bytes | None:
        """What of buf can go on now (the rest waits for more bytes); None:
        send buf's bytes so far and cut the connection."""
        i = buf.find(PATTERN)
        # A header may straddle reads: hold back a tail that begins one.
        keep = len(buf)
        for n in range(min(len(PATTERN) - 1, len(buf)), 0, -1):
            if buf.endswith(PATTERN[:n]):
                keep = len(buf) - n
                break
        if i < 0:
            out = bytes(buf[:keep])
            del buf[:keep]
            return out
        if len(buf) < i + HDR.size:
            out = bytes(buf[:i])
            del buf[:i]
            return out
        (length,) = struct.unpack_from("<Q", buf, i + LEN_AT)
        if length != SIZE:
            out = bytes(buf[:i + HDR.size])
            del buf[:i + HDR.size]
            return out
        self.seen += 1
        if self.seen < self.nth:
            out = bytes(buf[:i + HDR.size])
            del buf[:i + HDR.size]
            return out
        if len(buf) < i + HDR.size + SIZE:  # the whole response first
            out = bytes(buf[:i])
            del buf[:i]
            self.seen -= 1
            return out
        self.done.set()
        hdr = bytearray(buf[i:i + HDR.size])
        payload = bytes(buf[i + HDR.size:i + HDR.size + SIZE])
        rest = bytes(buf[i + HDR.size + SIZE:])
        head = bytes(buf[:i])
        buf.clear()
        if self.mode == "die-mid-payload":
            buf += head + hdr + payload[:SIZE // 2]
            return None
        if self.mode == "short":  # says and carries 4 KiB less
            struct.pack_into("<Q", hdr, LEN_AT, SIZE - 4 * KiB)
            return head + bytes(hdr) + payload[:SIZE - 4 * KiB] + rest
        if self.mode == "long":  # says and carries 4 KiB more
            struct.pack_into("<Q", hdr, LEN_AT, SIZE + 4 * KiB)
            return head + bytes(hdr) + payload + b"\x22" * (4 * KiB) + rest
        if self.mode == "extra-bytes":  # says 64 KiB, carries 4 KiB more
            return head + bytes(hdr) + payload + b"\x22" * (4 * KiB) + rest
        raise AssertionError(self.mode)


@pytest.mark.parametrize("mode", ["short", "long", "extra-bytes", "die-mid-payload"])
async def test_hostile_response_to_a_lone_64k_read(make_agent, capsys, mode: str) -> None:
    target = await make_agent("target", transports=("tcp",))
    src = target.alloc(SIZE, name="src")
    src.numpy()[:] = 0x11
    proxy = Proxy(target.address, mode, nth=3)
    addr = await proxy.start()
    try:
        init = await make_agent("init", transports=("tcp",))
        local = init.alloc(4 * SIZE, name="dst")
        guard = np.frombuffer(bytes(range(256)) * (4 * SIZE // 256), dtype=np.uint8)
        local.numpy()[:] = guard
        peer = await within(init.connect(addr))
        dst = local[SIZE:2 * SIZE]
        err: BaseException | None = None
        for k in range(6):
            try:
                await within(init.read(dst, peer.region("src")[0:SIZE]), 10)
            except aioxfer.XferError as e:  # typed, and promptly (within)
                err = e
                break
            assert np.all(local.numpy()[SIZE:2 * SIZE] == 0x11), f"READ {k}: wrong bytes"
            if k == proxy.nth - 1 and mode == "die-mid-payload":
                # One connection lost, the others live: the READ went again
                # on another (rerouted), and completed with the right bytes.
                break
            assert k < proxy.nth - 1 or mode == "extra-bytes", f"READ {k} succeeded"
        assert proxy.done.is_set(), "the proxy never saw the response it rewrites"
        got = local.numpy()
        # Nothing outside the destination was touched.
        assert np.array_equal(got[:SIZE], guard[:SIZE])
        assert np.array_equal(got[2 * SIZE:], guard[2 * SIZE:])
        # extra-bytes: the response itself is right (its READ completes), and
        # its extra bytes are read as the next frame's header: not one, the
        # connection closes and the next READ fails.
        assert err is not None or mode == "die-mid-payload", "a wrong response completed it"
        why = {"short": "malformed frame: READ responses short of what the group asked",
               "long": "malformed frame: READ response outside its request",
               "extra-bytes": "malformed frame: bad frame magic",
               # the endpoint lost, or (rerouted) that rail
               "die-mid-payload": ("peer.lost", "broken or silent")}[mode]
        whys = (why,) if isinstance(why, str) else why
        logged = ""
        for _ in range(100):
            logged += capsys.readouterr().err
            if any(w in logged for w in whys):
                break
            await asyncio.sleep(0.05)
        assert any(w in logged for w in whys), logged
    finally:
        await proxy.close()

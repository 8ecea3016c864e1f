"""Log injection: peer-supplied strings in aioxfer's own log lines.

Real agents in a child process (its stderr is what is checked), and a raw
client speaking the handshake to one of them: a frame whose message type is
a string with control characters, bidirectional overrides and line
separators (before any authentication: the server's conn.rejected reason
carries msgspec's text, which quotes that value as it is), and a Hello that
proves the token under a name made of the same characters (the server
logged it as the peer's name; since sec29 such a name is refused in the
handshake, and the refusal names it). structlog's ConsoleRenderer writes a
string with no space, quote or line break as it is: an ESC, NUL, U+202E,
U+2028 or NEL went out raw (a terminal's screen cleared, a line hidden or
reversed, a log reader's line split). aioxfer.log escapes them now.

(Before sec29 the agents themselves had such names; aioxfer.names refuses
them now, so the hostile text comes from a raw peer instead.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

# (Written as escapes: the child decodes them.) No space, quote, CR or LF:
# structlog's ConsoleRenderer writes such a string as its repr, any other as
# it is. \x0b, \x0c, \x85 and \u2028 end a line for str.splitlines and many
# log readers.
_EVIL = r"x\x1b[2K\u202eevil\x00\u2028y\x7f\x85z\x0bE1206\x0cforged"

_CHILD = r"""
import asyncio, os, socket, sys, msgspec, aioxfer
from aioxfer import auth, metadata, protocol
EVIL = sys.argv[1].encode().decode("unicode_escape")
TOKEN = "t" * 32

def frame(obj):
    body = msgspec.msgpack.encode(obj)
    return len(body).to_bytes(4, "big") + body

def raw(address, frames_of):
    # A peer of our own making: reads the Challenge, sends what frames_of
    # makes of its nonce, reads until the server closes (or 1 s: an
    # accepted "data" connection waits for engine frames).
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        n = int.from_bytes(s.recv(4, socket.MSG_WAITALL), "big")
        chal = protocol.decode_body(s.recv(n, socket.MSG_WAITALL))
        s.sendall(frames_of(chal.nonce))
        s.settimeout(1)
        try:
            while s.recv(1 << 16):
                pass
        except OSError:
            pass

def hostile_hello(nonce_s):
    nonce = os.urandom(protocol.NONCE_BYTES)
    name = "H" + EVIL
    proof = protocol.client_proof(auth.hmac_key(TOKEN.encode()), nonce_s, nonce, name)
    return (frame({"type": "hello", "version": metadata.PROTOCOL_VERSION, "name": name,
                   "incarnation": 7, "purpose": "data", "nonce": nonce,
                   "byteorder": sys.byteorder})
            + protocol.encode_frame(metadata.Proof(proof=proof)))

async def main():
    async with aioxfer.Agent("B-log", token=TOKEN, listen="127.0.0.1:0") as b:
        async with aioxfer.Agent("A-log", token=TOKEN, listen="127.0.0.1:0") as a:
            peer = await a.connect(b.address)
            await peer.aclose()
        # (A peer refused: B logs conn.rejected.)
        async with aioxfer.Agent("C-log", token="u" * 32, listen="127.0.0.1:0") as c:
            try:
                await c.connect(b.address)
            except aioxfer.AccessDenied:
                pass
        loop = asyncio.get_running_loop()
        # Unauthenticated: a frame of an unknown type named EVIL.
        await loop.run_in_executor(None, raw, b.address,
                                   lambda _n: frame({"type": "T" + EVIL}))
        # A token holder whose Hello names itself with EVIL.
        await loop.run_in_executor(None, raw, b.address, hostile_hello)
        await asyncio.sleep(0.2)
asyncio.run(main())
"""

_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[")


def _run(tmp_path: Path, fmt: str) -> bytes:
    env = dict(os.environ, AIOXFER_LOG_LEVEL="debug", AIOXFER_LOG_FORMAT=fmt)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, _EVIL], cwd=tmp_path, env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stderr


def _raw_controls(text: str) -> list[str]:
    return sorted({repr(c) for c in text if c != "\n" and not c.isprintable()})


def test_console_lines_escape_peer_strings(tmp_path: Path) -> None:
    err = _run(tmp_path, "console")
    text = err.decode("utf-8")
    assert not _raw_controls(text), f"raw in the log: {_raw_controls(text)}"
    lines = text.splitlines()  # (splits at \r, \x85, \u2028 too: none may be left)
    assert lines
    forged = [line for line in lines if not _STAMP.match(line)]
    assert not forged, forged
    assert any("peer.connected" in line and "B-log" in line for line in lines)
    # Readable: the hostile text's printable parts as they are, the rest
    # escaped, in the line that refused its frame (and in whichever names
    # or refuses the hostile Hello's peer).
    evil = [line for line in lines if "Tx" in line]
    assert evil and all("conn.rejected" in line for line in evil), evil
    assert all("evil" in line and "\\u202e" in line and "\\x1b" in line for line in evil)
    assert any("Hx" in line and "evil" in line for line in lines), lines
    assert any("conn.rejected" in line and "C-log" in line for line in lines)


def test_json_lines_escape_peer_strings(tmp_path: Path) -> None:
    err = _run(tmp_path, "json")
    assert all(b < 0x80 and (b >= 0x20 or b == 0x0A) for b in err)  # json: ASCII only
    reasons = []
    for line in err.decode().splitlines():
        event = json.loads(line)
        reasons.append(str(event.get("reason", "")))
    evil = _EVIL.encode().decode("unicode_escape")
    # (whole: the decoder's quote of the frame type is escaped in the
    # ProtocolError's text already, protocol.decode_body)
    from aioxfer.log import escape

    assert any(escape("T" + evil) in r for r in reasons), reasons


def test_escape_values_keeps_text_readable() -> None:
    from aioxfer.log import escape, escape_values

    assert escape("plain text, ünïcödé, 東京") == "plain text, ünïcödé, 東京"
    assert escape("a\nb\x1b\u202e\U000e0001") == "a\\x0ab\\x1b\\u202e\\U000e0001"
    out = escape_values(None, "info", {"event": "e\nv", "a": "ok", "b": "k\x1bx",
                                       "n": 5, "l": ["x\u202e"], "exception": "T\nE: x\x1b"})
    assert out["a"] == "ok" and out["n"] == 5
    assert str(out["event"]) == "e\\x0av"
    assert repr(out["b"]) == "'k\\x1bx'"
    assert repr(out["l"]) == "['x\\u202e']"
    assert out["exception"] == "T\nE: x\\x1b"


def test_log_call_cost_is_small() -> None:
    # (Not a benchmark: the bound is loose, against a regression to a per
    # character Python loop over printable values.)
    import io
    import time

    from aioxfer import log

    log.configure(level="info")
    lg = log.get_logger("aioxfer.test")
    old = sys.stderr
    sys.stderr = io.StringIO()
    try:
        t0 = time.perf_counter()
        for _ in range(2000):
            lg.info("peer.connected", agent="a" * 64, peer="b" * 200, address="127.0.0.1:1",
                    conns=1, path="shm")
        per = (time.perf_counter() - t0) / 2000
    finally:
        sys.stderr = old
        log._state.clear()
    assert per < 1e-3, per

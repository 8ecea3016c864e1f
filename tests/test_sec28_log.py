"""Log injection: peer-supplied strings in aioxfer's own log lines.

Real agents in a child process (its stderr is what is checked) whose names
carry control characters, bidirectional overrides and line separators: the
peer's name reaches the other agent's lines (peer.connected, peer.closed,
conn.rejected's reason). structlog's ConsoleRenderer writes a string with
no space, quote or line break as it is: an ESC, NUL, U+202E, U+2028 or
NEL went out raw (a terminal's screen cleared, a line hidden or reversed,
a log reader's line split). aioxfer.log escapes them now.
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
import asyncio, sys, aioxfer
EVIL = sys.argv[1].encode().decode("unicode_escape")
async def main():
    async with aioxfer.Agent("B" + EVIL, token="t" * 32, listen="127.0.0.1:0") as b:
        async with aioxfer.Agent("A" + EVIL, token="t" * 32, listen="127.0.0.1:0") as a:
            peer = await a.connect(b.address)
            await peer.aclose()
        # (A peer refused: B logs conn.rejected with C's name in its reason.)
        async with aioxfer.Agent("C" + EVIL, token="u" * 32, listen="127.0.0.1:0") as c:
            try:
                await c.connect(b.address)
            except aioxfer.AccessDenied:
                pass
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


def test_console_lines_escape_peer_names(tmp_path: Path) -> None:
    err = _run(tmp_path, "console")
    text = err.decode("utf-8")
    assert not _raw_controls(text), f"raw in the log: {_raw_controls(text)}"
    lines = text.splitlines()  # (splits at \r, \x85, \u2028 too: none may be left)
    assert lines
    forged = [line for line in lines if not _STAMP.match(line)]
    assert not forged, forged
    peer_lines = [line for line in lines if "peer.connected" in line or "peer.closed" in line]
    assert peer_lines
    # Readable: the name's printable parts as they are, the rest escaped.
    assert all("evil" in line and "\\u202e" in line and "\\x1b" in line for line in peer_lines)
    assert any("conn.rejected" in line and "Cx" in line for line in lines)


def test_json_lines_escape_peer_names(tmp_path: Path) -> None:
    err = _run(tmp_path, "json")
    assert all(b < 0x80 and (b >= 0x20 or b == 0x0A) for b in err)  # json: ASCII only
    names = set()
    for line in err.decode().splitlines():
        event = json.loads(line)
        names.add(event.get("peer"))
    evil = _EVIL.encode().decode("unicode_escape")
    assert "A" + evil in names and "B" + evil in names  # (whole, once decoded)


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

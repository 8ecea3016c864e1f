"""Exception messages in aioxfer's console log are one line each.

escape_values escaped every value but kept a rendered traceback's line
breaks (its frames are ours), and with them the line breaks of the
exception's message, which is often a peer's text: a frame's bad value
quoted by the decoder, a listener's refusal, a server's reason. A server
whose first frame is of the type "x\\n<a timestamp> [error] forged" made a
client's ProtocolError, logged with exc_info by the application through
aioxfer's logger, write a line that reads as a log line of its own. Now
(aioxfer.log.format_exc_info) the traceback keeps its lines and each
message and note is written on one line, its line breaks as \\x0a.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from conftest import within

import aioxfer
from aioxfer import log

FORGED = "2026-01-01T00:00:00.000000Z [error    ] forged.line"
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[")


@pytest.fixture
def console() -> Iterator[Any]:
    """aioxfer's own console logger (the default set-up), reset after."""
    log._state.clear()
    log.configure(level="info", json=False)
    try:
        yield log.get_logger("aioxfer.test")
    finally:
        log._state.clear()


def _lines_of(err: str) -> list[str]:
    assert all(c == "\n" or c.isprintable() for c in err), "a raw control in the log"
    return err.splitlines()


async def test_a_servers_text_in_an_exception_forges_no_line(
        make_agent: Any, console: Any, capfd: Any) -> None:
    client = await make_agent("client", insecure_no_auth=True, transports=("tcp",))
    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    held: list[socket.socket] = []

    async def serve() -> None:
        conn, _ = await loop.sock_accept(lsock)
        held.append(conn)
        body = msgspec.msgpack.encode({"type": "x\n" + FORGED + "\r\x1b[2K"})
        await loop.sock_sendall(conn, len(body).to_bytes(4, "big") + body)

    server = asyncio.ensure_future(serve())
    try:
        with pytest.raises(aioxfer.ProtocolError) as info:
            await within(client.connect(f"127.0.0.1:{lsock.getsockname()[1]}"), 10)
        assert FORGED in str(info.value)  # (the message carries the server's text)
        capfd.readouterr()
        try:
            raise info.value
        except aioxfer.ProtocolError:
            console.error("app.connect_failed", exc_info=True)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        for c in held:
            c.close()
        lsock.close()
    lines = _lines_of(capfd.readouterr().err)
    assert not [ln for ln in lines if ln.startswith(FORGED[:20])], lines
    # The traceback keeps its lines; the message is one of them, escaped.
    assert lines[0].startswith(tuple("0123456789")) and "app.connect_failed" in lines[0]
    assert "Traceback (most recent call last):" in lines
    assert any(ln.startswith('  File "') for ln in lines)
    # (The decoder quotes the frame's type as it is: protocol.py escaping
    # it itself would leave this line escaped all the same.)
    (msg,) = [ln for ln in lines if "forged.line" in ln]
    assert msg.startswith("aioxfer.errors.ProtocolError: ") and FORGED in msg, msg


def test_chained_grouped_and_noted_messages(console: Any, capfd: Any) -> None:
    def fail(text: str) -> None:
        raise ValueError(text)

    try:
        try:
            fail("inner\n" + FORGED)
        except ValueError as inner:
            err = RuntimeError("outer\u2028" + FORGED)
            err.add_note("note\n" + FORGED)
            group = ExceptionGroup("group\n" + FORGED, [err, KeyError("k\nforged")])
            raise group from inner
    except ExceptionGroup:
        capfd.readouterr()
        console.error("app.failed", exc_info=True)
    lines = _lines_of(capfd.readouterr().err)
    assert not [ln for ln in lines if FORGED[:20] in ln[:20]], lines
    text = "\n".join(lines)
    for escaped in ("inner\\x0a", "outer\\u2028", "note\\x0a", "group\\x0a", "'k\\nforged'"):
        assert escaped in text, (escaped, text)
    # Still a traceback: both of its parts, frames on their own lines.
    assert "The above exception was the direct cause of the following exception:" in lines
    assert sum("Traceback (most recent call last)" in ln for ln in lines) >= 2
    assert any("in fail" in ln for ln in lines)


def test_processor_alone_and_other_forms() -> None:
    """format_exc_info takes what structlog's takes (an exception, a tuple,
    True inside an except) and leaves events without one alone."""
    try:
        raise OSError("a\nb")
    except OSError as exc:
        caught = exc
        out_true = log.format_exc_info(None, "error", {"event": "e", "exc_info": True})
    out_exc = log.format_exc_info(None, "error", {"event": "e", "exc_info": caught})
    tup = (type(caught), caught, caught.__traceback__)
    out_tup = log.format_exc_info(None, "error", {"event": "e", "exc_info": tup})
    for out in (out_true, out_exc, out_tup):
        assert "exc_info" not in out and out["exception"].endswith("OSError: a\\x0ab"), out
        assert out["exception"].startswith("Traceback (most recent call last):\n")
    assert log.format_exc_info(None, "info", {"event": "e", "exc_info": True}) == {"event": "e"}
    assert log.format_exc_info(None, "info", {"event": "e"}) == {"event": "e"}
    # (A message that is all printable is as traceback writes it.)
    plain = log.format_exc_info(None, "error", {"exc_info": ValueError("fine text")})
    assert plain["exception"] == "ValueError: fine text"

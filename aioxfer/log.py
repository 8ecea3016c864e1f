"""Structured logging through structlog, set up lazily and never globally.

If the application configured structlog itself, aioxfer logs through that
configuration. Otherwise aioxfer's loggers write to stderr with their own small
processor chain, leaving structlog's global configuration alone:

- ``AIOXFER_LOG_LEVEL``: debug, info (default), warning, error, critical
- ``AIOXFER_LOG_FORMAT``: ``console`` (default) or ``json``

or call :func:`configure`. Events are named ``object.what`` (``peer.connected``,
``peer.lost``, ``conn.rejected``) and carry their details as key/values. Below the
level, a call is one method call that formats nothing; the data path does not
log at all.

Values in log lines often come from peers (agent names, a refusal's reason,
a KV key): the console format writes every value and the event with their
control characters and bidirectional-text overrides escaped (``\\x0a``,
``\\x1b``, ``\\u202e``; :func:`escape`), so that no peer can forge, end or
hide a line; ordinary text, non-ASCII letters included, is written as it is.
The json format is escaped by json itself (ASCII only). When the application
configured structlog, its processors render aioxfer's events and are its
to make safe (structlog's ConsoleRenderer writes strings as they are: add
:func:`escape_values` before the renderer, and :func:`format_exc_info` in
place of structlog's).

Exceptions (``exc_info``): a traceback keeps its lines (the frames are code
locations, ours), but each exception's message and notes are written on one
line, their line breaks escaped too (``\\x0a``): a message is text of any
origin (a peer's refusal, a listener's error, a frame's bad value quoted by
the decoder) and cannot be told from one of ours, so none ends a line.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from types import TracebackType
from typing import Any

import structlog

__all__ = ["configure", "escape", "escape_values", "format_exc_info", "get_logger"]

_state: dict[str, Any] = {}


class _Stderr:
    """Writes each rendered event to whatever sys.stderr is at that moment
    (test runners swap it)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = error = err = critical = fatal = exception = msg


def _escape_char(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def escape(text: str) -> str:
    """``text`` with every character that is not printable (str.isprintable:
    control characters, line and paragraph separators, format characters
    such as the bidirectional overrides U+202A-U+202E and U+2066-U+2069,
    unassigned code points) written as a Python escape; ``text`` itself
    when it has none (one C-speed scan)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


class _Shown:
    """A value as the console renderer is to write it: its text exactly
    (structlog's ConsoleRenderer writes a value that is not a str as its
    repr, and one that is as it is or as its repr by what it contains:
    this is neither re-quoted nor re-escaped)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def escape_values(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor for a console renderer, which writes some
    strings and objects' own reprs as they are: each value (and the event)
    with a character that is not printable is replaced by text without
    one, a str by its repr (quoted, escaped as :func:`escape` does), any
    other value by its repr, escaped; printable values pass untouched (one
    scan each). A rendered traceback (``exception``, ``stack``) keeps its
    line breaks, each line escaped."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            if value.isprintable():
                continue
            if key in ("exception", "stack"):
                event_dict[key] = "\n".join(map(escape, value.split("\n")))
            elif key == "event":
                event_dict[key] = _Shown(escape(value))
            else:
                event_dict[key] = _Shown(repr(value))
        elif not isinstance(value, (int, float, bool, type(None))):
            text = repr(value)
            if not text.isprintable():
                event_dict[key] = _Shown(escape(text))
    return event_dict


def _exc_info(value: Any) -> tuple[type[BaseException], BaseException, TracebackType | None] | None:
    """An ``exc_info`` value as structlog takes it (an exception, a
    sys.exc_info() tuple, or true for the exception being handled), as a
    tuple; None when it names no exception."""
    if isinstance(value, BaseException):
        return type(value), value, value.__traceback__
    if (isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], BaseException)
            and (value[2] is None or isinstance(value[2], TracebackType))):
        return type(value[1]), value[1], value[2]
    if value:
        exc = sys.exception()
        if exc is not None:
            return type(exc), exc, exc.__traceback__
    return None


def _one_line_messages(te: traceback.TracebackException) -> None:
    """Escapes the message and notes of ``te`` and of every exception chained
    to it (cause, context, a group's members): each then renders on one line.
    Frames are left alone. (TracebackException keeps the message it renders
    in ``_str``, 3.11 to 3.14; a version without it keeps its text, which
    escape_values still escapes but for its line breaks.)"""
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        text = getattr(t, "_str", None)
        if isinstance(text, str) and not text.isprintable():
            t._str = escape(text)  # type: ignore[attr-defined]
        msg = getattr(t, "msg", None)  # (a SyntaxError's message)
        if isinstance(msg, str) and not msg.isprintable():
            t.msg = escape(msg)
        notes = getattr(t, "__notes__", None)
        if isinstance(notes, list):
            t.__notes__ = [escape(n) if isinstance(n, str) else n for n in notes]
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
        todo += getattr(t, "exceptions", None) or []


def format_exc_info(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog's format_exc_info (``exc_info`` rendered into ``exception``,
    as traceback.print_exception writes it) with every exception's message
    and notes on one line: their line breaks and other unprintable
    characters escaped, the traceback's own lines kept. For a console
    renderer, before :func:`escape_values`."""
    ei = _exc_info(event_dict.pop("exc_info", None))
    if ei is not None:
        te = traceback.TracebackException(*ei, compact=True)
        _one_line_messages(te)
        event_dict["exception"] = "".join(te.format()).removesuffix("\n")
    return event_dict


def _level(value: str | int | None) -> int:
    if value is None:
        value = os.environ.get("AIOXFER_LOG_LEVEL", "info")
    if isinstance(value, int):
        return value
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {value!r}")
    return level


def configure(*, level: str | int | None = None, json: bool | None = None) -> None:
    """Sets aioxfer's own level and format (only used when structlog is not
    configured by the application). Loggers made before keep their settings
    until :func:`get_logger` is called again."""
    if json is None:
        json = os.environ.get("AIOXFER_LOG_FORMAT", "console").strip().lower() == "json"
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        # (Tracebacks rendered to text first, so that they are escaped too;
        # their messages on one line: format_exc_info.)
        processors += [format_exc_info, escape_values,
                       structlog.dev.ConsoleRenderer(colors=False)]
    _state["processors"] = processors
    _state["wrapper"] = structlog.make_filtering_bound_logger(_level(level))
    _state["logger"] = _Stderr()


def get_logger(name: str = "aioxfer", **initial: Any) -> Any:
    """A bound structlog logger: ``log.info("peer.connected", peer=..., path=...)``."""
    if structlog.is_configured():
        return structlog.get_logger(name, **initial)
    if not _state:
        configure()
    # The bound logger itself, not structlog.wrap_logger's lazy proxy: that
    # assembles a new bound logger on every call (~2 µs even for a filtered
    # one, a few per connect) from the same arguments, captured here anyway
    # (configure() affects only loggers made after it, as before). Its
    # below-the-level methods are then one no-op call.
    return _state["wrapper"](_state["logger"], processors=_state["processors"],
                             context=dict(initial))

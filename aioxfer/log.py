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
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

__all__ = ["configure", "get_logger"]

_state: dict[str, Any] = {}


class _Stderr:
    """Writes each rendered event to whatever sys.stderr is at that moment
    (test runners swap it)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = error = err = critical = fatal = exception = msg


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
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
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

"""``nixl.logging``: the logging set-up NIXL's scripts report through.

``get_logger(name)`` returns the stdlib logger ``nixl.<name without leading
underscores>``. The first call configures logger ``nixl``: level INFO, one
handler on stdout, lines ``<date time> NIXL <LEVEL> <file>:<line> <message>``,
not propagated to the root logger. ``NIXL_LOG_LEVEL`` (TRACE, DEBUG, INFO,
WARN, ERROR, FATAL) overrides the level; ``NIXL_DEBUG_LOGGING=yes`` makes
errors inside logging calls raise (``logging.raiseExceptions``). NIXL's
examples and tests report success only through these messages, so the format
and the stream are theirs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TextIO

__all__ = ["get_logger", "set_log_level_by_env", "setup_logging"]

_FORMAT = "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}

_configured = False
_configure_lock = threading.Lock()


class _StdoutHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever sys.stdout is at the time (pytest swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def set_log_level_by_env(nixl_logger: logging.Logger) -> None:
    """Applies NIXL_LOG_LEVEL to ``nixl_logger`` (a bad value is reported and ignored)."""
    value = os.getenv("NIXL_LOG_LEVEL")
    if not value:
        return
    level = _LEVELS.get(value.upper())
    if level is None:
        nixl_logger.warning(
            "Invalid NIXL_LOG_LEVEL value '%s': not one of %s. Using configuration default.",
            value,
            ", ".join(_LEVELS),
        )
        return
    nixl_logger.setLevel(level)
    nixl_logger.info("Log level set to %s from NIXL_LOG_LEVEL environment variable",
                     value.upper())


def setup_logging() -> None:
    global _configured
    with _configure_lock:
        if _configured:
            return
        handler = _StdoutHandler()
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        nixl_logger = logging.getLogger("nixl")
        nixl_logger.setLevel(logging.INFO)
        nixl_logger.handlers[:] = [handler]
        nixl_logger.propagate = False
        set_log_level_by_env(nixl_logger)
        if nixl_logger.level < logging.INFO:
            handler.setLevel(nixl_logger.level)
        logging.raiseExceptions = os.getenv("NIXL_DEBUG_LOGGING", "").lower() in (
            "true",
            "1",
            "yes",
        )
        _configured = True


def get_logger(name: str) -> logging.Logger:
    """``nixl.<name>`` (leading underscores dropped), after configuring ``nixl``."""
    setup_logging()
    return logging.getLogger(f"nixl.{name.lstrip('_')}")

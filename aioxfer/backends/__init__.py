"""Backends: the Python half of every way bytes move.

Local backends (the far side is storage this agent reaches itself: object
storage, users' own plugins) implement :class:`LocalBackend` and are found by
name in the registry, built-in or through the entry-point group
``aioxfer.backends``. See :mod:`aioxfer.backends.base` for the interface and
:mod:`aioxfer.backends.objects` for the S3 backend.
"""

from __future__ import annotations

from aioxfer.backends.base import (
    API_VERSION,
    BackendRegion,
    BackendStatistics,
    BackendTransfer,
    LocalBackend,
)
from aioxfer.backends.registry import (
    BUILTIN,
    GROUP,
    add_backend,
    available,
    backend_class,
    backends_of,
    instance,
    local_target,
    register_region,
)

__all__ = [
    "API_VERSION",
    "BUILTIN",
    "GROUP",
    "BackendRegion",
    "BackendStatistics",
    "BackendTransfer",
    "LocalBackend",
    "add_backend",
    "available",
    "backend_class",
    "backends_of",
    "instance",
    "local_target",
    "register_region",
]

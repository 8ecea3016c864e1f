"""RDMA verbs: what this machine has, for ``aioxfer info`` and the Agent.

The transport itself is native (native/src/verbs.c): libibverbs is loaded at
run time, so a build without rdma-core installed still runs (verbs is then
simply unavailable). ``AIOXFER_VERBS_PROVIDER=/path/to/lib.so`` loads a verbs
provider library of our own instead of libibverbs (the software provider of
native/tests/softverbs/ that the tests use); spawned processes inherit it.
"""

from __future__ import annotations

import os

from aioxfer import _cyx

__all__ = ["PROVIDER_ENV", "devices", "provider", "status"]

PROVIDER_ENV = "AIOXFER_VERBS_PROVIDER"


def provider() -> str | None:
    """The verbs provider library to load instead of libibverbs, if any."""
    return os.environ.get(PROVIDER_ENV) or None


def status() -> tuple[bool, str]:
    """(available, what was found): available when at least one device with
    an active port is there. A kernel without InfiniBand (ENOSYS) is "no
    devices", never an error."""
    n, _, why = _cyx.verbs_probe(provider())
    return n > 0, why


def devices() -> list[str]:
    """One line per usable device: name, port, link layer, MTU, GID."""
    n, names, _ = _cyx.verbs_probe(provider())
    return names if n > 0 else []

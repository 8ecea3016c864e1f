"""aioxfer.nixl: NIXL's Python API on aioxfer.

Code written for NIXL runs on aioxfer by importing from here instead of from
``nixl``::

    from aioxfer.nixl import nixl_agent, nixl_agent_config

or, unchanged, through the opt-in shim that makes ``import nixl`` resolve here
(for scripts you do not want to edit; real NIXL stays importable without it)::

    PYTHONPATH="$(python -m aioxfer.nixl)" python your_nixl_script.py
    # or, in-process, before anything imports nixl:
    import aioxfer.nixl; aioxfer.nixl.install()

Like NIXL's ``nixl`` package, this one re-exports every public name of its
submodules ``_api``, ``_bindings``, ``_utils`` and ``logging`` (as in NIXL,
``_bindings``' ``nixl_thread_sync_t`` shadows ``_api``'s here). The wire
formats are aioxfer's: compat agents talk to compat agents (and their
notifications reach plain aioxfer agents), not to real NIXL.
"""

from __future__ import annotations

import sys

from aioxfer.nixl import _api, _bindings, _utils, logging
from aioxfer.nixl._api import *  # noqa: F403
from aioxfer.nixl._bindings import *  # type: ignore[assignment]  # noqa: F403
from aioxfer.nixl._utils import *  # noqa: F403
from aioxfer.nixl.logging import *  # noqa: F403

__all__ = [
    *_api.__all__,
    *_bindings.__all__,
    *_utils.__all__,
    *logging.__all__,
    "install",
    "shim_path",
]

_SUBMODULES = ("_api", "_bindings", "_utils", "logging")


def shim_path() -> str:
    """The directory to put on PYTHONPATH so that ``import nixl`` is this package."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")


def install() -> None:
    """Makes ``import nixl`` (and nixl._api, nixl._bindings, nixl._utils,
    nixl.logging) resolve to this package in this process. Refuses if a real
    NIXL was imported already: one process, one NIXL."""
    this = sys.modules[__name__]
    present = sys.modules.get("nixl")
    if present is not None and present is not this and not getattr(present, "_AIOXFER_SHIM",
                                                                     False):
        raise RuntimeError(
            f"a different nixl is already imported ({getattr(present, '__file__', present)}); "
            f"call aioxfer.nixl.install() before anything imports nixl"
        )
    sys.modules["nixl"] = this
    for sub in _SUBMODULES:
        sys.modules[f"nixl.{sub}"] = sys.modules[f"{__name__}.{sub}"]

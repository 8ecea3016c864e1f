"""The opt-in shim: with this directory's parent on sys.path (``PYTHONPATH="$(python
-m aioxfer.nixl)"``), ``import nixl`` is aioxfer.nixl, and nixl._api,
nixl._bindings, nixl._utils, nixl.logging its submodules (one class object per
name, so what aioxfer.nixl raises is what ``except nixl...`` catches).

A script run this way is a NIXL script, and prints what it prints on NIXL:
aioxfer's own structured log lines (stderr) follow ``NIXL_LOG_LEVEL``
unless ``AIOXFER_LOG_LEVEL`` is set. At NIXL's default (WARN) only
aioxfer's errors are shown: its warnings include ``peer.lost`` for every
peer that goes away while still added (a target that exits when its
transfer is done, as NIXL's two-peer examples do), where NIXL prints
nothing and reports a dead peer by raising nixlRemoteDisconnectError.
NIXL_LOG_LEVEL=INFO shows aioxfer's warnings and info lines too. aioxfer
fixes its level when its modules are first imported, so it is set here,
before that, and the environment is left as it was (children are not
told)."""

import os
import sys

# NIXL_LOG_LEVEL's names as aioxfer.log's levels (WARN: errors only, see
# above); an unknown value counts as the default, as NIXL's own logging does.
_LEVELS = {"TRACE": "debug", "DEBUG": "debug", "INFO": "info", "WARN": "error",
           "ERROR": "error", "FATAL": "critical"}

if "aioxfer" not in sys.modules and "AIOXFER_LOG_LEVEL" not in os.environ:
    os.environ["AIOXFER_LOG_LEVEL"] = _LEVELS.get(
        os.environ.get("NIXL_LOG_LEVEL", "").strip().upper(), "error")
    try:
        import aioxfer  # noqa: F401  (its modules make their loggers now, at that level)
    finally:
        del os.environ["AIOXFER_LOG_LEVEL"]

import aioxfer.nixl as _impl  # noqa: E402

_AIOXFER_SHIM = True
# Replace this module by the real package before anything else binds to it.
sys.modules[__name__] = _impl
for _sub in ("_api", "_bindings", "_utils", "logging"):
    sys.modules[f"{__name__}.{_sub}"] = sys.modules[f"aioxfer.nixl.{_sub}"]

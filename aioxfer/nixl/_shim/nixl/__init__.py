"""The opt-in shim: with this directory's parent on sys.path (``PYTHONPATH="$(python
-m aioxfer.nixl)"``), ``import nixl`` is aioxfer.nixl, and nixl._api,
nixl._bindings, nixl._utils, nixl.logging its submodules (one class object per
name, so what aioxfer.nixl raises is what ``except nixl...`` catches)."""

import sys

import aioxfer.nixl as _impl

_AIOXFER_SHIM = True
# Replace this module by the real package before anything else binds to it.
sys.modules[__name__] = _impl
for _sub in ("_api", "_bindings", "_utils", "logging"):
    sys.modules[f"{__name__}.{_sub}"] = sys.modules[f"aioxfer.nixl.{_sub}"]

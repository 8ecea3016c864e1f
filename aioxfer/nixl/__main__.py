"""``python -m aioxfer.nixl``: prints the directory whose ``nixl`` package is
the opt-in shim, for ``PYTHONPATH="$(python -m aioxfer.nixl)" python script.py``."""

from aioxfer.nixl import shim_path

print(shim_path())

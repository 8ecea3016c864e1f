"""Coverage for the atheris harnesses.

atheris.instrument_imports() only sees modules loaded through the ordinary
path finder, and an editable install (meson-python's loader) is not that: it
would instrument nothing of aioxfer. So the harnesses instrument the
functions of the modules they exercise in place, after importing them.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any


def instrument_modules(*modules: types.ModuleType) -> int:
    """Instruments every function and method defined in these modules;
    returns how many."""
    import atheris

    done = 0
    seen: set[int] = set()

    def visit(obj: Any, owner: str) -> None:
        nonlocal done
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if inspect.isfunction(obj) and obj.__module__ == owner:
            atheris.instrument_func(obj)
            done += 1
        elif inspect.isclass(obj) and obj.__module__ == owner:
            for member in vars(obj).values():
                visit(member, owner)
        elif isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    visit(f, owner)

    for mod in modules:
        for obj in list(vars(mod).values()):
            visit(obj, mod.__name__)
    return done


def fuzz(check: Callable[[bytes], str | None], *modules: types.ModuleType) -> None:
    """Runs atheris over a harness's check(), its modules instrumented. A
    known issue check() names fails the run, unless the campaign tolerates
    known issues (AXF_FUZZ_TOLERATE_KNOWN=1): then it is said once and the
    run goes on past it."""
    import atheris
    import known_issues

    n = instrument_modules(*modules)
    print(f"instrumented {n} functions", file=sys.stderr)
    tolerate = known_issues.tolerate()
    seen: set[str] = set()

    def one(data: bytes) -> None:
        known = check(data)
        if known is None:
            return
        if not tolerate:
            raise AssertionError(f"known issue {known}: {known_issues.KNOWN[known]}")
        if known not in seen:  # said once, so the log shows the run went past it
            seen.add(known)
            print(f"known issue hit (tolerated): {known}: {known_issues.KNOWN[known]}",
                  file=sys.stderr, flush=True)

    atheris.Setup(sys.argv, one)
    atheris.Fuzz()

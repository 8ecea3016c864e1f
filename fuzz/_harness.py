"""What every atheris harness (fuzz/fuzz_*.py) does the same way: its
check()'s frame (load the modules, skip the empty input, name a known issue
instead of raising it) and its main() (quiet logs where asked, load, run
atheris over check() with the harness's modules instrumented).

A harness keeps its own check(data) (fuzz/replay.py and the corpus replay
tests call it) and writes it as ``return guarded(load, _run, data)``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import known_issues  # noqa: E402


def guarded(load: Callable[[], None], run: Callable[[bytes], None], data: bytes) -> str | None:
    """Runs one input through run(). None: it held (or the input was
    empty); a KNOWN name: a known issue (tolerated only when the caller
    allows); raises on a new finding."""
    load()
    if not data:
        return None
    try:
        run(data)
    except Exception as exc:
        known = known_issues.classify(exc)
        if known is None:
            raise
        return known
    return None


def main(
    check: Callable[[bytes], str | None],
    load: Callable[[], None],
    modules: Callable[[], Sequence[types.ModuleType]],
    *,
    quiet: bool = False,
) -> None:
    """atheris over check(), the modules named by modules() (asked after
    load(): they are what load() imported) instrumented. quiet: aioxfer's
    log at critical only (a warning per input costs more than the input)."""
    from instrument import fuzz

    if quiet:
        import aioxfer.log

        aioxfer.log.configure(level="critical")
    load()
    fuzz(check, *modules())

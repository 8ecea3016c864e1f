"""Failures the Python harnesses found that are reported and not fixed yet.

A harness raises on anything its contract does not allow; an exception that
matches an entry here is a *known* finding instead: benchmarks/fuzz.sh counts
it and goes on when AXF_FUZZ_TOLERATE_KNOWN=1 (so a campaign explores past
it), and tests/test_fuzz_replay.py replays fuzz/findings/ expecting it (a
strict xfail: once the fix lands the test fails until the entry is removed
here and the finding moves into the corpus).
"""

from __future__ import annotations

import os

KNOWN = {
    "deep-nesting": (
        "issue 9 (9): msgpack or JSON nested ~1000 levels deep makes msgspec raise "
        "RecursionError, which escapes decode_body() (pre-auth, out of the accept task) "
        "and discovery's JSON decoder (a hostile etcd value ends the watch)"
    ),
}


def classify(exc: BaseException) -> str | None:
    """The KNOWN entry this exception is, or None (a new finding)."""
    if isinstance(exc, RecursionError):
        return "deep-nesting"
    return None


def tolerate() -> bool:
    return os.environ.get("AXF_FUZZ_TOLERATE_KNOWN") == "1"

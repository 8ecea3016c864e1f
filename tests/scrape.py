"""Prometheus text read back into samples, for the metrics tests (import it
after ``pytest.importorskip("prometheus_client")``)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: dict[Any, float], name: str, **labels: str) -> float:
    return got[(name, tuple(sorted(labels.items())))]

"""Tags: the numbers an agent's engine knows its peers' connections by.

A collaborator of :class:`aioxfer.Agent` (issue 10, item 8). A peer's
connections (those it accepted from us and ours to it) share one tag per
(name, incarnation), counted: each accepted connection and each endpoint holds
one reference until it is gone, so that churn leaves no tags behind. Local
endpoints (the FILE endpoint) take a tag of their own, named by a label and
never released. ``names`` maps a tag to the name it reports (notifications,
logs).
"""

from __future__ import annotations

import itertools

__all__ = ["Tags"]


class Tags:
    """One agent's connection tags (see the module docstring)."""

    __slots__ = ("names", "_by_key", "_keys", "_refs", "_next")

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self._by_key: dict[tuple[str, int], int] = {}
        self._keys: dict[int, tuple[str, int]] = {}
        self._refs: dict[int, int] = {}
        self._next = itertools.count(1).__next__

    def __len__(self) -> int:
        """How many peer tags are referenced (local ones not counted)."""
        return len(self._refs)

    def ref(self, name: str, incarnation: int) -> int:
        """The tag of (name, incarnation)'s connections, one reference more."""
        key = (name, incarnation)
        tag = self._by_key.get(key)
        if tag is None:
            tag = self._by_key[key] = self._next()
            self.names[tag] = name
            self._keys[tag] = key
        self._refs[tag] = self._refs.get(tag, 0) + 1
        return tag

    def unref(self, tag: int) -> None:
        """One reference fewer; forgotten at none."""
        n = self._refs.get(tag, 0) - 1
        if n > 0:
            self._refs[tag] = n
            return
        self._refs.pop(tag, None)
        key = self._keys.pop(tag, None)
        if key is not None:
            self._by_key.pop(key, None)
        self.names.pop(tag, None)

    def local(self, label: str) -> int:
        """A new tag for a local endpoint, reported as ``label``; never released."""
        tag = self._next()
        self.names[tag] = label
        return tag

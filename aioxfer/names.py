"""What an agent's name may be: the one rule, for our own names and peers'.

A name travels far: in handshakes (Hello, Accept), metadata, etcd keys,
log lines, error messages, metrics labels, KV member tables, the NIXL
layer's remote-agent tables. A peer's name that carries a line break, an
escape sequence or a bidirectional override could end or forge a line in
any of them, or show one agent as another, wherever a consumer writes it
as it is (aioxfer's own console log escapes values, others need not). So a
name is refused where it enters, ours (``Agent(name)``) and a peer's (its
Hello, its Accept, its metadata):

- 1 to MAX_NAME (256) characters;
- every character printable in Python's sense (``str.isprintable``): no
  control characters (C0, DEL, C1: NUL, ESC, CR, LF, NEL ...), no line or
  paragraph separators (U+2028, U+2029), no format characters (the
  bidirectional embeddings, overrides and isolates U+202A-U+202E,
  U+2066-U+2069, zero-width joiners, the BOM), no spaces other than the
  ASCII space, no surrogates, private-use or unassigned code points.

Letters, digits and punctuation of any script stay valid ("prefill-0",
"节点-1", "host.example:rank/3"). The rule is exactly the complement of
what :func:`aioxfer.log.escape` escapes: a valid name is written in a log
line as it is. One C-speed scan; no imports from aioxfer (metadata.py and
protocol.py may use it without a cycle).
"""

from __future__ import annotations

__all__ = ["MAX_NAME", "check_name", "name_problem"]

MAX_NAME = 256


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid agent name (a short text that never
    carries the name's characters raw), or None when it is one."""
    if not isinstance(name, str):
        return f"agent name must be a string, not {type(name).__name__}"
    if not 0 < len(name) <= MAX_NAME:
        return f"agent name must be 1..{MAX_NAME} characters, not {len(name)}"
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        # (ascii(): the offending character escaped, never written raw; the
        # name itself shown as repr does, cut: it may be 256 characters.)
        shown = repr(name[:64]) + ("..." if len(name) > 64 else "")
        return (f"agent name {shown} has a character that is not printable "
                f"({ascii(bad)}: a control, separator, format or unassigned character)")
    return None


def check_name(name: object) -> str:
    """``name`` when it is a valid agent name; ValueError (saying why) when not."""
    why = name_problem(name)
    if why is not None:
        raise ValueError(why)
    assert isinstance(name, str)
    return name

"""Every bound on what a peer can make this agent hold, in one place.

Each one caps a resource a peer (possibly hostile, possibly just slow) could
otherwise grow without end: memory for its frames and replies, connections and
their threads, tasks, time. Over a bound we push back (stop reading that
connection, so TCP flow control slows the sender) or refuse with a logged
reason; nothing is dropped silently. SECURITY.md lists them with their
defaults and what each protects.
"""

from __future__ import annotations

import dataclasses

from aioxfer.protocol import MAX_META_FRAME

__all__ = ["Limits"]

_U32 = (1 << 32) - 1
_U64 = (1 << 63) - 1
_BYTES = frozenset({"max_meta_bytes", "reply_queue_bytes"})
_MAX_SECONDS = _U32 // 1000  # seconds the engine can count in milliseconds


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """``Agent(..., limits=Limits(...))``; the defaults suit a serving node."""

    #: connections in their handshake at once (each unauthenticated one holds a
    #: socket and a task for up to peer_timeout); more are closed at accept.
    max_handshakes: int = 64
    #: listen addresses (rails) of one peer we dial, whatever its metadata lists.
    max_rails: int = 8
    #: the largest metadata we read from an authenticated peer (~16 M regions
    #: per 1 GiB: 64 MiB is ~700 k regions).
    max_meta_bytes: int = MAX_META_FRAME
    #: connections in this agent's engine, both directions (each costs threads).
    max_conns: int = 1024
    #: notifications from one connection received but not yet taken by the
    #: application; at the bound we stop reading that connection until it does.
    max_notify_per_conn: int = 1024
    #: bytes of replies (READ responses, acknowledgements) queued for one
    #: connection; at the bound we stop reading its requests.
    reply_queue_bytes: int = 64 << 20
    #: seconds a tcp peer may take to acknowledge that a region was revoked
    #: before it is disconnected (then it cannot touch that memory any more).
    revoke_timeout: float = 10.0
    #: seconds aclose() waits for peers to release our memory before it gives up
    #: on them (naming them) and closes anyway. A network peer's connection
    #: itself is ended at most min(peer_timeout, revoke_timeout) after the
    #: close began (a goodbye still owed, or a peer that never closes after
    #: it), and its revocations settle then; a same-host peer that mapped our
    #: memory is released only by its acknowledgement or its process's exit.
    close_timeout: float = 10.0
    #: the longest wait between re-dials of a failed rail (doubling from rail_probe).
    rail_probe_max: float = 30.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                # Counts and sizes: the engine takes them as 32- or 64-bit ints.
                top = _U64 if f.name in _BYTES else _U32
                if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= top:
                    raise ValueError(f"Limits.{f.name} must be a positive int up to {top}, "
                                     f"not {v!r}")
            elif (isinstance(v, bool) or not isinstance(v, int | float)
                  or not 0 < v <= _MAX_SECONDS):
                # (NaN fails the comparison; the engine takes milliseconds in 32 bits)
                raise ValueError(f"Limits.{f.name} must be a positive number of seconds up "
                                 f"to {_MAX_SECONDS}, not {v!r}")

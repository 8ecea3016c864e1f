"""Per-peer admission control: in-flight limits and priorities.

A :class:`PeerScheduler` decides, for one peer, which requests go to the engine
now and which wait. It is pure bookkeeping (no I/O, no event loop, no clock),
so the agent drives it from the loop thread and tests drive it directly:

- ``admit(item, nbytes, priority)`` when a request is posted: True means it
  goes now and its bytes are counted in flight; False means it is queued.
- ``release(nbytes)`` when an admitted request finished (completed, failed or
  cancel confirmed): returns the queued items that fit now, in the order they
  must be posted.
- ``discard(item)`` when a queued request is cancelled before it was admitted;
  then ``admit_ready()``: what was behind it may fit now.
- ``drain()`` when the peer is lost or closed: every queued item, to be failed.

Order: higher ``priority`` first, FIFO within a priority. The queue is strict:
when the item at its head does not fit, nothing behind it is admitted either,
so a large request cannot be starved by a stream of small ones of its own or a
lower priority. A *new* request of a higher priority than everything queued
is admitted at once if it fits, and is otherwise queued ahead of the rest: this
is how a latency-critical request overtakes a backlog of bulk prefetch (it
still waits for budget, never for the backlog).

A request larger than ``max_bytes`` could never fit; it is admitted when
nothing else is in flight (and then runs alone), so it neither deadlocks nor
needs the caller to split it. More generally, anything fits an idle peer.

Every operation is O(log n) in the number queued (amortized for ``discard``,
which deletes lazily).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["PeerScheduler"]

T = TypeVar("T", bound=Hashable)

# A heap entry: (-priority, sequence, nbytes, item). The sequence number is
# unique, so tuples never compare items (which need not be orderable), and it
# gives FIFO order within a priority.
_Entry = tuple[int, int, int, T]


class PeerScheduler(Generic[T]):
    """Admission control for one peer: at most ``max_bytes`` and
    ``max_requests`` in flight (``None``: unlimited), by priority.

    Items are the caller's handles (e.g. Transfers); they are keyed by
    equality, so one item may be queued only once at a time.

    Invariants the tests check: in-flight requests never exceed
    ``max_requests``; in-flight bytes never exceed ``max_bytes`` except while
    one oversize request runs alone; every item admitted is returned exactly
    once (by ``admit``'s True, ``release``, or ``drain``) unless discarded; and
    whenever anything is queued something is in flight, so a ``release`` will
    come to admit it.
    """

    __slots__ = (
        "_max_bytes",
        "_max_requests",
        "_heap",
        "_entries",
        "_seq",
        "_in_flight_bytes",
        "_in_flight_requests",
        "_queued_bytes",
    )

    def __init__(self, *, max_bytes: int | None = None, max_requests: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1 (or None: unlimited), not {max_bytes}")
        # Zero requests in flight would never admit anything: a deadlock, not a limit.
        if max_requests is not None and max_requests < 1:
            raise ValueError(
                f"max_requests must be at least 1 (or None: unlimited), not {max_requests}"
            )
        self._max_bytes = max_bytes
        self._max_requests = max_requests
        self._heap: list[_Entry[T]] = []
        # item -> its live heap entry. Discarded entries stay in the heap (lazy
        # deletion keeps discard O(1)) and are recognised by not being here.
        self._entries: dict[T, _Entry[T]] = {}
        self._seq = itertools.count()
        self._in_flight_bytes = 0
        self._in_flight_requests = 0
        self._queued_bytes = 0

    # ------------------------------------------------------------ state

    @property
    def max_bytes(self) -> int | None:
        return self._max_bytes

    @property
    def max_requests(self) -> int | None:
        return self._max_requests

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of the admitted requests not yet released."""
        return self._in_flight_bytes

    @property
    def in_flight_requests(self) -> int:
        """Admitted requests not yet released."""
        return self._in_flight_requests

    @property
    def queued(self) -> int:
        """Requests waiting for admission."""
        return len(self._entries)

    @property
    def queued_bytes(self) -> int:
        """Bytes of the requests waiting for admission."""
        return self._queued_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: object) -> bool:
        return item in self._entries

    def __repr__(self) -> str:
        return (
            f"<PeerScheduler in_flight={self._in_flight_requests} "
            f"({self._in_flight_bytes} bytes) queued={len(self._entries)} "
            f"({self._queued_bytes} bytes) max_bytes={self._max_bytes} "
            f"max_requests={self._max_requests}>"
        )

    # ------------------------------------------------------------ operations

    def admit(self, item: T, nbytes: int, priority: int = 0) -> bool:
        """A new request: True if it goes now (its budget is taken), False if
        it was queued (a later ``release`` returns it)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative, not {nbytes}")
        if item in self._entries:
            raise ValueError(f"{item!r} is already queued")
        head = self._head()
        # Anything queued at this priority or higher goes first (FIFO within a
        # priority, strict across); only a request that outranks the whole
        # queue may pass it, and only if the budget has room now.
        if (head is None or -head[0] < priority) and self._fits(nbytes):
            self._take(nbytes)
            return True
        entry: _Entry[T] = (-priority, next(self._seq), nbytes, item)
        heapq.heappush(self._heap, entry)
        self._entries[item] = entry
        self._queued_bytes += nbytes
        return False

    def release(self, nbytes: int) -> list[T]:
        """One admitted request of ``nbytes`` finished: frees its budget and
        returns the queued items admitted now, in the order to post them."""
        if self._in_flight_requests < 1:
            raise ValueError("release() without a request in flight")
        if not 0 <= nbytes <= self._in_flight_bytes:
            raise ValueError(
                f"release({nbytes}) does not match the {self._in_flight_bytes} bytes in flight"
            )
        self._in_flight_requests -= 1
        self._in_flight_bytes -= nbytes
        return self._admit_queued()

    def discard(self, item: T) -> bool:
        """Removes a queued item (cancelled before admission); False if it is
        not queued (already admitted, drained, discarded, or never seen).

        Items behind it that now fit are admitted by ``admit_ready()`` (or
        else by the next ``release``).
        """
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        self._queued_bytes -= entry[2]
        # Lazy deletion: the entry stays in the heap until it surfaces. Compact
        # when dead entries outnumber live ones, so the heap stays O(live) and
        # discard stays amortized O(1).
        if len(self._heap) > 2 * len(self._entries) + 16:
            self._heap = [e for e in self._heap if self._entries.get(e[3]) is e]
            heapq.heapify(self._heap)
        return True

    def admit_ready(self) -> list[T]:
        """The queued items that fit now, admitted, in the order to post
        them: after a ``discard`` of the head (a large request waiting for
        budget), what was behind it need not wait for a ``release`` (which
        a stalled request in flight may never give)."""
        return self._admit_queued()

    def drain(self) -> list[T]:
        """Empties the queue (the peer was lost or closed) and returns what
        was queued, in the order it would have been admitted. In-flight
        accounting is untouched: those requests still finish (or fail) and
        are released one by one."""
        live = sorted(e for e in self._heap if self._entries.get(e[3]) is e)
        self._heap = []
        self._entries = {}
        self._queued_bytes = 0
        return [e[3] for e in live]

    # ------------------------------------------------------------ internals

    def _fits(self, nbytes: int) -> bool:
        if self._in_flight_requests == 0:
            # An idle peer takes anything: this is the oversize rule (a request
            # above max_bytes runs alone rather than never).
            return True
        if self._max_requests is not None and self._in_flight_requests >= self._max_requests:
            return False
        return self._max_bytes is None or self._in_flight_bytes + nbytes <= self._max_bytes

    def _take(self, nbytes: int) -> None:
        self._in_flight_requests += 1
        self._in_flight_bytes += nbytes

    def _head(self) -> _Entry[T] | None:
        """The live entry at the top of the heap, popping dead ones."""
        heap = self._heap
        while heap:
            entry = heap[0]
            if self._entries.get(entry[3]) is entry:
                return entry
            heapq.heappop(heap)
        return None

    def _admit_queued(self) -> list[T]:
        admitted: list[T] = []
        while (head := self._head()) is not None and self._fits(head[2]):
            heapq.heappop(self._heap)
            del self._entries[head[3]]
            self._queued_bytes -= head[2]
            self._take(head[2])
            admitted.append(head[3])
        return admitted

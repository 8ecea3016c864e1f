"""Eviction policies for a tier's blocks: which block goes when room is needed.

A policy only orders keys; the tier decides what may go (a pinned block, one
not yet written below, one being demoted is skipped: ``coldest`` takes a
``skip`` predicate). Every operation is O(1) amortized, bookkeeping only: no
I/O, no await.

- ``"lru"`` (default): least recently inserted or read first.
- ``"fifo"``: oldest insertion first; reads change nothing.
- ``"s3fifo"``: S3-FIFO (Yang et al., SOSP 2023): new blocks enter a small
  FIFO (10 %); one read again while there moves on to the main FIFO, the
  others leave early and are remembered in a ghost FIFO (keys only); a block
  inserted again while remembered goes straight to main; main gives each
  read block another round (up to 3). A one-pass scan of cold blocks flushes
  through the small queue without evicting the hot working set.
- ``"arc"``: ARC (Megiddo and Modha, FAST 2003): recency (T1) and frequency
  (T2) lists with ghost lists (B1, B2) of what each evicted; a hit in a ghost
  list moves the target split toward the list that would have kept it.
  Scan-resistant and self-tuning.

``make_policy(name, capacity)`` with ``capacity`` in blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

__all__ = ["ARC", "FIFO", "LRU", "POLICIES", "EvictionPolicy", "S3FIFO", "make_policy"]

_NO_SKIP: Callable[[bytes], bool] = lambda _k: False  # noqa: E731


class EvictionPolicy:
    """The interface a tier drives. ``insert`` a key it now holds, ``hit``
    when one is read, ``remove`` when one goes (``evicted``: by the policy's
    choice, so ghost lists remember it; not for an explicit remove or a
    demotion the tier decided elsewhere), ``coldest`` for candidates."""

    name = "policy"
    # hit() does something: the store's hit path calls it per block (when
    # False, the store skips the call altogether).
    tracks_hits = True

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a policy needs a capacity of at least one block")
        self.capacity = int(capacity)

    def insert(self, key: bytes) -> None:
        raise NotImplementedError

    def hit(self, key: bytes) -> None:
        raise NotImplementedError

    def remove(self, key: bytes, *, evicted: bool = False) -> None:
        raise NotImplementedError

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def order(self) -> Iterator[bytes]:
        """Every key, in the order the policy would evict them now (no
        bookkeeping changes; for inspection and tests)."""
        raise NotImplementedError

    def coldest(self, limit: int, skip: Callable[[bytes], bool] = _NO_SKIP,
                budget: int | None = None) -> list[bytes]:
        """Up to ``limit`` keys to evict next, coldest first, none for which
        ``skip(key)`` is true; looks at no more than ``budget`` keys (default
        4 × limit + 16). May advance the policy's own state (a second chance
        used up, a block moved from the small queue to main), never removes."""
        raise NotImplementedError


def _scan(it: Iterator[bytes], limit: int, skip: Callable[[bytes], bool],
          budget: int) -> list[bytes]:
    out: list[bytes] = []
    for key in it:
        if budget <= 0 or len(out) >= limit:
            break
        budget -= 1
        if not skip(key):
            out.append(key)
    return out


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._od: OrderedDict[bytes, None] = OrderedDict()  # coldest first
        # The hit path's per-block call, bound once (a C method).
        self.hit = self._od.move_to_end  # type: ignore[method-assign]

    def insert(self, key: bytes) -> None:
        self._od[key] = None
        self._od.move_to_end(key)

    def hit(self, key: bytes) -> None:  # replaced per instance (see __init__)
        self._od.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool = False) -> None:
        self._od.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)

    def order(self) -> Iterator[bytes]:
        return iter(list(self._od))

    def coldest(self, limit: int, skip: Callable[[bytes], bool] = _NO_SKIP,
                budget: int | None = None) -> list[bytes]:
        return _scan(iter(self._od), limit, skip, 4 * limit + 16 if budget is None else budget)


class FIFO(LRU):
    name = "fifo"
    tracks_hits = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.hit = _ignore  # type: ignore[method-assign,assignment]

    def insert(self, key: bytes) -> None:
        if key not in self._od:
            self._od[key] = None

    def hit(self, key: bytes) -> None:
        pass


def _ignore(_key: bytes) -> None:
    pass


_MAX_FREQ = 3


class S3FIFO(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_target = max(1, int(capacity * small_ratio))
        self.small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}

    def insert(self, key: bytes) -> None:
        if key in self.freq:
            return
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def hit(self, key: bytes) -> None:
        f = self.freq.get(key)
        if f is not None and f < _MAX_FREQ:
            self.freq[key] = f + 1

    def remove(self, key: bytes, *, evicted: bool = False) -> None:
        if self.freq.pop(key, None) is None:
            return
        if key in self.small:
            del self.small[key]
            if evicted:
                self.ghost[key] = None
                while len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def order(self) -> Iterator[bytes]:
        if len(self.small) >= self.small_target or not self.main:
            return iter(list(self.small) + list(self.main))
        return iter(list(self.main) + list(self.small))

    def coldest(self, limit: int, skip: Callable[[bytes], bool] = _NO_SKIP,
                budget: int | None = None) -> list[bytes]:
        budget = 4 * limit + 16 if budget is None else budget
        out: list[bytes] = []
        seen: set[bytes] = set()
        freq, small, main = self.freq, self.small, self.main
        from_small_n = 0
        # Moving blocks on (small to main, a round used up in main) is not
        # charged to the budget (each block moves at most 1 + _MAX_FREQ
        # times before it is looked at), but bounded all the same.
        moves = (1 + _MAX_FREQ) * len(freq)
        # Each step looks at one queue's oldest block: the small queue while
        # it is over its share (or main is empty), main otherwise. A block
        # looked at and passed over (skipped, or chosen) goes to the back of
        # its queue so the scan moves on; chosen ones come back to the front
        # at the end (they stay the coldest until the tier removes them).
        while len(out) < limit and budget > 0:
            small_first = len(small) - from_small_n > self.small_target or not main
            for q in ((small, main) if small_first else (main, small)):
                if q and next(iter(q)) not in seen:
                    break
            else:
                break  # both queues went round
            key = next(iter(q))
            f = freq[key]
            if f > 0 and moves > 0:
                moves -= 1
                if q is small:
                    # read again while new: it belongs to the working set
                    del small[key]
                    main[key] = None
                    freq[key] = 0
                else:
                    freq[key] = f - 1  # another round in main
                    main.move_to_end(key)
                continue
            budget -= 1
            seen.add(key)
            q.move_to_end(key)
            if not skip(key):
                out.append(key)
                from_small_n += q is small
        for key in reversed(out):
            (small if key in small else main).move_to_end(key, last=False)
        return out


class ARC(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0  # target size of t1
        self.t1: OrderedDict[bytes, None] = OrderedDict()  # seen once recently, LRU first
        self.t2: OrderedDict[bytes, None] = OrderedDict()  # seen at least twice
        self.b1: OrderedDict[bytes, None] = OrderedDict()  # ghosts evicted from t1
        self.b2: OrderedDict[bytes, None] = OrderedDict()  # ghosts evicted from t2

    def insert(self, key: bytes) -> None:
        if key in self.t1 or key in self.t2:
            self.hit(key)
            return
        c = self.capacity
        if key in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def hit(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool = False) -> None:
        if key in self.t1:
            del self.t1[key]
            if evicted:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if evicted:
                self.b2[key] = None
        else:
            return
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def order(self) -> Iterator[bytes]:
        return iter(self._sides())

    def _sides(self) -> list[bytes]:
        # REPLACE: from t1 while it is over its target p, else from t2.
        if self.t1 and (len(self.t1) > self.p or not self.t2):
            return list(self.t1) + list(self.t2)
        return list(self.t2) + list(self.t1)

    def coldest(self, limit: int, skip: Callable[[bytes], bool] = _NO_SKIP,
                budget: int | None = None) -> list[bytes]:
        budget = 4 * limit + 16 if budget is None else budget
        out: list[bytes] = []
        t1, t2 = self.t1, self.t2
        n1 = len(t1)
        it1, it2 = iter(list(t1)), iter(list(t2))
        # Each pick follows REPLACE as if the picks before it were evicted.
        while len(out) < limit and budget > 0:
            use_t1 = n1 > 0 and (n1 > self.p or len(t2) == 0)
            key = next(it1 if use_t1 else it2, None)
            if key is None:
                key = next(it2 if use_t1 else it1, None)
                if key is None:
                    break
                use_t1 = not use_t1
            budget -= 1
            if skip(key):
                continue
            out.append(key)
            if use_t1:
                n1 -= 1
        return out


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRU, "fifo": FIFO, "s3fifo": S3FIFO, "arc": ARC,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"eviction is one of {sorted(POLICIES)}, not {name!r}") from None
    return cls(capacity)

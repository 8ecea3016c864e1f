"""The store's errors: every one is an aioxfer.XferError."""

from __future__ import annotations

from aioxfer.errors import XferError

__all__ = ["BlockCorrupt", "BlockMissing", "BlockUnavailable", "KVError", "PinLimitExceeded",
           "RemoveIncomplete"]


class KVError(XferError):
    """Base of the KV store's own errors."""


class BlockCorrupt(KVError):
    """A block's bytes failed their length or checksum check. The key is
    quarantined: removed from the tier that served it, never retried there."""


class BlockUnavailable(KVError):
    """A tier could not deliver a block it holds (an I/O error, a peer lost
    mid-read); ``__cause__`` is the transport's error. The block stays where
    it is; the get's prefix ends before it."""


class BlockMissing(KVError):
    """A tier found the block gone when it went to read it (a peer that left
    or evicted it meanwhile): the get treats it as a miss, not a failure."""


class PinLimitExceeded(KVError):
    """An operation needed more pinned memory than the store's
    ``max_pinned_bytes`` allows within its wait (``pin_wait``)."""


class RemoveIncomplete(KVError):
    """``Store.remove()`` could not reach a tier's storage (the object bucket
    down, a disk error). The remove still did all it could: every other tier
    dropped the keys, and the store serves them from no tier (the failed
    tier forgot them and does not look them up again until they are put
    again). But the blocks may remain in that storage, where another store
    (or this one after a restart) can find them: remove the keys again once
    it is reachable (remove is idempotent). ``removed``: the blocks removed,
    as remove() would have returned; ``tiers``: the tiers that failed;
    ``__cause__``: the first failure."""

    def __init__(self, message: str, *, removed: int, tiers: tuple[str, ...]) -> None:
        super().__init__(message)
        self.removed = removed
        self.tiers = tiers

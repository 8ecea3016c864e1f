"""The store's errors: every one is an aioxfer.XferError."""

from __future__ import annotations

from aioxfer.errors import XferError

__all__ = ["BlockCorrupt", "BlockMissing", "BlockUnavailable", "KVError", "PinLimitExceeded"]


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

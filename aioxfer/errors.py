"""Exception classes, and the one table that maps native status codes to them.

Every error aioxfer raises derives from :class:`XferError`. Where a standard
library class means the same thing it is a second base, so that plain
``except TimeoutError`` (which also catches ``asyncio.timeout()``) or anyio's
``except anyio.ClosedResourceError`` keep working.
"""

from __future__ import annotations

import anyio

__all__ = [
    "AccessDenied",
    "ClosedResourceError",
    "ObjectExists",
    "ObjectNotFound",
    "PeerLost",
    "ProtocolError",
    "RegistrationError",
    "StalePeer",
    "TransferTimeout",
    "TransportError",
    "XferError",
    "error_for_status",
]


class XferError(Exception):
    """Base of every aioxfer error.

    ``status`` is the native status code when the error came from the engine
    (else ``None``); ``peer``, ``op`` and ``fail_index`` say which transfer failed
    and at which descriptor, where that is known.
    """

    status: int | None
    peer: str | None
    op: str | None
    fail_index: int | None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        peer: str | None = None,
        op: str | None = None,
        fail_index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.peer = peer
        self.op = op
        self.fail_index = fail_index


class PeerLost(XferError):
    """The peer died, left, or stopped answering within the peer timeout."""


class StalePeer(PeerLost):
    """The peer restarted (new incarnation): handles to its old life are fenced.

    A subclass of :class:`PeerLost`: the peer you had is gone either way.
    """


class AccessDenied(XferError):
    """Bad access key, out-of-bounds access, missing permission, or failed auth."""


class TransferTimeout(XferError, TimeoutError):
    """The engine's stall detection failed a transfer that made no progress."""


class TransportError(XferError):
    """The transport failed (connection refused or broken, copy failed)."""


class RegistrationError(XferError):
    """Memory could not be registered (not a buffer, empty, duplicate name)."""


class ProtocolError(XferError):
    """A peer sent something that does not follow the protocol."""


class ClosedResourceError(XferError, anyio.ClosedResourceError):
    """The agent, region or peer was closed by us."""


class ObjectNotFound(XferError, FileNotFoundError):
    """A key (or its bucket) does not exist in object storage."""


class ObjectExists(XferError, FileExistsError):
    """A conditional create found the key already there."""


_TABLE: dict[int, type[XferError]] | None = None


def _table() -> dict[int, type[XferError]]:
    # Built on first use so that this module imports without the compiled edge.
    global _TABLE
    if _TABLE is None:
        from aioxfer import _cyx

        _TABLE = {
            _cyx.E_INVALID: XferError,
            _cyx.E_NOMEM: XferError,
            _cyx.E_ACCESS: AccessDenied,
            _cyx.E_PEER_LOST: PeerLost,
            _cyx.E_TIMEOUT: TransferTimeout,
            _cyx.E_TRANSPORT: TransportError,
            _cyx.E_REGISTRATION: RegistrationError,
            _cyx.E_PROTOCOL: ProtocolError,
            _cyx.E_CLOSED: ClosedResourceError,
            _cyx.E_CANCELLED: XferError,
            _cyx.E_NOTFOUND: XferError,
            _cyx.E_LIMIT: TransportError,  # a resource limit refused it (aioxfer.Limits)
        }
    return _TABLE


def error_class(status: int) -> type[XferError]:
    """The exception class for a native status code."""
    return _table().get(status, XferError)


def strerror(status: int) -> str:
    from aioxfer import _cyx

    return _cyx.strerror(status)


def error_for_status(
    status: int,
    what: str,
    *,
    peer: str | None = None,
    op: str | None = None,
    fail_index: int | None = None,
) -> XferError:
    """An exception for a native status: ``"<what>: <strerror(status)>"``."""
    cls = error_class(status)
    return cls(
        f"{what}: {strerror(status)}", status=status, peer=peer, op=op, fail_index=fail_index
    )

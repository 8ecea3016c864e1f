"""Exception classes, and the one table that maps native status codes to them.

Every error aioxfer raises derives from :class:`XferError`. Where a standard
library class means the same thing it is a second base, so that plain
``except TimeoutError`` (which also catches ``asyncio.timeout()``) or anyio's
``except anyio.ClosedResourceError`` keep working.
"""

from __future__ import annotations

import anyio

from aioxfer import _abi

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


# Every status of the header's table (aioxfer/_abi.py, generated from
# native/include/aioxfer.h) -> its class, by name: a status added to the table
# without a decision here fails tests/test_abi.py.
_CLASS_BY_NAME: dict[str, type[XferError]] = {
    "OK": XferError,  # never an error; listed so that the table is complete
    "E_INVALID": XferError,
    "E_NOMEM": XferError,
    "E_ACCESS": AccessDenied,
    "E_PEER_LOST": PeerLost,
    "E_TIMEOUT": TransferTimeout,
    "E_TRANSPORT": TransportError,
    "E_REGISTRATION": RegistrationError,
    "E_PROTOCOL": ProtocolError,
    "E_CLOSED": ClosedResourceError,
    "E_CANCELLED": XferError,
    "E_NOTFOUND": XferError,
    "E_LIMIT": TransportError,  # a resource limit refused it (aioxfer.Limits)
}

_TABLE: dict[int, type[XferError]] = {
    status: _CLASS_BY_NAME.get(name, XferError) for status, name in _abi.STATUS_NAMES.items()
}


def error_class(status: int) -> type[XferError]:
    """The exception class for a native status code."""
    return _TABLE.get(status, XferError)


def strerror(status: int) -> str:
    """The header's text for a status code (what axf_strerror says)."""
    return _abi.STATUS_TEXT.get(status, "unknown status")


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

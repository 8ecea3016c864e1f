"""What the NIXL layer puts on the wire: agent metadata, listener messages,
serialized descriptor lists and notification frames.

All msgspec (never pickle: metadata and descriptor lists arrive from peers).
Compat agents talk only to compat agents; the blobs start with a magic so that
a real NIXL blob (or garbage) is refused with a clear error.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MD_MAGIC",
    "AgentMD",
    "DListBlob",
    "Fetch",
    "Invalidate",
    "Push",
    "RegionMD",
    "Reply",
    "decode_md",
    "encode_md",
    "notif_frames",
    "NotifAssembler",
]

MD_MAGIC = b"AXFNIXL1"
DL_MAGIC = b"AXFNXDL1"
# Listener frames: 4-byte big-endian length, then one msgpack message.
MAX_FRAME = 64 << 20


class RegionMD(msgspec.Struct, array_like=True, frozen=True):
    """One registered descriptor: the aioxfer region behind it is ``name``."""

    name: str
    mem: int
    addr: int
    nbytes: int
    dev: int


class AgentMD(msgspec.Struct, frozen=True):
    """An agent's metadata, whole or partial. ``address`` (the aioxfer
    agent's control address) and ``incarnation`` are the connection info;
    empty when the blob carries descriptors only. Access keys are not in it:
    the connection fetches them from the agent itself (authenticated)."""

    name: str
    address: str = ""
    incarnation: int = 0
    regions: list[RegionMD] = []
    partial: bool = False


class Push(msgspec.Struct, tag="push", frozen=True):
    md: bytes


class Fetch(msgspec.Struct, tag="fetch", frozen=True):
    name: str
    label: str = ""


class Invalidate(msgspec.Struct, tag="invalidate", frozen=True):
    name: str


class Reply(msgspec.Struct, tag="reply", frozen=True):
    ok: bool
    md: bytes = b""
    error: str = ""


Request = Push | Fetch | Invalidate

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
_md_decoder = msgspec.msgpack.Decoder(AgentMD)


def encode_md(md: AgentMD) -> bytes:
    return MD_MAGIC + encoder.encode(md)


def decode_md(blob: bytes) -> AgentMD:
    """Raises ValueError for anything that is not compat metadata."""
    blob = bytes(blob)
    if not blob.startswith(MD_MAGIC):
        raise ValueError(
            "not aioxfer.nixl agent metadata (from real NIXL, or damaged): "
            "compat agents load only each other's metadata"
        )
    try:
        md = _md_decoder.decode(blob[len(MD_MAGIC):])
    except msgspec.DecodeError as exc:
        raise ValueError(f"damaged aioxfer.nixl agent metadata: {exc}") from None
    if not md.name:
        raise ValueError("aioxfer.nixl agent metadata without an agent name")
    return md


class DListBlob(msgspec.Struct, array_like=True, frozen=True):
    """A serialized descriptor list: kind ("xfer", "reg"), mem type, the (n, 3)
    uint64 array's bytes, and (reg lists) each descriptor's meta bytes."""

    kind: str
    mem: int
    descs: bytes
    metas: list[bytes] = []


_dl_decoder = msgspec.msgpack.Decoder(DListBlob)


def encode_dlist(blob: DListBlob) -> bytes:
    return DL_MAGIC + encoder.encode(blob)


def decode_dlist(data: bytes) -> DListBlob:
    data = bytes(data)
    if not data.startswith(DL_MAGIC):
        raise ValueError("not a descriptor list serialized by aioxfer.nixl")
    try:
        return _dl_decoder.decode(data[len(DL_MAGIC):])
    except msgspec.DecodeError as exc:
        raise ValueError(f"damaged serialized descriptor list: {exc}") from None


# ---------------------------------------------------------------- notifications
#
# aioxfer carries notifications of 1..4096 bytes; NIXL's may be empty or much
# larger (a pickled descriptor list). A message that fits and does not start
# with NOTIF_MAGIC goes as it is (so plain aioxfer agents interoperate); any
# other is framed: NOTIF_MAGIC + b"W" (whole) / b"F" (a fragment, more follow)
# / b"L" (the last fragment) + bytes. Fragments of one message are sent in
# order on one peer's connection; a WRITE carries the last one, so the message
# is complete only once the WRITE's data is in place.

NOTIF_MAGIC = b"\xffAXN"
NOTIF_MAX = 4096
_CHUNK = NOTIF_MAX - len(NOTIF_MAGIC) - 1


def notif_frames(msg: bytes) -> list[bytes]:
    if 0 < len(msg) <= NOTIF_MAX and not msg.startswith(NOTIF_MAGIC):
        return [msg]
    if len(msg) <= _CHUNK:
        return [NOTIF_MAGIC + b"W" + msg]
    chunks = [msg[i:i + _CHUNK] for i in range(0, len(msg), _CHUNK)]
    return [NOTIF_MAGIC + b"F" + c for c in chunks[:-1]] + [NOTIF_MAGIC + b"L" + chunks[-1]]


class NotifAssembler:
    """Turns received frames back into messages, per sender."""

    __slots__ = ("_partial",)

    def __init__(self) -> None:
        self._partial: dict[str, list[bytes]] = {}

    def feed(self, sender: str, frame: bytes) -> bytes | None:
        if not frame.startswith(NOTIF_MAGIC):
            return frame
        kind = frame[len(NOTIF_MAGIC):len(NOTIF_MAGIC) + 1]
        body = frame[len(NOTIF_MAGIC) + 1:]
        if kind == b"W":
            return body
        if kind == b"F":
            self._partial.setdefault(sender, []).append(body)
            return None
        if kind == b"L":
            parts = self._partial.pop(sender, [])
            parts.append(body)
            return b"".join(parts)
        return frame  # not ours after all: hand it over as it is

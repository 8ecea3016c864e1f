"""What the NIXL layer puts on the wire: agent metadata, listener messages,
serialized descriptor lists and notification frames.

All msgspec (never pickle: metadata and descriptor lists arrive from peers).
Compat agents talk only to compat agents; the blobs start with a magic so that
a real NIXL blob (or garbage) is refused with a clear error.
"""

from __future__ import annotations

import os

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
    for r in md.regions:
        # (Values a peer controls: each must fit the uint64 tables they are
        # searched in, else numpy raises later, untyped.)
        if not (0 <= r.addr and 0 <= r.nbytes and r.addr + r.nbytes <= _U64_MAX
                and 0 <= r.dev <= _U64_MAX and 0 <= r.mem < 2**31):
            raise ValueError(f"damaged aioxfer.nixl agent metadata: region {r.name!r} "
                             f"(mem {r.mem}, {r.addr:#x}+{r.nbytes}, dev {r.dev}) does not "
                             f"fit 64 bits")
    return md


_U64_MAX = 2**64 - 1


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
# other is framed: NOTIF_MAGIC + b"W" (whole) + bytes, or NOTIF_MAGIC + b"F"
# (a fragment, more follow) / b"L" (the last fragment) + the message's random
# 8-byte id + bytes. Fragments of one message are sent in order on one peer's
# connection; a WRITE carries the last one, so the message is complete only
# once the WRITE's data is in place. The id keeps a message whose WRITE failed
# after its first fragments went (they stay with the receiver, never to be
# completed) out of the sender's next message; at most _MAX_PARTIAL such
# messages per sender are kept.

NOTIF_MAGIC = b"\xffAXN"
NOTIF_MAX = 4096
_ID = 8
_CHUNK = NOTIF_MAX - len(NOTIF_MAGIC) - 1 - _ID
_MAX_PARTIAL = 8


def notif_frames(msg: bytes) -> list[bytes]:
    if 0 < len(msg) <= NOTIF_MAX and not msg.startswith(NOTIF_MAGIC):
        return [msg]
    if len(msg) <= NOTIF_MAX - len(NOTIF_MAGIC) - 1:
        return [NOTIF_MAGIC + b"W" + msg]
    mid = os.urandom(_ID)
    chunks = [msg[i:i + _CHUNK] for i in range(0, len(msg), _CHUNK)]
    return ([NOTIF_MAGIC + b"F" + mid + c for c in chunks[:-1]]
            + [NOTIF_MAGIC + b"L" + mid + chunks[-1]])


class NotifAssembler:
    """Turns received frames back into messages, per sender."""

    __slots__ = ("_partial",)

    def __init__(self) -> None:
        # sender -> message id -> its fragments so far (oldest message first)
        self._partial: dict[str, dict[bytes, list[bytes]]] = {}

    def feed(self, sender: str, frame: bytes) -> bytes | None:
        if not frame.startswith(NOTIF_MAGIC):
            return frame
        head = len(NOTIF_MAGIC)
        kind = frame[head:head + 1]
        if kind == b"W":
            return frame[head + 1:]
        if kind not in (b"F", b"L") or len(frame) < head + 1 + _ID:
            return frame  # not ours after all: hand it over as it is
        mid = frame[head + 1:head + 1 + _ID]
        body = frame[head + 1 + _ID:]
        partial = self._partial.get(sender)
        if kind == b"F":
            if partial is None:
                partial = self._partial[sender] = {}
            parts = partial.get(mid)
            if parts is None:
                while len(partial) >= _MAX_PARTIAL:  # (orphans of failed WRITEs)
                    del partial[next(iter(partial))]
                parts = partial[mid] = []
            parts.append(body)
            return None
        parts = partial.pop(mid, None) if partial is not None else None
        if partial is not None and not partial:
            del self._partial[sender]
        if parts is None:
            return body
        parts.append(body)
        return b"".join(parts)

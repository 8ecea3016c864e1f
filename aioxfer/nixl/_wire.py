"""What the NIXL layer puts on the wire: agent metadata, listener messages,
serialized descriptor lists and notification frames.

All msgspec (never pickle: metadata and descriptor lists arrive from peers).
Compat agents talk only to compat agents; the blobs start with a magic so that
a real NIXL blob (or garbage) is refused with a clear error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from aioxfer.auth import hmac_key
from aioxfer.errors import ProtocolError
from aioxfer.metadata import check_address
from aioxfer.names import MAX_NAME, name_problem

__all__ = [
    "MD_MAGIC",
    "AgentMD",
    "DListBlob",
    "Fetch",
    "Invalidate",
    "CLIENT_NONCE",
    "ListenerVersionError",
    "Push",
    "RegionMD",
    "Reply",
    "decode_md",
    "encode_md",
    "notif_frames",
    "NotMetadata",
    "NotifAssembler",
]

MD_MAGIC = b"AXFNIXL1"
DL_MAGIC = b"AXFNXDL1"
# Listener frames: 4-byte big-endian length, then one msgpack message.
MAX_FRAME = 64 << 20
# A listener request proves knowledge of the agent's token (the token of its
# aioxfer agent, which every connection it makes needs anyway), as aioxfer's
# own handshake does: the listener first sends its greeting (LISTEN_NONCE
# bytes: GREETING_MAGIC, its wire version, fresh random bytes); the client
# then sends the length, HMAC(key, len ctx + greeting + length), the body,
# HMAC(key, body ctx + greeting + body), key = auth.hmac_key(token), the
# contexts naming the wire version that made them. The first MAC is checked before the body
# is read, so a client without the token makes the listener hold 4 +
# LISTEN_MAC bytes, not MAX_FRAME; the fresh bytes make a recorded request
# useless on another connection. Each request carries a fresh client
# nonce (its ``nonce`` field, CLIENT_NONCE random bytes) and each reply is
# proved too (version 3): 4-byte length, body, HMAC(key, reply ctx +
# greeting + the request's body MAC + length + body); the request's body
# MAC covers the greeting and the client's nonce, so a reply is good for
# that one request only, and only from a holder of the token. Before
# version 3 replies were plain frames: whoever answered a client's
# connection (a process squatting on the listener's port while the agent
# was down, a man in the middle) had its metadata, its refusal or its
# acknowledgement believed; the client now refuses such a reply (a
# ValueError naming the listener) before decoding it. No TLS (as aioxfer's
# own: see SECURITY.md): a reply is proved, not hidden. What a reply says
# is checked where it is used too (the connection to the address it gives
# authenticates, and only ranges the peer itself advertised are used).
#
# Versions (WIRE_VERSION). Version 1 (aioxfer.nixl up to main 07d60a7) had
# no version field: its greeting was 16 random bytes and its contexts end in
# "-v1". From version 2 on, the greeting's layout never changes (it is what
# each side reads leniently), and both directions of a mismatch end at once,
# named on both sides, never as a bad token:
# - the client reads the greeting's version before it sends a proof; of
#   another version it sends a VersionNotice (LISTEN_MAGIC bytes, which no
#   listener of version 2 or later reads as a length: the first byte is
#   0xff, over any MAX_FRAME) and raises ListenerVersionError; the listener
#   logs the client's version. A greeting without GREETING_MAGIC is version
#   1's: the client sends it a version-1 request (its MACs) whose message
#   type names our version, which a version-1 listener logs as an invalid
#   value ("Invalid value 'aioxfer.nixl listener wire version 2 ...'");
# - a version-1 client uses the greeting as its nonce and MACs with the
#   "-v1" contexts: the listener, its MAC over our greeting matching those,
#   reads the request (bounded as any) and answers a refusal (Reply ok=False)
#   naming both versions, which a version-1 client raises as the listener's
#   refusal text; a request without a MAC of either kind is refused as
#   before ("without this agent's token").
#
# Version 3 (this one) adds the client's nonce to the request's body and the
# reply's MAC; a request's layout and its MAC contexts are version 2's
# (named "-v2"): a client checks the greeting's version before it sends
# one, so no request of one version reaches a listener of another.
WIRE_VERSION = 3
GREETING_MAGIC = b"AXNL"
NOTICE_MAGIC = b"\xffAXV"
LISTEN_NONCE = 16  # the greeting's length: version 1's nonce, so its clients read it whole
LISTEN_MAC = 32
LISTEN_HEAD = 4 + LISTEN_MAC  # a request's length and its MAC; a VersionNotice's size
_LISTEN_LEN_CTX = b"aioxfer-nixl-listen-len-v2\x00"
_LISTEN_BODY_CTX = b"aioxfer-nixl-listen-body-v2\x00"
_REPLY_CTX = b"aioxfer-nixl-listen-reply-v3\x00"
CLIENT_NONCE = 16  # the request's own fresh bytes (its ``nonce``): what binds a reply to it
_V1_LEN_CTX = b"aioxfer-nixl-listen-len-v1\x00"
_V1_BODY_CTX = b"aioxfer-nixl-listen-body-v1\x00"
# The most a reply to a Push or an Invalidate may have (an acknowledgement,
# or an error text): a client reads no more of a reply announced longer. A
# Fetch's reply carries the listener's metadata: up to MAX_FRAME.
MAX_ACK = 64 << 10
# The most of a listener's refusal text (Reply.error) a client keeps: it
# becomes an exception's message and a log line.
MAX_ERROR_CHARS = 1024
# Listener connections served at once; more are closed at accept (each is
# bounded in time by the listener's request timeout).
MAX_LISTEN_CONNS = 64


class ListenerVersionError(ProtocolError):
    """The other end of a metadata listener connection speaks another
    listener wire version (named in the message): a client of one aioxfer
    version fetching from or pushing to an agent of another."""


def greeting() -> bytes:
    """What the listener sends first: GREETING_MAGIC, WIRE_VERSION (2 bytes,
    big-endian), fresh random bytes; LISTEN_NONCE bytes in all."""
    return (GREETING_MAGIC + WIRE_VERSION.to_bytes(2, "big")
            + os.urandom(LISTEN_NONCE - len(GREETING_MAGIC) - 2))


def greeting_version(data: bytes) -> int:
    """The wire version a listener's greeting says; 1 for one without
    GREETING_MAGIC (version 1's greeting was random bytes only)."""
    if len(data) != LISTEN_NONCE or not data.startswith(GREETING_MAGIC):
        return 1
    return int.from_bytes(data[len(GREETING_MAGIC):len(GREETING_MAGIC) + 2], "big")


def version_notice() -> bytes:
    """What a client sends a listener of another version (2 or later)
    instead of a request: NOTICE_MAGIC, its version, zeros; LISTEN_HEAD
    bytes, the listener's first read."""
    return (NOTICE_MAGIC + WIRE_VERSION.to_bytes(2, "big")
            + bytes(LISTEN_HEAD - len(NOTICE_MAGIC) - 2))


def notice_version(head: bytes | bytearray) -> int | None:
    """The version a client's VersionNotice says, None when ``head`` is not one."""
    if len(head) < len(NOTICE_MAGIC) + 2 or not head.startswith(NOTICE_MAGIC):
        return None
    return int.from_bytes(head[len(NOTICE_MAGIC):len(NOTICE_MAGIC) + 2], "big")


# Real NIXL's metadata listener protocol (its P2P metadata backend): each
# message an 8-byte native-endian length, then "NIXLCOMM:" and a 4-letter
# command (SEND: send me your metadata; LOAD<blob>; INVL<agent>). The two
# protocols cannot talk (ours greets first, NIXL's client speaks first), so
# each side only says clearly what it met.
NIXL_COMM = b"NIXLCOMM:"
NIXL_NOT_US = ("NIXL and aioxfer.nixl metadata listeners do not interoperate: exchange "
               "metadata between aioxfer.nixl agents only")


def nixl_command(data: bytes | bytearray) -> str | None:
    """The command of real NIXL's listener message at the start of ``data``
    ("SEND", "LOAD", "INVL"), None when ``data`` is not one."""
    if bytes(data[8:8 + len(NIXL_COMM)]) != NIXL_COMM:
        return None
    start = 8 + len(NIXL_COMM)
    return bytes(data[start:start + 4]).decode("ascii", "replace") or "?"


def older_listener_notice(token: bytes, nonce: bytes) -> bytes:
    """A version-1 request (its MACs over ``nonce``, the greeting of a
    listener of version 1) whose message type names our version: such a
    listener cannot decode it and logs the value it refused."""
    body = encoder.encode({"type": f"aioxfer.nixl listener wire version {WIRE_VERSION} "
                                   f"(this listener speaks version 1: use one aioxfer "
                                   f"version on both sides)"})
    head = len(body).to_bytes(4, "big")
    key = hmac_key(token)
    return (head + hmac.new(key, _V1_LEN_CTX + nonce + head, hashlib.sha256).digest() + body
            + hmac.new(key, _V1_BODY_CTX + nonce + body, hashlib.sha256).digest())


def older_client_refusal() -> str:
    """The refusal a version-1 client is answered with (its listener error text)."""
    return (f"this metadata listener speaks listener wire version {WIRE_VERSION}, the "
            f"client version 1 (an older aioxfer.nixl): use one aioxfer version on both "
            f"sides")


def listen_len_mac(token: bytes, nonce: bytes, head: bytes) -> bytes:
    # Keyed on the stretched token, as aioxfer's handshake (auth.hmac_key,
    # cached: the agent derived it when it was made): a listener a client
    # dials by mistake gets a MAC that costs a derivation per token guess.
    return hmac.new(hmac_key(token), _LISTEN_LEN_CTX + nonce + head, hashlib.sha256).digest()


def listen_body_mac(token: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(hmac_key(token), _LISTEN_BODY_CTX + nonce + body, hashlib.sha256).digest()


def v1_len_mac(token: bytes, nonce: bytes, head: bytes) -> bytes:
    """A version-1 client's length MAC (how a listener tells one)."""
    return hmac.new(hmac_key(token), _V1_LEN_CTX + nonce + head, hashlib.sha256).digest()


def listen_request(token: bytes, nonce: bytes, body: bytes) -> bytes:
    """A request as a client with ``token`` sends it after the greeting
    ``nonce``; its last LISTEN_MAC bytes are its body's MAC (what the
    reply's proves it answers: reply_frame)."""
    head = len(body).to_bytes(4, "big")
    return (head + listen_len_mac(token, nonce, head) + body
            + listen_body_mac(token, nonce, body))


def reply_mac(token: bytes, nonce: bytes, request_mac: bytes, head: bytes,
              body: bytes | bytearray | memoryview) -> bytes:
    """The MAC of a reply (its length ``head`` and ``body``) to the request
    whose body MAC was ``request_mac``, on the connection greeted with
    ``nonce``."""
    mac = hmac.new(hmac_key(token), _REPLY_CTX + nonce + request_mac + head, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def reply_frame(token: bytes, nonce: bytes, request_mac: bytes, body: bytes) -> bytes:
    """A reply as a listener with ``token`` sends it: length, body, MAC."""
    head = len(body).to_bytes(4, "big")
    return head + body + reply_mac(token, nonce, request_mac, head, body)


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


# (``nonce``: the client's fresh CLIENT_NONCE bytes, which the reply's MAC
# covers through the request's; the listener reads it as any other byte of
# the body: it protects the client, which made it.)
class Push(msgspec.Struct, tag="push", frozen=True):
    md: bytes
    nonce: bytes = b""


class Fetch(msgspec.Struct, tag="fetch", frozen=True):
    name: str
    label: str = ""
    nonce: bytes = b""


class Invalidate(msgspec.Struct, tag="invalidate", frozen=True):
    name: str
    nonce: bytes = b""


class Reply(msgspec.Struct, tag="reply", frozen=True):
    ok: bool
    md: bytes = b""
    error: str = ""


Request = Push | Fetch | Invalidate

_T = TypeVar("_T")


class _Decoder(Generic[_T]):
    """A msgpack decoder for bytes from a peer: msgpack nested past the
    interpreter's recursion limit (in a field the Struct does not have,
    which msgspec skips recursively) is a DecodeError like any other
    malformed input, never a RecursionError (fuzz31)."""

    __slots__ = ("_decode",)

    def __init__(self, type_: Any) -> None:  # (a union is no type[_T])
        self._decode: Callable[[bytes | bytearray | memoryview], _T] = (
            msgspec.msgpack.Decoder(type_).decode)

    def decode(self, data: bytes | bytearray | memoryview) -> _T:
        try:
            return self._decode(data)
        except RecursionError:
            raise msgspec.DecodeError("msgpack nested too deeply") from None


request_decoder: _Decoder[Request] = _Decoder(Request)
reply_decoder: _Decoder[Reply] = _Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
_md_decoder: _Decoder[AgentMD] = _Decoder(AgentMD)


def encode_md(md: AgentMD) -> bytes:
    return MD_MAGIC + encoder.encode(md)


class NotMetadata(ValueError):
    """Bytes that do not decode as compat metadata at all (NIXL's
    deserialisation failure: NIXL_ERR_MISMATCH), as opposed to metadata whose
    decoded values are refused (NIXL_ERR_INVALID_PARAM)."""


def decode_md(blob: bytes) -> AgentMD:
    """Raises NotMetadata for bytes that are not compat metadata, ValueError
    for compat metadata with values that cannot be used."""
    blob = bytes(blob)
    if not blob.startswith(MD_MAGIC):
        raise NotMetadata(
            "not aioxfer.nixl agent metadata (from real NIXL, or damaged): "
            "compat agents load only each other's metadata"
        )
    try:
        md = _md_decoder.decode(blob[len(MD_MAGIC):])
    except msgspec.DecodeError as exc:
        raise NotMetadata(f"damaged aioxfer.nixl agent metadata: {exc}") from None
    if not md.name:
        raise ValueError("aioxfer.nixl agent metadata without an agent name")
    # (The name a peer gives itself: held to aioxfer's rule for names, as
    # its aioxfer agent's handshake is; it keys our remote-agent table and
    # reaches logs and errors.)
    why = name_problem(md.name)
    if why is not None:
        raise ValueError(f"damaged aioxfer.nixl agent metadata: {why}")
    if md.address:
        # (Dialled by loadRemoteMD: else a bad one raised the dialling code's
        # builtin ValueError or UnicodeError, not NIXL's invalid-parameter.)
        try:
            check_address(md.address)
        except ValueError as exc:
            raise ValueError(f"damaged aioxfer.nixl agent metadata: address {exc}") from None
    for r in md.regions:
        # (A region's name is an aioxfer region's, at most MAX_NAME: a longer
        # one names none, and would be quoted whole in errors and logs.)
        if len(r.name) > MAX_NAME:
            raise ValueError(f"damaged aioxfer.nixl agent metadata: a region name of "
                             f"{len(r.name)} characters (at most {MAX_NAME})")
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
    uint64 array's bytes, and (reg lists) each descriptor's meta bytes.

    NIXL's get_serialized_descs pickles whatever it is given; of that, the
    descriptor-shaped inputs come back here as they went (the fields after
    ``metas``, absent from the lists' blobs, which older peers still read):
    kind "ndarray", an integer numpy array: ``descs`` its bytes in C order,
    ``dtype`` its numpy type string, ``shape``; kind "list" or "tuple", a
    list (tuple) of descriptor tuples: ``rows``, each three integers and
    maybe a meta (str or bytes), and ``inner`` one letter per row, "t" a
    tuple, "l" a list."""

    kind: str
    mem: int
    descs: bytes
    metas: list[bytes] = []
    dtype: str = ""
    shape: list[int] = []
    rows: list[list[Any]] = []  # (checked by the reader: ints, then str or bytes)
    inner: str = ""


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
    except RecursionError:  # a row (rows: Any) nested past the interpreter's limit
        raise ValueError("damaged serialized descriptor list: nested too deeply") from None


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
# messages, and _MAX_PARTIAL_BYTES of their fragments, are kept per sender:
# past either bound the oldest message is dropped (logged), and the rest of
# its fragments, when they come, with it (never handed over as a truncated
# message). All senders together keep at most _MAX_HELD_BYTES: past it the
# oldest message of the sender holding most goes (senders that die mid-message
# are never told of, and each new name, as in an elastic cluster or from a
# peer connecting under many, would else keep its own 64 MiB for good).

NOTIF_MAGIC = b"\xffAXN"
NOTIF_MAX = 4096
_ID = 8
_CHUNK = NOTIF_MAX - len(NOTIF_MAGIC) - 1 - _ID
_MAX_PARTIAL = 8
_MAX_PARTIAL_BYTES = 64 << 20  # per sender: a peer never sending a last fragment
_MAX_DROPPED = 64  # per sender: ids of dropped messages whose fragments are ignored
_MAX_HELD_BYTES = 256 << 20  # all senders together


def notif_frames(msg: bytes) -> list[bytes]:
    if 0 < len(msg) <= NOTIF_MAX and not msg.startswith(NOTIF_MAGIC):
        return [msg]
    if len(msg) <= NOTIF_MAX - len(NOTIF_MAGIC) - 1:
        return [NOTIF_MAGIC + b"W" + msg]
    mid = os.urandom(_ID)
    chunks = [msg[i:i + _CHUNK] for i in range(0, len(msg), _CHUNK)]
    return ([NOTIF_MAGIC + b"F" + mid + c for c in chunks[:-1]]
            + [NOTIF_MAGIC + b"L" + mid + chunks[-1]])


class _Sender:
    """What one sender's messages not yet whole hold."""

    __slots__ = ("partial", "held", "dropped")

    def __init__(self) -> None:
        self.partial: dict[bytes, list[bytes]] = {}  # id -> fragments (oldest first)
        self.held = 0  # bytes of those fragments
        self.dropped: dict[bytes, None] = {}  # ids dropped, their fragments ignored


class NotifAssembler:
    """Turns received frames back into messages, per sender. ``on_drop(sender,
    nbytes)`` is told of each partial message dropped at a bound."""

    __slots__ = ("_senders", "_on_drop", "_held")

    def __init__(self, on_drop: Callable[[str, int], None] | None = None) -> None:
        self._senders: dict[str, _Sender] = {}
        self._on_drop = on_drop
        self._held = 0  # bytes of fragments held, all senders

    def held(self) -> int:
        """Bytes of fragments held, all senders."""
        return self._held

    def _drop_oldest(self, sender: str, st: _Sender) -> None:
        mid = next(iter(st.partial))
        nbytes = sum(map(len, st.partial.pop(mid)))
        st.held -= nbytes
        self._held -= nbytes
        st.dropped[mid] = None
        while len(st.dropped) > _MAX_DROPPED:
            del st.dropped[next(iter(st.dropped))]
        if self._on_drop is not None:
            self._on_drop(sender, nbytes)

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
        st = self._senders.get(sender)
        if kind == b"F":
            if st is None:
                st = self._senders[sender] = _Sender()
            elif mid in st.dropped:
                return None  # the rest of a message dropped at a bound
            parts = st.partial.get(mid)
            if parts is None:
                while len(st.partial) >= _MAX_PARTIAL:  # (orphans of failed WRITEs)
                    self._drop_oldest(sender, st)
                parts = st.partial[mid] = []
            parts.append(body)
            st.held += len(body)
            self._held += len(body)
            # (A peer that never sends a message's last fragment must not
            # grow our memory without bound: this message goes too, once it
            # is the oldest.)
            while st.held > _MAX_PARTIAL_BYTES:
                self._drop_oldest(sender, st)
            while self._held > _MAX_HELD_BYTES:
                hog, hst = max(self._senders.items(), key=lambda kv: kv[1].held)
                self._drop_oldest(hog, hst)
            return None
        if st is None:
            return body
        parts = st.partial.pop(mid, None)
        dropped = parts is None and mid in st.dropped
        if dropped:
            del st.dropped[mid]
        elif parts is not None:
            n = sum(map(len, parts))
            st.held -= n
            self._held -= n
        if not st.partial and not st.dropped:
            del self._senders[sender]
        if dropped:
            return None
        if parts is None:
            return body
        parts.append(body)
        return b"".join(parts)

"""Control-plane messages: msgspec Structs, versioned, never pickled.

Every message is a tagged Struct, so one decoder reads any of them and rejects
anything else. New fields are only ever added with defaults, so that an agent
reads what an older or newer agent of the same major ``version`` sends
(unknown fields are ignored by msgspec).
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "Accept",
    "AgentMeta",
    "Challenge",
    "CudaExport",
    "Frame",
    "Hello",
    "Proof",
    "RegionMeta",
    "Reject",
    "VerbsAccept",
    "VerbsConnect",
    "VerbsQP",
]

PROTOCOL_VERSION = 1

Purpose = Literal["meta", "data", "verbs"]


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First frame of every connection, client to server."""

    version: int
    name: str
    incarnation: int
    purpose: Purpose
    nonce: bytes
    byteorder: str = "little"


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    """Server to client when the server has a token.

    ``proof`` = HMAC(token, server context + client nonce): the server shows it
    knows the token too; ``nonce`` is what the client must answer.
    """

    nonce: bytes
    proof: bytes


class Proof(msgspec.Struct, tag="proof", frozen=True):
    """Client's answer: HMAC(token, client context + server nonce + client name)."""

    proof: bytes


class Accept(msgspec.Struct, tag="accept", frozen=True):
    """The server accepts the connection; for "data" the native bytes follow."""

    name: str = ""
    incarnation: int = 0


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """The server refuses the connection and closes it."""

    reason: str


class CudaExport(msgspec.Struct, frozen=True):
    """How a same-host peer maps a GPU region: the CUDA IPC handle of its
    allocation, the region's offset in it, and the device's UUID."""

    handle: bytes  # CUipcMemHandle, 64 bytes
    offset: int
    device: bytes  # CUuuid, 16 bytes
    version: int = 1


class RegionMeta(msgspec.Struct, frozen=True):
    """What a peer needs to address one registered region."""

    name: str
    rid: int
    key: int
    nbytes: int
    access: int
    addr: int  # the region's address in the owner process (cross-memory attach)
    memfd: int = -1  # fd number in the owner process for alloc'd regions, else -1
    memfd_ino: int = 0  # inode of that memfd: lets a peer check it maps the right file
    # RDMA: (address, rkey) of its memory registration on each of the owner's
    # verbs devices, in device order; empty without verbs.
    verbs: list[tuple[int, int]] = []
    kind: str = "host"  # memory kind: "host" or "cuda" (addr is then a device pointer)
    cuda: CudaExport | None = None  # cuda regions that can be shared by CUDA IPC


class AgentMeta(msgspec.Struct, tag="meta", frozen=True):
    """An agent's metadata, served on its own port to "meta" connections."""

    version: int
    name: str
    incarnation: int
    host_id: str
    pid: int
    address: str
    transports: list[str]
    regions: list[RegionMeta]
    uid: int = -1
    byteorder: str = "little"
    # Every listen address (the first is ``address``): the paths (rails) a TCP
    # peer stripes its connections over. Empty from older agents: ``address``.
    rails: list[str] = []
    # RDMA verbs devices (name and GID), in device order: peers pair theirs
    # with ours by index, one queue pair per pair (a rail). Empty: no verbs.
    verbs_devices: list[str] = []


class VerbsQP(msgspec.Struct, frozen=True):
    """What a peer needs to connect a reliable-connected queue pair to ours."""

    qpn: int
    psn: int
    mtu: int
    lid: int
    port: int
    gid_index: int
    gid: bytes


class VerbsConnect(msgspec.Struct, tag="verbs_connect", frozen=True):
    """Client to server on a "verbs" connection after Accept: the client's
    queue pairs, one per rail (rail i joins the client's device i and the
    server's device i)."""

    qps: list[VerbsQP]


class VerbsAccept(msgspec.Struct, tag="verbs_accept", frozen=True):
    """The server's queue pairs for them; the native engine frames follow."""

    qps: list[VerbsQP]


Frame = Hello | Challenge | Proof | Accept | Reject | AgentMeta | VerbsConnect | VerbsAccept

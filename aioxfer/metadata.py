"""Control-plane messages: msgspec Structs, versioned, never pickled.

Every message is a tagged Struct, so one decoder reads any of them and rejects
anything else. New fields are only ever added with defaults, so that an agent
reads what an older or newer agent of the same major ``version`` sends
(unknown fields are ignored by msgspec).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from aioxfer.names import MAX_NAME, check_name

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

# 2: same-host peers meet on a unix socket (kernel-verified pid/uid, memfds by
# SCM_RIGHTS); every connection authenticates by default.
# 3: tcp frames may be vectored (FR_WRITEV, FR_READV, FR_READV_RESP: several
# chunks of a request in one frame), which a version-2 engine rejects.
# 4: the server speaks first (Challenge at accept), its proof moved into
# Accept; an older peer meets a frame it cannot decode, or a Reject naming
# the version, never a wait.
# 5: every HMAC keys on the stretched token (auth.hmac_key: scrypt), not on
# the token itself. A version-4 peer's proofs would only fail as a bad token
# (AccessDenied): the version makes either side name it instead (the client
# checks the Challenge's version before it sends a proof).
PROTOCOL_VERSION = 5

# Bounds a peer's messages are validated against while decoding (a violation is
# a ProtocolError, never an OverflowError or a huge allocation later on).
MAX_REGIONS = 1 << 20  # regions in one agent's metadata
MAX_RAILS = 16  # listen addresses an agent may advertise (Agent(max_rails=) dials fewer)
# MAX_NAME (256): aioxfer.names, the one rule for names
MAX_ADDRESS = 300
MAX_JOINS = 63  # connections that may join one Challenge (Hello.joins)

# msgspec bounds must fit an int64: the upper bound of a u64 is checked in
# __post_init__ (msgpack cannot carry more anyway; JSON from etcd can).
U64 = Annotated[int, msgspec.Meta(ge=0)]
_U64_MAX = (1 << 64) - 1


def _check_u64(*values: int) -> None:
    for v in values:
        if v > _U64_MAX:
            raise ValueError(f"{v} does not fit in an unsigned 64-bit integer")


def check_address(a: str) -> None:
    """A peer's "host:port" as dialling parses it (dialing.parse_address) and
    the resolver takes it: else a rail of a peer's metadata failed connect()
    with a builtin ValueError or UnicodeError (idna), not a ProtocolError."""
    host, sep, port = a.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ok = bool(sep and host and port.isascii() and port.isdigit() and int(port) <= 65535
              and "\x00" not in host)
    if ok:
        try:
            host.encode("idna")
        except UnicodeError:
            ok = False
    if not ok:
        raise ValueError(f"{a!r} is not a host:port address")


I32 = Annotated[int, msgspec.Meta(ge=-(1 << 31), le=(1 << 31) - 1)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS)]
Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]

Purpose = Literal["meta", "data", "verbs"]


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First frame of every connection, client to server."""

    version: I32
    name: Name
    incarnation: U64
    purpose: Purpose
    nonce: Nonce
    byteorder: Literal["little", "big"] = "little"
    # "data" only: the server sends its metadata (AgentMeta; on the unix socket
    # its memfds follow) right after Accept, then hands the connection to its
    # engine: no separate "meta" connection (two round trips fewer).
    meta: bool = False
    # "meta" only: the Accept alone (who answered, where its unix socket is),
    # no metadata after it; a same-host agent asks this first. A server that
    # predates it sends the metadata anyway, which such a client never reads.
    accept_only: bool = False
    # A first "data" connection or accept_only "meta" probe (with a token):
    # this many more "data" connections of ours will join its Challenge
    # (authenticate against its nonce, see ``join``), each once, within the
    # server's peer timeout.
    joins: Annotated[int, msgspec.Meta(ge=0, le=MAX_JOINS)] = 0
    # One of those connections: the first one's Challenge.nonce, which of its
    # ``joins`` this is (1-based), and HMAC(key, join context + join +
    # join_index + nonce + name). Accepted once: Accept at once, no Proof;
    # anything else gets its Challenge again and proves the token.
    join: Nonce = b""
    join_index: Annotated[int, msgspec.Meta(ge=0, le=MAX_JOINS)] = 0
    join_proof: Nonce = b""
    # Same host only (the unix socket, or tcp to a loopback address): the
    # early proof, HMAC(key, early context + every field above + early_ts +
    # the server's socket address), early_ts the client's time.time_ns(). A
    # server that takes it sends its Challenge (``early``) and the proved
    # Accept together: no Proof round (protocol.EarlyProofs). An older server
    # ignores both fields.
    early_ts: U64 = 0
    early_proof: Nonce = b""

    def __post_init__(self) -> None:
        _check_u64(self.incarnation, self.early_ts)
        # (A peer's name, held to our own names' rule where it enters:
        # aioxfer.names. A decode raises ProtocolError.)
        check_name(self.name)


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    """The server's first frame, sent as it accepts, before it reads a byte.

    ``nonce``: what the client must prove the token over (empty when the
    server has no token); ``version``: the server's PROTOCOL_VERSION, so a
    client of another version stops with a clear error. Sent again on a
    connection whose join was not honoured: prove the token after all.
    """

    version: I32
    nonce: Nonce
    # The server took the Hello's early proof: the proved Accept follows in
    # the same send, and the client sends no Proof (it checks the Accept's
    # proof over both nonces as ever). Only ever set with that Accept
    # behind it; an older server never sets it.
    early: bool = False


class Proof(msgspec.Struct, tag="proof", frozen=True):
    """Client's answer: HMAC(key, client context + server nonce + client
    nonce + client name), key = auth.hmac_key(token) (as in every proof)."""

    proof: Nonce


class Accept(msgspec.Struct, tag="accept", frozen=True):
    """The server accepts the connection; for "data" the native bytes follow."""

    name: Name = ""
    incarnation: U64 = 0
    # Sent only after authentication: where a same-host client may go next
    # (the server's unix socket, see AgentMeta.local) without a tcp metadata fetch.
    host_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    local: Address = ""
    # The AgentMeta the client asked for (Hello.meta) follows (an older server
    # ignores the request: then the client fetches it on its own connection).
    meta: bool = False
    # With a token: HMAC(key, server context + client nonce + server
    # nonce), the server's proof that it knows the token too. The client
    # checks it before it trusts anything of this Accept or after it.
    proof: Nonce = b""

    def __post_init__(self) -> None:
        _check_u64(self.incarnation)
        if self.name:  # (empty: a server that names nobody, as before)
            check_name(self.name)


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """The server refuses the connection and closes it."""

    reason: Annotated[str, msgspec.Meta(max_length=1024)]


class CudaExport(msgspec.Struct, frozen=True):
    """How a same-host peer maps a GPU region: the CUDA IPC handle of its
    allocation, the region's offset in it, and the device's UUID."""

    handle: Annotated[bytes, msgspec.Meta(max_length=64)]  # CUipcMemHandle, 64 bytes
    offset: U64
    device: Annotated[bytes, msgspec.Meta(max_length=16)]  # CUuuid, 16 bytes
    version: I32 = 1


class RegionMeta(msgspec.Struct, frozen=True):
    """What a peer needs to address one registered region."""

    name: Name
    rid: U64
    key: U64
    nbytes: U64
    access: Annotated[int, msgspec.Meta(ge=0, le=3)]
    addr: U64  # the region's address in the owner process (cross-memory attach)
    # Alloc'd regions served on a same-host (unix) connection: the index of its
    # memfd among the fds that follow the metadata (SCM_RIGHTS); else -1. A
    # number is never opened through /proc: only an fd the kernel passed us.
    memfd: I32 = -1
    # RDMA: (address, rkey) of its memory registration on each of the owner's
    # verbs devices, in device order; empty without verbs.
    verbs: Annotated[list[tuple[U64, U64]], msgspec.Meta(max_length=MAX_RAILS)] = []
    kind: Literal["host", "cuda"] = "host"  # "cuda": addr is a device pointer
    cuda: CudaExport | None = None  # cuda regions that can be shared by CUDA IPC

    def __post_init__(self) -> None:
        _check_u64(self.rid, self.key, self.nbytes, self.addr)
        if self.addr + self.nbytes > _U64_MAX + 1:
            raise ValueError("region wraps around the address space")
        for addr, rkey in self.verbs:
            _check_u64(addr)
            if rkey >= 1 << 32:
                raise ValueError("an rkey is 32 bits")


class AgentMeta(msgspec.Struct, tag="meta", frozen=True):
    """An agent's metadata, served on its own port to "meta" connections."""

    version: I32
    name: Name
    incarnation: U64
    host_id: Annotated[str, msgspec.Meta(max_length=128)]
    pid: I32  # informational: same-host peers use the pid the kernel reports
    address: Address
    transports: Annotated[list[Name], msgspec.Meta(max_length=16)]
    regions: Annotated[list[RegionMeta], msgspec.Meta(max_length=MAX_REGIONS)]
    uid: I32 = -1  # informational, as pid
    byteorder: Literal["little", "big"] = "little"
    # Every listen address (the first is ``address``): the paths (rails) a TCP
    # peer stripes its connections over. Empty from older agents: ``address``.
    rails: Annotated[list[Address], msgspec.Meta(max_length=MAX_RAILS)] = []
    # RDMA verbs devices (name and GID), in device order: peers pair theirs
    # with ours by index, one queue pair per pair (a rail). Empty: no verbs.
    verbs_devices: Annotated[list[Name], msgspec.Meta(max_length=MAX_RAILS)] = []
    # Same host: the abstract unix socket name this agent also listens on. A
    # same-host peer connects there, learns our pid and uid from the kernel
    # (SO_PEERCRED) and receives our memfds with SCM_RIGHTS. "": none.
    local: Address = ""

    def __post_init__(self) -> None:
        _check_u64(self.incarnation)
        check_name(self.name)
        for a in ([self.address] if self.address else []) + self.rails:
            check_address(a)


class VerbsQP(msgspec.Struct, frozen=True):
    """What a peer needs to connect a reliable-connected queue pair to ours."""

    qpn: U64
    psn: U64
    mtu: U64
    lid: U64
    port: U64
    gid_index: U64
    gid: Annotated[bytes, msgspec.Meta(max_length=16)]
    # What the engine checks before connecting (0: not said, i.e. a peer from
    # before these fields; the engine then assumes one like itself): a RoCE
    # queue pair never pairs with an InfiniBand one, a RoCE v2 GID with a v1.
    link_layer: U64 = 0
    gid_type: U64 = 0
    max_dest_rd_atomic: U64 = 0


class VerbsConnect(msgspec.Struct, tag="verbs_connect", frozen=True):
    """Client to server on a "verbs" connection after Accept: the client's
    queue pairs, one per rail: rail i joins the client's i-th paired device
    and the server's device ``devices[i]`` (paired by link layer,
    ``verbs.pair_rails``; empty: device i, as peers before this field)."""

    qps: Annotated[list[VerbsQP], msgspec.Meta(max_length=MAX_RAILS)]
    devices: Annotated[list[U64], msgspec.Meta(max_length=MAX_RAILS)] = []


class VerbsAccept(msgspec.Struct, tag="verbs_accept", frozen=True):
    """The server's queue pairs for them; the native engine frames follow."""

    qps: Annotated[list[VerbsQP], msgspec.Meta(max_length=MAX_RAILS)]


Frame = Hello | Challenge | Proof | Accept | Reject | AgentMeta | VerbsConnect | VerbsAccept

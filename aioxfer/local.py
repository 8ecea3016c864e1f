"""Same-host trust from the kernel: unix sockets, peer credentials, pidfds,
memfds passed with SCM_RIGHTS and checked for seals.

A same-host peer's memory is reached by mapping its memfds and by cross-memory
attach (``process_vm_readv/writev``) at its pid. Neither may rest on what a peer
*says*: a peer that names another process's pid, or an fd number that process
holds, would make us read and write that process's memory (a confused deputy).
So the same-host path runs over an abstract unix socket, where:

- the kernel tells each side the other's pid and uid (``SO_PEERCRED``); only a
  peer of our own uid gets the same-host path (others use tcp, token-checked);
- a pidfd is opened for that pid at once and held for the peer's lifetime: the
  engine learns from it when the process is really gone (a closed socket is not
  gone: a stopped process keeps its mappings);
- memfds travel as fds (``SCM_RIGHTS``), never as numbers opened through
  ``/proc/<pid>/fd``, and are refused unless sealed against shrinking and
  growing (a peer that could truncate its pool would kill us with SIGBUS).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import os
import secrets
import socket
import struct
from typing import NamedTuple

from aioxfer.errors import ProtocolError

__all__ = [
    "FDS_PER_MESSAGE",
    "REQUIRED_SEALS",
    "PeerCred",
    "check_sealed",
    "listen_abstract",
    "listen_local",
    "local_name_for",
    "peer_cred",
    "local_address",
    "peer_pidfd",
    "recv_fds",
    "recv_fds_then",
    "seal",
    "send_fds",
]

# Linux passes at most SCM_MAX_FD (253) fds per message.
FDS_PER_MESSAGE = 250
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class PeerCred(NamedTuple):
    pid: int
    uid: int
    gid: int


def listen_local(uid: int) -> tuple[socket.socket, str]:
    """A listening abstract unix socket with an unguessable name (abstract
    sockets live in the network namespace: peers in another one cannot reach
    it, which is right, since neither can their shm). Returns it and its name
    without the leading NUL."""
    name = f"aioxfer-{uid}-{secrets.token_hex(12)}"
    return listen_abstract(name), name


def local_name_for(token: bytes | None, address: str, uid: int) -> str:
    """The abstract name an agent of uid listening at address (its tcp
    "host:port", as it advertises it) also listens on, so that a same-host
    peer that knows only that address dials it directly, without first
    asking over tcp for the random name of listen_local (a tcp connect and
    handshake, ~1 ms of a first connect). Keyed by the agent's key
    (auth.hmac_key of its token: the name is public in /proc/net/unix, so
    each guess of a weak token costs a derivation): without it nobody can
    tell the name; without a token it can be guessed, and taken
    first by another process, which then only delays connects to the tcp
    path (the kernel's uid check and the handshake refuse any impostor:
    SECURITY.md)."""
    return local_name_from(local_name_mac(token), address, uid)


def local_name_mac(token: bytes | None) -> hmac.HMAC:
    """local_name_for's HMAC keyed and begun, before its address: made once
    (Connector, at its agent's start) and copied per name, so that a
    connect's name, on its way before the Hello, costs no keying."""
    return hmac.new(token or b"", b"local-v1", hashlib.sha256)


def local_name_from(mac: hmac.HMAC, address: str, uid: int) -> str:
    """local_name_for(token, address, uid) from local_name_mac(token) (a
    copy of it finished: mac itself is left as it was)."""
    h = mac.copy()
    h.update(address.encode())
    return f"aioxfer-{uid}-{h.hexdigest()[:24]}"


def listen_abstract(name: str) -> socket.socket:
    """A listening, non-blocking abstract unix socket bound to name (OSError
    EADDRINUSE where another socket holds it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind("\0" + name)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def local_address(name: str) -> str:
    return "\0" + name


def peer_cred(sock: socket.socket) -> PeerCred:
    """The pid, uid and gid of the process at the other end, as the kernel
    recorded them when the connection was made."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    if pid <= 0:
        raise ProtocolError("the kernel reports no process for this unix socket")
    return PeerCred(pid, uid, gid)


_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5


def peer_pidfd(sock: socket.socket, cred: PeerCred) -> int:
    """A pidfd for the process at the other end of sock (readable once it
    exits). SO_PEERPIDFD names exactly the process that connected; older
    kernels: pidfd_open(pid), then the pid is checked to still be the peer's
    (a pid reused between the two calls would need the peer to exit first,
    which closes the socket unless it was shared with a child)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
    except OSError:
        pass
    fd = os.pidfd_open(cred.pid)
    try:
        if peer_cred(sock).pid != cred.pid:
            raise ProtocolError("peer credentials changed")
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal(fd: int) -> None:
    """Seals a memfd we allocated: its size can never change again."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)


def check_sealed(fd: int, nbytes: int) -> str | None:
    """Why the memfd a peer passed cannot be mapped safely, or None if it can."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "not a memfd (no seals)"
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        return f"memfd not sealed against resizing (seals {seals:#x})"
    size = os.fstat(fd).st_size
    if size < nbytes:
        return f"memfd of {size} bytes is smaller than the region's {nbytes}"
    return None


async def _wait(loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    fd = sock.fileno()
    (loop.add_writer if write else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def send_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, fds: list[int]) -> None:
    """Sends fds after whatever was sent on sock, FDS_PER_MESSAGE per one-byte message."""
    for i in range(0, len(fds), FDS_PER_MESSAGE):
        part = fds[i : i + FDS_PER_MESSAGE]
        while True:
            try:
                socket.send_fds(sock, [b"F"], part)
                break
            except BlockingIOError:
                await _wait(loop, sock, write=True)


async def recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> list[int]:
    """Exactly n fds sent by send_fds. On any error every fd received so far is closed."""
    return (await recv_fds_then(loop, sock, n, 0))[0]


async def recv_fds_then(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, after: int
) -> tuple[list[int], bytes]:
    """Exactly n fds sent by send_fds, and up to after bytes of the stream
    that follow the last one's message, as far as that one read got them
    (b"" with n 0): a sender that appends the next bytes to that message
    (serving: META_GO) spares the reader a read of its own for them. On any
    error every fd received so far is closed."""
    got: list[int] = []
    try:
        while len(got) < n:
            want = min(FDS_PER_MESSAGE, n - len(got))
            size = 1 + after if len(got) + want == n else 1
            try:
                data, fds, flags, _ = socket.recv_fds(sock, size, want)
            except BlockingIOError:
                await _wait(loop, sock, write=False)
                continue
            got.extend(fds)
            if not data:
                raise ProtocolError(f"connection closed after {len(got)} of {n} memfds")
            if flags & socket.MSG_CTRUNC or len(fds) != want:
                raise ProtocolError(f"expected {want} memfds in a message, got {len(fds)}")
            if len(got) == n:
                return got, data[1:]
        return got, b""
    except BaseException:
        for fd in got:
            os.close(fd)
        raise

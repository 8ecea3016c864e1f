"""Server: the accepting side of an agent's connections.

A collaborator of :class:`aioxfer.Agent` (issue 10, item 8): it accepts on the
agent's listening sockets (tcp rails and the same-host unix socket), runs
the handshake (authentication, who connects, what for), serves metadata, sets
up the queue pairs a "verbs" connection asks for, and hands each data
connection to the engine under its peer's tag. It reaches the agent only
through the narrow arguments it was built with. Also the small socket helpers
both sides of a connection share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

from aioxfer import _cyx
from aioxfer.errors import ProtocolError
from aioxfer.local import FDS_PER_MESSAGE, PeerCred, peer_cred, peer_pidfd
from aioxfer.log import get_logger
from aioxfer.metadata import (
    Accept,
    AgentMeta,
    Hello,
    Reject,
    VerbsAccept,
    VerbsConnect,
    VerbsQP,
)
from aioxfer.protocol import (
    HANDSHAKE_SPIN_NS,
    META_GO,
    AcceptAhead,
    ClosedSilently,
    EarlyProofs,
    HandshakeRejected,
    Joins,
    challenge,
    early_challenge,
    encode_frame,
    handshake_spin_ns,
    hello_peek_now,
    peek_now,
    recv_frame,
    same_host,
    send_frame,
    send_now,
    server_answer_now,
    server_early_now,
    server_greet_now,
    server_handshake,
    server_join_now,
    sock_endpoint,
)

__all__ = ["Server", "fmt_sockaddr", "nodelay", "qp_tuple", "writable"]

_log = get_logger("aioxfer")
# Connections accepted in one step of the loop at most (the rest the next step).
_ACCEPT_BURST = 32
# The accepting step's polling for a same-host client's Proof (Server._answer_now)
# is a leaky bucket: each poll's time is owed, the debt drains at _SPIN_SHARE
# of a core, and nothing is polled while _SPIN_BURST_NS are owed. A local
# client that never answers (or answers late on purpose) so costs us at most
# _SPIN_BURST_NS at once, then _SPIN_SHARE of a core, whatever it does; an
# honest one's Proof comes within ~0.1 ms: ~500 polled handshakes a second.
_SPIN_SHARE = 0.05
_SPIN_BURST_NS = 4 * HANDSHAKE_SPIN_NS
# This process's servers: a client agent of ours is never polled for (it
# cannot answer while its own process's loop polls, when it shares it).
_servers: weakref.WeakSet[Server] = weakref.WeakSet()


class _Out:
    """What a handshake's answer still has to send (Server._send_now): the
    bytes (Accept, metadata), then the memfds, then META_GO (go); meta/fds:
    the snapshot the bytes were made of (None: no metadata); go_last:
    META_GO is the bytes' last one instead; waited: a send had to wait (the
    snapshot is checked against our regions again)."""

    __slots__ = ("data", "meta", "fds", "i", "go", "go_last", "local", "waited")

    def __init__(
        self, data: bytes, meta: AgentMeta | None, fds: list[int], *, go: bool, local: bool
    ) -> None:
        self.data = memoryview(data)
        self.meta = meta
        self.fds = fds
        self.i = 0  # the next memfd to send
        self.go = go
        self.go_last = False  # META_GO is data's last byte
        self.local = local
        self.waited = False


class Server:
    """Serves one agent's listening sockets.

    ``agent``: the agent's name (logs); ``engine``: its native engine (takes
    the connections and makes the queue pairs); ``token``: the shared secret
    (None: no authentication); ``accept``: what the handshake answers (our
    name, incarnation, host, unix socket); ``peer_timeout``: the bound on one
    handshake and exchange; ``max_handshakes``: connections served at once
    (more are closed at once); ``verbs_devices``: how many RDMA devices the
    agent opened; ``meta()``: our metadata as served over tcp;
    ``local_meta()``: as served on the unix socket, with the memfds to pass;
    ``tag_for(name, incarnation)`` / ``tag_unref(tag)``: a reference to the
    tag of a peer's connections, and its release; ``tasks``: the agent's set
    of serving tasks (cancelled and awaited at close); ``closed()``: whether
    the agent is closed; ``spin``: whether a same-host client's handshake
    may be polled for in the accepting step (_answer_now);
    ``meta_version()``: a value that changes whenever what ``meta()`` and
    ``local_meta()`` return does (registration.Memory.generation, and
    whatever else makes them: LocalMeta.meta_with): our metadata is then
    made and encoded once per version, not per connect (None: per connect).
    """

    __slots__ = (
        "_agent",
        "_engine",
        "_token",
        "_accept",
        "_peer_timeout",
        "_max_handshakes",
        "_verbs_devices",
        "_meta",
        "_local_meta",
        "_tag_for",
        "_tag_unref",
        "_tasks",
        "_closed",
        "_spin",
        "_spin_debt",
        "_spin_at",
        "_challenge",
        "_meta_version",
        "_meta_made",
        "_makers",
        "_early_challenge",
        "_accepts",
        "joins",
        "early",
        "closing",
        "__weakref__",
    )

    def __init__(
        self,
        agent: str,
        *,
        engine: _cyx.Engine,
        token: bytes | None,
        accept: Accept,
        peer_timeout: float,
        max_handshakes: int,
        verbs_devices: int,
        meta: Callable[[], AgentMeta],
        local_meta: Callable[[], tuple[AgentMeta, list[int]]],
        tag_for: Callable[[str, int], int],
        tag_unref: Callable[[int], None],
        tasks: set[asyncio.Task[None]],
        closed: Callable[[], bool],
        spin: bool = True,
        meta_version: Callable[[], object] | None = None,
    ) -> None:
        self._agent = agent
        self._engine = engine
        self._token = token
        self._accept = accept
        self._peer_timeout = peer_timeout
        self._max_handshakes = max_handshakes
        self._verbs_devices = verbs_devices
        self._meta = meta
        self._local_meta = local_meta
        self._tag_for = tag_for
        self._tag_unref = tag_unref
        self._tasks = tasks
        self._closed = closed
        # Whether the accepting step may poll a same-host client's socket
        # for its Proof (_answer_now); the agent's progress mode "sleep": not.
        self._spin = spin
        self._spin_debt = 0  # ns of polling owed (see _SPIN_SHARE)
        self._spin_at = 0
        # The next connection's Challenge, made ahead (after an accepting
        # step), so that it goes out first thing on the next accept.
        self._challenge: tuple[bytes, bytes] | None = None
        # The same for an early answer (_early_now): its Challenge, with
        # its own fresh nonce (each used once), and our proved Accept's
        # frames up to the proof: made ahead, off the connect's way (the
        # accepting step runs on a vCPU just woken, its code and caches cold).
        self._early_challenge: tuple[bytes, bytes] | None = None
        self._accepts = AcceptAhead(accept)
        # Our metadata as last made, over tcp and on the unix socket ([local]):
        # (its key: meta_version() and our pid, as it was read before the
        # metadata was made; the snapshot, its memfds, its frame). Made per
        # connect, it was ~0.06-0.08 ms of the accepting step's answer on a
        # cold vCPU (~15-40 us warm): a snapshot of every region, then encoded.
        self._meta_version = meta_version
        self._meta_made: list[tuple[object, AgentMeta, list[int], bytes] | None] = [None, None]
        # The makers meta_version() speaks for: one put in their place (the
        # tests' stale or hostile snapshots, served through _meta or
        # _local_meta) is asked on every connect, and what it makes is never
        # kept, nor served to a later one from the cache (rv35: a stale
        # snapshot kept under the version's current value was served again,
        # to the refresh's own check, tests/test_rev29_refresh).
        self._makers = (meta, local_meta)
        _servers.add(self)
        # The Challenges a client's other connections may join (one round
        # trip each instead of two: a tcp connect's other connections, a
        # same-host connect's unix socket): as many live as handshakes may run.
        self.joins = Joins(ttl=peer_timeout, cap=max_handshakes)
        # The early proofs of same-host clients taken (no Proof round:
        # _early_now), from the time we start listening on.
        self.early = EarlyProofs(token=token)
        # Set by the agent as its close begins (before its goodbye to the
        # network): from then on a handshake is refused with a Reject that
        # says so, instead of an Accept followed by a connection the closing
        # engine drops (the peer would think it connected, then lose us).
        self.closing = False

    async def accept_loop(
        self, loop: asyncio.AbstractEventLoop, lsock: socket.socket, *, local: bool = False
    ) -> None:
        """Accepts on lsock until cancelled (local: the unix socket, where the
        kernel says who connects); each connection is served by its own task.

        A reader callback accepts every connection waiting (up to a burst
        bound) and starts their tasks in the same step: a dialer's several
        connections arrive together and their handshakes run side by side
        (loop.sock_accept took one a step, re-arming the reader each time, and
        its task started a step after the accept)."""
        fd = lsock.fileno()
        stop: asyncio.Future[None] = loop.create_future()
        refused = 0
        # The address an early proof is bound to (protocol.sock_endpoint of
        # the accepted socket's getsockname()), where every connection this
        # listener accepts has the same: the listener's own (a unix socket's
        # path or name; an IP bound to one address), once here instead of a
        # syscall and a format per connect. None: per connection (a wildcard).
        here = _listener_endpoint(lsock)
        accept = _accepter(lsock)

        def resume() -> None:
            if not stop.done():
                loop.add_reader(fd, ready)

        def ready() -> None:
            nonlocal refused
            for _ in range(_ACCEPT_BURST):
                try:
                    sock, addr = accept()
                except (BlockingIOError, InterruptedError):
                    if self._challenge is None:  # (the next one's, off its way)
                        self._challenge = challenge(self._token)
                    if self._early_challenge is None and self._token is not None:
                        self._early_challenge = early_challenge()
                    return
                except OSError as exc:
                    if self._closed():
                        if not stop.done():
                            stop.set_result(None)
                        return
                    _log.warning("accept.failed", agent=self._agent, error=str(exc))
                    loop.remove_reader(fd)  # e.g. EMFILE: do not spin
                    loop.call_later(0.1, resume)
                    return
                if len(self._tasks) >= self._max_handshakes:
                    # Each handshake holds a socket and a task until peer_timeout:
                    # over the cap a connection is closed at once (said once per burst).
                    sock.close()
                    refused += 1
                    if refused == 1:
                        _log.warning("conn.refused", agent=self._agent,
                                     remote=fmt_sockaddr(addr),
                                     reason=f"{self._max_handshakes} handshakes already running")
                    continue
                refused = 0
                cred = None
                if local:
                    # Who connected, as the kernel says, before we send a
                    # byte: only our own user gets the same-host path.
                    cred = self._local_cred(sock, addr)
                    if cred is None:  # refused (logged, closed)
                        continue
                if self.closing or self._closed():
                    self._refuse_now(sock, addr)
                    continue
                peeked = None
                if not local:
                    joined = self._join_now(sock, addr)
                    if joined is None and self._token is not None and same_host(addr):
                        joined = self._join_polled(loop, sock, addr)
                    if joined is True:
                        continue
                    peeked = joined or None
                answered: bool | tuple[Hello, _Out] | None = False
                nonce = b""
                if self._token is not None and (local or same_host(addr)):
                    answered = self._early_now(loop, sock, addr, cred, here, peeked)
                if answered is True:
                    continue
                if not answered:
                    got = self._greet_now(sock, addr)
                    if got is None:  # broke before its handshake (logged, closed)
                        continue
                    nonce = got
                    # (None: its Hello was polled for in vain: not twice)
                    answered = (False if answered is None
                                else self._answer_now(loop, sock, addr, cred, nonce))
                    if answered is True:
                        continue
                task = loop.create_task(self._serve(loop, sock, addr, cred=cred, nonce=nonce,
                                                    answered=answered or None))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        loop.add_reader(fd, ready)
        try:
            await stop
        finally:
            if not loop.is_closed():
                loop.remove_reader(fd)

    async def _serve(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        addr: Any,
        *,
        cred: PeerCred | None,
        nonce: bytes,
        answered: tuple[Hello, _Out] | None = None,
    ) -> None:
        """One connection's handshake and what it asked for (nonce: of our
        Challenge, sent in the accepting step, _greet_now; cred: who
        connected on the unix socket, our own user: _local_cred; answered:
        the handshake was made in the accepting step, _answer_now, whose
        sends are finished here)."""
        local = cred is not None
        remote = _remote(addr, cred)
        pidfd = -1
        try:
            # (a tcp connection's TCP_NODELAY is set already: _join_now saw
            # it first; one setsockopt per handshake was made twice)
            async with asyncio.timeout(self._peer_timeout):
                if answered is not None:
                    hello, out = answered
                    await self._send_rest(loop, sock, out)
                    if hello.purpose == "meta":
                        return
                else:
                    hello = await server_handshake(
                        loop,
                        sock,
                        token=self._token,
                        accept=self._accept,
                        joins=self.joins,
                        nonce=nonce,
                        refuse=self._refusal,
                    )
                if answered is not None:
                    handles: list[int] = []
                elif hello.purpose == "meta":
                    if hello.accept_only:
                        return
                    if local:
                        # As a "data" connection's, checked against our
                        # regions whenever its send waited: a region
                        # deregistered meanwhile had its memfd closed, and the
                        # number, reused by our next open, was passed as its
                        # (tests/test_rev29_metafds).
                        await self._send_meta(loop, sock, local, go=False)
                    else:
                        await send_frame(loop, sock, self._meta())
                    return
                else:
                    handles = []
                    if hello.purpose == "verbs":
                        if local:
                            raise ProtocolError(
                                "verbs connections are not made on the unix socket")
                        handles = await self._accept_verbs(loop, sock)
                    elif hello.meta:
                        # Returns having sent META_GO; from there to the engine
                        # taking the connection nothing awaits (no deregistration
                        # can slip in between).
                        await self._send_meta(loop, sock, local)
            if cred is not None:
                # Held by the engine for this connection's life: a revocation
                # it owes is settled by its ack or by its process's exit, never
                # by a closed socket alone (a stopped process keeps its maps).
                pidfd = peer_pidfd(sock, cred)
            # _hand_over owns pidfd, the engine the fd (and the queue pairs).
            owned, pidfd = pidfd, -1
            self._hand_over(sock, hello, remote, owned, handles)
        except Exception as exc:  # hostile input must never end in an unretrieved task error
            self._failed(exc, remote)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
            sock.close()  # (nothing if the engine took it: detached)

    def _failed(self, exc: Exception, remote: str) -> None:
        """A handshake (or what it asked for) that failed with exc, logged
        as what it was: refused, malformed, timed out, broken."""
        if isinstance(exc, (HandshakeRejected, ProtocolError)):
            _log.warning("conn.rejected", agent=self._agent, remote=remote, reason=str(exc))
        elif isinstance(exc, TimeoutError):
            _log.warning(
                "conn.rejected", agent=self._agent, remote=remote, reason="handshake timed out"
            )
        elif isinstance(exc, OSError):
            _log.info("conn.failed", agent=self._agent, remote=remote, reason=str(exc))
        elif isinstance(exc, _cyx.NativeError):
            _log.warning("conn.failed", agent=self._agent, remote=remote, reason=str(exc))
        else:
            _log.warning("conn.rejected", agent=self._agent, remote=remote,
                         reason=f"{type(exc).__name__}: {exc}")

    def _answer_now(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        addr: Any,
        cred: PeerCred | None,
        nonce: bytes,
    ) -> bool | tuple[Hello, _Out]:
        """The whole handshake in the accepting step, right after our
        Challenge (protocol.server_answer_now), when the client's Hello (and
        Proof) are there, or, from a client on this host, come within a
        bounded poll (_spin_ns): no task, no timer, no further step of the
        loop on the connect's way (cxs32: the serving task's start and
        steps cost ~0.15 ms after the accept, and a Proof awaited in the
        loop the wake-up of an idle vCPU). False: nothing read, for _serve;
        True: served here (handed to the engine, or closed and logged);
        (hello, what is still to send): the socket took part of the answer
        only, _serve sends the rest."""
        spin = 0 if cred is not None and cred.pid == os.getpid() else self._spin_ns(loop, sock)
        if self._token is not None and not spin:
            return False  # (a remote client's Proof is a round trip away: not there yet)
        remote = fmt_sockaddr(addr) if cred is None else f"local pid {cred.pid} uid {cred.uid}"
        t0 = time.monotonic_ns()
        try:
            got = server_answer_now(loop, sock, token=self._token, accept=self._accept,
                                    joins=self.joins, nonce=nonce, refuse=self._refusal,
                                    spin_ns=spin, ahead=self._ahead(cred is not None),
                                    polled=_not_ours)
        except Exception as exc:  # (ProtocolError: read, then broken; our metadata's own)
            self._failed(exc, remote)
            sock.close()
            return True
        finally:
            if spin:
                self._spin_debt += time.monotonic_ns() - t0
        if got is None:
            return False
        return self._finish_now(sock, got[0], got[1], remote, cred)

    def _early_now(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, addr: Any,
        cred: PeerCred | None, here: str | bytes | None = None, peeked: bytes | None = None,
    ) -> bool | tuple[Hello, _Out] | None:
        """A same-host client's (the caller decided, from the socket) Hello
        with an early proof we take (protocol.server_early_now), answered at
        once, in the accepting step: our Challenge, the proved Accept and
        what it asked for in one send, no Proof round. As _answer_now's
        (False: nothing read or sent, for _greet_now and _answer_now; None:
        the same, but nothing came while we polled: not polled again).

        On the unix socket, whose accept is ready before the client's Hello
        is sent, a client of another process is first polled for its Hello
        (protocol.hello_peek_now, under _answer_now's budget: _spin_ns):
        an early Hello that landed after our ordinary Challenge would cost
        the Proof round. tcp's accept waits for the first bytes
        (TCP_DEFER_ACCEPT), and a tcp connect's other connections may send
        nothing for a while (their joins): not polled.

        here: the listener's address where it is every accepted socket's
        (accept_loop); None: server_early_now asks the socket. peeked: what
        _join_now peeked of a tcp connection (nothing was read since)."""
        try:
            sock.setblocking(False)
            if cred is not None and cred.pid != os.getpid():
                spin = self._spin_ns(loop, sock, unix=True)
                t0 = time.monotonic_ns()
                try:
                    peeked = hello_peek_now(loop, sock, spin)
                    if peeked is None:
                        return None if spin else False
                finally:
                    if spin:
                        self._spin_debt += time.monotonic_ns() - t0
            got = server_early_now(sock, token=self._token, accept=self._accept,
                                   early=self.early, joins=self.joins, refuse=self._refusal,
                                   ahead=self._ahead(cred is not None), peeked=peeked,
                                   here=here, made=self._take_early_challenge,
                                   accepts=self._accepts)
        except Exception as exc:  # (ProtocolError: read, then broken; our metadata's own)
            self._failed(exc, _remote(addr, cred))
            sock.close()
            return True
        if got is None:
            return False
        return self._finish_now(sock, got[0], got[1], _remote(addr, cred), cred)

    def _take_early_challenge(self) -> tuple[bytes, bytes]:
        """An early answer's Challenge: the one made ahead, taken (each
        nonce once), or a fresh one."""
        made, self._early_challenge = self._early_challenge, None
        return made if made is not None else early_challenge()

    def _ahead(self, local: bool) -> Callable[[Hello, bytes], _Out]:
        """What a handshake answered in the accepting step sends: head (our
        Accept, as frames) and what the Hello asked for (_out)."""

        def ahead(hello: Hello, head: bytes) -> _Out:
            return self._out(
                local, head,
                meta=hello.meta if hello.purpose == "data" else not hello.accept_only,
                go=hello.purpose == "data",
            )

        return ahead

    def _finish_now(
        self, sock: socket.socket, hello: Hello, out: _Out, remote: str, cred: PeerCred | None
    ) -> bool | tuple[Hello, _Out]:
        """A handshake made in the accepting step (_answer_now, _early_now):
        its answer sent as far as the socket takes it now and a "data"
        connection handed to the engine (True: served, or closed and
        logged); (hello, out): the rest is _serve's."""
        pidfd = -1
        keep = False  # (the socket goes on to _serve)
        try:
            if not self._send_now(sock, out):
                # The rest in _serve (its timeout bounds the waits), a step
                # or more after the snapshot: checked again before its
                # memfds and META_GO, as after any send that waited.
                out.waited = True
                keep = True
                return hello, out
            if hello.purpose == "data":
                if cred is not None:  # (see _serve)
                    pidfd = peer_pidfd(sock, cred)
                owned, pidfd = pidfd, -1
                self._hand_over(sock, hello, remote, owned, [])
        except Exception as exc:  # as _serve: never an error out of the accepting step
            self._failed(exc, remote)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
            if not keep:
                sock.close()  # (nothing if the engine took it: detached)
        return True

    def _spin_ns(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, *, unix: bool = False
    ) -> int:
        """How long _answer_now may poll sock for the client's frames, ns:
        protocol.handshake_spin_ns (a client on this host, asyncio's own
        loops), unless spin is off or the polling owed is at its bound
        (_SPIN_SHARE). unix: sock is the unix socket's (on this host: its
        family not asked again)."""
        if not self._spin:
            return 0
        now = time.monotonic_ns()
        self._spin_debt = max(0, self._spin_debt - int((now - self._spin_at) * _SPIN_SHARE))
        self._spin_at = now
        if self._spin_debt >= _SPIN_BURST_NS:
            return 0
        if unix:
            return HANDSHAKE_SPIN_NS if getattr(loop, "_ready", None) is not None else 0
        return handshake_spin_ns(loop, sock)

    def _hand_over(
        self, sock: socket.socket, hello: Hello, remote: str, pidfd: int, handles: list[int]
    ) -> None:
        """The engine takes the handshaken connection (and pidfd, and the
        queue pairs), also if this raises; pidfd is closed if it cannot."""
        try:
            tag = self._tag_for(hello.name, hello.incarnation)
        except BaseException:
            if pidfd >= 0:
                os.close(pidfd)
            raise
        fd = sock.detach()
        try:
            if hello.purpose == "verbs":
                self._engine.verbs_accept_conn(fd, tag, handles)
            else:
                self._engine.accept_conn(fd, tag, pidfd)
        except BaseException:
            self._tag_unref(tag)
            raise
        _log.debug("conn.accepted", agent=self._agent, peer=hello.name, remote=remote, tag=tag)

    def _join_polled(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, addr: Any
    ) -> bool | bytes | None:
        """_join_now once the Hello of a same-host tcp connection accepted
        before it came is there, polled for as the unix socket's
        (protocol.hello_peek_now, under the same budget: _spin_ns); None:
        none came in time (the caller greets it, as before).

        Why: a listener that accepts at the connect (no TCP_DEFER_ACCEPT,
        as agent._listen may leave a loopback one) is woken by the client's
        connect, ~0.2-0.3 ms before its Hello (the client makes and sends it
        meanwhile): the wake-up of an idle vCPU, ~0.1-0.2 ms, is then off
        the connect's way, where a deferred accept took it after the Hello
        (tgt36). With TCP_DEFER_ACCEPT, a connection comes without its
        Hello only from a client silent for ~1 s: polled once, budgeted."""
        spin = self._spin_ns(loop, sock)
        if not spin:
            return None
        t0 = time.monotonic_ns()
        try:
            got = hello_peek_now(loop, sock, spin)
        except OSError:
            return None  # (_serve meets it again, and says so)
        finally:
            self._spin_debt += time.monotonic_ns() - t0
        return None if got is None else self._join_now(sock, addr)

    def _join_now(self, sock: socket.socket, addr: Any) -> bool | bytes | None:
        """A tcp connection whose Hello joins a Challenge, served at once, in
        the accepting step (protocol.server_join_now: the Hello came with the
        connection, TCP_DEFER_ACCEPT, and needs one reply): no task, no
        timer, no further step of the loop, on the way of each of a connect's
        other connections (True). Anything else, nothing read, for
        _early_now or _serve: what was peeked (bytes, for _early_now: one
        recv fewer on a connect's way), or False/None (nothing peeked)."""
        # TCP_NODELAY first, whatever follows: _serve, which serves it when
        # this does not, counts on it (nodelay never raises).
        nodelay(sock)
        try:
            sock.setblocking(False)
            peeked = peek_now(sock) if self._token is not None else None
            hello = server_join_now(sock, token=self._token, accept=self._accept,
                                    joins=self.joins, peeked=peeked)
        except OSError:
            return False  # _serve meets it again, and says so
        except ClosedSilently:
            # Nothing asked: a client's early-dialled connection its agent
            # closed before using (or a port check); not a rejected handshake.
            _log.debug("conn.closed_silently", agent=self._agent, remote=fmt_sockaddr(addr))
            sock.close()
            return True
        except ProtocolError as exc:
            _log.warning("conn.rejected", agent=self._agent, remote=fmt_sockaddr(addr),
                         reason=str(exc))
            sock.close()
            return True
        if hello is None:
            return peeked
        try:
            self._hand_over(sock, hello, fmt_sockaddr(addr), -1, [])
        except _cyx.NativeError as exc:
            _log.warning("conn.failed", agent=self._agent, remote=fmt_sockaddr(addr),
                         reason=str(exc))
        except Exception as exc:  # as _serve: never an error out of the accepting step
            _log.warning("conn.rejected", agent=self._agent, remote=fmt_sockaddr(addr),
                         reason=f"{type(exc).__name__}: {exc}")
            sock.close()  # (nothing if the engine took it: detached)
        return True

    def _local_cred(self, sock: socket.socket, addr: Any) -> PeerCred | None:
        """The kernel's word on who connected to the unix socket, when it is
        our own user (another user's agents connect over tcp); else None,
        closed before a byte of ours was sent (logged)."""
        try:
            cred = peer_cred(sock)
        except (OSError, ProtocolError) as exc:
            _log.warning("conn.rejected", agent=self._agent, remote=fmt_sockaddr(addr),
                         reason=str(exc))
            sock.close()
            return None
        if cred.uid != os.geteuid():
            _log.warning("conn.rejected", agent=self._agent,
                         remote=f"local pid {cred.pid} uid {cred.uid}",
                         reason=f"uid {cred.uid} is not this agent's user: "
                                "same-host access refused")
            sock.close()
            return None
        return cred

    def _greet_now(self, sock: socket.socket, addr: Any) -> bytes | None:
        """Our Challenge sent in the accepting step, before a byte of the
        connection is read (protocol.server_greet_now): the client has our
        nonce one round trip sooner than if we waited for its Hello. Its
        nonce; None: the socket broke, closed (and logged) here."""
        made, self._challenge = self._challenge, None  # (each nonce once)
        try:
            sock.setblocking(False)
            return server_greet_now(sock, token=self._token, made=made)
        except OSError as exc:  # (reset at once: as _serve says a broken one)
            _log.info("conn.failed", agent=self._agent, remote=fmt_sockaddr(addr),
                      reason=str(exc))
        except ProtocolError as exc:
            _log.warning("conn.rejected", agent=self._agent, remote=fmt_sockaddr(addr),
                         reason=str(exc))
        sock.close()
        return None

    def _refusal(self) -> str | None:
        """Why a handshake is refused at its Accept (None: it is not)."""
        if self.closing or self._closed():
            return f"agent {self._agent!r} is closing"
        return None

    def _refuse_now(self, sock: socket.socket, addr: Any) -> None:
        """A connection accepted while we close: a Reject in place of our
        Challenge (the client raises AccessDenied naming it), then closed."""
        reason = self._refusal() or "closing"
        try:
            sock.setblocking(False)
            send_now(sock, encode_frame(Reject(reason=reason)))
        except OSError:
            pass
        _log.info("conn.refused", agent=self._agent, remote=fmt_sockaddr(addr), reason=reason)
        sock.close()

    async def _send_meta(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, local: bool, *,
        go: bool = True,
    ) -> None:
        """The metadata a "data" client asked for (Hello.meta), its memfds on
        the unix socket, then META_GO. A region the metadata names and
        deregistered before the engine holds this connection would never be
        revoked on it: if a send had to wait, what was sent is checked
        against our regions again before each further memfd and before
        META_GO (sent in the same step as the check), and the connection is
        closed when it changed. Usually nothing waits: a snapshot, its sends
        and the hand-over to the engine happen in one step of the loop.
        go False (a "meta" connection): no META_GO, nothing handed over."""
        await self._send_rest(loop, sock, self._out(local, b"", meta=True, go=go))

    def _out(self, local: bool, head: bytes, *, meta: bool, go: bool) -> _Out:
        """head (our Accept, or nothing), then with meta our metadata as
        served over tcp, or on the unix socket (local) with its memfds, and
        with go META_GO: what _send_now sends."""
        if not meta:
            return _Out(head, None, [], go=False, local=local)
        snap, fds, frame = self._snapshot(local)
        if go and not fds:
            # META_GO in the same send (one syscall, one segment fewer); if
            # the socket takes only part, _send_now takes it off the rest and
            # sends it once the snapshot was checked again.
            out = _Out(head + frame + META_GO, snap, fds, go=False, local=local)
            out.go_last = True
            return out
        return _Out(head + frame, snap, fds, go=go, local=local)

    def _snapshot(self, local: bool) -> tuple[AgentMeta, list[int], bytes]:
        """Our metadata as served over tcp, or on the unix socket (local)
        with its memfds, and its frame: as made for the last connect while
        meta_version() and our pid are what they were then (made before it
        was read: a change meanwhile makes the next one anew), else made
        now. Its memfds are then still the regions' (a memfd is closed only
        once its region left the table, which changes the version). Made
        each time, and not kept, while _meta or _local_meta is not the maker
        this Server was given (see _makers)."""
        version = self._meta_version
        meta, local_meta = self._makers
        key = None
        if version is not None and self._meta is meta and self._local_meta is local_meta:
            key = (version(), os.getpid())
            made = self._meta_made[local]
            if made is not None and made[0] == key:
                return made[1], made[2], made[3]
        snap, fds = self._local_meta() if local else (self._meta(), [])
        frame = encode_frame(snap)
        if key is not None:
            self._meta_made[local] = (key, snap, fds, frame)
        return snap, fds, frame

    def _send_now(self, sock: socket.socket, out: _Out) -> bool:
        """Sends what out still owes, as far as the socket takes it now
        (see _send_meta for the checks once a send waited); True: all."""
        if out.data:
            out.data = out.data[send_now(sock, out.data) :]
            if out.data:
                if out.go_last:  # (META_GO not sent: sent once checked, below)
                    out.data, out.go, out.go_last = out.data[:-1], True, False
                return False
        while out.i < len(out.fds):
            if out.waited:
                assert out.meta is not None
                self._check_current(out.meta, out.fds, out.local)
            # The last memfds' message carries META_GO behind its byte
            # when nothing waited (the snapshot made in this step, as below):
            # one syscall fewer on the connect's way; the client reads the
            # memfds' messages a byte at a time (local.recv_fds), then GO.
            last = out.i + FDS_PER_MESSAGE >= len(out.fds)
            data = b"F" + META_GO if last and out.go and not out.waited else b"F"
            try:
                n = socket.send_fds(sock, [data], out.fds[out.i : out.i + FDS_PER_MESSAGE])
            except (BlockingIOError, InterruptedError):
                return False
            out.i += FDS_PER_MESSAGE
            if n == 2:
                out.go = False
        if out.go:
            if out.waited:
                assert out.meta is not None
                self._check_current(out.meta, out.fds, out.local)
            if not send_now(sock, META_GO):
                return False
            out.go = False
        return True

    async def _send_rest(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, out: _Out
    ) -> None:
        while not self._send_now(sock, out):
            await writable(loop, sock)
            out.waited = True

    def _check_current(self, meta: AgentMeta, fds: list[int], local: bool) -> None:
        """ProtocolError unless every region of meta is still ours, with the
        same key (and memfd: an fd is closed only once its region is gone)."""
        now, now_fds = self._local_meta() if local else (self._meta(), [])
        have = {(r.rid, r.key): now_fds[r.memfd] if r.memfd >= 0 else -1 for r in now.regions}
        for r in meta.regions:
            if have.get((r.rid, r.key), -2) != (fds[r.memfd] if r.memfd >= 0 else -1):
                raise ProtocolError(
                    "regions were deregistered while our metadata was sent: connection closed"
                )

    async def _accept_verbs(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket
    ) -> list[int]:
        """Server side of a "verbs" connection: a queue pair per rail the
        client asks for, connected to the client's; returns their handles
        (bound to the connection once the engine takes it)."""
        msg = await recv_frame(loop, sock)
        if not isinstance(msg, VerbsConnect):
            raise ProtocolError(f"expected VerbsConnect, got {type(msg).__name__}")
        if not self._verbs_devices:
            raise ProtocolError("verbs connection to an agent without RDMA devices")
        if not 0 < len(msg.qps) <= self._verbs_devices:
            raise ProtocolError(
                f"{len(msg.qps)} queue pairs asked of {self._verbs_devices} devices"
            )
        devices = list(msg.devices) if msg.devices else list(range(len(msg.qps)))
        if len(devices) != len(msg.qps) or len(set(devices)) != len(devices) or not all(
            0 <= d < self._verbs_devices for d in devices
        ):
            raise ProtocolError(f"queue pairs asked of devices {devices!r}")
        handles: list[int] = []
        try:
            ours = []
            for dev, qp in zip(devices, msg.qps, strict=True):
                handle, info = self._engine.verbs_accept_qp(dev, qp_tuple(qp))
                handles.append(handle)
                ours.append(VerbsQP(*info))
            await send_frame(loop, sock, VerbsAccept(qps=ours))
        except BaseException:
            for handle in handles:
                with contextlib.suppress(_cyx.NativeError):
                    self._engine.verbs_qp_destroy(handle)
            raise
        return handles


def _remote(addr: Any, cred: PeerCred | None) -> str:
    """Who is at the other end, for our logs."""
    return fmt_sockaddr(addr) if cred is None else f"local pid {cred.pid} uid {cred.uid}"


_WILDCARDS = ("0.0.0.0", "::", "")


def _accepter(lsock: socket.socket) -> Callable[[], tuple[socket.socket, Any]]:
    """lsock.accept for a non-blocking listener, with what it asks lsock
    each time (its family, type and protocol, two of them converted to
    enums) read once: the accept is the first step of a woken target's
    way to its answer (~3-7 us of socket.accept's ~12-16 warm, more on a
    cold vCPU, tgt36). The same socket as socket.accept's: a listener
    without a timeout has nothing else for it to do (it copies a timeout
    only where the listener has one: such a listener keeps socket.accept)."""
    raw = getattr(lsock, "_accept", None)
    if lsock.gettimeout() != 0.0 or raw is None or type(lsock) is not socket.socket:
        return lsock.accept
    family, kind, proto = lsock.family, lsock.type, lsock.proto
    new = socket.socket

    def accept() -> tuple[socket.socket, Any]:
        fd, addr = raw()
        return new(family, kind, proto, fileno=fd), addr

    return accept


def _listener_endpoint(lsock: socket.socket) -> str | bytes | None:
    """sock_endpoint(getsockname()) of every socket lsock accepts, where
    that is lsock's own: a unix listener (an accepted unix socket is named
    as its listener), an IP listener bound to one address (a connection's
    local address is the one it was accepted on). None: a wildcard IP
    listener (each connection's own, asked per connection), or unknown."""
    try:
        name = lsock.getsockname()
    except OSError:
        return None
    if isinstance(name, tuple) and (len(name) < 2 or str(name[0]) in _WILDCARDS):
        return None
    if not isinstance(name, str | bytes | tuple):
        return None
    return sock_endpoint(name)


def _not_ours(hello: Hello) -> bool:
    """Whether hello is not from an agent of this process (see _servers)."""
    return not any(s._accept.incarnation == hello.incarnation for s in _servers)


async def writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until sock can be written to (or is connected, or has failed)."""
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


def qp_tuple(qp: VerbsQP) -> tuple[int, int, int, int, int, int, bytes, int, int, int]:
    """A peer's queue pair parameters, range-checked (they are untrusted)."""
    if not (
        0 <= qp.qpn < 1 << 24
        and 0 <= qp.psn < 1 << 24
        and 1 <= qp.mtu <= 5
        and 0 <= qp.lid < 1 << 16
        and 0 <= qp.port < 256
        and 0 <= qp.gid_index < 256
        and len(qp.gid) == 16
        and 0 <= qp.link_layer < 256
        and 0 <= qp.gid_type < 256
        and 0 <= qp.max_dest_rd_atomic < 256
    ):
        raise ProtocolError(f"queue pair parameters out of range: {qp!r}")
    return (
        qp.qpn, qp.psn, qp.mtu, qp.lid, qp.port, qp.gid_index, qp.gid,
        qp.link_layer, qp.gid_type, qp.max_dest_rd_atomic,
    )


def fmt_sockaddr(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        h = str(addr[0])
        return f"[{h}]:{addr[1]}" if ":" in h else f"{h}:{addr[1]}"
    return str(addr)


def nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass

"""Rails: the several connections (paths, addresses) an agent keeps to a tcp peer.

A collaborator of :class:`aioxfer.Agent`: the engine stripes large transfers
over a peer's connections and moves a failed connection's unfinished chunks to
the survivors (reporting CQ_RAIL_DOWN); this keeps the rails themselves up. It
marks a rail down once its last connection failed and re-dials it, with
backoff, until the peer's engine takes connections on it again. It reaches
the agent only through the narrow arguments it was built with.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aioxfer import _cyx
from aioxfer.dialing import joining
from aioxfer.errors import XferError
from aioxfer.log import get_logger

if TYPE_CHECKING:
    from aioxfer.metadata import Accept
    from aioxfer.peer import Peer

__all__ = ["Rails"]

_log = get_logger("aioxfer")

# (rail, live, bytes, rate in bytes/ms, reroutes) per connection (Engine.endpoint_rails)
RailConn = tuple[int, bool, int, int, int]


class Rails:
    """Counts live connections per rail, notices rails going down and re-dials them.

    ``endpoint_rails(ep)``: the engine's per-connection records of endpoint
    ``ep``; ``add_conn(ep, fd, rail)``: hands a connected, handshaken socket's
    fd to the engine (raises when the engine refuses); ``open_conn(address)``:
    a new data connection and the Accept of whoever answered; ``probe_delay``
    and ``probe_max``: the first and the longest wait between re-dials of a
    failed rail; ``tasks``: the agent's set of background tasks (awaited at
    close); ``closed()``: whether the agent is closed.
    """

    __slots__ = (
        "_agent",
        "_endpoint_rails",
        "_add_conn",
        "_open_conn",
        "_probe_delay",
        "_probe_max",
        "_tasks",
        "_closed",
        "_timeout_status",
        "_loop",
        "_running",
        "_joining",
    )

    def __init__(
        self,
        agent: str,
        *,
        endpoint_rails: Callable[[int], list[RailConn]],
        add_conn: Callable[[int, int, int], None],
        open_conn: Callable[..., Awaitable[tuple[socket.socket, Accept]]],
        probe_delay: float,
        probe_max: float,
        tasks: set[asyncio.Task[None]],
        closed: Callable[[], bool],
        timeout_status: int,
        loop: Callable[[], asyncio.AbstractEventLoop | None] = lambda: None,
    ) -> None:
        self._agent = agent
        self._endpoint_rails = endpoint_rails
        self._add_conn = add_conn
        self._open_conn = open_conn
        self._probe_delay = probe_delay
        self._probe_max = probe_max
        self._tasks = tasks
        self._closed = closed
        self._timeout_status = timeout_status  # E_TIMEOUT: the rail stalled
        self._loop = loop  # the agent's loop: probes run there, whoever drains
        # peer -> its probes running (ended by forget() when the peer goes)
        self._running: dict[Peer, set[asyncio.Task[None]]] = {}
        # peer -> its connections' background joining (track), while it runs
        self._joining: dict[Peer, asyncio.Task[None]] = {}

    def live(self, peer: Peer) -> dict[int, int]:
        """Live connections per rail index, as the engine sees them."""
        live: dict[int, int] = {}
        for rail, up, *_ in self._endpoint_rails(peer._ep):
            if up:
                live[rail] = live.get(rail, 0) + 1
        return live

    def on_down(self, peer: Peer, rail: int, moved: int, status: int) -> None:
        """The engine lost a connection of ``rail`` (CQ_RAIL_DOWN) and moved
        ``moved`` request groups to the others."""
        peer._rerouted(moved)
        if status == _cyx.E_CLOSED or not 0 <= rail < len(peer.rails):
            return  # (E_CLOSED: the peer's agent closes and said so: nothing to re-dial)
        address = peer.rails[rail]
        reason = "stalled" if status == self._timeout_status else "broken or silent"
        if moved:
            _log.warning("rail.rerouted", agent=self._agent, peer=peer.name, address=address,
                         reason=reason, moved=moved)
        if peer.lost or peer._rail_is_down(rail):
            return
        if self.live(peer).get(rail, 0) == 0:
            peer._rail_down(rail)
            _log.warning("rail.down", agent=self._agent, peer=peer.name, address=address,
                         reason=reason, moved=moved)
        # Also a rail that kept some connections is topped up again.
        self.start_probe(peer, rail)

    def start_probe(self, peer: Peer, rail: int) -> None:
        """Re-dials ``rail`` in the background (once at a time per rail)."""
        if self._closed() or not peer._probe_begin(rail):
            return
        # A rail-down record may be drained by a thread that is not the
        # agent's loop's (aioxfer.nixl's callers poll from their own threads,
        # with no running loop, or with one of their own): the probe is
        # started on the agent's loop, from that loop's thread.
        loop, running = self._loops()
        if loop is None:
            loop = running
        if loop is None or loop.is_closed():
            peer._probe_end(rail)
            return
        if loop is running:
            self._spawn(loop, peer, rail)
        else:
            loop.call_soon_threadsafe(self._spawn, loop, peer, rail)

    def _loops(self) -> tuple[asyncio.AbstractEventLoop | None, asyncio.AbstractEventLoop | None]:
        """The agent's loop, and the calling thread's running loop (None when
        it runs none)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        return self._loop(), running

    def _spawn(self, loop: asyncio.AbstractEventLoop, peer: Peer, rail: int) -> None:
        if self._closed():
            peer._probe_end(rail)
            return
        if peer.lost:
            peer._probe_end(rail)
            return
        task = loop.create_task(self._probe(peer, rail), name=f"aioxfer-probe-{peer.name}-{rail}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._running.setdefault(peer, set()).add(task)
        task.add_done_callback(functools.partial(self._ended, peer))

    def track(self, peer: Peer, task: asyncio.Task[None]) -> None:
        """A background task of the peer's (its connections joining): one of
        the agent's (tasks: cancelled and awaited at its close) that forget()
        cancels with its probes. The peer's re-dials wait for it to end."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if peer.lost:
            task.cancel()
            return
        self._running.setdefault(peer, set()).add(task)
        task.add_done_callback(functools.partial(self._ended, peer))
        self._joining[peer] = task
        task.add_done_callback(functools.partial(self._joined, peer))

    def _joined(self, peer: Peer, task: asyncio.Task[None]) -> None:
        if self._joining.get(peer) is task:
            del self._joining[peer]

    def _ended(self, peer: Peer, task: asyncio.Task[None]) -> None:
        running = self._running.get(peer)
        if running is not None:
            running.discard(task)
            if not running:
                del self._running[peer]

    def forget(self, peer: Peer) -> None:
        """The peer is lost or closed: its probes end now (not after their
        backoff, up to probe_max, holding it). From any thread (a drain may
        run on a caller's own, as in start_probe)."""
        tasks = self._running.pop(peer, ())
        if not tasks:
            return
        loop, running = self._loops()
        for task in tasks:
            if loop is None or loop is running:
                task.cancel()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

    async def dial(
        self,
        ep: int,
        rail: int,
        address: str,
        n: int,
        incarnation: int,
        join: tuple[bytes, int] | None = None,
    ) -> int:
        """Opens n data connections to address at once and hands those the
        peer's incarnation answered (not another process behind that address)
        to endpoint ep as rail; closes the rest. Returns how many it added:
        network failures only make it fewer; the engine refusing raises.
        join (nonce, i): connection k joins that Challenge as index i + k."""
        opening = [
            asyncio.ensure_future(
                self._open_conn(address) if join is None
                else self._open_conn(address, join=joining(join[0], join[1] + k))
            )
            for k in range(n)
        ]
        try:
            results = await asyncio.gather(*opening, return_exceptions=True)
        except BaseException:
            # Cancelled (the peer went, the agent closes): the openings still
            # running close their own socket; those that finished, we close.
            for t in opening:
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result()[0].close()
            raise
        socks = [r[0] for r in results if isinstance(r, tuple)]
        added = 0
        try:
            for r in results:
                if isinstance(r, BaseException):
                    if not isinstance(r, XferError | OSError):
                        raise r
                    continue
                sock, accept = r
                if self._closed() or accept.incarnation != incarnation:
                    continue
                # The handshake read exactly its frames: what follows is the engine's.
                self._add_conn(ep, sock.detach(), rail)
                added += 1
        finally:
            for sock in socks:
                if sock.fileno() >= 0:
                    sock.close()
        return added

    async def _probe(self, peer: Peer, rail: int) -> None:
        """Re-dials a failed rail until the peer's engine takes connections on
        it again (or the peer is gone): after probe_delay seconds, then twice as
        long after each attempt that added nothing, up to probe_max (an address
        that never answers is not hammered)."""
        address = peer.rails[rail]
        delay = self._probe_delay
        try:
            while not (peer.lost or self._closed()):
                await asyncio.sleep(delay)
                join = self._joining.get(peer)
                if join is not None and not join.done():
                    # The peer's connections are still joining: those not
                    # added yet would count as missing here and the rail end
                    # with more than asked for (the engine caps an endpoint
                    # at 16). What they leave missing is counted after them.
                    await asyncio.wait((join,))
                if peer.lost or self._closed():
                    return
                need = peer._rail_conns - self.live(peer).get(rail, 0)
                if need <= 0:
                    break
                try:
                    added = await self.dial(peer._ep, rail, address, need, peer.incarnation)
                except _cyx.NativeError:
                    return  # the endpoint is gone: the peer is lost
                if added and self.live(peer).get(rail, 0) >= peer._rail_conns:
                    break
                delay = self._probe_delay if added else min(2 * delay, self._probe_max)
            if not (peer.lost or self._closed()) and peer._rail_up(rail):
                _log.info("rail.up", agent=self._agent, peer=peer.name, address=address)
        finally:
            peer._probe_end(rail)

"""An agent's hand-off to etcd: joining, republishing, name look-ups, leaving.

A collaborator of :class:`aioxfer.Agent`, made only when the agent has
``discovery=Etcd(...)``. It opens the agent's :class:`~aioxfer.discovery.EtcdSession`
(publishing our metadata under a lease; the session reports the other members to
:class:`~aioxfer.members.Members`), republishes when our regions change, resolves
an agent's name to the incarnation etcd holds now (fencing older ones), and
leaves at close. It reaches the agent only through the narrow arguments it was
built with, never its state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from aioxfer.dialing import parse_address
from aioxfer.discovery import Etcd, EtcdSession, retrieve_exception
from aioxfer.errors import ClosedResourceError, PeerLost, ProtocolError, TransportError, XferError
from aioxfer.log import get_logger

if TYPE_CHECKING:
    from aioxfer.members import Members
    from aioxfer.peer import Peer

__all__ = ["Cluster"]

_log = get_logger("aioxfer")


def _check_address(name: str, address: str) -> None:
    """etcd's address for ``name`` is a "host:port" connect() dials, never a
    name it would resolve again (an address naming its own agent recursed
    without end) nor one it rejects with ValueError: anyone who can write the
    prefix writes it."""
    port = address.rpartition(":")[2]
    try:
        parse_address(address)
        if not (port.isascii() and port.isdigit()):
            raise ValueError(f"address {address!r} has no valid port")
    except ValueError as exc:
        raise ProtocolError(
            f"etcd holds no usable address for agent {name!r}: {exc}", peer=name
        ) from None


class Cluster:
    """The agent's etcd session (see the module docstring).

    ``agent``: its name; ``discovery``: the etcd configuration;
    ``incarnation``: ours; ``members``: the membership collaborator (the
    session's listener; fencing); ``published()``: our metadata as published
    in etcd; ``peers_by_inc``: live Peers by (name, incarnation);
    ``closed()``: whether the agent is closed.

    ``session`` is the joined session (None until joined, and after a failed
    join); ``joining`` the join task once the agent started.
    """

    __slots__ = (
        "_agent",
        "_discovery",
        "_incarnation",
        "_members",
        "_published",
        "_peers_by_inc",
        "_closed",
        "session",
        "joining",
        "_waiting",
        "_retry_now",
    )

    def __init__(
        self,
        agent: str,
        *,
        discovery: Etcd,
        incarnation: int,
        members: Members,
        published: Callable[[], bytes],
        peers_by_inc: Mapping[tuple[str, int], Peer],
        closed: Callable[[], bool],
    ) -> None:
        self._agent = agent
        self._discovery = discovery
        self._incarnation = incarnation
        self._members = members
        self._published = published
        self._peers_by_inc = peers_by_inc
        self._closed = closed
        self.session: EtcdSession | None = None
        self.joining: asyncio.Task[None] | None = None
        self._waiting = 0  # start()s awaiting the join
        # Set by a start() that comes while a lazy join waits to try again:
        # it tries at once, rather than after the rest of its backoff.
        self._retry_now = asyncio.Event()

    # ------------------------------------------------------------ joining

    def join(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts joining (the agent started). Joining needs etcd round trips:
        start() awaits it (``joined``); a lazy start (first connect, write or
        read) lets it run in the background."""
        self.joining = loop.create_task(self._join(), name=f"aioxfer-join-{self._agent}")
        # Its exception is raised to whoever awaits start() (joined());
        # retrieved so that asyncio does not log it when nobody did.
        self.joining.add_done_callback(retrieve_exception)

    async def joined(self) -> None:
        """Waits until joined; raises what joining raised.

        Cancelled while it waits, and the only one waiting, it cancels the join
        and waits for it to undo itself: a start() that was cancelled leaves
        nothing joined (no key in etcd, no lease). A later start() joins
        again, as it does after a join that failed."""
        task = self.joining
        if task is None:
            return
        if task.done() and self.session is None and not self._closed():
            # An earlier start() was cancelled, or its join failed (etcd down):
            # this one tries again, rather than raising that old error for ever.
            self.join(asyncio.get_running_loop())
            task = self.joining
            assert task is not None
        self._waiting += 1
        self._retry_now.set()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiting == 1:
                if not task.done():
                    task.cancel()
                    # Bounded: the join's own undoing is (session.aclose).
                    await asyncio.wait([task])
                if not task.cancelled() and task.exception() is None:
                    # It had just joined as we were cancelled: leave again.
                    session, self.session = self.session, None
                    if session is not None:
                        await session.aclose()
                        self._members.forget()
            raise
        finally:
            self._waiting -= 1

    async def _join(self) -> None:
        """Joins; a lazy start's join (nobody awaits it) that fails tries
        again in the background, with backoff, until it joins or the agent
        closes: it was retried only by a later start() or connect(name), so
        an agent started lazily while etcd was down never joined, however
        long etcd had been back. A start() that waits gets the failure."""
        backoff = 0.5
        tries = 0
        while True:
            self._retry_now.clear()
            tries += 1
            try:
                await self._join_once()
                if tries > 1:
                    _log.info("discovery.join_recovered", agent=self._agent, tries=tries)
                return
            except Exception as exc:
                if self._closed() or isinstance(exc, ClosedResourceError):
                    raise
                if self._waiting:
                    _log.warning("discovery.join_failed", agent=self._agent, reason=str(exc))
                    raise
                if tries == 1:  # once, not at every try while etcd is down
                    _log.warning("discovery.join_failed", agent=self._agent,
                                 reason=f"{exc}; trying again in the background")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await self._retry_now.wait()
            backoff = min(backoff * 2, max(1.0, float(self._discovery.ttl)))

    async def _join_once(self) -> None:
        session = EtcdSession(self._discovery, self._agent, self._incarnation, self._members)
        try:
            members = await session.open(self._published())
            if self._closed():
                raise ClosedResourceError(f"agent {self._agent!r} is closed")
        except BaseException as exc:
            await session.aclose()
            if isinstance(exc, Exception) and not isinstance(exc, XferError):
                raise TransportError(
                    f"agent {self._agent!r} cannot join through etcd at "
                    f"{', '.join(self._discovery.endpoints)}: {exc}"
                ) from exc
            raise
        try:
            await self._members.reset(members)
        except BaseException:
            # Cancelled (or failed) before the keepalive runs: a key left on a
            # lease nobody refreshes would show a member for a ttl, and the
            # members the reset took would stay in membership() of an agent
            # that never joined.
            await session.aclose()
            self._members.forget()
            raise
        self.session = session
        session.start()
        self.changed()  # regions registered while we were joining

    def changed(self) -> None:
        """Our advertised regions changed: republish (once joined)."""
        if self.session is not None and not self._closed():
            self.session.publish(self._published())

    async def leave(self) -> None:
        """Leaves etcd now, so that the others see PeerLeft at once rather
        than when our lease would expire."""
        if self.session is not None:
            await self.session.aclose()

    # ------------------------------------------------------------ names

    async def connect(self, name: str, connect: Callable[[str], Awaitable[Peer]]) -> Peer:
        """The Peer of agent ``name`` in the incarnation etcd holds now (older
        ones fenced: StalePeer), connected with ``connect(address)``. A name
        etcd does not hold raises PeerLost. The agent has joined."""
        session = self.session
        assert session is not None
        try:
            meta = await session.resolve(name)
        except (Exception, TimeoutError) as exc:
            if isinstance(exc, XferError):
                raise
            raise TransportError(
                f"cannot look up agent {name!r} in etcd at {session._endpoint}: "
                f"{str(exc) or type(exc).__name__}"
            ) from exc
        if meta is None:
            raise PeerLost(
                f"no agent named {name!r} in etcd (key {self._discovery.key(name)!r}): "
                f"not started yet, left, or its lease expired",
                peer=name,
            )
        _check_address(name, meta.address)
        known = self._peers_by_inc.get((name, meta.incarnation))
        if known is not None and not known.lost:
            return known
        self._members.fence(name, meta.incarnation, None)
        peer = await connect(meta.address)
        if peer.name != name:
            raise TransportError(
                f"etcd says agent {name!r} is at {meta.address}, but the agent there is "
                f"{peer.name!r}"
            )
        return peer

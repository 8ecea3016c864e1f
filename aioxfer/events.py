"""The engine's events that are not a transfer's completion.

A collaborator of :class:`aioxfer.Agent`: the drain (``Submission``) hands it
every completion record that is not a transfer's, and it routes each one: a
notification to ``agent.notifications``, a rail or a peer lost to the rails and
the peer table, a region freed to the agent's memory, an engine log line to the
log, a closed connection's tag back to the tag table. It reaches the agent only
through the narrow arguments it was built with, never its state.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from aioxfer import _cyx
from aioxfer.log import get_logger
from aioxfer.notifications import Notification

if TYPE_CHECKING:
    from aioxfer.peer import Peer

__all__ = ["EngineEvents"]

_log = get_logger("aioxfer")

_CQ_NOTIFY = _cyx.CQ_NOTIFY
_E_CLOSED = _cyx.E_CLOSED
_monotonic = time.monotonic

#: notification ids remembered per peer (see EngineEvents): at ~136 bytes
#: each, about 1 MiB for a peer that notifies without pause.
NOTIFY_SEEN = 8192


class EngineEvents:
    """Routes the engine's events (see the module docstring).

    ``agent``: its name (logs); ``tag_names``: connection tag -> peer name;
    ``tag_unref(tag)``: a connection holding a tag closed; ``notify(message,
    tag)``: queues a notification for the application; ``peer_of(ep)``: the
    live Peer of an endpoint, or None; ``peer_lost(ep, status, log, bye)``:
    the engine's loss record of an endpoint: marks its peer lost, or reports
    one already marked at a refused post (bye: it said goodbye, its agent
    closed); False if no peer has that endpoint; ``rail_down(peer,
    rail, moved, status)``: a rail of a tcp peer failed; ``connecting``:
    endpoints still connecting -> the status they were lost with (0 until
    then); ``region_freed(rid)``: no peer can touch that
    region any more.

    A notification arrives once per sending: when a rail fails, the sender
    sends again, on another rail, every notification that rail still owed it
    an acknowledgement for, and one of those may have arrived already (only
    its acknowledgement was lost). So notifications are delivered once per
    (connection tag, the sender's request id): ``seen_for`` seconds (at least
    the time a sender takes to give up on a silent rail: its peer_timeout)
    and the last NOTIFY_SEEN of each peer are remembered; a copy is dropped
    (logged) and its credit given back with ``release(tag)``.
    """

    __slots__ = (
        "_agent",
        "_tag_names",
        "_tag_unref",
        "_notify",
        "_peer_of",
        "_peer_lost",
        "_rail_down",
        "_connecting",
        "_region_freed",
        "_release",
        "_seen_for",
        "_seen",
    )

    def __init__(
        self,
        agent: str,
        *,
        tag_names: Mapping[int, str],
        tag_unref: Callable[[int], None],
        notify: Callable[[Notification, int], None],
        peer_of: Callable[[int], Peer | None],
        peer_lost: Callable[[int, int, bool, bool], bool],
        rail_down: Callable[[Peer, int, int, int], None],
        connecting: dict[int, int],
        region_freed: Callable[[int], None],
        release: Callable[[int], None],
        seen_for: float,
    ) -> None:
        self._agent = agent
        self._tag_names = tag_names
        self._tag_unref = tag_unref
        self._notify = notify
        self._peer_of = peer_of
        self._peer_lost = peer_lost
        self._rail_down = rail_down
        self._connecting = connecting
        self._region_freed = region_freed
        self._release = release
        self._seen_for = seen_for
        # tag -> (request ids delivered, (forget at, id) in arrival order)
        self._seen: dict[int, tuple[set[int], deque[tuple[float, int]]]] = {}

    def on_event(
        self,
        kind: int,
        status: int,
        id_: int,
        tag: int,
        nbytes: int,
        fail_index: int,
        payload: bytes | None,
    ) -> None:
        """A completion record that is not a transfer's (Submission's
        ``on_event``): a notification, or an engine event."""
        if kind == _CQ_NOTIFY:
            name = self._tag_names.get(tag)
            if name is None:
                name = f"tag-{tag}"  # a tag we never saw: should not happen
            if self._first(tag, id_):
                self._notify(Notification(name, payload or b""), tag)
            else:
                _log.info("notify.duplicate", agent=self._agent, peer=name, id=id_)
                self._release(tag)
            return
        if kind == _cyx.CQ_RAIL_DOWN:
            rpeer = self._peer_of(id_)
            if rpeer is not None:
                self._rail_down(rpeer, fail_index, nbytes, status)
            return
        if kind == _cyx.CQ_PEER_LOST:
            # fail_index 1: the peer said goodbye (its engine shut down)
            known = self._peer_lost(id_, status, status != _E_CLOSED, fail_index == 1)
            if not known and id_ in self._connecting:
                self._connecting[id_] = status
            # Its endpoint's reference to its tag went (here, or when we
            # closed or dropped it): the last one, when its connections to
            # us closed first.
            self._sweep()
        elif kind == _cyx.CQ_REGION_FREED:
            self._region_freed(id_)
        elif kind == _cyx.CQ_LOG:
            if payload is not None and payload.startswith(b"verbs: GPU region"):
                # GPUDirect registration failed: said loudly, it is a slow path.
                warnings.warn(payload.decode("utf-8", "replace"), RuntimeWarning, stacklevel=1)
            _log.warning(
                "engine.log",
                agent=self._agent,
                peer=self._tag_names.get(tag),
                tag=tag,
                reason=(payload or b"").decode("utf-8", "replace"),
            )
        elif kind == _cyx.CQ_CONN_CLOSED:
            _log.debug("conn.closed", agent=self._agent, peer=self._tag_names.get(tag), tag=tag)
            self._tag_unref(tag)
            if tag not in self._tag_names:  # the peer's last connection: forgotten
                self._seen.pop(tag, None)

    def _sweep(self) -> None:
        """Forgets the notification ids of tags released (their peers gone).
        A tag goes with its last reference, which is a connection's close
        record (forgotten there) or the peer's endpoint: marked lost after
        its connections to us closed, or closed, or dropped. Those ids stayed
        for good then, up to NOTIFY_SEEN per peer that had notified us (rev31).
        Swept at each peer lost and each new tag that notifies: O(peers that
        notified us), on rare events."""
        names = self._tag_names
        for tag in [t for t in self._seen if t not in names]:
            del self._seen[tag]

    def _first(self, tag: int, id_: int) -> bool:
        """Whether notification id_ of tag's peer is new (and remembers it)."""
        now = _monotonic()
        seen = self._seen.get(tag)
        if seen is None:
            self._sweep()
            seen = self._seen[tag] = (set(), deque())
        ids, order = seen
        while order and (order[0][0] <= now or len(order) >= NOTIFY_SEEN):
            ids.discard(order.popleft()[1])
        if id_ in ids:
            return False
        ids.add(id_)
        order.append((now + self._seen_for, id_))
        return True

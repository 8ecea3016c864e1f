"""PeerTier: other stores' host memory, placed by rendezvous hashing over the
agent's membership. No master: every member computes the same placement from
the same member list.

What a member publishes (regions of its agent, read one-sided by the others):
- ``kvpeer.{group}.pool``: its host tier's pool;
- ``kvpeer.{group}.index``: a hash table of what the pool holds (4 ways per
  bucket; an entry is key, slot, CRC32C and a check, so a reader that races
  an update sees a failed check, never a wrong slot);
- ``kvpeer.{group}.meta``: where its control agent listens, and the geometry.

Placement: key K belongs to the ``replicas`` members with the highest
``H(K ‖ member name)`` (rendezvous / highest-random-weight hashing): a
member joining or leaving moves only the keys it owns. A block leaves its
writer's host tier for its owners; a writer that is itself an owner sends it
to the next member in that order instead, so readers probe the top
``replicas + 1`` members other than themselves. A block the host tier
writes back (its next storing tier is this one) goes to its owners: the
owner pulls it with a one-sided READ from the writer's pool, verifies it and
publishes it in its index, then acknowledges over its control agent (a small
agent of the tier's own, so the application's notifications are never
consumed here). A get probes the owners' index buckets (one-sided READs),
then READs the block straight from the owner's pool into the caller's
memory and verifies its CRC. A member that left (or whose read fails because
it died) is a miss: the get's prefix ends there, nothing hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import random
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import aioxfer
from aioxfer._uncancelled import finish_uncancelled, run_to_end
from aioxfer.errors import PeerLost, XferError
from aioxfer.kv import checksum as ck
from aioxfer.kv.disk import entry_check
from aioxfer.kv.errors import BlockMissing, BlockUnavailable
from aioxfer.kv.tier import Tier, landed
from aioxfer.log import get_logger
from aioxfer.names import name_problem
from aioxfer.region import Region, RemoteRegion, SegmentList

if TYPE_CHECKING:
    from aioxfer.kv.host import HostTier
    from aioxfer.kv.store import Store

__all__ = ["PeerIndex", "PeerTier", "owners"]

_log = get_logger("aioxfer.kv")
# A member's control agent is its store agent's name and this.
_CTL = ".kvctl"
WAYS = 4
IENTRY = 64
IDX_DTYPE = np.dtype([("key", "V32"), ("slot", "<u4"), ("crc", "<u4"), ("gen", "<u8"),
                      ("pad", "<u4"), ("algo", "<u4"), ("used", "<u4"), ("check", "<u4")])
assert IDX_DTYPE.itemsize == IENTRY
_META_BYTES = 4096
_MAX_PER_MSG = 64  # (key, offset, crc) entries per control message (<= 4 KiB)
# A placement refused as "busy" (see _refuse) is sent again after a random
# pause of 0.5-1.5 x this, doubled each time up to _BUSY_PAUSE_MAX (seconds).
_BUSY_PAUSE = 0.002
_BUSY_PAUSE_MAX = 0.05
# Joins _follow runs at once (each a connect and a meta read, in tasks of
# their own: see _follow); the events past them wait their turn in order.
_FOLLOW_JOINS = 16
# Meta reads at once, each into its own _META_BYTES of the join stage
# (they shared the probes' stage under one lock: one member whose meta read
# hung, stopped after connecting, held every later join and every get's
# probe for the agent's stall bound).
_JOIN_READS = 8
# Index buckets the probes' stage holds (WAYS x IENTRY bytes each: 256 KiB),
# handed out first come, first served to the members' bucket reads, of at
# most _PROBE_KEYS buckets each, and a member's reads at most _PROBE_KEYS at
# once (_Member.probing). (One lock over a stage of 256: a member whose
# bucket read hung, stopped, held every get's probe of every other member
# for the agent's peer timeout.)
_PROBE_BUCKETS = 1024
_PROBE_KEYS = 256
# Parts of the pull staging (each pull_staging_blocks blocks), one per
# staged read at once. (One area under one lock: a sender stopped with its
# blocks being read held every other sender's staged pull for the agent's
# peer timeout; their ack_waits passed, and they took this owner for
# silent, skipping it for ack_timeout.)
_PULL_PARTS = 4
# Parts one sender's staged reads hold at once (its pulls, up to
# max_pulls_per_peer, each took a part of its own: a stopped sender with 4
# placements in flight held them all, rv31a).
_PULL_SHARE = 1
# Request numbers of a member's placements that went unanswered past their
# ack_wait kept for a late ack (_Member.late): the newest this many.
_LATE_MAX = 64


def _bucket(key: bytes, nb: int) -> int:
    return int.from_bytes(key[:8], "little") & (nb - 1)


def _score(key: bytes, member: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + member.encode(), digest_size=8).digest(), "little")


def _count(counts: dict[str, int], name: str, by: int) -> None:
    """counts[name] += by, the entry dropped at 0."""
    c = counts.get(name, 0) + by
    if c:
        counts[name] = c
    else:
        counts.pop(name, None)


def _member_name(sender: str) -> str:
    """The member a placement's or ack's sender speaks for: a store agent's
    control agent is its name and _CTL; a plain agent speaks for itself."""
    return sender[:-len(_CTL)] if sender.endswith(_CTL) else sender


def owners(key: bytes, members: list[str], replicas: int) -> list[str]:
    """The ``replicas`` members that own ``key`` (highest score first)."""
    return sorted(members, key=lambda m: _score(key, m), reverse=True)[:replicas]


class PeerIndex:
    """The published hash table of a host tier (see the module doc)."""

    def __init__(self, region: Region, buckets: int) -> None:
        self.region = region
        self.buckets = buckets
        self.rows = region.numpy().view(IDX_DTYPE).reshape(buckets, WAYS)
        self.gen = 0

    def add(self, key: bytes, slot: int, crc: int) -> None:
        b = _bucket(key, self.buckets)
        row = self.rows[b]
        way = next((w for w in range(WAYS) if not row[w]["used"]), None)
        if way is None:  # full: the oldest entry goes (a miss for peers, not an error)
            way = int(np.argmin(row["gen"]))
        self.gen += 1
        rec = np.zeros(1, dtype=IDX_DTYPE)
        rec["key"] = np.frombuffer(key, dtype="V32")
        rec["slot"] = slot
        rec["crc"] = crc
        rec["gen"] = self.gen
        rec["algo"] = ck.ALGO
        rec["used"] = 1
        rec["check"] = entry_check(rec.view(np.uint8).reshape(1, IENTRY))[0]
        row[way] = rec[0]

    def remove(self, key: bytes) -> None:
        b = _bucket(key, self.buckets)
        row = self.rows[b]
        kv = np.frombuffer(key, dtype="V32")[0]
        for w in range(WAYS):
            if row[w]["used"] and row[w]["key"] == kv:
                row[w]["check"] = 0  # invalid first: a racing reader skips it
                row[w] = np.zeros(1, dtype=IDX_DTYPE)[0]


def parse_bucket(raw: npt.NDArray[np.uint8], key: bytes) -> tuple[int, int, int] | None:
    """(slot, crc, algo) of ``key`` in one bucket's bytes, if present and intact."""
    rows = raw.reshape(WAYS, IENTRY)
    ent = rows.view(IDX_DTYPE).ravel()
    ok = (ent["used"] == 1) & (entry_check(rows) == ent["check"])
    kv = np.frombuffer(key, dtype="V32")[0]
    for w in np.flatnonzero(ok).tolist():
        if ent["key"][w] == kv:
            return int(ent["slot"][w]), int(ent["crc"][w]), int(ent["algo"][w])
    return None


class _Slots:
    """``n`` numbered slots handed out first come, first served: ``take(k)``
    waits until every request before it has been served and ``k`` slots are
    free (a large request is never passed by smaller ones after it, so none
    starves). A request cancelled while it waits leaves the queue (and wakes
    those it held up); one cancelled after its slots were granted, before
    it resumed, gives them back."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.free: list[int] = list(range(n))
        self._waiters: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    async def take(self, k: int) -> list[int]:
        if not 1 <= k <= self.n:
            raise ValueError(f"take({k}) of {self.n} slots")
        if self.ready(k):
            return self._grab(k)
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        entry = (k, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give_back(fut.result())  # granted, but we are not there to use them
            else:
                with contextlib.suppress(ValueError):  # (_wake may have dropped it)
                    self._waiters.remove(entry)
                self._wake()  # it may have held up those after it
            raise

    def ready(self, k: int) -> bool:
        """Whether take(k) would be served at once."""
        return not self._waiters and len(self.free) >= k

    def give_back(self, slots: list[int]) -> None:
        self.free.extend(slots)
        self._wake()

    def _grab(self, k: int) -> list[int]:
        got = self.free[-k:]
        del self.free[-k:]
        return got

    def _wake(self) -> None:
        while self._waiters:
            k, fut = self._waiters[0]
            if fut.done():  # cancelled, not yet removed by its taker
                self._waiters.popleft()
                continue
            if len(self.free) < k:
                return
            self._waiters.popleft()
            fut.set_result(self._grab(k))


class _Barred(LookupError):
    """A sender's "from" not dialled (PeerTier._dial_barred says why)."""


class _Member:
    def __init__(self, name: str, peer: aioxfer.Peer, meta: dict[str, Any],
                 sends: int) -> None:
        self.name = name
        self.peer = peer
        self.meta = meta
        self.pool: RemoteRegion = peer.region(meta["pool"])
        self.index: RemoteRegion = peer.region(meta["index"])
        self.buckets = int(meta["buckets"])
        self.ctl: aioxfer.Peer | None = None
        # Placements sent and not yet acknowledged: request -> its future.
        self.waiting: dict[int, asyncio.Future[tuple[bytes, bool]]] = {}
        # Requests whose ack_wait passed unanswered (the newest _LATE_MAX,
        # oldest first); a late ack of one of them proves the member alive
        # again. (A set that grew by one request per ack_timeout, for ever,
        # for a member that never answers but stays connected.)
        self.late: dict[int, None] = {}
        # When it last let a placement's ack_wait pass (None: it answers):
        # while set, no placement is sent to it (see PeerTier._place).
        self.silent_since: float | None = None
        # Its share of the probes' stage: the buckets its reads may hold at
        # once (see _PROBE_BUCKETS). Each get that probed a stopped member
        # took up to _PROBE_KEYS more, held for the peer timeout: four such
        # gets held them all, and every probe of every other member waited
        # (rv31a). Past its share, its reads wait here, holding none.
        self.probing = _Slots(_PROBE_KEYS)
        # Placements to it in flight at once: at most what it pulls from one
        # peer (its max_pulls_per_peer, published in its meta), so that our
        # own placements are never refused there for arriving together.
        self.sending = _Slots(sends)

        # Set once it is no longer the member of its name (it left, or its
        # next incarnation replaced it): ends a busy retry's pause (_place).
        self.gone = asyncio.Event()

    @property
    def silent(self) -> bool:
        return self.silent_since is not None

    def went_late(self, req: int) -> None:
        """Placement ``req`` let its ack_wait pass: kept for a late ack, the
        oldest let go past _LATE_MAX (its late ack then proves nothing; the
        next try after ack_timeout finds the member answering)."""
        self.late[req] = None
        while len(self.late) > _LATE_MAX:
            del self.late[next(iter(self.late))]


class PeerTier(Tier):
    """Blocks in other stores' host tiers (see the module doc). ``group``:
    stores of one group share blocks (and need the same block size);
    ``replicas``: owners per block; ``seeds``: addresses of members to connect
    to when the agent has no discovery (with etcd, members are found through
    ``agent.membership()``). ``max_pulls``: placements (requests of up to 64
    blocks each) pulled here at once, at most ``max_pulls_per_peer`` of them
    from one sending peer; a request past either is refused (acknowledged
    with nothing stored and "busy": its sender sends it again after a short
    random pause, until its ack_wait is over, then drops those blocks,
    "peer_busy"; counted there as ``busy_retries``) and counted here
    (``pulls_refused``, dropped "pull_refused"): a flood from a broken or
    hostile peer starts no unbounded work.

    ``ack_wait``: how long a placement waits for its member's
    acknowledgement (its turn behind our other placements to that member
    and connecting to it included). Past it the blocks count as
    not stored (dropped "ack_timeout"; the member may still take them: it
    verifies what it reads, so a slot reused meanwhile is refused there) and
    the member (if that placement had not waited for its turn) is
    *silent*: placements to it are skipped at once (dropped
    "peer_stalled") until it answers again (a late ack), leaves, or
    ``ack_timeout`` has passed (then one placement tries it again). One
    stopped or wedged member (alive to the kernel, so not yet lost) thus
    costs one ``ack_wait``, never a write-back or put held for each of its
    placements; a member that leaves (lost) fails its placements at once.
    Acknowledgements count only from the member asked, for a request
    number drawn at random, with one byte 0/1 per block sent.

    ``pull_staging_blocks``: blocks placed here while the host tier has no
    free slot are read into a staging area of this many blocks first and
    verified there; only the good ones make room (evict clean cold blocks).
    The area is 4 such parts (4 staged reads at once, each in a part of its
    own, one sender's one at a time): a sender that stops while its blocks
    are read holds one part, not every other sender's pulls.

    ``place_staging_blocks``: blocks of a caller's memory (a put that
    overflows the host tier) are copied into a tier-owned area of this many
    blocks first (allocated at the first such put), and their owners pull
    them from there: once a put has returned or raised, its ``src`` is never
    read again, whatever its owners do. (They pulled from ``src`` itself: an
    owner stopped past ``ack_wait``, or sent a placement of a cancelled put,
    read it later, while the caller was reusing it.) A late pull now reads
    store memory, which the owner verifies (a slot reused meanwhile fails
    its checksum there, as for host slots written back). Concurrent puts
    share the area: each round of a put (up to this many blocks) takes
    slots of its own, first come, first served, and holds them until its
    placements have ended; rounds of several puts are in flight together.
    (They took the whole area one at a time: 8 concurrent puts of 8 blocks
    were 8 placements one after another.) A writer keeps at most its
    member's ``max_pulls_per_peer`` (published in its meta) placements in
    flight to it, write-backs included, so that none is refused for
    arriving together with the others."""

    kind = "peer"
    probes = True

    def __init__(self, *, name: str = "peer", group: str = "kv", replicas: int = 1,
                 seeds: list[str] | None = None, max_pulls: int = 16,
                 max_pulls_per_peer: int = 4, ack_wait: float = 1.0,
                 ack_timeout: float = 10.0, pull_staging_blocks: int = 8,
                 place_staging_blocks: int = 64) -> None:
        super().__init__(name)
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        if not 0 < ack_wait <= ack_timeout:
            raise ValueError("need 0 < ack_wait <= ack_timeout (seconds)")
        if pull_staging_blocks < 1:
            raise ValueError("pull_staging_blocks must be >= 1")
        self.pull_staging_blocks = int(pull_staging_blocks)
        if place_staging_blocks < 1:
            raise ValueError("place_staging_blocks must be >= 1")
        self.place_staging_blocks = int(place_staging_blocks)
        self.place_stage: Region | None = None  # see the class doc; made at first use
        # Its blocks, handed to the puts' rounds first come, first served.
        self.place_slots = _Slots(self.place_staging_blocks)
        self.pull_stage: Region | None = None
        self.pull_parts = _Slots(_PULL_PARTS)  # (see _PULL_PARTS)
        # Room made for staged blocks and their copy in, one pull at a time
        # (local: never waits on a sender). Concurrently, pulls took slots
        # that the others could then not evict: a host tier of fewer slots
        # than the parts hold refused ~10 % of the blocks placed
        # (benchmarks/kv_probe.py put, members of 16 slots).
        self.room_lock = asyncio.Lock()
        # sender -> its share of the parts (_PULL_SHARE) and how many of its
        # pulls hold or wait for it (dropped at none: senders churn)
        self._pull_shares: dict[str, tuple[_Slots, list[int]]] = {}
        self.ack_wait = float(ack_wait)
        self.ack_timeout = float(ack_timeout)
        if max_pulls < 1 or max_pulls_per_peer < 1:
            raise ValueError("max_pulls and max_pulls_per_peer must be >= 1")
        self.max_pulls = max_pulls
        self.max_pulls_per_peer = max_pulls_per_peer
        self._pulling: dict[str, int] = {}  # sending peer -> its pulls reading here
        # sending peer -> its pulls done reading whose ack is being sent: no
        # longer counted above (notify returns once the peer has the ack,
        # and the sender, acknowledged, may send its next placement before
        # our notify returns: it was refused then, its blocks dropped), and
        # bounded apart, at max_pulls from one peer (an ack can hang in its
        # connect while the sender sends more).
        self._answering: dict[str, int] = {}
        self._pull_tasks: dict[asyncio.Task[Any], str] = {}  # a pull reading -> its sender
        # Refusals being acknowledged: to a member, per member (its sender
        # name); to a sender that is no member (each dials its "from"
        # first: _introduce), all together under "" (see _refuse).
        self._acking: dict[str, int] = {}
        # "from" addresses of senders that are no member (embedded) whose
        # last dial reached no agent of the sender's: (sender, address), or
        # ("", address) where it reached no agent at all -> when (see
        # _dial_barred; oldest first).
        self._misdialled: dict[tuple[str, str], float] = {}
        self.pulls_refused = 0
        self.group = group
        self.replicas = replicas
        self.seeds = list(seeds or [])
        self.members: dict[str, _Member] = {}
        self.located: dict[bytes, tuple[str, int, int, int]] = {}  # key -> member, slot, crc, algo
        self.ctl: aioxfer.Agent | None = None
        self.meta_region: Region | None = None
        self.index: PeerIndex | None = None
        self.stage: Region | None = None  # the probes' (_PROBE_BUCKETS)
        self.probe_slots = _Slots(_PROBE_BUCKETS)
        self._tasks: set[asyncio.Task[Any]] = set()
        # (the member's control agent's name, request) -> the ack's future
        # (an ack is its bitmap and whether it says "busy": see _refuse)
        self._acks: dict[tuple[str, int], asyncio.Future[tuple[bytes, bool]]] = {}
        # name -> the peer being joined under it and its join (see _add_member)
        self._joining: dict[str, tuple[aioxfer.Peer, asyncio.Task[_Member | None]]] = {}
        # _follow's joins: (name, incarnation) -> its join under way (at most
        # _FOLLOW_JOINS), or its address while it waits for its turn.
        self._follows: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._queued: dict[tuple[str, int], str] = {}
        # name of a live member -> the last agent refused that name while
        # that member lived (see _taken): joined once the member leaves.
        self._claims: dict[str, aioxfer.Peer] = {}
        # The meta reads' stage (_JOIN_READS x _META_BYTES) and its parts.
        self.join_stage: Region | None = None
        self.join_slots = _Slots(_JOIN_READS)
        self._closing = False
        self.busy_retries = 0  # placements sent again after a "busy" refusal
        self.pulled = 0  # blocks other members placed here

    # ------------------------------------------------------------ open / close

    async def _open(self, store: Store) -> None:
        await super()._open(store)
        host = store._host
        if host is None or host.region is None:
            raise ValueError("a PeerTier publishes the store's host tier: add a HostTier")
        agent = store.agent
        buckets = 1
        while buckets * WAYS < 2 * host.n_slots:
            buckets *= 2
        pfx = f"kvpeer.{self.group}"
        idx_region = agent.alloc(buckets * WAYS * IENTRY, name=f"{pfx}.index")
        self.index = PeerIndex(idx_region, buckets)
        host.publish(self.index)
        self.stage = agent.alloc(_PROBE_BUCKETS * WAYS * IENTRY)
        self.join_stage = agent.alloc(_JOIN_READS * _META_BYTES)
        self.pull_stage = agent.alloc(_PULL_PARTS * self.pull_staging_blocks * store.block_bytes)
        host_part = agent.address.rsplit(":", 1)[0]
        # Its timeouts are the store agent's (it used the defaults whatever
        # those were: a member stopped was taken for lost after 5 s here
        # while the store's agent, configured for 1 s, had long let it go;
        # an ack to a stopped writer held a pull for as long). So are its
        # credentials: the store agent's key (or none, insecure_no_auth),
        # not the default token ($AIOXFER_TOKEN or the token file), which
        # members given token= with other token files do not share (their
        # control agents could not reach each other: every placement
        # failed), and which the application did not choose.
        # It only sends and receives notifications (small, a few a
        # placement) and has no memory of its own: one tcp connection a
        # peer, and the store agent's transports but verbs and cuda (kv28:
        # the defaults gave it 4 connections a peer over tcp, each with its
        # thread, both ways). One copy worker (not the default 2): it
        # never copies (no memory; a notification goes straight to its
        # connection, engine.c axf_post's AXF_OP_NOTIFY branch, never
        # through shm's workers), so the second was an idle thread. (kv26
        # read ~25 % slower rounds with one over 5 pairs; kv29,
        # benchmarks/kv26_overflow.py KV26_CTL_COPY_WORKERS=1 vs 2, 6
        # interleaved pairs: medians 16.2 vs 15.6 ms, pair ratios 0.76-1.35,
        # median 1.02: noise.)
        transports = tuple(t for t in agent.transports if t in ("shm", "tcp")) or ("tcp",)
        self.ctl = aioxfer.Agent(f"{agent.name}{_CTL}", listen=f"{host_part}:0",
                                 transports=transports, tcp_connections=1, copy_workers=1,
                                 peer_timeout=agent._peer_timeout,
                                 keepalive=agent._keepalive,
                                 stall_timeout=agent._stall_timeout, limits=agent.limits,
                                 _credentials_of=agent)
        await self.ctl.start()
        meta = {"v": 1, "ctl": self.ctl.address, "address": agent.address,
                "pool": host.region.name, "index": f"{pfx}.index", "buckets": buckets,
                "block_bytes": store.block_bytes, "pulls_per_peer": self.max_pulls_per_peer}
        blob = json.dumps(meta).encode()
        self.meta_region = agent.alloc(_META_BYTES, name=f"{pfx}.meta")
        self.meta_region.numpy()[: len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        self._spawn(self._serve())
        self._spawn(self._follow())
        for address in self.seeds:
            with contextlib.suppress(XferError, OSError):
                await self._add_member(await agent.connect(address))

    async def _aclose(self) -> None:
        """Stops serving and releases what the tier holds. Every step is taken
        even when one before it fails or the close is cancelled at one of its
        awaits (each runs to its end): the first failure, else the cancel, is
        raised once all are done. (It stopped at the first: the control
        agent, the published regions and the host tier's link to its index
        were left behind.)"""
        host = self.store._host
        if host is not None:
            host.publish(None)  # no await: done whatever follows
        self._closing = True  # (no queued join starts as the running ones end)
        self._queued.clear()
        for t in list(self._tasks):
            t.cancel()
        for fut in self._acks.values():
            if not fut.done():
                fut.cancel()
        from aioxfer.kv.store import _deregister_all

        steps: list[Awaitable[Any]] = []
        if self._tasks:
            steps.append(asyncio.gather(*self._tasks, return_exceptions=True))
        if self.ctl is not None:
            steps.append(self.ctl.aclose())
        first: Exception | None = None
        cancelled = False
        for step in steps:
            try:
                cancelled |= await finish_uncancelled(step)
            except Exception as exc:
                _log.warning("kv.peer_close_failed", tier=self.name, error=repr(exc))
                first = first or exc
        # The regions together, waited for once: each release waits up to
        # close_timeout for a peer that maps it, and a stopped member maps
        # all four (one after another that was 4 x close_timeout).
        # The index's rows are a numpy view of its region: dropped first (the
        # host tier let go of it above), or the region stayed mapped for as
        # long as the tier object lived, after its release.
        index_region = self.index.region if self.index is not None else None
        self.index = None
        failed, stopped = await _deregister_all(
            self.store.agent,
            (self.meta_region, self.stage, self.join_stage, self.pull_stage, self.place_stage,
             index_region),
            "kv.peer_close_failed", tier=self.name)
        first = first or failed
        cancelled |= stopped
        if first is not None:
            raise first
        if cancelled:
            raise asyncio.CancelledError

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ membership

    async def _follow(self) -> None:
        """Follows the agent's membership: joins each new member, drops each
        one that leaves. A join runs in a task of its own (at most
        _FOLLOW_JOINS at once, the events past them queued in order), ended
        when that incarnation leaves or the tier closes: the loop goes on
        to the next event at once. (It awaited each join inline: the
        connect to, or the meta read of, one member that accepts and never
        answers held every later event, leaves included, for the agent's
        peer timeout; with discovery, an etcd key naming such an address did
        so at each event of its.)"""
        agent = self.store.agent
        async for ev in agent.membership():
            key = (ev.name, ev.incarnation)
            known = self.members.get(ev.name)
            # (by incarnation: kv29, the leaving of a restarted member's
            # old incarnation removed its successor, and the successor's
            # joining was skipped while the old one was still a member)
            ours = known is not None and known.peer.incarnation == ev.incarnation
            if isinstance(ev, aioxfer.PeerLeft):
                self._unfollow(key)
                gone = self.members.pop(ev.name) if known is not None and ours else None
                if gone is not None:
                    self._left(gone, f"member {ev.name!r} left")
                continue
            if ev.name == agent.name or ours or key in self._follows or key in self._queued:
                continue
            self._queued[key] = ev.address
            self._follow_next()

    def _left(self, gone: _Member, why: str) -> None:
        """``gone`` is no longer the member of its name (popped by the
        caller): what waits for it ends now, and an agent refused its name
        while it lived (_taken) is joined."""
        gone.gone.set()
        _log.info("kv.peer_left", tier=self.name, member=gone.name)
        # Its placements end now (its acks will not come), not after
        # ack_wait each.
        for fut in gone.waiting.values():
            if not fut.done():
                fut.set_exception(PeerLost(why))
        self.located = {k: v for k, v in self.located.items() if v[0] != gone.name}
        claim = self._claims.pop(gone.name, None)
        if claim is not None and not claim.lost and not self._closing:
            # (the restart of a member at another address, found while its
            # old incarnation still lived: it joins now, not at its next event)
            self._queued.setdefault((claim.name, claim.incarnation), claim.address)
            self._follow_next()

    def _follow_next(self) -> None:
        """Starts queued joins while fewer than _FOLLOW_JOINS run."""
        while self._queued and len(self._follows) < _FOLLOW_JOINS and not self._closing:
            key = next(iter(self._queued))
            address = self._queued.pop(key)
            task = asyncio.ensure_future(self._follow_join(address))
            self._follows[key] = task
            self._tasks.add(task)  # (cancelled and waited for by _aclose)
            task.add_done_callback(functools.partial(self._followed, key))

    def _followed(self, key: tuple[str, int], task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._follows.get(key) is task:
            del self._follows[key]
        if not task.cancelled():
            task.exception()  # (retrieved; _follow_join lets none out but a bug)
        self._follow_next()

    def _unfollow(self, key: tuple[str, int]) -> None:
        """Incarnation ``key`` left: its join, queued or under way, ends (a
        connect or a meta read that hangs is not waited out)."""
        self._queued.pop(key, None)
        task = self._follows.get(key)
        if task is not None:
            task.cancel()
        joining = self._joining.get(key[0])
        if joining is not None and joining[0].incarnation == key[1]:
            joining[1].cancel()  # (its callers get None: _add_member)

    async def _follow_join(self, address: str) -> None:
        agent = self.store.agent
        with contextlib.suppress(XferError, OSError, KeyError, ValueError):
            await self._add_member(await agent.connect(address))

    async def join(self, address: str) -> bool:
        """Adds the member at ``address`` (an agent with a store of this group);
        False if the agent there has none, or if its name is a live member's
        (see _taken)."""
        return await self._add_member(await self.store.agent.connect(address)) is not None

    def _taken(self, peer: aioxfer.Peer) -> bool:
        """Whether ``peer``'s name is a live member's (another incarnation's):
        then ``peer`` is no member (logged, remembered: it joins once that
        member leaves). Embedded, names are not unique (the handshake proves
        the token, not the name): an agent named after a member, elsewhere,
        became that member (its placements to the first failed "replaced",
        its blocks were looked for there), whenever the store's agent
        connected to it (any connect: the application's, or a placement
        naming it as "from"). A member's identity is now its incarnation
        while it lives: first come, first served. A restarted member still
        joins at once where its old incarnation is gone: at the same
        address (the agent fences the old one as it connects), or killed
        or closed (its connections end); a stopped one is let go by the
        agent's peer_timeout, and its successor joins then."""
        agent = self.store.agent
        if peer.name == agent.name:  # (ours: this agent lives; _add_member let us pass)
            _log.warning("kv.peer_name_taken", tier=self.name, member=peer.name,
                         address=peer.address, incarnation=f"{peer.incarnation:#x}",
                         reason="it is this store's own agent's name")
            return True
        old = self.members.get(peer.name)
        if old is None or old.peer is peer or old.peer.lost:
            return False
        self._claims[peer.name] = peer
        _log.warning("kv.peer_name_taken", tier=self.name, member=peer.name,
                     address=peer.address, incarnation=f"{peer.incarnation:#x}",
                     held_by=old.peer.address, held_incarnation=f"{old.peer.incarnation:#x}",
                     reason="a live member has this name: not joined while it lives")
        return True

    async def _add_member(self, peer: aioxfer.Peer) -> _Member | None:
        agent = self.store.agent
        if peer.name == agent.name and peer.incarnation == agent.incarnation:
            return None
        why = name_problem(peer.name)
        if why is not None:
            # A member's name goes into log lines (kv.peer_joined, ...) as
            # it is: one with a newline or a terminal escape could forge or
            # hide lines there (kv28). The agent's handshake refuses such
            # names already (aioxfer.names, the one rule): this is the same
            # rule again, for a Peer from anywhere.
            _log.warning("kv.peer_name_refused", tier=self.name, member=repr(peer.name[:256]),
                         reason=why)
            return None
        known = self.members.get(peer.name)
        if known is not None and known.peer is peer:
            return known
        if self._taken(peer):
            return None
        # Concurrent adds of one peer (a pull's _reach and _follow, two
        # placements of a sender that is no member yet) share one join:
        # each made its own _Member, and the second replaced the first,
        # failing the placements sent to it meanwhile ("replaced", kv29).
        # Shielded: one caller cancelled leaves the join to the others.
        joining = self._joining.get(peer.name)
        if joining is None or joining[0] is not peer:
            task = asyncio.ensure_future(self._join_member(peer))
            joining = (peer, task)
            self._joining[peer.name] = joining
            self._tasks.add(task)  # (cancelled and waited for by _aclose)
            task.add_done_callback(lambda t: self._joined(peer.name, t))
        try:
            return await asyncio.shield(joining[1])
        except asyncio.CancelledError:
            # The join ended by its peer's leaving (_unfollow), not a cancel
            # of ours: no member. (The tier's close: cancelled, as before.)
            me = asyncio.current_task()
            if (joining[1].cancelled() and not self._closing
                    and (me is None or not me.cancelling())):
                return None
            raise

    def _joined(self, name: str, task: asyncio.Task[_Member | None]) -> None:
        self._tasks.discard(task)
        if self._joining.get(name, (None, None))[1] is task:
            del self._joining[name]
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have been cancelled

    async def _join_member(self, peer: aioxfer.Peer) -> _Member | None:
        """_add_member's one join of ``peer``: reads its meta, makes it the
        member of its name."""
        raw = await self._read_meta(peer)
        if raw is None:
            return None
        member = self._member(peer, raw)
        if member is None or peer.lost:
            # (lost while read: a join of its next incarnation may already
            # have made that the member, which this one must not replace)
            return None
        if self._taken(peer):  # (joined meanwhile)
            return None
        old = self.members.get(peer.name)
        self.members[peer.name] = member
        if self._claims.get(peer.name) is peer:
            del self._claims[peer.name]
        if old is not None:
            # Lost, its leaving not taken by _follow yet (_taken): its acks
            # will not come (restarted).
            old.gone.set()
            for fut in old.waiting.values():
                if not fut.done():
                    fut.set_exception(PeerLost(f"member {peer.name!r} was replaced"))
        _log.info("kv.peer_joined", tier=self.name, member=peer.name)
        return member

    async def _read_meta(self, peer: aioxfer.Peer) -> bytes | None:
        """``peer``'s published meta (None: it publishes none for our group),
        read into a part of the join stage of its own (see _JOIN_READS)."""
        pfx = f"kvpeer.{self.group}"
        try:
            meta_rr = peer.region(f"{pfx}.meta")
        except KeyError:
            await peer.refresh()
            try:
                meta_rr = peer.region(f"{pfx}.meta")
            except KeyError:
                return None
        stage = self.join_stage
        assert stage is not None
        slot = (await self.join_slots.take(1))[0]
        try:
            part = stage[slot * _META_BYTES:(slot + 1) * _META_BYTES]
            # Never cut short: a cancelled read could still land in the part
            # while the next join reads it.
            await run_to_end(self.store.agent.read(part, meta_rr[0:_META_BYTES]))
            return bytes(part.memoryview).rstrip(b"\x00")
        finally:
            self.join_slots.give_back([slot])

    def _member(self, peer: aioxfer.Peer, raw: bytes) -> _Member | None:
        """The member that ``raw`` (its published meta) describes, or None if
        it is not one we can use: another block size, or bytes that are not
        a meta of this format (a broken or hostile peer is no member, never
        an untyped error out of join, open or a placement)."""
        try:
            meta = json.loads(raw)
            if not isinstance(meta, dict) or meta.get("block_bytes") != self.store.block_bytes:
                return None
            buckets = meta["buckets"]
            if (not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 1
                    or buckets & (buckets - 1) or not isinstance(meta["ctl"], str)):
                raise ValueError(f"bad geometry: buckets={buckets!r}")
            # (compared with placements' "from" in sets: _unvouched; fz28)
            if not isinstance(meta.get("address", ""), str):
                raise ValueError(f"bad address: {meta['address']!r:.100}")
            # (a member that does not say pulls as many as we would)
            sends = meta.get("pulls_per_peer", self.max_pulls_per_peer)
            if not isinstance(sends, int) or isinstance(sends, bool) or sends < 1:
                raise ValueError(f"bad pulls_per_peer: {sends!r}")
            member = _Member(peer.name, peer, meta, min(sends, 1024))
            if member.index.nbytes < buckets * WAYS * IENTRY:
                raise ValueError(f"index region of {member.index.nbytes} bytes for "
                                 f"{buckets} buckets")
        # (JSON/UTF-8 errors are ValueErrors; JSON nested past the recursion
        # limit is a RecursionError)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            _log.warning("kv.peer_meta_unreadable", tier=self.name, member=peer.name,
                         error=repr(exc))
            return None
        return member

    def member_names(self) -> list[str]:
        return [self.store.agent.name, *self.members]

    # ------------------------------------------------------------ reads

    def _locate(self, key: bytes) -> tuple[str, int, int, int] | None:
        loc = self.located.get(key)
        if loc is not None and loc[0] not in self.members:
            return None
        return loc

    async def _probe(self, keys: list[bytes]) -> int:
        """Reads the owners' index buckets for the keys (one-sided, one batch
        per member, the members at once) and remembers where each block is."""
        if not self.members:
            return 0
        names = self.member_names()
        me = self.store.agent.name
        want: dict[str, list[bytes]] = {}
        for k in keys[:256]:
            if k in self.located:
                continue
            # Where a writer put it: its top ``replicas`` owners, or the next
            # one for the writer that was itself an owner (see _write).
            for o in owners(k, names, self.replicas + 1):
                if o != me and o in self.members:
                    want.setdefault(o, []).append(k)
        reads = [self._probe_member(name, ks[:_PROBE_KEYS]) for name, ks in want.items()]
        if len(reads) == 1:
            await reads[0]
        elif reads:
            # (a cancel reaches each, and is raised once each read has ended)
            await asyncio.gather(*reads)
        n = 0
        for k in keys:
            if self._locate(k) is None:
                break
            n += 1
        return n

    async def _probe_member(self, name: str, ks: list[bytes]) -> None:
        """One member's buckets of ``ks``, read into stage buckets of this
        read's own (see _PROBE_BUCKETS)."""
        m = self.members.get(name)
        if m is None:
            return
        stage = self.stage
        assert stage is not None
        bsz = WAYS * IENTRY
        offs = np.array([_bucket(k, m.buckets) * bsz for k in ks], dtype=np.uint64)
        lens = np.full(len(ks), bsz, dtype=np.uint64)
        share = await m.probing.take(len(ks))  # (first: waiting here holds no bucket)
        try:
            parts = await self.probe_slots.take(len(ks))
            try:
                # Never cut short: a cancelled read could still land in
                # these buckets while the next probe reads them.
                try:
                    await run_to_end(self.store.agent.read(
                        SegmentList(stage, np.array(parts, dtype=np.uint64) * np.uint64(bsz),
                                    lens),
                        SegmentList(m.index, offs, lens)))
                except XferError:
                    return  # it left or failed: its blocks are misses
                raw = stage.numpy()
                hits = [parse_bucket(raw[p * bsz:(p + 1) * bsz], k)
                        for p, k in zip(parts, ks, strict=True)]
                del raw  # a view of the stage
            finally:
                self.probe_slots.give_back(parts)
        finally:
            m.probing.give_back(share)
        slots = m.pool.nbytes // self.store.block_bytes
        for k, hit in zip(ks, hits, strict=True):
            if hit is None:
                continue
            if hit[0] >= slots:
                # An intact entry for a slot its pool does not have (a
                # broken member): a miss, not a read that fails its batch.
                self.counters.checksum_failures += 1
                continue
            self.located[k] = (name, *hit)

    async def _read(self, locs: list[Any], regions: list[Region],
                    offsets: list[int]) -> list[XferError | None]:
        bb = self.store.block_bytes
        errs: list[XferError | None] = [None] * len(locs)
        by_member: dict[str, list[int]] = {}
        for i, loc in enumerate(locs):
            by_member.setdefault(loc[0], []).append(i)
        agent = self.store.agent
        for name, idx in by_member.items():
            m = self.members.get(name)
            miss = BlockMissing(f"peer {name!r} left")
            if m is None:
                for i in idx:
                    errs[i] = miss
                continue
            transfers = []
            for i in idx:
                slot = locs[i][1]
                transfers.append(agent.read(regions[i][offsets[i]:offsets[i] + bb],
                                            m.pool[slot * bb:(slot + 1) * bb]))
            self.counters.reads += len(transfers)
            # Into the caller's memory: a cancel waits for them to end (the
            # owner's answers, or the agent's stall/liveness bounds), so the
            # caller never reuses memory a late answer still writes.
            results = await landed(*transfers)
            for i, r in zip(idx, results, strict=True):
                key_loc = locs[i]
                if isinstance(r, asyncio.CancelledError):
                    raise r
                if isinstance(r, aioxfer.PeerLost):
                    errs[i] = BlockMissing(f"peer {name!r} was lost mid-read")
                    continue
                if isinstance(r, BaseException):
                    e = BlockUnavailable(f"peer {name!r}: {r}")
                    e.__cause__ = r
                    errs[i] = e
                    continue
                got = ck.checksum_with(key_loc[3], regions[i].memoryview[offsets[i]:offsets[i]
                                                                          + bb])
                if got != key_loc[2]:
                    # The owner evicted and reused the slot after we read its
                    # index: a miss (its index no longer has it), not corruption.
                    self.counters.checksum_failures += 1
                    errs[i] = BlockMissing(f"peer {name!r}: the block moved while read")
        # forget what was read: the next get probes afresh
        for loc_key in [k for k, v in self.located.items() if v in locs]:
            self.located.pop(loc_key, None)
        return errs

    # ------------------------------------------------------------ placement (write-back)

    async def _write(self, keys: list[bytes], regions: list[Region], offsets: list[int],
                     *, durable: bool = False) -> list[bool]:
        """Sends each block to its owner(s): the owner pulls it from store
        memory (the host tier's, or the placement staging a caller's blocks
        are copied into first: see the class doc)."""
        ok = [False] * len(keys)
        if len(self.member_names()) < 2:
            self.counters.dropped("no_peer", len(keys))
            return ok
        host = self.store._host
        own = host.region if host is not None else None
        mine = [i for i, r in enumerate(regions) if r is own]
        theirs = [i for i, r in enumerate(regions) if r is not own]
        if mine:
            sub = await self._place_all([keys[i] for i in mine], [regions[i] for i in mine],
                                        [offsets[i] for i in mine])
            for i, good in zip(mine, sub, strict=True):
                ok[i] = good
        step = self.place_staging_blocks
        parts = [theirs[b:b + step] for b in range(0, len(theirs), step)]
        if len(parts) == 1:
            rounds: list[Any] = [await self._place_round(parts[0], keys, regions, offsets)]
        elif parts:
            # A put's rounds queue for the staging in order, each placed as
            # soon as it has its slots (several in flight). A cancel reaches
            # them all and raises once each has ended (copies from src
            # included: _stage_in), never while one still reads src.
            rounds = await asyncio.gather(*(self._place_round(p, keys, regions, offsets)
                                            for p in parts), return_exceptions=True)
            for r in rounds:
                if isinstance(r, BaseException):
                    raise r
        else:
            rounds = []
        for r in rounds:
            for i, good in r:
                ok[i] = good
        return ok

    async def _place_round(self, part: list[int], keys: list[bytes], regions: list[Region],
                           offsets: list[int]) -> list[tuple[int, bool]]:
        """Blocks ``part`` of a caller's memory (at most place_staging_blocks):
        copied into staging slots of their own, placed from there; (block,
        stored) for those copied. Rounds of concurrent puts run together,
        each on its own slots (they took the whole area, one at a time: 8
        concurrent puts of 8 blocks were 8 placements one after another).
        The slots are held until the round's placements have ended
        (acknowledged, timed out, or failed): a later round's blocks then
        replace these under a late owner's pull, which fails its checksum
        and stores nothing."""
        slots = await self.place_slots.take(len(part))
        try:
            staged = await self._stage_in(part, slots, regions, offsets)
            if not staged:
                return []
            stage = self.place_stage
            assert stage is not None
            bb = self.store.block_bytes
            sub = await self._place_all([keys[part[k]] for k in staged], [stage] * len(staged),
                                        [slots[k] * bb for k in staged])
        finally:
            self.place_slots.give_back(slots)
        return [(part[k], good) for k, good in zip(staged, sub, strict=True)]

    async def _stage_in(self, part: list[int], slots: list[int], regions: list[Region],
                        offsets: list[int]) -> list[int]:
        """Copies blocks ``part`` of the caller's memory into the placement
        staging (block k of part at slot ``slots[k]``); the k copied. Never
        cut short: a cancelled put raises once the copies have ended (they
        read ``src``)."""
        from aioxfer.kv.store import _groups, _seglist

        store = self.store
        bb = store.block_bytes
        if self.place_stage is None:
            self.place_stage = store.agent.alloc(
                self.place_staging_blocks * bb, name=f"kvpeer.{self.group}.{store.name}.place")
        remote = await store._remote(self.place_stage)
        slot = {i: k for k, i in enumerate(part)}
        groups = _groups(regions, part)
        copies = [store.agent.write(_seglist(region, [offsets[i] for i in idx], bb),
                                    _seglist(remote, [slots[slot[i]] * bb for i in idx], bb))
                  for region, idx in groups]
        results = await run_to_end(asyncio.gather(*copies, return_exceptions=True))
        staged: list[int] = []
        for (_region, idx), r in zip(groups, results, strict=True):
            if isinstance(r, BaseException):
                self.counters.errors += 1
                self.counters.dropped("copy_failed", len(idx))
                continue
            staged.extend(slot[i] for i in idx)
        return sorted(staged)

    async def _place_all(self, keys: list[bytes], regions: list[Region],
                         offsets: list[int]) -> list[bool]:
        """The placements of blocks in store memory; per block whether it is
        stored on an owner."""
        ok = [False] * len(keys)
        names = self.member_names()
        me = self.store.agent.name
        bb = self.store.block_bytes
        # Per owner and source region (the owner reads one region by name
        # per message): blocks of a caller's put may come from several.
        plan: dict[tuple[str, int], list[int]] = {}
        for i, k in enumerate(keys):
            # The block leaves this store: its owners over all members, with
            # the next one in rendezvous order standing in for ourselves.
            targets = [o for o in owners(k, names, self.replicas + 1) if o != me]
            for o in targets[: self.replicas]:
                plan.setdefault((o, id(regions[i])), []).append(i)
        crcs = [ck.checksum(regions[i].memoryview[offsets[i]:offsets[i] + bb])
                for i in range(len(keys))]
        sends = []
        for (name, _r), idx in plan.items():
            for b in range(0, len(idx), _MAX_PER_MSG):
                sends.append(self._place(name, idx[b:b + _MAX_PER_MSG], keys, regions,
                                         offsets, crcs))
        results = await asyncio.gather(*sends, return_exceptions=True)
        why: dict[str, int] = {}
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
            if isinstance(r, BaseException):
                self.counters.errors += 1
                continue
            stored, reason, n = r
            for i in stored:
                ok[i] = True
            if n > len(stored):
                why[reason] = why.get(reason, 0) + n - len(stored)
        self.counters.puts += sum(ok)
        self.counters.put_bytes += sum(ok) * bb
        missing = ok.count(False)
        for reason, n in why.items():
            n = min(n, missing)  # (replicas > 1: a block another owner took is stored)
            if n:
                self.counters.dropped(reason, n)
                missing -= n
        if missing:
            self.counters.dropped("peer_refused", missing)
        return ok

    async def _place(self, name: str, idx: list[int], keys: list[bytes], regions: list[Region],
                     offsets: list[int], crcs: list[int]) -> tuple[list[int], str, int]:
        """One placement message to member ``name``: (the blocks it stored,
        why the others were not, how many were sent)."""
        if self.ctl is None:
            return [], "peer_left", len(idx)
        # ack_wait bounds the whole placement, its turn included (kv28: the
        # turn was waited for outside it, so a slow member that answers
        # each placement just within ack_wait held the last of n queued
        # ones n ack_waits, and the put or write-back with it).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ack_wait
        queued = False
        pause = _BUSY_PAUSE
        slowest = 0.0  # the slowest answer to a try (seconds)
        while True:
            # Each try goes to the member of that name as it is then (kv29:
            # a busy retry went to the member the first try found, even
            # after it left or was replaced by its next incarnation).
            m = self.members.get(name)
            if m is None:
                return [], "peer_left", len(idx)
            queued = queued or not m.sending.ready(1)
            # In turn with our other placements to it (see _Member.sending):
            # one past its max_pulls_per_peer would be refused there (its
            # blocks dropped) for no fault of either side.
            try:
                if queued:
                    async with asyncio.timeout_at(deadline):
                        sending = await m.sending.take(1)
                else:
                    sending = await m.sending.take(1)  # (served at once: no timer)
            except TimeoutError:
                # Not sent: its turn never came (the member answers, slowly,
                # or a placement before it is finding it silent).
                return [], "ack_timeout", len(idx)
            try:
                if self.members.get(name) is not m:  # it left or was replaced meanwhile
                    if name in self.members and loop.time() < deadline:
                        queued = True
                        continue  # (its successor, in its turn)
                    return [], "peer_left", len(idx)
                sent = loop.time()
                got = await self._place_to(m, name, idx, keys, regions, offsets, crcs,
                                           deadline, queued)
                # Refused for the member's pull limits, not for its blocks
                # (kv28: more writers than its max_pulls allows at once had
                # placements refused and their blocks dropped): sent again,
                # after a short random pause, while the deadline leaves room
                # for the pause and an answer as slow as the slowest so far
                # (kv29: the last retry, sent with less, mostly ended
                # "ack_timeout", its blocks maybe pulled after all). The
                # turn is kept over the pause; a member that leaves or is
                # replaced ends the pause (m.gone).
                wait = pause * (0.5 + random.random())
                now = loop.time()
                slowest = max(slowest, now - sent)
                if got[1] != "peer_busy" or now + wait + slowest >= deadline:
                    return got
                self.busy_retries += 1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await m.gone.wait()
                pause = min(2 * pause, _BUSY_PAUSE_MAX)
                queued = True  # (it has had part of its ack_wait)
            finally:
                m.sending.give_back(sending)

    async def _place_to(self, m: _Member, name: str, idx: list[int], keys: list[bytes],
                        regions: list[Region], offsets: list[int], crcs: list[int],
                        deadline: float, queued: bool) -> tuple[list[int], str, int]:
        """_place's message, sent and answered by ``deadline``; ``queued``:
        it waited for its turn, so it had less than ack_wait to itself."""
        assert self.ctl is not None
        loop = asyncio.get_running_loop()
        if m.silent_since is not None:
            if loop.time() - m.silent_since < self.ack_timeout:
                return [], "peer_stalled", len(idx)
            m.silent_since = loop.time()  # this one tries it again; the others still skip
        region = regions[idx[0]]
        # Random, so that no other member can guess the request numbers it
        # was not sent (its acks are matched on the sender too, see _serve).
        req = secrets.randbits(62)
        head = json.dumps({"op": "put", "req": req, "from": self.store.agent.address,
                           "ctl": self.ctl.address, "region": region.name}).encode()
        body = b"".join(keys[i] + offsets[i].to_bytes(8, "little") + crcs[i].to_bytes(4, "little")
                        + ck.ALGO.to_bytes(4, "little") for i in idx)
        fut: asyncio.Future[tuple[bytes, bool]] = loop.create_future()
        key: tuple[str, int] | None = None
        try:
            async with asyncio.timeout_at(deadline):
                if m.ctl is None or m.ctl.lost:
                    m.ctl = await self.ctl.connect(m.meta["ctl"])
                key = (m.ctl.name, req)
                self._acks[key] = fut
                m.waiting[req] = fut
                await m.ctl.notify(len(head).to_bytes(2, "little") + head + body)
                bitmap, busy = await fut
        except TimeoutError:
            # Silent (stopped, wedged, or its control agent unreachable): its
            # blocks are not stored as far as we know; nothing more is sent
            # to it until it answers (a late ack of this request) or leaves.
            _log.warning("kv.peer_ack_timeout", tier=self.name, member=name,
                         seconds=self.ack_wait, queued=queued)
            # Silent only when a placement that had the whole ack_wait to
            # itself went unanswered: one that waited for its turn behind
            # others had less (a member answering each in time is no
            # silent one, and skipping it would drop placements for
            # ack_timeout).
            if m.silent_since is None and not queued:
                m.silent_since = loop.time()
            if key is not None:
                m.went_late(req)
            return [], "ack_timeout", len(idx)
        except PeerLost:
            return [], "peer_lost", len(idx)
        except (XferError, OSError) as exc:  # its control agent cannot be reached
            _log.info("kv.peer_place_failed", tier=self.name, member=name, error=repr(exc))
            return [], "peer_unreachable", len(idx)
        finally:
            if key is not None:
                self._acks.pop(key, None)
            m.waiting.pop(req, None)
            # _follow or _add_member may have failed it (the member left or
            # was replaced) while the notification was still in flight and
            # then failed, or the timeout or a cancel ended this placement
            # first: retrieved here, else asyncio logs "Future exception was
            # never retrieved" (a loop exception-handler call).
            if fut.done() and not fut.cancelled():
                fut.exception()
            else:
                fut.cancel()
        m.silent_since = None
        m.late.clear()  # (it answers: what it left unanswered proves nothing more)
        if len(bitmap) != len(idx) or bitmap.strip(b"\x00\x01"):
            # Not an answer to what was sent (a broken or hostile member):
            # it claims nothing.
            _log.warning("kv.peer_bad_ack", tier=self.name, member=name, blocks=len(idx),
                         ack_bytes=len(bitmap))
            return [], "bad_ack", len(idx)
        # A refusal past the member's pull limits says so ("busy": all its
        # max_pulls taken, as by more writers than max_pulls /
        # max_pulls_per_peer at once): _place sends it again.
        why = "peer_busy" if busy and not bitmap.strip(b"\x00") else "peer_refused"
        return [i for i, b in zip(idx, bitmap, strict=True) if b], why, len(idx)

    async def _serve(self) -> None:
        assert self.ctl is not None
        async for msg in self.ctl.notifications:
            # Anything another process sends: what is not a well-formed
            # request is dropped (never ends this loop, which serves every
            # placement and acknowledgement to come).
            p = msg.payload
            try:
                n = int.from_bytes(p[:2], "little")
                head = json.loads(p[2:2 + n])
                body = p[2 + n:]
            except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError
                continue  # (RecursionError: JSON nested past the interpreter's limit)
            if not isinstance(head, dict) or type(head.get("req")) is not int:
                continue
            if head.get("op") == "ack":
                # Only the member the request went to answers it (another
                # member's ack of it would make us drop blocks as stored).
                fut = self._acks.get((msg.peer_name, head["req"]))
                if fut is not None and not fut.done():
                    fut.set_result((body, head.get("busy") is True))
                elif fut is None:
                    self._late_ack(msg.peer_name, head["req"])
            elif head.get("op") == "put" and all(
                    isinstance(head.get(f), str) for f in ("from", "ctl", "region")):
                sender = msg.peer_name
                why = self._unvouched(sender, head)
                if why is not None:
                    self._refuse_unvouched(sender, head, why, len(body) // 48)
                    continue
                if (sum(self._pulling.values()) >= self.max_pulls
                        or self._pulling.get(sender, 0) >= self.max_pulls_per_peer
                        or self._answering.get(sender, 0) >= self.max_pulls):
                    self._refuse(sender, head, len(body) // 48)
                    continue
                _count(self._pulling, sender, 1)
                self._spawn(self._pull_from(sender, head, body))

    def _unvouched(self, sender: str, head: dict[str, Any], *, ack: bool = False,
                   reached: str | None = None) -> str | None:
        """Why a placement from the agent ``sender`` names addresses we will
        not dial (None: we may). A placement makes us connect to its "from"
        (to pull) and its "ctl" (to acknowledge), else any holder of the
        token could make this agent dial any host and port. Asked twice:
        as it arrives, for "from", and again before its ack (``ack``), for
        "ctl" too (``reached``: the name of the agent the pull found at
        "from", None if it reached none). From a member we know (its control
        agent, or its store agent itself), both must be what it published
        (its meta, as read at its join: "address" and "ctl"); by the ack a
        sender that is a member has been joined by the pull (_pull), so its
        published "ctl" is checked then. With discovery, a sender we have
        not joined must be one of etcd's members, at the address etcd holds
        for it. Embedded, a sender we never connected to (it joined us) has
        no published address we know: its "from" is dialled as sent (within
        _dial_barred's bounds: an address not for ack_timeout after it
        reached no agent of the sender's), and the pull goes
        on only if the agent there is the sender's store agent (its name,
        proven by the token in the handshake: _pull), which is how a member
        that joined us introduces itself. The ack of a sender
        that is still no member goes only to the sender itself, found at
        "from" (a plain agent placing its own memory), nowhere else (rev28,
        kv28: it went to any "ctl" such a placement named, even after a
        failed pull or a refusal). A name that is no valid agent name
        (aioxfer.names: the handshake refuses those already) is no member's
        (kv28: names with control characters went raw into log lines)."""
        name = _member_name(sender)
        why = name_problem(sender)
        if why is not None:
            return why
        known = self.members.get(name)
        if known is not None and not known.peer.lost:
            if head["from"] not in {known.peer.address, known.meta.get("address")}:
                return "its address is not the member's"
            if head["ctl"] != known.meta["ctl"]:
                return "its control address is not the member's"
            return None
        if self.store.agent._cluster is not None:
            held = next((ev.address for ev in self.store.agent._membership.snapshot()
                         if ev.name == name), None)
            if held is None:
                return "not a member (discovery)"
            if held != head["from"]:
                return "its address is not the one discovery holds"
        if ack and (reached != sender or head["ctl"] != head["from"]):
            return "its control address is not the member's"
        if not ack and self.store.agent._cluster is None:
            return self._dial_barred(sender, head["from"])
        return None

    def _dial_barred(self, sender: str, address: str) -> str | None:
        """Why the "from" of ``sender`` (no member; embedded, so nothing
        vouches for it) is not dialled now (None: it may be). Each such
        placement made us open a connection and send a Hello wherever it
        named, at the sender's rate (kv29, benchmarks/kv29_reflect.py: one
        connection and 174 bytes to the address a placement of 142 bytes
        names, the sender pacing each on the last): a token holder could
        aim this agent at any host and port. An address that reached no
        agent is not dialled again for ack_timeout, whoever names it; one
        that reached another agent than the sender's, not for that sender.
        (rev36: kv29 barred the sender's name, every address of it, after
        one such dial and while one was under way; embedded, names need not
        be unique, so any token holder that claimed a writer's name and
        named a dead port had the owner refuse the writer's own placements,
        undialled, for ack_timeout, again and again. Names cost nothing, so
        a bar by name never bounded a token holder anyway; this one bounds
        what the dials can reach.)"""
        now = asyncio.get_running_loop().time()
        for key in (("", address), (sender, address)):
            when = self._misdialled.get(key)
            if when is None:
                continue
            if now - when < self.ack_timeout:
                return ("its address reached no agent (lately)" if not key[0]
                        else "its address reached another agent than its own (lately)")
            del self._misdialled[key]
        return None

    def _refuse_unvouched(self, sender: str, head: dict[str, Any], why: str, n: int) -> None:
        """A placement naming addresses that are not its member's: nothing is
        dialled, neither to pull nor to acknowledge (the sender's ack_wait
        ends it there)."""
        self.pulls_refused += 1
        self.counters.dropped("placement_unvouched", n)
        _log.warning("kv.peer_placement_refused", tier=self.name, sender=repr(sender), reason=why,
                     address=repr(head["from"][:200]), ctl=repr(head["ctl"][:200]))

    def _late_ack(self, ctl_name: str, req: int) -> None:
        """An ack after its placement's ack_wait: the member is alive again."""
        for m in self.members.values():
            if m.ctl is not None and m.ctl.name == ctl_name and req in m.late:
                m.late.clear()  # (it answers: the others' answers prove nothing more)
                m.silent_since = None
                _log.info("kv.peer_answers_again", tier=self.name, member=m.name)
                return

    def _refuse(self, sender: str, head: dict[str, Any], n: int) -> None:
        """A placement past the limits: nothing pulled; its sender is told so
        with "busy" in the ack: its blocks were not looked at, so the sender
        may send them again (an older sender reads it as any refusal: its
        blocks dropped). Refusals being told are bounded at max_pulls from
        each member, and at max_pulls from all senders that are no member
        together (theirs dial the sender first, and can hang there for a
        peer timeout); past that none is sent, and the sender's wait for the
        ack ends it. (kv29: one bound for all: two refusals to non-members
        hanging in their dials, or a burst of refusals from more writers
        than max_pulls, left a member's refusal unanswered: its writer
        waited out ack_wait and took this owner for silent, skipping it for
        ack_timeout.)"""
        self.pulls_refused += 1
        self.counters.dropped("pull_refused", n)
        known = self.members.get(_member_name(sender))
        who = sender if known is not None and not known.peer.lost else ""
        if self._acking.get(who, 0) < self.max_pulls:
            _count(self._acking, who, 1)
            self._spawn(self._ack(sender, head, bytes(n), refusal=who))

    async def _pull_from(self, sender: str, head: dict[str, Any], body: bytes) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pull_tasks[task] = sender
        try:
            await self._pull(head, body)
        finally:
            if self._pull_tasks.pop(task, None) is not None:  # (ended before its ack)
                _count(self._pulling, sender, -1)

    async def _ack(self, sender: str, head: dict[str, Any], stored: bytes, *,
                   refusal: str | None = None, reached: str | None = None) -> None:
        """Answers a placement at its "ctl", if that is an address we may
        dial (_unvouched, asked again now: ``reached`` is the agent the pull
        found at "from"); else nothing is sent (the sender's ack_wait ends
        it there). ``refusal``: a refusal's ack, its key in _acking (see
        _refuse)."""
        # A pull's ack: its reading is over, from now on it counts as answering.
        task = asyncio.current_task()
        pulled = None if refusal is not None or task is None else self._pull_tasks.pop(task, None)
        if pulled is not None:
            _count(self._pulling, pulled, -1)
            _count(self._answering, pulled, 1)
        try:
            with contextlib.suppress(XferError, OSError, LookupError, ValueError):
                if refusal is not None:
                    reached = await self._introduce(sender, head)
                if self.ctl is not None:
                    why = self._unvouched(sender, head, ack=True, reached=reached)
                    if why is not None:
                        _log.info("kv.peer_ack_withheld", tier=self.name, sender=repr(sender),
                                  reason=why, ctl=repr(head["ctl"][:200]))
                        return
                    back = await self.ctl.connect(head["ctl"])
                    answer: dict[str, Any] = {"op": "ack", "req": head["req"]}
                    if refusal is not None:
                        answer["busy"] = True  # (see _refuse)
                    ack = json.dumps(answer).encode()
                    await back.notify(len(ack).to_bytes(2, "little") + ack + stored)
        finally:
            if refusal is not None:
                _count(self._acking, refusal, -1)
            if pulled is not None:
                _count(self._answering, pulled, -1)

    async def _introduce(self, sender: str, head: dict[str, Any]) -> str | None:
        """Before a refusal's ack: a sender that is no member yet is joined
        as a pull would join it (its "from" dialled, the agent there
        checked to be the sender's, its meta read), so that the ack can go
        to the control address it published (else it would get none, and
        wait out its ack_wait: a writer whose first placement met the
        limits took the owner for silent). The agent found at "from", if
        it is the sender's (None: none or another)."""
        name = _member_name(sender)
        known = self.members.get(name)
        if known is not None and not known.peer.lost:
            return None  # (vouched by what it published)
        peer = await self._reach(sender, head)
        return peer.name if peer.name == name else None

    async def _reach(self, sender: str, head: dict[str, Any]) -> aioxfer.Peer:
        """The agent at a placement's "from", joined as a member only when it
        is the sender's store agent (its name proven by the token in the
        handshake); another agent there is returned unjoined."""
        name = _member_name(sender)
        known = self.members.get(name)
        if (known is not None and not known.peer.lost) or self.store.agent._cluster is not None:
            peer = await self.store.agent.connect(head["from"])  # (vouched: _unvouched)
        else:
            peer = await self._dial_unvouched(sender, head["from"])
        if peer.name == name:
            await self._add_member(peer)
        return peer

    async def _dial_unvouched(self, sender: str, address: str) -> aioxfer.Peer:
        """Connects to the "from" of a sender that is no member, within
        _dial_barred's bounds (asked again here: placements that arrived
        together passed it together); LookupError if barred."""
        why = self._dial_barred(sender, address)
        if why is not None:
            raise _Barred(why)
        try:
            peer = await self.store.agent.connect(address)
        except (XferError, OSError, ValueError):
            self._misdial("", address)
            raise
        if peer.name != _member_name(sender):
            self._misdial(sender, address)
        return peer

    def _misdial(self, sender: str, address: str) -> None:
        """Bars ``address`` (for ``sender``; "": for all) for ack_timeout
        (see _dial_barred). At most 1024 bars: the lapsed go first, then
        the oldest (token holders' names and addresses churn)."""
        now = asyncio.get_running_loop().time()
        key = (sender, address)
        bars = self._misdialled
        bars.pop(key, None)  # (renewed: now the newest; the dict stays oldest first)
        while bars:
            first = next(iter(bars))
            if len(bars) < 1024 and now - bars[first] < self.ack_timeout:
                break
            del bars[first]
        bars[key] = now

    async def _pull(self, head: dict[str, Any], body: bytes) -> None:
        """A member places blocks here: read them from its memory into our
        host tier, verify, publish, acknowledge. The agent found at "from"
        must be the sender's store agent (kv28: any agent there was read
        from, and joined as a member: a token holder could make us copy a
        third agent's memory, and have the ack sent wherever it named)."""
        task = asyncio.current_task()
        assert task is not None
        sender = self._pull_tasks[task]  # (set by _pull_from, which runs this)
        store = self.store
        host: HostTier | None = store._host
        bb = store.block_bytes
        entries = [(body[j:j + 32], int.from_bytes(body[j + 32:j + 40], "little"),
                    int.from_bytes(body[j + 40:j + 44], "little"),
                    int.from_bytes(body[j + 44:j + 48], "little"))
                   for j in range(0, len(body) - 47, 48)]
        stored = bytearray(len(entries))
        reached: str | None = None
        refused = False
        try:
            try:
                peer = await self._reach(sender, head)
            except _Barred as exc:
                refused = True
                self._refuse_unvouched(sender, head, str(exc), len(entries))
                return
            if peer.name != _member_name(sender):
                # Nothing read, nothing sent back: not even a member's ack
                # (its "from" names another agent: broken or forged).
                refused = True
                self._refuse_unvouched(
                    sender, head, f"the agent at its address is {peer.name!r}", len(entries))
                return
            reached = peer.name
            try:
                src = peer.region(head["region"])
            except KeyError:
                await peer.refresh()
                src = peer.region(head["region"])
            assert host is not None and host.region is not None
            # (an offset past the sender's region: broken or hostile, skipped)
            fresh = [j for j, e in enumerate(entries)
                     if e[0] not in host.index and e[1] + bb <= src.nbytes]
            for j, e in enumerate(entries):
                if e[0] in host.index:
                    stored[j] = 1
            # Free slots take the blocks straight (nothing is lost if they
            # fail their checks); past them, the blocks pass through the
            # tier's staging and room is made (clean cold blocks evicted)
            # only for those that verified: a refused or broken placement
            # never pushes good blocks out.
            slots = host.take_free(len(fresh))
            direct, rest = fresh[:len(slots)], fresh[len(slots):]
            if direct:
                await self._pull_direct(host, src, entries, direct, slots, stored)
            for b in range(0, len(rest), self.pull_staging_blocks):
                async with self._pull_share(sender):
                    await self._pull_staged(host, src, entries,
                                            rest[b:b + self.pull_staging_blocks], stored)
        except (XferError, OSError, LookupError, ValueError) as exc:  # (a bad address)
            _log.info("kv.peer_pull_failed", tier=self.name, error=repr(exc))
        finally:
            if not refused:
                await self._ack(sender, head, bytes(stored), reached=reached)

    async def _pull_direct(self, host: HostTier, src: RemoteRegion,
                           entries: list[tuple[bytes, int, int, int]], fresh: list[int],
                           slots: list[int], stored: bytearray) -> None:
        """Reads blocks into free host slots, verifies, publishes."""
        bb = self.store.block_bytes
        assert host.region is not None
        try:
            t = self.store.agent.read(
                SegmentList(host.region, np.array(slots, dtype=np.uint64) * np.uint64(bb),
                            np.full(len(slots), bb, dtype=np.uint64)),
                SegmentList(src, np.array([entries[j][1] for j in fresh], dtype=np.uint64),
                            np.full(len(fresh), bb, dtype=np.uint64)))
        except BaseException:
            host.give_back(slots)  # no read was posted
            raise
        try:
            await asyncio.shield(t)  # our memory: never cancelled midway
        except BaseException:
            t.add_done_callback(lambda _t: host.give_back(slots))
            raise
        for j, s in zip(fresh, slots, strict=True):
            key, _off, crc, algo = entries[j]
            got = ck.checksum_with(algo, host.region.memoryview[s * bb:(s + 1) * bb])
            if got == crc and key not in host.index:
                host.insert(key, s, dirty=False)
                stored[j] = 1
                self.pulled += 1
            else:
                host.give_back([s])

    @contextlib.asynccontextmanager
    async def _pull_share(self, sender: str) -> AsyncIterator[None]:
        """Held around a staged pull of ``sender``'s: at most _PULL_SHARE of
        its staged reads take parts at once (the others wait here, holding
        none), so a sender that stops leaves the other parts to the others."""
        share = self._pull_shares.get(sender)
        if share is None:
            share = self._pull_shares[sender] = (_Slots(_PULL_SHARE), [0])
        share[1][0] += 1
        try:
            mine = await share[0].take(1)
            try:
                yield
            finally:
                share[0].give_back(mine)
        finally:
            share[1][0] -= 1
            if not share[1][0] and self._pull_shares.get(sender) is share:
                del self._pull_shares[sender]

    async def _pull_staged(self, host: HostTier, src: RemoteRegion,
                           entries: list[tuple[bytes, int, int, int]], fresh: list[int],
                           stored: bytearray) -> None:
        """Reads blocks (at most pull_staging_blocks) into a part of the pull
        staging of this read's own, verifies them there, and only then makes
        room for the good ones and copies them in."""
        store = self.store
        bb = store.block_bytes
        stage = self.pull_stage
        assert stage is not None and host.remote is not None
        n = len(fresh)
        lens = np.full(n, bb, dtype=np.uint64)
        (part,) = await self.pull_parts.take(1)
        try:
            base = part * self.pull_staging_blocks  # (in blocks)
            offs = (np.arange(n, dtype=np.uint64) + np.uint64(base)) * np.uint64(bb)
            # Never cut short: the next pull refills the part.
            await run_to_end(store.agent.read(
                SegmentList(stage, offs, lens),
                SegmentList(src, np.array([entries[j][1] for j in fresh], dtype=np.uint64),
                            lens)))
            verified = []
            for k, j in enumerate(fresh):
                key, _off, crc, algo = entries[j]
                if key not in host.index and ck.checksum_with(
                        algo, stage.memoryview[(base + k) * bb:(base + k + 1) * bb]) == crc:
                    verified.append(k)
            if not verified:
                return
            async with self.room_lock:
                good = [k for k in verified if entries[fresh[k]][0] not in host.index]
                slots = host._take(len(good))  # accepted: now room is made
                good = good[:len(slots)]
                if not good:
                    return
                t = store.agent.write(
                    SegmentList(stage, (np.array(good, dtype=np.uint64) + np.uint64(base))
                                * np.uint64(bb), np.full(len(good), bb, dtype=np.uint64)),
                    SegmentList(host.remote, np.array(slots, dtype=np.uint64) * np.uint64(bb),
                                np.full(len(good), bb, dtype=np.uint64)))
                try:
                    await run_to_end(t)
                except BaseException:
                    host.give_back(slots)
                    raise
                for k, s in zip(good, slots, strict=True):
                    key = entries[fresh[k]][0]
                    if key not in host.index:
                        host.insert(key, s, dirty=False)
                        stored[fresh[k]] = 1
                        self.pulled += 1
                    else:
                        host.give_back([s])
        finally:
            self.pull_parts.give_back([part])

    async def _remove(self, keys: list[bytes]) -> int:
        """Store.remove: forgets where the keys were found. The copies in
        other members' host tiers are theirs (no write into another
        member's index from here): they age out there, by its eviction.
        Without it Tier._remove raised NotImplementedError out of
        Store.remove, after the host tier had dropped the keys and before
        the tiers below this one were asked."""
        for k in keys:
            self.located.pop(k, None)
        return 0

    def _usage(self) -> tuple[int, int, int]:
        return len(self.members), 0, 0

    def _extra(self) -> dict[str, int | float | str]:
        return {"members": len(self.members), "pulled": self.pulled,
                "pulls_in_flight": sum(self._pulling.values()),
                "pulls_answering": sum(self._answering.values()),
                "pulls_refused": self.pulls_refused, "busy_retries": self.busy_retries}

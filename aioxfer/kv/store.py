"""Store: one key space over tiers (host memory, disk, peers, object storage).

Data never passes through Python ``bytes``: every move is one of the agent's
one-sided transfers between registered memories (the caller's, the host
tier's pool, a file region), posted in batches (one SegmentList per region).

Concurrent gets of one block that is not in host memory fetch it once: the
first getter's fetch lands in its own memory ("leader"); later getters
("followers") attach to the in-flight fetch and get a copy from there once it
is verified. A cancelled follower detaches and leaves the others running. A
leader cancelled while followers wait hands the fetch over: it is re-issued
into store-owned staging memory, from which the followers get their copies;
the last waiter to cancel cancels the fetch.

Pins: every block an operation reads from or writes into store memory (host
slots, disk segments) is pinned by that operation and released when it ends
(completed, failed or cancelled). A transfer that writes store memory is
never cancelled midway: a cancelled operation returns at once and its pins
are released when that transfer completes, so a slot can never be reused
while the engine still writes into it. A put's copies read the caller's
``src``: a cancelled put cancels them and raises only once the engine has
let go of them (kv.tier.settle_on_cancel), so src is never read once put
has returned or raised. ``max_pinned_bytes`` caps what all
operations pin together; over it an operation waits up to ``pin_wait``
seconds (asleep on an event, never spinning) and then raises
PinLimitExceeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Generator, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from aioxfer._uncancelled import finish_uncancelled, run_to_end
from aioxfer.agent import Agent
from aioxfer.discovery import retrieve_exception
from aioxfer.errors import ClosedResourceError, XferError
from aioxfer.kv.errors import BlockMissing, BlockUnavailable, PinLimitExceeded, RemoveIncomplete
from aioxfer.kv.host import HostTier
from aioxfer.kv.keys import KEY_BYTES
from aioxfer.kv.stats import StoreStatistics
from aioxfer.kv.tier import Tier, landed, settle_on_cancel
from aioxfer.log import get_logger
from aioxfer.peer import Peer
from aioxfer.region import Region, RemoteRegion, Segment, SegmentList
from aioxfer.transfer import Transfer

__all__ = ["BlockFailure", "GetResult", "LayerResult", "LayerStream", "LookupResult",
           "PutResult", "Store"]

_log = get_logger("aioxfer.kv")


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class PutResult:
    """``stored``: blocks newly stored; ``present``: already in the store (not
    written again); ``dropped``: not stored within the put's bound (no room,
    not admitted, I/O error: each counted in the tiers' ``dropped_stores``);
    ``durable``: blocks acknowledged on a durable tier (``put(durable=True)``);
    ``tiers``: per key, the tier that holds it now (None: dropped)."""

    stored: int
    present: int
    dropped: int
    durable: int
    tiers: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``prefix``: how many leading keys the store holds; ``tiers``: per key,
    the fastest tier holding it (None: a miss)."""

    prefix: int
    tiers: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class BlockFailure:
    """A block a tier holds but could not deliver: ``error`` is a
    BlockCorrupt (quarantined), BlockUnavailable or PinLimitExceeded."""

    index: int
    key: bytes
    tier: str
    error: XferError


@dataclass(frozen=True, slots=True)
class GetResult:
    """``prefix``: leading keys delivered into ``dst`` and verified (use
    nothing past it); ``tiers``: per key, the tier it came from (None: not
    delivered); ``failed``: blocks found but not delivered, typed;
    ``coalesced``: blocks this get received from another get's fetch."""

    prefix: int
    tiers: tuple[str | None, ...]
    failed: tuple[BlockFailure, ...]
    nbytes: int
    coalesced: int


@dataclass(frozen=True, slots=True)
class LayerResult:
    """One layer of the stream's leading ``prefix`` blocks has landed."""

    layer: int
    prefix: int
    nbytes: int


# ---------------------------------------------------------------- blocks


class _Blocks:
    """A caller's memory for n blocks: per block (region, offset)."""

    __slots__ = ("regions", "offsets")

    def __init__(self, regions: list[Region], offsets: list[int]) -> None:
        self.regions = regions
        self.offsets = offsets

    @staticmethod
    def run(arg: Any, n: int, block_bytes: int,
            what: str) -> tuple[Region, npt.NDArray[np.uint64]] | None:
        """A SegmentList or one Segment (checked) as its region and the
        blocks' offsets there, without a Python pass over the blocks; None
        for anything else."""
        if isinstance(arg, SegmentList):
            region = arg.region
            if not isinstance(region, Region):
                raise TypeError(f"{what} must be local registered memory, not a peer's")
            if len(arg) != n:
                raise ValueError(f"{n} keys but {len(arg)} {what} segments")
            if n and not bool((arg.lengths == block_bytes).all()):
                raise ValueError(f"every {what} segment must be block_bytes ({block_bytes}) long")
            return region, arg.offsets
        if isinstance(arg, Segment):
            # One contiguous run of n blocks.
            if arg.length != n * block_bytes:
                raise ValueError(f"a single {what} Segment must hold the {n} blocks "
                                 f"({n * block_bytes} bytes), not {arg.length}")
            return arg.region, np.arange(arg.offset, arg.offset + n * block_bytes, block_bytes,
                                         dtype=np.uint64)
        return None

    @classmethod
    def of(cls, arg: Any, n: int, block_bytes: int, what: str) -> _Blocks:
        run = cls.run(arg, n, block_bytes, what)
        if run is not None:
            return cls([run[0]] * n, run[1].tolist())
        if isinstance(arg, Sequence) and not isinstance(arg, str | bytes | bytearray):
            if len(arg) != n:
                raise ValueError(f"{n} keys but {len(arg)} {what} segments")
            regions: list[Region] = []
            offsets: list[int] = []
            for i, seg in enumerate(arg):
                if type(seg) is not Segment:
                    raise TypeError(f"{what} {i} is a {type(seg).__name__}, not a Segment")
                if seg.length != block_bytes:
                    raise ValueError(f"{what} {i} is {seg.length} bytes, not block_bytes "
                                     f"({block_bytes})")
                regions.append(seg.region)
                offsets.append(seg.offset)
            return cls(regions, offsets)
        raise TypeError(f"{what} is a SegmentList, a Segment or a list of Segments, "
                        f"not {type(arg).__name__}")

    def check(self, agent: Agent, what: str) -> None:
        # Each distinct region once (regions hash by identity; fromkeys is a
        # C-level pass: a get of 256 blocks in one region checks one).
        for r in dict.fromkeys(self.regions):
            if r.agent is not agent:
                raise ValueError(f"{what} is in a region of agent {r.agent.name!r}, not the "
                                 f"store's ({agent.name!r})")
            if r.kind != "host":
                raise TypeError(f"{what} must be host memory, not {r.kind}")
            if r.closed:
                raise ClosedResourceError(f"{what} region {r.name!r} is closed")


def _groups(regions: list[Region], idx: list[int]) -> list[tuple[Region, list[int]]]:
    """``idx`` grouped by region (first-seen order): one transfer per group."""
    if not idx:
        return []
    first = regions[idx[0]]
    if regions.count(first) == len(regions) or all(regions[i] is first for i in idx):
        return [(first, idx)]
    out: dict[int, tuple[Region, list[int]]] = {}
    for i in idx:
        r = regions[i]
        g = out.get(id(r))
        if g is None:
            out[id(r)] = (r, [i])
        else:
            g[1].append(i)
    return list(out.values())


def _seglist(region: Region | RemoteRegion, offsets: list[int], block_bytes: int) -> SegmentList:
    offs = np.array(offsets, dtype=np.uint64)
    return SegmentList(region, offs, np.full(len(offsets), block_bytes, dtype=np.uint64))


_FLIP = bytes.maketrans(b"\0\1", b"\1\0")
_RUNS = 16  # above this many runs of one tier, names are picked per key


def _find(keys: list[bytes], probes: list[Any],
          names: tuple[str | None, ...]) -> tuple[int, tuple[str | None, ...]]:
    """Per key, the first tier whose probe holds it (``names[i]``; the last
    name, None, for a miss), and the leading run of hits.

    No Python code runs per key (a lookup of 1 024 keys is measured in
    microseconds, ~25 us of it one probe of each key): each tier is probed by
    one C-level ``map`` into a bytearray of 0/1, and only for the keys the
    faster tiers do not hold. While each tier holds one leading run of what
    is left (the usual shape: host memory keeps the hot prefix of a chain,
    the next tier the rest), the answer is that run's name repeated;
    otherwise ``_place`` sorts the keys out with numpy."""
    n = len(keys)
    out: tuple[str | None, ...] = ()
    at = 0  # keys[:at] are placed, in runs
    for ti, probe in enumerate(probes):
        rest = keys[at:] if at else keys
        hit = bytearray(map(probe, rest))
        j = hit.find(0)
        if j < 0:
            return n, out + (names[ti],) * len(rest)
        if hit.find(1, j) >= 0:  # not one leading run
            prefix, placed = _place(rest, hit, probes[ti:], names[ti:])
            return at + prefix, out + placed
        out += (names[ti],) * j
        at += j
    return at, out + (None,) * (n - at)


def _place(keys: list[bytes], hit: bytearray, probes: list[Any],
           names: tuple[str | None, ...]) -> tuple[int, tuple[str | None, ...]]:
    """``_find`` for any shape, ``hit``: the first tier's probe of ``keys``.
    The lower tiers see only the keys the faster ones missed
    (``itertools.compress`` with the flipped hits); numpy places the
    answers, and the names are built per run of one tier (a tuple
    repeated), or per key past ``_RUNS`` runs."""
    n = len(keys)
    nt = len(probes)
    codes = np.full(n, nt, dtype=np.uint8)
    h = np.frombuffer(hit, dtype=np.bool_)
    codes[h] = 0
    miss = np.flatnonzero(~h)
    sel = hit.translate(_FLIP)
    for ti in range(1, nt):
        h = np.frombuffer(bytearray(map(probes[ti], compress(keys, sel))), dtype=np.bool_)
        codes[miss[h]] = ti
        miss = miss[~h]
        if not miss.size:
            break
        sel = (codes == nt).tobytes()
    prefix = int(miss[0]) if miss.size else n
    edges = np.flatnonzero(codes[1:] != codes[:-1])
    cb = codes.tobytes()
    if len(edges) >= _RUNS:
        got: tuple[str | None, ...] = itemgetter(*cb)(names)
        return prefix, got
    out: tuple[str | None, ...] = ()
    at = 0
    for e in edges.tolist():
        out += (names[cb[at]],) * (e + 1 - at)
        at = e + 1
    return prefix, out + (names[cb[at]],) * (n - at)


# ---------------------------------------------------------------- pins


class _Op:
    """The owner of an operation's pins."""

    __slots__ = ("store", "pins", "host", "host_slots", "nbytes", "pending", "done", "after")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.pins: list[tuple[Tier, Any]] = []
        self.host: HostTier | None = None  # the host tier's slots, pinned in bulk
        self.host_slots: list[int] = []
        self.nbytes = 0
        self.pending = 0  # store-owned transfers still running after a cancel
        self.done = False
        self.after: list[Any] = []  # run once, when the pins go (memory free to reuse)

    def pin(self, tier: Tier, loc: Any) -> None:
        tier_pin = getattr(tier, "pin", None)
        if tier_pin is not None:
            tier_pin(loc)
        self.pins.append((tier, loc))
        bb = self.store.block_bytes
        self.nbytes += bb
        self.store._pinned_bytes += bb
        self.store._pins += 1

    def pin_host(self, host: HostTier, slots: list[int]) -> None:
        """Pins host slots (the hit path's bulk form of ``pin``)."""
        pins = host.pins
        newly = 0
        for s in slots:
            p = pins[s]
            if not p:
                newly += 1
            pins[s] = p + 1
        host.pinned += newly
        self.host = host
        self.host_slots.extend(slots)
        nb = len(slots) * self.store.block_bytes
        self.nbytes += nb
        self.store._pinned_bytes += nb
        self.store._pins += len(slots)

    def unpin_all(self) -> None:
        pins, self.pins = self.pins, []
        for tier, loc in pins:
            tier_unpin = getattr(tier, "unpin", None)
            if tier_unpin is not None:
                tier_unpin(loc)
        count = len(pins)
        if self.host_slots:
            host, slots = self.host, self.host_slots
            self.host_slots = []
            assert host is not None
            hp = host.pins
            for s in slots:
                if hp[s] == 1 and s in host.doomed:
                    host.unpin(s)
                else:
                    hp[s] -= 1
                    if not hp[s]:
                        host.pinned -= 1
            count += len(slots)
        store = self.store
        store._pinned_bytes -= self.nbytes
        store._pins -= count
        self.nbytes = 0
        if store._pin_space is not None and count:
            store._pin_space.set()
        if self.done and self.after:
            after, self.after = self.after, []
            for fn in after:
                fn()

    def finish(self) -> None:
        """The operation is over: pins go now, or when its last store-owned
        transfer completes."""
        self.done = True
        if not self.pending:
            self.unpin_all()

    def hold_until(self, transfers: Sequence[asyncio.Future[Any]]) -> None:
        """Keeps the pins until ``transfers`` (writing store memory) are done."""
        for t in transfers:
            if not t.done():
                self.pending += 1
                t.add_done_callback(self._transfer_done)

    def _transfer_done(self, t: asyncio.Future[Any]) -> None:
        if not t.cancelled():
            t.exception()  # retrieved: its operation has already returned
        self.pending -= 1
        if self.done and not self.pending:
            self.unpin_all()


async def _await_owned(transfers: list[Transfer], op: _Op,
                       release: Any = None) -> list[BaseException | None]:
    """Awaits transfers that write store memory without ever cancelling them:
    a cancelled caller returns at once and ``op`` keeps its pins (and
    ``release`` runs) only once they are all done."""
    if not transfers:
        return []
    gathered = asyncio.gather(*transfers, return_exceptions=True)
    try:
        results = await asyncio.shield(gathered)
    except asyncio.CancelledError:
        op.hold_until([gathered])
        if release is not None:
            gathered.add_done_callback(lambda _f: release())
        raise
    return [r if isinstance(r, BaseException) else None for r in results]


# ---------------------------------------------------------------- fetches


class _Waiter:
    __slots__ = ("region", "offset", "future", "copy")

    def __init__(self, region: Region, offset: int, future: asyncio.Future[None]) -> None:
        self.region = region
        self.offset = offset
        self.future = future
        # The copy a delivery posted into this waiter's memory: a cancelled
        # follower waits for it to end before its get raises.
        self.copy: Transfer | None = None


class _Fetch:
    """One block in flight from a lower tier; others wait on it."""

    __slots__ = ("key", "tier", "loc", "region", "offset", "followers", "error", "task",
                 "reading", "delivering", "removed")

    def __init__(self, key: bytes, tier: Tier, loc: Any, region: Region, offset: int) -> None:
        self.key = key
        self.tier = tier
        self.loc = loc
        self.region = region  # where it lands (the leader's memory, or staging)
        self.offset = offset
        self.followers: list[_Waiter] = []
        self.error: XferError | None = None
        self.task: asyncio.Task[None] | None = None  # a handed-over refetch
        self.reading = False  # its read was started (by the leader or a refetch)
        # Its bytes are being copied out (promotion, followers): from here on
        # it is never cancelled; its copies finish and every waiter hears.
        self.delivering = False
        # Removed from the store while in flight: still delivered to whoever
        # asked, never promoted (it would come back after remove() returned).
        self.removed = False


class _Staging:
    """Store-owned registered slots for re-issued fetches."""

    def __init__(self, region: Region, remote: RemoteRegion, n: int) -> None:
        self.region = region
        self.remote = remote
        self.free = list(range(n - 1, -1, -1))
        self.space = asyncio.Event()

    async def take(self, k: int, wait: float) -> list[int]:
        got: list[int] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            while self.free and len(got) < k:
                got.append(self.free.pop())
            left = deadline - loop.time()
            if len(got) >= k or left <= 0:
                return got
            self.space.clear()
            try:
                async with asyncio.timeout(left):
                    await self.space.wait()
            except TimeoutError:
                pass
            except BaseException:
                self.give_back(got)  # cancelled while waiting: what it held goes back
                raise

    def give_back(self, slots: list[int]) -> None:
        self.free.extend(slots)
        self.space.set()


# ---------------------------------------------------------------- the store


class _Running:
    """One operation of a store in its caller's task (Store._running): counted
    (aclose waits for the count to reach 0), its task known (a cancelled
    aclose cancels it: Store._cut_operations). A cancel of the store's is
    the caller's ClosedResourceError; the task's cancel count is restored
    (Task.uncancel, as asyncio.timeout does), so the caller's own timeouts
    and cancels still count right. A cancel of the caller's own arriving as
    well stays a CancelledError."""

    __slots__ = ("store", "task")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.task: asyncio.Task[Any] | None = None

    def __enter__(self) -> None:
        store = self.store
        store._check_open()
        # (None: a coroutine driven by hand, outside any task: counted, and
        # waited for, but it cannot be cancelled by a cancelled aclose)
        task = self.task = asyncio.current_task()
        store._op_tasks[task] = store._op_tasks.get(task, 0) + 1

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        store = self.store
        task = self.task
        left = store._op_tasks[task] - 1
        if left:
            store._op_tasks[task] = left
            return
        del store._op_tasks[task]
        if not store._op_tasks and store._ops_idle is not None:
            store._ops_idle.set()
        if task is None or task not in store._cut:
            return
        store._cut.discard(task)
        if task.uncancel() == 0 and typ is asyncio.CancelledError:
            raise ClosedResourceError(
                f"store {store.name!r} closed under this operation (a cancelled aclose "
                f"cancels the operations in flight)") from exc


class _Opening:
    """``await Store.open(...)`` or ``async with Store.open(...) as store``."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __await__(self) -> Generator[Any, None, Store]:
        return self._store._start().__await__()

    async def __aenter__(self) -> Store:
        return await self._store._start()

    async def __aexit__(self, *exc: object) -> None:
        await self._store.aclose()


class Store:
    """A tiered KV block store on one agent. Make it with ``Store.open``."""

    def __init__(self, agent: Agent, *, block_bytes: int, tiers: Sequence[Tier], name: str,
                 max_pinned_bytes: int | None, pin_wait: float, staging_blocks: int) -> None:
        if not isinstance(agent, Agent):
            raise TypeError(f"agent must be an aioxfer.Agent, not {type(agent).__name__}")
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        hosts = [t for t in tiers if isinstance(t, HostTier)]
        if len(hosts) > 1 or (hosts and tiers[0] is not hosts[0]):
            raise ValueError("at most one HostTier, and it comes first (fastest first)")
        if pin_wait < 0:
            raise ValueError("pin_wait must be >= 0 (seconds)")
        self.agent = agent
        self.block_bytes = int(block_bytes)
        self.name = name
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self._names: tuple[str | None, ...] = (*names, None)  # by tier position; None: a miss
        self._host: HostTier | None = hosts[0] if hosts else None
        self._lower: tuple[Tier, ...] = tuple(t for t in tiers if not isinstance(t, HostTier))
        self._probing = tuple(t for t in self._lower if getattr(t, "probes", False))
        if max_pinned_bytes is None:
            # Room for everything the host tier holds plus a full staging area.
            host_bytes = self._host.capacity if self._host is not None else 0
            max_pinned_bytes = max(host_bytes, 256 * self.block_bytes)
        if max_pinned_bytes < self.block_bytes:
            raise ValueError("max_pinned_bytes must hold at least one block")
        self.max_pinned_bytes = int(max_pinned_bytes)
        self.pin_wait = float(pin_wait)
        self._staging_blocks = int(staging_blocks)
        self._pinned_bytes = 0
        self._pins = 0
        self._pin_space: asyncio.Event | None = None
        self._fetches: dict[bytes, _Fetch] = {}
        self._filling: set[bytes] = set()
        self._removing: dict[bytes, int] = {}  # keys a remove() is taking out of the tiers
        self._coalesced = 0
        self._handoffs = 0
        self._quarantined = 0
        self._pin_waits = 0
        self._me: Peer | None = None
        self._remotes: weakref.WeakKeyDictionary[Region, RemoteRegion] = (
            weakref.WeakKeyDictionary())
        self._staging: _Staging | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._opened = False
        # Set as aclose begins: new operations are refused from then on.
        self._refusing = False
        self._closing = False
        self._closed = False
        # Operations in flight (put, get, lookup, prefetch, remove): the
        # tasks they run in, how many each (None: outside any task), and the
        # event set when the last ends: aclose waits for them (see there).
        # (A separate count of them, kept beside, could only disagree.)
        self._op_tasks: dict[asyncio.Task[Any] | None, int] = {}
        self._ops_idle: asyncio.Event | None = None
        # The tasks a cancelled aclose cancelled (see _cut_operations).
        self._cut: set[asyncio.Task[Any]] = set()
        # The close (one task, shared by every aclose call; see aclose), its
        # flush while it runs, and whether a cancelled aclose asked it to
        # skip the rest of the flush.
        self._closer: asyncio.Task[None] | None = None
        self._flushing: asyncio.Future[None] | None = None
        self._hurry = False
        # Streams not yet ended: the close ends them before host memory goes.
        self._streams: weakref.WeakSet[LayerStream] = weakref.WeakSet()

    @classmethod
    def open(
        cls,
        agent: Agent,
        *,
        block_bytes: int,
        tiers: Sequence[Tier],
        name: str = "kv",
        max_pinned_bytes: int | None = None,
        pin_wait: float = 1.0,
        staging_blocks: int = 32,
    ) -> _Opening:
        """Opens a store on ``agent`` with ``tiers`` (fastest first; a
        HostTier, if any, first). Disk tiers rebuild their index here.
        ``max_pinned_bytes``: cap on memory pinned by operations in flight
        (default: the host tier's capacity, at least 256 blocks);
        ``pin_wait``: how long an operation waits under that cap before
        PinLimitExceeded; ``staging_blocks``: store-owned blocks for fetches
        handed over by a cancelled getter."""
        return _Opening(cls(agent, block_bytes=block_bytes, tiers=tiers, name=name,
                            max_pinned_bytes=max_pinned_bytes, pin_wait=pin_wait,
                            staging_blocks=staging_blocks))

    async def _start(self) -> Store:
        if self._opened:
            return self
        self._opened = True
        self._pin_space = asyncio.Event()
        self._ops_idle = asyncio.Event()
        agent = self.agent
        await agent.start()
        try:
            # The agent's loopback peer: how the store copies between its own
            # pool and the caller's memory with the agent's transfers.
            self._me = await agent.connect(agent.address)
            region = agent.alloc(self._staging_blocks * self.block_bytes,
                                 name=f"{self.name}.staging")
            self._staging = _Staging(region, await self._remote(region), self._staging_blocks)
            for tier in self.tiers:
                await tier._open(self)
        except BaseException:
            # What the caller must see is why the open failed: a failure of
            # the cleanup (logged by aclose) does not replace it.
            with contextlib.suppress(Exception):
                await self.aclose()
            raise
        return self

    async def __aenter__(self) -> Store:
        return await self._start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, *, flush: bool = True) -> None:
        """Writes dirty host blocks back to the next tier (``flush``), stops
        background work, closes the tiers (disk headers written) and releases
        the store's memory. Idempotent. A tier whose close fails does not
        stop the others: every tier is closed and the memory released, then
        the first failure is raised (the store is closed all the same).

        Operations called from here on raise ClosedResourceError; those
        already running are waited for first (each is bounded by its own
        waits: pin_wait, put_wait, the tiers' room_wait and ack_wait, the
        agent's stall bounds). Closed under them, a tier was left with work
        behind it: a disk put's header flusher started after the disk tier
        had closed (it failed with ClosedResourceError, its headers lost),
        or a put's copy into memory already released. The host tier's
        write-back stops before the tiers below it close, for the same
        reason. Streams still open are ended (see LayerStream): the copies
        they posted are waited for, their pins released, and their next
        step raises ClosedResourceError.

        Cancelled, the close still ends before CancelledError is raised: the
        store is closed when the cancel reaches the caller (tasks stopped,
        tiers closed, memory released), never left refusing calls but open.
        The cancel cuts the flush short (dirty host blocks not yet written
        back are dropped, as with ``flush=False``, and logged as
        ``kv.close_flush_cut``) and cancels the operations in flight
        rather than waiting for them: each settles as a cancelled operation
        does (a put's copies from ``src`` stopped and waited for until the
        engine lets go; a get's reads into ``dst`` waited for) and raises
        ClosedResourceError to its caller (a cancel of its own meanwhile
        stays CancelledError). The rest is bounded as above (the tiers'
        releases by the agent's close_timeout). Concurrent calls share one
        close.
        A cancelled caller gets CancelledError even when the close then
        fails (the failure is its ``__cause__``, logged as
        ``kv.close_failed``); callers waiting for it uncancelled get the
        failure."""
        closer = self._closer
        if closer is None:
            if self._closed:
                return
            self._refusing = True
            closer = self._closer = asyncio.get_running_loop().create_task(
                self._close(flush), name=f"aioxfer-kv-close-{self.name}")
        elif closer.done():
            return  # (its failure, if any, went to the call that closed)
        cancelled = False
        while True:
            try:
                await asyncio.shield(closer)
                break
            except Exception as exc:
                if not cancelled:
                    raise
                # A caller cancelled meanwhile is told of its cancel (kv22:
                # it got the close's failure instead, and a caller that
                # handles its own cancel never learned that it happened);
                # the failure is its cause, logged here, and raised to the
                # callers still waiting uncancelled.
                _log.warning("kv.close_failed", store=self.name, error=repr(exc),
                             why="the caller of aclose was cancelled: CancelledError raised "
                                 "to it, this failure as its cause")
                raise asyncio.CancelledError from exc
            except asyncio.CancelledError:
                if closer.done():
                    raise  # the close itself was cancelled (its loop going away)
                # The close goes on to its end (kv22: cut short here, the
                # store refused every call but held its tasks, tiers and
                # memory until a second aclose): only the flush is dropped.
                cancelled = True
                self._hurry = True
                if self._flushing is not None:
                    self._flushing.cancel()
                self._cut_operations()
        if cancelled:
            raise asyncio.CancelledError

    async def _close(self, flush: bool) -> None:
        """aclose's work, in a task of its own (a cancelled aclose waits for
        it to end; see there)."""
        if self._op_tasks:
            assert self._ops_idle is not None
            self._ops_idle.clear()
            while self._op_tasks:
                await self._ops_idle.wait()
        host = self._host
        if flush and host is not None and self._opened and not self._closing and not self._hurry:
            lower = self._next_storing_tier(host)
            if lower is not None and host.dirty:
                self._flushing = asyncio.ensure_future(self._flush_host(host, lower))
                (res,) = await asyncio.gather(self._flushing, return_exceptions=True)
                self._flushing = None
                if isinstance(res, BaseException):
                    _log.warning("kv.close_flush_cut", store=self.name, lower=lower.name,
                                 dirty_blocks=len(host.dirty), error=repr(res))
        self._closing = True
        # Streams still open: their copies read host memory released below.
        for stream in list(self._streams):
            await stream._close(store_closed=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # Every tier is closed and all memory released even if one fails (a
        # tier left open keeps its files, tasks and registrations): the
        # first failure is raised once all of it is done.
        # A cancel landing in a tier's close does not stop the rest either
        # (the tiers after it left open, the host memory registered): it is
        # raised once everything is closed, unless a failure comes first.
        first: BaseException | None = None
        cancelled = False
        if host is not None and host._store is self:
            # Its demoter writes into the tiers below: stopped before they close.
            try:
                await host._stop_demoter()
            except asyncio.CancelledError:
                cancelled = True
        for tier in reversed(self.tiers):
            if tier._store is self:
                try:
                    await tier._aclose()
                except asyncio.CancelledError:
                    cancelled = True
                except Exception as exc:
                    _log.warning("kv.tier_close_failed", tier=tier.name, error=repr(exc))
                    first = first or exc
                finally:
                    tier._store = None
        self._closed = True
        failed, late = await _deregister_all(
            self.agent, [t.region for t in self.tiers if isinstance(t, HostTier)]
            + ([self._staging.region] if self._staging is not None else []),
            "kv.deregister_failed", store=self.name)
        first, cancelled = first or failed, cancelled or late
        if first is not None:
            raise first
        if cancelled:
            raise asyncio.CancelledError

    async def _flush_host(self, host: HostTier, lower: Tier) -> None:
        keys = [k for k, s in host.index.items() if s in host.dirty]
        for i in range(0, len(keys), 256):
            await host._write_back(lower, keys[i:i + 256], evict=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed or self._refusing:
            raise ClosedResourceError(f"store {self.name!r} is closed")
        if not self._opened:
            raise RuntimeError("the store is not open: `await kv.Store.open(...)` first")

    def _running(self) -> _Running:
        """``with store._running():`` around an operation (aclose waits for
        it; refused once closing; cut short by a cancelled aclose)."""
        return _Running(self)

    def _cut_operations(self) -> None:
        """A cancelled aclose: the operations in flight are cancelled rather
        than waited for (kv22: the cancelled close still waited for them,
        each up to its own bounds: a put to a stopped peer member its
        ack_wait, a get its stall bounds). Each settles as a cancelled one
        does (a put's copies from src cancelled and waited for until the
        engine lets go, a get's reads into dst waited for), and its caller
        gets ClosedResourceError, not a cancel it did not ask for
        (_Running.__exit__)."""
        me = asyncio.current_task()
        for task in list(self._op_tasks):
            if task is not None and task is not me and task not in self._cut and task.cancel():
                self._cut.add(task)

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _remote(self, region: Region) -> RemoteRegion:
        """``region`` as the loopback peer sees it (refreshed when new)."""
        rr = self._remotes.get(region)
        if rr is not None and not rr.gone:
            return rr
        me = self._me
        assert me is not None
        try:
            rr = me.region(region.name)
        except KeyError:
            await me.refresh()
            rr = me.region(region.name)
        if rr.rid != region.rid:
            await me.refresh()
            rr = me.region(region.name)
        self._remotes[region] = rr
        return rr

    def _next_storing_tier(self, tier: Tier) -> Tier | None:
        below = False
        for t in self.tiers:
            if below and t.stores:
                return t
            if t is tier:
                below = True
        return None

    @staticmethod
    def _keys(keys: Sequence[bytes], *, strict: bool = True) -> list[bytes]:
        """``keys`` as a list, checked with C-level passes (map/set/join), not
        a Python loop: lookups of 1 024 keys are measured in microseconds.
        ``strict=False`` (lookup: it changes nothing): only that they are
        bytes-like of 32 bytes on average; a key of another length is a
        miss. Everything that may store a key checks each one."""
        out = list(keys)
        if not out:
            return out
        try:
            if strict:
                ok = set(map(type, out)) == {bytes} and set(map(len, out)) == {KEY_BYTES}
            else:
                ok = len(b"".join(out)) == KEY_BYTES * len(out)
        except TypeError:
            ok = False
        if not ok:
            raise TypeError(f"keys are {KEY_BYTES}-byte bytes (kv.chain / kv.import_key)")
        return out

    # ------------------------------------------------------------ pin budget

    async def _pin_budget(self, op: _Op) -> None:
        """Waits until ``op``'s pins fit under the cap (op holds none yet)."""
        need = op.nbytes
        if need > self.max_pinned_bytes:
            op.unpin_all()
            raise PinLimitExceeded(f"an operation needs {need} pinned bytes, more than the "
                                   f"store's max_pinned_bytes ({self.max_pinned_bytes})")
        if self._pinned_bytes <= self.max_pinned_bytes:
            return
        op.unpin_all()
        self._pin_waits += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pin_wait
        assert self._pin_space is not None
        while self._pinned_bytes + need > self.max_pinned_bytes:
            left = deadline - loop.time()
            if left <= 0:
                raise PinLimitExceeded(
                    f"{self._pinned_bytes} bytes pinned by operations in flight; {need} more "
                    f"would exceed max_pinned_bytes ({self.max_pinned_bytes}) for "
                    f"{self.pin_wait} s")
            self._pin_space.clear()
            try:
                async with asyncio.timeout(left):
                    await self._pin_space.wait()
            except TimeoutError:
                pass
        raise _Replan

    # ------------------------------------------------------------ lookup

    def _where(self, key: bytes) -> Tier | None:
        host = self._host
        if host is not None and key in host.index:
            return host
        for tier in self._lower:
            if tier._contains(key):
                return tier
        return None

    async def _probe(self, keys: list[bytes]) -> None:
        """Tiers whose index is remote (object storage) are asked about the
        keys from the first one no local index knows."""
        probing = self._probing
        if not probing:
            return
        i0 = next((i for i, k in enumerate(keys) if self._where(k) is None), None)
        if i0 is None:
            return
        for tier in probing:
            await tier._probe(keys[i0:])  # type: ignore[attr-defined]

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Which leading keys the store holds, and where (no data moves)."""
        with self._running():
            return await self._lookup(list(keys))

    async def _lookup(self, keys: list[bytes]) -> LookupResult:
        probes: list[Any] = []
        checked = False
        for tier in self.tiers:
            index = getattr(tier, "index", None)
            if type(index) is dict:
                probes.append(index.__contains__)
            else:
                probes.append(tier._contains)
                checked = True  # a tier's own probe gets only well-formed keys
        if checked or self._probing:
            self._keys(keys, strict=False)
            if self._probing:
                await self._probe(keys)
        try:
            prefix, where = _find(keys, probes, self._names)
        except TypeError:  # an unhashable key
            self._keys(keys, strict=False)
            raise
        if prefix < len(keys) and not checked:
            # A miss: keys that are not keys at all raise here rather than
            # miss (all found, they are keys: every index holds only keys).
            self._keys(keys, strict=False)
        n = len(keys)
        for t in self.tiers:
            t.counters.lookups += n
        return LookupResult(prefix, where)

    # ------------------------------------------------------------ get

    async def get(self, keys: Sequence[bytes], dst: Any) -> GetResult:
        """Delivers the leading blocks the store holds into ``dst`` (one
        Segment per key, a SegmentList, or one Segment of all blocks; the
        agent's registered host memory), verified. Stops at the first miss;
        ``res.prefix`` says how many leading blocks are good."""
        with self._running():
            return await self._get_op(self._keys(keys), dst)

    async def _get_op(self, keys: list[bytes], dst: Any) -> GetResult:
        blk = _Blocks.of(dst, len(keys), self.block_bytes, "dst")
        blk.check(self.agent, "dst")
        await self._probe(keys)
        while True:
            op = _Op(self)
            try:
                return await self._get(keys, blk, op)
            except _Replan:
                continue
            finally:
                op.finish()

    async def _get(self, keys: list[bytes], blk: _Blocks, op: _Op) -> GetResult:
        n = len(keys)
        host = self._host
        bb = self.block_bytes
        tiers_out: list[str | None] = [None] * n
        host_i: list[int] = []
        host_slots: list[int] = []
        leads: dict[Tier, list[tuple[int, _Fetch]]] = {}
        follows: list[tuple[int, _Fetch, _Waiter]] = []
        loop = asyncio.get_running_loop()
        end = n
        no_index: dict[bytes, int] = {}
        index_get = (host.index if host is not None else no_index).get
        regions, offsets = blk.regions, blk.offsets
        touch = host.policy.hit if host is not None and host.policy.tracks_hits else None
        removing = self._removing
        # Planning takes its pins without awaiting, so nothing it found can be
        # evicted before it is pinned.
        for i, key in enumerate(keys):
            slot = index_get(key)
            if slot is not None:
                if touch is not None:
                    touch(key)
                host_i.append(i)
                host_slots.append(slot)
                continue
            f = self._fetches.get(key)
            if f is not None:
                w = _Waiter(blk.regions[i], blk.offsets[i], loop.create_future())
                f.followers.append(w)
                follows.append((i, f, w))
                tiers_out[i] = f.tier.name
                continue
            for tier in self._lower:
                loc = tier._locate(key)
                if loc is not None:
                    break
            else:
                end = i
                break
            op.pin(tier, loc)
            f = _Fetch(key, tier, loc, regions[i], offsets[i])
            if removing and key in removing:
                f.removed = True
            self._fetches[key] = f
            leads.setdefault(tier, []).append((i, f))
            tiers_out[i] = tier.name
        if host_slots:
            assert host is not None
            op.pin_host(host, host_slots)
            name = host.name
            for i in host_i:
                tiers_out[i] = name
            if host.track_reuse:
                host.reused.update(keys[i] for i in host_i)
        try:
            if op.nbytes:
                await self._pin_budget(op)
        except BaseException:
            self._abandon(leads, follows)
            raise
        # counters
        if host is not None:
            host.counters.hits += len(host_i)
            host.counters.hit_bytes += len(host_i) * bb
        for tier, items in leads.items():
            tier.counters.hits += len(items)
            tier.counters.hit_bytes += len(items) * bb
        for _i, f, _w in follows:
            f.tier.counters.hits += 1
            f.tier.counters.coalesced += 1
        self._coalesced += len(follows)
        if end < n:
            for t in self.tiers:
                t.counters.misses += 1
                t.counters.miss_bytes += bb

        errors: dict[int, tuple[str, XferError]] = {}
        waits: list[Awaitable[Any]] = []
        host_groups: list[tuple[list[int], Transfer]] = []
        # Everything posted into the caller's memory is waited for when the
        # get is cancelled, before CancelledError reaches the caller: a
        # cancelled Transfer resolves at once while its bytes may still land
        # (DESIGN: memory of a cancelled op stays in use until the engine
        # confirms it untouched), and a caller must be able to reuse ``dst``
        # once its get is over. The host copies are never cancelled (a
        # memcpy's time), the tiers' reads wait for theirs (kv.tier.landed),
        # and a follower waits for the copy a delivery posted for it.
        host_copies: list[Transfer] = []
        if host_i:
            assert host is not None and host.remote is not None
            slot_of = dict(zip(host_i, host_slots, strict=True))
            t0 = time.perf_counter()
            for region, idx in _groups(blk.regions, host_i):
                copy = self.agent.read(_seglist(region, [blk.offsets[i] for i in idx], bb),
                                       _seglist(host.remote, [slot_of[i] * bb for i in idx], bb))
                host_groups.append((idx, copy))
                host_copies.append(copy)
            host.counters.reads += len(host_groups)
        fetch_runs = [self._run_fetches(tier, [f for _i, f in items], blk, op)
                      for tier, items in leads.items()]
        n_waits = len(host_copies) + len(fetch_runs) + len(follows)
        try:
            if n_waits == 1 and host_copies:
                # The hot path (one host hit): posted as an awaited transfer
                # is (a small same-host copy completes inside the post, and
                # nothing suspends), awaited through landed if still running.
                copy = host_copies[0]
                _eager(copy)
                results: list[Any] = [copy.exception()] if copy.done() else await landed(copy)
            elif n_waits == 1:
                aw = fetch_runs[0] if fetch_runs else follows[0][2].future
                try:
                    await aw
                    results = [None]
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    results = [exc]
            elif n_waits:
                waits.extend(asyncio.shield(c) for c in host_copies)
                waits.extend(fetch_runs)
                waits.extend(w.future for _i, _f, w in follows)
                results = await asyncio.gather(*waits, return_exceptions=True)
            else:
                results = []
        except asyncio.CancelledError:
            self._detach(follows)
            # A fetch whose read never started (its task was cancelled before
            # its first step) is handed over or dropped here, by its leader.
            for tier, items in leads.items():
                idle = [f for _i, f in items if not f.reading]
                if idle:
                    self._hand_over(tier, idle)
            # The fetch runs have ended (gather answers a cancel once its
            # children are done; awaited alone, inline): what is left to
            # land is the host copies and the followers' delivered copies.
            landing = [c for c in host_copies if not c.done()]
            landing += [w.copy for _i, _f, w in follows
                        if w.copy is not None and not w.copy.done()]
            if landing:
                await landed(*landing)
            raise
        if host_groups:
            assert host is not None
            host.counters.read_latency.add(time.perf_counter() - t0)
        for (idx, _t), r in zip(host_groups, results, strict=False):
            if isinstance(r, BaseException):
                err = BlockUnavailable(f"host tier copy failed: {r}")
                err.__cause__ = r
                for i in idx:
                    errors[i] = (host.name if host else "host", err)  # pragma: no branch
        for _tier, items in leads.items():
            for i, f in items:
                if f.error is not None:
                    errors[i] = (f.tier.name, f.error)
        k = len(host_groups) + len(fetch_runs)
        for (i, f, _w), r in zip(follows, results[k:], strict=True):
            if isinstance(r, XferError):
                errors[i] = (f.tier.name, r)
            elif isinstance(r, BaseException):
                err = BlockUnavailable(f"coalesced fetch failed: {r}")
                err.__cause__ = r
                errors[i] = (f.tier.name, err)
        prefix = end
        failed: list[BlockFailure] = []
        for i in sorted(errors):
            tier_name, error = errors[i]
            if not isinstance(error, BlockMissing):  # gone meanwhile: a miss
                failed.append(BlockFailure(i, keys[i], tier_name, error))
            tiers_out[i] = None
            prefix = min(prefix, i)
        for i in range(end, n):
            tiers_out[i] = None
        return GetResult(prefix, tuple(tiers_out), tuple(failed), prefix * bb, len(follows))

    def _abandon(self, leads: dict[Tier, list[tuple[int, _Fetch]]],
                 follows: list[tuple[int, _Fetch, _Waiter]]) -> None:
        """A planned get that will not run (pin budget): undo its fetches."""
        for items in leads.values():
            for _i, f in items:
                if self._fetches.get(f.key) is f:
                    if f.followers:
                        self._hand_over(f.tier, [f])
                    else:
                        del self._fetches[f.key]
        self._detach(follows)

    def _detach(self, follows: list[tuple[int, _Fetch, _Waiter]]) -> None:
        """Cancelled followers leave their fetches; a handed-over fetch with
        nobody left waiting is cancelled (the last waiter cancels the fetch)."""
        for _i, f, w in follows:
            # Also a future gather cancelled already: it leaves the list, and
            # may have been the last one waiting.
            w.future.cancel()
            try:
                f.followers.remove(w)
            except ValueError:
                pass  # already taken by a delivery (which skips it: it is done)
            task = f.task
            if task is not None and not task.done():
                fetches: list[_Fetch] = getattr(task, "fetches", [])
                # Only a refetch still reading may go: once its bytes are
                # being copied out, waiters taken into that copy are no longer
                # in ``followers`` (cancelling then would orphan them, and
                # cut copies out of staging short).
                if not any(g.delivering for g in fetches) and all(
                        not any(not x.future.done() for x in g.followers) for g in fetches):
                    for g in fetches:
                        if self._fetches.get(g.key) is g:
                            del self._fetches[g.key]
                    task.cancel()

    async def _run_fetches(self, tier: Tier, fetches: list[_Fetch], blk: _Blocks,
                           op: _Op) -> None:
        """Leader: fetches blocks from ``tier`` straight into the caller's
        memory, then serves whoever attached meanwhile."""
        for f in fetches:
            f.reading = True
        tier.counters.in_flight += len(fetches)
        t0 = time.perf_counter()
        try:
            errs = await tier._read([f.loc for f in fetches], [f.region for f in fetches],
                                    [f.offset for f in fetches])
        except asyncio.CancelledError:
            self._hand_over(tier, fetches)
            raise
        except Exception as exc:  # a tier reports per block; this is a bug guard
            err = BlockUnavailable(f"tier {tier.name!r} failed: {exc}")
            errs = [err] * len(fetches)
        finally:
            tier.counters.in_flight -= len(fetches)
        if len(errs) != len(fetches):  # a tier bug: its waiters still hear
            errs = [BlockUnavailable(f"tier {tier.name!r} answered {len(errs)} of "
                                     f"{len(fetches)} blocks")] * len(fetches)
        tier.counters.read_latency.add(time.perf_counter() - t0)
        for f, e in zip(fetches, errs, strict=True):
            f.error = e
            if e is not None:
                self._note_error(e)
        host = self._host
        if not (host is not None and host.promote) and not any(f.followers for f in fetches):
            # Nothing to copy anywhere: retire the fetches now (no task).
            fetches_d = self._fetches
            for f in fetches:
                if fetches_d.get(f.key) is f:
                    del fetches_d[f.key]
            return
        # Promotion and the followers' copies read the leader's memory: the
        # leader may not return (cancelled or not) before they are done, a
        # memcpy's time at most.
        for f in fetches:
            f.delivering = True
        await run_to_end(self._deliver(fetches, promote=True))

    def _note_error(self, e: XferError) -> None:
        from aioxfer.kv.errors import BlockCorrupt

        if isinstance(e, BlockCorrupt):
            self._quarantined += 1

    async def _deliver(self, fetches: list[_Fetch], *, promote: bool) -> None:
        """Fetched blocks are in ``f.region``: copy them into the host tier
        (promotion) and to every follower, then retire the fetches.

        Every waiter taken off ``followers`` is answered (a copy, its error,
        or BlockUnavailable) whatever happens here; copies are never cut
        short: a cancel waits for the batch in flight (a memcpy's time) and
        then answers the rest, so ``f.region`` (staging, a leader's memory)
        is never reused while a copy still reads it."""
        host = self._host
        bb = self.block_bytes
        op = _Op(self)
        taken: list[_Waiter] = []
        cancelled = False
        promoted: dict[int, int] = {}
        for f in fetches:
            f.delivering = True
        try:
            good = [f for f in fetches if f.error is None]
            if promote and host is not None and host.promote and good:
                task = asyncio.ensure_future(self._promote(host, good, op))
                cancelled = await finish_uncancelled(task)
                promoted = task.result()
            # Followers may keep attaching while we copy: serve until none.
            while not cancelled:
                batch: list[tuple[_Fetch, _Waiter]] = []
                for f in fetches:
                    while f.followers:
                        w = f.followers.pop(0)
                        taken.append(w)
                        batch.append((f, w))
                if not batch:
                    break
                copies: list[tuple[_Waiter, Transfer]] = []
                for f, w in batch:
                    if w.future.done():
                        continue  # cancelled meanwhile
                    if f.error is not None:
                        w.future.set_exception(f.error)
                        continue
                    try:
                        slot = promoted.get(id(f))
                        if slot is not None:
                            # From the promoted copy (store memory the
                            # loopback peer knows): a caller's region is
                            # never imported just to copy out of it.
                            assert host is not None and host.remote is not None
                            src, off = host.remote, slot * bb
                        else:
                            rr = self._remotes.get(f.region)
                            if rr is None or rr.gone:
                                rr = await self._remote(f.region)
                                if w.future.done():
                                    continue  # cancelled meanwhile: its memory is its own again
                            src, off = rr, f.offset
                        copy = self.agent.read(w.region[w.offset:w.offset + bb],
                                               src[off:off + bb])
                        w.copy = copy
                    except (XferError, KeyError, ValueError) as exc:
                        err = BlockUnavailable(f"coalesced copy failed: {exc}")
                        err.__cause__ = exc
                        if not w.future.done():
                            w.future.set_exception(err)
                        continue
                    copies.append((w, copy))
                if not copies:
                    continue
                gathered = asyncio.gather(*(c for _w, c in copies), return_exceptions=True)
                cancelled = await finish_uncancelled(gathered)
                for (w, _c), r in zip(copies, gathered.result(), strict=True):
                    if w.future.done():
                        continue
                    if not isinstance(r, BaseException):
                        w.future.set_result(None)
                    else:
                        err = BlockUnavailable(f"coalesced copy failed: {r!r}")
                        err.__cause__ = r
                        w.future.set_exception(err)
        finally:
            self._retire(fetches, "the fetch was abandoned", taken)
            op.finish()
        if cancelled:
            raise asyncio.CancelledError

    def _retire(self, fetches: list[_Fetch], why: str,
                taken: Sequence[_Waiter] = ()) -> None:
        """The fetches are over: unregistered, and every waiter still
        unanswered (attached, or ``taken`` into a delivery) gets
        BlockUnavailable. Safe to call more than once."""
        for w in taken:
            if not w.future.done():
                w.future.set_exception(BlockUnavailable(why))
        for f in fetches:
            if self._fetches.get(f.key) is f:
                del self._fetches[f.key]
            for w in f.followers:
                if not w.future.done():
                    w.future.set_exception(BlockUnavailable(why))
            f.followers.clear()

    async def _promote(self, host: HostTier, fetches: list[_Fetch], op: _Op) -> dict[int, int]:
        """Copies fetched blocks into host slots; returns, per promoted fetch
        (by id), its slot, pinned by ``op`` until the delivery is over."""
        bb = self.block_bytes
        promoted: dict[int, int] = {}
        want = [f for f in fetches if f.key not in host.index and f.key not in self._filling
                and not f.removed]
        slots = host._take(len(want))  # never waits: promotion is best effort
        if not slots:
            return promoted
        want = want[: len(slots)]
        for s in slots:
            op.pin(host, s)
        assert host.remote is not None
        transfers = []
        for f, s in zip(want, slots, strict=True):
            transfers.append(self.agent.write(f.region[f.offset:f.offset + bb],
                                              host.remote[s * bb:(s + 1) * bb]))
        results = await _await_owned(transfers, op, lambda: None)
        for f, s, r in zip(want, slots, results, strict=True):
            if r is None and f.key not in host.index and not f.removed:
                host.insert(f.key, s, dirty=False)
                host.counters.promotions += 1
                promoted[id(f)] = s
            else:
                host.give_back([s])
        return promoted

    def _hand_over(self, tier: Tier, fetches: list[_Fetch]) -> None:
        """The leader was cancelled: fetches with followers are re-issued into
        staging by a store task; the others are dropped."""
        keep = []
        for f in fetches:
            if self._fetches.get(f.key) is not f:
                continue
            if any(not w.future.done() for w in f.followers):
                keep.append(f)
            else:
                del self._fetches[f.key]
        if not keep:
            return
        self._handoffs += len(keep)
        op = _Op(self)
        for f in keep:
            op.pin(tier, f.loc)  # now: the leader's pins go with it
        task = self._spawn(self._refetch(tier, keep, op), f"aioxfer-kv-refetch-{tier.name}")
        # Also if cancelled before it ran (store closing): the pins go and no
        # follower is left waiting on a fetch nobody runs.
        def over(_t: asyncio.Task[Any]) -> None:
            op.finish()
            self._retire(keep, "the fetch was abandoned")

        task.add_done_callback(over)
        task.fetches = keep  # type: ignore[attr-defined]
        for f in keep:
            f.task = task

    async def _refetch(self, tier: Tier, fetches: list[_Fetch], op: _Op) -> None:
        staging = self._staging
        assert staging is not None
        bb = self.block_bytes
        slots: list[int] = []
        # Staging goes back exactly once, when op's pins go: after the read
        # into it and every copy out of it are over, however this ends.
        op.after.append(lambda: staging.give_back(slots))
        try:
            slots.extend(await staging.take(len(fetches), self.pin_wait))
            for f in fetches[len(slots):]:
                f.error = PinLimitExceeded("no staging memory for a handed-over fetch")
            fetches_ok = fetches[: len(slots)]
            for f, s in zip(fetches_ok, slots, strict=True):
                f.region, f.offset = staging.region, s * bb
            if fetches_ok:
                errs = await _owned_read(tier, fetches_ok, op, None)
                for f, e in zip(fetches_ok, errs, strict=True):
                    f.error = e
                    if e is not None:
                        self._note_error(e)
            await self._deliver(fetches, promote=True)
        except asyncio.CancelledError:
            # The last waiter left while the read was in flight (or the store
            # closes): nobody is left to answer, but answer anyway.
            self._retire(fetches, "the fetch was cancelled")
            raise
        finally:
            op.finish()

    # ------------------------------------------------------------ put

    async def put(self, keys: Sequence[bytes], src: Any, *, durable: bool = False) -> PutResult:
        """Stores blocks from ``src`` (the agent's registered host memory; same
        shapes as ``get``'s ``dst``) in the fastest tier with room. Keys the
        store holds already are not written again. ``durable=True``: returns
        once the blocks are also on the first durable tier (disk, fsynced)."""
        with self._running():
            return await self._put_op(self._keys(keys), src, durable)

    async def _put_op(self, keys: list[bytes], src: Any, durable: bool) -> PutResult:
        n = len(keys)
        blk = _Blocks.of(src, n, self.block_bytes, "src")
        blk.check(self.agent, "src")
        tiers_out: list[str | None] = [None] * n
        new: list[int] = []
        seen: set[bytes] = set()
        present = 0
        for i, key in enumerate(keys):
            t = self._where(key)
            if t is not None or key in self._filling or key in seen:
                present += 1
                tiers_out[i] = t.name if t is not None else None
                continue
            seen.add(key)
            new.append(i)
        op = _Op(self)
        for i in new:
            self._filling.add(keys[i])
        try:
            stored, durable_n = await self._put(keys, blk, new, tiers_out, durable, op)
        finally:
            for i in new:
                self._filling.discard(keys[i])
            op.finish()
        for i in range(n):
            if tiers_out[i] is None and keys[i] in seen:
                tiers_out[i] = None
        dropped = len(new) - stored
        return PutResult(stored, present, dropped, durable_n, tuple(tiers_out))

    async def _put(self, keys: list[bytes], blk: _Blocks, new: list[int],
                   tiers_out: list[str | None], durable: bool, op: _Op) -> tuple[int, int]:
        if not new:
            return 0, 0
        host = self._host
        bb = self.block_bytes
        if host is None:
            tier = next((t for t in self._lower if t.stores), None)
            if tier is None:
                return 0, 0
            ok = await tier._write([keys[i] for i in new], [blk.regions[i] for i in new],
                                   [blk.offsets[i] for i in new], durable=durable)
            stored = 0
            for i, good in zip(new, ok, strict=True):
                if good:
                    tiers_out[i] = tier.name
                    stored += 1
            return stored, stored if durable and getattr(tier, "durable", False) else 0
        slots = await host.reserve(len(new), host.put_wait)
        placed = new[: len(slots)]
        overflow = new[len(slots):]
        stored_around = 0
        if overflow:
            # No room in host memory within put_wait: the blocks go to the
            # next tier that has room, straight from the caller's memory.
            lower = self._next_storing_tier(host)
            if lower is None:
                host.counters.dropped("no_room", len(overflow))
            else:
                try:
                    ok = await lower._write([keys[i] for i in overflow],
                                            [blk.regions[i] for i in overflow],
                                            [blk.offsets[i] for i in overflow], durable=durable)
                except BaseException:
                    # Cancelled (or the tier failed) before the reserved host
                    # slots were filled: they go back, or the tier would
                    # lose that much capacity for good.
                    host.give_back(slots)
                    raise
                for i, good in zip(overflow, ok, strict=True):
                    if good:
                        tiers_out[i] = lower.name
                        stored_around += 1
        if not placed:
            durable_around = stored_around if durable and getattr(
                self._next_storing_tier(host), "durable", False) else 0
            return stored_around, durable_around
        for s in slots:
            op.pin(host, s)
        assert host.remote is not None
        slot_of = dict(zip(placed, slots, strict=True))
        transfers: list[Transfer] = []
        groups = _groups(blk.regions, placed)
        t0 = time.perf_counter()
        for region, idx in groups:
            transfers.append(self.agent.write(
                _seglist(region, [blk.offsets[i] for i in idx], bb),
                _seglist(host.remote, [slot_of[i] * bb for i in idx], bb)))
        host.counters.writes += len(transfers)
        try:
            # These copies read ``src``: a cancelled put raises only once the
            # engine has let go of them (kv22: through _await_owned it raised
            # at once while the copies ran on, and a marker written into src
            # after the put raised reached the host slots, ~70-130 MiB of a
            # 128 MiB put, every cancel after the first loop step, shm and
            # tcp alike). The slots go back then: nothing writes them any more.
            got = await settle_on_cancel(transfers)
        except BaseException:
            host.give_back(slots)
            raise
        results = [r if isinstance(r, BaseException) else None for r in got]
        host.counters.write_latency.add(time.perf_counter() - t0)
        lower = self._next_storing_tier(host)
        through = lower is not None and (host.write_through or durable)
        stored_i: list[int] = []
        arrived = 0  # keys another writer put in host memory meanwhile
        for (_region, idx), r in zip(groups, results, strict=True):
            for i in idx:
                if r is None:
                    tiers_out[i] = host.name
                    if host.insert(keys[i], slot_of[i], dirty=lower is not None and not through):
                        stored_i.append(i)
                        continue
                    # The key arrived in another slot while we copied (a
                    # member's placement): ours went back. Not written through
                    # nor counted durable here: left to write-back instead.
                    arrived += 1
                    if through:
                        host.mark_unwritten(keys[i])
                else:
                    host.counters.errors += 1
                    host.counters.dropped("copy_failed")
                    host.give_back([slot_of[i]])
        host.counters.puts += len(stored_i)
        host.counters.put_bytes += len(stored_i) * bb
        durable_n = 0
        if through and stored_i:
            assert lower is not None and host.region is not None
            wkeys = [keys[i] for i in stored_i]
            try:
                ok = await lower._write(wkeys, [host.region] * len(stored_i),
                                        [slot_of[i] * bb for i in stored_i], durable=durable)
            except BaseException:
                # Cancelled (or the tier failed) midway: the blocks are in
                # host memory as clean copies of nothing; left for write-back
                # instead, or the host tier would drop them unwritten.
                for i in stored_i:
                    if host.index.get(keys[i]) == slot_of[i] and lower._locate(keys[i]) is None:
                        host.dirty.add(slot_of[i])
                raise
            for i, good in zip(stored_i, ok, strict=True):
                if not good and host.index.get(keys[i]) == slot_of[i]:
                    host.dirty.add(slot_of[i])  # left for write-back
                elif good:
                    durable_n += 1
            if not (durable and getattr(lower, "durable", False)):
                durable_n = 0
        if durable and stored_around and getattr(lower, "durable", False):
            durable_n += stored_around
        return len(stored_i) + stored_around + arrived, durable_n

    # ------------------------------------------------------------ prefetch

    async def prefetch(self, keys: Sequence[bytes], tier: str = "host") -> int:
        """Brings the leading blocks the store holds into the host tier;
        returns how many of ``keys``' leading run are in host memory once it
        is done. Blocks another get is fetching already are left to that get's
        promotion. Cancelling stops the wait at once; reads already posted
        into host memory still complete and are kept (their pins go then)."""
        with self._running():
            return await self._prefetch(self._keys(keys), tier)

    async def _prefetch(self, keys: list[bytes], tier: str = "host") -> int:
        host = self._host
        if host is None or tier != host.name:
            raise ValueError(f"prefetch targets the host tier; this store has "
                             f"{host.name if host else None!r}")
        await self._probe(keys)
        have = 0
        want: list[tuple[bytes, Tier, Any]] = []
        for key in keys:
            if key in host.index or key in self._fetches:
                have += 1
                continue
            found = next(((t, loc) for t in self._lower
                          if (loc := t._locate(key)) is not None), None)
            if found is None:
                break
            want.append((key, found[0], found[1]))
        if not want:
            return have
        op = _Op(self)
        for _key, t, loc in want:
            op.pin(t, loc)  # before any await: the block cannot go away meanwhile
        try:
            slots = await host.reserve(len(want), host.put_wait)
        except BaseException:
            op.finish()
            raise
        want = want[: len(slots)]  # the rest had no room (their pins go with op)
        bb = self.block_bytes
        assert host.region is not None
        by_tier: dict[Tier, list[_Fetch]] = {}
        slot_of: dict[bytes, int] = {}
        for (key, t, loc), s in zip(want, slots, strict=True):
            if key in self._fetches or key in host.index:
                # Another get or prefetch took it up while we waited for room.
                host.give_back([s])
                have += 1
                continue
            op.pin(host, s)
            f = _Fetch(key, t, loc, host.region, s * bb)
            if key in self._removing:
                f.removed = True
            self._fetches[key] = f
            by_tier.setdefault(t, []).append(f)
            slot_of[key] = s
        task = self._spawn(self._prefetch_run(by_tier, slot_of, op), "aioxfer-kv-prefetch")
        fetches = [f for fs in by_tier.values() for f in fs]

        def over(_t: asyncio.Task[Any]) -> None:
            # Also if cancelled before it ran (store closing): the pins go
            # and its waiters still hear.
            op.finish()
            self._retire(fetches, "the prefetch was abandoned")

        task.add_done_callback(over)
        done: int = await asyncio.shield(task)
        return have + done

    async def _prefetch_run(self, by_tier: dict[Tier, list[_Fetch]], slot_of: dict[bytes, int],
                            op: _Op) -> int:
        host = self._host
        assert host is not None
        left = dict(slot_of)  # reserved slots not yet published or given back

        def release(fs: list[_Fetch]) -> None:
            # Once a tier's read is over (cancelled or not), its unpublished
            # slots go back; never while the engine may still write them.
            host.give_back([left.pop(f.key) for f in fs if f.key in left])

        done = 0
        try:
            runs = [_owned_read(t, fs, op, lambda fs=fs: release(fs))
                    for t, fs in by_tier.items()]
            results = await asyncio.gather(*runs, return_exceptions=True)
            for (t, fs), errs in zip(by_tier.items(), results, strict=True):
                if isinstance(errs, asyncio.CancelledError):
                    raise errs
                if isinstance(errs, BaseException):
                    err = BlockUnavailable(f"tier {t.name!r} failed: {errs!r}")
                    errs = [err] * len(fs)
                t.counters.hits += len(fs)
                for f, e in zip(fs, errs, strict=True):
                    f.error = e
                    slot = left.pop(f.key)
                    if e is None and f.key not in host.index and not f.removed:
                        host.insert(f.key, slot, dirty=False)
                        host.counters.promotions += 1
                        done += 1
                    else:
                        host.give_back([slot])
                        if e is not None:
                            self._note_error(e)
                await self._deliver(fs, promote=False)
        finally:
            # Whatever was not delivered (cancelled, or a bug): its waiters
            # learn it now, and nothing stays registered.
            for fs in by_tier.values():
                for f in fs:
                    if self._fetches.get(f.key) is f:
                        del self._fetches[f.key]
                    for w in f.followers:
                        if not w.future.done():
                            w.future.set_exception(BlockUnavailable("the prefetch was abandoned"))
                    f.followers.clear()
            if not op.pending:
                host.give_back(list(left.values()))
                left.clear()
            op.finish()
        return done

    # ------------------------------------------------------------ stream

    def stream(self, keys: Sequence[bytes], dst: Any, *, layers: int) -> LayerStream:
        """Delivers the leading blocks the store holds layer by layer: ``async
        for layer in store.stream(keys, dst, layers=32)`` yields a
        LayerResult as soon as that layer of every block has landed (layer
        ``l`` of a block is its bytes ``[l * block_bytes // layers, ...)``).
        ``dst``: block memory as for ``get`` (each layer lands inside its
        block), or one target per layer (a SegmentList or list of Segments of
        ``block_bytes // layers`` bytes per key: a layer-major KV cache).
        Blocks below the host tier are first brought into host memory whole
        and verified (no layer of a block is delivered unverified); layers
        are then copied from there in order: layer 0 alone, the next ones
        once it is handed out, two ahead of the one awaited (one transfer
        per layer and dst region). Layers are yielded in order, each once
        it has landed. Leave the loop early, or cancel the task iterating
        it, and the stream ends once the layers already posted into ``dst``
        have landed (at most the window: no copy writes ``dst`` once the
        close or the cancellation returns) and the pins are released
        (``aclose()``, or ``async with``, for a loop left with ``break``).
        ``async for ... in store.stream(...)`` left by ``break`` without
        either drops the stream at the break, and it waits there for its
        copies (see LayerStream.__del__); a stream the caller still holds
        a reference to is not dropped by the break: close it."""
        self._check_open()
        # The keys are checked where they are used, not in a pass here (~10
        # us of a first layer's ~250, cold): a key the host tier holds is one
        # (only checked keys are stored); any other sends the stream down the
        # path that checks each key before anything is brought up, so a
        # non-key raises TypeError from the first iteration.
        return LayerStream(self, list(keys), dst, layers)

    # ------------------------------------------------------------ remove

    async def remove(self, keys: Sequence[bytes]) -> int:
        """Removes the keys from every tier; returns how many blocks went.

        A tier whose storage cannot be reached (the object bucket down, a
        disk I/O error) does not stop the others: every tier is asked, and
        once all were the store serves the keys from none of them (the tier
        that failed forgets them too). Then RemoveIncomplete is raised
        (``removed``, the failed ``tiers``, the first error as ``__cause__``):
        the blocks may still be in that storage, where another store can
        find them; remove them again once it is back."""
        with self._running():
            return await self._remove(self._keys(keys))

    async def _remove(self, keys: list[bytes]) -> int:
        removed = 0
        host = self._host
        # Fetches in flight (a get's promotion, a prefetch) of these keys
        # must not bring them back into host memory once we return.
        fetches = self._fetches
        for key in keys:
            f = fetches.get(key)
            if f is not None:
                f.removed = True
        removing = self._removing
        for key in keys:
            removing[key] = removing.get(key, 0) + 1
        failed: list[tuple[str, BaseException]] = []
        try:
            if host is not None:
                for key in keys:
                    if key in host.index:
                        host.evict(key, "removed")
                        removed += 1
            for tier in self._lower:
                if tier.stores:
                    try:
                        removed += await tier._remove(keys)
                    except (XferError, OSError) as exc:
                        tier.counters.errors += 1
                        _log.warning("kv.remove_failed", tier=tier.name, blocks=len(keys),
                                     error=repr(exc))
                        failed.append((tier.name, exc))
        finally:
            for key in keys:
                c = removing[key] - 1
                if c:
                    removing[key] = c
                else:
                    del removing[key]
        if failed:
            names = tuple(n for n, _ in failed)
            err = RemoveIncomplete(
                f"store {self.name!r}: remove could not reach tier(s) {', '.join(names)}: "
                f"{failed[0][1]!r}; the blocks may remain there (removed elsewhere: {removed})",
                removed=removed, tiers=names)
            raise err from failed[0][1]
        return removed

    # ------------------------------------------------------------ statistics

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            tiers={t.name: t._statistics() for t in self.tiers},
            pinned_bytes=self._pinned_bytes,
            pins=self._pins,
            fetches_in_flight=len(self._fetches),
            coalesced=self._coalesced,
            handoffs=self._handoffs,
            quarantined=self._quarantined,
            pin_waits=self._pin_waits,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "new"
        return f"<Store {self.name!r} {state} tiers={[t.name for t in self.tiers]}>"


_STREAM_WINDOW = 2  # layers in flight ahead of the one awaited

# A stream's targets in one region: (region, which keys (None: all, in
# order), their offsets there).
_Group = tuple[Region, "npt.NDArray[np.intp] | None", "npt.NDArray[np.uint64]"]
# What one layer posts per region: (region, dst offsets, host-slot offsets
# of layer 0), each range layer_bytes long.
_Plan = tuple[Region, "npt.NDArray[np.uint64]", "npt.NDArray[np.uint64]"]


def _target_groups(arg: Any, n: int, length: int, what: str, agent: Agent) -> list[_Group]:
    """``arg`` (a get's ``dst`` shapes, segments of ``length`` bytes), checked,
    as groups of one region each; a SegmentList or one Segment without a
    Python pass over the keys."""
    if type(arg) is Segment and arg.length == n * length:
        # One run of n blocks (a stream's usual dst): checked as _Blocks.check
        # does, without building one.
        region = arg.region
        if region.agent is not agent or region.kind != "host" or region.closed:
            _Blocks([region], []).check(agent, what)
        return [(region, None, np.arange(arg.offset, arg.offset + n * length, length,
                                         dtype=np.uint64))]
    run = _Blocks.run(arg, n, length, what)
    if run is not None:
        _Blocks([run[0]], []).check(agent, what)
        return [(run[0], None, run[1])]
    blk = _Blocks.of(arg, n, length, what)
    blk.check(agent, what)
    offsets = np.array(blk.offsets, dtype=np.uint64)
    out: list[_Group] = []
    for region, idx in _groups(blk.regions, list(range(n))):
        if len(idx) == n:
            out.append((region, None, offsets))
        else:
            ix = np.array(idx, dtype=np.intp)
            out.append((region, ix, offsets[ix]))
    return out


class LayerStream:
    """The async iterator ``Store.stream`` returns (also an async context
    manager: leaving it waits for the layers posted into dst to land, then
    releases pins).

    Time to the first layer is what a decoder waits for, so everything
    before layer 0's copy is kept to whole-array work: the targets are
    numpy offsets (no per-key lists), layer 0 is posted alone (beside other
    layers it would share the copy threads with them and land layers late;
    alone, a same-host copy within the engine's inline threshold runs inside
    the await), and the window of later layers is posted from the loop right
    after layer 0 is handed out, not before: the caller has layer 0 without
    waiting for the Python work of posting two more."""

    def __init__(self, store: Store, keys: list[bytes], dst: Any, layers: int) -> None:
        if layers < 1 or store.block_bytes % layers:
            raise ValueError(f"layers must divide block_bytes ({store.block_bytes})")
        self.store = store
        self.keys = keys
        self.layers = layers
        self.layer_bytes = lb = store.block_bytes // layers
        self.prefix: int | None = None  # known once the first layer is awaited
        n, agent = len(keys), store.agent
        per_layer = (type(dst) is not Segment  # (the usual dst: no ABC checks)
                     and isinstance(dst, Sequence) and not isinstance(dst, Segment | SegmentList)
                     and len(dst) == self.layers
                     and all(isinstance(d, SegmentList) or (isinstance(d, Sequence)
                                                            and not isinstance(d, Segment))
                             for d in dst))
        # Per layer its own targets (a layer-major cache), or one set for
        # every layer (block memory: layer l at + l * layer_bytes).
        self._per_layer = per_layer
        self._targets: list[list[_Group]] = (
            [_target_groups(d, n, lb, "layer dst", agent) for d in dst] if per_layer
            else [_target_groups(dst, n, store.block_bytes, "dst", agent)])
        self._plans: list[list[_Plan]] = []
        self._op = _Op(store)
        self._pending: list[list[Transfer]] = []  # per layer posted, its transfers
        self._next = 0
        self._noted = False  # hits told to the policy and the counters
        self._closed = False
        self._store_closed = False  # ended by Store.aclose: the next step raises
        self._orphans: list[Transfer] = []  # posted by a _post that then failed
        store._streams.add(self)

    def _begin(self) -> bool:
        """Every block in host memory (the usual stream): pins them and posts
        layer 0, without a coroutine to await. False: some are below host
        memory (``_start`` brings them up first)."""
        store = self.store
        host = store._host
        if host is None:
            raise ValueError("stream delivers from host memory: the store needs a HostTier")
        store._check_open()
        try:
            slots: list[int] = list(map(host.index.__getitem__, self.keys))
        except KeyError:
            return False
        self._pin_and_post(host, slots)
        return True

    async def _start(self) -> None:
        store = self.store
        host = store._host
        assert host is not None
        keys = self.keys
        found = list(map(host.index.get, keys))
        if None in found:
            # Some blocks are below host memory: they come up first (and
            # may be stored under these keys: each one checked).
            store._keys(keys)
            # An operation of the store's while it brings blocks up
            # (Store.aclose waits for it; refused once closing: rev21 #3).
            with store._running():
                await store._prefetch(keys)
            found = list(map(host.index.get, keys))
        m = found.index(None) if None in found else len(found)
        self._pin_and_post(host, found[:m])  # type: ignore[arg-type]

    def _pin_and_post(self, host: HostTier, slots: list[int]) -> None:
        """Pins the leading blocks' host slots and posts their layer 0 (no
        await between the lookup that found the slots and this)."""
        self._op.pin_host(host, slots)
        self.prefix = m = len(slots)
        if m:
            # (fromiter reads a list of ints in well under np.array's time)
            src = np.fromiter(slots, dtype=np.uint64, count=m)
            src *= np.uint64(self.store.block_bytes)
            targets = self._targets
            if len(targets) == 1 and len(targets[0]) == 1 and targets[0][0][1] is None:
                # One dst region, every key (block memory): the usual plan.
                region, _, offs = targets[0][0]
                self._plans = [[(region, offs[:m] if m < len(offs) else offs, src)]]
            else:
                self._plans = [self._plan(groups, src, m) for groups in targets]
            self._post(0)
        else:
            self._note_hits()

    def _note_hits(self) -> None:
        """The eviction policy and the counters hear of the stream's hits:
        once, after layer 0 is out (or when the stream ends before)."""
        if self._noted:
            return
        self._noted = True
        host, m = self.store._host, self.prefix
        assert host is not None and m is not None
        if host.policy.tracks_hits:
            # Only the blocks still indexed: this runs after layer 0 is out,
            # and a pinned block may have been removed or evicted since (LRU's
            # hit is OrderedDict.move_to_end: a KeyError for a key it lost).
            # Filtered and consumed at C level.
            deque(map(host.policy.hit, filter(host.index.__contains__, self.keys[:m])),
                  maxlen=0)
        host.counters.hits += m
        host.counters.hit_bytes += m * self.store.block_bytes

    @staticmethod
    def _plan(groups: list[_Group], src: npt.NDArray[np.uint64], m: int) -> list[_Plan]:
        """Targets of the leading ``m`` keys, with their host slots."""
        out: list[_Plan] = []
        for region, idx, offs in groups:
            if idx is None:
                out.append((region, offs[:m], src))
                continue
            k = int(np.searchsorted(idx, m))  # idx ascends: the group's keys below m
            if k:
                out.append((region, offs[:k], src[idx[:k]]))
        return out

    def _post(self, layer: int) -> None:
        """Posts layer ``layer`` of every block (one transfer per dst region).
        Straight from the plan's offset arrays (Agent.post_arrays: every
        range ``layer_bytes`` long, no SegmentLists to build, pair or merge
        per layer: the first layer's setup is most of its latency)."""
        store, host = self.store, self.store._host
        assert host is not None and host.remote is not None
        post, remote = store.agent.post_arrays, host.remote
        lb = self.layer_bytes
        per_layer = self._per_layer
        posted: list[Transfer] = []
        try:
            for region, dst, src in self._plans[layer if per_layer else 0]:
                if layer:  # (layer 0 is at the plan's offsets: two array ops fewer)
                    d = np.uint64(layer * lb)
                    src = src + d
                    if not per_layer:
                        dst = dst + d
                posted.append(post("read", region, remote, dst, src, lb))
        except BaseException:
            # One region's post failed after others' were posted: those
            # are not cancelled (a cancelled Transfer resolves at once while
            # the engine may still write dst) but kept, and the close waits
            # for them as for whole layers. (Today they are still in the
            # loop iteration's batch, which a cancel drops unposted; kept,
            # this does not depend on when the agent hands a batch over.)
            self._orphans.extend(posted)
            raise
        self._pending.append(posted)

    def _post_upto(self, layer: int) -> None:
        for later in range(len(self._pending), min(layer, self.layers - 1) + 1):
            self._post(later)

    def _open_window(self) -> None:
        """Posts the layers after the first (a loop callback, scheduled as
        layer 0 is handed out) and hands them to the engine now."""
        if self._closed:
            return
        self._note_hits()
        posted = len(self._pending)
        try:
            self._post_upto(self._next + _STREAM_WINDOW - 1)
        except Exception:
            return  # the next __anext__ posts again and raises it to the caller
        if len(self._pending) > posted:
            self.store.agent.flush()

    def __aiter__(self) -> LayerStream:
        return self

    async def __anext__(self) -> LayerResult:
        if self._closed:
            if self._store_closed:
                # Not StopAsyncIteration: a loop that simply ended would
                # take the layers never delivered for delivered.
                raise ClosedResourceError(f"store {self.store.name!r} closed under the stream "
                                          f"(layers {self._next}..{self.layers - 1} not "
                                          f"delivered)")
            raise StopAsyncIteration
        try:
            if self.prefix is None and not self._begin():
                await self._start()
            layer = self._next
            if not self.prefix or layer >= self.layers:
                self._finish()
                raise StopAsyncIteration
            if layer:
                # A window of layers in flight: all of them posted at once
                # would land (and be seen) together, the first no sooner than
                # the last.
                self._post_upto(layer + _STREAM_WINDOW)
            for t in self._pending[layer]:
                # Posted as an awaited transfer is (layer 0 alone and small:
                # done inside the post, nothing suspends), then awaited
                # through landed: a cancel here must not cancel a copy into
                # dst (its bytes may still land: see _close).
                _eager(t)
                res = t.exception() if t.done() else (await landed(t))[0]
                if isinstance(res, XferError):
                    raise BlockUnavailable(f"layer {layer} copy failed: {res}") from res
                if isinstance(res, BaseException):
                    raise res
            self._next = layer + 1
            if self._next >= self.layers:
                self._finish()
            elif not layer:
                # Through a weak reference: a strong one (the bound method)
                # kept a stream left by ``break`` right after layer 0 alive
                # until the callback had posted the window into dst, after
                # the caller's loop had ended (see __del__).
                asyncio.get_running_loop().call_soon(_open_window, weakref.ref(self))
            return LayerResult(layer, self.prefix, self.prefix * self.layer_bytes)
        except BaseException:
            await self._close()
            raise

    def _finish(self, cancel: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if cancel:
            # Only where nobody can wait (see __del__): its layers may still
            # land in dst, which no caller awaits any more.
            for t in self._in_flight():
                t.cancel()
        # Layers posted that nobody will await (the window past a failed
        # layer, or past the close): a failure of theirs is retrieved here,
        # not reported by the loop as "exception was never retrieved" (kv22:
        # seen for a stream whose store closed under it).
        for ts in (*self._pending[self._next:], self._orphans):
            for t in ts:
                if t.done():
                    _retrieve(t)
                else:
                    t.add_done_callback(_retrieve)
        self.store._streams.discard(self)
        try:
            if self.prefix is not None:
                self._note_hits()
        finally:
            self._op.finish()  # the pins go whatever happened above

    def _in_flight(self) -> list[Transfer]:
        """What the stream posted into dst and nobody awaited to its end."""
        return [t for ts in (*self._pending[self._next:], self._orphans) for t in ts
                if not t.done()]

    async def _close(self, store_closed: bool = False) -> None:
        """Ends the stream once nothing it posted writes ``dst``: the layers
        in flight are waited for, not cancelled (a cancelled Transfer
        resolves at once while its bytes may still land, and the caller
        reuses ``dst`` once its close, or its cancellation, returns). At
        most the window's layers, each one local copy; a cancel meanwhile
        still waits for them (kv.tier.landed), then is raised. The pins go
        after: the copies read the pinned host slots until they end.
        ``store_closed``: Store.aclose ends it (before the host memory goes:
        kv22, a stream left open through the close had its later layers
        refused by the engine, BlockUnavailable "access denied", and one
        such failure never retrieved); its next step raises
        ClosedResourceError."""
        if store_closed:
            self._store_closed = True
        if self._closed:
            return
        self._closed = True  # (no window is posted from here on: _open_window)
        posted = self._in_flight()
        try:
            if posted:
                await landed(*posted)
        finally:
            self._closed = False
            self._finish(cancel=False)

    async def aclose(self) -> None:
        await self._close()

    async def __aenter__(self) -> LayerStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    def __del__(self) -> None:
        """A stream dropped unclosed: ``async for`` left by ``break`` (or an
        exception in the loop's body) without aclose/``async with``. CPython
        drops it at the break itself (the loop held the only reference), so
        the code after the loop runs only once this returns: what it posted
        into dst is waited for here, synchronously (a __del__ cannot await),
        by driving the agent's completions until those copies are over. They
        are local copies (the host tier is this agent's own memory), at most
        the window's layers. Where that cannot be done (no running loop, a
        closed agent, a collection inside the agent's own completion drain,
        or the copies still running after _ABANDON_WAIT) they are cancelled
        as before and may still land: only aclose/``async with`` guarantee
        dst is no longer written. The pins go either way.

        Measured (kv20; 8 blocks of 8 MiB, 4 layers, 40 breaks each): left
        after layer 0 nothing is in flight yet (0.05 ms); after layer 1 the
        window's two layers (32 MiB) are: 3.5 ms median, 24 ms max over
        loopback TCP, 0.55 / 38 ms over shared memory, the loop blocked as
        long. A scheduled task instead would not block the loop, but the
        code after the loop would see dst change (test_kv19_stream); a
        shorter bound changes only a stalled engine's case (then the
        copies may land after the break instead). Left as it is."""
        if getattr(self, "_closed", True):
            return
        posted = self._in_flight()
        if posted and not _wait_here(self.store.agent, posted):
            with contextlib.suppress(Exception):  # (at interpreter exit: logging may be gone)
                _log.warning("kv.stream_abandoned", transfers=len(posted),
                             why="a stream dropped unclosed whose copies could not be waited "
                                 "for here: they may still write dst (use aclose or async with)")
        self._finish()


_ABANDON_WAIT = 2.0  # s: how long a dropped stream waits for its copies


def _retrieve(t: asyncio.Future[Any]) -> None:
    if not t.cancelled():
        t.exception()


def _open_window(ref: weakref.ReferenceType[LayerStream]) -> None:
    stream = ref()
    if stream is not None:
        stream._open_window()


def _wait_here(agent: Agent, transfers: list[Transfer]) -> bool:
    """Runs the agent's completions from here (no await) until every one of
    ``transfers`` is done: True, or False where that cannot be done here or
    not within _ABANDON_WAIT. For a caller that cannot await (a __del__)
    and must not return while they may still write memory."""
    if _collecting:
        return False  # inside a collection: maybe inside the drain itself
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False  # not on a loop's thread: its completions are not ours to take
    if agent.closed or getattr(agent, "_loop", loop) is not loop:
        return False
    deadline = time.monotonic() + _ABANDON_WAIT
    try:
        agent.flush()  # (any not yet handed to the engine go now, not at the loop's turn)
        while True:
            agent.poll()
            if all(t.done() for t in transfers):
                return True
            if time.monotonic() > deadline:
                return False
            agent.wait(1000)
    except Exception:  # (a drain already running below us refuses a second one)
        return False


_collecting = False


def _gc_phase(phase: str, info: dict[str, Any]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_gc_phase)


def _eager(t: Transfer) -> None:
    """Has the agent post ``t`` as it posts an awaited transfer, without
    awaiting it: Transfer.__await__'s first step is the agent's eager post
    (awaited alone and small, a same-host copy then completes inside the
    post). The await proper goes through kv.tier.landed, which a cancel does
    not cut short; awaited directly, a cancel would cancel ``t``."""
    t.__await__()


class _Replan(Exception):
    """The pin budget had to wait: plan the get again (the index moved on)."""


async def _owned_read(tier: Tier, fetches: list[_Fetch], op: _Op,
                      release: Any) -> list[XferError | None]:
    """A tier read into store memory, never cancelled midway (see _await_owned)."""
    task = asyncio.ensure_future(tier._read([f.loc for f in fetches],
                                            [f.region for f in fetches],
                                            [f.offset for f in fetches]))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        op.hold_until([task])
        if release is not None:
            task.add_done_callback(lambda _t: release())
        raise


async def _deregister(agent: Agent, region: Region) -> None:
    """Deregisters ``region`` (peers lose access now) and waits for its
    release, at most the agent's ``limits.close_timeout``: a same-host peer
    that maps it and is stopped holds it until that process exits, and the
    close paths run this inside finish_uncancelled, so an unbounded wait
    would be a close no cancel or deadline can end. Past the bound the agent
    keeps the memory pinned until the peer lets go (and quarantines it at its
    own close), so nothing reuses it meanwhile."""
    # agent.deregister returns an awaitable in newer versions: accept both.
    dereg: Any = agent.deregister
    result = dereg(region)
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        fut = asyncio.ensure_future(result)
        limits = getattr(agent, "limits", None)
        bound = getattr(limits, "close_timeout", None)
        try:
            await asyncio.wait_for(asyncio.shield(fut), bound)
        except asyncio.CancelledError:
            # The release goes on (shielded); its late failure is nobody's.
            fut.add_done_callback(retrieve_exception)
            raise
        except TimeoutError:
            fut.add_done_callback(retrieve_exception)  # a late failure: not "never retrieved"
            _log.warning("kv.release_pending", region=region.name, timeout=bound,
                         why="a peer still maps it (a stopped process?): the agent keeps "
                             "it pinned until that peer lets go")


async def _deregister_all(agent: Agent, regions: Sequence[Region | None], event: str,
                          **fields: Any) -> tuple[Exception | None, bool]:
    """A close's deregistrations: every open region of ``regions`` at once
    (each release bounded as in _deregister: one bound in all, not one per
    region), run to their end through a cancel. Failures are logged as
    ``event``; returns the first, and whether a cancel arrived (the caller
    raises it once the rest of its close is done)."""
    open_ = [r for r in regions if r is not None and not r.closed]
    if not open_:
        return None, False
    fut = asyncio.gather(*(_deregister(agent, r) for r in open_), return_exceptions=True)
    cancelled = await finish_uncancelled(fut)
    first: Exception | None = None
    for region, res in zip(open_, fut.result(), strict=True):
        if isinstance(res, Exception):
            _log.warning(event, region=region.name, error=repr(res), **fields)
            first = first or res
    return first, cancelled

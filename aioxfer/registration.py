"""An agent's registered memory: its region table, registration and release.

A collaborator of :class:`aioxfer.Agent` (as asyncpg's ``connect_utils`` is of
its ``Connection``): ``Agent.register``, ``alloc`` and ``deregister`` delegate
here, and so does the release half of ``aclose()``. It registers host buffers,
GPU pointers and shared-memory pools with the engine, names the regions, revokes
them, and gives their memory back only once the engine says no peer can touch
it (the CQ_REGION_FREED event); what a peer still held when the agent closed is
quarantined for good. It reaches the agent only through the narrow arguments it
was built with, never its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import operator
import os
import re
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, Protocol

from aioxfer import _cyx
from aioxfer import cuda as _cuda
from aioxfer.errors import ClosedResourceError, RegistrationError
from aioxfer.local import seal
from aioxfer.log import get_logger
from aioxfer.metadata import CudaExport
from aioxfer.names import MAX_NAME
from aioxfer.region import Region

__all__ = ["Memory", "Pending"]

_log = get_logger("aioxfer")

# Regions a peer could still touch when their agent closed: kept referenced (so
# their buffers are never freed and reused under a stopped peer's copies).
_QUARANTINE: list[Region] = []
_MAX_ALLOC = (1 << 63) - 1  # the largest off_t: a memfd cannot be sized past it
_HUGE = 2 << 20  # a PMD's worth (x86-64, arm64 with 4 KiB pages)


def _advise_huge(mm: mmap.mmap) -> None:
    """Asks for the pool's pages as transparent huge pages, before its first
    touch (the advice only shapes pages allocated after it).

    Honoured only where the host allows shmem THP for advised mappings
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` ``advise``, or
    ``always``/``within_size``); at the default ``never`` it changes nothing.
    Where honoured, every same-host peer maps the pool with one PMD entry per
    2 MiB instead of 512 page-table entries (shm.c map_fd aligns its mapping
    for that): populating a peer's 64 MiB pool took 26-36 us instead of
    2.5-9.9 ms (2 vCPUs, Linux 6.18), connect + first 4 KiB write to it
    2.0-2.3 ms instead of 5.0, and filling it here ~4x less time
    (docs/shm-huge-pages.md).
    Not hugetlbfs: the pages are ordinary shmem, so a hole punched in them
    refills with zeros and never makes a peer take SIGBUS
    (tests/test_shm24_thp.py). A pool touched only sparsely holds a 2 MiB
    page for every 2 MiB range it touched at all; that is what the host's
    setting opts into.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:  # not Linux, or built without THP
        return
    with contextlib.suppress(OSError):  # EINVAL: a kernel without THP
        mm.madvise(advice)


# PEP 3118 struct fields are "<format>:<name>:"; a name may hold any letter.
_FIELD_NAME = re.compile(r":[^:]*:")


def _holds_objects(obj: Any) -> bool:
    """Whether obj's buffer holds PyObject pointers (numpy object arrays and
    structured dtypes with object fields, ctypes py_object arrays): memory
    that peers must never read (addresses) or write (pointers followed)."""
    try:
        with memoryview(obj) as mv:
            fmt = mv.format
    except Exception:  # whatever it raises: the engine's own export reports it, typed
        return False
    return "O" in _FIELD_NAME.sub("", fmt)


class Pending(Protocol):
    """What deregistration needs of the submission path (Submission has it)."""

    def post_pending(self, alone: bool = False) -> None: ...

    def drain_once(self) -> int: ...

    def hold_region(self, rid: int, then: Callable[[], None]) -> bool: ...


class _Released:
    """deregister()'s answer where no event loop runs: already complete."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield

    def done(self) -> bool:
        return True


def _resolve(released: Awaitable[None]) -> None:
    if isinstance(released, asyncio.Future) and not released.done():
        released.set_result(None)


def _release_future() -> Awaitable[None]:
    try:
        return asyncio.get_running_loop().create_future()
    except RuntimeError:  # no loop: nothing can be waiting for it
        return _Released()


class Memory:
    """An agent's regions (see the module docstring).

    ``agent``: its name (errors, logs); ``engine``: the native engine;
    ``new_region(name, rid, key, nbytes, access, addr, obj, ...)``: a Region
    owned by the agent (``Region``'s arguments after the agent); ``pin_cuda``:
    page-lock host regions on the engine's CUDA thread (the agent uses cuda);
    ``changed()``: our advertised regions changed (republish); ``pending``:
    the submission path (deregistration posts what is batched first, and
    before the agent serves, takes the engine's freed event at once);
    ``started()``: whether the agent serves (has an event loop);
    ``closed()``: whether it is closed; ``tag_names``: connection tag -> peer
    name (who held memory at close); ``close_timeout``: seconds ``aclose()``
    waits for peers to release our memory.

    ``regions`` (name -> Region) is the agent's table, shared with its
    LocalBackendHost (file regions are listed in it too); ``generation``
    changes whenever it does (a region listed, dropped, or its memory given
    back): what was made of the table at one generation (our metadata, as
    serving.Server keeps it) is what the table says as long as it is the same.
    """

    __slots__ = (
        "_agent",
        "_engine",
        "_new_region",
        "_pin_cuda",
        "_changed",
        "_pending",
        "_started",
        "_closed",
        "_tag_names",
        "_close_timeout",
        "regions",
        "generation",
        "_freeing",
        "_held_back",
        "_failed",
        "_settled",
        "_shut",
    )

    def __init__(
        self,
        agent: str,
        *,
        engine: _cyx.Engine,
        new_region: Callable[..., Region],
        pin_cuda: bool,
        changed: Callable[[], None],
        pending: Pending,
        started: Callable[[], bool],
        closed: Callable[[], bool],
        tag_names: Mapping[int, str],
        close_timeout: float,
    ) -> None:
        self._agent = agent
        self._engine = engine
        self._new_region = new_region
        self._pin_cuda = pin_cuda
        self._changed = changed
        self._pending = pending
        self._started = started
        self._closed = closed
        self._tag_names = tag_names
        self._close_timeout = close_timeout
        self.regions: dict[str, Region] = {}
        self.generation = 0
        self._freeing: dict[int, Region] = {}  # deregistered, memory still ours to release
        # Deregistered, the engine's deregistration held back until transfers
        # made before it, still waiting for a peer's scheduler, are over
        # (Submission.hold_region); also in _freeing.
        self._held_back: dict[int, Region] = {}
        # Deregistered, the engine's deregistration refused (also in
        # _freeing): their memory waits for the engine's release (_deregister_failed).
        self._failed: set[int] = set()
        self._settled: asyncio.Event | None = None  # release_all: set on each freed region
        self._shut = False  # close() ran: the engine shut down, every region given back

    # ------------------------------------------------------------ names

    def check_open(self) -> None:
        if self._closed():
            raise ClosedResourceError(f"agent {self._agent!r} is closed")

    def check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise RegistrationError("a region name must be a non-empty string")
        # A region's name travels in our metadata, whose decoder refuses a
        # name over MAX_NAME: a longer one made every peer's connect fail
        # (ProtocolError) and close wait for nothing. (Its characters are
        # free: a peer's region names reach logs escaped, aioxfer.log.)
        if len(name) > MAX_NAME:
            raise RegistrationError(
                f"a region name must be at most {MAX_NAME} characters, not {len(name)}")
        if name in self.regions:
            raise RegistrationError(
                f"agent {self._agent!r} already has a region named {name!r}; "
                f"deregister it first or choose another name"
            )

    def default_name(self, rid: int, prefix: str = "region") -> str:
        """prefix-rid, made unique among the agent's regions."""
        name, k = f"{prefix}-{rid}", 1
        while name in self.regions:
            name, k = f"{prefix}-{rid}-{k}", k + 1
        return name

    def add_region(self, region: Region) -> None:
        """A region registered elsewhere (a file region): listed, released at
        close, never advertised."""
        self.regions[region.name] = region
        self.generation += 1

    # ------------------------------------------------------------ registration

    def register(self, obj: Any, name: str | None) -> Region:
        """Agent.register: a buffer, or GPU memory (see aioxfer.cuda)."""
        try:
            mem = _cuda.inspect(obj)
        except ValueError as exc:
            raise RegistrationError(f"cannot register {type(obj).__name__}: {exc}") from None
        except (TypeError, KeyError, RuntimeError, BufferError) as exc:
            # What the object's own protocol raised: a torch tensor that
            # requires grad refuses __cuda_array_interface__ / __dlpack__
            # with RuntimeError, a malformed interface dict is a KeyError.
            # A RegistrationError (it escaped bare), the cause kept.
            raise RegistrationError(
                f"cannot register {type(obj).__name__}: {type(exc).__name__}: {exc}"
            ) from exc
        if mem is not None:
            return self._register_pointer(obj, mem, name)
        return self._register(obj, name)

    def _register_pointer(self, obj: Any, mem: _cuda.GpuMemory, name: str | None) -> Region:
        self.check_open()
        if name is not None:
            self.check_name(name)
        what = f"cannot register {type(obj).__name__} ({mem.kind} memory, {mem.nbytes} bytes)"
        export = None
        devbuf = None
        if mem.kind == "cuda":
            ok, why = _cuda.status()
            if not ok:
                raise RegistrationError(f"{what}: CUDA is not available: {why}")
            try:
                _, base, _ = _cyx.cuda_pointer(mem.ptr, mem.nbytes)
            except _cyx.NativeError as exc:
                raise RegistrationError(f"{what}: {exc}") from None
            # Memory of a DeviceBuffer, by whatever object it came (itself, a
            # DevicePointer into it, a tensor over it): the buffer's close()
            # must wait for this region's release too, or it frees memory
            # the engine (a copy, a peer's IPC mapping) still reaches.
            devbuf = _cuda.buffer_at(base)
            if devbuf is not None and devbuf._closing:
                raise RegistrationError(f"{what}: its DeviceBuffer is closed")
            try:
                handle, offset, device = _cyx.cuda_export(mem.ptr)
                export = CudaExport(handle=handle, offset=offset, device=device)
            except _cyx.NativeError as exc:
                # Still usable locally (and by RDMA); same-host peers cannot map it.
                _log.warning("region.no_cuda_ipc", agent=self._agent, error=str(exc))
        access = _cyx.ACCESS_READ | (0 if mem.readonly else _cyx.ACCESS_WRITE)
        kind = _cyx.MEM_CUDA if mem.kind == "cuda" else _cyx.MEM_HOST
        try:
            rid, key = self._engine.register_kind(kind, mem.ptr, mem.nbytes, access, obj)
        except _cyx.NativeError as exc:
            raise RegistrationError(f"{what}: {exc}") from None
        if name is None:
            name = self.default_name(rid)
        region = self._new_region(name, rid, key, mem.nbytes, access, mem.ptr, obj)
        region.kind = mem.kind
        region._cuda = export
        if devbuf is not None:
            region._devbuf = devbuf
            devbuf._regions.add(id(region))  # its close() frees after _release_memory
        self.regions[name] = region
        self.generation += 1
        if self._pin_cuda and mem.kind == "host":
            # As _register's: page-locked now, on the engine's CUDA thread,
            # not at its first GPU copy (which pins it otherwise: speed, not
            # correctness; that copy would wait for the pinning, and until it
            # is pinned none goes the caller's fast path).
            self._engine.cuda_pin_region(rid)
        self._changed()
        return region

    def alloc(self, nbytes: int, name: str | None) -> Region:
        """Agent.alloc: a new zeroed, sealed memfd mapped shared."""
        self.check_open()
        try:  # an integer (of any kind), never a float or str quietly truncated
            nbytes = operator.index(nbytes)
        except TypeError:
            raise TypeError(f"alloc takes a number of bytes, not {nbytes!r}") from None
        if nbytes <= 0:
            raise RegistrationError(f"cannot allocate {nbytes} bytes: size must be positive")
        if nbytes > _MAX_ALLOC:
            # past off_t, ftruncate raises OverflowError (not an OSError) and
            # the memfd just created would leak
            raise RegistrationError(f"cannot allocate {nbytes} bytes: more than {_MAX_ALLOC}")
        if name is not None:
            self.check_name(name)
        # The memfd's label is only a name in /proc: a NUL (fine in a region
        # name) would make memfd_create raise ValueError.
        label = f"aioxfer:{self._agent}:{name or 'alloc'}".replace("\0", "?")[:200]
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise RegistrationError(f"cannot create a memfd of {nbytes} bytes: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            # Its size is fixed for good, so a peer mapping it can never take
            # SIGBUS (peers refuse memfds without these seals).
            seal(fd)
            if nbytes >= _HUGE and os.environ.get("AIOXFER_SHM_HUGE", "1") != "0":
                # 2 MiB pages whatever the host's shmem_enabled says (short of
                # "deny"): a same-host peer then maps the pool by one PMD per
                # 2 MiB, not 512 PTEs: ~0.2 ms of connecting to a 64 MiB pool
                # instead of 2-4 ms (shm.c axf_shm_make_huge). The pool's memory
                # is allocated now, not at first touch. AIOXFER_SHM_HUGE=0: not.
                _cyx.shm_make_huge(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError, ValueError) as exc:
            os.close(fd)
            raise RegistrationError(f"cannot map a memfd of {nbytes} bytes: {exc}") from exc
        if nbytes >= _HUGE:
            _advise_huge(mm)
        try:
            return self._register(mm, name, memfd=fd, ino=os.fstat(fd).st_ino, mm=mm)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    def _register(
        self,
        obj: Any,
        name: str | None,
        *,
        memfd: int = -1,
        ino: int = 0,
        mm: mmap.mmap | None = None,
    ) -> Region:
        self.check_open()
        if name is not None:
            self.check_name(name)
        if _holds_objects(obj):
            raise RegistrationError(
                f"cannot register {type(obj).__name__}: its items are Python object "
                f"references (format 'O'), not bytes: a peer reading it would see heap "
                f"addresses, and one writing it would plant pointers this process follows"
            )
        try:
            rid, key, addr, nbytes, access = self._engine.register(obj, memfd)
        except ValueError as exc:
            raise RegistrationError(f"cannot register {type(obj).__name__}: {exc}") from None
        except (TypeError, BufferError) as exc:
            raise RegistrationError(
                f"cannot register {type(obj).__name__}: not a contiguous buffer ({exc})"
            ) from None
        except _cyx.NativeError as exc:
            raise RegistrationError(f"cannot register {type(obj).__name__}: {exc}") from None
        if name is None:
            name = self.default_name(rid)
        region = self._new_region(name, rid, key, nbytes, access, addr, obj, memfd, ino, mm)
        self.regions[name] = region
        self.generation += 1
        if self._pin_cuda:
            # Page-locked now, on the engine's CUDA thread, so a GPU copy to or
            # from it is asynchronous and its first one pays no pinning.
            self._engine.cuda_pin_region(rid)
        self._changed()
        return region

    # ------------------------------------------------------------ release

    def deregister(self, region: Region) -> Awaitable[None]:
        """Agent.deregister, for a region of this agent (the agent checked)."""
        if region._released is not None:
            return region._released
        region._closed = True
        if self.regions.get(region.name) is region:
            del self.regions[region.name]
        self.generation += 1
        released = region._released = _release_future()
        if self._closed():
            if not self._shut and region.rid not in self._freeing:
                # The agent closes, its engine not shut down yet (aclose()
                # still awaits its backends, its tasks): the engine still has
                # the region, and peers may reach it. Its memory is given
                # back, and this resolved, by close(), as for every region
                # (dropped here, it was never given back: rv31b).
                self._freeing[region.rid] = region
            else:
                _resolve(released)
            return released
        self._freeing[region.rid] = region
        try:
            # Transfers posted before this call but still batched for the
            # next flush are "already using it": they go to the engine
            # first, so they finish rather than fail against a region that
            # vanished under them.
            self._pending.post_pending()
        finally:
            # Also when that post re-raised a drain callback's error (all
            # was posted): the region has left our table, so it must leave
            # the engine too, or peers would reach it for good and
            # `released` never complete.
            self._release_engine(region)
        return released

    def _release_engine(self, region: Region) -> None:
        """deregister(), once what was batched is posted: the engine's
        deregistration, or, while transfers that use the region still wait
        for a peer's scheduler, its revocation now and the deregistration
        once they are over."""
        rid = region.rid
        released = region._released
        assert released is not None
        if self._pending.hold_region(rid, lambda: self._deregister_held(rid)):
            # Some wait in a peer's scheduler (over its limits): the engine
            # keeps the region for them until they are over. Peers lose it
            # now: it is gone from our table and metadata, their accesses
            # fail as for a deregistered region, and each is told to forget
            # it (the engine's revocation).
            self._held_back[rid] = region
            try:
                self._engine.revoke(rid)
            except (ValueError, _cyx.NativeError) as exc:
                # Not revoked (out of memory): the queued transfers must not
                # keep it reachable. Deregistered now: they fail as if the
                # region had gone before they were made.
                self._held_back.pop(rid, None)
                _log.warning("region.revoke_failed", agent=self._agent, region=region.name,
                             error=str(exc))
            else:
                self._changed()
                return
        try:
            self._engine.deregister(rid)
        except (ValueError, _cyx.NativeError) as exc:
            raise self._deregister_failed(region, exc) from None
        finally:
            self._changed()  # it is gone from our metadata either way
        if not self._started():
            self._pending.drain_once()  # not serving yet: no peer; the engine freed it already

    def _deregister_held(self, rid: int) -> None:
        """The transfers a deregistration waited for are over (or the agent
        closes): the engine's deregistration now. Runs from the loop, where
        nobody can take its error: logged, and the awaitable resolved (as
        deregister() does before raising), the memory left to the engine's
        close."""
        region = self._held_back.pop(rid, None)
        if region is None or self._closed():
            return  # done already (release_all did it), or the engine is gone
        try:
            self._engine.deregister(rid)
        except (ValueError, _cyx.NativeError) as exc:
            _log.warning("region.deregister_failed", agent=self._agent, region=region.name,
                         error=str(exc))
            self._deregister_failed(region, exc)

    def _deregister_failed(self, region: Region, exc: Exception) -> RegistrationError:
        """The engine refused region's deregistration (out of memory, or a
        region it does not know). Its memory is not given back now: the
        engine may still hold it, and a copy or a peer still reach it. It
        stays among the regions being freed: released at the engine's
        CQ_REGION_FREED if one still comes, else by the agent's close
        (release_all asks the engine again; its shutdown frees every region
        before close() gives the memory back). Its deregister() awaitable
        fails now with the error returned (raised by deregister() itself, or
        logged): awaiting it ends, typed. (It completed as a success before,
        and the region's memory was never given back: a DeviceBuffer of it
        stayed allocated after its close(), for good.)"""
        self._failed.add(region.rid)
        err = RegistrationError(
            f"cannot deregister region {region.name!r}: {exc}; its memory is released "
            f"once the engine releases it (at the latest when the agent closes)"
        )
        released = region._released
        if isinstance(released, asyncio.Future) and not released.done():
            released.set_exception(err)
            released.exception()  # told already (raised or logged): never logged again as lost
        return err

    def freed(self, rid: int) -> None:
        """The engine's CQ_REGION_FREED: no peer can touch region rid any more."""
        region = self._freeing.pop(rid, None)
        self._failed.discard(rid)
        if region is not None:
            err = self._release_memory(region)
            released = region._released
            if err is not None and isinstance(released, asyncio.Future) and not released.done():
                released.set_exception(err)
                released.exception()  # logged already; awaiting it still raises
            elif released is not None:
                _resolve(released)
        if self._settled is not None:
            self._settled.set()

    async def release_all(self) -> None:
        """aclose(): deregisters every region and waits, bounded by
        close_timeout, until peers released them; what a peer still holds then
        is quarantined (named in a warning). Returns at once with nothing to do.
        Cancelled while waiting, it quarantines the same way, then raises
        CancelledError (the agent closes anyway: the memory must stay put)."""
        if not (self.regions or self._freeing):
            return
        for region in list(self.regions.values()):
            with contextlib.suppress(RegistrationError):
                self.deregister(region)
        # Held back for transfers that waited in a scheduler: the agent
        # failed those (Submission.fail_pending); any admitted meanwhile is
        # posted, and the engine's count of its ops holds the region.
        for rid in list(self._held_back):
            self._deregister_held(rid)
        # Refused by the engine before (out of memory): asked again, so that
        # peers are told and waited for as for the others; refused again,
        # the engine's shutdown frees it (and close() gives its memory back).
        for rid in list(self._failed):
            with contextlib.suppress(ValueError, _cyx.NativeError):
                self._engine.deregister(rid)
                self._failed.discard(rid)
        self._settled = asyncio.Event()
        try:
            async with asyncio.timeout(self._close_timeout):
                while self._held():
                    self._settled.clear()
                    await self._settled.wait()
        except TimeoutError:
            pass
        finally:
            self._settled = None
            self._quarantine_held()

    def _quarantine_held(self) -> None:
        """Regions a peer still holds are kept referenced for good (named)."""
        held = self._held()
        if held:
            names = sorted({self._tag_names.get(t, f"tag-{t}") for tags in held.values()
                            for t in tags})
            for rid in held:
                if rid in self._freeing:
                    region = self._freeing.pop(rid)
                    _QUARANTINE.append(region)  # its buffer is never released
                    self._gave_up(region, names)
            _log.warning("agent.close_gave_up", agent=self._agent, peers=names,
                         regions=len(held), timeout=self._close_timeout,
                         reason="peers that could still touch our memory did not release it")

    def _gave_up(self, region: Region, peers: list[str]) -> None:
        """A quarantined region's deregister() awaitable: it never completes
        as released (the memory is pinned for good, never to be reused), and
        a task awaiting it must not hang: ClosedResourceError."""
        released = region._released
        if isinstance(released, asyncio.Future) and not released.done():
            released.set_exception(ClosedResourceError(
                f"agent {self._agent!r} closed while {', '.join(peers)} could still touch "
                f"region {region.name!r}: its memory stays pinned for the life of this process"
            ))
            # Marked retrieved: nobody need await it, and the quarantine
            # keeps it referenced only until the interpreter's exit clears
            # _QUARANTINE, where an unretrieved exception was logged
            # ("Future exception was never retrieved", once per region).
            # A task awaiting it still gets the error.
            released.exception()

    def _held(self) -> dict[int, list[int]]:
        """Deregistered regions some connection still holds: rid -> tags."""
        held: dict[int, list[int]] = {}
        for rid in self._freeing:
            tags = self._engine.region_holders(rid)
            if tags:
                held[rid] = tags
        return held

    def close(self) -> None:
        """The engine has shut down (it freed every region): closes what is
        left and gives its memory back."""
        self._shut = True
        self.generation += 1
        for region in list(self.regions.values()):
            region._closed = True
            self._release_memory(region)
        self.regions.clear()
        for region in list(self._freeing.values()):
            err = self._release_memory(region)
            released = region._released
            if err is not None and isinstance(released, asyncio.Future) and not released.done():
                released.set_exception(err)
                released.exception()  # logged already
            elif released is not None:
                # The engine's shutdown freed it: no peer reaches it now,
                # whether or not its CQ_REGION_FREED came before.
                _resolve(released)
        self._freeing.clear()
        self._held_back.clear()
        self._failed.clear()

    def _release_memory(self, region: Region) -> RegistrationError | None:
        """Gives region's memory back (the engine released it). Never
        raises: where a DeviceBuffer's deferred free fails (a driver poisoned
        by a sticky error), that is logged and returned, as the error its
        deregister() awaitable ends with, after everything else went."""
        err = None
        devbuf, region._devbuf = region._devbuf, None
        if devbuf is not None:
            try:
                devbuf._released(id(region))  # a close() deferred frees it now
            except _cyx.NativeError as exc:
                # Raised into the drain, it left the rest of this release
                # undone and the awaitable unresolved for good.
                _log.warning("region.device_free_failed", agent=self._agent,
                             region=region.name, error=str(exc))
                err = RegistrationError(
                    f"region {region.name!r} was released, but freeing its DeviceBuffer "
                    f"failed: {exc}"
                )
        mm, fd = region._mmap, region._memfd
        region._mmap = None
        region._memfd = -1
        self.generation += 1  # (its memfd's number may be reused from here)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # The caller still holds views of it: it is unmapped when they go.
                _log.debug("region.views_alive", agent=self._agent, region=region.name)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        return err

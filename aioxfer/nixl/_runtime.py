"""The event loop the NIXL layer runs its aioxfer agents on.

NIXL's API is synchronous and is called from any thread (vLLM drives one agent
from its engine thread, a handshake executor and a writer thread). aioxfer's
agents live on one asyncio loop. This module owns that loop, on a daemon
thread, and one re-entrant lock, ``Runtime.lock``, that makes the agents
single-threaded again:

- the loop thread holds the lock whenever it runs anything; it lets go only
  while it sleeps in ``select`` (the selector below wraps the real one);
- a caller's thread takes the lock and then calls the agents directly (post a
  transfer, read notifications, register memory) as if it were the loop
  thread. A small transfer is then posted, copied and completed inside the
  caller's own call: no thread hop, no wake-up of the loop thread.

Only awaiting (connect, refresh, a notification round trip) runs on the loop
thread, through ``run`` / ``spawn``, and never with the lock held by the caller.
Callbacks that a caller's critical section scheduled on the loop (``call_soon``
from a foreign thread does not wake the loop) are noticed by the loop class
below and the loop is woken when the section ends.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import math
import os
import select
import selectors
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from aioxfer import _cyx

T = TypeVar("T")

__all__ = ["Runtime", "runtime"]


class _Claim:
    """A caller's hold on an fd the loop thread watches (see claim)."""

    __slots__ = ("active", "until", "linger")

    def __init__(self) -> None:
        self.active = 0
        self.until = 0.0  # while not active: the loop thread takes it back then
        self.linger = 0.0


class _LockedSelector(selectors.BaseSelector):
    """The loop's selector: releases the runtime lock while it waits, tells
    waiting pollers that a round of callbacks has finished, and lets callers
    take fds away from the loop thread for a while (claim)."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._inner = selectors.EpollSelector()
        self._claims: dict[int, _Claim] = {}
        # When the loop thread will wake by itself (inf: not before an event;
        # 0.0: it is awake). Read by callers with the lock held.
        self.sleep_until = 0.0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = self._inner.unregister(fileobj)
        self._claims.pop(key.fd, None)  # its number may come back for another fd
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = self._inner.modify(fileobj, events, data)
        if key.fd in self._claims:
            self._epoll().modify(key.fd, 0)  # still claimed: asyncio's change waits
        return key

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.get_key(fileobj)

    def get_map(self) -> Any:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()

    def claim(self, fd: int) -> bool:
        """Stops the loop thread from waking for ``fd`` (a caller waits on it
        itself) until ``release``; nestable. Runtime lock held. Only the
        kernel's interest set changes: the registration asyncio knows stays,
        so no stale handle can outlive it. An fd released with a linger and
        claimed again within it costs no system call."""
        c = self._claims.get(fd)
        if c is None:
            try:
                self._inner.get_key(fd)
            except (KeyError, ValueError):
                return False
            c = self._claims[fd] = _Claim()
            self._epoll().modify(fd, 0)
        c.active += 1
        return True

    def release(self, fd: int, linger: float = 0.0) -> None:
        """Ends a claim (runtime lock held). With ``linger`` > 0 the loop
        thread takes the fd back only after that many seconds without a new
        claim: a caller polling in a loop keeps it (a completion then wakes
        that caller only, and the loop thread stays asleep), and one that
        stops polling hands it back soon."""
        c = self._claims.get(fd)
        if c is None:
            return
        c.active -= 1
        if c.active > 0:
            return
        if linger <= 0.0:
            self._restore(fd)
            return
        c.linger = linger
        c.until = time.monotonic() + linger
        if self.sleep_until > c.until + linger:
            # The loop thread sleeps past the linger (with no timer, for
            # ever): wake it once so that it sets its timeout by it. Later
            # lingers of a busy poller only move ``until`` on.
            self.sleep_until = 0.0
            self._rt.wake()

    def _restore(self, fd: int) -> None:
        self._claims.pop(fd, None)
        try:
            key = self._inner.get_key(fd)
        except (KeyError, ValueError):
            return  # unregistered meanwhile (the agent closed)
        mask = (select.EPOLLIN if key.events & selectors.EVENT_READ else 0) | (
            select.EPOLLOUT if key.events & selectors.EVENT_WRITE else 0)
        self._epoll().modify(fd, mask)

    @property
    def lingering(self) -> bool:
        return bool(self._claims)

    def expire_all(self) -> None:
        """Gives back every claim no caller holds now (lock held)."""
        for fd, c in list(self._claims.items()):
            if not c.active:
                self._restore(fd)

    def _expire(self, now: float) -> float:
        """Gives back lingering claims that are due; when to look again
        (inf: no need)."""
        first = math.inf
        for fd, c in list(self._claims.items()):
            if c.active:
                # Held now; look again a linger later (rather than be woken
                # when it is released).
                if c.linger and now + c.linger < first:
                    first = now + c.linger
                continue
            if c.until <= now:
                self._restore(fd)
            elif c.until < first:
                first = c.until
        return first

    def _epoll(self) -> Any:
        return self._inner._selector  # type: ignore[attr-defined]

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        rt = self._rt
        rt._round_done()
        now = time.monotonic()
        due = self._expire(now) if self._claims else math.inf
        if due != math.inf:
            wait = max(0.0, due - now)
            timeout = wait if timeout is None or timeout < 0 else min(timeout, wait)
        self.sleep_until = math.inf if timeout is None or timeout < 0 else now + timeout
        rt.lock.release()
        try:
            return self._inner.select(timeout)
        finally:
            rt.lock.acquire()
            self.sleep_until = 0.0


# An agent's end-of-iteration flush (Submission._flush, bound): what a post
# from a caller's thread schedules; the compat layer flushes itself right after
# (one call), so the scheduled one finds nothing and needs no wake-up.
_FLUSH = _cyx.submission_scheduled_flush


class _Loop(asyncio.SelectorEventLoop):
    """Notes callbacks scheduled from another thread (a caller holding the
    runtime lock), so that the runtime wakes the loop for them; all but an
    agent's flush (_FLUSH). The callers' posts used to clear the mark after
    their own flush instead, which also dropped the wake-up for other
    transfers' completions their drain had scheduled (rev19 #5: a
    future()/await user waited up to ~20 ms, the loop asleep until a
    poller's claim lingered out)."""

    _rt: Runtime

    def call_soon(self, callback: Any, *args: Any, **kwargs: Any) -> asyncio.Handle:  # type: ignore[override]
        if (threading.get_ident() != self._rt.loop_ident
                and getattr(callback, "__func__", None) is not _FLUSH):
            self._rt._foreign = True
        return super().call_soon(callback, *args, **kwargs)

    def call_at(self, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:  # type: ignore[override]
        if threading.get_ident() != self._rt.loop_ident:
            self._rt._foreign = True
        return super().call_at(*args, **kwargs)


class Runtime:
    """One loop thread per process, started on first use."""

    # (Slots: the callers' hot paths read and write _foreign and lock once
    # per request.)
    __slots__ = ("lock", "_local", "_foreign", "_round", "_round_fd", "_waiters_lock",
                 "_round_waiters", "loop_ident", "_closers", "_closing", "selector",
                 "loop", "thread")

    def __init__(self) -> None:
        # (threading.RLock's semantics; its acquire and release are plain C
        # calls for the compiled hot paths: _cyx._lock_acquire.)
        self.lock = _cyx.RLock()
        self._local = threading.local()
        self._foreign = False
        self._round = 0
        # Written by the loop thread after a round of callbacks while a poller
        # waits (see yield_to_loop).
        self._round_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._waiters_lock = threading.Lock()
        self._round_waiters = 0
        self.loop_ident = -1
        self._closers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closing: set[asyncio.Task[Any]] = set()  # closes of agents already dropped
        # (Public: a poller claims and releases through it, without this
        # class's wrappers.)
        self.selector = _LockedSelector(self)
        self.loop = _Loop(self.selector)
        self.loop._rt = self
        self.loop.set_debug(False)  # debug mode forbids what the lock makes safe
        started = threading.Event()
        self.thread = threading.Thread(
            target=self._main, args=(started,), name="aioxfer-nixl-loop", daemon=True
        )
        self.thread.start()
        started.wait()
        atexit.register(self._at_exit)

    def _main(self, started: threading.Event) -> None:
        self.lock.acquire()
        self.loop_ident = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        started.set()
        try:
            self.loop.run_forever()
        finally:
            self.lock.release()

    # ------------------------------------------------------------ callers' side

    def on_loop(self) -> bool:
        return threading.get_ident() == self.loop_ident

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the lock: the agents may be used directly. Wakes the loop on
        exit if the section scheduled callbacks on it."""
        local = self._local
        self.lock.acquire()
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            yield
        finally:
            local.depth = depth
            wake = self._foreign and depth == 0 and not self.on_loop()
            if wake:
                self._foreign = False
            self.lock.release()
            if wake:
                self.wake()

    def claim(self, fd: int) -> bool:
        """See _LockedSelector.claim (lock held)."""
        return self.selector.claim(fd)

    def release(self, fd: int, linger: float = 0.0) -> None:
        """See _LockedSelector.release (lock held)."""
        self.selector.release(fd, linger)

    def expire_lingering(self) -> None:
        """Gives the loop thread back every fd no caller waits on now (lock
        held): for what only the loop thread will take."""
        if self.selector.lingering:
            self.selector.expire_all()

    def leave(self) -> None:
        """Releases a lock taken by hand (``lock.acquire()``), waking the loop
        if the section scheduled callbacks on it: the hot paths' cheaper
        ``locked()``."""
        wake = self._foreign and threading.get_ident() != self.loop_ident
        if wake:
            self._foreign = False
        self.lock.release()
        if wake:
            self.wake()

    def wake(self) -> None:
        self.loop.call_soon_threadsafe(_nothing)

    def _holds_lock(self) -> bool:
        return getattr(self._local, "depth", 0) > 0 or self.on_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coro`` on the loop and waits for its result (from a caller's
        thread that does not hold the lock)."""
        if self._holds_lock():
            coro.close()
            raise RuntimeError(
                "aioxfer.nixl: a blocking call from the loop thread or with the runtime lock held"
            )
        if self.selector.lingering:
            # What coro awaits may come through an fd a poller's claim still
            # keeps from the loop thread: give those back now.
            with self.lock:
                self.selector.expire_all()
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            # (On 3.11 that is the builtin TimeoutError: the coroutine's own
            # one too. A finished future raised it itself, or finished just
            # after the wait gave up: its result or error as it is, and
            # nothing to cancel.)
            if fut.done():
                return fut.result()
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Starts ``coro`` as a task on the loop; call with the lock held."""
        task = self.loop.create_task(coro)
        self._foreign = not self.on_loop() or self._foreign
        return task

    # ------------------------------------------------------------ polling

    def _round_done(self) -> None:
        # Called by the loop thread (lock held) before each select.
        self._round += 1
        if self._round_waiters:
            os.eventfd_write(self._round_fd, 1)

    def yield_to_loop(self, timeout: float = 0.001,
                      ready: Callable[[], bool] | None = None) -> None:
        """A caller polling in a tight loop sleeps (without the GIL, so a loop
        thread woken by a completion takes it at once rather than after the
        interpreter's switch interval) until the loop thread finishes a round
        of callbacks, at most ``timeout`` seconds; at once if ``ready()`` (what
        the caller waits for) is already true once it is registered as
        waiting, so that a round that finished just before is not waited for."""
        if self._holds_lock():
            return
        start = self._round
        with self._waiters_lock:
            self._round_waiters += 1
        try:
            if self._round != start or (ready is not None and ready()):
                return
            got, _, _ = select.select([self._round_fd], [], [], timeout)
            if got:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._round_fd)
        finally:
            with self._waiters_lock:
                self._round_waiters -= 1

    # ------------------------------------------------------------ exit

    def add_closer(self, obj: Any) -> None:
        """``obj._close_at_exit()`` (a coroutine function) runs at interpreter
        exit if obj is still alive, so peers see a clean leave."""
        self._closers.add(obj)

    def track_closing(self, task: asyncio.Task[Any]) -> None:
        """A close begun for an agent nobody holds any more (loop thread):
        the exit waits for it as for the others."""
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _at_exit(self) -> None:
        closers = list(self._closers)

        async def close_all() -> None:
            # (Here, on the loop, the closes scheduled before are tracked.)
            await asyncio.gather(*(c._close_at_exit() for c in closers), *self._closing,
                                 return_exceptions=True)

        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.run(close_all(), timeout=10.0)
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5.0)


def _nothing() -> None:
    pass


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """The process's runtime, started on first use (in a forked child: its
    own, see _forget_after_fork)."""
    global _runtime
    rt = _runtime
    if rt is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime()
            rt = _runtime
    return rt


def _forget_after_fork() -> None:
    """In the child of os.fork(): the parent's runtime is forgotten, and the
    child's first use of aioxfer.nixl starts a runtime of its own (a loop
    thread, a lock, a new agent's engine).

    The child has only the forking thread: the parent's loop thread, and
    every agent's engine threads, do not exist there, and the runtime lock
    may be held by a thread that is gone. Objects made before the fork (a
    nixl_agent, its handles and descriptor lists) keep the parent's runtime
    and engine and cannot be used in the child (a call may block or fail);
    make new agents there. (Before this, the child's first agent waited on
    the parent's loop for 2 x AIOXFER_NIXL_CONNECT_TIMEOUT, then raised
    TimeoutError: rev19 #2.) Nothing of the parent's runtime is closed or
    freed here: the parent still uses it, and what the child holds of it
    (fds, memory) goes with the child."""
    global _runtime, _runtime_lock
    _runtime = None
    _runtime_lock = threading.Lock()  # (a thread of the parent may have held it)


os.register_at_fork(after_in_child=_forget_after_fork)


async def wait_bounded(aw: Awaitable[T], timeout: float) -> T:
    return await asyncio.wait_for(aw, timeout)


def monotonic_us() -> int:
    return time.perf_counter_ns() // 1000

"""aioxfer.nixl's runtime lock (_cyx.RLock): threading.RLock's semantics."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from aioxfer import _cyx
from aioxfer.nixl._runtime import runtime


def test_runtime_lock_is_the_compiled_rlock() -> None:
    assert type(runtime().lock) is _cyx.RLock


def test_reentrant_and_owned_by_its_thread() -> None:
    lock = _cyx.RLock()
    assert not lock._is_owned()
    assert lock.acquire(blocking=False) and lock.acquire() and lock.acquire(False)
    assert lock._is_owned()
    got: list[object] = []

    def other() -> None:
        got.append(lock.acquire(blocking=False))
        got.append(lock.acquire(timeout=0.02))
        got.append(lock._is_owned())
        try:
            lock.release()
        except RuntimeError as exc:
            got.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert got[:3] == [False, False, False] and isinstance(got[3], RuntimeError)
    lock.release()
    lock.release()
    assert lock._is_owned()  # (acquired three times: released twice)
    lock.release()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError):
        lock.release()
    with pytest.raises(ValueError):
        lock.acquire(False, 1.0)
    with pytest.raises(ValueError):
        lock.acquire(timeout=-2)


def test_blocking_acquire_waits_for_the_release() -> None:
    lock = _cyx.RLock()
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait()

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    assert not lock.acquire(timeout=0.01)
    threading.Timer(0.05, release.set).start()
    assert lock.acquire()  # (blocks, the GIL released: the holder runs)
    assert lock._is_owned()
    lock.release()
    t.join()


def test_blocking_acquire_runs_signal_handlers() -> None:
    # A signal's handler runs while the main thread waits for the lock; its
    # exception ends the wait, as threading.RLock's acquire does.
    lock = _cyx.RLock()
    held = threading.Event()
    done = threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            done.wait(10)

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            lock.acquire()
        assert time.monotonic() - t0 < 5
        assert not lock._is_owned()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        done.set()
        t.join()
    assert lock.acquire(timeout=5)
    lock.release()

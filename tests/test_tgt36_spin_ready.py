"""The handshake's polls (protocol._spin_recv_into, hello_peek_now,
server_answer_now) look at asyncio's ready queue to leave the loop to
callbacks that will run; a handle cancelled after it was queued never runs
(the loop pops and skips it), so it does not stop a poll (tgt36: a timer of
an agent closed before the connect, seen on every handshake read of the
next one). A live callback still does, and so does one that another thread
adds while the queue is looked at.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from aioxfer import protocol


def _noop() -> None:
    pass


async def test_a_cancelled_handle_does_not_stop_the_poll() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        b.sendall(b"xy")
        h = loop.call_soon(_noop)
        h.cancel()  # (still in loop._ready, as a due timer cancelled after it fell due)
        assert loop._ready  # type: ignore[attr-defined]
        buf = bytearray(8)
        # On the base this was -1 (any handle in the queue): the read then
        # waited for a wake-up of the loop.
        assert protocol._spin_recv_into(loop, a, memoryview(buf), 10**9) == 2
        assert bytes(buf[:2]) == b"xy"
        live = loop.call_soon(_noop)  # a callback that will run: no poll
        b.sendall(b"z")
        assert protocol._spin_recv_into(loop, a, memoryview(buf), 10**9) == -1
        live.cancel()
        assert protocol._spin_recv_into(loop, a, memoryview(buf), 10**9) == 1
    finally:
        a.close()
        b.close()


async def test_a_cancelled_timer_due_does_not_stop_a_handshake_read() -> None:
    """The case met: a timer cancelled after the loop moved it, due, into
    its ready queue (a callback that ran before it in the same pass cancels
    it). The read that follows in that pass polls and gets its bytes."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    seen: list[object] = []
    try:
        b.sendall(b"abcd")
        done: asyncio.Future[None] = loop.create_future()
        late = loop.call_later(0.002, _noop)

        def first() -> None:
            late.cancel()
            seen.append(any(x is late for x in loop._ready))  # type: ignore[attr-defined]
            buf = bytearray(4)
            seen.append(protocol._spin_recv_into(loop, a, memoryview(buf), 10**9))
            done.set_result(None)

        loop.call_later(0.001, first)
        # The loop held past both: the next pass moves both, first then late.
        loop.call_soon(time.sleep, 0.01)
        await asyncio.wait_for(done, 5)
        assert seen == [True, 4]
    finally:
        a.close()
        b.close()


def test_others_ready() -> None:
    loop = asyncio.new_event_loop()
    try:
        q = loop._ready  # type: ignore[attr-defined]
        assert not protocol._others_ready(q)
        h = loop.call_soon(_noop)
        assert protocol._others_ready(q)
        h.cancel()
        assert not protocol._others_ready(q)
        h2 = loop.call_soon(_noop)
        assert protocol._others_ready(q)
        h2.cancel()
        assert not protocol._others_ready(q)
    finally:
        loop.close()


def test_a_queue_changed_while_looked_at_counts_as_ready() -> None:
    """call_soon_threadsafe appends to the queue from another thread; a
    look that meets the deque changing says ready (never an error)."""
    loop = asyncio.new_event_loop()
    try:
        for _ in range(1000):
            loop.call_soon(_noop).cancel()
        stop = threading.Event()

        def add() -> None:
            while not stop.is_set():
                loop.call_soon_threadsafe(_noop).cancel()

        t = threading.Thread(target=add)
        t.start()
        try:
            for _ in range(200):
                protocol._others_ready(loop._ready)  # type: ignore[attr-defined]
        finally:
            stop.set()
            t.join()
    finally:
        loop.close()

"""alloc33: the demo starts its prefill process together with the decode one
(the prefill side allocates and fills its pool while the decode side
allocates its own) and hands it the decode address once that pool is ready.

What must hold: a prefill side given no address (None: the parent gave up
first, e.g. the decode process failed) returns without connecting and
without reporting an error, its agent and pool closed; one given an address
streams every request and the decode side verifies them (tests/test_cli.py
runs the whole demo, also with a corruption it must catch).
"""

from __future__ import annotations

import queue
import threading

from aioxfer import demo


def test_prefill_without_address_stops_quietly() -> None:
    cfg = demo.DemoConfig(requests=2, pages=4, page_size=4096, progress=False, timeout=30)
    addresses: queue.Queue[str | None] = queue.Queue()
    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    addresses.put(None)
    stop = threading.Event()
    demo._prefill_main(cfg, addresses, events, stop)  # returns; SystemExit(1) on an error
    assert events.empty()


def test_prefill_waits_for_the_address_then_streams() -> None:
    """In-process: the decode side's coroutine on one thread, the prefill
    side's on another started first, its address handed over as the parent
    does; every request arrives and verifies."""
    cfg = demo.DemoConfig(requests=3, pages=8, page_size=4096, progress=False, timeout=60)
    addresses: queue.Queue[str | None] = queue.Queue()
    events: queue.Queue[tuple[object, ...]] = queue.Queue()
    stop = threading.Event()
    prefill = threading.Thread(target=demo._prefill_main, args=(cfg, addresses, events, stop))
    decode = threading.Thread(target=demo._decode_main, args=(cfg, events, stop))
    prefill.start()
    decode.start()
    seen: list[tuple[object, ...]] = []
    try:
        while not any(ev[0] == "prefill-done" for ev in seen) or not any(
            ev[0] == "decode-done" for ev in seen
        ):
            ev = events.get(timeout=60)
            assert ev[0] != "error", ev
            if ev[0] == "address":
                addresses.put(str(ev[1]))
            seen.append(ev)
    finally:
        stop.set()
        addresses.put(None)
        prefill.join(timeout=30)
        decode.join(timeout=30)
    assert not prefill.is_alive() and not decode.is_alive()
    verified = [ev for ev in seen if ev[0] == "verified"]
    assert sorted(ev[1] for ev in verified) == [0, 1, 2]  # type: ignore[type-var]
    assert all(ev[2] for ev in verified)
    assert next(ev for ev in seen if ev[0] == "decode-done")[1] == []

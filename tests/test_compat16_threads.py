"""One nixl_agent driven from several threads at once, as vLLM and SGLang do
(an engine thread posting and polling, a handshake executor adding and
removing peers, a thread reading notifications), with every outcome checked:
no call may fail, every transfer's data lands, every notification arrives
exactly once, and a removed peer is unknown at once."""

from __future__ import annotations

import ctypes
import threading
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np
import pytest

from aioxfer.nixl import nixl_agent, nixl_agent_config, nixlNotFoundError

STEP = 30.0
WORKERS = 4
ROUNDS = 150
BLK = 16 << 10


class Buf:
    def __init__(self, n: int) -> None:
        self.raw = (ctypes.c_char * n)()
        self.addr = ctypes.addressof(self.raw)
        self.np = np.frombuffer(self.raw, dtype=np.uint8)


def _wait(agent: nixl_agent, handle: Any) -> None:
    deadline = time.monotonic() + STEP
    while (st := agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "transfer still in progress"
    assert st == "DONE", st


@pytest.mark.parametrize("transports", ["", "tcp"])
def test_four_threads_post_poll_and_read_notifs_while_a_peer_churns(
    monkeypatch: pytest.MonkeyPatch, transports: str
) -> None:
    if transports:
        monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", transports)
    made: list[nixl_agent] = []

    def agent() -> nixl_agent:
        made.append(nixl_agent(str(uuid.uuid4()), nixl_agent_config(capture_telemetry=True)))
        return made[-1]

    try:
        a, b, c = agent(), agent(), agent()
        src, dst, cdst = Buf(WORKERS * BLK), Buf(WORKERS * BLK), Buf(BLK)
        a.register_memory([(src.addr, WORKERS * BLK, 0, "")], "DRAM")
        b.register_memory([(dst.addr, WORKERS * BLK, 0, "")], "DRAM")
        c.register_memory([(cdst.addr, BLK, 0, "")], "DRAM")
        b_name = a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())  # B's messages to A need A's address
        b_md, c_md = b.get_agent_metadata(), c.get_agent_metadata()
        local = a.prep_xfer_dlist("", [(src.addr + k * BLK, BLK, 0) for k in range(WORKERS)],
                                  "DRAM")
        remote = a.prep_xfer_dlist(b_name, [(dst.addr + k * BLK, BLK, 0)
                                            for k in range(WORKERS)], "DRAM")
        errors: list[BaseException] = []
        got: list[list[bytes]] = [[] for _ in range(WORKERS)]  # B's notifications to A
        stop = threading.Event()
        start = threading.Barrier(WORKERS + 2)

        def worker(k: int) -> None:
            # The engine thread's loop: post, poll to DONE, check the data,
            # read notifications; its own request on its own block.
            try:
                h = a.make_prepped_xfer("WRITE", local, [k], remote, [k])
                mine = src.np[k * BLK:(k + 1) * BLK]
                theirs = dst.np[k * BLK:(k + 1) * BLK]
                start.wait()
                for i in range(ROUNDS):
                    mine[:] = (k * ROUNDS + i) % 251 + 1
                    assert a.transfer(h, f"w{k}:{i}".encode()) in ("DONE", "PROC")
                    _wait(a, h)
                    assert theirs[0] == mine[0] and np.array_equal(theirs, mine), (k, i)
                    for name, msgs in a.get_new_notifs().items():
                        assert name == b.name, name
                        got[k].extend(msgs)
                telem = a.get_xfer_telemetry(h)
                assert telem.descCount == 1 and telem.totalBytes == BLK
                a.release_xfer_handle(h)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        churns = [0]

        def churn() -> None:
            # The handshake executor: a peer added, used, removed, over and
            # over; once removed it is unknown, at once.
            try:
                start.wait()
                while not stop.is_set():
                    name = a.add_remote_agent(c_md)
                    assert name == c.name.encode()
                    far = a.prep_xfer_dlist(name, [(cdst.addr, BLK, 0)], "DRAM")
                    h = a.make_prepped_xfer("WRITE", local, [0], far, [0])
                    assert a.transfer(h) in ("DONE", "PROC")
                    _wait(a, h)
                    a.release_xfer_handle(h)
                    a.release_dlist_handle(far)
                    a.remove_remote_agent(name)
                    with pytest.raises(nixlNotFoundError):
                        a.prep_xfer_dlist(name, [(cdst.addr, BLK, 0)], "DRAM")
                    assert not a.check_remote_metadata(name)
                    # The busy peer's metadata loaded again (a second
                    # handshake): its name back, the workers' requests unharmed.
                    assert a.add_remote_agent(b_md) == b_name
                    assert a.check_remote_metadata(b_name)
                    churns[0] += 1
            except BaseException as exc:
                errors.append(exc)

        def replies() -> None:
            # The peer's side: B sends A messages the workers must share out
            # between them, each exactly once.
            try:
                start.wait()
                for i in range(WORKERS * ROUNDS // 2):
                    b.send_notif(a.name, f"r{i}".encode())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(WORKERS)]
        threads += [threading.Thread(target=churn), threading.Thread(target=replies)]
        for t in threads:
            t.start()
        for t in threads[:WORKERS] + threads[-1:]:
            t.join(STEP * 3)
        stop.set()
        threads[WORKERS].join(STEP)
        assert not any(t.is_alive() for t in threads), "a thread is stuck"
        assert not errors, errors
        assert churns[0] > 0

        # Every worker's notification reached B exactly once.
        want = {f"w{k}:{i}".encode() for k in range(WORKERS) for i in range(ROUNDS)}
        seen: Counter[bytes] = Counter()
        deadline = time.monotonic() + STEP
        while set(seen) != want and time.monotonic() < deadline:
            for msgs in b.get_new_notifs().values():
                seen.update(msgs)
        assert set(seen) == want and max(seen.values()) == 1
        # And B's messages reached A exactly once, among the workers' reads
        # and what is left for this thread.
        replies_seen = Counter(m for part in got for m in part)
        want_r = {f"r{i}".encode() for i in range(WORKERS * ROUNDS // 2)}
        deadline = time.monotonic() + STEP
        while set(replies_seen) != want_r and time.monotonic() < deadline:
            for msgs in a.get_new_notifs().values():
                replies_seen.update(msgs)
        assert set(replies_seen) == want_r and max(replies_seen.values()) == 1
    finally:
        for ag in made:
            ag.close()

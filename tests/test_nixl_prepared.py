"""Agent.prepare: a request posted again and again (what aioxfer.nixl's
transfer() of a prepared request posts). Each post is what write/read of
the same pair would post, also after the pair stops being valid. And
Agent.wait_poll, what its check_xfer_state waits with."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Pair, pattern, within

import aioxfer
from aioxfer.errors import ClosedResourceError, XferError

N = 1 << 16


async def _regions(pair: Pair) -> tuple[Any, bytearray, Any, bytearray, Any]:
    src_buf = bytearray(pattern(N, 1).tobytes())
    src = pair.init.register(src_buf, name="src")
    dst_buf = bytearray(N)
    dst = pair.target.register(dst_buf, name="dst")
    return src, src_buf, dst, dst_buf, await pair.remote("dst")


async def test_posts_are_the_writes_and_reads_of_the_pair(pair: Pair) -> None:
    src, src_buf, _, dst_buf, remote = await _regions(pair)
    w = pair.init.prepare("write", src[0:4096], remote[8192:12288])
    assert (w.op, w.nbytes, w.priority) == ("write", 4096, 0)
    for _ in range(3):
        t = w.post()
        assert isinstance(t, aioxfer.Transfer)
        await within(t)
    assert dst_buf[8192:12288] == src_buf[0:4096]
    # post(now=True): handed to the engine before it returns (nothing left
    # for the loop's flush), a thread that polls can take it.
    dst_buf[:] = bytes(N)
    t = w.post(True)
    assert pair.init._sub._pending == []
    await within(t)
    assert dst_buf[8192:12288] == src_buf[0:4096]
    # READ back into another place, prepared with a priority.
    r = pair.init.prepare("read", src[N - 4096:N], remote[8192:12288], priority=1)
    assert r.priority == 1
    await within(r.post(True))
    assert src_buf[N - 4096:N] == src_buf[0:4096]
    # Shapes other than one Segment pair post through write/read.
    lst = pair.init.prepare("write", [src[0:16], src[32:48]], [remote[0:16], remote[64:80]])
    assert lst.nbytes == 32
    await within(lst.post())
    assert dst_buf[64:80] == src_buf[32:48]


async def test_segment_list_pairs_post_in_one_compiled_call(pair: Pair) -> None:
    """Two SegmentLists (what aioxfer.nixl prepares for several descriptors)
    post with the descriptors made when prepared, no Python frame of the
    agent, the data as write/read move it (merged neighbours too: a
    failure's index is the caller's), and after the local region is
    deregistered or the remote one gone, raise what write/read raise."""
    import sys

    import numpy as np

    from aioxfer import agent as agent_mod

    src, src_buf, dst, dst_buf, remote = await _regions(pair)
    offs = np.array([4096, 0, 8192, 12288, 40960], dtype=np.uint64)  # (8192, 12288: merged)
    lens = np.full(5, 4096, dtype=np.uint64)
    roffs = np.array([0, 16384, 8192, 12288, 57344], dtype=np.uint64)
    local = aioxfer.SegmentList(src, offs, lens)
    far = aioxfer.SegmentList(remote, roffs, lens)
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == agent_mod.__file__:
            frames.append(frame.f_code.co_name)

    for now in (False, True):
        dst_buf[:] = bytes(N)
        w = pair.init.prepare("write", local, far)
        assert w.nbytes == 5 * 4096
        sys.setprofile(profile)
        try:
            t = w.post(now)
        finally:
            sys.setprofile(None)
        assert frames == []
        assert t._starts is not None  # (the merged pair's first index: as write sets it)
        await within(t)
        for o, r in zip(offs.tolist(), roffs.tolist(), strict=True):
            assert dst_buf[r:r + 4096] == src_buf[o:o + 4096]
    src_buf[:] = bytes(N)
    await within(pair.init.prepare("read", local, far).post(True))
    for o, r in zip(offs.tolist(), roffs.tolist(), strict=True):
        assert src_buf[o:o + 4096] == dst_buf[r:r + 4096]
    # The local region deregistered, then the remote one gone: as read.
    keep = pair.init.register(bytearray(N), name="keep")
    p = pair.init.prepare("read", local, far)
    p2 = pair.init.prepare("read", aioxfer.SegmentList(keep, offs, lens), far)
    await within(pair.init.deregister(src))
    with pytest.raises(XferError) as read_exc:
        pair.init.read(local, far)
    with pytest.raises(type(read_exc.value)):
        p.post()
    await within(pair.target.deregister(dst))
    await within(pair.peer.refresh())
    with pytest.raises(XferError) as read_exc:
        pair.init.read(aioxfer.SegmentList(keep, offs, lens), far)
    with pytest.raises(type(read_exc.value)):
        p2.post(True)


async def test_a_pair_write_refuses_is_refused_when_prepared(pair: Pair) -> None:
    src, _, _, _, remote = await _regions(pair)
    with pytest.raises(ValueError):
        pair.init.prepare("copy", src[0:16], remote[0:16])
    for local, far in ((src[0:16], remote[0:32]), ([src[0:16]], [remote[0:16], remote[0:16]])):
        with pytest.raises((ValueError, XferError)) as prep_exc:
            pair.init.prepare("write", local, far)
        with pytest.raises(type(prep_exc.value)):
            pair.init.write(local, far)


async def test_posts_after_deregister_gone_or_close_raise_as_write_does(
        pair: Pair, make_agent: Any) -> None:
    src, _, dst, _, remote = await _regions(pair)
    keep = pair.init.register(bytearray(N), name="keep")
    p = pair.init.prepare("write", src[0:64], remote[0:64])
    p2 = pair.init.prepare("write", keep[0:64], remote[0:64])
    await within(p.post())
    # The local region deregistered.
    await within(pair.init.deregister(src))
    with pytest.raises(XferError) as write_exc:
        pair.init.write(src[0:64], remote[0:64])
    with pytest.raises(type(write_exc.value)):
        p.post()
    # The remote region gone (deregistered by its agent, seen by a refresh).
    await within(pair.target.deregister(dst))
    await within(pair.peer.refresh())
    assert remote._gone
    with pytest.raises(XferError) as write_exc:
        pair.init.write(keep[0:64], remote[0:64])
    with pytest.raises(type(write_exc.value)):
        p2.post(True)
    # The agent closed.
    other = await make_agent("other")
    mine = other.register(bytearray(N), name="mine")
    peer = await within(other.connect(pair.target.address))
    pair.target.register(bytearray(N), name="far")
    await within(peer.refresh())
    p3 = other.prepare("read", mine[0:64], peer.region("far")[0:64])
    await within(p3.post())
    await within(other.aclose())
    with pytest.raises(ClosedResourceError):
        p3.post()


async def test_posts_to_a_lost_peer_fail_as_writes_do(pair: Pair) -> None:
    src, _, _, _, remote = await _regions(pair)
    p = pair.init.prepare("read", src[0:64], remote[0:64])
    await within(p.post())
    await within(pair.target.aclose())
    # (The loss is noticed by the connection's reader, or by the next posts.)
    for _ in range(100):
        t = p.post(True)
        try:
            await within(t)
        except XferError as exc:
            with pytest.raises(type(exc)):
                await within(pair.init.read(src[0:64], remote[0:64]))
            break
    else:
        pytest.fail("posts to a closed peer kept succeeding")


async def test_wait_poll_takes_what_came_while_it_waited(pair: Pair) -> None:
    src, _, _, _, remote = await _regions(pair)
    assert pair.init.wait_poll(0) is False  # nothing in flight: a look
    p = pair.init.prepare("read", src[0:4096], remote[0:4096])
    caught = 0
    for _ in range(20):
        t = p.post(True)
        # (No await: only wait_poll takes completions here, the loop does not run.)
        for _ in range(100_000):
            if t.done():
                break
            if pair.init.wait_poll(1000):
                caught += 1
                assert t.done()  # taken by the poll, before wait_poll returned
                break
        assert t.done()
        await t
    # Over tcp, the completion comes from the engine's thread: some waits
    # catch it (on shm the copy runs inside the post).
    assert caught or pair.transport != "tcp"


# ---------------------------------------------------------------- aioxfer.nixl's transfer()


def _nixl_pair(prefix: str, n: int = 1 << 16) -> tuple[list[Any], Any, Any, Any, Any]:
    """Two aioxfer.nixl agents in this process (prefix-0 initiates), each with
    n bytes of ctypes memory registered by address, the second added to the
    first: (agents, its memory, the peer's, its registration, the peer's
    name)."""
    import ctypes

    from aioxfer.nixl import nixl_agent, nixl_agent_config

    made = [nixl_agent(f"{prefix}-{i}", nixl_agent_config()) for i in range(2)]
    a, b = made
    xs, ys = (ctypes.c_char * n)(), (ctypes.c_char * n)()
    ra = a.register_memory([(ctypes.addressof(xs), n, 0, "")], "DRAM")
    b.register_memory([(ctypes.addressof(ys), n, 0, "")], "DRAM")
    return made, xs, ys, ra, a.add_remote_agent(b.get_agent_metadata())


def test_nixl_plain_reposts_go_through_the_compiled_path_and_fail_as_before(
        tmp_path: Any) -> None:
    """transfer() of a plain prepared request (no notification) posts through
    Agent.prepare's compiled post; after the local memory is deregistered,
    the handle released or the remote removed it raises what the Python
    method raises."""
    import ctypes

    import aioxfer.nixl as nixl
    from aioxfer.nixl import _bindings

    made, xs, ys, ra, name = _nixl_pair(f"prep-{tmp_path.name}")
    a, b = made
    xa, ya = ctypes.addressof(xs), ctypes.addressof(ys)
    n = len(xs)
    try:
        ys[0:n] = bytes(range(256)) * (n // 256)
        assert a.transfer.__func__ is _bindings.nixlAgent.xferTransfer  # type: ignore[attr-defined]
        h = a.initialize_xfer("READ", a.get_xfer_descs([(xa, 4096, 0)], "DRAM"),
                              a.get_xfer_descs([(ya + 4096, 4096, 0)], "DRAM"), name)
        x = a.agent._xfers[h._handle]
        assert x.plain and x.prep is not None  # the compiled path's request
        for _ in range(3):
            xs[0:4096] = bytes(4096)
            st = a.transfer(h)
            while st == "PROC":
                st = a.check_xfer_state(h)
            assert st == "DONE" and xs[0:4096] == ys[4096:8192]
        # Another handle, its twin, that the Python method posts: both fail
        # the same way from here on.
        h2 = a.initialize_xfer("READ", a.get_xfer_descs([(xa, 4096, 0)], "DRAM"),
                               a.get_xfer_descs([(ya + 4096, 4096, 0)], "DRAM"), name)
        a.agent._xfers[h2._handle].prep = None
        a.deregister_memory(ra)
        with pytest.raises(Exception) as py_exc:
            a.transfer(h2)
        with pytest.raises(type(py_exc.value)):
            a.transfer(h)
        assert type(py_exc.value).__module__ == nixl.nixlNotFoundError.__module__
        h.release()
        with pytest.raises(nixl.nixlInvalidParamError):  # (unknown handle, as postXferReq's)
            a.transfer(h)
        a.register_memory([(xa, n, 0, "")], "DRAM")
        h3 = a.initialize_xfer("WRITE", a.get_xfer_descs([(xa, 64, 0)], "DRAM"),
                               a.get_xfer_descs([(ya, 64, 0)], "DRAM"), name)
        a.remove_remote_agent(name)
        with pytest.raises(nixl.nixlNotFoundError):  # NIXL 1.5.1's answer (nixl22)
            a.transfer(h3)
        h2.release()
        h3.release()
    finally:
        for ag in made:
            ag.close()


def test_nixl_lone_reposts_are_posted_alone_and_copied_inside_transfer(
        tmp_path: Any) -> None:
    """A plain repost with nothing else of the agent's in flight is posted
    with AXF_POST_ALONE, as an awaited lone request of the Agent's: a
    same-host copy past the batch bound (64 KiB) and within inline_bytes
    then runs inside transfer(), which returns DONE, every time, through the
    compiled repost and through the Python method alike. (The compiled
    repost without the flag, _cyx.Submitter._submit's len(inflight) == 1
    made False: its first repost returned PROC, the copy on a worker.)"""
    import ctypes

    made, xs, ys, _, name = _nixl_pair(f"alone-{tmp_path.name}", n=(1 << 20) + 4096)
    a, b = made
    xa, ya = ctypes.addressof(xs), ctypes.addressof(ys)
    try:
        ba = a.agent
        assert ba._agent.transports[0] == "shm"
        m = min(1 << 20, ba._agent.inline_bytes)
        if m <= 64 << 10:
            pytest.skip(f"inline_bytes {m}: not past the batch bound")
        for op in ("WRITE", "READ"):
            h = a.initialize_xfer(op, a.get_xfer_descs([(xa, m, 0)], "DRAM"),
                                  a.get_xfer_descs([(ya + 4096, m, 0)], "DRAM"), name)
            x = ba._xfers[h._handle]
            assert x.plain and x.prep is not None
            for i in range(12):
                if i == 6:
                    x.prep = None  # from here, the Python method's post
                pat = bytes([(i * 7 + len(op)) & 0xFF]) * m
                if op == "WRITE":
                    xs[0:m] = pat
                else:
                    ys[4096:4096 + m] = pat
                assert a.transfer(h) == "DONE", (op, i)
                assert xs[0:m] == ys[4096:4096 + m] == pat
                assert not ba._agent._sub.inflight
            h.release()
    finally:
        for ag in made:
            ag.close()


def test_nixl_tight_checks_go_through_the_compiled_path_with_the_python_states(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_xfer_state of a request just posted (a tight poll) spins and
    catches it without a Python frame of the binding (_cyx.nixl_state), and
    leaves the request as the Python method (_state_py) does: the same
    states, the same spin bookkeeping, the same errors."""
    import ctypes
    import sys

    from aioxfer.nixl import _bindings

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")  # (a completion that takes a spin)
    made, xs, ys, _, name = _nixl_pair(f"state-{tmp_path.name}")
    a, b = made
    xa, ya = ctypes.addressof(xs), ctypes.addressof(ys)
    try:
        m = 1 << 15  # (posted, then completed: not inside the post)
        ba = a.agent
        assert a.check_xfer_state.__func__ is _bindings.nixlAgent.xferState  # type: ignore[attr-defined]
        assert ba._spin_us > 0  # ("adaptive" progress: a tight poll spins)

        def handle() -> Any:
            return a.initialize_xfer("WRITE", a.get_xfer_descs([(xa, m, 0)], "DRAM"),
                                     a.get_xfer_descs([(ya, m, 0)], "DRAM"), name)

        frames: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename == _bindings.__file__:
                frames.append(frame.f_code.co_name)

        def run(h: Any, check: Any, i: int) -> tuple[list[str], list[list[str]]]:
            xs[0:m] = bytes([i]) * m
            assert a.transfer(h) in ("DONE", "PROC")
            states, called = [], []
            while not states or states[-1] == "PROC":
                frames.clear()
                sys.setprofile(profile)
                try:
                    states.append(check(h))
                finally:
                    sys.setprofile(None)
                called.append(list(frames))
            assert ys[0:m] == bytes([i]) * m
            return states, called

        spins: list[int] = []
        wait_poll = ba._wait_poll

        def counted_wait_poll(max_us: int) -> bool:  # (a frame of this file, not the binding's)
            if max_us:
                spins.append(max_us)
            return wait_poll(max_us)

        monkeypatch.setattr(ba, "_wait_poll", counted_wait_poll)
        monkeypatch.setattr(ba, "_ns", ba._nixl_cache())  # (xferState's resolved fields)
        hc, hp = handle(), handle()
        bare = 0  # checks that spun without a Python frame of the binding
        for i in range(200):
            spins.clear()
            states, called = run(hc, a.check_xfer_state, i & 0xFF)
            assert states[-1] == "DONE" and set(states[:-1]) <= {"PROC"}
            bare += bool(spins) and not any(called)
            pstates, _ = run(hp, ba._state_py, i & 0xFF)
            assert pstates[-1] == "DONE" and set(pstates[:-1]) <= {"PROC"}
            if bare >= 3 and i >= 20:
                break
        assert bare > 0
        # The same spin bookkeeping (_note_latency's, _spin_outcome's): the
        # spin budget a small request's, from its average latency. (Either
        # request may have been found done by the loop thread before any
        # spin: then it has none.)
        xc, xp = ba._xfers[hc._handle], ba._xfers[hp._handle]
        for x in (xc, xp):
            if x.lat:
                assert type(x.spin) is bool and type(x.slow) is int and type(x.skipped) is int
                assert type(x.lat) is float and type(x.budget) is int
                assert x.budget == min(int(x.lat * (_bindings.ALONE_LATENCIES * 1e6)),
                                        _bindings.ALONE_MAX_US)
        # Done, then asked again: "DONE" from both.
        assert a.check_xfer_state(hc) == ba._state_py(hc) == "DONE"
        # Not posted, or unknown: the same errors.
        h0 = handle()
        for _ in range(2):
            with pytest.raises(Exception) as py_exc:
                ba._state_py(h0)
            with pytest.raises(type(py_exc.value)):
                a.check_xfer_state(h0)
            h0.release()
        hc.release()
        hp.release()
    finally:
        for ag in made:
            ag.close()


def test_nixl_sleeping_checks_go_through_the_compiled_path(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """In "sleep" progress a tight check does not spin: it sleeps on the
    engine's fd it claimed (_cyx.nixl_state's compiled sleep, no Python frame
    of the binding), takes the completion, and leaves the claim lingering
    (not held) for the next check; no spin bookkeeping."""
    import ctypes
    import sys

    from aioxfer.nixl import _bindings
    from aioxfer.nixl._runtime import runtime

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")  # (a completion from the engine)
    monkeypatch.setenv("AIOXFER_NIXL_PROGRESS", "sleep")
    made, xs, ys, _, name = _nixl_pair(f"slept-{tmp_path.name}")
    a, b = made
    xa, ya = ctypes.addressof(xs), ctypes.addressof(ys)
    try:
        ba = a.agent
        assert ba._spin_us == 0 and not ba._spin_only
        m = 1 << 15
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(xa, m, 0)], "DRAM"),
                              a.get_xfer_descs([(ya, m, 0)], "DRAM"), name)
        frames: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename == _bindings.__file__:
                frames.append(frame.f_code.co_name)

        looks: list[bool] = []
        wait_poll = ba._wait_poll

        def counted_wait_poll(max_us: int) -> bool:  # (a frame of this file, not the binding's)
            looks.append(wait_poll(max_us))
            return looks[-1]

        monkeypatch.setattr(ba, "_wait_poll", counted_wait_poll)
        monkeypatch.setattr(ba, "_ns", ba._nixl_cache())  # (xferState's resolved fields)
        slept = 0  # requests a check slept for (a look found nothing) without a binding frame
        for i in range(2000):  # (a loaded machine: some checks are late, not tight)
            xs[0:m] = bytes([i & 0xFF]) * m
            st = a.transfer(h)
            frames.clear()
            looks.clear()
            sys.setprofile(profile)
            try:
                while st == "PROC":
                    st = a.check_xfer_state(h)
            finally:
                sys.setprofile(None)
            assert st == "DONE" and ys[0:m] == bytes([i & 0xFF]) * m
            slept += not frames and False in looks
            if slept >= 5:
                break
        assert slept >= 5
        x = ba._xfers[h._handle]
        assert x.lat == 0.0 and x.budget == 0 and x.spin is True  # (nothing spun)
        with runtime().locked():
            c = runtime().selector._claims.get(ba._fd)
            assert c is None or c.active == 0  # lingering or given back, not held
        h.release()
    finally:
        for ag in made:
            ag.close()


def test_nixl_checks_of_several_parts_go_through_the_compiled_path(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of two region pairs (two aioxfer calls, one whole future) is
    checked by _cyx.nixl_state as one request: its parts' data waited for
    without a frame of the binding but _advance (which settles it, or sends
    its notification after the data), the states those of _state_py; with a
    notification, the peer gets it once the data is in its memory."""
    import ctypes
    import sys

    from aioxfer.nixl import _bindings

    monkeypatch.setenv("AIOXFER_NIXL_TRANSPORTS", "tcp")  # (completions from the engine)
    made, xs, ys, _, name = _nixl_pair(f"parts-{tmp_path.name}")
    a, b = made
    m = 1 << 14
    zs = (ctypes.c_char * m)()
    xa, ya, za = ctypes.addressof(xs), ctypes.addressof(ys), ctypes.addressof(zs)
    a.register_memory([(za, m, 0, "")], "DRAM")
    try:
        ba = a.agent

        k = 1 << 10  # (16 descriptors per region pair: two aioxfer calls, not one list)

        def handle(notif: bytes = b"") -> Any:
            local = [(base + j, k, 0) for base in (xa, za) for j in range(0, m, k)]
            far = [(ya + j, k, 0) for j in range(0, 2 * m, k)]
            return a.initialize_xfer("WRITE", a.get_xfer_descs(local, "DRAM"),
                                     a.get_xfer_descs(far, "DRAM"), name, notif)

        frames: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename == _bindings.__file__:
                frames.append(frame.f_code.co_name)

        def run(h: Any, check: Any, i: int, profiled: bool = True) -> list[str]:
            xs[0:m] = bytes([i]) * m
            zs[0:m] = bytes([i ^ 0xFF]) * m
            states = [a.transfer(h)]
            frames.clear()
            if profiled:
                sys.setprofile(profile)
            try:
                while states[-1] == "PROC":
                    states.append(check(h))
            finally:
                sys.setprofile(None)
            assert ys[0:m] == bytes([i]) * m and ys[m:2 * m] == bytes([i ^ 0xFF]) * m
            return states

        hc, hp = handle(), handle()
        assert len(ba._xfers[hc._handle].groups) == 2
        bare = 0  # requests checked (at least once) with no frame of the binding but _advance
        for i in range(2000):  # (a loaded machine: some checks are late, not tight)
            states = run(hc, a.check_xfer_state, i & 0xFF)
            assert states[-1] == "DONE" and set(states[:-1]) <= {"PROC"}
            bare += len(states) > 1 and set(frames) <= {"_advance"}
            pstates = run(hp, ba._state_py, i & 0xFF, profiled=False)
            assert pstates[-1] == "DONE" and set(pstates[:-1]) <= {"PROC"}
            if bare >= 5:
                break
        assert bare >= 5
        xc = ba._xfers[hc._handle]
        assert type(xc.spin) is bool and type(xc.slow) is int and type(xc.lat) is float
        # With a notification: sent after both parts' data.
        hn = handle(b"parts-done")
        for i in range(5):
            assert run(hn, a.check_xfer_state, i, profiled=False)[-1] == "DONE"
            got: list[bytes] = []
            for _ in range(2000):
                got = b.get_new_notifs().get(a.name, [])
                if got:
                    break
            assert got == [b"parts-done"]
        for h in (hc, hp, hn):
            h.release()
    finally:
        for ag in made:
            ag.close()

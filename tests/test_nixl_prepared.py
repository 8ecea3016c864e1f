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

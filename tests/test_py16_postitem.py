"""Agent.write/read's usual case (_cyx.Poster) puts a _cyx.PostItem into the
Submission's batch, not the item tuple ``(ep, op, descs, None, req_id)`` and
its descriptor 6-tuple: its fields are C integers, and the engine's post
copies them. What reads a batch item from Python (Submission.hold_region's
``item[2]``, tests) sees that tuple; a field that is not a uint64 keeps the
tuple item, so the post fails the transfer with the error it did before."""

from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pair_64k

import aioxfer
from aioxfer import _cyx


async def test_a_write_batches_a_post_item_that_reads_as_its_tuple(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    local.numpy()[:] = 7
    t = init.write(local[0:4096], remote[8192:12288])
    r = init.read(local[8192:12288], remote[8192:12288])
    w_item, r_item = sub._pending
    assert type(w_item) is _cyx.PostItem and type(r_item) is _cyx.PostItem
    w = (peer._ep, _cyx.OP_WRITE, (local.rid, 0, remote.rid, remote.key, 8192, 4096), None,
         t.req_id)
    assert w_item == w and not (w_item != w) and tuple(w_item) == w and len(w_item) == 5
    assert w_item[2] == w[2] and w_item[:4] == w[:4] and w_item[-1] == t.req_id
    assert r_item[1] == _cyx.OP_READ and r_item[4] == r.req_id and r_item != w_item
    assert repr(w_item) == f"PostItem{w!r}"
    # A batch item that is not the request's keeps the transfer's own ways.
    assert sub.hold_region(local.rid + 1000, lambda: None) is False
    with pytest.raises(TypeError):
        hash(w_item)
    with pytest.raises(TypeError):
        _cyx.PostItem()
    with pytest.raises(TypeError):
        pickle.dumps(w_item)
    assert (await t).nbytes == 4096 and (await r).nbytes == 4096
    assert bytes(local.memoryview[8192:12288]) == b"\x07" * 4096
    # Posted from a batch of items and tuples alike (post_many).
    t1 = init.write(local[0:4096], remote[0:4096])
    t2 = sub.submit(peer, _cyx.OP_WRITE, (local.rid, 0, remote.rid, remote.key, 4096, 4096),
                    None, 4096, "write", 0)
    assert [type(i) for i in sub._pending] == [_cyx.PostItem, tuple]
    assert [(await x).nbytes for x in (t1, t2)] == [4096, 4096]


async def test_hold_region_finds_a_batched_post_item(
    make_agent: Callable[..., Awaitable[Any]],
) -> None:
    """Submission.hold_region reads a batch item's descriptors as item[2]:
    a PostItem's local region is found there."""
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    t = init.write(local[0:4096], remote[0:4096])
    assert type(sub._pending[0]) is _cyx.PostItem
    ran: list[int] = []
    assert sub.hold_region(local.rid, lambda: ran.append(1)) is True
    assert sub._holds[t.req_id][0].left == 1
    sub._holds.clear()
    assert (await t).nbytes == 4096


@pytest.mark.parametrize("field", ["rid", "offset"])
async def test_a_field_that_is_not_a_uint64_fails_the_post_as_before(
    make_agent: Callable[..., Awaitable[Any]], field: str,
) -> None:
    """A segment field out of uint64 range (set by hand here): the compiled
    write batches the tuple item, and the post fails the transfer with the
    error the Python method's request gets."""
    init, peer, local, remote = await pair_64k(make_agent)
    sub = init._sub
    errors = []
    for write in (init.write, aioxfer.Agent.write.__get__(init)):
        seg = local[0:4096]
        if field == "rid":
            rid = local.rid
            local.rid = -1
        else:
            object.__setattr__(seg, "offset", 1 << 64)
        try:
            t = write(seg, remote[0:4096])
            assert type(sub._pending[-1]) is tuple
        finally:
            if field == "rid":
                local.rid = rid
        with pytest.raises(aioxfer.XferError) as err:
            await t
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "could not be posted" in errors[0], errors

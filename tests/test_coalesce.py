"""Adjacent segments are merged into one descriptor before they reach the
engine; data and failures still read in the caller's terms."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import pattern, transport_kwargs, within

import aioxfer
from aioxfer.agent import _coalesce


def test_coalesce_merges_runs_only() -> None:
    d = np.array([[1, 0, 2, 9, 100, 10],   # run: contiguous on both sides
                  [1, 10, 2, 9, 110, 5],
                  [1, 20, 2, 9, 115, 5],   # local gap: a new run
                  [1, 25, 2, 9, 120, 1],
                  [1, 26, 3, 9, 121, 1]],  # another remote region
                 dtype=np.uint64)
    merged, starts = _coalesce(d)
    assert merged.tolist() == [[1, 0, 2, 9, 100, 15], [1, 20, 2, 9, 115, 6],
                               [1, 26, 3, 9, 121, 1]]
    assert starts.tolist() == [0, 2, 4]
    assert d[0, 5] == 10  # the caller's array is left alone
    same, none = _coalesce(d[[0, 2]])
    assert none is None and same.shape == (2, 6)


async def test_adjacent_pages_write_and_fail_index(make_agent, transport) -> None:
    kw = transport_kwargs(transport)
    target = await make_agent("target", **kw)
    init = await make_agent("init", **kw)
    dst = target.alloc(1 << 20, name="dst")
    peer = await within(init.connect(target.address))
    data = pattern(1 << 20, seed=41)
    src = init.register(data)
    remote = peer.region("dst")
    page = 4096
    n = 200  # 200 adjacent pages: one descriptor after merging
    await within(init.write([src[i * page:(i + 1) * page] for i in range(n)],
                            [remote[i * page:(i + 1) * page] for i in range(n)]))
    assert bytes(dst.memoryview[: n * page]) == data[: n * page].tobytes()
    # Pages 0..9 adjacent (one merged descriptor), then one into a region the
    # target only lets peers read: refused as a whole, never half written.
    target.register(bytes(page), name="ro")
    await within(peer.refresh())
    ro = peer.region("ro")
    ls = [src[i * page:(i + 1) * page] for i in range(11)]
    rs = [remote[i * page:(i + 1) * page] for i in range(10)] + [ro[0:page]]
    with pytest.raises(aioxfer.AccessDenied) as info:
        await within(init.write(ls, rs))
    # Refused at post (the peer's metadata says read-only), so no index comes
    # back; an index from the engine would be mapped to the caller's (10).
    assert info.value.fail_index in (10, None)

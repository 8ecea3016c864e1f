"""reg31: a SegmentList keeps arrays of its own.

SegmentList kept the caller's uint64 array itself (np.ascontiguousarray
returns it as it is): a change to it after the list was built reached the
engine without the list's bounds check (the engine refused it at
completion, as AccessDenied, rather than IndexError at the call). Now a
uint64 array given (or a view of one) is copied."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import within

from aioxfer.region import SegmentList

KiB = 1 << 10


async def test_changing_the_callers_array_changes_nothing(make_agent: Any) -> None:
    target = await make_agent("target")
    init = await make_agent("init")
    target.alloc(64 * KiB, name="dst")
    src = init.alloc(64 * KiB, name="src")
    src.numpy()[:] = 0x61
    peer = await within(init.connect(target.address))
    offs = np.arange(4, dtype=np.uint64) * np.uint64(4 * KiB)
    lens = np.full(4, 4 * KiB, dtype=np.uint64)
    local = src.segments(offs, lens)
    remote = SegmentList(peer.region("dst"), offs, lens)
    offs[3] = 1 << 40  # far past both regions: checked neither here nor there
    lens[0] = 1 << 40
    assert int(local.offsets[3]) == 12 * KiB and int(remote.lengths[0]) == 4 * KiB
    result = await within(init.write(local, remote))
    assert result.nbytes == 16 * KiB
    # a caller's view (a slice of a larger array) is copied too
    big = np.arange(8, dtype=np.uint64) * np.uint64(4 * KiB)
    view = SegmentList(src, big[2:6], lens[1:].repeat(2)[:4])
    big[2] = 1 << 40
    assert int(view.offsets[0]) == 8 * KiB
    # out of bounds at build time is still IndexError
    with pytest.raises(IndexError):
        SegmentList(src, [60 * KiB], [8 * KiB])

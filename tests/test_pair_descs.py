"""region.pair_descs is compiled (_cyx.pair_descs): the same descriptor array
and the same errors as the numpy implementation it replaced."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from aioxfer import _cyx
from aioxfer.region import SegmentList, pair_descs


def _numpy_pair_descs(local: SegmentList, lrid: int, far: SegmentList, frid: int, fkey: int,
                      far_name: str) -> npt.NDArray[np.uint64]:
    # The numpy implementation region.pair_descs had before it was compiled.
    n = len(local)
    if n != len(far):
        raise ValueError(f"{n} local segments but {len(far)} {far_name} segments")
    if not n:
        raise ValueError("no segments to transfer")
    lens = local.lengths
    if not np.array_equal(lens, far.lengths):
        bad = int(np.flatnonzero(lens != far.lengths)[0])
        raise ValueError(
            f"segment {bad}: local length {int(lens[bad])} != {far_name} length "
            f"{int(far.lengths[bad])}"
        )
    if not lens.all():
        raise ValueError(f"segment {int(np.flatnonzero(lens == 0)[0])} is empty")
    descs = np.empty((n, 6), dtype=np.uint64)
    descs[:, 0] = lrid
    descs[:, 1] = local.offsets
    descs[:, 2] = frid
    descs[:, 3] = fkey
    descs[:, 4] = far.offsets
    descs[:, 5] = lens
    return descs


def _segs(offsets: npt.ArrayLike, lengths: npt.ArrayLike) -> SegmentList:
    # As aioxfer.nixl builds them: the arrays set directly, no region checks.
    sl = SegmentList.__new__(SegmentList)
    sl.offsets = np.asarray(offsets)  # type: ignore[assignment]
    sl.lengths = np.asarray(lengths)  # type: ignore[assignment]
    return sl


def _outcome(f, *args):  # type: ignore[no-untyped-def]
    try:
        return f(*args)
    except ValueError as e:
        return ("ValueError", str(e))


def test_compiled_pair_descs_agrees_with_numpy_on_random_inputs() -> None:
    rng = np.random.default_rng(13)
    seen: set[str] = set()
    for trial in range(2000):
        n = int(rng.choice([0, 1, 2, 5, 256]))
        lens = rng.choice([0, 1, 4096, 16384, 2**63 + 5], n).astype(np.uint64)
        if rng.random() < 0.7:
            lens[lens == 0] = 1  # most cases valid
        flens = lens.copy()
        kind = int(rng.integers(0, 6))
        if kind == 0 and n:  # a length differs (sometimes also before an empty one)
            i = int(rng.integers(0, n))
            flens[i] += np.uint64(1)
        nf = n
        if kind == 1:  # count mismatch
            nf = n + int(rng.choice([-1, 1])) if n else 1
        loffs = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        foffs = rng.integers(0, 2**64 - 1, nf, dtype=np.uint64, endpoint=True)
        flens = np.resize(flens, nf) if nf != n else flens
        local, far = _segs(loffs, lens), _segs(foffs, flens)
        ids = [int(x) for x in rng.integers(0, 2**64 - 1, 3, dtype=np.uint64, endpoint=True)]
        name = ("remote", "file")[trial % 2]
        want = _outcome(_numpy_pair_descs, local, ids[0], far, ids[1], ids[2], name)
        got = _outcome(pair_descs, local, ids[0], far, ids[1], ids[2], name)
        if isinstance(want, tuple):
            assert got == want
            msg = want[1]
            seen.add("count" if "local segments but" in msg else
                     "none" if msg == "no segments to transfer" else
                     "length" if "local length" in msg else
                     "empty" if msg.endswith(" is empty") else msg)
        else:
            assert isinstance(got, np.ndarray)
            assert got.dtype == np.uint64 and got.shape == (n, 6) and got.flags.c_contiguous
            assert np.array_equal(got, want)
            seen.add("ok")
    # Every outcome was drawn: a descriptor array, and each of the four errors.
    assert seen == {"ok", "count", "none", "length", "empty"}


def test_compiled_pair_descs_errors_exactly() -> None:
    a = np.array([4, 8, 12], dtype=np.uint64)
    l3 = np.array([4, 4, 4], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"^3 local segments but 2 remote segments$"):
        pair_descs(_segs(a, l3), 1, _segs(a[:2], l3[:2]), 2, 3, "remote")
    empty = np.zeros(0, dtype=np.uint64)
    with pytest.raises(ValueError, match=r"^no segments to transfer$"):
        pair_descs(_segs(empty, empty), 1, _segs(empty, empty), 2, 3, "file")
    # The first unequal length wins over an earlier empty segment.
    ll = np.array([0, 4, 2**64 - 1], dtype=np.uint64)
    fl = np.array([0, 4, 7], dtype=np.uint64)
    with pytest.raises(ValueError,
                       match=rf"^segment 2: local length {2**64 - 1} != file length 7$"):
        pair_descs(_segs(a, ll), 1, _segs(a, fl), 2, 3, "file")
    with pytest.raises(ValueError, match=r"^segment 1 is empty$"):
        pair_descs(_segs(a, [4, 0, 0]), 1, _segs(a, [4, 0, 0]), 2, 3, "remote")


def test_compiled_pair_descs_takes_any_integer_layout() -> None:
    # Strided and int64 arrays (built outside SegmentList.__init__) are converted.
    offs = np.arange(0, 80, 8, dtype=np.int64)[::2]
    lens = np.full(10, 4, dtype=np.uint64)[::2]
    got = _cyx.pair_descs(offs, lens, offs[::-1], lens, 1, 2, 3, "remote")
    assert got.tolist() == [[1, int(o), 2, 3, int(f), 4]
                            for o, f in zip(offs, offs[::-1], strict=True)]

# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: embedsignature=True, initializedcheck=False
"""aioxfer._cyx: the Cython edge of the native engine (cyx/README.md).

No policy lives here. This module pins buffer exports for as long as the
engine may touch them, hands packed descriptor arrays to the engine without a
Python object per descriptor, and turns completion records into tuples.
Everything is meant to be called from one thread (the event loop's); calls
that can wait release the GIL.
"""

cimport cython
cimport numpy as cnp
from cpython.buffer cimport (
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int32_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cnp.import_array()


cdef extern from "Python.h":
    # object.__setattr__: sets a slot through its descriptor, past a frozen
    # dataclass's __setattr__ (which is what the dataclass's __init__ does).
    int PyObject_GenericSetAttr(object o, object name, object value) except -1


cdef inline double _perf_counter() noexcept nogil:
    """time.perf_counter() without a Python call: Linux's perf_counter is
    CLOCK_MONOTONIC, as nanoseconds over 1e9 (transfers' _t0 come from it)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>(<long long>ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9

# Pins of regions an engine gave up on at shutdown (a peer could still write
# them): held for the life of the process, so that memory is never reused.
_abandoned = []

# ------------------------------------------------------------------ constants
# Same names as the C header, without the AXF_ prefix.

# Status codes, constants and limits, generated from native/include/aioxfer.h
# by tools/gen_abi.py (the same values as aioxfer/_abi.py).
include "_abi.pxi"

DESC_FIELDS = 6  # columns of a descriptor array: lrid, loff, rrid, rkey, roff, len

# post() hands (n, 6) uint64 rows to the engine as axf_desc records.
if sizeof(axf_desc) != DESC_FIELDS * sizeof(uint64_t):
    raise ImportError("axf_desc is not six packed uint64 fields")

cdef enum:
    POLL_DEFAULT = 4096
    # A batch posting up to this many bytes (one-descriptor requests) keeps
    # the GIL: a same-host post copies them inline, in about the time the
    # GIL's release and retake take.
    _GIL_KEPT_BYTES = 64 << 10


import sys as _sys

import numpy as _np


def coalesce(descs):
    """aioxfer.descriptors.coalesce compiled (one pass over the rows, no
    numpy call per column): runs of descriptors contiguous on both sides
    (same regions, same key) merged into one each. Returns ``(descs, None)``
    when nothing merges (a tuple, fewer than two rows: as given), else
    ``(merged, starts)``: the merged (m, 6) uint64 array and each merged
    row's first original index (intp)."""
    cdef cnp.ndarray a
    cdef const uint64_t *p
    cdef uint64_t *q
    cdef const uint64_t *prev
    cdef const uint64_t *cur
    cdef cnp.intp_t *st
    cdef Py_ssize_t n, i, j, m
    if isinstance(descs, tuple) or len(descs) < 2:
        return descs, None
    a = _np.ascontiguousarray(descs, dtype=_np.uint64)
    if a.ndim != 2 or a.shape[1] != DESC_FIELDS:
        raise ValueError(f"descriptors are (n, {DESC_FIELDS}), not {(<object>a).shape}")
    n = a.shape[0]
    p = <const uint64_t *>cnp.PyArray_DATA(a)
    m = 1
    for i in range(1, n):
        prev = p + (i - 1) * 6
        cur = prev + 6
        if not (cur[0] == prev[0] and cur[2] == prev[2] and cur[3] == prev[3]
                and cur[1] == prev[1] + prev[5] and cur[4] == prev[4] + prev[5]):
            m += 1
    if m == n:
        return descs, None
    merged = _np.empty((m, DESC_FIELDS), dtype=_np.uint64)
    starts = _np.empty(m, dtype=_np.intp)
    q = <uint64_t *>cnp.PyArray_DATA(merged)
    st = <cnp.intp_t *>cnp.PyArray_DATA(starts)
    j = 0
    memcpy(q, p, 6 * sizeof(uint64_t))
    st[0] = 0
    for i in range(1, n):
        prev = p + (i - 1) * 6
        cur = prev + 6
        if (cur[0] == prev[0] and cur[2] == prev[2] and cur[3] == prev[3]
                and cur[1] == prev[1] + prev[5] and cur[4] == prev[4] + prev[5]):
            q[j * 6 + 5] += cur[5]
        else:
            j += 1
            memcpy(q + j * 6, cur, 6 * sizeof(uint64_t))
            st[j] = i
    return merged, starts


cdef inline cnp.ndarray _u64c(object a):
    """a as a C-contiguous uint64 array (itself when it already is one)."""
    if (type(a) is _np.ndarray and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_UINT64
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a) and cnp.PyArray_NDIM(<cnp.ndarray>a) == 1):
        return <cnp.ndarray>a
    return _np.ascontiguousarray(a, dtype=_np.uint64)


def pair_descs(loffs, llens, foffs, flens, uint64_t lrid, uint64_t frid, uint64_t fkey,
               str far_name):
    """aioxfer.region.pair_descs compiled (one pass, no numpy call per
    column): the (n, 6) uint64 descriptor array of two equal segment lists
    given as their offsets and lengths (1-D uint64), with the same checks and
    errors: as many segments on both sides, none empty, lengths pairwise
    equal. ``far_name`` names the far side in the errors."""
    cdef cnp.ndarray lo = _u64c(loffs)
    cdef cnp.ndarray ll = _u64c(llens)
    cdef cnp.ndarray fo = _u64c(foffs)
    cdef cnp.ndarray fl = _u64c(flens)
    cdef Py_ssize_t n = cnp.PyArray_DIM(lo, 0)
    cdef Py_ssize_t nf = cnp.PyArray_DIM(fo, 0)
    cdef Py_ssize_t i, bad = -1, empty = -1
    cdef const uint64_t *plo
    cdef const uint64_t *pll
    cdef const uint64_t *pfo
    cdef const uint64_t *pfl
    cdef uint64_t *q
    cdef uint64_t length
    if n != nf:
        raise ValueError(f"{n} local segments but {nf} {far_name} segments")
    if not n:
        raise ValueError("no segments to transfer")
    if cnp.PyArray_DIM(ll, 0) != n or cnp.PyArray_DIM(fl, 0) != n:
        raise ValueError("offsets and lengths differ in length")
    plo = <const uint64_t *>cnp.PyArray_DATA(lo)
    pll = <const uint64_t *>cnp.PyArray_DATA(ll)
    pfo = <const uint64_t *>cnp.PyArray_DATA(fo)
    pfl = <const uint64_t *>cnp.PyArray_DATA(fl)
    descs = _np.empty((n, DESC_FIELDS), dtype=_np.uint64)
    q = <uint64_t *>cnp.PyArray_DATA(descs)
    for i in range(n):
        length = pll[i]
        if length != pfl[i]:
            bad = i
            break
        if length == 0 and empty < 0:
            empty = i
        q[0] = lrid
        q[1] = plo[i]
        q[2] = frid
        q[3] = fkey
        q[4] = pfo[i]
        q[5] = length
        q += 6
    if bad >= 0:
        raise ValueError(f"segment {bad}: local length {pll[bad]} != {far_name} length "
                         f"{pfl[bad]}")
    if empty >= 0:
        raise ValueError(f"segment {empty} is empty")
    return descs


def strerror(int status):
    """The header's text for a status code."""
    return axf_strerror(status).decode("utf-8", "replace")


def file_backend():
    """(io_uring?, one line): the file I/O backend a new engine would choose now."""
    cdef char buf[160]
    cdef int r
    axf_env_read()  # with the GIL: the environment as it is now, no getenv beside a write
    with nogil:
        r = axf_file_info(NULL, buf, sizeof(buf))
    return r == 1, buf.decode("utf-8", "replace")


def calibration():
    """This machine's costs, measured once per process (native axf_calibrate):
    wake_ns (one thread wake-up through an eventfd), copy_mbps (one thread's
    memcpy), and what the engine derives from them: inline_bytes (a lone
    same-host copy up to this runs on the posting thread) and poll_us (the
    bound of one busy-poll of the ring)."""
    cdef axf_calibration c
    axf_env_read()  # with the GIL: no os.environ write runs beside its getenv
    with nogil:
        axf_calibrate(&c)
    return {"wake_ns": c.wake_ns, "copy_mbps": c.copy_mbps,
            "inline_bytes": c.inline_bytes, "poll_us": c.poll_us}


class NativeError(Exception):
    """A native call refused; ``status`` is the engine's status code.

    The public layer (aioxfer.errors) maps the code to its exception classes.
    """

    def __init__(self, status, what):
        super().__init__(status, what)
        self.status = status
        self.what = what

    def __str__(self):
        return f"{self.what}: {strerror(self.status)}"


cdef inline int _check(int status, what) except -1:
    if status != AXF_OK:
        raise NativeError(status, what)
    return 0


# ------------------------------------------------------------------ families
# One extension, one file per family (textual includes: they share the
# cimports and constants above).
include "_verbs.pxi"
include "_buffers.pxi"
include "_hostview.pxi"
include "_completions.pxi"
include "_engine.pxi"
include "_progress.pxi"
include "_submit.pxi"
include "_cuda.pxi"
include "_prepared.pxi"

# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# Buffer exports pinned while the engine may touch them; descriptor
# arrays and notification payloads handed over without a copy.

# ------------------------------------------------------------------ pins

@cython.final
@cython.freelist(16)
cdef class _Pin:
    """One acquired buffer export; released once the engine is done with it."""

    cdef Py_buffer view
    cdef bint held
    cdef object owner  # memory without a buffer export (GPU): the object that owns it

    cdef void release(self) noexcept:
        if self.held:
            self.held = False
            PyBuffer_Release(&self.view)
        self.owner = None

    def __dealloc__(self):
        self.release()


# ------------------------------------------------------------------ descriptors

cdef int _descs_view(object descs, const axf_desc **out, size_t *n) except -1:
    """Checks a descriptor array and points at its rows; no copy, no per-row work."""
    cdef cnp.ndarray a
    if descs is None:
        out[0] = NULL
        n[0] = 0
        return 0
    if not cnp.PyArray_Check(descs):
        raise ValueError(
            f"descs must be a numpy uint64 array of shape (n, {DESC_FIELDS}), "
            f"not {type(descs).__name__}"
        )
    a = <cnp.ndarray>descs
    if cnp.PyArray_NDIM(a) != 2 or cnp.PyArray_DIM(a, 1) != DESC_FIELDS:
        raise ValueError(
            f"descs must have shape (n, {DESC_FIELDS}), not {tuple(descs.shape)}"
        )
    if not cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(a), cnp.NPY_UINT64) \
            or not cnp.PyArray_ISNOTSWAPPED(a):
        raise ValueError(f"descs must have dtype uint64 (native byte order), not {descs.dtype}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a):
        raise ValueError("descs must be C-contiguous and aligned")
    out[0] = <const axf_desc *>cnp.PyArray_DATA(a)
    n[0] = <size_t>cnp.PyArray_DIM(a, 0)
    return 0


cdef int _descs_in(object descs, axf_desc *one, const axf_desc **out, size_t *n) except -1:
    """A descriptor array (_descs_view), or one descriptor as a 6-tuple
    (lrid, loff, rrid, rkey, roff, len) copied into *one: a single-segment
    request then costs no numpy array (most of its post cost otherwise)."""
    cdef tuple d
    if type(descs) is not tuple:
        return _descs_view(descs, out, n)
    d = <tuple>descs
    if len(d) != DESC_FIELDS:
        raise ValueError(f"a descriptor tuple has {DESC_FIELDS} fields, not {len(d)}")
    one.lrid = d[0]
    one.loff = d[1]
    one.rrid = d[2]
    one.rkey = d[3]
    one.roff = d[4]
    one.len = d[5]
    out[0] = one
    n[0] = 1
    return 0


cdef inline bytes _notify_bytes(object notify):
    if notify is None or type(notify) is bytes:
        return notify
    # bytearray / memoryview / array: a copy (MAX_NOTIFY bytes at most are
    # accepted); memoryview() refuses ints, which bytes() would not.
    return bytes(memoryview(notify))


ctypedef struct _drained:  # what a drain took: Engine.drain's (records, completed, bytes)
    Py_ssize_t records
    Py_ssize_t completed
    uint64_t nbytes


ctypedef struct _slot:
    axf_desc one  # storage of a single descriptor given as a tuple
    uint64_t ep
    int op
    const axf_desc *descs
    size_t n
    const char *notify
    size_t notify_len
    uint64_t req_id
    int status


@cython.final
@cython.freelist(64)
@cython.auto_pickle(False)
cdef class PostItem:
    """A batched request of one descriptor and no notification, as C
    integers: what Poster (Agent.write/read's usual case) puts into the
    Submission's batch in place of the item tuple ``(ep, op, (lrid, loff,
    rrid, rkey, roff, len), None, req_id)`` and its descriptor tuple (the two
    made and freed per request, ~250 instructions of a small one; this one
    comes from a free list and holds no object). The engine's post copies it
    into its slot. Read from Python it is that tuple (len, indexing,
    slicing, ==), built on demand: what Submission.hold_region and tests
    read of a batch item."""

    cdef axf_desc one
    cdef uint64_t ep
    cdef uint64_t req_id
    cdef int op

    def __init__(self):
        raise TypeError("PostItem is made by aioxfer's write and read, not directly")

    cdef tuple _tuple(self):
        return (self.ep, self.op,
                (self.one.lrid, self.one.loff, self.one.rrid, self.one.rkey, self.one.roff,
                 self.one.len),
                None, self.req_id)

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return self._tuple()[i]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other):
        if type(other) is PostItem:
            other = (<PostItem>other)._tuple()
        return self._tuple() == other

    def __ne__(self, other):
        return not (self == other)

    __hash__ = None

    def __repr__(self):
        return f"PostItem{self._tuple()!r}"

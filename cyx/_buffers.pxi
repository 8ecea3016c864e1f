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


from cpython.ref cimport PyObject


cdef extern from *:
    """
    /* o's value when o is an exact int of at most 60 bits (3.11: two
       30-bit digits; 3.12+: a compact int), not negative: 1 and *out set;
       else 0 (the caller converts as Cython does, raising what it raises). */
    static inline int axf_u64_small(PyObject *o, uint64_t *out) {
        if (!PyLong_CheckExact(o))
            return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
            if (v < 0)
                return 0;
            *out = (uint64_t)v;
            return 1;
        }
        return 0;
    #else
        switch (Py_SIZE(o)) {
        case 0: *out = 0; return 1;
        case 1: *out = ((PyLongObject *)o)->ob_digit[0]; return 1;
        case 2:
            *out = ((uint64_t)((PyLongObject *)o)->ob_digit[1] << PyLong_SHIFT)
                   | ((PyLongObject *)o)->ob_digit[0];
            return 1;
        default: return 0;
        }
    #endif
    }
    """
    bint axf_u64_small(PyObject *o, uint64_t *out)
    PyObject *axf_tuple_item "PyTuple_GET_ITEM"(object t, Py_ssize_t i)


cdef inline int _u64_in(PyObject *o, uint64_t *out) except -1:
    """*out = the uint64 o is (borrowed), as Cython's conversion gives it
    (its errors too: TypeError, OverflowError), small exact ints inline: the
    conversion's call and reference counting were ~10-20 instructions a
    field, nine fields a request."""
    if not axf_u64_small(o, out):
        out[0] = <uint64_t><object>o
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
    _u64_in(axf_tuple_item(d, 0), &one.lrid)
    _u64_in(axf_tuple_item(d, 1), &one.loff)
    _u64_in(axf_tuple_item(d, 2), &one.rrid)
    _u64_in(axf_tuple_item(d, 3), &one.rkey)
    _u64_in(axf_tuple_item(d, 4), &one.roff)
    _u64_in(axf_tuple_item(d, 5), &one.len)
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

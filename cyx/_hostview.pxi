# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# a byte view of host memory registered by pointer (a DLPack CPU tensor: no
# buffer export), so Region.memoryview, numpy() and every local path that
# moves host memory through a view reach it as they reach a buffer's.

from cpython.buffer cimport PyBuffer_FillInfo


@cython.final
@cython.auto_pickle(False)
cdef class HostView:
    """Exports ``nbytes`` bytes at ``addr`` through the buffer protocol
    (format "B", one dimension; read-only when ``readonly``). ``owner``, the
    object that owns that memory (the registered tensor), is held for as long
    as this object lives, and so for as long as any memoryview or numpy array
    made from it: the memory cannot be freed under a view. Made by
    Region.memoryview from the registration's own address and size."""

    cdef uintptr_t _addr
    cdef Py_ssize_t _nbytes
    cdef bint _readonly
    cdef object _owner

    def __cinit__(self, object owner, uintptr_t addr, Py_ssize_t nbytes, bint readonly):
        if not addr:
            raise ValueError("a host view needs a non-null address")
        if nbytes <= 0:
            raise ValueError(f"a host view needs a positive size, not {nbytes}")
        if owner is None:
            # Nothing would keep the memory alive: a view could outlive it.
            raise ValueError("a host view needs the object that owns its memory")
        self._addr = addr
        self._nbytes = nbytes
        self._readonly = readonly
        self._owner = owner

    def __getbuffer__(self, Py_buffer *view, int flags):
        # BufferError for a writable request of a read-only view.
        PyBuffer_FillInfo(view, self, <void *>self._addr, self._nbytes, self._readonly,
                          flags)

    @property
    def owner(self):
        return self._owner

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def readonly(self):
        return bool(self._readonly)

    def __repr__(self):
        ro = " read-only" if self._readonly else ""
        return f"<HostView {self._nbytes} bytes{ro} of {type(self._owner).__name__}>"

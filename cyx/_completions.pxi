# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# Completion tallies onto a peer's counters (Engine.drain).

# ------------------------------------------------------------------ completions

# ------------------------------------------------------------------ futures

from cpython.ref cimport PyObject

cdef extern from *:
    """
    /* A type's own tp_new / tp_init slots, called directly: what
       Base.__new__(cls) and Base.__init__(self, **kw) do, minus the slot
       wrapper's argument tuple and keyword dict made per call. */
    static PyObject *axf_slot_new(PyObject *base, PyObject *cls, PyObject *args) {
        return ((PyTypeObject *)base)->tp_new((PyTypeObject *)cls, args, NULL);
    }
    static int axf_slot_init(PyObject *base, PyObject *self, PyObject *args, PyObject *kw) {
        return ((PyTypeObject *)base)->tp_init(self, args, kw);
    }
    """
    object axf_slot_new(object base, object cls, object args)
    int axf_slot_init(object base, object self, object args, object kw) except -1

cdef extern from *:
    """
    /* The C Future's first field after its object header is its loop
       (FutureObj_HEAD, CPython 3.11 to 3.14): what asyncio.Future.__init__
       sets, the rest of a freshly allocated future being zeroed (pending,
       no callbacks, no result). */
    static inline PyObject *axf_future_loop(PyObject *f) {
        return *(PyObject **)((char *)f + sizeof(PyObject));
    }
    static inline void axf_future_set_loop(PyObject *f, PyObject *loop) {
        Py_INCREF(loop);
        *(PyObject **)((char *)f + sizeof(PyObject)) = loop;
    }
    """
    PyObject *axf_future_loop(object f)
    void axf_future_set_loop(object f, object loop)

cdef extern from *:
    """
    /* The C Future's done callbacks: its fields fut_callback0 (the first),
       fut_context0 (its context) and fut_callbacks (a list of the rest),
       the second, third and fourth after the loop in FutureObj_HEAD
       (CPython 3.11 to 3.14), by these indices from the loop's; NULL each
       when it has none. Read only once _probe_cb_fields saw them there. */
    enum { AXF_FUT_CALLBACK0 = 1, AXF_FUT_CONTEXT0 = 2, AXF_FUT_CALLBACKS = 3 };
    static inline PyObject *axf_future_field(PyObject *f, int i) {
        return ((PyObject **)((char *)f + sizeof(PyObject)))[i];
    }
    static inline int axf_future_has_callbacks(PyObject *f) {
        PyObject **p = (PyObject **)((char *)f + sizeof(PyObject));
        return p[AXF_FUT_CALLBACK0] != NULL || p[AXF_FUT_CALLBACKS] != NULL;
    }
    /* Takes them off as the C Future's own future_schedule_callbacks does
       before it schedules them: no remove_done_callback, whose comparisons
       run a callback's __eq__ (which may raise, or change the list). */
    static inline void axf_future_clear_callbacks(PyObject *f) {
        PyObject **p = (PyObject **)((char *)f + sizeof(PyObject));
        Py_CLEAR(p[AXF_FUT_CALLBACK0]);
        Py_CLEAR(p[AXF_FUT_CONTEXT0]);
        Py_CLEAR(p[AXF_FUT_CALLBACKS]);
    }
    """
    enum:
        AXF_FUT_CALLBACK0
        AXF_FUT_CONTEXT0
        AXF_FUT_CALLBACKS
    PyObject *axf_future_field(object f, int i)
    bint axf_future_has_callbacks(object f)
    void axf_future_clear_callbacks(object f)

from asyncio import BaseEventLoop as _BaseEventLoop
from asyncio import get_running_loop as _get_running_loop
from asyncio import Future as _Future

cdef tuple _NO_ARGS = ()


cdef inline object _new_instance(object cls):
    """object.__new__(cls) without the Python-level call."""
    return axf_slot_new(object, cls, _NO_ARGS)


# ------------------------------------------------------------------ slots
# Engine.drain reads five fields of every completed transfer and sets the four
# of its result: through their __slots__ member descriptors' offsets, resolved
# once per type, rather than a generic attribute lookup each (a type lookup,
# a descriptor call: ~1.5 k instructions of an awaited 4 KiB write). A type
# whose field is not a plain object slot takes the generic path.

from cpython.dict cimport PyDict_GetItem, PyDict_GetItemWithError
from cpython.float cimport PyFloat_AS_DOUBLE

cdef extern from *:
    """
    /* del lst[:] keeping the list's allocation (Engine.post_drain empties
       the batch lists a submit appends to again at once: freeing their
       arrays, as del does, then growing them again is ~300 instructions a
       request). The size is 0 before an item is released (a release may
       run code that uses the list); a long list the usual way. Up to 256
       items (a batch of 64 or 256 requests in flight: the slice deletion's
       own malloc'd recycle array, the array freed, then regrown by eight
       reallocs while the next batch is appended, were ~80 instructions a
       request). */
    static int axf_list_empty(PyObject *lst) {
        PyObject *keep[256];
        Py_ssize_t i, n = PyList_GET_SIZE(lst);
        if (n > 256)
            return PyList_SetSlice(lst, 0, n, NULL);
        for (i = 0; i < n; i++)
            keep[i] = PyList_GET_ITEM(lst, i);
        Py_SET_SIZE(lst, 0);
        for (i = 0; i < n; i++)
            Py_DECREF(keep[i]);
        return 0;
    }
    """
    int axf_list_empty(list lst) except -1
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.long cimport (PyLong_AsLongLong, PyLong_AsLongLongAndOverflow, PyLong_FromLongLong,
                           PyLong_FromUnsignedLongLong)
from cpython.ref cimport PyObject

cdef extern from *:
    """
    #include <structmember.h>
    /* The offset of a __slots__ member (a PyMemberDescr of an object slot
       of type tp), else -1. */
    static Py_ssize_t axf_slot_offset(PyObject *tp, PyObject *descr) {
        PyMemberDef *m;
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type)
            return -1;
        if (((PyDescrObject *)descr)->d_type != (PyTypeObject *)tp
                && !PyType_IsSubtype((PyTypeObject *)tp, ((PyDescrObject *)descr)->d_type))
            return -1;
        m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY))
            return -1;
        return m->offset;
    }
    static PyObject *axf_type_lookup(PyObject *tp, PyObject *name) {
        return _PyType_Lookup((PyTypeObject *)tp, name);  /* borrowed, or NULL */
    }
    static inline PyObject *axf_slot_ptr(PyObject *o, Py_ssize_t off) {
        return *(PyObject **)((char *)o + off);
    }
    /* o's slot at off, borrowed; NULL when off < 0 (not a plain slot) or
       unset (then the caller takes the generic way). */
    static inline PyObject *axf_slot_get(PyObject *o, Py_ssize_t off) {
        return off >= 0 ? *(PyObject **)((char *)o + off) : NULL;
    }
    static inline void axf_slot_put(PyObject *o, Py_ssize_t off, PyObject *v) {
        PyObject **p = (PyObject **)((char *)o + off);
        PyObject *old = *p;
        Py_INCREF(v);
        *p = v;
        Py_XDECREF(old);
    }
    """
    Py_ssize_t axf_slot_offset(object tp, PyObject *descr)
    PyObject *axf_slot_ptr(object o, Py_ssize_t off)
    PyObject *axf_slot_get(object o, Py_ssize_t off)
    void axf_slot_put(object o, Py_ssize_t off, object v)
    PyObject *axf_type_lookup(object tp, object name)

cdef enum:
    _T_ADMITTED = 0
    _T_PEER = 1
    _T_NBYTES = 2
    _T_T0 = 3
    _T_PATH = 4
    _T_POSTED = 5
    _T_FIELDS = 6

cdef enum:
    _R_NBYTES = 0
    _R_SECONDS = 1
    _R_PATH = 2
    _R_REROUTES = 3
    _R_FIELDS = 4

_T_NAMES = ("_admitted", "peer", "nbytes", "_t0", "_path", "_posted")
_R_NAMES = ("nbytes", "seconds", "path", "reroutes")

cdef object _xfer_type = None  # the transfer type _xfer_off is of
cdef Py_ssize_t _xfer_off[_T_FIELDS]
cdef bint _xfer_future = False  # its done and set_result are asyncio.Future's
cdef object _result_type = None
cdef Py_ssize_t _result_off[_R_FIELDS]
cdef bint _result_fast = False  # every result field is a plain slot

_future_done = _Future.done
_future_set_result = _Future.set_result

cdef extern from *:
    """
    /* The C function behind a C type's method descriptor, if it takes
       (self, NULL) (flags METH_NOARGS) or (self, arg) (METH_O), else NULL:
       asyncio.Future's done and set_result, called without the descriptor's
       vectorcall (~140 instructions a call). */
    typedef PyObject *(*axf_meth1)(PyObject *, PyObject *);
    static axf_meth1 axf_c_method(PyObject *descr, int flags) {
        PyMethodDef *m;
        if (descr == NULL || Py_TYPE(descr) != &PyMethodDescr_Type)
            return NULL;
        m = ((PyMethodDescrObject *)descr)->d_method;
        return m->ml_flags == flags ? (axf_meth1)(void *)m->ml_meth : NULL;
    }
    static inline PyObject *axf_meth_call(axf_meth1 f, PyObject *self, PyObject *arg) {
        return f(self, arg);
    }
    """
    ctypedef PyObject *(*axf_meth1)(PyObject *, PyObject *)
    axf_meth1 axf_c_method(PyObject *descr, int flags)
    object axf_meth_call(axf_meth1 f, object self, PyObject *arg)
    enum:
        METH_NOARGS
        METH_O

cdef axf_meth1 _c_done = axf_c_method(<PyObject *>_future_done, METH_NOARGS)
cdef axf_meth1 _c_set_result = axf_c_method(<PyObject *>_future_set_result, METH_O)


cdef inline bint _fut_done(object f) except -1:
    """asyncio.Future.done(f), f an asyncio.Future (of a type that does not
    override done)."""
    if _c_done != NULL:
        return axf_meth_call(_c_done, f, NULL) is True
    return _future_done(f)


cdef inline int _fut_set_result(object f, object r) except -1:
    """asyncio.Future.set_result(f, r), f an asyncio.Future."""
    if _c_set_result != NULL:
        axf_meth_call(_c_set_result, f, <PyObject *>r)
    else:
        _future_set_result(f, r)
    return 0


cdef int _xfer_resolve(object tp) except -1:
    """_xfer_off for transfer type tp (-1: that field the generic way)."""
    global _xfer_type, _xfer_future
    cdef Py_ssize_t i
    for i in range(_T_FIELDS):
        _xfer_off[i] = axf_slot_offset(tp, axf_type_lookup(tp, _T_NAMES[i]))
    _xfer_future = (getattr(tp, "done", None) is _future_done
                    and getattr(tp, "set_result", None) is _future_set_result)
    _xfer_type = tp
    return 0


cdef int _result_resolve(object tp) except -1:
    global _result_type, _result_fast
    cdef Py_ssize_t i
    _result_fast = True
    for i in range(_R_FIELDS):
        _result_off[i] = axf_slot_offset(tp, axf_type_lookup(tp, _R_NAMES[i]))
        if _result_off[i] < 0:
            _result_fast = False
    _result_type = tp
    return 0


cdef inline object _xfer_get(object t, int field):
    """Field ``field`` of transfer t (type _xfer_type), as getattr gives it."""
    cdef Py_ssize_t off = _xfer_off[field]
    cdef PyObject *v
    if off >= 0:
        v = axf_slot_ptr(t, off)
        if v != NULL:
            return <object>v
    return _xfer_getattr(t, field)


cdef object _xfer_getattr(object t, int field):
    return getattr(t, _T_NAMES[field])  # unset (AttributeError) or not a slot


cdef inline int _mark_posted(object t) except -1:
    """t._posted = True (a transfer handed to the engine)."""
    if type(t) is not _xfer_type:
        _xfer_resolve(type(t))
    if _xfer_off[_T_POSTED] >= 0:
        axf_slot_put(t, _xfer_off[_T_POSTED], True)
    else:
        t._posted = True
    return 0


# ------------------------------------------------------------------ results
# aioxfer.TransferResult (aioxfer.transfer's public name for this class): what
# an awaited transfer returns. It was a frozen slots dataclass: made (a GC
# allocation, its type's reference, four slot stores) and freed (the generic
# subtype_dealloc of a heap type) per request, ~400 instructions of an awaited
# 4 KiB request. Compiled, from a free list, with the dataclass's public
# behaviour: the same fields and constructor, dataclasses.fields, replace,
# asdict and astuple (its __dataclass_fields__ and __dataclass_params__ are a
# frozen dataclass's of the same fields), frozen (FrozenInstanceError), ==
# and hash over the fields, its repr, __match_args__, copy and pickle.

import dataclasses as _dataclasses
import inspect as _inspect

# A frozen dataclass of the same fields (their annotations the strings that
# aioxfer.transfer's, under `from __future__ import annotations`, were): the
# dataclass machinery's view of TransferResult comes from it.
_RESULT_SPEC = _dataclasses.make_dataclass(
    "TransferResult",
    [("nbytes", "int"), ("seconds", "float"), ("path", "str"),
     ("reroutes", "int", _dataclasses.field(default=0))],
    frozen=True, slots=True)

cdef extern from *:
    """
    /* The compiled TransferResult's name as its instances show it (repr,
       __module__, pickle's reference): aioxfer.transfer's, where it is
       public, not the extension's internal _cyx. A static type's
       __module__ and __qualname__ are read from tp_name. */
    static void axf_set_type_name(PyObject *tp, const char *name) {
        ((PyTypeObject *)tp)->tp_name = name;
        PyType_Modified((PyTypeObject *)tp);
    }
    """
    void axf_set_type_name(object tp, const char *name)


@cython.final
@cython.freelist(64)
@cython.auto_pickle(False)
cdef class TransferResult:
    """What a finished transfer moved: bytes, seconds from post to completion,
    the transport that carried it ("shm" or "tcp"), and how many of its parts
    were moved to another rail when theirs failed (tcp)."""

    cdef readonly object nbytes
    cdef readonly object seconds
    cdef readonly object path
    cdef readonly object reroutes

    __match_args__ = ("nbytes", "seconds", "path", "reroutes")
    __dataclass_fields__ = _RESULT_SPEC.__dataclass_fields__
    __dataclass_params__ = _RESULT_SPEC.__dataclass_params__
    # inspect.signature(TransferResult): the dataclass's (a compiled
    # class's __init__ has none to read)
    __signature__ = _inspect.signature(_RESULT_SPEC)

    def __init__(self, nbytes, seconds, path, reroutes=0):
        self.nbytes = nbytes
        self.seconds = seconds
        self.path = path
        self.reroutes = reroutes

    def __setattr__(self, name, value):
        raise _dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise _dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    cdef tuple _fields(self):
        return (self.nbytes, self.seconds, self.path, self.reroutes)

    def __eq__(self, other):
        if type(other) is not TransferResult:
            return NotImplemented
        return self._fields() == (<TransferResult>other)._fields()

    def __ne__(self, other):
        if type(other) is not TransferResult:
            return NotImplemented
        return self._fields() != (<TransferResult>other)._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return (f"{type(self).__qualname__}(nbytes={self.nbytes!r}, "
                f"seconds={self.seconds!r}, path={self.path!r}, reroutes={self.reroutes!r})")

    def __reduce__(self):
        return TransferResult, self._fields()

    def __replace__(self, **changes):
        # copy.replace (Python 3.13+), as a dataclass has it
        return _dataclasses.replace(self, **changes)

    def __setstate__(self, state):
        # (a pickle of the dataclass this was: copyreg's __newobj__, then its
        # fields' values as a list)
        self.nbytes, self.seconds, self.path, self.reroutes = state


axf_set_type_name(TransferResult, "aioxfer.transfer.TransferResult")


cdef object _make_result(object result_type, object nbytes, object seconds, object path,
                         object reroutes):
    """result_type(nbytes, seconds, path, reroutes) without its Python-level
    __init__ (a frozen dataclass's costs as much as the rest of the
    completion): its slots set as that __init__ sets them; the compiled
    TransferResult's fields set directly, from its free list."""
    cdef object r
    cdef TransferResult tr
    if result_type is TransferResult:
        tr = TransferResult.__new__(TransferResult)
        tr.nbytes = nbytes
        tr.seconds = seconds
        tr.path = path
        tr.reroutes = reroutes
        return tr
    if result_type is not _result_type:
        _result_resolve(result_type)
    r = _new_instance(result_type)
    if _result_fast:
        axf_slot_put(r, _result_off[_R_NBYTES], nbytes)
        axf_slot_put(r, _result_off[_R_SECONDS], seconds)
        axf_slot_put(r, _result_off[_R_PATH], path)
        axf_slot_put(r, _result_off[_R_REROUTES], reroutes)
    else:
        PyObject_GenericSetAttr(r, "nbytes", nbytes)
        PyObject_GenericSetAttr(r, "seconds", seconds)
        PyObject_GenericSetAttr(r, "path", path)
        PyObject_GenericSetAttr(r, "reroutes", reroutes)
    return r


# ------------------------------------------------------------------ makers
# Submission.submit makes one Transfer per request: asyncio.Future's own new
# and init, then a dozen fields. Set from Python those are a STORE_ATTR each
# (and a perf_counter() call); FutureMaker sets them through their slots'
# offsets, resolved once, in the same call that makes the future.

cdef extern from *:
    """
    /* asyncio.Future's own am_await (the C Future's iterator), called
       directly: what Future.__await__(f) does, minus the wrapper call. */
    static PyObject *axf_base_await(PyObject *base, PyObject *f) {
        return ((PyTypeObject *)base)->tp_as_async->am_await(f);
    }
    """
    object axf_base_await(object base, object f)

cdef enum:
    _MAKER_GIVEN = 5  # fields given per make() call
    _MAKER_MAX = 32  # fields set to a constant, at most


@cython.final
cdef class FutureMaker:
    """Makes futures of ``cls`` (an asyncio.Future subclass whose fields are
    ``__slots__``) on one loop: ``make(a, b, c, d, e)`` is
    ``f = cls.__new__(cls)``; ``asyncio.Future.__init__(f, **init_kw)``;
    then ``f.<given[i]> = `` the i-th argument, ``f.<clock> =
    time.perf_counter()`` and ``f.<name> = value`` for each of ``fixed``
    (``{name: value}``), as the type's own ``__init__`` would, without it
    (no Python frame, no attribute lookup per field). ``given``: five field
    names. Every field must be a plain object slot of ``cls``."""

    cdef object _cls
    cdef dict _kw
    cdef Py_ssize_t _given[_MAKER_GIVEN]
    cdef Py_ssize_t _clock
    cdef Py_ssize_t _fixed_off[_MAKER_MAX]
    cdef tuple _fixed_val
    cdef Py_ssize_t _nfixed
    # init_kw only {"loop": loop}, on the C Future: the loop is stored in its
    # slot (_loop) rather than through Future.__init__, whose keyword parsing
    # and loop.get_debug() call (a Python frame on asyncio's loops) cost
    # ~700 instructions a future. Only while the loop's debug mode is off
    # (read per future: _loop_dict["_debug"] for asyncio's own get_debug,
    # else _get_debug()): in debug mode __init__ records the future's
    # creation traceback.
    cdef object _loop
    cdef dict _loop_dict
    cdef object _get_debug

    def __cinit__(self, future_cls, dict init_kw, tuple given, str clock, dict fixed):
        cdef Py_ssize_t i
        if not isinstance(future_cls, type) or not issubclass(future_cls, _Future):
            raise TypeError(f"{future_cls!r} is not a subclass of asyncio.Future")
        self._loop = None
        if list(init_kw) == ["loop"] and _maker_fast_init(future_cls, init_kw["loop"]):
            self._loop = init_kw["loop"]
            if (getattr(type(self._loop), "get_debug", None) is _BaseEventLoop.get_debug
                    and type(getattr(self._loop, "__dict__", None)) is dict
                    and "_debug" in self._loop.__dict__):
                self._loop_dict = self._loop.__dict__
            else:
                self._get_debug = self._loop.get_debug
        if len(given) != _MAKER_GIVEN:
            raise ValueError(f"FutureMaker takes {_MAKER_GIVEN} given fields, not {len(given)}")
        if len(fixed) > _MAKER_MAX:
            raise ValueError(f"FutureMaker takes at most {_MAKER_MAX} fixed fields")
        self._cls = future_cls
        self._kw = dict(init_kw)
        for i in range(_MAKER_GIVEN):
            self._given[i] = _maker_offset(future_cls, given[i])
        self._clock = _maker_offset(future_cls, clock)
        vals = []
        self._nfixed = 0
        for name, value in fixed.items():
            self._fixed_off[self._nfixed] = _maker_offset(future_cls, name)
            vals.append(value)
            self._nfixed += 1
        self._fixed_val = tuple(vals)

    def make(self, a, b, c, d, e):
        return self._make(a, b, c, d, e)

    cdef object _make(self, object a, object b, object c, object d, object e):
        cdef Py_ssize_t i
        cdef PyObject *debug
        f = axf_slot_new(_Future, self._cls, _NO_ARGS)
        if self._loop is None:
            axf_slot_init(_Future, f, _NO_ARGS, self._kw)
        else:
            if self._loop_dict is not None:
                # borrowed; GetItemWithError: PyDict_GetItem saves and
                # restores the exception state around its lookup (~100
                # instructions a future more on 3.11)
                debug = PyDict_GetItemWithError(self._loop_dict, "_debug")
                if debug == NULL or (<object>debug is not False and <object>debug):
                    axf_slot_init(_Future, f, _NO_ARGS, self._kw)
                else:
                    axf_future_set_loop(f, self._loop)
            elif self._get_debug():
                axf_slot_init(_Future, f, _NO_ARGS, self._kw)
            else:
                axf_future_set_loop(f, self._loop)
        axf_slot_put(f, self._given[0], a)
        axf_slot_put(f, self._given[1], b)
        axf_slot_put(f, self._given[2], c)
        axf_slot_put(f, self._given[3], d)
        axf_slot_put(f, self._given[4], e)
        axf_slot_put(f, self._clock, _perf_counter())
        for i in range(self._nfixed):
            axf_slot_put(f, self._fixed_off[i], self._fixed_val[i])
        return f


cdef bint _maker_fast_init(object cls, object loop) except -1:
    """Whether futures of cls are made right by storing their loop in the
    C Future's loop field (axf_future_set_loop): the C implementation (not
    asyncio.futures' Python one), whose __init__ is seen to store the loop
    there on a probe."""
    if getattr(_Future, "__module__", None) != "_asyncio" or loop is None:
        return False
    probe = axf_slot_new(_Future, cls, _NO_ARGS)
    if axf_future_loop(probe) != NULL:
        return False
    axf_slot_init(_Future, probe, _NO_ARGS, {"loop": loop})
    return axf_future_loop(probe) == <PyObject *>loop


cdef Py_ssize_t _maker_offset(object cls, object name) except -1:
    cdef Py_ssize_t off
    if not isinstance(name, str):
        raise TypeError(f"a field name is a str, not {name!r}")
    off = axf_slot_offset(cls, axf_type_lookup(cls, name))
    if off < 0:
        raise TypeError(f"{cls.__name__}.{name} is not a plain __slots__ field")
    return off


# Transfer.__await__: the two fields it reads, by offset (one type at a time).
cdef object _await_type = None
cdef Py_ssize_t _await_posted = -1
cdef Py_ssize_t _await_host = -1
# The host type last seen by _eager_await, its version tag then, and
# whether its eager is submission_eager as an attribute lookup finds it (then
# called directly). The tag changes when the type or a base is modified (an
# eager patched on Submission later: looked up again, rev17b).
cdef object _await_host_type = None
cdef unsigned int _await_host_ver = 0
cdef bint _await_host_sub = False

cdef extern from *:
    """
    /* tp's instances have no __dict__ and take their attributes by the
       generic lookup: a method found on the type is what an instance's
       attribute lookup finds. */
    static inline int axf_plain_getattr(PyObject *tp) {
        PyTypeObject *t = (PyTypeObject *)tp;
        return t->tp_dictoffset == 0 && t->tp_getattro == PyObject_GenericGetAttr;
    }
    """
    bint axf_plain_getattr(object tp)


cdef extern from *:
    """
    /* tp's version tag: 0 once it or a base was modified (PyType_Modified),
       a new one after its next method-cache lookup. */
    static inline unsigned int axf_type_version(PyObject *tp) {
        return ((PyTypeObject *)tp)->tp_version_tag;
    }
    """
    unsigned int axf_type_version(object tp)


cdef extern from *:
    """
    /* Type tp's await slot (its own, a heap type's) set to f: what an
       `await` of one of its instances calls, rather than the slot wrapper
       that a class's __await__ in Python gets (slot_am_await: the method
       looked up on the type, bound, called through vectorcall: ~150
       instructions an await). Assigning or deleting tp.__await__ later
       resets the slot as CPython always does. */
    typedef PyObject *(*axf_unary)(PyObject *);
    static int axf_set_am_await(PyObject *tp, axf_unary f) {
        PyTypeObject *t = (PyTypeObject *)tp;
        if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE) || t->tp_as_async == NULL)
            return 0;
        t->tp_as_async->am_await = f;
        PyType_Modified(t);
        return 1;
    }
    """
    ctypedef object (*axf_unary)(object)
    bint axf_set_am_await(object tp, axf_unary f)


def eager_await(f):
    """``f.__await__()`` for an asyncio.Future subclass with fields
    ``_posted`` and ``_host`` (aioxfer.transfer.Transfer's, compiled):
    not posted and not done, ``f._host.eager(f)`` first; then the C
    Future's own await iterator. A class whose own ``__await__`` is this
    function gets it as its C await slot at its first await (the same
    function, without the slot wrapper's lookup and call)."""
    return _eager_await(f)


cdef object _eager_await(object f):
    global _await_type, _await_posted, _await_host
    cdef PyObject *v
    tp = type(f)
    if tp is not _await_type:
        if not issubclass(tp, _Future):
            raise TypeError(f"{tp!r} is not a subclass of asyncio.Future")
        _await_posted = axf_slot_offset(tp, axf_type_lookup(tp, "_posted"))
        _await_host = axf_slot_offset(tp, axf_type_lookup(tp, "_host"))
        _await_type = tp
        if tp.__dict__.get("__await__") is eager_await:
            axf_set_am_await(tp, _eager_await)
    v = axf_slot_ptr(f, _await_posted) if _await_posted >= 0 else NULL
    posted = <object>v if v != NULL else f._posted
    if posted is not True and not posted and not _fut_done(f):
        v = axf_slot_ptr(f, _await_host) if _await_host >= 0 else NULL
        host = <object>v if v != NULL else f._host
        htp = type(host)
        if (htp is not _await_host_type or _await_host_ver == 0
                or axf_type_version(htp) != _await_host_ver):
            _await_host_resolve(htp)
        if _await_host_sub:
            # Submission.eager is submission_eager: its Submitter's _eager,
            # called directly (no method lookup, bound call and argument
            # parsing: ~150 instructions an awaited request).
            _submitter_of(host)._eager(f)
        else:
            host.eager(f)
    return axf_base_await(_Future, f)


cdef int _await_host_resolve(object tp) except -1:
    global _await_host_type, _await_host_sub, _await_host_ver
    _await_host_sub = (axf_plain_getattr(tp)
                       and axf_type_lookup(tp, "eager") == <PyObject *>submission_eager)
    _await_host_type = tp
    _await_host_ver = axf_type_version(tp)  # (the lookup gave it one; 0: looked up each time)
    return 0


# ------------------------------------------------------------------ counters
# A peer's live counters (aioxfer.stats.PeerCounters is this class). Held as
# Python ints in a dataclass, every request's submit (posted, inflight,
# inflight_bytes up), drain (inflight, inflight_bytes down, completed, bytes
# up) and aioxfer.nixl's repost read each as a C integer and made a new int
# for it (~1.2 k instructions a compat request for the in-flight +1 then -1
# alone). Here the eight counts are C integers the compiled paths add to,
# and Python reads and writes them as int attributes as before. A count past
# +-2**62 (a test, or years of bytes) is kept as a Python int: all eight
# then live in a list (_big) and every path takes Python's arithmetic, back
# to C integers once they all fit again.

cdef enum:
    _PK_POSTED = 0
    _PK_COMPLETED = 1
    _PK_FAILED = 2
    _PK_BYTES = 3
    _PK_INFLIGHT = 4
    _PK_INFLIGHT_BYTES = 5
    _PK_QUEUED = 6
    _PK_QUEUED_BYTES = 7
    _PK_INTS = 8

_PK_NAMES = ("posted", "completed", "failed", "bytes", "inflight", "inflight_bytes", "queued",
             "queued_bytes")

cdef extern from *:
    """
    /* A C count's bound: |count| < 2**62 and |delta| <= 2**62, so that a
       sum cannot overflow a long long before it is checked. */
    #define AXF_PK_LIMIT (1LL << 62)
    """
    long long _PK_LIMIT "AXF_PK_LIMIT"

from cpython.number cimport PyNumber_Index


@cython.final
@cython.auto_pickle(False)
cdef class PeerCounters:
    """The live counters of one peer, typed: what the submission path and the
    completion drain (``Engine.drain``, which settles them once per batch
    and peer) update, and ``Peer.statistics()`` snapshots. Not public.

    ``posted``, ``completed``, ``failed``, ``bytes``: its transfers;
    ``inflight``/``inflight_bytes``: admitted to the engine and not yet
    confirmed finished; ``queued``/``queued_bytes``: waiting in the peer's
    scheduler; ``bandwidth`` (bytes/s) and ``latency`` (s): moving averages
    (see aioxfer.stats.ESTIMATE_WEIGHT), 0.0 until a sample. The counts are
    ints (any integer, numpy's too, is taken as its int), the averages
    floats; the compiled paths add to the counts as C integers."""

    cdef long long _v[_PK_INTS]
    cdef list _big  # None while every count is in _v, else all eight as ints
    cdef public double bandwidth
    cdef public double latency

    def __init__(self, posted=0, completed=0, failed=0, bytes=0, inflight=0,
                 inflight_bytes=0, queued=0, queued_bytes=0, double bandwidth=0.0,
                 double latency=0.0):
        cdef Py_ssize_t i
        self._big = None
        for i in range(_PK_INTS):
            self._v[i] = 0
        _pk_set(self, _PK_POSTED, posted)
        _pk_set(self, _PK_COMPLETED, completed)
        _pk_set(self, _PK_FAILED, failed)
        _pk_set(self, _PK_BYTES, bytes)
        _pk_set(self, _PK_INFLIGHT, inflight)
        _pk_set(self, _PK_INFLIGHT_BYTES, inflight_bytes)
        _pk_set(self, _PK_QUEUED, queued)
        _pk_set(self, _PK_QUEUED_BYTES, queued_bytes)
        self.bandwidth = bandwidth
        self.latency = latency

    @property
    def posted(self):
        return _pk_get(self, _PK_POSTED)

    @posted.setter
    def posted(self, value):
        _pk_set(self, _PK_POSTED, value)

    @property
    def completed(self):
        return _pk_get(self, _PK_COMPLETED)

    @completed.setter
    def completed(self, value):
        _pk_set(self, _PK_COMPLETED, value)

    @property
    def failed(self):
        return _pk_get(self, _PK_FAILED)

    @failed.setter
    def failed(self, value):
        _pk_set(self, _PK_FAILED, value)

    @property
    def bytes(self):
        return _pk_get(self, _PK_BYTES)

    @bytes.setter
    def bytes(self, value):
        _pk_set(self, _PK_BYTES, value)

    @property
    def inflight(self):
        return _pk_get(self, _PK_INFLIGHT)

    @inflight.setter
    def inflight(self, value):
        _pk_set(self, _PK_INFLIGHT, value)

    @property
    def inflight_bytes(self):
        return _pk_get(self, _PK_INFLIGHT_BYTES)

    @inflight_bytes.setter
    def inflight_bytes(self, value):
        _pk_set(self, _PK_INFLIGHT_BYTES, value)

    @property
    def queued(self):
        return _pk_get(self, _PK_QUEUED)

    @queued.setter
    def queued(self, value):
        _pk_set(self, _PK_QUEUED, value)

    @property
    def queued_bytes(self):
        return _pk_get(self, _PK_QUEUED_BYTES)

    @queued_bytes.setter
    def queued_bytes(self, value):
        _pk_set(self, _PK_QUEUED_BYTES, value)

    def settle(self, done, req_bytes, moved, double latency, double bandwidth):
        """The tally of ``done`` transfers completed (``req_bytes`` asked,
        ``moved`` moved) and the moving averages after them, per peer and
        drained batch: what Engine.drain applies (compiled) once per run of
        one peer's records."""
        _pk_add_obj(self, _PK_INFLIGHT, -done)
        _pk_add_obj(self, _PK_INFLIGHT_BYTES, -req_bytes)
        _pk_add_obj(self, _PK_COMPLETED, done)
        _pk_add_obj(self, _PK_BYTES, moved)
        self.latency = latency
        self.bandwidth = bandwidth

    def _fields(self):
        return tuple([_pk_get(self, i) for i in range(_PK_INTS)]) + (self.bandwidth,
                                                                      self.latency)

    def __repr__(self):
        f = self._fields()
        return "PeerCounters(" + ", ".join(
            [f"{n}={v!r}" for n, v in zip(_PK_NAMES + ("bandwidth", "latency"), f)]) + ")"

    def __eq__(self, other):
        if type(other) is not PeerCounters:
            return NotImplemented
        return self._fields() == (<PeerCounters>other)._fields()

    __hash__ = None  # mutable, compared by value (as the dataclass was)


cdef object _pk_get(PeerCounters c, int i):
    if c._big is None:
        return PyLong_FromLongLong(c._v[i])
    return c._big[i]


cdef int _pk_set(PeerCounters c, int i, object value) except -1:
    """c's count i = value (an integer: int(value) as operator.index gives it)."""
    cdef object x = PyNumber_Index(value)
    cdef long long ll
    cdef int ovf = 0
    cdef Py_ssize_t k
    if type(x) is not int:
        x = int(x)  # (an int subclass: stored as its value)
    ll = PyLong_AsLongLongAndOverflow(x, &ovf)
    if c._big is None:
        if not ovf and -_PK_LIMIT < ll < _PK_LIMIT:
            c._v[i] = ll
            return 0
        c._big = [PyLong_FromLongLong(c._v[k]) for k in range(_PK_INTS)]
    c._big[i] = x
    for k in range(_PK_INTS):
        ll = PyLong_AsLongLongAndOverflow(c._big[k], &ovf)
        if ovf or not (-_PK_LIMIT < ll < _PK_LIMIT):
            return 0
    for k in range(_PK_INTS):  # all fit again
        c._v[k] = PyLong_AsLongLong(c._big[k])
    c._big = None
    return 0


cdef inline int _pk_add(PeerCounters c, int i, long long d) except -1:
    """c's count i += d, |d| <= 2**62: a C addition while it fits (inline:
    the rest out of line)."""
    cdef long long r
    if c._big is None:
        r = c._v[i] + d
        if -_PK_LIMIT < r < _PK_LIMIT:
            c._v[i] = r
            return 0
    return _pk_add_slow(c, i, d)


cdef int _pk_add_slow(PeerCounters c, int i, long long d) except -1:
    """_pk_add past 2**62: Python's ints."""
    return _pk_set(c, i, _pk_get(c, i) + d)


cdef int _pk_add_obj(PeerCounters c, int i, object d) except -1:
    """c's count i += d, any integer d."""
    return _pk_set(c, i, _pk_get(c, i) + PyNumber_Index(d))


cdef inline int _pk_add_u(PeerCounters c, int i, uint64_t d, bint down) except -1:
    """c's count i += d (-= d when down), d unsigned."""
    if d <= <uint64_t>_PK_LIMIT:
        return _pk_add(c, i, -<long long>d if down else <long long>d)
    return _pk_add_obj(c, i, -PyLong_FromUnsignedLongLong(d) if down
                       else PyLong_FromUnsignedLongLong(d))


# ------------------------------------------------------------------ settle

cdef enum:
    _C_LATENCY = 0
    _C_BANDWIDTH = 1


cdef double _counters_float(object counters, int field) except? -1.0:
    """counters.latency or .bandwidth (field): PeerCounters' C doubles, else
    the attribute (a stand-in's, in tests)."""
    if type(counters) is PeerCounters:
        return ((<PeerCounters>counters).latency if field == _C_LATENCY
                else (<PeerCounters>counters).bandwidth)
    return getattr(counters, "latency" if field == _C_LATENCY else "bandwidth")


# A transfer's peer (aioxfer.peer.Peer): the two fields the drain reads per
# run of its records, by their slots when they are plain ones.
cdef enum:
    _P_COUNTERS = 0
    _P_PATH = 1
    _P_FIELDS = 2

_P_NAMES = ("_counters", "path")
cdef object _peer_type = None
cdef Py_ssize_t _peer_off[_P_FIELDS]


cdef inline object _peer_get(object peer, int field):
    cdef PyObject *v
    cdef Py_ssize_t i
    global _peer_type
    if type(peer) is not _peer_type:
        for i in range(_P_FIELDS):
            _peer_off[i] = axf_slot_offset(type(peer), axf_type_lookup(type(peer), _P_NAMES[i]))
        _peer_type = type(peer)
    if _peer_off[field] >= 0:
        v = axf_slot_ptr(peer, _peer_off[field])
        if v != NULL:
            return <object>v
    return getattr(peer, _P_NAMES[field])


cdef inline bint _slot_int(object o, Py_ssize_t off, long long *out) except -1:
    """*out = o's slot at off, if it holds an exact int within 62 bits."""
    cdef PyObject *v = axf_slot_ptr(o, off)
    cdef long long x
    cdef int ovf = 0
    if v == NULL or type(<object>v) is not int:
        return False
    # (AndOverflow: PyLong_AsLongLong, declared except? -1, would raise
    # OverflowError here for an int past 63 bits, not take the Python path.)
    x = PyLong_AsLongLongAndOverflow(<object>v, &ovf)
    if ovf or x > (1LL << 62) or x < -(1LL << 62):
        return False
    out[0] = x
    return True


cdef inline void _average_in(double *latency, double *bandwidth, uint64_t nbytes,
                             double seconds, uint64_t bandwidth_min, double weight) noexcept:
    """One request that completed in ``seconds`` into its peer's moving
    averages (weight: the newest sample's share; 0.0: none yet, the sample
    is taken): a large one (bandwidth_min or more) into the bandwidth
    average, bytes/s; a small one into the latency average, s. The rule of
    Engine._drain and of the posts completed inside (_prepared.pxi)."""
    cdef double bw
    if nbytes >= bandwidth_min:
        bw = nbytes / seconds if seconds > 0 else 0.0
        bandwidth[0] = bw if bandwidth[0] == 0.0 else (1.0 - weight) * bandwidth[0] + weight * bw
    else:
        latency[0] = seconds if latency[0] == 0.0 else (1.0 - weight) * latency[0] + weight * seconds


cdef int _settle(object counters, Py_ssize_t done, uint64_t req_bytes, uint64_t moved,
                 double latency, double bandwidth) except -1:
    """Engine.drain's per-peer tally of ``done`` completed transfers
    (``req_bytes`` asked, ``moved`` moved) onto the peer's counters
    (PeerCounters, not the Peer): inflight and inflight_bytes down,
    completed and bytes up, latency and bandwidth set. PeerCounters' counts
    as C integers (a Python call costs ~2 k instructions, most of an awaited
    small transfer's completion); any other counters (a stand-in) by their
    own settle(), which does the same."""
    cdef long long v[4]
    cdef PeerCounters pc
    if type(counters) is PeerCounters:  # its counts are C integers
        pc = <PeerCounters>counters
        pc.latency = latency
        pc.bandwidth = bandwidth
        if pc._big is None and req_bytes < <uint64_t>_PK_LIMIT and moved < <uint64_t>_PK_LIMIT:
            v[0] = pc._v[_PK_INFLIGHT] - done
            v[1] = pc._v[_PK_INFLIGHT_BYTES] - <long long>req_bytes
            v[2] = pc._v[_PK_COMPLETED] + done
            v[3] = pc._v[_PK_BYTES] + <long long>moved
            if (-_PK_LIMIT < v[0] and -_PK_LIMIT < v[1] and v[2] < _PK_LIMIT
                    and v[3] < _PK_LIMIT and done >= 0):
                pc._v[_PK_INFLIGHT] = v[0]
                pc._v[_PK_INFLIGHT_BYTES] = v[1]
                pc._v[_PK_COMPLETED] = v[2]
                pc._v[_PK_BYTES] = v[3]
                return 0
        _pk_add(pc, _PK_INFLIGHT, -<long long>done)
        _pk_add_u(pc, _PK_INFLIGHT_BYTES, req_bytes, True)
        _pk_add(pc, _PK_COMPLETED, done)
        _pk_add_u(pc, _PK_BYTES, moved, False)
        return 0
    counters.settle(done, req_bytes, moved, latency, bandwidth)
    return 0


# ------------------------------------------------------------------ wake-ups
# A future's set_result schedules each of its done callbacks (the awaiting
# task's wake-up, mostly) as a handle of its own: asyncio's call_soon, in
# Python, ~4 k instructions each (callgrind), most of a completion with many
# in flight. With Engine.batch_wakeups, the drain takes the callbacks off the
# futures it completes and schedules them all as one handle, which runs each
# in its context as a handle would (an exception goes to the loop's exception
# handler). Callgrind, 256 x 4 KiB in flight, progress "sleep": asyncio
# 31.0 k -> 27.4 k instructions per transfer; uvloop (whose call_soon is
# compiled) 25.7 k -> 26.6 k, so the agent sets it on asyncio's loops only.

_remove_done_callback = _Future.remove_done_callback
cdef class Engine  # (_engine.pxi, included after this file: its _take_error slot)
from contextvars import copy_context as _copy_context


cdef int _cb_fields = -1  # _probe_cb_fields' answer (-1: not asked yet)


cdef bint _probe_cb_fields(object loop) except -1:
    """Whether a future's done callbacks are where axf_future_has_callbacks
    looks (the C Future of CPython 3.11-3.14): seen there on a probe."""
    cdef object f, a, b, ctx
    if getattr(_Future, "__module__", None) != "_asyncio":
        return False
    f = _Future(loop=loop)
    a, b = object(), object()
    if (axf_future_field(f, AXF_FUT_CALLBACK0) != NULL
            or axf_future_field(f, AXF_FUT_CALLBACKS) != NULL):
        return False
    ctx = _copy_context()
    f.add_done_callback(a, context=ctx)
    if (axf_future_field(f, AXF_FUT_CALLBACK0) != <PyObject *>a
            or axf_future_field(f, AXF_FUT_CONTEXT0) != <PyObject *>ctx
            or axf_future_field(f, AXF_FUT_CALLBACKS) != NULL):
        return False
    f.add_done_callback(b)
    if (axf_future_field(f, AXF_FUT_CALLBACK0) != <PyObject *>a
            or axf_future_field(f, AXF_FUT_CALLBACKS) == NULL
            or type(<object>axf_future_field(f, AXF_FUT_CALLBACKS)) is not list
            or len(<list>axf_future_field(f, AXF_FUT_CALLBACKS)) != 1):
        return False
    f.remove_done_callback(a)
    f.remove_done_callback(b)
    return not axf_future_has_callbacks(f)


cdef list _take_callbacks(object fut, list wake, Engine eng):
    """fut's done callbacks, off it and into wake (made if None) as
    (callback, context, fut, loop); fut is not done yet (it is about to be).
    Returns wake. eng: the engine whose drain completes fut (where the
    removal path leaves its error, _take_callbacks_error)."""
    global _cb_fields
    cdef object cbs, cb, ctx, loop
    # A future completed before anyone awaited it (what an awaited lone
    # request's drain and a burst posted by its first await complete) has
    # no callbacks: seen in its fields, not through ``fut._callbacks`` (an
    # attribute lookup and, with callbacks, a new list: ~150 instructions
    # a record).
    if _cb_fields < 0:
        _cb_fields = _probe_cb_fields(fut.get_loop())
    if _cb_fields:
        if not axf_future_has_callbacks(fut):
            return wake
        cbs = fut._callbacks
        axf_future_clear_callbacks(fut)
        if not cbs:
            return wake
        if wake is None:
            wake = []
        loop = fut.get_loop()
        for cb, ctx in cbs:
            wake.append((cb, ctx, fut, loop))
        return wake
    cbs = fut._callbacks
    if not cbs:
        return wake
    return _take_callbacks_removing(fut, wake, cbs, eng)


cdef list _take_callbacks_removing(object fut, list wake, object cbs, Engine eng):
    """_take_callbacks for a future whose callback fields were not probed
    (not the C Future of CPython 3.11-3.14): each taken off by
    remove_done_callback. One that stays on the future (its removal raised:
    a callback's ``__eq__`` runs in its comparisons) is left to the future,
    which schedules it itself once done, and the first error goes to
    eng._take_error, for the drain to report as it reports its callbacks'
    errors (its ``failed``): raised from here, it escaped the drain, whose
    finally freed the batch's other records unread. The engine's own slot,
    not one of the module: a finalizer or a property run by what follows
    (``fut._callbacks``, allocations that collect garbage) may drain another
    engine in between, which then took this error for its own."""
    cdef object cb, ctx, loop, left, err = None
    cdef dict stay
    cdef tuple key
    # A copy: with no first callback (fut_callback0 cleared by a
    # remove_done_callback) the C Future hands out its own list, which the
    # removals below shrink while they walk it: every other callback was
    # skipped, left on the future, and run twice (its own wake-up too).
    cbs = list(cbs)
    for cb, ctx in cbs:
        try:
            _remove_done_callback(fut, cb)
        except Exception as exc:
            if err is None:
                err = exc
    stay = None
    if err is not None:
        if eng._take_error is None:
            eng._take_error = err
        # What is still on the future (by identity, counted): run by it, not
        # by the drain's handle, so that nothing runs twice.
        left = fut._callbacks
        stay = {}
        for cb, ctx in (left or ()):
            key = (id(cb), id(ctx))
            stay[key] = stay.get(key, 0) + 1
    loop = fut.get_loop()
    for cb, ctx in cbs:
        if stay:
            key = (id(cb), id(ctx))
            if stay.get(key, 0) > 0:
                stay[key] -= 1
                continue
        if wake is None:
            wake = []
        wake.append((cb, ctx, fut, loop))
    return wake


cdef inline object _take_callbacks_error(Engine eng):
    """The error _take_callbacks_removing kept for eng (None: none), now
    cleared."""
    cdef object err = eng._take_error
    if err is not None:
        eng._take_error = None
    return err


def _force_cb_fields(int value):
    """Sets _take_callbacks' probe answer (1: the C Future's fields, 0: the
    remove_done_callback path, -1: probe again at the next drain); returns
    the previous one. For tests of the path other futures take."""
    global _cb_fields
    cdef int prev = _cb_fields
    _cb_fields = value
    return prev


cdef int _schedule_callbacks(list wake) except -1:
    """One handle for the callbacks of wake, on their loop (an agent's
    transfers share one)."""
    (<tuple>wake[0])[3].call_soon(_run_callbacks, wake)
    return 0


def _run_callbacks(list wake):
    cdef Py_ssize_t i, n = len(wake)
    cdef tuple w
    for i in range(n):
        w = <tuple>wake[i]
        try:
            w[1].run(w[0], w[2])
        except (SystemExit, KeyboardInterrupt):
            if i + 1 < n:  # the rest still run, as their own handles would
                w[3].call_soon(_run_callbacks, wake[i + 1:])
            raise
        except BaseException as exc:
            w[3].call_exception_handler({
                "message": f"Exception in callback {w[0]!r}({w[2]!r})",
                "exception": exc,
                "future": w[2],
            })


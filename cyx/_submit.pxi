

# Included by _cyx.pyx after _engine.pxi (Submitter.eager calls Engine's
# post_drain directly).

# ------------------------------------------------------------------ submit
# aioxfer.submission.Submission.submit and .eager, their usual cases
# compiled. submit: a transfer
# made, counted on its peer, put in flight and into this loop iteration's
# batch, with every field read and written through its __slots__ offset (the
# Python method's frame and ~70 bytecodes are ~2 k instructions a request,
# the most of any one step of a small request). Anything else (the agent not
# started, the peer lost or with a scheduler, a field that is not a plain
# slot holding what is expected) goes to the Python method, which does all.

cdef enum:
    _S_POSTED = 0
    _S_INFLIGHT = 1
    _S_PENDING = 2
    _S_PENDING_T = 3
    _S_FLUSH_SCHEDULED = 4
    _S_MAKE = 5
    _S_LOOP = 6
    _S_EAGER_STREAK = 7
    _S_ALONE_MAX = 8
    _S_CLOSED = 9
    _S_PENDING_CANCELLED = 10
    _S_COMPLETED = 11
    _S_BYTES = 12
    _S_ENGINE = 13
    _S_ON_RECORD = 14
    _S_RELEASE = 15
    _S_POLLER = 16
    _S_FIELDS = 17

_S_NAMES = ("posted", "inflight", "_pending", "_pending_t", "_flush_scheduled", "_make", "_loop",
            "_eager_streak", "alone_max", "closed", "_pending_cancelled", "completed", "bytes",
            "_engine", "_on_record_cb", "_release_cb", "_poller")

cdef enum:
    _Q_COUNTERS = 0
    _Q_LOST = 1
    _Q_EP = 2
    _Q_SCHED = 3
    _Q_FIELDS = 4

_Q_NAMES = ("_counters", "_lost", "_ep", "_sched")

cdef enum:
    _K_POSTED = 0
    _K_INFLIGHT = 1
    _K_INFLIGHT_BYTES = 2
    _K_FIELDS = 3

_K_NAMES = ("posted", "inflight", "inflight_bytes")


cdef inline object _slot_obj(object o, Py_ssize_t off):
    """o's slot at off, None when unset (what a Python read would raise
    AttributeError for: the checks then take the Python path, or a Python
    error follows, never a NULL dereference)."""
    cdef PyObject *v = axf_slot_ptr(o, off)
    return <object>v if v != NULL else None


cdef bint _offsets(object tp, tuple names, Py_ssize_t *out, Py_ssize_t n) except -1:
    """out[i]: the slot offset of names[i] in tp; False if one is not a plain slot."""
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = axf_slot_offset(tp, axf_type_lookup(tp, names[i]))
        if out[i] < 0:
            return False
    return True


cdef bint _alone_max(object sub, Py_ssize_t off, long long *out) except -1:
    """*out = Submission.alone_max, clamped to 2**62 (2**64 - 1: never)."""
    cdef PyObject *v = axf_slot_ptr(sub, off)
    if v == NULL or type(<object>v) is not int or <object>v < 0:
        return False
    out[0] = (1LL << 62) if <object>v > (1 << 62) else PyLong_AsLongLong(<object>v)
    return True


@cython.final
cdef class Submitter:
    """``submit(peer, opcode, descs, notify, nbytes, op, priority=0)``:
    ``slow(...)`` (Submission's Python submit, same arguments) made cheaper
    for the usual request, with the same effects; ``eager(t)`` likewise for
    ``slow_eager(t)``. ``sub``: the Submission; ``flush``: its bound _flush
    (what a batch's first request schedules); the rest, the constants of
    Submission.eager's post (post_drain's arguments, EAGER_MAX and
    EAGER_STREAK)."""

    cdef object _sub
    cdef object _slow
    cdef object _flush
    cdef object _slow_eager
    cdef object _result_type
    cdef double _weight
    cdef uint64_t _bandwidth_min
    cdef Py_ssize_t _poll_max
    cdef long long _eager_max
    cdef long long _eager_streak
    cdef bint _ok  # sub's fields are plain slots
    cdef Py_ssize_t _s[_S_FIELDS]
    cdef object _peer_type
    cdef bint _peer_ok
    cdef Py_ssize_t _q[_Q_FIELDS]
    cdef object _counters_type
    cdef bint _counters_ok
    cdef Py_ssize_t _k[_K_FIELDS]

    def __cinit__(self, sub, slow, flush, slow_eager, result_type, double weight,
                  uint64_t bandwidth_min, Py_ssize_t poll_max, long long eager_max,
                  long long eager_streak):
        self._sub = sub
        self._slow = slow
        self._flush = flush
        self._slow_eager = slow_eager
        self._result_type = result_type
        self._weight = weight
        self._bandwidth_min = bandwidth_min
        self._poll_max = poll_max
        self._eager_max = eager_max
        self._eager_streak = eager_streak
        self._ok = _offsets(type(sub), _S_NAMES, self._s, _S_FIELDS)

    def submit(self, peer, opcode, descs, notify, nbytes, op, priority=0):
        cdef object sub = self._sub
        cdef PyObject *v
        cdef object make, counters  # owned: make() can run Python that rebinds them
        cdef long long posted, k_posted, k_inflight, k_bytes, n
        if not self._ok or type(nbytes) is not int:
            return self._slow(peer, opcode, descs, notify, nbytes, op, priority)
        if type(peer) is not self._peer_type:
            self._peer_ok = _offsets(type(peer), _Q_NAMES, self._q, _Q_FIELDS)
            self._peer_type = type(peer)
        make = _slot_obj(sub, self._s[_S_MAKE])
        v = axf_slot_ptr(peer, self._q[_Q_LOST]) if self._peer_ok else NULL
        if (not self._peer_ok or make is None or v == NULL
                or <object>v is not False
                or axf_slot_ptr(peer, self._q[_Q_SCHED]) == NULL
                or _slot_obj(peer, self._q[_Q_SCHED]) is not None
                or axf_slot_ptr(peer, self._q[_Q_EP]) == NULL):
            return self._slow(peer, opcode, descs, notify, nbytes, op, priority)
        counters = _slot_obj(peer, self._q[_Q_COUNTERS])
        if counters is None:
            return self._slow(peer, opcode, descs, notify, nbytes, op, priority)
        if type(counters) is not self._counters_type:
            self._counters_ok = _offsets(type(counters), _K_NAMES, self._k, _K_FIELDS)
            self._counters_type = type(counters)
        n = PyLong_AsLongLong(nbytes)
        if (not self._counters_ok or n < 0 or n > (1LL << 62)
                or not _slot_int(sub, self._s[_S_POSTED], &posted)
                or not _slot_int(counters, self._k[_K_POSTED], &k_posted)
                or not _slot_int(counters, self._k[_K_INFLIGHT], &k_inflight)
                or not _slot_int(counters, self._k[_K_INFLIGHT_BYTES], &k_bytes)):
            return self._slow(peer, opcode, descs, notify, nbytes, op, priority)
        inflight = _slot_obj(sub, self._s[_S_INFLIGHT])
        pending = _slot_obj(sub, self._s[_S_PENDING])
        pending_t = _slot_obj(sub, self._s[_S_PENDING_T])
        if type(inflight) is not dict or type(pending) is not list or type(pending_t) is not list:
            return self._slow(peer, opcode, descs, notify, nbytes, op, priority)
        # As Submission.submit does it, in its order.
        req_id = PyLong_FromLongLong(posted + 1)
        axf_slot_put(sub, self._s[_S_POSTED], req_id)
        t = make(sub, req_id, op, peer, nbytes)
        axf_slot_put(counters, self._k[_K_POSTED], PyLong_FromLongLong(k_posted + 1))
        axf_slot_put(counters, self._k[_K_INFLIGHT], PyLong_FromLongLong(k_inflight + 1))
        axf_slot_put(counters, self._k[_K_INFLIGHT_BYTES],
                     PyLong_FromLongLong(k_bytes + n))
        (<dict>inflight)[req_id] = t
        (<list>pending).append(
            (_slot_obj(peer, self._q[_Q_EP]), opcode, descs, notify, req_id))
        (<list>pending_t).append(t)
        v = axf_slot_ptr(sub, self._s[_S_FLUSH_SCHEDULED])
        if v == NULL or <object>v is not True:
            axf_slot_put(sub, self._s[_S_FLUSH_SCHEDULED], True)
            (_slot_obj(sub, self._s[_S_LOOP])).call_soon(self._flush)
        return t

    def eager(self, t):
        """Submission.eager(t), in its order: when the awaited t is alone
        enough (nothing else in flight, small, or alone within alone_max)
        and the streak allows, the batch posted and drained now, then polled
        for if still in flight."""
        return self._eager(t)

    cdef object _eager(self, object t):
        cdef object sub = self._sub
        cdef PyObject *v
        cdef long long streak, nbytes, alone_max
        cdef Py_ssize_t n
        cdef object engine, pending, pending_t, inflight, ts, poller, res, statuses
        if not self._ok:
            return self._slow_eager(t)
        v = axf_slot_ptr(sub, self._s[_S_ENGINE])
        engine = <object>v if v != NULL else None
        pending = _slot_obj(sub, self._s[_S_PENDING])
        pending_t = _slot_obj(sub, self._s[_S_PENDING_T])
        inflight = _slot_obj(sub, self._s[_S_INFLIGHT])
        if type(t) is not _xfer_type:
            _xfer_resolve(type(t))
        nb = _xfer_get(t, _T_NBYTES)
        if (type(engine) is not Engine or type(pending) is not list
                or type(pending_t) is not list or type(inflight) is not dict
                or type(nb) is not int
                or not _slot_int(sub, self._s[_S_EAGER_STREAK], &streak)
                or not _alone_max(sub, self._s[_S_ALONE_MAX], &alone_max)
                or _slot_obj(sub, self._s[_S_CLOSED]) is not False
                or _slot_obj(sub, self._s[_S_PENDING_CANCELLED]) is not False):
            return self._slow_eager(t)
        nbytes = PyLong_AsLongLong(nb)  # an int within 2**63 (else OverflowError)
        n = len(<list>pending)
        if not (n == len(<dict>inflight)
                and (nbytes <= self._eager_max or (n == 1 and nbytes <= alone_max))
                and streak < self._eager_streak):
            return None
        if n == 0:
            return self._slow_eager(t)
        axf_slot_put(sub, self._s[_S_EAGER_STREAK], PyLong_FromLongLong(streak + 1))
        if not self._post(engine, pending, pending_t, inflight, n == 1):
            return None
        # Still in flight (not copied inside the post): poll for it here,
        # then the await may not suspend.
        v = axf_slot_ptr(sub, self._s[_S_POLLER])
        if n == 1 and nbytes <= self._eager_max and v != NULL and <object>v is not None:
            (<object>v).spin_alone(t, _slot_obj(sub, self._s[_S_FLUSH_SCHEDULED]))
        return None

    def flush(self):
        """Submission.flush(), in its order: post_pending(alone), alone when
        one transfer is pending with nothing else in flight (what
        aioxfer.nixl calls per request: the Python method's two frames are
        ~2 k instructions of a small same-host request)."""
        cdef object sub = self._sub
        cdef PyObject *v
        cdef object engine, pending, pending_t, inflight
        if self._ok:
            v = axf_slot_ptr(sub, self._s[_S_ENGINE])
            engine = <object>v if v != NULL else None
            pending = _slot_obj(sub, self._s[_S_PENDING])
            pending_t = _slot_obj(sub, self._s[_S_PENDING_T])
            inflight = _slot_obj(sub, self._s[_S_INFLIGHT])
            if (type(engine) is Engine and type(pending) is list and type(pending_t) is list
                    and type(inflight) is dict
                    and _slot_obj(sub, self._s[_S_CLOSED]) is False
                    and _slot_obj(sub, self._s[_S_PENDING_CANCELLED]) is False):
                if pending:
                    self._post(engine, pending, pending_t, inflight,
                               len(<list>pending_t) == 1 == len(<dict>inflight))
                return None
        sub._flush_now()  # the Python version, which does all
        return None

    cdef bint _post(self, object engine, object pending, object ts, object inflight,
                    bint alone) except -1:
        """Submission.post_pending(alone) once its checks passed (the agent
        open, nothing cancelled, pending not empty): the batch posted and
        drained in one native call, the counts, the poller kicked when
        something stays in flight (then True)."""
        cdef object sub = self._sub
        cdef PyObject *v
        cdef object res, statuses
        try:
            res = (<Engine>engine)._post_drain(
                <list>pending, <list>ts, <dict>inflight,
                _slot_obj(sub, self._s[_S_ON_RECORD]),
                _slot_obj(sub, self._s[_S_RELEASE]),
                self._result_type, self._weight, self._bandwidth_min, self._poll_max, alone)
        except Exception as exc:
            sub._post_raised(ts, exc)
            return False
        statuses = res[0]
        if statuses is None:
            axf_slot_put(sub, self._s[_S_COMPLETED],
                         _slot_obj(sub, self._s[_S_COMPLETED]) + res[2])
            axf_slot_put(sub, self._s[_S_BYTES],
                         _slot_obj(sub, self._s[_S_BYTES]) + res[3])
            if res[1] >= self._poll_max:
                sub.drain()  # more remain
        else:
            sub._refused(ts, statuses)
        if not inflight:
            return False
        v = axf_slot_ptr(sub, self._s[_S_POLLER])
        if v != NULL and <object>v is not None:
            (<object>v).kick()  # poll for the rest before the loop blocks
        return True


cdef object _fast_type = None  # the Submission type _fast_off is of
cdef Py_ssize_t _fast_off = -1


cdef Submitter _submitter_of(object sub):
    """The Submitter in sub's ``_fast`` slot."""
    global _fast_type, _fast_off
    cdef PyObject *v
    if type(sub) is not _fast_type:
        _fast_off = axf_slot_offset(type(sub), axf_type_lookup(type(sub), "_fast"))
        _fast_type = type(sub)
    v = axf_slot_ptr(sub, _fast_off) if _fast_off >= 0 else NULL
    fast = <object>v if v != NULL else sub._fast
    if type(fast) is not Submitter:
        raise TypeError(f"{sub!r}._fast is not a Submitter")
    return <Submitter>fast


def submission_eager(sub, t):
    """Submission.eager (a method: bound to the Submission): its Submitter's
    eager(t), the Submitter found in its ``_fast`` slot."""
    return _submitter_of(sub)._eager(t)


def submission_flush(sub):
    """Submission.flush (a method: bound to the Submission): its Submitter's
    flush(), the Submitter found in its ``_fast`` slot."""
    return _submitter_of(sub).flush()

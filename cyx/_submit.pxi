

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
    _S_TOTALS = 0
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
    _S_ENGINE = 11
    _S_ON_RECORD = 12
    _S_RELEASE = 13
    _S_POLLER = 14
    _S_FIELDS = 15

_S_NAMES = ("_totals", "inflight", "_pending", "_pending_t", "_flush_scheduled", "_make",
            "_loop", "_eager_streak", "alone_max", "closed", "_pending_cancelled", "_engine",
            "_on_record_cb", "_release_cb", "_poller")

cdef enum:
    _Q_COUNTERS = 0
    _Q_LOST = 1
    _Q_EP = 2
    _Q_SCHED = 3
    _Q_FIELDS = 4

_Q_NAMES = ("_counters", "_lost", "_ep", "_sched")


cdef inline int _pk_count_in(PeerCounters c, long long n) except -1:
    """A request of n bytes (0 <= n <= 2**62) posted to c's peer, in flight:
    what Submission.submit adds to its counters (C additions while they
    stay within 2**62)."""
    if (c._big is None and c._v[_PK_POSTED] < _PK_LIMIT - 1
            and c._v[_PK_INFLIGHT] < _PK_LIMIT - 1
            and c._v[_PK_INFLIGHT_BYTES] + n < _PK_LIMIT):
        c._v[_PK_POSTED] += 1
        c._v[_PK_INFLIGHT] += 1
        c._v[_PK_INFLIGHT_BYTES] += n
        return 0
    _pk_add(c, _PK_POSTED, 1)
    _pk_add(c, _PK_INFLIGHT, 1)
    _pk_add(c, _PK_INFLIGHT_BYTES, n)
    return 0


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


cdef inline bint _alone_max(object sub, Py_ssize_t off, long long *out) except -1:
    """*out = Submission.alone_max, clamped to 2**62 (2**64 - 1: never);
    False for a negative one or not an exact int. Compared as a C integer
    (the two rich comparisons with Python ints were ~80 instructions of an
    awaited request)."""
    cdef PyObject *v = axf_slot_ptr(sub, off)
    cdef long long x
    cdef int ovf = 0
    if v == NULL or type(<object>v) is not int:
        return False
    x = PyLong_AsLongLongAndOverflow(<object>v, &ovf)
    if ovf < 0 or (ovf == 0 and x < 0):
        return False
    out[0] = (1LL << 62) if ovf > 0 or x > (1LL << 62) else x
    return True


from cpython.long cimport PyLong_FromSsize_t, PyLong_FromUnsignedLongLong
from types import MethodType as _MethodType  # what a bound FutureMaker.make is


@cython.final
cdef class Submitter:
    """``submit(peer, opcode, descs, notify, nbytes, op, priority=0)``:
    ``slow(...)`` (Submission's Python submit, same arguments) made cheaper
    for the usual request, with the same effects; ``eager(t)`` likewise for
    ``slow_eager(t)``. ``sub``: the Submission; ``flush``: its bound _flush
    (what a batch's first request schedules); the rest, the constants of
    Submission.eager's post (post_drain's arguments, EAGER_MAX,
    EAGER_STREAK and SPIN_ALONE_MAX) and of its drain (POLL_ROUNDS)."""

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
    cdef int _poll_rounds
    cdef long long _spin_alone_max
    cdef bint _ok  # sub's fields are plain slots
    cdef Py_ssize_t _s[_S_FIELDS]
    cdef object _peer_type
    cdef bint _peer_ok
    cdef Py_ssize_t _q[_Q_FIELDS]
    cdef object _make_seen  # sub._make as last seen, and its FutureMaker (or None)
    cdef object _maker
    cdef bint _direct  # _submit(now=True) posted the request itself

    def __cinit__(self, sub, slow, flush, slow_eager, result_type, double weight,
                  uint64_t bandwidth_min, Py_ssize_t poll_max, long long eager_max,
                  long long eager_streak, int poll_rounds, long long spin_alone_max):
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
        self._poll_rounds = poll_rounds
        self._spin_alone_max = spin_alone_max
        self._ok = _offsets(type(sub), _S_NAMES, self._s, _S_FIELDS)

    cdef inline bint _sub_open(self):
        """Whether the Submission's ``closed`` (the agent's: Agent.aclose
        sets both) is False, read through its slot (Prepared's check of the
        agent, ~200 instructions as an attribute of the Agent)."""
        return self._ok and _slot_obj(self._sub, self._s[_S_CLOSED]) is False

    def submit(self, peer, opcode, descs, notify, nbytes, op, priority=0):
        return self._submit(peer, opcode, descs, notify, nbytes, op, priority, False)

    cdef object _submit_now(self, object peer, object opcode, object descs, object nbytes,
                            object op, object priority):
        """submit(peer, opcode, descs, None, nbytes, op, priority), then
        flush() (Prepared.post(now=True), aioxfer.nixl's repost): with
        nothing else batched, the request is posted on its own, without
        going through the batch (no item, no lists, no flush scheduled: ~1 k
        instructions of a small same-host request)."""
        self._direct = False  # (also after a post that raised)
        t = self._submit(peer, opcode, descs, None, nbytes, op, priority, True)
        if not self._direct:
            self._flush_now()
        self._direct = False
        return t

    cdef object _slow_item(self, object peer, object opcode, object descs, object notify,
                           object nbytes, object op, object priority, PostItem item):
        """The Python method's submit, of descs (else of item's descriptor,
        as the tuple Poster would have passed)."""
        if item is not None:
            descs = item._tuple()[2]
        return self._slow(peer, opcode, descs, notify, nbytes, op, priority)

    cdef object _submit(self, object peer, object opcode, object descs, object notify,
                        object nbytes, object op, object priority, bint now,
                        PostItem item=None):
        """submit(...); with item (Poster's: its descriptor and op set,
        descs and notify None, now False), item goes into the batch, its ep
        and req_id filled here, and wherever the request takes another way
        its descriptor goes as the tuple Poster would have passed."""
        cdef object sub = self._sub
        cdef PyObject *v
        cdef object make, counters  # owned: make() can run Python that rebinds them
        cdef object engine
        cdef long long n
        cdef object totals
        # A priority that is not an exact int (a float, None, a numpy
        # integer) goes to the Python method, which checks it for every peer,
        # with limits or not, before anything is made or counted.
        if not self._ok or type(nbytes) is not int or type(priority) is not int:
            return self._slow_item(peer, opcode, descs, notify, nbytes, op, priority, item)
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
            return self._slow_item(peer, opcode, descs, notify, nbytes, op, priority, item)
        counters = _slot_obj(peer, self._q[_Q_COUNTERS])
        if counters is None:
            return self._slow_item(peer, opcode, descs, notify, nbytes, op, priority, item)
        n = PyLong_AsLongLong(nbytes)
        totals = _totals_of(sub, self._s[_S_TOTALS])
        if type(counters) is not PeerCounters or n < 0 or n > (1LL << 62) or totals is None:
            return self._slow_item(peer, opcode, descs, notify, nbytes, op, priority, item)
        inflight = _slot_obj(sub, self._s[_S_INFLIGHT])
        pending = _slot_obj(sub, self._s[_S_PENDING])
        pending_t = _slot_obj(sub, self._s[_S_PENDING_T])
        if type(inflight) is not dict or type(pending) is not list or type(pending_t) is not list:
            return self._slow_item(peer, opcode, descs, notify, nbytes, op, priority, item)
        # As Submission.submit does it, in its order.
        req_id = _next_req_id(<PeerCounters>totals)
        if item is not None:
            item.req_id = <uint64_t>(<PeerCounters>totals)._v[_PK_POSTED]
        if make is not self._make_seen:  # a FutureMaker's bound make: called directly
            self._make_seen = make
            self._maker = None
            if (type(make) is _MethodType and make.__func__ is FutureMaker.make
                    and type(make.__self__) is FutureMaker):
                self._maker = make.__self__
        if self._maker is not None:
            t = (<FutureMaker>self._maker)._make(sub, req_id, op, peer, nbytes)
        else:
            t = make(sub, req_id, op, peer, nbytes)
        _pk_count_in(<PeerCounters>counters, n)
        (<dict>inflight)[req_id] = t
        if now and item is None and not <list>pending and not <list>pending_t and notify is None:
            # Nothing batched: posted now on its own (flush's checks).
            v = axf_slot_ptr(sub, self._s[_S_ENGINE])
            engine = <object>v if v != NULL else None
            if (type(engine) is Engine
                    and _slot_obj(sub, self._s[_S_CLOSED]) is False
                    and _slot_obj(sub, self._s[_S_PENDING_CANCELLED]) is False):
                self._direct = True
                self._post_one(engine, inflight, len(<dict>inflight) == 1, t,
                               _slot_obj(peer, self._q[_Q_EP]), opcode, descs, req_id)
                return t
        if item is None:
            (<list>pending).append(
                (_slot_obj(peer, self._q[_Q_EP]), opcode, descs, notify, req_id))
        elif axf_u64_exact(axf_slot_ptr(peer, self._q[_Q_EP]), &item.ep):
            (<list>pending).append(item)
        else:  # (an endpoint that is not a uint64: the post fails it, as before)
            (<list>pending).append(
                (_slot_obj(peer, self._q[_Q_EP]), opcode, item._tuple()[2], None, req_id))
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
        if n == 1 and nbytes <= self._spin_alone_max and v != NULL and <object>v is not None:
            if isinstance(<object>v, Poller):  # aioxfer.progress's: called directly
                (<Poller>v)._spin_alone(
                    t, _slot_obj(sub, self._s[_S_FLUSH_SCHEDULED]) is True)
            else:
                (<object>v).spin_alone(t, _slot_obj(sub, self._s[_S_FLUSH_SCHEDULED]))
        return None

    def flush(self):
        """Submission.flush(), in its order: post_pending(alone), alone when
        one transfer is pending with nothing else in flight (what
        aioxfer.nixl calls per request: the Python method's two frames are
        ~2 k instructions of a small same-host request)."""
        return self._flush_now()

    cdef object _flush_now(self):
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

    cdef object _scheduled_flush(self):
        """Submission._flush (what a batch's first submit schedules on the
        loop), in its order: _flush_scheduled and _eager_streak reset (the
        loop ran), then post_pending() (not alone) for the usual case, else
        the Python post_pending, which does all. Once a loop iteration with
        a batch: the Python methods' two frames, post_drain's call and the
        totals' properties were ~2.5 k instructions (an awaited request in
        every EAGER_STREAK, a batch of 64 in flight)."""
        cdef object sub = self._sub
        cdef PyObject *v
        cdef object engine, pending, pending_t, inflight
        if not self._ok:
            return sub._flush_py()
        axf_slot_put(sub, self._s[_S_FLUSH_SCHEDULED], False)
        axf_slot_put(sub, self._s[_S_EAGER_STREAK], 0)
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
                self._post(engine, pending, pending_t, inflight, False)
            return None
        sub.post_pending()
        return None

    def drain(self):
        """Submission.drain(), in its order: up to POLL_ROUNDS drain calls
        while each takes poll_max records, the agent's totals counted, then
        (more remain) the next drain scheduled on the loop. What the engine's
        eventfd reader and aioxfer.nixl's poll (once per request of a tight
        poller) call: the Python method's frame is ~700 instructions."""
        return self._drain_now()

    cdef object _drain_now(self):
        cdef object sub = self._sub
        cdef PyObject *v
        cdef object engine, inflight
        cdef _drained d
        cdef int rounds = self._poll_rounds
        if not self._ok:
            return sub._drain_py()
        v = axf_slot_ptr(sub, self._s[_S_ENGINE])
        engine = <object>v if v != NULL else None
        inflight = _slot_obj(sub, self._s[_S_INFLIGHT])
        if type(engine) is not Engine or type(inflight) is not dict:
            return sub._drain_py()
        while rounds:
            (<Engine>engine)._drain(
                <dict>inflight, _slot_obj(sub, self._s[_S_ON_RECORD]),
                _slot_obj(sub, self._s[_S_RELEASE]),
                self._result_type, self._weight, self._bandwidth_min, self._poll_max, &d)
            _add_totals(sub, self._s[_S_TOTALS], &d)
            if d.records < self._poll_max:
                return None
            rounds -= 1
        _slot_obj(sub, self._s[_S_LOOP]).call_soon(sub.drain)  # more remain: the loop breathes
        return None

    cdef bint _post(self, object engine, object pending, object ts, object inflight,
                    bint alone) except -1:
        """Submission.post_pending(alone) once its checks passed (the agent
        open, nothing cancelled, pending not empty): the batch posted and
        drained in one native call, then _posted."""
        cdef object sub = self._sub
        cdef object statuses
        cdef _drained d
        try:
            statuses = (<Engine>engine)._post_drain(
                <list>pending, <list>ts, <dict>inflight,
                _slot_obj(sub, self._s[_S_ON_RECORD]),
                _slot_obj(sub, self._s[_S_RELEASE]),
                self._result_type, self._weight, self._bandwidth_min, self._poll_max, alone,
                &d)
        except Exception as exc:
            sub._post_raised(ts, exc)
            return False
        return self._posted(statuses, &d, ts, inflight)

    cdef bint _post_one(self, object engine, object inflight, bint alone, object t,
                        object ep, object opcode, object descs, object req_id) except -1:
        """_post of transfer t alone (ep, opcode, descs, req_id: its item),
        not batched: its fields passed as they are (no item tuple made and
        freed per request)."""
        cdef object sub = self._sub
        cdef object statuses
        cdef _drained d
        try:
            statuses = (<Engine>engine)._post_one_drain(
                ep, opcode, descs, req_id, t, <dict>inflight,
                _slot_obj(sub, self._s[_S_ON_RECORD]),
                _slot_obj(sub, self._s[_S_RELEASE]),
                self._result_type, self._weight, self._bandwidth_min, self._poll_max, alone,
                &d)
        except Exception as exc:
            sub._post_raised([t], exc)
            return False
        return self._posted(statuses, &d, None, inflight, t)

    cdef bint _posted(self, object statuses, const _drained *d, object ts, object inflight,
                      object t=None) except -1:
        """The end of _post and _post_one: statuses None (all posted), the
        drain's counts d added to the totals, else the refusal of ts (else
        of [t]); the poller kicked when something stays in flight (then
        True)."""
        cdef object sub = self._sub
        cdef PyObject *v
        if statuses is None:
            _add_totals(sub, self._s[_S_TOTALS], d)
            if d.records >= self._poll_max:
                sub.drain()  # more remain
        else:
            sub._refused(ts if t is None else [t], statuses)
        if not inflight:
            return False
        v = axf_slot_ptr(sub, self._s[_S_POLLER])
        if v != NULL and <object>v is not None:  # poll for the rest before the loop blocks
            if isinstance(<object>v, Poller):
                (<Poller>v)._kick()
            else:
                (<object>v).kick()
        return True


cdef int _add_total(object sub, Py_ssize_t off, int i, object d) except -1:
    """The Submission's total i (_PK_COMPLETED, _PK_BYTES: its _totals, a
    PeerCounters at slot offset off) += d (a count the engine returned, an
    int): a C addition while it fits (the generic add and its type dispatch,
    then a new int, cost ~85 instructions a total, two totals per post and
    per drain); nothing to do for 0."""
    cdef PyObject *v = axf_slot_ptr(sub, off)
    cdef long long dv
    cdef int ovf = 0
    if v == NULL or type(<object>v) is not PeerCounters:
        setattr(sub, _PK_NAMES[i], getattr(sub, _PK_NAMES[i]) + d)  # (not ours: as Python)
        return 0
    if type(d) is int:
        dv = PyLong_AsLongLongAndOverflow(d, &ovf)
        if not ovf and 0 <= dv <= _PK_LIMIT:
            if dv:
                _pk_add(<PeerCounters><object>v, i, dv)
            return 0
    return _pk_add_obj(<PeerCounters><object>v, i, d)


cdef int _add_totals(object sub, Py_ssize_t off, const _drained *d) except -1:
    """A drain's completed transfers and their bytes (d) added to the
    Submission's totals (_add_total's, from C integers: no int made per
    count while the totals are C integers, nothing to do for a drain that
    completed nothing; other totals as _add_total adds to them)."""
    cdef PyObject *v = axf_slot_ptr(sub, off)
    cdef PeerCounters c
    if v != NULL and type(<object>v) is PeerCounters:
        c = <PeerCounters><object>v
        if d.completed == 0 and d.nbytes == 0:
            return 0
        if (c._big is None and d.completed <= _PK_LIMIT and d.nbytes <= <uint64_t>_PK_LIMIT
                and c._v[_PK_COMPLETED] + d.completed < _PK_LIMIT
                and c._v[_PK_BYTES] + <long long>d.nbytes < _PK_LIMIT):
            c._v[_PK_COMPLETED] += d.completed
            c._v[_PK_BYTES] += <long long>d.nbytes
            return 0
    _add_total(sub, off, _PK_COMPLETED, PyLong_FromSsize_t(d.completed))
    _add_total(sub, off, _PK_BYTES, PyLong_FromUnsignedLongLong(d.nbytes))
    return 0


cdef inline object _totals_of(object sub, Py_ssize_t off):
    """The Submission's totals (_totals, a PeerCounters), when its next
    request id is a C integer; else None (the Python method then counts)."""
    cdef PyObject *v = axf_slot_ptr(sub, off)
    if (v == NULL or type(<object>v) is not PeerCounters
            or (<PeerCounters><object>v)._big is not None
            or (<PeerCounters><object>v)._v[_PK_POSTED] >= _PK_LIMIT - 1):
        return None
    return <object>v


cdef inline object _next_req_id(PeerCounters totals):
    """totals.posted += 1, the new value: the request id Submission.submit
    hands out (totals from _totals_of)."""
    totals._v[_PK_POSTED] += 1
    return PyLong_FromLongLong(totals._v[_PK_POSTED])


# ------------------------------------------------------------------ post
# Agent.write and Agent.read, their usual case (one Segment and one
# RemoteSegment of an open peer's region, no notification, not CUDA) compiled:
# the Python method's checks (a dozen attribute reads and comparisons) and its
# frame, with its keyword-only parameters' set-up, are ~1.5 k instructions of
# a small request. The same checks here, through the fields' slot offsets;
# the request then goes to Submitter._submit as the method's submit call
# would. Anything else (another shape, a check that fails, a field that is
# not a plain slot holding what is expected) goes to the Python method itself.

cdef enum:
    _G_REGION = 0
    _G_OFFSET = 1
    _G_LENGTH = 2
    _G_FIELDS = 3

_G_NAMES = ("region", "offset", "length")

cdef enum:
    _L_AGENT = 0
    _L_CLOSED = 1
    _L_KIND = 2
    _L_RID = 3
    _L_FIELDS = 4

_L_NAMES = ("_agent", "_closed", "kind", "rid")

cdef enum:
    _F_PEER = 0
    _F_GONE = 1
    _F_KIND = 2
    _F_RID = 3
    _F_KEY = 4
    _F_FIELDS = 5

_F_NAMES = ("peer", "_gone", "kind", "rid", "key")

cdef enum:
    _H_HOST = 0
    _H_PATH = 1
    _H_FIELDS = 2

_H_NAMES = ("_host", "path")

cdef extern from *:
    """
    /* o is set and of exactly type tp (borrowed: no reference taken). */
    static inline int axf_is_type(PyObject *o, PyObject *tp) {
        return o != NULL && (PyObject *)Py_TYPE(o) == tp;
    }
    """
    bint axf_is_type(PyObject *o, object tp)
    PyObject *_py_false "Py_False"  # (<PyObject *>False is the C int 0)

cdef extern from *:
    """
    /* *out = o when o (borrowed, may be NULL) is an exact int within
       0..2**64-1: 1; else 0, no error set (the caller keeps the object, and
       the post converts it and raises what it raised before). Linux's
       unsigned long is 64 bits: PyLong_AsUnsignedLong's digit loop, not
       PyLong_AsUnsignedLongLong's byte-array conversion past one digit. */
    static inline int axf_u64_exact(PyObject *o, uint64_t *out) {
        unsigned long v;
        if (o == NULL || !PyLong_CheckExact(o))
            return 0;
    #if ULONG_MAX == UINT64_MAX
        v = PyLong_AsUnsignedLong(o);
    #else
        v = PyLong_AsUnsignedLongLong(o);
    #endif
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        *out = (uint64_t)v;
        return 1;
    }
    """
    bint axf_u64_exact(PyObject *o, uint64_t *out)

# Region.kind of host memory (interned: "host" literals are; a kind that is
# not this very object goes to the Python method, which compares by value).
cdef object _KIND_HOST = _sys.intern("host")
cdef object _OP_WRITE_OBJ = AXF_OP_WRITE
cdef object _OP_READ_OBJ = AXF_OP_READ


@cython.final
cdef class Poster:
    """``write(src, dst, *, notify=None, priority=0)`` and ``read(dst, src,
    *, priority=0)``: ``agent``'s (``slow_write`` and ``slow_read``, the
    Agent class's functions, called with agent first) made cheaper for one
    Segment and one RemoteSegment, with the same effects. ``sub``: the
    agent's Submission (its ``closed`` is the agent's); ``peers``: the
    PeerTable its peers' ``_host`` is; the rest, the types the usual case
    is made of (Segment, RemoteSegment, Region, RemoteRegion, Peer)."""

    cdef object _agent
    cdef object _slow_write
    cdef object _slow_read
    cdef object _sub
    cdef Submitter _submitter
    cdef object _peers
    cdef object _seg_t, _rseg_t, _region_t, _rregion_t, _peer_t
    cdef bint _ok
    cdef Py_ssize_t _closed_off
    cdef Py_ssize_t _g[_G_FIELDS]
    cdef Py_ssize_t _rg[_G_FIELDS]
    cdef Py_ssize_t _l[_L_FIELDS]
    cdef Py_ssize_t _f[_F_FIELDS]
    cdef Py_ssize_t _h[_H_FIELDS]

    def __cinit__(self, agent, slow_write, slow_read, sub, Submitter submitter, peers,
                  seg_t, rseg_t, region_t, rregion_t, peer_t):
        self._agent = agent
        self._slow_write = slow_write
        self._slow_read = slow_read
        self._sub = sub
        self._submitter = submitter
        self._peers = peers
        self._seg_t, self._rseg_t = seg_t, rseg_t
        self._region_t, self._rregion_t, self._peer_t = region_t, rregion_t, peer_t
        self._closed_off = axf_slot_offset(type(sub), axf_type_lookup(type(sub), "closed"))
        self._ok = (self._closed_off >= 0
                    and _offsets(seg_t, _G_NAMES, self._g, _G_FIELDS)
                    and _offsets(rseg_t, _G_NAMES, self._rg, _G_FIELDS)
                    and _offsets(region_t, _L_NAMES, self._l, _L_FIELDS)
                    and _offsets(rregion_t, _F_NAMES, self._f, _F_FIELDS)
                    and _offsets(peer_t, _H_NAMES, self._h, _H_FIELDS))

    # write and read: what the agent binds as its write and read, callables
    # (bound to this Poster) whose call with two positional arguments and no
    # keyword goes straight to _one (axf_poster_fast): the method wrapper's
    # parsing of the keyword-only parameters, their defaults and references
    # were ~100 instructions of an awaited small request. Any other call goes
    # to _write / _read, the same methods with their full signatures.
    @property
    def write(self):
        """write(src, dst, *, notify=None, priority=0), bound to this Poster."""
        return axf_poster_method(0, self)

    @property
    def read(self):
        """read(dst, src, *, priority=0), bound to this Poster."""
        return axf_poster_method(1, self)

    def _write(self, src, dst, *, notify=None, priority=0):
        if notify is None:
            t = self._one(src, dst, _OP_WRITE_OBJ, "write", priority, AXF_OP_WRITE)
            if t is not None:
                return t
        return self._slow_write(self._agent, src, dst, notify=notify, priority=priority)

    def _read(self, dst, src, *, priority=0):
        t = self._one(dst, src, _OP_READ_OBJ, "read", priority, AXF_OP_READ)
        if t is not None:
            return t
        return self._slow_read(self._agent, dst, src, priority=priority)

    cdef object _one(self, object seg, object rseg, object opcode, object op, object priority,
                     int opc):
        """The request of local seg and far rseg, submitted, if it is the
        usual case the Python method's checks pass for at once; else None.
        Its fields read as borrowed references (no reference counting for
        what is only compared)."""
        cdef PyObject *lr
        cdef PyObject *rr
        cdef PyObject *peer
        cdef PyObject *n
        cdef PyObject *m
        cdef PyObject *path
        cdef PyObject *d[5]
        cdef PostItem item
        cdef long long ln
        cdef int ovf = 0
        if not self._ok or type(seg) is not self._seg_t or type(rseg) is not self._rseg_t:
            return None
        lr = axf_slot_ptr(seg, self._g[_G_REGION])
        rr = axf_slot_ptr(rseg, self._rg[_G_REGION])
        if not axf_is_type(lr, self._region_t) or not axf_is_type(rr, self._rregion_t):
            return None
        peer = axf_slot_ptr(<object>rr, self._f[_F_PEER])
        n = axf_slot_ptr(seg, self._g[_G_LENGTH])
        m = axf_slot_ptr(rseg, self._rg[_G_LENGTH])
        if (not axf_is_type(peer, self._peer_t)
                or axf_slot_ptr(self._sub, self._closed_off) != _py_false
                or axf_slot_ptr(<object>lr, self._l[_L_AGENT]) != <PyObject *>self._agent
                or axf_slot_ptr(<object>lr, self._l[_L_CLOSED]) != _py_false
                or axf_slot_ptr(<object>rr, self._f[_F_GONE]) != _py_false
                or not axf_is_type(n, int) or not axf_is_type(m, int)
                or axf_slot_ptr(<object>peer, self._h[_H_HOST]) != <PyObject *>self._peers
                or axf_slot_ptr(<object>lr, self._l[_L_KIND])
                != axf_slot_ptr(<object>rr, self._f[_F_KIND])
                or axf_slot_ptr(<object>lr, self._l[_L_KIND]) == NULL
                # GPU memory (one kind on both sides): the Python method asks
                # whether the peer's path reaches it (tcp does not)
                or axf_slot_ptr(<object>lr, self._l[_L_KIND]) != <PyObject *>_KIND_HOST):
            return None
        # Both exact ints: compared as C integers (a rich comparison and a
        # truth test are ~250 instructions); one past 63 bits, or 0, goes to
        # the Python method.
        if n != m:
            ln = PyLong_AsLongLongAndOverflow(<object>n, &ovf)
            if ovf or ln <= 0 or ln != PyLong_AsLongLongAndOverflow(<object>m, &ovf) or ovf:
                return None
        elif PyLong_AsLongLongAndOverflow(<object>n, &ovf) <= 0 or ovf:
            return None
        path = axf_slot_ptr(<object>peer, self._h[_H_PATH])
        # (a str compared as one: its length first, no rich comparison)
        if not axf_is_type(path, str) or <str>path == "cuda":  # its _path is set after
            return None
        d[0] = axf_slot_ptr(<object>lr, self._l[_L_RID])
        d[1] = axf_slot_ptr(seg, self._g[_G_OFFSET])
        d[2] = axf_slot_ptr(<object>rr, self._f[_F_RID])
        d[3] = axf_slot_ptr(<object>rr, self._f[_F_KEY])
        d[4] = axf_slot_ptr(rseg, self._rg[_G_OFFSET])
        if d[0] == NULL or d[1] == NULL or d[2] == NULL or d[3] == NULL or d[4] == NULL:
            return None  # unset: the Python method raises what it raises
        # Every field a uint64 (what they always are): the request goes into
        # the batch as a PostItem, no descriptor or item tuple made; else as
        # the tuple (the post converts its fields and fails it as before).
        item = PostItem.__new__(PostItem)
        if (axf_u64_exact(d[0], &item.one.lrid) and axf_u64_exact(d[1], &item.one.loff)
                and axf_u64_exact(d[2], &item.one.rrid) and axf_u64_exact(d[3], &item.one.rkey)
                and axf_u64_exact(d[4], &item.one.roff) and axf_u64_exact(n, &item.one.len)):
            item.op = opc
            return self._submitter._submit(<object>peer, opcode, None, None, <object>n, op,
                                           priority, False, item)
        return self._submitter._submit(
            <object>peer, opcode,
            (<object>d[0], <object>d[1], <object>d[2], <object>d[3], <object>d[4], <object>n),
            None, <object>n, op, priority, False)


cdef object _poster_write2(object p, object src, object dst):
    """Poster._write(src, dst): notify None, priority 0."""
    t = (<Poster>p)._one(src, dst, _OP_WRITE_OBJ, "write", 0, AXF_OP_WRITE)
    if t is not None:
        return t
    return (<Poster>p)._slow_write((<Poster>p)._agent, src, dst, notify=None, priority=0)


cdef object _poster_read2(object p, object dst, object src):
    """Poster._read(dst, src): priority 0."""
    t = (<Poster>p)._one(dst, src, _OP_READ_OBJ, "read", 0, AXF_OP_READ)
    if t is not None:
        return t
    return (<Poster>p)._slow_read((<Poster>p)._agent, dst, src, priority=0)


cdef extern from *:
    """
    /* A Poster's write and read as the agent binds them: builtin methods
       (self: the Poster) taking vectorcall arguments. Two positional
       arguments and no keyword: the compiled two-argument function (set
       once at import); else the Poster's _write / _read with the same
       arguments (their full signatures: keywords, errors). */
    typedef PyObject *(*axf_call2)(PyObject *, PyObject *, PyObject *);
    static axf_call2 axf_poster_two[2];
    static PyObject *axf_poster_full_name[2];

    static PyObject *axf_poster_call(int i, PyObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
        PyObject *m, *r;
        if (nargs == 2 && kwnames == NULL)
            return axf_poster_two[i](self, args[0], args[1]);
        m = PyObject_GetAttr(self, axf_poster_full_name[i]);
        if (m == NULL)
            return NULL;
        r = PyObject_Vectorcall(m, args, nargs, kwnames);
        Py_DECREF(m);
        return r;
    }
    static PyObject *axf_poster_write_call(PyObject *self, PyObject *const *args,
                                           Py_ssize_t nargs, PyObject *kwnames) {
        return axf_poster_call(0, self, args, nargs, kwnames);
    }
    static PyObject *axf_poster_read_call(PyObject *self, PyObject *const *args,
                                          Py_ssize_t nargs, PyObject *kwnames) {
        return axf_poster_call(1, self, args, nargs, kwnames);
    }
    static PyMethodDef axf_poster_defs[2] = {
        {"write", (PyCFunction)(void (*)(void))axf_poster_write_call,
         METH_FASTCALL | METH_KEYWORDS,
         "write($self, src, dst, *, notify=None, priority=0)\\n--\\n\\nAgent.write's usual case"},
        {"read", (PyCFunction)(void (*)(void))axf_poster_read_call,
         METH_FASTCALL | METH_KEYWORDS,
         "read($self, dst, src, *, priority=0)\\n--\\n\\nAgent.read's usual case"},
    };
    static int axf_poster_init(axf_call2 w, axf_call2 r) {
        axf_poster_two[0] = w;
        axf_poster_two[1] = r;
        axf_poster_full_name[0] = PyUnicode_InternFromString("_write");
        axf_poster_full_name[1] = PyUnicode_InternFromString("_read");
        return axf_poster_full_name[0] != NULL && axf_poster_full_name[1] != NULL ? 0 : -1;
    }
    static PyObject *axf_poster_method(int i, PyObject *poster) {
        return PyCFunction_NewEx(&axf_poster_defs[i], poster, NULL);
    }
    """
    ctypedef object (*axf_call2)(object, object, object)
    int axf_poster_init(axf_call2 w, axf_call2 r) except -1
    object axf_poster_method(int i, object poster)

axf_poster_init(_poster_write2, _poster_read2)


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
    return _submitter_of(sub)._flush_now()


def submission_scheduled_flush(sub):
    """Submission._flush (a method: bound to the Submission, what a batch's
    first submit schedules): its Submitter's _scheduled_flush(), the
    Submitter found in its ``_fast`` slot."""
    return _submitter_of(sub)._scheduled_flush()


def submission_drain(sub):
    """Submission.drain (a method: bound to the Submission): its Submitter's
    drain(), the Submitter found in its ``_fast`` slot."""
    return _submitter_of(sub)._drain_now()



# Included by _cyx.pyx after _submit.pxi.

# ------------------------------------------------------------------ prepared
# Agent.prepare: one request posted again and again (a NIXL prepared
# transfer, reposted by transfer()). Its pair is checked once, when it is
# prepared; a post checks only what can change since (the agent closed, the
# local region deregistered, the remote one gone) and calls the agent's
# Submitter.submit with the descriptor made then: no Python frame (the
# agent's write/read and its checks are ~2 k instructions of a small
# same-host request). A peer lost is submit's to see (its transfers fail as
# they are submitted, as agent.write's). Anything else (a pair that is not
# one Segment and one RemoteSegment, a GPU path, something changed) posts
# through agent.write/read, which raises what they raise.


@cython.final
cdef class Prepared:
    """``post(now=False)``: what ``Agent.write(local, remote,
    priority=priority)`` (``op`` "write") or ``Agent.read`` returns, posted
    again; ``now``: handed to the engine before it returns (Agent.flush), not
    at the end of the loop iteration or at its await. Made by Agent.prepare."""

    cdef readonly object op
    cdef readonly object local
    cdef readonly object remote
    cdef readonly object nbytes
    cdef readonly int priority
    cdef object _agent
    cdef object _slow
    cdef object _submit
    cdef object _flush
    cdef object _peer
    cdef object _opcode
    cdef object _descs
    cdef object _lr
    cdef object _rr
    cdef Py_ssize_t _lr_closed  # slot offsets; -1: not the one-pair path
    cdef Py_ssize_t _rr_gone
    cdef Submitter _submitter  # submit and flush are its own (else None): called directly
    cdef object _starts  # a vector pair's merged descriptors' first indices (or None)
    cdef object _done_t  # a Transfer of an earlier post that succeeded: see _post_repost

    def __cinit__(self, agent, op, local, remote, slow, submit, flush, peer, opcode, descs,
                  nbytes, int priority, lr, rr):
        self._agent = agent
        self.op = op
        self.local = local
        self.remote = remote
        self._slow = slow
        self._submit = submit
        self._flush = flush
        self._peer = peer
        self._opcode = opcode
        self._descs = descs
        self.nbytes = nbytes
        self.priority = priority
        self._lr = lr
        self._rr = rr
        self._lr_closed = self._rr_gone = -1
        self._submitter = _submitter_behind(submit, flush)
        if descs is None and peer is None and lr is None and rr is None:
            lr, rr = self._vectors(agent)
            self._lr, self._rr = lr, rr
        if lr is not None and rr is not None and type(nbytes) is int:
            self._lr_closed = axf_slot_offset(type(lr), axf_type_lookup(type(lr), "_closed"))
            self._rr_gone = axf_slot_offset(type(rr), axf_type_lookup(type(rr), "_gone"))
            if self._lr_closed < 0 or self._rr_gone < 0:
                self._lr_closed = self._rr_gone = -1

    cdef tuple _vectors(self, object agent):
        """A pair of two SegmentLists (a local Region's, a peer's
        RemoteRegion's: what aioxfer.nixl prepares for a request of several
        descriptors): its descriptors made now, once, as write/read make them
        on each call (from_vectors, then coalesce), so that a post is one
        compiled call too; (local region, remote region), or (None, None):
        posted through write/read (anything else, or a pair they refuse)."""
        from aioxfer.descriptors import SegmentList, coalesce, from_vectors
        local, remote = self.local, self.remote
        if type(local) is not SegmentList or type(remote) is not SegmentList:
            return None, None
        try:
            peer, descs, nbytes = from_vectors(local, remote, owner=agent)
        except Exception:  # (refused: the post raises what write/read raise)
            return None, None
        if peer.path == "cuda" or nbytes != self.nbytes:  # (cuda: its transfers carry their path)
            return None, None
        self._descs, self._starts = coalesce(descs)
        self._peer = peer
        return local.region, remote.region

    def post(self, bint now=False):
        return self._post(now)

    cdef object _post(self, bint now):
        cdef PyObject *closed
        cdef PyObject *gone
        cdef object t
        if self._lr_closed >= 0:
            closed = axf_slot_ptr(self._lr, self._lr_closed)
            gone = axf_slot_ptr(self._rr, self._rr_gone)
            if (closed != NULL and <object>closed is False and gone != NULL
                    and <object>gone is False
                    and (self._submitter._sub_open() if self._submitter is not None
                         else self._agent._closed is False)):
                if self._starts is not None:
                    # (Merged descriptors: the request's first indices set
                    # before it can complete, as write/read set them.)
                    t = self._submit(self._peer, self._opcode, self._descs, None, self.nbytes,
                                     self.op, self.priority)
                    t._starts = self._starts
                    if now:
                        self._flush()
                    return t
                if self._submitter is not None:
                    if now:
                        return _post_now(self._submitter, self._peer, self._opcode,
                                         self._descs, self.nbytes, self.op, self.priority)
                    return self._submitter._submit(self._peer, self._opcode, self._descs,
                                                   None, self.nbytes, self.op, self.priority,
                                                   False)
                t = self._submit(self._peer, self._opcode, self._descs, None, self.nbytes,
                                 self.op, self.priority)
                if now:
                    self._flush()
                return t
        if self.priority:
            t = self._slow(self.local, self.remote, priority=self.priority)
        else:
            t = self._slow(self.local, self.remote)
        if now:
            self._flush()
        return t

    cdef object _post_repost(self):
        """_post(True) for aioxfer.nixl's plain repost (_cyx.nixl_transfer),
        which reads of what it returns only whether and how it ended: a post
        that completes inside (AXF_POST_DONE) makes no Transfer and returns
        the one of an earlier post that succeeded (_done_t: done, its result
        that post's), the transfer still counted as any (_post_small).
        Anything else as _post(True)."""
        cdef PyObject *closed
        cdef PyObject *gone
        if (self._done_t is not None and self._lr_closed >= 0 and self._starts is None
                and self._submitter is not None):
            closed = axf_slot_ptr(self._lr, self._lr_closed)
            gone = axf_slot_ptr(self._rr, self._rr_gone)
            if (closed != NULL and <object>closed is False and gone != NULL
                    and <object>gone is False and self._submitter._sub_open()):
                t = _post_small(self, self._submitter)
                if t is not None:
                    return t
        t = self._post(True)
        if self._done_t is None and type(t) is _xfer_type and _fut_state(t) == 1:
            self._done_t = t
        return t

    def __repr__(self):
        return f"<Prepared {self.op} of {self.nbytes} bytes>"


# ------------------------------------------------------------------ done inside the post
# Prepared.post(now=True) (aioxfer.nixl's repost) with nothing else batched:
# Submitter._submit_now's request, posted with AXF_POST_INLINE. A same-host
# copy done inside the post (a small request, alone) then comes back as
# AXF_POST_DONE with no completion record: its transfer completed here as
# Engine._drain completes one from its record (out of inflight, the peer's
# counters settled, its result set, the agent's totals), without the
# record's push into the ring, the poll that takes it back, the drain's
# batch around it and the record's free (~2 k instructions of a 4 KiB
# request: callgrind). The request is counted and put in flight before the
# post, as _submit does, so that whatever the post does not finish inside
# (a copy the workers take, a failure, a queued request) completes through
# the ring as before; the ring is still looked at after the post (a
# completion that came meanwhile is drained, as _posted_drain does).
# Anything else that _submit_now would not post on its own goes to it.

cdef extern from "aioxfer.h":
    enum:
        AXF_POST_INLINE
        AXF_POST_DONE


cdef object _post_now(Submitter s, object peer, object opcode, object descs, object nbytes,
                      object op, object priority):
    """s._submit_now(peer, opcode, descs, nbytes, op, priority), the post's
    own completion taken inside it when it can be (see above)."""
    cdef object sub = s._sub
    cdef PyObject *v
    cdef object counters, engine, inflight, pending, pending_t, t, req_id, statuses
    cdef _drained d
    cdef long long n
    cdef object totals
    cdef int st
    if not s._ok or type(nbytes) is not int or type(priority) is not int:
        return s._submit_now(peer, opcode, descs, nbytes, op, priority)
    if type(peer) is not s._peer_type:
        s._peer_ok = _offsets(type(peer), _Q_NAMES, s._q, _Q_FIELDS)
        s._peer_type = type(peer)
    v = axf_slot_ptr(sub, s._s[_S_ENGINE])
    engine = <object>v if v != NULL else None
    inflight = _slot_obj(sub, s._s[_S_INFLIGHT])
    pending = _slot_obj(sub, s._s[_S_PENDING])
    pending_t = _slot_obj(sub, s._s[_S_PENDING_T])
    # (The checks of _submit and of its post on its own; its FutureMaker
    # resolved by an earlier _submit, else that one's.)
    if (not s._peer_ok or s._maker is None
            or _slot_obj(sub, s._s[_S_MAKE]) is not s._make_seen
            or type(engine) is not Engine or (<Engine>engine)._polling
            or (<Engine>engine)._e == NULL
            or type(inflight) is not dict or type(pending) is not list
            or type(pending_t) is not list or pending or pending_t
            or _slot_obj(sub, s._s[_S_CLOSED]) is not False
            or _slot_obj(sub, s._s[_S_PENDING_CANCELLED]) is not False
            or _slot_obj(peer, s._q[_Q_LOST]) is not False
            or axf_slot_ptr(peer, s._q[_Q_SCHED]) == NULL
            or _slot_obj(peer, s._q[_Q_SCHED]) is not None
            or axf_slot_ptr(peer, s._q[_Q_EP]) == NULL):
        return s._submit_now(peer, opcode, descs, nbytes, op, priority)
    counters = _slot_obj(peer, s._q[_Q_COUNTERS])
    if counters is None:
        return s._submit_now(peer, opcode, descs, nbytes, op, priority)
    n = PyLong_AsLongLong(nbytes)
    totals = _totals_of(sub, s._s[_S_TOTALS])
    if type(counters) is not PeerCounters or n < 0 or n > (1LL << 62) or totals is None:
        return s._submit_now(peer, opcode, descs, nbytes, op, priority)
    # As Submitter._submit does it, in its order.
    req_id = _next_req_id(<PeerCounters>totals)
    t = (<FutureMaker>s._maker)._make(sub, req_id, op, peer, nbytes)
    _pk_count_in(<PeerCounters>counters, n)
    (<dict>inflight)[req_id] = t
    statuses = None
    d.records = d.completed = 0
    d.nbytes = 0
    try:
        st = _post_inline(<Engine>engine, _slot_obj(peer, s._q[_Q_EP]), opcode, descs, req_id,
                          len(<dict>inflight) == 1)
        if st == AXF_POST_DONE or st == AXF_OK:
            _mark_posted(t)
            if st == AXF_POST_DONE:
                _done_inline(<Engine>engine, s, <dict>inflight, t, req_id)
            (<Engine>engine)._posted_drain(
                False, <dict>inflight, _slot_obj(sub, s._s[_S_ON_RECORD]),
                _slot_obj(sub, s._s[_S_RELEASE]), s._result_type, s._weight,
                s._bandwidth_min, s._poll_max, &d)
        else:
            statuses = [st]
    except Exception as exc:  # (as Submitter._post_one)
        sub._post_raised([t], exc)
        return t
    s._posted(statuses, &d, None, inflight, t)
    return t


# aioxfer.nixl's repost of a small request (Prepared._post_repost): posted
# before its Transfer is made, made only when the post did not complete
# inside (AXF_POST_DONE), so that the usual same-host repost makes and frees
# no future, no result, no inflight entry (~2 k instructions of a 4 KiB
# request: callgrind). Safe only while no other thread can drain the ring
# between the post and the Transfer's entry into inflight (a record drained
# before it would be dropped as not ours): the GIL is kept throughout (one
# descriptor up to _GIL_KEPT_BYTES: posted without releasing it), the
# FutureMaker makes the Transfer without a Python frame (its loop's debug
# mode off: Future.__init__ runs Python, whose eval loop may hand the GIL
# over), and the cyclic GC is off for that stretch (a collection runs
# finalizers: Python code). Anything else: None, nothing done (the caller
# posts the usual way).

cdef extern from "Python.h":
    int PyGC_Disable()
    int PyGC_Enable()


cdef object _post_small(Prepared p, Submitter s):
    """p's post(True) as _post_now's, its Transfer made after the post and
    only if it did not complete inside (then p._done_t is returned); None
    when it cannot be posted so (nothing done)."""
    cdef object sub = s._sub
    cdef object peer = p._peer, nbytes = p.nbytes, descs = p._descs
    cdef PyObject *v
    cdef object counters, engine, inflight, pending, pending_t, t = None, req_id, statuses
    cdef _drained d
    cdef FutureMaker mk
    cdef Engine e
    cdef _slot *sl
    cdef long long n
    cdef object totals
    cdef double t0, now, seconds, latency, bandwidth
    cdef uint32_t flags = AXF_POST_DEFER | AXF_POST_POLL | AXF_POST_INLINE
    cdef int st = 0
    cdef int gc_was
    cdef object err = None
    if (not s._ok or type(nbytes) is not int or type(p.priority) is not int
            or type(peer) is not s._peer_type or not s._peer_ok or s._maker is None):
        return None
    mk = <FutureMaker>s._maker
    if mk._loop is None or mk._loop_dict is None:
        return None
    v = PyDict_GetItemWithError(mk._loop_dict, "_debug")
    if v == NULL or <object>v is not False:
        return None
    v = axf_slot_ptr(sub, s._s[_S_ENGINE])
    engine = <object>v if v != NULL else None
    inflight = _slot_obj(sub, s._s[_S_INFLIGHT])
    pending = _slot_obj(sub, s._s[_S_PENDING])
    pending_t = _slot_obj(sub, s._s[_S_PENDING_T])
    if (_slot_obj(sub, s._s[_S_MAKE]) is not s._make_seen
            or type(engine) is not Engine or (<Engine>engine)._polling
            or (<Engine>engine)._posting or (<Engine>engine)._e == NULL
            or type(inflight) is not dict or type(pending) is not list
            or type(pending_t) is not list or pending or pending_t
            or _slot_obj(sub, s._s[_S_CLOSED]) is not False
            or _slot_obj(sub, s._s[_S_PENDING_CANCELLED]) is not False
            or _slot_obj(peer, s._q[_Q_LOST]) is not False
            or axf_slot_ptr(peer, s._q[_Q_SCHED]) == NULL
            or _slot_obj(peer, s._q[_Q_SCHED]) is not None
            or axf_slot_ptr(peer, s._q[_Q_EP]) == NULL):
        return None
    counters = _slot_obj(peer, s._q[_Q_COUNTERS])
    # (Its counts C integers: nothing in the stretch below runs Python.)
    if type(counters) is not PeerCounters or (<PeerCounters>counters)._big is not None:
        return None
    n = PyLong_AsLongLong(nbytes)
    totals = _totals_of(sub, s._s[_S_TOTALS])
    if n <= 0 or n > _GIL_KEPT_BYTES or totals is None:
        return None
    e = <Engine>engine
    e._ensure_slots(1)
    sl = e._slots
    _descs_in(descs, &sl.one, &sl.descs, &sl.n)  # (descs, held by p, keeps its memory)
    if sl.descs != &sl.one or sl.one.len != <uint64_t>n:
        return None  # (not one descriptor of the request's bytes)
    if not inflight:
        flags |= AXF_POST_ALONE
    # Counted as Submitter._submit counts it (its Transfer, if any, later).
    t0 = _perf_counter()
    req_id = _next_req_id(<PeerCounters>totals)
    _pk_count_in(<PeerCounters>counters, n)
    gc_was = PyGC_Disable()
    try:
        try:
            sl.ep = _slot_obj(peer, s._q[_Q_EP])
            sl.op = p._opcode
            sl.req_id = req_id
            sl.notify = NULL
            sl.notify_len = 0
            e._posting = True
            try:
                e._post_slots(1, flags, <uint64_t>n)  # (the GIL kept: n <= _GIL_KEPT_BYTES)
            finally:
                e._posting = False
            st = e._slots[0].status
        except Exception as exc:  # (nothing posted: refused below, the GC back on)
            err = exc
        if err is not None:
            pass  # (refused after the finally)
        elif st == AXF_POST_DONE:
            # Engine._drain's tally of one successful record (_done_inline's,
            # without a Transfer: no result, no future to resolve).
            now = _perf_counter()
            seconds = now - t0
            latency = _counters_float(counters, _C_LATENCY)
            bandwidth = _counters_float(counters, _C_BANDWIDTH)
            _average_in(&latency, &bandwidth, <uint64_t>n, seconds, s._bandwidth_min, s._weight)
            _settle(counters, 1, <uint64_t>n, <uint64_t>n, latency, bandwidth)
            _add_total(sub, s._s[_S_TOTALS], _PK_COMPLETED, 1)
            _add_total(sub, s._s[_S_TOTALS], _PK_BYTES, nbytes)
            t = p._done_t
        else:
            # In flight (or refused): its Transfer, as _submit makes it, in
            # inflight before anything can drain its record.
            t = mk._make(sub, req_id, p.op, peer, nbytes)
            if type(t) is not _xfer_type:
                _xfer_resolve(type(t))
            if _xfer_off[_T_T0] >= 0:
                axf_slot_put(t, _xfer_off[_T_T0], t0)
            (<dict>inflight)[req_id] = t
    finally:
        if gc_was:
            PyGC_Enable()
    if err is not None:
        # As Submitter._post_one's refusal; after the stretch without the GC,
        # as it runs Python (finish_failed, the loop's call_soon): another
        # thread may take the GIL there (rev14).
        t = mk._make(sub, req_id, p.op, peer, nbytes)
        (<dict>inflight)[req_id] = t
        sub._post_raised([t], err)
        return t
    if st == AXF_POST_DONE:
        # The ring looked at all the same, as after any post: what this
        # thread pushed quietly meanwhile (a region freed by the request's
        # end) is drained now, nothing else would signal it; and with
        # others in flight, the poller kicked (Submitter._posted). Neither,
        # the usual repost: nothing more to do (the look is a read of the
        # ring's count, no lock).
        if not inflight and axf_wait_ex(e._e, 0, AXF_WAIT_POLLS) == 0:
            return t
        e._posted_drain(
            False, <dict>inflight, _slot_obj(sub, s._s[_S_ON_RECORD]),
            _slot_obj(sub, s._s[_S_RELEASE]), s._result_type, s._weight,
            s._bandwidth_min, s._poll_max, &d)
        s._posted(None, &d, None, inflight)
        return t
    statuses = None
    d.records = d.completed = 0
    d.nbytes = 0
    try:
        if st == AXF_OK:
            _mark_posted(t)
            e._posted_drain(
                False, <dict>inflight, _slot_obj(sub, s._s[_S_ON_RECORD]),
                _slot_obj(sub, s._s[_S_RELEASE]), s._result_type, s._weight,
                s._bandwidth_min, s._poll_max, &d)
        else:
            statuses = [st]
    except Exception as exc:  # (as Submitter._post_one)
        sub._post_raised([t], exc)
        return t
    s._posted(statuses, &d, None, inflight, t)
    return t


cdef int _post_inline(Engine e, object ep, object opcode, object descs, object req_id,
                      bint alone) except? -100:
    """Engine._post_one_drain's post (not nested: the caller checked), with
    AXF_POST_INLINE: the request's status, or AXF_POST_DONE."""
    cdef uint32_t flags = AXF_POST_DEFER | AXF_POST_POLL | AXF_POST_INLINE
    cdef _slot *sl
    if alone:
        flags |= AXF_POST_ALONE
    e._open()
    if e._posting:
        raise RuntimeError("Engine.post_many() is not reentrant")
    e._posting = True
    try:
        e._ensure_slots(1)
        sl = e._slots
        sl.ep = ep
        sl.op = opcode
        sl.req_id = req_id
        sl.notify = NULL
        sl.notify_len = 0
        _descs_in(descs, &sl.one, &sl.descs, &sl.n)
        # (descs, held by the caller, keeps an array's memory alive.)
        e._post_slots(1, flags, sl.one.len if sl.descs == &sl.one
                      and sl.one.len <= _GIL_KEPT_BYTES else _GIL_KEPT_BYTES + 1)
    finally:
        e._posting = False
    return e._slots[0].status


cdef int _done_inline(Engine e, Submitter s, dict inflight, object t, object req_id) except -1:
    """Engine._drain's completion of a successful record of transfer t
    (every byte it asked moved, no reroute), for a post that completed
    inside (AXF_POST_DONE, no record): the same effects, in its order."""
    cdef object sub = s._sub
    cdef object peer, counters, path, r, asked
    cdef object failed = None
    cdef list wake = None
    cdef double now = _perf_counter(), seconds, latency, bandwidth
    cdef uint64_t nb
    if inflight.pop(req_id, None) is None:
        return 0  # (not ours any more: the drain drops such a record)
    if type(t) is not _xfer_type:
        _xfer_resolve(type(t))
    if _xfer_get(t, _T_ADMITTED):
        try:
            _slot_obj(sub, s._s[_S_RELEASE])(t)
        except Exception as exc:
            failed = exc
    peer = _xfer_get(t, _T_PEER)
    counters = _peer_get(peer, _P_COUNTERS)
    latency = _counters_float(counters, _C_LATENCY)
    bandwidth = _counters_float(counters, _C_BANDWIDTH)
    asked = _xfer_get(t, _T_NBYTES)
    nb = <uint64_t>asked
    seconds = now - <double>_xfer_get(t, _T_T0)
    _average_in(&latency, &bandwidth, nb, seconds, s._bandwidth_min, s._weight)
    try:
        if not (_fut_done(t) if _xfer_future else t.done()):
            path = _xfer_get(t, _T_PATH)
            if path is None:
                path = _peer_get(peer, _P_PATH)
            r = _make_result(s._result_type, asked, seconds, path, 0)
            if _xfer_future and e.batch_wakeups:
                wake = _take_callbacks(t, wake, e)
                if e._take_error is not None:  # (the remove_done_callback path's)
                    exc = _take_callbacks_error(e)
                    if failed is None:
                        failed = exc
                _fut_set_result(t, r)
            elif _xfer_future:
                _fut_set_result(t, r)
            else:
                t.set_result(r)
    finally:
        _settle(counters, 1, nb, nb, latency, bandwidth)
        if wake:
            _schedule_callbacks(wake)
    _add_total(sub, s._s[_S_TOTALS], _PK_COMPLETED, 1)
    _add_total(sub, s._s[_S_TOTALS], _PK_BYTES, asked)
    if failed is not None:
        _report_drain_error(failed)
    return 0


cdef Submitter _submitter_behind(object submit, object flush):
    """The Submitter whose submit ``submit`` is (bound) and whose
    Submission's flush ``flush`` is (bound submission_flush), else None:
    Prepared then calls its C methods, not the two bound ones (~400
    instructions a post)."""
    s = getattr(submit, "__self__", None)
    if type(s) is not Submitter or getattr(submit, "__name__", None) != "submit":
        return None
    if getattr(flush, "__func__", None) is not submission_flush:
        return None
    if _submitter_of(flush.__self__) is not s:
        return None
    return <Submitter>s


# ------------------------------------------------------------------ C calls
# What aioxfer.nixl's two hot calls ask of a request's future (done, and
# then whether it succeeded) and of the runtime's lock (an RLock: acquire,
# release), called through the C functions behind the types' methods: a
# method call from here is a lookup and a vectorcall, ~150 instructions,
# several per request. Only for types that do not override them (checked
# once per type); anything else through the methods.

cdef extern from *:
    """
    /* The C function behind a METH_VARARGS|METH_KEYWORDS method
       descriptor (an RLock's acquire), else NULL. */
    typedef PyObject *(*axf_methkw)(PyObject *, PyObject *, PyObject *);
    static axf_methkw axf_c_method_kw(PyObject *descr) {
        PyMethodDef *m;
        if (descr == NULL || Py_TYPE(descr) != &PyMethodDescr_Type)
            return NULL;
        m = ((PyMethodDescrObject *)descr)->d_method;
        return m->ml_flags == (METH_VARARGS | METH_KEYWORDS)
            ? (axf_methkw)(void *)m->ml_meth : NULL;
    }
    static inline PyObject *axf_methkw_call(axf_methkw f, PyObject *self, PyObject *args) {
        return f(self, args, NULL);
    }
    """
    ctypedef PyObject *(*axf_methkw)(PyObject *, PyObject *, PyObject *)
    axf_methkw axf_c_method_kw(PyObject *descr)
    object axf_methkw_call(axf_methkw f, object self, object args)

cdef axf_meth1 _c_cancelled = axf_c_method(<PyObject *>_Future.cancelled, METH_NOARGS)
cdef axf_meth1 _c_exception = axf_c_method(<PyObject *>_Future.exception, METH_NOARGS)
cdef object _fs_type = None  # the future type last seen
cdef bint _fs_c = False  # its done, cancelled and exception are the C Future's

cdef int _fut_state(object f) except -1:
    """0: future f is not done; 1: done with a result; 2: failed or
    cancelled."""
    global _fs_type, _fs_c
    cdef type tp = type(f)
    if tp is not _fs_type:
        _fs_c = (_c_done != NULL and _c_cancelled != NULL and _c_exception != NULL
                 and issubclass(tp, _Future)
                 and getattr(tp, "done", None) is _future_done
                 and getattr(tp, "cancelled", None) is _Future.cancelled
                 and getattr(tp, "exception", None) is _Future.exception)
        _fs_type = tp
    if _fs_c:
        if axf_meth_call(_c_done, f, NULL) is not True:
            return 0
        if axf_meth_call(_c_cancelled, f, NULL) is True:
            return 2
        return 1 if axf_meth_call(_c_exception, f, NULL) is None else 2
    if not f.done():
        return 0
    return 1 if not f.cancelled() and f.exception() is None else 2


cdef object _lk_type = None  # the lock type last seen
cdef axf_methkw _lk_acquire = NULL  # its acquire and release, when C functions
cdef axf_meth1 _lk_release = NULL
cdef tuple _ARGS_NOWAIT = (False,)


cdef inline int _lock_types(object lock) except -1:
    global _lk_type, _lk_acquire, _lk_release
    tp = type(lock)
    if tp is not _lk_type:
        _lk_acquire = axf_c_method_kw(axf_type_lookup(tp, "acquire"))
        _lk_release = axf_c_method(axf_type_lookup(tp, "release"), METH_NOARGS)
        if _lk_acquire == NULL or _lk_release == NULL:
            _lk_acquire = NULL
            _lk_release = NULL
        _lk_type = tp
    return 0


# ------------------------------------------------------------------ the runtime's lock
# aioxfer.nixl's Runtime.lock: threading.RLock's semantics (re-entrant, its
# owner's only to release; a blocking acquire releases the GIL and runs
# signal handlers while it waits), its acquire and release plain C calls
# for the hot paths here (_lock_acquire: ~50 instructions, where RLock's
# acquire(False) parses its arguments, ~600 a call).

from cpython.pythread cimport (
    PY_LOCK_ACQUIRED, PY_LOCK_INTR, PyLockStatus, PyThread_allocate_lock, PyThread_free_lock,
    PyThread_release_lock, PyThread_type_lock,
)

cdef extern from "pythread.h":
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock, long long microseconds,
                                             int intr_flag) nogil
    unsigned long _thread_ident "PyThread_get_thread_ident" () nogil

cdef extern from "Python.h":
    int Py_MakePendingCalls() except -1


@cython.final
cdef class RLock:
    """A re-entrant lock, as threading.RLock."""
    cdef PyThread_type_lock _lock
    cdef unsigned long _owner
    cdef unsigned long _count

    def __cinit__(self):
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self._lock != NULL:
            if self._count:
                PyThread_release_lock(self._lock)
            PyThread_free_lock(self._lock)

    cdef inline bint _try(self) noexcept:
        """The acquire without blocking."""
        cdef unsigned long me = _thread_ident()
        if self._count and self._owner == me:
            self._count += 1
            return True
        if PyThread_acquire_lock_timed(self._lock, 0, 0) == PY_LOCK_ACQUIRED:
            self._owner = me
            self._count = 1
            return True
        return False

    cdef bint _acquire(self, double timeout) except -1:
        """Blocking, for up to ``timeout`` s (< 0: for ever)."""
        cdef PyThread_type_lock lk = self._lock
        cdef PyLockStatus r
        cdef long long us
        cdef double deadline = 0.0
        if self._try():
            return True
        if timeout == 0.0:
            return False
        if timeout > 0:
            deadline = _perf_counter() + timeout
        while True:
            us = -1 if timeout < 0 else <long long>((deadline - _perf_counter()) * 1e6)
            if timeout >= 0 and us <= 0:
                return self._try()
            with nogil:
                r = PyThread_acquire_lock_timed(lk, us, 1)
            if r == PY_LOCK_ACQUIRED:
                self._owner = _thread_ident()
                self._count = 1
                return True
            if r == PY_LOCK_INTR:
                Py_MakePendingCalls()  # (a signal handler's exception raises here)
                continue
            return False

    cdef inline int _release(self) except -1:
        if self._count == 0 or self._owner != _thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self._count -= 1
        if self._count == 0:
            self._owner = 0
            PyThread_release_lock(self._lock)
        return 0

    def acquire(self, blocking=True, timeout=-1.0):
        """As threading.RLock.acquire: whether it was acquired."""
        cdef double t
        if blocking is True and type(timeout) is float and <double>timeout == -1.0:  # (usual)
            return self._try() or self._acquire(-1)
        t = timeout
        if not blocking:
            if t != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return self._try()
        if t < 0 and t != -1:
            raise ValueError("timeout value must be a non-negative number")
        return self._acquire(t)

    def release(self):
        self._release()

    def __enter__(self):
        return self._acquire(-1)

    def __exit__(self, *exc):
        self._release()

    def _is_owned(self):
        return self._count > 0 and self._owner == _thread_ident()

    def __repr__(self):
        return (f"<{'locked' if self._count else 'unlocked'} aioxfer._cyx.RLock "
                f"owner={self._owner} count={self._count}>")


cdef bint _lock_acquire(object lock, bint blocking) except -1:
    """lock.acquire(blocking)."""
    if type(lock) is RLock:
        return (<RLock>lock)._try() if not blocking else (<RLock>lock)._acquire(-1)
    _lock_types(lock)
    if _lk_acquire != NULL:
        r = axf_methkw_call(_lk_acquire, lock, _NO_ARGS if blocking else _ARGS_NOWAIT)
    else:
        r = lock.acquire(blocking)
    return r is True or (r is not False and bool(r))


cdef int _lock_release(object lock) except -1:
    """lock.release()."""
    if type(lock) is RLock:
        return (<RLock>lock)._release()
    _lock_types(lock)
    if _lk_acquire != NULL:
        axf_meth_call(_lk_release, lock, NULL)
    else:
        lock.release()
    return 0


# ------------------------------------------------------------------ wait, then poll
# Agent.wait_poll: for an integration that waits from its own thread (what
# aioxfer.nixl's check_xfer_state does per request). Compiled, bound as a
# method: no Python frame around the engine's wait.


def agent_wait_poll(agent, uint32_t max_us):
    """Agent.wait_poll(max_us) (a method: bound to the Agent): waits up to
    ``max_us`` µs for a completion (a busy-poll, the GIL released; 0: a look
    at the ring, no system call) and, when any came, takes them (poll()): their
    transfers are done when it returns. Whether any came. What came during
    the wait is left unsignalled for that poll (Engine.wait_polls: no eventfd
    write, nor its read, two system calls fewer than wait() then poll()).
    From a drain's callback it takes nothing (the drain running takes them).
    The thread rules of poll()."""
    engine = agent._engine
    if type(engine) is not Engine:
        raise TypeError(f"{agent!r}._engine is not an Engine")
    cdef Engine e = <Engine>engine
    cdef bint nested = e._polling
    if not e._wait(max_us, 0 if nested else AXF_WAIT_POLLS):
        return False
    if not nested:
        agent.poll()
    return True



# ------------------------------------------------------------------ aioxfer.nixl's repost
# nixlAgent.xferTransfer (nixl_agent.transfer), its hot path compiled: a
# plain repost (prepared, nothing to notify, no telemetry) of a request not
# in flight, posted under the runtime lock with Prepared._post(now=True),
# as the Python method (nixlAgent._transfer_py) does it, in its order,
# fields read and written through their __slots__ offsets. Anything else
# (a notification, a request in flight or whose remote changed, a field
# not what is expected) goes to _transfer_py, which does all; a post that
# raised, or completed failed, to the agent's _repost_failed / _repost_done.

from cpython.float cimport PyFloat_FromDouble

cdef enum:
    _NX_PLAIN = 0
    _NX_PREP = 1
    _NX_FUT = 2
    _NX_REMOTE = 3
    _NX_GEN = 4
    _NX_T0 = 5
    _NX_LAST_POLL = 6
    _NX_FIELDS = 7

_NX_NAMES = ("plain", "prep", "fut", "remote", "gen", "t0", "last_poll")

cdef enum:
    _NR_LOCK = 0
    _NR_FOREIGN = 1
    _NR_FIELDS = 2

_NR_NAMES = ("lock", "_foreign")

cdef object _nx_type = None  # the request type _nx_off is of
cdef bint _nx_ok = False
cdef Py_ssize_t _nx_off[_NX_FIELDS]
cdef object _nr_type = None  # the runtime type _nr_off is of
cdef bint _nr_ok = False
cdef Py_ssize_t _nr_off[_NR_FIELDS]


# The agent's two fields the repost reads (_xfers, _rt: plain instance
# attributes), from its __dict__ (a generic attribute read is ~180
# instructions: the type's lookup first), when its type has no attribute of
# those names (checked once per type); and the handle's number through its
# slot.
cdef extern from "Python.h":
    PyObject **_PyObject_GetDictPtr(object o)

cdef object _na_type = None  # the agent type last seen
cdef bint _na_dict = False  # its _xfers and _rt are read from the instance's __dict__
cdef object _nh_type = None  # the handle type last seen
cdef Py_ssize_t _nh_off = -1  # its _handle slot


cdef inline object _nx_field(object agent, str name):
    """agent.<name>, an instance attribute."""
    cdef PyObject **dp
    cdef PyObject *v
    if _na_dict:
        dp = _PyObject_GetDictPtr(agent)
        if dp != NULL and dp[0] != NULL:
            v = PyDict_GetItemWithError(<object>dp[0], name)
            if v != NULL:
                return <object>v
    return getattr(agent, name)


cdef inline int _na_types(object agent) except -1:
    global _na_type, _na_dict
    if type(agent) is not _na_type:
        _na_dict = (axf_type_lookup(type(agent), "_xfers") == NULL
                    and axf_type_lookup(type(agent), "_rt") == NULL
                    and axf_type_lookup(type(agent), "_ns") == NULL)
        _na_type = type(agent)
    return 0


cdef PyObject *_nx_in(object xfers, object handle) except? NULL:
    """xfers.get(handle._handle) (borrowed: the caller holds the agent, whose
    dict it is), NULL when absent or when xfers is not a dict."""
    global _nh_type, _nh_off
    cdef PyObject *v
    if type(handle) is not _nh_type:
        _nh_off = axf_slot_offset(type(handle), axf_type_lookup(type(handle), "_handle"))
        _nh_type = type(handle)
    v = axf_slot_ptr(handle, _nh_off) if _nh_off >= 0 else NULL
    number = <object>v if v != NULL else handle._handle
    return PyDict_GetItemWithError(xfers, number) if type(xfers) is dict else NULL


cdef PyObject *_nx_request(object agent, object handle) except? NULL:
    """agent._xfers.get(handle._handle) (borrowed), NULL when absent or when
    _xfers is not a dict."""
    _na_types(agent)
    return _nx_in(_nx_field(agent, "_xfers"), handle)


cdef object _rm_type = None  # the remote type last seen
cdef Py_ssize_t _rm_off = -1  # its gen slot


cdef inline object _nx_gen(object rem):
    """rem.gen (a _Remote: through its slot, not a generic attribute read)."""
    global _rm_type, _rm_off
    cdef PyObject *v
    if type(rem) is not _rm_type:
        _rm_off = axf_slot_offset(type(rem), axf_type_lookup(type(rem), "gen"))
        _rm_type = type(rem)
    v = axf_slot_ptr(rem, _rm_off) if _rm_off >= 0 else NULL
    return <object>v if v != NULL else rem.gen


def nixl_transfer(agent, handle, notif_msg=b""):
    """aioxfer.nixl's nixlAgent.xferTransfer (a method: bound to the
    nixlAgent): ``transfer(handle, notif_msg)``, "DONE" or "PROC"."""
    global _nx_type, _nx_ok, _nr_type, _nr_ok
    cdef PyObject *v
    cdef object x, prep, rt, lock, fut, rem, t0, nso
    cdef object err = None
    cdef bint punt = False
    cdef int st
    if notif_msg:
        return agent._transfer_py(handle, notif_msg)
    # (The agent's _xfers and _rt through its NixlCache, when started: one
    # field read rather than two.)
    _na_types(agent)
    nso = _nx_field(agent, "_ns")
    if type(nso) is NixlCache:
        v = _nx_in((<NixlCache>nso).xfers, handle)
        rt = (<NixlCache>nso).rt
    else:
        v = _nx_request(agent, handle)
        rt = _nx_field(agent, "_rt")
    if v == NULL:
        return agent._transfer_py(handle, notif_msg)
    x = <object>v
    if type(x) is not _nx_type:
        _nx_ok = _offsets(type(x), _NX_NAMES, _nx_off, _NX_FIELDS)
        _nx_type = type(x)
    if type(rt) is not _nr_type:
        _nr_ok = _offsets(type(rt), _NR_NAMES, _nr_off, _NR_FIELDS)
        _nr_type = type(rt)
    if not _nx_ok or not _nr_ok or _slot_obj(x, _nx_off[_NX_PLAIN]) is not True:
        return agent._transfer_py(handle, notif_msg)
    prep = _slot_obj(x, _nx_off[_NX_PREP])
    lock = _slot_obj(rt, _nr_off[_NR_LOCK])
    if type(prep) is not Prepared or lock is None:
        return agent._transfer_py(handle, notif_msg)
    _lock_acquire(lock, True)
    try:
        fut = _slot_obj(x, _nx_off[_NX_FUT])
        rem = _slot_obj(x, _nx_off[_NX_REMOTE])
        if fut is not None and _fut_state(fut) != 1:
            # (Refused there: still in flight; or, the last post cancelled
            # or failed, while the engine may still move its data: the
            # Transfers' busy. Checked there, off this path.)
            punt = True
        elif rem is not None and _nx_gen(rem) != _slot_obj(x, _nx_off[_NX_GEN]):
            punt = True  # (refused there: removed or re-registered)
        else:
            # Stamped before the post (see _transfer_py).
            t0 = PyFloat_FromDouble(_perf_counter())
            axf_slot_put(x, _nx_off[_NX_T0], t0)
            try:
                fut = (<Prepared>prep)._post_repost()
            except Exception as exc:
                axf_slot_put(x, _nx_off[_NX_FUT], None)
                err = exc
            else:
                axf_slot_put(x, _nx_off[_NX_FUT], fut)
                # The caller's last call ended now (see _transfer_py).
                axf_slot_put(x, _nx_off[_NX_LAST_POLL], PyFloat_FromDouble(_perf_counter()))
    finally:
        if _slot_obj(rt, _nr_off[_NR_FOREIGN]) is True:
            rt.leave()  # wakes the loop for what the section scheduled
        else:
            _lock_release(lock)
    if punt:
        return agent._transfer_py(handle, notif_msg)
    if err is not None:
        return agent._repost_failed(x, err)
    st = _fut_state(fut)
    if st == 0:
        return "PROC"
    if st == 1:
        return "DONE"
    return agent._repost_done(x, fut)


# ------------------------------------------------------------------ aioxfer.nixl's check
# nixlAgent.xferState (nixl_agent.check_xfer_state), its usual call
# compiled: a tight poll (within _TIGHT_POLL of the last call or of the post)
# of one in-flight request of one aioxfer call (a Transfer), as the Python
# method (nixlAgent._state_py) and _wait_completion do it, in their order:
# the runtime lock taken without blocking, the engine's fd claimed, a spin
# (wait_poll) of the budget _wait_completion picks, the catch's bookkeeping
# (_note_latency, _spin_outcome), the claim and the lock released. A spin
# that did not catch then sleeps on the engine's fd as _wait_sleep does
# (_ns_slept), without spinning again. A request of several parts
# (nixlAgent._post) is waited for the same way, its parts' data, then moved
# on by the agent's _advance (which sends its notification after the data).
# Anything else (not a tight poll, a notification being sent, the lock busy)
# goes to _state_py, which does all.

cdef enum:
    _NS_FUT = 0
    _NS_LAST_POLL = 1
    _NS_T0 = 2
    _NS_SPIN = 3
    _NS_SLOW = 4
    _NS_SKIPPED = 5
    _NS_LAT = 6
    _NS_BUDGET = 7
    _NS_NBYTES = 8
    _NS_PARTS = 9
    _NS_NOTIFYING = 10
    _NS_FIELDS = 11

_NS_NAMES = ("fut", "last_poll", "t0", "spin", "slow", "skipped", "lat", "budget", "nbytes",
             "parts", "notifying")

cdef object _ns_type = None  # the request type _ns_off is of
cdef bint _ns_ok = False
cdef Py_ssize_t _ns_off[_NS_FIELDS]
cdef object _ns_cls = None  # the agent class the constants below are of
cdef object _ns_transfer = None
cdef double _ns_tight_poll = 0.0
cdef double _ns_spin_keep = 0.0
cdef long _ns_spin_misses = 0
cdef long _ns_spin_probe = 0
cdef object _ns_linger = None
cdef long long _ns_spin_max = 0
cdef long long _ns_alone_max_us = 0
cdef double _ns_alone_lat = 2e6  # spin_alone's bound per second of average latency
cdef double _ns_engine_wait = 0.0


cdef inline object _ns_done(object agent, object x, object fut, object nso):
    """The state of a request whose post is done: "DONE" when it succeeded
    and there is no telemetry event to write (the agent's NixlCache ``nso``
    says, else its _tel_events), else the agent's _finish (which raises a
    failure)."""
    cdef bint tel = ((<NixlCache>nso).tel_events if type(nso) is NixlCache
                     else agent._tel_events is not False)
    if not tel and _fut_state(fut) == 1:
        return "DONE"
    return _STATE_NAMES[agent._finish(x, fut, "getXferStatus")]

_STATE_NAMES = ("DONE", "PROC")


@cython.final
cdef class NixlCache:
    """What aioxfer.nixl's nixlAgent.xferState reads of its agent on each
    check, resolved once (the nixlAgent's ``_ns``, made from its fields when
    its aioxfer agent starts, None again when it closes; remade by whoever
    changes one): the aioxfer agent, its engine, its poll and wait_poll, the
    runtime, its lock and selector (its claims), the engine's fd, the spin
    the agent's progress mode picks, and its requests (_xfers). Each would otherwise be an attribute
    read of a plain instance per check (~180 instructions each, the type's
    lookup first). A wait_poll that is the agent's own (Agent.wait_poll,
    agent_wait_poll bound to it) is done inline."""
    cdef readonly object agent
    cdef Engine engine
    cdef object poll  # the nixlAgent's _poll_fn (agent.poll)
    cdef object drain  # what poll does: agent._sub.drain if it is Agent.poll, else poll
    cdef object wait_poll  # its _wait_poll; None: agent_wait_poll's, inline
    cdef object rt, lock, sel, claims
    cdef object fd
    cdef long long spin_us
    cdef bint spin_only
    cdef bint tel_events  # the nixlAgent's _tel_events (set before its agent starts)
    cdef bint sel_dict  # the selector's sleep_until read from its __dict__
    cdef object xfers  # the nixlAgent's _xfers (its requests by number: never rebound)

    def __cinit__(self, agent, rt, fd, long long spin_us, bint spin_only, poll, wait_poll,
                  bint tel_events, xfers):
        engine = agent._engine
        if type(engine) is not Engine:
            raise TypeError(f"{agent!r}._engine is not an Engine")
        self.agent = agent
        self.engine = <Engine>engine
        self.poll = poll
        # Agent.poll is its Submission's drain (compiled): called without
        # the Python frame around it.
        from aioxfer.agent import Agent as _Agent
        if (type(poll) is _MethodType and poll.__self__ is agent
                and poll.__func__ is _Agent.poll):
            self.drain = agent._sub.drain
        else:
            self.drain = poll
        own = (type(wait_poll) is _MethodType and wait_poll.__self__ is agent
               and wait_poll.__func__ is agent_wait_poll and poll == agent.poll)
        self.wait_poll = None if own else wait_poll
        self.rt = rt
        self.lock = rt.lock
        self.sel = rt.selector
        self.claims = self.sel._claims
        if type(self.claims) is not dict:
            raise TypeError("the runtime's selector has no claims dict")
        self.fd = fd
        self.spin_us = spin_us
        self.spin_only = spin_only
        self.tel_events = tel_events
        if type(xfers) is not dict:
            raise TypeError("the requests are not a dict")
        self.xfers = xfers
        self.sel_dict = axf_type_lookup(type(self.sel), "sleep_until") == NULL


cdef bint _ns_wait_poll(NixlCache n, uint32_t max_us) except -1:
    """The nixlAgent's _wait_poll(max_us) through the cache: the agent's
    own (agent_wait_poll) inline."""
    cdef Engine e
    cdef bint nested
    if n.wait_poll is not None:
        return bool(n.wait_poll(max_us))
    e = n.engine
    nested = e._polling
    if not e._wait(max_us, 0 if nested else AXF_WAIT_POLLS):
        return False
    if not nested:
        n.drain()
    return True


# A selector claim's fields (_Claim's slots: active, until, linger).
cdef enum:
    _CL_ACTIVE = 0
    _CL_UNTIL = 1
    _CL_LINGER = 2
    _CL_FIELDS = 3

_CL_NAMES = ("active", "until", "linger")
cdef object _cl_type = None
cdef bint _cl_ok = False
cdef Py_ssize_t _cl_off[_CL_FIELDS]


cdef inline bint _cl_slots(object c):
    """Whether c's fields are read through _cl_off (its type's slots)."""
    global _cl_type, _cl_ok
    if type(c) is not _cl_type:
        _cl_ok = _offsets(type(c), _CL_NAMES, _cl_off, _CL_FIELDS)
        _cl_type = type(c)
    return _cl_ok


def nixl_state(agent, handle):
    """aioxfer.nixl's nixlAgent.xferState (a method: bound to the
    nixlAgent): ``check_xfer_state(handle)``, "DONE" or "PROC"."""
    global _ns_type, _ns_ok, _ns_cls, _ns_transfer, _ns_tight_poll, _ns_spin_keep
    global _ns_spin_misses, _ns_spin_probe, _ns_linger, _ns_spin_max, _ns_alone_max_us
    global _ns_engine_wait, _ns_alone_lat, _nr_type, _nr_ok
    cdef PyObject *v
    cdef object x, fut, rt, lock, sel, fd, f2, c, nso, active
    cdef NixlCache n
    cdef double now, took, lat, seconds
    cdef long long spin_us, budget, us
    cdef long slow, skipped
    cdef bint claimed, caught, spun
    cdef tuple consts
    cdef object parts = None  # a request of several parts: their Transfers
    if type(agent) is not _ns_cls:
        consts = type(agent)._nx_consts
        (_ns_transfer, _ns_tight_poll, _ns_spin_keep, _ns_spin_misses, _ns_spin_probe,
         _ns_linger, _ns_spin_max, _ns_alone_max_us, _ns_engine_wait, _ns_alone_lat) = consts
        _ns_cls = type(agent)
    _na_types(agent)
    nso = _nx_field(agent, "_ns")
    v = (_nx_in((<NixlCache>nso).xfers, handle) if type(nso) is NixlCache
         else _nx_request(agent, handle))
    if v == NULL:
        return agent._state_py(handle)
    x = <object>v
    if type(x) is not _ns_type:
        _ns_ok = _offsets(type(x), _NS_NAMES, _ns_off, _NS_FIELDS)
        _ns_type = type(x)
    if not _ns_ok:
        return agent._state_py(handle)
    fut = _slot_obj(x, _ns_off[_NS_FUT])
    if type(fut) is not _ns_transfer:
        # A request of several aioxfer calls (nixlAgent._post): its parts'
        # data waited for as one request's, then moved on (_advance, which
        # sends its notification after them); while that is being sent,
        # and anything else, _state_py's.
        parts = _slot_obj(x, _ns_off[_NS_PARTS])
        if (type(fut) is not _Future or type(parts) is not list or not parts
                or _slot_obj(x, _ns_off[_NS_NOTIFYING]) is not False):
            return agent._state_py(handle)
    if _fut_state(fut):
        return _ns_done(agent, x, fut, nso)
    f2 = _slot_obj(x, _ns_off[_NS_LAST_POLL])
    now = _perf_counter()
    if type(f2) is not float or now - <double>f2 >= _ns_tight_poll:
        return agent._state_py(handle)
    if type(nso) is not NixlCache:
        return agent._state_py(handle)  # (no agent: not started, or closed)
    n = <NixlCache>nso
    rt = n.rt
    if type(rt) is not _nr_type:
        _nr_ok = _offsets(type(rt), _NR_NAMES, _nr_off, _NR_FIELDS)
        _nr_type = type(rt)
    if not _nr_ok:
        return agent._state_py(handle)
    lock = n.lock
    if not _lock_acquire(lock, False):
        return agent._state_py(handle)  # (it yields to the loop thread)
    spun = False
    try:
        if _ns_data_done(fut, parts):  # (_wait_completion's ready())
            spun = True
            if parts is not None:
                agent._advance(x, fut)
        else:
            fd = n.fd
            sel = n.sel
            # (Runtime.claim's usual case inline: the fd claimed before,
            # lingering; else its method.)
            v = PyDict_GetItemWithError(n.claims, fd)
            c = <object>v if v != NULL else None
            if c is not None and _cl_slots(c):
                active = _slot_obj(c, _cl_off[_CL_ACTIVE])
            else:
                active = None
            if type(active) is int:
                axf_slot_put(c, _cl_off[_CL_ACTIVE], active + 1)
                claimed = True
            else:
                c = None
                claimed = sel.claim(fd)
            spin_us = n.spin_us
            if spin_us and (n.spin_only
                            or _slot_obj(x, _ns_off[_NS_SPIN]) is True
                            or _ns_spin_wanted(x)):
                budget = _slot_obj(x, _ns_off[_NS_BUDGET])
                if budget > spin_us:
                    spin_us = budget  # (a small request: see _note_latency)
                us = spin_us
            else:
                us = 0  # (a look at the ring: no spin)
            try:
                caught = _ns_wait_poll(n, us)
                spun = caught or (us != 0 and n.spin_only)
                if not caught and spun and not n.agent.closed:
                    n.drain()
            except BaseException:
                if claimed:
                    sel.release(fd, _ns_linger)
                raise
            if caught and _ns_data_done(fut, parts):
                if us != 0:
                    # (_wait_completion's bookkeeping of a catch, inline.)
                    took = _perf_counter() - <double>_slot_obj(x, _ns_off[_NS_T0])
                    _ns_note_latency(x, took)
                    _ns_spin_outcome(x, took < _ns_spin_keep * spin_us * 1e-6)
            if spun and claimed:
                _ns_release(n, fd, c)
            if caught and parts is not None and _ns_data_done(fut, parts):
                # (After the claim's release: a notification it sends
                # expires the lingering claims, for the loop thread.)
                agent._advance(x, fut)
    finally:
        if _slot_obj(rt, _nr_off[_NR_FOREIGN]) is True:
            rt.leave()
        else:
            _lock_release(lock)
    if not spun:
        # Neither caught nor spun for in "poll" progress: the sleep, as
        # _wait_completion's, then the rest of the state (no second spin).
        _ns_slept(agent, n, x, fut, parts, fd, claimed, c, spin_us)
    axf_slot_put(x, _ns_off[_NS_LAST_POLL], PyFloat_FromDouble(_perf_counter()))
    if _fut_state(fut):
        return _ns_done(agent, x, fut, nso)
    return "PROC"


cdef int _ns_note_latency(object x, double took) except -1:
    """_note_latency: ``x``'s average time to completion, and for a small
    request the budget a tight poller spins for it."""
    cdef long long budget
    cdef double lat = <double>_slot_obj(x, _ns_off[_NS_LAT])
    lat = took if lat == 0.0 else lat + (took - lat) * 0.125
    axf_slot_put(x, _ns_off[_NS_LAT], PyFloat_FromDouble(lat))
    if <long long>_slot_obj(x, _ns_off[_NS_NBYTES]) <= _ns_spin_max:
        budget = <long long>(lat * _ns_alone_lat)
        axf_slot_put(x, _ns_off[_NS_BUDGET],
                     budget if budget < _ns_alone_max_us else _ns_alone_max_us)
    return 0


cdef int _ns_spin_outcome(object x, bint soon) except -1:
    """_spin_outcome: whether ``x``'s post completed within _SPIN_KEEP
    spins of its post."""
    cdef long slow
    if soon:
        axf_slot_put(x, _ns_off[_NS_SPIN], True)
        axf_slot_put(x, _ns_off[_NS_SLOW], 0)
        return 0
    slow = _slot_obj(x, _ns_off[_NS_SLOW])
    if slow < _ns_spin_misses:
        slow += 1
        axf_slot_put(x, _ns_off[_NS_SLOW], slow)
        if slow == _ns_spin_misses:
            axf_slot_put(x, _ns_off[_NS_SPIN], False)
            axf_slot_put(x, _ns_off[_NS_SKIPPED], 0)
    return 0


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int ppoll(pollfd *fds, unsigned long nfds, const timespec *tmo, const void *sigmask)
    enum:
        POLLIN
        POLLNVAL

from cpython.exc cimport PyErr_CheckSignals

cdef extern from "<errno.h>" nogil:
    int errno
    enum:
        EINTR


cdef int _ns_sleep(int fd, double timeout) except -2:
    """select.select([fd], [], [], timeout) without the GIL: 1 when fd is
    readable, 0 when the timeout ran out, -1 when fd is not open (select's
    OSError / ValueError); a signal handler's exception raised (as select's
    retry after EINTR, PEP 475)."""
    cdef pollfd p
    cdef timespec ts
    cdef double end = _perf_counter() + timeout, left = timeout
    cdef int r, e
    if fd < 0:
        return -1
    p.fd = fd
    p.events = POLLIN
    while True:
        if left < 0.0:
            left = 0.0
        ts.tv_sec = <long>left
        ts.tv_nsec = <long>((left - <double>ts.tv_sec) * 1e9)
        p.revents = 0
        with nogil:
            r = ppoll(&p, 1, &ts, NULL)
            e = errno
        if r >= 0:
            if r and (p.revents & POLLNVAL):
                return -1
            return 1 if r else 0
        if e != EINTR:
            return -1
        PyErr_CheckSignals()  # (a handler's exception raised)
        left = end - _perf_counter()


cdef bint _ns_data_done(object fut, object parts) except -1:
    """_data_done: whether the request's data moved (the Transfer ``fut``
    done, or each of its ``parts``)."""
    if parts is None:
        return _fut_state(fut) != 0
    for p in <list>parts:
        if not _fut_state(p):
            return False
    return True


cdef int _ns_slept(object agent, NixlCache n, object x, object fut, object parts, object fd,
                   bint claimed, object c, long long spin_us) except -1:
    """nixlAgent._wait_sleep, compiled, for nixl_state: after a spin
    that did not catch (the claim held, the lock released), a sleep on the
    engine's fd (at most _ENGINE_WAIT, the GIL released), then, under the
    lock, the agent's poll (before the loop thread may watch the fd again)
    and the claim's release; then the spin bookkeeping."""
    cdef int got = -1
    cdef double woke = 0.0, took
    cdef object rt = n.rt
    cdef PyObject *v
    try:
        got = _ns_sleep(fd, _ns_engine_wait)
        woke = _perf_counter()
    finally:  # also on KeyboardInterrupt: the loop thread must get its fd back
        _lock_acquire(n.lock, True)
        try:
            try:
                if _nx_field(agent, "_agent") is n.agent and not n.agent.closed:
                    n.drain()
            finally:
                if claimed:
                    v = PyDict_GetItemWithError(n.claims, fd)
                    _ns_release(n, fd, c if (c is not None and v == <PyObject *>c) else None)
            if parts is not None and _ns_data_done(fut, parts):
                # (What _state_py does after its wait; after the claim's
                # release: a notification it sends expires lingering claims.)
                agent._advance(x, fut)
        finally:
            if _slot_obj(rt, _nr_off[_NR_FOREIGN]) is True:
                rt.leave()
            else:
                _lock_release(n.lock)
    if spin_us and got >= 0:
        # Spun for next time if it completed soon after a spin would have
        # ended; late if the wait ran out; neither if what woke this thread
        # was another completion (the next wait tells).
        if not got:
            _ns_spin_outcome(x, False)
        elif _ns_data_done(fut, parts):
            took = woke - <double>_slot_obj(x, _ns_off[_NS_T0])
            _ns_note_latency(x, took)
            _ns_spin_outcome(x, took < _ns_spin_keep * spin_us * 1e-6)
    return 0


def nixl_consts_reset():
    """Forgets the constants nixl_state read of a nixlAgent class (its
    ``_nx_consts``, read once per class): the next check reads them again
    (for a test that patches them)."""
    global _ns_cls
    _ns_cls = None


cdef bint _ns_spin_wanted(object x) except -1:
    """_spin_wanted of a request whose spin flag is not set: every
    _SPIN_PROBE-th wait spins anyway."""
    cdef long skipped = _slot_obj(x, _ns_off[_NS_SKIPPED])
    skipped += 1
    if skipped >= _ns_spin_probe:
        axf_slot_put(x, _ns_off[_NS_SKIPPED], 0)
        return True
    axf_slot_put(x, _ns_off[_NS_SKIPPED], skipped)
    return False


cdef int _ns_release(NixlCache n, object fd, object c) except -1:
    """sel.release(fd, _LINGER) (Runtime's selector, lock held), its usual
    case inline: the last claim of ``c`` (the fd's, claimed above, its type's
    slots in _cl_off) ended, lingering, the loop thread not asleep past the
    linger (else the method, which wakes it)."""
    cdef double until, su, linger = _ns_linger
    cdef object sel = n.sel, sleep_until
    cdef PyObject **dp
    cdef PyObject *v = NULL
    if c is not None and _slot_obj(c, _cl_off[_CL_ACTIVE]) == 1:
        until = _perf_counter() + linger  # (time.monotonic: CLOCK_MONOTONIC too)
        if n.sel_dict:
            dp = _PyObject_GetDictPtr(sel)
            if dp != NULL and dp[0] != NULL:
                v = PyDict_GetItemWithError(<object>dp[0], "sleep_until")
        sleep_until = <object>v if v != NULL else sel.sleep_until
        su = sleep_until
        if not (su > until + linger):
            axf_slot_put(c, _cl_off[_CL_ACTIVE], 0)
            axf_slot_put(c, _cl_off[_CL_LINGER], _ns_linger)
            axf_slot_put(c, _cl_off[_CL_UNTIL], PyFloat_FromDouble(until))
            return 0
    sel.release(fd, _ns_linger)
    return 0



# Included by _cyx.pyx after _engine.pxi (Poller waits through Engine._wait)
# and before _submit.pxi (Submitter calls Poller's kick and spin_alone).

# ------------------------------------------------------------------ progress
# aioxfer.progress.Poller's work, compiled: every request awaited alone goes
# through spin_alone (and its bound) and every post that leaves something in
# flight through kick, then the loop through _run. As Python methods these
# were ~1-2 k instructions a tcp request (three frames, the counters' two
# attribute reads, perf_counter_ns twice, the bound wait's call); here the
# Submitter calls them directly and the wait is the Engine's own when it is
# its wait_polls. aioxfer.progress.Poller subclasses this with its constants
# and its documentation: what a Poller does is described there.

from collections.abc import Sized as _Sized


cdef inline long long _mono_ns() noexcept nogil:
    """CLOCK_MONOTONIC in ns (what time.perf_counter_ns reads on Linux)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <long long>ts.tv_sec * 1000000000LL + ts.tv_nsec


# Not picklable (it holds a loop and an engine): no __reduce_cython__.
@cython.auto_pickle(False)
cdef class Poller:
    """``Poller(sub, wait, loop, mode, poll_us, poll_slice_us, alone_max_us,
    alone_span_us, bandwidth_min, alone_latencies=2)``: see
    aioxfer.progress.Poller, which passes the last five (its constants and
    stats.BANDWIDTH_MIN)."""

    cdef object _sub
    cdef object _wait
    cdef object _engine  # wait's Engine when wait is its wait_polls (called directly)
    cdef object _loop
    cdef object _ready  # asyncio's loop's ready queue, or None (no spin_alone)
    cdef object _run_cb  # self._run, bound once (kick's call_soon)
    cdef bint _fast_drain  # sub.drain is submission_drain: its Submitter's, called directly
    cdef bint _keep
    cdef bint _scheduled
    cdef long long _budget
    cdef long long _spent_ns
    cdef long long _next
    cdef long long _alone_max_us
    cdef long long _alone_span_us
    cdef double _bandwidth_min
    cdef double _alone_latencies  # a small lone request's bound: this many latency averages
    cdef public long long hits  # polls that found a completion
    cdef public long long misses  # polls that ran out (then the eventfd wakes the loop)
    cdef public long long alone_hits  # spin_alone polls that found it
    cdef public long long alone_misses  # spin_alone polls that ran out

    def __init__(self, sub, wait, loop, str mode, poll_us, poll_slice_us, alone_max_us,
                 alone_span_us, bandwidth_min, alone_latencies=2):
        self._sub = sub
        self._wait = wait
        self._engine = None
        owner = getattr(wait, "__self__", None)
        if type(owner) is Engine and wait == owner.wait_polls:
            self._engine = owner
        self._loop = loop
        self._keep = mode == "poll"  # poll on after a miss
        self._budget = max(int(poll_us), int(poll_slice_us)) if self._keep else int(poll_us)
        self._scheduled = False
        # asyncio's own loops: their queue of ready callbacks (spin_alone
        # polls only while it holds nothing but ours); other loops (uvloop,
        # whose queue is not visible): None, no spin_alone.
        ready = getattr(loop, "_ready", None) if isinstance(loop, _BaseEventLoop) else None
        self._ready = ready if isinstance(ready, _Sized) else None
        self._run_cb = self._run
        self._fast_drain = getattr(type(sub), "drain", None) is submission_drain
        self._spent_ns = 0  # spin_alone's polling since the loop last ran _run
        self._next = 0  # _run's bound once (us): a lone transfer spin_alone left to it
        self._alone_max_us = int(alone_max_us)
        self._alone_span_us = int(alone_span_us)
        self._bandwidth_min = float(bandwidth_min)
        self._alone_latencies = float(alone_latencies)
        self.hits = self.misses = self.alone_hits = self.alone_misses = 0

    cdef size_t _wait_us(self, long long us) except? 0:
        if us > 0xFFFFFFFF:
            us = 0xFFFFFFFF
        cdef Engine e
        if self._engine is not None:
            e = <Engine>self._engine  # Engine.wait_polls, without its call
            return e._wait(<uint32_t>us, 0 if e._polling else AXF_WAIT_POLLS)
        return 1 if self._wait(us) else 0  # any wait: its result's truth, as in Python

    cdef inline int _drain(self) except -1:
        if self._fast_drain:
            _submitter_of(self._sub)._drain_now()
        else:
            self._sub.drain()
        return 0

    def kick(self):
        """Transfers are in flight: poll before the loop blocks."""
        self._kick()

    cdef inline int _kick(self) except -1:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run_cb)
        return 0

    cdef long long _alone_us(self, object t) except -1:
        """How long an await polls for its lone transfer t (spin_alone),
        microseconds: alone_latencies times the peer's latency average
        (t.peer._counters.latency, s: what a small transfer takes), or for a
        large transfer (bandwidth_min or more) twice its bytes at the peer's
        bandwidth average (.bandwidth, bytes/s) when that is longer; at
        least the budget (poll_us) and at most alone_max_us. A 1 MiB tcp
        request takes ~250 us where a small one takes ~25, and a poll
        bounded by the small ones' ran out before most 1 MiB READs completed.
        PeerCounters' two fields are C doubles; other counters' (a
        stand-in, in tests) are read as attributes."""
        cdef object peer, c
        cdef double latency, bw, nb
        cdef long long us, sized
        if type(t) is not _xfer_type:
            _xfer_resolve(type(t))
        peer = _xfer_get(t, _T_PEER)
        c = _peer_get(peer, _P_COUNTERS)
        if type(c) is PeerCounters:  # (its averages are C doubles)
            latency = (<PeerCounters>c).latency
            bw = (<PeerCounters>c).bandwidth
        else:
            latency, bw = c.latency, c.bandwidth
        us = <long long>(latency * (self._alone_latencies * 1e6))
        if bw > 0.0:
            nb = _xfer_get(t, _T_NBYTES)
            if nb >= self._bandwidth_min:
                sized = <long long>(nb * 2e6 / bw)
                if sized > us:
                    us = sized
        if us <= self._budget:
            return self._budget
        return us if us < self._alone_max_us else self._alone_max_us

    def alone_bound(self, t):
        """spin_alone's bound for t, microseconds (_alone_us)."""
        return self._alone_us(t)

    def spin_alone(self, t, flush_scheduled):
        """See aioxfer.progress.Poller.spin_alone."""
        self._spin_alone(t, bool(flush_scheduled))

    cdef int _spin_alone(self, object t, bint flush_scheduled) except -1:
        cdef long long budget, t0
        cdef size_t got
        if self._ready is None or len(self._ready) > self._scheduled + flush_scheduled:
            return 0
        budget = self._alone_us(t)
        if self._spent_ns > self._alone_span_us * 1000:
            self._next = budget
            return 0
        t0 = _mono_ns()
        got = self._wait_us(budget)
        self._spent_ns += _mono_ns() - t0
        if got:
            self.alone_hits += 1
            self._drain()
        else:
            self.alone_misses += 1
        return 0

    def _run(self):
        cdef long long budget
        self._scheduled = False
        self._spent_ns = 0  # the loop runs
        budget = self._budget if self._budget > self._next else self._next
        self._next = 0
        sub = self._sub
        if sub.closed or not sub.inflight:
            return
        if self._wait_us(budget):
            self.hits += 1
            self._drain()
            if sub.inflight:
                self._kick()
        else:
            self.misses += 1
            if self._keep:
                self._kick()

# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# The native engine: its lifetime, memory, endpoints, posts and completions.

# ------------------------------------------------------------------ engine

@cython.final
@cython.no_gc_clear  # pins must outlive the native engine, never be cleared first
cdef class Engine:
    """One native engine: registry, endpoints, one completion ring and eventfd."""

    cdef axf_engine *_e
    cdef int _fd
    cdef dict _pins  # rid -> _Pin, until CQ_REGION_FREED for rid is polled
    cdef axf_completion *_cq
    cdef size_t _cq_cap
    cdef _slot *_slots
    cdef size_t _slots_cap
    cdef int _busy  # native calls in progress without the GIL (close() must wait)
    cdef bint _polling  # self._cq in use
    cdef bint _posting  # self._slots in use
    # drain: the done callbacks of the futures it completes run as one loop
    # handle, not one each (_completions.pxi: worth it where call_soon is
    # Python, asyncio's own loops; not on uvloop's). Set by the agent.
    cdef public bint batch_wakeups
    # The first error a drain's _take_callbacks met on its removal path (a
    # callback's __eq__ raising in remove_done_callback), until that drain
    # reports it (_take_callbacks_error): this engine's, never another's.
    cdef object _take_error

    def __cinit__(self, uint32_t copy_workers=0, uint64_t chunk_bytes=0,
                  uint64_t inline_bytes=0, uint32_t keepalive_ms=0,
                  uint32_t peer_timeout_ms=0, uint32_t stall_ms=0, uint32_t max_conns=0,
                  uint32_t max_notify_per_conn=0, uint32_t revoke_timeout_ms=0,
                  uint64_t reply_queue_bytes=0, uint32_t target_poll_us=0):
        # 0 everywhere: the engine's documented default (native/include/aioxfer.h).
        cdef axf_config cfg
        memset(&cfg, 0, sizeof(cfg))
        cfg.copy_workers = copy_workers
        cfg.chunk_bytes = chunk_bytes
        cfg.inline_bytes = inline_bytes
        cfg.keepalive_ms = keepalive_ms
        cfg.peer_timeout_ms = peer_timeout_ms
        cfg.stall_ms = stall_ms
        cfg.max_conns = max_conns
        cfg.max_notify_per_conn = max_notify_per_conn
        cfg.revoke_timeout_ms = revoke_timeout_ms
        cfg.reply_queue_bytes = reply_queue_bytes
        cfg.target_poll_us = target_poll_us
        self._pins = {}
        self._fd = -1
        self._cq = <axf_completion *>PyMem_Malloc(POLL_DEFAULT * sizeof(axf_completion))
        if self._cq == NULL:
            raise MemoryError()
        self._cq_cap = POLL_DEFAULT
        # The process-wide settings from the environment, read here with the
        # GIL held (os.environ's writes hold it too), not by the native
        # engine on a thread of its own where they raced such a write.
        axf_env_read()
        with nogil:
            self._e = axf_engine_create(&cfg)
        if self._e == NULL:
            raise NativeError(AXF_E_NOMEM, "cannot create the native engine")
        self._fd = axf_engine_fd(self._e)

    def __dealloc__(self):
        # Normally close() or __del__ ran already; this is the last resort and
        # must not touch Python beyond our own attributes.
        if self._e != NULL:
            self._close_native()
        PyMem_Free(self._cq)
        self._cq = NULL
        PyMem_Free(self._slots)
        self._slots = NULL

    def __del__(self):
        if self._e != NULL:
            import warnings
            warnings.warn(
                f"unclosed native engine (fd {self._fd}, {len(self._pins)} pinned regions)",
                ResourceWarning,
                stacklevel=2,
            )
            self._close_native()

    def __repr__(self):
        state = "closed" if self._e == NULL else f"fd={self._fd} pinned={len(self._pins)}"
        return f"<aioxfer._cyx.Engine {state}>"

    # -------------------------------------------------------------- internals

    cdef inline int _open(self) except -1:
        if self._e == NULL:
            raise NativeError(AXF_E_CLOSED, "engine is closed")
        return 0

    cdef int _ensure_cq(self, size_t want) except -1:
        cdef axf_completion *p
        if want > self._cq_cap:
            p = <axf_completion *>PyMem_Realloc(self._cq, want * sizeof(axf_completion))
            if p == NULL:
                raise MemoryError()
            self._cq = p
            self._cq_cap = want
        return 0

    cdef int _ensure_slots(self, size_t want) except -1:
        cdef _slot *p
        cdef size_t cap
        if want > self._slots_cap:
            cap = want if want > 64 else 64
            p = <_slot *>PyMem_Realloc(self._slots, cap * sizeof(_slot))
            if p == NULL:
                raise MemoryError()
            self._slots = p
            self._slots_cap = cap
        return 0

    cdef size_t _poll_batch(self, Py_ssize_t max, str who) except? 0:
        """Polls up to max records into self._cq. With records, self._polling
        stays set: the caller frees them and clears it. poll() and drain()."""
        cdef size_t n
        if max <= 0:
            raise ValueError("max must be positive")
        if self._polling:
            raise RuntimeError(f"Engine.{who}() is not reentrant")
        self._ensure_cq(<size_t>max)
        self._busy += 1
        self._polling = True
        # GIL kept: a poll takes a lock and copies the records out (and at
        # most clears the eventfd), shorter than the GIL's release and retake.
        n = axf_poll(self._e, self._cq, <size_t>max)
        self._busy -= 1
        if n == 0:
            self._polling = False
        return n

    cdef void _release_freed(self, size_t n) noexcept:
        """Releases pins of regions the engine reported freed among n records.
        A region given up on (status E_CLOSED: a peer may still write it) keeps
        its buffer pinned for the life of the process: that memory must never
        be reused."""
        cdef size_t i
        cdef _Pin pin
        for i in range(n):
            if self._cq[i].kind == AXF_CQ_REGION_FREED:
                pin = self._pins.pop(self._cq[i].id, None)
                if pin is not None:
                    if self._cq[i].status == AXF_OK:
                        pin.release()
                    else:
                        _abandoned.append(pin)

    cdef void _close_native(self) noexcept:
        """shutdown, drain (releasing pins, dropping records), destroy."""
        cdef axf_engine *e = self._e
        cdef size_t n, i
        if e == NULL:
            return
        with nogil:
            axf_engine_shutdown(e)
        while True:
            with nogil:
                n = axf_poll(e, self._cq, self._cq_cap)
            if n == 0:
                break
            self._release_freed(n)
            for i in range(n):
                axf_completion_free(&self._cq[i])
        with nogil:
            axf_engine_destroy(e)
        self._e = NULL
        self._fd = -1
        # Nothing native touches memory any more: whatever is left goes too.
        for pin in self._pins.values():
            (<_Pin>pin).release()
        self._pins.clear()

    # -------------------------------------------------------------- lifecycle

    def fileno(self):
        """The completion eventfd: readable while completions are waiting."""
        self._open()
        return self._fd

    @property
    def closed(self):
        return self._e == NULL

    @property
    def inline_bytes(self):
        """A lone same-host request up to this size is copied inside post
        (POST_ALONE); 2**64 - 1: never."""
        self._open()
        return axf_engine_inline_bytes(self._e)

    @property
    def poll_us(self):
        """The calibrated bound of one busy-poll (wait()), microseconds."""
        self._open()
        return axf_engine_poll_us(self._e)

    def wait(self, uint32_t max_us):
        """Spins (GIL released) up to max_us microseconds for a completion;
        returns how many the ring holds (0: none came). Takes nothing: poll()
        or drain() them. 0 once closed."""
        return self._wait(max_us, 0)

    def wait_polls(self, uint32_t max_us):
        """wait(), for a caller that polls (poll() or drain()) right after a
        nonzero return, always: what came while it spun is left unsignalled
        for that poll (AXF_WAIT_POLLS: no eventfd write here, no read there)."""
        # Inside a drain (a callback of its), the caller's drain would raise:
        # then what came is signalled, as wait() does.
        return self._wait(max_us, 0 if self._polling else AXF_WAIT_POLLS)

    cdef size_t _wait(self, uint32_t max_us, uint32_t flags):
        cdef size_t n
        if self._e == NULL:
            return 0
        self._busy += 1
        with nogil:
            n = axf_wait_ex(self._e, max_us, flags)
        self._busy -= 1
        return n

    def bye_network(self):
        """Says goodbye on each accepted network (not same-host) connection
        and ends it, waiting a little for its threads to leave: before the
        regions are released on close, so that those peers see a close and
        not refused accesses. Same-host peers and our own connections are
        left to shutdown(). No-op once shut down or closed."""
        cdef axf_engine *e = self._e
        if e == NULL:
            return
        self._busy += 1
        try:
            with nogil:
                axf_engine_bye_network(e)
        finally:
            self._busy -= 1

    def shutdown(self):
        """Fails everything pending with E_CLOSED and frees every region; the
        records still have to be polled. Idempotent; no-op once closed."""
        cdef axf_engine *e = self._e
        if e == NULL:
            return
        self._busy += 1
        try:
            with nogil:
                axf_engine_shutdown(e)
        finally:
            self._busy -= 1

    def close(self):
        """shutdown() + a final drain + destroy. Idempotent.

        Records drained here are dropped: call shutdown() and poll() first to
        see them. Every pinned buffer is released.
        """
        if self._e == NULL:
            return
        if self._busy or self._polling or self._posting:
            raise RuntimeError("Engine.close() while another thread is inside a native call")
        self._close_native()

    # -------------------------------------------------------------- regions

    def register(self, obj, int memfd=-1):
        """Registers obj's buffer; returns (rid, key, addr, nbytes, access).

        A writable export gives READ|WRITE access, a read-only one READ. The
        export stays acquired until poll() returns CQ_REGION_FREED for rid.
        """
        cdef _Pin pin = _Pin.__new__(_Pin)
        cdef uint32_t access = AXF_ACCESS_READ | AXF_ACCESS_WRITE
        cdef uint64_t rid = 0, key = 0
        cdef int st
        cdef bint writable = True
        self._open()
        try:
            PyObject_GetBuffer(obj, &pin.view, PyBUF_WRITABLE)
        except (BufferError, TypeError, ValueError):
            writable = False
        if not writable:
            # Read-only exporters (bytes, read-only arrays) refuse a writable
            # export; a plain one can still be READ by peers.
            PyObject_GetBuffer(obj, &pin.view, PyBUF_SIMPLE)
            access = AXF_ACCESS_READ
        pin.held = True
        if pin.view.len <= 0:
            pin.release()
            raise ValueError("cannot register an empty buffer")
        st = axf_region_register(self._e, pin.view.buf, <uint64_t>pin.view.len, access, memfd,
                                 &rid, &key)
        if st != AXF_OK:
            pin.release()
            raise NativeError(st, f"cannot register {pin.view.len} bytes")
        self._pins[rid] = pin
        return (rid, key, <uintptr_t>pin.view.buf, <uint64_t>pin.view.len, access)

    def register_file(self, int fd, uint64_t offset, uint64_t nbytes, uint32_t access):
        """Registers bytes [offset, offset + nbytes) of an open file as a file
        region; the engine keeps its own duplicate of fd. Returns (rid, key)."""
        cdef uint64_t rid = 0, key = 0
        cdef int st
        self._open()
        st = axf_region_register_kind(self._e, AXF_MEM_FILE, offset, nbytes, access, fd,
                                      &rid, &key)
        _check(st, f"cannot register {nbytes} bytes of file descriptor {fd}")
        return (rid, key)

    def file_backend(self):
        """(1 io_uring, 0 thread pool, -1 not started yet; one line) for this engine."""
        cdef char buf[160]
        cdef int r
        self._open()
        r = axf_file_info(self._e, buf, sizeof(buf))
        return r, buf.decode("utf-8", "replace")

    def register_kind(self, uint32_t kind, uint64_t addr, uint64_t nbytes, uint32_t access,
                      owner):
        """Registers memory given by address (MEM_CUDA: a device pointer, MEM_HOST:
        a host pointer without a buffer export); returns (rid, key). ``owner``
        (the object that keeps the memory alive) is held until poll() returns
        CQ_REGION_FREED for rid."""
        cdef _Pin pin = _Pin.__new__(_Pin)
        cdef uint64_t rid = 0, key = 0
        cdef int st
        self._open()
        st = axf_region_register_kind(self._e, kind, addr, nbytes, access, -1, &rid, &key)
        if st != AXF_OK:
            raise NativeError(st, f"cannot register {nbytes} bytes at {addr:#x}")
        pin.owner = owner
        self._pins[rid] = pin
        return (rid, key)

    def cuda_enable(self):
        """(status, reason): OK once CUDA endpoints may be created on this engine."""
        cdef char why[256]
        cdef int st
        self._open()
        why[0] = 0
        with nogil:
            st = axf_cuda_enable(self._e, why, sizeof(why))
        return st, why.decode("utf-8", "replace")

    def cuda_pin_region(self, uint64_t rid):
        """Page-locks host region rid for GPU copies on the engine's CUDA thread,
        ahead of its first copy; returns at once (status; best effort)."""
        self._open()
        return axf_cuda_pin_region(self._e, rid)

    def endpoint_import_cuda(self, uint64_t ep, uint64_t rid, uint64_t key, uint64_t nbytes,
                             uint32_t access, uint64_t addr, handle, uint64_t offset, uuid):
        """A peer's GPU region (handle: its IPC handle, None for our own memory)."""
        cdef const uint8_t *h = NULL
        cdef const uint8_t *u = NULL
        cdef bytes hb = None
        cdef bytes ub = None
        cdef int st
        self._open()
        if handle is not None:
            hb = bytes(handle)
            if len(hb) != AXF_CUDA_IPC_HANDLE:
                raise ValueError(f"a CUDA IPC handle is {AXF_CUDA_IPC_HANDLE} bytes, not {len(hb)}")
            h = <const uint8_t *>PyBytes_AS_STRING(hb)
        if uuid is not None:
            ub = bytes(uuid)
            if len(ub) != 16:
                raise ValueError(f"a device UUID is 16 bytes, not {len(ub)}")
            u = <const uint8_t *>PyBytes_AS_STRING(ub)
        self._busy += 1
        try:
            with nogil:
                st = axf_endpoint_import_cuda(self._e, ep, rid, key, nbytes, access, addr, h,
                                              offset, u)
        finally:
            self._busy -= 1
        _check(st, f"cannot import GPU region {rid} into endpoint {ep}")

    def deregister(self, uint64_t rid):
        """Revokes a region; its buffer is released when CQ_REGION_FREED is polled."""
        self._open()
        cdef int st = axf_region_deregister(self._e, rid)
        if st == AXF_E_NOTFOUND:
            raise ValueError(f"unknown region {rid}")
        _check(st, f"cannot deregister region {rid}")

    def revoke(self, uint64_t rid):
        """From now on no peer reaches region rid (their accesses fail as if
        it were deregistered; each connected peer is told to forget it),
        while our own transfers still use it until deregister()."""
        self._open()
        cdef int st = axf_region_revoke(self._e, rid)
        if st == AXF_E_NOTFOUND:
            raise ValueError(f"unknown region {rid}")
        _check(st, f"cannot revoke region {rid}")

    def pinned_regions(self):
        """Buffers still held by _cyx (for leak checks)."""
        return len(self._pins)

    # -------------------------------------------------------------- endpoints

    def endpoint_create(self, int kind, uint64_t tag, int32_t pid=0, int pidfd=-1):
        """Same-host kinds (EP_SHM, EP_CUDA): pid and pidfd from the kernel
        (SO_PEERCRED, pidfd_open), never from metadata; pidfd may be -1 only
        for our own pid. Other kinds: pid 0, pidfd -1. The engine owns pidfd
        from now on, also when this raises."""
        cdef uint64_t ep = 0
        self._open()
        _check(axf_endpoint_create(self._e, kind, tag, pid, pidfd, &ep), "cannot create endpoint")
        return ep

    def endpoint_add_conn(self, uint64_t ep, int fd, uint32_t rail=0):
        """The engine owns fd from now on, also when this raises. rail: the
        caller's number for the path it runs on (reported back by
        endpoint_rails and CQ_RAIL_DOWN records)."""
        cdef int st
        self._open()
        self._busy += 1
        try:
            with nogil:
                st = axf_endpoint_add_rail_conn(self._e, ep, fd, rail)
        finally:
            self._busy -= 1
        _check(st, f"cannot add a connection to endpoint {ep}")

    def endpoint_rails(self, uint64_t ep):
        """One (rail, live, bytes, rate in bytes/ms, reroutes) per connection
        the endpoint ever had, in slot order; [] for an unknown endpoint."""
        cdef axf_rail_stats st[16]
        cdef size_t n, i
        self._open()
        n = axf_endpoint_rails(self._e, ep, st, 16)
        return [(st[i].rail, bool(st[i].live), st[i].bytes, st[i].rate, st[i].reroutes)
                for i in range(n)]

    def endpoint_import(self, uint64_t ep, uint64_t rid, uint64_t key, uint64_t nbytes,
                        uint32_t access, uint64_t addr, int memfd=-1):
        """memfd: -1, or an fd of the peer's memory received over its unix
        socket (SCM_RIGHTS), sealed (F_SEAL_SHRINK|GROW|SEAL) and at least
        nbytes long (else E_ACCESS); mapped during the call. The caller keeps
        and closes it."""
        cdef int st
        self._open()
        self._busy += 1
        try:
            with nogil:  # maps (and populates) the peer's memory
                st = axf_endpoint_import(self._e, ep, rid, key, nbytes, access, addr, memfd)
        finally:
            self._busy -= 1
        _check(st, f"cannot import region {rid} into endpoint {ep}")

    def endpoint_forget(self, uint64_t ep, uint64_t rid):
        self._open()
        _check(axf_endpoint_forget(self._e, ep, rid),
               f"cannot forget region {rid} of endpoint {ep}")

    def endpoint_close(self, uint64_t ep):
        cdef int st
        self._open()
        self._busy += 1
        try:
            with nogil:
                st = axf_endpoint_close(self._e, ep)
        finally:
            self._busy -= 1
        _check(st, f"cannot close endpoint {ep}")

    def accept_conn(self, int fd, uint64_t tag, int pidfd=-1):
        """Target side; the engine owns fd (and pidfd) from now on, also when
        this raises. pidfd: the same-host peer's process (kernel-verified):
        revocations on this connection then settle only when acknowledged,
        on its goodbye, or when that process exits, not when the socket
        closes. -1 for tcp. E_LIMIT beyond max_conns."""
        cdef int st
        self._open()
        self._busy += 1
        try:
            with nogil:
                st = axf_accept_conn(self._e, fd, tag, pidfd)
        finally:
            self._busy -= 1
        _check(st, "cannot accept a connection")

    def notify_release(self, uint64_t tag, uint64_t n):
        """The application consumed n notifications of connections tagged tag
        (see max_notify_per_conn): their receivers may read again."""
        self._open()
        axf_notify_release(self._e, tag, n)

    def region_holders(self, uint64_t rid):
        """Tags of the connections a quarantined (deregistered, not yet freed)
        region still waits for; None when rid is not quarantined."""
        cdef uint64_t tags[64]
        cdef uint64_t *buf = tags
        cdef int n
        cdef list out
        self._open()
        n = axf_region_holders(self._e, rid, tags, 64)
        if n == AXF_E_NOTFOUND:
            return None
        _check(n if n < 0 else AXF_OK, f"cannot list the holders of region {rid}")
        if n > 64:
            buf = <uint64_t *>PyMem_Malloc(n * sizeof(uint64_t))
            if buf == NULL:
                raise MemoryError()
            try:
                n = min(n, axf_region_holders(self._e, rid, buf, n))
                out = [buf[i] for i in range(n)]
            finally:
                PyMem_Free(buf)
            return out
        return [tags[i] for i in range(n)]

    # -------------------------------------------------------------- data path

    def post(self, uint64_t ep, int op, descs, notify, uint64_t req_id, bint defer=False,
             bint alone=False):
        """Posts one request. Returns OK when queued, else the rejecting status
        (nothing queued, no completion follows). alone: the caller awaits it
        alone (POST_ALONE)."""
        cdef const axf_desc *d = NULL
        cdef size_t n = 0
        cdef const char *np = NULL
        cdef size_t nl = 0
        cdef uint32_t flags = (AXF_POST_DEFER if defer else 0) | (AXF_POST_ALONE if alone else 0)
        cdef axf_desc one
        cdef int st
        cdef bytes nb
        self._open()
        _descs_in(descs, &one, &d, &n)
        nb = _notify_bytes(notify)
        if nb is not None:
            np = PyBytes_AS_STRING(nb)
            nl = <size_t>PyBytes_GET_SIZE(nb)
        self._busy += 1
        with nogil:
            st = axf_post(self._e, ep, op, d, n, np, nl, req_id, flags)
        self._busy -= 1
        return st

    def post_many(self, items, bint polls=False, bint alone=False):
        """Posts (ep, op, descs, notify, req_id) items deferred, then rings one
        doorbell: one native call for a loop iteration's submissions. Every item
        is checked before any is posted. Returns the statuses, in order.

        polls: the caller polls (or drains) right after this call, so the
        completions known at submit (small same-host copies) are queued
        without signalling the eventfd (AXF_POST_POLL).

        alone: one item that the caller awaits alone, nothing else in flight
        (AXF_POST_ALONE: a same-host copy up to inline_bytes runs inside this
        call, on this thread; tcp keeps it on one connection)."""
        cdef Py_ssize_t count, i
        self._open()
        items = list(items)  # our own references while the GIL is released
        count = len(items)
        if count == 0:
            return []
        self._post_items(<list>items, count, polls, alone)
        return [self._slots[i].status for i in range(count)]

    cdef int _post_items(self, list items, Py_ssize_t count, bint polls, bint alone) except -1:
        """post_many's work: items (a list the caller holds, count > 0) posted,
        their statuses left in self._slots[:count]."""
        cdef uint32_t flags = AXF_POST_DEFER | (AXF_POST_POLL if polls else 0)
        cdef Py_ssize_t i
        cdef _slot *s
        cdef object descs, notify, nb, it
        cdef tuple item
        cdef list keep = None  # copies made here (notify payloads not given as bytes)
        cdef uint64_t small = 0  # the bytes of the batch, while it is known small
        if alone and count == 1:
            flags |= AXF_POST_ALONE
        if self._posting:
            raise RuntimeError("Engine.post_many() is not reentrant")
        self._posting = True
        try:
            self._ensure_slots(<size_t>count)
            for i in range(count):
                it = items[i]
                s = &self._slots[i]
                if type(it) is PostItem:  # Poster's: C fields, checked when made
                    s.one = (<PostItem>it).one
                    s.ep = (<PostItem>it).ep
                    s.op = (<PostItem>it).op
                    s.req_id = (<PostItem>it).req_id
                    s.descs = &s.one
                    s.n = 1
                    s.notify = NULL
                    s.notify_len = 0
                    if s.one.len <= _GIL_KEPT_BYTES:
                        small += s.one.len
                    else:
                        small = _GIL_KEPT_BYTES + 1
                    continue
                item = <tuple>it if type(it) is tuple else tuple(it)
                if len(item) != 5:
                    raise ValueError(f"a posted item has 5 fields, not {len(item)}")
                s.ep = item[0]
                s.op = item[1]
                s.req_id = item[4]
                s.notify = NULL
                s.notify_len = 0
                descs = item[2]
                _descs_in(descs, &s.one, &s.descs, &s.n)
                # One descriptor (a tuple's, counted), else no bound known.
                if s.descs == &s.one and s.one.len <= _GIL_KEPT_BYTES:
                    small += s.one.len
                else:
                    small = _GIL_KEPT_BYTES + 1
                notify = item[3]
                if notify is not None:
                    nb = _notify_bytes(notify)
                    s.notify = PyBytes_AS_STRING(nb)
                    s.notify_len = <size_t>PyBytes_GET_SIZE(nb)
                    if nb is not notify:  # a copy: ours to keep alive
                        if keep is None:
                            keep = []
                        keep.append(nb)
            # items (held by the caller) keeps every descs and notify alive,
            # keep the copies; an item converted to a tuple here holds only
            # what items[i] holds too.
            self._post_slots(count, flags, small)
        finally:
            self._posting = False
        return 0

    cdef int _post_slots(self, Py_ssize_t count, uint32_t flags, uint64_t small) except -1:
        """self._slots[:count] (filled, their buffers held by the caller)
        posted with flags, then the doorbell; small: their bytes, while
        known to be at most _GIL_KEPT_BYTES."""
        cdef Py_ssize_t i
        cdef _slot *s = self._slots
        self._busy += 1
        if small <= _GIL_KEPT_BYTES:
            # Little to copy (what a same-host post copies inline): the
            # GIL's release and retake (~600 instructions) would cost
            # more than the other threads could gain. POST_NOHELP: the
            # doorbell leaves other requests' queued work (shm copies up
            # to inline_bytes, a 1 MiB tcp frame) to the workers and
            # senders, which would otherwise hold every other Python
            # thread up to a millisecond.
            flags |= AXF_POST_NOHELP
            for i in range(count):
                s[i].status = axf_post(self._e, s[i].ep, s[i].op, s[i].descs, s[i].n,
                                       s[i].notify, s[i].notify_len, s[i].req_id,
                                       flags)
            axf_doorbell_ex(self._e, AXF_POST_NOHELP)
        else:
            with nogil:
                for i in range(count):
                    s[i].status = axf_post(self._e, s[i].ep, s[i].op, s[i].descs, s[i].n,
                                           s[i].notify, s[i].notify_len, s[i].req_id,
                                           flags)
                axf_doorbell(self._e)
        self._busy -= 1
        return 0

    def post_drain(self, list items, list ts, dict inflight, object slow, object release,
                   object result_type, double weight, uint64_t bandwidth_min,
                   Py_ssize_t max=POLL_DEFAULT, bint alone=False):
        """post_many(items, polls=True, alone) then, if every item was
        accepted, ``transfer._posted = True`` for each of ``ts`` (the items'
        transfers, in order) and drain(inflight, ...): one call for the
        submission path. Returns (statuses, records, completed, bytes):
        statuses None when all were accepted (then the rest is the drain's,
        and items and ts were emptied before the drain: the caller's batch
        lists, reusable), else post_many's list and nothing drained, marked
        or emptied (0, 0, 0)."""
        cdef _drained d
        statuses = self._post_drain(items, ts, inflight, slow, release, result_type, weight,
                                    bandwidth_min, max, alone, &d)
        return statuses, d.records, d.completed, d.nbytes

    cdef object _post_drain(self, list items, list ts, dict inflight, object slow,
                            object release, object result_type, double weight,
                            uint64_t bandwidth_min, Py_ssize_t max, bint alone, _drained *d):
        """post_drain's work: its statuses (None: all accepted), the drain's
        counts in *d (zeros when nothing was drained). C results, not a
        tuple: the submission path's callers add them to the agent's totals
        as C integers (a tuple and three ints made and freed per post, ~250
        instructions of an awaited small request)."""
        cdef Py_ssize_t count, i
        cdef object t
        d.records = d.completed = 0
        d.nbytes = 0
        self._open()
        count = len(items)
        if count == 0:
            return None
        if len(ts) != count:
            raise ValueError("post_drain: one transfer per item")
        # Inside a drain (a callback of its posting again): no drain here,
        # so no quiet records either (AXF_POST_POLL leaves what the post
        # completes unsignalled for a poll that would then never come); the
        # outer drain or the next wake-up takes them.
        nested = self._polling
        self._post_items(items, count, not nested, alone)
        for i in range(count):
            if self._slots[i].status != AXF_OK:
                return [self._slots[i].status for i in range(count)]
        for i in range(count):
            _mark_posted(ts[i])
        # Posted: the engine copied the descriptors; the batch lists are the
        # caller's to fill again (a transfer submitted from the drain's
        # callbacks goes into them).
        axf_list_empty(items)  # del items[:], its allocation kept
        axf_list_empty(ts)
        self._posted_drain(nested, inflight, slow, release, result_type, weight,
                           bandwidth_min, max, d)
        return None

    cdef object _post_one_drain(self, object ep, object op, object descs, object req_id,
                                object t, dict inflight, object slow, object release,
                                object result_type, double weight, uint64_t bandwidth_min,
                                Py_ssize_t max, bint alone, _drained *d):
        """_post_drain([(ep, op, descs, None, req_id)], [t], ..., d) without
        the batch lists (Submitter's post of one request when nothing else
        is batched: no item tuple, no lists to fill and empty)."""
        cdef uint32_t flags
        cdef _slot *s
        cdef bint nested
        d.records = d.completed = 0
        d.nbytes = 0
        self._open()
        nested = self._polling
        flags = AXF_POST_DEFER | (0 if nested else AXF_POST_POLL)
        if alone:
            flags |= AXF_POST_ALONE
        if self._posting:
            raise RuntimeError("Engine.post_many() is not reentrant")
        self._posting = True
        try:
            self._ensure_slots(1)
            s = self._slots
            s.ep = ep
            s.op = op
            s.req_id = req_id
            s.notify = NULL
            s.notify_len = 0
            _descs_in(descs, &s.one, &s.descs, &s.n)
            # (descs, held by the caller, keeps an array's memory alive.)
            self._post_slots(1, flags, s.one.len if s.descs == &s.one
                             and s.one.len <= _GIL_KEPT_BYTES else _GIL_KEPT_BYTES + 1)
        finally:
            self._posting = False
        if self._slots[0].status != AXF_OK:
            return [self._slots[0].status]
        _mark_posted(t)
        self._posted_drain(nested, inflight, slow, release, result_type, weight,
                           bandwidth_min, max, d)
        return None

    cdef int _posted_drain(self, bint nested, dict inflight, object slow, object release,
                           object result_type, double weight, uint64_t bandwidth_min,
                           Py_ssize_t max, _drained *d) except -1:
        """The end of _post_drain once all was posted: the ring drained into
        *d, unless nested (see there) or nothing is in it (*d zeros)."""
        d.records = d.completed = 0
        d.nbytes = 0
        if nested:
            return 0
        # Nothing in the ring (a remote request, a copy on a worker): no poll,
        # whose lock and eventfd read (to clear a wake-up nobody made) cost
        # two syscalls' worth on the way of every tcp request. axf_wait_ex(0,
        # POLLS) reads the ring's count without its lock; a stale wake-up is
        # cleared by the drain that it causes.
        if axf_wait_ex(self._e, 0, AXF_WAIT_POLLS) == 0:
            return 0
        return self._drain(inflight, slow, release, result_type, weight, bandwidth_min, max, d)

    def doorbell(self):
        self._open()
        self._busy += 1
        with nogil:  # it may copy queued work (shm help) or send a large frame
            axf_doorbell(self._e)
        self._busy -= 1

    def cancel(self, uint64_t req_id):
        """OK (the E_CANCELLED completion follows once memory is untouched) or E_NOTFOUND."""
        self._open()
        return axf_cancel(self._e, req_id)

    def poll(self, Py_ssize_t max=POLL_DEFAULT):
        """Drains up to max records without blocking; [] once closed.

        Each record: (kind, status, id, tag, nbytes, fail_index, payload), payload
        bytes or None. CQ_REGION_FREED also releases that region's buffer.
        """
        cdef size_t n, i
        cdef axf_completion *c
        cdef list out
        if self._e == NULL:
            return []
        n = self._poll_batch(max, "poll")
        if n == 0:
            return []
        try:
            self._release_freed(n)
            out = [None] * n
            for i in range(n):
                c = &self._cq[i]
                out[i] = (
                    c.kind,
                    c.status,
                    c.id,
                    c.tag,
                    c.nbytes,
                    c.fail_index,
                    PyBytes_FromStringAndSize(<char *>c.payload, c.payload_len)
                    if c.payload != NULL else None,
                )
        finally:
            for i in range(n):
                axf_completion_free(&self._cq[i])
            self._polling = False
        return out

    def drain(self, dict inflight, object slow, object release, object result_type,
              double weight, uint64_t bandwidth_min, Py_ssize_t max=POLL_DEFAULT):
        """Drains up to max records and dispatches each, in ring order; returns
        (records, completed, bytes): the records drained, and the transfers
        completed here with their bytes (the agent's totals).

        A successful CQ_XFER record whose id is in ``inflight`` (id -> Transfer)
        is completed here, without a Python call: the transfer leaves
        ``inflight``; if it holds a scheduler budget (``_admitted``),
        ``release(transfer)`` is called first; its peer's counters
        (``transfer.peer._counters``) are settled, once per run of records of
        one peer, by ``counters.settle(done, req_bytes, moved, latency,
        bandwidth)``, the averages read from ``counters.latency`` and
        ``counters.bandwidth`` and updated per transfer by the policy the caller
        gives: a transfer
        of ``bandwidth_min`` bytes or more is a bandwidth sample, a smaller one
        a latency sample, each weighing ``weight`` against the average so far
        (the first one taken as it is); and unless the future is done
        (cancelled) it gets ``result_type(nbytes, seconds, path, reroutes)``,
        path being ``transfer._path`` or else ``peer.path``. A successful record
        with an unknown id is dropped. Every other record goes to
        ``slow(kind, status, id, tag, nbytes, fail_index, payload)``.

        A peer's counters are settled before every call into Python, so
        ``slow`` and ``release`` always see them up to date. Not reentrant:
        neither callback may poll or drain.
        """
        cdef _drained d
        self._drain(inflight, slow, release, result_type, weight, bandwidth_min, max, &d)
        return d.records, d.completed, d.nbytes

    cdef int _drain(self, dict inflight, object slow, object release, object result_type,
                    double weight, uint64_t bandwidth_min, Py_ssize_t max,
                    _drained *d) except -1:
        """drain's work, its (records, completed, bytes) into *d."""
        cdef size_t n, i
        cdef axf_completion *c
        cdef object t, peer = None, counters = None, path, r, key, tpeer, asked
        cdef PyObject *v
        cdef object peer_path = None  # peer.path, read once per run of its records
        cdef list wake = None  # the done callbacks of the futures completed here
        # A callback's error (slow, release) is reported once the whole batch
        # is processed (_report_drain_error): raised at once, the records
        # after it were freed unread and their transfers never resolved.
        cdef object failed = None
        cdef Py_ssize_t completed = 0, done = 0
        cdef uint64_t total = 0, moved = 0, req_bytes = 0
        cdef double now, seconds, latency = 0.0, bandwidth = 0.0
        d.records = d.completed = 0
        d.nbytes = 0
        if self._e == NULL:
            return 0
        n = self._poll_batch(max, "drain")
        if n == 0:
            return 0
        # One clock reading for the batch: every record in it was complete
        # before the poll, and what is measured is post -> seen by the loop.
        now = _perf_counter()
        try:
            self._release_freed(n)
            for i in range(n):
                c = &self._cq[i]
                if c.kind == AXF_CQ_XFER and c.status == AXF_OK:
                    # One dict operation: the transfer out of inflight.
                    key = c.id
                    t = inflight.pop(key, None)
                    if t is None:
                        continue  # not ours (any more): nothing to complete
                else:
                    # slow() finds the transfer in inflight (and takes it out).
                    if peer is not None:
                        _settle(counters, done, req_bytes, moved, latency, bandwidth)
                        peer = None
                    try:
                        slow(c.kind, c.status, c.id, c.tag, c.nbytes, c.fail_index,
                             PyBytes_FromStringAndSize(<char *>c.payload, c.payload_len)
                             if c.payload != NULL else None)
                    except Exception as exc:
                        if failed is None:
                            failed = exc
                    continue
                if type(t) is not _xfer_type:
                    _xfer_resolve(type(t))
                # The transfer's fields read through their slots here, not
                # by _xfer_get calls (five a record, which the C compiler
                # left out of line): _xfer_getattr only where one is unset
                # or not a plain slot. _admitted, only tested, borrowed.
                v = axf_slot_get(t, _xfer_off[_T_ADMITTED])
                if (<object>v is not False and <object>v) if v != NULL else \
                        _xfer_getattr(t, _T_ADMITTED):
                    if peer is not None:
                        _settle(counters, done, req_bytes, moved, latency, bandwidth)
                        peer = None
                    try:
                        release(t)
                    except Exception as exc:
                        if failed is None:
                            failed = exc
                v = axf_slot_get(t, _xfer_off[_T_PEER])
                tpeer = <object>v if v != NULL else _xfer_getattr(t, _T_PEER)
                if tpeer is not peer:
                    if peer is not None:
                        _settle(counters, done, req_bytes, moved, latency, bandwidth)
                    peer = tpeer
                    counters = _peer_get(peer, _P_COUNTERS)
                    done = 0
                    req_bytes = moved = 0
                    latency = _counters_float(counters, _C_LATENCY)
                    bandwidth = _counters_float(counters, _C_BANDWIDTH)
                    peer_path = _peer_get(peer, _P_PATH)
                done += 1
                v = axf_slot_get(t, _xfer_off[_T_NBYTES])
                asked = <object>v if v != NULL else _xfer_getattr(t, _T_NBYTES)
                req_bytes += <uint64_t>asked
                moved += c.nbytes
                completed += 1
                total += c.nbytes
                v = axf_slot_get(t, _xfer_off[_T_T0])
                seconds = now - (PyFloat_AS_DOUBLE(<object>v) if v != NULL
                                 and type(<object>v) is float
                                 else <double>_xfer_get(t, _T_T0))
                _average_in(&latency, &bandwidth, c.nbytes, seconds, bandwidth_min, weight)
                if not (_fut_done(t) if _xfer_future else t.done()):
                    v = axf_slot_get(t, _xfer_off[_T_PATH])
                    path = <object>v if v != NULL else _xfer_getattr(t, _T_PATH)
                    if path is None:
                        path = peer_path
                    # On success fail_index counts the reroutes. nbytes: the
                    # transfer's own int when it is one and it moved what it
                    # asked (no new int per record).
                    r = _make_result(result_type,
                                     asked if type(asked) is int
                                     and <uint64_t>asked == c.nbytes else c.nbytes,
                                     seconds, path, c.fail_index)
                    if _xfer_future and self.batch_wakeups:
                        wake = _take_callbacks(t, wake, self)
                        if self._take_error is not None:  # (the remove_done_callback path's)
                            exc = _take_callbacks_error(self)
                            if failed is None:
                                failed = exc
                        _fut_set_result(t, r)
                    elif _xfer_future:
                        _fut_set_result(t, r)
                    else:
                        t.set_result(r)
        finally:
            try:
                if peer is not None:
                    _settle(counters, done, req_bytes, moved, latency, bandwidth)
                if wake:
                    _schedule_callbacks(wake)
            finally:
                # Even if the counters' settle raised: else the records leak
                # and every later drain says it is not reentrant.
                for i in range(n):
                    axf_completion_free(&self._cq[i])
                self._polling = False
        d.records = <Py_ssize_t>n
        d.completed = completed
        d.nbytes = total
        if failed is not None:
            _report_drain_error(failed)
        return 0

    # -------------------------------------------------------------- verbs

    def verbs_enable(self, provider=None):
        """(devices, why): opens every RDMA device for this engine (0: none,
        verbs stays off; negative: cannot be used). Once only."""
        cdef char why[512]
        cdef bytes p = _c_path(provider)
        cdef const char *cp = NULL if p is None else <const char *>p
        cdef int n
        self._open()
        why[0] = 0
        self._busy += 1
        try:
            with nogil:
                n = axf_verbs_enable(self._e, cp, why, sizeof(why))
        finally:
            self._busy -= 1
        return n, why.decode("utf-8", "replace")

    def verbs_device_count(self):
        self._open()
        return axf_verbs_device_count(self._e)

    def verbs_region_keys(self, uint64_t rid):
        """[(addr, rkey)] of region rid, one per device ([] while verbs is off)."""
        cdef uint64_t addrs[16]
        cdef uint32_t rkeys[16]
        cdef int n, i
        self._open()
        n = axf_verbs_region_keys(self._e, rid, addrs, rkeys, 16)
        if n < 0:
            raise NativeError(n, f"no verbs keys for region {rid}")
        return [(addrs[i], rkeys[i]) for i in range(n)]

    def verbs_region_dmabuf(self, uint64_t rid, int fd, uint64_t offset=0):
        """GPUDirect: registers CUDA region rid through a dmabuf on every device."""
        self._open()
        _check(axf_verbs_region_dmabuf(self._e, rid, fd, offset),
               f"cannot register region {rid} through a dmabuf")

    def verbs_qp_create(self, uint64_t ep, uint32_t dev):
        """Initiator: a queue pair of ep on device dev; returns its info tuple
        (qpn, psn, mtu, lid, port, gid_index, gid)."""
        cdef axf_verbs_qp_info out
        self._open()
        _check(axf_verbs_qp_create(self._e, ep, dev, &out),
               f"cannot create a queue pair on device {dev}")
        return _qp_info_out(&out)

    def verbs_qp_connect(self, uint64_t ep, uint32_t dev, uint32_t remote_dev, remote):
        cdef axf_verbs_qp_info r = _qp_info_in(remote)
        cdef int st
        self._open()
        self._busy += 1
        try:
            with nogil:
                st = axf_verbs_qp_connect(self._e, ep, dev, remote_dev, &r)
        finally:
            self._busy -= 1
        _check(st, f"cannot connect the queue pair on device {dev}")

    def verbs_accept_qp(self, uint32_t dev, remote):
        """Target: (handle, info) of a queue pair on dev connected to remote."""
        cdef axf_verbs_qp_info r = _qp_info_in(remote)
        cdef axf_verbs_qp_info out
        cdef uint64_t h = 0
        cdef int st
        self._open()
        self._busy += 1
        try:
            with nogil:
                st = axf_verbs_accept_qp(self._e, dev, &r, &out, &h)
        finally:
            self._busy -= 1
        _check(st, f"cannot accept a queue pair on device {dev}")
        return h, _qp_info_out(&out)

    def verbs_qp_destroy(self, uint64_t handle):
        self._open()
        _check(axf_verbs_qp_destroy(self._e, handle), f"cannot destroy queue pair {handle}")

    def verbs_accept_conn(self, int fd, uint64_t tag, handles):
        """Target: accepts fd; the queue pairs live as long as it. The engine
        owns fd (and the handles) from now on, also when this raises."""
        cdef uint64_t hs[16]
        cdef size_t n = 0
        cdef int st
        self._open()
        for h in handles:
            if n == 16:
                raise ValueError("at most 16 queue pairs per connection")
            hs[n] = h
            n += 1
        self._busy += 1
        try:
            with nogil:
                st = axf_verbs_accept_conn(self._e, fd, tag, hs, n)
        finally:
            self._busy -= 1
        _check(st, "cannot accept a verbs connection")

    def endpoint_import_verbs(self, uint64_t ep, uint64_t rid, keys):
        """keys: [(addr, rkey)] per device of the region's owner."""
        cdef uint64_t addrs[16]
        cdef uint32_t rkeys[16]
        cdef size_t n = 0
        self._open()
        for addr, rkey in keys:
            if n == 16:
                raise ValueError("at most 16 devices")
            addrs[n] = addr
            rkeys[n] = rkey
            n += 1
        _check(axf_endpoint_import_verbs(self._e, ep, rid, addrs, rkeys, n),
               f"cannot import the verbs keys of region {rid}")

    def stats(self):
        cdef axf_stats s
        self._open()
        axf_engine_stats(self._e, &s)
        return {
            "regions": s.regions,
            "ops": s.ops,
            "endpoints": s.endpoints,
            "conns": s.conns,
            "ops_posted": s.ops_posted,
            "ops_completed": s.ops_completed,
            "ops_failed": s.ops_failed,
            "bytes": s.bytes,
            "frames_rejected": s.frames_rejected,
            "quarantined": s.quarantined,
            "quarantined_bytes": s.quarantined_bytes,
            "held_conns": s.held_conns,
            "conns_refused": s.conns_refused,
            "cq_dropped": s.cq_dropped,
            "helped": s.helped,
        }


def _report_drain_error(exc):
    """A completion callback's error, seen while draining the ring: to the
    running loop's exception handler, as asyncio reports a callback's error,
    not raised to whoever's call drained (a write() must not fail for another
    record's callback, and the drain's counts must still reach its caller).
    Raised only where no loop runs."""
    try:
        loop = _get_running_loop()
    except RuntimeError:
        raise exc from None
    loop.call_exception_handler({
        "message": "aioxfer: a completion callback raised while draining the engine's ring",
        "exception": exc,
    })


# ------------------------------------------------------------------ pools

def shm_make_huge(int memfd, uint64_t nbytes):
    """Collapses a fresh pool memfd (no data yet, nobody mapping it) into
    shmem huge pages, 2 MiB each, whatever the host's shmem_enabled says
    short of ``deny``: a same-host peer then populates its mapping of the
    pool with one page-table entry per 2 MiB instead of 512 (shm.c
    axf_shm_make_huge says what it costs). True when every whole 2 MiB is
    one huge page; False when nothing changed (the kernel refused, the file
    has data already, or it is under 2 MiB). ValueError for a file shorter
    than nbytes or not a regular file."""
    cdef int r
    with nogil:
        r = axf_shm_make_huge(memfd, nbytes)
    if r < 0:
        raise ValueError(f"cannot make fd {memfd} huge: {strerror(r)}")
    return r == 1

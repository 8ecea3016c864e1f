

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
        if lr is not None and rr is not None and type(nbytes) is int:
            self._lr_closed = axf_slot_offset(type(lr), axf_type_lookup(type(lr), "_closed"))
            self._rr_gone = axf_slot_offset(type(rr), axf_type_lookup(type(rr), "_gone"))
            if self._lr_closed < 0 or self._rr_gone < 0:
                self._lr_closed = self._rr_gone = -1

    def post(self, bint now=False):
        cdef PyObject *closed
        cdef PyObject *gone
        cdef object t
        if self._lr_closed >= 0:
            closed = axf_slot_ptr(self._lr, self._lr_closed)
            gone = axf_slot_ptr(self._rr, self._rr_gone)
            if (closed != NULL and <object>closed is False and gone != NULL
                    and <object>gone is False and self._agent._closed is False):
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

    def __repr__(self):
        return f"<Prepared {self.op} of {self.nbytes} bytes>"


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

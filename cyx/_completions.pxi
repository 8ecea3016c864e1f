# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# Completion tallies onto peers (Engine.drain).

# ------------------------------------------------------------------ completions

cdef int _settle(object peer, Py_ssize_t done, uint64_t req_bytes, uint64_t moved,
                 double latency, double bandwidth) except -1:
    """Engine.drain's per-peer tally of completed transfers, onto the peer."""
    peer._inflight -= done
    peer._inflight_bytes -= req_bytes
    peer._completed += done
    peer._bytes += moved
    peer._latency = latency
    peer._bandwidth = bandwidth
    return 0

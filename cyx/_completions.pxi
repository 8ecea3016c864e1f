# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# Completion tallies onto a peer's counters (Engine.drain).

# ------------------------------------------------------------------ completions

cdef int _settle(object counters, Py_ssize_t done, uint64_t req_bytes, uint64_t moved,
                 double latency, double bandwidth) except -1:
    """Engine.drain's per-peer tally of completed transfers, onto the peer's
    counters (aioxfer.stats.PeerCounters: a typed record, not the Peer)."""
    counters.inflight -= done
    counters.inflight_bytes -= req_bytes
    counters.completed += done
    counters.bytes += moved
    counters.latency = latency
    counters.bandwidth = bandwidth
    return 0

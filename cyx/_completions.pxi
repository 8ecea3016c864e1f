# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# Completion tallies onto a peer's counters (Engine.drain).

# ------------------------------------------------------------------ completions

cdef inline int _settle(object counters, Py_ssize_t done, uint64_t req_bytes, uint64_t moved,
                        double latency, double bandwidth) except -1:
    """Engine.drain's per-peer tally of completed transfers: one call of the
    counters' own settle (aioxfer.stats.PeerCounters: a typed record, not the
    Peer; the drain names none of its fields)."""
    counters.settle(done, req_bytes, moved, latency, bandwidth)
    return 0

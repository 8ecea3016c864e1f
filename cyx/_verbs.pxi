# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# The verbs transport's probe and queue-pair parameters, in and out.

# ------------------------------------------------------------------ verbs

cdef bytes _c_path(object provider):
    if provider is None or provider == "":
        return None
    return str(provider).encode()


def verbs_probe(provider=None):
    """(devices, names, why): loads the verbs (a software provider library at
    ``provider``, else libibverbs.so.1) and lists the devices. devices is 0
    for none (a kernel without InfiniBand: ENOSYS), negative when verbs cannot
    be used at all (not built, library missing); why says which."""
    cdef char names[4096]
    cdef char why[512]
    cdef bytes p = _c_path(provider)
    cdef const char *cp = NULL if p is None else <const char *>p
    cdef int n
    names[0] = 0
    why[0] = 0
    axf_env_read()  # with the GIL: the AIOXFER_VERBS_* settings as they are now
    with nogil:
        n = axf_verbs_probe(cp, names, sizeof(names), why, sizeof(why))
    text = names.decode("utf-8", "replace")
    return n, [line for line in text.split("\n") if line], why.decode("utf-8", "replace")


cdef axf_verbs_qp_info _qp_info_in(object info) except *:
    cdef axf_verbs_qp_info q
    cdef bytes gid
    memset(&q, 0, sizeof(q))
    # 7 fields, or 10 with (link layer, GID type, READ depth served) from a
    # peer that says them (0: not said; the engine then assumes a peer like us)
    extra = tuple(info[7:10]) if len(info) == 10 else (0, 0, 0)
    qpn, psn, mtu, lid, port, gid_index, gid = info[:7]
    q.link_layer, q.gid_type, q.max_dest_rd_atomic = extra
    if len(gid) != 16:
        raise ValueError("a GID is 16 bytes")
    q.qpn = qpn
    q.psn = psn
    q.mtu = mtu
    q.lid = lid
    q.port = port
    q.gid_index = gid_index
    for i in range(16):
        q.gid[i] = gid[i]
    return q


cdef tuple _qp_info_out(const axf_verbs_qp_info *q):
    return (q.qpn, q.psn, q.mtu, q.lid, q.port, q.gid_index,
            PyBytes_FromStringAndSize(<const char *>q.gid, 16),
            q.link_layer, q.gid_type, q.max_dest_rd_atomic)

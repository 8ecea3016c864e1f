/* aioxfer native engine: registered memory, endpoints, one completion ring.
 *
 * Threading: every function may be called from the Python loop thread. Bulk
 * copies, socket I/O and keepalives run on engine-owned threads that sleep in
 * blocking syscalls or condition waits; nothing spins while idle (a tcp
 * receiver that answered a request may poll for the next one, bounded:
 * axf_config.target_poll_us). Completions from every
 * transport land in one ring; the engine writes axf_engine_fd() (an eventfd)
 * when the ring goes from empty to non-empty. Besides those threads, the
 * caller's may copy (a lone same-host request, AXF_POST_ALONE) or poll the
 * ring for a bounded time (axf_wait): only while it has work in flight.
 */
#ifndef AIOXFER_H
#define AIOXFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: the one table Python maps to exception classes. */
#define AXF_STATUS_TABLE(X)                                             \
    X(AXF_OK, 0, "ok")                                                  \
    X(AXF_E_INVALID, -1, "invalid argument")                            \
    X(AXF_E_NOMEM, -2, "out of memory")                                 \
    X(AXF_E_ACCESS, -3, "access denied (bad key, bounds or permission)") \
    X(AXF_E_PEER_LOST, -4, "peer lost")                                 \
    X(AXF_E_TIMEOUT, -5, "timed out")                                   \
    X(AXF_E_TRANSPORT, -6, "transport error")                           \
    X(AXF_E_REGISTRATION, -7, "registration error")                     \
    X(AXF_E_PROTOCOL, -8, "protocol error")                             \
    X(AXF_E_CLOSED, -9, "closed")                                       \
    X(AXF_E_CANCELLED, -10, "cancelled")                                \
    X(AXF_E_NOTFOUND, -11, "not found")                                 \
    X(AXF_E_LIMIT, -12, "resource limit reached")

enum axf_status {
#define AXF_ENUM_ENTRY(name, value, text) name = value,
    AXF_STATUS_TABLE(AXF_ENUM_ENTRY)
#undef AXF_ENUM_ENTRY
};

const char *axf_strerror(int status);

/* Access bits of a region. */
#define AXF_ACCESS_READ 1u  /* peers may READ from it */
#define AXF_ACCESS_WRITE 2u /* peers may WRITE into it */

/* Endpoint kinds (transports). */
#define AXF_EP_TCP 1
#define AXF_EP_SHM 2
#define AXF_EP_FILE 3  /* this engine's own file regions (local storage) */
#define AXF_EP_VERBS 4 /* RDMA verbs queue pairs, a stream connection for control */
#define AXF_EP_CUDA 5  /* same-host GPU copies (CUDA IPC, streams, events) */

/* Memory kinds of a region. Host memory is what every transport can touch;
 * the others only the transports that know them. */
#define AXF_MEM_HOST 0
#define AXF_MEM_CUDA 1 /* addr: a device pointer */
#define AXF_MEM_FILE 2 /* fd: an open file; addr: the region's offset in it */

/* Ops. */
#define AXF_OP_WRITE 1
#define AXF_OP_READ 2
#define AXF_OP_NOTIFY 3 /* zero descriptors, payload only */

/* Flags for axf_post. */
/* AXF_POST_DEFER: queue only; sent at the latest by axf_doorbell() (the
 * connection's sending thread may send it earlier, whenever it runs). */
#define AXF_POST_DEFER 1u
#define AXF_POST_POLL 2u  /* the caller polls right after this call: a completion
                             known at submit (small same-host copy) is queued
                             without signalling the eventfd (no wake-up, no
                             syscall for it) */
#define AXF_POST_ALONE 4u /* the caller awaits this request alone (nothing else of its
                             in flight): a same-host copy up to axf_config.inline_bytes
                             runs on the calling thread, inside this call, where
                             handing it to a copy worker would cost two thread
                             wake-ups (from 2 MiB the copy workers take a share
                             beside it; still done when this call returns); over
                             tcp its frames stay on one connection */
#define AXF_POST_NOHELP 8u /* the caller holds others up while it posts (a Python thread
                              keeping the GIL): this post, and axf_doorbell_ex with
                              this flag, take on no other request's queued work (a
                              shm doorbell's help with queued copies, a tcp frame over
                              64 KiB queued on a connection): the copy workers and
                              sending threads do it. Its own copy still runs inline
                              as the other flags say. */
#define AXF_POST_INLINE 16u /* with AXF_POST_POLL: a request that completes successfully
                               on the calling thread inside this call (a same-host copy
                               done inline) pushes no completion record: axf_post
                               returns AXF_POST_DONE instead of AXF_OK, and the request
                               is over, every byte it asked moved (a caller that
                               polls for its own request at once would otherwise
                               push, poll and free that record). Any other outcome
                               (queued, done by another thread, failed, a bound
                               notification) is reported as without this flag. */
#define AXF_POST_DONE 1 /* axf_post's answer for AXF_POST_INLINE's case: not a status */

/* Completion kinds. */
#define AXF_CQ_XFER 1         /* id = request id; status, nbytes, fail_index (on
                                 success: how many of its groups were rerouted) */
#define AXF_CQ_NOTIFY 2       /* tag = connection tag; payload */
#define AXF_CQ_PEER_LOST 3    /* id = endpoint id; tag; status = reason; fail_index 1: the
                                 peer said goodbye (its engine shut down): closed, not failed */
#define AXF_CQ_REGION_FREED 4 /* id = region id; status AXF_OK: its memory is no longer
                                 touched; AXF_E_CLOSED: the engine shut down while peers
                                 could still touch it (quarantined, given up: never reuse
                                 that memory) */
#define AXF_CQ_LOG 5          /* tag = connection tag; payload = reason text */
#define AXF_CQ_CONN_CLOSED 6  /* tag = connection tag (accepted side) */
#define AXF_CQ_RAIL_DOWN 7    /* id = endpoint id; tag; fail_index = rail; nbytes = request
                                 groups moved to other connections; status = why
                                 (AXF_E_PEER_LOST: broken or silent, AXF_E_TIMEOUT: stalled,
                                 AXF_E_CLOSED: the peer said goodbye on it) */
#define AXF_CQ_XFER_HELD 8    /* as AXF_CQ_XFER for a failed or cancelled request (it is
                                 over: status, nbytes, fail_index; a success is told only
                                 once its memory is free), but the engine still holds its
                                 local memory:
                                 pages of it sent by the one-copy send (tcp, loopback) that
                                 a peer may still read. Do not reuse, free or deregister
                                 that memory (a deregistration waits) until
                                 AXF_CQ_XFER_FREED with the same id */
#define AXF_CQ_XFER_FREED 9   /* id = request id, after its AXF_CQ_XFER_HELD: its memory is
                                 no longer touched (its regions released) */

#define AXF_MAX_NOTIFY 4096u

typedef struct axf_engine axf_engine;

typedef struct axf_config {
    uint32_t copy_workers;    /* shm copy threads (0: default 2) */
    uint64_t chunk_bytes;     /* tcp chunk size (0: default 1 MiB) */
    uint64_t inline_bytes;    /* a lone shm request (AXF_POST_ALONE) up to this size is
                                 copied at submit, on the caller's thread; other shm
                                 requests up to min(this, 64 KiB). 0: calibrated (see
                                 axf_calibrate); UINT64_MAX: never */
    uint32_t keepalive_ms;    /* idle ping interval (0: default 1000) */
    uint32_t peer_timeout_ms; /* silence after which a connection is lost (0: default 5000) */
    uint32_t stall_ms;        /* a connection with replies outstanding and no progress for
                                 this long fails its requests with AXF_E_TIMEOUT (0: off) */
    /* Limits on what peers can make us hold (0: the default given). */
    uint32_t max_conns;       /* live connections (accepted and dialled) per engine, each
                                 two threads, plus closed same-host ones still held (one
                                 per live peer process). Beyond it: AXF_E_LIMIT (default 256) */
    uint32_t max_notify_per_conn; /* notifications of one connection pushed to the ring and
                                 not yet released by axf_notify_release: at this many its
                                 receiver stops reading (TCP flow control pushes back).
                                 Default 1024; UINT32_MAX: no bound */
    uint32_t revoke_timeout_ms; /* a connection without a pidfd (tcp) that has not
                                 acknowledged a revocation within this (counted while we
                                 read it) is disconnected, and then counts as gone
                                 (default 10000) */
    uint64_t reply_queue_bytes; /* replies (READ responses, acknowledgements) queued on one
                                 connection, counting their payload: at this much its
                                 receiver stops reading until they drain (default 64 MiB) */
    uint32_t target_poll_us;  /* a receiver that answered a request polls its socket for the
                                 next one while that peer's requests come within this of
                                 its answers, for twice their average gap (one receiver
                                 of the engine at a time). 0: default 100; UINT32_MAX:
                                 never (nothing polls: progress "sleep") */
} axf_config;

/* One descriptor: local (region, offset) <-> remote (region, key, offset), len. */
typedef struct axf_desc {
    uint64_t lrid;
    uint64_t loff;
    uint64_t rrid;
    uint64_t rkey;
    uint64_t roff;
    uint64_t len;
} axf_desc;

/* One connection of an endpoint, as axf_endpoint_rails reports it. */
typedef struct axf_rail_stats {
    uint32_t rail;     /* as given to axf_endpoint_add_rail_conn */
    uint32_t live;     /* 0 once the connection failed */
    uint64_t bytes;    /* data acknowledged (WRITE) or received (READ) on it */
    uint64_t rate;     /* measured bytes per millisecond (0: not measured yet) */
    uint64_t reroutes; /* request groups moved off it when it failed */
} axf_rail_stats;

typedef struct axf_completion {
    uint32_t kind;
    int32_t status;
    uint64_t id;
    uint64_t tag;
    uint64_t nbytes;
    uint64_t fail_index;
    uint32_t payload_len;
    /* malloc'd (NULL: none), payload_len bytes followed by a NUL not counted
     * in payload_len (a log's text is a C string; a notification's bytes may
     * hold NULs of their own); released by axf_completion_free */
    uint8_t *payload;
} axf_completion;

typedef struct axf_stats {
    uint64_t regions;       /* registered and not yet freed */
    uint64_t ops;           /* posted and not yet completed */
    uint64_t endpoints;
    uint64_t conns;         /* live connections (both directions) */
    uint64_t ops_posted;
    uint64_t ops_completed;
    uint64_t ops_failed;
    uint64_t bytes;         /* bytes moved by completed ops */
    uint64_t frames_rejected; /* malformed frames that closed a connection */
    uint64_t quarantined;       /* deregistered (or revoked) regions some peer may still touch */
    uint64_t quarantined_bytes; /* ... and their bytes */
    uint64_t held_conns;        /* closed same-host connections whose process lives and
                                   still holds a revocation (or may: no goodbye) */
    uint64_t conns_refused;     /* connections refused at max_conns */
    uint64_t cq_dropped;        /* completion records lost: the ring was full and could not
                                   grow (out of memory). Only records no post, endpoint or
                                   region had promised a slot to: logs, peers'
                                   notifications (their credit is given back), accepted
                                   connections' closes, rails down. Logged once a second
                                   at most (an AXF_CQ_LOG record of its own). */
    uint64_t helped;            /* tcp replies (acknowledgements, READ responses, a lone
                                   READ's response up to 1 MiB as it arrives) read off the
                                   socket by the thread awaiting them, not by the
                                   connection's receiver (axf_wait's spin) */
} axf_stats;

axf_engine *axf_engine_create(const axf_config *cfg);
int axf_engine_fd(axf_engine *e);
/* Stops every connection and worker, fails pending ops with AXF_E_CLOSED and
 * frees every region (their completions go to the ring). Idempotent. */
void axf_engine_shutdown(axf_engine *e);
/* Before releasing every region on close: says goodbye on each accepted
 * network (not same-host) connection and ends it, then waits (at most
 * min(peer_timeout, 1 s)) for its threads to leave, so that those peers see
 * a close (AXF_CQ_PEER_LOST, goodbye) and not refused accesses. Same-host
 * peers and our own connections are left to axf_engine_shutdown.
 * AXF_E_CLOSED after shutdown. */
int axf_engine_bye_network(axf_engine *e);
void axf_engine_destroy(axf_engine *e); /* after shutdown and a final poll */
void axf_engine_stats(axf_engine *e, axf_stats *out);

/* Registration. access: AXF_ACCESS_* bits. memfd >= 0 when the memory is a
 * shared mapping of that fd at offset 0 (same-host peers may map it). */
int axf_region_register(axf_engine *e, void *addr, uint64_t len, uint32_t access,
                        int memfd, uint64_t *id_out, uint64_t *key_out);
/* A region of another memory kind (AXF_MEM_CUDA, AXF_MEM_FILE). fd: the
 * file of a file region (the engine keeps its own duplicate), else -1. */
int axf_region_register_kind(axf_engine *e, uint32_t kind, uint64_t addr, uint64_t len,
                             uint32_t access, int fd, uint64_t *id_out, uint64_t *key_out);
/* Revokes a region: new accesses fail with AXF_E_ACCESS; ops already holding it
 * finish; every connected peer is told to forget it. AXF_CQ_REGION_FREED is
 * pushed once nothing touches it any more: our own ops are done and each peer
 * has acknowledged, said goodbye, or is verifiably gone. Gone means: for a
 * connection accepted with a pidfd (same host), that process exited; a closed
 * socket is not enough (a stopped process keeps its mappings and its
 * cross-memory-attach rights). For one without (tcp), its connection closed;
 * a tcp peer that does not acknowledge within revoke_timeout_ms is
 * disconnected. Until then the region is quarantined (axf_stats). */
int axf_region_deregister(axf_engine *e, uint64_t id);
/* The peers' half of axf_region_deregister, now, while the region stays
 * ours: from this call on no peer reaches it (a tcp peer's READ or WRITE
 * with its key fails with AXF_E_ACCESS, as for a region that was never
 * there), every connected peer is told to forget it and is waited for as
 * deregistration waits (same-host peers stop copying into it and unmap it;
 * RDMA and CUDA IPC peers let go of their keys and mappings), while our own
 * posts, made before or after, still use it. axf_region_deregister later
 * ends our use; AXF_CQ_REGION_FREED follows once both are over. For a
 * deregistration that must wait for transfers of ours not yet posted.
 * Idempotent; a file region (never a peer's) is left as it is.
 * AXF_E_NOTFOUND: not registered; AXF_E_NOMEM: nothing changed. What a
 * peer that ignores the revocation still reaches: see SECURITY.md. */
int axf_region_revoke(axf_engine *e, uint64_t id);
/* Which connections (their tags) a quarantined region still waits for:
 * fills up to max, returns how many there are (may exceed max), or
 * AXF_E_NOTFOUND when rid is not quarantined. */
int axf_region_holders(axf_engine *e, uint64_t rid, uint64_t *tags_out, size_t max);

/* Endpoints (the initiator side of a peer).
 * Same-host kinds (AXF_EP_SHM, AXF_EP_CUDA): pid and pidfd must come from the
 * kernel (SO_PEERCRED of the peer's unix socket, pidfd_open of that pid),
 * never from a peer's metadata; cross-memory attach is aimed at that pid only,
 * the engine checks that pidfd names it, and once the pidfd reports the
 * process exited the endpoint is lost (its copies stop between chunks). pid
 * may be our own with pidfd -1 (an endpoint into this process). Other kinds:
 * pid 0 and pidfd -1. The engine owns pidfd from the call on, also when it
 * fails: give each call a pidfd of its own (dup one to pass it twice). */
int axf_endpoint_create(axf_engine *e, int kind, uint64_t tag, int32_t pid, int pidfd,
                        uint64_t *ep_out);
/* fd: a connected, authenticated stream socket; the engine owns it from now on.
 * A TCP endpoint stripes large requests over all its live connections in
 * proportion to their measured rates. When one fails and others live, its
 * unfinished chunks move to them (AXF_CQ_RAIL_DOWN reports it); the
 * endpoint is lost only with its last connection. A new connection may be
 * added at any time (a rail that came back). add_conn is rail 0. */
int axf_endpoint_add_conn(axf_engine *e, uint64_t ep, int fd);
int axf_endpoint_add_rail_conn(axf_engine *e, uint64_t ep, int fd, uint32_t rail);
/* Fills up to max entries, one per connection slot, then (live 0, rate 0) the
 * totals of connections that failed and gave up their slot, one per rail;
 * returns how many. Summed per rail, bytes and reroutes never go backwards. */
size_t axf_endpoint_rails(axf_engine *e, uint64_t ep, axf_rail_stats *out, size_t max);
/* Makes a peer's region known: bounds and key checks use it; for shm also its
 * address in the peer (cross-memory attach), or memfd: an fd of its memory
 * received from the peer with SCM_RIGHTS (same-host kinds only), mapped here
 * during the call. The caller keeps ownership of memfd (the mapping holds
 * the file; close it when you like). Refused with AXF_E_ACCESS unless its
 * seals include F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL (a peer could
 * otherwise truncate it under our copies: SIGBUS) and it is at least len
 * bytes; AXF_E_ACCESS too when it cannot be mapped with the access asked. */
int axf_endpoint_import(axf_engine *e, uint64_t ep, uint64_t rid, uint64_t key, uint64_t len,
                        uint32_t access, uint64_t addr, int memfd);
int axf_endpoint_forget(axf_engine *e, uint64_t ep, uint64_t rid);
/* Fails its pending ops with AXF_E_CLOSED and closes its connections. A
 * same-host endpoint first lets its copies stop (at most one chunk each),
 * unmaps the peer's memory and says goodbye on each live connection: the
 * peer then stops waiting for our acknowledgements. The endpoint is freed
 * once nothing uses it; later calls with its id answer AXF_E_CLOSED (posts,
 * imports), AXF_OK (close) or AXF_E_NOTFOUND. */
int axf_endpoint_close(axf_engine *e, uint64_t ep);

/* The target side: a connected, authenticated stream socket (tcp or unix)
 * accepted for a peer; the engine owns fd from now on. pidfd: for a same-host
 * peer (kernel-verified, as for axf_endpoint_create), its process; owned by
 * the engine from the call on. With it, revocations sent on this connection
 * settle only when acknowledged, when the peer says goodbye, or when that
 * process exits: not when the socket closes. -1 for tcp. AXF_E_LIMIT beyond
 * max_conns; AXF_E_NOMEM when the completion ring cannot hold the record of
 * its end (AXF_CQ_CONN_CLOSED, promised now as a post's is). */
int axf_accept_conn(axf_engine *e, int fd, uint64_t tag, int pidfd);
/* The application consumed n notifications that arrived on connections
 * tagged tag: their receivers may read again (see max_notify_per_conn). */
void axf_notify_release(axf_engine *e, uint64_t tag, uint64_t n);

/* Posts one request. Returns AXF_OK when queued; an error when rejected at once
 * (nothing queued, no completion will come); AXF_POST_DONE (only with
 * AXF_POST_INLINE) when it completed inside the call, with no completion
 * record. Checks local bounds, imported remote bounds and keys before
 * anything moves. */
int axf_post(axf_engine *e, uint64_t ep, int op, const axf_desc *descs, size_t n,
             const void *notify, size_t notify_len, uint64_t req_id, uint32_t flags);
void axf_doorbell(axf_engine *e);
/* axf_doorbell; flags: 0 or AXF_POST_NOHELP (as for axf_post). */
void axf_doorbell_ex(axf_engine *e, uint32_t flags);
/* Returns AXF_OK when found; the completion (AXF_E_CANCELLED) follows once the
 * engine no longer touches the op's memory. */
int axf_cancel(axf_engine *e, uint64_t req_id);

/* The file transport's I/O backends: with e, what that engine runs (1: an
 * io_uring for O_DIRECT files, or for all with AIOXFER_FILE_IO=uring, beside
 * a thread pool; 0: the thread pool only; -1: no FILE endpoint yet); with e
 * NULL, what an engine would run now. buf (may be NULL) gets one line saying
 * what and why. AIOXFER_FILE_IO=threads forces the pool alone. */
int axf_file_info(axf_engine *e, char *buf, size_t cap);

/* Drains up to max completions; never blocks; also clears the eventfd. */
size_t axf_poll(axf_engine *e, axf_completion *out, size_t max);
/* Waits up to max_us microseconds, spinning on the calling thread, for the
 * ring to hold a completion; returns how many it holds (0: none came). Its
 * eventfd is written by then. Takes nothing: axf_poll them. For a caller
 * that has work in flight and nothing else to do (bounded busy-polling). */
size_t axf_wait(axf_engine *e, uint32_t max_us);
/* axf_wait with flags: AXF_WAIT_POLLS, the caller promises to axf_poll right
 * after a nonzero return: then records that came while it spun are left to
 * that poll, unsignalled (no eventfd write here, none to clear there), and
 * the ring's count is read without its lock. */
#define AXF_WAIT_POLLS 1u
size_t axf_wait_ex(axf_engine *e, uint32_t max_us, uint32_t flags);

/* This machine's costs, measured once per process (the first call, or the
 * first engine made with inline_bytes 0): a thread wake-up through an
 * eventfd (half a ping-pong between two threads pinned to the caller's CPU:
 * left to the scheduler it was bimodal from one process to the next on a
 * VM), single-thread memcpy bandwidth (best of 16), and what follows from
 * them: inline_bytes, the largest copy cheaper on the posting thread than
 * two wake-ups and an event-loop iteration of the caller's, rounded up to a
 * power of two in 64 KiB .. 16 MiB, and poll_us, a poll bounded by that
 * same cost (20 .. 200). In the environment, AIOXFER_WAKE_NS and
 * AIOXFER_COPY_MBPS stand for the two measurements (one calibration shared
 * by several processes), AIOXFER_INLINE_BYTES overrides inline_bytes. */
typedef struct axf_calibration {
    uint64_t wake_ns;       /* one thread wake-up */
    uint64_t copy_mbps;     /* memcpy, MB/s, one thread, 4 MiB blocks */
    uint64_t inline_bytes;
    uint32_t poll_us;
    uint32_t reserved;
} axf_calibration;
void axf_calibrate(axf_calibration *out);
/* A pool's owner (agent.alloc), before anyone maps or writes it: collapses
 * each whole 2 MiB of a fresh memfd into a shmem huge page, so that a
 * same-host peer maps it by one PMD per 2 MiB (shm.c says what it costs).
 * 1: every whole 2 MiB collapsed; 0: nothing changed; AXF_E_INVALID: not a
 * regular file, or shorter than len. */
int axf_shm_make_huge(int memfd, uint64_t len);
/* Snapshots the environment variables the library reads (README's
 * AIOXFER_* settings), each call. Every engine created after it reads that
 * snapshot, never the environment: the per-engine settings as they were at
 * the last call, the process-wide ones ($AIOXFER_SHM_LAZY_MIN, the
 * calibration's, $AIOXFER_CUDA_DRIVER) from the first snapshot taken. Until
 * the first call, each engine creation takes the snapshot itself on its own
 * thread. A caller whose other threads may write the environment calls it
 * where none can, before each engine's creation (Python: with the GIL held,
 * as os.environ's writes are): no getenv then runs on any other thread. */
void axf_env_read(void);
/* What this engine runs with: the inline threshold, the poll bound. */
uint64_t axf_engine_inline_bytes(axf_engine *e);
uint32_t axf_engine_poll_us(axf_engine *e);
void axf_completion_free(axf_completion *c);

/* ---------------------------------------------------------------- RDMA verbs
 * Built where the libibverbs headers were found at build time (libibverbs is
 * then loaded at run time); elsewhere every call answers AXF_E_TRANSPORT with
 * "not built". An AXF_EP_VERBS endpoint has ordinary stream connections for
 * control (keepalives, notifications, revocations) and one reliable-connected
 * queue pair per device pair (a rail). */
#define AXF_VERBS_MAX_DEVICES 8

/* What a peer needs to connect a queue pair to ours. */
typedef struct axf_verbs_qp_info {
    uint32_t qpn;
    uint32_t psn;
    uint32_t mtu; /* enum ibv_mtu */
    uint16_t lid;
    uint8_t port;
    uint8_t gid_index;
    uint8_t gid[16];
    /* Appended; 0 = not said (a peer from before they existed). */
    uint8_t link_layer;         /* IBV_LINK_LAYER_*: 1 InfiniBand, 2 Ethernet */
    uint8_t gid_type;           /* 1 + enum ibv_gid_type: 1 IB, 2 RoCE v1, 3 RoCE v2 */
    uint8_t max_dest_rd_atomic; /* READs this queue pair serves in flight */
    uint8_t reserved;
} axf_verbs_qp_info;

/* Loads the verbs (provider: a software provider library, or NULL for
 * libibverbs.so.1) and lists the devices: names separated by newlines. Returns
 * how many (0: none, which includes a kernel without InfiniBand, ENOSYS) or a
 * negative status; why says what was found. Needs no engine. */
int axf_verbs_probe(const char *provider, char *names, size_t names_len, char *why,
                    size_t why_len);
/* Opens every device with an active port for engine e: one protection domain,
 * one completion queue and channel per device, one poller thread that sleeps
 * on the channels. Regions registered from then on (and those registered
 * before) get a memory registration per device, cached by range. Returns the
 * number of devices (0: verbs stays off) or a negative status. Once only. */
int axf_verbs_enable(axf_engine *e, const char *provider, char *why, size_t why_len);
int axf_verbs_device_count(axf_engine *e); /* 0 while off */
/* A region's registration per device: addresses (as peers address it) and
 * rkeys. Returns the device count, or a negative status. */
int axf_verbs_region_keys(axf_engine *e, uint64_t rid, uint64_t *addrs, uint32_t *rkeys,
                          size_t max);
/* GPUDirect hook: registers a CUDA region through a dmabuf (fd and offset of
 * its memory, from the CUDA driver) on every device where it has no
 * registration yet. AXF_OK, or AXF_E_REGISTRATION (then the region stays
 * unreachable over verbs: no host staging). */
int axf_verbs_region_dmabuf(axf_engine *e, uint64_t rid, int fd, uint64_t offset);
/* Initiator: a queue pair on local device dev for endpoint ep (kind
 * AXF_EP_VERBS), initialised; out: what the peer connects to. */
int axf_verbs_qp_create(axf_engine *e, uint64_t ep, uint32_t dev, axf_verbs_qp_info *out);
/* Initiator: connects ep's queue pair on dev to the peer's queue pair on its
 * device remote_dev (whose rkeys its regions were imported with); ready to
 * send once this returns. */
int axf_verbs_qp_connect(axf_engine *e, uint64_t ep, uint32_t dev, uint32_t remote_dev,
                         const axf_verbs_qp_info *remote);
/* Target: a queue pair on dev connected to the initiator's remote; out: ours
 * for it; qp_out: a handle until axf_verbs_accept_conn binds it (or
 * axf_verbs_qp_destroy drops it). */
int axf_verbs_accept_qp(axf_engine *e, uint32_t dev, const axf_verbs_qp_info *remote,
                        axf_verbs_qp_info *out, uint64_t *qp_out);
int axf_verbs_qp_destroy(axf_engine *e, uint64_t qp);
/* Target: axf_accept_conn, and the queue pairs live as long as that
 * connection (destroyed when it closes). The engine owns fd from now on; the
 * handles are consumed, also on failure. */
int axf_verbs_accept_conn(axf_engine *e, int fd, uint64_t tag, const uint64_t *qps, size_t n);
/* The owner's (addr, rkey) per its device for imported region rid. */
int axf_endpoint_import_verbs(axf_engine *e, uint64_t ep, uint64_t rid, const uint64_t *addrs,
                              const uint32_t *rkeys, size_t n);

/* CUDA (native/src/cuda.c): the driver (libcuda.so.1, or the library named by
 * the AIOXFER_CUDA_DRIVER environment variable) is loaded at run time on first
 * use; without it these return AXF_E_TRANSPORT and a reason, never fail to load.
 * Process-level status: AXF_OK with the device count, or a reason. */
#define AXF_CUDA_IPC_HANDLE 64
int axf_cuda_probe(char *why, size_t why_len, int *ndevices);
int axf_cuda_device_name(int ordinal, char *name, size_t len);
/* Enables AXF_EP_CUDA endpoints on this engine (its copy threads start). */
int axf_cuda_enable(axf_engine *e, char *why, size_t why_len);
/* [ptr, ptr+len) must be device memory inside one allocation: its device,
 * and the allocation's base and size. AXF_E_INVALID: not device memory;
 * AXF_E_ACCESS: the range runs past its allocation. */
int axf_cuda_pointer(uint64_t ptr, uint64_t len, int *device, uint64_t *base, uint64_t *size);
/* What a same-host peer needs to map ptr's allocation: its legacy IPC handle,
 * ptr's offset in it, and the device's UUID. AXF_E_REGISTRATION: the memory
 * cannot be shared by IPC (e.g. cuMemCreate memory). */
int axf_cuda_export(uint64_t ptr, uint8_t handle[AXF_CUDA_IPC_HANDLE], uint64_t *offset,
                    uint8_t uuid[16]);
/* A dmabuf fd of [ptr, ptr+len) for GPUDirect RDMA (CUDA >= 11.7); the caller
 * closes it. Page-aligned ranges only (else AXF_E_INVALID): see axf_cuda_dmabuf_range. */
int axf_cuda_dmabuf(uint64_t ptr, uint64_t len, int *fd);
/* Plain driver allocations and synchronous copies (unified addressing: host
 * or device pointers), for tests and tools that have no CUDA library of their own. */
int axf_cuda_alloc(int device, uint64_t len, uint64_t *ptr);
int axf_cuda_free(uint64_t ptr);
int axf_cuda_copy(uint64_t dst, uint64_t src, uint64_t len);
/* What device `ordinal` offers: dmabuf export (GPUDirect RDMA without
 * nvidia-peermem), its PCI address ("dddd:bb:dd.0") and the devices it can
 * reach peer-to-peer (bit i: device i). */
typedef struct axf_cuda_device {
    uint32_t dmabuf; /* 1: supported */
    char pci[16];
    uint64_t peers;
} axf_cuda_device;
int axf_cuda_device_info(int ordinal, axf_cuda_device *out);
/* One line on what [ptr, ptr+len) is and why it cannot be registered as GPU
 * memory (managed memory, past its mapping, not device memory): AXF_OK with
 * a description when it can. */
int axf_cuda_describe(uint64_t ptr, uint64_t len, char *why, size_t why_len);
/* A dmabuf fd of the host pages around [ptr, ptr+len) and where ptr lies in
 * it (the driver exports page-aligned ranges only): for ibv_reg_dmabuf_mr's
 * offset. why: the reason on failure (may be NULL). The caller closes fd. */
int axf_cuda_dmabuf_range(uint64_t ptr, uint64_t len, int *fd, uint64_t *offset, char *why,
                          size_t why_len);
/* Peer allocations this process has open by CUDA IPC (one per allocation and device). */
int axf_cuda_ipc_open_count(void);
/* Page-locks host region rid for GPU copies now, on the engine's CUDA thread
 * (pinning GBs takes a while: off the caller's thread, and before the first
 * copy rather than in its way). Returns at once; best effort. */
int axf_cuda_pin_region(axf_engine *e, uint64_t rid);
/* Imports a peer's GPU region into an AXF_EP_CUDA endpoint: its IPC handle
 * is opened once per allocation (per process) and closed once the region is
 * forgotten after its last op, revoked, or the endpoint destroyed. The
 * allocation's real size bounds offset + len. A loopback endpoint (pid is our
 * own) uses addr as is and needs no handle. */
int axf_endpoint_import_cuda(axf_engine *e, uint64_t ep, uint64_t rid, uint64_t key, uint64_t len,
                             uint32_t access, uint64_t addr, const uint8_t *handle,
                             uint64_t offset, const uint8_t uuid[16]);

#ifdef __cplusplus
}
#endif
#endif

/* Engine internals shared by the core (engine.c: registry, ops, ring;
 * conn.c: framed connections; control.c: the control channel over them) and
 * the transports (transport.h: their interface; each keeps its own state
 * behind the private slots below). */
#ifndef AXF_INTERNAL_H
#define AXF_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "aioxfer.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/types.h>

#define AXF_MAX_CONNS 16
#define AXF_MAX_FRAME (256ull << 20) /* largest payload one frame may carry */
#define AXF_REGION_BUCKETS 1024
#define AXF_OP_BUCKETS 4096
/* Private slots of the transports (transport.h), indexed by endpoint kind. */
#define AXF_XP_SLOTS 8
#define AXF_HELP_MAX 8 /* initiator receivers parked for a spinning thread at once */

struct axf_transport;

/* Wire frame: fixed 64-byte header, little-endian hosts only (checked at
 * handshake by the Python layer's host metadata). */
enum {
    FR_WRITE = 1,
    FR_WRITE_ACK,
    FR_READ_REQ,
    FR_READ_RESP,
    FR_NOTIFY,
    FR_NOTIFY_ACK,
    FR_PING,
    FR_REVOKE,     /* target -> initiator: forget region rid/key, then acknowledge */
    FR_REVOKE_ACK, /* initiator -> target: nothing of ours touches that region any more */
    FR_BYE,        /* initiator -> target, last frame: nothing of ours touches any of your
                      memory any more, nor will (settles every revocation for this
                      connection, now and later) */
    /* Vectored frames: several chunks of one request in one frame. The header's
     * nseg (1..AXF_MAX_SEGS) wire_seg records follow it, then (WRITEV, a
     * successful READV_RESP) their bytes back to back; len is those bytes, the
     * segments' lengths summed; the header's rid, key and off are unused.
     * One readv scatters them (after every segment was checked), one sendmsg
     * gathers them. A READV's response is one READV_RESP echoing its segments
     * (status not OK: no segments, no bytes, index the descriptor that failed). */
    FR_WRITEV,
    FR_READV,
    FR_READV_RESP,
};
/* FL_BYE, on a PING, target -> initiator: the target's engine shuts down
 * (its agent closes); the connection ends right after, nothing failed. The
 * last frame it sends, at a frame boundary. An engine that predates it reads
 * a ping. */
enum { FL_LAST = 1, FL_ABORT = 2, FL_BYE = 4 };
#define AXF_MAGIC 0x31465841u /* "AXF1" */

typedef struct wire_hdr {
    uint32_t magic;
    uint16_t type;
    uint16_t flags;
    int32_t status;
    uint32_t nseg; /* vectored frames: wire_seg records after the header; else 0 */
    uint64_t op;
    uint64_t index;
    uint64_t rid;
    uint64_t key;
    uint64_t off;
    uint64_t len;
} wire_hdr;
_Static_assert(sizeof(wire_hdr) == 64, "wire header is 64 bytes");

/* One segment of a vectored frame: len bytes at off of region rid (key) for
 * descriptor index of the request. */
typedef struct wire_seg {
    uint64_t index;
    uint64_t rid;
    uint64_t key;
    uint64_t off;
    uint64_t len;
} wire_seg;
_Static_assert(sizeof(wire_seg) == 40, "wire segment is 40 bytes");
#define AXF_MAX_SEGS 64 /* segments of one vectored frame (its table: 2560 bytes) */

typedef struct region {
    uint64_t id, key, len;
    int32_t freed_status; /* what AXF_CQ_REGION_FREED says: AXF_OK, or AXF_E_CLOSED
                             when shutdown gave up on a quarantined region */
    uint8_t *addr;   /* host memory; a device pointer for AXF_MEM_CUDA; NULL for files */
    uint32_t access;
    uint32_t kind;   /* AXF_MEM_* */
    int fd;          /* AXF_MEM_FILE: our duplicate of the file, else -1 */
    uint64_t foff;   /* AXF_MEM_FILE: where the region starts in the file */
    atomic_int refs; /* one for the registry while registered, one per user */
    bool revoked;    /* e->mu: axf_region_revoke: peers' look-ups miss it (region_get),
                        our own posts still use it */
    void *xp[AXF_XP_SLOTS]; /* each transport's own: RDMA registrations, a CUDA pin,
                               a file's O_DIRECT alignment */
    struct region *next;
} region;

/* A peer's region as imported into an endpoint. Freed with the endpoint.
 * users counts ops that resolved it and are not freed yet; a revocation by the
 * owner is acknowledged only once it drops to zero, because same-host copies
 * reach the owner's memory directly, past any check on its side. */
typedef struct rregion {
    uint64_t rid, key, len, addr;
    uint32_t access;
    bool gone;             /* e->mu: no new op may resolve it */
    atomic_bool revoked;   /* the owner revoked it (set under e->mu) */
    atomic_uint users;
    void *xp[AXF_XP_SLOTS]; /* each transport's own: RDMA keys, a CUDA IPC mapping, a
                               memfd mapping (shm.c's, also the CUDA transport's) */
    struct rregion *next;
} rregion;

/* Initiator side: a revocation received on conn c, acknowledged once no op of
 * endpoint ep uses region rid/key any more. e->mu guards the list. */
typedef struct rv_ack {
    struct conn *c;
    struct endpoint *ep;
    uint64_t rid, key;
    struct rv_ack *next;
} rv_ack;

/* Target side: a deregistered region waiting for every connection it was
 * revoked on to acknowledge (or to be gone). Quarantined until then: listed
 * in e->quarantine. e->mu guards it. */
typedef struct revocation {
    struct region *r;
    int waiting;
    struct revocation *qnext, *qprev;
} revocation;

typedef struct rv_wait {
    revocation *rv;
    uint64_t since_ms; /* when it was sent: tcp peers get revoke_timeout_ms */
    struct rv_wait *next;
} rv_wait;

struct conn;

/* One chunk of an op: bytes [off, off + chunk) of descriptor i. */
typedef struct chunk_ref {
    uint64_t i, off;
} chunk_ref;

typedef struct endpoint {
    uint64_t id, tag;
    int kind;
    const struct axf_transport *xp; /* its transport (the registry's entry for kind) */
    pid_t pid;   /* same-host kinds: the kernel-verified process, the only CMA target */
    int pidfd;   /* its pidfd (owned), or -1 */
    /* Copies stop between chunks once set: the endpoint is lost or closing,
     * or its process exited. Read without a lock on the copy path. */
    atomic_bool halt;
    atomic_bool exited;  /* its pidfd reported the process gone */
    bool bye_sent;       /* e->mu: goodbye queued on its live connections */
    bool peer_bye;       /* e->mu: a connection of it heard the peer's goodbye (FL_BYE):
                            its loss is reported as a close (AXF_CQ_PEER_LOST fail_index 1) */
    struct conn *conns[AXF_MAX_CONNS];
    int nconns, live_conns;
    uint64_t reroutes; /* groups moved off failed connections (e->mu) */
    /* What connections that gave up their slot had carried, per rail: a
     * rail's counters never go backwards when it is re-dialled. e->mu. */
    axf_rail_stats retired[AXF_MAX_CONNS];
    int nretired;
    rregion *rregions;
    bool dead, closing, lost_reported;
    atomic_int ops_alive; /* ops posted on it and not freed yet (they point at it) */
    struct op *ops; /* pending ops, doubly linked */
    void *priv; /* its transport's own (verbs: its queue pairs) */
    struct endpoint *next;
} endpoint;

typedef struct op {
    uint64_t req_id;
    endpoint *ep;
    int opcode;
    size_t n;
    axf_desc *d;
    uint8_t **laddr;  /* resolved local address per descriptor */
    rregion **rr;     /* resolved remote region per descriptor */
    region **lregs;   /* distinct local regions referenced */
    size_t nlregs;
    rregion **rregs;  /* distinct remote regions referenced (one use each) */
    size_t nrregs;
    void *priv;       /* its endpoint's transport's own (file: its file regions;
                         tcp: its striping schedule) */
    uint8_t *notify;
    size_t notify_len;
    atomic_long remaining;
    atomic_int status;
    atomic_int cancelled;
    atomic_ullong nbytes;
    atomic_int pins; /* 1 until the op is over, +1 per frame of it in a send queue */
    /* Its local memory's holds (spl28): 1 until its completion is pushed,
     * +1 per spliced frame of it kept until the peer read its pages (conn.c
     * spl_keep; the frame's pin is given back then, so a failure is told at
     * once). Its regions are released and the op freed when it drops to 0:
     * after an AXF_CQ_XFER_HELD record, with AXF_CQ_XFER_FREED (op_mem_unref). */
    atomic_uint mem;
    bool held;        /* its completion was AXF_CQ_XFER_HELD: AXF_CQ_XFER_FREED follows */
    uint64_t fin_tag; /* its endpoint's tag, kept for the record pushed at the last hold */
    uint64_t fail_index;
    int phase; /* 0: data, 1: notification sent */
    uint32_t reroutes;        /* groups moved off failed connections (e->mu) */
    uint64_t total;           /* bytes its descriptors ask for: what it reports done */
    bool claimed;
    bool counted; /* registered: holds one of ep->ops_alive */
    bool tcp_whole; /* tcp: a lone WRITE of several chunks kept on one connection,
                       sent whole by the posting thread (tcp.c solo_conn) */
    /* One descriptor (the frequent small request): d, laddr, rr, lregs and
     * rregs point at these instead of at five allocations of one element. */
    axf_desc d1;
    uint8_t *laddr1;
    rregion *rr1;
    region *lreg1;
    rregion *rreg1;
    struct op *hnext, *prev, *next;
} op;

typedef struct sq_item {
    wire_hdr h;
    const uint8_t *payload;
    uint64_t plen;
    op *op;          /* initiator frames: the op, pinned until the frame is released */
    region *reg;     /* target READ_RESP: region ref released after sending */
    uint8_t *owned;  /* freed after sending */
    /* vectored frames (h.nseg > 0): the segment table sent after the header,
     * and (WRITEV, READV_RESP) where each segment's bytes are, plen in all;
     * target READV_RESP: a region ref per segment, released after sending.
     * All three live in owned. */
    wire_seg *segs;
    const uint8_t **pieces;
    region **regs;
    uint32_t nregs;
    uint64_t sent;   /* bytes of header + payload already sent (a short inline send) */
    /* initiator LAST frames: what its group is, for a reroute if the
     * connection fails: a schedule slot, or (rerouted groups) a chunk list
     * whose ownership passes to the connection with the frame */
    int slot;
    chunk_ref *chunks;
    size_t nchunks;
    uint64_t group_bytes; /* initiator LAST frames: bytes its group asks for */
    uint32_t reply_cost;  /* target replies: what it counts in conn->reply_bytes */
    /* An initiator WRITE frame whose payload went (or may have gone) by
     * splice on this connection (referenced): once sent, it stays as a hold
     * on its op's memory until the peer read the pages (conn.c spl_keep). */
    struct conn *spl_c;
    struct sq_item *next;
} sq_item;

typedef struct conn {
    axf_engine *e;
    endpoint *ep; /* NULL on the accepting side */
    uint64_t tag;
    int fd;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    sq_item *head, *tail;
    bool dead;               /* c->mu */
    bool sending;            /* c->mu: a thread is sending from this queue */
    /* c->mu: a goodbye is owed (conn_say_bye found a frame partly sent, or
     * the socket full): no frame starts any more; the sending thread says it
     * once the stream is between frames, then the connection ends. */
    bool bye_owed;
    /* c->mu: bytes of our goodbye's header already in the socket (a send
     * that TCP split: conn_say_bye), the rest owed (bye_owed_send); 0 when
     * none. Nothing else goes on the stream before its rest. */
    uint8_t bye_off;
    /* c->mu: dead after our goodbye went into the socket, shut for writing
     * only while its receiver reads on until the peer closes (conn.c
     * conn_bye_out); the next kill shuts it for reading too. */
    bool bye_linger;
    /* Our goodbye went into the socket (conn_bye_out) or is owed
     * (conn_say_bye); set once: from then on the receiver serves nothing the
     * peer sends, it drains (conn.c rx_drain). Only then: a connection dead
     * any other way still serves what is queued until EOF (a same-host
     * peer's FR_BYE behind it settles its revocations: native
     * test_bye26_release). */
    atomic_bool bye_said;
    /* e->mu: when a network peer's connection that bye_network said or owed
     * its goodbye on is ended whatever it is doing (0: no such deadline): an
     * owed goodbye whose frame never finishes, or a peer that does not close
     * after it, holds the close no longer (engine.c watch_scan). */
    uint64_t bye_due_ms;
    /* Accepted by conn_open: its AXF_CQ_CONN_CLOSED's ring slot is promised
     * (cq_reserve), pushed claimed by its last thread's exit. */
    bool closed_slot;
    atomic_bool down;        /* dead, as others see it without c->mu */
    atomic_bool stalled;     /* killed by stall detection */
    atomic_bool bye_heard;   /* initiator: the peer said goodbye on it (FL_BYE) */
    /* The keepalive's time stamps (control.c's; conn.c reports to it). */
    struct {
        uint64_t last_send_ms;     /* c->mu: last frame sent, pings included */
        atomic_ullong progress_us; /* last frame sent, or reply received */
        atomic_ullong last_rx_us;  /* last frame received (pings included) */
        atomic_uint ping_ms;       /* our ping interval here: keepalive_ms, or
                                      shorter for a peer with a shorter timeout */
        atomic_uint peer_to_ms;    /* the peer's timeout, from its pings (0: not heard) */
        /* Its group's (the connections to one peer: one endpoint, or one
         * accepted tag) pinger at keepalive_ms; the others ping only as often
         * as the peer's timeout needs (control.c ka_interval). Set by
         * conn_open (e->mu) before its threads start, then read-only. */
        bool lead;
        bool pinged; /* c->mu: a ping of ours went out (the first goes at ping_ms) */
    } ka;
    int slot;                /* initiator: index in ep->conns */
    uint32_t rail;           /* initiator: the caller's rail number */
    atomic_ullong bytes, reroutes, rate; /* rate: bytes per ms, a moving average */
    /* Rate measurement (c->mu): bytes of whole groups over the time the
     * connection had replies owed, in windows of RATE_WINDOW_US at least. */
    uint64_t busy_since_us;  /* 0 while nothing is owed */
    uint64_t win_busy_us, win_bytes;
    atomic_int threads;
    /* accepting side: state of the current write group */
    uint64_t grp_op;
    int32_t grp_status;
    uint64_t grp_fail, grp_bytes;
    bool in_grp;
    /* accepting side, e->mu: revocations this connection has to acknowledge */
    rv_wait *revokes;
    bool exited;   /* e->mu: its threads are gone (the socket is closed) */
    bool gone;     /* e->mu: it cannot touch our memory any more (tcp: closed;
                      same host: said goodbye, or its process exited) */
    bool released; /* e->mu: said goodbye (FR_BYE) */
    int pidfd;     /* accepting side: the same-host peer's process (owned), else -1 */
    pid_t peer_pid; /* ... and its pid, as the pidfd names it */
    atomic_bool peer_exited; /* that process is gone (the watcher saw its pidfd) */
    /* Backpressure (c->mu): bytes of replies queued and not sent, and
     * notifications pushed to the ring and not yet released. The receiver
     * waits on room_cv while either is at its bound. */
    atomic_ullong reply_bytes; /* changed under c->mu, read without it */
    atomic_ullong notify_out;
    bool rx_paused;
    pthread_cond_t room_cv;
    atomic_bool flush_close; /* set under c->mu: close once the queue is sent (after a
                                goodbye); a send it waits for is bounded then */
    uint32_t rv_pending;    /* initiator, e->mu: revocations not acknowledged yet */
    atomic_int refs;        /* threads, registry, endpoint slot, transient holders */
    bool replay;            /* conn_replay's: no threads, the caller runs the parser */
    void *xp[AXF_XP_SLOTS]; /* accepting side, e->mu: what transports hang on it (verbs:
                               queue pairs that live as long as it) */
    /* initiator (tcp): who reads the socket (RX_SELF, RX_PARKED, RX_HELPER:
     * conn.c conn_help), a futex word; and when a spinning thread last could
     * have read a reply here (us: the receiver parks while that is recent). */
    atomic_int rx_hold;
    atomic_ullong help_us;
    struct conn *next_all;
    /* tcp19: a TCP connection through the loopback device whose congestion
     * control conn_open set to e->tcp_loop_cc (set before it is used, read
     * only after): tcp.c sends a lone 1 MiB WRITE on it whole. */
    bool loop_cc;
} conn;


/* ------------------------------------------------------------ environment
 * Every variable the native code reads, snapshotted by axf_env_read (the
 * Python extension calls it with the GIL held, before each engine's
 * creation) or, before any such call, by each engine's creation on its own
 * thread. Nothing else calls getenv: a getenv on a thread not holding the GIL
 * raced a Python thread writing os.environ (putenv may free or move what
 * getenv returned). */
enum {
    AXF_ENV_REFUSED_LOG_MS,
    AXF_ENV_TCP_LOOPBACK_CC,
    AXF_ENV_TCP_SPLICE,
    AXF_ENV_FILE_IO,
    AXF_ENV_VERBS_TIMEOUT,
    AXF_ENV_VERBS_RETRY_CNT,
    AXF_ENV_VERBS_TC,
    AXF_ENV_VERBS_SL,
    AXF_ENV_VERBS_GID_INDEX,
    AXF_ENV_VERBS_RELAXED_ORDERING,
    AXF_ENV_VERBS_DEVICES,
    AXF_ENV_CUDA_DRIVER,
    AXF_ENV_TCP_TRACE,
    AXF_ENV_SHM_LAZY_MIN,
    AXF_ENV_WAKE_NS,
    AXF_ENV_COPY_MBPS,
    AXF_ENV_INLINE_BYTES,
    AXF_ENV_N
};
/* The most a process-wide value may have, its NUL included (axf_env_value's
 * out: a path, PATH_MAX); a longer one is ignored there, and every engine
 * created with it logs so (engine.c env_check). */
#define AXF_ENV_VAL_MAX 4096
/* A snapshot (engine.c): one block per distinct environment, each value at
 * its length, immutable; an axf_env is a pointer to one and holds a
 * reference (axf_env_take), let go by axf_env_release: the block lives while
 * it is the process's current snapshot or an axf_env holds it (an engine:
 * its life; a probe, a process-wide reader: its call). NULL: nothing set. */
struct axf_env_block;
typedef struct axf_env {
    const struct axf_env_block *b;
} axf_env;
/* The process's snapshot (taken now when none was), one reference held.
 * `creating`: an engine's creation, which takes a fresh one while nobody has
 * called axf_env_read (a C program's engines each see the environment as it
 * is at their creation, as before). */
void axf_env_take(axf_env *out, bool creating);
/* Lets go of what axf_env_take gave (env->b is NULL after; NULL: nothing). */
void axf_env_release(axf_env *env);
/* Variable `which` of `env`, NULL when unset; valid while env is held. */
const char *axf_env_get(const axf_env *env, int which);
/* A process-wide setting (the CUDA driver's path, the trace directory,
 * shm's) of a taken snapshot, as its readers take it: NULL when unset or
 * AXF_ENV_VAL_MAX bytes or longer (logged by engines: engine.c env_check).
 * Read in place, no copy: a reader on a small thread stack needs no buffer. */
const char *axf_env_wide(const axf_env *env, int which);
/* The same, copied into out[AXF_ENV_VAL_MAX] (4 KiB: not for small stacks);
 * false when unset or too long. */
bool axf_env_value(int which, char *out);
/* The live blocks (tests: what the process keeps). */
size_t axf_env_blocks(void);
/* shm.c: the process-wide settings read from the first snapshot, once. */

struct axf_engine {
    axf_config cfg;
    int efd;
    pthread_mutex_t mu; /* registry, ops, endpoints, conns. Order: mu, then conn->mu */
    region *regions[AXF_REGION_BUCKETS];
    op *ops[AXF_OP_BUCKETS];
    endpoint *eps;
    conn *conns;
    uint64_t next_rid, next_ep;
    bool shut;
    /* axf_engine_bye_network ran: the engine is closing (its network peers
     * told goodbye, its regions being released); no new peer is served. */
    bool bye;

    pthread_mutex_t cq_mu;
    bool cq_signalled; /* efd written (or about to be) since axf_poll last cleared it */
    axf_completion *cq;
    size_t cq_head, cq_count, cq_cap;
    atomic_int cq_spinners; /* threads spinning in axf_wait: they write a push's eventfd */
    atomic_size_t cq_ready; /* cq_count, readable without cq_mu (axf_wait spins on it) */
    /* Slots of the ring neither holding a record nor promised to one:
     * cq_cap - cq_count - reservations (cq_reserve), less claims still
     * growing the ring (so transiently negative). The ring grows where a
     * record is promised (a post, an endpoint, a region), where a failure can
     * be returned, never in cq_push: a record once promised is never lost. */
    /* On a cache line of its own (64 bytes of padding either side, the
     * engine being only malloc-aligned): the posting and polling thread
     * writes it per request, and the pushers' cq_mu and cq_ready, and the
     * receivers' counters below, stay off that line. */
    char cq_free_pad0[64];
    atomic_llong cq_free;
    atomic_ullong cq_dropped; /* unpromised records (logs, notifications, ...) lost to OOM */
    /* The drop note (engine.c cq_drop): one LOG record saying records were
     * lost, its ring slot and payload held in advance (so it is never lost
     * itself): DROP_NOTE_ARMED while held, taken by the first drop, held
     * again by axf_poll at most once a second (rate-limited). */
    atomic_int drop_note;
    char *drop_note_buf;
    atomic_ullong drop_note_ms; /* when the last note was pushed (ms) */
    char cq_free_pad1[64];
    uint32_t poll_us;       /* the calibrated bound of a poll (axf_engine_poll_us) */
    atomic_int rx_spinners; /* receivers polling for a peer's next request (conn.c spin_take):
                               at most RX_SPINNERS_MAX */
    /* Initiator receivers parked while a thread spinning in axf_wait reads
     * their replies (conn.c conn_help): help_mu guards the list. */
    pthread_mutex_t help_mu;
    struct conn *help[AXF_HELP_MAX];
    atomic_int nhelp;
    atomic_ullong helped; /* replies a spinner read (axf_stats helped) */


    pthread_mutex_t th_mu;
    pthread_cond_t th_cv;
    int conn_threads; /* detached connection threads still running */

    conn *dirty[64]; /* connections with deferred, unsignalled frames */
    int ndirty;
    atomic_uint bells; /* a bit per transport (1 << ep_kind) posted to since the
                          last axf_doorbell: the doorbells it has to ring */
    /* Finished ops' records, for the next posts (linked by hnext): a post
     * then costs no calloc and free. op_lock: a spin lock held for a push or
     * a pop only. */
    atomic_flag op_lock;
    struct op *op_cache;
    unsigned op_cached;

    rv_ack *rv_acks; /* initiator side: revocations not acknowledged yet */
    revocation *quarantine; /* target side: deregistered regions peers may still touch */
    uint64_t quarantined, quarantined_bytes; /* e->mu */
    uint8_t *lost_bits; /* e->mu: freed endpoints that ended lost, by id (a bit each) */
    size_t lost_cap;

    /* The watcher: one thread asleep in poll(2) on the pidfds of same-host
     * peers and a wake-up eventfd, with a timeout for the nearest tcp
     * revocation deadline. */
    pthread_t watch_thread;
    bool watch_started, watch_stop; /* e->mu */
    int watch_efd;
    /* Each transport's own state (transport.h), NULL while it is off: the
     * verbs devices and poller, the file transport (started by the first
     * FILE endpoint, e->mu), the CUDA copy threads (axf_cuda_enable). */
    void *xp[AXF_XP_SLOTS];

    atomic_ullong n_regions, n_ops, n_conns, posted, completed, failed, bytes, rejected;
    /* tcp18: WRITE payloads of [splice_min, splice_max] bytes a frame go to a
     * same-uid loopback peer by vmsplice + splice (conn.c, "one-copy send");
     * splice_max 0: off (AIOXFER_TCP_SPLICE=0). Set once by the tcp
     * transport's enable (tcp.c tcp_enable). The counters are the tests' and
     * the benchmarks' (frames that went spliced, frames that fell back to the
     * copy after a failed vmsplice or pipe, pipes open now). */
    uint64_t splice_min, splice_max, splice_req_max; /* req_max: the request's total */
    /* tcp19: the congestion control of TCP connections through the loopback
     * device (conn.c conn_open; "" leaves the system's). Set once by the tcp
     * transport's enable from AIOXFER_TCP_LOOPBACK_CC (tcp.c tcp_enable). */
    char tcp_loop_cc[16];
    atomic_ullong spliced_frames, spliced_bytes, splice_fallbacks;
    atomic_int splice_pipes;
    /* Connections whose one-copy verdict is in (conn.c spl_decide): a frame
     * a sender meets while its verdict is being asked goes by copy, so a
     * test that needs a splice waits for this first. */
    atomic_ullong splice_verdicts;
    /* Refused accesses (conn.c refused_access): when the last was logged
     * (ms + 1; 0: never), and how many were counted quietly since. The
     * engine's, not a connection's: a peer may open max_conns of them. */
    atomic_ullong refused_ms, refused_quiet;
    /* Their log line's window: 1000 ms, or AIOXFER_REFUSED_LOG_MS at the
     * engine's creation (tests shorten it rather than sleep past it). */
    unsigned long long refused_log_ms;
    atomic_ullong conns_refused, held_conns;
    /* Test-only faults (set by the native tests through mock.h's
     * axf_mock_faults; NULL in every other engine), while the engine's
     * threads run: stored and loaded atomically (__atomic_*, conn.c
     * faults_of). Looked at on rare paths, and once per sending-thread
     * wake-up and per inline spliced send (spl29's counters). */
    const struct axf_faults *faults;
    /* The environment as it was at the engine's creation (axf_env_take):
     * what its transports read later (the file transport's start, verbs'
     * enable), never getenv. */
    axf_env env;
};

/* What a test makes fail or wait (axf_engine.faults). */
typedef struct axf_faults {
    /* conn_spread's reroute of a moved group fails as if out of memory (its
     * only failure while a connection is live). */
    bool spread_nomem;
    /* Called in axf_endpoint_add_rail_conn between conn_spread and
     * conn_spread_end (e->mu not held, the joining connection's threads
     * started): the window in which everything else may happen. */
    void (*spread_gap)(void *arg);
    void *arg;
    /* Called in axf_poll's re-arming of the drop note (engine.c
     * drop_note_arm) once it found the last note a second old, before it
     * claims the note: where another poll and a drop may run. */
    void (*drop_note_gap)(void *arg);
    /* Called in conn_kick after it unlocked c->mu holding spliced items it
     * sent, before it releases them (conn.c spl_late): where the
     * connection's threads may end. */
    void (*kick_release_gap)(void *arg);
    /* Called on a connection's sending thread (conn.c tx_main) each time
     * its wait ends, c->mu held: its wake-ups, counted (spl29). */
    void (*tx_woke)(void *arg);
} axf_faults;

/* engine.c */
/* Set around a completion the posting thread makes itself and polls next
 * (AXF_POST_POLL): its record needs no wake-up. */
extern _Thread_local bool axf_cq_quiet;
/* Set while this thread posts or rings with AXF_POST_NOHELP: the transports'
 * doorbells then leave other requests' queued work to their own threads. */
extern _Thread_local bool axf_no_help;
uint64_t axf_now_ms(void);
uint64_t axf_now_ns(void); /* CLOCK_MONOTONIC */
uint64_t axf_now_us(void);
void cq_push(axf_engine *e, uint32_t kind, int32_t status, uint64_t id, uint64_t tag,
             uint64_t nbytes, uint64_t fail_index, const void *payload, size_t plen);
void cq_log(axf_engine *e, uint64_t tag, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Promises one record's slot in the completion ring: AXF_OK, or AXF_E_NOMEM
 * (the ring could not grow). Each promise is either kept by cq_push of a
 * promised kind (AXF_CQ_XFER, AXF_CQ_PEER_LOST, AXF_CQ_REGION_FREED) or
 * handed back with cq_unreserve. */
int cq_reserve(axf_engine *e);
void cq_unreserve(axf_engine *e);
/* A record whose slot its producer claimed itself with cq_reserve, before
 * committing to it (conn.c: a peer's notification, before acknowledging it;
 * an accepted connection's AXF_CQ_CONN_CLOSED, at conn_open). */
void cq_push_claimed(axf_engine *e, uint32_t kind, int32_t status, uint64_t id, uint64_t tag,
                     uint64_t nbytes, uint64_t fail_index, const void *payload, size_t plen);
region *region_get(axf_engine *e, uint64_t id); /* with e->mu held; takes a ref */
void region_unref(axf_engine *e, region *r);
op *op_find(axf_engine *e, uint64_t req_id);     /* with e->mu held */
void op_set_status(op *o, int status, uint64_t index);
void op_unit_done(axf_engine *e, op *o);
void op_unpin(axf_engine *e, op *o); /* a queued frame of it is gone */
/* The one-copy send's holds on an op's local memory (op.mem): conn.c keeps
 * one per spliced frame whose pages the peer may still read. */
void op_mem_hold(op *o);
void op_mem_unref(axf_engine *e, op *o);
void endpoint_conn_finished(axf_engine *e, endpoint *ep);
/* conn.c: a timeline of the tcp path, for measuring only (tcp14): built
 * with -Dc_args=-DAXF_TCP_TRACE, each AXF_TR appends (CLOCK_MONOTONIC ns,
 * thread, CPU, event, request, fd, a value) to a file mapped from
 * $AXF_TCP_TRACE/trace.<pid> (written even if the process is killed);
 * without the flag it compiles to nothing. benchmarks/tcp14_timeline.py
 * runs requests and reads both processes' files into one timeline. */
enum {
    TR_POST = 1,   /* tcp_stripe: a = the chunk size */
    TR_SEND_B,     /* send_batch: a = bytes | nowait << 62 */
    TR_SEND_E,     /* a = bytes sent */
    TR_TX_WAKE,    /* the sending thread out of its wait */
    TR_RX_HDR,     /* a receiver has a header: a = type | spun << 16 | (off >> 12) << 20 */
    TR_RX_DONE,    /* ... and served its frame: a = type */
    TR_UNIT_B,     /* op_unit_done on the initiator */
    TR_UNIT_E,
    TR_HELP,       /* a spinner read a reply */
    TR_PARK_B,
    TR_PARK_E,
    TR_RX_BLOCK,   /* a receiver blocks in recv for a header */
    TR_STREAM_B,   /* rx_stream: a = 1 when it polled */
    TR_STREAM_E,
    TR_WAIT_B,     /* axf_wait_ex's spin: a = its bound, us */
    TR_WAIT_E,     /* a = the records ready when it stopped */
    TR_CQ_PUSH,    /* a = whether it wrote the eventfd */
    TR_SPIN_B,     /* rx_spin_one: a = its bound, us (0: another receiver spins) */
    TR_SPIN_E,     /* a = what rx_spin returned */
    TR_SIG_B,      /* tcp_stripe: a group queued with its sending thread woken */
    TR_SIG_E,
};
#ifdef AXF_TCP_TRACE
void axf_trace(uint32_t ev, int fd, uint64_t op, uint64_t a);
#define AXF_TR(ev, fd, op, a) axf_trace((ev), (fd), (op), (a))
#else
#define AXF_TR(ev, fd, op, a) ((void)0)
#endif
/* e->mu held: every transport undoes what it mapped of rr. */
void rr_unmap(rregion *rr);
/* control.c: the control channel (keepalive, notify, revoke, goodbye) */
/* Keepalive. Engine creation: the defaults of keepalive_ms and
 * peer_timeout_ms, and a keepalive short enough for the timeout. */
void ka_configure(axf_config *cfg);
void ka_init(conn *c);       /* a new connection: heard from and making progress now */
/* e->mu held, a connection of endpoint ep (NULL: accepted, from tag's peer)
 * about to open: whether it leads its group's keepalive (no live one does). */
bool ka_leads(axf_engine *e, const endpoint *ep, uint64_t tag);
void ka_arm_socket(conn *c); /* its socket's receive (silence) and send (stall) timeouts */
void ka_restart(conn *c);    /* c->mu: sent nothing that is progress (the sender starts, a ping) */
void ka_sent(conn *c, uint64_t now_us); /* c->mu: frames went out at now_us: progress */
void ka_progress(conn *c);   /* a reply arrived: progress */
/* A frame header arrived (its payload may follow): the peer is heard from;
 * true when it is a ping, which carries nothing more. */
bool ka_heard(conn *c, const wire_hdr *h);
bool ka_silent(int io);      /* a read failed so: the peer was silent for peer_timeout_ms */
void ka_ping_frame(conn *c, wire_hdr *h);
/* A blocking send the socket refused for its send timeout: true when it goes
 * on waiting (the peer is heard from: it pushes back, it is not gone; never
 * with stall detection on). */
bool ka_send_waits(conn *c);
/* A send failed with err (-errno): flags a stall when that is one. Before
 * the connection is marked dead: its receiver decides from the flag whether
 * requests move or time out. */
void ka_send_failed(conn *c, int err);
typedef enum { KA_IDLE, KA_PING, KA_STALLED } ka_step;
/* c->mu held, nothing queued: what the sender does next. KA_IDLE: sleep at
 * most *wait_ms (or until woken). KA_PING: send a ping (then ka_restart).
 * KA_STALLED: flagged stalled (owed: replies are owed on c), close it. */
ka_step ka_next(conn *c, bool owed, uint64_t *wait_ms);
conn *endpoint_live_conn(endpoint *ep); /* e->mu held; NULL when none */
/* e->mu held: every revocation c holds is over. */
void revokes_settle_all(axf_engine *e, conn *c);
/* e->mu held: the watcher saw the same-host peer of accepted connection c exit. */
void conn_peer_exited(axf_engine *e, conn *c);
/* e->mu held: acknowledges every revocation of ep whose region no op uses any more. */
void rv_acks_flush(axf_engine *e, endpoint *ep);
/* e->mu held: goodbye on each live connection of ep, which then closes. */
void ep_send_bye(endpoint *ep);
/* e->mu held. Returns the connection it was queued on (kick it once
 * unlocked), or NULL: no live connection. */
conn *notify_enqueue(axf_engine *e, op *o);
/* AXF_OK, or AXF_E_PROTOCOL (a second revocation while the first waits). */
int revoke_received(axf_engine *e, conn *c, uint64_t rid, uint64_t key);
int revoke_acked(axf_engine *e, conn *c, uint64_t rid); /* AXF_OK or AXF_E_PROTOCOL */
/* The connection's threads are gone: for tcp its revocations settle; a
 * same-host one is held until its process exits or it said goodbye. */
void revokes_drop(axf_engine *e, conn *c);
void bye_received(axf_engine *e, conn *c);
void watch_wake(axf_engine *e);
void conn_ref(conn *c);
void conn_unref(conn *c); /* the last reference frees it */
/* e->mu held: an initiator op left the copy phase, or the endpoint is
 * closing: says goodbye once no copy of it runs any more. */
void ep_maybe_bye(axf_engine *e, endpoint *ep);

endpoint *ep_find(axf_engine *e, uint64_t id); /* e->mu held */
rregion *rr_find(endpoint *ep, uint64_t rid);   /* e->mu held; not gone */
rregion *rregion_new(uint64_t rid, uint64_t key, uint64_t len, uint32_t access, uint64_t addr);
/* Makes rr the endpoint's region rid; an older import of rid takes no new ops. e->mu held. */
void rregion_publish(endpoint *ep, rregion *rr);
/* e->mu held: far regions of ep no op can use any more (forgotten, revoked,
 * or the endpoint is dead) are unmapped by every transport. */
void rr_unmap_idle(endpoint *ep);
void op_complete(axf_engine *e, op *o);         /* fails an op that queued nothing */

/* conn.c */
/* e->mu held: a connection running its threads (its receiver starts its
 * sender), or NULL with *status. */
conn *conn_start(axf_engine *e, endpoint *ep, uint64_t tag, int fd, int *status);
/* e->mu held: a connection on the registry, usable (frames queue, a kill
 * holds), its threads counted but not started; then, with e->mu not held,
 * conn_launch starts them (AXF_OK) or ends it as if they had found it dead
 * (AXF_E_NOMEM: the endpoint hears of a lost connection). Nothing may free
 * it in between: shutdown waits for its counted threads. */
conn *conn_open(axf_engine *e, endpoint *ep, uint64_t tag, int fd, int *status);
int conn_launch(conn *c);
void conn_enqueue(conn *c, sq_item *it, bool signal); /* callers may hold e->mu */
/* An accepted connection ends, its engine closing: a goodbye (a PING with
 * FL_BYE) goes first, so the initiator reports a close, not a loss. Said
 * now if the stream is between frames and the socket takes it at once.
 * Else, with owe, it is owed: the connection stays up (no new frame starts)
 * until its sender finished the frame it is in and the goodbye went out
 * (engine shutdown ends it anyway); without owe the connection ends now,
 * the goodbye skipped (the peer sees a loss). */
void conn_say_bye(conn *c, bool owe);
/* What conn_spread leaves for after e->mu: frames it took off queues (to
 * release), groups it could not move (their unit to end, failed), the
 * endpoint's live connections (held) to wake, and the endpoint, held as a
 * connection holds it (live_conns) while a failed group's unit is to end:
 * else, if every connection exits first, the loss claims and finishes the
 * op and the unit's end touches it after its free. */
typedef struct conn_spread_left {
    sq_item *dropped;
    sq_item *spl_read; /* spliced holds whose op's last group here moved off (conn.c) */
    struct spread_job *failed;
    conn *wake[AXF_MAX_CONNS];
    int nwake;
    endpoint *held;
} conn_spread_left;
/* e->mu held: a connection joined ep. The WRITE frames still queued on its
 * other live connections (never sent: whole groups, and the tail of a group
 * being sent) are queued anew over every live connection, the new one too
 * (the transport's reroute, AXF_MOVE_SPREAD): requests posted before the
 * join no longer wait behind one connection. conn_spread_end, once e->mu
 * is released, finishes it. */
void conn_spread(axf_engine *e, endpoint *ep, conn_spread_left *left);
void conn_spread_end(axf_engine *e, conn_spread_left *left);
/* A reply to the peer (READ response, acknowledgement): counted against
 * reply_queue_bytes until sent. */
void conn_enqueue_reply(conn *c, sq_item *it, bool signal);
void conn_registry_drop(axf_engine *e, conn *c); /* e->mu held: off e->conns */
/* Queues first..last (linked by next) at once; last is the frame the group's
 * reply answers. */
void conn_enqueue_chain(conn *c, sq_item *first, sq_item *last, bool signal);
void conn_signal(conn *c);
/* Sends what is queued now on the calling thread when that is small and the
 * socket takes it (no handoff to the sending thread), else wakes that
 * thread. No engine lock may be held. */
void conn_kick(conn *c);
void conn_kill(conn *c);
/* Sends what is queued, then closes (c->mu not held). */
void conn_close_after_flush(conn *c);
/* The receiver may read again (credits released, replies sent). */
void conn_room(conn *c);
/* Parses and serves one frame that arrived on c, its payload (if any) still
 * in the socket. NULL, or why the connection must close (*proto: a
 * malformed frame). */
const char *conn_rx_frame(conn *c, const wire_hdr *h, uint8_t *scratch, bool *proto, int *io);
/* Called by a thread spinning in axf_wait: reads the replies that are here
 * on the connections whose receivers are parked for it (true: one was read);
 * conn_help_end: that thread stops without its completion, the receivers
 * read again. */
bool conn_help(axf_engine *e);
void conn_help_end(axf_engine *e);
/* The fuzz harnesses' entry point (a byte buffer in, no threads): the
 * target-side parser of a fresh connection tagged tag runs on the calling
 * thread over buf (what fits in a socket buffer, 4 MiB), as if a peer had
 * sent it and closed. Frames are checked and served exactly as on a real
 * connection (regions written, READ responses and acknowledgements queued
 * and sent without waiting into a socket nobody reads, notifications and
 * logs pushed to the ring: poll them). AXF_OK, AXF_E_PROTOCOL when a frame
 * was malformed (a real connection would have been closed there). */
int conn_replay(axf_engine *e, uint64_t tag, const uint8_t *buf, size_t len);
/* A connection with no socket and no threads (the native core tests drive
 * it, over the mock transport): e->mu held; ep NULL for the accepting side.
 * Frames queued on it wait for conn_detached_take (which sends them: their
 * pins go); frames that arrive are handed to conn_rx_frame (header-only
 * ones); conn_detached_close ends it as its threads' exit would (not under
 * e->mu). */
conn *conn_detached(axf_engine *e, endpoint *ep, uint64_t tag);
bool conn_detached_take(conn *c, wire_hdr *h);
void conn_detached_close(conn *c);
sq_item *sq_new(int type, uint64_t op_id);
void sq_drop(axf_engine *e, sq_item *it); /* an item never queued */

/* shm.c: same-host copies, shared with the CUDA transport (host memory) */
int shm_start(axf_engine *e);
void shm_stop(axf_engine *e);
/* A peer's memfd, mapped into rr's shm slot (for the CUDA transport too). */
int shm_map(endpoint *ep, rregion *rr, int memfd);
void shm_unmap(rregion *rr);
uint8_t *shm_far_map(const rregion *rr); /* that mapping, or NULL: none */
extern uint64_t axf_shm_lazy_min; /* larger peer pools are populated lazily (shm.c) */
void shm_submit(axf_engine *e, op *o, bool signal);
int shm_copy_inline(axf_engine *e, op *o);
/* The shm transport's submit: e->mu held, released; the data phase inline
 * (small) or on the copy workers. */
bool shm_post(axf_engine *e, op *o, uint32_t flags);
/* Copy workers parked for want of a job, of *nworkers (tests: a deferred
 * post holds only while none is awake). */
uint32_t shm_parked_workers(axf_engine *e, uint32_t *nworkers);
/* This process's calibration (measured once, thread-safe). */
const axf_calibration *shm_calibration(void);

/* A spin-wait's pause between polls (engine.c's waits, cuda.c's event poll). */
static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif

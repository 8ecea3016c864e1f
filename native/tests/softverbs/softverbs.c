/* softverbs: a software RDMA verbs provider for the tests.
 *
 * It implements the verbs that native/src/verbs_table.h names and moves real
 * bytes between processes over unix sockets, so the verbs transport and its
 * conformance suite run in CI without an RDMA NIC. It is a test fixture, not a
 * transport: each byte is copied through a bounce buffer on both sides.
 *
 * Build standalone (what the Python tests do):
 *   cc -shared -fPIC -O2 -pthread native/tests/softverbs/softverbs.c -o libaxf_softverbs.so
 * It needs the libibverbs-dev headers only; it never links or loads libibverbs.
 *
 * Exports: axf_verbs_provider (fills an axf_verbs_table, provider "softverbs")
 * and test hooks for this process (see each one at the end of the file): a
 * device's link cut or restored (axf_softverbs_set_link) or the device dead
 * (axf_softverbs_device_fatal); a post_send refused part way
 * (axf_softverbs_fail_next_post) and posts on a QP in ERR refused
 * (axf_softverbs_refuse_post_in_error); QP asynchronous events, now or as a
 * QP reaches INIT (axf_softverbs_qp_events, axf_softverbs_qp_event_at_init,
 * axf_softverbs_events_taken); a modify_qp to ERR or a reg_dmabuf_mr parked
 * until released (axf_softverbs_hold, _held, _release), to hold a race's
 * window open; axf_softverbs_qp_exists. Environment: AXF_SOFTVERBS_DEVICES
 * (default 2, 0..16); AXF_SOFTVERBS_NAME_SUFFIX, read at each
 * get_device_name: appended to the names that call returns ("softverbs0" +
 * suffix; NUL: the name given as "", for a provider's empty or too long name).
 *
 * Model, as close to a RoCE NIC with RC queue pairs as a test needs:
 * - Devices softverbs0..N-1, one port each, ACTIVE, link layer Ethernet, lid 0,
 *   addressing by GID (ah_attr.is_global = 1). A GID encodes (pid, device
 *   index): that is how a QP's RTR finds the remote process. A GID that is not
 *   a softverbs GID makes modify_qp(RTR) fail with EINVAL.
 * - The GID table is a RoCE NIC's: index 0 link-local (fe80::) RoCE v1, 1 the
 *   same address RoCE v2, 2 a routable address (2001:db8::) RoCE v1, 3 that
 *   address RoCE v2 (query_gid_type). Two QPs whose source GID types differ
 *   never hear each other (v1 is IB-over-Ethernet frames, v2 UDP/IP): the
 *   connection is refused and the first WR fails RETRY_EXC_ERR, as it would by
 *   timeout. With AXF_SOFTVERBS_ROUTED=1 the peers are in different IP subnets:
 *   only a RoCE v2 source GID towards a routable destination GID reaches the
 *   peer; link-local or v1 traffic is not routed (RETRY_EXC_ERR).
 * - RDMA READ depth: a device accepts at most max_qp_rd_atom READs in flight
 *   as a responder and issues at most max_qp_init_rd_atom
 *   (AXF_SOFTVERBS_RD_ATOM="resp,init", default "16,16"); modify_qp refuses
 *   more, the requester never has more than its QP's max_rd_atomic
 *   outstanding, and a requester whose max_rd_atomic exceeds the responder
 *   QP's max_dest_rd_atomic gets REM_INV_REQ_ERR on its first READ (hardware
 *   fails once the load overruns the responder's resources), so the two must
 *   be negotiated.
 * - Memory a CPU cannot read (a GPU's device addresses: fakecuda maps them
 *   PROT_NONE) cannot be registered with reg_mr (EFAULT, as without
 *   nvidia-peermem); reg_dmabuf_mr registers it through its dmabuf fd, which
 *   the "NIC" reads and writes through its own mapping of the fd (the fd's
 *   file position is where the exported range starts, fakecuda's convention).
 *   An inline WR copies its payload with the CPU in post_send: from such memory
 *   it faults (SIGSEGV) in the posting thread, exactly as on hardware.
 * - Per process and device, a "hub": an abstract unix socket listener named
 *   from (pid, device), the MR table (keys are per device, as on a NIC) and the
 *   QP table. Each accepted connection gets a responder thread that checks the
 *   rkey, the bounds, the PD and the access flags (MR and QP) BEFORE touching
 *   memory. Every byte from a socket is untrusted; a malformed frame closes
 *   that connection (the requester sees it as a dead link).
 * - A QP in RTR connects to the remote hub and says which QP it is and which it
 *   wants; the remote binds the connection to that QP if the QP's dest_qp_num
 *   and dgid name us back (SO_PEERCRED gives our pid, not the frame). A QP has
 *   a sender thread (requests, in posting order) and a receiver thread
 *   (responses, in the same order); a WR completes only when the responder has
 *   acknowledged it (WRITE: data placed; READ: data arrived and was copied).
 * - Errors as on RC: the first failing WR completes with its error
 *   (REM_ACCESS_ERR, REM_INV_REQ_ERR, RNR_RETRY_EXC_ERR, LOC_PROT_ERR, or
 *   RETRY_EXC_ERR when the link is gone: EOF/ECONNRESET, a destroyed remote QP,
 *   a killed peer), the QP goes to ERR and every outstanding and later WR
 *   completes with WR_FLUSH_ERR, signalled or not. A responder-side access
 *   violation moves the responder QP to ERR too (as mlx5 does). A QP in ERR
 *   closes its connections, so its peer's next WRs fail RETRY_EXC_ERR.
 *   A SEND longer than the posted receive: REM_INV_REQ_ERR at the sender,
 *   LOC_LEN_ERR on the receive. No receive posted for a SEND or WRITE_WITH_IMM:
 *   the responder waits (rnr_retry 7) or fails it RNR_RETRY_EXC_ERR after
 *   about 100 ms per retry. Zero-length RDMA does not check the rkey (IB
 *   spec). An MR deregistered while a remote READ streams out of it cuts the
 *   link (the requester sees RETRY_EXC_ERR).
 * - Send queue slots are released when a completion at or after them is
 *   POLLED (as mlx5): a requester that never signals fills its SQ and gets
 *   ENOMEM, as on hardware.
 * - CQ overflow: real hardware raises a CQ error. Here the completion is lost,
 *   a line goes to stderr, and poll_cq returns -EOVERFLOW once the queued
 *   completions are drained: loud, because a transport that undersizes its CQ
 *   is broken on hardware too.
 * - Memory registered with reg_mr is read and written with memcpy under the MR
 *   table's read lock after a fresh key lookup, so dereg_mr waits for in-flight
 *   copies and no copy touches memory after dereg_mr returns.
 * - Threads block in poll/recv/send or on condition variables; none spins.
 *   Per process: one listener thread per open device, one responder thread
 *   per incoming connection, a sender and a receiver thread per connected QP.
 *   Do not use objects across fork(): a child opens its own devices.
 * - Measured on the 2-core CI-like machine, two processes, 32 WRs in flight:
 *   ~45k 4 KiB WRITEs/s, 2.8-3.8 GB/s for 256 KiB-16 MiB WRITEs, 1.8-2.9
 *   GB/s READs.
 */
#define _GNU_SOURCE
#include "../../src/verbs_table.h"

#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/mman.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define SV_EXPORT __attribute__((visibility("default")))

enum {
    SV_MAX_DEVICES = 16,
    SV_MAX_SGE = 16,
    SV_MAX_INLINE = 256,
    SV_MAX_QP_WR = 16384,
    SV_MAX_CQE = 1 << 18,
    SV_MAX_RD_ATOM = 16,
    SV_CHUNK = 256 * 1024,
    SV_QP_BUCKETS = 256,
    SV_MR_BUCKETS = 1024,
};

/* ------------------------------------------------------------------ wire */

#include "softverbs_wire.h"

/* ------------------------------------------------------------------ objects */

typedef struct sv_device {
    struct ibv_device dev; /* first: the public object */
    int index;
    int link_down; /* __atomic; axf_softverbs_set_link */
    int fatal;     /* __atomic; axf_softverbs_device_fatal: no completion ever again */
} sv_device;

typedef struct sv_mr {
    struct ibv_mr mr;
    int access;
    uint8_t *dma;      /* reg_dmabuf_mr: our mapping of the dmabuf, else NULL */
    size_t dma_len;
    size_t dma_delta;  /* where mr.addr (the iova) lies in that mapping */
    struct sv_mr *next;
} sv_mr;

typedef struct sv_qp sv_qp;
typedef struct sv_conn sv_conn;

/* One per (process, device): listener, keys, QP numbers. */
typedef struct sv_hub {
    sv_device *dev;
    int refs; /* g_lock */
    int listen_fd, wake_fd;
    pthread_t listener;
    pthread_mutex_t lock; /* qps, conns, next_qpn, next_key */
    sv_qp *qps[SV_QP_BUCKETS];
    sv_conn *conns;
    uint32_t next_qpn, next_key;
    pthread_rwlock_t mr_lock; /* mrs, and held while copying into/out of an MR */
    sv_mr *mrs[SV_MR_BUCKETS];
} sv_hub;

typedef struct sv_ctx {
    struct ibv_context ctx;
    sv_hub *hub;
    int nobj; /* __atomic: PDs, MRs, CQs, channels, QPs not yet destroyed */
    /* Asynchronous events (async_fd: an eventfd counting them), g_lock:
     * the type, the QP for a QP event, and when it may be delivered (ms on
     * CLOCK_MONOTONIC; 0: at once). */
    struct sv_event {
        enum ibv_event_type type;
        struct ibv_qp *qp;
        uint64_t not_before;
    } events[16];
    int nevents;
    struct sv_ctx *next_ctx; /* g_ctxs */
} sv_ctx;

typedef struct sv_cq sv_cq;

typedef struct sv_chan {
    struct ibv_comp_channel ch;
    pthread_mutex_t lock; /* cqs, and each cq's events */
    sv_cq *cqs;
} sv_chan;

typedef struct sv_cqe {
    struct ibv_wc wc;
    uint64_t seq; /* the WR's slot sequence in its queue */
    bool recv;
} sv_cqe;

struct sv_cq {
    struct ibv_cq cq;
    pthread_mutex_t lock;
    sv_cqe *ring;
    uint32_t cap, head, count;
    bool armed, overflow;
    uint32_t events; /* delivered to the channel, not yet taken by get_cq_event */
    sv_cq *chan_next;
    int nqp; /* __atomic */
};

typedef struct sv_swqe {
    uint64_t wr_id, len, raddr;
    uint32_t rkey, imm;
    int op, nsge;
    bool signaled, final;
    enum ibv_wc_status local; /* found at post (bad lkey): completes with it */
    enum ibv_wc_status status;
} sv_swqe;

typedef struct sv_rwqe {
    uint64_t wr_id;
    int nsge;
} sv_rwqe;

/* An accepted connection: a remote requester served by this process. */
struct sv_conn {
    sv_hub *hub;
    int fd;
    pthread_t thread;
    bool done; /* hub lock: the thread has finished, join it */
    sv_conn *next; /* hub->conns */
    sv_qp *qp; /* bound QP, set under hub lock + qp lock */
    sv_conn *qp_next; /* qp->in */
};

struct sv_qp {
    struct ibv_qp qp; /* qp.state is the state, under lock */
    sv_hub *hub;
    /* Asynchronous events about it delivered (qp.mutex; qp.events_completed
     * counts those acknowledged): destroy_qp waits until all are, as
     * libibverbs' does, so that an event's QP stays valid until its ack. */
    uint32_t events_reported;
    sv_qp *next_free; /* g_qp_free */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct ibv_qp_cap cap;
    bool sig_all;
    int access;
    uint32_t dest_qpn;
    union ibv_gid dgid;
    uint8_t rnr_retry;
    uint32_t sgid_index;   /* RTR: our source GID entry */
    uint8_t max_dest_rd;   /* RTR: READs we serve in flight */
    uint8_t max_rd;        /* RTS: READs we may have outstanding */
    uint8_t reads_out;     /* READs sent and not answered yet */
    /* Send queue: a ring of cap.max_send_wr slots indexed by sequence.
     * released <= done <= resp <= sent <= posted: released slots are free;
     * done ones completed; resp ones answered; sent ones on the wire. */
    sv_swqe *sq;
    struct ibv_sge *sq_sge;
    uint8_t *sq_inl;
    uint64_t sq_posted, sq_sent, sq_resp, sq_done, sq_released;
    sv_rwqe *rq;
    struct ibv_sge *rq_sge;
    uint64_t rq_posted, rq_done, rq_released;
    int fd; /* our requester connection, -1 when none */
    bool link_dead, halted, stop, destroying;
    bool has_sender, has_receiver; /* threads to join */
    pthread_t sender, receiver;
    sv_conn *in; /* responder connections bound to us */
    sv_qp *next; /* hub->qps bucket */
};

/* ------------------------------------------------------------------ globals */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static sv_device g_devs[SV_MAX_DEVICES];
static int g_ndev;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static bool g_routed;                  /* AXF_SOFTVERBS_ROUTED=1 */
static int g_rd_resp = 16, g_rd_init = 16; /* AXF_SOFTVERBS_RD_ATOM="resp,init" */
static int g_fail_post_after = -1;     /* axf_softverbs_fail_next_post; g_lock */
static bool g_refuse_in_error;         /* axf_softverbs_refuse_post_in_error; g_lock */
/* axf_softverbs_qp_event_at_init: the next QP of device g_init_dev moved to
 * INIT gets event g_init_type, delivered g_init_delay ms later; g_lock. */
static int g_init_dev = -1, g_init_type, g_init_delay;
/* axf_softverbs_hold: one call parked at its entry until released. */
enum { SV_HOLD_NONE, SV_HOLD_MODIFY_ERR, SV_HOLD_REG_DMABUF, SV_HOLD_ACK_ASYNC };
static pthread_mutex_t g_hold_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hold_cond = PTHREAD_COND_INITIALIZER;
static int g_hold_what;       /* armed; SV_HOLD_NONE once taken */
static int g_hold_dev;        /* SV_HOLD_MODIFY_ERR: the QP (device, number) */
static uint32_t g_hold_qpn;
static bool g_held, g_released;
/* g_held, read by axf_softverbs_held without g_hold_lock: a test that learns
 * a call is parked must not synchronize with the parked thread (ThreadSanitizer
 * would then miss a race of the caller's with what it wrote before). */
static int g_held_flag; /* __atomic, relaxed */
static struct sv_ctx *g_ctxs;          /* open contexts, for async events; g_lock */
static uint64_t g_events_taken;        /* __atomic: asynchronous events delivered */
/* Destroyed QPs' memory, reused (last in, first out) by the next create_qp,
 * as a provider's QP table reuses its slots: a new QP can sit at the address
 * of one destroyed a moment ago (and does here under ASan too); g_lock. */
static sv_qp *g_qp_free;
static sv_hub *g_hubs[SV_MAX_DEVICES];
static pid_t g_hubs_pid;

/* Test hook (axf_softverbs_hold): the armed call parks here, at its entry,
 * until released. */
static void hold_point(int what, int dev, uint32_t qpn)
{
    pthread_mutex_lock(&g_hold_lock);
    if (g_hold_what == what &&
        (what != SV_HOLD_MODIFY_ERR || (g_hold_dev == dev && g_hold_qpn == qpn))) {
        g_hold_what = SV_HOLD_NONE;
        g_held = true;
        __atomic_store_n(&g_held_flag, 1, __ATOMIC_RELAXED);
        pthread_cond_broadcast(&g_hold_cond);
        while (!g_released)
            pthread_cond_wait(&g_hold_cond, &g_hold_lock);
        g_held = false;
        __atomic_store_n(&g_held_flag, 0, __ATOMIC_RELAXED);
        g_released = false;
        pthread_cond_broadcast(&g_hold_cond);
    }
    pthread_mutex_unlock(&g_hold_lock);
}

/* A child forked while another thread held g_lock would find it locked
 * forever; the parent's hubs (and their threads) do not exist in the child. */
static void sv_atfork_child(void)
{
    pthread_mutex_init(&g_lock, NULL);
}

static void sv_init(void)
{
    pthread_atfork(NULL, NULL, sv_atfork_child);
    int n = 2;
    const char *e = getenv("AXF_SOFTVERBS_DEVICES");
    if (e && *e) {
        char *end;
        long v = strtol(e, &end, 10);
        if (*end == '\0' && v >= 0 && v <= SV_MAX_DEVICES)
            n = (int)v;
        else
            fprintf(stderr, "softverbs: AXF_SOFTVERBS_DEVICES=%s is not 0..%d; using 2\n", e,
                    SV_MAX_DEVICES);
    }
    const char *r = getenv("AXF_SOFTVERBS_ROUTED");
    g_routed = r && *r == '1';
    const char *ra = getenv("AXF_SOFTVERBS_RD_ATOM");
    int resp, init;
    if (ra && sscanf(ra, "%d,%d", &resp, &init) == 2 && resp >= 1 && resp <= SV_MAX_RD_ATOM &&
        init >= 1 && init <= SV_MAX_RD_ATOM) {
        g_rd_resp = resp;
        g_rd_init = init;
    }
    for (int i = 0; i < n; i++) {
        sv_device *d = &g_devs[i];
        d->index = i;
        d->dev.node_type = IBV_NODE_CA;
        d->dev.transport_type = IBV_TRANSPORT_IB;
        snprintf(d->dev.name, sizeof d->dev.name, "softverbs%d", i);
        snprintf(d->dev.dev_name, sizeof d->dev.dev_name, "uverbs-softverbs%d", i);
    }
    g_ndev = n;
}

/* ------------------------------------------------------------------ helpers */

static int send_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int recv_all(int fd, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r == 0)
            return -1;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

enum { SV_GIDS = 4 };

/* GID entry i's type (see the table at the top). */
static int sv_gid_type(uint32_t index)
{
    return index % 2 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1;
}

/* A link-local (fe80::) or routable (2001:db8::) GID naming (pid, dev). */
static void sv_gid_at(union ibv_gid *g, uint32_t pid, uint32_t dev, bool routable)
{
    memset(g, 0, sizeof *g);
    g->raw[0] = routable ? 0x20 : 0xfe;
    g->raw[1] = routable ? 0x01 : 0x80;
    g->raw[2] = routable ? 0x0d : 0;
    g->raw[3] = routable ? 0xb8 : 0;
    memcpy(g->raw + 4, "axsv", 4);
    uint32_t p = htonl(pid), d = htonl(dev);
    memcpy(g->raw + 8, &p, 4);
    memcpy(g->raw + 12, &d, 4);
}

static void sv_gid(union ibv_gid *g, uint32_t pid, uint32_t dev)
{
    sv_gid_at(g, pid, dev, false);
}

static bool sv_gid_routable(const union ibv_gid *g)
{
    return g->raw[0] == 0x20 && g->raw[1] == 0x01;
}

static bool sv_gid_parse(const union ibv_gid *g, uint32_t *pid, uint32_t *dev)
{
    union ibv_gid ll, rt;
    sv_gid_at(&ll, 0, 0, false);
    sv_gid_at(&rt, 0, 0, true);
    if (memcmp(g->raw, ll.raw, 8) != 0 && memcmp(g->raw, rt.raw, 8) != 0)
        return false;
    uint32_t p, d;
    memcpy(&p, g->raw + 8, 4);
    memcpy(&d, g->raw + 12, 4);
    *pid = ntohl(p);
    *dev = ntohl(d);
    /* The remote's device count may differ from ours (AXF_SOFTVERBS_DEVICES
     * is per process): bound the index by the most any process has. */
    return *pid > 0 && *pid <= INT32_MAX && *dev < SV_MAX_DEVICES;
}

static socklen_t sv_addr(struct sockaddr_un *a, uint32_t pid, uint32_t dev)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    /* Abstract namespace (leading NUL): nothing to unlink, gone with the process. */
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "axf-softverbs/%u/%u", pid, dev);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static bool link_down(const sv_hub *h)
{
    return __atomic_load_n(&h->dev->link_down, __ATOMIC_ACQUIRE) != 0;
}

static sv_hub *hub_of(struct ibv_context *c)
{
    return ((sv_ctx *)c)->hub;
}

static void obj_add(struct ibv_context *c, int d)
{
    __atomic_add_fetch(&((sv_ctx *)c)->nobj, d, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ MR table */

static unsigned mr_bucket(uint32_t key)
{
    return (key * 2654435761u) >> 22; /* 10 bits */
}

/* Caller holds mr_lock (read or write). */
static sv_mr *mr_find(sv_hub *h, uint32_t key)
{
    for (sv_mr *m = h->mrs[mr_bucket(key)]; m; m = m->next)
        if (m->mr.lkey == key)
            return m;
    return NULL;
}

/* The MR behind key if [addr, addr+len) lies inside it, it belongs to pd and
 * allows access; NULL otherwise. Caller holds mr_lock. */
static sv_mr *mr_check(sv_hub *h, struct ibv_pd *pd, uint32_t key, uint64_t addr, uint64_t len,
                       int access)
{
    sv_mr *m = mr_find(h, key);
    if (!m || m->mr.pd != pd || (m->access & access) != access)
        return NULL;
    uint64_t base = (uint64_t)(uintptr_t)m->mr.addr, size = m->mr.length;
    if (addr < base || len > size || addr - base > size - len)
        return NULL;
    return m;
}

/* Where the bytes at addr of MR m are for our copies: the address itself,
 * or (dmabuf MR) our mapping of the dmabuf. Caller holds mr_lock. */
static uint8_t *mr_at(const sv_mr *m, uint64_t addr)
{
    if (m->dma)
        return m->dma + m->dma_delta + (addr - (uint64_t)(uintptr_t)m->mr.addr);
    return (uint8_t *)(uintptr_t)addr;
}

/* ------------------------------------------------------------------ CQ */

static void cq_push(sv_cq *cq, const struct ibv_wc *wc, uint64_t seq, bool recv)
{
    bool notify = false;
    if (__atomic_load_n(&((sv_device *)cq->cq.context->device)->fatal, __ATOMIC_ACQUIRE))
        return; /* a dead device completes nothing, not even flushes */
    pthread_mutex_lock(&cq->lock);
    if (cq->count == cq->cap) {
        if (!cq->overflow)
            fprintf(stderr, "softverbs: CQ overflow (%u entries): a completion was lost\n",
                    cq->cap);
        cq->overflow = true;
    } else {
        sv_cqe *e = &cq->ring[(cq->head + cq->count) % cq->cap];
        e->wc = *wc;
        e->seq = seq;
        e->recv = recv;
        cq->count++;
    }
    if (cq->armed && cq->cq.channel) {
        cq->armed = false;
        notify = true;
    }
    if (notify) {
        sv_chan *ch = (sv_chan *)cq->cq.channel;
        pthread_mutex_lock(&ch->lock);
        cq->events++;
        pthread_mutex_unlock(&ch->lock);
        uint64_t one = 1;
        ssize_t r = write(ch->ch.fd, &one, sizeof one);
        (void)r; /* an eventfd write of 1 cannot fail short of overflow */
    }
    pthread_mutex_unlock(&cq->lock);
}

/* ------------------------------------------------------------------ QP table */

static sv_qp *qp_find(sv_hub *h, uint32_t qpn)
{
    for (sv_qp *q = h->qps[qpn % SV_QP_BUCKETS]; q; q = q->next)
        if (q->qp.qp_num == qpn)
            return q;
    return NULL;
}

/* ------------------------------------------------------------------ QP errors */

static struct ibv_sge *sq_sges(sv_qp *q, uint64_t seq)
{
    return q->sq_sge + (seq % q->cap.max_send_wr) * q->cap.max_send_sge;
}

static struct ibv_sge *rq_sges(sv_qp *q, uint64_t seq)
{
    return q->rq_sge + (seq % q->cap.max_recv_wr) * q->cap.max_recv_sge;
}

static enum ibv_wc_opcode wc_opcode(int wr_op)
{
    switch (wr_op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
        return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
        return IBV_WC_RDMA_READ;
    default:
        return IBV_WC_SEND;
    }
}

/* Caller holds q->lock. */
static void sq_complete(sv_qp *q, uint64_t seq, enum ibv_wc_status st)
{
    sv_swqe *w = &q->sq[seq % q->cap.max_send_wr];
    if (st == IBV_WC_SUCCESS && !w->signaled)
        return;
    struct ibv_wc wc = {0};
    wc.wr_id = w->wr_id;
    wc.status = st;
    wc.opcode = wc_opcode(w->op);
    wc.qp_num = q->qp.qp_num;
    if (w->op == IBV_WR_RDMA_READ && st == IBV_WC_SUCCESS)
        wc.byte_len = (uint32_t)w->len;
    cq_push((sv_cq *)q->qp.send_cq, &wc, seq, false);
}

/* Caller holds q->lock. */
static void rq_complete(sv_qp *q, uint64_t seq, enum ibv_wc_status st, enum ibv_wc_opcode op,
                        uint32_t len, bool with_imm, uint32_t imm)
{
    struct ibv_wc wc = {0};
    wc.wr_id = q->rq[seq % q->cap.max_recv_wr].wr_id;
    wc.status = st;
    wc.opcode = op;
    wc.byte_len = len;
    wc.qp_num = q->qp.qp_num;
    wc.src_qp = q->dest_qpn;
    if (with_imm && st == IBV_WC_SUCCESS) {
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = imm;
    }
    cq_push((sv_cq *)q->qp.recv_cq, &wc, seq, true);
}

/* Moves the QP to ERR: every outstanding WR on both queues completes with
 * WR_FLUSH_ERR, both directions of the link close. Caller holds q->lock. */
static void qp_error(sv_qp *q)
{
    if (q->qp.state != IBV_QPS_ERR) {
        q->qp.state = IBV_QPS_ERR;
        for (uint64_t s = q->sq_done; s < q->sq_posted; s++)
            sq_complete(q, s, IBV_WC_WR_FLUSH_ERR);
        q->sq_done = q->sq_resp = q->sq_sent = q->sq_posted;
        for (uint64_t s = q->rq_done; s < q->rq_posted; s++)
            rq_complete(q, s, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
        q->rq_done = q->rq_posted;
    }
    q->halted = true;
    if (q->fd >= 0)
        shutdown(q->fd, SHUT_RDWR);
    for (sv_conn *c = q->in; c; c = c->qp_next)
        shutdown(c->fd, SHUT_RDWR);
    pthread_cond_broadcast(&q->cond);
}

/* Completes finished WRs in order; the first failure errors the QP. Caller
 * holds q->lock. */
static void sq_progress(sv_qp *q)
{
    while (q->sq_done < q->sq_posted) {
        sv_swqe *w = &q->sq[q->sq_done % q->cap.max_send_wr];
        if (!w->final)
            break;
        enum ibv_wc_status st = w->status;
        sq_complete(q, q->sq_done, st);
        q->sq_done++;
        if (st != IBV_WC_SUCCESS) {
            qp_error(q);
            break;
        }
    }
    pthread_cond_broadcast(&q->cond); /* a poster may wait for completions (test hook) */
}

/* The requester link is gone: the oldest WR on the wire fails RETRY_EXC_ERR
 * (the peer stopped answering), later ones flush; with nothing on the wire the
 * next WR fails when the sender reaches it. Caller holds q->lock. */
static void qp_link_lost(sv_qp *q)
{
    q->link_dead = true;
    if (q->qp.state == IBV_QPS_ERR)
        return;
    if (q->sq_resp < q->sq_sent) {
        sv_swqe *w = &q->sq[q->sq_resp % q->cap.max_send_wr];
        if (!w->final) {
            w->final = true;
            w->status = w->local != IBV_WC_SUCCESS ? w->local : IBV_WC_RETRY_EXC_ERR;
        }
        sq_progress(q);
    }
    pthread_cond_broadcast(&q->cond);
}

/* ------------------------------------------------------------------ requester */

/* Copies [off, off+n) of the WR's gathered local memory into buf, looking
 * every key up afresh. Caller holds no lock. Returns false on a bad lkey. */
static bool gather(sv_qp *q, const struct ibv_sge *sg, int nsge, uint64_t off, uint8_t *buf,
                   size_t n)
{
    sv_hub *h = q->hub;
    bool ok = true;
    pthread_rwlock_rdlock(&h->mr_lock);
    for (int i = 0; i < nsge && n; i++) {
        if (off >= sg[i].length) {
            off -= sg[i].length;
            continue;
        }
        size_t take = sg[i].length - off < n ? (size_t)(sg[i].length - off) : n;
        sv_mr *m = mr_check(h, q->qp.pd, sg[i].lkey, sg[i].addr + off, take, 0);
        if (!m) {
            ok = false;
            break;
        }
        memcpy(buf, mr_at(m, sg[i].addr + off), take);
        buf += take;
        n -= take;
        off = 0;
    }
    pthread_rwlock_unlock(&h->mr_lock);
    return ok;
}

/* Scatters buf into [off, off+n) of the local SGEs (LOCAL_WRITE needed).
 * Caller holds q->lock (so a flush cannot race the copy) and no mr_lock. */
static bool scatter(sv_qp *q, const struct ibv_sge *sg, int nsge, uint64_t off,
                    const uint8_t *buf, size_t n)
{
    sv_hub *h = q->hub;
    bool ok = true;
    pthread_rwlock_rdlock(&h->mr_lock);
    for (int i = 0; i < nsge && n; i++) {
        if (off >= sg[i].length) {
            off -= sg[i].length;
            continue;
        }
        size_t take = sg[i].length - off < n ? (size_t)(sg[i].length - off) : n;
        sv_mr *m = mr_check(h, q->qp.pd, sg[i].lkey, sg[i].addr + off, take,
                            IBV_ACCESS_LOCAL_WRITE);
        if (!m) {
            ok = false;
            break;
        }
        memcpy(mr_at(m, sg[i].addr + off), buf, take);
        buf += take;
        n -= take;
        off = 0;
    }
    pthread_rwlock_unlock(&h->mr_lock);
    return ok;
}

static uint8_t wire_op(int wr_op)
{
    switch (wr_op) {
    case IBV_WR_RDMA_WRITE:
        return SV_OP_WRITE;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
        return SV_OP_WRITE_IMM;
    case IBV_WR_SEND:
        return SV_OP_SEND;
    case IBV_WR_SEND_WITH_IMM:
        return SV_OP_SEND_IMM;
    default:
        return SV_OP_READ;
    }
}

/* Sends WRs in posting order. Stops at the first one that cannot go on the
 * wire (bad lkey, dead link), which completes with its error in turn. */
static void *sender_main(void *arg)
{
    sv_qp *q = arg;
    uint8_t *buf = malloc(sizeof(sv_req) + SV_CHUNK);
    struct ibv_sge sg[SV_MAX_SGE];
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (!q->stop && (q->halted || q->sq_sent == q->sq_posted))
            pthread_cond_wait(&q->cond, &q->lock);
        if (q->stop)
            break;
        uint64_t seq = q->sq_sent;
        sv_swqe *w = &q->sq[seq % q->cap.max_send_wr];
        if (w->op == IBV_WR_RDMA_READ && w->local == IBV_WC_SUCCESS && !q->link_dead &&
            q->reads_out >= (q->max_rd ? q->max_rd : 1)) {
            /* The requester never has more READs outstanding than its QP's
             * max_rd_atomic: the next one waits for a response. */
            pthread_cond_wait(&q->cond, &q->lock);
            continue;
        }
        enum ibv_wc_status bad = w->local;
        if (bad == IBV_WC_SUCCESS && (q->link_dead || q->fd < 0 || link_down(q->hub)))
            bad = IBV_WC_RETRY_EXC_ERR;
        if (bad == IBV_WC_SUCCESS && !buf)
            bad = IBV_WC_LOC_QP_OP_ERR;
        if (bad != IBV_WC_SUCCESS) {
            /* Nothing after it may go out; it completes when its turn comes. */
            w->final = true;
            w->status = bad;
            q->sq_sent++;
            q->halted = true;
            if (q->sq_resp == seq)
                q->sq_resp++;
            sq_progress(q);
            continue;
        }
        sv_req req = {0};
        req.seq = (uint32_t)seq;
        req.op = wire_op(w->op);
        req.rnr_retry = q->rnr_retry;
        if (w->op == IBV_WR_RDMA_READ) {
            q->reads_out++;
            req.rd_depth = q->max_rd ? q->max_rd : 1;
        }
        req.imm = w->imm;
        req.rkey = w->rkey;
        req.raddr = w->raddr;
        req.len = w->len;
        int nsge = w->nsge;
        bool inl = nsge < 0; /* inline: the data is in the slot */
        bool payload = req.op != SV_OP_READ;
        size_t first = 0;
        memcpy(buf, &req, sizeof req);
        if (inl) {
            first = (size_t)req.len;
            if (first)
                memcpy(buf + sizeof req,
                       q->sq_inl + (seq % q->cap.max_send_wr) * q->cap.max_inline_data, first);
        } else if (nsge) {
            memcpy(sg, sq_sges(q, seq), (size_t)nsge * sizeof sg[0]);
        }
        q->sq_sent++;
        int fd = q->fd;
        pthread_mutex_unlock(&q->lock);

        bool local_ok = true;
        int r;
        if (!payload || inl) {
            r = send_all(fd, buf, sizeof req + first);
        } else {
            uint64_t off = 0;
            size_t hdr = sizeof req;
            r = 0;
            do {
                size_t n = req.len - off < SV_CHUNK ? (size_t)(req.len - off) : SV_CHUNK;
                if (local_ok && !gather(q, sg, nsge, off, buf + hdr, n))
                    local_ok = false; /* MR gone mid-WR: kill the link below */
                if (!local_ok)
                    break;
                r = send_all(fd, buf, hdr + n);
                hdr = 0;
                off += n;
            } while (r == 0 && off < req.len);
        }
        pthread_mutex_lock(&q->lock);
        if (!local_ok && seq >= q->sq_done) {
            w->local = IBV_WC_LOC_PROT_ERR;
            shutdown(fd, SHUT_RDWR);
        }
        if (r != 0 || !local_ok) {
            /* The receiver sees the dead link and fails the WRs in order. */
            q->halted = true;
            shutdown(fd, SHUT_RDWR);
        }
    }
    pthread_mutex_unlock(&q->lock);
    free(buf);
    return NULL;
}

static enum ibv_wc_status wire_status(uint8_t s)
{
    switch (s) {
    case SV_REM_ACCESS:
        return IBV_WC_REM_ACCESS_ERR;
    case SV_REM_INV_REQ:
        return IBV_WC_REM_INV_REQ_ERR;
    case SV_RNR:
        return IBV_WC_RNR_RETRY_EXC_ERR;
    default:
        return IBV_WC_REM_OP_ERR;
    }
}

/* Reads responses in order and completes the WRs they answer. */
static void *receiver_main(void *arg)
{
    sv_qp *q = arg;
    uint8_t *buf = malloc(SV_CHUNK);
    struct ibv_sge sg[SV_MAX_SGE];
    for (;;) {
        sv_resp resp;
        if (!buf || recv_all(q->fd, &resp, sizeof resp) != 0)
            break;
        pthread_mutex_lock(&q->lock);
        uint64_t seq = q->sq_resp;
        sv_swqe *w = &q->sq[seq % q->cap.max_send_wr];
        bool valid = !q->stop && q->qp.state != IBV_QPS_ERR && seq < q->sq_sent && !w->final &&
                     resp.seq == (uint32_t)seq && resp.op == wire_op(w->op) && resp.zero == 0 &&
                     resp.status <= SV_RNR &&
                     (resp.status == SV_OK
                          ? resp.len == (w->op == IBV_WR_RDMA_READ ? w->len : 0)
                          : resp.len == 0);
        int nsge = w->nsge;
        if (valid && nsge > 0)
            memcpy(sg, sq_sges(q, seq), (size_t)nsge * sizeof sg[0]);
        pthread_mutex_unlock(&q->lock);
        if (!valid)
            break; /* a malformed or unexpected frame: the link is dead */

        enum ibv_wc_status st = resp.status == SV_OK ? IBV_WC_SUCCESS : wire_status(resp.status);
        bool io_ok = true;
        for (uint64_t off = 0; off < resp.len;) {
            size_t n = resp.len - off < SV_CHUNK ? (size_t)(resp.len - off) : SV_CHUNK;
            if (recv_all(q->fd, buf, n) != 0) {
                io_ok = false;
                break;
            }
            pthread_mutex_lock(&q->lock);
            /* A flushed WR's buffers are the application's again: never write them. */
            if (seq >= q->sq_done && st == IBV_WC_SUCCESS && !scatter(q, sg, nsge, off, buf, n))
                st = IBV_WC_LOC_PROT_ERR;
            pthread_mutex_unlock(&q->lock);
            off += n;
        }
        if (!io_ok)
            break;
        pthread_mutex_lock(&q->lock);
        if (w->op == IBV_WR_RDMA_READ && q->reads_out) {
            q->reads_out--;
            pthread_cond_broadcast(&q->cond); /* a READ may wait for this */
        }
        if (seq >= q->sq_done && seq == q->sq_resp) {
            w->final = true;
            w->status = w->local != IBV_WC_SUCCESS ? w->local : st;
            q->sq_resp++;
            sq_progress(q);
        }
        pthread_mutex_unlock(&q->lock);
    }
    pthread_mutex_lock(&q->lock);
    if (!q->stop)
        qp_link_lost(q);
    pthread_mutex_unlock(&q->lock);
    free(buf);
    return NULL;
}

/* ------------------------------------------------------------------ responder */

/* Whether requests to this QP are served (RTR or RTS, not stopping). */
static bool qp_serving(const sv_qp *q)
{
    return !q->destroying && !q->stop &&
           (q->qp.state == IBV_QPS_RTR || q->qp.state == IBV_QPS_RTS);
}

/* Waits for a posted receive (RNR: the requester's rnr_retry 7 waits forever,
 * otherwise about 100 ms per retry). Returns its sequence, or -1. Caller holds
 * q->lock. */
static int64_t rq_take(sv_qp *q, uint8_t rnr_retry)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ms = 100ull * ((uint64_t)rnr_retry + 1);
    until.tv_sec += (time_t)(ms / 1000);
    until.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (q->rq_done == q->rq_posted) {
        if (!qp_serving(q))
            return -1;
        if (rnr_retry >= 7)
            pthread_cond_wait(&q->cond, &q->lock);
        else if (pthread_cond_timedwait(&q->cond, &q->lock, &until) == ETIMEDOUT)
            return q->rq_done < q->rq_posted ? (int64_t)q->rq_done++ : -1;
    }
    return (int64_t)q->rq_done++;
}

/* Receives len payload bytes; places them at raddr (rkey, WRITE) or into the
 * receive's SGEs (SEND), checking keys, bounds and access before every copy.
 * Returns SV_OK, an error status (payload drained), or -1: connection lost. */
static int place(sv_conn *c, sv_qp *q, uint8_t *buf, const sv_req *rq, bool to_recv,
                 const struct ibv_sge *sg, int nsge)
{
    sv_hub *h = c->hub;
    int st = SV_OK;
    for (uint64_t off = 0; off < rq->len;) {
        size_t n = rq->len - off < SV_CHUNK ? (size_t)(rq->len - off) : SV_CHUNK;
        if (recv_all(c->fd, buf, n) != 0)
            return -1;
        pthread_mutex_lock(&q->lock);
        if (!qp_serving(q)) {
            pthread_mutex_unlock(&q->lock);
            return -1;
        }
        if (st == SV_OK) {
            if (to_recv) {
                if (!scatter(q, sg, nsge, off, buf, n))
                    st = SV_REM_OP;
            } else {
                pthread_rwlock_rdlock(&h->mr_lock);
                sv_mr *m = mr_check(h, q->qp.pd, rq->rkey, rq->raddr + off, n,
                                    IBV_ACCESS_REMOTE_WRITE);
                if (m)
                    memcpy(mr_at(m, rq->raddr + off), buf, n);
                else
                    st = SV_REM_ACCESS; /* deregistered mid-WR */
                pthread_rwlock_unlock(&h->mr_lock);
            }
        }
        pthread_mutex_unlock(&q->lock);
        off += n;
    }
    return st;
}

/* Copies [addr, addr+n) of the MR behind rkey into buf if REMOTE_READ allows
 * it. Caller holds q->lock. */
static bool mr_read(sv_qp *q, uint32_t rkey, uint64_t addr, uint8_t *buf, size_t n)
{
    sv_hub *h = q->hub;
    pthread_rwlock_rdlock(&h->mr_lock);
    sv_mr *m = mr_check(h, q->qp.pd, rkey, addr, n, IBV_ACCESS_REMOTE_READ);
    bool ok = m != NULL;
    if (ok)
        memcpy(buf, mr_at(m, addr), n);
    pthread_rwlock_unlock(&h->mr_lock);
    return ok;
}

/* Checks a WRITE/READ target before any byte moves. Caller holds q->lock. */
static bool remote_ok(sv_qp *q, const sv_req *rq, int access)
{
    if (rq->len == 0)
        return true; /* zero-length RDMA: the R_Key is not checked (IB spec) */
    if ((q->access & access) != access)
        return false;
    pthread_rwlock_rdlock(&q->hub->mr_lock);
    bool ok = mr_check(q->hub, q->qp.pd, rq->rkey, rq->raddr, rq->len, access) != NULL;
    pthread_rwlock_unlock(&q->hub->mr_lock);
    return ok;
}

static int respond(sv_conn *c, const sv_req *rq, int status, uint64_t len)
{
    sv_resp r = {.seq = rq->seq, .op = rq->op, .status = (uint8_t)status, .len = len};
    return send_all(c->fd, &r, sizeof r);
}

/* Serves one request. Returns 0 to go on, -1 to close the connection. */
static int serve(sv_conn *c, sv_qp *q, uint8_t *buf, const sv_req *rq)
{
    struct ibv_sge sg[SV_MAX_SGE];
    if (rq->zero != 0 || rq->op < SV_OP_WRITE || rq->op > SV_OP_READ || rq->len > SV_MAX_MSG)
        return -1;
    bool rdma = rq->op == SV_OP_WRITE || rq->op == SV_OP_WRITE_IMM || rq->op == SV_OP_READ;
    bool with_imm = rq->op == SV_OP_WRITE_IMM || rq->op == SV_OP_SEND_IMM;
    bool needs_recv = rq->op != SV_OP_WRITE && rq->op != SV_OP_READ;
    int access = rq->op == SV_OP_READ ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE;

    pthread_mutex_lock(&q->lock);
    if (!qp_serving(q)) {
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    if (rq->op == SV_OP_READ && rq->rd_depth > q->max_dest_rd) {
        /* A requester that may have more READs in flight than this responder
         * QP has resources for (max_dest_rd_atomic) overruns it as soon as
         * the load is there; the NIC then NAKs an invalid request. Refused at
         * the first READ, so the mismatch shows in every test, not only
         * under load. */
        pthread_mutex_unlock(&q->lock);
        respond(c, rq, SV_REM_INV_REQ, 0);
        pthread_mutex_lock(&q->lock);
        qp_error(q);
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    if (rdma && !remote_ok(q, rq, access)) {
        /* The NIC refuses before touching memory; the responder QP errors
         * (after the NAK is out: the error closes this connection). */
        pthread_mutex_unlock(&q->lock);
        respond(c, rq, SV_REM_ACCESS, 0);
        pthread_mutex_lock(&q->lock);
        qp_error(q);
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    int64_t rseq = -1;
    int nsge = 0;
    uint64_t room = 0;
    if (needs_recv) {
        rseq = rq_take(q, rq->rnr_retry);
        if (rseq < 0) {
            bool serving = qp_serving(q);
            pthread_mutex_unlock(&q->lock);
            if (serving)
                respond(c, rq, SV_RNR, 0);
            return -1;
        }
        nsge = q->rq[(uint64_t)rseq % q->cap.max_recv_wr].nsge;
        if (nsge)
            memcpy(sg, rq_sges(q, (uint64_t)rseq), (size_t)nsge * sizeof sg[0]);
        for (int i = 0; i < nsge; i++)
            room += sg[i].length;
    }
    pthread_mutex_unlock(&q->lock);

    if (rq->op == SV_OP_READ) {
        if (respond(c, rq, SV_OK, rq->len) != 0)
            return -1;
        for (uint64_t off = 0; off < rq->len;) {
            size_t n = rq->len - off < SV_CHUNK ? (size_t)(rq->len - off) : SV_CHUNK;
            pthread_mutex_lock(&q->lock);
            bool ok = qp_serving(q) && mr_read(q, rq->rkey, rq->raddr + off, buf, n);
            pthread_mutex_unlock(&q->lock);
            /* Deregistered mid-READ: the response is promised, so the link dies. */
            if (!ok || send_all(c->fd, buf, n) != 0)
                return -1;
            off += n;
        }
        return 0;
    }

    int st;
    bool too_long = needs_recv && !rdma && rq->len > room;
    if (too_long) {
        /* Drain, then fail as a NIC does: local length error at the receiver. */
        for (uint64_t off = 0; off < rq->len;) {
            size_t n = rq->len - off < SV_CHUNK ? (size_t)(rq->len - off) : SV_CHUNK;
            if (recv_all(c->fd, buf, n) != 0)
                return -1;
            off += n;
        }
        st = SV_REM_INV_REQ;
    } else {
        st = place(c, q, buf, rq, !rdma, sg, nsge);
        if (st < 0)
            return -1;
    }
    pthread_mutex_lock(&q->lock);
    if (!qp_serving(q)) {
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    if (needs_recv) {
        enum ibv_wc_status rst = st == SV_OK ? IBV_WC_SUCCESS
                                 : too_long  ? IBV_WC_LOC_LEN_ERR
                                             : IBV_WC_LOC_PROT_ERR;
        if (st == SV_REM_ACCESS)
            rst = IBV_WC_REM_ACCESS_ERR;
        rq_complete(q, (uint64_t)rseq, rst, rdma ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV,
                    (uint32_t)rq->len, with_imm, rq->imm);
    }
    pthread_mutex_unlock(&q->lock);
    if (respond(c, rq, st, 0) != 0)
        return -1;
    if (st != SV_OK) {
        pthread_mutex_lock(&q->lock);
        qp_error(q);
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    return 0;
}

/* Binds the connection to the QP it names once that QP is in RTR and names us
 * back. Returns the QP, or NULL to drop the connection. */
static sv_qp *conn_bind(sv_conn *c)
{
    sv_hub *h = c->hub;
    sv_hello hello;
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (recv_all(c->fd, &hello, sizeof hello) != 0 || hello.magic != SV_MAGIC ||
        hello.src_dev >= SV_MAX_DEVICES ||
        getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.pid <= 0)
        return NULL;
    pthread_mutex_lock(&h->lock);
    sv_qp *q = link_down(h) ? NULL : qp_find(h, hello.dst_qpn);
    if (q) {
        pthread_mutex_lock(&q->lock);
        if (q->destroying) {
            pthread_mutex_unlock(&q->lock);
            q = NULL;
        } else {
            c->qp = q;
            c->qp_next = q->in;
            q->in = c;
        }
    }
    pthread_mutex_unlock(&h->lock);
    if (!q)
        return NULL;
    /* A peer may reach RTR before we do: wait, as its packets would be retried. */
    while (!q->destroying && !q->stop &&
           (q->qp.state == IBV_QPS_RESET || q->qp.state == IBV_QPS_INIT))
        pthread_cond_wait(&q->cond, &q->lock);
    union ibv_gid want;
    sv_gid(&want, (uint32_t)cred.pid, hello.src_dev);
    union ibv_gid want_rt;
    sv_gid_at(&want_rt, (uint32_t)cred.pid, hello.src_dev, true);
    bool ok = qp_serving(q) && !q->stop && q->dest_qpn == hello.src_qpn &&
              (memcmp(&q->dgid, &want, sizeof want) == 0 ||
               memcmp(&q->dgid, &want_rt, sizeof want_rt) == 0) &&
              hello.sgid_index < SV_GIDS &&
              sv_gid_type(hello.sgid_index) == sv_gid_type(q->sgid_index); /* v1 != v2 */
    pthread_mutex_unlock(&q->lock);
    return ok ? q : NULL;
}

static void conn_unbind(sv_conn *c)
{
    sv_qp *q = c->qp;
    if (!q)
        return;
    pthread_mutex_lock(&q->lock);
    for (sv_conn **p = &q->in; *p; p = &(*p)->qp_next) {
        if (*p == c) {
            *p = c->qp_next;
            break;
        }
    }
    c->qp = NULL;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

static void *conn_main(void *arg)
{
    sv_conn *c = arg;
    uint8_t *buf = malloc(SV_CHUNK);
    sv_qp *q = buf ? conn_bind(c) : NULL;
    while (q) {
        sv_req rq;
        if (recv_all(c->fd, &rq, sizeof rq) != 0 || serve(c, q, buf, &rq) != 0)
            break;
    }
    conn_unbind(c);
    shutdown(c->fd, SHUT_RDWR);
    free(buf);
    pthread_mutex_lock(&c->hub->lock);
    c->done = true;
    pthread_mutex_unlock(&c->hub->lock);
    return NULL;
}

/* Joins finished responder threads. Caller holds no lock. */
static void hub_reap(sv_hub *h, bool all)
{
    for (;;) {
        sv_conn *dead = NULL;
        pthread_mutex_lock(&h->lock);
        for (sv_conn **p = &h->conns; *p; p = &(*p)->next) {
            if ((*p)->done || all) {
                dead = *p;
                *p = dead->next;
                break;
            }
        }
        pthread_mutex_unlock(&h->lock);
        if (!dead)
            return;
        pthread_join(dead->thread, NULL);
        close(dead->fd);
        free(dead);
    }
}

static void *listener_main(void *arg)
{
    sv_hub *h = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = h->listen_fd, .events = POLLIN},
                              {.fd = h->wake_fd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (p[1].revents)
            break;
        hub_reap(h, false);
        int fd = accept4(h->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                struct timespec ts = {0, 10 * 1000 * 1000}; /* out of fds: do not spin */
                nanosleep(&ts, NULL);
            }
            continue;
        }
        sv_conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->hub = h;
        c->fd = fd;
        pthread_mutex_lock(&h->lock);
        if (link_down(h) || pthread_create(&c->thread, NULL, conn_main, c) != 0) {
            pthread_mutex_unlock(&h->lock);
            close(fd);
            free(c);
            continue;
        }
        c->next = h->conns;
        h->conns = c;
        pthread_mutex_unlock(&h->lock);
    }
    return NULL;
}

/* ------------------------------------------------------------------ hub */

static void hub_free(sv_hub *h)
{
    if (h->wake_fd >= 0)
        close(h->wake_fd);
    if (h->listen_fd >= 0)
        close(h->listen_fd);
    pthread_mutex_destroy(&h->lock);
    pthread_rwlock_destroy(&h->mr_lock);
    free(h);
}

static sv_hub *hub_get(sv_device *d)
{
    pthread_mutex_lock(&g_lock);
    if (g_hubs_pid != getpid()) {
        /* A forked child: its parent's hubs (and their threads) are not ours. */
        memset(g_hubs, 0, sizeof g_hubs);
        g_hubs_pid = getpid();
    }
    sv_hub *h = g_hubs[d->index];
    if (h) {
        h->refs++;
        pthread_mutex_unlock(&g_lock);
        return h;
    }
    h = calloc(1, sizeof *h);
    if (!h) {
        pthread_mutex_unlock(&g_lock);
        errno = ENOMEM;
        return NULL;
    }
    h->dev = d;
    h->refs = 1;
    h->next_qpn = 0x100 + (uint32_t)d->index * 0x10000;
    h->next_key = 0x1000 + (uint32_t)d->index;
    pthread_mutex_init(&h->lock, NULL);
    pthread_rwlock_init(&h->mr_lock, NULL);
    h->wake_fd = eventfd(0, EFD_CLOEXEC);
    h->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_un a;
    socklen_t al = sv_addr(&a, (uint32_t)getpid(), (uint32_t)d->index);
    int err = 0;
    if (h->wake_fd < 0 || h->listen_fd < 0 || bind(h->listen_fd, (struct sockaddr *)&a, al) != 0 ||
        listen(h->listen_fd, 128) != 0)
        err = errno;
    if (!err)
        err = pthread_create(&h->listener, NULL, listener_main, h);
    if (err) {
        hub_free(h);
        pthread_mutex_unlock(&g_lock);
        errno = err;
        return NULL;
    }
    g_hubs[d->index] = h;
    pthread_mutex_unlock(&g_lock);
    return h;
}

static void hub_put(sv_hub *h)
{
    pthread_mutex_lock(&g_lock);
    if (--h->refs > 0) {
        pthread_mutex_unlock(&g_lock);
        return;
    }
    g_hubs[h->dev->index] = NULL;
    pthread_mutex_unlock(&g_lock);
    uint64_t one = 1;
    ssize_t r = write(h->wake_fd, &one, sizeof one);
    (void)r;
    pthread_join(h->listener, NULL);
    pthread_mutex_lock(&h->lock);
    for (sv_conn *c = h->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_unlock(&h->lock);
    hub_reap(h, true);
    for (int i = 0; i < SV_MR_BUCKETS; i++) {
        while (h->mrs[i]) {
            sv_mr *m = h->mrs[i];
            h->mrs[i] = m->next;
            free(m);
        }
    }
    hub_free(h);
}

/* ------------------------------------------------------------------ devices */

static struct ibv_device **sv_get_device_list(int *num)
{
    pthread_once(&g_once, sv_init);
    struct ibv_device **list = calloc((size_t)g_ndev + 1, sizeof *list);
    if (!list) {
        errno = ENOMEM;
        return NULL;
    }
    for (int i = 0; i < g_ndev; i++)
        list[i] = &g_devs[i].dev;
    if (num)
        *num = g_ndev;
    return list;
}

static void sv_free_device_list(struct ibv_device **list)
{
    free(list);
}

static const char *sv_get_device_name(struct ibv_device *d)
{
    /* Names a conforming provider never returns (empty, longer than
     * IBV_SYSFS_NAME_MAX): the name is then not in d->name, only here. */
    static _Thread_local char shown[512];
    const char *suffix = getenv("AXF_SOFTVERBS_NAME_SUFFIX");
    if (!suffix)
        return d->name;
    if (strcmp(suffix, "NUL") == 0)
        return "";
    snprintf(shown, sizeof shown, "%s%s", d->name, suffix);
    return shown;
}

static int sv_post_send(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **);
SV_EXPORT int axf_softverbs_set_link(const char *dev, int up);
static int sv_post_recv(struct ibv_qp *, struct ibv_recv_wr *, struct ibv_recv_wr **);
static int sv_poll_cq(struct ibv_cq *, int, struct ibv_wc *);
static int sv_req_notify_cq(struct ibv_cq *, int);

static struct ibv_context *sv_open_device(struct ibv_device *dev)
{
    pthread_once(&g_once, sv_init);
    sv_device *d = (sv_device *)dev;
    if (!d || d < g_devs || d >= g_devs + g_ndev) {
        errno = ENODEV;
        return NULL;
    }
    sv_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        errno = ENOMEM;
        return NULL;
    }
    c->hub = hub_get(d);
    if (!c->hub) {
        int e = errno;
        free(c);
        errno = e;
        return NULL;
    }
    c->ctx.device = dev;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = eventfd(0, EFD_CLOEXEC | EFD_SEMAPHORE);
    if (c->ctx.async_fd < 0) {
        int e = errno;
        hub_put(c->hub);
        free(c);
        errno = e;
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    c->next_ctx = g_ctxs;
    g_ctxs = c;
    pthread_mutex_unlock(&g_lock);
    c->ctx.num_comp_vectors = 1;
    /* The fast-path inlines of <infiniband/verbs.h> (ibv_poll_cq, ...) go
     * through these: code that calls them directly works too. */
    c->ctx.ops.poll_cq = sv_poll_cq;
    c->ctx.ops.req_notify_cq = sv_req_notify_cq;
    c->ctx.ops.post_send = sv_post_send;
    c->ctx.ops.post_recv = sv_post_recv;
    pthread_mutex_init(&c->ctx.mutex, NULL);
    return &c->ctx;
}

static int sv_close_device(struct ibv_context *ctx)
{
    sv_ctx *c = (sv_ctx *)ctx;
    int n = __atomic_load_n(&c->nobj, __ATOMIC_RELAXED);
    if (n != 0) {
        fprintf(stderr, "softverbs: close_device with %d objects not destroyed\n", n);
        return EBUSY;
    }
    pthread_mutex_lock(&g_lock);
    for (sv_ctx **p = &g_ctxs; *p; p = &(*p)->next_ctx)
        if (*p == c) {
            *p = c->next_ctx;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    close(c->ctx.async_fd);
    hub_put(c->hub);
    pthread_mutex_destroy(&c->ctx.mutex);
    free(c);
    return 0;
}

static uint64_t sv_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* Queues an asynchronous event on context c (g_lock held). */
static void event_push(sv_ctx *c, enum ibv_event_type type, struct ibv_qp *qp, int delay_ms)
{
    if (c->nevents >= 16)
        return;
    c->events[c->nevents++] =
        (struct sv_event){type, qp, delay_ms > 0 ? sv_now_ms() + (uint64_t)delay_ms : 0};
    uint64_t one = 1;
    ssize_t r = write(c->ctx.async_fd, &one, sizeof one);
    (void)r;
}

static int sv_get_async_event(struct ibv_context *ctx, struct ibv_async_event *ev)
{
    sv_ctx *c = (sv_ctx *)ctx;
    uint64_t v;
    if (read(ctx->async_fd, &v, sizeof v) != (ssize_t)sizeof v)
        return -1; /* EAGAIN on a nonblocking fd */
    pthread_mutex_lock(&g_lock);
    memset(ev, 0, sizeof *ev);
    struct sv_event e = {IBV_EVENT_DEVICE_FATAL, NULL, 0};
    if (c->nevents) {
        e = c->events[0];
        memmove(c->events, c->events + 1, (size_t)--c->nevents * sizeof c->events[0]);
    }
    if (e.qp) { /* its destroy_qp now waits for the ack (destroy purges the queue first) */
        pthread_mutex_lock(&e.qp->mutex);
        ((sv_qp *)e.qp)->events_reported++;
        pthread_mutex_unlock(&e.qp->mutex);
    }
    pthread_mutex_unlock(&g_lock);
    if (e.not_before) { /* a NIC that reports late: the caller waits, as in a blocking read */
        uint64_t now = sv_now_ms();
        if (now < e.not_before) {
            struct timespec ts = {(time_t)((e.not_before - now) / 1000),
                                  (long)((e.not_before - now) % 1000) * 1000000};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
                ;
        }
    }
    ev->event_type = e.type;
    if (e.qp)
        ev->element.qp = e.qp;
    else
        ev->element.port_num = 1;
    __atomic_add_fetch(&g_events_taken, 1, __ATOMIC_RELEASE);
    return 0;
}

static bool qp_event(enum ibv_event_type t)
{
    return t >= IBV_EVENT_QP_FATAL && t <= IBV_EVENT_PATH_MIG_ERR;
}

static void sv_ack_async_event(struct ibv_async_event *ev)
{
    if (qp_event(ev->event_type)) {
        struct ibv_qp *qp = ev->element.qp;
        pthread_mutex_lock(&qp->mutex);
        qp->events_completed++;
        pthread_cond_broadcast(&qp->cond);
        pthread_mutex_unlock(&qp->mutex);
    }
    hold_point(SV_HOLD_ACK_ASYNC, -1, 0); /* after the ack: the QP may go now */
}

static int sv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a)
{
    sv_device *d = (sv_device *)ctx->device;
    memset(a, 0, sizeof *a);
    snprintf(a->fw_ver, sizeof a->fw_ver, "softverbs-1");
    a->node_guid = htobe64(0x0200000000000000ull | ((uint64_t)getpid() << 8) | (uint64_t)d->index);
    a->sys_image_guid = a->node_guid;
    a->max_mr_size = UINT64_MAX;
    a->page_size_cap = 4096;
    a->hw_ver = 1;
    a->max_qp = 1 << 16;
    a->max_qp_wr = SV_MAX_QP_WR;
    a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN;
    a->max_sge = SV_MAX_SGE;
    a->max_sge_rd = SV_MAX_SGE;
    a->max_cq = 1 << 16;
    a->max_cqe = SV_MAX_CQE;
    a->max_mr = 1 << 20;
    a->max_pd = 1 << 16;
    a->max_qp_rd_atom = g_rd_resp;
    a->max_qp_init_rd_atom = g_rd_init;
    a->max_res_rd_atom = SV_MAX_RD_ATOM << 16;
    a->atomic_cap = IBV_ATOMIC_NONE;
    a->max_pkeys = 1;
    a->phys_port_cnt = 1;
    return 0;
}

static int sv_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *a)
{
    if (port != 1)
        return EINVAL;
    sv_device *d = (sv_device *)ctx->device;
    bool down = __atomic_load_n(&d->link_down, __ATOMIC_ACQUIRE) != 0;
    memset(a, 0, sizeof *a);
    a->state = down ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = IBV_MTU_4096;
    a->gid_tbl_len = SV_GIDS;
    a->max_msg_sz = (uint32_t)SV_MAX_MSG;
    a->pkey_tbl_len = 1;
    a->lid = 0;
    a->active_width = 2; /* 4x */
    a->active_speed = 32; /* EDR */
    a->phys_state = down ? 3 : 5; /* disabled / link up */
    a->link_layer = IBV_LINK_LAYER_ETHERNET;
    return 0;
}

static int sv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
    if (port != 1 || index < 0 || index >= SV_GIDS) {
        errno = EINVAL;
        return -1;
    }
    sv_gid_at(gid, (uint32_t)getpid(), (uint32_t)((sv_device *)ctx->device)->index, index >= 2);
    return 0;
}

static int sv_query_gid_type(struct ibv_context *ctx, uint8_t port, int index, int *type)
{
    (void)ctx;
    if (port != 1 || index < 0 || index >= SV_GIDS)
        return EINVAL;
    *type = sv_gid_type((uint32_t)index);
    return 0;
}

/* ------------------------------------------------------------------ PD, MR */

static struct ibv_pd *sv_alloc_pd(struct ibv_context *ctx)
{
    struct ibv_pd *pd = calloc(1, sizeof *pd);
    if (!pd) {
        errno = ENOMEM;
        return NULL;
    }
    pd->context = ctx;
    obj_add(ctx, 1);
    return pd;
}

static int sv_dealloc_pd(struct ibv_pd *pd)
{
    obj_add(pd->context, -1);
    free(pd);
    return 0;
}

static struct ibv_mr *mr_new(struct ibv_pd *pd, void *addr, size_t length, int access)
{
    sv_hub *h = hub_of(pd->context);
    sv_mr *m = calloc(1, sizeof *m);
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = addr;
    m->mr.length = length;
    m->access = access;
    pthread_mutex_lock(&h->lock);
    /* Keys are never reused within a process: a stale key stays invalid. */
    uint32_t key = h->next_key;
    h->next_key += 0x100;
    pthread_mutex_unlock(&h->lock);
    m->mr.lkey = m->mr.rkey = key;
    m->mr.handle = key;
    pthread_rwlock_wrlock(&h->mr_lock);
    m->next = h->mrs[mr_bucket(key)];
    h->mrs[mr_bucket(key)] = m;
    pthread_rwlock_unlock(&h->mr_lock);
    obj_add(pd->context, 1);
    return &m->mr;
}

static struct ibv_mr *sv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
    /* Remote write (and atomics) require local write, as on every NIC. */
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & IBV_ACCESS_LOCAL_WRITE)) {
        errno = EINVAL;
        return NULL;
    }
    if (!addr && length) {
        errno = EFAULT;
        return NULL;
    }
    /* The kernel pins the pages through the CPU's page tables: memory the CPU
     * cannot read (a GPU's device addresses) fails, as it does without a
     * peer-memory module. Probed at both ends (a syscall copies, never faults). */
    if (length) {
        uint8_t probe;
        struct iovec li = {&probe, 1}, r1 = {addr, 1}, r2 = {(uint8_t *)addr + length - 1, 1};
        if (process_vm_readv(getpid(), &li, 1, &r1, 1, 0) != 1 ||
            process_vm_readv(getpid(), &li, 1, &r2, 1, 0) != 1) {
            errno = EFAULT;
            return NULL;
        }
    }
    return mr_new(pd, addr, length, access);
}

/* Registers [iova, iova+length) backed by bytes [offset, offset+length) of a
 * dmabuf: the "NIC" maps the fd itself and never touches iova with the CPU. */
static struct ibv_mr *sv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
                                       uint64_t iova, int fd, int access)
{
    hold_point(SV_HOLD_REG_DMABUF, -1, 0);
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & IBV_ACCESS_LOCAL_WRITE)) {
        errno = EINVAL;
        return NULL;
    }
    off_t start = lseek(fd, 0, SEEK_CUR); /* the exported range's start in its memory */
    struct stat st;
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    if (start < 0 || fstat(fd, &st) != 0 || !length ||
        (uint64_t)start + offset + length > (uint64_t)st.st_size) {
        errno = EINVAL;
        return NULL;
    }
    uint64_t at = (uint64_t)start + offset;
    uint64_t lo = at & ~(uint64_t)(pg - 1);
    size_t len = (size_t)(at + length - lo);
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)lo);
    if (m == MAP_FAILED)
        return NULL;
    struct ibv_mr *mr = mr_new(pd, (void *)(uintptr_t)iova, length, access);
    if (!mr) {
        munmap(m, len);
        return NULL;
    }
    sv_hub *h = hub_of(pd->context);
    sv_mr *sm = (sv_mr *)mr;
    pthread_rwlock_wrlock(&h->mr_lock);
    sm->dma = m;
    sm->dma_len = len;
    sm->dma_delta = (size_t)(at - lo);
    pthread_rwlock_unlock(&h->mr_lock);
    return mr;
}

static int sv_dereg_mr(struct ibv_mr *mr)
{
    sv_hub *h = hub_of(mr->context);
    sv_mr *m = (sv_mr *)mr;
    /* The write lock waits for every copy in flight into or out of this MR. */
    pthread_rwlock_wrlock(&h->mr_lock);
    for (sv_mr **p = &h->mrs[mr_bucket(mr->lkey)]; *p; p = &(*p)->next) {
        if (*p == m) {
            *p = m->next;
            break;
        }
    }
    pthread_rwlock_unlock(&h->mr_lock);
    obj_add(mr->context, -1);
    if (m->dma)
        munmap(m->dma, m->dma_len);
    free(m);
    return 0;
}

/* ------------------------------------------------------------------ CQ, channel */

static struct ibv_comp_channel *sv_create_comp_channel(struct ibv_context *ctx)
{
    sv_chan *ch = calloc(1, sizeof *ch);
    if (!ch) {
        errno = ENOMEM;
        return NULL;
    }
    /* One count per event: get_cq_event reads exactly one. */
    ch->ch.fd = eventfd(0, EFD_CLOEXEC | EFD_SEMAPHORE);
    if (ch->ch.fd < 0) {
        int e = errno;
        free(ch);
        errno = e;
        return NULL;
    }
    ch->ch.context = ctx;
    pthread_mutex_init(&ch->lock, NULL);
    obj_add(ctx, 1);
    return &ch->ch;
}

static int sv_destroy_comp_channel(struct ibv_comp_channel *channel)
{
    sv_chan *ch = (sv_chan *)channel;
    pthread_mutex_lock(&ch->lock);
    bool busy = ch->cqs != NULL;
    pthread_mutex_unlock(&ch->lock);
    if (busy)
        return EBUSY;
    close(ch->ch.fd);
    pthread_mutex_destroy(&ch->lock);
    obj_add(channel->context, -1);
    free(ch);
    return 0;
}

static struct ibv_cq *sv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                                   struct ibv_comp_channel *channel, int comp_vector)
{
    if (cqe < 1 || cqe > SV_MAX_CQE || comp_vector < 0 || comp_vector >= ctx->num_comp_vectors ||
        (channel && channel->context != ctx)) {
        errno = EINVAL;
        return NULL;
    }
    sv_cq *cq = calloc(1, sizeof *cq);
    sv_cqe *ring = calloc((size_t)cqe, sizeof *ring);
    if (!cq || !ring) {
        free(cq);
        free(ring);
        errno = ENOMEM;
        return NULL;
    }
    cq->ring = ring;
    cq->cap = (uint32_t)cqe;
    cq->cq.context = ctx;
    cq->cq.channel = channel;
    cq->cq.cq_context = cq_context;
    cq->cq.cqe = cqe;
    pthread_mutex_init(&cq->lock, NULL);
    pthread_mutex_init(&cq->cq.mutex, NULL);
    pthread_cond_init(&cq->cq.cond, NULL);
    if (channel) {
        sv_chan *ch = (sv_chan *)channel;
        pthread_mutex_lock(&ch->lock);
        cq->chan_next = ch->cqs;
        ch->cqs = cq;
        pthread_mutex_unlock(&ch->lock);
    }
    obj_add(ctx, 1);
    return &cq->cq;
}

static int sv_destroy_cq(struct ibv_cq *ibcq)
{
    sv_cq *cq = (sv_cq *)ibcq;
    if (__atomic_load_n(&cq->nqp, __ATOMIC_RELAXED) != 0)
        return EBUSY;
    if (ibcq->channel) {
        sv_chan *ch = (sv_chan *)ibcq->channel;
        pthread_mutex_lock(&ch->lock);
        for (sv_cq **p = &ch->cqs; *p; p = &(*p)->chan_next) {
            if (*p == cq) {
                *p = cq->chan_next;
                break;
            }
        }
        pthread_mutex_unlock(&ch->lock);
    }
    pthread_mutex_destroy(&cq->lock);
    pthread_mutex_destroy(&cq->cq.mutex);
    pthread_cond_destroy(&cq->cq.cond);
    obj_add(ibcq->context, -1);
    free(cq->ring);
    free(cq);
    return 0;
}

static int sv_req_notify_cq(struct ibv_cq *ibcq, int solicited_only)
{
    (void)solicited_only; /* every completion we make is "solicited" enough */
    sv_cq *cq = (sv_cq *)ibcq;
    if (!ibcq->channel)
        return EINVAL;
    pthread_mutex_lock(&cq->lock);
    cq->armed = true;
    pthread_mutex_unlock(&cq->lock);
    return 0;
}

static int sv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **out,
                           void **cq_context)
{
    sv_chan *ch = (sv_chan *)channel;
    for (;;) {
        uint64_t v;
        ssize_t r = read(ch->ch.fd, &v, sizeof v);
        if (r != (ssize_t)sizeof v) {
            if (r < 0 && errno == EINTR)
                continue;
            return -1; /* EAGAIN on a nonblocking fd */
        }
        pthread_mutex_lock(&ch->lock);
        for (sv_cq *cq = ch->cqs; cq; cq = cq->chan_next) {
            if (cq->events) {
                cq->events--;
                *out = &cq->cq;
                *cq_context = cq->cq.cq_context;
                pthread_mutex_unlock(&ch->lock);
                return 0;
            }
        }
        /* The count belonged to a CQ destroyed since: read the next one. */
        pthread_mutex_unlock(&ch->lock);
    }
}

static void sv_ack_cq_events(struct ibv_cq *ibcq, unsigned int nevents)
{
    sv_cq *cq = (sv_cq *)ibcq;
    pthread_mutex_lock(&cq->lock);
    ibcq->comp_events_completed += nevents;
    pthread_mutex_unlock(&cq->lock);
}

/* Frees the queue slots up to each polled completion (as mlx5 does). */
static void release_slots(sv_hub *h, const sv_cqe *e, int n)
{
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&h->lock);
        sv_qp *q = qp_find(h, e[i].wc.qp_num);
        if (q) {
            pthread_mutex_lock(&q->lock);
            uint64_t *rel = e[i].recv ? &q->rq_released : &q->sq_released;
            uint64_t lim = e[i].recv ? q->rq_done : q->sq_done;
            if (e[i].seq + 1 > *rel && e[i].seq < lim)
                *rel = e[i].seq + 1;
            pthread_mutex_unlock(&q->lock);
        }
        pthread_mutex_unlock(&h->lock);
    }
}

static int sv_poll_cq(struct ibv_cq *ibcq, int num_entries, struct ibv_wc *wc)
{
    sv_cq *cq = (sv_cq *)ibcq;
    sv_hub *h = hub_of(ibcq->context);
    sv_cqe batch[32];
    int total = 0;
    while (total < num_entries) {
        int n = 0;
        pthread_mutex_lock(&cq->lock);
        while (n < 32 && total + n < num_entries && cq->count) {
            batch[n] = cq->ring[cq->head];
            wc[total + n] = batch[n].wc;
            cq->head = (cq->head + 1) % cq->cap;
            cq->count--;
            n++;
        }
        bool overflow = cq->overflow && cq->count == 0;
        pthread_mutex_unlock(&cq->lock);
        release_slots(h, batch, n);
        total += n;
        if (n == 0) {
            if (total == 0 && overflow)
                return -EOVERFLOW;
            break;
        }
    }
    return total;
}

/* ------------------------------------------------------------------ QP */

static struct ibv_qp *sv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    struct ibv_qp_cap cap = attr->cap;
    if (attr->qp_type != IBV_QPT_RC || attr->srq || !attr->send_cq || !attr->recv_cq ||
        attr->send_cq->context != pd->context || attr->recv_cq->context != pd->context ||
        cap.max_send_wr > SV_MAX_QP_WR || cap.max_recv_wr > SV_MAX_QP_WR ||
        cap.max_send_sge > SV_MAX_SGE || cap.max_recv_sge > SV_MAX_SGE ||
        cap.max_inline_data > SV_MAX_INLINE) {
        errno = EINVAL;
        return NULL;
    }
    if (cap.max_send_wr == 0)
        cap.max_send_wr = 1;
    if (cap.max_recv_wr == 0)
        cap.max_recv_wr = 1;
    if (cap.max_send_sge == 0)
        cap.max_send_sge = 1;
    if (cap.max_recv_sge == 0)
        cap.max_recv_sge = 1;
    pthread_mutex_lock(&g_lock);
    sv_qp *q = g_qp_free;
    if (q)
        g_qp_free = q->next_free;
    pthread_mutex_unlock(&g_lock);
    if (q)
        memset(q, 0, sizeof *q);
    else
        q = calloc(1, sizeof *q);
    if (!q) {
        errno = ENOMEM;
        return NULL;
    }
    q->sq = calloc(cap.max_send_wr, sizeof *q->sq);
    q->sq_sge = calloc((size_t)cap.max_send_wr * cap.max_send_sge, sizeof *q->sq_sge);
    q->sq_inl = cap.max_inline_data ? calloc(cap.max_send_wr, cap.max_inline_data) : NULL;
    q->rq = calloc(cap.max_recv_wr, sizeof *q->rq);
    q->rq_sge = calloc((size_t)cap.max_recv_wr * cap.max_recv_sge, sizeof *q->rq_sge);
    if (!q->sq || !q->sq_sge || (cap.max_inline_data && !q->sq_inl) || !q->rq || !q->rq_sge) {
        free(q->sq);
        free(q->sq_sge);
        free(q->sq_inl);
        free(q->rq);
        free(q->rq_sge);
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    sv_hub *h = hub_of(pd->context);
    q->hub = h;
    q->cap = cap;
    attr->cap = cap;
    q->sig_all = attr->sq_sig_all != 0;
    q->fd = -1;
    q->rnr_retry = 7;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
    q->qp.context = pd->context;
    q->qp.qp_context = attr->qp_context;
    q->qp.pd = pd;
    q->qp.send_cq = attr->send_cq;
    q->qp.recv_cq = attr->recv_cq;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_type = IBV_QPT_RC;
    pthread_mutex_init(&q->qp.mutex, NULL);
    pthread_cond_init(&q->qp.cond, NULL);
    __atomic_add_fetch(&((sv_cq *)attr->send_cq)->nqp, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&((sv_cq *)attr->recv_cq)->nqp, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&h->lock);
    q->qp.qp_num = h->next_qpn++ & 0xffffff;
    q->qp.handle = q->qp.qp_num;
    q->next = h->qps[q->qp.qp_num % SV_QP_BUCKETS];
    h->qps[q->qp.qp_num % SV_QP_BUCKETS] = q;
    pthread_mutex_unlock(&h->lock);
    obj_add(pd->context, 1);
    return &q->qp;
}

/* Stops the link: threads joined, connections closed. Caller holds no lock. */
static void qp_stop_io(sv_qp *q)
{
    pthread_mutex_lock(&q->lock);
    q->stop = true;
    if (q->fd >= 0)
        shutdown(q->fd, SHUT_RDWR);
    for (sv_conn *c = q->in; c; c = c->qp_next)
        shutdown(c->fd, SHUT_RDWR);
    pthread_cond_broadcast(&q->cond);
    bool js = q->has_sender, jr = q->has_receiver;
    q->has_sender = q->has_receiver = false;
    pthread_mutex_unlock(&q->lock);
    if (js)
        pthread_join(q->sender, NULL);
    if (jr)
        pthread_join(q->receiver, NULL);
    pthread_mutex_lock(&q->lock);
    while (q->in) /* responder threads unbind themselves on their way out */
        pthread_cond_wait(&q->cond, &q->lock);
    if (q->fd >= 0)
        close(q->fd);
    q->fd = -1;
    q->stop = false;
    pthread_mutex_unlock(&q->lock);
}

/* Connects to the remote hub and introduces the QP; -1 when it is not there
 * (that shows later as RETRY_EXC_ERR, as a silent peer would). */
static int qp_connect(sv_qp *q, uint32_t pid, uint32_t dev, uint32_t dest_qpn, uint32_t sgid)
{
    if (link_down(q->hub))
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un a;
    socklen_t al = sv_addr(&a, pid, dev);
    sv_hello hello = {.magic = SV_MAGIC,
                      .src_dev = (uint32_t)q->hub->dev->index,
                      .src_qpn = q->qp.qp_num,
                      .dst_qpn = dest_qpn,
                      .sgid_index = sgid};
    int r;
    do
        r = connect(fd, (struct sockaddr *)&a, al);
    while (r != 0 && errno == EINTR);
    if (r != 0 || send_all(fd, &hello, sizeof hello) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int sv_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr, int mask)
{
    sv_qp *q = (sv_qp *)ibqp;
    if ((mask & IBV_QP_STATE) && attr->qp_state == IBV_QPS_ERR)
        hold_point(SV_HOLD_MODIFY_ERR, q->hub->dev->index, ibqp->qp_num);
    pthread_mutex_lock(&q->lock);
    enum ibv_qp_state cur = q->qp.state;
    enum ibv_qp_state to = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
    pthread_mutex_unlock(&q->lock);

    if (to == IBV_QPS_RESET) {
        qp_stop_io(q);
        pthread_mutex_lock(&q->lock);
        /* No completions for what was queued; sequences keep counting so a
         * stale completion still in a CQ frees nothing. */
        q->sq_done = q->sq_resp = q->sq_sent = q->sq_released = q->sq_posted;
        q->rq_done = q->rq_released = q->rq_posted;
        q->link_dead = q->halted = false;
        q->reads_out = 0;
        q->qp.state = IBV_QPS_RESET;
        pthread_mutex_unlock(&q->lock);
        return 0;
    }
    if (to == IBV_QPS_ERR) {
        pthread_mutex_lock(&q->lock);
        qp_error(q);
        pthread_mutex_unlock(&q->lock);
        return 0;
    }
    if ((mask & IBV_QP_PORT) && attr->port_num != 1)
        return EINVAL;
    if ((mask & IBV_QP_ACCESS_FLAGS) &&
        (attr->qp_access_flags & ~(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                   IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)))
        return EINVAL;

    if (cur == IBV_QPS_RESET && to == IBV_QPS_INIT) {
        if ((mask & (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) !=
            (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
            return EINVAL;
    } else if (cur == IBV_QPS_INIT && to == IBV_QPS_INIT) {
        /* attribute change only */
    } else if (cur == IBV_QPS_INIT && to == IBV_QPS_RTR) {
        int need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        uint32_t pid, dev;
        if ((mask & need) != need || !attr->ah_attr.is_global || attr->ah_attr.port_num > 1 ||
            attr->path_mtu < IBV_MTU_256 || attr->path_mtu > IBV_MTU_4096 ||
            attr->max_dest_rd_atomic > g_rd_resp || attr->dest_qp_num > 0xffffff ||
            attr->ah_attr.grh.sgid_index >= SV_GIDS ||
            !sv_gid_parse(&attr->ah_attr.grh.dgid, &pid, &dev))
            return EINVAL;
        uint32_t sgid = attr->ah_attr.grh.sgid_index;
        /* Across IP subnets only RoCE v2 towards a routable address arrives;
         * the rest is dropped on the way (the first WR times out). */
        bool routed_ok = !g_routed || (sv_gid_type(sgid) == IBV_GID_TYPE_ROCE_V2 &&
                                       sv_gid_routable(&attr->ah_attr.grh.dgid));
        int fd = routed_ok ? qp_connect(q, pid, dev, attr->dest_qp_num, sgid) : -1;
        pthread_mutex_lock(&q->lock);
        if (q->qp.state != IBV_QPS_INIT) { /* raced with another modify */
            pthread_mutex_unlock(&q->lock);
            if (fd >= 0)
                close(fd);
            return EINVAL;
        }
        if (mask & IBV_QP_ACCESS_FLAGS)
            q->access = attr->qp_access_flags;
        q->dest_qpn = attr->dest_qp_num;
        q->dgid = attr->ah_attr.grh.dgid;
        q->sgid_index = sgid;
        q->max_dest_rd = attr->max_dest_rd_atomic;
        q->fd = fd;
        q->link_dead = fd < 0;
        q->halted = false;
        /* The sender runs even without a connection: it fails the WRs. */
        int err = pthread_create(&q->sender, NULL, sender_main, q);
        if (!err && fd >= 0 && (err = pthread_create(&q->receiver, NULL, receiver_main, q)) != 0) {
            q->stop = true;
            pthread_cond_broadcast(&q->cond);
            pthread_mutex_unlock(&q->lock);
            pthread_join(q->sender, NULL);
            pthread_mutex_lock(&q->lock);
            q->stop = false;
        }
        if (err) {
            if (fd >= 0)
                close(fd);
            q->fd = -1;
            pthread_mutex_unlock(&q->lock);
            return err;
        }
        q->has_sender = true;
        q->has_receiver = fd >= 0;
        q->qp.state = IBV_QPS_RTR;
        pthread_cond_broadcast(&q->cond); /* responder connections waiting for RTR */
        pthread_mutex_unlock(&q->lock);
        return 0;
    } else if (cur == IBV_QPS_RTR && to == IBV_QPS_RTS) {
        int need = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                   IBV_QP_MAX_QP_RD_ATOMIC;
        if ((mask & need) != need || attr->max_rd_atomic > g_rd_init)
            return EINVAL;
    } else if (cur == IBV_QPS_RTS && to == IBV_QPS_RTS) {
        /* attribute change only */
    } else {
        return EINVAL;
    }
    pthread_mutex_lock(&q->lock);
    if (q->qp.state != cur) {
        pthread_mutex_unlock(&q->lock);
        return EINVAL;
    }
    if (mask & IBV_QP_ACCESS_FLAGS)
        q->access = attr->qp_access_flags;
    if (mask & IBV_QP_RNR_RETRY)
        q->rnr_retry = attr->rnr_retry > 7 ? 7 : attr->rnr_retry;
    if (mask & IBV_QP_MAX_QP_RD_ATOMIC)
        q->max_rd = attr->max_rd_atomic;
    q->qp.state = to;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
    if (cur == IBV_QPS_RESET && to == IBV_QPS_INIT) {
        pthread_mutex_lock(&g_lock);
        if (g_init_dev == q->hub->dev->index) {
            g_init_dev = -1;
            event_push((sv_ctx *)ibqp->context, (enum ibv_event_type)g_init_type, ibqp,
                       g_init_delay);
        }
        pthread_mutex_unlock(&g_lock);
    }
    return 0;
}

static int sv_destroy_qp(struct ibv_qp *ibqp)
{
    sv_qp *q = (sv_qp *)ibqp;
    sv_hub *h = q->hub;
    pthread_mutex_lock(&h->lock);
    for (sv_qp **p = &h->qps[ibqp->qp_num % SV_QP_BUCKETS]; *p; p = &(*p)->next) {
        if (*p == q) {
            *p = q->next;
            break;
        }
    }
    pthread_mutex_lock(&q->lock);
    q->destroying = true;
    pthread_mutex_unlock(&q->lock);
    pthread_mutex_unlock(&h->lock);
    /* Its events not delivered yet are dropped (the kernel's are; here each
     * becomes a port event nobody acts on, async_fd keeps its count);
     * delivered ones are waited for. */
    pthread_mutex_lock(&g_lock);
    sv_ctx *c = (sv_ctx *)ibqp->context;
    for (int i = 0; i < c->nevents; i++)
        if (c->events[i].qp == ibqp)
            c->events[i] = (struct sv_event){IBV_EVENT_PORT_ACTIVE, NULL, 0};
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_lock(&ibqp->mutex);
    while (ibqp->events_completed != q->events_reported)
        pthread_cond_wait(&ibqp->cond, &ibqp->mutex);
    pthread_mutex_unlock(&ibqp->mutex);
    qp_stop_io(q); /* outstanding WRs are dropped: no completions after destroy */
    __atomic_sub_fetch(&((sv_cq *)ibqp->send_cq)->nqp, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&((sv_cq *)ibqp->recv_cq)->nqp, 1, __ATOMIC_RELAXED);
    obj_add(ibqp->context, -1);
    pthread_mutex_destroy(&q->lock);
    pthread_cond_destroy(&q->cond);
    pthread_mutex_destroy(&q->qp.mutex);
    pthread_cond_destroy(&q->qp.cond);
    free(q->sq);
    free(q->sq_sge);
    free(q->sq_inl);
    free(q->rq);
    free(q->rq_sge);
    pthread_mutex_lock(&g_lock);
    q->next_free = g_qp_free;
    g_qp_free = q;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static bool wr_op_ok(int op)
{
    return op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM || op == IBV_WR_SEND ||
           op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_READ;
}

/* Checks the local SGEs of a WR at post time (as the NIC would on fetch).
 * Caller holds q->lock. */
static enum ibv_wc_status local_check(sv_qp *q, const struct ibv_send_wr *wr, uint64_t *len)
{
    uint64_t total = 0;
    int access = wr->opcode == IBV_WR_RDMA_READ ? IBV_ACCESS_LOCAL_WRITE : 0;
    enum ibv_wc_status st = IBV_WC_SUCCESS;
    pthread_rwlock_rdlock(&q->hub->mr_lock);
    for (int i = 0; i < wr->num_sge; i++) {
        total += wr->sg_list[i].length;
        if (wr->sg_list[i].length && !(wr->send_flags & IBV_SEND_INLINE) &&
            !mr_check(q->hub, q->qp.pd, wr->sg_list[i].lkey, wr->sg_list[i].addr,
                      wr->sg_list[i].length, access))
            st = IBV_WC_LOC_PROT_ERR;
    }
    pthread_rwlock_unlock(&q->hub->mr_lock);
    *len = total;
    if (st == IBV_WC_SUCCESS && total > SV_MAX_MSG)
        st = IBV_WC_LOC_LEN_ERR;
    return st;
}

static int sv_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
    sv_qp *q = (sv_qp *)ibqp;
    int err = 0;
    pthread_mutex_lock(&g_lock);
    int fail_after = g_fail_post_after;
    g_fail_post_after = -1;
    bool refuse_in_error = g_refuse_in_error;
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_lock(&q->lock);
    uint64_t first = q->sq_posted;
    for (int taken = 0; wr; wr = wr->next, taken++) {
        if (taken == fail_after) {
            /* The hook: the WRs taken so far complete (unsignalled ones
             * silently) before the refusal is returned. */
            pthread_cond_broadcast(&q->cond);
            while (q->sq_done < first + (uint64_t)taken && q->qp.state != IBV_QPS_ERR)
                pthread_cond_wait(&q->cond, &q->lock);
            err = ENOMEM;
            break;
        }
        bool inl = (wr->send_flags & IBV_SEND_INLINE) != 0;
        if (q->qp.state != IBV_QPS_RTS && (q->qp.state != IBV_QPS_ERR || refuse_in_error))
            err = EINVAL;
        else if (!wr_op_ok(wr->opcode) || wr->num_sge < 0 ||
                 (uint32_t)wr->num_sge > q->cap.max_send_sge || (wr->num_sge && !wr->sg_list))
            err = EINVAL;
        else if (q->sq_posted - q->sq_released >= q->cap.max_send_wr)
            err = ENOMEM;
        if (err)
            break;
        uint64_t len;
        enum ibv_wc_status local = local_check(q, wr, &len);
        if (inl && (wr->opcode == IBV_WR_RDMA_READ || len > q->cap.max_inline_data)) {
            err = EINVAL;
            break;
        }
        uint64_t seq = q->sq_posted++;
        sv_swqe *w = &q->sq[seq % q->cap.max_send_wr];
        memset(w, 0, sizeof *w);
        w->wr_id = wr->wr_id;
        w->op = wr->opcode;
        w->len = len;
        w->imm = wr->imm_data;
        w->raddr = wr->wr.rdma.remote_addr;
        w->rkey = wr->wr.rdma.rkey;
        w->signaled = q->sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
        w->local = local;
        w->status = IBV_WC_SUCCESS;
        if (inl) {
            /* Inline data is copied now: the buffer is free when post returns. */
            uint8_t *dst = len ? q->sq_inl + (seq % q->cap.max_send_wr) * q->cap.max_inline_data
                               : NULL;
            for (int i = 0; i < wr->num_sge; i++) {
                if (!wr->sg_list[i].length)
                    continue;
                memcpy(dst, (const void *)(uintptr_t)wr->sg_list[i].addr, wr->sg_list[i].length);
                dst += wr->sg_list[i].length;
            }
            w->nsge = -1;
        } else {
            w->nsge = wr->num_sge;
            if (wr->num_sge)
                memcpy(sq_sges(q, seq), wr->sg_list, (size_t)wr->num_sge * sizeof *wr->sg_list);
        }
        if (q->qp.state == IBV_QPS_ERR) {
            sq_complete(q, seq, IBV_WC_WR_FLUSH_ERR);
            q->sq_done = q->sq_resp = q->sq_sent = q->sq_posted;
        }
    }
    if (err && bad_wr)
        *bad_wr = wr;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
    return err;
}

static int sv_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
    sv_qp *q = (sv_qp *)ibqp;
    int err = 0;
    pthread_mutex_lock(&q->lock);
    for (; wr; wr = wr->next) {
        if (q->qp.state == IBV_QPS_RESET)
            err = EINVAL;
        else if (wr->num_sge < 0 || (uint32_t)wr->num_sge > q->cap.max_recv_sge ||
                 (wr->num_sge && !wr->sg_list))
            err = EINVAL;
        else if (q->rq_posted - q->rq_released >= q->cap.max_recv_wr)
            err = ENOMEM;
        if (err)
            break;
        uint64_t seq = q->rq_posted++;
        sv_rwqe *r = &q->rq[seq % q->cap.max_recv_wr];
        r->wr_id = wr->wr_id;
        r->nsge = wr->num_sge;
        if (wr->num_sge)
            memcpy(rq_sges(q, seq), wr->sg_list, (size_t)wr->num_sge * sizeof *wr->sg_list);
        if (q->qp.state == IBV_QPS_ERR) {
            rq_complete(q, seq, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
            q->rq_done = q->rq_posted;
        }
    }
    if (err && bad_wr)
        *bad_wr = wr;
    pthread_cond_broadcast(&q->cond); /* a responder may wait for a receive */
    pthread_mutex_unlock(&q->lock);
    return err;
}

/* ------------------------------------------------------------------ exports */

/* Test hook: the next post_send on any QP takes `after` WRs, waits until
 * they completed, then refuses the rest with ENOMEM (a provider whose queue
 * accounting differs from ours; the worst case of a partial post). */
SV_EXPORT void axf_softverbs_fail_next_post(int after)
{
    pthread_once(&g_once, sv_init);
    pthread_mutex_lock(&g_lock);
    g_fail_post_after = after;
    pthread_mutex_unlock(&g_lock);
}

/* Test hook: device `dev` dies (as on a firmware crash or a pulled card):
 * its links are cut, it never completes anything again (no flushes either),
 * and every context open on it gets IBV_EVENT_DEVICE_FATAL. */
SV_EXPORT int axf_softverbs_device_fatal(const char *dev)
{
    pthread_once(&g_once, sv_init);
    sv_device *d = NULL;
    for (int i = 0; i < g_ndev; i++)
        if (dev && strcmp(g_devs[i].dev.name, dev) == 0)
            d = &g_devs[i];
    if (!d)
        return -ENODEV;
    __atomic_store_n(&d->fatal, 1, __ATOMIC_RELEASE);
    axf_softverbs_set_link(dev, 0);
    pthread_mutex_lock(&g_lock);
    for (sv_ctx *c = g_ctxs; c; c = c->next_ctx)
        if (c->ctx.device == &d->dev)
            event_push(c, IBV_EVENT_DEVICE_FATAL, NULL, 0);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static pthread_mutex_t g_omit_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_omit[8][32]; /* axf_softverbs_omit */

SV_EXPORT int axf_verbs_provider(axf_verbs_table *t)
{
    if (!t)
        return -EINVAL;
    pthread_once(&g_once, sv_init);
    memset(t, 0, sizeof *t);
    t->version = AXF_VERBS_TABLE_VERSION;
    t->provider = "softverbs";
    t->get_device_list = sv_get_device_list;
    t->free_device_list = sv_free_device_list;
    t->get_device_name = sv_get_device_name;
    t->open_device = sv_open_device;
    t->close_device = sv_close_device;
    t->query_device = sv_query_device;
    t->query_port = sv_query_port;
    t->query_gid = sv_query_gid;
    t->alloc_pd = sv_alloc_pd;
    t->dealloc_pd = sv_dealloc_pd;
    t->reg_mr = sv_reg_mr;
    t->reg_dmabuf_mr = sv_reg_dmabuf_mr;
    t->query_gid_type = sv_query_gid_type;
    t->get_async_event = sv_get_async_event;
    t->ack_async_event = sv_ack_async_event;
    t->dereg_mr = sv_dereg_mr;
    t->create_comp_channel = sv_create_comp_channel;
    t->destroy_comp_channel = sv_destroy_comp_channel;
    t->create_cq = sv_create_cq;
    t->destroy_cq = sv_destroy_cq;
    t->req_notify_cq = sv_req_notify_cq;
    t->get_cq_event = sv_get_cq_event;
    t->ack_cq_events = sv_ack_cq_events;
    t->poll_cq = sv_poll_cq;
    t->create_qp = sv_create_qp;
    t->modify_qp = sv_modify_qp;
    t->destroy_qp = sv_destroy_qp;
    t->post_send = sv_post_send;
    t->post_recv = sv_post_recv;
    /* A provider that leaves entries out (axf_softverbs_omit): the loader
     * must refuse it, naming the entry, rather than crash at its first use. */
    pthread_mutex_lock(&g_omit_lock);
    for (size_t i = 0; i < sizeof g_omit / sizeof g_omit[0] && g_omit[i][0]; i++) {
#define OMIT(f)                                                                                    \
    if (!strcmp(g_omit[i], #f))                                                                    \
        t->f = NULL;
        OMIT(get_device_list) OMIT(free_device_list) OMIT(get_device_name) OMIT(open_device)
        OMIT(close_device) OMIT(query_device) OMIT(query_port) OMIT(query_gid) OMIT(alloc_pd)
        OMIT(dealloc_pd) OMIT(reg_mr) OMIT(reg_dmabuf_mr) OMIT(query_gid_type)
        OMIT(get_async_event) OMIT(ack_async_event) OMIT(dereg_mr) OMIT(create_comp_channel)
        OMIT(destroy_comp_channel) OMIT(create_cq) OMIT(destroy_cq) OMIT(req_notify_cq)
        OMIT(get_cq_event) OMIT(ack_cq_events) OMIT(poll_cq) OMIT(create_qp) OMIT(modify_qp)
        OMIT(destroy_qp) OMIT(post_send) OMIT(post_recv)
#undef OMIT
    }
    pthread_mutex_unlock(&g_omit_lock);
    return 0;
}

/* The next tables axf_verbs_provider fills leave out the entries named in
 * `names` (comma-separated table field names; NULL or "" for none). */
SV_EXPORT void axf_softverbs_omit(const char *names)
{
    pthread_mutex_lock(&g_omit_lock);
    memset(g_omit, 0, sizeof g_omit);
    for (size_t i = 0; names && *names && i < sizeof g_omit / sizeof g_omit[0]; i++) {
        size_t n = strcspn(names, ",");
        snprintf(g_omit[i], sizeof g_omit[i], "%.*s", (int)n, names);
        names += n + (names[n] == ',');
    }
    pthread_mutex_unlock(&g_omit_lock);
}

/* Cuts (up = 0) or restores (up = 1) the link of device `dev` in this process:
 * while down, every connection of its QPs fails as a cut cable would
 * (outstanding WRs RETRY_EXC_ERR, then flush), new connections are refused
 * and query_port reports DOWN. QPs that lost their link stay dead; new QPs
 * work once it is up. Returns 0, or -ENODEV. */
SV_EXPORT int axf_softverbs_set_link(const char *dev, int up)
{
    pthread_once(&g_once, sv_init);
    sv_device *d = NULL;
    for (int i = 0; i < g_ndev; i++)
        if (dev && strcmp(g_devs[i].dev.name, dev) == 0)
            d = &g_devs[i];
    if (!d)
        return -ENODEV;
    __atomic_store_n(&d->link_down, up ? 0 : 1, __ATOMIC_RELEASE);
    if (up)
        return 0;
    pthread_mutex_lock(&g_lock);
    sv_hub *h = g_hubs_pid == getpid() ? g_hubs[d->index] : NULL;
    if (h) {
        pthread_mutex_lock(&h->lock);
        for (int i = 0; i < SV_QP_BUCKETS; i++) {
            for (sv_qp *q = h->qps[i]; q; q = q->next) {
                pthread_mutex_lock(&q->lock);
                if (q->fd >= 0)
                    shutdown(q->fd, SHUT_RDWR);
                for (sv_conn *c = q->in; c; c = c->qp_next)
                    shutdown(c->fd, SHUT_RDWR);
                q->link_dead = true;
                pthread_cond_broadcast(&q->cond);
                pthread_mutex_unlock(&q->lock);
            }
        }
        for (sv_conn *c = h->conns; c; c = c->next)
            shutdown(c->fd, SHUT_RDWR);
        pthread_mutex_unlock(&h->lock);
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* The device named dev, or NULL. */
static sv_device *dev_named(const char *dev)
{
    pthread_once(&g_once, sv_init);
    for (int i = 0; i < g_ndev; i++)
        if (dev && strcmp(g_devs[i].dev.name, dev) == 0)
            return &g_devs[i];
    return NULL;
}

/* QP qpn of device d in this process (g_lock held; its hub's lock taken and
 * returned held in *hub), or NULL. */
static sv_qp *qp_named(sv_device *d, uint32_t qpn, sv_hub **hub)
{
    sv_hub *h = g_hubs_pid == getpid() ? g_hubs[d->index] : NULL;
    *hub = h;
    if (!h)
        return NULL;
    pthread_mutex_lock(&h->lock);
    sv_qp *q = qp_find(h, qpn);
    if (!q)
        pthread_mutex_unlock(&h->lock);
    return q;
}

/* Test hook: QP qpn of device dev raises asynchronous events types[0..n)
 * (IBV_EVENT_QP_FATAL, ...: a NIC reports a QP that failed on its own), in
 * that order and all at once, on the context that created it. Returns 0, or
 * -ENODEV / -ENOENT. */
SV_EXPORT int axf_softverbs_qp_events(const char *dev, uint32_t qpn, const int *types, int n)
{
    sv_device *d = dev_named(dev);
    if (!d)
        return -ENODEV;
    pthread_mutex_lock(&g_lock);
    sv_hub *h;
    sv_qp *q = qp_named(d, qpn, &h);
    if (q) {
        for (int i = 0; i < n; i++)
            event_push((sv_ctx *)q->qp.context, (enum ibv_event_type)types[i], &q->qp, 0);
        pthread_mutex_unlock(&h->lock);
    }
    pthread_mutex_unlock(&g_lock);
    return q ? 0 : -ENOENT;
}

/* Test hook: the next QP of device dev that reaches INIT raises event `type`
 * as it does, delivered by get_async_event no sooner than delay_ms later (a
 * NIC reports asynchronously: the event may come before its QP is known). */
SV_EXPORT int axf_softverbs_qp_event_at_init(const char *dev, int type, int delay_ms)
{
    sv_device *d = dev_named(dev);
    if (!d)
        return -ENODEV;
    pthread_mutex_lock(&g_lock);
    g_init_dev = d->index;
    g_init_type = type;
    g_init_delay = delay_ms;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Test hook: asynchronous events delivered by get_async_event so far (in
 * this process). */
SV_EXPORT uint64_t axf_softverbs_events_taken(void)
{
    return __atomic_load_n(&g_events_taken, __ATOMIC_ACQUIRE);
}

/* Test hook: whether QP qpn of device dev exists (not destroyed). */
SV_EXPORT int axf_softverbs_qp_exists(const char *dev, uint32_t qpn)
{
    sv_device *d = dev_named(dev);
    if (!d)
        return -ENODEV;
    pthread_mutex_lock(&g_lock);
    sv_hub *h;
    sv_qp *q = qp_named(d, qpn, &h);
    if (q)
        pthread_mutex_unlock(&h->lock);
    pthread_mutex_unlock(&g_lock);
    return q != NULL;
}

/* Test hook: post_send on a QP in the error state refuses (EINVAL) instead of
 * flushing what it is given (on = 1), as some providers do; 0: flushes. */
SV_EXPORT void axf_softverbs_refuse_post_in_error(int on)
{
    pthread_once(&g_once, sv_init);
    pthread_mutex_lock(&g_lock);
    g_refuse_in_error = on != 0;
    pthread_mutex_unlock(&g_lock);
}

/* Test hook: parks one call at its entry until axf_softverbs_release():
 * what = 1: the next modify_qp to ERR of QP qpn of device dev (a slow
 * firmware command); what = 2: the next reg_dmabuf_mr (dev, qpn unused);
 * what = 3: the next ack_async_event, once it has acknowledged (the event's
 * QP may be destroyed from then on; dev, qpn unused).
 * axf_softverbs_held() says whether a call is parked now. */
SV_EXPORT int axf_softverbs_hold(int what, const char *dev, uint32_t qpn)
{
    sv_device *d = what == SV_HOLD_MODIFY_ERR ? dev_named(dev) : NULL;
    if (what == SV_HOLD_MODIFY_ERR && !d)
        return -ENODEV;
    if (what != SV_HOLD_MODIFY_ERR && what != SV_HOLD_REG_DMABUF && what != SV_HOLD_ACK_ASYNC)
        return -EINVAL;
    pthread_mutex_lock(&g_hold_lock);
    g_hold_what = what;
    g_hold_dev = d ? d->index : -1;
    g_hold_qpn = qpn;
    g_released = false;
    pthread_mutex_unlock(&g_hold_lock);
    return 0;
}

SV_EXPORT int axf_softverbs_held(void)
{
    return __atomic_load_n(&g_held_flag, __ATOMIC_RELAXED);
}

/* Releases the parked call (if any) and disarms the hold; returns once the
 * parked call has gone on. */
SV_EXPORT void axf_softverbs_release(void)
{
    pthread_mutex_lock(&g_hold_lock);
    g_hold_what = SV_HOLD_NONE;
    if (g_held) {
        g_released = true;
        pthread_cond_broadcast(&g_hold_cond);
        while (g_held)
            pthread_cond_wait(&g_hold_cond, &g_hold_lock);
    }
    pthread_mutex_unlock(&g_hold_lock);
}

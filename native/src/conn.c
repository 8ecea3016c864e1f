/* The framed socket transport. Each connection has a receiver thread (blocking
 * reads, zero-copy into registered memory) and a sender thread (gathered
 * sendmsg from registered memory, keepalive pings when control.c says). The accepting
 * side checks every frame against its region table before touching memory.
 * A request's small chunks travel several to a frame (vectored frames: a
 * segment table after the header, every segment checked before one
 * scattered read; tcp.c packs them). */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#ifdef AXF_TCP_TRACE
#include <sys/mman.h>
#endif

#ifdef AXF_TCP_TRACE
typedef struct tr_rec {
    uint64_t ns, op, a;
    uint32_t tid;
    uint8_t ev, cpu;
    int16_t fd;
} tr_rec;
#define TR_CAP (1u << 21)
static tr_rec *tr_buf;
static atomic_size_t tr_n;
static pthread_once_t tr_once = PTHREAD_ONCE_INIT;

static void tr_open(void)
{
    /* The snapshot's (engine.c axf_env_read), not getenv, read in place: no
     * 8 KiB on the stack of the connection thread that traces first. */
    axf_env env;
    axf_env_take(&env, false);
    const char *dir = axf_env_wide(&env, AXF_ENV_TCP_TRACE);
    char *path = NULL;
    if (!dir || asprintf(&path, "%s/trace.%d", dir, (int)getpid()) < 0)
        path = NULL;
    axf_env_release(&env);
    if (!path)
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    free(path);
    if (fd < 0)
        return;
    if (ftruncate(fd, (off_t)(TR_CAP * sizeof(tr_rec))) == 0) {
        void *m = mmap(NULL, TR_CAP * sizeof(tr_rec), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED)
            tr_buf = m;
    }
    close(fd);
}

void axf_trace(uint32_t ev, int fd, uint64_t op, uint64_t a)
{
    static _Thread_local uint32_t tid;
    pthread_once(&tr_once, tr_open);
    if (!tr_buf)
        return;
    size_t i = atomic_fetch_add(&tr_n, 1);
    if (i >= TR_CAP)
        return;
    if (!tid)
        tid = (uint32_t)syscall(SYS_gettid);
    tr_buf[i] = (tr_rec){.ns = axf_now_ns(), .op = op, .a = a, .tid = tid, .ev = (uint8_t)ev,
                         .cpu = (uint8_t)sched_getcpu(), .fd = (int16_t)fd};
}
#endif

#define TX_BATCH 64
#define TX_IOV (2 * TX_BATCH + AXF_MAX_SEGS) /* a sendmsg's iovecs at most */
/* A sending thread's batch holds no more than this many bytes (one frame
 * at least): what it took off the queue is committed to one blocking
 * sendmsg, so what stays queued is what a joining connection can take over
 * (conn_spread). Two default chunks: a batch's vectored 1 MiB frames were
 * two to a batch already (TX_IOV); plain 1 MiB frames went 64 at a time. */
#define TX_BATCH_BYTES (2u << 20)
#define INLINE_SEND ((64u << 10) + 4096u) /* small frames sent on the caller's thread, in all */
#define INLINE_BULK ((1u << 20) + 4096u)  /* or one frame this large, alone */
#define RATE_WINDOW_US 20000u   /* rate samples span at least this much busy time */
#define DISCARD_BYTES (64u << 10)
#define TX_LAZY_MS 20u /* a quiet connection starts its sending thread after this */
#define RX_AHEAD 4096u /* read ahead of a frame's end: the next one's header, usually */
#define RX_STREAM_MIN (128u << 10) /* a large payload is polled for ... */
#define RX_STREAM_IDLE_US 50u      /* ... while its bytes come (pauses under this) */
#define RX_SPIN_MIN_US 10u /* a target's poll lasts twice the requests' average gap and this */
#define ACK_NOW_MIN (128u << 10) /* a READ's lone response this large is acknowledged at once */
#define HELP_PARK_US 1000u /* an initiator's receiver parks while replies were read for it
                              (or could have been) this recently (conn_help) ... */
#define HELP_BYTES_MAX (128u << 10) /* ... replies to groups up to this large */
#define HELP_READ_MAX (16u << 10) /* a READ's response, of a request alone, read by a spinner */
#define HELP_READ_LOOP_MAX (1u << 20) /* ... on a loop_cc connection (help_resp) */
#define HELP_STALL_US 50u /* ... whose payload, still coming, stopped coming (help_more) */
#define HELP_LOOP_MAX (1u << 20) /* ... and WRITE acks of groups up to this on a loop_cc
                                    connection (help_ack) */
/* Larger groups' replies (a lone 1 MiB request's two 512 KiB halves) stay
 * the receivers': measured through Python (aioxfer bench, 1 MiB WRITEs one
 * at a time, 5 alternated runs), p50 271 us read by the spinner against 238
 * us by the receivers; the spinner peeks two sockets every few microseconds
 * for ~200 us while the peer's receivers need the CPUs for the copies. */

/* conn->rx_hold: who reads an initiator connection's socket. */
enum { RX_SELF, RX_PARKED, RX_HELPER };

/* rx reason for a goodbye: the connection ends, nothing went wrong. */
static const char BYE_REASON[] = "goodbye";

/* What the initiator expects back on one connection, in order: one entry
 * per request group (or notification) queued on it, which says how to send
 * the group again elsewhere should the connection fail first. */
typedef struct expect {
    op *op;
    uint64_t op_id;
    uint16_t type;     /* FR_WRITE_ACK, FR_READ_RESP (or READV_RESP) or FR_NOTIFY_ACK */
    int slot;          /* the group: chunks of this connection in the op's schedule ... */
    chunk_ref *chunks; /* ... or these (a rerouted group) */
    size_t nchunks;
    uint64_t bytes;    /* READ: received so far; counted only once the group is whole */
    uint64_t req_bytes; /* what the group asks for: all it ever reports (never the
                           peer's word); cut by conn_spread (c.mu) */
    uint32_t frames;   /* a data group's frames, queued or sent (conn_spread) */
    size_t count;      /* a data group's chunks: its first count of slot's or of chunks
                          (conn_spread moves its tail elsewhere); c.mu, e->mu to cut */
    bool failed;       /* READ: a response said the group failed (its bytes fall short) */
    uint64_t t_enq;    /* queued at (us): for the rate measurement */
    struct expect *next;
} expect;

typedef struct conn_priv {
    conn c;
    expect *ex_head, *ex_tail; /* guarded by c.mu */
    bool ex_lost;              /* c.mu: an expectation could not be recorded */
    /* The receiver's own (rx_read): bytes read past the frame it served,
     * rb_len of them from rb + rb_pos; and a READ response queued but not yet
     * sent, held while the next frame (here already) is another READ request. */
    uint32_t rb_pos, rb_len;
    bool kick_owed;
    bool tcp; /* a TCP socket (conn_start), not a unix-domain one: TCP options apply */
    /* c.mu: its sending thread is counted (c.threads) but not started yet
     * (tx_wake starts it). Only conn_open's connections have one to start. */
    atomic_bool tx_owed;
    /* The one-copy send (tcp18, initiator tcp connections only): spl_ok,
     * this connection splices (the kernel said that the peer's socket is
     * our uid's over loopback: spl_v, decided off the connect's path;
     * set by whoever holds c->sending, under c.mu, before its first
     * spliced byte, never cleared); its pipe (spl_fd), made on first use
     * (spl_pipe; spl_nopipe: it could not be, this connection copies), and
     * spl_in, bytes of the head frame in that pipe and not yet in the
     * socket (not counted in its sent): they go first. The pipe's fields
     * belong to whoever holds c->sending. */
    bool spl_ok, spl_pipe, spl_nopipe;
    atomic_int spl_v; /* SPL_V_*: the kernel's verdict on splicing (spl_decide) */
    int spl_fd[2];
    uint32_t spl_in;
    /* Spliced pages still owed (tcp26, "one-copy send": the release rule):
     * one entry per spliced frame sent, holding its op's memory, until the
     * group's acknowledgement says the peer read it, or the connection's
     * end finds them read or dropped (spl_settle: spl_settled set, entries
     * that come later are settled at once). c.mu. The tuple sock_diag is
     * asked about (conn_path: the socket may be reset by then). */
    sq_item *spl_holds;
    bool spl_settled;
    /* Spliced items an inline sender (conn_kick) took off the queue as sent
     * and releases after unlocking c.mu (tcp27): spl_settle waits for them
     * to be kept or released first, else they would find the connection
     * settled with nothing held and go at once, the peer not done with
     * their pages (rev18b's bug in a window of microseconds). c.mu; c.cv
     * broadcast when it drops to 0 while spl_settle waits for it
     * (spl_late_wait), and only then: c.cv is also the sending thread's, and
     * a broadcast per spliced inline send woke that idle thread for nothing
     * (spl29: ~1 voluntary switch per lone spliced WRITE). */
    uint32_t spl_late, spl_late_wait;
    struct sockaddr_storage spl_me, spl_peer;
    /* A connection that may splice waits for room in slices (send_waits):
     * when its blocked send's wait began (ms; 0: it moved since). Whoever
     * holds c->sending owns it. */
    uint64_t snd_wait0;
    /* A lone READ's response taken by a spinner as it comes (help_more):
     * its header (read, checked by help_takes) and mid_have bytes of its
     * payload copied to their destination, the last of them at mid_since.
     * Whoever holds the socket (rx_hold) owns these; the receiver handed it
     * back finishes the frame (rx_loop, rx_initiator). */
    bool mid;
    wire_hdr mid_h;
    uint64_t mid_have, mid_since;
    uint8_t rb[RX_AHEAD];
} conn_priv;

static bool spl_keep(conn *c, sq_item *it);

#define SPL_SNDTIMEO_MS 100u /* a splicing connection's send timeout slice (send_waits) */

/* The send timeout ka_arm_socket arms: the stall time, or the peer timeout. */
static uint32_t snd_armed_ms(const conn *c)
{
    const axf_config *cfg = &c->e->cfg;
    return cfg->stall_ms && cfg->stall_ms < cfg->peer_timeout_ms ? cfg->stall_ms
                                                                 : cfg->peer_timeout_ms;
}

static void expect_free(expect *x)
{
    free(x->chunks);
    free(x);
}

sq_item *sq_new(int type, uint64_t op_id)
{
    sq_item *it = calloc(1, sizeof *it);
    if (!it)
        return NULL;
    it->h.magic = AXF_MAGIC;
    it->h.type = (uint16_t)type;
    it->h.op = op_id;
    return it;
}

static void sq_release(axf_engine *e, sq_item *it)
{
    if (it->reg)
        region_unref(e, it->reg);
    for (uint32_t j = 0; j < it->nregs; j++)
        region_unref(e, it->regs[j]);
    free(it->owned);
    free(it->chunks);
    it->owned = NULL;
    it->chunks = NULL;
    if (it->spl_c) { /* spliced: the item may stay as a hold on its op's memory */
        conn *c = it->spl_c;
        op *o = it->op;
        it->spl_c = NULL;
        bool kept = o && spl_keep(c, it);
        conn_unref(c); /* a kept item is the connection's: its threads' reference holds it */
        if (kept) {
            /* Its pin given back (spl28): the op may be over now, its
             * memory held by the kept item (op.mem). The item may be gone
             * already (released by another thread); o is not: this pin. */
            op_unpin(e, o);
            return;
        }
    }
    if (it->op)
        op_unpin(e, it->op);
    free(it);
}

void sq_drop(axf_engine *e, sq_item *it)
{
    sq_release(e, it);
}

/* Releases a list of items (linked by next) with no lock held: releasing
 * may finish an op. */
static void release_list(axf_engine *e, sq_item *it)
{
    while (it) {
        sq_item *n = it->next;
        sq_release(e, it);
        it = n;
    }
}

/* An item's bytes on the wire: header, segment table (vectored), payload. */
static uint64_t item_size(const sq_item *it)
{
    return sizeof it->h + (uint64_t)it->h.nseg * sizeof(wire_seg) + it->plen;
}

/* The iovecs of what of an item is not sent yet (past it->sent), at most max
 * of them: how many, or -1 when they do not fit. *pay: the first of them
 * that is payload (after the header and segment table). */
static int item_iov(const sq_item *it, struct iovec *iov, int max, int *pay)
{
    uint64_t skip = it->sent;
    int n = 0;
#define PUT(b, l)                                                          \
    do {                                                                   \
        uint64_t l_ = (l);                                                 \
        if (skip >= l_) {                                                  \
            skip -= l_;                                                    \
        } else {                                                           \
            if (n == max)                                                  \
                return -1;                                                 \
            iov[n].iov_base = (uint8_t *)(uintptr_t)(b) + skip;            \
            iov[n++].iov_len = l_ - skip;                                  \
            skip = 0;                                                      \
        }                                                                  \
    } while (0)
    PUT(&it->h, sizeof it->h);
    if (it->h.nseg)
        PUT(it->segs, (uint64_t)it->h.nseg * sizeof(wire_seg));
    *pay = n;
    if (it->h.nseg) {
        for (uint32_t j = 0; it->pieces && j < it->h.nseg; j++)
            PUT(it->pieces[j], it->segs[j].len);
    } else if (it->plen) {
        PUT(it->payload, it->plen);
    }
#undef PUT
    return n;
}

/* c->mu held. */
/* ------------------------------------------------ replies read by a spinner
 *
 * A request awaited alone: the thread that awaits it spins in axf_wait for
 * its completion while the peer answers, and the reply used to be read by
 * this connection's receiver, asleep in recv and woken for it: on 2 CPUs a
 * third thread wanting a CPU beside the spinner and the peer's receiver (a
 * scheduling round trip per reply, two for a 1 MiB request's halves). Now a
 * receiver that has just read a WRITE's or a small READ's reply while a
 * thread spun in axf_wait parks (a futex, not the socket: the reply wakes
 * nobody), and the spinner reads the next replies itself (conn_help): a
 * whole WRITE acknowledgement that matches what the connection expects next
 * (a header, no payload, peeked first), or the one response of a READ
 * request alone up to HELP_READ_MAX once all of its payload is readable
 * (help_takes, read_alone); anything else (a ping, a larger or partial READ
 * response, a malformed frame, the peer's close, an error) hands the socket
 * back to the receiver, which serves it as always. Parked for as long as replies (to
 * groups up to HELP_BYTES_MAX) were read for it within HELP_PARK_US (a
 * spinner that stops without its completion hands back at once:
 * conn_help_end), and never while a frame read ahead waits (rb_len), or in
 * progress mode "sleep". rx_hold says who
 * reads: RX_SELF the receiver; RX_PARKED nobody (a spinner may take it);
 * RX_HELPER a spinner, under e->help_mu. */
static void futex_wait_us(atomic_int *w, int val, uint64_t us)
{
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000u),
                          .tv_nsec = (long)(us % 1000000u) * 1000L};
    (void)syscall(SYS_futex, (int *)w, FUTEX_WAIT_PRIVATE, val, &ts, NULL, 0);
}

static void futex_wake(atomic_int *w)
{
    (void)syscall(SYS_futex, (int *)w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* A parked receiver reads its socket again (its connection is dying, or no
 * thread spins any more). */
static void rx_unpark(conn *c)
{
    int parked = RX_PARKED;
    if (atomic_compare_exchange_strong(&c->rx_hold, &parked, RX_SELF))
        futex_wake(&c->rx_hold);
}

static void conn_mark_dead(conn *c)
{
    if (c->dead) {
        /* Dead after our goodbye, its receiver still reading (conn_bye_out):
         * now cut both ways. Its receiver's own exit comes here too (rx_main's
         * conn_kill, before the fd is closed), so the fd is never touched
         * once closed. */
        if (c->bye_linger) {
            c->bye_linger = false;
            shutdown(c->fd, SHUT_RDWR);
        }
        return;
    }
    c->dead = true;
    atomic_store(&c->down, true);
    if (c->ep)
        ep_conns_changed(c->ep);
    /* Wakes both threads out of their syscalls (a send waits SO_SNDTIMEO at
     * most, then sees it down). A connection that may splice shuts only its
     * reading side here, the rest at its close (thread_exit, after
     * spl_settle): a FIN of ours with reading shut makes our kernel answer
     * the peer's next bytes with a reset, which unhashes the peer's socket
     * (sock_diag no longer finds it) while its receive queue, our spliced
     * pages in it, stays readable. */
    /* Except at the engine's shutdown (conn_kill under e->mu, which set
     * e->shut; read atomically for the callers that do not hold it): a
     * sending thread then sits out SO_SNDTIMEO (peer_timeout, 5 s by
     * default; one call after another) in a send to a stopped peer, and the
     * shutdown, on the caller's thread (Agent.aclose: the event loop's),
     * waits for it: 10-16 s measured (rev27), against 0 s with splice off.
     * spl_settle gives up a second after the shutdown anyway. */
    bool rd_only = ((conn_priv *)c)->spl_ok && !__atomic_load_n(&c->e->shut, __ATOMIC_RELAXED);
    shutdown(c->fd, rd_only ? SHUT_RD : SHUT_RDWR);
    pthread_cond_broadcast(&c->room_cv); /* and a receiver paused for room */
    rx_unpark(c); /* and one parked for a spinning thread (conn_help) */
}

/* c->mu held: our goodbye is in the socket, the connection ends. Shut for
 * writing only (a FIN after the goodbye), not for reading: the kernel
 * resets a TCP socket shut for reading that receives data (RFC 1122;
 * Linux: TCPAbortOnData), and the reset drops what is still queued to
 * send: the tail of the frame and the goodbye, for a slow reader that
 * pinged or a peer that pipelined another request meanwhile (native
 * test_rev24_bye_tcp: a loss). So the receiver reads on, dropping what it
 * reads (rx_drain: nothing is served after the goodbye), until the peer,
 * having read the goodbye, closes (or falls silent for the peer timeout);
 * any later kill (engine shutdown, a revocation's deadline) cuts it both
 * ways at once (conn_mark_dead). */
static void conn_bye_out(conn *c)
{
    if (c->dead)
        return;
    c->dead = true;
    atomic_store(&c->bye_said, true);
    atomic_store(&c->down, true);
    c->bye_linger = true;
    shutdown(c->fd, SHUT_WR);
    pthread_cond_broadcast(&c->room_cv); /* a receiver paused for room reads on */
}

void conn_ref(conn *c)
{
    atomic_fetch_add(&c->refs, 1);
}

void conn_unref(conn *c)
{
    if (atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    /* Nothing queues on it any more: its sender released its queue, and a
     * frame queued on a dead connection is released at once. */
    conn_priv *p = (conn_priv *)c;
    for (sq_item *it = c->head, *in; it; it = in) {
        in = it->next;
        free(it->owned);
        free(it->chunks);
        free(it);
    }
    for (expect *x = p->ex_head, *xn; x; x = xn) {
        xn = x->next;
        expect_free(x);
    }
    if (c->pidfd >= 0)
        close(c->pidfd);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->room_cv);
    free(p);
}

void conn_registry_drop(axf_engine *e, conn *c)
{
    conn **pp = &e->conns;
    while (*pp && *pp != c)
        pp = &(*pp)->next_all;
    if (!*pp)
        return;
    *pp = c->next_all;
    c->next_all = NULL;
    conn_unref(c);
}

/* May the receiver read the next frame? (Exact under c->mu.) */
static bool rx_has_room(const conn *c)
{
    const axf_config *cfg = &c->e->cfg;
    return atomic_load(&c->reply_bytes) < cfg->reply_queue_bytes &&
           (cfg->max_notify_per_conn == UINT32_MAX ||
            atomic_load(&c->notify_out) < cfg->max_notify_per_conn);
}

void conn_room(conn *c)
{
    if (c->rx_paused && rx_has_room(c))
        pthread_cond_broadcast(&c->room_cv);
}

/* The receiver stops reading (TCP flow control pushes back on the peer)
 * while this connection's replies or undelivered notifications are at their
 * bound. Our liveness check is a receive timeout, so a paused receiver is
 * never declared silent; our sender keeps sending keepalives meanwhile. */
/* The engine's test-only faults (axf_mock_faults sets them while the
 * connections' threads run): read atomically, as the tests set them (the
 * sending thread reads them at each wake-up, spl29: a plain read beside the
 * test's store was a data race, ThreadSanitizer failing test_rails and
 * test_spl29_kick_wake in .ci/run's TSan step). */
static inline const axf_faults *faults_of(axf_engine *e)
{
    return __atomic_load_n(&e->faults, __ATOMIC_ACQUIRE);
}

static void tx_wake(conn *c);

static void rx_wait_room(conn *c)
{
    if (rx_has_room(c)) /* the usual case: no lock */
        return;
    pthread_mutex_lock(&c->mu);
    /* Our keepalives must go on while we hold the peer back, and the lazily
     * started sender is otherwise started by this receiver only between
     * reads (rx_await), which a paused receiver never reaches: a receiver
     * that had answered everything inline paused with no sender, sent no
     * ping, and its peer declared it silent (test_limits test_notify_credit
     * on an idle machine, every run). */
    if (atomic_load(&((conn_priv *)c)->tx_owed))
        tx_wake(c);
    while (!c->dead && !atomic_load(&c->bye_said) && !rx_has_room(c)) {
        c->rx_paused = true;
        pthread_cond_wait(&c->room_cv, &c->mu);
    }
    c->rx_paused = false;
    pthread_mutex_unlock(&c->mu);
}

void axf_notify_release(axf_engine *e, uint64_t tag, uint64_t n)
{
    pthread_mutex_lock(&e->mu);
    for (conn *c = e->conns; c && n; c = c->next_all) {
        if (c->ep || c->tag != tag)
            continue;
        pthread_mutex_lock(&c->mu);
        uint64_t out = atomic_load(&c->notify_out);
        uint64_t k = out < n ? out : n;
        atomic_fetch_sub(&c->notify_out, k);
        n -= k;
        conn_room(c);
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&e->mu);
}

static void *tx_main(void *arg);

/* A connection's lock and condvars, one way for every kind of connection:
 * c->cv on CLOCK_MONOTONIC, the clock of the sending thread's timed wait
 * (tx_main, keepalive): on a wall-clock c->cv its deadline (boot time
 * based) is long past, the wait ends at once and the thread spins. (The
 * replay and detached connections never run a sending thread: their
 * tx_owed stays false, so tx_wake only signals them. They get the same
 * condvars so that one started there later cannot spin.) */
static void conn_sync_init(conn *c)
{
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&c->room_cv, NULL);
}

/* A connection's thread (its receiver or sender), detached: each ends by
 * itself (thread_exit). 0, or pthread_create's error. */
static int conn_thread(conn *c, void *(*main)(void *))
{
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int r = pthread_create(&t, &attr, main, c);
    pthread_attr_destroy(&attr);
    return r;
}

/* The sending thread starts lazily, the first time it has work: a frame
 * left queued (a posting thread sends small ones inline: conn_kick), a
 * goodbye to flush, or, from the receiver, pings once the connection has
 * been quiet for a while (rx_await). A connect and its first small
 * transfers then create one thread per connection, not two (a clone and a
 * stack: 0.06-0.7 ms each, measured, on the 2-core box competing with the
 * connect's own work). c->mu held; callers may hold e->mu. A creation that
 * fails marks the connection dead: its receiver leaves and does the
 * sender's exit (tx_never_ran). */
static void tx_wake(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    if (!atomic_load(&p->tx_owed)) {
        pthread_cond_signal(&c->cv);
        return;
    }
    if (c->dead)
        return; /* the receiver does its exit */
    atomic_store(&p->tx_owed, false);
    if (conn_thread(c, tx_main) != 0) {
        atomic_store(&p->tx_owed, true);
        conn_mark_dead(c);
    }
}

void conn_signal(conn *c)
{
    pthread_mutex_lock(&c->mu);
    tx_wake(c);
    pthread_mutex_unlock(&c->mu);
}

void conn_enqueue(conn *c, sq_item *it, bool signal)
{
    it->next = NULL;
    conn_enqueue_chain(c, it, it, signal);
}

void conn_enqueue_reply(conn *c, sq_item *it, bool signal)
{
    /* What it holds: the item, its header, its payload (a READ response's
     * points into registered memory, but the bound is on what a peer can
     * make us keep queued, whatever it costs). */
    uint64_t cost = sizeof *it + item_size(it);
    it->reply_cost = cost > UINT32_MAX ? UINT32_MAX : (uint32_t)cost;
    it->next = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->dead) {
        pthread_mutex_unlock(&c->mu);
        release_list(c->e, it);
        return;
    }
    atomic_fetch_add(&c->reply_bytes, it->reply_cost);
    if (c->tail)
        c->tail->next = it;
    else
        c->head = it;
    c->tail = it;
    if (signal)
        tx_wake(c);
    pthread_mutex_unlock(&c->mu);
}

/* An initiator's data frame (a request's chunks). */
static bool item_data(const sq_item *it)
{
    uint16_t t = it->h.type;
    return it->op && (t == FR_WRITE || t == FR_WRITEV || t == FR_READ_REQ || t == FR_READV);
}

/* The reply an initiator's queued frame is answered by (an expectation is
 * recorded for it), or 0: none. */
static uint16_t item_want(const sq_item *it)
{
    if (it->op && it->h.type == FR_NOTIFY)
        return FR_NOTIFY_ACK;
    if (it->op && (it->h.flags & FL_LAST))
        return it->h.type == FR_WRITE || it->h.type == FR_WRITEV ? FR_WRITE_ACK : FR_READ_RESP;
    return 0;
}

void conn_enqueue_chain(conn *c, sq_item *first, sq_item *last, bool signal)
{
    conn_priv *p = (conn_priv *)c;
    sq_item *it = last; /* the frame a reply answers: a LAST frame or a notification */
    uint32_t frames = 0;
    size_t chunks = 0;
    if (item_data(last)) /* (a data group's chain is its frames) */
        for (sq_item *f = first;; f = f->next) {
            frames++;
            chunks += f->h.nseg ? f->h.nseg : 1;
            if (f == last)
                break;
        }
    pthread_mutex_lock(&c->mu);
    uint16_t want = item_want(it);
    if (want) {
        /* Recorded even on a dead connection: its failure path (which runs
         * after, under e->mu like every enqueue of an initiator frame) then
         * moves or fails the group. And recorded with the whole group in the
         * same hold of c->mu: the target answers every READ chunk at once, so
         * no frame of the group may leave before its expectation exists. */
        expect *x = calloc(1, sizeof *x);
        if (!x) { /* without an expectation the group would be forgotten */
            p->ex_lost = true;
            conn_mark_dead(c);
            pthread_cond_signal(&c->cv);
            pthread_mutex_unlock(&c->mu);
            release_list(c->e, first);
            return;
        }
        x->op = it->op;
        x->op_id = it->h.op;
        x->type = want;
        x->slot = it->slot;
        x->req_bytes = it->group_bytes;
        x->chunks = it->chunks;
        x->nchunks = it->nchunks;
        x->frames = frames;
        x->count = chunks;
        x->t_enq = axf_now_us();
        it->chunks = NULL;
        if (!p->ex_head)
            c->busy_since_us = x->t_enq;
        if (p->ex_tail)
            p->ex_tail->next = x;
        else
            p->ex_head = x;
        p->ex_tail = x;
    }
    if (c->dead) {
        pthread_mutex_unlock(&c->mu);
        release_list(c->e, first);
        return;
    }
    last->next = NULL;
    if (c->tail)
        c->tail->next = first;
    else
        c->head = first;
    c->tail = last;
    if (signal)
        tx_wake(c);
    pthread_mutex_unlock(&c->mu);
}

void conn_kill(conn *c)
{
    pthread_mutex_lock(&c->mu);
    conn_mark_dead(c);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* c->mu held: a frame is partly on the wire (a thread sending, the head
 * frame partly sent and left for the sending thread, or its bytes in the
 * splice pipe): nothing else may go on the stream until it is whole. */
static bool conn_mid_frame(const conn *c)
{
    return c->sending || (c->head && c->head->sent) || ((const conn_priv *)c)->spl_in;
}

void conn_say_bye(conn *c, bool owe)
{
    pthread_mutex_lock(&c->mu);
    if (!c->dead && c->fd >= 0 && !conn_mid_frame(c)) {
        /* Between frames (or inside our goodbye, c->bye_off: a second call,
         * the shutdown's after bye_network's): the goodbye now, if the
         * socket takes it (its rest) whole. */
        wire_hdr h;
        ka_ping_frame(c, &h);
        h.flags = FL_BYE;
        size_t off = c->bye_off;
        ssize_t r = send(c->fd, (uint8_t *)&h + off, sizeof h - off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r == (ssize_t)(sizeof h - off)) {
            conn_bye_out(c);
            pthread_cond_signal(&c->cv);
            pthread_mutex_unlock(&c->mu);
            return;
        }
        if (r > 0) {
            /* Part of it is in the socket (TCP took what its last segment
             * had room for): the stream is inside the goodbye now, so it is
             * finished whatever owe says, by the sending thread from where
             * it stopped (bye_owed_send); cutting it here left the peer a
             * truncated header (nat28). */
            c->bye_off = (uint8_t)(off + (size_t)r);
        } else if (!owe || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            goto dead;
        }
        /* The socket is full (a reply just written, a slow reader): owed,
         * for the sending thread to say as soon as there is room. */
    } else if (c->bye_off && !c->dead && c->fd >= 0) {
        /* Our goodbye's rest is being sent (bye_owed_send): it ends it. */
        pthread_mutex_unlock(&c->mu);
        return;
    } else if (c->dead || c->fd < 0 || !owe) {
        goto dead; /* (the goodbye skipped: the peer sees a loss) */
    }
    /* A frame partly sent, or no room: the goodbye is owed. Its sender (or
     * the sending thread, woken) finishes the frame, starts no other, and
     * says it (tx_main); the connection ends then. Waiting here instead
     * (bye_network's grace) left the peer a loss whenever the frame took
     * longer: a large response to a slow reader. Nothing the peer sends
     * from now on is served (rx_drain): it fails as a close when the
     * goodbye reaches it, and a request served meanwhile landed in our
     * memory (a WRITE) while its reply, queued behind the goodbye, was never
     * sent (native test_bye26_owed). */
    c->bye_owed = true;
    atomic_store(&c->bye_said, true);
    pthread_cond_broadcast(&c->room_cv); /* a receiver paused for room drains */
    tx_wake(c);
    pthread_mutex_unlock(&c->mu);
    return;
dead:
    conn_mark_dead(c);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void conn_close_after_flush(conn *c)
{
    pthread_mutex_lock(&c->mu);
    atomic_store(&c->flush_close, true);
    tx_wake(c);
    pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------ raw I/O */

/* Moves an iovec array past n bytes (n at most what it holds). */
static void iov_skip(struct iovec **iov, int *cnt, size_t n)
{
    while (*cnt && n >= (*iov)->iov_len) {
        n -= (*iov)->iov_len;
        (*iov)++;
        (*cnt)--;
    }
    if (*cnt && n) {
        (*iov)->iov_base = (uint8_t *)(*iov)->iov_base + n;
        (*iov)->iov_len -= n;
    }
}

static size_t iov_total(const struct iovec *iov, int cnt)
{
    size_t n = 0;
    for (int i = 0; i < cnt; i++)
        n += iov[i].iov_len;
    return n;
}

/* All of the iovecs, waiting in the kernel (MSG_WAITALL).
 * 0 on success, else -errno (or -EPIPE on orderly close). */
static int read_full(int fd, struct iovec *iov, int cnt)
{
    while (cnt) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t r = recvmsg(fd, &m, MSG_WAITALL);
        if (r > 0)
            iov_skip(&iov, &cnt, (size_t)r);
        else if (r == 0)
            return -EPIPE;
        else if (errno != EINTR)
            return -errno;
    }
    return 0;
}

/* How many receivers of an engine may poll at once (rx_stream, rx_spin_one;
 * the others block in recv). Many connections busy at once need no polling:
 * their requests queue up, and every poller takes a CPU from the copies.
 * One: two (the next request's receiver and the payload's) measured no
 * steady gain (tcp15; tcp_chunk's comment has the figures). */
#define RX_SPINNERS_MAX 1

/* A place among the engine's polling receivers, else false at once. */
static bool spin_take(axf_engine *e)
{
    int n = atomic_load(&e->rx_spinners);
    while (n < RX_SPINNERS_MAX)
        if (atomic_compare_exchange_weak(&e->rx_spinners, &n, n + 1))
            return true;
    return false;
}

static void spin_give(axf_engine *e) { atomic_fetch_sub(&e->rx_spinners, 1); }

/* For a large payload (a WRITE's at a target, a READ response's at an
 * initiator) that its sender is still sending: non-blocking reads, the CPU
 * yielded between them, while bytes keep coming. Asleep in recv, the
 * receiver is woken several times per MiB, a scheduling round trip each, and
 * copies in bursts behind the sender instead of alongside it (what NIXL's
 * polling target does). Bounded: inside a frame only, while its bytes
 * arrive, by RX_SPINNERS_MAX receivers of the engine at a time (spin_take,
 * shared with rx_spin_one). Moves *iov past what it read; *err: -errno or
 * -EPIPE, else 0. */
static void rx_stream(conn *c, struct iovec **iov, int *cnt, int *err)
{
    *err = 0;
    if (c->replay || !spin_take(c->e)) {
        AXF_TR(TR_STREAM_B, c->fd, 0, 0);
        return;
    }
    AXF_TR(TR_STREAM_B, c->fd, 0, 1);
    uint64_t idle_from = 0;
    while (*cnt) {
        struct msghdr m = {.msg_iov = *iov, .msg_iovlen = (size_t)*cnt};
        ssize_t r = recvmsg(c->fd, &m, MSG_DONTWAIT);
        if (r > 0) {
            iov_skip(iov, cnt, (size_t)r);
            idle_from = 0;
            continue;
        }
        if (r == 0) {
            *err = -EPIPE;
            break;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            *err = -errno;
            break;
        }
        uint64_t now = axf_now_us();
        if (!idle_from)
            idle_from = now;
        else if (now - idle_from >= RX_STREAM_IDLE_US)
            break;
        sched_yield(); /* the sender may need this CPU */
    }
    AXF_TR(TR_STREAM_E, c->fd, 0, (uint64_t)*cnt);
    spin_give(c->e);
}

/* The receiver's reads: the iovecs filled (a vectored frame's segments
 * scattered where they go), from the bytes read ahead first, then from the
 * socket together with whatever follows them there (up to RX_AHEAD, kept for
 * the next read): one recvmsg per frame, not one for its header and one for
 * its payload, while frames come back to back (a batch of 16 KiB
 * descriptors). A payload still on its way is waited for whole (MSG_WAITALL:
 * the wait stays in the kernel, one call however many times its bytes wake
 * us), and read ahead of only when it was all there; a large one is polled
 * for while it streams in (rx_stream) when stream is set. iov has room for
 * cnt + 1 entries (the read-ahead buffer's) and is changed.
 * 0 on success, else -errno (-EPIPE: orderly close). */
static int rx_readv(conn *c, struct iovec *iov, int cnt, bool stream)
{
    conn_priv *p = (conn_priv *)c;
    while (p->rb_len && cnt) {
        size_t n = p->rb_len < iov->iov_len ? p->rb_len : iov->iov_len;
        memcpy(iov->iov_base, p->rb + p->rb_pos, n);
        p->rb_pos += (uint32_t)n;
        p->rb_len -= (uint32_t)n;
        iov_skip(&iov, &cnt, n);
    }
    size_t len = iov_total(iov, cnt);
    if (!len)
        return 0;
    p->rb_pos = 0; /* empty */
    /* A header waits for its first bytes (the rest follow at once); a
     * payload is taken as far as it is here. */
    bool header = len <= sizeof(wire_hdr);
    for (int flags = header ? 0 : MSG_DONTWAIT; len;) {
        iov[cnt] = (struct iovec){.iov_base = p->rb, .iov_len = RX_AHEAD};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt + 1};
        ssize_t r = recvmsg(c->fd, &m, flags);
        if (r < 0 && !header && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (r > 0) {
            if (!header && (size_t)r < len) { /* still coming: wait for all of it */
                iov_skip(&iov, &cnt, (size_t)r);
                len -= (size_t)r;
                break;
            }
            if ((size_t)r >= len) {
                p->rb_len = (uint32_t)((size_t)r - len);
                return 0;
            }
            iov_skip(&iov, &cnt, (size_t)r);
            len -= (size_t)r;
        } else if (r == 0) {
            return -EPIPE;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    if (stream && len >= RX_STREAM_MIN) {
        int err;
        rx_stream(c, &iov, &cnt, &err);
        if (err)
            return err;
    }
    return cnt ? read_full(c->fd, iov, cnt) : 0;
}

static int rx_read(conn *c, void *dst, size_t len)
{
    struct iovec iov[2] = {{.iov_base = dst, .iov_len = len}};
    return rx_readv(c, iov, 1, true);
}

/* Whether the READ response queued last may wait to go out with the next
 * one: the next frame is here already (read ahead), another READ request,
 * and both responses with those queued before them fit one inline send
 * (reply_bytes counts a little more than what send_batch does). */
static bool rx_reply_may_wait(conn *c)
{
    const conn_priv *p = (const conn_priv *)c;
    if (p->rb_len < sizeof(wire_hdr) || !rx_has_room(c))
        return false;
    wire_hdr next;
    memcpy(&next, p->rb + p->rb_pos, sizeof next);
    uint64_t queued = atomic_load(&c->reply_bytes);
    /* Only behind a frame that will be served: one the loop then refuses
     * (its magic is checked after this) closes the connection, and a
     * response held for it would never go out. */
    return next.magic == AXF_MAGIC && next.type == FR_READ_REQ && next.len <= INLINE_SEND &&
           queued + sizeof next + next.len <= INLINE_SEND;
}

static int discard(conn *c, uint8_t *scratch, uint64_t len)
{
    while (len) {
        size_t n = len < DISCARD_BYTES ? (size_t)len : DISCARD_BYTES;
        int r = rx_read(c, scratch, n);
        if (r)
            return r;
        len -= n;
    }
    return 0;
}

/* A blocking send's SO_SNDTIMEO ran out (EAGAIN): wait on? A connection
 * that may splice has it armed in slices of SPL_SNDTIMEO_MS (conn_open,
 * spl28): its death shuts only its reading (conn_mark_dead: no FIN while
 * spliced pages may be unread), which does not wake a blocked send, and a
 * sender that sat out the whole timeout (min(stall, peer timeout)) held
 * its connection's end, so its endpoint's loss and its ops' failure, for
 * that long. Sliced, it looks at down between slices (then EPIPE, as the
 * shutdown gives a copying connection) and waits the armed time in all as
 * before. Otherwise as ka_send_waits. */
static bool send_waits(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    if (p->spl_ok) {
        if (atomic_load(&c->down)) {
            errno = EPIPE;
            return false;
        }
        uint64_t now = axf_now_ms();
        if (!p->snd_wait0)
            p->snd_wait0 = now - SPL_SNDTIMEO_MS; /* one slice waited already */
        if (now - p->snd_wait0 < snd_armed_ms(c))
            return true;
        p->snd_wait0 = now; /* a whole timeout: as an unsliced send's */
    }
    return ka_send_waits(c);
}

/* Sends the iovecs whole (blocking, up to SO_SNDTIMEO) or, nowait, as much
 * as the socket takes now. *sent: bytes sent. 0, or -errno.
 * A blocking send that the socket refused for SO_SNDTIMEO goes on waiting
 * while c's peer is heard from (its keepalives arrive): it is alive and
 * pushing back (its receiver paused for room), not gone. With stall
 * detection on, that is a stall instead (the caller's choice). */
static int send_iov(conn *c, struct iovec *iov, int cnt, bool nowait, uint64_t *sent)
{
    while (cnt > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t r = sendmsg(c->fd, &m, MSG_NOSIGNAL | (nowait ? MSG_DONTWAIT : 0));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (nowait && (errno == EAGAIN || errno == EWOULDBLOCK))
                return 0;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && send_waits(c))
                continue;
            return -errno;
        }
        ((conn_priv *)c)->snd_wait0 = 0;
        *sent += (uint64_t)r;
        size_t done = (size_t)r;
        while (cnt > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + done;
            iov->iov_len -= done;
            if (nowait)
                return 0;
        }
    }
    return 0;
}

/* ------------------------------------------------ one-copy send (tcp18)
 *
 * Over loopback a WRITE's payload used to be copied twice: sendmsg copies
 * the initiator's registered memory into skbs, the target's recv copies it
 * out. vmsplice (user pages -> a pipe) and splice (pipe -> socket) queue
 * skbs that reference our pages instead, and loopback delivers them as
 * they are (MSG_ZEROCOPY would not do: loopback delivery copies zerocopy
 * frags, skb_orphan_frags_rx; spliced page frags are not copied), so only
 * the target copies. Measured in the plain-C floor (benchmarks/peers/
 * tcp_floor.c `splice`, kernel 6.18, 2 vCPUs, 6 interleaved pairs): 1 MiB
 * WRITE 1.66x (one connection, polled), 1.85x (two, a sending thread),
 * 64 KiB 1.32x, CPU per GB about halved; but a 16 MiB send on one
 * connection 0.74x and a READ's response 0.70x. The window (tcp.c
 * tcp_enable) is from the engine's own measurement.
 *
 * Why only to a same-uid peer over loopback (decided per connection, from
 * the kernel, before its first spliced byte: conn_path, spl_decide,
 * spl_on). Until the peer reads them,
 * its socket's receive queue holds references to our pages. A hostile
 * receiver could acknowledge a WRITE without reading it; we complete it,
 * the caller reuses the buffer, and the peer then reads the new contents:
 * memory it was never sent. A process of our own uid on this host can read
 * our memory anyway (process_vm_readv, /proc/pid/mem: the shm transport's
 * cross-memory attach rests on the same trust), so for it nothing new is
 * exposed. So: both ends local (loopback, or the same address with the
 * peer's socket in our own network namespace), and sock_diag (NETLINK_SOCK_DIAG,
 * the exact 4-tuple of the peer's socket, our own reversed) says that
 * socket's owner is our euid. A uid the peer reports is never used.
 * Anything else (another uid, a remote address, diag unavailable or
 * failing): the copy, as before.
 *
 * Why only WRITE payloads, sent by the initiator: a target splicing a READ
 * response would let the bytes be read after its access check and after a
 * deregistration that waited for the response to be sent (a TOCTOU), and
 * the floor measured it slower anyway. Target replies never come here
 * (send_batch's spl_frame: an initiator's op, FR_WRITE or FR_WRITEV).
 *
 * The release rule (tcp26): a WRITE completes on its group's
 * acknowledgement, which the target sends once it has read the group's
 * frames (in order on this stream, spliced pages included) into its
 * memory, and not before every frame of it has left the send queue
 * (op->pins); the op holds its regions (op->lregs) until then. Sent is
 * not read with splice: a spliced frame's item, once sent, stays as a hold
 * on its op's memory (op->mem; its pin given back, spl28) on its
 * connection (spl_keep) until that op's groups here
 * are acknowledged (spl_read_take), or the last of them here moves off
 * whole (spread_take: a joining connection's spread; tcp27, else the op
 * stayed pinned until this connection died). When the connection fails first (the
 * stall timeout of a stopped target, a lost or closed endpoint; the op
 * fails, or its group is sent again elsewhere), the peer may still read
 * the pages later, as they are then. So the holds stay until the kernel
 * shows every byte we put in the socket read or dropped (spl_settle,
 * polled: our send queue empty or purged, and the peer's socket gone or
 * its receive queue empty; and no inline sender still between its unlock
 * and its release, spl_late, tcp27): the op's region holds (a
 * deregistration waits for them) are released only then. Its outcome is
 * told at once (spl28: AXF_CQ_XFER_HELD, engine.c op_finish_now), the
 * release later (AXF_CQ_XFER_FREED); the connection's end reaches its
 * endpoint before it settles (thread_exit). Why no prompt release: an
 * abortive close does not drop the pages (a reset socket's
 * receive queue stays readable: recv returns it before ECONNRESET, kernel
 * 6.18, and the reset unhashes the socket, so sock_diag stops seeing it),
 * nothing else of ours can take them back from a live peer, and with the
 * copy the posted bytes may still land as well. A stopped peer so holds a
 * failed WRITE's memory until it resumes and reads, or exits; the engine's
 * shutdown gives up after a second, logged. For
 * the same reason a connection that may splice shuts only its reading
 * side when it dies (conn_mark_dead) and closes after settling: with our
 * FIN out and reading shut, the peer's next bytes draw our kernel's reset.
 * That shutdown does not wake a blocked send, so such a connection waits
 * for room in slices (send_waits).
 *
 * Known limits: the uid check vouches for the process that created
 * (accepted) the peer socket, not one it was passed to or one that dropped
 * privileges after accepting (inetd's pattern); a peer that acknowledges
 * without reading (dishonest) reads later contents, which the uid check
 * stands for. Where the kernel says "our uid cannot read our memory", no
 * splice (spl_peer_may_read): we are not dumpable, or Yama's ptrace_scope
 * is 1 or more. Not told: uid 0 across pid namespaces sharing a network
 * namespace (containers of one pod): see tcp.c tcp_enable.
 *
 * Errors: a vmsplice that fails (EFAULT or EINVAL on an odd mapping,
 * ENOMEM) sends the rest of that frame by copy; a pipe that cannot be made
 * (EMFILE, ENFILE) leaves the connection on the copy for good. Bytes left
 * in the pipe when a send stops (spl_in) go into the same socket before
 * anything else (send_vec drains first). The pipe closes with the socket
 * (thread_exit); one at most per connection (e->splice_pipes counts them).
 * A splice to a socket cannot be told not to wait (SPLICE_F_NONBLOCK is
 * about the pipe; O_NONBLOCK on the socket would also stop its receiver's
 * blocking reads), so a caller's nowait send splices only what the
 * socket's own accounting says it takes now (spl_room). And splice raises
 * SIGPIPE on a closed peer (no MSG_NOSIGNAL for it): blocked around it and
 * consumed (spl_sig_*). */
#define SPL_PIPE_BYTES (256u << 10) /* per connection; the user's pipe pages are limited
                                       (fs/pipe-user-pages-soft, 64 MiB by default) */
#define SPL_IOV 64                  /* iovecs to one vmsplice */
#define SPL_ROOM_MIN 4096u          /* a nowait splice needs this much room at least */

/* Both ends on a loopback address (127/8, ::1, v4-mapped 127/8): each
 * network namespace has its own loopback, so the peer is on this host, in
 * our namespace. The fast path: no lookup. */
static bool addr_loopback(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        uint32_t ax = ntohl(x->sin_addr.s_addr), bx = ntohl(y->sin_addr.s_addr);
        return (ax >> 24) == 127 && (bx >> 24) == 127;
    }
    const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
    static const uint8_t v4m[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    bool lx = IN6_IS_ADDR_LOOPBACK(&x->sin6_addr) ||
              (memcmp(&x->sin6_addr, v4m, 12) == 0 && x->sin6_addr.s6_addr[12] == 127);
    bool ly = IN6_IS_ADDR_LOOPBACK(&y->sin6_addr) ||
              (memcmp(&y->sin6_addr, v4m, 12) == 0 && y->sin6_addr.s6_addr[12] == 127);
    return lx && ly;
}

static bool addr_equal(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)(const void *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)(const void *)b)->sin_addr.s_addr;
    return memcmp(&((const struct sockaddr_in6 *)(const void *)a)->sin6_addr,
                  &((const struct sockaddr_in6 *)(const void *)b)->sin6_addr,
                  sizeof(struct in6_addr)) == 0;
}

/* Through the loopback device (tcp19): a TCP connection between two
 * addresses of this host gets e->tcp_loop_cc ("reno" unless
 * AIOXFER_TCP_LOOPBACK_CC says otherwise) for its congestion control. No
 * link can be congested there, and the system's default may cost us: this
 * VM's is bbr, which paces each connection and bounds what it has in
 * flight (on loopback: bytes the receiver has not read yet), so a 1 MiB
 * frame sent whole stalls until the peer's reads make room (its
 * receiver's, or in softirq on its CPU), and loopback's reordering made it
 * retransmit (ss -ti: bytes_retrans, dsack_dups). Measured, 1 MiB WRITEs
 * awaited one at a time through Python (benchmarks/tcp14_timeline.py,
 * interleaved, medians of per-pair ratios): reno alone 1.08x (8/10 pairs
 * better) and 1.09x, CPU per GB 0.35 -> 0.26; with the request whole on
 * one connection (tcp.c tcp_chunk) 1.54x (7/8), 1.10x NIXL-tcp in the same
 * rounds, where the whole frame under bbr lost (as tcp13 found). Wheels
 * against main's, 8 pairs each: 1.53x (8/8) and 1.30x (7/8), NIXL-tcp
 * 1.12x and 1.02x in the same rounds; 16 MiB WRITE 1.48x, READ 1.54x
 * (4/4); 4 KiB, 64 KiB, 1 MiB READ within noise.
 * Reno is the one the kernel lets any process choose (the others may need
 * CAP_NET_ADMIN or tcp_allowed_congestion_control). Other routes keep the
 * system's choice.
 *
 * true (c->loop_cc: the whole-WRITE, whole-batch and loopback help_ack /
 * help_resp shapes) when the connection is through loopback AND the
 * congestion control the kernel reports in use on it afterwards does not
 * pace (read22): AIOXFER_TCP_LOOPBACK_CC=bbr leaves bbr, under which those
 * shapes were measured to stall (above; tcp13), so they stay off whatever
 * the setting's name. "" or "0" (no setting: the system's choice kept) and
 * a setsockopt the kernel refused keep them off, as before. In the kernel
 * only bbr asks for TCP's internal pacing (sk_pacing_status
 * SK_PACING_NEEDED, tcp_bbr.c); the others (reno, cubic, ...) send as the
 * window allows, the shape these were measured with. bbr's later versions
 * keep the name as a prefix (bbr2, bbr3). */
static bool cc_paces(const char *name)
{
    return strncmp(name, "bbr", 3) == 0;
}

/* The one in use after a setsockopt that succeeded is the one named (the
 * kernel finds it by that exact name, tcp_ca_find, or fails): its name is
 * not read back (a system call per connection less, cxn32). */
static bool loop_cc_set(axf_engine *e, int fd) /* fd's path local (conn_open) */
{
    return e->tcp_loop_cc[0] &&
           setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, e->tcp_loop_cc,
                      (socklen_t)strlen(e->tcp_loop_cc)) == 0 &&
           !cc_paces(e->tcp_loop_cc);
}

/* The peer's socket of a TCP connection looked up by its exact tuple (ours
 * reversed) with sock_diag, which answers for our own network namespace
 * only: true when found there, *uid its owner's euid (the kernel's word,
 * never the peer's). One netlink round trip. */
/* The peer's socket as sock_diag sees it (the exact 4-tuple, our own
 * reversed): 1 found (*uid, *state, *rqueue: its owner, TCP state, bytes in
 * its receive queue not yet read), 0 the kernel has no such socket, -1 no
 * answer (no diag, no fd, a short or odd reply). */
static int peer_diag_q(const struct sockaddr_storage *mep, const struct sockaddr_storage *peerp,
                       uint32_t *uid, uint8_t *state, uint32_t *rqueue)
{
    const struct sockaddr_storage me = *mep, peer = *peerp;
    struct {
        struct nlmsghdr n;
        struct inet_diag_req_v2 r;
    } q;
    memset(&q, 0, sizeof q);
    q.n.nlmsg_len = sizeof q;
    q.n.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    q.n.nlmsg_flags = NLM_F_REQUEST; /* no NLM_F_DUMP: the one socket of this exact tuple */
    q.r.sdiag_family = (uint8_t)me.ss_family;
    q.r.sdiag_protocol = IPPROTO_TCP;
    q.r.idiag_states = ~0u;
    q.r.id.idiag_cookie[0] = q.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    if (me.ss_family == AF_INET) { /* the peer's socket: its source is our destination */
        const struct sockaddr_in *m = (const void *)&me, *pr = (const void *)&peer;
        q.r.id.idiag_sport = pr->sin_port;
        q.r.id.idiag_dport = m->sin_port;
        memcpy(q.r.id.idiag_src, &pr->sin_addr, 4);
        memcpy(q.r.id.idiag_dst, &m->sin_addr, 4);
    } else {
        const struct sockaddr_in6 *m = (const void *)&me, *pr = (const void *)&peer;
        q.r.id.idiag_sport = pr->sin6_port;
        q.r.id.idiag_dport = m->sin6_port;
        memcpy(q.r.id.idiag_src, &pr->sin6_addr, 16);
        memcpy(q.r.id.idiag_dst, &m->sin6_addr, 16);
    }
    int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0)
        return -1;
    struct timeval tv = {.tv_sec = 1};
    (void)setsockopt(nl, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_nl k = {.nl_family = AF_NETLINK};
    union {
        struct nlmsghdr n;
        uint8_t b[1024];
    } a;
    ssize_t r = -1;
    if (sendto(nl, &q, sizeof q, 0, (struct sockaddr *)&k, sizeof k) == (ssize_t)sizeof q)
        do
            r = recv(nl, &a, sizeof a, 0);
        while (r < 0 && errno == EINTR);
    close(nl);
    if (r >= (ssize_t)NLMSG_LENGTH(sizeof(struct nlmsgerr)) && a.n.nlmsg_type == NLMSG_ERROR &&
        a.n.nlmsg_len <= (size_t)r) {
        const struct nlmsgerr *er = NLMSG_DATA(&a.n);
        return er->error == -ENOENT ? 0 : -1; /* ENOENT: no socket of this tuple */
    }
    if (r < (ssize_t)NLMSG_LENGTH(sizeof(struct inet_diag_msg)) ||
        a.n.nlmsg_type != SOCK_DIAG_BY_FAMILY || a.n.nlmsg_len > (size_t)r ||
        a.n.nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
        return -1; /* short, or odd */
    const struct inet_diag_msg *d = NLMSG_DATA(&a.n);
    /* The kernel's lookup falls back to a listener on the port (inet_lookup):
     * another socket's answer means the connection's own is gone. */
    if (d->id.idiag_sport != q.r.id.idiag_sport || d->id.idiag_dport != q.r.id.idiag_dport ||
        memcmp(d->id.idiag_src, q.r.id.idiag_src, sizeof d->id.idiag_src) != 0 ||
        memcmp(d->id.idiag_dst, q.r.id.idiag_dst, sizeof d->id.idiag_dst) != 0)
        return 0;
    *uid = d->idiag_uid;
    *state = d->idiag_state;
    *rqueue = d->idiag_rqueue;
    return 1;
}

static bool peer_diag(const struct sockaddr_storage *mep, const struct sockaddr_storage *peerp,
                      uint32_t *uid)
{
    uint8_t state;
    uint32_t rq;
    return peer_diag_q(mep, peerp, uid, &state, &rq) == 1;
}

/* "A process of our uid can read our memory anyway" (the one-copy send's
 * premise, above), as far as the kernel lets us check it (tcp26): not when
 * we are not dumpable (PR_SET_DUMPABLE 0, or a set-id exec: the same uid
 * may not ptrace us then, nor process_vm_readv or /proc/pid/mem us), nor
 * under Yama's ptrace_scope 1 or more (only our declared tracer or, at 1,
 * an ancestor may: not a peer that accepted our connection; a missing file
 * is no Yama). Read per connection (spl_decide): prctl can change it.
 * uid 0 across pid namespaces (containers of one pod sharing a network
 * namespace) is not told here: sock_diag names the socket's owner uid, not
 * its process, and finding the process (every /proc/PID/fd of the host)
 * costs a scan per connect; see tcp.c tcp_enable. */
static bool spl_peer_may_read(void)
{
    if (prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 1)
        return false;
    char buf[8] = {0};
    int f = open("/proc/sys/kernel/yama/ptrace_scope", O_RDONLY | O_CLOEXEC);
    if (f < 0)
        return errno == ENOENT; /* no Yama; unreadable: not vouched for */
    ssize_t r = read(f, buf, sizeof buf - 1);
    close(f);
    return r > 0 && buf[0] == '0';
}

/* Where a TCP connection's peer is, decided once at conn_open, never per
 * frame: local (through this host's loopback device: loop_cc_set's shapes
 * and congestion control) when both ends are loopback addresses, or when
 * both have the same address AND sock_diag finds the peer's socket in our
 * own network namespace. Equal addresses alone do not say it: two network
 * namespaces (containers) behind NAT may each have the same address, and
 * then a real path, a veth or a NIC, got the loopback's shapes and reno.
 * Local: true, and *mep, *peerp the tuple (the one-copy send asks about it:
 * spl_decide, spl_settle). No lookup through loopback addresses, at most
 * one netlink round trip (tens of us) otherwise. Whether a local peer may
 * be spliced to is asked later, off the connect's path (spl_decide). */
static bool conn_path(int fd, struct sockaddr_storage *mep, struct sockaddr_storage *peerp)
{
    struct sockaddr_storage me, peer;
    socklen_t ml = sizeof me, pl = sizeof peer;
    memset(&me, 0, sizeof me);
    memset(&peer, 0, sizeof peer);
    if (getsockname(fd, (struct sockaddr *)&me, &ml) != 0 ||
        getpeername(fd, (struct sockaddr *)&peer, &pl) != 0 || me.ss_family != peer.ss_family ||
        (me.ss_family != AF_INET && me.ss_family != AF_INET6))
        return false;
    uint32_t uid = 0;
    if (!addr_loopback(&me, &peer) && !(addr_equal(&me, &peer) && peer_diag(&me, &peer, &uid)))
        return false;
    *mep = me;
    *peerp = peer;
    return true;
}

/* spl_v: the one-copy send's verdict on a connection. OFF: it copies (not
 * an initiator's local TCP connection with the switch on, or the kernel
 * said no); ASK: not asked yet; BUSY: being asked (spl_decide); YES: the
 * kernel said yes, not turned on yet (spl_on); ON: spl_ok. */
enum { SPL_V_OFF, SPL_V_ASK, SPL_V_BUSY, SPL_V_YES, SPL_V_ON };

/* The kernel asked once whether c's peer may be spliced to (spl_v ASK ->
 * YES or OFF): its socket's owner is our euid (sock_diag: the exact tuple)
 * and spl_peer_may_read. By the connection's receiver as it starts, off
 * the connect's path (cxn32: these ~10 system calls, about 20 us here, were
 * inside endpoint_add_conn, on the caller's thread, per connection), or by
 * its sender at its first frame to splice (spl_on), whichever comes first;
 * the other finds it decided or, in the microseconds it is being asked,
 * BUSY: that frame is copied. Either way before any byte is spliced, so
 * the checks are as fresh as at conn_open's (a prctl in between counts). */
static void spl_decide(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    int ask = SPL_V_ASK;
    if (!atomic_compare_exchange_strong(&p->spl_v, &ask, SPL_V_BUSY))
        return;
    uint32_t uid = 0;
    bool yes = peer_diag(&p->spl_me, &p->spl_peer, &uid) && uid == (uint32_t)geteuid() &&
               spl_peer_may_read();
    atomic_store(&p->spl_v, yes ? SPL_V_YES : SPL_V_OFF);
    atomic_fetch_add(&c->e->splice_verdicts, 1);
}

/* Whoever holds c->sending, before a frame it would splice: whether c
 * splices (spl_ok). Turned on here once the kernel said yes (spl_decide),
 * under c.mu before the first spliced byte, unless c died already (then it
 * was shut both ways, conn_mark_dead, and nothing of it is ever spliced).
 * From then on its death shuts only its reading, its blocked sends wait
 * in slices and its end settles its holds (conn_mark_dead, send_waits,
 * thread_exit), as when conn_open decided it; a connection that never
 * sends a frame to splice never turns it on and ends as a copying one. */
static bool spl_on(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    if (p->spl_ok)
        return true;
    int v = atomic_load(&p->spl_v);
    if (v == SPL_V_ASK) {
        spl_decide(c);
        v = atomic_load(&p->spl_v);
    }
    if (v != SPL_V_YES)
        return false;
    pthread_mutex_lock(&c->mu);
    bool on = !c->dead;
    if (on) {
        p->spl_ok = true;
        if (snd_armed_ms(c) > SPL_SNDTIMEO_MS) { /* sliced (send_waits): the sender's own */
            struct timeval stv = {.tv_sec = 0, .tv_usec = SPL_SNDTIMEO_MS * 1000};
            (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &stv, sizeof stv);
        }
    }
    atomic_store(&p->spl_v, on ? SPL_V_ON : SPL_V_OFF);
    pthread_mutex_unlock(&c->mu);
    return on;
}

/* The connection's pipe, made on first use: false when it cannot be. */
static bool spl_pipe_get(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    if (p->spl_pipe)
        return true;
    if (p->spl_nopipe)
        return false;
    /* Non-blocking: a vmsplice never waits for room (the pipe is empty when
     * we fill it), a splice from it never waits for bytes. */
    if (pipe2(p->spl_fd, O_CLOEXEC | O_NONBLOCK) != 0) {
        p->spl_nopipe = true; /* EMFILE, ENFILE: this connection copies */
        return false;
    }
    /* A uid over fs/pipe-user-pages-soft gets a 2-slot pipe and EPERM here
     * (rev18b #3): 8 KiB a round trip of vmsplice + splice costs more than
     * the copy, so such a connection copies. */
    if (fcntl(p->spl_fd[1], F_SETPIPE_SZ, (int)SPL_PIPE_BYTES) < (int)SPL_PIPE_BYTES) {
        close(p->spl_fd[0]);
        close(p->spl_fd[1]);
        p->spl_fd[0] = p->spl_fd[1] = -1;
        p->spl_nopipe = true;
        return false;
    }
    p->spl_pipe = true;
    atomic_fetch_add(&c->e->splice_pipes, 1);
    return true;
}

static void spl_pipe_close(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    if (!p->spl_pipe)
        return;
    close(p->spl_fd[0]);
    close(p->spl_fd[1]);
    p->spl_pipe = false;
    p->spl_in = 0;
    atomic_fetch_sub(&c->e->splice_pipes, 1);
}

/* The release rule with splice (tcp26). A spliced frame's item, once sent,
 * stays a hold on its op's memory on its connection (c.mu) while a group of
 * that op is still owed here: only its acknowledgement, sent by the target
 * after reading the group's frames in order, says the pages were read.
 * Taken over: true (the item is the connection's now). An op with nothing
 * owed here was acknowledged already (its reply can beat the release of a
 * frame sent inline), or the connection settled (spl_settle): released. A
 * dead connection not yet settled keeps it for spl_settle. */
static bool spl_keep(conn *c, sq_item *it)
{
    conn_priv *p = (conn_priv *)c;
    pthread_mutex_lock(&c->mu);
    bool owed = false;
    if (!p->spl_settled) {
        owed = c->dead; /* its expectations may be gone with it: spl_settle decides */
        for (expect *x = p->ex_head; x && !owed; x = x->next)
            owed = x->op == it->op;
    }
    if (owed) {
        op_mem_hold(it->op); /* before it is on the list: spl_release may take it at once */
        it->next = p->spl_holds;
        p->spl_holds = it;
    }
    pthread_mutex_unlock(&c->mu);
    return owed;
}

/* c.mu held, a group of o acknowledged (its expectation taken off): o's
 * holds once nothing of o is owed here any more (another group of o on
 * this connection, a rerouted one, may follow its frames). */
static sq_item *spl_read_take(conn *c, op *o)
{
    conn_priv *p = (conn_priv *)c;
    for (expect *x = p->ex_head; x; x = x->next)
        if (x->op == o)
            return NULL;
    sq_item *out = NULL, **pp = &p->spl_holds;
    while (*pp) {
        sq_item *it = *pp;
        if (it->op == o) {
            *pp = it->next;
            it->next = out;
            out = it;
        } else {
            pp = &it->next;
        }
    }
    return out;
}

static void spl_release(axf_engine *e, sq_item *it)
{
    while (it) {
        sq_item *n = it->next;
        op_mem_unref(e, it->op);
        free(it);
        it = n;
    }
}

/* Every byte this connection put in its socket read by the peer or dropped,
 * as the kernel says: our send queue empty (or purged: our socket reset,
 * which only the peer's end can cause while we hold our fd and have not
 * sent a FIN: conn_mark_dead) and the peer's socket gone (closed: its
 * receive queue freed) or its receive queue empty. */
static bool spl_pages_free(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    struct tcp_info ti;
    socklen_t tl = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) != 0)
        return false;
    int outq = 0;
    if (ti.tcpi_state != TCP_CLOSE && (ioctl(c->fd, SIOCOUTQ, &outq) != 0 || outq != 0))
        return false;
    uint32_t uid = 0, rq = 0;
    uint8_t st = 0;
    int f = peer_diag_q(&p->spl_me, &p->spl_peer, &uid, &st, &rq);
    return f == 0 || (f == 1 && rq == 0);
}

/* A dead connection's last thread, before its close: its holds (frames of
 * groups never acknowledged, their ops failed or moved) are released only
 * once spl_pages_free: until then the ops do not complete and their regions
 * stay held, so the caller cannot reuse or deregister the memory a stopped
 * peer would still read (rev18b). An abortive close would not end it (the
 * peer's queue stays readable after our reset), so we wait: polled, from
 * 1 ms up to 50 ms apart. Given up only at the engine's shutdown after a
 * second (logged: a peer that never reads nor closes cannot hold a
 * process's exit). */
/* Waits (c->mu held) until no inline sender holds spliced items between
 * its unlock and their release (spl_late). */
static void spl_late_drain(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    p->spl_late_wait++;
    while (p->spl_late)
        pthread_cond_wait(&c->cv, &c->mu);
    p->spl_late_wait--;
}

static void spl_settle(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    axf_engine *e = c->e;
    uint64_t wait_us = 1000, shut_at = 0;
    bool logged = false;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        spl_late_drain(c); /* an inline sender's spliced items: kept, or released */
        bool any = p->spl_holds != NULL;
        pthread_mutex_unlock(&c->mu);
        if (!any || spl_pages_free(c))
            break;
        pthread_mutex_lock(&e->mu);
        bool shut = e->shut;
        pthread_mutex_unlock(&e->mu);
        uint64_t now = axf_now_us();
        if (shut && !shut_at)
            shut_at = now;
        if (shut_at && now - shut_at > 1000000u) {
            cq_log(e, c->tag, "closing: spliced pages of failed writes still unread by the peer");
            break;
        }
        if (!logged && wait_us >= 50000u) {
            logged = true;
            cq_log(e, c->tag, "connection lost: its failed writes' memory is released once "
                              "the peer has read or dropped their spliced pages");
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)wait_us * 1000L};
        nanosleep(&ts, NULL);
        if (wait_us < 50000u)
            wait_us *= 2;
    }
    pthread_mutex_lock(&c->mu);
    spl_late_drain(c); /* (a shutdown's give-up: still none released early) */
    p->spl_settled = true;
    sq_item *held = p->spl_holds;
    p->spl_holds = NULL;
    pthread_mutex_unlock(&c->mu);
    spl_release(e, held);
}

/* What the socket takes now without waiting, by its own accounting (its
 * send buffer less what it holds queued), halved for the skbs' overhead. */
static uint64_t spl_room(int fd)
{
    uint32_t mi[SK_MEMINFO_VARS];
    socklen_t l = sizeof mi;
    if (getsockopt(fd, SOL_SOCKET, SO_MEMINFO, mi, &l) != 0 ||
        l < (SK_MEMINFO_WMEM_QUEUED + 1) * sizeof mi[0] ||
        mi[SK_MEMINFO_WMEM_QUEUED] >= mi[SK_MEMINFO_SNDBUF])
        return 0;
    return (mi[SK_MEMINFO_SNDBUF] - mi[SK_MEMINFO_WMEM_QUEUED]) / 2;
}

/* SIGPIPE around splices (a closed peer raises it: splice has no
 * MSG_NOSIGNAL): blocked for the calling thread, and one raised meanwhile
 * consumed before the mask is restored, unless one was pending before. */
typedef struct spl_sig {
    sigset_t old;
    bool had, on;
} spl_sig;

static void spl_sig_begin(spl_sig *g)
{
    sigset_t pipe_set, pend;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    g->on = pthread_sigmask(SIG_BLOCK, &pipe_set, &g->old) == 0;
    g->had = sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE);
}

static void spl_sig_end(spl_sig *g, bool epipe)
{
    if (!g->on)
        return;
    if (epipe && !g->had) {
        sigset_t pipe_set;
        sigemptyset(&pipe_set);
        sigaddset(&pipe_set, SIGPIPE);
        struct timespec zero = {0, 0};
        while (sigtimedwait(&pipe_set, NULL, &zero) < 0 && errno == EINTR)
            ;
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* Moves the pipe's bytes (spl_in) into the socket; more: more of the
 * stream follows at once. 0: all went; 1: nowait, some are left (the
 * socket has no room now); or -errno. */
static int spl_drain(conn *c, bool more, bool nowait, uint64_t *sent)
{
    conn_priv *p = (conn_priv *)c;
    while (p->spl_in) {
        size_t len = p->spl_in;
        if (nowait) {
            uint64_t room = spl_room(c->fd);
            if (room < SPL_ROOM_MIN)
                return 1;
            if (len > room)
                len = (size_t)room;
        }
        bool tail = len < p->spl_in;
        ssize_t w = splice(p->spl_fd[0], NULL, c->fd, NULL, len,
                           SPLICE_F_NONBLOCK | (more || tail ? SPLICE_F_MORE : 0));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN && nowait)
                return 1;
            if (errno == EAGAIN && send_waits(c))
                continue;
            return -errno;
        }
        if (w == 0)
            return -EPIPE;
        p->snd_wait0 = 0;
        p->spl_in -= (uint32_t)w;
        *sent += (uint64_t)w;
    }
    return 0;
}

/* A frame's payload, n iovecs, by vmsplice into the pipe and splice into
 * the socket. *used: bytes of the iovecs taken (into the socket, or left
 * in the pipe: spl_in). 0: all taken, or nowait: as much as the socket
 * had room for; 1: vmsplice (or the pipe) refused: the rest goes by copy;
 * or -errno. */
static int spl_run(conn *c, const struct iovec *iov, int n, bool more, bool nowait,
                   uint64_t *sent, size_t *used)
{
    conn_priv *p = (conn_priv *)c;
    axf_engine *e = c->e;
    *used = 0;
    if (!spl_pipe_get(c))
        return 1;
    int i = 0;
    size_t off = 0; /* into iov[i] */
    bool any = false;
    while (i < n) {
        size_t cap = SIZE_MAX;
        if (nowait) {
            uint64_t room = spl_room(c->fd);
            if (room < SPL_ROOM_MIN)
                break;
            cap = (size_t)room;
        }
        struct iovec v[SPL_IOV];
        int k = 0;
        size_t tot = 0;
        for (int j = i; j < n && k < SPL_IOV && tot < cap; j++) {
            size_t o = j == i ? off : 0, l = iov[j].iov_len - o;
            if (l > cap - tot)
                l = cap - tot;
            v[k].iov_base = (uint8_t *)iov[j].iov_base + o;
            v[k++].iov_len = l;
            tot += l;
        }
        ssize_t r = vmsplice(p->spl_fd[1], v, (unsigned long)k, SPLICE_F_NONBLOCK);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) { /* EFAULT, EINVAL (an odd mapping), ENOMEM: copy the rest */
            atomic_fetch_add(&e->splice_fallbacks, 1);
            return 1;
        }
        any = true;
        atomic_fetch_add(&e->spliced_bytes, (uint64_t)r);
        p->spl_in = (uint32_t)r;
        *used += (size_t)r;
        size_t adv = (size_t)r;
        while (i < n && adv >= iov[i].iov_len - off) {
            adv -= iov[i].iov_len - off;
            off = 0;
            i++;
        }
        off += adv;
        int d = spl_drain(c, more || i < n, nowait, sent);
        if (d)
            return d < 0 ? d : 0; /* nowait: the rest of the pipe waits (spl_in) */
    }
    if (any)
        atomic_fetch_add(&e->spliced_frames, 1);
    return 0;
}

/* send_iov with a splice mark per iovec (spl[k]: iov[k] is payload to
 * splice), the pipe's leftover sent first. Same contract: 0 (all sent, or
 * nowait: what the socket took), or -errno. */
static int send_vec(conn *c, struct iovec *iov, uint8_t *spl, int cnt, bool nowait,
                    uint64_t *sent)
{
    conn_priv *p = (conn_priv *)c;
    if (!p->spl_in && !memchr(spl, 1, (size_t)cnt))
        return send_iov(c, iov, cnt, nowait, sent);
    spl_sig g;
    spl_sig_begin(&g);
    int r = 0;
    if (p->spl_in) { /* the head frame's bytes in the pipe come first */
        size_t had = p->spl_in;
        r = spl_drain(c, cnt > 0, nowait, sent);
        if (r) {
            r = r < 0 ? r : 0;
            goto out;
        }
        struct iovec *v0 = iov;
        iov_skip(&iov, &cnt, had);
        spl += iov - v0;
    }
    while (cnt > 0) {
        int k = 1;
        while (k < cnt && spl[k] == spl[0])
            k++;
        bool more = k < cnt;
        if (spl[0]) {
            size_t used = 0, run = iov_total(iov, k);
            r = spl_run(c, iov, k, more, nowait, sent, &used);
            if (r < 0)
                goto out;
            struct iovec *v0 = iov;
            iov_skip(&iov, &cnt, used);
            spl += iov - v0;
            if (r == 1) { /* the rest of this frame by copy */
                for (int j = 0; j < cnt && spl[j]; j++)
                    spl[j] = 0;
                r = 0;
                continue;
            }
            /* nowait: no room, or bytes left in the pipe (they go before
             * anything else: the next frame waits for the sending thread) */
            if (used < run || p->spl_in)
                goto out;
            continue;
        }
        /* The header (and segment table), or copied payloads: MSG_MORE while
         * a spliced payload follows, so they share a segment. */
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)k};
        ssize_t w = sendmsg(c->fd, &m,
                            MSG_NOSIGNAL | (nowait ? MSG_DONTWAIT : 0) | (more ? MSG_MORE : 0));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (nowait && (errno == EAGAIN || errno == EWOULDBLOCK))
                goto out;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && send_waits(c))
                continue;
            r = -errno;
            goto out;
        }
        p->snd_wait0 = 0;
        *sent += (uint64_t)w;
        size_t total = iov_total(iov, k);
        struct iovec *v0 = iov;
        iov_skip(&iov, &cnt, (size_t)w);
        spl += iov - v0;
        if ((size_t)w < total && nowait)
            goto out;
    }
out:
    spl_sig_end(&g, r == -EPIPE);
    return r;
}

/* ------------------------------------------------------------ threads */

static void thread_exit(conn *c)
{
    axf_engine *e = c->e;
    if (atomic_fetch_sub(&c->threads, 1) == 1) {
        conn_priv *p = (conn_priv *)c;
        pthread_mutex_lock(&c->mu);
        expect *x = p->ex_head;
        p->ex_head = p->ex_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        while (x) {
            expect *n = x->next;
            expect_free(x);
            x = n;
        }
        /* A connection that may have spliced (an initiator's) settles its
         * holds before its close (its reset would hide the peer's queue),
         * but after its endpoint hears of it (spl28): the ops failed with it
         * complete now (AXF_CQ_XFER_HELD where a peer may still read their
         * pages), their memory only once spl_settle releases the holds
         * (AXF_CQ_XFER_FREED). Before, their failure and the endpoint's loss
         * waited for a stopped peer to resume or exit. */
        bool settle = p->spl_ok;
        if (!settle) {
            close(c->fd);
            spl_pipe_close(c); /* what was left in it is never sent */
            atomic_fetch_sub(&e->n_conns, 1);
        }
        if (!c->ep) {
            /* What transports hung on it first (verbs: its queue pairs):
             * then nothing reaches us */
            AXF_FOR_XP(xp)
                if (xp->conn_closed)
                    xp->conn_closed(e, c);
            revokes_drop(e, c); /* tcp: a dead peer touches nothing of ours any more */
        }
        /* Off the registry unless held (a same-host peer still alive, which
         * the watcher drops once its process exits). An initiator's before
         * its endpoint hears of it: the endpoint may be freed from then on,
         * and nothing in the registry may point at a freed one. */
        pthread_mutex_lock(&e->mu);
        if (c->ep || c->gone)
            conn_registry_drop(e, c);
        pthread_mutex_unlock(&e->mu);
        if (c->ep)
            endpoint_conn_finished(e, c->ep);
        else if (c->closed_slot) /* promised at conn_open: never lost */
            cq_push_claimed(e, AXF_CQ_CONN_CLOSED, AXF_OK, 0, c->tag, 0, 0, NULL, 0);
        else /* a detached one (conn_detached): claims its slot now */
            cq_push(e, AXF_CQ_CONN_CLOSED, AXF_OK, 0, c->tag, 0, 0, NULL, 0);
        if (settle) { /* c->ep may be freed from here on: spl_settle does not use it */
            spl_settle(c);
            close(c->fd);
            spl_pipe_close(c);
            atomic_fetch_sub(&e->n_conns, 1);
        }
        conn_unref(c); /* the threads' reference */
    }
    pthread_mutex_lock(&e->th_mu);
    e->conn_threads--;
    pthread_cond_broadcast(&e->th_cv);
    pthread_mutex_unlock(&e->th_mu);
}

/* Sends a batch of queued frames, c->mu held on entry and on return (released
 * while sending), c->sending claimed for the duration. Sent (or dropped)
 * items go to *done for the caller to release once unlocked.
 * nowait: on a caller's own thread (the loop's doorbell, a receiver's reply):
 * only frames up to INLINE_SEND in all (a 64 KiB one with its header), or
 * the first frame alone up to INLINE_BULK (a 1 MiB chunk: handing it to the
 * sending thread costs a thread wake-up, tens of us in a VM, against the
 * ~150 us the copy takes on either thread), MSG_DONTWAIT, and whatever the
 * socket did not take goes back to the head of the queue for the sending
 * thread. Returns 0,
 * or -errno (the connection is then marked dead). */
static int send_batch(conn *c, bool nowait, sq_item **done)
{
    sq_item *batch[TX_BATCH];
    struct iovec iov[TX_IOV];
    uint8_t spl[TX_IOV]; /* iov[k] is payload to splice (send_vec) */
    conn_priv *p = (conn_priv *)c;
    axf_engine *e = c->e;
    int n = 0, nv = 0;
    uint64_t bytes = 0, cap = 0; /* cap: send no more than this (0: all) */
    while (c->head && n < TX_BATCH && !cap) {
        sq_item *it = c->head;
        /* A goodbye owed: only the rest of a frame partly sent goes, then
         * the goodbye (tx_main); no other frame starts. */
        if (c->bye_owed && (n || !(it->sent || p->spl_in)))
            break;
        uint64_t size = item_size(it) - it->sent;
        int need = 2 + (int)it->h.nseg; /* iovecs it takes at most */
        if (n && (nv + need > TX_IOV || bytes >= TX_BATCH_BYTES))
            break;
        /* AXF_POST_NOHELP: no large frame on the caller's thread. A large
         * vectored WRITE (a batch's 1 MiB frame per connection) goes only
         * in part (INLINE_SEND, the rest to the sending thread): the
         * connections' sending threads copy them side by side, where the
         * posting thread would copy them one after the other, while the
         * peer's receiver has its first bytes meanwhile. */
        if (nowait && !axf_no_help && it->op && it->op->tcp_whole) {
            /* A lone WRITE kept on this connection (tcp.c solo_conn): all
             * of it from the posting thread, as the socket takes it. */
        } else if (nowait && !n && !axf_no_help && it->h.type == FR_WRITEV &&
                   size > INLINE_SEND) {
            cap = INLINE_SEND;
        } else if (nowait && bytes + size > (n || axf_no_help || it->h.type == FR_WRITEV
                                                 ? INLINE_SEND
                                                 : INLINE_BULK)) {
            break;
        }
        c->head = it->next;
        if (!c->head)
            c->tail = NULL;
        it->next = NULL;
        batch[n++] = it;
        bytes += size;
        nv += need;
    }
    if (!n)
        return 0;
    c->sending = true;
    pthread_mutex_unlock(&c->mu);

    int niov = 0, keep = 0;
    for (int i = 0; i < n; i++) {
        sq_item *it = batch[i];
        bool data = it->op && (it->h.type == FR_WRITE || it->h.type == FR_READ_REQ ||
                               it->h.type == FR_WRITEV || it->h.type == FR_READV);
        if (!it->sent && data && atomic_load(&it->op->cancelled)) {
            if (!(it->h.flags & FL_LAST)) {
                it->next = *done;
                *done = it;
                continue;
            }
            /* The group's last frame still goes, empty, so it is acknowledged. */
            it->h.flags |= FL_ABORT;
            it->h.len = 0;
            it->h.nseg = 0;
            it->payload = NULL;
            it->plen = 0;
        }
        batch[keep++] = it;
        int pay = 0, k = item_iov(it, iov + niov, TX_IOV - niov, &pay); /* fits: counted */
        /* The one-copy send (see "one-copy send" above): an initiator's
         * WRITE payload in the window, to a peer the kernel vouched for. */
        bool sp = it->op && (it->h.type == FR_WRITE || it->h.type == FR_WRITEV) &&
                  !(it->h.flags & FL_ABORT) && it->plen >= e->splice_min &&
                  it->plen <= e->splice_max && it->op->total <= e->splice_req_max &&
                  spl_on(c);
        for (int j = 0; j < k; j++)
            spl[niov + j] = sp && j >= pay;
        if (sp && it->spl_c != c) { /* the pin's rule changes (spl_keep): set before any
                                       byte goes; a frame put back unsent may have moved
                                       here (conn_spread): this stream's peer reads it */
            if (it->spl_c)
                conn_unref(it->spl_c);
            conn_ref(c);
            it->spl_c = c;
        }
        niov += k;
    }
    if (cap) { /* the first cap bytes only */
        uint64_t left = cap;
        int k = 0;
        while (k < niov && left > iov[k].iov_len)
            left -= iov[k++].iov_len;
        if (k < niov) {
            iov[k].iov_len = left;
            niov = k + 1;
        }
    }
    uint64_t sent = 0;
    AXF_TR(TR_SEND_B, c->fd, keep ? batch[0]->h.op : 0,
           (keep ? iov_total(iov, niov) : 0) | (uint64_t)nowait << 62);
    int r = niov || p->spl_in ? send_vec(c, iov, spl, niov, nowait, &sent) : 0;
    AXF_TR(TR_SEND_E, c->fd, keep ? batch[0]->h.op : 0, sent);
    uint64_t now = axf_now_us();

    pthread_mutex_lock(&c->mu);
    c->sending = false;
    ka_sent(c, now);
    /* Sent items are done; on a short nowait send the rest goes back. */
    int i = 0;
    for (; i < keep; i++) {
        sq_item *it = batch[i];
        uint64_t left = item_size(it) - it->sent;
        if (r == 0 && sent < left) {
            it->sent += sent;
            break;
        }
        sent -= r == 0 ? left : 0;
        atomic_fetch_sub(&c->reply_bytes, it->reply_cost);
        it->next = *done;
        *done = it;
    }
    conn_room(c);
    if (i < keep) {
        sq_item *head = c->head;
        for (int k = keep - 1; k >= i; k--) {
            batch[k]->next = head;
            head = batch[k];
        }
        if (!c->head)
            c->tail = batch[keep - 1];
        c->head = head;
        tx_wake(c); /* the sending thread takes it from here */
    }
    if (r) {
        ka_send_failed(c, r); /* before it is marked dead */
        conn_mark_dead(c);
    }
    if (c->bye_owed && !c->dead && !conn_mid_frame(c))
        tx_wake(c); /* the frame is out: the sending thread says the goodbye */
    if (c->dead) /* the sending thread may be waiting for us to leave */
        pthread_cond_broadcast(&c->cv);
    return r;
}

void conn_kick(conn *c)
{
    if (c->fd < 0)
        return; /* detached: its frames wait for conn_detached_take */
    sq_item *done = NULL;
    pthread_mutex_lock(&c->mu);
    if (!c->dead && !c->sending && c->head)
        (void)send_batch(c, true, &done);
    /* A lone WRITE sent whole (tcp.c solo_conn, up to 4 MiB) takes a
     * send_batch per TX_BATCH_BYTES: on while the socket takes each batch
     * whole (a short send left the rest with the sending thread, woken). */
    for (sq_item *was = NULL; !c->dead && !c->sending && c->head && c->head != was &&
                              !c->head->sent && c->head->op && c->head->op->tcp_whole &&
                              !axf_no_help;) {
        was = c->head;
        if (send_batch(c, true, &done))
            break;
    }
    if (c->head && !c->sending && !c->dead)
        tx_wake(c);
    /* Spliced items sent here are released (spl_keep) after the unlock, not
     * on one of the connection's threads: counted until then, so that its
     * last thread's spl_settle waits for them (spl_late). */
    conn_priv *p = (conn_priv *)c;
    uint32_t late = 0;
    if (p->spl_ok) {
        for (sq_item *it = done; it; it = it->next)
            late += it->spl_c == c;
        if (late) {
            p->spl_late += late;
            conn_ref(c); /* the items' references go with them */
        }
    }
    pthread_mutex_unlock(&c->mu);
    const axf_faults *ft = late ? faults_of(c->e) : NULL;
    if (ft && ft->kick_release_gap) /* (test only) */
        ft->kick_release_gap(ft->arg);
    release_list(c->e, done);
    if (late) {
        pthread_mutex_lock(&c->mu);
        p->spl_late -= late;
        if (!p->spl_late && p->spl_late_wait) /* not the idle sending thread */
            pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        conn_unref(c);
    }
}

/* The owed goodbye (conn_say_bye), c->mu held, the stream between frames
 * and nobody sending: said on the sending thread, waiting for room as a
 * frame does (bounded as a frame's send is: a peer that neither reads nor
 * pings, or the engine's shutdown, ends it), then the connection ends. */
static void bye_owed_send(conn *c)
{
    c->bye_owed = false;
    c->sending = true; /* nothing else goes on the stream meanwhile */
    /* What conn_say_bye put in the socket already: the same header (a
     * function of the engine's settings), sent on from there. */
    size_t off = c->bye_off;
    pthread_mutex_unlock(&c->mu);
    wire_hdr h;
    ka_ping_frame(c, &h);
    h.flags = FL_BYE;
    struct iovec v = {.iov_base = (uint8_t *)&h + off, .iov_len = sizeof h - off};
    uint64_t sent = 0;
    int r = send_iov(c, &v, 1, false, &sent);
    pthread_mutex_lock(&c->mu);
    c->sending = false;
    if (r == 0)
        conn_bye_out(c);
    else
        conn_mark_dead(c);
    pthread_cond_broadcast(&c->cv); /* an inline sender waiting to leave */
}

static void *tx_main(void *arg)
{
    conn *c = arg;
    axf_engine *e = c->e;

    pthread_mutex_lock(&c->mu);
    ka_restart(c);
    while (!c->dead) {
        if (c->bye_owed && !conn_mid_frame(c)) {
            bye_owed_send(c); /* the connection ends with it */
            break;
        }
        if (atomic_load(&c->flush_close) && !c->head && !c->sending) {
            conn_mark_dead(c); /* the goodbye is out: nothing follows it */
            break;
        }
        if (c->head && !c->sending) {
            sq_item *done = NULL;
            int r = send_batch(c, false, &done);
            pthread_mutex_unlock(&c->mu);
            release_list(e, done);
            pthread_mutex_lock(&c->mu);
            if (r) /* marked dead (and stalled, if it was one) by send_batch */
                break;
            continue;
        }
        uint64_t wait_ms = 0;
        ka_step step = ka_next(c, ((conn_priv *)c)->ex_head != NULL, &wait_ms);
        if (step == KA_PING) {
            c->sending = true;
            pthread_mutex_unlock(&c->mu);
            wire_hdr ping;
            ka_ping_frame(c, &ping);
            struct iovec pv = {.iov_base = &ping, .iov_len = sizeof ping};
            uint64_t sent = 0;
            int r = send_iov(c, &pv, 1, false, &sent);
            pthread_mutex_lock(&c->mu);
            c->sending = false;
            c->ka.pinged = true;
            ka_restart(c);
            if (r) {
                conn_mark_dead(c);
                break;
            }
            continue;
        }
        if (step == KA_STALLED) {
            conn_mark_dead(c);
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_sec += (time_t)(wait_ms / 1000);
        ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        AXF_TR(TR_TX_WAKE, c->fd, 0, 0);
        const axf_faults *ft = faults_of(e);
        if (ft && ft->tx_woke) /* (test only: its wake-ups counted) */
            ft->tx_woke(ft->arg);
    }
    /* An inline sender may still be in send_batch: it puts back or releases
     * its own items. */
    while (c->sending)
        pthread_cond_wait(&c->cv, &c->mu);
    sq_item *rest = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    release_list(e, rest);
    thread_exit(c);
    return NULL;
}

/* Why region r (held) may not be accessed at [off, off + len) for need
 * (for the log), or NULL when it may: one list of the checks, so that the
 * log's reason cannot drift from the check that refused. */
static const char *region_refusal(const region *r, uint64_t key, uint32_t need, uint64_t off,
                                  uint64_t len)
{
    if (r->key != key)
        return "wrong key";
    if (!(r->access & need))
        return "access not granted";
    if (off > r->len || len > r->len - off)
        return "out of the region's bounds";
    /* The socket path reads and writes host memory only: a GPU or file
     * region is never a target of its frames. */
    if (r->kind != AXF_MEM_HOST)
        return "not host memory";
    return NULL;
}

static bool region_fits(const region *r, uint64_t key, uint32_t need, uint64_t off, uint64_t len)
{
    return !region_refusal(r, key, need, off, len);
}

/* Looks up a local region for a remote access; returns it with a ref, or NULL. */
static region *target_region(axf_engine *e, const wire_hdr *h, uint32_t need)
{
    pthread_mutex_lock(&e->mu);
    region *r = region_get(e, h->rid);
    pthread_mutex_unlock(&e->mu);
    if (!r)
        return NULL;
    if (!region_fits(r, h->key, need, h->off, h->len)) {
        region_unref(e, r);
        return NULL;
    }
    return r;
}

/* Why region rid refuses [off, off + len) for need, for the log: looked up
 * again (only on this failure path), so that the checks that pass stay one
 * look-up. The key itself is never logged. */
static const char *refusal_reason(axf_engine *e, uint64_t rid, uint64_t key, uint32_t need,
                                  uint64_t off, uint64_t len)
{
    pthread_mutex_lock(&e->mu);
    region *r = region_get(e, rid);
    pthread_mutex_unlock(&e->mu);
    if (!r)
        return "unknown or revoked region";
    const char *why = region_refusal(r, key, need, off, len);
    region_unref(e, r);
    return why ? why : "changed while checked";
}

/* A peer's access that the target refused (AXF_E_ACCESS answered): said in
 * the log, as a malformed frame is, but at most once per e->refused_log_ms for
 * the whole engine (a peer may open max_conns connections), with the count
 * of those refused quietly since; a peer probing keys cannot flood the log.
 * The window test is now < last + window, not now - last < window: another
 * receiver may have stored a later `last` than this thread's `now`. */
static void refused_access(conn *c, const char *what, uint64_t rid, uint64_t key, uint32_t need,
                           uint64_t off, uint64_t len)
{
    axf_engine *e = c->e;
    unsigned long long now = axf_now_ms() + 1, last = atomic_load(&e->refused_ms);
    /* One receiver wins the line; the others (and the rest of the window)
     * count. */
    if ((last && now < last + e->refused_log_ms) ||
        !atomic_compare_exchange_strong(&e->refused_ms, &last, now)) {
        atomic_fetch_add(&e->refused_quiet, 1);
        return;
    }
    cq_log(e, c->tag,
           "refused a %s frame for region %llu at offset %llu, %llu bytes: %s (%llu more frames "
           "refused since the last such line)",
           what, (unsigned long long)rid, (unsigned long long)off, (unsigned long long)len,
           refusal_reason(e, rid, key, need, off, len), atomic_exchange(&e->refused_quiet, 0));
}

/* A vectored frame's segments, each looked up and checked as target_region
 * does (one hold of e->mu for all): n when every one is, their refs in
 * regs; else the first that is not, and no ref is held. */
static uint32_t target_regions(axf_engine *e, const wire_seg *s, uint32_t n, uint32_t need,
                               region **regs)
{
    uint32_t j = 0;
    pthread_mutex_lock(&e->mu);
    for (; j < n; j++) {
        regs[j] = region_get(e, s[j].rid);
        if (!regs[j])
            break;
        if (!region_fits(regs[j], s[j].key, need, s[j].off, s[j].len)) {
            region_unref(e, regs[j]);
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    if (j < n)
        for (uint32_t k = 0; k < j; k++)
            region_unref(e, regs[k]);
    return j;
}

/* Reads a vectored frame's segment table (after its header) and checks its
 * shape: 1..AXF_MAX_SEGS segments, none empty, their lengths summing to the
 * header's len. NULL, or why the frame is malformed (*proto) or the
 * connection lost (*io). */
static const char *rx_segs(conn *c, const wire_hdr *h, wire_seg *segs, bool *proto, int *io)
{
    if (!h->nseg || h->nseg > AXF_MAX_SEGS || h->len > AXF_MAX_FRAME) {
        *proto = true;
        return "vectored frame of invalid size";
    }
    *io = rx_read(c, segs, h->nseg * sizeof *segs);
    if (*io)
        return "connection lost inside a segment table";
    uint64_t sum = 0;
    for (uint32_t j = 0; j < h->nseg; j++) {
        if (!segs[j].len || segs[j].len > AXF_MAX_FRAME) {
            *proto = true;
            return "vectored frame segment of invalid length";
        }
        sum += segs[j].len; /* at most 64 x 256 MiB: no overflow */
    }
    if (sum != h->len) {
        *proto = true;
        return "vectored frame's segments do not sum to its length";
    }
    return NULL;
}

/* A WRITE payload the target may not take: the group fails with
 * AXF_E_ACCESS naming its first refused descriptor, the bytes are read and
 * dropped. 0, or -errno from the socket. */
static int reject_write(conn *c, uint8_t *scratch, uint64_t len, uint64_t index)
{
    if (c->grp_status == AXF_OK) {
        c->grp_status = AXF_E_ACCESS;
        c->grp_fail = index;
    }
    return discard(c, scratch, len);
}

static bool valid_status(int32_t st)
{
    return st <= 0 && st >= AXF_E_NOTFOUND;
}

/* Returns NULL to continue, or a reason (protocol errors set *proto). */
static const char *rx_target(conn *c, const wire_hdr *h, uint8_t *scratch, bool *proto, int *io)
{
    axf_engine *e = c->e;
    switch (h->type) {
    case FR_WRITE:
    case FR_WRITEV: {
        bool vec = h->type == FR_WRITEV;
        if (h->len > AXF_MAX_FRAME) {
            *proto = true;
            return "oversized WRITE frame";
        }
        if (!c->in_grp) {
            c->in_grp = true;
            c->grp_op = h->op;
            c->grp_status = AXF_OK;
            c->grp_fail = 0;
            c->grp_bytes = 0;
        } else if (c->grp_op != h->op) {
            *proto = true;
            return "WRITE frames of two requests interleaved";
        }
        if (h->flags & FL_ABORT) {
            if (h->len || h->nseg) {
                *proto = true;
                return "aborted WRITE frame with payload";
            }
            if (c->grp_status == AXF_OK)
                c->grp_status = AXF_E_CANCELLED;
        } else if (vec) {
            wire_seg segs[AXF_MAX_SEGS];
            region *regs[AXF_MAX_SEGS];
            const char *bad = rx_segs(c, h, segs, proto, io);
            if (bad)
                return bad;
            uint32_t n = h->nseg, ok = target_regions(e, segs, n, AXF_ACCESS_WRITE, regs);
            if (ok == n) {
                struct iovec iov[AXF_MAX_SEGS + 1];
                for (uint32_t j = 0; j < n; j++)
                    iov[j] = (struct iovec){.iov_base = regs[j]->addr + segs[j].off,
                                            .iov_len = segs[j].len};
                /* Not polled for: a vectored frame is a batch's, striped
                 * over several connections whose receivers all have bytes
                 * to copy; a poller among them takes a CPU from them.
                 * Measured, 256 x 16 KiB WRITE batches side by side: 0.76x
                 * and 0.83x main polled, 1.22x not (CPU per GB 0.34 vs 0.40). */
                *io = rx_readv(c, iov, (int)n, false);
                for (uint32_t j = 0; j < n; j++)
                    region_unref(e, regs[j]);
                if (*io)
                    return "connection lost inside a WRITE payload";
                c->grp_bytes += h->len;
            } else {
                refused_access(c, "WRITE", segs[ok].rid, segs[ok].key, AXF_ACCESS_WRITE,
                               segs[ok].off, segs[ok].len);
                if ((*io = reject_write(c, scratch, h->len, segs[ok].index)))
                    return "connection lost inside a rejected WRITE payload";
            }
        } else {
            region *r = target_region(e, h, AXF_ACCESS_WRITE);
            if (r) {
                *io = rx_read(c, r->addr + h->off, h->len);
                region_unref(e, r);
                if (*io)
                    return "connection lost inside a WRITE payload";
                c->grp_bytes += h->len;
            } else {
                refused_access(c, "WRITE", h->rid, h->key, AXF_ACCESS_WRITE, h->off, h->len);
                if ((*io = reject_write(c, scratch, h->len, h->index)))
                    return "connection lost inside a rejected WRITE payload";
            }
        }
        if (h->flags & FL_LAST) {
            sq_item *ack = sq_new(FR_WRITE_ACK, c->grp_op);
            if (!ack)
                return "out of memory";
            ack->h.status = c->grp_status;
            ack->h.index = c->grp_fail;
            ack->h.len = c->grp_bytes;
            c->in_grp = false;
            conn_enqueue_reply(c, ack, false);
            conn_kick(c); /* replies go out from here: no handoff */
        }
        return NULL;
    }
    case FR_READV: {
        if (h->flags & FL_ABORT) {
            if (h->len || h->nseg) {
                *proto = true;
                return "aborted READ request with segments";
            }
        }
        wire_seg segs[AXF_MAX_SEGS];
        region *regs[AXF_MAX_SEGS];
        if (!(h->flags & FL_ABORT)) {
            const char *bad = rx_segs(c, h, segs, proto, io);
            if (bad)
                return bad;
        }
        sq_item *resp = sq_new(FR_READV_RESP, h->op);
        if (!resp)
            return "out of memory";
        resp->h.index = h->index;
        resp->h.flags = h->flags & FL_LAST;
        if (h->flags & FL_ABORT) {
            resp->h.status = AXF_E_CANCELLED;
        } else {
            uint32_t n = h->nseg, ok = target_regions(e, segs, n, AXF_ACCESS_READ, regs);
            if (ok == n) {
                /* One block: the echoed table, the pieces, the refs. */
                uint8_t *blk = malloc(n * (sizeof(wire_seg) + sizeof(uint8_t *) +
                                           sizeof(region *)));
                if (!blk) {
                    for (uint32_t j = 0; j < n; j++)
                        region_unref(e, regs[j]);
                    sq_drop(e, resp);
                    return "out of memory";
                }
                resp->owned = blk;
                resp->segs = (wire_seg *)blk;
                resp->pieces = (const uint8_t **)(blk + n * sizeof(wire_seg));
                resp->regs = (region **)(blk + n * (sizeof(wire_seg) + sizeof(uint8_t *)));
                for (uint32_t j = 0; j < n; j++) {
                    resp->segs[j] = segs[j];
                    resp->segs[j].key = 0; /* the initiator's own: nothing to echo */
                    resp->pieces[j] = regs[j]->addr + segs[j].off;
                    resp->regs[j] = regs[j];
                }
                resp->nregs = n;
                resp->h.nseg = n;
                resp->h.len = h->len;
                resp->plen = h->len;
            } else {
                refused_access(c, "READ", segs[ok].rid, segs[ok].key, AXF_ACCESS_READ,
                               segs[ok].off, segs[ok].len);
                resp->h.status = AXF_E_ACCESS;
                resp->h.index = segs[ok].index;
            }
        }
        conn_enqueue_reply(c, resp, false);
        ((conn_priv *)c)->kick_owed = true;
        return NULL;
    }
    case FR_READ_REQ: {
        if (h->len > AXF_MAX_FRAME || (!h->len && !(h->flags & FL_ABORT))) {
            *proto = true;
            return "READ request of invalid length";
        }
        sq_item *resp = sq_new(FR_READ_RESP, h->op);
        if (!resp)
            return "out of memory";
        resp->h.index = h->index;
        resp->h.rid = h->rid;
        resp->h.off = h->off;
        resp->h.flags = h->flags & FL_LAST;
        if (h->flags & FL_ABORT) {
            resp->h.status = AXF_E_CANCELLED;
        } else {
            region *r = target_region(e, h, AXF_ACCESS_READ);
            if (r) {
                resp->reg = r;
                resp->payload = r->addr + h->off;
                resp->plen = h->len;
                resp->h.len = h->len;
            } else {
                refused_access(c, "READ", h->rid, h->key, AXF_ACCESS_READ, h->off, h->len);
                resp->h.status = AXF_E_ACCESS;
            }
        }
        conn_enqueue_reply(c, resp, false);
        /* Sent from here (no handoff), but together with the next ones when
         * more READ requests are here already: one sendmsg for several
         * responses (rx_loop sends what is owed before anything else). */
        ((conn_priv *)c)->kick_owed = true;
        return NULL;
    }
    case FR_NOTIFY: {
        if (!h->len || h->len > AXF_MAX_NOTIFY) {
            *proto = true;
            return "NOTIFY frame of invalid length";
        }
        *io = rx_read(c, scratch, h->len);
        if (*io)
            return "connection lost inside a NOTIFY payload";
        /* Its record's slot before its acknowledgement: one that cannot be
         * delivered (the ring full and out of memory) is never acknowledged;
         * the connection closes and its sender's transfer fails (or moves to
         * another rail) rather than completing for a notification nobody
         * will see. */
        if (cq_reserve(e) != AXF_OK)
            return "out of memory: no room for a notification";
        /* Everything sent before this frame on every connection of the request
         * was acknowledged before the initiator sent it: data is in memory. */
        /* The acknowledgement is queued before the application can see the
         * notification, so a receiver that closes right after receive() does
         * not usually leave it unsent. */
        sq_item *ack = sq_new(FR_NOTIFY_ACK, h->op);
        if (!ack) {
            cq_unreserve(e);
            return "out of memory";
        }
        conn_enqueue_reply(c, ack, false);
        conn_kick(c);
        /* One credit, until the application consumed it (axf_notify_release). */
        atomic_fetch_add(&c->notify_out, 1);
        cq_push_claimed(e, AXF_CQ_NOTIFY, AXF_OK, h->op, c->tag, 0, 0, scratch, h->len);
        return NULL;
    }
    case FR_REVOKE_ACK:
        if (h->len || revoke_acked(e, c, h->rid) != AXF_OK) {
            *proto = true;
            return "REVOKE_ACK for no revocation";
        }
        return NULL;
    case FR_BYE:
        if (h->len) {
            *proto = true;
            return "BYE frame with payload";
        }
        bye_received(e, c);
        return BYE_REASON;
    default:
        *proto = true;
        return "frame type not valid towards a target";
    }
}

/* A group is whole (c->mu held, its expectation already off the list). The
 * connection's rate is the bytes of whole groups over the time it had replies
 * owed, taken over windows of RATE_WINDOW_US at least: single acknowledgements
 * arrive in bursts, and per-group intervals would measure the bursts. */
static void measure_rate(conn *c, const expect *x)
{
    conn_priv *p = (conn_priv *)c;
    uint64_t now = axf_now_us();
    atomic_fetch_add(&c->bytes, x->bytes);
    c->win_bytes += x->bytes;
    uint64_t busy = c->win_busy_us + (c->busy_since_us ? now - c->busy_since_us : 0);
    if (!p->ex_head && c->busy_since_us) { /* nothing owed any more: idle from now */
        c->win_busy_us += now - c->busy_since_us;
        c->busy_since_us = 0;
    }
    if (busy < RATE_WINDOW_US || c->win_bytes < (256u << 10))
        return;
    uint64_t sample = c->win_bytes * 1000u / busy;
    c->win_bytes = 0;
    c->win_busy_us = 0;
    if (c->busy_since_us)
        c->busy_since_us = now;
    uint64_t old = atomic_load(&c->rate);
    uint64_t rate = old ? (3 * old + sample) / 4 : sample;
    atomic_store(&c->rate, rate ? rate : 1);
    if (!old || rate > old + old / 4 || rate < old - old / 4)
        ep_conns_changed(c->ep);
}

/* A READ's large response was read (its group is complete): the TCP
 * acknowledgement of its last bytes goes out now. The connection takes
 * turns (request, response), so the kernel holds it back to ride on our
 * next frame (or its delayed-ACK timer, 40 ms at least): the peer's send
 * buffer then still holds the response's tail while our next request
 * arrives. Measured, 1 MiB READs awaited one at a time on loopback: that
 * request's send took ~32 us of the posting thread and woke the target's
 * receiver (it had stopped polling); acknowledged here, ~7 us and the
 * target's poll caught it (READ 1 MiB 1.07-1.16x). Sent once the
 * completion is out: the application takes it meanwhile. Only for a group
 * of one response: 16 MiB READs (groups of 4 MiB) measured 0.90x with it.
 * (A WRITE's payload is acknowledged by the reply the target sends at once.) */
static void rx_ack_now(conn *c)
{
    if (!((conn_priv *)c)->tcp)
        return;
    int one = 1; /* not sticky: the kernel goes back to delaying by itself */
    (void)setsockopt(c->fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
}

static const char *rx_initiator(conn *c, const wire_hdr *h, bool *proto, int *io)
{
    conn_priv *p = (conn_priv *)c;
    if (h->type == FR_REVOKE) { /* unsolicited: the target deregistered a region */
        if (h->len) {
            *proto = true;
            return "REVOKE frame with payload";
        }
        if (revoke_received(c->e, c, h->rid, h->key) == AXF_E_PROTOCOL) {
            *proto = true;
            return "REVOKE repeated while the first waits";
        }
        return NULL;
    }
    ka_progress(c);
    pthread_mutex_lock(&c->mu);
    expect *x = p->ex_head;
    pthread_mutex_unlock(&c->mu);
    /* A READ group's responses are plain or vectored, as its frames were. */
    uint16_t type = h->type == FR_READV_RESP ? FR_READ_RESP : h->type;
    if (!x || x->type != type || x->op_id != h->op || !valid_status(h->status)) {
        /* Said in detail: from a peer of ours this is a bug worth chasing. */
        cq_log(c->e, c->tag,
               "unexpected reply: type %u op %llu index %llu flags %u status %d len %llu; "
               "expected %s type %u op %llu",
               (unsigned)h->type, (unsigned long long)h->op, (unsigned long long)h->index,
               (unsigned)h->flags, (int)h->status, (unsigned long long)h->len,
               x ? "head" : "nothing:", x ? (unsigned)x->type : 0u,
               x ? (unsigned long long)x->op_id : 0ull);
        *proto = true;
        return "reply that matches no outstanding request";
    }
    op *o = x->op;
    bool last = (h->type != FR_READ_RESP && h->type != FR_READV_RESP) || (h->flags & FL_LAST);
    if (h->type == FR_READ_RESP) {
        if (h->index >= o->n) {
            *proto = true;
            return "READ response for a descriptor out of range";
        }
        const axf_desc *d = &o->d[h->index];
        if (h->status != AXF_OK) {
            if (h->len) {
                *proto = true;
                return "failed READ response with payload";
            }
            x->failed = true;
            op_set_status(o, h->status, h->index);
        } else {
            if (!h->len || h->off < d->roff || h->off - d->roff > d->len ||
                h->len > d->len - (h->off - d->roff)) {
                *proto = true;
                return "READ response outside its request";
            }
            if (h->len > x->req_bytes - x->bytes) {
                *proto = true;
                return "READ responses past what the group asked for";
            }
            /* Its first bytes copied already by a spinner (help_more). */
            uint64_t have = p->mid ? p->mid_have : 0;
            p->mid = false;
            p->mid_have = 0;
            if (have < h->len)
                *io = rx_read(c, o->laddr[h->index] + (h->off - d->roff) + have, h->len - have);
            if (*io)
                return "connection lost inside a READ payload";
            x->bytes += h->len;
        }
    } else if (h->type == FR_READV_RESP) {
        if (h->status != AXF_OK) {
            if (h->len || h->nseg) {
                *proto = true;
                return "failed READ response with payload";
            }
            x->failed = true;
            op_set_status(o, h->status, h->index < o->n ? h->index : 0);
        } else {
            if (h->len > x->req_bytes - x->bytes) {
                *proto = true;
                return "READ responses past what the group asked for";
            }
            wire_seg segs[AXF_MAX_SEGS];
            const char *bad = rx_segs(c, h, segs, proto, io);
            if (bad)
                return bad;
            /* Every segment lands inside what its descriptor asked for, or
             * nothing is read. */
            struct iovec iov[AXF_MAX_SEGS + 1];
            for (uint32_t j = 0; j < h->nseg; j++) {
                const wire_seg *g = &segs[j];
                const axf_desc *d = g->index < o->n ? &o->d[g->index] : NULL;
                if (!d || g->off < d->roff || g->off - d->roff > d->len ||
                    g->len > d->len - (g->off - d->roff)) {
                    *proto = true;
                    return "READ response outside its request";
                }
                iov[j] = (struct iovec){.iov_base = o->laddr[g->index] + (g->off - d->roff),
                                        .iov_len = g->len};
            }
            *io = rx_readv(c, iov, (int)h->nseg, false); /* as a WRITEV's */
            if (*io)
                return "connection lost inside a READ payload";
            x->bytes += h->len;
        }
    } else if (h->type == FR_WRITE_ACK) {
        /* Its byte count is the peer's word: ours is what the group asked
         * (read under c->mu below: conn_spread may cut a group). */
        if (h->status != AXF_OK)
            op_set_status(o, h->status, h->index < o->n ? h->index : 0);
    }
    /* The target answers every READ request of a group once, in order: a
     * group that did not fail is answered with exactly the bytes it asked
     * for (more was refused before its payload was read). A short one would
     * complete with destination bytes never written. Counted, not mapped: a
     * peer answering one range twice and another never in the same count is
     * not caught here (a target can send wrong bytes anyway: it is the
     * data's source); a buggy one's short or long answer is. */
    if (last && x->type == FR_READ_RESP && !x->failed && x->bytes != x->req_bytes) {
        *proto = true;
        return "READ responses short of what the group asked for";
    }
    if (last) {
        pthread_mutex_lock(&c->mu);
        if (h->type == FR_WRITE_ACK && h->status == AXF_OK)
            x->bytes = x->req_bytes;
        p->ex_head = x->next;
        if (!p->ex_head)
            p->ex_tail = NULL;
        if (x->type != FR_NOTIFY_ACK)
            measure_rate(c, x);
        else if (!p->ex_head && c->busy_since_us) {
            c->win_busy_us += axf_now_us() - c->busy_since_us;
            c->busy_since_us = 0;
        }
        sq_item *read = p->spl_holds ? spl_read_take(c, o) : NULL;
        pthread_mutex_unlock(&c->mu);
        spl_release(c->e, read);
        atomic_fetch_add(&o->nbytes, x->bytes);
        /* A group of one large response: a request awaited alone, or half of one. */
        bool ack_now = h->type == FR_READ_RESP && h->len >= ACK_NOW_MIN && x->bytes == h->len;
        expect_free(x);
        AXF_TR(TR_UNIT_B, c->fd, h->op, 0);
        op_unit_done(c->e, o);
        AXF_TR(TR_UNIT_E, c->fd, h->op, 0);
        if (ack_now)
            rx_ack_now(c);
    }
    return NULL;
}

/* An initiator connection failed (its receiver is done with it). With other
 * live connections to the same peer (rails), its unfinished groups move to
 * them; a stalled connection's requests fail with AXF_E_TIMEOUT instead. The
 * last connection, a protocol violation (the peer is broken, not the link),
 * or a closing endpoint fail the whole endpoint, promptly. */
static void initiator_conn_lost(conn *c, bool proto)
{
    axf_engine *e = c->e;
    endpoint *ep = c->ep;
    conn_priv *p = (conn_priv *)c;
    bool stalled = atomic_load(&c->stalled), bye = atomic_load(&c->bye_heard);
    pthread_mutex_lock(&e->mu);
    if (bye)
        ep->peer_bye = true;
    pthread_mutex_lock(&c->mu);
    bool lost_expect = p->ex_lost;
    pthread_mutex_unlock(&c->mu);
    bool others = false;
    for (int i = 0; i < ep->nconns; i++)
        others |= ep->conns[i] != c && !atomic_load(&ep->conns[i]->down);
    /* A goodbye ends the endpoint, not one connection (the peer's engine
     * shuts down: its other connections end too). Handled per connection, a
     * peer saying it on one left that rail short for good (no re-dial after
     * a close) and a later real loss reported as a close (rev17b). */
    if (proto || lost_expect || !others || bye || ep->closing || e->shut ||
        !ep->xp->reroute) {
        if (stalled) { /* its requests time out; the endpoint's others are lost with it */
            pthread_mutex_lock(&c->mu);
            for (expect *x = p->ex_head; x; x = x->next)
                op_set_status(x->op, AXF_E_TIMEOUT, 0);
            pthread_mutex_unlock(&c->mu);
        }
        ep->dead = true;
        atomic_store(&ep->halt, true); /* same-host copies stop at their next chunk */
        for (int i = 0; i < ep->nconns; i++)
            conn_kill(ep->conns[i]);
        pthread_mutex_unlock(&e->mu);
        if (stalled)
            cq_log(e, c->tag, "closing connection: no progress for %u ms", e->cfg.stall_ms);
        return;
    }
    /* Unsent data must not reach the peer later, should the link come back. */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    (void)setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    ep_conns_changed(ep);
    pthread_mutex_lock(&c->mu);
    expect *list = p->ex_head;
    p->ex_head = p->ex_tail = NULL;
    pthread_mutex_unlock(&c->mu);
    expect *finished = NULL, *moved = NULL;
    uint64_t nmoved = 0;
    for (expect *x = list, *next; x; x = next) {
        next = x->next;
        op *o = x->op;
        bool ok = false;
        if (stalled)
            op_set_status(o, AXF_E_TIMEOUT, 0);
        else if (!atomic_load(&o->cancelled) && atomic_load(&o->status) == AXF_OK) {
            if (x->type == FR_NOTIFY_ACK) {
                conn *to = notify_enqueue(e, o);
                if (to)
                    conn_signal(to);
                ok = to != NULL;
            } else {
                ok = ep->xp->reroute(e, o, x->slot, x->chunks, x->nchunks, 0, x->count, 0);
            }
        }
        if (ok) {
            nmoved++;
            x->next = moved;
            moved = x;
        } else {
            op_set_status(o, AXF_E_PEER_LOST, 0);
            x->next = finished;
            finished = x;
        }
    }
    atomic_fetch_add(&c->reroutes, nmoved);
    ep->reroutes += nmoved;
    uint64_t ep_id = ep->id, tag = ep->tag;
    uint32_t rail = c->rail;
    pthread_mutex_unlock(&e->mu);
    if (stalled)
        cq_log(e, c->tag, "closing connection: no progress for %u ms", e->cfg.stall_ms);
    /* The rail first, so a caller woken by a failed transfer sees it down. */
    cq_push(e, AXF_CQ_RAIL_DOWN,
            stalled ? AXF_E_TIMEOUT : bye ? AXF_E_CLOSED : AXF_E_PEER_LOST, ep_id, tag, nmoved,
            rail, NULL, 0);
    while (moved) {
        expect *n = moved->next;
        expect_free(moved);
        moved = n;
    }
    while (finished) {
        expect *n = finished->next;
        op *o = finished->op;
        expect_free(finished);
        op_unit_done(e, o);
        finished = n;
    }
}

/* ------------------------------------------------------------ joins */

/* A group (or its tail) conn_spread took off a connection's queue, queued
 * anew over the live connections once every queue was looked at. */
struct spread_job {
    op *o;
    int slot;
    const chunk_ref *list; /* the group's chunk list (x's or own), or NULL: its slot's */
    size_t n, from, to;    /* the chunks [from, to) of it that move */
    expect *x;             /* a whole group's expectation, taken off the list */
    chunk_ref *own;        /* a cut group's moved chunks, copied */
    struct spread_job *next;
};

static void spread_job_free(struct spread_job *j)
{
    if (j->x)
        expect_free(j->x);
    free(j->own);
    free(j);
}

/* Takes c's queued frames that may move off it (conn_spread), under c->mu:
 * a group none of whose frames was sent (and whose reply is not the next
 * one awaited, which the receiver may be reading against), whole, its
 * expectation with it; of a WRITE group being sent, the frames after its
 * first unsent one, which then ends the group (FL_LAST: the peer
 * acknowledges what came before it), the moved part counted as one more
 * unit of the op until it is queued elsewhere. A READ group's requests are
 * headers that leave at once: moved only whole, never cut (its responses
 * are counted against the expectation without c->mu). Each one a job
 * appended at **tail; its frames onto left->dropped. */
static void spread_take(conn *c, struct spread_job ***tail, conn_spread_left *left)
{
    conn_priv *p = (conn_priv *)c;
    pthread_mutex_lock(&c->mu);
    if (c->dead || !c->head) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    /* The queued frames that bear an expectation have the list's last ones,
     * in order (both recorded in one hold of c->mu, conn_enqueue_chain). */
    size_t nq = 0, nx = 0;
    for (sq_item *it = c->head; it; it = it->next)
        nq += item_want(it) != 0;
    for (expect *x = p->ex_head; x; x = x->next)
        nx++;
    if (nq > nx) { /* a peer answered what it was not sent: leave it be */
        pthread_mutex_unlock(&c->mu);
        return;
    }
    expect **xl = &p->ex_head, *xprev = NULL;
    for (size_t k = 0; k < nx - nq; k++) {
        xprev = *xl;
        xl = &(*xl)->next;
    }
    sq_item **link = &c->head, *before = NULL; /* before: the item *link is in (NULL: head) */
    while (*link) {
        sq_item *f0 = *link;
        if (!item_data(f0)) {
            if (item_want(f0)) {
                xprev = *xl;
                xl = &(*xl)->next;
            }
            before = f0;
            link = &f0->next;
            continue;
        }
        /* A group's queued frames: f0 up to its LAST one, one after another. */
        sq_item *last = f0;
        uint32_t m = 1;
        while (!(last->h.flags & FL_LAST) && last->next && last->next->op == f0->op &&
               item_data(last->next)) {
            last = last->next;
            m++;
        }
        expect *x = *xl;
        if (!(last->h.flags & FL_LAST) || !x || x->op != f0->op || x->type != item_want(last))
            break; /* (not a queue conn_enqueue_chain made: leave the rest) */
        op *o = f0->op;
        bool write = f0->h.type == FR_WRITE || f0->h.type == FR_WRITEV;
        bool whole = m == x->frames && !f0->sent && x != p->ex_head;
        uint32_t keep = f0->sent ? 1 : 0; /* a cut group's frames before its new LAST one */
        struct spread_job *j = NULL;
        if (!atomic_load(&o->cancelled) && atomic_load(&o->status) == AXF_OK &&
            (whole || (write && keep + 1 < m)))
            j = calloc(1, sizeof *j);
        if (j && whole) {
            *link = last->next;
            if (c->tail == last)
                c->tail = before;
            last->next = left->dropped;
            left->dropped = f0;
            *xl = x->next;
            if (p->ex_tail == x)
                p->ex_tail = xprev;
            *j = (struct spread_job){.o = o, .slot = x->slot, .list = x->chunks,
                                     .n = x->nchunks, .from = 0, .to = x->count, .x = x};
            /* o's spliced frames of groups acknowledged here wait as holds
             * while a group of o is owed here (spl_keep): this may have been
             * the last, and no acknowledgement here would free them now
             * (tcp27). Released by conn_spread_end, e->mu no longer held. */
            for (sq_item *r = p->spl_holds ? spl_read_take(c, o) : NULL, *rn; r; r = rn) {
                rn = r->next;
                r->next = left->spl_read;
                left->spl_read = r;
            }
            **tail = j;
            *tail = &j->next;
            continue; /* *link and *xl are the next ones now */
        }
        sq_item *kf = f0; /* the group's new last frame (keep + 1 < m: more follow) */
        size_t mc = 0;
        uint64_t mb = 0;
        if (j) {
            for (uint32_t k = 0; k < keep; k++)
                kf = kf->next;
            for (sq_item *f = kf->next;; f = f->next) {
                mc += f->h.nseg ? f->h.nseg : 1;
                mb += f->h.len;
                if (f == last)
                    break;
            }
            if (mc > x->count || mb > x->req_bytes) { /* (never: made by conn_enqueue_chain) */
                free(j);
                j = NULL;
            }
        }
        if (j && x->chunks) { /* the list's tail is x's: copied, x may go first */
            j->own = malloc(mc * sizeof *j->own);
            if (j->own)
                memcpy(j->own, x->chunks + (x->count - mc), mc * sizeof *j->own);
            else {
                free(j);
                j = NULL;
            }
        }
        if (j) {
            sq_item *moved = kf->next;
            kf->next = last->next;
            if (c->tail == last)
                c->tail = kf;
            kf->h.flags |= FL_LAST;
            last->next = left->dropped;
            left->dropped = moved;
            j->o = o;
            j->slot = x->slot;
            if (j->own) {
                j->list = j->own;
                j->n = mc;
                j->to = mc;
            } else {
                j->from = x->count - mc;
                j->to = x->count;
            }
            x->count -= mc;
            x->req_bytes -= mb;
            x->frames -= m - keep - 1;
            /* Before kf can be sent and answered: the op stays unfinished. */
            atomic_fetch_add(&o->remaining, 1);
            **tail = j;
            *tail = &j->next;
            last = kf;
        }
        xprev = x;
        xl = &x->next;
        before = last;
        link = &last->next;
    }
    pthread_mutex_unlock(&c->mu);
}

void conn_spread(axf_engine *e, endpoint *ep, conn_spread_left *left)
{
    memset(left, 0, sizeof *left);
    int live = 0;
    for (int i = 0; i < ep->nconns; i++)
        live += !atomic_load(&ep->conns[i]->down);
    if (!ep->xp->reroute || ep->dead || ep->closing || e->shut || live < 2)
        return;
    struct spread_job *jobs = NULL, **tail = &jobs;
    for (int i = 0; i < ep->nconns; i++)
        if (!atomic_load(&ep->conns[i]->down) && ep->conns[i]->fd >= 0)
            spread_take(ep->conns[i], &tail, left);
    if (!jobs)
        return;
    /* Queued anew in the order they were queued, over every live
     * connection (by the endpoint's schedule, which counts the new one). */
    struct spread_job **ftail = &left->failed;
    for (struct spread_job *j = jobs, *next; j; j = next) {
        next = j->next;
        j->next = NULL;
        const axf_faults *ft = faults_of(e);
        if (ft && ft->spread_nomem) /* (test only) */
            op_set_status(j->o, AXF_E_NOMEM, 0);
        else if (ep->xp->reroute(e, j->o, j->slot, j->list, j->n, j->from, j->to,
                                 AXF_MOVE_SPREAD)) {
            spread_job_free(j);
            continue;
        }
        if (atomic_load(&j->o->status) == AXF_OK) /* (out of memory set its own) */
            op_set_status(j->o, AXF_E_PEER_LOST, 0);
        *ftail = j; /* its unit ends once e->mu is released */
        ftail = &j->next;
    }
    if (left->failed) { /* until their units ended: endpoint_conn_finished then */
        ep->live_conns++;
        left->held = ep;
    }
    for (int i = 0; i < ep->nconns; i++)
        if (!atomic_load(&ep->conns[i]->down)) {
            conn_ref(ep->conns[i]);
            left->wake[left->nwake++] = ep->conns[i];
        }
}

void conn_spread_end(axf_engine *e, conn_spread_left *left)
{
    /* The failed groups' units first: the moved frames still pin their ops
     * (an op a unit finishes here completes only once they are released),
     * and the endpoint, held, is not lost meanwhile (nothing claims them). */
    for (struct spread_job *j = left->failed, *next; j; j = next) {
        next = j->next;
        op *o = j->o;
        spread_job_free(j);
        op_unit_done(e, o);
    }
    release_list(e, left->dropped);
    spl_release(e, left->spl_read);
    for (int i = 0; i < left->nwake; i++) {
        conn *c = left->wake[i];
        pthread_mutex_lock(&c->mu);
        if (!c->dead && c->head && !c->sending)
            tx_wake(c);
        pthread_mutex_unlock(&c->mu);
        conn_unref(c);
    }
    if (left->held) /* as its last connection would, if all left meanwhile */
        endpoint_conn_finished(e, left->held);
}

const char *conn_rx_frame(conn *c, const wire_hdr *h, uint8_t *scratch, bool *proto, int *io)
{
    if (h->nseg && h->type != (c->ep ? FR_READV_RESP : FR_WRITEV) &&
        (c->ep || h->type != FR_READV)) {
        *proto = true;
        return "segments on a frame that has none";
    }
    return c->ep ? rx_initiator(c, h, proto, io) : rx_target(c, h, scratch, proto, io);
}

/* Polls (non-blocking reads, the CPU yielded between them) up to us
 * microseconds for the next frame's header: 1 it came (whole in *h), 0 it
 * did not (nothing of it read), or -errno (-EPIPE: orderly close). */
static int rx_spin(conn *c, wire_hdr *h, uint32_t us)
{
    conn_priv *p = (conn_priv *)c;
    if (p->rb_len) { /* (some of) it is here: the rest follows */
        int r = rx_read(c, h, sizeof *h);
        return r ? r : 1;
    }
    p->rb_pos = 0;
    uint64_t until = axf_now_us() + us;
    for (;;) {
        struct iovec iov[2] = {{.iov_base = h, .iov_len = sizeof *h},
                               {.iov_base = p->rb, .iov_len = RX_AHEAD}};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
        ssize_t r = recvmsg(c->fd, &m, MSG_DONTWAIT);
        if (r > 0) {
            if ((size_t)r >= sizeof *h) {
                p->rb_len = (uint32_t)((size_t)r - sizeof *h);
                return 1;
            }
            int rest = rx_read(c, (uint8_t *)h + r, sizeof *h - (size_t)r);
            return rest ? rest : 1;
        }
        if (r == 0)
            return -EPIPE;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return -errno;
        if (axf_now_us() >= until)
            return 0;
        sched_yield(); /* the peer we wait for may need this CPU */
    }
}

/* rx_spin by RX_SPINNERS_MAX receivers of the engine at a time (spin_take),
 * else 0 at once. */
static int rx_spin_one(conn *c, wire_hdr *h, uint32_t us)
{
    if (!spin_take(c->e)) {
        AXF_TR(TR_SPIN_B, c->fd, 0, 0);
        return 0;
    }
    AXF_TR(TR_SPIN_B, c->fd, 0, us);
    int got = rx_spin(c, h, us);
    AXF_TR(TR_SPIN_E, c->fd, 0, (uint64_t)(int64_t)got);
    spin_give(c->e);
    return got;
}

/* Whether a receiver parks for a spinning thread before its next header:
 * an initiator's connection, nothing read ahead, replies read (or
 * readable) by a spinner within HELP_PARK_US. */
static bool rx_may_park(conn *c)
{
    conn_priv *p = (conn_priv *)c;
    if (!c->ep || c->replay || p->rb_len || p->mid ||
        c->e->cfg.target_poll_us == UINT32_MAX)
        return false;
    uint64_t last = atomic_load(&c->help_us);
    return last && axf_now_us() < last + HELP_PARK_US;
}

/* Whether c owes a reply now (a request of its in flight). */
static bool rx_owed(conn *c)
{
    pthread_mutex_lock(&c->mu);
    bool owed = ((conn_priv *)c)->ex_head != NULL;
    pthread_mutex_unlock(&c->mu);
    return owed;
}

/* Parks the receiver (nobody reads the socket but a spinner: conn_help)
 * until it is handed back or HELP_PARK_US pass without a reply read for it.
 * first: its park as it starts (rx_loop): a request posted before it was
 * parked may have had its spinner already, which left without handing
 * anything back (conn_help_end found nobody parked): with no spinner now
 * and a reply owed, it reads its socket itself at once. Otherwise a
 * spinner is there (its end, which unparks, comes after this park: the
 * seq_cst pair nhelp / cq_spinners) or comes with the next request. */
static void rx_park(conn *c, bool first)
{
    axf_engine *e = c->e;
    pthread_mutex_lock(&e->help_mu);
    int n = atomic_load(&e->nhelp);
    if (n == AXF_HELP_MAX) {
        pthread_mutex_unlock(&e->help_mu);
        return;
    }
    e->help[n] = c;
    atomic_store(&e->nhelp, n + 1);
    atomic_store(&c->rx_hold, RX_PARKED);
    pthread_mutex_unlock(&e->help_mu);
    if (first && !atomic_load(&e->cq_spinners) && rx_owed(c)) {
        int parked = RX_PARKED; /* (nobody waits on it but this thread: no wake) */
        (void)atomic_compare_exchange_strong(&c->rx_hold, &parked, RX_SELF);
    }
    for (;;) {
        int st = atomic_load(&c->rx_hold);
        if (st == RX_SELF)
            break;
        if (st == RX_HELPER) { /* a spinner reads: wait for it to be done */
            futex_wait_us(&c->rx_hold, RX_HELPER, 100);
            continue;
        }
        uint64_t now = axf_now_us(), until = atomic_load(&c->help_us) + HELP_PARK_US;
        if (atomic_load(&c->down) || now >= until) { /* conn_mark_dead's set down first */
            rx_unpark(c);
            continue;
        }
        futex_wait_us(&c->rx_hold, RX_PARKED, until - now);
    }
    pthread_mutex_lock(&e->help_mu);
    n = atomic_load(&e->nhelp);
    for (int i = 0; i < n; i++) {
        if (e->help[i] == c) {
            e->help[i] = e->help[n - 1];
            atomic_store(&e->nhelp, n - 1);
            break;
        }
    }
    pthread_mutex_unlock(&e->help_mu);
}

/* Whether a READ on initiator connection c is its endpoint's only request
 * in flight (or was, its op just done): only then is its response read by a
 * spinner. Many in flight, their responses come on several connections at
 * once, and the receivers read them side by side where one spinner would read
 * them one after the other: in one side by side through Python (tcp), 4 KiB
 * READs 16 in flight measured 0.68x with every READ's response helped; and
 * 64 KiB READs awaited alone 0.73x (the spinner waits for the whole payload
 * that a receiver copies as it comes: HELP_READ_MAX). */
static bool read_alone(const conn *c)
{
    return atomic_load(&c->ep->ops_alive) <= 1;
}

/* Whether a READ's response of len bytes, of a request alone, is read by a
 * spinner (help_takes) and parks the receiver for one (rx_loop): up to
 * HELP_READ_MAX, and on a loop_cc connection up to HELP_READ_LOOP_MAX (read20:
 * a lone 64 KiB READ's response comes in one or two loopback segments, both
 * sent by the target's single inline send, so the spinner that waits for all
 * of it waits about as long as a receiver blocked in recv would, without the
 * receiver's wake-up). Measured (wheels, 2 vCPUs, a noisy shared VM):
 * tcp14_timeline 64 KiB READs, voluntary switches per request 1.0 -> 0.04-0.07
 * (4939 of 5000 responses read by the spinner, traced); peers/run.py tcp,
 * 3 interleaved rounds against main's wheel (one with the order swapped):
 * READ 64 KiB 1.28x median (1.19-1.64x), 1.77x Mooncake (1.32-1.88); the
 * other one-at-a-time rows 0.92-1.16x (noise). read22: up to 1 MiB, a lone
 * READ that tcp.c tcp_chunk now sends whole on one loop_cc connection; the
 * spinner copies its response as it comes (help_more), the target's one
 * receiver sending it: two busy threads (iperf3's shape) where the halves
 * woke two receivers on each side. Measured (one wheel, the shapes
 * switchable, tcp20_batch.py --size 1048576, 4 interleaved pairs, 2 vCPUs):
 * the median 1 MiB READ 238.8 -> 206.5 us (1.21x, 4/4), GB/s 1.26x (3/4),
 * voluntary switches per request 2.05 -> 0.92. */
static bool help_resp(const conn *c, uint64_t len)
{
    return len <= HELP_READ_MAX || (c->loop_cc && len <= HELP_READ_LOOP_MAX);
}

enum { HELP_NO, HELP_WAIT, HELP_YES };

/* Whether h (peeked) is what the spinner reads: a reply that completes the
 * group the connection expects next, well formed: a WRITE acknowledgement
 * (a header alone: its len is the peer's byte count), or a small READ's one
 * response (its group's last frame and all of its bytes, inside the
 * descriptor) whose payload is here already (avail: the bytes readable), so
 * that reading it never waits for the peer: HELP_YES. HELP_WAIT: such a
 * response whose payload is still coming (nothing is read: the spinner peeks
 * again, help_read). */
static int help_takes(conn *c, const wire_hdr *h, int avail)
{
    if (h->magic != AXF_MAGIC || h->nseg || !valid_status(h->status))
        return HELP_NO;
    bool ack = h->type == FR_WRITE_ACK;
    if (!ack && (h->type != FR_READ_RESP || !(h->flags & FL_LAST) || h->status != AXF_OK ||
                 !h->len || !help_resp(c, h->len) || avail < 0))
        return HELP_NO;
    conn_priv *p = (conn_priv *)c;
    pthread_mutex_lock(&c->mu);
    const expect *x = p->ex_head;
    bool ok = x && x->type == h->type && x->op_id == h->op;
    if (ok && !ack) { /* rx_initiator's checks, passed before anything is read */
        const op *o = x->op;
        const axf_desc *d = h->index < o->n ? &o->d[h->index] : NULL;
        ok = d && x->bytes == 0 && x->req_bytes == h->len && read_alone(c) && h->off >= d->roff &&
             h->off - d->roff <= d->len && h->len <= d->len - (h->off - d->roff);
    }
    pthread_mutex_unlock(&c->mu);
    if (!ok)
        return HELP_NO;
    return ack || (uint64_t)avail >= sizeof *h + h->len ? HELP_YES : HELP_WAIT;
}

/* The bytes readable on c's socket for a READ response peeked (h): its
 * payload is taken only once all of it is here; -1 otherwise. */
static int help_avail(conn *c, const wire_hdr *h)
{
    int n = -1;
    if (h->type == FR_READ_RESP && ioctl(c->fd, FIONREAD, &n) != 0)
        n = -1;
    return n;
}

/* Whether a WRITE acknowledgement of len bytes parks the receiver for a
 * spinner (rx_loop, help_read): groups up to HELP_BYTES_MAX, and on a
 * connection through loopback with loop_cc (tcp19b) up to HELP_LOOP_MAX, a
 * lone 1 MiB WRITE sent whole on one connection (tcp.c tcp_chunk): one
 * reply per request, the peer's single receiver busy, so the spinner that
 * awaits it reads its ack instead of a woken third thread. Measured
 * (benchmarks/tcp14_timeline.py, 1 MiB WRITEs awaited one at a time,
 * wheels interleaved with tcp19's, 2 vCPUs, 4 rounds): 1.09x pair-median
 * (20/28 pairs), 5.64 -> 6.29 GB/s, NIXL-tcp 5.68 in the same rounds
 * (0.99x -> 1.11x); voluntary switches per request 1.05 -> 0.17, CPU per
 * GB 0.32 -> 0.30. */
static bool help_ack(const conn *c, uint64_t len)
{
    return len <= HELP_BYTES_MAX || (c->loop_cc && len <= HELP_LOOP_MAX);
}

/* A spinner's read of a lone READ's response still coming (HELP_WAIT; its
 * header read already, p->mid): copies what is readable of its payload to
 * its destination (help_takes checked that it all lands inside it), and
 * once all of it is here completes it as its receiver would (got). The
 * payload copied as it comes overlaps the target's send of its last
 * segment (read21: a 64 KiB response comes in two loopback segments, and
 * read20's spinner waited for both before copying either). Hands the
 * socket back to its receiver (RX_SELF), which reads the rest, when the
 * peer closed or failed (the receiver finds it so), or when no byte came for
 * HELP_STALL_US (the sender preempted or stopped, or a receive window too
 * small: the bytes come only as they are read); RX_PARKED: peek again.
 * Measured (wheels, peers/run.py tcp, 4 interleaved rounds against read20's,
 * order swapped in two, 2 vCPUs, noisy): READ 64 KiB 1.06x median
 * (0.93-1.61), 2.05x Mooncake (1.64-2.70; read20 1.72x in the same rounds,
 * Mooncake itself 0.90-1.43 GB/s); the other rows 0.94-1.19x,
 * noise (paths this does not touch moved as much). */
static int help_more(conn *c, bool *got)
{
    conn_priv *p = (conn_priv *)c;
    wire_hdr h = p->mid_h;
    pthread_mutex_lock(&c->mu);
    const op *o = p->ex_head->op; /* the head: only the socket's holder pops it */
    pthread_mutex_unlock(&c->mu);
    const axf_desc *d = &o->d[h.index];
    uint64_t now = axf_now_us();
    while (p->mid_have < h.len) {
        ssize_t r = recv(c->fd, o->laddr[h.index] + (h.off - d->roff) + p->mid_have,
                         (size_t)(h.len - p->mid_have), MSG_DONTWAIT);
        if (r > 0) {
            p->mid_have += (uint64_t)r;
            p->mid_since = now;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return now - p->mid_since >= HELP_STALL_US ? RX_SELF : RX_PARKED;
        } else {
            return RX_SELF; /* closed or failed: its receiver finds it so */
        }
    }
    bool proto = false;
    int io = 0;
    AXF_TR(TR_HELP, c->fd, h.op, h.type);
    if (conn_rx_frame(c, &h, NULL, &proto, &io)) {
        /* Not reached (help_takes checked it all): the receiver finds the
         * connection shut and closes it. */
        shutdown(c->fd, SHUT_RDWR);
        return RX_SELF;
    }
    atomic_fetch_add(&c->e->helped, 1);
    atomic_store(&c->help_us, axf_now_us());
    *got = true;
    return atomic_load(&c->down) ? RX_SELF : RX_PARKED;
}

/* A spinner reads c's reply if one is here and it is one it takes (help_takes),
 * peeks again later at a READ response still coming, and leaves anything else
 * to the receiver. e->help_mu held. */
static bool help_read(conn *c)
{
    int parked = RX_PARKED;
    if (!atomic_compare_exchange_strong(&c->rx_hold, &parked, RX_HELPER))
        return false;
    wire_hdr h;
    int back = RX_SELF;
    bool got = false;
    if (((conn_priv *)c)->mid) {
        back = help_more(c, &got);
        goto out;
    }
    ssize_t r = recv(c->fd, &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    int avail = r == (ssize_t)sizeof h ? help_avail(c, &h) : -1;
    int takes = r == (ssize_t)sizeof h ? help_takes(c, &h, avail) : HELP_NO;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        back = RX_PARKED; /* nothing yet */
    } else if (takes == HELP_WAIT) {
        if (recv(c->fd, &h, sizeof h, MSG_DONTWAIT) == (ssize_t)sizeof h) {
            conn_priv *p = (conn_priv *)c;
            (void)ka_heard(c, &h);
            p->mid_h = h;
            p->mid_have = 0;
            p->mid_since = axf_now_us();
            p->mid = true;
            back = help_more(c, &got);
        } else {
            shutdown(c->fd, SHUT_RDWR); /* not reached: the header was peeked whole */
        }
    } else if (takes == HELP_YES &&
               recv(c->fd, &h, sizeof h, MSG_DONTWAIT) == (ssize_t)sizeof h) {
        (void)ka_heard(c, &h);
        bool proto = false;
        int io = 0;
        AXF_TR(TR_HELP, c->fd, h.op, h.type);
        if (!conn_rx_frame(c, &h, NULL, &proto, &io)) {
            atomic_fetch_add(&c->e->helped, 1);
            if (h.type == FR_WRITE_ACK ? help_ack(c, h.len) : h.len <= HELP_BYTES_MAX)
                atomic_store(&c->help_us, axf_now_us());
            /* Dying: its receiver ends it. Bytes read ahead with a READ's
             * payload (rx_readv): its receiver serves them. */
            back = atomic_load(&c->down) || ((conn_priv *)c)->rb_len ? RX_SELF : RX_PARKED;
            got = true;
        } else {
            /* Not reached (help_takes checked it all): the receiver finds
             * the connection shut and closes it. */
            shutdown(c->fd, SHUT_RDWR);
        }
    }
    /* A reply handed back (one the spinner does not take: a READ's of many
     * in flight, a ping): its receiver reads on without parking again until
     * it reads one that a spinner could have (rx_loop sets help_us). Parked
     * again at once, it was handed back each of a burst's replies in turn:
     * 4 KiB READs 64 in flight measured 0.61x through Python. */
out:
    if (back == RX_SELF && !got)
        atomic_store(&c->help_us, 0);
    atomic_store(&c->rx_hold, back);
    if (back == RX_SELF)
        futex_wake(&c->rx_hold);
    return got;
}

bool conn_help(axf_engine *e)
{
    if (!atomic_load_explicit(&e->nhelp, memory_order_relaxed) ||
        pthread_mutex_trylock(&e->help_mu))
        return false;
    bool got = false;
    int n = atomic_load(&e->nhelp);
    for (int i = 0; i < n; i++)
        got |= help_read(e->help[i]);
    pthread_mutex_unlock(&e->help_mu);
    return got;
}

void conn_help_end(axf_engine *e)
{
    if (!atomic_load(&e->nhelp))
        return;
    pthread_mutex_lock(&e->help_mu);
    int n = atomic_load(&e->nhelp);
    for (int i = 0; i < n; i++)
        rx_unpark(e->help[i]);
    pthread_mutex_unlock(&e->help_mu);
}

/* Whether a served frame was a request's last and its reply is out: sent
 * from here (conn_kick), not handed to the sending thread (a large READ
 * response), which a poll here would compete with for a CPU. */
static bool rx_answered(conn *c, const wire_hdr *h)
{
    return !c->ep &&
           (h->type == FR_WRITE || h->type == FR_READ_REQ || h->type == FR_WRITEV ||
            h->type == FR_READV) &&
           (h->flags & FL_LAST) &&
           atomic_load(&c->reply_bytes) == 0;
}

/* Reads and serves frames until one ends the connection: why.
 *
 * The accepting side polls for a while after answering a request, when its
 * peer's next request has come soon after the last answers (the moving
 * average of that gap below cfg.target_poll_us): for twice that average. A
 * peer awaiting its requests one at a time then finds this thread running,
 * not asleep in recv (a thread wake-up less per request: what NIXL's
 * always-polling progress thread saves, at a cost bounded per request and
 * none while the peer is idle or slow). */
/* While the sending thread is not started: before a blocking read, waits
 * for data at most until tx_at (the connection's start + TX_LAZY_MS, or
 * keepalive_ms / 2 if less), and from then on starts it, so pings go out
 * in time whatever the traffic. One wait, not a poll loop. */
static void rx_await(conn *c, uint64_t tx_at, bool got)
{
    conn_priv *p = (conn_priv *)c;
    uint64_t now = axf_now_us();
    if (now < tx_at) {
        if (got || p->rb_len)
            return;
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        if (poll(&pf, 1, (int)((tx_at - now + 999) / 1000)) != 0)
            return; /* something to read (or the socket shut down) */
    }
    pthread_mutex_lock(&c->mu);
    tx_wake(c);
    pthread_mutex_unlock(&c->mu);
}

/* A target connection after our goodbye (said: conn_bye_out, or owed:
 * conn_say_bye): what the peer still sends is read and dropped, never
 * served (a WRITE landing in our memory after we said goodbye), until it
 * closes, falls silent (SO_RCVTIMEO) or the connection is cut
 * (conn_mark_dead). Only after our goodbye: a connection dead any other
 * way (our sender's EPIPE, a kill) still reads and serves what was queued
 * before it died until EOF, as before rev24 (a shutdown for reading leaves
 * what is queued readable). Draining those too threw
 * away a same-host peer's FR_BYE queued behind its last frames, the one
 * word besides its exit that it let go of our memory: its revocations were
 * held until the process exited (close_timeout, 10 s, in an agent whose
 * peer is in its own process: native test_bye26_release). */
static bool rx_after_bye(conn *c)
{
    return atomic_load(&c->bye_said);
}

/* The bytes after header h that a drained frame carries (its payload,
 * a vectored frame's segment table), or false for a header whose framing
 * cannot be trusted: its bounds are the serving path's. */
static bool drain_skip(const wire_hdr *h, uint64_t *skip)
{
    bool abort = h->flags & FL_ABORT;
    uint64_t table = (uint64_t)h->nseg * sizeof(wire_seg);
    switch (h->type) {
    case FR_WRITE:
        *skip = h->len;
        return !h->nseg && h->len <= AXF_MAX_FRAME && (!abort || !h->len);
    case FR_WRITEV:
        *skip = table + h->len;
        return abort ? !h->len && !h->nseg
                     : h->nseg && h->nseg <= AXF_MAX_SEGS && h->len <= AXF_MAX_FRAME;
    case FR_READV:
        *skip = table;
        return abort ? !h->len && !h->nseg : h->nseg && h->nseg <= AXF_MAX_SEGS;
    case FR_NOTIFY:
        *skip = h->len;
        return h->len && h->len <= AXF_MAX_NOTIFY;
    case FR_READ_REQ:
    case FR_PING:
    case FR_REVOKE_ACK:
    case FR_BYE:
        *skip = 0;
        return !h->nseg && (h->type == FR_READ_REQ || h->type == FR_PING || !h->len);
    default:
        return false;
    }
}

/* After our goodbye (rx_after_bye; h: a frame's header read already, or
 * NULL between frames): nothing the peer sends is served, with two
 * exceptions that only let go of our memory and touch none of it: a
 * REVOKE_ACK settles its revocation, a BYE all of the connection's and ends
 * it. Dropped with the rest, a same-host peer's (ours to wait for until it
 * acknowledges, says goodbye or exits) left its region quarantined until
 * the engine's shutdown gave it up (AXF_CQ_REGION_FREED AXF_E_CLOSED: never
 * to be reused), when our goodbye and its word crossed (native test
 * nat28_drain). The frames are followed by their headers' lengths, as the
 * serving path bounds them; a header that breaks them (or a bad magic)
 * ends the framing: the rest is read raw and dropped. An acknowledgement
 * of no revocation here is dropped too (the connection ends anyway). */
static const char *rx_drain(conn *c, uint8_t *scratch, const wire_hdr *first, int *io)
{
    wire_hdr h;
    uint64_t skip = 0;
    for (const wire_hdr *at = first;; at = NULL) {
        if (!at) {
            if ((*io = rx_read(c, &h, sizeof h)))
                return "connection lost";
            at = &h;
        }
        if (at->magic != AXF_MAGIC || !drain_skip(at, &skip))
            break;
        if (at->type == FR_REVOKE_ACK) {
            (void)revoke_acked(c->e, c, at->rid);
        } else if (at->type == FR_BYE) {
            bye_received(c->e, c);
            return BYE_REASON;
        } else if (skip && (*io = discard(c, scratch, skip))) {
            return "connection lost";
        }
    }
    ((conn_priv *)c)->rb_len = 0; /* read ahead: dropped as well */
    for (;;) {
        ssize_t r = recv(c->fd, scratch, DISCARD_BYTES, 0);
        if (r > 0 || (r < 0 && errno == EINTR))
            continue;
        *io = r < 0 ? -errno : 0;
        return "connection lost";
    }
}

static const char *rx_loop(conn *c, uint8_t *scratch, wire_hdr *h, bool *proto, int *io)
{
    uint64_t answered = 0; /* when the last request was answered; 0: not just now */
    uint64_t gap = UINT64_MAX; /* moving average of answer -> next frame, us */
    uint32_t poll_max = c->e->cfg.target_poll_us; /* UINT32_MAX: never */
    conn_priv *p = (conn_priv *)c;
    uint32_t lazy_ms = c->e->cfg.keepalive_ms / 2 < TX_LAZY_MS ? c->e->cfg.keepalive_ms / 2
                                                                 : TX_LAZY_MS;
    uint64_t tx_at = axf_now_us() + (uint64_t)lazy_ms * 1000u;
    for (bool first = true;; first = false) {
        if (!c->ep && rx_after_bye(c))
            return rx_drain(c, scratch, NULL, io);
        if (!c->replay)
            rx_wait_room(c);
        int got = 0;
        if (answered && gap < poll_max && poll_max != UINT32_MAX && !c->replay) {
            got = rx_spin_one(c, h, (uint32_t)(2 * gap + RX_SPIN_MIN_US));
            if (got < 0) {
                *io = got;
                return "connection lost";
            }
        }
        if (!got && rx_may_park(c)) {
            AXF_TR(TR_PARK_B, c->fd, 0, 0);
            rx_park(c, first);
            AXF_TR(TR_PARK_E, c->fd, 0, 0);
        }
        if (atomic_load(&p->tx_owed))
            rx_await(c, tx_at, got);
        if (!got && p->mid) {
            /* A READ response a spinner began and handed back (help_more):
             * its rest is read below (rx_initiator), its checks done again. */
            *h = p->mid_h;
            got = 1;
        }
        if (!got) {
            AXF_TR(TR_RX_BLOCK, c->fd, 0, p->rb_len);
            *io = rx_read(c, h, sizeof *h);
            if (*io)
                return "connection lost";
        }
        AXF_TR(TR_RX_HDR, c->fd, h->op,
               h->type | (uint64_t)(got > 0) << 16 | (uint64_t)(h->off >> 12) << 20);
        if (answered) {
            uint64_t d = axf_now_us() - answered;
            gap = gap == UINT64_MAX ? d : (3 * gap + d) / 4;
            answered = 0;
        }
        if (ka_heard(c, h)) { /* a ping: nothing more */
            if (!(h->flags & FL_BYE) || !c->ep)
                continue;
            /* The peer's goodbye: its last frame, the connection ends here
             * (never a connection that goes on marked closed). */
            atomic_store(&c->bye_heard, true);
            return BYE_REASON;
        }
        if (h->magic != AXF_MAGIC) {
            *proto = true;
            return "bad frame magic";
        }
        if (!c->ep && rx_after_bye(c)) /* (it may have come while we waited for it) */
            return rx_drain(c, scratch, h, io);
        const char *reason = conn_rx_frame(c, h, scratch, proto, io);
        AXF_TR(TR_RX_DONE, c->fd, h->op, h->type);
        if (reason)
            return reason;
        if (p->kick_owed && !rx_reply_may_wait(c)) {
            p->kick_owed = false;
            conn_kick(c);
        }
        if (rx_answered(c, h))
            answered = axf_now_us();
        /* A reply that a thread spinning for it could have read (help_takes):
         * the next ones it reads (rx_park). */
        if (c->ep && atomic_load(&c->e->cq_spinners) &&
            (h->type == FR_WRITE_ACK ? help_ack(c, h->len)
                                     : h->type == FR_READ_RESP && (h->flags & FL_LAST) &&
                                           help_resp(c, h->len) && read_alone(c)))
            atomic_store(&c->help_us, axf_now_us());
    }
}

/* The sending thread's exit, for one that never ran (its creation failed):
 * what it would have done on leaving a dead connection. */
static void tx_never_ran(conn *c)
{
    conn_kill(c);
    pthread_mutex_lock(&c->mu);
    while (c->sending) /* an inline sender puts back or releases its own items */
        pthread_cond_wait(&c->cv, &c->mu);
    sq_item *rest = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    release_list(c->e, rest);
    thread_exit(c);
}

static void *rx_main(void *arg)
{
    conn *c = arg;
    axf_engine *e = c->e;
    uint8_t *scratch = malloc(DISCARD_BYTES);
    const char *reason = scratch ? NULL : "out of memory";
    bool proto = false;
    int io = 0;
    wire_hdr h = {0};
    if (c->ep && ((conn_priv *)c)->tcp) {
        /* Off the connect's path: the one-copy send's verdict (before its
         * sender's first frame to splice, most likely). */
        spl_decide(c);
        /* Parked as it starts, as if a spinner had just read a reply for
         * it (rx_may_park, for HELP_PARK_US): the first request's reply
         * (a connect's first write, a few hundred us later) is read by the
         * thread that spins for it (conn_help), not by this one woken out
         * of its wait for the socket (cxn32: a thread wake-up on that
         * reply's way, where later replies had none). A spinner that
         * leaves without it hands the socket back (conn_help_end), as
         * does a request owed while nobody spins (rx_park's first). As
         * every park, only where the engine's owner spins for its replies
         * (target_poll_us not "never": progress "adaptive" or "poll"); an
         * owner that does not, yet left that setting, has a reply to a
         * request posted in this first park wait for its end (HELP_PARK_US
         * from this thread's start at most), as after any helped reply. */
        if (e->cfg.target_poll_us != UINT32_MAX)
            atomic_store(&c->help_us, axf_now_us());
    }
    if (!reason)
        reason = rx_loop(c, scratch, &h, &proto, &io);
    free(scratch);
    pthread_mutex_lock(&c->mu);
    /* closed locally (shutdown, endpoint close), or by the peer's goodbye */
    bool by_us = c->dead || atomic_load(&c->bye_heard) || atomic_load(&c->bye_said);
    pthread_mutex_unlock(&c->mu);
    if (proto) {
        atomic_fetch_add(&e->rejected, 1);
        cq_log(e, c->tag, "closing connection: malformed frame: %s (type %u)", reason,
               (unsigned)h.type);
    } else if (!by_us && ka_silent(io)) {
        cq_log(e, c->tag, "closing connection: peer silent for %u ms", e->cfg.peer_timeout_ms);
    } else if (!by_us && io && io != -EPIPE) {
        cq_log(e, c->tag, "closing connection: %s: %s", reason, strerror(-io));
    } else if (!by_us && !io && reason && reason != BYE_REASON) {
        cq_log(e, c->tag, "closing connection: %s", reason); /* e.g. out of memory */
    }
    conn_kill(c);
    pthread_mutex_lock(&c->mu); /* dead: nobody starts it now */
    bool tx_owed = atomic_exchange(&((conn_priv *)c)->tx_owed, false);
    pthread_mutex_unlock(&c->mu);
    if (tx_owed)
        tx_never_ran(c);
    if (c->ep)
        initiator_conn_lost(c, proto);
    thread_exit(c);
    return NULL;
}

int conn_replay(axf_engine *e, uint64_t tag, const uint8_t *buf, size_t len)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return AXF_E_TRANSPORT;
    int big = 4 << 20;
    (void)setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    (void)setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    size_t off = 0;
    while (off < len) { /* what the socket takes; the rest is cut off */
        ssize_t r = send(sv[0], buf + off, len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r <= 0)
            break;
        off += (size_t)r;
    }
    shutdown(sv[0], SHUT_WR); /* the peer closed after these bytes */
    /* Replies are sent without waiting (conn_kick) into sv[0]'s receive
     * side, where nobody reads them; what does not fit stays queued and is
     * released at the end. */
    conn_priv *p = calloc(1, sizeof *p);
    uint8_t *scratch = malloc(DISCARD_BYTES);
    if (!p || !scratch) {
        free(p);
        free(scratch);
        close(sv[0]);
        close(sv[1]);
        return AXF_E_NOMEM;
    }
    conn *c = &p->c;
    c->e = e;
    c->tag = tag;
    c->fd = sv[1];
    c->pidfd = -1;
    c->replay = true;
    conn_sync_init(c);
    atomic_init(&c->refs, 1); /* the registry's */
    pthread_mutex_lock(&e->mu);
    bool shut = e->shut;
    if (!shut) { /* in the registry: revocations reach it like any peer's */
        c->next_all = e->conns;
        e->conns = c;
        atomic_fetch_add(&e->n_conns, 1);
    }
    pthread_mutex_unlock(&e->mu);
    bool proto = false;
    int io = 0;
    wire_hdr h;
    if (!shut)
        (void)rx_loop(c, scratch, &h, &proto, &io);
    free(scratch);
    if (proto)
        atomic_fetch_add(&e->rejected, 1);
    pthread_mutex_lock(&c->mu);
    c->dead = true;
    atomic_store(&c->down, true);
    sq_item *rest = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    release_list(e, rest);
    close(sv[0]);
    close(sv[1]);
    if (!shut) {
        atomic_fetch_sub(&e->n_conns, 1);
        revokes_drop(e, c); /* no pidfd: gone */
        pthread_mutex_lock(&e->mu);
        conn_registry_drop(e, c);
        pthread_mutex_unlock(&e->mu);
    } else {
        conn_unref(c);
    }
    return proto ? AXF_E_PROTOCOL : AXF_OK;
}

/* e->mu held. A connection on the registry with its two threads counted
 * (e->conn_threads, c->threads), none started yet: conn_launch (or, under
 * the same hold, conn_start) starts them. Until then it is usable: frames
 * queue and go out inline (conn_kick), a kill marks it dead (the threads
 * then start, see it dead and leave), and engine shutdown waits for the
 * counted threads, so it never frees one that has yet to start. */
conn *conn_open(axf_engine *e, endpoint *ep, uint64_t tag, int fd, int *status)
{
    /* Each connection costs two threads and its buffers (a held one, a
     * pidfd): a peer (or many) cannot make us hold more than max_conns. */
    if (atomic_load(&e->n_conns) + atomic_load(&e->held_conns) >= e->cfg.max_conns) {
        atomic_fetch_add(&e->conns_refused, 1);
        close(fd);
        *status = AXF_E_LIMIT;
        return NULL;
    }
    /* An accepted connection's end is told (AXF_CQ_CONN_CLOSED: the
     * application drops what it keeps for the peer's tag): its ring slot is
     * promised now, where a failure can still be returned, so the record is
     * never lost to a ring that cannot grow. */
    if (!ep && cq_reserve(e) != AXF_OK) {
        close(fd);
        *status = AXF_E_NOMEM;
        return NULL;
    }
    conn_priv *p = calloc(1, sizeof *p);
    if (!p) {
        if (!ep)
            cq_unreserve(e);
        close(fd);
        *status = AXF_E_NOMEM;
        return NULL;
    }
    conn *c = &p->c;
    c->e = e;
    c->ep = ep;
    c->tag = tag;
    c->fd = fd;
    c->pidfd = -1;
    c->closed_slot = !ep;
    conn_sync_init(c);

    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    int one = 1, domain = 0;
    socklen_t dlen = sizeof domain;
    /* Unix-domain stream sockets (same-host peers) have no TCP options. */
    p->tcp = getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dlen) == 0 &&
             (domain == AF_INET || domain == AF_INET6);
    if (p->tcp)
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* Its path, once (conn_path): the loopback shapes; the one-copy send,
     * for an initiator's local TCP connection with the switch on, is asked
     * about later (spl_decide). */
    bool local = p->tcp && conn_path(fd, &p->spl_me, &p->spl_peer);
    c->loop_cc = local && loop_cc_set(e, fd);
    atomic_init(&p->spl_v, local && ep && e->splice_max ? SPL_V_ASK : SPL_V_OFF);
    ka_arm_socket(c);

    ka_init(c);
    c->ka.lead = ka_leads(e, ep, tag);
    atomic_init(&p->tx_owed, true); /* started on its first work (tx_wake) */
    atomic_init(&c->threads, 2);
    atomic_init(&c->refs, 2); /* the registry's, the threads' */
    pthread_mutex_lock(&e->th_mu);
    e->conn_threads += 2;
    pthread_mutex_unlock(&e->th_mu);
    c->next_all = e->conns;
    e->conns = c;
    atomic_fetch_add(&e->n_conns, 1);

    *status = AXF_OK;
    return c;
}

static int rx_create(conn *c)
{
    return conn_thread(c, rx_main);
}

/* e->mu held: a connection with its threads running (the receiver starts
 * the sender), or NULL and nothing of it left. */
conn *conn_start(axf_engine *e, endpoint *ep, uint64_t tag, int fd, int *status)
{
    conn *c = conn_open(e, ep, tag, fd, status);
    if (!c || rx_create(c) == 0)
        return c;
    /* Nothing runs: undo the accounting here (e->mu is held by our caller). */
    e->conns = c->next_all;
    atomic_fetch_sub(&e->n_conns, 1);
    pthread_mutex_lock(&e->th_mu);
    e->conn_threads -= 2;
    pthread_mutex_unlock(&e->th_mu);
    close(fd);
    if (c->closed_slot)
        cq_unreserve(e); /* its end is never told: it never began */
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->room_cv);
    free((conn_priv *)c);
    *status = AXF_E_NOMEM;
    return NULL;
}

int conn_launch(conn *c)
{
    int r = rx_create(c);
    if (r == 0)
        return AXF_OK;
    /* Both threads' exits, as if each had found it dead at once: the
     * endpoint hears of it (a lost peer if it was its last), queued frames
     * and expectations fail, the fd closes, shutdown stops waiting. */
    cq_log(c->e, c->tag, "closing connection: cannot start its threads: %s", strerror(r));
    conn_kill(c); /* dead: nobody starts its sender from now on */
    pthread_mutex_lock(&c->mu);
    bool tx_owed = atomic_exchange(&((conn_priv *)c)->tx_owed, false);
    pthread_mutex_unlock(&c->mu);
    if (tx_owed) /* else a posting thread started it: it leaves on its own */
        tx_never_ran(c);
    if (c->ep)
        initiator_conn_lost(c, false);
    thread_exit(c);
    return AXF_E_NOMEM;
}

/* ------------------------------------------------------------ detached */

conn *conn_detached(axf_engine *e, endpoint *ep, uint64_t tag)
{
    conn_priv *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    conn *c = &p->c;
    c->e = e;
    c->ep = ep;
    c->tag = tag;
    c->fd = -1;
    c->pidfd = -1;
    c->replay = true; /* nothing to wait for before "reading" */
    conn_sync_init(c);
    ka_init(c);
    /* As one thread: conn_detached_close is its exit. */
    atomic_init(&c->threads, 1);
    atomic_init(&c->refs, 2); /* the registry's, the "thread's" */
    pthread_mutex_lock(&e->th_mu);
    e->conn_threads++;
    pthread_mutex_unlock(&e->th_mu);
    c->next_all = e->conns;
    e->conns = c;
    atomic_fetch_add(&e->n_conns, 1);
    return c;
}

bool conn_detached_take(conn *c, wire_hdr *h)
{
    pthread_mutex_lock(&c->mu);
    sq_item *it = c->head;
    if (it) {
        c->head = it->next;
        if (!c->head)
            c->tail = NULL;
        if (it->reply_cost)
            atomic_fetch_sub(&c->reply_bytes, it->reply_cost);
    }
    pthread_mutex_unlock(&c->mu);
    if (!it)
        return false;
    *h = it->h;
    it->next = NULL;
    release_list(c->e, it); /* sent */
    return true;
}

void conn_detached_close(conn *c)
{
    conn_kill(c);
    if (c->ep)
        initiator_conn_lost(c, false);
    pthread_mutex_lock(&c->mu);
    sq_item *rest = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    release_list(c->e, rest);
    thread_exit(c);
}

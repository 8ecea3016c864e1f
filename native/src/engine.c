/* Engine core: region registry, ops table, posting, the completion ring,
 * revocation, endpoints' life. It names no transport: what differs between
 * them goes through their axf_transport (transport.h, transports.c). */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

const char *axf_strerror(int status)
{
    switch (status) {
#define AXF_STR_ENTRY(name, value, text) \
    case value:                          \
        return text;
        AXF_STATUS_TABLE(AXF_STR_ENTRY)
#undef AXF_STR_ENTRY
    default:
        return "unknown status";
    }
}

uint64_t axf_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t axf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t axf_now_us(void) { return axf_now_ns() / 1000u; }

static uint64_t random_u64(void)
{
    uint64_t v = 0;
    while (v == 0) {
        if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
            v = 0x9e3779b97f4a7c15ull ^ axf_now_ms() ^ (uint64_t)getpid();
    }
    return v;
}

static void *watch_main(void *arg);
static int ep_ended_status(axf_engine *e, uint64_t id);
static void doorbell_conns(axf_engine *e);

/* ---------------------------------------------------------------- ring */

/* Set by axf_post (AXF_POST_POLL) around a completion it makes itself: the
 * thread that posted polls next, so its record needs no wake-up. */
_Thread_local bool axf_cq_quiet;
/* Set by axf_post and axf_doorbell_ex (AXF_POST_NOHELP) around the submit
 * and the ring: shm_help and conn_kick's large frames then stay the workers'
 * and senders' (a thread that keeps others waiting, such as a Python thread
 * holding the GIL, would stall them for as long as it helped: up to
 * inline_bytes of others' copies, a 1 MiB frame). */
_Thread_local bool axf_no_help;
/* Set by axf_post (AXF_POST_INLINE) around its submit: the successful
 * completion of request take_id, made quietly on this thread, is not pushed
 * (taken is set instead) and axf_post reports it. */
static _Thread_local struct {
    bool armed, taken;
    uint64_t id;
} cq_take;

/* cq_mu held: the ring twice as large (1024 records at first). */
static int cq_grow(axf_engine *e)
{
    size_t ncap = e->cq_cap ? e->cq_cap * 2 : 1024;
    axf_completion *n = malloc(ncap * sizeof *n);
    if (!n)
        return AXF_E_NOMEM;
    for (size_t i = 0; i < e->cq_count; i++)
        n[i] = e->cq[(e->cq_head + i) % e->cq_cap];
    free(e->cq);
    e->cq = n;
    atomic_fetch_add_explicit(&e->cq_free, (long long)(ncap - e->cq_cap), memory_order_relaxed);
    e->cq_cap = ncap;
    e->cq_head = 0;
    return AXF_OK;
}

/* The fast path is one atomic subtraction: a positive count before it means
 * a slot nobody else holds or claims (claims only subtract), whatever runs
 * beside it. Else the ring grows, under cq_mu, until the count is back to
 * zero or more: every claim made so far is then backed by a slot. */
int cq_reserve(axf_engine *e)
{
    if (atomic_fetch_sub_explicit(&e->cq_free, 1, memory_order_relaxed) > 0)
        return AXF_OK;
    int st = AXF_OK;
    pthread_mutex_lock(&e->cq_mu);
    while (atomic_load_explicit(&e->cq_free, memory_order_relaxed) < 0) {
        if (cq_grow(e) != AXF_OK) {
            atomic_fetch_add_explicit(&e->cq_free, 1, memory_order_relaxed);
            st = AXF_E_NOMEM;
            break;
        }
    }
    pthread_mutex_unlock(&e->cq_mu);
    return st;
}

void cq_unreserve(axf_engine *e)
{
    atomic_fetch_add_explicit(&e->cq_free, 1, memory_order_relaxed);
}

/* cq_mu not held: the record in a slot already promised or claimed, its
 * payload (malloc'd, or NULL) handed over to the ring. */
static void cq_put(axf_engine *e, uint32_t kind, int32_t status, uint64_t id, uint64_t tag,
                   uint64_t nbytes, uint64_t fail_index, uint8_t *copy, size_t plen)
{
    pthread_mutex_lock(&e->cq_mu);
    if (e->cq_count == e->cq_cap && cq_grow(e) != AXF_OK) {
        /* Not reached: every record's slot was promised or claimed. Were one
         * pushed without (a bug), it is lost rather than written past the
         * ring. */
        pthread_mutex_unlock(&e->cq_mu);
        free(copy);
        atomic_fetch_add(&e->cq_dropped, 1);
        return;
    }
    /* One eventfd write per drain: none while one is pending, none for a
     * record the posting thread is about to poll itself. */
    bool signal = !e->cq_signalled && !axf_cq_quiet;
    axf_completion *c = &e->cq[(e->cq_head + e->cq_count) % e->cq_cap];
    c->kind = kind;
    c->status = status;
    c->id = id;
    c->tag = tag;
    c->nbytes = nbytes;
    c->fail_index = fail_index;
    c->payload_len = (uint32_t)plen;
    c->payload = copy;
    e->cq_count++;
    atomic_store_explicit(&e->cq_ready, e->cq_count, memory_order_seq_cst);
    if (signal && atomic_load_explicit(&e->cq_spinners, memory_order_seq_cst))
        signal = false; /* a thread spinning in axf_wait sees it, and signals when it stops */
    if (signal)
        e->cq_signalled = true;
    AXF_TR(TR_CQ_PUSH, -1, id, signal);
    /* Written before unlocking: a poll that takes this record (and clears
     * the eventfd under cq_mu) cannot run between our push and our write, so
     * the write never outlives the record it announces (a stale wake-up),
     * and whoever sees the record under cq_mu sees the eventfd written. */
    if (signal) {
        uint64_t one = 1;
        ssize_t r = write(e->efd, &one, sizeof one);
        (void)r; /* EAGAIN means the counter is already non-zero: still signalled */
    }
    pthread_mutex_unlock(&e->cq_mu);
}

enum { DROP_NOTE_NONE, DROP_NOTE_ARMING, DROP_NOTE_ARMED };
#define DROP_NOTE_LEN 256
#define DROP_NOTE_EVERY_MS 1000

/* Holds the drop note's slot and payload again (axf_poll, cq_mu not held,
 * after it freed slots): at most once per DROP_NOTE_EVERY_MS, so a ring that
 * keeps overflowing costs one log line a second, with the running count. */
static void drop_note_arm(axf_engine *e)
{
    int none = DROP_NOTE_NONE;
    if (axf_now_ms() - atomic_load(&e->drop_note_ms) < DROP_NOTE_EVERY_MS)
        return;
    const axf_faults *ft = __atomic_load_n(&e->faults, __ATOMIC_ACQUIRE); /* (test only) */
    if (ft && ft->drop_note_gap)
        ft->drop_note_gap(ft->arg);
    if (!atomic_compare_exchange_strong(&e->drop_note, &none, DROP_NOTE_ARMING))
        return;
    /* Again, the note ours: the look above may predate a note taken since
     * (another poll re-armed it, a drop used it): the NONE claimed here is
     * then that drop's, stored after its time, so this load sees it. Else
     * re-armed at once, the next drop logged a second line that second. */
    if (axf_now_ms() - atomic_load(&e->drop_note_ms) < DROP_NOTE_EVERY_MS) {
        atomic_store(&e->drop_note, DROP_NOTE_NONE);
        return;
    }
    char *buf = e->drop_note_buf ? e->drop_note_buf : malloc(DROP_NOTE_LEN);
    if (!buf || cq_reserve(e) != AXF_OK) {
        e->drop_note_buf = buf;
        atomic_store(&e->drop_note, DROP_NOTE_NONE);
        return;
    }
    e->drop_note_buf = buf;
    atomic_store(&e->drop_note, DROP_NOTE_ARMED);
}

static const char *cq_kind_name(uint32_t kind)
{
    switch (kind) {
    case AXF_CQ_NOTIFY:
        return "a notification from this peer (its sender was told it arrived)";
    case AXF_CQ_CONN_CLOSED:
        return "this peer's connection closed";
    case AXF_CQ_RAIL_DOWN:
        return "a rail of this peer down";
    case AXF_CQ_LOG:
        return "a log line";
    default:
        return "a record";
    }
}

/* A record with no slot (the ring full and unable to grow): counted, its
 * credit given back, and said once by the drop note if it is armed. */
static void cq_drop(axf_engine *e, uint32_t kind, uint64_t tag)
{
    unsigned long long n = atomic_fetch_add(&e->cq_dropped, 1) + 1;
    /* A peer's notification holds one of its connection's credits
     * (max_notify_per_conn) until the application releases it, which it
     * cannot for one it never saw: given back here, else the receiver pauses
     * for good once max_notify_per_conn of them were lost, and every later
     * request of that peer's connection waits forever. */
    if (kind == AXF_CQ_NOTIFY)
        axf_notify_release(e, tag, 1);
    int armed = DROP_NOTE_ARMED;
    if (!atomic_compare_exchange_strong(&e->drop_note, &armed, DROP_NOTE_ARMING))
        return; /* noted less than a second ago (or being armed): counted only */
    /* Ours alone while ARMING: the buffer and the slot (promised when armed). */
    char *buf = e->drop_note_buf;
    e->drop_note_buf = NULL;
    atomic_store(&e->drop_note_ms, axf_now_ms());
    atomic_store(&e->drop_note, DROP_NOTE_NONE);
    int len = snprintf(buf, DROP_NOTE_LEN,
                       "completion ring full and out of memory: records lost so far: %llu "
                       "(axf_stats cq_dropped), the last %s",
                       n, cq_kind_name(kind));
    size_t plen = len < 0 ? 0 : (size_t)len < DROP_NOTE_LEN ? (size_t)len : DROP_NOTE_LEN - 1;
    buf[plen] = 0; /* as every payload (payload_copy): snprintf's, unless it failed */
    cq_put(e, AXF_CQ_LOG, 0, 0, tag, 0, 0, (uint8_t *)buf, plen);
}

/* A record's payload: its bytes and a NUL after them, not counted in
 * payload_len (nat26: the contract, aioxfer.h axf_completion). A log's text
 * then reads as a C string: test_file.c's strstr on a log's payload read
 * past its end, and an application doing so would too. A notification's
 * bytes may hold NULs of their own: payload_len is still their length.
 * Out of memory: no payload (*plen 0), the record itself still told. */
static uint8_t *payload_copy(const void *payload, size_t *plen)
{
    uint8_t *copy = malloc(*plen + 1);
    if (!copy) {
        *plen = 0;
        return NULL;
    }
    memcpy(copy, payload, *plen);
    copy[*plen] = 0;
    return copy;
}

void cq_push(axf_engine *e, uint32_t kind, int32_t status, uint64_t id, uint64_t tag,
             uint64_t nbytes, uint64_t fail_index, const void *payload, size_t plen)
{
    uint8_t *copy = NULL;
    if (cq_take.armed && axf_cq_quiet && kind == AXF_CQ_XFER && status == AXF_OK &&
        id == cq_take.id && !plen) {
        cq_take.taken = true; /* counted by op_finish_now already; its caller is told */
        cq_unreserve(e);      /* its post's promise, not needed */
        return;
    }
    /* Records of these kinds had their slot promised when their object was
     * made (a post, an endpoint, a region): they always fit, as do those
     * pushed by cq_push_claimed (a peer's notification, an accepted
     * connection's end). The others (a log, a rail down, a detached
     * connection's end) claim one now; if the ring cannot grow they are
     * lost, counted and noted. */
    bool promised =
        kind == AXF_CQ_XFER || kind == AXF_CQ_PEER_LOST || kind == AXF_CQ_REGION_FREED ||
        kind == AXF_CQ_XFER_HELD || kind == AXF_CQ_XFER_FREED;
    if (!promised && cq_reserve(e) != AXF_OK) {
        cq_drop(e, kind, tag);
        return;
    }
    if (plen)
        copy = payload_copy(payload, &plen);
    cq_put(e, kind, status, id, tag, nbytes, fail_index, copy, plen);
}

void cq_push_claimed(axf_engine *e, uint32_t kind, int32_t status, uint64_t id, uint64_t tag,
                     uint64_t nbytes, uint64_t fail_index, const void *payload, size_t plen)
{
    uint8_t *copy = NULL;
    if (plen)
        copy = payload_copy(payload, &plen);
    cq_put(e, kind, status, id, tag, nbytes, fail_index, copy, plen);
}

void cq_log(axf_engine *e, uint64_t tag, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
    cq_push(e, AXF_CQ_LOG, 0, 0, tag, 0, 0, buf, len);
}

size_t axf_poll(axf_engine *e, axf_completion *out, size_t max)
{
    pthread_mutex_lock(&e->cq_mu);
    size_t n = e->cq_count < max ? e->cq_count : max;
    for (size_t i = 0; i < n; i++)
        out[i] = e->cq[(e->cq_head + i) % e->cq_cap];
    if (n) {
        e->cq_head = (e->cq_head + n) % e->cq_cap;
        e->cq_count -= n;
        atomic_store_explicit(&e->cq_ready, e->cq_count, memory_order_release);
        atomic_fetch_add_explicit(&e->cq_free, (long long)n, memory_order_relaxed);
    }
    bool signal = false;
    if (e->cq_count == 0) {
        /* Drained: clear the eventfd. Under cq_mu, so that it cannot eat the
         * signal of a record pushed after the ones taken here. Only when a
         * push signalled, or when this poll found nothing: a wake-up whose
         * records an earlier poll took (their pusher wrote after that poll
         * cleared) is cleared by the empty poll it causes. */
        if (e->cq_signalled || n == 0) {
            uint64_t v;
            ssize_t r = read(e->efd, &v, sizeof v);
            (void)r;
        }
        e->cq_signalled = false;
    } else if (!e->cq_signalled) {
        e->cq_signalled = true; /* records remain (max reached, or quiet ones) */
        signal = true;
    }
    pthread_mutex_unlock(&e->cq_mu);
    if (signal) {
        uint64_t one = 1;
        ssize_t r = write(e->efd, &one, sizeof one);
        (void)r;
    }
    /* The drop note was used (records were lost): held again now that slots
     * are free, at most once a second. One relaxed load otherwise. */
    if (n && atomic_load_explicit(&e->drop_note, memory_order_relaxed) == DROP_NOTE_NONE)
        drop_note_arm(e);
    return n;
}

size_t axf_wait(axf_engine *e, uint32_t max_us) { return axf_wait_ex(e, max_us, 0); }

size_t axf_wait_ex(axf_engine *e, uint32_t max_us, uint32_t flags)
{
    size_t n = atomic_load_explicit(&e->cq_ready, memory_order_acquire);
    bool spun = false;
    if (!n && max_us) {
        atomic_fetch_add_explicit(&e->cq_spinners, 1, memory_order_seq_cst);
        AXF_TR(TR_WAIT_B, -1, 0, max_us);
        uint64_t until = axf_now_us() + max_us;
        for (unsigned spin = 1;; spin++) {
            cpu_relax();
            n = atomic_load_explicit(&e->cq_ready, memory_order_acquire);
            if (n)
                break;
            if ((spin & 15) == 0) {
                /* A reply our receivers left to us (parked: conn_help) is
                 * read here, not by a woken thread. */
                if (conn_help(e))
                    continue;
                /* The completion comes from a thread that may share this
                 * CPU (few cores, or a busy host): let it run. */
                sched_yield();
                if (axf_now_us() >= until) {
                    /* What the yield let arrive (often: a preempted spin
                     * gets the CPU back once the peer answered) is read
                     * here, not by a receiver woken as we leave: one
                     * wake-up fewer for that request. Measured (nat24,
                     * tcp20_batch.py lone requests, wheels, 18 rotated
                     * rounds on 2 shared vCPUs): 1 MiB READ 1.04x (11 of
                     * 18), voluntary switches 0.70 -> 0.65 per request;
                     * 1 MiB WRITE 1.035x (13 of 18); 64 KiB 0.97-1.02x
                     * (6 rounds: noise). */
                    if (!atomic_load_explicit(&e->cq_ready, memory_order_acquire))
                        (void)conn_help(e);
                    n = atomic_load_explicit(&e->cq_ready, memory_order_acquire);
                    break;
                }
            }
        }
        /* Leaving: a push that saw us skipped its eventfd write, so we
         * write it below. seq_cst on both sides (cq_push stores cq_ready,
         * then loads cq_spinners): either that push saw no spinner and
         * signalled, or this load sees its record (or a poll took it). */
        AXF_TR(TR_WAIT_E, -1, 0, n);
        int left = atomic_fetch_sub_explicit(&e->cq_spinners, 1, memory_order_seq_cst) - 1;
        n = atomic_load_explicit(&e->cq_ready, memory_order_seq_cst);
        spun = true;
        if (!n && !left) /* nobody polls now: the receivers read their replies */
            conn_help_end(e);
    }
    if (n) {
        /* AXF_WAIT_POLLS: the caller polls next, and that poll takes the
         * records (or signals what it leaves, as axf_poll does): records a
         * push left unsignalled for our spin stay so, and that poll, finding
         * the eventfd unsignalled, does not read it either: two system calls
         * fewer on the way of a request awaited alone. Not spun: that poll
         * takes what is there as it finds it (no lock taken here). */
        if (flags & AXF_WAIT_POLLS)
            return n;
        /* A pusher writes the eventfd before unlocking: once we hold the
         * lock, a reader of the eventfd sees it readable. Records a push
         * left unsignalled for our spin we signal here, under cq_mu like a
         * push (so the write never outlives the records it announces): the
         * caller need not poll, the loop's eventfd reader finds them. No
         * contention: the pusher made no system call under the lock. */
        pthread_mutex_lock(&e->cq_mu);
        n = e->cq_count;
        if (spun && n && !e->cq_signalled) {
            e->cq_signalled = true;
            uint64_t one = 1;
            ssize_t r = write(e->efd, &one, sizeof one);
            (void)r;
        }
        pthread_mutex_unlock(&e->cq_mu);
    }
    return n;
}

uint64_t axf_engine_inline_bytes(axf_engine *e) { return e->cfg.inline_bytes; }
uint32_t axf_engine_poll_us(axf_engine *e) { return e->poll_us; }

void axf_completion_free(axf_completion *c)
{
    free(c->payload);
    c->payload = NULL;
    c->payload_len = 0;
}

/* ----------------------------------------------------------- environment */

static const char *const env_names[AXF_ENV_N] = {
    [AXF_ENV_REFUSED_LOG_MS] = "AIOXFER_REFUSED_LOG_MS",
    [AXF_ENV_TCP_LOOPBACK_CC] = "AIOXFER_TCP_LOOPBACK_CC",
    [AXF_ENV_TCP_SPLICE] = "AIOXFER_TCP_SPLICE",
    [AXF_ENV_FILE_IO] = "AIOXFER_FILE_IO",
    [AXF_ENV_VERBS_TIMEOUT] = "AIOXFER_VERBS_TIMEOUT",
    [AXF_ENV_VERBS_RETRY_CNT] = "AIOXFER_VERBS_RETRY_CNT",
    [AXF_ENV_VERBS_TC] = "AIOXFER_VERBS_TC",
    [AXF_ENV_VERBS_SL] = "AIOXFER_VERBS_SL",
    [AXF_ENV_VERBS_GID_INDEX] = "AIOXFER_VERBS_GID_INDEX",
    [AXF_ENV_VERBS_RELAXED_ORDERING] = "AIOXFER_VERBS_RELAXED_ORDERING",
    [AXF_ENV_VERBS_DEVICES] = "AIOXFER_VERBS_DEVICES",
    [AXF_ENV_CUDA_DRIVER] = "AIOXFER_CUDA_DRIVER",
    [AXF_ENV_TCP_TRACE] = "AXF_TCP_TRACE",
    [AXF_ENV_SHM_LAZY_MIN] = "AIOXFER_SHM_LAZY_MIN",
    [AXF_ENV_WAKE_NS] = "AIOXFER_WAKE_NS",
    [AXF_ENV_COPY_MBPS] = "AIOXFER_COPY_MBPS",
    [AXF_ENV_INLINE_BYTES] = "AIOXFER_INLINE_BYTES",
};

/* The variables read through axf_env_value (process-wide, into a buffer of
 * AXF_ENV_VAL_MAX): a longer value is ignored there, and logged by engines. */
#define ENV_PROCESS_WIDE                                                                   \
    ((1u << AXF_ENV_CUDA_DRIVER) | (1u << AXF_ENV_TCP_TRACE) | (1u << AXF_ENV_SHM_LAZY_MIN) | \
     (1u << AXF_ENV_WAKE_NS) | (1u << AXF_ENV_COPY_MBPS) | (1u << AXF_ENV_INLINE_BYTES))

/* One snapshot. Each engine carried 17 slots of 512 bytes (8.7 KiB), and a
 * value of 512 bytes or more read as unset, silently: now the values are
 * packed at their lengths (NUL-terminated) in one block, made once per
 * distinct environment (interned: an unchanged environment read again, as
 * before every Python engine, reuses its block) and immutable, so that an
 * engine, a probe, a process-wide reader hold a pointer to it.
 *
 * Its life (nat26; before, never freed: one block per distinct environment
 * the process ever read, the values' bytes included, each as long as the
 * kernel lets a variable be): counted references, one for being the
 * process's current snapshot (env_cur) and one per axf_env taken
 * (axf_env_take: an engine's for its life, a probe's for its call). The
 * last one let go frees it, so what stays is the current block and those
 * of live engines. */
struct axf_env_block {
    struct axf_env_block *next; /* env_mu: the interned list (every live block) */
    size_t refs;                /* env_mu */
    uint32_t set;               /* bit k: variable k was set */
    uint32_t off[AXF_ENV_N], len[AXF_ENV_N];
    size_t size; /* bytes of data */
    char data[];
};

/* The process's snapshot: taken by axf_env_read (each call), or by an
 * engine's creation or a process-wide reader when nobody has called it. */
static pthread_mutex_t env_mu = PTHREAD_MUTEX_INITIALIZER;
static struct axf_env_block *env_blocks; /* every live one */
static struct axf_env_block *env_cur;    /* holds a reference (NULL: none taken yet) */
static bool env_taken, env_explicit;

static void env_unref(struct axf_env_block *b) /* env_mu held */
{
    if (--b->refs)
        return;
    struct axf_env_block **p = &env_blocks;
    while (*p != b)
        p = &(*p)->next;
    *p = b->next;
    free(b);
}

/* b becomes the current snapshot (its reference moves from the old one). */
static void env_set_cur(struct axf_env_block *b) /* env_mu held */
{
    if (b == env_cur)
        return;
    b->refs++;
    if (env_cur)
        env_unref(env_cur);
    env_cur = b;
}

static void env_snapshot(void) /* env_mu held: the only getenv of the library */
{
    const char *v[AXF_ENV_N];
    uint32_t len[AXF_ENV_N], set = 0;
    size_t size = 0;
    for (int k = 0; k < AXF_ENV_N; k++) {
        v[k] = getenv(env_names[k]);
        size_t n = v[k] ? strlen(v[k]) : 0;
        if (n > UINT32_MAX - 1)
            v[k] = NULL; /* (not reached: the kernel caps a variable far below) */
        len[k] = v[k] ? (uint32_t)n : 0;
        if (v[k]) {
            set |= 1u << k;
            size += n + 1;
        }
    }
    env_taken = true;
    for (struct axf_env_block *b = env_blocks; b; b = b->next) {
        if (b->set != set || b->size != size)
            continue;
        int k = 0;
        while (k < AXF_ENV_N &&
               (!(set & (1u << k)) ||
                (b->len[k] == len[k] && memcmp(b->data + b->off[k], v[k], len[k]) == 0)))
            k++;
        if (k == AXF_ENV_N) {
            env_set_cur(b);
            return;
        }
    }
    struct axf_env_block *b = malloc(sizeof *b + size);
    if (!b) /* the previous snapshot stays (none: nothing set) */
        return;
    b->refs = 0;
    b->set = set;
    b->size = size;
    size_t at = 0;
    for (int k = 0; k < AXF_ENV_N; k++) {
        b->off[k] = (uint32_t)at;
        b->len[k] = len[k];
        if (!(set & (1u << k)))
            continue;
        memcpy(b->data + at, v[k], len[k] + 1);
        at += len[k] + 1;
    }
    b->next = env_blocks;
    env_blocks = b;
    env_set_cur(b);
}

void axf_env_read(void)
{
    pthread_mutex_lock(&env_mu);
    env_snapshot();
    env_explicit = true;
    pthread_mutex_unlock(&env_mu);
}

void axf_env_take(axf_env *out, bool creating)
{
    pthread_mutex_lock(&env_mu);
    if (!env_taken || (creating && !env_explicit))
        env_snapshot();
    out->b = env_cur;
    if (env_cur)
        env_cur->refs++;
    pthread_mutex_unlock(&env_mu);
}

void axf_env_release(axf_env *env)
{
    /* Not const to us: the block's count is ours (env_mu), its values are
     * what the holders may not change. */
    struct axf_env_block *b = (struct axf_env_block *)(uintptr_t)env->b;
    env->b = NULL;
    if (!b)
        return;
    pthread_mutex_lock(&env_mu);
    env_unref(b);
    pthread_mutex_unlock(&env_mu);
}

size_t axf_env_blocks(void)
{
    size_t n = 0;
    pthread_mutex_lock(&env_mu);
    for (struct axf_env_block *b = env_blocks; b; b = b->next)
        n++;
    pthread_mutex_unlock(&env_mu);
    return n;
}

const char *axf_env_get(const axf_env *env, int which)
{
    const struct axf_env_block *b = env->b;
    return b && (b->set & (1u << which)) ? b->data + b->off[which] : NULL;
}

const char *axf_env_wide(const axf_env *env, int which)
{
    const struct axf_env_block *b = env->b;
    return b && (b->set & (1u << which)) && b->len[which] < AXF_ENV_VAL_MAX
               ? b->data + b->off[which]
               : NULL;
}

bool axf_env_value(int which, char *out)
{
    axf_env env;
    axf_env_take(&env, false);
    const char *v = axf_env_wide(&env, which);
    if (v)
        memcpy(out, v, strlen(v) + 1);
    else
        out[0] = 0;
    axf_env_release(&env);
    return v != NULL;
}

/* A new engine's log: each process-wide value of its snapshot too long for
 * its readers (ignored there: their defaults apply). Said per engine (the
 * application sees it wherever it looks), not dropped silently. */
static void env_check(axf_engine *e)
{
    const struct axf_env_block *b = e->env.b;
    for (int k = 0; b && k < AXF_ENV_N; k++)
        if ((ENV_PROCESS_WIDE & b->set & (1u << k)) && b->len[k] >= AXF_ENV_VAL_MAX)
            cq_log(e, 0, "environment: %s is %u bytes long, more than the %d it may have: ignored",
                   env_names[k], (unsigned)b->len[k], AXF_ENV_VAL_MAX - 1);
}

/* ---------------------------------------------------------------- engine */

axf_engine *axf_engine_create(const axf_config *cfg)
{
    axf_engine *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    atomic_flag_clear(&e->op_lock);
    if (cfg)
        e->cfg = *cfg;
    if (!e->cfg.copy_workers)
        e->cfg.copy_workers = 2;
    if (!e->cfg.chunk_bytes)
        e->cfg.chunk_bytes = 1u << 20;
    if (e->cfg.chunk_bytes > AXF_MAX_FRAME)
        e->cfg.chunk_bytes = AXF_MAX_FRAME; /* a frame is a chunk at most: the target refuses
                                               larger */
    ka_configure(&e->cfg);
    if (!e->cfg.max_conns)
        e->cfg.max_conns = 256;
    if (!e->cfg.max_notify_per_conn)
        e->cfg.max_notify_per_conn = 1024;
    if (!e->cfg.revoke_timeout_ms)
        e->cfg.revoke_timeout_ms = 10000;
    if (!e->cfg.reply_queue_bytes)
        e->cfg.reply_queue_bytes = 64u << 20;
    if (!e->cfg.target_poll_us)
        e->cfg.target_poll_us = 100;
    e->refused_log_ms = 1000;
    axf_env_take(&e->env, true); /* before any transport's enable reads it */
    const char *rl = axf_env_get(&e->env, AXF_ENV_REFUSED_LOG_MS);
    if (rl && *rl) {
        char *end;
        unsigned long long ms = strtoull(rl, &end, 10);
        if (!*end && ms)
            e->refused_log_ms = ms;
    }
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->efd < 0) {
        axf_env_release(&e->env);
        free(e);
        return NULL;
    }
    e->watch_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->watch_efd < 0) {
        close(e->efd);
        axf_env_release(&e->env);
        free(e);
        return NULL;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->cq_mu, NULL);
    pthread_mutex_init(&e->th_mu, NULL);
    pthread_mutex_init(&e->help_mu, NULL);
    pthread_cond_init(&e->th_cv, NULL);
    e->next_rid = 1;
    e->next_ep = 1;
    const axf_transport *const *xi = axf_transports;
    for (; *xi; xi++)
        if ((*xi)->enable && (*xi)->enable(e) != AXF_OK)
            break;
    if (*xi || pthread_create(&e->watch_thread, NULL, watch_main, e) != 0) {
        while (xi-- != axf_transports) { /* those enabled, in reverse */
            if ((*xi)->quiesce)
                (*xi)->quiesce(e);
            if ((*xi)->stop)
                (*xi)->stop(e);
            if ((*xi)->destroy)
                (*xi)->destroy(e);
        }
        close(e->efd);
        close(e->watch_efd);
        axf_env_release(&e->env);
        free(e);
        return NULL;
    }
    e->watch_started = true;
    drop_note_arm(e); /* if it cannot be held now, the first poll that frees a slot does */
    env_check(e);
    return e;
}

int axf_engine_fd(axf_engine *e) { return e->efd; }

void axf_engine_stats(axf_engine *e, axf_stats *s)
{
    memset(s, 0, sizeof *s);
    s->regions = atomic_load(&e->n_regions);
    s->ops = atomic_load(&e->n_ops);
    s->conns = atomic_load(&e->n_conns);
    s->ops_posted = atomic_load(&e->posted);
    s->ops_completed = atomic_load(&e->completed);
    s->ops_failed = atomic_load(&e->failed);
    s->bytes = atomic_load(&e->bytes);
    s->frames_rejected = atomic_load(&e->rejected);
    s->conns_refused = atomic_load(&e->conns_refused);
    s->cq_dropped = atomic_load(&e->cq_dropped);
    s->helped = atomic_load(&e->helped);
    s->held_conns = atomic_load(&e->held_conns);
    pthread_mutex_lock(&e->mu);
    s->quarantined = e->quarantined;
    s->quarantined_bytes = e->quarantined_bytes;
    for (endpoint *ep = e->eps; ep; ep = ep->next)
        if (!ep->dead)
            s->endpoints++;
    pthread_mutex_unlock(&e->mu);
}

/* ---------------------------------------------------------------- regions */

/* Every transport lets go of r, those before `upto` only when it is set (a
 * registration that failed at upto). */
static void region_xp_free(axf_engine *e, region *r, const axf_transport *const *upto)
{
    for (const axf_transport *const *xi = axf_transports; *xi && xi != upto; xi++)
        if ((*xi)->region_free)
            (*xi)->region_free(e, r);
}

/* Any registered region, revoked or not: our own ops' lookup. e->mu held. */
static region *region_get_local(axf_engine *e, uint64_t id)
{
    for (region *r = e->regions[id % AXF_REGION_BUCKETS]; r; r = r->next)
        if (r->id == id) {
            atomic_fetch_add(&r->refs, 1);
            return r;
        }
    return NULL;
}

/* What a peer's access (the tcp target's frames) and the transports' own
 * look-ups find: a revoked region is not there, as if deregistered, so a
 * peer that kept its key gets the same AXF_E_ACCESS from the one check that
 * runs before memory is touched. */
region *region_get(axf_engine *e, uint64_t id)
{
    region *r = region_get_local(e, id);
    if (r && r->revoked) {
        atomic_fetch_sub(&r->refs, 1); /* the registry holds another: never the last */
        return NULL;
    }
    return r;
}

void region_unref(axf_engine *e, region *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1) {
        /* After every peer acknowledged (nothing in flight), and before the
         * owner hears it may release the memory. */
        region_xp_free(e, r, NULL);
        cq_push(e, AXF_CQ_REGION_FREED, r->freed_status, r->id, 0, r->len, 0, NULL, 0);
        atomic_fetch_sub(&e->n_regions, 1);
        if (r->fd >= 0)
            close(r->fd);
        free(r);
    }
}

static int region_add(axf_engine *e, region *r, uint64_t *id_out, uint64_t *key_out)
{
    /* Its AXF_CQ_REGION_FREED's slot, promised while a failure can be told. */
    if (cq_reserve(e) != AXF_OK) {
        if (r->fd >= 0)
            close(r->fd);
        free(r);
        return AXF_E_NOMEM;
    }
    r->key = random_u64();
    atomic_init(&r->refs, 1);
    /* Every transport sees it before anyone can reach it. */
    for (const axf_transport *const *xi = axf_transports; *xi; xi++) {
        int xst = (*xi)->region_add ? (*xi)->region_add(e, r) : AXF_OK;
        if (xst != AXF_OK) {
            region_xp_free(e, r, xi);
            if (r->fd >= 0)
                close(r->fd);
            free(r);
            cq_unreserve(e);
            return xst;
        }
    }
    pthread_mutex_lock(&e->mu);
    if (e->shut) {
        pthread_mutex_unlock(&e->mu);
        region_xp_free(e, r, NULL);
        if (r->fd >= 0)
            close(r->fd);
        free(r);
        cq_unreserve(e);
        return AXF_E_CLOSED;
    }
    r->id = e->next_rid++;
    region **b = &e->regions[r->id % AXF_REGION_BUCKETS];
    r->next = *b;
    *b = r;
    pthread_mutex_unlock(&e->mu);
    atomic_fetch_add(&e->n_regions, 1);
    *id_out = r->id;
    *key_out = r->key;
    return AXF_OK;
}

int axf_region_register(axf_engine *e, void *addr, uint64_t len, uint32_t access, int memfd,
                        uint64_t *id_out, uint64_t *key_out)
{
    if (!addr || !len || (access & ~(AXF_ACCESS_READ | AXF_ACCESS_WRITE)))
        return AXF_E_INVALID;
    if ((uintptr_t)addr + len < (uintptr_t)addr)
        return AXF_E_INVALID;
    region *r = calloc(1, sizeof *r);
    if (!r)
        return AXF_E_NOMEM;
    r->addr = addr;
    r->len = len;
    r->access = access;
    r->kind = AXF_MEM_HOST;
    /* Not kept: same-host peers get the memfd from our caller (with the
     * region's metadata) and map it themselves; nothing here reads it. */
    (void)memfd;
    r->fd = -1;
    return region_add(e, r, id_out, key_out);
}

int axf_region_register_kind(axf_engine *e, uint32_t kind, uint64_t addr, uint64_t len,
                             uint32_t access, int fd, uint64_t *id_out, uint64_t *key_out)
{
    if (!len || (access & ~(AXF_ACCESS_READ | AXF_ACCESS_WRITE)) || addr + len < addr)
        return AXF_E_INVALID;
    if (kind == AXF_MEM_HOST)
        return axf_region_register(e, (void *)(uintptr_t)addr, len, access, -1, id_out, key_out);
    if ((kind == AXF_MEM_CUDA && (!addr || fd >= 0)) || (kind == AXF_MEM_FILE && fd < 0) ||
        (kind != AXF_MEM_CUDA && kind != AXF_MEM_FILE))
        return AXF_E_INVALID;
    region *r = calloc(1, sizeof *r);
    if (!r)
        return AXF_E_NOMEM;
    r->kind = kind;
    r->len = len;
    r->access = access;
    r->fd = -1;
    if (kind == AXF_MEM_CUDA) {
        r->addr = (uint8_t *)(uintptr_t)addr;
    } else {
        r->foff = addr;
        r->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (r->fd < 0) {
            free(r);
            return AXF_E_REGISTRATION;
        }
    }
    return region_add(e, r, id_out, key_out);
}

/* e->mu held: every transport undoes what it mapped of rr (in registry
 * order: a CUDA host registration of a mapping before the mapping). */
void rr_unmap(rregion *rr)
{
    AXF_FOR_XP(xp)
        if (xp->rr_unmap)
            xp->rr_unmap(rr);
}

/* e->mu held: the far regions of ep no op can use any more (forgotten,
 * revoked, or the endpoint is dead) are unmapped. */
void rr_unmap_idle(endpoint *ep)
{
    for (rregion *rr = ep->rregions; rr; rr = rr->next)
        if ((rr->gone || ep->dead) && atomic_load(&rr->users) == 0)
            rr_unmap(rr);
}

/* An op no longer touches its remote regions; a revoked one may now be
 * acknowledged. Paired with revoke_received: one of the two sees the other. */
static void op_release_remote(axf_engine *e, op *o)
{
    bool flush = false, eager = false;
    for (size_t i = 0; i < o->nrregs; i++) {
        rregion *rr = o->rregs[i];
        if (atomic_fetch_sub(&rr->users, 1) == 1) {
            flush |= atomic_load(&rr->revoked);
            /* its transport's mappings are looked at under e->mu only */
            eager |= (o->ep->xp->caps & AXF_XP_CAP_EAGER_UNMAP) != 0;
        }
    }
    if (flush || eager) {
        pthread_mutex_lock(&e->mu);
        if (flush)
            rv_acks_flush(e, o->ep);
        if (eager)
            rr_unmap_idle(o->ep);
        pthread_mutex_unlock(&e->mu);
    }
}

/* ---------------------------------------------------------------- ops */

op *op_find(axf_engine *e, uint64_t req_id)
{
    for (op *o = e->ops[req_id % AXF_OP_BUCKETS]; o; o = o->hnext)
        if (o->req_id == req_id)
            return o;
    return NULL;
}

static void op_unlink(axf_engine *e, op *o) /* e->mu held */
{
    op **p = &e->ops[o->req_id % AXF_OP_BUCKETS];
    while (*p && *p != o)
        p = &(*p)->hnext;
    if (*p)
        *p = o->hnext;
    if (o->prev)
        o->prev->next = o->next;
    else
        o->ep->ops = o->next;
    if (o->next)
        o->next->prev = o->prev;
    o->prev = o->next = NULL;
    if (o->ep->closing)
        ep_maybe_bye(e, o->ep);
}

#if defined(__SANITIZE_ADDRESS__)
#define AXF_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AXF_ASAN 1
#endif
#endif
#define OP_CACHE_MAX 1024u /* records kept: a deep queue's worth */

static inline void op_cache_lock(axf_engine *e)
{
    while (atomic_flag_test_and_set_explicit(&e->op_lock, memory_order_acquire))
        cpu_relax();
}

/* A zeroed op record: a cached one, else a new one. */
static op *op_alloc(axf_engine *e)
{
    op_cache_lock(e);
    op *o = e->op_cache;
    if (o) {
        e->op_cache = o->hnext;
        e->op_cached--;
    }
    atomic_flag_clear_explicit(&e->op_lock, memory_order_release);
    if (!o)
        return calloc(1, sizeof *o);
    memset(o, 0, sizeof *o);
    return o;
}

static void op_dealloc(axf_engine *e, op *o)
{
#ifdef AXF_ASAN
    /* None kept under AddressSanitizer: a record used after its op was
     * freed is then reported, not silently reused. */
    (void)e;
#else
    op_cache_lock(e);
    if (e->op_cached < OP_CACHE_MAX) {
        o->hnext = e->op_cache;
        e->op_cache = o;
        e->op_cached++;
        o = NULL;
    }
    atomic_flag_clear_explicit(&e->op_lock, memory_order_release);
#endif
    free(o);
}

/* An op's local regions: once released, a deregistration may go on. */
static void op_lregs_release(axf_engine *e, op *o)
{
    for (size_t i = 0; i < o->nlregs; i++)
        region_unref(e, o->lregs[i]);
}

/* Everything of an op but its local regions and its record: its transport's
 * state, its remote regions, its notification, and its endpoint's count,
 * its last touch of the endpoint (which may be freed from then on). */
static void op_drop_ep(axf_engine *e, op *o)
{
    if (o->priv)
        o->ep->xp->op_free(e, o);
    op_release_remote(e, o);
    free(o->notify);
    o->notify = NULL;
    endpoint *ep = o->counted ? o->ep : NULL;
    o->counted = false;
    /* Read first: once the count is down, the watcher may free a finished
     * endpoint. */
    bool ending = ep && atomic_load(&ep->halt);
    if (ep && atomic_fetch_sub(&ep->ops_alive, 1) == 1 && ending)
        watch_wake(e);
}

static void op_dealloc_all(axf_engine *e, op *o)
{
    if (o->d != &o->d1) { /* else the op's own one-descriptor storage */
        free(o->d);
        free(o->laddr);
        free(o->rr);
        free(o->rregs);
        free(o->lregs);
    }
    op_dealloc(e, o);
}

static void op_free(axf_engine *e, op *o)
{
    op_lregs_release(e, o);
    op_drop_ep(e, o);
    op_dealloc_all(e, o);
}

/* Pushes the completion and frees an op: nothing refers to it any more but
 * spliced frames of it whose pages a peer may still read (op.mem, conn.c
 * spl_keep): then a failed op is over now, told at once (AXF_CQ_XFER_HELD,
 * its outcome; a successful one waits, see below), and its local regions
 * stay held until the last of those goes (op_mem_unref: AXF_CQ_XFER_FREED).
 * So a failure is prompt and the memory safe: the caller may not reuse it,
 * nor can it be deregistered, before the second record. Without a slot for
 * that record (the ring cannot grow) the one record waits for the memory,
 * as before spl28. */
static void op_finish_now(axf_engine *e, op *o)
{
    int st = atomic_load(&o->status);
    /* Our own numbers: what the request asked, never more (a peer's
     * acknowledgement says nothing about it). */
    uint64_t nbytes = atomic_load(&o->nbytes), req_id = o->req_id, tag = o->ep->tag;
    nbytes = st == AXF_OK || nbytes > o->total ? o->total : nbytes;
    uint64_t fail_index = st == AXF_OK ? o->reroutes : o->fail_index;
    bool holds = atomic_load(&o->mem) > 1;
    if (!holds)
        op_free(e, o); /* before the completion: its regions are released first */
    atomic_fetch_add(st == AXF_OK ? &e->completed : &e->failed, 1);
    if (st == AXF_OK)
        atomic_fetch_add(&e->bytes, nbytes);
    atomic_fetch_sub(&e->n_ops, 1);
    if (!holds) {
        cq_push(e, AXF_CQ_XFER, st, req_id, tag, nbytes, fail_index, NULL, 0);
        return;
    }
    /* No hold is added from here on: one comes only from a frame of it
     * (a pin), and none is left.
     * Only a failure is told early (rev32). A success with holds (a group
     * rerouted off a dead connection whose peer has not read its pages) is
     * told once they are read or dropped, as before spl28: a caller reuses
     * a buffer as soon as its write succeeded (nobody awaits settled() after
     * a success), and the peer, reading that connection's queue later,
     * applied the reused buffer's bytes at the write's destination (native
     * test rev32_held_ok). */
    o->held = st != AXF_OK && cq_reserve(e) == AXF_OK; /* the second record's slot */
    o->fin_tag = tag;
    atomic_store(&o->nbytes, nbytes);
    o->fail_index = fail_index;
    op_drop_ep(e, o);
    if (o->held)
        cq_push(e, AXF_CQ_XFER_HELD, st, req_id, tag, nbytes, fail_index, NULL, 0);
    op_mem_unref(e, o); /* its own hold last: the second record follows the first */
}

void op_mem_hold(op *o)
{
    atomic_fetch_add(&o->mem, 1);
}

/* A hold on an op's memory gone; the last one (its completion pushed and no
 * spliced pages of it left with a peer) releases its regions and frees it. */
void op_mem_unref(axf_engine *e, op *o)
{
    if (atomic_fetch_sub(&o->mem, 1) != 1)
        return;
    bool held = o->held;
    int st = atomic_load(&o->status);
    uint64_t req_id = o->req_id, tag = o->fin_tag, nbytes = atomic_load(&o->nbytes),
             fail_index = o->fail_index;
    op_lregs_release(e, o);
    op_dealloc_all(e, o);
    if (held)
        cq_push(e, AXF_CQ_XFER_FREED, AXF_OK, req_id, tag, 0, 0, NULL, 0);
    else
        cq_push(e, AXF_CQ_XFER, st, req_id, tag, nbytes, fail_index, NULL, 0);
}

void op_unpin(axf_engine *e, op *o)
{
    if (atomic_fetch_sub(&o->pins, 1) == 1)
        op_finish_now(e, o);
}

/* An op already unlinked by its owner is over. Frames of it may still sit in
 * a send queue (a hostile peer can acknowledge what was never sent): the
 * completion, which lets the caller release the memory those frames point
 * into, waits for the last of them to leave. */
static void op_finish_unlinked(axf_engine *e, op *o)
{
    op_unpin(e, o);
}

void op_complete(axf_engine *e, op *o)
{
    pthread_mutex_lock(&e->mu);
    if (o->claimed) {
        pthread_mutex_unlock(&e->mu);
        return;
    }
    o->claimed = true;
    op_unlink(e, o);
    pthread_mutex_unlock(&e->mu);
    op_finish_unlinked(e, o);
}

/* An op failed at descriptor index (whole-op failures, such as a lost peer,
 * a close or a cancel, pass 0: the API shows an index only for descriptor
 * statuses). The first failure in time is kept, status and index together,
 * and later ones are dropped. Not the lowest failing index: once one copy
 * fails the others stop at their next check (copy_may_go reads this status),
 * so descriptors below it may never be tried, and a lower one that fails
 * later may fail only because of the first (a revoked region, the peer
 * gone). The lowest index would need every descriptor tried to the end, or
 * would name one that never failed. What is checked at post (bounds, keys,
 * access: op_resolve) is checked in order, so there the first failure is the
 * lowest index. NIXL's API reports no index; ours (the completion's
 * fail_index) says which descriptor failed the request. */
void op_set_status(op *o, int status, uint64_t index)
{
    int expected = AXF_OK;
    if (status != AXF_OK && atomic_compare_exchange_strong(&o->status, &expected, status))
        o->fail_index = index;
}

/* The data phase is over: send the bound notification, or complete. */
static void op_data_done(axf_engine *e, op *o)
{
    pthread_mutex_lock(&e->mu);
    endpoint *ep = o->ep;
    if (ep->dead) {
        op_set_status(o, ep->closing ? AXF_E_CLOSED : AXF_E_PEER_LOST, 0);
        /* A connection thread marks it dead first and the last one to exit
         * reports the loss: reported now if it is not yet, before this op's
         * completion (a caller woken by the failure sees the peer lost). */
        if (!ep->closing && !ep->lost_reported) {
            ep->lost_reported = true;
            cq_push(e, AXF_CQ_PEER_LOST, AXF_E_PEER_LOST, ep->id, ep->tag, 0, ep->peer_bye,
                    NULL, 0);
        }
    }
    if (o->notify && atomic_load(&o->status) == AXF_OK && !atomic_load(&o->cancelled)) {
        o->phase = 1;
        atomic_store(&o->remaining, 1);
        conn *c = notify_enqueue(e, o);
        if (c) {
            conn_ref(c);
            pthread_mutex_unlock(&e->mu);
            conn_kick(c);
            conn_unref(c);
            return;
        }
        op_set_status(o, o->ep->nconns ? AXF_E_PEER_LOST : AXF_E_TRANSPORT, 0);
    }
    o->claimed = true;
    op_unlink(e, o);
    pthread_mutex_unlock(&e->mu);
    op_finish_unlinked(e, o);
}

void op_unit_done(axf_engine *e, op *o)
{
    if (atomic_fetch_sub(&o->remaining, 1) != 1)
        return;
    if (o->phase == 0)
        op_data_done(e, o);
    else
        op_complete(e, o);
}

/* Called when the last connection thread of an endpoint's connection exits.
 * Ops whose remaining work sits only on connections are failed here; shm data
 * copies in worker threads finish on their own and then see ep->dead. */
void endpoint_conn_finished(axf_engine *e, endpoint *ep)
{
    op *claimed = NULL;
    pthread_mutex_lock(&e->mu);
    ep->live_conns--;
    if (ep->live_conns == 0) {
        int st = ep->closing ? AXF_E_CLOSED : AXF_E_PEER_LOST;
        /* The loss first, so a caller woken by a failed transfer sees the
         * peer lost: pushed before halt is set (a same-host copy that sees
         * halt fails its op at once, on its own thread, and its completion
         * must follow this record in the ring; pushed after unlocking, as
         * it was, it could precede it). cq_push takes only cq_mu. */
        if (!ep->lost_reported) {
            ep->lost_reported = true;
            /* fail_index 1: it said goodbye (its agent closed), nothing failed */
            cq_push(e, AXF_CQ_PEER_LOST, st, ep->id, ep->tag, 0, ep->peer_bye && !ep->closing,
                    NULL, 0);
        }
        ep->dead = true;
        atomic_store(&ep->halt, true); /* copies stop between chunks */
        for (op *o = ep->ops, *next; o; o = next) {
            next = o->next;
            /* Copies in flight (CPU or GPU) and posted RDMA requests finish
             * (or flush) on their own. */
            uint32_t caps = ep->xp->caps;
            if ((caps & (AXF_XP_CAP_OWN_DATA | AXF_XP_CAP_FAIL_EARLY)) == AXF_XP_CAP_OWN_DATA &&
                o->phase == 0)
                continue;
            if (caps & AXF_XP_CAP_FAIL_EARLY) { /* its chunks finish there and then see this */
                op_set_status(o, st, 0);
                continue;
            }
            o->claimed = true;
            op_set_status(o, st, 0);
            op_unlink(e, o);
            o->next = claimed;
            claimed = o;
        }
        rr_unmap_idle(ep);
    }
    bool flush = ep->live_conns == 0 && ep->xp->ep_lost;
    bool reap = ep->live_conns == 0;
    pthread_mutex_unlock(&e->mu);
    if (reap)
        watch_wake(e);
    if (flush) { /* e.g. posted RDMA requests flush, then their ops finish */
        pthread_mutex_lock(&e->mu);
        ep->xp->ep_lost(e, ep);
        pthread_mutex_unlock(&e->mu);
    }
    for (op *o = claimed, *next; o; o = next) {
        next = o->next;
        op_finish_unlinked(e, o);
    }
}

/* e->mu held: id named an endpoint that was closed and freed since. */
static bool ep_ended(axf_engine *e, uint64_t id)
{
    return id && id < e->next_ep;
}

endpoint *ep_find(axf_engine *e, uint64_t id) /* e->mu held */
{
    for (endpoint *ep = e->eps; ep; ep = ep->next)
        if (ep->id == id)
            return ep;
    return NULL;
}

rregion *rr_find(endpoint *ep, uint64_t rid)
{
    for (rregion *rr = ep->rregions; rr; rr = rr->next)
        if (rr->rid == rid && !rr->gone)
            return rr;
    return NULL;
}

/* Checks every descriptor and takes refs on local regions; e->mu held. */
static int op_resolve(axf_engine *e, op *o)
{
    uint32_t need_remote = o->opcode == AXF_OP_WRITE ? AXF_ACCESS_WRITE : AXF_ACCESS_READ;
    uint64_t last_lrid = 0;
    region *last = NULL;
    rregion *last_rr = NULL;
    for (size_t i = 0; i < o->n; i++) {
        const axf_desc *d = &o->d[i];
        if (!d->len) {
            o->fail_index = i;
            return AXF_E_INVALID;
        }
        if (!last || d->lrid != last_lrid) {
            region *r = NULL;
            for (size_t k = 0; k < o->nlregs; k++)
                if (o->lregs[k]->id == d->lrid)
                    r = o->lregs[k];
            if (!r) {
                /* Revoked for peers, still ours: a transfer made before its
                 * deregistration that reached the engine only now. */
                r = region_get_local(e, d->lrid);
                if (!r) {
                    o->fail_index = i;
                    return AXF_E_ACCESS;
                }
                o->lregs[o->nlregs++] = r;
            }
            last = r;
            last_lrid = d->lrid;
        }
        if (d->loff > last->len || d->len > last->len - d->loff) {
            o->fail_index = i;
            return AXF_E_ACCESS;
        }
        o->total += d->len; /* bounded by a region each: no wrap for any sane n */
        /* The memory kinds its transport reaches, and (RDMA: registered
         * with the devices) what it says it can use. */
        const axf_transport *xp = o->ep->xp;
        if (!(xp->local_mem & AXF_MEM_BIT(last->kind)) ||
            (xp->region_usable && !xp->region_usable(last))) {
            o->fail_index = i;
            return AXF_E_INVALID;
        }
        /* READ lands in local memory: the local buffer must be writable. */
        if (o->opcode == AXF_OP_READ && !(last->access & AXF_ACCESS_WRITE)) {
            o->fail_index = i;
            return AXF_E_ACCESS;
        }
        o->laddr[i] = last->addr + d->loff;
        if (xp->resolve) { /* the far side is not a region the peer shared */
            int st = xp->resolve(e, o, i, need_remote);
            if (st != AXF_OK) {
                o->fail_index = i;
                return st;
            }
            continue;
        }
        rregion *rr = last_rr && last_rr->rid == d->rrid ? last_rr : rr_find(o->ep, d->rrid);
        if (!rr || rr->key != d->rkey || !(rr->access & need_remote) || d->roff > rr->len ||
            d->len > rr->len - d->roff) {
            o->fail_index = i;
            return AXF_E_ACCESS;
        }
        if (rr != last_rr) {
            bool seen = false;
            for (size_t k = 0; k < o->nrregs && !seen; k++)
                seen = o->rregs[k] == rr;
            if (!seen) { /* a use: a revocation waits for it */
                atomic_fetch_add(&rr->users, 1);
                o->rregs[o->nrregs++] = rr;
            }
            last_rr = rr;
        }
        o->rr[i] = rr;
    }
    return AXF_OK;
}

int axf_post(axf_engine *e, uint64_t ep_id, int opcode, const axf_desc *descs, size_t n,
             const void *notify, size_t notify_len, uint64_t req_id, uint32_t flags)
{
    if (opcode != AXF_OP_WRITE && opcode != AXF_OP_READ && opcode != AXF_OP_NOTIFY)
        return AXF_E_INVALID;
    if (notify_len > AXF_MAX_NOTIFY || (opcode == AXF_OP_NOTIFY && (n || !notify_len)) ||
        (opcode != AXF_OP_NOTIFY && !n) || (opcode == AXF_OP_READ && notify_len))
        return AXF_E_INVALID;
    op *o = op_alloc(e);
    if (!o)
        return AXF_E_NOMEM;
    atomic_init(&o->pins, 1);
    atomic_init(&o->mem, 1);
    o->req_id = req_id;
    o->opcode = opcode;
    o->n = n;
    if (n == 1) {
        o->d = &o->d1;
        o->laddr = &o->laddr1;
        o->rr = &o->rr1;
        o->lregs = &o->lreg1;
        o->rregs = &o->rreg1;
        o->d1 = descs[0];
    } else if (n) {
        o->d = malloc(n * sizeof *o->d);
        o->laddr = malloc(n * sizeof *o->laddr);
        o->rr = malloc(n * sizeof *o->rr);
        o->lregs = malloc(n * sizeof *o->lregs);
        o->rregs = malloc(n * sizeof *o->rregs);
        if (!o->d || !o->laddr || !o->rr || !o->lregs || !o->rregs) {
            op_free(e, o);
            return AXF_E_NOMEM;
        }
        memcpy(o->d, descs, n * sizeof *descs);
    }
    if (notify_len) {
        o->notify = malloc(notify_len);
        if (!o->notify) {
            op_free(e, o);
            return AXF_E_NOMEM;
        }
        memcpy(o->notify, notify, notify_len);
        o->notify_len = notify_len;
    }
    pthread_mutex_lock(&e->mu);
    int st = AXF_OK;
    endpoint *ep = ep_find(e, ep_id);
    if (e->shut)
        st = AXF_E_CLOSED;
    else if (!ep)
        st = ep_ended(e, ep_id) ? ep_ended_status(e, ep_id) : AXF_E_NOTFOUND;
    else if (ep->dead || ep->closing || ep->lost_reported)
        /* (lost_reported: the loss is in the queue, and a caller that read it
         * must not get AXF_OK here; a verbs queue pair's failure reports it
         * before the connections' end marks the endpoint dead) */
        st = ep->closing ? AXF_E_CLOSED : AXF_E_PEER_LOST;
    else if (atomic_load(&ep->exited))
        st = AXF_E_PEER_LOST;
    else if (op_find(e, req_id))
        st = AXF_E_INVALID;
    else if (!(ep->xp->caps & AXF_XP_CAP_NOTIFY) && (opcode == AXF_OP_NOTIFY || notify_len))
        st = AXF_E_INVALID; /* nobody to notify */
    else if (((ep->xp->caps & AXF_XP_CAP_NEEDS_CONN) || opcode == AXF_OP_NOTIFY) &&
             ep->nconns == 0)
        st = AXF_E_TRANSPORT;
    if (st == AXF_OK) {
        o->ep = ep;
        st = op_resolve(e, o);
    }
    if (st == AXF_OK && ep->xp->check)
        st = ep->xp->check(o);
    /* Its completion's slot in the ring, promised now: here a failure is
     * the caller's AXF_E_NOMEM; once completed, the op is gone and its
     * record could not be pushed again (rev20 #2: a Transfer never done). */
    if (st == AXF_OK)
        st = cq_reserve(e);
    if (st != AXF_OK) {
        pthread_mutex_unlock(&e->mu);
        op_free(e, o);
        return st;
    }
    /* Registered: from here on exactly one completion follows. */
    o->counted = true;
    atomic_fetch_add(&ep->ops_alive, 1);
    op **b = &e->ops[req_id % AXF_OP_BUCKETS];
    o->hnext = *b;
    *b = o;
    o->next = ep->ops;
    if (ep->ops)
        ep->ops->prev = o;
    ep->ops = o;
    atomic_fetch_add(&e->n_ops, 1);
    atomic_fetch_add(&e->posted, 1);
    if (opcode == AXF_OP_NOTIFY) {
        atomic_store(&o->remaining, 1);
        pthread_mutex_unlock(&e->mu);
        op_unit_done(e, o); /* straight to the notification phase */
        return AXF_OK;
    }
    /* What the next doorbell rings (deferred frames, copies, file jobs):
     * marked once queued, so that a ring between the mark and the queueing
     * (another thread's) cannot take the mark and leave the work; an
     * undeferred post also before (tcp rings from inside its submit). */
    unsigned bell = 1u << ep->xp->ep_kind;
    if (!(flags & AXF_POST_DEFER))
        atomic_fetch_or_explicit(&e->bells, bell, memory_order_acq_rel);
    /* The transport queues (or does) the data phase and unlocks. */
    bool no_help = axf_no_help;
    if (flags & AXF_POST_NOHELP)
        axf_no_help = true;
    /* (Only with AXF_POST_POLL: the completion the submit makes quietly, on
     * this thread, is the one its caller polls for at once.) */
    bool take = (flags & (AXF_POST_INLINE | AXF_POST_POLL)) == (AXF_POST_INLINE | AXF_POST_POLL);
    if (take) {
        cq_take.armed = true;
        cq_take.taken = false;
        cq_take.id = req_id;
    }
    bool finish_now = !ep->xp->submit(e, o, flags);
    bool taken = take && cq_take.taken;
    if (take)
        cq_take.armed = cq_take.taken = false;
    axf_no_help = no_help;
    if (!(atomic_load_explicit(&e->bells, memory_order_acquire) & bell))
        atomic_fetch_or_explicit(&e->bells, bell, memory_order_acq_rel);
    if (finish_now)
        op_complete(e, o); /* (not taken: no longer armed) */
    return taken ? AXF_POST_DONE : AXF_OK;
}

void axf_doorbell(axf_engine *e)
{
    /* Nothing posted since the last ring: nothing to ring. Only shm posted
     * to (an awaited same-host copy, done inside its post, the usual case):
     * shm's doorbell alone, without the tcp dirty list's e->mu and the file
     * queue's locks. Anything else rings everything: a transport may hand
     * work to another's queues (cuda's host copies go to shm's workers).
     * Marked by axf_post on the posting thread, which rings next (tcp's
     * undeferred post rings from inside its submit). */
    unsigned bells = atomic_exchange_explicit(&e->bells, 0u, memory_order_acq_rel);
    if (!bells)
        return;
    if (bells == 1u << AXF_EP_SHM) {
        const axf_transport *shm = axf_transport_for(AXF_EP_SHM);
        if (shm && shm->doorbell)
            shm->doorbell(e);
        return;
    }
    doorbell_conns(e);
    AXF_FOR_XP(xp)
        if (xp->doorbell)
            xp->doorbell(e);
}

void axf_doorbell_ex(axf_engine *e, uint32_t flags)
{
    bool no_help = axf_no_help;
    if (flags & AXF_POST_NOHELP)
        axf_no_help = true;
    axf_doorbell(e);
    axf_no_help = no_help;
}

static void doorbell_conns(axf_engine *e)
{
    conn *dirty[64];
    pthread_mutex_lock(&e->mu);
    int ndirty = e->ndirty;
    memcpy(dirty, e->dirty, (size_t)ndirty * sizeof *dirty);
    e->ndirty = 0;
    pthread_mutex_unlock(&e->mu);
    /* Each holds a reference from mark_dirty: safe once unlocked. */
    for (int i = 0; i < ndirty; i++) {
        conn_kick(dirty[i]);
        conn_unref(dirty[i]);
    }
}

int axf_cancel(axf_engine *e, uint64_t req_id)
{
    pthread_mutex_lock(&e->mu);
    op *o = op_find(e, req_id);
    if (o) {
        atomic_store(&o->cancelled, 1);
        op_set_status(o, AXF_E_CANCELLED, 0);
    }
    pthread_mutex_unlock(&e->mu);
    return o ? AXF_OK : AXF_E_NOTFOUND;
}

/* ---------------------------------------------------------------- endpoints */

/* The process a pidfd refers to, as the kernel says (/proc/self/fdinfo):
 * its pid, -1 once it exited and was reaped, 0 outside our pid namespace;
 * -2 when fd is not a pidfd. Read once per call by its callers (cxn32:
 * endpoint_create read it three times, accept_conn twice, one of them
 * under e->mu), with open/read (stdio's fopen added an fstat and a buffer
 * for a file of ~100 bytes). */
static pid_t pidfd_pid(int pidfd)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0)
        return -2;
    size_t len = 0;
    ssize_t r;
    while (len < sizeof buf - 1 &&
           ((r = read(f, buf + len, sizeof buf - 1 - len)) > 0 || (r < 0 && errno == EINTR)))
        len += r > 0 ? (size_t)r : 0;
    close(f);
    buf[len] = 0;
    /* "Pid:" starts a line (after pos, flags, mnt_id, ino: well inside buf) */
    for (const char *at = buf; (at = strstr(at, "Pid:")); at += 4)
        if (at == buf || at[-1] == '\n')
            return (pid_t)strtol(at + 4, NULL, 10);
    return -2;
}

/* A pidfd that reports its process exited (readable). */
static bool pidfd_exited(int pidfd)
{
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL));
}


int axf_endpoint_create(axf_engine *e, int kind, uint64_t tag, int32_t pid, int pidfd,
                        uint64_t *ep_out)
{
    int st = AXF_OK;
    pid_t ppid = 0; /* the pidfd's process (pidfd_pid), once */
    const axf_transport *xp = axf_transport_for(kind);
    bool same_host = xp && (xp->caps & AXF_XP_CAP_SAME_HOST);
    if (!xp) /* a public kind whose transport is not built: unavailable */
        st = kind >= AXF_EP_TCP && kind <= AXF_EP_CUDA ? AXF_E_TRANSPORT : AXF_E_INVALID;
    else if (!same_host && (pid != 0 || pidfd >= 0))
        st = AXF_E_INVALID; /* no process to aim at: nothing to hold */
    else if (same_host && pid <= 0)
        st = AXF_E_INVALID;
    else if (same_host && pidfd < 0 && pid != getpid())
        st = AXF_E_ACCESS; /* another process, and the kernel did not vouch for it */
    else if (pidfd >= 0 && ((ppid = pidfd_pid(pidfd)) == -1 || (ppid > 0 && pidfd_exited(pidfd))))
        st = AXF_E_PEER_LOST; /* gone already */
    else if (pidfd >= 0 && ppid != pid)
        st = AXF_E_ACCESS; /* the pidfd names another process (or none, or it was reaped) */
    endpoint *ep = st == AXF_OK ? calloc(1, sizeof *ep) : NULL;
    if (st == AXF_OK && !ep)
        st = AXF_E_NOMEM;
    /* Its AXF_CQ_PEER_LOST's slot (one per endpoint: lost_reported),
     * promised while a failure can be told. */
    if (st == AXF_OK && cq_reserve(e) != AXF_OK) {
        free(ep);
        st = AXF_E_NOMEM;
    }
    if (st != AXF_OK) {
        if (pidfd >= 0)
            close(pidfd);
        return st;
    }
    ep->kind = kind;
    ep->xp = xp;
    ep->tag = tag;
    ep->pid = pid;
    ep->pidfd = pidfd;
    if (pidfd >= 0)
        (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    pthread_mutex_lock(&e->mu);
    if (e->shut) {
        pthread_mutex_unlock(&e->mu);
        if (pidfd >= 0)
            close(pidfd);
        free(ep);
        cq_unreserve(e);
        return AXF_E_CLOSED;
    }
    /* Its transport starts on demand, or refuses (not enabled). */
    int fst = xp->ep_open ? xp->ep_open(e, ep) : AXF_OK;
    if (fst != AXF_OK) {
        pthread_mutex_unlock(&e->mu);
        if (pidfd >= 0)
            close(pidfd);
        free(ep);
        cq_unreserve(e);
        return fst;
    }
    ep->id = e->next_ep++;
    ep->next = e->eps;
    e->eps = ep;
    pthread_mutex_unlock(&e->mu);
    *ep_out = ep->id;
    if (pidfd >= 0)
        watch_wake(e); /* watch it */
    return AXF_OK;
}

int axf_endpoint_add_conn(axf_engine *e, uint64_t ep_id, int fd)
{
    return axf_endpoint_add_rail_conn(e, ep_id, fd, 0);
}

int axf_endpoint_add_rail_conn(axf_engine *e, uint64_t ep_id, int fd, uint32_t rail)
{
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    int st = AXF_OK;
    if (e->shut)
        st = AXF_E_CLOSED;
    else if (!ep)
        st = ep_ended(e, ep_id) ? AXF_E_CLOSED : AXF_E_NOTFOUND;
    else if (ep->dead || ep->closing)
        st = AXF_E_CLOSED;
    else if (atomic_load(&ep->exited))
        st = AXF_E_PEER_LOST;
    int slot = ep ? ep->nconns : 0;
    if (st == AXF_OK) /* a failed connection's slot is taken over by a new one */
        for (int i = 0; i < ep->nconns; i++)
            if (atomic_load(&ep->conns[i]->down)) {
                slot = i;
                break;
            }
    if (st == AXF_OK && slot >= AXF_MAX_CONNS)
        st = AXF_E_INVALID;
    if (st != AXF_OK) {
        pthread_mutex_unlock(&e->mu);
        close(fd);
        return st;
    }
    /* Counted before the threads start so an early death is accounted. */
    ep->live_conns++;
    conn *c = conn_open(e, ep, ep->tag, fd, &st);
    if (!c) {
        ep->live_conns--;
        pthread_mutex_unlock(&e->mu);
        return st;
    }
    c->slot = slot;
    c->rail = rail;
    if (slot < ep->nconns) { /* retire the failed connection's counters into its rail's */
        conn *old = ep->conns[slot];
        int k = 0;
        while (k < ep->nretired && ep->retired[k].rail != old->rail)
            k++;
        if (k == ep->nretired && ep->nretired < AXF_MAX_CONNS)
            ep->retired[ep->nretired++] = (axf_rail_stats){.rail = old->rail};
        if (k < ep->nretired) {
            ep->retired[k].bytes += atomic_load(&old->bytes);
            ep->retired[k].reroutes += atomic_load(&old->reroutes);
        }
        conn_unref(old); /* the slot's reference */
    }
    conn_ref(c); /* the slot's */
    ep->conns[slot] = c;
    if (slot == ep->nconns)
        ep->nconns++;
    ep_conns_changed(ep); /* e.g. stripe over it too from now on */
    /* What was posted before it joined and still waits on the others'
     * queues goes over it too: a tcp peer's connections after its first one
     * join after connect returned (aioxfer's connector), and bulk requests
     * posted meanwhile would else stay on the first one to the end. */
    conn_spread_left left;
    conn_spread(e, ep, &left);
    pthread_mutex_unlock(&e->mu);
    /* Its threads start unlocked (their creation costs 0.06-0.7 ms, which
     * nobody else waits for on e->mu): it is usable meanwhile (conn_open). */
    int r = conn_launch(c);
    const axf_faults *ft = __atomic_load_n(&e->faults, __ATOMIC_ACQUIRE); /* (test only) */
    if (ft && ft->spread_gap)
        ft->spread_gap(ft->arg);
    conn_spread_end(e, &left); /* (the connections woken, its sender started) */
    return r;
}

size_t axf_endpoint_rails(axf_engine *e, uint64_t ep_id, axf_rail_stats *out, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    for (int i = 0; ep && i < ep->nconns && n < max; i++, n++) {
        conn *c = ep->conns[i];
        out[n] = (axf_rail_stats){
            .rail = c->rail,
            .live = !atomic_load(&c->down),
            .bytes = atomic_load(&c->bytes),
            .rate = atomic_load(&c->rate),
            .reroutes = atomic_load(&c->reroutes),
        };
    }
    for (int i = 0; ep && i < ep->nretired && n < max; i++, n++)
        out[n] = ep->retired[i]; /* live 0, rate 0: counters only */
    pthread_mutex_unlock(&e->mu);
    return n;
}

rregion *rregion_new(uint64_t rid, uint64_t key, uint64_t len, uint32_t access, uint64_t addr)
{
    rregion *rr = calloc(1, sizeof *rr);
    if (!rr)
        return NULL;
    rr->rid = rid;
    rr->key = key;
    rr->len = len;
    rr->access = access;
    rr->addr = addr;
    atomic_init(&rr->revoked, false);
    atomic_init(&rr->users, 0);
    return rr;
}

/* e->mu held. A region imported again under its id replaces the old one,
 * whose mapping goes now if no op uses it (else with the endpoint): kept
 * until the endpoint ended, a peer re-sending its metadata in a loop grew our
 * mappings without bound. (The small record stays until the endpoint goes: an
 * op releasing it reads it after dropping its use.) */
void rregion_publish(endpoint *ep, rregion *rr)
{
    rregion *old = rr_find(ep, rr->rid);
    if (old) {
        old->gone = true;
        if (atomic_load(&old->users) == 0)
            rr_unmap(old);
    }
    rr->next = ep->rregions;
    ep->rregions = rr;
}

int axf_endpoint_import(axf_engine *e, uint64_t ep_id, uint64_t rid, uint64_t key, uint64_t len,
                        uint32_t access, uint64_t addr, int memfd)
{
    if (!len || (access & ~(AXF_ACCESS_READ | AXF_ACCESS_WRITE)))
        return AXF_E_INVALID;
    rregion *rr = rregion_new(rid, key, len, access, addr);
    if (!rr)
        return AXF_E_NOMEM;
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    int st = e->shut ? AXF_E_CLOSED
             : !ep   ? (ep_ended(e, ep_id) ? AXF_E_CLOSED : AXF_E_NOTFOUND)
             : ep->dead || ep->closing ? AXF_E_CLOSED
                                       : AXF_OK;
    if (st == AXF_OK && memfd >= 0)
        st = ep->xp->ep_import_fd ? ep->xp->ep_import_fd(ep, rr, memfd) : AXF_E_INVALID;
    if (st != AXF_OK) {
        pthread_mutex_unlock(&e->mu);
        free(rr);
        return st;
    }
    rregion_publish(ep, rr);
    pthread_mutex_unlock(&e->mu);
    return AXF_OK;
}

int axf_endpoint_forget(axf_engine *e, uint64_t ep_id, uint64_t rid)
{
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    rregion *rr = ep ? rr_find(ep, rid) : NULL;
    if (rr) {
        rr->gone = true; /* in-flight ops keep using it; freed with the endpoint */
        if (ep->xp->caps & AXF_XP_CAP_EAGER_UNMAP)
            rr_unmap_idle(ep);
    }
    pthread_mutex_unlock(&e->mu);
    return rr ? AXF_OK : AXF_E_NOTFOUND;
}

int axf_endpoint_close(axf_engine *e, uint64_t ep_id)
{
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    if (!ep) {
        bool ended = ep_ended(e, ep_id);
        pthread_mutex_unlock(&e->mu);
        return ended ? AXF_OK : AXF_E_NOTFOUND;
    }
    ep->closing = true;
    atomic_store(&ep->halt, true); /* copies stop at their next chunk */
    if (ep_same_host(ep) && ep->live_conns > 0) {
        /* Its copies reach the peer's memory directly: the peer may release
         * it only once none runs. Ops fail now; copies stop at their next
         * chunk; the last one out says goodbye (ep_maybe_bye), and the
         * connections close once that is sent. */
        for (op *o = ep->ops; o; o = o->next) {
            op_set_status(o, AXF_E_CLOSED, 0);
            atomic_store(&o->cancelled, 1);
        }
        ep_maybe_bye(e, ep);
        pthread_mutex_unlock(&e->mu);
        return AXF_OK;
    }
    int n = ep->nconns;
    bool none = ep->live_conns == 0;
    if (none) {
        ep->dead = true;
        ep->live_conns++; /* as a connection would: endpoint_conn_finished below */
    }
    for (int i = 0; i < n; i++)
        conn_kill(ep->conns[i]);
    pthread_mutex_unlock(&e->mu);
    if (none) /* no connection thread will come by: fail what is left here */
        endpoint_conn_finished(e, ep);
    return AXF_OK;
}

int axf_accept_conn(axf_engine *e, int fd, uint64_t tag, int pidfd)
{
    int st = AXF_OK;
    pid_t ppid = pidfd >= 0 ? pidfd_pid(pidfd) : 0; /* once, and not under e->mu */
    if (ppid == -2)
        st = AXF_E_INVALID; /* not a pidfd (one whose process is gone is fine: the watcher
                               sees it) */
    pthread_mutex_lock(&e->mu);
    /* Nor once the close began (bye_network): a peer accepted then would
     * not have heard the goodbye the others did, and would be served by an
     * engine releasing its regions, its accesses refused as if revoked
     * rather than told the agent is closing (close18 (b)). */
    if (st == AXF_OK && (e->shut || e->bye))
        st = AXF_E_CLOSED;
    if (st != AXF_OK) {
        pthread_mutex_unlock(&e->mu);
        close(fd);
        if (pidfd >= 0)
            close(pidfd);
        return st;
    }
    conn *c = conn_open(e, NULL, tag, fd, &st);
    if (c && pidfd >= 0) { /* before its threads start: they read it under e->mu */
        (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        c->pidfd = pidfd;
        c->peer_pid = ppid; /* (read above: a process reaped since is the watcher's) */
    } else if (pidfd >= 0) {
        close(pidfd);
    }
    pthread_mutex_unlock(&e->mu);
    if (c)
        st = conn_launch(c); /* unlocked, as for an initiator's */
    if (c && pidfd >= 0)
        watch_wake(e);
    return st;
}

/* ---------------------------------------------------------------- watcher */

void watch_wake(axf_engine *e)
{
    uint64_t one = 1;
    ssize_t r = write(e->watch_efd, &one, sizeof one);
    (void)r; /* EAGAIN: already pending */
}

/* e->mu held: can this endpoint go? Only kinds whose structs nothing else
 * holds on to (the CUDA and verbs code keep endpoint pointers of their own). */
static bool ep_reapable(axf_engine *e, endpoint *ep)
{
    if (!(ep->xp->caps & AXF_XP_CAP_REAPABLE) || !ep->dead || ep->live_conns ||
        ep->ops || atomic_load(&ep->ops_alive) || !ep->lost_reported)
        return false;
    for (rv_ack *a = e->rv_acks; a; a = a->next)
        if (a->ep == ep)
            return false;
    return true;
}

static void ep_free(endpoint *ep)
{
    for (rregion *rr = ep->rregions, *rn; rr; rr = rn) {
        rn = rr->next;
        rr_unmap(rr);
        AXF_FOR_XP(xp)
            if (xp->rr_free)
                xp->rr_free(rr);
        free(rr);
    }
    for (int i = 0; i < ep->nconns; i++)
        conn_unref(ep->conns[i]); /* the slots' references */
    if (ep->pidfd >= 0)
        close(ep->pidfd);
    if (ep->xp->ep_free)
        ep->xp->ep_free(ep);
    free(ep);
}

/* e->mu held: remembers that endpoint id ended by loss (a post on it then
 * still says AXF_E_PEER_LOST): one bit per endpoint ever made. */
static void ep_mark_lost_id(axf_engine *e, uint64_t id)
{
    size_t byte = (size_t)(id / 8);
    if (byte >= e->lost_cap) {
        size_t ncap = e->lost_cap ? e->lost_cap : 64;
        while (ncap <= byte)
            ncap *= 2;
        uint8_t *n = realloc(e->lost_bits, ncap);
        if (!n)
            return; /* then it says AXF_E_CLOSED: still refused */
        memset(n + e->lost_cap, 0, ncap - e->lost_cap);
        e->lost_bits = n;
        e->lost_cap = ncap;
    }
    e->lost_bits[byte] |= (uint8_t)(1u << (id % 8));
}

static int ep_ended_status(axf_engine *e, uint64_t id)
{
    size_t byte = (size_t)(id / 8);
    bool lost = byte < e->lost_cap && (e->lost_bits[byte] >> (id % 8)) & 1u;
    return lost ? AXF_E_PEER_LOST : AXF_E_CLOSED;
}

/* The watcher's rounds (e->mu held): processes that exited, tcp peers past
 * their revocation deadline, endpoints and connections nothing uses any
 * more. Returns how long it may sleep (ms, -1: until woken). *finish:
 * endpoints whose loss the caller reports once unlocked. */
static int watch_scan(axf_engine *e, endpoint **finish, int *nfinish, int max_finish)
{
    uint64_t now = axf_now_ms();
    uint64_t next = UINT64_MAX;
    for (endpoint *ep = e->eps; ep; ep = ep->next) {
        if (ep->pidfd < 0 || atomic_load(&ep->exited) || !pidfd_exited(ep->pidfd))
            continue;
        if (*nfinish == max_finish) {
            next = now; /* the rest on the next round */
            break;
        }
        /* Its pid may be reused from now on: no copy may aim at it again. */
        atomic_store(&ep->exited, true);
        atomic_store(&ep->halt, true);
        cq_log(e, ep->tag, "peer process %d exited", (int)ep->pid);
        for (int i = 0; i < ep->nconns; i++)
            conn_kill(ep->conns[i]);
        if (ep->live_conns == 0 && !ep->dead) {
            ep->live_conns++; /* endpoint_conn_finished, once unlocked */
            finish[(*nfinish)++] = ep;
        }
    }
    for (conn *c = e->conns, *cn; c; c = cn) {
        cn = c->next_all;
        if (c->ep)
            continue;
        if (c->pidfd >= 0) {
            if (!atomic_load(&c->peer_exited) && pidfd_exited(c->pidfd))
                conn_peer_exited(e, c); /* may drop it from the registry */
            continue;
        }
        if (c->bye_due_ms && !c->exited && c->bye_due_ms > now) {
            /* Our goodbye said or owed at the close (bye_network): the
             * connection ends at this deadline at the latest, its
             * revocations with it. A revocation queued at the close (behind
             * an owed goodbye: never sent) has its own deadline later than
             * this one; only one sent before the close may be due earlier. */
            next = next < c->bye_due_ms ? next : c->bye_due_ms;
        } else if (c->bye_due_ms && !c->exited) {
            pthread_mutex_lock(&c->mu);
            bool owed = c->bye_owed, linger = c->bye_linger;
            pthread_mutex_unlock(&c->mu);
            if (owed)
                cq_log(e, c->tag, "closing connection: our goodbye still owed (a frame not out) "
                                  "at the close's deadline");
            else if (linger)
                cq_log(e, c->tag, "closing connection: the peer did not close after our goodbye "
                                  "by the close's deadline");
            c->bye_due_ms = 0; /* once: its threads are leaving */
            conn_kill(c);
            continue;
        }
        if (c->exited || atomic_load(&c->down))
            continue;
        pthread_mutex_lock(&c->mu);
        /* Paused for our replies (the peer does not take them) is the
         * peer's doing: its time runs. A peer that takes them at a trickle,
         * enough to keep our sender from timing out, held its revocations
         * (over verbs: its queue pairs, so the revoked memory) for as long
         * as it liked (nat28). */
        bool paused = c->rx_paused && atomic_load(&c->reply_bytes) < e->cfg.reply_queue_bytes;
        pthread_mutex_unlock(&c->mu);
        if (paused && c->revokes) {
            /* We are not reading it (backpressure): its acknowledgement may
             * be waiting in the socket. Its time runs while we read only. */
            for (rv_wait *w = c->revokes; w; w = w->next)
                w->since_ms = now;
            next = next < now + 100 ? next : now + 100;
            continue;
        }
        for (rv_wait *w = c->revokes; w; w = w->next) {
            uint64_t due = w->since_ms + e->cfg.revoke_timeout_ms;
            if (due <= now) {
                /* It cannot touch our memory once disconnected (tcp). */
                cq_log(e, c->tag,
                       "closing connection: revocation of region %llu not acknowledged "
                       "within %u ms",
                       (unsigned long long)w->rv->r->id, e->cfg.revoke_timeout_ms);
                conn_kill(c);
                break;
            }
            if (due < next)
                next = due;
        }
    }
    for (endpoint **pp = &e->eps; *pp;) {
        endpoint *ep = *pp;
        if (!ep_reapable(e, ep)) {
            pp = &ep->next;
            continue;
        }
        *pp = ep->next;
        if (!ep->closing)
            ep_mark_lost_id(e, ep->id);
        ep_free(ep);
    }
    if (next == UINT64_MAX)
        return -1;
    return next <= now ? 0 : (int)(next - now < INT32_MAX ? next - now : INT32_MAX);
}

static void *watch_main(void *arg)
{
    axf_engine *e = arg;
    /* On the stack while it fits (a few same-host peers), so that the engine
     * allocates nothing here that lives only in this thread's registers
     * (libFuzzer's leak check, which runs while the thread is in poll,
     * reported the first round's 8 bytes as a leak and stopped both frame
     * fuzzers within seconds). */
    enum { PFD_FIXED = 16 };
    struct pollfd fixed[PFD_FIXED], *pfd = fixed;
    size_t cap = PFD_FIXED;
    enum { MAX_FINISH = 64 };
    endpoint *finish[MAX_FINISH];
    pthread_mutex_lock(&e->mu);
    while (!e->watch_stop) {
        int nfinish = 0;
        int timeout = watch_scan(e, finish, &nfinish, MAX_FINISH);
        if (nfinish) {
            pthread_mutex_unlock(&e->mu);
            for (int i = 0; i < nfinish; i++)
                endpoint_conn_finished(e, finish[i]);
            pthread_mutex_lock(&e->mu);
            continue; /* a freed endpoint may be reaped now */
        }
        /* What to sleep on: the wake-up eventfd, and every pidfd whose
         * process is not known gone yet. A pidfd closed meanwhile makes
         * poll return (POLLNVAL) and the next round no longer lists it. */
        size_t n = 1;
        for (endpoint *ep = e->eps; ep; ep = ep->next)
            n += ep->pidfd >= 0 && !atomic_load(&ep->exited);
        for (conn *c = e->conns; c; c = c->next_all)
            n += c->pidfd >= 0 && !atomic_load(&c->peer_exited);
        if (n > cap) {
            struct pollfd *np = pfd == fixed ? malloc(n * sizeof *np)
                                             : realloc(pfd, n * sizeof *np);
            if (np) {
                pfd = np;
                cap = n;
            } else {
                n = cap; /* watch what fits; look again soon */
                timeout = timeout < 0 || timeout > 100 ? 100 : timeout;
            }
        }
        size_t k = 0;
        if (k < n)
            pfd[k++] = (struct pollfd){.fd = e->watch_efd, .events = POLLIN};
        for (endpoint *ep = e->eps; ep && k < n; ep = ep->next)
            if (ep->pidfd >= 0 && !atomic_load(&ep->exited))
                pfd[k++] = (struct pollfd){.fd = ep->pidfd, .events = POLLIN};
        for (conn *c = e->conns; c && k < n; c = c->next_all)
            if (c->pidfd >= 0 && !atomic_load(&c->peer_exited))
                pfd[k++] = (struct pollfd){.fd = c->pidfd, .events = POLLIN};
        pthread_mutex_unlock(&e->mu);
        if (k)
            (void)poll(pfd, (nfds_t)k, timeout);
        else if (timeout != 0)
            (void)poll(NULL, 0, 100);
        uint64_t v;
        ssize_t r = read(e->watch_efd, &v, sizeof v);
        (void)r;
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    if (pfd != fixed)
        free(pfd);
    return NULL;
}

/* ---------------------------------------------------------------- shutdown */

/* Before the agent revokes its regions on close: a network peer (no pidfd:
 * it reaches our memory only through frames we serve) hears our goodbye
 * now, so that what it has in flight fails as a close (PEER_LOST, goodbye
 * flag) and not as refused accesses to regions we are about to revoke.
 * Same-host peers keep their connections: they may still copy into our
 * memory, and the revocation has to wait for them on those connections
 * (axf_engine_shutdown says their goodbye after that). Our own outgoing
 * connections are shutdown's too. Then it waits (up to min(peer_timeout,
 * 1 s)) for those connections' threads to leave: a frame the peer sent
 * before the goodbye is served (or dropped) while its region is still
 * registered, not refused by the release that follows. */
int axf_engine_bye_network(axf_engine *e)
{
    pthread_mutex_lock(&e->mu);
    if (e->shut) {
        pthread_mutex_unlock(&e->mu);
        return AXF_E_CLOSED;
    }
    e->bye = true;
    uint32_t grace_ms = e->cfg.peer_timeout_ms < 1000 ? e->cfg.peer_timeout_ms : 1000;
    uint64_t until = axf_now_ms() + grace_ms;
    /* Each goodbye said now, or owed (conn_say_bye): a connection whose
     * sender is in the middle of a frame (a reply being written, a large
     * response to a slow reader) says it once that frame is out, however
     * long it takes, and only then ends. Skipped instead, the peer saw a
     * loss, not a close: nat22 waited for such senders within the grace
     * below, still a loss past it (native test_nat24_bye). No connection is
     * added meanwhile (e->bye refuses them). */
    /* Each also gets its deadline (watch_scan): min(peer timeout, revoke
     * timeout) from now. The revocations that the close's release_all
     * queues behind an owed goodbye never go out, and none can be
     * acknowledged after a goodbye; they settle when the connection ends
     * (revokes_drop: a tcp peer touches our memory only through frames our
     * receiver serves). Without the deadline the watcher ended it at
     * revoke_timeout only, logging a revocation not acknowledged, and a
     * close_timeout no longer than that quarantined the region for good
     * (native test_nat25_bye_revoke). */
    uint32_t due_ms = e->cfg.peer_timeout_ms < e->cfg.revoke_timeout_ms
                          ? e->cfg.peer_timeout_ms
                          : e->cfg.revoke_timeout_ms;
    uint64_t due = axf_now_ms() + due_ms;
    for (conn *c = e->conns; c; c = c->next_all)
        if (!c->ep && c->pidfd < 0) {
            c->bye_due_ms = due;
            conn_say_bye(c, true);
        }
    pthread_mutex_unlock(&e->mu);
    watch_wake(e); /* the new deadlines */
    for (;;) {
        bool all_out = true;
        pthread_mutex_lock(&e->mu);
        for (conn *c = e->conns; c && all_out; c = c->next_all)
            all_out = c->ep || c->pidfd >= 0 || c->exited;
        pthread_mutex_unlock(&e->mu);
        uint64_t now = axf_now_ms();
        if (all_out || now >= until)
            return AXF_OK;
        /* A thread leaving signals th_cv; one that left between the look
         * above and this wait is caught by the slice's end. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts); /* th_cv's clock */
        long slice_ms = until - now < 10 ? (long)(until - now) : 10;
        ts.tv_nsec += slice_ms * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&e->th_mu);
        (void)pthread_cond_timedwait(&e->th_cv, &e->th_mu, &ts);
        pthread_mutex_unlock(&e->th_mu);
    }
}

void axf_engine_shutdown(axf_engine *e)
{
    pthread_mutex_lock(&e->mu);
    if (e->shut) {
        pthread_mutex_unlock(&e->mu);
        return;
    }
    /* Atomic: conn_mark_dead reads it without e->mu (a receiver killing its
     * connection); a plain store beside an atomic load is a C11 data race. */
    __atomic_store_n(&e->shut, true, __ATOMIC_RELAXED);
    for (endpoint *ep = e->eps; ep; ep = ep->next) {
        ep->closing = true;
        atomic_store(&ep->halt, true);
        for (op *o = ep->ops; o; o = o->next) { /* no copy goes on, no notification goes out */
            op_set_status(o, AXF_E_CLOSED, 0);
            atomic_store(&o->cancelled, 1);
        }
    }
    /* Connections of same-host endpoints stay up until our copies stopped:
     * then they say goodbye. */
    for (conn *c = e->conns; c; c = c->next_all)
        if (!c->ep)
            conn_say_bye(c, false); /* its initiator sees us close, not fail */
        else if (!ep_same_host(c->ep))
            conn_kill(c);
    pthread_mutex_unlock(&e->mu);

    /* Copies that reach peers' memory finish or fail (in reverse registry
     * order: the same-host copies before the GPU copies). */
    for (size_t i = axf_ntransports; i-- > 0;)
        if (axf_transports[i]->quiesce)
            axf_transports[i]->quiesce(e);

    /* Goodbye on each live same-host connection; they close once it is
     * sent. Waited for a little (a peer that does not read waits for our
     * exit instead, shutdown does not wait for it), then closed anyway. */
    pthread_mutex_lock(&e->mu);
    for (endpoint *ep = e->eps; ep; ep = ep->next)
        if (ep_same_host(ep) && !ep->bye_sent)
            ep_send_bye(ep);
    pthread_mutex_unlock(&e->mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* th_cv's clock */
    uint32_t grace_ms = e->cfg.peer_timeout_ms < 1000 ? e->cfg.peer_timeout_ms : 1000;
    until.tv_sec += grace_ms / 1000;
    until.tv_nsec += (long)(grace_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    for (;;) {
        bool all_down = true;
        pthread_mutex_lock(&e->mu);
        for (endpoint *ep = e->eps; ep && all_down; ep = ep->next)
            for (int i = 0; ep_same_host(ep) && i < ep->nconns && all_down; i++)
                all_down = atomic_load(&ep->conns[i]->down);
        pthread_mutex_unlock(&e->mu);
        if (all_down)
            break;
        pthread_mutex_lock(&e->th_mu);
        int r = pthread_cond_timedwait(&e->th_cv, &e->th_mu, &until); /* a thread left */
        pthread_mutex_unlock(&e->th_mu);
        if (r == ETIMEDOUT)
            break;
    }
    pthread_mutex_lock(&e->mu);
    for (conn *c = e->conns; c; c = c->next_all)
        conn_kill(c);
    for (endpoint *ep = e->eps; ep; ep = ep->next)
        for (int i = 0; i < ep->nconns; i++)
            conn_kill(ep->conns[i]);
    pthread_mutex_unlock(&e->mu);

    /* Connection threads are detached: wait for them to leave. */
    pthread_mutex_lock(&e->th_mu);
    while (e->conn_threads > 0)
        pthread_cond_wait(&e->th_cv, &e->th_mu);
    pthread_mutex_unlock(&e->th_mu);

    /* Queued work fails, what is in flight finishes (posted RDMA requests
     * flush and their ops finish). */
    AXF_FOR_XP(xp)
        if (xp->stop)
            xp->stop(e);

    /* Whatever is left (endpoints that never had a connection). */
    for (;;) {
        op *o = NULL;
        pthread_mutex_lock(&e->mu);
        for (endpoint *ep = e->eps; ep && !o; ep = ep->next)
            o = ep->ops;
        if (o) {
            o->claimed = true;
            op_set_status(o, AXF_E_CLOSED, 0);
            op_unlink(e, o);
        }
        pthread_mutex_unlock(&e->mu);
        if (!o)
            break;
        op_finish_unlinked(e, o);
    }
    pthread_mutex_lock(&e->mu);
    for (endpoint *ep = e->eps; ep; ep = ep->next)
        if (!ep->lost_reported) {
            ep->lost_reported = true;
            ep->dead = true;
            cq_push(e, AXF_CQ_PEER_LOST, AXF_E_CLOSED, ep->id, ep->tag, 0, 0, NULL, 0);
        }
    /* Quarantined regions: given up, said so (AXF_E_CLOSED: never reuse). */
    for (conn *c = e->conns, *cn; c; c = cn) {
        cn = c->next_all;
        for (rv_wait *w = c->revokes; w; w = w->next)
            w->rv->r->freed_status = AXF_E_CLOSED;
        if (c->exited && !c->gone && !c->released)
            atomic_fetch_sub(&e->held_conns, 1);
        c->gone = true;
        revokes_settle_all(e, c);
        if (c->exited)
            conn_registry_drop(e, c);
    }
    e->watch_stop = true;
    pthread_mutex_unlock(&e->mu);
    watch_wake(e);
    if (e->watch_started) {
        pthread_join(e->watch_thread, NULL);
        e->watch_started = false;
    }
    for (size_t b = 0; b < AXF_REGION_BUCKETS; b++) {
        for (;;) {
            pthread_mutex_lock(&e->mu);
            region *r = e->regions[b];
            if (r)
                e->regions[b] = r->next;
            pthread_mutex_unlock(&e->mu);
            if (!r)
                break;
            region_unref(e, r);
        }
    }
}

void axf_engine_destroy(axf_engine *e)
{
    if (!e)
        return;
    axf_engine_shutdown(e);
    for (rv_ack *a = e->rv_acks, *n; a; a = n) {
        n = a->next;
        conn_unref(a->c);
        free(a);
    }
    for (int i = 0; i < e->ndirty; i++)
        conn_unref(e->dirty[i]);
    for (endpoint *ep = e->eps, *n; ep; ep = n) {
        n = ep->next;
        ep_free(ep);
    }
    for (conn *c = e->conns, *n; c; c = n) { /* their threads are gone */
        n = c->next_all;
        conn_unref(c);
    }
    AXF_FOR_XP(xp)
        if (xp->destroy)
            xp->destroy(e);
    for (op *o = e->op_cache, *n; o; o = n) {
        n = o->hnext;
        free(o);
    }
    for (size_t i = 0; i < e->cq_count; i++)
        free(e->cq[(e->cq_head + i) % e->cq_cap].payload);
    free(e->cq);
    free(e->drop_note_buf);
    free(e->lost_bits);
    close(e->efd);
    close(e->watch_efd);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->cq_mu);
    pthread_mutex_destroy(&e->th_mu);
    pthread_mutex_destroy(&e->help_mu);
    pthread_cond_destroy(&e->th_cv);
    axf_env_release(&e->env); /* the transports are gone: nothing reads it now */
    free(e);
}

/* The engine core over the test-only mock transport (native/src/mock.c): no
 * socket, no copy thread. The test finishes every op's data phase itself, in
 * any order, and plays the peer's side of the control connections, so the
 * completion ring, op lifetime, cancellation, revocation and shutdown are
 * checked deterministically (as NIXL tests its agent against a mock backend). */
#include "harness.h"
#include "mock.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define FAR_RID 5
#define FAR_KEY 0x5eed
#define FAR_LEN (1u << 20)

static uint8_t src[1u << 16];

/* An engine, a local region over src, a mock endpoint with one far region. */
typedef struct fixture {
    tengine *t;
    uint64_t lrid, lkey, ep;
} fixture;

static int fx_open(fixture *f)
{
    memset(f, 0, sizeof *f);
    f->t = t_engine(NULL);
    CHECK(f->t);
    CHECK_EQ(axf_region_register(f->t->e, src, sizeof src, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &f->lrid, &f->lkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(f->t->e, AXF_EP_MOCK, 42, 0, -1, &f->ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import(f->t->e, f->ep, FAR_RID, FAR_KEY, FAR_LEN,
                                 AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0x100000, -1),
             AXF_OK);
    return 0;
}

static axf_desc desc(const fixture *f, uint64_t len)
{
    return (axf_desc){.lrid = f->lrid, .rrid = FAR_RID, .rkey = FAR_KEY, .len = len};
}

static int post(const fixture *f, uint64_t req, uint64_t len)
{
    axf_desc d = desc(f, len);
    return axf_post(f->t->e, f->ep, AXF_OP_WRITE, &d, 1, NULL, 0, req, 0);
}

/* Exactly what the ring holds now, no waiting: nothing else runs. */
static size_t ring(fixture *f, axf_completion *out, size_t max)
{
    return axf_poll(f->t->e, out, max);
}

static int test_registry(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    uint64_t ep = 0;
    CHECK_EQ(axf_endpoint_create(t->e, 99, 1, 0, -1, &ep), AXF_E_INVALID); /* no such kind */
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_MOCK, 1, 0, -1, &ep), AXF_OK);
    CHECK(axf_transport_for(AXF_EP_MOCK) == &axf_xp_mock);
    CHECK(axf_transport_for(99) == NULL);
    size_t n = 0;
    for (const axf_transport *const *xi = axf_transports; *xi; xi++, n++) {
        CHECK_EQ((*xi)->abi, AXF_TRANSPORT_ABI);
        CHECK((*xi)->submit != NULL);
        CHECK(axf_transport_for((*xi)->ep_kind) == *xi); /* one per kind */
    }
    CHECK_EQ(n, axf_ntransports);
    /* A transport not built is absent (no stub): its public kind is refused. */
    char names[256] = "", why[256] = "";
    bool verbs_built = axf_verbs_probe(NULL, names, sizeof names, why, sizeof why) == AXF_OK ||
                       strstr(why, "not built") == NULL;
    CHECK_EQ(axf_transport_for(AXF_EP_VERBS) != NULL, verbs_built);
    if (!verbs_built)
        CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_VERBS, 1, 0, -1, &ep), AXF_E_TRANSPORT);
    t_close(t);
    return 0;
}

/* Completions come out in the order ops finished (not posted), each once,
 * with its status and bytes, across the ring's growth (past 1024) and polls
 * of any size; records left behind by a short poll keep the fd readable. */
static int test_ring_order(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    enum { N = 3000 };
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(post(&f, 1000 + i, 1 + i % 512), AXF_OK);
    static uint64_t pend[N];
    CHECK_EQ(axf_mock_pending(f.t->e, pend, N), N);
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(pend[i], 1000 + i); /* submitted in post order */
    /* Finish them in a scrambled order (a permutation: 7 is prime to N),
     * taking one record per two finished: the ring fills past its first
     * size (1024) with its head away from slot 0, so it grows wrapped. */
    static uint64_t order[N];
    size_t got = 0;
    axf_completion c[7];
    for (uint64_t k = 0; k < N; k++) {
        uint64_t i = (k * 7 + 3) % N;
        order[k] = 1000 + i;
        int32_t st = i % 5 == 0 ? AXF_E_ACCESS : AXF_OK;
        CHECK_EQ(axf_mock_complete(f.t->e, 1000 + i, st, st == AXF_OK ? 1 + i % 512 : 0), AXF_OK);
        if (k % 2 == 0)
            continue;
        CHECK_EQ(ring(&f, c, 1), 1);
        CHECK_EQ(c[0].id, order[got]);
        got++;
    }
    CHECK_EQ(axf_mock_pending(f.t->e, pend, N), 0);
    CHECK_EQ(axf_mock_complete(f.t->e, 1000, AXF_OK, 0), AXF_E_NOTFOUND); /* once only */
    CHECK_EQ(got, N / 2);
    while (got < N) {
        size_t n = ring(&f, c, 7);
        CHECK(n > 0);
        for (size_t k = 0; k < n; k++, got++) {
            uint64_t i = order[got] - 1000;
            CHECK_EQ(c[k].kind, AXF_CQ_XFER);
            CHECK_EQ(c[k].id, order[got]);
            CHECK_EQ(c[k].tag, 42);
            CHECK_EQ(c[k].status, i % 5 == 0 ? AXF_E_ACCESS : AXF_OK);
            if (c[k].status == AXF_OK)
                CHECK_EQ(c[k].nbytes, 1 + i % 512);
        }
        if (got < N) { /* records remain: still signalled */
            struct pollfd p = {.fd = axf_engine_fd(f.t->e), .events = POLLIN};
            CHECK_EQ(poll(&p, 1, 0), 1);
        }
    }
    CHECK_EQ(ring(&f, c, 7), 0);
    axf_stats s;
    axf_engine_stats(f.t->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(s.ops_failed, N / 5);
    CHECK_EQ(s.ops_completed, N - N / 5);
    t_close(f.t);
    return 0;
}

/* Cancel first, then the transport finishes the op (as it sees the flag):
 * AXF_E_CANCELLED whatever the transport said. */
static int test_cancel_then_complete(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    CHECK_EQ(post(&f, 1, 100), AXF_OK);
    CHECK_EQ(post(&f, 2, 100), AXF_OK);
    CHECK_EQ(axf_cancel(f.t->e, 1), AXF_OK);
    CHECK_EQ(axf_cancel(f.t->e, 1), AXF_OK); /* still pending: idempotent */
    axf_completion c[4];
    CHECK_EQ(ring(&f, c, 4), 0); /* a cancel completes nothing by itself */
    CHECK_EQ(axf_mock_complete(f.t->e, 1, AXF_OK, 100), AXF_OK);
    CHECK_EQ(axf_mock_complete(f.t->e, 2, AXF_OK, 100), AXF_OK);
    CHECK_EQ(ring(&f, c, 4), 2);
    CHECK_EQ(c[0].id, 1);
    CHECK_EQ(c[0].status, AXF_E_CANCELLED);
    CHECK_EQ(c[1].id, 2);
    CHECK_EQ(c[1].status, AXF_OK);
    /* A failure the transport reports after the cancel does not replace it. */
    CHECK_EQ(post(&f, 3, 100), AXF_OK);
    CHECK_EQ(axf_cancel(f.t->e, 3), AXF_OK);
    CHECK_EQ(axf_mock_complete(f.t->e, 3, AXF_E_PEER_LOST, 0), AXF_OK);
    CHECK_EQ(ring(&f, c, 4), 1);
    CHECK_EQ(c[0].status, AXF_E_CANCELLED); /* the first failure wins */
    t_close(f.t);
    return 0;
}

/* The op finished first: the cancel finds nothing, the result stands. */
static int test_complete_then_cancel(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    CHECK_EQ(post(&f, 7, 100), AXF_OK);
    CHECK_EQ(axf_mock_complete(f.t->e, 7, AXF_OK, 100), AXF_OK);
    CHECK_EQ(axf_cancel(f.t->e, 7), AXF_E_NOTFOUND);
    axf_completion c[2];
    CHECK_EQ(ring(&f, c, 2), 1);
    CHECK_EQ(c[0].status, AXF_OK);
    CHECK_EQ(c[0].nbytes, 100);
    /* Its request id is free again. */
    CHECK_EQ(post(&f, 7, 100), AXF_OK);
    CHECK_EQ(post(&f, 7, 100), AXF_E_INVALID); /* but not twice at once */
    CHECK_EQ(axf_mock_complete(f.t->e, 7, AXF_OK, 100), AXF_OK);
    CHECK_EQ(ring(&f, c, 2), 1);
    CHECK_EQ(c[0].status, AXF_OK);
    t_close(f.t);
    return 0;
}

typedef struct race {
    axf_engine *e;
    uint64_t first, n;
    int *cancel_st;
    atomic_int ready, go;
} race;

static void *race_cancel(void *arg)
{
    race *r = arg;
    atomic_store(&r->ready, 1);
    while (!atomic_load(&r->go))
        sched_yield();
    for (uint64_t i = r->n; i-- > 0;) /* from the other end: the two meet */
        r->cancel_st[i] = axf_cancel(r->e, r->first + i);
    return NULL;
}

/* Cancels racing completions on another thread: each op completes once, and
 * AXF_E_CANCELLED exactly when its cancel found it. */
static int test_cancel_race(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    enum { N = 2000 };
    static int cancel_st[N];
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(post(&f, 1 + i, 64), AXF_OK);
    race r = {.e = f.t->e, .first = 1, .n = N, .cancel_st = cancel_st};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, race_cancel, &r), 0);
    while (!atomic_load(&r.ready))
        sched_yield();
    atomic_store(&r.go, 1);
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(axf_mock_complete(f.t->e, 1 + i, AXF_OK, 64), AXF_OK);
    pthread_join(th, NULL);
    static uint8_t seen[N];
    memset(seen, 0, sizeof seen);
    size_t got = 0, cancelled = 0;
    axf_completion c[64];
    for (size_t n; (n = ring(&f, c, 64)) > 0;)
        for (size_t k = 0; k < n; k++, got++) {
            CHECK_EQ(c[k].kind, AXF_CQ_XFER);
            uint64_t i = c[k].id - 1;
            CHECK(i < N && !seen[i]);
            seen[i] = 1;
            CHECK(cancel_st[i] == AXF_OK || cancel_st[i] == AXF_E_NOTFOUND);
            CHECK_EQ(c[k].status, cancel_st[i] == AXF_OK ? AXF_E_CANCELLED : AXF_OK);
            cancelled += cancel_st[i] == AXF_OK;
        }
    CHECK_EQ(got, N);
    printf("  %zu of %d cancels won the race\n", cancelled, N);
    t_close(f.t);
    return 0;
}

/* axf_wait against pushers on other threads: a push skips its eventfd write
 * while a thread spins in axf_wait, and that thread writes it when it stops.
 * One consumer, waits of varied length: whenever axf_wait returns a count the
 * eventfd is readable already (the loop's reader would wake, whether or not
 * the waiter polls); whenever it returns 0 and records are still to come, the
 * eventfd wakes the consumer (no lost wake-up); every record arrives once. */
enum { WW_PUSHERS = 4, WW_EACH = 25000 };

typedef struct ww_arg {
    axf_engine *e;
    unsigned idx;
    atomic_int *go;
} ww_arg;

static void *ww_push(void *arg)
{
    ww_arg *a = arg;
    while (!atomic_load(a->go))
        sched_yield();
    uint32_t x = 2463534242u + a->idx * 7919u;
    for (unsigned i = 0; i < WW_EACH; i++) {
        /* Its slot promised first, as axf_post does (cq21). */
        if (cq_reserve(a->e) != AXF_OK)
            return NULL; /* the consumer then misses records: the test fails */
        cq_push(a->e, AXF_CQ_XFER, AXF_OK, (uint64_t)a->idx * WW_EACH + i + 1, 0, 0, 0, NULL, 0);
        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
        if ((x & 7) == 0) /* a pause: the consumer stops spinning, or blocks */
            for (unsigned k = x >> 20; k; k--)
                __asm__ __volatile__("" ::: "memory");
        else if ((x & 7) == 1)
            sched_yield();
    }
    return NULL;
}

/* What both ring tests share: an engine, its pushers (started by ww_begin,
 * pushing once go is set), and which of their records the consumer took. */
typedef struct ww_run {
    tengine *t;
    axf_engine *e;
    int efd;
    atomic_int go;
    pthread_t th[WW_PUSHERS];
    ww_arg args[WW_PUSHERS];
    uint8_t seen[WW_PUSHERS * WW_EACH];
    size_t got;
} ww_run;

static int ww_begin(ww_run *w)
{
    w->t = t_engine(NULL);
    CHECK(w->t);
    w->e = w->t->e;
    w->efd = axf_engine_fd(w->e);
    for (unsigned p = 0; p < WW_PUSHERS; p++) {
        w->args[p] = (ww_arg){.e = w->e, .idx = p, .go = &w->go};
        CHECK_EQ(pthread_create(&w->th[p], NULL, ww_push, &w->args[p]), 0);
    }
    return 0;
}

/* The k records polled: each a transfer's, each seen once. */
static int ww_take(ww_run *w, const axf_completion *c, size_t k)
{
    for (size_t i = 0; i < k; i++, w->got++) {
        CHECK_EQ(c[i].kind, AXF_CQ_XFER);
        uint64_t id = c[i].id - 1;
        CHECK(id < sizeof w->seen && !w->seen[id]);
        w->seen[id] = 1;
    }
    return 0;
}

/* Waits for the pushers (all of their records pushed). */
static void ww_join(ww_run *w)
{
    for (unsigned p = 0; p < WW_PUSHERS; p++)
        pthread_join(w->th[p], NULL);
}

static int test_wait_wake(void)
{
    static ww_run w;
    memset(&w, 0, sizeof w);
    CHECK_EQ(ww_begin(&w), 0);
    static const uint32_t waits[] = {0, 1, 3, 20, 200};
    size_t rounds = 0, blocked = 0, counted = 0;
    axf_completion c[16];
    atomic_store(&w.go, 1);
    while (w.got < (size_t)WW_PUSHERS * WW_EACH) {
        size_t n = axf_wait(w.e, waits[rounds++ % 5]);
        struct pollfd pf = {.fd = w.efd, .events = POLLIN};
        if (n) {
            counted++;
            CHECK_EQ(poll(&pf, 1, 0), 1); /* written by then */
        } else if (rounds & 1) {
            blocked++;
            CHECK_EQ(poll(&pf, 1, T_TIMEOUT_MS), 1); /* a record comes: it wakes us */
        }
        if (rounds & 2)
            CHECK_EQ(ww_take(&w, c, axf_poll(w.e, c, 16)), 0);
    }
    ww_join(&w);
    CHECK_EQ(axf_poll(w.e, c, 16), 0);
    printf("  %zu waits: %zu found records, %zu blocked on the eventfd\n", rounds, counted,
           blocked);
    t_close(w.t);
    return 0;
}

/* axf_wait_ex(AXF_WAIT_POLLS) against the same pushers, the consumer polling
 * after every nonzero return as it promised: every record arrives once; a
 * wait that returns 0 while records are still to come leaves the eventfd to
 * wake the consumer (no lost wake-up); records a poll leaves in the ring are
 * signalled (the loop's reader would find them); and a ring that the poll
 * emptied leaves the eventfd unsignalled unless a push came since: the
 * records the spin saw cost no eventfd write and no read. */
static int test_wait_polls(void)
{
    static ww_run w;
    memset(&w, 0, sizeof w);
    CHECK_EQ(ww_begin(&w), 0);
    axf_engine *e = w.e;
    static const uint32_t waits[] = {0, 1, 3, 20, 200};
    size_t rounds = 0, blocked = 0, quiet = 0;
    axf_completion c[4];
    atomic_store(&w.go, 1);
    while (w.got < (size_t)WW_PUSHERS * WW_EACH) {
        size_t n = axf_wait_ex(e, waits[rounds++ % 5], AXF_WAIT_POLLS);
        struct pollfd pf = {.fd = w.efd, .events = POLLIN};
        if (!n) {
            blocked++;
            CHECK_EQ(poll(&pf, 1, T_TIMEOUT_MS), 1); /* a record comes: it wakes us */
        }
        CHECK_EQ(ww_take(&w, c, axf_poll(e, c, 4)), 0);
        pthread_mutex_lock(&e->cq_mu); /* a push writes the eventfd under it */
        size_t left = e->cq_count;
        int readable = poll(&pf, 1, 0);
        pthread_mutex_unlock(&e->cq_mu);
        if (left)
            CHECK_EQ(readable, 1); /* left in the ring: signalled */
        else if (!readable)
            quiet++;
    }
    ww_join(&w);
    CHECK_EQ(axf_poll(e, c, 4), 0);
    struct pollfd pf = {.fd = w.efd, .events = POLLIN};
    CHECK_EQ(poll(&pf, 1, 0), 0); /* the empty poll cleared any stale wake-up */
    printf("  %zu waits: %zu blocked on the eventfd, %zu left it unsignalled\n", rounds,
           blocked, quiet);
    t_close(w.t);
    return 0;
}

/* A region deregistered while an op holds it is freed (AXF_CQ_REGION_FREED)
 * only once the op is over, and before the op's completion: the caller may
 * reuse the memory when either arrives. */
static int test_op_holds_region(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    CHECK_EQ(post(&f, 1, 4096), AXF_OK);
    CHECK_EQ(axf_region_deregister(f.t->e, f.lrid), AXF_OK);
    axf_completion c[4];
    CHECK_EQ(ring(&f, c, 4), 0); /* the op still holds it */
    CHECK_EQ(post(&f, 2, 4096), AXF_E_ACCESS); /* but nothing new reaches it */
    axf_stats s;
    axf_engine_stats(f.t->e, &s);
    CHECK_EQ(s.regions, 1);
    CHECK_EQ(axf_mock_complete(f.t->e, 1, AXF_OK, 4096), AXF_OK);
    CHECK_EQ(ring(&f, c, 4), 2);
    CHECK_EQ(c[0].kind, AXF_CQ_REGION_FREED);
    CHECK_EQ(c[0].id, f.lrid);
    CHECK_EQ(c[0].status, AXF_OK);
    CHECK_EQ(c[0].nbytes, sizeof src);
    CHECK_EQ(c[1].kind, AXF_CQ_XFER);
    CHECK_EQ(c[1].id, 1);
    axf_engine_stats(f.t->e, &s);
    CHECK_EQ(s.regions, 0);
    t_close(f.t);
    return 0;
}

/* Checks at post the transport's capabilities say: the mock reaches host
 * memory only, has no file side, needs a connection to notify. */
static int test_post_checks(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    int fd = open("/dev/zero", O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    uint64_t frid = 0, fkey = 0;
    CHECK_EQ(axf_region_register_kind(f.t->e, AXF_MEM_FILE, 0, 4096, AXF_ACCESS_READ, fd, &frid,
                                      &fkey),
             AXF_OK);
    close(fd);
    axf_desc d = {.lrid = frid, .rrid = FAR_RID, .rkey = FAR_KEY, .len = 16};
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_INVALID);
    d = desc(&f, 16);
    d.rkey ^= 1;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_E_ACCESS);
    d = desc(&f, 16);
    d.roff = FAR_LEN - 8;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 3, 0), AXF_E_ACCESS);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_NOTIFY, NULL, 0, "hi", 2, 4, 0), AXF_E_TRANSPORT);
    uint64_t pend[4];
    CHECK_EQ(axf_mock_pending(f.t->e, pend, 4), 0); /* none reached the transport */
    axf_completion c[4];
    CHECK_EQ(ring(&f, c, 4), 0);
    t_close(f.t);
    return 0;
}

/* A bound notification goes out on the control connection once the data is
 * done; the op completes when it is acknowledged AND its frame has left the
 * send queue (a peer may acknowledge what was never sent). */
static int test_notify_frame_pins_op(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    uint64_t peer = 0;
    CHECK_EQ(axf_mock_connect(f.t->e, f.ep, &peer), AXF_OK);
    axf_desc d = desc(&f, 512);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, "done", 4, 9, 0), AXF_OK);
    wire_hdr h;
    CHECK(!axf_mock_take(f.t->e, peer, &h)); /* data first */
    CHECK_EQ(axf_mock_complete(f.t->e, 9, AXF_OK, 512), AXF_OK);
    axf_completion c[4];
    CHECK_EQ(ring(&f, c, 4), 0);
    wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_NOTIFY_ACK, .op = 9};
    CHECK_EQ(axf_mock_deliver(f.t->e, peer, &ack), AXF_OK); /* before it was "sent" */
    CHECK_EQ(ring(&f, c, 4), 0); /* its frame still points into the op */
    CHECK(axf_mock_take(f.t->e, peer, &h));
    CHECK_EQ(h.type, FR_NOTIFY);
    CHECK_EQ(h.op, 9);
    CHECK_EQ(h.len, 4);
    CHECK_EQ(ring(&f, c, 4), 1);
    CHECK_EQ(c[0].id, 9);
    CHECK_EQ(c[0].status, AXF_OK);
    CHECK_EQ(c[0].nbytes, 512);
    /* An acknowledgement nobody asked for is a protocol violation. */
    CHECK_EQ(axf_mock_deliver(f.t->e, peer, &ack), AXF_E_PROTOCOL);
    t_close(f.t);
    return 0;
}

/* Target side: a deregistered region a peer may still touch is quarantined
 * until that peer acknowledges the revocation; then it is freed. */
static int test_revoke_target(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    uint64_t p1 = 0, p2 = 0, rid = 0, key = 0;
    CHECK_EQ(axf_mock_accept(t->e, 71, &p1), AXF_OK);
    CHECK_EQ(axf_mock_accept(t->e, 72, &p2), AXF_OK);
    CHECK_EQ(axf_region_register(t->e, src, 4096, AXF_ACCESS_WRITE, -1, &rid, &key), AXF_OK);
    CHECK_EQ(axf_region_deregister(t->e, rid), AXF_OK);
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.quarantined, 1);
    CHECK_EQ(s.quarantined_bytes, 4096);
    uint64_t tags[4] = {0};
    CHECK_EQ(axf_region_holders(t->e, rid, tags, 4), 2);
    CHECK((tags[0] == 71 && tags[1] == 72) || (tags[0] == 72 && tags[1] == 71));
    wire_hdr h;
    for (uint64_t p = p1; p <= p2; p++) {
        CHECK(axf_mock_take(t->e, p, &h));
        CHECK_EQ(h.type, FR_REVOKE);
        CHECK_EQ(h.rid, rid);
        CHECK_EQ(h.key, key);
        CHECK(!axf_mock_take(t->e, p, &h));
    }
    axf_completion c[4];
    CHECK_EQ(axf_poll(t->e, c, 4), 0);
    wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_REVOKE_ACK, .rid = rid, .key = key};
    CHECK_EQ(axf_mock_deliver(t->e, p1, &ack), AXF_OK);
    CHECK_EQ(axf_mock_deliver(t->e, p1, &ack), AXF_E_PROTOCOL); /* once per revocation */
    CHECK_EQ(axf_region_holders(t->e, rid, tags, 4), 1);
    CHECK_EQ(tags[0], 72);
    CHECK_EQ(axf_poll(t->e, c, 4), 0); /* p2 may still touch it */
    CHECK_EQ(axf_mock_deliver(t->e, p2, &ack), AXF_OK);
    CHECK_EQ(axf_poll(t->e, c, 4), 1);
    CHECK_EQ(c[0].kind, AXF_CQ_REGION_FREED);
    CHECK_EQ(c[0].id, rid);
    CHECK_EQ(c[0].status, AXF_OK);
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.quarantined, 0);
    CHECK_EQ(axf_region_holders(t->e, rid, tags, 4), AXF_E_NOTFOUND);

    /* A peer whose connection ends (no process to wait for) settles its
     * revocations: it touches nothing of ours any more. */
    CHECK_EQ(axf_region_register(t->e, src, 4096, AXF_ACCESS_WRITE, -1, &rid, &key), AXF_OK);
    CHECK_EQ(axf_region_deregister(t->e, rid), AXF_OK);
    CHECK_EQ(axf_mock_deliver(t->e, p1, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_REVOKE_ACK,
                                                    .rid = rid, .key = key}),
             AXF_OK);
    CHECK_EQ(axf_poll(t->e, c, 4), 0);
    CHECK_EQ(axf_mock_close(t->e, p2), AXF_OK);
    CHECK_EQ(axf_poll(t->e, c, 4), 2);
    CHECK_EQ(c[0].kind, AXF_CQ_REGION_FREED);
    CHECK_EQ(c[0].status, AXF_OK);
    CHECK_EQ(c[1].kind, AXF_CQ_CONN_CLOSED);
    CHECK_EQ(c[1].tag, 72);
    /* A goodbye settles them too. */
    CHECK_EQ(axf_region_register(t->e, src, 4096, AXF_ACCESS_WRITE, -1, &rid, &key), AXF_OK);
    CHECK_EQ(axf_region_deregister(t->e, rid), AXF_OK);
    CHECK_EQ(axf_poll(t->e, c, 4), 0);
    CHECK_EQ(axf_mock_deliver(t->e, p1, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_BYE}),
             AXF_E_CLOSED); /* the last frame: the connection closes after it */
    CHECK_EQ(axf_poll(t->e, c, 4), 1);
    CHECK_EQ(c[0].kind, AXF_CQ_REGION_FREED);
    CHECK_EQ(c[0].id, rid);
    CHECK_EQ(axf_mock_close(t->e, p1), AXF_OK);
    CHECK_EQ(axf_poll(t->e, c, 4), 1);
    CHECK_EQ(c[0].kind, AXF_CQ_CONN_CLOSED);
    t_close(t);
    return 0;
}

/* Initiator side: the peer revokes a region an op of ours still uses: no new
 * op resolves it, and the acknowledgement waits for the op to end. */
static int test_revoke_initiator(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    uint64_t peer = 0;
    CHECK_EQ(axf_mock_connect(f.t->e, f.ep, &peer), AXF_OK);
    CHECK_EQ(post(&f, 1, 256), AXF_OK);
    wire_hdr rv = {.magic = AXF_MAGIC, .type = FR_REVOKE, .rid = FAR_RID, .key = FAR_KEY};
    CHECK_EQ(axf_mock_deliver(f.t->e, peer, &rv), AXF_OK);
    wire_hdr h;
    CHECK(!axf_mock_take(f.t->e, peer, &h)); /* op 1 may still touch it */
    CHECK_EQ(post(&f, 2, 256), AXF_E_ACCESS);
    /* A second revocation of it while the first waits: a protocol error. */
    CHECK_EQ(axf_mock_deliver(f.t->e, peer, &rv), AXF_E_PROTOCOL);
    CHECK_EQ(axf_mock_complete(f.t->e, 1, AXF_OK, 256), AXF_OK);
    CHECK(axf_mock_take(f.t->e, peer, &h));
    CHECK_EQ(h.type, FR_REVOKE_ACK);
    CHECK_EQ(h.rid, FAR_RID);
    CHECK_EQ(h.key, FAR_KEY);
    axf_completion c[4];
    CHECK_EQ(ring(&f, c, 4), 1);
    CHECK_EQ(c[0].status, AXF_OK);
    /* A region nothing uses is acknowledged at once. */
    CHECK_EQ(axf_endpoint_import(f.t->e, f.ep, 6, 66, 4096, AXF_ACCESS_WRITE, 0x1000, -1), AXF_OK);
    rv.rid = 6;
    rv.key = 66;
    CHECK_EQ(axf_mock_deliver(f.t->e, peer, &rv), AXF_OK);
    CHECK(axf_mock_take(f.t->e, peer, &h));
    CHECK_EQ(h.type, FR_REVOKE_ACK);
    CHECK_EQ(h.rid, 6);
    t_close(f.t);
    return 0;
}

/* The endpoint's last connection fails: it is lost; ops whose data phase the
 * transport owns finish when it says, with AXF_E_PEER_LOST. */
static int test_endpoint_lost(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    uint64_t peer = 0;
    CHECK_EQ(axf_mock_connect(f.t->e, f.ep, &peer), AXF_OK);
    CHECK_EQ(post(&f, 1, 256), AXF_OK);
    CHECK_EQ(axf_mock_close(f.t->e, peer), AXF_OK);
    axf_completion c[4];
    CHECK_EQ(ring(&f, c, 4), 1);
    CHECK_EQ(c[0].kind, AXF_CQ_PEER_LOST);
    CHECK_EQ(c[0].id, f.ep);
    CHECK_EQ(c[0].status, AXF_E_PEER_LOST);
    CHECK_EQ(post(&f, 2, 256), AXF_E_PEER_LOST);
    CHECK_EQ(axf_mock_complete(f.t->e, 1, AXF_OK, 256), AXF_OK);
    CHECK_EQ(ring(&f, c, 4), 1);
    CHECK_EQ(c[0].id, 1);
    CHECK_EQ(c[0].status, AXF_E_PEER_LOST);
    t_close(f.t);
    return 0;
}

/* Shutdown with ops in flight (data and notification phase) and a region in
 * quarantine: every op completes once with AXF_E_CLOSED, the endpoint is
 * reported, the region is freed once its holder's connection is closed (a
 * peer with no process to wait for touches nothing then), and nothing of the
 * transport outlives it. */
static int test_shutdown_inflight(void)
{
    fixture f;
    if (fx_open(&f))
        return 1;
    uint64_t peer = 0, acc = 0, rid = 0, key = 0;
    CHECK_EQ(axf_mock_connect(f.t->e, f.ep, &peer), AXF_OK);
    CHECK_EQ(axf_mock_accept(f.t->e, 5, &acc), AXF_OK);
    for (uint64_t i = 1; i <= 3; i++)
        CHECK_EQ(post(&f, i, 128), AXF_OK);
    axf_desc d = desc(&f, 64);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, "n", 1, 4, 0), AXF_OK);
    CHECK_EQ(axf_mock_complete(f.t->e, 4, AXF_OK, 64), AXF_OK); /* now notifying */
    CHECK_EQ(axf_region_register(f.t->e, src, 4096, AXF_ACCESS_WRITE, -1, &rid, &key), AXF_OK);
    CHECK_EQ(axf_region_deregister(f.t->e, rid), AXF_OK);
    axf_engine_shutdown(f.t->e);
    axf_completion c[16];
    size_t n = ring(&f, c, 16);
    int xfer[5] = {0}, lost = 0, freed_q = 0, freed_ok = 0;
    for (size_t k = 0; k < n; k++) {
        if (c[k].kind == AXF_CQ_XFER) {
            CHECK(c[k].id >= 1 && c[k].id <= 4);
            CHECK_EQ(c[k].status, AXF_E_CLOSED);
            xfer[c[k].id]++;
        }
        lost += c[k].kind == AXF_CQ_PEER_LOST && c[k].id == f.ep;
        freed_q += c[k].kind == AXF_CQ_REGION_FREED && c[k].id == rid && c[k].status == AXF_OK;
        freed_ok += c[k].kind == AXF_CQ_REGION_FREED && c[k].id == f.lrid &&
                    c[k].status == AXF_OK;
        axf_completion_free(&c[k]);
    }
    for (int i = 1; i <= 4; i++)
        CHECK_EQ(xfer[i], 1);
    CHECK_EQ(lost, 1);
    CHECK_EQ(freed_q, 1);
    CHECK_EQ(freed_ok, 1);
    uint64_t pend[4];
    CHECK_EQ(axf_mock_pending(f.t->e, pend, 4), 0);
    CHECK_EQ(axf_mock_complete(f.t->e, 1, AXF_OK, 0), AXF_E_NOTFOUND);
    CHECK_EQ(post(&f, 9, 16), AXF_E_CLOSED);
    t_close(f.t);
    return 0;
}

/* The keepalive (control.c) decides from a connection's time stamps alone:
 * they are set here instead of waited for. */
static int test_keepalive(void)
{
    axf_config cfg = {.keepalive_ms = 4000, .peer_timeout_ms = 6000};
    ka_configure(&cfg);
    CHECK_EQ(cfg.keepalive_ms, 2000); /* at most a third of the timeout then */
    axf_config dflt = {0};
    ka_configure(&dflt);
    CHECK_EQ(dflt.keepalive_ms, 1000);
    CHECK_EQ(dflt.peer_timeout_ms, 5000);

    tengine *t = t_engine(&(axf_config){.keepalive_ms = 1000, .peer_timeout_ms = 5000});
    CHECK(t);
    endpoint fake_ep = {0};
    conn c = {.e = t->e};
    ka_init(&c);
    uint64_t wait = 0;
    CHECK_EQ(ka_next(&c, false, &wait), KA_IDLE);
    CHECK(wait >= 1 && wait <= 1000);
    /* Idle for the keepalive time: a ping, unless a send is under way. */
    c.ka.last_send_ms -= 1000;
    c.sending = true;
    CHECK_EQ(ka_next(&c, false, &wait), KA_IDLE);
    c.sending = false;
    CHECK_EQ(ka_next(&c, false, &wait), KA_PING);
    ka_restart(&c);
    CHECK_EQ(ka_next(&c, false, &wait), KA_IDLE);

    /* A ping is liveness: heard from, and nothing more to read. */
    atomic_store(&c.ka.last_rx_us, 0);
    CHECK(ka_heard(&c, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_PING}));
    CHECK(atomic_load(&c.ka.last_rx_us) > 0);
    CHECK(!ka_heard(&c, &(wire_hdr){.magic = 0, .type = FR_PING})); /* malformed: parsed */
    CHECK(!ka_heard(&c, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_WRITE_ACK}));
    CHECK(ka_silent(-EAGAIN) && ka_silent(-ETIMEDOUT) && !ka_silent(-EPIPE));

    /* Our pings carry our timeout; a peer's shorter timeout shortens our ping
     * interval to a third of it (never longer than ours, never under 10 ms). */
    wire_hdr ping;
    ka_ping_frame(&c, &ping);
    CHECK_EQ(ping.type, FR_PING);
    CHECK_EQ(ping.len, 5000);
    CHECK_EQ(atomic_load(&c.ka.ping_ms), 1000);
    CHECK(ka_heard(&c, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_PING, .len = 60000}));
    CHECK_EQ(atomic_load(&c.ka.ping_ms), 1000); /* a longer timeout changes nothing */
    CHECK(ka_heard(&c, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_PING, .len = 600}));
    CHECK_EQ(atomic_load(&c.ka.ping_ms), 200);
    ka_restart(&c);
    CHECK_EQ(ka_next(&c, false, &wait), KA_IDLE);
    CHECK(wait <= 200);
    c.ka.last_send_ms -= 200;
    CHECK_EQ(ka_next(&c, false, &wait), KA_PING);
    CHECK(ka_heard(&c, &(wire_hdr){.magic = AXF_MAGIC, .type = FR_PING, .len = 3}));
    CHECK_EQ(atomic_load(&c.ka.ping_ms), 10); /* a hostile 3 ms: the floor */
    atomic_store(&c.ka.ping_ms, 1000);
    ka_restart(&c);

    /* A refused blocking send waits while the peer is heard from. */
    CHECK(ka_send_waits(&c));
    atomic_store(&c.ka.last_rx_us, axf_now_us() - 5000u * 1000u - 1);
    CHECK(!ka_send_waits(&c));
    /* A stamp taken after our clock read (another thread) is "just now",
     * never ~2^64 microseconds ago. */
    atomic_store(&c.ka.last_rx_us, axf_now_us() + 1000000u);
    CHECK(ka_send_waits(&c));
    atomic_store(&c.down, true);
    CHECK(!ka_send_waits(&c));
    atomic_store(&c.down, false);
    ka_send_failed(&c, -EAGAIN); /* no stall detection: not a stall */
    CHECK(!atomic_load(&c.stalled));
    t_close(t);

    /* Stall detection: replies owed, no progress either way for stall_ms. */
    t = t_engine(&(axf_config){.keepalive_ms = 1000, .peer_timeout_ms = 5000, .stall_ms = 200});
    CHECK(t);
    conn s = {.e = t->e, .ep = &fake_ep};
    ka_init(&s);
    CHECK(!ka_send_waits(&s)); /* with stall detection, a refused send is a stall */
    CHECK_EQ(ka_next(&s, true, &wait), KA_IDLE);
    CHECK(wait <= 200 / 4 + 1); /* checked a few times per stall time */
    atomic_store(&s.ka.progress_us, axf_now_us() - 300000u);
    CHECK_EQ(ka_next(&s, false, &wait), KA_IDLE); /* nothing owed: idle, not stalled */
    s.ep = NULL;
    CHECK_EQ(ka_next(&s, true, &wait), KA_IDLE); /* accepting side: never */
    s.ep = &fake_ep;
    atomic_store(&s.ka.progress_us, axf_now_us() + 1000000u); /* a later stamp */
    CHECK_EQ(ka_next(&s, true, &wait), KA_IDLE);
    CHECK(!atomic_load(&s.stalled));
    ka_progress(&s);
    CHECK_EQ(ka_next(&s, true, &wait), KA_IDLE);
    atomic_store(&s.ka.progress_us, axf_now_us() - 300000u);
    CHECK_EQ(ka_next(&s, true, &wait), KA_STALLED);
    CHECK(atomic_load(&s.stalled));
    /* A send the socket refused for the stall time is one too; others not. */
    conn s2 = {.e = t->e, .ep = &fake_ep};
    ka_init(&s2);
    ka_send_failed(&s2, -EPIPE);
    CHECK(!atomic_load(&s2.stalled));
    ka_send_failed(&s2, -EAGAIN);
    CHECK(atomic_load(&s2.stalled));
    ka_sent(&s2, axf_now_us());
    CHECK_EQ(ka_next(&s2, true, &wait), KA_IDLE);
    t_close(t);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_registry),
        T_CASE(test_ring_order),
        T_CASE(test_cancel_then_complete),
        T_CASE(test_complete_then_cancel),
        T_CASE(test_cancel_race),
        T_CASE(test_wait_wake),
        T_CASE(test_wait_polls),
        T_CASE(test_op_holds_region),
        T_CASE(test_post_checks),
        T_CASE(test_notify_frame_pins_op),
        T_CASE(test_revoke_target),
        T_CASE(test_revoke_initiator),
        T_CASE(test_endpoint_lost),
        T_CASE(test_shutdown_inflight),
        T_CASE(test_keepalive),
    };
    return T_RUN(argc, argv, cases);
}

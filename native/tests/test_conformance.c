/* One conformance suite for every transport: each case is written once and
 * run over the test-only mock transport and every real transport built here
 * (tcp and shm over socketpairs, verbs over the software verbs provider when
 * AXF_SOFTVERBS_PROVIDER names it). What must hold whatever carries the
 * bytes: access checks before memory is touched, cancellation (one
 * completion per op, cancelled or done, nothing after), shutdown with ops in
 * flight (each fails closed or was done), and notifications (a write's only
 * once its data is there; standalone ones in the order posted).
 *
 * The mock moves no bytes: the test plays its far side (finishes data
 * phases, takes notification frames and acknowledges them), so the data
 * checks apply to the real transports only. Transport-specific behaviour
 * stays in test_tcp.c, test_shm.c, test_verbs.c and test_core.c. */
#include "harness.h"
#include "mock.h"

#include <sys/socket.h>

#define A_TAG 61
#define B_TAG 62
#define REG (1u << 20)
#define RW (AXF_ACCESS_READ | AXF_ACCESS_WRITE)
#define MAX_REQ 256

typedef struct xpair xpair;

typedef struct xkind {
    const char *name;
    /* 0: open; 1: failed; -1: not available here (the case is skipped). */
    int (*open)(xpair *p);
    /* Makes far region rid/key of B's (len bytes at addr) usable from A's endpoint. */
    int (*import)(xpair *p, uint64_t rid, uint64_t key, uint64_t len, uint32_t access,
                  uint8_t *addr);
    bool moves_bytes;
} xkind;

struct xpair {
    const xkind *k;
    tengine *a, *b; /* b: NULL for the mock (the test is the far side) */
    uint64_t ep;
    uint8_t *asrc, *bdst;
    uint64_t arid, akey, brid, bkey;
    uint64_t mpeer;            /* mock: the control connection the test plays */
    uint64_t mlen[MAX_REQ];    /* mock: bytes each request asks for */
    uint64_t mnotes[MAX_REQ];  /* mock: notification frames taken, in order */
    size_t nmnotes;
    int ndev;                  /* verbs */
};

static const char *provider; /* AXF_SOFTVERBS_PROVIDER */

static int buffers(xpair *p)
{
    p->asrc = calloc(1, REG);
    p->bdst = calloc(1, REG);
    CHECK(p->asrc && p->bdst);
    CHECK_EQ(axf_region_register(p->a->e, p->asrc, REG, RW, -1, &p->arid, &p->akey), AXF_OK);
    if (p->b)
        CHECK_EQ(axf_region_register(p->b->e, p->bdst, REG, RW, -1, &p->brid, &p->bkey), AXF_OK);
    else
        p->brid = 5, p->bkey = 0x5eed;
    return p->k->import(p, p->brid, p->bkey, REG, RW, p->bdst);
}

static int plain_import(xpair *p, uint64_t rid, uint64_t key, uint64_t len, uint32_t access,
                        uint8_t *addr)
{
    CHECK_EQ(axf_endpoint_import(p->a->e, p->ep, rid, key, len, access, (uint64_t)(uintptr_t)addr,
                                 -1),
             AXF_OK);
    return 0;
}

static int mock_open(xpair *p)
{
    p->a = t_engine(NULL);
    CHECK(p->a);
    CHECK_EQ(axf_endpoint_create(p->a->e, AXF_EP_MOCK, A_TAG, 0, -1, &p->ep), AXF_OK);
    CHECK_EQ(axf_mock_connect(p->a->e, p->ep, &p->mpeer), AXF_OK);
    return buffers(p);
}

static int socket_open(xpair *p, int kind, pid_t pid)
{
    p->a = t_engine(NULL);
    p->b = t_engine(NULL);
    CHECK(p->a && p->b);
    CHECK_EQ(axf_endpoint_create(p->a->e, kind, A_TAG, pid, -1, &p->ep), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(p->a->e, p->ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(p->b->e, sv[1], B_TAG, -1), AXF_OK);
    return buffers(p);
}

static int tcp_open(xpair *p)
{
    return socket_open(p, AXF_EP_TCP, 0);
}

static int shm_open_(xpair *p)
{
    return socket_open(p, AXF_EP_SHM, getpid());
}

static int verbs_import(xpair *p, uint64_t rid, uint64_t key, uint64_t len, uint32_t access,
                        uint8_t *addr)
{
    (void)addr;
    return t_verbs_import(p->a->e, p->b->e, p->ep, p->ndev, rid, key, len, access);
}

static int verbs_open(xpair *p)
{
    if (!provider || !*provider)
        return -1;
    p->a = t_engine(NULL);
    p->b = t_engine(NULL);
    CHECK(p->a && p->b);
    p->ndev = t_verbs_connect(p->a->e, p->b->e, provider, A_TAG, B_TAG, &p->ep);
    CHECK(p->ndev > 0); /* the provider was named: it must work */
    return buffers(p);
}

static const xkind KINDS[] = {
    {"mock", mock_open, plain_import, false},
    {"tcp", tcp_open, plain_import, true},
    {"shm", shm_open_, plain_import, true},
    {"verbs", verbs_open, verbs_import, true},
};
#define NKINDS (sizeof KINDS / sizeof KINDS[0])

static void xp_close(xpair *p)
{
    t_close(p->a); /* engines first: they may still touch the buffers */
    t_close(p->b);
    free(p->asrc);
    free(p->bdst);
}

static int xp_post(xpair *p, int op, const axf_desc *d, size_t n, const char *note,
                   uint64_t req)
{
    uint64_t len = 0;
    for (size_t i = 0; i < n; i++)
        len += d[i].len;
    p->mlen[req % MAX_REQ] = len;
    return axf_post(p->a->e, p->ep, op, d, n, note, note ? strlen(note) : 0, req, 0);
}

static axf_desc xd(const xpair *p, uint64_t loff, uint64_t roff, uint64_t len)
{
    return (axf_desc){.lrid = p->arid, .loff = loff, .rrid = p->brid, .rkey = p->bkey,
                      .roff = roff, .len = len};
}

/* The mock's far side: finishes every pending data phase (as done, all of
 * its bytes) and acknowledges the notification frames queued, noting their
 * order. Nothing for the real transports, whose far side runs by itself. */
static void xp_pump(xpair *p)
{
    if (p->b)
        return;
    uint64_t pend[MAX_REQ];
    size_t n = axf_mock_pending(p->a->e, pend, MAX_REQ);
    for (size_t i = 0; i < n; i++)
        (void)axf_mock_complete(p->a->e, pend[i], AXF_OK, p->mlen[pend[i] % MAX_REQ]);
    wire_hdr h;
    while (axf_mock_take(p->a->e, p->mpeer, &h)) {
        if (h.type != FR_NOTIFY)
            continue;
        if (p->nmnotes < MAX_REQ)
            p->mnotes[p->nmnotes++] = h.op;
        wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_NOTIFY_ACK, .op = h.op};
        (void)axf_mock_deliver(p->a->e, p->mpeer, &ack);
    }
}

/* Request req's completion on A (pumping the mock meanwhile): its status,
 * or 1 when none came in time. */
static int xp_wait(xpair *p, uint64_t req, axf_completion *out)
{
    uint64_t deadline = t_now_ms() + T_TIMEOUT_MS;
    while (t_now_ms() < deadline) {
        xp_pump(p);
        if (t_wait_ex(p->a, AXF_CQ_XFER, false, req, out, 5) == 0)
            return 0;
    }
    fprintf(stderr, "%s: no completion for request %llu\n", p->k->name, (unsigned long long)req);
    return 1;
}

/* An op A posted: refused at post with `want`, or accepted and then
 * completed with `want`. */
static int refused(xpair *p, int op, axf_desc d, uint64_t req, int want)
{
    int st = xp_post(p, op, &d, 1, NULL, req);
    if (st == AXF_OK) {
        axf_completion c;
        CHECK_EQ(xp_wait(p, req, &c), 0);
        st = c.status;
    }
    CHECK_EQ(st, want);
    return 0;
}

/* Keys, bounds and permissions are checked before any memory is touched;
 * the endpoint keeps working afterwards. */
static int c_access_checks(xpair *p)
{
    memset(p->bdst, 0x11, REG);
    t_fill(p->asrc, REG, 1);
    axf_desc bad_key = xd(p, 0, 0, 64);
    bad_key.rkey ^= 1;
    CHECK(!refused(p, AXF_OP_WRITE, bad_key, 1, AXF_E_ACCESS));
    CHECK(!refused(p, AXF_OP_WRITE, xd(p, 0, REG - 32, 64), 2, AXF_E_ACCESS)); /* past the end */
    CHECK(!refused(p, AXF_OP_WRITE, xd(p, 0, UINT64_MAX - 8, 64), 3, AXF_E_ACCESS)); /* wraps */
    axf_desc unknown = xd(p, 0, 0, 64);
    unknown.rrid += 1000;
    CHECK(!refused(p, AXF_OP_READ, unknown, 4, AXF_E_ACCESS));
    axf_desc local_oob = xd(p, REG - 16, 0, 64);
    CHECK(axf_post(p->a->e, p->ep, AXF_OP_WRITE, &local_oob, 1, NULL, 0, 5, 0) != AXF_OK);
    /* A far region its owner registered read-only refuses writes. */
    static uint8_t ro[4096];
    uint64_t rorid = 900, rokey = 0x90;
    if (p->b)
        CHECK_EQ(axf_region_register(p->b->e, ro, sizeof ro, AXF_ACCESS_READ, -1, &rorid, &rokey),
                 AXF_OK);
    CHECK(!p->k->import(p, rorid, rokey, sizeof ro, AXF_ACCESS_READ, ro));
    axf_desc rod = {.lrid = p->arid, .rrid = rorid, .rkey = rokey, .len = 64};
    CHECK(!refused(p, AXF_OP_WRITE, rod, 6, AXF_E_ACCESS));
    if (p->k->moves_bytes)
        CHECK(t_all(p->bdst, REG, 0x11)); /* nothing refused touched memory */
    /* The right request on the same endpoint works. */
    axf_desc good = xd(p, 4096, 8192, 4096);
    CHECK_EQ(xp_post(p, AXF_OP_WRITE, &good, 1, NULL, 7), AXF_OK);
    axf_completion c;
    CHECK_EQ(xp_wait(p, 7, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, 4096);
    if (p->k->moves_bytes) {
        CHECK(memcmp(p->bdst + 8192, p->asrc + 4096, 4096) == 0);
        CHECK(t_all(p->bdst, 8192, 0x11));
    }
    return 0;
}

/* Cancelled ops: exactly one completion each, cancelled or done (the race
 * is the transport's), none after; the engine holds no op afterwards. */
static int c_cancel(xpair *p)
{
    enum { N = 32, LEN = REG / N };
    for (uint64_t i = 0; i < N; i++) {
        axf_desc d = xd(p, i * LEN, i * LEN, LEN);
        CHECK_EQ(xp_post(p, i % 2 ? AXF_OP_READ : AXF_OP_WRITE, &d, 1, NULL, 10 + i), AXF_OK);
    }
    for (uint64_t i = 0; i < N; i++) {
        int st = axf_cancel(p->a->e, 10 + i);
        CHECK(st == AXF_OK || st == AXF_E_NOTFOUND); /* NOTFOUND: already done */
    }
    int cancelled = 0;
    for (uint64_t i = 0; i < N; i++) {
        axf_completion c;
        CHECK_EQ(xp_wait(p, 10 + i, &c), 0);
        CHECK(c.status == AXF_OK || c.status == AXF_E_CANCELLED);
        cancelled += c.status == AXF_E_CANCELLED;
    }
    if (!p->b)
        CHECK_EQ(cancelled, N); /* the mock finished none before the cancels */
    for (uint64_t i = 0; i < N; i++)
        CHECK(t_quiet(p->a, AXF_CQ_XFER, 10 + i, i ? 0 : 50)); /* once only */
    axf_stats s;
    axf_engine_stats(p->a->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(axf_cancel(p->a->e, 10), AXF_E_NOTFOUND);
    /* The endpoint still works. */
    axf_desc d = xd(p, 0, 0, 4096);
    t_fill(p->asrc, 4096, 3);
    CHECK_EQ(xp_post(p, AXF_OP_WRITE, &d, 1, NULL, 99), AXF_OK);
    axf_completion c;
    CHECK_EQ(xp_wait(p, 99, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    if (p->k->moves_bytes)
        CHECK(memcmp(p->bdst, p->asrc, 4096) == 0);
    return 0;
}

/* Shutdown with ops in flight (some bound to notifications): each gets one
 * completion, done or closed, none hangs; posts are refused after. */
static int c_shutdown_inflight(xpair *p)
{
    enum { N = 24, LEN = REG / N };
    for (uint64_t i = 0; i < N; i++) {
        axf_desc d = xd(p, i * LEN, i * LEN, LEN);
        CHECK_EQ(xp_post(p, AXF_OP_WRITE, &d, 1, i % 3 ? NULL : "n", 40 + i), AXF_OK);
    }
    if (!p->b) { /* the mock: two bound writes now notifying, the rest in their data phase */
        CHECK_EQ(axf_mock_complete(p->a->e, 40, AXF_OK, LEN), AXF_OK);
        CHECK_EQ(axf_mock_complete(p->a->e, 43, AXF_OK, LEN), AXF_OK);
    }
    axf_engine_shutdown(p->a->e);
    int seen[N] = {0}, nseen = 0;
    axf_completion c[64];
    uint64_t deadline = t_now_ms() + T_TIMEOUT_MS;
    while (nseen < N) {
        size_t n = axf_poll(p->a->e, c, 64);
        if (!n) {
            CHECK(t_now_ms() < deadline);
            struct pollfd pf = {.fd = axf_engine_fd(p->a->e), .events = POLLIN};
            (void)poll(&pf, 1, 5);
            continue;
        }
        for (size_t k = 0; k < n; k++) {
            if (c[k].kind == AXF_CQ_XFER) {
                CHECK(c[k].id >= 40 && c[k].id < 40 + N);
                CHECK(c[k].status == AXF_OK || c[k].status == AXF_E_CLOSED);
                if (!p->b)
                    CHECK_EQ(c[k].status, AXF_E_CLOSED); /* the mock finished none whole */
                seen[c[k].id - 40]++;
                nseen++;
            }
            axf_completion_free(&c[k]);
        }
    }
    for (int i = 0; i < N; i++)
        CHECK_EQ(seen[i], 1);
    axf_desc d = xd(p, 0, 0, 64);
    CHECK_EQ(axf_post(p->a->e, p->ep, AXF_OP_WRITE, &d, 1, NULL, 0, 90, 0), AXF_E_CLOSED);
    axf_stats s;
    axf_engine_stats(p->a->e, &s);
    CHECK_EQ(s.ops, 0);
    return 0;
}

/* A write's notification is seen once all of its data is in place;
 * standalone notifications come in the order posted. */
static int c_notifications(xpair *p)
{
    enum { N = 16, LEN = 32u << 10 };
    t_fill(p->asrc, REG, 7);
    char note[16];
    for (uint64_t i = 0; i < N; i++) {
        axf_desc d = xd(p, i * LEN, i * LEN, LEN);
        snprintf(note, sizeof note, "w%02u", (unsigned)i);
        CHECK_EQ(xp_post(p, AXF_OP_WRITE, &d, 1, note, 100 + i), AXF_OK);
    }
    for (uint64_t i = 0; i < N; i++) {
        snprintf(note, sizeof note, "s%02u", (unsigned)i);
        CHECK_EQ(xp_post(p, AXF_OP_NOTIFY, NULL, 0, note, 200 + i), AXF_OK);
    }
    if (p->b) {
        bool got_w[N] = {false};
        int next_s = 0;
        for (int k = 0; k < 2 * N; k++) {
            axf_completion c;
            CHECK_EQ(t_wait_any(p->b, AXF_CQ_NOTIFY, &c), 0);
            CHECK_EQ(c.tag, B_TAG);
            CHECK_EQ(c.payload_len, 3);
            const char *pl = (const char *)c.payload;
            unsigned i = (unsigned)((pl[1] - '0') * 10 + (pl[2] - '0'));
            CHECK(i < N);
            if (pl[0] == 'w') {
                CHECK(!got_w[i]);
                got_w[i] = true;
                CHECK(memcmp(p->bdst + i * LEN, p->asrc + i * LEN, LEN) == 0); /* data first */
            } else {
                CHECK_EQ(pl[0], 's');
                CHECK_EQ(i, next_s); /* in the order posted */
                next_s++;
            }
            axf_completion_free(&c);
        }
        axf_notify_release(p->b->e, B_TAG, 2 * N);
    }
    for (uint64_t i = 0; i < N; i++) {
        axf_completion c;
        CHECK_EQ(xp_wait(p, 100 + i, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK_EQ(c.nbytes, LEN);
        CHECK_EQ(xp_wait(p, 200 + i, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    if (!p->b) { /* the frames the mock's far side took */
        CHECK_EQ(p->nmnotes, 2 * N);
        int next_s = 0;
        for (size_t k = 0; k < p->nmnotes; k++)
            if (p->mnotes[k] >= 200)
                CHECK_EQ(p->mnotes[k], 200 + next_s++);
        CHECK_EQ(next_s, N);
    }
    return 0;
}

typedef int (*xcase_fn)(xpair *p);
static const struct {
    const char *name;
    xcase_fn fn;
} CASES[] = {
    {"access_checks", c_access_checks},
    {"cancel", c_cancel},
    {"shutdown_inflight", c_shutdown_inflight},
    {"notifications", c_notifications},
};

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IONBF, 0);
    provider = getenv("AXF_SOFTVERBS_PROVIDER");
    int failed = 0, ran = 0, skipped = 0;
    for (size_t ki = 0; ki < NKINDS; ki++) {
        for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
            char name[64];
            snprintf(name, sizeof name, "%s/%s", KINDS[ki].name, CASES[ci].name);
            if (argc > 1 && strcmp(argv[1], name) != 0 && strcmp(argv[1], KINDS[ki].name) != 0)
                continue;
            xpair *p = calloc(1, sizeof *p);
            if (!p)
                return 1;
            p->k = &KINDS[ki];
            uint64_t t0 = t_now_ms();
            int r = p->k->open(p);
            if (r < 0) {
                printf("skip %s (not available here: AXF_SOFTVERBS_PROVIDER unset)\n", name);
                skipped++;
            } else {
                ran++;
                if (r == 0)
                    r = CASES[ci].fn(p);
                printf("%s %s (%llu ms)\n", r ? "FAIL" : "ok  ", name,
                       (unsigned long long)(t_now_ms() - t0));
                failed += r != 0;
            }
            xp_close(p);
            free(p);
        }
    }
    if (!ran) {
        fprintf(stderr, "no test case ran\n");
        return 2;
    }
    printf("%d of %d failed, %d skipped\n", failed, ran, skipped);
    return failed ? 1 : 0;
}

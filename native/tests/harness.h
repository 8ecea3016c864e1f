/* A small harness for the native tests: checks that report and fail, and a
 * completion waiter that sleeps in poll(2) on the engine's eventfd with a
 * deadline, so a missing completion fails the test instead of hanging it. */
#ifndef AXF_TEST_HARNESS_H
#define AXF_TEST_HARNESS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "aioxfer.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: %s: check failed: %s\n", __FILE__, __LINE__, \
                    __func__, #cond);                                            \
            return 1;                                                            \
        }                                                                        \
    } while (0)

#define CHECK_EQ(a, b)                                                                    \
    do {                                                                                  \
        long long a_ = (long long)(a), b_ = (long long)(b);                               \
        if (a_ != b_) {                                                                   \
            fprintf(stderr, "%s:%d: %s: check failed: %s == %s (%lld != %lld)\n", __FILE__, \
                    __LINE__, __func__, #a, #b, a_, b_);                                  \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

#define T_TIMEOUT_MS 10000

static inline uint64_t t_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* An engine plus the completions drained from it and not yet consumed. */
#define T_BACKLOG 4096
typedef struct tengine {
    axf_engine *e;
    axf_completion q[T_BACKLOG];
    size_t n;
} tengine;

static inline tengine *t_engine(const axf_config *cfg)
{
    tengine *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->e = axf_engine_create(cfg);
    if (!t->e) {
        free(t);
        return NULL;
    }
    return t;
}

/* Drains what is there now (non-blocking). */
static inline void t_drain(tengine *t)
{
    if (t->n < T_BACKLOG)
        t->n += axf_poll(t->e, t->q + t->n, T_BACKLOG - t->n);
}

static inline bool t_match(const axf_completion *c, uint32_t kind, bool any_id, uint64_t id)
{
    /* A request's end is AXF_CQ_XFER, or AXF_CQ_XFER_HELD where its memory
     * is still held (spl28: the one-copy send, on by default); a test that
     * cares about the memory waits for AXF_CQ_XFER_FREED itself. */
    return (c->kind == kind || (kind == AXF_CQ_XFER && c->kind == AXF_CQ_XFER_HELD)) &&
           (any_id || c->id == id);
}

/* Waits up to timeout_ms for a completion of this kind (and id unless any_id).
 * Returns 0 and moves it into *out (the caller frees its payload), or -1. */
static inline int t_wait_ex(tengine *t, uint32_t kind, bool any_id, uint64_t id,
                            axf_completion *out, int timeout_ms)
{
    uint64_t deadline = t_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        for (size_t i = 0; i < t->n; i++) {
            if (t_match(&t->q[i], kind, any_id, id)) {
                *out = t->q[i];
                memmove(&t->q[i], &t->q[i + 1], (t->n - i - 1) * sizeof t->q[0]);
                t->n--;
                return 0;
            }
        }
        uint64_t now = t_now_ms();
        if (now >= deadline)
            return -1;
        struct pollfd p = {.fd = axf_engine_fd(t->e), .events = POLLIN};
        int r = poll(&p, 1, (int)(deadline - now));
        if (r < 0 && errno != EINTR)
            return -1;
        t_drain(t);
    }
}

static inline int t_wait(tengine *t, uint32_t kind, uint64_t id, axf_completion *out)
{
    return t_wait_ex(t, kind, false, id, out, T_TIMEOUT_MS);
}

static inline int t_wait_any(tengine *t, uint32_t kind, axf_completion *out)
{
    return t_wait_ex(t, kind, true, 0, out, T_TIMEOUT_MS);
}

/* True when no completion of this kind/id shows up within ms. */
static inline bool t_quiet(tengine *t, uint32_t kind, uint64_t id, int ms)
{
    axf_completion c;
    if (t_wait_ex(t, kind, false, id, &c, ms) != 0)
        return true;
    axf_completion_free(&c);
    return false;
}

/* Shutdown, final poll, destroy; frees every undelivered payload. */
static inline void t_close(tengine *t)
{
    if (!t)
        return;
    axf_engine_shutdown(t->e);
    for (;;) {
        t_drain(t);
        for (size_t i = 0; i < t->n; i++)
            axf_completion_free(&t->q[i]);
        bool empty = t->n == 0;
        t->n = 0;
        if (empty)
            break;
    }
    axf_engine_destroy(t->e);
    free(t);
}

static inline void t_fill(uint8_t *p, size_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = (uint8_t)x;
    }
}

static inline bool t_all(const uint8_t *p, size_t n, uint8_t v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return false;
    return true;
}

/* Verbs between engines a and b (both enabled on the provider at path):
 * A's endpoint (tagged a_tag) gets one queue pair per device, paired with
 * B's, and a control connection B accepts (tagged b_tag) owning B's queue
 * pairs. *ep: A's endpoint; returns the device count, or -1 (reported). */
static inline int t_verbs_connect(axf_engine *a, axf_engine *b, const char *provider,
                                  uint64_t a_tag, uint64_t b_tag, uint64_t *ep)
{
    char why[256];
    int ndev = axf_verbs_enable(a, provider, why, sizeof why);
    if (ndev <= 0) {
        fprintf(stderr, "verbs: %s\n", why);
        return -1;
    }
    if (axf_verbs_enable(b, provider, why, sizeof why) != ndev ||
        axf_verbs_device_count(a) != ndev ||
        axf_endpoint_create(a, AXF_EP_VERBS, a_tag, 0, -1, ep) != AXF_OK)
        return -1;
    uint64_t handles[AXF_VERBS_MAX_DEVICES];
    for (int d = 0; d < ndev; d++) {
        axf_verbs_qp_info ia, ib;
        if (axf_verbs_qp_create(a, *ep, (uint32_t)d, &ia) != AXF_OK ||
            axf_verbs_accept_qp(b, (uint32_t)d, &ia, &ib, &handles[d]) != AXF_OK ||
            axf_verbs_qp_connect(a, *ep, (uint32_t)d, (uint32_t)d, &ib) != AXF_OK)
            return -1;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0 ||
        axf_endpoint_add_conn(a, *ep, sv[0]) != AXF_OK ||
        axf_verbs_accept_conn(b, sv[1], b_tag, handles, (size_t)ndev) != AXF_OK)
        return -1;
    return ndev;
}

/* B's region rid (key, len, access) imported into A's verbs endpoint ep,
 * with the remote keys of each of B's ndev devices. 0, or 1 (reported). */
static inline int t_verbs_import(axf_engine *a, axf_engine *b, uint64_t ep, int ndev,
                                 uint64_t rid, uint64_t key, uint64_t len, uint32_t access)
{
    uint64_t addrs[AXF_VERBS_MAX_DEVICES];
    uint32_t rkeys[AXF_VERBS_MAX_DEVICES];
    int n = axf_verbs_region_keys(b, rid, addrs, rkeys, AXF_VERBS_MAX_DEVICES);
    CHECK_EQ(n, ndev);
    CHECK_EQ(axf_endpoint_import(a, ep, rid, key, len, access, 0, -1), AXF_OK);
    CHECK_EQ(axf_endpoint_import_verbs(a, ep, rid, addrs, rkeys, (size_t)n), AXF_OK);
    return 0;
}

typedef int (*t_fn)(void);
typedef struct t_case {
    const char *name;
    t_fn fn;
} t_case;

/* Runs every case (or only the one named in argv[1]); non-zero on failure. */
static inline int t_main(int argc, char **argv, const t_case *cases, size_t n)
{
    signal(SIGPIPE, SIG_IGN); /* raw-socket tests write into closed sockets */
    setvbuf(stdout, NULL, _IONBF, 0);
    int failed = 0, ran = 0;
    for (size_t i = 0; i < n; i++) {
        if (argc > 1 && strcmp(argv[1], cases[i].name) != 0)
            continue;
        ran++;
        uint64_t t0 = t_now_ms();
        int r = cases[i].fn();
        printf("%s %s (%" PRIu64 " ms)\n", r ? "FAIL" : "ok  ", cases[i].name, t_now_ms() - t0);
        failed += r != 0;
    }
    if (!ran) {
        fprintf(stderr, "no test case ran\n");
        return 2;
    }
    printf("%d of %d failed\n", failed, ran);
    return failed ? 1 : 0;
}

#define T_CASE(fn) {#fn, fn}
#define T_RUN(argc, argv, cases) t_main(argc, argv, cases, sizeof cases / sizeof cases[0])

#endif

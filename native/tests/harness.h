/* A small harness for the native tests: checks that report and fail, and a
 * completion waiter that sleeps in poll(2) on the engine's eventfd with a
 * deadline, so a missing completion fails the test instead of hanging it. */
#ifndef AXF_TEST_HARNESS_H
#define AXF_TEST_HARNESS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "aioxfer.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
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

/* A missing completion's wait: 10 s, times NATIVE_TEST_TIMEOUT_SCALE (1..100;
 * read once by t_main, before any case: the ThreadSanitizer run in .ci/run
 * sets it, its build being 5-15x slower). Not an AXF_ name: test_nat23_env
 * counts those the process asks for. */
static unsigned t_timeout_scale = 1;
#define T_TIMEOUT_MS (10000u * t_timeout_scale)

static inline uint64_t t_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Which sanitizer the test is built with: T_ASAN, T_TSAN. gcc says it with
 * __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang only through
 * __has_feature: a check on the gcc macro alone runs a case clang's
 * sanitizer breaks (test_limits' RSS bound under clang's ASan). */
#if defined(__SANITIZE_ADDRESS__)
#define T_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define T_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define T_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define T_TSAN 1
#endif
#endif

/* t_racy(mem, size, why): a test's own memory that it races on by design
 * (transfers in flight to the same bytes at once, a region watched for a
 * peer's WRITE with no completion to wait for, a buffer rewritten after a
 * completion that ThreadSanitizer cannot tie to the sender's read through
 * the kernel socket). Under ThreadSanitizer those bytes' races are not
 * reported; everything else (the engine's own state) still is. Elsewhere
 * nothing. */
#ifdef T_TSAN
void AnnotateBenignRaceSized(const char *file, int line, const volatile void *mem,
                             unsigned long size, const char *desc);
#define t_racy(mem, size, why) AnnotateBenignRaceSized(__FILE__, __LINE__, (mem), (size), (why))
#else
#define t_racy(mem, size, why) ((void)(mem), (void)(size), (void)(why))
#endif

/* The definition a test's own interposer of name (pthread_create and the
 * like, defined in the test program) forwards to: a sanitizer's interceptor
 * where there is one, else the next one (libc's). dlsym(RTLD_NEXT) alone
 * finds the interceptor only where the sanitizer's runtime is a library
 * loaded after the program (gcc's libtsan.so); clang links it into the
 * program itself, where the test's definition replaced it, so RTLD_NEXT
 * went straight to libc: clang's ThreadSanitizer never saw the thread
 * start, its first instrumented call crashed and the join failed TSan's
 * CHECK in ConsumeThreadUserId (first seen in shm.c's calibration, the
 * first thread test_tcp starts). */
static inline void *t_next(const char *name)
{
    char icpt[128];
    snprintf(icpt, sizeof icpt, "__interceptor_%s", name);
    void *p = dlsym(RTLD_DEFAULT, icpt);
    return p ? p : dlsym(RTLD_NEXT, name);
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

/* Socket buffer sizes for t_tcp_pair_opts, each set before the connection is
 * made (0: the kernel's). A receive buffer set after the handshake cannot
 * widen the window scale agreed there: a peer that must hold a whole frame
 * unread sets b_rcvbuf here (on the listener: the accepted socket inherits
 * it), not on the connected socket. */
typedef struct t_tcp_opts {
    int a_sndbuf; /* the connecting end's */
    int a_rcvbuf;
    int b_rcvbuf; /* the accepted end's */
} t_tcp_opts;

/* A connected loopback TCP pair, both ends blocking and close-on-exec: *a
 * the connecting end, *b the accepted one. The tests' raw peers: one end
 * goes to an engine (axf_endpoint_add_conn, axf_accept_conn), the test
 * speaks the wire protocol by hand on the other. 0, or 1 (reported). */
static inline int t_tcp_pair_opts(int *a, int *b, const t_tcp_opts *o)
{
    static const t_tcp_opts none = {0};
    if (!o)
        o = &none;
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(l >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (o->b_rcvbuf)
        (void)setsockopt(l, SOL_SOCKET, SO_RCVBUF, &o->b_rcvbuf, sizeof o->b_rcvbuf);
    CHECK_EQ(bind(l, (struct sockaddr *)&sa, sizeof sa), 0);
    CHECK_EQ(listen(l, 1), 0);
    CHECK_EQ(getsockname(l, (struct sockaddr *)&sa, &sl), 0);
    *a = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(*a >= 0);
    if (o->a_sndbuf)
        (void)setsockopt(*a, SOL_SOCKET, SO_SNDBUF, &o->a_sndbuf, sizeof o->a_sndbuf);
    if (o->a_rcvbuf)
        (void)setsockopt(*a, SOL_SOCKET, SO_RCVBUF, &o->a_rcvbuf, sizeof o->a_rcvbuf);
    CHECK_EQ(connect(*a, (struct sockaddr *)&sa, sizeof sa), 0);
    *b = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    CHECK(*b >= 0);
    close(l);
    return 0;
}

static inline int t_tcp_pair(int *a, int *b)
{
    return t_tcp_pair_opts(a, b, NULL);
}

/* How many of the npages 4 KiB pages from m are mapped (pagemap's present
 * bit), or UINT64_MAX without pagemap. */
static inline uint64_t t_present_pages(const uint8_t *m, uint64_t npages)
{
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return UINT64_MAX;
    uint64_t n = 0, ent[512];
    for (uint64_t i = 0; i < npages; i += 512) {
        uint64_t k = npages - i < 512 ? npages - i : 512;
        ssize_t r = pread(fd, ent, k * sizeof ent[0], (off_t)(((uintptr_t)m / 4096 + i) * 8));
        for (uint64_t j = 0; r > 0 && j < (uint64_t)r / 8; j++)
            n += ent[j] >> 63;
    }
    close(fd);
    return n;
}

/* Waits (up to 5 s) until an engine's counter reaches n, e.g. a test that
 * needs its first frame spliced waits for e->splice_verdicts to count its
 * connections (conn.c spl_decide, asked by each receiver as it starts: a
 * frame sent while it is being asked goes by copy). 0, or 1 (reported). */
static inline int t_wait_count(atomic_ullong *counter, uint64_t n)
{
    for (uint64_t t = t_now_ms(); atomic_load(counter) < n;) {
        CHECK(t_now_ms() - t < 5000);
        usleep(1000);
    }
    return 0;
}

/* A raw peer of an initiator: a loopback TCP connection added to e's tcp
 * endpoint ep, its other end in *peer, where the test reads the engine's
 * frames and answers them by hand (the wire layout: internal.h). sndbuf,
 * peer_rcvbuf: the engine's end's send buffer and the peer's receive buffer
 * (0: the kernel's), set before the engine gets its end. With a pair of
 * opts (NULL: none) for sizes that must be set before the handshake (see
 * t_tcp_opts). 0, or 1 (reported). */
static inline int t_raw_peer_opts(axf_engine *e, uint64_t ep, int sndbuf, int peer_rcvbuf,
                                  const t_tcp_opts *o, int *peer)
{
    int x;
    if (t_tcp_pair_opts(&x, peer, o))
        return 1;
    if (sndbuf)
        CHECK_EQ(setsockopt(x, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf), 0);
    if (peer_rcvbuf)
        CHECK_EQ(setsockopt(*peer, SOL_SOCKET, SO_RCVBUF, &peer_rcvbuf, sizeof peer_rcvbuf), 0);
    CHECK_EQ(axf_endpoint_add_conn(e, ep, x), AXF_OK);
    return 0;
}

static inline int t_raw_peer(axf_engine *e, uint64_t ep, int sndbuf, int peer_rcvbuf, int *peer)
{
    return t_raw_peer_opts(e, ep, sndbuf, peer_rcvbuf, NULL, peer);
}

/* A relay between a target engine o and an initiator p (the goodbye tests,
 * nat24 on): a thread copying bytes between our ends of their two
 * connections (socket pairs or loopback TCP), which can stop taking o's
 * bytes (hold: o's sender then blocks mid-frame, as over a stalled link) or
 * take them at about 1 MB/s (slow: 4 KiB per 4 ms). */
typedef struct t_relay {
    int o_fd;              /* our end of the target's (o's) connection */
    int p_fd;              /* our end of the initiator's (p's) connection */
    atomic_bool hold;      /* o's bytes are not taken while set */
    atomic_bool slow;      /* o's bytes taken 4 KiB per 4 ms while set */
    atomic_bool stop;
    atomic_int o_err;      /* errno of a read or write of o's side (ECONNRESET: o's RST) */
    atomic_ullong o_bytes; /* o's bytes passed on */
    pthread_t t;
} t_relay;

/* Copies at most max bytes readable on from to to (blocking write); false
 * at EOF or an error (to's writing side is then shut); the read's error in
 * *err, the write's in *werr (either NULL: not kept). */
static inline bool t_relay_copy(int from, int to, size_t max, atomic_int *err, atomic_int *werr,
                                atomic_ullong *bytes)
{
    char buf[65536];
    ssize_t n = read(from, buf, max < sizeof buf ? max : sizeof buf);
    if (n <= 0) {
        if (n < 0 && err)
            atomic_store(err, errno);
        shutdown(to, SHUT_WR);
        return false;
    }
    if (bytes)
        atomic_fetch_add(bytes, (unsigned long long)n);
    for (ssize_t off = 0; off < n;) {
        ssize_t w = write(to, buf + off, (size_t)(n - off));
        if (w <= 0) {
            if (werr)
                atomic_store(werr, errno);
            shutdown(from, SHUT_RD);
            return false;
        }
        off += w;
    }
    return true;
}

static inline void *t_relay_main(void *arg)
{
    t_relay *r = arg;
    bool o_open = true, p_open = true;
    uint64_t next_o = 0;
    while (!atomic_load(&r->stop) && (o_open || p_open)) {
        bool slow = atomic_load(&r->slow);
        bool take_o = o_open && !atomic_load(&r->hold) && (!slow || t_now_ms() >= next_o);
        struct pollfd pf[2] = {{.fd = take_o ? r->o_fd : -1, .events = POLLIN},
                               {.fd = p_open ? r->p_fd : -1, .events = POLLIN}};
        if (poll(pf, 2, slow ? 1 : 10) <= 0)
            continue;
        if (pf[0].revents) {
            o_open = t_relay_copy(r->o_fd, r->p_fd, slow ? 4096 : 65536, &r->o_err, NULL,
                                  &r->o_bytes);
            next_o = t_now_ms() + 4;
        }
        if (pf[1].revents)
            p_open = t_relay_copy(r->p_fd, r->o_fd, 65536, NULL, &r->o_err, NULL);
    }
    return NULL;
}

/* Starts relaying between o_fd and p_fd (both then owned by the relay). */
static inline int t_relay_start(t_relay *r, int o_fd, int p_fd)
{
    memset(r, 0, sizeof *r);
    r->o_fd = o_fd;
    r->p_fd = p_fd;
    CHECK_EQ(pthread_create(&r->t, NULL, t_relay_main, r), 0);
    return 0;
}

/* Stops the relay's thread and closes its two ends. */
static inline void t_relay_stop(t_relay *r)
{
    atomic_store(&r->stop, true);
    pthread_join(r->t, NULL);
    close(r->o_fd);
    close(r->p_fd);
}

/* Bytes of o's waiting in the relay's end of o's connection (-1: error). */
static inline int t_relay_queued(t_relay *r)
{
    int queued = 0;
    return ioctl(r->o_fd, FIONREAD, &queued) == 0 ? queued : -1;
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
    const char *scale = getenv("NATIVE_TEST_TIMEOUT_SCALE");
    if (scale && atoi(scale) >= 1 && atoi(scale) <= 100)
        t_timeout_scale = (unsigned)atoi(scale);
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

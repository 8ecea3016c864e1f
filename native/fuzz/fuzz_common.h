/* Shared plumbing of the native frame-parser fuzz harnesses (libFuzzer).
 *
 * The parsers run on the engine's own connection threads, behind the public
 * API, exactly as in production: a harness hands the engine one end of a
 * socketpair (axf_accept_conn: the target side; axf_endpoint_add_conn: the
 * initiator side) and writes the fuzzer's bytes into the other end. Nothing
 * here reaches into the engine's internals except the wire layout
 * (internal.h's wire_hdr and frame types), so the harnesses keep working
 * while conn.c and engine.c change underneath.
 *
 * Every wait has a deadline: an engine that stops answering is a finding
 * (abort, so libFuzzer keeps the input), never a hung fuzzer. */
#ifndef AXF_FUZZ_COMMON_H
#define AXF_FUZZ_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* An engine serves this many inputs, then is destroyed and made anew: the
 * engine keeps a small record per connection it ever had, which over tens of
 * millions of inputs would be gigabytes. */
#define FZ_RECYCLE 256
/* AXF_FUZZ_RECYCLE=N: a fresh engine every N inputs instead (1: each input
 * gets its own engine and ends with its shutdown, which then runs against
 * whatever that one input left behind). */
static inline uint64_t fz_recycle(void)
{
    static uint64_t n;
    if (!n) {
        const char *s = getenv("AXF_FUZZ_RECYCLE");
        n = s && atoi(s) > 0 ? (uint64_t)atoi(s) : FZ_RECYCLE;
    }
    return n;
}

/* Longest the engine may take to finish with one input's connection. Far
 * above anything a healthy engine needs (microseconds), far below libFuzzer's
 * own -timeout, so a hang is reported with our message. */
#define FZ_DEADLINE_MS 10000
#define FZ_GUARD 256u

#define FZ_FAIL(...)                                      \
    do {                                                  \
        fprintf(stderr, "fuzz harness: " __VA_ARGS__);    \
        fputc('\n', stderr);                              \
        abort();                                          \
    } while (0)

static inline uint64_t fz_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Registered memory between guard bytes that nothing may ever change. */
typedef struct fz_buf {
    uint8_t *base; /* FZ_GUARD | len | FZ_GUARD */
    uint8_t *mem;
    size_t len;
} fz_buf;

static inline void fz_buf_init(fz_buf *b, size_t len)
{
    b->base = malloc(len + 2 * FZ_GUARD);
    if (!b->base)
        FZ_FAIL("out of memory");
    b->mem = b->base + FZ_GUARD;
    b->len = len;
    memset(b->base, 0xA5, FZ_GUARD);
    memset(b->mem + len, 0x5A, FZ_GUARD);
}

/* A recognisable pattern, different per position, so a misplaced write shows. */
static inline void fz_pattern(uint8_t *p, size_t len, uint8_t seed)
{
    for (size_t i = 0; i < len; i++)
        p[i] = (uint8_t)(seed + i * 131u + (i >> 8));
}

static inline bool fz_is_pattern(const uint8_t *p, size_t len, uint8_t seed, size_t *bad)
{
    for (size_t i = 0; i < len; i++)
        if (p[i] != (uint8_t)(seed + i * 131u + (i >> 8))) {
            *bad = i;
            return false;
        }
    return true;
}

static inline void fz_guards_check(const fz_buf *b, const char *what)
{
    for (size_t i = 0; i < FZ_GUARD; i++) {
        if (b->base[i] != 0xA5)
            FZ_FAIL("%s: guard byte %zu before the region was overwritten", what, FZ_GUARD - i);
        if (b->mem[b->len + i] != 0x5A)
            FZ_FAIL("%s: guard byte %zu after the region was overwritten", what, i);
    }
}

/* AXF_FUZZ_VERBOSE=1: every completion on stderr (what the engine made of
 * an input: which frames it refused and why). */
static inline bool fz_verbose(void)
{
    static int v = -1;
    if (v < 0) {
        const char *s = getenv("AXF_FUZZ_VERBOSE");
        v = s && *s == '1';
    }
    return v;
}

/* Polls the engine (sleeping on its eventfd) and hands each completion to
 * on_completion until done(ctx) holds; aborts at the deadline. */
typedef void (*fz_on_completion)(void *ctx, const axf_completion *c);

static inline void fz_wait(axf_engine *e, fz_on_completion on_completion,
                           bool (*done)(void *ctx), void *ctx, const char *what)
{
    uint64_t deadline = fz_now_ms() + FZ_DEADLINE_MS;
    axf_completion q[64];
    for (;;) {
        size_t n = axf_poll(e, q, 64);
        for (size_t i = 0; i < n; i++) {
            if (fz_verbose())
                fprintf(stderr, "  completion kind %u status %d id %llu tag %llu nbytes %llu: %.*s\n",
                        q[i].kind, q[i].status, (unsigned long long)q[i].id,
                        (unsigned long long)q[i].tag, (unsigned long long)q[i].nbytes,
                        q[i].kind == AXF_CQ_LOG ? (int)q[i].payload_len : 0,
                        q[i].payload ? (const char *)q[i].payload : "");
            if (on_completion)
                on_completion(ctx, &q[i]);
            axf_completion_free(&q[i]);
        }
        if (done(ctx))
            return;
        if (n)
            continue;
        uint64_t now = fz_now_ms();
        if (now >= deadline)
            FZ_FAIL("engine did not finish within %d ms: %s", FZ_DEADLINE_MS, what);
        struct pollfd p = {.fd = axf_engine_fd(e), .events = POLLIN};
        (void)poll(&p, 1, (int)(deadline - now < 100 ? deadline - now : 100));
    }
}

static inline bool fz_always(void *ctx)
{
    (void)ctx;
    return true;
}

/* Shuts the engine down, takes (and drops) what it still reports, destroys it. */
static inline void fz_engine_destroy(axf_engine *e)
{
    axf_engine_shutdown(e);
    fz_wait(e, NULL, fz_always, NULL, "draining at shutdown");
    axf_engine_destroy(e);
}

/* Writes data into fd (non-blocking) while reading and discarding whatever
 * the engine sends back, so neither side can block the other; then half-closes
 * and reads until the engine closes its end. Aborts at the deadline. */
static inline void fz_exchange(int fd, const uint8_t *data, size_t n, const char *what)
{
    uint8_t sink[16384];
    uint64_t deadline = fz_now_ms() + FZ_DEADLINE_MS;
    size_t off = 0;
    bool shut = false;
    for (;;) {
        if (off == n && !shut) {
            shutdown(fd, SHUT_WR);
            shut = true;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN | (off < n ? POLLOUT : 0)};
        uint64_t now = fz_now_ms();
        if (now >= deadline)
            FZ_FAIL("engine did not close the connection within %d ms: %s", FZ_DEADLINE_MS, what);
        if (poll(&p, 1, (int)(deadline - now < 100 ? deadline - now : 100)) <= 0)
            continue;
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
            /* The engine closed (or reset) its end: whatever was left
             * unsent, it refused, and that is its right. */
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
                return;
        }
        if (off < n && (p.revents & POLLOUT)) {
            ssize_t w = send(fd, data + off, n - off, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (w > 0)
                off += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EINTR)
                off = n; /* the engine hung up on us mid-stream: its right */
        }
    }
}

static inline void fz_socketpair(int sv[2])
{
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        FZ_FAIL("socketpair: %s", strerror(errno));
    (void)fcntl(sv[0], F_SETFL, O_NONBLOCK);
}

/* Small chunks, so one request is several frames (groups, FL_LAST), and a
 * short peer timeout, so a silent test side is noticed while we watch. */
static inline axf_config fz_config(void)
{
    axf_config cfg = {0};
    cfg.copy_workers = 1;
    cfg.chunk_bytes = 512;
    cfg.keepalive_ms = 60000; /* no pings mixed into what we read */
    cfg.peer_timeout_ms = 3000;
    return cfg;
}

static inline uint64_t fz_get_u64(const uint8_t **p, size_t *n)
{
    uint64_t v = 0;
    size_t k = *n < 8 ? *n : 8;
    memcpy(&v, *p, k);
    *p += k;
    *n -= k;
    return v;
}

static inline uint8_t fz_get_u8(const uint8_t **p, size_t *n)
{
    if (!*n)
        return 0;
    uint8_t v = **p;
    (*p)++;
    (*n)--;
    return v;
}

#endif

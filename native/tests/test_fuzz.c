/* Randomised hostile frames against both frame parsers, from raw sockets:
 * - the target side (an accepted connection) gets sequences of frames with
 *   valid and invalid magic, every type, flags, region ids, keys, offsets and
 *   lengths biased to the edges, payloads cut short;
 * - the initiator side (an endpoint with ops outstanding) gets random
 *   "replies", READ responses among them, which land in local memory.
 * Each registered buffer sits between guard bytes that must never change, the
 * engine must close the bad connections (never crash, never hang) and still
 * serve a well-behaved peer afterwards. A fixed seed keeps failures
 * reproducible (AXF_FUZZ_SEED overrides it); under ASan/UBSan in CI. */
#include "harness.h"

#include "internal.h"

#include <fcntl.h>
#include <sys/socket.h>

#define REG (64u << 10)
#define GUARD 4096u
#define ROUNDS 600

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

/* Values that hit the edges of a REG-sized region more often than chance. */
static uint64_t edgy(uint64_t limit)
{
    switch (rnd() % 8) {
    case 0: return 0;
    case 1: return limit;
    case 2: return limit - 1;
    case 3: return limit + 1;
    case 4: return UINT64_MAX - rnd() % 4096;
    case 5: return (uint64_t)1 << (rnd() % 64);
    default: return rnd() % (limit + 2);
    }
}

/* A buffer with guard bytes on both sides. */
typedef struct guarded {
    uint8_t *base; /* GUARD | REG | GUARD */
    uint8_t *mem;
} guarded;

static int g_alloc(guarded *g)
{
    g->base = malloc(REG + 2 * GUARD);
    CHECK(g->base);
    memset(g->base, 0xA5, GUARD);
    memset(g->base + GUARD + REG, 0x5A, GUARD);
    g->mem = g->base + GUARD;
    memset(g->mem, 0, REG);
    return 0;
}

static int g_intact(const guarded *g)
{
    CHECK(t_all(g->base, GUARD, 0xA5));
    CHECK(t_all(g->base + GUARD + REG, GUARD, 0x5A));
    return 0;
}

/* Sends n bytes, ignoring a peer that closed on us (that is its right). */
static void send_quiet(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r <= 0)
            return;
        p += r;
        n -= (size_t)r;
    }
}

/* Reads and throws away what the engine sends until it closes, or ms pass. */
static bool drain_until_closed(int fd, int ms)
{
    uint8_t buf[4096];
    uint64_t deadline = t_now_ms() + (uint64_t)ms;
    for (;;) {
        uint64_t now = t_now_ms();
        if (now >= deadline)
            return false;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)(deadline - now)) <= 0)
            continue;
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
            return true;
    }
}

/* Mostly frames the parser accepts at first sight, so it gets past the first
 * check; the rest anything at all. */
static wire_hdr random_hdr(uint64_t rid, uint64_t key, const uint16_t *types, size_t ntypes)
{
    wire_hdr h = {0};
    h.magic = rnd() % 32 ? AXF_MAGIC : (uint32_t)rnd();
    h.type = (uint16_t)(rnd() % 8 ? types[rnd() % ntypes] : rnd() % 12);
    h.flags = (uint16_t)(rnd() % 4);
    h.status = rnd() % 4 ? 0 : (int32_t)(rnd() % 20) - 15;
    h.op = rnd() % 4 ? 1 + rnd() % 4 : rnd();
    h.index = rnd() % 4 ? rnd() % 3 : rnd();
    h.rid = rnd() % 4 ? rid : rnd() % 8;
    h.key = rnd() % 4 ? key : rnd();
    h.off = edgy(REG);
    h.len = rnd() % 2 ? edgy(REG) : rnd() % 256;
    return h;
}

/* Sends the header and part (or all) of the payload its length announces. */
static void send_frame(int fd, const wire_hdr *h)
{
    static uint8_t junk[REG + 1];
    send_quiet(fd, h, sizeof *h);
    uint64_t want = h->len <= sizeof junk ? h->len : rnd() % sizeof junk;
    if (rnd() % 4 == 0)
        want = want ? rnd() % want : 0; /* cut short */
    for (uint64_t i = 0; i < want; i += 8) {
        uint64_t v = rnd();
        memcpy(junk + i, &v, want - i < 8 ? want - i : 8);
    }
    send_quiet(fd, junk, want);
}

static int wait_conns(tengine *t, uint64_t want)
{
    uint64_t deadline = t_now_ms() + T_TIMEOUT_MS;
    axf_stats s;
    for (;;) {
        t_drain(t);
        for (size_t i = 0; i < t->n; i++)
            axf_completion_free(&t->q[i]);
        t->n = 0;
        axf_engine_stats(t->e, &s);
        if (s.conns == want)
            return 0;
        CHECK(t_now_ms() < deadline);
        usleep(1000);
    }
}

static int test_fuzz_target(void)
{
    tengine *b = t_engine(NULL);
    CHECK(b);
    guarded g = {0};
    if (g_alloc(&g))
        return 1;
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(b->e, g.mem, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    int closed = 0;
    for (int round = 0; round < ROUNDS; round++) {
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        (void)fcntl(sv[0], F_SETFL, O_NONBLOCK);
        CHECK_EQ(axf_accept_conn(b->e, sv[1], 1000 + (uint64_t)round, -1), AXF_OK);
        int nframes = 1 + (int)(rnd() % 16);
        for (int i = 0; i < nframes; i++) {
            static const uint16_t types[] = {FR_WRITE, FR_WRITE, FR_READ_REQ, FR_NOTIFY,
                                             FR_REVOKE_ACK, FR_PING};
            wire_hdr h = random_hdr(rid, key, types, sizeof types / sizeof types[0]);
            send_frame(sv[0], &h);
        }
        /* Hang up our side: the engine must notice and let go. */
        shutdown(sv[0], SHUT_WR);
        closed += drain_until_closed(sv[0], T_TIMEOUT_MS);
        close(sv[0]);
        if (g_intact(&g))
            return 1;
    }
    CHECK_EQ(closed, ROUNDS);
    if (wait_conns(b, 0))
        return 1;
    axf_stats s;
    axf_engine_stats(b->e, &s);
    printf("  %d hostile connections closed, %llu frames rejected as malformed\n", closed,
           (unsigned long long)s.frames_rejected);
    CHECK(s.frames_rejected > 0);
    CHECK_EQ(s.regions, 1);

    /* Still serving: a well-formed WRITE from a real engine lands. */
    tengine *a = t_engine(NULL);
    CHECK(a);
    uint8_t *src = malloc(REG);
    CHECK(src);
    t_fill(src, REG, 3);
    uint64_t arid, akey, ep;
    CHECK_EQ(axf_region_register(a->e, src, REG, AXF_ACCESS_READ, -1, &arid, &akey), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, 1, 0, -1, &ep), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 2, -1), AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, rid, key, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                 -1),
             AXF_OK);
    axf_desc d = {.lrid = arid, .rrid = rid, .rkey = key, .len = REG};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(g.mem, src, REG) == 0);
    if (g_intact(&g))
        return 1;
    t_close(a);
    t_close(b);
    free(src);
    free(g.base);
    return 0;
}

/* A fake target answers real requests with random frames. */
static int test_fuzz_initiator(void)
{
    tengine *a = t_engine(NULL);
    CHECK(a);
    guarded g = {0};
    if (g_alloc(&g))
        return 1;
    uint64_t lrid, lkey;
    CHECK_EQ(axf_region_register(a->e, g.mem, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &lrid,
                                 &lkey),
             AXF_OK);
    uint64_t failed = 0, ok = 0;
    for (int round = 0; round < ROUNDS; round++) {
        uint64_t ep;
        CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, 5000 + (uint64_t)round, 0, -1, &ep), AXF_OK);
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        (void)fcntl(sv[1], F_SETFL, O_NONBLOCK);
        CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
        uint64_t rrid = 7, rkey = 0x1234;
        CHECK_EQ(axf_endpoint_import(a->e, ep, rrid, rkey, REG,
                                     AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
                 AXF_OK);
        /* Requests outstanding: READs (whose responses land in g.mem) and a WRITE. */
        int nops = 1 + (int)(rnd() % 3);
        uint64_t base = (uint64_t)round * 8 + 1;
        for (int i = 0; i < nops; i++) {
            uint64_t off = rnd() % (REG / 2), len = 1 + rnd() % (REG / 2);
            axf_desc d = {.lrid = lrid, .loff = off, .rrid = rrid, .rkey = rkey, .roff = off,
                          .len = len};
            int opc = rnd() % 3 ? AXF_OP_READ : AXF_OP_WRITE;
            CHECK_EQ(axf_post(a->e, ep, opc, &d, 1, NULL, 0, base + (uint64_t)i, 0), AXF_OK);
        }
        int nframes = 1 + (int)(rnd() % 6);
        for (int i = 0; i < nframes; i++) {
            static const uint16_t types[] = {FR_READ_RESP, FR_READ_RESP, FR_WRITE_ACK,
                                             FR_NOTIFY_ACK, FR_REVOKE, FR_PING};
            wire_hdr h = random_hdr(rrid, rkey, types, sizeof types / sizeof types[0]);
            h.op = rnd() % 4 ? base + rnd() % (uint64_t)nops : h.op;
            send_frame(sv[1], &h);
        }
        close(sv[1]); /* the fake target goes away: every op must complete */
        for (int i = 0; i < nops; i++) {
            axf_completion c;
            CHECK_EQ(t_wait(a, AXF_CQ_XFER, base + (uint64_t)i, &c), 0);
            if (c.status == AXF_OK)
                ok++;
            else
                failed++;
        }
        if (g_intact(&g))
            return 1;
    }
    if (wait_conns(a, 0))
        return 1;
    axf_stats s;
    axf_engine_stats(a->e, &s);
    printf("  initiator: %llu ops failed, %llu completed, %llu frames rejected\n",
           (unsigned long long)failed, (unsigned long long)ok,
           (unsigned long long)s.frames_rejected);
    CHECK_EQ(s.ops, 0);
    CHECK(failed > 0);
    t_close(a);
    free(g.base);
    return 0;
}

int main(int argc, char **argv)
{
    const char *seed = getenv("AXF_FUZZ_SEED");
    if (seed && *seed)
        rng_state = strtoull(seed, NULL, 0) * 2 + 1;
    printf("seed %#llx\n", (unsigned long long)rng_state);
    static const t_case cases[] = {
        T_CASE(test_fuzz_target),
        T_CASE(test_fuzz_initiator),
    };
    return T_RUN(argc, argv, cases);
}

/* The one-copy send (conn.c "one-copy send", tcp18): WRITE payloads to a
 * same-uid loopback peer go by vmsplice + splice. Two engines in one
 * process joined by real TCP loopback connections (the check asks the
 * kernel for the peer socket's owner: socketpairs never qualify). The
 * engine's own counters (internal.h: spliced_frames, splice_pipes,
 * splice_fallbacks) say which path ran; the bytes are compared at the
 * target. SIGPIPE is left at its default in every case here: a splice into
 * a closed socket raises it, and the engine must keep it from killing us.
 * Run with AIOXFER_TCP_SPLICE=1 (meson test splice) and with it unset, the
 * default, and 0 (splice-default, splice-off): then nothing may be spliced
 * and every case still passes. */
#include "harness.h"

#include "internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define A_TAG 77
#define B_TAG 99
#define REG (8u << 20)

static bool splice_on(void)
{
    const char *v = getenv("AIOXFER_TCP_SPLICE"); /* on unless "0" (spl28) */
    return !v || strcmp(v, "0") != 0;
}

/* A connected TCP loopback pair: *a the connecting end, *b the accepted. */
typedef struct pair {
    tengine *a, *b;
    uint64_t ep;
    uint8_t *asrc, *bdst;
    uint64_t arid, akey, brid, bkey;
} pair;

static int pair_open(pair *p, const axf_config *cfg, int nconns)
{
    memset(p, 0, sizeof *p);
    p->a = t_engine(cfg);
    p->b = t_engine(cfg);
    CHECK(p->a && p->b);
    CHECK_EQ(axf_endpoint_create(p->a->e, AXF_EP_TCP, A_TAG, 0, -1, &p->ep), AXF_OK);
    for (int i = 0; i < nconns; i++) {
        int x, y;
        if (t_tcp_pair(&x, &y))
            return 1;
        CHECK_EQ(axf_endpoint_add_conn(p->a->e, p->ep, x), AXF_OK);
        CHECK_EQ(axf_accept_conn(p->b->e, y, B_TAG, -1), AXF_OK);
    }
    if (splice_on() && t_wait_count(&p->a->e->splice_verdicts, (uint64_t)nconns))
        return 1; /* (a frame sent while it is asked goes by copy) */
    p->asrc = calloc(1, REG);
    p->bdst = calloc(1, REG);
    CHECK(p->asrc && p->bdst);
    CHECK_EQ(axf_region_register(p->a->e, p->asrc, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &p->arid, &p->akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(p->b->e, p->bdst, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &p->brid, &p->bkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(p->a->e, p->ep, p->brid, p->bkey, REG,
                                 AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    return 0;
}

static void pair_close(pair *p)
{
    t_close(p->a);
    t_close(p->b);
    free(p->asrc);
    free(p->bdst);
}

/* Pipes this process holds open (/proc/self/fd links "pipe:[...]"). */
static int count_pipes(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    char path[300], link[64];
    while ((de = readdir(d))) {
        snprintf(path, sizeof path, "/proc/self/fd/%s", de->d_name);
        ssize_t l = readlink(path, link, sizeof link - 1);
        if (l > 0) {
            link[l] = 0;
            n += strncmp(link, "pipe:", 5) == 0;
        }
    }
    closedir(d);
    return n;
}

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Random sizes across the window's edges (64 KiB and 512 KiB, either side),
 * unaligned and sub-page offsets, page-spanning, many in flight (sent by
 * the posting thread inline and by the sending threads), one and several
 * descriptors; the target's bytes compared with the source. */
static int test_integrity(void)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    pair p;
    if (pair_open(&p, &cfg, 2))
        return 1;
    static const uint64_t sizes[] = {(64 << 10) - 1, 64 << 10, (64 << 10) + 1, 100000,
                                     (512 << 10) - 1, 512 << 10, (512 << 10) + 1, 1 << 20,
                                     3 << 20, 4096, 200 << 10};
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int round = 0; round < 6; round++) {
        t_fill(p.asrc, REG, (uint32_t)round + 1);
        memset(p.bdst, 0, REG);
        /* Disjoint destination slots (REG / 8 each), so every byte has one writer. */
        enum { NREQ = 8 };
        axf_desc d[NREQ][2];
        size_t nd[NREQ];
        for (int k = 0; k < NREQ; k++) {
            uint64_t len = sizes[rnd(&seed) % (sizeof sizes / sizeof sizes[0])];
            uint64_t slot = (uint64_t)k * (REG / NREQ), room = REG / NREQ;
            if (len > room - 8192)
                len = room - 8192;
            uint64_t loff = rnd(&seed) % (REG - len), roff = slot + rnd(&seed) % 4099;
            nd[k] = 1;
            d[k][0] = (axf_desc){.lrid = p.arid, .loff = loff, .rrid = p.brid, .rkey = p.bkey,
                                 .roff = roff, .len = len};
            if (k % 3 == 2 && len > 8192) { /* two descriptors: a batch's vectored frame */
                uint64_t half = len / 2 + 7;
                d[k][0].len = half;
                d[k][1] = (axf_desc){.lrid = p.arid, .loff = (loff + half + 333) % (REG - len),
                                     .rrid = p.brid, .rkey = p.bkey, .roff = roff + half,
                                     .len = len - half};
                nd[k] = 2;
            }
            CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d[k], nd[k], NULL, 0,
                              (uint64_t)(100 + k), 0),
                     AXF_OK);
        }
        for (int k = 0; k < NREQ; k++) {
            axf_completion c;
            CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, (uint64_t)(100 + k), &c), 0);
            CHECK_EQ(c.status, AXF_OK);
        }
        for (int k = 0; k < NREQ; k++)
            for (size_t j = 0; j < nd[k]; j++)
                CHECK(memcmp(p.bdst + d[k][j].roff, p.asrc + d[k][j].loff, d[k][j].len) == 0);
    }
    uint64_t frames = atomic_load(&p.a->e->spliced_frames);
    printf("  spliced frames %" PRIu64 ", bytes %" PRIu64 ", fallbacks %" PRIu64 "\n", frames,
           (uint64_t)atomic_load(&p.a->e->spliced_bytes),
           (uint64_t)atomic_load(&p.a->e->splice_fallbacks));
    if (splice_on())
        CHECK(frames > 0);
    else
        CHECK_EQ(frames, 0);
    CHECK_EQ(atomic_load(&p.b->e->spliced_frames), 0); /* the target's replies: never */
    pair_close(&p);
    return 0;
}

/* The source rewritten the moment each WRITE completes: the target must
 * hold the bytes as of the post (the acknowledgement came after the target
 * read the spliced pages, not when they were queued). */
static int test_rewrite_after_complete(void)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    pair p;
    if (pair_open(&p, &cfg, 2))
        return 1;
    const uint64_t len = 512 << 10; /* the window's top */
    for (int i = 0; i < 40; i++) {
        uint8_t v = (uint8_t)(i * 7 + 1);
        memset(p.asrc, v, len);
        uint64_t roff = (uint64_t)(i % 12) * len;
        axf_desc d = {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = roff,
                      .len = len};
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, (uint64_t)(500 + i), 0),
                 AXF_OK);
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, (uint64_t)(500 + i), &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        memset(p.asrc, 0xEE, len); /* what a peer reading late would see */
        CHECK(t_all(p.bdst + roff, len, v));
    }
    if (splice_on())
        CHECK(atomic_load(&p.a->e->spliced_frames) > 0);
    pair_close(&p);
    return 0;
}

/* One pipe per connection at most, made only when used, all closed with
 * the engine (counted in /proc/self/fd). */
static int test_pipes_per_conn(void)
{
    signal(SIGPIPE, SIG_DFL);
    int before = count_pipes();
    axf_config cfg = {0};
    pair p;
    enum { NC = 8 };
    if (pair_open(&p, &cfg, NC))
        return 1;
    CHECK_EQ(count_pipes(), before); /* none before a frame is spliced */
    t_fill(p.asrc, REG, 5);
    /* Each WRITE to its own 256 KiB (REG / 32): concurrent WRITEs to the
     * same bytes race in the target's memory (ThreadSanitizer, nat29). */
    for (int i = 0; i < 32; i++) {
        uint64_t off = (uint64_t)i << 18;
        axf_desc d = {.lrid = p.arid, .loff = off, .rrid = p.brid, .rkey = p.bkey,
                      .roff = off, .len = 256 << 10};
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, (uint64_t)(700 + i), 0),
                 AXF_OK);
    }
    for (int i = 0; i < 32; i++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, (uint64_t)(700 + i), &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    int pipes = atomic_load(&p.a->e->splice_pipes);
    printf("  %d pipes for %d connections\n", pipes, NC);
    CHECK(pipes <= NC);
    CHECK_EQ(count_pipes() - before, 2 * pipes);
    if (splice_on())
        CHECK(pipes > 0);
    else
        CHECK_EQ(pipes, 0);
    CHECK(memcmp(p.bdst, p.asrc, 32u << 18) == 0);
    pair_close(&p);
    CHECK_EQ(count_pipes(), before);
    return 0;
}

/* No fd for a pipe (RLIMIT_NOFILE at what is open): the WRITEs go by
 * copy, whole and correct, and nothing is spliced. */
static int test_no_pipe_copies(void)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    pair p;
    if (pair_open(&p, &cfg, 2))
        return 1;
    struct rlimit old, tight;
    CHECK_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
    int maxfd = 0, holes[4096], nh = 0;
    for (int fd = 0; fd < 4096; fd++)
        if (fcntl(fd, F_GETFD) >= 0)
            maxfd = fd;
    for (int fd = 0; fd < maxfd; fd++) /* fds are taken lowest first: fill the holes */
        if (fcntl(fd, F_GETFD) < 0 && dup2(0, fd) == fd)
            holes[nh++] = fd;
    tight = old;
    tight.rlim_cur = (rlim_t)maxfd + 1; /* no new fd: pipe2 fails with EMFILE */
    CHECK_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
    t_fill(p.asrc, REG, 9);
    for (int i = 0; i < 8; i++) {
        axf_desc d = {.lrid = p.arid, .loff = (uint64_t)i * 4097, .rrid = p.brid, .rkey = p.bkey,
                      .roff = (uint64_t)i * (1 << 20), .len = 512 << 10};
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, (uint64_t)(900 + i), 0),
                 AXF_OK);
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, (uint64_t)(900 + i), &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK(memcmp(p.bdst + (uint64_t)i * (1 << 20), p.asrc + (uint64_t)i * 4097, 512 << 10) == 0);
    }
    CHECK_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
    for (int k = 0; k < nh; k++)
        close(holes[k]);
    CHECK_EQ(atomic_load(&p.a->e->spliced_frames), 0);
    CHECK_EQ(atomic_load(&p.a->e->splice_pipes), 0);
    pair_close(&p);
    return 0;
}

/* A raw peer that reads a little, then closes while large WRITEs are being
 * spliced to it: the ops fail (a lost peer), promptly, and SIGPIPE (left at
 * its default here) does not kill the process. */
static int test_peer_closes_midstream(void)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    int x, y;
    if (t_tcp_pair(&x, &y))
        return 1;
    int small = 64 << 10; /* the peer's receive queue fills soon */
    (void)setsockopt(y, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, x), AXF_OK);
    if (splice_on() && t_wait_count(&a->e->splice_verdicts, 1))
        return 1;
    uint8_t *src = calloc(1, REG);
    CHECK(src);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(a->e, src, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, 1, 2, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    for (int i = 0; i < 8; i++) {
        axf_desc d = {.lrid = rid, .loff = 0, .rrid = 1, .rkey = 2,
                      .roff = (uint64_t)i * (1 << 20), .len = 512 << 10};
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, (uint64_t)(1100 + i), 0),
                 AXF_OK);
    }
    static uint8_t buf[256 << 10];
    size_t got = 0;
    while (got < (256u << 10)) {
        ssize_t r = recv(y, buf, sizeof buf, 0);
        CHECK(r > 0);
        got += (size_t)r;
    }
    uint64_t t0 = t_now_ms();
    close(y); /* unread data: an RST */
    for (int i = 0; i < 8; i++) {
        axf_completion c;
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, (uint64_t)(1100 + i), &c), 0);
        CHECK(c.status != AXF_OK);
    }
    CHECK(t_now_ms() - t0 < 3000);
    if (splice_on())
        CHECK(atomic_load(&a->e->spliced_frames) > 0);
    t_close(a);
    free(src);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_integrity),
        T_CASE(test_rewrite_after_complete),
        T_CASE(test_pipes_per_conn),
        T_CASE(test_no_pipe_copies),
        T_CASE(test_peer_closes_midstream),
    };
    return T_RUN(argc, argv, cases);
}

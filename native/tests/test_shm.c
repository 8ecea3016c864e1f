/* The same-host transport, inside one process: cross-memory attach into this
 * process's own memory (the "peer" pid is ours), sealed memfd regions mapped
 * from the fd itself, inline small copies whose completion is known at
 * submit, large copies split over workers, and a WRITE-bound notification
 * over a socketpair connection. */
#include "harness.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>

#define REG (8u << 20)

typedef struct shm_pair {
    tengine *a, *b;
    uint64_t ep;
    uint8_t *asrc, *bdst;
    uint64_t arid, akey, brid, bkey;
} shm_pair;

static int sp_open(shm_pair *p, const axf_config *cfg, bool with_conn)
{
    memset(p, 0, sizeof *p);
    p->a = t_engine(cfg);
    p->b = t_engine(cfg);
    CHECK(p->a && p->b);
    CHECK_EQ(axf_endpoint_create(p->a->e, AXF_EP_SHM, 21, getpid(), -1, &p->ep), AXF_OK);
    if (with_conn) {
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ(axf_endpoint_add_conn(p->a->e, p->ep, sv[0]), AXF_OK);
        CHECK_EQ(axf_accept_conn(p->b->e, sv[1], 22, -1), AXF_OK);
    }
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
                                 AXF_ACCESS_READ | AXF_ACCESS_WRITE, (uint64_t)(uintptr_t)p->bdst,
                                 -1),
             AXF_OK);
    return 0;
}

static void sp_close(shm_pair *p)
{
    t_close(p->a);
    t_close(p->b);
    free(p->asrc);
    free(p->bdst);
}

static int test_inline_write_known_at_submit(void)
{
    shm_pair p;
    if (sp_open(&p, NULL, false))
        return 1;
    t_fill(p.asrc, REG, 1);
    axf_desc d[3] = {
        {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = 100, .len = 1000},
        {.lrid = p.arid, .loff = 5000, .rrid = p.brid, .rkey = p.bkey, .roff = 9000, .len = 3},
        {.lrid = p.arid, .loff = 7000, .rrid = p.brid, .rkey = p.bkey, .roff = 20000, .len = 4096},
    };
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, 3, NULL, 0, 1, 0), AXF_OK);
    /* Small same-host copy: the completion is in the ring when post returns. */
    t_drain(p.a);
    axf_completion c;
    CHECK_EQ(t_wait_ex(p.a, AXF_CQ_XFER, false, 1, &c, 0), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, 1000 + 3 + 4096);
    for (int i = 0; i < 3; i++)
        CHECK(memcmp(p.bdst + d[i].roff, p.asrc + d[i].loff, d[i].len) == 0);
    CHECK(t_all(p.bdst, 100, 0));
    CHECK(t_all(p.bdst + 1100, 9000 - 1100, 0));
    sp_close(&p);
    return 0;
}

static int test_large_write_and_read(void)
{
    axf_config cfg = {.copy_workers = 2};
    shm_pair p;
    if (sp_open(&p, &cfg, false))
        return 1;
    t_fill(p.asrc, REG, 2);
    /* One big descriptor (split over workers) plus many small ones. */
    enum { NSMALL = 3000 };
    axf_desc *d = calloc(NSMALL + 1, sizeof *d);
    CHECK(d);
    d[0] = (axf_desc){.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = 0,
                      .len = 4u << 20};
    uint64_t total = d[0].len;
    for (size_t i = 1; i <= NSMALL; i++) {
        d[i] = (axf_desc){.lrid = p.arid, .loff = (4u << 20) + i * 1024, .rrid = p.brid,
                          .rkey = p.bkey, .roff = (4u << 20) + (NSMALL + 1 - i) * 1024,
                          .len = 1000};
        total += 1000;
    }
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, NSMALL + 1, NULL, 0, 2, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, total);
    for (size_t i = 0; i <= NSMALL; i++)
        CHECK(memcmp(p.bdst + d[i].roff, p.asrc + d[i].loff, d[i].len) == 0);

    /* And back: READ into a cleared local buffer. */
    memset(p.asrc, 0, REG);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_READ, d, NSMALL + 1, NULL, 0, 3, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 3, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, total);
    for (size_t i = 0; i <= NSMALL; i++)
        CHECK(memcmp(p.bdst + d[i].roff, p.asrc + d[i].loff, d[i].len) == 0);
    free(d);

    /* Deferred until the doorbell. */
    t_fill(p.asrc, REG, 3);
    axf_desc big = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &big, 1, NULL, 0, 4, AXF_POST_DEFER), AXF_OK);
    axf_doorbell(p.a->e);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 4, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst, p.asrc, REG) == 0);
    sp_close(&p);
    return 0;
}

static int test_memfd_region(void)
{
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    enum { LEN = 1 << 20 };
    int mfd = memfd_create("axf-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(mfd >= 0);
    CHECK_EQ(ftruncate(mfd, LEN), 0);
    uint8_t *pool = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    CHECK(pool != MAP_FAILED);
    uint64_t brid, bkey, arid, akey, ep;
    CHECK_EQ(axf_region_register(b->e, pool, LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE, mfd, &brid,
                                 &bkey),
             AXF_OK);
    uint8_t *src = malloc(LEN);
    CHECK(src);
    t_fill(src, LEN, 4);
    CHECK_EQ(axf_region_register(a->e, src, LEN, AXF_ACCESS_READ, -1, &arid, &akey), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_SHM, 1, getpid(), -1, &ep), AXF_OK);
    /* Unsealed: its owner could shrink it under our copies (SIGBUS): refused. */
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                 mfd),
             AXF_E_ACCESS);
    CHECK_EQ(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    /* Without F_SEAL_SEAL the seals could still change: refused. */
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                 mfd),
             AXF_E_ACCESS);
    CHECK_EQ(fcntl(mfd, F_ADD_SEALS, F_SEAL_SEAL), 0);
    /* Claimed larger than the file: refused (no mapping past its end). */
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, 2 * LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE,
                                 0, mfd),
             AXF_E_ACCESS);
    /* Not a memfd: a pipe has no seals. */
    int pp[2];
    CHECK_EQ(pipe(pp), 0);
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, 16, AXF_ACCESS_READ, 0, pp[0]),
             AXF_E_ACCESS);
    close(pp[0]);
    close(pp[1]);
    /* The fd as received over SCM_RIGHTS (here: our own); mapped from it
     * directly, addr unused. The caller keeps it. */
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                 mfd),
             AXF_OK);
    CHECK(fcntl(mfd, F_GETFD) >= 0); /* still open: not the engine's */
    axf_desc d = {.lrid = arid, .loff = 0, .rrid = brid, .rkey = bkey, .roff = 0, .len = LEN};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 9, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 9, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(pool, src, LEN) == 0);
    /* READ into a read-only local region: refused at post. */
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_READ, &d, 1, NULL, 0, 10, 0), AXF_E_ACCESS);
    /* An fd that is not there: the import fails (never a /proc lookup). */
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid + 100, 1, LEN, AXF_ACCESS_READ, 0, 987654),
             AXF_E_ACCESS);
    t_close(a);
    t_close(b);
    munmap(pool, LEN);
    close(mfd);
    free(src);
    return 0;
}

static int test_access_checks(void)
{
    shm_pair p;
    if (sp_open(&p, NULL, false))
        return 1;
    static uint8_t ro[4096];
    memset(ro, 0, sizeof ro);
    uint64_t rorid, rokey;
    CHECK_EQ(axf_region_register(p.b->e, ro, sizeof ro, AXF_ACCESS_READ, -1, &rorid, &rokey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(p.a->e, p.ep, rorid, rokey, sizeof ro, AXF_ACCESS_READ,
                                 (uint64_t)(uintptr_t)ro, -1),
             AXF_OK);
    t_fill(p.asrc, REG, 5);
    axf_desc wrong_key = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey ^ 1, .len = 64};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &wrong_key, 1, NULL, 0, 11, 0), AXF_E_ACCESS);
    axf_desc oob = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .roff = REG - 1, .len = 2};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &oob, 1, NULL, 0, 12, 0), AXF_E_ACCESS);
    axf_desc ro_write = {.lrid = p.arid, .rrid = rorid, .rkey = rokey, .len = 64};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &ro_write, 1, NULL, 0, 13, 0), AXF_E_ACCESS);
    CHECK(t_all(p.bdst, REG, 0));
    CHECK(t_all(ro, sizeof ro, 0));
    /* Forgotten remote region: refused. */
    CHECK_EQ(axf_endpoint_forget(p.a->e, p.ep, p.brid), AXF_OK);
    CHECK_EQ(axf_endpoint_forget(p.a->e, p.ep, p.brid), AXF_E_NOTFOUND);
    axf_desc gone = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = 64};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &gone, 1, NULL, 0, 14, 0), AXF_E_ACCESS);
    /* Notifications need a connection. */
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_NOTIFY, NULL, 0, "x", 1, 15, 0), AXF_E_TRANSPORT);
    axf_stats s;
    axf_engine_stats(p.a->e, &s);
    CHECK_EQ(s.ops, 0);
    sp_close(&p);
    return 0;
}

static int test_write_with_notify(void)
{
    axf_config cfg = {.inline_bytes = UINT64_MAX}; /* every copy on a worker */
    shm_pair p;
    if (sp_open(&p, &cfg, true))
        return 1;
    t_fill(p.asrc, REG, 6);
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, "req-17", 6, 21, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait_any(p.b, AXF_CQ_NOTIFY, &c), 0);
    CHECK(memcmp(p.bdst, p.asrc, REG) == 0); /* all data in place before the notification */
    CHECK_EQ(c.payload_len, 6);
    CHECK(memcmp(c.payload, "req-17", 6) == 0);
    CHECK_EQ(c.tag, 22);
    axf_completion_free(&c);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 21, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, REG);
    sp_close(&p);
    return 0;
}

/* inline_bytes = UINT64_MAX: never inline, so even a tiny deferred copy waits
 * for the doorbell and is done by a worker. (A worker that happens to be awake
 * may take a deferred job early; we let them park first.) */
static int test_defer_holds_until_doorbell(void)
{
    axf_config cfg = {.inline_bytes = UINT64_MAX};
    shm_pair p;
    if (sp_open(&p, &cfg, false))
        return 1;
    t_fill(p.asrc, 64, 7);
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = 64};
    usleep(50 * 1000);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 31, AXF_POST_DEFER), AXF_OK);
    CHECK(t_quiet(p.a, AXF_CQ_XFER, 31, 100));
    CHECK(t_all(p.bdst, 64, 0));
    axf_doorbell(p.a->e);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 31, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst, p.asrc, 64) == 0);
    sp_close(&p);
    return 0;
}

static int test_shutdown_with_queued_copies(void)
{
    axf_config cfg = {.copy_workers = 1, .inline_bytes = UINT64_MAX};
    shm_pair p;
    if (sp_open(&p, &cfg, false))
        return 1;
    enum { N = 64 };
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 100 + i, 0), AXF_OK);
    axf_engine_shutdown(p.a->e);
    /* Every op completes exactly once: done before shutdown, or closed. */
    int ok = 0, closed = 0;
    for (uint64_t i = 0; i < N; i++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 100 + i, &c), 0);
        CHECK(c.status == AXF_OK || c.status == AXF_E_CLOSED);
        ok += c.status == AXF_OK;
        closed += c.status == AXF_E_CLOSED;
    }
    CHECK_EQ(ok + closed, N);
    CHECK(t_quiet(p.a, AXF_CQ_XFER, 100, 20));
    axf_stats s;
    axf_engine_stats(p.a->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(s.regions, 0);
    printf("  shutdown: %d done, %d closed\n", ok, closed);
    sp_close(&p);
    return 0;
}

/* The owner deregisters its region while our copies into it are in flight:
 * it is told over the connection, and frees the region only once we
 * acknowledge, which we do only after our copies are done. From then on our
 * handle is refused at post: nothing lands in memory that is no longer
 * registered. */
static int test_revocation_waits_for_copies(void)
{
    axf_config cfg = {.copy_workers = 1, .inline_bytes = UINT64_MAX};
    shm_pair p;
    if (sp_open(&p, &cfg, true))
        return 1;
    t_fill(p.asrc, REG, 9);
    enum { N = 8 };
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 40 + i, 0), AXF_OK);
    CHECK_EQ(axf_region_deregister(p.b->e, p.brid), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.b, AXF_CQ_REGION_FREED, p.brid, &c), 0);
    /* Every copy posted before the revocation finished, or stopped at a
     * chunk boundary, before the region was freed: memory cleared now stays
     * clear. */
    memset(p.bdst, 0, REG);
    for (uint64_t i = 0; i < N; i++) {
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 40 + i, &c), 0);
        CHECK(c.status == AXF_OK || c.status == AXF_E_ACCESS);
    }
    CHECK(t_all(p.bdst, REG, 0));
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 50, 0), AXF_E_ACCESS);
    CHECK(t_all(p.bdst, REG, 0));
    /* The connection is fine. */
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_NOTIFY, NULL, 0, "x", 1, 51, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 51, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    sp_close(&p);
    return 0;
}

/* A peer whose connection dies does not hold the owner's region forever. */
static int test_revocation_settled_by_lost_conn(void)
{
    shm_pair p;
    if (sp_open(&p, NULL, true))
        return 1;
    CHECK_EQ(axf_endpoint_close(p.a->e, p.ep), AXF_OK);
    CHECK_EQ(axf_region_deregister(p.b->e, p.brid), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.b, AXF_CQ_REGION_FREED, p.brid, &c), 0);
    sp_close(&p);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_inline_write_known_at_submit),
        T_CASE(test_large_write_and_read),
        T_CASE(test_memfd_region),
        T_CASE(test_access_checks),
        T_CASE(test_write_with_notify),
        T_CASE(test_defer_holds_until_doorbell),
        T_CASE(test_shutdown_with_queued_copies),
        T_CASE(test_revocation_waits_for_copies),
        T_CASE(test_revocation_settled_by_lost_conn),
    };
    return T_RUN(argc, argv, cases);
}

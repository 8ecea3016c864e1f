/* The completion ring's promises (cq21: cq_reserve / cq_unreserve) balance
 * over real traffic: every promise made (a post accepted, an endpoint, a
 * region, an accepted connection) is kept by exactly one record or handed
 * back, and an unpromised record (a notification, a log) claims exactly one
 * slot. A promise leaked or released twice shows as the count of promises
 * outstanding (the ring's capacity less its records less its free slots)
 * differing from what is alive: the ring then grows for nothing (a leak), or
 * a promised record finds no room and is dropped (a Transfer never done).
 * Two engines over a socketpair (the tcp transport's framing), as test_tcp. */
#include "harness.h"

#include "internal.h"

#include <pthread.h>

#define A_TAG 77
#define B_TAG 99
#define REG (1u << 20)

/* Promises outstanding: slots neither holding a record nor free. */
static long long promised_raw(axf_engine *e)
{
    pthread_mutex_lock(&e->cq_mu);
    long long v = (long long)e->cq_cap - (long long)e->cq_count -
                  atomic_load_explicit(&e->cq_free, memory_order_relaxed);
    pthread_mutex_unlock(&e->cq_mu);
    return v;
}

/* Less what a new engine holds already (an engine may hold a slot of its
 * own from the start, as nat22's drop note does): what its objects promised. */
static axf_engine *base_e[4];
static long long base_n[4];

static void promised_base(axf_engine *e)
{
    for (int i = 0; i < 4; i++)
        if (!base_e[i] || base_e[i] == e) {
            base_e[i] = e;
            base_n[i] = promised_raw(e);
            return;
        }
}

static long long promised(axf_engine *e)
{
    for (int i = 0; i < 4; i++)
        if (base_e[i] == e)
            return promised_raw(e) - base_n[i];
    return promised_raw(e);
}

/* Consumes every record there is now (their payloads freed). */
static void drain_all(tengine *t)
{
    t_drain(t);
    for (size_t i = 0; i < t->n; i++)
        axf_completion_free(&t->q[i]);
    t->n = 0;
}

static int connect_pair(tengine *a, tengine *b, uint64_t tag, uint64_t *ep, int nconns)
{
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, tag, 0, -1, ep), AXF_OK);
    for (int i = 0; i < nconns; i++) {
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ(axf_endpoint_add_conn(a->e, *ep, sv[0]), AXF_OK);
        CHECK_EQ(axf_accept_conn(b->e, sv[1], B_TAG, -1), AXF_OK);
    }
    return 0;
}

static int test_promises_balance(void)
{
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    promised_base(a->e);
    promised_base(b->e);
    uint8_t *asrc = calloc(1, REG), *bdst = calloc(1, REG);
    CHECK(asrc && bdst);
    /* READs into asrc and WRITEs into bdst in flight at once over the same
     * bytes (cancelled, on endpoints that close): what lands is not checked. */
    t_racy(asrc, REG, "overlapping READs in flight");
    t_racy(bdst, REG, "overlapping WRITEs in flight");
    t_fill(asrc, REG, 22);
    uint64_t arid, akey, brid, bkey, ep;
    CHECK_EQ(axf_region_register(a->e, asrc, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &arid,
                                 &akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(b->e, bdst, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &brid,
                                 &bkey),
             AXF_OK);
    CHECK_EQ(connect_pair(a, b, A_TAG, &ep, 2), 0);
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                 -1),
             AXF_OK);
    /* A: its region and its endpoint; B: its region and, per accepted
     * connection, the record of its end (nat24: AXF_CQ_CONN_CLOSED). */
    CHECK_EQ(promised(a->e), 2);
    CHECK_EQ(promised(b->e), 3);

    /* Transfers that complete: WRITEs, READs, with and without a
     * notification, and the posting thread's quiet path (INLINE|POLL). */
    axf_completion c;
    for (uint64_t i = 0; i < 300; i++) {
        uint64_t len = 1 + (i * 977) % 70000;
        axf_desc d = {.lrid = arid, .loff = i * 13, .rrid = brid, .rkey = bkey,
                      .roff = i * 29, .len = len};
        int op = i % 2 ? AXF_OP_READ : AXF_OP_WRITE;
        uint32_t flags = i % 3 == 0 ? AXF_POST_INLINE | AXF_POST_POLL : 0;
        bool notify = op == AXF_OP_WRITE && i % 5 == 0;
        int st = axf_post(a->e, ep, op, &d, 1, notify ? "n" : NULL, notify ? 1 : 0, 100 + i,
                          flags);
        CHECK(st == AXF_OK || st == AXF_POST_DONE);
        if (st == AXF_OK) {
            CHECK_EQ(t_wait(a, AXF_CQ_XFER, 100 + i, &c), 0);
            CHECK_EQ(c.status, AXF_OK);
        }
    }
    drain_all(a);
    drain_all(b); /* B's notifications: claimed one slot each, polled */
    CHECK_EQ(promised(a->e), 2);
    CHECK_EQ(promised(b->e), 3);

    /* Same host (shm, this process), a lone request polled at once: done
     * inside its post (AXF_POST_DONE, no record: its promise handed back),
     * or left to the workers (its record keeps it); with a notification
     * (the record after B's notification). */
    uint64_t sep;
    int sv[2];
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_SHM, A_TAG + 5, getpid(), -1, &sep), AXF_OK);
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(a->e, sep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], B_TAG + 5, -1), AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, sep, brid, bkey, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE,
                                 (uint64_t)(uintptr_t)bdst, -1),
             AXF_OK);
    CHECK_EQ(promised(a->e), 3);
    size_t done_inline = 0;
    for (uint64_t i = 0; i < 300; i++) {
        const uint32_t in = AXF_POST_INLINE | AXF_POST_POLL | AXF_POST_ALONE;
        uint64_t len = i % 7 == 0 ? REG : 1 + (i * 131) % 8192;
        axf_desc d = {.lrid = arid, .rrid = brid, .rkey = bkey, .len = len};
        bool notify = i % 11 == 0 && i % 2 == 0;
        int st = axf_post(a->e, sep, i % 2 ? AXF_OP_READ : AXF_OP_WRITE, &d, 1,
                          notify ? "s" : NULL, notify ? 1 : 0, 7000 + i, i % 4 ? in : 0);
        CHECK(st == AXF_OK || st == AXF_POST_DONE);
        done_inline += st == AXF_POST_DONE;
        if (st == AXF_OK) {
            CHECK_EQ(t_wait(a, AXF_CQ_XFER, 7000 + i, &c), 0);
            CHECK_EQ(c.status, AXF_OK);
        }
    }
    CHECK(done_inline > 0); /* the quiet path ran */
    drain_all(a);
    drain_all(b);
    CHECK_EQ(promised(a->e), 3);
    CHECK_EQ(axf_endpoint_close(a->e, sep), AXF_OK);
    CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, sep, &c), 0);
    drain_all(a);
    CHECK_EQ(promised(a->e), 2);

    /* Posts refused before they are registered: no promise kept. */
    for (uint64_t i = 0; i < 50; i++) {
        axf_desc bad = {.lrid = arid, .rrid = brid, .rkey = bkey ^ 1, .len = 64};
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &bad, 1, NULL, 0, 1000 + i, 0), AXF_E_ACCESS);
        axf_desc past = {.lrid = arid, .rrid = brid, .rkey = bkey, .roff = REG, .len = 64};
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_READ, &past, 1, NULL, 0, 2000 + i, 0), AXF_E_ACCESS);
    }
    CHECK_EQ(promised(a->e), 2);

    /* Posted and cancelled: one record each, the promise kept by it. */
    for (uint64_t i = 0; i < 50; i++) {
        axf_desc d = {.lrid = arid, .rrid = brid, .rkey = bkey, .len = REG};
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_READ, &d, 1, NULL, 0, 3000 + i, 0), AXF_OK);
        (void)axf_cancel(a->e, 3000 + i);
    }
    for (uint64_t i = 0; i < 50; i++)
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, 3000 + i, &c), 0);
    drain_all(a);
    CHECK_EQ(promised(a->e), 2);

    /* Regions made and released on both sides. */
    for (int i = 0; i < 40; i++) {
        uint64_t rid, key;
        CHECK_EQ(axf_region_register(a->e, asrc, 4096, AXF_ACCESS_READ, -1, &rid, &key), AXF_OK);
        CHECK_EQ(axf_region_deregister(a->e, rid), AXF_OK);
        CHECK_EQ(t_wait(a, AXF_CQ_REGION_FREED, rid, &c), 0);
    }
    drain_all(a);
    CHECK_EQ(promised(a->e), 2);

    /* A second endpoint, closed by us with transfers in flight; a third,
     * whose peer engine goes away (PEER_LOST from the connections' end). */
    uint64_t ep2, ep3;
    CHECK_EQ(connect_pair(a, b, A_TAG + 1, &ep2, 2), 0);
    CHECK_EQ(axf_endpoint_import(a->e, ep2, brid, bkey, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE,
                                 0, -1),
             AXF_OK);
    for (uint64_t i = 0; i < 20; i++) {
        axf_desc d = {.lrid = arid, .rrid = brid, .rkey = bkey, .len = REG / 2};
        CHECK_EQ(axf_post(a->e, ep2, i % 2 ? AXF_OP_READ : AXF_OP_WRITE, &d, 1, NULL, 0,
                          4000 + i, 0),
                 AXF_OK);
    }
    CHECK_EQ(axf_endpoint_close(a->e, ep2), AXF_OK);
    CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep2, &c), 0);
    for (uint64_t i = 0; i < 20; i++)
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, 4000 + i, &c), 0);
    drain_all(a);
    CHECK_EQ(promised(a->e), 2);

    tengine *b2 = t_engine(NULL);
    CHECK(b2);
    uint8_t *b2dst = calloc(1, REG);
    CHECK(b2dst);
    t_racy(b2dst, REG, "overlapping WRITEs in flight");
    uint64_t b2rid, b2key;
    CHECK_EQ(axf_region_register(b2->e, b2dst, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &b2rid, &b2key),
             AXF_OK);
    CHECK_EQ(connect_pair(a, b2, A_TAG + 2, &ep3, 3), 0);
    CHECK_EQ(axf_endpoint_import(a->e, ep3, b2rid, b2key, REG,
                                 AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    CHECK_EQ(promised(a->e), 3);
    for (uint64_t i = 0; i < 20; i++) {
        axf_desc d = {.lrid = arid, .rrid = b2rid, .rkey = b2key, .len = REG / 4};
        CHECK_EQ(axf_post(a->e, ep3, i % 2 ? AXF_OP_READ : AXF_OP_WRITE, &d, 1, NULL, 0,
                          5000 + i, 0),
                 AXF_OK);
    }
    t_close(b2); /* the peer goes: its connections end under our transfers */
    free(b2dst);
    CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep3, &c), 0);
    for (uint64_t i = 0; i < 20; i++)
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, 5000 + i, &c), 0);
    /* A post on the lost endpoint is refused: nothing promised. */
    axf_desc d = {.lrid = arid, .rrid = b2rid, .rkey = b2key, .len = 64};
    CHECK(axf_post(a->e, ep3, AXF_OP_WRITE, &d, 1, NULL, 0, 6000, 0) != AXF_OK);
    drain_all(a);
    CHECK_EQ(promised(a->e), 2);

    /* Our region released, then the first endpoint closed: nothing left. */
    CHECK_EQ(axf_region_deregister(a->e, arid), AXF_OK);
    CHECK_EQ(t_wait(a, AXF_CQ_REGION_FREED, arid, &c), 0);
    CHECK_EQ(axf_endpoint_close(a->e, ep), AXF_OK);
    CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep, &c), 0);
    drain_all(a);
    CHECK_EQ(promised(a->e), 0);
    /* B: its connections from A closed (each CONN_CLOSED record kept its
     * accept's promise, once its threads left); its region released. */
    axf_stats bs;
    for (uint64_t until = t_now_ms() + T_TIMEOUT_MS; t_now_ms() < until; usleep(1000)) {
        axf_engine_stats(b->e, &bs);
        if (bs.conns == 0)
            break;
    }
    CHECK_EQ(bs.conns, 0);
    CHECK_EQ(axf_region_deregister(b->e, brid), AXF_OK);
    CHECK_EQ(t_wait(b, AXF_CQ_REGION_FREED, brid, &c), 0);
    drain_all(b);
    CHECK_EQ(promised(b->e), 0);
    t_close(a);
    t_close(b);
    free(asrc);
    free(bdst);
    return 0;
}

/* Shutdown with an endpoint, regions and transfers in flight: every one of
 * their promises is kept by its record (PEER_LOST at shutdown, the ops
 * failed, REGION_FREED), none left and none kept twice. */
static int test_promises_at_shutdown(void)
{
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    memset(base_e, 0, sizeof base_e);
    promised_base(a->e);
    uint8_t *asrc = calloc(1, REG), *bdst = calloc(1, REG);
    CHECK(asrc && bdst);
    /* 64 transfers of the whole region at once over two connections: their
     * receivers copy into the same bytes together (TSan reported it in CI). */
    t_racy(asrc, REG, "overlapping READs in flight");
    t_racy(bdst, REG, "overlapping WRITEs in flight");
    uint64_t arid, akey, brid, bkey, ep, ep_idle;
    CHECK_EQ(axf_region_register(a->e, asrc, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &arid,
                                 &akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(b->e, bdst, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &brid,
                                 &bkey),
             AXF_OK);
    CHECK_EQ(connect_pair(a, b, A_TAG, &ep, 2), 0);
    /* An endpoint that never had a connection (its loss said at shutdown). */
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG + 9, 0, -1, &ep_idle), AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                 -1),
             AXF_OK);
    for (uint64_t i = 0; i < 64; i++) {
        axf_desc d = {.lrid = arid, .rrid = brid, .rkey = bkey, .len = REG};
        CHECK_EQ(axf_post(a->e, ep, i % 2 ? AXF_OP_READ : AXF_OP_WRITE, &d, 1, NULL, 0, 100 + i,
                          0),
                 AXF_OK);
    }
    axf_engine_shutdown(a->e);
    size_t xfers = 0, lost = 0, freed = 0;
    axf_completion c[256];
    size_t n;
    while ((n = axf_poll(a->e, c, 256)) > 0) {
        for (size_t k = 0; k < n; k++) {
            xfers += c[k].kind == AXF_CQ_XFER;
            lost += c[k].kind == AXF_CQ_PEER_LOST;
            freed += c[k].kind == AXF_CQ_REGION_FREED;
            axf_completion_free(&c[k]);
        }
    }
    CHECK_EQ(xfers, 64);
    CHECK_EQ(lost, 2);
    CHECK_EQ(freed, 1);
    CHECK_EQ(promised(a->e), 0);
    axf_engine_destroy(a->e);
    free(a);
    t_close(b);
    free(asrc);
    free(bdst);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_promises_balance),
        T_CASE(test_promises_at_shutdown),
    };
    return T_RUN(argc, argv, cases);
}

/* Engine core without a transport: status table, registration and its
 * REGION_FREED completion, argument checks at post, shutdown semantics. */
#include "harness.h"

#include <sys/socket.h>

static int test_strerror(void)
{
#define T_STR(name, value, text) CHECK(strcmp(axf_strerror(value), text) == 0);
    AXF_STATUS_TABLE(T_STR)
#undef T_STR
    CHECK(axf_strerror(12345) != NULL);
    CHECK(axf_strerror(-12345) != NULL);
    return 0;
}

static int test_fd_idle(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    int fd = axf_engine_fd(t->e);
    CHECK(fd >= 0);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    CHECK_EQ(poll(&p, 1, 50), 0); /* nothing happened: not readable */
    axf_completion c[4];
    CHECK_EQ(axf_poll(t->e, c, 4), 0);
    t_close(t);
    return 0;
}

static int test_register_deregister(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    static uint8_t buf[8192];
    uint64_t id = 0, key = 0, id2 = 0, key2 = 0;
    CHECK_EQ(axf_region_register(t->e, buf, sizeof buf, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &id, &key),
             AXF_OK);
    CHECK(id != 0);
    CHECK_EQ(axf_region_register(t->e, buf, 100, AXF_ACCESS_READ, -1, &id2, &key2), AXF_OK);
    CHECK(id2 != id);
    CHECK(key != key2); /* random 64-bit keys: equal only by a 2^-64 accident */

    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.regions, 2);

    CHECK_EQ(axf_region_deregister(t->e, id), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, id, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, sizeof buf);
    CHECK(c.payload == NULL);
    axf_completion_free(&c);
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.regions, 1);

    /* Once only. */
    CHECK_EQ(axf_region_deregister(t->e, id), AXF_E_NOTFOUND);
    CHECK(t_quiet(t, AXF_CQ_REGION_FREED, id, 50));
    CHECK_EQ(axf_region_deregister(t->e, 999999), AXF_E_NOTFOUND);

    CHECK_EQ(axf_region_deregister(t->e, id2), AXF_OK);
    CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, id2, &c), 0);
    axf_completion_free(&c);
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.regions, 0);
    t_close(t);
    return 0;
}

static int test_register_invalid(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    uint8_t buf[64];
    uint64_t id, key;
    CHECK_EQ(axf_region_register(t->e, NULL, 64, AXF_ACCESS_READ, -1, &id, &key), AXF_E_INVALID);
    CHECK_EQ(axf_region_register(t->e, buf, 0, AXF_ACCESS_READ, -1, &id, &key), AXF_E_INVALID);
    CHECK_EQ(axf_region_register(t->e, buf, sizeof buf, 0x80, -1, &id, &key), AXF_E_INVALID);
    CHECK_EQ(axf_region_register(t->e, (void *)(uintptr_t)(UINTPTR_MAX - 8), 64, AXF_ACCESS_READ,
                                 -1, &id, &key),
             AXF_E_INVALID);
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.regions, 0);
    t_close(t);
    return 0;
}

static int test_post_invalid(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    static uint8_t buf[4096];
    uint64_t rid, key, ep, ep_shm;
    CHECK_EQ(axf_region_register(t->e, buf, sizeof buf, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &rid, &key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_TCP, 7, 0, -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_SHM, 8, getpid(), -1, &ep_shm), AXF_OK);
    uint64_t dummy;
    CHECK_EQ(axf_endpoint_create(t->e, 99, 9, 0, -1, &dummy), AXF_E_INVALID);

    axf_desc d = {.lrid = rid, .loff = 0, .rrid = 5, .rkey = 6, .roff = 0, .len = 16};
    char big[AXF_MAX_NOTIFY + 1];
    memset(big, 'x', sizeof big);

    CHECK_EQ(axf_post(t->e, 424242, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_NOTFOUND);
    CHECK_EQ(axf_post(t->e, ep, 77, &d, 1, NULL, 0, 1, 0), AXF_E_INVALID);
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 0, NULL, 0, 1, 0), AXF_E_INVALID);
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_NOTIFY, &d, 1, "hi", 2, 1, 0), AXF_E_INVALID);
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_NOTIFY, NULL, 0, NULL, 0, 1, 0), AXF_E_INVALID);
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_READ, &d, 1, "hi", 2, 1, 0), AXF_E_INVALID);
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 1, big, sizeof big, 1, 0), AXF_E_INVALID);
    /* TCP endpoint without a connection. */
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_TRANSPORT);
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_NOTIFY, NULL, 0, "hi", 2, 1, 0), AXF_E_TRANSPORT);
    /* Remote region never imported: refused before anything moves. */
    CHECK_EQ(axf_post(t->e, ep_shm, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_ACCESS);
    /* Zero-length descriptor. */
    d.len = 0;
    CHECK_EQ(axf_post(t->e, ep_shm, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_INVALID);

    /* Rejected posts leave nothing behind and produce no completion. */
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(s.ops_posted, 0);
    CHECK(t_quiet(t, AXF_CQ_XFER, 1, 50));
    CHECK_EQ(axf_cancel(t->e, 1), AXF_E_NOTFOUND);
    t_close(t);
    return 0;
}

static int test_endpoint_close_unconnected(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_TCP, 31, 0, -1, &ep), AXF_OK);
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.endpoints, 1);
    CHECK_EQ(axf_endpoint_close(t->e, 4711), AXF_E_NOTFOUND);
    CHECK_EQ(axf_endpoint_close(t->e, ep), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_PEER_LOST, ep, &c), 0);
    CHECK_EQ(c.status, AXF_E_CLOSED);
    CHECK_EQ(c.tag, 31);
    axf_completion_free(&c);
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.endpoints, 0);
    axf_desc d = {.lrid = 1, .len = 1};
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_CLOSED);
    t_close(t);
    return 0;
}

static int test_shutdown_frees_regions(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    static uint8_t buf[3][256];
    uint64_t ids[3], key;
    for (int i = 0; i < 3; i++)
        CHECK_EQ(axf_region_register(t->e, buf[i], sizeof buf[i], AXF_ACCESS_READ, -1, &ids[i],
                                     &key),
                 AXF_OK);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_TCP, 5, 0, -1, &ep), AXF_OK);
    axf_engine_shutdown(t->e);
    axf_engine_shutdown(t->e); /* idempotent */
    axf_completion c;
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, ids[i], &c), 0);
        axf_completion_free(&c);
    }
    CHECK(t_quiet(t, AXF_CQ_REGION_FREED, ids[0], 20));
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.regions, 0);
    /* After shutdown everything is refused. */
    uint64_t id;
    CHECK_EQ(axf_region_register(t->e, buf[0], 16, AXF_ACCESS_READ, -1, &id, &key), AXF_E_CLOSED);
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_TCP, 6, 0, -1, &id), AXF_E_CLOSED);
    axf_desc d = {.lrid = ids[0], .len = 1};
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_CLOSED);
    t_close(t);
    return 0;
}

/* Quarantine bookkeeping without peers: a region nobody can touch is freed
 * at once, is never listed as quarantined, and has no holders. */
static int test_quarantine_without_peers(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    static uint8_t buf[4096];
    uint64_t id, key, tags[4];
    CHECK_EQ(axf_region_register(t->e, buf, sizeof buf, AXF_ACCESS_READ, -1, &id, &key), AXF_OK);
    CHECK_EQ(axf_region_holders(t->e, id, tags, 4), AXF_E_NOTFOUND); /* registered, not revoked */
    CHECK_EQ(axf_region_deregister(t->e, id), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, id, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(axf_region_holders(t->e, id, tags, 4), AXF_E_NOTFOUND);
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.quarantined, 0);
    CHECK_EQ(s.quarantined_bytes, 0);
    CHECK_EQ(s.held_conns, 0);
    axf_notify_release(t->e, 12345, 10); /* no such connection: nothing happens */
    t_close(t);
    return 0;
}

/* AXF_POST_INLINE (with AXF_POST_POLL): a request whose copy completes
 * successfully on the calling thread, inside axf_post, is reported by its
 * return value (AXF_POST_DONE) and pushes no record; anything else (no
 * AXF_POST_POLL, a bound notification, a copy left to the workers, a
 * refusal) is reported as without the flag. */
static int test_post_inline_done(void)
{
    enum { N = 1u << 20 };
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    uint8_t *src = calloc(1, N), *dst = calloc(1, N);
    CHECK(src && dst);
    uint64_t ep, arid, akey, brid, bkey;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_SHM, 21, getpid(), -1, &ep), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 22, -1), AXF_OK);
    CHECK_EQ(axf_region_register(a->e, src, N, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &arid,
                                 &akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(b->e, dst, N, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &brid,
                                 &bkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, N, AXF_ACCESS_READ | AXF_ACCESS_WRITE,
                                 (uint64_t)(uintptr_t)dst, -1),
             AXF_OK);
    t_fill(src, N, 3);
    const uint32_t in = AXF_POST_INLINE | AXF_POST_POLL | AXF_POST_ALONE;
    axf_desc d = {.lrid = arid, .loff = 64, .rrid = brid, .rkey = bkey, .roff = 128, .len = 4096};
    axf_stats s;
    axf_completion c;

    /* Done inside: its bytes there, counted, no record. */
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, in), AXF_POST_DONE);
    CHECK(memcmp(dst + d.roff, src + d.loff, d.len) == 0);
    axf_engine_stats(a->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(s.ops_completed, 1);
    CHECK_EQ(s.bytes, 4096);
    CHECK_EQ(axf_wait(a->e, 0), 0);
    CHECK(t_quiet(a, AXF_CQ_XFER, 1, 50));
    /* A READ too, and its id free again at once. */
    memset(src + d.loff, 0, d.len);
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_READ, &d, 1, NULL, 0, 1, in), AXF_POST_DONE);
    CHECK(memcmp(dst + d.roff, src + d.loff, d.len) == 0);
    CHECK(t_quiet(a, AXF_CQ_XFER, 1, 50));

    /* Without AXF_POST_POLL: the record, as before. */
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2,
                      AXF_POST_INLINE | AXF_POST_ALONE),
             AXF_OK);
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, 4096);

    /* A bound notification: the data is in place at return; the record
     * follows the notification (strictly after the data), as before. */
    memset(dst, 0, N);
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, "n", 1, 3, in), AXF_OK);
    CHECK(memcmp(dst + d.roff, src + d.loff, d.len) == 0);
    CHECK_EQ(t_wait_any(b, AXF_CQ_NOTIFY, &c), 0);
    axf_completion_free(&c);
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 3, &c), 0);
    CHECK_EQ(c.status, AXF_OK);

    /* Not alone and past the batch's inline size: the workers copy it, the
     * record comes from them. */
    axf_desc big = {.lrid = arid, .loff = 0, .rrid = brid, .rkey = bkey, .roff = 0, .len = N};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &big, 1, NULL, 0, 4,
                      AXF_POST_INLINE | AXF_POST_POLL),
             AXF_OK);
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 4, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(dst, src, N) == 0);

    /* Refused at post: its status, no record. */
    d.rkey ^= 1;
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 5, in), AXF_E_ACCESS);
    CHECK(t_quiet(a, AXF_CQ_XFER, 5, 50));
    axf_engine_stats(a->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(s.ops_completed, 5);
    t_close(a);
    t_close(b);
    free(src);
    free(dst);
    return 0;
}

static int test_config_defaults(void)
{
    axf_config cfg = {.copy_workers = 1, .chunk_bytes = 4096, .inline_bytes = UINT64_MAX,
                      .keepalive_ms = 50, .peer_timeout_ms = 100, .max_conns = 3,
                      .max_notify_per_conn = UINT32_MAX, .revoke_timeout_ms = 10,
                      .reply_queue_bytes = 1};
    tengine *t = t_engine(&cfg);
    CHECK(t);
    t_close(t);
    t = t_engine(NULL);
    CHECK(t);
    t_close(t);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_strerror),
        T_CASE(test_fd_idle),
        T_CASE(test_register_deregister),
        T_CASE(test_register_invalid),
        T_CASE(test_post_invalid),
        T_CASE(test_endpoint_close_unconnected),
        T_CASE(test_shutdown_frees_regions),
        T_CASE(test_quarantine_without_peers),
        T_CASE(test_config_defaults),
        T_CASE(test_post_inline_done),
    };
    return T_RUN(argc, argv, cases);
}

/* Several connections (rails) per TCP endpoint: requests striped over them,
 * a failed connection's unfinished chunks moved to the others with the data
 * intact, the endpoint lost only with its last connection, a connection added
 * back, and stall detection. A "dark" rail is a socketpair whose far end the
 * test holds and never serves: what goes there is stuck until the test
 * breaks it, so a reroute is certain, not a matter of timing. */
#include "harness.h"

#include "internal.h"
#include "mock.h"

#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>

#define REG (8u << 20)

typedef struct rails {
    tengine *a, *b;
    uint64_t ep;
    uint8_t *src, *dst;
    uint64_t arid, akey, brid, bkey;
    int dark[4]; /* the test's ends of dark rails */
    int ndark;
} rails;

/* nlive rails served by B, then ndark dark rails. */
static int rails_open(rails *r, const axf_config *cfg, int nlive, int ndark)
{
    memset(r, 0, sizeof *r);
    r->a = t_engine(cfg);
    r->b = t_engine(cfg);
    CHECK(r->a && r->b);
    CHECK_EQ(axf_endpoint_create(r->a->e, AXF_EP_TCP, 5, 0, -1, &r->ep), AXF_OK);
    for (int i = 0; i < nlive + ndark; i++) {
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ(axf_endpoint_add_rail_conn(r->a->e, r->ep, sv[0], 10 + (uint32_t)i), AXF_OK);
        if (i < nlive)
            CHECK_EQ(axf_accept_conn(r->b->e, sv[1], 6, -1), AXF_OK);
        else
            r->dark[r->ndark++] = sv[1];
    }
    r->src = malloc(REG);
    r->dst = calloc(1, REG);
    CHECK(r->src && r->dst);
    t_fill(r->src, REG, 77);
    CHECK_EQ(axf_region_register(r->a->e, r->src, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &r->arid, &r->akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(r->b->e, r->dst, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &r->brid, &r->bkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(r->a->e, r->ep, r->brid, r->bkey, REG,
                                 AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    return 0;
}

static void rails_close(rails *r)
{
    t_close(r->a);
    t_close(r->b);
    for (int i = 0; i < r->ndark; i++)
        if (r->dark[i] >= 0)
            close(r->dark[i]);
    free(r->src);
    free(r->dst);
}

static int test_write_rerouted_off_a_failed_rail(void)
{
    axf_config cfg = {.chunk_bytes = 64u << 10};
    rails r;
    if (rails_open(&r, &cfg, 2, 1))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, "done", 4, 1, 0), AXF_OK);
    /* A third of the chunks sit on the dark rail: not done. */
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 200));
    close(r.dark[0]); /* the rail breaks */
    r.dark[0] = -1;
    axf_completion c;
    CHECK_EQ(t_wait(r.a, AXF_CQ_RAIL_DOWN, r.ep, &c), 0);
    CHECK_EQ(c.fail_index, 12); /* the dark rail's number */
    CHECK_EQ(c.nbytes, 1);      /* one group moved */
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, REG);
    CHECK_EQ(c.fail_index, 1); /* on success: the groups it had rerouted */
    CHECK(memcmp(r.dst, r.src, REG) == 0);
    /* Its notification came after all of it. */
    CHECK_EQ(t_wait_any(r.b, AXF_CQ_NOTIFY, &c), 0);
    axf_completion_free(&c);
    axf_rail_stats st[4];
    CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 4), 3);
    CHECK(st[0].live && st[1].live && !st[2].live);
    CHECK_EQ(st[2].reroutes, 1);
    CHECK_EQ(st[0].bytes + st[1].bytes, REG);
    printf("  rail bytes %llu + %llu, rates %llu %llu B/ms\n", (unsigned long long)st[0].bytes,
           (unsigned long long)st[1].bytes, (unsigned long long)st[0].rate,
           (unsigned long long)st[1].rate);
    /* Later requests use the live rails only. */
    memset(r.dst, 0, REG);
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_OK);
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(r.dst, r.src, REG) == 0);
    rails_close(&r);
    return 0;
}

static int test_read_rerouted_and_rail_added_back(void)
{
    axf_config cfg = {.chunk_bytes = 64u << 10};
    rails r;
    if (rails_open(&r, &cfg, 1, 2))
        return 1;
    t_fill(r.dst, REG, 78);
    memset(r.src, 0, REG);
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_READ, &d, 1, NULL, 0, 1, 0), AXF_OK);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 200));
    /* One dark rail answers part of what it was asked, then breaks. */
    wire_hdr h;
    CHECK_EQ(recv(r.dark[0], &h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
    CHECK_EQ(h.type, FR_READ_REQ);
    wire_hdr resp = {.magic = AXF_MAGIC, .type = FR_READ_RESP, .op = h.op, .index = h.index,
                     .rid = h.rid, .off = h.off, .len = h.len};
    CHECK_EQ(send(r.dark[0], &resp, sizeof resp, 0), (ssize_t)sizeof resp);
    CHECK_EQ(send(r.dark[0], r.dst + h.off, h.len, 0), (ssize_t)h.len);
    close(r.dark[0]);
    r.dark[0] = -1;
    close(r.dark[1]);
    r.dark[1] = -1;
    axf_completion c;
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, REG); /* bytes read twice are counted once */
    CHECK(memcmp(r.src, r.dst, REG) == 0);
    int downs = 0;
    while (downs < 2 && t_wait(r.a, AXF_CQ_RAIL_DOWN, r.ep, &c) == 0)
        downs++;
    CHECK_EQ(downs, 2);
    /* The rail comes back: a new connection takes a failed one's slot. */
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_rail_conn(r.a->e, r.ep, sv[0], 11), AXF_OK);
    CHECK_EQ(axf_accept_conn(r.b->e, sv[1], 6, -1), AXF_OK);
    memset(r.src, 0, REG);
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_READ, &d, 1, NULL, 0, 2, 0), AXF_OK);
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(r.src, r.dst, REG) == 0);
    axf_rail_stats st[8];
    /* Three slots, then the counters of the connection that gave up its slot. */
    CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 8), 4);
    int live = 0, back = 0;
    for (int i = 0; i < 3; i++) {
        live += (int)st[i].live;
        back += st[i].live && st[i].rail == 11 && st[i].bytes > 0;
    }
    CHECK_EQ(live, 2);
    CHECK_EQ(back, 1); /* the new rail carried part of the second READ */
    CHECK(!st[3].live && st[3].rate == 0);
    CHECK(st[3].rail == 11 || st[3].rail == 12);
    rails_close(&r);
    return 0;
}

/* A lone 1 MiB request goes as two halves on two rails (tcp.c tcp_chunk);
 * a half stuck on a rail that breaks is moved whole to the other (found
 * again by the op's own chunk size, not chunk_bytes). */
static int test_lone_request_halves(void)
{
    axf_config cfg = {.chunk_bytes = 1u << 20};
    rails r;
    if (rails_open(&r, &cfg, 2, 0))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = 1u << 20};
    axf_completion c;
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(r.dst, r.src, 1u << 20) == 0);
    axf_rail_stats st[2];
    CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 2), 2);
    CHECK_EQ(st[0].bytes, 512u << 10);
    CHECK_EQ(st[1].bytes, 512u << 10);
    rails_close(&r);

    for (int op = 0; op < 2; op++) {
        if (rails_open(&r, &cfg, 1, 1))
            return 1;
        t_fill(r.dst, REG, 79);
        memset(r.src + REG / 2, 0, REG / 2);
        /* WRITE src[0, 1 MiB) -> dst; READ dst[0, 1 MiB) -> src[REG / 2, ...). */
        axf_desc dd = {.lrid = r.arid, .loff = op ? REG / 2 : 0, .rrid = r.brid, .rkey = r.bkey,
                       .len = 1u << 20};
        CHECK_EQ(axf_post(r.a->e, r.ep, op ? AXF_OP_READ : AXF_OP_WRITE, &dd, 1, NULL, 0, 2, 0),
                 AXF_OK);
        CHECK(t_quiet(r.a, AXF_CQ_XFER, 2, 100)); /* a half sits on the dark rail */
        close(r.dark[0]);
        r.dark[0] = -1;
        CHECK_EQ(t_wait(r.a, AXF_CQ_RAIL_DOWN, r.ep, &c), 0);
        CHECK_EQ(c.nbytes, 1); /* one group moved */
        CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 2, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK_EQ(c.nbytes, 1u << 20);
        CHECK(memcmp(op ? r.src + REG / 2 : r.dst, op ? r.dst : r.src, 1u << 20) == 0);
        rails_close(&r);
    }
    return 0;
}

static int test_last_rail_lost_fails_the_endpoint(void)
{
    axf_config cfg = {.chunk_bytes = 64u << 10};
    rails r;
    if (rails_open(&r, &cfg, 0, 2))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    close(r.dark[0]);
    r.dark[0] = -1;
    axf_completion c;
    CHECK_EQ(t_wait(r.a, AXF_CQ_RAIL_DOWN, r.ep, &c), 0);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 100)); /* moved to the other rail, still dark */
    close(r.dark[1]);
    r.dark[1] = -1;
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_E_PEER_LOST);
    CHECK_EQ(t_wait(r.a, AXF_CQ_PEER_LOST, r.ep, &c), 0);
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_E_PEER_LOST);
    rails_close(&r);
    return 0;
}

/* The dark rail's peer keeps pinging (it is alive) but never serves: the
 * stall detector fails its requests with AXF_E_TIMEOUT and takes it out. */
static int test_stalled_rail_times_out(void)
{
    axf_config cfg = {.chunk_bytes = 64u << 10, .keepalive_ms = 50, .peer_timeout_ms = 5000,
                      .stall_ms = 300};
    rails r;
    if (rails_open(&r, &cfg, 1, 1))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    wire_hdr ping = {.magic = AXF_MAGIC, .type = FR_PING};
    axf_completion c = {0};
    for (int i = 0; i < 100; i++) {
        send(r.dark[0], &ping, sizeof ping, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (t_wait_ex(r.a, AXF_CQ_XFER, false, 1, &c, 20) == 0)
            break;
    }
    uint64_t took = t_now_ms() - t0;
    CHECK_EQ(c.id, 1);
    CHECK_EQ(c.status, AXF_E_TIMEOUT);
    printf("  stalled request failed after %llu ms (stall_ms 300)\n", (unsigned long long)took);
    CHECK(took >= 300 && took < 3000);
    CHECK_EQ(t_wait(r.a, AXF_CQ_RAIL_DOWN, r.ep, &c), 0);
    CHECK_EQ(c.status, AXF_E_TIMEOUT);
    /* The served rail goes on. */
    memset(r.dst, 0, REG);
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_OK);
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(r.dst, r.src, REG) == 0);
    rails_close(&r);
    return 0;
}

/* Rates are measured per connection and weight the striping. A rate is a
 * sample over RATE_WINDOW_US (20 ms) of a connection's busy time and 256 KiB
 * at least (conn.c measure_rate), so how many writes it takes depends on the
 * machine: 32 were once not enough on a loaded CI machine (a connection that
 * the schedule gave few chunks had not been busy 20 ms yet). The writes go
 * on until every connection has a rate, up to a bound far beyond what it
 * takes: a connection never measured still fails the test. */
static int test_rates_measured(void)
{
    axf_config cfg = {.chunk_bytes = 256u << 10};
    rails r;
    if (rails_open(&r, &cfg, 3, 0))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    axf_rail_stats st[4];
    uint64_t ops = 0, measured = 0, first = 0, t0 = t_now_ms();
    /* 32 writes at least (the striping is exercised with rates moving), then
     * until each connection has a rate: 4096 writes (32 GiB) or 60 s at most. */
    while (ops < 4096 && t_now_ms() - t0 < 60000) {
        ops++;
        CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, ops, 0), AXF_OK);
        axf_completion c;
        CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, ops, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 4), 3);
        measured = 0;
        for (int i = 0; i < 3; i++)
            measured += st[i].rate > 0;
        if (measured == 3 && !first)
            first = ops;
        if (ops >= 32 && measured == 3)
            break;
    }
    printf("  every connection's rate measured after %llu writes of 8 MiB (%llu written)\n",
           (unsigned long long)first, (unsigned long long)ops);
    CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 4), 3);
    uint64_t total = 0;
    for (int i = 0; i < 3; i++) {
        CHECK(st[i].live);
        CHECK(st[i].bytes > 0);
        CHECK(st[i].rate > 0);
        total += st[i].bytes;
    }
    CHECK_EQ(total, ops * REG);
    rails_close(&r);
    return 0;
}

/* A READ's chunks are answered one by one: no chunk of a group may leave
 * before the group's expectation exists, or an early answer matches nothing
 * and the connection is closed as broken (seen with many chunks per group). */
static int test_many_chunk_reads_in_flight(void)
{
    axf_config cfg = {.chunk_bytes = 4096};
    rails r;
    if (rails_open(&r, &cfg, 4, 0))
        return 1;
    /* Each READ in flight lands in its own SIZE bytes of the region (REG /
     * INFLIGHT): READs into the same bytes at once race in our memory
     * (ThreadSanitizer, nat29); 128 chunks per READ. */
    enum { READS = 200, INFLIGHT = 16, SIZE = REG / INFLIGHT };
    uint64_t posted = 0, done = 0;
    int slot_of[READS + 1];
    bool busy[INFLIGHT] = {0};
    axf_completion c;
    while (done < READS) {
        while (posted < READS && posted - done < INFLIGHT) {
            int s = 0;
            while (busy[s]) /* fewer than INFLIGHT in flight: one is free */
                s++;
            busy[s] = true;
            slot_of[posted + 1] = s;
            uint64_t off = (uint64_t)s * SIZE;
            axf_desc d = {.lrid = r.arid, .loff = off, .rrid = r.brid, .rkey = r.bkey,
                          .roff = off, .len = SIZE};
            CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_READ, &d, 1, NULL, 0, ++posted,
                              AXF_POST_DEFER),
                     AXF_OK);
        }
        axf_doorbell(r.a->e);
        CHECK_EQ(t_wait_any(r.a, AXF_CQ_XFER, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK(c.id >= 1 && c.id <= posted && busy[slot_of[c.id]]);
        busy[slot_of[c.id]] = false;
        done++;
    }
    axf_stats st;
    axf_engine_stats(r.a->e, &st);
    CHECK_EQ(st.frames_rejected, 0);
    rails_close(&r);
    return 0;
}

/* ------------------------------------------------ a connection joins
 * (conn.c conn_spread): what a WRITE still has queued on the endpoint's
 * other connections is queued anew over all of them, the new one too. */

/* The dark rail's silence never ends it within a test (peer_timeout_ms): what
 * reaches another connection was moved there by the join, not rerouted off
 * a rail that timed out. */
#define JOIN_CFG {.chunk_bytes = 64u << 10, .peer_timeout_ms = 60000}

/* Bytes acknowledged on the connection of rail `rail`, polled until at
 * least min or ms passed. */
static uint64_t rail_bytes(rails *r, uint32_t rail, uint64_t min, int ms)
{
    uint64_t until = t_now_ms() + (uint64_t)ms, got = 0;
    for (;;) {
        axf_rail_stats st[8];
        size_t n = axf_endpoint_rails(r->a->e, r->ep, st, 8);
        got = 0;
        for (size_t i = 0; i < n; i++)
            if (st[i].rail == rail && st[i].live)
                got = st[i].bytes;
        if (got >= min || t_now_ms() > until)
            return got;
        usleep(1000);
    }
}

/* A frame header from a raw end (pings skipped), within the test timeout. */
static int raw_hdr(int fd, wire_hdr *h)
{
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    do {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        uint64_t now = t_now_ms();
        CHECK(now < until);
        CHECK_EQ(poll(&pf, 1, (int)(until - now)), 1);
        CHECK_EQ(recv(fd, h, sizeof *h, MSG_WAITALL), (ssize_t)sizeof *h);
        CHECK_EQ(h->magic, AXF_MAGIC);
    } while (h->type == FR_PING);
    return 0;
}

/* A WRITE of 128 chunks posted on one connection whose peer does not read
 * (its socket full, the rest queued), then a served connection joins: the
 * queued chunks go over both, the new one's land while the first is still
 * dark, and once it is served the request completes with every byte once.
 * Before conn_spread the new connection carried nothing of it. */
static int test_queued_write_spreads_to_a_joining_rail(void)
{
    axf_config cfg = JOIN_CFG;
    rails r;
    if (rails_open(&r, &cfg, 0, 1))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, "done", 4, 1, 0), AXF_OK);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 100));
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_rail_conn(r.a->e, r.ep, sv[0], 11), AXF_OK);
    CHECK_EQ(axf_accept_conn(r.b->e, sv[1], 6, -1), AXF_OK);
    uint64_t moved = rail_bytes(&r, 11, 1, T_TIMEOUT_MS);
    printf("  the joining rail carried %llu of %u bytes while the first was dark\n",
           (unsigned long long)moved, REG);
    CHECK(moved > 0);
    CHECK(moved < REG);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 20));
    CHECK_EQ(axf_accept_conn(r.b->e, r.dark[0], 6, -1), AXF_OK); /* served at last */
    r.dark[0] = -1;
    axf_completion c;
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, REG);
    CHECK_EQ(c.fail_index, 0); /* nothing rerouted: moved, not failed over */
    CHECK(memcmp(r.dst, r.src, REG) == 0);
    CHECK_EQ(t_wait_any(r.b, AXF_CQ_NOTIFY, &c), 0); /* after all of it */
    axf_completion_free(&c);
    axf_rail_stats st[4];
    CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 4), 2);
    CHECK_EQ(st[0].bytes + st[1].bytes, REG);
    CHECK_EQ(st[0].reroutes + st[1].reroutes, 0);
    rails_close(&r);
    return 0;
}

/* A READ queued behind a stuck WRITE (every group of it unsent) moves as a
 * whole when a connection joins; both complete exactly once the first one
 * is served. */
static int test_queued_read_moves_whole(void)
{
    axf_config cfg = JOIN_CFG;
    rails r;
    if (rails_open(&r, &cfg, 0, 1))
        return 1;
    t_fill(r.dst + REG / 2, REG / 2, 81);
    axf_desc w = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG / 2};
    axf_desc rd = {.lrid = r.arid, .loff = REG / 2, .rrid = r.brid, .rkey = r.bkey,
                   .roff = REG / 2, .len = REG / 2};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &w, 1, NULL, 0, 1, 0), AXF_OK);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 100)); /* its socket full */
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_READ, &rd, 1, NULL, 0, 2, 0), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_rail_conn(r.a->e, r.ep, sv[0], 11), AXF_OK);
    CHECK_EQ(axf_accept_conn(r.b->e, sv[1], 6, -1), AXF_OK);
    CHECK(rail_bytes(&r, 11, 1, T_TIMEOUT_MS) > 0);
    CHECK_EQ(axf_accept_conn(r.b->e, r.dark[0], 6, -1), AXF_OK);
    r.dark[0] = -1;
    axf_completion c;
    for (uint64_t id = 1; id <= 2; id++) {
        CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, id, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK_EQ(c.nbytes, REG / 2);
    }
    CHECK(memcmp(r.dst, r.src, REG) == 0); /* written half, read half */
    axf_rail_stats st[4];
    CHECK_EQ(axf_endpoint_rails(r.a->e, r.ep, st, 4), 2);
    CHECK_EQ(st[0].bytes + st[1].bytes, REG);
    rails_close(&r);
    return 0;
}

/* The joining connection takes moved chunks, then fails before answering:
 * they are moved again (to the first one, rerouted as any failed
 * connection's) and land once; if the first one fails too, the request
 * fails typed (peer lost), never hangs. */
static int test_spread_chunks_on_a_joining_rail_that_fails(void)
{
    for (int both = 0; both < 2; both++) {
        axf_config cfg = JOIN_CFG;
        rails r;
        if (rails_open(&r, &cfg, 0, 1))
            return 1;
        axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
        CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
        CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 100));
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ(axf_endpoint_add_rail_conn(r.a->e, r.ep, sv[0], 11), AXF_OK);
        wire_hdr h;
        if (raw_hdr(sv[1], &h))
            return 1;
        CHECK(h.type == FR_WRITE && h.op == 1); /* moved chunks came to it */
        close(sv[1]); /* it breaks with them unanswered */
        axf_completion c;
        CHECK_EQ(t_wait(r.a, AXF_CQ_RAIL_DOWN, r.ep, &c), 0);
        CHECK_EQ(c.fail_index, 11);
        CHECK(c.nbytes >= 1); /* its groups moved (back to the first) */
        CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 20));
        if (both) {
            close(r.dark[0]);
            r.dark[0] = -1;
            CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
            CHECK_EQ(c.status, AXF_E_PEER_LOST);
            CHECK_EQ(t_wait(r.a, AXF_CQ_PEER_LOST, r.ep, &c), 0);
        } else {
            CHECK_EQ(axf_accept_conn(r.b->e, r.dark[0], 6, -1), AXF_OK);
            r.dark[0] = -1;
            CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
            CHECK_EQ(c.status, AXF_OK);
            CHECK_EQ(c.nbytes, REG);
            CHECK(c.fail_index >= 1); /* the groups it rerouted */
            CHECK(memcmp(r.dst, r.src, REG) == 0);
        }
        rails_close(&r);
    }
    return 0;
}

/* A request cancelled once its queued chunks were spread completes
 * cancelled (what was sent of it acknowledged, the rest never sent). */
static int test_spread_request_cancelled(void)
{
    axf_config cfg = JOIN_CFG;
    rails r;
    if (rails_open(&r, &cfg, 0, 1))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 100));
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_rail_conn(r.a->e, r.ep, sv[0], 11), AXF_OK);
    int joined = sv[1];
    wire_hdr h;
    if (raw_hdr(joined, &h))
        return 1;
    CHECK(h.type == FR_WRITE && h.op == 1);
    CHECK_EQ(axf_cancel(r.a->e, 1), AXF_OK);
    CHECK_EQ(axf_accept_conn(r.b->e, r.dark[0], 6, -1), AXF_OK);
    r.dark[0] = -1;
    close(joined); /* the rest of its part never answered: moved, then aborted */
    axf_completion c;
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_E_CANCELLED);
    rails_close(&r);
    return 0;
}

/* A group the join could not move (its reroute failed: out of memory, the
 * test's fault) ends its unit once e->mu is released (conn_spread_end). The
 * peer dies in that window: every connection of the endpoint exits first.
 * The request still completes once, with the first failure, and the peer
 * is reported lost. Before conn_spread held the endpoint over that window,
 * the last connection out claimed the op, the moved frames' release freed
 * it, and the unit's end then touched it (ASan: heap use after free in
 * op_unit_done). */
typedef struct peer_dies {
    rails *r;
    int joined;     /* the joining connection's far end */
    bool timed_out; /* A's connection threads did not all exit */
} peer_dies;

static void peer_dies_in_the_gap(void *arg)
{
    peer_dies *g = arg;
    close(g->r->dark[0]);
    g->r->dark[0] = -1;
    close(g->joined);
    g->joined = -1;
    axf_engine *e = g->r->a->e;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += T_TIMEOUT_MS / 1000;
    pthread_mutex_lock(&e->th_mu);
    while (e->conn_threads > 0 && !g->timed_out)
        g->timed_out = pthread_cond_timedwait(&e->th_cv, &e->th_mu, &until) == ETIMEDOUT;
    pthread_mutex_unlock(&e->th_mu);
}

static int test_spread_fails_while_the_peer_dies(void)
{
    axf_config cfg = JOIN_CFG;
    rails r;
    if (rails_open(&r, &cfg, 0, 1))
        return 1;
    axf_desc d = {.lrid = r.arid, .rrid = r.brid, .rkey = r.bkey, .len = REG};
    CHECK_EQ(axf_post(r.a->e, r.ep, AXF_OP_WRITE, &d, 1, "done", 4, 1, 0), AXF_OK);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 100)); /* its socket full, groups queued */
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    peer_dies g = {.r = &r, .joined = sv[1]};
    axf_faults f = {.spread_nomem = true, .spread_gap = peer_dies_in_the_gap, .arg = &g};
    axf_mock_faults(r.a->e, &f);
    CHECK_EQ(axf_endpoint_add_rail_conn(r.a->e, r.ep, sv[0], 11), AXF_OK);
    axf_mock_faults(r.a->e, NULL);
    CHECK(!g.timed_out);
    axf_completion c;
    CHECK_EQ(t_wait(r.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_E_NOMEM); /* the first failure: its move's */
    CHECK_EQ(t_wait(r.a, AXF_CQ_PEER_LOST, r.ep, &c), 0);
    CHECK(t_quiet(r.a, AXF_CQ_XFER, 1, 50)); /* once */
    rails_close(&r);
    return 0;
}

/* The target's engine shuts down (its agent closes cleanly): it says
 * goodbye on each accepted connection (a PING with FL_BYE), so the
 * initiator reports its rails closed (AXF_E_CLOSED, not lost) and the
 * endpoint closed by the peer (AXF_CQ_PEER_LOST with fail_index 1). A
 * target whose connections just end (a crash: the dark rails' ends closed)
 * is still a loss (fail_index 0). Before FL_BYE both read alike. */
static int test_target_goodbye_reported_as_a_close(void)
{
    for (int crash = 0; crash < 2; crash++) {
        axf_config cfg = {.chunk_bytes = 64u << 10};
        rails r;
        if (rails_open(&r, &cfg, crash ? 0 : 3, crash ? 3 : 0))
            return 1;
        if (crash) {
            for (int i = 0; i < r.ndark; i++) {
                close(r.dark[i]);
                r.dark[i] = -1;
            }
        } else {
            t_close(r.b);
            r.b = NULL;
        }
        axf_completion c;
        CHECK_EQ(t_wait(r.a, AXF_CQ_PEER_LOST, r.ep, &c), 0);
        CHECK_EQ(c.status, AXF_E_PEER_LOST); /* (its requests fail as lost all the same) */
        CHECK_EQ(c.fail_index, crash ? 0 : 1);
        t_drain(r.a);
        int downs = 0;
        for (size_t i = 0; i < r.a->n; i++) {
            const axf_completion *q = &r.a->q[i];
            if (q->kind == AXF_CQ_RAIL_DOWN) {
                downs++;
                CHECK_EQ(q->status, crash ? AXF_E_PEER_LOST : AXF_E_CLOSED);
            }
            CHECK(crash || q->kind != AXF_CQ_LOG); /* nothing said about a clean close */
        }
        printf("  %s: %d rail-down records before the endpoint's\n", crash ? "crash" : "goodbye",
               downs);
        rails_close(&r);
    }
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_write_rerouted_off_a_failed_rail),
        T_CASE(test_queued_write_spreads_to_a_joining_rail),
        T_CASE(test_queued_read_moves_whole),
        T_CASE(test_spread_chunks_on_a_joining_rail_that_fails),
        T_CASE(test_spread_request_cancelled),
        T_CASE(test_spread_fails_while_the_peer_dies),
        T_CASE(test_target_goodbye_reported_as_a_close),
        T_CASE(test_read_rerouted_and_rail_added_back),
        T_CASE(test_lone_request_halves),
        T_CASE(test_last_rail_lost_fails_the_endpoint),
        T_CASE(test_stalled_rail_times_out),
        T_CASE(test_rates_measured),
        T_CASE(test_many_chunk_reads_in_flight),
    };
    return T_RUN(argc, argv, cases);
}

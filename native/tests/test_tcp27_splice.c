/* The one-copy send's release rule (conn.c "one-copy send", tcp26) at two
 * edges tcp27 fixed. A spliced WRITE's op stays pinned until the peer has
 * read or dropped the pages (its group's acknowledgement, or the dead
 * connection's spl_settle), so the caller cannot reuse the memory a peer
 * would still read:
 *  - an inline sender (conn_kick) releases its sent items after unlocking
 *    the connection; a connection whose threads end in that window must
 *    still keep them (conn.c spl_late), with the peer's queue unread;
 *  - an op acknowledged on a connection while another group of it was owed
 *    there keeps its holds; a joining connection's spread that moves that
 *    group off whole must release them (conn.c spread_take), else the op
 *    never completes while the connection lives.
 * Real TCP loopback, a raw peer socket the test reads (or not), the
 * test-only fault hook of the mock library (internal.h axf_faults) to stop
 * in the window. Splice forced on (AIOXFER_TCP_SPLICE=1, set here before
 * the engine is made). */
#include "harness.h"

#include "internal.h"
#include "mock.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#define A_TAG 77
#define REG (4u << 20)

typedef struct gap {
    axf_engine *e;
    int peer;  /* the raw peer's socket */
    int calls; /* windows met */
    bool ended_in_gap; /* the connection's threads ended (settled) within it */
} gap;

/* In conn_kick's window: the peer half-closes (its FIN: our receiver sees
 * the end, the connection dies) but keeps what it was sent unread; we give
 * the connection's threads 400 ms to end. Before the fix they ended at
 * once, settling with no holds; with it the last one waits for us. */
static void peer_ends_in_the_gap(void *arg)
{
    gap *g = arg;
    if (g->calls++)
        return;
    (void)shutdown(g->peer, SHUT_WR);
    uint64_t t0 = t_now_ms();
    while (t_now_ms() - t0 < 400) {
        if (atomic_load(&g->e->n_conns) == 0) {
            g->ended_in_gap = true;
            break;
        }
        usleep(2000);
    }
}

/* A WRITE spliced and sent whole from the posting thread (conn_kick); the
 * connection ends while the posting thread is between its unlock and the
 * release. The op's memory must not be released while the peer's receive
 * queue still holds the spliced bytes unread; once the peer drains it, it
 * is (AXF_CQ_XFER_FREED), promptly. */
static int test_kick_release_race(void)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    int y;
    int big = 4 << 20; /* room for the whole frame at once (spl_room) */
    if (t_raw_peer(a->e, ep, big, big, &y) || t_wait_count(&a->e->splice_verdicts, 1))
        return 1;
    uint8_t *src = calloc(1, REG);
    CHECK(src);
    t_fill(src, REG, 3);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(a->e, src, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, 1, 2, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    gap g = {.e = a->e, .peer = y};
    axf_faults f = {.kick_release_gap = peer_ends_in_the_gap, .arg = &g};
    axf_mock_faults(a->e, &f);
    axf_desc d = {.lrid = rid, .loff = 0, .rrid = 1, .rkey = 2, .roff = 0, .len = 128 << 10};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 4242, 0), AXF_OK);
    printf("  windows %d, spliced frames %" PRIu64 ", ended in the window: %d\n", g.calls,
           (uint64_t)atomic_load(&a->e->spliced_frames), (int)g.ended_in_gap);
    CHECK(g.calls >= 1); /* the frame went spliced, from the posting thread */
    /* The op fails at once (spl28: AXF_CQ_XFER_HELD), but the peer has read
     * nothing: its memory stays held, whatever the threads did. */
    axf_completion h;
    CHECK_EQ(t_wait(a, AXF_CQ_XFER_HELD, 4242, &h), 0);
    CHECK(h.status != AXF_OK);
    CHECK(t_quiet(a, AXF_CQ_XFER_FREED, 4242, 600));
    CHECK(!g.ended_in_gap); /* the last thread waited for the late items */
    /* The peer drains its queue: the pages are free, the op fails now. */
    static uint8_t buf[256 << 10];
    uint64_t t0 = t_now_ms();
    for (;;) {
        ssize_t r = recv(y, buf, sizeof buf, MSG_DONTWAIT);
        if (r == 0)
            break;
        if (r < 0 && errno != EAGAIN && errno != EINTR)
            break;
        if (r < 0 && t_now_ms() - t0 > 3000)
            break;
        if (r < 0)
            usleep(1000);
    }
    axf_completion c;
    CHECK_EQ(t_wait(a, AXF_CQ_XFER_FREED, 4242, &c), 0);
    axf_mock_faults(a->e, NULL);
    close(y);
    t_close(a);
    free(src);
    return 0;
}

/* One frame from a raw peer's socket: its header (and segment table and
 * payload, skipped). 0, or -1: nothing within ms. */
static int read_frame(int fd, wire_hdr *h, int ms)
{
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, ms) != 1)
        return -1;
    if (recv(fd, h, sizeof *h, MSG_WAITALL) != (ssize_t)sizeof *h)
        return -1;
    uint64_t skip = (uint64_t)h->nseg * sizeof(wire_seg);
    if (h->type == FR_WRITE || h->type == FR_WRITEV)
        skip += h->len;
    static uint8_t buf[256 << 10];
    while (skip) {
        ssize_t r = recv(fd, buf, skip < sizeof buf ? skip : sizeof buf, MSG_WAITALL);
        if (r <= 0)
            return -1;
        skip -= (uint64_t)r;
    }
    return 0;
}

/* Reads fd's frames to the end of op id's group (its FL_LAST frame); the
 * first data frame must be op's (when id is 0: whichever op's, stored).
 * 0, or -1: another op's data first, or nothing in time. */
static int read_group(int fd, uint64_t *id)
{
    for (;;) {
        wire_hdr h;
        if (read_frame(fd, &h, 2000))
            return -1;
        if (h.type != FR_WRITE && h.type != FR_WRITEV)
            continue; /* (a ping) */
        if (!*id)
            *id = h.op;
        if (h.op != *id) {
            printf("  op %" PRIu64 "'s frame, not %" PRIu64 "'s\n", (uint64_t)h.op, *id);
            return -1;
        }
        if (h.flags & FL_LAST)
            return 0;
    }
}

static int send_ack(int fd, uint64_t id)
{
    wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_WRITE_ACK, .op = id};
    CHECK_EQ(send(fd, &ack, sizeof ack, MSG_NOSIGNAL), (ssize_t)sizeof ack);
    return 0;
}

/* An op's group acknowledged on a connection while another of its groups
 * is still owed there keeps its spliced frames as holds (spl_keep). When a
 * joining connection's spread (conn_spread) then moves that other group off
 * whole, no acknowledgement on the first connection would release them: the
 * op must still complete once its moved group is acknowledged where it
 * went. The shape: WRITE O striped over connections A and B, WRITE P after
 * it; B lost, so O's and P's groups of B go behind P's on A (A's queue: O
 * sent, P blocked, O's second unsent); O acknowledged on A; C joins and
 * takes O's second group; acknowledged on C, O completes. Before the fix it
 * did not (pinned by A's holds until A died). Should the spread's schedule
 * put O's group back on A, the case fails as inconclusive, not passes. */
static int test_spread_moves_last_group(void)
{
    signal(SIGPIPE, SIG_DFL);
    /* Every WRITE frame of 64 KiB..8 MiB spliced, whatever the request's size. */
    setenv("AIOXFER_TCP_SPLICE", "65536-8388608-99999999999", 1);
    axf_config cfg = {.chunk_bytes = 3 << 20}; /* O and P: two chunks each */
    tengine *a = t_engine(&cfg);
    setenv("AIOXFER_TCP_SPLICE", "1", 1);
    CHECK(a);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    int ya, yb, yc;
    int small = 64 << 10; /* what is queued behind stays unsent */
    if (t_raw_peer(a->e, ep, small, small, &ya) || t_raw_peer(a->e, ep, small, small, &yb))
        return 1;
    enum { SRC = 16 << 20 };
    uint8_t *src = calloc(1, SRC);
    CHECK(src);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(a->e, src, SRC, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, 1, 2, SRC, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    /* O over 4 MiB (no solo connection: tcp.c solo_conn), P as large. */
    axf_desc od = {.lrid = rid, .loff = 0, .rrid = 1, .rkey = 2, .roff = 0, .len = 6 << 20};
    axf_desc pd = {.lrid = rid, .loff = 0, .rrid = 1, .rkey = 2, .roff = 8 << 20, .len = 6 << 20};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &od, 1, NULL, 0, 1, 0), AXF_OK);
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &pd, 1, NULL, 0, 2, 0), AXF_OK);
    uint64_t o_id = 0;
    CHECK_EQ(read_group(ya, &o_id), 0); /* O's group on A, read whole */
    close(yb); /* B lost: its groups go onto A, behind P's */
    uint64_t t0 = t_now_ms();
    for (;;) { /* until B's groups were moved (rerouted when it failed) */
        axf_rail_stats rs[4];
        size_t n = axf_endpoint_rails(a->e, ep, rs, 4), moved = 0;
        for (size_t i = 0; i < n; i++)
            moved += !rs[i].live && rs[i].reroutes >= 2;
        if (moved)
            break;
        CHECK(t_now_ms() - t0 < 5000);
        usleep(5000);
    }
    usleep(50 * 1000);
    CHECK_EQ(send_ack(ya, o_id), 0); /* O's group on A read: held, O's other owed on A */
    usleep(100 * 1000);
    CHECK(t_quiet(a, AXF_CQ_XFER, 1, 10));
    /* A small WRITE now: it moves the schedule's rotation by one, so the
     * spread's first job (O's group) goes to C, where P's went first. */
    axf_desc qd = {.lrid = rid, .loff = 0, .rrid = 1, .rkey = 2, .roff = 15 << 20, .len = 4096};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &qd, 1, NULL, 0, 3, 0), AXF_OK);
    int xc;
    if (t_tcp_pair(&xc, &yc))
        return 1;
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, xc), AXF_OK); /* the spread */
    uint64_t got = o_id;
    if (read_group(yc, &got) != 0) {
        printf("  O's moved group did not come to the new connection: inconclusive\n");
        CHECK(0);
    }
    CHECK_EQ(send_ack(yc, o_id), 0);
    axf_completion c;
    CHECK_EQ(t_wait_ex(a, AXF_CQ_XFER, false, 1, &c, 3000), 0); /* before: never */
    CHECK_EQ(c.status, AXF_OK);
    close(ya); /* (P's groups fail: the engine's close ends them) */
    close(yc);
    t_close(a);
    free(src);
    return 0;
}

int main(int argc, char **argv)
{
    setenv("AIOXFER_TCP_SPLICE", "1", 1); /* (read at the engine's creation) */
    static const t_case cases[] = {
        T_CASE(test_kick_release_race),
        T_CASE(test_spread_moves_last_group),
    };
    return T_RUN(argc, argv, cases);
}

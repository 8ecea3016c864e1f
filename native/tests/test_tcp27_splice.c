/* The one-copy send's release rule (conn.c "one-copy send", tcp26) at two
 * edges tcp27 fixed. A spliced WRITE's op stays pinned until the peer has
 * read or dropped the pages (its group's acknowledgement, or the dead
 * connection's spl_settle), so the caller cannot reuse the memory a peer
 * would still read:
 *  - an inline sender (conn_kick) releases its sent items after unlocking
 *    the connection; a connection whose threads end in that window must
 *    still keep them (conn.c spl_late), with the peer's queue unread;
 *  - (the other, spread_take's, is in tests/test_tcp27_*.py's reach only
 *    through a real join: see the report.)
 * Real TCP loopback, a raw peer socket the test reads (or not), the
 * test-only fault hook of the mock library (internal.h axf_faults) to stop
 * in the window. Splice forced on (AIOXFER_TCP_SPLICE=1, set here before
 * the engine is made). */
#include "harness.h"

#include "internal.h"
#include "mock.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#define A_TAG 77
#define REG (4u << 20)

static int tcp_pair(int *a, int *b)
{
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(l >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    CHECK_EQ(bind(l, (struct sockaddr *)&sa, sizeof sa), 0);
    CHECK_EQ(listen(l, 1), 0);
    CHECK_EQ(getsockname(l, (struct sockaddr *)&sa, &sl), 0);
    *a = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(*a >= 0);
    CHECK_EQ(connect(*a, (struct sockaddr *)&sa, sizeof sa), 0);
    *b = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    CHECK(*b >= 0);
    close(l);
    return 0;
}

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
 * release. The op must not complete while the peer's receive queue still
 * holds the spliced bytes unread; once the peer drains it, it fails (the
 * peer is lost), promptly. */
static int test_kick_release_race(void)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    int x, y;
    if (tcp_pair(&x, &y))
        return 1;
    int big = 4 << 20; /* room for the whole frame at once (spl_room) */
    (void)setsockopt(x, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    (void)setsockopt(y, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, x), AXF_OK);
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
    /* The peer has read nothing: no completion, whatever the threads did. */
    CHECK(t_quiet(a, AXF_CQ_XFER, 4242, 600));
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
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 4242, &c), 0);
    CHECK(c.status != AXF_OK);
    axf_mock_faults(a->e, NULL);
    close(y);
    t_close(a);
    free(src);
    return 0;
}

int main(int argc, char **argv)
{
    setenv("AIOXFER_TCP_SPLICE", "1", 1); /* (read at the engine's creation) */
    static const t_case cases[] = {
        T_CASE(test_kick_release_race),
    };
    return T_RUN(argc, argv, cases);
}

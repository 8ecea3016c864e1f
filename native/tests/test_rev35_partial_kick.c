/* A lone WRITE whose posting thread's inline send goes only partly into a
 * small socket buffer (conn.c conn_kick: a nowait send_batch puts the rest
 * back) must be finished by the sending thread at once, woken for it: spl29
 * stopped conn_kick's spl_late broadcast on c->cv, the sending thread's
 * condvar, and this checks no wake-up the rest relied on went with it. The
 * keepalive interval is a minute, so the sending thread's timed wait does
 * not end by itself before the completion's wait gives up: a wake-up lost
 * for good fails here. (One only late does not: with conn.c's two tx_wake
 * calls of the put-back path removed, other wake-ups finished each frame
 * in ~1.6 s, checked; the test takes no time.) AIOXFER_TCP_SPLICE=1 (frames spliced where they fit), real TCP
 * loopback, a raw peer that reads late (after the posting thread left). */
#include "harness.h"

#include "internal.h"
#include "mock.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#define A_TAG 35
#define REG (2u << 20)
#define ROUNDS 8

typedef struct counts {
    atomic_int woke;     /* the sending thread's waits ended */
    atomic_int released; /* conn_kick released spliced items it sent */
} counts;

static void on_woke(void *arg)
{
    atomic_fetch_add(&((counts *)arg)->woke, 1);
}

static void on_release(void *arg)
{
    atomic_fetch_add(&((counts *)arg)->released, 1);
}

/* The next WRITE frame of the raw peer's socket, whole (header, segment
 * table, payload); pings skipped. Its payload is checked against want.
 * 0, or -1: nothing in time, or other bytes. */
static int read_write(int fd, const uint8_t *want, uint64_t len, uint64_t *op)
{
    static uint8_t buf[4 << 20];
    for (;;) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, (int)T_TIMEOUT_MS) != 1)
            return -1;
        wire_hdr h;
        if (recv(fd, &h, sizeof h, MSG_WAITALL) != (ssize_t)sizeof h)
            return -1;
        uint64_t seg = (uint64_t)h.nseg * sizeof(wire_seg);
        if (seg && recv(fd, buf, seg, MSG_WAITALL) != (ssize_t)seg)
            return -1;
        if (h.type != FR_WRITE)
            continue; /* (a ping) */
        if (h.len != len || len > sizeof buf ||
            recv(fd, buf, len, MSG_WAITALL) != (ssize_t)len || memcmp(buf, want, len) != 0)
            return -1;
        *op = h.op;
        return 0;
    }
}

/* ROUNDS lone WRITEs of len bytes; the peer starts reading only after a
 * pause, then acknowledges. sndbuf: the sending socket's buffer (64 KiB:
 * the inline send goes short; 8 MiB: the frame fits, spliced whole by the
 * posting thread while the peer's 64 KiB receive buffer stays full). */
static int lone_partial(uint64_t len, int sndbuf)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {.keepalive_ms = 60000};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    /* The hooks set before the connection's threads start, kept until the
     * engine's close: no store of them races with their reads. */
    counts n = {0};
    axf_faults f = {.tx_woke = on_woke, .kick_release_gap = on_release, .arg = &n};
    axf_mock_faults(a->e, &f);
    int y;
    int small = 32 << 10; /* (sizes doubled by the kernel) */
    if (t_raw_peer(a->e, ep, sndbuf, small, &y))
        return 1;
    uint8_t *src = calloc(1, REG);
    CHECK(src);
    t_fill(src, REG, 7);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(a->e, src, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, 1, 2, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    usleep(50 * 1000); /* the connection's threads started and waiting */
    int woke0 = atomic_load(&n.woke);
    for (int i = 0; i < ROUNDS; i++) {
        uint64_t off = (uint64_t)(i % 2) * len;
        axf_desc d = {.lrid = rid, .loff = off, .rrid = 1, .rkey = 2, .roff = 0, .len = len};
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 200 + (uint64_t)i, 0), AXF_OK);
        usleep(30 * 1000); /* the posting thread's inline send returned, short */
        uint64_t op = 0;
        CHECK_EQ(read_write(y, src + off, len, &op), 0);
        wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_WRITE_ACK, .op = op};
        CHECK_EQ(send(y, &ack, sizeof ack, MSG_NOSIGNAL), (ssize_t)sizeof ack);
        axf_completion c;
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, 200 + (uint64_t)i, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    int woke = atomic_load(&n.woke) - woke0;
    printf("  %" PRIu64 " B x %d: sending thread woken %d, spliced items released inline %d\n",
           len, ROUNDS, woke, atomic_load(&n.released));
    if (sndbuf < (int)len)
        CHECK(woke >= 1); /* the rest went on the sending thread */
    close(y);
    t_close(a);
    free(src);
    return 0;
}

static int test_partial_256k(void)
{
    return lone_partial(256u << 10, 32 << 10);
}

static int test_partial_1m(void)
{
    return lone_partial(1u << 20, 32 << 10);
}

static int test_whole_1m_late_reader(void)
{
    return lone_partial(1u << 20, 4 << 20);
}

int main(int argc, char **argv)
{
    setenv("AIOXFER_TCP_SPLICE", "1", 1); /* (read at the engine's creation) */
    static const t_case cases[] = {
        T_CASE(test_partial_256k),
        T_CASE(test_partial_1m),
        T_CASE(test_whole_1m_late_reader),
    };
    return T_RUN(argc, argv, cases);
}

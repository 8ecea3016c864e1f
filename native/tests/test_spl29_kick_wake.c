/* A lone spliced WRITE sent by its posting thread (conn.c conn_kick, the
 * one-copy send) must not wake the connection's idle sending thread.
 * conn_kick counts its spliced items until it has released them
 * (spl_late, tcp27) and used to broadcast c->cv each time the count fell
 * back to 0, for spl_settle; but c->cv is also where the sending thread
 * waits for work, so every lone spliced WRITE woke it for nothing: a
 * thread wake-up (a voluntary switch, tens of us on a VM) per request on
 * the path the inline send exists to keep free of them (spl29: the tcp
 * 1 MiB WRITE row's gap to NIXL-tcp, and why splicing 64 KiB frames
 * measured slower than copying them).
 *
 * Real TCP loopback, a raw peer socket the test reads and acknowledges,
 * WRITEs awaited one at a time; the test-only fault hooks of the mock
 * library (internal.h axf_faults) count the sending thread's wake-ups and
 * the items the posting thread released (so every frame went spliced from
 * the posting thread, not from the sending thread). */
#include "harness.h"

#include "internal.h"
#include "mock.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#define A_TAG 29
#define REG (2u << 20)
#define ROUNDS 64

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
    static uint8_t buf[1 << 20];
    for (;;) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 3000) != 1)
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

/* ROUNDS lone WRITEs of len bytes, each awaited: the peer reads the frame
 * and acknowledges it. Every frame must go spliced from the posting thread
 * and the sending thread stay asleep (its timed wait for keepalive may end
 * once or twice in the run, not once a request). */
static int lone_writes(uint64_t len)
{
    signal(SIGPIPE, SIG_DFL);
    axf_config cfg = {0};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    int y;
    int big = 4 << 20; /* room for the whole frame at once (conn.c spl_room) */
    if (t_raw_peer(a->e, ep, big, big, &y))
        return 1;
    uint8_t *src = calloc(1, REG);
    CHECK(src);
    t_fill(src, REG, 5);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(a->e, src, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, 1, 2, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    usleep(50 * 1000); /* the connection's threads started and waiting */
    counts n = {0};
    axf_faults f = {.tx_woke = on_woke, .kick_release_gap = on_release, .arg = &n};
    axf_mock_faults(a->e, &f);
    uint64_t frames0 = atomic_load(&a->e->spliced_frames);
    for (int i = 0; i < ROUNDS; i++) {
        uint64_t off = (uint64_t)(i % 4) * len;
        axf_desc d = {.lrid = rid, .loff = off, .rrid = 1, .rkey = 2, .roff = 0, .len = len};
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 100 + (uint64_t)i, 0), AXF_OK);
        uint64_t op = 0;
        CHECK_EQ(read_write(y, src + off, len, &op), 0);
        wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_WRITE_ACK, .op = op};
        CHECK_EQ(send(y, &ack, sizeof ack, MSG_NOSIGNAL), (ssize_t)sizeof ack);
        axf_completion c;
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, 100 + (uint64_t)i, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    axf_mock_faults(a->e, NULL);
    uint64_t frames = atomic_load(&a->e->spliced_frames) - frames0;
    int woke = atomic_load(&n.woke), released = atomic_load(&n.released);
    printf("  %" PRIu64 " B x %d: spliced frames %" PRIu64 ", released by the posting thread %d,"
           " sending thread woken %d\n",
           len, ROUNDS, frames, released, woke);
    CHECK_EQ(frames, (uint64_t)ROUNDS);
    CHECK_EQ(released, ROUNDS); /* each sent whole by the posting thread */
    CHECK(woke <= ROUNDS / 8);  /* before: about one per request */
    close(y);
    t_close(a);
    free(src);
    return 0;
}

/* The default window's smallest frame (tcp.c: 256 KiB..1 MiB). */
static int test_lone_256k(void)
{
    return lone_writes(256u << 10);
}

/* tcp26's opt-in window ("1"): 64 KiB frames too. */
static int test_lone_64k(void)
{
    return lone_writes(64u << 10);
}

int main(int argc, char **argv)
{
    setenv("AIOXFER_TCP_SPLICE", "1", 1); /* (read at the engine's creation) */
    static const t_case cases[] = {
        T_CASE(test_lone_256k),
        T_CASE(test_lone_64k),
    };
    return T_RUN(argc, argv, cases);
}

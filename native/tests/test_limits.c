/* What a peer can make an engine hold, measured: replies queued for a peer
 * that does not read them, a target's flood of revocations, notifications the
 * application has not consumed, connections, a tcp peer that never
 * acknowledges a revocation; what a lost peer leaves behind over many
 * connect/lose cycles (mappings, structs); and whose numbers a completion
 * reports. Floods are bounded in time and count; bounds are asserted with
 * generous margins. Raw sockets play the hostile peers. */
#include "harness.h"

/* Wire layout, for the raw peers. */
#include "internal.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#define REG (1u << 20)

static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "re");
    if (!f)
        return -1;
    char line[256];
    long v = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            v = strtol(line + 6, NULL, 10);
    fclose(f);
    return v;
}

static long maps_count(void)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return -1;
    long n = 0;
    int ch;
    while ((ch = fgetc(f)) != EOF)
        n += ch == '\n';
    fclose(f);
    return n;
}

static int pidfd_self(void)
{
    return (int)syscall(SYS_pidfd_open, getpid(), 0);
}

/* Writes frames from `make` into fd without blocking, for up to ms or until
 * the socket refused them for 300 ms in a row (the receiver stopped reading);
 * returns how many went in. */
static long flood(int fd, const wire_hdr *frame, long max_frames, int ms)
{
    int fl = fcntl(fd, F_GETFL);
    (void)fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    uint64_t end = t_now_ms() + (uint64_t)ms, stuck_since = 0;
    long sent = 0;
    size_t partial = 0;
    while (sent < max_frames && t_now_ms() < end) {
        ssize_t r = send(fd, (const uint8_t *)frame + partial, sizeof *frame - partial,
                         MSG_NOSIGNAL);
        if (r > 0) {
            partial += (size_t)r;
            if (partial == sizeof *frame) {
                partial = 0;
                sent++;
            }
            stuck_since = 0;
            continue;
        }
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            break;
        if (!stuck_since)
            stuck_since = t_now_ms();
        else if (t_now_ms() - stuck_since > 300)
            break;
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        poll(&p, 1, 20);
    }
    /* Finish a partial frame so the stream stays parseable. */
    while (partial && partial < sizeof *frame) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        poll(&p, 1, 100);
        ssize_t r = send(fd, (const uint8_t *)frame + partial, sizeof *frame - partial,
                         MSG_NOSIGNAL);
        if (r > 0)
            partial += (size_t)r;
        else if (r < 0 && errno != EAGAIN)
            break;
    }
    (void)fcntl(fd, F_SETFL, fl);
    return sent;
}

/* READ requests sent faster than their responses are read: the target stops
 * reading that connection once reply_queue_bytes of responses wait, so a
 * flood moves only what the socket buffers and that bound hold. */
static int test_reply_queue_bounded(void)
{
    axf_config cfg = {.reply_queue_bytes = 256u << 10, .peer_timeout_ms = 20000};
    tengine *b = t_engine(&cfg);
    CHECK(b);
    uint8_t *mem = calloc(1, REG);
    CHECK(mem);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(b->e, mem, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &rid,
                                 &key),
             AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 7, -1), AXF_OK);
    long rss0 = rss_kib();
    /* Tiny reads: the cost is in the queue items, not in payload. */
    wire_hdr h = {.magic = AXF_MAGIC, .type = FR_READ_REQ, .flags = FL_LAST, .op = 1,
                  .rid = rid, .key = key, .off = 0, .len = 1};
    long sent = flood(sv[0], &h, 2000000, 3000);
    long grown = rss_kib() - rss0;
    printf("  READ flood: %ld requests went in, target RSS +%ld KiB\n", sent, grown);
    /* Bound: socket buffers (a few hundred KiB of 64-byte frames each way)
     * plus 256 KiB of queued replies (~250 bytes each). Unbounded, a target
     * serves a million requests a second into its queue. */
    CHECK(sent < 60000);
    CHECK(grown < 32 * 1024);
    /* Reading the responses lets it go on: nothing was dropped. */
    int fl = fcntl(sv[0], F_GETFL);
    (void)fcntl(sv[0], F_SETFL, fl | O_NONBLOCK);
    long got = 0;
    uint8_t buf[65 * 64];
    size_t have = 0;
    uint64_t end = t_now_ms() + 10000;
    while (got < sent && t_now_ms() < end) {
        ssize_t r = recv(sv[0], buf + have, sizeof buf - have, 0);
        if (r <= 0) {
            struct pollfd p = {.fd = sv[0], .events = POLLIN};
            poll(&p, 1, 50);
            continue;
        }
        have += (size_t)r;
        size_t off = 0;
        while (have - off >= sizeof(wire_hdr)) {
            wire_hdr rh;
            memcpy(&rh, buf + off, sizeof rh);
            size_t need = sizeof rh + (rh.type == FR_READ_RESP ? rh.len : 0);
            if (have - off < need)
                break;
            got += rh.type == FR_READ_RESP;
            off += need;
        }
        memmove(buf, buf + off, have - off);
        have -= off;
    }
    CHECK_EQ(got, sent);
    close(sv[0]);
    t_close(b);
    free(mem);
    return 0;
}

/* A hostile target floods REVOKE frames and never reads our
 * acknowledgements: the initiator's queued acknowledgements are bounded the
 * same way, and it stops reading that target. */
static int test_revoke_flood_bounded(void)
{
    axf_config cfg = {.reply_queue_bytes = 128u << 10, .peer_timeout_ms = 20000};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, 5, 0, -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    long rss0 = rss_kib();
    wire_hdr h = {.magic = AXF_MAGIC, .type = FR_REVOKE, .rid = 77, .key = 88};
    long sent = flood(sv[1], &h, 2000000, 3000);
    long grown = rss_kib() - rss0;
    printf("  REVOKE flood: %ld went in, initiator RSS +%ld KiB\n", sent, grown);
    CHECK(sent < 60000);
    CHECK(grown < 32 * 1024);
    /* It is paused, not lost. */
    axf_stats s;
    axf_engine_stats(a->e, &s);
    CHECK_EQ(s.endpoints, 1);
    close(sv[1]);
    t_close(a);
    return 0;
}

/* Notifications the application has not released stop the receiver at
 * max_notify_per_conn; data behind them waits in the socket (the sender
 * blocks longer than peer_timeout: the receiver is alive and keeps sending
 * keepalives, so nobody is declared lost); releasing lets everything through
 * and nothing is dropped. */
static int test_notify_credit(void)
{
    axf_config cfg = {.max_notify_per_conn = 8, .keepalive_ms = 50, .peer_timeout_ms = 300,
                      .chunk_bytes = 4u << 20};
    tengine *a = t_engine(&cfg), *b = t_engine(&cfg);
    CHECK(a && b);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, 1, 0, -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 2, -1), AXF_OK);
    enum { N = 30, BIG = 8u << 20 };
    uint8_t *src = malloc(BIG), *dst = calloc(1, BIG);
    CHECK(src && dst);
    t_fill(src, BIG, 3);
    uint64_t arid, akey, brid, bkey;
    CHECK_EQ(axf_region_register(a->e, src, BIG, AXF_ACCESS_READ, -1, &arid, &akey), AXF_OK);
    CHECK_EQ(axf_region_register(b->e, dst, BIG, AXF_ACCESS_WRITE, -1, &brid, &bkey), AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, brid, bkey, BIG, AXF_ACCESS_WRITE, 0, -1), AXF_OK);
    for (uint64_t i = 0; i < N; i++) {
        char msg[16];
        int len = snprintf(msg, sizeof msg, "n%llu", (unsigned long long)i);
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_NOTIFY, NULL, 0, msg, (size_t)len, 100 + i, 0),
                 AXF_OK);
    }
    /* Data behind the notifications: more than the socket buffers hold. */
    axf_desc d = {.lrid = arid, .rrid = brid, .rkey = bkey, .len = BIG};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 999, 0), AXF_OK);
    int seen = 0;
    axf_completion c;
    while (t_wait_ex(b, AXF_CQ_NOTIFY, true, 0, &c, 400) == 0) {
        CHECK_EQ(c.tag, 2);
        axf_completion_free(&c);
        seen++;
    }
    CHECK_EQ(seen, 8); /* the credit, exactly: nothing more is read */
    /* Paused for several peer timeouts: nobody is lost. */
    usleep(1000 * 1000);
    CHECK(t_quiet(a, AXF_CQ_PEER_LOST, ep, 10));
    CHECK(t_quiet(b, AXF_CQ_CONN_CLOSED, 0, 10));
    axf_stats s;
    axf_engine_stats(b->e, &s);
    CHECK_EQ(s.conns, 1);
    /* Released as consumed: everything arrives, in order, none dropped. */
    while (seen < N) {
        axf_notify_release(b->e, 2, 8);
        int round = 0;
        while (round < 8 && seen < N && t_wait_ex(b, AXF_CQ_NOTIFY, true, 0, &c, 5000) == 0) {
            char want[16];
            int len = snprintf(want, sizeof want, "n%d", seen);
            CHECK_EQ(c.payload_len, len);
            CHECK(memcmp(c.payload, want, (size_t)len) == 0);
            axf_completion_free(&c);
            seen++;
            round++;
        }
        CHECK(round > 0);
    }
    axf_notify_release(b->e, 2, 8);
    for (uint64_t i = 0; i < N; i++) {
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, 100 + i, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 999, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(dst, src, BIG) == 0);
    t_close(a);
    t_close(b);
    free(src);
    free(dst);
    return 0;
}

static int test_max_conns(void)
{
    axf_config cfg = {.max_conns = 4};
    tengine *b = t_engine(&cfg);
    CHECK(b);
    int peers[5];
    for (int i = 0; i < 4; i++) {
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ(axf_accept_conn(b->e, sv[1], 10 + (uint64_t)i, -1), AXF_OK);
        peers[i] = sv[0];
    }
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 99, -1), AXF_E_LIMIT);
    peers[4] = sv[0];
    /* Refused means closed: the peer reads EOF. */
    char ch;
    struct pollfd p = {.fd = sv[0], .events = POLLIN};
    CHECK_EQ(poll(&p, 1, T_TIMEOUT_MS), 1);
    CHECK_EQ(read(sv[0], &ch, 1), 0);
    /* Dialled connections count too. */
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(b->e, AXF_EP_TCP, 1, 0, -1, &ep), AXF_OK);
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(b->e, ep, sv[0]), AXF_E_LIMIT);
    close(sv[1]);
    axf_stats s;
    axf_engine_stats(b->e, &s);
    CHECK_EQ(s.conns, 4);
    CHECK_EQ(s.conns_refused, 2);
    /* One leaves: room for one more. */
    close(peers[0]);
    axf_completion c;
    CHECK_EQ(t_wait_any(b, AXF_CQ_CONN_CLOSED, &c), 0);
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 50, -1), AXF_OK);
    peers[0] = sv[0];
    t_close(b);
    for (int i = 0; i < 5; i++)
        close(peers[i]);
    return 0;
}

/* A tcp peer (no pidfd) that keeps the connection up but never acknowledges
 * a revocation is disconnected after revoke_timeout_ms; then it cannot touch
 * our memory, and the region is freed. */
static int test_revoke_timeout_tcp(void)
{
    axf_config cfg = {.revoke_timeout_ms = 300, .keepalive_ms = 50, .peer_timeout_ms = 20000};
    tengine *b = t_engine(&cfg);
    CHECK(b);
    static uint8_t mem[4096];
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(b->e, mem, sizeof mem, AXF_ACCESS_READ, -1, &rid, &key), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 31, -1), AXF_OK);
    CHECK_EQ(axf_region_deregister(b->e, rid), AXF_OK);
    axf_stats s;
    axf_engine_stats(b->e, &s);
    CHECK_EQ(s.quarantined, 1);
    CHECK_EQ(s.quarantined_bytes, sizeof mem);
    uint64_t tags[4];
    CHECK_EQ(axf_region_holders(b->e, rid, tags, 4), 1);
    CHECK_EQ(tags[0], 31);
    /* The peer is alive (pings) and silent about the revocation. */
    wire_hdr ping = {.magic = AXF_MAGIC, .type = FR_PING};
    uint64_t start = t_now_ms();
    axf_completion c;
    bool freed = false;
    while (!freed && t_now_ms() - start < T_TIMEOUT_MS) {
        (void)send(sv[0], &ping, sizeof ping, MSG_NOSIGNAL | MSG_DONTWAIT);
        freed = t_wait_ex(b, AXF_CQ_REGION_FREED, false, rid, &c, 50) == 0;
    }
    CHECK(freed);
    CHECK_EQ(c.status, AXF_OK);
    uint64_t took = t_now_ms() - start;
    printf("  freed %llu ms after the revocation (bound 300 ms)\n", (unsigned long long)took);
    CHECK(took >= 250); /* not before the peer had its time */
    CHECK_EQ(t_wait_any(b, AXF_CQ_LOG, &c), 0);
    CHECK(memmem(c.payload, c.payload_len, "not acknowledged", 16) != NULL);
    axf_completion_free(&c);
    CHECK_EQ(axf_region_holders(b->e, rid, tags, 4), AXF_E_NOTFOUND);
    axf_engine_stats(b->e, &s);
    CHECK_EQ(s.quarantined, 0);
    close(sv[0]);
    t_close(b);
    return 0;
}

/* Our own pause (notification credit) keeps a tcp peer's acknowledgement of
 * a revocation unread: its revocation time does not run meanwhile, nobody
 * is disconnected, and the region is freed once we read again. */
static int test_revoke_timeout_waits_for_our_pause(void)
{
    axf_config cfg = {.revoke_timeout_ms = 200, .max_notify_per_conn = 2, .keepalive_ms = 50,
                      .peer_timeout_ms = 20000};
    tengine *a = t_engine(&cfg), *b = t_engine(&cfg);
    CHECK(a && b);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, 1, 0, -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], 2, -1), AXF_OK);
    static uint8_t mem[4096];
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(b->e, mem, sizeof mem, AXF_ACCESS_WRITE, -1, &rid, &key), AXF_OK);
    for (uint64_t i = 0; i < 4; i++)
        CHECK_EQ(axf_post(a->e, ep, AXF_OP_NOTIFY, NULL, 0, "x", 1, 10 + i, 0), AXF_OK);
    axf_completion c;
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(t_wait_any(b, AXF_CQ_NOTIFY, &c), 0);
        axf_completion_free(&c);
    }
    usleep(100 * 1000); /* b's receiver is paused now */
    CHECK_EQ(axf_region_deregister(b->e, rid), AXF_OK);
    CHECK(t_quiet(b, AXF_CQ_REGION_FREED, rid, 800)); /* 4 revocation timeouts */
    CHECK(t_quiet(b, AXF_CQ_CONN_CLOSED, 0, 1));
    axf_stats s;
    axf_engine_stats(b->e, &s);
    CHECK_EQ(s.conns, 1);
    CHECK_EQ(s.quarantined, 1);
    axf_notify_release(b->e, 2, 2); /* the two behind: read, then paused again */
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(t_wait_any(b, AXF_CQ_NOTIFY, &c), 0);
        axf_completion_free(&c);
    }
    axf_notify_release(b->e, 2, 2); /* now the acknowledgement behind them */
    CHECK_EQ(t_wait(b, AXF_CQ_REGION_FREED, rid, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    axf_engine_stats(b->e, &s);
    CHECK_EQ(s.conns, 1);
    t_close(a);
    t_close(b);
    return 0;
}

/* A WRITE_ACK claiming a terabyte for a 16-byte write: the completion, the
 * engine's byte count (and so every rate estimate) say 16. */
static int test_nbytes_are_ours(void)
{
    tengine *a = t_engine(NULL);
    CHECK(a);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, 1, 0, -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    static uint8_t src[16];
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(a->e, src, sizeof src, AXF_ACCESS_READ, -1, &rid, &key), AXF_OK);
    CHECK_EQ(axf_endpoint_import(a->e, ep, 5, 6, 1 << 20, AXF_ACCESS_WRITE, 0, -1), AXF_OK);
    axf_desc d = {.lrid = rid, .rrid = 5, .rkey = 6, .len = 16};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 42, 0), AXF_OK);
    wire_hdr h;
    uint8_t payload[16];
    do {
        CHECK_EQ(read(sv[1], &h, sizeof h), (ssize_t)sizeof h);
    } while (h.type == FR_PING);
    CHECK_EQ(h.type, FR_WRITE);
    CHECK_EQ(h.len, 16);
    CHECK_EQ(read(sv[1], payload, 16), 16);
    wire_hdr ack = {.magic = AXF_MAGIC, .type = FR_WRITE_ACK, .op = h.op, .len = 1ull << 40};
    CHECK_EQ(write(sv[1], &ack, sizeof ack), (ssize_t)sizeof ack);
    axf_completion c;
    CHECK_EQ(t_wait(a, AXF_CQ_XFER, 42, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, 16);
    axf_stats s;
    axf_engine_stats(a->e, &s);
    CHECK_EQ(s.bytes, 16);
    close(sv[1]);
    t_close(a);
    return 0;
}

/* Many peers come and go: a tcp one (its connection dies), and a same-host
 * one with a sealed memfd pool mapped here (its endpoint closed). What they
 * held is freed: the maps count and RSS end near where they started.
 * AXF_CHURN sets the cycle count (default 2000). */
static int test_churn_leaves_nothing(void)
{
    const char *env = getenv("AXF_CHURN");
    long cycles = env ? strtol(env, NULL, 10) : 2000;
    axf_config cfg = {.keepalive_ms = 1000, .peer_timeout_ms = 5000};
    tengine *a = t_engine(&cfg), *b = t_engine(&cfg);
    CHECK(a && b);
    enum { POOL = 256u << 10 };
    int mfd = memfd_create("axf-churn", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(mfd >= 0);
    CHECK_EQ(ftruncate(mfd, POOL), 0);
    CHECK_EQ(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
    long maps0 = -1, rss0 = -1;
    for (long i = 0; i < cycles; i++) {
        if (i == cycles / 10) { /* warmed up: arenas, thread stacks, the ring */
            t_drain(a);
            t_drain(b);
            maps0 = maps_count();
            rss0 = rss_kib();
        }
        /* tcp peer: connects, then dies. */
        int sv[2];
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        uint64_t ep;
        CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, (uint64_t)i, 0, -1, &ep), AXF_OK);
        CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
        close(sv[1]);
        axf_completion c;
        CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep, &c), 0);
        if (i % 2)
            CHECK_EQ(axf_endpoint_close(a->e, ep), AXF_OK); /* closed after the loss, or not */
        /* same-host peer: a mapped pool, a connection, then closed. */
        CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_SHM, (uint64_t)i, getpid(), pidfd_self(), &ep),
                 AXF_OK);
        CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
        CHECK_EQ(axf_accept_conn(b->e, sv[1], (uint64_t)i, pidfd_self()), AXF_OK);
        CHECK_EQ(axf_endpoint_import(a->e, ep, 1, 2, POOL, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                                     mfd),
                 AXF_OK);
        CHECK_EQ(axf_endpoint_close(a->e, ep), AXF_OK);
        CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep, &c), 0);
        CHECK_EQ(t_wait_any(b, AXF_CQ_CONN_CLOSED, &c), 0);
        if (a->n > T_BACKLOG / 2) /* logs and the like: not what is measured */
            for (size_t k = 0; k < a->n; k++)
                axf_completion_free(&a->q[k]);
        if (a->n > T_BACKLOG / 2)
            a->n = 0;
    }
    /* The last ones are freed by the watcher: give it a moment. */
    axf_stats sa, sb;
    uint64_t end = t_now_ms() + T_TIMEOUT_MS;
    long maps1, rss1;
    do {
        usleep(20000);
        axf_engine_stats(a->e, &sa);
        axf_engine_stats(b->e, &sb);
        maps1 = maps_count();
        rss1 = rss_kib();
    } while ((sa.conns || sb.conns || maps1 > maps0 + 16) && t_now_ms() < end);
    printf("  %ld cycles: /proc/self/maps %ld -> %ld lines, RSS %ld -> %ld KiB\n", cycles, maps0,
           maps1, rss0, rss1);
    CHECK_EQ(sa.endpoints, 0);
    CHECK_EQ(sa.conns, 0);
    CHECK_EQ(sb.conns, 0);
    CHECK_EQ(sb.held_conns, 0);
    CHECK(maps1 <= maps0 + 16);
#ifndef T_ASAN /* ASan's quarantine keeps freed memory resident */
    CHECK(rss1 - rss0 < 24 * 1024);
#endif
    close(mfd);
    t_close(a);
    t_close(b);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_reply_queue_bounded),
        T_CASE(test_revoke_flood_bounded),
        T_CASE(test_notify_credit),
        T_CASE(test_max_conns),
        T_CASE(test_revoke_timeout_tcp),
        T_CASE(test_revoke_timeout_waits_for_our_pause),
        T_CASE(test_nbytes_are_ours),
        T_CASE(test_churn_leaves_nothing),
    };
    return T_RUN(argc, argv, cases);
}

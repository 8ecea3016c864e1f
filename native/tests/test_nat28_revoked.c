/* Revoked memory and connections that die with frames still queued (nat28).
 *
 * A target connection killed for any reason but our goodbye (a revocation's
 * deadline, our sender's EPIPE) still reads and serves the frames queued in
 * its socket before it died, until EOF (rx_after_bye: a same-host peer's
 * FR_BYE may be among them). The question left by bye26: can one of those
 * frames, or one that arrived after a region's revocation began, read or
 * write that region's memory, or write it after the owner was told it may
 * reuse it (AXF_CQ_REGION_FREED)? Every access is looked up (region_get:
 * a revoked or deregistered region is not found) and holds a reference for
 * as long as it touches the memory, and the connection's revocation settles
 * only once its threads left (revokes_drop). These cases pin that down with
 * a raw peer over real sockets:
 *
 * - frames queued behind a paused receiver, served after the connection died
 *   (our sender's EPIPE): the revoked region's are refused, a live region's
 *   served (so the path that serves after death did run);
 * - a WRITE admitted before the revocation, its payload still arriving when
 *   the revocation's deadline kills the connection (AF_UNIX and loopback
 *   TCP): the region is freed only after the last byte of it landed, and
 *   nothing lands after that.
 */
#include "harness.h"

#include "internal.h" /* wire layout, for the raw peer */

#include <fcntl.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#define O_TAG 28
#define REG 4096
#define BIG (1u << 20)

/* Writes all of buf (blocking); false on an error. */
static bool put(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* The next frame (and its payload, dropped) of one of the types wanted:
 * pings and revocations, which this hostile peer ignores, are skipped. */
static int next_frame(int fd, uint16_t type, wire_hdr *out)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        CHECK_EQ(poll(&p, 1, T_TIMEOUT_MS), 1);
        CHECK_EQ(recv(fd, out, sizeof *out, MSG_WAITALL), (ssize_t)sizeof *out);
        CHECK_EQ(out->magic, AXF_MAGIC);
        if (out->type == type)
            return 0;
        CHECK(out->type == FR_PING || out->type == FR_REVOKE);
    }
}

static int log_has(tengine *t, const char *what)
{
    for (int i = 0; i < 8; i++) {
        axf_completion lg;
        if (t_wait_ex(t, AXF_CQ_LOG, true, 0, &lg, 2000) != 0)
            return 0;
        bool hit = strstr((const char *)lg.payload, what) != NULL;
        fprintf(stderr, "log: %s\n", (const char *)lg.payload);
        axf_completion_free(&lg);
        if (hit)
            return 1;
    }
    return 0;
}

/* The owner's receiver is paused (a notification not released, at
 * max_notify_per_conn 1) while the peer queues frames for the region being
 * revoked and for a live one; the connection then dies (the peer shut its
 * reading side: our sender's next frame, the revocation, fails). Its
 * receiver wakes, reads on and serves the queued frames: the revoked
 * region's WRITE, WRITEV and READ are refused, the live one's WRITE lands. */
static int test_queued_after_death_refused(void)
{
    axf_config cfg = {.max_notify_per_conn = 1, .revoke_timeout_ms = 300};
    tengine *o = t_engine(&cfg);
    CHECK(o);
    static uint8_t r[REG], s[REG];
    memset(r, 0x11, sizeof r);
    memset(s, 0x22, sizeof s);
    uint64_t rid, rkey, sid, skey;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(o->e, r, sizeof r, rw, -1, &rid, &rkey), AXF_OK);
    CHECK_EQ(axf_region_register(o->e, s, sizeof s, rw, -1, &sid, &skey), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(o->e, sv[1], O_TAG, -1), AXF_OK);
    int fd = sv[0];

    /* One notification the owner does not release: its receiver pauses
     * before the next frame. */
    wire_hdr nh = {.magic = AXF_MAGIC, .type = FR_NOTIFY, .op = 1, .len = 4};
    uint8_t nf[sizeof nh + 4];
    memcpy(nf, &nh, sizeof nh);
    memcpy(nf + sizeof nh, "note", 4);
    CHECK(put(fd, nf, sizeof nf));
    axf_completion c;
    CHECK_EQ(t_wait_any(o, AXF_CQ_NOTIFY, &c), 0);
    axf_completion_free(&c);
    wire_hdr ack;
    if (next_frame(fd, FR_NOTIFY_ACK, &ack))
        return 1;

    /* Queued behind the pause: a WRITE, a WRITEV (a live segment first, the
     * revoked one second), a READ and a READV of r, then a WRITE of s. */
    uint8_t q[4096];
    size_t n = 0;
    wire_hdr h = {.magic = AXF_MAGIC, .type = FR_WRITE, .flags = FL_LAST, .op = 10, .rid = rid,
                  .key = rkey, .off = 8, .len = 4};
    memcpy(q + n, &h, sizeof h);
    memcpy(q + n + sizeof h, "EVIL", 4);
    n += sizeof h + 4;
    h = (wire_hdr){.magic = AXF_MAGIC, .type = FR_WRITEV, .flags = FL_LAST, .op = 11, .nseg = 2,
                   .len = 8};
    wire_seg sg[2] = {{.index = 0, .rid = sid, .key = skey, .off = 100, .len = 4},
                      {.index = 1, .rid = rid, .key = rkey, .off = 100, .len = 4}};
    memcpy(q + n, &h, sizeof h);
    memcpy(q + n + sizeof h, sg, sizeof sg);
    memcpy(q + n + sizeof h + sizeof sg, "evilEVIL", 8);
    n += sizeof h + sizeof sg + 8;
    h = (wire_hdr){.magic = AXF_MAGIC, .type = FR_READ_REQ, .flags = FL_LAST, .op = 12,
                   .rid = rid, .key = rkey, .len = 64};
    memcpy(q + n, &h, sizeof h);
    n += sizeof h;
    h = (wire_hdr){.magic = AXF_MAGIC, .type = FR_READV, .flags = FL_LAST, .op = 13, .nseg = 1,
                   .len = 64};
    wire_seg rs = {.index = 0, .rid = rid, .key = rkey, .off = 0, .len = 64};
    memcpy(q + n, &h, sizeof h);
    memcpy(q + n + sizeof h, &rs, sizeof rs);
    n += sizeof h + sizeof rs;
    h = (wire_hdr){.magic = AXF_MAGIC, .type = FR_WRITE, .flags = FL_LAST, .op = 14, .rid = sid,
                   .key = skey, .off = 0, .len = 4};
    memcpy(q + n, &h, sizeof h);
    memcpy(q + n + sizeof h, "SAFE", 4);
    n += sizeof h + 4;
    CHECK(put(fd, q, n));
    usleep(50 * 1000);
    CHECK(t_all(s, sizeof s, 0x22)); /* nothing of it served yet: paused */

    /* The peer stops reading; the revocation's frame then fails to go and
     * the connection dies with the frames still queued. */
    CHECK_EQ(shutdown(fd, SHUT_RD), 0);
    CHECK_EQ(axf_region_revoke(o->e, rid), AXF_OK);
    CHECK_EQ(t_wait_any(o, AXF_CQ_CONN_CLOSED, &c), 0);
    CHECK_EQ(c.tag, O_TAG);
    /* The queued frames were served after the death (s's WRITE landed) and
     * none of r's touched it. */
    CHECK(memcmp(s, "SAFE", 4) == 0);
    CHECK(t_all(r, sizeof r, 0x11));
    CHECK(t_all(s + 100, 4, 0x22)); /* the WRITEV failed whole: its live segment unwritten */
    CHECK_EQ(axf_region_deregister(o->e, rid), AXF_OK);
    CHECK_EQ(t_wait(o, AXF_CQ_REGION_FREED, rid, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(t_all(r, sizeof r, 0x11));
    close(fd);
    t_close(o);
    return 0;
}

/* A connected pair: fds[0] the peer's, fds[1] the owner's; over loopback TCP
 * when tcp, else AF_UNIX. Small buffers, so that the peer's writes wait for
 * the owner's reads. */
static int pair(bool tcp, int fds[2])
{
    if (!tcp)
        return socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds);
    const t_tcp_opts small = {.a_sndbuf = 64 * 1024};
    return t_tcp_pair_opts(&fds[0], &fds[1], &small);
}

/* Waits until region bytes [0, n) hold the peer's pattern. */
static bool landed(const uint8_t *r, const uint8_t *want, size_t n)
{
    /* Watched while the receiver writes it: a target has no completion for
     * a peer's WRITE to wait for. */
    t_racy(r, n, "a peer's WRITE watched landing");
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (t_now_ms() < until) {
        if (memcmp(r, want, n) == 0)
            return true;
        usleep(1000);
    }
    return false;
}

/* A WRITE to r admitted before r's revocation (its header read, r held)
 * whose payload the peer sends slowly: r is revoked and deregistered, the
 * peer never acknowledges, and the revocation's deadline kills the
 * connection mid-payload. What was sent before the kill lands (the access
 * was granted before the revocation, and it holds r); AXF_CQ_REGION_FREED
 * comes only after the connection ended, with those bytes in r; the owner
 * then reuses r, and what the peer sends after that never reaches it. */
static int deadline_mid_write(bool tcp)
{
    axf_config cfg = {.revoke_timeout_ms = 1000, .target_poll_us = UINT32_MAX};
    tengine *o = t_engine(&cfg);
    CHECK(o);
    uint8_t *r = malloc(BIG), *pat = malloc(BIG);
    CHECK(r && pat);
    memset(r, 0x11, BIG);
    t_fill(pat, BIG, 28);
    uint64_t rid, rkey;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(o->e, r, BIG, rw, -1, &rid, &rkey), AXF_OK);
    int fds[2];
    CHECK_EQ(pair(tcp, fds), 0);
    CHECK_EQ(axf_accept_conn(o->e, fds[1], O_TAG, -1), AXF_OK);
    int fd = fds[0];

    wire_hdr h = {.magic = AXF_MAGIC, .type = FR_WRITE, .flags = FL_LAST, .op = 1, .rid = rid,
                  .key = rkey, .off = 0, .len = BIG};
    CHECK(put(fd, &h, sizeof h));
    CHECK(put(fd, pat, BIG / 2));
    CHECK(landed(r, pat, BIG / 2)); /* the receiver waits inside the payload */

    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_region_revoke(o->e, rid), AXF_OK);
    CHECK_EQ(axf_region_deregister(o->e, rid), AXF_OK);
    axf_stats st;
    axf_engine_stats(o->e, &st);
    CHECK_EQ(st.quarantined, 1);
    /* More of the admitted payload: it lands (r is held), and r is not
     * freed under it. */
    CHECK(put(fd, pat + BIG / 2, BIG / 4));
    CHECK(landed(r, pat, BIG / 2 + BIG / 4));
    CHECK(t_quiet(o, AXF_CQ_REGION_FREED, rid, 100));

    /* No acknowledgement: the deadline kills the connection. */
    axf_completion c;
    CHECK_EQ(t_wait(o, AXF_CQ_REGION_FREED, rid, &c), 0);
    uint64_t took = t_now_ms() - t0;
    fprintf(stderr, "%s: region freed %" PRIu64 " ms after its revocation\n", tcp ? "tcp" : "unix",
            took);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(took >= 950);
    CHECK(memcmp(r, pat, BIG / 2 + BIG / 4) == 0);
    CHECK(t_all(r + BIG / 2 + BIG / 4, BIG / 4, 0x11));
    CHECK(log_has(o, "not acknowledged"));
    /* The owner's again: reused. The rest of the payload, and a new WRITE
     * with the old key, never reach it. */
    memset(r, 0x5a, BIG);
    (void)put(fd, pat + BIG / 2 + BIG / 4, BIG / 4);
    h.op = 2;
    h.len = 4;
    (void)put(fd, &h, sizeof h);
    (void)put(fd, "EVIL", 4);
    usleep(100 * 1000);
    CHECK(t_all(r, BIG, 0x5a));
    close(fd);
    t_close(o);
    free(r);
    free(pat);
    return 0;
}

static int test_deadline_mid_write_unix(void) { return deadline_mid_write(false); }
static int test_deadline_mid_write_tcp(void) { return deadline_mid_write(true); }

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_queued_after_death_refused),
        T_CASE(test_deadline_mid_write_unix),
        T_CASE(test_deadline_mid_write_tcp),
    };
    return T_RUN(argc, argv, cases);
}

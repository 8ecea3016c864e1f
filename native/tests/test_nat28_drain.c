/* After our goodbye, a peer's word that lets go of our memory is still
 * heard (nat28).
 *
 * A target connection that said its goodbye (conn_say_bye: at the engine's
 * shutdown for every accepted connection, at bye_network for network
 * peers) reads and drops what the peer sends (rx_drain): nothing is served.
 * Before, that included the peer's REVOKE_ACK and BYE, which serve nothing
 * and only let go of our memory. For a same-host peer (a pidfd: we wait for
 * its acknowledgement, its goodbye or its exit) such a word queued when our
 * goodbye went out was lost, and the shutdown gave the region up
 * (AXF_CQ_REGION_FREED with AXF_E_CLOSED: the owner must never reuse that
 * memory) although the peer had let go of it. Now the drain follows the
 * frames by their headers' lengths and takes those two; everything else is
 * still dropped (a WRITE queued before them never lands).
 *
 * The peer's word is queued behind a paused receiver (a notification not
 * released, max_notify_per_conn 1) when the shutdown says goodbye. The
 * peer is this process (its pidfd: it never exits during the test). */
#include "harness.h"

#include "internal.h" /* wire layout, for the raw peer */

#include <sys/syscall.h>

#define O_TAG 28

static bool put(int fd, const void *buf, size_t n)
{
    return send(fd, buf, n, MSG_NOSIGNAL) == (ssize_t)n;
}

static int next_frame(int fd, uint16_t type, wire_hdr *out)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        CHECK_EQ(poll(&p, 1, T_TIMEOUT_MS), 1);
        CHECK_EQ(recv(fd, out, sizeof *out, MSG_WAITALL), (ssize_t)sizeof *out);
        CHECK_EQ(out->magic, AXF_MAGIC);
        if (out->type == type)
            return 0;
        CHECK(out->type == FR_PING);
    }
}

/* word: FR_REVOKE_ACK or FR_BYE, queued after a WRITE of region s, both
 * behind the paused receiver, when the engine shuts down. broken: a header
 * with a bad magic between them ends the framing: the word is read raw and
 * dropped (the region given up, as before). */
static int word_after_goodbye(uint16_t word, bool broken)
{
    axf_config cfg = {.max_notify_per_conn = 1};
    tengine *o = t_engine(&cfg);
    CHECK(o);
    static uint8_t r[4096], s[4096];
    memset(r, 0x11, sizeof r);
    memset(s, 0x22, sizeof s);
    uint64_t rid, rkey, sid, skey;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(o->e, r, sizeof r, rw, -1, &rid, &rkey), AXF_OK);
    CHECK_EQ(axf_region_register(o->e, s, sizeof s, rw, -1, &sid, &skey), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    int pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    CHECK(pidfd >= 0);
    CHECK_EQ(axf_accept_conn(o->e, sv[1], O_TAG, pidfd), AXF_OK); /* a same-host peer */
    int fd = sv[0];

    wire_hdr nh = {.magic = AXF_MAGIC, .type = FR_NOTIFY, .op = 1, .len = 4};
    uint8_t nf[sizeof nh + 4];
    memcpy(nf, &nh, sizeof nh);
    memcpy(nf + sizeof nh, "note", 4);
    CHECK(put(fd, nf, sizeof nf));
    axf_completion c;
    CHECK_EQ(t_wait_any(o, AXF_CQ_NOTIFY, &c), 0); /* not released: the receiver pauses */
    axf_completion_free(&c);
    wire_hdr h;
    if (next_frame(fd, FR_NOTIFY_ACK, &h))
        return 1;

    CHECK_EQ(axf_region_deregister(o->e, rid), AXF_OK);
    if (next_frame(fd, FR_REVOKE, &h))
        return 1;
    CHECK_EQ(h.rid, rid);
    /* Queued behind the pause: a WRITE of s whose payload is a BYE header
     * (framing: it is skipped as payload, not taken as a frame), then the
     * word. */
    uint8_t q[4 * sizeof(wire_hdr)];
    size_t n = 0;
    wire_hdr wh = {.magic = AXF_MAGIC, .type = FR_WRITE, .flags = FL_LAST, .op = 2, .rid = sid,
                   .key = skey, .len = sizeof(wire_hdr)};
    wire_hdr fake = {.magic = AXF_MAGIC, .type = FR_BYE};
    wire_hdr bad = {.magic = AXF_MAGIC ^ 1, .type = FR_PING};
    wire_hdr wd = {.magic = AXF_MAGIC, .type = word, .rid = rid};
    memcpy(q + n, &wh, sizeof wh);
    n += sizeof wh;
    memcpy(q + n, &fake, sizeof fake);
    n += sizeof fake;
    if (broken) {
        memcpy(q + n, &bad, sizeof bad);
        n += sizeof bad;
    }
    memcpy(q + n, &wd, sizeof wd);
    n += sizeof wd;
    CHECK(put(fd, q, n));
    usleep(50 * 1000);
    axf_stats st;
    axf_engine_stats(o->e, &st);
    CHECK_EQ(st.quarantined, 1); /* not read yet */

    axf_engine_shutdown(o->e); /* our goodbye, then the connection is cut */
    CHECK_EQ(t_wait(o, AXF_CQ_REGION_FREED, rid, &c), 0);
    fprintf(stderr, "%s after the goodbye: region freed with status %d\n",
            word == FR_BYE ? "BYE" : "REVOKE_ACK", c.status);
    CHECK_EQ(c.status, broken ? AXF_E_CLOSED : AXF_OK); /* before: AXF_E_CLOSED, given up */
    CHECK(t_all(s, sizeof s, 0x22)); /* the WRITE was not served */
    /* What the peer got: our goodbye, then EOF. */
    if (next_frame(fd, FR_PING, &h))
        return 1;
    CHECK(h.flags & FL_BYE);
    close(fd);
    t_close(o);
    return 0;
}

static int test_revoke_ack_after_goodbye(void) { return word_after_goodbye(FR_REVOKE_ACK, false); }
static int test_bye_after_goodbye(void) { return word_after_goodbye(FR_BYE, false); }
static int test_broken_framing_drops_the_rest(void) { return word_after_goodbye(FR_BYE, true); }

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_revoke_ack_after_goodbye),
        T_CASE(test_bye_after_goodbye),
        T_CASE(test_broken_framing_drops_the_rest),
    };
    return T_RUN(argc, argv, cases);
}

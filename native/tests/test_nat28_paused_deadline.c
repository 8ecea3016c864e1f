/* A peer that keeps our receiver paused does not stop a revocation's
 * deadline (nat28 lead).
 *
 * The watcher counts a tcp peer's revocation deadline only while we read
 * its connection: paused for backpressure, its acknowledgement may wait
 * unread in the socket. A peer that makes us pause by not reading our
 * replies (READ requests whose responses it takes at a trickle, enough to
 * keep our blocked sender from timing out) so held the revocation, and the
 * region's quarantine, for as long as it liked: over verbs also its queue
 * pairs, and so its access to the revoked memory (SECURITY.md: disconnected
 * after revoke_timeout). Paused because the peer does not take our replies
 * is the peer's doing: the deadline runs. */
#include "harness.h"

#include "internal.h" /* wire layout, for the raw peer */

#include <sys/socket.h>

#define O_TAG 28
#define RESP (64u * 1024)
#define NREQ 128

static int test_trickle_reader_revocation_deadline(void)
{
    axf_config cfg = {.revoke_timeout_ms = 300, .reply_queue_bytes = 256 * 1024};
    tengine *o = t_engine(&cfg);
    CHECK(o);
    static uint8_t r[4096], s[RESP];
    uint64_t rid, rkey, sid, skey;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(o->e, r, sizeof r, rw, -1, &rid, &rkey), AXF_OK);
    CHECK_EQ(axf_region_register(o->e, s, sizeof s, AXF_ACCESS_READ, -1, &sid, &skey), AXF_OK);
    int fds[2];
    const t_tcp_opts small = {.a_rcvbuf = 64 * 1024}; /* the peer's: it reads at a trickle */
    CHECK_EQ(t_tcp_pair_opts(&fds[0], &fds[1], &small), 0); /* the peer's, the owner's */
    CHECK_EQ(axf_accept_conn(o->e, fds[1], O_TAG, -1), AXF_OK);
    int fd = fds[0];
    static wire_hdr q[NREQ];
    for (int i = 0; i < NREQ; i++)
        q[i] = (wire_hdr){.magic = AXF_MAGIC, .type = FR_READ_REQ, .flags = FL_LAST,
                          .op = (uint64_t)i + 1, .rid = sid, .key = skey, .len = RESP};
    CHECK_EQ(send(fd, q, sizeof q, 0), (ssize_t)sizeof q);
    usleep(200 * 1000); /* our replies fill the socket and the reply queue: paused */
    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_region_revoke(o->e, rid), AXF_OK);
    /* The trickle: 64 KiB every 100 ms, for 2 s (revoke_timeout 300 ms). */
    static uint8_t sink[RESP];
    bool closed = false;
    axf_completion c;
    while (t_now_ms() - t0 < 2000 && !closed) {
        (void)recv(fd, sink, sizeof sink, MSG_DONTWAIT);
        closed = t_wait_ex(o, AXF_CQ_CONN_CLOSED, true, 0, &c, 100) == 0;
    }
    uint64_t took = t_now_ms() - t0;
    axf_stats st;
    axf_engine_stats(o->e, &st);
    fprintf(stderr, "connection %s after %" PRIu64 " ms; quarantined %" PRIu64 "\n",
            closed ? "closed" : "still up", took, (uint64_t)st.quarantined);
    CHECK(closed); /* before: still up at 2 s, the region quarantined */
    CHECK(took < 1500);
    CHECK_EQ(st.quarantined, 0);
    close(fd);
    t_close(o);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_trickle_reader_revocation_deadline),
    };
    return T_RUN(argc, argv, cases);
}

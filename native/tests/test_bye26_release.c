/* A same-host peer's goodbye (FR_BYE: "I unmapped all of yours") must be
 * read even when our side of the connection died first (bye26).
 *
 * rev24 made a target connection that is down drop whatever the peer still
 * sends (rx_drain), to serve nothing after our goodbye. It did so for any
 * dead target connection, not only after our goodbye: a connection killed
 * any other way (our sender's EPIPE: the peer closed as we sent it a
 * revocation) then threw away the peer's FR_BYE still queued in the socket.
 * For a same-host peer (a pidfd) that goodbye is the only thing besides its
 * process's exit that says it let go of our memory: its revocations were
 * held, and an agent whose process also runs the peer (aioxfer.nixl's
 * loopback to itself, two agents in one process) waited close_timeout (10 s)
 * in release_all, then quarantined the region (tests/test_nixl_faults'
 * churn test teardown, tests/test_compat16_nixl's factory test: +10 s in
 * every run of the two files with rev24). Before rev24 (and after this fix)
 * a dead connection's receiver still serves what is queued until EOF.
 *
 * Made deterministic with the notification credit: o's receiver is paused
 * (max_notify_per_conn) with the peer's next notification and its goodbye
 * queued behind; the peer closes; o's revocation then meets EPIPE and kills
 * the connection before its receiver reads on. */
#include "harness.h"

#include <sys/syscall.h>

static int pidfd_self(void)
{
    return (int)syscall(SYS_pidfd_open, getpid(), 0);
}

static uint64_t conns_of(tengine *t)
{
    axf_stats s;
    axf_engine_stats(t->e, &s);
    return s.conns;
}

static int test_same_host_goodbye_read_after_our_side_died(void)
{
    axf_config oc = {.max_notify_per_conn = 1, .revoke_timeout_ms = 60000,
                     .peer_timeout_ms = 60000};
    tengine *o = t_engine(&oc), *p = t_engine(NULL);
    CHECK(o && p);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(p->e, AXF_EP_SHM, 21, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(p->e, ep, sv[0]), AXF_OK);
    int pidfd = pidfd_self();
    CHECK(pidfd >= 0);
    CHECK_EQ(axf_accept_conn(o->e, sv[1], 22, pidfd), AXF_OK); /* same host: held by a pidfd */
    static uint8_t mem[4096];
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(o->e, mem, sizeof mem, AXF_ACCESS_WRITE, -1, &rid, &key),
             AXF_OK);
    /* Two notifications: o takes the first and, its credit spent, pauses
     * with the second in the socket. */
    CHECK_EQ(axf_post(p->e, ep, AXF_OP_NOTIFY, NULL, 0, "a", 1, 1, 0), AXF_OK);
    CHECK_EQ(axf_post(p->e, ep, AXF_OP_NOTIFY, NULL, 0, "b", 1, 2, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait_any(o, AXF_CQ_NOTIFY, &c), 0);
    axf_completion_free(&c);
    usleep(100 * 1000); /* o's receiver is paused now */
    /* p leaves cleanly: its goodbye (FR_BYE) queued behind the second
     * notification, then its socket closed. */
    CHECK_EQ(axf_endpoint_close(p->e, ep), AXF_OK);
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (conns_of(p) && t_now_ms() < until)
        usleep(1000);
    CHECK_EQ(conns_of(p), 0);
    usleep(50 * 1000);
    /* o deregisters: its revocation meets the closed socket (EPIPE) and
     * kills the connection while its receiver is still paused. */
    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_region_deregister(o->e, rid), AXF_OK);
    /* The goodbye behind the notification is still read: the region is
     * released now, not at the exit of this process (before: never). */
    int r = t_wait_ex(o, AXF_CQ_REGION_FREED, false, rid, &c, 3000);
    fprintf(stderr, "region freed: %s after %" PRIu64 " ms\n", r == 0 ? "yes" : "no",
            t_now_ms() - t0);
    CHECK_EQ(r, 0);
    CHECK_EQ(c.status, AXF_OK);
    axf_stats s;
    axf_engine_stats(o->e, &s);
    CHECK_EQ(s.quarantined, 0);
    t_close(o);
    t_close(p);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_same_host_goodbye_read_after_our_side_died),
    };
    return T_RUN(argc, argv, cases);
}

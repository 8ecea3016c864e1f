/* The owed goodbye (nat24): axf_engine_bye_network ends a network peer's
 * accepted connection with a goodbye even when that connection's sender is
 * in the middle of a frame for longer than the close's grace (min(peer
 * timeout, 1 s)). Before, the goodbye was skipped at the grace's end and the
 * connection cut mid-frame: the peer saw a loss (AXF_CQ_PEER_LOST
 * fail_index 0), not a close. Now the goodbye is owed, and the sender says it
 * as soon as its frame is out.
 *
 * The sender is held deterministically by a relay between the two engines
 * (a thread copying bytes between two socket pairs) that stops taking the
 * target's bytes for longer than the grace: the target's READ response fills
 * the socket buffers and its sender blocks in sendmsg, as over a slow link. */
#include "harness.h"


#define REG (1u << 20)

typedef struct pair {
    tengine *o, *p;
    uint64_t p_ep;
    uint8_t *r, *x;
    uint64_t rid, rkey, xid, xkey;
    t_relay rl;
} pair;

/* p dials o through the relay; o's region r imported by p. */
static int pair_open(pair *d)
{
    memset(d, 0, sizeof *d);
    d->o = t_engine(NULL);
    d->p = t_engine(NULL);
    CHECK(d->o && d->p);
    int a[2], b[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a), 0);
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, b), 0);
    if (t_relay_start(&d->rl, a[0], b[1]))
        return 1;
    CHECK_EQ(axf_endpoint_create(d->p->e, AXF_EP_TCP, 2, 0, -1, &d->p_ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(d->p->e, d->p_ep, b[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(d->o->e, a[1], 31, -1), AXF_OK); /* no pidfd: a network peer */
    d->r = malloc(REG);
    d->x = calloc(1, REG);
    CHECK(d->r && d->x);
    t_fill(d->r, REG, 7);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(d->o->e, d->r, REG, rw, -1, &d->rid, &d->rkey), AXF_OK);
    CHECK_EQ(axf_region_register(d->p->e, d->x, REG, rw, -1, &d->xid, &d->xkey), AXF_OK);
    CHECK_EQ(axf_endpoint_import(d->p->e, d->p_ep, d->rid, d->rkey, REG, rw, 0, -1), AXF_OK);
    /* One small READ first: the connection works end to end. */
    axf_desc rd = {.lrid = d->xid, .rrid = d->rid, .rkey = d->rkey, .len = 4096};
    CHECK_EQ(axf_post(d->p->e, d->p_ep, AXF_OP_READ, &rd, 1, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(d->p, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    return 0;
}

static void pair_close(pair *d)
{
    atomic_store(&d->rl.hold, false);
    t_close(d->o);
    t_close(d->p);
    t_relay_stop(&d->rl);
    free(d->r);
    free(d->x);
}

/* Holds o's bytes, posts a 1 MiB READ from p, and waits until o's response
 * filled the relay's side (o's sender is then blocked mid-frame). */
static int read_held(pair *d, uint64_t req)
{
    atomic_store(&d->rl.hold, true);
    axf_desc rd = {.lrid = d->xid, .rrid = d->rid, .rkey = d->rkey, .len = REG};
    CHECK_EQ(axf_post(d->p->e, d->p_ep, AXF_OP_READ, &rd, 1, NULL, 0, req, 0), AXF_OK);
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    int queued = 0;
    while (t_now_ms() < until) {
        queued = t_relay_queued(&d->rl);
        CHECK(queued >= 0);
        if (queued >= 64 * 1024)
            break;
        usleep(1000);
    }
    CHECK(queued >= 64 * 1024);
    usleep(50 * 1000); /* and stays full: the sender waits for room */
    return 0;
}

typedef struct releaser {
    t_relay *rl;
    unsigned ms;
    pthread_t t;
} releaser;

static void *release_main(void *arg)
{
    releaser *q = arg;
    usleep(q->ms * 1000u);
    atomic_store(&q->rl->hold, false);
    return NULL;
}

/* The sender holds the connection past the grace (1 s: the default peer
 * timeout is 5 s), then the peer reads again: it gets the frame, then the
 * goodbye, and reports the endpoint closed (fail_index 1), not lost. */
static int test_goodbye_owed_by_a_busy_sender(void)
{
    pair d;
    if (pair_open(&d))
        return 1;
    if (read_held(&d, 10))
        return 1;
    releaser q = {.rl = &d.rl, .ms = 1600};
    CHECK_EQ(pthread_create(&q.t, NULL, release_main, &q), 0);
    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK);
    uint64_t took = t_now_ms() - t0;
    pthread_join(q.t, NULL);
    axf_completion c;
    CHECK_EQ(t_wait(d.p, AXF_CQ_PEER_LOST, d.p_ep, &c), 0);
    axf_completion x;
    CHECK_EQ(t_wait(d.p, AXF_CQ_XFER, 10, &x), 0);
    fprintf(stderr, "bye_network took %" PRIu64 " ms; peer: fail_index %" PRIu64
                    ", status %d; the READ: status %d\n",
            took, c.fail_index, c.status, x.status);
    CHECK_EQ(c.fail_index, 1); /* a close (before: 0, a loss) */
    /* The frame the sender was in went out whole before the goodbye. */
    CHECK(x.status == AXF_OK || x.status == AXF_E_PEER_LOST);
    if (x.status == AXF_OK)
        CHECK(memcmp(d.x, d.r, REG) == 0);
    /* The close still waited no longer than its grace (plus scheduling). */
    CHECK(took < 1500);
    pair_close(&d);
    return 0;
}

/* A peer that never reads again keeps the owed goodbye from going out: the
 * shutdown that follows still ends the connection (a loss, as before) and
 * does not wait for the peer. */
static int test_goodbye_owed_bounded_by_shutdown(void)
{
    pair d;
    if (pair_open(&d))
        return 1;
    if (read_held(&d, 20))
        return 1;
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK);
    uint64_t t0 = t_now_ms();
    axf_engine_shutdown(d.o->e);
    uint64_t took = t_now_ms() - t0;
    fprintf(stderr, "shutdown took %" PRIu64 " ms\n", took);
    CHECK(took < 3000);
    atomic_store(&d.rl.hold, false);
    axf_completion c;
    CHECK_EQ(t_wait(d.p, AXF_CQ_PEER_LOST, d.p_ep, &c), 0);
    CHECK_EQ(c.fail_index, 0); /* cut mid-frame: a loss */
    axf_completion x;
    CHECK_EQ(t_wait(d.p, AXF_CQ_XFER, 20, &x), 0);
    CHECK_EQ(x.status, AXF_E_PEER_LOST);
    pair_close(&d);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_goodbye_owed_by_a_busy_sender),
        T_CASE(test_goodbye_owed_bounded_by_shutdown),
    };
    return T_RUN(argc, argv, cases);
}

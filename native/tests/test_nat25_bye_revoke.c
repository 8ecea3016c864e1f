/* An owed goodbye must not hold a close for revoke_timeout (nat25).
 *
 * At close the agent says goodbye to its network peers (bye_network), then
 * deregisters its regions (release_all): a tcp connection whose sender is
 * mid-frame owes its goodbye (nat24), and the revocation frames queued behind
 * it never go. Before, such a connection kept the region quarantined until
 * the watcher killed it at revoke_timeout (10 s), with a misleading
 * "revocation not acknowledged" log; an agent whose close_timeout is not
 * longer than that gave the memory up for good. A tcp peer reaches our memory
 * only through frames our receiver serves, so such a connection's
 * revocations settle when it ends; and the owed goodbye (or the drain after
 * it) is bounded by the peer timeout from the close, not by revoke_timeout.
 *
 * The target's sender is held mid-frame by the relay of nat24's test. */
#include "harness.h"


#define REG (1u << 20)

#define PEER_MS 2000u
#define REVOKE_MS 10000u

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
    axf_config oc = {.peer_timeout_ms = PEER_MS, .revoke_timeout_ms = REVOKE_MS};
    d->o = t_engine(&oc);
    /* p is patient (a slow link it hears from at last): only o's own bounds
     * end the connection. */
    axf_config pc = {.peer_timeout_ms = 30000};
    d->p = t_engine(&pc);
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


static uint64_t quarantined(tengine *t)
{
    axf_stats s;
    axf_engine_stats(t->e, &s);
    return s.quarantined;
}

/* Waits (up to T_TIMEOUT_MS past REVOKE_MS) for o's quarantine to empty;
 * returns how long it took. */
static uint64_t wait_unquarantined(tengine *t, uint64_t t0)
{
    while (quarantined(t) && t_now_ms() - t0 < REVOKE_MS + T_TIMEOUT_MS)
        usleep(5 * 1000);
    return t_now_ms() - t0;
}

/* The peer never reads again: the owed goodbye never goes out. The region
 * deregistered after bye_network is released when the connection is ended
 * at the peer timeout (counted from the close), not at revoke_timeout. */
static int test_owed_goodbye_stuck_region_released_at_peer_timeout(void)
{
    pair d;
    if (pair_open(&d))
        return 1;
    if (read_held(&d, 10))
        return 1;
    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK);
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_OK);
    CHECK_EQ(quarantined(d.o), 1); /* the peer's connection is still up */
    uint64_t took = wait_unquarantined(d.o, t0);
    fprintf(stderr, "region released %" PRIu64 " ms after the close began (peer timeout %u, "
                    "revoke timeout %u)\n", took, PEER_MS, REVOKE_MS);
    CHECK_EQ(quarantined(d.o), 0);
    CHECK(took >= PEER_MS - 100); /* the goodbye had its time */
    CHECK(took < PEER_MS + 1500);  /* before: REVOKE_MS */
    /* o says why it ended the connection: the goodbye, not a revocation
     * "not acknowledged" (before: that, although the frame never went). */
    axf_completion lg;
    CHECK_EQ(t_wait_ex(d.o, AXF_CQ_LOG, true, 0, &lg, 1000), 0);
    char text[256] = {0}; /* the payload is not NUL-terminated */
    memcpy(text, lg.payload, lg.payload_len < sizeof text - 1 ? lg.payload_len : sizeof text - 1);
    fprintf(stderr, "o's log: %s\n", text);
    CHECK(strstr(text, "goodbye") != NULL);
    CHECK(strstr(text, "not acknowledged") == NULL);
    axf_completion_free(&lg);
    atomic_store(&d.rl.hold, false);
    axf_completion c;
    CHECK_EQ(t_wait(d.p, AXF_CQ_PEER_LOST, d.p_ep, &c), 0);
    pair_close(&d);
    return 0;
}

/* The peer reads again past the close's grace: the frame, then the owed
 * goodbye go out (a close, not a loss), the peer closes, and the region is
 * released at once then: its revocation neither kills the connection nor
 * waits for an acknowledgement that cannot follow the goodbye. */
static int test_owed_goodbye_said_region_released_when_peer_closes(void)
{
    pair d;
    if (pair_open(&d))
        return 1;
    if (read_held(&d, 10))
        return 1;
    releaser q = {.rl = &d.rl, .ms = 1200};
    CHECK_EQ(pthread_create(&q.t, NULL, release_main, &q), 0);
    uint64_t t0 = t_now_ms();
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK);
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_OK);
    uint64_t took = wait_unquarantined(d.o, t0);
    pthread_join(q.t, NULL);
    axf_completion c;
    CHECK_EQ(t_wait(d.p, AXF_CQ_PEER_LOST, d.p_ep, &c), 0);
    fprintf(stderr, "region released %" PRIu64 " ms after the close began; peer: "
                    "fail_index %" PRIu64 "\n", took, c.fail_index);
    CHECK_EQ(quarantined(d.o), 0);
    CHECK_EQ(c.fail_index, 1); /* the goodbye went out: a close */
    CHECK(took < PEER_MS);     /* settled as the peer closed, before any deadline */
    pair_close(&d);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_owed_goodbye_stuck_region_released_at_peer_timeout),
        T_CASE(test_owed_goodbye_said_region_released_when_peer_closes),
    };
    return T_RUN(argc, argv, cases);
}

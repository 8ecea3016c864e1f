/* While our goodbye is owed, nothing the peer sends is served (bye26).
 *
 * At the close (bye_network) a network peer's connection whose sender is
 * mid-frame owes its goodbye (nat24): it goes once the frame is out, and no
 * other frame starts before it. Its receiver meanwhile went on serving the
 * peer's new requests: a WRITE landed in our memory after the close began,
 * and its acknowledgement (like a READ's response) was queued behind the
 * goodbye, never sent: the peer was told the WRITE failed (the close) while
 * its bytes were in our memory, and the replies held memory (and region
 * references) until the connection ended. Now a connection that owes its
 * goodbye drains as one that said it (rx_drain): what the peer sends is
 * read and dropped; the peer fails it as a close when the goodbye reaches
 * it.
 *
 * The target's sender is held mid-frame by the relay of nat24's test. */
#include "harness.h"


#define REG (1u << 20)

#define PEER_MS 5000u
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


/* Our bytes to write into o's region r: none of r's. */
#define SRC 4096u

static int test_write_while_goodbye_owed_not_served(void)
{
    pair d;
    if (pair_open(&d))
        return 1;
    static uint8_t src[SRC];
    memset(src, 0xa5, sizeof src);
    uint64_t sid, skey;
    CHECK_EQ(axf_region_register(d.p->e, src, sizeof src, AXF_ACCESS_READ, -1, &sid, &skey),
             AXF_OK);
    uint8_t *before = malloc(REG);
    CHECK(before);
    memcpy(before, d.r, REG);
    if (read_held(&d, 10))
        return 1;
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK); /* the goodbye owed: o's sender is held */
    /* p, not told yet, writes into r and asks for 64 KiB of it. */
    axf_desc wr = {.lrid = sid, .rrid = d.rid, .rkey = d.rkey, .roff = 8192, .len = SRC};
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_WRITE, &wr, 1, NULL, 0, 11, 0), AXF_OK);
    axf_desc rd = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = 65536};
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_READ, &rd, 1, NULL, 0, 12, 0), AXF_OK);
    usleep(300 * 1000); /* ample for o's receiver to have served them (before: it did) */
    bool untouched = memcmp(d.r, before, REG) == 0;
    fprintf(stderr, "while the goodbye is owed: r %s\n", untouched ? "untouched" : "written");
    CHECK(untouched); /* before: the WRITE landed */
    /* The peer reads again: the held frame, then the goodbye: a close, and
     * the WRITE and READ fail with it. */
    atomic_store(&d.rl.hold, false);
    axf_completion c, w, r;
    CHECK_EQ(t_wait(d.p, AXF_CQ_PEER_LOST, d.p_ep, &c), 0);
    CHECK_EQ(t_wait(d.p, AXF_CQ_XFER, 11, &w), 0);
    CHECK_EQ(t_wait(d.p, AXF_CQ_XFER, 12, &r), 0);
    fprintf(stderr, "peer: fail_index %" PRIu64 "; WRITE status %d, READ status %d\n",
            c.fail_index, w.status, r.status);
    CHECK_EQ(c.fail_index, 1); /* the goodbye reached it: a close */
    CHECK(w.status != AXF_OK);
    CHECK(r.status != AXF_OK);
    CHECK(memcmp(d.r, before, REG) == 0); /* failed, and never landed */
    free(before);
    pair_close(&d);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_write_while_goodbye_owed_not_served),
    };
    return T_RUN(argc, argv, cases);
}

/* axf_engine_bye_network: on close, before its regions are revoked, an
 * engine says goodbye on its accepted network connections and ends them, so
 * their initiators see a close (AXF_CQ_PEER_LOST, fail_index 1) rather than
 * refused accesses, and the revocation that follows waits for nobody.
 * Its own outgoing connections stay up (shutdown's). */
#include "harness.h"

#include <sys/socket.h>

#define REG (1u << 20)

/* The owner o accepted a connection from the peer p (p's endpoint p_ep to
 * o) and dialled one to p (o's endpoint o_ep): regions r (o's, imported by
 * p) and x (p's, imported by o). */
typedef struct pair {
    tengine *o, *p;
    uint64_t o_ep, p_ep;
    uint8_t *r, *x;
    uint64_t rid, rkey, xid, xkey;
} pair;

static int link_one(tengine *from, uint64_t ep, tengine *to, uint64_t tag)
{
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(from->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(to->e, sv[1], tag, -1), AXF_OK); /* no pidfd: a network peer */
    return 0;
}

static int pair_open(pair *d)
{
    memset(d, 0, sizeof *d);
    d->o = t_engine(NULL);
    d->p = t_engine(NULL);
    CHECK(d->o && d->p);
    CHECK_EQ(axf_endpoint_create(d->o->e, AXF_EP_TCP, 1, 0, -1, &d->o_ep), AXF_OK);
    CHECK_EQ(axf_endpoint_create(d->p->e, AXF_EP_TCP, 2, 0, -1, &d->p_ep), AXF_OK);
    if (link_one(d->o, d->o_ep, d->p, 32) || link_one(d->p, d->p_ep, d->o, 31))
        return 1;
    d->r = calloc(1, REG);
    d->x = calloc(1, REG);
    CHECK(d->r && d->x);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(d->o->e, d->r, REG, rw, -1, &d->rid, &d->rkey), AXF_OK);
    CHECK_EQ(axf_region_register(d->p->e, d->x, REG, rw, -1, &d->xid, &d->xkey), AXF_OK);
    CHECK_EQ(axf_endpoint_import(d->p->e, d->p_ep, d->rid, d->rkey, REG, rw, 0, -1), AXF_OK);
    CHECK_EQ(axf_endpoint_import(d->o->e, d->o_ep, d->xid, d->xkey, REG, rw, 0, -1), AXF_OK);
    return 0;
}

static void pair_close(pair *d)
{
    t_close(d->o);
    t_close(d->p);
    free(d->r);
    free(d->x);
}

static int op_status(tengine *t, uint64_t ep, int opcode, const axf_desc *d, uint64_t req)
{
    int st = axf_post(t->e, ep, opcode, d, 1, NULL, 0, req, 0);
    if (st != AXF_OK)
        return st;
    axf_completion c;
    if (t_wait(t, AXF_CQ_XFER, req, &c) != 0)
        return 12345;
    return c.status;
}

static int test_bye_network_closes_accepted_only(void)
{
    pair d;
    if (pair_open(&d))
        return 1;
    axf_desc pw = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = 4096};
    t_fill(d.x, 4096, 3);
    CHECK_EQ(op_status(d.p, d.p_ep, AXF_OP_WRITE, &pw, 1), AXF_OK);
    CHECK(memcmp(d.r, d.x, 4096) == 0);

    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK);
    /* The peer heard a goodbye: its endpoint ends as closed, not lost. */
    axf_completion c;
    CHECK_EQ(t_wait(d.p, AXF_CQ_PEER_LOST, d.p_ep, &c), 0);
    CHECK_EQ(c.fail_index, 1); /* (status: how its connections ended) */
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_WRITE, &pw, 1, NULL, 0, 2, 0), AXF_E_PEER_LOST);
    /* Its connection's threads are gone on return: the revocation that
     * follows has nobody to wait for (at once, nothing quarantined). */
    axf_stats s;
    axf_engine_stats(d.o->e, &s);
    CHECK_EQ(s.conns, 1); /* ours to the peer */
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_OK);
    CHECK_EQ(t_wait(d.o, AXF_CQ_REGION_FREED, d.rid, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    axf_engine_stats(d.o->e, &s);
    CHECK_EQ(s.quarantined, 0);
    /* Our own connection to the peer still works. */
    axf_desc ow = {.lrid = d.rid, .rrid = d.xid, .rkey = d.xkey, .len = 4096};
    uint64_t r2, k2;
    CHECK_EQ(axf_region_register(d.o->e, d.r, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &r2, &k2), AXF_OK);
    ow.lrid = r2;
    t_fill(d.r, 4096, 9);
    CHECK_EQ(op_status(d.o, d.o_ep, AXF_OP_WRITE, &ow, 3), AXF_OK);
    CHECK(memcmp(d.r, d.x, 4096) == 0);

    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK); /* again: nothing left to end */
    axf_engine_shutdown(d.o->e);
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_E_CLOSED);
    pair_close(&d);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_bye_network_closes_accepted_only),
    };
    return T_RUN(argc, argv, cases);
}

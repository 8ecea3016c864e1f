/* axf_region_revoke: a region's peers lose it at once while its owner's own
 * ops still use it, until axf_region_deregister ends that too. Over tcp
 * (a well-behaved peer, and a raw peer that ignores the revocation and keeps
 * using the key: only the target's check stands between it and our memory)
 * and over shm (a same-host peer's copies reach our memory directly: the
 * revocation makes it stop and unmap, acknowledged only after its copies). */
#include "harness.h"

#include "internal.h" /* wire layout, for the raw peer */

#include <sys/socket.h>

#define REG (1u << 20)
#define O_TAG 31 /* the owner's tag for the connection it accepted from the peer */
#define P_TAG 32 /* the peer's tag for the connection it accepted from the owner */

/* Two engines that reach each other both ways: the owner (o) registered
 * region r, which the peer (p) imported into its endpoint to o; the owner
 * posts its own ops on r through its endpoint to p, into the peer's region x. */
typedef struct duo {
    tengine *o, *p;
    uint64_t o_ep, p_ep; /* the owner's endpoint to the peer, the peer's to the owner */
    uint8_t *r, *x;
    uint64_t rid, rkey, xid, xkey;
} duo;

static int conn_both(tengine *from, uint64_t ep, tengine *to, uint64_t tag)
{
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(from->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(to->e, sv[1], tag, -1), AXF_OK);
    return 0;
}

static int duo_open(duo *d, int kind, const axf_config *cfg)
{
    memset(d, 0, sizeof *d);
    d->o = t_engine(cfg);
    d->p = t_engine(cfg);
    CHECK(d->o && d->p);
    int32_t pid = kind == AXF_EP_SHM ? getpid() : 0; /* same host: into this process */
    CHECK_EQ(axf_endpoint_create(d->o->e, kind, 1, pid, -1, &d->o_ep), AXF_OK);
    CHECK_EQ(axf_endpoint_create(d->p->e, kind, 2, pid, -1, &d->p_ep), AXF_OK);
    if (conn_both(d->o, d->o_ep, d->p, P_TAG) || conn_both(d->p, d->p_ep, d->o, O_TAG))
        return 1;
    d->r = calloc(1, REG);
    d->x = calloc(1, REG);
    CHECK(d->r && d->x);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(d->o->e, d->r, REG, rw, -1, &d->rid, &d->rkey), AXF_OK);
    CHECK_EQ(axf_region_register(d->p->e, d->x, REG, rw, -1, &d->xid, &d->xkey), AXF_OK);
    uint64_t raddr = kind == AXF_EP_SHM ? (uint64_t)(uintptr_t)d->r : 0;
    uint64_t xaddr = kind == AXF_EP_SHM ? (uint64_t)(uintptr_t)d->x : 0;
    CHECK_EQ(axf_endpoint_import(d->p->e, d->p_ep, d->rid, d->rkey, REG, rw, raddr, -1), AXF_OK);
    CHECK_EQ(axf_endpoint_import(d->o->e, d->o_ep, d->xid, d->xkey, REG, rw, xaddr, -1), AXF_OK);
    return 0;
}

static void duo_close(duo *d)
{
    t_close(d->o);
    t_close(d->p);
    free(d->r);
    free(d->x);
}

/* One op of ep's, waited for: its completion's status. */
static int op_status(tengine *t, uint64_t ep, int opcode, const axf_desc *d, uint64_t req)
{
    int st = axf_post(t->e, ep, opcode, d, 1, NULL, 0, req, 0);
    if (st != AXF_OK)
        return st; /* refused at post */
    axf_completion c;
    if (t_wait(t, AXF_CQ_XFER, req, &c) != 0)
        return 12345; /* never completed: fails any CHECK_EQ */
    return c.status;
}

/* Until the owner's revocation of rid settled (every peer acknowledged). */
static int wait_settled(tengine *o, uint64_t rid)
{
    uint64_t tags[4];
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (axf_region_holders(o->e, rid, tags, 4) != AXF_E_NOTFOUND) {
        CHECK(t_now_ms() < until);
        usleep(1000);
    }
    return 0;
}

/* The peer's accesses to r fail from the revocation on, over tcp both where
 * it forgot r (refused at its post) and where it did not (a stale import:
 * the owner's check refuses it); the owner's own ops on r go on, before and
 * after, and r is freed only once deregistered. */
/* The owner's own ops on its revoked region r still run, both ways (r the
 * local side), and r is still registered (no freed record). */
static int owner_ops_go_on(duo *d)
{
    t_fill(d->r, REG, 5);
    axf_desc ow = {.lrid = d->rid, .rrid = d->xid, .rkey = d->xkey, .len = REG};
    CHECK_EQ(op_status(d->o, d->o_ep, AXF_OP_WRITE, &ow, 10), AXF_OK);
    CHECK(memcmp(d->r, d->x, REG) == 0);
    t_fill(d->x, REG, 6);
    CHECK_EQ(op_status(d->o, d->o_ep, AXF_OP_READ, &ow, 11), AXF_OK);
    CHECK(memcmp(d->r, d->x, REG) == 0);
    CHECK(t_quiet(d->o, AXF_CQ_REGION_FREED, d->rid, 50));
    return 0;
}

static int revoke_peer_refused_owner_goes_on(int kind)
{
    duo d;
    if (duo_open(&d, kind, NULL))
        return 1;
    axf_desc pw = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = 4096};
    t_fill(d.x, REG, 3);
    CHECK_EQ(op_status(d.p, d.p_ep, AXF_OP_WRITE, &pw, 1), AXF_OK); /* before: it can */
    CHECK(memcmp(d.r, d.x, 4096) == 0);

    CHECK_EQ(axf_region_revoke(d.o->e, d.rid), AXF_OK);
    CHECK_EQ(axf_region_revoke(d.o->e, d.rid), AXF_OK); /* idempotent */
    memset(d.r, 0, REG);
    if (wait_settled(d.o, d.rid)) /* the peer acknowledged: it forgot r */
        return 1;
    axf_stats s;
    axf_engine_stats(d.o->e, &s);
    CHECK_EQ(s.quarantined, 0);
    CHECK_EQ(s.regions, 1); /* still the owner's */
    axf_desc pr = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = 4096};
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_WRITE, &pw, 1, NULL, 0, 2, 0), AXF_E_ACCESS);
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_READ, &pr, 1, NULL, 0, 3, 0), AXF_E_ACCESS);
    if (kind == AXF_EP_TCP) {
        /* A stale handle that slipped past the peer's table (imported
         * again): the owner's check refuses it, as for a region never there. */
        CHECK_EQ(axf_endpoint_import(d.p->e, d.p_ep, d.rid, d.rkey, REG,
                                     AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
                 AXF_OK);
        CHECK_EQ(op_status(d.p, d.p_ep, AXF_OP_WRITE, &pw, 4), AXF_E_ACCESS);
        memset(d.x, 0x77, REG);
        CHECK_EQ(op_status(d.p, d.p_ep, AXF_OP_READ, &pr, 5), AXF_E_ACCESS);
        CHECK(t_all(d.x, REG, 0x77)); /* nothing read into it */
    }
    CHECK(t_all(d.r, REG, 0)); /* nothing of the peer's landed */

    CHECK_EQ(owner_ops_go_on(&d), 0); /* the owner's own ops on r */

    /* An op of the owner's in flight at the deregistration holds r. */
    axf_desc ow = {.lrid = d.rid, .rrid = d.xid, .rkey = d.xkey, .len = REG};
    CHECK_EQ(axf_post(d.o->e, d.o_ep, AXF_OP_WRITE, &ow, 1, NULL, 0, 12, 0), AXF_OK);
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(d.o, AXF_CQ_XFER, 12, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(t_wait(d.o, AXF_CQ_REGION_FREED, d.rid, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(axf_post(d.o->e, d.o_ep, AXF_OP_WRITE, &ow, 1, NULL, 0, 13, 0), AXF_E_ACCESS);
    CHECK_EQ(axf_region_revoke(d.o->e, d.rid), AXF_E_NOTFOUND);
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_E_NOTFOUND);
    axf_engine_stats(d.o->e, &s);
    CHECK_EQ(s.regions, 0);
    CHECK_EQ(s.quarantined, 0);
    duo_close(&d);
    return 0;
}

static int test_revoke_tcp(void) { return revoke_peer_refused_owner_goes_on(AXF_EP_TCP); }
static int test_revoke_shm(void) { return revoke_peer_refused_owner_goes_on(AXF_EP_SHM); }

/* A same-host peer's copies into r in flight at the revocation: it
 * acknowledges only once they finished or stopped, so once the revocation
 * settled, nothing of the peer's lands in r any more, while r stays the
 * owner's. */
static int test_revoke_shm_waits_for_copies(void)
{
    axf_config cfg = {.copy_workers = 1, .inline_bytes = UINT64_MAX};
    duo d;
    if (duo_open(&d, AXF_EP_SHM, &cfg))
        return 1;
    t_fill(d.x, REG, 9);
    enum { N = 8 };
    axf_desc pw = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = REG};
    for (uint64_t i = 0; i < N; i++)
        CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_WRITE, &pw, 1, NULL, 0, 40 + i, 0), AXF_OK);
    CHECK_EQ(axf_region_revoke(d.o->e, d.rid), AXF_OK);
    if (wait_settled(d.o, d.rid))
        return 1;
    memset(d.r, 0, REG);
    axf_completion c;
    for (uint64_t i = 0; i < N; i++) {
        CHECK_EQ(t_wait(d.p, AXF_CQ_XFER, 40 + i, &c), 0);
        CHECK(c.status == AXF_OK || c.status == AXF_E_ACCESS);
    }
    CHECK(t_all(d.r, REG, 0));
    CHECK(t_quiet(d.o, AXF_CQ_REGION_FREED, d.rid, 50));
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_OK);
    CHECK_EQ(t_wait(d.o, AXF_CQ_REGION_FREED, d.rid, &c), 0);
    duo_close(&d);
    return 0;
}

/* ---------------------------------------------------------------- verbs */

/* from's verbs endpoint to to (both enabled on ndev devices): a queue pair
 * per device and a control connection to accepts (tagged tag). */
static int verbs_link(tengine *from, tengine *to, int ndev, uint64_t tag, uint64_t *ep)
{
    CHECK_EQ(axf_endpoint_create(from->e, AXF_EP_VERBS, tag, 0, -1, ep), AXF_OK);
    uint64_t handles[AXF_VERBS_MAX_DEVICES];
    for (int d = 0; d < ndev; d++) {
        axf_verbs_qp_info mine, theirs;
        CHECK_EQ(axf_verbs_qp_create(from->e, *ep, (uint32_t)d, &mine), AXF_OK);
        CHECK_EQ(axf_verbs_accept_qp(to->e, (uint32_t)d, &mine, &theirs, &handles[d]), AXF_OK);
        CHECK_EQ(axf_verbs_qp_connect(from->e, *ep, (uint32_t)d, (uint32_t)d, &theirs), AXF_OK);
    }
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(from->e, *ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_verbs_accept_conn(to->e, sv[1], tag, handles, (size_t)ndev), AXF_OK);
    return 0;
}

/* Over RDMA (the software verbs provider, where built and named): the
 * revocation reaches a verbs peer on its control connection, and it
 * refuses its own later accesses; the owner's own RDMA ops on the region go
 * on (its memory registration stays while the region is ours: SECURITY.md
 * says what a peer that ignores the revocation still reaches). */
static int test_revoke_verbs(void)
{
    const char *provider = getenv("AXF_SOFTVERBS_PROVIDER");
    if (!provider) {
        printf("skip: AXF_SOFTVERBS_PROVIDER is not set (meson's revoke-verbs sets it)\n");
        return 0;
    }
    duo d;
    memset(&d, 0, sizeof d);
    d.o = t_engine(NULL);
    d.p = t_engine(NULL);
    CHECK(d.o && d.p);
    int ndev = t_verbs_connect(d.p->e, d.o->e, provider, 2, O_TAG, &d.p_ep);
    CHECK(ndev > 0);
    if (verbs_link(d.o, d.p, ndev, P_TAG, &d.o_ep))
        return 1;
    d.r = calloc(1, REG);
    d.x = calloc(1, REG);
    CHECK(d.r && d.x);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(d.o->e, d.r, REG, rw, -1, &d.rid, &d.rkey), AXF_OK);
    CHECK_EQ(axf_region_register(d.p->e, d.x, REG, rw, -1, &d.xid, &d.xkey), AXF_OK);
    if (t_verbs_import(d.p->e, d.o->e, d.p_ep, ndev, d.rid, d.rkey, REG, rw) ||
        t_verbs_import(d.o->e, d.p->e, d.o_ep, ndev, d.xid, d.xkey, REG, rw))
        return 1;
    axf_desc pw = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = 4096};
    t_fill(d.x, REG, 3);
    CHECK_EQ(op_status(d.p, d.p_ep, AXF_OP_WRITE, &pw, 1), AXF_OK);
    CHECK(memcmp(d.r, d.x, 4096) == 0);

    CHECK_EQ(axf_region_revoke(d.o->e, d.rid), AXF_OK);
    if (wait_settled(d.o, d.rid))
        return 1;
    memset(d.r, 0, REG);
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_WRITE, &pw, 1, NULL, 0, 2, 0), AXF_E_ACCESS);
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_READ, &pw, 1, NULL, 0, 3, 0), AXF_E_ACCESS);
    CHECK(t_all(d.r, REG, 0));

    CHECK_EQ(owner_ops_go_on(&d), 0);
    CHECK_EQ(axf_region_deregister(d.o->e, d.rid), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(d.o, AXF_CQ_REGION_FREED, d.rid, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    duo_close(&d);
    return 0;
}

/* ---------------------------------------------------------------- raw peer */

/* Reads frames until one of this type; pings and revocations (which a
 * hostile peer ignores) are skipped. */
static int read_frame(int fd, uint16_t type, wire_hdr *out)
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

/* A WRITE of 4 bytes at rid/key + off: the status its acknowledgement says. */
static int raw_write(int fd, uint64_t op, uint64_t rid, uint64_t key, uint64_t off,
                     const char four[4])
{
    wire_hdr h = {.magic = AXF_MAGIC, .type = FR_WRITE, .flags = FL_LAST, .op = op,
                  .rid = rid, .key = key, .off = off, .len = 4};
    uint8_t f[sizeof h + 4];
    memcpy(f, &h, sizeof h);
    memcpy(f + sizeof h, four, 4);
    if (write(fd, f, sizeof f) != (ssize_t)sizeof f)
        return 12345;
    wire_hdr ack;
    if (read_frame(fd, FR_WRITE_ACK, &ack) || ack.op != op)
        return 12345;
    return ack.status;
}

/* A READ of 4 bytes at rid/key + off: its response's status (and bytes). */
static int raw_read(int fd, uint64_t op, uint64_t rid, uint64_t key, uint64_t off, char four[4])
{
    wire_hdr h = {.magic = AXF_MAGIC, .type = FR_READ_REQ, .flags = FL_LAST, .op = op,
                  .rid = rid, .key = key, .off = off, .len = 4};
    if (write(fd, &h, sizeof h) != (ssize_t)sizeof h)
        return 12345;
    wire_hdr resp;
    if (read_frame(fd, FR_READ_RESP, &resp) || resp.op != op)
        return 12345;
    if (resp.status == AXF_OK &&
        (resp.len != 4 || recv(fd, four, 4, MSG_WAITALL) != 4))
        return 12345;
    if (resp.status != AXF_OK && resp.len != 0)
        return 12345;
    return resp.status;
}

/* A tcp peer that keeps r's key and ignores the revocation: its READ and
 * WRITE are refused by the owner's check from the revocation on, exactly
 * as after a deregistration, and the connection survives for its other
 * regions; it is disconnected once it has not acknowledged within
 * revoke_timeout_ms, and the owner's region is freed once deregistered. */
static int test_revoke_raw_tcp_peer(void)
{
    axf_config cfg = {.revoke_timeout_ms = 300};
    tengine *o = t_engine(&cfg);
    CHECK(o);
    static uint8_t r[4096], s[4096];
    memset(r, 0x11, sizeof r);
    memset(s, 0, sizeof s);
    uint64_t rid, rkey, sid, skey;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(o->e, r, sizeof r, rw, -1, &rid, &rkey), AXF_OK);
    CHECK_EQ(axf_region_register(o->e, s, sizeof s, rw, -1, &sid, &skey), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(o->e, sv[1], O_TAG, -1), AXF_OK);
    int fd = sv[0];
    char got[4];
    CHECK_EQ(raw_write(fd, 1, rid, rkey, 0, "GOOD"), AXF_OK); /* the key works before */
    CHECK(memcmp(r, "GOOD", 4) == 0);

    CHECK_EQ(axf_region_revoke(o->e, rid), AXF_OK);
    wire_hdr rv;
    if (read_frame(fd, FR_REVOKE, &rv))
        return 1;
    CHECK_EQ(rv.rid, rid);
    CHECK_EQ(rv.key, rkey);
    memset(r, 0x11, sizeof r);
    CHECK_EQ(raw_write(fd, 2, rid, rkey, 8, "EVIL"), AXF_E_ACCESS);
    CHECK_EQ(raw_read(fd, 3, rid, rkey, 0, got), AXF_E_ACCESS);
    CHECK(t_all(r, sizeof r, 0x11));
    /* The same answer as a deregistered region's, and as a forged key's. */
    CHECK_EQ(raw_write(fd, 4, rid, rkey ^ 1, 8, "EVIL"), AXF_E_ACCESS);
    /* The connection is fine for what was not revoked. */
    CHECK_EQ(raw_write(fd, 5, sid, skey, 0, "SAFE"), AXF_OK);
    CHECK_EQ(raw_read(fd, 6, sid, skey, 0, got), AXF_OK);
    CHECK(memcmp(got, "SAFE", 4) == 0);
    /* Still the owner's, and quarantined (the peer named) until the
     * ignored revocation times out. */
    axf_stats st;
    axf_engine_stats(o->e, &st);
    CHECK_EQ(st.regions, 2);
    CHECK_EQ(st.quarantined, 1);
    uint64_t tags[2];
    CHECK_EQ(axf_region_holders(o->e, rid, tags, 2), 1);
    CHECK_EQ(tags[0], O_TAG);
    /* No acknowledgement: disconnected after revoke_timeout_ms. */
    axf_completion c;
    CHECK_EQ(t_wait_any(o, AXF_CQ_CONN_CLOSED, &c), 0);
    CHECK_EQ(c.tag, O_TAG);
    CHECK_EQ(axf_region_holders(o->e, rid, tags, 2), AXF_E_NOTFOUND);
    CHECK(t_quiet(o, AXF_CQ_REGION_FREED, rid, 50)); /* still the owner's */
    CHECK_EQ(axf_region_deregister(o->e, rid), AXF_OK);
    CHECK_EQ(t_wait(o, AXF_CQ_REGION_FREED, rid, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    close(fd);
    t_close(o);
    return 0;
}

/* Without peers, and for a file region (never a peer's): nothing to wait
 * for; the region is the owner's until deregistered. */
static int test_revoke_without_peers(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    static uint8_t buf[4096];
    uint64_t id, key, tags[2];
    CHECK_EQ(axf_region_revoke(t->e, 424242), AXF_E_NOTFOUND);
    CHECK_EQ(axf_region_register(t->e, buf, sizeof buf, AXF_ACCESS_READ, -1, &id, &key), AXF_OK);
    CHECK_EQ(axf_region_revoke(t->e, id), AXF_OK);
    CHECK(t_quiet(t, AXF_CQ_REGION_FREED, id, 50));
    CHECK_EQ(axf_region_holders(t->e, id, tags, 2), AXF_E_NOTFOUND);
    axf_stats s;
    axf_engine_stats(t->e, &s);
    CHECK_EQ(s.regions, 1);
    CHECK_EQ(s.quarantined, 0);
    CHECK_EQ(axf_region_deregister(t->e, id), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, id, &c), 0);
    CHECK_EQ(c.status, AXF_OK);

    char path[] = "/tmp/axf-revoke-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    unlink(path);
    CHECK_EQ(ftruncate(fd, 4096), 0);
    uint64_t fid, fkey;
    CHECK_EQ(axf_region_register_kind(t->e, AXF_MEM_FILE, 0, 4096, AXF_ACCESS_READ, fd, &fid,
                                      &fkey),
             AXF_OK);
    close(fd);
    CHECK_EQ(axf_region_revoke(t->e, fid), AXF_OK);
    CHECK_EQ(axf_region_deregister(t->e, fid), AXF_OK);
    CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, fid, &c), 0);
    /* Revoked regions are freed by a shutdown like any other. */
    CHECK_EQ(axf_region_register(t->e, buf, sizeof buf, AXF_ACCESS_READ, -1, &id, &key), AXF_OK);
    CHECK_EQ(axf_region_revoke(t->e, id), AXF_OK);
    axf_engine_shutdown(t->e);
    CHECK_EQ(t_wait(t, AXF_CQ_REGION_FREED, id, &c), 0);
    t_close(t);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_revoke_without_peers),
        T_CASE(test_revoke_tcp),
        T_CASE(test_revoke_shm),
        T_CASE(test_revoke_shm_waits_for_copies),
        T_CASE(test_revoke_verbs),
        T_CASE(test_revoke_raw_tcp_peer),
    };
    return T_RUN(argc, argv, cases);
}

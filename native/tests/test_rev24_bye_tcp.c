/* The goodbye over TCP to a slow reader that pings (rev24). nat24's owed
 * goodbye (and the goodbye said at once between frames) is handed to the
 * socket, and the connection is then marked dead at once: conn_mark_dead
 * shuts the socket down both ways (SHUT_RDWR) while the tail of the frame
 * and the goodbye may still sit in the socket's send queue, waiting for a
 * slow peer's window. A TCP socket shut for reading that then receives data
 * (the peer's keepalive ping, sent every keepalive_ms while it waits for the
 * response) is aborted by the kernel (RFC 1122; Linux tcp_rcv_state_process,
 * TCPAbortOnData): an RST, and everything still queued to send is dropped,
 * the goodbye with it. The peer then sees a loss mid-frame, not a close: the
 * case the owed goodbye was made for (a large response to a slow reader).
 *
 * native test_nat24_bye cannot see it: its relay is a unix socket pair
 * (no RST), and its peer pings once a second. Here the links are loopback
 * TCP, the relay passes the initiator's bytes (its pings) at once and the
 * target's at about 1 MB/s (a slow link), and the initiator pings every
 * 50 ms. */
#include "harness.h"

#define REG (1u << 20)

/* A connected loopback TCP pair: *a the connecting end, *b the accepted. */
typedef struct pair {
    tengine *o, *p;
    uint64_t p_ep;
    uint8_t *r, *x, *w, *s;
    uint64_t rid, rkey, xid, xkey, wid, wkey, sid, skey;
    t_relay rl;
} pair;

/* p dials o through the relay over loopback TCP; o's region r imported by
 * p. o's send buffer about half the frame (snd), so that a 1 MiB response
 * is partly in o's hands (mid-frame) or, snd large, all in its socket. */
static int pair_open(pair *d, int snd)
{
    memset(d, 0, sizeof *d);
    axf_config pc = {.keepalive_ms = 50}; /* p pings while it waits */
    d->o = t_engine(NULL);
    d->p = t_engine(&pc);
    CHECK(d->o && d->p);
    int o_sock, o_relay, p_sock, p_relay;
    if (t_tcp_pair(&o_relay, &o_sock) || t_tcp_pair(&p_sock, &p_relay))
        return 1;
    CHECK_EQ(setsockopt(o_sock, SOL_SOCKET, SO_SNDBUF, &snd, sizeof snd), 0);
    if (t_relay_start(&d->rl, o_relay, p_relay))
        return 1;
    CHECK_EQ(axf_endpoint_create(d->p->e, AXF_EP_TCP, 2, 0, -1, &d->p_ep), AXF_OK);
    CHECK_EQ(axf_endpoint_add_conn(d->p->e, d->p_ep, p_sock), AXF_OK);
    CHECK_EQ(axf_accept_conn(d->o->e, o_sock, 31, -1), AXF_OK); /* no pidfd: a network peer */
    d->r = malloc(REG);
    d->x = calloc(1, REG);
    CHECK(d->r && d->x);
    t_fill(d->r, REG, 7);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(d->o->e, d->r, REG, rw, -1, &d->rid, &d->rkey), AXF_OK);
    CHECK_EQ(axf_region_register(d->p->e, d->x, REG, rw, -1, &d->xid, &d->xkey), AXF_OK);
    CHECK_EQ(axf_endpoint_import(d->p->e, d->p_ep, d->rid, d->rkey, REG, rw, 0, -1), AXF_OK);
    /* A small region of o's that p writes into, from one of its own. */
    d->w = calloc(1, 4096);
    d->s = malloc(4096);
    CHECK(d->w && d->s);
    t_fill(d->s, 4096, 9);
    CHECK_EQ(axf_region_register(d->o->e, d->w, 4096, rw, -1, &d->wid, &d->wkey), AXF_OK);
    CHECK_EQ(axf_region_register(d->p->e, d->s, 4096, rw, -1, &d->sid, &d->skey), AXF_OK);
    CHECK_EQ(axf_endpoint_import(d->p->e, d->p_ep, d->wid, d->wkey, 4096, rw, 0, -1), AXF_OK);
    axf_desc rd = {.lrid = d->xid, .rrid = d->rid, .rkey = d->rkey, .len = 4096};
    CHECK_EQ(axf_post(d->p->e, d->p_ep, AXF_OP_READ, &rd, 1, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(d->p, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    return 0;
}

static void pair_close(pair *d)
{
    atomic_store(&d->rl.slow, false);
    t_close(d->o);
    t_close(d->p);
    t_relay_stop(&d->rl);
    free(d->r);
    free(d->x);
    free(d->w);
    free(d->s);
}

/* p's WRITEs into o's w, 20 ms after it starts, while o's goodbye goes
 * out slowly (p has not read it yet: the endpoint is up). */
typedef struct writer {
    pair *d;
    pthread_t t;
} writer;

static void *writer_main(void *arg)
{
    writer *wr = arg;
    pair *d = wr->d;
    usleep(20 * 1000);
    for (uint64_t req = 1000; req < 1010; req++) {
        axf_desc wd = {.lrid = d->sid, .rrid = d->wid, .rkey = d->wkey, .len = 4096};
        (void)axf_post(d->p->e, d->p_ep, AXF_OP_WRITE, &wd, 1, NULL, 0, req, 0);
        usleep(10 * 1000);
    }
    return NULL;
}

/* o says goodbye while its 1 MiB response goes out over the slow link; p
 * must see a close (fail_index 1) and, the frame having been started, the
 * READ whole; what p sends after the goodbye is not served. */
static int bye_to_slow_reader(int snd, bool owed)
{
    pair d;
    if (pair_open(&d, snd))
        return 1;
    atomic_store(&d.rl.slow, true);
    axf_desc rd = {.lrid = d.xid, .rrid = d.rid, .rkey = d.rkey, .len = REG};
    CHECK_EQ(axf_post(d.p->e, d.p_ep, AXF_OP_READ, &rd, 1, NULL, 0, 10, 0), AXF_OK);
    usleep(150 * 1000); /* the response is on its way, ~0.15 MB of it through */
    uint64_t t0 = t_now_ms();
    writer wr = {.d = &d};
    if (!owed) /* WRITEs from 20 ms on: after the goodbye, said at once */
        CHECK_EQ(pthread_create(&wr.t, NULL, writer_main, &wr), 0);
    CHECK_EQ(axf_engine_bye_network(d.o->e), AXF_OK);
    if (!owed)
        pthread_join(wr.t, NULL);
    uint64_t took = t_now_ms() - t0;
    /* p goes on sending (small WRITEs every 20 ms, as a busy peer
     * pipelines requests) until it hears the goodbye: they reach o after
     * o's goodbye is in its socket, behind the response's tail. */
    axf_completion c;
    int w = -1;
    for (uint64_t req = 100; w != 0 && t_now_ms() < t0 + 30000; req++) {
        axf_desc wd = {.lrid = d.sid, .rrid = d.wid, .rkey = d.wkey, .len = 4096};
        (void)axf_post(d.p->e, d.p_ep, AXF_OP_WRITE, &wd, 1, NULL, 0, req, 0);
        w = t_wait_ex(d.p, AXF_CQ_PEER_LOST, false, d.p_ep, &c, 20);
    }
    fprintf(stderr, "peer lost after %" PRIu64 " ms (w %d), o bytes %llu\n", t_now_ms() - t0, w,
            (unsigned long long)atomic_load(&d.rl.o_bytes));
    t_drain(d.o);
    t_drain(d.p);
    for (int k = 0; k < 2; k++) {
        tengine *t = k ? d.p : d.o;
        for (size_t i = 0; i < t->n; i++)
            if (t->q[i].kind == AXF_CQ_LOG)
                fprintf(stderr, "%s log: %.*s\n", k ? "p" : "o", (int)t->q[i].payload_len,
                        (const char *)t->q[i].payload);
    }
    CHECK_EQ(w, 0);
    axf_completion x;
    CHECK_EQ(t_wait(d.p, AXF_CQ_XFER, 10, &x), 0);
    fprintf(stderr,
            "snd %d: bye_network took %" PRIu64 " ms; peer: fail_index %" PRIu64
            ", status %d; the READ: status %d; the relay on o's socket: %s\n",
            snd, took, c.fail_index, c.status, x.status,
            atomic_load(&d.rl.o_err) ? strerror(atomic_load(&d.rl.o_err)) : "no error");
    CHECK_EQ(atomic_load(&d.rl.o_err), 0); /* o did not abort (RST) the connection */
    CHECK_EQ(c.fail_index, 1);             /* a close, not a loss */
    CHECK_EQ(x.status, AXF_OK);
    CHECK(memcmp(d.x, d.r, REG) == 0);
    if (!owed) {
        /* Said at once: the writer's WRITEs reached o after its goodbye
         * (p still reading the response): none was served (o's receiver
         * only drains until p closes). */
        static const uint8_t zero[4096];
        CHECK(memcmp(d.w, zero, sizeof zero) == 0);
    }
    pair_close(&d);
    return 0;
}

/* o's send buffer smaller than the frame: the goodbye is owed (nat24). */
static int test_owed_goodbye_to_a_slow_pinging_reader(void)
{
    return bye_to_slow_reader(128 * 1024, true);
}

/* The whole frame in o's socket already: the goodbye is said at once. */
static int test_goodbye_at_once_to_a_slow_pinging_reader(void)
{
    return bye_to_slow_reader(4 << 20, false);
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_owed_goodbye_to_a_slow_pinging_reader),
        T_CASE(test_goodbye_at_once_to_a_slow_pinging_reader),
    };
    return T_RUN(argc, argv, cases);
}

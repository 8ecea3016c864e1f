/* The test-only mock transport (mock.h): the native core tests drive its
 * completions. Adding a transport is this: one file defining one
 * axf_transport, one line in transports.c, one meson option. */
#include "mock.h"

#include <stdlib.h>
#include <string.h>

#define MOCK_PEERS 64

typedef struct mock_state {
    pthread_mutex_t mu; /* after e->mu */
    op **q;             /* submitted, not finished: in submit order */
    size_t n, cap;
    conn *peers[MOCK_PEERS]; /* a reference each, until destroy */
    bool closed[MOCK_PEERS];
    size_t npeers;
} mock_state;

static mock_state *mock_of(axf_engine *e) { return e->xp[AXF_EP_MOCK]; }

static int mock_enable(axf_engine *e)
{
    mock_state *m = calloc(1, sizeof *m);
    if (!m)
        return AXF_E_NOMEM;
    pthread_mutex_init(&m->mu, NULL);
    e->xp[AXF_EP_MOCK] = m;
    return AXF_OK;
}

static bool mock_submit(axf_engine *e, op *o, uint32_t flags) /* e->mu held; unlocks */
{
    (void)flags;
    mock_state *m = mock_of(e);
    atomic_store(&o->remaining, 1); /* its data phase: one unit, the test's */
    pthread_mutex_lock(&m->mu);
    bool ok = true;
    if (m->n == m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 64;
        op **nq = realloc(m->q, ncap * sizeof *nq);
        if (nq) {
            m->q = nq;
            m->cap = ncap;
        }
        ok = nq != NULL;
    }
    if (ok)
        m->q[m->n++] = o;
    pthread_mutex_unlock(&m->mu);
    pthread_mutex_unlock(&e->mu);
    if (!ok)
        op_set_status(o, AXF_E_NOMEM, 0);
    return ok;
}

static op *mock_take(mock_state *m, uint64_t req_id, bool any) /* m->mu held */
{
    for (size_t i = 0; i < m->n; i++)
        if (any || m->q[i]->req_id == req_id) {
            op *o = m->q[i];
            memmove(&m->q[i], &m->q[i + 1], (m->n - i - 1) * sizeof *m->q);
            m->n--;
            return o;
        }
    return NULL;
}

size_t axf_mock_pending(axf_engine *e, uint64_t *req_ids, size_t max)
{
    mock_state *m = mock_of(e);
    pthread_mutex_lock(&m->mu);
    size_t n = m->n;
    for (size_t i = 0; i < n && i < max; i++)
        req_ids[i] = m->q[i]->req_id;
    pthread_mutex_unlock(&m->mu);
    return n;
}

int axf_mock_complete(axf_engine *e, uint64_t req_id, int32_t status, uint64_t nbytes)
{
    mock_state *m = mock_of(e);
    pthread_mutex_lock(&m->mu);
    op *o = mock_take(m, req_id, false);
    pthread_mutex_unlock(&m->mu);
    if (!o)
        return AXF_E_NOTFOUND;
    atomic_fetch_add(&o->nbytes, nbytes);
    op_set_status(o, status, 0);
    op_unit_done(e, o);
    return AXF_OK;
}

/* Shutdown, once no connection thread runs: what is still queued fails
 * (the core marked it AXF_E_CLOSED). */
static void mock_stop(axf_engine *e)
{
    mock_state *m = mock_of(e);
    if (!m)
        return;
    for (;;) {
        pthread_mutex_lock(&m->mu);
        op *o = mock_take(m, 0, true);
        pthread_mutex_unlock(&m->mu);
        if (!o)
            break;
        op_set_status(o, AXF_E_CLOSED, 0);
        op_unit_done(e, o);
    }
}

static conn *mock_peer(axf_engine *e, uint64_t peer, bool take_close)
{
    mock_state *m = mock_of(e);
    conn *c = NULL;
    pthread_mutex_lock(&m->mu);
    if (peer < m->npeers && !m->closed[peer]) {
        c = m->peers[peer];
        if (take_close)
            m->closed[peer] = true;
    }
    pthread_mutex_unlock(&m->mu);
    return c;
}

static int mock_add_peer(axf_engine *e, endpoint *ep, uint64_t tag, uint64_t *peer_out)
{
    /* e->mu held */
    mock_state *m = mock_of(e);
    pthread_mutex_lock(&m->mu);
    bool room = m->npeers < MOCK_PEERS;
    pthread_mutex_unlock(&m->mu);
    if (!room)
        return AXF_E_LIMIT;
    conn *c = conn_detached(e, ep, tag);
    if (!c)
        return AXF_E_NOMEM;
    conn_ref(c); /* ours */
    pthread_mutex_lock(&m->mu);
    *peer_out = m->npeers;
    m->peers[m->npeers++] = c;
    pthread_mutex_unlock(&m->mu);
    return AXF_OK;
}

int axf_mock_connect(axf_engine *e, uint64_t ep_id, uint64_t *peer_out)
{
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    int st = e->shut                            ? AXF_E_CLOSED
             : !ep || ep->kind != AXF_EP_MOCK ? AXF_E_NOTFOUND
             : ep->dead || ep->closing         ? AXF_E_CLOSED
             : ep->nconns == AXF_MAX_CONNS     ? AXF_E_LIMIT
                                               : AXF_OK;
    if (st == AXF_OK)
        st = mock_add_peer(e, ep, ep->tag, peer_out);
    if (st == AXF_OK) {
        mock_state *m = mock_of(e);
        conn *c = m->peers[*peer_out];
        c->slot = ep->nconns;
        conn_ref(c); /* the endpoint slot's */
        ep->conns[ep->nconns++] = c;
        ep->live_conns++;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

int axf_mock_accept(axf_engine *e, uint64_t tag, uint64_t *peer_out)
{
    pthread_mutex_lock(&e->mu);
    int st = e->shut ? AXF_E_CLOSED : mock_add_peer(e, NULL, tag, peer_out);
    pthread_mutex_unlock(&e->mu);
    return st;
}

bool axf_mock_take(axf_engine *e, uint64_t peer, wire_hdr *h)
{
    conn *c = mock_peer(e, peer, false);
    return c && conn_detached_take(c, h);
}

int axf_mock_deliver(axf_engine *e, uint64_t peer, const wire_hdr *h)
{
    conn *c = mock_peer(e, peer, false);
    if (!c)
        return AXF_E_NOTFOUND;
    if ((h->len && h->type != FR_WRITE_ACK) || h->nseg)
        return AXF_E_INVALID; /* header-only frames: there is no socket to read a payload
                                 or a segment table from */
    static uint8_t scratch[4096];
    bool proto = false;
    int io = 0;
    const char *why = conn_rx_frame(c, h, scratch, &proto, &io);
    return why ? (proto ? AXF_E_PROTOCOL : AXF_E_CLOSED) : AXF_OK;
}

int axf_mock_close(axf_engine *e, uint64_t peer)
{
    conn *c = mock_peer(e, peer, true);
    if (!c)
        return AXF_E_NOTFOUND;
    conn_detached_close(c);
    return AXF_OK;
}

/* Shutdown, before the core waits for connection threads: its detached
 * connections end as their threads would. */
static void mock_quiesce(axf_engine *e)
{
    mock_state *m = mock_of(e);
    for (uint64_t i = 0; m && i < MOCK_PEERS; i++)
        (void)axf_mock_close(e, i);
}

static void mock_destroy(axf_engine *e)
{
    mock_state *m = mock_of(e);
    if (!m)
        return;
    for (size_t i = 0; i < m->npeers; i++)
        conn_unref(m->peers[i]);
    free(m->q);
    pthread_mutex_destroy(&m->mu);
    free(m);
    e->xp[AXF_EP_MOCK] = NULL;
}

void axf_mock_faults(axf_engine *e, const axf_faults *f)
{
    pthread_mutex_lock(&e->mu);
    /* (atomic: tx_main reads it without e->mu) */
    __atomic_store_n(&e->faults, f, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->mu);
}

const axf_transport axf_xp_mock = {
    .abi = AXF_TRANSPORT_ABI,
    .name = "mock",
    .ep_kind = AXF_EP_MOCK,
    .caps = AXF_XP_CAP_NOTIFY | AXF_XP_CAP_OWN_DATA,
    .local_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .far_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .enable = mock_enable,
    .quiesce = mock_quiesce,
    .stop = mock_stop,
    .destroy = mock_destroy,
    .submit = mock_submit,
};

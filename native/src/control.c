/* The control channel every transport's endpoints use, over the framed
 * connections of conn.c: the keepalive (when a connection pings, what counts
 * as progress, when a peer is silent or a connection stalled), bound
 * notifications, revocation of our regions (target side: quarantine until
 * every peer that may touch one acknowledged or is gone) and of peers'
 * (initiator side: acknowledged once no op of ours uses it), and goodbyes (a
 * same-host endpoint's copies are over). conn.c moves the frames; what to
 * send when, and what a silence means, is decided here. */
#include "transport.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>

/* ---------------------------------------------------------------- keepalive */

/* Each connection's sender pings (FR_PING, a bare header) once it sent
 * nothing for its interval (ka_interval: keepalive_ms for the first
 * connection to a peer); a receiver that hears nothing (pings included)
 * for peer_timeout_ms declares the peer silent (its socket's receive
 * timeout). A ping carries its sender's peer_timeout_ms (in len), and the
 * side that hears it pings at a third of that when its own keepalive is
 * longer: agents configured apart (one with a 1 s timeout, one with the
 * default 1 s keepalive) would otherwise drop each other's idle
 * connections. Progress is a frame of ours sent, or a reply received: pings
 * are liveness, not progress. With stall detection (stall_ms), a connection that
 * owes us replies and made no progress either way for stall_ms is stalled,
 * and so is a blocking send that moved nothing for that long (a peer that
 * pings but does not read). */

void ka_configure(axf_config *cfg)
{
    if (!cfg->keepalive_ms)
        cfg->keepalive_ms = 1000;
    if (!cfg->peer_timeout_ms)
        cfg->peer_timeout_ms = 5000;
    if (cfg->keepalive_ms * 2 > cfg->peer_timeout_ms)
        cfg->keepalive_ms = cfg->peer_timeout_ms / 3 ? cfg->peer_timeout_ms / 3 : 1;
}

/* Microseconds since the time stamp *t, which other threads move forward.
 * Loaded before the clock is read: read after, a stamp taken later than our
 * clock would make the difference wrap to ~2^64 (a connection declared
 * stalled, or silent, moments after it made progress). */
static uint64_t us_since(atomic_ullong *t)
{
    uint64_t last = atomic_load(t);
    uint64_t now = axf_now_us();
    return now > last ? now - last : 0;
}

void ka_init(conn *c)
{
    uint64_t now = axf_now_us();
    atomic_init(&c->ka.progress_us, now);
    atomic_init(&c->ka.last_rx_us, now);
    c->ka.last_send_ms = now / 1000;
    atomic_init(&c->ka.ping_ms, c->e->cfg.keepalive_ms);
    atomic_init(&c->ka.peer_to_ms, 0);
}

bool ka_leads(axf_engine *e, const endpoint *ep, uint64_t tag)
{
    for (const conn *s = e->conns; s; s = s->next_all)
        if (s->ep == ep && s->tag == tag && s->ka.lead && !atomic_load(&s->down))
            return false;
    return true;
}

void ka_arm_socket(conn *c)
{
    const axf_config *cfg = &c->e->cfg;
    struct timeval tv = {.tv_sec = cfg->peer_timeout_ms / 1000,
                         .tv_usec = (cfg->peer_timeout_ms % 1000) * 1000};
    (void)setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    /* A send that moves nothing for the stall time is a stall too (a peer that
     * pings but does not read). */
    uint32_t snd_ms = cfg->stall_ms && cfg->stall_ms < cfg->peer_timeout_ms ? cfg->stall_ms
                                                                             : cfg->peer_timeout_ms;
    struct timeval stv = {.tv_sec = snd_ms / 1000, .tv_usec = (snd_ms % 1000) * 1000};
    (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &stv, sizeof stv);
}

void ka_restart(conn *c)
{
    c->ka.last_send_ms = axf_now_ms();
}

void ka_sent(conn *c, uint64_t now_us)
{
    atomic_store(&c->ka.progress_us, now_us);
    c->ka.last_send_ms = now_us / 1000;
}

void ka_progress(conn *c)
{
    atomic_store(&c->ka.progress_us, axf_now_us());
}

/* The interval a peer whose timeout is peer_timeout_ms needs from us; never
 * longer than ours, nor under 10 ms (len is the peer's word: a hostile one
 * must not make us flood it). */
static uint32_t ping_ms_for(const axf_config *cfg, uint64_t peer_timeout_ms)
{
    uint64_t want = peer_timeout_ms / 3;
    if (want < 10)
        want = 10;
    return want < cfg->keepalive_ms ? (uint32_t)want : cfg->keepalive_ms;
}

bool ka_heard(conn *c, const wire_hdr *h)
{
    atomic_store(&c->ka.last_rx_us, axf_now_us());
    if (h->magic != AXF_MAGIC || h->type != FR_PING)
        return false;
    if (h->len) {
        if (atomic_load_explicit(&c->ka.peer_to_ms, memory_order_relaxed) != h->len)
            atomic_store(&c->ka.peer_to_ms, h->len);
        uint32_t want = ping_ms_for(&c->e->cfg, h->len);
        if (want < atomic_load(&c->ka.ping_ms)) { /* once per connection, at most a few */
            pthread_mutex_lock(&c->mu);
            atomic_store(&c->ka.ping_ms, want);
            pthread_cond_broadcast(&c->cv); /* the sender waits on the old interval */
            pthread_mutex_unlock(&c->mu);
        }
    }
    return true;
}

bool ka_silent(int io)
{
    return io == -EAGAIN || io == -ETIMEDOUT;
}

void ka_ping_frame(conn *c, wire_hdr *h)
{
    *h = (wire_hdr){.magic = AXF_MAGIC, .type = FR_PING, .len = c->e->cfg.peer_timeout_ms};
}

bool ka_send_waits(conn *c)
{
    const axf_config *cfg = &c->e->cfg;
    return !cfg->stall_ms && !atomic_load(&c->down) && !atomic_load(&c->flush_close) &&
           us_since(&c->ka.last_rx_us) < (uint64_t)cfg->peer_timeout_ms * 1000u;
}

void ka_send_failed(conn *c, int err)
{
    const axf_config *cfg = &c->e->cfg;
    if ((err == -EAGAIN || err == -EWOULDBLOCK) && cfg->stall_ms && c->ep &&
        cfg->stall_ms < cfg->peer_timeout_ms)
        atomic_store(&c->stalled, true);
}

/* The ping interval of c. Its group's lead (the first connection to the
 * peer) pings every ping_ms: the peer link is pinged as configured. Its
 * other connections (a tcp peer's rails) ping every half of the peer's
 * timeout (ka_configure's bound: a keepalive may be half the timeout), once
 * a ping of the peer told it and after their own first ping (at ping_ms: the
 * peer hears each early, and learns our timeout). Each is still heard within
 * the peer's timeout and judged silent on its own, exactly as before, while
 * an idle agent wakes about half as often (issue 13: 4 connections to each
 * of 10 peers, both ways, pinged each second, cost 0.6 % of a core here). A
 * hostile peer's large timeout only makes us ping it less: it then declares
 * us silent itself. */
static uint64_t ka_interval(conn *c)
{
    uint64_t ms = atomic_load(&c->ka.ping_ms);
    uint64_t half = atomic_load(&c->ka.peer_to_ms) / 2;
    return !c->ka.lead && c->ka.pinged && half > ms ? half : ms;
}

ka_step ka_next(conn *c, bool owed, uint64_t *wait_ms)
{
    const axf_config *cfg = &c->e->cfg;
    uint64_t keepalive = ka_interval(c);
    uint64_t stall_us = (uint64_t)cfg->stall_ms * 1000u;
    uint64_t now = axf_now_ms();
    if (!c->sending && now - c->ka.last_send_ms >= keepalive)
        return KA_PING;
    if (stall_us && c->ep && owed && !c->sending && us_since(&c->ka.progress_us) > stall_us) {
        /* Replies are owed and nothing moved either way: the peer is
         * alive (it pings) but does not serve us. */
        atomic_store(&c->stalled, true);
        return KA_STALLED;
    }
    uint64_t since = now - c->ka.last_send_ms;
    uint64_t w = since < keepalive ? keepalive - since : 1;
    if (stall_us && w > stall_us / 4000 + 1)
        w = stall_us / 4000 + 1; /* the stall check runs at least 4 times per stall time */
    *wait_ms = w;
    return KA_IDLE;
}

/* ---------------------------------------------------------------- notify */

conn *endpoint_live_conn(endpoint *ep)
{
    for (int i = 0; i < ep->nconns; i++)
        if (!atomic_load(&ep->conns[i]->down))
            return ep->conns[i];
    return NULL;
}

conn *notify_enqueue(axf_engine *e, op *o)
{
    (void)e;
    conn *c = endpoint_live_conn(o->ep);
    if (!c)
        return NULL;
    sq_item *it = sq_new(FR_NOTIFY, o->req_id);
    uint8_t *copy = malloc(o->notify_len);
    if (!it || !copy) {
        free(it);
        free(copy);
        op_set_status(o, AXF_E_NOMEM, 0);
        return NULL;
    }
    /* The frame owns a copy: the acknowledgement (and the op's end) can come
     * before the sending thread is back from sendmsg, and a rerouted
     * notification is sent again from the op's own. */
    memcpy(copy, o->notify, o->notify_len);
    it->h.len = o->notify_len;
    it->payload = it->owned = copy;
    it->plen = o->notify_len;
    it->op = o;
    atomic_fetch_add(&o->pins, 1);
    conn_enqueue(c, it, false);
    return c;
}

/* ---------------------------------------------------------------- revoke: target */

/* e->mu held; r is registered. Every peer that may still touch r is told to
 * forget it (if its connection is up) and waited for: same-host peers copy
 * into our memory without asking us. *held: some are, and the revocation
 * took over one reference of r, dropped once the last of them acknowledged
 * or is gone; else the caller drops it (unlocked: it may be r's last).
 * Everything is allocated first: AXF_E_NOMEM changes nothing. *timed: a tcp
 * peer got a deadline (the watcher must look). */
static int revoke_peers(axf_engine *e, region *r, bool *held, bool *timed)
{
    size_t n = 0;
    for (conn *c = e->conns; c; c = c->next_all)
        n += !c->ep && !c->gone && r->kind != AXF_MEM_FILE; /* peers never reach files */
    revocation *rv = NULL;
    rv_wait **ws = NULL;
    sq_item **its = NULL;
    *timed = *held = false;
    if (n) {
        rv = calloc(1, sizeof *rv);
        ws = calloc(n, sizeof *ws);
        its = calloc(n, sizeof *its);
        bool ok = rv && ws && its;
        for (size_t i = 0; ok && i < n; i++)
            ok = (ws[i] = calloc(1, sizeof *ws[i])) && (its[i] = sq_new(FR_REVOKE, 0));
        if (!ok) {
            for (size_t i = 0; ws && its && i < n; i++) {
                free(ws[i]);
                free(its[i]);
            }
            free(ws);
            free(its);
            free(rv);
            return AXF_E_NOMEM;
        }
    }
    uint64_t now = axf_now_ms();
    size_t k = 0;
    for (conn *c = e->conns; c && n; c = c->next_all) {
        if (c->ep || c->gone || r->kind == AXF_MEM_FILE)
            continue;
        rv_wait *w = ws[k];
        sq_item *it = its[k++];
        w->rv = rv;
        w->since_ms = now;
        w->next = c->revokes;
        c->revokes = w;
        rv->waiting++;
        *timed |= c->pidfd < 0;
        if (c->exited) { /* held: a closed same-host peer that may still copy */
            free(it);
            continue;
        }
        it->h.rid = r->id;
        it->h.key = r->key;
        conn_enqueue(c, it, true);
    }
    free(ws);
    free(its);
    if (rv) {
        rv->r = r;
        rv->qnext = e->quarantine;
        if (e->quarantine)
            e->quarantine->qprev = rv;
        e->quarantine = rv;
        e->quarantined++;
        e->quarantined_bytes += r->len;
        *held = true;
    }
    return AXF_OK;
}

int axf_region_revoke(axf_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->mu);
    region *r = e->regions[id % AXF_REGION_BUCKETS];
    while (r && r->id != id)
        r = r->next;
    int st = r ? AXF_OK : AXF_E_NOTFOUND;
    bool held = false, timed = false;
    /* A file region is never a peer's: nothing to revoke (and the file
     * transport's own look-ups must still find it). */
    if (r && !r->revoked && r->kind != AXF_MEM_FILE) {
        atomic_fetch_add(&r->refs, 1); /* the revocation's: the registry keeps its own */
        st = revoke_peers(e, r, &held, &timed);
        if (st == AXF_OK)
            r->revoked = true; /* peers' look-ups miss it from now on */
        if (!held)
            atomic_fetch_sub(&r->refs, 1); /* the registry holds another: never the last */
    }
    pthread_mutex_unlock(&e->mu);
    if (timed)
        watch_wake(e); /* a new deadline */
    return st;
}

int axf_region_deregister(axf_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->mu);
    region **p = &e->regions[id % AXF_REGION_BUCKETS];
    while (*p && (*p)->id != id)
        p = &(*p)->next;
    region *r = *p;
    if (!r) {
        pthread_mutex_unlock(&e->mu);
        return AXF_E_NOTFOUND;
    }
    bool held = false, timed = false;
    if (r->revoked) {
        /* Every peer was told at its revocation, and none has learnt its key
         * since (no look-up of a peer finds it): what is left is our own
         * use. The registry's reference goes; our ops' hold it. */
        *p = r->next;
        pthread_mutex_unlock(&e->mu);
        region_unref(e, r);
        return AXF_OK;
    }
    int st = revoke_peers(e, r, &held, &timed); /* held: took the registry's reference */
    if (st == AXF_OK)
        *p = r->next; /* unreachable from now on: new accesses fail */
    pthread_mutex_unlock(&e->mu);
    if (timed)
        watch_wake(e); /* a new deadline */
    if (st == AXF_OK && !held)
        region_unref(e, r);
    return st;
}

/* Target side: one of the region's revocations is over. e->mu held. */
static void revoke_settled(axf_engine *e, revocation *rv)
{
    if (--rv->waiting == 0) {
        if (rv->qprev)
            rv->qprev->qnext = rv->qnext;
        else
            e->quarantine = rv->qnext;
        if (rv->qnext)
            rv->qnext->qprev = rv->qprev;
        e->quarantined--;
        e->quarantined_bytes -= rv->r->len;
        region_unref(e, rv->r); /* only the ring lock inside: fine under e->mu */
        free(rv);
    }
}

/* e->mu held: every revocation c holds is over. */
void revokes_settle_all(axf_engine *e, conn *c)
{
    rv_wait *w = c->revokes;
    c->revokes = NULL;
    while (w) {
        rv_wait *n = w->next;
        revoke_settled(e, w->rv);
        free(w);
        w = n;
    }
}

int axf_region_holders(axf_engine *e, uint64_t rid, uint64_t *tags_out, size_t max)
{
    pthread_mutex_lock(&e->mu);
    revocation *rv = e->quarantine;
    while (rv && rv->r->id != rid)
        rv = rv->qnext;
    int n = 0;
    for (conn *c = e->conns; rv && c; c = c->next_all)
        for (rv_wait *w = c->revokes; w; w = w->next)
            if (w->rv == rv) {
                if ((size_t)n < max)
                    tags_out[n] = c->tag;
                n++;
                break;
            }
    pthread_mutex_unlock(&e->mu);
    return rv ? n : AXF_E_NOTFOUND;
}

int revoke_acked(axf_engine *e, conn *c, uint64_t rid)
{
    pthread_mutex_lock(&e->mu);
    rv_wait **p = &c->revokes;
    while (*p && (*p)->rv->r->id != rid)
        p = &(*p)->next;
    rv_wait *w = *p;
    if (w) {
        *p = w->next;
        revoke_settled(e, w->rv);
        free(w);
    }
    pthread_mutex_unlock(&e->mu);
    return w ? AXF_OK : AXF_E_PROTOCOL;
}

/* The connection's socket is closed (its threads are leaving). */
void revokes_drop(axf_engine *e, conn *c)
{
    pthread_mutex_lock(&e->mu);
    c->exited = true;
    if (c->pidfd >= 0 && !c->released && !atomic_load(&c->peer_exited)) {
        /* Same host: a stopped process keeps its mappings and its right to
         * copy into us; only its exit (the watcher) or a goodbye ends it.
         * One held connection per process is enough to wait for it: a
         * process that connects and disconnects again and again adds to
         * the one already held, not a pidfd each. */
        for (conn *h = e->conns; h; h = h->next_all)
            if (h != c && !h->ep && h->exited && !h->gone && h->pidfd >= 0 &&
                h->peer_pid == c->peer_pid && !atomic_load(&h->peer_exited)) {
                rv_wait **tail = &h->revokes;
                while (*tail)
                    tail = &(*tail)->next;
                *tail = c->revokes;
                c->revokes = NULL;
                c->gone = true; /* its waits are h's now */
                pthread_mutex_unlock(&e->mu);
                return;
            }
        atomic_fetch_add(&e->held_conns, 1);
        pthread_mutex_unlock(&e->mu);
        watch_wake(e);
        return;
    }
    c->gone = true;
    revokes_settle_all(e, c);
    pthread_mutex_unlock(&e->mu);
}

void bye_received(axf_engine *e, conn *c)
{
    pthread_mutex_lock(&e->mu);
    c->released = true;
    revokes_settle_all(e, c);
    pthread_mutex_unlock(&e->mu);
}

/* The watcher saw the same-host peer of accepted connection c exit. e->mu held. */
void conn_peer_exited(axf_engine *e, conn *c)
{
    atomic_store(&c->peer_exited, true);
    if (c->exited) { /* held until now */
        if (!c->gone && !c->released)
            atomic_fetch_sub(&e->held_conns, 1);
        c->gone = true;
        revokes_settle_all(e, c);
        conn_registry_drop(e, c);
    } else {
        conn_kill(c); /* its receiver leaves and revokes_drop settles */
    }
}

/* ---------------------------------------------------------------- revoke: initiator */

/* Initiator side: acknowledges every revocation of ep whose region no op uses
 * any more, and unmaps what it had mapped of it. e->mu held. */
void rv_acks_flush(axf_engine *e, endpoint *ep)
{
    for (rv_ack **p = &e->rv_acks; *p;) {
        rv_ack *a = *p;
        bool busy = false;
        if (a->ep == ep)
            for (rregion *rr = ep->rregions; rr && !busy; rr = rr->next)
                busy = rr->rid == a->rid && rr->key == a->key && atomic_load(&rr->users);
        if (a->ep != ep || busy) {
            p = &a->next;
            continue;
        }
        for (rregion *rr = ep->rregions; rr; rr = rr->next)
            if (rr->rid == a->rid && rr->key == a->key) {
                rr_unmap(rr);
            }
        sq_item *it = sq_new(FR_REVOKE_ACK, 0);
        if (it) {
            it->h.rid = a->rid;
            it->h.key = a->key;
            conn_enqueue_reply(a->c, it, true);
        } else {
            conn_kill(a->c); /* the target then stops waiting for us */
        }
        a->c->rv_pending--;
        conn_unref(a->c);
        *p = a->next;
        free(a);
    }
}

/* Initiator side: the target revoked rid/key (on each of its connections
 * to us). Bounded whatever the target sends: a region nothing uses is
 * acknowledged at once (a reply, counted against reply_queue_bytes like any
 * other); one an op still uses waits in one entry per connection and
 * imported region, and a second revocation of it on the same connection
 * while the first waits is a protocol error. */
int revoke_received(axf_engine *e, conn *c, uint64_t rid, uint64_t key)
{
    endpoint *ep = c->ep;
    pthread_mutex_lock(&e->mu);
    bool busy = false, dup = false;
    for (rregion *rr = ep->rregions; rr; rr = rr->next)
        if (rr->rid == rid && rr->key == key) {
            rr->gone = true; /* no new op resolves it */
            atomic_store(&rr->revoked, true);
            busy |= atomic_load(&rr->users) != 0;
        }
    for (rv_ack *a = busy ? e->rv_acks : NULL; a && !dup; a = a->next)
        dup = a->c == c && a->rid == rid && a->key == key;
    if (dup) {
        pthread_mutex_unlock(&e->mu);
        return AXF_E_PROTOCOL;
    }
    if (busy) {
        rv_ack *a = calloc(1, sizeof *a);
        if (!a) {
            conn_kill(c);
            pthread_mutex_unlock(&e->mu);
            return AXF_E_NOMEM;
        }
        a->c = c;
        conn_ref(c);
        c->rv_pending++;
        a->ep = ep;
        a->rid = rid;
        a->key = key;
        a->next = e->rv_acks;
        e->rv_acks = a;
    }
    /* Now, or once the ops holding it are done (op_release_remote). */
    rv_acks_flush(e, ep);
    if (!busy) {
        for (rregion *rr = ep->rregions; rr; rr = rr->next)
            if (rr->rid == rid && rr->key == key) {
                rr_unmap(rr);
            }
        sq_item *it = sq_new(FR_REVOKE_ACK, 0);
        if (!it) {
            conn_kill(c);
            pthread_mutex_unlock(&e->mu);
            return AXF_E_NOMEM;
        }
        it->h.rid = rid;
        it->h.key = key;
        conn_enqueue_reply(c, it, true);
    }
    pthread_mutex_unlock(&e->mu);
    return AXF_OK;
}

/* ---------------------------------------------------------------- goodbye */

void ep_maybe_bye(axf_engine *e, endpoint *ep)
{
    (void)e;
    if (ep->bye_sent || !ep->closing || !ep_same_host(ep))
        return;
    for (op *o = ep->ops; o; o = o->next)
        if (o->phase == 0)
            return; /* a copy of it may still run */
    /* No copy of ours runs, none will: nothing touches the peer's memory. */
    for (rregion *rr = ep->rregions; rr; rr = rr->next)
        rr_unmap(rr);
    ep_send_bye(ep);
}

void ep_send_bye(endpoint *ep)
{
    ep->bye_sent = true;
    for (int i = 0; i < ep->nconns; i++) {
        conn *c = ep->conns[i];
        if (atomic_load(&c->down))
            continue;
        sq_item *it = sq_new(FR_BYE, 0);
        if (!it) {
            conn_kill(c); /* the peer then waits for our exit instead */
            continue;
        }
        conn_enqueue(c, it, true);
        conn_close_after_flush(c);
    }
}

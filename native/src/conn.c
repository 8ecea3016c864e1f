/* The framed socket transport. Each connection has a receiver thread (blocking
 * reads, zero-copy into registered memory) and a sender thread (gathered
 * sendmsg from registered memory, keepalive pings when idle). The accepting
 * side checks every frame against its region table before touching memory. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define TX_BATCH 64
#define DISCARD_BYTES (64u << 10)

/* What the initiator expects back on one connection, in order. */
typedef struct expect {
    op *op;
    uint64_t op_id;
    uint16_t type; /* FR_WRITE_ACK, FR_READ_RESP or FR_NOTIFY_ACK */
    struct expect *next;
} expect;

typedef struct conn_priv {
    conn c;
    expect *ex_head, *ex_tail; /* guarded by c.mu */
} conn_priv;

sq_item *sq_new(int type, uint64_t op_id)
{
    sq_item *it = calloc(1, sizeof *it);
    if (!it)
        return NULL;
    it->h.magic = AXF_MAGIC;
    it->h.type = (uint16_t)type;
    it->h.op = op_id;
    return it;
}

static void sq_release(axf_engine *e, sq_item *it)
{
    if (it->reg)
        region_unref(e, it->reg);
    if (it->op)
        op_unpin(e, it->op);
    free(it->owned);
    free(it);
}

void conn_signal(conn *c)
{
    pthread_mutex_lock(&c->mu);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void conn_enqueue(conn *c, sq_item *it, bool signal)
{
    conn_priv *p = (conn_priv *)c;
    pthread_mutex_lock(&c->mu);
    if (c->dead) {
        /* Initiator frames: the endpoint's failure path completes the op. */
        pthread_mutex_unlock(&c->mu);
        sq_release(c->e, it);
        return;
    }
    uint16_t want = 0;
    if (it->op && it->h.type == FR_NOTIFY)
        want = FR_NOTIFY_ACK;
    else if (it->op && (it->h.flags & FL_LAST))
        want = it->h.type == FR_WRITE ? FR_WRITE_ACK : FR_READ_RESP;
    if (want) {
        expect *x = calloc(1, sizeof *x);
        if (!x) { /* without an expectation the reply would be rejected: fail the conn */
            c->dead = true;
            shutdown(c->fd, SHUT_RDWR);
            pthread_cond_signal(&c->cv);
            pthread_mutex_unlock(&c->mu);
            sq_release(c->e, it);
            return;
        }
        x->op = it->op;
        x->op_id = it->h.op;
        x->type = want;
        if (p->ex_tail)
            p->ex_tail->next = x;
        else
            p->ex_head = x;
        p->ex_tail = x;
    }
    if (c->tail)
        c->tail->next = it;
    else
        c->head = it;
    c->tail = it;
    if (signal)
        pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void conn_kill(conn *c)
{
    pthread_mutex_lock(&c->mu);
    if (!c->dead) {
        c->dead = true;
        shutdown(c->fd, SHUT_RDWR); /* wakes both threads out of their syscalls */
    }
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------ raw I/O */

/* 0 on success, else -errno (or -EPIPE on orderly close). */
static int read_full(int fd, void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t r = recv(fd, p, len, MSG_WAITALL);
        if (r > 0) {
            p += r;
            len -= (size_t)r;
        } else if (r == 0) {
            return -EPIPE;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return 0;
}

static int discard(int fd, uint8_t *scratch, uint64_t len)
{
    while (len) {
        size_t n = len < DISCARD_BYTES ? (size_t)len : DISCARD_BYTES;
        int r = read_full(fd, scratch, n);
        if (r)
            return r;
        len -= n;
    }
    return 0;
}

static int send_all(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        size_t done = (size_t)r;
        while (cnt > 0 && done >= iov->iov_len) {
            done -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + done;
            iov->iov_len -= done;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ threads */

static void thread_exit(conn *c)
{
    axf_engine *e = c->e;
    if (atomic_fetch_sub(&c->threads, 1) == 1) {
        conn_priv *p = (conn_priv *)c;
        pthread_mutex_lock(&c->mu);
        expect *x = p->ex_head;
        p->ex_head = p->ex_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        while (x) {
            expect *n = x->next;
            free(x);
            x = n;
        }
        close(c->fd);
        atomic_fetch_sub(&e->n_conns, 1);
        if (!c->ep)
            revokes_drop(e, c); /* a dead peer touches nothing of ours any more */
        if (c->ep)
            endpoint_conn_finished(e, c->ep);
        else
            cq_push(e, AXF_CQ_CONN_CLOSED, AXF_OK, 0, c->tag, 0, 0, NULL, 0);
    }
    pthread_mutex_lock(&e->th_mu);
    e->conn_threads--;
    pthread_cond_broadcast(&e->th_cv);
    pthread_mutex_unlock(&e->th_mu);
}

static void *tx_main(void *arg)
{
    conn *c = arg;
    axf_engine *e = c->e;
    sq_item *batch[TX_BATCH];
    struct iovec iov[2 * TX_BATCH];
    uint64_t keepalive = e->cfg.keepalive_ms;
    uint64_t last_send = axf_now_ms();

    pthread_mutex_lock(&c->mu);
    while (!c->dead) {
        if (!c->head) {
            uint64_t now = axf_now_ms();
            if (now - last_send >= keepalive) {
                pthread_mutex_unlock(&c->mu);
                wire_hdr ping = {.magic = AXF_MAGIC, .type = FR_PING};
                struct iovec pv = {.iov_base = &ping, .iov_len = sizeof ping};
                int r = send_all(c->fd, &pv, 1);
                last_send = axf_now_ms();
                pthread_mutex_lock(&c->mu);
                if (r) {
                    if (!c->dead) {
                        c->dead = true;
                        shutdown(c->fd, SHUT_RDWR);
                    }
                    break;
                }
                continue;
            }
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t wait_ms = keepalive - (now - last_send);
            ts.tv_sec += (time_t)(wait_ms / 1000);
            ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
            continue;
        }
        int n = 0;
        while (c->head && n < TX_BATCH) {
            sq_item *it = c->head;
            c->head = it->next;
            if (!c->head)
                c->tail = NULL;
            it->next = NULL;
            batch[n++] = it;
        }
        pthread_mutex_unlock(&c->mu);

        int niov = 0, keep = 0;
        for (int i = 0; i < n; i++) {
            sq_item *it = batch[i];
            bool data = it->op && (it->h.type == FR_WRITE || it->h.type == FR_READ_REQ);
            if (data && atomic_load(&it->op->cancelled)) {
                if (!(it->h.flags & FL_LAST)) {
                    sq_release(e, it);
                    continue;
                }
                /* The group's last frame still goes, empty, so it is acknowledged. */
                it->h.flags |= FL_ABORT;
                it->h.len = 0;
                it->payload = NULL;
                it->plen = 0;
            }
            batch[keep++] = it;
            iov[niov].iov_base = &it->h;
            iov[niov++].iov_len = sizeof it->h;
            if (it->plen) {
                iov[niov].iov_base = (void *)it->payload;
                iov[niov++].iov_len = it->plen;
            }
        }
        int r = niov ? send_all(c->fd, iov, niov) : 0;
        last_send = axf_now_ms();
        for (int i = 0; i < keep; i++)
            sq_release(e, batch[i]);
        pthread_mutex_lock(&c->mu);
        if (r) {
            if (!c->dead) {
                c->dead = true;
                shutdown(c->fd, SHUT_RDWR);
            }
            break;
        }
    }
    sq_item *rest = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    while (rest) {
        sq_item *n = rest->next;
        sq_release(e, rest);
        rest = n;
    }
    thread_exit(c);
    return NULL;
}

/* Looks up a local region for a remote access; returns it with a ref, or NULL. */
static region *target_region(axf_engine *e, const wire_hdr *h, uint32_t need)
{
    pthread_mutex_lock(&e->mu);
    region *r = region_get(e, h->rid);
    pthread_mutex_unlock(&e->mu);
    if (!r)
        return NULL;
    if (r->key != h->key || !(r->access & need) || h->off > r->len || h->len > r->len - h->off) {
        region_unref(e, r);
        return NULL;
    }
    return r;
}

static bool valid_status(int32_t st)
{
    return st <= 0 && st >= AXF_E_NOTFOUND;
}

/* Returns NULL to continue, or a reason (protocol errors set *proto). */
static const char *rx_target(conn *c, const wire_hdr *h, uint8_t *scratch, bool *proto, int *io)
{
    axf_engine *e = c->e;
    switch (h->type) {
    case FR_WRITE: {
        if (h->len > AXF_MAX_FRAME) {
            *proto = true;
            return "oversized WRITE frame";
        }
        if (!c->in_grp) {
            c->in_grp = true;
            c->grp_op = h->op;
            c->grp_status = AXF_OK;
            c->grp_fail = 0;
            c->grp_bytes = 0;
        } else if (c->grp_op != h->op) {
            *proto = true;
            return "WRITE frames of two requests interleaved";
        }
        if (h->flags & FL_ABORT) {
            if (h->len) {
                *proto = true;
                return "aborted WRITE frame with payload";
            }
            if (c->grp_status == AXF_OK)
                c->grp_status = AXF_E_CANCELLED;
        } else {
            region *r = target_region(e, h, AXF_ACCESS_WRITE);
            if (r) {
                *io = read_full(c->fd, r->addr + h->off, h->len);
                region_unref(e, r);
                if (*io)
                    return "connection lost inside a WRITE payload";
                c->grp_bytes += h->len;
            } else {
                if (c->grp_status == AXF_OK) {
                    c->grp_status = AXF_E_ACCESS;
                    c->grp_fail = h->index;
                }
                *io = discard(c->fd, scratch, h->len);
                if (*io)
                    return "connection lost inside a rejected WRITE payload";
            }
        }
        if (h->flags & FL_LAST) {
            sq_item *ack = sq_new(FR_WRITE_ACK, c->grp_op);
            if (!ack)
                return "out of memory";
            ack->h.status = c->grp_status;
            ack->h.index = c->grp_fail;
            ack->h.len = c->grp_bytes;
            c->in_grp = false;
            conn_enqueue(c, ack, true);
        }
        return NULL;
    }
    case FR_READ_REQ: {
        if (h->len > AXF_MAX_FRAME || (!h->len && !(h->flags & FL_ABORT))) {
            *proto = true;
            return "READ request of invalid length";
        }
        sq_item *resp = sq_new(FR_READ_RESP, h->op);
        if (!resp)
            return "out of memory";
        resp->h.index = h->index;
        resp->h.rid = h->rid;
        resp->h.off = h->off;
        resp->h.flags = h->flags & FL_LAST;
        if (h->flags & FL_ABORT) {
            resp->h.status = AXF_E_CANCELLED;
        } else {
            region *r = target_region(e, h, AXF_ACCESS_READ);
            if (r) {
                resp->reg = r;
                resp->payload = r->addr + h->off;
                resp->plen = h->len;
                resp->h.len = h->len;
            } else {
                resp->h.status = AXF_E_ACCESS;
            }
        }
        conn_enqueue(c, resp, true);
        return NULL;
    }
    case FR_NOTIFY: {
        if (!h->len || h->len > AXF_MAX_NOTIFY) {
            *proto = true;
            return "NOTIFY frame of invalid length";
        }
        *io = read_full(c->fd, scratch, h->len);
        if (*io)
            return "connection lost inside a NOTIFY payload";
        /* Everything sent before this frame on every connection of the request
         * was acknowledged before the initiator sent it: data is in memory. */
        /* The acknowledgement is queued before the application can see the
         * notification, so a receiver that closes right after receive() does
         * not usually leave it unsent. */
        sq_item *ack = sq_new(FR_NOTIFY_ACK, h->op);
        if (!ack)
            return "out of memory";
        conn_enqueue(c, ack, true);
        cq_push(e, AXF_CQ_NOTIFY, AXF_OK, h->op, c->tag, 0, 0, scratch, h->len);
        return NULL;
    }
    case FR_REVOKE_ACK:
        if (h->len || revoke_acked(e, c, h->rid) != AXF_OK) {
            *proto = true;
            return "REVOKE_ACK for no revocation";
        }
        return NULL;
    default:
        *proto = true;
        return "frame type not valid towards a target";
    }
}

static const char *rx_initiator(conn *c, const wire_hdr *h, bool *proto, int *io)
{
    conn_priv *p = (conn_priv *)c;
    if (h->type == FR_REVOKE) { /* unsolicited: the target deregistered a region */
        if (h->len) {
            *proto = true;
            return "REVOKE frame with payload";
        }
        revoke_received(c->e, c, h->rid, h->key);
        return NULL;
    }
    pthread_mutex_lock(&c->mu);
    expect *x = p->ex_head;
    pthread_mutex_unlock(&c->mu);
    if (!x || x->type != h->type || x->op_id != h->op || !valid_status(h->status)) {
        *proto = true;
        return "reply that matches no outstanding request";
    }
    op *o = x->op;
    bool last = h->type != FR_READ_RESP || (h->flags & FL_LAST);
    if (h->type == FR_READ_RESP) {
        if (h->index >= o->n) {
            *proto = true;
            return "READ response for a descriptor out of range";
        }
        const axf_desc *d = &o->d[h->index];
        if (h->status != AXF_OK) {
            if (h->len) {
                *proto = true;
                return "failed READ response with payload";
            }
            op_set_status(o, h->status, h->index);
        } else {
            if (!h->len || h->off < d->roff || h->off - d->roff > d->len ||
                h->len > d->len - (h->off - d->roff)) {
                *proto = true;
                return "READ response outside its request";
            }
            *io = read_full(c->fd, o->laddr[h->index] + (h->off - d->roff), h->len);
            if (*io)
                return "connection lost inside a READ payload";
            atomic_fetch_add(&o->nbytes, h->len);
        }
    } else if (h->type == FR_WRITE_ACK) {
        if (h->status != AXF_OK)
            op_set_status(o, h->status, h->index < o->n ? h->index : 0);
        else
            atomic_fetch_add(&o->nbytes, h->len);
    }
    if (last) {
        pthread_mutex_lock(&c->mu);
        p->ex_head = x->next;
        if (!p->ex_head)
            p->ex_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        free(x);
        op_unit_done(c->e, o);
    }
    return NULL;
}

static void *rx_main(void *arg)
{
    conn *c = arg;
    axf_engine *e = c->e;
    uint8_t *scratch = malloc(DISCARD_BYTES);
    const char *reason = scratch ? NULL : "out of memory";
    bool proto = false;
    int io = 0;
    wire_hdr h;
    while (!reason) {
        io = read_full(c->fd, &h, sizeof h);
        if (io) {
            reason = "connection lost";
            break;
        }
        if (h.magic != AXF_MAGIC) {
            proto = true;
            reason = "bad frame magic";
            break;
        }
        if (h.type == FR_PING)
            continue;
        if (c->ep)
            reason = rx_initiator(c, &h, &proto, &io);
        else
            reason = rx_target(c, &h, scratch, &proto, &io);
    }
    free(scratch);
    pthread_mutex_lock(&c->mu);
    bool by_us = c->dead; /* closed locally (shutdown, endpoint close) */
    pthread_mutex_unlock(&c->mu);
    if (proto) {
        atomic_fetch_add(&e->rejected, 1);
        cq_log(e, c->tag, "closing connection: malformed frame: %s (type %u)", reason,
               (unsigned)h.type);
    } else if (!by_us && (io == -EAGAIN || io == -ETIMEDOUT)) {
        cq_log(e, c->tag, "closing connection: peer silent for %u ms", e->cfg.peer_timeout_ms);
    } else if (!by_us && io && io != -EPIPE) {
        cq_log(e, c->tag, "closing connection: %s: %s", reason, strerror(-io));
    }
    conn_kill(c);
    if (c->ep) {
        /* One lost connection fails the whole endpoint, promptly. */
        pthread_mutex_lock(&e->mu);
        c->ep->dead = true;
        for (int i = 0; i < c->ep->nconns; i++)
            conn_kill(c->ep->conns[i]);
        pthread_mutex_unlock(&e->mu);
    }
    thread_exit(c);
    return NULL;
}

/* e->mu held. */
conn *conn_start(axf_engine *e, endpoint *ep, uint64_t tag, int fd, int *status)
{
    conn_priv *p = calloc(1, sizeof *p);
    if (!p) {
        close(fd);
        *status = AXF_E_NOMEM;
        return NULL;
    }
    conn *c = &p->c;
    c->e = e;
    c->ep = ep;
    c->tag = tag;
    c->fd = fd;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);

    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* fails on unix sockets */
    struct timeval tv = {.tv_sec = e->cfg.peer_timeout_ms / 1000,
                         .tv_usec = (e->cfg.peer_timeout_ms % 1000) * 1000};
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);

    atomic_init(&c->threads, 2);
    pthread_mutex_lock(&e->th_mu);
    e->conn_threads += 2;
    pthread_mutex_unlock(&e->th_mu);
    c->next_all = e->conns;
    e->conns = c;
    atomic_fetch_add(&e->n_conns, 1);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int started = 0;
    if (pthread_create(&t, &attr, rx_main, c) == 0)
        started++;
    if (started && pthread_create(&t, &attr, tx_main, c) == 0)
        started++;
    pthread_attr_destroy(&attr);
    if (started == 0) {
        /* Nothing runs: undo the accounting here (e->mu is held by our caller). */
        e->conns = c->next_all;
        atomic_fetch_sub(&e->n_conns, 1);
        pthread_mutex_lock(&e->th_mu);
        e->conn_threads -= 2;
        pthread_mutex_unlock(&e->th_mu);
        close(fd);
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
        free(p);
        *status = AXF_E_NOMEM;
        return NULL;
    }
    if (started == 1) {
        /* The receiver runs alone: kill the socket so it exits and reports. */
        conn_kill(c);
        atomic_fetch_sub(&c->threads, 1);
        pthread_mutex_lock(&e->th_mu);
        e->conn_threads--;
        pthread_mutex_unlock(&e->th_mu);
    }
    *status = AXF_OK;
    return c;
}

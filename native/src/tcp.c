/* TCP transport: an op's chunks are striped over the endpoint's framed
 * socket connections (conn.c) by a schedule weighted by each connection's
 * measured rate, and a failed connection's unfinished groups are rerouted
 * over the live ones. */
#include "transport.h"

#include <stdlib.h>
#include <string.h>

#define AXF_SCHED 64 /* slots of a striping schedule over an endpoint's connections */
/* A lone request of one descriptor at least this large (up to chunk_bytes)
 * goes as two halves on two connections (tcp_chunk). */
#define SPLIT_MIN (1u << 20)
#define WHOLE_MAX (1u << 20) /* tcp_chunk: lone WRITEs (tcp19) and READs (read22) whole */
#define SOLO_MAX (4u << 20)  /* solo_conn: lone WRITEs of several chunks on one connection
                                (tcp20) */

/* An endpoint's (endpoint->priv): chunks are striped over its live
 * connections by this schedule (slot -> connection index), weighted by each
 * one's measured rate; rebuilt when nsched is 0 or stale is set (a rate
 * moved, a connection came or went). e->mu, but stale. */
typedef struct tcp_ep {
    uint8_t sched[AXF_SCHED];
    int nsched;
    atomic_bool stale;
    int rr_next;
} tcp_ep;
#define TEP(ep) ((tcp_ep *)(ep)->priv)

/* An op's (op->priv), when it has more than one chunk: the endpoint's
 * schedule when it was posted, and where chunk 0 went in it, so a failed
 * connection's group (the chunks of one slot) can be found again. A
 * one-chunk op (the frequent small request) has none: its one group is all
 * of it, and posting it copies and allocates nothing. */
typedef struct tcp_op {
    uint8_t sched[AXF_SCHED];
    uint32_t sched0;
    uint64_t chunk; /* its chunk size (tcp_chunk) */
} tcp_op;
#define TOP(o) ((tcp_op *)(o)->priv)

/* Smooth weighted round robin over the live connections, weighted by their
 * measured rates (unmeasured ones count as the average), every live one
 * keeping at least a slot so that its rate keeps being measured. */
static void sched_build(endpoint *ep)
{
    tcp_ep *t = TEP(ep);
    uint64_t w[AXF_MAX_CONNS] = {0}, known = 0, nknown = 0, total = 0;
    bool live[AXF_MAX_CONNS] = {0};
    int nlive = 0;
    for (int i = 0; i < ep->nconns; i++) {
        if (atomic_load(&ep->conns[i]->down))
            continue;
        live[i] = true;
        nlive++;
        w[i] = atomic_load(&ep->conns[i]->rate);
        if (w[i]) {
            known += w[i];
            nknown++;
        }
    }
    t->nsched = 0;
    if (!nlive)
        return;
    uint64_t avg = nknown ? known / nknown : 1;
    for (int i = 0; i < ep->nconns; i++)
        if (live[i]) {
            if (!w[i])
                w[i] = avg;
            total += w[i];
        }
    uint64_t floor = total / AXF_SCHED + 1;
    total = 0;
    for (int i = 0; i < ep->nconns; i++)
        if (live[i]) {
            if (w[i] < floor)
                w[i] = floor;
            total += w[i];
        }
    int64_t cur[AXF_MAX_CONNS] = {0};
    for (int k = 0; k < AXF_SCHED; k++) {
        int best = -1;
        for (int i = 0; i < ep->nconns; i++) {
            if (!live[i])
                continue;
            cur[i] += (int64_t)w[i];
            if (best < 0 || cur[i] > cur[best])
                best = i;
        }
        cur[best] -= (int64_t)total;
        t->sched[k] = (uint8_t)best;
    }
    t->nsched = AXF_SCHED;
}

static bool sched_ready(endpoint *ep)
{
    tcp_ep *t = TEP(ep);
    if (!t->nsched || atomic_exchange(&t->stale, false))
        sched_build(ep);
    return t->nsched > 0;
}

/* Walks the chunks of an op: a given list, or every chunk in order (those of
 * one connection of the op's schedule only, when slot >= 0). */
typedef struct chunk_iter {
    const op *o;
    const chunk_ref *list;
    size_t n, pos;
    int slot;
    uint64_t k, i, off, chunk;
} chunk_iter;

static bool chunk_next(chunk_iter *it, uint64_t *i, uint64_t *off)
{
    if (it->list) {
        if (it->pos == it->n)
            return false;
        *i = it->list[it->pos].i;
        *off = it->list[it->pos].off;
        it->pos++;
        return true;
    }
    while (it->i < it->o->n) {
        uint64_t ci = it->i, coff = it->off, k = it->k++;
        it->off += it->chunk;
        if (it->off >= it->o->d[ci].len) {
            it->i++;
            it->off = 0;
        }
        const tcp_op *to = TOP(it->o);
        if (it->slot < 0 || !to || to->sched[(to->sched0 + k) % AXF_SCHED] == it->slot) {
            *i = ci;
            *off = coff;
            return true;
        }
    }
    return false;
}

static sq_item *chunk_item(const op *o, uint64_t i, uint64_t off, uint64_t chunk)
{
    sq_item *it = sq_new(o->opcode == AXF_OP_WRITE ? FR_WRITE : FR_READ_REQ, o->req_id);
    if (!it)
        return NULL;
    const axf_desc *d = &o->d[i];
    uint64_t len = d->len - off < chunk ? d->len - off : chunk;
    it->h.index = i;
    it->h.rid = d->rrid;
    it->h.key = d->rkey;
    it->h.off = d->roff + off;
    it->h.len = len;
    it->op = (op *)o;
    if (o->opcode == AXF_OP_WRITE) {
        it->payload = o->laddr[i] + off;
        it->plen = len;
    }
    atomic_fetch_add(&((op *)o)->pins, 1);
    return it;
}

/* A frame of several chunks of o (n of them, 2..AXF_MAX_SEGS, their bytes
 * at most the op's chunk size): one vectored frame, its segment table (and a
 * WRITE's piece addresses) in one allocation. */
static sq_item *vec_item(const op *o, const chunk_ref *ch, uint32_t n, uint64_t chunk)
{
    bool w = o->opcode == AXF_OP_WRITE;
    sq_item *it = sq_new(w ? FR_WRITEV : FR_READV, o->req_id);
    uint8_t *blk = it ? malloc(n * (sizeof(wire_seg) + (w ? sizeof(uint8_t *) : 0))) : NULL;
    if (!blk) {
        free(it);
        return NULL;
    }
    it->owned = blk;
    it->segs = (wire_seg *)blk;
    if (w)
        it->pieces = (const uint8_t **)(blk + n * sizeof(wire_seg));
    uint64_t total = 0;
    for (uint32_t j = 0; j < n; j++) {
        const axf_desc *d = &o->d[ch[j].i];
        uint64_t len = d->len - ch[j].off < chunk ? d->len - ch[j].off : chunk;
        it->segs[j] = (wire_seg){.index = ch[j].i, .rid = d->rrid, .key = d->rkey,
                                 .off = d->roff + ch[j].off, .len = len};
        if (w)
            it->pieces[j] = o->laddr[ch[j].i] + ch[j].off;
        total += len;
    }
    it->h.index = ch[0].i;
    it->h.nseg = n;
    it->h.len = total;
    it->plen = w ? total : 0;
    it->op = (op *)o;
    atomic_fetch_add(&((op *)o)->pins, 1);
    return it;
}

/* One connection's frames of a group, as they are built: its chunks are
 * packed, in order, into frames of up to AXF_MAX_SEGS chunks and the op's
 * chunk size in bytes (a batch of 256 16 KiB descriptors over 4 connections:
 * one 1 MiB frame on each, instead of 64 frames of 16 KiB, each a header to
 * parse, a region lookup and a recvmsg for the receiver); a frame of one
 * chunk stays a plain frame. */
typedef struct grp_build {
    sq_item *first, *last;
    uint64_t bytes;    /* of its frames */
    chunk_ref pend[AXF_MAX_SEGS]; /* the frame being filled */
    uint32_t npend;
    uint64_t pbytes;
} grp_build;

/* The frame being filled goes onto the chain. false: out of memory. */
static bool grp_flush(grp_build *g, const op *o, uint64_t chunk)
{
    if (!g->npend)
        return true;
    sq_item *it = g->npend == 1 ? chunk_item(o, g->pend[0].i, g->pend[0].off, chunk)
                                : vec_item(o, g->pend, g->npend, chunk);
    g->npend = 0;
    g->pbytes = 0;
    if (!it)
        return false;
    if (g->last)
        g->last->next = it;
    else
        g->first = it;
    g->last = it;
    g->bytes += it->h.len;
    return true;
}

static bool grp_add(grp_build *g, const op *o, uint64_t i, uint64_t off, uint64_t chunk)
{
    uint64_t len = o->d[i].len - off < chunk ? o->d[i].len - off : chunk;
    if (g->npend == AXF_MAX_SEGS || (g->npend && g->pbytes + len > chunk))
        if (!grp_flush(g, o, chunk))
            return false;
    g->pend[g->npend++] = (chunk_ref){.i = i, .off = off};
    g->pbytes += len;
    return true;
}

/* Releases what a group's build holds (a failure). */
static void grp_drop(axf_engine *e, grp_build *g)
{
    for (sq_item *it = g->first, *n; it; it = n) {
        n = it->next;
        sq_drop(e, it);
    }
    g->first = g->last = NULL;
    g->npend = 0;
}

static void mark_dirty(axf_engine *e, conn *c)
{
    for (int k = 0; k < e->ndirty; k++)
        if (e->dirty[k] == c)
            return;
    if (e->ndirty < 64) {
        conn_ref(c); /* until the doorbell kicked it */
        e->dirty[e->ndirty++] = c;
    } else {
        conn_signal(c);
    }
}

/* The chunk size of a new op: chunk_bytes, but a lone request (nothing else
 * of the endpoint's in flight) of one descriptor from SPLIT_MIN up to
 * chunk_bytes is cut in two halves (4 KiB multiples) that go on two
 * connections: the peer's receiver of the first half copies it while the
 * second is sent, and two receivers on each side share the work, where one
 * frame on one connection is copied by the sender and then by the receiver,
 * in turn. Measured, 1 MiB requests awaited one at a time on a 2-CPU VM's
 * loopback, interleaved: WRITE 1.14-1.39x, READ 1.47x; four quarters gained
 * less (1.07x), and 512 KiB ones lost cut in two (0.90x WRITE, 0.79x READ):
 * halves of 512 KiB at least (with the default chunk_bytes, a lone request
 * of 1 MiB or more then always uses two connections at least). Requests in
 * flight together spread over the connections already: each keeps its one
 * frame (and its one reply). Measured and left (tcp13, 1 MiB WRITEs awaited
 * one at a time through Python, [0:1 MiB] as the peers' benchmark does,
 * interleaved with a wheel of main): a lone WRITE kept whole on one
 * connection with its acknowledgement read by the spinning thread
 * (HELP_BYTES_MAX 1 MiB: NIXL's shape, voluntary context switches per
 * request 3.0 -> 0.24 here) 0.70x; the halves with their acknowledgements
 * read so 0.88x; the posting thread's part larger than the sending thread's
 * (10/16, 11/16, 9/16 of it) 0.87x, 0.89x, 0.91x; SO_RCVLOWAT on the
 * peer's blocking payload read (its receiver already wakes once) 1.02x with
 * a stall. In the same locked runs main made 6.4-7.7 GB/s, the C floor
 * (tcp_floor, one connection, both sides polling) 7.7-7.9, NIXL-tcp 8.0-8.3.
 * Where the time goes (tcp14, timeline of 2000 such WRITEs from an
 * AXF_TCP_TRACE build, benchmarks/tcp14_timeline.py; us after the post,
 * medians of one quiet run at 6.7 GB/s): the posting thread sends its half
 * at 3 (wakes the sending thread first: 1.6, but 90 at p90, when that thread
 * is woken onto its CPU and runs its whole half first), the sending thread
 * wakes at 26 and sends to 80, the target's receivers get the halves'
 * headers at 53 and 92 (asleep in recv: never caught by their poll, the
 * halves alternate over the four connections) and have them at 102 and 139,
 * the second acknowledgement is read at 148, the completion pushed at 150,
 * Python returns at 154. The copies (two sends, two receives of 512 KiB: ~170
 * us of CPU) need both vCPUs, but this VM (kernel sched_vcpu_pack=15, guest
 * halt polling off) wakes a thread on the CPU of its waker or on a busy one,
 * and the awaiting thread spins on its own (needed: without that spin 0.74x,
 * a halted vCPU's wake-up costs ~20-30 us): in 23 % of requests both sends
 * ran on one CPU (median 192 us against 148), in 35 % both target receivers
 * (170 against 142); the best tenth take 75-90 us (11-14 GB/s). The floor's
 * and NIXL's pollers never sleep, so are never placed; but one sender's copy
 * bounds them: tcp_floor's 1 MiB request (one connection, polled) is 127-133
 * us of send in 131 (send_us_med), where two senders in parallel can do a
 * request in 75-90; tcp_floor in our shape (two connections, the second
 * part sent by a thread woken per request: `senders`) measured 97-115 us
 * polled and 112-154 blocking, against 142-168 for us in the same runs. Whole
 * on one connection our target's poll does catch the
 * header (9 us after the post, other CPU: NIXL's shape), but the 1 MiB
 * sendmsg took 159 us median (p90 327; 4.5 GB/s). Measured and left
 * (interleaved, quiet runs): the posting thread sending both halves 0.82x
 * (its receivers then woken onto its CPU), the halves kept on two
 * connections 0.98x, the sending thread's affinity set to the posting
 * thread's other CPU before its wake-up 0.89x, sending threads SCHED_BATCH
 * (no wake-up preemption) 1.12x then 0.90x (noise), no spin for these
 * waits 0.74x, nanosleep in the spin 0.63x; two receivers of an engine
 * polling at once (rx_spinners up to 2, for the next request and the
 * payload) 1.24x and 1.23x (4 and 7 pairs) then 0.92x (4 pairs); decided
 * by tcp15 (conn.c RX_SPINNERS_MAX 1 against 2, two wheels, 12 interleaved
 * quiet locked pairs of the peers' tcp run, medians of per-pair gains,
 * [min..max], pairs > 1): 1 MiB WRITE 1.01x [0.81..1.17] 6/12 (6.59 -> 6.60
 * GB/s), CPU per GB 0.258 -> 0.263; 1 MiB READ 1.05x [0.84..1.27] 9/12; 64
 * KiB WRITE 1.01x; 4 KiB p50 1.01x (8.96 us both); 16 MiB WRITE 1.01x, READ
 * 0.99x; 4 KiB x 256 in flight 1.01x [0.87..1.13], x 64 0.98x; batch WRITE
 * 1.02x, READ 1.08x [0.53..1.55] 9/12; tcp14's own loop (1 MiB awaited
 * one at a time, 1.5 s a run, 12 pairs) 0.92x and 0.88x (two sets of 6, 3
 * of 12 above 1, CPU per GB 0.265 -> 0.286), READ 1.06x [0.93..1.17] in 6:
 * no steady gain for the WRITE it was for, so one poller (READ's may be a
 * lead of its own). */
static uint64_t tcp_chunk(axf_engine *e, const op *o)
{
    uint64_t chunk = e->cfg.chunk_bytes;
    if (o->n != 1 || o->d[0].len < SPLIT_MIN || o->d[0].len > chunk ||
        atomic_load(&o->ep->ops_alive) > 1)
        return chunk;
    int live = 0, loop = 0;
    for (int i = 0; i < o->ep->nconns; i++)
        if (!atomic_load(&o->ep->conns[i]->down)) {
            live++;
            loop += o->ep->conns[i]->loop_cc;
        }
    /* tcp19: a WRITE up to WHOLE_MAX over connections without bbr's pacing
     * (conn.c loop_cc_set) goes whole: the posting thread copies it into
     * one socket while the peer's polling receiver copies it out (NIXL's
     * and tcp_floor's shape, two threads busy on two vCPUs), where the
     * halves kept four threads (two senders, two receivers) on them.
     * Measured (1 MiB WRITEs awaited one at a time through Python,
     * benchmarks/tcp14_timeline.py, interleaved, medians of per-pair
     * ratios, 2 vCPUs): reno and whole 1.54x main (7/8 pairs), the wheels
     * 1.53x (8/8: 4.36 -> 6.86 GB/s, CPU per GB 0.39 -> 0.29; NIXL-tcp 6.15
     * in the same rounds), reno with halves 1.08x; whole under bbr lost, as
     * tcp13 found. A READ kept its halves (whole under reno, its response
     * read by a receiver, 0.96x main; the halves under reno 1.13x) until
     * read22: whole, its response copied by the awaiting thread as it comes
     * (conn.c help_resp, HELP_READ_LOOP_MAX), the median 1 MiB READ 1.21x
     * (4/4 pairs), voluntary switches per request 2.05 -> 0.92. */
    if (live < 2 || (o->d[0].len <= WHOLE_MAX && loop == live))
        return chunk;
    return (o->d[0].len / 2 + 4095) & ~(uint64_t)4095;
}

/* The one connection a lone WRITE of several chunks (a batch of many
 * descriptors, a request of 1-4 MiB) goes on, or -1 (striped by the
 * schedule, as before): up to SOLO_MAX bytes, nothing else of the
 * endpoint's in flight, every live connection through loopback with
 * loop_cc (conn.c loop_cc_set). Its frames are then sent whole by the
 * posting thread (conn.c send_batch, op->tcp_whole) while the peer's one
 * receiver copies them out: two threads busy on two vCPUs, iperf3's shape
 * (one stream, one writer, one reader), where the stripes over four
 * connections kept nine (four sending threads woken, four receivers, the
 * awaiting spinner; ~11 voluntary switches per request, ~1.1 with this).
 * The connection is the one the last lone request went on (warm threads,
 * as for a lone one-chunk request: tcp_stripe). Measured (256 x 16 KiB
 * WRITEs awaited one at a time through Python, benchmarks/tcp20_batch.py,
 * one build with the shapes switchable, interleaved, medians of per-pair
 * ratios, 2 vCPUs): one connection, sent whole by the posting thread 1.15x
 * (5/5) and 1.18x (4/4), 16 MiB requests so 1.09x (3/3) and 1.03x (2/3);
 * one connection, sent by its sending thread (the spinner, the sender and
 * the receiver on two vCPUs) 1.02x; two connections, their sending threads
 * 0.89x and 1.20x (noise); the target polling the payload as it streams
 * (rx_stream) beside it 1.09x-1.27x, not steadier: left; the awaiting
 * thread reading the 4 MiB acknowledgement (help_ack) 0.86x; the posting
 * thread sending the first 4 MiB of a 16 MiB request and its sending thread
 * the rest 0.86x. So up to 4 MiB (~0.7 ms of the posting thread, where
 * the caller awaits the request anyway): larger requests keep the stripes
 * (sending 16 MiB whole would hold an event loop's thread ~2.5 ms for
 * 1.03-1.09x). A READ keeps the stripes: on one connection (the target's
 * receiver sending every response, the initiator's receiver copying them
 * in, with or without polling) 0.70x-0.75x, on two 0.99x. On a loaded
 * machine (compilers on both vCPUs) the stripes' many threads take a
 * larger share of the CPUs than the two busy threads of one connection:
 * measured so 0.6x, on a shape that iperf3 shares. Wheels (this against
 * main's, tcp20_batch.py alternated, medians of per-pair ratios): the
 * batch WRITE 1.18x (5/5, CPU per GB 0.328 -> 0.318), 1.22x (4/4, 0.435 ->
 * 0.372; iperf3 right after each run: 0.82x -> 1.04x of it) and 1.20x
 * (5/6) on a loaded stretch; 2 MiB in one descriptor 1.11x (4/5, the
 * median request 0.89-0.95x the time), 4 MiB 1.05x (3/3); unchanged paths
 * within noise: 16 MiB 1.01x, the READ batch 1.10x [0.83..1.43]. */
static int solo_conn(const op *o)
{
    endpoint *ep = o->ep;
    if (o->opcode != AXF_OP_WRITE || o->total > SOLO_MAX || atomic_load(&ep->ops_alive) > 1)
        return -1;
    const tcp_ep *t = TEP(ep);
    int last = t->sched[(t->rr_next + AXF_SCHED - 1) % AXF_SCHED], pick = -1;
    for (int i = 0; i < ep->nconns; i++) {
        int ci = (last + i) % ep->nconns;
        const conn *c = ep->conns[ci];
        if (atomic_load(&c->down))
            continue;
        if (!c->loop_cc)
            return -1;
        if (pick < 0)
            pick = ci;
    }
    return pick;
}

/* Stripes a new op's chunks over the live connections by the endpoint's
 * schedule: one group per connection used, its LAST frame acknowledged once.
 * Returns false when nothing could be queued (the caller completes the op). */
static bool tcp_stripe(axf_engine *e, op *o, bool signal) /* e->mu held */
{
    endpoint *ep = o->ep;
    tcp_ep *t = TEP(ep);
    if (!sched_ready(ep)) {
        op_set_status(o, AXF_E_PEER_LOST, 0);
        atomic_store(&o->remaining, 1);
        return false;
    }
    uint64_t chunk = tcp_chunk(e, o);
    AXF_TR(TR_POST, -1, o->req_id, chunk);
    bool one = o->n == 0 || (o->n == 1 && o->d[0].len <= chunk);
    /* A lone one-chunk request (nothing else of the endpoint's in flight)
     * goes on the connection the last request went on, not the next one in
     * the rotation: its threads on both sides ran last (warm caches, and the
     * scheduler keeps them near the threads they talk to). Measured, 4 KiB
     * awaited round trips, 4 connections: ~31 us rotating, ~27 us on one.
     * A lone 64 KiB WRITE (tcp17; benchmarks/tcp17_placement.py pins the two
     * processes): what it costs is where the two sides run. One frame, sent
     * by the posting thread, caught by the target's poll, its acknowledgement
     * read by the awaiting thread; on two vCPUs of this VM the payload's cache
     * lines cross between them twice (the send 8.5-8.7 us, the receive
     * 6.3-6.7, against 3.9 and 2.3-2.6 on one vCPU; a plain memcpy ping-pong
     * of 64 KiB between two threads: 11-14 us a round on two vCPUs, 3.7-3.8
     * on one), so the plain-C request/answer floor (tcp_floor, polled) is
     * 17.8-18.8 us median on two vCPUs and 9.3-9.8 on one, aioxfer 21.4-23.0
     * and 15.0-16.6: the side-by-side row's GB/s is the placement the
     * scheduler chose (kept while both sides poll). Measured and left: the
     * payload sent in 2 or 4 pieces so the receiver copies alongside (floor,
     * two vCPUs: 18.0-18.5 against 18.4-19.5 us, 4 pieces 22.8-24.1); the
     * target not polling (Agent(progress="sleep"): its receiver is woken
     * onto the sender's vCPU or a halted one, 14.2 or 41 us median run to
     * run; both on one vCPU 1.10x [0.97..1.11] in 3 pairs); the awaiting
     * thread peeking for the acknowledgement four times as often (engine.c
     * spin & 3: 1.03x two vCPUs, 1.04x one, 3 pairs each, p50 1.00-1.01x);
     * the target's poll bound raised (conn.c RX_SPIN_MIN_US 10 -> 50 us, so
     * that a preempted initiator still finds it polling: a tenth of these
     * requests take ~60 us here, and in a third of those the poll had
     * ended) 1.017x in 8 pairs, 4 above 1. */
    bool lone = one && o->n == 1 && atomic_load(&ep->ops_alive) <= 1;
    uint32_t sched0 = (uint32_t)(lone ? (t->rr_next + AXF_SCHED - 1) % AXF_SCHED : t->rr_next);
    const uint8_t *sched = t->sched;
    bool solo = false;
    if (!one) {
        tcp_op *to = malloc(sizeof *to);
        if (!to) {
            op_set_status(o, AXF_E_NOMEM, 0);
            atomic_store(&o->remaining, 1);
            return false;
        }
        int sc = solo_conn(o);
        if (sc >= 0) { /* its own schedule: every slot that connection (a reroute finds it so) */
            memset(to->sched, sc, AXF_SCHED);
            sched0 = 0;
            solo = o->tcp_whole = true;
        } else {
            memcpy(to->sched, t->sched, AXF_SCHED);
        }
        to->sched0 = sched0;
        to->chunk = chunk;
        o->priv = to;
        sched = to->sched;
    }
    if (one) { /* the frequent small request: one frame, nothing to pack */
        int ci = t->sched[sched0 % AXF_SCHED];
        sq_item *it = o->n ? chunk_item(o, 0, 0, chunk) : NULL;
        if (o->n && !it)
            op_set_status(o, AXF_E_NOMEM, 0);
        if (!lone)
            t->rr_next = (int)((sched0 + (o->n ? 1 : 0)) % AXF_SCHED);
        atomic_store(&o->remaining, 1); /* before it is queued: replies may come at once */
        if (!it)
            return false;
        it->h.flags |= FL_LAST;
        it->slot = ci;
        it->group_bytes = it->h.len;
        conn_enqueue_chain(ep->conns[ci], it, it, signal);
        if (!signal)
            mark_dirty(e, ep->conns[ci]);
        return true;
    }
    /* Each connection's frames are chained here and queued as one group with
     * its expectation (a READ's frames are answered one by one). */
    grp_build *g = calloc((size_t)ep->nconns, sizeof *g);
    if (!g) {
        op_set_status(o, AXF_E_NOMEM, 0);
        atomic_store(&o->remaining, 1);
        return false;
    }
    chunk_iter ci_ = {.o = o, .slot = -1, .chunk = chunk};
    uint64_t i, off, k = 0;
    int used = 0;
    bool ok = true;
    while (ok && chunk_next(&ci_, &i, &off)) {
        int ci = sched[(sched0 + k++) % AXF_SCHED];
        ok = grp_add(&g[ci], o, i, off, chunk);
    }
    for (int ci = 0; ok && ci < ep->nconns; ci++)
        ok = grp_flush(&g[ci], o, chunk);
    if (!ok) { /* nothing queued yet: none of it goes */
        op_set_status(o, AXF_E_NOMEM, 0);
        for (int ci = 0; ci < ep->nconns; ci++)
            grp_drop(e, &g[ci]);
    }
    for (int ci = 0; ci < ep->nconns; ci++)
        used += g[ci].last != NULL;
    if (!lone && !solo)
        t->rr_next = (int)((sched0 + k) % AXF_SCHED);
    /* Set before any group is queued: replies may come at once. */
    atomic_store(&o->remaining, used ? used : 1);
    if (!used) {
        free(g);
        return false;
    }
    /* A lone WRITE cut in halves (tcp_chunk): the second half goes to its
     * connection's sending thread at once, while this thread sends the
     * first, so the two copies into the socket run side by side instead of
     * one after the other here (the wake-up of that thread is hidden behind
     * the first half's copy). Measured, 1 MiB WRITEs awaited one at a time
     * through Python on the 2-vCPU VM's loopback, 10 interleaved pairs:
     * 6.48 -> 6.87 GB/s median (pairwise 1.06x, 9 of 10 better), CPU per
     * GB 0.160 -> 0.140 s; READ's halves are small requests (no copy to
     * share: 0.95x, so not them), and larger WRITEs, whose other groups go
     * to their sending threads after their first frame anyway, within noise
     * (4 MiB 0.97x, 16 MiB 1.03x). */
    bool halves = o->opcode == AXF_OP_WRITE && chunk < e->cfg.chunk_bytes;
    int first_ci = sched[sched0 % AXF_SCHED];
    for (int ci = 0; ci < ep->nconns; ci++) {
        if (!g[ci].last)
            continue;
        g[ci].last->h.flags |= FL_LAST;
        g[ci].last->slot = ci;
        g[ci].last->group_bytes = g[ci].bytes;
        bool sig = signal || (halves && ci != first_ci);
        if (sig)
            AXF_TR(TR_SIG_B, -1, o->req_id, (uint64_t)ci);
        conn_enqueue_chain(ep->conns[ci], g[ci].first, g[ci].last, sig);
        if (sig)
            AXF_TR(TR_SIG_E, -1, o->req_id, (uint64_t)ci);
        if (!sig)
            mark_dirty(e, ep->conns[ci]);
    }
    free(g);
    return true;
}


/* Queues chunks [from, to) of a group of o (a failed connection's, or the
 * unsent part of one a joining connection spreads: AXF_MOVE_SPREAD) on the
 * live connections, by the endpoint's schedule; false when none is left.
 * e->mu held. (transport.h: reroute) */
static bool tcp_reroute(axf_engine *e, op *o, int slot, const chunk_ref *list, size_t n,
                        size_t from, size_t to, uint32_t how)
{
    endpoint *ep = o->ep;
    tcp_ep *t = TEP(ep);
    if (!sched_ready(ep))
        return false;
    bool spread = how & AXF_MOVE_SPREAD;
    /* The op's own chunk size: the slot's chunks are found again by it. */
    uint64_t chunk = TOP(o) ? TOP(o)->chunk : e->cfg.chunk_bytes, i, off;
    uint32_t start = (uint32_t)t->rr_next;
    size_t cnt[AXF_MAX_CONNS] = {0}, fill[AXF_MAX_CONNS] = {0}, total = 0;
    chunk_iter it = {.o = o, .list = list, .n = n, .slot = slot, .chunk = chunk};
    for (size_t k = 0; k < to && chunk_next(&it, &i, &off); k++)
        if (k >= from)
            cnt[t->sched[(start + total++) % AXF_SCHED]]++;
    if (!total)
        return false;
    chunk_ref *lists[AXF_MAX_CONNS] = {0};
    grp_build *g = calloc((size_t)ep->nconns, sizeof *g);
    bool ok = g != NULL;
    int groups = 0;
    for (int ci = 0; ci < ep->nconns && ok; ci++)
        if (cnt[ci]) {
            groups++;
            ok = (lists[ci] = malloc(cnt[ci] * sizeof *lists[ci])) != NULL;
        }
    it = (chunk_iter){.o = o, .list = list, .n = n, .slot = slot, .chunk = chunk};
    for (size_t k = 0, j = 0; ok && k < to && chunk_next(&it, &i, &off); k++) {
        if (k < from)
            continue;
        int ci = t->sched[(start + j++) % AXF_SCHED];
        lists[ci][fill[ci]++] = (chunk_ref){.i = i, .off = off};
        ok = grp_add(&g[ci], o, i, off, chunk);
    }
    for (int ci = 0; ok && ci < ep->nconns; ci++)
        ok = grp_flush(&g[ci], o, chunk);
    if (!ok) {
        for (int ci = 0; g && ci < ep->nconns; ci++)
            grp_drop(e, &g[ci]);
        for (int ci = 0; ci < AXF_MAX_CONNS; ci++)
            free(lists[ci]);
        free(g);
        op_set_status(o, AXF_E_NOMEM, 0);
        return false;
    }
    /* The moved part's unit becomes these groups' units. */
    atomic_fetch_add(&o->remaining, groups - 1);
    if (!spread)
        o->reroutes++;
    for (int ci = 0; ci < ep->nconns; ci++) {
        if (!g[ci].last)
            continue;
        g[ci].last->h.flags |= FL_LAST;
        g[ci].last->slot = ci;
        g[ci].last->chunks = lists[ci];
        g[ci].last->nchunks = cnt[ci];
        g[ci].last->group_bytes = g[ci].bytes;
        conn_enqueue_chain(ep->conns[ci], g[ci].first, g[ci].last, !spread);
    }
    t->rr_next = (int)((start + total) % AXF_SCHED);
    free(g);
    return true;
}

static void tcp_op_free(axf_engine *e, op *o)
{
    (void)e;
    free(o->priv);
    o->priv = NULL;
}

static bool tcp_submit(axf_engine *e, op *o, uint32_t flags) /* e->mu held; unlocks */
{
    /* Not read back from o->remaining: replies may already be decrementing it. */
    /* Queued unsignalled; the doorbell below (or the caller's) sends small
     * frames on this thread, without a handoff. */
    bool queued = tcp_stripe(e, o, false);
    pthread_mutex_unlock(&e->mu);
    if (!(flags & AXF_POST_DEFER) && queued)
        axf_doorbell(e);
    return queued;
}

/* The one-copy send's window (conn.c, "one-copy send"): read once, at
 * engine creation, from AIOXFER_TCP_SPLICE: unset the default window below
 * (on by default since spl28), "1" tcp26's opt-in window (frames from 64
 * KiB), "0" off (every payload is copied by sendmsg), "MIN-MAX" or
 * "MIN-MAX-REQMAX" (bytes) another window. A frame's payload goes spliced
 * when it is MIN..MAX bytes and its request REQMAX at most.
 * Safe since tcp26: a spliced WRITE that fails or is cancelled before its
 * acknowledgement keeps its memory held (its region holds) until the
 * kernel shows its pages read or dropped (conn.c, spl_settle); before
 * (rev18b) such an op was released while the peer's receive queue still
 * referenced our pages, and a peer reading them later applied the
 * buffer's bytes of that moment. No release can be both prompt and safe
 * (an abortive close leaves the peer's queue readable), so a stopped
 * peer's spliced pages stay held until it resumes and reads, or exits.
 * Prompt since spl28, and so on by default: the failure is told at once
 * (AXF_CQ_XFER_HELD: the transfer fails on time, Transfer.busy stays
 * true) and the memory released later by a second record
 * (AXF_CQ_XFER_FREED: Transfer.settled() ends, a deregistration goes
 * on). tcp26 kept it off because the one record waited for the memory:
 * a stopped peer's loss (tests/test_liveness.py, due by 2.2 s: not ended
 * at 7.2 s) and an endpoint's close with bulk writes at it
 * (test_conn16_spread) waited with it.
 * uid 0 across pid namespaces (tcp26, decided): still spliced. sock_diag
 * says the peer socket's owner uid, not its process; telling whether a
 * uid-0 peer shares our pid namespace (so could read our memory anyway)
 * needs the process holding the socket's inode: a scan of every
 * /proc/PID/fd, measured 2.4-2.7 ms here (164 processes, 814 fds) against a
 * whole tcp connect + first write of ~2 ms, more on a busy host. What it
 * would guard since tcp26 is only a peer that acknowledges without reading
 * (a failed op's pages are no longer released early). The cheap way, left:
 * the handshake's claimed peer pid, checked by its /proc/PID/fd holding the
 * inode and /proc/PID/ns/pid equal to ours.
 * The default window (spl28): 256 KiB..1 MiB frames of requests up to 1
 * MiB. spl28 measured tcp26's 64 KiB floor slower than the copy at 64 KiB
 * on this 2-vCPU VM (busy: other builds beside it): benchmarks/tcp24_lone.py
 * WRITE 64 KiB, main's copy ÷ spliced: spliced 0.718x [0.42..0.88], 0 of 6
 * pairs faster, CPU per GB 0.47 against 0.35 (a sending thread woken per
 * request: 1.9 voluntary switches per request, 0.02 copying); the peers
 * harness' 64 KiB row 0.56-0.98x in 3 rounds; 256 KiB 1.037x [1.00..1.27]
 * 3/5 (p50 36.8 against 40.9 us), 1 MiB 1.014x [0.94..1.15] 4/6.
 * Re-measured by spl29 once that wake-up was found to be conn_kick's
 * spl_late broadcast (c->cv, the sending thread's own; gone): the posting
 * thread splices a lone frame itself with no other thread woken (0.04
 * voluntary switches per request on each side), and still 64 KiB spliced
 * is slower than copied: tcp24_lone.py, one wheel, splice "1" against the
 * default, 6 rotated rounds, 0.894x [0.79..1.08] 1/6 (p50 31.7 against
 * 26.7 us, CPU per GB 0.99 against 0.94; the build before the fix 0.934x
 * 2/6): the pipe's syscalls and the pinning cost more than a 64 KiB copy
 * here. So the window keeps its 256 KiB floor; 1 MiB, spliced with no
 * wake-up, 1.21x main's [1.06..1.33] 5/5 (p50 173 -> 148 us, voluntary
 * switches per request on the initiator 1.48 -> 0.16, CPU per GB 0.347 ->
 * 0.295); rerun on a loaded stretch 1.08x [0.99..1.38] 5/6 (CPU per GB
 * 0.307 -> 0.271).
 * tcp26's window ("1"): 64 KiB..1 MiB frames of requests up to 1 MiB (tcp26,
 * wheels against main 07d60a7's, 2 vCPUs shared with other builds).
 * benchmarks/peers/run.py --only nixl_tcp,aioxfer_tcp,before_tcp, two runs
 * of 3 rotated rounds: WRITE 1 MiB one at a time 1.66x and 1.23x NIXL-tcp
 * (main in the same rounds 1.28x and 1.18x), 1.20x and 1.05x main; 64 KiB
 * 1.34x and 1.25x main; CPU per GB at 1 MiB 0.216 against 0.279; rows
 * without spliced frames (4 KiB, 16 MiB, batches, READs) within noise.
 * benchmarks/tcp24_lone.py, 1 MiB WRITE, medians of per-pair ratios: 1.12x
 * [1.02..1.27] 7/7 (CPU per GB 0.241 against 0.287), 1.05x [0.91..1.18]
 * 5/7, 1.10x [0.31..1.25] 3/5; tcp18's window in the same rounds 0.88x
 * [0.81..1.05], though it splices nothing of a 1 MiB request (REQMAX 512
 * KiB): this machine's noise; READ 1 MiB 1.06x, off 1.02x.
 * tcp18's window, measured (tcp18, wheels of its branch, 2 vCPUs, kernel
 * 6.18; in-process A/B: two initiator agents in one process, splice on and
 * off, against one target process, WRITEs awaited one at a time, rows
 * alternated 8-12 times, medians of per-pair ratios): single-frame
 * requests of 64 KiB 1.15x [0.63..1.42] (8/10 better), 128 KiB 1.38x, 256
 * KiB 1.16x, 512 KiB 1.12x, CPU per GB 1.10-1.22x lower (with this window
 * built, three more runs: 64 KiB 1.22x and 1.17x [0.97..1.26] 11/12, 128
 * KiB 1.49x 12/12, 256 KiB 1.13x and 1.50x, 384 KiB 1.49x 12/12, 512 KiB
 * 1.06x and 1.42x 12/12, CPU per GB 1.18-1.51x lower; one disturbed run
 * 256 KiB 0.78x, 512 KiB 0.58x; 4 KiB p50 1.007x); but a lone 1 MiB
 * request (tcp_chunk's two 512 KiB halves, the posting thread's inline and
 * a sending thread's) 0.71x [0.58..1.16] in 12 and 0.93x in 8 (both sends
 * end early, the awaiting thread spins beside the target's two receivers
 * copying on two vCPUs), the same 1 MiB as one spliced frame 0.46x, the
 * halves with only the sending thread's spliced 1.03x; and splicing every
 * frame of larger requests (AIOXFER_TCP_SPLICE=65536-1048576-99999999999,
 * the peers harness, 3 pairs against main): 16 MiB 0.73x, 64 MiB 0.70x,
 * 256 x 16 KiB batch 0.48x, CPU per GB at 16 MiB 1.5x higher (a long
 * stream of spliced skbs on each connection: the plain-C floor's 16 MiB
 * 0.74x too). So tcp18 chose frames of 64..512 KiB of requests up to 512 KiB; below
 * (header-sized copies cost less than the pipe's syscalls) and above, the
 * copy. */
#define SPLICE_MIN_DEFAULT (256u << 10)
#define SPLICE_MIN_ONE (64u << 10) /* "1": tcp26's opt-in window */
#define SPLICE_MAX_DEFAULT (1u << 20)
#define SPLICE_REQ_MAX_DEFAULT (1u << 20)
static int tcp_enable(axf_engine *e)
{
    /* conn.c loop_cc_set: "reno" by default; "" or "0" leave the system's. */
    const char *cc = axf_env_get(&e->env, AXF_ENV_TCP_LOOPBACK_CC);
    if (!cc)
        cc = "reno";
    if (strcmp(cc, "0") == 0 || strlen(cc) >= sizeof e->tcp_loop_cc)
        cc = "";
    memcpy(e->tcp_loop_cc, cc, strlen(cc) + 1);
    e->splice_min = SPLICE_MIN_DEFAULT;
    e->splice_max = SPLICE_MAX_DEFAULT;
    e->splice_req_max = SPLICE_REQ_MAX_DEFAULT;
    const char *v = axf_env_get(&e->env, AXF_ENV_TCP_SPLICE);
    if (!v || !*v) /* the default: on, this window (spl28) */
        return AXF_OK;
    if (strcmp(v, "1") == 0) {
        e->splice_min = SPLICE_MIN_ONE;
        return AXF_OK;
    }
    char *end;
    unsigned long long lo = strtoull(v, &end, 10), hi = 0, req = UINT64_MAX;
    if (*end == '-') {
        hi = strtoull(end + 1, &end, 10);
        if (*end == '-')
            req = strtoull(end + 1, &end, 10);
    }
    if (*end || hi < lo || (lo == 0 && hi == 0)) { /* "0", or not understood: off */
        e->splice_min = e->splice_max = e->splice_req_max = 0;
        return AXF_OK;
    }
    e->splice_min = lo ? lo : 1;
    e->splice_max = hi;
    e->splice_req_max = req;
    return AXF_OK;
}

static int tcp_ep_open(axf_engine *e, endpoint *ep)
{
    (void)e;
    tcp_ep *t = calloc(1, sizeof *t);
    if (!t)
        return AXF_E_NOMEM;
    atomic_init(&t->stale, false);
    ep->priv = t;
    return AXF_OK;
}

static void tcp_ep_free(endpoint *ep)
{
    free(ep->priv);
    ep->priv = NULL;
}

static void tcp_ep_changed(endpoint *ep)
{
    atomic_store(&TEP(ep)->stale, true); /* the schedule is rebuilt at the next post */
}

const axf_transport axf_xp_tcp = {
    .abi = AXF_TRANSPORT_ABI,
    .name = "tcp",
    .ep_kind = AXF_EP_TCP,
    .enable = tcp_enable,
    .caps = AXF_XP_CAP_NEEDS_CONN | AXF_XP_CAP_NOTIFY | AXF_XP_CAP_REAPABLE,
    .local_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .far_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .ep_open = tcp_ep_open,
    .ep_free = tcp_ep_free,
    .ep_conns_changed = tcp_ep_changed,
    .reroute = tcp_reroute,
    .submit = tcp_submit,
    .op_free = tcp_op_free,
};

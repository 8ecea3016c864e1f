/* The native transport interface: what the engine core asks of a transport.
 *
 * The core (engine.c: regions, ops, the completion ring, revocation,
 * endpoints' life) names no transport. Each transport is one file that
 * defines one `const axf_transport`, listed in the registry (transports.c)
 * under the meson option that builds it; a transport that is not built is
 * absent from the registry, never a stub. Per-transport state sits behind
 * private slots: engine->xp[kind], region->xp[kind], rregion->xp[kind] and
 * conn->xp[kind] (indexed by the transport's endpoint kind, so several
 * transports may attach to one region, e.g. RDMA registrations and a CUDA
 * host pin), and endpoint->priv (owned by the endpoint's own transport).
 *
 * Locking: "e->mu" below means the op is called with the engine lock held.
 * Every op may be NULL (nothing to do), except submit. */
#ifndef AXF_TRANSPORT_H
#define AXF_TRANSPORT_H

#include "internal.h"

#define AXF_TRANSPORT_ABI 1u

/* Endpoint kinds that are no part of the public header: the test-only mock
 * transport (native/src/mock.c, mock.h). */
#define AXF_EP_MOCK 7

/* reroute's how. */
#define AXF_MOVE_SPREAD 1u

/* caps */
enum {
    /* Same host: the endpoint names a process (pid, pidfd), its copies reach
     * the peer's memory directly, so closing it says goodbye once none runs. */
    AXF_XP_CAP_SAME_HOST = 1u << 0,
    /* Posting needs a connection (the data goes over it). */
    AXF_XP_CAP_NEEDS_CONN = 1u << 1,
    /* A peer to notify: bound notifications and AXF_OP_NOTIFY are allowed. */
    AXF_XP_CAP_NOTIFY = 1u << 2,
    /* An op's data phase finishes on the transport's own threads even when
     * the endpoint's connections are gone (copies in flight, posted RDMA
     * requests): the core leaves such ops alone when it loses the endpoint. */
    AXF_XP_CAP_OWN_DATA = 1u << 3,
    /* ... and, for these, marks them failed right away (they see it later). */
    AXF_XP_CAP_FAIL_EARLY = 1u << 4,
    /* The watcher may free a finished endpoint of this kind (its transport
     * keeps no pointer to it). */
    AXF_XP_CAP_REAPABLE = 1u << 5,
    /* Far regions are unmapped as soon as no op uses one and none can
     * resolve it any more (not only when the endpoint goes). */
    AXF_XP_CAP_EAGER_UNMAP = 1u << 6,
};

#define AXF_MEM_BIT(kind) (1u << (kind))

typedef struct axf_transport {
    uint32_t abi; /* AXF_TRANSPORT_ABI */
    const char *name;
    int ep_kind;        /* AXF_EP_*: its endpoints, and its private slot */
    uint32_t caps;      /* AXF_XP_CAP_* */
    uint32_t local_mem; /* AXF_MEM_BIT(AXF_MEM_*): our memory its ops may touch */
    uint32_t far_mem;   /* ... and the far side's */

    /* Engine life. enable: at engine creation (an AXF_E_* failure fails it).
     * quiesce: shutdown, before connections close, in reverse registry
     * order: copies that reach a peer's memory stop (finish or fail).
     * stop: shutdown, once connection threads are gone: what is queued
     * fails, what is in flight finishes. destroy: frees its engine slot. */
    int (*enable)(axf_engine *e);
    void (*quiesce)(axf_engine *e);
    void (*stop)(axf_engine *e);
    void (*destroy)(axf_engine *e);

    /* Our regions, every transport: add before the region is reachable
     * (a failure refuses the registration), free after its last reference. */
    int (*region_add)(axf_engine *e, region *r);
    void (*region_free)(axf_engine *e, region *r);
    /* Whether this transport's endpoints may use region r (beyond local_mem). */
    bool (*region_usable)(const region *r);

    /* Endpoints of its kind. open: e->mu, at creation (starts the transport
     * on demand, or refuses: not enabled). import_fd: e->mu, a far region
     * the peer shared as a memfd. lost: e->mu, its last connection is gone.
     * free: the endpoint goes (its priv). */
    int (*ep_open)(axf_engine *e, endpoint *ep);
    int (*ep_import_fd)(endpoint *ep, rregion *rr, int memfd);
    void (*ep_lost)(axf_engine *e, endpoint *ep);
    void (*ep_free)(endpoint *ep);
    /* A connection of ep came, went or changed its measured rate (any lock
     * or none held: a flag to look at later). */
    void (*ep_conns_changed)(endpoint *ep);
    /* Far regions, every transport (each looks at its own slot): unmap, e->mu
     * (no op uses it and none will); free, before the struct is freed. */
    void (*rr_unmap)(rregion *rr);
    void (*rr_free)(rregion *rr);
    /* An accepted connection is closed (what this transport hung on it goes). */
    void (*conn_closed)(axf_engine *e, conn *c);

    /* Posting. resolve: e->mu, the far side of descriptor i when it is not a
     * region the peer shared (the file transport: one of our file regions);
     * o->laddr[i] is set. check: e->mu, after every descriptor resolved.
     * submit: called with e->mu held, releases it; queues (or does) the op's
     * data phase; false when nothing was queued (the core then completes it
     * with the status set). doorbell: the caller's deferred posts go now. */
    int (*resolve)(axf_engine *e, op *o, size_t i, uint32_t need);
    int (*check)(op *o);
    bool (*submit)(axf_engine *e, op *o, uint32_t flags);
    /* An op of its endpoint is freed with op->priv set (resolve or submit set it). */
    void (*op_free)(axf_engine *e, op *o);
    /* e->mu held: chunks [from, to) of a group of o (the chunks of its
     * schedule slot `slot` in order, or list[0, n)) are queued anew over the
     * endpoint's live connections, their new groups taking over one unit of
     * o->remaining; false when nothing was queued (none live, or out of
     * memory: o's status set then). A failed connection's unfinished group
     * (how 0: counted as rerouted, the connections signalled), or, with
     * AXF_MOVE_SPREAD, the unsent part of one on a live connection when
     * another joined (conn.c conn_spread: not counted, queued unsignalled,
     * the caller wakes the connections). Without it, a failed connection
     * fails the whole endpoint and a joining one takes new requests only. */
    bool (*reroute)(axf_engine *e, op *o, int slot, const chunk_ref *list, size_t n, size_t from,
                    size_t to, uint32_t how);
    void (*doorbell)(axf_engine *e);
} axf_transport;

/* transports.c: the registry, in the order the core calls them in (an
 * rregion's CUDA registration is undone before its shared-memory mapping,
 * a region's RDMA registrations before its CUDA pin). NULL-terminated. */
extern const axf_transport *const axf_transports[];
extern const size_t axf_ntransports;
const axf_transport *axf_transport_for(int ep_kind); /* NULL: not built */

/* The transports (each defined in its own file; only those built exist). */
extern const axf_transport axf_xp_tcp, axf_xp_shm, axf_xp_file, axf_xp_verbs, axf_xp_cuda,
    axf_xp_mock;

static inline void ep_conns_changed(endpoint *ep)
{
    if (ep->xp->ep_conns_changed)
        ep->xp->ep_conns_changed(ep);
}

/* Its copies reach the peer's memory directly (AXF_XP_CAP_SAME_HOST). */
static inline bool ep_same_host(const endpoint *ep)
{
    return ep->xp->caps & AXF_XP_CAP_SAME_HOST;
}

#define AXF_FOR_XP(xp)                                                   \
    for (const axf_transport *const *xp##_it = axf_transports, *xp;     \
         (xp = *xp##_it) != NULL; xp##_it++)

#endif

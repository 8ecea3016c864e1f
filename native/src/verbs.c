/* The RDMA verbs transport: one-sided WRITE and READ over reliable-connected
 * queue pairs, one per device pair (rail) of an endpoint; the endpoint's
 * stream connections carry the control traffic (keepalives, notifications,
 * revocations) exactly as for TCP.
 *
 * Posting: an op's descriptors become RDMA work requests striped over the
 * rails (a rail takes chunk_bytes before the next one does), chained per rail
 * in chains of at most CHAIN_WRS, each chain posted with one post_send and
 * only its last request signalled. RC completes a queue pair's requests in
 * order, so the last one's completion (success, error or flush) says the
 * whole chain is over and frees its send-queue slots. Chains that do not fit
 * the send queue (or the completion queue, which must hold a flush of
 * everything posted) wait in the queue pair's pending list, posted by the
 * poller as completions free room.
 *
 * Completions: one poller thread sleeps in epoll on every device's completion
 * channel (and an eventfd to wake it), drains the completion queues in
 * batches and feeds the engine's ring through op_unit_done: a WRITE's
 * notification then goes out on a control connection after every one of its
 * RDMA writes completed, that is after the data is placed at the target.
 *
 * Failure: an error completion other than a flush moves the queue pair to
 * the error state, so the endpoint is lost (its control connections killed,
 * every queue pair flushed); a flushed request fails its op with PEER_LOST
 * (CLOSED when we closed). An endpoint whose control connections died has
 * its queue pairs moved to the error state: in-flight requests flush, and no
 * op completes (releasing its memory) before its requests did. A queue pair
 * the NIC reports failed (asynchronous event) loses its endpoint likewise; an
 * accepting-side one has its connection closed, so the peer learns at once.
 * A post refused part way whose drain request is refused too (nothing would
 * say when its requests are over) destroys the queue pair and fails its ops.
 *
 * Memory: a region gets a registration per device when registered, cached by
 * (device, address, length, access) with a reference count; it is
 * deregistered when the engine frees the region, which is after every peer
 * acknowledged its revocation, which a peer does once no op of its own uses
 * the region: deregistration waits for in-flight work.
 */
#include "transport.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef AXF_HAVE_VERBS

#include "verbs_table.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define SQ_DEPTH 256      /* send queue entries per queue pair */
#define CHAIN_WRS 32      /* work requests per chain (one signalled) */
#define CQ_ENTRIES 8192   /* per device; also the bound on requests posted on it */
#define MAX_INLINE 256    /* asked of a queue pair; small WRITEs from host memory go inline */
#define MR_BUCKETS 256
#define WAKE_ID UINT32_MAX
#define ASYNC_ID 0x10000u /* + device: its asynchronous event fd */

typedef struct verbs_state verbs_state;
typedef struct verbs_qp vqp;

/* Its private slots (transport.h): the engine's devices and poller, a
 * region's registrations, a far region's keys, an endpoint's queue pairs,
 * an accepted connection's queue pairs. */
#define VS_OF(e) ((verbs_state *)(e)->xp[AXF_EP_VERBS])
#define VREG(r) ((struct verbs_reg *)(r)->xp[AXF_EP_VERBS])
#define VRK(rr) ((struct verbs_rkeys *)(rr)->xp[AXF_EP_VERBS])
#define VEP(ep) ((struct verbs_ep *)(ep)->priv)
#define VQP(c) ((vqp *)(c)->xp[AXF_EP_VERBS])

static void verbs_ep_dead(axf_engine *e, endpoint *ep);

typedef struct vdev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    uint8_t port;
    uint8_t gid_index;
    uint8_t gid_type; /* 1 + enum ibv_gid_type; 0 unknown */
    union ibv_gid gid;
    uint16_t lid;
    enum ibv_mtu mtu;
    bool eth; /* RoCE: addressed by GID (GRH) */
    uint8_t rd_atom, rd_init_atom;
    uint32_t cq_room; /* requests it may still have posted (vs->mu) */
    bool dead;        /* IBV_EVENT_DEVICE_FATAL: poller thread only */
    char name[64];
} vdev;

/* One cached memory registration. */
typedef struct vmr {
    int dev;
    uint64_t addr, len;
    int access;
    int refs; /* vs->mu */
    struct ibv_mr *mr;
    struct vmr *next;
} vmr;

struct verbs_reg {
    vmr *mr[AXF_VERBS_MAX_DEVICES];
};

struct verbs_rkeys {
    uint32_t n;
    uint64_t addr[AXF_VERBS_MAX_DEVICES];
    uint32_t rkey[AXF_VERBS_MAX_DEVICES];
};

typedef struct vchain vchain;

/* What a work request's wr_id points at. */
typedef struct wr_info {
    vchain *c;
    uint64_t index; /* the op's descriptor */
    bool last;
} wr_info;

struct vchain {
    op *o;
    vqp *q;
    int nwr;
    int took;      /* work requests the send queue took (all, but after a failed post) */
    bool partial;  /* a failed post_send took part of the chain */
    bool drained;  /* ... and a signalled drain request went after it */
    int left;      /* no drain: completions still expected (may never come) */
    uint64_t bytes;
    bool failed;
    struct ibv_send_wr *wr;
    struct ibv_sge *sge;
    wr_info *wi;
    vchain *next;
};

struct verbs_qp {
    verbs_state *vs;
    int devi;
    struct ibv_qp *qp; /* written under q->mu and vs->mu (vs->qps scans read it) */
    endpoint *ep;  /* initiator: the owner; NULL on the accepting side (set before linked) */
    int rdev;      /* initiator: the peer's device (its rkeys) */
    uint64_t handle; /* accepting side: until bound to a connection */
    uint32_t psn, max_inline;
    pthread_mutex_t mu; /* the fields below */
    bool ready, err;
    bool post_failed; /* a post_send failed: the poller reports the loss */
    bool abandon;     /* ... and its drain request was refused: the poller destroys it */
    int sq_used;
    vchain *posted_head, *posted_tail; /* in completion order */
    vchain *pend_head, *pend_tail;
    vqp *next_all;  /* vs->mu */
    uint64_t gen;   /* which of ours it is, never reused (set before linked) */
    vqp *next_conn; /* accepting side: the connection's list; unbound list */
};

struct verbs_ep {
    vqp *rail[AXF_VERBS_MAX_DEVICES];
    int next; /* striping position */
};

/* What hardware decides, as settings with safe defaults (environment, read
 * when verbs is enabled; see README "RDMA settings"). */
typedef struct verbs_settings {
    uint8_t timeout;   /* AIOXFER_VERBS_TIMEOUT: 4.096 us * 2^n per try; 20 (~4.3 s), as NCCL */
    uint8_t retry_cnt; /* AIOXFER_VERBS_RETRY_CNT: 7 */
    uint8_t tc;        /* AIOXFER_VERBS_TC: GRH traffic class (DSCP << 2); 0 */
    uint8_t sl;        /* AIOXFER_VERBS_SL: service level; 0 */
    int gid_index;     /* AIOXFER_VERBS_GID_INDEX: -1 picks by type (RoCE v2, routable) */
    bool relaxed;      /* AIOXFER_VERBS_RELAXED_ORDERING: 1 (tried, dropped if refused) */
    /* AIOXFER_VERBS_DEVICES: comma-separated allow-list; NULL or empty: all.
     * Read in place in the environment snapshot it came from, any length
     * (a copy into 256 bytes cut a longer list: the devices named past it
     * were refused): valid while that snapshot is held, an engine's for
     * its life, a probe's for its call (axf_verbs_probe releases it after
     * its devices are opened). */
    const char *devices;
} verbs_settings;

static int env_int(const axf_env *env, int which, int dflt, int lo, int hi)
{
    const char *v = axf_env_get(env, which);
    if (!v || !*v)
        return dflt;
    char *end;
    long n = strtol(v, &end, 10);
    return *end || n < lo || n > hi ? dflt : (int)n;
}

/* From the engine's snapshot of the environment (its creation's), or for a
 * probe the process's (engine.c axf_env_take): never getenv here, on a
 * thread that does not hold the GIL. */
static void settings_read(const axf_env *env, verbs_settings *s)
{
    s->timeout = (uint8_t)env_int(env, AXF_ENV_VERBS_TIMEOUT, 20, 1, 31);
    s->retry_cnt = (uint8_t)env_int(env, AXF_ENV_VERBS_RETRY_CNT, 7, 0, 7);
    s->tc = (uint8_t)env_int(env, AXF_ENV_VERBS_TC, 0, 0, 255);
    s->sl = (uint8_t)env_int(env, AXF_ENV_VERBS_SL, 0, 0, 15);
    s->gid_index = env_int(env, AXF_ENV_VERBS_GID_INDEX, -1, 0, 255);
    s->relaxed = env_int(env, AXF_ENV_VERBS_RELAXED_ORDERING, 1, 0, 1) == 1;
    s->devices = axf_env_get(env, AXF_ENV_VERBS_DEVICES);
}

/* Whether device `name` is in the allow-list (empty: every device). */
static bool device_allowed(const verbs_settings *s, const char *name)
{
    if (!s->devices || !s->devices[0])
        return true;
    size_t n = strlen(name);
    for (const char *p = s->devices; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0)
            return true;
        p += len + (e ? 1 : 0);
    }
    return false;
}

struct verbs_state {
    axf_engine *e;
    axf_verbs_table t;
    verbs_settings set;
    int ndev;
    vdev dev[AXF_VERBS_MAX_DEVICES];
    int epfd, wakefd;
    pthread_t poller;
    bool poller_started;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* the poller finished a round */
    bool stop;
    vmr *mrs[MR_BUCKETS];
    vqp *qps;      /* every queue pair not yet freed */
    uint64_t qp_gens; /* the last queue pair's gen */
    vqp *unbound;  /* accepting side, not bound to a connection yet */
    uint64_t next_handle;
    vchain *fail;  /* chains to fail on the poller thread */
};

/* ------------------------------------------------------------ loading */

/* One table per provider path for the life of the process: a loaded library
 * is never unloaded (see verbs_table.c). A failed load is tried again. */
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static struct loaded {
    char path[512];
    axf_verbs_table t;
    int status;
    char why[256];
} loaded[4];
static int nloaded;

static int load_table(const char *provider, axf_verbs_table *out, char *why, size_t why_len)
{
    const char *key = provider && *provider ? provider : "";
    if (strlen(key) >= sizeof loaded[0].path) {
        snprintf(why, why_len, "provider path too long");
        return AXF_E_INVALID;
    }
    pthread_mutex_lock(&load_mu);
    struct loaded *l = NULL;
    for (int i = 0; i < nloaded && !l; i++)
        if (!strcmp(loaded[i].path, key))
            l = &loaded[i];
    if (!l && nloaded < (int)(sizeof loaded / sizeof loaded[0])) {
        l = &loaded[nloaded++];
        snprintf(l->path, sizeof l->path, "%s", key);
        l->status = axf_verbs_load(*key ? key : NULL, &l->t, l->why, sizeof l->why);
    }
    int st = l ? l->status : -ENOMEM;
    if (l) {
        *out = l->t;
        snprintf(why, why_len, "%s", l->why);
        if (st && l == &loaded[nloaded - 1])
            nloaded--; /* a failure is not remembered: the library may appear later */
    } else {
        snprintf(why, why_len, "too many verbs providers loaded");
    }
    pthread_mutex_unlock(&load_mu);
    return st ? AXF_E_TRANSPORT : AXF_OK;
}

static const char *mtu_text(enum ibv_mtu m)
{
    switch (m) {
    case IBV_MTU_256: return "256";
    case IBV_MTU_512: return "512";
    case IBV_MTU_1024: return "1024";
    case IBV_MTU_2048: return "2048";
    case IBV_MTU_4096: return "4096";
    default: return "?";
    }
}

/* The device list; NULL with *n 0 for "no devices" (ENOSYS: a kernel
 * without InfiniBand), NULL with *n < 0 (-errno) for a failure. */
static struct ibv_device **device_list(const axf_verbs_table *t, int *n)
{
    errno = 0;
    struct ibv_device **list = t->get_device_list(n);
    if (!list) {
        int err = errno;
        *n = err == ENOSYS || err == 0 || err == ENOENT ? 0 : -err;
    }
    return list;
}

/* The type of GID entry `index` (1 + enum ibv_gid_type), 0 if unknown: from
 * the library (ibv_query_gid_ex), else sysfs, as rdma-core itself reads it. */
static int gid_type_of(const axf_verbs_table *t, struct ibv_context *ctx, const char *dev,
                       uint8_t port, int index)
{
    int type = -1;
    if (t->query_gid_type && t->query_gid_type(ctx, port, index, &type) == 0 && type >= 0)
        return 1 + type;
    char path[256], buf[32] = "";
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%d", dev,
             port, index);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    bool got = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!got)
        return 0;
    if (strstr(buf, "v2"))
        return 1 + IBV_GID_TYPE_ROCE_V2;
    if (strstr(buf, "v1") || strstr(buf, "IB"))
        return 1 + IBV_GID_TYPE_ROCE_V1;
    return 0;
}

/* How good a RoCE GID is to address peers by (NCCL's order): RoCE v2 first
 * (routable, carries DSCP/ECN), a non-link-local address first (fe80::/10
 * does not cross a router), IPv4-mapped first. -1: an empty entry. */
static int gid_score(const union ibv_gid *g, int type)
{
    static const uint8_t zero[16];
    if (!memcmp(g->raw, zero, 16))
        return -1;
    bool link_local = g->raw[0] == 0xfe && (g->raw[1] & 0xc0) == 0x80;
    bool v4mapped = !memcmp(g->raw, zero, 10) && g->raw[10] == 0xff && g->raw[11] == 0xff;
    return (type == 1 + IBV_GID_TYPE_ROCE_V2 ? 4 : 0) + (link_local ? 0 : 2) + (v4mapped ? 1 : 0);
}

/* Picks the port's GID: the override, index 0 on InfiniBand, else the best
 * scored entry (lowest index among equals). false when none is usable. */
static bool gid_pick(const axf_verbs_table *t, vdev *v, const verbs_settings *set, int tbl_len,
                     char *why, size_t why_len)
{
    int best = -1, best_score = -1;
    if (set->gid_index >= 0 || !v->eth) {
        best = set->gid_index >= 0 ? set->gid_index : 0;
    } else {
        for (int i = 0; i < tbl_len && i < 256; i++) {
            union ibv_gid g;
            if (t->query_gid(v->ctx, v->port, i, &g))
                continue;
            int sc = gid_score(&g, gid_type_of(t, v->ctx, v->name, v->port, i));
            if (sc > best_score) {
                best = i;
                best_score = sc;
            }
        }
    }
    if (best < 0 || t->query_gid(v->ctx, v->port, best, &v->gid)) {
        snprintf(why, why_len, "%s: no usable GID on port %u", v->name, v->port);
        return false;
    }
    v->gid_index = (uint8_t)best;
    v->gid_type = v->eth ? (uint8_t)gid_type_of(t, v->ctx, v->name, v->port, best)
                         : (uint8_t)(1 + IBV_GID_TYPE_IB);
    return true;
}

/* Opens a device and finds its first active port; false when unusable. */
static bool dev_open(const axf_verbs_table *t, struct ibv_device *d, vdev *v,
                     const verbs_settings *set, char *why, size_t why_len)
{
    memset(v, 0, sizeof *v);
    /* The provider's name, checked before it is kept: NULL or empty names no
     * device, and one that does not fit v->name (the kernel's and rdma-core's
     * limit, IBV_SYSFS_NAME_MAX with its NUL) is refused, not cut: a cut name
     * matched an allow-list entry naming a different device (its prefix),
     * missed the entry naming it in full, and read another device's sysfs. */
    const char *name = t->get_device_name(d);
    size_t name_len = name ? strnlen(name, sizeof v->name) : 0;
    if (!name_len || name_len == sizeof v->name) {
        snprintf(why, why_len, "%.40s%s: device name %s", name_len ? name : "(device)",
                 name_len ? "..." : "", name_len ? "longer than 63 bytes" : "empty");
        return false;
    }
    memcpy(v->name, name, name_len + 1);
    if (!device_allowed(set, v->name)) {
        snprintf(why, why_len, "%s: not in AIOXFER_VERBS_DEVICES", v->name);
        return false;
    }
    v->ctx = t->open_device(d);
    if (!v->ctx) {
        snprintf(why, why_len, "%s: cannot open: %s", v->name, strerror(errno));
        return false;
    }
    struct ibv_device_attr da;
    memset(&da, 0, sizeof da);
    if (t->query_device(v->ctx, &da)) {
        snprintf(why, why_len, "%s: cannot query", v->name);
        goto fail;
    }
    v->rd_atom = (uint8_t)(da.max_qp_rd_atom > 16 ? 16 : da.max_qp_rd_atom);
    v->rd_init_atom = (uint8_t)(da.max_qp_init_rd_atom > 16 ? 16 : da.max_qp_init_rd_atom);
    for (int p = 1; p <= da.phys_port_cnt; p++) {
        struct ibv_port_attr pa = {0}; /* the library may fill only its compat prefix */
        memset(&pa, 0, sizeof pa);
        if (t->query_port(v->ctx, (uint8_t)p, &pa) || pa.state != IBV_PORT_ACTIVE)
            continue;
        v->port = (uint8_t)p;
        v->lid = pa.lid;
        v->mtu = pa.active_mtu;
        v->eth = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
        if (!gid_pick(t, v, set, pa.gid_tbl_len, why, why_len))
            goto fail;
        return true;
    }
    snprintf(why, why_len, "%s: no active port", v->name);
fail:
    t->close_device(v->ctx);
    v->ctx = NULL;
    return false;
}

static const char *gid_type_text(int t)
{
    return t == 1 + IBV_GID_TYPE_ROCE_V2 ? "RoCE v2"
           : t == 1 + IBV_GID_TYPE_ROCE_V1 ? "RoCE v1"
           : t == 1 + IBV_GID_TYPE_IB      ? "IB"
                                           : "type unknown";
}

int axf_verbs_probe(const char *provider, char *names, size_t names_len, char *why,
                    size_t why_len)
{
    axf_verbs_table t;
    char buf[256] = "";
    if (names && names_len)
        names[0] = 0;
    if (load_table(provider, &t, buf, sizeof buf) != AXF_OK) {
        snprintf(why, why_len, "%s", buf);
        return AXF_E_TRANSPORT;
    }
    int n = 0;
    struct ibv_device **list = device_list(&t, &n);
    if (!list) {
        if (n < 0) {
            snprintf(why, why_len, "%s: cannot list devices: %s", t.provider, strerror(-n));
            return AXF_E_TRANSPORT;
        }
        snprintf(why, why_len, "%s: no RDMA devices (the kernel has no InfiniBand support)",
                 t.provider);
        return 0;
    }
    int usable = 0;
    size_t used = 0;
    char reason[160] = "";
    verbs_settings set;
    axf_env env; /* what an engine created now would use */
    axf_env_take(&env, true);
    settings_read(&env, &set); /* set.devices points into env: held until the loop is done */
    for (int i = 0; i < n; i++) {
        vdev v;
        char r[160];
        if (!dev_open(&t, list[i], &v, &set, r, sizeof r)) {
            snprintf(reason, sizeof reason, "%s", r);
            continue;
        }
        char gid[40];
        snprintf(gid, sizeof gid, "%02x%02x:%02x%02x:...:%02x%02x:%02x%02x", v.gid.raw[0],
                 v.gid.raw[1], v.gid.raw[2], v.gid.raw[3], v.gid.raw[12], v.gid.raw[13],
                 v.gid.raw[14], v.gid.raw[15]);
        int k = snprintf(names + used, names_len > used ? names_len - used : 0,
                         "%s%s (port %u, %s, mtu %s, gid[%u] %s %s)", usable ? "\n" : "",
                         v.name, v.port, v.eth ? "Ethernet" : "InfiniBand", mtu_text(v.mtu),
                         v.gid_index, gid, gid_type_text(v.gid_type));
        if (k > 0 && used + (size_t)k < names_len)
            used += (size_t)k;
        t.close_device(v.ctx);
        usable++;
    }
    axf_env_release(&env);
    t.free_device_list(list);
    if (usable)
        snprintf(why, why_len, "%s: %d device%s", t.provider, usable, usable == 1 ? "" : "s");
    else if (n)
        snprintf(why, why_len, "%s: %d device%s, none usable (%s)", t.provider, n,
                 n == 1 ? "" : "s", reason);
    else
        snprintf(why, why_len, "%s: no RDMA devices", t.provider);
    return usable;
}

/* ------------------------------------------------------------ memory */

static int mr_access(uint32_t access)
{
    int a = 0;
    if (access & AXF_ACCESS_WRITE)
        a |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (access & AXF_ACCESS_READ)
        a |= IBV_ACCESS_REMOTE_READ;
    return a;
}

static size_t mr_bucket(int dev, uint64_t addr)
{
    return (size_t)((addr >> 12) * 31u + (uint64_t)dev) % MR_BUCKETS;
}

/* A registration of [addr, addr+len) on dev, shared with an identical one
 * (vs->mu held). dmabuf_fd >= 0: through that dmabuf at offset. */
static vmr *mr_get(verbs_state *vs, int dev, uint64_t addr, uint64_t len, int access, int dmabuf_fd,
                   uint64_t offset)
{
    size_t b = mr_bucket(dev, addr);
    for (vmr *m = vs->mrs[b]; m; m = m->next)
        if (m->dev == dev && m->addr == addr && m->len == len && m->access == access) {
            m->refs++;
            return m;
        }
    vmr *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    /* Relaxed ordering (PCIe) lets the NIC's writes pass each other: much
     * faster to GPU memory and on some CPUs. An optional access flag: a
     * library or kernel that does not know it refuses it, so try without. */
    int ro = vs->set.relaxed ? IBV_ACCESS_RELAXED_ORDERING : 0;
    for (int pass = ro ? 0 : 1; pass < 2 && !m->mr; pass++) {
        int acc = access | (pass ? 0 : ro);
        if (dmabuf_fd >= 0)
            m->mr = vs->t.reg_dmabuf_mr ? vs->t.reg_dmabuf_mr(vs->dev[dev].pd, offset, len, addr,
                                                            dmabuf_fd, acc)
                                        : NULL;
        else
            m->mr = vs->t.reg_mr(vs->dev[dev].pd, (void *)(uintptr_t)addr, len, acc);
        if (!m->mr && errno != EINVAL && errno != EOPNOTSUPP)
            break; /* not about the flag */
    }
    if (!m->mr) {
        free(m);
        return NULL;
    }
    m->dev = dev;
    m->addr = addr;
    m->len = len;
    m->access = access;
    m->refs = 1;
    m->next = vs->mrs[b];
    vs->mrs[b] = m;
    return m;
}

static void mr_put(verbs_state *vs, vmr *m) /* vs->mu held */
{
    if (--m->refs)
        return;
    vmr **p = &vs->mrs[mr_bucket(m->dev, m->addr)];
    while (*p != m)
        p = &(*p)->next;
    *p = m->next;
    vs->t.dereg_mr(m->mr);
    free(m);
}

/* Registers r into reg on every device neither reg nor have (may be NULL)
 * has a registration on; AXF_OK or the first failure. vs->mu held. */
static int reg_fill(verbs_state *vs, const region *r, struct verbs_reg *reg,
                    const struct verbs_reg *have, int dmabuf_fd, uint64_t offset, char *why,
                    size_t why_len)
{
    int access = mr_access(r->access);
    for (int d = 0; d < vs->ndev; d++) {
        if (reg->mr[d] || (have && have->mr[d]))
            continue;
        reg->mr[d] = mr_get(vs, d, (uint64_t)(uintptr_t)r->addr, r->len, access, dmabuf_fd,
                            offset);
        if (!reg->mr[d]) {
            int err = errno;
            struct rlimit rl;
            if ((err == ENOMEM || err == EPERM || err == EAGAIN) && dmabuf_fd < 0 &&
                getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
                /* Pinning counts against the locked-memory limit, per device. */
                snprintf(why, why_len, "%s: %s (RLIMIT_MEMLOCK is %llu KiB: raise it, e.g. "
                         "ulimit -l unlimited or LimitMEMLOCK=infinity, or name fewer devices "
                         "in AIOXFER_VERBS_DEVICES)", vs->dev[d].name, strerror(err),
                         (unsigned long long)rl.rlim_cur / 1024);
            else
                snprintf(why, why_len, "%s: %s", vs->dev[d].name, strerror(err));
            return AXF_E_REGISTRATION;
        }
    }
    return AXF_OK;
}

/* Registers r on every device it has no registration on yet; AXF_OK or the
 * first failure. vs->mu held, and r not reachable by posts yet (being added,
 * or the engine's lock held too: posts read VREG under e->mu only). */
static int region_register_all(verbs_state *vs, region *r, int dmabuf_fd, uint64_t offset,
                               char *why, size_t why_len)
{
    if (!VREG(r)) {
        r->xp[AXF_EP_VERBS] = calloc(1, sizeof *VREG(r));
        if (!VREG(r))
            return AXF_E_NOMEM;
    }
    return reg_fill(vs, r, VREG(r), NULL, dmabuf_fd, offset, why, why_len);
}

static void region_release_all(verbs_state *vs, region *r) /* vs->mu held */
{
    if (!VREG(r))
        return;
    for (int d = 0; d < AXF_VERBS_MAX_DEVICES; d++)
        if (VREG(r)->mr[d])
            mr_put(vs, VREG(r)->mr[d]);
    free(VREG(r));
    r->xp[AXF_EP_VERBS] = NULL;
}

/* Registers r on every device (vs->mu NOT held). GPU memory: through a
 * dmabuf of the pages around it (GPUDirect RDMA, CUDA >= 11.7 and a kernel
 * with dmabuf MRs), else plainly, which works where the peer-memory module
 * (nvidia-peermem) is loaded. why: what failed (GPU: both ways). */
static int region_register(verbs_state *vs, region *r, char *why, size_t why_len)
{
    char dm_why[160] = "";
    int dmabuf = -1;
    uint64_t dm_off = 0;
    if (r->kind == AXF_MEM_CUDA) {
        if (!vs->t.reg_dmabuf_mr)
            snprintf(dm_why, sizeof dm_why, "this libibverbs has no ibv_reg_dmabuf_mr");
        else if (axf_cuda_dmabuf_range((uint64_t)(uintptr_t)r->addr, r->len, &dmabuf, &dm_off,
                                       dm_why, sizeof dm_why) != AXF_OK)
            dmabuf = -1;
    }
    pthread_mutex_lock(&vs->mu);
    int st = AXF_E_REGISTRATION;
    if (dmabuf >= 0) {
        st = region_register_all(vs, r, dmabuf, dm_off, dm_why, sizeof dm_why);
        if (st != AXF_OK)
            region_release_all(vs, r);
    }
    if (st != AXF_OK) {
        st = region_register_all(vs, r, -1, 0, why, why_len);
        if (st != AXF_OK)
            region_release_all(vs, r);
    }
    pthread_mutex_unlock(&vs->mu);
    if (dmabuf >= 0)
        close(dmabuf); /* the registrations hold their own reference */
    if (st != AXF_OK && r->kind == AXF_MEM_CUDA) {
        char plain[200];
        snprintf(plain, sizeof plain, "%s", why);
        snprintf(why, why_len, "dmabuf: %s; peer memory (nvidia-peermem): %s",
                 dm_why[0] ? dm_why : "refused", plain);
    }
    return st;
}

static int verbs_region_add(axf_engine *e, region *r)
{
    verbs_state *vs = VS_OF(e);
    if (!vs || r->kind == AXF_MEM_FILE)
        return AXF_OK;
    char why[400] = "";
    int st = region_register(vs, r, why, sizeof why);
    if (st == AXF_OK || st == AXF_E_NOMEM)
        return st;
    if (r->kind == AXF_MEM_CUDA) {
        /* Neither way: verbs cannot reach it (the axf_verbs_region_dmabuf hook
         * may still register it). Loud, because the fallback is slow. */
        cq_log(e, 0,
               "verbs: GPU region of %llu bytes not registered for GPUDirect RDMA (%s); slow "
               "path: it is unreachable over verbs, and there is no host staging",
               (unsigned long long)r->len, why);
        return AXF_OK;
    }
    cq_log(e, 0, "verbs: cannot register %llu bytes: %s", (unsigned long long)r->len, why);
    return st;
}

static void verbs_region_free(axf_engine *e, region *r)
{
    verbs_state *vs = VS_OF(e);
    if (!vs || !VREG(r))
        return;
    pthread_mutex_lock(&vs->mu);
    region_release_all(vs, r);
    pthread_mutex_unlock(&vs->mu);
}

static bool verbs_region_usable(const region *r)
{
    if (!VREG(r))
        return false;
    return VREG(r)->mr[0] != NULL; /* all or none (but CUDA: per device, checked at post) */
}

int axf_verbs_region_keys(axf_engine *e, uint64_t rid, uint64_t *addrs, uint32_t *rkeys,
                          size_t max)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return 0;
    pthread_mutex_lock(&e->mu);
    region *r = region_get(e, rid);
    pthread_mutex_unlock(&e->mu);
    if (!r)
        return AXF_E_NOTFOUND;
    int n = 0;
    pthread_mutex_lock(&vs->mu);
    for (int d = 0; d < vs->ndev && (size_t)d < max; d++, n++) {
        vmr *m = VREG(r) ? VREG(r)->mr[d] : NULL;
        addrs[d] = m ? m->addr : 0;
        rkeys[d] = m ? m->mr->rkey : 0;
    }
    pthread_mutex_unlock(&vs->mu);
    region_unref(e, r);
    return n;
}

int axf_verbs_region_dmabuf(axf_engine *e, uint64_t rid, int fd, uint64_t offset)
{
    verbs_state *vs = VS_OF(e);
    if (!vs || fd < 0)
        return AXF_E_INVALID;
    pthread_mutex_lock(&e->mu);
    region *r = region_get(e, rid);
    pthread_mutex_unlock(&e->mu);
    if (!r)
        return AXF_E_NOTFOUND;
    char why[200] = "";
    int st = r->kind == AXF_MEM_CUDA ? AXF_OK : AXF_E_INVALID;
    struct verbs_reg *add = NULL;
    if (st == AXF_OK && !(add = calloc(1, sizeof *add)))
        st = AXF_E_NOMEM;
    if (st == AXF_OK) {
        /* The region is live: posts read its registrations under e->mu
         * (verbs_submit, region_usable). Registered aside under vs->mu (slow:
         * not under the engine's lock), then published under both. */
        pthread_mutex_lock(&vs->mu);
        st = reg_fill(vs, r, add, VREG(r), fd, offset, why, sizeof why);
        pthread_mutex_unlock(&vs->mu);
        bool any = false;
        for (int d = 0; d < AXF_VERBS_MAX_DEVICES; d++)
            any |= add->mr[d] != NULL;
        pthread_mutex_lock(&e->mu);
        pthread_mutex_lock(&vs->mu);
        if (any && !VREG(r)) {
            r->xp[AXF_EP_VERBS] = add;
            add = NULL;
        }
        for (int d = 0; add && d < AXF_VERBS_MAX_DEVICES; d++) {
            if (!add->mr[d])
                continue;
            if (!VREG(r)->mr[d])
                VREG(r)->mr[d] = add->mr[d];
            else /* a concurrent call registered it first */
                mr_put(vs, add->mr[d]);
        }
        pthread_mutex_unlock(&vs->mu);
        pthread_mutex_unlock(&e->mu);
    }
    free(add);
    if (st == AXF_E_REGISTRATION)
        cq_log(e, 0, "verbs: dmabuf registration of GPU region %llu failed (%s)%s",
               (unsigned long long)rid, why,
               vs->t.reg_dmabuf_mr ? "" : ": this libibverbs has no ibv_reg_dmabuf_mr");
    region_unref(e, r);
    return st;
}

/* ------------------------------------------------------------ queue pairs */

static void wake(verbs_state *vs)
{
    uint64_t one = 1;
    ssize_t r = write(vs->wakefd, &one, sizeof one);
    (void)r; /* EAGAIN: already signalled */
}

/* A queue pair on device devi for endpoint ep (initiator), or for the
 * accepting side (ep NULL). ep is set before q is linked into vs->qps and
 * never changes: whoever finds q there (the poller) reads it race-free. */
static vqp *qp_new(verbs_state *vs, int devi, endpoint *ep, char *why, size_t why_len)
{
    vdev *d = &vs->dev[devi];
    vqp *q = calloc(1, sizeof *q);
    if (!q)
        return NULL;
    q->vs = vs;
    q->devi = devi;
    q->ep = ep;
    pthread_mutex_init(&q->mu, NULL);
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = d->cq;
    ia.recv_cq = d->cq;
    ia.cap.max_send_wr = SQ_DEPTH;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = MAX_INLINE;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;
    q->qp = vs->t.create_qp(d->pd, &ia);
    if (!q->qp) { /* some devices take no inline data */
        ia.cap.max_inline_data = 0;
        q->qp = vs->t.create_qp(d->pd, &ia);
    }
    if (!q->qp) {
        snprintf(why, why_len, "%s: create_qp: %s", d->name, strerror(errno));
        goto fail;
    }
    q->max_inline = ia.cap.max_inline_data;
    uint32_t psn = 0;
    if (getrandom(&psn, sizeof psn, 0) != (ssize_t)sizeof psn)
        psn = (uint32_t)axf_now_us();
    q->psn = psn & 0xffffff;
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = d->port;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (vs->t.modify_qp(q->qp, &a,
                        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        snprintf(why, why_len, "%s: queue pair to INIT: %s", d->name, strerror(errno));
        vs->t.destroy_qp(q->qp);
        goto fail;
    }
    pthread_mutex_lock(&vs->mu);
    q->gen = ++vs->qp_gens;
    q->next_all = vs->qps;
    vs->qps = q;
    pthread_mutex_unlock(&vs->mu);
    return q;
fail:
    pthread_mutex_destroy(&q->mu);
    free(q);
    return NULL;
}

static void qp_info(const vqp *q, axf_verbs_qp_info *out)
{
    const vdev *d = &q->vs->dev[q->devi];
    memset(out, 0, sizeof *out);
    out->qpn = q->qp->qp_num;
    out->psn = q->psn;
    out->mtu = (uint32_t)d->mtu;
    out->lid = d->lid;
    out->port = d->port;
    out->gid_index = d->gid_index;
    memcpy(out->gid, d->gid.raw, 16);
    out->link_layer = d->eth ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
    out->gid_type = d->gid_type;
    out->max_dest_rd_atomic = d->rd_atom ? d->rd_atom : 1;
}

/* INIT -> RTR -> RTS towards the peer's queue pair. */
static int qp_connect(vqp *q, const axf_verbs_qp_info *r, char *why, size_t why_len)
{
    verbs_state *vs = q->vs;
    const vdev *d = &vs->dev[q->devi];
    if (r->mtu < IBV_MTU_256 || r->mtu > IBV_MTU_4096 || r->psn > 0xffffff ||
        r->qpn > 0xffffff) {
        snprintf(why, why_len, "peer's queue pair parameters out of range");
        return AXF_E_PROTOCOL;
    }
    /* Both ends must speak the same link and GID type: InfiniBand frames never
     * reach a RoCE port, RoCE v1 never reaches a v2 GID. Refused now rather
     * than left to time out on the first transfer. (0: the peer did not say.) */
    uint8_t ll = d->eth ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
    if (r->link_layer && r->link_layer != ll) {
        snprintf(why, why_len, "%s: link layer %s, the peer's %s: not connectable", d->name,
                 d->eth ? "Ethernet" : "InfiniBand",
                 r->link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand");
        return AXF_E_TRANSPORT;
    }
    if (r->gid_type && d->gid_type && r->gid_type != d->gid_type) {
        snprintf(why, why_len, "%s: GID[%u] is %s, the peer's %s: set AIOXFER_VERBS_GID_INDEX "
                 "to entries of one type on both", d->name, d->gid_index,
                 gid_type_text(d->gid_type), gid_type_text(r->gid_type));
        return AXF_E_TRANSPORT;
    }
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)r->mtu < d->mtu ? (enum ibv_mtu)r->mtu : d->mtu;
    a.dest_qp_num = r->qpn;
    a.rq_psn = r->psn;
    a.max_dest_rd_atomic = d->rd_atom ? d->rd_atom : 1;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = r->lid;
    a.ah_attr.port_num = d->port;
    a.ah_attr.sl = vs->set.sl;
    static const uint8_t zero[16];
    if (d->eth || memcmp(r->gid, zero, 16)) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, r->gid, 16);
        a.ah_attr.grh.sgid_index = d->gid_index;
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.grh.traffic_class = vs->set.tc;
    }
    if (vs->t.modify_qp(q->qp, &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                            IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
        snprintf(why, why_len, "%s: queue pair to RTR: %s", d->name, strerror(errno));
        return AXF_E_TRANSPORT;
    }
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    /* 4.096 us * 2^timeout per try, retry_cnt tries: 20 and 7 (~30 s to
     * declare a peer gone) ride out a switch reboot or congestion pause,
     * where 14 (67 ms) turned every hiccup into a lost peer. */
    a.timeout = vs->set.timeout;
    a.retry_cnt = vs->set.retry_cnt;
    a.rnr_retry = 7;
    a.sq_psn = q->psn;
    /* READs in flight: no more than the peer's queue pair serves
     * (max_dest_rd_atomic), else the peer's NIC NAKs them under load. A peer
     * that did not say is taken to be like us. */
    uint8_t depth = d->rd_init_atom ? d->rd_init_atom : 1;
    uint8_t peer = r->max_dest_rd_atomic ? r->max_dest_rd_atomic : (d->rd_atom ? d->rd_atom : 1);
    a.max_rd_atomic = depth < peer ? depth : peer;
    if (vs->t.modify_qp(q->qp, &a,
                        IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                            IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
        snprintf(why, why_len, "%s: queue pair to RTS: %s", d->name, strerror(errno));
        return AXF_E_TRANSPORT;
    }
    return AXF_OK;
}

static void qp_to_error(vqp *q) /* q->mu held */
{
    if (q->err)
        return;
    q->err = true;
    if (q->qp) {
        struct ibv_qp_attr a;
        memset(&a, 0, sizeof a);
        a.qp_state = IBV_QPS_ERR;
        (void)q->vs->t.modify_qp(q->qp, &a, IBV_QP_STATE);
    }
}

/* An initiator's queue pair in the error state with nothing posted or
 * waiting is of no further use: its device resources go now rather than at
 * shutdown (the struct stays with its endpoint). q->mu held. */
static void qp_retire(vqp *q)
{
    if (q->err && q->ep && q->qp && !q->posted_head && !q->pend_head) {
        struct ibv_qp *qp = q->qp;
        pthread_mutex_lock(&q->vs->mu);
        q->qp = NULL;
        pthread_mutex_unlock(&q->vs->mu);
        q->vs->t.destroy_qp(qp);
    }
}

/* Unlinks q from vs->qps, destroys its queue pair and frees it. Nothing may
 * be posted on it. */
static void qp_free(verbs_state *vs, vqp *q)
{
    pthread_mutex_lock(&vs->mu);
    for (vqp **p = &vs->qps; *p; p = &(*p)->next_all)
        if (*p == q) {
            *p = q->next_all;
            break;
        }
    pthread_mutex_unlock(&vs->mu);
    if (q->qp)
        vs->t.destroy_qp(q->qp);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

int axf_verbs_qp_create(axf_engine *e, uint64_t ep_id, uint32_t dev, axf_verbs_qp_info *out)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return AXF_E_TRANSPORT;
    if (dev >= (uint32_t)vs->ndev || !out)
        return AXF_E_INVALID;
    char why[200] = "";
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    int st = AXF_OK;
    if (e->shut)
        st = AXF_E_CLOSED;
    else if (!ep || ep->kind != AXF_EP_VERBS)
        st = ep ? AXF_E_INVALID : AXF_E_NOTFOUND;
    else if (ep->dead)
        st = AXF_E_CLOSED;
    else if (!VEP(ep) && !(ep->priv = calloc(1, sizeof *VEP(ep))))
        st = AXF_E_NOMEM;
    else if (VEP(ep)->rail[dev])
        st = AXF_E_INVALID;
    vqp *q = NULL;
    if (st == AXF_OK) {
        q = qp_new(vs, (int)dev, ep, why, sizeof why);
        if (q) {
            VEP(ep)->rail[dev] = q;
            qp_info(q, out);
        } else {
            st = AXF_E_TRANSPORT;
        }
    }
    pthread_mutex_unlock(&e->mu);
    if (*why)
        cq_log(e, ep ? ep->tag : 0, "verbs: %s", why);
    return st;
}

int axf_verbs_qp_connect(axf_engine *e, uint64_t ep_id, uint32_t dev, uint32_t remote_dev,
                         const axf_verbs_qp_info *remote)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return AXF_E_TRANSPORT;
    if (dev >= AXF_VERBS_MAX_DEVICES || remote_dev >= AXF_VERBS_MAX_DEVICES || !remote)
        return AXF_E_INVALID;
    char why[200] = "";
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    vqp *q = ep && VEP(ep) ? VEP(ep)->rail[dev] : NULL;
    int st = !q ? AXF_E_NOTFOUND : ep->dead ? AXF_E_CLOSED : AXF_OK;
    if (st == AXF_OK) {
        pthread_mutex_lock(&q->mu);
        if (q->ready || q->err)
            st = AXF_E_INVALID;
        else if ((st = qp_connect(q, remote, why, sizeof why)) == AXF_OK) {
            q->rdev = (int)remote_dev;
            q->ready = true;
        }
        pthread_mutex_unlock(&q->mu);
    }
    pthread_mutex_unlock(&e->mu);
    if (*why)
        cq_log(e, ep ? ep->tag : 0, "verbs: %s", why);
    return st;
}

int axf_verbs_accept_qp(axf_engine *e, uint32_t dev, const axf_verbs_qp_info *remote,
                        axf_verbs_qp_info *out, uint64_t *qp_out)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return AXF_E_TRANSPORT;
    if (dev >= (uint32_t)vs->ndev || !remote || !out || !qp_out)
        return AXF_E_INVALID;
    char why[200] = "";
    vqp *q = qp_new(vs, (int)dev, NULL, why, sizeof why);
    int st = q ? qp_connect(q, remote, why, sizeof why) : AXF_E_TRANSPORT;
    if (st != AXF_OK) {
        if (q)
            qp_free(vs, q);
        cq_log(e, 0, "verbs: %s", why);
        return st;
    }
    q->ready = true;
    qp_info(q, out);
    pthread_mutex_lock(&vs->mu);
    q->handle = ++vs->next_handle;
    q->next_conn = vs->unbound;
    vs->unbound = q;
    pthread_mutex_unlock(&vs->mu);
    *qp_out = q->handle;
    return AXF_OK;
}

static vqp *unbound_take(verbs_state *vs, uint64_t handle) /* vs->mu held */
{
    for (vqp **p = &vs->unbound; *p; p = &(*p)->next_conn)
        if ((*p)->handle == handle) {
            vqp *q = *p;
            *p = q->next_conn;
            q->next_conn = NULL;
            return q;
        }
    return NULL;
}

int axf_verbs_qp_destroy(axf_engine *e, uint64_t handle)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return AXF_E_TRANSPORT;
    pthread_mutex_lock(&vs->mu);
    vqp *q = unbound_take(vs, handle);
    pthread_mutex_unlock(&vs->mu);
    if (!q)
        return AXF_E_NOTFOUND;
    qp_free(vs, q);
    return AXF_OK;
}

int axf_verbs_accept_conn(axf_engine *e, int fd, uint64_t tag, const uint64_t *qps, size_t n)
{
    verbs_state *vs = VS_OF(e);
    if (!vs) {
        close(fd);
        return AXF_E_TRANSPORT;
    }
    vqp *list = NULL;
    bool missing = false;
    pthread_mutex_lock(&vs->mu);
    for (size_t i = 0; i < n; i++) {
        vqp *q = unbound_take(vs, qps[i]);
        if (!q) {
            missing = true;
            continue;
        }
        q->next_conn = list;
        list = q;
    }
    pthread_mutex_unlock(&vs->mu);
    int st = missing ? AXF_E_NOTFOUND : AXF_OK;
    conn *c = NULL;
    pthread_mutex_lock(&e->mu);
    if (st == AXF_OK && (e->shut || e->bye)) /* closing: as axf_accept_conn (cq21) */
        st = AXF_E_CLOSED;
    if (st == AXF_OK) {
        c = conn_start(e, NULL, tag, fd, &st);
        if (c) { /* under the same hold as its start: its exit sees the list */
            c->xp[AXF_EP_VERBS] = list;
            list = NULL;
        }
    } else {
        close(fd);
    }
    pthread_mutex_unlock(&e->mu);
    while (list) {
        vqp *next = list->next_conn;
        qp_free(vs, list);
        list = next;
    }
    return st;
}

static void verbs_conn_closed(axf_engine *e, conn *c)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return;
    pthread_mutex_lock(&e->mu);
    vqp *list = VQP(c);
    c->xp[AXF_EP_VERBS] = NULL;
    pthread_mutex_unlock(&e->mu);
    /* The peer's requests fail from now on (retries exhausted): nothing of
     * ours is reachable through these any more. */
    while (list) {
        vqp *next = list->next_conn;
        qp_free(vs, list);
        list = next;
    }
}

int axf_endpoint_import_verbs(axf_engine *e, uint64_t ep_id, uint64_t rid, const uint64_t *addrs,
                              const uint32_t *rkeys, size_t n)
{
    if (!n || n > AXF_VERBS_MAX_DEVICES)
        return AXF_E_INVALID;
    struct verbs_rkeys *k = calloc(1, sizeof *k);
    if (!k)
        return AXF_E_NOMEM;
    k->n = (uint32_t)n;
    memcpy(k->addr, addrs, n * sizeof *addrs);
    memcpy(k->rkey, rkeys, n * sizeof *rkeys);
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    rregion *rr = ep && ep->kind == AXF_EP_VERBS ? rr_find(ep, rid) : NULL;
    int st = !ep ? AXF_E_NOTFOUND : ep->kind != AXF_EP_VERBS ? AXF_E_INVALID
                                      : !rr                  ? AXF_E_NOTFOUND
                                                             : AXF_OK;
    if (st == AXF_OK) {
        for (size_t d = 0; d < n; d++) /* the whole remote range must be addressable */
            if (k->addr[d] + rr->len < k->addr[d])
                st = AXF_E_INVALID;
    }
    if (st == AXF_OK) {
        free(VRK(rr)); /* set once in practice: ops only read it under e->mu at post */
        rr->xp[AXF_EP_VERBS] = k;
        k = NULL;
    }
    pthread_mutex_unlock(&e->mu);
    free(k);
    return st;
}

/* ------------------------------------------------------------ posting */

/* Posts chain c if q and its device have room (q->mu and vs->mu held).
 * Returns false when it must wait. A post_send failure marks the chain
 * failed; what it took is counted in c->partial and flushed. */
static bool chain_post(vqp *q, vchain *c)
{
    verbs_state *vs = q->vs;
    vdev *d = &vs->dev[q->devi];
    if (q->sq_used + c->nwr > SQ_DEPTH || d->cq_room < (uint32_t)c->nwr)
        return false;
    struct ibv_send_wr *bad = NULL;
    int r = vs->t.post_send(q->qp, c->wr, &bad);
    int took = c->nwr;
    if (r) {
        took = 0; /* the requests before bad_wr were taken (none if it is unset) */
        for (struct ibv_send_wr *w = c->wr; bad && w && w != bad; w = w->next)
            took++;
        c->failed = true;
        op_set_status(c->o, AXF_E_TRANSPORT, c->wi[took < c->nwr ? took : 0].index);
        c->partial = true;
        c->left = took;
        qp_to_error(q); /* what it took flushes; the endpoint is lost */
        q->post_failed = true;
        if (took) {
            /* The requests it took are unsignalled: those that completed
             * before the error produce no completion at all, so counting
             * them could wait forever. A signalled request posted now (on a
             * queue pair in the error state it is flushed at once) completes
             * after every one before it: it ends the chain. */
            struct ibv_send_wr *w = &c->wr[c->nwr], *bad2 = NULL;
            memset(w, 0, sizeof *w);
            c->wi[c->nwr] = (wr_info){.c = c, .index = c->wi[0].index, .last = true};
            w->wr_id = (uint64_t)(uintptr_t)&c->wi[c->nwr];
            w->opcode = IBV_WR_RDMA_WRITE;
            w->send_flags = IBV_SEND_SIGNALED;
            if (vs->t.post_send(q->qp, w, &bad2) == 0) {
                c->drained = true;
                took++;
            } else {
                /* Refused too (some providers refuse posts on a queue pair
                 * in the error state): nothing will say when what it took is
                 * over. The poller destroys the queue pair (qp_abandon). */
                q->abandon = true;
            }
        }
    }
    c->took = took;
    q->sq_used += took;
    d->cq_room -= (uint32_t)took;
    if (!took) { /* nothing posted: fail it on the poller */
        c->next = vs->fail;
        vs->fail = c;
        return true;
    }
    c->next = NULL;
    if (q->posted_tail)
        q->posted_tail->next = c;
    else
        q->posted_head = c;
    q->posted_tail = c;
    return true;
}

/* Queues chain c on q: posted now when there is room and nothing waits
 * before it, else pending; failed (on the poller) when q is broken. */
static void chain_queue(vqp *q, vchain *c)
{
    verbs_state *vs = q->vs;
    pthread_mutex_lock(&q->mu);
    pthread_mutex_lock(&vs->mu);
    bool wakeup = false;
    if (q->err || !q->ready) {
        c->next = vs->fail;
        vs->fail = c;
        wakeup = true;
    } else if (q->pend_head || !chain_post(q, c)) {
        c->next = NULL;
        if (q->pend_tail)
            q->pend_tail->next = c;
        else
            q->pend_head = c;
        q->pend_tail = c;
    }
    wakeup |= vs->fail != NULL || q->post_failed;
    pthread_mutex_unlock(&vs->mu);
    pthread_mutex_unlock(&q->mu);
    if (wakeup)
        wake(vs);
}

static vchain *chain_new(op *o, vqp *q)
{
    /* One slot more than a chain holds: the drain request of a partial post. */
    size_t sz = sizeof(vchain) + (CHAIN_WRS + 1) * (sizeof(struct ibv_send_wr) +
                                                    sizeof(struct ibv_sge) + sizeof(wr_info));
    vchain *c = calloc(1, sz);
    if (!c)
        return NULL;
    c->o = o;
    c->q = q;
    c->wr = (struct ibv_send_wr *)(c + 1);
    c->sge = (struct ibv_sge *)(c->wr + CHAIN_WRS + 1);
    c->wi = (wr_info *)(c->sge + CHAIN_WRS + 1);
    return c;
}

/* Appends one work request: bytes [off, off+len) of descriptor i. */
static void chain_add(vchain *c, const op *o, size_t i, uint64_t off, uint64_t len,
                      const struct verbs_rkeys *k)
{
    vqp *q = c->q;
    int n = c->nwr++;
    const axf_desc *d = &o->d[i];
    region *lr = NULL;
    for (size_t j = 0; j < o->nlregs && !lr; j++)
        if (o->lregs[j]->id == d->lrid)
            lr = o->lregs[j];
    struct ibv_send_wr *w = &c->wr[n];
    struct ibv_sge *s = &c->sge[n];
    s->addr = (uint64_t)(uintptr_t)(o->laddr[i] + off);
    s->length = (uint32_t)len;
    s->lkey = VREG(lr)->mr[q->devi]->mr->lkey;
    c->wi[n] = (wr_info){.c = c, .index = i, .last = false};
    memset(w, 0, sizeof *w);
    w->wr_id = (uint64_t)(uintptr_t)&c->wi[n];
    w->sg_list = s;
    w->num_sge = 1;
    w->opcode = o->opcode == AXF_OP_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    /* Inline: the CPU copies the payload into the request in post_send. Host
     * memory only: a GPU's memory is not CPU-readable (the posting thread
     * would fault), and a dmabuf registration has no CPU mapping to read. */
    if (o->opcode == AXF_OP_WRITE && len <= q->max_inline && lr->kind == AXF_MEM_HOST)
        w->send_flags = IBV_SEND_INLINE;
    w->wr.rdma.remote_addr = k->addr[q->rdev] + d->roff + off;
    w->wr.rdma.rkey = k->rkey[q->rdev];
    if (n)
        c->wr[n - 1].next = w;
    c->bytes += len;
}

static void chain_close(vchain *c)
{
    c->wi[c->nwr - 1].last = true;
    c->wr[c->nwr - 1].send_flags |= IBV_SEND_SIGNALED;
    c->wr[c->nwr - 1].next = NULL;
}

static bool verbs_submit(axf_engine *e, op *o)
{
    endpoint *ep = o->ep;
    struct verbs_ep *vep = VEP(ep);
    vqp *rails[AXF_VERBS_MAX_DEVICES];
    int nr = 0;
    for (int d = 0; vep && d < AXF_VERBS_MAX_DEVICES; d++) {
        vqp *q = vep->rail[d];
        if (!q)
            continue;
        pthread_mutex_lock(&q->mu);
        if (q->ready && !q->err)
            rails[nr++] = q;
        pthread_mutex_unlock(&q->mu);
    }
    atomic_store(&o->remaining, 1);
    if (!nr) {
        op_set_status(o, vep ? AXF_E_PEER_LOST : AXF_E_TRANSPORT, 0);
        return false;
    }
    /* Every descriptor must be addressable on every rail it may take, and its
     * local memory registered there: checked before anything moves. */
    for (size_t i = 0; i < o->n; i++) {
        const struct verbs_rkeys *k = VRK(o->rr[i]);
        region *lr = NULL;
        for (size_t j = 0; j < o->nlregs && !lr; j++)
            if (o->lregs[j]->id == o->d[i].lrid)
                lr = o->lregs[j];
        bool ok = k && lr && VREG(lr);
        for (int r = 0; ok && r < nr; r++)
            ok = (uint32_t)rails[r]->rdev < k->n && k->addr[rails[r]->rdev] &&
                 VREG(lr)->mr[rails[r]->devi];
        if (!ok) {
            op_set_status(o, k ? AXF_E_INVALID : AXF_E_ACCESS, i);
            return false;
        }
    }
    /* Striped: a rail takes chunk_bytes (whole small descriptors, or one
     * chunk of a big one) before the next one does. */
    uint64_t chunk = e->cfg.chunk_bytes < (1u << 30) ? e->cfg.chunk_bytes : (1u << 30);
    vchain *open[AXF_VERBS_MAX_DEVICES] = {0};
    vchain *done_head = NULL, **done_tail = &done_head;
    int r = vep->next % nr;
    uint64_t on_rail = 0;
    long chains = 0;
    bool oom = false;
    for (size_t i = 0; i < o->n && !oom; i++) {
        const struct verbs_rkeys *k = VRK(o->rr[i]);
        for (uint64_t off = 0; off < o->d[i].len && !oom;) {
            uint64_t len = o->d[i].len - off < chunk ? o->d[i].len - off : chunk;
            if (on_rail >= chunk) {
                r = (r + 1) % nr;
                on_rail = 0;
            }
            if (!open[r] && !(open[r] = chain_new(o, rails[r]))) {
                oom = true;
                break;
            }
            chain_add(open[r], o, i, off, len, k);
            if (open[r]->nwr == CHAIN_WRS) {
                chain_close(open[r]);
                *done_tail = open[r];
                done_tail = &open[r]->next;
                open[r] = NULL;
                chains++;
            }
            on_rail += len;
            off += len;
        }
    }
    vep->next = (r + 1) % nr;
    for (int j = 0; j < nr; j++)
        if (open[j]) {
            if (oom) {
                free(open[j]);
                continue;
            }
            chain_close(open[j]);
            *done_tail = open[j];
            done_tail = &open[j]->next;
            chains++;
        }
    if (oom) {
        while (done_head) {
            vchain *n = done_head->next;
            free(done_head);
            done_head = n;
        }
        op_set_status(o, AXF_E_NOMEM, 0);
        return false;
    }
    /* Set before any chain is posted: completions may come at once. */
    atomic_store(&o->remaining, chains);
    while (done_head) {
        vchain *n = done_head->next;
        chain_queue(done_head->q, done_head);
        done_head = n;
    }
    return true;
}

/* ------------------------------------------------------------ completions */

static int wc_status(axf_engine *e, const op *o, enum ibv_wc_status s)
{
    /* While we close, the peer's end goes too: whatever fails, we did it.
     * (Error paths only: the lock costs nothing that matters.) */
    pthread_mutex_lock(&e->mu);
    bool closing = e->shut || o->ep->closing;
    pthread_mutex_unlock(&e->mu);
    if (s != IBV_WC_REM_ACCESS_ERR && closing)
        return AXF_E_CLOSED;
    switch (s) {
    case IBV_WC_REM_ACCESS_ERR:
        return AXF_E_ACCESS;
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_FATAL_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
        return AXF_E_PEER_LOST;
    default:
        return AXF_E_TRANSPORT;
    }
}

/* Queue pair q hit an error: its endpoint is lost (the control connections
 * go, their end flushes every queue pair of it). No lock held. */
static void qp_failed(axf_engine *e, vqp *q, const char *what)
{
    endpoint *ep = q->ep;
    if (!ep)
        return;
    pthread_mutex_lock(&e->mu);
    bool first = !ep->dead && !ep->closing;
    /* Reported here, before the op that met the error finishes: a caller
     * woken by it sees the peer lost (the connections' end reports no more). */
    bool report = first && !ep->lost_reported;
    if (report)
        ep->lost_reported = true;
    for (int i = 0; i < ep->nconns; i++)
        conn_kill(ep->conns[i]);
    verbs_ep_dead(e, ep);
    pthread_mutex_unlock(&e->mu);
    if (first)
        cq_log(e, ep->tag, "verbs: queue pair on %s failed (%s): peer lost",
               q->vs->dev[q->devi].name, what);
    if (report)
        cq_push(e, AXF_CQ_PEER_LOST, AXF_E_PEER_LOST, ep->id, ep->tag, 0, 0, NULL, 0);
}

/* Posts what waits on q as far as there is room; cancelled ops' chains are
 * dropped. Dropped chains are returned (to finish with no lock held). */
static vchain *drain_pending(vqp *q)
{
    verbs_state *vs = q->vs;
    vchain *dropped = NULL;
    pthread_mutex_lock(&q->mu);
    pthread_mutex_lock(&vs->mu);
    while (q->pend_head) {
        vchain *c = q->pend_head, *next = c->next; /* chain_post relinks c */
        bool drop = q->err || atomic_load(&c->o->cancelled);
        if (!drop && !chain_post(q, c))
            break;
        q->pend_head = next;
        if (!q->pend_head)
            q->pend_tail = NULL;
        if (drop) {
            c->next = dropped;
            dropped = c;
        }
    }
    bool again = q->post_failed; /* a post here failed: the next round reports it */
    pthread_mutex_unlock(&vs->mu);
    qp_retire(q);
    pthread_mutex_unlock(&q->mu);
    if (again)
        wake(vs);
    return dropped;
}

static void chain_finish(axf_engine *e, vchain *c)
{
    op *o = c->o;
    if (!c->failed)
        atomic_fetch_add(&o->nbytes, c->bytes);
    else if (atomic_load(&o->status) == AXF_OK)
        op_set_status(o, wc_status(e, o, IBV_WC_WR_FLUSH_ERR), c->wi[0].index);
    free(c);
    op_unit_done(e, o);
}

static void finish_list(axf_engine *e, vchain *c)
{
    while (c) {
        vchain *n = c->next;
        if (!c->failed) { /* never posted */
            c->failed = true;
            op_set_status(c->o, wc_status(e, c->o, IBV_WC_WR_FLUSH_ERR), c->wi[0].index);
        }
        chain_finish(e, c);
        c = n;
    }
}

static void handle_wc(verbs_state *vs, const struct ibv_wc *wc)
{
    axf_engine *e = vs->e;
    wr_info *wi = (wr_info *)(uintptr_t)wc->wr_id;
    vchain *c = wi->c;
    vqp *q = c->q;
    if (wc->status != IBV_WC_SUCCESS) {
        int st = wc_status(e, c->o, wc->status);
        c->failed = true;
        op_set_status(c->o, st, wi->index);
        if (wc->status != IBV_WC_WR_FLUSH_ERR) {
            pthread_mutex_lock(&q->mu);
            qp_to_error(q);
            pthread_mutex_unlock(&q->mu);
            if (st == AXF_E_TRANSPORT)
                cq_log(e, q->ep ? q->ep->tag : 0, "verbs: work request failed: status %d (%s)",
                       (int)wc->status, wc->status == IBV_WC_REM_INV_REQ_ERR ? "invalid request"
                                        : wc->status == IBV_WC_LOC_PROT_ERR ? "local protection"
                                                                             : "see ibv_wc_status");
            qp_failed(e, q, wc->status == IBV_WC_REM_ACCESS_ERR ? "remote access error"
                            : st == AXF_E_PEER_LOST            ? "peer unreachable"
                                                               : "work request error");
        }
    }
    bool over = c->partial && !c->drained ? --c->left == 0 : wi->last;
    if (!over)
        return;
    pthread_mutex_lock(&q->mu);
    pthread_mutex_lock(&vs->mu);
    /* RC completes in order: it is the oldest posted chain of q. */
    vchain **p = &q->posted_head, *prev = NULL;
    while (*p && *p != c) {
        prev = *p;
        p = &(*p)->next;
    }
    if (*p) {
        *p = c->next;
        if (q->posted_tail == c)
            q->posted_tail = prev;
    }
    q->sq_used -= c->took;
    vs->dev[q->devi].cq_room += (uint32_t)c->took;
    pthread_mutex_unlock(&vs->mu);
    qp_retire(q);
    pthread_mutex_unlock(&q->mu);
    chain_finish(e, c);
}

static void drain_cq(verbs_state *vs, vdev *d)
{
    struct ibv_wc wc[32];
    int n;
    while ((n = vs->t.poll_cq(d->cq, 32, wc)) > 0)
        for (int i = 0; i < n; i++)
            handle_wc(vs, &wc[i]);
}

static void qp_take_chains(vqp *q, vdev *d, vchain **left);

/* A post_send refused part way whose drain request was refused too: the
 * requests it took that completed before the error made no completion, so
 * nothing will say they are over. Destroying the queue pair does: afterwards
 * it touches no memory and completes nothing. What it completed before is in
 * the completion queue (drained here, on the poller, so that no completion
 * names a chain freed below); every chain still on it then fails now.
 * Poller thread, no lock held. */
static void qp_abandon(verbs_state *vs, vqp *q)
{
    vdev *d = &vs->dev[q->devi];
    pthread_mutex_lock(&q->mu);
    pthread_mutex_lock(&vs->mu);
    struct ibv_qp *qp = q->abandon ? q->qp : NULL;
    q->abandon = false;
    if (qp)
        q->qp = NULL;
    pthread_mutex_unlock(&vs->mu);
    pthread_mutex_unlock(&q->mu);
    if (!qp)
        return;
    vs->t.destroy_qp(qp);
    if (!d->dead)
        drain_cq(vs, d);
    vchain *left = NULL;
    pthread_mutex_lock(&q->mu);
    pthread_mutex_lock(&vs->mu);
    qp_take_chains(q, d, &left);
    pthread_mutex_unlock(&vs->mu);
    pthread_mutex_unlock(&q->mu);
    for (vchain *c = left; c; c = c->next)
        if (!c->failed) {
            c->failed = true;
            op_set_status(c->o, AXF_E_TRANSPORT, c->wi[0].index);
        }
    finish_list(vs->e, left);
}

/* Pending chains of every queue pair: posted where completions made room. */
static void drain_all_pending(verbs_state *vs)
{
    axf_engine *e = vs->e;
    pthread_mutex_lock(&vs->mu);
    size_t nq = 0, cap = 0;
    for (vqp *q = vs->qps; q; q = q->next_all)
        cap += q->pend_head != NULL || q->post_failed;
    vqp **qs = cap ? malloc(cap * sizeof *qs) : NULL;
    for (vqp *q = vs->qps; qs && q && nq < cap; q = q->next_all)
        if (q->pend_head || q->post_failed)
            qs[nq++] = q;
    pthread_mutex_unlock(&vs->mu);
    /* Initiator vqp structs are freed only by verbs_free; accepting-side ones
     * (freed with their connection) never have pending chains. */
    vchain *dropped = NULL;
    for (size_t i = 0; i < nq; i++) {
        pthread_mutex_lock(&qs[i]->mu);
        bool failed = qs[i]->post_failed;
        qs[i]->post_failed = false;
        pthread_mutex_unlock(&qs[i]->mu);
        if (failed) {
            qp_failed(e, qs[i], "post_send refused");
            qp_abandon(vs, qs[i]);
        }
        vchain *d = drain_pending(qs[i]);
        while (d) {
            vchain *n = d->next;
            d->next = dropped;
            dropped = d;
            d = n;
        }
    }
    free(qs);
    finish_list(e, dropped);
}

/* q->mu and vs->mu held: every chain of q, posted or still pending, goes to
 * the front of *left for the caller to finish. Posted ones give back their
 * send queue and completion queue room on d, when given (a device that still
 * runs counts them; one being torn down does not matter). */
static void qp_take_chains(vqp *q, vdev *d, vchain **left)
{
    while (q->posted_head) {
        vchain *c = q->posted_head;
        q->posted_head = c->next;
        if (d) {
            q->sq_used -= c->took;
            d->cq_room += (uint32_t)c->took;
        }
        c->next = *left;
        *left = c;
    }
    while (q->pend_head) {
        vchain *c = q->pend_head;
        q->pend_head = c->next;
        c->next = *left;
        *left = c;
    }
    q->posted_tail = q->pend_tail = NULL;
}

/* The device died (IBV_EVENT_DEVICE_FATAL): it will complete nothing ever
 * again, flushes included, and touches no memory any more. Every queue pair
 * on it is failed here, its chains finished without waiting, its endpoints
 * lost. Poller thread. */
static void dev_fatal(verbs_state *vs, int devi)
{
    axf_engine *e = vs->e;
    vdev *d = &vs->dev[devi];
    if (d->dead)
        return;
    d->dead = true;
    cq_log(e, 0, "verbs: device %s failed (IBV_EVENT_DEVICE_FATAL): its endpoints are lost; "
           "restart the process once the device is back", d->name);
    vchain *left = NULL;
    /* Initiator queue pairs (the only ones with chains) live until
     * verbs_free: collected under the lock, handled after. */
    size_t nq = 0, cap = 0;
    pthread_mutex_lock(&vs->mu);
    for (vqp *q = vs->qps; q; q = q->next_all)
        cap += q->devi == devi && q->ep;
    vqp **lost = cap ? calloc(cap, sizeof *lost) : NULL;
    for (vqp *q = vs->qps; lost && q; q = q->next_all)
        if (q->devi == devi && q->ep && nq < cap)
            lost[nq++] = q;
    pthread_mutex_unlock(&vs->mu);
    for (size_t i = 0; i < nq; i++) {
        vqp *q = lost[i];
        pthread_mutex_lock(&q->mu);
        pthread_mutex_lock(&vs->mu);
        q->err = true; /* no modify_qp: the device answers nothing */
        qp_take_chains(q, d, &left);
        pthread_mutex_unlock(&vs->mu);
        pthread_mutex_unlock(&q->mu);
    }
    for (size_t i = 0; i < nq; i++)
        qp_failed(e, lost[i], "device fatal");
    free(lost);
    for (vchain *c = left; c; c = c->next)
        if (!c->failed) {
            c->failed = true;
            op_set_status(c->o, AXF_E_TRANSPORT, c->wi[0].index);
        }
    finish_list(e, left);
}

/* An accepting-side queue pair failed on its own (asynchronous event type):
 * the connection it serves is killed (its end frees the queue pair). Found
 * by gen (its address may be another queue pair's by now) under e->mu, which
 * a connection's list is detached under before its queue pairs are freed,
 * and vs->mu. */
static void serving_failed(verbs_state *vs, uint64_t gen, const char *dev, int type)
{
    axf_engine *e = vs->e;
    uint64_t tag = 0;
    pthread_mutex_lock(&e->mu);
    pthread_mutex_lock(&vs->mu);
    conn *hit = NULL;
    for (conn *c = e->conns; c && !hit; c = c->next_all)
        for (vqp *q = VQP(c); q && !hit; q = q->next_conn)
            if (q->gen == gen)
                hit = c;
    pthread_mutex_unlock(&vs->mu);
    if (hit) {
        tag = hit->tag;
        conn_kill(hit);
    }
    pthread_mutex_unlock(&e->mu);
    cq_log(e, tag, "verbs: a queue pair on %s serving a peer failed (asynchronous event %d)%s",
           dev, type, hit ? ": its connection is closed" : "");
}

/* Asynchronous events of device devi. Poller thread. */
static void handle_async(verbs_state *vs, int devi)
{
    vdev *d = &vs->dev[devi];
    struct ibv_async_event ev;
    while (vs->t.get_async_event(d->ctx, &ev) == 0) {
        enum ibv_event_type type = ev.event_type;
        struct ibv_qp *bad_qp = type == IBV_EVENT_QP_FATAL || type == IBV_EVENT_QP_REQ_ERR ||
                                        type == IBV_EVENT_QP_ACCESS_ERR
                                    ? ev.element.qp
                                    : NULL;
        /* Which of ours it is, found before the ack: until then the queue
         * pair cannot be destroyed (destroy_qp waits for its events' acks),
         * so no other can be at its address. After it, one destroyed
         * meanwhile and a new one made at the same address would be failed
         * in its place. Its gen names it from then on. (Nobody destroys a
         * queue pair with vs->mu held while the poller runs: verbs_stop
         * does so once it has joined the poller.) */
        vqp *hit = NULL;
        uint64_t serving = 0;
        if (bad_qp) {
            pthread_mutex_lock(&vs->mu);
            for (vqp *q = vs->qps; q; q = q->next_all)
                if (q->qp == bad_qp) {
                    hit = q->ep ? q : NULL;
                    serving = q->ep ? 0 : q->gen;
                    break;
                }
            pthread_mutex_unlock(&vs->mu);
        }
        if (vs->t.ack_async_event)
            vs->t.ack_async_event(&ev);
        if (type == IBV_EVENT_DEVICE_FATAL) {
            dev_fatal(vs, devi);
        } else if (bad_qp) {
            /* The queue pair went to the error state on its own: its
             * requests flush; an initiator's endpoint is lost (its vqp lives
             * until verbs_free). An accepting-side one is freed by its
             * connection's thread at any moment: not touched past the scan
             * (the NIC moved it to the error state already). Its connection
             * is killed instead, so that the peer, whose requests through it
             * would only fail once its retries ran out (~30 s), loses the
             * endpoint now. */
            if (serving)
                serving_failed(vs, serving, d->name, (int)type);
            if (hit) {
                pthread_mutex_lock(&hit->mu);
                qp_to_error(hit);
                pthread_mutex_unlock(&hit->mu);
                qp_failed(vs->e, hit, "asynchronous queue pair error");
            }
        } else if (type == IBV_EVENT_PORT_ERR) {
            cq_log(vs->e, 0, "verbs: %s port %u went down: transfers on it fail until it is back",
                   d->name, d->port);
        }
    }
}

static void *poller_main(void *arg)
{
    verbs_state *vs = arg;
    axf_engine *e = vs->e;
    struct epoll_event ev[2 * AXF_VERBS_MAX_DEVICES + 1];
    for (;;) {
        int n = epoll_wait(vs->epfd, ev, 2 * AXF_VERBS_MAX_DEVICES + 1, -1);
        if (n < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            if (ev[i].data.u32 == WAKE_ID) {
                uint64_t v;
                ssize_t r = read(vs->wakefd, &v, sizeof v);
                (void)r;
                continue;
            }
            if (ev[i].data.u32 >= ASYNC_ID) {
                handle_async(vs, (int)(ev[i].data.u32 - ASYNC_ID));
                continue;
            }
            vdev *d = &vs->dev[ev[i].data.u32];
            if (d->dead)
                continue;
            struct ibv_cq *cq;
            void *ctx;
            while (vs->t.get_cq_event(d->ch, &cq, &ctx) == 0)
                vs->t.ack_cq_events(cq, 1);
            /* Re-armed before draining: a completion after the drain then
             * signals the channel again. */
            vs->t.req_notify_cq(d->cq, 0);
            drain_cq(vs, d);
        }
        pthread_mutex_lock(&vs->mu);
        vchain *fail = vs->fail;
        vs->fail = NULL;
        pthread_mutex_unlock(&vs->mu);
        finish_list(e, fail);
        drain_all_pending(vs);
        pthread_mutex_lock(&vs->mu);
        bool stop = vs->stop;
        pthread_cond_broadcast(&vs->cv);
        pthread_mutex_unlock(&vs->mu);
        if (stop)
            break;
    }
    return NULL;
}

static void verbs_ep_dead(axf_engine *e, endpoint *ep)
{
    verbs_state *vs = VS_OF(e);
    if (!vs || !VEP(ep))
        return;
    for (int d = 0; d < AXF_VERBS_MAX_DEVICES; d++) {
        vqp *q = VEP(ep)->rail[d];
        if (!q)
            continue;
        pthread_mutex_lock(&q->mu);
        qp_to_error(q); /* posted requests flush; pending ones fail on the poller */
        qp_retire(q);
        pthread_mutex_unlock(&q->mu);
    }
    wake(vs);
}

/* ------------------------------------------------------------ lifecycle */

static void devs_close(verbs_state *vs)
{
    for (int d = 0; d < vs->ndev; d++) {
        vdev *v = &vs->dev[d];
        if (v->cq)
            vs->t.destroy_cq(v->cq);
        if (v->ch)
            vs->t.destroy_comp_channel(v->ch);
        if (v->pd)
            vs->t.dealloc_pd(v->pd);
        if (v->ctx)
            vs->t.close_device(v->ctx);
    }
    vs->ndev = 0;
}

int axf_verbs_enable(axf_engine *e, const char *provider, char *why, size_t why_len)
{
    char buf[256] = "";
    if (why && why_len)
        why[0] = 0;
    pthread_mutex_lock(&e->mu);
    bool busy = VS_OF(e) != NULL || e->shut;
    pthread_mutex_unlock(&e->mu);
    if (busy)
        return AXF_E_INVALID;
    verbs_state *vs = calloc(1, sizeof *vs);
    if (!vs)
        return AXF_E_NOMEM;
    vs->e = e;
    vs->epfd = vs->wakefd = -1;
    settings_read(&e->env, &vs->set);
    pthread_mutex_init(&vs->mu, NULL);
    pthread_cond_init(&vs->cv, NULL);
    int st = load_table(provider, &vs->t, buf, sizeof buf);
    int n = 0;
    struct ibv_device **list = st == AXF_OK ? device_list(&vs->t, &n) : NULL;
    if (st == AXF_OK && !list) {
        if (n < 0) {
            snprintf(buf, sizeof buf, "%s: cannot list devices: %s", vs->t.provider, strerror(-n));
            st = AXF_E_TRANSPORT;
        } else {
            snprintf(buf, sizeof buf, "%s: no RDMA devices (the kernel has no InfiniBand support)",
                     vs->t.provider);
        }
    }
    char reason[160] = "";
    for (int i = 0; list && i < n && vs->ndev < AXF_VERBS_MAX_DEVICES; i++) {
        vdev *v = &vs->dev[vs->ndev];
        if (!dev_open(&vs->t, list[i], v, &vs->set, reason, sizeof reason))
            continue;
        vs->ndev++;
        v->pd = vs->t.alloc_pd(v->ctx);
        v->ch = v->pd ? vs->t.create_comp_channel(v->ctx) : NULL;
        v->cq = v->ch ? vs->t.create_cq(v->ctx, CQ_ENTRIES, NULL, v->ch, 0) : NULL;
        if (!v->cq || vs->t.req_notify_cq(v->cq, 0)) {
            snprintf(buf, sizeof buf, "%s: cannot set up (PD, CQ): %s", v->name, strerror(errno));
            st = AXF_E_TRANSPORT;
            break;
        }
        v->cq_room = CQ_ENTRIES;
        int fl = fcntl(v->ch->fd, F_GETFL);
        (void)fcntl(v->ch->fd, F_SETFL, fl | O_NONBLOCK);
    }
    if (list)
        vs->t.free_device_list(list);
    if (st == AXF_OK && list && !vs->ndev)
        snprintf(buf, sizeof buf, "%s: %d device%s, none usable (%s)", vs->t.provider, n,
                 n == 1 ? "" : "s", reason);
    if (st == AXF_OK && vs->ndev) {
        vs->epfd = epoll_create1(EPOLL_CLOEXEC);
        vs->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = WAKE_ID};
        if (vs->epfd < 0 || vs->wakefd < 0 || epoll_ctl(vs->epfd, EPOLL_CTL_ADD, vs->wakefd, &ev))
            st = AXF_E_NOMEM;
        for (int d = 0; st == AXF_OK && d < vs->ndev; d++) {
            ev.data.u32 = (uint32_t)d;
            if (epoll_ctl(vs->epfd, EPOLL_CTL_ADD, vs->dev[d].ch->fd, &ev))
                st = AXF_E_NOMEM;
            /* Device-fatal and queue pair errors arrive here, not as
             * completions: without them a dead device hangs every op. */
            int afd = vs->dev[d].ctx->async_fd;
            if (st == AXF_OK && vs->t.get_async_event && afd >= 0) {
                (void)fcntl(afd, F_SETFL, fcntl(afd, F_GETFL) | O_NONBLOCK);
                ev.data.u32 = ASYNC_ID + (uint32_t)d;
                if (epoll_ctl(vs->epfd, EPOLL_CTL_ADD, afd, &ev))
                    st = AXF_E_NOMEM;
            }
        }
        if (st == AXF_OK && pthread_create(&vs->poller, NULL, poller_main, vs) == 0)
            vs->poller_started = true;
        else
            st = AXF_E_NOMEM;
        if (st == AXF_OK)
            snprintf(buf, sizeof buf, "%s: %d device%s", vs->t.provider, vs->ndev,
                     vs->ndev == 1 ? "" : "s");
    }
    int ndev = vs->ndev;
    if (st == AXF_OK && ndev) {
        /* Regions registered before: registered now. */
        pthread_mutex_lock(&e->mu);
        if (e->shut || VS_OF(e)) {
            st = AXF_E_CLOSED;
        } else {
            e->xp[AXF_EP_VERBS] = vs;
            for (size_t b = 0; b < AXF_REGION_BUCKETS && st == AXF_OK; b++)
                for (region *r = e->regions[b]; r && st == AXF_OK; r = r->next) {
                    if (r->kind == AXF_MEM_FILE)
                        continue;
                    char rwhy[400] = "";
                    st = region_register(vs, r, rwhy, sizeof rwhy);
                    if (st != AXF_OK && r->kind == AXF_MEM_CUDA) {
                        cq_log(e, 0, "verbs: GPU region of %llu bytes not registered for "
                               "GPUDirect RDMA (%s); unreachable over verbs",
                               (unsigned long long)r->len, rwhy);
                        st = AXF_OK;
                    } else if (st != AXF_OK) {
                        snprintf(buf, sizeof buf, "%.200s", rwhy);
                    }
                }
            if (st != AXF_OK) {
                /* region_release_all wants vs->mu (mr_put); order e->mu, then
                 * vs->mu, as region_register takes it above */
                pthread_mutex_lock(&vs->mu);
                for (size_t b = 0; b < AXF_REGION_BUCKETS; b++)
                    for (region *r = e->regions[b]; r; r = r->next)
                        region_release_all(vs, r);
                pthread_mutex_unlock(&vs->mu);
                e->xp[AXF_EP_VERBS] = NULL;
            }
        }
        pthread_mutex_unlock(&e->mu);
    }
    if (why && why_len)
        snprintf(why, why_len, "%s", buf);
    if (st == AXF_OK && ndev)
        return ndev;
    if (vs->poller_started) {
        pthread_mutex_lock(&vs->mu);
        vs->stop = true;
        pthread_mutex_unlock(&vs->mu);
        wake(vs);
        pthread_join(vs->poller, NULL);
    }
    devs_close(vs);
    if (vs->epfd >= 0)
        close(vs->epfd);
    if (vs->wakefd >= 0)
        close(vs->wakefd);
    pthread_mutex_destroy(&vs->mu);
    pthread_cond_destroy(&vs->cv);
    free(vs);
    return st == AXF_OK ? 0 : st;
}

int axf_verbs_device_count(axf_engine *e)
{
    return VS_OF(e) ? VS_OF(e)->ndev : 0;
}

static bool all_quiet(verbs_state *vs) /* vs->mu held */
{
    if (vs->fail)
        return false;
    for (vqp *q = vs->qps; q; q = q->next_all)
        if (q->posted_head || q->pend_head)
            return false;
    return true;
}

static void verbs_stop(axf_engine *e)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return;
    pthread_mutex_lock(&e->mu);
    for (endpoint *ep = e->eps; ep; ep = ep->next)
        verbs_ep_dead(e, ep);
    pthread_mutex_unlock(&e->mu);
    /* Every queue pair is in the error state: posted requests flush and
     * their ops finish on the poller. Bounded, should a provider never flush:
     * a destroyed queue pair touches no memory either. */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    pthread_mutex_lock(&vs->mu);
    while (!all_quiet(vs)) {
        if (pthread_cond_timedwait(&vs->cv, &vs->mu, &until) == ETIMEDOUT)
            break;
    }
    bool quiet = all_quiet(vs);
    vs->stop = true;
    pthread_mutex_unlock(&vs->mu);
    wake(vs);
    if (vs->poller_started)
        pthread_join(vs->poller, NULL);
    vs->poller_started = false;
    if (!quiet)
        cq_log(e, 0, "verbs: requests not flushed within 10 s of shutdown; queue pairs destroyed");
    /* Destroy every queue pair; whatever is left fails. */
    vchain *left = NULL;
    pthread_mutex_lock(&vs->mu);
    while (vs->unbound) {
        vqp *q = vs->unbound;
        vs->unbound = q->next_conn;
        pthread_mutex_unlock(&vs->mu);
        qp_free(vs, q);
        pthread_mutex_lock(&vs->mu);
    }
    for (vqp *q = vs->qps; q; q = q->next_all) {
        if (q->qp)
            vs->t.destroy_qp(q->qp);
        q->qp = NULL;
        q->err = true;
        qp_take_chains(q, NULL, &left);
    }
    while (vs->fail) {
        vchain *c = vs->fail;
        vs->fail = c->next;
        c->next = left;
        left = c;
    }
    pthread_mutex_unlock(&vs->mu);
    finish_list(e, left);
}

static void verbs_free(axf_engine *e)
{
    verbs_state *vs = VS_OF(e);
    if (!vs)
        return;
    while (vs->qps) { /* initiator queue pairs, destroyed by verbs_stop */
        vqp *q = vs->qps;
        vs->qps = q->next_all;
        if (q->qp)
            vs->t.destroy_qp(q->qp);
        pthread_mutex_destroy(&q->mu);
        free(q);
    }
    for (size_t b = 0; b < MR_BUCKETS; b++) /* regions still registered: none after shutdown */
        while (vs->mrs[b]) {
            vmr *m = vs->mrs[b];
            vs->mrs[b] = m->next;
            vs->t.dereg_mr(m->mr);
            free(m);
        }
    devs_close(vs);
    close(vs->epfd);
    close(vs->wakefd);
    pthread_mutex_destroy(&vs->mu);
    pthread_cond_destroy(&vs->cv);
    free(vs);
    e->xp[AXF_EP_VERBS] = NULL;
}

static void verbs_ep_free(endpoint *ep)
{
    free(VEP(ep));
    ep->priv = NULL;
}

static void verbs_rr_free(rregion *rr)
{
    free(VRK(rr));
    rr->xp[AXF_EP_VERBS] = NULL;
}

static bool verbs_xp_submit(axf_engine *e, op *o, uint32_t flags)
{
    (void)flags;
    /* Posted to the queue pairs at once: one post per chain is the batch. */
    bool queued = verbs_submit(e, o);
    pthread_mutex_unlock(&e->mu);
    return queued;
}

static int verbs_ep_open(axf_engine *e, endpoint *ep)
{
    (void)ep;
    return VS_OF(e) ? AXF_OK : AXF_E_TRANSPORT; /* axf_verbs_enable first */
}

const axf_transport axf_xp_verbs = {
    .abi = AXF_TRANSPORT_ABI,
    .name = "verbs",
    .ep_kind = AXF_EP_VERBS,
    .caps = AXF_XP_CAP_NEEDS_CONN | AXF_XP_CAP_NOTIFY | AXF_XP_CAP_OWN_DATA,
    .local_mem = AXF_MEM_BIT(AXF_MEM_HOST) | AXF_MEM_BIT(AXF_MEM_CUDA),
    .far_mem = AXF_MEM_BIT(AXF_MEM_HOST) | AXF_MEM_BIT(AXF_MEM_CUDA),
    .stop = verbs_stop,
    .destroy = verbs_free,
    .region_add = verbs_region_add,
    .region_free = verbs_region_free,
    .region_usable = verbs_region_usable,
    .ep_open = verbs_ep_open,
    .ep_lost = verbs_ep_dead,
    .ep_free = verbs_ep_free,
    .rr_free = verbs_rr_free,
    .conn_closed = verbs_conn_closed,
    .submit = verbs_xp_submit,
};

#else /* !AXF_HAVE_VERBS: absent from the registry; the public calls say "not built" */

static const char not_built[] = "not built (-Dverbs=disabled)";


int axf_verbs_probe(const char *provider, char *names, size_t names_len, char *why,
                    size_t why_len)
{
    (void)provider;
    if (names && names_len)
        names[0] = 0;
    snprintf(why, why_len, "%s", not_built);
    return AXF_E_TRANSPORT;
}
int axf_verbs_enable(axf_engine *e, const char *provider, char *why, size_t why_len)
{
    (void)e;
    (void)provider;
    if (why && why_len)
        snprintf(why, why_len, "%s", not_built);
    return AXF_E_TRANSPORT;
}
int axf_verbs_device_count(axf_engine *e) { (void)e; return 0; }
int axf_verbs_region_keys(axf_engine *e, uint64_t rid, uint64_t *addrs, uint32_t *rkeys,
                          size_t max)
{
    (void)e; (void)rid; (void)addrs; (void)rkeys; (void)max;
    return 0;
}
int axf_verbs_region_dmabuf(axf_engine *e, uint64_t rid, int fd, uint64_t offset)
{
    (void)e; (void)rid; (void)fd; (void)offset;
    return AXF_E_TRANSPORT;
}
int axf_verbs_qp_create(axf_engine *e, uint64_t ep, uint32_t dev, axf_verbs_qp_info *out)
{
    (void)e; (void)ep; (void)dev; (void)out;
    return AXF_E_TRANSPORT;
}
int axf_verbs_qp_connect(axf_engine *e, uint64_t ep, uint32_t dev, uint32_t remote_dev,
                         const axf_verbs_qp_info *remote)
{
    (void)e; (void)ep; (void)dev; (void)remote_dev; (void)remote;
    return AXF_E_TRANSPORT;
}
int axf_verbs_accept_qp(axf_engine *e, uint32_t dev, const axf_verbs_qp_info *remote,
                        axf_verbs_qp_info *out, uint64_t *qp_out)
{
    (void)e; (void)dev; (void)remote; (void)out; (void)qp_out;
    return AXF_E_TRANSPORT;
}
int axf_verbs_qp_destroy(axf_engine *e, uint64_t qp) { (void)e; (void)qp; return AXF_E_TRANSPORT; }
int axf_verbs_accept_conn(axf_engine *e, int fd, uint64_t tag, const uint64_t *qps, size_t n)
{
    (void)e; (void)tag; (void)qps; (void)n;
    close(fd);
    return AXF_E_TRANSPORT;
}
int axf_endpoint_import_verbs(axf_engine *e, uint64_t ep, uint64_t rid, const uint64_t *addrs,
                              const uint32_t *rkeys, size_t n)
{
    (void)e; (void)ep; (void)rid; (void)addrs; (void)rkeys; (void)n;
    return AXF_E_TRANSPORT;
}

#endif

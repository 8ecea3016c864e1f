/* Fills the verbs table: from libibverbs.so.1 loaded at run time (so one build
 * runs where rdma-core is absent), or from a software provider library.
 *
 * Never linked against libibverbs, and built without its header: the ABI is
 * declared in verbs_abi.h, with the static-inline verbs (post_send, poll_cq,
 * req_notify_cq), which dispatch through ctx->ops and are wrapped here as
 * plain functions. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "verbs_table.h"

#include <dlfcn.h>
#include <stddef.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

static int w_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    return ibv_post_send(qp, wr, bad);
}

static int w_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    return ibv_post_recv(qp, wr, bad);
}

static int w_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    return ibv_poll_cq(cq, n, wc);
}

static int w_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    return ibv_req_notify_cq(cq, solicited_only);
}

/* ibv_query_gid_ex (rdma-core >= 32) is an inline over _ibv_query_gid_ex. */
static int (*p_query_gid_ex)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *,
                             uint32_t, size_t);

static int w_query_gid_type(struct ibv_context *ctx, uint8_t port, int index, int *type)
{
    struct ibv_gid_entry ent;
    memset(&ent, 0, sizeof ent);
    int r = p_query_gid_ex ? p_query_gid_ex(ctx, port, (uint32_t)index, &ent, 0, sizeof ent)
                           : ENOSYS;
    if (r == 0)
        *type = (int)ent.gid_type;
    return r;
}

static void say(char *why, size_t n, const char *fmt, const char *a, const char *b)
{
    if (why && n)
        snprintf(why, n, fmt, a, b ? b : "");
}

#define STR_(x) #x
#define STR(x) STR_(x)
#define VERSION_TEXT STR(AXF_VERBS_TABLE_VERSION)

/* Every entry verbs.c calls without looking first: a provider that leaves
 * one NULL is refused at load, naming it, rather than crashing the process
 * at the first close, deregistration or queue pair teardown. The optional
 * ones (reg_dmabuf_mr, query_gid_type, post_recv) are looked at before each
 * call; the asynchronous-event pair is optional as a pair only (events
 * taken and never acknowledged would hold destroy_qp forever). */
#define ENTRY(f) {#f, offsetof(axf_verbs_table, f)}
static const struct {
    const char *name;
    size_t off;
} required[] = {
    ENTRY(get_device_list), ENTRY(free_device_list), ENTRY(get_device_name),
    ENTRY(open_device),     ENTRY(close_device),     ENTRY(query_device),
    ENTRY(query_port),      ENTRY(query_gid),        ENTRY(alloc_pd),
    ENTRY(dealloc_pd),      ENTRY(reg_mr),           ENTRY(dereg_mr),
    ENTRY(create_comp_channel), ENTRY(destroy_comp_channel), ENTRY(create_cq),
    ENTRY(destroy_cq),      ENTRY(req_notify_cq),    ENTRY(get_cq_event),
    ENTRY(ack_cq_events),   ENTRY(poll_cq),          ENTRY(create_qp),
    ENTRY(modify_qp),       ENTRY(destroy_qp),       ENTRY(post_send),
};
#undef ENTRY

const char *axf_verbs_table_missing(const axf_verbs_table *t)
{
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        void (*f)(void);
        memcpy(&f, (const char *)t + required[i].off, sizeof f);
        if (!f)
            return required[i].name;
    }
    if (!t->get_async_event != !t->ack_async_event)
        return t->get_async_event ? "ack_async_event (get_async_event is given)"
                                  : "get_async_event (ack_async_event is given)";
    return NULL;
}

/* dlsym into a function pointer without a cast warning. */
#define SYM(field, name, required)                                       \
    do {                                                                 \
        void *p_ = dlsym(h, name);                                       \
        if (!p_ && (required)) {                                         \
            say(why, why_len, "libibverbs.so.1 has no %s%s", name, NULL); \
            return -ENOSYS;                                              \
        }                                                                \
        memcpy(&t->field, &p_, sizeof p_);                               \
    } while (0)

static int load_libibverbs(axf_verbs_table *t, char *why, size_t why_len)
{
    /* Kept loaded for the life of the process: its providers register global
     * state that does not survive an unload. */
    void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *err = dlerror();
        say(why, why_len, "cannot load libibverbs.so.1 (rdma-core not installed?): %s%s",
            err ? err : "unknown error", NULL);
        return -ENOENT;
    }
    memset(t, 0, sizeof *t);
    t->version = AXF_VERBS_TABLE_VERSION;
    t->provider = "libibverbs";
    SYM(get_device_list, "ibv_get_device_list", 1);
    SYM(free_device_list, "ibv_free_device_list", 1);
    SYM(get_device_name, "ibv_get_device_name", 1);
    SYM(open_device, "ibv_open_device", 1);
    SYM(close_device, "ibv_close_device", 1);
    SYM(query_device, "ibv_query_device", 1);
    SYM(query_port, "ibv_query_port", 1); /* the real symbol behind the macro */
    SYM(query_gid, "ibv_query_gid", 1);
    SYM(alloc_pd, "ibv_alloc_pd", 1);
    SYM(dealloc_pd, "ibv_dealloc_pd", 1);
    SYM(reg_mr, "ibv_reg_mr", 1); /* ditto */
    SYM(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", 0); /* rdma-core >= 34 */
    SYM(dereg_mr, "ibv_dereg_mr", 1);
    SYM(create_comp_channel, "ibv_create_comp_channel", 1);
    SYM(destroy_comp_channel, "ibv_destroy_comp_channel", 1);
    SYM(create_cq, "ibv_create_cq", 1);
    SYM(destroy_cq, "ibv_destroy_cq", 1);
    SYM(get_cq_event, "ibv_get_cq_event", 1);
    SYM(ack_cq_events, "ibv_ack_cq_events", 1);
    SYM(create_qp, "ibv_create_qp", 1);
    SYM(modify_qp, "ibv_modify_qp", 1);
    SYM(destroy_qp, "ibv_destroy_qp", 1);
    SYM(get_async_event, "ibv_get_async_event", 0);
    SYM(ack_async_event, "ibv_ack_async_event", 0);
    void *gx = dlsym(h, "_ibv_query_gid_ex");
    memcpy(&p_query_gid_ex, &gx, sizeof gx);
    if (p_query_gid_ex)
        t->query_gid_type = w_query_gid_type; /* else verbs.c reads sysfs */
    /* Registered memory and fork(): with a kernel and rdma-core that cannot
     * keep a child from taking the registered pages (copy-on-write breaks the
     * DMA mapping), fork support must be turned on before any registration.
     * Newer stacks answer "unneeded" (kernel >= 5.13 with rdma-core >= 35). */
    int (*is_fork)(void) = NULL, (*fork_init)(void) = NULL;
    void *fi = dlsym(h, "ibv_is_fork_initialized"), *fn = dlsym(h, "ibv_fork_init");
    memcpy(&is_fork, &fi, sizeof fi);
    memcpy(&fork_init, &fn, sizeof fn);
    if (fork_init && (!is_fork || is_fork() == IBV_FORK_DISABLED))
        (void)fork_init(); /* refused once a device is open: then nothing changes */
    t->post_send = w_post_send;
    t->post_recv = w_post_recv;
    t->poll_cq = w_poll_cq;
    t->req_notify_cq = w_req_notify_cq;
    const char *missing = axf_verbs_table_missing(t);
    if (missing) { /* only the async pair can be: the rest were required above */
        say(why, why_len, "libibverbs.so.1: %s missing%s", missing, NULL);
        return -ENOSYS;
    }
    return 0;
}

static int load_provider(const char *path, axf_verbs_table *t, char *why, size_t why_len)
{
    /* Kept loaded: the table points into it for the life of the process. */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *err = dlerror();
        say(why, why_len, "cannot load verbs provider: %s%s", err ? err : path, NULL);
        return -ENOENT;
    }
    void *sym = dlsym(h, AXF_VERBS_PROVIDER_SYMBOL);
    if (!sym) {
        say(why, why_len, "%s exports no " AXF_VERBS_PROVIDER_SYMBOL "%s", path, NULL);
        return -ENOSYS;
    }
    axf_verbs_provider_fn fill;
    memcpy(&fill, &sym, sizeof sym);
    memset(t, 0, sizeof *t);
    int r = fill(t);
    if (r) {
        say(why, why_len, "verbs provider %s failed: %s", path, strerror(r < 0 ? -r : r));
        return r < 0 ? r : -r;
    }
    if (t->version != AXF_VERBS_TABLE_VERSION) {
        char v[16];
        snprintf(v, sizeof v, "%u", (unsigned)t->version);
        say(why, why_len, "verbs provider %s: table version %s, not " VERSION_TEXT, path, v);
        return -ENOSYS;
    }
    const char *missing = axf_verbs_table_missing(t);
    if (missing) {
        say(why, why_len, "verbs provider %s: table entry %s missing", path, missing);
        return -ENOSYS;
    }
    if (!t->provider)
        t->provider = "software";
    return 0;
}

int axf_verbs_load(const char *path, axf_verbs_table *table, char *why, size_t why_len)
{
    if (why && why_len)
        why[0] = 0;
    return path && *path ? load_provider(path, table, why, why_len)
                         : load_libibverbs(table, why, why_len);
}

/* The RDMA verbs transport between two engines in one process, through the
 * software verbs provider (native/tests/softverbs/, path in
 * AXF_SOFTVERBS_PROVIDER; meson sets it): queue pairs per device rail, WRITE
 * and READ with the data checked, chains longer than the send queue,
 * notifications after data, access checks, remote access errors, peer loss,
 * cancellation, shutdown with requests in flight, the registration cache;
 * races the provider's hooks hold open (QP asynchronous errors, partial posts,
 * dmabuf registration while posting; run under TSan and ASan too).
 * Also: the real libibverbs on a machine without RDMA devices is "no devices". */
#include "harness.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define A_TAG 41
#define B_TAG 42
#define REG (4u << 20)
#define RW (AXF_ACCESS_READ | AXF_ACCESS_WRITE)

static const char *provider;

typedef struct vpair {
    tengine *a, *b;
    uint64_t ep;
    int ndev;
    uint8_t *asrc, *bdst;
    uint64_t arid, akey, brid, bkey;
} vpair;

static int import_verbs(vpair *p, uint64_t rid, uint64_t key, uint64_t len, uint32_t access)
{
    return t_verbs_import(p->a->e, p->b->e, p->ep, p->ndev, rid, key, len, access);
}

static int vpair_open(vpair *p, const axf_config *cfg)
{
    memset(p, 0, sizeof *p);
    p->a = t_engine(cfg);
    p->b = t_engine(cfg);
    CHECK(p->a && p->b);
    p->ndev = t_verbs_connect(p->a->e, p->b->e, provider, A_TAG, B_TAG, &p->ep);
    CHECK(p->ndev > 0);
    p->asrc = calloc(1, REG);
    p->bdst = calloc(1, REG);
    CHECK(p->asrc && p->bdst);
    CHECK_EQ(axf_region_register(p->a->e, p->asrc, REG, RW, -1, &p->arid, &p->akey), AXF_OK);
    CHECK_EQ(axf_region_register(p->b->e, p->bdst, REG, RW, -1, &p->brid, &p->bkey), AXF_OK);
    return import_verbs(p, p->brid, p->bkey, REG, RW);
}

static void vpair_close(vpair *p)
{
    t_close(p->a); /* engines first: they may still touch the buffers */
    t_close(p->b);
    free(p->asrc);
    free(p->bdst);
}

static int test_no_devices_is_not_an_error(void)
{
    /* The real libibverbs: on a kernel without InfiniBand (CI, this machine)
     * that is "no devices"; where devices exist they are listed. */
    char names[1024], why[256];
    int n = axf_verbs_probe(NULL, names, sizeof names, why, sizeof why);
    printf("    libibverbs: %d (%s)\n", n, why);
    if (n == AXF_E_TRANSPORT && strstr(why, "cannot load"))
        return 0; /* rdma-core not installed: also not an error of ours */
    CHECK(n >= 0);
    if (n == 0)
        CHECK(strstr(why, "no RDMA devices") != NULL);
    tengine *t = t_engine(NULL);
    CHECK(t);
    CHECK_EQ(axf_verbs_enable(t->e, NULL, why, sizeof why), n);
    uint64_t ep;
    if (n == 0) /* verbs stays off */
        CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_VERBS, 1, 0, -1, &ep), AXF_E_TRANSPORT);
    t_close(t);
    return 0;
}

static int test_probe_provider(void)
{
    char names[1024], why[256];
    int n = axf_verbs_probe(provider, names, sizeof names, why, sizeof why);
    printf("    provider: %d (%s)\n%s\n", n, why, names);
    CHECK(n > 0);
    CHECK(strchr(names, '(') != NULL);
    return 0;
}

/* Rule: a provider whose table leaves out an entry the transport calls is
 * refused at load, with the entry named, both by probe and by enable; the
 * process does not crash (close_device missing used to be called by probe;
 * dereg_mr, destroy_qp and the others at the first teardown). Each case in
 * a child: a crash there is a failure here, not the end of the suite. The
 * provider is loaded through a link of its own, so the table the other
 * cases loaded (verbs.c keeps one per path) is not the one asked for. */
static int test_provider_missing_entries(void)
{
    static const char *const names[] = {
        "get_device_list", "free_device_list", "get_device_name", "open_device",
        "close_device", "query_device", "query_port", "query_gid", "alloc_pd", "dealloc_pd",
        "reg_mr", "dereg_mr", "create_comp_channel", "destroy_comp_channel", "create_cq",
        "destroy_cq", "req_notify_cq", "get_cq_event", "ack_cq_events", "poll_cq", "create_qp",
        "modify_qp", "destroy_qp", "post_send", "ack_async_event", "get_async_event",
    };
    void *lib = dlopen(provider, RTLD_NOW); /* the library the engines load too */
    CHECK(lib);
    void (*omit)(const char *);
    void *sym = dlsym(lib, "axf_softverbs_omit");
    CHECK(sym);
    memcpy(&omit, &sym, sizeof sym);
    char dir[] = "/tmp/axf-omit-XXXXXX", link[64];
    CHECK(mkdtemp(dir));
    snprintf(link, sizeof link, "%s/provider.so", dir);
    CHECK_EQ(symlink(provider, link), 0);
    int bad = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            omit(names[i]);
            char why[256];
            int n = axf_verbs_probe(link, NULL, 0, why, sizeof why);
            if (n != AXF_E_TRANSPORT || !strstr(why, names[i]) || !strstr(why, "missing")) {
                printf("    probe without %s: %d (%s)\n", names[i], n, why);
                _exit(1);
            }
            tengine *t = t_engine(NULL);
            if (!t)
                _exit(2);
            n = axf_verbs_enable(t->e, link, why, sizeof why);
            if (n != AXF_E_TRANSPORT || !strstr(why, names[i])) {
                printf("    enable without %s: %d (%s)\n", names[i], n, why);
                _exit(3);
            }
            t_close(t);
            _exit(0);
        }
        CHECK(pid > 0);
        int st = 0;
        CHECK_EQ(waitpid(pid, &st, 0), pid);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("    without %s: %s %d\n", names[i], WIFSIGNALED(st) ? "signal" : "exit",
                   WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            bad++;
        }
    }
    /* Optional ones left out: still loads, and lists its devices. */
    omit("reg_dmabuf_mr,query_gid_type,post_recv,get_async_event,ack_async_event");
    char names_buf[1024], why[256];
    int n = axf_verbs_probe(link, names_buf, sizeof names_buf, why, sizeof why);
    omit(NULL);
    unlink(link);
    rmdir(dir);
    dlclose(lib);
    CHECK_EQ(bad, 0);
    CHECK(n > 0);
    return 0;
}

/* Scattered descriptors; one larger than the chunk size, so it is striped. */
static const struct { uint64_t loff, roff, len; } SCATTER[] = {
    {0, 4096, 100}, /* inline */
    {8192, 65536, 16384},
    {300000, 1000000, 2000000}, /* striped over the rails in 256 KiB chunks */
    {3000000, 3900000, 1},
    {40000, 0, 4096}, /* local ranges never overlap: READs land in them at once */
};
#define NSCATTER (sizeof SCATTER / sizeof SCATTER[0])

static int test_write_read(void)
{
    axf_config cfg = {.chunk_bytes = 256 << 10};
    vpair p;
    if (vpair_open(&p, &cfg))
        return 1;
    t_fill(p.asrc, REG, 1);
    axf_desc d[NSCATTER];
    uint64_t total = 0;
    for (size_t i = 0; i < NSCATTER; i++) {
        d[i] = (axf_desc){.lrid = p.arid, .loff = SCATTER[i].loff, .rrid = p.brid,
                          .rkey = p.bkey, .roff = SCATTER[i].roff, .len = SCATTER[i].len};
        total += SCATTER[i].len;
    }
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, NSCATTER, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, total);
    uint8_t *expect = calloc(1, REG);
    CHECK(expect);
    for (size_t i = 0; i < NSCATTER; i++)
        memcpy(expect + SCATTER[i].roff, p.asrc + SCATTER[i].loff, SCATTER[i].len);
    CHECK(memcmp(expect, p.bdst, REG) == 0);
    /* READ it back into zeroed memory, at the same local offsets. */
    memset(p.asrc, 0, REG);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_READ, d, NSCATTER, NULL, 0, 2, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, total);
    for (size_t i = 0; i < NSCATTER; i++)
        CHECK(memcmp(p.asrc + SCATTER[i].loff, expect + SCATTER[i].roff, SCATTER[i].len) == 0);
    free(expect);
    axf_stats s;
    axf_engine_stats(p.a->e, &s);
    CHECK_EQ(s.ops, 0);
    CHECK_EQ(s.ops_completed, 2);
    vpair_close(&p);
    return 0;
}

/* More work requests than a send queue holds: chains wait and are posted by
 * the poller as completions free room. Several ops in flight at once. */
static int test_many_small(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    t_fill(p.asrc, REG, 2);
    enum { N = 2048, SZ = 1024, OPS = 4 };
    axf_desc *d = calloc(N, sizeof *d);
    CHECK(d);
    for (int k = 0; k < OPS; k++) {
        for (size_t i = 0; i < N / OPS; i++) {
            size_t j = (size_t)k * (N / OPS) + i;
            /* reversed order on the target: every descriptor lands elsewhere */
            d[i] = (axf_desc){.lrid = p.arid, .loff = j * SZ, .rrid = p.brid, .rkey = p.bkey,
                              .roff = (N - 1 - j) * SZ, .len = SZ};
        }
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, N / OPS, NULL, 0, 10 + (uint64_t)k,
                          AXF_POST_DEFER),
                 AXF_OK);
    }
    axf_doorbell(p.a->e);
    for (int k = 0; k < OPS; k++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 10 + (uint64_t)k, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK_EQ(c.nbytes, (uint64_t)(N / OPS) * SZ);
    }
    for (size_t j = 0; j < N; j++)
        CHECK(memcmp(p.bdst + (N - 1 - j) * SZ, p.asrc + j * SZ, SZ) == 0);
    free(d);
    vpair_close(&p);
    return 0;
}

/* The notification arrives after every RDMA write of its op completed: the
 * target finds the data in memory when it sees the notification. */
static int test_notify_after_data(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    t_fill(p.asrc, REG, 3);
    for (uint64_t k = 0; k < 8; k++) {
        uint64_t off = k * (REG / 8);
        axf_desc d = {.lrid = p.arid, .loff = off, .rrid = p.brid, .rkey = p.bkey, .roff = off,
                      .len = REG / 8};
        char note[16];
        int nl = snprintf(note, sizeof note, "n%llu", (unsigned long long)k);
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, note, (size_t)nl, 100 + k, 0),
                 AXF_OK);
    }
    for (uint64_t k = 0; k < 8; k++) {
        axf_completion n;
        CHECK_EQ(t_wait_any(p.b, AXF_CQ_NOTIFY, &n), 0);
        CHECK_EQ(n.tag, B_TAG);
        CHECK(n.payload_len >= 2 && n.payload[0] == 'n');
        uint64_t j = (uint64_t)(n.payload[1] - '0');
        CHECK(j < 8);
        CHECK(memcmp(p.bdst + j * (REG / 8), p.asrc + j * (REG / 8), REG / 8) == 0);
        axf_completion_free(&n);
    }
    for (uint64_t k = 0; k < 8; k++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 100 + k, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    vpair_close(&p);
    return 0;
}

/* Keys and bounds are checked in native code before anything is posted; a
 * read-only region is refused as a WRITE target. */
static int test_access_checked_at_post(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    axf_desc d = {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey ^ 1, .roff = 0,
                  .len = 4096};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_ACCESS);
    d.rkey = p.bkey;
    d.roff = REG - 100;
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_E_ACCESS);
    uint8_t *ro = calloc(1, 8192);
    CHECK(ro);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register(p.b->e, ro, 8192, AXF_ACCESS_READ, -1, &rid, &key), AXF_OK);
    if (import_verbs(&p, rid, key, 8192, AXF_ACCESS_READ))
        return 1;
    d = (axf_desc){.lrid = p.arid, .rrid = rid, .rkey = key, .len = 8192};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 3, 0), AXF_E_ACCESS);
    memset(ro, 7, 8192);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_READ, &d, 1, NULL, 0, 4, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 4, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(t_all(p.asrc, 8192, 7));
    vpair_close(&p);
    free(ro);
    return 0;
}

/* An rkey the target never issued (a broken or hostile peer's metadata):
 * the device refuses it, the op fails with AXF_E_ACCESS, and since the queue
 * pair is then in the error state the endpoint is lost, promptly. */
static int test_remote_access_error(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    uint64_t addrs[AXF_VERBS_MAX_DEVICES];
    uint32_t rkeys[AXF_VERBS_MAX_DEVICES];
    int n = axf_verbs_region_keys(p.b->e, p.brid, addrs, rkeys, AXF_VERBS_MAX_DEVICES);
    for (int i = 0; i < n; i++)
        rkeys[i] ^= 0x5a5a00;
    CHECK_EQ(axf_endpoint_import_verbs(p.a->e, p.ep, p.brid, addrs, rkeys, (size_t)n), AXF_OK);
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = 4096};
    memset(p.asrc, 9, 4096);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 5, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 5, &c), 0);
    CHECK_EQ(c.status, AXF_E_ACCESS);
    CHECK_EQ(t_wait(p.a, AXF_CQ_PEER_LOST, p.ep, &c), 0);
    CHECK(t_all(p.bdst, REG, 0));
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 6, 0), AXF_E_PEER_LOST);
    vpair_close(&p);
    return 0;
}

/* The target engine goes away with requests in flight: they fail with
 * AXF_E_PEER_LOST (flushed), the endpoint is reported lost, nothing hangs. */
static int test_peer_lost(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    for (uint64_t k = 0; k < 8; k++)
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, "x", 1, 200 + k, 0), AXF_OK);
    t_close(p.b); /* its connection closes, its queue pairs are destroyed */
    p.b = NULL;
    int ok = 0, lost = 0;
    for (uint64_t k = 0; k < 8; k++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 200 + k, &c), 0);
        CHECK(c.status == AXF_OK || c.status == AXF_E_PEER_LOST);
        ok += c.status == AXF_OK;
        lost += c.status == AXF_E_PEER_LOST;
    }
    CHECK(lost > 0);
    fprintf(stderr, "peer closed under 8 writes: %d done, %d lost\n", ok, lost);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_PEER_LOST, p.ep, &c), 0);
    CHECK_EQ(c.status, AXF_E_PEER_LOST);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 300, 0), AXF_E_PEER_LOST);
    t_close(p.a);
    free(p.asrc);
    free(p.bdst);
    return 0;
}

/* Cancel: what was not posted is dropped, what was posted finishes first;
 * the completion says AXF_E_CANCELLED and the endpoint stays usable. */
static int test_cancel(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    enum { N = 4096 };
    axf_desc *d = calloc(N, sizeof *d);
    CHECK(d);
    for (size_t i = 0; i < N; i++)
        d[i] = (axf_desc){.lrid = p.arid, .loff = i * 1024, .rrid = p.brid, .rkey = p.bkey,
                          .roff = i * 1024, .len = 1024};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, N, NULL, 0, 7, 0), AXF_OK);
    CHECK_EQ(axf_cancel(p.a->e, 7), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 7, &c), 0);
    CHECK_EQ(c.status, AXF_E_CANCELLED);
    t_fill(p.asrc, REG, 4);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, N, NULL, 0, 8, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 8, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.asrc, p.bdst, REG) == 0);
    free(d);
    vpair_close(&p);
    return 0;
}

/* Shutdown with requests in flight: they fail with AXF_E_CLOSED after their
 * requests flushed; nothing leaks (ASan build). */
static int test_shutdown_in_flight(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    for (uint64_t k = 0; k < 8; k++)
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 400 + k, 0), AXF_OK);
    axf_engine_shutdown(p.a->e);
    for (uint64_t k = 0; k < 8; k++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 400 + k, &c), 0);
        CHECK(c.status == AXF_OK || c.status == AXF_E_CLOSED);
    }
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_REGION_FREED, p.arid, &c), 0);
    vpair_close(&p);
    return 0;
}

/* The same range registered twice shares its registrations (same rkeys);
 * they stay until the last of the regions is freed. */
static int test_registration_cache(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    uint64_t rid2, key2, a1[8], a2[8];
    uint32_t k1[8], k2[8];
    CHECK_EQ(axf_region_register(p.b->e, p.bdst, REG, RW, -1, &rid2, &key2), AXF_OK);
    CHECK_EQ(axf_verbs_region_keys(p.b->e, p.brid, a1, k1, 8), p.ndev);
    CHECK_EQ(axf_verbs_region_keys(p.b->e, rid2, a2, k2, 8), p.ndev);
    for (int i = 0; i < p.ndev; i++) {
        CHECK_EQ(k1[i], k2[i]);
        CHECK_EQ(a1[i], (uint64_t)(uintptr_t)p.bdst);
    }
    /* Another access is another registration. */
    uint64_t rid3, key3;
    CHECK_EQ(axf_region_register(p.b->e, p.bdst, REG, AXF_ACCESS_READ, -1, &rid3, &key3), AXF_OK);
    CHECK_EQ(axf_verbs_region_keys(p.b->e, rid3, a2, k2, 8), p.ndev);
    CHECK(k2[0] != k1[0]);
    /* The first region goes; writes through the second still land. */
    CHECK_EQ(axf_region_deregister(p.b->e, p.brid), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.b, AXF_CQ_REGION_FREED, p.brid, &c), 0); /* the peer acknowledged */
    if (import_verbs(&p, rid2, key2, REG, RW))
        return 1;
    t_fill(p.asrc, 65536, 5);
    axf_desc d = {.lrid = p.arid, .rrid = rid2, .rkey = key2, .len = 65536};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 9, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 9, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.asrc, p.bdst, 65536) == 0);
    /* The stale handle to the first is refused in native code. */
    d.rrid = p.brid;
    d.rkey = p.bkey;
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 10, 0), AXF_E_ACCESS);
    vpair_close(&p);
    return 0;
}

/* Deregistration on the target waits for the initiator's in-flight writes:
 * the region is freed only after they are over. */
static int test_deregister_waits(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    t_fill(p.asrc, REG, 6);
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    for (uint64_t k = 0; k < 4; k++)
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 500 + k, 0), AXF_OK);
    CHECK_EQ(axf_region_deregister(p.b->e, p.brid), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.b, AXF_CQ_REGION_FREED, p.brid, &c), 0);
    /* Had the registration gone with writes in flight, they would have
     * failed with a remote access error: they all completed. */
    for (uint64_t k = 0; k < 4; k++) {
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 500 + k, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    vpair_close(&p);
    return 0;
}

/* Regions registered before verbs was enabled are registered by the enable;
 * a second enable is refused. */
static int test_enable_after_register(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    uint8_t *buf = calloc(1, 65536);
    CHECK(buf);
    uint64_t rid, key, addrs[8];
    uint32_t rkeys[8];
    CHECK_EQ(axf_region_register(t->e, buf, 65536, RW, -1, &rid, &key), AXF_OK);
    CHECK_EQ(axf_verbs_region_keys(t->e, rid, addrs, rkeys, 8), 0); /* off: none */
    char why[256];
    int n = axf_verbs_enable(t->e, provider, why, sizeof why);
    CHECK(n > 0);
    CHECK_EQ(axf_verbs_enable(t->e, provider, why, sizeof why), AXF_E_INVALID);
    CHECK_EQ(axf_verbs_region_keys(t->e, rid, addrs, rkeys, 8), n);
    for (int i = 0; i < n; i++)
        CHECK_EQ(addrs[i], (uint64_t)(uintptr_t)buf);
    CHECK_EQ(axf_verbs_region_keys(t->e, rid + 100, addrs, rkeys, 8), AXF_E_NOTFOUND);
    t_close(t);
    free(buf);
    return 0;
}

/* GPU memory the provider cannot register (a software provider copies with
 * the CPU): the region registers, the slow path is logged loudly, verbs
 * refuses to move it (no host staging), and the dmabuf hook is refused for a
 * host region. The device pointer is never touched. */
static int test_gpu_region_unreachable(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    uint64_t rid, key, addrs[8];
    uint32_t rkeys[8];
    CHECK_EQ(axf_region_register_kind(p.a->e, AXF_MEM_CUDA, 0x7f0000000000ull, 1 << 20, RW, -1,
                                      &rid, &key),
             AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait_any(p.a, AXF_CQ_LOG, &c), 0);
    CHECK(c.payload_len && strstr((const char *)c.payload, "GPU region") != NULL);
    axf_completion_free(&c);
    CHECK_EQ(axf_verbs_region_keys(p.a->e, rid, addrs, rkeys, 8), p.ndev);
    CHECK_EQ(addrs[0], 0);
    axf_desc d = {.lrid = rid, .rrid = p.brid, .rkey = p.bkey, .len = 4096};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_E_INVALID);
    CHECK_EQ(axf_verbs_region_dmabuf(p.a->e, p.arid, 0, 0), AXF_E_INVALID);
    vpair_close(&p);
    return 0;
}


/* ------------------------------------------------------------ hardware rules */

/* Rules 1 and 3: GPU memory (the software CUDA driver's: not CPU-readable)
 * at a 512-byte offset in its allocation, as a caching allocator hands out
 * tensors. It must register through a dmabuf of the pages around it (the
 * driver exports page-aligned ranges only), and a small WRITE from it must
 * not be posted inline (the CPU would read device memory: SIGSEGV). */
static int test_gpu_dmabuf_small_write(void)
{
    char why[256];
    int ndev = 0;
    if (axf_cuda_probe(why, sizeof why, &ndev) != AXF_OK) {
        printf("    (no CUDA driver: %s)\n", why);
        return 0;
    }
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    enum { ALLOC = 1 << 20, OFF = 512, LEN = 8192 };
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, ALLOC, &g), AXF_OK);
    uint8_t *host = malloc(LEN), *back = calloc(1, LEN);
    CHECK(host && back);
    t_fill(host, LEN, 77);
    CHECK_EQ(axf_cuda_copy(g + OFF, (uint64_t)(uintptr_t)host, LEN), AXF_OK);
    uint64_t grid, gkey, addrs[AXF_VERBS_MAX_DEVICES];
    uint32_t rkeys[AXF_VERBS_MAX_DEVICES];
    CHECK_EQ(axf_region_register_kind(p.a->e, AXF_MEM_CUDA, g + OFF, LEN, RW, -1, &grid, &gkey),
             AXF_OK);
    CHECK_EQ(axf_verbs_region_keys(p.a->e, grid, addrs, rkeys, AXF_VERBS_MAX_DEVICES), p.ndev);
    CHECK_EQ(addrs[0], g + OFF); /* registered (through the dmabuf) at the tensor's address */
    /* 100 bytes (a tail piece): below the inline limit, from GPU memory */
    axf_desc d = {.lrid = grid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = 0, .len = 100};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst, host, 100) == 0);
    /* the whole tensor both ways */
    d.len = LEN;
    d.roff = 65536;
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst + 65536, host, LEN) == 0);
    memset(p.bdst + 65536, 0x5c, LEN);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_READ, &d, 1, NULL, 0, 3, 0), AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 3, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(axf_cuda_copy((uint64_t)(uintptr_t)back, g + OFF, LEN), AXF_OK);
    CHECK(t_all(back, LEN, 0x5c));
    CHECK_EQ(axf_region_deregister(p.a->e, grid), AXF_OK);
    vpair_close(&p);
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    free(host);
    free(back);
    return 0;
}

/* Rule: READ depth is negotiated. The provider's devices take 4 READs in
 * flight as responders but issue 16 (AXF_SOFTVERBS_RD_ATOM=4,16, set in
 * main): a requester that keeps its own 16 overruns the peer. */
static int test_read_depth(void)
{
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    enum { N = 64, SZ = 4096 };
    axf_desc d[N];
    t_fill(p.bdst, N * SZ, 12);
    for (int i = 0; i < N; i++)
        d[i] = (axf_desc){.lrid = p.arid, .loff = (uint64_t)i * SZ, .rrid = p.brid,
                          .rkey = p.bkey, .roff = (uint64_t)i * SZ, .len = SZ};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_READ, d, N, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.asrc, p.bdst, N * SZ) == 0);
    vpair_close(&p);
    return 0;
}

/* Rule: a post_send refused part way: the requests it took that completed
 * before the queue pair failed produce no completion (unsignalled), so the
 * op must not wait for one per request. It fails, promptly, and the endpoint
 * is lost. */
static int test_partial_post(void)
{
    void *lib = dlopen(provider, RTLD_NOW); /* the library the engines load too */
    void (*fail_next)(int) = NULL;
    if (lib)
        *(void **)&fail_next = dlsym(lib, "axf_softverbs_fail_next_post");
    CHECK(fail_next);
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    enum { N = 8 };
    axf_desc d[N];
    for (int i = 0; i < N; i++)
        d[i] = (axf_desc){.lrid = p.arid, .loff = (uint64_t)i * 4096, .rrid = p.brid,
                          .rkey = p.bkey, .roff = (uint64_t)i * 4096, .len = 4096};
    fail_next(3);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, N, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 1, &c), 0);
    CHECK(c.status != AXF_OK);
    CHECK_EQ(t_wait(p.a, AXF_CQ_PEER_LOST, p.ep, &c), 0);
    dlclose(lib);
    vpair_close(&p);
    return 0;
}

/* Rule: what a peer says about its region's verbs keys is checked before any
 * request is built from it: a remote address whose range would wrap past the
 * top of the address space, no keys, more devices than there can be; and
 * queue pair parameters out of range (a 24-bit QP number or PSN, an MTU
 * enum outside 256..4096) are refused at connect. */
static int test_peer_values_checked(void)
{
    vpair p;
    CHECK_EQ(vpair_open(&p, NULL), 0);
    enum { RID = 777, LEN = 8192 };
    CHECK_EQ(axf_endpoint_import(p.a->e, p.ep, RID, 5, LEN, RW, 0, -1), AXF_OK);
    uint64_t addrs[AXF_VERBS_MAX_DEVICES + 1];
    uint32_t rkeys[AXF_VERBS_MAX_DEVICES + 1];
    for (int i = 0; i <= AXF_VERBS_MAX_DEVICES; i++) {
        addrs[i] = 1u << 20;
        rkeys[i] = 1;
    }
    addrs[p.ndev - 1] = UINT64_MAX - LEN + 2; /* its last byte past 2^64 */
    CHECK_EQ(axf_endpoint_import_verbs(p.a->e, p.ep, RID, addrs, rkeys, (size_t)p.ndev),
             AXF_E_INVALID);
    addrs[p.ndev - 1] = UINT64_MAX - LEN; /* ends below the top: addressable */
    CHECK_EQ(axf_endpoint_import_verbs(p.a->e, p.ep, RID, addrs, rkeys, (size_t)p.ndev), AXF_OK);
    CHECK_EQ(axf_endpoint_import_verbs(p.a->e, p.ep, RID, addrs, rkeys, 0), AXF_E_INVALID);
    CHECK_EQ(axf_endpoint_import_verbs(p.a->e, p.ep, RID, addrs, rkeys,
                                       AXF_VERBS_MAX_DEVICES + 1),
             AXF_E_INVALID);
    axf_verbs_qp_info out, bad;
    uint64_t h = 0;
    static const struct {
        uint32_t qpn, psn, mtu;
    } wrong[] = {{1u << 24, 1, 3}, {1, 1u << 24, 3}, {1, 1, 0}, {1, 1, 6}};
    for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
        memset(&bad, 0, sizeof bad);
        bad.port = 1;
        bad.qpn = wrong[i].qpn;
        bad.psn = wrong[i].psn;
        bad.mtu = wrong[i].mtu;
        CHECK_EQ(axf_verbs_accept_qp(p.b->e, 0, &bad, &out, &h), AXF_E_PROTOCOL);
    }
    vpair_close(&p);
    return 0;
}

/* Rule: the two ends of a queue pair must agree on link layer and GID type;
 * a peer that says otherwise is refused at connect, not left to time out. */
static int test_qp_mismatch_refused(void)
{
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK(axf_verbs_enable(a->e, provider, why, sizeof why) > 0);
    CHECK(axf_verbs_enable(b->e, provider, why, sizeof why) > 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_VERBS, A_TAG, 0, -1, &ep), AXF_OK);
    axf_verbs_qp_info ia, ib;
    CHECK_EQ(axf_verbs_qp_create(a->e, ep, 0, &ia), AXF_OK);
    if (provider) { /* softverbs: RoCE, and its routable v2 entry is the one to pick */
        CHECK_EQ(ia.link_layer, 2);
        CHECK(ia.gid_type == 1 + 2 && ia.gid_index == 3);
    }
    CHECK(ia.link_layer == 1 || ia.link_layer == 2);
    CHECK(ia.max_dest_rd_atomic >= 1);
    axf_verbs_qp_info bad = ia;
    bad.link_layer = ia.link_layer == 1 ? 2 : 1; /* the other one */
    uint64_t h;
    CHECK_EQ(axf_verbs_accept_qp(b->e, 0, &bad, &ib, &h), AXF_E_TRANSPORT);
    bad = ia;
    bad.gid_type = ia.gid_type == 1 + 1 ? 1 + 2 : 1 + 1; /* another type */
    CHECK_EQ(axf_verbs_accept_qp(b->e, 0, &bad, &ib, &h), AXF_E_TRANSPORT);
    t_close(a);
    t_close(b);
    return 0;
}


/* ------------------------------------------------------------ races the provider's hooks expose */

/* The software provider's test hooks (softverbs.c), from the library the
 * engines load. */
static struct sv_hooks {
    void *lib;
    void (*fail_next)(int);
    void (*refuse_in_error)(int);
    int (*qp_events)(const char *, uint32_t, const int *, int);
    int (*qp_event_at_init)(const char *, int, int);
    uint64_t (*events_taken)(void);
    int (*qp_exists)(const char *, uint32_t);
    int (*hold)(int, const char *, uint32_t);
    int (*held)(void);
    void (*release)(void);
} sv;

static int sv_load(void)
{
    if (sv.lib)
        return 0;
    sv.lib = dlopen(provider, RTLD_NOW);
    CHECK(sv.lib);
    *(void **)&sv.fail_next = dlsym(sv.lib, "axf_softverbs_fail_next_post");
    *(void **)&sv.refuse_in_error = dlsym(sv.lib, "axf_softverbs_refuse_post_in_error");
    *(void **)&sv.qp_events = dlsym(sv.lib, "axf_softverbs_qp_events");
    *(void **)&sv.qp_event_at_init = dlsym(sv.lib, "axf_softverbs_qp_event_at_init");
    *(void **)&sv.events_taken = dlsym(sv.lib, "axf_softverbs_events_taken");
    *(void **)&sv.qp_exists = dlsym(sv.lib, "axf_softverbs_qp_exists");
    *(void **)&sv.hold = dlsym(sv.lib, "axf_softverbs_hold");
    *(void **)&sv.held = dlsym(sv.lib, "axf_softverbs_held");
    *(void **)&sv.release = dlsym(sv.lib, "axf_softverbs_release");
    CHECK(sv.fail_next && sv.refuse_in_error && sv.qp_events && sv.qp_event_at_init &&
          sv.events_taken && sv.qp_exists && sv.hold && sv.held && sv.release);
    return 0;
}

enum { EV_QP_FATAL = 1, EV_COMM_EST = 4, HOLD_MODIFY_ERR = 1, HOLD_REG_DMABUF = 2,
       HOLD_ACK_ASYNC = 3 };

/* Polls cond() every millisecond for up to T_TIMEOUT_MS; its last value. */
static bool t_until(bool (*cond)(void))
{
    uint64_t end = t_now_ms() + T_TIMEOUT_MS;
    while (!cond() && t_now_ms() < end) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return cond();
}

/* Rule: a post_send refused part way, on a provider that also refuses posts
 * on a queue pair in the error state (so no drain request can follow): the
 * requests it took may all have completed without a completion (unsignalled),
 * so nothing ever says they are over. The op must still fail promptly with a
 * typed error (not at shutdown's 10 s limit), the endpoint be lost, and the
 * engine close cleanly. */
static int test_partial_post_no_drain(void)
{
    if (sv_load())
        return 1;
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    enum { N = 8 };
    axf_desc d[N];
    for (int i = 0; i < N; i++)
        d[i] = (axf_desc){.lrid = p.arid, .loff = (uint64_t)i * 4096, .rrid = p.brid,
                          .rkey = p.bkey, .roff = (uint64_t)i * 4096, .len = 4096};
    sv.refuse_in_error(1);
    sv.fail_next(3);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, N, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    int got = t_wait(p.a, AXF_CQ_XFER, 1, &c); /* before shutdown: not left to verbs_stop */
    sv.refuse_in_error(0);
    CHECK_EQ(got, 0);
    CHECK(c.status == AXF_E_TRANSPORT || c.status == AXF_E_PEER_LOST);
    CHECK_EQ(t_wait(p.a, AXF_CQ_PEER_LOST, p.ep, &c), 0);
    /* Refused at once, or failed through its completion while the endpoint's
     * connections are still going away. */
    int st = axf_post(p.a->e, p.ep, AXF_OP_WRITE, d, N, NULL, 0, 2, 0);
    if (st == AXF_OK) {
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 2, &c), 0);
        st = c.status;
    }
    CHECK_EQ(st, AXF_E_PEER_LOST);
    vpair_close(&p);
    return 0;
}

/* Connects A -> B over every device as t_verbs_connect does, and says the
 * numbers of B's (accepting-side) queue pairs. ndev, or -1. */
static int connect_qpns(axf_engine *a, axf_engine *b, uint64_t *ep, uint32_t *bqpn)
{
    char why[256];
    int ndev = axf_verbs_enable(a, provider, why, sizeof why);
    if (ndev <= 0 || axf_verbs_enable(b, provider, why, sizeof why) != ndev ||
        axf_endpoint_create(a, AXF_EP_VERBS, A_TAG, 0, -1, ep) != AXF_OK)
        return -1;
    uint64_t h[AXF_VERBS_MAX_DEVICES];
    for (int d = 0; d < ndev; d++) {
        axf_verbs_qp_info ia, ib;
        if (axf_verbs_qp_create(a, *ep, (uint32_t)d, &ia) != AXF_OK ||
            axf_verbs_accept_qp(b, (uint32_t)d, &ia, &ib, &h[d]) != AXF_OK ||
            axf_verbs_qp_connect(a, *ep, (uint32_t)d, (uint32_t)d, &ib) != AXF_OK)
            return -1;
        bqpn[d] = ib.qpn;
    }
    int s[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, s) != 0 ||
        axf_endpoint_add_conn(a, *ep, s[0]) != AXF_OK ||
        axf_verbs_accept_conn(b, s[1], B_TAG, h, (size_t)ndev) != AXF_OK)
        return -1;
    return ndev;
}

static uint64_t ev_goal;
static uint32_t gone_qpn;
static bool held_or_passed(void) { return sv.held() || sv.events_taken() >= ev_goal; }
static bool qp_gone(void) { return sv.qp_exists("softverbs0", gone_qpn) == 0; }

/* Rule: an asynchronous error on a queue pair that serves a peer (accepting
 * side) while that peer's connection closes. The connection's thread frees
 * the queue pair; the event's handling must not touch it (the NIC already
 * moved it to the error state) but close its connection, so that the peer
 * loses the endpoint at once rather than when its retries run out. The provider parks a modify_qp to ERR of that queue pair
 * until it is destroyed: one that the event handling makes would run on a
 * freed queue pair (ASan: heap-use-after-free). */
static int test_async_error_accepting_qp(void)
{
    if (sv_load())
        return 1;
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    uint64_t ep;
    uint32_t bqpn[AXF_VERBS_MAX_DEVICES];
    CHECK(connect_qpns(a->e, b->e, &ep, bqpn) > 0);
    CHECK_EQ(sv.hold(HOLD_MODIFY_ERR, "softverbs0", bqpn[0]), 0);
    ev_goal = sv.events_taken() + 2;
    /* COMM_EST after it (ignored): once taken, the error was handled. */
    static const int evs[] = {EV_QP_FATAL, EV_COMM_EST};
    CHECK_EQ(sv.qp_events("softverbs0", bqpn[0], evs, 2), 0);
    CHECK(t_until(held_or_passed));
    bool touched = sv.held();
    if (!touched) { /* B closed the connection: A loses the endpoint now, not at retry's end */
        axf_completion c;
        CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep, &c), 0);
    }
    t_close(a); /* its connection closes: B's connection thread frees its queue pairs */
    gone_qpn = bqpn[0];
    CHECK(t_until(qp_gone));
    sv.release();
    CHECK(!touched);
    t_close(b);
    return 0;
}

/* Rule: a NIC may report a queue pair's asynchronous error as soon as the
 * queue pair exists, before axf_verbs_qp_create returned: the poller then
 * reads the queue pair's owner while the creating thread sets it (TSan: data
 * race). The endpoint is lost, typed, and nothing hangs. */
static int test_async_error_new_qp(void)
{
    if (sv_load())
        return 1;
    tengine *a = t_engine(NULL);
    CHECK(a);
    char why[256];
    CHECK(axf_verbs_enable(a->e, provider, why, sizeof why) > 0);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_VERBS, A_TAG, 0, -1, &ep), AXF_OK);
    /* Delivered 20 ms after it reached INIT: when the poller looks for it,
     * the queue pair is linked (else the event is for an unknown one). */
    CHECK_EQ(sv.qp_event_at_init("softverbs0", EV_QP_FATAL, 20), 0);
    axf_verbs_qp_info ia;
    CHECK_EQ(axf_verbs_qp_create(a->e, ep, 0, &ia), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(a, AXF_CQ_PEER_LOST, ep, &c), 0);
    CHECK_EQ(c.status, AXF_E_PEER_LOST);
    t_close(a);
    return 0;
}

static bool ack_held(void) { return sv.held() != 0; }
static bool events_passed(void) { return sv.events_taken() >= ev_goal; }

/* Rule: an asynchronous event names its queue pair by address, valid only
 * until the event is acknowledged (destroy_qp waits for the ack; the provider
 * may then reuse the memory for the next queue pair). The poller must find
 * which of ours it is before acknowledging: here it is parked right after the
 * ack of a QP_FATAL on an unbound accepting queue pair, which is then
 * destroyed and a new initiator queue pair made at the same address (the
 * provider reuses it); looked up after the ack, the event failed the new
 * queue pair's endpoint (a PEER_LOST for a peer that is fine). */
static int test_async_event_qp_reused(void)
{
    if (sv_load())
        return 1;
    tengine *a = t_engine(NULL);
    CHECK(a);
    char why[256];
    CHECK(axf_verbs_enable(a->e, provider, why, sizeof why) > 0);
    uint64_t ep1, ep2, h;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_VERBS, A_TAG, 0, -1, &ep1), AXF_OK);
    axf_verbs_qp_info i1, ib, i2;
    CHECK_EQ(axf_verbs_qp_create(a->e, ep1, 0, &i1), AXF_OK);
    CHECK_EQ(axf_verbs_accept_qp(a->e, 0, &i1, &ib, &h), AXF_OK);
    CHECK_EQ(sv.hold(HOLD_ACK_ASYNC, NULL, 0), 0);
    static const int fatal[] = {EV_QP_FATAL};
    CHECK_EQ(sv.qp_events("softverbs0", ib.qpn, fatal, 1), 0);
    CHECK(t_until(ack_held));
    CHECK_EQ(axf_verbs_qp_destroy(a->e, h), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_VERBS, B_TAG, 0, -1, &ep2), AXF_OK);
    CHECK_EQ(axf_verbs_qp_create(a->e, ep2, 0, &i2), AXF_OK); /* at the freed address */
    sv.release();
    /* Events are handled in order: once this one is taken, the first is done. */
    ev_goal = sv.events_taken() + 1;
    static const int est[] = {EV_COMM_EST};
    CHECK_EQ(sv.qp_events("softverbs0", i1.qpn, est, 1), 0);
    CHECK(t_until(events_passed));
    axf_completion c[16];
    size_t n;
    while ((n = axf_poll(a->e, c, 16)) > 0)
        for (size_t k = 0; k < n; k++) {
            CHECK(!(c[k].kind == AXF_CQ_PEER_LOST && c[k].id == ep2));
            axf_completion_free(&c[k]);
        }
    t_close(a);
    return 0;
}

struct dmabuf_reg {
    axf_engine *e;
    uint64_t rid;
    int fd, st;
};

static void *dmabuf_thread(void *arg)
{
    struct dmabuf_reg *r = arg;
    r->st = axf_verbs_region_dmabuf(r->e, r->rid, r->fd, 0);
    return NULL;
}

static bool reg_held(void) { return sv.held() != 0; }

/* Rule: a GPU region registered through the dmabuf hook while ops that use
 * it are posted. The provider parks the registration: a post meanwhile sees
 * the region unregistered (typed AXF_E_INVALID) without reading what the
 * registering thread writes (TSan: data race); once it is registered the
 * same post moves the data. */
static int test_dmabuf_register_while_posting(void)
{
    if (sv_load())
        return 1;
    vpair p;
    if (vpair_open(&p, NULL))
        return 1;
    enum { LEN = 1 << 20 };
    uint64_t rid, key;
    /* Not CUDA memory: nothing registers it but the dmabuf hook. */
    CHECK_EQ(axf_region_register_kind(p.a->e, AXF_MEM_CUDA, 0x7f0000000000ull, LEN, RW, -1, &rid,
                                      &key),
             AXF_OK);
    struct dmabuf_reg r = {.e = p.a->e, .rid = rid, .fd = memfd_create("dmabuf", MFD_CLOEXEC)};
    CHECK(r.fd >= 0 && ftruncate(r.fd, LEN) == 0);
    uint8_t *m = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd, 0);
    CHECK(m != MAP_FAILED);
    t_fill(m, LEN, 31);
    CHECK_EQ(sv.hold(HOLD_REG_DMABUF, NULL, 0), 0);
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, dmabuf_thread, &r), 0);
    bool parked = t_until(reg_held);
    axf_desc d = {.lrid = rid, .rrid = p.brid, .rkey = p.bkey, .len = 4096};
    int st = axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0);
    sv.release();
    pthread_join(th, NULL);
    CHECK(parked);
    CHECK_EQ(st, AXF_E_INVALID);
    CHECK_EQ(r.st, AXF_OK);
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst, m, 4096) == 0);
    CHECK_EQ(axf_region_deregister(p.a->e, rid), AXF_OK);
    vpair_close(&p);
    munmap(m, LEN);
    close(r.fd);
    return 0;
}


/* Rule: a device that dies says so only through its asynchronous events; it
 * completes nothing afterwards, not even flushes. Ops in flight on it must
 * still finish (failed), and the endpoint be lost. Last: the device stays
 * dead for the rest of the process. */
static int test_device_fatal(void)
{
    void *lib = dlopen(provider, RTLD_NOW); /* the library the engines load too */
    int (*fatal)(const char *) = NULL;
    if (lib)
        *(void **)&fatal = dlsym(lib, "axf_softverbs_device_fatal");
    CHECK(fatal);
    axf_config cfg = {.chunk_bytes = 64 << 10};
    vpair p;
    if (vpair_open(&p, &cfg))
        return 1;
    axf_desc d = {.lrid = p.arid, .rrid = p.brid, .rkey = p.bkey, .len = REG};
    for (uint64_t k = 0; k < 4; k++)
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1 + k, 0), AXF_OK);
    CHECK_EQ(fatal("softverbs0"), 0);
    for (uint64_t k = 0; k < 4; k++) {
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 1 + k, &c), 0); /* finishes: no hang */
    }
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_PEER_LOST, p.ep, &c), 0);
    dlclose(lib);
    vpair_close(&p);
    return 0;
}

int main(int argc, char **argv)
{
    provider = getenv("AXF_SOFTVERBS_PROVIDER");
    /* Devices that serve fewer READs than they issue: the depth must be
     * negotiated (test_read_depth; every READ of the suite depends on it). */
    setenv("AXF_SOFTVERBS_RD_ATOM", "4,16", 0);
    char why[256];
    if (axf_verbs_probe(NULL, NULL, 0, why, sizeof why) == AXF_E_TRANSPORT &&
        strstr(why, "not built")) {
        printf("SKIP: verbs %s\n", why);
        return 77;
    }
    static const t_case all[] = {
        T_CASE(test_no_devices_is_not_an_error),
        /* Before any case opens the provider's devices: its children fork
         * a process where none of the provider's threads run yet. */
        T_CASE(test_provider_missing_entries),
        T_CASE(test_probe_provider),
        T_CASE(test_write_read),
        T_CASE(test_many_small),
        T_CASE(test_notify_after_data),
        T_CASE(test_access_checked_at_post),
        T_CASE(test_remote_access_error),
        T_CASE(test_peer_lost),
        T_CASE(test_cancel),
        T_CASE(test_shutdown_in_flight),
        T_CASE(test_registration_cache),
        T_CASE(test_deregister_waits),
        T_CASE(test_enable_after_register),
        T_CASE(test_gpu_region_unreachable),
        T_CASE(test_gpu_dmabuf_small_write),
        T_CASE(test_read_depth),
        T_CASE(test_partial_post),
        T_CASE(test_qp_mismatch_refused),
        T_CASE(test_peer_values_checked),
        T_CASE(test_partial_post_no_drain),
        T_CASE(test_async_error_accepting_qp),
        T_CASE(test_async_error_new_qp),
        T_CASE(test_async_event_qp_reused),
        T_CASE(test_dmabuf_register_while_posting),
        T_CASE(test_device_fatal), /* last: the device stays dead */
    };
    /* AXF_VERBS_REAL=1: the same cases on the real libibverbs and NIC (both
     * engines in this process, queue pairs looped back through the port), but
     * those that need the software provider's hooks (benchmarks/gpu_check.sh). */
    const char *real = getenv("AXF_VERBS_REAL");
    if (real && *real == '1') {
        provider = NULL;
        static const t_case hw[] = {
            T_CASE(test_probe_provider),          T_CASE(test_write_read),
            T_CASE(test_many_small),              T_CASE(test_notify_after_data),
            T_CASE(test_access_checked_at_post),  T_CASE(test_remote_access_error),
            T_CASE(test_peer_lost),               T_CASE(test_cancel),
            T_CASE(test_shutdown_in_flight),      T_CASE(test_registration_cache),
            T_CASE(test_deregister_waits),        T_CASE(test_enable_after_register),
            T_CASE(test_gpu_dmabuf_small_write),  T_CASE(test_read_depth),
            T_CASE(test_qp_mismatch_refused),
        };
        return T_RUN(argc, argv, hw);
    }
    if (!provider || !*provider) {
        printf("SKIP: AXF_SOFTVERBS_PROVIDER is not set (the software verbs provider)\n");
        return 77;
    }
    return T_RUN(argc, argv, all);
}

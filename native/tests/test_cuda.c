/* CUDA support. Without arguments: the absent-driver path, on any machine (the
 * driver is pointed at a library that does not exist): every CUDA call answers
 * AXF_E_TRANSPORT with a reason, nothing hangs, the engine keeps working for
 * host memory. With --driver: the real driver (libcuda.so.1); exits 77 (meson's
 * "skipped") where there is none, else moves bytes host -> GPU -> GPU -> host
 * through a loopback AXF_EP_CUDA endpoint and checks bounds and keys. */
#include "harness.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/wait.h>

#define MISSING "/nonexistent/aioxfer-test/libcuda.so.1"

static int test_probe_reports_why(void)
{
    char why[256] = {0};
    int n = -1;
    CHECK_EQ(axf_cuda_probe(why, sizeof why, &n), AXF_E_TRANSPORT);
    CHECK_EQ(n, 0);
    CHECK(strstr(why, "no CUDA driver") != NULL);
    CHECK(strstr(why, MISSING) != NULL);
    char name[64];
    CHECK_EQ(axf_cuda_device_name(0, name, sizeof name), AXF_E_TRANSPORT);
    int dev = -1;
    uint64_t base = 0, size = 0, ptr = 0;
    CHECK_EQ(axf_cuda_pointer(0x1000, 16, &dev, &base, &size), AXF_E_TRANSPORT);
    CHECK_EQ(axf_cuda_alloc(0, 4096, &ptr), AXF_E_TRANSPORT);
    CHECK_EQ(axf_cuda_copy(0x1000, 0x2000, 16), AXF_E_TRANSPORT);
    uint8_t handle[AXF_CUDA_IPC_HANDLE], uuid[16];
    uint64_t off = 0;
    CHECK_EQ(axf_cuda_export(0x1000, handle, &off, uuid), AXF_E_TRANSPORT);
    int fd = -1;
    CHECK_EQ(axf_cuda_dmabuf(0x1000, 16, &fd), AXF_E_TRANSPORT);
    return 0;
}

static int test_enable_without_driver(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    char why[256] = {0};
    CHECK_EQ(axf_cuda_enable(t->e, why, sizeof why), AXF_E_TRANSPORT);
    CHECK(strstr(why, "no CUDA driver") != NULL);
    uint64_t ep = 0;
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_CUDA, 1, getpid(), -1, &ep), AXF_E_TRANSPORT);
    /* A GPU import into a host endpoint is refused before the driver is asked. */
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_SHM, 1, getpid(), -1, &ep), AXF_OK);
    uint8_t handle[AXF_CUDA_IPC_HANDLE] = {0};
    CHECK_EQ(axf_endpoint_import_cuda(t->e, ep, 7, 8, 4096, AXF_ACCESS_WRITE, 0x1000, handle, 0,
                                      NULL),
             AXF_E_INVALID);
    /* The host path still works on the same engine. */
    uint8_t *a = calloc(1, 4096), *b = calloc(1, 4096);
    CHECK(a && b);
    t_fill(a, 4096, 3);
    uint64_t arid, akey, brid, bkey, crid, ckey;
    CHECK_EQ(axf_region_register(t->e, a, 4096, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &arid,
                                 &akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(t->e, b, 4096, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &brid,
                                 &bkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_import(t->e, ep, brid, bkey, 4096, AXF_ACCESS_READ | AXF_ACCESS_WRITE,
                                 (uint64_t)(uintptr_t)b, -1),
             AXF_OK);
    axf_desc d = {.lrid = arid, .rrid = brid, .rkey = bkey, .len = 4096};
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(a, b, 4096) == 0);
    /* A GPU region registers (a pointer is all the engine keeps) but a host
     * transport refuses it before touching anything. */
    CHECK_EQ(axf_region_register_kind(t->e, AXF_MEM_CUDA, 0x7f0000000000ull, 4096,
                                      AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1, &crid, &ckey),
             AXF_OK);
    d.lrid = crid;
    CHECK_EQ(axf_post(t->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_E_INVALID);
    CHECK_EQ(axf_region_deregister(t->e, crid), AXF_OK);
    t_close(t);
    free(a);
    free(b);
    return 0;
}

/* ---------------------------------------------------------------- real driver */

#define GPU_LEN (4u << 20)

/* With the software driver: how many host ranges it has page-locked (-1 with
 * the real one, which has no such hook). */
static int pinned_now(void)
{
    const char *path = getenv("AIOXFER_CUDA_DRIVER");
    void *h = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    int (*count)(void) = NULL;
    if (h)
        *(void **)&count = dlsym(h, "fakecuda_pinned_count");
    int n = count ? count() : -1;
    if (h)
        dlclose(h);
    return n;
}

static int post_wait(tengine *t, uint64_t ep, int op, axf_desc *d, size_t n, uint64_t id,
                     int want)
{
    CHECK_EQ(axf_post(t->e, ep, op, d, n, NULL, 0, id, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_XFER, id, &c), 0);
    CHECK_EQ(c.status, want);
    return 0;
}

static int test_gpu_loopback(void)
{
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint64_t g1 = 0, g2 = 0;
    CHECK_EQ(axf_cuda_alloc(0, GPU_LEN, &g1), AXF_OK);
    CHECK_EQ(axf_cuda_alloc(0, GPU_LEN, &g2), AXF_OK);
    int dev = -1;
    uint64_t base = 0, size = 0;
    CHECK_EQ(axf_cuda_pointer(g1 + 16, 32, &dev, &base, &size), AXF_OK);
    CHECK_EQ(dev, 0);
    CHECK_EQ(base, g1);
    CHECK(size >= GPU_LEN);
    CHECK_EQ(axf_cuda_pointer(g1 + size - 8, 16, NULL, NULL, NULL), AXF_E_ACCESS);
    uint8_t handle[AXF_CUDA_IPC_HANDLE], uuid[16];
    uint64_t off = 0;
    CHECK_EQ(axf_cuda_export(g1 + 4096, handle, &off, uuid), AXF_OK);
    CHECK_EQ(off, 4096);

    uint8_t *src = malloc(GPU_LEN), *dst = calloc(1, GPU_LEN);
    CHECK(src && dst);
    t_fill(src, GPU_LEN, 11);
    uint64_t srid, skey, drid, dkey, g2rid, g2key, g1rid, g1key;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(a->e, src, GPU_LEN, rw, -1, &srid, &skey), AXF_OK);
    CHECK_EQ(axf_region_register(a->e, dst, GPU_LEN, rw, -1, &drid, &dkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(a->e, AXF_MEM_CUDA, g2, GPU_LEN, rw, -1, &g2rid, &g2key),
             AXF_OK);
    /* b owns g1; a reaches it through a loopback endpoint (our own pid). */
    CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, g1, GPU_LEN, rw, -1, &g1rid, &g1key),
             AXF_OK);
    uint64_t ep = 0;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    /* A length past the allocation is refused at import. */
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, g1rid, g1key, size + 1, rw, g1, NULL, 0, NULL),
             AXF_E_ACCESS);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, g1rid, g1key, GPU_LEN, rw, g1, NULL, 0, NULL),
             AXF_OK);

    /* host -> GPU (g1), in 64 descriptors */
    axf_desc d[64];
    for (int i = 0; i < 64; i++)
        d[i] = (axf_desc){.lrid = srid, .loff = (uint64_t)i * (GPU_LEN / 64), .rrid = g1rid,
                          .rkey = g1key, .roff = (uint64_t)i * (GPU_LEN / 64),
                          .len = GPU_LEN / 64};
    if (post_wait(a, ep, AXF_OP_WRITE, d, 64, 1, AXF_OK))
        return 1;
    /* the local host region was page-locked for it (and stays so while registered) */
    CHECK(pinned_now() == -1 || pinned_now() == 1);
    /* GPU (g1) -> GPU (g2): local g2 READs remote g1 */
    axf_desc g = {.lrid = g2rid, .rrid = g1rid, .rkey = g1key, .len = GPU_LEN};
    if (post_wait(a, ep, AXF_OP_READ, &g, 1, 2, AXF_OK))
        return 1;
    /* g2 -> host through the driver's synchronous copy, then compare */
    CHECK_EQ(axf_cuda_copy((uint64_t)(uintptr_t)dst, g2, GPU_LEN), AXF_OK);
    CHECK(memcmp(src, dst, GPU_LEN) == 0);
    /* GPU (g1) -> host via the endpoint */
    memset(dst, 0, GPU_LEN);
    axf_desc r = {.lrid = drid, .rrid = g1rid, .rkey = g1key, .len = GPU_LEN};
    if (post_wait(a, ep, AXF_OP_READ, &r, 1, 3, AXF_OK))
        return 1;
    CHECK(memcmp(src, dst, GPU_LEN) == 0);
    /* Keys and bounds are checked before any copy is enqueued. */
    axf_desc bad = {.lrid = srid, .rrid = g1rid, .rkey = g1key ^ 1, .len = 16};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &bad, 1, NULL, 0, 4, 0), AXF_E_ACCESS);
    bad.rkey = g1key;
    bad.roff = GPU_LEN - 8;
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &bad, 1, NULL, 0, 5, 0), AXF_E_ACCESS);
    /* Revocation waits for nothing here (no op in flight); forget closes the mapping. */
    CHECK_EQ(axf_endpoint_forget(a->e, ep, g1rid), AXF_OK);
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, d, 1, NULL, 0, 6, 0), AXF_E_ACCESS);
    t_close(a);
    t_close(b);
    CHECK(pinned_now() <= 0); /* unpinned before the regions were reported freed */
    CHECK_EQ(axf_cuda_free(g1), AXF_OK);
    CHECK_EQ(axf_cuda_free(g2), AXF_OK);
    free(src);
    free(dst);
    return 0;
}


/* ---------------------------------------------------------------- driver rules */

/* A symbol of the loaded driver (the real one has the cu* calls too; the
 * fakecuda_* hooks only the software one: NULL with a real driver). */
static void *drv_sym(const char *name)
{
    const char *path = getenv("AIOXFER_CUDA_DRIVER");
    void *h = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *s = h ? dlsym(h, name) : NULL;
    if (h)
        dlclose(h);
    return s;
}

typedef int (*cu_ctx_fn)(void **);
typedef int (*cu_ctx_in_fn)(void *);
typedef int (*cu_retain_fn)(void **, int);
typedef int (*cu_release_fn)(int);
typedef int (*fake_int_fn)(int);
typedef int (*fake_void_fn)(void);

static void *cur_ctx(void)
{
    cu_ctx_fn get = (cu_ctx_fn)(uintptr_t)drv_sym("cuCtxGetCurrent");
    void *c = (void *)1;
    if (get)
        get(&c);
    return c;
}

static int primary_refs(int dev)
{
    fake_int_fn f = (fake_int_fn)(uintptr_t)drv_sym("fakecuda_primary_refs");
    return f ? f(dev) : -1;
}

static int sync_copies(void)
{
    fake_void_fn f = (fake_void_fn)(uintptr_t)drv_sym("fakecuda_sync_copies");
    return f ? f() : 0;
}

static int ndevices(void)
{
    char why[256];
    int n = 0;
    axf_cuda_probe(why, sizeof why, &n);
    return n;
}

#define CTX_SAME(c) CHECK(cur_ctx() == (c))

/* Rule: every call we make leaves the caller's current context as it was,
 * and a device the process does not use never gets its primary context
 * activated (hundreds of MB of HBM, and an exclusive-process GPU refused). */
static int test_context_untouched(void)
{
    int n = ndevices();
    int dev = n - 1; /* the application's GPU: the last one, not device 0 */
    cu_retain_fn retain = (cu_retain_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRetain");
    cu_release_fn release = (cu_release_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRelease_v2");
    cu_ctx_in_fn push = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxPushCurrent_v2");
    cu_ctx_fn pop = (cu_ctx_fn)(uintptr_t)drv_sym("cuCtxPopCurrent_v2");
    CHECK(retain && release && push && pop);
    int refs0 = primary_refs(0);
    /* First on a thread with no context at all: pointer queries need none. */
    void *none = cur_ctx();
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(dev, 1 << 20, &g), AXF_OK);
    CTX_SAME(none);
    CHECK_EQ(axf_cuda_pointer(g, 4096, NULL, NULL, NULL), AXF_OK);
    CTX_SAME(none);
    /* Then as an application that made its device's primary context current. */
    void *app = NULL;
    CHECK_EQ(retain(&app, dev), 0);
    CHECK_EQ(push(app), 0);
    CTX_SAME(app);
    int dv = -1;
    CHECK_EQ(axf_cuda_pointer(g + 64, 4096, &dv, NULL, NULL), AXF_OK);
    CHECK_EQ(dv, dev);
    CTX_SAME(app);
    uint8_t handle[AXF_CUDA_IPC_HANDLE], uuid[16];
    uint64_t off = 0;
    CHECK_EQ(axf_cuda_export(g + 4096, handle, &off, uuid), AXF_OK);
    CTX_SAME(app);
    uint8_t *host = malloc(1 << 20), *back = calloc(1, 1 << 20);
    CHECK(host && back);
    t_fill(host, 1 << 20, 21);
    CHECK_EQ(axf_cuda_copy(g, (uint64_t)(uintptr_t)host, 1 << 20), AXF_OK);
    CTX_SAME(app);
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint64_t hrid, hkey, grid, gkey, ep;
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    CHECK_EQ(axf_region_register(a->e, back, 1 << 20, rw, -1, &hrid, &hkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, g, 1 << 20, rw, -1, &grid, &gkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, grid, gkey, 1 << 20, rw, g, NULL, 0, NULL), AXF_OK);
    CTX_SAME(app);
    axf_desc d = {.lrid = hrid, .rrid = grid, .rkey = gkey, .len = 1 << 20};
    if (post_wait(a, ep, AXF_OP_READ, &d, 1, 1, AXF_OK))
        return 1;
    CHECK(memcmp(host, back, 1 << 20) == 0);
    CTX_SAME(app);
    CHECK_EQ(axf_endpoint_forget(a->e, ep, grid), AXF_OK);
    t_close(a);
    t_close(b);
    CTX_SAME(app);
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    CTX_SAME(app);
    void *popped = NULL;
    CHECK_EQ(pop(&popped), 0);
    CHECK(popped == app);
    CHECK_EQ(release(dev), 0);
    if (n > 1 && refs0 >= 0)
        CHECK_EQ(primary_refs(0), refs0); /* device 0 was never activated */
    free(host);
    free(back);
    return 0;
}

/* Rule: a GPU copy to or from host memory is asynchronous only when that
 * memory is page-locked; our mapping of a peer's memfd region (read-only
 * ones too) must be, or every such copy runs synchronously on the submit
 * thread (GpuFileStager's whole path). */
static int test_peer_host_memory_pinned(void)
{
    enum { LEN = 1 << 20 };
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, LEN, &g), AXF_OK);
    /* Sealed as agent.alloc seals its pools: the engine maps nothing else. */
    int mfd = memfd_create("peer-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(mfd >= 0 && ftruncate(mfd, 2 * LEN) == 0);
    CHECK(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
    uint8_t *pool = mmap(NULL, 2 * LEN, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    CHECK(pool != MAP_FAILED);
    t_fill(pool, 2 * LEN, 33);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t prid, pkey, grid, gkey, ep;
    CHECK_EQ(axf_region_register(b->e, pool, 2 * LEN, rw, mfd, &prid, &pkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(a->e, AXF_MEM_CUDA, g, LEN, rw, -1, &grid, &gkey), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    /* read-only: the peer grants READ only, so our mapping is PROT_READ */
    CHECK_EQ(axf_endpoint_import(a->e, ep, prid, pkey, 2 * LEN, AXF_ACCESS_READ,
                                 (uint64_t)(uintptr_t)pool, mfd),
             AXF_OK);
    int before = sync_copies();
    axf_desc d = {.lrid = grid, .rrid = prid, .rkey = pkey, .roff = LEN, .len = LEN};
    if (post_wait(a, ep, AXF_OP_READ, &d, 1, 1, AXF_OK)) /* peer host -> GPU */
        return 1;
    CHECK_EQ(sync_copies(), before); /* asynchronous: the mapping was page-locked */
    uint8_t *back = calloc(1, LEN);
    CHECK(back);
    CHECK_EQ(axf_cuda_copy((uint64_t)(uintptr_t)back, g, LEN), AXF_OK);
    CHECK(memcmp(back, pool + LEN, LEN) == 0);
    t_close(a);
    t_close(b);
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    munmap(pool, 2 * LEN);
    close(mfd);
    free(back);
    return 0;
}

/* Rule: one copy may not span page-locked and pageable host memory. Two
 * overlapping local regions: the first is pinned whole at its first GPU
 * copy, the second can then not be pinned (overlap) and its copies run
 * partly over pinned memory. */
static int test_mixed_pinned_span(void)
{
    enum { LEN = 1 << 20 };
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, 2 * LEN, &g), AXF_OK);
    uint8_t *buf = malloc(2 * LEN);
    CHECK(buf);
    t_fill(buf, 2 * LEN, 44);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t arid, akey, brid, bkey, grid, gkey, ep;
    CHECK_EQ(axf_region_register(a->e, buf, LEN, rw, -1, &arid, &akey), AXF_OK);
    CHECK_EQ(axf_region_register(a->e, buf + LEN / 2, LEN, rw, -1, &brid, &bkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, g, 2 * LEN, rw, -1, &grid, &gkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, grid, gkey, 2 * LEN, rw, g, NULL, 0, NULL),
             AXF_OK);
    axf_desc d = {.lrid = arid, .rrid = grid, .rkey = gkey, .len = LEN};
    if (post_wait(a, ep, AXF_OP_WRITE, &d, 1, 1, AXF_OK))
        return 1;
    d = (axf_desc){.lrid = brid, .rrid = grid, .rkey = gkey, .roff = LEN, .len = LEN};
    if (post_wait(a, ep, AXF_OP_WRITE, &d, 1, 2, AXF_OK))
        return 1;
    uint8_t *back = calloc(1, LEN);
    CHECK(back);
    CHECK_EQ(axf_cuda_copy((uint64_t)(uintptr_t)back, g + LEN, LEN), AXF_OK);
    CHECK(memcmp(back, buf + LEN / 2, LEN) == 0);
    t_close(a);
    t_close(b);
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    free(buf);
    free(back);
    return 0;
}

/* Rule (VMM, PyTorch expandable segments): the driver reports each mapped
 * chunk as its own range; a tensor spanning chunks is still one contiguous
 * span of device memory and registers. Legacy IPC refuses such memory. */
static int test_vmm_span(void)
{
    typedef int (*vmm_fn)(int, size_t, int, uint64_t *);
    typedef int (*vmm_free_fn)(uint64_t, size_t, int);
    vmm_fn vmm = (vmm_fn)(uintptr_t)drv_sym("fakecuda_alloc_vmm");
    vmm_free_fn vmm_free = (vmm_free_fn)(uintptr_t)drv_sym("fakecuda_free_vmm");
    if (!vmm || !vmm_free)
        return 0; /* the real driver: gpu_check.sh covers it with PyTorch */
    enum { CHUNK = 2 << 20 };
    uint64_t p = 0;
    CHECK_EQ(vmm(0, CHUNK, 3, &p), 0);
    uint64_t base = 0, size = 0;
    CHECK_EQ(axf_cuda_pointer(p + CHUNK / 2, 2 * CHUNK, NULL, &base, &size), AXF_OK);
    CHECK_EQ(axf_cuda_pointer(p + CHUNK, 2 * CHUNK + 1, NULL, NULL, NULL), AXF_E_ACCESS);
    uint8_t handle[AXF_CUDA_IPC_HANDLE], uuid[16];
    uint64_t off;
    CHECK_EQ(axf_cuda_export(p, handle, &off, uuid), AXF_E_REGISTRATION);
    /* bytes across the chunk boundary, through a loopback endpoint */
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint8_t *src = malloc(2 * CHUNK), *dst = calloc(1, 2 * CHUNK);
    CHECK(src && dst);
    t_fill(src, 2 * CHUNK, 55);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t srid, skey, drid, dkey, vrid, vkey, ep;
    CHECK_EQ(axf_region_register(a->e, src, 2 * CHUNK, rw, -1, &srid, &skey), AXF_OK);
    CHECK_EQ(axf_region_register(a->e, dst, 2 * CHUNK, rw, -1, &drid, &dkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, p + CHUNK / 2, 2 * CHUNK, rw, -1, &vrid,
                                      &vkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, vrid, vkey, 2 * CHUNK, rw, p + CHUNK / 2, NULL, 0,
                                      NULL),
             AXF_OK);
    axf_desc d = {.lrid = srid, .rrid = vrid, .rkey = vkey, .len = 2 * CHUNK};
    if (post_wait(a, ep, AXF_OP_WRITE, &d, 1, 1, AXF_OK))
        return 1;
    d.lrid = drid;
    if (post_wait(a, ep, AXF_OP_READ, &d, 1, 2, AXF_OK))
        return 1;
    CHECK(memcmp(src, dst, 2 * CHUNK) == 0);
    t_close(a);
    t_close(b);
    vmm_free(p, CHUNK, 3);
    free(src);
    free(dst);
    return 0;
}

/* Rule: managed memory reports memory type DEVICE but is CPU-accessible and
 * has no IPC handle: refused as GPU memory, with the reason. */
static int test_managed_refused(void)
{
    typedef int (*managed_fn)(uint64_t *, size_t, unsigned);
    managed_fn managed = (managed_fn)(uintptr_t)drv_sym("cuMemAllocManaged");
    cu_retain_fn retain = (cu_retain_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRetain");
    cu_release_fn release = (cu_release_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRelease_v2");
    cu_ctx_in_fn push = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxPushCurrent_v2");
    cu_ctx_fn pop = (cu_ctx_fn)(uintptr_t)drv_sym("cuCtxPopCurrent_v2");
    CHECK(managed && retain && release && push && pop);
    void *ctx = NULL, *popped = NULL;
    CHECK_EQ(retain(&ctx, 0), 0);
    CHECK_EQ(push(ctx), 0);
    uint64_t m = 0;
    CHECK_EQ(managed(&m, 1 << 16, 1), 0);
    CHECK_EQ(axf_cuda_pointer(m, 4096, NULL, NULL, NULL), AXF_E_INVALID);
    CHECK_EQ(pop(&popped), 0);
    CHECK_EQ(release(0), 0);
    return 0;
}

/* Rule: an IPC mapping is reachable from the context it was opened in; a
 * copy on another device's stream needs peer access. GPU 1 reads a peer
 * process's GPU 0 memory (prefill on one GPU, decode on another). */
static int test_ipc_cross_device(void)
{
    if (ndevices() < 2) {
        printf("    (one device: nothing to cross)\n");
        return 0;
    }
    enum { LEN = 1 << 20 };
    int up[2], down[2];
    CHECK_EQ(pipe(up), 0);
    CHECK_EQ(pipe(down), 0);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) { /* the exporter: GPU 0 */
        close(up[0]);
        close(down[1]);
        uint64_t g = 0;
        uint8_t *h = malloc(LEN);
        struct { uint8_t handle[AXF_CUDA_IPC_HANDLE], uuid[16]; uint64_t off; } msg;
        t_fill(h, LEN, 66);
        int ok = h && axf_cuda_alloc(0, LEN, &g) == AXF_OK &&
                 axf_cuda_copy(g, (uint64_t)(uintptr_t)h, LEN) == AXF_OK &&
                 axf_cuda_export(g, msg.handle, &msg.off, msg.uuid) == AXF_OK;
        if (!ok)
            memset(&msg, 0, sizeof msg);
        if (write(up[1], &msg, sizeof msg) != (ssize_t)sizeof msg)
            _exit(2);
        char c;
        if (read(down[0], &c, 1) < 0)
            _exit(3);
        _exit(ok ? 0 : 1);
    }
    close(up[1]);
    close(down[0]);
    struct { uint8_t handle[AXF_CUDA_IPC_HANDLE], uuid[16]; uint64_t off; } msg;
    CHECK_EQ(read(up[0], &msg, sizeof msg), (ssize_t)sizeof msg);
    tengine *a = t_engine(NULL);
    CHECK(a);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint64_t g1 = 0;
    CHECK_EQ(axf_cuda_alloc(1, LEN, &g1), AXF_OK);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t lrid, lkey, ep;
    CHECK_EQ(axf_region_register_kind(a->e, AXF_MEM_CUDA, g1, LEN, rw, -1, &lrid, &lkey), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, child, (int)syscall(SYS_pidfd_open, child, 0), &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, 7, 8, LEN, rw, 0x1000, msg.handle, msg.off,
                                      msg.uuid),
             AXF_OK);
    axf_desc d = {.lrid = lrid, .rrid = 7, .rkey = 8, .len = LEN};
    int bad = post_wait(a, ep, AXF_OP_READ, &d, 1, 1, AXF_OK); /* GPU 1 <- peer's GPU 0 */
    uint8_t *back = calloc(1, LEN), *want = malloc(LEN);
    CHECK(back && want);
    t_fill(want, LEN, 66);
    if (!bad) {
        CHECK_EQ(axf_cuda_copy((uint64_t)(uintptr_t)back, g1, LEN), AXF_OK);
        bad = memcmp(back, want, LEN) != 0;
    }
    t_close(a);
    CHECK_EQ(axf_cuda_free(g1), AXF_OK);
    CHECK_EQ(write(down[1], "x", 1), 1);
    int wst = 0;
    CHECK_EQ(waitpid(child, &wst, 0), child);
    CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    close(up[0]);
    close(down[1]);
    free(back);
    free(want);
    CHECK(!bad);
    return 0;
}



/* A host pool is page-locked ahead of its first GPU copy, on the engine's
 * CUDA thread (not the caller's, not in the first copy's way); unpinned when
 * the region is freed. */
static int test_pin_ahead(void)
{
    if (pinned_now() < 0)
        return 0; /* the real driver has no hook to count pins */
    enum { LEN = 4 << 20 };
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, LEN, &g), AXF_OK);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t grid, gkey, hrid, hkey, ep;
    /* registering GPU memory tells the engine the application's context */
    CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, g, LEN, rw, -1, &grid, &gkey), AXF_OK);
    CHECK_EQ(axf_cuda_pointer(g, LEN, NULL, NULL, NULL), AXF_OK);
    uint8_t *pool = malloc(LEN);
    CHECK(pool);
    t_fill(pool, LEN, 88);
    int before = pinned_now();
    CHECK_EQ(axf_region_register(a->e, pool, LEN, rw, -1, &hrid, &hkey), AXF_OK);
    CHECK_EQ(axf_cuda_pin_region(a->e, hrid), AXF_OK);
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (pinned_now() == before && t_now_ms() < until)
        usleep(1000);
    CHECK_EQ(pinned_now(), before + 1);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, grid, gkey, LEN, rw, g, NULL, 0, NULL), AXF_OK);
    int sync0 = sync_copies();
    axf_desc d = {.lrid = hrid, .rrid = grid, .rkey = gkey, .len = LEN};
    if (post_wait(a, ep, AXF_OP_WRITE, &d, 1, 1, AXF_OK))
        return 1;
    CHECK_EQ(sync_copies(), sync0); /* pinned: asynchronous */
    CHECK_EQ(axf_cuda_pin_region(a->e, 999999), AXF_E_NOTFOUND);
    t_close(a);
    t_close(b);
    CHECK_EQ(pinned_now(), before); /* unpinned with the region */
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    free(pool);
    return 0;
}


typedef long (*fake_long_fn)(void);
typedef void (*fake_delay_fn)(unsigned);

/* The small-request floor. A GPU op whose copies need nothing slow (its
 * stream made, the peer's memory open, no host memory) is enqueued by its
 * posting thread inside axf_post, with the submit queue empty: no hand-off to
 * the submit thread. That thread's context stack is left as it was (its
 * application's context on another device, here). Its event is polled
 * (cuEventQuery) for the engine's poll bound before the waiter sleeps in the
 * driver, and only where the engine polls: never with target_poll_us "never"
 * (progress "sleep"). Events are reused, not made per op. Counted by the
 * software driver; skipped on a real one. */
static int test_caller_submits(void)
{
    fake_void_fn queries = (fake_void_fn)(uintptr_t)drv_sym("fakecuda_event_queries");
    fake_void_fn sleeps = (fake_void_fn)(uintptr_t)drv_sym("fakecuda_event_sleeps");
    fake_void_fn creates = (fake_void_fn)(uintptr_t)drv_sym("fakecuda_event_creates");
    fake_void_fn depth = (fake_void_fn)(uintptr_t)drv_sym("fakecuda_ctx_depth");
    fake_long_fn copy_tid = (fake_long_fn)(uintptr_t)drv_sym("fakecuda_copy_tid");
    fake_long_fn query_tid = (fake_long_fn)(uintptr_t)drv_sym("fakecuda_query_tid");
    fake_delay_fn delay = (fake_delay_fn)(uintptr_t)drv_sym("fakecuda_set_event_delay_us");
    if (!queries || !sleeps || !creates || !depth || !copy_tid || !query_tid || !delay)
        return 0;
    cu_retain_fn retain = (cu_retain_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRetain");
    cu_release_fn release = (cu_release_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRelease_v2");
    cu_ctx_in_fn push = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxPushCurrent_v2");
    cu_ctx_fn pop = (cu_ctx_fn)(uintptr_t)drv_sym("cuCtxPopCurrent_v2");
    CHECK(retain && release && push && pop);
    enum { LEN = 1 << 20 };
    int appdev = ndevices() - 1;
    long me = (long)syscall(SYS_gettid);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    for (int polls = 1; polls >= 0; polls--) {
        axf_config cfg = {.target_poll_us = polls ? 0 : UINT32_MAX};
        tengine *a = t_engine(&cfg), *b = t_engine(NULL);
        CHECK(a && b);
        char why[256];
        CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
        uint64_t g1 = 0, g2 = 0, g1rid, g1key, g2rid, g2key, hrid, hkey, ep = 0;
        CHECK_EQ(axf_cuda_alloc(0, LEN, &g1), AXF_OK);
        CHECK_EQ(axf_cuda_alloc(0, LEN, &g2), AXF_OK);
        uint8_t *host = calloc(1, LEN);
        CHECK(host);
        CHECK_EQ(axf_region_register(a->e, host, LEN, rw, -1, &hrid, &hkey), AXF_OK);
        CHECK_EQ(axf_region_register_kind(a->e, AXF_MEM_CUDA, g2, LEN, rw, -1, &g2rid, &g2key),
                 AXF_OK);
        CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, g1, LEN, rw, -1, &g1rid, &g1key),
                 AXF_OK);
        CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
        CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, g1rid, g1key, LEN, rw, g1, NULL, 0, NULL),
                 AXF_OK);
        axf_desc d = {.lrid = g2rid, .rrid = g1rid, .rkey = g1key, .len = 4096};
        /* the first makes the stream: the submit thread's */
        if (post_wait(a, ep, AXF_OP_WRITE, &d, 1, 1, AXF_OK))
            return 1;
        CHECK(copy_tid() != me);
        void *app = NULL;
        CHECK_EQ(retain(&app, appdev), 0);
        CHECK_EQ(push(app), 0);
        int depth0 = depth();
        int q0 = queries(), c0 = creates();
        if (post_wait(a, ep, AXF_OP_WRITE, &d, 1, 2, AXF_OK))
            return 1;
        CHECK_EQ(copy_tid(), me); /* enqueued inside axf_post */
        CHECK_EQ(creates(), c0);  /* the first op's event, reused */
        CTX_SAME(app);
        CHECK_EQ(depth(), depth0);
        if (polls)
            CHECK(queries() > q0);
        else
            CHECK_EQ(queries(), q0); /* progress "sleep": no poll */
        /* an event still pending past the poll bound: the waiter sleeps in the
         * driver (blocking sync) rather than spinning on. Pending for 300 ms:
         * with 20 ms, a waiter that a loaded machine (CPU hogs, ASan) ran
         * later than that found the event reached and never slept (2 of 150
         * runs beside 3 CPU hogs): the test's timing, not the engine's. */
        delay(300000);
        int s0 = sleeps();
        d.len = 64;
        if (post_wait(a, ep, AXF_OP_READ, &d, 1, 3, AXF_OK))
            return 1;
        delay(0);
        CHECK_EQ(sleeps(), s0 + 1);
        CHECK_EQ(copy_tid(), me);
        CTX_SAME(app);
        /* A lone op (AXF_POST_ALONE): its poster polls the event and completes
         * it, no thread involved (at least once in 20: the stand-in's
         * "GPU" is a thread, which a loaded machine may not run in time),
         * and only where the engine polls. */
        int mine = 0;
        d.len = 4096;
        for (uint64_t id = 100; id < 120; id++) {
            int qb = queries();
            CHECK_EQ(axf_post(a->e, ep, AXF_OP_WRITE, &d, 1, NULL, 0, id,
                              AXF_POST_ALONE | AXF_POST_POLL), AXF_OK);
            axf_completion cq[4];
            size_t got = axf_poll(a->e, cq, 4); /* no wait: there already, or not */
            if (got == 1 && cq[0].id == id && queries() > qb && query_tid() == me) {
                CHECK_EQ(cq[0].status, AXF_OK);
                mine++;
            } else {
                for (size_t k = 0; k < got; k++)
                    a->q[a->n++] = cq[k];
                axf_completion c;
                CHECK_EQ(t_wait(a, AXF_CQ_XFER, id, &c), 0);
                CHECK_EQ(c.status, AXF_OK);
            }
            CTX_SAME(app);
            CHECK_EQ(depth(), depth0);
        }
        if (polls)
            CHECK(mine > 0);
        else
            CHECK_EQ(mine, 0);
        void *popped = NULL;
        CHECK_EQ(pop(&popped), 0);
        CHECK(popped == app);
        CHECK_EQ(release(appdev), 0);
        /* host memory not page-locked yet (pinned first, else staged
         * synchronously by the driver): the submit thread's */
        axf_desc h = {.lrid = hrid, .rrid = g1rid, .rkey = g1key, .len = 4096};
        if (post_wait(a, ep, AXF_OP_READ, &h, 1, 4, AXF_OK))
            return 1;
        CHECK(copy_tid() != me);
        /* once page-locked, the posting thread's */
        if (post_wait(a, ep, AXF_OP_WRITE, &h, 1, 5, AXF_OK))
            return 1;
        CHECK_EQ(copy_tid(), me);
        CHECK_EQ(axf_endpoint_forget(a->e, ep, g1rid), AXF_OK);
        t_close(a);
        t_close(b);
        CHECK_EQ(axf_cuda_free(g1), AXF_OK);
        CHECK_EQ(axf_cuda_free(g2), AXF_OK);
        free(host);
    }
    return 0;
}

/* ---------------------------------------------------------------- stop */

typedef void (*fake_set_fn)(int);

/* A lone op posted from its own thread (AXF_POST_ALONE: the poster polls and
 * completes it itself), or (many) a stream of them until one is refused. */
typedef struct lone_poster {
    axf_engine *e;
    uint64_t ep, id;
    axf_desc d;
    int many, st;
    _Atomic int posted;
} lone_poster;

static void *lone_post_main(void *arg)
{
    lone_poster *p = arg;
    do {
        p->st = axf_post(p->e, p->ep, AXF_OP_WRITE, &p->d, 1, NULL, 0, p->id + (uint64_t)p->posted,
                         AXF_POST_ALONE | AXF_POST_POLL);
        if (p->st == AXF_OK)
            atomic_fetch_add(&p->posted, 1);
    } while (p->st == AXF_OK && p->posted < p->many);
    return NULL;
}

typedef struct shutter {
    axf_engine *e;
    _Atomic int done;
} shutter;

static void *shut_main(void *arg)
{
    shutter *s = arg;
    axf_engine_shutdown(s->e);
    atomic_store(&s->done, 1);
    return NULL;
}

/* How many transfer completions of id the engine has reported (drained). */
static int xfer_count(tengine *t, uint64_t id, int *status)
{
    t_drain(t);
    int n = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->q[i].kind == AXF_CQ_XFER && t->q[i].id == id) {
            n++;
            if (status)
                *status = t->q[i].status;
        }
    return n;
}

/* A loopback GPU -> GPU endpoint on an engine that polls, whose stream the
 * first op made: the next lone small op is its poster's from end to end. */
typedef struct lone_rig {
    tengine *a, *b;
    uint64_t g1, g2, ep;
    axf_desc d;
} lone_rig;

static int lone_rig_open(lone_rig *r)
{
    enum { LEN = 1 << 16 };
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    axf_config cfg = {.target_poll_us = 0};
    memset(r, 0, sizeof *r);
    r->a = t_engine(&cfg);
    r->b = t_engine(NULL);
    CHECK(r->a && r->b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(r->a->e, why, sizeof why), AXF_OK);
    uint64_t g1rid, g1key, g2rid, g2key;
    CHECK_EQ(axf_cuda_alloc(0, LEN, &r->g1), AXF_OK);
    CHECK_EQ(axf_cuda_alloc(0, LEN, &r->g2), AXF_OK);
    CHECK_EQ(axf_region_register_kind(r->a->e, AXF_MEM_CUDA, r->g2, LEN, rw, -1, &g2rid, &g2key),
             AXF_OK);
    CHECK_EQ(axf_region_register_kind(r->b->e, AXF_MEM_CUDA, r->g1, LEN, rw, -1, &g1rid, &g1key),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(r->a->e, AXF_EP_CUDA, 5, getpid(), -1, &r->ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(r->a->e, r->ep, g1rid, g1key, LEN, rw, r->g1, NULL, 0, NULL),
             AXF_OK);
    r->d = (axf_desc){.lrid = g2rid, .rrid = g1rid, .rkey = g1key, .len = 4096};
    return post_wait(r->a, r->ep, AXF_OP_WRITE, &r->d, 1, 1, AXF_OK); /* makes the stream */
}

static int lone_rig_close(lone_rig *r)
{
    t_close(r->a);
    t_close(r->b);
    CHECK_EQ(axf_cuda_free(r->g1), AXF_OK);
    CHECK_EQ(axf_cuda_free(r->g2), AXF_OK);
    return 0;
}

/* Rule: shutdown (cuda_stop, then the engine's sweep of what is left, then
 * cuda_free) waits for a posting thread that completes its own lone op: it
 * let go of the submit lock before completing it, and completing it touches
 * the engine's CUDA state, the event pool and the op. Held there (its event
 * failed; the software driver keeps it in cuGetErrorString) while shutdown
 * runs: shutdown must not get past it, and the op completes once. Before the
 * fix, shutdown ran to its end meanwhile and failed the op the poster then
 * completed again. Software driver only. */
static int test_stop_waits_for_lone_poster(void)
{
    fake_set_fn fail_next = (fake_set_fn)(uintptr_t)drv_sym("fakecuda_fail_next_query");
    fake_set_fn gate = (fake_set_fn)(uintptr_t)drv_sym("fakecuda_gate_error_text");
    fake_void_fn waiters = (fake_void_fn)(uintptr_t)drv_sym("fakecuda_gate_waiters");
    if (!fail_next || !gate || !waiters)
        return 0;
    lone_rig r;
    if (lone_rig_open(&r))
        return 1;
    lone_poster p = {.e = r.a->e, .ep = r.ep, .id = 2, .d = r.d, .many = 1};
    shutter s = {.e = r.a->e};
    fail_next(801); /* CUDA_ERROR_NOT_SUPPORTED: not sticky */
    gate(1);
    pthread_t pt, st;
    CHECK_EQ(pthread_create(&pt, NULL, lone_post_main, &p), 0);
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (waiters() < 1 && t_now_ms() < until)
        usleep(1000);
    int held = waiters();
    CHECK_EQ(pthread_create(&st, NULL, shut_main, &s), 0);
    /* Time enough for an unguarded shutdown to finish (it did in well under
     * a millisecond); a correct one stays blocked however long this is. */
    until = t_now_ms() + 300;
    while (!atomic_load(&s.done) && t_now_ms() < until)
        usleep(1000);
    int early_done = atomic_load(&s.done), early_n = xfer_count(r.a, 2, NULL);
    gate(0);
    pthread_join(pt, NULL);
    pthread_join(st, NULL);
    CHECK_EQ(held, 1);       /* the poster, inside its own completion */
    CHECK_EQ(early_done, 0); /* shutdown waited for it */
    CHECK_EQ(early_n, 0);    /* and did not fail its op behind its back */
    CHECK_EQ(p.st, AXF_OK);
    int status = AXF_OK;
    CHECK_EQ(xfer_count(r.a, 2, &status), 1);
    CHECK(status == AXF_E_CLOSED || status == AXF_E_TRANSPORT);
    return lone_rig_close(&r);
}

/* Rule: the same race unprovoked, repeated: a thread posting lone ops while
 * the engine shuts down. Every op posted completes exactly once, and nothing
 * is left (the sanitizer builds check memory and, under TSan, the locking). */
static int test_stop_races_lone_posts(void)
{
    if (!drv_sym("fakecuda_gate_waiters"))
        return 0;
    for (int round = 0; round < 20; round++) {
        lone_rig r;
        if (lone_rig_open(&r))
            return 1;
        lone_poster p = {.e = r.a->e, .ep = r.ep, .id = 100, .d = r.d, .many = 64};
        pthread_t pt;
        CHECK_EQ(pthread_create(&pt, NULL, lone_post_main, &p), 0);
        uint64_t until = t_now_ms() + T_TIMEOUT_MS;
        while (atomic_load(&p.posted) < round % 4 && t_now_ms() < until)
            sched_yield();
        axf_engine_shutdown(r.a->e);
        pthread_join(pt, NULL);
        CHECK(p.st == AXF_OK || p.st == AXF_E_CLOSED);
        for (int i = 0; i < p.posted; i++) {
            int n = xfer_count(r.a, 100 + (uint64_t)i, NULL);
            if (n != 1)
                fprintf(stderr, "round %d: op %d completed %d times\n", round, i, n);
            CHECK_EQ(n, 1);
        }
        if (lone_rig_close(&r))
            return 1;
    }
    return 0;
}

typedef int (*cu_create_fn)(void **, unsigned int, int);
typedef int (*cu_alloc_fn)(uint64_t *, size_t);
typedef int (*cu_free_fn)(uint64_t);

/* Moves len bytes host -> GPU memory g (registered by b, imported by a over
 * a loopback CUDA endpoint) and back into a second host buffer: both copies
 * must arrive. */
static int gpu_round_trip(tengine *a, tengine *b, uint64_t g, size_t len, uint64_t id)
{
    uint8_t *src = malloc(len), *back = calloc(1, len);
    CHECK(src && back);
    t_fill(src, len, (int)id);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t srid, skey, brid, bkey, grid, gkey, ep;
    CHECK_EQ(axf_region_register(a->e, src, len, rw, -1, &srid, &skey), AXF_OK);
    CHECK_EQ(axf_region_register(a->e, back, len, rw, -1, &brid, &bkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(b->e, AXF_MEM_CUDA, g, len, rw, -1, &grid, &gkey), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, id, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, grid, gkey, len, rw, g, NULL, 0, NULL), AXF_OK);
    axf_desc w = {.lrid = srid, .rrid = grid, .rkey = gkey, .len = len};
    if (post_wait(a, ep, AXF_OP_WRITE, &w, 1, id, AXF_OK))
        return 1;
    axf_desc r = {.lrid = brid, .rrid = grid, .rkey = gkey, .len = len};
    if (post_wait(a, ep, AXF_OP_READ, &r, 1, id + 1, AXF_OK))
        return 1;
    CHECK(memcmp(src, back, len) == 0);
    /* everything that refers to g goes before g may */
    CHECK_EQ(axf_endpoint_forget(a->e, ep, grid), AXF_OK);
    CHECK_EQ(axf_endpoint_close(a->e, ep), AXF_OK);
    CHECK_EQ(axf_region_deregister(b->e, grid), AXF_OK);
    CHECK_EQ(axf_region_deregister(a->e, srid), AXF_OK);
    CHECK_EQ(axf_region_deregister(a->e, brid), AXF_OK);
    free(src);
    free(back);
    return 0;
}

/* Rule: the engine keeps no context it does not own. An application's own
 * context (cuCtxCreate: not the device's primary one) whose memory was moved
 * once and which the application then destroyed must not be what later
 * streams, events and copies on that device run in, in any engine: with the
 * primary context's memory they still work, in the engine that moved the
 * first memory and in a new one. (Run alone too, "cuda_fake_appctx": in a
 * fresh process, where nothing has made the engine use the primary context
 * of that device before.) */
static int test_app_context_destroyed(void)
{
    cu_create_fn create = (cu_create_fn)(uintptr_t)drv_sym("cuCtxCreate_v2");
    cu_ctx_in_fn destroy = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxDestroy_v2");
    cu_ctx_fn pop = (cu_ctx_fn)(uintptr_t)drv_sym("cuCtxPopCurrent_v2");
    cu_ctx_in_fn push = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxPushCurrent_v2");
    cu_retain_fn retain = (cu_retain_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRetain");
    cu_release_fn release = (cu_release_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRelease_v2");
    cu_alloc_fn cualloc = (cu_alloc_fn)(uintptr_t)drv_sym("cuMemAlloc_v2");
    cu_free_fn cufree = (cu_free_fn)(uintptr_t)drv_sym("cuMemFree_v2");
    if (!create || !destroy) { /* a driver without them (the software one has them) */
        CHECK(!drv_sym("fakecuda_sync_copies"));
        return 0;
    }
    CHECK(pop && push && retain && release && cualloc && cufree);
    enum { LEN = 1 << 20 };
    int dev = ndevices() - 1;
    void *none = cur_ctx();
    /* The application's own context, its memory, moved once. */
    void *app = NULL, *popped = NULL;
    CHECK_EQ(create(&app, 0, dev), 0); /* made current on this thread */
    uint64_t gx = 0;
    CHECK_EQ(cualloc(&gx, LEN), 0);
    CHECK_EQ(pop(&popped), 0);
    CHECK(popped == app);
    CTX_SAME(none);
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    CHECK_EQ(gpu_round_trip(a, b, gx, LEN, 10), 0);
    CTX_SAME(none);
    /* Gone, with its memory (cuCtxDestroy frees it). */
    CHECK_EQ(destroy(app), 0);
    CTX_SAME(none);
    /* Memory of the device's primary context, as the runtime API makes it. */
    void *prim = NULL;
    uint64_t gp = 0;
    CHECK_EQ(retain(&prim, dev), 0);
    CHECK_EQ(push(prim), 0);
    CHECK_EQ(cualloc(&gp, LEN), 0);
    CHECK_EQ(pop(&popped), 0);
    CHECK(popped == prim);
    /* the engine that moved the first memory, and a new one */
    CHECK_EQ(gpu_round_trip(a, b, gp, LEN, 20), 0);
    tengine *c = t_engine(NULL);
    CHECK(c);
    CHECK_EQ(axf_cuda_enable(c->e, why, sizeof why), AXF_OK);
    CHECK_EQ(gpu_round_trip(c, b, gp, LEN, 30), 0);
    /* and what needs a context of the engine's own: an allocation */
    uint64_t g2 = 0;
    CHECK_EQ(axf_cuda_alloc(dev, 4096, &g2), AXF_OK);
    CHECK_EQ(axf_cuda_free(g2), AXF_OK);
    CTX_SAME(none);
    t_close(a);
    t_close(b);
    t_close(c);
    CHECK_EQ(push(prim), 0);
    CHECK_EQ(cufree(gp), 0);
    CHECK_EQ(pop(&popped), 0);
    CHECK_EQ(release(dev), 0);
    CTX_SAME(none);
    return 0;
}

/* Rule: registering GPU memory of a device whose primary context the
 * application uses (the runtime API, PyTorch) gives the engine a context of
 * its own there at once (host pools are pinned ahead of their first copy);
 * registering memory of an application's own context activates nothing.
 * Alone, in a fresh process ("cuda_fake_register_ctx"): before this, no
 * engine has a context anywhere. */
static int test_register_takes_active_primary(void)
{
    cu_create_fn create = (cu_create_fn)(uintptr_t)drv_sym("cuCtxCreate_v2");
    cu_ctx_in_fn destroy = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxDestroy_v2");
    cu_ctx_fn pop = (cu_ctx_fn)(uintptr_t)drv_sym("cuCtxPopCurrent_v2");
    cu_ctx_in_fn push = (cu_ctx_in_fn)(uintptr_t)drv_sym("cuCtxPushCurrent_v2");
    cu_retain_fn retain = (cu_retain_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRetain");
    cu_release_fn release = (cu_release_fn)(uintptr_t)drv_sym("cuDevicePrimaryCtxRelease_v2");
    cu_alloc_fn cualloc = (cu_alloc_fn)(uintptr_t)drv_sym("cuMemAlloc_v2");
    cu_free_fn cufree = (cu_free_fn)(uintptr_t)drv_sym("cuMemFree_v2");
    if (!create || !destroy) { /* a driver without them (the software one has them) */
        CHECK(!drv_sym("fakecuda_sync_copies"));
        return 0;
    }
    CHECK(pop && push && retain && release && cualloc && cufree);
    if (pinned_now() < 0 || primary_refs(0) < 0 || ndevices() < 2)
        return 0; /* counted by the software driver only */
    if (primary_refs(0) || primary_refs(1))
        return 0; /* not a fresh process: earlier cases retained contexts */
    enum { LEN = 1 << 20 };
    void *popped = NULL;
    /* device 0: the application's own context; registering its memory
     * leaves device 0's primary context inactive */
    void *app = NULL;
    uint64_t gx = 0;
    CHECK_EQ(create(&app, 0, 0), 0);
    CHECK_EQ(cualloc(&gx, LEN), 0);
    CHECK_EQ(pop(&popped), 0);
    CHECK_EQ(axf_cuda_pointer(gx, LEN, NULL, NULL, NULL), AXF_OK);
    CHECK_EQ(primary_refs(0), 0);
    tengine *a = t_engine(NULL);
    CHECK(a);
    char why[256];
    CHECK_EQ(axf_cuda_enable(a->e, why, sizeof why), AXF_OK);
    uint8_t *pool = calloc(1, LEN);
    CHECK(pool);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t hrid, hkey;
    int before = pinned_now();
    /* no context of the engine's yet: the pin waits for the first copy */
    CHECK_EQ(axf_region_register(a->e, pool, LEN, rw, -1, &hrid, &hkey), AXF_OK);
    CHECK_EQ(axf_cuda_pin_region(a->e, hrid), AXF_OK);
    usleep(50 * 1000);
    CHECK_EQ(pinned_now(), before);
    CHECK_EQ(axf_region_deregister(a->e, hrid), AXF_OK);
    /* device 1: the primary context, active (the application's) */
    void *prim = NULL;
    uint64_t gp = 0;
    CHECK_EQ(retain(&prim, 1), 0);
    CHECK_EQ(push(prim), 0);
    CHECK_EQ(cualloc(&gp, LEN), 0);
    CHECK_EQ(pop(&popped), 0);
    CHECK_EQ(primary_refs(1), 1);
    CHECK_EQ(axf_cuda_pointer(gp, LEN, NULL, NULL, NULL), AXF_OK);
    CHECK_EQ(primary_refs(1), 2); /* ours, held for the life of the process */
    CHECK_EQ(axf_cuda_pointer(gp, LEN, NULL, NULL, NULL), AXF_OK);
    CHECK_EQ(primary_refs(1), 2); /* once */
    CHECK_EQ(primary_refs(0), 0);
    CHECK_EQ(axf_region_register(a->e, pool, LEN, rw, -1, &hrid, &hkey), AXF_OK);
    CHECK_EQ(axf_cuda_pin_region(a->e, hrid), AXF_OK);
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (pinned_now() == before && t_now_ms() < until)
        usleep(1000);
    CHECK_EQ(pinned_now(), before + 1); /* ahead of any copy */
    /* The first transfer that copies on device 0 (memory of the application's
     * own context there) activates device 0's primary context: the engine's
     * stream lives in it (documented in aioxfer/cuda.py). */
    CHECK_EQ(primary_refs(0), 0);
    uint64_t grid, gkey, ep = 0;
    CHECK_EQ(axf_region_register_kind(a->e, AXF_MEM_CUDA, gx, LEN, rw, -1, &grid, &gkey), AXF_OK);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(a->e, ep, grid, gkey, LEN, rw, gx, NULL, 0, NULL), AXF_OK);
    CHECK_EQ(primary_refs(0), 0);
    axf_desc w = {.lrid = hrid, .rrid = grid, .rkey = gkey, .len = LEN};
    if (post_wait(a, ep, AXF_OP_WRITE, &w, 1, 1, AXF_OK))
        return 1;
    CHECK_EQ(primary_refs(0), 1);
    t_close(a);
    CHECK_EQ(pinned_now(), before);
    CHECK_EQ(push(prim), 0);
    CHECK_EQ(cufree(gp), 0);
    CHECK_EQ(pop(&popped), 0);
    CHECK_EQ(release(1), 0);
    CHECK_EQ(destroy(app), 0);
    free(pool);
    return 0;
}

/* Rule: a sticky error (an illegal address on the device) poisons every
 * context of the process, the application's too: latched, reported with its
 * name, and no GPU op is attempted after it. Last: it stays for the process. */
static int test_sticky_error_latched(void)
{
    if (!drv_sym("fakecuda_sync_copies"))
        return 0; /* not something to provoke on a real GPU */
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, 4096, &g), AXF_OK);
    uint8_t host[8192];
    CHECK(axf_cuda_copy(g, (uint64_t)(uintptr_t)host, sizeof host) != AXF_OK); /* past the end */
    char why[256] = "";
    int n = -1;
    CHECK_EQ(axf_cuda_probe(why, sizeof why, &n), AXF_E_TRANSPORT);
    CHECK(strstr(why, "sticky") != NULL && strstr(why, "ILLEGAL_ADDRESS") != NULL);
    tengine *t = t_engine(NULL);
    CHECK(t);
    CHECK_EQ(axf_cuda_enable(t->e, why, sizeof why), AXF_E_TRANSPORT);
    t_close(t);
    return 0;
}

/* Rule: a range whose end wraps past the top of the address space is refused
 * by every call that checks ranges (describe said "device 0,
 * allocation ..." and answered AXF_OK; the dmabuf export asked the driver
 * for some 2^64 bytes). */
static int test_wrapping_range_refused(void)
{
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, 1 << 16, &g), AXF_OK);
    uint64_t wrap = UINT64_MAX - g + 2; /* g + wrap == 1 */
    char why[256] = "";
    int st = axf_cuda_describe(g, wrap, why, sizeof why);
    printf("    describe: %d (%s)\n", st, why);
    CHECK_EQ(st, AXF_E_ACCESS);
    int fd = -1;
    uint64_t off = 0;
    st = axf_cuda_dmabuf_range(g, wrap, &fd, &off, why, sizeof why);
    printf("    dmabuf range: %d (%s)\n", st, why);
    CHECK_EQ(st, AXF_E_INVALID);
    CHECK_EQ(fd, -1);
    CHECK_EQ(axf_cuda_pointer(g, wrap, NULL, NULL, NULL), AXF_E_INVALID);
    /* Ranges inside it are still fine. */
    CHECK_EQ(axf_cuda_describe(g, 1 << 16, why, sizeof why), AXF_OK);
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    return 0;
}

/* Rule: a driver call failing in the middle of the copy path fails only the
 * op that met it, with the right status, and leaks nothing (under ASan, LSan
 * checks): no stream (the op fails, the next one makes it), no event or no
 * record of it (the stream is synchronised instead: the op succeeds), a
 * copy refused (the op fails), host memory not page-locked (copied pageable:
 * the op succeeds). Each on a fresh engine, then a second op there works and
 * the bytes are checked. The software driver's faults only. */
static int test_driver_call_fails(void)
{
    void (*fail_next)(const char *, int);
    int (*pending)(void);
    void *f = drv_sym("fakecuda_fail_next_call"), *p = drv_sym("fakecuda_fail_pending");
    if (!f || !p)
        return 0; /* not something to provoke on a real GPU */
    memcpy(&fail_next, &f, sizeof f);
    memcpy(&pending, &p, sizeof p);
    static const struct {
        const char *call;
        int want;
    } cases[] = {
        {"cuStreamCreate", AXF_E_TRANSPORT}, {"cuEventCreate", AXF_OK},
        {"cuEventRecord", AXF_OK},           {"cuMemcpyAsync", AXF_E_TRANSPORT},
        {"cuMemHostRegister_v2", AXF_OK},
    };
    enum { LEN = 1 << 16 };
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, LEN, &g), AXF_OK);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tengine *t = t_engine(NULL);
        CHECK(t);
        char why[256];
        CHECK_EQ(axf_cuda_enable(t->e, why, sizeof why), AXF_OK);
        uint8_t *src = malloc(LEN), *dst = calloc(1, LEN);
        CHECK(src && dst);
        t_fill(src, LEN, (int)i + 3);
        uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
        uint64_t srid, skey, drid, dkey, grid, gkey, ep = 0;
        CHECK_EQ(axf_region_register(t->e, src, LEN, rw, -1, &srid, &skey), AXF_OK);
        CHECK_EQ(axf_region_register(t->e, dst, LEN, rw, -1, &drid, &dkey), AXF_OK);
        CHECK_EQ(axf_region_register_kind(t->e, AXF_MEM_CUDA, g, LEN, rw, -1, &grid, &gkey),
                 AXF_OK);
        CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
        CHECK_EQ(axf_endpoint_import_cuda(t->e, ep, grid, gkey, LEN, rw, g, NULL, 0, NULL),
                 AXF_OK);
        axf_desc w = {.lrid = srid, .rrid = grid, .rkey = gkey, .len = LEN};
        fail_next(cases[i].call, 2 /* CUDA_ERROR_OUT_OF_MEMORY */);
        int st = post_wait(t, ep, AXF_OP_WRITE, &w, 1, 1, cases[i].want);
        int missed = pending();
        fail_next(NULL, 0);
        printf("    %s failing: %s\n", cases[i].call, st ? "wrong status" : "ok");
        CHECK_EQ(st, 0);
        CHECK_EQ(missed, 0); /* the op did meet the failure */
        if (post_wait(t, ep, AXF_OP_WRITE, &w, 1, 2, AXF_OK))
            return 1;
        axf_desc r = {.lrid = drid, .rrid = grid, .rkey = gkey, .len = LEN};
        if (post_wait(t, ep, AXF_OP_READ, &r, 1, 3, AXF_OK))
            return 1;
        CHECK(memcmp(src, dst, LEN) == 0);
        t_close(t);
        free(src);
        free(dst);
    }
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    return 0;
}

/* ---------------------------------------------------------------- failures of axf_cuda_enable */

/* What the engine's thread creation and lock set-up do on the thread that
 * arms them: the N-th pthread_create fails (EAGAIN, as it does at the
 * process's thread limit), and mutex/condition inits and destroys are
 * counted. Defined here, they take the place of libc's for the engine
 * (linked statically into this program) and forward to the real ones. The
 * driver cannot make these fail; only the thread that calls enable counts,
 * so the driver's and the engine's other threads are untouched. */
static _Thread_local int create_fail_at, creates, mx_inits, mx_destroys, cv_inits, cv_destroys;
static _Thread_local bool counting;

#define REAL(name, type)                                                                   \
    static type real_;                                                                     \
    if (!real_) {                                                                          \
        void *p_ = t_next(name);                                                           \
        memcpy(&real_, &p_, sizeof p_);                                                    \
    }

typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg)
{
    REAL("pthread_create", create_fn);
    if (counting && ++creates == create_fail_at)
        return EAGAIN;
    return real_(t, a, fn, arg);
}

typedef int (*mx_init_fn)(pthread_mutex_t *, const pthread_mutexattr_t *);
int pthread_mutex_init(pthread_mutex_t *m, const pthread_mutexattr_t *a)
{
    REAL("pthread_mutex_init", mx_init_fn);
    mx_inits += counting;
    return real_(m, a);
}

typedef int (*mx_destroy_fn)(pthread_mutex_t *);
int pthread_mutex_destroy(pthread_mutex_t *m)
{
    REAL("pthread_mutex_destroy", mx_destroy_fn);
    mx_destroys += counting;
    return real_(m);
}

typedef int (*cv_init_fn)(pthread_cond_t *, const pthread_condattr_t *);
int pthread_cond_init(pthread_cond_t *c, const pthread_condattr_t *a)
{
    REAL("pthread_cond_init", cv_init_fn);
    cv_inits += counting;
    return real_(c, a);
}

typedef int (*cv_destroy_fn)(pthread_cond_t *);
int pthread_cond_destroy(pthread_cond_t *c)
{
    REAL("pthread_cond_destroy", cv_destroy_fn);
    cv_destroys += counting;
    return real_(c);
}
#undef REAL

/* Rule: an axf_cuda_enable that fails (its submit thread, then its wait
 * thread, not created) undoes all it set up: every mutex and condition it
 * initialised is destroyed, the engine is left without CUDA state, and a
 * later enable works and moves bytes. (Under ASan, LSan checks the rest.) */
static int test_enable_failure_undone(void)
{
    tengine *t = t_engine(NULL);
    CHECK(t);
    char why[256];
    for (int at = 1; at <= 2; at++) {
        creates = mx_inits = mx_destroys = cv_inits = cv_destroys = 0;
        create_fail_at = at;
        counting = true;
        int st = axf_cuda_enable(t->e, why, sizeof why);
        counting = false;
        printf("    thread %d not created: %d; mutexes %d made %d destroyed, conditions %d/%d\n",
               at, st, mx_inits, mx_destroys, cv_inits, cv_destroys);
        CHECK_EQ(st, AXF_E_NOMEM);
        CHECK_EQ(creates, at);
        CHECK(mx_inits > 0 && cv_inits > 0);
        CHECK_EQ(mx_destroys, mx_inits);
        CHECK_EQ(cv_destroys, cv_inits);
        /* No CUDA state left behind: an endpoint cannot open. */
        uint64_t ep = 0;
        CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_E_TRANSPORT);
    }
    CHECK_EQ(axf_cuda_enable(t->e, why, sizeof why), AXF_OK);
    uint64_t g = 0;
    CHECK_EQ(axf_cuda_alloc(0, 1 << 16, &g), AXF_OK);
    uint8_t *src = malloc(1 << 16), *dst = calloc(1, 1 << 16);
    CHECK(src && dst);
    t_fill(src, 1 << 16, 7);
    uint32_t rw = AXF_ACCESS_READ | AXF_ACCESS_WRITE;
    uint64_t srid, skey, grid, gkey, drid, dkey;
    CHECK_EQ(axf_region_register(t->e, src, 1 << 16, rw, -1, &srid, &skey), AXF_OK);
    CHECK_EQ(axf_region_register(t->e, dst, 1 << 16, rw, -1, &drid, &dkey), AXF_OK);
    CHECK_EQ(axf_region_register_kind(t->e, AXF_MEM_CUDA, g, 1 << 16, rw, -1, &grid, &gkey),
             AXF_OK);
    uint64_t ep = 0;
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_CUDA, 5, getpid(), -1, &ep), AXF_OK);
    CHECK_EQ(axf_endpoint_import_cuda(t->e, ep, grid, gkey, 1 << 16, rw, g, NULL, 0, NULL),
             AXF_OK);
    axf_desc w = {.lrid = srid, .rrid = grid, .rkey = gkey, .len = 1 << 16};
    if (post_wait(t, ep, AXF_OP_WRITE, &w, 1, 1, AXF_OK))
        return 1;
    axf_desc r = {.lrid = drid, .rrid = grid, .rkey = gkey, .len = 1 << 16};
    if (post_wait(t, ep, AXF_OP_READ, &r, 1, 2, AXF_OK))
        return 1;
    CHECK(memcmp(src, dst, 1 << 16) == 0);
    t_close(t);
    CHECK_EQ(axf_cuda_free(g), AXF_OK);
    free(src);
    free(dst);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--driver") == 0) {
        char why[256];
        int n = 0;
        if (axf_cuda_probe(why, sizeof why, &n) != AXF_OK) {
            printf("skipped: %s\n", why);
            return 77;
        }
        printf("%s\n", why);
        static const t_case gpu[] = {
            T_CASE(test_gpu_loopback),
            T_CASE(test_context_untouched),
            T_CASE(test_peer_host_memory_pinned),
            T_CASE(test_mixed_pinned_span),
            T_CASE(test_vmm_span),
            T_CASE(test_managed_refused),
            T_CASE(test_ipc_cross_device),
            T_CASE(test_pin_ahead),
            T_CASE(test_caller_submits),
            T_CASE(test_stop_waits_for_lone_poster),
            T_CASE(test_stop_races_lone_posts),
            T_CASE(test_app_context_destroyed),
            T_CASE(test_register_takes_active_primary),
            T_CASE(test_enable_failure_undone),
            T_CASE(test_wrapping_range_refused),
            T_CASE(test_driver_call_fails),
            T_CASE(test_sticky_error_latched), /* last: the process stays poisoned */
        };
        return T_RUN(argc - 1, argv + 1, gpu);
    }
    setenv("AIOXFER_CUDA_DRIVER", MISSING, 1);
    static const t_case cases[] = {
        T_CASE(test_probe_reports_why),
        T_CASE(test_enable_without_driver),
    };
    return T_RUN(argc, argv, cases);
}

/* CUDA support. Without arguments: the absent-driver path, on any machine (the
 * driver is pointed at a library that does not exist): every CUDA call answers
 * AXF_E_TRANSPORT with a reason, nothing hangs, the engine keeps working for
 * host memory. With --driver: the real driver (libcuda.so.1); exits 77 (meson's
 * "skipped") where there is none, else moves bytes host -> GPU -> GPU -> host
 * through a loopback AXF_EP_CUDA endpoint and checks bounds and keys. */
#include "harness.h"

#include <dlfcn.h>
#include <sys/socket.h>

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
        static const t_case gpu[] = {T_CASE(test_gpu_loopback)};
        return T_RUN(argc - 1, argv + 1, gpu);
    }
    setenv("AIOXFER_CUDA_DRIVER", MISSING, 1);
    static const t_case cases[] = {
        T_CASE(test_probe_reports_why),
        T_CASE(test_enable_without_driver),
    };
    return T_RUN(argc, argv, cases);
}

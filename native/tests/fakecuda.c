/* A software stand-in for the CUDA driver (the subset aioxfer's cuda.c calls),
 * so the GPU copy path runs where no GPU is: tests load it through
 * AIOXFER_CUDA_DRIVER=<path of this library>.
 *
 * It keeps the driver's semantics that the engine depends on, not its speed:
 * - "device memory" is a shared mapping of a memfd per allocation; a device
 *   pointer is its address, so copies between host and device are memcpy
 *   (unified addressing), and pointers outside allocations are host memory
 *   (cuPointerGetAttribute fails on them, as on unregistered host memory);
 * - streams are worker threads running copies in order, asynchronously to the
 *   caller; an event completes when the stream reaches it; cuEventSynchronize
 *   blocks on a condition variable;
 * - IPC handles name (pid, memfd) and open through /proc/<pid>/fd in another
 *   process; opening a handle of our own process, or one already open here,
 *   fails as the real driver does; a copy that runs past an allocation is a
 *   sticky error (CUDA_ERROR_ILLEGAL_ADDRESS) for every later call.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef struct {
    char reserved[64];
} CUipcMemHandle;
typedef struct {
    char bytes[16];
} CUuuid;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_ALREADY_MAPPED = 208,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_ILLEGAL_ADDRESS = 700,
};

#define EXPORT __attribute__((visibility("default")))

typedef struct alloc {
    uint64_t base, size;
    int fd;        /* ours: the memfd; imported: -1 */
    pid_t pid;     /* imported: the exporter and its fd number */
    int peer_fd;
    bool imported;
    struct alloc *next;
} alloc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static alloc *allocs;
static bool inited;
static _Atomic CUresult sticky; /* set by any stream thread */

static alloc *find(uint64_t p) /* mu held */
{
    for (alloc *a = allocs; a; a = a->next)
        if (p >= a->base && p < a->base + a->size)
            return a;
    return NULL;
}

/* Bounds of a device range (host memory is not checked: it is the caller's). */
static bool range_ok(uint64_t p, uint64_t n)
{
    pthread_mutex_lock(&mu);
    alloc *a = find(p);
    bool ok = !a || (n <= a->size && p - a->base <= a->size - n);
    pthread_mutex_unlock(&mu);
    return ok;
}

#define CHECK_INIT()             \
    do {                         \
        if (!inited)             \
            return E_NOT_INITIALIZED; \
        if (sticky)              \
            return sticky;       \
    } while (0)

EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags)
        return E_INVALID_VALUE;
    inited = true;
    return OK;
}

EXPORT CUresult cuDriverGetVersion(int *v)
{
    *v = 12040;
    return OK;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s)
{
    switch (r) {
    case OK: *s = "no error"; break;
    case E_INVALID_VALUE: *s = "invalid argument"; break;
    case E_OUT_OF_MEMORY: *s = "out of memory"; break;
    case E_NOT_INITIALIZED: *s = "initialization error"; break;
    case E_ALREADY_MAPPED: *s = "resource already mapped"; break;
    case E_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
    default: *s = "unknown error"; break;
    }
    return OK;
}

EXPORT CUresult cuDeviceGetCount(int *n)
{
    CHECK_INIT();
    *n = 1;
    return OK;
}

EXPORT CUresult cuDeviceGet(int *d, int ordinal)
{
    CHECK_INIT();
    if (ordinal != 0)
        return E_INVALID_DEVICE;
    *d = 0;
    return OK;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, int dev)
{
    CHECK_INIT();
    if (dev != 0 || len <= 0)
        return E_INVALID_VALUE;
    snprintf(name, (size_t)len, "aioxfer fake CUDA device");
    return OK;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, int dev)
{
    CHECK_INIT();
    if (dev != 0)
        return E_INVALID_DEVICE;
    memcpy(u->bytes, "aioxfer-fakecuda", 16);
    return OK;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    CHECK_INIT();
    if (dev != 0)
        return E_INVALID_DEVICE;
    *ctx = (void *)(uintptr_t)0xc0de;
    return OK;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int dev)
{
    return dev == 0 ? OK : E_INVALID_DEVICE;
}

EXPORT CUresult cuCtxSetCurrent(void *ctx)
{
    CHECK_INIT();
    return ctx == (void *)(uintptr_t)0xc0de || !ctx ? OK : E_INVALID_CONTEXT;
}

/* ---------------------------------------------------------------- memory */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    CHECK_INIT();
    if (!n)
        return E_INVALID_VALUE;
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0)
        return E_OUT_OF_MEMORY;
    void *m = MAP_FAILED;
    if (ftruncate(fd, (off_t)n) == 0)
        m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    alloc *a = calloc(1, sizeof *a);
    if (m == MAP_FAILED || !a) {
        if (m != MAP_FAILED)
            munmap(m, n);
        close(fd);
        free(a);
        return E_OUT_OF_MEMORY;
    }
    a->base = (uint64_t)(uintptr_t)m;
    a->size = n;
    a->fd = fd;
    pthread_mutex_lock(&mu);
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&mu);
    *p = a->base;
    return OK;
}

static alloc *unlink_base(uint64_t base, bool imported)
{
    pthread_mutex_lock(&mu);
    alloc **pp = &allocs;
    while (*pp && !((*pp)->base == base && (*pp)->imported == imported))
        pp = &(*pp)->next;
    alloc *a = *pp;
    if (a)
        *pp = a->next;
    pthread_mutex_unlock(&mu);
    return a;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    CHECK_INIT();
    alloc *a = unlink_base(p, false);
    if (!a)
        return E_INVALID_VALUE;
    munmap((void *)(uintptr_t)a->base, a->size);
    close(a->fd);
    free(a);
    return OK;
}

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    CHECK_INIT();
    pthread_mutex_lock(&mu);
    alloc *a = find(p);
    if (a) {
        if (base)
            *base = a->base;
        if (size)
            *size = a->size;
    }
    pthread_mutex_unlock(&mu);
    return a ? OK : E_NOT_FOUND;
}

EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p)
{
    CHECK_INIT();
    pthread_mutex_lock(&mu);
    alloc *a = find(p);
    pthread_mutex_unlock(&mu);
    if (!a)
        return E_INVALID_VALUE; /* unregistered host memory */
    if (attr == 2) /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */
        *(int *)data = 2; /* CU_MEMORYTYPE_DEVICE */
    else if (attr == 9) /* CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL */
        *(int *)data = 0;
    else
        return E_INVALID_VALUE;
    return OK;
}

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CHECK_INIT();
    if (!range_ok(dst, n) || !range_ok(src, n)) {
        sticky = E_ILLEGAL_ADDRESS;
        return sticky;
    }
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return OK;
}

/* Page-locked host ranges: registering one twice, or unregistering one that
 * is not, fails as in the driver (712 / 713). */
typedef struct pinned {
    void *p;
    size_t n;
    struct pinned *next;
} pinned;
static pinned *pins;

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags)
{
    CHECK_INIT();
    (void)flags;
    if (!p || !n)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (pinned *q = pins; q; q = q->next)
        if ((char *)p < (char *)q->p + q->n && (char *)q->p < (char *)p + n) {
            pthread_mutex_unlock(&mu);
            return 712; /* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
        }
    pinned *q = calloc(1, sizeof *q);
    if (q) {
        q->p = p;
        q->n = n;
        q->next = pins;
        pins = q;
    }
    pthread_mutex_unlock(&mu);
    return q ? OK : E_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemHostUnregister(void *p)
{
    CHECK_INIT();
    pthread_mutex_lock(&mu);
    pinned **pp = &pins;
    while (*pp && (*pp)->p != p)
        pp = &(*pp)->next;
    pinned *q = *pp;
    if (q)
        *pp = q->next;
    pthread_mutex_unlock(&mu);
    free(q);
    return q ? OK : 713; /* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
}

/* Test hook: how many host ranges are page-locked now. */
EXPORT int fakecuda_pinned_count(void)
{
    int n = 0;
    pthread_mutex_lock(&mu);
    for (pinned *q = pins; q; q = q->next)
        n++;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Test hook: how many peer allocations are open here by IPC now. */
EXPORT int fakecuda_ipc_open_count(void)
{
    int n = 0;
    pthread_mutex_lock(&mu);
    for (alloc *a = allocs; a; a = a->next)
        n += a->imported;
    pthread_mutex_unlock(&mu);
    return n;
}

/* ---------------------------------------------------------------- IPC */

typedef struct {
    char magic[8];
    int32_t pid, fd;
    uint64_t size;
} fake_handle;

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
    CHECK_INIT();
    pthread_mutex_lock(&mu);
    alloc *a = find(p);
    fake_handle fh = {.magic = "AXFFAKE"};
    bool ok = a && a->base == p && !a->imported;
    if (ok) {
        fh.pid = (int32_t)getpid();
        fh.fd = a->fd;
        fh.size = a->size;
    }
    pthread_mutex_unlock(&mu);
    if (!ok)
        return E_INVALID_VALUE;
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &fh, sizeof fh);
    return OK;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags)
{
    CHECK_INIT();
    (void)flags;
    fake_handle fh;
    memcpy(&fh, h.reserved, sizeof fh);
    if (memcmp(fh.magic, "AXFFAKE", 8) != 0 || !fh.size)
        return E_INVALID_VALUE;
    if (fh.pid == (int32_t)getpid())
        return E_INVALID_CONTEXT; /* the real driver refuses our own handles too */
    pthread_mutex_lock(&mu);
    for (alloc *a = allocs; a; a = a->next)
        if (a->imported && a->pid == fh.pid && a->peer_fd == fh.fd) {
            pthread_mutex_unlock(&mu);
            return E_ALREADY_MAPPED;
        }
    pthread_mutex_unlock(&mu);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)fh.pid, (int)fh.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return E_INVALID_VALUE;
    void *m = mmap(NULL, fh.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    alloc *a = calloc(1, sizeof *a);
    if (m == MAP_FAILED || !a) {
        if (m != MAP_FAILED)
            munmap(m, fh.size);
        free(a);
        return E_OUT_OF_MEMORY;
    }
    a->base = (uint64_t)(uintptr_t)m;
    a->size = fh.size;
    a->fd = -1;
    a->pid = fh.pid;
    a->peer_fd = fh.fd;
    a->imported = true;
    pthread_mutex_lock(&mu);
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&mu);
    *p = a->base;
    return OK;
}

EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags)
{
    return cuIpcOpenMemHandle_v2(p, h, flags);
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
    CHECK_INIT();
    alloc *a = unlink_base(p, true);
    if (!a)
        return E_INVALID_VALUE;
    munmap((void *)(uintptr_t)a->base, a->size);
    free(a);
    return OK;
}

/* ---------------------------------------------------------------- streams, events */

typedef struct event {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned pending; /* records not reached yet */
} event;

typedef struct item {
    uint64_t dst, src, n; /* a copy, or (ev) an event record */
    event *ev;
    struct item *next;
} item;

typedef struct stream {
    pthread_mutex_t mu;
    pthread_cond_t cv, idle;
    item *head, *tail;
    bool stop, busy;
    pthread_t th;
} stream;

static void *stream_main(void *arg)
{
    stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        item *it = s->head;
        if (!it)
            break;
        s->head = it->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = true;
        pthread_mutex_unlock(&s->mu);
        if (it->ev) {
            pthread_mutex_lock(&it->ev->mu);
            it->ev->pending--;
            pthread_cond_broadcast(&it->ev->cv);
            pthread_mutex_unlock(&it->ev->mu);
        } else if (!sticky) {
            if (range_ok(it->dst, it->n) && range_ok(it->src, it->n))
                memcpy((void *)(uintptr_t)it->dst, (const void *)(uintptr_t)it->src, it->n);
            else
                sticky = E_ILLEGAL_ADDRESS;
        }
        free(it);
        pthread_mutex_lock(&s->mu);
        s->busy = false;
        if (!s->head)
            pthread_cond_broadcast(&s->idle);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

EXPORT CUresult cuStreamCreate(void **out, unsigned int flags)
{
    CHECK_INIT();
    (void)flags;
    stream *s = calloc(1, sizeof *s);
    if (!s)
        return E_OUT_OF_MEMORY;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->idle, NULL);
    if (pthread_create(&s->th, NULL, stream_main, s) != 0) {
        free(s);
        return E_OUT_OF_MEMORY;
    }
    *out = s;
    return OK;
}

static CUresult push(stream *s, item *it)
{
    if (!s)
        return E_INVALID_VALUE; /* no legacy default stream here */
    pthread_mutex_lock(&s->mu);
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return OK;
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *hs)
{
    CHECK_INIT();
    item *it = calloc(1, sizeof *it);
    if (!it)
        return E_OUT_OF_MEMORY;
    it->dst = dst;
    it->src = src;
    it->n = n;
    CUresult r = push(hs, it);
    if (r != OK)
        free(it);
    return r;
}

EXPORT CUresult cuStreamSynchronize(void *hs)
{
    stream *s = hs;
    if (!s)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy)
        pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return sticky;
}

EXPORT CUresult cuStreamDestroy_v2(void *hs)
{
    stream *s = hs;
    if (!s)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL); /* runs what is queued first */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->idle);
    free(s);
    return OK;
}

EXPORT CUresult cuEventCreate(void **out, unsigned int flags)
{
    CHECK_INIT();
    (void)flags;
    event *e = calloc(1, sizeof *e);
    if (!e)
        return E_OUT_OF_MEMORY;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    *out = e;
    return OK;
}

EXPORT CUresult cuEventRecord(void *he, void *hs)
{
    CHECK_INIT();
    event *e = he;
    item *it = calloc(1, sizeof *it);
    if (!it)
        return E_OUT_OF_MEMORY;
    it->ev = e;
    pthread_mutex_lock(&e->mu);
    e->pending++;
    pthread_mutex_unlock(&e->mu);
    CUresult r = push(hs, it);
    if (r != OK) {
        pthread_mutex_lock(&e->mu);
        e->pending--;
        pthread_mutex_unlock(&e->mu);
        free(it);
    }
    return r;
}

EXPORT CUresult cuEventSynchronize(void *he)
{
    event *e = he;
    pthread_mutex_lock(&e->mu);
    while (e->pending)
        pthread_cond_wait(&e->cv, &e->mu); /* blocking sync: sleeps */
    pthread_mutex_unlock(&e->mu);
    return sticky;
}

EXPORT CUresult cuEventQuery(void *he)
{
    event *e = he;
    pthread_mutex_lock(&e->mu);
    unsigned p = e->pending;
    pthread_mutex_unlock(&e->mu);
    return sticky ? sticky : p ? E_NOT_READY : OK;
}

EXPORT CUresult cuEventDestroy_v2(void *he)
{
    event *e = he;
    /* The driver defers the release of an event still pending; so do we. */
    cuEventSynchronize(e);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
    return OK;
}

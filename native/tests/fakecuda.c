/* A software stand-in for the CUDA driver (the subset aioxfer's cuda.c calls),
 * so the GPU copy path runs where no GPU is: tests load it through
 * AIOXFER_CUDA_DRIVER=<path of this library>.
 *
 * It keeps the driver's rules that the engine depends on, not its speed. Each
 * rule below is one the real driver enforces (CUDA Driver API reference) and
 * that a test in native/tests/test_cuda.c or tests/test_cuda.py exercises:
 *
 * - Devices: FAKECUDA_DEVICES of them (default 2, 1..8), each with its own
 *   primary context, retained and released with a count; a released (count
 *   0) primary context is inactive and every call made in it fails
 *   CUDA_ERROR_INVALID_CONTEXT. Each thread has a real context stack
 *   (cuCtxPushCurrent / cuCtxPopCurrent / cuCtxSetCurrent replaces the top /
 *   cuCtxGetCurrent); calls that need a context (allocation, streams, events,
 *   copies, IPC open, host registration, cuMemGetAddressRange) fail
 *   CUDA_ERROR_INVALID_CONTEXT without one. cuPointerGetAttribute needs none
 *   (unified addressing). fakecuda_ctx_current / fakecuda_primary_refs let a
 *   test check that a library left the caller's context and the devices'
 *   primary contexts as it found them.
 * - Contexts of the application's own (cuCtxCreate, pushed current as the
 *   real call does): cuCtxDestroy frees what was made in it (its device
 *   memory, the IPC mappings opened into it, its host registrations) and
 *   leaves its streams and events refusing work: a copy, an event record or
 *   query there, or any call made with it current, fails
 *   CUDA_ERROR_INVALID_CONTEXT. Destroyed handles are never reused, so a
 *   library that kept one finds it dead rather than someone else's.
 * - Device memory is NOT CPU-accessible: an allocation is a memfd mapped twice,
 *   once PROT_NONE at the "device address" (a CPU load or store there faults,
 *   as on a real GPU's unified address space) and once read-write for this
 *   library's own copies. A NIC reaches it only through a dmabuf.
 * - cuMemGetHandleForAddressRange (dmabuf export) refuses a range whose address
 *   or size is not host-page aligned (CUDA_ERROR_INVALID_VALUE), and devices
 *   report CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (0 with FAKECUDA_NO_DMABUF=1,
 *   and then the export fails CUDA_ERROR_NOT_SUPPORTED). The fd is a fresh open
 *   of the allocation's memfd whose file position is where the exported range
 *   starts in it (the convention softverbs' reg_dmabuf_mr reads).
 * - Peer access: memory is reachable from a context of its own device; from
 *   another device's context only once cuCtxEnablePeerAccess made it so. An IPC
 *   handle opens into the CURRENT context (once per device and exporter, as the
 *   real driver allows); with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS the mapping is
 *   reachable from that context whatever device owns the memory. A copy on a
 *   stream (or in a context) that cannot reach one of its operands fails
 *   CUDA_ERROR_INVALID_VALUE when enqueued.
 * - Host memory: a copy from or to host memory registered with
 *   cuMemHostRegister is asynchronous; one touching pageable (unregistered)
 *   host memory runs synchronously in the caller, after the stream's earlier
 *   work (counted: fakecuda_sync_copies); a host range partly registered and
 *   partly not fails CUDA_ERROR_INVALID_VALUE. Registering a read-only
 *   mapping needs CU_MEMHOSTREGISTER_READ_ONLY; overlapping registrations fail
 *   712 and unregistering what is not registered 713.
 * - VMM (fakecuda_alloc_vmm: cuMemAddressReserve + cuMemCreate + cuMemMap of
 *   several chunks): cuMemGetAddressRange and the RANGE_START_ADDR / RANGE_SIZE
 *   attributes describe the one chunk a pointer falls in, legacy IPC is
 *   refused, IS_LEGACY_CUDA_IPC_CAPABLE is 0. Managed memory
 *   (cuMemAllocManaged) is CPU-accessible, reports memory type DEVICE and
 *   IS_MANAGED 1, and has no IPC handle.
 * - Streams are worker threads running copies in order; an event completes when
 *   its stream reaches it (FAKECUDA_EVENT_DELAY_US: that long after, as a GPU
 *   copy takes a while, so that cuEventQuery answers CUDA_ERROR_NOT_READY
 *   first). Events are process-wide: queried and waited on from any thread,
 *   with or without a current context. A copy that runs past an allocation is
 *   a sticky error (CUDA_ERROR_ILLEGAL_ADDRESS) for every later call.
 *   Counted for tests (what a GPU costs in wake-ups, not in time):
 *   fakecuda_event_sleeps (cuEventSynchronize calls that found their event
 *   pending: the caller slept, to be woken by the driver's interrupt),
 *   fakecuda_event_queries (cuEventQuery calls), fakecuda_event_creates
 *   (cuEventCreate calls that made one), fakecuda_copy_tid (the
 *   kernel thread id of the last cuMemcpyAsync's caller), fakecuda_query_tid
 *   (of the last cuEventQuery's that found its event reached).
 * - Faults on demand: fakecuda_fail_next_call(name, r) makes the next call of
 *   the driver function `name` (cuStreamCreate, cuEventCreate, cuEventRecord,
 *   cuMemcpyAsync, cuMemHostRegister_v2), from any thread, fail with r and
 *   do nothing, as the real one does when it runs out of resources.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
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
    E_PEER_ACCESS_UNSUPPORTED = 217,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_ILLEGAL_ADDRESS = 700,
    E_PEER_ACCESS_ALREADY_ENABLED = 704,
    E_HOST_ALREADY_REGISTERED = 712,
    E_HOST_NOT_REGISTERED = 713,
    E_NOT_SUPPORTED = 801,
};

enum {
    ATTR_CONTEXT = 1,
    ATTR_MEMORY_TYPE = 2,
    ATTR_IS_MANAGED = 8,
    ATTR_DEVICE_ORDINAL = 9,
    ATTR_IS_LEGACY_IPC = 10,
    ATTR_RANGE_START = 11,
    ATTR_RANGE_SIZE = 12,
    ATTR_MAPPED = 13,
    MEMORYTYPE_DEVICE = 2,
    DEV_ATTR_PCI_BUS_ID = 33,
    DEV_ATTR_PCI_DEVICE_ID = 34,
    DEV_ATTR_UNIFIED_ADDRESSING = 41,
    DEV_ATTR_PCI_DOMAIN_ID = 50,
    DEV_ATTR_DMA_BUF_SUPPORTED = 124,
    HOSTREGISTER_READ_ONLY = 0x08,
    IPC_LAZY_ENABLE_PEER_ACCESS = 0x1,
};

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 8
#define STACK 16

/* A context: a device's primary one (refs: how often retained), or one
 * made by cuCtxCreate (refs 1 until cuCtxDestroy). Handles stay valid
 * (never freed or reused); one with no refs (an inactive primary context, a
 * destroyed one) refuses work. */
typedef struct fctx {
    int dev;
    int refs; /* mu */
} fctx;

typedef struct alloc {
    uint64_t base, size; /* the device address range (PROT_NONE, or RW if managed) */
    uint8_t *shadow;     /* our read-write view of the same memory */
    int fd;              /* ours: the memfd; imported: -1 */
    int dev;             /* the device the memory lives on */
    fctx *ctx;           /* the context it was allocated in / opened into */
    pid_t pid;           /* imported: the exporter and its fd number */
    int peer_fd;
    bool imported, managed, vmm, lazy_peer;
    struct alloc *next;
} alloc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static alloc *allocs;
static bool inited;
static int ndev = 2;
static bool no_dmabuf, no_p2p;
static fctx primary[MAX_DEV];
#define MAX_CREATED 64
static fctx created[MAX_CREATED]; /* cuCtxCreate's, in order; mu */
static int ncreated;
static bool peer_on[MAX_DEV][MAX_DEV]; /* [from][to]: contexts of `from` reach `to`'s memory */
static _Atomic CUresult sticky;        /* set by any stream thread */
static _Atomic int sync_copies;
static _Atomic unsigned event_delay_us; /* FAKECUDA_EVENT_DELAY_US */
static _Atomic int event_sleeps, event_queries, event_creates;
static _Atomic long copy_tid, query_tid;
static _Atomic CUresult query_error; /* fakecuda_fail_next_query */
/* fakecuda_fail_next_call: the function's name and what it returns once */
static pthread_mutex_t fail_mu = PTHREAD_MUTEX_INITIALIZER;
static char fail_name[40];
static CUresult fail_result;
/* fakecuda_gate_error_text: cuGetErrorString waits while the gate is shut */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_shut;
static _Atomic int gate_waiters;
static _Thread_local fctx *stack[STACK];
static _Thread_local int depth;

static size_t page_size(void)
{
    return (size_t)sysconf(_SC_PAGESIZE);
}

static fctx *current(void)
{
    return depth ? stack[depth - 1] : NULL;
}

/* The current context, usable: 0, or why not. */
static CUresult need_ctx(fctx **out)
{
    fctx *c = current();
    if (!c)
        return E_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    int refs = c->refs;
    pthread_mutex_unlock(&mu);
    if (refs <= 0)
        return E_INVALID_CONTEXT; /* a released primary context, a destroyed one */
    *out = c;
    return OK;
}

static alloc *find(uint64_t p) /* mu held */
{
    for (alloc *a = allocs; a; a = a->next)
        if (p >= a->base && p < a->base + a->size)
            return a;
    return NULL;
}

/* What the call `name` returns instead of running: once, when armed. */
static CUresult injected(const char *name)
{
    CUresult r = OK;
    pthread_mutex_lock(&fail_mu);
    if (fail_name[0] && strcmp(fail_name, name) == 0) {
        r = fail_result;
        fail_name[0] = 0;
    }
    pthread_mutex_unlock(&fail_mu);
    return r;
}

#define INJECTED(name)                  \
    do {                                \
        CUresult f_ = injected(name);   \
        if (f_ != OK)                   \
            return f_;                  \
    } while (0)

#define CHECK_INIT()                  \
    do {                              \
        if (!inited)                  \
            return E_NOT_INITIALIZED; \
        if (sticky)                   \
            return sticky;            \
    } while (0)

#define NEED_CTX(c)                      \
    fctx *c = NULL;                      \
    do {                                 \
        CUresult r_ = need_ctx(&c);      \
        if (r_ != OK)                    \
            return r_;                   \
    } while (0)

EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!inited) {
        const char *n = getenv("FAKECUDA_DEVICES");
        if (n && atoi(n) >= 1 && atoi(n) <= MAX_DEV)
            ndev = atoi(n);
        const char *ed = getenv("FAKECUDA_EVENT_DELAY_US");
        if (ed && atoi(ed) > 0 && atoi(ed) <= 1000000)
            event_delay_us = (unsigned)atoi(ed);
        const char *d = getenv("FAKECUDA_NO_DMABUF");
        no_dmabuf = d && *d == '1';
        const char *p = getenv("FAKECUDA_NO_P2P");
        no_p2p = p && *p == '1';
        for (int i = 0; i < MAX_DEV; i++)
            primary[i].dev = i;
        inited = true;
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

EXPORT CUresult cuDriverGetVersion(int *v)
{
    *v = 12040;
    return OK;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s)
{
    pthread_mutex_lock(&gate_mu);
    if (gate_shut) {
        gate_waiters++;
        while (gate_shut)
            pthread_cond_wait(&gate_cv, &gate_mu);
        gate_waiters--;
    }
    pthread_mutex_unlock(&gate_mu);
    switch (r) {
    case OK: *s = "no error"; break;
    case E_INVALID_VALUE: *s = "invalid argument"; break;
    case E_OUT_OF_MEMORY: *s = "out of memory"; break;
    case E_NOT_INITIALIZED: *s = "initialization error"; break;
    case E_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case E_INVALID_CONTEXT: *s = "invalid device context"; break;
    case E_ALREADY_MAPPED: *s = "resource already mapped"; break;
    case E_PEER_ACCESS_UNSUPPORTED: *s = "peer access is not supported between these two devices"; break;
    case E_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
    case E_PEER_ACCESS_ALREADY_ENABLED: *s = "peer access is already enabled"; break;
    case E_HOST_ALREADY_REGISTERED: *s = "part or all of the requested memory range is already mapped"; break;
    case E_HOST_NOT_REGISTERED: *s = "pointer does not correspond to a registered memory region"; break;
    case E_NOT_SUPPORTED: *s = "operation not supported"; break;
    default: *s = NULL; return E_INVALID_VALUE;
    }
    return OK;
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **s)
{
    switch (r) {
    case OK: *s = "CUDA_SUCCESS"; break;
    case E_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case E_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case E_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case E_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case E_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; break;
    }
    return OK;
}

EXPORT CUresult cuDeviceGetCount(int *n)
{
    CHECK_INIT();
    *n = ndev;
    return OK;
}

EXPORT CUresult cuDeviceGet(int *d, int ordinal)
{
    CHECK_INIT();
    if (ordinal < 0 || ordinal >= ndev)
        return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, int dev)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev || len <= 0)
        return E_INVALID_VALUE;
    snprintf(name, (size_t)len, "aioxfer fake CUDA device %d", dev);
    return OK;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, int dev)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    memcpy(u->bytes, "aioxfer-fakecud", 15);
    u->bytes[15] = (char)('0' + dev);
    return OK;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, int dev)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    switch (attr) {
    case DEV_ATTR_DMA_BUF_SUPPORTED: *v = !no_dmabuf; break;
    case DEV_ATTR_UNIFIED_ADDRESSING: *v = 1; break;
    case DEV_ATTR_PCI_BUS_ID: *v = 0x17 + dev * 0x20; break;
    case DEV_ATTR_PCI_DEVICE_ID: *v = 0; break;
    case DEV_ATTR_PCI_DOMAIN_ID: *v = 0; break;
    default: *v = 0; break;
    }
    return OK;
}

EXPORT CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev || peer < 0 || peer >= ndev)
        return E_INVALID_DEVICE;
    *can = dev != peer && !no_p2p;
    return OK;
}

/* ---------------------------------------------------------------- contexts */

EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    primary[dev].refs++;
    pthread_mutex_unlock(&mu);
    *ctx = &primary[dev];
    return OK;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int dev)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    CUresult r = primary[dev].refs > 0 ? OK : E_INVALID_CONTEXT;
    if (r == OK && --primary[dev].refs == 0)
        for (int i = 0; i < MAX_DEV; i++)
            peer_on[dev][i] = false; /* an inactive context forgets its peers */
    pthread_mutex_unlock(&mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxGetState(int dev, unsigned int *flags, int *active)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    *active = primary[dev].refs > 0;
    pthread_mutex_unlock(&mu);
    *flags = 0;
    return OK;
}

static bool ctx_valid(const void *c)
{
    const fctx *f = c;
    if (f >= primary && f < primary + ndev)
        return true;
    pthread_mutex_lock(&mu);
    bool made = f >= created && f < created + ncreated;
    pthread_mutex_unlock(&mu);
    return made;
}

/* Whether context c may have work done in it (refs: mu). */
static bool ctx_alive(fctx *c)
{
    pthread_mutex_lock(&mu);
    bool alive = c && c->refs > 0;
    pthread_mutex_unlock(&mu);
    return alive;
}

EXPORT CUresult cuCtxGetCurrent(void **ctx)
{
    CHECK_INIT();
    *ctx = current();
    return OK;
}

EXPORT CUresult cuCtxSetCurrent(void *ctx)
{
    CHECK_INIT();
    if (ctx && !ctx_valid(ctx))
        return E_INVALID_CONTEXT;
    if (!ctx) { /* pops the top, or nothing on an empty stack */
        if (depth)
            depth--;
        return OK;
    }
    if (!depth)
        depth = 1;
    stack[depth - 1] = ctx;
    return OK;
}

EXPORT CUresult cuCtxPushCurrent_v2(void *ctx)
{
    CHECK_INIT();
    if (!ctx || !ctx_valid(ctx))
        return E_INVALID_CONTEXT;
    if (depth == STACK)
        return E_OUT_OF_MEMORY;
    stack[depth++] = ctx;
    return OK;
}

EXPORT CUresult cuCtxPopCurrent_v2(void **ctx)
{
    CHECK_INIT();
    if (!depth)
        return E_INVALID_CONTEXT;
    fctx *c = stack[--depth];
    if (ctx)
        *ctx = c;
    return OK;
}

/* An application's own context on dev, made current (pushed) on the calling
 * thread, as the real call does. */
EXPORT CUresult cuCtxCreate_v2(void **out, unsigned int flags, int dev)
{
    CHECK_INIT();
    (void)flags;
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    if (depth == STACK)
        return E_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    fctx *c = ncreated < MAX_CREATED ? &created[ncreated++] : NULL;
    if (c) {
        c->dev = dev;
        c->refs = 1;
    }
    pthread_mutex_unlock(&mu);
    if (!c)
        return E_OUT_OF_MEMORY;
    stack[depth++] = c;
    *out = c;
    return OK;
}

EXPORT CUresult cuCtxGetDevice(int *dev)
{
    CHECK_INIT();
    NEED_CTX(c);
    *dev = c->dev;
    return OK;
}

EXPORT CUresult cuCtxSynchronize(void)
{
    CHECK_INIT();
    NEED_CTX(c);
    (void)c;
    return OK;
}

EXPORT CUresult cuCtxEnablePeerAccess(void *peer, unsigned int flags)
{
    CHECK_INIT();
    NEED_CTX(c);
    if (flags || !peer || !ctx_valid(peer))
        return E_INVALID_VALUE;
    fctx *p = peer;
    if (p->dev == c->dev || no_p2p)
        return E_PEER_ACCESS_UNSUPPORTED;
    pthread_mutex_lock(&mu);
    CUresult r = p->refs <= 0 ? E_INVALID_CONTEXT
                 : peer_on[c->dev][p->dev] ? E_PEER_ACCESS_ALREADY_ENABLED
                                           : OK;
    if (r == OK)
        peer_on[c->dev][p->dev] = true;
    pthread_mutex_unlock(&mu);
    return r;
}

/* Test hooks: the calling thread's current context and stack depth; how many
 * times device dev's primary context is retained (0: inactive). */
EXPORT void *fakecuda_ctx_current(void)
{
    return current();
}

EXPORT int fakecuda_ctx_depth(void)
{
    return depth;
}

EXPORT int fakecuda_primary_refs(int dev)
{
    if (dev < 0 || dev >= MAX_DEV)
        return -1;
    pthread_mutex_lock(&mu);
    int n = primary[dev].refs;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT int fakecuda_sync_copies(void)
{
    return sync_copies;
}

EXPORT int fakecuda_event_sleeps(void)
{
    return event_sleeps;
}

EXPORT int fakecuda_event_queries(void)
{
    return event_queries;
}

EXPORT int fakecuda_event_creates(void)
{
    return event_creates;
}

EXPORT long fakecuda_copy_tid(void)
{
    return copy_tid;
}

EXPORT long fakecuda_query_tid(void)
{
    return query_tid;
}

/* As FAKECUDA_EVENT_DELAY_US, from now on (a test's own). */
EXPORT void fakecuda_set_event_delay_us(unsigned us)
{
    event_delay_us = us;
}

/* The next cuEventQuery (any event, any thread) returns r instead of the
 * event's state: an event that ended in an error. */
EXPORT void fakecuda_fail_next_query(int r)
{
    query_error = r;
}

/* The next call of driver function `name` fails with r (0: disarms). */
EXPORT void fakecuda_fail_next_call(const char *name, int r)
{
    pthread_mutex_lock(&fail_mu);
    snprintf(fail_name, sizeof fail_name, "%s", r && name ? name : "");
    fail_result = r;
    pthread_mutex_unlock(&fail_mu);
}

/* Whether the armed failure is still to happen. */
EXPORT int fakecuda_fail_pending(void)
{
    pthread_mutex_lock(&fail_mu);
    int armed = fail_name[0] != 0;
    pthread_mutex_unlock(&fail_mu);
    return armed;
}

/* Shut: every cuGetErrorString waits until it opens again (a test holds a
 * thread that reports an error at that point). */
EXPORT void fakecuda_gate_error_text(int shut)
{
    pthread_mutex_lock(&gate_mu);
    gate_shut = shut != 0;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

/* Threads waiting at the shut gate. */
EXPORT int fakecuda_gate_waiters(void)
{
    return gate_waiters;
}

/* ---------------------------------------------------------------- memory */

/* memfd + a device-address view (PROT_NONE: the CPU faults on it, unless
 * managed) + our read-write view. At `at` and `shadow_at` (MAP_FIXED) when
 * given. */
static alloc *alloc_new(int fd, uint64_t fd_off, uint64_t n, bool cpu_access, void *at,
                        void *shadow_at)
{
    alloc *a = calloc(1, sizeof *a);
    if (!a)
        return NULL;
    void *dv = mmap(at, n, cpu_access ? PROT_READ | PROT_WRITE : PROT_NONE,
                    MAP_SHARED | (at ? MAP_FIXED : 0), fd, (off_t)fd_off);
    void *sh = mmap(shadow_at, n, PROT_READ | PROT_WRITE, MAP_SHARED | (shadow_at ? MAP_FIXED : 0),
                    fd, (off_t)fd_off);
    if (dv == MAP_FAILED || sh == MAP_FAILED) {
        if (dv != MAP_FAILED && !at)
            munmap(dv, n);
        if (sh != MAP_FAILED)
            munmap(sh, n);
        free(a);
        return NULL;
    }
    a->base = (uint64_t)(uintptr_t)dv;
    a->size = n;
    a->shadow = sh;
    a->fd = -1;
    return a;
}

static void alloc_link(alloc *a)
{
    pthread_mutex_lock(&mu);
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&mu);
}

/* cuMemAlloc hands out device addresses back to back from one arena, as the
 * real driver does (seen on an H200: two cuMemAlloc allocations adjacent), so
 * a range running past one allocation can land inside the next one. The arena
 * is reserved PROT_NONE and never reused (a freed range stays reserved). */
static uint8_t *arena_next, *arena_end;

static void *arena_take(size_t n)
{
    size_t len = (n + page_size() - 1) / page_size() * page_size();
    void *at = NULL;
    pthread_mutex_lock(&mu);
    if (!arena_next) {
        size_t sz = (size_t)1 << 40;
        void *va = mmap(NULL, sz, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (va != MAP_FAILED) {
            arena_next = va;
            arena_end = arena_next + sz;
        }
    }
    if (arena_next && (size_t)(arena_end - arena_next) >= len) {
        at = arena_next;
        arena_next += len;
    }
    pthread_mutex_unlock(&mu);
    return at;
}

static CUresult alloc_common(CUdeviceptr *p, size_t n, bool managed)
{
    CHECK_INIT();
    NEED_CTX(c);
    if (!n)
        return E_INVALID_VALUE;
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0)
        return E_OUT_OF_MEMORY;
    void *at = managed ? NULL : arena_take(n);
    alloc *a = ftruncate(fd, (off_t)n) == 0 ? alloc_new(fd, 0, n, managed, at, NULL) : NULL;
    if (!a) {
        close(fd);
        return E_OUT_OF_MEMORY;
    }
    a->fd = fd;
    a->dev = c->dev;
    a->ctx = c;
    a->managed = managed;
    alloc_link(a);
    *p = a->base;
    return OK;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    return alloc_common(p, n, false);
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int flags)
{
    (void)flags;
    return alloc_common(p, n, true);
}

static void alloc_unmap(alloc *a, bool keep_va)
{
    if (keep_va) /* a VMM chunk or an arena range: the reservation stays, inaccessible */
        mmap((void *)(uintptr_t)a->base, a->size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    else
        munmap((void *)(uintptr_t)a->base, a->size);
    munmap(a->shadow, a->size);
    if (a->fd >= 0)
        close(a->fd);
    free(a);
}

static alloc *unlink_base(uint64_t base, bool imported, bool vmm)
{
    pthread_mutex_lock(&mu);
    alloc **pp = &allocs;
    while (*pp && !((*pp)->base == base && (*pp)->imported == imported && (*pp)->vmm == vmm))
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
    alloc *a = unlink_base(p, false, false); /* VMM memory is unmapped, never freed */
    if (!a)
        return E_INVALID_VALUE;
    alloc_unmap(a, !a->managed); /* device memory: its arena range stays reserved */
    return OK;
}

/* Test hook: a VMM-style mapping (cuMemAddressReserve, then nchunks
 * cuMemCreate + cuMemMap of chunk bytes each, back to back) on device dev. */
EXPORT CUresult fakecuda_alloc_vmm(int dev, size_t chunk, int nchunks, CUdeviceptr *p)
{
    CHECK_INIT();
    if (dev < 0 || dev >= ndev || !chunk || nchunks <= 0 || chunk % page_size())
        return E_INVALID_VALUE;
    size_t total = chunk * (size_t)nchunks;
    /* The chunks are contiguous in the device address space, so one copy may
     * span them; our views of them are laid out the same way. */
    void *va = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void *sh = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (va == MAP_FAILED || sh == MAP_FAILED)
        return E_OUT_OF_MEMORY;
    for (int i = 0; i < nchunks; i++) {
        int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
        alloc *a = fd >= 0 && ftruncate(fd, (off_t)chunk) == 0
                       ? alloc_new(fd, 0, chunk, false, (uint8_t *)va + (size_t)i * chunk,
                                   (uint8_t *)sh + (size_t)i * chunk)
                       : NULL;
        if (!a) {
            if (fd >= 0)
                close(fd);
            return E_OUT_OF_MEMORY; /* a test fixture: what was mapped stays */
        }
        a->fd = fd;
        a->dev = dev;
        a->ctx = &primary[dev];
        a->vmm = true;
        alloc_link(a);
    }
    *p = (CUdeviceptr)(uintptr_t)va;
    return OK;
}

EXPORT CUresult fakecuda_free_vmm(CUdeviceptr p, size_t chunk, int nchunks)
{
    for (int i = 0; i < nchunks; i++) {
        alloc *a = unlink_base(p + (uint64_t)i * chunk, false, true);
        if (a)
            alloc_unmap(a, true);
    }
    munmap((void *)(uintptr_t)p, chunk * (size_t)nchunks);
    return OK;
}

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    CHECK_INIT();
    NEED_CTX(c);
    (void)c;
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
    alloc copy = a ? *a : (alloc){0};
    pthread_mutex_unlock(&mu);
    if (!a)
        return E_INVALID_VALUE; /* unregistered host memory */
    switch (attr) {
    case ATTR_CONTEXT: *(void **)data = copy.ctx; break;
    case ATTR_MEMORY_TYPE: *(int *)data = MEMORYTYPE_DEVICE; break;
    case ATTR_IS_MANAGED: *(int *)data = copy.managed; break;
    case ATTR_DEVICE_ORDINAL: *(int *)data = copy.dev; break;
    case ATTR_IS_LEGACY_IPC: *(int *)data = !copy.vmm && !copy.managed && !copy.imported; break;
    case ATTR_RANGE_START: *(CUdeviceptr *)data = copy.base; break;
    case ATTR_RANGE_SIZE: *(size_t *)data = copy.size; break;
    case ATTR_MAPPED: *(int *)data = 1; break;
    default: return E_INVALID_VALUE;
    }
    return OK;
}

/* ---------------------------------------------------------------- host registration */

typedef struct pinned {
    uint8_t *p;
    size_t n;
    fctx *ctx; /* registered in; gone with it */
    struct pinned *next;
} pinned;
static pinned *pins;

/* Whether [p, p+n) is mapped writable (from /proc/self/maps). */
static bool range_writable(const uint8_t *p, size_t n)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return true;
    char line[512];
    uintptr_t want = (uintptr_t)p, end = (uintptr_t)p + n;
    bool ok = true;
    while (want < end && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perm[5];
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perm) != 3)
            continue;
        if (hi <= want || lo > want)
            continue;
        if (perm[1] != 'w')
            ok = false;
        want = hi;
    }
    fclose(f);
    return ok && want >= end;
}

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags)
{
    CHECK_INIT();
    INJECTED("cuMemHostRegister_v2");
    NEED_CTX(c);
    if (!p || !n)
        return E_INVALID_VALUE;
    /* The driver pins pages for the device to write: a read-only mapping
     * needs the flag that says the device only reads them. */
    if (!(flags & HOSTREGISTER_READ_ONLY) && !range_writable(p, n))
        return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (pinned *q = pins; q; q = q->next)
        if ((uint8_t *)p < q->p + q->n && q->p < (uint8_t *)p + n) {
            pthread_mutex_unlock(&mu);
            return E_HOST_ALREADY_REGISTERED;
        }
    pinned *q = calloc(1, sizeof *q);
    if (q) {
        q->p = p;
        q->n = n;
        q->ctx = c;
        q->next = pins;
        pins = q;
    }
    pthread_mutex_unlock(&mu);
    return q ? OK : E_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemHostUnregister(void *p)
{
    CHECK_INIT();
    NEED_CTX(c);
    (void)c;
    pthread_mutex_lock(&mu);
    pinned **pp = &pins;
    while (*pp && (*pp)->p != p)
        pp = &(*pp)->next;
    pinned *q = *pp;
    if (q)
        *pp = q->next;
    pthread_mutex_unlock(&mu);
    free(q);
    return q ? OK : E_HOST_NOT_REGISTERED;
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

/* ---------------------------------------------------------------- copies */

/* One operand of a copy, resolved: where we touch it, and what it is. */
typedef enum { OPND_DEVICE, OPND_PINNED, OPND_PAGEABLE } opnd_kind;

/* Resolves [p, p+n) for a copy run in a context of device dev. mu held.
 * Returns 0 and *out (our address), or an error: unreachable device memory
 * (no peer access), a host range partly registered, a device range past its
 * allocation (ILLEGAL_ADDRESS: sticky). */
static CUresult opnd(uint64_t p, uint64_t n, int dev, uint8_t **out, opnd_kind *kind)
{
    alloc *a = find(p);
    if (a) {
        uint64_t end = a->base + a->size;
        for (alloc *b; a->vmm && end < p + n && (b = find(end)) && b->vmm && b->base == end &&
                       b->shadow == a->shadow + (end - a->base);)
            end += b->size; /* VMM chunks mapped back to back: one range */
        if (p + n > end)
            return E_ILLEGAL_ADDRESS;
        int home = a->imported && a->lazy_peer ? a->ctx->dev : a->dev;
        if (!a->managed && home != dev && !peer_on[dev][home])
            return E_INVALID_VALUE; /* no peer access from this device */
        *out = a->shadow + (p - a->base);
        *kind = OPND_DEVICE;
        return OK;
    }
    size_t covered = 0;
    for (pinned *q = pins; q; q = q->next) {
        uint64_t lo = p > (uint64_t)(uintptr_t)q->p ? p : (uint64_t)(uintptr_t)q->p;
        uint64_t hi = p + n < (uint64_t)(uintptr_t)(q->p + q->n) ? p + n
                                                                 : (uint64_t)(uintptr_t)(q->p + q->n);
        if (hi > lo)
            covered += hi - lo;
    }
    if (covered && covered < n)
        return E_INVALID_VALUE; /* spans registered and pageable memory */
    *out = (uint8_t *)(uintptr_t)p;
    *kind = covered ? OPND_PINNED : OPND_PAGEABLE;
    return OK;
}

static CUresult resolve(uint64_t dst, uint64_t src, uint64_t n, int dev, uint8_t **d, uint8_t **s,
                        bool *pageable)
{
    opnd_kind kd, ks;
    pthread_mutex_lock(&mu);
    CUresult r = opnd(dst, n, dev, d, &kd);
    if (r == OK)
        r = opnd(src, n, dev, s, &ks);
    pthread_mutex_unlock(&mu);
    if (r == E_ILLEGAL_ADDRESS)
        sticky = r;
    if (r == OK)
        *pageable = kd == OPND_PAGEABLE || ks == OPND_PAGEABLE;
    return r;
}

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CHECK_INIT();
    NEED_CTX(c);
    uint8_t *d, *s;
    bool pageable;
    CUresult r = resolve(dst, src, n, c->dev, &d, &s, &pageable);
    if (r != OK)
        return r;
    memmove(d, s, n);
    return OK;
}

/* ---------------------------------------------------------------- IPC */

typedef struct {
    char magic[8];
    int32_t pid, fd;
    uint64_t size;
    int32_t dev;
} fake_handle;

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
    CHECK_INIT();
    NEED_CTX(c);
    (void)c;
    pthread_mutex_lock(&mu);
    alloc *a = find(p);
    fake_handle fh = {.magic = "AXFFAKE"};
    bool ok = a && a->base == p && !a->imported && !a->vmm && !a->managed;
    if (ok) {
        fh.pid = (int32_t)getpid();
        fh.fd = a->fd;
        fh.size = a->size;
        fh.dev = a->dev;
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
    NEED_CTX(c);
    fake_handle fh;
    memcpy(&fh, h.reserved, sizeof fh);
    if (memcmp(fh.magic, "AXFFAKE", 8) != 0 || !fh.size || fh.dev < 0 || fh.dev >= ndev)
        return E_INVALID_VALUE;
    if (fh.pid == (int32_t)getpid())
        return E_INVALID_CONTEXT; /* the real driver refuses our own handles too */
    /* Memory of another device, without lazy peer access, needs it enabled. */
    pthread_mutex_lock(&mu);
    bool reach = fh.dev == c->dev || (flags & IPC_LAZY_ENABLE_PEER_ACCESS) ||
                 peer_on[c->dev][fh.dev];
    /* Once per (exporter, device) in a process. */
    for (alloc *a = allocs; a && reach; a = a->next)
        if (a->imported && a->pid == fh.pid && a->peer_fd == fh.fd && a->ctx->dev == c->dev) {
            pthread_mutex_unlock(&mu);
            return E_ALREADY_MAPPED;
        }
    pthread_mutex_unlock(&mu);
    if (!reach)
        return E_INVALID_VALUE;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)fh.pid, (int)fh.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return E_INVALID_VALUE;
    alloc *a = alloc_new(fd, 0, fh.size, false, NULL, NULL);
    close(fd);
    if (!a)
        return E_OUT_OF_MEMORY;
    a->dev = fh.dev;
    a->ctx = c;
    a->pid = fh.pid;
    a->peer_fd = fh.fd;
    a->imported = true;
    a->lazy_peer = (flags & IPC_LAZY_ENABLE_PEER_ACCESS) != 0;
    alloc_link(a);
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
    NEED_CTX(c);
    (void)c;
    alloc *a = unlink_base(p, true, false);
    if (!a)
        return E_INVALID_VALUE;
    alloc_unmap(a, false);
    return OK;
}

/* ---------------------------------------------------------------- dmabuf */

EXPORT CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type,
                                              unsigned long long flags)
{
    CHECK_INIT();
    if (type != 1 /* CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD */ || flags || !n)
        return E_INVALID_VALUE;
    size_t pg = page_size();
    if (p % pg || n % pg)
        return E_INVALID_VALUE; /* host-page-aligned address and size only */
    pthread_mutex_lock(&mu);
    alloc *a = find(p);
    bool ok = a && !a->managed && !a->imported && n <= a->size && p - a->base <= a->size - n;
    int memfd = ok ? a->fd : -1;
    uint64_t start = ok ? p - a->base : 0;
    int dev = ok ? a->dev : 0;
    pthread_mutex_unlock(&mu);
    if (!ok)
        return E_INVALID_VALUE;
    if (no_dmabuf)
        return E_NOT_SUPPORTED;
    (void)dev;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", memfd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return E_OUT_OF_MEMORY;
    lseek(fd, (off_t)start, SEEK_SET); /* where the exported range starts */
    *(int *)handle = fd;
    return OK;
}

/* ---------------------------------------------------------------- streams, events */

typedef struct event {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned pending; /* records not reached yet */
    fctx *ctx;        /* made in: refuses work once that is destroyed */
} event;

typedef struct item {
    uint8_t *dst, *src; /* resolved when enqueued */
    uint64_t n;         /* a copy, or (ev) an event record */
    event *ev;
    struct item *next;
} item;

typedef struct stream {
    pthread_mutex_t mu;
    pthread_cond_t cv, idle;
    item *head, *tail;
    bool stop, busy;
    int dev;
    fctx *ctx; /* made in: refuses work once that is destroyed */
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
            unsigned delay = event_delay_us;
            if (delay)
                usleep(delay);
            pthread_mutex_lock(&it->ev->mu);
            it->ev->pending--;
            pthread_cond_broadcast(&it->ev->cv);
            pthread_mutex_unlock(&it->ev->mu);
        } else if (!sticky) {
            memmove(it->dst, it->src, it->n);
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
    INJECTED("cuStreamCreate");
    NEED_CTX(c);
    (void)flags;
    stream *s = calloc(1, sizeof *s);
    if (!s)
        return E_OUT_OF_MEMORY;
    s->dev = c->dev;
    s->ctx = c;
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

static void stream_drain(stream *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy)
        pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *hs)
{
    CHECK_INIT();
    INJECTED("cuMemcpyAsync");
    NEED_CTX(c);
    (void)c;
    stream *s = hs;
    if (!s)
        return E_INVALID_VALUE;
    if (!ctx_alive(s->ctx))
        return E_INVALID_CONTEXT; /* a stream of a destroyed context */
    copy_tid = (long)syscall(SYS_gettid);
    uint8_t *d, *sp;
    bool pageable;
    CUresult r = resolve(dst, src, n, s->dev, &d, &sp, &pageable);
    if (r != OK)
        return r;
    if (pageable) {
        /* Pageable host memory: the driver stages it through its own pinned
         * buffer, and the call returns only once the copy is done. */
        stream_drain(s);
        if (!sticky)
            memmove(d, sp, n);
        sync_copies++;
        return sticky;
    }
    item *it = calloc(1, sizeof *it);
    if (!it)
        return E_OUT_OF_MEMORY;
    it->dst = d;
    it->src = sp;
    it->n = n;
    r = push(s, it);
    if (r != OK)
        free(it);
    return r;
}

EXPORT CUresult cuStreamSynchronize(void *hs)
{
    stream *s = hs;
    if (!s)
        return E_INVALID_VALUE;
    if (!ctx_alive(s->ctx))
        return E_INVALID_CONTEXT;
    stream_drain(s);
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
    INJECTED("cuEventCreate");
    NEED_CTX(c);
    (void)flags;
    event *e = calloc(1, sizeof *e);
    if (!e)
        return E_OUT_OF_MEMORY;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->ctx = c;
    event_creates++;
    *out = e;
    return OK;
}

EXPORT CUresult cuEventRecord(void *he, void *hs)
{
    CHECK_INIT();
    INJECTED("cuEventRecord");
    event *e = he;
    stream *s = hs;
    if (!ctx_alive(e->ctx) || (s && !ctx_alive(s->ctx)))
        return E_INVALID_CONTEXT;
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

static bool event_drain(event *e) /* whether it had to sleep */
{
    pthread_mutex_lock(&e->mu);
    bool slept = e->pending != 0;
    while (e->pending)
        pthread_cond_wait(&e->cv, &e->mu); /* blocking sync: sleeps */
    pthread_mutex_unlock(&e->mu);
    return slept;
}

EXPORT CUresult cuEventSynchronize(void *he)
{
    if (!ctx_alive(((event *)he)->ctx))
        return E_INVALID_CONTEXT;
    if (event_drain(he))
        event_sleeps++;
    return sticky;
}

EXPORT CUresult cuEventQuery(void *he)
{
    event *e = he;
    event_queries++;
    if (!ctx_alive(e->ctx))
        return E_INVALID_CONTEXT;
    CUresult fail = atomic_exchange(&query_error, OK);
    if (fail != OK)
        return fail;
    pthread_mutex_lock(&e->mu);
    unsigned p = e->pending;
    pthread_mutex_unlock(&e->mu);
    if (!p)
        query_tid = (long)syscall(SYS_gettid);
    return sticky ? sticky : p ? E_NOT_READY : OK;
}

EXPORT CUresult cuEventDestroy_v2(void *he)
{
    event *e = he;
    /* The driver defers the release of an event still pending; so do we. */
    event_drain(e);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
    return OK;
}

/* ---------------------------------------------------------------- destroying a context */

/* Destroys a context made by cuCtxCreate, whatever still uses it (the
 * driver's rule: "regardless of how many threads it is current to"): its
 * device memory and the IPC mappings opened into it are freed, its host
 * registrations dropped, its streams and events refuse work from now on. Off
 * the calling thread's stack if on top, as the real call pops it. */
EXPORT CUresult cuCtxDestroy_v2(void *ctx)
{
    CHECK_INIT();
    fctx *c = ctx;
    pthread_mutex_lock(&mu);
    bool made = c >= created && c < created + ncreated;
    if (!made || c->refs <= 0) { /* a primary context, or destroyed already */
        pthread_mutex_unlock(&mu);
        return E_INVALID_CONTEXT;
    }
    c->refs = 0;
    alloc *gone = NULL;
    for (alloc **pp = &allocs; *pp;) {
        alloc *a = *pp;
        if (a->ctx == c) {
            *pp = a->next;
            a->next = gone;
            gone = a;
        } else {
            pp = &a->next;
        }
    }
    pinned *dropped = NULL;
    for (pinned **pp = &pins; *pp;) {
        pinned *q = *pp;
        if (q->ctx == c) {
            *pp = q->next;
            q->next = dropped;
            dropped = q;
        } else {
            pp = &q->next;
        }
    }
    pthread_mutex_unlock(&mu);
    while (gone) {
        alloc *a = gone;
        gone = a->next;
        alloc_unmap(a, !a->imported && !a->managed); /* an arena range stays reserved */
    }
    while (dropped) {
        pinned *q = dropped;
        dropped = q->next;
        free(q);
    }
    if (depth && stack[depth - 1] == c)
        depth--;
    return OK;
}

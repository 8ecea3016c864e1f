/* CUDA: the driver API loaded at run time, and the same-host GPU copy path.
 *
 * Why dlopen: one build runs on machines with and without an NVIDIA driver;
 * without one, CUDA is simply absent (a reason string, never an error at load
 * time). No CUDA header is needed to build: the few types and constants used
 * are declared below, with the values of the CUDA Driver API (cuda.h; "Data
 * types used by CUDA driver", CUpointer_attribute, CUmemorytype). Symbols that
 * cuda.h maps to a versioned name (#define cuMemAlloc cuMemAlloc_v2, ...) are
 * looked up by that name.
 *
 * The copy path: an AXF_EP_CUDA endpoint is a same-host endpoint (host-only
 * ops run as shm copies) that also reaches a peer's GPU memory through CUDA IPC
 * handles. An op that touches GPU memory goes to this engine's CUDA submit
 * thread, which enqueues one cuMemcpyAsync per descriptor on a dedicated
 * non-blocking stream and records one event per op; a second thread waits on
 * those events in order with cuEventSynchronize (blocking-sync events: the
 * thread sleeps in the driver, it never spins) and completes the op through
 * op_unit_done, into the one completion ring. Posting never calls the driver,
 * so the caller's thread never blocks on a pageable copy.
 */
#include "internal.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- driver API */

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct {
    char reserved[64];
} CUipcMemHandle; /* CU_IPC_HANDLE_SIZE = 64 */
typedef struct {
    char bytes[16];
} CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_NOT_READY = 600,
    CU_STREAM_NON_BLOCKING = 0x1,
    CU_EVENT_BLOCKING_SYNC = 0x1,
    CU_EVENT_DISABLE_TIMING = 0x2,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1,
    CU_MEMHOSTREGISTER_PORTABLE = 0x1,
};

/* X(field, symbol, required, return, params) */
#define CU_FUNCS(X)                                                                                \
    X(Init, "cuInit", 1, CUresult, (unsigned int))                                                 \
    X(DriverGetVersion, "cuDriverGetVersion", 1, CUresult, (int *))                                \
    X(GetErrorString, "cuGetErrorString", 1, CUresult, (CUresult, const char **))                  \
    X(DeviceGetCount, "cuDeviceGetCount", 1, CUresult, (int *))                                    \
    X(DeviceGet, "cuDeviceGet", 1, CUresult, (CUdevice *, int))                                    \
    X(DeviceGetName, "cuDeviceGetName", 1, CUresult, (char *, int, CUdevice))                      \
    X(DeviceGetUuid, "cuDeviceGetUuid_v2", 0, CUresult, (CUuuid *, CUdevice))                      \
    X(DeviceGetUuidV1, "cuDeviceGetUuid", 0, CUresult, (CUuuid *, CUdevice))                       \
    X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1, CUresult, (CUcontext *, CUdevice))    \
    X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1, CUresult, (CUdevice))            \
    X(CtxSetCurrent, "cuCtxSetCurrent", 1, CUresult, (CUcontext))                                  \
    X(StreamCreate, "cuStreamCreate", 1, CUresult, (CUstream *, unsigned int))                     \
    X(StreamDestroy, "cuStreamDestroy_v2", 1, CUresult, (CUstream))                                \
    X(StreamSynchronize, "cuStreamSynchronize", 1, CUresult, (CUstream))                           \
    X(MemcpyAsync, "cuMemcpyAsync", 1, CUresult, (CUdeviceptr, CUdeviceptr, size_t, CUstream))     \
    X(Memcpy, "cuMemcpy", 1, CUresult, (CUdeviceptr, CUdeviceptr, size_t))                         \
    X(MemAlloc, "cuMemAlloc_v2", 1, CUresult, (CUdeviceptr *, size_t))                             \
    X(MemFree, "cuMemFree_v2", 1, CUresult, (CUdeviceptr))                                         \
    X(EventCreate, "cuEventCreate", 1, CUresult, (CUevent *, unsigned int))                        \
    X(EventRecord, "cuEventRecord", 1, CUresult, (CUevent, CUstream))                              \
    X(EventSynchronize, "cuEventSynchronize", 1, CUresult, (CUevent))                              \
    X(EventQuery, "cuEventQuery", 1, CUresult, (CUevent))                                          \
    X(EventDestroy, "cuEventDestroy_v2", 1, CUresult, (CUevent))                                   \
    X(IpcGetMemHandle, "cuIpcGetMemHandle", 1, CUresult, (CUipcMemHandle *, CUdeviceptr))          \
    X(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2", 0, CUresult,                                      \
      (CUdeviceptr *, CUipcMemHandle, unsigned int))                                               \
    X(IpcOpenMemHandleV1, "cuIpcOpenMemHandle", 0, CUresult,                                       \
      (CUdeviceptr *, CUipcMemHandle, unsigned int))                                               \
    X(IpcCloseMemHandle, "cuIpcCloseMemHandle", 1, CUresult, (CUdeviceptr))                        \
    X(PointerGetAttribute, "cuPointerGetAttribute", 1, CUresult, (void *, int, CUdeviceptr))       \
    X(MemGetAddressRange, "cuMemGetAddressRange_v2", 1, CUresult,                                  \
      (CUdeviceptr *, size_t *, CUdeviceptr))                                                      \
    X(MemHostRegister, "cuMemHostRegister_v2", 0, CUresult, (void *, size_t, unsigned int))        \
    X(MemHostUnregister, "cuMemHostUnregister", 0, CUresult, (void *))                             \
    /* CUDA >= 11.7: a dmabuf fd of device memory (GPUDirect RDMA through verbs) */                \
    X(MemGetHandleForAddressRange, "cuMemGetHandleForAddressRange", 0, CUresult,                   \
      (void *, CUdeviceptr, size_t, int, unsigned long long))

#define AXF_CUDA_MAX_DEVICES 64

typedef struct cu_driver {
#define CU_FIELD(field, sym, req, ret, params) ret(*field) params;
    CU_FUNCS(CU_FIELD)
#undef CU_FIELD
    void *lib;
    int status; /* AXF_OK once loaded and initialised */
    char why[256];
    int ndev, version;
    CUcontext ctx[AXF_CUDA_MAX_DEVICES]; /* primary contexts, retained on first use */
} cu_driver;

static cu_driver drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t drv_mu = PTHREAD_MUTEX_INITIALIZER; /* ctx[], the IPC map cache */
static _Thread_local bool tl_bound; /* this thread has a current context */

static const char *cu_err(CUresult r)
{
    const char *s = NULL;
    if (drv.GetErrorString && drv.GetErrorString(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "unknown CUDA error";
}

static void drv_load(void)
{
    /* AIOXFER_CUDA_DRIVER names another library (tests use a missing path to
     * exercise the absent-driver path on any machine). */
    const char *path = getenv("AIOXFER_CUDA_DRIVER");
    if (!path || !*path)
        path = "libcuda.so.1";
    drv.status = AXF_E_TRANSPORT;
    drv.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!drv.lib) {
        const char *err = dlerror();
        snprintf(drv.why, sizeof drv.why, "no CUDA driver: cannot load %s (%s)", path,
                 err ? err : "not found");
        return;
    }
#define CU_LOOKUP(field, sym, req, ret, params)                                             \
    *(void **)&drv.field = dlsym(drv.lib, sym);                                             \
    if (req && !drv.field) {                                                                \
        snprintf(drv.why, sizeof drv.why, "CUDA driver %s lacks %s (too old)", path, sym); \
        return;                                                                             \
    }
    CU_FUNCS(CU_LOOKUP)
#undef CU_LOOKUP
    if (!drv.IpcOpenMemHandle)
        drv.IpcOpenMemHandle = drv.IpcOpenMemHandleV1;
    if (!drv.DeviceGetUuid)
        drv.DeviceGetUuid = drv.DeviceGetUuidV1;
    if (!drv.IpcOpenMemHandle || !drv.DeviceGetUuid) {
        snprintf(drv.why, sizeof drv.why, "CUDA driver %s lacks IPC or UUID calls (too old)",
                 path);
        return;
    }
    CUresult r = drv.Init(0);
    if (r != CUDA_SUCCESS) {
        snprintf(drv.why, sizeof drv.why, "CUDA driver present but cuInit failed: %s (%d)",
                 cu_err(r), r);
        return;
    }
    drv.DriverGetVersion(&drv.version);
    r = drv.DeviceGetCount(&drv.ndev);
    if (r != CUDA_SUCCESS || drv.ndev <= 0) {
        snprintf(drv.why, sizeof drv.why, "CUDA driver %d.%d present but no device visible",
                 drv.version / 1000, drv.version % 1000 / 10);
        drv.ndev = 0;
        return;
    }
    if (drv.ndev > AXF_CUDA_MAX_DEVICES)
        drv.ndev = AXF_CUDA_MAX_DEVICES;
    snprintf(drv.why, sizeof drv.why, "CUDA driver %d.%d, %d device(s)", drv.version / 1000,
             drv.version % 1000 / 10, drv.ndev);
    drv.status = AXF_OK;
}

static int drv_ready(void)
{
    pthread_once(&drv_once, drv_load);
    return drv.status;
}

/* Makes device dev's primary context current on the calling thread. */
static int ctx_bind(int dev)
{
    if (dev < 0 || dev >= drv.ndev)
        return AXF_E_INVALID;
    pthread_mutex_lock(&drv_mu);
    CUresult r = CUDA_SUCCESS;
    if (!drv.ctx[dev]) {
        CUdevice d;
        r = drv.DeviceGet(&d, dev);
        if (r == CUDA_SUCCESS)
            r = drv.DevicePrimaryCtxRetain(&drv.ctx[dev], d);
    }
    CUcontext c = drv.ctx[dev];
    pthread_mutex_unlock(&drv_mu);
    if (r != CUDA_SUCCESS || drv.CtxSetCurrent(c) != CUDA_SUCCESS)
        return AXF_E_TRANSPORT;
    tl_bound = true;
    return AXF_OK;
}

/* The device a pointer's memory lives on; -1 when it is not device memory. */
static int ptr_device(uint64_t ptr)
{
    int type = 0, ord = -1;
    if (!tl_bound && ctx_bind(0) != AXF_OK) /* attribute queries want a current context */
        return -1;
    if (drv.PointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) != CUDA_SUCCESS ||
        type != CU_MEMORYTYPE_DEVICE)
        return -1;
    if (drv.PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) != CUDA_SUCCESS)
        return -1;
    return ord;
}

/* ---------------------------------------------------------------- process-level */

int axf_cuda_probe(char *why, size_t why_len, int *ndevices)
{
    int st = drv_ready();
    if (why && why_len)
        snprintf(why, why_len, "%s", drv.why);
    if (ndevices)
        *ndevices = st == AXF_OK ? drv.ndev : 0;
    return st;
}

int axf_cuda_device_name(int ordinal, char *name, size_t len)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (ordinal < 0 || ordinal >= drv.ndev || !len)
        return AXF_E_INVALID;
    CUdevice d;
    if (drv.DeviceGet(&d, ordinal) != CUDA_SUCCESS ||
        drv.DeviceGetName(name, (int)(len > 1024 ? 1024 : len), d) != CUDA_SUCCESS)
        return AXF_E_TRANSPORT;
    name[len - 1] = 0;
    return AXF_OK;
}

int axf_cuda_pointer(uint64_t ptr, uint64_t len, int *device, uint64_t *base, uint64_t *size)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (!ptr || !len || ptr + len < ptr)
        return AXF_E_INVALID;
    int dev = ptr_device(ptr);
    if (dev < 0)
        return AXF_E_INVALID;
    if (ctx_bind(dev) != AXF_OK)
        return AXF_E_TRANSPORT;
    CUdeviceptr b = 0;
    size_t sz = 0;
    if (drv.MemGetAddressRange(&b, &sz, ptr) != CUDA_SUCCESS)
        return AXF_E_INVALID;
    /* The whole range inside one allocation: a copy past it would fault the
     * GPU and poison the context for every later op. */
    if (ptr + len > b + sz)
        return AXF_E_ACCESS;
    if (device)
        *device = dev;
    if (base)
        *base = b;
    if (size)
        *size = sz;
    return AXF_OK;
}

int axf_cuda_export(uint64_t ptr, uint8_t handle[AXF_CUDA_IPC_HANDLE], uint64_t *offset,
                    uint8_t uuid[16])
{
    int dev = -1;
    uint64_t base = 0;
    int st = axf_cuda_pointer(ptr, 1, &dev, &base, NULL);
    if (st != AXF_OK)
        return st;
    CUipcMemHandle h;
    CUuuid u;
    CUdevice d;
    if (drv.IpcGetMemHandle(&h, base) != CUDA_SUCCESS)
        return AXF_E_REGISTRATION; /* e.g. VMM (cuMemCreate) memory: not legacy-IPC capable */
    if (drv.DeviceGet(&d, dev) != CUDA_SUCCESS || drv.DeviceGetUuid(&u, d) != CUDA_SUCCESS)
        return AXF_E_TRANSPORT;
    memcpy(handle, h.reserved, sizeof h.reserved);
    memcpy(uuid, u.bytes, sizeof u.bytes);
    *offset = ptr - base;
    return AXF_OK;
}

int axf_cuda_dmabuf(uint64_t ptr, uint64_t len, int *fd)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (!drv.MemGetHandleForAddressRange)
        return AXF_E_TRANSPORT;
    int dev = ptr_device(ptr);
    if (dev < 0 || ctx_bind(dev) != AXF_OK)
        return AXF_E_INVALID;
    int out = -1;
    if (drv.MemGetHandleForAddressRange(&out, ptr, len, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) !=
        CUDA_SUCCESS)
        return AXF_E_TRANSPORT;
    *fd = out;
    return AXF_OK;
}

int axf_cuda_alloc(int device, uint64_t len, uint64_t *ptr)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (!len || ctx_bind(device) != AXF_OK)
        return AXF_E_INVALID;
    CUdeviceptr p = 0;
    if (drv.MemAlloc(&p, len) != CUDA_SUCCESS)
        return AXF_E_NOMEM;
    *ptr = p;
    return AXF_OK;
}

int axf_cuda_free(uint64_t ptr)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    int dev = ptr_device(ptr);
    if (dev < 0 || ctx_bind(dev) != AXF_OK)
        return AXF_E_INVALID;
    return drv.MemFree(ptr) == CUDA_SUCCESS ? AXF_OK : AXF_E_INVALID;
}

int axf_cuda_copy(uint64_t dst, uint64_t src, uint64_t len)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    int dev = ptr_device(dst);
    if (dev < 0)
        dev = ptr_device(src);
    if (ctx_bind(dev < 0 ? 0 : dev) != AXF_OK)
        return AXF_E_TRANSPORT;
    return drv.Memcpy(dst, src, len) == CUDA_SUCCESS ? AXF_OK : AXF_E_TRANSPORT;
}

/* ---------------------------------------------------------------- IPC mappings */

/* A peer allocation opened in this process. A handle may be opened only once
 * per process, and several regions (several agents' endpoints) may sit in one
 * allocation: one entry per allocation, counted. drv_mu guards the list. */
typedef struct ipc_map {
    CUipcMemHandle h;
    CUdeviceptr base;
    size_t size;
    int dev, refs;
    struct ipc_map *next;
} ipc_map;

static ipc_map *ipc_maps;

struct cuda_rmap {
    ipc_map *m;   /* NULL: our own process's memory, used as is */
    uint64_t ptr; /* the region's first byte in our address space */
};

static int dev_by_uuid(const uint8_t uuid[16])
{
    for (int i = 0; i < drv.ndev; i++) {
        CUdevice d;
        CUuuid u;
        if (drv.DeviceGet(&d, i) == CUDA_SUCCESS && drv.DeviceGetUuid(&u, d) == CUDA_SUCCESS &&
            memcmp(u.bytes, uuid, 16) == 0)
            return i;
    }
    return 0; /* not visible here: opened on device 0 with peer access */
}

static void ipc_release(ipc_map *m)
{
    /* Bound before drv_mu (ctx_bind takes it); closed under it, so that an
     * import of the same handle never races with its close. */
    bool bound = ctx_bind(m->dev) == AXF_OK;
    pthread_mutex_lock(&drv_mu);
    if (--m->refs == 0) {
        for (ipc_map **p = &ipc_maps; *p; p = &(*p)->next)
            if (*p == m) {
                *p = m->next;
                break;
            }
        if (bound)
            drv.IpcCloseMemHandle(m->base);
        free(m);
    }
    pthread_mutex_unlock(&drv_mu);
}

int cuda_import(endpoint *ep, rregion *rr, const uint8_t *handle, uint64_t offset,
                const uint8_t uuid[16])
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    cuda_rmap *cm = calloc(1, sizeof *cm);
    if (!cm)
        return AXF_E_NOMEM;
    if (ep->pid == getpid()) {
        /* Our own memory (a loopback endpoint): the handle cannot be opened in
         * the process that made it, and need not be. */
        int st = axf_cuda_pointer(rr->addr, rr->len, NULL, NULL, NULL);
        if (st != AXF_OK) {
            free(cm);
            return st == AXF_E_TRANSPORT ? st : AXF_E_ACCESS;
        }
        cm->ptr = rr->addr;
        rr->cuda = cm;
        return AXF_OK;
    }
    if (!handle) {
        free(cm);
        return AXF_E_INVALID;
    }
    CUipcMemHandle h;
    memcpy(h.reserved, handle, sizeof h.reserved);
    int dev = dev_by_uuid(uuid);
    if (ctx_bind(dev) != AXF_OK) {
        free(cm);
        return AXF_E_TRANSPORT;
    }
    /* Looked up and opened under one lock: a handle may be opened only once
     * per process, also by two engines importing it at the same time. */
    int st = AXF_OK;
    pthread_mutex_lock(&drv_mu);
    ipc_map *m = ipc_maps;
    while (m && memcmp(m->h.reserved, h.reserved, sizeof h.reserved) != 0)
        m = m->next;
    if (m) {
        m->refs++;
    } else if (!(m = calloc(1, sizeof *m))) {
        st = AXF_E_NOMEM;
    } else {
        CUdeviceptr b2 = 0;
        m->h = h;
        m->dev = dev;
        m->refs = 1;
        if (drv.IpcOpenMemHandle(&m->base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS) {
            st = AXF_E_TRANSPORT;
        } else if (drv.MemGetAddressRange(&b2, &m->size, m->base) != CUDA_SUCCESS ||
                   b2 != m->base) {
            /* The allocation's true size bounds what the peer's metadata claims. */
            drv.IpcCloseMemHandle(m->base);
            st = AXF_E_TRANSPORT;
        }
        if (st == AXF_OK) {
            m->next = ipc_maps;
            ipc_maps = m;
        } else {
            free(m);
            m = NULL;
        }
    }
    pthread_mutex_unlock(&drv_mu);
    if (st != AXF_OK) {
        free(cm);
        return st;
    }
    if (offset > m->size || rr->len > m->size - offset) {
        ipc_release(m);
        free(cm);
        return AXF_E_ACCESS;
    }
    cm->m = m;
    cm->ptr = m->base + offset;
    rr->cuda = cm;
    return AXF_OK;
}

void cuda_unmap(rregion *rr)
{
    cuda_rmap *cm = rr->cuda;
    if (!cm)
        return;
    rr->cuda = NULL;
    if (cm->m)
        ipc_release(cm->m);
    free(cm);
}

/* ---------------------------------------------------------------- engine state */

typedef struct cuda_job {
    op *o;
    CUevent ev;   /* NULL: nothing to wait for (or the stream was synchronised) */
    struct cuda_job *next;
} cuda_job;

struct axf_cuda {
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* submit queue */
    pthread_cond_t wcv; /* wait queue */
    cuda_job *sq_head, *sq_tail; /* posted, not yet enqueued on a stream */
    cuda_job *wq_head, *wq_tail; /* enqueued, waiting for their event */
    bool stop, started;
    pthread_t submitter, waiter;
    CUstream stream[AXF_CUDA_MAX_DEVICES]; /* submit thread only */
};

static uint64_t rptr(const op *o, size_t i)
{
    rregion *rr = o->rr[i];
    uint64_t off = o->d[i].roff;
    if (rr->cuda)
        return rr->cuda->ptr + off;
    return (uint64_t)(uintptr_t)(rr->map + off); /* host memfd mapping (cuda_op_check) */
}

/* The op's device: where its first GPU pointer lives. */
static int op_device(const op *o)
{
    for (size_t i = 0; i < o->n; i++) {
        int dev = ptr_device((uint64_t)(uintptr_t)o->laddr[i]);
        if (dev >= 0)
            return dev;
        if (o->rr[i]->cuda) {
            dev = ptr_device(rptr(o, i));
            if (dev >= 0)
                return dev;
        }
    }
    return 0;
}

static void wq_push(struct axf_cuda *c, cuda_job *j)
{
    pthread_mutex_lock(&c->mu);
    if (c->wq_tail)
        c->wq_tail->next = j;
    else
        c->wq_head = j;
    c->wq_tail = j;
    pthread_cond_signal(&c->wcv);
    pthread_mutex_unlock(&c->mu);
}

/* Page-locks the op's local host regions on their first GPU copy: copies
 * from pageable memory go through the driver's bounce buffers (and block the
 * calling thread), pinned memory is read by DMA. Best effort: memory already
 * pinned by someone else (or a refusal) stays as it is. Submit thread only. */
static void pin_local(const op *o)
{
    if (!drv.MemHostRegister || !drv.MemHostUnregister)
        return;
    for (size_t i = 0; i < o->nlregs; i++) {
        region *r = o->lregs[i];
        if (r->kind != AXF_MEM_HOST || r->cuda_pinned || r->cuda_pin_tried)
            continue;
        r->cuda_pin_tried = true;
        if (drv.MemHostRegister(r->addr, r->len, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS)
            r->cuda_pinned = true;
    }
}

void cuda_unpin(region *r)
{
    if (r->cuda_pinned && drv.MemHostUnregister && (tl_bound || ctx_bind(0) == AXF_OK))
        drv.MemHostUnregister(r->addr);
    r->cuda_pinned = false;
}

/* Enqueues one op's copies and hands it to the waiter. */
static void submit_one(struct axf_cuda *c, cuda_job *j)
{
    op *o = j->o;
    j->next = NULL;
    if (atomic_load(&o->cancelled) || atomic_load(&o->status) != AXF_OK) {
        wq_push(c, j);
        return;
    }
    int dev = op_device(o);
    if (ctx_bind(dev) != AXF_OK) {
        op_set_status(o, AXF_E_TRANSPORT, 0);
        wq_push(c, j);
        return;
    }
    if (!c->stream[dev] && drv.StreamCreate(&c->stream[dev], CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        c->stream[dev] = NULL;
        op_set_status(o, AXF_E_TRANSPORT, 0);
        wq_push(c, j);
        return;
    }
    CUstream s = c->stream[dev];
    pin_local(o);
    size_t done = 0;
    uint64_t bytes = 0;
    for (; done < o->n; done++) {
        uint64_t l = (uint64_t)(uintptr_t)o->laddr[done], r = rptr(o, done), len = o->d[done].len;
        CUresult rc = o->opcode == AXF_OP_WRITE ? drv.MemcpyAsync(r, l, len, s)
                                                : drv.MemcpyAsync(l, r, len, s);
        if (rc != CUDA_SUCCESS) {
            op_set_status(o, AXF_E_TRANSPORT, done);
            break;
        }
        bytes += len;
    }
    atomic_fetch_add(&o->nbytes, bytes);
    if (done == 0) {
        wq_push(c, j);
        return;
    }
    /* Copies are in flight: the op's memory stays pinned until they are over. */
    if (drv.EventCreate(&j->ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS ||
        drv.EventRecord(j->ev, s) != CUDA_SUCCESS) {
        if (j->ev)
            drv.EventDestroy(j->ev);
        j->ev = NULL;
        if (drv.StreamSynchronize(s) != CUDA_SUCCESS)
            op_set_status(o, AXF_E_TRANSPORT, 0);
    }
    wq_push(c, j);
}

static void *submit_main(void *arg)
{
    axf_engine *e = arg;
    struct axf_cuda *c = e->cuda;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->sq_head && !c->stop)
            pthread_cond_wait(&c->cv, &c->mu);
        cuda_job *j = c->sq_head;
        if (!j)
            break;
        c->sq_head = j->next;
        if (!c->sq_head)
            c->sq_tail = NULL;
        bool stopping = c->stop;
        pthread_mutex_unlock(&c->mu);
        if (stopping)
            op_set_status(j->o, AXF_E_CLOSED, 0);
        submit_one(c, j);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void *wait_main(void *arg)
{
    axf_engine *e = arg;
    struct axf_cuda *c = e->cuda;
    bool bound = false;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        /* Stops only once the submitter is gone and nothing waits: every
         * enqueued copy is over before its op completes. */
        while (!c->wq_head && !(c->stop && !c->started))
            pthread_cond_wait(&c->wcv, &c->mu);
        cuda_job *j = c->wq_head;
        if (!j)
            break;
        c->wq_head = j->next;
        if (!c->wq_head)
            c->wq_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        if (j->ev) {
            if (!bound)
                bound = ctx_bind(0) == AXF_OK; /* events sync from any context */
            if (drv.EventSynchronize(j->ev) != CUDA_SUCCESS)
                op_set_status(j->o, AXF_E_TRANSPORT, 0);
            drv.EventDestroy(j->ev);
        }
        op *o = j->o;
        free(j);
        op_unit_done(e, o);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int axf_cuda_enable(axf_engine *e, char *why, size_t why_len)
{
    int st = drv_ready();
    if (why && why_len)
        snprintf(why, why_len, "%s", drv.why);
    if (st != AXF_OK)
        return st;
    pthread_mutex_lock(&e->mu);
    if (e->cuda || e->shut) {
        st = e->shut ? AXF_E_CLOSED : AXF_OK;
        pthread_mutex_unlock(&e->mu);
        return st;
    }
    struct axf_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        pthread_mutex_unlock(&e->mu);
        return AXF_E_NOMEM;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->wcv, NULL);
    e->cuda = c;
    c->started = true;
    if (pthread_create(&c->submitter, NULL, submit_main, e) != 0) {
        e->cuda = NULL;
        pthread_mutex_unlock(&e->mu);
        free(c);
        return AXF_E_NOMEM;
    }
    if (pthread_create(&c->waiter, NULL, wait_main, e) != 0) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->submitter, NULL);
        e->cuda = NULL;
        pthread_mutex_unlock(&e->mu);
        free(c);
        return AXF_E_NOMEM;
    }
    pthread_mutex_unlock(&e->mu);
    return AXF_OK;
}

bool cuda_ready(axf_engine *e) { return e->cuda != NULL; }

/* ---------------------------------------------------------------- ops */

bool cuda_op_is_gpu(const op *o)
{
    for (size_t i = 0; i < o->nlregs; i++)
        if (o->lregs[i]->kind == AXF_MEM_CUDA)
            return true;
    for (size_t i = 0; i < o->nrregs; i++)
        if (o->rregs[i]->cuda)
            return true;
    return false;
}

int cuda_op_check(op *o)
{
    if (!cuda_op_is_gpu(o))
        return AXF_OK;
    /* A GPU copy reaches a peer's host memory only through our mapping of it
     * (an agent.alloc'd memfd region); cross-memory attach has no device path. */
    for (size_t i = 0; i < o->n; i++)
        if (!o->rr[i]->cuda && !o->rr[i]->map) {
            o->fail_index = i;
            return AXF_E_INVALID;
        }
    return AXF_OK;
}

void cuda_submit(axf_engine *e, op *o)
{
    struct axf_cuda *c = e->cuda;
    cuda_job *j = calloc(1, sizeof *j);
    atomic_store(&o->remaining, 1);
    if (!j) {
        op_set_status(o, AXF_E_NOMEM, 0);
        op_unit_done(e, o);
        return;
    }
    j->o = o;
    pthread_mutex_lock(&c->mu);
    if (c->sq_tail)
        c->sq_tail->next = j;
    else
        c->sq_head = j;
    c->sq_tail = j;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void cuda_stop(axf_engine *e)
{
    struct axf_cuda *c = e->cuda;
    if (!c || !c->started)
        return;
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->submitter, NULL); /* fails what was not enqueued yet */
    pthread_mutex_lock(&c->mu);
    c->started = false;
    pthread_cond_broadcast(&c->wcv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->waiter, NULL); /* waits for what was */
}

void cuda_free(axf_engine *e)
{
    struct axf_cuda *c = e->cuda;
    if (!c)
        return;
    cuda_stop(e);
    for (int d = 0; d < AXF_CUDA_MAX_DEVICES; d++)
        if (c->stream[d] && ctx_bind(d) == AXF_OK)
            drv.StreamDestroy(c->stream[d]);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->wcv);
    free(c);
    e->cuda = NULL;
}

void cuda_unmap_idle(endpoint *ep)
{
    for (rregion *rr = ep->rregions; rr; rr = rr->next)
        if (rr->cuda && (rr->gone || ep->dead) && atomic_load(&rr->users) == 0)
            cuda_unmap(rr);
}

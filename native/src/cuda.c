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
 * Contexts (the rule every function here keeps): a thread of the application
 * leaves as it came. Pointer queries use cuPointerGetAttribute, which needs
 * no context (unified addressing); a call that needs one pushes the context
 * the memory belongs to (CU_POINTER_ATTRIBUTE_CONTEXT) and pops it after, as
 * UCX does. What outlives one call (streams, events, IPC mappings, host
 * pins) lives in the device's primary context, retained by us for the life
 * of the process: a context we hold a reference on. Never in the context of
 * the application's memory, which may be one it made itself (cuCtxCreate)
 * and destroys when it likes; the driver then frees everything made in it,
 * under every engine of the process. Copies between that memory and ours
 * need no shared context (unified addressing). The primary context is
 * retained (activated: hundreds of MB of device memory, where the
 * application did not activate it already) only to allocate on a device
 * (axf_cuda_alloc), when this process moves bytes on it, or when GPU memory
 * of a device whose primary context is active already is registered (so that
 * host pools can be pinned ahead of their first copy). Only the engine's own
 * CUDA threads keep a context current.
 *
 * The copy path: an AXF_EP_CUDA endpoint is a same-host endpoint (host-only
 * ops run as shm copies) that also reaches a peer's GPU memory through CUDA IPC
 * handles. An op that touches GPU memory has one cuMemcpyAsync per descriptor
 * (split where host memory changes between page-locked and pageable) enqueued
 * on a dedicated non-blocking stream of the op's device (the device of its
 * local GPU memory, else of the peer's), and one event recorded after them
 * (reused from a per-device pool). Who enqueues: the posting thread itself
 * when the submit queue is empty and the work is short (up to 16 descriptors,
 * stream made, the peer's memory open, host memory already page-locked; its
 * context pushed and popped, the thread's context stack left as it was), else
 * this engine's CUDA submit thread (first use: IPC opens, pinning, stream
 * creation). A second thread waits on the events in order and completes the
 * ops through op_unit_done, into the one completion ring: where the engine
 * polls (progress other than "sleep") it polls cuEventQuery for the engine's
 * poll bound first, then sleeps in cuEventSynchronize (blocking-sync events).
 * A lone small op (AXF_POST_ALONE, up to 1 MiB) that its poster enqueued is
 * polled and completed by the poster too, within that bound: no thread
 * hand-off at all, as UCX's cuda_ipc completes on its caller's progress.
 * Nothing on the posting thread waits on a copy past the poll bound.
 *
 * A peer's allocation is opened by IPC at its first use, in the context of the
 * device whose stream copies it (with lazy peer access, so GPU A <-> GPU B
 * runs over NVLink/PCIe peer-to-peer rather than through host memory), once
 * per (allocation, device) per process, as UCX caches them. Host memory a GPU
 * copy touches is page-locked (cuMemHostRegister): our own regions and our
 * mappings of peers' memfd regions (read-only ones with the read-only flag),
 * so copies are asynchronous DMA rather than synchronous staging through the
 * driver's bounce buffers.
 *
 * A sticky CUDA error (an illegal address, a device-side fault) poisons every
 * context of the process, the application's primary contexts included: it is
 * latched, logged with its name, and every later GPU op fails at once.
 */
#include "transport.h"

#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct cuda_rmap cuda_rmap;

/* Its private slots (transport.h): the engine's copy threads, a far region's
 * IPC mapping, and (bits, not a pointer) whether a region of ours is
 * page-locked for GPU copies. */
#define CU_OF(e) ((struct axf_cuda *)(e)->xp[AXF_EP_CUDA])
#define CU_RM(rr) ((cuda_rmap *)(rr)->xp[AXF_EP_CUDA])
enum { PIN_TRIED = 1, PIN_DONE = 2 };
static inline uintptr_t pin_flags(const region *r) { return (uintptr_t)r->xp[AXF_EP_CUDA]; }
static inline void pin_flags_set(region *r, uintptr_t bit)
{
    r->xp[AXF_EP_CUDA] = (void *)(pin_flags(r) | bit);
}

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
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CU_STREAM_NON_BLOCKING = 0x1,
    CU_EVENT_BLOCKING_SYNC = 0x1,
    CU_EVENT_DISABLE_TIMING = 0x2,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1,
    CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1,
    CU_MEMHOSTREGISTER_PORTABLE = 0x1,
    CU_MEMHOSTREGISTER_READ_ONLY = 0x8,
};

/* X(field, symbol, required, return, params) */
#define CU_FUNCS(X)                                                                                \
    X(Init, "cuInit", 1, CUresult, (unsigned int))                                                 \
    X(DriverGetVersion, "cuDriverGetVersion", 1, CUresult, (int *))                                \
    X(GetErrorString, "cuGetErrorString", 1, CUresult, (CUresult, const char **))                  \
    X(GetErrorName, "cuGetErrorName", 0, CUresult, (CUresult, const char **))                      \
    X(DeviceGetCount, "cuDeviceGetCount", 1, CUresult, (int *))                                    \
    X(DeviceGet, "cuDeviceGet", 1, CUresult, (CUdevice *, int))                                    \
    X(DeviceGetName, "cuDeviceGetName", 1, CUresult, (char *, int, CUdevice))                      \
    X(DeviceGetAttribute, "cuDeviceGetAttribute", 1, CUresult, (int *, int, CUdevice))             \
    X(DeviceCanAccessPeer, "cuDeviceCanAccessPeer", 1, CUresult, (int *, CUdevice, CUdevice))      \
    X(DeviceGetUuid, "cuDeviceGetUuid_v2", 0, CUresult, (CUuuid *, CUdevice))                      \
    X(DeviceGetUuidV1, "cuDeviceGetUuid", 0, CUresult, (CUuuid *, CUdevice))                       \
    X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1, CUresult, (CUcontext *, CUdevice))    \
    X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1, CUresult, (CUdevice))            \
    X(DevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState", 0, CUresult,                         \
      (CUdevice, unsigned int *, int *))                                                           \
    X(CtxSetCurrent, "cuCtxSetCurrent", 1, CUresult, (CUcontext))                                  \
    X(CtxPushCurrent, "cuCtxPushCurrent_v2", 1, CUresult, (CUcontext))                             \
    X(CtxPopCurrent, "cuCtxPopCurrent_v2", 1, CUresult, (CUcontext *))                             \
    X(CtxEnablePeerAccess, "cuCtxEnablePeerAccess", 1, CUresult, (CUcontext, unsigned int))        \
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
    /* The context our own threads use per device: its primary context,
     * retained by us at first need for the life of the process (NULL until
     * then). Only a context we hold a reference on: see the top of the file.
     * drv_mu. */
    CUcontext dev_ctx[AXF_CUDA_MAX_DEVICES];
    _Atomic int poisoned; /* a sticky error: the CUresult */
    char poison_why[160];
} cu_driver;

static cu_driver drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t drv_mu = PTHREAD_MUTEX_INITIALIZER; /* dev_ctx, IPC maps, pins */

/* "CUDA_ERROR_X (text)": names on every log line, so a report says which. */
static const char *cu_err(CUresult r, char *buf, size_t len)
{
    const char *s = NULL, *n = NULL;
    if (!drv.GetErrorString || drv.GetErrorString(r, &s) != CUDA_SUCCESS || !s)
        s = "unknown CUDA error";
    if (!drv.GetErrorName || drv.GetErrorName(r, &n) != CUDA_SUCCESS || !n)
        n = "CUresult";
    snprintf(buf, len, "%s %d (%s)", n, r, s);
    return buf;
}

/* Errors after which the process's contexts are unusable (cuda.h: "the
 * process must be terminated and relaunched"). */
static bool cu_sticky(CUresult r)
{
    return r == 700 || (r >= 714 && r <= 720) || r == 710 || r == 999;
}

/* Latches a sticky error; returns r. */
static CUresult cu_check(CUresult r)
{
    if (r != CUDA_SUCCESS && cu_sticky(r)) {
        int zero = 0;
        if (atomic_compare_exchange_strong(&drv.poisoned, &zero, r)) {
            char b[120];
            snprintf(drv.poison_why, sizeof drv.poison_why,
                     "CUDA contexts poisoned by a sticky error: %s; restart the process",
                     cu_err(r, b, sizeof b));
        }
    }
    return r;
}

static void drv_load_from(const char *path)
{
    drv.status = AXF_E_TRANSPORT;
    drv.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!drv.lib) {
        const char *err = dlerror();
        snprintf(drv.why, sizeof drv.why, "no CUDA driver: cannot load %.200s (%s)", path,
                 err ? err : "not found");
        return;
    }
#define CU_LOOKUP(field, sym, req, ret, params)                                             \
    *(void **)&drv.field = dlsym(drv.lib, sym);                                             \
    if (req && !drv.field) {                                                                \
        snprintf(drv.why, sizeof drv.why, "CUDA driver %.160s lacks %s (too old)",          \
                 path, sym);                                                                \
        return;                                                                             \
    }
    CU_FUNCS(CU_LOOKUP)
#undef CU_LOOKUP
    if (!drv.IpcOpenMemHandle)
        drv.IpcOpenMemHandle = drv.IpcOpenMemHandleV1;
    if (!drv.DeviceGetUuid)
        drv.DeviceGetUuid = drv.DeviceGetUuidV1;
    if (!drv.IpcOpenMemHandle || !drv.DeviceGetUuid) {
        snprintf(drv.why, sizeof drv.why, "CUDA driver %.160s lacks IPC or UUID calls (too old)",
                 path);
        return;
    }
    CUresult r = drv.Init(0);
    if (r != CUDA_SUCCESS) {
        char b[120];
        snprintf(drv.why, sizeof drv.why, "CUDA driver present but cuInit failed: %s",
                 cu_err(r, b, sizeof b));
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

static void drv_load(void)
{
    /* AIOXFER_CUDA_DRIVER names another library (tests use a missing path to
     * exercise the absent-driver path on any machine): the snapshot's
     * (engine.c axf_env_read), not getenv, read in place (a path may be 4 KiB:
     * no copy on the stack of whichever thread asks first). */
    axf_env env;
    axf_env_take(&env, false);
    const char *v = axf_env_wide(&env, AXF_ENV_CUDA_DRIVER);
    drv_load_from(v && *v ? v : "libcuda.so.1");
    axf_env_release(&env);
}

static int drv_ready(void)
{
    pthread_once(&drv_once, drv_load);
    if (drv.status == AXF_OK && atomic_load(&drv.poisoned))
        return AXF_E_TRANSPORT;
    return drv.status;
}

/* ---------------------------------------------------------------- pointers */

/* What a pointer is, from attributes that need no current context. */
typedef struct ptr_attr {
    int dev;
    CUcontext ctx;
    uint64_t base, size; /* the allocation (a VMM mapping: the one chunk) */
    bool managed, legacy_ipc;
} ptr_attr;

/* false when p is not device memory (host memory, or unknown). */
static bool ptr_query(uint64_t p, ptr_attr *a)
{
    int type = 0, managed = 0, legacy = 0;
    memset(a, 0, sizeof *a);
    a->dev = -1;
    if (drv.PointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) != CUDA_SUCCESS ||
        type != CU_MEMORYTYPE_DEVICE)
        return false;
    if (drv.PointerGetAttribute(&a->dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS ||
        drv.PointerGetAttribute(&a->ctx, CU_POINTER_ATTRIBUTE_CONTEXT, p) != CUDA_SUCCESS ||
        drv.PointerGetAttribute(&a->base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p) !=
            CUDA_SUCCESS ||
        drv.PointerGetAttribute(&a->size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p) != CUDA_SUCCESS ||
        a->dev < 0 || a->dev >= drv.ndev)
        return false;
    if (drv.PointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, p) == CUDA_SUCCESS)
        a->managed = managed != 0;
    if (drv.PointerGetAttribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) ==
        CUDA_SUCCESS)
        a->legacy_ipc = legacy != 0;
    else
        a->legacy_ipc = true; /* drivers before 11.0 have only legacy allocations */
    return true;
}

/* Pushes ctx on the calling thread; ctx_pop undoes it. */
static int ctx_push(CUcontext ctx)
{
    return ctx && drv.CtxPushCurrent(ctx) == CUDA_SUCCESS ? AXF_OK : AXF_E_TRANSPORT;
}

static void ctx_pop(void)
{
    CUcontext c;
    drv.CtxPopCurrent(&c);
}

/* The context the engine's threads use on dev: its primary context,
 * retained once (cu_driver.dev_ctx). Never the context of the memory an op
 * moves: the application may destroy that one, and with it every stream,
 * event, IPC mapping and pin made in it (rev18 #5). NULL on failure. */
static CUcontext dev_context(int dev)
{
    if (dev < 0 || dev >= drv.ndev)
        return NULL;
    pthread_mutex_lock(&drv_mu);
    if (!drv.dev_ctx[dev]) {
        CUdevice d;
        CUcontext c = NULL;
        if (drv.DeviceGet(&d, dev) == CUDA_SUCCESS &&
            drv.DevicePrimaryCtxRetain(&c, d) == CUDA_SUCCESS)
            drv.dev_ctx[dev] = c;
    }
    CUcontext c = drv.dev_ctx[dev];
    pthread_mutex_unlock(&drv_mu);
    return c;
}

/* ---------------------------------------------------------------- process-level */

int axf_cuda_probe(char *why, size_t why_len, int *ndevices)
{
    int st = drv_ready();
    if (why && why_len)
        snprintf(why, why_len, "%s", atomic_load(&drv.poisoned) ? drv.poison_why : drv.why);
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

int axf_cuda_device_info(int ordinal, axf_cuda_device *out)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (ordinal < 0 || ordinal >= drv.ndev || !out)
        return AXF_E_INVALID;
    memset(out, 0, sizeof *out);
    CUdevice d;
    if (drv.DeviceGet(&d, ordinal) != CUDA_SUCCESS)
        return AXF_E_TRANSPORT;
    int v = 0;
    if (drv.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, d) == CUDA_SUCCESS)
        out->dmabuf = v != 0;
    int bus = 0, devid = 0, dom = 0;
    drv.DeviceGetAttribute(&bus, 33 /* PCI_BUS_ID */, d);
    drv.DeviceGetAttribute(&devid, 34 /* PCI_DEVICE_ID */, d);
    drv.DeviceGetAttribute(&dom, 50 /* PCI_DOMAIN_ID */, d);
    snprintf(out->pci, sizeof out->pci, "%04x:%02x:%02x.0", (unsigned)dom & 0xffff,
             (unsigned)bus & 0xff, (unsigned)devid & 0xff);
    for (int p = 0; p < drv.ndev && p < 64; p++) {
        int can = 0;
        CUdevice pd;
        if (p != ordinal && drv.DeviceGet(&pd, p) == CUDA_SUCCESS &&
            drv.DeviceCanAccessPeer(&can, d, pd) == CUDA_SUCCESS && can)
            out->peers |= 1ull << p;
    }
    return AXF_OK;
}

/* Checks [ptr, ptr+len) is device memory on one device and one contiguous
 * span of mappings: one allocation, or (VMM, expandable segments) several
 * chunks mapped back to back, each of which the driver reports on its own.
 * Only VMM chunks continue a span: cuMemAlloc allocations can be adjacent
 * (seen on an H200), but each is its own IPC export, so a range running from
 * one into the next would run past the peer's mapping of the first. */
static int span_check(uint64_t ptr, uint64_t len, ptr_attr *first)
{
    if (!ptr_query(ptr, first))
        return AXF_E_INVALID;
    if (first->managed)
        return AXF_E_INVALID; /* CPU-accessible: register it as host memory */
    /* A range that wraps past the top of the address space would pass the
     * end test below (ptr + len small) and reach the driver as a huge size. */
    if (ptr + len < ptr)
        return AXF_E_ACCESS;
    uint64_t end = first->base + first->size;
    while (ptr + len > end) {
        ptr_attr next;
        if (first->legacy_ipc || !ptr_query(end, &next) || next.base != end ||
            next.dev != first->dev || next.managed || next.legacy_ipc || !next.size)
            return AXF_E_ACCESS; /* past the mapped span: a copy would fault the GPU */
        end = next.base + next.size;
    }
    return AXF_OK;
}

int axf_cuda_pointer(uint64_t ptr, uint64_t len, int *device, uint64_t *base, uint64_t *size)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (!ptr || !len || ptr + len < ptr)
        return AXF_E_INVALID;
    ptr_attr a;
    int st = span_check(ptr, len, &a);
    if (st != AXF_OK)
        return st;
    /* Where the application runs in the device's primary context (the
     * runtime API, PyTorch) it is active already and retaining it costs a
     * count: the engine then has a context for pinning host pools ahead of
     * their first copy (pin_ahead). Not where it is inactive (the
     * application's own context): that waits for the first copy. */
    unsigned flags = 0;
    int active = 0;
    if (drv.DevicePrimaryCtxGetState) {
        CUdevice d;
        if (drv.DeviceGet(&d, a.dev) == CUDA_SUCCESS &&
            drv.DevicePrimaryCtxGetState(d, &flags, &active) == CUDA_SUCCESS && active)
            dev_context(a.dev);
    }
    if (device)
        *device = a.dev;
    if (base)
        *base = a.base;
    if (size)
        *size = a.size;
    return AXF_OK;
}

int axf_cuda_describe(uint64_t ptr, uint64_t len, char *why, size_t why_len)
{
    int st = drv_ready();
    if (st != AXF_OK) {
        snprintf(why, why_len, "%s", atomic_load(&drv.poisoned) ? drv.poison_why : drv.why);
        return st;
    }
    ptr_attr a;
    if (!ptr_query(ptr, &a)) {
        snprintf(why, why_len, "%#llx is not CUDA device memory (host memory: register it "
                 "through the buffer protocol)", (unsigned long long)ptr);
        return AXF_E_INVALID;
    }
    if (a.managed) {
        snprintf(why, why_len, "%#llx is CUDA managed (unified) memory: it is CPU-accessible, "
                 "register it as host memory", (unsigned long long)ptr);
        return AXF_E_INVALID;
    }
    st = span_check(ptr, len ? len : 1, &a);
    if (st != AXF_OK) {
        snprintf(why, why_len, "[%#llx, +%llu) runs past the device memory mapped there "
                 "(allocation or mapping at %#llx of %llu bytes)", (unsigned long long)ptr,
                 (unsigned long long)len, (unsigned long long)a.base, (unsigned long long)a.size);
        return st;
    }
    snprintf(why, why_len, "device %d, %s at %#llx of %llu bytes%s", a.dev,
             a.legacy_ipc ? "allocation" : "VMM mapping", (unsigned long long)a.base,
             (unsigned long long)a.size,
             a.legacy_ipc ? "" : " (no legacy CUDA IPC: same-host peers cannot map it)");
    return AXF_OK;
}

int axf_cuda_export(uint64_t ptr, uint8_t handle[AXF_CUDA_IPC_HANDLE], uint64_t *offset,
                    uint8_t uuid[16])
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    ptr_attr a;
    int st = span_check(ptr, 1, &a);
    if (st != AXF_OK)
        return st;
    if (!a.legacy_ipc)
        return AXF_E_REGISTRATION; /* VMM (cuMemCreate) memory: not legacy-IPC capable */
    CUipcMemHandle h;
    CUuuid u;
    CUdevice d;
    if (ctx_push(a.ctx) != AXF_OK)
        return AXF_E_TRANSPORT;
    CUresult r = cu_check(drv.IpcGetMemHandle(&h, a.base));
    ctx_pop();
    if (r != CUDA_SUCCESS)
        return AXF_E_REGISTRATION;
    if (drv.DeviceGet(&d, a.dev) != CUDA_SUCCESS || drv.DeviceGetUuid(&u, d) != CUDA_SUCCESS)
        return AXF_E_TRANSPORT;
    memcpy(handle, h.reserved, sizeof h.reserved);
    memcpy(uuid, u.bytes, sizeof u.bytes);
    *offset = ptr - a.base;
    return AXF_OK;
}

int axf_cuda_dmabuf_range(uint64_t ptr, uint64_t len, int *fd, uint64_t *offset, char *why,
                          size_t why_len)
{
    char b[120];
    if (why && why_len)
        why[0] = 0;
    if (drv_ready() != AXF_OK || !drv.MemGetHandleForAddressRange) {
        if (why && why_len)
            snprintf(why, why_len, "%s", drv.status != AXF_OK ? drv.why
                                         : "the CUDA driver has no dmabuf export (before 11.7)");
        return AXF_E_TRANSPORT;
    }
    ptr_attr a;
    if (!len || span_check(ptr, len, &a) != AXF_OK || ptr + len > a.base + a.size) {
        if (why && why_len)
            snprintf(why, why_len, "not inside one device allocation");
        return AXF_E_INVALID;
    }
    CUdevice d;
    int ok = 0;
    if (drv.DeviceGet(&d, a.dev) != CUDA_SUCCESS ||
        drv.DeviceGetAttribute(&ok, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, d) != CUDA_SUCCESS ||
        !ok) {
        if (why && why_len)
            snprintf(why, why_len, "device %d does not support dmabuf (kernel or driver too old, "
                     "or open kernel modules missing)", a.dev);
        return AXF_E_TRANSPORT;
    }
    /* The driver exports host-page-aligned ranges only; caching allocators
     * hand out 512-byte-aligned tensors. Export the pages around the range
     * (inside the allocation, which is page-granular) and say where the range
     * starts in them, for ibv_reg_dmabuf_mr's offset. */
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t lo = ptr & ~(pg - 1), hi = (ptr + len + pg - 1) & ~(pg - 1);
    if (lo < a.base)
        lo = a.base;
    if (hi > a.base + a.size)
        hi = a.base + a.size;
    if (ctx_push(a.ctx) != AXF_OK)
        return AXF_E_TRANSPORT;
    int out = -1;
    CUresult r = cu_check(
        drv.MemGetHandleForAddressRange(&out, lo, hi - lo, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
    ctx_pop();
    if (r != CUDA_SUCCESS) {
        if (why && why_len)
            snprintf(why, why_len, "cuMemGetHandleForAddressRange: %s", cu_err(r, b, sizeof b));
        return AXF_E_TRANSPORT;
    }
    *fd = out;
    *offset = ptr - lo;
    return AXF_OK;
}

int axf_cuda_dmabuf(uint64_t ptr, uint64_t len, int *fd)
{
    uint64_t off = 0;
    int st = axf_cuda_dmabuf_range(ptr, len, fd, &off, NULL, 0);
    if (st == AXF_OK && off) { /* the caller has nowhere to put the offset */
        close(*fd);
        *fd = -1;
        return AXF_E_INVALID;
    }
    return st;
}

int axf_cuda_alloc(int device, uint64_t len, uint64_t *ptr)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    if (!len || device < 0 || device >= drv.ndev)
        return AXF_E_INVALID;
    /* Allocating on a device needs a context there: its primary context
     * (what the runtime API and PyTorch use), retained once. */
    CUcontext c = dev_context(device);
    if (ctx_push(c) != AXF_OK)
        return AXF_E_TRANSPORT;
    CUdeviceptr p = 0;
    CUresult r = cu_check(drv.MemAlloc(&p, len));
    ctx_pop();
    if (r != CUDA_SUCCESS)
        return AXF_E_NOMEM;
    *ptr = p;
    return AXF_OK;
}

int axf_cuda_free(uint64_t ptr)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    ptr_attr a;
    if (!ptr_query(ptr, &a) || ctx_push(a.ctx) != AXF_OK)
        return AXF_E_INVALID;
    CUresult r = cu_check(drv.MemFree(ptr));
    ctx_pop();
    return r == CUDA_SUCCESS ? AXF_OK : AXF_E_INVALID;
}

int axf_cuda_copy(uint64_t dst, uint64_t src, uint64_t len)
{
    if (drv_ready() != AXF_OK)
        return AXF_E_TRANSPORT;
    ptr_attr a;
    if (!ptr_query(dst, &a) && !ptr_query(src, &a))
        return AXF_E_INVALID; /* host to host: not the driver's job */
    if (ctx_push(a.ctx) != AXF_OK)
        return AXF_E_TRANSPORT;
    CUresult r = cu_check(drv.Memcpy(dst, src, len));
    ctx_pop();
    return r == CUDA_SUCCESS ? AXF_OK : AXF_E_TRANSPORT;
}

/* ---------------------------------------------------------------- host pins */

/* Host ranges we page-locked, with the context that did it (unregistered in
 * it). owner: the region or imported region they were pinned for. drv_mu. */
typedef struct pin {
    uint64_t lo, hi;
    CUcontext ctx;
    const void *owner;
    struct pin *next;
} pin;

static pin *pins;

/* Page-locks [p, p+n) for owner, in ctx (current on the calling thread, one
 * of ours). Best effort: memory pinned already by someone else, or a
 * refusal (RLIMIT_MEMLOCK), leaves it pageable and copies split around it.
 * Returns whether it is pinned for owner now. */
static bool pin_range(const void *owner, void *p, uint64_t n, bool readonly, CUcontext ctx)
{
    if (!drv.MemHostRegister || !drv.MemHostUnregister || !p || !n)
        return false;
    pthread_mutex_lock(&drv_mu);
    for (pin *q = pins; q; q = q->next)
        if (q->owner == owner) {
            pthread_mutex_unlock(&drv_mu);
            return true;
        }
    pthread_mutex_unlock(&drv_mu);
    unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | (readonly ? CU_MEMHOSTREGISTER_READ_ONLY : 0);
    if (cu_check(drv.MemHostRegister(p, n, flags)) != CUDA_SUCCESS)
        return false;
    pin *q = calloc(1, sizeof *q);
    if (!q) {
        drv.MemHostUnregister(p);
        return false;
    }
    q->lo = (uint64_t)(uintptr_t)p;
    q->hi = q->lo + n;
    q->ctx = ctx;
    q->owner = owner;
    pthread_mutex_lock(&drv_mu);
    q->next = pins;
    pins = q;
    pthread_mutex_unlock(&drv_mu);
    return true;
}

/* Page-locks one of our host regions. Its mapping is usually writable (its
 * access bits say what peers may do, not how it is mapped): pinned so. One
 * no transfer may write (no ACCESS_WRITE: op_resolve refuses a READ into it,
 * and peers' WRITEs are refused) may be a read-only mapping (a PROT_READ
 * mmap, a read-only tensor's pages), which the driver pins only with
 * CU_MEMHOSTREGISTER_READ_ONLY: asked that way when the first is refused, or
 * it stayed pageable and every GPU copy of it ran synchronously. (Not first:
 * a device without READ_ONLY_HOST_REGISTER_SUPPORTED refuses the flag.) */
static void pin_region(region *r, CUcontext ctx)
{
    if (!pin_range(r, r->addr, r->len, false, ctx) && !(r->access & AXF_ACCESS_WRITE))
        (void)pin_range(r, r->addr, r->len, true, ctx);
}

/* Unpins what was pinned for owner, on any thread (its context pushed). */
static void unpin_owner(const void *owner)
{
    pthread_mutex_lock(&drv_mu);
    pin *q = NULL;
    for (pin **pp = &pins; *pp; pp = &(*pp)->next)
        if ((*pp)->owner == owner) {
            q = *pp;
            *pp = q->next;
            break;
        }
    pthread_mutex_unlock(&drv_mu);
    if (!q)
        return;
    if (ctx_push(q->ctx) == AXF_OK) {
        drv.MemHostUnregister((void *)(uintptr_t)q->lo);
        ctx_pop();
    }
    free(q);
}

/* Whether host memory was page-locked for owner (not refused). */
static bool pin_held(const void *owner)
{
    pthread_mutex_lock(&drv_mu);
    pin *q = pins;
    while (q && q->owner != owner)
        q = q->next;
    pthread_mutex_unlock(&drv_mu);
    return q != NULL;
}

/* How far from host address p (at most n bytes) memory stays on the same
 * side of our pins: copies are split there, because one copy over page-locked
 * and pageable memory at once is refused by the driver. */
static uint64_t pin_run(uint64_t p, uint64_t n)
{
    uint64_t run = n;
    pthread_mutex_lock(&drv_mu);
    for (pin *q = pins; q; q = q->next) {
        if (p >= q->lo && p < q->hi && q->hi - p < run)
            run = q->hi - p; /* inside: up to its end */
        else if (p < q->lo && q->lo - p < run)
            run = q->lo - p; /* before: up to its start */
    }
    pthread_mutex_unlock(&drv_mu);
    return run;
}

static void cuda_unpin(region *r)
{
    unpin_owner(r);
    r->xp[AXF_EP_CUDA] = (void *)(uintptr_t)(pin_flags(r) & ~(uintptr_t)PIN_DONE);
}

/* ---------------------------------------------------------------- IPC mappings */

/* A peer allocation opened in this process in one device's context. A
 * handle may be opened once per (device, exporter) in a process, and several
 * regions (several agents' endpoints) may sit in one allocation: one entry
 * per (allocation, device), counted. drv_mu guards the list. */
typedef struct ipc_map {
    CUipcMemHandle h;
    int dev;
    CUcontext ctx;
    CUdeviceptr base;
    size_t size;
    int refs;
    struct ipc_map *next;
} ipc_map;

static ipc_map *ipc_maps;

struct cuda_rmap {
    bool own;          /* our own process's memory, used as is */
    uint64_t own_ptr;
    CUipcMemHandle h;  /* else: the peer's handle, opened per device at first use */
    uint64_t offset, len;
    int home;          /* the memory's device here (by UUID), -1 if not visible */
    pid_t pid;         /* the exporter */
    ipc_map *m[AXF_CUDA_MAX_DEVICES]; /* submit thread; freed at unmap */
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
    return -1;
}

static void ipc_release(ipc_map *m)
{
    pthread_mutex_lock(&drv_mu);
    bool last = --m->refs == 0;
    if (last)
        for (ipc_map **p = &ipc_maps; *p; p = &(*p)->next)
            if (*p == m) {
                *p = m->next;
                break;
            }
    pthread_mutex_unlock(&drv_mu);
    if (!last)
        return;
    if (ctx_push(m->ctx) == AXF_OK) {
        drv.IpcCloseMemHandle(m->base);
        ctx_pop();
    }
    free(m);
}

/* Whether process pid still runs: not a zombie (its memory is gone), and not
 * on its way to one. A killed process is still "R" or "D" while it tears
 * down its memory and files (an IPC open fails then), but its PF_EXITING
 * flag (0x4, field 9 of /proc/PID/stat) is set before any of that. */
static bool process_alive(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *rp = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold anything */
    if (!rp || rp[1] != ' ' || rp[2] == 'Z' || rp[2] == 'X')
        return false;
    /* state ppid pgrp session tty_nr tpgid flags */
    unsigned long flags = 0;
    if (sscanf(rp + 2, "%*c %*d %*d %*d %*d %*d %lu", &flags) == 1 && (flags & 0x4))
        return false;
    return true;
}

/* The peer's allocation opened in dev's context (current on the calling
 * thread, ctx): cached per (handle, device). Returns AXF_OK with cm->m[dev]. */
static int rmap_open(cuda_rmap *cm, int dev, CUcontext ctx, char *why, size_t why_len)
{
    if (cm->m[dev])
        return AXF_OK;
    int st = AXF_OK;
    /* Looked up and opened under one lock: a handle may be opened only once
     * per (device, exporter), also by two engines at the same time. */
    pthread_mutex_lock(&drv_mu);
    ipc_map *m = ipc_maps;
    while (m && !(m->dev == dev && memcmp(m->h.reserved, cm->h.reserved, sizeof m->h) == 0))
        m = m->next;
    if (m) {
        m->refs++;
    } else if (!(m = calloc(1, sizeof *m))) {
        st = AXF_E_NOMEM;
    } else {
        m->h = cm->h;
        m->dev = dev;
        m->ctx = ctx;
        m->refs = 1;
        /* Lazy peer access: the mapping is reachable from this device even
         * when the memory is on another one (peer-to-peer, not via host). */
        CUresult r = cu_check(drv.IpcOpenMemHandle(&m->base, cm->h,
                                                   CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        CUdeviceptr b2 = 0;
        char b[120];
        if (r != CUDA_SUCCESS) {
            snprintf(why, why_len, "cuIpcOpenMemHandle on device %d: %s", dev,
                     cu_err(r, b, sizeof b));
            st = AXF_E_TRANSPORT;
        } else if ((r = drv.MemGetAddressRange(&b2, &m->size, m->base)) != CUDA_SUCCESS) {
            snprintf(why, why_len, "cuMemGetAddressRange of an IPC mapping: %s",
                     cu_err(r, b, sizeof b));
            drv.IpcCloseMemHandle(m->base);
            st = AXF_E_TRANSPORT;
        } else if (b2 != m->base) {
            snprintf(why, why_len, "an IPC mapping at 0x%llx lies inside an allocation at 0x%llx",
                     (unsigned long long)m->base, (unsigned long long)b2);
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
    if (st == AXF_E_TRANSPORT && !process_alive(cm->pid))
        st = AXF_E_PEER_LOST; /* its memory went with it */
    if (st != AXF_OK)
        return st;
    /* The allocation's true size bounds what the peer's metadata claims. */
    if (cm->offset > m->size || cm->len > m->size - cm->offset) {
        ipc_release(m);
        snprintf(why, why_len, "the peer's region runs past its allocation");
        return AXF_E_ACCESS;
    }
    cm->m[dev] = m;
    return AXF_OK;
}

static int cuda_import(endpoint *ep, rregion *rr, const uint8_t *handle, uint64_t offset,
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
        cm->own = true;
        cm->own_ptr = rr->addr;
        rr->xp[AXF_EP_CUDA] = cm;
        return AXF_OK;
    }
    if (!handle) {
        free(cm);
        return AXF_E_INVALID;
    }
    /* Opened at first use, in the context of the device that copies it
     * (which this process may not even have a context on yet). */
    memcpy(cm->h.reserved, handle, sizeof cm->h.reserved);
    cm->offset = offset;
    cm->len = rr->len;
    cm->home = dev_by_uuid(uuid);
    cm->pid = ep->pid;
    rr->xp[AXF_EP_CUDA] = cm;
    return AXF_OK;
}

static void cuda_unmap(rregion *rr)
{
    unpin_owner(rr); /* our mapping of a peer's host memory, if pinned */
    cuda_rmap *cm = CU_RM(rr);
    if (!cm)
        return;
    rr->xp[AXF_EP_CUDA] = NULL;
    for (int d = 0; d < AXF_CUDA_MAX_DEVICES; d++)
        if (cm->m[d])
            ipc_release(cm->m[d]);
    free(cm);
}

/* Test and tool hook: how many peer allocations this process has open. */
int axf_cuda_ipc_open_count(void)
{
    int n = 0;
    pthread_mutex_lock(&drv_mu);
    for (ipc_map *m = ipc_maps; m; m = m->next)
        n++;
    pthread_mutex_unlock(&drv_mu);
    return n;
}

/* ---------------------------------------------------------------- engine state */

#define CU_EV_POOL 32 /* free events kept per device */

typedef struct cuda_job {
    op *o;          /* NULL: a pin job (pin) */
    region *pin;    /* a host region to page-lock ahead of its first copy (ref held) */
    CUevent ev;     /* NULL: nothing to wait for (or the stream was synchronised) */
    int dev;        /* the stream's device (whose free events ev goes back to) */
    bool polled;    /* its poster polled ev for the poll bound already */
    CUcontext ctx;  /* the stream's */
    struct cuda_job *next;
} cuda_job;

struct axf_cuda {
    axf_engine *e;
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* submit queue */
    pthread_cond_t wcv; /* wait queue */
    cuda_job *sq_head, *sq_tail; /* posted, not yet enqueued on a stream */
    cuda_job *wq_head, *wq_tail; /* enqueued, waiting for their event */
    bool stop, started, poison_logged;
    /* Posting threads inside cuda_submit (mu). The submit thread leaves
     * (stop) only once none is: one may still enqueue to it, and one that
     * completes its own op (a lone op, job_done) touches this struct, the
     * event pool and the op after letting go of smu. cuda_stop joins the
     * submit thread, so nothing is left of a poster when it returns: the
     * engine's shutdown then finds (and fails) only ops nobody holds, and
     * cuda_free destroys nothing still in use. */
    int posters;
    pthread_t submitter, waiter;
    /* Held by whoever enqueues copies (the submit thread, or a posting thread
     * that found the submit queue empty: cuda_submit): streams, IPC maps. */
    pthread_mutex_t smu;
    bool hold;        /* smu: the submit thread's handoff keeps its job (held) */
    cuda_job *held;
    CUstream stream[AXF_CUDA_MAX_DEVICES]; /* smu */
    CUcontext sctx[AXF_CUDA_MAX_DEVICES];  /* the context each stream lives in */
    /* Events waited on and free again, per stream (its context's), reused as
     * UCX does: cuEventCreate and cuEventDestroy cost microseconds each on a
     * real driver, per op. mu. */
    CUevent evfree[AXF_CUDA_MAX_DEVICES][CU_EV_POOL];
    int nevfree[AXF_CUDA_MAX_DEVICES];
};

static region *op_lregion(const op *o, size_t i)
{
    for (size_t j = 0; j < o->nlregs; j++)
        if (o->lregs[j]->id == o->d[i].lrid)
            return o->lregs[j];
    return NULL;
}

static bool desc_local_gpu(const op *o, size_t i)
{
    region *r = op_lregion(o, i);
    return r && r->kind == AXF_MEM_CUDA;
}

/* The peer-side address of descriptor i as seen from device dev. */
static uint64_t rptr(const op *o, size_t i, int dev)
{
    rregion *rr = o->rr[i];
    uint64_t off = o->d[i].roff;
    cuda_rmap *cm = CU_RM(rr);
    if (cm)
        return (cm->own ? cm->own_ptr : cm->m[dev]->base + cm->offset) + off;
    return (uint64_t)(uintptr_t)(shm_far_map(rr) + off); /* host memfd mapping (cuda_op_check) */
}

/* The device whose stream copies op o: where its local GPU memory is, else
 * where the peer's is. */
static int op_device(const op *o)
{
    ptr_attr a;
    for (size_t i = 0; i < o->n; i++)
        if (desc_local_gpu(o, i) && ptr_query((uint64_t)(uintptr_t)o->laddr[i], &a))
            return a.dev;
    for (size_t i = 0; i < o->n; i++) {
        cuda_rmap *cm = CU_RM(o->rr[i]);
        if (cm && cm->own && ptr_query(cm->own_ptr, &a))
            return a.dev;
        if (cm && !cm->own && cm->home >= 0)
            return cm->home;
    }
    return 0; /* the peer's device is not visible here: any device maps it */
}

/* GPU memory of ours on another device than the stream's: reachable once
 * peer access is enabled (NVLink / PCIe P2P). Current context: dev's. */
static int enable_peers(struct axf_cuda *c, const op *o, int dev, char *why, size_t why_len)
{
    for (size_t i = 0; i < o->n; i++) {
        uint64_t p[2] = {desc_local_gpu(o, i) ? (uint64_t)(uintptr_t)o->laddr[i] : 0,
                         CU_RM(o->rr[i]) && CU_RM(o->rr[i])->own ? CU_RM(o->rr[i])->own_ptr : 0};
        for (int k = 0; k < 2; k++) {
            ptr_attr a;
            if (!p[k] || !ptr_query(p[k], &a) || a.dev == dev)
                continue;
            CUdevice d1, d2;
            int can = 0;
            if (drv.DeviceGet(&d1, dev) != CUDA_SUCCESS ||
                drv.DeviceGet(&d2, a.dev) != CUDA_SUCCESS ||
                drv.DeviceCanAccessPeer(&can, d1, d2) != CUDA_SUCCESS || !can) {
                snprintf(why, why_len, "device %d cannot access device %d's memory (no peer "
                         "access between them)", dev, a.dev);
                return AXF_E_TRANSPORT;
            }
            CUresult r = drv.CtxEnablePeerAccess(a.ctx, 0);
            if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
                char b[120];
                snprintf(why, why_len, "cuCtxEnablePeerAccess %d -> %d: %s", dev, a.dev,
                         cu_err(r, b, sizeof b));
                return AXF_E_TRANSPORT;
            }
        }
    }
    (void)c;
    return AXF_OK;
}

/* Page-locks the host memory the op's copies touch, once: our regions, and
 * our mappings of a peer's memfd regions. Copies from pageable memory go
 * through the driver's bounce buffers and block the calling thread; pinned
 * memory is read by DMA, asynchronously. */
static void pin_op(const op *o, CUcontext ctx)
{
    for (size_t i = 0; i < o->nlregs; i++) {
        region *r = o->lregs[i];
        if (r->kind != AXF_MEM_HOST || (pin_flags(r) & PIN_TRIED))
            continue;
        pin_flags_set(r, PIN_TRIED);
        pin_region(r, ctx);
        pin_flags_set(r, PIN_DONE); /* cuda_unpin looks it up (nothing if refused) */
    }
    for (size_t i = 0; i < o->nrregs; i++) {
        rregion *rr = o->rregs[i];
        uint8_t *map = CU_RM(rr) ? NULL : shm_far_map(rr);
        if (map) /* mapped read-only when the peer grants no write */
            (void)pin_range(rr, map, rr->len, !(rr->access & AXF_ACCESS_WRITE), ctx);
    }
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

/* An op enqueued (or failed) goes to the waiter; from the submit thread only
 * once it has let go of smu (submit_main), so that a completion never finds
 * smu still held: the next lone op is then its posting thread's. smu held. */
static void handoff(struct axf_cuda *c, cuda_job *j)
{
    if (c->hold)
        c->held = j;
    else
        wq_push(c, j);
}

static void op_fail(struct axf_cuda *c, op *o, int st, uint64_t index, const char *why)
{
    op_set_status(o, st, index);
    if (why && *why)
        cq_log(c->e, o->ep ? o->ep->tag : 0, "cuda: %s", why);
}

/* The exporting process is gone (found opening its memory): the endpoint is
 * lost, reported before the op that found it completes, so that a caller
 * woken by that op sees the peer lost (as verbs does for a dead queue pair). */
static void peer_gone(struct axf_cuda *c, endpoint *ep)
{
    axf_engine *e = c->e;
    pthread_mutex_lock(&e->mu);
    bool report = !ep->dead && !ep->closing && !ep->lost_reported;
    if (report)
        ep->lost_reported = true;
    for (int i = 0; i < ep->nconns; i++)
        conn_kill(ep->conns[i]);
    pthread_mutex_unlock(&e->mu);
    if (report)
        cq_push(e, AXF_CQ_PEER_LOST, AXF_E_PEER_LOST, ep->id, ep->tag, 0, 0, NULL, 0);
}

/* Enqueues one op's copies and hands it to the waiter. smu held. caller:
 * on a posting thread (cuda_submit): its context is pushed and popped, the
 * thread's context stack left as it was; else the submit thread's own,
 * which keeps its context current. */
static void submit_copies(struct axf_cuda *c, cuda_job *j, int dev, CUcontext ctx);

static void submit_one(struct axf_cuda *c, cuda_job *j, bool caller)
{
    op *o = j->o;
    char why[200] = "";
    j->next = NULL;
    if (atomic_load(&o->cancelled) || atomic_load(&o->status) != AXF_OK) {
        handoff(c, j);
        return;
    }
    if (atomic_load(&drv.poisoned)) {
        if (!c->poison_logged) /* once per engine: every later op fails alike */
            snprintf(why, sizeof why, "%s", drv.poison_why);
        c->poison_logged = true;
        op_fail(c, o, AXF_E_TRANSPORT, 0, why);
        handoff(c, j);
        return;
    }
    int dev = op_device(o);
    CUcontext ctx = dev_context(dev);
    if (!ctx || (caller ? ctx_push(ctx) != AXF_OK : drv.CtxSetCurrent(ctx) != CUDA_SUCCESS)) {
        snprintf(why, sizeof why, "no usable context on device %d", dev);
        op_fail(c, o, AXF_E_TRANSPORT, 0, why);
        handoff(c, j);
        return;
    }
    submit_copies(c, j, dev, ctx);
    if (caller)
        ctx_pop();
}

static void submit_copies(struct axf_cuda *c, cuda_job *j, int dev, CUcontext ctx)
{
    op *o = j->o;
    char why[200] = "", b[120];
    if (!c->stream[dev]) {
        CUresult r = drv.StreamCreate(&c->stream[dev], CU_STREAM_NON_BLOCKING);
        if (r != CUDA_SUCCESS) {
            c->stream[dev] = NULL;
            snprintf(why, sizeof why, "cuStreamCreate on device %d: %s", dev,
                     cu_err(r, b, sizeof b));
            op_fail(c, o, AXF_E_TRANSPORT, 0, why);
            handoff(c, j);
            return;
        }
        c->sctx[dev] = ctx;
    }
    CUstream s = c->stream[dev];
    j->ctx = c->sctx[dev];
    for (size_t i = 0; i < o->n; i++) {
        cuda_rmap *cm = CU_RM(o->rr[i]);
        int st = cm && !cm->own ? rmap_open(cm, dev, ctx, why, sizeof why) : AXF_OK;
        if (st == AXF_E_PEER_LOST)
            peer_gone(c, o->ep);
        if (st != AXF_OK) {
            op_fail(c, o, st, i, why);
            handoff(c, j);
            return;
        }
    }
    int st = enable_peers(c, o, dev, why, sizeof why);
    if (st != AXF_OK) {
        op_fail(c, o, st, 0, why);
        handoff(c, j);
        return;
    }
    pin_op(o, ctx);
    size_t done = 0;
    uint64_t bytes = 0;
    bool failed = false;
    for (; done < o->n && !failed; done++) {
        uint64_t l = (uint64_t)(uintptr_t)o->laddr[done], r = rptr(o, done, dev);
        uint64_t len = o->d[done].len;
        bool lhost = !desc_local_gpu(o, done), rhost = !CU_RM(o->rr[done]);
        uint64_t dst = o->opcode == AXF_OP_WRITE ? r : l, src = o->opcode == AXF_OP_WRITE ? l : r;
        bool dhost = o->opcode == AXF_OP_WRITE ? rhost : lhost;
        bool shost = o->opcode == AXF_OP_WRITE ? lhost : rhost;
        for (uint64_t off = 0; off < len;) {
            uint64_t n = len - off;
            if (dhost)
                n = pin_run(dst + off, n);
            if (shost)
                n = pin_run(src + off, n);
            CUresult rc = cu_check(drv.MemcpyAsync(dst + off, src + off, n, s));
            if (rc != CUDA_SUCCESS) {
                snprintf(why, sizeof why, "cuMemcpyAsync of %llu bytes on device %d: %s",
                         (unsigned long long)n, dev, cu_err(rc, b, sizeof b));
                op_fail(c, o, AXF_E_TRANSPORT, done, why);
                failed = true;
                break;
            }
            off += n;
            bytes += n;
        }
    }
    atomic_fetch_add(&o->nbytes, bytes);
    if (!bytes) {
        handoff(c, j);
        return;
    }
    /* Copies are in flight: the op's memory stays pinned until they are over. */
    j->dev = dev;
    pthread_mutex_lock(&c->mu);
    if (c->nevfree[dev])
        j->ev = c->evfree[dev][--c->nevfree[dev]];
    pthread_mutex_unlock(&c->mu);
    if ((!j->ev && drv.EventCreate(&j->ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) !=
                       CUDA_SUCCESS) ||
        drv.EventRecord(j->ev, s) != CUDA_SUCCESS) {
        if (j->ev)
            drv.EventDestroy(j->ev);
        j->ev = NULL;
        if (cu_check(drv.StreamSynchronize(s)) != CUDA_SUCCESS)
            op_set_status(o, AXF_E_TRANSPORT, 0);
    }
    handoff(c, j);
}

/* A pin job: page-locks a host region now, off the caller's thread, rather
 * than at its first GPU copy (pinning a pool of many GB takes a while: the
 * first copy would wait for it). In a context of ours when one is known;
 * else left to the first copy, which then has one. Submit thread. */
static void pin_ahead(struct axf_cuda *c, region *r, bool stopping)
{
    CUcontext ctx = NULL;
    pthread_mutex_lock(&drv_mu);
    for (int d = 0; d < drv.ndev && !ctx; d++)
        ctx = drv.dev_ctx[d];
    pthread_mutex_unlock(&drv_mu);
    if (!stopping && ctx && !(pin_flags(r) & PIN_TRIED) && drv.CtxSetCurrent(ctx) == CUDA_SUCCESS) {
        pin_flags_set(r, PIN_TRIED);
        pin_region(r, ctx);
        pin_flags_set(r, PIN_DONE);
    }
    region_unref(c->e, r);
}

/* Hands a job to the submit thread (FIFO: a pin queued before a copy runs
 * first). false: that thread is gone or leaving (stopped, no posting thread
 * left to keep it: submit_main's exit condition), the job is the caller's. */
static bool submit_enqueue(struct axf_cuda *c, cuda_job *j)
{
    pthread_mutex_lock(&c->mu);
    if (c->stop && !c->posters) {
        pthread_mutex_unlock(&c->mu);
        return false;
    }
    if (c->sq_tail)
        c->sq_tail->next = j;
    else
        c->sq_head = j;
    c->sq_tail = j;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return true;
}

int axf_cuda_pin_region(axf_engine *e, uint64_t rid)
{
    pthread_mutex_lock(&e->mu);
    struct axf_cuda *c = CU_OF(e);
    region *r = c && !e->shut ? region_get(e, rid) : NULL;
    pthread_mutex_unlock(&e->mu);
    if (!c)
        return AXF_E_TRANSPORT;
    if (!r)
        return AXF_E_NOTFOUND;
    cuda_job *j = r->kind == AXF_MEM_HOST ? calloc(1, sizeof *j) : NULL;
    if (!j) {
        int st = r->kind == AXF_MEM_HOST ? AXF_E_NOMEM : AXF_E_INVALID;
        region_unref(e, r);
        return st;
    }
    j->pin = r;
    /* Shutdown began after the check above: the job (and the region's
     * reference) would sit in a queue nobody runs. */
    if (!submit_enqueue(c, j)) {
        region_unref(e, r);
        free(j);
        return AXF_E_CLOSED;
    }
    return AXF_OK;
}

static void *submit_main(void *arg)
{
    struct axf_cuda *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->sq_head && !(c->stop && !c->posters))
            pthread_cond_wait(&c->cv, &c->mu);
        cuda_job *j = c->sq_head;
        if (!j)
            break;
        c->sq_head = j->next;
        if (!c->sq_head)
            c->sq_tail = NULL;
        bool stopping = c->stop;
        pthread_mutex_unlock(&c->mu);
        pthread_mutex_lock(&c->smu);
        if (!j->o) {
            pin_ahead(c, j->pin, stopping);
            free(j);
            j = NULL;
        } else {
            if (stopping)
                op_set_status(j->o, AXF_E_CLOSED, 0);
            c->hold = true;
            submit_one(c, j, false);
            c->hold = false;
            j = c->held;
            c->held = NULL;
        }
        pthread_mutex_unlock(&c->smu);
        if (j)
            wq_push(c, j);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Waits for an op's event. Where the engine polls (progress "adaptive" and
 * "poll": target_poll_us is not "never"), the waiter first polls cuEventQuery
 * for the engine's poll bound, as UCX's cuda_ipc does on its caller's
 * progress: a small copy is over within a few microseconds, and its
 * completion then costs no interrupt and no wake-up of this thread from the
 * driver. Only with an op waiting (never while idle); past the bound, the
 * blocking-sync wait sleeps in the driver as before. */
static CUresult event_wait_bounded(axf_engine *e, CUevent ev)
{
    CUresult r = CUDA_ERROR_NOT_READY;
    if (e->cfg.target_poll_us != UINT32_MAX && e->poll_us) {
        uint64_t end = axf_now_ns() + (uint64_t)e->poll_us * 1000u;
        for (unsigned i = 0;; i++) {
            r = drv.EventQuery(ev);
            if (r != CUDA_ERROR_NOT_READY)
                return r;
            if ((i & 15) == 15) {
                if (axf_now_ns() >= end)
                    break;
                /* a machine with more runnable threads than cores: the one
                 * this waits for (a driver's, the peer's) may need the core */
                sched_yield();
            } else {
                cpu_relax();
            }
        }
    }
    return r;
}

static CUresult event_wait(axf_engine *e, CUevent ev)
{
    CUresult r = event_wait_bounded(e, ev);
    return r == CUDA_ERROR_NOT_READY ? drv.EventSynchronize(ev) : r;
}

/* An op's copies are over (r: how its event ended): completes it. */
static void job_done(struct axf_cuda *c, cuda_job *j, CUresult r)
{
    if (j->ev) {
        if (r != CUDA_SUCCESS) {
            char b[120];
            op_fail(c, j->o, AXF_E_TRANSPORT, 0, cu_err(r, b, sizeof b));
        }
        bool kept = false;
        if (r == CUDA_SUCCESS) { /* reached: free for the stream's next op */
            pthread_mutex_lock(&c->mu);
            if ((kept = c->nevfree[j->dev] < CU_EV_POOL))
                c->evfree[j->dev][c->nevfree[j->dev]++] = j->ev;
            pthread_mutex_unlock(&c->mu);
        }
        if (!kept)
            drv.EventDestroy(j->ev);
    }
    op *o = j->o;
    free(j);
    op_unit_done(c->e, o);
}

static void *wait_main(void *arg)
{
    struct axf_cuda *c = arg;
    axf_engine *e = c->e;
    CUcontext bound = NULL;
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
        CUresult r = CUDA_SUCCESS;
        if (j->ev) {
            if (bound != j->ctx && drv.CtxSetCurrent(j->ctx) == CUDA_SUCCESS) /* our thread */
                bound = j->ctx;
            r = cu_check(j->polled ? drv.EventSynchronize(j->ev) : event_wait(e, j->ev));
        }
        job_done(c, j, r);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int axf_cuda_enable(axf_engine *e, char *why, size_t why_len)
{
    int st = drv_ready();
    if (why && why_len)
        snprintf(why, why_len, "%s", atomic_load(&drv.poisoned) ? drv.poison_why : drv.why);
    if (st != AXF_OK)
        return st;
    pthread_mutex_lock(&e->mu);
    if (CU_OF(e) || e->shut) {
        st = e->shut ? AXF_E_CLOSED : AXF_OK;
        pthread_mutex_unlock(&e->mu);
        return st;
    }
    struct axf_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        pthread_mutex_unlock(&e->mu);
        return AXF_E_NOMEM;
    }
    c->e = e;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->smu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->wcv, NULL);
    e->xp[AXF_EP_CUDA] = c;
    c->started = true;
    st = AXF_OK;
    if (pthread_create(&c->submitter, NULL, submit_main, c) != 0) {
        st = AXF_E_NOMEM;
    } else if (pthread_create(&c->waiter, NULL, wait_main, c) != 0) {
        /* Nothing reached the submitter yet (e->mu is held: no poster found
         * c): it leaves at once. */
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->submitter, NULL);
        st = AXF_E_NOMEM;
    }
    if (st != AXF_OK) {
        /* Every failure undoes all of the above, as cuda_free would (no
         * stream or event exists yet): the engine is as it was, and a later
         * enable starts afresh. */
        e->xp[AXF_EP_CUDA] = NULL;
        pthread_mutex_destroy(&c->mu);
        pthread_mutex_destroy(&c->smu);
        pthread_cond_destroy(&c->cv);
        pthread_cond_destroy(&c->wcv);
        free(c);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

static bool cuda_ready(axf_engine *e) { return CU_OF(e) != NULL; }

/* ---------------------------------------------------------------- ops */

static bool cuda_op_is_gpu(const op *o)
{
    for (size_t i = 0; i < o->nlregs; i++)
        if (o->lregs[i]->kind == AXF_MEM_CUDA)
            return true;
    for (size_t i = 0; i < o->nrregs; i++)
        if (CU_RM(o->rregs[i]))
            return true;
    return false;
}

static int cuda_op_check(op *o)
{
    if (!cuda_op_is_gpu(o))
        return AXF_OK;
    /* A GPU copy reaches a peer's host memory only through our mapping of it
     * (an agent.alloc'd memfd region); cross-memory attach has no device path. */
    for (size_t i = 0; i < o->n; i++)
        if (!CU_RM(o->rr[i]) && !shm_far_map(o->rr[i])) {
            o->fail_index = i;
            return AXF_E_INVALID;
        }
    return AXF_OK;
}

/* Descriptors a posting thread enqueues itself at most (one cuMemcpyAsync
 * each, a few microseconds): a longer op goes to the submit thread. */
#define CU_CALLER_MAX_DESCS 16

/* Whether the posting thread may enqueue op o's copies itself: short work
 * only. Device memory, or host memory page-locked already (pinning takes a
 * while, and a copy touching pageable memory runs synchronously in the
 * driver), the peer's allocations already open on the op's device (an IPC
 * open takes milliseconds), its stream made, and nothing the submit thread
 * has to report. smu held. */
static bool caller_may_submit(struct axf_cuda *c, const op *o)
{
    if (o->n > CU_CALLER_MAX_DESCS || atomic_load(&drv.poisoned) ||
        atomic_load(&o->cancelled) || atomic_load(&o->status) != AXF_OK)
        return false;
    for (size_t i = 0; i < o->nlregs; i++) {
        region *r = o->lregs[i];
        if (r->kind != AXF_MEM_CUDA &&
            (r->kind != AXF_MEM_HOST || !(pin_flags(r) & PIN_DONE) || !pin_held(r)))
            return false;
    }
    for (size_t i = 0; i < o->nrregs; i++) {
        rregion *rr = o->rregs[i];
        if (!CU_RM(rr) && (!shm_far_map(rr) || !pin_held(rr)))
            return false;
    }
    int dev = op_device(o);
    if (dev < 0 || dev >= drv.ndev || !c->stream[dev])
        return false;
    for (size_t i = 0; i < o->n; i++) {
        const cuda_rmap *cm = CU_RM(o->rr[i]);
        if (cm && !cm->own && !cm->m[dev])
            return false;
    }
    return true;
}

/* Bytes of a lone op (AXF_POST_ALONE) whose posting thread polls its event
 * itself: what a GPU copies in about the time of the hand-off it saves. */
#define CU_ALONE_BYTES (1u << 20)

/* A posting thread is done with c and its op (c->posters). */
static void poster_leave(struct axf_cuda *c)
{
    pthread_mutex_lock(&c->mu);
    if (--c->posters == 0 && c->stop)
        pthread_cond_broadcast(&c->cv); /* the submit thread may leave now */
    pthread_mutex_unlock(&c->mu);
}

static void cuda_post_one(struct axf_cuda *c, op *o, uint32_t flags);

static void cuda_submit(axf_engine *e, op *o, uint32_t flags)
{
    struct axf_cuda *c = CU_OF(e);
    atomic_store(&o->remaining, 1);
    pthread_mutex_lock(&c->mu);
    bool stopped = c->stop;
    if (!stopped)
        c->posters++;
    pthread_mutex_unlock(&c->mu);
    /* Posted while the engine shuts down, past cuda_stop's wait for posting
     * threads: nothing of ours runs any more, and completing it here would
     * race the shutdown's own sweep of what is left on the endpoint (marked
     * closed already), which completes it. */
    if (stopped)
        return;
    cuda_post_one(c, o, flags);
    poster_leave(c);
}

static void cuda_post_one(struct axf_cuda *c, op *o, uint32_t flags)
{
    axf_engine *e = c->e;
    cuda_job *j = calloc(1, sizeof *j);
    if (!j) {
        op_set_status(o, AXF_E_NOMEM, 0);
        op_unit_done(e, o);
        return;
    }
    j->o = o;
    /* Nothing queued before it and nobody enqueueing: the posting thread
     * enqueues its copies itself, sparing the submit thread's wake-up (the
     * order of what is queued is kept: only with an empty queue). */
    pthread_mutex_lock(&c->mu);
    bool mine = !c->stop && !c->sq_head && pthread_mutex_trylock(&c->smu) == 0;
    pthread_mutex_unlock(&c->mu);
    if (mine) {
        bool ok = caller_may_submit(c, o);
        uint64_t total = 0;
        for (size_t i = 0; ok && i < o->n; i++)
            total += o->d[i].len;
        /* A lone small op where the engine polls: this thread polls its event
         * too (for the engine's poll bound, as the waiter would; as UCX does
         * on its caller's progress) and completes it, with no hand-off at all;
         * a notification follows from the connection, so not with one. Polled
         * under smu, completed after it (job_done may take a while: a failed
         * event's error text, the engine's locks); cuda_stop waits for both
         * (c->posters), and the waiter is still there for an op this gives
         * up on. */
        bool own = ok && (flags & AXF_POST_ALONE) && total <= CU_ALONE_BYTES &&
                   !o->notify_len && e->cfg.target_poll_us != UINT32_MAX && e->poll_us;
        if (ok) {
            c->hold = own;
            submit_one(c, j, true);
            c->hold = false;
        }
        cuda_job *mj = c->held;
        c->held = NULL;
        if (mj && mj->ev && ctx_push(mj->ctx) == AXF_OK) {
            CUresult r = event_wait_bounded(e, mj->ev);
            ctx_pop();
            if (r != CUDA_ERROR_NOT_READY) {
                pthread_mutex_unlock(&c->smu);
                axf_cq_quiet = (flags & AXF_POST_POLL) != 0;
                job_done(c, mj, cu_check(r));
                axf_cq_quiet = false;
                return;
            }
        }
        if (mj) {
            mj->polled = mj->ev != NULL;
            wq_push(c, mj);
        }
        pthread_mutex_unlock(&c->smu);
        if (ok)
            return;
    }
    submit_enqueue(c, j); /* kept by this poster (c->posters): never refused */
}

static void cuda_stop(axf_engine *e)
{
    struct axf_cuda *c = CU_OF(e);
    if (!c || !c->started)
        return;
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    /* Fails what was not enqueued yet; leaves once no posting thread is in
     * cuda_submit (c->posters): their enqueueing and their own completions
     * are over too. */
    pthread_join(c->submitter, NULL);
    pthread_mutex_lock(&c->mu);
    c->started = false;
    pthread_cond_broadcast(&c->wcv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->waiter, NULL); /* waits for what was */
}

static void cuda_free(axf_engine *e)
{
    struct axf_cuda *c = CU_OF(e);
    if (!c)
        return;
    cuda_stop(e);
    for (int d = 0; d < AXF_CUDA_MAX_DEVICES; d++)
        if (c->stream[d] && ctx_push(c->sctx[d]) == AXF_OK) { /* the caller's thread */
            for (int i = 0; i < c->nevfree[d]; i++)
                drv.EventDestroy(c->evfree[d][i]);
            drv.StreamDestroy(c->stream[d]);
            ctx_pop();
        }
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->smu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->wcv);
    free(c);
    e->xp[AXF_EP_CUDA] = NULL;
}


/* ---------------------------------------------------------------- transport */

int axf_endpoint_import_cuda(axf_engine *e, uint64_t ep_id, uint64_t rid, uint64_t key,
                             uint64_t len, uint32_t access, uint64_t addr, const uint8_t *handle,
                             uint64_t offset, const uint8_t uuid[16])
{
    static const uint8_t no_uuid[16];
    if (!len)
        return AXF_E_INVALID;
    rregion *rr = rregion_new(rid, key, len, access, addr);
    if (!rr)
        return AXF_E_NOMEM;
    pthread_mutex_lock(&e->mu);
    endpoint *ep = ep_find(e, ep_id);
    int st = !ep ? AXF_E_NOTFOUND : ep->dead ? AXF_E_CLOSED
             : ep->kind != AXF_EP_CUDA ? AXF_E_INVALID : AXF_OK;
    pthread_mutex_unlock(&e->mu);
    /* Opening the handle may take a while: not under the engine lock (an
     * endpoint lives as long as the engine). */
    if (st == AXF_OK)
        st = cuda_import(ep, rr, handle, offset, uuid ? uuid : no_uuid);
    if (st != AXF_OK) {
        free(rr);
        return st;
    }
    pthread_mutex_lock(&e->mu);
    if (ep->dead) {
        pthread_mutex_unlock(&e->mu);
        cuda_unmap(rr);
        free(rr);
        return AXF_E_CLOSED;
    }
    rregion_publish(ep, rr);
    rr_unmap_idle(ep);
    pthread_mutex_unlock(&e->mu);
    return AXF_OK;
}

static int cuda_ep_open(axf_engine *e, endpoint *ep)
{
    (void)ep;
    return cuda_ready(e) ? AXF_OK : AXF_E_TRANSPORT; /* axf_cuda_enable first */
}

static void cuda_region_free(axf_engine *e, region *r)
{
    (void)e;
    if (pin_flags(r) & PIN_DONE)
        cuda_unpin(r);
}

static bool cuda_post(axf_engine *e, op *o, uint32_t flags)
{
    if (!cuda_op_is_gpu(o))
        return shm_post(e, o, flags); /* host to host: the same-host copies */
    pthread_mutex_unlock(&e->mu);
    cuda_submit(e, o, flags); /* the CUDA threads enqueue and complete it */
    return true;
}

const axf_transport axf_xp_cuda = {
    .abi = AXF_TRANSPORT_ABI,
    .name = "cuda",
    .ep_kind = AXF_EP_CUDA,
    .caps = AXF_XP_CAP_SAME_HOST | AXF_XP_CAP_NOTIFY | AXF_XP_CAP_OWN_DATA |
            AXF_XP_CAP_EAGER_UNMAP,
    .local_mem = AXF_MEM_BIT(AXF_MEM_HOST) | AXF_MEM_BIT(AXF_MEM_CUDA),
    .far_mem = AXF_MEM_BIT(AXF_MEM_HOST) | AXF_MEM_BIT(AXF_MEM_CUDA),
    .quiesce = cuda_stop,
    .destroy = cuda_free,
    .region_free = cuda_region_free,
    .ep_open = cuda_ep_open,
    .ep_import_fd = shm_map, /* host regions shared as memfds: mapped as shm does */
    .rr_unmap = cuda_unmap,
    .check = cuda_op_check,
    .submit = cuda_post,
};

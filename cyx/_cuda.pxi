# Included by _cyx.pyx (one extension module, split by family as uvloop is):
# The CUDA driver, process-wide.

# ------------------------------------------------------------------ CUDA (process-wide)

# The driver's path ($AIOXFER_CUDA_DRIVER) is read when the driver is first
# loaded, which may be inside any of the calls below, with the GIL released.
# Were that the process's first use of the native code (no engine, no probe
# yet), its first environment snapshot (getenv) ran there, beside a Python
# thread writing os.environ: so the first of these calls takes it first,
# with the GIL, and later ones need not (an engine's creation and the probe
# take a fresh one anyway). Not at import: a variable set after the import
# and before the first use is seen, as it was.
cdef bint _cuda_env_read = False


cdef inline void _cuda_env(bint fresh=False) noexcept:
    global _cuda_env_read
    if fresh or not _cuda_env_read:
        axf_env_read()
        _cuda_env_read = True


def cuda_probe():
    """(status, reason, devices): OK when the CUDA driver loaded and sees devices.
    Never raises: without a driver the status says why."""
    cdef char why[256]
    cdef int n = 0
    cdef int st
    why[0] = 0
    _cuda_env(True)  # with the GIL: $AIOXFER_CUDA_DRIVER as it is now, never getenv off it
    with nogil:
        st = axf_cuda_probe(why, sizeof(why), &n)
    return st, why.decode("utf-8", "replace"), n


def cuda_device_name(int ordinal):
    cdef char name[256]
    name[0] = 0
    _check(axf_cuda_device_name(ordinal, name, sizeof(name)), f"cannot name CUDA device {ordinal}")
    return name.decode("utf-8", "replace")


def cuda_pointer(uint64_t ptr, uint64_t nbytes):
    """(device, allocation base, allocation size) of device memory [ptr, ptr+nbytes)."""
    cdef int dev = -1
    cdef uint64_t base = 0, size = 0
    cdef int st
    cdef char why[256]
    _cuda_env()
    with nogil:
        st = axf_cuda_pointer(ptr, nbytes, &dev, &base, &size)
    if st != 0:
        # Say what the memory is (managed, past its mapping, host memory):
        # "not inside one allocation" alone misled for managed memory.
        why[0] = 0
        axf_cuda_describe(ptr, nbytes, why, sizeof(why))
        _check(st, why.decode("utf-8", "replace") or
               f"{nbytes} bytes at {ptr:#x} are not inside one CUDA allocation")
    return dev, base, size


def cuda_device_info(int ordinal):
    """(dmabuf export supported, PCI address, bitmask of devices reachable peer-to-peer)."""
    cdef axf_cuda_device d
    _check(axf_cuda_device_info(ordinal, &d), f"cannot query CUDA device {ordinal}")
    return bool(d.dmabuf), d.pci.decode("ascii", "replace"), d.peers


def cuda_describe(uint64_t ptr, uint64_t nbytes):
    """(status, one line): what [ptr, ptr+nbytes) is, and why it cannot be registered."""
    cdef char why[256]
    cdef int st
    why[0] = 0
    _cuda_env()
    with nogil:
        st = axf_cuda_describe(ptr, nbytes, why, sizeof(why))
    return st, why.decode("utf-8", "replace")


def cuda_ipc_open_count():
    """Peer GPU allocations this process has open by CUDA IPC (per allocation and device)."""
    return axf_cuda_ipc_open_count()


def cuda_export(uint64_t ptr):
    """(IPC handle, offset of ptr in its allocation, device UUID)."""
    cdef uint8_t handle[64]
    cdef uint8_t uuid[16]
    cdef uint64_t off = 0
    cdef int st
    _cuda_env()
    with nogil:
        st = axf_cuda_export(ptr, handle, &off, uuid)
    _check(st, f"cannot export GPU memory at {ptr:#x} by CUDA IPC")
    return (PyBytes_FromStringAndSize(<char *>handle, 64), off,
            PyBytes_FromStringAndSize(<char *>uuid, 16))


def cuda_alloc(int device, uint64_t nbytes):
    cdef uint64_t ptr = 0
    cdef int st
    _cuda_env()
    with nogil:
        st = axf_cuda_alloc(device, nbytes, &ptr)
    _check(st, f"cannot allocate {nbytes} bytes on CUDA device {device}")
    return ptr


def cuda_free(uint64_t ptr):
    cdef int st
    _cuda_env()
    with nogil:
        st = axf_cuda_free(ptr)
    _check(st, f"cannot free GPU memory at {ptr:#x}")


def cuda_copy(uint64_t dst, uint64_t src, uint64_t nbytes):
    """A synchronous copy between host and/or device pointers (unified addressing)."""
    cdef int st
    _cuda_env()
    with nogil:
        st = axf_cuda_copy(dst, src, nbytes)
    _check(st, f"cannot copy {nbytes} bytes from {src:#x} to {dst:#x}")

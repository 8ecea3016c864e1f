# The native engine's header, line for line (native/include/aioxfer.h).
# Every function is declared nogil: _cyx decides where the GIL is released.
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "aioxfer.h" nogil:
    enum axf_status:
        AXF_OK
        AXF_E_INVALID
        AXF_E_NOMEM
        AXF_E_ACCESS
        AXF_E_PEER_LOST
        AXF_E_TIMEOUT
        AXF_E_TRANSPORT
        AXF_E_REGISTRATION
        AXF_E_PROTOCOL
        AXF_E_CLOSED
        AXF_E_CANCELLED
        AXF_E_NOTFOUND
        AXF_E_LIMIT

    const char *axf_strerror(int status)

    uint32_t AXF_ACCESS_READ
    uint32_t AXF_ACCESS_WRITE

    int AXF_EP_TCP
    int AXF_EP_SHM
    int AXF_EP_FILE
    int AXF_EP_CUDA

    uint32_t AXF_MEM_HOST
    uint32_t AXF_MEM_CUDA
    uint32_t AXF_MEM_FILE
    int AXF_EP_VERBS

    int AXF_OP_WRITE
    int AXF_OP_READ
    int AXF_OP_NOTIFY

    uint32_t AXF_POST_DEFER
    uint32_t AXF_POST_POLL
    uint32_t AXF_WAIT_POLLS
    uint32_t AXF_POST_ALONE
    uint32_t AXF_POST_NOHELP

    uint32_t AXF_CQ_XFER
    uint32_t AXF_CQ_NOTIFY
    uint32_t AXF_CQ_PEER_LOST
    uint32_t AXF_CQ_REGION_FREED
    uint32_t AXF_CQ_LOG
    uint32_t AXF_CQ_CONN_CLOSED
    uint32_t AXF_CQ_RAIL_DOWN
    uint32_t AXF_CQ_XFER_HELD
    uint32_t AXF_CQ_XFER_FREED

    uint32_t AXF_MAX_NOTIFY

    ctypedef struct axf_engine:
        pass

    ctypedef struct axf_config:
        uint32_t copy_workers
        uint64_t chunk_bytes
        uint64_t inline_bytes
        uint32_t keepalive_ms
        uint32_t peer_timeout_ms
        uint32_t stall_ms
        uint32_t max_conns
        uint32_t max_notify_per_conn
        uint32_t revoke_timeout_ms
        uint64_t reply_queue_bytes
        uint32_t target_poll_us

    ctypedef struct axf_desc:
        uint64_t lrid
        uint64_t loff
        uint64_t rrid
        uint64_t rkey
        uint64_t roff
        uint64_t len

    ctypedef struct axf_rail_stats:
        uint32_t rail
        uint32_t live
        uint64_t bytes
        uint64_t rate
        uint64_t reroutes

    ctypedef struct axf_completion:
        uint32_t kind
        int32_t status
        uint64_t id
        uint64_t tag
        uint64_t nbytes
        uint64_t fail_index
        uint32_t payload_len
        uint8_t *payload

    ctypedef struct axf_stats:
        uint64_t regions
        uint64_t ops
        uint64_t endpoints
        uint64_t conns
        uint64_t ops_posted
        uint64_t ops_completed
        uint64_t ops_failed
        uint64_t bytes
        uint64_t frames_rejected
        uint64_t quarantined
        uint64_t quarantined_bytes
        uint64_t held_conns
        uint64_t conns_refused
        uint64_t cq_dropped
        uint64_t helped

    axf_engine *axf_engine_create(const axf_config *cfg)
    int axf_engine_fd(axf_engine *e)
    void axf_engine_shutdown(axf_engine *e)
    int axf_engine_bye_network(axf_engine *e)
    void axf_engine_destroy(axf_engine *e)
    void axf_engine_stats(axf_engine *e, axf_stats *out)

    int axf_region_register(axf_engine *e, void *addr, uint64_t len, uint32_t access,
                            int memfd, uint64_t *id_out, uint64_t *key_out)
    int axf_region_register_kind(axf_engine *e, uint32_t kind, uint64_t addr, uint64_t len,
                                 uint32_t access, int fd, uint64_t *id_out, uint64_t *key_out)
    int axf_region_deregister(axf_engine *e, uint64_t id)
    int axf_region_revoke(axf_engine *e, uint64_t id)
    int axf_region_holders(axf_engine *e, uint64_t rid, uint64_t *tags_out, size_t max)

    int axf_endpoint_create(axf_engine *e, int kind, uint64_t tag, int32_t pid, int pidfd,
                            uint64_t *ep_out)
    int axf_endpoint_add_conn(axf_engine *e, uint64_t ep, int fd)
    int axf_endpoint_add_rail_conn(axf_engine *e, uint64_t ep, int fd, uint32_t rail)
    size_t axf_endpoint_rails(axf_engine *e, uint64_t ep, axf_rail_stats *out, size_t max)
    int axf_endpoint_import(axf_engine *e, uint64_t ep, uint64_t rid, uint64_t key,
                            uint64_t len, uint32_t access, uint64_t addr, int memfd)
    int axf_endpoint_forget(axf_engine *e, uint64_t ep, uint64_t rid)
    int axf_endpoint_close(axf_engine *e, uint64_t ep)

    int axf_accept_conn(axf_engine *e, int fd, uint64_t tag, int pidfd)
    void axf_notify_release(axf_engine *e, uint64_t tag, uint64_t n)

    int axf_post(axf_engine *e, uint64_t ep, int op, const axf_desc *descs, size_t n,
                 const void *notify, size_t notify_len, uint64_t req_id, uint32_t flags)
    void axf_doorbell(axf_engine *e)
    void axf_doorbell_ex(axf_engine *e, uint32_t flags)
    int axf_cancel(axf_engine *e, uint64_t req_id)

    int axf_file_info(axf_engine *e, char *buf, size_t cap)

    size_t axf_poll(axf_engine *e, axf_completion *out, size_t max)
    size_t axf_wait(axf_engine *e, uint32_t max_us)
    size_t axf_wait_ex(axf_engine *e, uint32_t max_us, uint32_t flags)

    ctypedef struct axf_calibration:
        uint64_t wake_ns
        uint64_t copy_mbps
        uint64_t inline_bytes
        uint32_t poll_us
        uint32_t reserved
    void axf_calibrate(axf_calibration *out)
    int axf_shm_make_huge(int memfd, uint64_t len) nogil
    void axf_env_read()
    uint64_t axf_engine_inline_bytes(axf_engine *e)
    uint32_t axf_engine_poll_us(axf_engine *e)
    void axf_completion_free(axf_completion *c)

    # RDMA verbs
    int AXF_VERBS_MAX_DEVICES

    ctypedef struct axf_verbs_qp_info:
        uint32_t qpn
        uint32_t psn
        uint32_t mtu
        uint16_t lid
        uint8_t port
        uint8_t gid_index
        uint8_t gid[16]
        uint8_t link_layer
        uint8_t gid_type
        uint8_t max_dest_rd_atomic

    int axf_verbs_probe(const char *provider, char *names, size_t names_len, char *why,
                        size_t why_len)
    int axf_verbs_enable(axf_engine *e, const char *provider, char *why, size_t why_len)
    int axf_verbs_device_count(axf_engine *e)
    int axf_verbs_region_keys(axf_engine *e, uint64_t rid, uint64_t *addrs, uint32_t *rkeys,
                              size_t max)
    int axf_verbs_region_dmabuf(axf_engine *e, uint64_t rid, int fd, uint64_t offset)
    int axf_verbs_qp_create(axf_engine *e, uint64_t ep, uint32_t dev, axf_verbs_qp_info *out)
    int axf_verbs_qp_connect(axf_engine *e, uint64_t ep, uint32_t dev, uint32_t remote_dev,
                             const axf_verbs_qp_info *remote)
    int axf_verbs_accept_qp(axf_engine *e, uint32_t dev, const axf_verbs_qp_info *remote,
                            axf_verbs_qp_info *out, uint64_t *qp_out)
    int axf_verbs_qp_destroy(axf_engine *e, uint64_t qp)
    int axf_verbs_accept_conn(axf_engine *e, int fd, uint64_t tag, const uint64_t *qps, size_t n)
    int axf_endpoint_import_verbs(axf_engine *e, uint64_t ep, uint64_t rid, const uint64_t *addrs,
                                  const uint32_t *rkeys, size_t n)
    int AXF_CUDA_IPC_HANDLE
    int axf_cuda_probe(char *why, size_t why_len, int *ndevices)
    int axf_cuda_device_name(int ordinal, char *name, size_t len)
    int axf_cuda_enable(axf_engine *e, char *why, size_t why_len)
    int axf_cuda_pointer(uint64_t ptr, uint64_t len, int *device, uint64_t *base, uint64_t *size)
    int axf_cuda_export(uint64_t ptr, uint8_t *handle, uint64_t *offset, uint8_t *uuid)
    int axf_cuda_dmabuf(uint64_t ptr, uint64_t len, int *fd)
    int axf_cuda_alloc(int device, uint64_t len, uint64_t *ptr)
    int axf_cuda_free(uint64_t ptr)
    int axf_cuda_copy(uint64_t dst, uint64_t src, uint64_t len)
    ctypedef struct axf_cuda_device:
        uint32_t dmabuf
        char pci[16]
        uint64_t peers
    int axf_cuda_device_info(int ordinal, axf_cuda_device *out)
    int axf_cuda_describe(uint64_t ptr, uint64_t len, char *why, size_t why_len)
    int axf_cuda_ipc_open_count()
    int axf_cuda_pin_region(axf_engine *e, uint64_t rid)
    int axf_endpoint_import_cuda(axf_engine *e, uint64_t ep, uint64_t rid, uint64_t key,
                                 uint64_t len, uint32_t access, uint64_t addr,
                                 const uint8_t *handle, uint64_t offset, const uint8_t *uuid)

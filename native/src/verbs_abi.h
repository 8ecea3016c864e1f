/* The part of the libibverbs ABI (rdma-core, <infiniband/verbs.h>) that the
 * verbs transport and the software provider use, declared here so that verbs
 * builds everywhere, with or without rdma-core's headers installed, and is
 * still loaded at run time (dlopen "libibverbs.so.1"), as TensorPipe does.
 *
 * Same names as rdma-core's, so the code reads the same; only what is used
 * is declared. Layout is the contract: the structures libibverbs fills or
 * reads (device and port attributes, queue pair attributes, work requests,
 * completions) are declared whole, with every member up to the last one, and
 * native/tests/test_verbs_abi.c compares every size, member offset and
 * constant here with rdma-core's header wherever that is installed (CI does).
 * The ABI has been stable since rdma-core 13 (2017): libibverbs.so.1 with
 * symbol version IBVERBS_1.1; ibv_reg_dmabuf_mr (IBVERBS_1.12, rdma-core 34)
 * and _ibv_query_gid_ex (IBVERBS_1.11, rdma-core 32) are looked up as optional.
 *
 * The static-inline verbs of the header (ibv_post_send, ibv_post_recv,
 * ibv_poll_cq, ibv_req_notify_cq) call through the context's operation
 * table; they are defined below the same way. */
#ifndef AXF_VERBS_ABI_H
#define AXF_VERBS_ABI_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ constants */

enum ibv_node_type { IBV_NODE_UNKNOWN = -1, IBV_NODE_CA = 1 };
enum ibv_transport_type { IBV_TRANSPORT_UNKNOWN = -1, IBV_TRANSPORT_IB = 0 };
enum ibv_atomic_cap { IBV_ATOMIC_NONE = 0 };
enum { IBV_DEVICE_RC_RNR_NAK_GEN = 1 << 12 };

enum ibv_mtu {
    IBV_MTU_256 = 1,
    IBV_MTU_512 = 2,
    IBV_MTU_1024 = 3,
    IBV_MTU_2048 = 4,
    IBV_MTU_4096 = 5,
};

enum ibv_port_state {
    IBV_PORT_NOP = 0,
    IBV_PORT_DOWN = 1,
    IBV_PORT_INIT = 2,
    IBV_PORT_ARMED = 3,
    IBV_PORT_ACTIVE = 4,
    IBV_PORT_ACTIVE_DEFER = 5,
};

enum {
    IBV_LINK_LAYER_UNSPECIFIED = 0,
    IBV_LINK_LAYER_INFINIBAND = 1,
    IBV_LINK_LAYER_ETHERNET = 2,
};

enum ibv_gid_type { IBV_GID_TYPE_IB, IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2 };

enum ibv_access_flags {
    IBV_ACCESS_LOCAL_WRITE = 1,
    IBV_ACCESS_REMOTE_WRITE = 1 << 1,
    IBV_ACCESS_REMOTE_READ = 1 << 2,
    IBV_ACCESS_REMOTE_ATOMIC = 1 << 3,
    /* Optional flags (from bit 20): ignored where unsupported by newer
     * stacks, refused by older ones (the transport retries without). */
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20,
};

enum ibv_qp_type { IBV_QPT_RC = 2, IBV_QPT_UC = 3, IBV_QPT_UD = 4 };

enum ibv_qp_state {
    IBV_QPS_RESET,
    IBV_QPS_INIT,
    IBV_QPS_RTR,
    IBV_QPS_RTS,
    IBV_QPS_SQD,
    IBV_QPS_SQE,
    IBV_QPS_ERR,
    IBV_QPS_UNKNOWN,
};

enum ibv_mig_state { IBV_MIG_MIGRATED, IBV_MIG_REARM, IBV_MIG_ARMED };

enum ibv_qp_attr_mask {
    IBV_QP_STATE = 1 << 0,
    IBV_QP_ACCESS_FLAGS = 1 << 3,
    IBV_QP_PKEY_INDEX = 1 << 4,
    IBV_QP_PORT = 1 << 5,
    IBV_QP_AV = 1 << 7,
    IBV_QP_PATH_MTU = 1 << 8,
    IBV_QP_TIMEOUT = 1 << 9,
    IBV_QP_RETRY_CNT = 1 << 10,
    IBV_QP_RNR_RETRY = 1 << 11,
    IBV_QP_RQ_PSN = 1 << 12,
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
    IBV_QP_MIN_RNR_TIMER = 1 << 15,
    IBV_QP_SQ_PSN = 1 << 16,
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
    IBV_QP_DEST_QPN = 1 << 20,
};

enum ibv_wr_opcode {
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    IBV_WR_SEND,
    IBV_WR_SEND_WITH_IMM,
    IBV_WR_RDMA_READ,
};

enum ibv_send_flags {
    IBV_SEND_FENCE = 1 << 0,
    IBV_SEND_SIGNALED = 1 << 1,
    IBV_SEND_SOLICITED = 1 << 2,
    IBV_SEND_INLINE = 1 << 3,
};

enum ibv_wc_status {
    IBV_WC_SUCCESS,
    IBV_WC_LOC_LEN_ERR,
    IBV_WC_LOC_QP_OP_ERR,
    IBV_WC_LOC_EEC_OP_ERR,
    IBV_WC_LOC_PROT_ERR,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WC_MW_BIND_ERR,
    IBV_WC_BAD_RESP_ERR,
    IBV_WC_LOC_ACCESS_ERR,
    IBV_WC_REM_INV_REQ_ERR,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_REM_OP_ERR,
    IBV_WC_RETRY_EXC_ERR,
    IBV_WC_RNR_RETRY_EXC_ERR,
    IBV_WC_LOC_RDD_VIOL_ERR,
    IBV_WC_REM_INV_RD_REQ_ERR,
    IBV_WC_REM_ABORT_ERR,
    IBV_WC_INV_EECN_ERR,
    IBV_WC_INV_EEC_STATE_ERR,
    IBV_WC_FATAL_ERR,
    IBV_WC_RESP_TIMEOUT_ERR,
    IBV_WC_GENERAL_ERR,
};

enum ibv_wc_opcode {
    IBV_WC_SEND,
    IBV_WC_RDMA_WRITE,
    IBV_WC_RDMA_READ,
    IBV_WC_RECV = 1 << 7,
    IBV_WC_RECV_RDMA_WITH_IMM,
};

enum { IBV_WC_GRH = 1 << 0, IBV_WC_WITH_IMM = 1 << 1 };

enum ibv_event_type {
    IBV_EVENT_CQ_ERR,
    IBV_EVENT_QP_FATAL,
    IBV_EVENT_QP_REQ_ERR,
    IBV_EVENT_QP_ACCESS_ERR,
    IBV_EVENT_COMM_EST,
    IBV_EVENT_SQ_DRAINED,
    IBV_EVENT_PATH_MIG,
    IBV_EVENT_PATH_MIG_ERR,
    IBV_EVENT_DEVICE_FATAL,
    IBV_EVENT_PORT_ACTIVE,
    IBV_EVENT_PORT_ERR,
};

enum ibv_fork_status { IBV_FORK_DISABLED, IBV_FORK_ENABLED, IBV_FORK_UNNEEDED };

#define IBV_SYSFS_NAME_MAX 64
#define IBV_SYSFS_PATH_MAX 256

/* ------------------------------------------------------------ objects */

union ibv_gid {
    uint8_t raw[16];
    struct {
        uint64_t subnet_prefix; /* big-endian */
        uint64_t interface_id;
    } global;
};

struct ibv_context;
struct ibv_cq;
struct ibv_qp;
struct ibv_pd;
struct ibv_srq; /* opaque here */
struct ibv_ah;
struct ibv_mw;
struct ibv_wc;
struct ibv_send_wr;
struct ibv_recv_wr;

struct ibv_device {
    struct {
        void *(*reserved1)(void); /* libibverbs' private device operations */
        void (*reserved2)(void);
    } _ops;
    enum ibv_node_type node_type;
    enum ibv_transport_type transport_type;
    char name[IBV_SYSFS_NAME_MAX];
    char dev_name[IBV_SYSFS_NAME_MAX];
    char dev_path[IBV_SYSFS_PATH_MAX];
    char ibdev_path[IBV_SYSFS_PATH_MAX];
};

/* The context's operation table: 32 entries, of which the fast-path verbs
 * (the header's static inlines) are the only ones callers use; the others
 * are compatibility slots of libibverbs and stay unnamed here. */
struct ibv_context_ops {
    void *(*reserved_0_10[11])(void);
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);            /* 11 */
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);                       /* 12 */
    void *(*reserved_13_24[12])(void);
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad); /* 25 */
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad); /* 26 */
    void *(*reserved_27_31[5])(void);
};

struct ibv_context {
    struct ibv_device *device;
    struct ibv_context_ops ops;
    int cmd_fd;
    int async_fd;
    int num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};

struct ibv_device_attr {
    char fw_ver[64];
    uint64_t node_guid; /* big-endian */
    uint64_t sys_image_guid;
    uint64_t max_mr_size;
    uint64_t page_size_cap;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t hw_ver;
    int max_qp;
    int max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge;
    int max_sge_rd;
    int max_cq;
    int max_cqe;
    int max_mr;
    int max_pd;
    int max_qp_rd_atom;
    int max_ee_rd_atom;
    int max_res_rd_atom;
    int max_qp_init_rd_atom;
    int max_ee_init_rd_atom;
    enum ibv_atomic_cap atomic_cap;
    int max_ee;
    int max_rdd;
    int max_mw;
    int max_raw_ipv6_qp;
    int max_raw_ethy_qp;
    int max_mcast_grp;
    int max_mcast_qp_attach;
    int max_total_mcast_qp_attach;
    int max_ah;
    int max_fmr;
    int max_map_per_fmr;
    int max_srq;
    int max_srq_wr;
    int max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay;
    uint8_t phys_port_cnt;
};

struct ibv_port_attr {
    enum ibv_port_state state;
    enum ibv_mtu max_mtu;
    enum ibv_mtu active_mtu;
    int gid_tbl_len;
    uint32_t port_cap_flags;
    uint32_t max_msg_sz;
    uint32_t bad_pkey_cntr;
    uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len;
    uint16_t lid;
    uint16_t sm_lid;
    uint8_t lmc;
    uint8_t max_vl_num;
    uint8_t sm_sl;
    uint8_t subnet_timeout;
    uint8_t init_type_reply;
    uint8_t active_width;
    uint8_t active_speed;
    uint8_t phys_state;
    uint8_t link_layer;
    uint8_t flags;
    uint16_t port_cap_flags2;
};

struct ibv_gid_entry {
    union ibv_gid gid;
    uint32_t gid_index;
    uint32_t port_num;
    uint32_t gid_type; /* enum ibv_gid_type */
    uint32_t ndev_ifindex;
};

struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};

struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};

struct ibv_comp_channel {
    struct ibv_context *context;
    int fd;
    int refcnt;
};

struct ibv_cq {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
};

struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle;
    uint32_t qp_num;
    enum ibv_qp_state state;
    enum ibv_qp_type qp_type;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_qp_cap {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
    void *qp_context;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    enum ibv_qp_type qp_type;
    int sq_sig_all;
};

struct ibv_global_route {
    union ibv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index;
    uint8_t hop_limit;
    uint8_t traffic_class;
};

struct ibv_ah_attr {
    struct ibv_global_route grh;
    uint16_t dlid;
    uint8_t sl;
    uint8_t src_path_bits;
    uint8_t static_rate;
    uint8_t is_global;
    uint8_t port_num;
};

struct ibv_qp_attr {
    enum ibv_qp_state qp_state;
    enum ibv_qp_state cur_qp_state;
    enum ibv_mtu path_mtu;
    enum ibv_mig_state path_mig_state;
    uint32_t qkey;
    uint32_t rq_psn;
    uint32_t sq_psn;
    uint32_t dest_qp_num;
    unsigned int qp_access_flags;
    struct ibv_qp_cap cap;
    struct ibv_ah_attr ah_attr;
    struct ibv_ah_attr alt_ah_attr;
    uint16_t pkey_index;
    uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify;
    uint8_t sq_draining;
    uint8_t max_rd_atomic;
    uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer;
    uint8_t port_num;
    uint8_t timeout;
    uint8_t retry_cnt;
    uint8_t rnr_retry;
    uint8_t alt_port_num;
    uint8_t alt_timeout;
    uint32_t rate_limit;
};

struct ibv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct ibv_send_wr {
    uint64_t wr_id;
    struct ibv_send_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
    enum ibv_wr_opcode opcode;
    unsigned int send_flags;
    union {
        uint32_t imm_data; /* big-endian */
        uint32_t invalidate_rkey;
    };
    union {
        struct {
            uint64_t remote_addr;
            uint32_t rkey;
        } rdma;
        struct {
            uint64_t remote_addr;
            uint64_t compare_add;
            uint64_t swap;
            uint32_t rkey;
        } atomic;
        struct {
            struct ibv_ah *ah;
            uint32_t remote_qpn;
            uint32_t remote_qkey;
        } ud;
    } wr;
    union {
        struct {
            uint32_t remote_srqn;
        } xrc;
    } qp_type;
    union { /* memory window binds and TSO: unused, sized */
        struct {
            struct ibv_mw *mw;
            uint32_t rkey;
            struct {
                struct ibv_mr *mr;
                uint64_t addr;
                uint64_t length;
                unsigned int mw_access_flags;
            } bind_info;
        } bind_mw;
        struct {
            void *hdr;
            uint16_t hdr_sz;
            uint16_t mss;
        } tso;
    };
};

struct ibv_recv_wr {
    uint64_t wr_id;
    struct ibv_recv_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
};

struct ibv_wc {
    uint64_t wr_id;
    enum ibv_wc_status status;
    enum ibv_wc_opcode opcode;
    uint32_t vendor_err;
    uint32_t byte_len;
    union {
        uint32_t imm_data; /* big-endian */
        uint32_t invalidated_rkey;
    };
    uint32_t qp_num;
    uint32_t src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index;
    uint16_t slid;
    uint8_t sl;
    uint8_t dlid_path_bits;
};

struct ibv_async_event {
    union {
        struct ibv_cq *cq;
        struct ibv_qp *qp;
        struct ibv_srq *srq;
        void *wq;
        int port_num;
    } element;
    enum ibv_event_type event_type;
};

/* ------------------------------------------------------------ fast-path verbs */

static inline int ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
                                struct ibv_send_wr **bad_wr)
{
    return qp->context->ops.post_send(qp, wr, bad_wr);
}

static inline int ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr,
                                struct ibv_recv_wr **bad_wr)
{
    return qp->context->ops.post_recv(qp, wr, bad_wr);
}

static inline int ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    return cq->context->ops.poll_cq(cq, num_entries, wc);
}

static inline int ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    return cq->context->ops.req_notify_cq(cq, solicited_only);
}

#ifdef __cplusplus
}
#endif
#endif

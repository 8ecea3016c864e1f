/* What native/src/verbs_abi.h must agree on with rdma-core's
 * <infiniband/verbs.h>: sizes (S: struct, U: union), member offsets (O) and
 * constants (V). Expanded once against each header (test_verbs_abi.c and
 * verbs_abi_real.c) and compared. */
#define AXF_VERBS_ABI(S, U, O, V)                                                              \
    S(ibv_device) O(ibv_device, node_type) O(ibv_device, name) O(ibv_device, dev_name)        \
    S(ibv_context) O(ibv_context, ops) O(ibv_context, ops.poll_cq)                             \
    O(ibv_context, ops.req_notify_cq) O(ibv_context, ops.post_send)                            \
    O(ibv_context, ops.post_recv) O(ibv_context, cmd_fd) O(ibv_context, async_fd)              \
    O(ibv_context, num_comp_vectors) O(ibv_context, mutex) O(ibv_context, abi_compat)          \
    S(ibv_device_attr) O(ibv_device_attr, node_guid) O(ibv_device_attr, max_qp_wr)             \
    O(ibv_device_attr, max_qp_rd_atom) O(ibv_device_attr, max_qp_init_rd_atom)                 \
    O(ibv_device_attr, atomic_cap) O(ibv_device_attr, max_pkeys)                               \
    O(ibv_device_attr, phys_port_cnt)                                                          \
    /* ibv_port_attr: offsets only. Its size grows with rdma-core (52 bytes in   \
     * 44, 56 in the H200 machine's newer header: active_speed_ex); the       \
     * exported ibv_query_port we call writes only the old compat prefix. */  \
    O(ibv_port_attr, state) O(ibv_port_attr, active_mtu) O(ibv_port_attr, gid_tbl_len)        \
    O(ibv_port_attr, max_msg_sz) O(ibv_port_attr, lid) O(ibv_port_attr, active_speed)          \
    O(ibv_port_attr, link_layer) O(ibv_port_attr, port_cap_flags2)                             \
    U(ibv_gid) S(ibv_gid_entry) O(ibv_gid_entry, gid_type)                                     \
    S(ibv_pd) S(ibv_mr) O(ibv_mr, addr) O(ibv_mr, length) O(ibv_mr, lkey) O(ibv_mr, rkey)       \
    S(ibv_comp_channel) O(ibv_comp_channel, fd)                                                \
    S(ibv_cq) O(ibv_cq, channel) O(ibv_cq, cq_context) O(ibv_cq, cqe) O(ibv_cq, mutex)         \
    O(ibv_cq, cond) O(ibv_cq, comp_events_completed)                                           \
    S(ibv_qp) O(ibv_qp, qp_num) O(ibv_qp, state) O(ibv_qp, mutex) O(ibv_qp, events_completed)   \
    S(ibv_qp_cap) S(ibv_qp_init_attr) O(ibv_qp_init_attr, cap) O(ibv_qp_init_attr, qp_type)    \
    O(ibv_qp_init_attr, sq_sig_all)                                                            \
    S(ibv_global_route) O(ibv_global_route, sgid_index) O(ibv_global_route, traffic_class)     \
    S(ibv_ah_attr) O(ibv_ah_attr, dlid) O(ibv_ah_attr, sl) O(ibv_ah_attr, is_global)           \
    O(ibv_ah_attr, port_num)                                                                   \
    S(ibv_qp_attr) O(ibv_qp_attr, rq_psn) O(ibv_qp_attr, dest_qp_num)                          \
    O(ibv_qp_attr, qp_access_flags) O(ibv_qp_attr, ah_attr) O(ibv_qp_attr, alt_ah_attr)        \
    O(ibv_qp_attr, pkey_index) O(ibv_qp_attr, max_rd_atomic) O(ibv_qp_attr, max_dest_rd_atomic) \
    O(ibv_qp_attr, min_rnr_timer) O(ibv_qp_attr, port_num) O(ibv_qp_attr, timeout)             \
    O(ibv_qp_attr, retry_cnt) O(ibv_qp_attr, rnr_retry) O(ibv_qp_attr, rate_limit)             \
    S(ibv_sge) S(ibv_send_wr) O(ibv_send_wr, sg_list) O(ibv_send_wr, opcode)                   \
    O(ibv_send_wr, send_flags) O(ibv_send_wr, imm_data) O(ibv_send_wr, wr.rdma.remote_addr)    \
    O(ibv_send_wr, wr.rdma.rkey) O(ibv_send_wr, qp_type)                                       \
    S(ibv_recv_wr) S(ibv_wc) O(ibv_wc, status) O(ibv_wc, opcode) O(ibv_wc, byte_len)           \
    O(ibv_wc, imm_data) O(ibv_wc, qp_num) O(ibv_wc, src_qp) O(ibv_wc, wc_flags)                \
    O(ibv_wc, dlid_path_bits)                                                                  \
    S(ibv_async_event) O(ibv_async_event, event_type)                                          \
    V(IBV_NODE_CA) V(IBV_TRANSPORT_IB) V(IBV_ATOMIC_NONE) V(IBV_DEVICE_RC_RNR_NAK_GEN)         \
    V(IBV_MTU_256) V(IBV_MTU_4096) V(IBV_PORT_DOWN) V(IBV_PORT_ACTIVE)                         \
    V(IBV_LINK_LAYER_INFINIBAND) V(IBV_LINK_LAYER_ETHERNET) V(IBV_GID_TYPE_IB)                 \
    V(IBV_GID_TYPE_ROCE_V1) V(IBV_GID_TYPE_ROCE_V2) V(IBV_ACCESS_LOCAL_WRITE)                  \
    V(IBV_ACCESS_REMOTE_WRITE) V(IBV_ACCESS_REMOTE_READ) V(IBV_ACCESS_REMOTE_ATOMIC)           \
    V(IBV_ACCESS_RELAXED_ORDERING) V(IBV_QPT_RC) V(IBV_QPS_RESET) V(IBV_QPS_INIT)              \
    V(IBV_QPS_RTR) V(IBV_QPS_RTS) V(IBV_QPS_ERR) V(IBV_QP_STATE) V(IBV_QP_ACCESS_FLAGS)        \
    V(IBV_QP_PKEY_INDEX) V(IBV_QP_PORT) V(IBV_QP_AV) V(IBV_QP_PATH_MTU) V(IBV_QP_TIMEOUT)      \
    V(IBV_QP_RETRY_CNT) V(IBV_QP_RNR_RETRY) V(IBV_QP_RQ_PSN) V(IBV_QP_MAX_QP_RD_ATOMIC)        \
    V(IBV_QP_MIN_RNR_TIMER) V(IBV_QP_SQ_PSN) V(IBV_QP_MAX_DEST_RD_ATOMIC) V(IBV_QP_DEST_QPN)   \
    V(IBV_WR_RDMA_WRITE) V(IBV_WR_RDMA_WRITE_WITH_IMM) V(IBV_WR_SEND) V(IBV_WR_SEND_WITH_IMM)  \
    V(IBV_WR_RDMA_READ) V(IBV_SEND_SIGNALED) V(IBV_SEND_INLINE) V(IBV_WC_SUCCESS)              \
    V(IBV_WC_LOC_LEN_ERR) V(IBV_WC_LOC_QP_OP_ERR) V(IBV_WC_LOC_PROT_ERR) V(IBV_WC_WR_FLUSH_ERR) \
    V(IBV_WC_REM_INV_REQ_ERR) V(IBV_WC_REM_ACCESS_ERR) V(IBV_WC_REM_OP_ERR)                    \
    V(IBV_WC_RETRY_EXC_ERR) V(IBV_WC_RNR_RETRY_EXC_ERR) V(IBV_WC_FATAL_ERR)                    \
    V(IBV_WC_RESP_TIMEOUT_ERR) V(IBV_WC_SEND) V(IBV_WC_RDMA_WRITE) V(IBV_WC_RDMA_READ)         \
    V(IBV_WC_RECV) V(IBV_WC_RECV_RDMA_WITH_IMM) V(IBV_WC_WITH_IMM) V(IBV_EVENT_QP_FATAL)       \
    V(IBV_EVENT_QP_REQ_ERR) V(IBV_EVENT_QP_ACCESS_ERR) V(IBV_EVENT_DEVICE_FATAL)               \
    V(IBV_EVENT_PORT_ERR) V(IBV_FORK_DISABLED) V(IBV_SYSFS_NAME_MAX) V(IBV_SYSFS_PATH_MAX)

#include <stddef.h>
#include <stdint.h>

#define AXF_ABI_S(t) (uint64_t)sizeof(struct t),
#define AXF_ABI_U(t) (uint64_t)sizeof(union t),
#define AXF_ABI_O(t, f) (uint64_t)offsetof(struct t, f),
#define AXF_ABI_V(c) (uint64_t)(c),
#define AXF_ABI_SN(t) "sizeof(struct " #t ")",
#define AXF_ABI_UN(t) "sizeof(union " #t ")",
#define AXF_ABI_ON(t, f) "offsetof(" #t ", " #f ")",
#define AXF_ABI_VN(c) #c,

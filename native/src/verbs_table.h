/* The verbs the transport uses, as one table of function pointers.
 *
 * Why a table: libibverbs is loaded at run time (dlopen "libibverbs.so.1"),
 * so one build runs where rdma-core is absent; and the tests load a software
 * provider of our own (native/tests/softverbs/) through the same table, which
 * moves real bytes between processes without an RDMA NIC.
 *
 * The types are libibverbs' ABI, declared in-tree (verbs_abi.h: no rdma-core
 * headers needed to build; checked against them by test_verbs_abi). A
 * provider allocates real struct ibv_* objects; the transport reads only
 * their public fields (context->device, context->async_fd, cq->context,
 * qp->qp_num, mr->lkey / rkey / addr / length, comp_channel->fd, wc fields).
 *
 * Semantics are those of the verbs of the same name (man ibv_post_send etc.),
 * including: RC QPs move RESET -> INIT -> RTR -> RTS through modify_qp; a
 * failed work request completes with an error status and moves the QP to the
 * error state, after which every outstanding and later request completes with
 * IBV_WC_WR_FLUSH_ERR; a peer that is gone shows as IBV_WC_RETRY_EXC_ERR;
 * a bad rkey or bounds at the target as IBV_WC_REM_ACCESS_ERR. Unsignalled
 * requests produce no completion on success but do on error. comp_channel->fd
 * becomes readable once a CQ armed with req_notify_cq gets a completion.
 */
#ifndef AXF_VERBS_TABLE_H
#define AXF_VERBS_TABLE_H

#include "verbs_abi.h"

#define AXF_VERBS_TABLE_VERSION 1

typedef struct axf_verbs_table {
    uint32_t version; /* AXF_VERBS_TABLE_VERSION */
    const char *provider; /* "libibverbs" or a software provider's name */

    struct ibv_device **(*get_device_list)(int *num_devices);
    void (*free_device_list)(struct ibv_device **list);
    const char *(*get_device_name)(struct ibv_device *device);
    struct ibv_context *(*open_device)(struct ibv_device *device);
    int (*close_device)(struct ibv_context *context);
    int (*query_device)(struct ibv_context *context, struct ibv_device_attr *attr);
    int (*query_port)(struct ibv_context *context, uint8_t port, struct ibv_port_attr *attr);
    int (*query_gid)(struct ibv_context *context, uint8_t port, int index, union ibv_gid *gid);

    struct ibv_pd *(*alloc_pd)(struct ibv_context *context);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length, int access);
    /* NULL where the library has no dmabuf registration (GPUDirect falls back). */
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *pd, uint64_t offset, size_t length,
                                    uint64_t iova, int fd, int access);
    int (*dereg_mr)(struct ibv_mr *mr);

    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *context);
    int (*destroy_comp_channel)(struct ibv_comp_channel *channel);
    struct ibv_cq *(*create_cq)(struct ibv_context *context, int cqe, void *cq_context,
                                struct ibv_comp_channel *channel, int comp_vector);
    int (*destroy_cq)(struct ibv_cq *cq);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    int (*get_cq_event)(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
    void (*ack_cq_events)(struct ibv_cq *cq, unsigned int nevents);
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);

    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
    int (*destroy_qp)(struct ibv_qp *qp);
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);

    /* Optional, appended (NULL where absent; the table's version stays 1). */
    /* The type of GID entry `index` (enum ibv_gid_type); 0 or an errno. */
    int (*query_gid_type)(struct ibv_context *context, uint8_t port, int index, int *type);
    /* Asynchronous events (device fatal, port changes, QP errors). */
    int (*get_async_event)(struct ibv_context *context, struct ibv_async_event *event);
    void (*ack_async_event)(struct ibv_async_event *event);
} axf_verbs_table;

/* What a software provider's shared library exports: fills the table and
 * returns 0 (or -errno). */
typedef int (*axf_verbs_provider_fn)(axf_verbs_table *table);
#define AXF_VERBS_PROVIDER_SYMBOL "axf_verbs_provider"

/* Loads a table: from the shared library at `path` when given (a software
 * provider exporting AXF_VERBS_PROVIDER_SYMBOL), else libibverbs.so.1.
 * Returns 0, or -errno with a reason in why (dlerror text). */
int axf_verbs_load(const char *path, axf_verbs_table *table, char *why, size_t why_len);

/* The name of the first entry the transport needs that `table` leaves NULL
 * (or a mismatched optional pair), NULL when none. */
const char *axf_verbs_table_missing(const axf_verbs_table *table);

#endif

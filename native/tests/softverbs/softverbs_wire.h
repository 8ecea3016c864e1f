/* The softverbs wire format: what one process's QP says to another's over a
 * unix stream socket. Shared by the provider and its test (which sends
 * malformed frames on purpose). Same host, so host byte order.
 *
 * A requester connects to "\0axf-softverbs/<pid>/<device index>" (abstract
 * namespace), sends one sv_hello, then requests; the responder answers each
 * request in order with one sv_resp. */
#ifndef AXF_SOFTVERBS_WIRE_H
#define AXF_SOFTVERBS_WIRE_H

#include <stdint.h>

#define SV_MAX_MSG (1ull << 31) /* port max_msg_sz: longer requests are malformed */

#define SV_MAGIC 0x53567231u /* "SVr1" */

enum { SV_OP_WRITE = 1, SV_OP_WRITE_IMM, SV_OP_SEND, SV_OP_SEND_IMM, SV_OP_READ };
enum { SV_OK = 0, SV_REM_ACCESS, SV_REM_INV_REQ, SV_REM_OP, SV_RNR };

/* First frame on a connection, requester -> responder. */
typedef struct sv_hello {
    uint32_t magic;
    uint32_t src_dev; /* the requester's device index (with its pid: its GID) */
    uint32_t src_qpn;
    uint32_t dst_qpn;
    uint32_t sgid_index; /* the requester's source GID entry: its type must match ours */
} sv_hello;

/* A request; WRITE and SEND payloads follow it (len bytes). */
typedef struct sv_req {
    uint32_t seq; /* echoed in the response */
    uint8_t op;
    uint8_t rnr_retry; /* the requester's: 7 waits for a receive forever */
    uint8_t rd_depth; /* READ: the requester QP's max_rd_atomic (READs it may have in flight) */
    uint8_t zero;
    uint32_t imm;
    uint32_t rkey;
    uint64_t raddr;
    uint64_t len;
} sv_req;

/* A response; a successful READ's data follows it (len bytes). */
typedef struct sv_resp {
    uint32_t seq;
    uint8_t op;
    uint8_t status;
    uint16_t zero;
    uint64_t len;
} sv_resp;

#endif

/* libFuzzer harness: the TARGET-side frame parser (conn.c rx_target), i.e.
 * whatever a remote initiator may send to a connection we accepted.
 *
 * One input = one connection. Byte 0 chooses options; the rest is the raw
 * byte stream the "initiator" sends: 64-byte wire headers and payloads, any
 * of it malformed (vectored WRITEV/READV frames too: a segment table after
 * the header). The engine serves three regions:
 *   rid 1: 4096 bytes, read-write (frames may change it),
 *   rid 2: 1024 bytes, read-only (nothing may ever change it),
 *   rid 3: option bit 0 only: 512 bytes registered and deregistered right
 *          after the connection is accepted, so a REVOKE is owed to the peer
 *          and REVOKE_ACK (or BYE) frames have something to answer; nothing
 *          may change it either, and the engine must report it freed.
 * Keys are random per registration, so a header's key field is taken as an
 * XOR with the real key of the region its rid names (0 = the right key): the
 * fuzzer can reach the accepted paths and still send any wrong key. rid 3 in
 * a header means the revoked region, whatever id the engine gave it.
 *
 * Oracles: guard bytes around every region, read-only and revoked memory byte
 * for byte untouched, the engine closes the connection and reports it closed
 * within FZ_DEADLINE_MS (no hang), ASan/UBSan clean. */
#include "fuzz_common.h"

#define RW_LEN 4096u
#define RO_LEN 1024u
#define RV_LEN 512u
#define OPT_REVOKE 1u

typedef struct target_state {
    axf_engine *e;
    uint64_t execs;
    fz_buf rw, ro, rv;
    uint64_t rw_rid, rw_key, ro_rid, ro_key;
} target_state;

static target_state S;

static void engine_new(void)
{
    axf_config cfg = fz_config();
    S.e = axf_engine_create(&cfg);
    if (!S.e)
        FZ_FAIL("axf_engine_create failed");
    memset(S.rw.mem, 0, RW_LEN);
    if (axf_region_register(S.e, S.rw.mem, RW_LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                            &S.rw_rid, &S.rw_key) != AXF_OK ||
        axf_region_register(S.e, S.ro.mem, RO_LEN, AXF_ACCESS_READ, -1, &S.ro_rid, &S.ro_key) !=
            AXF_OK)
        FZ_FAIL("axf_region_register failed");
}

static void engine_free(void)
{
    fz_engine_destroy(S.e);
    S.e = NULL;
}

/* The replay driver calls this last, so LeakSanitizer at exit sees only
 * what the engine really lost. */
void fz_cleanup(void);
void fz_cleanup(void)
{
    engine_free();
    free(S.rw.base);
    free(S.ro.base);
    free(S.rv.base);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fz_buf_init(&S.rw, RW_LEN);
    fz_buf_init(&S.ro, RO_LEN);
    fz_buf_init(&S.rv, RV_LEN);
    fz_pattern(S.ro.mem, RO_LEN, 0x11);
    fz_pattern(S.rv.mem, RV_LEN, 0x22);
    engine_new();
    return 0;
}

typedef struct wait_ctx {
    uint64_t tag, rv_rid;
    bool closed, freed;
} wait_ctx;

static void on_completion(void *ctx, const axf_completion *c)
{
    wait_ctx *w = ctx;
    /* Consumed, as an application does: the connection's notification
     * credit comes back (max_notify_per_conn). */
    if (c->kind == AXF_CQ_NOTIFY)
        axf_notify_release(S.e, c->tag, 1);
    if (c->kind == AXF_CQ_CONN_CLOSED && c->tag == w->tag)
        w->closed = true;
    if (c->kind == AXF_CQ_REGION_FREED && w->rv_rid && c->id == w->rv_rid)
        w->freed = true;
}

static bool finished(void *ctx)
{
    wait_ctx *w = ctx;
    return w->closed && (!w->rv_rid || w->freed);
}

static void fix_key(uint64_t *rid, uint64_t *key, uint64_t rv_rid, uint64_t rv_key)
{
    if (*rid == S.rw_rid)
        *key ^= S.rw_key;
    else if (*rid == S.ro_rid)
        *key ^= S.ro_key;
    else if (*rid == 3 && rv_rid) {
        *rid = rv_rid;
        *key ^= rv_key;
    }
}

/* The header's key is an XOR with the real key of the region its rid names
 * (rid 3: the revoked region, renamed to its real id), and so is each
 * segment's of a vectored frame (WRITEV, READV: up to AXF_MAX_SEGS records
 * after the header). Walks the stream the way the parser does on the
 * accepted paths: segment tables and the payloads of WRITE, WRITEV and
 * NOTIFY frames follow their header. */
static void fix_up(uint8_t *p, size_t n, uint64_t rv_rid, uint64_t rv_key)
{
    size_t pos = 0;
    while (pos + sizeof(wire_hdr) <= n) {
        wire_hdr h;
        memcpy(&h, p + pos, sizeof h);
        fix_key(&h.rid, &h.key, rv_rid, rv_key);
        memcpy(p + pos, &h, sizeof h);
        pos += sizeof h;
        bool vec = h.type == FR_WRITEV || h.type == FR_READV;
        if (vec && !(h.flags & FL_ABORT) && h.nseg && h.nseg <= AXF_MAX_SEGS) {
            for (uint32_t j = 0; j < h.nseg && pos + sizeof(wire_seg) <= n; j++) {
                wire_seg g;
                memcpy(&g, p + pos, sizeof g);
                fix_key(&g.rid, &g.key, rv_rid, rv_key);
                memcpy(p + pos, &g, sizeof g);
                pos += sizeof g;
            }
        }
        if (((h.type == FR_WRITE || h.type == FR_WRITEV) && !(h.flags & FL_ABORT)) ||
            h.type == FR_NOTIFY)
            pos += h.len < n - pos ? (size_t)h.len : n - pos;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (S.execs && S.execs % fz_recycle() == 0) {
        engine_free();
        engine_new();
    }
    S.execs++;
    uint8_t opts = fz_get_u8(&data, &size);
    uint8_t *stream = malloc(size ? size : 1);
    if (!stream)
        FZ_FAIL("out of memory");
    memcpy(stream, data, size);

    int sv[2];
    fz_socketpair(sv);
    wait_ctx w = {.tag = S.execs};
    if (axf_accept_conn(S.e, sv[1], w.tag, -1) != AXF_OK)
        FZ_FAIL("axf_accept_conn failed");
    uint64_t rv_key = 0;
    if (opts & OPT_REVOKE) {
        if (axf_region_register(S.e, S.rv.mem, RV_LEN, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                &w.rv_rid, &rv_key) != AXF_OK)
            FZ_FAIL("axf_region_register failed");
        /* From here on no frame may reach it; the peer is told to forget it. */
        if (axf_region_deregister(S.e, w.rv_rid) != AXF_OK)
            FZ_FAIL("axf_region_deregister failed");
    }
    fix_up(stream, size, w.rv_rid, rv_key);
    fz_exchange(sv[0], stream, size, "target connection");
    close(sv[0]);
    fz_wait(S.e, on_completion, finished, &w, "target connection closed / revoked region freed");
    free(stream);

    size_t bad;
    fz_guards_check(&S.rw, "read-write region");
    fz_guards_check(&S.ro, "read-only region");
    fz_guards_check(&S.rv, "revoked region");
    if (!fz_is_pattern(S.ro.mem, RO_LEN, 0x11, &bad))
        FZ_FAIL("read-only region changed at offset %zu", bad);
    if (!fz_is_pattern(S.rv.mem, RV_LEN, 0x22, &bad))
        FZ_FAIL("revoked region changed at offset %zu", bad);
    return 0;
}

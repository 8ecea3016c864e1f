/* libFuzzer harness: the INITIATOR-side frame parser (conn.c rx_initiator),
 * i.e. whatever a remote target may send back on a connection we dialled.
 *
 * One input = one endpoint with one connection. The first bytes are the plan:
 *   byte 0: number of requests (1..4, low bits); bit 7: a second connection
 *   (rail 1) to the same peer, which never answers: when the fuzzed one
 *   fails cleanly its unfinished groups are rerouted there, then it hangs up
 *   too;
 *   per request: a byte for its kind (READ, WRITE, WRITE + notification,
 *   NOTIFY) and its descriptor count (1..2), then per descriptor three
 *   little-endian u16: local offset, remote offset, length (folded into the
 *   regions' bounds, so every request is one the engine accepts).
 * A request's two descriptors on one connection go as one vectored frame
 * (WRITEV, READV), so the answers include READV_RESP frames and their
 * segment tables, each segment checked against what its descriptor asked.
 * The requests get ids 1..n (the op field of their frames); the imported
 * remote region is rid 7, key 0x1234, 2048 bytes. The rest of the input is
 * the raw byte stream the fake target answers with, after which it hangs up.
 *
 * Oracles: the local region's guard bytes; no byte of it changes outside the
 * ranges READ requests asked for (a reply lands only where we asked); every
 * request completes exactly once and the endpoint is reported lost within
 * FZ_DEADLINE_MS (no hang, no lost op); ASan/UBSan clean.
 * A request never reports more bytes than it asked for (issue 9: the count
 * is ours, never the peer's; AXF_FUZZ_CHECK_NBYTES=0 leaves that out, for an
 * engine from before that fix).
 *
 * Built with FZ_LONE (fuzz_lone_frames.c: a corpus of its own), the requests
 * go one at a time, each awaited by this thread spinning in axf_wait, as a
 * caller awaiting a lone READ does: the receiver that read one reply parks
 * and the spinner reads the next (conn.c help_read, help_takes, help_more:
 * a reply read by a thread other than the receiver, which the poll-driven
 * mode never reaches). After the descriptors the plan has one little-endian
 * u16 per request: how many bytes of the stream the fake target sends once
 * that request is posted (the last one: all that is left). A request not
 * done within FZ_LONE_MS after its bytes went is left in flight, and the
 * next is posted anyway. */
#include "fuzz_common.h"

#define LREG 4096u
#define RREG 2048u
#define RRID 7u
#define RKEY 0x1234u
#define MAX_OPS 4
#define MAX_DESC 2
#define FZ_LONE_MS 5

typedef struct init_state {
    axf_engine *e;
    uint64_t execs;
    fz_buf local;
    uint64_t lrid, lkey;
    bool check_nbytes;
} init_state;

static init_state S;

static void engine_new(void)
{
    axf_config cfg = fz_config();
    S.e = axf_engine_create(&cfg);
    if (!S.e)
        FZ_FAIL("axf_engine_create failed");
    if (axf_region_register(S.e, S.local.mem, LREG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                            &S.lrid, &S.lkey) != AXF_OK)
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
    free(S.local.base);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *v = getenv("AXF_FUZZ_CHECK_NBYTES");
    S.check_nbytes = !(v && *v == '0');
    fz_buf_init(&S.local, LREG);
    engine_new();
    return 0;
}

typedef struct plan {
    bool two_rails;
    int nops;
    int opcode[MAX_OPS];
    bool notify[MAX_OPS];
    size_t ndesc[MAX_OPS];
    axf_desc d[MAX_OPS][MAX_DESC];
    uint64_t want_bytes[MAX_OPS];
    size_t chunk[MAX_OPS]; /* FZ_LONE: the stream's bytes sent after request i is posted */
} plan;

typedef struct wait_ctx {
    uint64_t ep;
    int nops;
    int done[MAX_OPS];
    uint64_t nbytes[MAX_OPS];
    int32_t status[MAX_OPS];
    bool lost;
} wait_ctx;

static void on_completion(void *ctx, const axf_completion *c)
{
    wait_ctx *w = ctx;
    if (c->kind == AXF_CQ_XFER) {
        if (c->id < 1 || c->id > (uint64_t)w->nops)
            FZ_FAIL("completion for request %llu, which was never posted",
                    (unsigned long long)c->id);
        int i = (int)c->id - 1;
        if (w->done[i]++)
            FZ_FAIL("request %d completed twice", i + 1);
        w->nbytes[i] = c->nbytes;
        w->status[i] = c->status;
    } else if (c->kind == AXF_CQ_PEER_LOST && c->id == w->ep) {
        w->lost = true;
    }
}

static bool finished(void *ctx)
{
    wait_ctx *w = ctx;
    for (int i = 0; i < w->nops; i++)
        if (!w->done[i])
            return false;
    return w->lost;
}

static uint16_t get_u16(const uint8_t **p, size_t *n)
{
    uint16_t lo = fz_get_u8(p, n);
    return (uint16_t)(lo | (uint16_t)fz_get_u8(p, n) << 8);
}

static void read_plan(plan *pl, const uint8_t **p, size_t *n)
{
    uint8_t b0 = fz_get_u8(p, n);
    pl->two_rails = b0 & 0x80;
    pl->nops = 1 + (b0 & 0x7f) % MAX_OPS;
    for (int i = 0; i < pl->nops; i++) {
        uint8_t kind = fz_get_u8(p, n);
        pl->ndesc[i] = 1 + (kind >> 2) % MAX_DESC;
        pl->want_bytes[i] = 0;
        switch (kind & 3) {
        case 0: pl->opcode[i] = AXF_OP_READ; break;
        case 1: pl->opcode[i] = AXF_OP_WRITE; break;
        case 2: pl->opcode[i] = AXF_OP_WRITE; pl->notify[i] = true; break;
        default: pl->opcode[i] = AXF_OP_NOTIFY; pl->ndesc[i] = 0; break;
        }
        for (size_t k = 0; k < pl->ndesc[i]; k++) {
            uint64_t loff = get_u16(p, n) % LREG, roff = get_u16(p, n) % RREG;
            uint64_t room = LREG - loff < RREG - roff ? LREG - loff : RREG - roff;
            uint64_t len = 1 + get_u16(p, n) % room;
            pl->d[i][k] = (axf_desc){.lrid = S.lrid, .loff = loff, .rrid = RRID, .rkey = RKEY,
                                     .roff = roff, .len = len};
            pl->want_bytes[i] += len;
        }
    }
#ifdef FZ_LONE
    for (int i = 0; i < pl->nops; i++)
        pl->chunk[i] = get_u16(p, n);
#endif
}

#ifdef FZ_LONE
/* Sends what fd takes of data[*off, end) without blocking and drops what the
 * engine sent us meanwhile (our requests); true once all of it went, or the
 * engine hung up (its right). */
static bool lone_send(int fd, const uint8_t *data, size_t *off, size_t end)
{
    uint8_t sink[16384];
    while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0)
        ;
    while (*off < end) {
        ssize_t w = send(fd, data + *off, end - *off, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w > 0)
            *off += (size_t)w;
        else if (w < 0 && (errno == EAGAIN || errno == EINTR))
            return false;
        else
            *off = end; /* hung up on us mid-stream */
    }
    return true;
}

/* Posts the requests one at a time; after each, sends its share of the
 * stream while this thread spins in axf_wait (conn_help: it reads the
 * replies of parked receivers), until that request is done or FZ_LONE_MS
 * pass. Returns after the whole stream went. */
static void lone_run(const plan *pl, wait_ctx *w, int fd, const uint8_t *data, size_t size)
{
    static const char note[] = "fuzz";
    axf_completion q[64];
    size_t off = 0;
    uint64_t deadline = fz_now_ms() + FZ_DEADLINE_MS;
    for (int i = 0; i < pl->nops; i++) {
        bool with_note = pl->notify[i] || pl->opcode[i] == AXF_OP_NOTIFY;
        int st = axf_post(S.e, w->ep, pl->opcode[i], pl->d[i], pl->ndesc[i],
                          with_note ? note : NULL, with_note ? sizeof note : 0,
                          (uint64_t)i + 1, 0);
        if (st == AXF_E_PEER_LOST) { /* an earlier reply ended the endpoint: done */
            w->done[i] = 1;
            w->status[i] = st;
        } else if (st != AXF_OK) {
            FZ_FAIL("axf_post of request %d refused: %d", i + 1, st);
        }
        size_t end = i == pl->nops - 1 || pl->chunk[i] > size - off ? size : off + pl->chunk[i];
        uint64_t until = 0;
        while (!w->done[i] || off < end) {
            if (fz_now_ms() >= deadline)
                FZ_FAIL("engine did not take the stream within %d ms", FZ_DEADLINE_MS);
            if (lone_send(fd, data, &off, end) && !until)
                until = fz_now_ms() + FZ_LONE_MS;
            if (until && fz_now_ms() >= until)
                break; /* not answered (yet): the next request goes anyway */
            if (axf_wait(S.e, 1000)) {
                size_t n = axf_poll(S.e, q, 64);
                for (size_t k = 0; k < n; k++) {
                    if (fz_verbose())
                        fprintf(stderr, "  lone: completion kind %u status %d id %llu\n",
                                q[k].kind, q[k].status, (unsigned long long)q[k].id);
                    on_completion(w, &q[k]);
                    axf_completion_free(&q[k]);
                }
            }
        }
    }
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (S.execs && S.execs % fz_recycle() == 0) {
        engine_free();
        engine_new();
    }
    S.execs++;
    plan pl = {0};
    read_plan(&pl, &data, &size);
    fz_pattern(S.local.mem, LREG, 0x33);

    wait_ctx w = {.nops = pl.nops};
    if (axf_endpoint_create(S.e, AXF_EP_TCP, S.execs, 0, -1, &w.ep) != AXF_OK)
        FZ_FAIL("axf_endpoint_create failed");
    int sv[2];
    fz_socketpair(sv);
    if (axf_endpoint_add_conn(S.e, w.ep, sv[1]) != AXF_OK)
        FZ_FAIL("axf_endpoint_add_conn failed");
    int rail1[2] = {-1, -1};
    if (pl.two_rails) {
        fz_socketpair(rail1);
        if (axf_endpoint_add_rail_conn(S.e, w.ep, rail1[1], 1) != AXF_OK)
            FZ_FAIL("axf_endpoint_add_rail_conn failed");
    }
    if (axf_endpoint_import(S.e, w.ep, RRID, RKEY, RREG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0,
                            -1) != AXF_OK)
        FZ_FAIL("axf_endpoint_import failed");
#ifdef FZ_LONE
    lone_run(&pl, &w, sv[0], data, size);
    fz_exchange(sv[0], NULL, 0, "initiator connection"); /* it hangs up */
#else
    static const char note[] = "fuzz";
    for (int i = 0; i < pl.nops; i++) {
        bool with_note = pl.notify[i] || pl.opcode[i] == AXF_OP_NOTIFY;
        int st = axf_post(S.e, w.ep, pl.opcode[i], pl.d[i], pl.ndesc[i], with_note ? note : NULL,
                          with_note ? sizeof note : 0, (uint64_t)i + 1, 0);
        if (st != AXF_OK)
            FZ_FAIL("axf_post of request %d refused: %d", i + 1, st);
    }
    /* The fake target reads our requests (fz_exchange drains them) and
     * answers with the fuzzer's bytes, then hangs up. */
    fz_exchange(sv[0], data, size, "initiator connection");
#endif
    close(sv[0]);
    if (pl.two_rails) { /* it took what was rerouted (drained here); now it goes too */
        fz_exchange(rail1[0], NULL, 0, "second rail");
        close(rail1[0]);
    }
    fz_wait(S.e, on_completion, finished, &w, "requests completed / endpoint lost");
    (void)axf_endpoint_close(S.e, w.ep);

    fz_guards_check(&S.local, "local region");
    /* Bytes no READ asked for hold the pattern still. */
    static bool asked[LREG];
    memset(asked, 0, sizeof asked);
    for (int i = 0; i < pl.nops; i++)
        if (pl.opcode[i] == AXF_OP_READ)
            for (size_t k = 0; k < pl.ndesc[i]; k++)
                memset(asked + pl.d[i][k].loff, 1, pl.d[i][k].len);
    for (size_t b = 0; b < LREG; b++)
        if (!asked[b] && S.local.mem[b] != (uint8_t)(0x33 + b * 131u + (b >> 8)))
            FZ_FAIL("local byte %zu changed, though no READ asked for it", b);
    if (S.check_nbytes)
        for (int i = 0; i < pl.nops; i++)
            if (w.nbytes[i] > pl.want_bytes[i])
                FZ_FAIL("request %d reports %llu bytes moved, of %llu asked for", i + 1,
                        (unsigned long long)w.nbytes[i], (unsigned long long)pl.want_bytes[i]);
    return 0;
}

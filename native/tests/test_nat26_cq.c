/* A completion's payload is followed by a NUL not counted in payload_len
 * (nat26): a log record's text reads as a C string. Before, the payload was
 * payload_len bytes exactly, and a consumer treating a log's text as a
 * string (test_file.c's strstr) read past its end: under ASan strlen of it
 * is a heap-buffer-overflow; without, it reads whatever follows.
 *
 * A notification's payload is the sender's bytes, NULs of their own
 * included: payload_len is their length, and a NUL follows them too. */
#include "harness.h"
#include "internal.h"

#define A_TAG 77
#define B_TAG 99

/* payload_len bytes, then a NUL (strlen reads the whole string: under ASan
 * a read past the allocation is reported, not passed by luck). */
static int terminated(const axf_completion *c, size_t text_len)
{
    CHECK(c->payload != NULL);
    CHECK_EQ(strlen((const char *)c->payload), text_len);
    CHECK_EQ(c->payload[c->payload_len], 0);
    return 0;
}

/* A log record: the engine's own (a process-wide value too long for its
 * readers is logged at creation, engine.c env_check). */
static int test_log_is_a_string(void)
{
    char *v = malloc(AXF_ENV_VAL_MAX + 10);
    CHECK(v);
    memset(v, 'p', AXF_ENV_VAL_MAX + 9);
    v[AXF_ENV_VAL_MAX + 9] = 0;
    setenv("AIOXFER_CUDA_DRIVER", v, 1);
    free(v);
    axf_env_read();
    tengine *t = t_engine(NULL);
    unsetenv("AIOXFER_CUDA_DRIVER");
    axf_env_read();
    CHECK(t);
    axf_completion c;
    CHECK_EQ(t_wait_any(t, AXF_CQ_LOG, &c), 0);
    CHECK(c.payload_len > 0);
    int r = terminated(&c, c.payload_len);
    if (!r)
        CHECK(strstr((const char *)c.payload, "AIOXFER_CUDA_DRIVER") != NULL);
    axf_completion_free(&c);
    t_close(t);
    return r;
}

/* A connection's log record (a peer's malformed frame: conn.c's line),
 * the payload made by another path (cq_log from a receiver thread). */
static int test_conn_log_is_a_string(void)
{
    tengine *b = t_engine(NULL);
    CHECK(b);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], B_TAG, -1), AXF_OK);
    uint8_t junk[sizeof(wire_hdr)];
    memset(junk, 0xee, sizeof junk); /* no magic: refused, logged, closed */
    CHECK_EQ(write(sv[0], junk, sizeof junk), (ssize_t)sizeof junk);
    axf_completion c;
    CHECK_EQ(t_wait_any(b, AXF_CQ_LOG, &c), 0);
    fprintf(stderr, "log: %s\n", (const char *)c.payload);
    CHECK_EQ(c.tag, B_TAG);
    int r = terminated(&c, c.payload_len);
    axf_completion_free(&c);
    close(sv[0]);
    t_close(b);
    return r;
}

/* Notifications: text, and bytes with NULs of their own. */
static int test_notify_terminated(void)
{
    tengine *a = t_engine(NULL), *b = t_engine(NULL);
    CHECK(a && b);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_TCP, A_TAG, 0, -1, &ep), AXF_OK);
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ(axf_endpoint_add_conn(a->e, ep, sv[0]), AXF_OK);
    CHECK_EQ(axf_accept_conn(b->e, sv[1], B_TAG, -1), AXF_OK);
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_NOTIFY, NULL, 0, "hello", 5, 1, 0), AXF_OK);
    static const char bin[] = {'a', 0, 'b', 0, 'c'};
    CHECK_EQ(axf_post(a->e, ep, AXF_OP_NOTIFY, NULL, 0, bin, sizeof bin, 2, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait_any(b, AXF_CQ_NOTIFY, &c), 0);
    CHECK_EQ(c.payload_len, 5);
    int r = terminated(&c, 5);
    axf_completion_free(&c);
    axf_notify_release(b->e, B_TAG, 1);
    CHECK_EQ(r, 0);
    CHECK_EQ(t_wait_any(b, AXF_CQ_NOTIFY, &c), 0);
    CHECK_EQ(c.payload_len, sizeof bin);
    CHECK(memcmp(c.payload, bin, sizeof bin) == 0);
    CHECK_EQ(c.payload[sizeof bin], 0); /* under ASan: in bounds only now */
    axf_completion_free(&c);
    axf_notify_release(b->e, B_TAG, 1);
    for (uint64_t id = 1; id <= 2; id++) {
        CHECK_EQ(t_wait(a, AXF_CQ_XFER, id, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
    }
    t_close(a);
    t_close(b);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_log_is_a_string),
        T_CASE(test_conn_log_is_a_string),
        T_CASE(test_notify_terminated),
    };
    return T_RUN(argc, argv, cases);
}

/* A goodbye header that the socket takes only in part is finished (nat28).
 *
 * conn_say_bye sends the target's goodbye (a PING with FL_BYE, 64 bytes)
 * at once when the stream is between frames, MSG_DONTWAIT. TCP may take
 * only part of it: a send appends to the last unsent segment what fits
 * there, then stops when the socket's memory is spent (seen on loopback
 * with a stopped reader: 5 and 27 bytes of 64 taken). Before, a partial
 * send marked the connection dead: the peer read a truncated header, then
 * EOF (a malformed frame, not a close). Now the rest is owed, and the
 * sending thread sends it from where it stopped (bye_owed_send), nothing
 * else before it.
 *
 * Which sizes split depends on the kernel's segment sizes, so the split is
 * made to happen: this program's send() (the engine's calls bind to it)
 * gives the kernel only the first SPLIT bytes of the next goodbye header,
 * as TCP does when that is the room it has; the socket, the bytes and the
 * peer are real (loopback TCP). */
#include "harness.h"

#include "internal.h" /* wire layout, for the raw peer */

#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#define O_TAG 28
#define SPLIT 20

static atomic_int split_at; /* > 0: the next goodbye header goes in two */
static atomic_int splits;   /* how many were */

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
    int at = atomic_load(&split_at);
    if (at > 0 && len == sizeof(wire_hdr) && (flags & MSG_DONTWAIT)) {
        wire_hdr h;
        memcpy(&h, buf, sizeof h);
        if (h.magic == AXF_MAGIC && h.type == FR_PING && (h.flags & FL_BYE) &&
            atomic_compare_exchange_strong(&split_at, &at, 0)) {
            atomic_fetch_add(&splits, 1);
            len = (size_t)at;
        }
    }
    return syscall(SYS_sendto, fd, buf, len, flags, NULL, 0);
}

/* Everything the peer reads until EOF (or T_TIMEOUT_MS): its length. */
static ssize_t read_to_eof(int fd, uint8_t *buf, size_t cap)
{
    size_t n = 0;
    uint64_t until = t_now_ms() + T_TIMEOUT_MS;
    while (n < cap && t_now_ms() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t r = recv(fd, buf + n, cap - n, 0);
        if (r <= 0)
            return r < 0 ? -1 : (ssize_t)n;
        n += (size_t)r;
    }
    return -1;
}

/* The peer reads what the owner sends after the split goodbye: whole
 * frames (pings), the last the goodbye, then EOF; the peer closes and the
 * owner's connection ends as closed. */
static int said_split(bool then_shutdown)
{
    axf_config cfg = {.peer_timeout_ms = 3000};
    tengine *o = t_engine(&cfg);
    CHECK(o);
    static uint8_t r[4096];
    t_fill(r, sizeof r, 28);
    uint64_t rid, rkey;
    CHECK_EQ(axf_region_register(o->e, r, sizeof r, AXF_ACCESS_READ, -1, &rid, &rkey), AXF_OK);
    int fds[2];
    CHECK_EQ(t_tcp_pair(&fds[0], &fds[1]), 0); /* the peer's, the owner's */
    CHECK_EQ(axf_accept_conn(o->e, fds[1], O_TAG, -1), AXF_OK);
    int fd = fds[0];
    /* One READ answered: the connection works, and the stream is between
     * frames afterwards. */
    wire_hdr q = {.magic = AXF_MAGIC, .type = FR_READ_REQ, .flags = FL_LAST, .op = 1, .rid = rid,
                  .key = rkey, .len = sizeof r};
    CHECK_EQ(send(fd, &q, sizeof q, 0), (ssize_t)sizeof q);
    static uint8_t got[sizeof r];
    wire_hdr h;
    for (;;) {
        CHECK_EQ(recv(fd, &h, sizeof h, MSG_WAITALL), (ssize_t)sizeof h);
        if (h.type != FR_PING)
            break;
    }
    CHECK_EQ(h.type, FR_READ_RESP);
    CHECK_EQ(h.status, AXF_OK);
    CHECK_EQ(recv(fd, got, sizeof got, MSG_WAITALL), (ssize_t)sizeof got);
    CHECK(memcmp(got, r, sizeof r) == 0);
    /* The receiver that sent the response inline is back from its send
     * (else the goodbye is owed: it goes by the sending thread, whole). */
    usleep(100 * 1000);

    atomic_store(&splits, 0);
    atomic_store(&split_at, SPLIT);
    CHECK_EQ(axf_engine_bye_network(o->e), AXF_OK);
    if (then_shutdown) /* its own goodbye call (not owed) while the rest may be pending */
        axf_engine_shutdown(o->e);
    CHECK_EQ(atomic_load(&splits), 1);
    static uint8_t rest[64 * 1024];
    ssize_t n = read_to_eof(fd, rest, sizeof rest);
    fprintf(stderr, "peer read %zd bytes after the goodbye's split, then EOF\n", n);
    CHECK(n > 0);
    CHECK_EQ(n % (ssize_t)sizeof(wire_hdr), 0); /* before: SPLIT bytes of a header */
    for (ssize_t off = 0; off < n; off += (ssize_t)sizeof h) {
        memcpy(&h, rest + off, sizeof h);
        CHECK_EQ(h.magic, AXF_MAGIC);
        CHECK_EQ(h.type, FR_PING);
        CHECK_EQ(!!(h.flags & FL_BYE), off + (ssize_t)sizeof h == n); /* the goodbye last */
    }
    close(fd);
    axf_completion c;
    CHECK_EQ(t_wait_any(o, AXF_CQ_CONN_CLOSED, &c), 0);
    CHECK_EQ(c.tag, O_TAG);
    t_close(o);
    return 0;
}

static int test_goodbye_split_finished(void) { return said_split(false); }
static int test_goodbye_split_then_shutdown(void) { return said_split(true); }

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_goodbye_split_finished),
        T_CASE(test_goodbye_split_then_shutdown),
    };
    return T_RUN(argc, argv, cases);
}

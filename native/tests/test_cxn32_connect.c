/* The native engine's part of connect + first write (cxn32).
 *
 * (1) A fresh initiator TCP connection's receiver starts parked (conn.c
 * rx_main, rx_park's first): the first request's reply is read by the
 * thread spinning for it (axf_wait, conn_help: e->helped), not by the
 * receiver woken out of its wait for the socket. Before, only replies after
 * one a spinner could have read were (a connect's first write paid a
 * thread wake-up its later writes did not).
 * (2) The one-copy send's kernel checks (sock_diag over netlink, the
 * dumpable flag, Yama's ptrace_scope) are not made inside
 * axf_endpoint_add_conn on its caller's thread (the connect's path) but by
 * the connection's receiver (or its sender at a first frame to splice),
 * still before any byte is spliced: a large WRITE right after is spliced.
 * (3) A pidfd's process (/proc/self/fdinfo) is read once per
 * axf_endpoint_create and per axf_accept_conn (three and two times before).
 *
 * Real loopback TCP and unix sockets, real pidfds; socket() and open() are
 * interposed (counted, then passed on) to see who asks what. */
#include "harness.h"

#include "internal.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define A_TAG 32
#define B_TAG 33
#define REG (2u << 20)

/* ------------------------------------------------------------ interposed */

static pthread_t add_thread;
static atomic_bool in_add;          /* the test's thread is inside axf_endpoint_add_conn */
static atomic_int nl_in_add;        /* netlink sockets made by that call */
static atomic_int nl_other;         /* ... by anyone else (the receiver, a sender) */
static atomic_int fdinfo_opens;     /* /proc/self/fdinfo/N opened */

int socket(int domain, int type, int protocol)
{
    static int (*real)(int, int, int);
    if (!real)
        *(void **)&real = t_next("socket");
    if (domain == AF_NETLINK) {
        if (atomic_load(&in_add) && pthread_equal(pthread_self(), add_thread))
            atomic_fetch_add(&nl_in_add, 1);
        else
            atomic_fetch_add(&nl_other, 1);
    }
    return real(domain, type, protocol);
}

static void count_open(const char *path)
{
    if (path && strncmp(path, "/proc/self/fdinfo/", 18) == 0)
        atomic_fetch_add(&fdinfo_opens, 1);
}

/* (Built with _FILE_OFFSET_BITS=64, as the engine is: this defines the symbol
 * its calls reach, open64 where glibc's header redirects open to it.) */
int open(const char *path, int flags, ...)
{
    static int (*real)(const char *, int, ...);
    if (!real)
        *(void **)&real = t_next("open");
    va_list ap;
    va_start(ap, flags);
    mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
    va_end(ap);
    count_open(path);
    return real(path, flags, mode);
}

/* ------------------------------------------------------------ pair */

typedef struct pair {
    tengine *a, *b;
    uint64_t ep;
    uint8_t *asrc, *bdst;
    uint64_t arid, akey, brid, bkey;
} pair;

/* An initiator a with one TCP connection to a target b, regions registered
 * and imported after the connection was added (as aioxfer's connector
 * does: the data path's first request comes right after). */
static int pair_open(pair *p)
{
    memset(p, 0, sizeof *p);
    axf_config cfg = {0}; /* (target_poll_us: as "adaptive", receivers park) */
    p->a = t_engine(&cfg);
    p->b = t_engine(&cfg);
    CHECK(p->a && p->b);
    p->asrc = calloc(1, REG);
    p->bdst = calloc(1, REG);
    CHECK(p->asrc && p->bdst);
    CHECK_EQ(axf_region_register(p->a->e, p->asrc, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &p->arid, &p->akey),
             AXF_OK);
    CHECK_EQ(axf_region_register(p->b->e, p->bdst, REG, AXF_ACCESS_READ | AXF_ACCESS_WRITE, -1,
                                 &p->brid, &p->bkey),
             AXF_OK);
    CHECK_EQ(axf_endpoint_create(p->a->e, AXF_EP_TCP, A_TAG, 0, -1, &p->ep), AXF_OK);
    int x, y;
    if (t_tcp_pair(&x, &y))
        return 1;
    CHECK_EQ(axf_accept_conn(p->b->e, y, B_TAG, -1), AXF_OK);
    add_thread = pthread_self();
    atomic_store(&in_add, true);
    int st = axf_endpoint_add_conn(p->a->e, p->ep, x);
    atomic_store(&in_add, false);
    CHECK_EQ(st, AXF_OK);
    CHECK_EQ(axf_endpoint_import(p->a->e, p->ep, p->brid, p->bkey, REG,
                                 AXF_ACCESS_READ | AXF_ACCESS_WRITE, 0, -1),
             AXF_OK);
    return 0;
}

static void pair_close(pair *p)
{
    t_close(p->a);
    t_close(p->b);
    free(p->asrc);
    free(p->bdst);
}

static bool splice_on(void)
{
    const char *v = getenv("AIOXFER_TCP_SPLICE"); /* on unless "0" (spl28) */
    return !v || strcmp(v, "0") != 0;
}

/* ------------------------------------------------------------ cases */

/* (1) The first WRITE's acknowledgement on a fresh connection, awaited by a
 * spinner (axf_wait, as the agent's loop does), is read by that spinner.
 * Posted once its receiver parked (as it starts, for HELP_PARK_US: as in a
 * connect, whose first write comes a few hundred microseconds after the
 * connection joined). A receiver that parks while a request is owed and
 * nobody spins (its post still sending) reads the reply itself (rx_park's
 * first: correct, not helped), and a park can expire before the post on a
 * slow run, so up to 5 fresh connections; before cxn32 none was ever helped
 * (a receiver parked only after reading a reply itself). */
static int test_first_reply_read_by_spinner(void)
{
    int helped = 0;
    for (int round = 0; round < 5 && !helped; round++) {
        pair p;
        if (pair_open(&p))
            return 1;
        uint64_t until = t_now_ms() + 200;
        while (!atomic_load(&p.a->e->nhelp) && t_now_ms() < until)
            sched_yield();
        t_fill(p.asrc, 4096, (uint32_t)round + 7);
        axf_desc d = {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = 0,
                      .len = 4096};
        uint64_t before = atomic_load(&p.a->e->helped);
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
        /* One spin, long enough for any reply here: a spin that ends with
         * nothing hands parked receivers back (conn_help_end). */
        (void)axf_wait(p.a->e, 5u * 1000 * 1000 * t_timeout_scale);
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 1, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK(memcmp(p.bdst, p.asrc, 4096) == 0);
        helped += atomic_load(&p.a->e->helped) > before;
        printf("  round %d: first reply %s\n", round,
               atomic_load(&p.a->e->helped) > before ? "read by the spinner" : "by its receiver");
        /* And the next ones as before (its receiver parked since). */
        d.roff = 8192;
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 2, 0), AXF_OK);
        (void)axf_wait(p.a->e, 5u * 1000 * 1000 * t_timeout_scale);
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 2, &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK(memcmp(p.bdst + 8192, p.asrc, 4096) == 0);
        pair_close(&p);
    }
    CHECK(helped > 0);
    return 0;
}

/* (1) Nobody spins: a reply owed to a receiver parked as it started is
 * still read (the park lasts HELP_PARK_US at most), and promptly. */
static int test_first_reply_no_spinner(void)
{
    pair p;
    if (pair_open(&p))
        return 1;
    t_fill(p.asrc, 4096, 3);
    axf_desc d = {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = 0,
                  .len = 4096};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 9, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 9, &c), 0); /* (t_wait blocks on the eventfd) */
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst, p.asrc, 4096) == 0);
    pair_close(&p);
    return 0;
}

/* (2) No netlink round trip inside axf_endpoint_add_conn; the receiver
 * asks the kernel soon after, and a large WRITE is spliced. */
static int test_splice_verdict_off_add_conn(void)
{
    atomic_store(&nl_in_add, 0);
    atomic_store(&nl_other, 0);
    pair p;
    if (pair_open(&p))
        return 1;
    CHECK_EQ(atomic_load(&nl_in_add), 0);
    if (splice_on()) {
        uint64_t until = t_now_ms() + T_TIMEOUT_MS;
        while (!atomic_load(&nl_other) && t_now_ms() < until)
            usleep(1000);
        CHECK(atomic_load(&nl_other) > 0); /* asked, by the receiver */
    }
    const uint64_t len = 512u << 10; /* inside the default window (256 KiB - 1 MiB) */
    t_fill(p.asrc, len, 11);
    axf_desc d = {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey, .roff = 0,
                  .len = len};
    CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 5, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, 5, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK(memcmp(p.bdst, p.asrc, len) == 0);
    uint64_t spliced = atomic_load(&p.a->e->spliced_frames);
    printf("  spliced frames %" PRIu64 "\n", spliced);
    if (splice_on())
        CHECK(spliced > 0);
    else
        CHECK_EQ(spliced, 0);
    pair_close(&p);
    return 0;
}

/* (2) A large WRITE posted at once after the connection joined, before its
 * receiver may have run: it is whole and correct (spliced or copied:
 * whichever thread asks the kernel first), and later ones are spliced. */
static int test_splice_first_frame_at_once(void)
{
    pair p;
    if (pair_open(&p))
        return 1;
    const uint64_t len = 512u << 10;
    for (int i = 0; i < 3; i++) {
        t_fill(p.asrc, len, (uint32_t)i + 21);
        axf_desc d = {.lrid = p.arid, .loff = 0, .rrid = p.brid, .rkey = p.bkey,
                      .roff = (uint64_t)i * len, .len = len};
        CHECK_EQ(axf_post(p.a->e, p.ep, AXF_OP_WRITE, &d, 1, NULL, 0, (uint64_t)(40 + i), 0),
                 AXF_OK);
        axf_completion c;
        CHECK_EQ(t_wait(p.a, AXF_CQ_XFER, (uint64_t)(40 + i), &c), 0);
        CHECK_EQ(c.status, AXF_OK);
        CHECK(memcmp(p.bdst + (uint64_t)i * len, p.asrc, len) == 0);
    }
    if (splice_on())
        CHECK(atomic_load(&p.a->e->spliced_frames) >= 2);
    pair_close(&p);
    return 0;
}

/* (3) One read of /proc/self/fdinfo per endpoint_create and accept_conn
 * with a pidfd; what they decide is unchanged (a pidfd of another process
 * than the one named: refused). */
static int test_pidfd_read_once(void)
{
    axf_config cfg = {0};
    tengine *a = t_engine(&cfg);
    CHECK(a);
    int pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    CHECK(pidfd >= 0);
    uint64_t ep;
    atomic_store(&fdinfo_opens, 0);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_SHM, 1, getpid(), pidfd, &ep), AXF_OK);
    CHECK_EQ(atomic_load(&fdinfo_opens), 1);
    /* Another process named than the pidfd's: refused, after one read. */
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        pause();
        _exit(0);
    }
    int other = (int)syscall(SYS_pidfd_open, getpid(), 0);
    CHECK(other >= 0);
    atomic_store(&fdinfo_opens, 0);
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_SHM, 2, child, other, &ep), AXF_E_ACCESS);
    CHECK_EQ(atomic_load(&fdinfo_opens), 1);
    kill(child, SIGKILL);
    CHECK_EQ(waitpid(child, NULL, 0), child);
    /* A target's same-host connection: one read, not under e->mu twice. */
    int sv[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    int pfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    CHECK(pfd >= 0);
    atomic_store(&fdinfo_opens, 0);
    CHECK_EQ(axf_accept_conn(a->e, sv[1], 7, pfd), AXF_OK);
    CHECK_EQ(atomic_load(&fdinfo_opens), 1);
    /* Not a pidfd: refused, as before. */
    int sv2[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv2), 0);
    int notpid = dup(sv2[0]);
    CHECK(notpid >= 0);
    CHECK_EQ(axf_accept_conn(a->e, sv2[1], 8, notpid), AXF_E_INVALID);
    close(sv2[0]);
    close(sv[0]);
    t_close(a);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_first_reply_read_by_spinner),
        T_CASE(test_first_reply_no_spinner),
        T_CASE(test_splice_verdict_off_add_conn),
        T_CASE(test_splice_first_frame_at_once),
        T_CASE(test_pidfd_read_once),
    };
    return T_RUN(argc, argv, cases);
}

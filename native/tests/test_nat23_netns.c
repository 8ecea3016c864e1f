/* A TCP connection gets the loopback's shapes and congestion control
 * (c->loop_cc) only when its peer is on this host, in our network namespace
 * (conn.c conn_path): both ends on loopback, or the same address with the
 * peer's socket found there by sock_diag. Two network namespaces joined by
 * a veth pair, each with the same address 10.231.0.1 (containers behind
 * NAT): the client (namespace A) dials 10.231.0.2, which the server's
 * namespace B DNATs (nft) to its own 10.231.0.1; B routes its own packets
 * to 10.231.0.1 out of the veth (a rule for locally made packets ahead of
 * the local table). The server's accepted socket then has the same address
 * at both ends over a real link: not local. Controls: B's 10.231.0.5
 * dialled from B itself and 127.0.0.1 are local. Needs root, ip and nft: skipped
 * (77) otherwise. The namespaces are removed at the end. */
#include "harness.h"
#include "internal.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/wait.h>

static char ns_a[32], ns_b[32];

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int r = system(cmd);
    return WIFEXITED(r) ? WEXITSTATUS(r) : -1;
}

static void ns_down(void)
{
    sh("ip netns del %s 2>/dev/null", ns_a);
    sh("ip netns del %s 2>/dev/null", ns_b);
}

static int ns_up(void)
{
    snprintf(ns_a, sizeof ns_a, "axf23a-%d", (int)getpid());
    snprintf(ns_b, sizeof ns_b, "axf23b-%d", (int)getpid());
    if (sh("ip netns add %s && ip netns add %s", ns_a, ns_b))
        return -1;
    const char *a = ns_a, *b = ns_b;
    int r = sh("ip link add a0 address 02:23:00:00:00:0a netns %s type veth peer name b0 "
               "address 02:23:00:00:00:0b netns %s", a, b);
    r = r ? r : sh("ip -n %s link set lo up && ip -n %s link set a0 up", a, a);
    r = r ? r : sh("ip -n %s link set lo up && ip -n %s link set b0 up", b, b);
    r = r ? r : sh("ip -n %s addr add 10.231.0.1/32 dev a0 && ip -n %s route add 10.231.0.2/32 dev a0",
                a, a);
    r = r ? r : sh("ip -n %s addr add 10.231.0.1/32 dev b0 && "
                   "ip -n %s addr add 10.231.0.5/32 dev b0", b, b);
    /* static neighbours: neither end answers ARP for the address it dials
     * (B has no 10.231.0.2; A ignores a request from its own address) */
    r = r ? r : sh("ip -n %s neigh add 10.231.0.2 lladdr 02:23:00:00:00:0b dev a0 && "
                   "ip -n %s neigh add 10.231.0.1 lladdr 02:23:00:00:00:0a dev b0", a, b);
    /* B: its own packets to 10.231.0.1 leave by the veth (iif lo: made
     * here; arriving ones still reach the local table) */
    r = r ? r : sh("ip -n %s route add 10.231.0.1/32 dev b0 table 123 && "
                "ip -n %s rule add pref 10 iif lo to 10.231.0.1 lookup 123 && "
                "ip -n %s rule add pref 100 lookup local && ip -n %s rule del pref 0",
                b, b, b, b);
    /* B takes packets whose source is its own address from the veth */
    r = r ? r : sh("ip netns exec %s sh -c 'sysctl -qw net.ipv4.conf.all.rp_filter=0 "
                "net.ipv4.conf.b0.rp_filter=0 net.ipv4.conf.b0.accept_local=1'", b);
    r = r ? r : sh("ip netns exec %s nft 'add table ip t; add chain ip t pre "
                "{ type nat hook prerouting priority -100; }; "
                "add rule ip t pre ip daddr 10.231.0.2 dnat to 10.231.0.1'", b);
    return r ? -1 : 0;
}

static int ns_enter(const char *name)
{
    char path[64];
    snprintf(path, sizeof path, "/var/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int r = setns(fd, CLONE_NEWNET); /* this thread only */
    close(fd);
    return r;
}

typedef struct dial {
    const char *ns; /* NULL: the caller's namespace */
    const char *to;
    uint16_t port;
    int fd;
} dial;

static void *dial_main(void *arg)
{
    dial *d = arg;
    d->fd = -1;
    if (d->ns && ns_enter(d->ns) != 0)
        return NULL;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(d->port)};
    inet_pton(AF_INET, d->to, &sa.sin_addr);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        perror("connect");
        close(fd);
        return NULL;
    }
    d->fd = fd;
    return NULL;
}

/* The loop_cc of the connection the engine makes of the accepted socket
 * of a dial from namespace `from` (NULL: ours) to `to`. -1: no connection. */
static int accepted_loop_cc(axf_engine *e, const char *listen_on, const char *from,
                            const char *to, int *client_fd)
{
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, listen_on, &sa.sin_addr);
    socklen_t sl = sizeof sa;
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 4) != 0 ||
        getsockname(ls, (struct sockaddr *)&sa, &sl) != 0) {
        close(ls);
        return -1;
    }
    dial d = {.ns = from, .to = to, .port = ntohs(sa.sin_port)};
    pthread_t th;
    pthread_create(&th, NULL, dial_main, &d);
    pthread_join(th, NULL);
    *client_fd = d.fd;
    if (d.fd < 0) {
        close(ls);
        return -1;
    }
    int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    close(ls);
    if (fd < 0 || axf_accept_conn(e, fd, 7, -1) != AXF_OK)
        return -1;
    pthread_mutex_lock(&e->mu);
    int cc = e->conns ? e->conns->loop_cc : -1; /* the newest first */
    pthread_mutex_unlock(&e->mu);
    return cc;
}

static int test_same_address_across_namespaces(void)
{
    CHECK_EQ(ns_enter(ns_b), 0); /* the main thread: the server's namespace */
    tengine *t = t_engine(NULL);
    CHECK(t);
    int cfd = -1;
    /* across the veth, the same address at both ends of the server's socket */
    int cc = accepted_loop_cc(t->e, "10.231.0.1", ns_a, "10.231.0.2", &cfd);
    close(cfd);
    CHECK_EQ(cc, 0);
    /* controls: in B itself, to another of its own addresses (its packets
     * to 10.231.0.1 are routed out, above) and to loopback */
    cc = accepted_loop_cc(t->e, "10.231.0.5", NULL, "10.231.0.5", &cfd);
    close(cfd);
    CHECK_EQ(cc, 1);
    cc = accepted_loop_cc(t->e, "127.0.0.1", NULL, "127.0.0.1", &cfd);
    close(cfd);
    CHECK_EQ(cc, 1);
    t_close(t);
    return 0;
}

int main(int argc, char **argv)
{
    if (geteuid() != 0 || sh("command -v ip >/dev/null && command -v nft >/dev/null")) {
        printf("skipped: needs root, ip and nft\n");
        return 77;
    }
    setenv("AIOXFER_TCP_LOOPBACK_CC", "reno", 1); /* not the default's word: stated */
    if (ns_up() != 0) {
        ns_down();
        printf("skipped: cannot build the namespaces (veth, nft)\n");
        return 77;
    }
    static const t_case cases[] = {
        T_CASE(test_same_address_across_namespaces),
    };
    int r = T_RUN(argc, argv, cases);
    ns_down();
    return r;
}

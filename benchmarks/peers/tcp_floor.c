/* The floor of a one-request-at-a-time protocol over TCP loopback on this
 * machine: plain C, no framing, no registration, no completion queue.
 *
 * Two processes (as the systems measured beside it): the target accepts N
 * connections and runs one thread per connection. WRITE: the initiator sends
 * SIZE bytes (split in N equal parts, one per connection, sent back to back by
 * the initiating thread), each target thread receives its part into a buffer
 * and answers one byte; the request is done when every part's byte is back.
 * READ: the initiator sends a one-byte request per connection, each target
 * thread sends its part back; done when every part has arrived. TCP_NODELAY,
 * 4 MiB socket buffers. Receives either sleep in recv (blocking: a
 * kernel-woken thread each time) or poll it (MSG_DONTWAIT in a loop, on both
 * sides: what a polling engine does; on a VM a wake-up from idle can cost
 * tens of microseconds, so neither alone is the floor).
 *
 * Whatever a transfer engine adds (headers, bounds checks, completion rings,
 * Python) it cannot go below this. One JSON line on stdout:
 *   {"op": "WRITE", "size": S, "conns": N, "poll": P, "iters": I, "secs": T, "us_med": M,
 *    "send_us_med": the median time of a request's sends (WRITE: the copies into the
 *    sockets, the first part's with senders; READ: the one-byte requests), ...}
 *
 *   tcp_floor WRITE|READ SIZE CONNS SECS [poll] [auto] [zc] [senders] [splice]
 *
 * senders: WRITE's parts after the first are each sent by a thread of their
 * own, woken through a condition variable per request (what aioxfer's lone
 * 1 MiB WRITE does: the posting thread sends the first half, a connection's
 * sending thread the second); the request also waits for those threads to
 * be back from their sends.
 *
 * auto: the kernel's autotuned socket buffers instead of 4 MiB ones. zc:
 * WRITE's parts are sent with MSG_ZEROCOPY, and each request also waits for
 * the kernel's notification that the pages are released (what an engine
 * must wait for before it may report the source reusable); the JSON line
 * then says how many notifications said the kernel copied anyway
 * ("zc_copied" of "zc_notes"): loopback delivery copies zerocopy pages
 * (skb_orphan_frags_rx), so there it only adds the page pinning and the
 * notifications, which is what it measures.
 *
 * splice: every payload (WRITE's parts, READ's responses) is sent by
 * vmsplice (its pages into a pipe of the sending thread's, 1 MiB by
 * F_SETPIPE_SZ) and splice (pipe -> socket), not copied by send: the skbs
 * then reference the sender's pages, which loopback delivers as they are
 * (spliced page frags are not copied, unlike zerocopy's), so only the
 * receiver copies. Safe here because the request is over only once its
 * answer is back, after the receiver read the pages. Measured (kernel 6.18,
 * 2 vCPUs, 6 interleaved pairs, medians): WRITE 1 MiB one connection polled
 * 1.66x, two connections with senders 1.85x polled, 1.58x blocking; 64 KiB
 * 1.32x; CPU per GB about halved; WRITE 16 MiB on one connection 0.74x and
 * READ 1 MiB 0.70x (slower). aioxfer's tcp send uses it for WRITE payloads
 * to same-uid loopback peers (native/src/conn.c, "one-copy send").
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/errqueue.h>
#include <poll.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 8
#define MAX_SAMPLES (1 << 20)

static size_t part;
static int write_op, poll_rx, auto_buf, zc, senders, use_splice;
static _Thread_local int spl_pipe[2] = {-1, -1}; /* splice: the sending thread's pipe */
static long zc_notes, zc_copied;

static void die(const char *what)
{
    perror(what);
    exit(2);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void tune(int fd)
{
    int one = 1, sz = 4 << 20;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (auto_buf)
        return;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
}

static int recv_all(int fd, void *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(fd, (char *)buf + got, len - got, poll_rx ? MSG_DONTWAIT : MSG_WAITALL);
        if (r < 0 && poll_rx && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            sched_yield(); /* the sender may need this CPU (2 of them here) */
            continue;
        }
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

/* splice: len bytes at buf into socket fd through this thread's pipe,
 * vmsplice'd a pipeful at a time and spliced on (SPLICE_F_MORE until the
 * last). */
static int splice_all(int fd, const void *buf, size_t len)
{
    if (spl_pipe[0] < 0) {
        if (pipe2(spl_pipe, O_CLOEXEC))
            die("pipe2");
        if (fcntl(spl_pipe[1], F_SETPIPE_SZ, 1 << 20) < 0)
            die("F_SETPIPE_SZ");
    }
    size_t sent = 0;
    while (sent < len) {
        struct iovec iov = {.iov_base = (char *)buf + sent, .iov_len = len - sent};
        ssize_t r = vmsplice(spl_pipe[1], &iov, 1, 0);
        if (r <= 0)
            die("vmsplice");
        size_t in_pipe = (size_t)r;
        while (in_pipe) {
            ssize_t w = splice(spl_pipe[0], NULL, fd, NULL, in_pipe,
                               sent + in_pipe < len ? SPLICE_F_MORE : 0);
            if (w <= 0)
                return -1;
            in_pipe -= (size_t)w;
            sent += (size_t)w;
        }
    }
    return 0;
}

/* *calls: send calls made (a zerocopy notification id each), may be NULL.
 * With splice, payloads (more than the one-byte requests and answers) go by
 * splice_all. */
static int send_all(int fd, const void *buf, size_t len, int flags, uint32_t *calls)
{
    if (use_splice && len > 1)
        return splice_all(fd, buf, len);
    size_t sent = 0;
    while (sent < len) {
        ssize_t r = send(fd, (const char *)buf + sent, len - sent, MSG_NOSIGNAL | flags);
        if (calls && r > 0)
            (*calls)++;
        if (r <= 0)
            return -1;
        sent += (size_t)r;
    }
    return 0;
}

/* A sending thread of the initiator ("senders"): sends its part each time
 * go moves on (-1: leave), then says so in done. */
typedef struct sender {
    pthread_t th;
    int fd;
    const char *p;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_long go, done;
} sender;

static void *send_part(void *arg)
{
    sender *h = arg;
    long seen = 0;
    for (;;) {
        pthread_mutex_lock(&h->mu);
        long g;
        while ((g = atomic_load(&h->go)) == seen)
            pthread_cond_wait(&h->cv, &h->mu);
        pthread_mutex_unlock(&h->mu);
        if (g < 0)
            return NULL;
        seen = g;
        if (send_all(h->fd, h->p, part, 0, NULL))
            die("send");
        atomic_store(&h->done, g);
    }
}

/* One target thread: serves its connection until the initiator closes it. */
static void *serve(void *arg)
{
    int fd = (int)(intptr_t)arg;
    char *buf = malloc(part);
    char b = 1;
    if (!buf)
        die("malloc");
    memset(buf, 7, part);
    for (;;) {
        if (write_op) {
            if (recv_all(fd, buf, part) || send_all(fd, &b, 1, 0, NULL))
                break;
        } else {
            if (recv_all(fd, &b, 1) || send_all(fd, buf, part, 0, NULL))
                break;
        }
    }
    free(buf);
    close(fd);
    return NULL;
}

/* Waits until the kernel has released every zerocopy send of fd up to
 * *next (the count of sends so far): reads its error queue's notifications. */
static void zc_wait(int fd, uint32_t sends, uint32_t *done)
{
    while (*done < sends) {
        char ctl[128];
        struct msghdr m = {.msg_control = ctl, .msg_controllen = sizeof ctl};
        if (recvmsg(fd, &m, MSG_ERRQUEUE) < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                die("recvmsg errqueue");
            struct pollfd pf = {.fd = fd, .events = 0};
            poll(&pf, 1, 100); /* POLLERR: a notification is queued */
            continue;
        }
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
            struct sock_extended_err ee;
            memcpy(&ee, CMSG_DATA(cm), sizeof ee);
            if (ee.ee_origin != SO_EE_ORIGIN_ZEROCOPY)
                continue;
            zc_notes++;
            zc_copied += (ee.ee_code & SO_EE_CODE_ZEROCOPY_COPIED) != 0;
            *done = ee.ee_data + 1; /* sends [ee_info, ee_data] are released */
        }
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr,
                "usage: tcp_floor WRITE|READ SIZE CONNS SECS [poll] [auto] [zc] [senders] [splice]\n");
        return 2;
    }
    for (int i = 5; i < argc; i++) {
        if (strcmp(argv[i], "poll") == 0)
            poll_rx = 1;
        else if (strcmp(argv[i], "auto") == 0)
            auto_buf = 1;
        else if (strcmp(argv[i], "zc") == 0)
            zc = 1;
        else if (strcmp(argv[i], "senders") == 0)
            senders = 1;
        else if (strcmp(argv[i], "splice") == 0)
            use_splice = 1;
        else
            return 2;
    }
    write_op = strcmp(argv[1], "WRITE") == 0;
    size_t size = strtoull(argv[2], NULL, 0);
    int conns = atoi(argv[3]);
    double secs = atof(argv[4]);
    if (conns < 1 || conns > MAX_CONNS || size % (size_t)conns || size == 0)
        return 2;
    part = size / (size_t)conns;

    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, MAX_CONNS) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl))
        die("listen");

    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) { /* the target */
        pthread_t th[MAX_CONNS];
        for (int i = 0; i < conns; i++) {
            int fd = accept(lfd, NULL, NULL);
            if (fd < 0)
                die("accept");
            tune(fd);
            pthread_create(&th[i], NULL, serve, (void *)(intptr_t)fd);
        }
        for (int i = 0; i < conns; i++)
            pthread_join(th[i], NULL);
        _exit(0);
    }
    close(lfd);

    int fds[MAX_CONNS];
    for (int i = 0; i < conns; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        tune(fds[i]);
        if (connect(fds[i], (struct sockaddr *)&sa, sizeof sa))
            die("connect");
        int one = 1;
        if (zc && setsockopt(fds[i], SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one))
            die("SO_ZEROCOPY");
    }
    uint32_t zc_sends[MAX_CONNS] = {0}, zc_done[MAX_CONNS] = {0};
    char *buf = malloc(size);
    double *lat = malloc(sizeof(double) * MAX_SAMPLES);
    double *snd = malloc(sizeof(double) * MAX_SAMPLES);
    if (!buf || !lat || !snd)
        die("malloc");
    memset(buf, 3, size);
    static sender hs[MAX_CONNS];
    if ((senders && (!write_op || zc)) || (use_splice && zc)) /* splice: never zerocopy too */
        return 2;
    for (int i = 1; senders && i < conns; i++) {
        hs[i].fd = fds[i];
        hs[i].p = buf + (size_t)i * part;
        pthread_mutex_init(&hs[i].mu, NULL);
        pthread_cond_init(&hs[i].cv, NULL);
        if (pthread_create(&hs[i].th, NULL, send_part, &hs[i]))
            die("pthread_create");
    }

    long iters = 0;
    double t0 = now_us(), end = t0 + secs * 1e6, t = t0;
    char b = 1;
    while (t < end && iters < MAX_SAMPLES) {
        double s = t;
        for (int i = 1; senders && i < conns; i++) {
            pthread_mutex_lock(&hs[i].mu);
            atomic_store(&hs[i].go, iters + 1);
            pthread_cond_signal(&hs[i].cv);
            pthread_mutex_unlock(&hs[i].mu);
        }
        for (int i = 0; i < (senders ? 1 : conns); i++) {
            const void *p = write_op ? buf + (size_t)i * part : &b;
            int zflag = zc && write_op ? MSG_ZEROCOPY : 0;
            if (send_all(fds[i], p, write_op ? part : 1, zflag, zflag ? &zc_sends[i] : NULL))
                die("send");
        }
        snd[iters] = now_us() - s; /* the sends' part of it */
        for (int i = 0; i < conns; i++) {
            void *p = write_op ? &b : buf + (size_t)i * part;
            if (recv_all(fds[i], p, write_op ? 1 : part))
                die("recv");
        }
        for (int i = 0; zc && i < conns; i++)
            zc_wait(fds[i], zc_sends[i], &zc_done[i]);
        for (int i = 1; senders && i < conns; i++)
            while (atomic_load(&hs[i].done) != iters + 1)
                sched_yield(); /* back from its send (normally long since) */
        t = now_us();
        lat[iters++] = t - s;
    }
    double total = t - t0;
    for (int i = 1; senders && i < conns; i++) {
        pthread_mutex_lock(&hs[i].mu);
        atomic_store(&hs[i].go, -1);
        pthread_cond_signal(&hs[i].cv);
        pthread_mutex_unlock(&hs[i].mu);
        pthread_join(hs[i].th, NULL);
    }
    for (int i = 0; i < conns; i++)
        close(fds[i]);
    waitpid(pid, NULL, 0);
    qsort(lat, (size_t)iters, sizeof(double), cmp_double);
    qsort(snd, (size_t)iters, sizeof(double), cmp_double);
    printf("{\"op\": \"%s\", \"size\": %zu, \"conns\": %d, \"poll\": %d, \"iters\": %ld, "
           "\"secs\": %.6f, \"us_med\": %.3f, \"send_us_med\": %.3f, \"auto\": %d, \"zc\": %d, \"zc_notes\": %ld, "
           "\"zc_copied\": %ld, \"senders\": %d, \"splice\": %d}\n",
           write_op ? "WRITE" : "READ", size, conns, poll_rx, iters, total / 1e6, lat[iters / 2],
           snd[iters / 2],
           auto_buf, zc, zc_notes, zc_copied, senders, use_splice);
    free(lat);
    free(snd);
    free(buf);
    return 0;
}

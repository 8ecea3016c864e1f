/* The file transport through the engine: host memory <-> this engine's file
 * regions over a FILE endpoint. meson runs it twice: with the backend the
 * engine picks (io_uring where allowed) and with AIOXFER_FILE_IO=threads. */
#include "harness.h"

#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>

#define FSIZE (8u << 20)
#define RW (AXF_ACCESS_READ | AXF_ACCESS_WRITE)

typedef struct ffix {
    tengine *t;
    uint64_t ep;
    int fd;
    char path[64];
    uint8_t *src, *dst;
    uint64_t frid, fkey, srid, skey, drid, dkey;
} ffix;

static int ff_open(ffix *f, const char *dir, int flags, uint32_t faccess)
{
    memset(f, 0, sizeof *f);
    f->t = t_engine(NULL);
    CHECK(f->t);
    snprintf(f->path, sizeof f->path, "%s/axf-file-XXXXXX", dir);
    f->fd = mkostemp(f->path, O_CLOEXEC | flags);
    if (f->fd < 0)
        return -1;
    unlink(f->path);
    CHECK_EQ(ftruncate(f->fd, FSIZE), 0);
    CHECK_EQ(axf_endpoint_create(f->t->e, AXF_EP_FILE, 7, 0, -1, &f->ep), AXF_OK);
    f->src = aligned_alloc(4096, FSIZE);
    f->dst = aligned_alloc(4096, FSIZE);
    CHECK(f->src && f->dst);
    t_fill(f->src, FSIZE, 3);
    memset(f->dst, 0, FSIZE);
    CHECK_EQ(axf_region_register_kind(f->t->e, AXF_MEM_FILE, 0, FSIZE, faccess, f->fd, &f->frid,
                                      &f->fkey),
             AXF_OK);
    CHECK_EQ(axf_region_register(f->t->e, f->src, FSIZE, RW, -1, &f->srid, &f->skey), AXF_OK);
    CHECK_EQ(axf_region_register(f->t->e, f->dst, FSIZE, RW, -1, &f->drid, &f->dkey), AXF_OK);
    return 0;
}

static void ff_close(ffix *f)
{
    t_close(f->t);
    if (f->fd >= 0)
        close(f->fd);
    free(f->src);
    free(f->dst);
}

static axf_desc fd_(uint64_t lrid, uint64_t loff, const ffix *f, uint64_t foff, uint64_t len)
{
    return (axf_desc){.lrid = lrid, .loff = loff, .rrid = f->frid, .rkey = f->fkey, .roff = foff,
                      .len = len};
}

static int wait_ok(tengine *t, uint64_t id, uint64_t nbytes)
{
    axf_completion c;
    CHECK_EQ(t_wait(t, AXF_CQ_XFER, id, &c), 0);
    CHECK_EQ(c.status, AXF_OK);
    CHECK_EQ(c.nbytes, nbytes);
    return 0;
}

static int test_backend_reported(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    char line[128];
    int b = axf_file_info(f.t->e, line, sizeof line);
    const char *force = getenv("AIOXFER_FILE_IO");
    if (force && strcmp(force, "threads") == 0)
        CHECK_EQ(b, 0);
    CHECK(b == 0 || b == 1);
    CHECK(strlen(line) > 0);
    printf("  backend: %s\n", line);
    CHECK_EQ(axf_file_info(NULL, NULL, 0), b); /* the probe chooses alike */
    ff_close(&f);
    return 0;
}

/* Scattered descriptors, small ones and one of several chunks, both ways;
 * the file's bytes checked with pread as well. */
static int test_round_trip(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    axf_desc w[5] = {
        fd_(f.srid, 0, &f, 4096 * 7, 4096),
        fd_(f.srid, 8192 + 100, &f, 1, 333), /* apart from [0] */
        fd_(f.srid, 65536, &f, 2u << 20, (3u << 20) + 17), /* 4 chunks, the last short */
        fd_(f.srid, 5u << 20, &f, 6u << 20, 1u << 20),
        fd_(f.srid, FSIZE - 10, &f, FSIZE - 10, 10), /* the file's last bytes */
    };
    uint64_t total = 0;
    for (int i = 0; i < 5; i++)
        total += w[i].len;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, w, 5, NULL, 0, 1, 0), AXF_OK);
    if (wait_ok(f.t, 1, total))
        return 1;
    uint8_t *chk = malloc(4u << 20);
    CHECK(chk);
    for (int i = 0; i < 5; i++) {
        CHECK_EQ(pread(f.fd, chk, w[i].len, (off_t)w[i].roff), (ssize_t)w[i].len);
        CHECK(memcmp(chk, f.src + w[i].loff, w[i].len) == 0);
    }
    free(chk);
    axf_desc r[5];
    for (int i = 0; i < 5; i++) {
        r[i] = w[i];
        r[i].lrid = f.drid;
    }
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_READ, r, 5, NULL, 0, 2, 0), AXF_OK);
    if (wait_ok(f.t, 2, total))
        return 1;
    for (int i = 0; i < 5; i++)
        CHECK(memcmp(f.dst + r[i].loff, f.src + w[i].loff, w[i].len) == 0);
    ff_close(&f);
    return 0;
}

/* Thousands of small descriptors in one op, and deferred posts released by one doorbell. */
static int test_many_descriptors_deferred(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    enum { N = 2000 };
    axf_desc *d = calloc(N, sizeof *d);
    CHECK(d);
    for (uint64_t i = 0; i < N; i++) /* reversed: file order differs from memory order */
        d[i] = fd_(f.srid, i * 4096, &f, (N - 1 - i) * 4096, 4096);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, d, N / 2, NULL, 0, 1, AXF_POST_DEFER), AXF_OK);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, d + N / 2, N / 2, NULL, 0, 2, AXF_POST_DEFER),
             AXF_OK);
    axf_doorbell(f.t->e);
    if (wait_ok(f.t, 1, N / 2 * 4096) || wait_ok(f.t, 2, N / 2 * 4096))
        return 1;
    for (uint64_t i = 0; i < N; i++)
        d[i].lrid = f.drid;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_READ, d, N, NULL, 0, 3, 0), AXF_OK);
    if (wait_ok(f.t, 3, (uint64_t)N * 4096))
        return 1;
    CHECK(memcmp(f.dst, f.src, (size_t)N * 4096) == 0);
    free(d);
    ff_close(&f);
    return 0;
}

/* Chunks of queued ops are issued in turn: a small op posted behind a bulk
 * one (2048 descriptors) finishes first. */
static int test_small_op_not_stuck_behind_bulk(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    enum { N = FSIZE / 4096 };
    axf_desc *d = calloc(N, sizeof *d);
    CHECK(d);
    for (uint64_t i = 0; i < N; i++)
        d[i] = fd_(f.srid, i * 4096, &f, (N - 1 - i) * 4096, 4096);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, d, N, NULL, 0, 1, AXF_POST_DEFER), AXF_OK);
    axf_desc small = fd_(f.drid, 0, &f, 0, 4096);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_READ, &small, 1, NULL, 0, 2, AXF_POST_DEFER), AXF_OK);
    axf_doorbell(f.t->e);
    axf_completion c;
    CHECK_EQ(t_wait_any(f.t, AXF_CQ_XFER, &c), 0);
    CHECK_EQ(c.id, 2);
    if (wait_ok(f.t, 1, FSIZE))
        return 1;
    free(d);
    ff_close(&f);
    return 0;
}

static int post_status(ffix *f, int op, axf_desc d, uint64_t id)
{
    return axf_post(f->t->e, f->ep, op, &d, 1, NULL, 0, id, 0);
}

static int test_access_checks(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, AXF_ACCESS_READ), 0); /* the file side is read-only */
    axf_desc ok = fd_(f.drid, 0, &f, 0, 4096);
    axf_desc bad = ok;
    bad.rkey ^= 1;
    CHECK_EQ(post_status(&f, AXF_OP_READ, bad, 1), AXF_E_ACCESS);
    bad = ok;
    bad.roff = FSIZE - 100; /* runs past the region */
    CHECK_EQ(post_status(&f, AXF_OP_READ, bad, 2), AXF_E_ACCESS);
    bad = ok;
    bad.rrid = f.srid; /* a host region is not a file */
    bad.rkey = f.skey;
    CHECK_EQ(post_status(&f, AXF_OP_READ, bad, 3), AXF_E_ACCESS);
    bad = ok;
    bad.rrid = 999; /* no such region */
    CHECK_EQ(post_status(&f, AXF_OP_READ, bad, 4), AXF_E_ACCESS);
    CHECK_EQ(post_status(&f, AXF_OP_WRITE, ok, 5), AXF_E_ACCESS); /* no WRITE access */
    bad = ok;
    bad.lrid = f.frid; /* a file region is not host memory */
    bad.loff = 0;
    CHECK_EQ(post_status(&f, AXF_OP_READ, bad, 6), AXF_E_INVALID);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_NOTIFY, NULL, 0, "x", 1, 7, 0), AXF_E_INVALID);
    /* The failing descriptor is the second; the first region ref is dropped. */
    axf_desc two[2] = {ok, ok};
    two[1].rkey ^= 2;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_READ, two, 2, NULL, 0, 8, 0), AXF_E_ACCESS);
    CHECK_EQ(post_status(&f, AXF_OP_READ, ok, 9), AXF_OK);
    if (wait_ok(f.t, 9, 4096))
        return 1;
    axf_stats s;
    axf_engine_stats(f.t->e, &s);
    CHECK_EQ(s.ops, 0);
    ff_close(&f);
    return 0;
}

/* A real I/O error (the file is open read-only, the region says writable:
 * pwrite gets EBADF) fails the op with AXF_E_TRANSPORT and logs the errno. A
 * read that meets the end of a file that shrank under its region asked for
 * bytes the file no longer has: AXF_E_ACCESS (bounds), at its descriptor,
 * the log saying where the file ends (it was AXF_E_TRANSPORT, shown as
 * "transport error" at descriptor 0 with no reason). The engine stays usable. */
static int test_io_errors(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    char path[64];
    snprintf(path, sizeof path, "/tmp/axf-ro-XXXXXX");
    int wfd = mkostemp(path, O_CLOEXEC);
    CHECK(wfd >= 0);
    CHECK_EQ(ftruncate(wfd, 1u << 20), 0);
    int rofd = open(path, O_RDONLY | O_CLOEXEC);
    CHECK(rofd >= 0);
    unlink(path);
    uint64_t rid, key;
    CHECK_EQ(axf_region_register_kind(f.t->e, AXF_MEM_FILE, 0, 1u << 20, RW, rofd, &rid, &key),
             AXF_OK);
    close(rofd);
    axf_desc d = {.lrid = f.srid, .loff = 0, .rrid = rid, .rkey = key, .roff = 0, .len = 8192};
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, 0), AXF_OK);
    axf_completion c;
    CHECK_EQ(t_wait(f.t, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_E_TRANSPORT);
    CHECK_EQ(c.fail_index, 0);
    CHECK_EQ(t_wait_any(f.t, AXF_CQ_LOG, &c), 0);
    CHECK(c.payload_len > 0 && strstr((char *)c.payload, "errno") != NULL);
    axf_completion_free(&c);
    /* The file shrinks under its region: a read inside the region meets EOF. */
    CHECK_EQ(ftruncate(wfd, 4096), 0);
    d.lrid = f.drid;
    d.roff = 65536;
    axf_desc rd[2] = {d, d};
    rd[0].roff = 0; /* inside what is left */
    rd[0].len = 4096;
    rd[1].loff = 8192;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_READ, rd, 2, NULL, 0, 2, 0), AXF_OK);
    CHECK_EQ(t_wait(f.t, AXF_CQ_XFER, 2, &c), 0);
    CHECK_EQ(c.status, AXF_E_ACCESS);
    CHECK_EQ(c.fail_index, 1);
    CHECK_EQ(t_wait_any(f.t, AXF_CQ_LOG, &c), 0);
    CHECK(strstr((char *)c.payload, "end of the file at 4096") != NULL);
    axf_completion_free(&c);
    close(wfd);
    CHECK_EQ(post_status(&f, AXF_OP_WRITE, fd_(f.srid, 0, &f, 0, 4096), 3), AXF_OK);
    if (wait_ok(f.t, 3, 4096))
        return 1;
    ff_close(&f);
    return 0;
}

/* Deregistering a file region with an op in flight: the op finishes (its
 * region ref keeps the fd), new posts are refused, the region is freed. */
static int test_deregister_in_flight(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    enum { N = 1024 };
    axf_desc d[N];
    for (uint64_t i = 0; i < N; i++)
        d[i] = fd_(f.srid, i * 8192, &f, i * 8192, 8192);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, d, N, NULL, 0, 1, 0), AXF_OK);
    CHECK_EQ(axf_region_deregister(f.t->e, f.frid), AXF_OK);
    CHECK_EQ(post_status(&f, AXF_OP_WRITE, d[0], 2), AXF_E_ACCESS);
    if (wait_ok(f.t, 1, (uint64_t)N * 8192))
        return 1;
    axf_completion c;
    CHECK_EQ(t_wait(f.t, AXF_CQ_REGION_FREED, f.frid, &c), 0);
    uint8_t *chk = malloc(FSIZE);
    CHECK(chk);
    CHECK_EQ(pread(f.fd, chk, FSIZE, 0), (ssize_t)FSIZE);
    CHECK(memcmp(chk, f.src, FSIZE) == 0);
    free(chk);
    ff_close(&f);
    return 0;
}

/* A deferred op cancelled before the doorbell never moves a byte. */
static int test_cancel(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    axf_desc d = fd_(f.srid, 0, &f, 0, FSIZE);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, AXF_POST_DEFER), AXF_OK);
    CHECK_EQ(axf_cancel(f.t->e, 1), AXF_OK);
    axf_doorbell(f.t->e);
    axf_completion c;
    CHECK_EQ(t_wait(f.t, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_E_CANCELLED);
    CHECK_EQ(c.nbytes, 0);
    struct stat st;
    CHECK_EQ(fstat(f.fd, &st), 0);
    CHECK_EQ(st.st_blocks, 0); /* still a hole: nothing was written */
    ff_close(&f);
    return 0;
}

/* Endpoint close and engine shutdown fail queued ops promptly. */
static int test_shutdown_and_close(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    axf_desc d = fd_(f.srid, 0, &f, 0, FSIZE);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 1, AXF_POST_DEFER), AXF_OK);
    CHECK_EQ(axf_endpoint_close(f.t->e, f.ep), AXF_OK);
    axf_doorbell(f.t->e);
    axf_completion c;
    CHECK_EQ(t_wait(f.t, AXF_CQ_XFER, 1, &c), 0);
    CHECK_EQ(c.status, AXF_E_CLOSED);
    CHECK_EQ(post_status(&f, AXF_OP_WRITE, d, 2), AXF_E_CLOSED);
    ff_close(&f);
    /* A fresh engine: no I/O thread is awake to take the deferred op early. */
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    d = fd_(f.srid, 0, &f, 0, FSIZE);
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, &d, 1, NULL, 0, 3, AXF_POST_DEFER), AXF_OK);
    axf_engine_shutdown(f.t->e);
    CHECK_EQ(t_wait(f.t, AXF_CQ_XFER, 3, &c), 0);
    CHECK_EQ(c.status, AXF_E_CLOSED);
    CHECK_EQ(c.nbytes, 0);
    ff_close(&f);
    return 0;
}

/* O_DIRECT: aligned descriptors move, a misaligned one is refused at post. */
static int test_direct(void)
{
    ffix f;
    if (ff_open(&f, "/var/tmp", O_DIRECT, RW) != 0) {
        int err = errno;
        printf("  skipped: no O_DIRECT file in /var/tmp (%s)\n", strerror(err));
        t_close(f.t);
        return 0;
    }
    axf_desc w[2] = {fd_(f.srid, 0, &f, 8192, 4096), fd_(f.srid, 1u << 20, &f, 1u << 20, 2u << 20)};
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, w, 2, NULL, 0, 1, 0), AXF_OK);
    if (wait_ok(f.t, 1, 4096 + (2u << 20)))
        return 1;
    axf_desc r[2] = {w[0], w[1]};
    r[0].lrid = r[1].lrid = f.drid;
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_READ, r, 2, NULL, 0, 2, 0), AXF_OK);
    if (wait_ok(f.t, 2, 4096 + (2u << 20)))
        return 1;
    CHECK(memcmp(f.dst, f.src, 4096) == 0);
    CHECK(memcmp(f.dst + (1u << 20), f.src + (1u << 20), 2u << 20) == 0);
    axf_desc bad[3] = {w[0], w[0], w[0]};
    bad[1].roff = 100; /* file offset */
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, bad, 3, NULL, 0, 3, 0), AXF_E_INVALID);
    bad[1] = w[0];
    bad[2].loff = 4096 + 3; /* host address */
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, bad, 3, NULL, 0, 4, 0), AXF_E_INVALID);
    bad[2] = w[0];
    bad[0].len = 4096 + 1; /* length */
    CHECK_EQ(axf_post(f.t->e, f.ep, AXF_OP_WRITE, bad, 3, NULL, 0, 5, 0), AXF_E_INVALID);
    ff_close(&f);
    return 0;
}

/* A file region must lie below the largest off_t: pread/pwrite (and io_uring)
 * take signed offsets, so one reaching past it could only ever fail at I/O
 * time. Refused when registered, with its fd closed; one ending at the limit
 * registers. */
static int test_region_past_off_t_refused(void)
{
    ffix f;
    CHECK_EQ(ff_open(&f, "/tmp", 0, RW), 0);
    uint64_t rid, key;
    const uint64_t off_max = (uint64_t)INT64_MAX;
    CHECK_EQ(axf_region_register_kind(f.t->e, AXF_MEM_FILE, off_max - 4095, 8192, RW, f.fd, &rid,
                                      &key),
             AXF_E_INVALID);
    CHECK_EQ(axf_region_register_kind(f.t->e, AXF_MEM_FILE, 0, off_max + 1, RW, f.fd, &rid, &key),
             AXF_E_INVALID);
    CHECK_EQ(axf_region_register_kind(f.t->e, AXF_MEM_FILE, off_max + 1, 4096, RW, f.fd, &rid,
                                      &key),
             AXF_E_INVALID);
    CHECK_EQ(axf_region_register_kind(f.t->e, AXF_MEM_FILE, off_max - 4096, 4096, RW, f.fd, &rid,
                                      &key),
             AXF_OK);
    CHECK_EQ(axf_region_deregister(f.t->e, rid), AXF_OK);
    axf_stats s;
    axf_engine_stats(f.t->e, &s);
    CHECK_EQ(s.regions, 3); /* the fixture's three */
    ff_close(&f);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_backend_reported),
        T_CASE(test_round_trip),
        T_CASE(test_many_descriptors_deferred),
        T_CASE(test_small_op_not_stuck_behind_bulk),
        T_CASE(test_access_checks),
        T_CASE(test_io_errors),
        T_CASE(test_deregister_in_flight),
        T_CASE(test_cancel),
        T_CASE(test_shutdown_and_close),
        T_CASE(test_direct),
        T_CASE(test_region_past_off_t_refused),
    };
    return T_RUN(argc, argv, cases);
}

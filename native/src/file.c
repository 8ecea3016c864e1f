/* File transport: host memory <-> this engine's own file regions (local SSD,
 * filesystems, block devices).
 *
 * A FILE endpoint's "remote" side names one of our file regions; a WRITE is
 * host -> file, a READ file -> host. Descriptors are cut into chunks of at most
 * CHUNK bytes so that many are in flight at once. Two backends, each with
 * its own queue of ops (see file_mode for which op goes where):
 *  - io_uring (uring.h: the kernel interface itself, no liburing needed;
 *    where the kernel allows it): one thread owns the ring, submits up to
 *    QDEPTH chunks and sleeps in io_uring_enter until one completes; a poll
 *    on an eventfd wakes it for new work.
 *  - a small pread/pwrite thread pool: buffered I/O, and everything where
 *    there is no ring (built with -Dliburing=disabled, ENOSYS/EPERM from
 *    io_uring_setup, kernel < 5.6, or AIOXFER_FILE_IO=threads).
 * Nothing spins. Every op holds one unit while chunks remain to be issued,
 * plus one per chunk in flight; completions go through op_unit_done. Short
 * transfers are resubmitted for the rest; a read that meets the end of the
 * file inside the registered bounds (the file shrank under us) fails the op
 * with AXF_E_ACCESS (the bytes are not there), every I/O error with
 * AXF_E_TRANSPORT (EFAULT: AXF_E_ACCESS), the errno or file size logged. */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef AXF_HAVE_URING
#include "uring.h"
#endif

#define CHUNK (1u << 20) /* a multiple of every O_DIRECT block size */
#define QDEPTH 128u      /* io_uring: chunks in flight at once */
#define POOL_THREADS 4u  /* thread pool: concurrent preads/pwrites */
#define WAKE_TAG UINT64_MAX

/* An op whose chunks are not all issued yet: i/off is the next byte. */
typedef struct fjob {
    op *o;
    size_t i;
    uint64_t off;
    struct fjob *next;
} fjob;

/* One chunk in flight. */
typedef struct fchunk {
    op *o;
    size_t i;
    uint64_t off, len, done;
} fchunk;

/* Jobs waiting for one backend; f->mu. */
typedef struct fqueue {
    fjob *head, *tail;
    bool kick; /* deferred posts not yet woken for */
} fqueue;

enum { MODE_AUTO, MODE_THREADS, MODE_URING };

typedef struct file_xport {
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* thread pool: work or stop */
    fqueue pool_q, ring_q; /* mu */
    bool stop;             /* mu */
    int mode;              /* AIOXFER_FILE_IO */
    bool uring;            /* a ring is up: O_DIRECT ops (all ops in MODE_URING) use it */
    char why[128];         /* what was chosen, and why */
    pthread_t threads[POOL_THREADS + 1];
    uint32_t nthreads;
    int wake_fd;           /* io_uring: written when work arrives */
#ifdef AXF_HAVE_URING
    axf_uring ring;
    fchunk slots[QDEPTH];
    uint32_t free_slots[QDEPTH];
    uint32_t nfree;
#endif
} file_xport;

/* ------------------------------------------------------------ backend choice */

/* Measured here (page cache, 2 cores): buffered 4 KiB writes through a ring
 * run at half the pool's rate (io-wq serialises a file's buffered writes
 * behind a punt per request) and cached reads complete inline on the one ring
 * thread, where the pool copies on several; with O_DIRECT the ring keeps the
 * device's queue full and wins twice over on 4 KiB. So by default the ring
 * takes ops whose file regions are all O_DIRECT, the pool the rest.
 * AIOXFER_FILE_IO=threads: the pool only; =uring: the ring for everything. */
static int file_mode(const axf_env *env)
{
    const char *v = axf_env_get(env, AXF_ENV_FILE_IO);
    if (v && strcmp(v, "threads") == 0)
        return MODE_THREADS;
    if (v && strcmp(v, "uring") == 0)
        return MODE_URING;
    return MODE_AUTO;
}

/* Tries a ring; on success it is left initialised in *ring (when non-NULL). */
static bool uring_try(int mode, void *ring_out, char *why, size_t cap)
{
    if (mode == MODE_THREADS) {
        snprintf(why, cap, "thread pool: forced by AIOXFER_FILE_IO=threads");
        return false;
    }
#ifdef AXF_HAVE_URING
    axf_uring tmp, *ring = ring_out ? ring_out : &tmp;
    int r = axf_uring_init(QDEPTH * 2, ring);
    if (r < 0) {
        snprintf(why, cap, "thread pool: io_uring unavailable (%s)",
                 -r == ENOSYS ? "ENOSYS" : -r == EPERM ? "EPERM" : strerror(-r));
        return false;
    }
    /* Kernels before 5.6 have rings but not these opcodes. */
    static const int need[] = {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_POLL_ADD};
    if (!axf_uring_supports(ring, need, 3)) {
        axf_uring_exit(ring);
        snprintf(why, cap, "thread pool: io_uring lacks IORING_OP_READ/WRITE (kernel < 5.6)");
        return false;
    }
    if (!ring_out)
        axf_uring_exit(ring);
    snprintf(why, cap, "io_uring (kernel interface) %s",
             mode == MODE_URING ? "for all file I/O (AIOXFER_FILE_IO=uring)"
                                : "for O_DIRECT, thread pool for buffered I/O");
    return true;
#else
    (void)ring_out;
    snprintf(why, cap, "thread pool: built without io_uring (-Dliburing=disabled)");
    return false;
#endif
}

int axf_file_info(axf_engine *e, char *buf, size_t cap)
{
    char why[96];
    if (!buf || !cap) {
        buf = why;
        cap = sizeof why;
    }
    if (!e) { /* what an engine created now would use */
        axf_env env; /* a pointer (once 8.7 KiB, then malloc'd here) */
        axf_env_take(&env, true);
        int mode = file_mode(&env);
        axf_env_release(&env);
        return uring_try(mode, NULL, buf, cap) ? 1 : 0;
    }
    pthread_mutex_lock(&e->mu);
    file_xport *f = e->xp[AXF_EP_FILE];
    int r = f ? (f->uring ? 1 : 0) : -1;
    snprintf(buf, cap, "%s", f ? f->why : "not started");
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* ------------------------------------------------------------ regions */

/* An op's (op->priv): the file region of each descriptor, and the distinct
 * ones (one reference each). */
typedef struct file_op {
    region **fr, **fregs;
    size_t nfregs;
} file_op;
#define FOP(o) ((file_op *)(o)->priv)

/* A file region's slot (region->xp[AXF_EP_FILE]), no allocation: the file
 * was opened O_DIRECT, and offsets, lengths and host addresses must be
 * multiples of this; else 0. */
static inline uint32_t dio_align(const region *r)
{
    return (uint32_t)(uintptr_t)r->xp[AXF_EP_FILE];
}

static uint32_t file_dio_align(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || !(fl & O_DIRECT))
        return 0;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISBLK(st.st_mode)) {
        int bs = 0;
        if (ioctl(fd, BLKSSZGET, &bs) == 0 && bs > 0 && (bs & (bs - 1)) == 0)
            return (uint32_t)bs;
    }
#ifdef STATX_DIOALIGN
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
        uint32_t a = sx.stx_dio_offset_align > sx.stx_dio_mem_align ? sx.stx_dio_offset_align
                                                                    : sx.stx_dio_mem_align;
        if (a && (a & (a - 1)) == 0 && a <= CHUNK)
            return a;
    }
#endif
    return 4096; /* safe for every device we know of */
}

static int file_resolve(axf_engine *e, op *o, size_t i, uint32_t need)
{
    const axf_desc *d = &o->d[i];
    region *r = NULL;
    if (!o->priv) {
        file_op *fo = calloc(1, sizeof *fo);
        if (!fo)
            return AXF_E_NOMEM;
        o->priv = fo;
        fo->fr = calloc(o->n, sizeof *fo->fr);
        fo->fregs = calloc(o->n, sizeof *fo->fregs);
        if (!fo->fr || !fo->fregs)
            return AXF_E_NOMEM;
    }
    file_op *fo = FOP(o);
    if (i && fo->fr[i - 1]->id == d->rrid) {
        r = fo->fr[i - 1];
    } else {
        for (size_t k = 0; k < fo->nfregs && !r; k++)
            if (fo->fregs[k]->id == d->rrid)
                r = fo->fregs[k];
        if (!r) {
            r = region_get(e, d->rrid);
            if (!r)
                return AXF_E_ACCESS;
            fo->fregs[fo->nfregs++] = r;
        }
    }
    if (r->kind != AXF_MEM_FILE || r->key != d->rkey || !(r->access & need) || d->roff > r->len ||
        d->len > r->len - d->roff)
        return AXF_E_ACCESS;
    /* O_DIRECT moves whole blocks between the device and our memory. */
    uint64_t a = dio_align(r);
    if (a && (((r->foff + d->roff) | d->len | (uint64_t)(uintptr_t)o->laddr[i]) & (a - 1)))
        return AXF_E_INVALID;
    fo->fr[i] = r;
    return AXF_OK;
}

/* ------------------------------------------------------------ work queue */

/* Takes the next chunk of the first job, which then goes to the back of the
 * queue (f->mu held). The chunk is counted as a unit of its op before the
 * job's own unit may go. Returns the op whose job ended (its unit to release
 * once unlocked) in *ended. */
static bool take_chunk(file_xport *f, fqueue *q, fchunk *c, op **ended)
{
    *ended = NULL;
    while (q->head) {
        fjob *j = q->head;
        op *o = j->o;
        bool over = f->stop || atomic_load(&o->cancelled) || atomic_load(&o->status) != AXF_OK;
        if (f->stop)
            op_set_status(o, AXF_E_CLOSED, j->i);
        if (!over) {
            uint64_t left = o->d[j->i].len - j->off;
            *c = (fchunk){.o = o, .i = j->i, .off = j->off, .len = left < CHUNK ? left : CHUNK};
            atomic_fetch_add(&o->remaining, 1);
            j->off += c->len;
            if (j->off == o->d[j->i].len) {
                j->i++;
                j->off = 0;
            }
            if (j->i < o->n) {
                if (j->next) { /* round robin: a small op is not stuck behind a bulk one */
                    q->head = j->next;
                    j->next = NULL;
                    q->tail->next = j;
                    q->tail = j;
                }
                return true;
            }
        }
        q->head = j->next;
        if (!q->head)
            q->tail = NULL;
        free(j);
        *ended = o;
        return !over;
    }
    return false;
}

static int io_status(int err)
{
    return err == EFAULT ? AXF_E_ACCESS : err == ENOMEM ? AXF_E_NOMEM : AXF_E_TRANSPORT;
}

/* A chunk that failed: err is its errno, 0 when the call returned 0 bytes. A
 * READ that got 0 met the end of the file inside the region's bounds (the
 * file shrank under it): the bytes asked for are not there, a bounds failure
 * like a far region too short for a same-host copy, AXF_E_ACCESS (it was
 * AXF_E_TRANSPORT, which says nothing of what happened). */
static void chunk_failed(axf_engine *e, fchunk *c, int err)
{
    const char *what = c->o->opcode == AXF_OP_WRITE ? "write" : "read";
    int fd = FOP(c->o)->fr[c->i]->fd;
    unsigned long long at = FOP(c->o)->fr[c->i]->foff + c->o->d[c->i].roff + c->off + c->done;
    unsigned long long left = c->len - c->done;
    bool eof = !err && c->o->opcode == AXF_OP_READ;
    op_set_status(c->o, err ? io_status(err) : eof ? AXF_E_ACCESS : AXF_E_TRANSPORT, c->i);
    struct stat st;
    if (err)
        cq_log(e, c->o->ep->tag, "file: %s of %llu bytes at offset %llu failed: %s (errno %d)",
               what, left, at, strerror(err), err);
    else if (eof && fstat(fd, &st) == 0)
        cq_log(e, c->o->ep->tag,
               "file: read of %llu bytes at offset %llu met the end of the file at %llu: the "
               "file is shorter than its region (it shrank?)",
               left, at, (unsigned long long)st.st_size);
    else
        cq_log(e, c->o->ep->tag, "file: %s of %llu bytes at offset %llu %s", what, left, at,
               eof ? "met the end of the file (it shrank?)" : "made no progress");
}

static void chunk_ok(fchunk *c)
{
    atomic_fetch_add(&c->o->nbytes, c->len);
}

/* ------------------------------------------------------------ thread pool */

static void *pool_main(void *arg)
{
    axf_engine *e = arg;
    file_xport *f = e->xp[AXF_EP_FILE];
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (!f->pool_q.head && !f->stop)
            pthread_cond_wait(&f->cv, &f->mu);
        if (!f->pool_q.head)
            break; /* stopping, nothing queued */
        fchunk c;
        op *ended;
        bool got = take_chunk(f, &f->pool_q, &c, &ended);
        pthread_mutex_unlock(&f->mu);
        if (ended)
            op_unit_done(e, ended);
        if (got) {
            int fd = FOP(c.o)->fr[c.i]->fd;
            int err = 0;
            while (c.done < c.len) {
                uint8_t *mem = c.o->laddr[c.i] + c.off + c.done;
                off_t at = (off_t)(FOP(c.o)->fr[c.i]->foff + c.o->d[c.i].roff + c.off + c.done);
                size_t len = (size_t)(c.len - c.done);
                ssize_t n = c.o->opcode == AXF_OP_WRITE ? pwrite(fd, mem, len, at)
                                                        : pread(fd, mem, len, at);
                if (n < 0 && errno == EINTR)
                    continue;
                if (n <= 0) {
                    err = n < 0 ? errno : 0;
                    break;
                }
                c.done += (uint64_t)n;
            }
            if (c.done == c.len)
                chunk_ok(&c);
            else
                chunk_failed(e, &c, err);
            op_unit_done(e, c.o);
        }
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* ------------------------------------------------------------ io_uring */

#ifdef AXF_HAVE_URING
static void uring_prep(file_xport *f, uint32_t slot)
{
    fchunk *c = &f->slots[slot];
    struct io_uring_sqe *sqe = axf_uring_get_sqe(&f->ring);
    /* Never NULL: the ring has twice QDEPTH entries and at most QDEPTH + 1 are
     * ever outstanding, all submitted before the next batch is prepared. */
    uint8_t *mem = c->o->laddr[c->i] + c->off + c->done;
    uint64_t at = FOP(c->o)->fr[c->i]->foff + c->o->d[c->i].roff + c->off + c->done;
    unsigned len = (unsigned)(c->len - c->done);
    axf_uring_prep_rw(sqe, c->o->opcode == AXF_OP_WRITE ? IORING_OP_WRITE : IORING_OP_READ,
                      FOP(c->o)->fr[c->i]->fd, mem, len, at, slot);
}

static void *uring_main(void *arg)
{
    axf_engine *e = arg;
    file_xport *f = e->xp[AXF_EP_FILE];
    bool armed = false, stopping = false, ring_error = false;
    uint32_t inflight = 0;
    for (;;) {
        if (!armed && !stopping) {
            axf_uring_prep_poll_in(axf_uring_get_sqe(&f->ring), f->wake_fd, WAKE_TAG);
            armed = true;
        }
        /* Issue what fits; ops whose last chunk was issued release their unit. */
        pthread_mutex_lock(&f->mu);
        stopping = f->stop;
        for (;;) {
            fchunk c;
            op *ended = NULL;
            bool got = f->nfree > 0 && take_chunk(f, &f->ring_q, &c, &ended);
            if (!got && !ended && (f->nfree == 0 || !f->ring_q.head))
                break;
            if (ended) {
                pthread_mutex_unlock(&f->mu);
                op_unit_done(e, ended);
                pthread_mutex_lock(&f->mu);
            }
            if (got) {
                uint32_t slot = f->free_slots[--f->nfree];
                f->slots[slot] = c;
                uring_prep(f, slot);
                inflight++;
            }
        }
        pthread_mutex_unlock(&f->mu);
        if (stopping && inflight == 0)
            break;
        int r = axf_uring_submit_and_wait(&f->ring, 1);
        if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
            /* Not seen in practice. What the kernel took still completes into
             * the mapped CQ ring: keep reaping, slowly, and say so once. */
            if (!ring_error)
                cq_log(e, 0, "file: io_uring_enter failed: %s", strerror(-r));
            ring_error = true;
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
        struct io_uring_cqe *cqe;
        unsigned head = *f->ring.cq_head, seen = 0;
        for (; (cqe = axf_uring_cqe_at(&f->ring, head)) != NULL; head++) {
            seen++;
            uint64_t tag = cqe->user_data;
            int res = cqe->res;
            if (tag == WAKE_TAG) {
                uint64_t v;
                ssize_t n = read(f->wake_fd, &v, sizeof v);
                (void)n;
                armed = false;
                continue;
            }
            fchunk *c = &f->slots[tag];
            bool again = false;
            if (res == -EINTR || res == -EAGAIN) {
                again = true;
            } else if (res > 0) {
                c->done += (uint64_t)res;
                again = c->done < c->len; /* short: the rest, from where it stopped */
                if (!again)
                    chunk_ok(c);
            } else {
                chunk_failed(e, c, -res);
            }
            if (again && !stopping) {
                uring_prep(f, (uint32_t)tag);
                continue;
            }
            if (again)
                op_set_status(c->o, AXF_E_CLOSED, c->i);
            op *o = c->o;
            inflight--;
            pthread_mutex_lock(&f->mu);
            f->free_slots[f->nfree++] = (uint32_t)tag;
            pthread_mutex_unlock(&f->mu);
            op_unit_done(e, o);
        }
        axf_uring_cq_advance(&f->ring, seen);
    }
    return NULL;
}
#endif

/* ------------------------------------------------------------ lifecycle */

static int file_start(axf_engine *e) /* e->mu held */
{
    if (e->xp[AXF_EP_FILE])
        return AXF_OK;
    file_xport *f = calloc(1, sizeof *f);
    if (!f)
        return AXF_E_NOMEM;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->wake_fd = -1;
    f->mode = file_mode(&e->env); /* as it was at the engine's creation */
#ifdef AXF_HAVE_URING
    f->uring = uring_try(f->mode, &f->ring, f->why, sizeof f->why);
    if (f->uring) {
        f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (f->wake_fd < 0) {
            axf_uring_exit(&f->ring);
            f->uring = false;
            snprintf(f->why, sizeof f->why, "thread pool: no eventfd for io_uring");
        }
    }
    for (uint32_t k = 0; k < QDEPTH; k++)
        f->free_slots[k] = k;
    f->nfree = QDEPTH;
#else
    uring_try(f->mode, NULL, f->why, sizeof f->why);
#endif
    e->xp[AXF_EP_FILE] = f;
    /* The pool always runs (buffered I/O, and every op without a ring). */
    for (uint32_t k = 0; k < POOL_THREADS; k++) {
        if (pthread_create(&f->threads[f->nthreads], NULL, pool_main, e) != 0)
            break;
        f->nthreads++;
    }
#ifdef AXF_HAVE_URING
    if (f->nthreads && f->uring) {
        if (pthread_create(&f->threads[f->nthreads], NULL, uring_main, e) == 0) {
            f->nthreads++;
        } else {
            axf_uring_exit(&f->ring);
            f->uring = false;
            snprintf(f->why, sizeof f->why, "thread pool: no thread for io_uring");
        }
    }
#endif
    if (!f->nthreads) {
        e->xp[AXF_EP_FILE] = NULL;
#ifdef AXF_HAVE_URING
        if (f->uring)
            axf_uring_exit(&f->ring);
#endif
        if (f->wake_fd >= 0)
            close(f->wake_fd);
        pthread_mutex_destroy(&f->mu);
        pthread_cond_destroy(&f->cv);
        free(f);
        return AXF_E_NOMEM;
    }
    return AXF_OK;
}

static void file_wake(file_xport *f, fqueue *q) /* f->mu held */
{
    if (q == &f->ring_q) {
        uint64_t one = 1;
        ssize_t n = write(f->wake_fd, &one, sizeof one);
        (void)n; /* EAGAIN: the counter is already non-zero, still readable */
    } else {
        pthread_cond_broadcast(&f->cv);
    }
}

/* Queues of every engine with a deferred job waiting for a doorbell (a
 * hint: file_doorbell does nothing while it is 0). */
static atomic_uint file_kicks;

static void file_submit(axf_engine *e, op *o, bool signal)
{
    file_xport *f = e->xp[AXF_EP_FILE];
    fjob *j = calloc(1, sizeof *j);
    /* The job's own unit: held until its last chunk is issued. */
    atomic_store(&o->remaining, 1);
    if (!j) {
        op_set_status(o, AXF_E_NOMEM, 0);
        op_unit_done(e, o);
        return;
    }
    j->o = o;
    bool ring = f->uring && FOP(o)->nfregs > 0;
    for (size_t k = 0; ring && f->mode != MODE_URING && k < FOP(o)->nfregs; k++)
        ring = dio_align(FOP(o)->fregs[k]) != 0;
    fqueue *q = ring ? &f->ring_q : &f->pool_q;
    pthread_mutex_lock(&f->mu);
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
    if (signal) {
        file_wake(f, q);
    } else if (!q->kick) {
        q->kick = true;
        atomic_fetch_add_explicit(&file_kicks, 1, memory_order_release);
    }
    pthread_mutex_unlock(&f->mu);
}

/* Rung by every doorbell that is not shm's alone (each tcp request's, say):
 * with no deferred file job queued in any engine (file_kicks, counted before
 * the poster marks its bell), nothing to do, without e->mu to find this
 * engine's state and its queues' lock. */
static void file_doorbell(axf_engine *e)
{
    if (!atomic_load_explicit(&file_kicks, memory_order_acquire))
        return;
    pthread_mutex_lock(&e->mu);
    file_xport *f = e->xp[AXF_EP_FILE];
    pthread_mutex_unlock(&e->mu);
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    fqueue *qs[2] = {&f->pool_q, &f->ring_q};
    for (int k = 0; k < 2; k++)
        if (qs[k]->kick) {
            qs[k]->kick = false;
            atomic_fetch_sub_explicit(&file_kicks, 1, memory_order_relaxed);
            file_wake(f, qs[k]);
        }
    pthread_mutex_unlock(&f->mu);
}

static void file_stop(axf_engine *e)
{
    pthread_mutex_lock(&e->mu);
    file_xport *f = e->xp[AXF_EP_FILE];
    pthread_mutex_unlock(&e->mu);
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    for (int k = 0; k < 2; k++) { /* kicks no doorbell will take now: off the count */
        fqueue *q = k ? &f->ring_q : &f->pool_q;
        if (q->kick) {
            q->kick = false;
            atomic_fetch_sub_explicit(&file_kicks, 1, memory_order_relaxed);
        }
    }
    file_wake(f, &f->pool_q);
    if (f->uring)
        file_wake(f, &f->ring_q);
    pthread_mutex_unlock(&f->mu);
    for (uint32_t k = 0; k < f->nthreads; k++)
        pthread_join(f->threads[k], NULL);
    f->nthreads = 0;
    /* Jobs no thread took (none is left running): fail them here. No post
     * can queue one after this: axf_post checks e->shut under e->mu before
     * it reaches file_submit, and posts come from the loop thread, which is
     * in axf_engine_shutdown now (aioxfer.h's threading contract; _cyx's
     * Engine.close refuses while a post is under way). A second thread that
     * broke it would leave its op on its endpoint, completed AXF_E_CLOSED by
     * shutdown's last sweep (only its fjob would leak); that same window lets
     * the sweep free an op any transport's submit still reads: the engine's
     * contract to keep, not this queue's. */
    fqueue *qs[2] = {&f->pool_q, &f->ring_q};
    for (int k = 0; k < 2; k++)
        for (;;) {
            fchunk c;
            op *ended = NULL;
            pthread_mutex_lock(&f->mu);
            bool got = take_chunk(f, qs[k], &c, &ended); /* stop is set: never a chunk */
            pthread_mutex_unlock(&f->mu);
            (void)got;
            if (!ended)
                break;
            op_unit_done(e, ended);
        }
}

static void file_free(axf_engine *e)
{
    file_xport *f = e->xp[AXF_EP_FILE];
    if (!f)
        return;
    e->xp[AXF_EP_FILE] = NULL;
#ifdef AXF_HAVE_URING
    if (f->uring)
        axf_uring_exit(&f->ring);
#endif
    if (f->wake_fd >= 0)
        close(f->wake_fd);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f);
}

/* ------------------------------------------------------------ transport */

static void file_op_free(axf_engine *e, op *o)
{
    file_op *fo = FOP(o);
    for (size_t i = 0; i < fo->nfregs; i++)
        region_unref(e, fo->fregs[i]);
    free(fo->fr);
    free(fo->fregs);
    free(fo);
    o->priv = NULL;
}

static int file_region_add(axf_engine *e, region *r)
{
    (void)e;
    if (r->kind != AXF_MEM_FILE)
        return AXF_OK;
    /* pread/pwrite and io_uring take signed (off_t) offsets: a region
     * reaching past the largest one could only fail at I/O time. */
    if (r->foff > (uint64_t)INT64_MAX || r->len > (uint64_t)INT64_MAX - r->foff)
        return AXF_E_INVALID;
    r->xp[AXF_EP_FILE] = (void *)(uintptr_t)file_dio_align(r->fd);
    return AXF_OK;
}

static int file_ep_open(axf_engine *e, endpoint *ep)
{
    (void)ep;
    return file_start(e);
}

static bool file_post(axf_engine *e, op *o, uint32_t flags)
{
    pthread_mutex_unlock(&e->mu);
    file_submit(e, o, !(flags & AXF_POST_DEFER));
    return true;
}

const axf_transport axf_xp_file = {
    .abi = AXF_TRANSPORT_ABI,
    .name = "file",
    .ep_kind = AXF_EP_FILE,
    .caps = AXF_XP_CAP_OWN_DATA | AXF_XP_CAP_FAIL_EARLY,
    .local_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .far_mem = AXF_MEM_BIT(AXF_MEM_FILE),
    .stop = file_stop,
    .destroy = file_free,
    .region_add = file_region_add,
    .ep_open = file_ep_open,
    .resolve = file_resolve,
    .op_free = file_op_free,
    .submit = file_post,
    .doorbell = file_doorbell,
};

/* A minimal io_uring, on the kernel's own interface (<linux/io_uring.h>, the
 * UAPI header every Linux C toolchain has, and the io_uring_setup /
 * io_uring_enter / io_uring_register system calls): exactly what the file
 * transport uses (one ring owned by one thread; read, write and poll-add
 * requests; submit-and-wait; reaping completions in place), so it needs no
 * liburing to build. Included by file.c only.
 *
 * The rings are shared with the kernel: our stores to the submission tail
 * and completion head are releases, our loads of the kernel's completion
 * tail acquires (the kernel's io_uring(7) and liburing do the same). The
 * kernel only reads the SQ array entries we publish with the tail store. */
#ifndef AXF_URING_H
#define AXF_URING_H

#include <errno.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct axf_uring {
    int fd;
    /* submission ring (kernel-shared words) and its entries */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    struct io_uring_sqe *sqes;
    unsigned sq_entries;
    unsigned sqe_next; /* entries handed out, not yet published (ours) */
    /* completion ring */
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
} axf_uring;

static int uring_sys_setup(unsigned entries, struct io_uring_params *p)
{
    long r = syscall(__NR_io_uring_setup, entries, p);
    return r < 0 ? -errno : (int)r;
}

static int uring_sys_enter(int fd, unsigned submit, unsigned wait, unsigned flags)
{
    long r = syscall(__NR_io_uring_enter, fd, submit, wait, flags, NULL, 0);
    return r < 0 ? -errno : (int)r;
}

static void axf_uring_exit(axf_uring *r)
{
    if (r->sqes)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_map_len);
    if (r->fd >= 0)
        close(r->fd);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

/* A ring of `entries` submission entries; 0 or -errno (ENOSYS: no io_uring in
 * this kernel; EPERM: disabled, e.g. kernel.io_uring_disabled or seccomp). */
static int axf_uring_init(unsigned entries, axf_uring *r)
{
    memset(r, 0, sizeof *r);
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = uring_sys_setup(entries, &p);
    if (r->fd < 0) {
        int err = r->fd;
        r->fd = -1;
        return err;
    }
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    bool single = p.features & IORING_FEAT_SINGLE_MMAP; /* one mapping for both rings */
    if (single && r->cq_map_len > r->sq_map_len)
        r->sq_map_len = r->cq_map_len;
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                     r->fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) {
        r->sq_map = NULL;
        goto fail;
    }
    r->cq_map = single ? r->sq_map
                       : mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED) {
        r->cq_map = NULL;
        goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        r->sqes = NULL;
        goto fail;
    }
    uint8_t *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->sq_entries = p.sq_entries;
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
fail:;
    int err = -errno;
    axf_uring_exit(r);
    return err ? err : -ENOMEM;
}

/* Whether the kernel supports every opcode in ops (IORING_REGISTER_PROBE,
 * Linux >= 5.6; before that, READ and WRITE did not exist either). */
static bool axf_uring_supports(axf_uring *r, const int *ops, int n)
{
    size_t len = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *probe = calloc(1, len);
    if (!probe)
        return false;
    long rc = syscall(__NR_io_uring_register, r->fd, IORING_REGISTER_PROBE, probe, 256);
    bool ok = rc >= 0;
    for (int i = 0; ok && i < n; i++)
        ok = ops[i] <= probe->last_op && (probe->ops[ops[i]].flags & IO_URING_OP_SUPPORTED);
    free(probe);
    return ok;
}

/* The next free submission entry, zeroed; NULL when the ring is full. */
static struct io_uring_sqe *axf_uring_get_sqe(axf_uring *r)
{
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    if (r->sqe_next - head >= r->sq_entries)
        return NULL;
    struct io_uring_sqe *sqe = &r->sqes[r->sqe_next & *r->sq_mask];
    r->sqe_next++;
    memset(sqe, 0, sizeof *sqe);
    return sqe;
}

static void axf_uring_prep_rw(struct io_uring_sqe *sqe, int op, int fd, void *buf, unsigned len,
                              uint64_t off, uint64_t user_data)
{
    sqe->opcode = (uint8_t)op;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = user_data;
}

static void axf_uring_prep_poll_in(struct io_uring_sqe *sqe, int fd, uint64_t user_data)
{
    sqe->opcode = IORING_OP_POLL_ADD;
    sqe->fd = fd;
    /* The 32-bit poll mask is read as two 16-bit halves swapped on
     * big-endian hosts (as liburing's io_uring_prep_poll_add does). */
    uint32_t mask = POLLIN;
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    mask = (mask << 16) | (mask >> 16);
#endif
    sqe->poll32_events = mask;
    sqe->user_data = user_data;
}

/* Publishes what was prepared and waits for at least wait_nr completions;
 * the number submitted, or -errno. */
static int axf_uring_submit_and_wait(axf_uring *r, unsigned wait_nr)
{
    unsigned tail = *r->sq_tail; /* only we write it */
    unsigned n = r->sqe_next - tail;
    for (unsigned i = 0; i < n; i++)
        r->sq_array[(tail + i) & *r->sq_mask] = (tail + i) & *r->sq_mask;
    __atomic_store_n(r->sq_tail, tail + n, __ATOMIC_RELEASE);
    return uring_sys_enter(r->fd, n, wait_nr, wait_nr ? IORING_ENTER_GETEVENTS : 0);
}

/* The completion at position `head` if the kernel has posted it, else NULL;
 * positions run from *cq_head on. */
static struct io_uring_cqe *axf_uring_cqe_at(axf_uring *r, unsigned head)
{
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    return head != tail ? &r->cqes[head & *r->cq_mask] : NULL;
}

/* Gives the kernel back `seen` reaped completion slots. */
static void axf_uring_cq_advance(axf_uring *r, unsigned seen)
{
    if (seen)
        __atomic_store_n(r->cq_head, *r->cq_head + seen, __ATOMIC_RELEASE);
}

#endif

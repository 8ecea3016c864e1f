/* Same-host transport: copies straight into (or out of) a peer's memory.
 * Regions the peer allocated in a memfd are mapped here once (the fd came
 * over its unix socket with SCM_RIGHTS, sealed against resizing), so a
 * transfer is a memcpy; other peer memory is reached by cross-memory attach
 * (process_vm_readv/writev), aimed only at the pid the kernel reported for
 * the endpoint. Copies run on the engine's worker threads, a chunk at a time
 * with the endpoint's and the region's state checked in between; a small copy
 * runs inline at submit so its completion is known at once, and the posting
 * thread copies a share of a larger one beside the workers (shm_help). */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/uio.h>
#include <unistd.h>

/* Small descriptors are batched up to this size per job: a 256 x 16 KiB
 * batch is 16 jobs, shared out between the workers and the posting thread
 * (whose share is bounded by inline_bytes, 1-2 MiB) by whoever is free. */
#define RUN_BYTES (256u << 10)
#define RUN_DESCS 1024u        /* ... and this many (IOV_MAX) */
#define SHARED_MIN (2u << 20)  /* a lone request from here is shared with the workers */
#define MIN_PIECE (1u << 20)   /* a large descriptor is split into pieces no smaller */

/* Seals a peer's memfd must carry before we map it: without them the peer
 * could shrink the file under our copies (SIGBUS here), or unseal it later. */
#define SHM_SEALS_NEEDED (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* A piece of an op's copy for a worker. */
typedef struct job {
    op *op;
    size_t i0, i1;      /* whole descriptors [i0, i1) ... */
    uint64_t off, len;  /* ... or, when len != 0, bytes [off, off+len) of descriptor i0 */
    uint64_t bytes;     /* what it copies */
    struct shm_waiter *wait; /* a posting thread waiting for it (copy_shared) */
    struct job *next;
} job;

/* A posting thread's count of its request's jobs not finished yet. */
typedef struct shm_waiter {
    atomic_long left;
} shm_waiter;

/* Its engine slot (transport.h): the copy workers and their queue. */
typedef struct shm_state {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *head, *tail;
    bool stop;
    pthread_t *workers;
    uint32_t nworkers;
    uint32_t parked;       /* workers waiting for a job (mu) */
    atomic_bool dirty;     /* deferred copies queued, workers not woken (the doorbell) */
    uint64_t batch_inline; /* copies up to this run at submit (any post) */
} shm_state;
#define SH(e) ((shm_state *)(e)->xp[AXF_EP_SHM])

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif
#define POP_SHIFT 18                 /* populated lazily, 256 KiB at a time */
#define POP_PAR_SLICE (16u << 20)    /* populated at map time by threads, each this much */
#define POP_PAR_MAX 8                /* ... at most this many */
/* Mappings larger than this are populated lazily (tests lower it;
 * $AIOXFER_SHM_LAZY_MIN sets it, from axf_env_read's snapshot: see map_fd). */
uint64_t axf_shm_lazy_min = 1ull << 30;
/* The process-wide settings from the environment's snapshot (axf_env_read),
 * read once, by the first shm_enable or calibration (shm_env_read):
 * $AIOXFER_SHM_LAZY_MIN and the calibration's stand-ins. */
static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static uint64_t env_wake_ns, env_copy_mbps;

static void lazy_env(void)
{
    /* Bytes, a plain unsigned integer (0: every pool lazily); anything else
     * is ignored. Read once: a pool's mapping never changes mode. */
    axf_env env; /* read in place: no 4 KiB copy on whichever thread maps first */
    axf_env_take(&env, false);
    const char *s = axf_env_wide(&env, AXF_ENV_SHM_LAZY_MIN);
    if (s && *s >= '0' && *s <= '9') {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (*end == '\0' && errno == 0)
            axf_shm_lazy_min = v;
    }
    axf_env_release(&env);
}

/* A lazily populated mapping: which granules are populated, one bit each.
 * What it maps is copied here, so the populator never reads the rregion. */
typedef struct shm_pop {
    uint8_t *map;
    uint64_t len;
    int fd;                /* the peer's memfd (our dup) when it has holes: only its data */
    atomic_bool stop;      /* being unmapped: the populator lets go */
    struct shm_pop *next;  /* the populator's queue */
    _Atomic uint64_t bits[];
} shm_pop;

/* The kernel's fault-around window for file mappings (fault_around_bytes,
 * 64 KiB by default; debugfs, so not readable here): a read fault on a
 * shared file mapping maps every page of its window that is in the page
 * cache, not just the faulting one. 0: not measured yet; kept from the
 * first pool whose measure is conclusive (fault_window). */
static _Atomic uint64_t fa_bytes;

/* Measures the fault-around window on m, a fresh mapping of len bytes of a
 * file all data (no holes), 2 MiB-aligned when len is at least that: reads
 * m[0], then asks /proc/self/pagemap how many of the pages after it (up to
 * 2 MiB, never past len) are mapped now. Pages the window skipped (one
 * locked by someone else) only make it smaller, so the touches it spaces
 * never leave a page out. Where every page read is mapped, the window is
 * at least those pages but not known (a mapping smaller than the window, or
 * a huge page mapped whole): that many is returned for this mapping and
 * nothing is kept. Past len, pagemap tells of the next mapping: a one-page
 * pool below 2 MiB of mapped pages kept a 2 MiB window, and every pool
 * after it was populated 64 KiB in 2 MiB (rev35). 4 KiB (a touch per page)
 * where pagemap cannot be read. */
static uint64_t fault_window(const uint8_t *m, uint64_t len)
{
    uint64_t w = atomic_load_explicit(&fa_bytes, memory_order_relaxed);
    if (w)
        return w;
    w = 4096;
    (void)*(const volatile uint8_t *)m;
    uint64_t want = len / 4096 < 512 ? len / 4096 : 512;
    if (!want)
        return w; /* less than a page: nothing to measure, nothing kept */
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    uint64_t ent[512];
    if (fd >= 0) {
        ssize_t r = pread(fd, ent, want * sizeof ent[0],
                          (off_t)((uintptr_t)m / 4096 * sizeof ent[0]));
        close(fd);
        uint64_t got = r > 0 ? (uint64_t)r / sizeof ent[0] : 0, n = 0;
        while (n < got && (ent[n] >> 63)) /* present */
            n++;
        while (w * 2 <= n * 4096)
            w *= 2;
        if (n == want)
            return w; /* the window reaches past what was read: not kept */
    }
    atomic_store_explicit(&fa_bytes, w, memory_order_relaxed);
    return w;
}

/* Populates [m, m+len) by reading a byte of each fault-around window
 * (fa_bytes, a page where not measured): each read fault maps the whole
 * window (16 pages by default). Cheaper than madvise(MADV_POPULATE_READ) or
 * MAP_POPULATE, which walk every page again (get_user_pages) after the same
 * faults mapped it: C probe, a written 64 MiB memfd, 2 vCPUs (kernel 6.18),
 * CPU medians of 41: MADV_POPULATE_READ 5.7 ms, MAP_POPULATE 6.0, a read per
 * page 5.2, a read per 64 KiB 4.1; at 4 MiB 0.28 / 0.28 / 0.18 / 0.15 ms
 * wall. And the page faults run under the mapping's own lock, where
 * MADV_POPULATE_READ holds the whole process's mmap_lock for reading: the
 * lazy populator runs at a low priority and is often preempted; inside
 * madvise it held that lock meanwhile, and every mmap, munmap or mprotect
 * of any other thread (a thread's stack, malloc's arenas, the loop's own
 * allocations) waited for it to be scheduled again (AIOXFER_SHM_LAZY_MIN=0,
 * connect + first 4 KiB write to a 64 MiB pool: 1-3 ms more in half of the
 * samples, after the import returned). The windows are aligned in the
 * address space, so a range starting inside one is read at its own start.
 * The mapping is of a sealed memfd at least its length (map_fd): no SIGBUS. */
static void touch_window(const uint8_t *m, uint64_t len, uint64_t w)
{
    uintptr_t a = (uintptr_t)m, end = a + len;
    for (uintptr_t o = a & ~(uintptr_t)(w - 1); o < end; o += w)
        (void)*(const volatile uint8_t *)(o < a ? a : o);
}

static void touch_pages(const uint8_t *m, uint64_t len)
{
    uint64_t w = atomic_load_explicit(&fa_bytes, memory_order_relaxed);
    touch_window(m, len, w ? w : 4096);
}

/* Populates the granules of [off, off+len) not populated yet, consecutive
 * ones in one call: a copy then takes no page fault per page. Measured on
 * 512 MiB of a written memfd (kernel 6.18): MAP_POPULATE 43 ms,
 * MADV_POPULATE_READ 51 ms (whole or by granule; on a shared shmem mapping
 * it maps the pages writable, a write after it costs nothing more),
 * MADV_POPULATE_WRITE 112 ms, a write fault per page 190 ms. On the copying
 * thread, so the copy workers populate in parallel, each its own pieces. A
 * failed call leaves its granules to the page faults. */
static void pop_range(shm_pop *p, uint64_t off, uint64_t len, bool touch)
{
    if (!len)
        return;
    uint64_t g0 = off >> POP_SHIFT, g1 = (off + len - 1) >> POP_SHIFT, run = UINT64_MAX;
    for (uint64_t g = g0; g <= g1 + 1; g++) {
        bool need = g <= g1 && !(atomic_load_explicit(&p->bits[g / 64], memory_order_relaxed) &
                                 (1ull << (g % 64)));
        if (need && run == UINT64_MAX) {
            run = g;
        } else if (!need && run != UINT64_MAX) {
            uint64_t a = run << POP_SHIFT, b = g << POP_SHIFT;
            if (b > p->len)
                b = p->len;
            bool ok = true;
            if (touch)
                touch_pages(p->map + a, b - a);
            else
                ok = madvise(p->map + a, b - a, MADV_POPULATE_READ) == 0;
            if (ok)
                for (uint64_t k = run; k < g; k++)
                    atomic_fetch_or_explicit(&p->bits[k / 64], 1ull << (k % 64),
                                             memory_order_relaxed);
            run = UINT64_MAX;
        }
    }
}

/* Its far-region slot (rregion->xp[AXF_EP_SHM], also for the CUDA
 * transport's host regions): our mapping of the peer's memfd, and how much
 * of it is populated (pop NULL: all of it). No slot: nothing mapped, the
 * copies reach the peer by cross-memory attach. */
typedef struct shm_far {
    uint8_t *map;
    shm_pop *pop;
} shm_far;
#define SF(rr) ((shm_far *)(rr)->xp[AXF_EP_SHM])

static inline uint8_t *far_map(const rregion *rr)
{
    const shm_far *f = SF(rr);
    return f ? f->map : NULL;
}

uint8_t *shm_far_map(const rregion *rr)
{
    return far_map(rr);
}

static void shm_populate(const shm_far *f, uint64_t off, uint64_t len)
{
    if (f->pop)
        pop_range(f->pop, off, len, false);
}

/* Whether the peer's file has holes: pages it never wrote (a fresh or a
 * sparse memfd). Populating a hole is not free as populating a page the
 * peer has is: the kernel allocates and zeroes a page of the peer's file,
 * charged to us, and it stays the peer's for as long as it keeps the file.
 * A hostile same-host peer could hand us a 64 GiB memfd of holes and have us
 * fill it (MAP_POPULATE, then the populator: tens of GiB of our memory for
 * none of its own). Its data is populated as before; its holes are left to
 * the page faults of the copies our own caller asks for. A pool its owner
 * touched (the demo's decode pool, bench targets) has no hole: populated
 * whole, as before. */
static bool has_holes(int memfd)
{
    struct stat st;
    return fstat(memfd, &st) != 0 || (uint64_t)st.st_blocks * 512u < (uint64_t)st.st_size;
}

/* Populates the pages of [m+off, m+off+len) that the file at mapping offset
 * 0 has data for (SEEK_DATA / SEEK_HOLE), exactly those; with p, also marks
 * the granules wholly populated. false when the kernel cannot (EINVAL:
 * before 5.14). */
static bool pop_data(int fd, uint8_t *m, uint64_t off, uint64_t len, shm_pop *p, bool touch)
{
    uint64_t end = off + len;
    while (off < end) {
        off_t d = lseek(fd, (off_t)off, SEEK_DATA);
        if (d < 0 || (uint64_t)d >= end)
            return true; /* ENXIO: no data from off on */
        off_t h = lseek(fd, d, SEEK_HOLE);
        uint64_t a = (uint64_t)d & ~(uint64_t)4095, b = h < 0 || (uint64_t)h > end ? end
                                                                                   : (uint64_t)h;
        b = (b + 4095) & ~(uint64_t)4095;
        if (b > end)
            b = end;
        if (b <= a)
            b = a + 4096 < end ? a + 4096 : end;
        bool done = true;
        if (touch)
            touch_pages(m + a, b - a);
        else if (madvise(m + a, b - a, MADV_POPULATE_READ) != 0)
            done = false;
        if (!done) {
            if (errno == EINVAL)
                return false;
        } else if (p) {
            uint64_t g0 = (a + (1u << POP_SHIFT) - 1) >> POP_SHIFT;
            uint64_t g1 = b == p->len ? ((b - 1) >> POP_SHIFT) + 1 : b >> POP_SHIFT;
            for (uint64_t g = g0; g < g1; g++)
                atomic_fetch_or_explicit(&p->bits[g / 64], 1ull << (g % 64),
                                         memory_order_relaxed);
        }
        off = b;
    }
    return true;
}

/* The populator: one thread for the process, at a low priority (nice 10),
 * that populates lazily mapped regions front to back, so a pool connected to
 * and written later is populated by then (a copy populates what it needs
 * itself, first, by madvise: a running, normal-priority thread holding the
 * mmap_lock for one granule). It touches pages (touch_pages), never holding
 * the mmap_lock while preempted. Unmapping waits for it to let go of the
 * mapping (at most one POP_STEP). */
#define POP_STEP (1u << 20)
static pthread_mutex_t pop_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pop_cv = PTHREAD_COND_INITIALIZER;
static shm_pop *pop_head, *pop_busy;
static bool pop_started;

static void *pop_main(void *arg)
{
    (void)arg;
    (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
    pthread_mutex_lock(&pop_mu);
    for (;;) {
        while (!pop_head)
            pthread_cond_wait(&pop_cv, &pop_mu);
        shm_pop *p = pop_head;
        pop_head = p->next;
        pop_busy = p;
        pthread_mutex_unlock(&pop_mu);
        for (uint64_t off = 0; off < p->len && !atomic_load(&p->stop); off += POP_STEP) {
            uint64_t n = p->len - off < POP_STEP ? p->len - off : POP_STEP;
            if (p->fd >= 0)
                (void)pop_data(p->fd, p->map, off, n, p, true);
            else
                pop_range(p, off, n, true);
        }
        pthread_mutex_lock(&pop_mu);
        pop_busy = NULL;
        pthread_cond_broadcast(&pop_cv);
    }
    return NULL;
}

/* A forked child has no populator (and the parent's may have held a mapping). */
static void pop_prefork(void)
{
    pthread_mutex_lock(&pop_mu);
}

static void pop_postfork(void)
{
    pthread_mutex_unlock(&pop_mu);
}

static void pop_child(void)
{
    pop_started = false;
    pop_head = pop_busy = NULL;
    pthread_mutex_unlock(&pop_mu);
}

static pthread_once_t pop_once = PTHREAD_ONCE_INIT;
static void pop_atfork(void)
{
    (void)pthread_atfork(pop_prefork, pop_postfork, pop_child);
}

/* Queues p for the populator; false if there is none (then it stays lazy). */
static bool pop_queue(shm_pop *p)
{
    pthread_once(&pop_once, pop_atfork);
    pthread_mutex_lock(&pop_mu);
    if (!pop_started) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&at, 64u << 10);
        pop_started = pthread_create(&t, &at, pop_main, NULL) == 0;
        pthread_attr_destroy(&at);
    }
    if (pop_started) {
        shm_pop **pp = &pop_head;
        while (*pp)
            pp = &(*pp)->next;
        p->next = NULL;
        *pp = p;
        pthread_cond_signal(&pop_cv);
    }
    pthread_mutex_unlock(&pop_mu);
    return pop_started;
}

static void pop_cancel(shm_pop *p)
{
    atomic_store(&p->stop, true);
    pthread_mutex_lock(&pop_mu);
    for (shm_pop **pp = &pop_head; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    while (pop_busy == p)
        pthread_cond_wait(&pop_cv, &pop_mu);
    pthread_mutex_unlock(&pop_mu);
}

typedef struct pop_slice {
    uint8_t *map;
    uint64_t off, len;
    int fd; /* >= 0: only the file's data */
    uint64_t w; /* the reads' spacing (fault_window); 0: touch_pages' */
} pop_slice;

static void *pop_slice_main(void *arg)
{
    pop_slice *sl = arg;
    if (sl->fd >= 0)
        (void)pop_data(sl->fd, sl->map, sl->off, sl->len, NULL, true);
    else if (sl->w)
        touch_window(sl->map + sl->off, sl->len, sl->w);
    else
        touch_pages(sl->map + sl->off, sl->len);
    return NULL;
}

/* Populates [m, m+len) on several threads at once (one a core, up to
 * POP_PAR_MAX, at least POP_PAR_SLICE each; the caller takes a slice; below
 * 2 x POP_PAR_SLICE, on this thread alone). */
static void pop_parallel(uint8_t *m, uint64_t len, int fd, uint64_t w)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    uint64_t n = len / POP_PAR_SLICE;
    if (cpus > 0 && n > (uint64_t)cpus)
        n = (uint64_t)cpus;
    if (n > POP_PAR_MAX)
        n = POP_PAR_MAX;
    if (n < 1)
        n = 1;
    pop_slice sl[POP_PAR_MAX];
    pthread_t t[POP_PAR_MAX];
    bool started[POP_PAR_MAX] = {0};
    uint64_t step = (len / n + (2u << 20) - 1) & ~(uint64_t)((2u << 20) - 1), off = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t l = off >= len ? 0 : len - off < step ? len - off : step;
        sl[i] = (pop_slice){.map = m, .off = off, .len = l, .fd = fd, .w = w};
        off += l;
    }
    for (uint64_t i = 1; i < n; i++)
        if (sl[i].len)
            started[i] = pthread_create(&t[i], NULL, pop_slice_main, &sl[i]) == 0;
    pop_slice_main(&sl[0]);
    for (uint64_t i = 1; i < n; i++) {
        if (started[i])
            pthread_join(t[i], NULL);
        else if (sl[i].len)
            pop_slice_main(&sl[i]);
    }
}

/* Populates m, a 2 MiB-aligned mapping of len bytes of a file all data
 * whose first 2 MiB one read mapped whole (fault_window: a huge page of the
 * file, mapped by one PMD), on this thread alone (a second one took ~60 us
 * to start). The rest by one madvise(MADV_POPULATE_READ) (nat34): it maps
 * each further huge page by one PMD and every page of a range of small
 * pages (a tail below 2 MiB, which no PMD maps, or a 2 MiB whose huge page
 * the kernel could not allocate: THP falls back per range), in one call.
 * Before, a read a 2 MiB and a pagemap read of the range's last page told
 * the two apart (a small range then got a read per window): 32 faults and
 * 33 pagemap reads for a 64 MiB pool. The madvise's page walk skips the
 * rest of a huge page, so its cost is the faults': benchmarks/nat34_import.c
 * (2 vCPUs, Linux 6.18, medians) map + populate 134 -> 65 us at 64 MiB (41
 * rounds), 905 -> 381 us at 512 MiB (11 rounds), within ~10 us of
 * MAP_POPULATE; connect_phases --transport shm, n=15 interleaved with main's
 * wheel: the import 0.19 -> 0.12 ms (15 of 15 pairs), the total's pair
 * ratio 0.88 (a fresh process) and 0.94 (PHASE_WARM=1). The file was all
 * data (has_holes, the caller's check): the madvise maps the peer's pages
 * and allocates none; a peer that punches holes after that check (its seals
 * allow it) has them allocated as a read per window would have, every page
 * rather than one a window: at most the pool's size, which it held when
 * checked. Not for small-page pools (shmc29: the walk after the faults
 * costs ~1.4x a read a window there), not in the lazy populator (it holds
 * the mmap_lock while preempted). Where the kernel refuses it (before 5.14:
 * EINVAL), as before: a read a 2 MiB, and a read a window where the range's
 * last page stays unmapped (pagemap, one entry; without pagemap, every
 * range so). */
static void pop_huge(uint8_t *m, uint64_t len)
{
    const uint64_t huge = 2u << 20;
    if (len <= huge || madvise(m + huge, len - huge, MADV_POPULATE_READ) == 0)
        return;
    int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    for (uint64_t o = 0; o < len; o += huge) {
        uint64_t n = len - o < huge ? len - o : huge, ent = 0;
        (void)*(const volatile uint8_t *)(m + o);
        off_t at = (off_t)((uintptr_t)(m + o + n - 4096) / 4096 * sizeof ent);
        if (n < huge || pm < 0 || pread(pm, &ent, sizeof ent, at) != sizeof ent ||
            !(ent >> 63))
            touch_pages(m + o, n);
    }
    if (pm >= 0)
        close(pm);
}

/* mmap(NULL, len, prot, MAP_SHARED | flags, fd, 0) at an address that is a
 * multiple of 2 MiB when len is at least that. A pool its owner allocated as
 * shmem transparent huge pages (registration.py _advise_huge, where the
 * host's shmem_enabled allows it) is then mapped by one PMD entry per 2 MiB
 * when populated, not 512 PTEs: the kernel maps a huge page by PMD only at
 * an aligned address (do_set_pmd), and it aligns a shmem mapping itself only
 * while shmem_enabled is not "never" (shmem_get_unmapped_area), which may
 * have changed since the owner's pages were allocated. Populating a 64 MiB
 * pool so mapped took 26-36 us instead of 2.5-9.9 ms (2 vCPUs, Linux 6.18),
 * and connect + first 4 KiB write to it 2.0-2.3 ms instead of 5.0 (main's
 * build, interleaved, n=15-21; docs/shm-huge-pages.md); at "never" 1.00-1.08x
 * main's, within the noise. Copies gain little: the 256 x 16 KiB batch
 * 1.02-1.06x, the demo within its noise (bound by memory bandwidth).
 * No MADV_HUGEPAGE here: huge pages already in the file map by PMD without
 * it, and with it a copy of ours into a hole of the peer's file would
 * allocate (and charge us for) 2 MiB where it wrote 4 KiB. Costs an
 * address-space reservation and two munmaps; with small pages it changes
 * nothing but the address. */
static void *map_shared(uint64_t len, int prot, int flags, int fd)
{
    const uint64_t huge = 2u << 20;
    if (len < huge)
        return mmap(NULL, len, prot, MAP_SHARED | flags, fd, 0);
    uint8_t *r = mmap(NULL, len + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (r == MAP_FAILED) /* no room for the slack: any address */
        return mmap(NULL, len, prot, MAP_SHARED | flags, fd, 0);
    uint8_t *a = (uint8_t *)(((uintptr_t)r + huge - 1) & ~(uintptr_t)(huge - 1));
    void *m = mmap(a, len, prot, MAP_SHARED | MAP_FIXED | flags, fd, 0);
    if (m == MAP_FAILED) {
        int err = errno;
        munmap(r, len + huge);
        errno = err;
        return MAP_FAILED;
    }
    if (a > r)
        munmap(r, (size_t)(a - r));
    if (a + len < r + len + huge)
        munmap(a + len, (size_t)(r + len + huge - (a + len)));
    return m;
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
#define TMPFS_MAGIC_ 0x01021994 /* <linux/magic.h> TMPFS_MAGIC: shmem, memfds */

/* The owner's half of a pool as huge pages (agent.alloc, before anyone maps
 * or writes memfd): collapses each whole 2 MiB of a fresh memfd into one
 * shmem transparent huge page. A same-host peer then populates its mapping
 * of the pool with one PMD entry per 2 MiB (map_fd: ~50-80 us for 64 MiB)
 * instead of 16384 page-table entries (2.3 ms wall and 4.5 ms CPU on two
 * threads, 3.5 ms on one: benchmarks/shm32_populate.c, 2 vCPUs, Linux 6.18,
 * quiet, medians of 31), the most of connecting to it. Unlike the advice
 * (registration.py _advise_huge), MADV_COLLAPSE is honoured whatever the
 * host's shmem_enabled says but "deny" (the kernel's transhuge.rst: "never
 * ... MADV_COLLAPSE can still cause transparent huge pages to be obtained"),
 * where the default "never" gives advised pools 4 KiB pages. It needs a page
 * in each range (none: EINVAL): one read a 2 MiB allocates it (a read fault
 * on shmem allocates a zeroed page), then the collapse allocates the huge
 * page, zeroes it and swaps it in; the file is all zeros before and after.
 * The cost: the whole pool is allocated now (2 MiB pages), not as its owner
 * first touches it, and a sparse pool holds every page; the owner's first
 * writes then allocate nothing (a 64 MiB fill 58 -> 3.5 ms). Only a memfd
 * with no data (st_blocks 0: nothing to copy, no writer to race) on tmpfs;
 * where the kernel refuses (before 6.1, "deny", no contiguous memory),
 * the pages read are punched out again: the file is as it was. The tail
 * below a whole 2 MiB stays small pages. Pools above axf_shm_lazy_min (1
 * GiB: peers populate those behind, not inside connect) are left alone:
 * collapsing commits the whole pool at once and costs about what its first
 * fill would, but varies more (512 MiB, fill 454-590 -> 25 ms, alloc 0.1 ->
 * 51-1250 ms, the most where the kernel must find fresh 2 MiB pages: two
 * owners at once, 3 runs; 64 MiB: alloc + fill 61 -> 9.8 ms). Where that
 * time goes (alloc33, 2-vCPU Firecracker VM, Linux 6.18): ~98 % in the
 * kernel zeroing each fresh 2 MiB page (perf: clear_page_erms under the
 * page's allocation), no compaction (compact_stall +0), no fallback. It is
 * ~0.2 ms a 2 MiB when the memory was freed lately, but 4-27 ms where the
 * VM's host took it back (free page reporting, page_reporting_order on the
 * kernel's command line; freed memory goes back within seconds): every
 * first store then faults on the host. Anonymous THP pays the same there;
 * 4 KiB pages come from warm fragments and do not. Neither splitting the
 * collapse over threads (512 MiB cold: 3.1-6.9 s on one, 3.7-4.5 s on two,
 * benchmarks/alloc33_collapse.c) nor a different order (fallocate or
 * MADV_POPULATE_WRITE first: each page is allocated twice) made it cheaper.
 * Returns 1 when every whole 2 MiB was collapsed, 0 when nothing changed,
 * AXF_E_INVALID for a file shorter than len or not a regular file. */
static void shm_env_read(void);
int axf_shm_make_huge(int memfd, uint64_t len)
{
    const uint64_t huge = 2u << 20;
    uint64_t hlen = len & ~(huge - 1);
    struct stat st;
    struct statfs sf;
    if (fstat(memfd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0 ||
        (uint64_t)st.st_size < len)
        return AXF_E_INVALID;
    shm_env_read(); /* axf_shm_lazy_min */
    if (!hlen || len > axf_shm_lazy_min || st.st_blocks != 0 || fstatfs(memfd, &sf) != 0 ||
        (unsigned long)sf.f_type != TMPFS_MAGIC_)
        return 0;
    uint8_t *m = map_shared(hlen, PROT_READ, 0, memfd);
    if (m == MAP_FAILED)
        return 0;
    int done = 0;
    if (!((uintptr_t)m & (huge - 1))) { /* map_shared found no aligned room: nothing */
        for (uint64_t o = 0; o < hlen; o += huge)
            (void)*(const volatile uint8_t *)(m + o);
        done = madvise(m, hlen, MADV_COLLAPSE) == 0;
    }
    munmap(m, hlen);
    if (!done) /* some ranges may be huge, some a page: back to holes, as it came */
        (void)fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)hlen);
    return done;
}

/* Maps the memfd behind rr into f, populating nothing (the copies fault). */
static int map_plain(const rregion *rr, int memfd, int prot, shm_far *f)
{
    void *m = map_shared(rr->len, prot, 0, memfd);
    if (m == MAP_FAILED)
        return errno == EACCES || errno == EPERM ? AXF_E_ACCESS : AXF_E_TRANSPORT;
    f->map = m;
    return AXF_OK;
}

/* Maps the memfd behind rr into f. */
static int map_fd(const rregion *rr, int memfd, shm_far *f)
{
    int seals = fcntl(memfd, F_GET_SEALS);
    if (seals < 0 || (seals & SHM_SEALS_NEEDED) != SHM_SEALS_NEEDED)
        return AXF_E_ACCESS; /* not a memfd, or one its owner may still resize */
    struct stat st;
    if (fstat(memfd, &st) != 0 || st.st_size < 0 || (uint64_t)st.st_size < rr->len)
        return AXF_E_ACCESS;
    /* Seals do not hold a hugetlbfs file's pages: its owner can punch them
     * out (fallocate) and keep every free huge page, and our next fault
     * there is SIGBUS (a copy's, or the populator's touch). Our pools are
     * never there (registration.py alloc). */
    struct statfs sf;
    if (fstatfs(memfd, &sf) != 0 || sf.f_type == 0x958458f6 /* HUGETLBFS_MAGIC */)
        return AXF_E_ACCESS;
    bool rw = rr->access & AXF_ACCESS_WRITE;
    int prot = PROT_READ | (rw ? PROT_WRITE : 0);
    int datafd = has_holes(memfd) ? memfd : -1; /* populate only its data */
    /* Populated now, as before, so that the first bulk writes take no page
     * faults: by a read per fault-around window (touch_pages: ~0.7x the CPU
     * of MAP_POPULATE or MADV_POPULATE_READ, which were ~5 ms for a 64 MiB
     * pool, the most of connecting to it), from 2 x POP_PAR_SLICE on by
     * several threads at once. Connect + first 4 KiB write to a 64 MiB pool
     * (connect_phases, 3 runs of n=25 interleaved with the madvise build, 2
     * shared vCPUs): 4.30/4.71/4.95 -> 3.14/3.99/3.48 ms, the import
     * 2.86-3.34 -> 1.76-2.22 ms; the demo's throughput 0.998x (pair ratio
     * median, n=27: the page tables it leaves are the same).
     * Above axf_shm_lazy_min (1 GiB, ~90 ms) it is not populated here but
     * behind: by the populator, and by each copy a granule before its first
     * copy (shm_populate), so no copy takes a fault per page. Lazily, bulk
     * writes right after connecting pay for populating what they touch:
     * measured with the demo's workload into a 512 MiB pool (C engines, 2
     * shared cores), 47 ms to connect + 45 ms of writes became 0.3 ms + 83
     * ms, and the Python demo's throughput halved (7.7 -> 3.7 GB/s); an
     * earlier try that let the copies fault instead cut it from ~8.5 to ~2.5
     * GB/s. A third try (2026-12-04) mapped every pool from 16 MiB lazily
     * and sent the copies aimed at granules not yet populated through
     * cross-memory attach into the owner's own (populated) mapping instead:
     * connect + first 4 KiB write 50-90 ms -> 0.2 ms at 512 MiB, but the
     * demo's window halved again (C engines, 512 MiB: 1.6-2.3 -> 0.8-1.1
     * GB/s; Python demo 2.9 -> 1.4 GB/s, medians, loaded 2-core machine):
     * scattered 16 KiB process_vm_writev runs ~2x slower than memcpy into a
     * populated mapping here, with or without the populator. On two busy
     * cores any lazy scheme moves the populate into the first writes. A
     * fourth try (2026-12-04) returned with the last 16 MiB left to the
     * helper threads, to finish while connect returned and the first write
     * was posted (~0.5 ms of Python): connect + first 4 KiB write to a 64 MiB
     * pool 1.08x and 1.18x slower, not faster (interleaved, n=41 each, fresh
     * initiators, 2 cores at load 3-4): no CPU is idle to overlap with.
     * $AIOXFER_SHM_LAZY_MIN (lazy_env, read when the engine was created)
     * lets a caller take the other side of
     * the trade (2026-12-06, 2 shared cores, interleaved with main's wheel:
     * =0 made connect + first 4 KiB write to a 64 MiB pool 2.15 vs 4.99 ms,
     * n=30 each, and the Python demo's window 0.75x, 15 triples, medians).
     * Two populating threads gain little at load (64 MiB: 2.39 vs 2.86
     * ms, medians of 41, load average 3.5 on 2 vCPUs), 1.5x quiet (3.51 ->
     * 2.30 ms wall, 3.52 -> 4.49 ms CPU; benchmarks/shm32_populate.c, 31
     * rounds, 2026-12-07), and the fds come only with the metadata, the
     * handshake's last message: nothing is left to overlap with but ~0.2 ms
     * of Python (receive_meta -> the import), on a machine whose other core
     * runs the peer's side then: at most ~0.1 ms to win by populating on a
     * thread of its own from the fds' arrival, less the ~60 us to start it.
     * What does cut it is the owner's pool in huge pages (2 MiB shmem
     * folios: one PMD each, pop_huge; axf_shm_make_huge): the import of a
     * 64 MiB pool 4.1 -> 0.18 ms (connect_phases, n=15). A lazy mapping on a kernel
     * without MADV_POPULATE_READ (before 5.14) is populated whole here by
     * MAP_POPULATE, or, for a file with holes, not at all. A file with
     * holes (has_holes) has only its data populated, at any size.
     * Mapped from the fd itself: never reopened by number through /proc. A
     * read-only fd, or one sealed against writing, fails here for a
     * writable region. */
    if (rr->len <= axf_shm_lazy_min) {
        uint8_t *m = map_shared(rr->len, prot, 0, memfd);
        if (m == MAP_FAILED)
            return errno == EACCES || errno == EPERM ? AXF_E_ACCESS : AXF_E_TRANSPORT;
        uint64_t w = 0;
        if (datafd < 0 && rr->len >= (2u << 20)) /* aligned (map_shared), all data */
            w = fault_window(m, rr->len);
        if (w >= (2u << 20))
            pop_huge(m, rr->len);
        else
            pop_parallel(m, rr->len, datafd, w);
        f->map = m;
        return AXF_OK;
    }
    if (rr->len > axf_shm_lazy_min) {
        uint64_t ngran = ((rr->len - 1) >> POP_SHIFT) + 1;
        shm_pop *p = calloc(1, sizeof *p + (ngran + 63) / 64 * sizeof p->bits[0]);
        void *m = p ? map_shared(rr->len, prot, 0, memfd) : MAP_FAILED;
        if (m == MAP_FAILED) {
            int err = errno;
            free(p);
            if (p)
                return err == EACCES || err == EPERM ? AXF_E_ACCESS : AXF_E_TRANSPORT;
        } else {
            p->map = m;
            p->len = rr->len;
            p->fd = -1;
            atomic_init(&p->stop, false);
            /* Whether the kernel can (a zero length is checked for the
             * advice alone), then the first granule: its data only, when
             * the file has holes (the populator keeps a dup of the fd). */
            bool can = madvise(m, 0, MADV_POPULATE_READ) == 0;
            if (can && datafd >= 0) {
                p->fd = fcntl(datafd, F_DUPFD_CLOEXEC, 0);
                can = p->fd >= 0;
            }
            if (can) {
                if (p->fd >= 0)
                    (void)pop_data(p->fd, m, 0,
                                   rr->len < (1u << POP_SHIFT) ? rr->len : 1u << POP_SHIFT, p,
                                   false);
                else {
                    (void)fault_window(m, rr->len); /* the populator's stride, if not yet */
                    pop_range(p, 0, 1, false);
                }
            }
            if (can && pop_queue(p)) {
                f->map = m;
                f->pop = p;
                return AXF_OK;
            }
            if (p->fd >= 0)
                close(p->fd);
            munmap(m, rr->len);
            free(p);
            if (datafd >= 0)
                return map_plain(rr, memfd, prot, f);
        }
    }
    void *m = map_shared(rr->len, prot, MAP_POPULATE, memfd);
    if (m == MAP_FAILED)
        return errno == EACCES || errno == EPERM ? AXF_E_ACCESS : AXF_E_TRANSPORT;
    f->map = m;
    return AXF_OK;
}

int shm_map(endpoint *ep, rregion *rr, int memfd)
{
    (void)ep;
    shm_far *f = calloc(1, sizeof *f);
    if (!f)
        return AXF_E_NOMEM;
    int st = map_fd(rr, memfd, f);
    if (st != AXF_OK) {
        free(f);
        return st;
    }
    rr->xp[AXF_EP_SHM] = f;
    return AXF_OK;
}

void shm_unmap(rregion *rr)
{
    shm_far *f = SF(rr);
    if (!f)
        return;
    rr->xp[AXF_EP_SHM] = NULL;
    if (f->pop) {
        pop_cancel(f->pop); /* before the mapping goes */
        if (f->pop->fd >= 0)
            close(f->pop->fd);
    }
    munmap(f->map, rr->len);
    free(f->pop);
    free(f);
}

/* A cross-memory-attach call failed with err: the process is gone
 * (AXF_E_PEER_LOST), the range is not mapped there (EFAULT) or the kernel
 * refuses us the process (EPERM: another user, a non-dumpable process,
 * Yama's ptrace_scope), both AXF_E_ACCESS; else AXF_E_TRANSPORT. Said in a
 * log record but for a lost peer (EPERM was AXF_E_TRANSPORT, with no reason
 * anywhere). */
static int cma_status(axf_engine *e, const op *o, int err)
{
    if (err == ESRCH)
        return AXF_E_PEER_LOST;
    cq_log(e, o->ep->tag, "shm: cross-memory %s of pid %d failed: %s (%s%s)",
           o->opcode == AXF_OP_WRITE ? "write" : "read", (int)o->ep->pid, strerror(err),
           err == EPERM ? "EPERM" : err == EFAULT ? "EFAULT" : "errno",
           err == EPERM ? ": another user, a non-dumpable process or kernel.yama.ptrace_scope; "
                          "a memfd pool needs no such permission"
                        : "");
    return err == EFAULT || err == EPERM ? AXF_E_ACCESS : AXF_E_TRANSPORT;
}

/* May the op's copy go on? Checked before every chunk (not per byte): once
 * the endpoint is lost, closing or its process exited, or the op was
 * cancelled or failed, a copy in progress overruns by at most the chunk it
 * is in. A revoked region (the owner wants it back) is checked per region
 * where a chunk touches it. AXF_OK or why not. */
static int copy_may_go(const op *o)
{
    if (atomic_load(&o->ep->halt))
        return atomic_load(&o->ep->exited) || !o->ep->closing ? AXF_E_PEER_LOST : AXF_E_CLOSED;
    if (atomic_load(&o->cancelled))
        return AXF_E_CANCELLED;
    return atomic_load(&o->status);
}

/* Copies bytes [off, off+len) of descriptor i, chunk by chunk. */
static int copy_piece(axf_engine *e, op *o, size_t i, uint64_t off, uint64_t len,
                      uint64_t chunk)
{
    const axf_desc *d = &o->d[i];
    rregion *rr = o->rr[i];
    while (len) {
        int st = copy_may_go(o);
        if (st == AXF_OK && atomic_load(&rr->revoked))
            st = AXF_E_ACCESS;
        if (st != AXF_OK)
            return st;
        uint64_t n = len < chunk ? len : chunk;
        uint8_t *local = o->laddr[i] + off;
        const shm_far *f = SF(rr);
        if (f) {
            uint8_t *remote = f->map + d->roff + off;
            shm_populate(f, d->roff + off, n);
            if (o->opcode == AXF_OP_WRITE)
                memcpy(remote, local, n);
            else
                memcpy(local, remote, n);
        } else {
            struct iovec l = {.iov_base = local, .iov_len = n};
            struct iovec r = {.iov_base = (void *)(uintptr_t)(rr->addr + d->roff + off),
                              .iov_len = n};
            ssize_t got = o->opcode == AXF_OP_WRITE
                              ? process_vm_writev(o->ep->pid, &l, 1, &r, 1, 0)
                              : process_vm_readv(o->ep->pid, &l, 1, &r, 1, 0);
            if (got < 0)
                return cma_status(e, o, errno);
            if ((uint64_t)got != n)
                return AXF_E_ACCESS;
        }
        off += n;
        len -= n;
    }
    return AXF_OK;
}

/* Copies whole descriptors [i0, i1): mapped ones by memcpy, the others
 * gathered into as few cross-memory-attach calls as possible, each call at
 * most a chunk. The checks run when the region changes and after each chunk's
 * worth of bytes, not per descriptor: a batch of small ones costs them once. */
static int copy_run(axf_engine *e, op *o, size_t i0, size_t i1, uint64_t chunk, uint64_t *fail)
{
    struct iovec lv[RUN_DESCS], rv[RUN_DESCS];
    size_t nv = 0, first = i0;
    uint64_t want = 0, unchecked = 0;
    rregion *checked_rr = NULL;
    for (size_t i = i0; i <= i1; i++) {
        bool flush = i == i1 || nv == RUN_DESCS || (i < i1 && SF(o->rr[i])) ||
                     (i < i1 && want && want + o->d[i].len > chunk);
        if (flush && nv) {
            ssize_t n = o->opcode == AXF_OP_WRITE
                            ? process_vm_writev(o->ep->pid, lv, nv, rv, nv, 0)
                            : process_vm_readv(o->ep->pid, lv, nv, rv, nv, 0);
            if (n < 0 || (uint64_t)n != want) {
                *fail = first;
                return n < 0 ? cma_status(e, o, errno) : AXF_E_ACCESS;
            }
            nv = 0;
            want = 0;
        }
        if (i == i1)
            break;
        const axf_desc *d = &o->d[i];
        rregion *rr = o->rr[i];
        if (d->len > chunk) { /* chunk by chunk, checked in between */
            int st = copy_piece(e, o, i, 0, d->len, chunk);
            if (st != AXF_OK) {
                *fail = i;
                return st;
            }
            checked_rr = NULL;
            continue;
        }
        if (rr != checked_rr || unchecked + d->len > chunk) {
            int st = copy_may_go(o);
            if (st == AXF_OK && atomic_load(&rr->revoked))
                st = AXF_E_ACCESS;
            if (st != AXF_OK) {
                *fail = i;
                return st;
            }
            checked_rr = rr;
            unchecked = 0;
        }
        unchecked += d->len;
        const shm_far *f = SF(rr);
        if (f) {
            uint8_t *remote = f->map + d->roff;
            shm_populate(f, d->roff, d->len);
            if (o->opcode == AXF_OP_WRITE)
                memcpy(remote, o->laddr[i], d->len);
            else
                memcpy(o->laddr[i], remote, d->len);
            continue;
        }
        if (!nv)
            first = i;
        lv[nv].iov_base = o->laddr[i];
        lv[nv].iov_len = d->len;
        rv[nv].iov_base = (void *)(uintptr_t)(rr->addr + d->roff);
        rv[nv].iov_len = d->len;
        want += d->len;
        nv++;
    }
    return AXF_OK;
}

/* A copy found the peer's process gone (cross-memory attach: ESRCH) or its
 * endpoint halted for that (the watcher saw the process exit; a connection
 * thread saw the last connection drop and marked it dead): the endpoint's
 * loss is reported now if nobody did yet, before the op that found it
 * completes (as endpoint_conn_finished and cuda's peer_gone do), so that a
 * caller woken by the failed transfer sees the peer lost, not a PeerLost
 * from a peer it still counts as alive. (Those two set halt first and
 * report later, from the last connection thread to exit; that report is
 * then skipped.) Its copies stop at their next chunk; its connections
 * close; the watcher still marks the process exited once its pidfd says so. */
static void peer_gone(axf_engine *e, endpoint *ep)
{
    pthread_mutex_lock(&e->mu);
    if (!ep->closing && !ep->lost_reported) {
        /* Pushed under e->mu: another copy that then finds lost_reported set
         * knows the record is in the ring before its own completion. */
        ep->lost_reported = true;
        cq_push(e, AXF_CQ_PEER_LOST, AXF_E_PEER_LOST, ep->id, ep->tag, 0, 0, NULL, 0);
        atomic_store(&ep->halt, true);
        for (int i = 0; i < ep->nconns; i++)
            conn_kill(ep->conns[i]);
    }
    pthread_mutex_unlock(&e->mu);
}

static void run_job(axf_engine *e, job *j)
{
    op *o = j->op;
    if (!atomic_load(&o->cancelled) && atomic_load(&o->status) == AXF_OK) {
        int st;
        if (j->len) {
            st = copy_piece(e, o, j->i0, j->off, j->len, e->cfg.chunk_bytes);
            if (st == AXF_OK)
                atomic_fetch_add(&o->nbytes, j->len);
            else
                op_set_status(o, st, j->i0);
        } else {
            uint64_t fail = 0;
            st = copy_run(e, o, j->i0, j->i1, e->cfg.chunk_bytes, &fail);
            if (st == AXF_OK) {
                atomic_fetch_add(&o->nbytes, j->bytes);
            } else {
                op_set_status(o, st, fail);
            }
        }
        if (st == AXF_E_PEER_LOST)
            peer_gone(e, o->ep);
    }
    shm_waiter *w = j->wait;
    free(j);
    op_unit_done(e, o);
    if (w) /* last: the poster may return (and its waiter go) once it is 0 */
        atomic_fetch_sub_explicit(&w->left, 1, memory_order_release);
}

static void *worker_main(void *arg)
{
    axf_engine *e = arg;
    shm_state *sh = SH(e);
    pthread_mutex_lock(&sh->mu);
    for (;;) {
        while (!sh->head && !sh->stop) {
            sh->parked++;
            pthread_cond_wait(&sh->cv, &sh->mu);
            sh->parked--;
        }
        job *j = sh->head;
        if (!j)
            break; /* stopping and nothing queued */
        sh->head = j->next;
        if (!sh->head)
            sh->tail = NULL;
        bool stopping = sh->stop;
        pthread_mutex_unlock(&sh->mu);
        if (stopping)
            op_set_status(j->op, AXF_E_CLOSED, j->i0);
        run_job(e, j);
        pthread_mutex_lock(&sh->mu);
    }
    pthread_mutex_unlock(&sh->mu);
    return NULL;
}

int shm_start(axf_engine *e)
{
    shm_state *sh = calloc(1, sizeof *sh);
    pthread_t *w = calloc(e->cfg.copy_workers, sizeof *w);
    if (!sh || !w) {
        free(sh);
        free(w);
        return AXF_E_NOMEM;
    }
    pthread_mutex_init(&sh->mu, NULL);
    pthread_cond_init(&sh->cv, NULL);
    sh->workers = w;
    e->xp[AXF_EP_SHM] = sh;
    for (uint32_t i = 0; i < e->cfg.copy_workers; i++) {
        if (pthread_create(&sh->workers[i], NULL, worker_main, e) != 0)
            break;
        sh->nworkers++;
    }
    if (sh->nworkers)
        return AXF_OK;
    e->xp[AXF_EP_SHM] = NULL;
    pthread_mutex_destroy(&sh->mu);
    pthread_cond_destroy(&sh->cv);
    free(w);
    free(sh);
    return AXF_E_NOMEM;
}

void shm_stop(axf_engine *e)
{
    shm_state *sh = SH(e);
    if (!sh)
        return;
    pthread_mutex_lock(&sh->mu);
    sh->stop = true;
    pthread_cond_broadcast(&sh->cv);
    pthread_mutex_unlock(&sh->mu);
    for (uint32_t i = 0; i < sh->nworkers; i++)
        pthread_join(sh->workers[i], NULL);
    sh->nworkers = 0;
    free(sh->workers);
    sh->workers = NULL;
}

static void shm_destroy(axf_engine *e)
{
    shm_state *sh = SH(e);
    if (!sh)
        return;
    shm_stop(e);
    e->xp[AXF_EP_SHM] = NULL;
    pthread_mutex_destroy(&sh->mu);
    pthread_cond_destroy(&sh->cv);
    free(sh);
}

int shm_copy_inline(axf_engine *e, op *o)
{
    uint64_t fail = 0;
    int st = copy_run(e, o, 0, o->n, e->cfg.chunk_bytes, &fail);
    if (st == AXF_E_PEER_LOST)
        peer_gone(e, o->ep);
    if (st != AXF_OK)
        op_set_status(o, st, fail);
    else
        for (size_t i = 0; i < o->n; i++)
            atomic_fetch_add(&o->nbytes, o->d[i].len);
    return st;
}

static job *job_new(op *o, size_t i0, size_t i1, uint64_t off, uint64_t len, uint64_t bytes)
{
    job *j = calloc(1, sizeof *j);
    if (j) {
        j->op = o;
        j->i0 = i0;
        j->i1 = i1;
        j->off = off;
        j->len = len;
        j->bytes = bytes;
    }
    return j;
}

/* Queues o's copy as jobs: runs of small descriptors up to RUN_BYTES, a
 * descriptor of 2 x min_piece or more in split pieces (none under
 * min_piece). With w, each job counts itself off w when done. Returns how
 * many were queued (0: none could be made, the op failed and is done). */
static long submit_jobs(axf_engine *e, op *o, bool signal, uint64_t split, uint64_t min_piece,
                        shm_waiter *w)
{
    shm_state *sh = SH(e);
    /* Build every job before queueing any: a worker may finish the op as soon
     * as its last job is queued. */
    job *head = NULL, *tail = NULL;
    long count = 0;
    size_t run_start = 0;
    uint64_t run_bytes = 0;
    bool oom = false;
#define PUSH(j)                     \
    do {                            \
        job *j_ = (j);              \
        if (!j_) {                  \
            oom = true;             \
            break;                  \
        }                           \
        if (tail)                   \
            tail->next = j_;        \
        else                        \
            head = j_;              \
        tail = j_;                  \
        count++;                    \
    } while (0)
    for (size_t i = 0; i < o->n && !oom; i++) {
        uint64_t len = o->d[i].len;
        if (len >= 2 * min_piece && split > 1) {
            if (i > run_start)
                PUSH(job_new(o, run_start, i, 0, 0, run_bytes));
            uint64_t piece = (len + split - 1) / split;
            if (piece < min_piece)
                piece = min_piece;
            for (uint64_t off = 0; off < len && !oom; off += piece)
                PUSH(job_new(o, i, i + 1, off, len - off < piece ? len - off : piece,
                             len - off < piece ? len - off : piece));
            run_start = i + 1;
            run_bytes = 0;
            continue;
        }
        run_bytes += len;
        if (run_bytes >= RUN_BYTES || i + 1 - run_start >= RUN_DESCS) {
            PUSH(job_new(o, run_start, i + 1, 0, 0, run_bytes));
            run_start = i + 1;
            run_bytes = 0;
        }
    }
    if (!oom && run_start < o->n)
        PUSH(job_new(o, run_start, o->n, 0, 0, run_bytes));
#undef PUSH
    if (oom) {
        while (head) {
            job *n = head->next;
            free(head);
            head = n;
        }
        atomic_store(&o->remaining, 1);
        op_set_status(o, AXF_E_NOMEM, 0);
        op_unit_done(e, o);
        return 0;
    }
    atomic_store(&o->remaining, count);
    if (w) {
        atomic_store(&w->left, count);
        for (job *j = head; j; j = j->next)
            j->wait = w;
    }
    pthread_mutex_lock(&sh->mu);
    if (sh->tail)
        sh->tail->next = head;
    else
        sh->head = head;
    sh->tail = tail;
    if (signal) {
        if (count > 1)
            pthread_cond_broadcast(&sh->cv);
        else
            pthread_cond_signal(&sh->cv);
    }
    pthread_mutex_unlock(&sh->mu);
    return count;
}

void shm_submit(axf_engine *e, op *o, bool signal)
{
    (void)submit_jobs(e, o, signal, (uint64_t)SH(e)->nworkers * 2, MIN_PIECE, NULL);
}

/* ---------------------------------------------------------------- calibration
 *
 * Where copying on the posting thread beats handing the copy to a worker:
 * a worker costs two thread wake-ups (the worker's, then the waiting loop's
 * through the engine's eventfd), the copy on the caller's thread costs its
 * bytes at one thread's memcpy rate. Both are measured once per process: a
 * few milliseconds at the first engine. On bare metal a wake-up is a few
 * microseconds (a threshold of a few hundred KiB); in a VM, where waking a
 * vCPU goes through the hypervisor, tens (a few MiB). */

#include <sys/eventfd.h>
#include <time.h>

#define CAL_PINGS 32
#define CAL_COPY (4u << 20)
/* Beyond the wake-ups, what a handed-off copy costs a caller that waits for it
 * in an event loop: the await suspends, the loop returns from epoll, drains
 * the ring and resumes the task. Measured on a 2-vCPU VM: a lone 1 MiB write
 * took ~50 us longer through a worker than copied inline, with a measured
 * wake-up of ~4 us. A constant: the engine cannot time its caller's loop. */
#define CAL_LOOP_NS 40000u
#define CAL_WAKE_MAX 1000000u
#define CAL_MBPS_MAX 1000000u

static axf_calibration cal_result;
static pthread_once_t cal_once = PTHREAD_ONCE_INIT;

static int cal_u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

typedef struct cal_pong {
    int ping, pong;
    int cpu;       /* both threads run here (-1: wherever the scheduler puts them) */
    uint64_t res;  /* the pinger's answer: half the lower-quartile round trip */
} cal_pong;

static void cal_pin(int cpu)
{
    if (cpu < 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *cal_ponger(void *arg)
{
    cal_pong *p = arg;
    uint64_t v;
    cal_pin(p->cpu);
    for (int i = 0; i < CAL_PINGS; i++) {
        if (read(p->ping, &v, sizeof v) != sizeof v)
            break;
        if (write(p->pong, &v, sizeof v) != sizeof v)
            break;
    }
    return NULL;
}

static void *cal_pinger(void *arg)
{
    cal_pong *p = arg;
    uint64_t rt[CAL_PINGS];
    int n = 0;
    pthread_t th;
    cal_pin(p->cpu);
    if (pthread_create(&th, NULL, cal_ponger, p) != 0)
        return NULL;
    for (; n < CAL_PINGS; n++) {
        /* Apart, as transfers awaited one at a time are: the CPU has gone
         * idle in between (in a VM, its vCPU halted). */
        struct timespec gap = {0, 200000};
        nanosleep(&gap, NULL);
        uint64_t one = 1, v, t0 = axf_now_ns();
        if (write(p->ping, &one, sizeof one) != sizeof one ||
            read(p->pong, &v, sizeof v) != sizeof v)
            break;
        rt[n] = axf_now_ns() - t0;
    }
    if (n < CAL_PINGS) /* let the ponger out (it waits for the rest) */
        for (int i = n; i < CAL_PINGS; i++) {
            uint64_t one = 1;
            if (write(p->ping, &one, sizeof one) != sizeof one)
                break;
        }
    pthread_join(th, NULL);
    if (n) {
        /* The lower quartile, not the median: on a busy machine other
         * threads' time slices land in some round trips and only make
         * them longer, which moved the threshold by 4x between runs. */
        qsort(rt, (size_t)n, sizeof *rt, cal_u64_cmp);
        p->res = rt[n / 4] / 2;
    }
    return NULL;
}

/* A thread wake-up: half the lower-quartile round trip between two threads
 * blocked on eventfds, both on one CPU (the caller's). Left to the
 * scheduler, the ponger ran on the caller's CPU in some processes (a
 * thread switch: 1.5-4 us on this 2-vCPU VM) and on the other vCPU in
 * others (an IPI to a halted vCPU: 14-42 us), for all 32 round trips: the
 * measurement was bimodal from one process to the next (7 of 8 processes
 * of one compat bench run on the slow side, 4 of 12 started in a row),
 * and with it poll_us (42-124) and, near a power of two, inline_bytes.
 * One CPU is what the constants below were tuned with (CAL_LOOP_NS: a 1
 * MiB write ~50 us slower through a worker, measured with a ~4 us
 * wake-up). Pinned pingers (not the caller) so that the caller's affinity
 * is left alone. */
static uint64_t cal_wake_ns(void)
{
    cal_pong p = {eventfd(0, EFD_CLOEXEC), eventfd(0, EFD_CLOEXEC), -1, 0};
    cpu_set_t allowed;
    int cpu = sched_getcpu();
    if (pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) == 0) {
        if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed))
            for (cpu = 0; cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &allowed); cpu++)
                ;
        p.cpu = cpu < CPU_SETSIZE ? cpu : -1;
    }
    pthread_t th;
    if (p.ping >= 0 && p.pong >= 0 && pthread_create(&th, NULL, cal_pinger, &p) == 0)
        pthread_join(th, NULL);
    if (p.ping >= 0)
        close(p.ping);
    if (p.pong >= 0)
        close(p.pong);
    return p.res ? p.res : 20000; /* unmeasurable: assume a VM's */
}

/* One thread's memcpy, bytes per microsecond (the best of CAL_COPIES runs
 * over buffers already faulted in). Best of 5 ranged 12.2-15.2 GB/s from
 * one process to the next here, best of 16 13.5-15.7: the threshold's
 * power of two is crossed at ~11.9 GB/s with a 2 us wake-up. */
#define CAL_COPIES 16
static uint64_t cal_copy_mbps(void)
{
    uint8_t *a = malloc(CAL_COPY), *b = malloc(CAL_COPY);
    uint64_t best = 0;
    if (a && b) {
        memset(a, 1, CAL_COPY);
        memset(b, 2, CAL_COPY);
        for (int i = 0; i < CAL_COPIES; i++) {
            uint64_t t0 = axf_now_ns();
            memcpy(i & 1 ? a : b, i & 1 ? b : a, CAL_COPY);
            uint64_t dt = axf_now_ns() - t0;
            __asm__ __volatile__("" : : "r"(a), "r"(b) : "memory");
            uint64_t mbps = dt ? (uint64_t)CAL_COPY * 1000u / dt : 0;
            if (mbps > best)
                best = mbps;
        }
    }
    free(a);
    free(b);
    return best ? best : 5000;
}

/* A measurement from the environment (a positive integer), else 0. */
static uint64_t cal_env(int which)
{
    axf_env env; /* read in place: no 4 KiB copy on the stack */
    axf_env_take(&env, false);
    const char *s = axf_env_wide(&env, which);
    unsigned long long v = 0;
    if (s && *s) {
        char *end;
        v = strtoull(s, &end, 0);
        if (*end != '\0')
            v = 0;
    }
    axf_env_release(&env);
    return v;
}

static uint64_t env_inline_bytes;

static void env_read(void)
{
    lazy_env();
    env_wake_ns = cal_env(AXF_ENV_WAKE_NS);
    env_copy_mbps = cal_env(AXF_ENV_COPY_MBPS);
    env_inline_bytes = cal_env(AXF_ENV_INLINE_BYTES);
}

/* Once per process, from the environment's snapshot (engine.c axf_env_read:
 * taken with the GIL held where Python calls it), never by getenv on
 * whichever thread happens to map a peer's pool first. */
static void shm_env_read(void) { pthread_once(&env_once, env_read); }

static void cal_run(void)
{
    axf_calibration *c = &cal_result;
    shm_env_read();
    /* $AIOXFER_WAKE_NS and $AIOXFER_COPY_MBPS stand for the measurements
     * (one calibration for several processes: benchmarks/peers/
     * bench_nixl_compat.py gives its processes its own). */
    c->wake_ns = env_wake_ns;
    if (!c->wake_ns)
        c->wake_ns = cal_wake_ns();
    c->copy_mbps = env_copy_mbps;
    if (!c->copy_mbps)
        c->copy_mbps = cal_copy_mbps();
    /* Bounded (what follows cannot overflow): a wake-up of at most a
     * millisecond, a copy of at most a TB/s. */
    if (c->wake_ns > CAL_WAKE_MAX)
        c->wake_ns = CAL_WAKE_MAX;
    if (c->copy_mbps > CAL_MBPS_MAX)
        c->copy_mbps = CAL_MBPS_MAX;
    /* Two wake-ups and a loop iteration saved, at copy_mbps bytes per
     * microsecond; inline while the copy holds the caller's thread for at
     * most twice what it saves (a lone awaited request is faster done
     * inside the post at any size, from SHARED_MIN on with the workers'
     * help: the bound is for the caller's other work). */
    uint64_t saved_ns = 2 * c->wake_ns + CAL_LOOP_NS;
    uint64_t bytes = 2 * saved_ns * c->copy_mbps / 1000u;
    if (bytes > (16ull << 20)) /* a busy machine's wake-ups, not a VM's */
        bytes = 16ull << 20;
    /* Up to a power of two: the estimate is good to a factor, and a
     * threshold that moved with every start-up decided whether the same
     * request was copied here or by a worker, tens of microseconds apart.
     * Up, not down: for a lone awaited request the copy inside the post
     * (shared with the workers from SHARED_MIN on) is the faster one at any
     * size; the threshold only bounds how long it holds the caller's
     * thread. */
    uint64_t p2 = 64u << 10; /* the least threshold */
    while (p2 < bytes)
        p2 *= 2;
    c->inline_bytes = p2;
    if (env_inline_bytes)
        c->inline_bytes = env_inline_bytes;
    /* Spinning is worth at most what blocking costs. */
    uint64_t us = saved_ns / 1000u;
    c->poll_us = (uint32_t)(us < 20 ? 20 : us > 200 ? 200 : us);
}

uint32_t shm_parked_workers(axf_engine *e, uint32_t *nworkers)
{
    shm_state *sh = SH(e);
    if (!sh) {
        *nworkers = 0;
        return 0;
    }
    pthread_mutex_lock(&sh->mu);
    uint32_t n = sh->parked;
    *nworkers = sh->nworkers;
    pthread_mutex_unlock(&sh->mu);
    return n;
}

const axf_calibration *shm_calibration(void)
{
    pthread_once(&cal_once, cal_run);
    return &cal_result;
}

void axf_calibrate(axf_calibration *out)
{
    *out = *shm_calibration();
}

/* ---------------------------------------------------------------- transport */

static int shm_enable(axf_engine *e)
{
    shm_env_read(); /* on the creating thread, before any pool is mapped */
    const axf_calibration *cal = shm_calibration();
    if (!e->cfg.inline_bytes)
        e->cfg.inline_bytes = cal->inline_bytes;
    e->poll_us = cal->poll_us;
    int st = shm_start(e);
    if (st == AXF_OK) {
        uint64_t ib = e->cfg.inline_bytes;
        SH(e)->batch_inline = ib < (64u << 10) ? ib : 64u << 10;
    }
    return st;
}

/* The posting thread copies beside the workers it has just woken: queued
 * jobs from the head of the queue, while what it has copied stays within
 * inline_bytes (what a lone request may hold it for). It waits for its
 * transfers next anyway (or polls for them, spinning a CPU that the workers
 * could copy on): a 256 x 16 KiB batch is copied by one more thread, and
 * the workers' last jobs finish while it returns (measured on 2 vCPUs,
 * 256 x 16 KiB scattered: ~290 -> ~195 us a request). Runs of small
 * descriptors only: the pieces of a large one (a quarter each) stay the
 * workers' (one taken here as well left a 16 MiB write on 3 threads for 2
 * vCPUs, 0.72x in two side-by-side runs). Never with inline_bytes =
 * UINT64_MAX (every copy on the workers). */
static void shm_help(axf_engine *e)
{
    shm_state *sh = SH(e);
    uint64_t budget = e->cfg.inline_bytes, done = 0;
    if (budget == UINT64_MAX || axf_no_help) /* never / not this thread (AXF_POST_NOHELP) */
        return;
    for (;;) {
        pthread_mutex_lock(&sh->mu);
        job *j = sh->head;
        if (!j || sh->stop || j->len || done + j->bytes > budget) {
            pthread_mutex_unlock(&sh->mu);
            return;
        }
        sh->head = j->next;
        if (!sh->head)
            sh->tail = NULL;
        pthread_mutex_unlock(&sh->mu);
        done += j->bytes;
        run_job(e, j);
    }
}

/* A lone request within inline_bytes is done when post returns; from
 * SHARED_MIN on it is not copied by this thread alone but shared with the
 * workers: queued in pieces (RUN_BYTES or more, a dozen or so), the workers
 * woken, this thread takes pieces until none is left, then waits for the
 * ones the workers took (at most a piece each, being copied). A worker
 * that wakes late leaves it more pieces, none at all: the whole copy, as
 * inline. Measured on
 * 2 vCPUs (chrt-isolated), 256 x 16 KiB scattered alone: ~290 us inline,
 * ~195 us shared. Below SHARED_MIN a worker's wake-up (tens of us in a VM)
 * costs about what the second thread saves. */
static int copy_shared(axf_engine *e, op *o, uint32_t flags)
{
    shm_state *sh = SH(e);
    shm_waiter w;
    atomic_init(&w.left, 0);
    uint64_t split = 4 * ((uint64_t)sh->nworkers + 1);
    /* Its completion, if this thread makes it, is known at submit. Decided
     * before queueing: from then on a worker may finish (and free) o. */
    bool quiet = (flags & AXF_POST_POLL) != 0 && !o->notify_len;
    if (!submit_jobs(e, o, true, split, RUN_BYTES, &w))
        return AXF_E_NOMEM; /* failed and done */
    axf_cq_quiet = quiet;
    /* Its own pieces wherever they are in the queue (behind another
     * thread's batch too, and also once the workers are stopping: then no
     * worker would ever take them, and the wait below would not end); the
     * usual case finds the first one at the head. */
    for (;;) {
        pthread_mutex_lock(&sh->mu);
        job *prev = NULL, *j = sh->head;
        while (j && j->wait != &w) {
            prev = j;
            j = j->next;
        }
        if (j) {
            if (prev)
                prev->next = j->next;
            else
                sh->head = j->next;
            if (sh->tail == j)
                sh->tail = prev;
        }
        bool stopping = sh->stop;
        pthread_mutex_unlock(&sh->mu);
        if (!j)
            break;
        if (stopping) /* as a worker that drains the queue at a stop */
            op_set_status(j->op, AXF_E_CLOSED, j->i0);
        run_job(e, j);
    }
    axf_cq_quiet = false;
    for (unsigned spin = 0; atomic_load_explicit(&w.left, memory_order_acquire); spin++) {
        if (spin < 4096)
            __asm__ __volatile__("" ::: "memory");
        else
            sched_yield();
    }
    return AXF_OK;
}

bool shm_post(axf_engine *e, op *o, uint32_t flags)
{
    shm_state *sh = SH(e);
    uint64_t total = 0;
    for (size_t i = 0; i < o->n; i++)
        total += o->d[i].len;
    pthread_mutex_unlock(&e->mu);
    /* A small same-host copy, or a lone one below the calibrated threshold
     * (its caller would otherwise pay a worker's wake-up and then its own):
     * done now, on this thread. A batch keeps the workers for anything
     * larger (they copy in parallel with each other). */
    bool alone = flags & AXF_POST_ALONE, signal = !(flags & AXF_POST_DEFER);
    uint64_t ib = e->cfg.inline_bytes;
    if (ib != UINT64_MAX &&
        ((alone && total <= ib) || (!o->notify_len && total <= sh->batch_inline))) {
        if (alone && total >= SHARED_MIN && sh->nworkers) {
            (void)copy_shared(e, o, flags);
            return true;
        }
        atomic_store(&o->remaining, 1);
        int cst = shm_copy_inline(e, o);
        op_set_status(o, cst, 0);
        /* Its completion is known at submit (none when a notification
         * follows: that one comes from the connection). */
        axf_cq_quiet = (flags & AXF_POST_POLL) != 0 && !o->notify_len;
        op_unit_done(e, o);
        axf_cq_quiet = false;
        return true;
    }
    if (!signal)
        atomic_store(&sh->dirty, true);
    shm_submit(e, o, signal);
    if (signal && alone)
        shm_help(e);
    return true;
}

static void shm_doorbell(axf_engine *e)
{
    shm_state *sh = SH(e);
    if (atomic_load(&sh->dirty) && atomic_exchange(&sh->dirty, false)) {
        pthread_mutex_lock(&sh->mu);
        pthread_cond_broadcast(&sh->cv);
        pthread_mutex_unlock(&sh->mu);
        shm_help(e);
    }
}

const axf_transport axf_xp_shm = {
    .abi = AXF_TRANSPORT_ABI,
    .name = "shm",
    .ep_kind = AXF_EP_SHM,
    .caps = AXF_XP_CAP_SAME_HOST | AXF_XP_CAP_NOTIFY | AXF_XP_CAP_OWN_DATA | AXF_XP_CAP_REAPABLE,
    .local_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .far_mem = AXF_MEM_BIT(AXF_MEM_HOST),
    .enable = shm_enable,
    .quiesce = shm_stop,
    .destroy = shm_destroy,
    .ep_import_fd = shm_map,
    .rr_unmap = shm_unmap,
    .submit = shm_post,
    .doorbell = shm_doorbell,
};

/* What populating a same-host peer's pool costs, per method (shm32).
 *
 * An owner fills a sealed memfd of --mib MiB through its own mapping (after
 * MADV_HUGEPAGE, as agent.alloc does) and unmaps it: its pages stay in the
 * file, as a peer's pool's. Then, round after round, each method maps the
 * file (2 MiB-aligned, as shm.c map_shared), populates it, and the wall time
 * and the process's CPU time of the populate are taken; the mapping is then
 * unmapped (not timed). Methods interleave within each round, so they share
 * the machine's noise. Prints per method the median, p10 and p90 of wall and
 * CPU (us) over the rounds.
 *
 *   cc -O2 -pthread -o /tmp/shm32_populate benchmarks/shm32_populate.c
 *   /tmp/shm32_populate [--mib 64] [--rounds 31] [--owner-thp 0|1] [--collapse 0|1]
 *
 * --collapse 1: the owner touches a page a 2 MiB and asks MADV_COLLAPSE before
 * filling (huge pages whatever shmem_enabled says, short of deny).
 *
 * The shmem THP policy is the host's (/sys/kernel/mm/transparent_hugepage/
 * shmem_enabled and hugepages-<size>kB/shmem_enabled, read when the owner
 * fills the file): run it under each setting to compare. Printed first:
 * how many of the file's pages the first touch maps (pagemap), i.e. the
 * fault-around window or the folio size.
 *
 * Measured (2026-12-07, 2 vCPUs AMD EPYC VM, Linux 6.18, under benchlock,
 * 64 MiB, 31 rounds, medians; wall / CPU in us; /tmp/shm32_sweep.sh style:
 * each setting set for the run, 'never' restored after):
 *
 *                 never         --collapse 1   shmem advise   64kB advise
 *   touch64k_1t   3514 / 3516     84 / 85        84 / 85      1785 / 1786
 *   touch64k_2t   2304 / 4488    127 / 173      126 / 169     1079 / 2009
 *   touch4k_1t    4207 / 4209    204 / 206      202 / 203     2629 / 2630
 *   pop_read_1t   5255 / 5257     54 / 54        54 / 54      3480 / 3472
 *   pop_read_2t   3272 / 6037    114 / 150      110 / 140     1986 / 3735
 *   pop_write_1t 14857 / 14859    62 / 63        62 / 63      3484 / 3485
 *   map_populate  5259 / 5261     53 / 54        53 / 54      3496 / 3475
 *   owner fill    58.5 ms         3.5 ms (+54 ms collapse)  6.7 ms  11.3 ms
 *
 * (touch2m_1t, a read per 2 MiB, is 77 us with huge pages and leaves 15872
 * of 16384 pages unmapped with small ones.) With small pages a read per
 * fault-around window stays the cheapest, two threads 1.5x faster in wall
 * time for 1.3x the CPU; only huge folios (or 64 KiB ones, where the host
 * allows shmem mTHP) change the order of magnitude.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

static uint64_t LEN;
static int FD;

static uint64_t now_ns(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint8_t *map_aligned(int flags)
{
    const uint64_t huge = 2u << 20;
    uint8_t *r = mmap(NULL, LEN + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (r == MAP_FAILED)
        abort();
    uint8_t *a = (uint8_t *)(((uintptr_t)r + huge - 1) & ~(uintptr_t)(huge - 1));
    if (mmap(a, LEN, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | flags, FD, 0) == MAP_FAILED)
        abort();
    if (a > r)
        munmap(r, (size_t)(a - r));
    munmap(a + LEN, (size_t)(r + LEN + huge - (a + LEN)));
    return a;
}

typedef struct slice {
    uint8_t *m;
    uint64_t len, w;
    int how; /* 0 touch every w, 1 MADV_POPULATE_READ, 2 MADV_POPULATE_WRITE */
} slice;

static void *slice_main(void *arg)
{
    slice *s = arg;
    if (s->how == 0) {
        for (uint64_t o = 0; o < s->len; o += s->w)
            (void)*(volatile uint8_t *)(s->m + o);
    } else if (madvise(s->m, s->len, s->how == 1 ? MADV_POPULATE_READ : MADV_POPULATE_WRITE)) {
        perror("madvise");
        abort();
    }
    return NULL;
}

/* Populates m with how on n threads (the caller one of them). */
static void populate(uint8_t *m, int how, uint64_t w, int n)
{
    slice s[8];
    pthread_t t[8];
    uint64_t step = LEN / (uint64_t)n;
    for (int i = 0; i < n; i++)
        s[i] = (slice){.m = m + (uint64_t)i * step, .len = step, .w = w, .how = how};
    for (int i = 1; i < n; i++)
        if (pthread_create(&t[i], NULL, slice_main, &s[i]))
            abort();
    slice_main(&s[0]);
    for (int i = 1; i < n; i++)
        pthread_join(t[i], NULL);
}

typedef struct method {
    const char *name;
    int how, threads, map_populate;
    uint64_t w;
    uint64_t *wall, *cpu;
} method;

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* How many of m's LEN / 4096 pages are mapped (pagemap). */
static uint64_t mapped_pages(const uint8_t *m)
{
    int fd = open("/proc/self/pagemap", O_RDONLY);
    uint64_t ent[512], n = 0;
    for (uint64_t p = 0; p < LEN / 4096; p += 512) {
        ssize_t r = pread(fd, ent, sizeof ent, (off_t)(((uintptr_t)m / 4096 + p) * 8));
        for (ssize_t i = 0; r > 0 && i < r / 8; i++)
            n += ent[i] >> 63;
    }
    close(fd);
    return n;
}

static uint64_t first_touch_pages(void)
{
    uint8_t *m = map_aligned(0);
    (void)*(volatile uint8_t *)m;
    int fd = open("/proc/self/pagemap", O_RDONLY);
    uint64_t ent[512], n = 0, want = LEN / 4096 < 512 ? LEN / 4096 : 512;
    ssize_t r = pread(fd, ent, want * 8, (off_t)((uintptr_t)m / 4096 * 8));
    close(fd);
    while (r > 0 && n < (uint64_t)r / 8 && (ent[n] >> 63))
        n++;
    munmap(m, LEN);
    return n;
}

int main(int argc, char **argv)
{
    uint64_t mib = 64;
    int rounds = 31, owner_thp = 1, collapse = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mib"))
            mib = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--rounds"))
            rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--owner-thp"))
            owner_thp = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--collapse"))
            collapse = atoi(argv[i + 1]);
    }
    LEN = mib << 20;
    FD = memfd_create("shm32", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (FD < 0 || ftruncate(FD, (off_t)LEN))
        abort();
    uint8_t *own = map_aligned(0);
    if (owner_thp)
        (void)madvise(own, LEN, MADV_HUGEPAGE);
    uint64_t f0 = now_ns(CLOCK_MONOTONIC);
    if (collapse) { /* a page a 2 MiB, then collapsed: huge pages whatever the host's policy */
        for (uint64_t o = 0; o < LEN; o += 2u << 20)
            own[o] = 0;
        if (madvise(own, LEN, 25 /* MADV_COLLAPSE */))
            perror("MADV_COLLAPSE");
    }
    uint64_t f1 = now_ns(CLOCK_MONOTONIC);
    memset(own, 1, LEN);
    uint64_t f2 = now_ns(CLOCK_MONOTONIC);
    printf("# owner: collapse %.2f ms, fill %.2f ms\n", (f1 - f0) / 1e6, (f2 - f1) / 1e6);
    munmap(own, LEN);
    fcntl(FD, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    printf("# %llu MiB, owner MADV_HUGEPAGE %d: the first touch maps %llu pages\n",
           (unsigned long long)mib, owner_thp, (unsigned long long)first_touch_pages());

    method ms[] = {
        {"touch64k_1t", 0, 1, 0, 64 << 10, 0, 0},
        {"touch64k_2t", 0, 2, 0, 64 << 10, 0, 0},
        {"touch4k_1t", 0, 1, 0, 4 << 10, 0, 0},
        {"touch2m_1t", 0, 1, 0, 2 << 20, 0, 0},
        {"pop_read_1t", 1, 1, 0, 0, 0, 0},
        {"pop_read_2t", 1, 2, 0, 0, 0, 0},
        {"pop_write_1t", 2, 1, 0, 0, 0, 0},
        {"map_populate", 0, 1, 1, 0, 0, 0},
    };
    int nm = (int)(sizeof ms / sizeof ms[0]);
    for (int k = 0; k < nm; k++) {
        ms[k].wall = calloc((size_t)rounds, 8);
        ms[k].cpu = calloc((size_t)rounds, 8);
    }
    for (int r = 0; r < rounds; r++)
        for (int j = 0; j < nm; j++) {
            method *me = &ms[(j + r) % nm]; /* rotate the order round by round */
            uint64_t c0 = now_ns(CLOCK_PROCESS_CPUTIME_ID), t0 = now_ns(CLOCK_MONOTONIC);
            uint8_t *m = map_aligned(me->map_populate ? MAP_POPULATE : 0);
            if (!me->map_populate)
                populate(m, me->how, me->w, me->threads);
            uint64_t t1 = now_ns(CLOCK_MONOTONIC), c1 = now_ns(CLOCK_PROCESS_CPUTIME_ID);
            me->wall[r] = t1 - t0;
            me->cpu[r] = c1 - c0;
            if (r == 0 && mapped_pages(m) != LEN / 4096)
                printf("# %s leaves %llu of %llu pages unmapped\n", me->name,
                       (unsigned long long)(LEN / 4096 - mapped_pages(m)),
                       (unsigned long long)(LEN / 4096));
            munmap(m, LEN);
        }
    printf("%-14s %8s %8s %8s   %8s %8s %8s  (us)\n", "method", "wall", "p10", "p90", "cpu",
           "p10", "p90");
    for (int k = 0; k < nm; k++) {
        qsort(ms[k].wall, (size_t)rounds, 8, cmp);
        qsort(ms[k].cpu, (size_t)rounds, 8, cmp);
        int a = rounds / 10, b = rounds - 1 - rounds / 10;
        printf("%-14s %8.0f %8.0f %8.0f   %8.0f %8.0f %8.0f\n", ms[k].name,
               ms[k].wall[rounds / 2] / 1e3, ms[k].wall[a] / 1e3, ms[k].wall[b] / 1e3,
               ms[k].cpu[rounds / 2] / 1e3, ms[k].cpu[a] / 1e3, ms[k].cpu[b] / 1e3);
    }
    return 0;
}

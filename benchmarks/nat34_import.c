/* What importing a same-host peer's pool of shmem huge pages costs (nat34):
 * shm.c map_fd's path for a pool whose first 2 MiB one read maps whole
 * (axf_shm_make_huge's pools), per way of populating the rest.
 *
 * An owner collapses a sealed memfd of --mib MiB into 2 MiB pages (as
 * axf_shm_make_huge: a read a 2 MiB, MADV_COLLAPSE), fills it and unmaps
 * it. Then, round after round, each method maps the file 2 MiB-aligned (as
 * shm.c map_shared) and populates it; the wall time of map + populate is
 * taken, the unmap is not. Methods interleave within each round. Prints per
 * method the median, p10 and p90 (us).
 *
 *   cc -O2 -o /tmp/nat34_import benchmarks/nat34_import.c
 *   /tmp/nat34_import [MiB=64] [rounds=41]
 *
 *   before   fault_window (pagemap, 512 entries) + a read and a pagemap read
 *            a 2 MiB (main 17402908's pop_huge)
 *   nat34    fault_window + one MADV_POPULATE_READ over the rest (pop_huge now)
 *   one+pop  a read, one pagemap entry, MADV_POPULATE_READ over the rest
 *   pop      MADV_POPULATE_READ over the whole (no check: a lower bound)
 *   mapp     MAP_POPULATE (another lower bound)
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#define HUGE (2ull << 20)

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint8_t *map_aligned(uint64_t len, int fd, int flags)
{
    uint8_t *r = mmap(NULL, len + HUGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    uint8_t *a = (uint8_t *)(((uintptr_t)r + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    void *m = mmap(a, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | flags, fd, 0);
    if (r == MAP_FAILED || m == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    if (a > r)
        munmap(r, (size_t)(a - r));
    if (a + len < r + len + HUGE)
        munmap(a + len, (size_t)(r + len + HUGE - (a + len)));
    return m;
}

/* shm.c fault_window for an uncached window: 512 entries after a read. */
static int head_huge(const uint8_t *m)
{
    (void)*(const volatile uint8_t *)m;
    uint64_t ent[512];
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    ssize_t r = pread(fd, ent, sizeof ent, (off_t)((uintptr_t)m / 4096 * 8));
    close(fd);
    int n = 0;
    while (n < r / 8 && (ent[n] >> 63))
        n++;
    return n == 512;
}

static int head_huge_one(const uint8_t *m)
{
    (void)*(const volatile uint8_t *)m;
    uint64_t e = 0;
    int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    ssize_t r = pread(fd, &e, 8, (off_t)((uintptr_t)(m + HUGE - 4096) / 4096 * 8));
    close(fd);
    return r == 8 && (e >> 63);
}

static void pop_before(uint8_t *m, uint64_t len)
{
    int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    for (uint64_t o = 0; o < len; o += HUGE) {
        uint64_t e = 0;
        (void)*(const volatile uint8_t *)(m + o);
        if (pread(pm, &e, 8, (off_t)((uintptr_t)(m + o + HUGE - 4096) / 4096 * 8)) != 8 ||
            !(e >> 63))
            fprintf(stderr, "a small range\n");
    }
    close(pm);
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    uint64_t len = (uint64_t)atoi(argc > 1 ? argv[1] : "64") << 20;
    int rounds = argc > 2 ? atoi(argv[2]) : 41;
    int fd = memfd_create("nat34", MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)len) != 0)
        return 1;
    uint8_t *o = map_aligned(len, fd, 0);
    for (uint64_t x = 0; x < len; x += HUGE)
        (void)*(volatile uint8_t *)(o + x);
    if (madvise(o, len, MADV_COLLAPSE) != 0)
        perror("MADV_COLLAPSE (small pages: not what this measures)");
    memset(o, 1, len);
    munmap(o, len);
    enum { NV = 5 };
    static const char *names[NV] = {"before", "nat34", "one+pop", "pop", "mapp"};
    uint64_t *t = calloc((size_t)NV * (size_t)rounds, sizeof *t);
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < NV; v++) {
            uint64_t a = now_ns();
            uint8_t *m;
            switch (v) {
            case 0:
                m = map_aligned(len, fd, 0);
                if (head_huge(m))
                    pop_before(m, len);
                break;
            case 1:
                m = map_aligned(len, fd, 0);
                if (head_huge(m))
                    madvise(m + HUGE, len - HUGE, MADV_POPULATE_READ);
                break;
            case 2:
                m = map_aligned(len, fd, 0);
                if (head_huge_one(m))
                    madvise(m + HUGE, len - HUGE, MADV_POPULATE_READ);
                break;
            case 3:
                m = map_aligned(len, fd, 0);
                madvise(m, len, MADV_POPULATE_READ);
                break;
            default:
                m = map_aligned(len, fd, MAP_POPULATE);
            }
            t[v * rounds + r] = now_ns() - a;
            munmap(m, len);
        }
    printf("%llu MiB, %d rounds (us)\n", (unsigned long long)(len >> 20), rounds);
    for (int v = 0; v < NV; v++) {
        uint64_t *s = t + v * rounds;
        qsort(s, (size_t)rounds, sizeof *s, cmp);
        printf("  %-8s median %7.1f  p10 %7.1f  p90 %7.1f\n", names[v], s[rounds / 2] / 1e3,
               s[rounds / 10] / 1e3, s[rounds * 9 / 10] / 1e3);
    }
    return 0;
}

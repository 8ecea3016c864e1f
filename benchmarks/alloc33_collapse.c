/* Where agent.alloc's collapse spends its time (alloc33): a fresh memfd of
 * MIB MiB, one read a 2 MiB, then MADV_COLLAPSE over it from THREADS
 * threads (each a contiguous share, as shm.c collapse_parallel), wall time
 * per round; with SETTLE s of sleep before each round (cold memory on a VM
 * with free page reporting: see benchmarks/alloc33_alloc.py), and the
 * round's /proc/vmstat deltas that say whether the kernel compacted
 * (compact_stall) or fell back to small pages (thp_file_fallback).
 *
 *   cc -O2 -pthread -o /tmp/alloc33_collapse benchmarks/alloc33_collapse.c
 *   /tmp/alloc33_collapse MIB THREADS[,THREADS...] ROUNDS SETTLE
 *   e.g. /tmp/alloc33_collapse 512 1,2 3 7   (rounds alternate the counts)
 */
#define _GNU_SOURCE
#include <pthread.h>
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
#define HUGE (2u << 20)

static uint8_t *map;
static size_t len;
static long nthreads;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void *work(void *arg)
{
    long i = (long)arg;
    size_t n = len / HUGE, lo = n * (size_t)i / (size_t)nthreads * HUGE,
           hi = n * (size_t)(i + 1) / (size_t)nthreads * HUGE;
    for (size_t o = lo; o < hi; o += HUGE)
        (void)*(volatile uint8_t *)(map + o);
    return (void *)(long)(hi > lo && madvise(map + lo, hi - lo, MADV_COLLAPSE) != 0);
}

static long vmstat(const char *key)
{
    FILE *f = fopen("/proc/vmstat", "r");
    char k[128];
    long v, got = -1;
    while (f && fscanf(f, "%127s %ld", k, &v) == 2)
        if (!strcmp(k, key))
            got = v;
    if (f)
        fclose(f);
    return got;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s MIB THREADS[,THREADS...] ROUNDS SETTLE\n", argv[0]);
        return 2;
    }
    len = (size_t)atol(argv[1]) << 20;
    long counts[8], nc = 0;
    for (char *s = strtok(argv[2], ","); s && nc < 8; s = strtok(NULL, ","))
        counts[nc++] = atol(s);
    int rounds = atoi(argv[3]);
    double settle = atof(argv[4]);
    for (int r = 0; r < rounds; r++)
        for (long c = 0; c < nc; c++) {
            nthreads = counts[(r % 2) ? nc - 1 - c : c];
            if (nthreads < 1 || nthreads > 64)
                return 2;
            usleep((useconds_t)(settle * 1e6));
            int fd = memfd_create("alloc33", MFD_CLOEXEC);
            if (fd < 0 || ftruncate(fd, (off_t)len) != 0)
                return 1;
            uint8_t *r0 = mmap(NULL, len + HUGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            map = (uint8_t *)(((uintptr_t)r0 + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
            map = mmap(map, len, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
            long c0 = vmstat("compact_stall"), f0 = vmstat("thp_file_fallback");
            double t0 = now_ms();
            pthread_t t[64];
            long bad = 0;
            for (long i = 1; i < nthreads; i++)
                pthread_create(&t[i], NULL, work, (void *)i);
            bad += (long)work(0);
            for (long i = 1; i < nthreads; i++) {
                void *x;
                pthread_join(t[i], &x);
                bad += (long)x;
            }
            double ms = now_ms() - t0;
            printf("%zu MiB threads %ld settle %g s: %.1f ms (%.3f ms per 2 MiB) failed %ld"
                   " compact_stall +%ld thp_file_fallback +%ld\n",
                   len >> 20, nthreads, settle, ms, ms / (double)(len / HUGE), bad,
                   vmstat("compact_stall") - c0, vmstat("thp_file_fallback") - f0);
            munmap(r0, len + HUGE);
            close(fd);
        }
    return 0;
}

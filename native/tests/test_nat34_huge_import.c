/* A same-host peer's pool of shmem huge pages (axf_shm_make_huge), imported
 * (shm_map): populated whole by one madvise(MADV_POPULATE_READ) after the
 * first 2 MiB's read (shm.c pop_huge, nat34), not a read and a pagemap read
 * per 2 MiB. What must hold: every page of the pool is mapped when the
 * import returns, also a 2 MiB range of small pages between huge ones (a
 * THP fallback) and a tail below 2 MiB; and an import of a pool all huge
 * pages opens /proc/self/pagemap once (the first 2 MiB's check), not once
 * more for a walk of the rest (open() interposed: 2 before nat34).
 * Each case in a fresh process: the fault-around window is cached per
 * process (fault_window), and a cached small window takes another path. */
#include "harness.h"

#include "internal.h"

#include <fcntl.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/wait.h>

int shm_map(endpoint *ep, rregion *rr, int memfd);
void shm_unmap(rregion *rr);

static atomic_int pagemap_opens;

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
    if (strcmp(path, "/proc/self/pagemap") == 0)
        atomic_fetch_add(&pagemap_opens, 1);
    return real(path, flags, mode);
}

#define MIB (1ull << 20)
#define PG 4096ull

/* A sealed memfd of len bytes, its whole 2 MiB ranges collapsed into huge
 * pages but the one at small_at (if not UINT64_MAX: punched out again, so
 * that the writes below give it small pages), every byte written (no holes:
 * map_fd's whole-pool path). -2: the kernel made no huge pages here. */
static int mixed_memfd(uint64_t len, uint64_t small_at)
{
    int fd = memfd_create("nat34", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)len) != 0)
        return -1;
    if (axf_shm_make_huge(fd, len) != 1)
        return -2;
    if (small_at != UINT64_MAX &&
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)small_at, 2 * MIB))
        return -1;
    /* An unaligned plain mapping, no advice: the writes into the punched
     * range (and the tail) allocate small pages at shmem_enabled "never". */
    uint8_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return -1;
    memset(m, 0x5a, len);
    munmap(m, len);
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        return -1;
    return fd;
}

/* In a fresh process: imports a pool (len, small_at as mixed_memfd) and
 * checks every page mapped; all_huge: and pagemap opened once by it. */
static int import_child(uint64_t len, uint64_t small_at, bool all_huge)
{
    int fd = mixed_memfd(len, small_at);
    if (fd == -2)
        return 77;
    CHECK(fd >= 0);
    axf_shm_lazy_min = 1ull << 30; /* populated whole at map time */
    rregion rr = {.len = len, .access = AXF_ACCESS_READ | AXF_ACCESS_WRITE};
    atomic_store(&pagemap_opens, 0);
    CHECK_EQ(shm_map(NULL, &rr, fd), AXF_OK);
    int opens = atomic_load(&pagemap_opens);
    const uint8_t *m = *(uint8_t **)rr.xp[AXF_EP_SHM];
    CHECK_EQ(t_present_pages(m, len / PG), len / PG);
    CHECK_EQ(m[len - 1], 0x5a);
    if (all_huge)
        CHECK_EQ(opens, 1);
    shm_unmap(&rr);
    close(fd);
    return 0;
}

static int run_child(uint64_t len, uint64_t small_at, bool all_huge)
{
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0)
        _exit(import_child(len, small_at, all_huge));
    int st = 0;
    CHECK_EQ(waitpid(pid, &st, 0), pid);
    CHECK(WIFEXITED(st));
    if (WEXITSTATUS(st) == 77) {
        fprintf(stderr, "skipped: no shmem huge pages here (MADV_COLLAPSE)\n");
        return 0;
    }
    CHECK_EQ(WEXITSTATUS(st), 0);
    return 0;
}

/* 64 MiB of huge pages: mapped whole, pagemap opened once. */
static int test_all_huge_pool_one_pagemap_open(void)
{
    return run_child(64 * MIB, UINT64_MAX, true);
}

/* Huge pages but one 2 MiB of small pages in the middle, and a 12 KiB tail
 * (never a huge page): each page mapped at import. */
static int test_small_range_and_tail_mapped_whole(void)
{
    return run_child(10 * MIB + 3 * PG, 4 * MIB, false);
}

/* A small-page range right after the first 2 MiB (the madvise's start). */
static int test_small_range_after_head_mapped_whole(void)
{
    return run_child(6 * MIB, 2 * MIB, false);
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_all_huge_pool_one_pagemap_open),
        T_CASE(test_small_range_and_tail_mapped_whole),
        T_CASE(test_small_range_after_head_mapped_whole),
    };
    return T_RUN(argc, argv, cases);
}

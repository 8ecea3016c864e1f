/* The process-wide settings are read without a 4 KiB copy on the reading
 * thread's stack (nat26): shm's (the lazy-mapping threshold, the
 * calibration's stand-ins) and the CUDA driver's path were each copied into
 * a char[AXF_ENV_VAL_MAX] on the stack of whichever thread asked first, a
 * copy worker or a populator on a 64 KiB stack among them. Now they are read
 * in place in the snapshot (axf_env_wide).
 *
 * Measured: the first reader runs on a thread whose stack we give it,
 * filled with a pattern; what it overwrote is what it used. A fresh process
 * per case (the settings are read once per process: pthread_once). */
#include "harness.h"

#include <dlfcn.h>
#include <pthread.h>

#define STACK (256u << 10)
#define FILL 0x5a

typedef struct run {
    void (*fn)(void);
} run;

static void *run_main(void *arg)
{
    ((run *)arg)->fn();
    return NULL;
}

/* Bytes of stack fn used on a fresh thread (-1: could not run it). */
static long stack_used(void (*fn)(void))
{
    uint8_t *stack = aligned_alloc(4096, STACK);
    if (!stack)
        return -1;
    memset(stack, FILL, STACK);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setstack(&at, stack, STACK);
    pthread_t th;
    run r = {fn};
    long used = -1;
    if (pthread_create(&th, &at, run_main, &r) == 0) {
        pthread_join(th, NULL);
        size_t untouched = 0; /* the stack grows down: from its low end */
        while (untouched < STACK && stack[untouched] == FILL)
            untouched++;
        used = (long)(STACK - untouched);
    }
    pthread_attr_destroy(&at);
    free(stack);
    return used;
}

static void nothing(void) {}

static void calibrate(void)
{
    axf_calibration c;
    axf_calibrate(&c); /* the stand-ins set: reads the settings, measures nothing */
}

/* shm's settings (4 of them, each through a 4 KiB buffer before: 4 KiB
 * more than the thread's own start at least). */
static int test_shm_settings(void)
{
    setenv("AIOXFER_WAKE_NS", "5000", 1);
    setenv("AIOXFER_COPY_MBPS", "5000", 1);
    setenv("AIOXFER_SHM_LAZY_MIN", "1048576", 1);
    axf_env_read();
    long base = stack_used(nothing), used = stack_used(calibrate);
    fprintf(stderr, "stack: %ld bytes for a thread doing nothing, %ld for the first calibrate\n",
            base, used);
    CHECK(base >= 0 && used >= 0);
    axf_calibration c;
    axf_calibrate(&c);
    CHECK_EQ(c.wake_ns, 5000); /* the settings read, as before */
    CHECK_EQ(c.copy_mbps, 5000);
    CHECK(used - base < 3072);
    return 0;
}

static void dlopen_missing(void)
{
    void *h = dlopen("/nonexistent/nat26/libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h)
        dlclose(h);
    (void)dlerror();
}

static void cuda_probe(void)
{
    char why[256];
    int n = 0;
    (void)axf_cuda_probe(why, sizeof why, &n);
}

/* The CUDA driver's path: the first probe loads it (a missing library
 * here); its stack beyond dlopen's own of that path is small. */
static int test_cuda_driver_path(void)
{
    setenv("AIOXFER_CUDA_DRIVER", "/nonexistent/nat26/libcuda.so.1", 1);
    axf_env_read();
    long ref = stack_used(dlopen_missing), used = stack_used(cuda_probe);
    fprintf(stderr, "stack: %ld bytes for dlopen of a missing path, %ld for the first probe\n",
            ref, used);
    CHECK(ref >= 0 && used >= 0);
    char why[256];
    int n = 0;
    CHECK(axf_cuda_probe(why, sizeof why, &n) != AXF_OK);
    CHECK(strstr(why, "/nonexistent/nat26/libcuda.so.1") != NULL); /* that path, as before */
    CHECK(used - ref < 3072);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_shm_settings),
        T_CASE(test_cuda_driver_path),
    };
#ifdef T_TSAN
    /* TSan refuses a thread on a stack given to it (pthread_attr_setstack). */
    fprintf(stderr, "skipped: no thread on a given stack under TSan\n");
    return 77;
#endif
    if (argc < 2) { /* each case in its own process: the settings are read once */
        int failed = 0;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            char cmd[4096];
            snprintf(cmd, sizeof cmd, "'%s' %s", argv[0], cases[i].name);
            failed += system(cmd) != 0;
        }
        return failed ? 1 : 0;
    }
    return T_RUN(argc, argv, cases);
}

/* The environment snapshot's blocks are freed (nat26). Each distinct
 * environment the process read was one block kept for the process's life,
 * its values' bytes included: a process that read N environments (a
 * Python process creating engines around changing os.environ, or a C one
 * creating engines as its environment changes) kept N blocks. Now a block
 * lives while it is the current snapshot or an engine (or a probe, for its
 * call) holds it; the last one let go frees it.
 *
 * Under ASan, an engine that used its block after a premature free (the
 * environment changed and read again while it lives) is reported. */
#include "harness.h"
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>

#define BIG (64u << 10) /* a value's bytes: what one kept block cost at least */

/* AIOXFER_VERBS_DEVICES (a per-engine setting: any length kept) set to BIG
 * bytes that differ for each i. */
static int set_distinct(unsigned i)
{
    char *v = malloc(BIG + 1);
    if (!v)
        return -1;
    memset(v, 'a' + (char)(i % 26), BIG);
    snprintf(v, 16, "%08u", i); /* distinct in its first bytes */
    v[8] = 'x';
    v[BIG] = 0;
    int r = setenv("AIOXFER_VERBS_DEVICES", v, 1);
    free(v);
    return r;
}

/* 200 environments, an engine created and destroyed in each: the blocks
 * left are the current one (before: 200 more, 12.5 MiB of values). */
static int test_blocks_freed(void)
{
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    size_t base = axf_env_blocks();
    for (unsigned i = 0; i < 200; i++) {
        CHECK_EQ(set_distinct(i), 0);
        axf_env_read();
        tengine *t = t_engine(NULL);
        CHECK(t);
        const char *got = axf_env_get(&t->e->env, AXF_ENV_VERBS_DEVICES);
        CHECK(got && strlen(got) == BIG && (unsigned)atoi(got) == i);
        t_close(t);
    }
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    fprintf(stderr, "blocks: %zu before, %zu after 200 environments\n", base,
            axf_env_blocks());
    CHECK(axf_env_blocks() <= base);
    return 0;
}

/* An engine keeps its block through any number of later environments, and
 * lets it go at its end; engines sharing one (an unchanged environment)
 * free it with the last of them. */
static int test_engine_holds_its_block(void)
{
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    size_t base = axf_env_blocks();
    CHECK_EQ(set_distinct(1), 0);
    axf_env_read();
    tengine *a = t_engine(NULL);
    tengine *b = t_engine(NULL);
    CHECK(a && b);
    CHECK(a->e->env.b == b->e->env.b);
    for (unsigned i = 3000; i < 3048; i++) { /* each the current one, then dropped */
        CHECK_EQ(set_distinct(i), 0);
        axf_env_read();
    }
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    CHECK_EQ(axf_env_blocks(), base + 1); /* a's and b's */
    /* Read after 48 environments came and went (a freed block: ASan says). */
    const char *got = axf_env_get(&a->e->env, AXF_ENV_VERBS_DEVICES);
    CHECK(got && strlen(got) == BIG && atoi(got) == 1);
    t_close(a);
    CHECK_EQ(axf_env_blocks(), base + 1); /* b still holds it */
    got = axf_env_get(&b->e->env, AXF_ENV_VERBS_DEVICES);
    CHECK(got && atoi(got) == 1);
    t_close(b);
    CHECK_EQ(axf_env_blocks(), base);
    return 0;
}

/* The probes (axf_file_info without an engine, the process-wide readers)
 * hold a block for their call only. */
static int test_probes_release(void)
{
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    size_t base = axf_env_blocks();
    char why[128], out[AXF_ENV_VAL_MAX];
    for (unsigned i = 0; i < 100; i++) {
        CHECK_EQ(set_distinct(1000 + i), 0); /* none read before: a block each */
        axf_env_read();
        CHECK(axf_file_info(NULL, why, sizeof why) >= 0);
        CHECK(!axf_env_value(AXF_ENV_CUDA_DRIVER, out));
        axf_calibration cal;
        axf_calibrate(&cal);
    }
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    CHECK(axf_env_blocks() <= base);
    return 0;
}

/* Engines created and destroyed, and the process-wide readers, beside the
 * environment read again and again as it changes: every block taken is
 * valid while held (ASan: no use after free; TSan: the counts race-free),
 * and what stays at the end is the current block. Only this thread writes
 * the environment (as Python does it: axf_env_read with the GIL). */
static atomic_bool churn_stop;
static atomic_int churn_bad, churn_engines;

static void *churn(void *arg)
{
    (void)arg;
    while (!atomic_load(&churn_stop)) {
        tengine *t = t_engine(NULL);
        if (!t) {
            atomic_fetch_add(&churn_bad, 1);
            break;
        }
        const char *v = axf_env_get(&t->e->env, AXF_ENV_VERBS_DEVICES);
        if (v && strlen(v) != BIG)
            atomic_fetch_add(&churn_bad, 1);
        axf_env env;
        axf_env_take(&env, false);
        v = axf_env_get(&env, AXF_ENV_VERBS_DEVICES);
        if (v && strlen(v) != BIG)
            atomic_fetch_add(&churn_bad, 1);
        axf_env_release(&env);
        t_close(t);
        atomic_fetch_add(&churn_engines, 1);
    }
    return NULL;
}

static int test_churn(void)
{
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    size_t base = axf_env_blocks();
    pthread_t th[2];
    atomic_store(&churn_stop, false);
    for (int i = 0; i < 2; i++)
        CHECK_EQ(pthread_create(&th[i], NULL, churn, NULL), 0);
    /* At least 300 reads and 200 engines (each spanning some reads). */
    uint64_t deadline = t_now_ms() + 20000;
    bool late = false;
    for (unsigned i = 0; i < 300 || atomic_load(&churn_engines) < 200; i++) {
        late = t_now_ms() > deadline || set_distinct(2000 + i % 7) != 0;
        if (late)
            break;
        axf_env_read(); /* some come back (i % 7): reused while alive */
        if (i % 8 == 0)
            usleep(200);
    }
    fprintf(stderr, "churn: %d engines\n", atomic_load(&churn_engines));
    atomic_store(&churn_stop, true);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    CHECK(!late);
    CHECK_EQ(atomic_load(&churn_bad), 0);
    unsetenv("AIOXFER_VERBS_DEVICES");
    axf_env_read();
    CHECK(axf_env_blocks() <= base);
    return 0;
}

int main(int argc, char **argv)
{
    /* The calibration's stand-ins: axf_calibrate measures nothing. */
    setenv("AIOXFER_WAKE_NS", "5000", 1);
    setenv("AIOXFER_COPY_MBPS", "5000", 1);
    static const t_case cases[] = {
        T_CASE(test_blocks_freed),
        T_CASE(test_engine_holds_its_block),
        T_CASE(test_probes_release),
        T_CASE(test_churn),
    };
    return T_RUN(argc, argv, cases);
}

/* The environment snapshot is compact (nat24): each engine kept a copy of 17
 * fixed 512-byte slots (8.7 KiB), and a value of 512 bytes or more read as
 * unset, silently. Now a snapshot is one block holding each value at its
 * length, made once per distinct environment and shared (an engine holds a
 * pointer); any length is kept for the per-engine settings, and a value too
 * long for a process-wide reader (a path copied into a PATH_MAX buffer) is
 * said in a log record of each engine created with it, not dropped
 * silently. */
#include "harness.h"
#include "internal.h"

#include <stdatomic.h>

static char *repeat(char c, size_t n)
{
    char *s = malloc(n + 1);
    if (s) {
        memset(s, c, n);
        s[n] = 0;
    }
    return s;
}

/* An engine's copy of the environment is small, whatever the values. */
static int test_snapshot_is_compact(void)
{
    fprintf(stderr, "sizeof(axf_env) %zu, sizeof(struct axf_engine) %zu\n", sizeof(axf_env),
            sizeof(struct axf_engine));
    CHECK(sizeof(axf_env) <= 16); /* before: 8708 */
    return 0;
}

/* A per-engine setting of any length is kept whole (before: 600 bytes read
 * as unset). */
static int test_long_value_kept(void)
{
    char *v = repeat('d', 600);
    CHECK(v);
    setenv("AIOXFER_VERBS_DEVICES", v, 1);
    axf_env_read();
    tengine *t = t_engine(NULL);
    CHECK(t);
    const char *got = axf_env_get(&t->e->env, AXF_ENV_VERBS_DEVICES);
    CHECK(got != NULL);
    CHECK_EQ(strlen(got), 600);
    CHECK(strcmp(got, v) == 0);
    unsetenv("AIOXFER_VERBS_DEVICES");
    free(v);
    t_close(t);
    return 0;
}

/* A process-wide value longer than its readers take is logged by each
 * engine created with it, naming the variable (before: silently unset). */
static int test_too_long_is_logged(void)
{
    char *v = repeat('p', AXF_ENV_VAL_MAX + 100);
    CHECK(v);
    setenv("AIOXFER_CUDA_DRIVER", v, 1);
    axf_env_read();
    tengine *t = t_engine(NULL);
    CHECK(t);
    bool said = false;
    axf_completion c;
    while (!said && t_wait_ex(t, AXF_CQ_LOG, true, 0, &c, 200) == 0) {
        fprintf(stderr, "log: %.*s\n", (int)c.payload_len, (const char *)c.payload);
        said = c.payload && memmem(c.payload, c.payload_len, "AIOXFER_CUDA_DRIVER", 19);
        axf_completion_free(&c);
    }
    CHECK(said);
    char out[AXF_ENV_VAL_MAX];
    CHECK(!axf_env_value(AXF_ENV_CUDA_DRIVER, out)); /* the readers' default applies */
    unsetenv("AIOXFER_CUDA_DRIVER");
    axf_env_read();
    free(v);
    t_close(t);
    return 0;
}

/* An unchanged environment read again reuses its block (engines share it);
 * a changed one gets its own, and changing back finds the first again. */
static int test_snapshots_shared(void)
{
    setenv("AIOXFER_FILE_IO", "threads", 1);
    axf_env_read();
    tengine *a = t_engine(NULL);
    for (int i = 0; i < 1000; i++)
        axf_env_read();
    tengine *b = t_engine(NULL);
    CHECK(a && b);
    CHECK(a->e->env.b == b->e->env.b);
    setenv("AIOXFER_FILE_IO", "uring", 1);
    axf_env_read();
    tengine *c = t_engine(NULL);
    CHECK(c);
    CHECK(c->e->env.b != a->e->env.b);
    CHECK(strcmp(axf_env_get(&c->e->env, AXF_ENV_FILE_IO), "uring") == 0);
    CHECK(strcmp(axf_env_get(&a->e->env, AXF_ENV_FILE_IO), "threads") == 0);
    setenv("AIOXFER_FILE_IO", "threads", 1);
    axf_env_read();
    tengine *d = t_engine(NULL);
    CHECK(d);
    CHECK(d->e->env.b == a->e->env.b);
    unsetenv("AIOXFER_FILE_IO");
    axf_env_read();
    t_close(a);
    t_close(b);
    t_close(c);
    t_close(d);
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_snapshot_is_compact),
        T_CASE(test_long_value_kept),
        T_CASE(test_too_long_is_logged),
        T_CASE(test_snapshots_shared),
    };
    return T_RUN(argc, argv, cases);
}

/* The library reads the environment only where axf_env_read (or, before any
 * call of it, an engine's creation) snapshots it: no getenv runs afterwards
 * on the threads that create engines, start their file transport, probe or
 * enable verbs, load the CUDA driver or calibrate. The Python extension calls
 * axf_env_read with the GIL held and creates engines without it: a getenv
 * there raced a Python thread writing os.environ (putenv may free or move the
 * string getenv returned). getenv is interposed here and counts the
 * library's variables asked for. Per-engine settings keep their per-engine
 * meaning: each engine has the snapshot of the last axf_env_read before its
 * creation, even for what it reads later (the file transport's backend). */
#include "harness.h"
#include "internal.h"

#include <fcntl.h>
#include <stdatomic.h>

extern char **environ;
static atomic_int asked; /* AIOXFER_* / AXF_* names asked for */

/* Our own lookup (no dlsym: it may itself look at the environment). */
char *getenv(const char *name)
{
    if (strncmp(name, "AIOXFER_", 8) == 0 || strncmp(name, "AXF_", 4) == 0)
        atomic_fetch_add(&asked, 1);
    size_t n = strlen(name);
    for (char **p = environ; p && *p; p++)
        if (strncmp(*p, name, n) == 0 && (*p)[n] == '=')
            return *p + n + 1;
    return NULL;
}

/* After axf_env_read: creation (tcp, shm, the calibration), the file
 * transport's start, the probes (file, verbs, CUDA) ask for nothing. */
static int test_no_getenv_after_read(void)
{
    setenv("AIOXFER_REFUSED_LOG_MS", "300", 1);
    setenv("AIOXFER_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
    axf_env_read();
    CHECK(atomic_load(&asked) > 0); /* the interposition works */
    int before = atomic_load(&asked);
    tengine *t = t_engine(NULL);
    CHECK(t);
    CHECK_EQ(t->e->refused_log_ms, 300);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(t->e, AXF_EP_FILE, 7, 0, -1, &ep), AXF_OK);
    char line[256];
    CHECK(axf_file_info(t->e, line, sizeof line) >= 0);
    axf_file_info(NULL, line, sizeof line);
    char names[256];
    axf_verbs_probe(NULL, names, sizeof names, line, sizeof line);
    int ndev = 0;
    CHECK(axf_cuda_probe(line, sizeof line, &ndev) != AXF_OK); /* the missing driver */
    CHECK(strstr(line, "/nonexistent/libcuda.so.1"));
    axf_calibration cal;
    axf_calibrate(&cal);
    CHECK_EQ(atomic_load(&asked), before);
    t_close(t);
    return 0;
}

/* Per engine: a change of the environment counts from the next
 * axf_env_read on, for what an engine reads at its creation and later. */
static int test_per_engine_snapshot(void)
{
    setenv("AIOXFER_FILE_IO", "threads", 1);
    setenv("AIOXFER_REFUSED_LOG_MS", "400", 1);
    axf_env_read();
    tengine *a = t_engine(NULL);
    CHECK(a);
    setenv("AIOXFER_FILE_IO", "uring", 1); /* not snapshotted yet */
    setenv("AIOXFER_REFUSED_LOG_MS", "700", 1);
    tengine *b = t_engine(NULL);
    CHECK(b);
    uint64_t ep;
    CHECK_EQ(axf_endpoint_create(a->e, AXF_EP_FILE, 7, 0, -1, &ep), AXF_OK); /* starts it now */
    char line[256];
    CHECK_EQ(axf_file_info(a->e, line, sizeof line), 0);
    CHECK(strcmp(line, "thread pool: forced by AIOXFER_FILE_IO=threads") == 0);
    CHECK_EQ(a->e->refused_log_ms, 400);
    CHECK_EQ(b->e->refused_log_ms, 400);
    axf_env_read();
    tengine *c = t_engine(NULL);
    CHECK(c);
    CHECK_EQ(c->e->refused_log_ms, 700);
    CHECK_EQ(axf_endpoint_create(c->e, AXF_EP_FILE, 7, 0, -1, &ep), AXF_OK);
    axf_file_info(c->e, line, sizeof line);
    CHECK(strcmp(line, "thread pool: forced by AIOXFER_FILE_IO=threads") != 0);
    t_close(a);
    t_close(b);
    t_close(c);
    unsetenv("AIOXFER_FILE_IO");
    unsetenv("AIOXFER_REFUSED_LOG_MS");
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_no_getenv_after_read),
        T_CASE(test_per_engine_snapshot),
    };
    return T_RUN(argc, argv, cases);
}

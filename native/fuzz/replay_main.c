/* A main() for the fuzz harnesses without libFuzzer: runs each file given
 * (directories: each regular file in them, sorted) through
 * LLVMFuzzerTestOneInput once. This is how CI replays the committed corpus:
 * any C compiler with ASan/UBSan builds it (no libclang-rt fuzzer runtime
 * needed), and a finding aborts with the harness's message. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* A harness's teardown (engine destroyed, buffers freed), where it has one. */
void fz_cleanup(void) __attribute__((weak));

static size_t replayed;

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        fprintf(stderr, "%s: read failed\n", path);
        fclose(f);
        free(buf);
        return 1;
    }
    fclose(f);
    /* libFuzzer hands over an exact-size heap copy: so do we, so ASan sees
     * a read past the end. */
    (void)LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    replayed++;
    return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

int main(int argc, char **argv)
{
    LLVMFuzzerInitialize(&argc, &argv);
    int rc = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            perror(argv[i]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            rc |= run_file(argv[i]);
            continue;
        }
        struct dirent **names;
        int n = scandir(argv[i], &names, NULL, by_name);
        if (n < 0) {
            perror(argv[i]);
            return 1;
        }
        for (int k = 0; k < n; k++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], names[k]->d_name);
            if (names[k]->d_name[0] != '.' && stat(path, &st) == 0 && S_ISREG(st.st_mode))
                rc |= run_file(path);
            free(names[k]);
        }
        free(names);
    }
    if (fz_cleanup)
        fz_cleanup();
    printf("replayed %zu inputs\n", replayed);
    return rc;
}

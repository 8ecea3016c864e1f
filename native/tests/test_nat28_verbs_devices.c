/* AIOXFER_VERBS_DEVICES of any length (nat28).
 *
 * The verbs settings copied the allow-list into 256 bytes: a longer list
 * (many HCAs with long names, a generated list) was cut at 255 characters,
 * and a device named past that was refused ("not in AIOXFER_VERBS_DEVICES")
 * by the probe and by enable. Now the list is read in place in the
 * environment snapshot (held by the engine, or by the probe for its call).
 * Over the software verbs provider (AXF_SOFTVERBS_PROVIDER, two devices:
 * softverbs0 and softverbs1). */
#include "harness.h"

#define LIST_MAX 1024

/* A list of `pad` bytes of other names, then `name`. */
static void set_list(size_t pad, const char *name)
{
    static char v[LIST_MAX];
    size_t n = 0;
    while (n + 8 < pad) {
        memcpy(v + n, "mlx5_99,", 8);
        n += 8;
    }
    snprintf(v + n, sizeof v - n, "%s", name);
    setenv("AIOXFER_VERBS_DEVICES", v, 1);
}

static int allowed_past(size_t pad)
{
    const char *provider = getenv("AXF_SOFTVERBS_PROVIDER");
    CHECK(provider);
    set_list(pad, "softverbs1");
    char names[1024] = "", why[256] = "";
    int n = axf_verbs_probe(provider, names, sizeof names, why, sizeof why);
    fprintf(stderr, "list of %zu bytes: probe %d (%s) %s\n",
            strlen(getenv("AIOXFER_VERBS_DEVICES")), n, why, names);
    CHECK_EQ(n, 1);
    CHECK(strncmp(names, "softverbs1 ", 11) == 0);
    tengine *t = t_engine(NULL);
    CHECK(t);
    CHECK_EQ(axf_verbs_enable(t->e, provider, why, sizeof why), 1);
    CHECK_EQ(axf_verbs_device_count(t->e), 1);
    t_close(t);
    /* A name that is only a prefix of the list's last entry is not in it. */
    set_list(pad, "softverbs10");
    CHECK_EQ(axf_verbs_probe(provider, NULL, 0, why, sizeof why), 0);
    unsetenv("AIOXFER_VERBS_DEVICES");
    return 0;
}

static int test_short_list(void) { return allowed_past(0); }
static int test_device_named_past_255(void) { return allowed_past(300); }
static int test_device_named_past_900(void) { return allowed_past(900); }

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_short_list),
        T_CASE(test_device_named_past_255),
        T_CASE(test_device_named_past_900),
    };
    return T_RUN(argc, argv, cases);
}

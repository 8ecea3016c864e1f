/* The device name a verbs provider gives (nat29): dev_open copied it into
 * 64 bytes with snprintf, so a longer name was cut without a word. The cut
 * name then matched an AIOXFER_VERBS_DEVICES entry that names a different
 * device (the prefix), missed the entry naming the device in full, and read
 * another device's sysfs (gid types); an empty name made a device nobody
 * could list. rdma-core's names fit (IBV_SYSFS_NAME_MAX, 64 with the NUL):
 * a longer or empty one is a provider's error, and the device is refused
 * with the reason, not used under another name. Over the software verbs
 * provider (AXF_SOFTVERBS_PROVIDER), whose AXF_SOFTVERBS_NAME_SUFFIX makes
 * its get_device_name return "softverbs<i>" + the suffix ("NUL": ""). */
#include "harness.h"

/* "softverbs1" padded with 'x' to `len` bytes. */
static const char *name_of_len(char *buf, size_t len)
{
    memset(buf, 'x', len);
    memcpy(buf, "softverbs1", 10);
    buf[len] = 0;
    return buf;
}

/* Device names len bytes long (both devices: the suffix is the same). */
static void set_names(size_t len)
{
    char suffix[256];
    memset(suffix, 'x', len - 10);
    suffix[len - 10] = 0;
    setenv("AXF_SOFTVERBS_NAME_SUFFIX", suffix, 1);
}

static int probe(const char *devices, char *names, size_t names_len, char *why, size_t why_len)
{
    const char *provider = getenv("AXF_SOFTVERBS_PROVIDER");
    if (!provider)
        return -100;
    if (devices)
        setenv("AIOXFER_VERBS_DEVICES", devices, 1);
    else
        unsetenv("AIOXFER_VERBS_DEVICES");
    int n = axf_verbs_probe(provider, names, names_len, why, why_len);
    fprintf(stderr, "probe %d (%s) %s\n", n, why, names ? names : "");
    return n;
}

static int enabled(const char *devices)
{
    char why[256] = "";
    if (devices)
        setenv("AIOXFER_VERBS_DEVICES", devices, 1);
    else
        unsetenv("AIOXFER_VERBS_DEVICES");
    tengine *t = t_engine(NULL);
    if (!t)
        return -100;
    int n = axf_verbs_enable(t->e, getenv("AXF_SOFTVERBS_PROVIDER"), why, sizeof why);
    fprintf(stderr, "enable %d (%s)\n", n, why);
    int count = n == 1 ? axf_verbs_device_count(t->e) : 0;
    t_close(t);
    return count;
}

/* 63 bytes, the longest that fits: kept whole, listed and matched whole. */
static int test_name_of_63_kept(void)
{
    char full[64], names[1024] = "", why[256] = "";
    set_names(63);
    CHECK_EQ(probe(NULL, names, sizeof names, why, sizeof why), 2);
    name_of_len(full, 63);
    CHECK(strstr(names, full) != NULL);
    CHECK_EQ(probe(full, names, sizeof names, why, sizeof why), 1);
    CHECK(strncmp(names, full, 63) == 0 && names[63] == ' ');
    CHECK_EQ(enabled(full), 1);
    unsetenv("AXF_SOFTVERBS_NAME_SUFFIX");
    return 0;
}

/* Longer than 63: refused with the reason, under no name (the cut name's
 * entry in the list does not pick it; the full name is no use either). */
static int test_name_past_63_refused(void)
{
    char full[128], cut[64], why[256] = "";
    for (size_t len = 64; len <= 100; len += 36) {
        set_names(len);
        name_of_len(full, len);
        name_of_len(cut, 63);
        CHECK_EQ(probe(NULL, NULL, 0, why, sizeof why), 0);
        CHECK(strstr(why, "longer than 63 bytes") != NULL);
        CHECK_EQ(probe(cut, NULL, 0, why, sizeof why), 0);
        CHECK_EQ(probe(full, NULL, 0, why, sizeof why), 0);
        CHECK_EQ(enabled(NULL), 0);
        CHECK_EQ(enabled(cut), 0);
    }
    unsetenv("AXF_SOFTVERBS_NAME_SUFFIX");
    return 0;
}

/* An empty name: refused, with the reason. */
static int test_empty_name_refused(void)
{
    char why[256] = "";
    setenv("AXF_SOFTVERBS_NAME_SUFFIX", "NUL", 1);
    CHECK_EQ(probe(NULL, NULL, 0, why, sizeof why), 0);
    CHECK(strstr(why, "device name empty") != NULL);
    CHECK_EQ(enabled(NULL), 0);
    unsetenv("AXF_SOFTVERBS_NAME_SUFFIX");
    return 0;
}

int main(int argc, char **argv)
{
    static const t_case cases[] = {
        T_CASE(test_name_of_63_kept),
        T_CASE(test_name_past_63_refused),
        T_CASE(test_empty_name_refused),
    };
    return T_RUN(argc, argv, cases);
}

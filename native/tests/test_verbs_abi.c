/* native/src/verbs_abi.h (the libibverbs ABI declared in-tree, so verbs builds
 * without rdma-core's headers) against rdma-core's <infiniband/verbs.h>: every
 * size, offset and constant in verbs_abi_list.h must be equal. A mismatch
 * would corrupt memory on real hardware, where no stand-in would notice. */
#include "verbs_abi.h"

#include <stdio.h>

#include "verbs_abi_list.h"

extern const uint64_t axf_abi_real[];
extern const size_t axf_abi_real_n;

static const uint64_t ours[] = {AXF_VERBS_ABI(AXF_ABI_S, AXF_ABI_U, AXF_ABI_O, AXF_ABI_V)};
static const char *const names[] = {
    AXF_VERBS_ABI(AXF_ABI_SN, AXF_ABI_UN, AXF_ABI_ON, AXF_ABI_VN)};

int main(void)
{
    size_t n = sizeof ours / sizeof ours[0];
    if (n != axf_abi_real_n) {
        fprintf(stderr, "the two expansions differ in length (%zu, %zu)\n", n, axf_abi_real_n);
        return 1;
    }
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        if (ours[i] != axf_abi_real[i]) {
            fprintf(stderr, "%s: ours %llu, rdma-core %llu\n", names[i],
                    (unsigned long long)ours[i], (unsigned long long)axf_abi_real[i]);
            bad = 1;
        }
    printf("%zu sizes, offsets and constants checked: %s\n", n, bad ? "MISMATCH" : "equal");
    return bad;
}

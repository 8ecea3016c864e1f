/* The ABI list expanded against rdma-core's own header (built only where it
 * is installed): what native/src/verbs_abi.h is compared with. */
#include <infiniband/verbs.h>

#include "verbs_abi_list.h"

const uint64_t axf_abi_real[] = {AXF_VERBS_ABI(AXF_ABI_S, AXF_ABI_U, AXF_ABI_O, AXF_ABI_V)};
const size_t axf_abi_real_n = sizeof axf_abi_real / sizeof axf_abi_real[0];

/* The transport registry: one line per transport, under the meson option
 * that builds it. A transport that is not built is absent here; the core
 * then refuses its endpoints (AXF_E_TRANSPORT for a public kind).
 *
 * The order is the order the core calls them in (transport.h): a far
 * region's CUDA IPC/host registration goes before its shared-memory mapping,
 * a region's RDMA registrations before its CUDA pin. */
#include "transport.h"

#include <stddef.h>

const axf_transport *const axf_transports[] = {
    &axf_xp_tcp,
    &axf_xp_file,
#ifdef AXF_HAVE_VERBS
    &axf_xp_verbs,
#endif
    &axf_xp_cuda,
    &axf_xp_shm,
#ifdef AXF_HAVE_MOCK
    &axf_xp_mock,
#endif
    NULL,
};

const size_t axf_ntransports = sizeof axf_transports / sizeof axf_transports[0] - 1;

const axf_transport *axf_transport_for(int ep_kind)
{
    for (const axf_transport *const *xi = axf_transports; *xi; xi++)
        if ((*xi)->ep_kind == ep_kind && (*xi)->abi == AXF_TRANSPORT_ABI)
            return *xi;
    return NULL;
}

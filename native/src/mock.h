/* The test-only mock transport (native/src/mock.c): built into the native
 * tests' library, and into the engine only with -Dmock_transport=true. Its
 * endpoints (kind AXF_EP_MOCK) queue every op's data phase and the test
 * finishes them, in any order, with any status; their control connections
 * and accepted peers are detached connections (no socket, no threads) whose
 * frames the test takes and delivers. So the core (ring, op lifetime,
 * cancellation, revocation, shutdown) is tested with no socket at all. */
#ifndef AXF_MOCK_H
#define AXF_MOCK_H

#include "transport.h"

/* Request ids of the ops submitted and not finished, in submit order. */
size_t axf_mock_pending(axf_engine *e, uint64_t *req_ids, size_t max);
/* Finishes op req_id's data phase: status (AXF_OK or a failure) and the
 * bytes it moved. AXF_E_NOTFOUND when it is not pending. */
int axf_mock_complete(axf_engine *e, uint64_t req_id, int32_t status, uint64_t nbytes);

/* Control connections. connect: one of endpoint ep's (its far side is the
 * test); accept: a peer's connection to us, tagged tag. *peer_out names it. */
int axf_mock_connect(axf_engine *e, uint64_t ep, uint64_t *peer_out);
int axf_mock_accept(axf_engine *e, uint64_t tag, uint64_t *peer_out);
/* The next frame we queued on it, as if sent (true), or false: none. */
bool axf_mock_take(axf_engine *e, uint64_t peer, wire_hdr *h);
/* A header-only frame arrives on it: AXF_OK; AXF_E_PROTOCOL (malformed) or
 * AXF_E_CLOSED (a goodbye): a real connection would close here, the test
 * then calls axf_mock_close. */
int axf_mock_deliver(axf_engine *e, uint64_t peer, const wire_hdr *h);
/* The connection ends (as when its socket fails). */
int axf_mock_close(axf_engine *e, uint64_t peer);

/* Test-only faults (internal.h axf_faults) for engine e from now on, or
 * none (NULL); f must outlive its use. Not in the engine's API: only the
 * native tests' library has it. */
void axf_mock_faults(axf_engine *e, const axf_faults *f);

#endif

/* libFuzzer harness: the initiator-side frame parser with each request
 * awaited alone by a spinning thread, which reads the replies of parked
 * receivers (conn.c help_read): fuzz_initiator_frames.c built with FZ_LONE
 * (see its header), a corpus of its own (fuzz/corpus/lone_frames). */
#define FZ_LONE 1
#include "fuzz_initiator_frames.c"

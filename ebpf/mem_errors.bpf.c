// Host memory-controller errors (EDAC): ras:mc_event. Counts by error type in the kernel and
// sends each event's type, count and memory-controller index to user space.
#include "events.h"

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);

struct mc_event {
    u64 ts_ns;
    u32 error_type;   // 0 corrected, 1 uncorrected, 2 deferred, 3 fatal, 4 info
    u16 error_count;
    u8 mc_index;
};

TRACEPOINT_PROBE(ras, mc_event) {
    struct mc_event *e = events.ringbuf_reserve(sizeof(struct mc_event));
    if (!e) {
        u32 zero = 0;
        u64 *l = lost.lookup(&zero);
        if (l) __sync_fetch_and_add(l, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->error_type = args->error_type;
    e->error_count = args->error_count;
    e->mc_index = args->mc_index;
    events.ringbuf_submit(e, 0);
    return 0;
}

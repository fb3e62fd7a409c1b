// PCIe Advanced Error Reporting: ras:aer_event (absent on VMs without AER; present on real nodes).
#include "events.h"

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);

struct aer_event {
    u64 ts_ns;
    u32 status;
    u8 severity;      // 0 uncorrectable non-fatal, 1 fatal, 2 corrected
    char dev_name[32];
};

TRACEPOINT_PROBE(ras, aer_event) {
    struct aer_event *e = events.ringbuf_reserve(sizeof(struct aer_event));
    if (!e) {
        u32 zero = 0;
        u64 *l = lost.lookup(&zero);
        if (l) __sync_fetch_and_add(l, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->status = args->status;
    e->severity = args->severity;
    bpf_probe_read_kernel_str(e->dev_name, sizeof(e->dev_name), (void *)args + (args->data_loc_dev_name & 0xFFFF));
    events.ringbuf_submit(e, 0);
    return 0;
}

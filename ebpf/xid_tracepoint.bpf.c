// Xid probe on the NVIDIA driver's own tracepoint, nvidia:nvidia_dev_xid (open-gpu-kernel-modules,
// nv-tracepoint.h): __string(dev, pci_name(pdev)), __field(u32, error_code), __string(msg, msg).
// Used when the tracepoint exists; the loader falls back to xid.bpf.c (printk:console) otherwise.
#include "events.h"

#ifndef MSG_LEN
#define MSG_LEN 256
#endif

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);

struct xid_report {
    u64 ts_ns;
    u32 pid;
    u32 error_code;
    char comm[16];
    char dev[32];
    char msg[MSG_LEN];
};

TRACEPOINT_PROBE(nvidia, nvidia_dev_xid) {
    struct xid_report *e = events.ringbuf_reserve(sizeof(struct xid_report));
    if (!e) {
        u32 zero = 0;
        u64 *l = lost.lookup(&zero);
        if (l) __sync_fetch_and_add(l, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->error_code = args->error_code;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    bpf_probe_read_kernel_str(e->dev, sizeof(e->dev), (void *)args + (args->data_loc_dev & 0xFFFF));
    bpf_probe_read_kernel_str(e->msg, sizeof(e->msg), (void *)args + (args->data_loc_msg & 0xFFFF));
    events.ringbuf_submit(e, 0);
    return 0;
}

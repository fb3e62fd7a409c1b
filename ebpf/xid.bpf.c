// Xid probe: NVIDIA driver Xid reports from the kernel log, filtered in the kernel.
// Attached to printk:console; only messages that START with "NVRM: Xid (" reach user space.
// The tracepoint's msg is the message text itself: trace_console() runs in printk_sprint(),
// after the log-level prefix is stripped and before any timestamp or record header exists
// (tests/test_kernel_trust.py checks it on the running kernel). Comparing at offset 0 is what
// keeps a kernel message that echoes user text ("process 'sh' launched '/tmp/NVRM: Xid (...'
// with NULL argv") out: never search further into the message. (A pr_cont() fragment is traced
// on its own; one that began with user text would pass this check. No tracepoint argument says
// "fragment"; user space parses whatever passes the same way.)
// Kernel side: filter and capture, nothing else. Settings come in as -D cflags.
#include "events.h"

#ifndef MSG_LEN
#define MSG_LEN 256
#endif

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);     // events the ring buffer had no room for
BPF_ARRAY(seen, u64, 1);     // console lines inspected (for the overhead figures)

struct xid_line {
    u64 ts_ns;
    u32 pid;       // the task that printed (the driver's context, or a /dev/kmsg writer)
    char comm[16];
    char msg[MSG_LEN];
};

TRACEPOINT_PROBE(printk, console) {
    u32 zero = 0;
    u64 *n = seen.lookup(&zero);
    if (n) __sync_fetch_and_add(n, 1);

    char head[11] = {};
    unsigned short loc = args->data_loc_msg & 0xFFFF;
    bpf_probe_read_kernel(head, sizeof(head), (void *)args + loc);
    // "NVRM: Xid (" at offset 0 — compare in the kernel so other lines never cost a wake-up
    if (head[0] != 'N' || head[1] != 'V' || head[2] != 'R' || head[3] != 'M' || head[4] != ':' ||
        head[5] != ' ' || head[6] != 'X' || head[7] != 'i' || head[8] != 'd' || head[9] != ' ' ||
        head[10] != '(')
        return 0;

    struct xid_line *e = events.ringbuf_reserve(sizeof(struct xid_line));
    if (!e) {
        u64 *l = lost.lookup(&zero);
        if (l) __sync_fetch_and_add(l, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->pid = bpf_get_current_pid_tgid() >> 32;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    bpf_probe_read_kernel_str(e->msg, sizeof(e->msg), (void *)args + loc);
    events.ringbuf_submit(e, 0);
    return 0;
}

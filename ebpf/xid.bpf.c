// Kernel-log probe: NVIDIA driver reports (Xid and the other signatures of sentinel/signatures.toml)
// from printk:console, filtered in the kernel. Only messages that START with one of the catalog's
// prefixes reach user space; the loader passes them as -DPREFIX_<n>="..." cflags (at most 16, each
// at most HEAD_LEN characters), never by editing this text.
// The tracepoint's msg is the message text itself: trace_console() runs in printk_sprint(),
// after the log-level prefix is stripped and before any timestamp or record header exists
// (tests/test_kernel_trust.py checks it on the running kernel). Comparing at offset 0 is what
// keeps a kernel message that echoes user text ("process 'sh' launched '/tmp/NVRM: Xid (...'
// with NULL argv") out: never search further into the message. (A pr_cont() fragment is traced
// on its own; one that began with user text would pass this check. No tracepoint argument says
// "fragment"; user space classifies whatever passes with the same anchored patterns.)
// Kernel side: filter and capture, nothing else.
#include "events.h"

#ifndef MSG_LEN
#define MSG_LEN 256
#endif
#define HEAD_LEN 32
#ifndef PREFIX_0
#define PREFIX_0 "NVRM: Xid ("
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

// 1 when head starts with the n characters of p. Branch-free (differences OR-ed together over
// a loop that unrolls to compares against constants), so the verifier sees one straight path
// however many prefixes there are.
static __always_inline int starts_with(const char *head, const char *p, int n) {
    char diff = 0;
#pragma unroll
    for (int i = 0; i < HEAD_LEN; i++) {
        if (i < n)
            diff |= head[i] ^ p[i];
    }
    return diff == 0;
}

#define PREFIX_MATCHES(P) starts_with(head, P, sizeof(P) - 1)

TRACEPOINT_PROBE(printk, console) {
    u32 zero = 0;
    u64 *n = seen.lookup(&zero);
    if (n) __sync_fetch_and_add(n, 1);

    char head[HEAD_LEN] = {};
    unsigned short loc = args->data_loc_msg & 0xFFFF;
    bpf_probe_read_kernel(head, sizeof(head), (void *)args + loc);
    int pass = PREFIX_MATCHES(PREFIX_0);
#ifdef PREFIX_1
    pass |= PREFIX_MATCHES(PREFIX_1);
#endif
#ifdef PREFIX_2
    pass |= PREFIX_MATCHES(PREFIX_2);
#endif
#ifdef PREFIX_3
    pass |= PREFIX_MATCHES(PREFIX_3);
#endif
#ifdef PREFIX_4
    pass |= PREFIX_MATCHES(PREFIX_4);
#endif
#ifdef PREFIX_5
    pass |= PREFIX_MATCHES(PREFIX_5);
#endif
#ifdef PREFIX_6
    pass |= PREFIX_MATCHES(PREFIX_6);
#endif
#ifdef PREFIX_7
    pass |= PREFIX_MATCHES(PREFIX_7);
#endif
#ifdef PREFIX_8
    pass |= PREFIX_MATCHES(PREFIX_8);
#endif
#ifdef PREFIX_9
    pass |= PREFIX_MATCHES(PREFIX_9);
#endif
#ifdef PREFIX_10
    pass |= PREFIX_MATCHES(PREFIX_10);
#endif
#ifdef PREFIX_11
    pass |= PREFIX_MATCHES(PREFIX_11);
#endif
#ifdef PREFIX_12
    pass |= PREFIX_MATCHES(PREFIX_12);
#endif
#ifdef PREFIX_13
    pass |= PREFIX_MATCHES(PREFIX_13);
#endif
#ifdef PREFIX_14
    pass |= PREFIX_MATCHES(PREFIX_14);
#endif
#ifdef PREFIX_15
    pass |= PREFIX_MATCHES(PREFIX_15);
#endif
    if (!pass)
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

// Rank signals: fatal signals (SIGBUS, SIGSEGV, SIGKILL, SIGABRT) generated for the node's
// registered training ranks. User space keeps the `ranks` map in sync with the control
// channel's verified ranks (at most MAX_RANKS); the kernel filters on it, so other processes'
// signals cost nothing. The si_code goes along: it tells a memory failure from a kill -BUS —
// but any process may send *itself* a SIGBUS with BUS_MCEERR_AR (rt_sigqueueinfo to oneself
// is allowed with any si_code), so a memory-failure code also carries the kernel's own record
// of who generated it: the kernel stack at signal_generate (force_sig_mceerr/send_sig_mceerr
// for a real memory failure, the rt_sigqueueinfo syscall for a forged one) and, where the
// kernel has ras:memory_failure_event (HAVE_MF_EVENT=1), when it last handled a memory failure.
#include "events.h"

#ifndef KSTACK_DEPTH
#define KSTACK_DEPTH 24
#endif

BPF_HASH(ranks, u32, u8, MAX_RANKS);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);
BPF_ARRAY(last_memory_failure, u64, 1);  // ktime of the kernel's last memory_failure_event

struct rank_signal {
    u64 ts_ns;
    u32 pid;          // the rank that receives the signal
    u32 sender_pid;
    s32 sig;
    s32 code;         // si_code: SI_USER 0 (kill), SI_TKILL -6, BUS_ADRERR 2, BUS_MCEERR_AR 4 / _AO 5
    s32 result;
    s32 kstack_bytes; // memory-failure codes only: bytes of kstack filled (< 0: the kernel's error)
    u64 memory_failure_ts_ns;  // memory-failure codes only: last_memory_failure (0: none seen)
    u64 kstack[KSTACK_DEPTH];  // kernel return addresses, innermost first
    char comm[16];    // the rank's command name
};

#if HAVE_MF_EVENT
TRACEPOINT_PROBE(ras, memory_failure_event) {
    u32 zero = 0;
    u64 now = bpf_ktime_get_ns();
    last_memory_failure.update(&zero, &now);
    return 0;
}
#endif

TRACEPOINT_PROBE(signal, signal_generate) {
    int sig = args->sig;
    if (sig != 7 && sig != 11 && sig != 9 && sig != 6)   // SIGBUS SIGSEGV SIGKILL SIGABRT
        return 0;
    u32 pid = args->pid;
    if (!ranks.lookup(&pid))
        return 0;
    struct rank_signal *e = events.ringbuf_reserve(sizeof(struct rank_signal));
    if (!e) {
        u32 zero = 0;
        u64 *l = lost.lookup(&zero);
        if (l) __sync_fetch_and_add(l, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->pid = pid;
    e->sender_pid = bpf_get_current_pid_tgid() >> 32;
    e->sig = sig;
    e->code = args->code;
    e->result = args->result;
    e->kstack_bytes = 0;
    e->memory_failure_ts_ns = 0;
    if (sig == 7 && (args->code == 4 || args->code == 5)) {
        e->kstack_bytes = bpf_get_stack(args, e->kstack, sizeof(e->kstack), 0);
        u32 zero = 0;
        u64 *mf = last_memory_failure.lookup(&zero);
        if (mf) e->memory_failure_ts_ns = *mf;
    }
    bpf_probe_read_kernel(e->comm, sizeof(e->comm), args->comm);
    events.ringbuf_submit(e, 0);
    return 0;
}

// Rank signals: fatal signals (SIGBUS, SIGSEGV, SIGKILL, SIGABRT) generated for the node's
// registered training ranks. User space keeps the `ranks` map in sync with the control
// channel's verified ranks (at most MAX_RANKS); the kernel filters on it, so other processes'
// signals cost nothing. The si_code goes along: it alone tells a memory failure from a kill -BUS.
#include "events.h"

BPF_HASH(ranks, u32, u8, MAX_RANKS);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);

struct rank_signal {
    u64 ts_ns;
    u32 pid;          // the rank that receives the signal
    u32 sender_pid;
    s32 sig;
    s32 code;         // si_code: SI_USER 0 (kill), SI_TKILL -6, BUS_ADRERR 2, BUS_MCEERR_AR 4 / _AO 5 (kernel only)
    s32 result;
    char comm[16];    // the rank's command name
};

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
    bpf_probe_read_kernel(e->comm, sizeof(e->comm), args->comm);
    events.ringbuf_submit(e, 0);
    return 0;
}

"""Fatal signals to the node's training ranks, seen in the kernel (``signal:signal_generate``)
the moment they are generated — not at torchrun's next monitor tick. The ranks are the pids
with a socket in the control channel's ``ranks/`` directory; the BPF map of watched pids is kept
in sync on every drain.

    python -m sentinel.sources.rank_signals -v --pid 1234
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

from sentinel.readings import KernelEvent
from sentinel.sources.ebpf import RingProbe
from sentinel.sources.kernel import KernelSource, run_alone

log = logging.getLogger("sentinel.rank_signals")
SIGNALS = {7: "SIGBUS", 11: "SIGSEGV", 9: "SIGKILL", 6: "SIGABRT"}


class RankSignalSource(KernelSource):
    name = "rank_signals"

    def __init__(self, ranks_dir: Path | None = None, *, max_ranks: int = 1024) -> None:
        super().__init__()
        self.ranks_dir = ranks_dir
        self.max_ranks = max_ranks
        self.probe: RingProbe | None = None
        self.watched: set[int] = set()
        self.extra: set[int] = set()

    def start(self) -> None:
        self.probe = self.load_probe("ebpf_rank_signals", RingProbe(
            "rank_signals", "rank_signals.bpf.c", ("signal", "signal_generate"),
            cflags={"MAX_RANKS": self.max_ranks, "RINGBUF_PAGES": 16}, on_event=self._on_event))
        self.sync()

    def watch(self, pid: int) -> None:
        self.extra.add(pid)
        self.sync()

    def current_ranks(self) -> set[int]:
        pids = set(self.extra)
        if self.ranks_dir is not None:
            try:
                pids |= {int(n.split(".")[0]) for n in os.listdir(self.ranks_dir) if n.split(".")[0].isdigit()}
            except OSError:
                pass
        return pids

    def sync(self) -> None:
        if self.probe is None:
            return
        want = self.current_ranks()
        table = self.probe.table("ranks")
        for pid in want - self.watched:
            table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        for pid in self.watched - want:
            try:
                del table[ctypes.c_uint32(pid)]
            except KeyError:
                pass
        self.watched = want

    def _on_event(self, e) -> None:
        sig = SIGNALS.get(e.sig, str(e.sig))
        self.counts[("sentinel_kernel_events", (("source", "ebpf_rank_signals"), ("kind", sig)))] += 1
        self.push(event=KernelEvent(kind="rank_signal", source="ebpf_rank_signals",
                                    detail={"pid": e.pid, "signal": sig, "sender_pid": e.sender_pid,
                                            "comm": bytes(e.comm).split(b"\0", 1)[0].decode("utf-8", "replace"),
                                            "ts_ns": e.ts_ns}))

    def drain(self):
        self.sync()
        return super().drain()



def main(argv: list[str] | None = None) -> int:
    def make(a):
        src = RankSignalSource(a.ranks_dir)
        src.extra.update(a.pid)
        return src

    def add(ap):
        ap.add_argument("--pid", type=int, action="append", default=[], help="watch this pid (repeatable)")
        ap.add_argument("--ranks-dir", type=Path, help="watch the ranks of this runtime directory")

    return run_alone("python -m sentinel.sources.rank_signals", make,
                     lambda e: f"{e.detail['signal']} -> pid {e.detail['pid']} ({e.detail['comm']}) from pid {e.detail['sender_pid']}",
                     add, argv)


if __name__ == "__main__":
    sys.exit(main())

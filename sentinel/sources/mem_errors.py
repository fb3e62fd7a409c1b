"""Host memory-controller errors (EDAC) through ``ras:mc_event``.

    python -m sentinel.sources.mem_errors -v
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from sentinel.readings import KernelEvent
from sentinel.sources.ebpf import EbpfUnavailable, RingProbe
from sentinel.sources.kernel import KernelSource

log = logging.getLogger("sentinel.mem_errors")
TYPES = {0: "corrected", 1: "uncorrected", 2: "deferred", 3: "fatal", 4: "info"}


class MemErrorSource(KernelSource):
    name = "mem_errors"

    def __init__(self) -> None:
        super().__init__()
        self.probe: RingProbe | None = None

    def start(self) -> None:
        self.probe = RingProbe("mem_errors", "mem_errors.bpf.c", ("ras", "mc_event"),
                               cflags={"RINGBUF_PAGES": 16}, on_event=self._on_event)
        try:
            self.probe.start()
            self.up = {"ebpf_mem_errors": True}
        except EbpfUnavailable as exc:
            self.probe = None
            self.up = {"ebpf_mem_errors": False}
            self.detail["ebpf_mem_errors"] = str(exc)
            log.warning("memory-controller probe unavailable: %s", exc)

    def _on_event(self, e) -> None:
        kind = TYPES.get(e.error_type, str(e.error_type))
        self.counts[("sentinel_host_memory_errors", (("type", kind),))] += int(e.error_count) or 1
        self.push(event=KernelEvent(kind="mc_error", source="ebpf_mem_errors",
                                    detail={"type": kind, "count": int(e.error_count), "mc": int(e.mc_index)}))

    def counters(self):
        out = super().counters()
        if self.probe is not None:
            out[("sentinel_ebpf_events_lost", (("probe", "mem_errors"),))] = float(self.probe.lost())
        return out

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel.sources.mem_errors")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--seconds", type=float, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    src = MemErrorSource()
    src.start()
    print(f"mem_errors: up={src.up} {src.detail}", flush=True)
    end = time.time() + args.seconds if args.seconds else float("inf")
    try:
        while time.time() < end:
            for e in src.drain()[1]:
                print(f"memory controller {e.detail['mc']}: {e.detail['count']} {e.detail['type']}", flush=True)
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        src.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

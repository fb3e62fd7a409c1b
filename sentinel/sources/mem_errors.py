"""Host memory-controller errors (EDAC) through ``ras:mc_event``.

    python -m sentinel.sources.mem_errors -v
"""

from __future__ import annotations

import logging
import sys

from sentinel.readings import KernelEvent
from sentinel.sources.ebpf import RingProbe
from sentinel.families import counter
from sentinel.sources.kernel import KernelSource, run_alone

log = logging.getLogger("sentinel.mem_errors")
TYPES = {0: "corrected", 1: "uncorrected", 2: "deferred", 3: "fatal", 4: "info"}


HOST_MEMORY_ERRORS = counter("sentinel_host_memory_errors",
                             "Host memory errors the memory controllers reported (ras:mc_event), by type", "type")


class MemErrorSource(KernelSource):
    name = "mem_errors"
    FAMILIES = KernelSource.FAMILIES + (HOST_MEMORY_ERRORS,)

    def __init__(self) -> None:
        super().__init__()
        self.probe: RingProbe | None = None

    def start(self) -> None:
        self.probe = self.load_probe("ebpf_mem_errors", RingProbe(
            "mem_errors", "mem_errors.bpf.c", ("ras", "mc_event"), cflags={"RINGBUF_PAGES": 16}, on_event=self._on_event))

    def _on_event(self, e) -> None:
        kind = TYPES.get(e.error_type, str(e.error_type))
        self.counts[HOST_MEMORY_ERRORS.key(type=kind)] += int(e.error_count) or 1
        self.push(event=KernelEvent(kind="mc_error", source="ebpf_mem_errors",
                                    detail={"type": kind, "count": int(e.error_count), "mc": int(e.mc_index)}))



def main(argv: list[str] | None = None) -> int:
    return run_alone("python -m sentinel.sources.mem_errors", lambda a: MemErrorSource(),
                     lambda e: f"memory controller {e.detail['mc']}: {e.detail['count']} {e.detail['type']}", argv=argv)


if __name__ == "__main__":
    sys.exit(main())

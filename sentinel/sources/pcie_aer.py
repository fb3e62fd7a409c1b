"""PCIe Advanced Error Reporting: ``ras:aer_event`` through eBPF when the tracepoint exists (real
nodes), else the sysfs counters ``/sys/bus/pci/devices/<dev>/aer_dev_{correctable,nonfatal,fatal}``
read at each drain. Both are mapped to GPUs by PCI bus id. Either one covers the signal
(``sentinel_source_up{source="pcie_aer",via="ebpf"|"sysfs"} 1``): a kernel without the tracepoint
whose sysfs counters are there is not blind.

    python -m sentinel.sources.pcie_aer -v
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from sentinel.readings import KernelEvent
from sentinel.sources.ebpf import RingProbe
from sentinel.families import counter
from sentinel.sources.kernel import KernelSource, run_alone

log = logging.getLogger("sentinel.pcie_aer")
SEVERITY = {0: "nonfatal", 1: "fatal", 2: "correctable"}


def read_sysfs_aer(root: Path, bus_id: str) -> dict[str, int]:
    """TOTAL_ERR_* lines of the aer_dev_* files of one device; {} when the device has none."""
    out = {}
    for kind in ("correctable", "nonfatal", "fatal"):
        try:
            text = (root / bus_id / f"aer_dev_{kind}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("TOTAL_ERR") and value.isdigit():
                out[kind] = int(value)
    return out


PCIE_AER_ERRORS = counter("sentinel_pcie_aer_errors",
                          "PCIe AER errors by device and severity", "device", "severity")


class PcieAerSource(KernelSource):
    name = "pcie_aer"
    FAMILIES = KernelSource.FAMILIES + (PCIE_AER_ERRORS,)

    def __init__(self, *, use_ebpf: bool = True, sysfs_root: Path = Path("/sys/bus/pci/devices")) -> None:
        super().__init__()
        self.use_ebpf = use_ebpf
        self.sysfs_root = sysfs_root
        self.probe: RingProbe | None = None
        self.last: dict[tuple[str, str], int] = {}

    def start(self) -> None:
        self.up = {"ebpf_pcie_aer": False}
        if self.use_ebpf:
            self.probe = self.load_probe("ebpf_pcie_aer", RingProbe(
                "pcie_aer", "pcie_aer.bpf.c", ("ras", "aer_event"), cflags={"RINGBUF_PAGES": 16}, on_event=self._on_event))
            if self.probe is not None:
                return
        # fallback: the aer_dev_* counters; the signal stays covered (source_up{via="sysfs"} 1)
        self.up["sysfs_aer"] = self.sysfs_root.is_dir()
        if not self.up["sysfs_aer"]:
            self.detail["sysfs_aer"] = f"{self.sysfs_root} is not a directory"

    def _on_event(self, e) -> None:
        dev = bytes(e.dev_name).split(b"\0", 1)[0].decode("utf-8", "replace")
        sev = SEVERITY.get(e.severity, str(e.severity))
        self._count(dev, sev, 1)

    def _count(self, dev: str, severity: str, n: int) -> None:
        gpu = self.bus_to_gpu.get(dev)
        self.counts[PCIE_AER_ERRORS.key(device=dev, severity=severity)] += n
        self.push(event=KernelEvent(kind="aer", source="pcie_aer", gpu=gpu,
                                    detail={"device": dev, "severity": severity, "count": n}))

    def drain(self):
        if self.probe is None and self.up.get("sysfs_aer"):
            for bus in self.bus_to_gpu:
                for kind, total in read_sysfs_aer(self.sysfs_root, bus).items():
                    prev = self.last.get((bus, kind))
                    self.last[(bus, kind)] = total
                    if prev is not None and total > prev:
                        self._count(bus, kind, total - prev)
        return super().drain()



def main(argv: list[str] | None = None) -> int:
    return run_alone("python -m sentinel.sources.pcie_aer", lambda a: PcieAerSource(),
                     lambda e: f"AER {e.detail['severity']} on {e.detail['device']} (+{e.detail['count']})", argv=argv)


if __name__ == "__main__":
    sys.exit(main())

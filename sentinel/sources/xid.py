"""Kernel-log source: the eBPF probe ``ebpf/xid.bpf.c`` (printk:console, filtered in the kernel on
the prefixes of the signature catalog, ``sentinel/signatures.toml``), or — when bcc is missing,
the kernel too old or privileges lacking — a /dev/kmsg reader. One classifier
(:mod:`sentinel.signatures`, with :mod:`sentinel.sources.xidparse` for the Xid details) for both.

An Xid becomes an :class:`~sentinel.readings.XidEvent` (the ``xid`` rule and NVML's own Xid events
are de-duplicated by the policy). Any other catalog match becomes a ``KernelEvent(kind="kernel_log")``
for the GPU whose bus id (or upstream PCIe port, :func:`sentinel.pci.port_map`) the message names,
or for the node when it names none; every match is counted as
``sentinel_kernel_events_total{source,kind}`` with the catalog's kind. The loss of the eBPF path is logged once; the signal
shows as ``sentinel_source_up{source="xid",via="kmsg"} 1`` while the fallback reads, and as down
(``via="none"``) only when neither path works. The daemon never fails to start over it.

    python -m sentinel.sources.xid -v      # run alone: print each Xid as it is seen
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from pathlib import Path

from sentinel import signatures
from sentinel.pci import port_map
from sentinel.readings import KernelEvent, XidEvent
from sentinel.records import LiveRecords
from sentinel.sources.ebpf import EbpfUnavailable, RingProbe, tracepoint_exists
from sentinel.families import counter
from sentinel.sources.kernel import KERNEL_EVENTS, KernelSource, run_alone
from sentinel.sources.kmsg import KmsgReader, KmsgUnavailable
from sentinel.sources import xidparse

log = logging.getLogger("sentinel.xid")

MSG_LEN = 256
MAX_BPF_PREFIXES = 16  # PREFIX_0..PREFIX_15 in ebpf/xid.bpf.c


def prefix_cflags(prefixes: tuple[str, ...]) -> dict[str, str]:
    """``{"PREFIX_0": '"NVRM: "', ...}``: the catalog's prefixes as C string literals for -D cflags.
    The catalog refuses quotes, backslashes and unprintable characters in a prefix."""
    if not prefixes or len(prefixes) > MAX_BPF_PREFIXES:
        raise ValueError(f"the eBPF filter takes 1 to {MAX_BPF_PREFIXES} prefixes, not {len(prefixes)}")
    return {f"PREFIX_{i}": f'"{p}"' for i, p in enumerate(prefixes)}


KMSG_MALFORMED_LINES = counter("sentinel_kmsg_malformed_lines",
                               "Kernel log lines that looked like Xid reports but did not parse", "source")
KMSG_RECORDS_LOST = counter("sentinel_kmsg_records_lost",
                            "Kernel log records overwritten before the /dev/kmsg fallback read them (gaps in their sequence numbers)")


class XidSource(KernelSource):
    name = "xid"
    FAMILIES = KernelSource.FAMILIES + (KERNEL_EVENTS, KMSG_MALFORMED_LINES, KMSG_RECORDS_LOST)

    def __init__(self, *, use_ebpf: bool = True, kmsg_fallback: bool = True, kmsg_path: str = "/dev/kmsg",
                 kmsg_read: Callable[[int, int], bytes] = os.read, catalog: signatures.Catalog | None = None,
                 pci_devices: Path = Path("/sys/bus/pci/devices")) -> None:
        super().__init__()
        self.catalog = catalog or signatures.default_catalog()
        self._records: dict[str, LiveRecords] = {}  # per path: a message printed in parts, joined as it comes
        self.pci_devices = pci_devices
        self.port_to_gpu: dict[str, int] = {}
        self.use_ebpf = use_ebpf
        self.kmsg_fallback = kmsg_fallback
        self.kmsg_path = kmsg_path
        self.kmsg_read = kmsg_read
        self.probe: RingProbe | None = None
        self.kmsg: KmsgReader | None = None
        self.path = "none"
        self._keys: dict[tuple[str, str], Any] = {}
        # no signature but the Xid one claims a line that starts like an Xid: such lines go straight
        # to the Xid parser (an Xid storm is a thousand a second)
        self._xid_first = not any(p.startswith("NVRM: Xid") for sig in self.catalog.signatures if sig.kind != "xid"
                                  for p in sig.prefixes)

    def start(self) -> None:
        self.up = {"ebpf_xid": False}
        if self.use_ebpf:
            # The driver's own tracepoint when it has one, else its printk twin, filtered in the kernel.
            # Xids from the driver's own tracepoint when it has one; every other signature (and the
            # Xids otherwise) from printk:console, filtered in the kernel on the catalog's prefixes.
            errors = []
            driver_tp = tracepoint_exists("nvidia", "nvidia_dev_xid")
            if driver_tp:
                try:
                    probe = RingProbe("xid_tracepoint", "xid_tracepoint.bpf.c", ("nvidia", "nvidia_dev_xid"),
                                      cflags={"MSG_LEN": MSG_LEN, "RINGBUF_PAGES": 64}, on_event=self._on_driver_tracepoint)
                    probe.start()
                    self.probes.append(probe)
                except EbpfUnavailable as exc:
                    errors.append(str(exc))
                    driver_tp = False
            try:
                cflags = {"MSG_LEN": MSG_LEN, "RINGBUF_PAGES": 64,
                          **prefix_cflags(self.catalog.prefixes(without_xid=driver_tp))}
                probe = RingProbe("xid", "xid.bpf.c", ("printk", "console"), cflags=cflags, on_event=self._on_bpf)
                probe.start()
            except (EbpfUnavailable, ValueError) as exc:
                errors.append(str(exc))
                for loaded in self.probes:
                    loaded.close()
                self.probes = []
            else:
                self.probe = probe
                self.probes.append(probe)
                self.up["ebpf_xid"] = True
                self.path = "ebpf:printk:console" + (" + nvidia:nvidia_dev_xid" if driver_tp else "")
                return
            self.detail["ebpf_xid"] = "; ".join(errors)
            log.warning("eBPF Xid probe unavailable, falling back to /dev/kmsg: %s", self.detail["ebpf_xid"])
        else:
            self.detail["ebpf_xid"] = "disabled in config"
        if self.kmsg_fallback:
            self.kmsg = KmsgReader(self._on_line, path=self.kmsg_path, read=self.kmsg_read)
            try:
                self.kmsg.start()
                self.up["kmsg"] = True
                self.path = "kmsg"
            except KmsgUnavailable as exc:
                self.kmsg = None
                self.up["kmsg"] = False
                self.detail["kmsg"] = str(exc)
                log.warning("no kernel Xid source at all: %s", exc)

    def _on_driver_tracepoint(self, event) -> None:
        """nvidia:nvidia_dev_xid carries (dev, error_code, msg): rebuild the driver's own line so
        one parser serves every path. The line is built here, so it starts with the marker by
        construction; ``dev`` must be a bare PCI name, or the line is not built at all."""
        dev = bytes(event.dev).split(b"\0", 1)[0].decode("utf-8", "replace")
        msg = bytes(event.msg).split(b"\0", 1)[0].decode("utf-8", "replace")
        if not xidparse.is_pci_name(dev):
            self.counts[KMSG_MALFORMED_LINES.key(source="ebpf_xid")] += 1
            return
        self._on_line(f"{xidparse.XID_MARKER}PCI:{dev}): {int(event.error_code)}, {msg}", "ebpf_xid")

    def _on_bpf(self, event) -> None:
        self._on_line(bytes(event.msg).split(b"\0", 1)[0].decode("utf-8", "replace"), "ebpf_xid")

    def set_gpus(self, bus_to_gpu: dict[str, int]) -> None:
        super().set_gpus(bus_to_gpu)
        self.port_to_gpu = port_map(self.bus_to_gpu, self.pci_devices)

    def gpu_of(self, match: signatures.Match) -> int | None:
        """The GPU a message is about: the device it names or, for a PCIe port, the one GPU below it."""
        for bus in (match.source_bus_id, match.pci_bus_id):
            if bus is not None and bus in self.bus_to_gpu:
                return self.bus_to_gpu[bus]
        for bus in (match.source_bus_id, match.pci_bus_id):
            if bus is not None and bus in self.port_to_gpu:
                return self.port_to_gpu[bus]
        return None

    def _event_key(self, source: str, kind: str):
        """The kernel-events sample key (made once per source and kind: a storm counts thousands a second)."""
        key = self._keys.get((source, kind))
        if key is None:
            key = self._keys[(source, kind)] = KERNEL_EVENTS.key(source=source, kind=kind)
        return key

    def _on_line(self, text: str, source: str = "kmsg") -> None:
        """One kernel message text (no record header, no timestamp). A report counts only at the
        start of the text: anywhere else it is user text the kernel echoed, and is ignored."""
        self.counts[self._event_key(source, "line")] += 1
        if isinstance(text, str):  # a message the driver prints in parts is classified joined, at its last part
            text = self._records.setdefault(source, LiveRecords(self.catalog)).record(text)
            if self._xid_first and text.lstrip().startswith(xidparse.XID_MARKER):
                self._on_xid_text(text, source)  # where classify would send it too, without trying the catalog
                return
        match = self.catalog.classify(text)
        if match is None or match.kind == "xid":
            self._on_xid_text(text, source)
            return
        self.counts[self._event_key(source, match.kind)] += 1
        gpu = self.gpu_of(match)
        self.push(event=KernelEvent(kind="kernel_log", source=source, gpu=gpu, detail={
            "signature": match.signature, "kind": match.kind, "severity": match.severity, "action": match.action,
            "device": match.source_bus_id or match.pci_bus_id or "", "message": match.message,
            **({"count": match.count} if match.count is not None else {})}))

    def _on_xid_text(self, text: str, source: str) -> None:
        if "NVRM: Xid" not in text:
            return
        report = xidparse.parse_message(text)
        if report is None:
            if text.lstrip().startswith("NVRM: Xid"):
                self.counts[KMSG_MALFORMED_LINES.key(source=source)] += 1
            else:
                self.counts[KERNEL_EVENTS.key(source=source, kind="xid_not_at_start")] += 1
            return
        self.counts[self._event_key(source, "xid")] += 1
        gpu = self.bus_to_gpu.get(report.pci_bus_id)
        self.push(XidEvent(gpu=gpu, xid=report.xid, source=source, pci_bus_id=report.pci_bus_id,
                           pid=report.pid, process=report.process, message=report.message))

    def counters(self):
        out = super().counters()
        if self.kmsg is not None:  # exact: counted from the gaps in the records' sequence numbers
            out[KMSG_RECORDS_LOST.key()] = float(self.kmsg.lost)
        return out

    def close(self) -> None:
        super().close()
        if self.kmsg is not None:
            self.kmsg.close()


def main(argv: list[str] | None = None) -> int:
    return run_alone(
        "python -m sentinel.sources.xid",
        lambda a: XidSource(use_ebpf=not a.no_ebpf),
        lambda x: (f"Xid {x.xid} bus={x.pci_bus_id} pid={x.pid} name={x.process} via {x.source}: {x.message}"
                   if isinstance(x, XidEvent) else
                   f"{x.detail['kind']} ({x.detail['severity']}, {x.detail['action']}) gpu={x.gpu} via {x.source}: "
                   f"{x.detail['message']}"),
        lambda ap: ap.add_argument("--no-ebpf", action="store_true", help="read /dev/kmsg instead"),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())

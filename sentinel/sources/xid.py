"""Xid source: the eBPF probe ``ebpf/xid.bpf.c`` (printk:console, filtered in the kernel), or —
when bcc is missing, the kernel too old or privileges lacking — a /dev/kmsg reader. One parser
(:mod:`sentinel.sources.xidparse`) for both. The loss of the eBPF path is logged once and shows
as ``sentinel_source_up{source="ebpf_xid"} 0``; the daemon never fails to start over it.

    python -m sentinel.sources.xid -v      # run alone: print each Xid as it is seen
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from sentinel.readings import XidEvent
from sentinel.sources.ebpf import EbpfUnavailable, RingProbe, tracepoint_exists
from sentinel.sources.kernel import KernelSource
from sentinel.sources.kmsg import KmsgReader, KmsgUnavailable
from sentinel.sources import xidparse

log = logging.getLogger("sentinel.xid")

MSG_LEN = 256


class XidSource(KernelSource):
    name = "xid"

    def __init__(self, *, use_ebpf: bool = True, kmsg_fallback: bool = True, kmsg_path: str = "/dev/kmsg") -> None:
        super().__init__()
        self.use_ebpf = use_ebpf
        self.kmsg_fallback = kmsg_fallback
        self.kmsg_path = kmsg_path
        self.probe: RingProbe | None = None
        self.kmsg: KmsgReader | None = None
        self.path = "none"

    def start(self) -> None:
        self.up = {"ebpf_xid": False}
        if self.use_ebpf:
            if tracepoint_exists("nvidia", "nvidia_dev_xid"):
                log.info("the driver's nvidia:nvidia_dev_xid tracepoint exists; reading its printk twin, which carries "
                         "the same report in the driver's own words")
            try:
                self.probe = RingProbe("xid", "xid.bpf.c", ("printk", "console"),
                                       cflags={"MSG_LEN": MSG_LEN, "RINGBUF_PAGES": 64}, on_event=self._on_bpf)
                self.probe.start()
                self.up["ebpf_xid"] = True
                self.path = "ebpf"
                return
            except EbpfUnavailable as exc:
                self.probe = None
                self.detail["ebpf_xid"] = str(exc)
                log.warning("eBPF Xid probe unavailable, falling back to /dev/kmsg: %s", exc)
        else:
            self.detail["ebpf_xid"] = "disabled in config"
        if self.kmsg_fallback:
            self.kmsg = KmsgReader(self._on_line, path=self.kmsg_path)
            try:
                self.kmsg.start()
                self.up["kmsg"] = True
                self.path = "kmsg"
            except KmsgUnavailable as exc:
                self.kmsg = None
                self.up["kmsg"] = False
                self.detail["kmsg"] = str(exc)
                log.warning("no kernel Xid source at all: %s", exc)

    def _on_bpf(self, event) -> None:
        self._on_line(bytes(event.msg).split(b"\0", 1)[0].decode("utf-8", "replace"), "ebpf_xid")

    def _on_line(self, line: str, source: str = "kmsg") -> None:
        self.counts[("sentinel_kernel_events", (("source", source), ("kind", "line")))] += 1
        if "NVRM: Xid" not in line:
            return
        report = xidparse.parse(line)
        if report is None:
            self.counts[("sentinel_kmsg_malformed_lines", (("source", source),))] += 1
            return
        self.counts[("sentinel_kernel_events", (("source", source), ("kind", "xid")))] += 1
        gpu = self.bus_to_gpu.get(report.pci_bus_id)
        self.push(XidEvent(gpu=gpu, xid=report.xid, source=source, pci_bus_id=report.pci_bus_id,
                           pid=report.pid, process=report.process, message=report.message))

    def counters(self):
        out = super().counters()
        if self.probe is not None:
            out[("sentinel_ebpf_events_lost", (("probe", "xid"),))] = float(self.probe.lost())
        if self.kmsg is not None:
            out[("sentinel_kmsg_records_lost", ())] = float(self.kmsg.lost)
        return out

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        if self.kmsg is not None:
            self.kmsg.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel.sources.xid")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--no-ebpf", action="store_true")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: until Ctrl-C)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    src = XidSource(use_ebpf=not args.no_ebpf)
    src.start()
    print(f"xid source: {src.path} ({src.detail})", flush=True)
    end = time.time() + args.seconds if args.seconds else float("inf")
    try:
        while time.time() < end:
            xids, _ = src.drain()
            for x in xids:
                print(f"Xid {x.xid} bus={x.pci_bus_id} pid={x.pid} name={x.process} via {x.source}: {x.message}", flush=True)
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        src.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

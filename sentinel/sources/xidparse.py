"""One parser for NVIDIA Xid reports, from eBPF (printk:console) and /dev/kmsg alike.

Accepted, after any of these prefixes: ``[12345.678901]`` (dmesg), ``[Mon Nov 30 05:02:27 2026]``
(``dmesg -T``), ``Nov 30 05:02:27 host kernel:`` (syslog), ``2026-11-30T05:02:27.123456+00:00 host
kernel:`` (journal ISO), ``<4>`` / ``4,1234,5678,-;`` (kmsg record headers)::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
    NVRM: Xid (PCI:0001:c1:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception ...
    NVRM: Xid (0000:01:00): 13, 0000 00000000 ...            (older drivers: no "PCI:")

:func:`parse` never raises: anything else returns None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\): "
    r"(?P<xid>\d{1,5})(?:,\s*(?P<rest>.*))?$"
)
_PID = re.compile(r"^pid=(?:'?(?P<pid>\d+|<unknown>)'?)(?:,\s*|$)")
_NAME = re.compile(r"^name=(?P<name>[^,]*)(?:,\s*|$)")


@dataclass(frozen=True)
class XidReport:
    pci_bus_id: str  # normalised 0000:3b:00.0
    xid: int
    pid: int | None = None
    process: str = ""
    message: str = ""


def normalize_bus(bus: str) -> str:
    parts = bus.lower().split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    domain, b, devfn = parts
    domain = domain[-4:].rjust(4, "0")
    if "." not in devfn:
        devfn += ".0"
    return f"{domain}:{b}:{devfn}"


def parse(line: str) -> XidReport | None:
    """The Xid report in one kernel-log line, or None. Never raises."""
    if not isinstance(line, str):
        return None
    idx = line.find("NVRM: Xid (")
    if idx < 0:
        return None
    m = _XID.match(line.strip()[line.strip().find("NVRM: Xid ("):])
    if not m:
        return None
    try:
        xid = int(m.group("xid"))
        bus = normalize_bus(m.group("bus"))
    except (ValueError, IndexError):
        return None
    rest = (m.group("rest") or "").strip()
    pid: int | None = None
    process = ""
    pm = _PID.match(rest)
    if pm:
        pid = int(pm.group("pid")) if pm.group("pid").isdigit() else None
        rest = rest[pm.end():]
        nm = _NAME.match(rest)
        if nm:
            process = nm.group("name").strip()
            rest = rest[nm.end():]
    message = rest.strip().rstrip(".;,").strip()
    return XidReport(bus, xid, pid, process, message)


def format_line(r: XidReport) -> str:
    """The driver's own format (used by tests and drills to write realistic lines)."""
    bus = r.pci_bus_id[:-2] if r.pci_bus_id.endswith(".0") else r.pci_bus_id
    pid = str(r.pid) if r.pid is not None else "'<unknown>'"
    name = r.process or "<unknown>"
    return f"NVRM: Xid (PCI:{bus}): {r.xid}, pid={pid}, name={name}, {r.message}"

"""One parser for NVIDIA Xid reports, from eBPF (printk:console) and /dev/kmsg alike.

A report is recognised only at the START of the kernel message text. Kernel messages echo user
text (``process 'sh' launched '/tmp/NVRM: Xid (PCI:0000:18:00): 79, ...' with NULL argv``), so
``NVRM: Xid (`` anywhere else in a line is not a report.

:func:`parse_message` takes a bare message text, as the kernel paths deliver it (printk:console,
and /dev/kmsg once its record header is removed): it must begin with ``NVRM: Xid (``.

:func:`parse` takes a log line in any format :func:`sentinel.sources.kmsg.parse_log_line` reads
(dmesg in all its time formats, journalctl -k, syslog, a /dev/kmsg record): one documented prefix,
then the message::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
    NVRM: Xid (PCI:0001:c1:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception ...
    NVRM: Xid (0000:01:00): 13, 0000 00000000 ...            (older drivers: no "PCI:")

Neither function raises: anything else returns None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sentinel.pci import normalize_bus_id
from sentinel.sources.kmsg import message_of

XID_MARKER = "NVRM: Xid ("

_BUS = r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_BUS_ONLY = re.compile(_BUS)
_XID = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<bus>{_BUS})\): "
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


normalize_bus = normalize_bus_id  # the one normaliser (sentinel.pci)


def strip_prefix(line: str) -> str:
    """The message text of one log line: exactly one documented prefix (or none) removed, by the
    one log-format reader (:func:`sentinel.sources.kmsg.message_of`)."""
    return message_of(line)


def parse(line: str) -> XidReport | None:
    """The Xid report in one log line (a documented prefix, then the message), or None. Never raises."""
    if not isinstance(line, str):
        return None
    return parse_message(strip_prefix(line))


def parse_message(text: str) -> XidReport | None:
    """The Xid report in a bare kernel message text, which must begin with ``NVRM: Xid (``
    (surrounding whitespace aside), or None. Never raises."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    if not text.startswith(XID_MARKER):
        return None
    m = _XID.match(text)
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


def is_pci_name(name: str) -> bool:
    """True for a bare PCI device name such as ``0000:3b:00.0`` (what ``pci_name()`` returns)."""
    return isinstance(name, str) and _BUS_ONLY.fullmatch(name) is not None


def format_line(r: XidReport) -> str:
    """The driver's own format (used by tests and drills to write realistic lines)."""
    bus = r.pci_bus_id[:-2] if r.pci_bus_id.endswith(".0") else r.pci_bus_id
    pid = str(r.pid) if r.pid is not None else "'<unknown>'"
    name = r.process or "<unknown>"
    return f"NVRM: Xid (PCI:{bus}): {r.xid}, pid={pid}, name={name}, {r.message}"

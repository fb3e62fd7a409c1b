"""Kernel records from kernel-log text: where one record ends and the next begins, for every path
that reads kernel text (``sentinel scan``, the /dev/kmsg source, the eBPF ``printk:console``
path), so that a record can never swallow another.

The rule, decided per line once its log prefix is off (:func:`sentinel.sources.kmsg.parse_log_line`):

* a line whose message starts a catalog record on its own (:meth:`Catalog.classify` matches it)
  is a record, whatever its prefix or indentation: a bare ``NVRM: Xid ...`` after a prefixed line
  is never taken for that line's continuation;
* a line continues the record before it only when the source format says so: an indented line
  with no prefix of its own (dmesg's and journalctl's continuation lines, a /dev/kmsg record's
  dictionary), or, in a log whose lines carry prefixes, a bare line with no text of its own (no
  kernel-message shape: :func:`kernel_shaped`; a paste or a terminal wrapped the record);
* a record a driver prints in parts (the fallen-off-bus message, one record per line on some
  drivers and logs) is joined when the catalog says so (an entry's ``joins``), whatever the
  prefixes of its parts.

:func:`kernel_shaped` is what a kernel message looks like without a prefix: a subsystem or driver
tag (``NVRM:``, ``pcieport 0000:00:1c.5:``, ``EXT4-fs (sda1):``, ``[drm]``, ``{3}[Hardware Error]:``),
or the kernel's own phrasing (``Linux version``, ``Freeing unused kernel memory``). A file in
which no line has it holds no kernel message (random text, an application's output).
"""

from __future__ import annotations

import re

from sentinel.signatures import Catalog

MAX_LINE = 8192  # bytes: a longer line of a kernel log is malformed (a record is at most 1 KiB of text)
MAX_RECORD = 2048  # a record printed over several lines is at most this long; what follows is not joined
# A subsystem/driver tag: "NVRM:", "ACPI:", "x86/fpu:", "BIOS-e820:", "EXT4-fs (sda1):", "usb 1-1:",
# "pcieport 0000:00:1c.5:", "e1000e 0000:00:19.0 eth0:", "sd 0:0:0:0: [sda]", "nvidia-nvswitch0:",
# "{3}[Hardware Error]:", "[drm] ", "[Firmware Bug]:", "Spectre V2 :" (the kernel's pr_fmt shapes).
_TAG = re.compile(
    r"(?:\{\d{1,6}\})?\[[A-Za-z][\w .-]{0,31}\]:?[ \t]+\S"  # [drm] x, [Hardware Error]: x, [Firmware Bug]: x
    r"|[A-Za-z_][\w.+/-]{0,40}(?:\[\d{1,10}\])?(?: ?\([^()]{1,40}\))?"  # a tag, a pid, (dev)
    r"(?: (?=[\w:./#-]{0,63}[\d:./#-])[\w:./#-]{1,64}){0,2} ?:[ \t]+\S"  # up to two device names (1-1, 0000:00:1c.5, eth0), ": text"
    r"|(?:Linux version|Command line|Kernel command line|Booting|Freeing|Calibrating|Run /|Kernel panic|"
    r"Out of memory|Memory failure|Call Trace|Hardware name|Modules linked in|RIP|Code|Oops|CPU\d{1,5}|"
    r"Critical temperature|critical temperature|Console|Detected|Mount-cache|Built \d|Policy zone|"
    r"Unknown kernel command line|random|audit|clocksource|printk|Initmem|smpboot|devtmpfs|"
    r"Write protecting|Unpacking|Trying to unpack|Key type|Loaded X\.509|Spectre|Speculative|"
    r"Last level|process '|virtio|Serial|loop|tsc|TSC|e820|ftrace|rcu|NET|Segment Routing|"
    r"Initializing|Setting up|Mounting|Mountpoint|Unable|Failed|Bluetooth|IPv6|PM|DMAR|APIC|IOAPIC|MDS|TAA|"
    r"cgroup|hugetlbfs|workingset|zbud|pid_max|LSM|Yama|landlock|SELinux|AppArmor|Dentry|Inode|"
    r"Hierarchical|Zone ranges|Movable zone|Early memory|On node|ACPI|PCI|pci|NUMA|smp|x86|SRAT|"
    r"kvm|Hypervisor|Booting paravirtualized)\b")
_NOT_KERNEL = re.compile(r"[A-Z][a-z]+(?:[A-Z][a-z]+)*(?:Error|Exception|Warning)\b|Traceback \(")


def kernel_shaped(message: str) -> bool:
    """True when a message without a prefix looks like one the kernel prints (module doc)."""
    return _TAG.match(message) is not None and _NOT_KERNEL.match(message) is None


class Joiner:
    """Assembles records from (line number, message, how the line came) in order; :meth:`feed`
    returns the records it completes, :meth:`close` the last one. ``how`` is ``record`` (a
    line with its own prefix, or a bare line that is a record), ``indented`` (a bare line that
    starts with blanks) or ``wrapped`` (a bare line with no kernel-message shape in a prefixed
    log: it can only be a continuation). A ``None`` message ends the record (another program's
    line, an unreadable one) and its continuations are dropped with it."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._line = 0
        self._text: str | None = None
        self._parts = 0
        self._open = False  # the pending record is another program's: its continuations go with it
        self.joined = False  # the last line fed continued a record

    def feed(self, lineno: int, message: str | None, how: str = "record") -> list[tuple[int, str]]:
        """The records this line completes; ``joined`` says whether the line continued one."""
        self.joined = False
        if message is None:  # not a kernel message: it ends the record before it
            done = self._flush()
            self._open = True
            return done
        pending = self._text
        if pending is not None and self._parts < 8 and len(pending) + len(message) < MAX_RECORD:
            if (how != "record" and self.catalog.classify(message) is None) or self.catalog.continues(pending, message):
                self._text = pending + "\n" + message
                self._parts += 1
                self.joined = True
                return []
        elif pending is None and self._open and how != "record" and self.catalog.classify(message) is None:
            self.joined = True  # a continuation of another program's line: dropped with it
            return []
        done = self._flush()
        self._line, self._text, self._parts = lineno, message, 0
        return done

    def close(self) -> list[tuple[int, str]]:
        return self._flush()

    def _flush(self) -> list[tuple[int, str]]:
        text, self._text, self._open = self._text, None, False
        return [] if text is None else [(self._line, text)]


class LiveRecords:
    """The same assembly for paths that hand over whole records one at a time and must act on
    each at once (/dev/kmsg, printk:console): a record is classified as it comes; a record that
    continues a message the driver prints in parts (the catalog's ``joins``) is classified joined
    to the parts before it, so the message is found when its last part arrives, never later."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._head: str | None = None
        self._parts = 0

    def record(self, text: str) -> str:
        """The text to classify for this record: itself, or the split message it completes."""
        head = self._head
        if head is not None and self._parts < 8 and len(head) + len(text) < MAX_RECORD \
                and self.catalog.continues(head, text):
            self._head, self._parts = head + "\n" + text, self._parts + 1
            return self._head
        self._head, self._parts = (text, 0) if self.catalog.opens_split(text) else (None, 0)
        return text

"""/dev/kmsg reader: the Xid fallback when eBPF is unavailable.

Opens /dev/kmsg non-blocking and reads whole records on a thread of its own. Each record is
``<prio>,<seq>,<usec>,<flags>[,...];message`` followed by optional `` KEY=value`` lines; the
message text (newlines escaped by the kernel) goes to ``on_line``.

Loss is counted in records, from the sequence numbers: a record whose seq is more than one past
the previous record's means exactly that many records were overwritten before they were read.
An EPIPE from read() only says that some were; the next record's seq says how many. At start the
records already in the buffer are read and skipped (not handed on), which gives the first seq to
compare with; only records that arrive later reach ``on_line`` (a record logged during that
start-up read, milliseconds, is skipped too, as one logged before start is).

``read`` is injectable (``os.read`` by default) so tests can drive a fake device (a FIFO) that
produces gaps and EPIPEs.

:func:`parse_log_line` is the one reader of kernel-log TEXT formats (what ``sentinel scan`` and the
signature catalog's ``classify_line`` take): it knows the /dev/kmsg record header and every
prefix that dmesg, journalctl and syslog daemons write (listed on :data:`FORMATS` and in
docs/scan.md), and says of each line whether it is a kernel message (and which), another
program's line, journalctl's ``-- ... --`` note, a bare message, or a line it cannot read.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import threading
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("sentinel.kmsg")

READ_SIZE = 8192  # a record is at most 1 KiB of text plus its dictionary; one read returns one record
MAX_SKIPPED_READS = 1 << 20  # bounds the start-up read even if the log is flooded while it runs


class KmsgUnavailable(RuntimeError):
    pass


def split_record(record: bytes) -> tuple[int, str] | None:
    """``(seq, message)`` of one record line (``prio,seq,usec,flags[,...];message``), or None."""
    header, sep, message = record.partition(b";")
    if not sep:
        return None
    fields = header.split(b",")
    if len(fields) < 4 or not fields[1].isdigit():
        return None
    return int(fields[1]), message.decode("utf-8", "replace")


# -- kernel-log text formats ---------------------------------------------------------------------
FORMATS = (
    "bare message (dmesg -t, journalctl -o cat)",
    "dmesg: [   12.345678]; -r <4>[   12.345678]; -T/--time-format=ctime [Tue Dec  1 21:31:52 2026]; "
    "-H/-e/--time-format=reltime [Dec 1 21:31] and [  +0.000123]; -d [   12.345678 <    0.000123>]; "
    "--time-format=delta [<    0.000123>]; --time-format=iso 2026-12-01T21:31:52,254954+00:00; "
    "-x (kern  :warn  : before any of these); --color escapes",
    "journalctl -k -o short, short-precise, short-iso, short-iso-precise, short-full, short-unix, short-monotonic "
    "(and journalctl's '-- ... --' notes)",
    "syslog: 'Dec  1 21:31:52 host kernel:', the day with one or two spaces or a leading 0, with or without the "
    "host, optionally followed by a dmesg timestamp; RFC 3339 times; a bare 'kernel:' prefix",
    "a /dev/kmsg record header 4,1234,5678,-; (its ' KEY=value' lines continue the record)",
    "the printk caller id after any time ([  T291], [    C3]: CONFIG_PRINTK_CALLER); a <N> priority",
    "wrappers around any of these: a bracketed ISO time ([2026-12-01T21:31:52.254954+00:00] or with a space), "
    "containerd/CRI-O log lines (2026-12-01T21:31:52.254954123Z stdout F ...), kubectl logs --timestamps and "
    "--prefix ([pod/name/container] ...), Talos-style remote kernel logs (host: kern:    info: [RFC 3339]: ...)",
)
_MON = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_NUM = r"\s*\d{1,10}\.\d{1,9}"
_DMESG_TS = (rf"\[(?:{_NUM}(?: <{_NUM}>)?"  # default; -d
             rf"|<{_NUM}>"  # --time-format=delta
             rf"|\s*\+{_NUM.removeprefix(chr(92) + 's*')}"  # -H/-e: the delta since the last line
             rf"|{_MON} ?[ \d]?\d(?: \d{{4}})? \d\d:\d\d(?::\d\d)?"  # -H/-e: the minute
             rf"|{_DAY} {_MON} [ \d]\d \d\d:\d\d:\d\d \d{{4}})\]")  # -T, --time-format=ctime
_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?"
_LOCAL_MON = r"[^\W\d_]{3,4}\.?"  # a month in the journal's locale (фев, jan., Mär)
_SYSLOG_TIME = (rf"(?:(?:{_MON}|{_LOCAL_MON}) {{1,2}}\d{{1,2}} \d\d:\d\d:\d\d(?:\.\d{{1,9}})?"  # syslog, journal short(-precise)
                rf"|{_ISO}"  # RFC 3339, journal short-iso(-precise)
                rf"|{_DAY} \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{{1,9}})? [A-Za-z][\w+-]{{0,31}}"  # short-full
                r"|\d{9,11}\.\d{1,9})")  # short-unix
_LEVELS = r"(?:emerg|alert|crit|err|warn|notice|info|debug)"
_FACILITIES = ("kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv", "ftp",
               "res0", "res1", "res2", "res3", "local0", "local1", "local2", "local3", "local4", "local5", "local6",
               "local7")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_KMSG_HEADER = re.compile(r"(?P<prio>\d{1,3}),\d{1,20},\d{1,20},[^;\s]*;")
_RAW = re.compile(rf"<(?P<prio>\d{{1,3}})>\s*(?:{_DMESG_TS}\s?)?")
_DECODE = re.compile(rf"(?P<facility>[a-z][a-z0-9]{{2,7}})\s*:\s*{_LEVELS}\s*:\s?(?:(?:{_DMESG_TS}|{_ISO})\s?)?")
_DMESG = re.compile(rf"(?:{_DMESG_TS}|{_ISO})(?:\[\s{{0,8}}[TC]\d{{1,7}}\])?(?: |$)")  # the caller id may follow
_SYSLOG = re.compile(rf"{_SYSLOG_TIME} ")
_MONOTONIC_JOURNAL = re.compile(rf"\[{_NUM}\] \S+ kernel: ")
_KERNEL_TAG = re.compile(r"kernel(?:\[\d{1,10}\])?:(?: |$|(?=\[))")
_OTHER_TAG = re.compile(r"(?:\S+ )?[^\s:\[\]]+(?:\[\d{1,10}\])?:(?: |$)")
_SYSLOG_KERNEL_TS = re.compile(rf"{_DMESG_TS}\s?")
_META = re.compile(r"-- .{1,200} --$")
_CALLER = re.compile(r"\[\s{0,8}[TC]\d{1,7}\]\s?")  # CONFIG_PRINTK_CALLER: [  T291] (a task) or [    C3] (a CPU)
_ISO_ANY = _ISO.replace("T", "[T ]", 1)
# Lines another program wraps around a kernel-log line: what follows is read again (at most twice).
_WRAPPERS = (
    re.compile(rf"\[{_ISO_ANY}\]\s?"),  # a collector's bracketed time before the dmesg one
    re.compile(rf"{_ISO} (?:stdout|stderr) [FP] "),  # containerd / CRI-O container log
    re.compile(r"\[(?:pod|deployment|daemonset|job)/[^\]\s]{1,253}\] "),  # kubectl logs --prefix
    re.compile(r"\[kernel\] "),  # a log viewer's source tag
    re.compile(r"(?:> ?){1,4}"),  # a mail or forum quote of a log
)
_KUBECTL_TS = re.compile(rf"{_ISO} (?=\[|<\d{{1,3}}>|\d{{1,3}},\d{{1,20}},|kern\s*:|{_MON} )")  # --timestamps
_TALOS = re.compile(rf"\S{{1,253}}: (?P<facility>[a-z][a-z0-9]{{2,7}}):\s{{0,8}}{_LEVELS}[a-z]{{0,3}}: \[{_ISO}\]: ")
# What a line that carries no known prefix may still start with when it is a log prefix this
# reader does not know (a timestamp, a priority, a facility, a journal field): such a line is
# unreadable, never taken for a bare message.
_LOOKS_PREFIXED = re.compile(
    rf"(?:\[\s*[\d+<]|\[{_DAY}\b|\[{_MON}\b|<\d|\d{{4}}-\d\d-\d\d|\d{{9,}}(?:\.\d+)?\s|\d{{1,3}},\d+,\d+,"
    rf"|(?:{_DAY}|{_MON})\b|[a-z0-9]{{2,8}}\s*[:.]\s*{_LEVELS}\b|[A-Z_][A-Z0-9_]{{1,63}}=|\{{\s*\")")


@dataclass(frozen=True)
class LogLine:
    """One line of a kernel-log text, read.

    ``kind``: ``kernel`` (a kernel message, behind a prefix), ``bare`` (no prefix: a message as
    ``dmesg -t`` prints it), ``other`` (another program's syslog/journal line, or a record
    user space wrote to /dev/kmsg: its facility is not kern), ``meta`` (journalctl's ``-- ... --``),
    ``blank``. ``message`` is the message text (kernel, bare) or ""."""

    kind: str
    message: str = ""


def _facility_is_kernel(prio: str) -> bool:
    return int(prio) >> 3 == 0  # user space cannot write facility 0 (kern) to /dev/kmsg


def parse_log_line(line: str) -> LogLine | None:
    """Read one line of a kernel log in any format of :data:`FORMATS`; None when the line starts
    like a log prefix this reader does not know (it cannot be read, so nothing can be said about
    it). Never raises."""
    text = line.strip()
    if "\x1b" in text:
        text = _ANSI.sub("", text).strip()
    if not text:
        return LogLine("blank")
    parsed = _parse_text(text)
    if parsed is not None and parsed.kind == "kernel" and parsed.message.startswith("["):
        m = _CALLER.match(parsed.message)
        if m:
            return LogLine("kernel", parsed.message[m.end():].strip())
    return parsed


_FAC = "(?:" + "|".join(_FACILITIES) + ")(?![a-z0-9])"
# Every prefix of FORMATS in one alternation, in the order they take precedence (one C call a line;
# the group that matched says which): wrappers, Talos, the caller id, /dev/kmsg and <N> headers,
# dmesg -x, journal short-monotonic, syslog with a kernel tag, dmesg, another program's syslog line,
# a syslog time with no tag (unreadable), a bare kernel: tag, journalctl's notes, an unknown prefix.
_READERS = (
    rf"(?P<talos>\S{{1,253}}: (?P<tfac>{_FAC}):\s{{0,8}}{_LEVELS}[a-z]{{0,3}}: \[{_ISO}\]: )",
    rf"(?P<caller>\[\s{{0,8}}[TC]\d{{1,7}}\]\s?)",
    rf"(?P<kmsg>(?P<kprio>\d{{1,3}}),\d{{1,20}},\d{{1,20}},[^;\s]*;|<(?P<rprio>\d{{1,3}})>\s*(?:{_DMESG_TS}\s?)?)",
    rf"(?P<decode>(?P<dfac>{_FAC})\s*:\s*{_LEVELS}\s*:\s?(?:(?:{_DMESG_TS}|{_ISO})\s?)?)",
    rf"(?P<monotonic>\[{_NUM}\] \S+ kernel: )",
    rf"(?P<syslog>{_SYSLOG_TIME} (?:\S* )?)(?=kernel(?:\[\d{{1,10}}\])?:(?: |$|(?=\[)))",
    rf"(?P<dmesg>(?:{_DMESG_TS}|{_ISO})(?:\[\s{{0,8}}[TC]\d{{1,7}}\])?(?: |$))",
    rf"(?P<other>{_SYSLOG_TIME} )(?=(?:\S+ )?[^\s:\[\]]+(?:\[\d{{1,10}}\])?:(?: |$)|(?:\S* )?-- .{{1,200}} --$)",
    rf"(?P<untagged>{_SYSLOG_TIME} )",
    r"(?P<tag>)(?=kernel(?:\[\d{1,10}\])?:(?: |$|(?=\[)))",
    r"(?P<meta>-- .{1,200} --$)",
    rf"(?P<unknown>{_LOOKS_PREFIXED.pattern})",
)
_WRAPPER = (rf"(?P<wrapper>\[{_ISO_ANY}\]\s?|{_ISO} (?:stdout|stderr) [FP] |\[(?:pod|deployment|daemonset|job)/[^\]\s]{{1,253}}\] "
            rf"|\[kernel\] |(?:> ?){{1,4}}|{_ISO} (?=\[|<\d{{1,3}}>|\d{{1,3}},\d{{1,20}},|kern\s*:|{_MON} ))")
_READ = re.compile("|".join((_WRAPPER, *_READERS)))
_READ_INNER = re.compile("|".join(_READERS))  # inside two wrappers: no third


def _parse_text(text: str, depth: int = 0) -> LogLine | None:
    m = (_READ if depth < 2 else _READ_INNER).match(text)
    if m is None:
        return LogLine("bare", text)
    how, rest = m.lastgroup, text[m.end():]
    if how == "wrapper":
        return _wrapped(rest, depth)
    if how == "talos":
        return LogLine("kernel" if m.group("tfac") == "kern" else "other", rest.strip())
    if how in ("caller", "monotonic", "dmesg"):
        return LogLine("kernel", rest.strip())
    if how == "kmsg":
        if not _facility_is_kernel(m.group("kprio") or m.group("rprio")):
            return LogLine("other")
        return LogLine("kernel", _after_kernel_tag(rest))
    if how == "decode":
        return LogLine("kernel" if m.group("dfac") == "kern" else "other", rest.strip())
    if how in ("syslog", "tag"):
        return LogLine("kernel", _after_kernel_tag(rest))
    if how == "other":
        return LogLine("other")
    if how == "meta":
        return LogLine("meta")
    return None  # a syslog time with no tag, or a prefix this reader does not know


def _wrapped(rest: str, depth: int) -> LogLine | None:
    """The line inside a wrapper: a kernel-log line of its own, or a bare message (the wrapper was its prefix)."""
    rest = rest.strip()
    if not rest:
        return LogLine("blank")
    inner = _parse_text(rest, depth + 1)
    if inner is not None and inner.kind == "bare":
        return LogLine("kernel", inner.message)
    return inner


def _after_kernel_tag(rest: str) -> str:
    """The message after an optional ``kernel:`` tag and the dmesg timestamp syslog keeps after it."""
    m = _KERNEL_TAG.match(rest)
    if m:
        rest = rest[m.end():]
    m = _SYSLOG_KERNEL_TS.match(rest)
    if m:
        rest = rest[m.end():]
    return rest.strip()


def message_of(line: str) -> str:
    """The kernel message a log line carries, or the line itself (stripped) when it carries none
    (another program's line, an unreadable one): such text starts with no catalog prefix."""
    parsed = parse_log_line(line)
    if parsed is not None and parsed.kind in ("kernel", "bare"):
        return parsed.message
    return line.strip()


class KmsgReader:
    """Reads /dev/kmsg (or ``path``) on a thread; ``lost`` is the exact number of records that
    were overwritten before they could be read, ``skipped_at_start`` the records already there."""

    def __init__(self, on_line: Callable[[str], None], *, path: str = "/dev/kmsg", poll_ms: int = 500,
                 read: Callable[[int, int], bytes] = os.read) -> None:
        self.on_line = on_line
        self.path = path
        self.poll_ms = poll_ms
        self.read = read
        self.lost = 0
        self.overruns = 0  # EPIPEs seen (each says "some records were lost")
        self.skipped_at_start = 0
        self.last_seq: int | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise KmsgUnavailable(f"{self.path}: {exc.strerror}") from None
        # Instead of seeking to the end (which hides the seq we start from), read what is there.
        self._read_available(deliver=False, max_reads=MAX_SKIPPED_READS)
        self._thread = threading.Thread(target=self._run, name="sentinel-kmsg", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._fd is not None
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not self._stop.is_set():
            if poller.poll(self.poll_ms) and self._read_available(deliver=True) == "eof":
                self._stop.wait(self.poll_ms / 1000)  # a fake device without a writer polls as ready

    def _read_available(self, *, deliver: bool, max_reads: int | None = None) -> str:
        """Read until the device has nothing more; returns why it stopped."""
        reads = 0
        while not self._stop.is_set():
            reads += 1
            if max_reads is not None and reads > max_reads:
                return "bounded"
            try:
                data = self.read(self._fd, READ_SIZE)
            except BlockingIOError:
                return "empty"
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring overwrote records we had not read
                    self.overruns += 1
                    continue
                log.error("reading %s failed: %s", self.path, exc)
                self._stop.wait(1.0)
                return "error"
            if not data:  # end of file (a fake device whose writer went away)
                return "eof"
            self._records(data, deliver)
        return "stopped"

    def _records(self, data: bytes, deliver: bool) -> None:
        # One read of /dev/kmsg is one record; a FIFO may carry several. Dictionary lines
        # (" KEY=value") start with a space and belong to the record before them.
        for line in data.split(b"\n"):
            if not line or line.startswith(b" "):
                continue
            parsed = split_record(line)
            if parsed is None:
                continue
            seq, message = parsed
            if deliver and self.last_seq is not None and seq > self.last_seq + 1:
                self.lost += seq - self.last_seq - 1  # records from before start were never due
            if self.last_seq is None or seq > self.last_seq:
                self.last_seq = seq
            if deliver:
                self.on_line(message)
            else:
                self.skipped_at_start += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

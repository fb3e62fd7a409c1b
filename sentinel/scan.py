"""`sentinel scan`: a one-shot check of this node, for Slurm's ``HealthCheckProgram``, NHC or a
human (the way operators use ``gpud scan`` or ``dcgmi diag -r 1``).

It reads NVML once (or ``--simulate STATE``) and a kernel log (``--kmsg FILE``, ``-`` for stdin,
default: the kernel ring buffer now, read from /dev/kmsg) in any format dmesg, journalctl -k or a
syslog daemon writes (:func:`sentinel.sources.kmsg.parse_log_line`; docs/scan.md), classifies every kernel message with
the signature catalog (:mod:`sentinel.signatures`) and runs the policy's rules over one NVML
poll. It prints a verdict per finding and per GPU and exits with Nagios codes: 0 ok, 1 warning,
2 critical, 3 unknown (it could not check: an unreadable log or log line, a log without a kernel
message, NVML unavailable). It never answers OK about input it could not read.

The kernel log is streamed: one line at a time, each cut at :data:`MAX_LINE` bytes, and at most
:data:`MAX_FINDINGS` findings are kept in full (the rest are counted, and still count for the exit
code), so a 100 MB log costs the same memory as a small one. A line that is not text (bad UTF-8,
NUL bytes), is cut, or is in no known format is counted as unreadable and classified no further;
a kernel message that matches no signature is no finding.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from dataclasses import dataclass, field
from typing import IO, Iterator

from sentinel import signatures
from sentinel.pci import port_map
from sentinel.records import MAX_LINE  # a longer line is malformed
from sentinel.scan_explain import explain_finding, explain_misses

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
EXIT_NAMES = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}
SEVERITY_EXIT = {"info": OK, "warning": WARNING, "critical": CRITICAL}
ACTION_SEVERITY = {"migrate": "critical", "snapshot": "warning", "alert": "warning"}
MAX_FINDINGS = 1000
KMSG_READ_LIMIT = 1 << 20  # records read from /dev/kmsg at most (its ring holds far fewer)


class ScanError(RuntimeError):
    """The scan could not check what it was asked to (exit 3); the message is one sentence."""


@dataclass
class KernelLogStats:
    """What was read of one kernel log. A line is unreadable when it is not text (bad UTF-8, NUL
    bytes, longer than MAX_LINE: ``malformed``), when it starts like a log prefix the reader does
    not know (``unrecognised``), or when it carries no prefix in a log whose other lines do,
    has no kernel-message shape and continues no record (``bare`` while ``prefixed`` > 0). Any unreadable line makes the verdict UNKNOWN unless a
    critical finding stands (what could not be read may hide a failure; OK is never said of it)."""

    source: str
    lines: int = 0
    malformed: int = 0
    unrecognised: int = 0
    bare: int = 0
    prefixed: int = 0
    messages: int = 0
    first_unreadable: int | None = None
    findings_dropped: int = 0

    @property
    def unreadable(self) -> int:
        return self.malformed + self.unrecognised + (self.bare if self.prefixed else 0)

    def as_dict(self) -> dict:
        return {"source": self.source, "lines": self.lines, "messages": self.messages, "unreadable": self.unreadable,
                "malformed": self.malformed, "unrecognised": self.unrecognised,
                "bare": self.bare if self.prefixed else 0, "first_unreadable_line": self.first_unreadable,
                "findings_dropped": self.findings_dropped}

    def unreadable_at(self, lineno: int) -> None:
        if self.first_unreadable is None or lineno < self.first_unreadable:
            self.first_unreadable = lineno


@dataclass
class Result:
    findings: list[dict] = field(default_factory=list)
    gpus: list[dict] = field(default_factory=list)
    worst: int = OK
    counts: dict[str, int] = field(default_factory=lambda: {"critical": 0, "warning": 0, "info": 0})
    kernel_log: KernelLogStats | None = None
    explain: bool = False  # --explain: each finding keeps its record and catalog entry; misses are kept
    misses: list[dict] = field(default_factory=list)  # records that start like an entry and match none

    def add(self, finding: dict) -> None:
        self.counts[finding["severity"]] += 1
        self.worst = max(self.worst, SEVERITY_EXIT[finding["severity"]])
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(finding)
        elif self.kernel_log is not None:
            self.kernel_log.findings_dropped += 1


def finding(*, lineno: int | None, kind: str, severity: str, pci_bus_id: str | None, gpu: int | None,
            xid: int | None, action: str, message: str) -> dict:
    return {"lineno": lineno, "kind": kind, "severity": severity, "pci_bus_id": pci_bus_id, "gpu": gpu, "xid": xid,
            "action": action, "message": message}


# -- the kernel log -------------------------------------------------------------------------------
def read_lines(stream: IO[bytes], stats: KernelLogStats) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each line; malformed lines are counted and skipped. A line
    longer than MAX_LINE is malformed; the rest of it is read and dropped, never held."""
    lineno = 0
    while True:
        raw = stream.readline(MAX_LINE)
        if not raw:
            return
        lineno += 1
        stats.lines += 1
        if not raw.endswith(b"\n") and len(raw) >= MAX_LINE:
            line_text(stats, lineno, None)
            while raw and not raw.endswith(b"\n"):  # skip the rest of the overlong line
                raw = stream.readline(MAX_LINE)
            continue
        text = line_text(stats, lineno, raw)
        if text is not None:
            yield lineno, text


def line_text(stats: KernelLogStats, lineno: int, raw: bytes | None, text: str | None = None) -> str | None:
    """One line's text from its bytes (``raw``) or its decoded text, or None when it is
    malformed (counted): longer than MAX_LINE (``raw`` and ``text`` None), a NUL byte, not UTF-8."""
    if text is None and raw is not None and b"\0" not in raw:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            pass
    body = text[:-1] if text is not None and text.endswith("\n") else text
    if body is not None and (len(body) if body.isascii() else len(body.encode("utf-8"))) >= MAX_LINE:
        text = None
    if text is None:
        stats.malformed += 1
        stats.unreadable_at(lineno)
        return None
    return text.rstrip("\r\n")


def logical_lines(lines: Iterator[tuple[int, str]], stats: KernelLogStats,
                  catalog: signatures.Catalog | None = None) -> Iterator[tuple[int, str]]:
    """The kernel records of a log, each as (its first line's number, its text): every line read
    by :func:`sentinel.sources.kmsg.parse_log_line`, then assembled by
    :class:`sentinel.records.Joiner` (a line that starts a catalog record on its own is never a
    continuation; an indented bare line, or in a prefixed log a bare line with no kernel-message
    shape, continues the record before it); other programs' lines skipped; the rest counted in
    ``stats``. A log in which no line has the shape of a kernel message holds none (``messages``
    is 0: random text, an application's output, a wrong file)."""
    from sentinel.records import Joiner, kernel_shaped
    from sentinel.sources.kmsg import parse_log_line

    joiner = Joiner(catalog or signatures.default_catalog())
    first_orphan = 0
    shaped = 0
    for lineno, text in lines:
        if type(text) is int:  # a run of lines the fast path passed over: kernel messages that match nothing
            if stats.prefixed == 0 and stats.bare:
                stats.unreadable_at(first_orphan)
            stats.prefixed += text
            stats.messages += text
            shaped += text
            # the run's last record stays open, as a record that matches nothing: a continuation after it joins it
            yield from joiner.feed(lineno + text - 1, "")
            continue
        parsed = parse_log_line(text)
        if parsed is None:
            stats.unrecognised += 1
            stats.unreadable_at(lineno)
            yield from joiner.feed(lineno, None)
            continue
        if parsed.kind == "bare":
            message = parsed.message
            looks = kernel_shaped(message)
            how = "indented" if text[:1] in (" ", "\t") else "wrapped" if stats.prefixed and not looks else "record"
            done = joiner.feed(lineno, message, how)
            if not joiner.joined:
                stats.messages += 1
                if looks or joiner.catalog.classify(message) is not None:
                    shaped += 1
                else:  # a bare line of no kernel shape that continues nothing
                    stats.bare += 1
                    if stats.prefixed:
                        stats.unreadable_at(lineno)
                    elif stats.bare == 1:
                        first_orphan = lineno
            yield from done
        elif parsed.kind in ("kernel", "other", "meta"):
            if stats.prefixed == 0 and stats.bare:
                stats.unreadable_at(first_orphan)  # the bare lines of no kernel shape before it were unreadable too
            stats.prefixed += 1
            if parsed.kind == "kernel":
                stats.messages += 1
                shaped += 1
                yield from joiner.feed(lineno, parsed.message)
            else:
                yield from joiner.feed(lineno, None)
    yield from joiner.close()
    if shaped == 0:
        stats.messages = 0


def kmsg_records(path: str = "/dev/kmsg") -> Iterator[bytes]:
    """The records in the kernel ring buffer now, as ``prio,seq,usec,flags;message\\n`` lines
    (their KEY=value lines dropped); :func:`logical_lines` reads the header (a record user space
    wrote has a facility other than kern and is no kernel message)."""
    from sentinel.sources.kmsg import split_record

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ScanError(f"cannot read the kernel ring buffer ({path}): {exc.strerror}; "
                        f"run as root or give a log with --kmsg FILE") from None
    try:
        for _ in range(KMSG_READ_LIMIT):
            try:
                data = os.read(fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while we read: go on with the next record
                    continue
                raise ScanError(f"reading {path} failed: {exc.strerror}") from None
            if not data:
                return
            record = data.split(b"\n", 1)[0]
            if split_record(record) is not None:
                yield record + b"\n"
    finally:
        os.close(fd)


class _Records:
    """A file-like view of kmsg records for :func:`read_lines`."""

    def __init__(self, records: Iterator[bytes]) -> None:
        self._records = records

    def readline(self, limit: int) -> bytes:
        return next(self._records, b"")[:limit]


def scan_kernel_log(stream: IO[bytes] | _Records, source: str, result: Result, catalog: signatures.Catalog,
                    bus_to_gpu: dict[str, int], ports: dict[str, int], xid_action: dict[int, str]) -> None:
    from sentinel.rules.xid import XID_APPLICATION

    stats = result.kernel_log = KernelLogStats(source)
    if hasattr(stream, "read"):  # a file or a pipe: runs of lines that cannot matter are passed over in C
        from sentinel import scan_fast

        lines = scan_fast.read_lines(stream, stats, lambda n, raw, text=None: line_text(stats, n, raw, text), catalog)
    else:
        lines = read_lines(stream, stats)
    for lineno, text in logical_lines(lines, stats, catalog):
        m = catalog.classify(text)
        if m is None:
            if result.explain and len(result.misses) < MAX_FINDINGS and catalog.starts_like_entry(text):
                result.misses.append({"lineno": lineno, "record": text})
            continue
        gpu = None
        for bus in (m.source_bus_id, m.pci_bus_id):
            if bus is not None and gpu is None:
                gpu = bus_to_gpu.get(bus, ports.get(bus))
        if m.kind == "xid":
            action = xid_action.get(m.xid) if m.xid is not None else None
            severity = signatures.xid_severity(action, m.xid in XID_APPLICATION)
            action = "alert" if action in (None, "ignore") else action
        else:
            severity, action = m.severity, m.action
        found = finding(lineno=lineno, kind=m.kind, severity=severity, pci_bus_id=m.pci_bus_id, gpu=gpu, xid=m.xid,
                        action=action, message=m.message)
        if result.explain:
            found.update(record=text, signature=m.signature)
        result.add(found)


# -- NVML -----------------------------------------------------------------------------------------
def scan_nvml(args: argparse.Namespace, result: Result, policy) -> list:
    """One poll of every GPU through the policy's rules; returns the GPU readings."""
    from sentinel.policy import PolicyState
    from sentinel.readings import NodeReadings
    from sentinel.sources.nvml import NvmlSource, NvmlUnavailable

    if args.simulate:
        from sentinel.sources import simulated

        try:
            simulated.load_state(args.simulate)
        except simulated.SimulatedStateError as exc:
            raise ScanError(str(exc)) from None
        nvml = simulated.SimulatedNvml(args.simulate)
    else:
        try:
            import pynvml as nvml
        except ImportError as exc:
            raise ScanError(f"the nvidia-ml-py package cannot be imported: {exc}") from None
    source = NvmlSource(nvml, deadline_seconds=args.deadline, event_wait_ms=50)
    try:
        source.start()
        gpus = source.poll()
    except NvmlUnavailable as exc:
        raise ScanError(f"NVML unavailable: {exc} (use --no-nvml to check the kernel log only)") from None
    finally:
        source.close()
    _, trips = policy.decide(PolicyState(), NodeReadings(time=0.0, driver_version=source.driver_version, gpus=tuple(gpus)), 0.0)
    by_index = {g.index: g for g in gpus}
    for t in trips:
        g = by_index.get(t.gpu)
        result.add(finding(lineno=None, kind=t.rule, severity=ACTION_SEVERITY.get(t.action, "warning"),
                           pci_bus_id=g.pci_bus_id if g else None, gpu=t.gpu if g else None, xid=None, action=t.action,
                           message=t.message))
    return gpus


def gpu_verdicts(result: Result, gpus: list) -> None:
    worst: dict[int, int] = {}
    count: dict[int, int] = {}
    for f in result.findings:
        if f["gpu"] is not None:
            worst[f["gpu"]] = max(worst.get(f["gpu"], OK), SEVERITY_EXIT[f["severity"]])
            count[f["gpu"]] = count.get(f["gpu"], 0) + 1
    for g in gpus:
        verdict = worst.get(g.index, OK)
        if g.hung or "handle" in g.errors:
            verdict = max(verdict, UNKNOWN if verdict == OK else verdict)
        result.gpus.append({"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "name": g.name,
                            "verdict": EXIT_NAMES[verdict].lower(), "findings": count.get(g.index, 0)})


# -- the command ----------------------------------------------------------------------------------
def run(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    from sentinel.config import Config, ConfigError, load
    from sentinel.policy import Policy

    try:
        cfg = load(args.config) if args.config else Config()
    except ConfigError as exc:
        return _unknown(f"{exc}", out, args.json)
    catalog = signatures.default_catalog()
    policy = Policy(cfg.policy)
    result = Result(explain=args.explain)
    gpus: list = []
    try:
        if not args.no_nvml:
            gpus = scan_nvml(args, result, policy)
        bus_to_gpu = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
        ports = port_map(bus_to_gpu)
        if args.kmsg == "-":
            scan_kernel_log(sys.stdin.buffer, "stdin", result, catalog, bus_to_gpu, ports, policy.xid_action)
        elif args.kmsg:
            try:
                stream = open(args.kmsg, "rb")
            except OSError as exc:
                raise ScanError(f"cannot read {args.kmsg}: {exc.strerror}") from None
            with stream:
                try:
                    scan_kernel_log(stream, args.kmsg, result, catalog, bus_to_gpu, ports, policy.xid_action)
                except OSError as exc:  # a directory, an I/O error half-way
                    raise ScanError(f"cannot read {args.kmsg}: {exc.strerror}") from None
        else:
            scan_kernel_log(_Records(kmsg_records()), "/dev/kmsg", result, catalog, bus_to_gpu, ports, policy.xid_action)
    except ScanError as exc:
        return _unknown(str(exc), out, args.json)
    gpu_verdicts(result, gpus)
    code = verdict(result)
    try:
        write_report(result, code, out, args.json)
    except BrokenPipeError:  # `sentinel scan | head`: the reader left; the verdict stands
        _stdout_gone(out)
    return code


def verdict(result: Result) -> int:
    """The exit code: the worst finding, except that what could not be checked (an unreadable
    log line, a GPU that did not answer) turns OK or WARNING into UNKNOWN; CRITICAL stands (as in
    Icinga's worst-state order: CRITICAL > UNKNOWN > WARNING > OK)."""
    code = result.worst
    kl = result.kernel_log
    cannot_check = any(g["verdict"] == "unknown" for g in result.gpus)
    if kl is not None and (kl.unreadable or kl.messages == 0):
        cannot_check = True
    if cannot_check and code < CRITICAL:
        code = UNKNOWN
    return code


def write_report(result: Result, code: int, out: IO[str], as_json: bool) -> None:
    kl = result.kernel_log
    if as_json:
        extra = {"not_counted": result.misses} if result.explain else {}
        out.write(json.dumps({"findings": result.findings, "gpus": result.gpus,
                              "kernel_log": None if kl is None else kl.as_dict(), "status": EXIT_NAMES[code],
                              **extra}) + "\n")
        out.flush()
        return
    c = result.counts
    out.write(f"SENTINEL {EXIT_NAMES[code]} - {c['critical']} critical, {c['warning']} warning, {c['info']} info "
              f"finding(s); {len(result.gpus)} GPU(s)"
              + (f"; {kl.unreadable} unreadable kernel-log line(s)" if kl is not None and kl.unreadable else "")
              + (f"; no kernel message in {kl.source}" if kl is not None and kl.messages == 0 else "") + "\n")
    for f in result.findings:
        where = f"GPU {f['gpu']}" if f["gpu"] is not None else (f["pci_bus_id"] or "node")
        line = f"line {f['lineno']}" if f["lineno"] is not None else "nvml"
        out.write(f"  {f['severity'].upper():<8} {line:<12} {where:<14} {f['kind']} -> {f['action']}: {f['message']}\n")
        if result.explain:
            explain_finding(f, out)
    if result.explain:
        explain_misses(result.misses, out)
    for g in result.gpus:
        out.write(f"  GPU {g['index']} {g['pci_bus_id']} {g['verdict'].upper()} ({g['findings']} finding(s))\n")
    if kl is not None:
        out.write(f"  kernel log {kl.source}: {kl.lines} line(s), {kl.messages} kernel message(s), {kl.unreadable} unreadable"
                  + (f" (the first at line {kl.first_unreadable}: not text, or in no format sentinel scan reads; "
                     f"see docs/scan.md)" if kl.unreadable else "")
                  + (f", {kl.findings_dropped} finding(s) not listed" if kl.findings_dropped else "") + "\n")
    out.flush()


def _stdout_gone(out: IO[str]) -> None:
    """The reader of our output went away: say so once on stderr, and keep the interpreter's
    final flush from raising again."""
    print("sentinel scan: the output was closed before the report ended (broken pipe); the exit code is the verdict",
          file=sys.stderr)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a StringIO)
        pass


def _unknown(message: str, out: IO[str], as_json: bool) -> int:
    print(f"sentinel scan: {message}", file=sys.stderr)
    try:
        if as_json:
            out.write(json.dumps({"findings": [], "gpus": [], "kernel_log": None, "status": "UNKNOWN", "error": message}) + "\n")
        else:
            out.write(f"SENTINEL UNKNOWN - {message}\n")
        out.flush()
    except BrokenPipeError:
        _stdout_gone(out)
    return UNKNOWN


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kmsg", metavar="FILE", help="kernel log to check (dmesg, journalctl -k, syslog; - for stdin); "
                   "default: the kernel ring buffer now (/dev/kmsg)")
    p.add_argument("--simulate", metavar="STATE", help="read simulated GPUs from this state file instead of NVML")
    p.add_argument("--no-nvml", action="store_true", help="check the kernel log only")
    p.add_argument("--config", help="TOML config whose [policy] applies (Xid overrides, thresholds)")
    p.add_argument("--deadline", type=float, default=2.0, help="seconds an NVML call may take (default 2)")
    p.add_argument("--json", action="store_true", help='print {"findings": [...], "gpus": [...]} (plus kernel_log, status)')
    p.add_argument("--explain", action="store_true", help="print each finding's record as joined and the catalog entry "
                   "that matched it, and the records that start like an entry but match none")


def explain(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    """`sentinel explain XID`: the catalog's meaning and the policy's action for one Xid."""
    from sentinel.config import Config, ConfigError, load
    from sentinel.policy import Policy
    from sentinel.rules.xid import XID_APPLICATION

    text = str(args.xid).strip()
    if not text.isdigit() or len(text) > 5:
        print(f"sentinel explain: {args.xid!r} is not an Xid number (e.g. sentinel explain 79)", file=sys.stderr)
        return 2
    try:
        cfg = load(args.config) if args.config else Config()
    except ConfigError as exc:
        print(f"sentinel explain: {exc}", file=sys.stderr)
        return 2
    xid = int(text)
    meaning = signatures.default_catalog().xid_meanings.get(xid)
    action = Policy(cfg.policy).xid_action.get(xid)
    if action is None:
        action_text = ("alert, until more than app_xid_max_per_hour in an hour (then app_xid_rate: snapshot)"
                       if xid in XID_APPLICATION else "alert")
    else:
        action_text = action
    out.write(f"Xid {xid}: {meaning or 'not in the catalog (see https://docs.nvidia.com/deploy/xid-errors/)'}\n")
    out.write(f"action: {action_text}\n")
    out.write(f"scan severity: {signatures.xid_severity(action, xid in XID_APPLICATION)}\n")
    return 0

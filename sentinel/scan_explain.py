"""``sentinel scan --explain``: why a record was, or was not, counted.

For each finding: the record as the scan joined it (its lines, from the first one's number) and the
catalog entry that matched it (name, kind, severity and action, pattern, source). Then the records
that start like a catalog entry (its prefix, or the text a wildcard entry needs) but match none of
them: what an operator reads to see that a line was seen and why it did not count.
"""

from __future__ import annotations

from typing import IO

from sentinel import signatures

MAX_SHOWN = 200  # record characters printed per line of a record


def _record_lines(lineno: int | None, record: str, out: IO[str]) -> None:
    parts = record.replace("\\x0a", "\n").split("\n")
    where = f"line {lineno}" if len(parts) == 1 else f"lines {lineno}-{lineno + len(parts) - 1} (joined)"
    out.write(f"      record, {where}:\n")
    for part in parts:
        out.write(f"        | {part[:MAX_SHOWN]}\n")


def explain_finding(f: dict, out: IO[str]) -> None:
    """The record and the entry behind one kernel-log finding (an NVML finding has neither)."""
    if "record" not in f:
        return
    _record_lines(f["lineno"], f["record"], out)
    sig = signatures.default_catalog().entry(f["signature"])
    if sig is None:
        return
    out.write(f"      entry {sig.name}: kind {sig.kind}, {sig.severity} -> {sig.action}"
              + (" (for an Xid: its policy action decides)" if sig.kind == "xid" else "") + "\n")
    out.write(f"        pattern {sig.regex.pattern}\n        source  {sig.source}\n")


def explain_misses(misses: list[dict], out: IO[str]) -> None:
    if not misses:
        return
    catalog = signatures.default_catalog()
    out.write(f"  not counted: {len(misses)} record(s) start like a catalog entry but match none\n")
    for miss in misses:
        names = catalog.starts_like_entry(miss["record"])
        _record_lines(miss["lineno"], miss["record"], out)
        out.write(f"      starts like: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}\n")

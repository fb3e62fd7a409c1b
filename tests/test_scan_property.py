"""The property a health check owes: a record is found in a whole log exactly as it is found alone.

For every file made of corpus entries (tests/corpus/kernel_lines.toml, real lines from public
sources) in random order and random formats (each entry bare, or behind one of the prefixes dmesg,
journalctl, syslog, /dev/kmsg, containerd and Talos write, mixed in one file), with benign lines
interleaved (the corpus's look-alikes and a real bare boot log), the findings of the file are
exactly the union of the findings of its entries scanned one by one.
"""

from __future__ import annotations

import io
import tomllib
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from sentinel import scan, signatures
from sentinel.sources.kmsg import parse_log_line

HERE = Path(__file__).parent
CORPUS = tomllib.loads((HERE / "corpus" / "kernel_lines.toml").read_text())["line"]
BOOT = (HERE / "corpus" / "logformats" / "dmesg-t.txt").read_text().splitlines()
CATALOG = signatures.default_catalog()

# (name, the prefix of a record, the prefix of a continuation line of that record or None when the
# format prints every part of a split message as a record of its own)
FORMATS = (
    ("bare", "", None),
    ("dmesg", "[ {ts:>12.6f}] ", "               "),
    ("dmesg-caller", "[ {ts:>12.6f}][  T{pid}] ", None),
    ("dmesg-r", "<4>[ {ts:>12.6f}] ", None),
    ("dmesg-T", "[Tue Dec  1 21:31:52 2026] ", "                           "),
    ("dmesg-x-iso", "kern  :warn  : 2026-12-01T21:31:52,254954+00:00 ", None),
    ("syslog", "Dec  1 21:31:52 gpu-node-07 kernel: ", None),
    ("syslog-ts", "Dec  1 21:31:52 gpu-node-07 kernel: [ {ts:.6f}] ", None),
    ("journal-short-iso", "2026-12-01T21:31:52+0000 gpu-node-07 kernel: ", "                                              "),
    ("kmsg", "4,{pid},{usec},-;", None),
    ("cri", "2026-12-01T21:31:52.254954123Z stdout F [ {ts:.6f}] ", None),
    ("talos", "198.18.0.7: kern: warning: [2026-12-01T21:31:52.597136489Z]: ", None),
)


def messages(text: str) -> list[str]:
    """An entry's lines as message texts (its published prefixes removed)."""
    out = []
    for line in text.replace("\\x0a", "\n").split("\n"):
        parsed = parse_log_line(line)
        out.append(parsed.message if parsed is not None and parsed.kind in ("kernel", "bare") else line.strip())
    return out


def render(entry_text: str, fmt: tuple, ts: float) -> list[str]:
    """The entry in one format: its first part behind the record prefix; the other parts as
    continuation lines of the format, or as records of their own where the format has none (only
    for a message the driver itself prints in parts, whose every part starts with NVRM:)."""
    _, prefix, cont = fmt
    parts = messages(entry_text)
    head = prefix.format(ts=ts, pid=4000 + int(ts), usec=int(ts * 1e6))
    lines = [head + parts[0]]
    for part in parts[1:]:
        if cont is not None or not prefix:
            lines.append((cont or "  ") + part)  # bare logs: an indented continuation (journalctl -o cat style)
        else:
            lines.append(head + part)
    return lines


def splittable(text: str) -> bool:
    parts = messages(text)
    return len(parts) == 1 or all(p.startswith("NVRM:") for p in parts)


def findings(text: str) -> Counter:
    result = scan.Result()
    scan.scan_kernel_log(io.BytesIO(text.encode()), "property", result, CATALOG, {}, {}, {})
    return Counter((f["kind"], f["severity"], f["xid"], f["pci_bus_id"]) for f in result.findings)


ENTRY = st.sampled_from(CORPUS).map(lambda e: e["text"])
BENIGN = st.one_of(st.sampled_from([e["text"] for e in CORPUS if not e["kind"] and "\n" not in e["text"]]),
                   st.sampled_from(BOOT))


@st.composite
def logs(draw):
    items = draw(st.lists(st.tuples(ENTRY, st.lists(BENIGN, max_size=3)), min_size=1, max_size=12))
    pieces, alone = [], []
    for i, (text, benign) in enumerate(items):
        fmt = draw(st.sampled_from([f for f in FORMATS if f[2] is not None or not f[1] or splittable(text)]))
        entry_lines = render(text, fmt, 100.0 + i)
        pieces.extend(entry_lines)
        alone.append("\n".join(entry_lines))
        for b in benign:
            bfmt = draw(st.sampled_from(FORMATS))
            lines = render(b, bfmt, 100.5 + i)
            pieces.extend(lines)
            alone.append("\n".join(lines))
    return "\n".join(pieces) + "\n", alone


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(logs())
def test_the_findings_of_a_file_are_the_union_of_the_findings_of_its_lines(case):
    text, alone = case
    expected = sum((findings(piece + "\n") for piece in alone), Counter())
    assert findings(text) == expected


def test_a_bare_xid_79_after_a_prefixed_xid_13_is_found():
    """The issue's two lines: a prefixed Xid 13, then a bare Xid 79 (dmesg -r, a paste)."""
    text = ("[  100.000000] NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python3, Graphics Exception\n"
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n")
    result = scan.Result()
    scan.scan_kernel_log(io.BytesIO(text.encode()), "two", result, CATALOG, {}, {}, {79: "migrate"})
    assert [(f["lineno"], f["xid"], f["severity"]) for f in result.findings] == [(1, 13, "info"), (2, 79, "critical")]
    assert scan.verdict(result) == scan.CRITICAL

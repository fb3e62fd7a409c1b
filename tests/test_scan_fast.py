"""The scan's fast path (sentinel/scan_fast.py) reads every log exactly as the line-by-line path
does: the same findings, line numbers and counts, on the real captures, the corpus in every
format, mixed logs, and the lines that sit on its edges (block boundaries, overlong lines, bytes
that are not UTF-8, NULs, carriage returns, colour escapes, continuation lines after a run)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from sentinel import scan, scan_fast, signatures
from test_scan_property import BOOT, CORPUS, FORMATS, render, splittable

HERE = Path(__file__).parent
CAPTURES = sorted((HERE / "corpus" / "logformats").glob("*.txt"))
CATALOG = signatures.default_catalog()


class LineByLine:
    """The same bytes, offered one line at a time (no read(): the path without runs)."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def readline(self, limit: int) -> bytes:
        return self._f.readline(limit)


def both(data: bytes, explain: bool = False):
    out = []
    for stream in (io.BytesIO(data), LineByLine(data)):
        result = scan.Result(explain=explain)
        scan.scan_kernel_log(stream, "t", result, CATALOG, {}, {}, {79: "migrate"})
        out.append((result.findings, result.kernel_log.as_dict(), result.counts, result.misses))
    return out


def same(data: bytes, explain: bool = False) -> None:
    fast, slow = both(data, explain)
    assert fast == slow


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_every_real_capture_reads_the_same(path):
    data = path.read_bytes()
    same(data)
    same(data * 50)  # long runs


@pytest.mark.parametrize("name", [f[0] for f in FORMATS])
def test_the_corpus_in_each_format_reads_the_same(name):
    fmt = next(f for f in FORMATS if f[0] == name)
    lines = []
    for i, e in enumerate(CORPUS):
        if fmt[2] is not None or not fmt[1] or splittable(e["text"]):
            lines += render(e["text"], fmt, 10.0 + i)
            lines += render(BOOT[i % len(BOOT)], fmt, 10.5 + i)
    same(("\n".join(lines) + "\n").encode(), explain=True)


EDGES = [
    b"[    1.000000] usb 1-1: new device\r\n",  # CRLF
    b"[    1.000000] \x1b[33musb\x1b[0m 1-1: colour\n",
    b"[    1.000000] caf\xc3\xa9 1-1: UTF-8 text\n",
    b"[    1.000000] bad \xff\xfe bytes\n",
    b"[    1.000000] a NUL \x00 here\n",
    b"[    1.000000] " + b"x" * 9000 + b"\n",  # overlong
    b"[    1.000000] " + b"y" * 8176 + b"\n",  # 8191 bytes with its prefix: the longest that is read
    b"[    1.000000] " + b"y" * 8177 + b"\n",  # 8192 bytes: malformed
    b"    NVRM: (PCI ID: 10de:2330) installed in this system has\n",  # an indented continuation
    b"fallen off the bus and is not responding to commands.\n",  # a wrapped one
    b"[    1.000000][    T42] NVRM: Xid (PCI:0000:2a:00): 79, pid=1, name=x, GPU has fallen off the bus.\n",
    b"[    1.000000] [ T42] EDAC MC0: 1 UE memory read error on CPU_SrcID#0_MC#0_Chan#0_DIMM#0\n",
    b"[    0.000000] gpu-node-07 kernel: NVRM: Xid (PCI:0000:2a:00): 79, pid=1, name=x, GPU has fallen off the bus.\n",
    b"Dec  1 21:31:52 kernel: [ 1.0] NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.\n",
    b"Dec  1 21:31:52 gpu-node-07 kernel: [ 1.0]\\x0aNVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.\n",
    b"6,1,2,-;nvidia 0000:2a:00.0: AER: Corrected error received: 0000:2a:00.0\n",
    b"14,1,2,-;NVRM: Xid (PCI:0000:2a:00): 79, pid=1, name=x, GPU has fallen off the bus.\n",
    b"198.18.0.7: kern: warning: [2026-12-01T21:31:52.597136489Z]: NVRM: Xid (PCI:0000:2a:00): 79, x\n",
    b"2026-12-01T21:31:52.254954123Z stdout F [ 1.0] NVRM: Xid (PCI:0000:2a:00): 79, x\n",
    b"2026-12-01T21:31:52+0000 gpu-node-07 kernel: NVRM: The NVIDIA GPU 0000:2a:00.0\n",
    b"2026-12-01T21:31:52+0000 gpu-node-07 kernel: NVRM: (PCI ID: 10de:2330) installed in this system has\n",
    b"2026-12-01T21:31:52+0000 gpu-node-07 kernel: NVRM: fallen off the bus and is not responding to commands.\n",
    b"2026-12-01T21:31:52,254954+00:00 usb 1-1: dmesg --time-format=iso\n",
    b"Dec  1 21:31:52 gpu-node-07 systemd[1]: Started something.\n",
    b"   \n",
    b"\n",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.one_of(st.sampled_from(EDGES), st.sampled_from([b.encode() + b"\n" for b in BOOT])), max_size=60),
       st.integers(1, 4096), st.booleans())
def test_edges_and_block_boundaries_read_the_same(pieces, block, final_newline):
    data = b"".join(pieces)
    if not final_newline:
        data = data.rstrip(b"\n")
    old = scan_fast.BLOCK
    scan_fast.BLOCK = block  # lines across every boundary
    try:
        same(data, explain=True)
    finally:
        scan_fast.BLOCK = old


def test_a_mixed_log_with_long_runs_reads_the_same():
    rng = random.Random(3)
    lines = []
    for _ in range(60):
        fmt = rng.choice(FORMATS)
        for i in range(100):
            text = rng.choice([e["text"] for e in CORPUS]) if rng.random() < 0.05 else rng.choice(BOOT)
            if fmt[2] is None and fmt[1] and not splittable(text):
                text = rng.choice(BOOT)
            lines += render(text, fmt, 100.0 + i)
    data = ("\n".join(lines) + "\n").encode()
    same(data)
    fast, _ = both(data)
    assert fast[1]["lines"] == len(lines)


def test_runs_are_passed_over_where_a_log_is_plain():
    """The point of the fast path: a plain dmesg or syslog file is read in runs, not line by line."""
    boring = [b for b in BOOT if CATALOG.classify(b) is None and not b.startswith(("ACPI", "CPU", "{", "NVRM"))]
    for prefix in ("[ {i:>10}.000000] ", "Dec  1 21:31:52 gpu-node-07 kernel: [ {i}.0] ", "6,{i},{i},-;"):
        text = "".join(prefix.format(i=i) + boring[i % len(boring)] + "\n" for i in range(1000))
        items = list(scan_fast.read_lines(io.BytesIO(text.encode()), scan.KernelLogStats("t"),
                                          lambda n, raw, t=None: t, CATALOG))
        runs = [count for _, count in items if type(count) is int]
        assert sum(runs) >= 990, prefix


ADVERSARIAL = {"letters": "a" * 8000, "colons": ":" * 8000, "bracket-blank": "[ " * 4000, "tag-colon": "x: " * 2666,
               "digits": "1" * 8000, "dates": "2026-" * 1600, "hosts": ("h" * 250 + ": ") * 30, "nvrm": "NVRM: " * 1333,
               "aer": "pcieport 0000:00:1c.5: AER: " * 280, "facility": "kern :" * 1333, "brackets": "[" * 8000,
               "quotes": "> " * 4000, "panic": "Kernel panic - not syncing: " + "x" * 7900, "caller": "[ T1]" * 1600,
               "syslog": "Dec  1 21:31:52 " * 500, "iso": "2026-12-01T21:31:52+0000 " * 300}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_a_crafted_line_costs_no_more_than_a_line(name):
    """No pattern backtracks without bound: the longest line the scan reads, made of the pieces its
    patterns repeat, costs milliseconds of CPU in every reader (a log is input anyone can shape)."""
    import time

    from sentinel.records import kernel_shaped
    from sentinel.sources.kmsg import parse_log_line

    runs, _ = scan_fast.boring_regex(CATALOG)
    line = ADVERSARIAL[name]
    start = time.process_time()
    for _ in range(5):
        parsed = parse_log_line(line)
        CATALOG.classify(line)
        CATALOG.classify(parsed.message if parsed is not None and parsed.message else line)
        kernel_shaped(line)
        runs.match(line + "\n")
    assert time.process_time() - start < 1.0  # 5 rounds; ~1 ms a round here, exponential backtracking takes years

"""Records, shapes and explanations: real bare kernel logs are read as kernel logs, text that is no
kernel log is UNKNOWN, `--explain` shows the record and the entry, and the /dev/kmsg and
printk:console paths classify every corpus record exactly as `sentinel scan` does."""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sentinel import signatures
from sentinel.sources.kmsg import parse_log_line
from sentinel.sources.xid import XidSource
from test_signatures import records_of

REPO = Path(__file__).resolve().parents[1]
BARE = REPO / "tests" / "corpus" / "bare"
CORPUS = tomllib.loads((REPO / "tests" / "corpus" / "kernel_lines.toml").read_text())["line"]
CATALOG = signatures.default_catalog()


def scan(path_or_bytes, *args: str) -> tuple[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stdin = path_or_bytes if isinstance(path_or_bytes, bytes) else None
    kmsg = "-" if stdin is not None else str(path_or_bytes)
    r = subprocess.run([sys.executable, "-m", "sentinel", "scan", "--no-nvml", "--kmsg", kmsg, "--json", *args],
                       input=stdin, capture_output=True, timeout=120, env=env, cwd=REPO)
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("path", sorted(BARE.glob("*.txt")) + [REPO / "tests/corpus/logformats/dmesg-t.txt",
                                                              REPO / "tests/corpus/logformats/journal-cat.txt"],
                         ids=lambda p: p.stem)
def test_real_bare_kernel_logs_are_read_as_kernel_logs(path):
    rc, out = scan(path)
    kl = out["kernel_log"]
    assert kl["messages"] > 0 and kl["unreadable"] == 0, kl
    assert out["status"] != "UNKNOWN"


def test_the_bare_lore_logs_find_their_hardware_errors():
    _, out = scan(BARE / "i40e_ghes_fatal_panic.txt")
    assert {"hardware_error_reported", "hardware_error_fatal", "hardware_panic"} <= {f["kind"] for f in out["findings"]}
    _, out = scan(BARE / "cxl_rootport_uce_panic.txt")
    assert {"pcie_aer_uncorrected", "hardware_panic"} <= {f["kind"] for f in out["findings"]}


TRACEBACK = b"""Traceback (most recent call last):
  File "/opt/train.py", line 12, in <module>
    main()
  File "/opt/train.py", line 8, in main
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
RuntimeError: CUDA error: an illegal memory access was encountered
"""
PIP = b"""Collecting torch==2.13.0
  Using cached torch-2.13.0-cp311-cp311-linux_x86_64.whl (190.2 MB)
Installing collected packages: torch
Successfully installed torch-2.13.0
"""


@pytest.mark.parametrize("what", ["base64", "gzip", "traceback", "pip", "json"])
def test_text_that_is_no_kernel_log_is_unknown(what):
    rng = random.Random(53)
    data = {
        "base64": base64.encodebytes(bytes(rng.randrange(256) for _ in range(3000))),
        "gzip": gzip.compress(b"[ 1.0] NVRM: Xid (PCI:0000:2a:00): 79, pid=1, name=x, GPU has fallen off the bus.\n" * 50),
        "traceback": TRACEBACK,
        "pip": PIP,
        "json": b'{"level": "info", "msg": "step 10", "loss": 0.5}\n{"level": "warn", "msg": "slow"}\n',
    }[what]
    rc, out = scan(data)
    assert (rc, out["status"]) == (3, "UNKNOWN"), out["kernel_log"]
    assert out["findings"] == []


def test_explain_shows_the_joined_record_the_entry_and_what_was_not_counted(tmp_path):
    log = tmp_path / "k.log"
    log.write_text("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
                   "[ 1843.308146] NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
                   "[ 1843.308147] NVRM: fallen off the bus and is not responding to commands.\n"
                   "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).\n")
    rc, out = scan(log, "--explain")
    assert rc == 2
    [f] = out["findings"]
    assert f["signature"] == "fallen_off_bus_multiline" and f["record"].count("\n") == 2
    assert [m["lineno"] for m in out["not_counted"]] == [4]
    text = subprocess.run([sys.executable, "-m", "sentinel", "scan", "--no-nvml", "--kmsg", str(log), "--explain"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
                          cwd=REPO).stdout
    assert "record, lines 1-3 (joined):" in text and "entry fallen_off_bus_multiline: kind gpu_fallen_off_bus" in text
    assert "not counted: 1 record(s)" in text and "| NVRM: The NVIDIA probe routine failed" in text


def _parts(entry: dict) -> list[str]:
    """The records of a corpus entry, each as the kernel paths deliver a record: its message."""
    out = []
    for line in entry["text"].replace("\\x0a", "\n").split("\n"):
        parsed = parse_log_line(line)
        out.append(parsed.message if parsed is not None and parsed.kind in ("kernel", "bare") else line.strip())
    return out


SPLIT = [e for e in CORPUS if e["kind"] and "\n" in e["text"] and all(p.startswith("NVRM:") for p in _parts(e))]
ONE = [e for e in CORPUS if "\n" not in e["text"] and "\\x0a" not in e["text"]]


@pytest.mark.parametrize("path", ["kmsg", "ebpf_xid"])
def test_the_kernel_paths_classify_every_corpus_record_as_scan_does(path):
    """/dev/kmsg hands over each record's message; printk:console the same, once the kernel's
    prefix filter passed it (a message of a wildcard family from another driver does not pass:
    there the ras:aer_event tracepoint sees it)."""
    prefixes = CATALOG.prefixes()
    for entry in ONE + SPLIT:
        src = XidSource(use_ebpf=False, kmsg_fallback=False)
        records = _parts(entry)
        if path == "ebpf_xid" and not all(r.startswith(prefixes) for r in records):
            continue
        for record in records:
            src._on_line(record, path)
        xids, events = src.drain()
        got = [("xid", x.xid) for x in xids] + [(e.detail["kind"], None) for e in events]
        want = [(m.kind, m.xid if m.kind == "xid" else None) for m in records_of(entry["text"])]
        # the live path counts an Xid only when the driver's own parser reads it whole (its bus id)
        want = [w for w in want if w[0] != "xid" or next(iter(records_of(entry["text"]))).pci_bus_id]
        assert got == want, entry["text"]

"""`sentinel scan` reads the kernel-log formats operators have: real dmesg and journalctl output
captured on this machine (tests/corpus/logformats/, see capture.py there), the documented syslog
file formats, and never answers OK about a line it could not read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sentinel.sources.kmsg import parse_log_line

REPO = Path(__file__).resolve().parents[1]
FORMATS = REPO / "tests" / "corpus" / "logformats"
DMESG = sorted(FORMATS.glob("dmesg*.txt"))
JOURNAL = sorted(FORMATS.glob("journal-*.txt"))
XID79 = "NVRM: Xid (PCI:0000:2a:00): 79, pid=1903, name=python3, GPU has fallen off the bus."


def scan(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "sentinel", "scan", "--no-nvml", *args], input=stdin,
                          capture_output=True, timeout=120, env=env, cwd=REPO)


def scan_json(path: Path) -> tuple[int, dict]:
    r = scan("--kmsg", str(path), "--json")
    return r.returncode, json.loads(r.stdout)


def test_the_captures_cover_every_format_the_issue_names():
    names = {p.stem for p in FORMATS.glob("*.txt")}
    assert {"dmesg", "dmesg-H", "dmesg-x", "dmesg-e", "dmesg-iso", "dmesg-T", "dmesg-r", "journal-short-precise",
            "journal-short-monotonic", "journal-short", "syslog"} <= names


@pytest.mark.parametrize("path", DMESG + [FORMATS / "syslog.txt"], ids=lambda p: p.stem)
def test_real_dmesg_output_in_every_format_is_read_whole_and_ok(path):
    rc, out = scan_json(path)
    kl = out["kernel_log"]
    others = sum(1 for line in path.read_text().splitlines() if "systemd[1]:" in line)
    assert (rc, out["status"], kl["unreadable"]) == (0, "OK", 0), kl
    assert kl["lines"] == len(path.read_text().splitlines()) and kl["messages"] == kl["lines"] - others


@pytest.mark.parametrize("path", [p for p in DMESG if p.stem != "dmesg-t"], ids=lambda p: p.stem)
def test_an_xid_in_each_dmesg_format_is_critical(path, tmp_path):
    """The Xid line carries the prefix of the capture's own last line (its message swapped)."""
    lines = path.read_text().splitlines()
    bare = (FORMATS / "dmesg-t.txt").read_text().splitlines()
    last, message = lines[-1], bare[len(lines) - 1]
    plain = last.replace("\x1b[0m", "").replace("\x1b[33m", "")  # --color: the message's own highlighting
    assert plain.endswith(message.replace("\x1b[0m", ""))
    prefix = plain[: len(plain) - len(message)]
    log = tmp_path / path.name
    log.write_text(path.read_text() + prefix + XID79 + "\n")
    rc, out = scan_json(log)
    assert rc == 2 and out["kernel_log"]["unreadable"] == 0
    assert [(f["lineno"], f["kind"], f["xid"], f["pci_bus_id"]) for f in out["findings"]] == \
        [(len(lines) + 1, "xid", 79, "0000:2a:00.0")]


@pytest.mark.parametrize("path", JOURNAL, ids=lambda p: p.stem)
def test_journalctl_k_in_every_short_mode_finds_the_xid_and_the_record_over_three_lines(path):
    rc, out = scan_json(path)
    assert rc == 2 and out["kernel_log"]["unreadable"] == 0, out["kernel_log"]
    kinds = [(f["kind"], f["pci_bus_id"]) for f in out["findings"]]
    assert ("xid", "0000:2a:00.0") in kinds
    if path.stem != "journal-cat":  # -o cat prints the record's lines without a mark that joins them
        assert ("gpu_fallen_off_bus", "0000:2a:00.0") in kinds


def test_the_issue_s_dmesg_h_pipe_is_no_longer_ok_when_it_holds_an_xid():
    text = (FORMATS / "dmesg-H.txt").read_text() + f"[  +0.000011] {XID79}\n"
    r = scan("--kmsg", "-", stdin=text.encode())
    assert r.returncode == 2 and r.stdout.decode().startswith("SENTINEL CRITICAL - 1 critical")


@pytest.mark.parametrize("stranger", [
    "Tue 2026-12-01 21:31:52.995111 UTC [s=5d0c;i=1;b=5d0c;m=0;t=1;x=1]",  # journalctl -o verbose
    '{"__CURSOR":"s=5d0c","MESSAGE":"NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus."}',  # -o json
    "MESSAGE=NVRM: Xid (PCI:0000:2a:00): 79, pid=1903, name=python3, GPU has fallen off the bus.",  # -o export
    "Dec 1 21:31 NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus.",  # a time without seconds
    "kern.warn: NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus.",  # a facility.level of no format
])
def test_a_line_in_no_known_format_makes_the_verdict_unknown_with_a_count(stranger, tmp_path):
    log = tmp_path / "mixed.log"
    good = (FORMATS / "dmesg.txt").read_text().splitlines()
    log.write_text("\n".join(good[:5] + [stranger] + good[5:]) + "\n")
    rc, out = scan_json(log)
    assert (rc, out["status"]) == (3, "UNKNOWN")
    assert out["kernel_log"]["unreadable"] == 1 and out["kernel_log"]["first_unreadable_line"] == 6
    r = scan("--kmsg", str(log))
    assert r.stdout.decode().startswith("SENTINEL UNKNOWN - 0 critical, 0 warning, 0 info finding(s); 0 GPU(s); "
                                        "1 unreadable kernel-log line(s)")
    assert "the first at line 6" in r.stdout.decode()


def test_a_bare_line_of_no_kernel_shape_before_the_first_timestamped_one_is_unreadable_but_a_bare_log_is_read():
    good = (FORMATS / "dmesg.txt").read_text()
    r = scan("--kmsg", "-", "--json", stdin=("new device attached\n" + good).encode())
    assert r.returncode == 3 and json.loads(r.stdout)["kernel_log"]["first_unreadable_line"] == 1
    rc, out = scan_json(FORMATS / "dmesg-t.txt")
    assert rc == 0 and out["kernel_log"]["unreadable"] == 0


def test_a_bare_kernel_message_in_a_prefixed_log_is_a_record_of_its_own():
    """A bare line with a kernel message's shape (a subsystem tag) is read, not counted unreadable
    and not joined to the line before it (pasted logs mix the two)."""
    good = (FORMATS / "dmesg.txt").read_text()
    r = scan("--kmsg", "-", "--json", stdin=("usb 1-1: new device\n" + good + XID79 + "\n").encode())
    out = json.loads(r.stdout)
    assert r.returncode == 2 and out["kernel_log"]["unreadable"] == 0
    assert [(f["lineno"], f["xid"]) for f in out["findings"]] == [(len(good.splitlines()) + 2, 79)]


def test_a_record_the_paste_wrapped_over_two_lines_is_one_finding():
    """https://github.com/BurntSushi/ripgrep/issues/2896's AMD status line, wrapped as a narrow
    terminal or a mail client does: the second half carries no prefix and continues the record."""
    good = (FORMATS / "dmesg.txt").read_text()
    wrapped = ("[  12.000001] [Hardware Error]: CPU:2 (19:21:0)\n"
               "MC5_STATUS[-|UE|MiscV|AddrV|PCC|TCC|SyndV|-|-|-]: 0xbea0000001000108\n")
    r = scan("--kmsg", "-", "--json", stdin=(good + wrapped).encode())
    out = json.loads(r.stdout)
    assert r.returncode == 2 and out["kernel_log"]["unreadable"] == 0
    assert [(f["lineno"], f["kind"]) for f in out["findings"]] == [(len(good.splitlines()) + 1, "machine_check_uncorrected")]


@pytest.mark.parametrize("text", ["", "-- No entries --\n", "\n\n"])
def test_a_log_without_a_kernel_message_is_unknown(text):
    r = scan("--kmsg", "-", stdin=text.encode())
    assert r.returncode == 3 and "no kernel message in stdin" in r.stdout.decode()


def test_a_critical_finding_stands_over_unreadable_lines_a_warning_does_not():
    sxid = "[ 5.0] nvidia-nvswitch1: SXid (PCI:0000:02:00.0): 22013, Non-fatal, Link 00 Minion Link DLREQ interrupt\n"
    junk = "MESSAGE=whatever\n"
    r = scan("--kmsg", "-", stdin=(sxid + junk).encode())
    assert r.returncode == 3 and r.stdout.decode().startswith("SENTINEL UNKNOWN - 0 critical, 1 warning")
    r = scan("--kmsg", "-", stdin=(sxid + junk + f"[ 6.0] {XID79}\n").encode())
    assert r.returncode == 2 and r.stdout.decode().startswith("SENTINEL CRITICAL - 1 critical, 1 warning")


def test_records_user_space_wrote_to_kmsg_are_not_kernel_messages():
    """Facility kern (0) cannot be written from user space: <14> and -x 'user' lines are not the driver's."""
    for line in (f"<12>{XID79}", f"12,1,2,-;{XID79}", f"user  :warn  : [ 5.0] {XID79}"):
        assert parse_log_line(line).kind == "other"
        r = scan("--kmsg", "-", "--json", stdin=(f"<6>[ 1.0] usb 1-1: new device\n{line}\n").encode())
        assert r.returncode == 0 and json.loads(r.stdout)["findings"] == []
    assert parse_log_line(f"<4>{XID79}").message == XID79


def test_the_ring_buffer_of_this_machine_is_read_whole():
    """The default source, /dev/kmsg now: every record carries its header, all of them are read."""
    r = scan("--json")
    out = json.loads(r.stdout)
    kl = out["kernel_log"]
    assert kl["source"] == "/dev/kmsg" and kl["lines"] > 0 and kl["unreadable"] == 0, kl
    # other tests on this machine may have filled the ring with user-space records (facility user):
    # those are read and are no kernel message; with none left, the scan cannot vouch for the kernel
    if kl["messages"] == 0:
        assert (r.returncode, out["status"]) == (3, "UNKNOWN")


def test_scan_into_a_closed_pipe_ends_with_a_message_and_its_verdict():
    """`sentinel scan | head -1`: no traceback; the scan's own exit code is still the verdict."""
    lines = "".join(f"[ {i}.0] {XID79}\n" for i in range(3000))
    script = (f"{sys.executable} -m sentinel scan --no-nvml --kmsg - | head -1; "
              "echo \"rc=${PIPESTATUS[0]}\" >&2")
    r = subprocess.run(["bash", "-c", script], input=lines.encode(), capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    err = r.stderr.decode()
    assert r.stdout.decode().startswith("SENTINEL CRITICAL - 3000 critical") and r.stdout.count(b"\n") == 1
    assert "Traceback" not in err and "broken pipe" in err and "rc=2" in err

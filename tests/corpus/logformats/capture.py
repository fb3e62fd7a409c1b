"""Capture real kernel-log text formats for tests/test_log_formats.py (run as root, once; the
files are committed). What it writes, all from this machine's own ring buffer (its first lines):

* ``dmesg*.txt``: util-linux dmesg in each time format and decoration operators use;
* ``journal-*.txt``: journalctl -k in each short output mode, read from a journal file that
  systemd-journal-remote built from the same kernel messages (the machine has no journald), with
  two more kernel-transport entries: an Xid 79 and a message over three lines;
* ``syslog.txt``: the same messages in the documented syslog file formats (rsyslog's
  RSYSLOG_TraditionalFileFormat and RSYSLOG_FileFormat, with and without the host name, the day
  with one space as some pastes have it, a bare ``kernel:`` prefix), built by hand: no syslog
  daemon runs here.

Nothing is written to /dev/kmsg (other tests on this machine read it).

    sudo python3 tests/corpus/logformats/capture.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
LINES = 40
HOST = "gpu-node-07"
XID79 = "NVRM: Xid (PCI:0000:2a:00): 79, pid=1903, name=python3, GPU has fallen off the bus."
MULTI = "NVRM: The NVIDIA GPU 0000:2a:00.0\nNVRM: (PCI ID: 10de:2330) installed in this system has\nNVRM: fallen off the bus and is not responding to commands."
DMESG = {"dmesg": [], "dmesg-r": ["-r"], "dmesg-T": ["-T"], "dmesg-H": ["-H"], "dmesg-e": ["-e"], "dmesg-x": ["-x"],
         "dmesg-x-T": ["-x", "-T"], "dmesg-d": ["-d"], "dmesg-iso": ["--time-format=iso"],
         "dmesg-delta": ["--time-format=delta"], "dmesg-t": ["-t"], "dmesg-color": ["--color=always"]}
JOURNAL = ("short", "short-precise", "short-monotonic", "short-iso", "short-iso-precise", "short-full", "short-unix", "cat")


def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TZ": "UTC", "LC_ALL": "C"}).stdout


def head(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines()[:LINES])


def main() -> None:
    for name, flags in DMESG.items():
        (HERE / f"{name}.txt").write_text(head(run("dmesg", *flags)))
    raw = run("dmesg", "-r").splitlines()[:LINES]
    boot_realtime = int(time.time() * 1e6) - int(float(run("cat", "/proc/uptime").split()[0]) * 1e6)
    entries = []
    for line in raw:
        m = re.match(r"<(\d+)>\[\s*(\d+)\.(\d+)\] (.*)", line)
        prio, sec, usec, msg = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
        entries.append((prio & 7, sec * 1_000_000 + usec, msg))
    last = entries[-1][1]
    entries += [(4, last + 1000, XID79), (3, last + 2000, MULTI)]
    boot = "5d0c1a2b3c4d4e5f8a9b0c1d2e3f4a5b"
    export = []
    for prio, mono, msg in entries:
        fields = [f"__REALTIME_TIMESTAMP={boot_realtime + mono}", f"__MONOTONIC_TIMESTAMP={mono}", f"_BOOT_ID={boot}",
                  "_TRANSPORT=kernel", "SYSLOG_FACILITY=0", "SYSLOG_IDENTIFIER=kernel", f"PRIORITY={prio}",
                  f"_HOSTNAME={HOST}"]
        text = "".join(f + "\n" for f in fields)
        data = msg.encode()
        if b"\n" in data:  # the export format's binary field form
            text += "MESSAGE\n"
            blob = text.encode() + len(data).to_bytes(8, "little") + data + b"\n"
        else:
            blob = (text + f"MESSAGE={msg}\n").encode()
        export.append(blob)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.export"
        src.write_bytes(b"\n".join(export) + b"\n")
        journal = Path(tmp) / "kernel.journal"
        subprocess.run(["/lib/systemd/systemd-journal-remote", "-o", str(journal), str(src)], check=True,
                       capture_output=True, timeout=60)
        for mode in JOURNAL:
            out = run("journalctl", "--file", str(journal), "-k", "--no-pager", "--utc", "-o", mode)
            (HERE / f"journal-{mode}.txt").write_text(out)
    msgs = run("dmesg", "-t").splitlines()[:LINES]
    stamps = run("dmesg").splitlines()[:LINES]
    ts = [s[: s.index("]") + 1] for s in stamps]
    t0 = time.gmtime(boot_realtime / 1e6)
    day = time.strftime("%b %e %H:%M:%S", t0)
    one_space = re.sub(r" +", " ", day)
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", t0) + ".000000+00:00"
    forms = [f"{day} {HOST} kernel: {{ts}} {{msg}}", f"{day} {HOST} kernel: {{msg}}", f"{iso} {HOST} kernel: {{msg}}",
             f"{day} kernel: {{ts}} {{msg}}", f"{one_space} {HOST} kernel: {{msg}}", "kernel: {msg}"]
    out = []
    for form in forms:
        out += [form.format(ts=t, msg=m) for t, m in zip(ts[:6], msgs[:6])]
        out.append(f"{day} {HOST} systemd[1]: Started session-4.scope - Session 4 of User root.")
    (HERE / "syslog.txt").write_text("".join(line + "\n" for line in out))


if __name__ == "__main__":
    main()

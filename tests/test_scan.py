"""`sentinel scan` and `sentinel explain`: Nagios exit codes, the JSON findings, malformed input, an
unreadable file, and a 100 MB log streamed in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentinel.sources import simulated

REPO = Path(__file__).resolve().parents[1]
FINDING_KEYS = {"lineno", "kind", "severity", "pci_bus_id", "gpu", "xid", "action", "message"}


def scan(*args: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "sentinel", "scan", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture
def state(tmp_path):
    path = tmp_path / "gpus.json"
    simulated.write_state(path, simulated.healthy_state(4))  # GPU 1 is 0000:2a:00.0
    return path


def log(tmp_path, *lines: str) -> Path:
    path = tmp_path / "kern.log"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_clean_node_is_ok(tmp_path, state):
    r = scan("--simulate", str(state), "--kmsg", str(log(tmp_path, "[ 1.0] usb 1-1: new device",
                                                            "[ 1.1] NVRM: GPU at PCI:0000:2a:00: GPU-5e0a1c2d")))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith("SENTINEL OK - 0 critical, 0 warning, 0 info")


def test_fallen_off_the_bus_without_xid_is_critical_for_that_gpu_with_exact_json(tmp_path, state):
    path = log(tmp_path, "[ 10.0] usb 1-1: new device",
               "[ 11.0] NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.",
               "[ 12.0] EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0",
               "[ 13.0] NVRM: Xid (PCI:0000:18:00): 13, pid=77, name=train, Graphics Exception")
    r = scan("--simulate", str(state), "--kmsg", str(path), "--json")
    assert r.returncode == 2
    out = json.loads(r.stdout)
    assert set(out) >= {"findings", "gpus"}
    assert all(set(f) == FINDING_KEYS for f in out["findings"])
    assert out["findings"] == [
        {"lineno": 2, "kind": "gpu_fallen_off_bus", "severity": "critical", "pci_bus_id": "0000:2a:00.0", "gpu": 1,
         "xid": None, "action": "migrate", "message": "NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus."},
        {"lineno": 3, "kind": "host_memory_ce", "severity": "warning", "pci_bus_id": None, "gpu": None, "xid": None,
         "action": "alert", "message": "EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"},
        {"lineno": 4, "kind": "xid", "severity": "info", "pci_bus_id": "0000:18:00.0", "gpu": 0, "xid": 13,
         "action": "alert", "message": "NVRM: Xid (PCI:0000:18:00): 13, pid=77, name=train, Graphics Exception"},
    ]
    verdicts = {g["index"]: g["verdict"] for g in out["gpus"]}
    assert verdicts == {0: "ok", 1: "critical", 2: "ok", 3: "ok"}


def test_warning_exit_for_an_sxid_and_nvml_findings_have_no_line(tmp_path, state):
    simulated.inject(state, 2, ["remap-pending"])
    r = scan("--simulate", str(state), "--kmsg", str(log(tmp_path, "nvidia-nvswitch1: SXid (PCI:0000:02:00.0): 22013, "
                                                                  "Non-fatal, Link 00 Minion Link DLREQ interrupt")), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 2  # the pending remap migrates: critical
    nvml = [f for f in out["findings"] if f["lineno"] is None]
    assert [(f["kind"], f["gpu"], f["severity"], f["action"]) for f in nvml] == [("remap_pending", 2, "critical", "migrate")]
    simulated.inject(state, 2, ["reset"])
    fresh = tmp_path / "fresh.json"
    simulated.write_state(fresh, simulated.healthy_state(4))
    r = scan("--simulate", str(fresh), "--kmsg", str(tmp_path / "kern.log"))
    assert r.returncode == 1 and r.stdout.decode().startswith("SENTINEL WARNING - 0 critical, 1 warning")


def test_recovery_action_from_nvml_is_a_finding(tmp_path, state):
    simulated.inject(state, 3, ["set=recovery_action:4"])
    r = scan("--simulate", str(state), "--kmsg", str(log(tmp_path, "nothing here")), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 2
    assert [(f["kind"], f["gpu"], f["action"]) for f in out["findings"]] == [("recovery_action", 3, "migrate")]


def test_malformed_input_is_counted_and_ignored(tmp_path, state):
    path = tmp_path / "bad.log"
    path.write_bytes(b"\xff\xfe garbage \x00 with NUL\n" + b"A" * 20000 + b"\n" + b"NVRM: GPU 0000:2a:00.0: GPU has fallen \xff\n"
                     + b"NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.\n" + b"no newline at the end")
    r = scan("--simulate", str(state), "--kmsg", str(path), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 2
    assert [f["lineno"] for f in out["findings"]] == [4]
    assert out["kernel_log"]["lines"] == 5 and out["kernel_log"]["malformed"] == 3


def test_stdin_and_a_dmesg_record_over_several_lines(state):
    text = ("[ 1843.308145] NVRM: The NVIDIA GPU 0000:2a:00.0\n"
            "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
            "               NVRM: fallen off the bus and is not responding to commands.\n"
            "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).\n")
    r = scan("--simulate", str(state), "--kmsg", "-", "--json", stdin=text.encode())
    out = json.loads(r.stdout)
    assert r.returncode == 2
    assert [(f["lineno"], f["kind"], f["gpu"]) for f in out["findings"]] == [(1, "gpu_fallen_off_bus", 1)]


@pytest.mark.parametrize("what", ["missing", "directory", "unreadable"])
def test_an_unreadable_log_is_a_clear_error_and_unknown(tmp_path, state, what, attacker):
    path = {"missing": tmp_path / "nope.log", "directory": tmp_path}.get(what, tmp_path / "secret.log")
    if what == "unreadable":
        path.write_text("NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.\n")
        path.chmod(0o600)
        shared = Path("/tmp") / f"sentinel-scan-{os.getpid()}"
        shared.mkdir(exist_ok=True)
        os.chmod(shared, 0o755)
        try:
            target = shared / "secret.log"
            target.write_text(path.read_text())
            target.chmod(0o600)
            r = attacker.run([attacker_python(), "-m", "sentinel", "scan", "--no-nvml", "--kmsg", str(target)],
                             env={"PYTHONPATH": str(REPO)})
            assert r.returncode == 3, r.stderr
            assert "cannot read" in r.stderr and "Permission denied" in r.stderr
            assert r.stdout.startswith("SENTINEL UNKNOWN")
        finally:
            for p in shared.iterdir():
                p.unlink()
            shared.rmdir()
        return
    r = scan("--simulate", str(state), "--kmsg", str(path))
    assert r.returncode == 3
    assert b"cannot read" in r.stderr and r.stdout.decode().startswith("SENTINEL UNKNOWN")


def attacker_python() -> str:
    from conftest import SYSTEM_PYTHON

    return SYSTEM_PYTHON


def test_bad_simulated_state_is_unknown(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{half")
    r = scan("--simulate", str(bad), "--kmsg", str(log(tmp_path, "x")), "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["status"] == "UNKNOWN"


def test_100_mb_log_is_streamed_in_bounded_memory(tmp_path, state):
    """100 MB of kernel log (with a finding every 10,000 lines) costs no more memory than a small one."""
    path = tmp_path / "big.log"
    filler = b"[ 1234.567890] usb 1-1: reset high-speed USB device number 2 using xhci_hcd and some padding\n"
    block = filler * 9999 + b"[ 1234.567891] NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.\n"
    blocks = 0
    with open(path, "wb") as f:
        while f.tell() < 100 * 1024 * 1024:
            f.write(block)
            blocks += 1
    size = path.stat().st_size
    small = log(tmp_path, "NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.")

    def peak_rss_kb(target: Path) -> tuple[int, float, dict]:
        code = ("import resource, sys, io, json, contextlib\nfrom sentinel.cli import main\nout = io.StringIO()\n"
                "with contextlib.redirect_stdout(out):\n"
                f"    rc = main(['scan', '--no-nvml', '--json', '--kmsg', {str(target)!r}])\n"
                "print(rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, out.getvalue())")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        rc, rss, payload = r.stdout.split(" ", 2)
        return int(rss), time.monotonic() - t0, {"rc": int(rc), **json.loads(payload)}

    small_rss, _, _ = peak_rss_kb(small)
    big_rss, seconds, out = peak_rss_kb(path)
    assert out["rc"] == 2
    assert out["kernel_log"]["lines"] == blocks * 10000 and out["kernel_log"]["malformed"] == 0
    assert len(out["findings"]) == blocks  # one per block, each listed (fewer than MAX_FINDINGS)
    assert out["findings"][0]["lineno"] == 10000 and out["findings"][-1]["lineno"] == blocks * 10000
    assert big_rss - small_rss < 40 * 1024, f"scanning {size / 1e6:.0f} MB grew peak RSS by {(big_rss - small_rss) / 1024:.1f} MB"
    assert seconds < 300


def test_findings_beyond_the_cap_are_counted_not_kept(tmp_path):
    from sentinel import scan as scan_mod

    path = log(tmp_path, *["NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus."] * (scan_mod.MAX_FINDINGS + 5))
    r = scan("--no-nvml", "--kmsg", str(path), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 2 and len(out["findings"]) == scan_mod.MAX_FINDINGS
    assert out["kernel_log"]["findings_dropped"] == 5


def test_explain_an_xid():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "sentinel", "explain", "79"], capture_output=True, text=True, env=env)
    assert r.returncode == 0
    assert r.stdout.splitlines() == ["Xid 79: GPU has fallen off the bus: RESTART_BM (node reboot); check power, cooling, PCIe",
                                     "action: migrate", "scan severity: critical"]
    r = subprocess.run([sys.executable, "-m", "sentinel", "explain", "13"], capture_output=True, text=True, env=env)
    assert "action: alert, until more than app_xid_max_per_hour" in r.stdout and "scan severity: info" in r.stdout
    r = subprocess.run([sys.executable, "-m", "sentinel", "explain", "seventy"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "not an Xid number" in r.stderr

"""systemd/sentinel.service as shipped, under a real systemd (``systemd-nspawn`` over the host's
``/usr``, see tests/nspawn.py), run from the built wheel installed into a fresh venv.

Only paths are rewritten in the unit (``/usr/local/bin/sentinel`` -> the venv's), and
``--simulate STATE`` is appended to ``ExecStart=`` because this machine has no GPU. Everything
else — Type=notify, the watchdog, ExecReload, TimeoutStopSec, the capability bounding set,
ProtectSystem=strict and the rest of the hardening — is the shipped unit's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, SYSTEM_PYTHON, make_venv, metric_value, require_ebpf
from nspawn import NSPAWN, Container

pytestmark = [pytest.mark.needs_root, pytest.mark.needs_ebpf, pytest.mark.needs_systemd, pytest.mark.slow]

UNIT = "sentinel.service"


def shipped_unit(name: str, sentinel_bin: Path, simulate: Path | None = None) -> str:
    """The unit file from systemd/, with the installed binary's path (and its venv's Python for the
    agent unit's isolated launcher) and (no GPU here) --simulate."""
    lines = []
    for line in (REPO / "systemd" / name).read_text().splitlines():
        line = line.replace("/usr/local/bin/sentinel", str(sentinel_bin))
        line = line.replace("/usr/bin/python3 -I -m sentinel", f"{sentinel_bin.parent / 'python'} -I -m sentinel")
        if simulate is not None and line.startswith("ExecStart="):
            line += f" --simulate {simulate}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def unique_bus_base() -> int:
    """Bus numbers no other test's kmsg lines use (they share the host's kernel log)."""
    return 0x80 + (os.getpid() % 60) * 2


class Node:
    """One booted container with sentinel installed from the wheel, the unit in place, not started."""

    def __init__(self, host: Path, container: Container, venv: Path, state: Path, config: Path, buses: list[str]):
        self.host, self.container, self.venv, self.state, self.config, self.buses = host, container, venv, state, config, buses

    def scrape(self) -> str:
        code = "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:9477/metrics', timeout=5).read().decode())"
        return self.container.run([sys.executable, "-c", code], namespaces="-n").stdout

    def status(self) -> dict | None:
        try:
            return json.loads(self.container.path("/run/sentinel/status.json").read_text())
        except (OSError, ValueError):
            return None

    def main_pid(self) -> int:
        return int(self.container.show(UNIT, "MainPID")["MainPID"])

    def ensure_active(self) -> None:
        self.container.run(["systemctl", "start", UNIT], timeout=120)
        assert self.container.show(UNIT, "ActiveState")["ActiveState"] == "active"


@pytest.fixture(scope="module")
def node(built_wheel):
    if os.geteuid() != 0:
        pytest.skip("systemd-nspawn needs root")
    if not os.path.exists(NSPAWN):
        pytest.skip("systemd-nspawn is missing (apt-get install systemd-container)")
    require_ebpf("printk:console")
    # not under /tmp or /var/tmp: the unit's PrivateTmp=yes hides both; 0755 so a job user can reach the venv
    host = Path(tempfile.mkdtemp(prefix="sentinel-nspawn-", dir="/var/lib"))
    os.chmod(host, 0o755)
    container = None
    try:
        venv = host / "venv"
        make_venv(venv, str(built_wheel), python=SYSTEM_PYTHON)
        sentinel_bin = venv / "bin" / "sentinel"
        state = host / "sim" / "gpus.json"
        state.parent.mkdir()
        base = unique_bus_base()
        buses = [f"00000000:{base + i:02X}:00.0" for i in range(2)]
        r = __import__("subprocess").run([str(sentinel_bin), "simulate", "init", str(state), "--gpus", "2"],
                                         capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        data = json.loads(state.read_text())
        for gpu, bus in zip(data["gpus"], buses):
            gpu["pci_bus_id"] = bus
        state.write_text(json.dumps(data))
        etc = host / "etc"
        etc.mkdir()
        shutil.copy(REPO / "systemd" / "sentinel.toml", etc / "sentinel.toml")
        units = host / "units"
        units.mkdir()
        (units / UNIT).write_text(shipped_unit(UNIT, sentinel_bin, simulate=state))
        container = Container(host, f"sntl-{os.getpid()}", binds=[(str(etc), "/etc/sentinel")],
                              ro_binds=[(str(units / UNIT), f"/etc/systemd/system/{UNIT}")])
        container.boot()
        yield Node(host, container, venv, state, etc / "sentinel.toml", buses)
    finally:
        if container is not None:
            container.halt()
        shutil.rmtree(host, ignore_errors=True)


def test_the_unit_is_the_shipped_one_with_only_paths_rewritten(node):
    shipped = (REPO / "systemd" / UNIT).read_text().splitlines()
    running = node.container.path(f"/etc/systemd/system/{UNIT}").read_text().splitlines()
    changed = [(a, b) for a, b in zip(shipped, running) if a != b]
    assert len(shipped) == len(running)
    assert all("/usr/local/bin/sentinel" in a for a, _ in changed)
    assert {b.split("=", 1)[0] for _, b in changed if not b.startswith("#")} == {"ExecStartPre", "ExecStart"}


def test_active_only_after_ready_and_the_probes_load_under_the_hardening(node, kmsg_writer):
    c = node.container
    c.run(["systemctl", "start", "--no-block", UNIT])
    seen: list[tuple[str, bool]] = []

    def active():
        state = c.show(UNIT, "ActiveState")["ActiveState"]
        seen.append((state, node.status() is not None))
        assert state != "failed", c.journal(UNIT)
        return state == "active"

    c.wait_for(active, timeout=120, what="sentinel.service active")
    # activating while the probes compile; active only once READY=1 came, which the daemon sends
    # after its listener is bound and its first poll wrote status.json
    assert "activating" in [s for s, _ in seen], seen
    assert seen[-1] == ("active", True)
    text = node.scrape()
    # bcc compiled and attached each probe inside the unit's sandbox
    for source in ("xid", "rank_signals", "mem_errors"):
        assert metric_value(text, "sentinel_source_up", source=source, via="ebpf") == 1.0, (source, c.journal(UNIT))
    assert "failed to load" not in c.journal(UNIT)

    # an Xid line in the host's kernel log reaches the daemon (through the eBPF probe)
    bus = node.buses[1]
    kmsg_writer(f"NVRM: Xid (PCI:0000:{bus.split(':')[1].lower()}:00): 43, pid={os.getpid()}, name=nspawn-test, Ch 00000010")

    assert c.wait_for(lambda: metric_value(node.scrape(), "sentinel_gpu_xid_errors_total", xid="43"), timeout=20,
                      what="Xid 43 counted") == 1.0
    status = node.status()
    assert [g["xid_counts"] for g in status["gpus"]] == [{}, {"43": 1}]


def test_reload_applies_a_config_and_keeps_the_old_one_on_a_bad_file(node):
    c = node.container
    node.ensure_active()
    pid = node.main_pid()
    original = node.config.read_text()
    try:
        # write in place: the file is bind-mounted into the container
        node.config.write_text(original.replace("lead_time_seconds = 600.0", "lead_time_seconds = 300.0"))
        c.run(["systemctl", "reload", UNIT], timeout=60)
        c.wait_for(lambda: metric_value(node.scrape(), "sentinel_config_reloads_total", outcome="ok") == 1.0,
                   timeout=20, what="reload ok")
        reloads = [json.loads(line) for line in c.journal(UNIT).splitlines()
                   if line.startswith("{") and '"config reload"' in line]
        assert [(r["reload_outcome"], r["applied"], r["needs_restart"]) for r in reloads] == [("ok", ["policy"], [])]

        node.config.write_text(original.replace("[policy]\n", "[policy]\nlead_time = 5\n"))  # an unknown key
        c.run(["systemctl", "reload", UNIT], timeout=60)
        c.wait_for(lambda: metric_value(node.scrape(), "sentinel_config_reloads_total", outcome="rejected") == 1.0,
                   timeout=20, what="reload rejected")
        props = c.show(UNIT, "ActiveState", "SubState", "MainPID")
        assert props == {"ActiveState": "active", "SubState": "running", "MainPID": str(pid)}
        assert "keeping the old config" in c.journal(UNIT) and "policy.lead_time: unknown key" in c.journal(UNIT)
    finally:
        node.config.write_text(original)


def test_a_blocked_loop_is_killed_by_the_watchdog_and_restarted(node):
    c = node.container
    node.ensure_active()
    before = c.show(UNIT, "NRestarts", "MainPID")
    assert before["MainPID"] != "0"
    # the loop blocks: no more WATCHDOG=1 (the test stops the process; nothing in the daemon does)
    c.run(["kill", "-STOP", before["MainPID"]])
    t0 = time.monotonic()
    c.wait_for(lambda: c.show(UNIT, "NRestarts")["NRestarts"] != before["NRestarts"], timeout=90,
               what="a watchdog restart")
    elapsed = time.monotonic() - t0
    journal = c.journal(UNIT)
    assert "Watchdog timeout" in journal and "SIGABRT" in journal, journal[-2000:]
    assert 20 < elapsed < 80  # WatchdogSec=30s
    c.wait_for(lambda: c.show(UNIT, "ActiveState")["ActiveState"] == "active", timeout=120, what="active again")
    after = c.show(UNIT, "MainPID")["MainPID"]
    assert after not in ("0", before["MainPID"])
    assert metric_value(node.scrape(), "sentinel_source_up", source="xid", via="ebpf") == 1.0


def test_stop_finishes_within_its_timeout(node):
    c = node.container
    node.ensure_active()
    timeout = c.show(UNIT, "TimeoutStopUSec")["TimeoutStopUSec"]
    assert timeout == "10s"
    c.run(["systemctl", "stop", UNIT], timeout=60)
    props = c.show(UNIT, "ActiveState", "Result")
    # Result=success: stopped by SIGTERM within TimeoutStopSec (a timeout would read "timeout")
    assert props == {"ActiveState": "inactive", "Result": "success"}, c.journal(UNIT)[-2000:]
    assert "timed out" not in c.journal(UNIT)


JOB_UID = 4717  # a user that exists only inside the container


def test_a_daemon_restart_during_a_migration_resumes_it_and_the_agent_runs_unprivileged(node):
    """The agent template unit as shipped runs the job as a non-root user; a migration that waits
    for that rank's ack survives `systemctl restart sentinel` (a package upgrade), then completes:
    cordon marker written, agent drained, and the agent unit refuses to start again."""
    c = node.container
    node.ensure_active()
    host = node.host
    agent_unit = "sentinel-agent@job.service"
    sentinel_bin = node.venv / "bin" / "sentinel"
    for name in ("passwd", "group"):
        path = c.path(f"/etc/{name}")
        existing = path.read_text() if path.exists() else ""
        root = "root:x:0:0:root:/root:/bin/sh\n" if name == "passwd" else "root:x:0:\n"
        line = f"sntljob:x:{JOB_UID}:{JOB_UID}::/nonexistent:/usr/sbin/nologin\n" if name == "passwd" else f"sntljob:x:{JOB_UID}:\n"
        path.write_text((existing or root) + line)
    out = host / "out"
    out.mkdir()
    os.chown(out, JOB_UID, JOB_UID)
    bindir = host / "bin"
    bindir.mkdir()
    (bindir / "torchrun").write_text(f"#!{node.venv / 'bin' / 'python'}\n" + (REPO / "tests/workers/fake_torchrun_rank.py").read_text())
    os.chmod(bindir / "torchrun", 0o755)
    (node.config.parent / "agent-job.env").write_text(
        f"TORCHRUN_ARGS=\nSENTINEL_AGENT_USER=sntljob\nFAKE_RANK_OUT={out}\nPATH={bindir}:/usr/bin:/bin\n")
    unit_path = c.path(f"/etc/systemd/system/{agent_unit.replace('job', '')}")
    unit_path.write_text(shipped_unit("sentinel-agent@.service", sentinel_bin))
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", agent_unit])
    c.wait_for(lambda: (out / "registered").exists(), timeout=60, what="the rank registered")
    assert (out / "registered").read_text().split() == [str(JOB_UID), "RankEndpoint"]
    pidfile = c.path("/run/sentinel/agent.pid")
    assert os.stat(pidfile).st_uid == 0 and json.loads(pidfile.read_text().splitlines()[1])["uid"] == JOB_UID

    r = __import__("subprocess").run([str(sentinel_bin), "inject", str(node.state), "--gpu", "0", "xid=79"],
                                     capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        requests = c.wait_for(lambda: sorted(p.name for p in out.glob("request-*")), timeout=30, what="the migrate request")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.journal(UNIT)[-3000:]}\n{c.journal(agent_unit)[-2000:]}") from None
    migration = c.wait_for(lambda: (node.status() or {}).get("migration"), timeout=20, what="migration in status")
    assert migration["phase"] == "requested" and f"request-{migration['request_id']}" in requests

    old_pid = node.main_pid()
    c.run(["systemctl", "restart", UNIT], timeout=120)  # the package upgrade
    assert node.main_pid() != old_pid
    resumed = c.wait_for(lambda: (node.status() or {}).get("migration"), timeout=30, what="migration after restart")
    assert resumed["request_id"] == migration["request_id"] and resumed["phase"] == "requested"
    assert any("restarted" in n for n in resumed["notes"])
    assert not c.path("/var/lib/sentinel/cordon.json").exists()

    (out / "ack-now").write_text("")
    c.wait_for(lambda: (node.status() or {}).get("migration", {}).get("phase") == "drained", timeout=60,
               what="migration drained")
    final = node.status()["migration"]
    assert final["request_id"] == migration["request_id"] and final["snapshot_step"] == 42
    marker = json.loads(c.path("/var/lib/sentinel/cordon.json").read_text())
    assert marker["request_id"] == migration["request_id"]
    c.wait_for(lambda: (out / "drained").exists(), timeout=30, what="the agent drained")
    assert (out / "drained").read_text() == "SIGTERM\n"
    # the agent unit does not come back on a cordoned node (ExecCondition=)
    time.sleep(7)  # RestartSec=5s
    assert c.show(agent_unit, "ActiveState")["ActiveState"] != "active"
    assert "resuming migration after restart" in c.journal(UNIT)

"""Running as a service: unit files, sd_notify against a real datagram socket, reload, stop."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, metric_value, wait_for
from sentinel.systemd import Notifier


class NotifySocket:
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, path: str) -> None:
        self.address = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + path[1:] if path.startswith("@") else path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []

    def collect(self, seconds: float) -> list[str]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.messages.append((time.monotonic(), self.sock.recv(4096).decode()))
            except socket.timeout:
                pass
        return [m for _, m in self.messages]

    def wait_for(self, text: str, timeout: float = 20) -> float:
        end = time.monotonic() + timeout
        seen = len(self.messages)
        while time.monotonic() < end:
            for t, m in self.messages[seen:]:
                if text in m:
                    return t
            seen = len(self.messages)
            self.collect(0.2)
        raise AssertionError(f"no {text!r} within {timeout}s; got {[m for _, m in self.messages]}")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.needs_systemd
def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    sentinel_bin = shutil.which("sentinel") or sys.executable
    for unit, name in (("sentinel.service", "sentinel.service"), ("sentinel-agent@.service", "sentinel-agent@train.service")):
        text = (REPO / "systemd" / unit).read_text().replace("/usr/local/bin/sentinel", os.path.realpath(sentinel_bin))
        (tmp_path / name).write_text(text)
        r = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / name)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert name not in r.stdout + r.stderr, r.stdout + r.stderr  # no warnings about our unit either


def test_notifier_is_a_noop_without_socket_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled and n.ready() is False
    broken = Notifier(str(tmp_path / "nobody-listens"))
    assert broken.watchdog() is False and broken.failures == 1  # logged and counted, not raised


def test_abstract_socket_names(tmp_path):
    name = f"@sentinel-test-{os.getpid()}"
    ns = NotifySocket(name)
    try:
        assert Notifier(name).ready("2 healthy")
        assert ns.collect(0.3) == ["READY=1\nSTATUS=2 healthy"]
    finally:
        ns.close()


def test_ready_after_bind_watchdog_while_healthy_and_through_a_hung_gpu_then_stopping(tmp_path, start_daemon):
    from sentinel.sources import simulated

    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.25\nnvml_deadline_seconds = 0.5\n")
    ns = NotifySocket(str(tmp_path / "notify.sock"))
    try:
        d = start_daemon("--simulate", str(state), "--config", str(cfg), wait=False,
                         env={"NOTIFY_SOCKET": ns.address, "WATCHDOG_USEC": "5000000"})
        t_ready = ns.wait_for("READY=1")
        # READY only after the listener is bound and the first poll wrote its status
        port = d.status["metrics_port"]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        assert any("STATUS=2 healthy" in m for _, m in ns.messages)
        ns.collect(1.5)
        pings = [t for t, m in ns.messages if m == "WATCHDOG=1" and t > t_ready]
        assert len(pings) >= 3
        simulated.inject(state, 1, ["hang"])  # an NVML call that never returns...
        t_hang = time.monotonic()
        ns.collect(3.0)
        during = [t for t, m in ns.messages if m == "WATCHDOG=1" and t > t_hang + 0.6]
        assert len(during) >= 3, "the deadline must keep the loop (and its pings) going"
        assert any("watch" in m or "failed" in m for _, m in ns.messages if m.startswith("STATUS="))
        simulated.inject(state, 1, ["unhang"])
        t_term = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(timeout=5)
        assert time.monotonic() - t_term < 4.0  # no wait on the released call, nor on a stop timeout
        assert d.proc.returncode == 0
        ns.collect(0.3)
        assert any(m == "STOPPING=1" for _, m in ns.messages)
    finally:
        ns.close()


class BlockingSource:
    """An NVML source whose poll blocks on a gate: a deliberately hung loop."""

    name = "nvml"
    driver_version = "t"
    gpus: list = []
    errors: dict = {}
    deadline = 1.0

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def start(self) -> None:
        return None

    def poll(self):
        self.gate.wait()
        return []

    def drain_xid_events(self):
        return []

    def close(self) -> None:
        self.gate.set()


def test_a_blocked_loop_stops_the_watchdog_pings(tmp_path):
    import dataclasses

    from sentinel.config import Config
    from sentinel.daemon import Daemon

    ns = NotifySocket(str(tmp_path / "n.sock"))
    cfg = Config()
    cfg = dataclasses.replace(cfg, daemon=dataclasses.replace(cfg.daemon, poll_interval_seconds=0.1,
                                                              runtime_dir=str(tmp_path / "run")),
                              metrics=dataclasses.replace(cfg.metrics, port=0, listen_address="127.0.0.1"))
    source = BlockingSource()
    daemon = Daemon(cfg, source, notifier=Notifier(ns.address))
    daemon.start()
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    try:
        ns.collect(0.8)
        assert sum(m == "WATCHDOG=1" for _, m in ns.messages) >= 3
        source.gate.clear()  # the loop now blocks inside poll
        time.sleep(0.3)
        t_block = time.monotonic()
        ns.collect(1.0)
        assert not [m for t, m in ns.messages if m == "WATCHDOG=1" and t > t_block]
    finally:
        source.gate.set()
        daemon.stop()
        loop.join(timeout=5)
        daemon.close()
        ns.close()


def test_sighup_reload_keeps_the_old_config_when_the_new_one_is_invalid(tmp_path, sim_state, start_daemon):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n")
    d = start_daemon("--simulate", str(sim_state), "--config", str(cfg))
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n[policy]\nlead_time = 5\n")  # unknown key
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: metric_value(d.scrape(), "sentinel_config_reloads_total", outcome="rejected") == 1,
             what="rejected reload counted")
    assert "policy.lead_time: unknown key" in d.log() and d.proc.poll() is None
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n[policy]\nlead_time_seconds = 300\n")
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: metric_value(d.scrape(), "sentinel_config_reloads_total", outcome="ok") == 1, what="reload ok")
    assert d.proc.poll() is None


def test_missing_or_unreadable_config_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sentinel", "run", "--config", str(tmp_path / "nope.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read config file" in r.stderr

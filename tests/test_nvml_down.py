"""No NVML is a reading (issue #23, point 7): on a GPU node whose driver is missing or broken the daemon
stays up (no exit-2 restart loop), exports sentinel_source_up{source="nvml"} 0, retries nvmlInit
with backoff, says so in `sentinel status` and the healthcheck, and an alert fires."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading

import pynvml
import pytest

from conftest import REPO, metric_value, wait_for
from fake_pynvml import FakePynvml
from sentinel.config import Config
from sentinel.daemon import Daemon
from sentinel.sources.nvml import NvmlSource

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
MON = REPO / "monitoring"


def nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_a_node_without_nvml_keeps_its_daemon_up_reporting_the_source_down(start_daemon, tmp_path):
    """The real pynvml on this machine, which has no NVIDIA driver: what a node with a broken one sees."""
    if nvml_works():
        pytest.fail("this test needs a machine where nvmlInit fails (no NVIDIA driver); this one has NVML")
    d = start_daemon("--config", str(_config(tmp_path)))  # no --simulate
    status = d.status
    assert d.proc.poll() is None
    assert status["gpus"] == [] and "nvmlInit failed" in status["nvml_error"]
    text = d.scrape()
    assert metric_value(text, "sentinel_source_up", source="nvml", via="none") == 0
    # retried with backoff while it stays up (first try at start, then from the loop)
    wait_for(lambda: metric_value(d.scrape(), "sentinel_nvml_init_failures_total") >= 3, timeout=30,
             what="nvmlInit retried")
    assert d.proc.poll() is None
    assert "NVML unavailable" in d.log() and "--simulate" in d.log()

    r = subprocess.run([sys.executable, "-m", "sentinel", "status", "--runtime-dir", str(d.runtime_dir)],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 1 and "NVML unavailable, the GPUs are not watched" in r.stderr
    r = subprocess.run(["sh", str(REPO / "deploy/slurm/sentinel-healthcheck"), "--runtime-dir", str(d.runtime_dir)],
                       capture_output=True, text=True, timeout=60, env={**ENV, "SENTINEL": f"{sys.executable} -m sentinel"})
    assert r.returncode == 3 and r.stdout.startswith("SENTINEL UNKNOWN - sentinel cannot read the GPUs"), r.stdout
    assert d.stop() == 0  # a clean stop, as any other time


def _config(tmp_path):
    path = tmp_path / "fast.toml"
    path.write_text("[daemon]\npoll_interval_seconds = 0.2\nnvml_deadline_seconds = 0.5\n")
    return path


def test_nvml_that_comes_back_is_picked_up_by_the_running_daemon(tmp_path):
    """A driver installed (or fixed) while the daemon runs: the next retry finds the GPUs."""
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, daemon=dataclasses.replace(cfg.daemon, poll_interval_seconds=0.1, nvml_deadline_seconds=0.5,
                                        runtime_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state")),
        metrics=dataclasses.replace(cfg.metrics, port=0, listen_address="127.0.0.1"))
    fake = FakePynvml(2)
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    daemon = Daemon(cfg, NvmlSource(fake, deadline_seconds=0.5, event_wait_ms=20))
    daemon.start()  # does not raise: the daemon starts blind
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    try:
        assert daemon.view.readings.sources["nvml"].up is False
        wait_for(lambda: fake.init_calls >= 2, timeout=20, what="a retry")
        fake.init_error = None
        wait_for(lambda: len(daemon.view.readings.gpus) == 2 and daemon.view.readings.sources["nvml"].up,
                 timeout=20, what="the GPUs found by a later retry")
        text = daemon.httpd.exposition().decode()
        assert metric_value(text, "sentinel_source_up", source="nvml", via="nvml") == 1
        assert metric_value(text, "sentinel_gpu_info", gpu="1") == 1
    finally:
        daemon.stop()
        loop.join(timeout=5)
        daemon.close()


def test_the_nvml_alert_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "rules", str(MON / "alerts-nvml.yml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "alerts-nvml_test.yml"], capture_output=True, text=True, timeout=60,
                       cwd=MON)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # its runbook_url names a section of docs/runbooks.md
    import re

    import yaml

    (rule,) = [r for g in yaml.safe_load((MON / "alerts-nvml.yml").read_text())["groups"] for r in g["rules"]]
    anchor = rule["annotations"]["runbook_url"].split("docs/runbooks.md#", 1)[1]
    headings = {h.strip().lower() for h in re.findall(r"^#{1,6} (.+)$", (REPO / "docs" / "runbooks.md").read_text(), re.M)}
    assert anchor in headings


def test_a_real_prometheus_fires_the_nvml_alert_on_a_daemon_without_nvml(start_daemon, tmp_path):
    """monitoring/alerts-nvml.yml (every `for:` at 0s), evaluated by a real Prometheus scraping a real
    daemon on this driverless machine: SentinelNvmlUnavailable fires for it."""
    import re
    import socket

    from test_prometheus import prometheus_api

    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    if nvml_works():
        pytest.fail("this test needs a machine where nvmlInit fails (no NVIDIA driver); this one has NVML")
    d = start_daemon("--config", str(_config(tmp_path)))
    rules = tmp_path / "alerts-nvml.yml"
    rules.write_text(re.sub(r"(?m)^(\s+for:) \S+$", r"\1 0s", (MON / "alerts-nvml.yml").read_text()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        prom_port = s.getsockname()[1]
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   f"rule_files:\n  - {rules}\n"
                   "scrape_configs:\n  - job_name: sentinel\n    static_configs:\n"
                   f"      - targets: ['127.0.0.1:{d.port}']\n")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)

    def firing():
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        data = prometheus_api(prom_port, "alerts") or {"alerts": []}
        return [a for a in data["alerts"] if a["labels"]["alertname"] == "SentinelNvmlUnavailable"
                and a["state"] == "firing"]

    try:
        (alert,) = wait_for(firing, timeout=90, interval=0.5, what="SentinelNvmlUnavailable to fire")
        assert alert["labels"]["severity"] == "critical" and alert["labels"]["source"] == "nvml"
        assert d.proc.poll() is None  # and the daemon is still up
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()

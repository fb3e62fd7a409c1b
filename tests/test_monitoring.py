"""Alert rules through promtool (check + unit tests) and a dashboard whose queries name real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from conftest import REPO

MON = REPO / "monitoring"


@pytest.mark.needs_prometheus
def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "rules", str(MON / "alerts.yml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 9 rules found" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True, timeout=60, cwd=MON)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_dashboard_queries_name_exported_metrics(sim_state, start_daemon):
    from sentinel.sources import simulated

    d = start_daemon("--simulate", str(sim_state))
    simulated.inject(sim_state, 0, ["xid=79"])
    import time

    time.sleep(1.5)
    exported = set(re.findall(r"^(sentinel_[a-z_]+)", d.scrape(), re.M)) | {
        "sentinel_ebpf_events_lost_total",  # present when eBPF is loaded (disabled here)
        "sentinel_gpu_predicted_failure_seconds"}  # present once a trend forecasts
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(sentinel_[a-z_]+)", target["expr"]):
                assert name in exported, f"panel {panel['title']!r} queries {name}, which the daemon does not export"

"""Sticky GPU conditions are judged by their presence, not only by a change: a double-bit error
(volatile uncorrectable ECC > 0), a pending page retirement, a pending row remap or a row-remap
failure that a GPU already holds when the daemon starts, or when `sentinel scan` looks, trips its
rule on the first poll."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import metric_value, wait_for
from sentinel.config import PolicyConfig
from sentinel.policy import Policy, PolicyState
from sentinel.readings import GpuReading, NodeReadings
from sentinel.sources import simulated

REPO = Path(__file__).resolve().parents[1]
STICKY = [("ecc_uncorrected_volatile", 2.0, "ecc_uncorrected", "migrate"),
          ("retired_pages_pending", 1.0, "retired_pending", "alert"),
          ("remapped_rows_pending", 1.0, "remap_pending", "migrate"),
          ("remapped_rows_failure", 1.0, "remap_failure", "migrate")]


def first_poll(values: dict[str, float]):
    gpu = GpuReading(0, "GPU-0", "0000:18:00.0", values=values)
    return Policy(PolicyConfig()).decide(PolicyState(), NodeReadings(0.0, "test", (gpu,)), 0.0)[1]


@pytest.mark.parametrize("field,value,rule,action", STICKY, ids=[s[2] for s in STICKY])
def test_a_condition_present_at_the_first_poll_trips_its_rule(field, value, rule, action):
    assert [(t.rule, t.action, t.gpu) for t in first_poll({field: value})] == [(rule, action, 0)]
    assert first_poll({field: 0.0}) == []


def test_a_dbe_already_counted_trips_once_then_only_new_ones_do():
    policy, state = Policy(PolicyConfig(cooldown_seconds=0)), PolicyState()
    seen = []
    for t, dbe in enumerate((2.0, 2.0, 2.0, 3.0)):
        gpu = GpuReading(0, "GPU-0", "0000:18:00.0", values={"ecc_uncorrected_volatile": dbe})
        state, trips = policy.decide(state, NodeReadings(float(t), "test", (gpu,)), float(t))
        seen += [(t, x.rule, x.message) for x in trips]
    assert seen == [(0, "ecc_uncorrected", "2 uncorrectable ECC error(s) since the last GPU reset (present at the first reading)"),
                    (3, "ecc_uncorrected", "1 new uncorrectable ECC error(s)")]


def test_a_dbe_present_at_start_trips_in_the_daemon(sim_state, start_daemon):
    simulated.inject(sim_state, 1, ["ecc-dbe=+2"])
    d = start_daemon("--simulate", str(sim_state))

    def tripped():
        text = d.scrape()
        return text if metric_value(text, "sentinel_policy_trips_total", rule="ecc_uncorrected", action="migrate") == 1 else None

    text = wait_for(tripped, timeout=20, what="ecc_uncorrected trip on the first poll")
    assert metric_value(text, "sentinel_gpu_health", gpu="1") == 3  # failed
    assert metric_value(text, "sentinel_gpu_health", gpu="0") == 0
    status = json.loads((d.runtime_dir / "status.json").read_text())
    assert [g["health"] for g in status["gpus"]] == ["healthy", "failed", "healthy", "healthy"]


def test_a_dbe_present_when_scan_runs_is_critical(sim_state, tmp_path):
    simulated.inject(sim_state, 1, ["ecc-dbe=+1"])
    log = tmp_path / "kern.log"
    log.write_text("[ 1.0] usb 1-1: new device\n")
    r = subprocess.run([sys.executable, "-m", "sentinel", "scan", "--simulate", str(sim_state), "--kmsg", str(log), "--json"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    out = json.loads(r.stdout)
    assert r.returncode == 2
    assert [(f["kind"], f["gpu"], f["severity"], f["action"]) for f in out["findings"]] == \
        [("ecc_uncorrected", 1, "critical", "migrate")]
    assert {g["index"]: g["verdict"] for g in out["gpus"]} == {0: "ok", 1: "critical", 2: "ok", 3: "ok"}

"""The simulated path end to end: a real daemon process, faults injected through the CLI,
/metrics scraped over HTTP on loopback."""

from __future__ import annotations

import subprocess
import sys

from conftest import metric_value, wait_for


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "sentinel", *args], capture_output=True, text=True, timeout=timeout)


def test_injected_faults_change_exact_metric_values(sim_state, start_daemon):
    d = start_daemon("--simulate", str(sim_state))
    text = d.scrape()
    uuid2 = "GPU-5e0a1c2d-0000-4000-8000-000000000002"
    assert metric_value(text, "sentinel_gpu_ecc_errors_total", gpu="2", type="corrected", scope="volatile") == 0
    assert metric_value(text, "sentinel_gpu_info", gpu="2", uuid=uuid2, pci_bus_id="0000:3a:00.0") == 1
    assert metric_value(text, "sentinel_gpu_health", gpu="2") == 0

    assert run_cli("inject", str(sim_state), "--gpu", "2", "ecc-sbe=+7", "pcie-replay=+3", "nvlink-crc=+11@1",
                   "xid=79", "xid=79", "xid=13", "temp=71").returncode == 0

    def changed():
        # the Xids arrive through NVML's event set and wake the daemon at once; the counters and the
        # temperature are read at its next poll: wait for both, not for the first to be published
        t = d.scrape()
        polled = metric_value(t, "sentinel_gpu_temperature_celsius", gpu="2") == 71
        return t if polled and metric_value(t, "sentinel_gpu_xid_errors_total", gpu="2", xid="13") == 1 else None

    text = wait_for(changed, what="xid 13 counted and the next poll's readings published")
    assert metric_value(text, "sentinel_gpu_ecc_errors_total", gpu="2", type="corrected", scope="volatile") == 7
    assert metric_value(text, "sentinel_gpu_ecc_errors_total", gpu="2", type="corrected", scope="aggregate") == 7
    assert metric_value(text, "sentinel_gpu_pcie_replay_total", gpu="2") == 3
    assert metric_value(text, "sentinel_gpu_nvlink_link_errors_total", gpu="2", link="1", kind="crc_flit") == 11
    assert metric_value(text, "sentinel_gpu_xid_errors_total", gpu="2", xid="79") == 2
    assert metric_value(text, "sentinel_gpu_temperature_celsius", gpu="2") == 71
    assert metric_value(text, "sentinel_gpu_ecc_errors_total", gpu="1", type="corrected", scope="volatile") == 0
    assert metric_value(text, "sentinel_gpu_health", gpu="2") == 3  # Xid 79: failed
    assert metric_value(text, "sentinel_policy_trips_total", rule="xid", action="migrate") == 1
    assert metric_value(text, "sentinel_source_up", source="nvml") == 1

    r = run_cli("status", "--runtime-dir", str(d.runtime_dir))
    assert r.returncode == 1 and "failed" in r.stdout
    assert d.stop() == 0


def test_status_exit_codes(sim_state, start_daemon, tmp_path):
    d = start_daemon("--simulate", str(sim_state))
    r = run_cli("status", "--runtime-dir", str(d.runtime_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "healthy" in r.stdout
    d.stop()
    r = run_cli("status", "--runtime-dir", str(d.runtime_dir))
    assert r.returncode == 2 and "no running daemon" in r.stderr
    r = run_cli("status", "--runtime-dir", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no running daemon" in r.stderr


def test_unsupported_field_shown_as_supported_0_not_exported(tmp_path, start_daemon):
    from sentinel.sources import simulated

    state = simulated.healthy_state(1)
    state["gpus"][0]["unsupported"] = ["pcie_replay"]
    path = tmp_path / "s.json"
    simulated.write_state(path, state)
    cfg = tmp_path / "full.toml"  # the 1s of field_supported are exported with detail = "full" only
    cfg.write_text('[metrics]\ndetail = "full"\n')
    d = start_daemon("--simulate", str(path), "--config", str(cfg))
    text = d.scrape()
    assert metric_value(text, "sentinel_gpu_field_supported", gpu="0", field="pcie_replay") == 0
    assert metric_value(text, "sentinel_gpu_field_supported", gpu="0", field="temperature_celsius") == 1
    assert metric_value(text, "sentinel_gpu_pcie_replay_total", gpu="0") is None


def test_hung_gpu_is_a_reading_not_a_hung_daemon(tmp_path, start_daemon):
    from sentinel.sources import simulated

    path = tmp_path / "s.json"
    simulated.write_state(path, simulated.healthy_state(2))
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\nnvml_deadline_seconds = 0.5\n")
    d = start_daemon("--simulate", str(path), "--config", str(cfg))
    simulated.inject(path, 1, ["hang"])
    def hung():
        t = d.scrape()
        return t if metric_value(t, "sentinel_gpu_nvml_hung", gpu="1") == 1 else None

    text = wait_for(hung, what="GPU 1 hung")
    assert metric_value(text, "sentinel_gpu_nvml_hung", gpu="0") == 0
    t0 = wait_for(lambda: d.status["time"], what="status")
    wait_for(lambda: d.status["time"] > t0 + 0.5, what="loop still polling")
    wait_for(lambda: metric_value(d.scrape(), "sentinel_policy_trips_total", rule="nvml_hung", action="migrate") == 1,
             what="nvml_hung trip")
    simulated.inject(path, 1, ["unhang"])
    wait_for(lambda: metric_value(d.scrape(), "sentinel_gpu_nvml_hung", gpu="1") == 0, what="GPU 1 recovers")


def test_bad_inputs_are_one_clear_sentence(tmp_path):
    state = tmp_path / "s.json"
    state.write_text('{"version": 1, "gpus": [')
    r = run_cli("run", "--simulate", str(state), "--runtime-dir", str(tmp_path / "r"), "--port", "0")
    assert r.returncode == 2 and "corrupt or half-written" in r.stderr and "Traceback" not in r.stderr

    cfg = tmp_path / "bad.toml"
    cfg.write_text("[policy]\nlead_time = 5\n")
    r = run_cli("run", "--config", str(cfg), "--simulate", str(state))
    assert r.returncode == 2 and "policy.lead_time: unknown key" in r.stderr and "Traceback" not in r.stderr

    # no GPU and no --simulate: the daemon stays up, blind to NVML (tests/test_nvml_down.py)


def test_port_in_use_and_unwritable_runtime_dir(sim_state, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("run", "--simulate", str(sim_state), "--runtime-dir", str(tmp_path / "r"),
                    "--listen-address", "127.0.0.1", "--port", str(port))
    assert r.returncode == 2 and "cannot listen for metrics" in r.stderr and "Traceback" not in r.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_cli("run", "--simulate", str(sim_state), "--runtime-dir", str(blocker / "sub"), "--port", "0")
    assert r.returncode == 2 and "is not writable" in r.stderr and "Traceback" not in r.stderr


def test_a_trend_only_fault_trips_the_predictor_and_starts_a_migration(sim_state, start_daemon, tmp_path):
    """Merged (#29): was test_drill's sbe-ramp drill (a whole 2-node job with a spare). The fault is
    the drill's own: 40 pages retired at once, then one more every 0.3 s — below every threshold,
    a trend only the predictor catches — under the drill's policy. What follows the trip (the
    migrate snapshot, the drain, the spare: 0 lost steps) does not depend on the rule that tripped,
    and test_drill's xid79 and dbe drills run it end to end."""
    import json
    import time

    from sentinel.sources import simulated

    cfg = tmp_path / "sentinel.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\nnode_name = \"node1\"\n"
                   "[policy]\nlead_time_seconds = 600.0\ndebounce_samples = 3\n"
                   "[actions]\nack_timeout_seconds = 30.0\n")
    d = start_daemon("--config", str(cfg), "--simulate", str(sim_state))
    assert run_cli("inject", str(sim_state), "--gpu", "0", "retired-sbe=+40").returncode == 0
    record = tmp_path / "state" / "migration.json"
    deadline = time.monotonic() + 30  # as the drill: the ramp goes on until the node is cordoned
    while not record.exists() and time.monotonic() < deadline:
        simulated.inject(sim_state, 0, ["retired-sbe=+1"])  # what the drill's ramp calls
        time.sleep(0.3)
    mig = wait_for(lambda: json.loads(record.read_text()) if record.exists() else None, what="the migration record")
    assert mig["rule"] == "trend" and mig["gpu"] == 0 and "retired_pages forecast" in mig["reason"], mig
    # the record is written by the action, before that poll publishes the trip to /metrics
    text = wait_for(lambda: (lambda t: t if metric_value(t, "sentinel_policy_trips_total", rule="trend",
                                                         action="migrate") is not None else None)(d.scrape()),
                    what="the trip on /metrics")
    assert metric_value(text, "sentinel_policy_trips_total", rule="trend", action="migrate") == 1
    assert not [line for line in text.splitlines()
                if line.startswith("sentinel_policy_trips_total{") and 'rule="trend"' not in line and not line.endswith(" 0.0")]

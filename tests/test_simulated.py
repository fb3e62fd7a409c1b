from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from sentinel.sources import simulated
from sentinel.sources.nvml import NvmlSource


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sentinel", *args], capture_output=True, text=True, timeout=60)


def test_init_and_inject_cli(tmp_path):
    state = tmp_path / "s.json"
    assert run_cli("simulate", "init", str(state), "--gpus", "8").returncode == 0
    assert len(simulated.load_state(state)["gpus"]) == 8
    r = run_cli("inject", str(state), "--gpu", "3", "ecc-sbe=+5", "ecc-dbe=+1", "retired-dbe=+2", "remap-uncorrectable=+4",
                "remap-pending", "pcie-replay=+9", "nvlink-crc=+100@2", "xid=79", "temp=91")
    assert r.returncode == 0, r.stderr
    g = simulated.load_state(state)["gpus"][3]
    assert g["ecc"] == {"corrected_volatile": 5, "uncorrected_volatile": 1, "corrected_aggregate": 5, "uncorrected_aggregate": 1}
    assert g["retired_pages"]["dbe"] == 2 and g["remapped_rows"]["uncorrectable"] == 4 and g["remapped_rows"]["pending"]
    assert g["pcie"]["replay"] == 9 and g["nvlink"][2]["crc_flit"] == 100 and g["xid_events"] == [79]
    assert g["temperature_celsius"] == 91


@pytest.mark.parametrize("fault,msg", [("ecc-sbe=lots", "expects =+N"), ("melt", "unknown fault"), ("xid=abc", "xid: expects")])
def test_bad_fault_is_a_clear_error(tmp_path, fault, msg):
    state = tmp_path / "s.json"
    simulated.write_state(state, simulated.healthy_state(1))
    r = run_cli("inject", str(state), "--gpu", "0", fault)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    r = run_cli("inject", str(state), "--gpu", "5", "lost")
    assert r.returncode == 2 and "GPUs 0..0" in r.stderr


def test_corrupt_state_is_a_clear_error(tmp_path):
    state = tmp_path / "s.json"
    state.write_text('{"version": 1, "gpus": [{"index": 0,')  # half-written
    with pytest.raises(simulated.SimulatedStateError, match="corrupt or half-written"):
        simulated.load_state(state)
    r = run_cli("inject", str(state), "--gpu", "0", "lost")
    assert r.returncode == 2 and "corrupt or half-written" in r.stderr and "Traceback" not in r.stderr


def test_concurrent_injectors_lose_nothing(tmp_path):
    state = tmp_path / "s.json"
    simulated.write_state(state, simulated.healthy_state(2))

    def worker():
        for _ in range(25):
            simulated.inject(state, 1, ["ecc-sbe=+1"])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert simulated.load_state(state)["gpus"][1]["ecc"]["corrected_volatile"] == 100


def test_corrupt_file_while_running_is_an_error_reading_not_a_crash(tmp_path):
    state = tmp_path / "s.json"
    simulated.write_state(state, simulated.healthy_state(1))
    src = NvmlSource(simulated.SimulatedNvml(state, recheck_seconds=0), deadline_seconds=0.5, event_wait_ms=20)
    src.start()
    try:
        state.write_text("{not json")
        g = src.poll()[0]
        assert g.values == {} and set(g.errors.values()) == {simulated.pynvml.NVML_ERROR_UNKNOWN}
        simulated.write_state(state, simulated.healthy_state(1))
        assert src.poll()[0].values["temperature_celsius"] == 38
    finally:
        src.close()


def test_unsupported_field_in_simulation(tmp_path):
    state = tmp_path / "s.json"
    s = simulated.healthy_state(1)
    s["gpus"][0]["unsupported"] = ["pcie_replay"]
    simulated.write_state(state, s)
    src = NvmlSource(simulated.SimulatedNvml(state), deadline_seconds=0.5, event_wait_ms=20)
    src.start()
    try:
        g = src.poll()[0]
        assert "pcie_replay" in g.unsupported and "pcie_replay" not in g.values
    finally:
        src.close()


def test_written_state_is_plain_json(tmp_path):
    state = tmp_path / "s.json"
    simulated.write_state(state, simulated.healthy_state(1))
    assert json.loads(state.read_text())["version"] == 1
    assert not list(tmp_path.glob(".s.json.*"))  # no temporary files left behind


def test_set_fault_sets_any_declared_field(tmp_path):
    state = tmp_path / "s.json"
    simulated.write_state(state, simulated.healthy_state(1))
    r = run_cli("inject", str(state), "--gpu", "0", "set=power_watts:700.5", "set=remapped_rows_pending:true",
                "set=ecc_uncorrected_aggregate:4")
    assert r.returncode == 0, r.stderr
    src = NvmlSource(simulated.SimulatedNvml(state), deadline_seconds=0.5, event_wait_ms=20)
    src.start()
    try:
        v = src.poll()[0].values
        assert (v["power_watts"], v["remapped_rows_pending"], v["ecc_uncorrected_aggregate"]) == (700.5, 1, 4)
    finally:
        src.close()
    for bad in ("set=no_such_field:1", "set=power_watts:lots", "set=power_watts:nan", "set=power_watts", "set"):
        with pytest.raises(simulated.SimulatedStateError, match="set: expects =FIELD:VALUE"):
            simulated.inject(state, 0, [bad])


def test_corrupt_file_is_an_nvml_error_on_every_call(tmp_path):
    """The Xid event thread once died with SimulatedStateError when the file broke just after start."""
    state = tmp_path / "s.json"
    simulated.write_state(state, simulated.healthy_state(1))
    nvml = simulated.SimulatedNvml(state, recheck_seconds=0)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    state.write_text("{not json")
    for call, args in ((nvml.nvmlEventSetCreate, ()), (nvml.nvmlDeviceGetCount, ()), (nvml.nvmlSystemGetDriverVersion, ()),
                       (nvml.nvmlDeviceGetHandleByIndex, (0,)), (nvml.nvmlDeviceGetPowerUsage, (handle,))):
        with pytest.raises(simulated.pynvml.NVMLError) as err:
            call(*args)
        assert err.value.value == simulated.pynvml.NVML_ERROR_UNKNOWN, call

"""One declaration per NVML field: the source, the simulator, the fake and the exporter follow it."""

from __future__ import annotations

import dataclasses
import logging

import pynvml
import pytest
from prometheus_client.exposition import generate_latest

from conftest import metric_value
from fake_pynvml import Err, FakePynvml
from sentinel import fields as nvml_fields
from sentinel.fields import MILLI, FieldDeclarationError, NvmlField
from sentinel.metrics import View, build_registry
from sentinel.readings import FIELDS, GpuReading, NodeReadings
from sentinel.sources import simulated
from sentinel.sources.nvml import NvmlSource

# Fields Sentinel does not read today, declared the way a contributor would add them: a counter
# from a plain call and two gauges taken from one call's composite result.
NEW_FIELDS = (
    NvmlField("energy_joules", "nvmlDeviceGetTotalEnergyConsumption", "sentinel_gpu_energy_joules",
              "Energy used since the driver was loaded", "counter", codec=MILLI, sim_default=5000.0, monotonic=True),
    NvmlField("memory_used_bytes", "nvmlDeviceGetMemoryInfo", "sentinel_gpu_memory_bytes", "Framebuffer memory",
              labels=(("state", "used"),), part="used", sim_path=("memory", "used"), sim_default=1 << 30),
    NvmlField("memory_total_bytes", "nvmlDeviceGetMemoryInfo", "sentinel_gpu_memory_bytes",
              labels=(("state", "total"),), part="total", sim_path=("memory", "total"), sim_default=80 << 30),
)


@pytest.fixture
def declared(monkeypatch):
    """The built-in table plus NEW_FIELDS, as if they had been added to sentinel/fields.py."""
    monkeypatch.setattr(nvml_fields, "NVML_FIELDS", nvml_fields.NVML_FIELDS + NEW_FIELDS)
    nvml_fields.check(nvml_fields.NVML_FIELDS)
    return nvml_fields.NVML_FIELDS


def polled(nvml) -> list[GpuReading]:
    src = NvmlSource(nvml, deadline_seconds=1.0, event_wait_ms=20)
    src.start()
    try:
        return src.poll()
    finally:
        src.close()


def scrape(gpus: list[GpuReading], detail: str = "fleet") -> str:
    view = View(readings=NodeReadings(time=0.0, driver_version="550.54.15", gpus=tuple(gpus)), detail=detail)
    return generate_latest(build_registry(lambda: view)).decode()


def test_builtin_table_names_real_pynvml_calls_and_constants():
    assert FIELDS == nvml_fields.names(nvml_fields.NVML_FIELDS)
    for f in nvml_fields.NVML_FIELDS + NEW_FIELDS:
        assert f.call or f.field_id, f.name
        if f.call:
            assert callable(getattr(pynvml, f.call)), f.name  # a typo here would only show on a GPU
        if f.field_id:
            assert isinstance(getattr(pynvml, f.field_id), int), (f.name, f.field_id)
        for const in f.args:
            assert isinstance(getattr(pynvml, const), int), (f.name, const)


def test_a_new_field_is_one_declaration_source_fake_simulator_exporter(declared, tmp_path):
    # The fake: the source reads the new fields through pynvml-shaped calls, defaults first.
    fake = FakePynvml(2)
    fake.behaviour[("energy_joules", 1)] = 123.456
    fake.behaviour[("memory_used_bytes", 1)] = 7 << 30
    g0, g1 = polled(fake)
    assert g0.values["energy_joules"] == 5000.0 and g0.values["memory_total_bytes"] == 80 << 30
    assert g1.values["energy_joules"] == pytest.approx(123.456) and g1.values["memory_used_bytes"] == 7 << 30
    assert len(g0.values) == len(FIELDS) + 3 and not g0.errors

    # "Not supported" on the new call is remembered and left out, as for any field.
    fake = FakePynvml(1)
    fake.behaviour[("memory_total_bytes", 0)] = Err(pynvml.NVML_ERROR_NOT_SUPPORTED)
    (g,) = polled(fake)
    assert {"memory_used_bytes", "memory_total_bytes"} <= g.unsupported and "memory_used_bytes" not in g.values

    # The simulator: a healthy state holds the declared defaults where the declaration says,
    # a state file written before the fields existed still loads, and both are served.
    state = simulated.healthy_state(2)
    assert state["gpus"][0]["memory"] == {"used": 1 << 30, "total": 80 << 30}
    assert state["gpus"][0]["energy_joules"] == 5000.0
    old = tmp_path / "old.json"
    del state["gpus"][0]["memory"], state["gpus"][0]["energy_joules"]
    state["gpus"][1]["memory"]["used"] = 3 << 30
    simulated.write_state(old, state)
    simulated.inject(old, 1, ["set=energy_joules:42.5"])  # drills inject it with no new fault
    s0, s1 = polled(simulated.SimulatedNvml(old))
    assert s0.values["memory_used_bytes"] == 1 << 30 and s0.values["energy_joules"] == 5000.0
    assert s1.values["memory_used_bytes"] == 3 << 30 and s1.values["memory_total_bytes"] == 80 << 30
    assert s1.values["energy_joules"] == 42.5

    # The exporter: metric name, type, help and labels as declared.
    text = scrape([g0, g1])
    assert "# TYPE sentinel_gpu_energy_joules_total counter" in text
    assert "# HELP sentinel_gpu_energy_joules_total Energy used since the driver was loaded" in text
    assert metric_value(text, "sentinel_gpu_energy_joules_total", gpu="1", uuid="GPU-fake-1") == pytest.approx(123.456)
    assert "# TYPE sentinel_gpu_memory_bytes gauge" in text
    assert "# HELP sentinel_gpu_memory_bytes Framebuffer memory" in text
    assert metric_value(text, "sentinel_gpu_memory_bytes", gpu="1", state="used") == 7 << 30
    assert metric_value(text, "sentinel_gpu_memory_bytes", gpu="0", state="total") == 80 << 30
    assert metric_value(scrape([g0, g1], detail="full"), "sentinel_gpu_field_supported", gpu="0", field="energy_joules") == 1


def test_a_value_without_a_declaration_is_skipped_and_counted_not_a_failed_scrape(caplog):
    gpu = GpuReading(index=0, uuid="GPU-a", pci_bus_id="0000:07:00.0",
                     values={"temperature_celsius": 50.0, "mystery_counter": 3.0, "power_watts": 300.0})
    view = View(readings=NodeReadings(time=0.0, driver_version="550", gpus=(gpu,)))
    registry = build_registry(lambda: view)
    with caplog.at_level(logging.ERROR, logger="sentinel.metrics"):
        first = generate_latest(registry).decode()
        second = generate_latest(registry).decode()
    for text in (first, second):  # the rest of the GPU's values are exported
        assert metric_value(text, "sentinel_gpu_temperature_celsius", gpu="0") == 50
        assert metric_value(text, "sentinel_gpu_power_watts", gpu="0") == 300
        assert "mystery_counter" not in text.replace('field="mystery_counter"', "")
    assert metric_value(first, "sentinel_exporter_unknown_fields_total", field="mystery_counter") == 1
    assert metric_value(second, "sentinel_exporter_unknown_fields_total", field="mystery_counter") == 2
    assert [r.getMessage() for r in caplog.records if "mystery_counter" in r.getMessage()] == [
        "reading field 'mystery_counter' has no NVML field declaration (sentinel/fields.py): not exported"]


def test_no_unknown_fields_metric_when_every_value_is_declared():
    gpu = GpuReading(index=0, uuid="GPU-a", pci_bus_id="0000:07:00.0", values={"temperature_celsius": 50.0})
    assert "sentinel_exporter_unknown_fields" not in scrape([gpu])


TEMP = next(f for f in nvml_fields.NVML_FIELDS if f.name == "temperature_celsius")
ECC = next(f for f in nvml_fields.NVML_FIELDS if f.name == "ecc_corrected_volatile")


@pytest.mark.parametrize("bad,message", [
    (dataclasses.replace(TEMP), "declared twice"),
    (dataclasses.replace(TEMP, name="t2", kind="counter", sim_path=("t2",)), "disagree on the metric type"),
    (dataclasses.replace(TEMP, name="t2", sim_path=("t2",)), "same series"),
    (dataclasses.replace(TEMP, name="t2", labels=(("sensor", "x"),), sim_path=("t2",)), "disagree on the metric type or label names"),
    (dataclasses.replace(TEMP, name="t2", metric="sentinel_gpu_t2", help="", sim_path=("t2",)), "exactly one help text"),
    (dataclasses.replace(TEMP, name="t2", metric="sentinel_gpu_t2", sim_path=("t2",)), "a different part"),
    (dataclasses.replace(ECC, name="e2", metric="sentinel_gpu_e2", help="h", args=("NVML_MEMORY_ERROR_TYPE_CORRECTED",)), "overlaps"),
    (dataclasses.replace(TEMP, name="t2", metric="sentinel_gpu_t2", kind="histogram", args=(), sim_path=("t2",)), "counter or gauge"),
    (dataclasses.replace(TEMP, name="t2", metric="sentinel_gpu_t2", labels=(("gpu", "0"),), args=(), sim_path=("t2",)), "gpu/uuid"),
])
def test_contradicting_declarations_are_rejected(bad, message):
    with pytest.raises(FieldDeclarationError, match=message):
        nvml_fields.check(nvml_fields.NVML_FIELDS + (bad,))


def test_a_field_stored_over_a_key_the_simulator_keeps_is_rejected(monkeypatch):
    clash = NvmlField("lost", "nvmlDeviceGetFanSpeed", "sentinel_gpu_fan", "Fan")
    monkeypatch.setattr(nvml_fields, "NVML_FIELDS", nvml_fields.NVML_FIELDS + (clash,))
    with pytest.raises(FieldDeclarationError, match="a key the simulator keeps"):
        simulated.healthy_state(1)


def test_an_older_pynvml_name_is_used_when_the_current_one_is_missing():
    throttle = next(f for f in nvml_fields.NVML_FIELDS if f.name == "throttle_reasons")

    class OldPynvml:
        NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED

        @staticmethod
        def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
            return 0x4

    assert throttle.read(OldPynvml, object()) == 4.0

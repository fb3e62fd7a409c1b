"""Batched NVML reads (nvmlDeviceGetFieldValues) and the GPU recovery action: few calls per GPU
per poll, the same supported / unsupported / error handling per field, and the action exported
only where it is not "none"."""

from __future__ import annotations

import pynvml
from prometheus_client.exposition import generate_latest

from conftest import metric_value
from fake_pynvml import Err, FakePynvml
from sentinel.metrics import View, build_registry
from sentinel.readings import FIELDS, NodeReadings
from sentinel.sources import simulated
from sentinel.sources.nvml import NvmlSource
from sentinel.sources.simulated import CountingNvml

CALLS_PER_GPU_TARGET = 10


def started(nvml, **kw) -> NvmlSource:
    src = NvmlSource(nvml, deadline_seconds=kw.pop("deadline", 1.0), event_wait_ms=20, **kw)
    src.start()
    return src


def calls_per_gpu_per_poll(fake: FakePynvml, src: NvmlSource, polls: int = 5) -> float:
    fake.calls.clear()
    for _ in range(polls):
        src.poll()
    return sum(fake.calls.values()) / fake.n / polls


def test_batched_poll_reads_everything_in_at_most_10_calls_per_gpu():
    fake = FakePynvml(2)
    batched, per_call = started(fake), started(FakePynvml(2), batch=False)
    try:
        assert calls_per_gpu_per_poll(fake, batched) <= CALLS_PER_GPU_TARGET
        assert calls_per_gpu_per_poll(per_call.nvml, per_call) == len(FIELDS) - 1 + 2 * 4  # one call per field and counter
        a, b = batched.poll()[1], per_call.poll()[1]
        assert {k: v for k, v in a.values.items() if k != "recovery_action"} == b.values
        assert a.values["recovery_action"] == 0 and a.nvlink == b.nvlink and not a.errors
    finally:
        batched.close()
        per_call.close()


def test_simulated_h100_with_18_links_in_at_most_10_calls(tmp_path):
    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    counted = CountingNvml(simulated.SimulatedNvml(state, recheck_seconds=0))
    src = started(counted)
    try:
        counted.calls = 0
        for _ in range(3):
            (g, _) = src.poll()
        assert counted.calls / 2 / 3 <= CALLS_PER_GPU_TARGET
        assert len(g.nvlink) == 18 * 4 - 6 and not g.errors
        simulated.inject(state, 0, ["nvlink-crc=+7@15", "set=recovery_action:2", "ecc-sbe=+3"])
        g = src.poll()[0]
        assert g.nvlink[(15, "crc_flit")] == 7 and g.values["recovery_action"] == 2
        assert g.values["ecc_corrected_volatile"] == 3
    finally:
        src.close()


def test_one_field_unsupported_or_failing_inside_the_batch_is_that_fields_alone():
    fake = FakePynvml(2)
    fake.behaviour[("recovery_action", 0)] = Err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a driver < 570
    fake.behaviour[("pcie_replay", 1)] = Err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # by field id and by call
    src = started(fake)
    try:
        assert "recovery_action" in src.gpus[0].unsupported and "recovery_action" not in src.gpus[1].unsupported
        assert "pcie_replay" in src.gpus[1].unsupported
        fake.behaviour[("ecc_corrected_volatile", 1)] = Err(pynvml.NVML_ERROR_UNKNOWN)  # a real error, later
        g0, g1 = src.poll()
        assert "recovery_action" not in g0.values and "pcie_replay" not in g1.values  # left out, never 0
        assert g1.errors == {"ecc_corrected_volatile": pynvml.NVML_ERROR_UNKNOWN}
        assert "ecc_corrected_volatile" not in g1.values and g1.values["ecc_uncorrected_volatile"] == 0
        assert src.errors[("ecc_corrected_volatile", pynvml.NVML_ERROR_UNKNOWN)] == 1
        fake.behaviour.pop(("ecc_corrected_volatile", 1))
        assert "ecc_corrected_volatile" in src.poll()[1].values  # retried every poll
    finally:
        src.close()


def test_a_gpu_lost_inside_the_batch_is_lost():
    fake = FakePynvml(2)
    src = started(fake)
    try:
        fake.behaviour[("temperature_celsius", 1)] = Err(pynvml.NVML_ERROR_GPU_IS_LOST)
        fake.behaviour[("ecc_corrected_volatile", 1)] = Err(pynvml.NVML_ERROR_GPU_IS_LOST)
        g1 = src.poll()[1]
        assert g1.lost and g1.errors.get("ecc_corrected_volatile") == pynvml.NVML_ERROR_GPU_IS_LOST
    finally:
        src.close()


class NoFieldValues(FakePynvml):
    """A driver/binding without nvmlDeviceGetFieldValues."""

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def test_without_field_values_every_field_is_read_by_its_own_call():
    fake = NoFieldValues(1)
    src = started(fake)
    try:
        (g,) = src.poll()
        assert "recovery_action" in g.unsupported  # only a field value: unsupported here, not 0
        assert len(g.values) == len(FIELDS) - 1 and len(g.nvlink) == 8 and not g.errors
    finally:
        src.close()


def render(gpus, detail="fleet") -> str:
    view = View(NodeReadings(time=0.0, driver_version="570", gpus=tuple(gpus)), detail=detail)
    return generate_latest(build_registry(lambda: view)).decode()


def test_recovery_action_is_exported_only_where_it_is_not_none():
    fake = FakePynvml(2)
    fake.behaviour[("recovery_action", 1)] = 4  # NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    src = started(fake)
    try:
        gpus = src.poll()
        text = render(gpus)
        assert metric_value(text, "sentinel_gpu_recovery_action", gpu="1") == 4
        assert metric_value(text, "sentinel_gpu_recovery_action", gpu="0") is None  # none: no series
        assert metric_value(render(gpus, "full"), "sentinel_gpu_recovery_action", gpu="0") == 0
    finally:
        src.close()


def test_the_policy_migrates_on_drain_and_reset_or_reboot_and_snapshots_on_drain_p2p():
    from sentinel.config import PolicyConfig
    from sentinel.policy import Policy, PolicyState
    from sentinel.readings import GpuReading

    policy = Policy(PolicyConfig())
    got = {}
    for code in (0, 1, 2, 3, 4, 99):
        g = GpuReading(0, "GPU-0", "0000:18:00.0", values={"recovery_action": float(code)})
        _, trips = policy.decide(PolicyState(), NodeReadings(0.0, "570", (g,)), 1.0)
        got[code] = [(t.rule, t.action) for t in trips]
    assert got == {0: [], 1: [("recovery_action", "migrate")], 2: [("recovery_action", "migrate")],
                   3: [("recovery_action", "snapshot")], 4: [("recovery_action", "migrate")],
                   99: [("recovery_action", "alert")]}
    unsupported = GpuReading(0, "GPU-0", "0000:18:00.0", unsupported=frozenset({"recovery_action"}))
    assert not policy.rule_active(unsupported)[("recovery_action", 0)]


def test_a_hung_batched_call_is_bounded_by_the_deadline_like_a_single_call():
    """nvmlDeviceGetFieldValues that never returns costs one deadline, marks only its GPU hung,
    is counted once, and the GPU comes back when the call does."""
    import time

    fake = FakePynvml(2)
    src = started(fake, deadline=1.0)  # wide enough that "skipped at once" is not a race on a loaded host
    try:
        src.poll()
        fake.behaviour[("ecc_corrected_volatile", 1)] = "hang"  # a batched field: the whole call hangs
        t0 = time.monotonic()
        r = src.poll()
        assert time.monotonic() - t0 < 1.0 + 0.25 + 3.0  # the budget plus the hung-call grace, with slack
        assert r[1].hung and not r[0].hung and r[0].values["temperature_celsius"] == 40
        t0 = time.monotonic()
        assert src.poll()[1].hung and time.monotonic() - t0 < 1.0  # still stuck: skipped at once, not one more deadline
        assert src.errors[("deadline", pynvml.NVML_ERROR_TIMEOUT)] == 1
        fake.behaviour.pop(("ecc_corrected_volatile", 1))
        fake.release.set()
        end = time.monotonic() + 5
        while src.poll()[1].hung and time.monotonic() < end:
            time.sleep(0.05)
        assert not src.poll()[1].hung and src.poll()[1].values["ecc_corrected_volatile"] >= 0
    finally:
        fake.release.set()
        src.close()

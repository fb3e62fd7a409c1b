"""The real pynvml path, against a fake of the pynvml API (functions + pynvml's error classes)."""

from __future__ import annotations

import time

import pynvml
import pytest

from fake_pynvml import Err, FakePynvml
from sentinel.readings import FIELDS
from sentinel.sources.nvml import NvmlSource, NvmlUnavailable, normalize_bus_id


def started(fake: FakePynvml, **kw) -> NvmlSource:
    """The tests of the per-call budget (slow, hung, resumed reads) pass batch=False: one NVML call
    per field and counter, as on a driver without nvmlDeviceGetFieldValues. Batched reads under
    the same budget: tests/test_nvml_batch.py."""
    src = NvmlSource(fake, deadline_seconds=kw.pop("deadline", 0.3), event_wait_ms=20, **kw)
    src.start()
    return src


def test_identity_and_values_read_through_pynvml_api():
    fake = FakePynvml(2)
    fake.behaviour[("ecc_uncorrected_aggregate", 1)] = 3  # the fake returns it from nvmlDeviceGetTotalEccErrors
    fake.behaviour[("retired_pages_sbe", 1)] = 2  # returned as a list of 2 page addresses
    for name, value in zip(("correctable", "uncorrectable", "pending", "failure"), (5, 2, 1, 0)):
        fake.behaviour[(f"remapped_rows_{name}", 1)] = value  # one nvmlDeviceGetRemappedRows tuple
    src = started(fake)
    try:
        r = src.poll()
        assert [g.index for g in r] == [0, 1]
        g1 = r[1]
        assert g1.uuid == "GPU-fake-1" and g1.name == "NVIDIA A100-SXM4-80GB"
        assert g1.pci_bus_id == "0000:08:00.0"
        assert g1.values["ecc_uncorrected_aggregate"] == 3
        assert g1.values["retired_pages_sbe"] == 2
        assert (g1.values["remapped_rows_correctable"], g1.values["remapped_rows_uncorrectable"],
                g1.values["remapped_rows_pending"], g1.values["remapped_rows_failure"]) == (5, 2, 1, 0)
        assert g1.values["power_watts"] == pytest.approx(250.5)
        assert sorted({link for link, _ in g1.nvlink}) == [0, 1]  # only active links
        assert src.driver_version == "550.54.15"
        assert fake.init_calls == 1
    finally:
        src.close()
    assert fake.shutdown_calls == 1


def test_init_once_across_many_polls():
    fake = FakePynvml(1)
    src = started(fake)
    for _ in range(5):
        src.poll()
    src.close()
    assert fake.init_calls == 1


def test_not_supported_is_remembered_and_left_out():
    fake = FakePynvml(1)
    fake.behaviour[("pcie_replay", 0)] = Err(pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.behaviour[("remap_histogram_max", 0)] = Err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # the call all five read
    src = started(fake)
    try:
        g = src.poll()[0]
        assert "pcie_replay" in g.unsupported and "pcie_replay" not in g.values
        assert "remap_histogram_low" in g.unsupported
        assert not any(field == "pcie_replay" for field, _ in src.errors)  # not an error
        fake.behaviour[("pcie_replay", 0)] = 7  # never asked again after the probe
        assert "pcie_replay" not in src.poll()[0].values
    finally:
        src.close()


def test_error_is_counted_per_field_and_code_and_retried():
    fake = FakePynvml(1)
    fake.behaviour[("temperature_celsius", 0)] = Err(pynvml.NVML_ERROR_UNKNOWN)
    src = started(fake)
    try:
        g = src.poll()[0]
        assert "temperature_celsius" not in g.values
        assert g.errors["temperature_celsius"] == pynvml.NVML_ERROR_UNKNOWN
        assert src.errors[("temperature_celsius", pynvml.NVML_ERROR_UNKNOWN)] == 2  # probe + poll
        fake.behaviour[("temperature_celsius", 0)] = 55
        assert src.poll()[0].values["temperature_celsius"] == 55
    finally:
        src.close()


def test_gpu_lost():
    fake = FakePynvml(2)
    src = started(fake)
    try:
        fake.behaviour[("ecc_corrected_volatile", 1)] = Err(pynvml.NVML_ERROR_GPU_IS_LOST)
        r = src.poll()
        assert r[1].lost and not r[0].lost
        assert src.errors[("ecc_corrected_volatile", pynvml.NVML_ERROR_GPU_IS_LOST)] == 1
    finally:
        src.close()


def test_hung_call_hits_deadline_and_never_stalls_poll():
    fake = FakePynvml(2)
    src = started(fake, deadline=1.0)  # a deadline wide enough that "not waited for again" is not a race
    try:
        fake.behaviour[("temperature_celsius", 1)] = "hang"
        t0 = time.monotonic()
        r = src.poll()
        elapsed = time.monotonic() - t0
        assert r[1].hung and not r[0].hung
        assert r[0].values["temperature_celsius"] == 40
        assert elapsed < 5.0  # the hung call never returns by itself: the poll returned at its deadline
        # still stuck: the next poll skips GPU 1 at once instead of waiting again
        t0 = time.monotonic()
        r = src.poll()
        assert r[1].hung and time.monotonic() - t0 < 1.0  # less than one more deadline: not waited for again
        fake.behaviour.pop(("temperature_celsius", 1))
        fake.release.set()
        deadline = time.monotonic() + 3
        while src.poll()[1].hung and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not src.poll()[1].hung
    finally:
        fake.release.set()
        src.close()


EXPECTED_GPU1 = {"ecc_corrected_volatile": 5.0, "temperature_celsius": 61.0, "power_watts": 250.5, "pcie_link_gen": 4.0}


def test_slow_gpu_costs_one_budget_per_poll_and_is_not_hung():
    """Issue 11: 31 calls x 0.25 s under a 0.3 s deadline made one poll take 7 s, nothing flagged."""
    fake = FakePynvml(3)
    fake.behaviour[("ecc_corrected_volatile", 1)] = 5
    fake.behaviour[("temperature_celsius", 1)] = 61
    src = started(fake, deadline=0.3, batch=False)
    try:
        fake.delay[1] = 0.25  # every call on GPU 1 works, slowly: the 23 declared fields + 2 links x 4 counters
        t0 = time.monotonic()
        r = src.poll()
        elapsed = time.monotonic() - t0
        assert elapsed < 4.0  # one 0.3 s budget (+ a loaded host's scheduling), not 31 calls x 0.25 s = 7.75 s
        slow = r[1]
        assert slow.errors == {"poll_budget": pynvml.NVML_ERROR_TIMEOUT}
        assert not slow.hung and not slow.lost
        assert len(slow.values) == 1 and not slow.nvlink  # what it finished; the rest missing, not 0
        for name, value in slow.values.items():
            assert value == EXPECTED_GPU1.get(name, value) and name in src.gpus[1].supported
        for g in (r[0], r[2]):  # the other GPUs are complete and untouched
            assert not g.hung and g.errors == {}
            assert len(g.values) == len(FIELDS) - 1 and len(g.nvlink) == 8  # per call: no recovery action
        assert src.errors[("poll_budget", pynvml.NVML_ERROR_TIMEOUT)] == 1
        assert ("deadline", pynvml.NVML_ERROR_TIMEOUT) not in src.errors  # no call passed its deadline
    finally:
        fake.delay.clear()
        src.close()


def test_all_gpus_slow_still_one_budget_not_one_per_gpu():
    fake = FakePynvml(4)
    src = started(fake, deadline=0.3, batch=False)
    try:
        for i in range(4):
            fake.delay[i] = 0.25
        for _ in range(3):
            t0 = time.monotonic()
            r = src.poll()
            assert time.monotonic() - t0 < 1.0  # one 0.3 s budget for all, not 4 x 0.3 s one after another
            assert all(g.errors.get("poll_budget") == pynvml.NVML_ERROR_TIMEOUT and not g.hung for g in r)
            # every poll shows progress: the call cut off by the last budget is reported, not lost
            assert all(len(g.values) >= 1 for g in r), [g.values for g in r]
    finally:
        fake.delay.clear()
        src.close()


def test_slow_gpu_reads_every_field_over_a_few_polls_then_recovers_at_once():
    fake = FakePynvml(2)
    fake.behaviour[("ecc_corrected_volatile", 1)] = 5
    fake.behaviour[("temperature_celsius", 1)] = 61
    src = started(fake, deadline=0.2, batch=False)
    try:
        fake.behaviour[(f"nvlink{pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT}", 1)] = 9
        fake.delay[1] = 0.06  # about 3 of the 31 calls fit in one budget
        seen: dict[str, float] = {}
        for _ in range(40):
            t0 = time.monotonic()
            g = src.poll()[1]
            assert time.monotonic() - t0 < 1.0  # the 0.2 s budget, not the whole 31 x 0.06 s read
            assert not g.hung and g.errors == {"poll_budget": pynvml.NVML_ERROR_TIMEOUT}
            # a partial set of NVLink counters would make the policy's sum over links jump
            assert g.nvlink == {}
            seen.update(g.values)
            if len(seen) == len(FIELDS) - 1:  # per call: every field but the recovery action (a field value only)
                break
        # the read resumes after the last call that returned, so no field is starved
        assert set(seen) == set(src.gpus[1].supported)
        assert all(seen[name] == value for name, value in EXPECTED_GPU1.items())
        fake.delay.clear()  # fast again: the next poll is complete (after the one call still in flight)
        g = src.poll()[1]
        assert g.errors == {} and not g.hung and len(g.values) == len(FIELDS) - 1 and len(g.nvlink) == 8
        assert g.values["temperature_celsius"] == 61 and g.nvlink[(1, "crc_flit")] == 9
    finally:
        fake.delay.clear()
        src.close()


def test_hung_call_counted_once_and_reported_hung_every_poll_until_it_returns():
    fake = FakePynvml(2)
    src = started(fake, deadline=0.2, batch=False)
    try:
        fake.behaviour[("power_watts", 1)] = "hang"
        polls = [src.poll() for _ in range(4)]
        assert all(p[1].hung and not p[0].hung for p in polls)
        assert polls[0][1].values["temperature_celsius"] == 40  # read before the hung call: kept
        assert "power_watts" not in polls[0][1].values
        assert src.errors[("deadline", pynvml.NVML_ERROR_TIMEOUT)] == 1
        assert src.errors[("poll_budget", pynvml.NVML_ERROR_TIMEOUT)] == 4
    finally:
        fake.release.set()
        src.close()


def test_missing_library_is_unavailable():
    fake = FakePynvml(1)
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(NvmlUnavailable, match="nvmlInit failed"):
        NvmlSource(fake).start()


def test_xid_events_counted_per_gpu_and_xid():
    fake = FakePynvml(2)
    src = started(fake)
    try:
        fake.xid_queue += [(1, 79), (1, 79), (0, 13)]
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and src.poll()[1].xid_counts.get(79) != 2:
            time.sleep(0.02)
        r = src.poll()
        assert r[1].xid_counts == {79: 2} and r[0].xid_counts == {13: 1}
        events = src.drain_xid_events()
        assert [(e.gpu, e.xid) for e in events] == [(1, 79), (1, 79), (0, 13)]
        assert events[0].pci_bus_id == "0000:08:00.0"
    finally:
        src.close()


@pytest.mark.parametrize("raw,norm", [
    ("00000000:3B:00.0", "0000:3b:00.0"),
    ("0000:3b:00", "0000:3b:00.0"),
    ("3b:00.0", "0000:3b:00.0"),
    ("0001:c1:00.0", "0001:c1:00.0"),
])
def test_bus_id_normalisation(raw, norm):
    assert normalize_bus_id(raw) == norm


def test_daemon_keeps_its_rhythm_with_a_slow_simulated_gpu(tmp_path, start_daemon):
    """A real daemon on the simulated backend: `sentinel inject --gpu 1 slow=0.25` makes each of
    GPU 1's ~95 NVML calls take 0.25 s; the loop still writes status every interval + deadline."""
    import json
    import subprocess
    import sys

    from conftest import metric_value, wait_for
    from sentinel.sources import simulated

    interval, deadline = 0.2, 0.3
    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\npoll_interval_seconds = {interval}\nnvml_deadline_seconds = {deadline}\n"
                   "[ebpf]\nenabled = false\nkmsg_fallback = false\n")  # no Xid lines from the host's kernel log
    d = start_daemon("--simulate", str(state), "--config", str(cfg))
    r = subprocess.run([sys.executable, "-m", "sentinel", "inject", str(state), "--gpu", "1", "slow=0.25"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr

    def slow_seen():
        s = d.status
        return s if s["gpus"][1]["errors"] == {"poll_budget": pynvml.NVML_ERROR_TIMEOUT} else None

    first_slow = wait_for(slow_seen, what="GPU 1 reported over its poll budget")
    times: list[float] = [first_slow["time"]]
    statuses: list[dict] = [first_slow]
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        try:
            s = d.status
        except (OSError, json.JSONDecodeError):
            continue
        if not times or s["time"] != times[-1]:
            times.append(s["time"])
            statuses.append(s)
        time.sleep(0.01)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) >= 5, times
    # Each poll takes one budget (before: one poll took ~24 s): the rhythm is max(interval, deadline)
    # plus the loop's own work, never more than interval + deadline.
    assert max(gaps) <= interval + deadline, gaps
    assert sum(gaps) / len(gaps) < deadline + 0.1, gaps
    for s in statuses:
        slow, other = s["gpus"][1], s["gpus"][0]
        assert slow["errors"] == {"poll_budget": pynvml.NVML_ERROR_TIMEOUT} and not slow["hung"]
        assert len(slow["values"]) < len(FIELDS) and slow["health"] == "healthy"  # slow is not a failure
        assert other["errors"] == {} and len(other["values"]) == len(FIELDS) and not other["hung"]
    text = d.scrape()
    assert metric_value(text, "sentinel_source_poll_duration_seconds", source="nvml") < deadline + 0.1
    assert metric_value(text, "sentinel_gpu_nvml_hung", gpu="1") == 0
    assert metric_value(text, "sentinel_policy_trips_total", rule="nvml_hung", action="migrate") is None
    budget_code = str(pynvml.NVML_ERROR_TIMEOUT)
    assert metric_value(text, "sentinel_nvml_errors_total", field="poll_budget", code=budget_code) >= 5

    simulated.inject(state, 1, ["slow=0"])
    recovered = wait_for(lambda: d.status["gpus"][1] if d.status["gpus"][1]["errors"] == {} else None,
                         timeout=5, what="GPU 1 complete again")
    assert len(recovered["values"]) == len(FIELDS) and not recovered["hung"]
    assert d.stop() == 0


def test_simulated_slow_fault_through_the_nvml_source(tmp_path):
    from sentinel.sources import simulated

    state = tmp_path / "s.json"
    old = simulated.healthy_state(2)
    for gpu in old["gpus"]:
        del gpu["slow_seconds"]  # a state file written before the fault existed still loads
    simulated.write_state(state, old)
    for bad in ("slow=-1", "slow=abc", "slow=nan", "slow"):
        with pytest.raises(simulated.SimulatedStateError, match="slow: expects =SECONDS"):
            simulated.inject(state, 1, [bad])
    src = NvmlSource(simulated.SimulatedNvml(state, recheck_seconds=0), deadline_seconds=0.3, event_wait_ms=20, batch=False)
    src.start()
    try:
        assert simulated.inject(state, 1, ["slow=0.2"])["slow_seconds"] == 0.2
        t0 = time.monotonic()
        r = src.poll()
        # The bound that matters: the poll kept its budget instead of waiting out GPU 1's whole read
        # (every field and link at 0.2 s a call, over 20 s); the slack is for a host running two suites.
        assert time.monotonic() - t0 < 3.0
        assert r[1].errors == {"poll_budget": pynvml.NVML_ERROR_TIMEOUT} and not r[1].hung
        assert r[0].errors == {} and r[0].values["temperature_celsius"] == 38
        simulated.inject(state, 1, ["slow=0"])
        # Once the fault clears the read resumes where it was cut and completes: on a loaded host that
        # may take more than one 0.3 s budget, never more than a bounded number of polls.
        for _ in range(100):
            g = src.poll()[1]
            if g.errors == {}:
                break
        assert g.errors == {} and g.values["temperature_celsius"] == 38 and len(g.nvlink) == 18 * 4 - 6  # links 12-17 (NVLink 4) have no data-CRC counter
    finally:
        src.close()

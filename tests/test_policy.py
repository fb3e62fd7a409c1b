from __future__ import annotations

import dataclasses

from sentinel.config import PolicyConfig, parse
from sentinel.policy import Health, Policy, PolicyState, theil_sen
from sentinel.readings import GpuReading, NodeReadings, XidEvent
from sentinel_tools.scenarios import HEALTHY

BASE = {k: float(v) for k, v in HEALTHY.items() if k != "nvlink_crc"}


def reading(values=None, unsupported=(), xids=(), hung=False, lost=False, errors=None):
    vals = {**BASE, **(values or {})}
    for f in unsupported:
        vals.pop(f, None)
    g = GpuReading(index=0, uuid="GPU-x", pci_bus_id="0000:18:00.0", values=vals, unsupported=frozenset(unsupported),
                   hung=hung, lost=lost, errors=errors or {})
    return NodeReadings(time=0, driver_version="t", gpus=(g,), xid_events=tuple(xids))


def run(policy, seq, start=0.0, step=10.0, state=None):
    state = state or PolicyState()
    out = []
    for i, r in enumerate(seq):
        state, trips = policy.decide(state, r, start + i * step)
        out.extend((start + i * step, t) for t in trips)
    return state, out


def test_theil_sen_ignores_a_burst():
    pts = [(t, t * 0.1) for t in range(20)]
    pts[10] = (10, 500.0)  # one wild outlier
    assert abs(theil_sen(pts) - 0.1) < 1e-9


def test_one_big_jump_never_migrates():
    policy = Policy(PolicyConfig())
    seq = [reading() for _ in range(5)] + [reading({"retired_pages_sbe": 55}) for _ in range(30)]
    state, trips = run(policy, seq)
    assert not [t for _, t in trips if t.action == "migrate"]
    assert state.gpus[0].health != Health.PREDICTED_FAILURE


def test_unsupported_field_disables_only_its_rules_and_is_not_health_evidence():
    policy = Policy(PolicyConfig())
    r = reading(unsupported=["remapped_rows_failure", "remapped_rows_pending"])
    active = policy.rule_active(r.gpus[0])
    assert active[("remap_failure", 0)] is False and active[("remap_pending", 0)] is False
    assert active[("ecc_uncorrected", 0)] is True
    # a GPU in WATCH does not return to HEALTHY on polls whose fields failed to read
    hot = reading({"temperature_celsius": 95})
    state, _ = run(policy, [hot])
    assert state.gpus[0].health == Health.WATCH
    failed = reading(errors={"temperature_celsius": 999})
    state, _ = run(policy, [failed] * 10, start=10, state=state)
    assert state.gpus[0].health == Health.WATCH
    state, _ = run(policy, [reading()] * 3, start=200, state=state)
    assert state.gpus[0].health == Health.HEALTHY


def test_xid_overrides_and_skip_list():
    cfg = parse('[policy]\nxid_overrides = { "94" = "migrate", "79" = "alert" }\nxid_skip = [48]\n').policy
    policy = Policy(cfg)
    ev = lambda x: XidEvent(gpu=0, xid=x, source="nvml")
    _, trips = run(policy, [reading(xids=[ev(94)]), reading(xids=[ev(79)]), reading(xids=[ev(48)])])
    assert [(t.values["xid"], t.action) for _, t in trips] == [(94, "migrate"), (79, "alert")]


def test_same_xid_from_two_sources_counts_once_and_cooldown_blocks_repeat():
    policy = Policy(PolicyConfig())
    both = [XidEvent(gpu=0, xid=79, source="nvml"), XidEvent(gpu=0, xid=79, source="ebpf_xid")]
    _, trips = run(policy, [reading(xids=both), reading(xids=[XidEvent(gpu=0, xid=79, source="nvml")])])
    assert len(trips) == 1 and trips[0][1].action == "migrate" and trips[0][1].cause == "xid:79"


def test_application_xids_migrate_only_past_their_rate():
    policy = Policy(dataclasses.replace(PolicyConfig(), app_xid_max_per_hour=5))
    xid13 = XidEvent(gpu=0, xid=13, source="nvml")
    _, trips = run(policy, [reading(xids=[xid13] * 3), reading(xids=[xid13] * 3)])
    assert [t.action for _, t in trips if t.rule == "app_xid_rate"] == ["migrate"]
    assert all(t.action == "alert" for _, t in trips if t.rule == "xid")


def test_counter_going_backwards_is_a_reset_not_a_trip():
    policy = Policy(PolicyConfig())
    seq = ([reading({"ecc_uncorrected_volatile": 0})] + [reading({"ecc_uncorrected_volatile": 2})] * 3
           + [reading({"ecc_uncorrected_volatile": 0})] * 3)
    state, trips = run(policy, seq)
    # the increase trips once; the way back to 0 (a GPU reset) is counted as a reset and trips nothing
    assert [t.rule for _, t in trips] == ["ecc_uncorrected"] and state.gpus[0].resets == 1
    # and a genuinely new error after the reset still trips
    state, trips = run(policy, [reading({"ecc_uncorrected_volatile": 1})], start=100_000, state=state)  # past the cooldown
    assert [t.rule for _, t in trips] == ["ecc_uncorrected"]


def test_decide_is_pure():
    policy = Policy(PolicyConfig())
    s0 = PolicyState()
    r = reading({"ecc_uncorrected_volatile": 0})
    a = policy.decide(s0, r, 0.0)
    b = policy.decide(s0, r, 0.0)
    assert a == b and s0 == PolicyState()


def test_trip_explains_itself():
    policy = Policy(PolicyConfig())
    seq = [reading({"retired_pages_sbe": float(v)}) for v in range(20, 64)]
    _, trips = run(policy, seq, step=60.0)
    trend = next(t for _, t in trips if t.rule == "trend")
    log = trend.as_log()
    assert log["gpu"] == 0 and log["rule"] == "trend" and log["forecast_seconds"] < 600 and log["lead_time_seconds"] == 600
    assert log["values"]["limit"] == 63 and "retired_pages" in log["message"]

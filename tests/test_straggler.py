"""Straggler scores, causes, and the act-only-when-it-pays rule."""

import pytest

from sentinel.straggler import (GpuEvidence, StepSample, StragglerConfigError, StragglerSettings, StragglerTracker,
                                causes, comparable, decide, window_scores)


def test_relative_and_individual_scores():
    s = window_scores({"a": [1.0, 1.0, 1.1], "b": [1.0, 1.0], "c": [1.5, 1.5, 1.6]}, best={"c": 1.0})
    assert s["c"].relative == pytest.approx(1.5) and s["c"].individual == pytest.approx(1.5)
    assert s["a"].relative == pytest.approx(1.0) and s["a"].individual == pytest.approx(1.0)


def test_one_slow_window_is_not_a_straggler_two_are():
    t = StragglerTracker(StragglerSettings(min_windows=2))  # two in a row (default 3)
    healthy = {"a": [1.0] * 10, "b": [1.0] * 10, "c": [1.0] * 10}
    assert t.observe(healthy) == []
    slow = {**healthy, "c": [1.5] * 10}
    assert t.observe(slow) == []
    assert t.observe(healthy) == []  # the run is broken
    assert t.observe(slow) == []
    (s,) = t.observe(slow)
    assert s.node == "c" and s.relative == pytest.approx(1.5) and s.individual == pytest.approx(1.5)


def test_a_job_wide_slowdown_makes_no_straggler():
    t = StragglerTracker()
    for factor in (1.0, 2.0, 2.0, 2.0):
        assert t.observe({n: [factor] * 10 for n in "abc"}) == []


def test_warmup_and_snapshot_steps_are_not_scored():
    st = StragglerSettings(warmup_steps=5)
    samples = [StepSample(i, 9.0, 9.0, since_start=i + 1) for i in range(5)]  # compile, caches
    samples += [StepSample(5, 8.0, 8.0, snapshot=True, since_start=6)]  # a checkpoint-heavy step
    samples += [StepSample(i, 1.0, 1.0, since_start=i + 1) for i in range(6, 10)]
    kept = comparable(samples, st)
    assert [s.step for s in kept] == [6, 7, 8, 9]


def test_causes_say_why():
    ev = [GpuEvidence(0, clock_event_reasons=0x1),  # idle: not a cause
          GpuEvidence(3, clock_event_reasons=0x8 | 0x80, pcie_replays=120, pcie_link_width=8, pcie_link_width_max=16,
                      nvlink_errors=0, minutes=2.0)]
    assert causes(ev) == ["GPU 3: hw_slowdown", "GPU 3: hw_power_brake", "GPU 3: 60 PCIe replays/min",
                          "GPU 3: PCIe x8 of x16"]
    assert causes([GpuEvidence(0)]) == []  # nothing read: nothing claimed


def test_hand_over_only_when_it_pays():
    # 1.5x slower, 1.5 s steps (healthy 1.0 s), hand-over 60 s: 0.5 s/step saved
    assert decide(1.5, 1.5, 1000, 60.0).action == "migrate"
    small = decide(1.5, 1.5, 100, 60.0)
    assert small.action == "alert" and small.saving_seconds == pytest.approx(50.0)
    assert decide(1.5, 1.5, None, 60.0).action == "alert"
    assert decide(1.05, 1.05, 1000, 60.0).action == "alert"  # 50 s saved < 61 s


def test_scheduling_noise_below_the_threshold_is_not_a_straggler():
    t = StragglerTracker()
    for _ in range(10):
        assert t.observe({"a": [0.0726], "b": [0.0726], "c": [0.0894]}) == []  # 1.23x: measured noise under load


def test_bad_settings_name_the_key():
    with pytest.raises(StragglerConfigError, match="straggler.relative_threshold"):
        StragglerSettings(relative_threshold=1.0)
    with pytest.raises(StragglerConfigError, match="straggler.window_steps"):
        StragglerSettings(window_steps=0)


def test_a_slow_host_link_is_told_from_its_neighbours_by_its_links_both_ways():
    """#41 slow-link: the replica ring 0->1->2->3->0, node1's link shaped. The links into and out of
    node1 are slow; node0 (out to node1) and node2 (in from node1) have one fast link each."""
    from sentinel.straggler import LINK_RELATIVE_THRESHOLD, node_link_seconds

    fast, slow = 0.004, 0.5
    ring = [("node0", "node1", slow), ("node1", "node2", slow), ("node2", "node3", fast), ("node3", "node0", fast)]
    links = node_link_seconds(ring)
    assert links == {"node0": fast, "node1": slow, "node2": fast, "node3": fast}
    tracker = StragglerTracker(StragglerSettings(relative_threshold=LINK_RELATIVE_THRESHOLD))
    named = [tracker.observe({n: [v] for n, v in links.items()}) for _ in range(3)]
    assert named[1] == [] and [s.node for s in named[2]] == ["node1"] and named[2][0].relative > 50
    three = node_link_seconds([("node0", "node1", slow), ("node1", "node2", slow), ("node2", "node0", fast)])
    assert max(three, key=three.get) == "node1" and three["node1"] / sorted(three.values())[1] > 50
    # two nodes share one link both ways: neither end stands out
    assert node_link_seconds([("node0", "node1", slow), ("node1", "node0", slow)]) == {"node0": slow, "node1": slow}
    # a link within a node, or one not measured, is no evidence
    assert node_link_seconds([("node0", "node0", slow), ("node0", "node1", float("nan"))]) == {}

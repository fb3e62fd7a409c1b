"""The slow drill's verdict (sentinel_tools.drill_verdict): a straggler's hand-over is judged by the
replacement's compute time against the other nodes', from the job's progress exchange, never by
wall-clock steps that other processes on the host slow down (#47 item 5)."""

from __future__ import annotations

from sentinel_tools.drill_verdict import job_health

FAULT, TRIP, FIRST = 9.95, 12.0, 18.0  # between steps: no float lands on them
MIG = {"rule": "straggler", "reason": "node1 1.50x the job's median compute; GPU 0: hw_slowdown"}


def slow_drill(*, step_after: float, spare_compute: float, others_after: float, windows_after: bool = True,
               trip: float = TRIP) -> list[dict]:
    """A 3-node job's progress log: 0.1 s steps, node1 1.5x slower from FAULT (0.15 s steps) until
    the trip, spare1 in its place from FIRST on with ``step_after`` steps; an exchange every 5 steps."""
    events, t, step, slow_windows = [], 0.0, 0, 0
    while t < 40.0:
        if trip < t < FIRST:
            t = FIRST
        slowed = FAULT <= t < trip
        nodes = ("node0", "spare1", "node2") if t >= FIRST else ("node0", "node1", "node2")
        events.append({"event": "step", "time": t, "step": step})
        if step % 5 == 0:
            if t >= FIRST:
                compute = {"node0": others_after, "spare1": spare_compute, "node2": others_after}
            else:
                compute = {n: 0.08 * (1.5 if slowed and n == "node1" else 1.0) for n in nodes}
            slow_windows += slowed
            named = ["node1"] if slowed and slow_windows >= 3 else []  # the rule's 3 windows in a row
            if t < FIRST or windows_after:
                events.append({"event": "exchange", "time": t + 0.001, "step": step, "compute": compute,
                               "stragglers": named})
        t += step_after if t >= FIRST else (0.15 if slowed else 0.1)
        step += 1
    return events


def verdict(events: list[dict], trip: float = TRIP) -> dict:
    return job_health("slow", events, {"tripped": trip}, MIG, FAULT, FIRST, failed="node1", replacement="spare1")


def test_a_clean_hand_over_passes_though_the_load_slowed_every_step_after_it():
    # the incident: named in 14 steps, 0 lost, bitwise equal, but the host's load made every step after
    # the hand-over 1.3x the one before; every node's compute rose alike, the spare's with them
    events = slow_drill(step_after=0.13, spare_compute=0.104, others_after=0.104)
    out = verdict(events)
    assert out["after_over_before"] == 1.3  # the wall clock says slower ...
    assert out["failed_relative_compute"] == 1.5 and out["replacement_relative_compute"] == 1.0
    assert out["steps_to_detect"] == 10  # the job named node1 at its third slow window, step 110
    assert out["ok"], out  # ... the hand-over took the straggler out all the same


def test_a_replacement_that_computes_as_slowly_as_the_straggler_fails_whatever_the_wall_clock():
    events = slow_drill(step_after=0.1, spare_compute=0.12, others_after=0.08)
    out = verdict(events)
    assert out["after_over_before"] == 1.0 and out["replacement_relative_compute"] == 1.5
    assert not out["ok"]


def test_no_exchange_after_the_hand_over_is_no_evidence_of_a_good_one():
    out = verdict(slow_drill(step_after=0.1, spare_compute=0.08, others_after=0.08, windows_after=False))
    assert out["replacement_windows"] == 0 and out["replacement_relative_compute"] is None and not out["ok"]


def test_detection_is_counted_in_the_job_s_steps_to_the_window_that_named_the_node_not_to_the_daemon_s_poll():
    # the job named node1 at step 110, 10 steps after the fault; the daemon's trip came at its
    # poll 1.3 s later, 23 steps after the fault in all: the job's detection held its bound
    events = slow_drill(step_after=0.1, spare_compute=0.08, others_after=0.08, trip=13.4)
    out = verdict(events, trip=13.4)
    assert out["steps_to_detect"] == 10 and out["steps_to_trip"] == 23
    assert out["ok"], out
